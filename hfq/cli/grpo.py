"""`hfq grpo`: QeRL GRPO from the command line.

With no arguments: the offline demo. It builds (deterministically, cached under `--cache-dir`) a tiny
Qwen2-architecture model with hfq's character tokenizer, pre-trains it briefly on the bundled arithmetic
word problems so it is right part of the time, reloads it quantized to NVFP4, adds LoRA, runs QeRL GRPO
(AQN on) for a few dozen steps on the CPU, prints + plots reward, entropy and sigma, and ends with a verdict:
accuracy and format of answers sampled as in training, on held-out problems, before vs after training, with
their noise.

With `--model` / `--dataset` / `--config` it trains a real model (e.g. Qwen2.5-7B-Instruct on GSM8K): in bf16 on a
GPU, in fp32 on a CPU-only machine (settings picked from the hardware; `--config` overrides them).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from hfq._settings import SETTINGS
from hfq.qerl.demo import DEMO_ARCH, DEMO_PRETRAIN_STEPS, build_demo_base

from . import check_model_dir, checkpoint_quantization, positive_float, positive_int

HELDOUT = 200
_EXPLAIN = """\
[hfq grpo] What this shows: QeRL = GRPO on a quantized base + LoRA, with Adaptive Quantization Noise (AQN), teaching
  a tiny pre-trained model ({layers} layers, {hidden} wide, fp32 -> {quant}) one-digit word problems, offline on the CPU.
  Each step samples {gens} answers to each of {prompts} prompts and rewards them:
    reward  = accuracy (1 if the answer is right) + format (1 for <think>..</think><answer>..</answer>); at most 2
    entropy = the policy's mean entropy per sampled token (nats)
    AQN     = the run is cut into {stages} stages of equal length: stage 0 adds no noise (sigma 0), stages 1..{K} add
              Gaussian noise of std sigma to the RMSNorm weights while sampling, {s0:g} decaying to {s1:g}
  A step's reward is a mean over its {samples} samples, so it moves from step to step by sampling alone; the verdict
  at the end compares accuracy and format on {n} held-out problems (2 answers each, sampled the same way) before
  and after training."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model id or path (default: the bundled tiny demo model)")
    p.add_argument("--dataset", default=None,
                   help="HF dataset id (e.g. openai/gsm8k), or a .json/.jsonl file with question/answer fields "
                        "(default: the bundled arithmetic task)")
    p.add_argument("--dataset-config", default=None, help="dataset config name (e.g. main for gsm8k)")
    p.add_argument("--config", default=None, help="JSON file of QeRLConfig fields (override the preset)")
    p.add_argument("--preset", default=None, choices=("gsm8k", "bigmath"), help="start from the paper's preset")
    p.add_argument("--quant", default="nvfp4", choices=("nvfp4", "mxfp4", "none"), help="base weight format")
    p.add_argument("--steps", type=positive_int, default=None, help="GRPO steps (demo default 60, else 500)")
    p.add_argument("--aqn-scope", default=None, choices=("rollout", "rollout_and_old_logprobs"))
    p.add_argument("--no-aqn", action="store_true", help="disable Adaptive Quantization Noise")
    p.add_argument("--lora-r", type=positive_int, default=None, help="LoRA rank (demo default 16, else 32)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: --config's seed, else 0)")
    p.add_argument("--pretrain-steps", type=positive_int, default=None,
                   help=f"demo base: pre-training steps (default {DEMO_PRETRAIN_STEPS})")
    p.add_argument("--lr", type=positive_float, default=None, help="learning rate (demo default 2e-3)")
    p.add_argument("--cache-dir", default=None,
                   help="where the demo base model is cached (default $HFQ_CACHE, else ~/.cache/hfq)")
    p.add_argument("--output-dir", default=None,
                   help="checkpoints, metrics.json and curves.png (default: --config's output_dir, else hfq-grpo-out)")
    p.add_argument("--no-plot", action="store_true")


