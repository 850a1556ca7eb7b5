"""hfq: quantized LLM training for the Hugging Face stack.

Importing hfq registers its quantization methods (`hfq_nvfp4`, `hfq_quest`, `hfq_qft`) with
transformers, so `from_pretrained` reloads hfq checkpoints (PEFT LoRA: see `hfq.nvfp4.register_lora`).
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
    "QLion": "hfq.qft",
    "ECOSGD": "hfq.eco",
    "ECOAdamW": "hfq.eco",
    "QeRLConfig": "hfq.qerl",
    "QeRLGRPOTrainer": "hfq.qerl",
    "QParam": "hfq.qparam",
    "RolloutEngine": "hfq.rollout",
    "RolloutMixin": "hfq.rollout",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hfq' has no attribute {name!r}")


from ._register import register_all  # noqa: E402

register_all()
