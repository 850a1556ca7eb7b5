"""Per-shape-bucket autotuning with an in-memory + JSON cache, safe under CUDA-graph capture and torch.compile.

A choice is keyed by (op, M bucket, N, K, dtype, device name). On a miss, outside capture/compile, every
candidate is timed (median of CUDA-event timings) and the fastest kept. During capture or tracing nothing is
timed: the cached choice, else the caller's heuristic default, is used. Shipped tables (tuned on the device
machine) live beside this file as `<op>_tuned.json`; `HFQ_AUTOTUNE_CACHE=<path>` adds a writable cache file.
A table's "cards" section records each tuned card's compute capability and SM count: a card with no entry of its
own reads the entries of a listed card with the same two (e.g. an H200 those of an H100 SXM); its own tuning
runs are stored under its own name.
"""
from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from hfq_kernels._settings import SETTINGS
from hfq_kernels._triton import card_props

_LOCK = threading.Lock()
_HERE = Path(__file__).resolve().parent


def m_bucket(m: int) -> int:
    """Next power of two (1, 2, 4, ..., 4096), so nearby batch sizes share a tuned config."""
    return 1 if m <= 1 else min(4096, 1 << (m - 1).bit_length())


_DEVICE_NAMES: dict = {}  # (type, index) -> name: torch.cuda.get_device_name costs microseconds per call


def device_name(device: torch.device) -> str:
    """The name used in tuning keys ("cpu" for CPU tensors), cached per device."""
    key = (device.type, device.index)
    name = _DEVICE_NAMES.get(key)
    if name is None:
        if device.type != "cuda":
            return device.type
        if device.index is None:  # "cuda": the current device, which may change
            return torch.cuda.get_device_name(device)
        name = _DEVICE_NAMES[key] = torch.cuda.get_device_name(device)
    return name


def same_kind(cards: dict, own: str, props: tuple[tuple[int, int], int] | None) -> list[str]:
    """Names of the cards in `cards` (name -> {"capability": [major, minor], "sms": n}) other than `own` with the
    compute capability and SM count `props`, in table order."""
    if props is None:
        return []
    (cap, sms) = props
    return [name for name, c in cards.items()
            if name != own and tuple(c.get("capability", ())) == tuple(cap) and c.get("sms") == sms]


def _capturing() -> bool:
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def enabled() -> bool:
    """Whether a miss may be timed now (not during graph capture / compile, and HFQ_AUTOTUNE != 0)."""
    return not _capturing() and SETTINGS.autotune


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


class _Table(dict):
    """A Tuner's cache: a dict that bumps its owner's `gen` on every change, so callers that keep a decision
    (hfq_kernels.nvfp4_plan.s per-shape plans) can tell with one integer compare whether it may be stale."""

    def __init__(self, owner: "Tuner", *a, **kw):
        super().__init__(*a, **kw)
        self._owner = owner

    def _bump(self):
        self._owner.gen += 1


for _name in ("__setitem__", "__delitem__", "__ior__", "update", "clear", "pop", "popitem", "setdefault"):
    def _mutator(self, *a, _f=getattr(dict, _name), **kw):
        r = _f(self, *a, **kw)
        self._bump()
        return r

    _mutator.__name__ = _name
    setattr(_Table, _name, _mutator)
del _name, _mutator


