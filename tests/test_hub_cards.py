"""Hub model cards of every kind, the folder a push uploads, the QeRL trainer's card and `hfq push`, offline.

Cards are checked through huggingface_hub's own parser (`ModelCard(text).data`); saved folders are reloaded with
`from_pretrained` after `import hfq` (or `PeftModel.from_pretrained`) by running the card's own usage snippet.
"""
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import peft
import pytest
import torch
from datasets import Dataset
from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.errors import HFValidationError, LocalTokenNotFoundError
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

import hfq
from hfq import hub

REPO = Path(__file__).resolve().parent.parent
HUB_BASE = "hfq-test/tiny-qwen2"  # a Hub-style id the tiny base pretends to come from


def _snippet(card_text: str) -> str:
    (code,) = re.findall(r"^```python\n(.*?)^```", card_text, flags=re.M | re.S)
    return code


def _run_snippet(card_text: str, replace: dict) -> dict:
    """Execute the card's usage snippet with Hub ids swapped for the local folders that stand for them."""
    code = _snippet(card_text)
    for old, new in replace.items():
        assert f'"{old}"' in code, f"{old!r} not in the snippet:\n{code}"
        code = code.replace(f'"{old}"', repr(new))
    scope = {}
    exec(compile(code, "<card snippet>", "exec"), scope)
    return scope


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


IDS = torch.tensor([[5, 17, 33, 60, 8, 2]])


@pytest.fixture
def nvfp4(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.NVFP4Config(), dtype=torch.float32)


@pytest.fixture
def no_token(monkeypatch, tmp_path):
    """No Hub token anywhere huggingface_hub looks (argument, env, token files)."""
    import huggingface_hub.constants as c

    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(c, "HF_TOKEN_PATH", str(tmp_path / "no_token"))
    monkeypatch.setattr(c, "HF_STORED_TOKENS_PATH", str(tmp_path / "no_stored_tokens"))


# --------------------------------------------------------------------------- NVFP4 base
def test_nvfp4_card_base_model_only_for_a_hub_id(nvfp4):
    local = ModelCard(str(hub.model_card(nvfp4, "me/tiny-nvfp4")))
    assert local.data.base_model is None and "base_model" not in local.data.to_dict()
    assert "not a Hugging Face Hub repository" in local.text and "tiny_qwen2" in local.text
    assert str(Path(nvfp4.config._name_or_path).parent) not in str(local)  # the full local path is never written
    nvfp4.config._name_or_path = HUB_BASE
    d = ModelCard(str(hub.model_card(nvfp4, "me/tiny-nvfp4"))).data
    assert d.base_model == HUB_BASE and d.base_model_relation == "quantized"
    assert d.library_name == "transformers" and {"hfq", "nvfp4", "hfq_nvfp4"} <= set(d.tags)
    assert d.quantization["quant_method"] == "hfq_nvfp4" and d.quantization["format"] == "nvfp4"
    assert d.quantization["layers_quantized"] == 14 and d.quantization["block_size"] == 16
    assert "training" not in d.to_dict()  # loaded and quantized, not trained: no training block


def test_nvfp4_save_for_hub_folder_reloads_through_the_card_snippet(nvfp4, tiny_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    out = hub.save_for_hub(nvfp4, str(tmp_path / "push"), "me/tiny-nvfp4", tokenizer=tok)
    files = set(os.listdir(out))
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "README.md"} <= files
    card = Path(out, "README.md").read_text()
    assert 'AutoTokenizer.from_pretrained("me/tiny-nvfp4")' in card
    scope = _run_snippet(card, {"me/tiny-nvfp4": out})
    assert any(isinstance(m, hfq.NVFP4Linear) for m in scope["model"].modules())
    assert torch.equal(_logits(scope["model"], IDS), _logits(nvfp4, IDS))
    assert scope["tokenizer"]("12").input_ids == tok("12").input_ids


