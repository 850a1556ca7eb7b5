"""Per-call cost of NVFP4Linear vs a bf16 nn.Linear (and of their PEFT LoRA r=32 layers), at 7B MLP shapes.

    python benchmarks/nvfp4_overhead.py [--out DIR]        # device: 3 shapes x M in 1, 8, 16, 256, 2048
    python benchmarks/nvfp4_overhead.py --device cpu --quick --out /tmp/oh   # end-to-end check on CPU, tiny shapes

What is timed is what a model pays per layer call in eager mode, host work included: `calls` back-to-back calls
(default 200) and one synchronize, divided by `calls`; the calls go through --copies copies of each layer in turn
(default 4), as a model's layers follow one another, so that no weight is still in L2 at its next call. Forward
under no_grad; forward+backward as y = layer(x); torch.autograd.grad(y, [x, trainable params], gy) (the base weight
frozen on both sides, as in LoRA training; the gradient of x is wanted, as for every layer but the first). Each
measurement runs --rounds rounds (default 3) with ours and the baseline interleaved (ours, bf16, ours, bf16, ...);
the report gives the median, the range (min-max over rounds) and the ratio of medians ours/bf16 (with its range:
worst to best pairing of rounds). Rows are written to nvfp4_overhead.{json,md} after each one, so a killed run keeps
what it measured. The LoRA layers are PEFT's own (get_peft_model, r=32, alpha=64, no dropout), timed as the wrapped
layer (PEFT's LoRA Linear / hfq's NVFP4LoraLinear), without the PeftModel wrapper around it, with the adapter
weights in bf16 as QeRL's training runs them (bf16 adapters, or fp32 ones under bf16 autocast; PEFT's fp32 adapters
without autocast take PEFT's own forward on both sides).
The "pyfn" rows time the floor of any layer written in Python: a torch.autograd.Function around the same bf16
F.linear (its backward g @ W), against nn.Linear; NVFP4Linear's eager route is such a Function.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import add_args, interleaved, ratio, spread, write  # noqa: E402

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


def _lora(layer: nn.Module, device) -> nn.Module:
    """The PEFT LoRA layer (r=32) wrapping `layer` (hfq's NVFP4LoraLinear for an NVFP4Linear)."""
    import peft

    import hfq  # noqa: F401  (registers NVFP4Linear with PEFT's LoRA)

    pm = peft.get_peft_model(_Holder(layer, device), peft.LoraConfig(r=32, lora_alpha=64, lora_dropout=0.0,
                                                             target_modules=["proj"]))
    for name, p in pm.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(torch.bfloat16)
    return pm.base_model.model.proj


class _PyLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.w = w
        return torch.nn.functional.linear(x, w)

    @staticmethod
    def backward(ctx, g):
        return g @ ctx.w, None


class _PyLinear(nn.Module):
    """nn.Linear's product (frozen weight) through a Python autograd.Function: the host cost of the pattern."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base = base

    def forward(self, x):
        return _PyLinearFn.apply(x, self.base.weight)


def measure(ours: list, base: list, x: torch.Tensor, mode: str, calls: int, rounds: int,
            warmup: int = 5) -> dict:
    """ours / base in one mode ("fwd" or "fwdbwd"): interleaved rounds of `calls` back-to-back calls, us per call.
    Each side is a list of copies of its layer called in turn, so a weight is not found in L2 by the next call."""
    fns = {}
    for name, layers in (("ours", ours), ("bf16", base)):
        if mode == "fwd":
            def fn(layers=layers):
                with torch.no_grad():
                    for layer in layers:
                        layer(x)
        else:
            xg = x.detach().clone().requires_grad_(True)
            params = [[p for p in layer.parameters() if p.requires_grad] for layer in layers]
            with torch.no_grad():
                gy = torch.randn_like(layers[0](xg))

            def fn(layers=layers, xg=xg, params=params, gy=gy):
                for layer, ps in zip(layers, params):
                    y = layer(xg)
                    torch.autograd.grad(y, [xg, *ps], gy)
        fns[name] = fn
    per = len(ours)  # layer calls per fn call
    t = interleaved(fns, rounds=rounds, warmup=warmup, inner=max(1, calls // per))  # warm-up: plan / tune / repack
    t = {k: dict(spread(times), times=times) for k, times in ((k, [x / per for x in v["times"]]) for k, v in t.items())}
    q = ratio(t["ours"], t["bf16"])  # ours / bf16 time
    us = {k: {s: round(v[s] * 1e6, 2) for s in ("median", "min", "max")} for k, v in t.items()}
    return dict(ours_us=us["ours"]["median"], ours_range=f"{us['ours']['min']}-{us['ours']['max']}",
                bf16_us=us["bf16"]["median"], bf16_range=f"{us['bf16']['min']}-{us['bf16']['max']}",
                ratio=round(q["ratio"], 3), ratio_range=f"{q['ratio_min']:.3f}-{q['ratio_max']:.3f}",
                times_us={k: [round(x * 1e6, 2) for x in v["times"]] for k, v in t.items()})


def _plan_kind(layer) -> str | None:
    """The kernel kind NVFP4Linear's eager plan picked for the last shape (None: the op path, e.g. on CPU)."""
    lin = getattr(layer, "base_layer", layer)
    st = lin.__dict__.get("_hfq_plans")
    if not st or not st[1]:
        return None
    plan = list(st[1].values())[-1]
    return plan.config["kind"] if plan.config else "dense"


COLUMNS = {"layer": "layer", "K": "in", "N": "out", "M": "M", "mode": "mode", "ours_us": "ours us",
           "ours_range": "range", "bf16_us": "bf16 us", "bf16_range": "range", "ratio": "ratio",
           "ratio_range": "ratio range", "kind": "kind", "error": "error"}


def save(rows: list, calls: int, rounds: int, out: str | None, extra: dict) -> str:
    notes = (f"{calls} back-to-back calls, one sync, {rounds} interleaved rounds; the calls cycle through "
             f"{extra.get('copies', 1)} copies of each layer, so no weight stays in L2 between its calls. us per "
             "call: median (range min-max over rounds). ratio = median ours / median bf16 (range: worst to best "
             "pairing of rounds); < 1 means ours is faster. fwd: no_grad forward; fwdbwd: forward + grad of x (+ LoRA "
             "A/B), frozen base. kind: the kernel our eager plan chose (gluon: the few-row decode kernel, whose "
             "training calls take the few-row grad-input kernel in backward; dequant: dequantize + cuBLAS, the "
             "training forward keeping its dense weight for grad-input). pyfn rows: 'ours' is the same bf16 product "
             "through a Python autograd.Function.")
    return write("nvfp4_overhead", rows, COLUMNS, notes, out_dir=out, extra=extra,
                 title="NVFP4Linear vs bf16 nn.Linear: per-call time, host work included")[1]


def selftest() -> None:
    """Rows and the table on made-up layers (CPU, tiny): measure() and save() end to end."""
    import tempfile

    base = nn.Linear(8, 16, bias=False).requires_grad_(False)
    row = dict(layer="linear", K=8, N=16, M=1, mode="fwd",
               **measure([base], [base], torch.randn(1, 8), "fwd", 2, 3, 1))
    assert row["ours_us"] > 0 and len(row["times_us"]["ours"]) == 3
    with tempfile.TemporaryDirectory() as d:
        md = open(save([row, dict(layer="lora", K=8, N=16, M=1, mode="fwd", error="RuntimeError: x")], 2, 3, d,
                       {})).read()
        assert f"| linear | 8 | 16 | 1 | fwd | {row['ours_us']} | {row['ours_range']} |" in md, md
        assert "| RuntimeError: x |" in md
    print("selftest ok")


def main():
    ap = add_args(argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, few calls (a CPU end-to-end check)")
    ap.add_argument("--calls", type=int, default=None, help="back-to-back calls per measurement (default 200)")
    ap.add_argument("--ms", default=None, help="comma-separated M values")
    ap.add_argument("--no-lora", action="store_true")
    ap.add_argument("--copies", type=int, default=4,
                    help="copies of each layer called in turn (default 4: more weight bytes than an H100/H200's L2)")
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
    extra = dict(calls=calls, rounds=a.rounds, shapes=shapes, ms=ms, copies=a.copies)
    rows = []
    t0 = time.time()
    for k, n in shapes:
        torch.manual_seed(0)
        bases = [nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16).requires_grad_(False)
                 for _ in range(a.copies)]
        ours = [NVFP4Linear.from_linear(b) for b in bases]
        layers = [("linear", ours, bases), ("pyfn", [_PyLinear(b) for b in bases], bases)]
        if not a.no_lora:
            layers.append(("lora_r32", [_lora(NVFP4Linear.from_linear(b), dev) for b in bases],
                           [_lora(b, dev) for b in bases]))
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            for name, o, b in layers:
                for mode in ("fwd", "fwdbwd"):
                    row = dict(layer=name, K=k, N=n, M=m, mode=mode)
                    try:
                        row.update(measure(o, b, x, mode, calls, a.rounds))
                        row["kind"] = _plan_kind(o[0])
                    except Exception as e:  # noqa: BLE001  (keep the other rows)
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    rows.append(row)
                    md = save(rows, calls, a.rounds, a.out, extra)
                    print(f"[{time.time() - t0:6.1f}s] {json.dumps(row)}", flush=True)
        del bases, ours, layers
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
