"""NVFP4 W4A16 matmul on the GPU: ours (Triton) vs BF16 cuBLAS (F.linear) vs bitsandbytes NF4, same run.

    python benchmarks/nvfp4_matmul.py                 # benchmark -> benchmarks/results/nvfp4_matmul.{json,md}
    python benchmarks/nvfp4_matmul.py --sweep --out D # correctness at full shapes + config tuning -> D/

Timing: each method's call is captured R times in one CUDA graph, each call on a different weight copy
(R large enough that the copies exceed 3x L2), the graph replayed and the median replay time divided by R.
Bandwidth counts the bytes a call must read/write: packed weights + scales + x + y.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import add_args, spread, write  # noqa: E402

from hfq_kernels.reference import fp4  # noqa: E402
from hfq_kernels import nvfp4 as K  # noqa: E402
from hfq_kernels import nvfp4_gluon as gluon  # noqa: E402
from hfq_kernels import nvfp4_configs as CF  # noqa: E402
from hfq_kernels import nvfp4_plan as PL  # noqa: E402
from hfq_kernels._autotune import device_name  # noqa: E402
from hfq_kernels._triton import card_props, sm_count  # noqa: E402

SHAPES = [  # (K=in, N=out)
    (3584, 3584), (3584, 512), (3584, 18944), (18944, 3584),  # Qwen2.5-7B
    (5120, 5120), (5120, 1024), (5120, 27648), (27648, 5120),  # Qwen2.5-32B
]
MS = [1, 2, 4, 8, 16, 32, 64, 256, 1024, 4096]
L2_BYTES = 50 * 2**20


def rel_err(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


def capture(call, n_copies: int):
    """call(i) for i in range(n_copies) captured in one CUDA graph (after a warm-up on a side stream), or None
    where the call cannot be captured."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for i in range(min(n_copies, 3)):
                call(i)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(n_copies):
                call(i)
        g.replay()
        torch.cuda.synchronize()
        return g
    except Exception:  # noqa: BLE001 - e.g. a library that cannot be captured: timed eagerly
        torch.cuda.synchronize()
        return None


def replay_us(g, call, n_copies: int, reps: int = 10) -> float:
    """Median us per call over `reps` replays of graph g (or, g None, of the eager loop over the copies)."""
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        if g is not None:
            g.replay()
        else:
            for i in range(n_copies):
                call(i)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2] * 1000 / n_copies


def interleaved_us(calls: dict, copies: dict, rounds: int = 3) -> dict:
    """{name: (median us per call over rounds, min, max, "graph" | "eager")}: each call captured once, then
    replayed round-robin (A B C A B C ...) `rounds` times."""
    graphs = {k: capture(c, copies[k]) for k, c in calls.items()}
    per = {k: [] for k in calls}
    for _ in range(rounds):
        for k, c in calls.items():
            per[k].append(replay_us(graphs[k], c, copies[k]))
    modes = {k: "graph" if g is not None else "eager" for k, g in graphs.items()}
    del graphs
    return {k: (spread(v)["median"], min(v), max(v), modes[k]) for k, v in per.items()}


def time_us(call, n_copies):
    """(median us per call, "graph" | "eager") of one captured graph over the copies (the sweep's timing)."""
    g = capture(call, n_copies)
    return replay_us(g, call, n_copies, reps=20), "graph" if g is not None else "eager"


def n_copies(bytes_per_copy: int) -> int:
    return int(min(256, max(2, math.ceil(3 * L2_BYTES / bytes_per_copy))))


def nvfp4_bytes(m, k, n):
    return n * k // 2 + n * k // 16 + 4 + m * k * 2 + m * n * 2


def make_weights(k, n, copies, gen):
    """`copies` quantized weights [n, k] (quantized on the GPU with our kernel)."""
    out = []
    for _ in range(copies):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        out.append(K.quantize(w))
    return out


