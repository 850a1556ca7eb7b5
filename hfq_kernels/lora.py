"""Unmerged LoRA for decode steps: y_i += scale_i * (x A_i^T) B_i^T for up to 3 adapters whose linears share an
input (q/k/v, gate/up), as one shrink and one expand launch per group.

A "shrink" computes the K-split fp32 partials of x A_i^T for the group; an "expand" sums them, rounds t_i to the
model dtype (as PEFT's lora_A output is) and adds scale_i * t_i B_i^T to the base outputs with one rounding.
`lora_add_` runs both (8 launches per Llama block with all seven projections adapted; at batch 8 that replaced 2
cuBLAS GEMMs per linear). A `Shrink` holds the partials and the geometry both sides share. A and B are read where
they live, so optimizer steps are seen by captured graphs. They stay separate launches: fusing the shrinks into the
norm / attention / SiLU*mul kernels and the expands into RoPE / SiLU*mul measured 0.90x of them (H100, 7B-shaped,
batch 8). Where the base linear leaves split-K partials (the NVFP4 decode GEMV), the expand writes the base output
itself from them (`expand_(base=...)`, the reduce kernel's bits): one launch fewer per group, 1.02x that step.
The rollout decoder runs such a group's shrink on a side stream, concurrent with the base GEMV (hfq.rollout.decoder).
The shrink computed by extra programs of the NVFP4 Gluon launch instead (no shrink launch, no fork, PDL kept) was
slower in every form tried (decode step 4.5-6.0 ms vs 3.7 ms): programs light enough to keep the GEMV tiles' 80
registers run a serial K loop longer than the GEMV, heavier ones cut the tiles' occupancy.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from hfq_kernels._triton import group_of, member, next_pow2, pdl_enter, pdl_meta, pick3, sel3, tl, triton

MAX_GROUP = 3


@triton.jit
def _shrink_kernel(x_ptr, a0, a1, a2, p_ptr, M, K, R, sxm, sa0, sa1, sa2, k_per_split, n_splits,
                   IEEE: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
                   PDL: tl.constexpr = False):
    pdl_enter(PDL)
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
        x = tl.load(x_ptr + rm[:, None] * sxm + (kk + rk)[None, :],
                    mask=(rm < M)[:, None] & ((kk + rk) < K)[None, :], other=0.0)
        acc = _shrink_acc(acc, x, a_ptr, sa, R, kk, K, IEEE, BR, BK)
    tl.store(p_ptr + ((i * n_splits + sp) * BM + rm[:, None]) * BR + rr[None, :], acc)


@triton.jit
def _expand_kernel(p_ptr, b0, b1, b2, y0, y1, y2, s0, s1, s2, n0, n1, n2, sb0, sb1, sb2, sy0, sy1, sy2,
                   q0, q1, q2, c0, c1, c2, M, R, nb0, nb1, NS: tl.constexpr,
                   IEEE: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
                   QS: tl.constexpr = 0, HAS_BIAS: tl.constexpr = False, PDL: tl.constexpr = False):
    """y_i += scale_i * t_i B_i^T. QS > 0: y_i is first made from the base linear's split-K partials q_i
    [QS, M, N_i] (+ bias c_i), summed and cast as nvfp4_matmul's reduce does (its launch folded in here)."""
    pdl_enter(PDL)
    i, blk = group_of(tl.program_id(0), nb0, nb1)
    scale = sel3(i, s0, s1, s2)
    N, sb, sy, b_ptr, y_ptr = member(i, n0, n1, n2, sb0, sb1, sb2, sy0, sy1, sy2, b0, b1, b2, y0, y1, y2)
    rm = tl.arange(0, BM)
    t = _t_rows(p_ptr, i, M, NS, BM, BR).to(y_ptr.dtype.element_ty)
    rn = blk * BN + tl.arange(0, BN)
    nm = rn < N
    ym = (rm < M)[:, None] & nm[None, :]
    yp = y_ptr + rm[:, None] * sy + rn[None, :]
    if QS > 0:
        q_ptr = pick3(i, q0, q1, q2)
        acc = tl.zeros([BM, BN], tl.float32)
        for sp in tl.static_range(QS):  # split order, as the reduce sums
            acc += tl.load(q_ptr + (sp * M + rm[:, None]) * N + rn[None, :], mask=ym, other=0.0)
        if HAS_BIAS:
            acc += tl.load(pick3(i, c0, c1, c2) + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
        y = acc.to(y_ptr.dtype.element_ty)
    else:
        y = tl.load(yp, mask=ym, other=0.0)
    tl.store(yp, _tile_delta(y, t, b_ptr, sb, tl.where(nm, rn, 0), R, scale, IEEE, BR), mask=ym)


class Shrink:
    """The fp32 partials of x A_i^T for a group of adapters (one K split per program of `shrink_`) and the
    geometry shared with `expand_`: plans[i] = (A [r, K], B [N_i, r], scale), one r (<= 128) for
    all; x has M <= 64 rows of K features."""

    def __init__(self, plans, m: int, k: int, device, n_splits: int | None = None, block_k: int = 64):
        n = len(plans)
        if not 1 <= n <= MAX_GROUP:
            raise ValueError(f"lora: need 1..{MAX_GROUP} adapters per group, got {n}")
        r = plans[0][0].shape[0]
        if r > 128 or any(p[0].shape != (r, k) or p[1].shape[1] != r for p in plans):
            raise ValueError(f"lora: A must be [r, {k}] and B [N, r] with one r <= 128 for the group, got "
                             f"{[(tuple(p[0].shape), tuple(p[1].shape)) for p in plans]}")
        if not 1 <= m <= 64:
            raise ValueError(f"lora: the decode LoRA kernels take 1..64 rows, got {m}")
        self.plans, self.n, self.M, self.K, self.R = plans, n, m, k, r
        self.BR = max(16, next_pow2(r))
        g = Shrink.geometry(m, k, n_splits, block_k)
        self.BM, self.BK, self.k_per_split, self.n_splits = g.BM, g.BK, g.k_per_split, g.n_splits
        self.part = torch.empty((n * self.n_splits * self.BM * self.BR,), dtype=torch.float32, device=device)
        self.a = [p[0] for p in plans] + [plans[0][0]] * (MAX_GROUP - n)
        self.sa = [a.stride(0) for a in self.a]


    @staticmethod
    def geometry(m: int, k: int, n_splits: int | None = None, block_k: int = 64):
        """Row padding and K split of a Shrink over [m, k]. At most 16 splits: the expand sums that many partial
        tiles; on the H100 (7B-shaped NVFP4+LoRA, batch 8) caps of 4 / 8 / 32 / 64 took the decode step from 3.82 ms
        to 4.37 / 3.94 / 3.87 / 4.16 ms."""
        if n_splits is None:
            n_splits = max(1, min(16, triton.cdiv(k, 4 * block_k)))
        k_per_split = triton.cdiv(triton.cdiv(k, n_splits), block_k) * block_k
        return SimpleNamespace(BM=max(16, next_pow2(m)), BK=block_k, k_per_split=k_per_split,
                               n_splits=triton.cdiv(k, k_per_split))


def _check_rows(x2, what):
    if x2.dim() != 2 or x2.stride(-1) != 1:
        raise ValueError(f"{what}: expected a [rows, features] tensor with contiguous features, got shape "
                         f"{tuple(x2.shape)} strides {x2.stride()}")


def shrink_(x, sh: Shrink):
    """The partials of x A_i^T into sh.part (x [M, K], last dim contiguous)."""
    _check_rows(x, "lora shrink x")
    _shrink_kernel[(sh.n, sh.n_splits)](x, sh.a[0], sh.a[1], sh.a[2], sh.part, sh.M, sh.K, sh.R, x.stride(0),
                                        sh.sa[0], sh.sa[1], sh.sa[2], sh.k_per_split, sh.n_splits,
                                        IEEE=x.dtype == torch.float32, BM=sh.BM, BR=sh.BR, BK=sh.BK, num_warps=4,
                                        **pdl_meta(x.device))


def expand_(sh: Shrink, outs, block_n: int = 64, base=None):
    """outs[i] += scale_i * t_i B_i^T in place, t_i the sum of sh's partials rounded to outs' dtype. block_n
    columns per program (each program sums all partial tiles): on the H100 (7B-shaped NVFP4+LoRA, batch 8) 128 and
    256 took the decode step from 3.82 ms to 3.89 / 4.15 ms.

    base = (partials, split, biases): outs[i] is written, not read: first the split-K reduce of the base linear's
    fp32 partials[i] [split, M, N_i] (contiguous) plus biases[i] (or None), with the reduce kernel's bits, then the
    update (one launch where reduce + expand take two)."""
    if len(outs) != sh.n:
        raise ValueError(f"lora expand: {sh.n} adapters but {len(outs)} outputs")
    for o, p in zip(outs, sh.plans):
        _check_rows(o, "lora expand output")
        if o.shape != (sh.M, p[1].shape[0]):
            raise ValueError(f"lora expand: output shape {tuple(o.shape)}, expected {(sh.M, p[1].shape[0])}")
    n = sh.n
    qs, qp, cp, has_bias = 0, [sh.part] * MAX_GROUP, [sh.part] * MAX_GROUP, False
    if base is not None:
        parts, qs, biases = base
        if len(parts) != n or len(biases) != n or qs < 1:
            raise ValueError(f"lora expand: base needs {n} partials and biases and a split >= 1, got "
                             f"{len(parts)}, {len(biases)}, split {qs}")
        for q, o in zip(parts, outs):
            if q.shape != (qs, sh.M, o.shape[1]) or q.dtype != torch.float32 or not q.is_contiguous():
                raise ValueError(f"lora expand: base partials must be contiguous float32 {(qs, sh.M, o.shape[1])}, "
                                 f"got {q.dtype} {tuple(q.shape)}")
        has_bias = biases[0] is not None
        for c, o in zip(biases, outs):
            if (c is not None) != has_bias or (c is not None and (c.shape != (o.shape[1],) or not c.is_contiguous())):
                raise ValueError(f"lora expand: biases must be all None or contiguous [N_i], got "
                                 f"{[None if c is None else tuple(c.shape) for c in biases]}")
        qp = list(parts) + [parts[0]] * (MAX_GROUP - n)
        cp = (list(biases) + [biases[0]] * (MAX_GROUP - n)) if has_bias else qp
    b = [p[1] for p in sh.plans] + [sh.plans[0][1]] * (MAX_GROUP - n)
    ys = list(outs) + [outs[0]] * (MAX_GROUP - n)
    sc = [float(p[2]) for p in sh.plans] + [0.0] * (MAX_GROUP - n)
    nbs = [triton.cdiv(o.shape[1], block_n) for o in outs] + [0] * (MAX_GROUP - n)
    ns = [o.shape[1] for o in ys]
    _expand_kernel[(sum(nbs),)](sh.part, b[0], b[1], b[2], ys[0], ys[1], ys[2], sc[0], sc[1], sc[2], ns[0], ns[1],
                                ns[2], b[0].stride(0), b[1].stride(0), b[2].stride(0), ys[0].stride(0),
                                ys[1].stride(0), ys[2].stride(0), qp[0], qp[1], qp[2], cp[0], cp[1], cp[2],
                                sh.M, sh.R, nbs[0], nbs[1], NS=sh.n_splits,
                                IEEE=outs[0].dtype == torch.float32, BM=sh.BM, BR=sh.BR, BN=block_n, QS=qs,
                                HAS_BIAS=has_bias, num_warps=4, **pdl_meta(outs[0].device))
    return outs


def lora_add_(x, outs, plans, n_splits=None, block_n=64):
    """outs[i] += scale_i * (x A_i^T) B_i^T in place; plans[i] = (A [r, K], B [N_i, r], scale), one adapter
    each, all with the same r (<= 128) and dtype as x; x [M <= 64, K] (last dim contiguous); outs[i] [M, N_i]
    (last dim contiguous)."""
    n = len(plans)
    if not (1 <= n <= MAX_GROUP and n == len(outs)):
        raise ValueError(f"lora_add_: need 1..{MAX_GROUP} plans and one output each, got {n} plans, {len(outs)} outs")
    sh = Shrink(plans, x.shape[0], x.shape[1], x.device, n_splits=n_splits)
    shrink_(x, sh)
    return expand_(sh, outs, block_n)


@triton.jit
def _tile_delta(x, t, b_ptr, sb, cols, R, scale, IEEE: tl.constexpr, BR: tl.constexpr):
    """x [BM, BK] (columns `cols`) plus scale * t [BM, BR] (model dtype) times B[cols]^T, one rounding."""
    rr = tl.arange(0, BR)
    w = tl.load(b_ptr + cols[:, None] * sb + rr[None, :], mask=(rr < R)[None, :], other=0.0)
    if IEEE:
        d = tl.dot(t, tl.trans(w), input_precision="ieee")
    else:
        d = tl.dot(t, tl.trans(w))
    return (x.to(tl.float32) + scale * d).to(x.dtype)


@triton.jit
def _t_rows(p_ptr, slot, M, NS: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr):
    """[BM, BR] fp32: the summed Shrink partials of adapter `slot` (rows >= M zero)."""
    rm = tl.arange(0, BM)
    rr = tl.arange(0, BR)
    t = tl.zeros([BM, BR], tl.float32)
    for sp in tl.static_range(NS):  # unrolled: the partials' loads are issued together, not one round trip each
        t += tl.load(p_ptr + ((slot * NS + sp) * BM + rm[:, None]) * BR + rr[None, :],
                     mask=(rm < M)[:, None], other=0.0)
    return t


@triton.jit
def _shrink_acc(acc, y, a_ptr, sa, R, kk, K, IEEE: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    """acc [BM, BR] += y [BM, BK] (columns kk..kk+BK) times A[:, kk..kk+BK]^T."""
    rr = tl.arange(0, BR)
    rk = kk + tl.arange(0, BK)
    a = tl.load(a_ptr + rr[:, None] * sa + rk[None, :], mask=(rr < R)[:, None] & (rk < K)[None, :], other=0.0)
    if IEEE:
        acc += tl.dot(y, tl.trans(a), input_precision="ieee")
    else:
        acc += tl.dot(y, tl.trans(a))
    return acc


def lora_add_ref(x, outs, plans):
    """Torch reference of lora_add_ (PEFT's rounding: x A^T in x's dtype, then B, then scale)."""
    for y, (a, b, scale) in zip(outs, plans):
        y += (torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * scale).to(y.dtype)
    return outs
