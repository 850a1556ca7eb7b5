"""Skinny GEMM for decode steps: y = x @ W^T (+ bias) with few rows (M <= 16), BF16/FP16 weights.

A decode step of a 7B model at batch 8 is ~14 GB of weight reads; cuBLAS runs these M=8 products at ~2.4 TB/s
on an H100. This Triton kernel streams W in [BN, BK] tiles (optionally split over K with an fp32 partial
buffer and a reduce kernel) and is picked per (M, N, K, dtype) only where it measured faster than cuBLAS:
`tune` times cuBLAS and the candidate configs once, outside graph capture, and `linear` then uses the winner
(cuBLAS when nothing won or the shape was never tuned). The weight is read where it lives, so in-place
updates are seen by captured graphs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

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


# (BN, BK, split, warps, stages)
CONFIGS = ((64, 128, 1, 4, 4), (32, 128, 1, 4, 5), (32, 256, 1, 4, 4), (64, 256, 1, 8, 3), (128, 128, 1, 8, 4),
           (64, 128, 2, 4, 4), (64, 128, 4, 4, 4), (32, 128, 4, 4, 4), (64, 128, 8, 4, 4), (32, 256, 8, 4, 3))

_choice: dict = {}  # (M, N, K, dtype, has_bias) -> config or None (cuBLAS)


def _run(x2, w, bias, cfg, out):
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


def eligible(x, weight) -> bool:
    return (HAS_TRITON and x.is_cuda and weight.dtype in (torch.bfloat16, torch.float16) and x.dtype == weight.dtype
            and weight.dim() == 2 and weight.stride(1) == 1 and x.shape[-1] == weight.shape[1]
            and x.numel() // x.shape[-1] <= 16 and weight.shape[1] % 8 == 0)


def _time(fn, iters=20):
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


@torch.no_grad()
def tune(x2, weight, bias, margin=0.97):
    """Time cuBLAS and CONFIGS for this shape (graph replay of 20 calls; several weight copies so that L2 does
    not hold them) and remember the winner. Not callable during graph capture."""
    M, K = x2.shape
    N = weight.shape[0]
    key = (M, N, K, weight.dtype, bias is not None)
    if key in _choice:
        return _choice[key]
    dev = x2.device
    copies = max(1, min(8, int(2 * 64 * 2**20 // (weight.numel() * weight.element_size())) + 1))
    ws = [weight] + [torch.randn_like(weight) * 0.02 for _ in range(copies - 1)]
    xs = torch.randn(M, K, device=dev, dtype=x2.dtype)
    out = torch.empty(M, N, device=dev, dtype=x2.dtype)
    it = [0]

    def nxt():
        it[0] = (it[0] + 1) % len(ws)
        return ws[it[0]]

    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    results = {}
    with torch.cuda.stream(s):
        results[None] = _time(lambda: F.linear(xs, nxt(), bias))
        ref = F.linear(xs, weight, bias).float()
        for cfg in CONFIGS:
            if cfg[2] > 1 and K // cfg[2] < cfg[1]:
                continue
            try:
                got = _run(xs, weight, bias, cfg, out).float()
                if not torch.allclose(got, ref, atol=2e-2, rtol=2e-2):
                    continue
                results[cfg] = _time(lambda c=cfg: _run(xs, nxt(), bias, c, out))
            except Exception:  # noqa: BLE001 - a config that does not compile is skipped
                continue
    torch.cuda.current_stream(dev).wait_stream(s)
    del ws
    best = min(results, key=lambda c: results[c])
    choice = best if best is not None and results[best] < margin * results[None] else None
    _choice[key] = choice
    TIMINGS[key] = {"cublas_us": round(results[None] * 1000, 2),
                    "best": None if choice is None else list(choice),
                    "best_us": round(results[best] * 1000, 2)}
    return choice


TIMINGS: dict = {}


def linear(x, weight, bias=None):
    """F.linear(x, weight, bias) through the tuned skinny kernel where it won, else cuBLAS."""
    x2 = x.reshape(-1, x.shape[-1])
    key = (x2.shape[0], weight.shape[0], weight.shape[1], weight.dtype, bias is not None)
    if key not in _choice:
        if torch.cuda.is_current_stream_capturing():
            return F.linear(x, weight, bias)
        tune(x2, weight, bias)
    cfg = _choice[key]
    if cfg is None:
        return F.linear(x, weight, bias)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    _run(x2, weight, bias, cfg, out)
    return out.view(*x.shape[:-1], weight.shape[0])


# ------------------------------------------------------------------------------------------ grouped
if HAS_TRITON:

    @triton.jit
    def _skinny_group_kernel(x_ptr, w0, w1, w2, b0, b1, b2, y0, y1, y2, n0, n1, n2, nb0, nb1, M, K, sxm,
                             sw0, sw1, sw2, sy0, sy1, sy2, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr,
                             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pid = tl.program_id(0)
        i = (pid >= nb0).to(tl.int32) + (pid >= nb0 + nb1).to(tl.int32)
        blk = pid - tl.where(i == 0, 0, tl.where(i == 1, nb0, nb0 + nb1))
        N = tl.where(i == 0, n0, tl.where(i == 1, n1, n2))
        sw = tl.where(i == 0, sw0, tl.where(i == 1, sw1, sw2))
        sy = tl.where(i == 0, sy0, tl.where(i == 1, sy1, sy2))
        if i == 0:
            w_ptr = w0
            b_ptr = b0
            y_ptr = y0
        elif i == 1:
            w_ptr = w1
            b_ptr = b1
            y_ptr = y1
        else:
            w_ptr = w2
            b_ptr = b2
            y_ptr = y2
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


GROUP_CONFIGS = ((32, 128, 4, 5), (32, 256, 4, 4), (64, 128, 4, 4), (64, 256, 8, 3))  # (BN, BK, warps, stages)
_group_choice: dict = {}


def _run_group(x2, weights, biases, cfg, outs):
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


def group_eligible(x, weights, biases) -> bool:
    return (1 < len(weights) <= 3 and all(eligible(x, w) for w in weights)
            and len({w.shape[1] for w in weights}) == 1 and len({w.dtype for w in weights}) == 1
            and len({b is None for b in biases}) == 1
            and all(b is None or (b.dtype == w.dtype and b.is_contiguous()) for w, b in zip(weights, biases)))


@torch.no_grad()
def tune_group(x2, weights, biases, margin=0.97):
    """Time one grouped launch against the per-weight choices (cuBLAS or the tuned kernel) and remember it."""
    M, K = x2.shape
    key = (M, K, tuple(w.shape[0] for w in weights), weights[0].dtype, biases[0] is not None)
    if key in _group_choice:
        return _group_choice[key]
    dev = x2.device
    for w, b in zip(weights, biases):
        tune(x2, w, b)
    xs = torch.randn(M, K, device=dev, dtype=x2.dtype)
    outs = [torch.empty(M, w.shape[0], device=dev, dtype=x2.dtype) for w in weights]
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    res = {}
    with torch.cuda.stream(s):
        res[None] = _time(lambda: [linear(xs, w, b) for w, b in zip(weights, biases)])
        refs = [F.linear(xs, w, b).float() for w, b in zip(weights, biases)]
        for cfg in GROUP_CONFIGS:
            try:
                got = _run_group(xs, weights, biases, cfg, outs)
                if not all(torch.allclose(g.float(), r, atol=2e-2, rtol=2e-2) for g, r in zip(got, refs)):
                    continue
                res[cfg] = _time(lambda c=cfg: _run_group(xs, weights, biases, c, outs))
            except Exception:  # noqa: BLE001
                continue
    torch.cuda.current_stream(dev).wait_stream(s)
    best = min(res, key=lambda c: res[c])
    choice = best if best is not None and res[best] < margin * res[None] else None
    _group_choice[key] = choice
    TIMINGS[("group",) + key[:3]] = {"separate_us": round(res[None] * 1000, 2),
                                     "best": None if choice is None else list(choice),
                                     "best_us": round(res[best] * 1000, 2)}
    return choice


def linear_group(x, weights, biases):
    """[F.linear(x, w, b) ...] as one launch where that measured faster than the separate products."""
    x2 = x.reshape(-1, x.shape[-1])
    key = (x2.shape[0], x2.shape[1], tuple(w.shape[0] for w in weights), weights[0].dtype, biases[0] is not None)
    if key not in _group_choice:
        if torch.cuda.is_current_stream_capturing():
            return [linear(x, w, b) for w, b in zip(weights, biases)]
        tune_group(x2, weights, biases)
    cfg = _group_choice[key]
    if cfg is None:
        return [linear(x, w, b) for w, b in zip(weights, biases)]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    outs = [torch.empty((x2.shape[0], w.shape[0]), dtype=x.dtype, device=x.device) for w in weights]
    _run_group(x2, weights, biases, cfg, outs)
    return [o.view(*x.shape[:-1], o.shape[-1]) for o in outs]
