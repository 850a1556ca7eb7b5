"""Decode-step fusions of NVFP4 linears in the g4 layout (the rollout decoder's): 2-3 weights sharing an input
(q/k/v, gate/up) as one grouped Gluon launch, and their unmerged LoRA with the base's split-K reduce done by the
LoRA expand's launch (hfq_kernels.lora).

A weight is handed in as its decode operands (words, scales, global_scale, bias, out_features): G4Operands, what
NVFP4Linear.decode_operands() gives.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from hfq_kernels import lora as _lora
from hfq_kernels import nvfp4_gluon as gluon
from hfq_kernels._triton import LRU, cdiv, pdl_bound
from hfq_kernels.nvfp4_configs import LINEAR_TUNER, gluon_config, splits
from hfq_kernels.nvfp4_matmul import _splitk_reduce_group_kernel
from hfq_kernels.nvfp4_plan import check_g4_call
from hfq_kernels.nvfp4_quant import recip


class G4Operands(NamedTuple):
    """One NVFP4 weight in the g4 layout as the decode kernels read it: words int32, scales u8 (nvfp4_gluon's
    layout), the global-scale reciprocal [1], bias [out_features] or None, and out_features."""

    words: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    bias: torch.Tensor | None
    out_features: int


_GROUP_PLANS = LRU(64)  # (M, widths, K, bias?, dtype, device) -> grouped forward (few shapes: a model's groups)


def group_g4_ok(x2: torch.Tensor, weights) -> bool:
    """Whether linear_group_g4 can take x2 [M, K] and weights [(wr, sr, global_scale, bias, n)]: 2-3 of them,
    the Gluon kernel's inputs (bf16, M <= 64, sm_80+), fp32 global scales, biases all None or all x2's dtype."""
    if not (2 <= len(weights) <= 3 and gluon.supported(x2) and x2.stride(-1) == 1):
        return False
    k = x2.shape[1]
    hb = {w[3] is not None for w in weights}
    return (len(hb) == 1 and all(w[2].dtype == torch.float32 and w[4] % 16 == 0 and w[4] > 0 for w in weights)
            and all(w[3] is None or (w[3].dtype == x2.dtype and w[3].is_contiguous()) for w in weights)
            and all(gluon.g4_numel(w[4], k) == (w[0].numel(), w[1].numel()) for w in weights))


def linear_group_g4(x2: torch.Tensor, weights, checked: bool = False) -> list:
    """[x2 @ W_g^T + b_g] for 2-3 g4 weights sharing x2 (q/k/v, gate/up of a decode step): one Gluon launch for
    all of them (and one split-K reduce), where separate calls take one (or two) each. weights: [(wr, sr,
    global_scale, bias, n)]; raises unless group_g4_ok (`checked`: the caller has asked it). The values are those
    of the per-weight kernel at the group's split-K (the split is chosen for the group's total width)."""
    if not checked and not group_g4_ok(x2, weights):
        raise ValueError(
            "nvfp4 grouped linear: needs 2-3 g4 weights (words, scales, fp32 global scale, bias, out_features: a "
            "multiple of 16) sharing a contiguous bf16 x [M <= 64, K] on an sm_80+ GPU, biases all None or all in "
            f"x's dtype; got x {tuple(x2.shape)} {x2.dtype} on {x2.device}, out_features "
            f"{[w[4] for w in weights]}, global scales {[w[2].dtype for w in weights]}")
    m, k = x2.shape
    ns = tuple(w[4] for w in weights)
    hb = weights[0][3] is not None
    key = (m, ns, k, hb, x2.dtype, x2.device)
    return _GROUP_PLANS.get_or(key, lambda: _group_plan(m, ns, k, hb, x2.dtype, x2.device))(x2, weights)


def _group_plan(m, ns, k, hb, dt, dev):
    cfg = gluon_config(m, sum(ns), k, dev)
    split, cps = splits(cdiv(k, 64), cfg.get("split", 1))
    run = gluon.group_launcher(m, ns, k, cfg, split, cps, hb)
    g = len(ns)
    nmax, total = max(ns), sum(ns)
    offs = [0, ns[0], ns[0] + ns[1]][:g]
    reduce = pdl_bound(_splitk_reduce_group_kernel, (cdiv(m * nmax, 1024), g),
                       dict(HAS_BIAS=hb, BLOCK=1024, num_warps=4))
    n2 = ns[2] if g == 3 else ns[1]

    def fwd(x2, weights, sh=None, join=None):
        outs = [torch.empty((m, n), dtype=dt, device=dev) for n in ns]
        members = [(w[0], w[1], w[2], w[3]) for w in weights]
        if split == 1:
            run(x2, members, outs)
            return outs if sh is None else _expand_after(sh, outs, None, join)
        part = torch.empty(split * m * total, dtype=torch.float32, device=dev)
        dsts = [part[o * split * m:(o + n) * split * m] for o, n in zip(offs, ns)]
        run(x2, members, dsts)
        if sh is not None:  # the reduce done by the LoRA expand's launch
            return _expand_after(sh, outs, ([d.view(split, m, n) for d, n in zip(dsts, ns)], split,
                                            [w[3] for w in weights]), join)
        bs = [w[3] if w[3] is not None else w[2] for w in weights]
        ys = outs + outs[-1:] if g == 2 else outs
        bs = bs + bs[-1:] if g == 2 else bs
        reduce.pick(dev)(part, *bs, *ys, m, ns[0], ns[1], n2, split)
        return outs

    return fwd


def lora_g4_ok(x2: torch.Tensor, weights) -> bool:
    """Whether linear_lora_g4 can take x2 with these g4 weights: 2-3 as group_g4_ok; one weight: bf16 x2 [M <= 64,
    K] with contiguous rows on a GPU that runs the Gluon kernel, bias None or in x2's dtype, tensors of the layout."""
    if len(weights) != 1:
        return group_g4_ok(x2, weights)
    wr, sr, gs, bias, n = weights[0]
    return (x2.dim() == 2 and x2.shape[0] >= 1 and x2.stride(-1) == 1 and gluon.supported(x2)
            and gs.numel() == 1 and (bias is None or (bias.dtype == x2.dtype and bias.shape == (n,)))
            and gluon.g4_numel(n, x2.shape[1]) == (wr.numel(), sr.numel()))


