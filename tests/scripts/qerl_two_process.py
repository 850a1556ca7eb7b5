"""Run under `accelerate launch --cpu --num_processes 2`: 2 QeRL steps on a tiny NVFP4 + LoRA policy; each rank
saves its LoRA weights and the norm weights it sampled with, for tests/test_qerl_multiprocess.py to compare."""
import sys

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

import hfq  # noqa: F401
from hfq.nvfp4 import NVFP4Config, get_peft_model
from hfq.qerl import QeRLConfig, QeRLGRPOTrainer
from hfq.qerl.data import make_dataset


def digit_reward(completions, **kwargs):
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def main(path, out):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=NVFP4Config(), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                             task_type="CAUSAL_LM"))
    tok = AutoTokenizer.from_pretrained(path)
    args = QeRLConfig(output_dir=f"{out}/run", learning_rate=1e-3, num_generations=4, per_device_train_batch_size=4,
                      max_completion_length=8, max_steps=2, logging_steps=1, save_strategy="no", report_to="none",
                      bf16=False, use_cpu=True, aqn_num_stages=2, aqn_sigma_start=2e-2, aqn_sigma_end=5e-3, seed=3)
    ds = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in make_dataset(16, seed=5)])
    trainer = QeRLGRPOTrainer(model=model, reward_funcs=[digit_reward], args=args, train_dataset=ds,
                              processing_class=tok)
    sampled = {}
    orig = trainer.aqn.apply

    def apply(step, sigma):
        orig(step, sigma)
        sampled[step] = torch.cat([m.weight.detach().flatten().clone() for _, m in trainer.aqn.targets])

    trainer.aqn.apply = apply
    trainer.train()
    lora = {n: p.detach().clone() for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()
            if "lora_" in n}
    rank = trainer.accelerator.process_index
    torch.save({"lora": lora, "sampled": sampled, "world": trainer.accelerator.num_processes},
               f"{out}/rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