# ------------------------------------------------------------------------------------------- sweep
def sweep(out_dir: Path, quick: bool):
    dev = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    log = {"checks": [], "tuning": [], "quantize": []}
    rows = []

    def save():  # after every shape: a killed sweep keeps what it measured
        write("nvfp4_matmul_sweep", rows, ["K", "N", "M", "bf16_us", "best_us", "x_bf16", "best"], out_dir=str(out_dir),
              title="NVFP4 W4A16 config sweep (best config per shape, tuning weights rotated over > 3x L2)",
              notes=f"checks: {len(log['checks'])}, failures: {fails[:10]}", extra=log)

    fails = []

    def check(name, ok, **info):
        log["checks"].append({"name": name, "ok": bool(ok), **info})
        if not ok:
            fails.append(name)
            print("FAIL", name, info, flush=True)

    # 1. quantize / dequantize bit-exactness vs the CPU oracle, and quantize speed
    qshapes = [(3584, 3584), (512, 3584), (18944, 3584), (3584, 18944), (5120, 5120), (1024, 5120),
               (27648, 5120), (5120, 27648), (11008, 4096), (4096, 11008)]
    if quick:
        qshapes = qshapes[:3]
    for n, k in qshapes:
        for dt in ((torch.bfloat16, torch.float32) if n * k <= 20e6 else (torch.bfloat16,)):
            w = torch.randn(n, k, device=dev, dtype=dt, generator=gen) * torch.rand(n, 1, device=dev, dtype=dt)
            w[0, :16] = 0
            w[1, :32] *= 1e-6
            p, s, r = K.quantize(w)
            rp, rs, rr = fp4.nvfp4_quantize(w.cpu())
            ok = (torch.equal(p.cpu(), rp) and torch.equal(s.view(torch.uint8).cpu(), rs.view(torch.uint8))
                  and torch.equal(r.cpu(), rr))
            gp, gs, gr = fp4.nvfp4_quantize(w)  # the same torch code run on CUDA, for information
            n_diff_gpu_ref = int((gs.view(torch.uint8) != s.view(torch.uint8)).sum()) + int((gp != p).sum())
            check(f"quantize {n}x{k} {dt}", ok, gpu_torch_ref_mismatches=n_diff_gpu_ref)
            for odt in (torch.bfloat16, torch.float16, torch.float32):
                d = K.dequantize(p, s, r, odt)
                rd = fp4.nvfp4_dequantize(rp, rs, rr, odt)
                check(f"dequantize {n}x{k} {dt}->{odt}", torch.equal(d.cpu(), rd))
            if dt == torch.bfloat16:
                import hfq_kernels._autotune as at
                t_q = at.bench_ms(lambda: K.quantize(w), 2, 10)
                t_d = at.bench_ms(lambda: K.dequantize(p, s, r, torch.bfloat16), 2, 10)
                log["quantize"].append({"n": n, "k": k, "quantize_ms": t_q, "dequantize_ms": t_d,
                                        "quantize_gbps": n * k * 2.5625 / t_q / 1e6,
                                        "dequantize_gbps": n * k * 2.5625 / t_d / 1e6})
                print(f"quant {n}x{k}: q {t_q:.3f} ms  dq {t_d:.3f} ms", flush=True)
    # 7B: 28 layers x (q,o 3584^2; k,v 512x3584; gate,up 18944x3584; down 3584x18944)
    qt = {(e["n"], e["k"]): e["quantize_ms"] for e in log["quantize"]}
    if all(x in qt for x in [(3584, 3584), (512, 3584), (18944, 3584), (3584, 18944)]):
        t7 = 28 * (2 * qt[(3584, 3584)] + 2 * qt[(512, 3584)] + 2 * qt[(18944, 3584)] + qt[(3584, 18944)])
        log["quantize_7b_s"] = t7 / 1000
        print(f"7B quantize estimate: {t7 / 1000:.3f} s", flush=True)

    # 2. linear correctness at full shapes (poisoned outputs), asm and plain decode, bias, fp16
    cshapes = SHAPES + [(11008, 4096), (4096, 11008)]
    if quick:
        cshapes = cshapes[:2]
    for k, n in cshapes:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
        p, s, r = K.quantize(w)
        wf = fp4.nvfp4_dequantize(p, s, r, torch.float32).double()
        bias = torch.randn(n, device=dev, dtype=torch.bfloat16, generator=gen)
        for m in (1, 3, 16, 17, 128, 1000):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
            ref = x.double() @ wf.T
            dflt = CF.default_config(m, n, k, sm_count(dev))
            cfgs = [dflt] + ([dict(dflt, asm=False)] if m in (1, 128) else [])
            if m <= 16:
                cfgs.append(dict(dflt, split=1))
            for cfg in cfgs:
                try:
                    y = K.plan_linear(x, p, s, r, config=cfg).forward(x, None)
                except Exception as ex:  # noqa: BLE001
                    check(f"linear K{k} N{n} M{m} {cfg}", False, error=f"{type(ex).__name__}: {str(ex)[:800]}")
                    continue
                e = rel_err(y, ref)
                check(f"linear K{k} N{n} M{m} {cfg}", e <= 1e-2 and torch.isfinite(y).all().item(), err=e,
                      asm_failed=len(PL._ASM_FAILED))
            if m in (3, 128):
                yb = K.plan_linear(x, p, s, r, bias, config=dflt).forward(x, bias)
                e = rel_err(yb, ref + bias.double())
                check(f"linear+bias K{k} N{n} M{m}", e <= 1e-2, err=e)
                yh = K.plan_linear(x.half(), p, s, r, config=dflt).forward(x.half(), None)
                e = rel_err(yh, x.half().double() @ wf.T)
                check(f"linear fp16 K{k} N{n} M{m}", e <= 1e-2, err=e)
            if m in (17, 1000):
                g = torch.randn(m, n, device=dev, dtype=torch.bfloat16, generator=gen)
                gi = K.grad_input(g, p, s, r)
                e = rel_err(gi, g.double() @ wf)
                check(f"grad_input K{k} N{n} M{m}", e <= 1e-2 and torch.isfinite(gi).all().item(), err=e)
        print(f"checked K{k} N{n}: {len(fails)} failures so far", flush=True)

    # 3. tuning with rotated weights; writes the tuned table
    tuned = {}
    tshapes = SHAPES if not quick else SHAPES[:2]
    for k, n in tshapes:
        pb = nvfp4_bytes(0, k, n)
        copies = make_weights(k, n, n_copies(pb), gen)
        wb = [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(n_copies(n * k * 2))]
        for m in MS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
            res = []
            cands = CF.candidates(m, n, k, sm_count(dev))
            cands += [dict(c, asm=False) for c in cands[:2] if c["kind"] == "tile"]
            for cfg in cands:
                try:
                    plans = [K.plan_linear(x, *c, config=cfg) for c in copies]
                    us, _ = time_us(lambda i: plans[i].forward(x, None), len(copies))
                except Exception as e:
                    us = float("inf")
                    cfg = dict(cfg, error=f"{type(e).__name__}: {str(e)[:300]}")
                res.append((us, cfg))
            bf = time_us(lambda i: F.linear(x, wb[i % len(wb)]), len(wb))[0]
            res.sort(key=lambda t: t[0])
            best_us, best = res[0]
            tuned[K.Tuner.key(m, n, k, torch.bfloat16, dev)] = best
            tuned[K.Tuner.key(m, n, k, torch.float16, dev)] = best
            log["tuning"].append({"M": m, "K": k, "N": n, "bf16_us": bf,
                                  "results": [{"us": u, "cfg": c} for u, c in res]})
            rows.append({"K": k, "N": n, "M": m, "bf16_us": round(bf, 3), "best_us": round(best_us, 3),
                         "x_bf16": round(bf / best_us, 3), "best": json.dumps(best, default=str)})
            gbps = nvfp4_bytes(m, k, n) / best_us / 1e3
            save()
            print(f"K{k:6d} N{n:6d} M{m:5d} best {best_us:8.2f}us bf16 {bf:8.2f}us x{bf / best_us:5.2f} "
                  f"{gbps:6.0f}GB/s {best}", flush=True)
        del copies, wb
        torch.cuda.empty_cache()

    (cap, sms) = card_props(dev)  # lets cards of the same kind read this table (hfq_kernels._autotune)
    cards = {device_name(dev): {"capability": list(cap), "sms": sms}}
    (out_dir / "nvfp4_linear_tuned.json").write_text(json.dumps({"nvfp4_linear": tuned, "cards": cards}, indent=1,
                                                                sort_keys=True))
    log["fails"] = fails
    log["asm_failed"] = {str(a): b for a, b in PL._ASM_FAILED.items()}
    save()
    print(f"SWEEP DONE: {len(log['checks'])} checks, {len(fails)} failures: {fails[:10]}", flush=True)