def test_merged_nvfp4_card_says_it_holds_a_fine_tune(nvfp4, tiny_dir, tmp_path):
    """merge_and_requantize folds a LoRA into the NVFP4 codes: the card called the result a plain quantization of
    the base (relation 'quantized', no lora tag) with the load's weight error, which describes the older codes."""
    nvfp4.config._name_or_path = HUB_BASE
    before = hub.model_card(nvfp4, "me/tiny-nvfp4").data
    assert before.base_model_relation == "quantized" and "mean_relative_weight_error" in before.quantization
    merged, _ = hfq.nvfp4.merge_and_requantize(_adapter(nvfp4))
    out = hub.save_for_hub(merged, str(tmp_path / "push"), "me/tiny-merged")
    card = ModelCard.load(os.path.join(out, "README.md"))
    d = card.data
    assert d.base_model == HUB_BASE and d.base_model_relation == "finetune" and {"lora", "merged"} <= set(d.tags)
    assert d.quantization["merged_adapter"] is True and "mean_relative_weight_error" not in d.quantization
    assert "merge_and_requantize" in card.text and "n/a (a LoRA merged since the load)" in card.text
    scope = _run_snippet(str(card), {"me/tiny-merged": out, HUB_BASE: tiny_dir})
    assert torch.equal(_logits(scope["model"], IDS), _logits(merged, IDS))


# --------------------------------------------------------------------------- QeRL LoRA adapter
def _adapter(model):
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # a non-zero LoRA delta, so reloading it is visible in the logits
        g = torch.Generator().manual_seed(1)
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return pm


def test_adapter_card_and_folder(nvfp4, tiny_dir, tmp_path):
    pm = _adapter(nvfp4)
    d = ModelCard(str(hub.model_card(pm, "me/tiny-qerl"))).data
    assert d.base_model is None and d.library_name == "peft"  # base loaded from a local folder
    pm.peft_config["default"].base_model_name_or_path = HUB_BASE
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    out = hub.save_for_hub(pm, str(tmp_path / "push"), "me/tiny-qerl", tokenizer=tok)
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "README.md"} <= set(os.listdir(out))
    card = ModelCard.load(os.path.join(out, "README.md"))
    d = card.data
    assert d.base_model == HUB_BASE and d.base_model_relation == "adapter" and d.library_name == "peft"
    assert {"hfq", "nvfp4", "lora"} <= set(d.tags) and "qerl" not in d.tags  # no trainer: the method is not known
    assert "QeRL" not in card.text and "Adaptive Quantization Noise" not in card.text
    assert d.quantization["format"] == "nvfp4" and d.training["lora"]["r"] == 4
    assert d.training["lora"]["target_modules"] == ["q_proj", "v_proj"]
    assert "rank 4, alpha 8" in card.text
    scope = _run_snippet(str(card), {HUB_BASE: tiny_dir, "me/tiny-qerl": out})
    assert isinstance(scope["model"], peft.PeftModel)
    with pm.disable_adapter():
        without = _logits(pm, IDS)
    assert not torch.allclose(without, _logits(pm, IDS), atol=1e-3)  # the adapter matters ...
    assert torch.allclose(_logits(scope["model"], IDS), _logits(pm, IDS), atol=1e-5)  # ... and came back


def test_adapter_card_on_a_calibrated_base_loads_the_calibrated_codes(tiny_dir, tmp_path):
    """An adapter trained on a GPTQ-calibrated base (calibrate_): its card loaded the dense base with NVFP4Config(),
    i.e. round-to-nearest codes the adapter was not trained on (logits off, no warning). Given the saved calibrated
    base's repo (base_model=) the card loads it as saved; without one it names no base and says why (a warning too:
    TRL writes cards at every checkpoint, so this is no error)."""
    from hfq.nvfp4 import calibrate_
    from hfq.tiny import char_tokenizer

    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    calibrate_(base, [f"sample {i}: the fox jumps over the dog {i * 7} times" for i in range(16)], char_tokenizer(),
               progress=False, device="cpu")
    base.save_pretrained(str(tmp_path / "calibrated"))
    pm = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                   init_lora_weights=False))
    pm.peft_config["default"].base_model_name_or_path = HUB_BASE  # the dense source: not what the adapter needs
    with pytest.warns(UserWarning, match=r"GPTQ-calibrated .* pass base_model="):
        card = hub.model_card(pm, "me/tiny-cal")
    assert card.data.base_model is None and HUB_BASE not in _snippet(str(card))
    assert 'from_pretrained("PATH/TO/BASE", dtype="float32")' in _snippet(str(card))
    assert "calibrated checkpoint" in str(card)
    out = hub.save_for_hub(pm, str(tmp_path / "push"), "me/tiny-cal", base_model="me/tiny-calibrated")
    card = ModelCard.load(os.path.join(out, "README.md"))
    assert card.data.base_model == "me/tiny-calibrated"
    assert "quantization_config" not in _snippet(str(card))
    scope = _run_snippet(str(card), {"me/tiny-calibrated": str(tmp_path / "calibrated"), "me/tiny-cal": out})
    assert torch.equal(_logits(scope["model"], IDS), _logits(pm, IDS))
    rtn = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
        tiny_dir, dtype=torch.float32, quantization_config=hfq.NVFP4Config()), out)
    assert not torch.allclose(_logits(rtn, IDS), _logits(pm, IDS))  # what the old card loaded


