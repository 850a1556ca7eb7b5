"""QFT in miniature: full-parameter fine-tuning of a small Llama with INT8 weights (dense + 1% sparse outliers),
INT8 weight gradients and INT8-momentum Lion (QLion), against a bf16 AdamW baseline, offline on CPU.

1. A base model (Llama from LlamaConfig, character tokenizer) is pre-trained briefly in fp32 on generated text
   (word chains + additions), so fine-tuning starts from a trained model, as in the paper.
2. It is fine-tuned on a different generated task (key: value facts and digit sorting) for the same steps and
   the same batches by three arms, all through transformers.Trainer:
     bf16 AdamW      the model in bf16, torch.optim.AdamW (its moments in bf16, like the weights)
     FP32 Lion       float reference of the optimizer (QLion with fp32 momentum on plain fp32 parameters)
     QFT             QFTConfig(weight_format="int8_dense_sparse", gradient_bits=8), rest of the model bf16, QLion
                     (INT8 momentum, stochastic rounding of the weight requantization)
3. Reports the final train/eval losses and the measured static memory (weights + gradients + optimizer state,
   bytes per parameter, from the tensors actually held after a backward), for the decoder linears and the model.

Writes examples/results/qft_finetune.{json,md,png}.   python examples/qft_finetune.py   (~8 min on 2 CPU cores)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

import torch
from tqdm import tqdm
from transformers import (AutoModelForCausalLM, LlamaConfig, PrinterCallback, Trainer, TrainerCallback,
                          TrainingArguments, get_cosine_schedule_with_warmup)

from hfq.qft import QFTConfig, QLion, state_bytes
from hfq.tiny import char_tokenizer
from tiny_args import add_model_args

WORDS = "sun moon star rain wind snow hill lake road town king queen horse apple bread stone gold iron".split()
VERBS = "sees takes finds keeps gives likes moves holds".split()
COLORS = "red blue green black white gray pink brown".split()
ARMS = ("bf16 AdamW", "FP32 Lion", "QFT (INT8 W+G+M, QLion)")


def pretrain_text(n: int, rng: random.Random) -> str:
    """Base-model corpus: short subject-verb-object chains and additions."""
    lines = []
    for i in range(n):
        if i % 2:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            lines.append(f"{a}+{b}={a + b}")
        else:
            lines.append(" ".join(f"{rng.choice(WORDS)} {rng.choice(VERBS)} {rng.choice(WORDS)}"
                                  for _ in range(rng.randint(1, 3))) + ".")
    return "\n".join(lines)


def finetune_text(n: int, rng: random.Random, facts: dict) -> str:
    """Fine-tuning corpus: fixed key: value facts to memorise, and sorting short digit lists."""
    lines = []
    for i in range(n):
        if i % 2:
            k = rng.choice(list(facts))
            lines.append(f"{k}: {facts[k]}")
        else:
            d = [rng.randint(0, 9) for _ in range(rng.randint(3, 6))]
            lines.append("sort " + " ".join(map(str, d)) + " = " + " ".join(map(str, sorted(d))))
    return "\n".join(lines)


def blocks(tok, text: str, seq: int) -> list[dict]:
    ids = torch.tensor(tok(text)["input_ids"])
    n = ids.numel() // seq
    return [{"input_ids": ids[i * seq:(i + 1) * seq], "labels": ids[i * seq:(i + 1) * seq]} for i in range(n)]


class Bar(TrainerCallback):
    """A tqdm bar per run, with the last logged loss; replaces Trainer's per-step log printing."""

    def __init__(self, desc):
        self.desc, self.bar, self.losses = desc, None, []

    def on_train_begin(self, args, state, control, **kw):
        self.bar = tqdm(total=state.max_steps, desc=self.desc, leave=True)

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])
            self.bar.set_postfix(loss=f"{logs['loss']:.3f}")

    def on_step_end(self, args, state, control, **kw):
        self.bar.update(1)

    def on_train_end(self, args, state, control, **kw):
        self.bar.close()


def train(model, opt, train_ds, eval_ds, steps, batch, out, desc, max_grad_norm, warmup):
    sched = get_cosine_schedule_with_warmup(opt, warmup, steps)
    args = TrainingArguments(out, max_steps=steps, per_device_train_batch_size=batch, per_device_eval_batch_size=32,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                             disable_tqdm=True, max_grad_norm=max_grad_norm, dataloader_drop_last=True)
    bar = Bar(desc)
    tr = Trainer(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds, optimizers=(opt, sched),
                 callbacks=[bar])
    tr.remove_callback(PrinterCallback)
    t0 = time.time()
    tr.train()
    secs = time.time() - t0
    return tr, bar.losses, tr.evaluate()["eval_loss"], secs


def is_decoder_linear(name, p):
    return ".layers." in name and name.endswith("proj.weight")


def measure(model, opt, batch) -> dict:
    """Static bytes after one more backward (gradients alive) on top of the trained optimizer state."""
    model.train()
    x = torch.stack([b["input_ids"] for b in batch])
    model(input_ids=x, labels=x).loss.backward()
    out = {"decoder_linears": state_bytes(model, opt, select=is_decoder_linear), "model": state_bytes(model, opt)}
    opt.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    return out


