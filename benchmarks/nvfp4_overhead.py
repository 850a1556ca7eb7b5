"""Per-call cost of NVFP4Linear vs a bf16 nn.Linear (and of their PEFT LoRA r=32 layers), at 7B MLP shapes.

    python benchmarks/nvfp4_overhead.py [--out DIR]        # device: 3 shapes x M in 1, 8, 16, 256, 2048
    python benchmarks/nvfp4_overhead.py --device cpu --quick --out /tmp/oh   # end-to-end check on CPU, tiny shapes

What is timed is what a model pays per layer call in eager mode, host work included: `calls` back-to-back calls
(default 200) and one synchronize, divided by `calls`. Forward under no_grad; forward+backward as
y = layer(x); torch.autograd.grad(y, [x, trainable params], gy) (the base weight frozen on both sides, as in
LoRA training; the gradient of x is wanted, as for every layer but the first). Each measurement is repeated
(default 3 times) with ours and the baseline interleaved (ours, bf16, ours, bf16, ...); the report gives the
median, the spread (min-max over repeats) and the ratio of medians ours/bf16 (with its spread: the min-max of
the per-repeat ratios). Rows are written to nvfp4_overhead.{json,md} after each one, so a killed run keeps
what it measured. The LoRA layers are PEFT's own (get_peft_model, r=32, alpha=64, no dropout), timed as the
wrapped layer (PEFT's LoRA Linear / hfq's NVFP4LoraLinear), without the PeftModel wrapper around it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [(3584, 18944), (18944, 3584), (3584, 3584)]  # (in, out): Qwen2.5-7B gate/up, down, and a square one
MS = [1, 8, 16, 256, 2048]  # the training-speed target's ranges: M <= 16 and M >= 256
QUICK_SHAPES = [(64, 192), (192, 64)]
QUICK_MS = [1, 8, 40]


class _Holder(nn.Module):
    """A one-layer model, so that PEFT can wrap `proj`."""

    def __init__(self, layer: nn.Module, device):
        super().__init__()
        self.proj = layer
        # PEFT reads the model's device from its first parameter; a bias-free NVFP4Linear has none
        self.anchor = nn.Parameter(torch.zeros(1, device=device), requires_grad=False)

    def forward(self, x):
        return self.proj(x)


def _commit() -> str:
    c = os.environ.get("HFQ_COMMIT")
    if c:
        return c
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL,
                                       cwd=Path(__file__).resolve().parents[1]).strip()
    except Exception:  # noqa: BLE001  (the device copy of the tree may have no .git)
        return "unknown"


def _lora(layer: nn.Module, device) -> nn.Module:
    """The PEFT LoRA layer (r=32) wrapping `layer` (hfq's NVFP4LoraLinear for an NVFP4Linear)."""
    import peft

    import hfq  # noqa: F401  (registers NVFP4Linear with PEFT's LoRA)

    pm = peft.get_peft_model(_Holder(layer, device), peft.LoraConfig(r=32, lora_alpha=64, lora_dropout=0.0,
                                                             target_modules=["proj"]))
    return pm.base_model.model.proj


def _time_per_call(fn, calls: int, sync) -> float:
    """us per call of `calls` back-to-back fn() with one synchronize (the queue drained before the start)."""
    sync()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t) / calls * 1e6


def _stats(v: list[float]) -> dict:
    return dict(median=round(statistics.median(v), 2), min=round(min(v), 2), max=round(max(v), 2),
                all=[round(t, 2) for t in v])


def measure(ours: nn.Module, base: nn.Module, x: torch.Tensor, mode: str, calls: int, repeats: int, sync,
            warmup: int = 5) -> dict:
    """Interleaved repeats of ours / base in one mode ("fwd" or "fwdbwd")."""
    fns = {}
    for name, layer in (("ours", ours), ("bf16", base)):
        if mode == "fwd":
            def fn(layer=layer):
                with torch.no_grad():
                    layer(x)
        else:
            xg = x.detach().clone().requires_grad_(True)
            params = [p for p in layer.parameters() if p.requires_grad]
            with torch.no_grad():
                gy = torch.randn_like(layer(xg))

            def fn(layer=layer, xg=xg, params=params, gy=gy):
                y = layer(xg)
                torch.autograd.grad(y, [xg, *params], gy)
        for _ in range(warmup):  # first calls plan / tune / repack
            fn()
        fns[name] = fn
    times = {"ours": [], "bf16": []}
    for _ in range(repeats):
        for name in ("ours", "bf16"):
            times[name].append(_time_per_call(fns[name], calls, sync))
    ratios = [a / b for a, b in zip(times["ours"], times["bf16"])]
    o, b = _stats(times["ours"]), _stats(times["bf16"])
    return dict(ours_us=o, bf16_us=b, ratio=round(o["median"] / b["median"], 3),
                ratio_spread=[round(min(ratios), 3), round(max(ratios), 3)])


