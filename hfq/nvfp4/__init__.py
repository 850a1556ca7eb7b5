"""NVFP4 room: config, quantizer, NVFP4Linear, GPTQ calibration, its PEFT LoRA layer, LoRA merge / adapter export,
compressed-tensors export."""
from .calibrate import CalibrationReport, calibrate_, calibration_batches
from .config import NVFP4Config
from .export import export_compressed_tensors
from .linear import NVFP4Linear, mark_ddp_ignore
from .merge import MergeReport, export_with_adapter, merge_and_requantize
from .peft_lora import NVFP4LoraLinear, get_peft_model, register_lora

__all__ = ["CalibrationReport", "MergeReport", "NVFP4Config", "NVFP4Linear", "NVFP4LoraLinear", "calibrate_",
           "calibration_batches", "export_compressed_tensors", "export_with_adapter", "get_peft_model",
           "mark_ddp_ignore", "merge_and_requantize", "register_lora"]
