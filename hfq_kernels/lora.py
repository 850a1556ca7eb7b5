"""Unmerged LoRA for decode steps: y_i += scale_i * (x A_i^T) B_i^T for up to 3 adapters whose linears share an
input (q/k/v, gate/up), as separate shrink and expand launches or fused into the kernels around the linears.

A "shrink" computes the K-split fp32 partials of x A_i^T for the group; an "expand" sums them, rounds t_i to the
model dtype (as PEFT's lora_A output is) and adds scale_i * t_i B_i^T to the base outputs with one rounding.
`lora_add_` runs both as two launches per group (8 per Llama block with all seven projections adapted; at batch 8
that replaced 2 cuBLAS GEMMs per linear). Fused (the rollout engine's HFQ_ROLLOUT_FUSE_LORA=1):
- the shrink runs in the kernel producing the group's input: `add_rmsnorm_shrink` (residual add + RMSNorm, HF
  numerics; q/k/v and gate/up), the attention combine of `hfq_kernels.rollout.decode_attention(shrink=)` (one
  split per head; o_proj), `silu_mul_lora(down=)` (down_proj);
- the expand runs in the kernel consuming the base outputs where that kernel reads whole columns:
  `rope_kv_write(lora=)` for q/k/v (`row_delta`), `silu_mul_lora(up_lora=)` for gate/up; o_proj's and
  down_proj's expands (consumed by a norm that needs whole rows) stay `expand_` launches.
That leaves 2 LoRA launches per block instead of 8. A `Shrink` holds the partials and the geometry both sides share.
A and B are read where they live, so optimizer steps are seen by captured graphs.
"""
from __future__ import annotations

from types import SimpleNamespace

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
        x = tl.load(x_ptr + rm[:, None] * sxm + (kk + rk)[None, :],
                    mask=(rm < M)[:, None] & ((kk + rk) < K)[None, :], other=0.0)
        acc = _shrink_acc(acc, x, a_ptr, sa, R, kk, K, IEEE, BR, BK)
    tl.store(p_ptr + ((i * n_splits + sp) * BM + rm[:, None]) * BR + rr[None, :], acc)


@triton.jit
def _expand_kernel(p_ptr, b0, b1, b2, y0, y1, y2, s0, s1, s2, n0, n1, n2, sb0, sb1, sb2, sy0, sy1, sy2,
                   M, R, nb0, nb1, NS: tl.constexpr,
                   IEEE: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr):
    i, blk = group_of(tl.program_id(0), nb0, nb1)
    scale = sel3(i, s0, s1, s2)
    N, sb, sy, b_ptr, y_ptr = member(i, n0, n1, n2, sb0, sb1, sb2, sy0, sy1, sy2, b0, b1, b2, y0, y1, y2)
    rm = tl.arange(0, BM)
    t = _t_rows(p_ptr, i, M, NS, BM, BR).to(y_ptr.dtype.element_ty)
    rn = blk * BN + tl.arange(0, BN)
    nm = rn < N
    ym = (rm < M)[:, None] & nm[None, :]
    yp = y_ptr + rm[:, None] * sy + rn[None, :]
    y = tl.load(yp, mask=ym, other=0.0)
    tl.store(yp, _tile_delta(y, t, b_ptr, sb, tl.where(nm, rn, 0), R, scale, IEEE, BR), mask=ym)


class Shrink:
    """The fp32 partials of x A_i^T for a group of adapters (one K split per program of the producer) and the
    geometry shared by the producer and `expand_`: plans[i] = (A [r, K], B [N_i, r], scale), one r (<= 128) for
    all; x has M <= 64 rows of K features."""

    def __init__(self, plans, m: int, k: int, device, n_splits: int | None = None, k_per_split: int | None = None,
                 block_k: int = 64):
        n = len(plans)
        if not 1 <= n <= MAX_GROUP:
            raise ValueError(f"lora: need 1..{MAX_GROUP} adapters per group, got {n}")
        r = plans[0][0].shape[0]
        if r > 128 or any(p[0].shape != (r, k) or p[1].shape[1] != r for p in plans):
            raise ValueError(f"lora: A must be [r, {k}] and B [N, r] with one r <= 128 for the group, got "
                             f"{[(tuple(p[0].shape), tuple(p[1].shape)) for p in plans]}")
        if not 1 <= m <= 64:
            raise ValueError(f"lora: the fused decode LoRA takes 1..64 rows, got {m}")
        self.plans, self.n, self.M, self.K, self.R = plans, n, m, k, r
        self.BR = max(16, next_pow2(r))
        g = Shrink.geometry(m, k, n_splits, k_per_split, block_k)
        self.BM, self.BK, self.k_per_split, self.n_splits = g.BM, g.BK, g.k_per_split, g.n_splits
        self.part = torch.empty((n * self.n_splits * self.BM * self.BR,), dtype=torch.float32, device=device)
        self.a = [p[0] for p in plans] + [plans[0][0]] * (MAX_GROUP - n)
        self.sa = [a.stride(0) for a in self.a]


    @staticmethod
    def geometry(m: int, k: int, n_splits: int | None = None, k_per_split: int | None = None, block_k: int = 64):
        """Row padding and K split of a Shrink over [m, k] (also the column split of a producer without one)."""
        if k_per_split is None:
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
                                        IEEE=x.dtype == torch.float32, BM=sh.BM, BR=sh.BR, BK=sh.BK, num_warps=4)


