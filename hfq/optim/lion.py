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

import warnings

import torch

from hfq_kernels import int8 as _k
from hfq_kernels import qlion as _q
from hfq_kernels.reference.intq import as_rows, dequantize_int_asym, quantize_int_asym
from ..qparam import Int8Grad, QParam, int8_kernels, pop_int8_grad
from ..qparam.fsdp import local, share_outliers_
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
    paper refreshes them once per epoch (App. C): pass steps per epoch), fused (None: int8_dense_sparse weights
    with INT8 momentum on CUDA take the fused multi-tensor Triton step, hfq_kernels.qlion, which reads the INT8
    gradient store as it is; False: always the torch ops; True: also CPU tensors under TRITON_INTERPRET=1). The
    fused step's RTN results equal the torch ops' under the interpreter (on CUDA row scales can differ in the last
    bit, moving a code by one step at rounding ties); its SR draws come from a hashed counter stream per step and weight
    (keyed by seed, the weight's position in the optimizer, its step count and the element's global index, so
    resumed runs, DDP ranks and FSDP2 row shards draw what the whole weight draws), not from the torch generator.
    The torch ops' SR is keyed by global element for FSDP2-sharded weights, and for every weight with keyed_sr=True.
    """

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0,
                 rounding: str = "sr", momentum_bits: int | None = 8, seed: int = 0, check_finite: bool = True,
                 refresh_thresholds_every: int | None = None, fused: bool | None = None,
                 keyed_sr: bool | None = None):
        if momentum_bits is not None and (isinstance(momentum_bits, bool) or momentum_bits not in (8,)):
            raise ValueError(f"momentum_bits must be one of {MOMENTUM_BITS}, got {momentum_bits!r}")
        if refresh_thresholds_every is not None and (isinstance(refresh_thresholds_every, bool) or not isinstance(
                refresh_thresholds_every, int) or refresh_thresholds_every <= 0):
            raise ValueError(f"refresh_thresholds_every must be None or an int > 0, got {refresh_thresholds_every!r}")
        if fused not in (None, True, False):
            raise ValueError(f"fused must be None, True or False, got {fused!r}")
        if fused and momentum_bits != 8:
            raise ValueError("fused=True: the fused QLion step keeps INT8 momentum; set momentum_bits=8")
        self.momentum_bits = momentum_bits
        self.fused = fused
        self._rtn_lrs: list | None = []  # lrs of the last step while the nearest-rounding check is due; None: done
        self.refresh_thresholds_every = refresh_thresholds_every
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay), rounding=rounding, seed=seed,
                         check_finite=check_finite, keyed_sr=keyed_sr)

    # ---- momentum storage -----------------------------------------------------------------------------
    def _fresh_state(self, p) -> dict:
        state: dict = {}
        self._init_state(state, local(p), sharded=local(p) is not p)
        return state

    def _int8_momentum(self, p, sharded: bool) -> bool:
        """Whether local tensor `p`'s momentum is kept as INT8 codes (see `_init_state`)."""
        return self.momentum_bits == 8 and not (sharded and p.dim() < 2)

    def _init_state(self, state, p, sharded: bool = False):
        """Momentum for local tensor `p`: INT8 per row, except for an FSDP2 shard of a 1-D parameter (a norm, a
        bias), whose one row runs across the shards: fp32 there (a row scale per shard would depend on the split)."""
        state["step"] = torch.tensor(0.0)
        if self._int8_momentum(p, sharded):
            rows, cols = as_rows(p.shape)
            dev = p.device
            state["exp_avg_codes"] = torch.zeros((rows, cols), dtype=torch.uint8, device=dev)
            state["exp_avg_scales"] = torch.ones((rows, 1), dtype=torch.float32, device=dev)
            state["exp_avg_zeros"] = torch.zeros((rows, 1), dtype=torch.uint8, device=dev)
        else:
            state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)

    def _load_m(self, state, shape) -> torch.Tensor:
        if "exp_avg_codes" in state:
            return dequantize_int_asym(state["exp_avg_codes"], state["exp_avg_scales"], state["exp_avg_zeros"],
                                       shape=shape)
        return state["exp_avg"]

    def _store_m(self, state, m) -> None:
        if "exp_avg_codes" in state:
            codes, scales, zeros = quantize_int_asym(m, 8, check=False)
            state["exp_avg_codes"].copy_(codes)
            state["exp_avg_scales"].copy_(scales)
            state["exp_avg_zeros"].copy_(zeros)
        # fp32: m is state["exp_avg"] itself, updated in place

    def load_state_dict(self, state_dict):
        """As QParamOptimizer's, with the saved momentum converted to the form this optimizer keeps for each
        parameter (`_init_state`): INT8 <-> fp32 follows momentum_bits, and a checkpoint moves between world sizes
        (an FSDP2 shard of a 1-D parameter keeps fp32)."""
        params = self._saved_ids(state_dict)
        state_dict = dict(state_dict, state=dict(state_dict["state"]))
        for idx, st in state_dict["state"].items():
            p = params[idx]
            want_codes = self._int8_momentum(local(p), sharded=local(p) is not p)
            if "exp_avg_codes" in st and not want_codes:
                st = dict(st)
                st["exp_avg"] = dequantize_int_asym(st.pop("exp_avg_codes"), st.pop("exp_avg_scales"),
                                                    st.pop("exp_avg_zeros"), shape=tuple(p.shape))
            elif "exp_avg" in st and want_codes:
                st = dict(st)
                st["exp_avg_codes"], st["exp_avg_scales"], st["exp_avg_zeros"] = quantize_int_asym(
                    st.pop("exp_avg").float(), 8, check=False)
            state_dict["state"][idx] = st
        super().load_state_dict(state_dict)

    # ---- the step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss, pending = self._begin_step(closure)
        self._finish_check(pending)
        self._check_rtn_stall()
        begun = []
        for group in self.param_groups:
            dense: dict = {}
            plain: dict = {}
            for p in group["params"]:
                if not self._has_grad(p):
                    continue
                if self._use_fused(p, group):
                    g = pop_int8_grad(p)
                    dense.setdefault(p.device, []).append((p, self._fused_item(p, local(p.grad) if g is None else g)))
                    continue
                q8 = pop_int8_grad(p)
                g = local(p.grad) if q8 is None else q8.dequantize(torch.float32)
                if self._plain_fused(p, g):  # the kernel reads a bf16/fp16 gradient as it is
                    plain.setdefault(p.device, []).append((p, g))
                else:
                    self.update_param_(p, g.float(), group)
            for items in plain.values():
                self._plain_step(items, group)
            begun += [(items, self._fused_begin([it for _, it in items], group)) for items in dense.values()]
        if begun:  # one host sync per step: the new outlier lists' lengths of every weight
            synced = torch.cat([ctx["sync"].to(begun[0][1]["sync"].device) for _, ctx in begun]).tolist()
            at = 0
            for items, ctx in begun:
                n = ctx["sync"].numel()
                self._fused_finish([p for p, _ in items], ctx, synced[at:at + n])
                at += n
        share_outliers_([p for group in self.param_groups for p in group["params"]])
        return loss

    def _check_rtn_stall(self) -> None:
        """rounding="rtn": once the lrs stop rising (step 2 at a constant lr, or the end of a warm-up), warn if nearest
        rounding takes back most of a Lion step of that lr (every weight moves by exactly lr) on the quantized
        weights: they would barely change. A few host syncs, once."""
        if self.rounding != "rtn" or self._rtn_lrs is None:
            return
        prev, self._rtn_lrs = self._rtn_lrs, [float(g["lr"]) for g in self.param_groups]
        if len(prev) != len(self._rtn_lrs) or any(a > b for a, b in zip(self._rtn_lrs, prev)):
            return
        self._rtn_lrs = None
        kept = [(local(p).rtn_step_kept(lr), local(p).numel()) for g, lr in zip(self.param_groups, prev) if lr > 0
                for p in g["params"] if isinstance(local(p), QParam)]
        if not kept:
            return
        share = sum(float(k) * n for k, n in kept) / sum(n for _, n in kept)
        if share < 0.5:
            warnings.warn(f"QLion(rounding='rtn'): at lr={', '.join(f'{x:g}' for x in sorted(set(prev)))} nearest "
                          f"rounding keeps {max(share, 0.0):.0%} of a step of the quantized weights (lr is below "
                          "half their quantization step), so they barely change. Use rounding='sr' (the default: "
                          "unbiased steps of any size) or a larger lr",
                          stacklevel=3)

    def _use_fused(self, p, group) -> bool:
        """The fused Triton step applies: an int8_dense_sparse QParam, INT8 momentum, lr > 0, no outlier refresh
        due on this step (a refresh re-selects thresholds from the whole weight: the torch ops do it), thresholds
        not within lr of zero (hfq_kernels.qlion.zero_may_cross; never seen on real weights)."""
        q = local(p)
        if self.fused is False or self.momentum_bits != 8 or not isinstance(q, QParam):
            return False
        if q.fmt != "int8_dense_sparse" or group["lr"] == 0 or p.numel() >= 2 ** 31:
            return False
        if not self._kernels_for(q.codes):
            return False
        n = getattr(self, "refresh_thresholds_every", None) or q.meta.get("outlier_refresh_steps", 0)
        step = int(self.state[p]["step"]) + 1 if self.state.get(p) else 1
        if n and step % n == 0:
            return False
        return not _q.zero_may_cross(q.thresholds, group["lr"])

    def _plain_fused(self, p, g) -> bool:
        """An ordinary parameter's step in two Triton launches (INT8 momentum, bf16/fp32 contiguous tensors)."""
        if self.fused is False or self.momentum_bits != 8 or isinstance(local(p), QParam) or p.numel() >= 2 ** 31:
            return False
        if local(p) is not p or "exp_avg" in self.state.get(p, {}):  # fp32 momentum (resumed from a 1-D shard)
            return False
        if not self._kernels_for(p):
            return False
        return (p.dtype in (torch.bfloat16, torch.float32) and p.data.is_contiguous() and g.device == p.device
                and g.shape == p.shape)

    def _kernels_for(self, t) -> bool:
        """hfq_kernels.int8 runs on t: CUDA (fused=None/True), or the interpreter on CPU when fused=True."""
        return int8_kernels(t) or (bool(self.fused) and _k.kernels_usable(t))

    @torch.no_grad()
    def update_param_(self, p: torch.Tensor, g, group: dict) -> None:
        """One Lion step of parameter `p` with its gradient `g` (float32, or an Int8Grad the fused step reads as
        codes); no NaN/Inf check here: step() checks every gradient first. The unit that step() loops over, and
        that a step applied during backward calls."""
        lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
        state, lp = self.state[p], local(p)
        if not state:
            self._init_state(state, lp, sharded=lp is not p)
        if self._use_fused(p, group):
            ctx = self._fused_begin([self._fused_item(p, g)], group)
            self._fused_finish([p], ctx, ctx["sync"].tolist())
            return
        if isinstance(g, Int8Grad):
            g = g.dequantize(torch.float32)
        if self._plain_fused(p, g):
            self._plain_step([(p, g)], group)
            return
        state["step"] += 1
        m = self._load_m(state, lp.shape)
        if isinstance(lp, QParam):
            refresh = self._outlier_refresh_due(p)
            if lr != 0 or refresh:  # a refresh due at lr == 0 still re-selects the outliers
                w = lp.dequantize(torch.float32)
                if wd:
                    w.mul_(1 - lr * wd)
                w.sub_(lion_direction(m, g, b1), alpha=lr)
                self._requantize(p, w, refresh_thresholds=refresh)
        elif lr != 0:
            def update(w, rows):
                if wd:
                    w.mul_(1 - lr * wd)
                w.sub_(lion_direction(m[rows], g[rows], b1).to(w.dtype), alpha=lr)
            self._plain_update_(p, update)
        m.mul_(b2).add_(g, alpha=1 - b2)
        self._store_m(state, m)

    def _momentum(self, p) -> dict:
        state = self.state[p]
        if not state:
            self._init_state(state, local(p), sharded=local(p) is not p)
        return {"codes": state["exp_avg_codes"], "scales": state["exp_avg_scales"], "zeros": state["exp_avg_zeros"]}

    def _plain_step(self, items, group) -> None:
        """Fused steps of ordinary parameters [(p, float gradient)] sharing `group`: two launches in all."""
        moms = [self._momentum(p) for p, _ in items]
        for p, _ in items:
            self.state[p]["step"] += 1
        lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
        seeds = [self._kernel_seed(p) for p, _ in items]
        _q.lion_plain_multi_step_([p.data for p, _ in items], [g for _, g in items], moms, lr=lr, beta1=b1,
                                  beta2=b2, weight_decay=wd, rounding=self.rounding, seeds=seeds)

    def _kernel_seed(self, p) -> int:
        """The SR seed of p's fused step at its current step (the kernels hash it with the element index)."""
        return self._seed * 1_000_003 + self._ordinal(p) * 7_919 + int(self.state[p]["step"])

    def _fused_item(self, p, g) -> tuple:
        """(weight, gradient, momentum, seed, first global element) of p (its local shard under FSDP2) for
        hfq_kernels.qlion; counts p's step."""
        mom = self._momentum(p)
        state = self.state[p]
        state["step"] += 1
        grad = ({"codes": g.codes, "scales": g.scales, "zeros": g.zeros} if isinstance(g, Int8Grad)
                else {"value": g})
        seed = self._kernel_seed(p)
        q = local(p)
        return q.qtensors(), grad, mom, seed, q.place.row0 * q.shape[1]

    def _fused_begin(self, items, group) -> dict:
        lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
        return _q.qlion_dense_sparse_begin(items, lr=lr, beta1=b1, beta2=b2, weight_decay=wd,
                                           rounding=self.rounding)

    @staticmethod
    def _fused_finish(params, ctx: dict, synced: list) -> None:
        for p, new in zip(params, _q.qlion_dense_sparse_finish(ctx, synced)):
            q = local(p)
            _q.store_outliers_(q.sparse_idx, q.sparse_val, new, q.codes.shape[-1])
