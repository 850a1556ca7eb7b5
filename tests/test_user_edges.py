"""No silent no-op at conversion: what a method leaves unconverted is warned about (or refused), non-finite
weights are refused by every method, options a format ignores are announced, int4_group fits any width, and a
checkpoint whose config does not match its tensors says what it holds; a quantized lm_head refuses
resize_token_embeddings before anything changes."""
import json
import os
import re
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import hfq
from hfq.nvfp4 import NVFP4Linear
from hfq.qparam import QLinear
from hfq.quest import QuESTLinear
from hfq.tiny import save_tiny

CONFIGS = {"nvfp4": hfq.NVFP4Config, "quest": hfq.QuESTConfig, "qft": hfq.QFTConfig}
LAYERS = {"nvfp4": NVFP4Linear, "quest": QuESTLinear, "qft": QLinear}


def test_nothing_converted_is_refused_naming_layers_and_strict(tmp_path):
    d = save_tiny(tmp_path / "odd", arch="qwen2", hidden=40, heads=2, kv_heads=1, intermediate=72)
    with pytest.raises(ValueError, match=r"hfq_nvfp4: no layer was converted.*q_proj: in_features=40 not a "
                                         r"multiple of block size 16.*strict=True"):
        AutoModelForCausalLM.from_pretrained(d, quantization_config=hfq.NVFP4Config())


def test_partial_conversion_warns_naming_the_layers(tmp_path):
    d = save_tiny(tmp_path / "odd", arch="qwen2", intermediate=72)  # only down_proj (in 72) misfits
    with pytest.warns(UserWarning, match=r"2 of 14 layers left unquantized: model\.layers\.0\.mlp\.down_proj"):
        m = AutoModelForCausalLM.from_pretrained(d, quantization_config=hfq.NVFP4Config())
    assert m.hfq_quantization_report["skipped"]["model.layers.1.mlp.down_proj"].startswith("in_features=72")
    assert m.hfq_quantization_report["skipped"]["lm_head"] == "modules_to_not_convert"


def _tiny_mixtral(path):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("mixtral", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                               num_key_value_heads=1, intermediate_size=64, num_local_experts=4,
                               num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_fused_moe_experts_left_dense_are_announced(method, tmp_path):
    """transformers 5 keeps MoE experts as 3-D parameters, no nn.Linear: they used to stay in full precision with
    no word, most of an MoE model's weights. Now a warning and the report name them (strict=True refuses), the
    routers are reported as kept in full precision, and modules_to_not_convert says it is meant."""
    d = _tiny_mixtral(tmp_path / "mixtral")
    with pytest.warns(UserWarning, match=r"2 of 10 layers left unquantized: model\.layers\.0\.mlp\.experts: "
                                         r"MixtralExperts holds weight tensors \['gate_up_proj', 'down_proj'\]"):
        m = AutoModelForCausalLM.from_pretrained(d, quantization_config=CONFIGS[method]())
    skipped = m.hfq_quantization_report["skipped"]
    assert skipped["model.layers.1.mlp.gate"].startswith("MoE router")
    with pytest.raises(ValueError, match=r"cannot be converted \(strict=True\): model\.layers\.0\.mlp\.experts"):
        AutoModelForCausalLM.from_pretrained(d, quantization_config=CONFIGS[method](strict=True))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*left unquantized.*")
        m = AutoModelForCausalLM.from_pretrained(d, quantization_config=CONFIGS[method](
            modules_to_not_convert=["lm_head", "experts"]))
    assert m.hfq_quantization_report["skipped"]["model.layers.0.mlp.experts"] == "modules_to_not_convert"


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_a_layer_kind_hfq_does_not_convert_is_named(method, tmp_path):
    """GPT-2's projections are transformers' Conv1D, not nn.Linear: nothing to convert is an error saying so."""
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32)).save_pretrained(
        tmp_path / "gpt2")
    with pytest.raises(ValueError, match=r"no layer was converted.*attn\.c_attn: Conv1D is not an nn\.Linear"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2", quantization_config=CONFIGS[method]())


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_every_method_reports_what_it_converted(method, tiny_dir):
    m = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=CONFIGS[method]())
    rep = m.hfq_quantization_report
    assert len(rep["quantized"]) == 14 and all(isinstance(m.get_submodule(n), LAYERS[method]) for n in rep["quantized"])
    assert rep["skipped"] == {"lm_head": "modules_to_not_convert"}


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_every_method_refuses_non_finite_weights_naming_the_layer(method, tiny_dir, tmp_path):
    sd = load_file(os.path.join(tiny_dir, "model.safetensors"))
    sd["model.layers.1.mlp.up_proj.weight"][3, 7] = float("nan")
    d = tmp_path / "nan"
    d.mkdir()
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    for f in ("config.json", "generation_config.json"):
        if os.path.exists(os.path.join(tiny_dir, f)):
            (d / f).write_text(open(os.path.join(tiny_dir, f)).read())
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj.*NaN/Inf"):
        AutoModelForCausalLM.from_pretrained(d, quantization_config=CONFIGS[method]())


NVFP4_BAD_SCALES = {"global_nan": ("weight_global_scale", lambda t: torch.full_like(t, float("nan")), "NaN/Inf"),
                    "global_zero": ("weight_global_scale", torch.zeros_like, "do not decode.*= 0.0"),
                    "global_inf": ("weight_global_scale", lambda t: torch.full_like(t, float("inf")), "NaN/Inf"),
                    "block_nan": ("weight_scale", lambda t: (t.view(torch.uint8) | 0x7F).view(t.dtype), "NaN/Inf")}


@pytest.mark.parametrize("method, case", [("nvfp4", c) for c in NVFP4_BAD_SCALES] + [("qft", "scale_nan"),
                                                                                    ("quest", "master_nan")])
