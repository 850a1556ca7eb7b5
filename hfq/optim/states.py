"""Optimizer-state storage: fp32, bf16, or blockwise 8-bit (own torch implementation, no bitsandbytes).

8-bit: blocks of `BLOCK` consecutive elements share one fp32 absmax. Values are companded before linear
rounding so small entries keep relative precision (the role of bitsandbytes' dynamic map):
  first moment (signed):  code = round(127 * sign(x) * sqrt(|x|/absmax)),  x = absmax * sign * (code/127)^2
  second moment (>= 0):   code = round(255 * (x/absmax)^(1/4)),           x = absmax * (code/255)^4
A first moment may instead be rounded stochastically between its two neighbouring codes (unbiased in x): ECO's
memory-free rule puts the quantization error into the momentum, entries ~1/lr times the gradient increments,
which round-to-nearest would drop step after step.
Bytes per element: 1 + 4/BLOCK.
bf16: a store given a generator rounds stochastically. ECOAdamW's second moment needs it: its per-step decay at
beta2 = 0.999 (0.1%) is below half a bf16 step (0.2-0.4%), so round-to-nearest gives the old value back and the
moment could only grow (updates too small once gradients shrink).
"""
from __future__ import annotations

import torch

from hfq_kernels.reference.intq import round_bf16

BLOCK = 2048
STATE_DTYPES = (torch.float32, torch.bfloat16)


def _blocks(x: torch.Tensor):
    flat = x.reshape(-1).float()
    pad = (-flat.numel()) % BLOCK
    if pad:
        flat = torch.cat((flat, flat.new_zeros(pad)))
    return flat.view(-1, BLOCK)


def encode8(x: torch.Tensor, signed: bool, generator: torch.Generator | None = None):
    """(codes, absmax) of x; a signed x with `generator` is rounded stochastically (see the module doc)."""
    b = _blocks(x)
    absmax = b.abs().amax(-1, keepdim=True)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    r = b.abs() / safe
    if signed and generator is not None:
        k = torch.floor(127 * r.sqrt()).clamp_(max=126)
        lo, hi = (k / 127) ** 2, ((k + 1) / 127) ** 2
        up = torch.rand(b.shape, generator=generator, device=b.device) < (r - lo) / (hi - lo)
        codes = (torch.sign(b) * (k + up)).to(torch.int8)
    elif signed:
        codes = (torch.sign(b) * torch.round(127 * r.sqrt())).to(torch.int8)
    else:
        codes = torch.round(255 * r.sqrt().sqrt()).to(torch.uint8)
    return codes.reshape(-1), absmax.reshape(-1)


def decode8(codes: torch.Tensor, absmax: torch.Tensor, shape, signed: bool) -> torch.Tensor:
    c = codes.float().view(-1, BLOCK)
    if signed:
        x = torch.sign(c) * (c.abs() / 127) ** 2
    else:
        x = (c / 255) ** 4
    n = 1
    for s in shape:
        n *= s
    return (x * absmax.view(-1, 1)).reshape(-1)[:n].reshape(shape)


class StateStore:
    """Reads/writes a named moment of one parameter's state dict in the configured precision."""

    def __init__(self, dtype: torch.dtype = torch.float32, bits: int | None = None):
        if bits not in (None, 8):
            raise ValueError(f"state_bits must be None or 8, got {bits!r}")
        if bits is None and dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {STATE_DTYPES}, got {dtype!r}")
        self.dtype, self.bits = dtype, bits
        self.stochastic_bf16 = bits is None and dtype == torch.bfloat16  # callers pass a generator where it matters

    def init(self, state: dict, name: str, like: torch.Tensor, signed: bool) -> None:
        if self.bits == 8:
            codes, absmax = encode8(torch.zeros(like.shape, device=like.device), signed)
            state[name + "_q8"], state[name + "_absmax"] = codes, absmax
        else:
            state[name] = torch.zeros(like.shape, dtype=self.dtype, device=like.device)

    def load(self, state: dict, name: str, shape, signed: bool) -> torch.Tensor:
        """An fp32 working copy (or the stored fp32 tensor itself)."""
        if self.bits == 8:
            return decode8(state[name + "_q8"], state[name + "_absmax"], shape, signed)
        t = state[name]
        return t if t.dtype == torch.float32 else t.float()

    def store(self, state: dict, name: str, value: torch.Tensor, signed: bool,
              generator: torch.Generator | None = None) -> None:
        """Write `value` back; given a `generator`, a bf16 moment or a signed 8-bit one is rounded stochastically."""
        if self.bits == 8:
            codes, absmax = encode8(value, signed, generator)
            state[name + "_q8"].copy_(codes)
            state[name + "_absmax"].copy_(absmax)
        elif generator is not None and state[name].dtype == torch.bfloat16:
            state[name].copy_(round_bf16(value, "sr", generator))
        elif state[name] is not value:
            state[name].copy_(value)

    def bytes_per_element(self) -> float:
        return 1 + 4 / BLOCK if self.bits == 8 else torch.empty(0, dtype=self.dtype).element_size()
