"""NVFP4 W4A16 matmul kernels (Triton): y = x @ dequant(W)^T (+ bias) on the canonical compressed-tensors layout.

The tensor-core kernels are "swap-AB": y^T tiles = dequant(W)[BN, BK] @ x^T[BK, BM], so the weight tile
(dequantised in registers) is the MMA's A operand and the token dimension is the small MMA N dimension. The
weight tile is E2M1 * E4M3-scale, exact in bf16/fp16 (<= 6 significant bits, |v| <= 2688), and 1/global_recip is
applied to the fp32 accumulator. Decode (M <= 64) splits K so that every SM streams weights; split-K partials are
summed by the reduce kernels here. Which kernel runs for a shape: nvfp4_configs; launches: nvfp4_plan.
"""
from __future__ import annotations

from hfq_kernels._triton import HAS_TRITON, e2m1_raw, e2m1_to_f32, e4m3_to_f32, pdl_enter, tl, triton

# Inline PTX: 4 packed bytes ($4) + 4 per-byte scales ($5, $6: x2 pairs) -> values of the 4 low
# nibbles ($0, $1) and of the 4 high nibbles ($2, $3), each multiplied by its scale.
# prmt with the code's 3 magnitude bits as selector reads a byte from an 8-entry table (one table for
# the high byte of the 16-bit value, one for the low byte); the sign bits are moved to each high byte's
# msb with one more prmt + lop3. The multiply is exact (see module doc).
_ASM_TEMPLATE = """
{
.reg .b32 m, m2, ql, lo, hi, lo2, hi2, sm, sm2, ha, hb, la, lb, z, sgn;
mov.b32 ha, HA;
mov.b32 hb, HB;
mov.b32 la, LA;
mov.b32 lb, LB;
mov.b32 sgn, 0x80808080;
mov.b32 z, 0x80008000;
and.b32 m, $4, 0x77777777;
shr.u32 m2, m, 16;
shl.b32 ql, $4, 4;
prmt.b32 sm, ql, $4, 0x5140;
prmt.b32 sm2, ql, $4, 0x7362;
prmt.b32 hi, ha, hb, m;
prmt.b32 lo, la, lb, m;
prmt.b32 hi2, ha, hb, m2;
prmt.b32 lo2, la, lb, m2;
lop3.b32 hi, hi, sm, sgn, 0xF8;
lop3.b32 hi2, hi2, sm2, sgn, 0xF8;
prmt.b32 $0, lo, hi, 0x6240;
prmt.b32 $2, lo, hi, 0x7351;
prmt.b32 $1, lo2, hi2, 0x6240;
prmt.b32 $3, lo2, hi2, 0x7351;
fma.rn.TY $0, $0, $5, z;
fma.rn.TY $2, $2, $5, z;
fma.rn.TY $1, $1, $6, z;
fma.rn.TY $3, $3, $6, z;
}
"""
# E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6: bf16 = 0000 3F00 3F80 3FC0 4000 4040 4080 40C0,
# fp16 = 0000 3800 3C00 3E00 4000 4200 4400 4600 (low bytes all zero).
_ASM_BF16 = (_ASM_TEMPLATE.replace("HA", "0x3F3F3F00").replace("HB", "0x40404040")
             .replace("LA", "0xC0800000").replace("LB", "0xC0804000").replace("TY", "bf16x2"))
_ASM_FP16 = (_ASM_TEMPLATE.replace("HA", "0x3E3C3800").replace("HB", "0x46444240")
             .replace("LA", "0x00000000").replace("LB", "0x00000000").replace("TY", "f16x2"))
if HAS_TRITON:  # a jitted function may read no other globals (a plain str made every inline-PTX build fail)
    _ASM_BF16, _ASM_FP16 = tl.constexpr(_ASM_BF16), tl.constexpr(_ASM_FP16)

