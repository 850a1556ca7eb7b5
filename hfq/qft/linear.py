"""Module surgery: swap a model's decoder nn.Linear layers for QLinear (quantized now, or placeholders that a
pre-quantized checkpoint fills); with `QFTConfig(gradient_bits=8)` for QFTLinear, whose weight gradient is stored
as INT8 (QFT Algorithm 1) instead of a bf16 `.grad`."""
from __future__ import annotations

import zlib

import torch
from torch import nn

from hfq_kernels.reference.fp8 import check_finite

from .._base.surgery import modules_to_skip, replace_linears
from ..qparam import QLinear, QParam, qlinear
from .config import check_gradient_bits


class QFTLinear(QLinear):
    """QLinear whose weight gradient goes to an INT8 store (read by hfq.qft.QLion) when gradient_bits == 8.

    Same state_dict as QLinear (codes + scales); errors name the weight by its QParam's `place.name`."""

    def __init__(self, *args, gradient_bits: int | None = 8, **kwargs):
        super().__init__(*args, **kwargs)
        self.gradient_bits = check_gradient_bits(gradient_bits)

    @classmethod
    def from_linear(cls, linear, weight_format="int8_dense_sparse", rounding="rtn", generator=None,
                    gradient_bits: int | None = 8, **meta) -> "QFTLinear":
        out = super().from_linear(linear, weight_format, rounding, generator, **meta)
        out.gradient_bits = check_gradient_bits(gradient_bits)
        return out

    def forward(self, x):
        if self.gradient_bits == 8 and isinstance(self.weight, QParam) and torch.is_grad_enabled():
            return _int8_grad_linear(x, self.weight, self.bias)
        return super().forward(x)

    def extra_repr(self):
        return super().extra_repr() + f", gradient_bits={self.gradient_bits}"


@torch.compiler.disable
def _int8_grad_linear(x, w, b):
    """qlinear with the INT8 gradient store, run eagerly under torch.compile: its backward writes the weight's
    Int8Grad (a tensor subclass built outside any graph), so Dynamo would break the graph there and compile the
    Function once per layer shape."""
    return qlinear(x, w, b, store_int8=True)


def layer_maker(config, placeholder: bool = False, generator=None):
    """The surgery's builder: a QLinear (QFTLinear with gradient_bits=8) quantized from the linear now, or with
    `placeholder` one whose codes/scales buffers a pre-quantized checkpoint fills (then `finalize_`). Stochastic
    rounding draws from `generator`, else from one per layer seeded by torch.initial_seed() and the layer's name: the
    codes follow the run's seed, not the order of loading or of other draws, and torch's random stream is left
    where it was."""
    bits = config.gradient_bits
    cls, extra = (QLinear, {}) if bits is None else (QFTLinear, {"gradient_bits": bits})
    seed = torch.initial_seed()

    def make(name: str, mod) -> QLinear:
        if placeholder:
            new = cls(mod.in_features, mod.out_features, mod.bias is not None, config.weight_format,
                      device=mod.weight.device, dtype=mod.weight.dtype, placeholder=True,
                      **extra, **config.format_options)
        else:
            check_finite(mod.weight.detach(), f"{name}.weight")
            g = generator
            if g is None and config.rounding == "sr":
                g = torch.Generator(device=mod.weight.device)
                g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))
            new = cls.from_linear(mod, config.weight_format, config.rounding, g, **extra, **config.format_options)
        return new

    return make


def convert_linears_(model: nn.Module, config, placeholder: bool = False, generator=None,
                     keep: list[str] = ()) -> list[str]:
    """Replace the nn.Linear modules that `config` converts (but those named in `keep`), in place; returns the
    converted names."""
    skip = modules_to_skip(model, config, False)
    return replace_linears(model, layer_maker(config, placeholder, generator), [*(skip or []), *keep])



def finalize_(model: nn.Module) -> None:
    for name, m in model.named_modules():
        if isinstance(m, QLinear):
            m.finalize(name)


@torch.no_grad()
def refresh_outliers_(model: nn.Module) -> int:
    """Re-select the outliers of every int8_dense_sparse weight of `model` now (QFT App. C), outside an optimizer
    step (e.g. at an epoch boundary): thresholds re-set to the outlier_fraction tails of the current weight, which
    is re-split and re-quantized (round to nearest: each element moves by at most half an INT8 step of its row,
    the larger of the old and the new step).
    The optimizers do this themselves every QFTConfig.outlier_refresh_steps steps. Returns the number refreshed."""
    n = 0
    for p in model.parameters():
        if isinstance(p, QParam) and p.fmt == "int8_dense_sparse":
            p.requantize_(p.dequantize(torch.float32), "rtn", refresh_thresholds=True)
            n += 1
    return n
