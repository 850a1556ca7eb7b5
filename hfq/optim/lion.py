"""QLion: the Lion optimizer with INT8 momentum, for QParam weights (no master copy) and ordinary parameters.

QFT Algorithm 2 (Lion, Appendix A, with quantized states), per parameter:
  g = dequant(INT8 gradient)          (QFTConfig(gradient_bits=8) store; else the ordinary .grad)
  m = dequant(INT8 momentum)
  c = beta1*m + (1-beta1)*g
  w = w - lr*(sign(c) + weight_decay*w)      (decoupled weight decay)
  m = beta2*m + (1-beta2)*g;  m -> INT8      (QFT eq. 1-2: asymmetric min-max, one scale + zero point per row,
                                              "channel-wise quantization for all quantizers of model states")
  w -> its format: QParam.requantize_(w) (INT8 dense + bf16 sparse outliers for QFT), or in place for plain params.

Rounding of the weight requantization defaults to stochastic ("sr"), not the paper's round-to-nearest: a Lion step
moves each weight by exactly lr, and with RTN any lr below half an INT8 step of its row is rounded away, every step
(tests/test_qft_lion.py shows the weights frozen). SR keeps the update unbiased. rounding="rtn" gives the paper's
quantizer. Momentum and gradients use RTN, as in the paper.

Safety and checkpoints as ECO (hfq.optim.base): every gradient (float and INT8) is checked for NaN/Inf before
any parameter is touched (ValueError naming the parameter); `state_dict()` holds the INT8 momentum codes (uint8),
their fp32 scales and uint8 zero points as such plus the SR generator state; `load_state_dict` restores them
bit-exactly.
"""
from __future__ import annotations

import torch

from hfq_kernels.reference.intq import as_rows, dequantize_int_asym, quantize_int_asym
from ..qparam import QParam
from .base import QParamOptimizer

MOMENTUM_BITS = (None, 8)


def lion_direction(m: torch.Tensor, g: torch.Tensor, beta1: float) -> torch.Tensor:
    """sign(beta1*m + (1-beta1)*g): Lion's update direction (entries in {-1, 0, 1})."""
    return torch.sign(m * beta1 + g * (1 - beta1))


class QLion(QParamOptimizer):
    """Lion with INT8 (channel-wise asymmetric) momentum; QParams updated through requantize_, no master weights.

    Args: lr (> 0), betas (beta1: interpolation for the update, beta2: momentum EMA; both in (0, 1)),
    weight_decay (decoupled, >= 0), rounding ("sr" default / "rtn": weight requantization), momentum_bits
    (8 default; None keeps fp32 momentum, the float reference), seed (SR generator), check_finite,
    refresh_thresholds_every (None: each int8_dense_sparse weight follows its QFTConfig.outlier_refresh_steps;
    N > 0 overrides it: its outlier thresholds are re-set from the updated weight on every N-th step of it. The
    paper refreshes them once per epoch (App. C): pass steps per epoch).
    """

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0,
                 rounding: str = "sr", momentum_bits: int | None = 8, seed: int = 0, check_finite: bool = True,
                 refresh_thresholds_every: int | None = None):
        if momentum_bits is not None and (isinstance(momentum_bits, bool) or momentum_bits not in (8,)):
            raise ValueError(f"momentum_bits must be one of {MOMENTUM_BITS}, got {momentum_bits!r}")
        if refresh_thresholds_every is not None and (isinstance(refresh_thresholds_every, bool) or not isinstance(
                refresh_thresholds_every, int) or refresh_thresholds_every <= 0):
            raise ValueError(f"refresh_thresholds_every must be None or an int > 0, got {refresh_thresholds_every!r}")
        self.momentum_bits = momentum_bits
        self.refresh_thresholds_every = refresh_thresholds_every
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay), rounding=rounding, seed=seed,
                         check_finite=check_finite)

    # ---- momentum storage -----------------------------------------------------------------------------
    def _init_state(self, state, p):
        state["step"] = torch.tensor(0.0)
        if self.momentum_bits == 8:
            rows, cols = as_rows(p.shape)
            dev = p.device
            state["exp_avg_codes"] = torch.zeros((rows, cols), dtype=torch.uint8, device=dev)
            state["exp_avg_scales"] = torch.ones((rows, 1), dtype=torch.float32, device=dev)
            state["exp_avg_zeros"] = torch.zeros((rows, 1), dtype=torch.uint8, device=dev)
        else:
            state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)

    def _load_m(self, state, shape) -> torch.Tensor:
        if self.momentum_bits == 8:
            return dequantize_int_asym(state["exp_avg_codes"], state["exp_avg_scales"], state["exp_avg_zeros"],
                                       shape=shape)
        return state["exp_avg"]

    def _store_m(self, state, m) -> None:
        if self.momentum_bits == 8:
            codes, scales, zeros = quantize_int_asym(m, 8, check=False)
            state["exp_avg_codes"].copy_(codes)
            state["exp_avg_scales"].copy_(scales)
            state["exp_avg_zeros"].copy_(zeros)
        # fp32: m is state["exp_avg"] itself, updated in place

    # ---- the step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss, pending = self._begin_step(closure)
        self._finish_check(pending)
        for group in self.param_groups:
            for p in group["params"]:
                if self._has_grad(p):
                    self.update_param_(p, self._grad32(p), group)
        return loss

    @torch.no_grad()
    def update_param_(self, p: torch.Tensor, g: torch.Tensor, group: dict) -> None:
        """One Lion step of parameter `p` with its float32 gradient `g` (no NaN/Inf check here: step() checks every
        gradient first). The unit that step() loops over, and that a step applied during backward calls."""
        lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
        state = self.state[p]
        if not state:
            self._init_state(state, p)
        state["step"] += 1
        m = self._load_m(state, p.shape)
        if isinstance(p, QParam):
            refresh = self._outlier_refresh_due(p)
            if lr != 0 or refresh:  # a refresh due at lr == 0 still re-selects the outliers
                w = p.dequantize(torch.float32)
                if wd:
                    w.mul_(1 - lr * wd)
                w.sub_(lion_direction(m, g, b1), alpha=lr)
                self._requantize(p, w, refresh_thresholds=refresh)
        elif lr != 0:
            if wd:
                p.mul_(1 - lr * wd)
            p.sub_(lion_direction(m, g, b1).to(p.dtype), alpha=lr)
        m.mul_(b2).add_(g, alpha=1 - b2)
        self._store_m(state, m)
