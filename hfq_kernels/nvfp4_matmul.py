"""NVFP4 W4A16 matmul: Triton kernels, their launchers, and the per-shape choice between them.

y = x @ dequant(W)^T (+ bias) and grad_x = g @ dequant(W), weights in the canonical compressed-tensors layout.
The tensor-core kernels are "swap-AB": y^T tiles = dequant(W)[BN, BK] @ x^T[BK, BM], so the weight tile
(dequantised in registers) is the MMA's A operand and the token dimension is the small MMA N dimension. The
weight tile is E2M1 * E4M3-scale, exact in bf16/fp16 (<= 6 significant bits, |v| <= 2688), and 1/global_recip is
applied to the fp32 accumulator. Decode (M <= 64) splits K so that every SM streams weights.

Config kinds (the "kind" of a config dict and of the shipped tuned table `nvfp4_linear_tuned.json`): see KINDS.
grad_input is always dequantize + cuBLAS: a transposed-read Triton kernel was 4-10x slower on every benchmark
shape (benchmarks/results/nvfp4_matmul_sweep.json, "grad"), so it is not shipped.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hfq_kernels import lora as _lora
from hfq_kernels import nvfp4_gluon as gluon
from hfq_kernels._autotune import Tuner
from hfq_kernels._autotune import _capturing as _autotune_capturing
from hfq_kernels._triton import (INTERPRET, LRU, BoundLaunch, cdiv, e2m1_raw, e2m1_to_f32, e4m3_to_f32, pdl_bound,
                                 pdl_enter, sm_count, tl, triton)
from hfq_kernels.nvfp4_quant import _dequantize_kernel, check_packed, dequant_raw

KINDS = {
    "dequant": "dequantize W to x's dtype, then cuBLAS (prefill / training, M > 64)",
    "tile": "Triton swap-AB tensor-core tile kernel, nibbles decoded by an inline-PTX lookup (fp32 atomics split-K)",
    "gemv": "Triton CUDA-core GEMV for M <= 4, no shared memory",
    "words": "Triton decode kernel: int32 words of 8 codes, fp16 tensor-core dots, split-K partials + reduce",
    "gluon": "Gluon decode kernel on the g4 layout (bf16 x, M <= 64; canonical callers get a cached g4 copy), "
             "split-K partials + reduce",
}
MM_DTYPES = (torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------------------------- kernels
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


# ----------------------------------------------------------------------------------------------- configs
def default_config(m: int, n: int, k: int, sms: int) -> dict:
    """Heuristic config used when no tuned choice exists (and during graph capture / compile)."""
    return words_default(m, n, k, sms) if m <= 64 else dict(kind="dequant")


def words_default(m: int, n: int, k: int, sms: int) -> dict:
    """Heuristic "words" config: BN=128 rows, BK=256, split-K until ~2 programs per SM."""
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    return dict(kind="words", BN=128, BM=bm, BK=256, split=_split_for(cdiv(n, 128) * cdiv(m, bm), cdiv(k, 256),
                                                                        2 * sms), warps=4, stages=1, prefetch=True)


def _split_for(tiles: int, chunks: int, programs: int, cap: int | None = None) -> int:
    """Smallest power-of-two split-K (<= chunks, <= cap) that gives at least `programs` programs."""
    split = 1
    while tiles * split < programs and split * 2 <= chunks and (cap is None or split < cap):
        split *= 2
    return split


def _words_candidates(m: int, n: int, k: int, sms: int) -> list[dict]:
    """"words" configs: tile shapes x split-K around the one that gives ~2 programs per SM."""
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    c = []
    for bn, bk, warps, pre in ((128, 256, 4, True), (64, 256, 4, True), (128, 512, 8, True), (256, 256, 8, True),
                               (128, 256, 8, True), (128, 256, 4, False)):
        chunks = cdiv(k, bk)
        base = _split_for(cdiv(n, bn) * cdiv(m, bm), chunks, 2 * sms)
        for split in sorted({max(1, base // 2), base, min(chunks, base * 2)}):
            c.append(dict(kind="words", BN=bn, BM=bm, BK=bk, split=split, warps=warps, stages=1, prefetch=pre))
    return c


def _split_range(n: int, bn: int, k: int, bk: int, splits, lo: int, hi: int):
    """The splits (of `splits`) that keep <= K chunks and, when > 1, lo..hi programs."""
    tiles, chunks = cdiv(n, bn), cdiv(k, bk)
    return [s for s in splits if s <= chunks and (s == 1 or lo <= tiles * s <= hi)]


def candidates(m: int, n: int, k: int, sms: int) -> list[dict]:
    """Every config the tuner times for this shape."""
    c = _words_candidates(m, n, k, sms) if m <= 64 else []
    if m <= 4:
        bm = 1 if m == 1 else (2 if m == 2 else 4)
        for bn, bk, warps, stages in ((16, 256, 4, 3), (32, 256, 4, 3), (16, 512, 4, 2), (8, 512, 4, 3)):
            for split in _split_range(n, bn, k, bk, (1, 2, 4, 8), sms, 16 * sms):
                c.append(dict(kind="gemv", BN=bn, BM=bm, BK=bk, split=split, warps=warps, stages=stages))
    if m <= 16:
        for bn, bk, warps, stages in ((64, 256, 4, 4), (64, 512, 4, 3)):
            for split in _split_range(n, bn, k, bk, (1, 2, 4, 8, 16), sms, 8 * sms):
                c.append(dict(kind="tile", BN=bn, BM=16, BK=bk, split=split, warps=warps, stages=stages, asm=True))
    elif m <= 64:
        for bn, bm, bk, warps, stages in ((64, 32, 128, 4, 4), (64, 64, 128, 4, 4), (128, 64, 128, 8, 3),
                                          (128, 32, 256, 4, 3)):
            if bm < m / 2:
                continue
            for split in (1, 2, 4):
                c.append(dict(kind="tile", BN=bn, BM=bm, BK=bk, split=split, warps=warps, stages=stages, asm=True))
    else:  # measured on H100: dequantize + cuBLAS beats the fused Triton tile for M >= 128 (see benchmarks)
        c.append(dict(kind="dequant"))
        c.append(dict(kind="tile", BN=64, BM=128, BK=64, split=1, warps=4, stages=4, asm=True))
    return c


LINEAR_TUNER = Tuner("nvfp4_linear")


def gluon_config(m: int, n: int, k: int, device) -> dict:
    """The "gluon" config linear() uses for bf16 x with M <= 64: a tuned "gluon" entry, else the default."""
    dev = torch.device(device)
    for mm in ((m, 8) if m <= 8 else (m,)):  # M <= 8 share the BM=8 kernel: fall back to the M=8 entry
        hit = LINEAR_TUNER.cache.get(Tuner.key(mm, n, k, torch.bfloat16, dev))
        if hit is not None and hit.get("kind") == "gluon":
            return dict(hit)
    return gluon.default_config(m, n, k, sm_count(dev))


# ----------------------------------------------------------------------------------------------- launchers
_ASM_FAILED: dict = {}  # constexpr-config -> error, for configs whose inline-PTX decode failed to build


def _use_asm(device: torch.device) -> bool:
    return (not INTERPRET and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0))


def _launch(kernel, grid, use_asm: bool, *args, **kw):
    """Launch; if this config's inline-PTX variant fails to build, remember it and use the plain decode."""
    key = (kernel.fn.__name__, tuple(sorted((k, v) for k, v in kw.items() if isinstance(v, (int, bool)))))
    if use_asm and key in _ASM_FAILED:
        use_asm = False
    try:
        kernel[grid](*args, USE_ASM=use_asm, **kw)
    except Exception as e:
        if not use_asm:
            raise
        _ASM_FAILED[key] = f"{type(e).__name__}: {str(e)[-1500:]}"
        kernel[grid](*args, USE_ASM=False, **kw)