def test_every_method_refuses_a_saved_checkpoint_with_corrupt_tensors(method, case, tiny_dir, tmp_path):
    """A pre-quantized checkpoint whose quantized tensors do not decode (NaN/Inf, a zero NVFP4 global scale) is
    refused naming the tensor, instead of loading a model that outputs NaN or a zeroed layer."""
    layer = "model.layers.1.mlp.up_proj"
    AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=CONFIGS[method]()).save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    if method == "nvfp4":
        key, corrupt, msg = NVFP4_BAD_SCALES[case]
        key = f"{layer}.{key}"
        sd[key] = corrupt(sd[key])
    else:
        key = next(k for k in sd if k.startswith(layer) and sd[k].is_floating_point() and sd[k].numel() > 1)
        sd[key] = sd[key].clone()
        sd[key].view(-1)[0] = float("nan")
        msg = "NaN/Inf"
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as err:
        AutoModelForCausalLM.from_pretrained(tmp_path)
    assert key in str(err.value) and re.search(msg, str(err.value))


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_a_config_edited_after_construction_is_checked_and_not_shared(method, tiny_dir):
    """Fields assigned after the config was built skip its validation: the quantizer validates its own copy (a bad
    value is the field's ValueError), and later edits of the caller's object reach no model built with it."""
    cfg = CONFIGS[method]()
    field, bad = {"nvfp4": ("scales", "MSE"), "quest": ("weight_bits", 9), "qft": ("weight_format", "int3")}[method]
    good = getattr(cfg, field)
    setattr(cfg, field, bad)
    with pytest.raises(ValueError, match=field):
        AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=cfg)
    setattr(cfg, field, good)
    m = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=cfg)
    setattr(cfg, field, bad)
    assert getattr(m.config.quantization_config, field) == good
    if method == "quest":
        cfg = hfq.QuESTConfig(weight_bits=4)
        built = hfq.quest.quantize_model(AutoModelForCausalLM.from_pretrained(tiny_dir), cfg)
        cfg.weight_bits = 2
        assert built.config.quantization_config.weight_bits == 4
        assert {(m.spec.wbits, m.config.weight_bits) for m in built.modules() if isinstance(m, QuESTLinear)} == {(4, 4)}


def test_options_the_format_ignores_are_announced():
    """Each warning names the caller's line (this file), not the config's internals."""
    with pytest.warns(UserWarning, match=r"group_size=64 has no effect: weight_format='fp8_e4m3_row'") as rec:
        hfq.QFTConfig(weight_format="fp8_e4m3_row", group_size=64)
    with pytest.warns(UserWarning, match=r"outlier_fraction=0\.05 has no effect") as rec2:
        hfq.QFTConfig(weight_format="int4_tensor", outlier_fraction=0.05)
    with pytest.warns(UserWarning, match=r"trust_scale=1\.5 has no effect") as rec3:
        hfq.QuESTConfig(weight_bits=4, activation_bits=4, trust_scale=1.5)
    with pytest.warns(UserWarning, match=r"hadamard_block_size=64 has no effect") as rec4:
        hfq.QuESTConfig(hadamard=False, hadamard_block_size=64)
    for r in (rec, rec2, rec3, rec4):
        assert {w.filename for w in r if "has no effect" in str(w.message)} == {__file__}


def test_int4_group_default_fits_the_width_and_says_which(tmp_path):
    d = save_tiny(tmp_path / "w48", arch="llama", hidden=48, heads=2, kv_heads=1, intermediate=160)
    with pytest.warns(UserWarning, match=r"in_features 48 is not a multiple of 128; using group_size 48"):
        m = AutoModelForCausalLM.from_pretrained(d, quantization_config=hfq.QFTConfig(weight_format="int4_group"))
    assert m.model.layers[0].mlp.down_proj.weight_meta["group_size"] == 80  # 160: largest divisor below 128
    assert m.model.layers[0].self_attn.q_proj.weight_meta["group_size"] == 48
    m.save_pretrained(tmp_path / "saved")
    re = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    x = torch.randint(3, 60, (1, 8))
    assert torch.equal(re(x).logits, m(x).logits)


@pytest.mark.real_model
def test_int4_group_default_loads_smollm2(smollm2):
    """SmolLM2's width 576 is not a multiple of 128: the default picks 96 (and 128 for the MLP's 1536)."""
    with pytest.warns(UserWarning, match="in_features 576 is not a multiple of 128; using group_size 96"):
        m = AutoModelForCausalLM.from_pretrained(smollm2, quantization_config=hfq.QFTConfig(weight_format="int4_group"))
    assert m.model.layers[0].self_attn.q_proj.weight_meta["group_size"] == 96
    assert m.model.layers[0].mlp.down_proj.weight_meta["group_size"] == 128
    ids = torch.tensor([[1, 504, 3458, 314]])
    assert torch.isfinite(m(ids).logits).all()


def _saved(tmp_path, tiny_dir, cfg):
    out = tmp_path / "ckpt"
    AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=cfg).save_pretrained(out)
    return out


def test_config_of_another_method_names_both(tiny_dir, tmp_path):
    out = _saved(tmp_path, tiny_dir, hfq.NVFP4Config())
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "hfq_qft"  # fields stay NVFP4's
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"quant_method 'hfq_qft' but has fields \['compute_dtype', 'format', 'scales'\]"
                                         r".*fields of hfq_nvfp4"):
        AutoModelForCausalLM.from_pretrained(out)


@pytest.mark.parametrize("held,asked", [("nvfp4", "qft"), ("qft", "quest"), ("quest", "nvfp4")])
def test_tensors_of_another_method_name_what_they_hold(held, asked, tiny_dir, tmp_path):
    kw = {"save_format": "codes"} if held == "quest" else {}
    out = _saved(tmp_path, tiny_dir, CONFIGS[held](**kw))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = CONFIGS[asked]().to_dict()
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"holds hfq_{held} tensors .* asks for hfq_{asked}"):
        AutoModelForCausalLM.from_pretrained(out)


