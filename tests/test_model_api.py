"""transformers' model API on hfq models where a load or a call could go silently wrong: checkpoints missing a
quantized layer's tensors, task heads a checkpoint does not hold, renamed checkpoint keys, models whose weight init
writes child layers, model.dequantize()."""
import os
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

import hfq
from hfq.nvfp4 import NVFP4Linear

CONFIGS = {"nvfp4": hfq.NVFP4Config, "quest": hfq.QuESTConfig, "quest_codes": lambda: hfq.QuESTConfig(
    save_format="codes"), "qft": hfq.QFTConfig, "eco_fp8": lambda: hfq.QFTConfig(weight_format="fp8_e4m3_row")}
IDS = torch.randint(4, 60, (2, 9), generator=torch.Generator().manual_seed(0))


def _logits(m, **kw):
    with torch.no_grad():
        return m(IDS, **kw).logits


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_a_checkpoint_missing_a_quantized_layers_tensors_is_refused(method, tiny_dir, tmp_path):
    """A reload of an hfq checkpoint lacking one layer's tensors built that layer from torch.empty memory (QFT/ECO,
    QuEST: transformers' init passes over hfq layers) and loaded with no word in most runs; the load now names the
    tensors."""
    AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=CONFIGS[method]()).save_pretrained(tmp_path)
    f = str(tmp_path / "model.safetensors")
    with safe_open(f, framework="pt") as h:
        meta = h.metadata()
    sd = {k: v for k, v in load_file(f).items() if not k.startswith("model.layers.1.mlp.up_proj.")}
    save_file(sd, f, metadata=meta)
    with pytest.raises(ValueError, match=r"the checkpoint has no model\.layers\.1\.mlp\.up_proj\.weight.*"
                                         r"uninitialised memory"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_a_new_task_head_stays_dense_and_its_model_reloads_exactly(method, tiny_dir, tmp_path):
    """A token classifier's `score` (a head with a bias, which transformers' default skip misses) on a causal LM's
    checkpoint: QuEST made it a QuESTLinear from torch.empty memory (losses up to 1e31), NVFP4 refused the load,
    and the saved QuEST classifier reloaded its dense head as a QuEST layer (logits 0.06 off). The head is now a
    dense, initialised, trainable nn.Linear, recorded in the checkpoint, and the model reloads exactly, from the
    dense checkpoint and from a quantized causal LM's alike."""
    lm = tmp_path / "lm"
    AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=CONFIGS[method]()).save_pretrained(lm)
    for src, kw in ((tiny_dir, {"quantization_config": CONFIGS[method]()}), (lm, {})):
        with pytest.warns(UserWarning, match=r"\['score'\] are not in the checkpoint \(a new head"):
            m = AutoModelForTokenClassification.from_pretrained(src, num_labels=3, **kw)
        assert type(m.score) is torch.nn.Linear and m.score.weight.requires_grad
        assert 0.01 < float(m.score.weight.detach().std()) < 0.03 and torch.count_nonzero(m.score.bias) == 0
        assert "score" in m.hfq_quantization_report["skipped"]
        want = _logits(m)
        assert torch.isfinite(want).all()
        out = tmp_path / f"cls_{src == lm}"
        m.save_pretrained(out)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the reload knows the head: nothing to announce
            back = AutoModelForTokenClassification.from_pretrained(out)
        assert type(back.score) is torch.nn.Linear
        assert torch.equal(_logits(back), want)