# ------------------------------------------------------------------------------------------- compile check
def compile_decode_check() -> dict:
    """torch.compile(fullgraph=True) + CUDA graphs of a tiny NVFP4 model's one-token forward."""
    from hfq.tiny import tiny_model

    class _Lin(torch.nn.Module):
        def __init__(self, lin):
            super().__init__()
            p, s, r = K.quantize(lin.weight.data)
            self.register_buffer("weight_packed", p)
            self.register_buffer("weight_scale", s)
            self.register_buffer("weight_global_scale", r)
            self.bias = lin.bias

        def forward(self, x):
            return torch.ops.hfq.nvfp4_linear(x, self.weight_packed, self.weight_scale, self.weight_global_scale,
                                              self.bias)

    model = tiny_model("qwen2", hidden=256, intermediate=512, heads=4, kv_heads=2).to("cuda", torch.bfloat16)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, mod in list(parent.named_children()):
                if isinstance(mod, torch.nn.Linear):
                    setattr(parent, name, _Lin(mod))
    ids = torch.randint(4, 90, (4, 1), device="cuda")
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits
        step = torch.compile(lambda t: model(t, use_cache=False).logits, fullgraph=True, mode="reduce-overhead")
        for _ in range(3):
            out = step(ids)
        torch.cuda.synchronize()
        err = rel_err(out.float(), eager.double())
        # explicit CUDA graph capture of the eager step too
        static = ids.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            model(static, use_cache=False)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            gout = model(static, use_cache=False).logits
        g.replay()
        torch.cuda.synchronize()
        gerr = rel_err(gout.float(), eager.double())
    return {"compile_fullgraph_reduce_overhead_err": err, "cuda_graph_err": gerr,
            "ok": bool(err < 2e-2 and gerr < 1e-6)}


