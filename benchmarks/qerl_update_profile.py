"""Where the QeRL update phase spends its time (device): NVFP4 + LoRA vs BF16 + LoRA at M = 768 per micro-batch.

    python benchmarks/qerl_update_profile.py --tag after --out DIR [--base DIR_WITH_OLD_hfq] [--methods qerl,bf16_lora]

Parts (all in one process, results in DIR/update_profile_<tag>.json + DIR/update_profile_<tag>.txt):
  micro    per 7B linear shape at M = 768 (bf16): F.linear vs NVFP4 (op and NVFP4Linear module) forward and
           forward+backward: wall time per call (loop, one sync) and GPU kernel time per call (profiler trace);
           dequantize alone; host time per call on a tiny weight (256 x 256, M = 128: launch-bound) for the same paths.
  update   the qerl_step update phase (8 micro-batches x 1 sequence of 768 tokens, fwd + bwd, AdamW), timed twice
           (the second reported); then one warm micro-batch under torch.profiler (CPU/CUDA time per op, GPU busy
           fraction = union of kernel intervals / span) and under cProfile (host time per Python function).
--base puts an older checkout's hfq/hfq_kernels first on sys.path (the "before" numbers in the same device call).
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import io
import json
import os
import pstats
import sys
import tempfile
import time

T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", default="after")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--base", default=None)
    ap.add_argument("--methods", default="qerl,bf16_lora")
    ap.add_argument("--parts", default="micro,update")
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer in the update part "
                    "(regional, as qerl_step --compile); records dynamo's graph-break and graph counts")
    return ap.parse_args()


A = parse()
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.abspath(A.base) if A.base else ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hfq  # noqa: E402,F401
import hfq_kernels.nvfp4 as K  # noqa: E402
from hfq.nvfp4 import NVFP4Linear  # noqa: E402

sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import qerl_step  # noqa: E402  (its sys.path insert comes after hfq is imported: the modules above stay)

SHAPES = [(3584, 3584), (3584, 512), (3584, 18944), (18944, 3584)]  # (in K, out N): q/o, k/v, gate/up, down
M = 768


def trace_stats(prof, iters=1):
    """Kernel time per iteration and GPU busy fraction (union of kernel/memcpy intervals / span of all events)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        ev = json.load(f)
    os.unlink(path)
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("ph") == "X"
                 and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    cpu = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in ev if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    if not gpu:
        return dict(kernels=0)
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in gpu:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    start = min([g[0] for g in gpu] + [c[0] for c in cpu])
    end = max([g[1] for g in gpu] + [c[1] for c in cpu])
    n_kern = sum(1 for e in ev if e.get("ph") == "X" and e.get("cat") == "kernel")
    return dict(kernel_us_per_iter=round(sum(e - s for s, e in gpu) / iters, 1),
                gpu_busy_us_per_iter=round(busy / iters, 1), span_us_per_iter=round((end - start) / iters, 1),
                gpu_busy_frac=round(busy / (end - start), 3), kernels_per_iter=round(n_kern / iters, 1))


def wall_us(fn, iters):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t) / iters * 1e6, 1)


def gpu_us(fn, iters=5):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return trace_stats(prof, iters)