@triton.jit
def _dequant_tile(p, s, R: tl.constexpr, C: tl.constexpr, DT: tl.constexpr, USE_ASM: tl.constexpr):
    """Packed bytes [R, C/2] + scale bytes [R, C/16] -> E2M1*E4M3 values [R, C] in DT (exact)."""
    sf = e4m3_to_f32(s.to(tl.int32))
    if USE_ASM:
        sd = sf.to(DT)
        sd = tl.reshape(tl.broadcast_to(tl.reshape(sd, (R, C // 16, 1)), (R, C // 16, 8)), (R, C // 2))
        if DT == tl.bfloat16:
            lo, hi = tl.inline_asm_elementwise(_ASM_BF16, "=r,=r,=r,=r,r,r,r", [p, sd],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        else:
            lo, hi = tl.inline_asm_elementwise(_ASM_FP16, "=r,=r,=r,=r,r,r,r", [p, sd],
                                               dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        w = tl.reshape(tl.join(lo, hi), (R, C))
    else:
        pi = p.to(tl.int32)
        v = tl.join(e2m1_to_f32(pi & 15), e2m1_to_f32(pi >> 4))
        v = tl.reshape(v, (R, C // 16, 16)) * tl.reshape(sf, (R, C // 16, 1))
        w = tl.reshape(v, (R, C)).to(DT)
    return w

@triton.jit
def _swap_ab_tile(M, N, BN: tl.constexpr, BM: tl.constexpr):
    """This program's weight rows rn and token rows rm (grid: N tiles, M tiles, K splits), their bounds, and the
    rows clamped into range (int64) so that loads stay unmasked: (pid_k, rn, rm, n_ok, m_ok, rn_c, rm_c)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = pid_m * BM + tl.arange(0, BM)
    n_ok = rn < N
    m_ok = rm < M
    return pid_k, rn, rm, n_ok, m_ok, tl.where(n_ok, rn, 0).to(tl.int64), tl.where(m_ok, rm, 0).to(tl.int64)


@triton.jit
def _mm_kernel(x_ptr, wp_ptr, ws_ptr, recip_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_ym, chunks_per_split,
               BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr,
               ATOMIC: tl.constexpr, USE_ASM: tl.constexpr, MASK_K: tl.constexpr,
               F32_DOT: tl.constexpr):
    """y[M, N] (+)= x[M, K] @ dequant(W)[N, K]^T, computed as W-tile @ x^T-tile (swap-AB), split over K."""
    pid_k, rn, rm, n_ok, m_ok, rn_c, rm_c = _swap_ab_tile(M, N, BN, BM)
    k_lo = pid_k * chunks_per_split * BK
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    kp = tl.arange(0, BK // 2)
    ks = tl.arange(0, BK // 16)
    kk = tl.arange(0, BK)
    wp_rows = wp_ptr + rn_c[:, None] * (K // 2)
    ws_rows = ws_ptr + rn_c[:, None] * (K // 16)
    x_cols = x_ptr + rm_c[None, :] * stride_xm
    for i in range(0, chunks_per_split):
        k = k_lo + i * BK
        if MASK_K:  # K % BK != 0 or an uneven split: chunks past K load as zeros
            p = tl.load(wp_rows + (k // 2 + kp)[None, :], mask=(k // 2 + kp < K // 2)[None, :], other=0)
            s = tl.load(ws_rows + (k // 16 + ks)[None, :], mask=(k // 16 + ks < K // 16)[None, :], other=0)
            xt = tl.load(x_cols + (k + kk)[:, None], mask=(k + kk < K)[:, None], other=0.0)
        else:
            p = tl.load(wp_rows + (k // 2 + kp)[None, :])
            s = tl.load(ws_rows + (k // 16 + ks)[None, :])
            xt = tl.load(x_cols + (k + kk)[:, None])
        w = _dequant_tile(p, s, BN, BK, x_ptr.dtype.element_ty, USE_ASM)
        if F32_DOT:  # the interpreter's dot reads bf16 operands as raw uint16
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc)
        else:
            acc = tl.dot(w, xt, acc)
    acc = acc * (1.0 / tl.load(recip_ptr))
    ymask = n_ok[:, None] & m_ok[None, :]
    yp = y_ptr + rm[None, :].to(tl.int64) * stride_ym + rn[:, None]
    if ATOMIC:
        tl.atomic_add(yp, acc, mask=ymask, sem="relaxed")
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=ymask)

@triton.jit
def _gemv_kernel(x_ptr, wp_ptr, ws_ptr, recip_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_ym, chunks_per_split,
                 BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr,
                 ATOMIC: tl.constexpr, MASK_K: tl.constexpr):
    """CUDA-core GEMV for M <= BM (tiny): [BN, BK/16, 8] byte tiles, even/odd x columns, no interleave and
    no shared memory; each block's 16 products are summed before its scale is applied."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    n_ok = rn < N
    rn_c = tl.where(n_ok, rn, 0).to(tl.int64)
    rm = tl.arange(0, BM)
    m_ok = rm < M
    rm_c = tl.where(m_ok, rm, 0).to(tl.int64)
    kb = tl.arange(0, BK // 16)
    kj = tl.arange(0, 8)
    k_lo = pid_k * chunks_per_split * BK
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    wp_rows = wp_ptr + rn_c[:, None, None] * (K // 2) + (kb * 8)[None, :, None] + kj[None, None, :]
    ws_rows = ws_ptr + rn_c[:, None] * (K // 16) + kb[None, :]
    x_rows = x_ptr + rm_c[:, None, None] * stride_xm + (kb * 16)[None, :, None] + (2 * kj)[None, None, :]
    for i in range(0, chunks_per_split):
        k = k_lo + i * BK
        if MASK_K:
            kmask = (k + kb * 16) < K
            p = tl.load(wp_rows + k // 2, mask=kmask[None, :, None], other=0)
            s = tl.load(ws_rows + k // 16, mask=kmask[None, :], other=0)
            xe = tl.load(x_rows + k, mask=kmask[None, :, None], other=0.0)
            xo = tl.load(x_rows + k + 1, mask=kmask[None, :, None], other=0.0)
        else:
            p = tl.load(wp_rows + k // 2)
            s = tl.load(ws_rows + k // 16)
            xe = tl.load(x_rows + k)
            xo = tl.load(x_rows + k + 1)
        pi = p.to(tl.int32)
        lo = e2m1_raw(pi & 15)
        hi = e2m1_raw(pi >> 4)
        part = tl.sum(lo[None, :, :, :] * xe.to(tl.float32)[:, None, :, :]
                      + hi[None, :, :, :] * xo.to(tl.float32)[:, None, :, :], axis=3)
        sf = e4m3_to_f32(s.to(tl.int32)) * 16384.0
        acc += tl.sum(part * sf[None, :, :], axis=2)
    acc = acc * (1.0 / tl.load(recip_ptr))
    ymask = m_ok[:, None] & n_ok[None, :]
    yp = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    if ATOMIC:
        tl.atomic_add(yp, acc, mask=ymask, sem="relaxed")
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=ymask)

@triton.jit
def _words_x_rowscale(x_cols, m_ok, k_lo, k_hi, K, BM: tl.constexpr, BK: tl.constexpr):
    """Per-row power-of-two factors (scale, 1/scale) that bring x's row max to [2^14, 2^15): fp16-safe x."""
    kk = tl.arange(0, BK)
    amax = tl.zeros((BM,), dtype=tl.float32)
    for k in range(k_lo, k_hi, BK):
        xt = tl.load(x_cols + (k + kk)[:, None], mask=(k + kk < K)[:, None], other=0.0)  # clamped rows: row 0
        amax = tl.maximum(amax, tl.max(tl.abs(xt.to(tl.float32)), axis=0))
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 255
    e = tl.minimum(tl.maximum(e, 15), 254)
    sc = ((268 - e) << 23).to(tl.float32, bitcast=True)  # 2^(14 - E)
    inv = ((e - 14) << 23).to(tl.float32, bitcast=True)  # 2^(E - 14)
    return sc, inv

@triton.jit
def _words_step(acc, q, s, x_cols, xsc, k, K, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
              MASK_K: tl.constexpr, X_F16: tl.constexpr, F32_DOT: tl.constexpr):
    """acc[BN, BM] += W-tile @ x^T-tile for one K tile. q: int32 words [BN, BK/8] (8 codes each, code j of
    word w is k = 8w + j), s: scale bytes [BN, BK/8], one per word (word w's block w // 2: each scale byte is
    loaded twice, see _words_kernel). The dot runs as 8 dots over the word axis, one per code position j, so no
    nibble is ever moved across lanes; x is read with the matching stride 8."""
    # E4M3 byte << 7 as fp16 bits = scale * 2^-8 (exact, subnormals included); * 256 restores it.
    s2 = ((s.to(tl.int32) & 0x7F) << 7).to(tl.int16).to(tl.float16, bitcast=True) * 256.0
    kw = tl.arange(0, BK // 8)
    xk = k + 8 * kw
    for j in tl.static_range(4):
        # codes j and j+4 of each word as two fp16 bit patterns (lo/hi half): e2m1 * 2^-14, exact
        if j < 3:
            pr = ((q << (9 - 4 * j)) & 0x0E000E00) | ((q << (12 - 4 * j)) & (-2147450880))  # 0x80008000
        else:
            pr = ((q >> 3) & 0x0E000E00) | (q & (-2147450880))
        wlo = pr.to(tl.int16).to(tl.float16, bitcast=True) * s2
        whi = (pr >> 16).to(tl.int16).to(tl.float16, bitcast=True) * s2
        if MASK_K:
            xm = (xk < K)[:, None]
            xlo = tl.load(x_cols + (xk + j)[:, None], mask=xm, other=0.0)
            xhi = tl.load(x_cols + (xk + j + 4)[:, None], mask=xm, other=0.0)
        else:
            xlo = tl.load(x_cols + (xk + j)[:, None])
            xhi = tl.load(x_cols + (xk + j + 4)[:, None])
        if X_F16:
            xlo = xlo.to(tl.float16)
            xhi = xhi.to(tl.float16)
        else:
            xlo = (xlo.to(tl.float32) * xsc[None, :]).to(tl.float16)
            xhi = (xhi.to(tl.float32) * xsc[None, :]).to(tl.float16)
        if F32_DOT:
            acc = tl.dot(wlo.to(tl.float32), xlo.to(tl.float32), acc)
            acc = tl.dot(whi.to(tl.float32), xhi.to(tl.float32), acc)
        else:
            acc = tl.dot(wlo, xlo, acc)
            acc = tl.dot(whi, xhi, acc)
    return acc

@triton.jit
def _words_load(wq_rows, ws_rows, k, kw, ks, K, MASK_K: tl.constexpr):
    """The K tile at k of the weight words [BN, BK/8] (int32, 8 codes each) and their scale bytes (one per word)."""
    if MASK_K:
        q = tl.load(wq_rows + (k // 8 + kw)[None, :], mask=(k // 8 + kw < K // 8)[None, :], other=0)
        s = tl.load(ws_rows + (k // 16 + ks)[None, :], mask=(k // 16 + ks < K // 16)[None, :], other=0)
    else:
        q = tl.load(wq_rows + (k // 8 + kw)[None, :])
        s = tl.load(ws_rows + (k // 16 + ks)[None, :])
    return q, s


@triton.jit
def _words_kernel(x_ptr, wq_ptr, ws_ptr, recip_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_ym, chunks_per_split,
                BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr,
                PARTIAL: tl.constexpr, MASK_K: tl.constexpr, X_F16: tl.constexpr, PREFETCH: tl.constexpr,
                F32_DOT: tl.constexpr):
    """Decode-path W4A16 (swap-AB, fp16 tensor cores): y^T tile = dequant(W)[BN, K-slice] @ x^T[K-slice, BM].

    Weights are read as int32 words (8 codes, 16-byte vector loads) and decoded with ~2 integer ops per
    code: the code's bits placed in an fp16 (= e2m1 * 2^-14) times the E4M3 scale as fp16 is exact
    (a multiple of 2^-24, at most 2688 * 2^-14). x is scaled per row by a power of two into fp16 range.
    PREFETCH keeps the next K tile's weight loads in flight while this one is decoded.
    PARTIAL writes fp32 partial sums to y_ptr[pid_k, M, N] (split-K; a second kernel reduces them)."""
    pid_k, rn, rm, n_ok, m_ok, rn_c, rm_c = _swap_ab_tile(M, N, BN, BM)
    k_lo = pid_k * chunks_per_split * BK
    kw = tl.arange(0, BK // 8)
    # one scale byte per weight word (word w of a tile uses block w // 2), so the per-word scale tile has the
    # words' shape with no in-register widening: widening a [BN, BK/16] tile with tl.reshape(tl.join(sh, sh))
    # miscompiles on the H100 (Triton 3.6) at BN=32, where layout propagation moves the dot-operand layout
    # (kWidth=8) back through the reshape/join (every output wrong) unless the tile is a loop-carried value.
    ks = tl.arange(0, BK // 8) // 2
    wq_rows = wq_ptr + rn_c[:, None] * (K // 8)
    ws_rows = ws_ptr + rn_c[:, None] * (K // 16)
    x_cols = x_ptr + rm_c[None, :] * stride_xm
    if X_F16:
        xsc = tl.full((BM,), 1.0, tl.float32)
        xinv = xsc
    else:
        xsc, xinv = _words_x_rowscale(x_cols, m_ok, k_lo, k_lo + chunks_per_split * BK, K, BM, BK)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    if PREFETCH:
        q, s = _words_load(wq_rows, ws_rows, k_lo, kw, ks, K, MASK_K)
        for i in range(0, chunks_per_split - 1):
            k = k_lo + i * BK
            qn, sn = _words_load(wq_rows, ws_rows, k + BK, kw, ks, K, MASK_K)
            acc = _words_step(acc, q, s, x_cols, xsc, k, K, BN, BM, BK, MASK_K, X_F16, F32_DOT)
            q = qn
            s = sn
        acc = _words_step(acc, q, s, x_cols, xsc, k_lo + (chunks_per_split - 1) * BK, K, BN, BM, BK, MASK_K,
                          X_F16, F32_DOT)
    else:
        for i in range(0, chunks_per_split):
            k = k_lo + i * BK
            q, s = _words_load(wq_rows, ws_rows, k, kw, ks, K, MASK_K)
            acc = _words_step(acc, q, s, x_cols, xsc, k, K, BN, BM, BK, MASK_K, X_F16, F32_DOT)
    acc = acc * xinv[None, :] * (16384.0 / tl.load(recip_ptr))
    ymask = n_ok[:, None] & m_ok[None, :]
    if PARTIAL:
        tl.store(y_ptr + (pid_k * M + rm[None, :]).to(tl.int64) * N + rn[:, None], acc, mask=ymask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + rm[None, :].to(tl.int64) * stride_ym + rn[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=ymask)

@triton.jit
def _splitk_sum(p_ptr, b_ptr, y_ptr, M, N, SPLIT, stride_ym, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's BLOCK elements of y[M, N] = sum_s partial[s, M, N] (+ bias), summed in split order, cast to
    y's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, SPLIT):
        acc += tl.load(p_ptr + s * M * N + offs, mask=ok, other=0.0)
    n = offs % N
    m = offs // N
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _splitk_reduce_kernel(p_ptr, b_ptr, y_ptr, M, N, SPLIT, stride_ym, HAS_BIAS: tl.constexpr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """y[M, N] = sum_s partial[s, M, N] (+ bias), cast to y's dtype."""
    pdl_enter(PDL)
    _splitk_sum(p_ptr, b_ptr, y_ptr, M, N, SPLIT, stride_ym, HAS_BIAS, BLOCK)


@triton.jit
def _splitk_reduce_group_kernel(p_ptr, b0, b1, b2, y0, y1, y2, M, N0, N1, N2, SPLIT, HAS_BIAS: tl.constexpr,
                                BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """_splitk_reduce_kernel for a grouped launch (program axis 1 = member g): p holds the members' partials
    [split, M, N_g] one after another; y_g [M, N_g] contiguous."""
    pdl_enter(PDL)
    g = tl.program_id(1)
    if g == 0:
        _splitk_sum(p_ptr, b0, y0, M, N0, SPLIT, N0, HAS_BIAS, BLOCK)
    elif g == 1:
        _splitk_sum(p_ptr + N0.to(tl.int64) * SPLIT * M, b1, y1, M, N1, SPLIT, N1, HAS_BIAS, BLOCK)
    else:
        _splitk_sum(p_ptr + (N0 + N1).to(tl.int64) * SPLIT * M, b2, y2, M, N2, SPLIT, N2, HAS_BIAS, BLOCK)

