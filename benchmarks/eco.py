"""ECO optimizer step on a 1B-shaped Llama (16 layers, hidden 2048, intermediate 8192, 8 kv-heads x 64... the
linear weights only): ECOAdamW (fused Triton, FP8 weights, no master weights) vs torch.optim.AdamW(fused=True)
on bf16 and fp32 weights, measured in the same run; plus static bytes per parameter (weights + optimizer
state) for each configuration. Writes <out>/eco.json and <out>/eco.md.

  python benchmarks/eco.py --out benchmarks/results          # on the GPU
  python benchmarks/eco.py --tiny --out /tmp/eco_bench       # CPU smoke run (interpreter)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import time

import torch

from hfq.eco import ECOAdamW
from hfq_kernels.reference.fp8 import quantize_fp8_row
from hfq.qparam import QParam


def shapes_1b(layers=16, hidden=2048, inter=8192, kv=512):
    per = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden),
           (hidden, inter)]
    return per * layers


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def time_step(opt, dev, warmup=3, iters=10):
    for _ in range(warmup):
        opt.step()
    _sync(dev)
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            opt.step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t = time.perf_counter()
    for _ in range(iters):
        opt.step()
    return (time.perf_counter() - t) * 1e3 / iters


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
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
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
        ms = time_step(opt, dev, warmup=1 if "reference" in name else 3,
                       iters=max(1, iters // 5) if "reference" in name else iters)
        wb, sb = weight_bytes(params), state_bytes(opt)
        rows.append({"config": name, "step_ms": round(ms, 3), "weight_bytes_per_param": round(wb / n, 4),
                     "state_bytes_per_param": round(sb / n, 4), "static_bytes_per_param": round((wb + sb) / n, 4)})
        print(rows[-1], flush=True)
        del params, opt
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    base = rows[0]["step_ms"]
    for r in rows:
        r["ratio_vs_adamw_bf16_fused"] = round(r["step_ms"] / base, 3)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    commit = os.environ.get("HFQ_COMMIT", commit) or "unknown"
    device = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    res = {"device": device, "date": datetime.date.today().isoformat(), "commit": commit,
           "shapes": "1B-shaped Llama linears: 16 x [q,o 2048x2048; k,v 512x2048; gate,up 8192x2048; "
                     "down 2048x8192]" if not args.tiny else str(shapes),
           "n_params": n, "torch": torch.__version__, "rows": rows}
    if dev.type == "cuda":
        res["correctness_fused_vs_reference_rtn"] = check_fused_matches_reference(dev)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "eco.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = [f"# ECO optimizer step: {res['device']}, {res['date']}, commit {res['commit']}", "",
             f"Shapes: {res['shapes']} ({n / 1e9:.3f} B params). Step time = one optimizer.step() over all of them "
             f"(grads already present), CUDA events, mean of {iters} steps.", "",
             "| configuration | step (ms) | vs AdamW bf16 fused | weights B/param | states B/param | static B/param |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['step_ms']:.2f} | {r['ratio_vs_adamw_bf16_fused']:.2f}x | "
                     f"{r['weight_bytes_per_param']:.3f} | {r['state_bytes_per_param']:.3f} | "
                     f"{r['static_bytes_per_param']:.3f} |")
    if "correctness_fused_vs_reference_rtn" in res:
        lines += ["", "Fused vs torch reference (RTN, one step): " + json.dumps(res["correctness_fused_vs_reference_rtn"])]
    with open(os.path.join(args.out, "eco.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
