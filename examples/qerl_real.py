"""QeRL's learning claims on a real pretrained model: GRPO on SmolLM2-135M-Instruct with four arms.

Arms (LoRA r=32 on every decoder linear, same prompts, same seeds):

  qerl    NVFP4 base + LoRA + AQN (exponential 1e-2 -> 5e-4, the paper's preset schedule)
  nvfp4   NVFP4 base + LoRA, no added noise
  bf16    16-bit base + LoRA (fp32 on a CPU-only machine: the full-precision reference)
  qlora   bitsandbytes NF4 base + LoRA (skipped, with the reason in the table, where bitsandbytes cannot run)

Task: grade-school arithmetic word problems with exact integer answers, generated offline (`make_task`), asked
through the model's chat template; reward 1 when the last integer of the completion equals the answer. A held-out
split (never trained on) is answered greedily before and after training. Step 0 also measures the sampling entropy
of the base (adapters off) on the same prompts: NVFP4 vs 16-bit, the paper's Fig. 5 measurement.

Each run is this script with `--one ARM` in a subprocess (runs go in parallel, one thread each). Writes
`<out>/qerl_real.{md,json,png}`:

    python examples/qerl_real.py                       # 3 seeds x 4 arms x lr {1e-5, 1e-4}, 30 steps (CPU, hours)
    python examples/qerl_real.py --quick               # 1 seed, 3 steps, one lr: a smoke run
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("qerl", "nvfp4", "bf16", "qlora")
COLORS = {"qerl": "tab:red", "nvfp4": "tab:orange", "bf16": "tab:blue", "qlora": "tab:green"}
NAMES = ("Tom", "Ann", "Raj", "Eve", "Sam", "Mia", "Leo", "Zoe", "Ivan", "Lena")
ITEMS = ("apples", "pens", "cups", "books", "coins", "eggs", "cards", "stamps", "shells", "marbles")
INSTRUCTION = "Answer with the final number."


# --------------------------------------------------------------------------------------------------- task
def make_problem(rng: random.Random) -> dict:
    """One word problem with an exact integer answer (add, subtract, multiply, or a two-step mix)."""
    n, it = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.choice(("add", "sub", "mul", "two_step"))
    if kind == "add":
        a, b = rng.randint(10, 60), rng.randint(5, 40)
        q, ans = f"{n} has {a} {it}. {n} finds {b} more. How many {it} does {n} have now?", a + b
    elif kind == "sub":
        a = rng.randint(20, 90)
        b = rng.randint(3, a - 5)
        q, ans = f"{n} has {a} {it} and gives {b} of them away. How many {it} are left?", a - b
    elif kind == "mul":
        a, b = rng.randint(2, 9), rng.randint(3, 12)
        q, ans = f"{n} buys {a} boxes with {b} {it} in each box. How many {it} does {n} buy?", a * b
    else:
        a, b, c = rng.randint(5, 30), rng.randint(2, 6), rng.randint(2, 9)
        q = f"{n} has {a} {it} and buys {b} packs of {c} {it}. How many {it} does {n} have now?"
        ans = a + b * c
    return {"question": q, "answer": str(ans), "kind": kind}


def make_task(n_train: int, n_eval: int, seed: int = 1234) -> tuple[list[dict], list[dict]]:
    """(train, held-out) problems; the held-out questions never appear in train."""
    rng = random.Random(seed)
    seen, rows = set(), []
    while len(rows) < n_train + n_eval:
        p = make_problem(rng)
        if p["question"] not in seen:
            seen.add(p["question"])
            rows.append(p)
    return rows[n_eval:], rows[:n_eval]


_INT_RE = re.compile(r"-?\d+")


def last_int(text: str) -> str | None:
    """The last integer in a completion (commas inside numbers dropped), or None."""
    m = _INT_RE.findall(text.replace(",", ""))
    return m[-1].lstrip("+") if m else None


def answer_reward(completions, answer, **kwargs) -> list[float]:
    """TRL reward: 1.0 where the completion's last integer equals the gold answer."""
    from hfq.qerl.rewards import completion_text

    return [float(last_int(completion_text(c)) == str(a)) for c, a in zip(completions, answer)]


