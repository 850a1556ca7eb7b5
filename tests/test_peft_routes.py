"""The standard PEFT / TRL routes on an NVFP4 base after a plain `import hfq` (no hfq helper), with real PEFT/TRL."""
import json
import os
import warnings

import peft
import pytest
import torch
from peft import LoraConfig, PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hfq  # noqa: F401  (registers hfq_nvfp4 and the PEFT dispatch)
from hfq.nvfp4 import NVFP4Config, NVFP4Linear, NVFP4LoraLinear
from hfq.tiny import save_tiny

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny(tmp_path_factory.mktemp("m") / "qwen2", arch="qwen2"))


def _base(path, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=NVFP4Config(), dtype=dtype)


def _ids(n=2, t=12, seed=0):
    return torch.randint(4, 100, (n, t), generator=torch.Generator().manual_seed(seed))


def _randomize_lora(pm, scale=0.05, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def _nvfp4_names(model):
    return {n for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}


@pytest.mark.parametrize("targets", ["all-linear", TARGETS])
def test_plain_get_peft_model_wraps_every_nvfp4_layer(tiny, targets):
    base = _base(tiny)
    nv = _nvfp4_names(base)
    pm = peft.get_peft_model(base, LoraConfig(r=4, target_modules=targets))
    wrapped = {n.removeprefix("base_model.model.") for n, m in pm.named_modules() if isinstance(m, NVFP4LoraLinear)}
    assert wrapped == nv and len(nv) == 7 * base.config.num_hidden_layers
    assert not isinstance(pm.base_model.model.lm_head, peft.tuners.lora.LoraLayer)  # all-linear skips the head
    trainable = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    x = _ids()
    loss = pm(x, labels=x).loss
    loss.backward()
    assert all(p.grad is not None for n, p in pm.named_parameters() if "lora_A" in n)


def test_trainable_parameter_count_includes_the_nvfp4_weights(tiny):
    """print_trainable_parameters() on an NVFP4 base counts its frozen weights as the dense model's count does
    (they are buffers, which PEFT's own count skips), merged or not: the same numbers as on the bf16 base."""
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS)
    dense = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tiny), cfg)
    pm = peft.get_peft_model(_base(tiny), cfg)
    want = dense.get_nb_trainable_parameters()
    assert pm.get_nb_trainable_parameters() == want and want[1] > 4 * want[0]
    pm.merge_adapter()
    assert pm.get_nb_trainable_parameters() == want
    pm.unmerge_adapter()
    assert pm.get_nb_trainable_parameters() == want


def test_adapter_save_and_plain_peft_from_pretrained(tiny, tmp_path):
    pm = peft.get_peft_model(_base(tiny), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    _randomize_lora(pm)
    x = _ids()
    y = pm(x).logits
    pm.save_pretrained(tmp_path / "adapter")
    keys = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys)
    re = PeftModel.from_pretrained(_base(tiny), tmp_path / "adapter")
    assert sum(isinstance(m, NVFP4LoraLinear) for m in re.modules()) == len(_nvfp4_names(_base(tiny)))
    assert torch.equal(re(x).logits, y)


def test_adapter_loaded_onto_a_dense_base_says_it_was_trained_on_nvfp4(tiny, tmp_path):
    """An adapter folder records its base's path, not its quantization: AutoPeftModelForCausalLM loaded the base
    dense and the policy's outputs were silently not the trained ones. An adapter saved on an NVFP4 base now
    records it (hfq_base.json), and a load onto a base without NVFP4 layers says so; the NVFP4 load stays quiet."""
    import json
    import warnings

    pm = peft.get_peft_model(_base(tiny), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    _randomize_lora(pm)
    pm.save_pretrained(tmp_path / "adapter")
    rec = json.loads((tmp_path / "adapter" / "hfq_base.json").read_text())["quantization_config"]
    assert rec["quant_method"] == "hfq_nvfp4" and rec["format"] == "nvfp4"
    with pytest.warns(UserWarning, match=r"trained on an NVFP4 base .* quantization_config=hfq.NVFP4Config\("):
        peft.AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter"))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*trained on an NVFP4 base.*")
        re = peft.AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter"), quantization_config=NVFP4Config())
    x = _ids()
    assert torch.equal(re(x).logits, pm(x).logits)
    dense = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tiny), LoraConfig(r=4, target_modules=TARGETS))
    dense.save_pretrained(tmp_path / "dense_adapter")
    assert not (tmp_path / "dense_adapter" / "hfq_base.json").exists()  # nothing recorded for a dense base


