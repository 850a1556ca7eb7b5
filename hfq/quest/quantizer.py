"""QuESTHfQuantizer: swaps linear layers for QuESTLinear in from_pretrained; saves codes + scales."""
from __future__ import annotations

import torch
from transformers.quantizers.base import HfQuantizer

from .config import QuESTConfig
from .linear import QuESTLinear, replace_linears


class QuESTHfQuantizer(HfQuantizer):
    """QAT on load: plain checkpoint + QuESTConfig -> master weights load into QuESTLinear layers.
    A checkpoint saved with save_format="codes" reloads into packed (inference) QuESTLinear layers."""

    requires_calibration = False
    quantization_config: QuESTConfig

    def __init__(self, quantization_config: QuESTConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.modules_to_not_convert: list[str] = []

    def _skip_list(self, model) -> list[str]:
        cfg = self.quantization_config
        return self.get_modules_to_not_convert(model, cfg.modules_to_not_convert,
                                               getattr(model, "_keep_in_fp32_modules", None),
                                               add_default_skips=cfg.modules_to_not_convert is None)

    def _process_model_before_weight_loading(self, model, **kwargs):
        self.modules_to_not_convert = self._skip_list(model)
        packed = self.pre_quantized and self.quantization_config.save_format == "codes"
        replace_linears(model, self.quantization_config, self.modules_to_not_convert, packed=packed)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        return model

    def get_state_dict_and_metadata(self, model):
        if self.quantization_config.save_format != "codes":
            return None, {}
        state = model.state_dict()
        for name, mod in model.named_modules():
            if isinstance(mod, QuESTLinear) and not mod.packed:
                prefix = f"{name}." if name else ""
                state.pop(prefix + "weight", None)
                codes, scale = mod.export_codes()
                state[prefix + "weight_codes"] = codes
                state[prefix + "weight_scale"] = scale
        return state, {}

    def is_serializable(self, **kwargs):
        return True

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_qat_trainable(self) -> bool:
        return True

    @property
    def is_compileable(self) -> bool:
        return True


def quantize_model(model: torch.nn.Module, config: QuESTConfig | None = None) -> torch.nn.Module:
    """Prepare an instantiated model (e.g. `AutoModelForCausalLM.from_config(...)` for pre-training) for
    QuEST QAT in place: linear layers become QuESTLinear sharing the existing parameters, and the model
    is marked quantized with `hfq_quest` so Trainer accepts it and save_pretrained stores codes."""
    config = config or QuESTConfig()
    quantizer = QuESTHfQuantizer(config, pre_quantized=False)
    skip = quantizer._skip_list(model) if hasattr(model, "get_output_embeddings") else (
        config.modules_to_not_convert or [])
    quantizer.modules_to_not_convert = skip
    replace_linears(model, config, skip, reuse=True)
    if hasattr(model, "config"):
        model.config.quantization_config = config
        model.hf_quantizer = quantizer
        model.is_quantized = True
        model.quantization_method = config.quant_method
    return model


prepare_for_qat = quantize_model