def test_adapter_card_loads_the_base_in_the_dtype_it_was_trained_in(tiny_dir, tmp_path):
    """An adapter trained on a bf16 base whose checkpoint is fp32: the card's snippet loaded the base in fp32 (the
    checkpoint's dtype), so its outputs were not the trained model's. The snippet names the dtype."""
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.NVFP4Config(), dtype=torch.bfloat16)
    pm = _adapter(base)
    pm.peft_config["default"].base_model_name_or_path = HUB_BASE
    out = hub.save_for_hub(pm, str(tmp_path / "push"), "me/tiny-bf16")
    card = ModelCard.load(os.path.join(out, "README.md"))
    assert 'dtype="bfloat16"' in _snippet(str(card))
    scope = _run_snippet(str(card), {HUB_BASE: tiny_dir, "me/tiny-bf16": out})
    assert torch.equal(_logits(scope["model"], IDS), _logits(pm, IDS))


def test_folder_card_from_saved_adapter_and_model(nvfp4, tmp_path):
    nvfp4.save_pretrained(tmp_path / "model")  # the base, before PEFT puts its layers in (then only the adapter saves)
    pm = _adapter(nvfp4)
    pm.save_pretrained(tmp_path / "adapter")
    card = hub.folder_card(str(tmp_path / "adapter"), "me/x")
    d = card.data  # the base (tiny_dir) is a dense checkpoint quantized on load: the folder cannot tell
    assert d.library_name == "peft" and d.base_model is None and d.quantization == {"quant_method": "unrecorded"}
    assert {"hfq", "lora", "peft"} <= set(d.tags) and "unrecorded" not in d.tags and "rank 4, alpha 8" in card.text
    # the base's quantization is not in the folder: the snippet loads it as QeRL does (NVFP4) and says so, where it
    # loaded a dense base under the adapter
    assert "does not record how the base was quantized" in card.text and "quantization_config=hfq.NVFP4Config()" in \
        _snippet(str(card))
    # PEFT's save wrote its empty template there: a push replaces it with hfq's card; hfq's own card is kept
    assert hub.is_placeholder_card(str(tmp_path / "adapter" / "README.md"))
    card.save(tmp_path / "adapter" / "README.md")
    assert not hub.is_placeholder_card(str(tmp_path / "adapter" / "README.md"))
    d = hub.folder_card(str(tmp_path / "model"), "me/y").data
    assert d.library_name == "transformers" and d.quantization["quant_method"] == "hfq_nvfp4"
    with pytest.raises(ValueError, match="adapter_config.json"):
        hub.folder_card(str(tmp_path), "me/z")