# --------------------------------------------------------------------------- data
def _load_dataset(args):
    from datasets import Dataset, load_dataset

    from hfq.qerl.rewards import PROMPT_SUFFIX, add_suffix

    if args.dataset is None:
        from hfq.qerl.data import make_dataset

        rows = make_dataset(2000, seed=args.seed + 7)
        return Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows]), False
    if args.dataset.endswith((".json", ".jsonl")):
        ds = load_dataset("json", data_files=args.dataset, split="train")
    else:
        ds = load_dataset(args.dataset, args.dataset_config, split="train")
    qcol = next((c for c in ("question", "problem", "prompt") if c in ds.column_names), None)
    acol = next((c for c in ("answer", "solution", "ground_truth") if c in ds.column_names), None)
    if qcol is None or acol is None:
        raise ValueError(f"--dataset: needs a question/problem/prompt and an answer/solution column, "
                         f"found {ds.column_names}")

    def fmt(ex):
        return {"prompt": [{"role": "user", "content": add_suffix(ex[qcol], PROMPT_SUFFIX)}], "answer": ex[acol]}

    return ds.map(fmt, remove_columns=ds.column_names), True


# --------------------------------------------------------------------------- main
def _one_thread_if_busy() -> str | None:
    """On a CPU machine already running more than it has cores, torch's spinning OpenMP threads fight the other
    jobs for them and the run slows several-fold: use one thread there, unless OMP_NUM_THREADS chooses. Returns
    a note saying so, or None."""
    import torch

    cores, load = os.cpu_count() or 1, os.getloadavg()[0]
    if torch.cuda.is_available() or SETTINGS.omp_threads_set or cores < 2 or load < cores - 0.5:
        return None
    torch.set_num_threads(1)
    return f"this machine is busy (load {load:.1f} on {cores} cores): 1 torch thread (OMP_NUM_THREADS overrides)"


def _heldout_rows(train_prompts: set, seed: int) -> list[dict]:
    """HELDOUT demo problems whose question is not among the training prompts."""
    from hfq.qerl.data import make_dataset

    rows = [r for r in make_dataset(4 * HELDOUT, seed=seed + 1000) if r["prompt"] not in train_prompts]
    return rows[:HELDOUT]


def _device_settings(demo: bool) -> tuple[dict, "torch.dtype"]:
    """QeRLConfig fields and load dtype for this machine: bf16 on a GPU that has it, fp32 on the CPU
    (and always for the tiny fp32 demo model)."""
    import torch

    on_gpu = torch.cuda.is_available()
    bf16 = on_gpu and not demo and torch.cuda.is_bf16_supported()
    return dict(use_cpu=not on_gpu, bf16=bf16, fp16=False), torch.bfloat16 if bf16 else torch.float32


def _build_config(args, demo: bool):
    from hfq.qerl.config import QeRLConfig

    kw, _ = _device_settings(demo)
    if demo:
        kw.update(learning_rate=2e-3, num_generations=8, per_device_train_batch_size=64, max_completion_length=48,
                  temperature=1.0, beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="grpo", max_steps=60,
                  logging_steps=1, save_strategy="no", report_to="none", gradient_checkpointing=False,
                  dataloader_num_workers=0, disable_tqdm=True, aqn_num_stages=4, aqn_sigma_start=1e-2,
                  aqn_sigma_end=5e-4)
    else:
        kw.update(logging_steps=1, report_to="none", max_steps=500, save_steps=100)
    kw.update(args.config_fields)
    if args.steps is not None:
        kw["max_steps"] = args.steps
    if args.lr is not None:
        kw["learning_rate"] = args.lr
    if args.aqn_scope:
        kw["aqn_scope"] = args.aqn_scope
    if args.no_aqn:
        kw["aqn"] = False
    kw.update(output_dir=args.output_dir, seed=args.seed)
    if args.preset:
        return QeRLConfig.paper_preset(args.preset, **kw)
    return QeRLConfig(**kw)


def _load_policy(args, path, demo: bool):
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    held = checkpoint_quantization(path)
    if held is not None and (held.get("quant_method"), held.get("format")) != ("hfq_nvfp4", args.quant):
        # transformers would load it as it is: the policy would not be in the --quant format asked for
        raise SystemExit(f"{path}: already quantized ({held.get('quant_method', 'unknown')}"
                         f"{', ' + held['format'] if held.get('format') else ''}), not --quant {args.quant}; "
                         "pass the matching --quant or the dense checkpoint")
    tok = AutoTokenizer.from_pretrained(path)
    kw = {"dtype": _device_settings(demo)[1]}
    if args.quant != "none":
        from hfq.nvfp4 import NVFP4Config

        kw["quantization_config"] = NVFP4Config(format=args.quant)
    if not demo and torch.cuda.is_available():
        kw["device_map"] = {"": 0}
    model = AutoModelForCausalLM.from_pretrained(path, **kw)
    r = args.lora_r if args.lora_r is not None else (16 if demo else 32)
    lcfg = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    if args.quant != "none":
        from hfq.nvfp4 import get_peft_model
    else:
        from peft import get_peft_model
    return get_peft_model(model, lcfg), tok