def _plan_kind(layer) -> str | None:
    """The kernel kind NVFP4Linear's eager plan picked for the last shape (None: the op path, e.g. on CPU)."""
    lin = getattr(layer, "base_layer", layer)
    st = lin.__dict__.get("_hfq_plans")
    if not st or not st[1]:
        return None
    cfg = list(st[1].values())[-1].config
    return cfg["kind"] if cfg else "dense"


def write(res: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "nvfp4_overhead.json").write_text(json.dumps(res, indent=1))
    (out / "nvfp4_overhead.md").write_text(to_markdown(res))


def to_markdown(res: dict) -> str:
    lines = ["# NVFP4Linear vs bf16 nn.Linear: per-call time, host work included", "",
             f"device: {res['device']} | date: {res['date']} | commit: `{res['commit']}` | torch {res['torch']} | "
             f"triton {res['triton']} | {res['calls']} back-to-back calls, one sync, {res['repeats']} interleaved "
             f"repeats", "",
             "us per call: median (min-max over repeats). ratio = median ours / median bf16 (min-max of the "
             "per-repeat ratios); < 1 means ours is faster. fwd: no_grad forward; fwdbwd: forward + grad of x "
             "(+ LoRA A/B), frozen base. kind: the kernel our eager plan chose.", "",
             "| layer | in | out | M | mode | ours us | bf16 us | ratio | kind |",
             "|---|---:|---:|---:|---|---:|---:|---:|---|"]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['layer']} | {r['K']} | {r['N']} | {r['M']} | {r['mode']} | error: "
                         f"{r['error'][:120]} | | | |")
            continue
        o, b = r["ours_us"], r["bf16_us"]
        lines.append(f"| {r['layer']} | {r['K']} | {r['N']} | {r['M']} | {r['mode']} | "
                     f"{o['median']} ({o['min']}-{o['max']}) | {b['median']} ({b['min']}-{b['max']}) | "
                     f"{r['ratio']} ({r['ratio_spread'][0]}-{r['ratio_spread'][1]}) | {r.get('kind')} |")
    lines.append("")
    return "\n".join(lines)


def selftest() -> None:
    """Table writing on made-up numbers (no device work)."""
    import tempfile

    row = dict(layer="linear", K=8, N=16, M=1, mode="fwd", kind="gluon",
               **{"ours_us": _stats([3.0, 1.0, 2.0]), "bf16_us": _stats([2.0, 2.0, 4.0])})
    row["ratio"], row["ratio_spread"] = 1.0, [0.5, 1.5]
    res = dict(device="none", date="-", commit="-", torch="-", triton="-", calls=1, repeats=3,
               rows=[row, dict(layer="lora", K=8, N=16, M=1, mode="fwd", error="RuntimeError: x")])
    with tempfile.TemporaryDirectory() as d:
        write(res, Path(d))
        md = (Path(d) / "nvfp4_overhead.md").read_text()
        assert "| linear | 8 | 16 | 1 | fwd | 2.0 (1.0-3.0) | 2.0 (2.0-4.0) | 1.0 (0.5-1.5) | gluon |" in md, md
        assert json.loads((Path(d) / "nvfp4_overhead.json").read_text())["rows"][0]["ours_us"]["median"] == 2.0
    print("selftest ok")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, few calls (a CPU end-to-end check)")
    ap.add_argument("--calls", type=int, default=None, help="back-to-back calls per measurement (default 200)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ms", default=None, help="comma-separated M values")
    ap.add_argument("--no-lora", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--selftest", action="store_true")
    a = ap.parse_args()
    if a.selftest:
        return selftest()
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("nvfp4_overhead: no CUDA device (use --device cpu --quick for a CPU check)")
    from hfq.nvfp4 import NVFP4Linear

    shapes = QUICK_SHAPES if a.quick else SHAPES
    ms = [int(m) for m in a.ms.split(",")] if a.ms else (QUICK_MS if a.quick else MS)
    calls = a.calls or (20 if a.quick else 200)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = None
    res = dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), commit=_commit(),
               torch=torch.__version__, triton=tv, calls=calls, repeats=a.repeats, shapes=shapes, ms=ms, rows=[])
    out = Path(a.out)
    t0 = time.time()
    for k, n in shapes:
        torch.manual_seed(0)
        base = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16).requires_grad_(False)
        ours = NVFP4Linear.from_linear(base)
        layers = [("linear", ours, base)]
        if not a.no_lora:
            layers.append(("lora_r32", _lora(NVFP4Linear.from_linear(base), dev), _lora(base, dev)))
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            for name, o, b in layers:
                for mode in ("fwd", "fwdbwd"):
                    row = dict(layer=name, K=k, N=n, M=m, mode=mode)
                    try:
                        row.update(measure(o, b, x, mode, calls, a.repeats, sync))
                        row["kind"] = _plan_kind(o)
                    except Exception as e:  # noqa: BLE001  (keep the other rows)
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    res["rows"].append(row)
                    write(res, out)
                    print(f"[{time.time() - t0:6.1f}s] {json.dumps(row)}", flush=True)
        del base, ours, layers
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print(f"wrote {out / 'nvfp4_overhead.json'} {out / 'nvfp4_overhead.md'}")


if __name__ == "__main__":
    main()
