"""QParam: a trainable low-precision weight (codes + scales) that behaves like a bf16 parameter.

It reports a logical shape [out, in] and dtype bf16, so autograd gives it an ordinary bf16 `.grad`, and hfq's
optimizers (hfq.optim: ECO, QLion) call `dequantize()` / `requantize_(value)`. No other update path can silently do
nothing: any in-place write into a QParam raises, and a global optimizer step pre-hook refuses every other torch
optimizer holding a trainable QParam before its step touches anything, naming the hfq optimizer to use.
With `qlinear(..., store_int8=True)` (QFTConfig(gradient_bits=8)) dL/dW is kept as INT8 codes: the weight's `.grad`
is an `Int8Grad`, which gradient clipping can measure and scale and hfq's optimizers consume.

DistributedDataParallel: gradients are ordinary bf16 tensors, bucketed and all-reduced like any others. DDP's
construction-time broadcast goes through the logical value (a dequantized view copied back with `copy_`); copying a
QParam's own value back is a no-op, so ranks that hold the same codes keep them bit-exactly. Ranks that may hold
different codes call `broadcast_qparams_(model)` first. INT8 gradients are averaged over ranks in backward, in fp32,
before storage; DDP is told to ignore those weights (`ddp_ignore_int8_grad_weights_`, applied by hfq.qft).

FSDP2 (`fully_shard`, accelerate's fsdp_version 2): a QParam shards by rows, each row with its scales / zero points
/ outliers, and FSDP2's all-gather moves the stored bytes (hfq.qparam.fsdp). hfq's optimizers step on the local
shards; QFT's INT8 gradient is reduce-scattered and quantized once per shard. FSDP1 (flattened
parameters) is refused by hfq's optimizers.

Modules, by concern: formats (names, encode/decode, checks), tensor (QParam), fsdp (row shards, all-gather),
int8grad (Int8Grad, the per-rank mean and reduce-scatter), linear (QLinear, qlinear), distributed (broadcast), guard
(the optimizer step pre-hook).
"""
from . import guard  # noqa: F401  (registers the optimizer step pre-hook)
from .distributed import broadcast_qparams_
from .formats import (FORMATS, MAX_OUTLIER_FRACTION, check_format, check_qtensors, empty_qtensors,
                      int8_kernels)
from .int8grad import (Int8Grad, accumulate_int8_grad_, clear_int8_grads_, ddp_ignore_int8_grad_weights_,
                       int8_grad, pop_int8_grad)
from .linear import QLinear, name_qparams_, qlinear
from .tensor import USE_HFQ_OPTIMIZER, QParam, QuantizedWriteError, sharding_refusal

__all__ = ["FORMATS", "MAX_OUTLIER_FRACTION", "USE_HFQ_OPTIMIZER", "Int8Grad", "QLinear", "QParam",
           "QuantizedWriteError", "accumulate_int8_grad_", "broadcast_qparams_", "check_format", "check_qtensors",
           "clear_int8_grads_", "ddp_ignore_int8_grad_weights_", "empty_qtensors", "int8_grad", "int8_kernels",
           "name_qparams_", "pop_int8_grad", "qlinear", "sharding_refusal"]
