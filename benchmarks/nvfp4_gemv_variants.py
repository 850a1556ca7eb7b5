"""Decode-path (M <= 64) variants of the NVFP4 W4A16 matmul on the GPU: correctness at full shapes + timings.

    python benchmarks/nvfp4_gemv_variants.py --out $OUT

For every Qwen2.5-7B/32B shape and M in {1, 2, 4, 8, 16, 32, 64}: every candidate config (new "dec" kernel
configs, the previously shipped choice, the old CUDA-core GEMV for M <= 4) is checked against a float64
reference of the dequantized product (rel. Frobenius <= 1e-2, NaN-poisoned outputs fully written) and timed
in a CUDA graph over rotated weight copies (> 3x L2). Writes variants.json and the winners as a tuned table.
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

from hfq.formats import fp4  # noqa: E402
from hfq_kernels import nvfp4 as K  # noqa: E402
from nvfp4_matmul import SHAPES, graph_us, make_weights, n_copies, nvfp4_bytes, rel_err  # noqa: E402

MS = [1, 2, 4, 8, 16, 32, 64]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", type=int, default=len(SHAPES))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    shipped = dict(K._LINEAR_TUNER.cache)
    log, tuned, fails = [], {}, []
    t0 = time.time()
    for k, n in SHAPES[:a.shapes]:
        copies = make_weights(k, n, n_copies(nvfp4_bytes(0, k, n)), gen)
        wf = fp4.nvfp4_dequantize(*copies[0], torch.float32).double()
        wb = [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
              for _ in range(n_copies(n * k * 2))]
        for m in MS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
            ref = x.double() @ wf.T
            key = K.Tuner.key(m, n, k, torch.bfloat16, dev)
            cands = K._dec_candidates(m, n, k)
            if key in shipped:
                cands.append(dict(shipped[key], old=True))
            if m <= 4:
                cands += [c for c in K._mm_candidates(m, n, k) if c["kind"] == "gemv"][:4]
            res = []
            for cfg in cands:
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
                    fails.append((k, n, m, cfg, e))
                res.append({"us": us, "err": e, "ok": ok, "cfg": cfg})
            bf = graph_us(lambda i: F.linear(x, wb[i]), len(wb))
            res.sort(key=lambda r: r["us"])
            best = res[0]
            oldr = [r for r in res if r["cfg"].get("old")]
            tuned[key] = {kk: v for kk, v in best["cfg"].items() if kk != "old"}
            tuned[K.Tuner.key(m, n, k, torch.float16, dev)] = tuned[key]
            gbps = nvfp4_bytes(m, k, n) / best["us"] / 1e3
            log.append({"K": k, "N": n, "M": m, "bf16_us": bf, "best": best, "old_us": oldr[0]["us"] if oldr else None,
                        "results": res})
            print(f"K{k:6d} N{n:6d} M{m:3d} best {best['us']:7.2f}us old {oldr[0]['us'] if oldr else float('nan'):7.2f}us "
                  f"bf16 {bf:7.2f}us x{bf / best['us']:5.2f} {gbps:6.0f}GB/s err {best['err']:.1e} "
                  f"{ {kk: v for kk, v in best['cfg'].items() if kk in ('kind', 'BN', 'BK', 'split', 'warps', 'prefetch')} }",
                  flush=True)
            (out / "variants.json").write_text(json.dumps({"rows": log, "fails": fails}, indent=1, default=str))
        del copies, wb, wf
        torch.cuda.empty_cache()
    # fp16 input and bias through the default dec config (one shape)
    k, n = SHAPES[0]
    p, s, r = K.quantize(torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02)
    wf = fp4.nvfp4_dequantize(p, s, r, torch.float32).double()
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16, generator=gen)
    for m in (1, 3, 17, 64):
        for dt in (torch.float16, torch.bfloat16):
            x = (torch.randn(m, k, device=dev, generator=gen) * 3).to(dt)
            for cfg in (K._dec_default(m, n, k), dict(K._dec_default(m, n, k), split=1)):
                y = torch.full((m, n), float("nan"), device=dev, dtype=dt)
                K.linear(x, p, s, r, bias.to(dt), config=cfg, out=y)
                e = rel_err(y, x.double() @ wf.T + bias.to(dt).double())
                if not (e <= 1e-2 and bool(torch.isfinite(y).all())):
                    fails.append(("bias/dtype", m, str(dt), cfg, e))
    (out / "variants.json").write_text(json.dumps({"rows": log, "fails": fails}, indent=1, default=str))
    (out / "nvfp4_linear_tuned_dec.json").write_text(json.dumps({"nvfp4_linear": tuned}, indent=1, sort_keys=True))
    print(f"\n{len(fails)} failures: {fails[:6]}")
    print(f"{'K':>6} {'N':>6} {'M':>3} {'best':>7} {'old':>7} {'bf16':>7} {'xbf16':>6} {'%bw':>5}")
    for r in log:
        print(f"{r['K']:6d} {r['N']:6d} {r['M']:3d} {r['best']['us']:7.2f} {r['old_us'] or float('nan'):7.2f} "
              f"{r['bf16_us']:7.2f} {r['bf16_us'] / r['best']['us']:6.2f} "
              f"{100 * nvfp4_bytes(r['M'], r['K'], r['N']) / r['best']['us'] / 1e3 / 3007:5.1f}")
    print(f"took {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
