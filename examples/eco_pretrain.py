"""Reproduce ECO's Table 1 in miniature: a small Llama trained from scratch on offline generated text with
FP8 (E4M3, row-wise) decoder-linear weights, six configurations:

  BF16 w/ MW            plain weights, AdamW (fp32 master weights; bf16 autocast on GPU, fp32 on CPU)
  FP8 w/ MW + RTN       fp32 master weights, forward on RTN-quantized FP8 weights (straight-through)
  FP8 w/o MW + RTN      FP8 QParams updated directly, no error feedback (naive)
  FP8 w/o MW + SR       same with stochastic rounding (naive)
  FP8 w/o MW ECO + RTN  ECOAdamW, memory-free error injection, RTN
  FP8 w/o MW ECO + SR   ECOAdamW, memory-free error injection, SR

Writes examples/results/eco_pretrain.md (final validation loss table) and eco_pretrain.png (curves).
  python examples/eco_pretrain.py --quick      # CPU, a few minutes
  python examples/eco_pretrain.py              # bigger (GPU)
"""
from __future__ import annotations

import argparse
import math
import os
import random

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from hfq.eco import ECOAdamW
from hfq.formats.fp8 import dequantize_fp8_row, quantize_fp8_row
from hfq.qft import QFTConfig, quantize_model_
from hfq.tiny import char_tokenizer, tiny_config

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


def build(cfg_name, args, device):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    cfg = tiny_config("llama", hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.heads,
                      intermediate=args.hidden * 4 if args.hidden >= 256 else args.hidden * 2, max_pos=args.seq)
    model = AutoModelForCausalLM.from_config(cfg).to(device)
    decay = dict(weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    if cfg_name == "BF16 w/ MW":
        return model, torch.optim.AdamW(model.parameters(), lr=args.lr, **decay)
    if cfg_name == "FP8 w/ MW + RTN":
        for name, mod in list(model.named_modules()):
            if type(mod) is nn.Linear and not name.endswith("lm_head"):
                mod.__class__ = FakeQuantLinear
        return model, torch.optim.AdamW(model.parameters(), lr=args.lr, **decay)
    quantize_model_(model, QFTConfig(weight_format="fp8_e4m3_row"))
    rule = "memory_free" if "ECO" in cfg_name else "naive"
    rounding = "sr" if cfg_name.endswith("SR") else "rtn"
    return model, ECOAdamW(model.parameters(), lr=args.lr, rule=rule, rounding=rounding, seed=args.seed, **decay)


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


def train_one(cfg_name, args, train_ids, val, device):
    model, opt = build(cfg_name, args, device)
    warm = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min((t + 1) / warm, 0.1 + 0.9 * 0.5 * (
        1 + math.cos(math.pi * min(1.0, max(0, t - warm) / max(1, args.steps - warm))))))
    gen = torch.Generator().manual_seed(args.seed)
    it = batches(train_ids, args.seq, args.batch, gen)
    curve = []
    model.train()
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu",
                                                                                                   enabled=False)
    for step in tqdm(range(args.steps), desc=cfg_name, leave=False):
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
    return curve


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="CPU-sized run (a few minutes)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="examples/results")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()
    if args.quick:
        args.steps, args.hidden, args.layers, args.heads, args.seq, args.batch, args.eval_every = \
            300, 128, 2, 4, 64, 16, 25
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    tok = char_tokenizer()
    text = make_corpus(6000 if args.quick else 60000, args.seed)
    ids = torch.tensor(tok(text)["input_ids"], dtype=torch.long)
    split = int(0.9 * ids.numel())
    train_ids, val_ids = ids[:split], ids[split:]
    nv = (val_ids.numel() // (args.seq + 1))
    val = val_ids[:nv * (args.seq + 1)].view(nv, args.seq + 1)[:64]
    curves = {}
    for name in args.configs.split(","):
        curves[name] = train_one(name, args, train_ids, val, device)
        print(f"{name}: final val loss {curves[name][-1][1]:.4f}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    ref = curves.get("BF16 w/ MW", [[0, float("nan")]])[-1][1]
    lines = [f"# ECO reproduction ({'quick, CPU' if args.quick else device.type}): small Llama from scratch, FP8 "
             "E4M3 row-wise decoder linears", "",
             f"hidden {args.hidden}, layers {args.layers}, seq {args.seq}, batch {args.batch}, steps {args.steps}, "
             f"AdamW lr {args.lr} (warm-up + cosine to 10%), wd 0.1, clip 1.0, seed {args.seed}; offline generated "
             "text (word Markov chain + additions), character tokenizer.", "",
             "| configuration | final val loss | vs BF16 w/ MW |", "|---|---|---|"]
    for name, c in curves.items():
        v = c[-1][1]
        rel = "" if math.isnan(ref) else f"{100 * (v - ref) / ref:+.1f}%"
        lines.append(f"| {name} | {v:.4f} | {rel} |")
    with open(os.path.join(args.out, "eco_pretrain.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, c in curves.items():
        ax.plot([s for s, _ in c], [v for _, v in c], label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title("ECO: FP8 weights without master weights")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "eco_pretrain.png"), dpi=110)


if __name__ == "__main__":
    main()
