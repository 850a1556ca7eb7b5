"""Rollout throughput: hfq RolloutEngine vs transformers generate / continuous batching (device).

    python benchmarks/rollout.py --check            # GPU correctness (graphs on) + quick batch-8 timing
    python benchmarks/rollout.py                    # the table: Qwen2.5-7B-shaped random init, prompt 256

Writes benchmarks/results/rollout.json (run facts, rows) and rollout.md (or --out DIR, --name NAME).
Rows: engine (generate|generate_static_compiled|transformers_cb|hfq), weights (bf16|nvfp4|nvfp4+lora|nf4),
model, batch, prompt_len, new_tokens, tok_s, peak_gb; EOS is disabled so every row makes new_tokens tokens.
Baselines that would take minutes at 2048 tokens run fewer tokens (their row says how many): their
per-token cost does not depend on the length much (they are launch-bound).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import add_args, run_facts, write  # noqa: E402

from hfq.rollout import RolloutEngine  # noqa: E402

T0 = time.time()
OUT_DIR = None  # results are rewritten after every row, so a killed run still leaves its numbers
NAME = "rollout"  # file stem of the results (a partial run gets its own name: the full table stays)


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def qwen7b_config(layers=28):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=layers,
                       num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                       rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0,
                       bos_token_id=1, eos_token_id=2)


def build_model(cfg, dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return m.eval()


def decoder_linears(model):
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for n in names:
                if hasattr(parent, n):
                    yield parent, n


def to_nvfp4(model):
    from hfq.nvfp4 import NVFP4Linear

    mods = {}
    for parent, n in list(decoder_linears(model)):
        lin = getattr(parent, n)
        mods[(id(parent), n)] = NVFP4Linear.from_linear(lin)
    return mods


def to_nf4(model):
    import bitsandbytes as bnb

    mods = {}
    for parent, n in list(decoder_linears(model)):
        lin = getattr(parent, n)
        q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                              compute_dtype=torch.bfloat16, quant_type="nf4", device="meta")
        q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, quant_type="nf4")
        if lin.bias is not None:
            q.bias = torch.nn.Parameter(lin.bias.data.clone(), requires_grad=False)
        mods[(id(parent), n)] = q.cuda()
    return mods


def swap(model, mods):
    for parent, n in list(decoder_linears(model)):
        setattr(parent, n, mods[(id(parent), n)])


def prompts(batch, plen, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, plen), generator=g)


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t, out


def run_hfq(engine, batch, plen, new, vocab, sample=True, runs=None):
    """(tok/s, seconds) of one generate; with a list `runs`: the median of 3 generates, each run's tok/s appended."""
    ids = prompts(batch, plen, vocab).cuda()
    kw = dict(max_new_tokens=new, temperature=1.0 if sample else 0, eos_token_ids=[], seed=1)
    engine.warmup(batch, plen, new, temperature=kw["temperature"])  # captures every KV bucket of the run
    engine.generate(ids, max_new_tokens=8, temperature=kw["temperature"], eos_token_ids=[], seed=1)
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(1 if runs is None else 3):
        dt, out = timed(lambda: engine.generate(ids, **kw))
        assert out.completion_ids.shape == (batch, new), out.completion_ids.shape
        times.append(dt)
    if runs is not None:
        runs.extend(round(batch * new / t, 1) for t in times)
    dt = sorted(times)[len(times) // 2]
    return batch * new / dt, dt


def run_generate(model, batch, plen, new, vocab, **extra):
    ids = prompts(batch, plen, vocab).cuda()
    am = torch.ones_like(ids)
    kw = dict(max_new_tokens=new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
              pad_token_id=0, eos_token_id=None, **extra)
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=am, **{**kw, "max_new_tokens": 4})
        torch.cuda.reset_peak_memory_stats()
        dt, out = timed(lambda: model.generate(input_ids=ids, attention_mask=am, **kw))
    assert out.shape[1] == plen + new
    return batch * new / dt, dt


