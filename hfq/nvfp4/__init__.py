"""NVFP4 room: config, quantizer, NVFP4Linear, its PEFT LoRA layer, compressed-tensors export."""
from .config import NVFP4Config
from .export import export_compressed_tensors
from .linear import NVFP4Linear, mark_ddp_ignore
from .merge import merge_and_requantize
from .peft_lora import NVFP4LoraLinear, get_peft_model, register_lora

__all__ = ["NVFP4Config", "NVFP4Linear", "NVFP4LoraLinear", "export_compressed_tensors", "get_peft_model", "mark_ddp_ignore",
           "merge_and_requantize", "register_lora"]
