"""Pre-train a small Llama from scratch with full precision, STE and QuEST (W4A4, W1A1, and without HT).

Every run sees the same tokens in the same order (one generated corpus, one seed). The corpus is
generated offline: a small probabilistic grammar (agreement, nesting) mixed with arithmetic facts,
written with the character tokenizer of hfq.tiny. Writes examples/results/quest_pretrain[_quick].{md,json,png}.

  python examples/quest_pretrain.py --quick          # CPU, a few minutes
  python examples/quest_pretrain.py --device cuda    # larger model, bf16 autocast
Expected ordering (paper Tab. 1): QuEST < STE at each bit-width; W1A1 QuEST trains stably.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import time

import torch

from hfq.quest import QuESTConfig, quantize_model
from hfq.tiny import CHARS, SPECIAL, tiny_config

NOUNS = ["cat", "dog", "bird", "fox", "child", "robot", "teacher", "farmer", "river", "king"]
VERBS_S = ["sees", "likes", "chases", "helps", "finds", "follows"]
VERBS_P = ["see", "like", "chase", "help", "find", "follow"]
ADJ = ["small", "old", "red", "quiet", "happy", "brave", "lazy"]
PLACES = ["in the park", "near the house", "by the sea", "under the bridge", "on the hill"]


def _np(rng):
    plural = rng.random() < 0.4
    n = rng.choice(NOUNS)
    adj = f"{rng.choice(ADJ)} " if rng.random() < 0.5 else ""
    return f"the {adj}{n}{'s' if plural else ''}", plural


def sentence(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.3:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice("+-")
        return f"{a}{op}{b}={a + b if op == '+' else a - b}."
    subj, plural = _np(rng)
    i = rng.randrange(len(VERBS_S))
    verb = VERBS_P[i] if plural else VERBS_S[i]
    obj, _ = _np(rng)
    s = f"{subj} {verb} {obj}"
    if rng.random() < 0.4:
        s += f" {rng.choice(PLACES)}"
    if rng.random() < 0.25:  # a relative clause: agreement across a gap
        s2, pl2 = _np(rng)
        j = rng.randrange(len(VERBS_S))
        s = f"{subj} that {s2} {VERBS_P[j] if pl2 else VERBS_S[j]} {verb} {obj}"
    return s + "."


def make_corpus(n_tokens: int, seed: int) -> torch.Tensor:
    rng = random.Random(seed)
    vocab = {c: i + len(SPECIAL) for i, c in enumerate(CHARS)}
    out: list[int] = []
    while len(out) < n_tokens:
        out.extend(vocab[c] for c in sentence(rng) + " ")
    return torch.tensor(out[:n_tokens], dtype=torch.long)


VARIANTS = {
    "dense": None,  # unquantized baseline: bf16 autocast on CUDA, fp32 on the CPU (see "precision")
    "STE W4A4": dict(weight_bits=4, activation_bits=4, estimator="ste", hadamard=False),
    "QuEST W4A4": dict(weight_bits=4, activation_bits=4),
    "QuEST W4A4 no HT": dict(weight_bits=4, activation_bits=4, hadamard=False),
    "STE W1A1": dict(weight_bits=1, activation_bits=1, estimator="ste", hadamard=False),
    "QuEST W1A1": dict(weight_bits=1, activation_bits=1),
    "QuEST W1A1 no HT": dict(weight_bits=1, activation_bits=1, hadamard=False),
}


def train_one(name, qkw, args, train, val, device):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    cfg = tiny_config("llama", hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.heads,
                      intermediate=args.intermediate, max_pos=args.seq)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(device)
    if qkw is not None:
        quantize_model(model, QuESTConfig(**qkw))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    warm = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warm, 0.5 * (1 + math.cos(
        math.pi * min(1.0, max(0, s - warm) / max(1, args.steps - warm))))))
    amp = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
    n_seq = train.numel() // args.seq
    seqs = train[: n_seq * args.seq].view(n_seq, args.seq)
    g = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(n_seq, generator=g)
    curve, t0 = [], time.time()

    def evaluate():
        model.eval()
        with torch.no_grad(), amp:
            losses = [model(v.to(device), labels=v.to(device)).loss.float().item() for v in val.split(args.batch)]
        model.train()
        return sum(losses) / len(losses)

    try:
        from tqdm import tqdm
        it = tqdm(range(args.steps), desc=name, leave=False)
    except ImportError:  # pragma: no cover
        it = range(args.steps)
    model.train()
    for step in it:
        idx = order[(step * args.batch + torch.arange(args.batch)) % n_seq]
        batch = seqs[idx].to(device)
        with amp:
            loss = model(batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curve.append((step + 1, loss.item(), evaluate()))
    return {"name": name, "config": qkw, "final_val_loss": curve[-1][2], "curve": curve,
            "seconds": round(time.time() - t0, 1), "finite": all(math.isfinite(c[2]) for c in curve)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model and few steps (CPU, minutes)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    size = dict(steps=300, hidden=64, layers=2, intermediate=128, seq=64, batch=16, lr=3e-3, eval_every=25) \
        if args.quick else dict(steps=1500, hidden=256, layers=4, intermediate=768, seq=256, batch=32, lr=1.5e-3,
                                eval_every=100)
    for k, v in size.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1))) if args.device == "cpu" else None
    n_train = args.steps * args.batch * args.seq
    corpus = make_corpus(n_train + 64 * args.seq, seed=1234)
    train, val = corpus[:n_train], corpus[n_train:].view(-1, args.seq)[:64]
    results = []
    for name in args.variants.split(","):
        r = train_one(name, VARIANTS[name], args, train, val, args.device)
        print(f"{name:18s} final val loss {r['final_val_loss']:.4f}  ({r['seconds']} s)", flush=True)
        results.append(r)
        write_results(results, args, n_train)  # after every run, so a cut-off run keeps what it has


def write_results(results, args, n_train):
    tag = "quest_pretrain_quick" if args.quick else "quest_pretrain"
    os.makedirs(args.out, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "date": time.strftime("%Y-%m-%d"), "tokens_per_run": n_train,
            "model": {k: getattr(args, k) for k in ("hidden", "layers", "heads", "intermediate", "seq")},
            "optim": {"lr": args.lr, "batch": args.batch, "steps": args.steps, "adamw_betas": [0.9, 0.95],
                      "weight_decay": 0.1, "clip": 1.0, "schedule": "cosine, 10% warmup"},
            "precision": "bf16 autocast, fp32 master" if args.device == "cuda" else "fp32 (CPU) baseline"}
    with open(os.path.join(args.out, tag + ".json"), "w") as f:
        json.dump({**meta, "rows": results}, f, indent=1)
    base = {r["name"]: r["final_val_loss"] for r in results}
    lines = [f"# QuEST pre-training reproduction ({'quick, ' if args.quick else ''}{meta['device']})", "",
             f"date {meta['date']}; Llama hidden {args.hidden}, {args.layers} layers, seq {args.seq}; "
             f"{n_train} tokens per run (same tokens, same order); {meta['precision']}.", "",
             "| run | final val loss | vs dense | time (s) |", "|---|---|---|---|"]
    for r in results:
        d = r["final_val_loss"] - base.get("dense", float("nan"))
        lines.append(f"| {r['name']} | {r['final_val_loss']:.4f} | {d:+.4f} | {r['seconds']} |")
    checks = []
    for b in ("W4A4", "W1A1"):
        if f"QuEST {b}" in base and f"STE {b}" in base:
            checks.append(f"- QuEST {b} < STE {b}: {base[f'QuEST {b}'] < base[f'STE {b}']}")
    lines += ["", *checks]
    with open(os.path.join(args.out, tag + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if len(results) == len(args.variants.split(",")):
        print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
        for r in results:
            s = [c[0] for c in r["curve"]]
            ax[0].plot(s, [c[1] for c in r["curve"]], label=r["name"])
            ax[1].plot(s, [c[2] for c in r["curve"]], label=r["name"])
        ax[0].set_title("train loss")
        ax[1].set_title("validation loss")
        for a in ax:
            a.set_xlabel("step")
            a.set_yscale("log")
            a.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, tag + ".png"), dpi=110)
        plt.close(fig)
    except ImportError:  # pragma: no cover
        pass


if __name__ == "__main__":
    main()
