"""ECOSGD / ECOAdamW: torch optimizers that update QParam weights directly (no master weights), injecting the
quantization error into momentum (the rules: hfq_kernels/reference/eco.py); ordinary parameters get plain
SGDM / AdamW. Usable by transformers' Trainer: `Trainer(optimizers=(ECOAdamW(model.parameters()), sched))`.

Before any parameter is touched, every gradient is checked for NaN/Inf: a bad step is refused with a
ValueError naming the parameter, so stored codes are never corrupted. Stochastic rounding draws from the
optimizer's own generators (seeded by `seed`), whose states are part of `state_dict()`: resuming from a
checkpoint continues bit-exactly.
"""
from __future__ import annotations

import warnings

import torch

from hfq_kernels.reference import eco as Fn
from ..qparam import QParam, int8_grad
from ..qparam.fsdp import local
from .base import QParamOptimizer
from .states import StateStore


class _ECOBase(QParamOptimizer):
    def __init__(self, params, defaults, *, rule, rounding, state_dtype, state_bits, seed, check_finite, keyed_sr):
        if rule not in Fn.RULES:
            raise ValueError(f"rule: unknown {rule!r}; allowed {Fn.RULES}")
        self.rule = rule
        self._store = StateStore(state_dtype, state_bits)
        super().__init__(params, defaults, rounding=rounding, seed=seed, check_finite=check_finite,
                         keyed_sr=keyed_sr)

    def _requant(self, p):
        return lambda tmp: self._requantize(p, tmp)

    def _fresh_state(self, p) -> dict:
        state: dict = {}
        self._init_state(local(p), state)
        return state

    def _carrier_rng(self, p, m: torch.Tensor) -> torch.Generator | None:
        """The generator for storing p's first moment stochastically: 8-bit states of a quantized weight under the
        memory-free rule, whose momentum carries the quantization error (see hfq.optim.states); else None."""
        if self._store.bits == 8 and isinstance(p, QParam) and self.rule == "memory_free":
            return self._generator(m.device)
        return None

    def _new_residual(self, state, p) -> None:
        if isinstance(p, QParam) and self.rule == "exact":
            state["residual"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)


class ECOSGD(_ECOBase):
    """SGD with momentum; QParams get the ECO update (no master weights), others plain SGDM.

    Args: lr, momentum (beta in (0,1): ECO divides by it), weight_decay (decoupled), rule
    ("memory_free" default, or "exact" with a stored residual), rounding ("sr" default, or "rtn"),
    state_dtype (torch.float32 / torch.bfloat16), state_bits (None or 8), seed (SR generator seed), keyed_sr
    (None: SR keyed by element for FSDP2-sharded weights, the seeded generator otherwise; True: keyed always).
    """

    def __init__(self, params, lr: float = 1e-2, momentum: float = 0.9, weight_decay: float = 0.0,
                 rule: str = "memory_free", rounding: str = "sr", state_dtype=torch.float32,
                 state_bits: int | None = None, seed: int = 0, check_finite: bool = True,
                 keyed_sr: bool | None = None):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay), rule=rule,
                         rounding=rounding, state_dtype=state_dtype, state_bits=state_bits, seed=seed,
                         check_finite=check_finite, keyed_sr=keyed_sr)

    def _init_state(self, p, state):
        self._store.init(state, "momentum_buffer", p, True)
        self._new_residual(state, p)

    @torch.no_grad()
    def step(self, closure=None):
        loss, pending = self._begin_step(closure)
        self._finish_check(pending)
        st = self._store
        for group in self.param_groups:
            lr, beta, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if not self._has_grad(p):
                    continue
                state, lp = self.state[p], local(p)
                if not state:
                    self._init_state(lp, state)
                m = st.load(state, "momentum_buffer", lp.shape, True)
                g = self._grad32(p)
                if isinstance(lp, QParam):
                    Fn.eco_sgdm_(lp.dequantize(torch.float32), m, g, lr=lr, beta=beta, weight_decay=wd,
                                 requant=self._requant(p), rule=self.rule, residual=state.get("residual"))
                else:
                    self._plain_update_(p, lambda w, r: Fn.sgdm_(w, m[r], g[r], lr=lr, beta=beta, weight_decay=wd))
                st.store(state, "momentum_buffer", m, True, self._carrier_rng(lp, m))
        return loss