def test_qerl_config_turns_bf16_on_only_where_the_device_has_it(tmp_path):
    from transformers.utils import is_torch_bf16_gpu_available

    from hfq.qerl import QeRLConfig

    has = is_torch_bf16_gpu_available()
    assert QeRLConfig(output_dir=str(tmp_path)).bf16 is has
    assert QeRLConfig.paper_preset("gsm8k", output_dir=str(tmp_path)).bf16 is has
    assert QeRLConfig(output_dir=str(tmp_path), use_cpu=True).bf16 is False
    assert QeRLConfig(output_dir=str(tmp_path), bf16=False).bf16 is False  # an explicit choice is kept


def test_nvfp4_model_pickles_and_deepcopies_after_calls(tmp_path, monkeypatch):
    """torch.save(model) (a whole-module pickle, as multiprocessing sends one) and copy.deepcopy (TRL's reference
    model) work after NVFP4 calls made the layers' per-shape plans: the plans, closures over the layer's tensors,
    stay behind and the copy makes its own, giving the same logits."""
    import copy
    import io

    from hfq_kernels._settings import SETTINGS

    monkeypatch.setattr(SETTINGS, "plan_on_cpu", True)  # the eager plan route GPUs take, here under the interpreter
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    m = AutoModelForCausalLM.from_pretrained(save_tiny(tmp_path / "m"), quantization_config=hfq.NVFP4Config()).to(dev)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0)).to(dev)
    with torch.no_grad():
        ref = m(ids).logits
    layers = [mod for mod in m.modules() if isinstance(mod, NVFP4Linear)]
    assert layers and all("_hfq_plans" in lay.__dict__ for lay in layers)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    copies = {"pickled": torch.load(buf, weights_only=False), "deepcopy": copy.deepcopy(m)}
    for how, c in copies.items():
        fresh = [mod for mod in c.modules() if isinstance(mod, NVFP4Linear)]
        assert not any("_hfq_plans" in lay.__dict__ for lay in fresh), how
        with torch.no_grad():
            assert torch.equal(c(ids).logits, ref), how
        assert all("_hfq_plans" in lay.__dict__ for lay in fresh), how
    assert all("_hfq_plans" in lay.__dict__ for lay in layers)  # the original keeps its own


def test_quest_codes_checkpoint_refuses_training_and_tied_heads_refuse_codes(tiny_dir, tmp_path):
    """A save_format='codes' checkpoint is inference-only: a training forward (Trainer's, model.train() with grad)
    is refused, where it used to run with no gradient reaching any QuEST layer; eval and no_grad forwards run. A
    quantized lm_head tied to the embeddings cannot be stored as codes (the reload failed deep in transformers)."""
    from transformers import AutoConfig

    cfg = hfq.QuESTConfig(save_format="codes")
    AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=cfg).save_pretrained(tmp_path / "codes")
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "codes")
    ids = torch.randint(4, 90, (2, 8))
    m(ids)  # from_pretrained gives eval mode
    m.train()
    with torch.no_grad():
        m(ids)
    with pytest.raises(ValueError, match="save_format='codes' checkpoint.*inference-only"):
        m(ids, labels=ids)
    tied_cfg = AutoConfig.from_pretrained(tiny_dir)
    tied_cfg.tie_word_embeddings = True
    tied = AutoModelForCausalLM.from_config(tied_cfg)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    hfq.quest.quantize_model(tied, hfq.QuESTConfig(save_format="codes", modules_to_not_convert=[]))
    with pytest.raises(ValueError, match="lm_head.weight is tied to model.embed_tokens.weight"):
        tied.save_pretrained(tmp_path / "tied")


def test_quest_announces_what_it_would_do_silently():
    """A default Hadamard block below 16 (block 1: no transform), trust_scale under estimator='ste', an entry of
    modules_to_not_convert matching nothing, and quantize_model on an already quantized model."""
    from hfq.tiny import tiny_model

    with pytest.warns(UserWarning, match=r"input width 100 .*Hadamard block is 4"):
        hfq.QuESTConfig().block_for(100)
    with pytest.warns(UserWarning, match=r"no transform at all"):
        hfq.QuESTConfig().block_for(63)
    with pytest.warns(UserWarning, match="trust_scale=2.0 has no effect: estimator='ste'"):
        hfq.QuESTConfig(weight_bits=1, estimator="ste", trust_scale=2.0)
    with pytest.warns(UserWarning, match=r"entry 'down_projj' matches no module"):
        m = hfq.quest.quantize_model(tiny_model("llama"), hfq.QuESTConfig(modules_to_not_convert=["lm_head",
                                                                                                   "down_projj"]))
    with pytest.raises(ValueError, match=r"already quantized \(hfq_quest\)"):
        hfq.quest.quantize_model(m, hfq.QuESTConfig(weight_bits=2))


def test_qft_reload_takes_the_training_options_passed(tiny_dir, tmp_path):
    """A saved QFT checkpoint reloaded with QFTConfig(gradient_bits=8, outlier_refresh_steps=7) trains with them
    (transformers kept the checkpoint's config whole: plain float gradients, no refresh, with only its generic
    warning); what the checkpoint stores (format, outliers) is the checkpoint's, and asking for another value of
    it is an error naming the field (it was silently dropped before)."""
    from hfq.qft import QFTLinear

    AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.QFTConfig()).save_pretrained(tmp_path)
    m = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=hfq.QFTConfig(
        gradient_bits=8, outlier_refresh_steps=7))
    q = m.model.layers[0].mlp.up_proj
    assert isinstance(q, QFTLinear) and q.gradient_bits == 8 and q.weight.meta["outlier_refresh_steps"] == 7
    cfg = m.config.quantization_config
    assert (cfg.gradient_bits, cfg.outlier_refresh_steps, cfg.outlier_fraction) == (8, 7, 0.01)
    with pytest.raises(ValueError, match=r"outlier_fraction=0.05 \(the checkpoint has 0.01\)"):
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=hfq.QFTConfig(outlier_fraction=0.05))


def test_a_skip_entry_naming_a_container_is_announced(tiny_dir):
    with pytest.warns(UserWarning, match=r"entry 'mlp' matches model\.layers\.0\.mlp, which holds linear layers"):
        AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.QFTConfig(modules_to_not_convert=["mlp"]))


