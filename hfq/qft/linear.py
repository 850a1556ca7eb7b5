"""Module surgery: swap a model's decoder nn.Linear layers for QLinear (quantized now, or placeholders that a
pre-quantized checkpoint fills)."""
from __future__ import annotations

from torch import nn

from ..qparam import QLinear


def is_skipped(name: str, skip) -> bool:
    """A module is skipped when its name equals an entry or ends with '.' + entry."""
    return any(name == s or name.endswith("." + s) for s in (skip or ()))


def convert_linears_(model: nn.Module, config, placeholder: bool = False, generator=None) -> list[str]:
    """Replace eligible nn.Linear modules in place; returns the converted names."""
    done = []
    for name, mod in list(model.named_modules()):
        if type(mod) is not nn.Linear or is_skipped(name, config.modules_to_not_convert):
            continue
        if placeholder:
            new = QLinear(mod.in_features, mod.out_features, mod.bias is not None, config.weight_format,
                          device=mod.weight.device, dtype=mod.weight.dtype, placeholder=True,
                          **config.format_options)
        else:
            new = QLinear.from_linear(mod, config.weight_format, config.rounding, generator, **config.format_options)
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