def _check_args(args) -> None:
    """Options that the chosen mode would ignore stop the run, naming them, before anything is loaded; --config is
    read and checked here (a JSON object of QeRLConfig fields)."""
    demo = args.model is None
    hub_dataset = args.dataset is not None and not args.dataset.endswith((".json", ".jsonl"))
    ignored = [("--preset", demo, "the demo's own settings replace the preset: use it with --model"),
               ("--dataset", demo, "the demo trains on its bundled task: use it with --model"),
               ("--pretrain-steps", not demo, "it sets up the demo base, which --model replaces"),
               ("--cache-dir", not demo, "it holds the demo base, which --model replaces"),
               ("--dataset-config", not hub_dataset, "it names a config of a Hub dataset (--dataset ID)"),
               ("--aqn-scope", args.no_aqn, "--no-aqn turns the noise off")]
    for flag, no_effect, why in ignored:
        if no_effect and getattr(args, flag[2:].replace("-", "_")) is not None:
            raise SystemExit(f"hfq grpo: {flag} has no effect here: {why}")
    args.config_fields = {}
    if args.config:
        from dataclasses import fields

        from hfq.qerl.config import QeRLConfig

        try:
            cfg = json.loads(Path(args.config).read_text())
        except FileNotFoundError:
            raise SystemExit(f"hfq grpo: --config {args.config}: no such file") from None
        except json.JSONDecodeError as e:
            raise SystemExit(f"hfq grpo: --config {args.config}: not valid JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise SystemExit(f"hfq grpo: --config {args.config}: expected a JSON object of QeRLConfig fields")
        unknown = sorted(set(cfg) - {f.name for f in fields(QeRLConfig)})
        if unknown:
            raise SystemExit(f"hfq grpo: --config {args.config}: {unknown} are not QeRLConfig fields")
        args.config_fields = cfg
    # a flag given on the command line wins over --config, which wins over the default
    for name, default in (("seed", 0), ("output_dir", "hfq-grpo-out")):
        if getattr(args, name) is None:
            setattr(args, name, args.config_fields.get(name, default))


def main(args) -> int:
    _check_args(args)
    if args.model is not None:  # before the heavy imports: a wrong path stops at once
        args.model = check_model_dir(args.model)
    import torch
    from transformers import PrinterCallback, TrainerCallback, set_seed

    from hfq.qerl.demo import heldout_scores, two_se, verdict
    from hfq.qerl.entropy import sampling_entropy
    from hfq.qerl.plot import plot_curves
    from hfq.qerl.rewards import accuracy_reward, format_reward
    from hfq.qerl.trainer import QeRLGRPOTrainer

    torch.manual_seed(args.seed)
    demo = args.model is None
    t0 = time.time()
    note = _one_thread_if_busy()
    if note:
        print(f"[hfq grpo] {note}")
    path = (build_demo_base(args.cache_dir, steps=args.pretrain_steps or DEMO_PRETRAIN_STEPS, seed=args.seed)
            if demo else args.model)
    set_seed(args.seed)  # LoRA's initialisation draws the same numbers whether the demo base was built or cached
    model, tok = _load_policy(args, path, demo)
    dataset, _ = _load_dataset(args)
    cfg = _build_config(args, demo)

    entropy_note, heldout, before = {}, [], {}
    if demo:
        K = cfg.aqn_num_stages
        print(_EXPLAIN.format(quant=args.quant, gens=cfg.num_generations, n=HELDOUT, stages=K + 1, K=K,
                              samples=cfg.per_device_train_batch_size,
                              prompts=cfg.per_device_train_batch_size // cfg.num_generations,
                              s0=cfg.aqn_sigma_start, s1=cfg.aqn_sigma_end, **DEMO_ARCH))
        # the paper's Fig. 5 on this model: same prompts, fp32 base vs quantized base, adapters off
        from transformers import AutoModelForCausalLM

        prompts = [dataset[i]["prompt"] for i in range(32)]
        clean = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with model.disable_adapter():
            entropy_note = {"fp32": sampling_entropy(clean, tok, prompts),
                            args.quant: sampling_entropy(model.eval(), tok, prompts)}
        model.train()
        print(f"[hfq grpo] sampling entropy of the base on 32 prompts (QeRL's claim: quantized samples more "
              f"broadly): " + ", ".join(f"{k} {v:.4f}" for k, v in entropy_note.items()))
        heldout = _heldout_rows(set(dataset["prompt"]), args.seed)
        before = heldout_scores(model, tok, heldout)
        print(f"[hfq grpo] before training, on {len(heldout)} held-out problems: " +
              ", ".join(f"{k} {sum(v) / len(v):.3f}" for k, v in before.items()))

    class _Print(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                parts = [logs.get(f"rewards/{f.__name__}/mean") for f in (accuracy_reward, format_reward)]
                split = f" (= {parts[0]:.3f} + {parts[1]:.3f})" if None not in parts else ""
                print(f"step {state.global_step:3d}  reward {logs['reward']:.3f}{split}  "
                      f"entropy {logs.get('entropy', 0):.3f}"
                      f"  AQN stage {int(logs.get('aqn/stage', 0))}/{cfg.aqn_num_stages if cfg.aqn else 0} sigma "
                      f"{logs.get('aqn/sigma', 0):.1e}", flush=True)

    trainer = QeRLGRPOTrainer(model=model, reward_funcs=[accuracy_reward, format_reward], args=cfg,
                              train_dataset=dataset, processing_class=tok, callbacks=[_Print()])
    trainer.remove_callback(PrinterCallback)  # _Print shows the few numbers that matter
    print(f"[hfq grpo] {'demo' if demo else path}: {args.quant} base + LoRA, AQN "
          f"{'off' if not cfg.aqn else cfg.aqn_schedule + ' ' + cfg.aqn_scope}, {cfg.max_steps} steps, "
          f"{len(trainer.aqn.targets) if trainer.aqn else 0} noisy norms")
    trainer.train()
    history = [h for h in trainer.state.log_history if "reward" in h]
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rewards = [h["reward"] for h in history]
    k = max(1, len(rewards) // 4)
    summary = {"first_quarter_reward": sum(rewards[:k]) / k, "last_quarter_reward": sum(rewards[-k:]) / k,
               "steps": len(rewards), "aqn_scope": cfg.aqn_scope,
               "aqn": cfg.aqn, "quant": args.quant, "sampling_entropy": entropy_note}
    verdicts = []
    if demo:
        after = heldout_scores(trainer.model, tok, heldout)
        for key in ("reward", "accuracy", "format"):
            b, a = before[key], after[key]
            change, noise, word = verdict(b, a)
            summary[f"heldout_{key}"] = {"problems": len(b), "before": sum(b) / len(b), "after": sum(a) / len(a),
                                         "before_2se": two_se(b), "after_2se": two_se(a),
                                         "change": change, "noise_2se": noise, "verdict": word}
            verdicts.append(f"held-out {key} {sum(b) / len(b):.3f} -> {sum(a) / len(a):.3f} ({change:+.3f} +- "
                            f"{noise:.3f}): {word}")
    summary["seconds"] = round(time.time() - t0, 1)
    (out / "metrics.json").write_text(json.dumps({"summary": summary, "history": history}, indent=1))
    if not args.no_plot:
        plot_curves(trainer.state.log_history, str(out / "curves.png"), heldout=summary.get("heldout_reward"))
    print(f"[hfq grpo] training reward, first quarter {summary['first_quarter_reward']:.3f} -> last quarter "
          f"{summary['last_quarter_reward']:.3f}; {summary['seconds']} s; wrote {out}/metrics.json"
          + ("" if args.no_plot else f" and {out}/curves.png"))
    if demo:
        print("[hfq grpo] verdict (before -> after, +- two standard errors of the paired change): "
              + "; ".join(verdicts))
    if not demo:
        trainer.save_model(str(out / "final"))
    return 0
