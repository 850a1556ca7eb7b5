"""`NVFP4Config`: load any causal LM with its decoder linears in NVFP4 (or MXFP4), quantized while loading."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from transformers.utils.quantization_config import QuantizationConfigMixin

QUANT_METHOD = "hfq_nvfp4"
FORMATS = ("nvfp4", "mxfp4")
BLOCK_SIZE = {"nvfp4": 16, "mxfp4": 32}
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class NVFP4Config(QuantizationConfigMixin):
    """Weight-only FP4 (W4A16) for the decoder's linear layers; embeddings and lm_head stay in BF16.

    modules_to_not_convert: names (or name suffixes) of modules kept in high precision.
    format: "nvfp4" (E4M3 scale per 16 + fp32 global scale) or "mxfp4" (E8M0 scale per 32).
    compute_dtype: activation dtype for the matmul ("bfloat16" | "float16" | "float32"; None = input dtype).
    strict: raise instead of skipping a linear whose in_features is not a multiple of the block size.
    """

    modules_to_not_convert: list[str] | None = field(default_factory=lambda: ["lm_head", "embed_tokens"])
    format: str = "nvfp4"
    compute_dtype: str | None = None
    strict: bool = False
    quant_method: str = QUANT_METHOD

    def __post_init__(self):
        if self.quant_method != QUANT_METHOD:
            raise ValueError(f"quant_method: expected {QUANT_METHOD!r}, got {self.quant_method!r}")
        if self.format not in FORMATS:
            raise ValueError(f"format: {self.format!r} is not supported; allowed {FORMATS}")
        if isinstance(self.compute_dtype, torch.dtype):
            self.compute_dtype = str(self.compute_dtype).removeprefix("torch.")
        if self.compute_dtype is not None and self.compute_dtype not in _DTYPES:
            raise ValueError(f"compute_dtype: {self.compute_dtype!r} is not supported; allowed {sorted(_DTYPES)} or None")
        if self.modules_to_not_convert is not None:
            if isinstance(self.modules_to_not_convert, str) or not all(
                isinstance(m, str) for m in self.modules_to_not_convert
            ):
                raise ValueError("modules_to_not_convert: expected a list of module names (str)")
            self.modules_to_not_convert = list(self.modules_to_not_convert)
        if not isinstance(self.strict, bool):
            raise ValueError(f"strict: expected a bool, got {self.strict!r}")

    @property
    def block_size(self) -> int:
        return BLOCK_SIZE[self.format]

    @property
    def torch_compute_dtype(self) -> torch.dtype | None:
        return None if self.compute_dtype is None else _DTYPES[self.compute_dtype]

    def to_dict(self) -> dict:
        return asdict(self)

    def to_diff_dict(self) -> dict:
        return self.to_dict()