def messages(q: str) -> list[dict]:
    return [{"role": "user", "content": f"{q} {INSTRUCTION}"}]


# --------------------------------------------------------------------------------------------------- one run
def load_policy(arm: str, path: str, seed: int):
    """The arm's base model with LoRA r=32 on every decoder linear, through plain `peft.get_peft_model`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import hfq  # noqa: F401  (NVFP4 quantizer + PEFT dispatch for NVFP4 layers)
    from hfq.nvfp4 import NVFP4Config

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    kw = {"dtype": dtype}
    if arm in ("qerl", "nvfp4"):
        kw["quantization_config"] = NVFP4Config()
    elif arm == "qlora":
        from transformers import BitsAndBytesConfig

        kw["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                       bnb_4bit_compute_dtype=dtype)
    if cuda:
        kw["device_map"] = {"": 0}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(path, **kw)
    lcfg = LoraConfig(r=32, lora_alpha=64, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules="all-linear")
    return get_peft_model(model, lcfg)


def greedy_accuracy(model, tok, rows, max_new_tokens: int, batch: int = 16) -> float:
    """Held-out accuracy: greedy answers, last integer vs gold."""
    import torch

    model.eval()
    right = 0
    dev = next(model.parameters()).device
    for i in range(0, len(rows), batch):
        chunk = rows[i:i + batch]
        texts = [tok.apply_chat_template(messages(r["question"]), tokenize=False, add_generation_prompt=True)
                 for r in chunk]
        enc = tok(texts, return_tensors="pt", padding=True, padding_side="left").to(dev)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        for r, seq in zip(chunk, out[:, enc.input_ids.shape[1]:]):
            right += last_int(tok.decode(seq, skip_special_tokens=True)) == r["answer"]
    model.train()
    return right / len(rows)


def run_one(args) -> int:
    import torch
    from datasets import Dataset

    from hfq.models import smollm2_135m_instruct
    from hfq.qerl.entropy import sampling_entropy
    from hfq.qerl import QeRLConfig, QeRLGRPOTrainer
    from transformers import AutoTokenizer

    torch.manual_seed(args.seed)
    out = Path(args.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.one == "qlora":
        try:
            import bitsandbytes  # noqa: F401
        except Exception as e:  # noqa: BLE001
            (out / "metrics.json").write_text(json.dumps({"skipped": f"bitsandbytes unavailable: {e}"}))
            return 0
    path = str(smollm2_135m_instruct())
    tok = AutoTokenizer.from_pretrained(path)
    tok.pad_token = tok.pad_token or tok.eos_token
    train, held = make_task(args.n_train, args.n_eval)
    t0 = time.time()
    model = load_policy(args.one, path, args.seed)
    with model.disable_adapter():  # step 0: the base's sampling entropy on held-out prompts
        prompts = [tok.apply_chat_template(messages(r["question"]), tokenize=False, add_generation_prompt=True)
                   for r in held[:args.entropy_prompts]]
        ent0 = sampling_entropy(model.eval(), tok, prompts, max_new_tokens=args.max_completion)
    acc0 = greedy_accuracy(model, tok, held, args.max_completion)
    ds = Dataset.from_list([{"prompt": messages(r["question"]), "answer": r["answer"]} for r in train])
    cfg = QeRLConfig(
        output_dir=str(out), seed=args.seed, learning_rate=args.lr, max_steps=args.steps,
        num_generations=args.num_generations, per_device_train_batch_size=args.num_generations * args.prompts,
        max_completion_length=args.max_completion, temperature=1.0, beta=0.0, epsilon=0.2, epsilon_high=0.28,
        loss_type=args.loss_type, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available(), gradient_checkpointing=False,
        dataloader_num_workers=0, aqn=args.one == "qerl", aqn_sigma_start=1e-2, aqn_sigma_end=5e-4,
        aqn_num_stages=args.aqn_stages, aqn_schedule="exponential")
    trainer = QeRLGRPOTrainer(model=model, reward_funcs=[answer_reward], args=cfg, train_dataset=ds,
                              processing_class=tok)
    trainer.train()
    hist = [h for h in trainer.state.log_history if "reward" in h]
    acc1 = greedy_accuracy(trainer.model, tok, held, args.max_completion)
    res = {"arm": args.one, "seed": args.seed, "lr": args.lr, "acc_before": acc0, "acc_after": acc1,
           "entropy_base": ent0, "seconds": round(time.time() - t0, 1), "steps": len(hist),
           "reward": [h["reward"] for h in hist], "entropy": [h.get("entropy", math.nan) for h in hist],
           "sigma": [h.get("aqn/sigma", 0.0) for h in hist]}
    (out / "metrics.json").write_text(json.dumps(res, indent=1))
    print(f"{args.one} seed {args.seed} lr {args.lr}: held-out {acc0:.3f} -> {acc1:.3f}, "
          f"base entropy {ent0:.3f}, {res['seconds']} s", flush=True)
    return 0


# --------------------------------------------------------------------------------------------------- driver
def spawn(arm, seed, lr, args, threads) -> dict:
    d = Path(args.work_dir) / f"{arm}_lr{lr:g}_seed{seed}"
    metrics = d / "metrics.json"
    if not (args.resume and metrics.exists()):
        d.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--one", arm, "--seed", str(seed), "--lr", str(lr),
               "--run-dir", str(d), "--steps", str(args.steps), "--prompts", str(args.prompts),
               "--num-generations", str(args.num_generations), "--max-completion", str(args.max_completion),
               "--n-eval", str(args.n_eval), "--loss-type", args.loss_type, "--aqn-stages", str(args.aqn_stages)]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false", TQDM_DISABLE="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        with open(d / "log.txt", "w") as log:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            raise RuntimeError(f"{arm} lr {lr} seed {seed}: exit {rc}, see {d / 'log.txt'}")
    return json.loads(metrics.read_text()) | {"arm": arm, "seed": seed, "lr": lr}


def ms(xs):
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return "-"
    return f"{statistics.fmean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def window(r, key, first: bool, n: int = 5):
    ys = r[key][:n] if first else r[key][-n:]
    return statistics.fmean(ys) if ys else math.nan


def plot(runs, lrs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(3, len(lrs), figsize=(6 * len(lrs), 9), squeeze=False)
    for j, lr in enumerate(lrs):
        for arm in ARMS:
            rs = [r for r in runs if r["arm"] == arm and r["lr"] == lr and "reward" in r]
            if not rs:
                continue
            T = min(len(r["reward"]) for r in rs)
            for i, key in enumerate(("reward", "entropy", "sigma")):
                for r in rs:
                    ax[i][j].plot(range(1, T + 1), r[key][:T], color=COLORS[arm], alpha=0.2, lw=0.8)
                mean = [statistics.fmean(r[key][t] for r in rs) for t in range(T)]
                ax[i][j].plot(range(1, T + 1), mean, color=COLORS[arm], lw=2, label=f"{arm} ({len(rs)} seeds)")
        for i, name in enumerate(("reward (train batch)", "policy entropy (nats)", "AQN sigma")):
            ax[i][j].set_title(f"{name}, lr {lr:g}")
            ax[i][j].set_xlabel("GRPO step")
            ax[i][j].grid(alpha=0.3)
        ax[0][j].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_md(path, runs, args, skipped, cmd):
    L = [f"# QeRL on SmolLM2-135M-Instruct: {len(args.seeds)} seed(s) x {args.steps} GRPO steps", "",
         f"Command: `{cmd}`. Device: {args.device_note}. Task: generated arithmetic word problems (add, subtract, "
         f"multiply, two-step; exact integer answers), {args.n_eval} held-out questions answered greedily before and "
         f"after training. GRPO ({args.loss_type} loss), {args.prompts} prompts x {args.num_generations} samples per "
         f"step, completions <= {args.max_completion} tokens, T=1, no KL, clip 0.2/0.28, LoRA r=32 on all linears; "
         f"AQN (qerl arm) exponential 1e-2 -> 5e-4, K={args.aqn_stages}. Mean ± std over seeds {args.seeds}.", "",
         "| arm | lr | held-out acc before | held-out acc after | reward, first 5 steps | reward, last 5 steps | "
         "policy entropy, mean | base sampling entropy (step 0) | s / run |",
         "|---|---|---|---|---|---|---|---|---|"]
    for lr in args.lrs:
        for arm in args.arms:
            rs = [r for r in runs if r["arm"] == arm and r["lr"] == lr and "reward" in r]
            if not rs:
                continue
            L.append(f"| {arm} | {lr:g} | {ms([r['acc_before'] for r in rs])} | {ms([r['acc_after'] for r in rs])} | "
                     f"{ms([window(r, 'reward', True) for r in rs])} | {ms([window(r, 'reward', False) for r in rs])} | "
                     f"{ms([statistics.fmean(r['entropy']) for r in rs])} | {ms([r['entropy_base'] for r in rs])} | "
                     f"{ms([r['seconds'] for r in rs])} |")
    if skipped:
        L += ["", "Not run: " + "; ".join(sorted(set(skipped)))]
    note = "(written by whoever ran it: the table above is regenerated, this section is kept)"
    if Path(path).exists() and "## What this shows" in Path(path).read_text():
        note = Path(path).read_text().split("## What this shows", 1)[1].strip()
    L += ["", f"Curves: `{Path(path).with_suffix('.png').name}` (thin: seeds, thick: mean).", "",
          "## What this shows", "", note, ""]
    Path(path).write_text("\n".join(L))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-5, 1e-4], help="paper lr and 10x")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion", type=int, default=24)
    p.add_argument("--n-train", type=int, default=2000)
    p.add_argument("--n-eval", type=int, default=64)
    p.add_argument("--entropy-prompts", type=int, default=32)
    p.add_argument("--aqn-stages", type=int, default=4)
    p.add_argument("--loss-type", default="grpo", choices=("grpo", "dapo", "dr_grpo", "bnpo"))
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--quick", action="store_true",
                   help="smoke-run defaults (1 seed, 3 steps, lr 1e-4, 16 eval questions) for the options not given")
    p.add_argument("--resume", action="store_true", help="reuse runs whose metrics.json exists")
    p.add_argument("--work-dir", default="/tmp/hfq_qerl_real")
    p.add_argument("--out", default=str(ROOT / "examples" / "results"))
    p.add_argument("--one", choices=ARMS, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--lr", type=float, default=1e-5, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:  # only where the command line left the default
        quick = dict(seeds=args.seeds[:1], steps=3, lrs=args.lrs[-1:], n_eval=16)
        for k, v in quick.items():
            if getattr(args, k) == p.get_default(k):
                setattr(args, k, v)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.one:
        return run_one(args)
    import torch
    from tqdm.auto import tqdm

    sys.path.insert(0, str(ROOT))
    from hfq.models import smollm2_135m_instruct

    smollm2_135m_instruct()  # convert once before the parallel runs
    args.device_note = torch.cuda.get_device_name() if torch.cuda.is_available() else \
        f"CPU ({os.cpu_count()} cores, {args.jobs} runs in parallel), fp32 compute"
    jobs = [(a, s, lr) for lr in args.lrs for s in args.seeds for a in args.arms]
    threads = max(1, (os.cpu_count() or 1) // max(1, args.jobs))
    runs, skipped = [], []
    with ThreadPoolExecutor(args.jobs) as ex, tqdm(total=len(jobs), desc="GRPO runs") as bar:
        futs = [ex.submit(spawn, a, s, lr, args, threads) for a, s, lr in jobs]
        for f in as_completed(futs):
            try:
                r = f.result()
            except RuntimeError as e:  # one failed run is reported, the others still count
                skipped.append(str(e))
                bar.update()
                continue
            if "skipped" in r:
                skipped.append(f"{r['arm']} ({r['skipped']})")
            else:
                runs.append(r)
                bar.set_postfix_str(f"{r['arm']} lr {r['lr']:g} s{r['seed']}: acc {r['acc_after']:.2f}")
            bar.update()
    stem = "qerl_real" + ("_quick" if args.quick else "")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(runs, args.lrs, out / f"{stem}.png")
    cmd = "python examples/qerl_real.py " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / f"{stem}.json").write_text(json.dumps({"command": cmd.strip(), "device": args.device_note,
                                                  "skipped": skipped, "runs": runs}, indent=1))
    write_md(out / f"{stem}.md", runs, args, skipped, cmd.strip())
    print(f"wrote {out / stem}.md/.json/.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
