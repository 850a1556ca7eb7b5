"""QParams across processes: the exact broadcast of their stored tensors, before DDP wraps ranks that may differ."""
from __future__ import annotations

import torch
import torch.nn as nn

from . import formats as _formats
from .tensor import QParam


def broadcast_qparams_(module: nn.Module, src: int = 0, group=None, bucket_bytes: int = 250 * 2 ** 20) -> int:
    """Copy the stored codes and scales of every QParam in `module` from rank `src` (of `group`, default: the
    world) to all ranks, bit-exactly.

    DistributedDataParallel broadcasts parameters at construction through their logical (bf16) values; for a
    QParam that is exact only when the ranks already hold the same weights (then it is a no-op: see `copy_`),
    which is the normal case (same checkpoint, or the same seed). When ranks may differ (e.g. unseeded random
    init), call this before wrapping, on every rank. float8 codes travel as uint8 (gloo cannot send float8);
    the variable-length outlier lists of int8_dense_sparse are resized first. Returns the number of QParams."""
    import torch.distributed as dist


    qps = list({id(p): p for p in module.parameters() if isinstance(p, QParam)}.values())
    if not qps:
        return 0
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    var = [(p, k) for p in qps for k in _formats._VARIABLE.get(p.fmt, ())]
    if var:
        n = torch.tensor([getattr(p, k).numel() for p, k in var], dtype=torch.int64, device=qps[0].codes.device)
        dist.broadcast(n, group=pg, group_src=src)
        for (p, k), ni in zip(var, n.tolist()):
            t = getattr(p, k)
            if t.numel() != ni:
                t.set_(t.new_empty((ni,)))  # same tensor object: aliases of this QParam follow
    wire = [t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t
            for p in qps for t in p.qtensors().values() if t.numel()]
    dist._broadcast_coalesced(pg, wire, bucket_bytes, src)
    return len(qps)

