"""What hfq's optimizers for quantized weights share: hyper-parameter checks, the start of `step()` with one NaN/Inf
check of every gradient (one host sync per step), gradients read from `.grad` (float, or an INT8 store), SR draws from
seeded per-device generators or keyed by element, and checkpoints that keep the state's own dtypes and the
generators' states, so a resumed run continues bit-exactly.

FSDP2 (fully_shard): parameters are DTensors; the optimizers step on the local shards (`hfq.qparam.fsdp.local`),
their states are shard-shaped, and `state_dict()` gathers them to whole-parameter tensors (`load_state_dict` cuts
its rows back out), so a checkpoint loads on any world size. Stochastic rounding of a sharded weight is keyed by
(seed, parameter, step, global element index), which no sharding changes."""
from __future__ import annotations

import numbers
import warnings

import torch

from hfq_kernels.reference import intq as _intq
from hfq_kernels.reference.fp8 import check_rounding
from ..qparam import QParam, int8_grad, pop_int8_grad, sharding_refusal
from ..qparam.fsdp import local, local_rows


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)  # numpy scalars included


def check_lr(lr, zero_ok: bool = False) -> None:
    """lr must be a real number > 0 (>= 0 for a parameter group: schedulers start warm-ups at 0; NaN and bools
    refused)."""
    if not _is_real(lr) or not (lr >= 0 if zero_ok else lr > 0):
        raise ValueError(f"lr must be a float {'>=' if zero_ok else '>'} 0, got {lr!r}")


def check_beta(name: str, b) -> None:
    """A momentum coefficient must lie strictly inside (0, 1)."""
    if not _is_real(b) or not 0 < b < 1:
        raise ValueError(f"{name} must be in (0, 1), got {b!r}")


_PLAIN_BLOCK = 1 << 22  # elements of an ordinary bf16 parameter updated at once in fp32 (_plain_update_)


def keyed_uniform(shape, row0: int, key: int, device) -> torch.Tensor:
    """Uniform [0, 1) float32 of `shape` = [rows, cols] for the rows starting at global row `row0`: a hash of
    (key, global element index), so any row split of a weight draws what the whole weight draws."""
    rows, cols = shape
    idx = (torch.arange(rows, device=device, dtype=torch.int64)[:, None] + row0) * cols \
        + torch.arange(cols, device=device, dtype=torch.int64)
    z = idx + _signed((key * _GOLDEN) % (1 << 64))
    for shift, mult in ((30, _MIX1), (27, _MIX2)):
        z = (z ^ _lsr(z, shift)) * mult
    z = z ^ _lsr(z, 31)
    return _lsr(z, 40).to(torch.float32) * 2.0 ** -24


