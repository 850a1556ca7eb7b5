"""ECO update rules as plain functions on tensors of any float dtype (the reference; float64 in tests).

SGDM with master weights: v = beta*v + g; w = w*(1 - lr*wd) - lr*v. ECO keeps only theta = Q(w) and m:
  memory-free (ECO): m = beta*m + g; tmp = theta*(1 - lr*wd) - lr*m; theta = Q(tmp); e = tmp - theta;
                     m -= (1 - beta)/(beta*lr) * e
  exact:             also stores the residual e of the current theta. The paper's injection
                     m += e_prev/lr - e/(lr*beta) is applied lazily, at the next step when that step's lr is
                     known: then the stored m is exactly the master momentum, the update direction is
                     m - e/lr, and theta - lr*(m - e/lr) = (theta + e) - lr*m reproduces the master weights'
                     trajectory exactly, even when lr changes between steps.
Adam(W): the same with Adam's element-wise step lr_t = lr/((1-beta1^t)(sqrt(v_hat)+eps)) for lr and beta1 for
beta (m carries the (1-beta1) factor on g, which leaves the injection coefficient unchanged):
  m -= (1 - beta1)/(beta1*lr_t) * e.
`requant(tmp)` stores Q(tmp) and returns the error tmp - Q(tmp). lr == 0 (warm-up start) leaves the weights
alone, as master weights would; momentum still accumulates.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

RULES = ("memory_free", "exact", "naive")  # naive: no error feedback (the paper's baseline)


def eco_sgdm_(theta: torch.Tensor, m: torch.Tensor, g: torch.Tensor, *, lr: float, beta: float, weight_decay: float,
              requant: Callable[[torch.Tensor], torch.Tensor], rule: str = "memory_free",
              residual: torch.Tensor | None = None) -> None:
    """One ECO-SGDM step; updates m (and residual for the exact rule) in place, the weight through requant."""
    m.mul_(beta).add_(g)
    if lr == 0:
        return
    base = theta + residual if rule == "exact" else theta
    tmp = base * (1 - lr * weight_decay) - lr * m
    e = requant(tmp)
    if rule == "exact":
        residual.copy_(e)
    elif rule == "memory_free":
        m.sub_(e, alpha=(1 - beta) / (beta * lr))


def _sqrt_rn(v: torch.Tensor) -> torch.Tensor:
    """Correctly rounded square root. torch's vectorized float32 sqrt on CPU is not (about 15% of results one ulp
    off on an AVX2 build); through float64 the result rounds correctly on every device."""
    if v.dtype == torch.float64:
        return v.sqrt()
    return v.double().sqrt_().to(v.dtype)


def adam_moments_(m, v, g, *, beta1: float, beta2: float, step: int, eps: float, lr: float):
    """Update Adam moments in place; return (step_size, denom) with lr_t = step_size / denom."""
    # one rounding per op (no alpha=/value= forms, whose kernels fuse a multiply-add on some builds and not on
    # others): the fused Triton step does the same ops in the same order and matches bit for bit
    m.mul_(beta1).add_(g * (1 - beta1))
    v.mul_(beta2).add_((g * g).mul_(1 - beta2))
    bc1 = 1 - beta1 ** step
    bc2 = 1 - beta2 ** step
    denom = _sqrt_rn(v).mul_(1 / math.sqrt(bc2)).add_(eps)
    return lr / bc1, denom


def eco_adamw_(theta, m, v, g, *, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               requant: Callable[[torch.Tensor], torch.Tensor], rule: str = "memory_free",
               residual: torch.Tensor | None = None) -> None:
    """One ECO-AdamW step (decoupled weight decay); m, v (and residual) updated in place."""
    step_size, denom = adam_moments_(m, v, g, beta1=beta1, beta2=beta2, step=step, eps=eps, lr=lr)
    if lr == 0:
        return
    base = theta + residual if rule == "exact" else theta
    tmp = base * (1 - lr * weight_decay) - step_size * (m / denom)
    e = requant(tmp)
    if rule == "exact":
        residual.copy_(e)
    elif rule == "memory_free":
        m.sub_((e * denom).mul_((1 - beta1) / (beta1 * step_size)))


def sgdm_(p, m, g, *, lr, beta, weight_decay) -> None:
    """Plain SGD with momentum and decoupled weight decay (for ordinary parameters)."""
    m.mul_(beta).add_(g)
    p.mul_(1 - lr * weight_decay).add_(m, alpha=-lr)


def adamw_(p, m, v, g, *, step, lr, beta1, beta2, eps, weight_decay) -> None:
    """Plain AdamW (for ordinary parameters)."""
    step_size, denom = adam_moments_(m, v, g, beta1=beta1, beta2=beta2, step=step, eps=eps, lr=lr)
    p.mul_(1 - lr * weight_decay).addcdiv_(m, denom, value=-step_size)
