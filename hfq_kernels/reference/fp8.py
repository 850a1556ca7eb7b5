"""FP8 E4M3 with one scale per row (ECO's weight format), pure torch: the oracle for the kernels.

scale[row] = amax(row) / 448; code = round(w / scale) on the E4M3 grid, nearest-even (RTN) or
stochastic (SR: up with probability equal to the fractional distance to the lower neighbour, so
E[Q(w)] = w). Codes are stored as torch.float8_e4m3fn, scales as float32 [rows, 1].
"""
from __future__ import annotations

import torch

E4M3_MAX = 448.0
# Smallest scale of any row/group format: fp32's smallest normal. 1/scale stays finite and no scale is a subnormal
# that a GPU kernel may flush to zero; rows smaller than ~qmax * MIN_SCALE are quantized with this step instead.
MIN_SCALE = 2.0 ** -126
ROUNDINGS = ("rtn", "sr")


def check_rounding(rounding: str) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding: unknown {rounding!r}; allowed {ROUNDINGS}")


def check_finite(w: torch.Tensor, name: str = "weight") -> None:
    """Refuse NaN/Inf: one bad value would poison the scale of its whole row."""
    if not torch.isfinite(w).all():
        n_bad = int((~torch.isfinite(w)).sum())
        raise ValueError(f"{name}: {n_bad} NaN/Inf value(s) found; cannot quantize a non-finite weight")


def e4m3_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of the E4M3 grid at |x| (float32): 2^(max(floor(log2|x|), -6) - 3); subnormals below 2^-6."""
    _, e = torch.frexp(x)
    return torch.ldexp(torch.ones_like(x), (e - 1).clamp_min(-6) - 3)


def round_e4m3(x: torch.Tensor, rounding: str = "rtn", generator: torch.Generator | None = None,
               noise: torch.Tensor | None = None) -> torch.Tensor:
    """Round float32 values in [-448, 448] onto the E4M3 grid; returns float32 grid values.

    `noise` (uniform [0,1), same shape) may be given instead of a generator, e.g. to replay draws."""
    check_rounding(rounding)
    x = x.float().clamp(-E4M3_MAX, E4M3_MAX)
    if rounding == "rtn":
        return x.to(torch.float8_e4m3fn).float()
    ulp = e4m3_ulp(x)
    t = x / ulp  # exact: division by a power of two
    lo = torch.floor(t)
    if noise is None:
        noise = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    q = (lo + (noise < (t - lo)).float()) * ulp
    return q.clamp(-E4M3_MAX, E4M3_MAX)


def fp8_row_scales(w: torch.Tensor) -> torch.Tensor:
    """float32 [rows, 1]: amax(row)/448, at least MIN_SCALE; an all-zero row gets scale 1 (its codes are all 0)."""
    amax = w.float().abs().amax(dim=-1, keepdim=True)
    # tensor / tensor: an IEEE division on every device (CUDA turns `/ python_scalar` into a reciprocal multiply)
    return torch.where(amax > 0, (amax / torch.full_like(amax, E4M3_MAX)).clamp_min(MIN_SCALE), torch.ones_like(amax))


def quantize_fp8_row(w: torch.Tensor, rounding: str = "rtn", generator: torch.Generator | None = None,
                     noise: torch.Tensor | None = None):
    """[rows, cols] float -> (codes float8_e4m3fn [rows, cols], scales float32 [rows, 1])."""
    if w.dim() != 2:
        raise ValueError(f"fp8_e4m3_row: weight must be 2-D [out, in], got shape {tuple(w.shape)}")
    check_finite(w)
    scales = fp8_row_scales(w)
    q = round_e4m3(w.float() / scales, rounding, generator, noise)
    return q.to(torch.float8_e4m3fn), scales


def dequantize_fp8_row(codes: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (codes.float() * scales).to(dtype)