def run_cb(model, batch, plen, new, vocab):
    from transformers import GenerationConfig

    ids = prompts(batch, plen, vocab).tolist()
    gc = GenerationConfig(max_new_tokens=new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                          eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate_batch(ids[:1], generation_config=GenerationConfig(**{**gc.to_dict(), "max_new_tokens": 4}))
        torch.cuda.reset_peak_memory_stats()
        dt, out = timed(lambda: model.generate_batch(ids, generation_config=gc, progress_bar=False))
    n_tok = sum(len(o.generated_tokens) for o in out.values())
    return n_tok / dt, dt, n_tok


def peak_gb():
    return round(torch.cuda.max_memory_allocated() / 2**30, 2)


# ---------------------------------------------------------------------------------------------- check mode
def check(results):
    """GPU correctness with graphs on, graph-vs-eager, in-place updates under graphs, quick timings."""
    from peft import LoraConfig, get_peft_model

    from hfq.tiny import tiny_model

    torch.backends.cuda.matmul.allow_tf32 = False
    P = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27], [40], [41, 42]]
    ok = True

    def hf(m, new):
        ids, am = RolloutEngine._left_pad(P, None, 0)
        out = m.generate(input_ids=ids.cuda(), attention_mask=am.cuda(), max_new_tokens=new, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
        return out[:, ids.shape[1]:].cpu()

    for arch in ("qwen2", "qwen3", "llama", "mistral"):
        m = tiny_model(arch, seed=1, hidden=128, intermediate=256, layers=3).cuda()
        for fused in (True, False):
            e = RolloutEngine(m, max_batch=8, max_seq_len=160, kv_block=32, fused_kernels=fused)
            got = e.generate(P, max_new_tokens=120, temperature=0, eos_token_ids=[]).completion_ids.cpu()
            same = torch.equal(got, hf(m, 120))
            ok &= same and e.use_graphs and e.adapter.fused == fused
            log(f"check greedy==generate fp32 cuda-graph {arch} fused={e.adapter.fused}: {same} "
                f"(graphs={e.use_graphs}, {len(e._graphs)} captured)")
    # graph vs eager, sampling on, seeded: identical tokens
    m = tiny_model("qwen2", seed=2, hidden=128, intermediate=256, layers=3).cuda()
    kw = dict(max_new_tokens=100, temperature=0.9, top_p=0.9, top_k=30, min_p=0.02, eos_token_ids=[], seed=3,
              return_logprobs=True)
    a = RolloutEngine(m, max_batch=8, max_seq_len=160, kv_block=32).generate(P, **kw)
    b = RolloutEngine(m, max_batch=8, max_seq_len=160, kv_block=32, graph_mode="eager").generate(P, **kw)
    same = torch.equal(a.completion_ids, b.completion_ids) and torch.allclose(a.logprobs, b.logprobs, atol=1e-5)
    ok &= same
    log(f"check sampled graph==eager: {same}")
    # LoRA unmerged + in-place updates (LoRA step, AQN norm noise) seen by the captured graphs
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"], init_lora_weights=False)
    pm = get_peft_model(tiny_model("llama", seed=4, hidden=128, intermediate=256, layers=3), cfg).cuda().eval()
    e = RolloutEngine(pm, max_batch=8, max_seq_len=160, kv_block=32)
    r1 = e.generate(P, max_new_tokens=60, temperature=0, eos_token_ids=[]).completion_ids.cpu()
    s1 = torch.equal(r1, hf(pm, 60)) and e.adapter.fused
    n_graphs = len(e._graphs)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n or "layernorm" in n:
                p.add_(torch.randn_like(p) * 0.3)
    r2 = e.generate(P, max_new_tokens=60, temperature=0, eos_token_ids=[]).completion_ids.cpu()
    s2 = torch.equal(r2, hf(pm, 60)) and not torch.equal(r1, r2) and len(e._graphs) == n_graphs
    ok &= s1 and s2
    log(f"check LoRA greedy==generate: {s1}; after in-place LoRA/norm update, no re-capture: {s2}")
    try:
        from hfq.nvfp4 import NVFP4Linear  # noqa: F401

        m = tiny_model("qwen2", seed=5, hidden=128, intermediate=256, layers=3).cuda().to(torch.bfloat16)
        swap(m, to_nvfp4(m))
        e = RolloutEngine(m, max_batch=8, max_seq_len=160, kv_block=32)
        got = e.generate(P, max_new_tokens=60, temperature=0, eos_token_ids=[]).completion_ids.cpu()
        ref = hf(m, 60)
        agree = (got == ref).float().mean().item()
        log(f"check NVFP4 bf16 greedy vs generate: token agreement {agree:.3f} (graphs={e.use_graphs}; bf16 "
            f"reductions differ in order, so late divergence is expected)")
    except Exception as ex:  # noqa: BLE001
        log(f"check NVFP4 failed: {type(ex).__name__}: {ex}")
        ok = False
    results["check_ok"] = bool(ok)
    return ok


def quick_timings(results, layers):
    cfg = qwen7b_config(layers)
    model = build_model(cfg)
    log("7B-shaped model built")
    V = cfg.vocab_size
    rows = results.setdefault("quick", [])
    eng = RolloutEngine(model, max_batch=8, max_seq_len=512, kv_block=256)
    for sample in (False, True):
        tok_s, dt = run_hfq(eng, 8, 256, 256, V, sample=sample)
        rows.append(dict(engine="hfq", weights="bf16", batch=8, new_tokens=256, sampling=sample, tok_s=round(tok_s, 1)))
        log(f"hfq bf16 b8 256 new sampling={sample}: {tok_s:.1f} tok/s")
        save(results, OUT_DIR)
    split = step_split(eng, V)
    split.update(linear_floor(model))
    results["split_bf16_b8"] = split
    log("split", split)
    tok_s, dt = run_generate(model, 8, 256, 64, V)
    rows.append(dict(engine="generate", weights="bf16", batch=8, new_tokens=64, tok_s=round(tok_s, 1)))
    log(f"generate bf16 b8 64 new: {tok_s:.1f} tok/s")
    save(results, OUT_DIR)
    try:
        t = time.time()
        run_generate(model, 8, 256, 8, V, cache_implementation="static")  # compiles (reduce-overhead)
        log(f"static+compile warm-up {time.time() - t:.1f}s")
        tok_s, dt = run_generate(model, 8, 256, 128, V, cache_implementation="static")
        rows.append(dict(engine="generate_static_compiled", weights="bf16", batch=8, new_tokens=128,
                         tok_s=round(tok_s, 1), compile_s=round(time.time() - t - dt, 1)))
        log(f"generate static+torch.compile(reduce-overhead) b8 128 new: {tok_s:.1f} tok/s")
    except Exception as ex:  # noqa: BLE001
        log(f"static compiled generate failed: {type(ex).__name__}: {ex}")


@torch.no_grad()
def linear_floor(model, b=8):
    """Graph-replay time of only the decoder linears + lm_head at M=b (the bandwidth floor of a step),
    and the bytes they read."""
    lins = [getattr(p, n) for p, n in decoder_linears(model)] + [model.lm_head]
    xs = {m.in_features: torch.randn(b, m.in_features, device="cuda", dtype=torch.bfloat16) for m in lins}
    nbytes = sum(sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers())) for m in lins)
    for m in lins:
        m(xs[m.in_features])
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for m in lins:
            m(xs[m.in_features])
    g.replay()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    ms = s.elapsed_time(e) / 20
    return {"linears_only_ms": round(ms, 3), "linear_bytes_gb": round(nbytes / 1e9, 2),
            "linears_tb_s": round(nbytes / ms / 1e9, 2)}


