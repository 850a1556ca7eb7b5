"""`NVFP4HfQuantizer`: transformers' hook for `hfq_nvfp4` (quantize while loading; reload pre-quantized)."""
from __future__ import annotations

import re

import torch
from torch import nn

from .._base.lora import dense_linear
from .._base.checkpoint import checkpoint_index, raise_load_errors, refuse_nonfinite
from .._base.surgery import HfqQuantizer, QuantizeOnLoad, modules_to_skip, replace_linears
from .config import NVFP4Config
from .linear import NVFP4Linear, mark_ddp_ignore


def _make_layer(config: NVFP4Config, placeholder: bool, skipped: dict[str, str]):
    """The surgery's builder: an NVFP4Linear for `linear`, or None (recorded in `skipped`) when its
    in_features is not a multiple of the block. With `placeholder`, the new layer gets an empty `weight`
    parameter on the meta device so the loader routes the checkpoint's weight to our quantize op."""

    def make(name: str, mod: nn.Linear):
        if mod.in_features % config.block_size:
            msg = f"in_features={mod.in_features} not a multiple of block size {config.block_size}"
            if config.strict:
                raise ValueError(f"{name}: {msg} (strict=True)")
            skipped[name] = msg
            return None
        new = NVFP4Linear(mod.in_features, mod.out_features, mod.bias is not None, config.format,
                          config.torch_compute_dtype, device=mod.weight.device, dtype=mod.weight.dtype)
        new.scale_rule = config.scales
        if placeholder:
            new._parameters["weight"] = nn.Parameter(
                torch.empty(mod.out_features, mod.in_features, dtype=mod.weight.dtype, device="meta"),
                requires_grad=False)
        return new

    return make


class NVFP4Quantize(QuantizeOnLoad):
    """Loader op: receives one layer's full-precision weight and returns its packed buffers."""

    def quantize(self, model, name, module, value):
        module.set_weight(value, name=name, canonical=True)  # read out below; the post-load pass converts once
        w32 = value.float()
        deq = module.dequantize(torch.float32)
        self.hf_quantizer.rel_error[name] = float((deq - w32).norm() / w32.norm().clamp_min(1e-30))
        del module._parameters["weight"]
        out = {f"{name}.weight_packed": module.weight_packed, f"{name}.weight_scale": module.weight_scale}
        if module.weight_global_scale is not None:
            out[f"{name}.weight_global_scale"] = module.weight_global_scale
        return out


