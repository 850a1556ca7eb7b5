"""NVFP4 / MXFP4 in pure torch: the oracle every kernel is tested against.

NVFP4: E2M1 codes, one E4M3 scale per 16 elements along the last dim, one fp32 global scale
stored as its reciprocal (compressed-tensors' convention): value = e2m1 * scale / global_recip.
MXFP4: E2M1 codes, one E8M0 (power-of-two) scale per 32 elements, no global scale.
Codes: bit 3 = sign, bits 0-2 = magnitude index; two codes per byte, element 2i in the low nibble.
Tiny tensors: the reciprocal is capped at 2^117 so that every block multiplier (scale / global_recip, scale >= 2^-9)
is a normal fp32 (GPU kernels may flush subnormals); below NVFP4_MIN_AMAX even the largest block's E4M3 scale would
leave E4M3's normal range, so such tensors are refused rather than rounded towards zero.
"""
from __future__ import annotations

import torch

from .fp8 import check_finite  # the one NaN/Inf refusal, shared by every format

E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
NVFP4_MAX_RECIP = 2.0 ** 117
NVFP4_MIN_AMAX = 2.0 ** -120  # the largest block's scale amax / 6 * NVFP4_MAX_RECIP stays >= 2^-6 (E4M3's smallest normal)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Decision boundaries between consecutive magnitudes; a value exactly on a boundary goes to the
# even code index (round-half-to-even on the E2M1 mantissa, as the hardware cvt does).
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round float values (already divided by their scale) to 4-bit E2M1 codes, saturating at +-6."""
    x = x.float()
    mag = x.abs()
    idx = torch.zeros_like(mag, dtype=torch.uint8)
    for i, b in enumerate(_BOUNDS):
        # index i -> i+1 when above the boundary, or exactly on it and i+1 is even
        up = (mag > b) | ((mag == b) & ((i + 1) % 2 == 0))
        idx = idx + up.to(torch.uint8)
    sign = torch.signbit(x).to(torch.uint8) << 3
    return idx | sign


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8, one per element) to float32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., n] codes -> [..., n/2] bytes; element 2i in the low nibble, 2i+1 in the high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dim must be even, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 15) | ((c[..., 1::2] & 15) << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., n/2] bytes -> [..., n] codes."""
    lo = packed & 15
    hi = (packed >> 4) & 15
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def _check_2d(w: torch.Tensor, block: int, name: str) -> None:
    if w.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D [out, in] weight, got shape {tuple(w.shape)}")
    if w.shape[-1] % block:
        raise ValueError(
            f"{name}: in_features={w.shape[-1]} is not a multiple of the block size {block}"
        )
    if not w.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point weight, got {w.dtype}")


def check_nvfp4_amax(amax, name: str = "weight") -> None:
    """ValueError for a nonzero max |value| (a tensor, or the amax itself) below NVFP4_MIN_AMAX."""
    a = float(amax.detach().abs().amax()) if isinstance(amax, torch.Tensor) else float(amax)
    if 0 < a < NVFP4_MIN_AMAX:
        raise ValueError(f"{name}: max |value| {a:.3g} is below {NVFP4_MIN_AMAX:.3g} (2^-120), the smallest NVFP4 "
                         "holds within its error (fp32 global scale, E4M3 block scales); scale the tensor up or keep "
                         "the layer unquantized (modules_to_not_convert)")


def nvfp4_global_scale(w: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """Reciprocal global scale 448*6/amax capped at NVFP4_MAX_RECIP (fp32 [1]); 1.0 for an all-zero tensor.
    ValueError for a nonzero amax below NVFP4_MIN_AMAX, which NVFP4 cannot hold within its error."""
    amax = w.abs().amax().float()
    check_nvfp4_amax(amax, name)
    recip = (torch.full_like(amax, E4M3_MAX * E2M1_MAX) / amax).clamp(max=NVFP4_MAX_RECIP)
    return torch.where(amax > 0, recip, torch.ones_like(recip)).reshape(1)


def nvfp4_quantize(w: torch.Tensor, global_scale: torch.Tensor | None = None, name: str = "weight"):
    """Quantize [out, in] to (packed uint8 [out, in/2], scale e4m3 [out, in/16], global_recip fp32 [1]).

    block scale = e4m3(block_amax / 6 * global_recip); element = e2m1(x / (scale / global_recip)).
    """
    _check_2d(w, NVFP4_BLOCK, name)
    check_finite(w, name)
    out, k = w.shape
    wf = w.float()
    recip = nvfp4_global_scale(wf, name) if global_scale is None else global_scale.float().reshape(1)
    blocks = wf.reshape(out, k // NVFP4_BLOCK, NVFP4_BLOCK)
    bmax = blocks.abs().amax(dim=-1)
    # a tensor divisor: CUDA turns division by a Python scalar into a reciprocal multiply, CPU does not
    scale = (bmax / torch.full_like(bmax, E2M1_MAX) * recip).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    eff = scale.float() / recip  # the real per-block multiplier
    safe = torch.where(eff > 0, eff, torch.ones_like(eff))
    scaled = torch.where((eff > 0)[..., None], blocks / safe[..., None], blocks * 0)
    codes = e2m1_encode(scaled).reshape(out, k)
    return pack_fp4(codes), scale, recip


def nvfp4_dequantize(packed, scale, global_scale, dtype=torch.bfloat16):
    """Inverse of nvfp4_quantize: e2m1(code) * (scale / global_recip), cast to dtype."""
    codes = unpack_fp4(packed)
    out, k = codes.shape
    vals = e2m1_decode(codes).reshape(out, k // NVFP4_BLOCK, NVFP4_BLOCK)
    eff = scale.float() / global_scale.float().reshape(1)
    return (vals * eff[..., None]).reshape(out, k).to(dtype)


def mxfp4_quantize(w: torch.Tensor, name: str = "weight"):
    """Quantize [out, in] to (packed uint8 [out, in/2], biased E8M0 exponent uint8 [out, in/32]).

    OCP MX rule: shared exponent = floor(log2(block_amax)) - 2 (E2M1's emax), clamped to E8M0's range;
    elements beyond +-6 after scaling saturate.
    """
    _check_2d(w, MXFP4_BLOCK, name)
    check_finite(w, name)
    out, k = w.shape
    blocks = w.float().reshape(out, k // MXFP4_BLOCK, MXFP4_BLOCK)
    bmax = blocks.abs().amax(dim=-1)
    exp = torch.floor(torch.log2(torch.where(bmax > 0, bmax, torch.ones_like(bmax)))) - 2
    exp = torch.where(bmax > 0, exp, torch.full_like(exp, -127)).clamp(-127, 127)
    scaled = blocks / torch.exp2(exp)[..., None]
    codes = e2m1_encode(scaled).reshape(out, k)
    return pack_fp4(codes), (exp + 127).to(torch.uint8)


def mxfp4_dequantize(packed, scale, dtype=torch.bfloat16):
    codes = unpack_fp4(packed)
    out, k = codes.shape
    vals = e2m1_decode(codes).reshape(out, k // MXFP4_BLOCK, MXFP4_BLOCK)
    mult = torch.exp2(scale.float() - 127)
    return (vals * mult[..., None]).reshape(out, k).to(dtype)
