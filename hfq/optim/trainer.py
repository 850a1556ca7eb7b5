"""Selecting ECO for transformers' Trainer from TrainingArguments.

transformers (checked on 5.17) has no way to register a new optimizer *name*: `TrainingArguments.__post_init__`
converts `optim` with `OptimizerNames(self.optim)`, a closed enum that raises on unknown values, and
`Trainer.get_optimizer_cls_and_kwargs` looks the name up in the private `trainer_optimizer._OPTIMIZER_HANDLERS`
dict. hfq does not patch either. The public hook is `Trainer(optimizer_cls_and_kwargs=(cls, kwargs))`: Trainer then
builds the optimizer itself, over its own parameter groups (weight decay `args.weight_decay` except biases and
norms), at the usual time (after accelerate/DDP wrapping), and saves/restores its state in checkpoints. It does not
add `args.learning_rate` or the Adam betas to those kwargs; `optimizer_cls_and_kwargs(args)` below does.
"""
from __future__ import annotations

from collections.abc import MutableMapping

import torch

from .eco import ECOAdamW, ECOSGD

NAMES = {"eco_adamw": ECOAdamW, "eco_sgd": ECOSGD}
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_BOOLS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}
_OPTIM_ARGS = {"rule": str, "rounding": str, "state_dtype": _DTYPES.__getitem__, "state_bits": int, "seed": int,
               "momentum": float, "fused": lambda v: _BOOLS[v.lower()], "check_finite": lambda v: _BOOLS[v.lower()]}


def _parse_optim_args(text: str | None) -> dict:
    """TrainingArguments.optim_args ("rounding=sr,state_dtype=bfloat16") -> ECO keyword arguments."""
    out = {}
    for item in (text or "").replace(" ", "").split(","):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or key not in _OPTIM_ARGS:
            raise ValueError(f"optim_args: expected key=value with key in {tuple(_OPTIM_ARGS)}, got {item!r}")
        try:
            out[key] = _OPTIM_ARGS[key](value)
        except (KeyError, ValueError) as e:
            allowed = f" (allowed: {', '.join(_BOOLS)})" if key in ("fused", "check_finite") else ""
            raise ValueError(f"optim_args: bad value for {key}: {value!r}{allowed}") from e
    return out


def optimizer_cls_and_kwargs(args, name: str = "eco_adamw", **overrides) -> tuple[type, dict]:
    """`(ECOAdamW | ECOSGD, kwargs)` for `Trainer(optimizer_cls_and_kwargs=...)`, filled from TrainingArguments.

    lr = args.learning_rate, seed = args.seed (stochastic rounding's draws); ECOAdamW also betas = (args.adam_beta1,
    args.adam_beta2), eps = args.adam_epsilon: read from `args` when Trainer builds the optimizer (ArgsKwargs), so
    each trial of Trainer.hyperparameter_search gets its own.
    Weight decay comes from Trainer's parameter groups (args.weight_decay; 0 for biases and norms). ECO options
    may be given in `args.optim_args` ("rounding=sr,state_dtype=bfloat16,rule=memory_free,state_bits=8,seed=0")
    and/or as keyword overrides (which win). `args.optim` is not read: it cannot hold an ECO name (see above)."""
    if name not in NAMES:
        raise ValueError(f"name: unknown {name!r}; allowed {tuple(NAMES)}")
    live = dict(_LIVE) if name == "eco_adamw" else {k: _LIVE[k] for k in ("lr", "seed")}
    fixed = _parse_optim_args(getattr(args, "optim_args", None))
    if name == "eco_adamw" and "momentum" in fixed:
        raise ValueError("optim_args: momentum is an eco_sgd option")
    if "weight_decay" in overrides:
        raise ValueError("weight_decay: Trainer gives every parameter group its own weight decay "
                         "(TrainingArguments.weight_decay, 0 for biases and norms), which would override this one; "
                         "set TrainingArguments(weight_decay=...) instead")
    fixed.update(overrides)
    return NAMES[name], ArgsKwargs(args, live, fixed)


# the keyword arguments taken from TrainingArguments; SR draws follow the run's seed, as its other streams
_LIVE = {"lr": lambda a: a.learning_rate, "seed": lambda a: a.seed,
         "betas": lambda a: (a.adam_beta1, a.adam_beta2), "eps": lambda a: a.adam_epsilon}


class ArgsKwargs(MutableMapping):
    """ECO's keyword arguments with those from TrainingArguments (`live`: name -> reader) read when Trainer
    unpacks them to build the optimizer, not when they were made: a hyperparameter search (each trial's values are
    set on the same args) and any later edit of the args reach the optimizer. `fixed` (optim_args, overrides, and
    anything set here) win over `live`."""

    def __init__(self, args, live: dict, fixed: dict):
        self._args, self._live, self._fixed = args, dict(live), dict(fixed)

    def __getitem__(self, key):
        if key in self._fixed:
            return self._fixed[key]
        if key in self._live:
            return self._live[key](self._args)
        raise KeyError(key)

    def __setitem__(self, key, value):
        self._fixed[key] = value

    def __delitem__(self, key):
        if key not in self:
            raise KeyError(key)
        self._fixed.pop(key, None)
        self._live.pop(key, None)

    def __iter__(self):
        return iter(dict.fromkeys([*self._live, *self._fixed]))

    def __len__(self):
        return len(dict.fromkeys([*self._live, *self._fixed]))

    def __repr__(self):
        return repr(dict(self))
