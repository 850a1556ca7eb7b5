"""QFT's uniform INT8 quantizer for gradients and momentum (paper eq. 1-2, channel-wise, Sec. 4.1).

Asymmetric min-max per row: s = (max - min) / 255, z = round(-min / s), code = clamp(round(x / s) + z, 0, 255),
value = (code - z) * s; the range is widened to contain 0, so 0 is exact (a zero momentum stays zero).
Codes are uint8 (the paper's INT8 with a zero point), one fp32 scale and one uint8 zero point per row.

Same formulas as `hfq_kernels.reference.intq.quantize_int_asym` (the weights' dense part), but without its finiteness
check: that check reads the tensor back to the host, once per layer per backward on a GPU; here non-finite
inputs are reported through a device flag (`finite`) that the optimizer reads once per step.
Rows: a tensor of shape [d0, d1, ...] uses d0 rows of prod(d1, ...) values; 0-D/1-D tensors are one row.
"""
from __future__ import annotations

import torch

from hfq_kernels.reference.intq import round_int

QMAX = 255


def as_rows(shape) -> tuple[int, int]:
    """The [rows, cols] view used for channel-wise scales: rows = first dim (1 for 0-D/1-D tensors)."""
    shape = tuple(shape)
    if len(shape) <= 1:
        return 1, (shape[0] if shape else 1)
    n = 1
    for s in shape[1:]:
        n *= s
    return shape[0], n


def quantize_rows(x: torch.Tensor, rounding: str = "rtn", generator: torch.Generator | None = None):
    """x (any shape, finite) -> (codes uint8 [rows, cols], scales fp32 [rows, 1], zeros uint8 [rows, 1])."""
    r = x.detach().float().reshape(as_rows(x.shape))
    lo = r.amin(-1, keepdim=True).clamp_max(0)
    hi = r.amax(-1, keepdim=True).clamp_min(0)
    scales = torch.where(hi > lo, (hi - lo) / QMAX, torch.ones_like(hi))
    zeros = torch.round(-lo / scales).clamp(0, QMAX)
    q = (round_int(r / scales, rounding, generator) + zeros).clamp(0, QMAX)
    return q.to(torch.uint8), scales, zeros.to(torch.uint8)


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, shape,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_rows, reshaped to the logical `shape`."""
    return ((codes.float() - zeros.float()) * scales).reshape(shape).to(dtype)


def max_error(scales: torch.Tensor, shape) -> torch.Tensor:
    """Round-to-nearest error bound per element: half a step of its row (broadcast to `shape`)."""
    rows, cols = as_rows(shape)
    return (scales / 2).expand(rows, cols).reshape(shape)


class Int8Grad:
    """A weight gradient stored as INT8 codes + per-row scale/zero point (QFT Algorithm 1: 'store as INT8').

    `add_(g)` accumulates (gradient accumulation: dequantize, add, requantize), `finite` is a device bool that
    turns False if any added gradient had NaN/Inf (the value is then unusable; the optimizer refuses the step).
    `name` is the parameter's module path when known, for error messages."""

    __slots__ = ("shape", "codes", "scales", "zeros", "finite", "count", "name")

    def __init__(self, g: torch.Tensor, name: str | None = None):
        self.shape = tuple(g.shape)
        self.name = name
        self.count = 0
        self.codes = self.scales = self.zeros = None
        self.finite = torch.ones((), dtype=torch.bool, device=g.device)
        self.add_(g)

    @torch.no_grad()
    def add_(self, g: torch.Tensor) -> "Int8Grad":
        if tuple(g.shape) != self.shape:
            raise ValueError(f"Int8Grad: gradient shape {tuple(g.shape)} != {self.shape}")
        ok = torch.isfinite(g).all()
        self.finite &= ok
        g = torch.nan_to_num(g.float(), nan=0.0, posinf=0.0, neginf=0.0)
        if self.count:
            g = g + self.dequantize()
        self.codes, self.scales, self.zeros = quantize_rows(g)
        self.count += 1
        return self

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_rows(self.codes, self.scales, self.zeros, self.shape, dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.zeros))


_ATTR = "_hfq_int8_grad"


def int8_grad(p: torch.Tensor) -> Int8Grad | None:
    """The INT8 gradient stored for parameter `p` (None if none is pending)."""
    return getattr(p, _ATTR, None)


def accumulate_int8_grad_(p: torch.Tensor, g: torch.Tensor, name: str | None = None) -> Int8Grad:
    """Add a float weight gradient to p's INT8 store (creating it); the float `g` can be freed right after."""
    cur = int8_grad(p)
    if cur is None:
        cur = Int8Grad(g, name)
        setattr(p, _ATTR, cur)
    else:
        cur.add_(g)
    return cur


def pop_int8_grad(p: torch.Tensor) -> Int8Grad | None:
    """Take p's INT8 gradient out of the store (the optimizer consumes it, like the paper's stack pop)."""
    cur = int8_grad(p)
    if cur is not None:
        delattr(p, _ATTR)
    return cur


def clear_int8_grads_(params) -> int:
    """Drop pending INT8 gradients of `params` (what zero_grad does for .grad); returns how many were dropped."""
    n = 0
    for p in params:
        if pop_int8_grad(p) is not None:
            n += 1
    return n
