"""Per-shape-bucket autotuning with an in-memory + JSON cache, safe under CUDA-graph capture and torch.compile.

A choice is keyed by (op, M bucket, N, K, dtype, device name). On a miss, outside capture/compile, every
candidate is timed (median of CUDA-event timings) and the fastest kept. During capture or tracing nothing is
timed: the cached choice, else the caller's heuristic default, is used. Shipped tables (tuned on the device
machine) live beside this file as `<op>_tuned.json`; `HFQ_AUTOTUNE_CACHE=<path>` adds a writable cache file.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

_LOCK = threading.Lock()
_HERE = Path(__file__).resolve().parent


def m_bucket(m: int) -> int:
    """Next power of two (1, 2, 4, ..., 4096), so nearby batch sizes share a tuned config."""
    b = 1
    while b < m and b < 4096:
        b *= 2
    return b


def _capturing() -> bool:
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def bench_ms(fn: Callable[[], Any], warmup: int = 3, rep: int = 15) -> float:
    """Median time of fn() in ms with CUDA events (one event pair per call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rep):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        times.append((a, b))
    torch.cuda.synchronize()
    ms = sorted(a.elapsed_time(b) for a, b in times)
    return ms[len(ms) // 2]


class Tuner:
    """Cache of tuned choices for one op; a choice is any JSON-serialisable dict."""

    def __init__(self, op: str):
        self.op = op
        self.cache: dict[str, dict] = {}
        self.log: list[dict] = []  # every tuning run's timings, for reports
        shipped = _HERE / f"{op}_tuned.json"
        for path in (shipped, os.environ.get("HFQ_AUTOTUNE_CACHE")):
            if path and Path(path).is_file():
                try:
                    self.cache.update(json.loads(Path(path).read_text()).get(op, {}))
                except (OSError, ValueError):
                    pass

    @staticmethod
    def key(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> str:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        return f"m{m_bucket(m)}|n{n}|k{k}|{str(dtype).replace('torch.', '')}|{name}"

    def choose(self, key: str, candidates: Sequence[dict], runner: Callable[[dict], Callable[[], Any]],
               default: dict) -> dict:
        """Return the cached choice for key, else time `runner(c)()` for each candidate and keep the fastest."""
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        if _capturing() or os.environ.get("HFQ_AUTOTUNE", "1") == "0":
            return default
        timings = []
        for cand in candidates:
            try:
                fn = runner(cand)
                timings.append((bench_ms(fn), cand))
            except Exception as e:  # a config that fails to compile/launch is simply not chosen
                timings.append((float("inf"), {**cand, "error": f"{type(e).__name__}: {str(e)[:200]}"}))
        ok = [t for t in timings if t[0] != float("inf")]
        best = min(ok, key=lambda t: t[0])[1] if ok else default
        with _LOCK:
            self.cache[key] = best
            self.log.append({"key": key, "timings": [(t, c) for t, c in timings], "best": best})
        self._persist()
        return best

    def _persist(self) -> None:
        path = os.environ.get("HFQ_AUTOTUNE_CACHE")
        if not path:
            return
        p = Path(path)
        try:
            data = json.loads(p.read_text()) if p.is_file() else {}
            data.setdefault(self.op, {}).update(self.cache)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(data, indent=1, sort_keys=True))
        except (OSError, ValueError):
            pass
