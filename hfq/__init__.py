"""hfq: quantized LLM training for the Hugging Face stack.

Importing hfq registers its quantization methods (`hfq_nvfp4`, `hfq_quest`, `hfq_qft`) with
transformers, so `from_pretrained` reloads hfq checkpoints, and extends PEFT's LoRA dispatch to NVFP4 layers (`hfq/nvfp4/peft_lora.py`).
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module; resolved lazily so `import hfq` stays light (TRL is imported only on use)
_LAZY = {
    "NVFP4Config": "hfq.nvfp4",
    "NVFP4Linear": "hfq.nvfp4",
    "QuESTConfig": "hfq.quest",
    "QFTConfig": "hfq.qft",
    "QLion": "hfq.optim",
    "ECOSGD": "hfq.optim",
    "ECOAdamW": "hfq.optim",
    "QeRLConfig": "hfq.qerl",
    "QeRLGRPOTrainer": "hfq.qerl",
    "QParam": "hfq.qparam",
    "RolloutEngine": "hfq.rollout",
    "RolloutMixin": "hfq.rollout",
}

# subpackages reachable as attributes after `import hfq` (e.g. `hfq.eco.optimizer_cls_and_kwargs`), imported on first use
_SUBMODULES = ("cli", "eco", "hub", "models", "nvfp4", "optim", "qerl", "qft", "qparam", "quest", "rollout", "tiny")

__all__ = sorted(_LAZY) + list(_SUBMODULES)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'hfq' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


from ._register import register_all  # noqa: E402

register_all()
