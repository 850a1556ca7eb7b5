"""Shared base of hfq's optimizers for quantized parameters (hfq.eco, hfq.qft): seeded per-device generators for
stochastic rounding, and checkpoints that keep the optimizer state's own dtypes and the generators' states, so a
resumed run continues bit-exactly."""
from __future__ import annotations

import torch


def check_lr(lr) -> None:
    """lr must be a real number > 0 (NaN and bools refused)."""
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not lr > 0:
        raise ValueError(f"lr must be a float > 0, got {lr!r}")


def check_beta(name: str, b) -> None:
    """A momentum coefficient must lie strictly inside (0, 1)."""
    if not isinstance(b, (int, float)) or isinstance(b, bool) or not 0 < b < 1:
        raise ValueError(f"{name} must be in (0, 1), got {b!r}")


class SeededOptimizer(torch.optim.Optimizer):
    """torch.optim.Optimizer + one seeded generator per device (SR draws) saved in `state_dict()`."""

    def __init__(self, params, defaults, *, seed: int = 0):
        self._seed = int(seed)
        self._generators: dict[str, torch.Generator] = {}
        super().__init__(params, defaults)

    def _generator(self, device) -> torch.Generator:
        key = str(torch.device(device))
        if key not in self._generators:
            g = torch.Generator(device=device)
            g.manual_seed(self._seed)
            self._generators[key] = g
        return self._generators[key]

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