class NVFP4HfQuantizer(HfqQuantizer):
    """Declarative quantizer: which linears become NVFP4Linear, and how their weights get there."""

    quantization_config: NVFP4Config
    QUANT_METHOD = NVFP4Config.QUANT_METHOD
    signature = frozenset({"weight_packed"})
    layer_types = (NVFP4Linear,)
    compileable = True
    calibrated = False  # the codes came from GPTQ (calibrate_): no quantization_config rebuilds them at load

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.errors: dict[str, str] = {}
        self.rel_error: dict[str, float] = {}
        self.skipped: dict[str, str] = {}
        self.converted: list[str] = []

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
        cfg = self.quantization_config
        skip = modules_to_skip(model, cfg, cfg.ADD_DEFAULT_SKIPS)
        heads = {}
        if self.pre_quantized and checkpoint_files:
            index = checkpoint_index(checkpoint_files)
            self.check_checkpoint_method(index)
            heads = self.heads_kept_dense(model, skip, checkpoint_files, index)
        keep = [f"^{re.escape(n)}$" for n in heads]
        self.converted = replace_linears(model, _make_layer(cfg, not self.pre_quantized, self.skipped),
                                         [*skip, *keep], self.skipped)
        self.skipped.update(heads)
        self.conversion_report(model, self.converted, skip, self.skipped)
        if self.pre_quantized:
            self.expect_guard(model)
            if checkpoint_files:
                self._validate_checkpoint(model, index)

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
                if key in index and index[key] != (want_dt, tuple(ref.shape)):
                    problems.append(f"{key}: got {index[key][0]}{list(index[key][1])}, "
                                    f"expected {want_dt}{list(ref.shape)}")
        if problems:
            head = "; ".join(problems[:20]) + (f"; ... ({len(problems)} in all)" if len(problems) > 20 else "")
            raise ValueError(f"hfq_nvfp4 checkpoint has quantized tensors of other dtypes or shapes than this model's "
                             f"layers: {head}")

    def _process_model_after_weight_loading(self, model, **kwargs):
        raise_load_errors("NVFP4", self.errors)
        if self.pre_quantized:  # keys are judged after transformers' renames (Llava, key_mapping=)
            self.refuse_unloaded(model, self.converted)
            self._check_loaded_scales(model)
        else:
            self.refuse_weightless(model, [n for n in self.converted if "weight" in model.get_submodule(n)._parameters],
                                   "NVFP4")
        model.hfq_quantization_report["rel_error"] = dict(self.rel_error)
        for name in self.converted:  # where the Gluon kernel runs: its layout only, no second copy
            mod = model.get_submodule(name)
            if mod.g4_wanted(mod.qweight.device):
                mod.to_g4_layout_()
        mark_ddp_ignore(model)
        return model

    def _check_loaded_scales(self, model) -> None:
        """Loaded scales must decode: no NaN/Inf (refuse_nonfinite: E4M3 block scales, the global scale), no MXFP4
        E8M0 NaN byte 0xFF, and a positive global scale (the dequantize divides by it: 0 gives Inf weights)."""
        refuse_nonfinite("hfq_nvfp4", model, self.layer_types)
        bad = []
        for name in self.converted:
            mod = model.get_submodule(name)
            gs = mod.weight_global_scale
            if gs is not None and gs.device.type != "meta" and not bool((gs > 0).all()):
                bad.append(f"{name}.weight_global_scale = {gs.flatten()[0].item()}")
            if mod.format == "mxfp4" and mod.weight_scale.device.type != "meta" and bool((mod.weight_scale == 0xFF).any()):
                bad.append(f"{name}.weight_scale (E8M0 NaN byte 0xFF)")
        if bad:
            raise ValueError(f"hfq_nvfp4 checkpoint has scales that do not decode in {len(bad)} layer(s): "
                             f"{'; '.join(bad[:5])}: the file is corrupt (global scales are finite and > 0)")

    def after_adapter_save(self, model, save_directory):
        """An adapter saved through transformers' integration records its NVFP4 base as PeftModel's does."""
        from .peft_lora import record_base

        record_base(model, [save_directory])

    def dequantize(self, model, dtype=None):
        """model.dequantize(): without a dtype, the one the model's other layers have now (transformers would take
        config.dtype, which model.to(dtype) leaves as it was loaded)."""
        rest = {p.dtype for p in model.parameters() if p.is_floating_point()}
        if dtype is None and len(rest) == 1:
            dtype = rest.pop()
        return super().dequantize(model, dtype=dtype)

    def _dequantize(self, model, dtype=None):
        if isinstance(dtype, str):  # save_pretrained writes config.dtype back as its name
            dtype = getattr(torch, dtype)
        dtype = dtype or torch.bfloat16
        rest = {p.dtype for p in model.parameters() if p.is_floating_point()}
        if rest and dtype not in rest:
            raise ValueError(f"model.dequantize(dtype={dtype}): the model's other layers are "
                             f"{', '.join(sorted(str(d) for d in rest))}, and a model of mixed dtypes fails in its "
                             "forward; call model.dequantize() (it takes their dtype when they have one), then "
                             "model.to(dtype)")
        peft_base = any(hasattr(m, "base_layer") for m in model.modules())  # PEFT froze the base model
        for name, mod in list(model.named_modules()):
            if isinstance(mod, NVFP4Linear):
                # trainable as a dense checkpoint's layers load, frozen as the rest of a PEFT base model
                trainable = mod.bias.requires_grad if mod.bias is not None else not peft_base
                lin = dense_linear(mod.dequantize(dtype), mod.bias, dtype).requires_grad_(trainable)
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, lin)
        return model

    def get_quantize_ops(self):
        return NVFP4Quantize(self)