# --------------------------------------------------------------------------- QuEST and ECO / QFT
def test_quest_card_and_folder(tiny_dir, tmp_path):
    cfg = hfq.QuESTConfig(weight_bits=2, activation_bits=None)
    m = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=cfg)
    m.config._name_or_path = HUB_BASE
    out = hub.save_for_hub(m, str(tmp_path / "push"), "me/tiny-quest")
    card = ModelCard.load(os.path.join(out, "README.md"))
    d = card.data
    assert d.base_model == HUB_BASE and d.library_name == "transformers" and {"hfq", "quest", "w2"} <= set(d.tags)
    assert d.quantization["weight_bits"] == 2 and d.quantization["activation_bits"] is None
    assert "none (weight-only)" in card.text  # no tokenizer saved: the snippet takes the base model's
    assert 'AutoTokenizer.from_pretrained("hfq-test/tiny-qwen2")' in _snippet(str(card))
    from hfq.quest.linear import QuESTLinear

    scope = _run_snippet(str(card), {"me/tiny-quest": out, HUB_BASE: tiny_dir})
    assert sum(isinstance(x, QuESTLinear) for x in scope["model"].modules()) == 14
    assert torch.equal(scope["model"].model.layers[0].mlp.up_proj.weight, m.model.layers[0].mlp.up_proj.weight)
    assert "Hadamard transform" in card.text and "the trust estimator" in card.text
    # the description follows the settings: it said "Hadamard transform ... the trust estimator" whatever they were
    plain = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.QuESTConfig(
        weight_bits=2, activation_bits=None, hadamard=False, estimator="ste"))
    text = str(hub.model_card(plain, "me/tiny-quest-ste"))
    assert "Hadamard transform" not in text and "the straight-through estimator" in text and "trust" not in text


def test_eco_fine_tune_card_has_hyperparameters_and_run_metrics(tiny_dir, tmp_path):
    m = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.QFTConfig(weight_format="fp8_e4m3_row"))
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    ids = tok("12+30=42. 7+8=15. " * 4).input_ids[:32]
    ds = Dataset.from_dict({"input_ids": [ids] * 4, "labels": [ids] * 4})
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=2,
                             learning_rate=1e-3, logging_steps=1, use_cpu=True, report_to="none", save_strategy="no",
                             disable_tqdm=True)
    trainer = Trainer(model=m, args=args, train_dataset=ds,
                      optimizers=(hfq.ECOAdamW(m.parameters(), lr=1e-3), None))
    trainer.train()
    out = hub.save_for_hub(m, str(tmp_path / "push"), "me/tiny-eco", trainer=trainer, tokenizer=tok)
    card = ModelCard.load(os.path.join(out, "README.md"))
    d = card.data
    assert {"hfq", "eco", "hfq_qft", "fp8_e4m3_row"} <= set(d.tags) and d.library_name == "transformers"
    hp, metrics = d.training["hyperparameters"], d.training["metrics"]
    assert hp["optimizer"] == "ECOAdamW" and "optim" not in hp and hp["learning_rate"] == 1e-3
    assert hp["max_steps"] == 2 and "num_train_epochs" not in hp
    last_loss = [h["loss"] for h in trainer.state.log_history if "loss" in h][-1]
    assert metrics["loss"] == pytest.approx(last_loss, rel=1e-5) and metrics["global_step"] == 2
    assert "| optimizer | ECOAdamW |" in card.text and "ECO folds" in card.text
    trainer.state.save_to_json(os.path.join(out, "trainer_state.json"))  # what a Trainer checkpoint holds
    folder = hub.folder_card(out, "me/tiny-eco").data
    assert folder.training["metrics"]["loss"] == metrics["loss"] and folder.training["method"] == "eco"
    assert folder.quantization["format"] == "fp8_e4m3_row"
    scope = _run_snippet(str(card), {"me/tiny-eco": out})
    from hfq.qparam import QParam

    w = scope["model"].model.layers[1].self_attn.o_proj.weight
    assert isinstance(w, QParam) and torch.equal(w.dequantize(), m.model.layers[1].self_attn.o_proj.weight.dequantize())


def test_qft_card_without_trainer(tiny_dir):
    m = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.QFTConfig(gradient_bits=8))
    d = ModelCard(str(hub.model_card(m, "me/tiny-qft"))).data
    assert d.training["method"] == "qft" and d.quantization["format"] == "int8_dense_sparse"
    assert d.quantization["gradient_bits"] == 8 and "hyperparameters" not in d.training


def test_plain_model_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="model: .* holds no hfq layers"):
        hub.model_card(hfq.tiny.tiny_model(), "me/plain")


