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

Safety and checkpoints as hfq.eco: every gradient (float and INT8) is checked for NaN/Inf before any parameter is
touched (ValueError naming the parameter); `state_dict()` holds the INT8 momentum codes (uint8), their fp32 scales
and uint8 zero points as such plus the SR generator state, and `load_state_dict` restores them bit-exactly.
"""
from __future__ import annotations

import torch

from hfq_kernels.reference.fp8 import check_rounding
from ..optim_base import SeededOptimizer, check_beta, check_lr
from ..qparam import QParam
from .int8 import as_rows, dequantize_rows, int8_grad, pop_int8_grad, quantize_rows

MOMENTUM_BITS = (None, 8)


def lion_direction(m: torch.Tensor, g: torch.Tensor, beta1: float) -> torch.Tensor:
    """sign(beta1*m + (1-beta1)*g): Lion's update direction (entries in {-1, 0, 1})."""
    return torch.sign(m * beta1 + g * (1 - beta1))


class QLion(SeededOptimizer):
    """Lion with INT8 (channel-wise asymmetric) momentum; QParams updated through requantize_, no master weights.

    Args: lr (> 0), betas (beta1: interpolation for the update, beta2: momentum EMA; both in (0, 1)),
    weight_decay (decoupled, >= 0), rounding ("sr" default / "rtn": weight requantization), momentum_bits
    (8 default; None keeps fp32 momentum, the float reference), seed (SR generator), check_finite,
    refresh_thresholds_every (None: int8_dense_sparse outlier thresholds stay as set at quantization; N: recomputed
    on every N-th step of a parameter. The paper refreshes them once per epoch (App. C): pass steps per epoch).
    """

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0,
                 rounding: str = "sr", momentum_bits: int | None = 8, seed: int = 0, check_finite: bool = True,
                 refresh_thresholds_every: int | None = None):
        check_lr(lr)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        check_beta("betas[0]", betas[0])
        check_beta("betas[1]", betas[1])
        if not isinstance(weight_decay, (int, float)) or not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        check_rounding(rounding)
        if momentum_bits is not None and (isinstance(momentum_bits, bool) or momentum_bits not in (8,)):
            raise ValueError(f"momentum_bits must be one of {MOMENTUM_BITS}, got {momentum_bits!r}")
        if refresh_thresholds_every is not None and (isinstance(refresh_thresholds_every, bool) or not isinstance(
                refresh_thresholds_every, int) or refresh_thresholds_every <= 0):
            raise ValueError(f"refresh_thresholds_every must be None or an int > 0, got {refresh_thresholds_every!r}")
        self.rounding, self.momentum_bits, self.check_finite = rounding, momentum_bits, check_finite
        self.refresh_thresholds_every = refresh_thresholds_every
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay), seed=seed)

    # ---- safety ---------------------------------------------------------------------------------------
    def _param_name(self, gi, pi, p):
        names = self.param_groups[gi].get("param_names")
        if names:
            return names[pi]
        q8 = int8_grad(p)
        if q8 is not None and q8.name:
            return q8.name
        kind = f"QParam {p.fmt}" if isinstance(p, QParam) else "param"
        return f"param_groups[{gi}]['params'][{pi}] ({kind} {tuple(p.shape)})"

    def _check_grads(self):
        """One host sync: refuse the step if any float or INT8 gradient held NaN/Inf."""
        items, flags = [], []
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                q8 = int8_grad(p)
                if q8 is not None:
                    items.append((gi, pi, p))
                    flags.append(q8.finite.reshape(()).cpu() if q8.finite.device.type != "cpu" else q8.finite)
                if p.grad is not None:
                    items.append((gi, pi, p))
                    flags.append(torch.isfinite(p.grad).all().cpu())
        if not items:
            return
        ok = torch.stack([f.reshape(()) for f in flags])
        if bool(ok.all()):
            return
        gi, pi, p = items[int((~ok).nonzero()[0])]
        raise ValueError(f"non-finite gradient (NaN/Inf) in {self._param_name(gi, pi, p)}: step refused, "
                         "no parameter was updated")

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
            return dequantize_rows(state["exp_avg_codes"], state["exp_avg_scales"], state["exp_avg_zeros"], shape)
        return state["exp_avg"]

    def _store_m(self, state, m) -> None:
        if self.momentum_bits == 8:
            codes, scales, zeros = quantize_rows(m)
            state["exp_avg_codes"].copy_(codes)
            state["exp_avg_scales"].copy_(scales)
            state["exp_avg_zeros"].copy_(zeros)
        # fp32: m is state["exp_avg"] itself, updated in place

    # ---- the step -----------------------------------------------------------------------------------
    def _grad32(self, p) -> torch.Tensor | None:
        q8 = pop_int8_grad(p)
        g = q8.dequantize(torch.float32) if q8 is not None else None
        if p.grad is not None:
            pg = p.grad.float()
            g = pg if g is None else g + pg
        return g

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.check_finite:
            self._check_grads()
        for group in self.param_groups:
            lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None and int8_grad(p) is None:
                    continue
                g = self._grad32(p)
                state = self.state[p]
                if not state:
                    self._init_state(state, p)
                state["step"] += 1
                m = self._load_m(state, p.shape)
                if lr != 0:
                    d = lion_direction(m, g, b1)
                    if isinstance(p, QParam):
                        w = p.dequantize(torch.float32)
                        if wd:
                            w.mul_(1 - lr * wd)
                        w.sub_(d, alpha=lr)
                        gen = self._generator(p.device) if self.rounding == "sr" else None
                        n = self.refresh_thresholds_every
                        refresh = bool(n) and p.fmt == "int8_dense_sparse" and int(state["step"]) % n == 0
                        p.requantize_(w, self.rounding, gen, refresh_thresholds=refresh)
                    else:
                        if wd:
                            p.mul_(1 - lr * wd)
                        p.sub_(d.to(p.dtype), alpha=lr)
                m.mul_(b2).add_(g, alpha=1 - b2)
                self._store_m(state, m)
        return loss

    def zero_grad(self, set_to_none: bool = True):
        """Also drops pending INT8 gradients of this optimizer's parameters (they play the role of .grad)."""
        super().zero_grad(set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                pop_int8_grad(p)

    def state_bytes(self) -> int:
        """Bytes held in this optimizer's state tensors (momentum codes, scales, zero points, step counters)."""
        return sum(t.numel() * t.element_size() for st in self.state.values() for t in st.values()
                   if torch.is_tensor(t))
