"""NVFP4 ops: quantize, dequantize, W4A16 linear (+ its grad-input product). Registered with torch.library.

CPU runs the torch reference (hfq.formats.fp4); CUDA runs the Triton kernels below.
Interface (the layouts are the canonical compressed-tensors ones, read directly by the kernels):
  hfq::nvfp4_quantize(w[out,in]) -> (packed u8[out,in/2], scale f8e4m3[out,in/16], global_recip f32[1])
  hfq::nvfp4_dequantize(packed, scale, global_recip, dtype) -> [out,in]
  hfq::nvfp4_linear(x[...,in], packed, scale, global_recip, bias?) -> [...,out]  (grads: x, bias)
  hfq::nvfp4_linear_grad_input(grad[...,out], packed, scale, global_recip) -> [...,in]

Matmul design: one "swap-AB" kernel computes y^T tiles = dequant(W)[BN, BK] @ x^T[BK, BM] so the weight tile
(dequantised in registers) is the MMA's A operand and the token dimension is the small MMA N dimension.
M <= 16 uses BM=16 plus split-K (fp32 atomics) so every SM streams weights; large M uses big tiles.
The weight tile is E2M1 * E4M3-scale, which is exact in bf16/fp16 (<= 6 significant bits, |v| <= 2688),
and the 1/global_recip factor is applied to the fp32 accumulator. On CUDA the nibble -> bf16/fp16 decode
is a byte-permute lookup table in inline PTX (~2.5 instructions per weight); the interpreter uses plain ops.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from hfq.formats import fp4
from hfq_kernels._autotune import Tuner, m_bucket

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - CPU installs without triton keep the reference
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

if HAS_TRITON and INTERPRET:
    # Triton 3.6's interpreter turns loop bounds into 1-element arrays and calls int() on them, which
    # NumPy >= 2.3 refuses; wrap its patch so __index__ reads the single element instead.
    import triton.runtime.interpreter as _interp

    if not getattr(_interp._patch_lang_tensor, "_hfq_wrapped", False):
        _orig_patch = _interp._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            _orig_patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        _patch_lang_tensor._hfq_wrapped = True
        _interp._patch_lang_tensor = _patch_lang_tensor


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------------------------- kernels
if HAS_TRITON:

    @triton.jit
    def _e4m3_to_f32(b):
        """E4M3 byte (int32 0..255) -> float32, exact (subnormals included)."""
        e = (b >> 3) & 15
        m = b & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
        return tl.where((b & 128) != 0, -mag, mag)

    @triton.jit
    def _f32_to_bf16_rne(v):
        """fp32 -> bf16 with round-to-nearest-even on the bits (the interpreter's cast truncates)."""
        b = v.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        return b.to(tl.int16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _e2m1_raw(c):
        """4-bit code (int32) -> float32 value * 2^-14 (the code's bits placed in an fp16; exact)."""
        h = (((c & 7) << 9) | ((c & 8) << 12)).to(tl.int16)
        return h.to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _e2m1_to_f32(c):
        """4-bit code (int32) -> float32: code bits as fp16 (value * 2^-14, exact incl. 0.5) then rescale."""
        h = (((c & 7) << 9) | ((c & 8) << 12)).to(tl.int16)
        return h.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0

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
        sf = _e4m3_to_f32(s.to(tl.int32))
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
            v = tl.join(_e2m1_to_f32(pi & 15), _e2m1_to_f32(pi >> 4))
            v = tl.reshape(v, (R, C // 16, 16)) * tl.reshape(sf, (R, C // 16, 1))
            w = tl.reshape(v, (R, C)).to(DT)
        return w

    @triton.jit
    def _quantize_kernel(w_ptr, recip_ptr, packed_ptr, scale_ptr, R, C, stride_w,
                         BR: tl.constexpr, BC: tl.constexpr):
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        rr = pid_r * BR + tl.arange(0, BR)
        rc = pid_c * BC + tl.arange(0, BC)
        mask = (rr < R)[:, None] & (rc < C)[None, :]
        x = tl.load(w_ptr + rr[:, None].to(tl.int64) * stride_w + rc[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        recip = tl.load(recip_ptr)
        xb = tl.reshape(x, (BR, BC // 16, 16))
        bmax = tl.max(tl.abs(xb), axis=2)
        v = tl.minimum(tl.math.div_rn(bmax, 6.0) * recip, 448.0)
        # E4M3 round-to-nearest-even, computed explicitly so GPU and interpreter agree bit for bit.
        vb = v.to(tl.int32, bitcast=True)
        rb = (vb + 0x7FFFF + ((vb >> 20) & 1)) & -1048576  # keep 3 mantissa bits
        sub = v < 0.015625  # below E4M3's smallest normal 2^-6: steps of 2^-9
        r_sub = (v * 512.0 + 12582912.0) - 12582912.0  # rint via the 1.5*2^23 trick
        byte = tl.where(sub, r_sub.to(tl.int32), (rb >> 20) - 960)
        q = tl.where(sub, r_sub * 0.001953125, rb.to(tl.float32, bitcast=True))
        eff = tl.math.div_rn(q, recip)
        safe = tl.where(eff > 0, eff, 1.0)
        scaled = tl.math.div_rn(xb, tl.reshape(safe, (BR, BC // 16, 1)))
        mag = tl.where(tl.reshape(eff > 0, (BR, BC // 16, 1)), tl.abs(scaled), 0.0)
        idx = ((mag > 0.25).to(tl.int32) + (mag >= 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32)
               + (mag >= 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag >= 3.5).to(tl.int32)
               + (mag > 5.0).to(tl.int32))
        sign = (xb.to(tl.int32, bitcast=True) < 0).to(tl.int32)
        code = tl.reshape(idx | (sign << 3), (BR, BC // 2, 2))
        even, odd = tl.split(code)
        packed = (even | (odd << 4)).to(tl.uint8)
        rp = pid_c * (BC // 2) + tl.arange(0, BC // 2)
        tl.store(packed_ptr + rr[:, None].to(tl.int64) * (C // 2) + rp[None, :], packed,
                 mask=(rr < R)[:, None] & (rp < C // 2)[None, :])
        rs = pid_c * (BC // 16) + tl.arange(0, BC // 16)
        tl.store(scale_ptr + rr[:, None].to(tl.int64) * (C // 16) + rs[None, :], byte.to(tl.uint8),
                 mask=(rr < R)[:, None] & (rs < C // 16)[None, :])

    @triton.jit
    def _dequantize_kernel(packed_ptr, scale_ptr, recip_ptr, out_ptr, R, C,
                           BR: tl.constexpr, BC: tl.constexpr):
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        rr = pid_r * BR + tl.arange(0, BR)
        rmask = (rr < R)[:, None]
        rp = pid_c * (BC // 2) + tl.arange(0, BC // 2)
        rs = pid_c * (BC // 16) + tl.arange(0, BC // 16)
        p = tl.load(packed_ptr + rr[:, None].to(tl.int64) * (C // 2) + rp[None, :],
                    mask=rmask & (rp < C // 2)[None, :], other=0).to(tl.int32)
        s = tl.load(scale_ptr + rr[:, None].to(tl.int64) * (C // 16) + rs[None, :],
                    mask=rmask & (rs < C // 16)[None, :], other=0).to(tl.int32)
        eff = tl.math.div_rn(_e4m3_to_f32(s), tl.load(recip_ptr))
        v = tl.join(_e2m1_to_f32(p & 15), _e2m1_to_f32(p >> 4))
        v = tl.reshape(v, (BR, BC // 16, 16)) * tl.reshape(eff, (BR, BC // 16, 1))
        rc = pid_c * BC + tl.arange(0, BC)
        v = tl.reshape(v, (BR, BC))
        if out_ptr.dtype.element_ty == tl.bfloat16:
            v = _f32_to_bf16_rne(v)
        else:
            v = v.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rr[:, None].to(tl.int64) * C + rc[None, :], v, mask=rmask & (rc < C)[None, :])

    @triton.jit
    def _mm_kernel(x_ptr, wp_ptr, ws_ptr, recip_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_ym, chunks_per_split,
                   BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr,
                   ATOMIC: tl.constexpr, USE_ASM: tl.constexpr, MASK_K: tl.constexpr,
                   F32_DOT: tl.constexpr):
        """y[M, N] (+)= x[M, K] @ dequant(W)[N, K]^T, computed as W-tile @ x^T-tile (swap-AB), split over K."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        rn = pid_n * BN + tl.arange(0, BN)
        rm = pid_m * BM + tl.arange(0, BM)
        n_ok = rn < N
        m_ok = rm < M
        rn_c = tl.where(n_ok, rn, 0).to(tl.int64)  # clamped rows: loads stay unmasked
        rm_c = tl.where(m_ok, rm, 0).to(tl.int64)
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
            lo = _e2m1_raw(pi & 15)
            hi = _e2m1_raw(pi >> 4)
            part = tl.sum(lo[None, :, :, :] * xe.to(tl.float32)[:, None, :, :]
                          + hi[None, :, :, :] * xo.to(tl.float32)[:, None, :, :], axis=3)
            sf = _e4m3_to_f32(s.to(tl.int32)) * 16384.0
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
    def _dec_x_rowscale(x_cols, m_ok, k_lo, k_hi, K, BM: tl.constexpr, BK: tl.constexpr):
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
    def _dec_step(acc, q, s, x_cols, xsc, k, K, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                  MASK_K: tl.constexpr, X_F16: tl.constexpr, F32_DOT: tl.constexpr):
        """acc[BN, BM] += W-tile @ x^T-tile for one K tile. q: int32 words [BN, BK/8] (8 codes each, code j of
        word w is k = 8w + j), s: scale bytes [BN, BK/16]. The dot runs as 8 dots over the word axis, one per
        code position j, so no nibble is ever moved across lanes; x is read with the matching stride 8."""
        # E4M3 byte << 7 as fp16 bits = scale * 2^-8 (exact, subnormals included); * 256 restores it.
        sh = ((s.to(tl.int32) & 0x7F) << 7).to(tl.int16).to(tl.float16, bitcast=True) * 256.0
        s2 = tl.reshape(tl.join(sh, sh), (BN, BK // 8))
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
    def _dec_kernel(x_ptr, wq_ptr, ws_ptr, recip_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_ym, chunks_per_split,
                    BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr,
                    PARTIAL: tl.constexpr, MASK_K: tl.constexpr, X_F16: tl.constexpr, PREFETCH: tl.constexpr,
                    F32_DOT: tl.constexpr):
        """Decode-path W4A16 (swap-AB, fp16 tensor cores): y^T tile = dequant(W)[BN, K-slice] @ x^T[K-slice, BM].

        Weights are read as int32 words (8 codes, 16-byte vector loads) and decoded with ~2 integer ops per
        code: the code's bits placed in an fp16 (= e2m1 * 2^-14) times the E4M3 scale as fp16 is exact
        (a multiple of 2^-24, at most 2688 * 2^-14). x is scaled per row by a power of two into fp16 range.
        PREFETCH keeps the next K tile's weight loads in flight while this one is decoded.
        PARTIAL writes fp32 partial sums to y_ptr[pid_k, M, N] (split-K; a second kernel reduces them)."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        rn = pid_n * BN + tl.arange(0, BN)
        rm = pid_m * BM + tl.arange(0, BM)
        n_ok = rn < N
        m_ok = rm < M
        rn_c = tl.where(n_ok, rn, 0).to(tl.int64)
        rm_c = tl.where(m_ok, rm, 0).to(tl.int64)
        k_lo = pid_k * chunks_per_split * BK
        KW = K // 8
        kw = tl.arange(0, BK // 8)
        ks = tl.arange(0, BK // 16)
        wq_rows = wq_ptr + rn_c[:, None] * KW
        ws_rows = ws_ptr + rn_c[:, None] * (K // 16)
        x_cols = x_ptr + rm_c[None, :] * stride_xm
        if X_F16:
            xsc = tl.full((BM,), 1.0, tl.float32)
            xinv = xsc
        else:
            xsc, xinv = _dec_x_rowscale(x_cols, m_ok, k_lo, k_lo + chunks_per_split * BK, K, BM, BK)
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        if PREFETCH:
            if MASK_K:
                q = tl.load(wq_rows + (k_lo // 8 + kw)[None, :], mask=(k_lo // 8 + kw < KW)[None, :], other=0)
                s = tl.load(ws_rows + (k_lo // 16 + ks)[None, :], mask=(k_lo // 16 + ks < K // 16)[None, :],
                            other=0)
            else:
                q = tl.load(wq_rows + (k_lo // 8 + kw)[None, :])
                s = tl.load(ws_rows + (k_lo // 16 + ks)[None, :])
            for i in range(0, chunks_per_split - 1):
                k = k_lo + i * BK
                kn = k + BK
                if MASK_K:
                    qn = tl.load(wq_rows + (kn // 8 + kw)[None, :], mask=(kn // 8 + kw < KW)[None, :], other=0)
                    sn = tl.load(ws_rows + (kn // 16 + ks)[None, :], mask=(kn // 16 + ks < K // 16)[None, :],
                                 other=0)
                else:
                    qn = tl.load(wq_rows + (kn // 8 + kw)[None, :])
                    sn = tl.load(ws_rows + (kn // 16 + ks)[None, :])
                acc = _dec_step(acc, q, s, x_cols, xsc, k, K, BN, BM, BK, MASK_K, X_F16, F32_DOT)
                q = qn
                s = sn
            acc = _dec_step(acc, q, s, x_cols, xsc, k_lo + (chunks_per_split - 1) * BK, K, BN, BM, BK, MASK_K,
                            X_F16, F32_DOT)
        else:
            for i in range(0, chunks_per_split):
                k = k_lo + i * BK
                if MASK_K:
                    q = tl.load(wq_rows + (k // 8 + kw)[None, :], mask=(k // 8 + kw < KW)[None, :], other=0)
                    s = tl.load(ws_rows + (k // 16 + ks)[None, :], mask=(k // 16 + ks < K // 16)[None, :],
                                other=0)
                else:
                    q = tl.load(wq_rows + (k // 8 + kw)[None, :])
                    s = tl.load(ws_rows + (k // 16 + ks)[None, :])
                acc = _dec_step(acc, q, s, x_cols, xsc, k, K, BN, BM, BK, MASK_K, X_F16, F32_DOT)
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
    def _splitk_reduce_kernel(p_ptr, b_ptr, y_ptr, M, N, SPLIT, stride_ym, HAS_BIAS: tl.constexpr,
                              BLOCK: tl.constexpr):
        """y[M, N] = sum_s partial[s, M, N] (+ bias), cast to y's dtype."""
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
    def _mm_grad_kernel(g_ptr, wp_ptr, ws_ptr, recip_ptr, out_ptr, M, N, K, stride_gm,
                        BM: tl.constexpr, BNR: tl.constexpr, BKO: tl.constexpr, USE_ASM: tl.constexpr,
                        MASK_N: tl.constexpr, F32_DOT: tl.constexpr):
        """out[M, K] = g[M, N] @ dequant(W)[N, K]: weight tiles read in the canonical layout, reduced over N."""
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rk = pid_k * BKO + tl.arange(0, BKO)
        m_ok = rm < M
        k_ok = rk < K
        rm_c = tl.where(m_ok, rm, 0).to(tl.int64)
        kp = pid_k * (BKO // 2) + tl.arange(0, BKO // 2)
        ks = pid_k * (BKO // 16) + tl.arange(0, BKO // 16)
        kp = tl.where(kp < K // 2, kp, 0)
        ks = tl.where(ks < K // 16, ks, 0)
        acc = tl.zeros((BM, BKO), dtype=tl.float32)
        for n in range(0, N, BNR):
            rn = n + tl.arange(0, BNR)
            if MASK_N:
                n_ok = rn < N
                rn_c = tl.where(n_ok, rn, 0).to(tl.int64)
                p = tl.load(wp_ptr + rn_c[:, None] * (K // 2) + kp[None, :], mask=n_ok[:, None], other=0)
                s = tl.load(ws_ptr + rn_c[:, None] * (K // 16) + ks[None, :], mask=n_ok[:, None], other=0)
                g = tl.load(g_ptr + rm_c[:, None] * stride_gm + rn_c[None, :], mask=n_ok[None, :], other=0.0)
            else:
                rn_c = rn.to(tl.int64)
                p = tl.load(wp_ptr + rn_c[:, None] * (K // 2) + kp[None, :])
                s = tl.load(ws_ptr + rn_c[:, None] * (K // 16) + ks[None, :])
                g = tl.load(g_ptr + rm_c[:, None] * stride_gm + rn_c[None, :])
            w = _dequant_tile(p, s, BNR, BKO, g_ptr.dtype.element_ty, USE_ASM)
            if F32_DOT:
                acc = tl.dot(g.to(tl.float32), w.to(tl.float32), acc)
            else:
                acc = tl.dot(g, w, acc)
        acc = acc * (1.0 / tl.load(recip_ptr))
        tl.store(out_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & k_ok[None, :])


# ----------------------------------------------------------------------------------------------- launchers
_MM_DTYPES = (torch.bfloat16, torch.float16)


def _check_packed(packed, scale, global_scale, name="nvfp4"):
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(f"{name}: weight_packed must be uint8 [out, in/2], got {packed.dtype} {tuple(packed.shape)}")
    n, kh = packed.shape
    if scale.shape != (n, kh * 2 // 16) or scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: weight_scale must be float8_e4m3fn [{n}, {kh * 2 // 16}] for weight_packed "
                         f"{tuple(packed.shape)}, got {scale.dtype} {tuple(scale.shape)}")
    if (kh * 2) % 16:
        raise ValueError(f"{name}: in_features={kh * 2} must be a multiple of 16")
    if global_scale.numel() != 1:
        raise ValueError(f"{name}: weight_global_scale must have one element, got shape {tuple(global_scale.shape)}")


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


def quantize(w: torch.Tensor):
    """Triton NVFP4 quantization, bit-identical to hfq.formats.fp4.nvfp4_quantize."""
    fp4._check_2d(w, fp4.NVFP4_BLOCK, "weight")
    fp4.check_finite(w, "weight")
    w = w if w.stride(-1) == 1 else w.contiguous()
    r, c = w.shape
    recip = fp4.nvfp4_global_scale(w).to(torch.float32)
    packed = torch.empty((r, c // 2), dtype=torch.uint8, device=w.device)
    scale = torch.empty((r, c // 16), dtype=torch.float8_e4m3fn, device=w.device)
    br, bc = 16, 256
    grid = (_cdiv(r, br), _cdiv(c, bc))
    _quantize_kernel[grid](w, recip, packed, scale.view(torch.uint8), r, c, w.stride(0), BR=br, BC=bc,
                           num_warps=4)
    return packed, scale, recip


def dequantize(packed, scale, global_scale, dtype=torch.bfloat16, out=None):
    """Triton NVFP4 -> dtype, bit-identical to hfq.formats.fp4.nvfp4_dequantize."""
    _check_packed(packed, scale, global_scale)
    r, c = packed.shape[0], packed.shape[1] * 2
    if out is None:
        out = torch.empty((r, c), dtype=dtype, device=packed.device)
    br, bc = 16, 256
    grid = (_cdiv(r, br), _cdiv(c, bc))
    _dequantize_kernel[grid](packed, scale.view(torch.uint8), global_scale.float().reshape(1), out, r, c,
                             BR=br, BC=bc, num_warps=4)
    return out


def _mm_default(m: int, n: int, k: int) -> dict:
    """Heuristic config used when no tuned choice exists (and during graph capture / compile)."""
    sms = 132
    if m <= 64:
        return _dec_default(m, n, k)
    if m <= 16:
        bn, bm, bk = 64, 16, 256
        tiles = _cdiv(n, bn)
        chunks = _cdiv(k, bk)
        split = 1
        while tiles * split < 2 * sms and split * 2 <= chunks and split < 16:
            split *= 2
        return dict(kind="mm", BN=bn, BM=bm, BK=bk, split=split, warps=4, stages=4, asm=True)
    if m <= 64:
        bm = 32 if m <= 32 else 64
        return dict(kind="mm", BN=64, BM=bm, BK=128, split=2 if n * k < 4096 * 4096 else 1, warps=4, stages=4,
                    asm=True)
    return dict(kind="dq")


def _dec_candidates(m: int, n: int, k: int) -> list[dict]:
    """Decode-kernel configs: tile shapes x split-K around the one that gives ~2 programs per SM."""
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    c = []
    for bn, bk, warps, pre in ((128, 256, 4, True), (64, 256, 4, True), (128, 512, 8, True), (256, 256, 8, True),
                               (128, 256, 8, True), (128, 256, 4, False)):
        tiles = _cdiv(n, bn) * _cdiv(m, bm)
        chunks = _cdiv(k, bk)
        base = 1
        while tiles * base < 264 and base * 2 <= chunks:
            base *= 2
        for split in sorted({max(1, base // 2), base, min(chunks, base * 2)}):
            c.append(dict(kind="dec", BN=bn, BM=bm, BK=bk, split=split, warps=warps, stages=1, prefetch=pre))
    return c


def _mm_candidates(m: int, n: int, k: int) -> list[dict]:
    c = _dec_candidates(m, n, k) if m <= 64 else []
    if m <= 4:
        bm = 1 if m == 1 else (2 if m == 2 else 4)
        for bn, bk, warps, stages in ((16, 256, 4, 3), (32, 256, 4, 3), (16, 512, 4, 2), (8, 512, 4, 3)):
            tiles = _cdiv(n, bn)
            chunks = _cdiv(k, bk)
            for split in (1, 2, 4, 8):
                if split > chunks or (split > 1 and not 132 <= tiles * split <= 16 * 132):
                    continue
                c.append(dict(kind="gemv", BN=bn, BM=bm, BK=bk, split=split, warps=warps, stages=stages))
    if m <= 16:
        for bn, bk, warps, stages in ((64, 256, 4, 4), (64, 512, 4, 3)):
            tiles = _cdiv(n, bn)
            chunks = _cdiv(k, bk)
            for split in (1, 2, 4, 8, 16):
                if split > chunks or (split > 1 and not 132 <= tiles * split <= 8 * 132):
                    continue
                c.append(dict(kind="mm", BN=bn, BM=16, BK=bk, split=split, warps=warps, stages=stages, asm=True))
    elif m <= 64:
        for bn, bm, bk, warps, stages in ((64, 32, 128, 4, 4), (64, 64, 128, 4, 4), (128, 64, 128, 8, 3),
                                          (128, 32, 256, 4, 3)):
            if bm < m / 2:
                continue
            for split in (1, 2, 4):
                c.append(dict(kind="mm", BN=bn, BM=bm, BK=bk, split=split, warps=warps, stages=stages, asm=True))
    else:  # measured on H100: dequantize + cuBLAS beats the fused Triton tile for M >= 128 (see benchmarks)
        c.append(dict(kind="dq"))
        c.append(dict(kind="mm", BN=64, BM=128, BK=64, split=1, warps=4, stages=4, asm=True))
    return c


def _dec_launch(x2, packed, scale, recip, bias, cfg, out=None):
    """Decode kernel (kind "dec"); split > 1 writes fp32 partials and reduces them in a second launch."""
    m, k = x2.shape
    n = packed.shape[0]
    bn, bm, bk = cfg["BN"], cfg["BM"], cfg["BK"]
    if bk < 128 or bm < 16 or bn < 16:
        raise ValueError(f"nvfp4 decode kernel config: BK={bk}, BM={bm}, BN={bn}; need BK >= 128 (8 dots of "
                         f"K = BK/8 >= 16), BM >= 16 and BN >= 16 (tensor-core tile limits)")
    chunks = _cdiv(k, bk)
    split = max(1, min(cfg.get("split", 1), chunks))
    cps = _cdiv(chunks, split)
    split = _cdiv(chunks, cps)
    if not packed.is_contiguous():
        packed = packed.contiguous()
    wq = packed.view(torch.int32)
    partial = split > 1
    y = out if out is not None else torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    dst = torch.empty((split, m, n), dtype=torch.float32, device=x2.device) if partial else y
    grid = (_cdiv(n, bn), _cdiv(m, bm), split)
    _dec_kernel[grid](x2, wq, scale.view(torch.uint8), recip, bias if bias is not None else recip, dst,
                      m, n, k, x2.stride(0), y.stride(0), cps, BN=bn, BM=bm, BK=bk,
                      HAS_BIAS=bias is not None and not partial, PARTIAL=partial,
                      MASK_K=(k % bk) != 0 or (chunks % split) != 0, X_F16=x2.dtype == torch.float16,
                      PREFETCH=bool(cfg.get("prefetch", True)), F32_DOT=INTERPRET,
                      num_warps=cfg.get("warps", 4), num_stages=cfg.get("stages", 1))
    if partial:
        blk = 1024
        _splitk_reduce_kernel[(_cdiv(m * n, blk),)](dst, bias if bias is not None else recip, y, m, n, split,
                                                    y.stride(0), HAS_BIAS=bias is not None, BLOCK=blk,
                                                    num_warps=4)
    return y


def _dec_default(m: int, n: int, k: int) -> dict:
    """Heuristic decode config: BN=128 rows, BK=256, split-K until ~2 programs per SM (132 SMs)."""
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    bn, bk = 128, 256
    tiles = _cdiv(n, bn) * _cdiv(m, bm)
    chunks = _cdiv(k, bk)
    split = 1
    while tiles * split < 264 and split * 2 <= chunks:
        split *= 2
    return dict(kind="dec", BN=bn, BM=bm, BK=bk, split=split, warps=4, stages=1, prefetch=True)


def _mm_launch(x2, packed, scale, recip, bias, cfg, out=None):
    m, k = x2.shape
    n = packed.shape[0]
    bn, bm, bk = cfg["BN"], cfg["BM"], cfg["BK"]
    chunks = _cdiv(k, bk)
    split = max(1, min(cfg.get("split", 1), chunks))
    cps = _cdiv(chunks, split)
    split = _cdiv(chunks, cps)
    grid = (_cdiv(n, bn), _cdiv(m, bm), split)
    atomic = split > 1
    if atomic:
        y = torch.zeros((m, n), dtype=torch.float32, device=x2.device)
    else:
        y = out if out is not None else torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    if cfg["kind"] == "dec":
        return _dec_launch(x2, packed, scale, recip, bias, cfg, out=out)
    if cfg["kind"] == "gemv":
        _gemv_kernel[(_cdiv(n, bn), split)](
            x2, packed, scale.view(torch.uint8), recip, bias if bias is not None else recip, y,
            m, n, k, x2.stride(0), y.stride(0), cps, BN=bn, BM=bm, BK=bk,
            HAS_BIAS=bias is not None and not atomic, ATOMIC=atomic, MASK_K=(k % bk) != 0 or (chunks % split) != 0,
            num_warps=cfg.get("warps", 4), num_stages=cfg.get("stages", 3))
    else:
        _launch(_mm_kernel, grid, bool(cfg.get("asm", True)) and _use_asm(x2.device),
                x2, packed, scale.view(torch.uint8), recip, bias if bias is not None else recip, y,
                m, n, k, x2.stride(0), y.stride(0), cps,
                BN=bn, BM=bm, BK=bk, HAS_BIAS=bias is not None and not atomic, ATOMIC=atomic,
                MASK_K=(k % bk) != 0 or (chunks % split) != 0, F32_DOT=INTERPRET,
                num_warps=cfg.get("warps", 4), num_stages=cfg.get("stages", 3))
    if atomic:
        if bias is not None:
            y += bias.float()
        if out is not None:
            out.copy_(y)
            return out
        return y.to(x2.dtype)
    return y


_LINEAR_TUNER = Tuner("nvfp4_linear")
_GRAD_TUNER = Tuner("nvfp4_grad_input")


def _prep(x, packed, scale, global_scale, bias):
    _check_packed(packed, scale, global_scale)
    k = packed.shape[1] * 2
    if x.shape[-1] != k:
        raise ValueError(f"nvfp4_linear: x has in_features={x.shape[-1]} but the weight has {k}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    recip = global_scale.reshape(1)
    if recip.dtype != torch.float32:
        recip = recip.float()
    if bias is not None and bias.shape != (packed.shape[0],):
        raise ValueError(f"nvfp4_linear: bias must have shape ({packed.shape[0]},), got {tuple(bias.shape)}")
    return x2, recip


def linear(x, packed, scale, global_scale, bias=None, config: dict | None = None, out=None):
    """y = x @ dequant(W)^T + bias on the GPU (Triton); `config` forces a kernel config (tests, sweeps)."""
    x2, recip = _prep(x, packed, scale, global_scale, bias)
    m, k = x2.shape
    n = packed.shape[0]
    if m == 0 or x.dtype not in _MM_DTYPES:
        w = dequantize(packed, scale, recip, x.dtype)
        return F.linear(x, w, bias)
    if config is None:
        key = Tuner.key(m, n, k, x.dtype, x.device)
        config = _LINEAR_TUNER.choose(
            key, _mm_candidates(m, n, k),
            lambda c: (lambda: linear(x2, packed, scale, recip, bias, config=c)),
            _mm_default(m, n, k))
    if config["kind"] == "dq":
        y = F.linear(x2, dequantize(packed, scale, recip, x.dtype), bias)
        if out is not None:
            out.copy_(y)
            y = out
    else:
        y = _mm_launch(x2, packed, scale, recip, bias, config, out=out)
    return y.reshape(*x.shape[:-1], n)


def _grad_default(m, n, k):
    return dict(kind="dq")  # measured faster than the transposed-read kernel on every benchmark shape (H100)


def _grad_candidates(m, n, k):
    c = [dict(kind="dq")]
    for bm, bnr, bko, warps, stages in ((128, 64, 128, 8, 3), (128, 64, 256, 8, 3), (64, 64, 128, 4, 4),
                                        (128, 128, 128, 8, 3)):
        if m <= 64 and bm > 64:
            continue
        c.append(dict(kind="t", BM=bm, BNR=bnr, BKO=bko, warps=warps, stages=stages, asm=True))
    return c


def grad_input(g, packed, scale, global_scale, config: dict | None = None, out=None):
    """grad_x = g @ dequant(W) on the GPU: transposed-read kernel or dequantize + cuBLAS, per tuning."""
    _check_packed(packed, scale, global_scale)
    n, k = packed.shape[0], packed.shape[1] * 2
    if g.shape[-1] != n:
        raise ValueError(f"nvfp4_linear_grad_input: grad has {g.shape[-1]} features but the weight has {n} rows")
    g2 = g.reshape(-1, n)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    recip = global_scale.reshape(1).float()
    m = g2.shape[0]
    if m == 0 or g.dtype not in _MM_DTYPES:
        return g @ dequantize(packed, scale, recip, g.dtype)
    if config is None:
        key = Tuner.key(m, n, k, g.dtype, g.device)
        config = _GRAD_TUNER.choose(key, _grad_candidates(m, n, k),
                                    lambda c: (lambda: grad_input(g2, packed, scale, recip, config=c)),
                                    _grad_default(m, n, k))
    if config["kind"] == "dq":
        y = g2 @ dequantize(packed, scale, recip, g.dtype)
        if out is not None:
            out.copy_(y)
            y = out
    else:
        y = out if out is not None else torch.empty((m, k), dtype=g.dtype, device=g.device)
        bm, bnr, bko = config["BM"], config["BNR"], config["BKO"]
        grid = (_cdiv(m, bm), _cdiv(k, bko))
        _launch(_mm_grad_kernel, grid, bool(config.get("asm", True)) and _use_asm(g.device),
                g2, packed, scale.view(torch.uint8), recip, y, m, n, k, g2.stride(0),
                              BM=bm, BNR=bnr, BKO=bko, MASK_N=(n % bnr) != 0, F32_DOT=INTERPRET, num_warps=config.get("warps", 4),
                              num_stages=config.get("stages", 3))
    return y.reshape(*g.shape[:-1], k)


def _gpu_ok(t: torch.Tensor) -> bool:
    return HAS_TRITON and t.is_cuda


# ----------------------------------------------------------------------------------------------- ops
@torch.library.custom_op("hfq::nvfp4_quantize", mutates_args=())
def nvfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return fp4.nvfp4_quantize(w)


@nvfp4_quantize.register_kernel("cuda")
def _(w):
    return quantize(w) if _gpu_ok(w) else fp4.nvfp4_quantize(w)


@nvfp4_quantize.register_fake
def _(w):
    out, k = w.shape
    return (w.new_empty((out, k // 2), dtype=torch.uint8),
            w.new_empty((out, k // 16), dtype=torch.float8_e4m3fn),
            w.new_empty((1,), dtype=torch.float32))


@torch.library.custom_op("hfq::nvfp4_dequantize", mutates_args=())
def nvfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    return fp4.nvfp4_dequantize(packed, scale, global_scale, dtype)


@nvfp4_dequantize.register_kernel("cuda")
def _(packed, scale, global_scale, dtype):
    if _gpu_ok(packed):
        return dequantize(packed, scale, global_scale, dtype)
    return fp4.nvfp4_dequantize(packed, scale, global_scale, dtype)


@nvfp4_dequantize.register_fake
def _(packed, scale, global_scale, dtype):
    return packed.new_empty((packed.shape[0], packed.shape[1] * 2), dtype=dtype)


@torch.library.custom_op("hfq::nvfp4_linear", mutates_args=())
def nvfp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    _prep(x, packed, scale, global_scale, bias)
    w = fp4.nvfp4_dequantize(packed, scale, global_scale, x.dtype)
    return F.linear(x, w, bias)


@nvfp4_linear.register_kernel("cuda")
def _(x, packed, scale, global_scale, bias=None):
    if _gpu_ok(x):
        return linear(x, packed, scale, global_scale, bias)
    return F.linear(x, fp4.nvfp4_dequantize(packed, scale, global_scale, x.dtype), bias)


@nvfp4_linear.register_fake
def _(x, packed, scale, global_scale, bias=None):
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


@torch.library.custom_op("hfq::nvfp4_linear_grad_input", mutates_args=())
def nvfp4_linear_grad_input(grad: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                            global_scale: torch.Tensor) -> torch.Tensor:
    return grad @ fp4.nvfp4_dequantize(packed, scale, global_scale, grad.dtype)


@nvfp4_linear_grad_input.register_kernel("cuda")
def _(grad, packed, scale, global_scale):
    if _gpu_ok(grad):
        return grad_input(grad, packed, scale, global_scale)
    return grad @ fp4.nvfp4_dequantize(packed, scale, global_scale, grad.dtype)


@nvfp4_linear_grad_input.register_fake
def _(grad, packed, scale, global_scale):
    return grad.new_empty((*grad.shape[:-1], packed.shape[1] * 2))


def _linear_setup(ctx, inputs, output):
    x, packed, scale, global_scale, bias = inputs
    ctx.save_for_backward(packed, scale, global_scale)
    ctx.has_bias = bias is not None


def _linear_backward(ctx, grad):
    packed, scale, global_scale = ctx.saved_tensors
    gx = gb = None
    if ctx.needs_input_grad[0]:
        gx = torch.ops.hfq.nvfp4_linear_grad_input(grad, packed, scale, global_scale)
    if ctx.has_bias and ctx.needs_input_grad[4]:
        gb = grad.reshape(-1, grad.shape[-1]).sum(0)
    return gx, None, None, None, gb


nvfp4_linear.register_autograd(_linear_backward, setup_context=_linear_setup)

__all__ = ["nvfp4_quantize", "nvfp4_dequantize", "nvfp4_linear", "nvfp4_linear_grad_input",
           "quantize", "dequantize", "linear", "grad_input", "m_bucket"]
