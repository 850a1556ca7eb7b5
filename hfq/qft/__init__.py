"""QFT room (Quantized Full-parameter Tuning): decoder linears as trainable INT8 dense + sparse-outlier weights
(QParam) via QFTConfig, INT8 weight gradients (`QFTConfig(gradient_bits=8)`), and QLion (Lion with INT8 momentum).

  model = AutoModelForCausalLM.from_pretrained(path, quantization_config=QFTConfig(gradient_bits=8))
  Trainer(model=model, args=args, train_dataset=ds, optimizers=(QLion(model.parameters(), lr=1e-4), sched))

QLion's step applied during backward (no gradient store at all; gradient_accumulation_steps=1, no clipping):
`handle = step_in_backward_(model, opt)`, or Trainer(..., callbacks=[StepInBackward()], args with max_grad_norm=0).
"""
import torch

from hfq_kernels.reference.intq import dequantize_int_asym, quantize_int_asym
from ..optim import QLion
from ..qparam import Int8Grad, clear_int8_grads_, ddp_ignore_int8_grad_weights_, int8_grad
from .callback import OutlierRefreshPerEpoch
from .config import QFTConfig
from .linear import QFTLinear, convert_linears_, refresh_outliers_
from .memory import state_bytes
from .quantizer import QFTHfQuantizer, quantize_model_
from .step_in_backward import StepInBackward, StepInBackwardHandle, step_in_backward_


def quantize_rows(x, rounding: str = "rtn", generator=None):
    """QFT's INT8 quantizer for gradients and momentum (eq. 1-2, per row, no NaN/Inf host check):
    x -> (codes uint8 [rows, cols], scales fp32 [rows, 1], zeros uint8 [rows, 1])."""
    return quantize_int_asym(x, 8, rounding, generator, check=False)


def dequantize_rows(codes, scales, zeros, shape, dtype=torch.float32):
    """Inverse of quantize_rows, reshaped to the logical `shape`."""
    return dequantize_int_asym(codes, scales, zeros, dtype, shape)


__all__ = ["Int8Grad", "OutlierRefreshPerEpoch", "QFTConfig", "QFTHfQuantizer", "QFTLinear", "QLion",
           "clear_int8_grads_", "convert_linears_", "ddp_ignore_int8_grad_weights_", "dequantize_rows", "int8_grad",
           "quantize_model_", "quantize_rows", "refresh_outliers_", "state_bytes", "step_in_backward_", "StepInBackward",
           "StepInBackwardHandle"]
