"""Model cards and the folder a Hub push uploads (the upload itself needs the network)."""
import os

import peft
import pytest
from transformers import AutoModelForCausalLM

import hfq
from hfq import hub


def test_adapter_and_model_cards(tiny_dir, tmp_path):
    m = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.NVFP4Config())
    card = hub.nvfp4_model_card(m, "me/tiny-nvfp4")
    assert "\n- hfq_nvfp4\n" in card and "me/tiny-nvfp4" in card and "| layers quantized | 14 |" in card
    pm = hfq.nvfp4.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    out = hub.save_for_hub(pm, str(tmp_path / "push"), "me/tiny-qerl", training_summary="reward 0.1 -> 0.5")
    files = set(os.listdir(out))
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md"} <= files
    text = open(os.path.join(out, "README.md")).read()
    assert text.startswith("---\nlibrary_name: peft") and "rank 4, alpha 8" in text and "NVFP4" in text
    assert "reward 0.1 -> 0.5" in text and "{" not in text.split("```python")[0]


def test_missing_card_field_is_an_error():
    with pytest.raises(ValueError, match="missing fields"):
        hub.render("lora_adapter.md", base_model="x")
