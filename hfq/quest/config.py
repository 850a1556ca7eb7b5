"""QuESTConfig: quantization-aware training down to 1 bit (quant_method `hfq_quest`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from transformers.utils.quantization_config import QuantizationConfigMixin

from hfq_kernels.reference import gaussian
from hfq_kernels.reference.hadamard import DEFAULT_BLOCK, check_block_size

ESTIMATORS = ("trust", "ste")
SAVE_FORMATS = ("codes", "master")


@dataclass
class QuESTConfig(QuantizationConfigMixin):
    """QuEST QAT (Panferov et al. 2025): Hadamard transform along the input dim, RMS normalisation,
    MSE-optimal Gaussian clipping, trust-masked gradients.

    weight_bits / activation_bits: 1..8 (activation_bits None = weight-only QAT).
    grid: "int" (uniform, 2^b levels) or "fp4" (E2M1 levels; 4 bits only).
    hadamard / hadamard_block_size: HT on or off (the paper's ablation) and its power-of-two block.
    trust_scale: outer trust scale s at 1 bit (None = paper's 1.30 with HT, 1.25 without).
    estimator: "trust" (QuEST) or "ste" (straight-through baseline).
    modules_to_not_convert: module names kept in full precision (None = lm_head / output embeddings;
        embeddings are never linear layers).
    save_format: what save_pretrained stores for each QuEST layer: "codes" (packed low-bit codes + fp32
        per-row scales in the Hadamard domain, an inference checkpoint) or "master" (the master weights,
        to resume QAT).
    """

    weight_bits: int = 4
    activation_bits: int | None = 4
    grid: str = "int"
    hadamard: bool = True
    hadamard_block_size: int = DEFAULT_BLOCK
    trust_scale: float | None = None
    estimator: str = "trust"
    modules_to_not_convert: list[str] | None = None
    save_format: str = "codes"
    quant_method: str = field(default="hfq_quest")

    def __post_init__(self):
        if self.quant_method != "hfq_quest":
            raise ValueError(f"quant_method: must be 'hfq_quest', got {self.quant_method!r}")
        if self.grid not in gaussian.GRIDS:
            raise ValueError(f"grid: unknown {self.grid!r}; allowed {gaussian.GRIDS}")
        for name in ("weight_bits", "activation_bits"):
            b = getattr(self, name)
            if b is None and name == "activation_bits":
                continue
            if not isinstance(b, int) or isinstance(b, bool) or not 1 <= b <= 8:
                raise ValueError(f"{name}: {b!r} not allowed; allowed integers 1..8"
                                 + (" or None (weight-only)" if name == "activation_bits" else ""))
            if self.grid == "fp4" and b != 4:
                raise ValueError(f"{name}: the fp4 grid has 4 bits, got {b}")
        if not isinstance(self.hadamard, bool):
            raise ValueError(f"hadamard: must be True or False, got {self.hadamard!r}")
        check_block_size(self.hadamard_block_size, "hadamard_block_size")
        if self.trust_scale is not None and not (isinstance(self.trust_scale, (int, float))
                                                 and self.trust_scale > 0):
            raise ValueError(f"trust_scale: must be a positive number or None, got {self.trust_scale!r}")
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator: unknown {self.estimator!r}; allowed {ESTIMATORS}")
        if self.save_format not in SAVE_FORMATS:
            raise ValueError(f"save_format: unknown {self.save_format!r}; allowed {SAVE_FORMATS}")
        if self.modules_to_not_convert is not None:
            if not isinstance(self.modules_to_not_convert, (list, tuple)) or not all(
                    isinstance(m, str) for m in self.modules_to_not_convert):
                raise ValueError("modules_to_not_convert: must be a list of module names or None")
            self.modules_to_not_convert = list(self.modules_to_not_convert)

    # -- derived settings used by the layers
    @property
    def block(self) -> int:
        """HT block size, 0 when the transform is off."""
        return self.hadamard_block_size if self.hadamard else 0

    def outer_trust(self, bits: int) -> float:
        """Outer trust scale s for a tensor quantized to `bits` (1 unless bits == 1)."""
        if bits != 1:
            return 1.0
        if self.trust_scale is not None:
            return float(self.trust_scale)
        return gaussian.default_trust_scale(1, self.hadamard)

    def is_quantizable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return True