def expand_(sh: Shrink, outs, block_n: int = 64):
    """outs[i] += scale_i * t_i B_i^T in place, t_i the sum of sh's partials rounded to outs' dtype."""
    if len(outs) != sh.n:
        raise ValueError(f"lora expand: {sh.n} adapters but {len(outs)} outputs")
    for o, p in zip(outs, sh.plans):
        _check_rows(o, "lora expand output")
        if o.shape != (sh.M, p[1].shape[0]):
            raise ValueError(f"lora expand: output shape {tuple(o.shape)}, expected {(sh.M, p[1].shape[0])}")
    n = sh.n
    b = [p[1] for p in sh.plans] + [sh.plans[0][1]] * (MAX_GROUP - n)
    ys = list(outs) + [outs[0]] * (MAX_GROUP - n)
    sc = [float(p[2]) for p in sh.plans] + [0.0] * (MAX_GROUP - n)
    nbs = [triton.cdiv(o.shape[1], block_n) for o in outs] + [0] * (MAX_GROUP - n)
    ns = [o.shape[1] for o in ys]
    _expand_kernel[(sum(nbs),)](sh.part, b[0], b[1], b[2], ys[0], ys[1], ys[2], sc[0], sc[1], sc[2], ns[0], ns[1],
                                ns[2], b[0].stride(0), b[1].stride(0), b[2].stride(0), ys[0].stride(0),
                                ys[1].stride(0), ys[2].stride(0), sh.M, sh.R, nbs[0], nbs[1], NS=sh.n_splits,
                                IEEE=outs[0].dtype == torch.float32, BM=sh.BM, BR=sh.BR, BN=block_n, num_warps=4)
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


# ------------------------------------------------------------------ producers with the shrink fused,
# consumers with the expand fused
@triton.jit
def row_delta(x, p_ptr, slot, n_splits, b, b_ptr, sb, rows, rows_ok, R, scale,
              BM: tl.constexpr, BR: tl.constexpr, BS: tl.constexpr):
    """x [BLOCK] (columns `rows` of output row b, in the model dtype) plus scale * t_b B[rows]^T, t_b the sum of
    the Shrink partials of adapter `slot` for row b rounded to x's dtype; one rounding, as `expand_` does."""
    sp = tl.arange(0, BS)
    rr = tl.arange(0, BR)
    part = tl.load(p_ptr + ((slot * n_splits + sp[:, None]) * BM + b) * BR + rr[None, :],
                   mask=(sp < n_splits)[:, None], other=0.0)
    t = tl.sum(part, axis=0).to(x.dtype).to(tl.float32)
    w = tl.load(b_ptr + rows[:, None] * sb + rr[None, :], mask=rows_ok[:, None] & (rr < R)[None, :], other=0.0)
    d = tl.sum(w.to(tl.float32) * t[None, :], axis=1)
    return (x.to(tl.float32) + scale * d).to(x.dtype)


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


@triton.jit
def _store_partials(p_ptr, acc0, acc1, acc2, sp, n_splits, NA: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr):
    rm = tl.arange(0, BM)
    rr = tl.arange(0, BR)
    off = rm[:, None] * BR + rr[None, :]
    tl.store(p_ptr + sp * BM * BR + off, acc0)
    if NA > 1:
        tl.store(p_ptr + (n_splits + sp) * BM * BR + off, acc1)
    if NA > 2:
        tl.store(p_ptr + (2 * n_splits + sp) * BM * BR + off, acc2)