def _splits(chunks: int, want: int) -> tuple[int, int]:
    """(split, chunks per split) for a requested split-K over `chunks` K tiles, with no empty split."""
    split = max(1, min(want, chunks))
    cps = cdiv(chunks, split)
    return cdiv(chunks, cps), cps


def _with_partials(x2, n, bias, recip, split, out, run):
    """run(dst, y) writes y directly (split 1) or fp32 partials [split, M, N] into dst, reduced here into y."""
    m = x2.shape[0]
    y = out if out is not None else torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    if split == 1:
        run(y, y)
        return y
    dst = torch.empty((split, m, n), dtype=torch.float32, device=x2.device)
    run(dst, y)
    blk = 1024
    _splitk_reduce_kernel[(cdiv(m * n, blk),)](dst, bias if bias is not None else recip, y, m, n, split,
                                               y.stride(0), HAS_BIAS=bias is not None, BLOCK=blk, num_warps=4)
    return y


def _words_launch(x2, packed, scale, recip, bias, cfg, out=None):
    """"words" kernel; split > 1 writes fp32 partials and reduces them in a second launch."""
    m, k = x2.shape
    n = packed.shape[0]
    bn, bm, bk = cfg["BN"], cfg["BM"], cfg["BK"]
    if bk < 128 or bm < 16 or bn < 32:
        raise ValueError(f"nvfp4 words kernel config: BK={bk}, BM={bm}, BN={bn}; need BK >= 128 (8 dots of "
                         f"K = BK/8 >= 16), BM >= 16 and BN >= 32 (BN = 16 gave wrong products on the H100)")
    chunks = cdiv(k, bk)
    split, cps = _splits(chunks, cfg.get("split", 1))
    wq = (packed if packed.is_contiguous() else packed.contiguous()).view(torch.int32)

    def run(dst, y):
        _words_kernel[(cdiv(n, bn), cdiv(m, bm), split)](
            x2, wq, scale.view(torch.uint8), recip, bias if bias is not None else recip, dst,
            m, n, k, x2.stride(0), y.stride(0), cps, BN=bn, BM=bm, BK=bk,
            HAS_BIAS=bias is not None and split == 1, PARTIAL=split > 1,
            MASK_K=(k % bk) != 0 or (chunks % split) != 0, X_F16=x2.dtype == torch.float16,
            PREFETCH=bool(cfg.get("prefetch", True)), F32_DOT=INTERPRET,
            num_warps=cfg.get("warps", 4), num_stages=cfg.get("stages", 1))

    return _with_partials(x2, n, bias, recip, split, out, run)