def test_transformers_adapter_route_records_and_checks_the_nvfp4_base(tiny, tmp_path):
    """transformers' own PEFT integration (model.add_adapter -> save_pretrained, model.load_adapter) wrote no
    hfq_base.json and never read one: an adapter trained on NVFP4 loaded onto the dense base with logits 0.1 off
    and no word."""
    import json
    import warnings

    m = _base(tiny)
    if _transformers_needs_newer_peft():  # transformers >= 5.24's add_adapter asks PEFT >= 0.22 (not released yet)
        with pytest.raises(ValueError, match="PEFT"):
            m.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
        return
    m.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    for mod in m.modules():
        if hasattr(mod, "lora_B"):
            torch.nn.init.normal_(mod.lora_B["default"].weight, std=0.5)
    m.save_pretrained(tmp_path / "a")
    rec = json.loads((tmp_path / "a" / "hfq_base.json").read_text())["quantization_config"]
    assert rec["quant_method"] == "hfq_nvfp4"
    x = _ids()
    for path in (tmp_path / "a", tmp_path / "p"):
        if path.name == "p":  # PEFT's save read by transformers' load
            peft.get_peft_model(_base(tiny), LoraConfig(r=4, target_modules=TARGETS)).save_pretrained(path)
        with pytest.warns(UserWarning, match=r"trained on an NVFP4 base .* quantization_config=hfq.NVFP4Config\("):
            AutoModelForCausalLM.from_pretrained(tiny).load_adapter(str(path))
    with pytest.warns(UserWarning, match=r"trained on an NVFP4 base"):
        peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny), str(tmp_path / "a"))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*trained on an NVFP4 base.*")
        back = _base(tiny)
        back.load_adapter(str(tmp_path / "a"))
    assert torch.equal(back(x).logits, m(x).logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_merge_and_unload_keeps_model_dtype(tiny, dtype):
    pm = peft.get_peft_model(_base(tiny, dtype), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    _randomize_lora(pm)
    x = _ids()
    with torch.no_grad():
        y = pm(x).logits.float()
    merged = pm.merge_and_unload()
    lin = [m for m in merged.modules() if isinstance(m, torch.nn.Linear)]
    assert not any(isinstance(m, NVFP4Linear) for m in merged.modules())
    assert {m.weight.dtype for m in lin} == {dtype}
    assert {p.dtype for p in merged.parameters()} == {dtype}
    with torch.no_grad():
        ym = merged(x).logits.float()
    tol = 1e-4 if dtype == torch.float32 else 0.15
    assert (ym - y).abs().max() < tol * max(1.0, y.abs().max().item())
    dense = merged.dequantize()  # the config goes, the model stays usable in its dtype
    with torch.no_grad():
        assert torch.equal(dense(x).logits.float(), ym)


def test_merge_lora_bias_is_scaled(tiny):
    """q/k/v carry a bias in Qwen2: a LoRA bias merges as scale * b (scale = alpha / r = 2 here)."""
    pm = peft.get_peft_model(_base(tiny), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                     lora_bias=True))
    _randomize_lora(pm, scale=0.2)
    x = _ids()
    y = pm(x).logits
    pm.merge_adapter()
    assert torch.allclose(pm(x).logits, y, atol=1e-4)
    pm.unmerge_adapter()
    assert torch.equal(pm(x).logits, y)
    assert torch.allclose(pm.merge_and_unload()(x).logits, y, atol=1e-4)


def test_loading_base_weights_while_merged_is_refused(tiny):
    """While merged, an NVFP4LoraLinear holds its NVFP4 base aside for unmerge: base codes loaded then would reach
    no layer and the old ones would return on unmerge. Refused (strict or not); unmerged, the same load works."""
    pm = peft.get_peft_model(_base(tiny), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    _randomize_lora(pm, scale=0.2)
    other = peft.get_peft_model(_base(tiny), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    q = other.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    q.set_weight(torch.randn(q.out_features, q.in_features))
    sd = {k: v for k, v in other.state_dict().items() if "lora_" not in k}
    pm.merge_adapter()
    with pytest.raises(RuntimeError, match=r"q_proj.base_layer: NVFP4 base weights given while adapters are merged"):
        pm.load_state_dict(sd, strict=False)
    pm.unmerge_adapter()
    pm.load_state_dict(sd, strict=False)
    x = _ids()
    with pm.disable_adapter(), other.disable_adapter():
        assert torch.equal(pm(x).logits, other(x).logits)


def _transformers_needs_newer_peft() -> bool:
    """transformers' add_adapter/load_adapter check PEFT against its own MIN_PEFT_VERSION and raise below it."""
    import importlib.metadata

    from packaging import version
    from transformers.integrations.peft import MIN_PEFT_VERSION

    return version.parse(importlib.metadata.version("peft")) < version.parse(MIN_PEFT_VERSION)


def test_dispatch_is_process_wide_and_refuses_what_it_cannot_do(tiny):
    from hfq.nvfp4.peft_lora import register_peft_dispatch

    assert register_peft_dispatch() is False  # installed once, on `import hfq`
    legacy = peft.get_peft_model(_base(tiny), hfq.nvfp4.register_lora(LoraConfig(r=2, target_modules=["q_proj"])))
    assert isinstance(legacy.base_model.model.model.layers[0].self_attn.q_proj, NVFP4LoraLinear)
    m = _base(tiny)  # transformers' own PEFT integration goes through the same dispatch
    if _transformers_needs_newer_peft():  # transformers >= 5.24 asks PEFT >= 0.22 (not released yet) for it
        with pytest.raises(ValueError, match="version of PEFT"):
            m.add_adapter(LoraConfig(r=2, target_modules="all-linear"))
    else:
        m.add_adapter(LoraConfig(r=2, target_modules="all-linear"))
        assert sum(isinstance(x, NVFP4LoraLinear) for x in m.modules()) == len(_nvfp4_names(_base(tiny)))
    with pytest.raises(ValueError, match="rewrites the base weight"):
        peft.get_peft_model(_base(tiny), LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights="pissa"))
    with pytest.raises(ValueError, match="plain LoRA only"):
        peft.get_peft_model(_base(tiny), LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match="not supported"):  # other PEFT methods refuse, never wrap silently
        peft.get_peft_model(_base(tiny), peft.IA3Config(target_modules=["q_proj"], feedforward_modules=[]))


def test_merge_and_requantize_reports_survival_and_warns(tiny):
    from hfq.nvfp4 import merge_and_requantize

    pm = peft.get_peft_model(_base(tiny), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    _randomize_lora(pm, scale=1e-3)  # a delta far below the NVFP4 step: re-quantization erases it
    with pytest.warns(UserWarning, match="lost most of the fine-tune"):
        nv, report = merge_and_requantize(pm)
    assert set(report) == _nvfp4_names(nv)
    assert report.overall["delta_error_ratio"] > 0.9 and report.overall["delta_kept"] < 0.1
    assert report.overall["layers_erased"] > 0 and "delta kept" in report.summary()

    pm = peft.get_peft_model(_base(tiny), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    _randomize_lora(pm, scale=0.1)  # a large delta survives
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nv, report = merge_and_requantize(pm)
    assert report.overall["delta_kept"] > 0.8 and report.overall["delta_error_ratio"] < 0.5
    for r in report.values():
        assert 0 < r["requant_rel_error"] < 0.13 and r["delta_rel_norm"] > 0
    with pytest.raises(ValueError, match="warn_ratio"):
        merge_and_requantize(pm, warn_ratio=0)


def test_export_with_adapter_side_by_side(tiny, tmp_path):
    from hfq.nvfp4 import export_with_adapter

    pm = peft.get_peft_model(_base(tiny), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    _randomize_lora(pm)
    x = _ids()
    y = pm(x).logits
    paths = export_with_adapter(pm, str(tmp_path / "out"))
    assert paths == {"base": str(tmp_path / "out" / "base"), "adapter": str(tmp_path / "out" / "adapter")}
    assert torch.equal(pm(x).logits, y)  # the policy is untouched
    sd = load_file(os.path.join(paths["base"], "model.safetensors"))
    assert not any("lora_" in k or "base_layer" in k for k in sd)
    q = pm.base_model.model.model.layers[1].mlp.down_proj.base_layer
    assert torch.equal(sd["model.layers.1.mlp.down_proj.weight_packed"], q.weight_packed)  # the codes trained on
    cfg = json.load(open(os.path.join(paths["base"], "config.json")))["quantization_config"]
    assert cfg["format"] == "nvfp4-pack-quantized"
    re = PeftModel.from_pretrained(_base(tiny), paths["adapter"])
    assert torch.equal(re(x).logits, y)
    pm.merge_adapter()
    with pytest.raises(ValueError, match="unmerge"):
        export_with_adapter(pm, str(tmp_path / "again"))


def test_export_with_adapter_refuses_lora_on_moe_experts_and_leaves_the_model_whole(tmp_path):
    """LoRA 'all-linear' on an MoE model wraps the fused experts (3-D parameters) in nested ParamWrappers, which
    vLLM's LoRA does not serve: refused before anything is swapped (the swap used to leave a module cycle: every
    later forward hung). With LoRA on the attention linears the base's export refuses the MoE model, and the
    wrappers are back in place afterwards."""
    from transformers import AutoConfig

    from hfq.nvfp4 import export_with_adapter

    cfg = AutoConfig.for_model("mixtral", vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                               num_key_value_heads=1, intermediate_size=64, num_local_experts=4,
                               num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "mixtral")

    def load():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the experts stay dense: announced (test_user_edges)
            return AutoModelForCausalLM.from_pretrained(tmp_path / "mixtral", quantization_config=NVFP4Config())

    x = _ids()
    pm = peft.get_peft_model(load(), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    y = pm(x).logits
    with pytest.raises(ValueError, match=r"LoRA on parameters that are no linear layers .*mlp\.experts"):
        export_with_adapter(pm, str(tmp_path / "out"))
    assert torch.equal(pm(x).logits, y) and len(pm.state_dict())
    pm = peft.get_peft_model(load(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    _randomize_lora(pm)
    y = pm(x).logits
    with pytest.raises(ValueError, match="hold weights outside nn.Linear"):  # the base's own export refuses MoE
        export_with_adapter(pm, str(tmp_path / "attn"))
    assert torch.equal(pm(x).logits, y) and isinstance(pm.base_model.model.model.layers[0].self_attn.q_proj,
                                                         NVFP4LoraLinear)


def _grpo_args(cls, tmp_path, **kw):
    return cls(output_dir=str(tmp_path / "out"), learning_rate=1e-2, num_generations=4, per_device_train_batch_size=4,
               max_completion_length=6, max_steps=1, logging_steps=1, save_strategy="no", report_to="none",
               bf16=False, use_cpu=True, **kw)


def _digit_reward(completions, **kwargs):
    return [float(sum(ch.isdigit() for ch in c)) + 0.1 * len(c) for c in completions]


@pytest.mark.parametrize("trainer_name", ["GRPOTrainer", "QeRLGRPOTrainer"])
def test_trainers_take_peft_config_on_nvfp4(tiny_dir, tmp_path, trainer_name):
    """The README's route: the trainer gets the NVFP4 base and a LoraConfig(target_modules="all-linear")."""
    pytest.importorskip("datasets", reason="the device image has no datasets/trl wheels; CI installs them")
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from hfq.qerl import QeRLConfig, QeRLGRPOTrainer
    from hfq.qerl.data import make_dataset

    cls, cfg_cls = ((GRPOTrainer, GRPOConfig) if trainer_name == "GRPOTrainer" else (QeRLGRPOTrainer, QeRLConfig))
    ds = Dataset.from_list([{"prompt": r["prompt"]} for r in make_dataset(8, seed=3)])
    trainer = cls(model=_base(tiny_dir), reward_funcs=[_digit_reward], args=_grpo_args(cfg_cls, tmp_path),
                  train_dataset=ds, processing_class=AutoTokenizer.from_pretrained(tiny_dir),
                  peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    layers = [m for m in trainer.model.modules() if isinstance(m, NVFP4LoraLinear)]
    assert len(layers) == 7 * 2
    codes = layers[0].base_layer.weight_packed.clone()
    trainer.train()
    assert any(p.abs().sum() > 0 for n, p in trainer.model.named_parameters() if "lora_B" in n)  # LoRA trained
    assert torch.equal(layers[0].base_layer.weight_packed, codes)  # the NVFP4 base is frozen


def test_prepare_model_for_kbit_training_then_trainer(tiny, tmp_path):
    """The QLoRA recipe as users write it: peft.prepare_model_for_kbit_training, get_peft_model, Trainer: the
    adapters train, the NVFP4 codes stay, and the losses are those without it. PEFT turns on gradient
    checkpointing only for the methods it knows, so that is the user's call (docs/nvfp4.md): checked both ways."""
    from transformers import Trainer, TrainingArguments

    def run(kbit, gc=False):
        torch.manual_seed(0)
        m = _base(tiny)
        if kbit:
            m = peft.prepare_model_for_kbit_training(m)
            assert not m.is_gradient_checkpointing and not any(p.requires_grad for p in m.parameters())
        pm = peft.get_peft_model(m, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        layer = next(x for x in pm.modules() if isinstance(x, NVFP4LoraLinear))
        codes = layer.base_layer.weight_packed.clone()
        data = [{"input_ids": ids, "labels": ids} for ids in _ids(8, 12, seed=5)]
        args = TrainingArguments(str(tmp_path / f"{kbit}{gc}"), max_steps=3, per_device_train_batch_size=4,
                                 learning_rate=1e-2, logging_steps=1, report_to=[], use_cpu=True, seed=0,
                                 disable_tqdm=True, save_strategy="no", gradient_checkpointing=gc)
        tr = Trainer(model=pm, args=args, train_dataset=data)
        tr.train()
        assert pm.base_model.model.is_gradient_checkpointing == gc
        assert torch.equal(layer.base_layer.weight_packed, codes)
        assert any(p.abs().sum() > 0 for n, p in pm.named_parameters() if "lora_B" in n)
        return [h["loss"] for h in tr.state.log_history if "loss" in h]

    plain = run(False)
    assert len(plain) == 3 and run(True) == plain and run(True, gc=True) == plain


def test_cli_export_adapter_writes_base_and_adapter(tiny, tmp_path):
    from hfq.cli import main

    ckpt, adapter, out = tmp_path / "ckpt", tmp_path / "adapter", tmp_path / "served"
    base = _base(tiny)
    base.save_pretrained(ckpt)  # the hfq NVFP4 checkpoint (`hfq quantize`) the adapter is trained on
    pm = peft.get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    _randomize_lora(pm)
    pm.save_pretrained(adapter)
    x = _ids()
    y = pm(x).logits
    assert main(["export", str(ckpt), "--adapter", str(adapter), "--out", str(out), "--device", "cpu"]) == 0
    cfg = json.load(open(out / "base" / "config.json"))["quantization_config"]
    assert cfg["format"] == "nvfp4-pack-quantized"
    re = PeftModel.from_pretrained(_base(tiny), str(out / "adapter"))
    assert torch.equal(re(x).logits, y)


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj"]])
def test_save_after_merge_and_unload_refused_until_dequantized(tiny, tmp_path, targets):
    """PEFT's merge_and_unload leaves dense layers under an hfq_nvfp4 config: save_pretrained refuses (such a
    checkpoint reloaded as 'corrupt', or not at all), and after model.dequantize() the dense save reloads exactly."""
    pm = peft.get_peft_model(_base(tiny), LoraConfig(r=4, target_modules=targets))
    _randomize_lora(pm)
    merged = pm.merge_and_unload()
    x = _ids()
    with torch.no_grad():
        want = merged(x).logits
    with pytest.raises(ValueError, match=r"no longer hfq_nvfp4 layers .*merge_and_unload.*model\.dequantize\(\)"):
        merged.save_pretrained(tmp_path / "refused")
    assert not (tmp_path / "refused" / "config.json").exists()  # refused before anything was written
    merged.dequantize()
    merged.save_pretrained(tmp_path / "dense")
    assert "quantization_config" not in json.load(open(tmp_path / "dense" / "config.json"))
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "dense")
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, want)


def test_base_save_with_lora_wrappers_in_place_is_refused_with_what_to_do(tiny, tmp_path):
    """Saving the inner model of a PEFT model would write PEFT's base_layer/lora_* keys that no load reads back (hfq's
    load stops on the missing codes): refused before writing, naming the adapter save, and unmerge_adapter() when
    merged. transformers' own adapter integration (add_adapter) saves the adapter alone and is not refused."""
    pm = peft.get_peft_model(_base(tiny), LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"carry PEFT adapter layers \(e.g. model.layers.0.self_attn.q_proj\).*"
                                         r"peft_model.save_pretrained"):
        pm.base_model.model.save_pretrained(tmp_path / "wrapped")
    pm.merge_adapter()
    with pytest.raises(ValueError, match="merged into it by merge_adapter.*after unmerge_adapter"):
        pm.base_model.model.save_pretrained(tmp_path / "wrapped")
    assert not (tmp_path / "wrapped" / "model.safetensors").exists()
    pm.unmerge_adapter()
    pm.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    if _transformers_needs_newer_peft():  # transformers >= 5.24's add_adapter asks PEFT >= 0.22 (not released yet)
        return
    base = _base(tiny)
    base.add_adapter(LoraConfig(r=4, target_modules=["q_proj"]))
    base.save_pretrained(tmp_path / "tf_adapter")
    assert (tmp_path / "tf_adapter" / "adapter_model.safetensors").exists()


@pytest.mark.parametrize("scales", ["amax", "mse"])
def test_merge_and_requantize_of_a_zero_delta_keeps_the_codes(tiny, scales):
    """An untrained adapter (lora_B = 0) merges to the very base codes, also on an scales="mse" base (re-quantizing
    its dequantized weight searched another global scale and moved up to 2% of the weights); layers that are
    re-quantized keep the base's scale rule."""
    base = AutoModelForCausalLM.from_pretrained(tiny, quantization_config=NVFP4Config(scales=scales))
    before = {n: b.clone() for n, b in base.named_buffers()}
    x = _ids()
    with torch.no_grad():
        want = base(x).logits
    pm = peft.get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    merged, report = hfq.nvfp4.merge_and_requantize(pm)
    assert report.overall["delta_error_ratio"] == 0.0
    assert all(torch.equal(b, before[n]) for n, b in merged.named_buffers())
    with torch.no_grad():
        assert torch.equal(merged(x).logits, want)
    pm = peft.get_peft_model(merged, LoraConfig(r=4, target_modules=["q_proj"]))
    _randomize_lora(pm)
    merged, _ = hfq.nvfp4.merge_and_requantize(pm)
    assert {m.scale_rule for m in merged.modules() if isinstance(m, NVFP4Linear)} == {scales}


def _dense_copy(model):
    """The model with every NVFP4Linear swapped for an nn.Linear holding its dequantized weight (the reference)."""
    import copy

    ref = copy.deepcopy(model)
    for name, mod in list(ref.named_modules()):
        if isinstance(mod, NVFP4Linear):
            lin = torch.nn.Linear(mod.in_features, mod.out_features, mod.bias is not None)
            lin.weight.data = mod.dequantize(torch.float32)
            if mod.bias is not None:
                lin.bias.data = mod.bias.data.clone()
            ref.set_submodule(name, lin)
    return ref


def test_merging_one_adapter_leaves_the_other_active_adapter_alone(tiny):
    """merge_adapter(["b"]) where "b" targets q_proj only: the other layers stay unmerged and keep computing the
    active "default" adapter, as PEFT's own Linear does on a dense model (same logits, still trainable)."""
    x = _ids()
    outs = []
    for base in (_base(tiny), _dense_copy(_base(tiny))):
        pm = peft.get_peft_model(base, LoraConfig(r=4, target_modules=TARGETS))
        pm.add_adapter("b", LoraConfig(r=4, target_modules=["q_proj"]))
        _randomize_lora(pm)
        pm.base_model.merge_adapter(["b"])
        k = pm.base_model.model.model.layers[0].self_attn.k_proj
        assert k.merged_adapters == [] and not k.merged
        loss = pm(x, labels=x).loss
        assert loss.requires_grad
        with torch.no_grad():
            outs.append(pm(x).logits)
    assert (outs[0] - outs[1]).abs().max() < 1e-4


def test_modules_to_save_holding_nvfp4_layers_is_refused(tiny):
    """PEFT's trainable copy of an NVFP4Linear (or of a module holding some) would train none of its weights."""
    for mts in (["down_proj"], ["mlp"]):
        with pytest.raises(ValueError, match="modules_to_save.*NVFP4Linear.*target_modules"):
            peft.get_peft_model(_base(tiny), LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=mts))
    pm = peft.get_peft_model(_base(tiny), LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    assert any("modules_to_save" in n and p.requires_grad for n, p in pm.named_parameters())


@pytest.mark.parametrize("cfg", [peft.IA3Config(target_modules="all-linear", feedforward_modules=[]),
                                 peft.LoHaConfig(target_modules="all-linear")])
def test_all_linear_with_a_method_other_than_lora_is_refused_on_nvfp4(tiny, tmp_path, cfg):
    """hfq supports LoRA only on NVFP4 layers: "all-linear" with another PEFT method would adapt the dense linears
    alone (here down_proj is kept dense), silently skipping every NVFP4 layer."""
    base = AutoModelForCausalLM.from_pretrained(tiny, quantization_config=NVFP4Config(
        modules_to_not_convert=["lm_head", "down_proj"]))
    with pytest.raises(ValueError, match=f"all-linear' with {cfg.peft_type.value}.*NVFP4Linear.*LoRA only"):
        peft.get_peft_model(base, cfg)


def test_export_with_adapter_writes_the_active_named_adapter(tiny, tmp_path):
    """A named adapter lands where PEFT saves it (adapter/NAME), and the path returned is that folder; only the
    active adapter is written; two active adapters and transformers' own adapter integration are refused clearly."""
    from hfq.nvfp4 import export_with_adapter, merge_and_requantize

    pm = peft.get_peft_model(_base(tiny), LoraConfig(r=4, target_modules=["q_proj"]), adapter_name="sft")
    pm.add_adapter("other", LoraConfig(r=4, target_modules=["v_proj"]))
    _randomize_lora(pm)
    pm.set_adapter("other")
    paths = export_with_adapter(pm, str(tmp_path / "out"))
    assert paths["adapter"] == str(tmp_path / "out" / "adapter" / "other")
    assert json.load(open(os.path.join(paths["adapter"], "adapter_config.json")))["target_modules"] == ["v_proj"]
    assert not (tmp_path / "out" / "adapter" / "sft").exists()
    re = PeftModel.from_pretrained(_base(tiny), paths["adapter"])
    x = _ids()
    with torch.no_grad():
        assert torch.equal(re(x).logits, pm(x).logits)
    pm.base_model.set_adapter(["sft", "other"])
    with pytest.raises(ValueError, match="2 adapters are active"):
        export_with_adapter(pm, str(tmp_path / "two"))
    base = _base(tiny)
    base.load_adapter(paths["adapter"])
    for fn in (export_with_adapter, merge_and_requantize):
        with pytest.raises(ValueError, match="transformers' load_adapter/add_adapter.*PeftModel.from_pretrained"):
            fn(base, *([str(tmp_path / "tf")] if fn is export_with_adapter else []))


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_merge_keeps_a_trainable_base_bias_the_one_that_trains(tiny, tmp_path, bias):
    """bias="all"/"lora_only" make the base biases trainable: while merged, the dense stand-in uses that same bias
    parameter (counts and gradients as PEFT's own merge), and the kept NVFP4 base adds no parameters or state keys."""
    cfg = LoraConfig(r=4, target_modules=TARGETS, bias=bias)
    dense = peft.get_peft_model(_dense_copy(_base(tiny)), cfg)
    pm = peft.get_peft_model(_base(tiny), cfg)
    want = dense.get_nb_trainable_parameters()
    pm.merge_adapter()
    assert pm.get_nb_trainable_parameters() == want
    q = pm.base_model.model.model.layers[0].self_attn.q_proj
    kept = q._nvfp4_base
    assert isinstance(kept, NVFP4Linear) and q.base_layer.bias is kept.bias and kept.bias.requires_grad
    assert not any("_nvfp4_base" in n for n in pm.state_dict())
    x = _ids()
    pm(x, labels=x).loss.backward()
    assert kept.bias.grad is not None and kept.bias.grad.abs().sum() > 0
    pm.save_pretrained(tmp_path / "a")
    keys = load_file(tmp_path / "a" / "adapter_model.safetensors")
    assert not any("_nvfp4_base" in k for k in keys) and any(k.endswith("q_proj.base_layer.bias") for k in keys)
    pm.unmerge_adapter()
    assert q.base_layer is kept and q._nvfp4_base is None and pm.get_nb_trainable_parameters() == want


def test_hub_adapter_base_record_is_read_at_the_revision_and_cache_loaded(tiny, tmp_path):
    """The base record of a Hub adapter was fetched from `main` whatever revision the load asked for, and without
    its cache_dir / token / local_files_only: a dense adapter at a branch got main's NVFP4 warning (and an
    NVFP4-trained one at a branch lost it), and a local_files_only load still asked the Hub (audit 18f F1). A
    local Hub cache stands in for the Hub: main holds an adapter with an NVFP4 record, branch dense-v1 one without."""
    import json
    import warnings

    root = tmp_path / "hub" / "models--someorg--lora-adapter"
    for sha, ref, nvfp4 in (("a" * 40, "main", True), ("b" * 40, "dense-v1", False)):
        torch.manual_seed(0)
        pm = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tiny),
                                 LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
        pm.save_pretrained(root / "snapshots" / sha)
        if nvfp4:
            (root / "snapshots" / sha / "hfq_base.json").write_text(
                json.dumps({"quantization_config": {"quant_method": "hfq_nvfp4", "format": "nvfp4"}}))
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / ref).write_text(sha)
    hub = {"cache_dir": str(tmp_path / "hub"), "local_files_only": True}
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*trained on an NVFP4 base.*")
        peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny), "someorg/lora-adapter",
                                       revision="dense-v1", **hub)
    with pytest.warns(UserWarning, match=r"trained on an NVFP4 base"):
        peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny), "someorg/lora-adapter", **hub)
    if not _transformers_needs_newer_peft():  # transformers >= 5.24 asks PEFT >= 0.22 (not released yet)
        with pytest.warns(UserWarning, match=r"trained on an NVFP4 base"):  # transformers' route, adapter_kwargs
            AutoModelForCausalLM.from_pretrained(tiny).load_adapter("someorg/lora-adapter", adapter_kwargs=hub)


def test_an_hfq_models_backbone_saves_as_before(tiny, tmp_path):
    """A backbone (model.model) holds the quantized layers but not the hf_quantizer: its save_pretrained is not the
    dense model under an hfq config that save_pretrained refuses (audit 18f F2), and reloads equal."""
    from transformers import AutoModel

    import hfq

    m = AutoModelForCausalLM.from_pretrained(tiny, quantization_config=hfq.QuESTConfig())
    m.model.save_pretrained(tmp_path)
    x = _ids()
    with torch.no_grad():
        assert torch.equal(AutoModel.from_pretrained(tmp_path)(x).last_hidden_state, m.model(x).last_hidden_state)
