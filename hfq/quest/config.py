"""QuESTConfig: quantization-aware training down to 1 bit (quant_method `hfq_quest`)."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from hfq_kernels.reference import gaussian
from hfq_kernels.reference.hadamard import DEFAULT_BLOCK, check_block_size, effective_block

from .._base.config import HfqConfig, check_bool, check_choice, check_positive, warn_unused

ESTIMATORS = ("trust", "ste")
SMALL_BLOCK = 16  # a default Hadamard block below this is announced (block_for)
SAVE_FORMATS = ("codes", "master")


@dataclass
class QuESTConfig(HfqConfig):
    """QuEST QAT (Panferov et al. 2025): Hadamard transform along the input dim, RMS normalisation,
    MSE-optimal Gaussian clipping, trust-masked gradients.

    weight_bits / activation_bits: 1..8 (activation_bits None = weight-only QAT).
    grid: "int" (uniform, 2^b levels) or "fp4" (E2M1 levels; 4 bits only).
    hadamard / hadamard_block_size: HT on or off (the paper's ablation) and its power-of-two block; None (the
        default) picks per layer the largest power of two dividing its input width, at most 128 (576 -> 64).
    trust_scale: outer trust scale s at 1 bit (None = paper's 1.30 with HT, 1.25 without).
    estimator: "trust" (QuEST) or "ste" (straight-through baseline).
    modules_to_not_convert: modules kept in full precision, matched by transformers' rule
        (hfq._base.surgery); None = transformers' defaults (the output embedding and modules tied to it).
    save_format: what save_pretrained (and so every Trainer checkpoint) stores for each QuEST layer:
        "master" (the master weights: reloads as a QAT model and resumes training exactly) or "codes"
        (packed low-bit codes + fp32 per-row scales in the Hadamard domain: a smaller inference checkpoint
        that reloads as packed layers and cannot resume QAT).
    strict: raise instead of leaving a linear-like layer that is not an nn.Linear (e.g. GPT-2's Conv1D) in full
        precision with a warning.
    """

    weight_bits: int = 4
    activation_bits: int | None = 4
    grid: str = "int"
    hadamard: bool = True
    hadamard_block_size: int | None = None
    trust_scale: float | None = None
    estimator: str = "trust"
    modules_to_not_convert: list[str] | None = None
    save_format: str = "master"
    strict: bool = False
    quant_method: str = field(default="hfq_quest")

    QUANT_METHOD = "hfq_quest"
    RELOAD_OPTIONS = ("estimator", "trust_scale")  # how gradients pass, not what a checkpoint stores

    def validate(self):
        check_choice("grid", self.grid, gaussian.GRIDS)
        for name in ("weight_bits", "activation_bits"):
            b = getattr(self, name)
            if b is None and name == "activation_bits":
                continue
            try:
                gaussian.check_bits_grid(b, self.grid)
            except ValueError as e:
                extra = " (or None: weight-only)" if name == "activation_bits" else ""
                raise ValueError(f"{name}: {str(e).removeprefix('bits: ')}{extra}") from None
        check_bool("hadamard", self.hadamard)
        if self.hadamard_block_size is not None:
            check_block_size(self.hadamard_block_size, "hadamard_block_size")
        check_positive("trust_scale", self.trust_scale, allow_none=True)
        check_choice("estimator", self.estimator, ESTIMATORS)
        check_choice("save_format", self.save_format, SAVE_FORMATS)
        if self.trust_scale is not None and 1 not in (self.weight_bits, self.activation_bits):
            warn_unused("trust_scale", self.trust_scale, "the outer trust scale applies at 1 bit only")
        if self.hadamard_block_size is not None and not self.hadamard:
            warn_unused("hadamard_block_size", self.hadamard_block_size, "hadamard=False")
        if self.trust_scale is not None and self.estimator == "ste":
            warn_unused("trust_scale", self.trust_scale, "estimator='ste' passes every gradient, and the trust scale "
                                                         "only widens the trust mask")

    # -- derived settings used by the layers
    def block_for(self, in_features: int, layer: str = "linear") -> int:
        """HT block of a layer with this input width, 0 when the transform is off. An explicit
        hadamard_block_size must tile the width (ValueError naming `layer`); None takes the largest power of
        two dividing the width, at most 128."""
        if not self.hadamard:
            return 0
        if self.hadamard_block_size is None:
            block = min(in_features & -in_features, DEFAULT_BLOCK)
            if block < SMALL_BLOCK:
                warnings.warn(
                    f"QuEST: input width {in_features} is divisible by no power of two above {block}, "
                    f"so its Hadamard block is {block}{' (no transform at all)' if block == 1 else ''}: the "
                    f"transform barely spreads outliers there. Keep such layers unquantized (modules_to_not_convert)"
                    f" or accept it", UserWarning, stacklevel=2)
            return block
        return effective_block(in_features, self.hadamard_block_size, layer)

    def outer_trust(self, bits: int) -> float:
        """Outer trust scale s for a tensor quantized to `bits` (1 unless bits == 1)."""
        if bits != 1:
            return 1.0
        if self.trust_scale is not None:
            return float(self.trust_scale)
        return gaussian.default_trust_scale(1, self.hadamard)

    def is_quantizable(self) -> bool:
        return True
