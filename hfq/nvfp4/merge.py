"""LoRA after training on an NVFP4 base: fold it into the codes (re-quantizing, with a report of how much of the
delta survived), or keep it beside the exported base, which loses nothing (vLLM serves LoRA on such bases)."""
from __future__ import annotations

import math
import os
import warnings

import torch

from .._base.lora import merge_lora
from .linear import NVFP4Linear
from .peft_lora import NVFP4LoraLinear


def requantized(base: NVFP4Linear, weight: torch.Tensor, bias: torch.Tensor | None, name: str,
                canonical: bool = False) -> NVFP4Linear:
    """A new NVFP4Linear like `base` (format, compute and weight dtype, device) holding Q(weight) and `bias`;
    `canonical` keeps compressed-tensors' layout on any device (for callers that only read the codes out)."""
    new = NVFP4Linear(base.in_features, base.out_features, bias is not None, base.format, base.compute_dtype,
                      device=weight.device, dtype=base.weight_dtype)
    new.scale_rule = base.scale_rule  # NVFP4Config.scales of the loaded model
    new.set_weight(weight, name=name, canonical=canonical)
    if bias is not None:
        new.bias.data.copy_(bias)
    return new


class MergeReport(dict):
    """layer name -> {"delta_rel_norm", "requant_rel_error", "delta_error_ratio", "delta_kept"}, plus `overall`.

    For a layer with NVFP4 base W (as the model computed with it), LoRA delta D and re-quantized result R:
    - delta_rel_norm = |D| / |W|: the size of the fine-tune;
    - requant_rel_error = |R - (W + D)| / |W + D|: the error re-quantization adds;
    - delta_error_ratio = |R - W - D| / |D|: that error measured against the delta (0: the delta is kept exactly;
      1: as large as the delta, e.g. R == W, the fine-tune erased);
    - delta_kept = <R - W, D> / |D|^2: the share of the delta the codes moved along (1 kept, 0 lost).
    `overall` aggregates the same over all layers (norms summed in squares).
    """

    overall: dict

    def summary(self) -> str:
        o = self.overall
        return (f"{len(self)} NVFP4 layers re-quantized: delta kept {o['delta_kept']:.3f}, re-quantization error "
                f"{o['delta_error_ratio']:.3f}x the delta ({o['layers_erased']} layers with error >= delta)")


@torch.no_grad()
def merge_and_requantize(peft_model, warn_ratio: float = 0.5):
    """Return (model, report): the base model with W' = Q(dequant(W) + BA) in every NVFP4 LoRA layer.

    `report` is a `MergeReport` (per layer and `report.overall`). A UserWarning is raised when the overall
    re-quantization error reaches `warn_ratio` times the LoRA delta: the merged NVFP4 model then no longer
    carries the fine-tune; serve base + adapter instead (`hfq.nvfp4.export_with_adapter`). LoRA on non-NVFP4
    layers is merged exactly (PEFT's own merge).
    """
    from peft.tuners.lora import LoraLayer

    _check_peft_model(peft_model, "merge_and_requantize")
    if not (isinstance(warn_ratio, (int, float)) and warn_ratio > 0):
        raise ValueError(f"warn_ratio must be a positive number, got {warn_ratio!r}")
    report = MergeReport()
    tot = dict(d2=0.0, w2=0.0, e2=0.0, dot=0.0, m2=0.0, r2=0.0)
    for name, mod in peft_model.get_base_model().named_modules():
        if isinstance(mod, NVFP4LoraLinear):
            if mod.merged:
                mod.unmerge()
            base: NVFP4Linear = mod.get_base_layer()
            w = base.dequantize(torch.float32)
            merged, bias, delta = merge_lora(mod, w, base.bias, name=name)
            same_bias = (bias is None) == (base.bias is None) and (bias is None or torch.equal(bias, base.bias))
            # a zero delta (an untrained or zero-initialized adapter) keeps the codes: re-quantizing the dequantized
            # weight picks its scales anew (scales="mse" searches another global scale), which would move them
            new = base if same_bias and not delta.any() else requantized(base, merged, bias, name)
            moved = new.dequantize(torch.float32) - w
            err = moved - delta
            s = dict(d2=float(delta.square().sum()), w2=float(w.square().sum()), e2=float(err.square().sum()),
                     dot=float((moved * delta).sum()), m2=float(merged.square().sum()))
            report[name] = _ratios(s)
            for k in s:
                tot[k] += s[k]
            mod.base_layer = new
            for a in list(mod.lora_A):  # the delta now lives in the codes
                del mod.lora_A[a], mod.lora_B[a]
        elif isinstance(mod, LoraLayer) and not mod.merged:
            mod.merge()
    report.overall = dict(_ratios(tot), layers_erased=sum(r["delta_error_ratio"] >= 1 for r in report.values()))
    if report and report.overall["delta_error_ratio"] >= warn_ratio:
        warnings.warn(f"merge_and_requantize: re-quantization error is {report.overall['delta_error_ratio']:.2f}x "
                      f"the LoRA delta (delta kept: {report.overall['delta_kept']:.2f}): the merged NVFP4 model has "
                      "lost most of the fine-tune. Serve the NVFP4 base with the adapter kept separate "
                      "(hfq.nvfp4.export_with_adapter) or merge to a dense model (merge_and_unload).",
                      UserWarning, stacklevel=2)
    model = peft_model.unload()
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # its codes now hold a fine-tune: a card says so, and not the load's weight error
        quantizer.merged_adapter = True
    return model, report