def paths(k, n, m, dtype=torch.bfloat16, device="cuda"):
    """name -> callable for one shape: F.linear and the NVFP4 routes, forward (no grad) and forward+backward."""
    torch.manual_seed(0)
    w = (torch.randn(n, k, device=device) * 0.02).to(dtype)
    p, s, r = K.quantize(w)
    mod = NVFP4Linear(k, n, bias=False, device=device, dtype=dtype)
    mod.weight_packed, mod.weight_scale, mod.weight_global_scale = p, s, r
    x = torch.randn(1, m, k, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(1, m, n, device=device, dtype=dtype)

    def fwd(f):
        def run():
            with torch.no_grad():
                f(x)
        return run

    def fwdbwd(f):
        def run():
            f(x).backward(g)
        return run

    lin = lambda t: F.linear(t, w)  # noqa: E731
    op = lambda t: torch.ops.hfq.nvfp4_linear(t, p, s, r, None)  # noqa: E731
    out = {"bf16_F.linear_fwd": fwd(lin), "bf16_F.linear_fwdbwd": fwdbwd(lin),
           "nvfp4_dequantize": lambda: K.dequantize(p, s, r, dtype),
           "nvfp4_op_fwd": fwd(op), "nvfp4_op_fwdbwd": fwdbwd(op),
           "nvfp4_module_fwd": fwd(mod), "nvfp4_module_fwdbwd": fwdbwd(mod)}
    return out, (p, s, r)


def micro(res):
    rows = []
    for k, n in SHAPES:
        fns, _ = paths(k, n, M)
        for name, fn in fns.items():
            row = dict(shape=f"{k}->{n}", M=M, path=name, wall_us=wall_us(fn, 20), **gpu_us(fn))
            rows.append(row)
            log(row)
        del fns
        torch.cuda.empty_cache()
    res["micro"] = rows
    # host time per call: a tiny weight (GPU work ~ a few us) with the large-M route forced to "dequant"
    tk, tn, tm = 256, 256, 128
    K.LINEAR_TUNER.cache[K.Tuner.key(tm, tn, tk, torch.bfloat16, torch.device("cuda", torch.cuda.current_device()))] = \
        {"kind": "dequant"}
    fns, _ = paths(tk, tn, tm)
    host = []
    for name, fn in fns.items():
        row = dict(shape=f"{tk}->{tn}", M=tm, path=name, wall_us=wall_us(fn, 500))
        host.append(row)
        log(row)
    res["host_tiny"] = host


def update(res, method):
    model = qerl_step.build(method, "7b")
    log(f"{method}: built, {torch.cuda.memory_allocated() / 2**30:.1f} GB")
    if A.compile:
        import torch._dynamo.utils as dyn

        dyn.counters.clear()
        for layer in model.get_base_model().model.layers:
            layer.compile()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    V = model.config.vocab_size
    batch, plen, new = 8, 256, 512
    full = torch.randint(3, V, (batch, plen + new), generator=torch.Generator().manual_seed(0)).cuda()
    adv = torch.randn(batch, device="cuda")

    def sync_t():
        torch.cuda.synchronize()
        return time.perf_counter()

    def micro_batch(i, old):
        lp = qerl_step.per_token_logps(model, full[i:i + 1], new)
        ratio = torch.exp(lp - old[i:i + 1])
        loss = -(torch.minimum(ratio * adv[i], ratio.clamp(0.8, 1.28) * adv[i])).mean() / batch
        loss.backward()

    out = {}
    for it in range(2):
        model.eval()
        t0 = sync_t()
        with torch.no_grad():
            old = qerl_step.per_token_logps(model, full, new)
        t1 = sync_t()
        model.train()
        for i in range(batch):
            micro_batch(i, old)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = sync_t()
        out = dict(logprob_s=round(t1 - t0, 3), update_s=round(t2 - t1, 3))
        log(f"{method} iter {it}: {out}")
    if A.compile:
        out["dynamo"] = {k: dict(v) for k, v in dyn.counters.items() if k in ("graph_break", "stats", "recompiles")}
    # one warm micro-batch: wall, profiler (per-op table + GPU busy), cProfile (host time per Python function)
    model.train()
    t0 = sync_t()
    micro_batch(0, old)
    out["micro_batch_wall_s"] = round(sync_t() - t0, 4)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        micro_batch(1, old)
        torch.cuda.synchronize()
    out["profile"] = trace_stats(prof)
    ka = prof.key_averages()
    out["table_cpu"] = ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
    out["table_cuda"] = ka.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=60)
    cp = cProfile.Profile()
    torch.cuda.synchronize()
    cp.enable()
    micro_batch(2, old)
    torch.cuda.synchronize()
    cp.disable()
    sio = io.StringIO()
    pstats.Stats(cp, stream=sio).sort_stats("tottime").print_stats(30)
    out["cprofile_tottime"] = sio.getvalue()[-9000:]
    sio = io.StringIO()
    pstats.Stats(cp, stream=sio).sort_stats("cumulative").print_stats(40)
    out["cprofile_cumulative"] = sio.getvalue()[-9000:]
    opt.zero_grad(set_to_none=True)
    res.setdefault("update", {})[method] = out
    log(method, {k: v for k, v in out.items() if not k.startswith(("table", "cprofile"))})
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()


def main():
    res = dict(tag=A.tag, compile=A.compile, device=torch.cuda.get_device_name(0), date=datetime.date.today().isoformat(),
               commit=os.environ.get("HFQ_COMMIT", "unknown"), kernels_file=K.__file__,
               eager_fast=hasattr(K, "plain_eager"), torch=torch.__version__)
    log(res)
    os.makedirs(A.out, exist_ok=True)
    path = os.path.join(A.out, f"update_profile_{A.tag}.json")

    def save():
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(A.out, f"update_profile_{A.tag}.txt"), "w") as f:
            for m, u in res.get("update", {}).items():
                for key in ("table_cpu", "table_cuda", "cprofile_tottime", "cprofile_cumulative"):
                    f.write(f"===== {A.tag} {m} {key}\n{u.get(key, '')}\n")

    parts = A.parts.split(",")
    if "micro" in parts:
        micro(res)
        save()
    if "update" in parts:
        for m in A.methods.split(","):
            update(res, m)
            save()
    log("done")


if __name__ == "__main__":
    main()
