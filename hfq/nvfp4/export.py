"""Write an hfq NVFP4 model as a compressed-tensors `nvfp4-pack-quantized` checkpoint (what vLLM loads)."""
from __future__ import annotations

import json
import os
import warnings

import torch
from torch import nn

from .._base.surgery import matrices_outside_linears
from .linear import _CODE_BUFFERS, NVFP4Linear


def compressed_tensors_config(ignore: list[str]) -> dict:
    """The `quantization_config` block of an NVFP4 weight-only (W4A16) compressed-tensors checkpoint."""
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
               "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"}
    return {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                      "output_activations": None, "format": "nvfp4-pack-quantized"}},
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
    }


def _unwrap(model: nn.Module) -> nn.Module:
    """A PEFT model exports its base (adapters must be merged first; see merge_and_requantize)."""
    if getattr(model, "_hf_peft_config_loaded", False):
        raise ValueError("export_compressed_tensors: the model has an adapter attached by transformers' "
                         "load_adapter/add_adapter; export the base model loaded without it, or load the adapter as "
                         "peft.PeftModel.from_pretrained(base, adapter_dir) and call "
                         "hfq.nvfp4.merge_and_requantize(peft_model) or hfq.nvfp4.export_with_adapter first")
    if hasattr(model, "peft_config"):
        raise ValueError("export_compressed_tensors: got a PEFT model; call hfq.nvfp4.merge_and_requantize(model) "
                         "first (vLLM takes LoRA separately), or export model.get_base_model()")
    return model


def _checkpoint_names(model: nn.Module, sd: dict, modules: list[str]) -> tuple[dict, dict]:
    """`sd` under the names checkpoints of this architecture use (what save_pretrained writes: transformers 5
    renames some at load, e.g. GPT-NeoX's embed_out, and fuses MoE experts), and module name -> checkpoint name
    for `modules`."""
    from transformers.core_model_loading import revert_weight_conversion

    out = revert_weight_conversion(model, sd)
    names = {}
    for n in modules:
        key = f"{n}.weight"
        if key in sd and key not in out:
            back = list(revert_weight_conversion(model, {key: sd[key]}))
            if len(back) == 1:
                names[n] = back[0].removesuffix(".weight")
    return out, names


def export_compressed_tensors(model: nn.Module, out_dir: str, max_shard_bytes: int = 4 << 30) -> str:
    """Save `model` (with NVFP4Linear layers) to `out_dir` in compressed-tensors' nvfp4-pack-quantized layout."""
    from safetensors.torch import save_file

    model = _unwrap(model)
    nv = {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    if not nv:
        raise ValueError("export_compressed_tensors: the model has no NVFP4Linear layers")
    bad = [n for n, m in nv.items() if m.format != "nvfp4"]
    if bad:
        raise ValueError(f"export_compressed_tensors: only format='nvfp4' is exportable; {bad[:5]} use mxfp4")
    moe = [n for n, m in model.named_modules() if matrices_outside_linears(m)]
    if moe:  # vLLM reads compressed-tensors' "Linear" targets as covering them: it would expect NVFP4 codes
        raise ValueError(f"export_compressed_tensors: {moe[:3]} hold weights outside nn.Linear layers (fused MoE "
                         "experts, routers), which hfq leaves in full precision; a compressed-tensors NVFP4 export "
                         "of such a model is not supported")
    dense = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    os.makedirs(out_dir, exist_ok=True)
    # tied parameters (e.g. lm_head tied to embed_tokens) are stored once: the loader re-ties them
    tied = set(getattr(model, "all_tied_weights_keys", None) or ())
    sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if k not in tied}
    sd, names = _checkpoint_names(model, sd, dense)
    ignore = dense + [c for c in names.values() if c not in dense]  # a loader matches either name
    # compressed-tensors decompresses NVFP4 weights to bf16 whatever the checkpoint's dtype: the other weights
    # must be bf16 too, or a default load's first product mixes dtypes
    codes = {f"{n}.{b}" for n in nv for b in _CODE_BUFFERS}
    cast = [k for k, v in sd.items() if k not in codes and v.is_floating_point() and v.dtype != torch.bfloat16]
    if cast:
        warnings.warn(f"export_compressed_tensors: the export is bfloat16 (compressed-tensors decompresses NVFP4 to "
                      f"bf16); {len(cast)} {sd[cast[0]].dtype} tensors (e.g. {cast[0]}) are cast to it",
                      UserWarning, stacklevel=2)
        for k in cast:
            sd[k] = sd[k].to(torch.bfloat16)
    # shard by size; safetensors refuses shared storage, so clone any other shared tensors
    shards, cur, size = [], {}, 0
    seen = set()
    for k, v in sd.items():
        if v.data_ptr() in seen:
            v = v.clone()
        seen.add(v.data_ptr())
        nbytes = v.numel() * v.element_size()
        if cur and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = v
        size += nbytes
    shards.append(cur)
    index = {}
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
        index.update({k: fname for k in shard})
    if len(shards) > 1:
        total = sum(v.numel() * v.element_size() for v in sd.values())
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": index}, f, indent=2)
    cfg = model.config.to_dict()
    cfg["quantization_config"] = compressed_tensors_config(ignore)
    cfg.pop("_is_quantized", None)
    cfg["dtype"] = "bfloat16"
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = "bfloat16"
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, default=str)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
    return out_dir