# ------------------------------------------------------------------------------------------- benchmark
def benchmark(out_dir: str | None, quick: bool, rounds: int):
    dev = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bnbF
    except Exception as e:  # noqa: BLE001
        bnb = None
        print("bitsandbytes unavailable:", e)
    # measured device-copy bandwidth (bytes read + written)
    buf = torch.empty(2**30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(buf)
    import hfq_kernels._autotune as at
    copy_ms = at.bench_ms(lambda: dst.copy_(buf), 3, 20)
    copy_gbps = 2 * buf.numel() / copy_ms / 1e6
    del buf, dst
    print(f"device copy: {copy_gbps:.0f} GB/s", flush=True)
    rows = []
    shapes = SHAPES if not quick else SHAPES[:2]
    prev_nf4, prev_commit = {}, None
    prev_path = Path(out_dir or os.environ.get("OUT") or Path(__file__).resolve().parent / "results") / "nvfp4_matmul.json"
    if bnb is None and prev_path.is_file():  # keep the NF4 column: reuse the previous run's numbers (noted per row)
        prev = json.loads(prev_path.read_text())
        prev_commit = prev.get("facts", prev).get("commit")
        prev_nf4 = {(r["K"], r["N"], r["M"]): r.get("nf4_us") for r in prev.get("rows", [])}
    for k, n in shapes:
        copies = []  # the g4 layout an NVFP4Linear keeps on the GPU (no canonical copy)
        for p, sc, gs in make_weights(k, n, n_copies(nvfp4_bytes(0, k, n)), gen):
            copies.append((*gluon.repack(p, sc), gs.float()))
        wb = [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
              for _ in range(n_copies(n * k * 2))]
        nf4 = []
        if bnb is not None:
            for i in range(n_copies(n * k // 2 + n * k // 64 * 4)):
                qw, qs = bnbF.quantize_4bit(wb[i % len(wb)], quant_type="nf4", blocksize=64)
                nf4.append((qw, qs))
        for m in MS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
            # NVFP4Linear's route for a g4 weight: the Gluon kernel at M <= 64, else dequantize_g4 + cuBLAS
            plans = [K.plan_linear_g4(x, c[0], c[1], c[2], None, n, k) for c in copies]
            calls = {"ours": lambda i: plans[i].forward(x, None),
                     "bf16": lambda i: F.linear(x, wb[i])}
            ncop = {"ours": len(copies), "bf16": len(wb)}
            if nf4:
                calls["nf4"] = lambda i: bnb.matmul_4bit(x, nf4[i][0].t(), quant_state=nf4[i][1])
                ncop["nf4"] = len(nf4)
            t = interleaved_us(calls, ncop, rounds)
            ours, bf = t["ours"][0], t["bf16"][0]
            nf, nmode = (t["nf4"][0], t["nf4"][3]) if "nf4" in t else (float("nan"), "n/a")
            if "nf4" not in t and prev_nf4.get((k, n, m)) is not None:
                nf, nmode = prev_nf4[(k, n, m)], f"reused from commit {prev_commit} (bitsandbytes not installed)"
            cfg = CF.gluon_config(m, n, k, dev) if gluon.supported(x) else {"kind": "dequant"}
            row = {"M": m, "K": k, "N": n, "ours_us": round(ours, 3), "bf16_us": round(bf, 3),
                   "nf4_us": round(nf, 3), "spread_us": {kk: [round(v[1], 3), round(v[2], 3)] for kk, v in t.items()},
                   **{f"{kk}_range": f"{v[1]:.3f}-{v[2]:.3f}" for kk, v in t.items()},
                   "ours_gbps": round(nvfp4_bytes(m, k, n) / ours / 1e3, 1),
                   "bf16_gbps": round((n * k * 2 + m * k * 2 + m * n * 2) / bf / 1e3, 1),
                   "x_bf16": round(bf / ours, 3), "x_nf4": round(nf / ours, 3) if nf == nf else None,
                   "pct_copy_bw": round(100 * nvfp4_bytes(m, k, n) / ours / 1e3 / copy_gbps, 1),
                   "config": cfg, "timing": t["ours"][3], "nf4_timing": nmode}
            rows.append(row)
            print(f"K{k:6d} N{n:6d} M{m:5d} ours {ours:8.2f}us bf16 {bf:8.2f}us nf4 {nf:8.2f}us "
                  f"x{bf / ours:5.2f} (nf4 x{nf / ours:5.2f}) {row['ours_gbps']:6.0f}GB/s {row['pct_copy_bw']:5.1f}%",
                  flush=True)
        del copies, wb, nf4
        torch.cuda.empty_cache()
    try:
        comp = compile_decode_check()
    except Exception as e:  # noqa: BLE001
        comp = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:500]}"}
    print("compile/cuda-graph decode:", comp, flush=True)
    import triton

    notes = (f"triton {triton.__version__}, bitsandbytes {getattr(bnb, '__version__', None)}, measured copy "
             f"bandwidth {copy_gbps:.1f} GB/s. Times: us per call inside CUDA graphs, weights rotated across copies "
             f"larger than 3x L2; each method's graph captured once, then replayed round-robin over {rounds} rounds: "
             "median of the rounds (range min-max). ours = NVFP4Linear's route for its g4 weights: the Gluon kernel "
             "at M <= 64, dequantize_g4 + cuBLAS above. GB/s counts bytes read+written (packed weights, scales, x, "
             "y).\n\ntorch.compile(fullgraph=True, mode='reduce-overhead') + CUDA-graph decode step of a tiny NVFP4 "
             f"Qwen2: {comp}")
    columns = {"K": "K", "N": "N", "M": "M", "ours_us": "ours us", "ours_range": "range", "bf16_us": "bf16 us",
               "bf16_range": "range", "nf4_us": "nf4 us", "x_bf16": "ours/bf16 speedup", "x_nf4": "ours/nf4 speedup",
               "ours_gbps": "ours GB/s", "pct_copy_bw": "% copy BW"}
    _, md = write("nvfp4_matmul", rows, columns, notes, out_dir=out_dir, extra={"copy_gbps": round(copy_gbps, 1),
                  "compile_decode": comp, "rounds": rounds, "bitsandbytes": getattr(bnb, "__version__", None)},
                  title="NVFP4 W4A16 matmul: ours (Triton) vs BF16 cuBLAS vs bitsandbytes NF4")
    print(f"wrote {md}")


def main():
    ap = add_args(argparse.ArgumentParser())
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("nvfp4_matmul: needs a CUDA GPU")
    if a.sweep:
        out = Path(a.out or os.environ.get("OUT", "."))
        out.mkdir(parents=True, exist_ok=True)
        t = time.time()
        sweep(out, a.quick)
        print(f"sweep took {time.time() - t:.0f}s")
    else:
        benchmark(a.out, a.quick, a.rounds)


if __name__ == "__main__":
    main()
