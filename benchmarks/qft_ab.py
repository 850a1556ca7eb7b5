"""A/B of QFT step variants on one 7B-shaped model (8 layers), steps interleaved, GC off while timing:
QLion's in-kernel merge sizes (three buckets compiled at first use, or every power of two compiled when first
needed). python benchmarks/qft_ab.py (device)."""
from __future__ import annotations

import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main(layers=8, repeats=7):
    import qft_profile as q
    model, opt = q._model("qft", layers)
    base, bopt = q._model("bf16_adamw", layers)
    ids = torch.randint(0, 32000, (1, 2048), device="cuda")

    from hfq_kernels import qlion as Q

    def step(m, o, buckets=Q.SEG_BUCKETS, precompile=True):
        Q.SEG_BUCKETS, Q.PRECOMPILE = buckets, precompile
        torch.cuda.synchronize()
        t = time.perf_counter()
        m(input_ids=ids, labels=ids).loss.backward()
        o.step()
        o.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    variants = {"qft": dict(), "qft_pow2_merge": dict(buckets=tuple(2 ** i for i in range(4, 13)), precompile=False)}
    for v in variants.values():
        step(model, opt, **v)
    step(base, bopt)
    gc.collect()
    gc.disable()
    res = {k: [] for k in list(variants) + ["bf16_adamw"]}
    for _ in range(repeats):
        for k, v in variants.items():
            res[k].append(step(model, opt, **v))
        res["bf16_adamw"].append(step(base, bopt))
    gc.enable()
    b = statistics.median(res["bf16_adamw"])
    for k, t in res.items():
        m = statistics.median(t)
        print(f"{k:24s} median {1e3 * m:7.1f} ms  min {1e3 * min(t):7.1f}  max {1e3 * max(t):7.1f}  x bf16 {m / b:.3f}"
              f"  steps {[round(1e3 * x, 1) for x in t]}")


if __name__ == "__main__":
    main()
