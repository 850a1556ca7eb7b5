"""Weight sync from an NVFP4 + LoRA policy to a vLLM engine that serves the compressed-tensors NVFP4 base.

TRL's own sync merges the adapters and sends every *parameter* by name. For an hfq NVFP4 base that would send
dense `...q_proj.weight` tensors, which vLLM's compressed-tensors NVFP4 layers (Marlin FP4 on Hopper) do not
have. `nvfp4_vllm_weights` instead yields what changed since vLLM loaded the exported base:

- every NVFP4 layer that carries LoRA: Q(dequant(W) + BA) in compressed-tensors naming
  (`weight_packed`, `weight_scale`, `weight_global_scale`), i.e. the tensors `hfq export` writes;
- every trainable or noisy plain parameter (RMSNorm weights with AQN noise, modules_to_save), dense.

What this relies on in vLLM (not installable on our machines, so untested end to end here):
1. vLLM was started on `hfq export`'s output (compressed-tensors `nvfp4-pack-quantized`);
2. its model's `load_weights([(name, tensor)])` accepts those checkpoint names, as it does while loading;
3. the quantized modules are re-processed afterwards (`process_weights_after_loading`, which repacks for
   Marlin); `QeRLGRPOTrainer` calls `vllm.model_executor.model_loader.utils.process_weights_after_loading`
   in colocate mode after each sync and raises a clear error if that function is missing.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn


def _strip(name: str) -> str:
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


@torch.no_grad()
def nvfp4_vllm_weights(model: nn.Module, include_frozen: tuple[str, ...] = ("norm",)) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs for vLLM: re-quantized LoRA-merged NVFP4 layers + changed plain parameters.

    `include_frozen`: substrings of frozen parameter names that are sent anyway (norms: AQN changes them).
    The policy itself is not modified (no merge/unmerge round trip through dense weights)."""
    from hfq._base.lora import merge_lora
    from hfq.nvfp4.merge import requantized
    from hfq.nvfp4.peft_lora import NVFP4LoraLinear

    lora_layers = {name: mod for name, mod in model.named_modules() if isinstance(mod, NVFP4LoraLinear)}
    skip_prefixes = tuple(n + "." for n in lora_layers)
    for name, mod in lora_layers.items():
        out = _strip(name)
        if mod.merged:
            raise ValueError(f"{out}: the LoRA adapter is merged; unmerge it before syncing to vLLM")
        base = mod.get_base_layer()
        w, b, _ = merge_lora(mod, base.dequantize(torch.float32), base.bias, name=out)
        q = requantized(base, w, b, out)
        yield f"{out}.weight_packed", q.weight_packed
        yield f"{out}.weight_scale", q.weight_scale
        yield f"{out}.weight_global_scale", q.weight_global_scale
        if q.bias is not None:
            yield f"{out}.bias", q.bias.detach()
    for name, p in model.named_parameters():
        if name.startswith(skip_prefixes) or ".lora_" in name or "original_module" in name:
            continue
        if p.requires_grad or any(s in name for s in include_frozen):
            yield _strip(name).replace("modules_to_save.default.", ""), p.detach()


def has_nvfp4(model: nn.Module) -> bool:
    from hfq.nvfp4.linear import NVFP4Linear

    return any(isinstance(m, NVFP4Linear) for m in model.modules())


def install_vllm_sync(trainer) -> None:
    """Route TRL's vLLM weight iterator through `nvfp4_vllm_weights` (NVFP4 bases only) and re-process the
    quantized modules after a colocate sync."""
    gen = getattr(trainer, "vllm_generation", None)
    if gen is None or not has_nvfp4(trainer.accelerator.unwrap_model(trainer.model)):
        return
    model = trainer.accelerator.unwrap_model(trainer.model)
    fix = getattr(gen, "_fix_param_name_to_vllm", lambda n, **k: n)
    gen._iter_named_params = lambda: ((fix(n), t) for n, t in nvfp4_vllm_weights(model))
    if getattr(gen, "mode", None) != "colocate":
        return
    orig = gen.sync_weights

    def sync_and_reprocess():
        orig()
        try:
            from vllm.model_executor.model_loader.utils import process_weights_after_loading
        except ImportError as e:  # the vLLM API this path relies on moved
            raise RuntimeError("hfq's vLLM NVFP4 sync needs vllm.model_executor.model_loader.utils."
                               "process_weights_after_loading (vLLM 0.10-0.11 layout); not found") from e
        runner = gen.llm.llm_engine.model_executor.driver_worker.model_runner
        process_weights_after_loading(runner.model, runner.model_config, runner.device)

    gen.sync_weights = sync_and_reprocess
