"""`QFTConfig`: load any causal LM with its decoder linears as trainable quantized weights (QParam)."""
from __future__ import annotations

from dataclasses import dataclass, field

from hfq_kernels.reference.fp8 import ROUNDINGS

from .._base.config import HfqConfig, check_choice, warn_unused
from ..qparam import FORMATS, check_format

QUANT_METHOD = "hfq_qft"
GRADIENT_BITS = (None, 8)


def check_gradient_bits(bits):
    """None (bf16 .grad, as autograd makes it) or 8 (INT8 store); anything else is a ValueError."""
    if bits is not None and (isinstance(bits, bool) or bits not in (8,)):
        raise ValueError(f"gradient_bits: expected one of {GRADIENT_BITS}, got {bits!r}")
    return bits


@dataclass
class QFTConfig(HfqConfig):
    """Full-parameter training on quantized weights: each decoder nn.Linear becomes a QLinear holding a QParam.

    weight_format: "int8_dense_sparse" (QFT: INT8 per channel + bf16 outliers), "fp8_e4m3_row" (ECO),
        "int4_tensor" or "int4_group" (ECO fine-tuning).
    group_size: int4_group's group (input elements per scale); None (default) picks per layer 128 when it divides
        in_features, else the largest divisor of in_features below 128 (576 -> 96), with a warning saying which. outlier_fraction: int8_dense_sparse's tails, in
        [0, 0.2] (checked for every format): per weight, the thresholds (T_min, T_max) are its fraction/2 lower and
        upper quantiles, set at load; elements outside them are kept as bf16 (int32 flat index + value, 6 bytes each,
        counted by hfq.qft.state_bytes), the rest is INT8 per row.
    outlier_refresh_steps: QFT's lazy threshold update (App. C). Between refreshes each optimizer step re-splits the
        updated weight with the thresholds set at load (an element that grows past them becomes an outlier); every
        `outlier_refresh_steps`-th optimizer step of a weight (QLion, ECOAdamW, ECOSGD) the thresholds are re-set
        from the current weight, so the outlier count returns to outlier_fraction x numel. The paper refreshes
        once per epoch: pass your optimizer steps per epoch, or give Trainer the callback
        hfq.qft.OutlierRefreshPerEpoch(), which counts them. 0 (default) = never: the thresholds from load are
        kept, as the paper does within an epoch (a config cannot know an epoch's length). Deterministic and a
        function of the weights and the optimizer's step count only, so DDP ranks and resumed runs agree.
    rounding: rounding of the initial quantization ("rtn" | "sr"; "sr" draws per layer from torch.initial_seed(),
        i.e. the seed set before loading, and leaves torch's random stream as it was).
    gradient_bits: None (default: weight gradients are ordinary bf16 `.grad`, all-reduced by DDP) or 8 (QFT's INT8
        gradients: each quantized linear's `.grad` is an hfq.qparam.Int8Grad, INT8 codes + per-row scale/zero point,
        read by hfq's QLion / ECO). Gradient accumulation dequantizes, adds and requantizes (1 byte/element between
        micro-steps; error within the sum of the half-steps). Trainer's max_grad_norm (torch's clip_grad_norm_) counts
        it in the norm and scales its row scales. Under DDP it is averaged over ranks inside backward (an
        all-reduce, bf16 on CUDA, else fp32), before storage, so ranks hold identical codes; DDP is told to skip
        those weights (`_ddp_params_and_buffers_to_ignore`, set on the converted model: wrap that model, not a
        submodule). Under FSDP2 it is reduce-scattered (bf16 on CUDA, else fp32; several weights per collective)
        and quantized once per shard (the rows this rank holds).
    modules_to_not_convert: modules kept in high precision, matched by transformers' rule (hfq._base.surgery);
        None = transformers' defaults (the output embedding and modules tied to it).
    strict: raise instead of leaving a linear-like layer that is not an nn.Linear (e.g. GPT-2's Conv1D) in high
        precision with a warning.
    Train with hfq.qft.QLion (QFT) or hfq.eco.ECOAdamW / ECOSGD: plain torch optimizers are refused.
    """

    weight_format: str = "int8_dense_sparse"
    group_size: int | None = None
    outlier_fraction: float = 0.01
    outlier_refresh_steps: int = 0
    rounding: str = "rtn"
    gradient_bits: int | None = None
    modules_to_not_convert: list[str] | None = field(default_factory=lambda: ["lm_head", "embed_tokens"])
    strict: bool = False
    quant_method: str = QUANT_METHOD

    QUANT_METHOD = QUANT_METHOD
    RELOAD_OPTIONS = ("gradient_bits", "outlier_refresh_steps")  # how the model trains, not what a checkpoint stores

    def validate(self):
        check_choice("weight_format", self.weight_format, FORMATS)
        check_choice("rounding", self.rounding, ROUNDINGS)
        check_format(self.weight_format, None, self.format_options)
        check_format("int8_dense_sparse", None, self._outlier_options)  # any format: fail early
        check_gradient_bits(self.gradient_bits)
        fmt = f"weight_format={self.weight_format!r}"
        if self.weight_format != "int4_group" and self.group_size is not None:
            warn_unused("group_size", self.group_size, f"{fmt} has no groups (int4_group only)")
        if self.weight_format != "int8_dense_sparse":
            for f, default in (("outlier_fraction", 0.01), ("outlier_refresh_steps", 0)):
                if getattr(self, f) != default:
                    warn_unused(f, getattr(self, f), f"{fmt} has no outliers (int8_dense_sparse only)")

    @property
    def format_options(self) -> dict:
        if self.weight_format == "int4_group":
            return {"group_size": self.group_size}
        if self.weight_format == "int8_dense_sparse":
            return self._outlier_options
        return {}


    @property
    def _outlier_options(self) -> dict:
        return {"outlier_fraction": self.outlier_fraction, "outlier_refresh_steps": self.outlier_refresh_steps}