# --------------------------------------------------------------------------- rendering
def test_render_equals_huggingface_hub_from_template():
    fields = dict(base_model="org/base", method="qerl", model_name="m", repo_id="me/m", r=8, lora_alpha=16,
                  target_modules="q_proj", training_summary="ok", base_format="NVFP4", hparams={"learning_rate": 1e-5},
                  metrics={"reward": 0.5}, base_load="", trainer_name="QeRLGRPOTrainer", base_source="x")
    data = ModelCardData(base_model="org/base", library_name="peft", tags=["hfq", "qerl"])
    ours = hub.render("lora_adapter.md", data, **fields)
    theirs = ModelCard.from_template(data, template_path=str(hub.CARDS_DIR / "lora_adapter.md"), **fields)
    assert str(ModelCard(ours)) == str(theirs)
    assert "| learning_rate | 1e-05 |" in ours and "| reward | 0.5 |" in ours


def test_missing_fields_are_named():
    with pytest.raises(ValueError, match=r"missing fields \[.*'lora_alpha'.*'r'.*\]"):
        hub.render("lora_adapter.md", base_model="x", method="qerl", model_name="m", repo_id="me/m")


def test_every_card_kind_has_a_template_shipped_as_package_data():
    assert set(hub.TEMPLATES.values()) <= {p.name for p in (REPO / "model_cards").glob("*.md")}
    assert "hfq.model_cards = *.md" in (REPO / "setup.cfg").read_text()


# --------------------------------------------------------------------------- QeRL trainer
def test_qerl_trainer_create_model_card_writes_our_card(tiny_dir, tmp_path):
    from hfq.qerl import QeRLConfig, QeRLGRPOTrainer

    base = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.NVFP4Config(), dtype=torch.float32)
    base.config._name_or_path = HUB_BASE
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      task_type="CAUSAL_LM"))
    args = QeRLConfig(output_dir=str(tmp_path / "out"), learning_rate=1e-3, num_generations=2,
                      per_device_train_batch_size=2, max_completion_length=4, max_steps=1, logging_steps=1,
                      save_strategy="steps", save_steps=1, report_to="none", bf16=False, use_cpu=True, aqn_num_stages=2,
                      hub_model_id="me/tiny-qerl", disable_tqdm=True)
    ds = Dataset.from_list([{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}])
    trainer = QeRLGRPOTrainer(model=model, args=args, train_dataset=ds, processing_class=AutoTokenizer.from_pretrained(
        tiny_dir), reward_funcs=[lambda completions, **kw: [float(len(c)) for c in completions]])
    trainer.train()
    path = tmp_path / "out" / "README.md"
    assert "qerl" in ModelCard.load(path).data.tags  # TRL's checkpoint save called our create_model_card
    trainer.save_model()  # what push_to_hub saves before it calls create_model_card and uploads output_dir
    trainer.create_model_card(model_name="tiny-qerl", tags=["mine"])
    card = ModelCard.load(path)
    assert "fine-tuned version of" not in card.text  # TRL's generic card
    d = card.data
    assert d.base_model == HUB_BASE and d.library_name == "peft" and {"hfq", "qerl", "nvfp4", "mine"} <= set(d.tags)
    assert d.training["trainer"] == "QeRLGRPOTrainer" and d.training["hyperparameters"]["aqn_num_stages"] == 2
    assert d.training["hyperparameters"]["num_generations"] == 2
    assert "reward" in d.training["metrics"] and d.training["metrics"]["global_step"] == 1
    assert 'PeftModel.from_pretrained(base, "me/tiny-qerl")' in card.text
    assert {"adapter_model.safetensors", "tokenizer.json"} <= set(os.listdir(tmp_path / "out"))


def test_qerl_trainer_on_a_plain_model_keeps_trls_card(tiny_dir, tmp_path):
    from hfq.qerl import QeRLConfig, QeRLGRPOTrainer

    args = QeRLConfig(output_dir=str(tmp_path / "out"), num_generations=2, per_device_train_batch_size=2,
                      max_completion_length=4, max_steps=1, save_strategy="no", report_to="none", bf16=False,
                      use_cpu=True, aqn=False)
    ds = Dataset.from_list([{"prompt": "1+1=", "answer": "2"}])
    trainer = QeRLGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_dir), args=args, train_dataset=ds,
                              processing_class=AutoTokenizer.from_pretrained(tiny_dir),
                              reward_funcs=[lambda completions, **kw: [0.0] * len(completions)])
    trainer.create_model_card(model_name="plain")
    assert "fine-tuned version of" in (tmp_path / "out" / "README.md").read_text()


