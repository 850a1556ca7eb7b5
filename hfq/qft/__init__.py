"""QFT room: models whose decoder linears are trainable quantized weights (QParam), via QFTConfig."""
from .config import QFTConfig
from .linear import convert_linears_, quantize_model_
from .quantizer import QFTHfQuantizer

__all__ = ["QFTConfig", "QFTHfQuantizer", "convert_linears_", "quantize_model_"]