@torch.no_grad()
def decode_graph(eng, b, flags):
    """The engine's captured decode graph for batch b (400 cache columns) and sampler flags, its state pointed at
    column 300 / step 1; None where capture failed."""
    key = (b, eng._kv_bucket(400), flags)
    if key not in eng._graphs:
        eng._graphs[key] = eng._capture(key)
    g = eng._graphs[key]
    if g is not None:
        eng.col.fill_(300)
        eng.step.fill_(1)
    return g


def step_split(eng, V, b=8, with_eager=True, greedy_only=False):
    """Per decode step: full graph replay (greedy / sampling), sampler alone in a graph, host loop overhead."""
    from hfq.rollout.sampling import SamplerFlags, sample

    out = {}
    kinds = (("greedy", SamplerFlags(greedy=True)), ("sample", SamplerFlags()),
             ("sample_topp_topk_lp", SamplerFlags(top_k=True, top_p=True, logprobs=True)))
    for flags_name, flags in kinds[:1] if greedy_only else kinds:
        g = decode_graph(eng, b, flags)
        if g is None:
            out["graphs"] = False
            break
        for _ in range(3):
            g.replay()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(50):
            eng.col.fill_(300)
            eng.step.fill_(1)
            g.replay()
        e.record()
        torch.cuda.synchronize()
        out[f"replay_ms_{flags_name}"] = round(s.elapsed_time(e) / 50, 3)
        if flags.greedy and with_eager:
            eng.col.fill_(300)
            eng.step.fill_(1)
            s.record()
            for _ in range(10):
                eng._decode_body(b, eng._kv_bucket(400), flags)
                eng.col.fill_(300)
                eng.step.fill_(1)
            e.record()
            torch.cuda.synchronize()
            out["eager_step_ms_greedy"] = round(s.elapsed_time(e) / 10, 3)
        logits = torch.randn(b, V, device="cuda")
        args = (torch.ones(b, 1, device="cuda"), torch.full((b, 1), 50, device="cuda"),
                torch.full((b, 1), 0.9, device="cuda"), torch.zeros(b, 1, device="cuda"),
                torch.zeros(b, 2, dtype=torch.long, device="cuda"), torch.zeros(1, dtype=torch.long, device="cuda"),
                torch.arange(V, device="cuda"))
        if not flags.greedy:
            sg = torch.cuda.CUDAGraph()
            sample(logits, flags, *args)
            with torch.cuda.graph(sg):
                sample(logits, flags, *args)
            s.record()
            for _ in range(50):
                sg.replay()
            e.record()
            torch.cuda.synchronize()
            out[f"sampler_ms_{flags_name}"] = round(s.elapsed_time(e) / 50, 3)
    return out


