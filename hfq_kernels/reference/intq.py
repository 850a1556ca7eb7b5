"""Uniform integer formats in pure torch (the oracle for kernels).

- Symmetric INT-b (ECO's INT4 fine-tuning): codes in [-(2^(b-1)-1), 2^(b-1)-1], scale = amax/qmax, one scale
  per tensor or per group of `group_size` contiguous input elements. INT4 codes are packed two per byte as
  (code + 8): element 2i in the low nibble, 2i+1 in the high nibble.
- Asymmetric INT-b per output channel (QFT eq. 1-2): s = (max-min)/(2^b-1), z = round(-min/s),
  code = clamp(round(w * (1/s)) + z, 0, 2^b-1) (the reciprocal once per row, as the kernels compute it), value = (code - z) * s. The range always contains 0, so 0 is exact.
  The one INT8 quantizer of hfq: weights' dense part, QFT's INT8 gradients and QLion's INT8 momentum.
- Dense + sparse (QFT eq. 3): values outside [T_min, T_max] (the `outlier_fraction` tails, split evenly) are
  kept in bf16 as (flat int32 index, value) pairs; the dense rest (outliers zeroed) is INT8 per channel.
Rounding: nearest (RTN) or stochastic (SR, floor(x + u), unbiased). Scales are at least fp8.MIN_SCALE.
"""
from __future__ import annotations

import torch

from .fp8 import MIN_SCALE, check_finite, check_rounding