@pytest.mark.parametrize("method", ["nvfp4", "quest", "qft"])
def test_checkpoints_whose_keys_transformers_renames_reload(method, tmp_path):
    """transformers renames some architectures' checkpoint keys at load (Llava's language_model.model.* ->
    model.language_model.*) and back at save; NVFP4 compared its layers with the raw file keys and called every
    saved Llava 'missing or corrupt'. A key_mapping= reload went the same way."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    cfg = LlavaConfig(vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                     num_attention_heads=2, image_size=32, patch_size=16),
                      text_config=LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
                      image_token_id=5)
    LlavaForConditionalGeneration(cfg).save_pretrained(tmp_path / "dense")
    m = LlavaForConditionalGeneration.from_pretrained(tmp_path / "dense", quantization_config=CONFIGS[method]())
    want = _logits(m)
    m.save_pretrained(tmp_path / "q")
    with safe_open(str(tmp_path / "q" / "model.safetensors"), framework="pt") as h:
        assert any(k.startswith("language_model.model.layers.0.") for k in h.keys())  # the legacy names
    assert torch.equal(_logits(LlavaForConditionalGeneration.from_pretrained(tmp_path / "q")), want)


@pytest.mark.parametrize("fmt", ["int8_dense_sparse", "fp8_e4m3_row"])
def test_qft_loads_models_whose_init_writes_child_layers(fmt, tmp_path):
    """T5 (and CLIP / SigLIP vision towers) initialise child linears from the parent's _init_weights, which wrote
    the new QParam in place during from_pretrained: a QuantizedWriteError about optimizers. The loaded weight is
    now left alone, and it is the checkpoint's."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4,
                                        decoder_start_token_id=0)).save_pretrained(tmp_path)
    dense = T5ForConditionalGeneration.from_pretrained(tmp_path)
    m = T5ForConditionalGeneration.from_pretrained(tmp_path, quantization_config=hfq.QFTConfig(weight_format=fmt))
    w, ref = m.encoder.block[0].layer[0].SelfAttention.q.weight, dense.encoder.block[0].layer[0].SelfAttention.q.weight
    assert float((w.dequantize(torch.float32) - ref).norm() / ref.norm()) < 0.05


def test_dequantize_takes_the_models_dtype_and_leaves_layers_trainable(tiny_dir):
    """NVFP4 model.dequantize(): after model.to(fp16) it took config.dtype (still fp32) and refused, telling the user
    to call model.dequantize(); and its dense linears came out frozen (15% of the parameters trainable, the decoder
    never trained) where the same model reloaded from disk is all trainable. A PEFT base layer stays frozen."""
    import peft

    m = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.NVFP4Config())
    m.to(torch.float16)
    want = _logits(m)
    dense = m.dequantize()
    assert dense.model.layers[0].mlp.up_proj.weight.dtype == torch.float16
    assert torch.allclose(_logits(dense), want, atol=1e-3, rtol=0)
    assert all(p.requires_grad for p in dense.parameters())
    pm = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.NVFP4Config()),
                             peft.LoraConfig(r=4, target_modules=["q_proj"]))
    pm.base_model.model.dequantize()
    q = pm.base_model.model.model.layers[0].self_attn.q_proj
    assert not q.base_layer.weight.requires_grad and not q.base_layer.bias.requires_grad
    assert q.lora_A["default"].weight.requires_grad
    assert not any(p.requires_grad for p in pm.base_model.model.model.layers[0].mlp.up_proj.parameters())
    assert not any(isinstance(x, NVFP4Linear) for x in pm.modules())



@pytest.mark.parametrize("method", ["nvfp4", "quest", "qft"])
def test_from_config_of_an_hfq_config_says_the_model_is_dense(method, tiny_dir, tmp_path):
    """AutoConfig.from_pretrained(hfq folder) + from_config gave a dense model still labelled hfq-quantized, with no
    word; its save wrote dense weights under the hfq config, which reloaded as 'corrupt', as QuEST layers (logits
    0.18 off) or as NaN QFT codes. from_config now warns; save_pretrained refuses; quantizing it works as on any
    dense model."""
    from transformers import AutoConfig

    AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=CONFIGS[method]()).save_pretrained(tmp_path)
    cfg = AutoConfig.from_pretrained(tmp_path)
    with pytest.warns(UserWarning, match=rf"from_config: the config names quantization method hfq_{method}, but the "
                                         r"model is dense"):
        m = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match=r"save_pretrained: this model's config names quantization method .*"
                                         r"del model.config.quantization_config"):
        m.save_pretrained(tmp_path / "bad")
    assert not (tmp_path / "bad" / "model.safetensors").exists()
    if method == "quest":
        hfq.quest.quantize_model(m, hfq.QuESTConfig())
        m.save_pretrained(tmp_path / "qat")
        assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "qat")), _logits(m))
    del m.config.quantization_config
    if method != "quest":
        m.save_pretrained(tmp_path / "dense")
        assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "dense")), _logits(m))


