"""Module surgery: swap a model's decoder nn.Linear layers for QLinear (quantized now, or placeholders that a
pre-quantized checkpoint fills); with `QFTConfig(gradient_bits=8)` for QFTLinear, whose weight gradient is stored
as INT8 (QFT Algorithm 1) instead of a bf16 `.grad`."""
from __future__ import annotations

import torch
from torch import nn

from ..qparam import QLinear, QParam, qlinear

GRADIENT_BITS = (None, 8)


class QFTLinear(QLinear):
    """QLinear whose weight gradient goes to an INT8 store (read by hfq.qft.QLion) when gradient_bits == 8.

    Same state_dict as QLinear (codes + scales); `qft_name` (the module path) names the weight in errors."""

    def __init__(self, *args, gradient_bits: int | None = 8, **kwargs):
        super().__init__(*args, **kwargs)
        self.gradient_bits = check_gradient_bits(gradient_bits)
        self.qft_name = None

    @classmethod
    def from_linear(cls, linear, weight_format="int8_dense_sparse", rounding="rtn", generator=None,
                    gradient_bits: int | None = 8, **meta) -> "QFTLinear":
        out = super().from_linear(linear, weight_format, rounding, generator, **meta)
        out.gradient_bits = check_gradient_bits(gradient_bits)
        out.qft_name = None
        return out

    def forward(self, x):
        if self.gradient_bits == 8 and isinstance(self.weight, QParam) and torch.is_grad_enabled():
            name = self.qft_name + ".weight" if self.qft_name else None
            return qlinear(x, self.weight, self.bias, store_int8=True, name=name)
        return super().forward(x)

    def extra_repr(self):
        return super().extra_repr() + f", gradient_bits={self.gradient_bits}"


def check_gradient_bits(bits):
    """None (bf16 .grad, as autograd makes it) or 8 (INT8 store); anything else is a ValueError."""
    if bits is not None and (isinstance(bits, bool) or bits not in (8,)):
        raise ValueError(f"gradient_bits: expected one of {GRADIENT_BITS}, got {bits!r}")
    return bits


def is_skipped(name: str, skip) -> bool:
    """A module is skipped when its name equals an entry or ends with '.' + entry."""
    return any(name == s or name.endswith("." + s) for s in (skip or ()))


def convert_linears_(model: nn.Module, config, placeholder: bool = False, generator=None) -> list[str]:
    """Replace eligible nn.Linear modules in place; returns the converted names."""
    done = []
    bits = getattr(config, "gradient_bits", None)
    cls, extra = (QLinear, {}) if bits is None else (QFTLinear, {"gradient_bits": bits})
    for name, mod in list(model.named_modules()):
        if type(mod) is not nn.Linear or is_skipped(name, config.modules_to_not_convert):
            continue
        if placeholder:
            new = cls(mod.in_features, mod.out_features, mod.bias is not None, config.weight_format,
                      device=mod.weight.device, dtype=mod.weight.dtype, placeholder=True,
                      **extra, **config.format_options)
        else:
            new = cls.from_linear(mod, config.weight_format, config.rounding, generator, **extra,
                                  **config.format_options)
        if cls is QFTLinear:
            new.qft_name = name
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        done.append(name)
    return done


def finalize_(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, QLinear):
            m.finalize()


def quantize_model_(model: nn.Module, config) -> list[str]:
    """Quantize an already-built model (e.g. from_config for pretraining) in place per a QFTConfig."""
    names = convert_linears_(model, config)
    if hasattr(model, "config"):
        model.config.quantization_config = config
    return names