def round_int(x: torch.Tensor, rounding: str = "rtn", generator: torch.Generator | None = None,
              noise: torch.Tensor | None = None) -> torch.Tensor:
    """Round float32 values to integers (still float32): nearest-even or stochastic (uniform draws from
    `generator`, or `noise` [0, 1) of x's shape when given)."""
    check_rounding(rounding)
    if rounding == "rtn":
        return torch.round(x)
    u = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32) if noise is None \
        else noise.reshape(x.shape)
    return torch.floor(x + u)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Signed int codes in [-8, 7], [..., n] -> uint8 [..., n/2] (offset +8, low nibble first)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_int4: last dim must be even, got {codes.shape[-1]}")
    c = (codes.to(torch.int16) + 8).to(torch.uint8)
    return (c[..., 0::2] & 15) | ((c[..., 1::2] & 15) << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> int8 codes [..., n] in [-8, 7]."""
    lo = (packed & 15).to(torch.int8) - 8
    hi = ((packed >> 4) & 15).to(torch.int8) - 8
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _sym_scales(w: torch.Tensor, qmax: int, group_size: int | None) -> torch.Tensor:
    rows, cols = w.shape
    if group_size is None:
        amax = w.abs().amax().reshape(1)
    else:
        amax = w.abs().reshape(rows, cols // group_size, group_size).amax(-1)
    return torch.where(amax > 0, (amax / qmax).clamp_min(MIN_SCALE), torch.ones_like(amax))


def _expand_scales(scales: torch.Tensor, shape, group_size: int | None) -> torch.Tensor:
    if group_size is None:
        return scales.reshape(1, 1)
    return scales.repeat_interleave(group_size, dim=-1)


def check_int4_shape(shape, group_size: int | None) -> None:
    if len(shape) != 2:
        raise ValueError(f"int4: weight must be 2-D [out, in], got shape {tuple(shape)}")
    if shape[-1] % 2:
        raise ValueError(f"int4: in_features must be even (two codes per byte), got {shape[-1]}")
    if group_size is not None and (group_size <= 0 or shape[-1] % group_size):
        raise ValueError(f"int4_group: in_features {shape[-1]} must be a multiple of group_size {group_size}")


def quantize_int4(w: torch.Tensor, group_size: int | None = None, rounding: str = "rtn",
                  generator: torch.Generator | None = None, noise: torch.Tensor | None = None):
    """[rows, cols] -> (packed uint8 [rows, cols/2], scales float32 [1] or [rows, cols/group_size])."""
    check_int4_shape(w.shape, group_size)
    check_finite(w)
    w = w.float()
    scales = _sym_scales(w, 7, group_size)
    q = round_int(w / _expand_scales(scales, w.shape, group_size), rounding, generator, noise).clamp(-7, 7)
    return pack_int4(q), scales


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, group_size: int | None = None,
                    dtype=torch.float32) -> torch.Tensor:
    q = unpack_int4(packed).float()
    return (q * _expand_scales(scales, q.shape, group_size)).to(dtype)


def as_rows(shape) -> tuple[int, int]:
    """The [rows, cols] view used for per-row scales: rows = first dim (1 for 0-D/1-D tensors)."""
    shape = tuple(shape)
    if len(shape) <= 1:
        return 1, (shape[0] if shape else 1)
    n = 1
    for s in shape[1:]:
        n *= s
    return shape[0], n


def quantize_int_asym(w: torch.Tensor, bits: int = 8, rounding: str = "rtn", generator: torch.Generator | None = None,
                      check: bool = True, noise: torch.Tensor | None = None):
    """Per-row asymmetric (rows: see as_rows) -> (codes uint8 [rows, cols], scales fp32 [rows,1], zeros uint8 [rows,1]).

    check=False skips the NaN/Inf refusal (a host sync) for callers that track finiteness on the device."""
    if isinstance(bits, bool) or bits not in range(1, 9):
        raise ValueError(f"bits: expected an int in [1, 8] (uint8 codes), got {bits!r}")
    if check:
        check_finite(w)
    w = w.detach().float().reshape(as_rows(w.shape))
    qmax = 2 ** bits - 1
    lo = w.amin(-1, keepdim=True).clamp_max(0)
    hi = w.amax(-1, keepdim=True).clamp_min(0)
    scales = torch.where(hi > lo, ((hi - lo) / qmax).clamp_min(MIN_SCALE), torch.ones_like(hi))
    zeros = torch.round(-lo / scales).clamp(0, qmax)
    q = (round_int(w * (1.0 / scales), rounding, generator, noise) + zeros).clamp(0, qmax)  # one division per row
    return q.to(torch.uint8), scales, zeros.to(torch.uint8)


def dequantize_int_asym(codes, scales, zeros, dtype=torch.float32, shape=None) -> torch.Tensor:
    """Inverse of quantize_int_asym: [rows, cols], or reshaped to the logical `shape` when given."""
    d = (codes.float() - zeros.float()) * scales
    return (d if shape is None else d.reshape(shape)).to(dtype)


def outlier_thresholds(w: torch.Tensor, fraction: float = 0.01) -> torch.Tensor:
    """float32 [2] = (T_min, T_max): the fraction/2 lower and upper quantiles of w (QFT's 1% tails)."""
    if not 0 <= fraction < 1:
        raise ValueError(f"outlier_fraction must be in [0, 1), got {fraction}")
    flat = w.detach().float().reshape(-1)
    n = flat.numel()
    k = int(n * fraction / 2)
    if k == 0:
        return torch.stack((flat.min(), flat.max())).to(torch.float32)
    if flat.is_cuda:  # CUDA's kthvalue scans a single slice with one thread block; a radix sort uses the whole GPU
        s = flat.sort().values
        return torch.stack((s[k], s[n - k - 1])).to(torch.float32)
    t_min = torch.kthvalue(flat, k + 1).values
    t_max = torch.kthvalue(flat, n - k).values
    return torch.stack((t_min, t_max)).to(torch.float32)


def round_bf16(x: torch.Tensor, rounding: str = "rtn", generator: torch.Generator | None = None,
               noise: torch.Tensor | None = None) -> torch.Tensor:
    """float32 values -> bf16: nearest-even, or stochastic (up with probability the fraction of the bf16 step
    below x's magnitude: unbiased; NaN/Inf kept), from `generator` or `noise` [0, 1) of x's shape."""
    check_rounding(rounding)
    if rounding == "rtn":
        return x.float().to(torch.bfloat16)
    u = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32) if noise is None \
        else noise.reshape(x.shape)
    x = x.float().contiguous()
    add = torch.where(torch.isfinite(x), (u * 65536.0).to(torch.int32), 0)  # NaN/Inf bits stay NaN/Inf
    bits = x.view(torch.int32) + add  # carries from the magnitude's low 16 bits round it up
    return (bits >> 16).to(torch.int16).view(torch.bfloat16)


def quantize_dense_sparse(w: torch.Tensor, thresholds: torch.Tensor, rounding: str = "rtn",
                          generator: torch.Generator | None = None, noise: torch.Tensor | None = None):
    """-> dict(codes, scales, zeros, sparse_idx int32 [nnz], sparse_val bf16 [nnz]) given (T_min, T_max). SR
    rounds the bf16 outliers stochastically too (nearest would undo any update below half their ulp: a Lion
    step of lr 2e-5 on every |w| >= 2^-7); with `noise`, its draws at the outliers' (otherwise unused) positions."""
    check_finite(w)
    check_rounding(rounding)
    w = w.float()
    out = (w < thresholds[0]) | (w > thresholds[1])
    idx = out.reshape(-1).nonzero().squeeze(-1)
    if rounding == "sr" and noise is None:  # one draw per element, as before outliers were rounded so: the
        noise = torch.rand(w.shape, generator=generator, device=w.device, dtype=torch.float32)  # stream stays
    codes, scales, zeros = quantize_int_asym(torch.where(out, torch.zeros_like(w), w), 8, rounding, generator,
                                             check=False, noise=noise)  # w was checked above
    vals = round_bf16(w.reshape(-1)[idx], rounding, generator, None if noise is None else noise.reshape(-1)[idx])
    return {"codes": codes, "scales": scales, "zeros": zeros, "sparse_idx": idx.to(torch.int32), "sparse_val": vals}


def dequantize_dense_sparse(codes, scales, zeros, sparse_idx, sparse_val, dtype=torch.float32) -> torch.Tensor:
    d = dequantize_int_asym(codes, scales, zeros, torch.float32)
    flat = d.reshape(-1)
    flat[sparse_idx.long()] = sparse_val.float()  # the dense code there is exactly 0
    return d.to(dtype)