def _ratios(s: dict) -> dict:
    d = math.sqrt(s["d2"])
    return {"delta_rel_norm": d / max(math.sqrt(s["w2"]), 1e-30),
            "requant_rel_error": math.sqrt(s["e2"]) / max(math.sqrt(s["m2"]), 1e-30),
            "delta_error_ratio": math.sqrt(s["e2"]) / d if d > 0 else 0.0,
            "delta_kept": s["dot"] / s["d2"] if d > 0 else 1.0}


def _check_peft_model(model, what: str) -> None:
    """A PeftModel is required: a transformers model with an adapter attached by its own PEFT integration
    (`load_adapter` / `add_adapter`) has no PeftModel API (get_base_model, unload) to work on."""
    if hasattr(model, "get_base_model") and getattr(model, "peft_config", None):
        return
    if getattr(model, "_hf_peft_config_loaded", False):
        raise ValueError(f"{what}: this adapter was attached with transformers' load_adapter/add_adapter; load it "
                         "as a PEFT model instead: peft.PeftModel.from_pretrained(base_model, adapter_dir)")
    raise ValueError(f"{what}: expected a PEFT model (peft.get_peft_model / PeftModel.from_pretrained)")


def export_with_adapter(peft_model, out_dir: str) -> dict[str, str]:
    """Write `out_dir/base` (the NVFP4 base in compressed-tensors' nvfp4-pack-quantized layout: the very codes the
    adapter was trained on) and the active PEFT LoRA adapter side by side; returns both paths ("adapter": the
    folder holding its adapter_config.json: `out_dir/adapter`, or `out_dir/adapter/NAME` for an adapter not named
    "default", as PEFT saves it).

    Nothing is re-quantized, so the fine-tune survives exactly; serve with e.g.
    `vllm serve OUT/base --enable-lora --lora-modules tuned=<adapter path>`. The model must be an unmerged PEFT
    LoRA model with one active adapter (what it computes with; other adapters are not written) and no
    `modules_to_save` (vLLM's LoRA carries A/B matrices only)."""
    from peft import PeftType
    from peft.tuners.tuners_utils import BaseTunerLayer

    from .export import export_compressed_tensors

    _check_peft_model(peft_model, "export_with_adapter")
    active = peft_model.base_model.active_adapters
    if len(active) != 1:
        raise ValueError(f"export_with_adapter: {len(active)} adapters are active ({active}); vLLM serves one "
                         "adapter per path: set_adapter(name) to the one to export")
    adapter = active[0]
    cfg = peft_model.peft_config[adapter]
    if cfg.peft_type != PeftType.LORA:
        raise ValueError(f"export_with_adapter: adapter {adapter!r} is {cfg.peft_type}, not LoRA")
    if getattr(cfg, "modules_to_save", None):
        raise ValueError(f"export_with_adapter: adapter {adapter!r} has modules_to_save={cfg.modules_to_save}; "
                         "vLLM's LoRA serves A/B matrices only")
    base_model = peft_model.get_base_model()
    layers = [(n, m) for n, m in base_model.named_modules() if isinstance(m, BaseTunerLayer)]
    merged = [n for n, m in layers if m.merged]
    if merged:
        raise ValueError(f"export_with_adapter: {merged[:3]} are merged; call unmerge_adapter() first")
    on_params = [n for n, m in layers if type(m).__name__ == "ParamWrapper"]
    if on_params:
        raise ValueError(f"export_with_adapter: LoRA on parameters that are no linear layers ({on_params[:3]}, "
                         "e.g. fused MoE experts: PEFT's target_parameters, or target_modules='all-linear' on an "
                         "MoE model); vLLM's LoRA serves linear layers' A/B matrices: target the linear layers by "
                         "name (target_modules=[...])")
    names = {n for n, _ in layers}  # a wrapper inside another (PEFT nests them on one module) goes with the outer
    layers = [(n, m) for n, m in layers if not any(n.startswith(o + ".") for o in names)]
    paths = {"base": os.path.join(out_dir, "base"),
             "adapter": os.path.join(out_dir, "adapter", *([] if adapter == "default" else [adapter]))}
    swapped = []
    tag = base_model.__dict__.pop("peft_config", None)  # PEFT tags the base model; export refuses tagged models
    try:  # export the base exactly as loaded: each LoRA wrapper replaced by its base layer for the duration
        for name, mod in layers:
            parent, _, child = name.rpartition(".")
            holder = base_model.get_submodule(parent) if parent else base_model
            setattr(holder, child, mod.get_base_layer())
            swapped.append((holder, child, mod))
        export_compressed_tensors(base_model, paths["base"])
    finally:
        for holder, child, mod in reversed(swapped):
            setattr(holder, child, mod)
        if tag is not None:
            base_model.peft_config = tag
    peft_model.save_pretrained(os.path.join(out_dir, "adapter"), selected_adapters=[adapter])
    return paths
