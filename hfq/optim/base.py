"""What hfq's optimizers for quantized weights share: hyper-parameter checks, the start of `step()` with one NaN/Inf
check of every gradient (one host sync per step), gradients read from `.grad` (float, or an INT8 store), SR draws from
seeded per-device generators, and checkpoints that keep the state's own dtypes and the generators' states, so a
resumed run continues bit-exactly."""
from __future__ import annotations

import torch

from hfq_kernels.reference.fp8 import check_rounding
from ..qparam import QParam, int8_grad, pop_int8_grad, sharding_refusal


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_lr(lr) -> None:
    """lr must be a real number > 0 (NaN and bools refused)."""
    if not _is_real(lr) or not lr > 0:
        raise ValueError(f"lr must be a float > 0, got {lr!r}")


def check_beta(name: str, b) -> None:
    """A momentum coefficient must lie strictly inside (0, 1)."""
    if not _is_real(b) or not 0 < b < 1:
        raise ValueError(f"{name} must be in (0, 1), got {b!r}")


def check_hyper(defaults: dict) -> None:
    """Validate the hyper-parameters an hfq optimizer takes (lr, momentum, betas, eps, weight_decay)."""
    check_lr(defaults["lr"])
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
    whose verdict `_finish_check` waits for before any parameter is touched. Gradients come from `_grad32(p)`
    (`.grad`; an INT8 store (hfq.qparam.Int8Grad) is consumed)."""

    updates_qparams = True  # read by hfq.qparam's guard that refuses other optimizers on trainable QParams

    def __init__(self, params, defaults, *, rounding: str = "sr", seed: int = 0, check_finite: bool = True):
        check_hyper(defaults)
        check_rounding(rounding)
        self.rounding, self.check_finite = rounding, check_finite
        self._seed = int(seed)
        self._generators: dict[str, torch.Generator] = {}
        super().__init__(params, dict(defaults, betas=tuple(defaults["betas"])) if "betas" in defaults else defaults)
        self._refuse_sharded()
        self._layout_checked = False

    def _refuse_sharded(self) -> None:
        """Parameters sharded by FSDP2 (DTensors) or flattened by FSDP (FullyShardedDataParallel): a QParam among
        them was already dequantized by the sharding, so training would go on as a plain model. Refused at
        construction and again before the first step (accelerate swaps the parameters of an optimizer built
        before `prepare`), naming the first such parameter."""
        from torch.distributed.tensor import DTensor

        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                how = ("is a sharded DTensor (FSDP2)" if isinstance(p, DTensor) else
                       "was flattened by FSDP (FullyShardedDataParallel)" if getattr(p, "_fsdp_flattened", False)
                       else None)
                if how:
                    raise ValueError(f"{type(self).__name__}: " + sharding_refusal(
                        f"parameter {self._param_name(gi, pi, p)} {how}"))

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
        return p.grad if p.grad.dtype == torch.float32 else p.grad.float()

    def zero_grad(self, set_to_none: bool = True):
        """Also drops pending INT8 gradients of this optimizer's parameters (they play the role of .grad)."""
        for group in self.param_groups:
            for p in group["params"]:
                pop_int8_grad(p)
        super().zero_grad(set_to_none)

    # ---- the start of step(): closure and the NaN/Inf check --------------------------------------------
    def _begin_step(self, closure):
        """Run the closure (with grad enabled); queue the NaN/Inf check. Returns (loss, pending check)."""
        if not getattr(self, "_layout_checked", False):
            self._refuse_sharded()
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
            norms = torch._foreach_norm([items[i][2].grad for i in idx], float("inf"))
            flags.append(torch.isfinite(torch.stack(norms)))
            order.extend(idx)
        if not flags:
            return None
        dev = next((f.device for f in flags if f.device.type != "cpu"), flags[0].device)
        return items, order, torch.cat([f.to(dev, non_blocking=True) for f in flags])

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
    def _requantize(self, p: QParam, value: torch.Tensor, **kw) -> torch.Tensor:
        """Store Q(value) in p with the optimizer's rounding (SR from p's device generator); returns the error.
        Called once per step of p: re-selects its outliers when `_outlier_refresh_due` says so."""
        if "refresh_thresholds" not in kw:
            kw["refresh_thresholds"] = self._outlier_refresh_due(p)
        gen = self._generator(p.device) if self.rounding == "sr" else None
        return p.requantize_(value, self.rounding, gen, **kw)

    def _outlier_refresh_due(self, p) -> bool:
        """True on every n-th step of an int8_dense_sparse weight (QFT App. C lazy update), n = the optimizer's
        `refresh_thresholds_every` if set, else the weight's `outlier_refresh_steps` (QFTConfig; 0 = never).
        Counted by the step in p's optimizer state (checkpointed), so DDP ranks and resumed runs agree; an
        optimizer without one (ECOSGD) counts calls in state["outlier_step"]."""
        if not (isinstance(p, QParam) and p.fmt == "int8_dense_sparse"):
            return False
        n = getattr(self, "refresh_thresholds_every", None) or p.meta.get("outlier_refresh_steps", 0)
        if not n:
            return False
        state = self.state[p]
        if "step" in state:
            return int(state["step"]) % n == 0
        state["outlier_step"] = int(state.get("outlier_step", 0)) + 1
        return state["outlier_step"] % n == 0

    def _generator(self, device) -> torch.Generator:
        key = str(torch.device(device))
        if key not in self._generators:
            g = torch.Generator(device=device)
            g.manual_seed(self._seed)
            self._generators[key] = g
        return self._generators[key]

    # ---- checkpoints ------------------------------------------------------------------------------------
    def state_dict(self):
        sd = super().state_dict()
        sd["hfq_generators"] = {k: g.get_state() for k, g in self._generators.items()}
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        gens = state_dict.pop("hfq_generators", {})
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        # torch casts floating state to the parameter's dtype (bf16 for a QParam): put back the saved tensors
        params = [p for g in self.param_groups for p in g["params"]]
        for idx, st in saved.items():
            p = params[idx]
            self.state[p] = {k: ((v.clone() if k == "step" else v.to(p.device, copy=True)) if torch.is_tensor(v)
                                 else v) for k, v in st.items()}
        for k, s in gens.items():
            self._generator(k).set_state(s.cpu() if torch.is_tensor(s) else s)

    def state_bytes(self) -> int:
        """Bytes held in this optimizer's state tensors (moments or their codes, scales, step counters)."""
        return sum(t.numel() * t.element_size() for st in self.state.values() for t in st.values()
                   if torch.is_tensor(t))
