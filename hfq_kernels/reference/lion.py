"""Lion on INT8 momentum in pure torch: the oracles of hfq_kernels/qlion.py's fused steps (same in/out contracts,
one rounding per op; formats in intq.py)."""
from __future__ import annotations

import torch

from . import intq


def lion_plain_step_ref(p: torch.Tensor, g: torch.Tensor, mom: dict, *, lr: float, beta1: float, beta2: float,
                        weight_decay: float, rounding: str = "rtn", generator: torch.Generator | None = None) -> None:
    """Torch reference of qlion.lion_plain_step_, one rounding per op (torch's own bf16 `sub_(alpha=lr)` on CPU
    rounds lr to bf16 first, and its fp32 `add_(alpha=)` may fuse the multiply-add: hfq.qft.QLion's torch path
    differs from this by such last bits)."""
    rows, cols = mom["codes"].shape
    m = intq.dequantize_int_asym(mom["codes"], mom["scales"], mom["zeros"])
    g = g.reshape(rows, cols).float()
    d = torch.sign(m * beta1 + g * (1 - beta1))
    w = p.reshape(rows, cols).float()
    sr = rounding == "sr" and p.dtype == torch.bfloat16  # one stochastic rounding of the fp32 update
    if weight_decay:
        w = w * (1 - lr * weight_decay) if sr else (w * (1 - lr * weight_decay)).to(p.dtype).float()
    w = w - d * lr
    p.copy_((intq.round_bf16(w, "sr", generator) if sr else w.to(p.dtype)).reshape(p.shape))
    m = m * beta2 + g * (1 - beta2)
    c, s, z = intq.quantize_int_asym(m, 8, check=False)
    mom["codes"].copy_(c)
    mom["scales"].copy_(s)
    mom["zeros"].copy_(z)


def qlion_dense_sparse_step_ref(w: dict, grad: dict, mom: dict, *, lr, beta1, beta2, weight_decay, rounding="sr",
                                seed=0, generator=None):
    """Torch reference of qlion.qlion_dense_sparse_step_ (hfq.qft.QLion's unfused update, same in/out contract)."""
    rows, cols = w["codes"].shape
    val = intq.dequantize_dense_sparse(w["codes"], w["scales"], w["zeros"], w["sparse_idx"], w["sparse_val"])
    g = (intq.dequantize_int_asym(grad["codes"], grad["scales"], grad["zeros"]) if "codes" in grad
         else grad["value"].reshape(rows, cols).float())
    m = intq.dequantize_int_asym(mom["codes"], mom["scales"], mom["zeros"])
    if weight_decay:
        val.mul_(1 - lr * weight_decay)
    val.sub_(torch.sign(m * beta1 + g * (1 - beta1)), alpha=lr)
    if rounding == "sr" and generator is None:
        generator = torch.Generator(device=val.device)
        generator.manual_seed(int(seed))
    new = intq.quantize_dense_sparse(val, w["thresholds"], rounding, generator)
    for k in ("codes", "scales", "zeros"):
        w[k].copy_(new[k])
    m.mul_(beta2).add_(g, alpha=1 - beta2)
    c, s, z = intq.quantize_int_asym(m, 8, check=False)
    mom["codes"].copy_(c)
    mom["scales"].copy_(s)
    mom["zeros"].copy_(z)
    return new["sparse_idx"], new["sparse_val"]