def _gluon_launch(x2, packed, scale, recip, bias, cfg, out=None):
    """"gluon" kernel on the cached repacked weight; None when that copy cannot be built now (graph capture)."""
    rep = gluon.repacked(packed, scale)
    if rep is None:
        return None
    return _gluon_on(x2, *rep, packed.shape[0], recip, bias, cfg, out)


def _gluon_on(x2, wr, sr, n, recip, bias, cfg, out=None):
    """"gluon" kernel on g4 tensors (wr, sr) of an [n, K] weight, with cfg's split-K."""
    split, cps = _splits(cdiv(x2.shape[1], 64), cfg.get("split", 1))
    return _with_partials(x2, n, bias, recip, split, out,
                          lambda dst, y: gluon.launch(x2, wr, sr, recip, bias, dst, y.stride(0), n, cfg, split, cps))


def _atomic_launch(x2, packed, scale, recip, bias, cfg, out=None):
    """"tile" and "gemv" kernels: split > 1 accumulates into an fp32 buffer with atomics."""
    m, k = x2.shape
    n = packed.shape[0]
    bn, bm, bk = cfg["BN"], cfg["BM"], cfg["BK"]
    chunks = cdiv(k, bk)
    split, cps = _splits(chunks, cfg.get("split", 1))
    atomic = split > 1
    if atomic:
        y = torch.zeros((m, n), dtype=torch.float32, device=x2.device)
    else:
        y = out if out is not None else torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    meta = dict(BN=bn, BM=bm, BK=bk, HAS_BIAS=bias is not None and not atomic, ATOMIC=atomic,
                MASK_K=(k % bk) != 0 or (chunks % split) != 0, num_warps=cfg.get("warps", 4),
                num_stages=cfg.get("stages", 3))
    args = (x2, packed, scale.view(torch.uint8), recip, bias if bias is not None else recip, y,
            m, n, k, x2.stride(0), y.stride(0), cps)
    if cfg["kind"] == "gemv":
        _gemv_kernel[(cdiv(n, bn), split)](*args, **meta)
    else:
        _launch(_mm_kernel, (cdiv(n, bn), cdiv(m, bm), split), bool(cfg.get("asm", True)) and _use_asm(x2.device),
                *args, F32_DOT=INTERPRET, **meta)
    if atomic:
        if bias is not None:
            y += bias.float()
        if out is not None:
            out.copy_(y)
            return out
        return y.to(x2.dtype)
    return y


def mm_launch(x2, packed, scale, recip, bias, cfg, out=None):
    """y[M, N] = x2 @ dequant(W)^T (+ bias) with the Triton kernel of cfg["kind"] (not "dequant")."""
    kind = cfg["kind"]
    if kind == "gluon":
        y = _gluon_launch(x2, packed, scale, recip, bias, cfg, out=out) if gluon.supported(x2) else None
        if y is not None:
            return y
        cfg, kind = words_default(x2.shape[0], packed.shape[0], x2.shape[1], sm_count(x2.device)), "words"
    if kind == "words":
        return _words_launch(x2, packed, scale, recip, bias, cfg, out=out)
    if kind in ("tile", "gemv"):
        return _atomic_launch(x2, packed, scale, recip, bias, cfg, out=out)
    raise ValueError(f"nvfp4_linear config: unknown kind {kind!r}; kinds: {sorted(KINDS)}")


# ----------------------------------------------------------------------------------------------- linear, grad_input
def check_bias(bias, n):
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"nvfp4_linear: bias must have shape ({n},), got {tuple(bias.shape)}")


def checked_runner(x2, packed, scale, recip, bias, tol: float = 2e-2):
    """Autotuning runner that first checks a candidate's product against dequantize + F.linear (fp32) and
    raises for a wrong one, so the tuner can never pick a config that miscomputes on this device/shape."""
    ref = {}

    def runner(c):
        if "y" not in ref:
            w = dequant_raw(packed, scale, recip, torch.float32)
            ref["y"] = F.linear(x2.float(), w, None if bias is None else bias.float())
        y = linear(x2, packed, scale, recip, bias, config=c).float()
        err = float((y - ref["y"]).norm() / ref["y"].norm().clamp_min(1e-30))
        if not err <= tol:
            raise ValueError(f"nvfp4 linear config {c}: relative error {err:.3g} > {tol} on this shape")
        return lambda: linear(x2, packed, scale, recip, bias, config=c)

    return runner