@pytest.mark.parametrize("method", ["quest", "qft"])
@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"]])
def test_peft_adapters_on_layers_that_train_their_own_weights_are_refused(method, targets, tiny_dir):
    """LoRA on a QuEST / QFT (ECO) model: "all-linear" used to report that no target_modules were given (the
    layers are not nn.Linear), a named target "not supported"; both now say what the layer is and what to do."""
    import peft

    m = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=CONFIGS[method]())
    name = {"quest": "QuEST", "qft": "QFT/ECO"}[method]
    with pytest.raises(ValueError, match=rf"is a {re.escape(name)} layer, which trains its own quantized weight.*"
                                         r"NVFP4 layers only.*without peft_config.*NVFP4Config"):
        peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules=targets))
    if targets == "all-linear":
        with pytest.raises(ValueError, match=rf"all-linear'.*is a {re.escape(name)} layer"):
            peft.get_peft_model(m, peft.LoHaConfig(target_modules=targets))
    nv = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.NVFP4Config())
    assert isinstance(peft.get_peft_model(nv, peft.LoraConfig(r=4, target_modules=targets)), peft.PeftModel)


def test_qft_refuses_a_tied_head_and_offloading(tmp_path):
    """QFT/ECO quantizing an lm_head tied to the embeddings untied them silently and wrote a checkpoint that did not
    reload (from_pretrained said the weight was missing); a device_map that offloads crashed inside accelerate."""
    d = save_tiny(tmp_path / "tied", arch="qwen2", tie_word_embeddings=True)
    for skip in ([], ["embed_tokens"]):
        with pytest.raises(ValueError, match=r"lm_head is tied to the input embeddings.*modules_to_not_convert"):
            AutoModelForCausalLM.from_pretrained(d, quantization_config=hfq.QFTConfig(modules_to_not_convert=skip))
        with pytest.raises(ValueError, match=r"lm_head is tied to the input embeddings"):
            hfq.qft.quantize_model_(AutoModelForCausalLM.from_pretrained(d),
                                    hfq.QFTConfig(weight_format="fp8_e4m3_row", modules_to_not_convert=skip))
    m = AutoModelForCausalLM.from_pretrained(d, quantization_config=hfq.QFTConfig())  # default: the head stays dense
    assert m.lm_head.weight is m.model.embed_tokens.weight
    dm = {"model.embed_tokens": "cpu", "model.layers": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu",
          "lm_head": "cpu"}
    with pytest.raises(ValueError, match=r"device_map places modules on \['cpu', 'disk'\]; offloading"):
        AutoModelForCausalLM.from_pretrained(d, quantization_config=hfq.QFTConfig(), device_map=dm,
                                             offload_folder=str(tmp_path / "off"))


def test_dequantize_after_save_and_dtype_casts_keep_quantized_state(tiny_dir, tmp_path):
    """NVFP4 dequantize() after save_pretrained (which writes config.dtype back as a string) crashed; dequantize to
    another dtype than the model's left a model whose forward failed; QuEST codes layers rounded their fp32 row
    scales for good on model.to(bfloat16)."""
    x = torch.randint(4, 60, (1, 8))
    m = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.NVFP4Config())
    with pytest.raises(ValueError, match=r"dequantize\(dtype=torch.bfloat16\): the model's other layers are "
                                         r"torch.float32.*model.to\(dtype\)"):
        m.dequantize(dtype=torch.bfloat16)
    want = m(x).logits
    m.save_pretrained(tmp_path / "nv")
    assert isinstance(m.config.dtype, str)
    dense = m.dequantize()
    assert not any(isinstance(mod, NVFP4Linear) for mod in dense.modules())
    assert torch.allclose(dense(x).logits, want, atol=1e-5)
    AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.QuESTConfig(save_format="codes")) \
        .save_pretrained(tmp_path / "qc")
    q = AutoModelForCausalLM.from_pretrained(tmp_path / "qc")
    layer = q.model.layers[0].self_attn.q_proj
    scale = layer.weight_scale.clone()
    q.to(torch.bfloat16).to(torch.float32)
    assert layer.weight_scale.dtype == torch.float32 and torch.equal(layer.weight_scale, scale)


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_save_pretrained_writes_the_state_dict_it_is_given(method, tiny_dir, tmp_path):
    """save_pretrained(dir, state_dict=sd) (EMA or edited weights) wrote the live model instead for every hfq model,
    silently (transformers takes a quantized model's tensors from its quantizer); sd is now what is written, checked
    against the model's own keys, shapes and dtypes."""
    m = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=CONFIGS[method]())
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    sd["model.norm.weight"] = torch.full_like(sd["model.norm.weight"], 0.5)
    m.save_pretrained(tmp_path / "a", state_dict=sd)
    assert torch.equal(load_file(tmp_path / "a" / "model.safetensors")["model.norm.weight"], sd["model.norm.weight"])
    assert not torch.equal(m.model.norm.weight, sd["model.norm.weight"])  # the live model is untouched
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    assert torch.equal(back.model.norm.weight, sd["model.norm.weight"])
    assert isinstance(back.model.layers[0].self_attn.q_proj, LAYERS[method])
    sd.pop("model.norm.weight")
    with pytest.raises(ValueError, match=r"state_dict=.*1 missing, e.g. \['model.norm.weight'\]"):
        m.save_pretrained(tmp_path / "b", state_dict=sd)
    sd = m.state_dict()
    k = next(k for k in sd if k.startswith("model.layers.0.self_attn.q_proj.") and not k.endswith("bias"))
    sd[k] = sd[k].float() if sd[k].dtype != torch.float32 else sd[k].double()
    with pytest.raises(ValueError, match=rf"state_dict=.*{re.escape(k)} is .* the model holds"):
        m.save_pretrained(tmp_path / "c", state_dict=sd)


