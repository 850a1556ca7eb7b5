"""QeRL GRPO step on the device: QeRL (NVFP4 + LoRA + AQN) vs BF16 LoRA vs QLoRA (bnb NF4), same batch and lengths,
same run, all three rolled out by hfq's RolloutEngine. Phases timed separately: rollout / reward / log-probs / update.
Plus a 32B-shaped QeRL step built layer by layer (the BF16 model never exists on the GPU).

    python benchmarks/qerl_step.py [--batch 8 --prompt 256 --new 512 --methods qerl,bf16_lora,qlora,qerl_32b]

Random-init weights with real Qwen2.5 configs (speed/memory only). Writes benchmarks/results/qerl_step.{json,md}
(or --out DIR) after every row, so a killed run keeps what it measured.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
import types

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from _harness import add_args, spread, table, write  # noqa: E402

T0 = time.time()
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def qwen_config(size: str):
    from transformers import Qwen2Config

    shapes = {"7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064),
              "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                          num_key_value_heads=8, vocab_size=152064)}[size]
    return Qwen2Config(max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2, **shapes)


def build(method: str, size: str):
    """The policy: base weights in the method's format + LoRA r=32 on all decoder linears."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    cfg = qwen_config(size)
    torch.manual_seed(0)
    if size == "32b":  # layer by layer: only one BF16 layer is ever on the GPU
        from hfq.nvfp4 import NVFP4Linear
        from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        for mod in (model.model.embed_tokens, model.lm_head, model.model.norm):
            mod.to_empty(device="cuda")
        torch.nn.init.normal_(model.model.embed_tokens.weight, std=0.02)
        torch.nn.init.normal_(model.lm_head.weight, std=0.02)
        torch.nn.init.ones_(model.model.norm.weight)
        for layer in model.model.layers:
            layer.to_empty(device="cuda")
            for n, p in layer.named_parameters():
                torch.nn.init.ones_(p) if "norm" in n else (torch.nn.init.normal_(p, std=0.02) if p.dim() == 2
                                                            else torch.nn.init.zeros_(p))
            for parent in (layer.self_attn, layer.mlp):
                for n in LORA_TARGETS:
                    if hasattr(parent, n):
                        setattr(parent, n, NVFP4Linear.from_linear(getattr(parent, n)))
            torch.cuda.empty_cache()
        model.model.rotary_emb = Qwen2RotaryEmbedding(cfg, device="cuda")
    else:
        from rollout import build_model, swap, to_nf4, to_nvfp4

        model = build_model(cfg)
        if method == "qerl":
            swap(model, to_nvfp4(model))
        elif method == "qlora":
            swap(model, to_nf4(model))
        gc.collect()
        torch.cuda.empty_cache()
    if add_fused_lm_head is not None:  # as GRPOTrainer does, before PEFT wraps the model
        add_fused_lm_head(model, temperature=1.0)
    lcfg = LoraConfig(r=32, lora_alpha=64, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    if method.startswith("qerl"):
        from hfq.nvfp4 import get_peft_model
    else:
        from peft import get_peft_model
    model = get_peft_model(model, lcfg)
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data = p.data.to(torch.bfloat16)
    return model


try:  # TRL >= 1.16 scores completions through a fused LM head (no [tokens, vocab] fp32 log-softmax held)
    from trl.trainer.utils import add_fused_lm_head
except Exception:  # noqa: BLE001 - e.g. a device image without trl/datasets: the logits path below
    add_fused_lm_head = None


def per_token_logps(model, ids, n_new):
    """Log-probs of the last n_new tokens, as TRL's GRPOTrainer computes them: with TRL >= 1.16, the model's fused LM
    head (`add_fused_lm_head`, applied in build(); labels only on the completion, `fused_lm_head=True`); otherwise
    logits only for the completion (logits_to_keep) and a row-by-row fp32 log-softmax."""
    if add_fused_lm_head is not None:
        labels = ids.clone()
        labels[:, :-n_new] = -100
        return model(input_ids=ids, labels=labels, fused_lm_head=True).log_probs[:, -n_new:]
    logits = model(input_ids=ids, logits_to_keep=n_new + 1, use_cache=False).logits[:, :-1]
    tgt = ids[:, -n_new:]
    rows = []
    for lg, t in zip(logits, tgt):  # [n_new, vocab] at a time
        lg = lg.float()
        rows.append(lg.gather(-1, t[:, None]).squeeze(-1) - torch.logsumexp(lg, -1))
    return torch.stack(rows)


def own_forward_code(layers, tag: str) -> None:
    """Give these layers a private copy of their class's forward code. TorchDynamo keeps its compiled entries per code
    object: without this, the methods built side by side would share one cache (its size limit included) and every
    call would first be guard-checked against the other models' entries, a host cost a user's single model never
    pays."""
    f = type(layers[0]).forward
    g = types.FunctionType(f.__code__.replace(co_name=f"{f.__name__}_{tag}"), f.__globals__, f.__name__,
                           f.__defaults__, f.__closure__)
    g.__kwdefaults__, g.__dict__ = f.__kwdefaults__, dict(f.__dict__)
    for layer in layers:
        layer.forward = types.MethodType(g, layer)


class Run:
    """One method's policy, optimizer, AQN and rollout engine, built once; step() runs one GRPO step.

    Several Runs live side by side so that their steps can be interleaved (A B A B ...). Memory figures are each
    Run's own: `held` is what it keeps allocated (model, engine caches, optimizer state), and a phase's peak is
    the peak allocated during it minus what the other live Runs hold (allocated bytes add up exactly)."""

    def __init__(self, method, size, batch, plen, new, grad_ckpt=False, compile_layers=False):
        from hfq.qerl.aqn import AQNSchedule, AdaptiveQuantizationNoise
        from hfq.rollout import RolloutEngine

        self.method, self.size, self.batch, self.plen, self.new = method, size, batch, plen, new
        torch.cuda.empty_cache()
        a0 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        self.model = model = build(method, size)
        if grad_ckpt:  # as GRPOConfig(gradient_checkpointing=True) does; the rollout engine is unaffected
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if compile_layers:  # regional compilation: each decoder layer (one graph serves all); the engine calls sub-modules
            own_forward_code(model.get_base_model().model.layers, method)
            for layer in model.get_base_model().model.layers:
                layer.compile()
        self.alloc = {"alloc_built_gb": round((torch.cuda.memory_allocated() - a0) / 2**30, 2)}
        log(f"{method} {size}: built, {self.alloc['alloc_built_gb']} GB allocated")
        self.aqn = AdaptiveQuantizationNoise(model, seed=0) if method.startswith("qerl") else None
        self.sigma = AQNSchedule().stage_sigma(1)
        self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        self.engine = RolloutEngine(model, max_batch=batch, max_seq_len=plen + new)
        V = model.config.vocab_size
        self.ids = torch.randint(3, V, (batch, plen), generator=torch.Generator().manual_seed(0)).cuda()
        self.engine.warmup(batch, plen, new, temperature=1.0)
        torch.cuda.synchronize()
        self.alloc["alloc_after_warmup_gb"] = round((torch.cuda.memory_allocated() - a0) / 2**30, 2)
        self.peaks = {"build_and_warmup": (torch.cuda.max_memory_allocated() - a0) / 2**30}
        self.held = torch.cuda.memory_allocated() - a0
        self.rounds = []  # timings of every reported step
        self.it = 0

    def step(self, report=True):
        """One GRPO step (rollout, reward, old log-probs, update); its timings are kept when `report`."""
        from hfq.qerl.rewards import accuracy_reward, format_reward

        model, batch, new, ids, aqn = self.model, self.batch, self.new, self.ids, self.aqn
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        other = before - self.held
        torch.cuda.reset_peak_memory_stats()
        peaks = {}

        def sync_t():
            torch.cuda.synchronize()
            return time.perf_counter()

        def phase_peak(name):  # own peak during the phase that just ended, then start the next phase's count
            torch.cuda.synchronize()
            peaks[name] = (torch.cuda.max_memory_allocated() - other) / 2**30
            torch.cuda.reset_peak_memory_stats()

        it = self.it
        self.it += 1
        model.eval()
        t0 = sync_t()
        if aqn is not None:
            aqn.apply(it, self.sigma)
        out = self.engine.generate(ids, max_new_tokens=new, temperature=1.0, eos_token_ids=[], seed=it)
        if aqn is not None:
            aqn.restore()
        t1 = sync_t()
        phase_peak("rollout")
        comp = out.completion_ids
        texts = ["<think>" + " ".join(map(str, r[:8].tolist())) + "</think><answer>1</answer>" for r in comp.cpu()]
        rewards = torch.tensor([a + f for a, f in zip(accuracy_reward(texts, answer=["1"] * batch),
                                                        format_reward(texts))], device="cuda")
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        t2 = sync_t()
        full = torch.cat([ids, comp.to(ids.device)], 1)
        with torch.no_grad():  # in the update's micro-batches, as TRL does (batch_size=per_device_train_batch_size)
            old = torch.cat([per_token_logps(model, full[i:i + 1], new) for i in range(batch)])
        t3 = sync_t()
        phase_peak("logprob")
        model.train()
        for i in range(batch):  # one sequence per micro-batch (TRL's per-device batch 1 x grad accumulation)
            lp = per_token_logps(model, full[i:i + 1], new)
            ratio = torch.exp(lp - old[i:i + 1])
            loss = -(torch.minimum(ratio * adv[i], ratio.clamp(0.8, 1.28) * adv[i])).mean() / batch
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t4 = sync_t()
        phase_peak("update")
        del out, comp, full, old, lp, ratio, loss, rewards, adv
        torch.cuda.synchronize()
        self.held += torch.cuda.memory_allocated() - before  # e.g. AdamW state, made on the first step
        timings = dict(rollout_s=t1 - t0, reward_s=t2 - t1, logprob_s=t3 - t2, update_s=t4 - t3, step_s=t4 - t0)
        log(f"{self.method} {self.size} step {it}{'' if report else ' (warm-up)'}: "
            + ", ".join(f"{k} {v:.2f}" for k, v in timings.items()))
        if report:
            self.rounds.append(timings)
            for k, v in peaks.items():
                self.peaks[k] = max(self.peaks.get(k, 0.0), v)
        return timings

    def row(self):
        return make_row(self.method, self.size, self.batch, self.plen, self.new, self.rounds, self.peaks, self.alloc)

    def close(self):
        del self.engine, self.model, self.opt, self.aqn
        gc.collect()
        torch.cuda.empty_cache()


PHASES = ("rollout_s", "reward_s", "logprob_s", "update_s", "step_s")


def make_row(method, size, batch, plen, new, rounds, peaks, alloc):
    """A table row from the reported steps: each phase's median over them, plus spreads (min-max) of the step
    and its big phases, and the per-round step times (for ratio spreads)."""
    row = dict(method=method, model=f"qwen2.5-{size}-shaped", batch=batch, prompt_len=plen, completion_len=new,
               rounds=len(rounds))
    for k in PHASES:
        v = [r[k] for r in rounds]
        row[k] = round(spread(v)["median"], 3) if v else None
        if k in ("step_s", "rollout_s", "update_s"):
            row[f"{k}_spread"] = [round(min(v), 3), round(max(v), 3)] if v else None
    row["step_s_rounds"] = [round(r["step_s"], 3) for r in rounds]
    row["rollout_tok_s"] = round(batch * new / row["rollout_s"], 1) if row["rollout_s"] else None
    # the step's peak: its phases only (the build peak is the benchmark's random-init BF16 model, not the method's)
    step_peaks = [v for k, v in peaks.items() if k != "build_and_warmup"]
    row["peak_gb"] = round(max(step_peaks), 2) if step_peaks else None
    row.update(alloc)
    row.update({f"peak_{k}_gb": round(v, 2) for k, v in peaks.items()})
    return row


COLUMNS = {"method": "method", "model": "model", "batch": "batch", "prompt_len": "prompt", "completion_len": "completion",
           "rounds": "rounds", "step_s": "step s", "step_sp": "step spread", "rollout_s": "rollout s",
           "rollout_sp": "rollout spread", "reward_s": "reward s", "logprob_s": "logprob s", "update_s": "update s",
           "update_sp": "update spread", "rollout_tok_s": "rollout tok/s", "alloc_after_warmup_gb": "held GB",
           "peak_gb": "step peak GB", "x_bf16": "step x bf16_lora (spread)", "rollout_x_bf16": "rollout x bf16_lora",
           "x_qlora": "step x qlora (spread)", "peak_vs_bf16": "step peak / bf16_lora"}
INTRO = ("Random-init Qwen2.5-shaped models, LoRA r=32 on all decoder linears, hfq RolloutEngine for every method, EOS "
         "off (every row generates completion_len tokens). The 7B methods are built side by side and their steps "
         "interleaved (A B C A B C ...) after one warm-up step each; times are medians over the `rounds` reported "
         "steps, spreads their min-max, `x` ratios of medians with the min-max of per-round ratios. Memory is each "
         "method's own (what the other live methods hold is subtracted); held = allocated after warm-up, step peak = "
         "the largest allocation during rollout, log-probs and update (the build's peak, a random-init BF16 model "
         "quantized here, is in the phase table).")


def display(rows):
    """The md table's cells: spreads as lo-hi, ratios vs bf16_lora / qlora with per-round spreads."""
    base = {r["method"]: r for r in rows}
    b, q = base.get("bf16_lora"), base.get("qlora")
    out = []
    for r in rows:
        def ratio(x, key, inv=False):
            if x is None or r.get(key) in (None, 0) or x.get(key) in (None, 0):
                return ""
            return f"{(r[key] / x[key]) if inv else (x[key] / r[key]):.2f}"

        def ratio_sp(x):  # speedup vs x per round (x's time / ours), min-max over the rounds both have
            if x is None or x is r or not r.get("step_s_rounds") or not x.get("step_s_rounds"):
                return ratio(x, "step_s")
            v = [a / c for a, c in zip(x["step_s_rounds"], r["step_s_rounds"]) if c]
            return f"{ratio(x, 'step_s')} ({min(v):.2f}-{max(v):.2f})" if v else ratio(x, "step_s")

        sp = {f"{k}_sp": f"{r[f'{k}_s_spread'][0]}-{r[f'{k}_s_spread'][1]}" if r.get(f"{k}_s_spread") else ""
              for k in ("step", "rollout", "update")}
        out.append(dict(r, **sp, x_bf16=ratio_sp(b), rollout_x_bf16=ratio(b, "rollout_s"), x_qlora=ratio_sp(q),
                        peak_vs_bf16=ratio(b, "peak_gb", inv=True)))
    return out


def save(rows, notes, out_dir, name="qerl_step", facts=None):
    """rows -> <name>.json (rows as measured) and <name>.md (the table, memory by phase, notes)."""
    ph = [k for k in ("built", "after_warmup") if any(f"alloc_{k}_gb" in r for r in rows)]
    mem = {"method": "method", **{f"alloc_{k}_gb": f"allocated {k}" for k in ph},
           **{f"peak_{k}_gb": f"peak {k}" for k in ("build_and_warmup", "rollout", "logprob", "update")}}
    md_notes = "\n".join(["## Memory by phase (GB, each method's own; allocated = held at that point, peak = max "
                          "allocated during the phase)", ""] + table(rows, mem)
                         + ["", "## Notes"] + [f"- {n}" for n in notes])
    return write(name, rows, COLUMNS, INTRO + "\n\n" + md_notes, out_dir=out_dir, facts=facts, extra={"notes": notes},
                 title="QeRL GRPO step", md_rows=display(rows))


def failed_row(m, size, a):
    return dict(method=m, model=f"qwen2.5-{size}-shaped", batch=a.batch, prompt_len=a.prompt, completion_len=a.new,
                rounds=0, step_s=None, rollout_s=None, reward_s=None, logprob_s=None, update_s=None,
                rollout_tok_s=None, peak_gb=None)


def selftest():
    """Rows and tables from made-up step timings (no GPU work)."""
    import tempfile

    rounds = {"qerl": [5.0, 5.4, 5.2], "bf16_lora": [6.0, 5.8, 6.2]}
    rows = [make_row(m, "7b", 8, 256, 2048, [dict(rollout_s=t / 2, reward_s=0.001, logprob_s=0.2, update_s=t / 2 - 0.2,
                                                  step_s=t) for t in ts], {"rollout": 10.0, "update": 15.0},
                     {"alloc_built_gb": 5.6}) for m, ts in rounds.items()]
    assert rows[0]["step_s"] == 5.2 and rows[0]["step_s_spread"] == [5.0, 5.4] and rows[0]["rounds"] == 3
    with tempfile.TemporaryDirectory() as d:
        save(rows + [dict(method="qlora", model="qwen2.5-7b-shaped", batch=8, prompt_len=256, completion_len=2048,
                          rounds=0, step_s=None)], ["a note"], d, "qerl_step_new2048_gc", facts={"device": "none"})
        md = open(os.path.join(d, "qerl_step_new2048_gc.md")).read()
        print(md)
        assert "| qerl | qwen2.5-7b-shaped | 8 | 256 | 2048 | 3 | 5.2 | 5.0-5.4 |" in md, md
        assert "| 1.15 (1.07-1.20) |" in md  # bf16 6.0 / 5.2; per round 6/5, 5.8/5.4, 6.2/5.2
    compiled_caches_apart()
    print("selftest ok")


def compiled_caches_apart():
    """Two models whose layers have their own forward code (own_forward_code) compile one graph each, in caches apart."""
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x).relu()

    stats = torch._dynamo.utils.counters["stats"]  # process-wide: other compilations may have counted before
    graphs0 = stats["unique_graphs"]
    models = [[Layer(), Layer()], [Layer(), Layer()]]
    for tag, layers in zip("ab", models):
        own_forward_code(layers, tag)
        for layer in layers:
            layer.compile(backend="eager")
    x = torch.randn(2, 4)
    for layers in models:
        for layer in layers:
            torch.testing.assert_close(layer(x), layer.lin(x).relu())
    codes = {layers[0].forward.__code__ for layers in models}
    assert len(codes) == 2 and all(layers[0].forward.__code__ is layers[1].forward.__code__ for layers in models)
    assert stats["unique_graphs"] - graphs0 == 2, dict(stats)


