"""Adaptive Quantization Noise (QeRL Sec. 3.3, Alg. 1, App. G-H).

One Gaussian vector per decoder block is added to the RMSNorm weight in front of attention (shared by q, k, v)
and one to the RMSNorm weight in front of the MLP (shared by gate, up): Eq. 10, Fig. 6. Its standard deviation
follows a staged schedule: stage 0 adds nothing (quantization noise only), stages 1..K follow Eq. 8 (or a
linear / cosine / logarithmic decay, App. H) from `sigma_start` to `sigma_end`.

Stage layout (a decision where the paper is ambiguous): Eq. 8 indexes the noisy stages k = 1..K and reaches
`sigma_end` at k = K, while Alg. 1 also has a stage 0 with sigma = 0. We honour both: the run is cut into K + 1
equal intervals, interval 0 is noise-free, interval k >= 1 uses exactly Eq. 8. With K = 10 that is the paper's
"10 evenly spaced injections after a quantization-noise-only start".

The noise for a step is a pure function of (seed, step): resuming from a checkpoint reproduces it exactly.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn

SCHEDULES = ("exponential", "linear", "cosine", "logarithmic")
SCOPES = ("rollout", "rollout_and_old_logprobs")

# model_type -> (norm before attention, norm before MLP), both named relative to a decoder block.
NORM_NAMES = {
    "qwen2": ("input_layernorm", "post_attention_layernorm"),
    "qwen3": ("input_layernorm", "post_attention_layernorm"),
    "qwen2_moe": ("input_layernorm", "post_attention_layernorm"),
    "qwen3_moe": ("input_layernorm", "post_attention_layernorm"),
    "llama": ("input_layernorm", "post_attention_layernorm"),
    "mistral": ("input_layernorm", "post_attention_layernorm"),
    "mixtral": ("input_layernorm", "post_attention_layernorm"),
    "phi3": ("input_layernorm", "post_attention_layernorm"),
    # Gemma 2/3 norm the attention output with post_attention_layernorm; the MLP's input norm is pre_feedforward
    "gemma2": ("input_layernorm", "pre_feedforward_layernorm"),
    "gemma3_text": ("input_layernorm", "pre_feedforward_layernorm"),
    "gemma3": ("input_layernorm", "pre_feedforward_layernorm"),
}
DEFAULT_NORM_NAMES = ("input_layernorm", "post_attention_layernorm")
# blocks that norm their outputs only (x + norm(attn(x))): no norm weight scales a quantized linear's input
POST_NORM_ONLY = {"olmo2", "olmo3"}


@dataclass(frozen=True)
class AQNSchedule:
    """Staged noise schedule. `sigma(step, total_steps)` gives the std for a 0-based optimizer step."""

    sigma_start: float = 1e-2
    sigma_end: float = 5e-4
    num_stages: int = 10
    kind: str = "exponential"

    def __post_init__(self):
        for name in ("sigma_start", "sigma_end"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or self.num_stages < 2:
            raise ValueError(f"num_stages (K) must be an int >= 2, got {self.num_stages!r}")
        if self.kind not in SCHEDULES:
            raise ValueError(f"schedule kind: unknown {self.kind!r}; allowed {SCHEDULES}")
        if self.kind == "exponential":
            if self.sigma_start <= 0 or self.sigma_end <= 0:
                raise ValueError(
                    f"sigma_start and sigma_end must be > 0 for the exponential schedule, got "
                    f"{self.sigma_start!r} -> {self.sigma_end!r}")
            if self.sigma_end > self.sigma_start:
                raise ValueError(
                    f"sigma_end ({self.sigma_end}) must be <= sigma_start ({self.sigma_start}) for the exponential "
                    "schedule (a decay)")

    def stage_sigma(self, k: int) -> float:
        """Noise std of stage k in 0..K (0 -> no added noise)."""
        K = self.num_stages
        if not 0 <= k <= K:
            raise ValueError(f"stage must be in [0, {K}], got {k}")
        if k == 0:
            return 0.0
        t = (k - 1) / (K - 1)
        s0, s1 = float(self.sigma_start), float(self.sigma_end)
        if self.kind == "exponential":  # Eq. 8
            return s0 * (s1 / s0) ** t
        if self.kind == "linear":
            return s0 + (s1 - s0) * t
        if self.kind == "cosine":
            return s1 + (s0 - s1) * 0.5 * (1.0 + math.cos(math.pi * t))
        # logarithmic: falls fast early, flattens late (App. H, Fig. 15)
        return s0 + (s1 - s0) * math.log1p((K - 1) * t) / math.log(K)

    def stage(self, step: int, total_steps: int) -> int:
        """Stage of a 0-based step: K + 1 equal intervals over `total_steps`, clamped at K."""
        if total_steps is None or total_steps <= 0:
            raise ValueError(f"total_steps must be a positive int to place the AQN stages, got {total_steps!r}")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return min(self.num_stages, (step * (self.num_stages + 1)) // total_steps)

    def sigma(self, step: int, total_steps: int) -> float:
        return self.stage_sigma(self.stage(step, total_steps))


def _mix_seed(seed: int, step: int) -> int:
    # splitmix64-style mix so that neighbouring (seed, step) pairs give unrelated streams
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(step) + 0x632BE59BD9B9AC47) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF


def _model_type(model: nn.Module) -> str | None:
    seen = set()
    m = model
    while m is not None and id(m) not in seen:  # unwrap PEFT / DDP wrappers
        seen.add(id(m))
        cfg = getattr(m, "config", None)
        if cfg is not None and getattr(cfg, "model_type", None):
            return cfg.model_type
        m = getattr(m, "module", None) or getattr(m, "base_model", None) or getattr(m, "model", None)
    return None


def resolve_norms(model: nn.Module, norm_names: tuple[str, ...] | list[str] | None = None) -> list[tuple[str, nn.Module]]:
    """The norm modules AQN perturbs, as (qualified name, module), in a fixed order.

    `norm_names` are attribute names inside a decoder block (default: by model_type, see NORM_NAMES).
    Raises ValueError listing the norm-like modules found when nothing matches."""
    guessed = False
    if norm_names is None:
        mt = _model_type(model)
        if mt in POST_NORM_ONLY:
            raise ValueError(f"AQN: model_type {mt!r} norms the outputs of attention and of the MLP (post-norms), "
                             "no norm in front of their quantized linears, so noise in norm weights cannot act as "
                             "noise on those linears (QeRL's AQN); pass aqn=False, or aqn_norm_names=[...] to perturb "
                             "norms of your choosing")
        guessed = mt not in NORM_NAMES
        norm_names = NORM_NAMES.get(mt, DEFAULT_NORM_NAMES)
    norm_names = tuple(norm_names)
    if not norm_names or not all(isinstance(n, str) and n for n in norm_names):
        raise ValueError(f"norm_names must be non-empty attribute names, got {norm_names!r}")
    found = []
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in norm_names:
            w = getattr(mod, "weight", None)
            if not isinstance(w, torch.Tensor) or w.dim() != 1:
                raise ValueError(f"AQN target {name} has no 1-D weight (got {type(mod).__name__}); "
                                 "AQN needs an affine RMSNorm/LayerNorm")
            found.append((name, mod))
    if not found:
        normish = sorted({f"{n.rsplit('.', 1)[-1]} ({type(m).__name__})" for n, m in model.named_modules()
                          if "norm" in n.rsplit(".", 1)[-1].lower() or "norm" in type(m).__name__.lower()})
        raise ValueError(f"AQN found no norm named {list(norm_names)} in {type(model).__name__} "
                         f"(model_type={_model_type(model)!r}); norm-like modules present: {normish or 'none'}. "
                         "Pass aqn_norm_names=[...] naming the norms before attention and before the MLP.")
    hit = {n.rsplit(".", 1)[-1] for n, _ in found}
    if guessed:
        warnings.warn(f"AQN: model_type {_model_type(model)!r} is not one whose norms in front of attention and of "
                      f"the MLP hfq knows; perturbing {sorted(hit)} (check they are those pre-norms, or pass "
                      "aqn_norm_names=[...])", UserWarning, stacklevel=3)
    missing = [n for n in norm_names if n not in hit]
    if missing:
        warnings.warn(f"AQN: no module is named {missing}; only {sorted(hit)} are perturbed", UserWarning,
                      stacklevel=3)
    return found


class AdaptiveQuantizationNoise:
    """Adds / removes per-block Gaussian vectors on the targeted norm weights, restoring them bit-exactly.

    Use `with aqn.noisy(step, sigma): ...` around sampling. The noise is drawn on CPU from a generator seeded by
    (seed, step) in fp32, added in fp32 to the clean weight, then cast to the weight's dtype."""

    def __init__(self, model: nn.Module, norm_names=None, seed: int = 0):
        self.model = model
        self.seed = int(seed)
        self.targets = resolve_norms(model, norm_names)
        self._clean: list[torch.Tensor] | None = None
        self.last_applied_std: float = 0.0
        self._warned_rounding = False

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.targets]

    def sample(self, step: int, sigma: float) -> list[torch.Tensor]:
        """The fp32 noise vectors of a step (one per target), a pure function of (seed, step, sigma)."""
        g = torch.Generator(device="cpu").manual_seed(_mix_seed(self.seed, step))
        return [torch.randn(m.weight.shape, generator=g, dtype=torch.float32) * float(sigma) for _, m in self.targets]

    def apply(self, step: int, sigma: float) -> None:
        if self._clean is not None:
            raise RuntimeError("AQN noise is already applied; restore() first")
        if not (math.isfinite(sigma) and sigma >= 0):
            raise ValueError(f"sigma must be finite and >= 0, got {sigma}")
        self._clean = [m.weight.detach().clone() for _, m in self.targets]
        if sigma == 0:
            self.last_applied_std = 0.0
            return
        sq, n = 0.0, 0
        with torch.no_grad():
            for (_, m), clean, z in zip(self.targets, self._clean, self.sample(step, sigma)):
                noisy = (clean.float() + z.to(clean.device)).to(clean.dtype)
                m.weight.data.copy_(noisy)
                d = noisy.float() - clean.float()
                sq += float((d * d).sum())
                n += d.numel()
        # what actually reached the weights (bf16 norms near 1.0 round away sigma < ~4e-3)
        self.last_applied_std = math.sqrt(sq / max(n, 1))
        if self.last_applied_std < 0.5 * sigma and not self._warned_rounding:
            self._warned_rounding = True
            warnings.warn(
                f"AQN: sigma {sigma:.3g} reaches the norm weights as std {self.last_applied_std:.3g}: their dtype "
                f"({self._clean[0].dtype}) rounds most of it away (its step near 1.0 is 2^-8..2^-7). The logged "
                "aqn/applied_std is the noise that got through; stochastic rounding would keep the mean but add "
                "noise of about the step, so the weights are left as they round.", stacklevel=3)

    def restore(self) -> None:
        if self._clean is None:
            return
        with torch.no_grad():
            for (_, m), clean in zip(self.targets, self._clean):
                m.weight.data.copy_(clean)
        self._clean = None

    @contextlib.contextmanager
    def noisy(self, step: int, sigma: float):
        self.apply(step, sigma)
        try:
            yield self
        finally:
            self.restore()
