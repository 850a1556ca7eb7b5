"""LoRA on NVFP4Linear through PEFT's custom-module API (`LoraConfig._register_custom_module`).

PEFT 0.21 has no global dispatcher registry: a LoRA config learns about a layer type through
`_register_custom_module`. `register_lora(config)` does that; `hfq.nvfp4.get_peft_model` and
`QeRLGRPOTrainer` call it for you.
"""
from __future__ import annotations

import warnings

import torch
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import check_adapters_to_merge
from torch import nn

from .linear import NVFP4Linear


class NVFP4LoraLinear(nn.Module, LoraLayer):
    """LoRA adapters beside a frozen NVFP4Linear: y = base(x) + B(A(dropout(x))) * scaling.

    merge() swaps the base for a dense nn.Linear holding dequant(W) + BA (the NVFP4 base is kept for an exact
    unmerge), so PEFT's `merge_and_unload()` yields a dense model; see `merge_and_requantize` for an NVFP4 one.
    """

    def __init__(self, base_layer: nn.Module, adapter_name: str, config, r: int = 0, lora_alpha: int = 1, **kwargs):
        super().__init__()
        LoraLayer.__init__(self, base_layer)
        self.fan_in_fan_out = False
        self._active_adapter = adapter_name
        self._nvfp4_base = None  # the quantized base while merged
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config)

    def _get_in_out_features(self, module):
        if isinstance(module, NVFP4Linear):
            return module.in_features, module.out_features
        return super()._get_in_out_features(module)

    def resolve_lora_variant(self, *, config, **kwargs):
        if getattr(config, "use_dora", False) or getattr(config, "alora_invocation_tokens", None) is not None:
            raise ValueError("NVFP4LoraLinear supports plain LoRA only (use_dora / aLoRA are not supported)")
        return None

    def _get_base_layer_device_and_dtype(self, base_layer):
        if isinstance(base_layer, NVFP4Linear):
            dtype = base_layer.compute_dtype
            if dtype is None and base_layer.bias is not None:
                dtype = base_layer.bias.dtype
            return base_layer.weight_packed.device, dtype
        return super()._get_base_layer_device_and_dtype(base_layer)

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        a, b = self.lora_A[adapter].weight, self.lora_B[adapter].weight
        return (b.float() @ a.float()) * self.scaling[adapter]

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        adapter_names = check_adapters_to_merge(self, adapter_names)
        if not adapter_names:
            return
        base = self.get_base_layer()
        if isinstance(base, NVFP4Linear):
            dtype = base.compute_dtype or (base.bias.dtype if base.bias is not None else torch.bfloat16)
            dense = nn.Linear(base.in_features, base.out_features, base.bias is not None,
                              device=base.weight_packed.device, dtype=dtype)
            dense.weight.data = base.dequantize(torch.float32)
            if base.bias is not None:
                dense.bias.data = base.bias.data.to(dtype).clone()
            dense.requires_grad_(False)
            self._nvfp4_base = base
            self.base_layer = dense
            base = dense
        w = base.weight.data.float()
        for name in adapter_names:
            if name in self.lora_A:
                w = w + self.get_delta_weight(name)
                if self.lora_bias[name]:
                    base.bias.data += self.lora_B[name].bias.to(base.bias.dtype)
                self.merged_adapters.append(name)
        if safe_merge and not torch.isfinite(w).all():
            raise ValueError(f"NaN/Inf in the merged weight of adapters {adapter_names}")
        base.weight.data = w.to(base.weight.dtype)

    def unmerge(self) -> None:
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
            return
        for name in self.merged_adapters:
            if self.lora_bias.get(name) and self._nvfp4_base is None:
                self.base_layer.bias.data -= self.lora_B[name].bias
        self.merged_adapters.clear()
        if self._nvfp4_base is not None:  # exact: the codes were never touched
            self.base_layer, self._nvfp4_base = self._nvfp4_base, None

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        result = self.base_layer(x, *args, **kwargs)
        if self.merged:
            return result
        for name in self.active_adapters:
            if name not in self.lora_A:
                continue
            lora_a, lora_b = self.lora_A[name], self.lora_B[name]
            xa = x.to(lora_a.weight.dtype)
            result = result + (lora_b(lora_a(self.lora_dropout[name](xa))) * self.scaling[name]).to(result.dtype)
        return result

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


def register_lora(lora_config):
    """Teach a peft.LoraConfig to wrap NVFP4Linear with NVFP4LoraLinear; returns the config."""
    lora_config._register_custom_module({NVFP4Linear: NVFP4LoraLinear})
    return lora_config


def get_peft_model(model, lora_config, **kwargs):
    """peft.get_peft_model with hfq's NVFP4 LoRA layer registered on the config."""
    import peft

    from .linear import mark_ddp_ignore

    pm = peft.get_peft_model(model, register_lora(lora_config), **kwargs)
    mark_ddp_ignore(pm)  # DDP must not broadcast the frozen codes (names now carry PEFT's prefix)
    return pm


def register_peft_dispatch() -> None:
    """Called on `import hfq`. PEFT offers no process-wide registry to extend, so nothing is patched here;
    configs are registered one by one with `register_lora` (which the hfq entry points do)."""
    return None
