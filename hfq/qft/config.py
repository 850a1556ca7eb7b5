"""`QFTConfig`: load any causal LM with its decoder linears as trainable quantized weights (QParam)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from transformers.utils.quantization_config import QuantizationConfigMixin

from hfq_kernels.reference.fp8 import ROUNDINGS
from ..qparam import FORMATS, check_format
from .linear import check_gradient_bits

QUANT_METHOD = "hfq_qft"


@dataclass
class QFTConfig(QuantizationConfigMixin):
    """Full-parameter training on quantized weights: each decoder nn.Linear becomes a QLinear holding a QParam.

    weight_format: "int8_dense_sparse" (QFT: INT8 per channel + bf16 outliers), "fp8_e4m3_row" (ECO),
        "int4_tensor" or "int4_group" (ECO fine-tuning).
    group_size: int4_group's group (input elements per scale). outlier_fraction: int8_dense_sparse's tails.
    rounding: rounding of the initial quantization ("rtn" | "sr").
    gradient_bits: None (default: weight gradients are ordinary bf16 `.grad`, all-reduced by DDP) or 8 (QFT's INT8
        gradients: each quantized linear stores dL/dW as INT8 codes + per-row scale/zero point instead of a `.grad`;
        hfq's QLion / ECO read that store; single process only; Trainer's max_grad_norm does not see it).
    modules_to_not_convert: module names (or name suffixes) kept in high precision.
    Train with hfq.qft.QLion (QFT) or hfq.eco.ECOAdamW / ECOSGD: plain torch optimizers are refused.
    """

    weight_format: str = "int8_dense_sparse"
    group_size: int = 128
    outlier_fraction: float = 0.01
    rounding: str = "rtn"
    gradient_bits: int | None = None
    modules_to_not_convert: list[str] | None = field(default_factory=lambda: ["lm_head", "embed_tokens"])
    quant_method: str = QUANT_METHOD

    def __post_init__(self):
        if self.quant_method != QUANT_METHOD:
            raise ValueError(f"quant_method: expected {QUANT_METHOD!r}, got {self.quant_method!r}")
        if self.weight_format not in FORMATS:
            raise ValueError(f"weight_format: unknown {self.weight_format!r}; allowed {FORMATS}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding: unknown {self.rounding!r}; allowed {ROUNDINGS}")
        check_format(self.weight_format, None, self.format_options)
        check_gradient_bits(self.gradient_bits)
        if self.modules_to_not_convert is not None:
            if isinstance(self.modules_to_not_convert, str) or not all(
                    isinstance(m, str) for m in self.modules_to_not_convert):
                raise ValueError("modules_to_not_convert: expected a list of module names (str)")
            self.modules_to_not_convert = list(self.modules_to_not_convert)

    @property
    def format_options(self) -> dict:
        if self.weight_format == "int4_group":
            return {"group_size": self.group_size}
        if self.weight_format == "int8_dense_sparse":
            return {"outlier_fraction": self.outlier_fraction}
        return {}

    def to_dict(self) -> dict:
        return asdict(self)

    def to_diff_dict(self) -> dict:
        return self.to_dict()
