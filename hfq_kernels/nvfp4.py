"""NVFP4 ops: quantize, dequantize, W4A16 linear (+ its grad-input product). Registered with torch.library.

CPU runs the torch reference (hfq_kernels.reference.fp4); CUDA runs the Triton kernels below.
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

from hfq_kernels.reference import fp4
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
        word w is k = 8w + j), s: scale bytes [BN, BK/8], one per word (word w's block w // 2: each scale byte is
        loaded twice, see _dec_kernel). The dot runs as 8 dots over the word axis, one per code position j, so no
        nibble is ever moved across lanes; x is read with the matching stride 8."""
        # E4M3 byte << 7 as fp16 bits = scale * 2^-8 (exact, subnormals included); * 256 restores it.
        # (Widening [BN, BK/16] scales with tl.reshape(tl.join(sh, sh), (BN, BK/8)) miscompiled on the H100 with
        # Triton 3.6: see _dec_kernel.)
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
        # one scale byte per weight word (word w of a tile uses block w // 2), so the per-word scale tile has the
        # words' shape with no in-register widening. The former tl.reshape(tl.join(sh, sh)) of a [BN, BK/16] tile
        # miscompiled on the H100 (Triton 3.6) when layout propagation moved the dot-operand layout (kWidth=8) back
        # through the reshape/join: with BN=32 every output was wrong (relative error ~1) unless the scale tile was
        # the prefetch loop's carried value (>= 2 K tiles per split with PREFETCH), which blocks that propagation;
        # BN >= 64 got kWidth=2 and was right, as was the interpreter.
        ks = tl.arange(0, BK // 8) // 2
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



# ----------------------------------------------------------------------------------------------- g4 decode kernel
# Gluon (explicit layouts) W4A16 decode kernel for bf16 activations on a repacked copy of the weights, M <= 64.
# Repacked layout (built once per weight by repack_g4, cached; state_dict/save keep the canonical layout):
#   rows in tiles of 16 (n = 16 rt + 8 hrow + g), K in chunks of 64 (k = 64 kc + 16 c + 8 wsub + 2 i + h), both
#   zero-padded. MMA lane (g, c) = 4 g + c owns rows g and g+8 of scale block c in every chunk: its 16 bytes are
#   words r = 2 hrow + wsub at int32 index ((rt*KC + kc)*32 + lane)*4 + r, one 16-byte load per thread.
#   In word r, the code of (i, h) has its 3 magnitude bits at 6+16h-SM[i] .. 8+16h-SM[i] and its sign at
#   15+16h-SS[i], with (SM, SS) = (0,0), (3,3), (-3,1), (6,2): so (w << SM[i]) & 0x01C001C0 | (w << SS[i]) & 0x80008000
#   is a pair of bf16 = e2m1 * 2^-126 (exact, 11 integer ops per 8 codes), which times the scale is the MMA's A
#   register for k-slab i directly (no layout conversion, no shared memory).
#   Scales: one byte per (row, block) at ((rt*KC + kc)*32 + lane)*2 + hrow, encoding bf16(scale * 2^112) as
#   (exponent - 230) << 3 | mantissa, so bf16x2(s, s) = byte * 0x00100010 + 0x73007300 (one IMAD); blocks whose
#   scale is 0 get zero codes. W = A * 2^14 / global_recip; x stays bf16 (the B operand, two 16-byte loads).
_G4_SM = (0, 3, -3, 6)
_G4_SS = (0, 3, 1, 2)
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    HAS_GLUON = HAS_TRITON
except Exception:  # pragma: no cover - older triton
    HAS_GLUON = False

if HAS_GLUON:
    _G4_ASM = gl.constexpr("""
    {
    .reg .b32 t0, t1, t2, t3, t4, NZ;
    mov.b32 NZ, 0x80008000;
    and.b32 t0, $4, 0x81C081C0;
    fma.rn.bf16x2 $0, t0, $5, NZ;
    shl.b32 t1, $4, 3;
    and.b32 t1, t1, 0x81C081C0;
    fma.rn.bf16x2 $1, t1, $5, NZ;
    shr.u32 t2, $4, 3;
    shl.b32 t3, $4, 1;
    and.b32 t2, t2, 0x01C001C0;
    and.b32 t3, t3, 0x80008000;
    or.b32 t2, t2, t3;
    fma.rn.bf16x2 $2, t2, $5, NZ;
    shl.b32 t3, $4, 6;
    shl.b32 t4, $4, 2;
    and.b32 t3, t3, 0x01C001C0;
    and.b32 t4, t4, 0x80008000;
    or.b32 t3, t3, t4;
    fma.rn.bf16x2 $3, t3, $5, NZ;
    }
    """)

    @gluon.constexpr_function
    def _g4_x_layout(BM, W):
        """x chunk [BM, 4, 16]: 16 contiguous k per thread (registers), lanes (c, g), rows g + 8t in registers."""
        BM, W = int(BM), int(W)
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8]] + [[8 << t, 0, 0] for t in range(BM.bit_length() - 4)],
            lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
            warp_bases=[[0, 0, 0]] * (W.bit_length() - 1), block_bases=[], shape=[BM, 4, 16])

    @gluon.jit
    def _g4_kernel(x_ptr, wr_ptr, sr_ptr, recip_ptr, b_ptr, y_ptr, M, N, K, KC, NT, stride_xm, stride_ym, cps,
                   BM: gl.constexpr, R: gl.constexpr, HAS_BIAS: gl.constexpr, PARTIAL: gl.constexpr,
                   PREFETCH: gl.constexpr):
        W: gl.constexpr = gl.num_warps()
        RT: gl.constexpr = R * W
        BN: gl.constexpr = RT * 16
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1], instr_shape=[16, 8])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 32, 1], [W, 1, 1], [2, 1, 0])
        L4: gl.constexpr = gl.BlockedLayout([1, 1, 2, 2], [1, 32, 1, 1], [W, 1, 1, 1], [3, 2, 1, 0])
        LS: gl.constexpr = gl.SliceLayout(3, L4)
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        pid_k = gl.program_id(2)
        kc0 = pid_k * cps
        nch = gl.minimum(cps, KC - kc0)
        # word offsets [RT, 32, 4]: ((rt*KC + kc)*32 + lane)*4 + r
        rt3 = gl.arange(0, RT, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        ln3 = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        r3 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        rtg3 = gl.minimum(pid_n * RT + rt3, NT - 1)
        woff = (gl.expand_dims(gl.expand_dims(rtg3 * (KC * 128), 1), 2) + gl.expand_dims(gl.expand_dims(ln3 * 4, 0), 2)
                + gl.expand_dims(gl.expand_dims(r3, 0), 1)) + kc0 * 128
        # scale offsets [RT, 32, 2] in LS: ((rt*KC + kc)*32 + lane)*2 + hrow
        rts = gl.arange(0, RT, layout=gl.SliceLayout(1, gl.SliceLayout(2, LS)))
        lns = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, LS)))
        hs = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, LS)))
        rtgs = gl.minimum(pid_n * RT + rts, NT - 1)
        soff = (gl.expand_dims(gl.expand_dims(rtgs * (KC * 64), 1), 2) + gl.expand_dims(gl.expand_dims(lns * 2, 0), 2)
                + gl.expand_dims(gl.expand_dims(hs, 0), 1)) + kc0 * 64
        # x chunk [BM, 4 (c), 16 (j)]: thread (g, c) reads x[g (+8), 16c .. 16c+15] (two 16-byte loads);
        # j = 8 wsub + 2 i + h is regrouped into the B operand's kappa = 16 i + 8 wsub + 2 c + h.
        XL: gl.constexpr = _g4_x_layout(BM, W)
        xm = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, gl.SliceLayout(2, XL)))
        xc = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, XL)))
        xj = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, XL)))
        xm3 = gl.expand_dims(gl.expand_dims(xm, 1), 2)
        xc3 = gl.expand_dims(gl.expand_dims(xc * 16, 0), 2)
        xptr = x_ptr + xm3.to(gl.int64) * stride_xm + xc3 + gl.expand_dims(gl.expand_dims(xj, 0), 1)
        xmok = xm3 < M
        acc = gl.zeros([BN, BM], gl.float32, layout=mma)
        k0 = kc0 * 64
        w = gl.load(wr_ptr + woff)
        s = gl.load(sr_ptr + soff)
        xt = gl.load(xptr + k0, mask=xmok & (k0 + xc3 < K), other=0.0)
        for it in range(nch):
            if PREFETCH:
                nx = gl.minimum(it + 1, nch - 1)
                wn = gl.load(wr_ptr + woff + nx * 128)
                sn = gl.load(sr_ptr + soff + nx * 64)
                kn = k0 + nx * 64
                xn = gl.load(xptr + kn, mask=xmok & (kn + xc3 < K), other=0.0)
            else:
                kcur = k0 + it * 64
                w = gl.load(wr_ptr + woff + it * 128)
                s = gl.load(sr_ptr + soff + it * 64)
                xt = gl.load(xptr + kcur, mask=xmok & (kcur + xc3 < K), other=0.0)
            w4 = gl.convert_layout(gl.reshape(w, [RT, 32, 2, 2]), L4, assert_trivial=True)
            s2 = s.to(gl.int32) * 0x00100010 + 0x73007300
            s4 = gl.broadcast(gl.expand_dims(s2, 3), w4)[0]
            o0, o1, o2, o3 = gl.inline_asm_elementwise(_G4_ASM, "=r,=r,=r,=r,r,r", [w4, s4],
                                                       dtype=(gl.int32, gl.int32, gl.int32, gl.int32),
                                                       is_pure=True, pack=1)
            o = gl.join(gl.join(o0, o1), gl.join(o2, o3))  # [RT, 32, hrow, wsub, i%2, i//2]
            lo = o.to(gl.int16).to(gl.bfloat16, bitcast=True)
            hi = (o >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
            v = gl.join(lo, hi)  # [..., h]
            v = gl.reshape(v, [RT, 8, 4, 2, 2, 2, 2, 2])  # rt, g, c, hrow, wsub, i0, i1, h
            v = gl.permute(v, [0, 3, 1, 6, 5, 4, 2, 7])  # rt, hrow, g, i1, i0, wsub, c, h
            a = gl.convert_layout(gl.reshape(v, [BN, 64]), a_l, assert_trivial=True)
            xb = gl.permute(gl.reshape(xt, [BM, 4, 2, 4, 2]), [3, 2, 1, 4, 0])  # i, wsub, c, h, m
            b = gl.convert_layout(gl.reshape(xb, [64, BM]), b_l, assert_trivial=True)
            acc = mma_v2(a, b, acc)
            if PREFETCH:
                w = wn
                s = sn
                xt = xn
        rn = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
        mo = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
        ymask = gl.expand_dims(rn < N, 1) & gl.expand_dims(mo < M, 0)
        acc = acc * (16384.0 / gl.load(recip_ptr))
        if PARTIAL:
            gl.store(y_ptr + (pid_k * M + gl.expand_dims(mo, 0)).to(gl.int64) * N + gl.expand_dims(rn, 1), acc, mask=ymask)
        else:
            if HAS_BIAS:
                acc += gl.expand_dims(gl.load(b_ptr + rn, mask=rn < N, other=0.0).to(gl.float32), 1)
            gl.store(y_ptr + gl.expand_dims(mo.to(gl.int64) * stride_ym, 0) + gl.expand_dims(rn, 1),
                     acc.to(y_ptr.dtype.element_ty), mask=ymask)


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
    """Triton NVFP4 quantization, bit-identical to hfq_kernels.reference.fp4.nvfp4_quantize."""
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
    """Triton NVFP4 -> dtype, bit-identical to hfq_kernels.reference.fp4.nvfp4_dequantize."""
    _check_packed(packed, scale, global_scale)
    return _dequant_raw(packed, scale, global_scale, dtype, out)


def _dequant_raw(packed, scale, global_scale, dtype, out=None):
    """dequantize() without the checks (callers have validated the tensors)."""
    r, c = packed.shape[0], packed.shape[1] * 2
    if out is None:
        out = torch.empty((r, c), dtype=dtype, device=packed.device)
    if global_scale.dtype != torch.float32:  # the kernel reads one fp32 (any shape with one element)
        global_scale = global_scale.float()
    _dequantize_kernel[(_cdiv(r, 16), _cdiv(c, 256))](packed, scale.view(torch.uint8), global_scale, out, r, c,
                                                      BR=16, BC=256, num_warps=4)
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
    if bk < 128 or bm < 16 or bn < 32:
        raise ValueError(f"nvfp4 decode kernel config: BK={bk}, BM={bm}, BN={bn}; need BK >= 128 (8 dots of "
                         f"K = BK/8 >= 16), BM >= 16 and BN >= 32 (BN = 16 gave wrong products on the H100)")
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


def repack_g4(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical (packed u8[N, K/2], scale e4m3[N, K/16]) -> the g4 kernel's (words i32, scale bytes u8); see _g4_kernel."""
    n, k = packed.shape[0], packed.shape[1] * 2
    nt, kc = _cdiv(n, 16), _cdiv(k, 64)
    dev = packed.device
    codes = torch.zeros((nt * 16, kc * 64), dtype=torch.int32, device=dev)
    p = packed.to(torch.int32)
    codes[:n, 0:k:2] = p & 15
    codes[:n, 1:k:2] = p >> 4
    sv = scale.float()
    bl = torch.zeros((nt * 16, kc * 4), dtype=torch.float32, device=dev)
    bl[:n, :k // 16] = sv
    zero = bl == 0
    codes.view(nt * 16, kc * 4, 16).masked_fill_(zero[:, :, None], 0)  # zero-scale blocks: zero codes (exact)
    bits = (bl * 2.0 ** 112).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    sb = torch.where(zero, torch.zeros_like(bits), (((bits >> 7) - 230) << 3) | ((bits >> 4) & 7))
    if bool(((sb < 0) | (sb > 255)).any()) or bool(((bits & 15) != 0).any()):
        raise ValueError("repack_g4: scale outside the E4M3 range (negative, NaN or not E4M3)")
    c = codes.view(nt, 2, 8, kc, 4, 2, 4, 2).to(torch.int64)  # rt, hrow, g, kc, c, wsub, i, h
    word = torch.zeros((nt, 2, 8, kc, 4, 2), dtype=torch.int64, device=dev)
    for i in range(4):
        for h in range(2):
            ci = c[..., i, h]
            word |= (ci & 7) << (6 + 16 * h - _G4_SM[i])
            word |= (ci >> 3) << (15 + 16 * h - _G4_SS[i])
    word = word.permute(0, 3, 2, 4, 1, 5).reshape(-1)  # rt, kc, g, c, hrow, wsub
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)
    sr = sb.view(nt, 2, 8, kc, 4).permute(0, 3, 2, 4, 1).reshape(-1).to(torch.uint8)  # rt, kc, g, c, hrow
    return word.contiguous(), sr.contiguous()


def g4_reference(x: torch.Tensor, wr: torch.Tensor, sr: torch.Tensor, n: int, k: int, recip) -> torch.Tensor:
    """Torch emulation of _g4_kernel's arithmetic on the repacked layout (tests: checks repack_g4 + decode on CPU)."""
    nt, kc = _cdiv(n, 16), _cdiv(k, 64)
    w = wr.to(torch.int64) & 0xFFFFFFFF
    w = w.view(nt, kc, 8, 4, 2, 2)  # rt, kc, g, c, hrow, wsub
    sbits = (sr.to(torch.int32) << 4) + (230 << 7)
    sval = (sbits.to(torch.int16).view(torch.bfloat16).float()).view(nt, kc, 8, 4, 2)
    out = torch.zeros((nt, kc, 8, 4, 2, 2, 4, 2), dtype=torch.float32)  # ..., hrow, wsub, i, h
    for i in range(4):
        sm, ss = _G4_SM[i], _G4_SS[i]
        sh = (lambda v, a: (v << a) if a >= 0 else (v >> -a))
        o = ((sh(w, sm) & 0x01C001C0) | (sh(w, ss) & 0x80008000)) & 0xFFFFFFFF
        for h in range(2):
            half = ((o >> (16 * h)) & 0xFFFF).to(torch.int32)
            half = torch.where(half >= 2 ** 15, half - 2 ** 16, half).to(torch.int16)
            out[..., i, h] = half.view(torch.bfloat16).float() * sval[..., None]
    wd = out.permute(0, 4, 2, 1, 3, 5, 6, 7).reshape(nt * 16, kc * 64)  # rt,hrow,g | kc,c,wsub,i,h
    wd = wd[:n, :k].double() * (2.0 ** 14 / float(recip.reshape(-1)[0]))
    return x.double() @ wd.T


_G4_CACHE: dict = {}


def _g4_repacked(packed: torch.Tensor, scale: torch.Tensor):
    """Lazily built repacked copy, cached per (packed, scale) tensor object and version (in-place updates rebuild)."""
    key = (id(packed), id(scale))
    ver = (packed._version, scale._version, packed.data_ptr(), scale.data_ptr())
    hit = _G4_CACHE.get(key)
    if hit is not None and hit[0]() is packed and hit[1]() is scale and hit[2] == ver:
        return hit[3]
    if torch.cuda.is_current_stream_capturing():
        return None
    import weakref
    rep = repack_g4(packed, scale)
    _G4_CACHE[key] = (weakref.ref(packed), weakref.ref(scale), ver, rep)
    weakref.finalize(packed, _G4_CACHE.pop, key, None)
    return rep


def _g4_ok(x2: torch.Tensor) -> bool:
    return (HAS_GLUON and not INTERPRET and x2.is_cuda and x2.dtype == torch.bfloat16 and x2.shape[0] <= 64
            and os.environ.get("HFQ_NVFP4_G4", "1") != "0" and torch.cuda.get_device_capability(x2.device) >= (8, 0))


def _g4_default(m: int, n: int, k: int) -> dict:
    bm = 8 if m <= 8 else (16 if m <= 16 else (32 if m <= 32 else 64))
    r, warps = 2, 4
    tiles = _cdiv(_cdiv(n, 16), r * warps) * _cdiv(m, bm)
    kc = _cdiv(k, 64)
    split = max(1, min(kc, _cdiv(264, tiles)))
    return dict(kind="g4", BM=bm, R=r, warps=warps, split=split)


def g4_config(m: int, n: int, k: int, device) -> dict:
    """The g4 config linear() uses for bf16 x with M <= 64: a tuned "g4" entry of the shipped table, else the default."""
    dev = torch.device(device)
    for mm in ((m, 8) if m <= 8 else (m,)):  # M <= 8 share the BM=8 kernel: fall back to the M=8 entry
        hit = _LINEAR_TUNER.cache.get(Tuner.key(mm, n, k, torch.bfloat16, dev))
        if hit is not None and hit.get("kind") == "g4":
            return dict(hit)
    return _g4_default(m, n, k)


def _g4_launch(x2, packed, scale, recip, bias, cfg, out=None):
    rep = _g4_repacked(packed, scale)
    if rep is None:
        return None
    wr, sr = rep
    m, k = x2.shape
    n = packed.shape[0]
    nt, kc = _cdiv(n, 16), _cdiv(k, 64)
    bm, r, warps = cfg["BM"], cfg["R"], cfg.get("warps", 4)
    split = max(1, min(cfg.get("split", 1), kc))
    cps = _cdiv(kc, split)
    split = _cdiv(kc, cps)
    partial = split > 1
    y = out if out is not None else torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    dst = torch.empty((split, m, n), dtype=torch.float32, device=x2.device) if partial else y
    grid = (_cdiv(nt, r * warps), _cdiv(m, bm), split)
    _g4_kernel[grid](x2, wr, sr, recip, bias if bias is not None else recip, dst, m, n, k, kc, nt,
                     x2.stride(0), y.stride(0), cps, BM=bm, R=r, HAS_BIAS=bias is not None and not partial,
                     PARTIAL=partial, PREFETCH=bool(cfg.get("prefetch", True)), num_warps=warps)
    if partial:
        blk = 1024
        _splitk_reduce_kernel[(_cdiv(m * n, blk),)](dst, bias if bias is not None else recip, y, m, n, split,
                                                    y.stride(0), HAS_BIAS=bias is not None, BLOCK=blk,
                                                    num_warps=4)
    return y


def _mm_launch(x2, packed, scale, recip, bias, cfg, out=None):
    m, k = x2.shape
    n = packed.shape[0]
    if cfg["kind"] == "g4":
        y = _g4_launch(x2, packed, scale, recip, bias, cfg, out=out) if _g4_ok(x2) else None
        if y is not None:
            return y
        cfg = _dec_default(m, n, k)
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


def _checked_runner(x2, packed, scale, recip, bias, tol: float = 2e-2):
    """Autotuning runner that first checks a candidate's product against dequantize + F.linear (fp32) and
    raises for a wrong one, so the tuner can never pick a config that miscomputes on this device/shape."""
    ref = {}

    def runner(c):
        if "y" not in ref:
            w = dequantize(packed, scale, recip, torch.float32)
            ref["y"] = F.linear(x2.float(), w, None if bias is None else bias.float())
        y = linear(x2, packed, scale, recip, bias, config=c).float()
        err = float((y - ref["y"]).norm() / ref["y"].norm().clamp_min(1e-30))
        if not err <= tol:
            raise ValueError(f"nvfp4 linear config {c}: relative error {err:.3g} > {tol} on this shape")
        return lambda: linear(x2, packed, scale, recip, bias, config=c)

    return runner


def linear(x, packed, scale, global_scale, bias=None, config: dict | None = None, out=None):
    """y = x @ dequant(W)^T + bias on the GPU (Triton); `config` forces a kernel config (tests, sweeps)."""
    _check_packed(packed, scale, global_scale)
    _check_bias(bias, packed.shape[0])
    return _linear_impl(x, packed, scale, global_scale, bias, config, out)


def _check_bias(bias, n):
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"nvfp4_linear: bias must have shape ({n},), got {tuple(bias.shape)}")


def _linear_impl(x, packed, scale, global_scale, bias=None, config: dict | None = None, out=None):
    """linear() for a validated weight (x's width is still checked). Large M with a cached "dq" choice (the
    training/prefill case) takes the shortest route: no reshapes, no key formatting, one dequantize launch + cuBLAS."""
    n, k = packed.shape[0], packed.shape[1] * 2
    if x.shape[-1] != k:
        raise ValueError(f"nvfp4_linear: x has in_features={x.shape[-1]} but the weight has {k}")
    recip = global_scale if global_scale.dtype == torch.float32 else global_scale.float()
    m = x.numel() // k
    if m == 0 or x.dtype not in _MM_DTYPES:
        return F.linear(x, _dequant_raw(packed, scale, recip, x.dtype), bias)
    if config is None and m > 64:
        config = _LINEAR_TUNER.cached(m, n, k, x.dtype, x.device)
        if config is not None and config["kind"] == "dq" and out is None:
            return F.linear(x, _dequant_raw(packed, scale, recip, x.dtype), bias)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if config is None and _g4_ok(x2):  # bf16 decode path: g4 kernel, shipped tuned choice else the heuristic
        config = g4_config(m, n, k, x.device)
    if config is None:
        config = _LINEAR_TUNER.cached(m, n, k, x.dtype, x.device)
    if config is None:
        key = Tuner.key(m, n, k, x.dtype, x.device)
        config = _LINEAR_TUNER.choose(key, _mm_candidates(m, n, k),
                                      _checked_runner(x2, packed, scale, recip, bias), _mm_default(m, n, k))
    if config["kind"] == "dq":
        y = F.linear(x2, _dequant_raw(packed, scale, recip, x.dtype), bias)
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
    return _grad_input_impl(g, packed, scale, global_scale, config, out)


def _grad_input_impl(g, packed, scale, global_scale, config: dict | None = None, out=None):
    """grad_input() for a validated weight (g's width is still checked); a cached "dq" choice goes straight to
    dequantize + cuBLAS."""
    n, k = packed.shape[0], packed.shape[1] * 2
    if g.shape[-1] != n:
        raise ValueError(f"nvfp4_linear_grad_input: grad has {g.shape[-1]} features but the weight has {n} rows")
    recip = global_scale if global_scale.dtype == torch.float32 else global_scale.float()
    m = g.numel() // n
    if m == 0 or g.dtype not in _MM_DTYPES:
        return g @ _dequant_raw(packed, scale, recip, g.dtype)
    if config is None:
        config = _GRAD_TUNER.cached(m, n, k, g.dtype, g.device)
        if config is not None and config["kind"] == "dq" and out is None:
            return g @ _dequant_raw(packed, scale, recip, g.dtype)
    g2 = g.reshape(-1, n)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    if config is None:
        key = Tuner.key(m, n, k, g.dtype, g.device)
        config = _GRAD_TUNER.choose(key, _grad_candidates(m, n, k),
                                    lambda c: (lambda: _grad_input_impl(g2, packed, scale, recip, config=c)),
                                    _grad_default(m, n, k))
    if config["kind"] == "dq":
        y = g2 @ _dequant_raw(packed, scale, recip, g.dtype)
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


# ----------------------------------------------------------------------------------------------- eager fast path
# torch.ops.hfq.nvfp4_linear costs ~0.1-0.2 ms of host time per call with autograd (the custom-op autograd
# wrapper, two Python dispatches, then the grad-input op again in backward): at M = 768 that is more than the
# GPU time of the smaller projections, so a training micro-batch became CPU-bound. In plain eager CUDA (no
# torch.compile, no dispatch mode, no functorch transform, a plain tensor) NVFP4Linear therefore calls the same
# host code through a torch.autograd.Function; everything else (compile, export, fake tensors, direct callers)
# goes through the registered ops. HFQ_NVFP4_EAGER_FAST=0 turns the shortcut off.
_EAGER_FAST = os.environ.get("HFQ_NVFP4_EAGER_FAST", "1") != "0"
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None)