def test_another_methods_config_on_reload_names_the_class_that_was_passed(tiny_dir, tmp_path):
    """The refusal of another method's config said 'transformers and hfq both have a class named NVFP4Config' when
    hfq's own class was passed; the clause is kept for transformers' class."""
    import transformers

    AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.QuESTConfig()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"quant_method 'hfq_quest' but .* hfq\.nvfp4\.config\.NVFP4Config "
                                         r"\(quant_method 'hfq_nvfp4'\)\. Load") as e:
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=hfq.NVFP4Config())
    assert "both have a class" not in str(e.value)
    theirs = getattr(transformers, "NVFP4Config", None)
    if theirs is not None:
        with pytest.raises(ValueError, match=r"both have a class named NVFP4Config, and this is transformers'"):
            AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=theirs())


def test_quest_codes_save_writes_the_state_dict_it_is_given(tiny_dir, tmp_path):
    """save_pretrained(dir, state_dict=sd) with QuESTConfig(save_format="codes") wrote the codes of the live master
    weights, not of sd's (the master-weight save honoured sd): an EMA or edited model saved silently as the live
    one."""
    m = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.QuESTConfig(save_format="codes"))
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    key = "model.layers.0.self_attn.q_proj.weight"
    sd[key] = torch.randn_like(sd[key]) * 0.05
    m.save_pretrained(tmp_path, state_dict=sd)
    got = load_file(str(tmp_path / "model.safetensors"))
    layer = m.model.layers[0].self_attn.q_proj
    want_codes, want_scale = layer.export_codes(sd[key])
    assert torch.equal(got[key + "_codes"], want_codes) and torch.equal(got[key.replace("weight", "weight_scale")],
                                                                       want_scale)
    assert not torch.equal(want_scale, layer.export_codes()[1])  # the live layer's differ


def test_loading_an_hfq_task_model_says_nothing_about_from_config(tiny_dir, tmp_path):
    """A task model's __init__ builds its backbone with AutoModel.from_config(config) inside from_pretrained, with the
    hfq quantization_config in that config: the from_config warning is for a user's dense model only, once."""
    from transformers import AutoConfig

    AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.NVFP4Config()).save_pretrained(tmp_path)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        AutoModelForTokenClassification.from_pretrained(tiny_dir, num_labels=2, quantization_config=hfq.NVFP4Config())
        AutoModelForTokenClassification.from_pretrained(tmp_path, num_labels=2)
    assert not [x for x in w if "from_config" in str(x.message)]
    with pytest.warns(UserWarning, match="from_config") as w:
        AutoModelForTokenClassification.from_config(AutoConfig.from_pretrained(tmp_path))
    assert len([x for x in w if "from_config" in str(x.message)]) == 1


def test_trl_fused_lm_head_refuses_a_quantized_output_head(tiny_dir, tmp_path):
    """DPOTrainer / GRPOTrainer / KTOTrainer score log-probabilities through TRL's fused LM head, which multiplies by
    lm_head.weight itself: with a QuEST head (modules_to_not_convert=[]) the trainer trained the full-precision
    master as a dense head while the saved model runs it quantized (log-probs 0.05 apart, no word); with a QFT/ECO
    head it crashed on dtypes. Refused at trainer construction, naming the head; the default (head kept out) trains."""
    import subprocess
    import sys

    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    data = Dataset.from_dict({"prompt": ["ab", "cd"], "chosen": ["e", "f"], "rejected": ["g", "h"]})
    args = DPOConfig(str(tmp_path), report_to="none", use_cpu=True, max_steps=1, per_device_train_batch_size=2)
    for cfg, refused in ((hfq.QuESTConfig(modules_to_not_convert=[]), True),
                         (hfq.QFTConfig(weight_format="fp8_e4m3_row", modules_to_not_convert=["embed_tokens"]), True),
                         (hfq.QuESTConfig(), False)):
        m = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=cfg)
        ref = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=cfg)
        if refused:
            with pytest.raises(ValueError, match=r"fused LM head .* `lm_head` is a hfq_(quest|qft) .*modules_to_not_"
                                                 r"convert"):
                DPOTrainer(m, ref_model=ref, args=args, train_dataset=data, processing_class=tok)
        else:
            DPOTrainer(m, ref_model=ref, args=args, train_dataset=data, processing_class=tok).train()
    # TRL imported after hfq: the trainers bind the wrapped function when they import it
    code = ("import hfq, trl.trainer.dpo_trainer as d, trl.trainer.grpo_trainer as g; "
            "assert d.add_fused_lm_head.hfq_wrapped and g.add_fused_lm_head.hfq_wrapped")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "TRITON_INTERPRET": "1"})


