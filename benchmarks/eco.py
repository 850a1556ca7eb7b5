"""ECO optimizer step on a 1B-shaped Llama (16 layers, hidden 2048, intermediate 8192, 8 kv-heads x 64... the
linear weights only): ECOAdamW (fused Triton, FP8 weights, no master weights) vs torch.optim.AdamW(fused=True)
on bf16 and fp32 weights, measured in the same run; plus static bytes per parameter (weights + optimizer
state) for each configuration. Writes <out>/eco.json and <out>/eco.md.

  python benchmarks/eco.py --out benchmarks/results          # on the GPU
  python benchmarks/eco.py --tiny --out /tmp/eco_bench       # CPU smoke run (interpreter)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import add_args, interleaved, write  # noqa: E402

from hfq.eco import ECOAdamW
from hfq_kernels.reference.fp8 import quantize_fp8_row
from hfq.qparam import QParam


def shapes_1b(layers=16, hidden=2048, inter=8192, kv=512):
    per = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden),
           (hidden, inter)]
    return per * layers


def time_step(opt, rounds, warmup=3, iters=10) -> dict:
    """ms per optimizer.step(): `rounds` rounds of `iters` back-to-back steps (median, min, max, spread)."""
    t = interleaved({"step": opt.step}, rounds=rounds, warmup=warmup, inner=iters)["step"]
    return {k: t[k] * 1e3 if k in ("median", "min", "max") else t[k] for k in ("median", "min", "max", "spread")}


def make_params(shapes, dev, kind, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    params = []
    for s in shapes:
        w = torch.randn(s, device=dev, generator=g) * 0.02
        if kind == "fp8":
            p = torch.nn.Parameter(QParam.from_float(w, "fp8_e4m3_row"))
        else:
            p = torch.nn.Parameter(w.to(torch.bfloat16 if kind == "bf16" else torch.float32))
        p.grad = (torch.randn(s, device=dev, generator=g) * 1e-3).to(torch.bfloat16 if kind != "fp32" else
                                                                       torch.float32)
        params.append(p)
        del w
    return params


def state_bytes(opt):
    return sum(t.numel() * t.element_size() for st in opt.state.values() for k, t in st.items()
               if torch.is_tensor(t) and k != "step")


def weight_bytes(params):
    return sum(p.storage_bytes if isinstance(p, QParam) else p.numel() * p.element_size() for p in params)


def check_fused_matches_reference(dev):
    """GPU correctness in the same run: fused Triton vs torch reference (RTN) on a 1B-layer shape."""
    from hfq_kernels.eco import eco_adamw_fp8_step_ref, eco_adamw_fp8_step_triton
    from hfq_kernels.reference.fp8 import dequantize_fp8_row
    g = torch.Generator(device=dev).manual_seed(1)
    out = {}
    for shape in ((2048, 8192), (8192, 2048), (300, 12289)):
        codes, scales = quantize_fp8_row(torch.randn(shape, device=dev, generator=g))
        grad = torch.randn(shape, device=dev, generator=g).bfloat16()
        m = torch.randn(shape, device=dev, generator=g) * 0.1
        v = torch.rand(shape, device=dev, generator=g) * 0.01
        kw = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=5, rounding="rtn")
        a = [codes.clone(), scales.clone(), grad, m.clone(), v.clone()]
        b = [codes.clone(), scales.clone(), grad, m.clone(), v.clone()]
        eco_adamw_fp8_step_triton(*a, **kw)
        eco_adamw_fp8_step_ref(*b, **kw)
        eq = (a[0].view(torch.uint8) == b[0].view(torch.uint8)).float().mean().item()
        rel_m = ((a[3] - b[3]).norm() / b[3].norm()).item()
        da, db = dequantize_fp8_row(a[0], a[1]), dequantize_fp8_row(b[0], b[1])
        out[str(shape)] = {"codes_equal_frac": eq, "rel_err_exp_avg": rel_m,
                           "max_abs_weight_diff": (da - db).abs().max().item()}
    return out


def main():
    ap = add_args(argparse.ArgumentParser())
    ap.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke run)")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = [(64, 128), (32, 128), (128, 64)] if args.tiny else shapes_1b()
    n = sum(a * b for a, b in shapes)
    iters = 2 if args.tiny else args.iters
    rows = []
    configs = [
        ("torch AdamW(fused=True), bf16 weights + bf16 states", "bf16", lambda p: torch.optim.AdamW(
            p, lr=1e-3, weight_decay=0.1, fused=dev.type == "cuda")),
        ("torch AdamW(fused=True), fp32 master weights + fp32 states", "fp32", lambda p: torch.optim.AdamW(
            p, lr=1e-3, weight_decay=0.1, fused=dev.type == "cuda")),
        ("ECOAdamW fused, FP8 weights, fp32 states, SR", "fp8", lambda p: ECOAdamW(
            p, lr=1e-3, weight_decay=0.1, rounding="sr", fused=True)),
        ("ECOAdamW fused, FP8 weights, fp32 states, RTN", "fp8", lambda p: ECOAdamW(
            p, lr=1e-3, weight_decay=0.1, rounding="rtn", fused=True)),
        ("ECOAdamW fused, FP8 weights, bf16 states, SR", "fp8", lambda p: ECOAdamW(
            p, lr=1e-3, weight_decay=0.1, rounding="sr", fused=True, state_dtype=torch.bfloat16)),
        ("ECOAdamW torch reference, FP8 weights, bf16 states, SR", "fp8", lambda p: ECOAdamW(
            p, lr=1e-3, weight_decay=0.1, rounding="sr", fused=False, state_dtype=torch.bfloat16)),
        ("ECOAdamW torch reference, FP8 weights, 8-bit states, SR", "fp8", lambda p: ECOAdamW(
            p, lr=1e-3, weight_decay=0.1, rounding="sr", fused=False, state_bits=8)),
    ]
    for name, kind, mk in configs:
        params = make_params(shapes, dev, kind)
        opt = mk(params)
        t = time_step(opt, args.rounds, warmup=1 if "reference" in name else 3,
                      iters=max(1, iters // 5) if "reference" in name else iters)
        wb, sb = weight_bytes(params), state_bytes(opt)
        rows.append({"config": name, "step_ms": round(t["median"], 3), "step_ms_range":
                     f"{t['min']:.2f}-{t['max']:.2f}", "spread": round(t["spread"], 3),
                     "weight_bytes_per_param": round(wb / n, 4),
                     "state_bytes_per_param": round(sb / n, 4), "static_bytes_per_param": round((wb + sb) / n, 4)})
        print(rows[-1], flush=True)
        del params, opt
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    base = rows[0]["step_ms"]
    for r in rows:
        r["ratio_vs_adamw_bf16_fused"] = round(r["step_ms"] / base, 3)
    shapes_txt = ("1B-shaped Llama linears: 16 x [q,o 2048x2048; k,v 512x2048; gate,up 8192x2048; down 2048x8192]"
                  if not args.tiny else str(shapes))
    extra = {"shapes": shapes_txt, "n_params": n}
    notes = (f"Shapes: {shapes_txt} ({n / 1e9:.3f} B params). Step time = one optimizer.step() over all of them "
             f"(grads already present): median over {args.rounds} rounds of {iters} back-to-back steps (torch-reference "
             "rows: a fifth of them), range min-max over the rounds.")
    if dev.type == "cuda":
        extra["correctness_fused_vs_reference_rtn"] = check_fused_matches_reference(dev)
        notes += "\n\nFused vs torch reference (RTN, one step): " + json.dumps(extra["correctness_fused_vs_reference_rtn"])
    columns = {"config": "configuration", "step_ms": "step (ms)", "step_ms_range": "range",
               "spread": "spread", "ratio_vs_adamw_bf16_fused": "vs AdamW bf16 fused",
               "weight_bytes_per_param": "weights B/param", "state_bytes_per_param": "states B/param",
               "static_bytes_per_param": "static B/param"}
    _, md = write("eco", rows, columns, notes, out_dir=args.out, title="ECO optimizer step", extra=extra)
    print(open(md).read())


if __name__ == "__main__":
    main()
