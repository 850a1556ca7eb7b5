"""The standard PEFT / TRL routes on the real SmolLM2-135M-Instruct in NVFP4, where they failed before. Forwards
only, on 32 tokens (an NVFP4 forward of this model costs ~10 s on a CI CPU); training steps run on the tiny model."""
import copy
import os

import peft
import pytest
import torch
from peft import LoraConfig, PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import hfq  # noqa: F401
from hfq.nvfp4 import NVFP4Config, NVFP4Linear, NVFP4LoraLinear, export_with_adapter, merge_and_requantize

pytestmark = pytest.mark.real_model

TEXT = ("The quick brown fox jumps over the lazy dog. Water boils at one hundred degrees Celsius at sea level, "
        "and ice melts at zero degrees.")


@pytest.fixture(scope="module")
def nvfp4_base(smollm2):
    return AutoModelForCausalLM.from_pretrained(smollm2, quantization_config=NVFP4Config())


@pytest.fixture(scope="module")
def batch(smollm2):
    ids = AutoTokenizer.from_pretrained(smollm2)(TEXT, return_tensors="pt")["input_ids"][:, :32]
    return ids


def _short_finetune(pm, step=6e-4, seed=0):
    """LoRA weights of the size six AdamW steps at lr 1e-4 leave (each entry moves by about lr per step): the
    small delta of a short run, set directly because a training step on this CPU costs tens of seconds."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * step)


def test_real_model_lora_routes(nvfp4_base, batch, tmp_path):
    assert nvfp4_base.dtype == torch.bfloat16
    n_nv = sum(isinstance(m, NVFP4Linear) for m in nvfp4_base.modules())
    assert n_nv == 7 * 30
    pm = peft.get_peft_model(copy.deepcopy(nvfp4_base), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    assert sum(isinstance(m, NVFP4LoraLinear) for m in pm.modules()) == n_nv
    _short_finetune(pm)
    with torch.no_grad():
        tuned = pm(batch).logits.float()
    # the adapter saves and reloads onto a fresh NVFP4 base through PEFT's own loader
    pm.save_pretrained(tmp_path / "adapter")
    re = PeftModel.from_pretrained(copy.deepcopy(nvfp4_base), tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(re(batch).logits.float(), tuned)
    # export keeps the fine-tune exactly: the base codes it was trained on + the adapter, side by side
    paths = export_with_adapter(re, str(tmp_path / "served"))
    sd = load_file(os.path.join(paths["base"], "model.safetensors"))
    q = nvfp4_base.model.layers[7].mlp.up_proj
    assert torch.equal(sd["model.layers.7.mlp.up_proj.weight_packed"], q.weight_packed)
    saved = load_file(os.path.join(paths["adapter"], "adapter_model.safetensors"))
    assert saved.keys() == load_file(tmp_path / "adapter" / "adapter_model.safetensors").keys()
    # merge_and_unload: a dense model in the model's dtype that runs
    merged = copy.deepcopy(re).merge_and_unload()
    assert {p.dtype for p in merged.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        dense = merged(batch).logits.float()
    assert torch.nn.functional.cosine_similarity(dense.flatten(), tuned.flatten(), dim=0) > 0.99
    # re-quantizing the merge says how much of the small delta survived, and warns that it did not
    with pytest.warns(UserWarning, match="lost most of the fine-tune"):
        _, report = merge_and_requantize(re)
    assert len(report) == n_nv
    assert report.overall["delta_error_ratio"] > 0.5 and report.overall["delta_kept"] < 0.5


def test_real_model_qerl_trainer_peft_config(nvfp4_base, smollm2, tmp_path):
    """The README's QeRL snippet: QeRLGRPOTrainer(peft_config=LoraConfig(target_modules="all-linear"))."""
    from datasets import Dataset

    from hfq.qerl import QeRLConfig, QeRLGRPOTrainer

    def length_reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    args = QeRLConfig(output_dir=str(tmp_path / "out"), learning_rate=1e-3, num_generations=2,
                      per_device_train_batch_size=2, max_completion_length=4, max_steps=1, logging_steps=1,
                      save_strategy="no", report_to="none", bf16=False, use_cpu=True, aqn_num_stages=2)
    ds = Dataset.from_list([{"prompt": "What is 2+3?"}, {"prompt": "Name a color."}] * 2)
    trainer = QeRLGRPOTrainer(model=copy.deepcopy(nvfp4_base), reward_funcs=[length_reward], args=args,
                              train_dataset=ds, processing_class=AutoTokenizer.from_pretrained(smollm2),
                              peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                     task_type="CAUSAL_LM"))
    assert sum(isinstance(m, NVFP4LoraLinear) for m in trainer.model.modules()) == 7 * 30
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert trainer.aqn is not None and len(trainer.aqn.targets) == 2 * 30  # (a GRPO step runs on the tiny model)