def eager_fast_ok(x: torch.Tensor) -> bool:
    """True where linear_eager may replace torch.ops.hfq.nvfp4_linear for input x."""
    return (_EAGER_FAST and HAS_TRITON and type(x) is torch.Tensor and x.is_cuda
            and not torch.compiler.is_compiling()
            and _dispatch_modes is not None and _dispatch_modes() == 0
            and not (_functorch_active is not None and _functorch_active()))


class _LinearFn(torch.autograd.Function):
    """Autograd of hfq::nvfp4_linear (grads for x and bias) without the custom-op machinery."""

    @staticmethod
    def forward(ctx, x, packed, scale, global_scale, bias):
        ctx.save_for_backward(packed, scale, global_scale)
        ctx.has_bias = bias is not None
        return _linear_impl(x, packed, scale, global_scale, bias)

    @staticmethod
    def backward(ctx, grad):
        packed, scale, global_scale = ctx.saved_tensors
        gx = gb = None
        if ctx.needs_input_grad[0]:
            gx = _grad_input_impl(grad, packed, scale, global_scale)
        if ctx.has_bias and ctx.needs_input_grad[4]:
            gb = grad.reshape(-1, grad.shape[-1]).sum(0)
        return gx, None, None, None, gb


def linear_eager(x, packed, scale, global_scale, bias=None, checked: bool = False):
    """torch.ops.hfq.nvfp4_linear(x, packed, scale, global_scale, bias): same values and gradients, with the
    eager shortcut where eager_fast_ok(x). checked=True: the caller has already validated packed/scale/global_scale
    (NVFP4Linear does once per buffer set); x's width and the bias shape are always checked."""
    if not eager_fast_ok(x):
        return torch.ops.hfq.nvfp4_linear(x, packed, scale, global_scale, bias)
    if not checked:
        _check_packed(packed, scale, global_scale)
    _check_bias(bias, packed.shape[0])
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return _LinearFn.apply(x, packed, scale, global_scale, bias)
    return _linear_impl(x, packed, scale, global_scale, bias)


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
           "quantize", "dequantize", "linear", "grad_input", "linear_eager", "eager_fast_ok", "m_bucket"]
