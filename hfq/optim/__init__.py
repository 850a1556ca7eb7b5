"""hfq's optimizers for quantized weights (hfq.qparam.QParam), no master weights, and their shared base.

- ECOSGD / ECOAdamW (ECO): the quantization error of each step is fed back into momentum; any weight_format.
- QLion (QFT): Lion with INT8 momentum; reads QFTConfig(gradient_bits=8)'s INT8 gradients (ECO does too).
- optimizer_cls_and_kwargs(args): ECO for `Trainer(optimizer_cls_and_kwargs=...)`, filled from TrainingArguments.
Other torch optimizers are refused at their first step on a trainable QParam (hfq.qparam's step pre-hook): they
would leave the weight unchanged.
"""
from .base import QParamOptimizer, check_beta, check_hyper, check_lr
from .eco import ECOAdamW, ECOSGD
from .lion import QLion, lion_direction
from .states import StateStore, decode8, encode8
from .trainer import optimizer_cls_and_kwargs

__all__ = ["ECOAdamW", "ECOSGD", "QLion", "QParamOptimizer", "StateStore", "check_beta", "check_hyper", "check_lr",
           "decode8", "encode8", "lion_direction", "optimizer_cls_and_kwargs"]
