"""The global optimizer step pre-hook that refuses torch optimizers other than hfq's on a trainable QParam, and
accelerate's prepare under DeepSpeed refusing models that hold QParams."""
from __future__ import annotations

import functools

from torch import nn
from torch.optim.optimizer import Optimizer, register_optimizer_step_pre_hook

from .tensor import NO_DEEPSPEED, USE_HFQ_OPTIMIZER, QParam


def _refuse_plain_optimizer(optimizer, args, kwargs):
    """Global optimizer step pre-hook: only optimizers marked `updates_qparams` (hfq.optim's) step over a trainable
    QParam. Any other would leave it unchanged without a word (its foreach/fused kernels write into dequantized
    temporaries; INT8-gradient weights have no .grad to read), so the step is refused before anything moves."""
    if getattr(optimizer, "updates_qparams", False) or getattr(getattr(optimizer, "optimizer", None),
                                                                "updates_qparams", False):
        return None  # hfq's, or a wrapper delegating to one (accelerate's AcceleratedOptimizer)
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if isinstance(p, QParam) and p.requires_grad:
                names = group.get("param_names")
                what = names[pi] if names else f"param_groups[{gi}]['params'][{pi}]"
                raise TypeError(f"{type(optimizer).__name__} cannot train {what}, a quantized weight (QParam "
                                f"{p.fmt} {tuple(p.shape)}): it would stay unchanged. {USE_HFQ_OPTIMIZER}")
    return None


if not getattr(Optimizer, "_hfq_guard_hook", None):  # once per process, also across reloads of this module
    Optimizer._hfq_guard_hook = register_optimizer_step_pre_hook(_refuse_plain_optimizer)


def refusing_deepspeed(prepare):
    """Accelerator.prepare (Trainer's route too) refusing, under DeepSpeed, a model that holds quantized weights,
    before the engine reaches them: inside it they fail with errors naming neither (DeepSpeed >= 0.19.7: "Couldn't
    swap QLinear.weight"; before: a .data write refused by QParam)."""
    @functools.wraps(prepare)
    def wrapper(self, *args, **kwargs):
        from accelerate.utils import DistributedType

        if self.distributed_type == DistributedType.DEEPSPEED:
            for obj in (*args, *kwargs.values()):
                if isinstance(obj, nn.Module):
                    name, p = next(((n, p) for n, p in obj.named_parameters() if isinstance(p, QParam)), (None, None))
                    if p is not None:
                        raise ValueError(f"{name} is a quantized weight (QParam {p.fmt}, QFT/ECO): DeepSpeed cannot "
                                         f"train it. {NO_DEEPSPEED}")
        return prepare(self, *args, **kwargs)

    wrapper.hfq_wrapped = True
    return wrapper
