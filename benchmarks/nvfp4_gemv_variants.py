"""Decode-path (M <= 64) variants of the NVFP4 W4A16 matmul on the GPU: correctness + timings per config.

    python benchmarks/nvfp4_gemv_variants.py --out $OUT

Compares the g4 kernel (Gluon, repacked weights, bf16 MMA straight from registers) over R (row tiles per warp),
warps and split-K against the previous decode kernel (shipped tuned choice) and BF16 cuBLAS. Every config is
checked against a float64 reference of the dequantized product (rel. Frobenius <= 1e-2, NaN-poisoned outputs)
and timed in a CUDA graph over rotated weight copies (> 3x L2). Writes variants.json + the winners as a table.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hfq_kernels.reference import fp4  # noqa: E402
from hfq_kernels import nvfp4 as K  # noqa: E402
from nvfp4_matmul import SHAPES, graph_us, make_weights, n_copies, nvfp4_bytes, rel_err  # noqa: E402

COPY_GBPS = 3007.6


def g4_cands(m, n, k):
    d = K._g4_default(m, n, k)
    out = []
    for r, warps in ((1, 4), (2, 4), (4, 4), (2, 8), (1, 8)):
        tiles = -(-(-(-n // 16)) // (r * warps)) * -(-m // d["BM"])
        kc = -(-k // 64)
        base = max(1, min(kc, -(-264 // tiles)))
        for split in sorted({max(1, base // 2), base, min(kc, base * 2)}):
            out.append(dict(kind="g4", BM=d["BM"], R=r, warps=warps, split=split))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,8,16")
    ap.add_argument("--shapes", default="all")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    t0 = time.time()
    fails = []
    # correctness on awkward shapes: odd M, K and N multiples of 16 but not of 64 / 16-row tiles, bias, subnormal scales
    for (k, n) in ((3584 + 16, 528), (208, 40), (5120, 1024)):
        w = torch.randn(n, k, device=dev, generator=gen) * 0.02
        w[3, :32] = 0
        w[5, 16:48] *= 1e-6
        p, s, r = K.quantize(w.to(torch.bfloat16))
        wf = fp4.nvfp4_dequantize(p, s, r, torch.float32).double()
        bias = torch.randn(n, device=dev, generator=gen).to(torch.bfloat16)
        for m in (1, 3, 8, 13, 16, 17, 33, 64):
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16) * 3
            for cfg in g4_cands(m, n, k)[:6] + [K._g4_default(m, n, k)]:
                for b in (None, bias):
                    y = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
                    K.linear(x, p, s, r, b, config=cfg, out=y)
                    ref = x.double() @ wf.T + (b.double() if b is not None else 0)
                    e = rel_err(y, ref)
                    if not (e <= 1e-2 and bool(torch.isfinite(y).all())):
                        fails.append(dict(k=k, n=n, m=m, cfg=cfg, bias=b is not None, err=e))
    print(f"correctness: {len(fails)} failures {fails[:4]} ({time.time() - t0:.0f}s)", flush=True)
    ms = [int(v) for v in a.ms.split(",")]
    shapes = SHAPES if a.shapes == "all" else [SHAPES[int(i)] for i in a.shapes.split(",")]
    rows, tuned = [], {}
    for k, n in shapes:
        copies = make_weights(k, n, n_copies(nvfp4_bytes(0, k, n)), gen)
        wf = fp4.nvfp4_dequantize(*copies[0], torch.float32).double()
        wb = [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
              for _ in range(n_copies(n * k * 2))]
        for c in copies:
            K._g4_repacked(c[0], c[1])
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
            ref = x.double() @ wf.T
            res = []
            old = dict(K._LINEAR_TUNER.cache.get(K.Tuner.key(m, n, k, torch.bfloat16, dev), K._dec_default(m, n, k)))
            for cfg in [dict(old, old=True)] + g4_cands(m, n, k):
                c = {kk: v for kk, v in cfg.items() if kk != "old"}
                try:
                    y = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
                    K.linear(x, *copies[0], config=c, out=y)
                    torch.cuda.synchronize()
                    e = rel_err(y, ref)
                    ok = e <= 1e-2 and bool(torch.isfinite(y).all())
                    us = graph_us(lambda i: K.linear(x, *copies[i], config=c), len(copies)) if ok else float("inf")
                except Exception as ex:  # noqa: BLE001
                    e, ok, us = float("nan"), False, float("inf")
                    cfg = dict(cfg, error=f"{type(ex).__name__}: {str(ex)[:300]}")
                if not ok:
                    fails.append(dict(k=k, n=n, m=m, cfg=cfg, err=e))
                res.append({"us": us, "err": e, "cfg": cfg})
            bf = graph_us(lambda i: F.linear(x, wb[i]), len(wb))
            oldr = res[0]
            best = min(res[1:], key=lambda r: r["us"])
            gb = nvfp4_bytes(m, k, n) / best["us"] / 1e3
            rows.append(dict(K=k, N=n, M=m, bf16_us=bf, old_us=oldr["us"], best=best, results=res))
            tuned[K.Tuner.key(m, n, k, torch.bfloat16, dev)] = best["cfg"]
            print(f"K{k:6d} N{n:6d} M{m:3d} g4 {best['us']:7.2f}us old {oldr['us']:7.2f}us bf16 {bf:7.2f}us "
                  f"x{bf / best['us']:5.2f} {gb:6.0f}GB/s {100 * gb / COPY_GBPS:5.1f}% err {best['err']:.1e} "
                  f"{ {kk: v for kk, v in best['cfg'].items() if kk in ('BM', 'R', 'warps', 'split')} }", flush=True)
            (out / "variants.json").write_text(json.dumps({"rows": rows, "fails": fails}, indent=1, default=str))
        del copies, wb, wf
        K._G4_CACHE.clear()
        torch.cuda.empty_cache()
    (out / "variants.json").write_text(json.dumps({"rows": rows, "fails": fails}, indent=1, default=str))
    (out / "g4_tuned.json").write_text(json.dumps({"nvfp4_linear": tuned}, indent=1, sort_keys=True))
    print(f"\n{len(fails)} failures: {fails[:6]}\ntook {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