def linear(x, packed, scale, global_scale, bias=None, config: dict | None = None, out=None):
    """y = x @ dequant(W)^T + bias on the GPU (Triton); `config` forces a kernel config (tests, sweeps)."""
    check_packed(packed, scale, global_scale)
    check_bias(bias, packed.shape[0])
    return linear_impl(x, packed, scale, global_scale, bias, config, out)


def _pick(x2, packed, scale, recip, bias, m, n, k):
    """The config for this call: gluon for bf16 decode, else the tuned choice, else tune now (or the default)."""
    if gluon.supported(x2):
        return gluon_config(m, n, k, x2.device)
    config = LINEAR_TUNER.cached(m, n, k, x2.dtype, x2.device)
    if config is None:
        key = Tuner.key(m, n, k, x2.dtype, x2.device)
        config = LINEAR_TUNER.choose(key, candidates(m, n, k, sm_count(x2.device)),
                                     checked_runner(x2, packed, scale, recip, bias),
                                     default_config(m, n, k, sm_count(x2.device)))
    return config


def linear_impl(x, packed, scale, global_scale, bias=None, config: dict | None = None, out=None):
    """linear() for a validated weight (x's width is still checked). Large M with a cached "dequant" choice (the
    training/prefill case) takes the shortest route: no reshapes, no key formatting, one dequantize + cuBLAS."""
    n, k = packed.shape[0], packed.shape[1] * 2
    if x.shape[-1] != k:
        raise ValueError(f"nvfp4_linear: x has in_features={x.shape[-1]} but the weight has {k}")
    recip = global_scale if global_scale.dtype == torch.float32 else global_scale.float()
    m = x.numel() // k
    if m == 0 or x.dtype not in MM_DTYPES:
        return F.linear(x, dequant_raw(packed, scale, recip, x.dtype), bias)
    if config is None and m > 64:
        config = LINEAR_TUNER.cached(m, n, k, x.dtype, x.device)
        if config is not None and config["kind"] == "dequant" and out is None:
            return F.linear(x, dequant_raw(packed, scale, recip, x.dtype), bias)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if config is None:
        config = _pick(x2, packed, scale, recip, bias, m, n, k)
    if config["kind"] == "dequant":
        y = F.linear(x2, dequant_raw(packed, scale, recip, x.dtype), bias)
        if out is not None:
            out.copy_(y)
            y = out
    else:
        y = mm_launch(x2, packed, scale, recip, bias, config, out=out)
    return y.reshape(*x.shape[:-1], n)


def grad_input(g, packed, scale, global_scale, out=None):
    """grad_x = g @ dequant(W): dequantize to g's dtype (Triton on CUDA), then cuBLAS."""
    check_packed(packed, scale, global_scale)
    return grad_input_impl(g, packed, scale, global_scale, out)


def grad_input_impl(g, packed, scale, global_scale, out=None):
    """grad_input() for a validated weight (g's width is still checked)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    if g.shape[-1] != n:
        raise ValueError(f"nvfp4_linear_grad_input: grad has {g.shape[-1]} features but the weight has {n} rows")
    recip = global_scale if global_scale.dtype == torch.float32 else global_scale.float()
    w = dequant_raw(packed, scale, recip, g.dtype)
    if out is None:
        return g @ w
    out.copy_(g.reshape(-1, n) @ w)
    return out.reshape(*g.shape[:-1], k)


# ----------------------------------------------------------------------------------------------- per-shape plans
class LinearPlan:
    """What linear_impl() and grad_input_impl() decide for one weight and one input (shape, dtype, device),
    decided once: validation, the config (gluon default / tuned table / autotuning), split-K, grids and kernel
    meta-parameters, the output shape. `forward(x, bias)` and `grad(g)` then do only the per-call work: views,
    output allocation, the launches. `final` is False for a config picked while nothing may be tuned (graph
    capture): such a plan serves its call and is not kept. `gen` is LINEAR_TUNER.gen when it was made (a plan is
    stale once the tuned table changes). Callers keep plans per weight (NVFP4Linear keys them by x's shape,
    dtype and device) and rebuild them when the weight tensors are replaced."""

    __slots__ = ("forward", "grad", "final", "gen", "config", "dequant")

    def __init__(self, forward, grad, final: bool, gen: int, config, dequant=None):
        self.forward, self.grad, self.final, self.gen, self.config = forward, grad, final, gen, config
        self.dequant = dequant  # dtype -> the dense weight, for plans whose forward is dequantize + cuBLAS


def _pick_final(x2, packed, scale, recip, bias, m, n, k) -> tuple[dict, bool]:
    """_pick() plus whether its answer may be kept: gluon defaults and tuned (stored) choices may; a heuristic
    default returned while tuning is impossible (graph capture / compile) may not."""
    config = _pick(x2, packed, scale, recip, bias, m, n, k)
    if config.get("kind") == "gluon" or not _autotune_capturing():
        return config, True
    return config, LINEAR_TUNER.cache.get(Tuner.key(m, n, k, x2.dtype, x2.device)) is config


class _PlanCtx:
    """What a plan's launch closures read: the call's geometry and the weight's tensors."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def recip(self):
        return self.rf if self.rf is not None else self.global_scale.float()


