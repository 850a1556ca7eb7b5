"""PEFT adapters on the layers that train their own quantized weights (QuEST, QFT, ECO): refused, saying what to do.

Those layers are not `nn.Linear`, so PEFT's "all-linear" finds nothing and reports that no target_modules were
given, and a named target gets "not supported". A layer class declares `full_tuning_method` (its method's name) to
be covered here; LoRA on NVFP4 layers is `hfq.nvfp4.peft_lora`'s.
"""
from __future__ import annotations

import functools

_INSTALLED = False


def _method_of(module) -> str | None:
    return getattr(type(module), "full_tuning_method", None)


def _refusal(what: str, module) -> ValueError:
    method = _method_of(module)
    return ValueError(
        f"{what}: {type(module).__name__} is a {method} layer, which trains its own quantized weight; hfq offers PEFT "
        f"adapters (LoRA) on NVFP4 layers only. Fine-tune the {method} model itself (Trainer / SFTTrainer without "
        "peft_config, see docs/training.md), or load the base with hfq.NVFP4Config() to train LoRA on it")


def _all_linear_refused(include_all_linear):
    @functools.wraps(include_all_linear)
    def _maybe_include_all_linear_layers(peft_config, model):
        tm = getattr(peft_config, "target_modules", None)
        if isinstance(tm, str) and tm.lower() == "all-linear":
            found = next(((n, m) for n, m in model.named_modules() if _method_of(m)), None)
            if found is not None:
                raise _refusal(f"target_modules='all-linear' ({found[0]} and the other linears)", found[1])
        return include_all_linear(peft_config, model)

    return _maybe_include_all_linear_layers


def _lora_target_refused(create_new_module):
    @functools.wraps(create_new_module)
    def _create_new_module(lora_config, adapter_name, target, **kwargs):
        from peft.tuners.tuners_utils import BaseTunerLayer

        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        if _method_of(base):
            raise _refusal(f"LoRA target {type(base).__name__}({base.in_features} -> {base.out_features})", base)
        return create_new_module(lora_config, adapter_name, target, **kwargs)

    return _create_new_module


def install() -> bool:
    """Put the refusals into PEFT, process-wide (on `import hfq`, before NVFP4's LoRA dispatch wraps the same two
    functions); idempotent. Returns whether it installed now."""
    global _INSTALLED
    from peft.tuners import tuners_utils
    from peft.tuners.lora.model import LoraModel

    if _INSTALLED or getattr(LoraModel, "_hfq_peft_guard", False):  # the class flag survives a reload of this module
        return False
    tuners_utils._maybe_include_all_linear_layers = _all_linear_refused(tuners_utils._maybe_include_all_linear_layers)
    LoraModel._create_new_module = staticmethod(_lora_target_refused(LoraModel._create_new_module))
    LoraModel._hfq_peft_guard = _INSTALLED = True
    return True