def main():
    ap = add_model_args(argparse.ArgumentParser(), hidden=128, layers=4, seq=64, batch=16)
    ap.add_argument("--pretrain-steps", type=int, default=150)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--lr-adamw", type=float, default=1e-3)
    ap.add_argument("--lr-lion", type=float, default=2e-4)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    tok = char_tokenizer()
    facts = {f"{w}{i}": rng.choice(COLORS) for i, w in enumerate(rng.sample(WORDS, 12))}
    pre = blocks(tok, pretrain_text(6000, rng), args.seq)
    ft_train = blocks(tok, finetune_text(5000, rng, facts), args.seq)
    ft_eval = blocks(tok, finetune_text(600, rng, facts), args.seq)

    work = tempfile.mkdtemp(prefix="qft_finetune_")
    base = os.path.join(work, "base")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=args.seq, tie_word_embeddings=False, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    _, pre_losses, pre_eval, _ = train(model, opt, pre, ft_eval, args.pretrain_steps, args.batch,
                                       os.path.join(work, "pre"), "pre-train (fp32 AdamW)", 1.0,
                                       args.pretrain_steps // 10)
    model.save_pretrained(base)
    del model, opt

    results = {}
    warm = args.steps // 10
    for arm in ARMS:
        torch.manual_seed(0)
        if arm == "bf16 AdamW":
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr_adamw, weight_decay=args.weight_decay)
            clip = 1.0
        elif arm == "FP32 Lion":
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            opt = QLion(model.parameters(), lr=args.lr_lion, weight_decay=args.weight_decay, momentum_bits=None)
            clip = 0.0  # off for both Lion arms, so FP32 Lion and QFT compare like for like
        else:
            qcfg = QFTConfig(weight_format="int8_dense_sparse", outlier_fraction=0.01, gradient_bits=8)
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16, quantization_config=qcfg)
            opt = QLion(model.parameters(), lr=args.lr_lion, weight_decay=args.weight_decay, rounding="sr")
            clip = 0.0
        tr, losses, ev, secs = train(model, opt, ft_train, ft_eval, args.steps, args.batch,
                                     os.path.join(work, "ft"), arm, clip, warm)
        mem = measure(model, opt, ft_train[:args.batch])
        results[arm] = {"train_loss": losses, "final_train_loss_avg10": sum(losses[-10:]) / 10, "eval_loss": ev,
                        "seconds": secs, "memory": mem}
        del tr, model, opt

    os.makedirs(args.out, exist_ok=True)
    n_params = results[ARMS[0]]["memory"]["model"]["params"]
    with open(os.path.join(args.out, "qft_finetune.json"), "w") as f:
        json.dump({"args": vars(args), "params": n_params, "pretrain_eval_loss_on_ft_task": pre_eval,
                   "pretrain_losses": pre_losses, "results": results}, f, indent=1)
    rows = ["| arm | final train loss (avg last 10) | eval loss | decoder linears: weights + grads + optimizer "
            "= bytes/param | whole model bytes/param | time (s) |", "|---|---|---|---|---|---|"]
    for arm, r in results.items():
        d, m = r["memory"]["decoder_linears"], r["memory"]["model"]
        per = lambda k: d[k] / d["params"]  # noqa: E731
        rows.append(f"| {arm} | {r['final_train_loss_avg10']:.3f} | {r['eval_loss']:.3f} | {per('weights'):.2f} + "
                    f"{per('grads'):.2f} + {per('optimizer'):.2f} = {d['bytes_per_param']:.2f} | "
                    f"{m['bytes_per_param']:.2f} | {r['seconds']:.0f} |")
    note = (f"Llama {args.layers} layers, hidden {args.hidden}, {n_params} parameters "
            f"({results[ARMS[0]]['memory']['decoder_linears']['params']} in decoder linears), char tokenizer, "
            f"seq {args.seq}, batch {args.batch}; {args.pretrain_steps} fp32 AdamW pre-training steps (eval loss on the "
            f"fine-tuning task before fine-tuning: {pre_eval:.3f}), then {args.steps} fine-tuning steps per arm, "
            f"cosine schedule with {warm} warm-up steps; AdamW lr {args.lr_adamw}, Lion lr {args.lr_lion}, weight "
            f"decay {args.weight_decay}. Bytes measured after a backward (gradients alive) with the optimizer state of "
            "the run; the step counters of the optimizers are included. QFT's embeddings, norms and lm_head are bf16 "
            "with float .grad (not part of the decoder-linear columns) and INT8 Lion momentum.")
    with open(os.path.join(args.out, "qft_finetune.md"), "w") as f:
        f.write("# QFT fine-tuning in miniature (CPU)\n\n" + note + "\n\n" + "\n".join(rows) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, r in results.items():
        ax.plot(range(1, len(r["train_loss"]) + 1), r["train_loss"], label=f"{arm} (eval {r['eval_loss']:.3f})",
                lw=1)
    ax.set_xlabel("fine-tuning step")
    ax.set_ylabel("train loss")
    ax.set_title("QFT vs bf16 AdamW: tiny Llama, generated text (CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "qft_finetune.png"), dpi=110)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
