"""QFT's INT8 kernels (hfq_kernels.int8) against the torch ops they replace, on LLaMA-2-7B shapes, same run,
interleaved, >= 3 repeats: decode of an int8_dense_sparse weight, INT8 gradient quantization (+ accumulation),
the QLion step, and one QFT linear forward+backward against bf16 nn.Linear.

    python benchmarks/qft_kernels.py [--repeats 5 --out DIR]     (device; writes qft_kernels.{json,md})
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]  # [out, in]: q/k/v/o, gate/up, down


def timed(fn, iters):
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters * 1e3  # us


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


def _layer_step(rounding="sr"):
    """QLion's step over one LLaMA-2-7B layer's seven int8_dense_sparse weights (INT8 gradients), and fused bf16
    AdamW's over the same shapes: two callables."""
    from hfq.qft import QLion
    from hfq.qparam import Int8Grad, QParam

    shapes = [(4096, 4096)] * 4 + [(11008, 4096)] * 2 + [(4096, 11008)]
    ps, stores = [], []
    for shape in shapes:
        w = torch.randn(*shape, device="cuda") * 0.02
        ps.append(torch.nn.Parameter(QParam.from_float(w, "int8_dense_sparse", outlier_fraction=0.01)))
        stores.append(Int8Grad(torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 1e-3))
    opt = QLion(ps, lr=1e-5, rounding=rounding)
    bf = [torch.nn.Parameter(torch.randn(*s, device="cuda", dtype=torch.bfloat16) * 0.02) for s in shapes]
    for p in bf:
        p.grad = torch.randn_like(p) * 1e-3
    adam = torch.optim.AdamW(bf, lr=1e-5, fused=True)

    def qlion():
        for p, st in zip(ps, stores):
            p.grad = st
        opt.step()

    return qlion, adam.step