def switch_ab(eng, V, set_on, keep, on_name, off_name, rounds=3):
    """Greedy decode-step replay with a switch on vs off (`set_on(bool)`, graphs recaptured each time),
    interleaved over `rounds`, the switch set back to `keep` after: {"replay_ms": {on_name: [...], off_name:
    [...]}, "speedup_<on_name>": median off / median on}."""
    ms = {on_name: [], off_name: []}
    try:
        for _ in range(rounds):
            for name, on in ((on_name, True), (off_name, False)):
                set_on(on)
                eng.invalidate()
                t = step_split(eng, V, with_eager=False, greedy_only=True).get("replay_ms_greedy")
                if t is None:
                    return {"error": f"no graph captured for {name}"}
                ms[name].append(t)
    finally:
        set_on(keep)
        eng.invalidate()
    med = {k: sorted(v)[len(v) // 2] for k, v in ms.items()}
    return {"replay_ms": {k: sorted(v) for k, v in ms.items()},
            f"speedup_{on_name}": round(med[off_name] / med[on_name], 3)}


def nvfp4_grouping(eng, V, rounds=3):
    """NVFP4 q/k/v and gate/up as one grouped Gluon launch each (the default) vs one launch (+ split-K reduce) per
    linear (DecodeFusions.group_nvfp4 off)."""
    fz = eng.adapter.fusions
    return switch_ab(eng, V, lambda on: setattr(fz, "group_nvfp4", on), fz.group_nvfp4,
                     "grouped", "per_linear", rounds)


def lora_reduce_ab(eng, V, rounds=3):
    """NVFP4+LoRA: the base linears' split-K reduce done by the LoRA expand's launch (the default) vs a reduce and
    an expand launch (DecodeFusions.lora_in_reduce off)."""
    fz = eng.adapter.fusions
    return switch_ab(eng, V, lambda on: setattr(fz, "lora_in_reduce", on), fz.lora_in_reduce,
                     "in_expand", "separate", rounds)


def lora_stream_ab(eng, V, rounds=3):
    """NVFP4+LoRA: the LoRA shrinks on a side stream beside the base GEMVs, step captured without PDL (the default)
    vs on the GEMVs' stream with PDL (DecodeFusions.lora_stream off)."""
    fz = eng.adapter.fusions
    return switch_ab(eng, V, lambda on: setattr(fz, "lora_stream", on), fz.lora_stream,
                     "side_stream", "same_stream", rounds)


def kernel_profile(eng, V, steps=20, top=14):
    """torch.profiler over `steps` replays of the greedy batch-8 decode graph: per kernel (name cut to 60 chars)
    GPU us per step and launches per step, the largest first, and the step's summed kernel time."""
    from torch.profiler import ProfilerActivity, profile

    from hfq.rollout.sampling import SamplerFlags

    g = decode_graph(eng, 8, SamplerFlags(greedy=True))
    if g is None:
        return {"error": "no graph captured"}
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            g.replay()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            r = rows.setdefault(e.name[:60], [0.0, 0])
            r[0] += e.device_time_total
            r[1] += 1
    out = sorted(((k, round(v[0] / steps, 1), round(v[1] / steps, 1)) for k, v in rows.items()), key=lambda t: -t[1])
    return {"kernel_us_per_step": round(sum(t[1] for t in out), 1),
            "top": [{"kernel": k, "us": us, "launches": n} for k, us, n in out[:top]]}


def pdl_ab(eng, V, rounds=3):
    """Decode graph captured with programmatic dependent launch of the decode kernels (the default on sm_90+) vs
    without (DecodeFusions.pdl off)."""
    fz = eng.adapter.fusions
    return switch_ab(eng, V, lambda on: setattr(fz, "pdl", on), fz.pdl, "pdl", "no_pdl", rounds)


# ---------------------------------------------------------------------------------------------- table mode
def bench(results, batches, new, plen, budget_s, layers, weights_list):
    cfg = qwen7b_config(layers)
    model = build_model(cfg)
    V = cfg.vocab_size
    name = "qwen2.5-7b-shaped" if layers == 28 else f"qwen2.5-7b-shaped-{layers}L"
    rows = results["rows"]
    skipped = results.setdefault("not_run", [])

    def add(**r):
        r.update(model=name, prompt_len=plen)
        rows.append(r)
        log(r)
        save(results, OUT_DIR)

    def left():
        return budget_s - (time.time() - T0)

    eng = RolloutEngine(model, max_batch=max(batches), max_seq_len=plen + new, kv_block=256)
    for b in batches:
        if "bf16" in weights_list:
            if left() < 30:
                skipped.append(f"hfq bf16 b{b}")
                continue
            tok_s, dt = run_hfq(eng, b, plen, new, V)
            add(engine="hfq", weights="bf16", batch=b, new_tokens=new, tok_s=round(tok_s, 1), peak_gb=peak_gb(),
                graphs=eng.use_graphs, fused=eng.adapter.fused)
            if b == 8 and "split_bf16_b8" not in results:
                results["split_bf16_b8"] = {**step_split(eng, V), **linear_floor(model),
                                            "step_ms_measured": round(dt / new * 1000, 3),
                                            "fused": eng.adapter.fused}
                log("split", results["split_bf16_b8"])
                from hfq_kernels import skinny_gemm as _gemm

                ids = prompts(b, plen, V).cuda()
                results["split_bf16_b8"]["prefill_ms"] = round(1000 * min(
                    timed(lambda: eng.generate(ids, max_new_tokens=1, eos_token_ids=[], seed=1))[0]
                    for _ in range(3)), 2)

                results["gemm_tuning_b8"] = {e["key"]: {"timings": e["timings"], "best": e["best"]}
                                              for e in _gemm.TUNER.log + _gemm.GROUP_TUNER.log}
                log("gemm tuning", results["gemm_tuning_b8"])
                if eng.adapter.gemm:  # fused kernels, cuBLAS for every linear
                    eng.adapter.gemm = False
                    eng.invalidate()
                    results["split_bf16_b8_cublas"] = step_split(eng, V, with_eager=False)
                    log("split fused+cublas", results["split_bf16_b8_cublas"])
                    eng.adapter.gemm = True
                    eng.invalidate()
                if eng.adapter.fused:  # the same engine with the model's own modules, for comparison
                    eng.adapter.fused = False
                    gm, eng.adapter.gemm = eng.adapter.gemm, False
                    eng.invalidate()
                    results["split_bf16_b8_unfused"] = step_split(eng, V)
                    log("split unfused", results["split_bf16_b8_unfused"])
                    eng.adapter.fused, eng.adapter.gemm = True, gm
                    eng.invalidate()
        gen_new = min(new, 128 if b <= 8 else 64)
        if "generate" in weights_list and left() > 60:
            tok_s, dt = run_generate(model, b, plen, gen_new, V)
            add(engine="generate", weights="bf16", batch=b, new_tokens=gen_new, tok_s=round(tok_s, 1), peak_gb=peak_gb())
        elif "generate" in weights_list:
            skipped.append(f"generate b{b}")
        if "cb" in weights_list and left() > 60:
            try:
                tok_s, dt, n_tok = run_cb(model, b, plen, gen_new * 2, V)
                add(engine="transformers_cb", weights="bf16", batch=b, new_tokens=gen_new * 2,
                    tok_s=round(tok_s, 1), peak_gb=peak_gb(), tokens_made=n_tok)
            except Exception as ex:  # noqa: BLE001
                add(engine="transformers_cb", weights="bf16", batch=b, new_tokens=gen_new * 2, tok_s=None,
                    peak_gb=None, error=f"{type(ex).__name__}: {str(ex)[:200]}")
        elif "cb" in weights_list:
            skipped.append(f"transformers_cb b{b}")
    del eng
    torch.cuda.empty_cache()

    quant = [w for w in ("nvfp4", "nvfp4+lora", "nf4") if w in weights_list]
    nv = to_nvfp4(model) if any(w.startswith("nvfp4") for w in quant) else None
    nf = None
    if "nf4" in quant:
        try:
            nf = to_nf4(model)
        except Exception as ex:  # noqa: BLE001
            skipped.append(f"nf4 ({type(ex).__name__}: {str(ex)[:120]})")
    for parent, n in list(decoder_linears(model)):
        setattr(parent, n, torch.nn.Identity())  # free the BF16 weights
    torch.cuda.empty_cache()
    for w in quant:
        if w.startswith("nvfp4"):
            swap(model, nv)
            target = model
            if w == "nvfp4+lora":
                from peft import LoraConfig

                from hfq.nvfp4.peft_lora import get_peft_model

                lcfg = LoraConfig(r=32, lora_alpha=64, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                       "gate_proj", "up_proj", "down_proj"])
                target = get_peft_model(model, lcfg).to(torch.bfloat16).eval()
        else:
            if nf is None:
                continue
            swap(model, nf)
            target = model
        eng = RolloutEngine(target, max_batch=max(batches), max_seq_len=plen + new, kv_block=256)
        for b in batches:
            if left() < 40:
                skipped.append(f"hfq {w} b{b}")
                continue
            try:
                runs = []
                tok_s, dt = run_hfq(eng, b, plen, new, V, runs=runs)
                add(engine="hfq", weights=w, batch=b, new_tokens=new, tok_s=round(tok_s, 1), peak_gb=peak_gb(),
                    graphs=eng.use_graphs, fused=eng.adapter.fused, tok_s_runs=runs)
                if b == 8 and f"split_{w}_b8" not in results:
                    results[f"split_{w}_b8"] = {**step_split(eng, V, with_eager=False),
                                                "step_ms_measured": round(dt / new * 1000, 3)}
                    log(f"split {w}", results[f"split_{w}_b8"])
                    if w == "nvfp4+lora" and eng.adapter.fused:  # the model's own modules, for comparison
                        eng.adapter.fused = False
                        gm, eng.adapter.gemm = eng.adapter.gemm, False
                        eng.invalidate()
                        results[f"split_{w}_b8_unfused"] = step_split(eng, V, with_eager=False)
                        log(f"split {w} unfused", results[f"split_{w}_b8_unfused"])
                        eng.adapter.fused, eng.adapter.gemm = True, gm
                        eng.invalidate()
                    if eng.adapter.fused:
                        results[f"group_{w}_b8"] = nvfp4_grouping(eng, V)
                        log(f"NVFP4 grouped q/k/v, gate/up ({w})", results[f"group_{w}_b8"])
                        results[f"prof_{w}_b8"] = kernel_profile(eng, V)
                        log(f"kernel profile ({w})", results[f"prof_{w}_b8"])
                        results[f"pdl_{w}_b8"] = pdl_ab(eng, V)
                        log(f"programmatic dependent launch ({w})", results[f"pdl_{w}_b8"])
                        if w == "nvfp4+lora":
                            results[f"lorareduce_{w}_b8"] = lora_reduce_ab(eng, V)
                            log(f"split-K reduce in the LoRA expand ({w})", results[f"lorareduce_{w}_b8"])
                            results[f"lorastream_{w}_b8"] = lora_stream_ab(eng, V)
                            log(f"LoRA shrink on a side stream ({w})", results[f"lorastream_{w}_b8"])
            except Exception as ex:  # noqa: BLE001 - a failing kernel must not lose the other rows
                add(engine="hfq", weights=w, batch=b, new_tokens=new, tok_s=None, peak_gb=None,
                    error=f"{type(ex).__name__}: {str(ex)[:200]}")
                break
        del eng
        if w == "nvfp4+lora":
            target.unload()
        torch.cuda.empty_cache()


COLUMNS = {"engine": "engine", "weights": "weights", "model": "model", "batch": "batch", "prompt_len": "prompt",
           "new_tokens": "new tokens", "tok": "tok/s", "peak_gb": "peak GB", "x_generate": "x generate"}


def save(results, out_dir):
    """results -> NAME.json (facts, rows, the splits / profiles / A-B dicts beside) and NAME.md."""
    gen = {r["batch"]: r["tok_s"] for r in results["rows"] if r["engine"] == "generate" and r.get("tok_s")}
    cells = []
    for r in results["rows"]:
        runs = r.get("tok_s_runs")
        cells.append(dict(r, x_generate=f"{r['tok_s'] / gen[r['batch']]:.1f}" if r.get("tok_s") and r["batch"] in gen
                          else "", tok=f"{r.get('tok_s')} ({min(runs)}-{max(runs)})" if runs else f"{r.get('tok_s')}"))
    notes = ["EOS disabled; sampling at temperature 1; tok/s = batch x new_tokens / wall time (prefill included); "
             "rows with (min-max): median of 3 generates."]
    if results.get("not_run"):
        notes.append(f"\nNot run (time budget / missing package): {', '.join(results['not_run'])}")
    keys = ("split_", "group_", "prof_", "pdl_", "lorareduce_", "lorastream_")
    for k in [k for k in results if k.startswith(keys)] + ["quick"]:
        if k in results:
            notes.append(f"\n{k}: `{json.dumps(results[k])}`")
    write(NAME, results["rows"], COLUMNS, "\n".join(notes), out_dir=out_dir, facts=results["facts"],
          extra={k: v for k, v in results.items() if k not in ("facts", "rows")}, md_rows=cells,
          title="Rollout throughput")


def main():
    ap = add_args(argparse.ArgumentParser())
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true", help="with --check: the table instead of the quick timings")
    ap.add_argument("--batches", default="8,1,32")
    ap.add_argument("--new-tokens", type=int, default=2048)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--what", default="bf16,generate,cb,nvfp4,nvfp4+lora,nf4")
    ap.add_argument("--name", default="rollout", help="results file stem (rollout.json / rollout.md)")
    a = ap.parse_args()
    global OUT_DIR, NAME
    OUT_DIR, NAME = a.out, a.name
    results = dict(facts=run_facts(), rows=[])
    try:
        if a.check:
            check(results)
            save(results, a.out)
            if a.bench:
                bench(results, [int(x) for x in a.batches.split(",")], a.new_tokens, a.prompt_len, a.budget_s,
                      a.layers, a.what.split(","))
            else:
                quick_timings(results, a.layers)
        else:
            bench(results, [int(x) for x in a.batches.split(",")], a.new_tokens, a.prompt_len, a.budget_s, a.layers,
                  a.what.split(","))
    finally:
        save(results, a.out)
        log("done", json.dumps({k: v for k, v in results.items() if k != "rows"})[:3000])


if __name__ == "__main__":
    main()
