"""QeRL: NVFP4 + LoRA + GRPO/DAPO with Adaptive Quantization Noise (AQN) merged into the norms."""
from .aqn import AQNSchedule, AdaptiveQuantizationNoise, resolve_norms
from .config import QeRLConfig
from .trainer import QeRLGRPOTrainer

__all__ = ["AQNSchedule", "AdaptiveQuantizationNoise", "QeRLConfig", "QeRLGRPOTrainer", "resolve_norms"]
