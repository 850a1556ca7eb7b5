"""Device check: wgmma g4 kernels vs dequantize + cuBLAS (correctness, then timing)."""
import sys, time, torch, triton
import torch.nn.functional as F
from hfq_kernels import nvfp4_gluon as g4, nvfp4_wgmma as wg
from hfq_kernels.nvfp4_quant import quantize

torch.manual_seed(0)
dev = "cuda"
print(torch.cuda.get_device_name(), flush=True)
SHAPES = [(18944, 3584), (3584, 18944), (3584, 3584), (512, 3584)] if len(sys.argv) < 2 else [tuple(map(int, sys.argv[1].split("x")))]
MS = [128, 256, 768, 2048]

def make(n, k):
    w = torch.randn(n, k, device=dev) * 0.02
    p, s, r = quantize(w)
    wr, sr = g4.repack(p, s)
    wd = g4.dequantize_g4(wr, sr, r, n, k, torch.bfloat16)
    return wr, sr, r, wd

def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())

def bench(fn, reps=20):
    """GPU time per call (us): a CUDA graph of `reps` calls, replayed, median of 5."""
    fn(); torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr, stream=s):
            for _ in range(reps):
                fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); gr.replay(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / reps)
    return sorted(ts)[2]

def wall(fn, reps=50):
    fn(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e6

# correctness on odd shapes
for (n, k, m) in [(200, 320, 100), (48, 64, 65), (3584, 3584, 256), (1000, 448, 130)]:
    wr, sr, r, wd = make(n, k)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, device=dev, dtype=torch.bfloat16)
    ref = F.linear(x.float(), wd.float(), b.float())
    for bm, warps, st in [(128, 4, 4), (64, 4, 4), (128, 8, 4), (256, 8, 3)]:
        y = wg.linear(x, wr, sr, r, b, n, k, bm, warps, st)
        print(f"fwd n={n} k={k} m={m} cfg={bm},{warps},{st} rel={rel(y, ref):.2e}", flush=True)
    g = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    refg = g.float() @ wd.float()
    for bm, st, sp in [(128, 4, 1), (256, 3, 1), (128, 4, 3)]:
        gx = wg.grad_input(g, wr, sr, r, n, k, bm, st, sp)
        print(f"grad n={n} k={k} m={m} cfg={bm},{st},{sp} rel={rel(gx, refg):.2e}", flush=True)

for n, k in SHAPES:
    wr, sr, r, wd = make(n, k)
    for m in MS:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        g = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        t_cub = bench(lambda: F.linear(x, wd))
        t_deq = bench(lambda: g4.dequantize_g4(wr, sr, r, n, k))
        res = {}
        for bm, warps, st in [(128, 4, 4), (128, 4, 3), (64, 4, 4), (128, 8, 4), (256, 8, 3)]:
            try:
                res[(bm, warps, st)] = bench(lambda: wg.linear(x, wr, sr, r, None, n, k, bm, warps, st))
            except Exception as e:
                res[(bm, warps, st)] = float("nan"); print("fail", bm, warps, st, str(e)[-200:])
        best = min(res, key=res.get)
        bm_, w_, st_ = best
        print(f"  kappa_order {bench(lambda: wg.kappa_order(x)):.1f}  wall: wg {wall(lambda: wg.linear(x, wr, sr, r, None, n, k, bm_, w_, st_)):.1f} cublas {wall(lambda: F.linear(x, wd)):.1f}")
        print(f"FWD {n}x{k} M={m}: cublas {t_cub:.1f} deq {t_deq:.1f} (route {t_cub + t_deq:.1f}) | "
              + " ".join(f"{c}:{v:.1f}" for c, v in res.items()) + f" | best/cublas {res[best] / t_cub:.2f}", flush=True)
        t_cubg = bench(lambda: g @ wd)
        resg = {}
        for bm, st, sp in [(128, 4, 1), (256, 3, 1), (128, 4, 2), (128, 4, 4), (64, 4, 2)]:
            try:
                resg[(bm, st, sp)] = bench(lambda: wg.grad_input(g, wr, sr, r, n, k, bm, st, sp))
            except Exception as e:
                resg[(bm, st, sp)] = float("nan"); print("fail", bm, st, sp, str(e)[-200:])
        best = min(resg, key=resg.get)
        print(f"GRAD {n}x{k} M={m}: cublas {t_cubg:.1f} | " + " ".join(f"{c}:{v:.1f}" for c, v in resg.items())
              + f" | best/cublas {resg[best] / t_cubg:.2f}", flush=True)
