"""Static model-state memory (weights + gradients + optimizer state), measured from the tensors actually held.

QFT's memory claim (Table 1) is about these three; activations are excluded. Call `state_bytes` after a backward
and before `optimizer.step()` (when gradients are alive) — or after a step for weights + optimizer state only.
"""
from __future__ import annotations

import torch
from torch import nn

from ..qparam import QParam, int8_grad


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                only_quantized: bool = False, select=None) -> dict:
    """{'params', 'weights', 'grads', 'optimizer', 'total', 'bytes_per_param', 'weights_sparse', 'outliers'} over
    the model's parameters (QParams only if `only_quantized`; those with `select(name, param)` true if given).
    Weights: every stored tensor of a QParam (int8_dense_sparse: INT8 codes, row scales and zero points, the two
    thresholds, and the sparse part), numel*itemsize otherwise; grads: the INT8 store or `.grad`; optimizer: every
    tensor in optimizer.state[p]. weights_sparse: the bytes of the sparse parts alone (int32 index + bf16 value per
    outlier, included in 'weights'); outliers: their count (it varies as weights cross the thresholds)."""
    opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    seen, out = set(), dict(params=0, weights=0, grads=0, optimizer=0, weights_sparse=0, outliers=0)
    for name, p in model.named_parameters():
        if id(p) in seen or (only_quantized and not isinstance(p, QParam)) or (select and not select(name, p)):
            continue
        seen.add(id(p))
        out["params"] += p.numel()
        out["weights"] += p.storage_bytes if isinstance(p, QParam) else _nbytes(p)
        if isinstance(p, QParam) and p.fmt == "int8_dense_sparse":
            out["weights_sparse"] += _nbytes(p.sparse_idx) + _nbytes(p.sparse_val)
            out["outliers"] += p.sparse_idx.numel()
        q8 = int8_grad(p)
        if q8 is not None:
            out["grads"] += q8.nbytes
        elif p.grad is not None:
            out["grads"] += _nbytes(p.grad)
        if opt is not None and p in opt.state:
            out["optimizer"] += sum(_nbytes(t) for t in opt.state[p].values() if torch.is_tensor(t))
    out["total"] = out["weights"] + out["grads"] + out["optimizer"]
    out["bytes_per_param"] = out["total"] / max(out["params"], 1)
    return out
