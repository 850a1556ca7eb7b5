"""QuEST: quantization-aware training down to 1-bit weights and activations (hfq_quest)."""
from .config import QuESTConfig
from .linear import QuESTLinear, pack_codes, unpack_codes
from .quantizer import QuESTHfQuantizer, quantize_model

__all__ = ["QuESTConfig", "QuESTLinear", "QuESTHfQuantizer", "quantize_model",
           "pack_codes", "unpack_codes"]
