"""hfq's settings: every environment variable the package reads, read once here at import.

docs/settings.md lists them (and hfq_kernels' own, hfq_kernels._settings) in one table. Code reads
`SETTINGS.<field>`; tests may set a field (monkeypatch).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from hfq_kernels._settings import flag


@dataclass
class Settings:
    """cache_dir: HFQ_CACHE, where converted models live (default ~/.cache/hfq). nvfp4_g4: HFQ_NVFP4_G4, the default
    of NVFP4Linear.allow_g4 (keep only the Gluon kernel's g4 layout on GPUs that run it). omp_threads_set:
    OMP_NUM_THREADS is set (the user chose torch's CPU thread count; `hfq grpo` then leaves it alone)."""

    cache_dir: Path
    nvfp4_g4: bool
    omp_threads_set: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "Settings":
        return cls(cache_dir=Path(env.get("HFQ_CACHE") or Path.home() / ".cache" / "hfq"),
                   nvfp4_g4=flag(env, "HFQ_NVFP4_G4", True), omp_threads_set="OMP_NUM_THREADS" in env)


SETTINGS = Settings.from_env()
