"""The one place that talks to transformers / PEFT registries. Runs once, on `import hfq`."""
from __future__ import annotations

import importlib

_DONE = False

# quant_method -> (module holding the config, config class, module holding the quantizer, quantizer class)
QUANTIZERS = {
    "hfq_nvfp4": ("hfq.nvfp4.config", "NVFP4Config", "hfq.nvfp4.quantizer", "NVFP4HfQuantizer"),
    "hfq_quest": ("hfq.quest.config", "QuESTConfig", "hfq.quest.quantizer", "QuESTHfQuantizer"),
    "hfq_qft": ("hfq.qft.config", "QFTConfig", "hfq.qft.quantizer", "QFTHfQuantizer"),
}


def register_all() -> None:
    global _DONE
    if _DONE:
        return
    from transformers.quantizers import auto

    importlib.import_module("hfq.nvfp4.peft_lora").check_peft()  # before anything is patched
    for method, (cfg_mod, cfg_name, q_mod, q_name) in QUANTIZERS.items():
        cfg_cls = getattr(importlib.import_module(cfg_mod), cfg_name)
        q_cls = getattr(importlib.import_module(q_mod), q_name)
        # Re-registration of our own class (e.g. importlib.reload in a notebook: a new class object) is allowed.
        known = auto.AUTO_QUANTIZATION_CONFIG_MAPPING.get(method)
        if known is not None and (known.__module__, known.__qualname__) != (cfg_mod, cfg_name):
            raise RuntimeError(f"quant_method {method!r} is already registered by another package "
                               f"({known.__module__}.{known.__qualname__})")
        auto.AUTO_QUANTIZATION_CONFIG_MAPPING[method] = cfg_cls
        auto.AUTO_QUANTIZER_MAPPING[method] = q_cls
        # a config with loading attributes (QFTConfig) has them applied to a saved checkpoint's config on reload
        kinds = getattr(auto, "LOADING_ATTRIBUTES_CONFIG_TYPES", None)
        if hasattr(cfg_cls, "get_loading_attributes") and kinds is not None and cfg_cls not in kinds:
            auto.LOADING_ATTRIBUTES_CONFIG_TYPES = (*kinds, cfg_cls)

    from hfq._base.config import refusing_other_methods_of_one_name

    merge = auto.AutoHfQuantizer.merge_quantization_configs
    if not hasattr(merge, "hfq_wrapped"):  # hfq's NVFP4Config shares transformers' class name: told apart here
        auto.AutoHfQuantizer.merge_quantization_configs = classmethod(refusing_other_methods_of_one_name(merge))
    from transformers import PreTrainedModel

    from hfq._base.surgery import (footprint_with_stored_bytes, refusing_quantized_head_resize, save_with_state_dict,
                                   warning_from_config)

    if not hasattr(PreTrainedModel.save_pretrained, "hfq_wrapped"):  # hfq checkpoints honour state_dict=
        PreTrainedModel.save_pretrained = save_with_state_dict(PreTrainedModel.save_pretrained)
    if not hasattr(PreTrainedModel._from_config.__func__, "hfq_wrapped"):  # a dense model under an hfq config
        PreTrainedModel._from_config = classmethod(warning_from_config(PreTrainedModel._from_config.__func__))
    if not hasattr(PreTrainedModel.get_memory_footprint, "hfq_wrapped"):  # QParams count what they store
        PreTrainedModel.get_memory_footprint = footprint_with_stored_bytes(PreTrainedModel.get_memory_footprint)
    resize = PreTrainedModel.resize_token_embeddings
    if not hasattr(resize, "hfq_wrapped"):  # a quantized lm_head: refused before anything is resized
        PreTrainedModel.resize_token_embeddings = refusing_quantized_head_resize(resize)
    from torch.nn.parallel import DistributedDataParallel

    from hfq.nvfp4.linear import marking_codes_for_ddp

    if not hasattr(DistributedDataParallel.__init__, "hfq_wrapped"):  # DDP leaves NVFP4 codes alone, however wrapped
        DistributedDataParallel.__init__ = marking_codes_for_ddp(DistributedDataParallel.__init__)
    from accelerate import Accelerator, utils as acc_utils
    from accelerate.utils import modeling as acc_modeling

    from hfq.nvfp4.linear import canonical_before_set

    for owner in (acc_modeling, acc_utils):  # its loaders look NVFP4 tensors up by their canonical names
        if not hasattr(owner.set_module_tensor_to_device, "hfq_wrapped"):
            owner.set_module_tensor_to_device = canonical_before_set(owner.set_module_tensor_to_device)

    from hfq.qparam.guard import refusing_deepspeed

    if not hasattr(Accelerator.prepare, "hfq_wrapped"):  # QFT/ECO models under DeepSpeed: refused before its engine
        Accelerator.prepare = refusing_deepspeed(Accelerator.prepare)
    from accelerate.utils import fsdp_utils

    from hfq.qparam.fsdp import loading_whole_state_dicts

    own = getattr(fsdp_utils, "_set_model_state_dict", None)  # Trainer's FSDP2 FULL_STATE_DICT resume of QParams
    if own is not None and not hasattr(own, "hfq_wrapped"):
        fsdp_utils._set_model_state_dict = loading_whole_state_dicts(own)
    importlib.import_module("hfq._base.trl_guard").install()  # TRL's fused LM head on a quantized head: refused
    importlib.import_module("hfq._base.peft_guard").install()  # adapters on QuEST/QFT/ECO layers: refused clearly
    importlib.import_module("hfq.nvfp4.peft_lora").register_peft_dispatch()  # LoRA on NVFP4Linear, process-wide
    _DONE = True
