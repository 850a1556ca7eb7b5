"""QeRL on math: NVFP4 + LoRA r=32 + AQN 1e-2 -> 5e-4, TRL-style, in the paper's two setups.

    # GSM8K with GRPO (paper Tab. 1)
    accelerate launch examples/qerl_math.py --task gsm8k --model_name_or_path Qwen/Qwen2.5-7B-Instruct \
        --output_dir qerl-gsm8k --per_device_train_batch_size 8 --gradient_accumulation_steps 4 --bf16 true
    # BigMath with DAPO (paper Tab. 2: DAPO loss, 16 samples/prompt)
    accelerate launch examples/qerl_math.py --task bigmath --model_name_or_path Qwen/Qwen2.5-7B-Instruct \
        --output_dir qerl-dapo --per_device_train_batch_size 16 --gradient_accumulation_steps 4 --bf16 true

`--task` picks the paper preset (loss, samples per prompt, lengths) and the dataset defaults; any QeRLConfig /
GRPOConfig field given on the command line (e.g. `--loss_type dapo`) and `--dataset_name` / `--question_column`
override them. LoRA goes in as TRL's `peft_config`: after `import hfq`, PEFT wraps the NVFP4 layers itself.
"""
import os
import sys
from dataclasses import dataclass, field

import torch
from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

import hfq  # noqa: F401  (registers hfq_nvfp4 and LoRA on NVFP4 layers)
from hfq.nvfp4 import NVFP4Config
from hfq.qerl import QeRLConfig, QeRLGRPOTrainer
from hfq.qerl.plot import plot_curves
from hfq.qerl.rewards import accuracy_reward, add_suffix, format_reward

# task -> (dataset name, config, question column)
TASKS = {"gsm8k": ("openai/gsm8k", "main", "question"),
         "bigmath": ("SynthLabsAI/Big-Math-RL-Verified", None, "problem")}


@dataclass
class ScriptArgs:
    task: str = field(default="gsm8k", metadata={"help": f"one of {tuple(TASKS)}"})
    model_name_or_path: str = "Qwen/Qwen2.5-7B-Instruct"
    dataset_name: str | None = field(default=None, metadata={"help": "default: the task's dataset"})
    dataset_config: str | None = None
    data_files: str | None = field(default=None, metadata={"help": "local files, e.g. with --dataset_name json"})
    question_column: str | None = field(default=None, metadata={"help": "default: the task's"})
    answer_column: str = "answer"
    lora_r: int = 32
    quant: str = field(default="nvfp4", metadata={"help": "nvfp4 | mxfp4 | none"})


def main():
    script, cfg = HfArgumentParser((ScriptArgs, QeRLConfig)).parse_args_into_dataclasses()
    if script.task not in TASKS:
        raise SystemExit(f"--task: {script.task!r} is not one of {tuple(TASKS)}")
    ds_name, ds_config, qcol = TASKS[script.task]
    if script.dataset_name is not None:
        ds_name, ds_config = script.dataset_name, script.dataset_config
    qcol = script.question_column or qcol
    # the paper's preset, overridden by every QeRLConfig field given explicitly on the command line
    given = {a[2:].split("=")[0].replace("-", "_") for a in sys.argv[1:] if a.startswith("--")}
    cfg = QeRLConfig.paper_preset(script.task, **{k: getattr(cfg, k) for k in given
                                                  if k in QeRLConfig.__dataclass_fields__})
    print(f"task={script.task} loss_type={cfg.loss_type} num_generations={cfg.num_generations}")
    tok = AutoTokenizer.from_pretrained(script.model_name_or_path)
    qc = None if script.quant == "none" else NVFP4Config(format=script.quant)
    model = AutoModelForCausalLM.from_pretrained(script.model_name_or_path, dtype=torch.bfloat16,
                                                 quantization_config=qc)
    lora = LoraConfig(r=script.lora_r, lora_alpha=2 * script.lora_r, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    ds = load_dataset(ds_name, ds_config, data_files=script.data_files, split="train")
    ds = ds.map(lambda ex: {"prompt": [{"role": "user", "content": add_suffix(ex[qcol])}],
                            "answer": ex[script.answer_column]}, remove_columns=ds.column_names)
    trainer = QeRLGRPOTrainer(model=model, reward_funcs=[accuracy_reward, format_reward], args=cfg,
                              train_dataset=ds, processing_class=tok, peft_config=lora)
    trainer.train()
    trainer.save_model(cfg.output_dir)
    if trainer.accelerator.is_main_process:  # reward / loss / entropy / sigma curves
        print("curves:", plot_curves(trainer.state.log_history, os.path.join(cfg.output_dir, "curves.png")))


if __name__ == "__main__":
    main()