class Tuner:
    """Cache of tuned choices for one op; a choice is any JSON-serialisable dict.

    `gen` changes whenever the cache does (an entry set, removed, or the whole cache replaced)."""

    def __init__(self, op: str):
        self.op = op
        self.gen = 0
        self._cache = _Table(self)
        self.log: list[dict] = []  # every tuning run's timings, for reports
        self._memo: dict = {}  # (m bucket, n, k, dtype, device type, index) -> (key, cache entry); see cached()
        self.cards: dict = {}  # tuned card name -> {"capability": [major, minor], "sms": n}
        self._unpersisted: set = set()  # keys whose every candidate failed: kept here, not in the cache file
        shipped = _HERE / f"{op}_tuned.json"
        for path in (shipped, SETTINGS.autotune_cache):
            if path and Path(path).is_file():
                try:
                    data = json.loads(Path(path).read_text())
                    self.cache.update(data.get(op, {}))
                    self.cards.update(data.get("cards", {}))
                except (OSError, ValueError):
                    pass

    @property
    def cache(self) -> dict:
        return self._cache

    @cache.setter
    def cache(self, value: dict) -> None:
        self._cache = _Table(self, value)
        self.gen += 1

    @staticmethod
    def key(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> str:
        return Tuner.card_key(m, n, k, dtype, device_name(device))

    @staticmethod
    def card_key(m: int, n: int, k: int, dtype: torch.dtype, card: str) -> str:
        return f"m{m_bucket(m)}|n{n}|k{k}|{str(dtype).replace('torch.', '')}|{card}"

    def cached(self, m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> dict | None:
        """The cached choice for this shape (this card's own, else a same-kind card's: see the module doc), else
        None (then call choose). Per-call fast path: a tuple-keyed memo in front of the string-keyed cache, so a hit
        formats no key; a memo entry counts only while it is still the cache's entry for its key and, for a
        same-kind card's entry, while this card has none of its own (the cache may be edited directly)."""
        fk = (m_bucket(m), n, k, dtype, device.type, device.index)
        hit = self._memo.get(fk)
        if hit is not None and self.cache.get(hit[0]) is hit[1] and (hit[2] == hit[0] or hit[2] not in self.cache):
            return hit[1]
        name = device_name(device)
        own = self.card_key(m, n, k, dtype, name)
        key, cfg = own, self.cache.get(own)
        if cfg is None and self.cards:
            for card in same_kind(self.cards, name, card_props(device)):
                key = self.card_key(m, n, k, dtype, card)
                cfg = self.cache.get(key)
                if cfg is not None:
                    break
        if cfg is not None and (device.index is not None or device.type != "cuda"):
            self._memo[fk] = (key, cfg, own)
        return cfg

    def choose(self, key: str, candidates: Sequence[dict], runner: Callable[[dict], Callable[[], Any]],
               default: dict, bench: Callable[[Callable[[], Any]], float] = bench_ms, margin: float = 1.0,
               fallback: dict | None = None) -> dict:
        """Return the cached choice for key, else time `runner(c)()` for each candidate (with `bench`, in ms) and
        keep the fastest; with margin < 1, candidates[0] (a baseline) is kept unless another takes < margin of its
        time. A runner that raises (fails to build, or computes wrongly) is never chosen. When every candidate
        fails, `fallback` (default: `default`) is used with a warning and kept for this process only (not written
        to the autotune cache file: a later process tries again)."""
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        if not enabled():
            return default
        timings = []
        for cand in candidates:
            try:
                fn = runner(cand)
                timings.append((bench(fn), cand))
            except Exception as e:  # a config that fails to compile/launch is simply not chosen
                timings.append((float("inf"), {**cand, "error": f"{type(e).__name__}: {str(e)[:200]}"}))
        ok = [t for t in timings if t[0] != float("inf")]
        if not ok:
            best = default if fallback is None else fallback
            first = timings[0][1].get("error", "no candidates") if timings else "no candidates"
            warnings.warn(f"{self.op}: every candidate config failed for {key} (first: {first}); using {best} "
                          f"for this process", RuntimeWarning, stacklevel=2)
        else:
            best = min(ok, key=lambda t: t[0])[1]
            if timings[0][0] != float("inf") and not min(t[0] for t in ok) < margin * timings[0][0]:
                best = timings[0][1]
        with _LOCK:
            self.cache[key] = best
            self.log.append({"key": key, "timings": [(t, c) for t, c in timings], "best": best})
            if not ok:
                self._unpersisted.add(key)
        self._persist()
        return best

    def _persist(self) -> None:
        path = SETTINGS.autotune_cache
        if not path:
            return
        p = Path(path)
        try:
            data = json.loads(p.read_text()) if p.is_file() else {}
            data.setdefault(self.op, {}).update({k: v for k, v in self.cache.items() if k not in self._unpersisted})
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(data, indent=1, sort_keys=True))
        except (OSError, ValueError):
            pass
