"""NVFP4 room: config, quantizer, NVFP4Linear, its PEFT LoRA layer, compressed-tensors export."""
from .config import NVFP4Config
from .linear import NVFP4Linear

__all__ = ["NVFP4Config", "NVFP4Linear"]