def decode_profile(run) -> str:
    """The run's batch decode step in its CUDA graph: ms per replay and the kernels taking the most GPU time
    (benchmarks/rollout.py's step_split and kernel_profile), as one line for the notes."""
    import rollout as rb

    run.model.eval()  # as in the rollout phase (after a step the model is in train mode: PEFT's own forward)
    V = run.model.config.vocab_size
    split = rb.step_split(run.engine, V, b=run.batch, with_eager=False, greedy_only=True)
    prof = rb.kernel_profile(run.engine, V)
    top = ", ".join(f"{t['kernel']} {t['us']} us x{t['launches']}" for t in prof.get("top", [])[:8])
    return f"step {json.dumps(split)}; kernels {prof.get('kernel_us_per_step')} us per step: {top}"


def main():
    ap = add_args(argparse.ArgumentParser())
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=512, help="completion tokens per sequence (the QeRL paper: 2048)")
    ap.add_argument("--methods", default="qerl,bf16_lora,qlora,qerl_32b")
    ap.add_argument("--repeats-32b", type=int, default=2, help="reported qerl_32b steps (after its warm-up step)")
    ap.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing in the update (writes qerl_step_gc.*)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (writes qerl_step_compile.*)")
    ap.add_argument("--selftest", action="store_true", help="table writing on made-up numbers (no GPU)")
    a = ap.parse_args()
    if a.selftest:
        return selftest()
    name = ("qerl_step" + (f"_b{a.batch}" if a.batch != 8 else "") + (f"_new{a.new}" if a.new != 512 else "")
            + ("_gc" if a.grad_ckpt else "")
            + ("_compile" if a.compile else "") + ("_32b" if a.methods == "qerl_32b" else ""))
    notes = [f"update: {a.batch} micro-batches of 1 sequence (TRL per_device_train_batch_size=1, "
             f"gradient_accumulation_steps={a.batch});"
             " the log-prob pass runs in the same micro-batches, as TRL's GRPOTrainer does",
             "log-probs: " + ("TRL's fused LM head (trl.trainer.utils.add_fused_lm_head), as GRPOTrainer scores them"
                              if add_fused_lm_head is not None else
                              "logits of the completion + row-wise fp32 log-softmax (trl not installed)")]
    if a.grad_ckpt:
        notes.append("gradient checkpointing on (non-reentrant) in the update and log-prob passes of every method")
    if a.compile:
        notes.append("torch.compile on every decoder layer (regional; the warm-up step absorbs the compilation)")
    methods = a.methods.split(",")
    order = [m for m in methods if m != "qerl_32b"]
    runs, done = {}, {}  # live Runs; rows of methods that failed (or stopped) on the way
    for m in order:  # built side by side, each followed by its warm-up step
        try:
            runs[m] = Run(m, "7b", a.batch, a.prompt, a.new, grad_ckpt=a.grad_ckpt, compile_layers=a.compile)
            runs[m].step(report=False)
        except Exception as e:  # noqa: BLE001 - record and go on: the other rows still count
            traceback.print_exc()
            notes.append(f"{m}: failed while building / warming up: {type(e).__name__}: {str(e)[:300]}")
            runs.pop(m, None)
            done[m] = failed_row(m, "7b", a)
            gc.collect()
            torch.cuda.empty_cache()

    def rows_now():
        return [runs[m].row() if m in runs else done[m] for m in order]

    rows = rows_now()
    save(rows, notes, a.out, name)
    for rnd in range(a.rounds):  # A B C A B C ...
        for m in list(runs):
            try:
                runs[m].step()
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                notes.append(f"{m}: failed in round {rnd}: {type(e).__name__}: {str(e)[:300]} "
                             f"(its row keeps the rounds before)")
                run = runs.pop(m)
                done[m] = run.row()
                run.close()
        rows = rows_now()
        save(rows, notes, a.out, name)
    for run in runs.values():
        run.close()
    runs.clear()
    if "qerl_32b" in methods:  # alone (no interleaving partner): a warm-up step, then the reported ones
        notes.append(f"qerl_32b: built alone after the 7B methods; one warm-up step, then {a.repeats_32b} reported")
        try:
            r32 = Run("qerl_32b", "32b", a.batch, a.prompt, a.new, grad_ckpt=a.grad_ckpt, compile_layers=a.compile)
            r32.step(report=False)
            for _ in range(a.repeats_32b):
                r32.step()
            rows.append(r32.row())
            notes.append("qerl_32b decode step (batch 8, LoRA on, CUDA graph): " + decode_profile(r32))
            r32.close()
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            notes.append(f"qerl_32b: failed: {type(e).__name__}: {str(e)[:300]}")
            rows.append(failed_row("qerl_32b", "32b", a))
        save(rows, notes, a.out, name)
    log("done")


if __name__ == "__main__":
    main()