@pytest.mark.parametrize("fmt", ["int8_dense_sparse", "fp8_e4m3_row", "int4_group"])
def test_memory_footprint_counts_what_qft_weights_store(tiny_dir, fmt):
    """model.get_memory_footprint() of a QFT/ECO model: the codes, scales and outliers its QParams store (it
    counted each as the bf16 weight it presents itself as, so QFT/ECO seemed to save nothing)."""
    from hfq.qft import state_bytes

    m = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.QFTConfig(
        weight_format=fmt, **({"group_size": 32} if fmt == "int4_group" else {})), dtype=torch.bfloat16)
    bufs = sum(b.numel() * b.element_size() for b in m.buffers())
    assert m.get_memory_footprint() == state_bytes(m)["weights"] + bufs
    assert m.get_memory_footprint(return_buffers=False) == state_bytes(m)["weights"]
    dense = sum(p.numel() * 2 for p in m.parameters())
    assert m.get_memory_footprint(return_buffers=False) < dense


def test_quest_bf16_master_weights_are_announced(tiny_dir):
    """QAT on master weights of the model's bf16 loses every optimizer step below half their ulp: the load says
    so, and fp32 master weights load quietly."""
    with pytest.warns(UserWarning, match="QuEST master weights are bfloat16"):
        AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.QuESTConfig(), dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*master weights.*")
        m = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.QuESTConfig(), dtype=torch.float32)
    assert m.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    dense = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16)  # the module-level route too
    with pytest.warns(UserWarning, match=r"QuEST master weights are bfloat16.*\(AdamW at lr 1e-4"):
        hfq.quest.quantize_model(dense)


def test_qft_format_that_loses_most_of_a_layer_is_announced(tmp_path):
    """int4_tensor (one scale per tensor) on a heavy-tailed layer rounds most of it to zero: the load names the
    layer and its relative error instead of fine-tuning from a silently damaged model."""
    from hfq.tiny import save_tiny

    src = save_tiny(tmp_path / "src", arch="llama")
    m = AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():  # a real layer's absmax / RMS is 27-51 (SmolLM2): one such element sets the scale
        w = m.model.layers[0].mlp.up_proj.weight
        w[0, 0] = 40 * w.std()
    m.save_pretrained(tmp_path / "tail")
    with pytest.warns(UserWarning, match=r"int4_tensor\): 1 of .* layers keep less than half.*model.layers.0.mlp.up_proj"):
        q = AutoModelForCausalLM.from_pretrained(tmp_path / "tail", quantization_config=hfq.QFTConfig(
            weight_format="int4_tensor"))
    assert list(q.hfq_quantization_report["relative_error"]) == ["model.layers.0.mlp.up_proj"]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*keep less than half.*")
        AutoModelForCausalLM.from_pretrained(tmp_path / "tail", quantization_config=hfq.QFTConfig(
            weight_format="int4_group", group_size=32))
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "tail")  # the route outside from_pretrained says the same
    with pytest.warns(UserWarning, match=r"int4_tensor\): 1 of .* layers keep less than half.*layers.0.mlp.up_proj"):
        hfq.qft.quantize_model_(m, hfq.QFTConfig(weight_format="int4_tensor"))
    assert list(m.hfq_quantization_report["relative_error"]) == ["model.layers.0.mlp.up_proj"]


@pytest.mark.parametrize("route", ["from_pretrained_qft", "from_pretrained_quest", "quest_quantize_model"])
def test_resize_token_embeddings_with_a_quantized_head_is_refused_untouched(tiny_dir, route):
    """transformers would resize the input embeddings and then stop on the quantized head with a TypeError; the
    refusal names the head and both fixes, and nothing is resized. With the head kept out the resize works."""
    from hfq.tiny import tiny_model

    if route == "quest_quantize_model":
        model = hfq.quest.quantize_model(tiny_model("qwen2"), hfq.QuESTConfig(modules_to_not_convert=[]))
    else:
        cfg = CONFIGS[route.split("_")[-1]](modules_to_not_convert=[])
        model = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=cfg)
    assert isinstance(model.lm_head, tuple(LAYERS.values()))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not isinstance(p, hfq.qparam.QParam)}
    with pytest.raises(ValueError, match=r"resize_token_embeddings: the output embeddings `lm_head` are a quantized "
                                         r".*nothing was changed.*Resize before quantizing.*modules_to_not_convert"):
        model.resize_token_embeddings(120)
    assert model.config.vocab_size == 100 and model.get_input_embeddings().weight.shape[0] == 100
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)
    model.resize_token_embeddings()  # no new size: nothing to resize, nothing refused
    kept = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.QFTConfig())  # lm_head kept out
    kept.resize_token_embeddings(120)
    assert kept.lm_head.weight.shape[0] == 120 and kept(torch.tensor([[5, 119]])).logits.shape[-1] == 120


