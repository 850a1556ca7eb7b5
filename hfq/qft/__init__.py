"""QFT room (Quantized Full-parameter Tuning): decoder linears as trainable INT8 dense + sparse-outlier weights
(QParam) via QFTConfig, INT8 weight gradients (`QFTConfig(gradient_bits=8)`), and QLion (Lion with INT8 momentum).

  model = AutoModelForCausalLM.from_pretrained(path, quantization_config=QFTConfig(gradient_bits=8))
  Trainer(model=model, args=args, train_dataset=ds, optimizers=(QLion(model.parameters(), lr=1e-4), sched))
"""
from .config import QFTConfig
from .int8 import Int8Grad, clear_int8_grads_, dequantize_rows, int8_grad, quantize_rows
from .linear import QFTLinear, convert_linears_, quantize_model_
from .memory import state_bytes
from .optim import QLion
from .quantizer import QFTHfQuantizer

__all__ = ["Int8Grad", "QFTConfig", "QFTHfQuantizer", "QFTLinear", "QLion", "clear_int8_grads_", "convert_linears_",
           "dequantize_rows", "int8_grad", "quantize_model_", "quantize_rows", "state_bytes"]
