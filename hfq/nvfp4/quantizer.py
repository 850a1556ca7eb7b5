"""`NVFP4HfQuantizer`: transformers' hook for `hfq_nvfp4` (quantize while loading; reload pre-quantized)."""
from __future__ import annotations

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.base import HfQuantizer

from .._base.lora import dense_linear
from .config import NVFP4Config
from .linear import NVFP4Linear, mark_ddp_ignore


def is_skipped(name: str, skip: list[str]) -> bool:
    """A module is skipped when its name equals an entry or ends with '.' + entry."""
    return any(name == s or name.endswith("." + s) for s in skip)


def replace_linears(model: nn.Module, config: NVFP4Config, skip: list[str], placeholder: bool,
                    skipped: dict[str, str]) -> list[str]:
    """Swap eligible nn.Linear modules for NVFP4Linear in place; returns the converted names.

    With `placeholder`, each new layer gets an empty `weight` parameter on the meta device so the loader
    routes the checkpoint's weight to our quantize op.
    """
    converted = []
    cd = config.torch_compute_dtype
    for name, mod in list(model.named_modules()):
        if type(mod) is not nn.Linear:
            continue
        if is_skipped(name, skip):
            skipped[name] = "modules_to_not_convert"
            continue
        if mod.in_features % config.block_size:
            msg = f"in_features={mod.in_features} not a multiple of block size {config.block_size}"
            if config.strict:
                raise ValueError(f"{name}: {msg} (strict=True)")
            skipped[name] = msg
            continue
        dev = mod.weight.device
        new = NVFP4Linear(mod.in_features, mod.out_features, mod.bias is not None, config.format, cd,
                          device=dev, dtype=mod.weight.dtype)
        if placeholder:
            new._parameters["weight"] = nn.Parameter(
                torch.empty(mod.out_features, mod.in_features, dtype=mod.weight.dtype, device="meta"),
                requires_grad=False)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        converted.append(name)
    return converted


class NVFP4Quantize(ConversionOps):
    """Loader op: receives one layer's full-precision weight and returns its packed buffers."""

    def __init__(self, hf_quantizer: "NVFP4HfQuantizer"):
        self.hf_quantizer = hf_quantizer

    @torch.no_grad()
    def convert(self, input_dict, model=None, missing_keys=None, **kwargs):
        key, value = next(iter(input_dict.items()))
        value = value[0] if isinstance(value, list) else value
        name = key.rsplit(".", 1)[0]
        module = model.get_submodule(name)
        if missing_keys is not None:
            missing_keys.discard(key)
        try:
            module.set_weight(value, name=name)
        except ValueError as e:
            # transformers turns op exceptions into a generic RuntimeError; keep ours (it names the layer)
            # and raise it from _process_model_after_weight_loading instead.
            self.hf_quantizer.errors[name] = str(e)
            return {}
        w32 = value.float()
        deq = module.dequantize(torch.float32)
        self.hf_quantizer.rel_error[name] = float((deq - w32).norm() / w32.norm().clamp_min(1e-30))
        del module._parameters["weight"]
        out = {f"{name}.weight_packed": module.weight_packed, f"{name}.weight_scale": module.weight_scale}
        if module.weight_global_scale is not None:
            out[f"{name}.weight_global_scale"] = module.weight_global_scale
        return out


def _checkpoint_index(files) -> dict[str, tuple[str, tuple]]:
    from safetensors import safe_open

    index = {}
    for f in files or []:
        if not str(f).endswith(".safetensors"):
            raise ValueError(f"{f}: hfq checkpoints are safetensors only (pickle is never loaded)")
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                index[k] = (sl.get_dtype(), tuple(sl.get_shape()))
    return index


class NVFP4HfQuantizer(HfQuantizer):
    """Declarative quantizer: which linears become NVFP4Linear, and how their weights get there."""

    requires_calibration = False
    quantization_config: NVFP4Config

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.errors: dict[str, str] = {}
        self.rel_error: dict[str, float] = {}
        self.skipped: dict[str, str] = {}
        self.converted: list[str] = []

    def validate_environment(self, *args, **kwargs):
        return

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        name, _, tensor = param_name.rpartition(".")
        if tensor != "weight":
            return False
        try:
            return isinstance(model.get_submodule(name), NVFP4Linear)
        except AttributeError:
            return False

    def param_element_size(self, model, param_name, param):
        return 0.5625 if self.param_needs_quantization(model, param_name) else super().param_element_size(
            model, param_name, param)

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        skip = self.get_modules_to_not_convert(model, self.quantization_config.modules_to_not_convert,
                                               getattr(model, "_keep_in_fp32_modules", None), add_default_skips=True)
        self.converted = replace_linears(model, self.quantization_config, skip, not self.pre_quantized, self.skipped)
        if self.pre_quantized and checkpoint_files:
            self._validate_checkpoint(model, _checkpoint_index(checkpoint_files))

    def _validate_checkpoint(self, model, index):
        problems = []
        for name in self.converted:
            mod = model.get_submodule(name)
            for buf in ("weight_packed", "weight_scale", "weight_global_scale"):
                ref = getattr(mod, buf)
                if ref is None:
                    continue
                key = f"{name}.{buf}"
                want_dt = {torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32"}[ref.dtype]
                if key not in index:
                    problems.append(f"{key}: missing")
                elif index[key] != (want_dt, tuple(ref.shape)):
                    problems.append(f"{key}: got {index[key][0]}{list(index[key][1])}, "
                                    f"expected {want_dt}{list(ref.shape)}")
        if problems:
            head = "; ".join(problems[:20]) + (f"; ... ({len(problems)} in all)" if len(problems) > 20 else "")
            raise ValueError(f"hfq_nvfp4 checkpoint is missing or has corrupt quantized tensors: {head}")

    def _process_model_after_weight_loading(self, model, **kwargs):
        if self.errors:
            lines = "; ".join(f"{k}: {v}" for k, v in self.errors.items())
            raise ValueError(f"NVFP4 quantization failed for {len(self.errors)} layer(s): {lines}")
        leftover = [n for n in self.converted if "weight" in model.get_submodule(n)._parameters]
        if leftover:
            raise ValueError(f"NVFP4: no weight was found in the checkpoint for {leftover[:10]}")
        model.hfq_quantization_report = {"quantized": list(self.converted), "skipped": dict(self.skipped),
                                         "rel_error": dict(self.rel_error)}
        mark_ddp_ignore(model)
        return model

    def _dequantize(self, model, dtype=None):
        dtype = dtype or torch.bfloat16
        for name, mod in list(model.named_modules()):
            if isinstance(mod, NVFP4Linear):
                lin = dense_linear(mod.dequantize(dtype), mod.bias, dtype)
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, lin)
        return model

    def get_quantize_ops(self):
        return NVFP4Quantize(self)

    def is_serializable(self, *args, **kwargs):
        return True

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_compileable(self) -> bool:
        return True
