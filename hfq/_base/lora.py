"""LoRA merge helpers for quantized bases (NVFP4 layers, the vLLM weight stream): the dense twin of a layer and the
LoRA-merged weight.

A quantized layer has no float weight to add a LoRA delta into, so merging always goes
through a dense float32 weight: `dequant(W) + sum_a scale_a * B_a @ A_a` (bias: `+ scale_a * b_a`), then either a
dense `nn.Linear` in the model's dtype (`dense_linear`) or a re-quantization by the caller.
"""
from __future__ import annotations

import torch
from torch import nn


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype | None = None) -> nn.Linear:
    """A frozen nn.Linear holding `weight` [out, in] and `bias` in `dtype` (default: the weight's) on the weight's
    device: the dense twin of a quantized layer after dequantization (and, optionally, a LoRA merge)."""
    dtype = dtype or weight.dtype
    out_f, in_f = weight.shape
    lin = nn.Linear(in_f, out_f, bias is not None, device=weight.device, dtype=dtype)
    lin.weight.data = weight.detach().to(dtype).clone()
    if bias is not None:
        lin.bias.data = bias.detach().to(device=weight.device, dtype=dtype).clone()
    return lin.requires_grad_(False)


def lora_adapters(layer, adapter_names=None) -> list[str]:
    """The adapters of a PEFT LoRA layer to merge: `adapter_names`, or the active ones that have weights here.
    Variants whose merge is not `B @ A` (DoRA, ...) are refused, naming the adapter."""
    names = list(layer.active_adapters if adapter_names is None else adapter_names)
    names = [a for a in names if a in layer.lora_A]
    variants = [a for a in names if a in getattr(layer, "lora_variant", {})]
    if variants:
        raise ValueError(f"adapters {variants}: only plain LoRA can be merged into a quantized layer "
                         f"({type(layer.lora_variant[variants[0]]).__name__} is a LoRA variant)")
    return names


def lora_delta(layer, adapter: str) -> torch.Tensor:
    """scale * B @ A of one adapter of a PEFT LoRA layer, in float32 (the bf16 product would round the delta)."""
    a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
    return (b.float() @ a.float()) * layer.scaling[adapter]


@torch.no_grad()
def merge_lora(layer, weight: torch.Tensor, bias: torch.Tensor | None, adapter_names=None, name: str = "layer"
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(W + delta, b + delta_b, delta): float32 results of folding the LoRA adapters of `layer` into the base
    `weight` / `bias`. NaN/Inf in the result is refused, naming `name`; a LoRA bias needs a base bias."""
    w = weight.detach().float()
    delta = torch.zeros_like(w)
    b = None if bias is None else bias.detach().float().clone()
    for a in lora_adapters(layer, adapter_names):
        delta += lora_delta(layer, a).to(w.device)
        lb = layer.lora_B[a].bias
        if lb is not None and getattr(layer, "lora_bias", {}).get(a, False):
            if b is None:
                raise ValueError(f"{name}: adapter {a!r} has lora_bias=True but the base layer has no bias")
            b += lb.float().to(b.device) * layer.scaling[a]
    merged = w + delta
    if not torch.isfinite(merged).all() or (b is not None and not torch.isfinite(b).all()):
        raise ValueError(f"{name}: NaN/Inf in the LoRA-merged weight")
    return merged, b, delta