def _finish(c: _PlanCtx, dst_split: int, launch):
    """forward(x, b, aux) around launch(x2, b, dst, y, aux): y [M, N] written directly (split 1) or via fp32
    partials [split, M, N] and the reduce kernel."""
    m, n, k = c.m, c.n, c.k
    rgrid = (cdiv(m * n, 1024),)
    reduce = {hb: pdl_bound(_splitk_reduce_kernel, rgrid, dict(HAS_BIAS=hb, BLOCK=1024, num_warps=4))
              for hb in (False, True)}

    def fwd(x, b, aux=None):
        x2 = x.reshape(m, k)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = torch.empty((m, n), dtype=c.dt, device=c.dev)
        if dst_split == 1:
            launch(x2, b, y, y, aux)
        else:
            dst = torch.empty((dst_split, m, n), dtype=torch.float32, device=c.dev)
            launch(x2, b, dst, y, aux)
            reduce[b is not None].pick(c.dev)(dst, b if b is not None else c.recip(), y, m, n, dst_split, n)
        return y.view(c.out_shape)

    return fwd


def _words(c: _PlanCtx, cfg: dict):
    """The planned forward of the words kernel for config `cfg`."""
    m, n, k = c.m, c.n, c.k
    bn, bm, bk = cfg["BN"], cfg["BM"], cfg["BK"]
    if bk < 128 or bm < 16 or bn < 32:  # _words_launch's check
        raise ValueError(f"nvfp4 words kernel config: BK={bk}, BM={bm}, BN={bn}; need BK >= 128 (8 dots of "
                         f"K = BK/8 >= 16), BM >= 16 and BN >= 32 (BN = 16 gave wrong products on the H100)")
    chunks = cdiv(k, bk)
    split, cps = _splits(chunks, cfg.get("split", 1))
    wq = (c.packed if c.packed.is_contiguous() else c.packed.contiguous()).view(torch.int32)
    grid = (cdiv(n, bn), cdiv(m, bm), split)
    meta = dict(BN=bn, BM=bm, BK=bk, HAS_BIAS=c.has_bias and split == 1, PARTIAL=split > 1,
                MASK_K=(k % bk) != 0 or (chunks % split) != 0, X_F16=c.dt == torch.float16,
                PREFETCH=bool(cfg.get("prefetch", True)), F32_DOT=INTERPRET,
                num_warps=cfg.get("warps", 4), num_stages=cfg.get("stages", 1))

    def launch(x2, b, dst, y, aux):
        recip = c.recip()
        _words_kernel[grid](x2, wq, c.su8, recip, b if b is not None else recip, dst, m, n, k, x2.stride(0), n,
                            cps, **meta)

    return _finish(c, split, launch)


def _kind_forward(c: _PlanCtx, kind: str, config: dict, x):
    """The planned forward for a chosen non-dequant kernel kind."""
    m, n, k = c.m, c.n, c.k
    if kind == "words":
        return _words(c, config)
    if kind == "gluon" and gluon.supported(x.reshape(-1, k)):
        split, cps = _splits(cdiv(k, 64), config.get("split", 1))
        run = gluon.launcher(m, n, k, config, split, cps, c.has_bias)
        g4 = _finish(c, split, lambda x2, b, dst, y, rep: run(x2, rep[0], rep[1], c.recip(), b, dst, n))
        fallback = _words(c, words_default(m, n, k, sm_count(c.dev)))  # while the repacked copy cannot be built

        def fwd(x, b):
            rep = gluon.repacked(c.packed, c.scale)  # cached per tensor and version (rebuilt after in-place updates)
            return g4(x, b, rep) if rep is not None else fallback(x, b)
        return fwd
    if kind in ("tile", "gemv", "gluon"):  # less used kinds: the generic launcher, selection already done
        def fwd(x, b):
            x2 = x.reshape(m, k)
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            return mm_launch(x2, c.packed, c.scale, c.recip(), b, config).view(c.out_shape)
        return fwd
    raise ValueError(f"nvfp4_linear config: unknown kind {kind!r}; kinds: {sorted(KINDS)}")


