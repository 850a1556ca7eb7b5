"""One NVFP4 weight copy on the GPU (the g4 layout) vs the canonical buffers + the decode kernel's cached copy.

    python benchmarks/nvfp4_layout.py [--layers 4] [--repeats 3] [--out DIR]     # device
    python benchmarks/nvfp4_layout.py --selftest                                 # table writing only

Builds `--layers` decoder layers' linears at Qwen2.5-7B shapes (q 3584->3584, k/v 3584->512, o 3584->3584,
gate/up 3584->18944, down 18944->3584) three times: NVFP4Linear in the g4 layout ("g4", the default), NVFP4Linear
kept canonical (allow_g4=False: the Gluon decode kernel caches its repacked copy beside the buffers, "canonical")
and bf16 nn.Linear. Reports the bytes each set holds on the device after warm-up (decode at M=1 and 8 and a
training forward+backward at M=2048 each ran once), then per-call times, interleaved over `--repeats`
rounds: decode forward at M=1 and 8 (`--calls` back-to-back passes over all linears, one sync) and forward +
grad-input at M=2048 (frozen weights, as under LoRA); then one dequantize of each weight shape to bf16 with g4's
word-wise and gather kernels and the canonical kernel. Writes nvfp4_layout.{json,md}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [(3584, 3584), (3584, 512), (3584, 512), (3584, 3584), (3584, 18944), (3584, 18944), (18944, 3584)]
ARMS = ("g4", "canonical", "bf16")


from nvfp4_overhead import _commit, _time_per_call  # noqa: E402  (the benchmarks' commit and per-call timing)


def build(arm: str, layers: int, dev) -> list[nn.Module]:
    from hfq.nvfp4 import NVFP4Linear

    mods = []
    g = torch.Generator(device=dev).manual_seed(0)
    for _ in range(layers):
        for k, n in SHAPES:
            lin = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
            with torch.no_grad():
                lin.weight.normal_(0, 0.02, generator=g)
            if arm == "bf16":
                mods.append(lin.requires_grad_(False))
                continue
            q = NVFP4Linear.from_linear(lin)
            q.allow_g4 = arm == "g4"
            del lin
            mods.append(q)
    return mods


def run_all(mods, xs: dict, grad: bool):
    if not grad:
        with torch.no_grad():
            for m in mods:
                m(xs[m.in_features])
        return
    for m in mods:
        x = xs[m.in_features]
        y = m(x)
        torch.autograd.grad(y, [x], torch.ones_like(y))


def _inputs(m: int, dev, grad: bool) -> dict:
    return {k: torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=grad) for k in (3584, 18944)}


def _stats(v):
    return dict(median=round(statistics.median(v), 3), min=round(min(v), 3), max=round(max(v), 3),
                all=[round(t, 3) for t in v])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--selftest", action="store_true")
    a = ap.parse_args()
    if a.selftest:
        return selftest()
    dev = torch.device("cuda")
    import hfq  # noqa: F401

    arms, held = {}, {}
    cases = {"decode M=1": (1, False), "decode M=8": (8, False), "fwd+grad_x M=2048": (2048, True)}
    inputs = {c: _inputs(m, dev, g) for c, (m, g) in cases.items()}
    for arm in ARMS:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        mods = build(arm, a.layers, dev)
        for c, (m, g) in cases.items():
            run_all(mods, inputs[c], g)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        held[arm] = (torch.cuda.memory_allocated() - before) / 2 ** 30
        if arm != "bf16":
            held[arm + " layouts"] = sorted({getattr(m, "layout", "-") for m in mods})
        arms[arm] = mods
        print(f"{arm}: held {held[arm]:.3f} GiB", flush=True)
    times = {c: {arm: [] for arm in ARMS} for c in cases}
    for _ in range(a.repeats):
        for c, (m, g) in cases.items():
            for arm in ARMS:
                calls = a.calls if m < 256 else max(2, a.calls // 5)
                fn = (lambda mods=arms[arm], xs=inputs[c], g=g: run_all(mods, xs, g))
                times[c][arm].append(_time_per_call(fn, calls, torch.cuda.synchronize) / 1e3)
    rows = []
    for c in cases:
        r = dict(case=c, **{arm: _stats(times[c][arm]) for arm in ARMS})
        r["g4/canonical"] = round(r["g4"]["median"] / r["canonical"]["median"], 3)
        r["g4/bf16"] = round(r["g4"]["median"] / r["bf16"]["median"], 3)
        rows.append(r)
        print(r, flush=True)
    res = dict(device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), commit=_commit(),
               torch=torch.__version__, layers=a.layers, shapes=SHAPES, repeats=a.repeats, calls=a.calls,
               held_gib={k: (round(v, 3) if isinstance(v, float) else v) for k, v in held.items()}, rows=rows,
               dequant=time_dequantize(arms, a.repeats))
    write(res, Path(a.out))


def time_dequantize(arms, repeats: int, calls: int = 50) -> list[dict]:
    """us per dequantize of one weight of each shape to bf16: g4 word-wise / g4 gather / canonical (interleaved)."""
    from hfq_kernels import nvfp4_gluon as G4
    from hfq_kernels.nvfp4_quant import dequant_raw

    out = []
    for i in range(len(SHAPES)):
        g4, cn = arms["g4"][i], arms["canonical"][i]
        n, k = g4.out_features, g4.in_features
        wr, sr, gs = g4.weight_g4, g4.weight_g4_scale, g4.weight_global_scale
        p, sc = cn._buffers["weight_packed"], cn._buffers["weight_scale"]
        fns = {"g4 words": lambda: G4.dequantize_g4(wr, sr, gs, n, k, kernel="words"),
               "g4 gather": lambda: G4.dequantize_g4(wr, sr, gs, n, k, kernel="gather"),
               "canonical": lambda: dequant_raw(p, sc, gs, torch.bfloat16)}
        ts = {name: [] for name in fns}
        for _ in range(repeats):
            for name, fn in fns.items():
                fn()
                ts[name].append(_time_per_call(fn, calls, torch.cuda.synchronize))
        out.append(dict(K=k, N=n, **{name: _stats(v) for name, v in ts.items()}))
        print(out[-1], flush=True)
    return out


def write(res, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    (out / "nvfp4_layout.json").write_text(json.dumps(res, indent=1))
    (out / "nvfp4_layout.md").write_text(to_markdown(res))


def to_markdown(res) -> str:
    h = res["held_gib"]
    lines = ["# NVFP4 weights: one g4 copy vs canonical + the decode kernel's cached copy", "",
             f"device: {res['device']} | date: {res['date']} | commit: `{res['commit']}` | torch {res['torch']} | "
             f"{res['layers']} decoder layers of Qwen2.5-7B linears (in, out): {res['shapes']} | {res['repeats']} "
             "interleaved repeats", "",
             f"held on the device after warm-up: g4 **{h['g4']} GiB**, canonical + cached copy {h['canonical']} GiB, "
             f"bf16 {h['bf16']} GiB", "",
             "ms per pass over all linears: median (min-max over repeats)", "",
             "| case | g4 | canonical + copy | bf16 | g4 / canonical | g4 / bf16 |", "|---|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        cell = [f"{r[a]['median']} ({r[a]['min']}-{r[a]['max']})" for a in ARMS]
        lines.append(f"| {r['case']} | {cell[0]} | {cell[1]} | {cell[2]} | {r['g4/canonical']} | {r['g4/bf16']} |")
    if res.get("dequant"):
        names = ("g4 words", "g4 gather", "canonical")
        lines += ["", "us per dequantize of one weight to bf16 (the M > 64 forward and every grad-input): median "
                  "(min-max)", "", "| in | out | " + " | ".join(names) + " |", "|---:|---:|---:|---:|---:|"]
        for r in res["dequant"]:
            lines.append(f"| {r['K']} | {r['N']} | "
                         + " | ".join(f"{r[x]['median']} ({r[x]['min']}-{r[x]['max']})" for x in names) + " |")
    return "\n".join(lines + [""])


def selftest():
    import tempfile

    st = _stats([1.0, 2.0, 3.0])
    res = dict(device="none", date="-", commit="-", torch="-", layers=1, shapes=SHAPES[:1], repeats=3, calls=1,
               held_gib={"g4": 1.0, "canonical": 2.0, "bf16": 4.0},
               rows=[dict(case="decode M=1", g4=st, canonical=st, bf16=st, **{"g4/canonical": 1.0, "g4/bf16": 1.0})],
               dequant=[dict(K=8, N=16, **{"g4 words": st, "g4 gather": st, "canonical": st})])
    with tempfile.TemporaryDirectory() as d:
        write(res, Path(d))
        md = (Path(d) / "nvfp4_layout.md").read_text()
        assert "| decode M=1 | 2.0 (1.0-3.0) | 2.0 (1.0-3.0) | 2.0 (1.0-3.0) | 1.0 | 1.0 |" in md, md
        assert "| 8 | 16 | 2.0 (1.0-3.0) | 2.0 (1.0-3.0) | 2.0 (1.0-3.0) |" in md, md
    print("selftest ok")


if __name__ == "__main__":
    main()
