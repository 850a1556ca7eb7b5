"""QeRL: NVFP4 + LoRA + GRPO/DAPO with Adaptive Quantization Noise (AQN) merged into the norms.

The trainer/config (which import TRL) load lazily, so `hfq.qerl.aqn` / `hfq.qerl.rewards` work without TRL."""
import importlib

from .aqn import AQNSchedule, AdaptiveQuantizationNoise, resolve_norms

_LAZY = {"QeRLConfig": ".config", "QeRLGRPOTrainer": ".trainer"}
__all__ = ["AQNSchedule", "AdaptiveQuantizationNoise", "QeRLConfig", "QeRLGRPOTrainer", "resolve_norms"]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'hfq.qerl' has no attribute {name!r}")