def plan_linear(x, packed, scale, global_scale, bias=None) -> LinearPlan:
    """The LinearPlan of y = x @ dequant(W)^T + bias for x's shape/dtype/device (raises for bad inputs, with
    linear()'s messages). Its forward gives linear()'s values; its grad gives grad_input()'s."""
    check_packed(packed, scale, global_scale)
    n, k = packed.shape[0], packed.shape[1] * 2
    check_bias(bias, n)
    if x.shape[-1] != k:
        raise ValueError(f"nvfp4_linear: x has in_features={x.shape[-1]} but the weight has {k}")
    x = x.detach()  # only looked at (and, for a first call that tunes, run); never kept
    dt, dev = x.dtype, x.device
    has_bias = bias is not None
    rf = global_scale if global_scale.dtype == torch.float32 else None  # else converted per call (stays current)
    su8 = scale.view(torch.uint8)
    dgrid = (cdiv(n, 16), cdiv(k, 256))

    def dequant(dtype):
        recip = rf if rf is not None else global_scale.float()
        w = torch.empty((n, k), dtype=dtype, device=dev)
        _dequantize_kernel[dgrid](packed, su8, recip, w, n, k, BR=16, BC=256, num_warps=4)
        return w

    def grad(g):
        return g @ dequant(g.dtype)

    def dense(x, b):
        return F.linear(x, dequant(x.dtype), b)

    m = x.numel() // k
    if m == 0 or dt not in MM_DTYPES:
        return LinearPlan(dense, grad, True, LINEAR_TUNER.gen, None, dequant)
    config = LINEAR_TUNER.cached(m, n, k, dt, dev) if m > 64 else None
    final = True
    if config is None or config["kind"] != "dequant":
        x2 = x.reshape(-1, k)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        recip = rf if rf is not None else global_scale.float()
        config, final = _pick_final(x2, packed, scale, recip, None if bias is None else bias.detach(), m, n, k)
    gen = LINEAR_TUNER.gen  # after the choice (tuning a new shape stores its result)
    kind = config["kind"]
    if kind == "dequant":
        return LinearPlan(dense, grad, final, gen, config, dequant)
    c = _PlanCtx(m=m, n=n, k=k, dt=dt, dev=dev, rf=rf, global_scale=global_scale, packed=packed, scale=scale,
                 su8=su8, has_bias=has_bias, out_shape=(*x.shape[:-1], n))
    fwd = _kind_forward(c, kind, config, x)
    return LinearPlan(fwd, grad, final, gen, config)


# ----------------------------------------------------------------------------------------------- the g4 layout
# NVFP4Linear's storage on GPUs that run the Gluon kernel (hfq_kernels.nvfp4_gluon's module doc): decode
# (bf16, M <= 64) runs the Gluon kernel on it directly; every other product dequantizes it (Triton) and calls
# cuBLAS, so no canonical copy is needed on the device.
def _g4_recip(global_scale):
    return global_scale if global_scale.dtype == torch.float32 else global_scale.float()


def check_g4_call(x, wr, sr, global_scale, bias, n, k, what="nvfp4_g4_linear"):
    """Raise ValueError (naming the tensor and the allowed shape) unless x, the g4 tensors and bias fit together."""
    gluon.check_g4(wr, sr, n, k)
    if global_scale.numel() != 1:
        raise ValueError(f"{what}: weight_global_scale must have one element, got shape {tuple(global_scale.shape)}")
    check_bias(bias, n)
    if x.shape[-1] != k:
        raise ValueError(f"{what}: x has in_features={x.shape[-1]} but the weight has {k}")


def linear_g4(x, wr, sr, global_scale, n: int, k: int, bias=None):
    """y = x @ dequant(W)^T + bias for a weight in the g4 layout (CUDA)."""
    check_g4_call(x, wr, sr, global_scale, bias, n, k)
    recip = _g4_recip(global_scale)
    x2 = x.reshape(-1, k)
    if x2.shape[0] > 0 and gluon.supported(x2):
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        cfg = gluon_config(x2.shape[0], n, k, x2.device)
        return _gluon_on(x2, wr, sr, n, recip, bias, cfg).reshape(*x.shape[:-1], n)
    return F.linear(x, gluon.dequantize_g4(wr, sr, recip, n, k, x.dtype), bias)


def grad_input_g4(g, wr, sr, global_scale, n: int, k: int):
    """grad_x = g @ dequant(W) for a weight in the g4 layout: dequantize (Triton), then cuBLAS."""
    if g.shape[-1] != n:
        raise ValueError(f"nvfp4_g4_linear_grad_input: grad has {g.shape[-1]} features but the weight has {n} rows")
    return g @ gluon.dequantize_g4(wr, sr, global_scale, n, k, g.dtype)


_GROUP_PLANS = LRU(64)  # (M, widths, K, bias?, dtype, device) -> grouped forward (few shapes: a model's groups)


