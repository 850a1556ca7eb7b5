"""Skinny GEMM for decode steps: y = x @ W^T (+ bias) with few rows (M <= 16), BF16/FP16 weights.

A decode step of a 7B model at batch 8 is ~14 GB of weight reads; cuBLAS runs these M=8 products at ~2.4 TB/s
on an H100. These Triton kernels stream W in [BN, BK] tiles (optionally split over K with an fp32 partial
buffer and a reduce kernel; or up to 3 weights sharing x in one launch) and are picked per (M, N, K, dtype, bias)
only where they measured faster than cuBLAS: `linear` / `linear_group` time cuBLAS and the candidate configs once
per shape through the shared tuner (`hfq_kernels._autotune`, graph replay of 20 calls over several weight copies
so that L2 does not hold them), outside graph capture, and then use the winner. The weight is read where it
lives, so in-place updates are seen by captured graphs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hfq_kernels._autotune import Tuner, device_name, enabled
from hfq_kernels._triton import HAS_TRITON, group_of, member, pick3, tl, triton

# (BN, BK, split, warps, stages) of the single-weight kernel; (BN, BK, warps, stages) of the grouped one
CONFIGS = ((64, 128, 1, 4, 4), (32, 128, 1, 4, 5), (32, 256, 1, 4, 4), (64, 256, 1, 8, 3), (128, 128, 1, 8, 4),
           (64, 128, 2, 4, 4), (64, 128, 4, 4, 4), (32, 128, 4, 4, 4), (64, 128, 8, 4, 4), (32, 256, 8, 4, 3))
GROUP_CONFIGS = ((32, 128, 4, 5), (32, 256, 4, 4), (64, 128, 4, 4), (64, 256, 8, 3))
CUBLAS = {"kind": "cublas"}
SEPARATE = {"kind": "separate"}
MARGIN = 0.97  # a Triton config must take < 97% of the baseline's time to be chosen
TUNER = Tuner("skinny_gemm")
GROUP_TUNER = Tuner("skinny_gemm_group")


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, p_ptr, M, N, K, sxm, swn, sym, k_per_split,
                   HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pn = tl.program_id(0)
    ps = tl.program_id(1)
    rn = pn * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    k0 = ps * k_per_split
    acc = tl.zeros([BM, BN], tl.float32)
    xp = x_ptr + rm[:, None] * sxm + (k0 + rk)[None, :]
    wp = w_ptr + rn[:, None] * swn + (k0 + rk)[None, :]
    for kk in range(0, k_per_split, BK):
        if EVEN:
            x = tl.load(xp, mask=(rm < M)[:, None], other=0.0)
            w = tl.load(wp)
        else:
            km = (k0 + kk + rk) < K
            x = tl.load(xp, mask=(rm < M)[:, None] & km[None, :], other=0.0)
            w = tl.load(wp, mask=(rn < N)[:, None] & km[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
        xp += BK
        wp += BK
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm < M)[:, None] & (rn < N)[None, :])
    else:
        tl.store(p_ptr + (ps * BM + rm[:, None]) * N + rn[None, :], acc, mask=(rn < N)[None, :])

@triton.jit
def _split_reduce_kernel(p_ptr, b_ptr, y_ptr, M, N, sym, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr):
    pn = tl.program_id(0)
    rn = pn * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    nm = rn < N
    acc = tl.zeros([BM, BN], tl.float32)
    for s in range(SPLIT):
        acc += tl.load(p_ptr + (s * BM + rm[:, None]) * N + rn[None, :], mask=nm[None, :], other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm < M)[:, None] & nm[None, :])


@triton.jit
def _skinny_group_kernel(x_ptr, w0, w1, w2, b0, b1, b2, y0, y1, y2, n0, n1, n2, nb0, nb1, M, K, sxm,
                         sw0, sw1, sw2, sy0, sy1, sy2, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    i, blk = group_of(tl.program_id(0), nb0, nb1)
    N, sw, sy, w_ptr, y_ptr = member(i, n0, n1, n2, sw0, sw1, sw2, sy0, sy1, sy2, w0, w1, w2, y0, y1, y2)
    b_ptr = pick3(i, b0, b1, b2)
    rn = blk * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    nm = rn < N
    acc = tl.zeros([BM, BN], tl.float32)
    xp = x_ptr + rm[:, None] * sxm + rk[None, :]
    wp = w_ptr + rn[:, None] * sw + rk[None, :]
    for kk in range(0, K, BK):
        if EVEN:
            x = tl.load(xp, mask=(rm < M)[:, None], other=0.0)
            w = tl.load(wp, mask=nm[:, None], other=0.0)
        else:
            km = (kk + rk) < K
            x = tl.load(xp, mask=(rm < M)[:, None] & km[None, :], other=0.0)
            w = tl.load(wp, mask=nm[:, None] & km[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
        xp += BK
        wp += BK
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * sy + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm < M)[:, None] & nm[None, :])


def _run(x2, w, bias, cfg, out):
    """One single-weight launch (+ the split-K reduce) with cfg = (BN, BK, split, warps, stages)."""
    M, K = x2.shape
    N = w.shape[0]
    BN, BK, split, warps, stages = cfg
    k_per_split = triton.cdiv(triton.cdiv(K, split), BK) * BK
    even = K % k_per_split == 0 and N % BN == 0 and k_per_split * split == K
    p = torch.empty((split, 16, N), dtype=torch.float32, device=x2.device) if split > 1 else out
    _skinny_kernel[(triton.cdiv(N, BN), split)](
        x2, w, bias if bias is not None else w, out, p, M, N, K, x2.stride(0), w.stride(0), out.stride(0),
        k_per_split, HAS_BIAS=bias is not None and split == 1, SPLIT=split, EVEN=even, BM=16, BN=BN, BK=BK,
        num_warps=warps, num_stages=stages)
    if split > 1:
        _split_reduce_kernel[(triton.cdiv(N, 128),)](p, bias if bias is not None else w, out, M, N, out.stride(0),
                                                      HAS_BIAS=bias is not None, SPLIT=split, BM=16, BN=128,
                                                      num_warps=4)
    return out


def _run_group(x2, weights, biases, cfg, outs):
    """One grouped launch for 2-3 weights sharing x2, cfg = (BN, BK, warps, stages)."""
    M, K = x2.shape
    BN, BK, warps, stages = cfg
    n = len(weights)
    w = list(weights) + [weights[0]] * (3 - n)
    b = [bb if bb is not None else weights[0] for bb in biases] + [weights[0]] * (3 - n)
    y = list(outs) + [outs[0]] * (3 - n)
    nbs = [triton.cdiv(t.shape[0], BN) for t in weights] + [0] * (3 - n)
    ns = [t.shape[0] for t in w]
    _skinny_group_kernel[(sum(nbs),)](
        x2, w[0], w[1], w[2], b[0], b[1], b[2], y[0], y[1], y[2], ns[0], ns[1], ns[2], nbs[0], nbs[1], M, K,
        x2.stride(0), w[0].stride(0), w[1].stride(0), w[2].stride(0), y[0].stride(0), y[1].stride(0),
        y[2].stride(0), HAS_BIAS=biases[0] is not None, EVEN=K % BK == 0, BM=16, BN=BN, BK=BK,
        num_warps=warps, num_stages=stages)
    return outs


def eligible(x, weight) -> bool:
    """Whether the skinny kernel can compute F.linear(x, weight) (CUDA, bf16/fp16, <= 16 rows)."""
    return (HAS_TRITON and x.is_cuda and weight.dtype in (torch.bfloat16, torch.float16) and x.dtype == weight.dtype
            and weight.dim() == 2 and weight.stride(1) == 1 and x.shape[-1] == weight.shape[1]
            and x.numel() // x.shape[-1] <= 16 and weight.shape[1] % 8 == 0)


def group_eligible(x, weights, biases) -> bool:
    """Whether 2-3 weights sharing x can run as one grouped launch."""
    return (1 < len(weights) <= 3 and all(eligible(x, w) for w in weights)
            and len({w.shape[1] for w in weights}) == 1 and len({w.dtype for w in weights}) == 1
            and len({b is None for b in biases}) == 1
            and all(b is None or (b.dtype == w.dtype and b.is_contiguous()) for w, b in zip(weights, biases)))


def _time_graph(fn, iters=20):
    """ms per call: best of 3 replays of a CUDA graph of `iters` calls."""
    fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        best = min(best, s.elapsed_time(e) / iters)
    return best


def _key(m, k, ns, dtype, device, has_bias) -> str:
    return f"m{m}|k{k}|n{'+'.join(str(n) for n in ns)}|{str(dtype).replace('torch.', '')}|bias{int(has_bias)}|" \
           f"{device_name(device)}"


@torch.no_grad()
def _choose(tuner, key, candidates, runner, default):
    """tuner.choose on a side stream (graph capture inside the timing must not touch the caller's stream)."""
    dev = torch.cuda.current_device()
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        cfg = tuner.choose(key, candidates, runner, default, bench=_time_graph, margin=MARGIN)
    torch.cuda.current_stream(dev).wait_stream(s)
    return cfg


def tune(x2, weight, bias):
    """Time cuBLAS and CONFIGS for this shape (several weight copies so that L2 does not hold them) and remember
    the winner (CUBLAS unless a config takes < MARGIN of its time). Not callable during graph capture."""
    M, K = x2.shape
    key = _key(M, K, (weight.shape[0],), weight.dtype, x2.device, bias is not None)
    if key in TUNER.cache:
        return TUNER.cache[key]
    if not enabled():
        return CUBLAS
    copies = max(1, min(8, int(2 * 64 * 2**20 // (weight.numel() * weight.element_size())) + 1))
    ws = [weight] + [torch.randn_like(weight) * 0.02 for _ in range(copies - 1)]
    xs = torch.randn(M, K, device=x2.device, dtype=x2.dtype)
    out = torch.empty(M, weight.shape[0], device=x2.device, dtype=x2.dtype)
    it = [0]

    def nxt():
        it[0] = (it[0] + 1) % len(ws)
        return ws[it[0]]

    def runner(c):
        if c["kind"] == "cublas":
            return lambda: F.linear(xs, nxt(), bias)
        cfg = tuple(c["cfg"])
        if not torch.allclose(_run(xs, weight, bias, cfg, out).float(), F.linear(xs, weight, bias).float(),
                              atol=2e-2, rtol=2e-2):
            raise ValueError(f"skinny gemm config {cfg} miscomputes on this shape")
        return lambda: _run(xs, nxt(), bias, cfg, out)

    cands = [CUBLAS] + [{"kind": "triton", "cfg": list(c)} for c in CONFIGS if not (c[2] > 1 and K // c[2] < c[1])]
    return _choose(TUNER, key, cands, runner, CUBLAS)


def linear(x, weight, bias=None):
    """F.linear(x, weight, bias) through the tuned skinny kernel where it won, else cuBLAS."""
    x2 = x.reshape(-1, x.shape[-1])
    cfg = TUNER.cache.get(_key(x2.shape[0], weight.shape[1], (weight.shape[0],), weight.dtype, x.device,
                               bias is not None))
    if cfg is None:
        if torch.cuda.is_current_stream_capturing():
            return F.linear(x, weight, bias)
        cfg = tune(x2, weight, bias)
    if cfg["kind"] == "cublas":
        return F.linear(x, weight, bias)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    _run(x2, weight, bias, tuple(cfg["cfg"]), out)
    return out.view(*x.shape[:-1], weight.shape[0])


def tune_group(x2, weights, biases):
    """Time one grouped launch against the per-weight choices (cuBLAS or the tuned kernel) and remember it."""
    M, K = x2.shape
    key = _key(M, K, [w.shape[0] for w in weights], weights[0].dtype, x2.device, biases[0] is not None)
    if key in GROUP_TUNER.cache:
        return GROUP_TUNER.cache[key]
    if not enabled():
        return SEPARATE
    for w, b in zip(weights, biases):
        tune(x2, w, b)
    xs = torch.randn(M, K, device=x2.device, dtype=x2.dtype)
    outs = [torch.empty(M, w.shape[0], device=x2.device, dtype=x2.dtype) for w in weights]

    def runner(c):
        if c["kind"] == "separate":
            return lambda: [linear(xs, w, b) for w, b in zip(weights, biases)]
        cfg = tuple(c["cfg"])
        got = _run_group(xs, weights, biases, cfg, outs)
        if not all(torch.allclose(g.float(), F.linear(xs, w, b).float(), atol=2e-2, rtol=2e-2)
                   for g, w, b in zip(got, weights, biases)):
            raise ValueError(f"grouped skinny gemm config {cfg} miscomputes on this shape")
        return lambda: _run_group(xs, weights, biases, cfg, outs)

    cands = [SEPARATE] + [{"kind": "triton", "cfg": list(c)} for c in GROUP_CONFIGS]
    return _choose(GROUP_TUNER, key, cands, runner, SEPARATE)


def linear_group(x, weights, biases):
    """[F.linear(x, w, b) ...] as one launch where that measured faster than the separate products."""
    x2 = x.reshape(-1, x.shape[-1])
    cfg = GROUP_TUNER.cache.get(_key(x2.shape[0], x2.shape[1], [w.shape[0] for w in weights], weights[0].dtype,
                                     x.device, biases[0] is not None))
    if cfg is None:
        if torch.cuda.is_current_stream_capturing():
            return [linear(x, w, b) for w, b in zip(weights, biases)]
        cfg = tune_group(x2, weights, biases)
    if cfg["kind"] == "separate":
        return [linear(x, w, b) for w, b in zip(weights, biases)]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    outs = [torch.empty((x2.shape[0], w.shape[0]), dtype=x.dtype, device=x.device) for w in weights]
    _run_group(x2, weights, biases, tuple(cfg["cfg"]), outs)
    return [o.view(*x.shape[:-1], o.shape[-1]) for o in outs]
