"""A/B of QFT step variants on one 7B-shaped model (8 layers), steps interleaved, GC off while timing:
the INT8 gradient kernel's one-pass rows on/off, and a host sync right before QLion.step (the step's former
two-sync structure) or not. python benchmarks/qft_ab.py (device)."""
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
    from hfq_kernels import int8 as K

    model, opt = q._model("qft", layers)
    base, bopt = q._model("bf16_adamw", layers)
    ids = torch.randint(0, 32000, (1, 2048), device="cuda")

    def step(m, o, one=16384, pre_sync=False):
        K.ONE_PASS_MAX = one
        torch.cuda.synchronize()
        t = time.perf_counter()
        m(input_ids=ids, labels=ids).loss.backward()
        if pre_sync:
            torch.cuda.synchronize()
        o.step()
        o.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    variants = {"qft": dict(), "qft_two_pass_quant": dict(one=0), "qft_sync_before_step": dict(pre_sync=True)}
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
        print(f"{k:24s} median {1e3 * m:7.1f} ms  min {1e3 * min(t):7.1f}  max {1e3 * max(t):7.1f}  x bf16 {m / b:.3f}")


if __name__ == "__main__":
    main()
