"""QFT paper Table 1 on the device: memory of full-parameter training of a LLaMA-2-7B-shaped model (LlamaConfig
hidden 4096, intermediate 11008, 32 layers, 32 heads, vocab 32000; random init), seq 2048, batch 1, gradient
checkpointing, one row per method:

  bf16_adamw     bf16 weights, torch AdamW (fused on CUDA, bf16 states)      the step-time baseline
  adamw_fp32     fp32 weights + fp32 AdamW states (fused on CUDA), bf16 autocast compute
  bnb_adamw8bit  fp32 weights + bitsandbytes AdamW8bit, bf16 autocast (row says "not installed" without bnb)
  lion_fp32      fp32 weights + hfq.qft.QLion(momentum_bits=None) (fp32 momentum), bf16 autocast
  eco            QFTConfig(weight_format="fp8_e4m3_row") + hfq.eco.ECOAdamW (defaults: fp32 states)
  qft            QFTConfig(gradient_bits=8) (INT8 dense + 1% bf16 outliers, INT8 gradients) + QLion (INT8 momentum)
  qft_sib        as qft, with the step applied during backward (hfq.qft.step_in_backward_): no gradient store

Columns (GiB = 2^30 B, the paper's unit: 6.74B fp32 = 25.1): weights, gradients (held at the end of backward),
optimizer states (all from the tensors held: numel x itemsize, QParam codes + scales + outliers, INT8 stores),
activations = peak - weights - gradients - states (so it also holds the step's temporaries: dequantized weights,
logits, the optimizer's working copies), peak = torch.cuda.max_memory_allocated over one training step (forward,
backward, optimizer.step) after a warm-up step. A row whose model states cannot fit (estimated from parameter counts,
or an OOM) is measured at --fallback-layers (default 2 and 4) and extrapolated linearly to --layers (marked).

Step time: each method against bf16_adamw at --time-layers (default 8, same layer shapes; both models resident),
steps interleaved baseline/method over --rounds (>= 3) after one warm-up step each; median, spread
((max - min) / median) and ratio of medians.

  python benchmarks/qft_memory.py --out benchmarks/results                  # device: about 5-7 min on an H100
  python benchmarks/qft_memory.py --device cpu --layers 1 --seq 64 --hidden 256 --intermediate 512 --heads 4 \\
      --vocab 1000 --time-layers 1 --out /tmp/qft_mem                          # CPU end-to-end check

Writes <out>/qft_memory.{json,md} after every row, so a killed run keeps what it measured. Each row runs in its own
try/except (errors and OOM recorded), models and optimizers are freed between rows. On CPU there is no allocator
peak: weights / gradients / states come from tensor sizes only and peak / activations are left empty.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import add_args, run_facts, spread, table, write  # noqa: E402

T0 = time.time()
GIB = 2 ** 30
ALL = ("qft_sib", "qft", "bf16_adamw", "eco", "bnb_adamw8bit", "lion_fp32", "adamw_fp32")  # run order: QFT first
# model-state bytes per parameter (linears), to skip a full-size attempt that cannot fit
EST_BYTES = {"bf16_adamw": 8, "adamw_fp32": 16, "bnb_adamw8bit": 10, "lion_fp32": 12, "eco": 11, "qft": 3.1,
             "qft_sib": 2.1}
LR = 1e-5


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def llama_config(a, layers):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=layers,
                       num_attention_heads=a.heads, num_key_value_heads=a.kv_heads or a.heads, vocab_size=a.vocab,
                       max_position_embeddings=max(4096, a.seq), rms_norm_eps=1e-5, tie_word_embeddings=False,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")


def _has_bnb():
    try:
        import bitsandbytes  # noqa: F401
        return True
    except Exception:  # noqa: BLE001 - any import failure means the row cannot run
        return False


def _qcfg(method):
    from hfq.qft import QFTConfig

    if method == "eco":
        return QFTConfig(weight_format="fp8_e4m3_row")
    if method in ("qft", "qft_sib"):
        return QFTConfig(gradient_bits=8)
    return None


def _dtype(method):
    return torch.float32 if method in ("adamw_fp32", "bnb_adamw8bit", "lion_fp32") else torch.bfloat16


@torch.no_grad()
def _init_(mod, gen):
    for n, p in mod.named_parameters():
        if n.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)


def build(method, cfg, dev):
    """The model on `dev`, built layer by layer from the meta device: a quantized method converts each decoder
    layer right after it is initialised, so the bf16 model never exists whole beside its quantized copy."""
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from hfq.qft import QFTLinear, convert_linears_, ddp_ignore_int8_grad_weights_

    dtype, qcfg = _dtype(method), _qcfg(method)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(dtype)
    gen = torch.Generator(device=dev).manual_seed(0)
    for mod in (model.model.embed_tokens, model.model.norm, model.lm_head):
        mod.to_empty(device=dev)
        _init_(mod, gen)
    with torch.device(dev):
        model.model.rotary_emb = LlamaRotaryEmbedding(config=cfg)
    for layer in model.model.layers:
        layer.to_empty(device=dev)
        _init_(layer, gen)
        if qcfg is not None:
            convert_linears_(layer, qcfg)
    if qcfg is not None:
        for n, m in model.named_modules():
            if isinstance(m, QFTLinear):
                m.qft_name = n
        ddp_ignore_int8_grad_weights_(model)
    return model.train()


def make_optimizer(method, model, dev):
    from hfq.eco import ECOAdamW
    from hfq.qft import QLion

    params = [p for p in model.parameters() if p.requires_grad]
    if method in ("bf16_adamw", "adamw_fp32"):
        return torch.optim.AdamW(params, lr=LR, weight_decay=0.0, fused=dev.type == "cuda")
    if method == "bnb_adamw8bit":
        import bitsandbytes as bnb
        return bnb.optim.AdamW8bit(params, lr=LR, weight_decay=0.0)
    if method == "lion_fp32":
        return QLion(params, lr=LR, momentum_bits=None)
    if method == "eco":
        return ECOAdamW(params, lr=LR, weight_decay=0.0)
    return QLion(params, lr=LR)  # qft, qft_sib: INT8 momentum, SR weight requantization


class Run:
    """One method's model + optimizer, ready to step."""

    def __init__(self, method, cfg, dev, a):
        from hfq.qft import step_in_backward_

        self.method, self.dev = method, dev
        self.model = build(method, cfg, dev)
        if a.grad_ckpt:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.opt = make_optimizer(method, self.model, dev)
        self.handle = step_in_backward_(self.model, self.opt) if method == "qft_sib" else None
        self.autocast = _dtype(method) == torch.float32  # fp32 weights: bf16 compute (mixed precision)
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(3, cfg.vocab_size, (1, a.seq), generator=g).to(dev)

    def forward_backward(self):
        with torch.autocast(self.dev.type, dtype=torch.bfloat16, enabled=self.autocast, cache_enabled=False):
            loss = self.model(input_ids=self.ids, labels=self.ids, use_cache=False).loss
        loss.backward()
        return loss

    def finish(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def step(self):
        self.forward_backward()
        self.finish()

    def close(self):
        if self.handle is not None:
            self.handle.remove()
        self.model = self.opt = self.handle = None


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def free(dev):
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def measure(method, layers, a, dev):
    """Build at `layers`, one warm-up step, then one measured step: tensor bytes at the end of backward, peak."""
    from hfq.qft import state_bytes

    free(dev)
    cuda = dev.type == "cuda"
    base = torch.cuda.memory_allocated() if cuda else 0
    t = time.perf_counter()
    run = Run(method, llama_config(a, layers), dev, a)
    try:
        sync(dev)
        build_s = time.perf_counter() - t
        built = (torch.cuda.memory_allocated() - base) if cuda else None
        run.step()  # warm-up: optimizer states are created here
        sync(dev)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        loss = run.forward_backward()
        sync(dev)
        sb = state_bytes(run.model, run.opt)
        run.finish()
        sync(dev)
        step_s = time.perf_counter() - t
        peak = (torch.cuda.max_memory_allocated() - base) if cuda else None
        reserved = torch.cuda.max_memory_reserved() if cuda else None
        after = (torch.cuda.memory_allocated() - base) if cuda else None
        n_params = sum(p.numel() for p in run.model.parameters())
        rest = sb["weights"] + sb["grads"] + sb["optimizer"]
        return dict(layers=layers, params=n_params, params_b=n_params / 1e9, weights_gib=sb["weights"] / GIB,
                    grads_gib=sb["grads"] / GIB, optimizer_gib=sb["optimizer"] / GIB, states_gib=rest / GIB,
                    activations_gib=None if peak is None else (peak - rest) / GIB,
                    peak_gib=None if peak is None else peak / GIB,
                    allocated_built_gib=None if built is None else built / GIB,
                    allocated_after_step_gib=None if after is None else after / GIB,
                    peak_reserved_gib=None if reserved is None else reserved / GIB,
                    outliers=sb["outliers"], step_s=step_s, build_s=build_s, loss=float(loss.detach()),
                    states_bytes_per_param=rest / n_params)
    finally:
        run.close()
        del run
        free(dev)


def extrapolate(r1, r2, layers):
    """Linear in the layer count (every decoder layer has the same shapes): value(L) from two measured sizes."""
    out = {}
    l1, l2 = r1["layers"], r2["layers"]
    for k, v1 in r1.items():
        v2 = r2.get(k)
        if k == "layers" or not isinstance(v1, (int, float)) or not isinstance(v2, (int, float)) or k in ("loss",):
            continue
        out[k] = v1 + (v2 - v1) * (layers - l1) / (l2 - l1)
    out["layers"] = layers
    out["params"] = round(out["params"])
    out["params_b"] = out["params"] / 1e9
    out["states_bytes_per_param"] = out["states_gib"] * GIB / out["params"]
    return out


def memory_row(method, a, dev, total_mem):
    if method == "bnb_adamw8bit" and not _has_bnb():
        return dict(method=method, status="not installed (bitsandbytes)")
    cfg = llama_config(a, a.layers)
    with torch.device("meta"):
        from transformers import LlamaForCausalLM
        n_params = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    est = EST_BYTES[method] * n_params
    reason = None
    if total_mem and est > 0.95 * total_mem:
        reason = (f"model states alone (estimated {est / GIB:.1f} GiB) exceed the device's {total_mem / GIB:.1f} GiB"
                  f" at {a.layers} layers")
    else:
        try:
            r = measure(method, a.layers, a, dev)
            r.update(method=method, status="measured")
            return r
        except Exception as e:  # noqa: BLE001 - an OOM (also as a plain RuntimeError from cuBLAS) falls back
            if not (isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()):
                raise
            reason = f"OOM at {a.layers} layers: {str(e).splitlines()[0][:160]}"
        free(dev)
    log(f"{method}: {reason}; measuring at {a.fallback_layers} layers and extrapolating")
    l1, l2 = a.fallback_layers
    r1, r2 = measure(method, l1, a, dev), measure(method, l2, a, dev)
    r = extrapolate(r1, r2, a.layers)
    r.update(method=method, status=f"extrapolated from {l1} and {l2} layers ({reason})",
             measured={str(l1): r1, str(l2): r2})
    return r


def timing_pairs(methods, a, dev, write_cb):
    """bf16_adamw resident at --time-layers; each other method built beside it and stepped interleaved."""
    cfg = llama_config(a, a.time_layers)
    rows = []
    base = Run("bf16_adamw", cfg, dev, a)
    try:
        base.step()
        for m in methods:
            if m == "bf16_adamw":
                continue
            if time.time() - T0 > a.budget_s:
                rows.append(dict(method=m, status="skipped: time budget"))
                write_cb(rows)
                continue
            if m == "bnb_adamw8bit" and not _has_bnb():
                rows.append(dict(method=m, status="not installed (bitsandbytes)"))
                write_cb(rows)
                continue
            run = None
            try:
                run = Run(m, cfg, dev, a)
                run.step()
                tb, tm = [], []
                for i in range(a.rounds):
                    order = ((base, tb), (run, tm)) if i % 2 == 0 else ((run, tm), (base, tb))
                    for r, out in order:
                        sync(dev)
                        t = time.perf_counter()
                        r.step()
                        sync(dev)
                        out.append(time.perf_counter() - t)
                mb, mm = spread(tb)["median"], spread(tm)["median"]
                rows.append(dict(method=m, status="measured", layers=a.time_layers, step_s_median=mm,
                                 step_s_spread=(max(tm) - min(tm)) / mm, step_s=tm, bf16_adamw_s_median=mb,
                                 bf16_adamw_s_spread=(max(tb) - min(tb)) / mb, bf16_adamw_s=tb,
                                 ratio_vs_bf16_adamw=mm / mb))
                log(f"time {m}: {mm:.3f} s vs bf16_adamw {mb:.3f} s -> {mm / mb:.2f}x")
            except Exception as e:  # noqa: BLE001 - record and go on
                traceback.print_exc()
                rows.append(dict(method=m, status=f"failed: {type(e).__name__}: {str(e)[:300]}"))
            finally:
                if run is not None:
                    run.close()
                del run
                free(dev)
            write_cb(rows)
    finally:
        base.close()
        del base
        free(dev)
    return rows


def _f(x, nd=2, suffix=""):
    return "" if x is None else f"{x:.{nd}f}{suffix}"


MEMORY = {"method": "method", "params_b": "params (B)", "weights_gib": "weights", "grads_gib": "gradients",
          "optimizer_gib": "optimizer states", "states_gib": "model states", "states_bytes_per_param": "B/param",
          "activations_gib": "activations", "peak_gib": "peak", "step_s": "step s (1 run)",
          "x_bf16": "x bf16_adamw (1 run)", "status": "status"}
TIMING = {"method": "method", "step_s_median": "median s", "step_s_spread": "spread",
          "bf16_adamw_s_median": "bf16 AdamW median s (same pairing)", "bf16_adamw_s_spread": "spread",
          "ratio_vs_bf16_adamw": "ratio", "status": "status"}


def save(res, out_dir):
    """res -> <name>.json (the memory rows; config, timing rows, notes beside) and <name>.md (both tables)."""
    c = res["config"]
    b = next((r for r in res["memory"] if r["method"] == "bf16_adamw" and r.get("step_s")), None)
    mem = []
    for r in res["memory"]:
        x = r["step_s"] / b["step_s"] if b and r.get("step_s") and r.get("status") == b.get("status") == "measured" \
            else None
        mem.append(dict(r, x_bf16=_f(x, 2, "x"), params_b=_f(r.get("params_b"), 3),
                        **{k: _f(r.get(k)) for k in list(MEMORY)[2:10]}))
    pct = lambda v: _f(None if v is None else 100 * v, 1, "%")  # noqa: E731
    tim = [dict(r, step_s_median=_f(r.get("step_s_median"), 3), step_s_spread=pct(r.get("step_s_spread")),
                bf16_adamw_s_median=_f(r.get("bf16_adamw_s_median"), 3),
                bf16_adamw_s_spread=pct(r.get("bf16_adamw_s_spread")),
                ratio_vs_bf16_adamw=_f(r.get("ratio_vs_bf16_adamw"), 2, "x")) for r in res["timing"]]
    notes = [f"Random-init Llama: hidden {c['hidden']}, intermediate {c['intermediate']}, {c['layers']} layers, "
             f"{c['heads']} heads, vocab {c['vocab']}; seq {c['seq']}, batch 1, gradient checkpointing "
             f"{'on (non-reentrant)' if c['grad_ckpt'] else 'off'}. GiB = 2^30 B."]
    if tim:
        notes += ["", f"## Step time vs bf16 AdamW ({res['timing'][0].get('layers', c['time_layers'])} layers, same "
                      f"shapes; interleaved, {c['rounds']} rounds after 1 warm-up step each)", ""] + table(tim, TIMING)
    notes += ["", "## Notes"] + [f"- {n}" for n in res["notes"]]
    write(c.get("name", "qft_memory"), res["memory"], MEMORY, "\n".join(notes), out_dir=out_dir, facts=res["facts"],
          extra={k: v for k, v in res.items() if k not in ("facts", "memory")}, md_rows=mem,
          title="QFT Table 1: training memory, LLaMA-2-7B-shaped")


def main():
    ap = add_args(argparse.ArgumentParser())
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=11008)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--methods", default=",".join(ALL))
    ap.add_argument("--time-layers", type=int, default=8, help="layers of the step-time comparison (0: skip it)")
    ap.add_argument("--fallback-layers", default="2,4")
    ap.add_argument("--no-grad-ckpt", dest="grad_ckpt", action="store_false")
    ap.add_argument("--budget-s", type=float, default=500.0, help="start no new row after this many seconds")
    ap.add_argument("--mem-limit-gib", type=float, default=None,
                    help="device memory assumed for the fits-or-extrapolate decision (default: the GPU's)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--name", default="qft_memory", help="basename of the .json/.md written to --out")
    a = ap.parse_args()
    methods = [m for m in a.methods.split(",") if m]
    bad = [m for m in methods if m not in ALL]
    if bad:
        ap.error(f"unknown methods {bad}; allowed {ALL}")
    if a.rounds < 3:
        ap.error("--rounds must be >= 3")
    a.fallback_layers = tuple(int(x) for x in a.fallback_layers.split(","))
    a.time_layers = min(a.time_layers, a.layers)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    total_mem = torch.cuda.get_device_properties(dev).total_memory if cuda else 0
    if a.mem_limit_gib:
        total_mem = int(a.mem_limit_gib * GIB)
    import transformers
    notes = [
        "weights / gradients / optimizer states: bytes of the tensors held (hfq.qft.state_bytes: QParam codes, "
        "scales, zero points, thresholds and bf16 outliers; INT8 gradient stores; every tensor in optimizer.state), "
        "gradients taken at the end of backward (qft_sib: none exist then).",
        "activations = peak - weights - gradients - optimizer states: it also holds every temporary of the step "
        "(logits and loss, per-layer dequantized weights, optimizer working copies, the per-layer fp32 gradient "
        "inside backward), so it is larger than the paper's activation column.",
        "fp32-weight rows compute under torch.autocast(bfloat16, cache_enabled=False): no bf16 weight copies are "
        "cached across the forward.",
        "eco: ECOAdamW defaults (fp32 moments, SR; fused Triton step on CUDA); qft / qft_sib: QLion defaults "
        "(INT8 momentum, SR weight requantization); qft_sib uses hfq.qft.step_in_backward_.",
        "paper Table 1 (LLaMA-2-7B, GB; weights / grads / weight copies / momentum / variances / activation / total "
        "/ peak): Adam-FP32 25.1 / 25.1 / - / 25.1 / 25.1 / 3.75 / 104 / 129; Bitsandbytes 25.1 / 25.1 / - / 6.31 / "
        "6.31 / 3.75 / 66.6 / 86.6; Lion-FP32 25.1 / 25.1 / - / 25.1 / - / 3.75 / 79.1 / 101; QFT 7.42 / 7.06 / - / "
        "7.06 / - / 3.75 / 25.3 / 28.9.",
        "step s (1 run) in the memory table: the measured step of that row (after one warm-up step), not "
        "interleaved; the interleaved comparison is the step-time table.",
        "bitsandbytes: " + ("installed" if _has_bnb() else "not installed: its row is empty"),
    ]
    if not cuda:
        notes.append("CPU run: no allocator peak; weights / gradients / states from tensor sizes only, peak and "
                     "activations empty; step times are CPU times.")
    res = dict(facts=dict(run_facts(), transformers=transformers.__version__),
               total_memory_gib=total_mem / GIB if total_mem else None,
               config=dict(hidden=a.hidden, intermediate=a.intermediate, layers=a.layers, heads=a.heads,
                           kv_heads=a.kv_heads or a.heads, vocab=a.vocab, seq=a.seq, batch=1, grad_ckpt=a.grad_ckpt,
                           rounds=a.rounds, time_layers=a.time_layers, fallback_layers=list(a.fallback_layers),
                           methods=methods, name=a.name),
               memory=[], timing=[], notes=notes)
    save(res, a.out)
    for m in methods:
        if time.time() - T0 > a.budget_s:
            res["memory"].append(dict(method=m, status="skipped: time budget"))
            save(res, a.out)
            continue
        log(f"memory {m}")
        try:
            r = memory_row(m, a, dev, total_mem)
        except Exception as e:  # noqa: BLE001 - record and go on: the other rows still count
            traceback.print_exc()
            r = dict(method=m, status=f"failed: {type(e).__name__}: {str(e)[:300]}")
        free(dev)
        res["memory"].append(r)
        log(f"memory {m}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                        for k, v in r.items() if k != "measured"))
        save(res, a.out)
    if a.time_layers > 0 and "bf16_adamw" in methods and len(methods) > 1:
        def cb(rows):
            res["timing"] = rows
            save(res, a.out)
        log(f"step time at {a.time_layers} layers")
        try:
            timing_pairs(methods, a, dev, cb)
        except Exception as e:  # noqa: BLE001 - the baseline itself failed
            traceback.print_exc()
            res["notes"].append(f"step-time comparison failed: {type(e).__name__}: {str(e)[:300]}")
        save(res, a.out)
    log("done")


if __name__ == "__main__":
    main()
