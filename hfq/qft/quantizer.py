"""`QFTHfQuantizer`: transformers' hook for `hfq_qft`.

Fresh load (a float checkpoint): each eligible nn.Linear stays a meta placeholder; the loader hands its weight
to `QFTQuantize`, which quantizes it into a QLinear there and then (the float copy is dropped layer by layer, so
the full-precision model never exists). Pre-quantized load (an hfq_qft checkpoint): QLinear placeholders expose
`weight_codes`, `weight_scales`, ... buffers that the loader fills; they become the QParam afterwards.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.base import HfQuantizer

from .._base.surgery import GuardedCheckpoint, modules_to_skip, set_submodule, should_convert
from ..qparam import QLinear
from .config import QFTConfig
from .linear import convert_linears_, finalize_, layer_maker


class QFTQuantize(ConversionOps):
    """Loader op: receives one linear's full-precision weight and swaps the linear for its QLinear."""

    def __init__(self, hf_quantizer: "QFTHfQuantizer"):
        self.hf_quantizer = hf_quantizer

    @torch.no_grad()
    def convert(self, input_dict, model=None, missing_keys=None, **kwargs):
        key, value = next(iter(input_dict.items()))
        value = value[0] if isinstance(value, list) else value
        name = key.rsplit(".", 1)[0]
        lin = model.get_submodule(name)
        if missing_keys is not None:
            missing_keys.discard(key)
        make = layer_maker(self.hf_quantizer.quantization_config)
        try:
            new = make(name, SimpleNamespace(weight=nn.Parameter(value), bias=lin.bias))
        except ValueError as e:  # raised again, naming the layer, once loading is done
            self.hf_quantizer.errors[name] = str(e)
            return {}
        set_submodule(model, name, new)
        return {}


class QFTHfQuantizer(GuardedCheckpoint, HfQuantizer):
    requires_calibration = False
    quantization_config: QFTConfig
    layer_types = (QLinear,)

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.converted: list[str] = []
        self.errors: dict[str, str] = {}
        self._skip: list[str] = []

    def validate_environment(self, *args, **kwargs):
        return

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        name, _, tensor = param_name.rpartition(".")
        if tensor != "weight" or self.pre_quantized or not should_convert(name, self._skip):
            return False
        try:
            return type(model.get_submodule(name)) is nn.Linear
        except AttributeError:
            return False

    def _process_model_before_weight_loading(self, model, **kwargs):
        cfg = self.quantization_config
        self._skip = modules_to_skip(model, cfg, False)
        if self.pre_quantized:
            self.converted = convert_linears_(model, cfg, placeholder=True)
            self.expect_guard(model)
        return model

    def get_quantize_ops(self):
        return QFTQuantize(self)

    def _process_model_after_weight_loading(self, model, **kwargs):
        if self.errors:
            lines = "; ".join(f"{k}: {v}" for k, v in self.errors.items())
            raise ValueError(f"QFT quantization failed for {len(self.errors)} layer(s): {lines}")
        if self.pre_quantized:
            finalize_(model)
        else:
            left = [n for n, m in model.named_modules() if type(m) is nn.Linear and should_convert(n, self._skip)]
            if left:
                raise ValueError(f"QFT: no weight was found in the checkpoint for {left[:10]}")
            self.converted = [n for n, m in model.named_modules() if isinstance(m, QLinear)]
        return model

    def is_serializable(self, safe_serialization=None):
        return True

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_qat_trainable(self) -> bool:
        return True