def group_g4_ok(x2: torch.Tensor, weights) -> bool:
    """Whether linear_group_g4 can take x2 [M, K] and weights [(wr, sr, global_scale, bias, n)]: 2-3 of them,
    the Gluon kernel's inputs (bf16, M <= 64, sm_80+), fp32 global scales, biases all None or all x2's dtype."""
    if not (2 <= len(weights) <= 3 and gluon.supported(x2) and x2.stride(-1) == 1):
        return False
    k = x2.shape[1]
    hb = {w[3] is not None for w in weights}
    return (len(hb) == 1 and all(w[2].dtype == torch.float32 and w[4] % 16 == 0 and w[4] > 0 for w in weights)
            and all(w[3] is None or (w[3].dtype == x2.dtype and w[3].is_contiguous()) for w in weights)
            and all(gluon.g4_numel(w[4], k) == (w[0].numel(), w[1].numel()) for w in weights))


def linear_group_g4(x2: torch.Tensor, weights, checked: bool = False) -> list:
    """[x2 @ W_g^T + b_g] for 2-3 g4 weights sharing x2 (q/k/v, gate/up of a decode step): one Gluon launch for
    all of them (and one split-K reduce), where separate calls take one (or two) each. weights: [(wr, sr,
    global_scale, bias, n)]; raises unless group_g4_ok (`checked`: the caller has asked it). The values are those
    of the per-weight kernel at the group's split-K (the split is chosen for the group's total width)."""
    if not checked and not group_g4_ok(x2, weights):
        raise ValueError(
            "nvfp4 grouped linear: needs 2-3 g4 weights (words, scales, fp32 global scale, bias, out_features: a "
            "multiple of 16) sharing a contiguous bf16 x [M <= 64, K] on an sm_80+ GPU, biases all None or all in "
            f"x's dtype; got x {tuple(x2.shape)} {x2.dtype} on {x2.device}, out_features "
            f"{[w[4] for w in weights]}, global scales {[w[2].dtype for w in weights]}")
    m, k = x2.shape
    ns = tuple(w[4] for w in weights)
    hb = weights[0][3] is not None
    key = (m, ns, k, hb, x2.dtype, x2.device)
    return _GROUP_PLANS.get_or(key, lambda: _group_plan(m, ns, k, hb, x2.dtype, x2.device))(x2, weights)


def _group_plan(m, ns, k, hb, dt, dev):
    cfg = gluon_config(m, sum(ns), k, dev)
    split, cps = _splits(cdiv(k, 64), cfg.get("split", 1))
    run = gluon.group_launcher(m, ns, k, cfg, split, cps, hb)
    g = len(ns)
    nmax, total = max(ns), sum(ns)
    offs = [0, ns[0], ns[0] + ns[1]][:g]
    reduce = pdl_bound(_splitk_reduce_group_kernel, (cdiv(m * nmax, 1024), g),
                       dict(HAS_BIAS=hb, BLOCK=1024, num_warps=4))
    n2 = ns[2] if g == 3 else ns[1]

    def fwd(x2, weights, sh=None, join=None):
        outs = [torch.empty((m, n), dtype=dt, device=dev) for n in ns]
        members = [(w[0], w[1], w[2], w[3]) for w in weights]
        if split == 1:
            run(x2, members, outs)
            return outs if sh is None else _expand_after(sh, outs, None, join)
        part = torch.empty(split * m * total, dtype=torch.float32, device=dev)
        dsts = [part[o * split * m:(o + n) * split * m] for o, n in zip(offs, ns)]
        run(x2, members, dsts)
        if sh is not None:  # the reduce done by the LoRA expand's launch
            return _expand_after(sh, outs, ([d.view(split, m, n) for d, n in zip(dsts, ns)], split,
                                            [w[3] for w in weights]), join)
        bs = [w[3] if w[3] is not None else w[2] for w in weights]
        ys = outs + outs[-1:] if g == 2 else outs
        bs = bs + bs[-1:] if g == 2 else bs
        reduce.pick(dev)(part, *bs, *ys, m, ns[0], ns[1], n2, split)
        return outs

    return fwd


def lora_g4_ok(x2: torch.Tensor, weights) -> bool:
    """Whether linear_lora_g4 can take x2 with these g4 weights: 2-3 as group_g4_ok; one weight: bf16 x2 [M <= 64,
    K] with contiguous rows on a GPU that runs the Gluon kernel, bias None or in x2's dtype, tensors of the layout."""
    if len(weights) != 1:
        return group_g4_ok(x2, weights)
    wr, sr, gs, bias, n = weights[0]
    return (x2.dim() == 2 and 1 <= x2.shape[0] <= 64 and x2.stride(-1) == 1 and gluon.supported(x2)
            and gs.numel() == 1 and (bias is None or (bias.dtype == x2.dtype and bias.shape == (n,)))
            and gluon.g4_numel(n, x2.shape[1]) == (wr.numel(), sr.numel()))


_LORA_PLANS = LRU(64)  # (M, N, K, bias?, dtype, device, tuner gen) -> (split, launcher) of a single g4 + LoRA


