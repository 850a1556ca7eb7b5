"""NVFP4 grad-input at few rows: the g4 kernel that decodes codes in registers (hfq_kernels.nvfp4_grad) vs
dequantize_g4 + cuBLAS, on 7B shapes at M = 1, 8, 16.

    python benchmarks/nvfp4_grad_input.py [--out DIR] [--rounds 3]      # device
    python benchmarks/nvfp4_grad_input.py --device cpu --quick          # end-to-end check (interpreter, tiny)

Two timings per route, interleaved (kernel, dequant, kernel, dequant, ...) over --rounds rounds: "gpu" replays
a CUDA graph of 20 calls (GPU time, no host work), "eager" is 100 back-to-back calls and one sync (host work
included). us per call: median (min-max over rounds); x = dequant time / kernel time. Every row first checks
the kernel against dequantize + matmul (relative error).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import add_args, interleaved, ratio, write  # noqa: E402

SHAPES = [(18944, 3584), (3584, 18944), (3584, 3584)]  # weight [out, in]: gate/up, down, q/o
MS = [1, 8, 16]


def _graphed(fn, calls: int):
    """A callable replaying a CUDA graph of `calls` calls of fn (captured after a warm-up on a side stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g.replay


def _us(t: dict, per: int) -> dict:
    return {k: t[k] * 1e6 / per for k in ("median", "min", "max")}


def row(n: int, k: int, m: int, dev: str, rounds: int, quick: bool) -> dict:
    from hfq.nvfp4 import NVFP4Linear
    from hfq_kernels.nvfp4_gluon import dequantize_g4
    from hfq_kernels.nvfp4_grad import grad_input_g4_fused

    lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    lay = NVFP4Linear.from_linear(lin).to_g4_layout_()
    wr, sr, gs = lay.weight_g4, lay.weight_g4_scale, lay.weight_global_scale
    g = torch.randn(m, n, device=dev, dtype=torch.bfloat16)

    def fused():
        return grad_input_g4_fused(g, wr, sr, gs, n, k)

    def dequant():
        return g @ dequantize_g4(wr, sr, gs, n, k, torch.bfloat16)

    ref = dequant().float()
    err = float((fused().float() - ref).norm() / ref.norm())
    out = dict(N=n, K=k, M=m, rel_err=round(err, 5))
    if err > 1e-2:
        raise AssertionError(f"grad-input kernel disagrees with dequantize + matmul at {out}")
    modes = [("eager", 3 if quick else 100, None)] + ([] if dev == "cpu" else [("gpu", 20, _graphed)])
    for mode, per, wrap in modes:
        fns = {"kernel": fused, "dequant": dequant}
        if wrap is not None:
            fns = {name: wrap(fn, per) for name, fn in fns.items()}
            inner = 1
        else:
            inner = per
        t = interleaved(fns, rounds=rounds, warmup=2, inner=inner)
        us = {name: _us(v, per if wrap is not None else 1) for name, v in t.items()}
        q = ratio(t["kernel"], t["dequant"])  # dequant / kernel
        for name in fns:
            out[f"{mode}_{name}_us"] = round(us[name]["median"], 2)
            out[f"{mode}_{name}_range"] = f"{us[name]['min']:.2f}-{us[name]['max']:.2f}"
        out[f"{mode}_x"] = f"{1 / q['ratio']:.2f} ({1 / q['ratio_max']:.2f}-{1 / q['ratio_min']:.2f})"
    return out


COLUMNS = {"N": "out", "K": "in", "M": "M", "gpu_kernel_us": "gpu kernel us", "gpu_kernel_range": "range",
           "gpu_dequant_us": "gpu dequant+mm us", "gpu_dequant_range": "range", "gpu_x": "gpu x",
           "eager_kernel_us": "eager kernel us", "eager_kernel_range": "range",
           "eager_dequant_us": "eager dequant+mm us", "eager_dequant_range": "range", "eager_x": "eager x",
           "rel_err": "rel err"}


def main():
    ap = add_args(argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, few calls (a CPU end-to-end check)")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("nvfp4_grad_input: no CUDA device (use --device cpu --quick for a CPU check)")
    shapes, ms = ([(48, 96)], [3]) if a.quick else (SHAPES, MS)
    rows = []
    for n, k in shapes:
        for m in ms:
            rows.append(row(n, k, m, a.device, a.rounds, a.quick))
            print(rows[-1], flush=True)
    notes = ("x = dequant time / kernel time (> 1: the kernel is faster; range: worst to best pairing of rounds). "
             "gpu: CUDA-graph replay of 20 calls (no host work); eager: 100 back-to-back calls, one sync. NVFP4Linear "
             "takes the kernel for <= 16 bf16 rows (hfq_kernels.nvfp4_grad.fused_ok).")
    print(write("nvfp4_grad_input", rows, COLUMNS, notes, out_dir=a.out,
                title="NVFP4 grad-input at few rows: g4 decode kernel vs dequantize + cuBLAS")[1])


if __name__ == "__main__":
    main()
