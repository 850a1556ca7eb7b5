"""hfq_kernels' settings: every environment variable the package reads, read once here at import.

docs/settings.md lists them in one table. Code reads `SETTINGS.<field>`; tests may set a field (monkeypatch).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Mapping


def flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """An on/off variable: unset or empty gives `default`, "1" on, "0" off; anything else raises, naming it."""
    v = env.get(name, "")
    if v == "":
        return default
    if v not in ("0", "1"):
        raise ValueError(f"{name}={v!r}: allowed values are 0 (off) and 1 (on)")
    return v == "1"


def amount(env: Mapping[str, str], name: str, default: float) -> float:
    """A non-negative number: unset or empty gives `default`; anything else raises, naming the variable."""
    v = env.get(name, "")
    if v == "":
        return default
    try:
        f = float(v)
    except ValueError:
        f = math.nan
    if not (math.isfinite(f) and f >= 0):
        raise ValueError(f"{name}={v!r}: allowed values are finite numbers >= 0")
    return f


@dataclass
class KernelSettings:
    """interpret: TRITON_INTERPRET=1, Triton kernels run on CPU tensors (tests). gluon: HFQ_NVFP4_GLUON, the Gluon
    decode kernel and the g4 layout where it runs. autotune: HFQ_AUTOTUNE, time kernel configs for shapes missing
    from the tuned tables. autotune_cache: HFQ_AUTOTUNE_CACHE, a writable JSON file of tuned choices. bind:
    HFQ_TRITON_BIND, launch planned kernels through their compiled launcher (BoundLaunch). grad_dense_gb:
    HFQ_NVFP4_GRAD_DENSE_GB, GiB of dequantized NVFP4 weights that dequantizing training forwards may keep alive
    for their grad-input (default 2; 0 recomputes them in every backward). plan_on_cpu (no
    variable; tests set it): NVFP4Linear sends CPU tensors through its plans too (needs `interpret`)."""

    interpret: bool
    gluon: bool
    autotune: bool
    autotune_cache: str | None
    bind: bool
    grad_dense_gb: float = 2.0
    plan_on_cpu: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "KernelSettings":
        return cls(interpret=env.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on"), gluon=flag(env, "HFQ_NVFP4_GLUON", True),
                   autotune=flag(env, "HFQ_AUTOTUNE", True), autotune_cache=env.get("HFQ_AUTOTUNE_CACHE") or None,
                   bind=flag(env, "HFQ_TRITON_BIND", True),
                   grad_dense_gb=amount(env, "HFQ_NVFP4_GRAD_DENSE_GB", 2.0))


SETTINGS = KernelSettings.from_env()
