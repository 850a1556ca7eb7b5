"""NVFP4 W4A16 at M >= 128 (prefill, training forward and grad-input) on the g4 layout: the fused decode-in-GEMM
kernel (hfq_kernels.nvfp4_g4mm) vs today's dequantize_g4 + cuBLAS vs BF16 cuBLAS, same run.

    python benchmarks/nvfp4_g4mm.py --out DIR      # -> DIR/nvfp4_g4mm.{json,md}, DIR/nvfp4_g4mm_tuned.json

1. correctness on the GPU: every candidate config, forward and grad-input, odd shapes and the model shapes, against
   the fp32 reference (relative error <= 1e-2: one bf16 rounding of the output);
2. per (shape, M, direction): every candidate timed once, the fastest kept ("tuned");
3. three interleaved rounds (bf16, dequant, fused, bf16, ...) of the three: median per call with CUDA events over
   back-to-back calls on weight copies rotated past L2, so each call reads its weights from HBM.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hfq_kernels import nvfp4_g4mm as MM  # noqa: E402
from hfq_kernels import nvfp4_gluon as G4  # noqa: E402
from hfq_kernels.reference import fp4  # noqa: E402

SHAPES = [(3584, 3584), (3584, 512), (3584, 18944), (18944, 3584),  # Qwen2.5-7B (K=in, N=out)
          (5120, 5120), (5120, 27648), (27648, 5120)]  # Qwen2.5-32B
MS = [128, 256, 768, 1024, 2048, 4096]
L2_BYTES = 50 * 2**20


def commit() -> str:
    c = os.environ.get("HFQ_COMMIT")
    if c:
        return c
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def make(k, n, copies, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    p, s, r = fp4.nvfp4_quantize(w)
    wr, sr = G4.repack(p, s)
    out = [(wr, sr)] + [(wr.clone(), sr.clone()) for _ in range(copies - 1)]
    return out, r.float().cuda()


def timed(fn, copies: int, reps: int = 3) -> float:
    """Median us per call over `reps` passes of back-to-back calls fn(i), i over the weight copies."""
    for i in range(min(copies, 2)):
        fn(i)
    torch.cuda.synchronize()
    res = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(copies):
            fn(i)
        b.record()
        torch.cuda.synchronize()
        res.append(a.elapsed_time(b) * 1000 / copies)
    return statistics.median(res)


def check(results: list):
    """GPU correctness of every candidate, forward and grad-input."""
    torch.manual_seed(0)
    for m, n, k in [(130, 37, 160), (257, 48, 272), (300, 512, 3584), (129, 3584, 1024), (1000, 208, 4096)]:
        w = torch.randn(n, k, device="cuda") * torch.logspace(-3, 0.5, n, device="cuda")[:, None]
        w[0, :16] = 0
        p, s, r = fp4.nvfp4_quantize(w)
        wr, sr = G4.repack(p, s)
        rf = r.float().cuda()
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        ref = MM.reference(x, wr, sr, rf, n, k, b)
        gref = MM.reference(g, wr, sr, rf, n, k, grad=True)
        for cfg in MM.candidates() + [dict(MM.DEFAULT, bcast=False)]:
            try:
                y = MM.linear(x, wr, sr, rf, b, n, k, cfg).float()
                gx = MM.grad_input(g, wr, sr, rf, n, k, cfg).float()
                e1 = float((y - ref).norm() / ref.norm())
                e2 = float((gx - gref).norm() / gref.norm())
                results.append({"m": m, "n": n, "k": k, "cfg": cfg, "fwd_err": e1, "grad_err": e2,
                                "ok": e1 <= 1e-2 and e2 <= 1e-2})
            except Exception as e:  # noqa: BLE001 - a config that fails to build is reported, not fatal
                results.append({"m": m, "n": n, "k": k, "cfg": cfg, "ok": False, "error": f"{type(e).__name__}: "
                                f"{str(e)[-300:]}"})
    return results


def bench(shapes, ms, rounds: int, tuned: dict, rows: list):
    for k, n in shapes:
        copies = max(2, min(12, -(-3 * L2_BYTES // (n * k * 2))))
        ws, rf = make(k, n, copies)
        wb = [G4.dequantize_g4(wr, sr, rf, n, k, torch.bfloat16) for wr, sr in ws]  # bf16 baseline's weights
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            gy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            for d in ("fwd", "grad"):
                if d == "fwd":
                    base = lambda i: F.linear(x, wb[i])  # noqa: E731
                    deq = lambda i: F.linear(x, G4.dequantize_g4(ws[i][0], ws[i][1], rf, n, k))  # noqa: E731
                    fused = lambda i, c: MM.linear(x, ws[i][0], ws[i][1], rf, None, n, k, c)  # noqa: E731
                else:
                    base = lambda i: gy @ wb[i]  # noqa: E731
                    deq = lambda i: gy @ G4.dequantize_g4(ws[i][0], ws[i][1], rf, n, k)  # noqa: E731
                    fused = lambda i, c: MM.grad_input(gy, ws[i][0], ws[i][1], rf, n, k, c)  # noqa: E731
                cands = []
                for c in MM.candidates():
                    try:
                        cands.append((timed(lambda i: fused(i, c), copies, reps=1), c))
                    except Exception as e:  # noqa: BLE001
                        cands.append((float("inf"), {**c, "error": str(e)[-200:]}))
                best_us, best = min(cands, key=lambda t: t[0])
                tuned[f"{d}|m{m}|n{n}|k{k}"] = {"cfg": best, "us": best_us,
                                                "all": [(round(t, 2), c) for t, c in cands]}
                times = {"bf16": [], "dequant": [], "fused": []}
                for _ in range(rounds):
                    times["bf16"].append(timed(base, copies))
                    times["dequant"].append(timed(deq, copies))
                    times["fused"].append(timed(lambda i: fused(i, best), copies))
                med = {kk: statistics.median(v) for kk, v in times.items()}
                rows.append({"dir": d, "k": k, "n": n, "m": m, "cfg": best, **{f"{kk}_us": round(v, 2) for kk, v in
                                                                             med.items()},
                             "spread": {kk: [round(min(v), 2), round(max(v), 2)] for kk, v in times.items()},
                             "fused_x_bf16": round(med["bf16"] / med["fused"], 3),
                             "fused_x_dequant": round(med["dequant"] / med["fused"], 3),
                             "dequant_x_bf16": round(med["bf16"] / med["dequant"], 3)})
                print(json.dumps(rows[-1]), flush=True)
        del ws, wb
        torch.cuda.empty_cache()


def to_markdown(res) -> str:
    lines = [f"# NVFP4 W4A16 at M >= 128 on the g4 layout: fused decode-in-GEMM vs dequantize + cuBLAS vs BF16",
             "", f"device: {res['device']} | date: {res['date']} | commit: `{res['commit']}` | torch "
             f"{res['torch']} | triton {res['triton']} | {res['rounds']} interleaved rounds",
             "", "us per call: median over rounds (min-max). x bf16 = bf16 time / ours (> 1: ours faster). "
             "fwd: y = x W^T; grad: g W. Weight copies rotated past L2.", "",
             "| dir | K | N | M | bf16 us | dequant+cuBLAS us | fused us | fused x bf16 | fused x dequant | "
             "dequant x bf16 | fused config |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        sp = r["spread"]
        c = r["cfg"]
        lines.append(f"| {r['dir']} | {r['k']} | {r['n']} | {r['m']} | {r['bf16_us']} ({sp['bf16'][0]}-"
                     f"{sp['bf16'][1]}) | {r['dequant_us']} ({sp['dequant'][0]}-{sp['dequant'][1]}) | "
                     f"{r['fused_us']} ({sp['fused'][0]}-{sp['fused'][1]}) | {r['fused_x_bf16']} | "
                     f"{r['fused_x_dequant']} | {r['dequant_x_bf16']} | BM{c['BM']} RT{c['RT']} KCS{c['KCS']} "
                     f"w{c['warps']} s{c['stages']} |")
    bad = [c for c in res["checks"] if not c["ok"]]
    lines += ["", f"GPU correctness: {len(res['checks']) - len(bad)} of {len(res['checks'])} (config, shape) "
              "checks within 1e-2 of the fp32 reference, forward and grad-input."]
    for c in bad[:10]:
        lines.append(f"- failed: {c}")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    checks = check([])
    print("checks", sum(c["ok"] for c in checks), "/", len(checks), f"{time.time() - t0:.0f}s", flush=True)
    for c in checks:
        if not c["ok"]:
            print("FAIL", c, flush=True)
    rows, tuned = [], {}
    shapes = SHAPES[:3] if a.quick else SHAPES
    bench(shapes, [256, 1024] if a.quick else MS, a.rounds, tuned, rows)
    import triton

    res = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "commit": commit(),
           "torch": torch.__version__, "triton": triton.__version__, "rounds": a.rounds, "rows": rows,
           "checks": checks, "seconds": round(time.time() - t0, 1)}
    (out / "nvfp4_g4mm.json").write_text(json.dumps(res, indent=1))
    (out / "nvfp4_g4mm_tuned.json").write_text(json.dumps(tuned, indent=1))
    (out / "nvfp4_g4mm.md").write_text(to_markdown(res))
    print(to_markdown(res))


if __name__ == "__main__":
    main()