def test_quest_masters_cast_to_bf16_after_loading_are_announced_at_training(tiny_dir):
    """fp32 masters loaded quietly, then model.to(torch.bfloat16): the first training forward says what the
    bf16 load would have said (once); evaluation forwards stay quiet."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*master weights.*")
        model = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.QuESTConfig(),
                                                     dtype=torch.float32).to(torch.bfloat16)
        ids = torch.tensor([[4, 5, 6, 7]])
        with torch.no_grad():
            model.eval()(ids)
    model.train()
    with pytest.warns(UserWarning, match=r"QuEST master weights are bfloat16.*keep them fp32"):
        model(input_ids=ids, labels=ids).loss.backward()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*master weights.*")
        model(input_ids=ids, labels=ids).loss.backward()


def test_quest_low_master_warning_is_per_model(tiny_dir):
    """The training forward's warning was once per process: after another QuEST model had warned (a bf16 load),
    a second model cast to bf16 trained with its small steps lost and nothing said. Now once per model."""
    with pytest.warns(UserWarning, match="QuEST master weights are bfloat16"):
        AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.QuESTConfig(), dtype=torch.bfloat16)
    b = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.QuESTConfig(),
                                             dtype=torch.float32).to(torch.bfloat16).train()
    ids = torch.tensor([[4, 5, 6, 7]])
    with pytest.warns(UserWarning, match=r"QuEST master weights are bfloat16.*keep them fp32"):
        b(input_ids=ids, labels=ids).loss.backward()


@pytest.fixture
def g4_device(monkeypatch):
    """Where NVFP4 layers keep the g4 layout: the GPU where there is one, else the CPU with the GPU's choice of
    layout emulated (nvfp4_gluon.device_ok) and its planned eager route run under the interpreter."""
    import hfq_kernels.nvfp4_gluon as G4
    from hfq_kernels._settings import SETTINGS

    if torch.cuda.is_available():
        return "cuda:0"
    monkeypatch.setattr(SETTINGS, "plan_on_cpu", True)
    monkeypatch.setattr(G4, "device_ok", lambda d: d.type == "cpu")
    return "cpu"


def _offload_map(layers: int, disk=(1,), rest="cpu") -> dict:
    """A device_map with decoder blocks `disk` offloaded to disk (accelerate's dispatch hooks), the rest on `rest`."""
    d = {"model.embed_tokens": rest, "model.norm": rest, "model.rotary_emb": rest, "lm_head": rest}
    d.update({f"model.layers.{i}": "disk" if i in disk else rest for i in range(layers)})
    return d


def test_quest_refuses_offloading_device_maps(tiny_dir, tmp_path):
    """Offloaded QuEST layers are rebuilt at each forward, so QAT's gradients reached temporary copies: the offloaded
    layers silently never trained (and a master checkpoint's load guard crashed there). Refused, as QFT/ECO do."""
    layers = AutoModelForCausalLM.from_pretrained(tiny_dir).config.num_hidden_layers
    with pytest.raises(ValueError, match=r"QuEST \(hfq_quest\): device_map places modules on \['cpu', 'disk'\]"):
        AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.QuESTConfig(), dtype=torch.float32,
                                             device_map=_offload_map(layers), offload_folder=str(tmp_path / "off"))


def test_nvfp4_checkpoint_with_offloaded_buffers_loads_and_matches(tiny_dir, tmp_path):
    """offload_buffers=True (what takes NVFP4's codes and scales off the device): the load's scale check read meta
    tensors (Tensor.item() on meta); now the offloaded model's logits equal the plain load's."""
    q = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.NVFP4Config(), dtype=torch.float32)
    q.save_pretrained(tmp_path / "q")
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32, offload_buffers=True,
                                             device_map=_offload_map(q.config.num_hidden_layers),
                                             offload_folder=str(tmp_path / "off"))
    ids = torch.tensor([[5, 17, 30, 41, 8, 60]])
    with torch.no_grad():
        assert torch.equal(m(ids).logits, q(ids).logits)


def test_nvfp4_layout_switch_leaves_no_stale_buffer_names():
    """Entering and leaving the g4 layout drops buffers; their names must leave the non-persistent set too (accelerate's
    dispatch looks every name in it up: 'does not have a parameter or a buffer named weight_g4')."""
    lin = NVFP4Linear.from_linear(torch.nn.Linear(64, 32))
    lin.to_g4_layout_()
    assert {"weight_g4", "weight_g4_scale"} <= lin._non_persistent_buffers_set
    lin.to_canonical_layout_()
    assert not lin._non_persistent_buffers_set & {"weight_g4", "weight_g4_scale"}
    assert all(n in lin._buffers for n in lin._non_persistent_buffers_set)


@pytest.mark.parametrize("offload_buffers", [True, False])
def test_nvfp4_offloaded_layers_keep_no_launch_plan(tiny_dir, tmp_path, monkeypatch, offload_buffers):
    """With offload_buffers=True an offloaded layer's codes come in for each forward and go back to meta after it:
    a kept per-shape plan would hold them (the whole offloaded weight, never reused), and converting them to the g4
    layout (what a layer does on a GPU that runs the Gluon kernel) would leave g4 copies on the GPU and nothing for
    the next forward to load. Offloaded layers keep neither; the others keep both, and every forward equals a plain
    load's. Without offload_buffers accelerate keeps buffers (the codes) on the execution device: such layers keep
    their plan, and stay canonical (the hook moves the names it recorded, also when it is removed, as PEFT's
    from_pretrained does on offloaded models). On CPU the g4 device is emulated (the planned route under the
    interpreter)."""
    import hfq_kernels.nvfp4_gluon as G4
    from hfq_kernels._settings import SETTINGS

    monkeypatch.setattr(SETTINGS, "plan_on_cpu", True)
    monkeypatch.setattr(hfq.nvfp4.linear, "_WARNED_G4_OFFLOAD", [])  # once per process: armed again
    dev = "cuda:0" if torch.cuda.is_available() else "cpu"
    if dev == "cpu":
        monkeypatch.setattr(G4, "device_ok", lambda d: d.type == "cpu")
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.NVFP4Config(), dtype=torch.float32,
                                               device_map=dev)
    off = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.NVFP4Config(), dtype=torch.float32,
                                               device_map=_offload_map(ref.config.num_hidden_layers, (1,), dev),
                                               offload_buffers=offload_buffers, offload_folder=str(tmp_path / "off"))
    ids = torch.tensor([[5, 17, 30, 41, 8, 60]], device=dev)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*offload hook.*")  # offloaded while loading: nothing to say
        want = ref(ids).logits
        for _ in range(2):
            assert torch.equal(off(ids).logits, want)
    kept = lambda m: len(m.__dict__.get("_hfq_plans", (None, {}))[1])  # noqa: E731
    q1, q0 = off.model.layers[1].self_attn.q_proj, off.model.layers[0].self_attn.q_proj
    assert q0.layout == "g4" and kept(q0) == 1
    if offload_buffers:
        assert q1.layout == "canonical" and q1.weight_packed.device.type == "meta" and kept(q1) == 0
    else:
        assert q1.layout == "canonical" and q1.weight_packed.device == q0.weight_g4.device and kept(q1) == 1
    from accelerate.hooks import remove_hook_from_submodules

    remove_hook_from_submodules(off)  # what PeftModel.from_pretrained does to a model with cpu/disk in its device_map


