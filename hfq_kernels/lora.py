"""Unmerged LoRA for decode steps in two Triton launches per group of linears that share an input.

y_i += scale_i * (x A_i^T) B_i^T for up to 3 adapters at once (q/k/v, gate/up): a "shrink" kernel computes
the K-split partials of x A_i^T for all of them, an "expand" kernel sums the partials, rounds t_i to the model
dtype (as PEFT's lora_A output is) and adds scale_i * t_i B_i^T into the base outputs in place. At batch 8
this replaces 2 cuBLAS GEMMs per linear (14 per block, each a few microseconds of latency for a few hundred KB)
by 8 launches per block. A and B are read where they live, so optimizer steps are seen by captured graphs.
"""
from __future__ import annotations

import torch

from hfq_kernels._triton import group_of, member, next_pow2, pick3, sel3, tl, triton

MAX_GROUP = 3


@triton.jit
def _shrink_kernel(x_ptr, a0, a1, a2, p_ptr, M, K, R, sxm, sa0, sa1, sa2, k_per_split, n_splits,
                   IEEE: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    i = tl.program_id(0)
    sp = tl.program_id(1)
    sa = sel3(i, sa0, sa1, sa2)
    a_ptr = pick3(i, a0, a1, a2)
    rm = tl.arange(0, BM)
    rr = tl.arange(0, BR)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BR], tl.float32)
    k0 = sp * k_per_split
    for kk in range(k0, k0 + k_per_split, BK):
        km = (kk + rk) < K
        x = tl.load(x_ptr + rm[:, None] * sxm + (kk + rk)[None, :], mask=(rm < M)[:, None] & km[None, :],
                    other=0.0)
        a = tl.load(a_ptr + rr[:, None] * sa + (kk + rk)[None, :], mask=(rr < R)[:, None] & km[None, :],
                    other=0.0)
        if IEEE:
            acc += tl.dot(x, tl.trans(a), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(a))
    tl.store(p_ptr + ((i * n_splits + sp) * BM + rm[:, None]) * BR + rr[None, :], acc)

@triton.jit
def _expand_kernel(p_ptr, b0, b1, b2, y0, y1, y2, s0, s1, s2, n0, n1, n2, sb0, sb1, sb2, sy0, sy1, sy2,
                   M, R, n_splits, nb0, nb1,
                   IEEE: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr):
    i, blk = group_of(tl.program_id(0), nb0, nb1)
    scale = sel3(i, s0, s1, s2)
    N, sb, sy, b_ptr, y_ptr = member(i, n0, n1, n2, sb0, sb1, sb2, sy0, sy1, sy2, b0, b1, b2, y0, y1, y2)
    rm = tl.arange(0, BM)
    rr = tl.arange(0, BR)
    t = tl.zeros([BM, BR], tl.float32)
    for sp in range(0, n_splits):
        t += tl.load(p_ptr + ((i * n_splits + sp) * BM + rm[:, None]) * BR + rr[None, :])
    dt = y_ptr.dtype.element_ty
    t = t.to(dt)
    rn = blk * BN + tl.arange(0, BN)
    nm = rn < N
    bw = tl.load(b_ptr + rn[:, None] * sb + rr[None, :], mask=nm[:, None] & (rr < R)[None, :], other=0.0)
    if IEEE:
        d = tl.dot(t, tl.trans(bw), input_precision="ieee")
    else:
        d = tl.dot(t, tl.trans(bw))
    ym = (rm < M)[:, None] & nm[None, :]
    yp = y_ptr + rm[:, None] * sy + rn[None, :]
    y = tl.load(yp, mask=ym, other=0.0).to(tl.float32)
    tl.store(yp, (y + scale * d).to(dt), mask=ym)


def lora_add_(x, outs, plans, n_splits=None, block_n=64):
    """outs[i] += scale_i * (x A_i^T) B_i^T in place; plans[i] = (A [r, K], B [N_i, r], scale), one adapter
    each, all with the same r (<= 128) and dtype as x; x [M <= 64, K] (last dim contiguous); outs[i] [M, N_i]
    (last dim contiguous)."""
    n = len(plans)
    if not (1 <= n <= MAX_GROUP and n == len(outs)):
        raise ValueError(f"lora_add_: need 1..{MAX_GROUP} plans and one output each, got {n} plans, {len(outs)} outs")
    M, K = x.shape
    R = plans[0][0].shape[0]
    BR = max(16, next_pow2(R))
    BK = 64
    if n_splits is None:
        n_splits = max(1, min(16, triton.cdiv(K, 4 * BK)))
    k_per_split = triton.cdiv(triton.cdiv(K, n_splits), BK) * BK
    n_splits = triton.cdiv(K, k_per_split)
    BM = max(16, next_pow2(M))
    part = torch.empty((n * n_splits * BM * BR,), dtype=torch.float32, device=x.device)
    a = [p[0] for p in plans] + [plans[0][0]] * (MAX_GROUP - n)
    b = [p[1] for p in plans] + [plans[0][1]] * (MAX_GROUP - n)
    ys = list(outs) + [outs[0]] * (MAX_GROUP - n)
    sc = [float(p[2]) for p in plans] + [0.0] * (MAX_GROUP - n)
    nbs = [triton.cdiv(o.shape[1], block_n) for o in outs] + [0] * (MAX_GROUP - n)
    ns = [o.shape[1] for o in ys]
    ieee = x.dtype == torch.float32
    _shrink_kernel[(n, n_splits)](x, a[0], a[1], a[2], part, M, K, R, x.stride(0), a[0].stride(0), a[1].stride(0),
                                  a[2].stride(0), k_per_split, n_splits, IEEE=ieee, BM=BM, BR=BR, BK=BK, num_warps=4)
    _expand_kernel[(sum(nbs),)](part, b[0], b[1], b[2], ys[0], ys[1], ys[2], sc[0], sc[1], sc[2], ns[0], ns[1], ns[2],
                                b[0].stride(0), b[1].stride(0), b[2].stride(0), ys[0].stride(0), ys[1].stride(0),
                                ys[2].stride(0), M, R, n_splits, nbs[0], nbs[1], IEEE=ieee, BM=BM, BR=BR,
                                BN=block_n, num_warps=4)
    return outs


def lora_add_ref(x, outs, plans):
    """Torch reference of lora_add_ (PEFT's rounding: x A^T in x's dtype, then B, then scale)."""
    for y, (a, b, scale) in zip(outs, plans):
        y += (torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * scale).to(y.dtype)
    return outs