_LORA_PLANS = LRU(64)  # (M, N, K, bias?, dtype, device, tuner gen) -> (split, launcher) of a single g4 + LoRA


def linear_lora_g4(x2: torch.Tensor, weights, sh, join=None) -> list:
    """[x2 @ W_g^T + b_g + scale_g (x2 A_g^T) B_g^T] for 1-3 g4 weights sharing x2 [M <= 64, K] (weights as for
    linear_group_g4) whose LoRA shrink `sh` (hfq_kernels.lora.Shrink, one adapter per weight) has run: the base
    products as linear_g4 (one weight: the module's own plan) or linear_group_g4 (2-3) compute them, and their
    split-K reduce is done by the LoRA expand's launch, with the bits of reduce then expand. `join()`, if given,
    is called between the base launch and the expand (e.g. to wait for a shrink running on another stream)."""
    if len(weights) != sh.n:
        raise ValueError(f"nvfp4 g4 + LoRA: {len(weights)} weights but {sh.n} adapters in the shrink")
    m, k = x2.shape
    if len(weights) > 1:
        if not group_g4_ok(x2, weights):
            raise ValueError(f"nvfp4 g4 + LoRA: the grouped launch cannot take x {tuple(x2.shape)} {x2.dtype} on "
                             f"{x2.device} with out_features {[w[4] for w in weights]} (see linear_group_g4)")
        ns = tuple(w[4] for w in weights)
        key = (m, ns, k, weights[0][3] is not None, x2.dtype, x2.device)
        return _GROUP_PLANS.get_or(key, lambda: _group_plan(m, ns, k, key[3], x2.dtype, x2.device))(x2, weights, sh,
                                                                                                    join)
    wr, sr, gs, bias, n = weights[0]
    check_g4_call(x2, wr, sr, gs, bias, n, k, "nvfp4 g4 + LoRA")
    if not (x2.stride(-1) == 1 and gluon.supported(x2)):
        raise ValueError(f"nvfp4 g4 + LoRA: needs a bf16 x [M in 1..{gluon.FEW_ROWS}, {k}] with contiguous rows on an sm_80+ GPU, "
                         f"got {tuple(x2.shape)} {x2.dtype} on {x2.device}")

    def plan():
        cfg = gluon_config(m, n, k, x2.device)
        split, cps = splits(cdiv(k, 64), cfg.get("split", 1))
        return split, gluon.launcher(m, n, k, cfg, split, cps, bias is not None)

    split, run = _LORA_PLANS.get_or((m, n, k, bias is not None, x2.dtype, x2.device, LINEAR_TUNER.gen), plan)
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    if split == 1:
        run(x2, wr, sr, recip(gs), bias, y, n)
        return _expand_after(sh, [y], None, join)
    p = torch.empty((split, m, n), dtype=torch.float32, device=x2.device)
    run(x2, wr, sr, recip(gs), bias, p, n)
    return _expand_after(sh, [y], ([p], split, [bias]), join)


def _expand_after(sh, outs, base, join):
    """The LoRA expand of a g4 + LoRA call (with the base's split-K reduce where `base` is given), after `join()`."""
    if join is not None:
        join()
    return _lora.expand_(sh, outs, base=base)
