"""hfq.rollout: CUDA-graphed batched generation for (quantized, LoRA, noisy) policies, and a TRL mixin.

`RolloutEngine(model, max_batch=..., max_seq_len=...)`.generate(...) works standalone;
`RolloutMixin` (before `trl.GRPOTrainer` in the bases) routes GRPO rollouts through it.
"""
from .decoder import DecodeFusions
from .engine import RolloutEngine, RolloutOutput
from .sampling import SamplerFlags

__all__ = ["DecodeFusions", "RolloutEngine", "RolloutOutput", "RolloutMixin", "SamplerFlags"]


def __getattr__(name):
    if name == "RolloutMixin":  # imported lazily: it is the only part that touches TRL
        from .mixin import RolloutMixin

        return RolloutMixin
    raise AttributeError(f"module 'hfq.rollout' has no attribute {name!r}")