def test_qft_eco_models_refused_under_deepspeed_before_its_engine(tiny_dir):
    """DeepSpeed's engine moves, flattens and partitions parameters into its own buffers: a QFT/ECO model failed
    inside it with errors naming neither (DeepSpeed >= 0.19.7: "Couldn't swap QLinear.weight"; before: a refused
    .data write recommending the optimizer the user already had). accelerate's prepare (Trainer's route too) now
    refuses such a model under DeepSpeed, naming the weight and DDP/FSDP2; elsewhere it prepares as before. (CI has
    no DeepSpeed: the run sets the distributed type accelerate sets under a DeepSpeed plugin; checked with
    DeepSpeed 0.19.8 on CPU through Trainer at ZeRO-2/3 and plain accelerate.)"""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    m = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.QFTConfig())
    opt = hfq.QLion(m.parameters(), lr=1e-3)
    acc = Accelerator(cpu=True)
    try:
        acc.state.distributed_type = DistributedType.DEEPSPEED
        with pytest.raises(ValueError, match=r"model\.layers\.0\.\S+ is a quantized weight \(QParam int8_dense_sparse"
                                             r".*DeepSpeed cannot train it.*DDP or FSDP2"):
            acc.prepare(m, opt)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator(cpu=True)
    pm, popt = acc.prepare(m, opt)
    assert pm is m and popt.optimizer is opt


def test_lora_on_offloaded_nvfp4_layers_runs_through_accelerates_hook_or_is_refused(tiny_dir, tmp_path, monkeypatch):
    """accelerate brings an offloaded layer's tensors in by replacing its forward. NVFP4LoraLinear's short route
    called the base's forward_lora around it and read them on meta (every CUDA GPU: 'Tensor on device meta'), so a
    layer under an accelerate hook takes PEFT's forward (equal to a model kept whole). With offload_buffers=True
    PEFT would place the adapters on meta, beside the offloaded codes (no values, nothing trained, NaN logits):
    refused, naming the remedy."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    from hfq_kernels._settings import SETTINGS

    monkeypatch.setattr(SETTINGS, "plan_on_cpu", True)  # on CPU: the eager planned route CUDA inputs take
    dev = "cuda:0" if torch.cuda.is_available() else "cpu"
    cfg = lambda: LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)  # noqa: E731
    torch.manual_seed(0)
    ref = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.NVFP4Config(),
                                                              dtype=torch.float32, device_map=dev), cfg())
    layers = ref.config.num_hidden_layers
    ids = torch.tensor([[5, 17, 30, 41, 8, 60]], device=dev)
    for offload_buffers in (False, True):
        base = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.NVFP4Config(),
                                                    dtype=torch.float32, device_map=_offload_map(layers, (1,), dev),
                                                    offload_buffers=offload_buffers,
                                                    offload_folder=str(tmp_path / f"off{offload_buffers}"))
        if offload_buffers:
            with pytest.raises(ValueError, match=r"LoRA on an NVFP4 layer whose codes accelerate offloads.*"
                                                 r"offload_buffers=False"):
                get_peft_model(base, cfg())
            continue
        pm = get_peft_model(base, cfg())
        set_peft_model_state_dict(pm, get_peft_model_state_dict(ref))
        with torch.no_grad():
            assert torch.equal(pm(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_adapter_saves_do_not_convert_a_g4_base(tiny_dir, tmp_path, monkeypatch, g4_device):
    """PeftModel.save_pretrained (every Trainer / TRL checkpoint of a LoRA run) read the model's whole state_dict(),
    for which every g4 layer was converted back to the canonical layout and copied to host memory, then dropped.
    Adapter saves now leave the codes out: no conversion, the same adapter file as a canonical base's, and a fresh
    base with the adapter gives the same logits."""
    import hfq_kernels.nvfp4_gluon as G4
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file as load_st

    cfg = LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    saved, calls, unrepack = {}, [], G4.unrepack
    monkeypatch.setattr(G4, "unrepack", lambda *a, **k: calls.append(1) or unrepack(*a, **k))
    for g4 in (False, True):
        torch.manual_seed(0)
        pm = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.NVFP4Config(),
                                                                 dtype=torch.float32, device_map=g4_device), cfg)
        if not g4:  # the reference: a canonical base
            for m in pm.modules():
                if isinstance(m, NVFP4Linear):
                    m.allow_g4 = False
                    m.to_canonical_layout_()
        assert pm.base_model.model.model.layers[0].self_attn.q_proj.base_layer.layout == ("g4" if g4 else "canonical")
        calls.clear()
        pm.save_pretrained(str(tmp_path / f"a{g4}"))
        assert calls == []
        saved[g4] = load_st(str(tmp_path / f"a{g4}" / "adapter_model.safetensors"))
        full = pm.state_dict()  # outside an adapter save: the codes, canonical (converted from g4)
        assert any(k.endswith("weight_packed") for k in full) and bool(calls) == g4
    assert saved[False].keys() == saved[True].keys() and all(torch.equal(saved[False][k], saved[True][k])
                                                               for k in saved[False])
    ids = torch.tensor([[5, 17, 30, 41, 8, 60]], device=g4_device)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.NVFP4Config(), dtype=torch.float32,
                                                device_map=g4_device)
    with torch.no_grad():
        assert torch.equal(PeftModel.from_pretrained(base, str(tmp_path / "aTrue"))(input_ids=ids).logits,
                           pm(input_ids=ids).logits)


def test_adapter_loads_leave_g4_codes_as_they_are(tiny_dir, tmp_path, monkeypatch, g4_device):
    """Loading an adapter (PeftModel.from_pretrained, load_adapter: PEFT's set_peft_model_state_dict) holds no base
    codes, yet every g4 layer went to canonical and back, with new code tensors (kept plans and rollout graphs then
    rebuilt). Now the codes stay the same tensors, with no conversion; the codes are still reported missing (as a
    canonical layer's are) and a strict load without them still fails."""
    import hfq_kernels.nvfp4_gluon as G4
    from peft import LoraConfig, PeftModel, get_peft_model

    load = lambda: AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.NVFP4Config(),  # noqa
                                                        dtype=torch.float32, device_map=g4_device)
    get_peft_model(load(), LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)).save_pretrained(
        str(tmp_path / "a"))
    base = load()
    q = base.model.layers[0].self_attn.q_proj
    codes = q.weight_g4
    calls = []
    for fn in ("repack", "unrepack"):
        orig = getattr(G4, fn)
        monkeypatch.setattr(G4, fn, lambda *a, _o=orig, **k: calls.append(1) or _o(*a, **k))
    pm = PeftModel.from_pretrained(base, str(tmp_path / "a"))
    pm.load_adapter(str(tmp_path / "a"), adapter_name="second")
    assert calls == [] and q.layout == "g4" and q.weight_g4 is codes
    sd = {k: v for k, v in load().state_dict().items() if not k.endswith(("weight_packed", "weight_scale"))}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*model\.layers\.0\.self_attn\.q_proj\.weight_packed"):
        load().load_state_dict(sd)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a g4 layer's state_dict() holds host copies on a GPU only")