@triton.jit
def _add_rmsnorm_shrink_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, a0, a1, a2, p_ptr, M, H, R, eps,
                               sx, sr, sy, ss, sa0, sa1, sa2, k_per_split, n_splits,
                               HAS_RES: tl.constexpr, NA: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr,
                               BR: tl.constexpr, BK: tl.constexpr, VB: tl.constexpr):
    sp = tl.program_id(0)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    rv = tl.arange(0, VB)
    mm = rm < M
    dt = y_ptr.dtype.element_ty
    ssq = tl.zeros([BM], tl.float32)
    for kk in range(0, H, VB):  # every split needs its rows' full sum of squares: wide tiles, few iterations
        msk = mm[:, None] & ((kk + rv) < H)[None, :]
        x = tl.load(x_ptr + rm[:, None] * sx + (kk + rv)[None, :], mask=msk, other=0.0)
        if HAS_RES:
            r = tl.load(r_ptr + rm[:, None] * sr + (kk + rv)[None, :], mask=msk, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
        xf = x.to(tl.float32)
        ssq += tl.sum(xf * xf, axis=1)
    rstd = 1.0 / tl.sqrt(ssq / H + eps)
    acc0 = tl.zeros([BM, BR], tl.float32)
    acc1 = tl.zeros([BM, BR], tl.float32)
    acc2 = tl.zeros([BM, BR], tl.float32)
    k0 = sp * k_per_split
    for kk in range(k0, k0 + k_per_split, BK):
        km = (kk + rk) < H
        msk = mm[:, None] & km[None, :]
        x = tl.load(x_ptr + rm[:, None] * sx + (kk + rk)[None, :], mask=msk, other=0.0)
        if HAS_RES:
            r = tl.load(r_ptr + rm[:, None] * sr + (kk + rk)[None, :], mask=msk, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
            tl.store(s_ptr + rm[:, None] * ss + (kk + rk)[None, :], x, mask=msk)
        w = tl.load(w_ptr + kk + rk, mask=km, other=0.0).to(tl.float32)
        y = (w[None, :] * (x.to(tl.float32) * rstd[:, None]).to(dt).to(tl.float32)).to(dt)
        tl.store(y_ptr + rm[:, None] * sy + (kk + rk)[None, :], y, mask=msk)
        acc0 = _shrink_acc(acc0, y, a0, sa0, R, kk, H, IEEE, BR, BK)
        if NA > 1:
            acc1 = _shrink_acc(acc1, y, a1, sa1, R, kk, H, IEEE, BR, BK)
        if NA > 2:
            acc2 = _shrink_acc(acc2, y, a2, sa2, R, kk, H, IEEE, BR, BK)
    _store_partials(p_ptr, acc0, acc1, acc2, sp, n_splits, NA, BM, BR)


@triton.jit
def _silu_mul_lora_kernel(g_ptr, u_ptr, o_ptr, a0, p_ptr, up_ptr, bg_ptr, bu_ptr, M, N, R, RU, sg, su, so, sa0,
                          sbg, sbu, k_per_split, n_splits, slot_g, slot_u, scale_g, scale_u, UPS: tl.constexpr,
                          EG: tl.constexpr, EU: tl.constexpr, SHRINK: tl.constexpr, IEEE: tl.constexpr,
                          BM: tl.constexpr, BR: tl.constexpr, BRU: tl.constexpr, BK: tl.constexpr):
    sp = tl.program_id(0)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    mm = rm < M
    dt = o_ptr.dtype.element_ty
    if EG:  # gate_proj's LoRA, from the Shrink the norm filled
        tg = _t_rows(up_ptr, slot_g, M, UPS, BM, BRU).to(dt)
    if EU:
        tu = _t_rows(up_ptr, slot_u, M, UPS, BM, BRU).to(dt)
    acc = tl.zeros([BM, BR], tl.float32)
    k0 = sp * k_per_split
    for kk in range(k0, k0 + k_per_split, BK):
        cols = kk + rk
        cm = cols < N
        msk = mm[:, None] & cm[None, :]
        g = tl.load(g_ptr + rm[:, None] * sg + cols[None, :], mask=msk, other=0.0)
        u = tl.load(u_ptr + rm[:, None] * su + cols[None, :], mask=msk, other=0.0)
        if EG:
            g = _tile_delta(g, tg, bg_ptr, sbg, tl.where(cm, cols, 0), RU, scale_g, IEEE, BRU)
        if EU:
            u = _tile_delta(u, tu, bu_ptr, sbu, tl.where(cm, cols, 0), RU, scale_u, IEEE, BRU)
        gf = g.to(tl.float32)
        a = (gf / (1.0 + tl.exp(-gf))).to(dt).to(tl.float32)
        h = (a * u.to(tl.float32)).to(dt)
        tl.store(o_ptr + rm[:, None] * so + cols[None, :], h, mask=msk)
        if SHRINK:
            acc = _shrink_acc(acc, h, a0, sa0, R, kk, N, IEEE, BR, BK)
    if SHRINK:
        _store_partials(p_ptr, acc, acc, acc, sp, n_splits, 1, BM, BR)


def add_rmsnorm_shrink(x, residual, weight, eps, sh: Shrink):
    """`hfq_kernels.rollout.add_rmsnorm` that also writes the shrink partials of its output into sh:
    x, residual [rows, H] (last dim contiguous), rows == sh.M, H == sh.K; returns (normed, x + residual or x)."""
    H = x.shape[-1]
    x2 = x.reshape(-1, H)
    _check_rows(x2, "add_rmsnorm_shrink x")
    if x2.shape != (sh.M, sh.K):
        raise ValueError(f"add_rmsnorm_shrink: x is {tuple(x2.shape)}, the shrink expects {(sh.M, sh.K)}")
    y = torch.empty_like(x2)
    if residual is None:
        s, r2, s_out = x, x2, x2
    else:
        r2 = residual.reshape(-1, H)
        _check_rows(r2, "add_rmsnorm_shrink residual")
        s_out = torch.empty_like(x2)
        s = s_out.view(x.shape)
    _add_rmsnorm_shrink_kernel[(sh.n_splits,)](
        x2, r2, weight, y, s_out, sh.a[0], sh.a[1], sh.a[2], sh.part, sh.M, H, sh.R, float(eps),
        x2.stride(0), r2.stride(0), y.stride(0), s_out.stride(0), sh.sa[0], sh.sa[1], sh.sa[2], sh.k_per_split,
        sh.n_splits, HAS_RES=residual is not None, NA=sh.n, IEEE=x.dtype == torch.float32, BM=sh.BM, BR=sh.BR,
        BK=sh.BK, VB=max(64, min(next_pow2(H), 8192 // sh.BM)), num_warps=8)  # 4 warps spill (ptxas, sm_90)
    return y.view(x.shape), s


def silu_mul_lora(gate, up, down: Shrink | None = None, up_lora=None, n_splits: int | None = None):
    """SiLU(gate) * up ([rows, N], last dim contiguous) with LoRA fused on either side: `up_lora` = (Shrink
    filled for gate/up, (gate's slot or None, up's slot or None)) adds their expands to gate and up before the
    activation (no expand launch; `gate`/`up` are the base outputs); `down` (one adapter over [rows, N]) gets
    the shrink partials of the result (down_proj's). The column split (programs) is down's, else `n_splits`
    (default: 256 columns per program)."""
    g2, u2 = gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])
    _check_rows(g2, "silu_mul_lora gate")
    _check_rows(u2, "silu_mul_lora up")
    m, n = g2.shape
    if u2.shape != g2.shape or not 1 <= m <= 64:
        raise ValueError(f"silu_mul_lora: gate {tuple(g2.shape)} and up {tuple(u2.shape)} must be one shape with "
                         "1..64 rows")
    if down is not None and ((down.M, down.K) != (m, n) or down.n != 1):
        raise ValueError(f"silu_mul_lora: the down shrink must be one adapter over {(m, n)}, got {down.n} over "
                         f"{(down.M, down.K)}")
    out = torch.empty_like(g2)
    # without down's shrink no partials are summed afterwards: 4 column blocks per program, as many programs as that
    geo = down if down is not None else Shrink.geometry(m, n, n_splits or triton.cdiv(n, 256))
    ush, slots = up_lora if up_lora is not None else (None, (None, None))
    if ush is not None and (ush.M, ush.K) != (m, ush.plans[0][0].shape[1]):
        raise ValueError(f"silu_mul_lora: the gate/up Shrink is over {ush.M} rows, gate has {m}")
    eg, eu = slots[0] is not None, slots[1] is not None
    bg = ush.plans[slots[0]][1] if eg else g2
    bu = ush.plans[slots[1]][1] if eu else g2
    for name, flag, b in (("gate", eg, bg), ("up", eu, bu)):
        if flag and b.shape[0] != n:
            raise ValueError(f"silu_mul_lora: {name}'s lora_B has {b.shape[0]} rows, the output {n} columns")
    _silu_mul_lora_kernel[(geo.n_splits,)](
        g2, u2, out, down.a[0] if down is not None else g2, down.part if down is not None else out,
        ush.part if ush is not None else out, bg, bu, m, n, down.R if down is not None else 0,
        ush.R if ush is not None else 0, g2.stride(0), u2.stride(0), out.stride(0),
        down.sa[0] if down is not None else 0, bg.stride(0), bu.stride(0), geo.k_per_split, geo.n_splits,
        slots[0] or 0, slots[1] or 0,
        float(ush.plans[slots[0]][2]) if eg else 0.0, float(ush.plans[slots[1]][2]) if eu else 0.0,
        UPS=ush.n_splits if ush is not None else 1,
        EG=eg, EU=eu, SHRINK=down is not None, IEEE=gate.dtype == torch.float32, BM=geo.BM,
        BR=down.BR if down is not None else 16, BRU=ush.BR if ush is not None else 16, BK=geo.BK, num_warps=4)
    return out.view(gate.shape)


def lora_add_ref(x, outs, plans):
    """Torch reference of lora_add_ (PEFT's rounding: x A^T in x's dtype, then B, then scale)."""
    for y, (a, b, scale) in zip(outs, plans):
        y += (torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * scale).to(y.dtype)
    return outs
