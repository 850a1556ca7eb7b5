"""Reproduce ECO's Table 1 in miniature: a small Llama trained from scratch on offline generated text with
FP8 (E4M3, row-wise) decoder-linear weights, six configurations:

  BF16 w/ MW            plain weights, AdamW (fp32 master weights; bf16 autocast on GPU, fp32 on CPU)
  FP8 w/ MW + RTN       fp32 master weights, forward on RTN-quantized FP8 weights (straight-through)
  FP8 w/o MW + RTN      FP8 QParams updated directly, no error feedback (naive)
  FP8 w/o MW + SR       same with stochastic rounding (naive)
  FP8 w/o MW ECO + RTN  ECOAdamW, memory-free error injection, RTN
  FP8 w/o MW ECO + SR   ECOAdamW, memory-free error injection, SR

The mechanism ECO addresses shows when Adam's step (about lr per element) is small next to the FP8 grid spacing
(1/16..1/8 of |w|): without master weights such updates are rounded away (RTN) or turned into rounding noise (SR),
and the paper's analysis has naive removal's error growing like 1/lr. So the run sweeps the peak lr (`--lrs`) and
decays it with a cosine to `--min-lr-ratio` of the peak (0 by default: the annealing phase is where the small
updates are). Besides the validation loss it reports the fraction of decoder weights whose FP8 code changed over the
last 10% of the steps (for runs with master weights: codes of the RTN-quantized master weights): a stalled run
shows few moving codes.

Writes examples/results/eco_pretrain.{md,json,png} (final validation loss table, curves).
  python examples/eco_pretrain.py --quick      # CPU, ~15 min on 2 cores (--jobs 2, one thread each)
  python examples/eco_pretrain.py              # bigger (GPU)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from hfq.eco import ECOAdamW
from hfq_kernels.reference.fp8 import dequantize_fp8_row, quantize_fp8_row
from hfq.qft import QFTConfig, quantize_model_
from hfq.qparam import QParam
from hfq.tiny import char_tokenizer, tiny_config
from tiny_args import add_model_args

CONFIGS = ["BF16 w/ MW", "FP8 w/ MW + RTN", "FP8 w/o MW + RTN", "FP8 w/o MW + SR", "FP8 w/o MW ECO + RTN",
           "FP8 w/o MW ECO + SR"]

WORDS = ("the a one red blue small big cat dog bird fish tree house river stone runs sees eats finds likes "
         "under over near with and then quickly slowly").split()


def make_corpus(n_lines: int, seed: int = 0) -> str:
    """Offline text with learnable structure: a word-level Markov chain plus small additions."""
    rng = random.Random(seed)
    nxt = {w: rng.sample(WORDS, 4) for w in WORDS}
    lines = []
    for i in range(n_lines):
        if i % 3 == 0:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            lines.append(f"{a}+{b}={a + b}")
        else:
            w = rng.choice(WORDS)
            out = [w]
            for _ in range(rng.randint(4, 10)):
                w = rng.choice(nxt[w])
                out.append(w)
            lines.append(" ".join(out) + ".")
    return "\n".join(lines)


class FakeQuantLinear(nn.Linear):
    """Master weights in fp32; the forward sees FP8 row-quantized weights (straight-through gradient)."""

    def forward(self, x):
        w = self.weight
        with torch.no_grad():
            c, s = quantize_fp8_row(w.detach(), "rtn")
            q = dequantize_fp8_row(c, s, w.dtype)
        return F.linear(x, w + (q - w).detach(), self.bias)


def build(cfg_name, args, device, lr):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    cfg = tiny_config("llama", hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.heads,
                      intermediate=args.hidden * 4 if args.hidden >= 256 else args.hidden * 2, max_pos=args.seq)
    model = AutoModelForCausalLM.from_config(cfg).to(device)
    decay = dict(weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    if cfg_name == "BF16 w/ MW":
        return model, torch.optim.AdamW(model.parameters(), lr=lr, **decay)
    if cfg_name == "FP8 w/ MW + RTN":
        for name, mod in list(model.named_modules()):
            if type(mod) is nn.Linear and not name.endswith("lm_head"):
                mod.__class__ = FakeQuantLinear
        return model, torch.optim.AdamW(model.parameters(), lr=lr, **decay)
    quantize_model_(model, QFTConfig(weight_format="fp8_e4m3_row"))
    rule = "memory_free" if "ECO" in cfg_name else "naive"
    rounding = "sr" if cfg_name.endswith("SR") else "rtn"
    return model, ECOAdamW(model.parameters(), lr=lr, rule=rule, rounding=rounding, seed=args.seed, **decay)


@torch.no_grad()
def fp8_codes(model) -> list:
    """The FP8 codes (row scales aside) the forward uses for each decoder linear (RTN codes of the weight where it
    is not a QParam)."""
    out = []
    for name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if isinstance(w, QParam):
            out.append(w.codes.view(torch.uint8).clone())
        elif isinstance(mod, nn.Linear) and not name.endswith("lm_head"):
            out.append(quantize_fp8_row(w.detach().float(), "rtn")[0].view(torch.uint8))
    return out


def batches(ids, seq, bs, gen):
    n = ids.numel() - seq - 1
    while True:
        starts = torch.randint(0, n, (bs,), generator=gen)
        x = torch.stack([ids[s:s + seq + 1] for s in starts])
        yield x


@torch.no_grad()
def evaluate(model, val, seq, device, n_batches=8):
    model.eval()
    losses = []
    for i in range(n_batches):
        x = val[i * 8:(i + 1) * 8].to(device)
        losses.append(float(model(x, labels=x).loss))
    model.train()
    return sum(losses) / len(losses)


def train_one(cfg_name, lr, args, train_ids, val, device, threads=None):
    if threads:
        torch.set_num_threads(threads)
    model, opt = build(cfg_name, args, device, lr)
    warm = max(1, args.steps // 10)
    floor = args.min_lr_ratio
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min((t + 1) / warm, floor + (1 - floor) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, max(0, t - warm) / max(1, args.steps - warm))))))
    gen = torch.Generator().manual_seed(args.seed)
    it = batches(train_ids, args.seq, args.batch, gen)
    curve = []
    model.train()
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu",
                                                                                                   enabled=False)
    late = args.steps - max(1, args.steps // 10)
    before = None
    for step in tqdm(range(args.steps), desc=f"{cfg_name} lr {lr:g}", leave=False, disable=args.jobs > 1):
        if step == late:
            before = fp8_codes(model)
        x = next(it).to(device)
        with amp:
            loss = model(x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curve.append((step + 1, evaluate(model, val, args.seq, device)))
    after = fp8_codes(model)
    moved = sum(int((a != b).sum()) for a, b in zip(after, before)) / sum(a.numel() for a in after)
    print(f"{cfg_name} lr {lr:g}: final val loss {curve[-1][1]:.4f}, FP8 codes moved in the last 10%: "
          f"{100 * moved:.1f}%", flush=True)
    return {"curve": curve, "moved_last_10pct": moved}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true",
                    help="CPU-sized defaults (500 steps, 2x128 model, 2 jobs) where not given (~15 min, 2 cores)")
    ap.add_argument("--steps", type=int, default=2000)
    add_model_args(ap, hidden=384, layers=6, seq=128, batch=64)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--lrs", default="3e-3,3e-4", help="peak learning rates to sweep (comma-separated)")
    ap.add_argument("--min-lr-ratio", type=float, default=0.0, help="cosine decays to this fraction of the peak")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="parallel runs (CPU: one thread each)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()
    if args.quick:  # only where the command line left the default
        quick = dict(steps=500, hidden=128, layers=2, heads=4, seq=64, batch=16, eval_every=25, jobs=2)
        for k, v in quick.items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        args.jobs = 1
    threads = 1 if args.jobs > 1 else max(1, min(4, os.cpu_count() or 1))
    torch.set_num_threads(threads)
    tok = char_tokenizer()
    text = make_corpus(6000 if args.quick else 60000, args.seed)
    ids = torch.tensor(tok(text)["input_ids"], dtype=torch.long)
    split = int(0.9 * ids.numel())
    train_ids, val_ids = ids[:split], ids[split:]
    nv = (val_ids.numel() // (args.seq + 1))
    val = val_ids[:nv * (args.seq + 1)].view(nv, args.seq + 1)[:64]
    lrs = [float(v) for v in args.lrs.split(",")]
    names = args.configs.split(",")
    runs = [(lr, name) for lr in lrs for name in names]
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as ex:
            futs = [ex.submit(train_one, name, lr, args, train_ids, val, device, 1) for lr, name in runs]
            results = [f.result() for f in futs]
    else:
        results = [train_one(name, lr, args, train_ids, val, device) for lr, name in runs]
    res = {f"{lr:g}": {} for lr in lrs}
    for (lr, name), r in zip(runs, results):
        res[f"{lr:g}"][name] = r
    os.makedirs(args.out, exist_ok=True)
    setting = (f"hidden {args.hidden}, layers {args.layers}, seq {args.seq}, batch {args.batch}, steps {args.steps}, "
               f"AdamW (betas 0.9/0.95) peak lr {', '.join(f'{lr:g}' for lr in lrs)}, 10% linear warm-up then "
               f"cosine to {args.min_lr_ratio:g} x peak, wd 0.1, clip 1.0, seed {args.seed}; offline generated "
               "text (word Markov chain + additions), character tokenizer; FP32 compute "
               f"({device.type}), only the decoder linear weights FP8.")
    with open(os.path.join(args.out, "eco_pretrain.json"), "w") as f:
        json.dump({"setting": setting, "args": vars(args), "results": res}, f, indent=1)
    head = "| configuration | " + " | ".join(f"lr {k}: val loss | vs BF16 | FP8 moved, last 10%" for k in res)
    lines = [f"# ECO reproduction ({'quick, CPU' if args.quick else device.type}): small Llama from scratch, FP8 "
             "E4M3 row-wise decoder linears", "", setting, "", head + " |",
             "|---|" + "---|---|---|" * len(res)]
    for name in names:
        cells = []
        for k, by in res.items():
            v, ref = by[name]["curve"][-1][1], by.get("BF16 w/ MW", {}).get("curve", [[0, float("nan")]])[-1][1]
            rel = "" if math.isnan(ref) else f"{100 * (v - ref) / ref:+.1f}%"
            cells += [f"{v:.4f}", rel, f"{100 * by[name]['moved_last_10pct']:.1f}%"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "FP8 moved: share of decoder-linear weights whose FP8 code changed over the last 10% of the steps "
              "(row scales aside; runs with master weights: codes of their RTN quantization; BF16 w/ MW: "
              "hypothetical, its weights are never quantized)."]
    with open(os.path.join(args.out, "eco_pretrain.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(res), figsize=(6.5 * len(res), 4.5), squeeze=False)
    for ax, (k, by) in zip(axes[0], res.items()):
        for name, r in by.items():
            c = r["curve"]
            ax.plot([s for s, _ in c], [v for _, v in c], label=name)
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss")
        ax.set_title(f"peak lr {k}, cosine to {args.min_lr_ratio:g}x")
        finals = [r["curve"][-1][1] for r in by.values()]
        lo, hi = min(finals), max(finals)
        ax.set_ylim(lo - 0.1 * (hi - lo + 0.05), max(hi + 0.6 * (hi - lo + 0.05), lo + 0.3))
        ax.legend(fontsize=8)
    fig.suptitle("ECO: FP8 weights without master weights")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "eco_pretrain.png"), dpi=110)


if __name__ == "__main__":
    main()