class ECOAdamW(_ECOBase):
    """AdamW; QParams get the ECO update (no master weights), others plain AdamW.

    Args as torch.optim.AdamW (lr, betas, eps, weight_decay: decoupled) plus rule ("memory_free" default /
    "exact"), rounding ("sr" default / "rtn"), state_dtype (fp32 / bf16 moments), state_bits (None / 8:
    blockwise 8-bit moments), seed, fused (None: the Triton step for fp8_e4m3_row QParams on CUDA;
    True forces it, also on CPU under TRITON_INTERPRET; False: torch reference; FSDP2-sharded weights too, their
    SR keyed by global element in either), keyed_sr (as ECOSGD).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 rule: str = "memory_free", rounding: str = "sr", state_dtype=torch.float32,
                 state_bits: int | None = None, seed: int = 0, fused: bool | None = None,
                 check_finite: bool = True, keyed_sr: bool | None = None):
        self.fused = fused
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), rule=rule,
                         rounding=rounding, state_dtype=state_dtype, state_bits=state_bits, seed=seed,
                         check_finite=check_finite, keyed_sr=keyed_sr)
        if fused and (self.rule != "memory_free" or self._store.bits is not None):
            raise ValueError("fused=True supports rule='memory_free' with fp32/bf16 states only")
        if fused and not any(isinstance(local(p), QParam) and local(p).fmt == "fp8_e4m3_row"
                             for g in self.param_groups for p in g["params"]):
            warnings.warn("ECOAdamW(fused=True): none of its parameters is an fp8_e4m3_row QParam, the only weights "
                          "the fused step covers; every parameter takes the torch step", UserWarning, stacklevel=2)

    def _use_fused(self, p) -> bool:
        q = local(p)
        if not (isinstance(q, QParam) and q.fmt == "fp8_e4m3_row") or int8_grad(p) is not None:
            return False
        if self.fused is None:
            return q.device.type == "cuda" and self.rule == "memory_free" and self._store.bits is None
        if not self.fused:
            return False
        # fused=True: Triton on CUDA tensors, or CPU tensors under TRITON_INTERPRET=1; elsewhere the torch
        # reference of the same step (CPU tensors on a CUDA machine)
        from hfq_kernels.eco import HAS_TRITON, INTERPRET
        return HAS_TRITON and (q.device.type == "cuda" or INTERPRET)

    @torch.no_grad()
    def step(self, closure=None):
        loss, pending = self._begin_step(closure)
        # Plan while the GPU runs the check; nothing is modified before the check has passed. Fused QParams of
        # the same hyper-parameters and step count share one multi-tensor launch (per block width and dtypes).
        fused: dict = {}
        plain = []
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if not self._has_grad(p):
                    continue
                if not self._use_fused(p):
                    plain.append((group, p))
                    continue
                state = self.state.get(p)
                step = int(state["step"]) + 1 if state else 1
                fused.setdefault((lr, b1, b2, eps, wd, step, self._keyed(p)), []).append((p, state))
        plans = []
        if fused:
            from hfq_kernels.eco import eco_adamw_fp8_prepare
            for key, ps in fused.items():
                ready = all(state for _, state in ps)
                plans.append((key, ps, self._fused_plan(ps, eco_adamw_fp8_prepare, key[-1]) if ready else None))
        self._finish_check(pending)
        if plans:
            from hfq_kernels.eco import eco_adamw_fp8_launch, eco_adamw_fp8_prepare
            for (lr, b1, b2, eps, wd, step, keyed), ps, plan in plans:
                if plan is None:  # first step of some of them: make their states, then plan
                    for p, state in ps:
                        if not state:
                            self._init_state(local(p), self.state[p])
                    ps = [(p, self.state[p]) for p, _ in ps]
                    plan = self._fused_plan(ps, eco_adamw_fp8_prepare, keyed)
                seed = 0
                if keyed:  # the same on every rank and world size: a function of (seed, step) only
                    seed = (self._seed * 1_000_003 + step) % (2 ** 31 - 1)
                elif self.rounding == "sr" or self._store.stochastic_bf16:
                    seed = int(torch.randint(0, 2 ** 31 - 1, (1,), generator=self._generator("cpu")))
                eco_adamw_fp8_launch(plan, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, step=step,
                                     rounding=self.rounding, seed=seed, state_sr=self._store.stochastic_bf16)
                for p, state in ps:  # the GPU is busy meanwhile
                    state["step"] += 1
        st = self._store
        for group, p in plain:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            state, lp = self.state[p], local(p)
            if not state:
                self._init_state(lp, state)
            state["step"] += 1
            step = int(state["step"].item())
            m = st.load(state, "exp_avg", lp.shape, True)
            v = st.load(state, "exp_avg_sq", lp.shape, False)
            g = self._grad32(p)
            if isinstance(lp, QParam):
                Fn.eco_adamw_(lp.dequantize(torch.float32), m, v, g, step=step, lr=lr, beta1=b1, beta2=b2,
                              eps=eps, weight_decay=wd, requant=self._requant(p), rule=self.rule,
                              residual=state.get("residual"))
            else:
                self._plain_update_(p, lambda w, r: Fn.adamw_(w, m[r], v[r], g[r], step=step, lr=lr, beta1=b1,
                                                              beta2=b2, eps=eps, weight_decay=wd))
            st.store(state, "exp_avg", m, True, self._carrier_rng(lp, m))
            st.store(state, "exp_avg_sq", v, False, self._generator(v.device) if st.stochastic_bf16 else None)
        return loss

    def _init_state(self, p, state):
        state["step"] = torch.tensor(0.0)
        self._store.init(state, "exp_avg", p, True)
        self._store.init(state, "exp_avg_sq", p, False)
        self._new_residual(state, p)

    def _fused_plan(self, ps, prepare, keyed: bool):
        """The kernel's plan over the local shards; keyed: each weight's SR stream is its position in the
        optimizer and its rows count from its shard's first global row."""
        qs = [local(p) for p, _ in ps]
        return prepare([q.codes for q in qs], [q.scales for q in qs], [local(p.grad) for p, _ in ps],
                       [state["exp_avg"] for _, state in ps], [state["exp_avg_sq"] for _, state in ps],
                       streams=[self._ordinal(p) for p, _ in ps] if keyed else None,
                       first_rows=[q.place.row0 for q in qs] if keyed else None)
