"""NVFP4 quantize / dequantize kernels (Triton) and their host launchers, bit-identical to hfq_kernels.reference.fp4.

Layouts are the canonical compressed-tensors ones: packed u8[out, in/2] (element 2i in the low nibble),
scale f8e4m3[out, in/16], global_recip f32[1] (value = e2m1 * scale / global_recip).
"""
from __future__ import annotations

import torch

from hfq_kernels._triton import cdiv, e2m1_to_f32, e4m3_to_f32, f32_to_bf16_rne, tl, triton
from hfq_kernels.reference import fp4


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
    eff = tl.math.div_rn(e4m3_to_f32(s), tl.load(recip_ptr))
    v = tl.join(e2m1_to_f32(p & 15), e2m1_to_f32(p >> 4))
    v = tl.reshape(v, (BR, BC // 16, 16)) * tl.reshape(eff, (BR, BC // 16, 1))
    rc = pid_c * BC + tl.arange(0, BC)
    v = tl.reshape(v, (BR, BC))
    if out_ptr.dtype.element_ty == tl.bfloat16:
        v = f32_to_bf16_rne(v)
    else:
        v = v.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rr[:, None].to(tl.int64) * C + rc[None, :], v, mask=rmask & (rc < C)[None, :])


def recip(global_scale: torch.Tensor) -> torch.Tensor:
    """The fp32 global-scale reciprocal the kernels read, from weight_global_scale of any float dtype."""
    return global_scale if global_scale.dtype == torch.float32 else global_scale.float()


def check_packed(packed, scale, global_scale, name="nvfp4"):
    """Raise ValueError unless (packed, scale, global_scale) form one canonical NVFP4 weight."""
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
    grid = (cdiv(r, br), cdiv(c, bc))
    _quantize_kernel[grid](w, recip, packed, scale.view(torch.uint8), r, c, w.stride(0), BR=br, BC=bc,
                           num_warps=4)
    return packed, scale, recip


def dequantize(packed, scale, global_scale, dtype=torch.bfloat16, out=None):
    """Triton NVFP4 -> dtype, bit-identical to hfq_kernels.reference.fp4.nvfp4_dequantize."""
    check_packed(packed, scale, global_scale)
    return dequant_raw(packed, scale, global_scale, dtype, out)


def dequantize_traced(packed, scale, global_scale, dtype=torch.bfloat16):
    """dequantize() inside a call torch.compile traces (hfq's triton_ops): launched through
    torch.library.wrap_triton, so inductor's generated code makes the launch itself. No checks."""
    from torch.library import wrap_triton

    return dequant_raw(packed, scale, global_scale, dtype, kernel=wrap_triton(_dequantize_kernel))


def dequant_raw(packed, scale, global_scale, dtype, out=None, kernel=None):
    """dequantize() without the checks (callers have validated the tensors); `kernel` stands in for
    _dequantize_kernel (dequantize_traced passes its wrap_triton wrapper)."""
    r, c = packed.shape[0], packed.shape[1] * 2
    if out is None:
        out = torch.empty((r, c), dtype=dtype, device=packed.device)
    (kernel or _dequantize_kernel)[(cdiv(r, 16), cdiv(c, 256))](packed, scale.view(torch.uint8), recip(global_scale),
                                                                out, r, c, BR=16, BC=256, num_warps=4)
    return out