def sweep(args):
    """QLion's multi-tensor step on one 7B layer: (elements per inner step, warps) of the statistics and write
    kernels, loads issued a block ahead or not, SR or RTN, against fused bf16 AdamW over the same shapes,
    interleaved."""
    from hfq_kernels import qlion as Q

    qlion, adam = _layer_step()
    rtn, _ = _layer_step(rounding="rtn")
    default = dict(Q.LAUNCH), Q.PREFETCH
    # (block, warps) of the statistics and of the write kernel, prefetch, rounding
    cfgs = [((1024, 8), (1024, 8), False, "sr"), ((256, 1), (512, 2), True, "sr"), ((256, 1), (256, 1), True, "sr"),
            ((128, 1), (512, 2), True, "sr"), ((256, 1), (512, 2), False, "sr"), ((256, 1), (512, 2), True, "rtn")]
    times = {i: [] for i in range(len(cfgs))}
    t_adam = []
    for _ in range(args.repeats):
        for i, (sb, wb, pf, rnd) in enumerate(cfgs):
            Q.LAUNCH["stats"], Q.LAUNCH["write"], Q.PREFETCH = sb, wb, pf
            fn = qlion if rnd == "sr" else rtn
            fn()
            times[i].append(timed(fn, 5))
        t_adam.append(timed(adam, 5))
    Q.LAUNCH.update(default[0])
    Q.PREFETCH = default[1]
    t_adam.sort()
    a = t_adam[len(t_adam) // 2]
    rows = []
    for i, (sb, wb, pf, rnd) in enumerate(cfgs):
        t = sorted(times[i])
        rows.append(dict(stats=sb, write=wb, prefetch=pf, rounding=rnd, us=t[len(t) // 2], spread=[t[0], t[-1]],
                         adamw_us=a, ratio=t[len(t) // 2] / a))
        print(rows[-1], flush=True)
    rows += _sweep_rows(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "qft_kernels_sweep.json"), "w") as f:
        json.dump(rows, f, indent=1)


def _sweep_rows(args):
    """Launch shapes of the INT8 gradient (one 7B layer's seven gradients, accumulating) and of QLion's plain step
    (an embedding-sized bf16 parameter), interleaved."""
    from hfq_kernels import int8 as K
    from hfq_kernels import qlion as Q

    shapes = [(4096, 4096)] * 4 + [(11008, 4096)] * 2 + [(4096, 11008)]
    gs = [torch.randn(*s, device="cuda", dtype=torch.bfloat16) * 1e-3 for s in shapes]
    st = [(torch.zeros(*s, dtype=torch.uint8, device="cuda"), torch.ones(s[0], 1, device="cuda"),
           torch.zeros(s[0], 1, dtype=torch.uint8, device="cuda")) for s in shapes]

    def quant():
        for g, (c, sc, z) in zip(gs, st):
            K.int8_quantize_rows_(g, c, sc, z, accumulate=True)

    p = torch.randn(32000, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    g = torch.randn_like(p) * 1e-3
    mom = dict(codes=torch.full((32000, 4096), 128, dtype=torch.uint8, device="cuda"),
               scales=torch.full((32000, 1), 1e-5, device="cuda"), zeros=torch.full((32000, 1), 128, dtype=torch.uint8,
                                                                                       device="cuda"))

    def plain():
        Q.lion_plain_step_(p, g, mom, lr=1e-6, beta1=0.9, beta2=0.99, weight_decay=0.0)

    # (kernel, module, launch shape, rows up to this length read once: INT8 gradient only)
    cases = [("quant", K, (1024, 4), 0), ("quant", K, (1024, 4), 16384), ("plain", Q, (1024, 8), None),
             ("plain", Q, (1024, 4), None)]
    fns = {"quant": quant, "plain": plain}
    default = {"quant": K.LAUNCH["quant"], "plain": Q.LAUNCH["plain"]}
    one_default = K.ONE_PASS_MAX
    times = {i: [] for i in range(len(cases))}
    for _ in range(args.repeats):
        for i, (name, mod, cfg, one) in enumerate(cases):
            mod.LAUNCH[name] = cfg
            K.ONE_PASS_MAX = one_default if one is None else one
            fns[name]()
            times[i].append(timed(fns[name], 5))
            mod.LAUNCH[name] = default[name]
    K.ONE_PASS_MAX = one_default
    rows = []
    for i, (name, _, cfg, one) in enumerate(cases):
        t = sorted(times[i])
        rows.append(dict(kernel=name, launch=cfg, one_pass_max=one, us=t[len(t) // 2], spread=[t[0], t[-1]]))
        print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--sweep", action="store_true", help="time launch choices of QLion's kernels (hfq_kernels.qlion) and exit")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.sweep:
        return sweep(args)
    rows = []
    for shape in SHAPES:
        for name, (base, ours) in cases(shape, args.tokens).items():
            base(), ours()
            tb, to = [], []
            for _ in range(args.repeats):  # interleaved
                tb.append(timed(base, 10))
                to.append(timed(ours, 10))
            tb.sort(), to.sort()
            med_b, med_o = tb[len(tb) // 2], to[len(to) // 2]
            rows.append(dict(op=name, shape=list(shape), baseline_us=med_b, ours_us=med_o, speedup=med_b / med_o,
                             baseline_spread_us=[tb[0], tb[-1]], ours_spread_us=[to[0], to[-1]]))
            print(rows[-1], flush=True)
            torch.cuda.empty_cache()
    commit = os.environ.get("HFQ_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                            text=True).stdout.strip()
    meta = dict(device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                commit=commit or os.environ.get("HFQ_COMMIT", "?"), repeats=args.repeats, tokens=args.tokens)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "qft_kernels.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# QFT INT8 kernels vs torch ops ({meta['device']}, {meta['date']}, commit {meta['commit']})", "",
             "Baseline: the torch ops hfq ran before (decode, INT8 gradient, QLion) and bf16 nn.Linear (linear "
             f"fwd+bwd at M={args.tokens}). Median of {args.repeats} interleaved repeats of 10 calls; spread min-max.",
             "", "| op | shape [out,in] | baseline us | ours us | speed-up | spread baseline | spread ours |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['shape']} | {r['baseline_us']:.0f} | {r['ours_us']:.0f} | "
                     f"{r['speedup']:.2f}x | {r['baseline_spread_us'][0]:.0f}-{r['baseline_spread_us'][1]:.0f} | "
                     f"{r['ours_spread_us'][0]:.0f}-{r['ours_spread_us'][1]:.0f} |")
    with open(os.path.join(args.out, "qft_kernels.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
