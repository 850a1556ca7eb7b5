"""`NVFP4Config`: load any causal LM with its decoder linears in NVFP4 (or MXFP4), quantized while loading."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .._base.config import HfqConfig, check_choice

QUANT_METHOD = "hfq_nvfp4"
FORMATS = ("nvfp4", "mxfp4")
SCALE_RULES = ("amax", "mse")
BLOCK_SIZE = {"nvfp4": 16, "mxfp4": 32}
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class NVFP4Config(HfqConfig):
    """Weight-only FP4 (W4A16) for the decoder's linear layers; embeddings and lm_head stay in BF16.

    modules_to_not_convert: modules kept in high precision, matched by transformers' rule (hfq._base.surgery);
        transformers' defaults for the model (output embedding, tied modules) are always added.
    format: "nvfp4" (E4M3 scale per 16 + fp32 global scale) or "mxfp4" (E8M0 scale per 32).
    compute_dtype: activation dtype for the matmul ("bfloat16" | "float16" | "float32"; None = input dtype).
    strict: raise instead of skipping a linear whose in_features is not a multiple of the block size (or that
        is not an nn.Linear); without it such layers stay dense with a warning naming them.
    scales: NVFP4 scale rule: "amax" (global 448*6/amax, block amax/6: round-to-nearest) or "mse" (block scales
        searched for the least weight reconstruction error, the global scale staying amax's; same format, slower
        load). A smaller weight error is not a better model: "mse" alone measured no better than "amax" on SmolLM2
        (examples/results/nvfp4_quality.md); inside GPTQ calibration (calibrate_) it helps.
    """

    modules_to_not_convert: list[str] | None = field(default_factory=lambda: ["lm_head", "embed_tokens"])
    format: str = "nvfp4"
    compute_dtype: str | None = None
    strict: bool = False
    scales: str = "amax"
    quant_method: str = QUANT_METHOD

    QUANT_METHOD = QUANT_METHOD
    RELOAD_OPTIONS = ("compute_dtype",)  # how the layers compute, not what a checkpoint stores
    ADD_DEFAULT_SKIPS = True

    def validate(self):
        check_choice("format", self.format, FORMATS)
        if isinstance(self.compute_dtype, torch.dtype):
            self.compute_dtype = str(self.compute_dtype).removeprefix("torch.")
        if self.compute_dtype is not None:
            check_choice("compute_dtype", self.compute_dtype, sorted(_DTYPES) + [None])
        check_choice("scales", self.scales, SCALE_RULES)
        if self.scales != "amax" and self.format != "nvfp4":
            raise ValueError(f"scales={self.scales!r} applies to format='nvfp4' only (MXFP4's scales are powers of two)")

    @property
    def block_size(self) -> int:
        return BLOCK_SIZE[self.format]

    @property
    def torch_compute_dtype(self) -> torch.dtype | None:
        return None if self.compute_dtype is None else _DTYPES[self.compute_dtype]
