"""`QFTHfQuantizer`: transformers' hook for `hfq_qft`.

Fresh load (a float checkpoint): weights load into ordinary nn.Linear, then each eligible one is quantized
into a QLinear (the float copy is dropped). Pre-quantized load (an hfq_qft checkpoint): QLinear placeholders
expose `weight_codes`, `weight_scales`, ... buffers that the loader fills; they become the QParam afterwards.
"""
from __future__ import annotations

from transformers.quantizers.base import HfQuantizer

from .config import QFTConfig
from .linear import convert_linears_, finalize_


class QFTHfQuantizer(HfQuantizer):
    requires_calibration = False
    quantization_config: QFTConfig

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.converted: list[str] = []

    def validate_environment(self, *args, **kwargs):
        return

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        return False

    def _process_model_before_weight_loading(self, model, **kwargs):
        if self.pre_quantized:
            self.converted = convert_linears_(model, self.quantization_config, placeholder=True)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        if self.pre_quantized:
            finalize_(model)
        else:
            self.converted = convert_linears_(model, self.quantization_config)
        return model

    def is_serializable(self, safe_serialization=None):
        return True

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_qat_trainable(self) -> bool:
        return True