def test_g4_load_state_dict_assign_keeps_the_codes_on_the_gpu(tiny_dir):
    """A g4 layer's state_dict() holds host copies of its codes beside its device global scale; loading it back with
    assign=True left canonical codes on the host under a CUDA global scale (the next forward repacked on the host
    for a CUDA launch). The codes now follow the global scale's device, and the layer is g4 again."""
    m = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.NVFP4Config(), dtype=torch.bfloat16,
                                             device_map="cuda:0")
    ids = torch.tensor([[5, 17, 30, 41, 8, 60]], device="cuda:0")
    with torch.no_grad():
        want = m(ids).logits
        m.load_state_dict(m.state_dict(), assign=True)
        got = m(ids).logits
    q = m.model.layers[0].self_attn.q_proj
    assert q.layout == "g4" and q.weight_g4.is_cuda and torch.equal(got, want)


def test_offloading_a_loaded_g4_model_says_the_codes_stay(tiny_dir, monkeypatch, g4_device):
    """accelerate's cpu_offload / disk_offload / dispatch_model on a model already loaded on a GPU: accelerate does
    not offload non-persistent buffers, so g4 codes stayed on the GPU while the offload looked done (logits right,
    memory not freed). The first forward says so and what to do."""
    import hfq.nvfp4.linear as L
    from accelerate import cpu_offload

    monkeypatch.setattr(L, "_WARNED_G4_OFFLOAD", [])
    m = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.NVFP4Config(), dtype=torch.float32,
                                             device_map=g4_device)
    ids = torch.tensor([[5, 17, 30, 41]], device=g4_device)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*offload hook.*")
        with torch.no_grad():
            want = m(ids).logits  # no hook: no warning
    cpu_offload(m, execution_device=torch.device(g4_device), offload_buffers=True)
    with pytest.warns(UserWarning, match=r"g4 layout .* offload hook attached after loading.*offload_buffers=True"):
        with torch.no_grad():
            assert torch.equal(m(ids).logits, want)


def test_load_checkpoint_and_dispatch_into_a_loaded_g4_model(tiny_dir, tmp_path, g4_device):
    """accelerate's load_checkpoint_and_dispatch / load_checkpoint_in_model with a device_map into an NVFP4 model
    already loaded on a GPU: accelerate looks each checkpoint name up in the layer's _parameters / _buffers, so every
    g4 layer failed ("does not have a parameter or a buffer named weight_scale"). The layer goes canonical for the
    load and back to g4 at its next forward, holding the checkpoint's codes."""
    from accelerate import load_checkpoint_and_dispatch

    ids = torch.tensor([[5, 17, 30, 41]], device=g4_device)
    src = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.NVFP4Config(), dtype=torch.float32,
                                               device_map=g4_device)
    with torch.no_grad():
        want = src(ids).logits
    src.save_pretrained(str(tmp_path / "q"))
    dst = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.NVFP4Config(), dtype=torch.float32,
                                               device_map=g4_device)
    layers = [m for m in dst.modules() if isinstance(m, NVFP4Linear)]
    with torch.no_grad():
        for m in layers:  # other codes and other dense weights than the checkpoint's
            m.weight_packed.zero_()
        for p in dst.parameters():
            p.add_(0.25)
        assert not torch.allclose(dst(ids).logits, want)
    assert all(m.layout == "g4" for m in layers)
    dst = load_checkpoint_and_dispatch(dst, str(tmp_path / "q"), device_map={"": g4_device})
    with torch.no_grad():
        assert torch.equal(dst(ids).logits, want)
    assert all(m.layout == "g4" for m in layers)


def test_quantize_on_load_repacks_each_layer_once(tiny_dir, monkeypatch, g4_device):
    """Quantizing a dense checkpoint while loading on a g4 device packed each layer to g4 in set_weight, unpacked it
    to hand the loader its canonical buffers, and packed it again after loading: it stays canonical until the
    post-load pass converts it, once."""
    import hfq_kernels.nvfp4_gluon as G4

    calls, repack = [], G4.repack
    monkeypatch.setattr(G4, "repack", lambda *a, **k: calls.append(1) or repack(*a, **k))
    m = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.NVFP4Config(), dtype=torch.float32,
                                             device_map=g4_device)
    layers = [x for x in m.modules() if isinstance(x, NVFP4Linear)]
    assert len(calls) == len(layers) and all(x.layout == "g4" for x in layers)
    assert all(0 < e < 0.2 for e in m.hfq_quantization_report["rel_error"].values())


def test_mxfp4_layer_state_dict_round_trip():
    """An MXFP4 layer has no global scale: its load_state_dict must not read one (the g4 checks are NVFP4's)."""
    lin = torch.nn.Linear(64, 32)
    lay = NVFP4Linear.from_linear(lin, format="mxfp4")
    fresh = NVFP4Linear(64, 32, True, "mxfp4")
    fresh.load_state_dict(lay.state_dict())
    assert torch.equal(fresh.dequantize(torch.float32), lay.dequantize(torch.float32))