def _lsr(z: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = (_signed(c) for c in (0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def check_hyper(defaults: dict, group: bool = False) -> None:
    """Validate the hyper-parameters an hfq optimizer takes (lr, momentum, betas, eps, weight_decay): its defaults,
    or (group=True) one parameter group's values."""
    check_lr(defaults["lr"], zero_ok=group)
    if "momentum" in defaults:
        check_beta("momentum", defaults["momentum"])
    if "betas" in defaults:
        betas = defaults["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        check_beta("betas[0]", betas[0])
        check_beta("betas[1]", betas[1])
    if "eps" in defaults and not (_is_real(defaults["eps"]) and defaults["eps"] > 0):
        raise ValueError(f"eps must be > 0, got {defaults['eps']!r}")
    wd = defaults["weight_decay"]
    if not _is_real(wd) or not wd >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {wd!r}")


class QParamOptimizer(torch.optim.Optimizer):
    """torch.optim.Optimizer for QParam weights (and ordinary parameters beside them).

    Subclasses call `_begin_step(closure)` first in `step()`: it runs the closure and queues the NaN/Inf check,
    whose verdict `_finish_check` waits for before any parameter is touched (check_finite=False skips it, and its
    host read: non-finite gradients then go undetected, see docs/training.md). Gradients come from `_grad32(p)`
    (`.grad`; an INT8 store (hfq.qparam.Int8Grad) is consumed)."""

    updates_qparams = True  # read by hfq.qparam's guard that refuses other optimizers on trainable QParams

    def __init__(self, params, defaults, *, rounding: str = "sr", seed: int = 0, check_finite: bool = True,
                 keyed_sr: bool | None = None):
        check_hyper(defaults)
        check_rounding(rounding)
        if keyed_sr not in (None, True, False):
            raise ValueError(f"keyed_sr must be None, True or False, got {keyed_sr!r}")
        self.rounding, self.check_finite, self.keyed_sr = rounding, check_finite, keyed_sr
        self._ordinals: dict[int, tuple[int, int]] = {}
        self._seed = int(seed)
        self._generators: dict[str, torch.Generator] = {}
        super().__init__(params, dict(defaults, betas=tuple(defaults["betas"])) if "betas" in defaults else defaults)
        self._refuse_sharded()
        self._layout_checked = False

    def _refuse_sharded(self) -> None:
        """Parameters flattened by FSDP1 (FullyShardedDataParallel): a QParam among them was already dequantized
        by the flattening, so training would go on as a plain model. Refused at construction and again before the
        first step (accelerate swaps the parameters of an optimizer built before `prepare`), naming the first such
        parameter. FSDP2's DTensor parameters are trained shard by shard; 8-bit blockwise states (state_bits=8),
        whose blocks run across rows, are refused for them. Quantized weights on several GPUs of one process (a
        device_map spread over GPUs) are refused too: the fused steps launch over many weights on one device."""
        from torch.distributed.tensor import DTensor

        gpus = {}
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if isinstance(local(p), QParam) and p.is_cuda:
                    gpus.setdefault(p.get_device(), self._param_name(gi, pi, p))
                if getattr(p, "_fsdp_flattened", False):
                    raise ValueError(f"{type(self).__name__}: " + sharding_refusal(
                        f"parameter {self._param_name(gi, pi, p)} was flattened by FSDP (FullyShardedDataParallel)"))
                store = getattr(self, "_store", None)
                if isinstance(p, DTensor) and store is not None and store.bits == 8:
                    raise ValueError(f"{type(self).__name__}: state_bits=8 keeps blockwise states across rows, which "
                                     f"FSDP2 cannot shard ({self._param_name(gi, pi, p)} is a sharded DTensor); "
                                     "use state_bits=None with state_dtype=torch.bfloat16 or torch.float32")
        if len(gpus) > 1:  # the fused steps launch over many weights at once, on one device
            raise ValueError(f"{type(self).__name__}: quantized weights on several GPUs in one process "
                             f"({', '.join(f'cuda:{d}: {n}' for d, n in sorted(gpus.items()))}); hfq's optimizers "
                             "step the weights of one GPU per process: train with DDP or FSDP2 (accelerate launch), "
                             "one GPU per process, instead of a device_map spread over GPUs")

    def _check_ranks_agree(self) -> None:
        """Before the first step of a multi-process run: every rank must hold the same (replicated) quantized weights.
        DDP never syncs them (INT8-gradient weights are outside its buffers; its start-up broadcast reaches only what
        it owns), so ranks that quantized differently at load (e.g. rounding="sr" with per-rank seeds) would train
        apart silently. One all-reduce of per-weight checksums; FSDP2-sharded weights are skipped."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return
        qs = [p for g in self.param_groups for p in g["params"] if isinstance(p, QParam) and not isinstance(p, DTensor)]
        if not qs:
            return
        sums = torch.stack([getattr(p, k).detach().double().sum() for p in qs for k in p.__tensor_flatten__()[0]])
        lo, hi = sums.clone(), sums.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        if not torch.equal(lo, hi):
            raise ValueError(
                f"{type(self).__name__}: the {dist.get_world_size()} ranks hold different quantized weights (e.g. "
                "loaded with rounding='sr' and per-rank seeds); they would train apart. Call "
                "hfq.qparam.broadcast_qparams_(model) on every rank before training (or load with rounding='rtn')")

    # ---- gradients ------------------------------------------------------------------------------------
    @staticmethod
    def _has_grad(p) -> bool:
        return p.grad is not None

    @staticmethod
    def _grad32(p) -> torch.Tensor:
        """p's gradient in float32: `.grad`, or the INT8 store (QFTConfig(gradient_bits=8)), which is consumed."""
        q8 = pop_int8_grad(p)
        if q8 is not None:
            return q8.dequantize(torch.float32)
        g = local(p.grad)
        return g if g.dtype == torch.float32 else g.float()

    def zero_grad(self, set_to_none: bool = True):
        """Also drops pending INT8 gradients of this optimizer's parameters (they play the role of .grad)."""
        for group in self.param_groups:
            for p in group["params"]:
                pop_int8_grad(p)
        super().zero_grad(set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        """torch's, then the group's own hyper-parameters are checked (as the defaults are), naming the group."""
        super().add_param_group(param_group)
        self._check_group(len(self.param_groups) - 1)

    def _check_group(self, i: int) -> None:
        try:
            check_hyper(self.param_groups[i], group=True)
        except (KeyError, ValueError) as e:
            what = f"{e.args[0]!r} is missing" if isinstance(e, KeyError) else e
            raise ValueError(f"{type(self).__name__} param_groups[{i}]: {what}") from None

    # ---- the start of step(): closure and the NaN/Inf check --------------------------------------------
    def _begin_step(self, closure):
        """Check every group's hyper-parameters (a group edited since, e.g. momentum=0, would fail half-way through
        the step), run the closure (with grad enabled); queue the NaN/Inf check. Returns (loss, pending check)."""
        for i in range(len(self.param_groups)):
            self._check_group(i)
        if not getattr(self, "_layout_checked", False):
            self._refuse_sharded()
            self._check_ranks_agree()
            self._layout_checked = True
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        return loss, (self._launch_check() if self.check_finite else None)

    def _launch_check(self):
        """Queue the check of every gradient: one multi-tensor max-norm per device and dtype (NaN/Inf propagate)
        and the INT8 stores' device flags, gathered on one device. Nothing waits for it yet."""
        items, flags, order, groups = [], [], [], {}
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                q8 = int8_grad(p)
                if q8 is not None:
                    order.append(len(items))
                    items.append((gi, pi, p))
                    flags.append(q8.finite.reshape(1))
                elif p.grad is not None:
                    groups.setdefault((p.grad.device, p.grad.dtype), []).append(len(items))
                    items.append((gi, pi, p))
        for idx in groups.values():
            norms = torch._foreach_norm([local(items[i][2].grad) for i in idx], float("inf"))
            flags.append(torch.isfinite(torch.stack(norms)))
            order.extend(idx)
        if not flags:
            return None
        dev = next((f.device for f in flags if f.device.type != "cpu"), flags[0].device)
        ok = torch.cat([f.to(dev, non_blocking=True) for f in flags])
        if self._sharded():  # each rank checked its shards: every rank refuses if any found a bad one
            import torch.distributed as dist

            ok = ok.to(torch.int32)
            dist.all_reduce(ok, dist.ReduceOp.MIN)
            ok = ok.bool()
        return items, order, ok

    def _sharded(self) -> bool:
        from torch.distributed.tensor import DTensor

        return any(isinstance(p, DTensor) for g in self.param_groups for p in g["params"])

    def _finish_check(self, pending) -> None:
        """Wait for the check (the one host sync of the step); refuse the step on a bad gradient, naming it."""
        if pending is None:
            return
        items, order, ok = pending
        ok = ok.cpu()
        if not bool(ok.all()):
            gi, pi, p = items[min(order[j] for j in (~ok).nonzero().flatten().tolist())]  # first in param order
            raise ValueError(f"non-finite gradient (NaN/Inf) in {self._param_name(gi, pi, p)}: step refused, "
                             "no parameter was updated")

    def _name_of(self, p) -> str:
        """`_param_name` of parameter `p`, found by identity in the groups (for error messages)."""
        return next((self._param_name(gi, pi, p) for gi, g in enumerate(self.param_groups)
                     for pi, q in enumerate(g["params"]) if q is p), "a parameter")

    def _param_name(self, gi, pi, p) -> str:
        names = self.param_groups[gi].get("param_names")
        if names:
            return names[pi]
        q8 = int8_grad(p)
        if q8 is not None and q8.param_name:
            return q8.param_name
        kind = f"QParam {p.fmt}" if isinstance(p, QParam) else "param"
        return f"param_groups[{gi}]['params'][{pi}] ({kind} {tuple(p.shape)})"

    # ---- weights ----------------------------------------------------------------------------------------
    def _requantize(self, p, value: torch.Tensor, **kw) -> torch.Tensor:
        """Store Q(value) in parameter p (its local shard under FSDP2) with the optimizer's rounding; returns the
        error. SR draws from p's device generator, or keyed by element (`_sr_noise`). Called once per step of p:
        re-selects its outliers when `_outlier_refresh_due` says so."""
        if "refresh_thresholds" not in kw:
            kw["refresh_thresholds"] = self._outlier_refresh_due(p)
        q = local(p)
        noise = self._sr_noise(p, q)
        gen = self._generator(q.device) if self.rounding == "sr" and noise is None else None
        try:
            return q.requantize_(value, self.rounding, gen, noise=noise, **kw)
        except ValueError as e:  # e.g. a NaN update with check_finite=False: say which parameter
            raise ValueError(f"{type(self).__name__}.step: {self._name_of(p)}: {e}" + (
                "; with check_finite=False a non-finite gradient reaches the update, and parameters stepped before "
                "this one (and their states) have taken it" if not self.check_finite else "")) from None

    def _plain_update_(self, p, update) -> None:
        """Apply `update(w, rows)` (in-place ops on w, the parameter's rows `rows` of its other tensors: momentum,
        gradient) to ordinary parameter p (its local shard): in its own dtype, or for a bf16 parameter under
        rounding="sr" on fp32 copies of row blocks (a few MB at a time, not a copy of a whole embedding) written
        back with stochastic rounding, as the quantized weights are (nearest rounding drops every step below half a
        bf16 ulp: a norm weight of 1.0 never moves at lr 2e-5). fp16 parameters keep nearest rounding."""
        lp = local(p)
        if self.rounding != "sr" or lp.dtype != torch.bfloat16:
            update(lp, ...)
            return
        if lp.dim() == 0:  # one element: its own block
            w = lp.float()
            update(w, ...)
            lp.copy_(_intq.round_bf16(w.reshape(1), "sr", self._generator(lp.device)).reshape(()))
            return
        rows = lp.shape[0]
        cols = lp.numel() // max(rows, 1)
        block = max(1, _PLAIN_BLOCK // max(cols, 1))
        keyed = self._keyed(p)  # an FSDP2 shard: draws keyed by global element, as a QParam shard's (_sr_noise)
        key, row0 = (self._sr_key(p), local_rows(p)[0]) if keyed else (0, 0)
        for r in range(0, rows, block):
            sl = slice(r, min(r + block, rows))
            w = lp[sl].float()
            update(w, sl)
            noise = keyed_uniform((sl.stop - r, cols), row0 + r, key, lp.device) if keyed else None
            lp[sl].copy_(_intq.round_bf16(w, "sr", None if keyed else self._generator(lp.device), noise))

    def _sr_key(self, p) -> int:
        """The key of p's SR draws at this step: (seed, p's position in the optimizer, p's step)."""
        state = self.state[p]
        if "step" in state:
            step = int(state["step"])
        else:
            state["sr_step"] = step = int(state.get("sr_step", 0)) + 1
        return (self._seed * 1_000_003 + self._ordinal(p)) * 1_000_033 + step

    def _sr_noise(self, p, q: QParam) -> torch.Tensor | None:
        """SR draws keyed by (seed, p's position in the optimizer, p's step, global element index): for sharded
        parameters (the split does not change them) and with keyed_sr=True; else None (the device generator)."""
        if not self._keyed(p):
            return None
        return keyed_uniform(q.shape, q.place.row0, self._sr_key(p), q.device)

    def _keyed(self, p) -> bool:
        """SR keyed by (seed, parameter, step, global element) for p: sharded, or keyed_sr=True."""
        return self.rounding == "sr" and (bool(self.keyed_sr) or (self.keyed_sr is None and local(p) is not p))

    def _ordinal(self, p) -> int:
        """p's position in the optimizer's flat parameter list (keys its SR draws), as the groups are now: the
        cached (group, index) is checked, so reordered or rebuilt groups are seen."""
        groups = self.param_groups
        at = self._ordinals.get(id(p))
        if at is not None:
            gi, pi = at
            if gi < len(groups) and pi < len(groups[gi]["params"]) and groups[gi]["params"][pi] is p:
                return sum(len(g["params"]) for g in groups[:gi]) + pi
        self._ordinals = {id(q): (gi, pi) for gi, g in enumerate(groups) for pi, q in enumerate(g["params"])}
        gi, pi = self._ordinals[id(p)]
        return sum(len(g["params"]) for g in groups[:gi]) + pi

    def _outlier_refresh_due(self, p) -> bool:
        """True on every n-th step of an int8_dense_sparse weight (QFT App. C lazy update), n = the optimizer's
        `refresh_thresholds_every` if set, else the weight's `outlier_refresh_steps` (QFTConfig; 0 = never).
        Counted by the step in p's optimizer state (checkpointed), so DDP ranks and resumed runs agree; an
        optimizer without one (ECOSGD) counts calls in state["outlier_step"]."""
        q = local(p)
        if not (isinstance(q, QParam) and q.fmt == "int8_dense_sparse"):
            return False
        n = getattr(self, "refresh_thresholds_every", None) or q.meta.get("outlier_refresh_steps", 0)
        if not n:
            self._warn_outlier_growth(q)
            return False
        state = self.state[p]
        if "step" in state:
            due = int(state["step"]) % n == 0
        else:
            state["outlier_step"] = int(state.get("outlier_step", 0)) + 1
            due = state["outlier_step"] % n == 0
        if due and q is not p:
            raise ValueError(f"{q.place.name or 'an int8_dense_sparse weight'}: re-selecting outliers needs the "
                             "whole weight's quantiles, which an FSDP2 shard does not hold; under FSDP2 use "
                             "outlier_refresh_steps=0 (QFTConfig) and no refresh_thresholds_every")
        return due

    def _warn_outlier_growth(self, q: QParam) -> None:
        """Once per optimizer: an int8_dense_sparse weight whose outliers are never re-selected has grown past three
        times its outlier_fraction (at least 2%): elements that cross the load-time thresholds become 6-byte bf16
        outliers for good, and past ~17% the weight takes more memory than bf16."""
        if getattr(self, "_outlier_growth_warned", False):
            return
        frac = float(q.meta.get("outlier_fraction", 0.0))
        n, total = q.sparse_idx.numel(), q.numel()
        if n <= max(3 * frac, 0.02) * total:
            return
        self._outlier_growth_warned = True
        warnings.warn(f"{q.place.name or 'an int8_dense_sparse weight'}: {n} of {total} elements ({n / total:.1%}) "
                      f"are now bf16 outliers (outlier_fraction={frac}); with outlier_refresh_steps=0 the thresholds "
                      "are never re-selected, and past ~17% the weight takes more memory than bf16. Re-select them "
                      "once per epoch (Trainer(callbacks=[hfq.qft.OutlierRefreshPerEpoch()])) or every N steps "
                      "(QFTConfig(outlier_refresh_steps=N))", UserWarning, stacklevel=4)

    def _generator(self, device) -> torch.Generator:
        key = str(torch.device(device))
        if key not in self._generators:
            g = torch.Generator(device=device)
            g.manual_seed(self._seed)
            self._generators[key] = g
        return self._generators[key]

    # ---- checkpoints ------------------------------------------------------------------------------------
    def state_dict(self):
        """torch's state dict plus the SR generators' states; the states of FSDP2-sharded parameters are gathered
        to whole-parameter tensors (a collective: call it on every rank), so any world size can load it."""
        sd = super().state_dict()
        sd["hfq_generators"] = {k: g.get_state() for k, g in self._generators.items()}
        params = [p for g in self.param_groups for p in g["params"]]
        for idx, st in sd["state"].items():
            p = params[idx]
            if local(p) is not p:
                rows = local_rows(p)[1]
                sd["state"][idx] = {k: _gather_rows(v, p) if torch.is_tensor(v) and v.dim() and v.shape[0] == rows
                                    else v for k, v in st.items()}
        return sd

    def _fresh_state(self, p) -> dict:
        """The state this optimizer, with its options, gives parameter `p` at its first step."""
        raise NotImplementedError

    def _check_saved_layout(self, state_dict) -> None:
        """A checkpoint written by another optimizer class, or with other state options (state_bits, state_dtype,
        rule; QLion's momentum_bits), is refused here, naming the parameter and both layouts, instead of a KeyError
        at the first step or the saved format silently kept."""
        for gi, g in enumerate(state_dict["param_groups"]):
            missing = [k for k in ("lr", "momentum", "betas", "eps", "weight_decay")
                       if k in self.defaults and k not in g]
            if missing:
                raise ValueError(f"{type(self).__name__}.load_state_dict: saved param_groups[{gi}] has no {missing}: "
                                 "the checkpoint was written by another optimizer")
        params = self._saved_ids(state_dict)

        def layout(st):
            return {k: str(v.dtype).removeprefix("torch.") for k, v in st.items() if torch.is_tensor(v) and k != "step"}

        for idx, st in state_dict["state"].items():
            p = params[idx]
            fresh = self._fresh_state(p)
            want, got = layout(fresh), layout(st)
            if want != got:
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: the saved state of {self._name_of(p)} is {got} but this "
                    f"optimizer keeps {want}: the checkpoint was written by another optimizer or with other state "
                    "options (state_bits, state_dtype, rule; QLion: momentum_bits). Build the optimizer as it was "
                    "built for the checkpoint")
            self._check_saved_shapes(p, fresh, st)

    def _check_saved_shapes(self, p, fresh: dict, saved: dict) -> None:
        """A saved state of other shapes than parameter p's (the optimizer built over the parameters in another
        order than the checkpoint's) is refused before any parameter moves. An FSDP2 shard's state may come whole
        (rows gathered, as state_dict writes it) or as the local rows."""
        rows = {p.shape[0]} if p.dim() else set()
        for k, f in fresh.items():
            if k == "step" or not torch.is_tensor(f):
                continue
            want, got = tuple(f.shape), tuple(saved[k].shape)
            if want != got and not (local(p) is not p and got[:1] and got[0] in rows and got[1:] == want[1:]):
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: the saved {k!r} of {self._name_of(p)} has shape "
                    f"{list(got)}, this parameter's is {list(want)}: the optimizer lists its parameters in another "
                    "order than the one the checkpoint was saved from. Build it over the parameters as it was built "
                    "(the same groups, the same order)")

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        gens = state_dict.pop("hfq_generators", {})
        saved = state_dict["state"]
        self._check_saved_layout(state_dict)
        super().load_state_dict(state_dict)
        # torch casts floating state to the parameter's dtype (bf16 for a QParam): put back the saved tensors
        params = self._saved_ids(state_dict)
        for idx, st in saved.items():
            p = params[idx]
            r0, n = local_rows(p)
            sharded = local(p) is not p
            self.state[p] = {k: ((v.clone() if k == "step" else
                                  (v[r0:r0 + n] if sharded and v.dim() and v.shape[0] == p.shape[0] else v)
                                  .to(p.device, copy=True)) if torch.is_tensor(v) else v) for k, v in st.items()}
        for k, s in gens.items():
            self._generator(k).set_state(s.cpu() if torch.is_tensor(s) else s)

    def _saved_ids(self, state_dict) -> dict:
        """The saved state's parameter ids (indices, or names as torch.distributed.checkpoint writes them) -> this
        optimizer's parameters, by position in the parameter groups (as torch matches them)."""
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        return dict(zip(saved, [p for g in self.param_groups for p in g["params"]]))

    def state_bytes(self) -> int:
        """Bytes held in this optimizer's state tensors (moments or their codes, scales, step counters)."""
        return sum(t.numel() * t.element_size() for st in self.state.values() for t in st.values()
                   if torch.is_tensor(t))


def _gather_rows(v: torch.Tensor, p) -> torch.Tensor:
    """The whole-parameter tensor of a row-sharded state `v` of FSDP2 parameter `p` (rows split as p's are)."""
    from torch.distributed.tensor import DTensor

    shape = (p.shape[0],) + tuple(v.shape[1:])
    stride = tuple(int(torch.tensor(shape[i + 1:]).prod()) for i in range(len(shape)))
    return DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=shape,
                              stride=stride).full_tensor()
