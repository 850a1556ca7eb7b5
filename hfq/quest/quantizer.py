"""QuESTHfQuantizer: swaps linear layers for QuESTLinear in from_pretrained; saves master weights or codes."""
from __future__ import annotations

import re

import torch
from torch import nn
from torch.distributed.tensor import DTensor


from .._base.checkpoint import checkpoint_index, converted_names, refuse_nonfinite, unguard_weight
from .._base.surgery import (HfqQuantizer, check_conversion, mark_quantized, modules_to_skip, refuse_quantized,
                             replace_linears, refuse_offloading)
from .config import QuESTConfig
from .linear import QuESTLinear, check_weight, layer_maker, warn_low_precision_master


class QuESTHfQuantizer(HfqQuantizer):
    """QAT on load: plain checkpoint + QuESTConfig -> master weights load straight into QuESTLinear layers.
    A checkpoint saved with save_format="codes" reloads into packed (inference) QuESTLinear layers."""

    quantization_config: QuESTConfig
    QUANT_METHOD = QuESTConfig.QUANT_METHOD
    signature = frozenset({"weight_codes", "weight_scale"})
    layer_types = (QuESTLinear,)
    qat_trainable = True
    compileable = True

    def __init__(self, quantization_config: QuESTConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.modules_to_not_convert: list[str] = []

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        return self.shape_may_differ(param_name)

    def validate_environment(self, *args, device_map=None, **kwargs):
        """A device_map that offloads (to "disk", or "cpu" beside accelerators) is refused: accelerate rebuilds an
        offloaded layer's weights at each forward, so QAT's gradients reach temporary copies (the offloaded layers
        would silently never train), and a master checkpoint's load guard is read from the file there."""
        super().validate_environment(*args, device_map=device_map, **kwargs)
        refuse_offloading(device_map, "QuEST (hfq_quest)", "QAT cannot update offloaded layers")

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        cfg = self.quantization_config
        self.modules_to_not_convert = modules_to_skip(model, cfg, cfg.ADD_DEFAULT_SKIPS)
        packed = self.pre_quantized and cfg.save_format == "codes"
        heads = {}
        if self.pre_quantized and checkpoint_files:
            index = checkpoint_index(checkpoint_files)
            self.check_checkpoint_method(index)
            # a master checkpoint stores a QuEST layer's `weight` as a dense one: only the save's record tells heads
            heads = self.heads_kept_dense(model, self.modules_to_not_convert, checkpoint_files, index,
                                          index_tells=packed)
        keep = [f"^{re.escape(n)}$" for n in heads]
        converted = replace_linears(model, layer_maker(cfg, packed=packed), [*self.modules_to_not_convert, *keep])
        self.conversion_report(model, converted, self.modules_to_not_convert, heads)
        if self.pre_quantized:
            self.expect_guard(model)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        self.refuse_unloaded(model, converted_names(model, self.layer_types))
        for name, mod in model.named_modules():  # the guarded master weight arrives as [1, out, in]
            if isinstance(mod, QuESTLinear) and not mod.packed and mod.weight.dim() == 3:
                mod.weight = nn.Parameter(unguard_weight(mod.weight.data, mod.out_features, mod.in_features),
                                          requires_grad=mod.weight.requires_grad)
            if (isinstance(mod, QuESTLinear) and not mod.packed and not self.pre_quantized
                    and mod.weight.device.type != "meta"):
                check_weight(mod.weight, f"{name}.weight")
        if self.pre_quantized:
            refuse_nonfinite("hfq_quest", model, self.layer_types)
        warn_low_precision_masters(model, stacklevel=3)
        return model

    def checkpoint_state(self, model):
        state = super().checkpoint_state(model)  # refuses FSDP2-sharded (DTensor) models with what to do instead
        if self.quantization_config.save_format != "codes":
            return state
        if any(isinstance(p, DTensor) for p in model.parameters()):
            raise ValueError("save_format='codes' of an FSDP2-sharded QuEST model: the codes are computed from whole "
                             "weights; save with save_format='master' (the default), then reload and save codes in "
                             "one process")
        owners: dict[int, list[str]] = {}
        for pname, p in model.named_parameters(remove_duplicate=False):
            owners.setdefault(id(p), []).append(pname)
        for name, mod in model.named_modules():
            if isinstance(mod, QuESTLinear) and not mod.packed and len(owners.get(id(mod.weight), ())) > 1:
                other = next(n for n in owners[id(mod.weight)] if n != f"{name}.weight")
                raise ValueError(
                    f"save_format='codes': {name}.weight is tied to {other} (tie_word_embeddings), which needs the "
                    f"full-precision tensor, so a codes checkpoint could not be loaded; save with "
                    f"save_format='master', or keep {name} unquantized (modules_to_not_convert)")
        for name, mod in model.named_modules():
            if isinstance(mod, QuESTLinear) and not mod.packed:
                prefix = f"{name}." if name else ""
                codes, scale = mod.export_codes(state.pop(prefix + "weight", None))  # a state_dict= given: its weight
                state[prefix + "weight_codes"] = codes
                state[prefix + "weight_scale"] = scale
        return state


def warn_low_precision_masters(model: torch.nn.Module, stacklevel: int = 2) -> None:
    """Warn when QuEST master weights are bf16/fp16: QAT steps below half their ulp are lost."""
    layers = [m for m in model.modules() if isinstance(m, QuESTLinear) and not m.packed]
    low = [m.weight.dtype for m in layers if m.weight.dtype in (torch.bfloat16, torch.float16)]
    if low:
        warn_low_precision_master(low[0], stacklevel=stacklevel + 1)
        for m in layers:  # said for these layers: their training forward stays quiet
            owner = m.__dict__.get("_hfq_owner")
            if owner is not None:
                owner.warned = True


def quantize_model(model: torch.nn.Module, config: QuESTConfig | None = None) -> torch.nn.Module:
    """Prepare an instantiated model (e.g. `AutoModelForCausalLM.from_config(...)` for pre-training) for
    QuEST QAT in place: linear layers become QuESTLinear sharing the existing parameters, and the model
    is marked quantized with `hfq_quest` so Trainer accepts it and save_pretrained writes an hfq checkpoint."""
    refuse_quantized(model, "quest.quantize_model")
    quantizer = QuESTHfQuantizer(config or QuESTConfig(), pre_quantized=False)
    config = quantizer.quantization_config
    quantizer.modules_to_not_convert = modules_to_skip(model, config, config.ADD_DEFAULT_SKIPS)
    converted = replace_linears(model, layer_maker(config, reuse=True), quantizer.modules_to_not_convert)
    report = check_conversion(config.quant_method, model, converted, quantizer.modules_to_not_convert,
                              strict=config.strict)
    if hasattr(model, "config"):
        mark_quantized(model, quantizer, report)
    warn_low_precision_masters(model)
    return model
