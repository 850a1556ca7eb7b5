"""The one harness every benchmark uses: run facts, interleaved timing with spread, the json + markdown writer.

A benchmark script imports it as `from _harness import ...` (scripts run as `python benchmarks/<name>.py`, so this
folder is on sys.path) and writes `benchmarks/results/<name>.json` and `<name>.md` through `write()`: each file
names the device, the card, the date, the commit, and every timed row carries its median and min-max over
interleaved rounds.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import statistics
import subprocess
import time
from typing import Callable, Mapping, Sequence

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def commit() -> str:
    """The commit measured: HFQ_COMMIT where set (a device copy of the tree, whose .git may be absent or stale),
    else git's HEAD, marked "+modified" when tracked files differ from it (the tree measured is not that commit)."""
    sha = os.environ.get("HFQ_COMMIT")
    if sha:
        return sha
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=root, timeout=30).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        if not head:
            return "unknown"
        return head + ("+modified" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_facts() -> dict:
    """Device, card(s), date, commit and library versions of this run."""
    import torch
    facts = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit(),
             "torch": torch.__version__}
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
        facts.update(device="cuda", card=" + ".join(names), gpus=n)
    else:
        facts.update(device="cpu", card="cpu", gpus=0)
    try:
        import triton
        facts["triton"] = triton.__version__
    except ImportError:
        pass
    return facts


def sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def spread(times: Sequence[float]) -> dict:
    """Median, min, max and (max-min)/median of a list of repeats."""
    med = statistics.median(times)
    return {"median": med, "min": min(times), "max": max(times), "n": len(times),
            "spread": (max(times) - min(times)) / med if med else 0.0}


def interleaved(fns: Mapping[str, Callable[[], object]], rounds: int = 3, warmup: int = 1, inner: int = 1,
                timer: Callable[[], float] = time.perf_counter) -> dict[str, dict]:
    """Time each callable `rounds` times, round-robin (A B C, A B C, ...), after `warmup` untimed calls each;
    a round's figure is the mean of `inner` back-to-back calls. Returns {name: spread(...) + "times"}."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync()
            t0 = timer()
            for _ in range(inner):
                fn()
            sync()
            times[name].append((timer() - t0) / inner)
    return {k: dict(spread(v), times=v) for k, v in times.items()}


def ratio(base: dict, ours: dict) -> dict:
    """base/ours speed-up of medians, with the range the rounds allow (worst pairing to best pairing)."""
    return {"ratio": base["median"] / ours["median"], "ratio_min": base["min"] / ours["max"],
            "ratio_max": base["max"] / ours["min"]}


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def table(rows: Sequence[Mapping], columns: Sequence[str] | Mapping[str, str] | None = None) -> list[str]:
    """Markdown table lines of `rows`: `columns` are row keys (the header), or {key: header}; missing cells blank."""
    columns = columns if columns is not None else (list(rows[0]) if rows else [])
    heads = dict(columns) if isinstance(columns, Mapping) else {c: c for c in columns}
    lines = ["| " + " | ".join(heads.values()) + " |", "|" + "---|" * len(heads)]
    return lines + ["| " + " | ".join(_fmt(r.get(c, "")) for c in heads) + " |" for r in rows]


def markdown(title: str, facts: dict, rows: Sequence[Mapping], columns=None, notes: str = "") -> str:
    """`# title`, the run facts, the table of `rows` (see `table`), then `notes` (markdown: text, more tables)."""
    head = ", ".join(f"{k}: {facts[k]}" for k in ("device", "card", "date", "commit") if k in facts)
    lines = [f"# {title}", "", head, ""]
    if rows:
        lines += table(rows, columns)
    if notes:
        lines += ["", notes.strip()]
    return "\n".join(lines) + "\n"


def write(name: str, rows: Sequence[Mapping], columns=None, notes: str = "",
          out_dir: str | None = None, facts: dict | None = None, extra: dict | None = None,
          title: str | None = None, md_rows: Sequence[Mapping] | None = None) -> tuple[str, str]:
    """Write `<out_dir>/<name>.json` (facts + rows + extra) and `<name>.md` (`markdown` of `md_rows`, when the table
    shows cells made for reading, e.g. "1.17 (1.06-1.26)", else of `rows`); returns the two paths.
    out_dir defaults to $OUT (the device's return folder) when set, else benchmarks/results."""
    out_dir = out_dir or os.environ.get("OUT") or RESULTS
    os.makedirs(out_dir, exist_ok=True)
    facts = facts or run_facts()
    payload = {"name": name, "facts": facts, "rows": list(rows), **(extra or {})}
    jpath, mpath = os.path.join(out_dir, f"{name}.json"), os.path.join(out_dir, f"{name}.md")
    with open(jpath, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    with open(mpath, "w") as f:
        f.write(markdown(title or name, facts, rows if md_rows is None else md_rows, columns, notes))
    return jpath, mpath


def add_args(parser):
    """The options every benchmark takes: --out (results folder), --rounds (interleaved rounds, >= 3 for tables)."""
    parser.add_argument("--out", default=None, help="results folder (default $OUT, else benchmarks/results)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds (>= 3 for a results table)")
    return parser