def linear_lora_g4(x2: torch.Tensor, weights, sh, join=None) -> list:
    """[x2 @ W_g^T + b_g + scale_g (x2 A_g^T) B_g^T] for 1-3 g4 weights sharing x2 [M <= 64, K] (weights as for
    linear_group_g4) whose LoRA shrink `sh` (hfq_kernels.lora.Shrink, one adapter per weight) has run: the base
    products as linear_g4 (one weight: the module's own plan) or linear_group_g4 (2-3) compute them, and their
    split-K reduce is done by the LoRA expand's launch, with the bits of reduce then expand. `join()`, if given,
    is called between the base launch and the expand (e.g. to wait for a shrink running on another stream)."""
    if len(weights) != sh.n:
        raise ValueError(f"nvfp4 g4 + LoRA: {len(weights)} weights but {sh.n} adapters in the shrink")
    m, k = x2.shape
    if len(weights) > 1:
        if not group_g4_ok(x2, weights):
            raise ValueError(f"nvfp4 g4 + LoRA: the grouped launch cannot take x {tuple(x2.shape)} {x2.dtype} on "
                             f"{x2.device} with out_features {[w[4] for w in weights]} (see linear_group_g4)")
        ns = tuple(w[4] for w in weights)
        key = (m, ns, k, weights[0][3] is not None, x2.dtype, x2.device)
        return _GROUP_PLANS.get_or(key, lambda: _group_plan(m, ns, k, key[3], x2.dtype, x2.device))(x2, weights, sh,
                                                                                                    join)
    wr, sr, gs, bias, n = weights[0]
    check_g4_call(x2, wr, sr, gs, bias, n, k, "nvfp4 g4 + LoRA")
    if not (m <= 64 and x2.stride(-1) == 1 and gluon.supported(x2)):
        raise ValueError(f"nvfp4 g4 + LoRA: needs a bf16 x [M in 1..64, {k}] with contiguous rows on an sm_80+ GPU, "
                         f"got {tuple(x2.shape)} {x2.dtype} on {x2.device}")

    def plan():
        cfg = gluon_config(m, n, k, x2.device)
        split, cps = _splits(cdiv(k, 64), cfg.get("split", 1))
        return split, gluon.launcher(m, n, k, cfg, split, cps, bias is not None)

    split, run = _LORA_PLANS.get_or((m, n, k, bias is not None, x2.dtype, x2.device, LINEAR_TUNER.gen), plan)
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    if split == 1:
        run(x2, wr, sr, _g4_recip(gs), bias, y, n)
        return _expand_after(sh, [y], None, join)
    p = torch.empty((split, m, n), dtype=torch.float32, device=x2.device)
    run(x2, wr, sr, _g4_recip(gs), bias, p, n)
    return _expand_after(sh, [y], ([p], split, [bias]), join)


def _expand_after(sh, outs, base, join):
    """The LoRA expand of a g4 + LoRA call (with the base's split-K reduce where `base` is given), after `join()`."""
    if join is not None:
        join()
    return _lora.expand_(sh, outs, base=base)


def plan_linear_g4(x, wr, sr, global_scale, bias, n: int, k: int) -> LinearPlan:
    """plan_linear() for a weight in the g4 layout: the Gluon kernel where gluon.supported(x), else dequantize_g4 +
    cuBLAS (config kind "dequant"); grad always dequantize_g4 + cuBLAS. Raises for bad inputs on the first call."""
    check_g4_call(x, wr, sr, global_scale, bias, n, k)
    rf = global_scale if global_scale.dtype == torch.float32 else None  # else converted per call (stays current)
    run_dequant = gluon.dequantizer(wr, sr, n, k)

    def dequant(dtype):
        return run_dequant(rf if rf is not None else global_scale.float(), dtype)

    def grad(g):
        return g @ dequant(g.dtype)

    def dense(x, b):
        return F.linear(x, dequant(x.dtype), b)

    x2 = x.detach().reshape(-1, k)
    m = x2.shape[0]
    if m == 0 or not gluon.supported(x2):
        return LinearPlan(dense, grad, True, LINEAR_TUNER.gen, {"kind": "dequant"}, dequant)
    config = gluon_config(m, n, k, x.device)
    split, cps = _splits(cdiv(k, 64), config.get("split", 1))
    run = gluon.launcher(m, n, k, config, split, cps, bias is not None)
    c = _PlanCtx(m=m, n=n, k=k, dt=x.dtype, dev=x.device, rf=rf, global_scale=global_scale,
                 has_bias=bias is not None, out_shape=(*x.shape[:-1], n))
    fwd = _finish(c, split, lambda x2, b, dst, y, aux: run(x2, wr, sr, c.recip(), b, dst, n))
    return LinearPlan(fwd, grad, True, LINEAR_TUNER.gen, config)
