"""QFT's INT8 kernels (hfq_kernels.int8) against the torch ops they replace, on LLaMA-2-7B shapes, same run,
interleaved, >= 3 rounds: decode of an int8_dense_sparse weight, INT8 gradient quantization (+ accumulation),
the QLion step, and one QFT linear forward+backward against bf16 nn.Linear.

    python benchmarks/qft_kernels.py [--rounds 5 --out DIR]     (device; writes qft_kernels.{json,md})
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import add_args, interleaved, ratio, write  # noqa: E402

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]  # [out, in]: q/k/v/o, gate/up, down


def cases(shape, tokens):
    import hfq.qparam as qp
    from hfq.qparam import Int8Grad, QParam
    from hfq.qft import QLion
    from hfq_kernels import int8 as K
    from hfq_kernels.reference import intq

    out_f, in_f = shape
    w = torch.randn(out_f, in_f, device="cuda") * 0.02
    p = QParam.from_float(w, "int8_dense_sparse", outlier_fraction=0.01)
    d = p.qtensors()
    g = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) * 1e-3
    store = Int8Grad(g)
    x = torch.randn(tokens, in_f, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    lin = torch.nn.Linear(in_f, out_f, bias=False, device="cuda", dtype=torch.bfloat16)
    pq = torch.nn.Parameter(p, requires_grad=True)
    c = torch.empty_like(d["codes"])
    s, z = torch.empty_like(d["scales"]), torch.empty_like(d["zeros"])

    def deq_ref():
        intq.dequantize_dense_sparse(d["codes"], d["scales"], d["zeros"], d["sparse_idx"], d["sparse_val"],
                                     torch.bfloat16)

    def deq_ours():
        K.int8_dequantize(d["codes"], d["scales"], d["zeros"], d["sparse_idx"], d["sparse_val"])

    def gq_ref():
        intq.quantize_int_asym(g.float() + intq.dequantize_int_asym(c, s, z), 8, check=False)

    def gq_ours():
        K.int8_quantize_rows_(g, c, s, z, accumulate=True)

    K.int8_quantize_rows_(g, c, s, z)
    opts = {f: QLion([pq], lr=1e-5, fused=f) for f in (False, True)}

    def lion(fused):
        def run():
            pq.grad = store
            opts[fused].update_param_(pq, store if fused else store.dequantize(), opts[fused].param_groups[0])
        return run

    def fb_bf16():
        lin(x).sum().backward()

    def fb_qft():
        qp.qlinear(x, pq, store_int8=True).sum().backward()
        pq.grad = None

    return {"decode": (deq_ref, deq_ours), "int8_grad_accumulate": (gq_ref, gq_ours),
            "qlion_step": (lion(False), lion(True)), f"linear_fwd_bwd_M{tokens}": (fb_bf16, fb_qft)}


def main():
    ap = add_args(argparse.ArgumentParser())
    ap.add_argument("--tokens", type=int, default=2048)
    ap.set_defaults(rounds=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for shape in SHAPES:
        for name, (base, ours) in cases(shape, args.tokens).items():
            t = interleaved({"baseline": base, "ours": ours}, rounds=args.rounds, warmup=1, inner=10)
            b, o = ({k: v * 1e6 for k, v in t[n].items() if k in ("median", "min", "max")} for n in ("baseline", "ours"))
            q = ratio(t["baseline"], t["ours"])
            rows.append(dict(op=name, shape=list(shape), baseline_us=round(b["median"]), ours_us=round(o["median"]),
                             speedup=f"{q['ratio']:.2f}x", speedup_range=f"{q['ratio_min']:.2f}-{q['ratio_max']:.2f}",
                             baseline_spread_us=f"{b['min']:.0f}-{b['max']:.0f}",
                             ours_spread_us=f"{o['min']:.0f}-{o['max']:.0f}"))
            print(rows[-1], flush=True)
            torch.cuda.empty_cache()
    notes = ("Baseline: the torch ops hfq ran before (decode, INT8 gradient, QLion) and bf16 nn.Linear (linear fwd+bwd "
             f"at M={args.tokens}). Median of {args.rounds} interleaved rounds of 10 calls; spread min-max.")
    columns = {"op": "op", "shape": "shape [out,in]", "baseline_us": "baseline us", "ours_us": "ours us",
               "speedup": "speed-up", "speedup_range": "speed-up range", "baseline_spread_us": "spread baseline",
               "ours_spread_us": "spread ours"}
    write("qft_kernels", rows, columns, notes, out_dir=args.out, title="QFT INT8 kernels vs torch ops",
          extra={"rounds": args.rounds, "tokens": args.tokens})


if __name__ == "__main__":
    main()
