"""Fold LoRA deltas into NVFP4 weights (re-quantizing), reporting the error the re-quantization adds."""
from __future__ import annotations

import torch

from .linear import NVFP4Linear
from .peft_lora import NVFP4LoraLinear


@torch.no_grad()
def merge_and_requantize(peft_model):
    """Return (model, report): the base model with W' = Q(dequant(W) + BA) in every NVFP4 LoRA layer.

    report[layer] = {"requant_rel_error": ||Q(W') - W'|| / ||W'||, "delta_rel_norm": ||BA|| / ||W||}.
    LoRA on non-NVFP4 layers is merged exactly (PEFT's own merge).
    """
    from peft.tuners.lora import LoraLayer

    report = {}
    for name, mod in peft_model.get_base_model().named_modules():
        if isinstance(mod, NVFP4LoraLinear):
            if mod.merged:
                mod.unmerge()
            base: NVFP4Linear = mod.get_base_layer()
            w = base.dequantize(torch.float32)
            delta = sum((mod.get_delta_weight(a) for a in mod.active_adapters if a in mod.lora_A),
                        torch.zeros_like(w))
            merged = w + delta
            new = NVFP4Linear(base.in_features, base.out_features, base.bias is not None, base.format,
                              base.compute_dtype, device=w.device,
                              dtype=base.bias.dtype if base.bias is not None else None)
            new.set_weight(merged, name=name)
            if base.bias is not None:
                new.bias.data.copy_(base.bias.data)
                for a in mod.active_adapters:
                    if a in mod.lora_A and mod.lora_bias[a]:
                        new.bias.data += mod.lora_B[a].bias.to(new.bias.dtype)
            err = (new.dequantize(torch.float32) - merged).norm() / merged.norm().clamp_min(1e-30)
            report[name] = {"requant_rel_error": float(err),
                            "delta_rel_norm": float(delta.norm() / w.norm().clamp_min(1e-30))}
            mod.base_layer = new
            for a in list(mod.lora_A):  # the delta now lives in the codes
                del mod.lora_A[a], mod.lora_B[a]
        elif isinstance(mod, LoraLayer) and not mod.merged:
            mod.merge()
    return peft_model.unload(), report