# --------------------------------------------------------------------------- push: fail fast, offline
def test_bad_repo_id_fails_before_anything_is_written(nvfp4, tmp_path):
    with pytest.raises(HFValidationError, match="Repo id must"):
        hub.push_to_hub(nvfp4, "bad id!!")
    with pytest.raises(HFValidationError, match="namespace/repo_name"):
        hub.save_for_hub(nvfp4, str(tmp_path / "never"), "a/b/c")
    assert not (tmp_path / "never").exists()


def test_missing_token_fails_fast_with_the_hub_error(nvfp4, no_token):
    t = time.monotonic()
    with pytest.raises(LocalTokenNotFoundError, match="no token found"):
        hub.push_to_hub(nvfp4, "me/tiny-nvfp4")
    assert time.monotonic() - t < 5


def test_cli_push_bad_repo_and_missing_token(nvfp4, tmp_path, no_token, capsys):
    from hfq.cli import main

    nvfp4.save_pretrained(tmp_path / "m")
    with pytest.raises(SystemExit, match=r"REPO 'bad id!!' is not a valid Hub repository id: Repo id must"):
        main(["push", str(tmp_path / "m"), "bad id!!"])
    with pytest.raises(SystemExit, match="no Hub token: .*no token found"):
        main(["push", str(tmp_path / "m"), "me/ok", "--private"])
    assert not (tmp_path / "m" / "README.md").exists()  # nothing touched before the checks pass


def test_cli_push_adds_the_card_then_reports_the_upload_error(nvfp4, tiny_dir, tmp_path, monkeypatch):
    import huggingface_hub.constants as c

    from hfq.cli import main

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)  # the upload itself must fail here, never reach the network
    nvfp4.save_pretrained(tmp_path / "m")
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(tmp_path / "m")
    with pytest.raises(SystemExit, match="upload to 'me/ok' failed: .*offline mode"):
        main(["push", str(tmp_path / "m"), "me/ok", "--token", "hf_not_a_real_token"])
    card = ModelCard.load(tmp_path / "m" / "README.md")
    assert card.data.library_name == "transformers" and card.data.quantization["quant_method"] == "hfq_nvfp4"
    assert 'AutoTokenizer.from_pretrained("me/ok")' in card.text  # the folder's tokenizer goes up with it
    # the same folder pushed to another repo: hfq's card names the repo it goes to, a user's own card is left alone
    with pytest.raises(SystemExit, match="upload to 'me/other' failed"):
        main(["push", str(tmp_path / "m"), "me/other", "--token", "hf_not_a_real_token"])
    card = ModelCard.load(tmp_path / "m" / "README.md")
    assert card.text.startswith("\n# other\n") and '"me/ok"' not in card.text and card.data.hfq_repo_id == "me/other"
    assert 'AutoModelForCausalLM.from_pretrained("me/other")' in card.text
    (tmp_path / "m" / "README.md").write_text("---\nlicense: mit\n---\n# mine, from_pretrained(\"me/ok\")\n")
    assert not hub.retarget_card(str(tmp_path / "m" / "README.md"), "me/third")
    assert "mine" in (tmp_path / "m" / "README.md").read_text()


def test_cli_push_base_model_reaches_the_folder_card(nvfp4, tmp_path, monkeypatch):
    """A saved model folder does not record its source (transformers 5 writes no _name_or_path into config.json), so
    every pushed folder's card said "an unrecorded checkpoint" with no base_model; `--base-model` supplies it."""
    import huggingface_hub.constants as c

    from hfq.cli import main

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    nvfp4.save_pretrained(tmp_path / "m")
    assert hub.folder_card(str(tmp_path / "m"), "me/ok").data.base_model is None
    with pytest.raises(SystemExit, match="upload to 'me/ok' failed"):
        main(["push", str(tmp_path / "m"), "me/ok", "--token", "hf_not_a_real_token", "--base-model", HUB_BASE])
    card = ModelCard.load(tmp_path / "m" / "README.md")
    assert card.data.base_model == HUB_BASE and HUB_BASE in card.text


def test_cli_push_as_a_command(tmp_path):
    r = subprocess.run([sys.executable, "-m", "hfq.cli", "push", str(tmp_path), "not a repo"], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 1 and "hfq push: REPO 'not a repo' is not a valid Hub repository id" in r.stderr