def test_overlapping_saves_keep_their_own_state_dicts(tiny_dir, tmp_path, monkeypatch):
    """save_pretrained(state_dict=sd) handed sd to the model's quantizer through one attribute: a save of the live
    model overlapping it (another thread) cleared it, and the snapshot checkpoint silently held the live weights
    (audit 18f F6). The first save is held at its makedirs until the second has run."""
    import threading

    m = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.QuESTConfig())
    snap = {k: v.detach().clone() for k, v in m.state_dict().items()}
    snap["model.norm.weight"] = torch.full_like(snap["model.norm.weight"], 0.25)
    first, release, makedirs = threading.Event(), threading.Event(), os.makedirs

    def held(*a, **k):
        if threading.current_thread().name == "snapshot" and not first.is_set():
            first.set()
            release.wait(20)
        return makedirs(*a, **k)

    monkeypatch.setattr(os, "makedirs", held)
    t = threading.Thread(target=lambda: m.save_pretrained(tmp_path / "snap", state_dict=snap), name="snapshot")
    t.start()
    assert first.wait(20)
    m.save_pretrained(tmp_path / "live")
    release.set()
    t.join()
    assert torch.equal(load_file(str(tmp_path / "snap" / "model.safetensors"))["model.norm.weight"],
                       snap["model.norm.weight"])
    assert torch.equal(load_file(str(tmp_path / "live" / "model.safetensors"))["model.norm.weight"],
                       m.model.norm.weight.detach())


def test_from_config_warns_while_another_thread_builds_a_model(tiny_dir, tmp_path):
    """The from_config warning counted nested calls process-wide: while any other thread was inside from_config, a
    dense model under an hfq config came with no warning (audit 18f F3)."""
    import threading

    from transformers import AutoConfig, Qwen2ForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=hfq.NVFP4Config()).save_pretrained(tmp_path)
    inside, release = threading.Event(), threading.Event()

    class Slow(Qwen2ForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            inside.set()
            release.wait(20)

    t = threading.Thread(target=lambda: Slow._from_config(AutoConfig.from_pretrained(tiny_dir)))
    t.start()
    try:
        assert inside.wait(20)
        with pytest.warns(UserWarning, match="from_config: the config names quantization method hfq_nvfp4"):
            AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    finally:
        release.set()
        t.join()


def test_hfq_wraps_keep_the_names_and_signatures_they_wrap():
    """PEFT's and transformers' functions that hfq wraps keep their names and docs (functools.wraps), and the TRL
    import hook is installed once however often its module is reloaded (audit 18f F4)."""
    import importlib
    import sys

    from peft.tuners import tuners_utils
    from peft.tuners.lora.model import LoraModel
    from transformers.quantizers.auto import AutoHfQuantizer

    import hfq._base.trl_guard as guard

    assert LoraModel._create_new_module.__name__ == "_create_new_module"
    assert tuners_utils._maybe_include_all_linear_layers.__name__ == "_maybe_include_all_linear_layers"
    assert AutoHfQuantizer.merge_quantization_configs.__name__ == "merge_quantization_configs"
    importlib.reload(guard).install()
    importlib.reload(guard).install()
    assert sum(type(f).__name__ == "_AfterImport" for f in sys.meta_path) <= 1


@pytest.mark.parametrize("method", ["nvfp4", "quest", "qft"])
def test_a_layer_new_inside_the_base_model_names_the_fix(method, tmp_path):
    """A BERT classifier from a masked-LM checkpoint: its pooler (inside the base model) is not in the checkpoint.
    hfq refuses to quantize a layer it has no weight for (a truncated checkpoint looks the same); the error names
    modules_to_not_convert with the layer, and with it the pooler loads dense and initialised as transformers does."""
    from transformers import AutoModelForSequenceClassification, BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                               intermediate_size=128)).save_pretrained(tmp_path)
    cfg = CONFIGS[method]
    with pytest.raises(ValueError, match=r"pooler.*modules_to_not_convert=\[\.\.\., 'bert\.pooler\.dense'\]"):
        AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=3, quantization_config=cfg())
    m = AutoModelForSequenceClassification.from_pretrained(
        tmp_path, num_labels=3, quantization_config=type(cfg())(modules_to_not_convert=["bert.pooler.dense"]))
    assert type(m.bert.pooler.dense) is torch.nn.Linear and 0.01 < float(m.bert.pooler.dense.weight.detach().std()) < 0.03
    assert type(m.bert.encoder.layer[0].attention.self.query) is not torch.nn.Linear
