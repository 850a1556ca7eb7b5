"""hfq checkpoints through the standard routes: Trainer resume of QuEST, loading with and without `import hfq`
in fresh interpreters (never silently wrong), QuEST's per-layer Hadamard block on a 576-wide model, and the
compressed-tensors export of a tied lm_head."""
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import hfq
from hfq.nvfp4 import NVFP4Config
from hfq.qft import QFTConfig
from hfq.quest import QuESTConfig, QuESTLinear, quantize_model
from hfq.tiny import save_tiny, tiny_config, tiny_model

IDS = torch.randint(4, 90, (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return str(save_tiny(tmp_path_factory.mktemp("tiny") / "llama", arch="llama"))


def _data(n=16):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": ids, "labels": ids} for ids in (torch.randint(4, 90, (16,), generator=g) for _ in range(n))]


# ----------------------------------------------------------------------------- resume
def _train(model, out, data, resume=None, steps=4, lr=1e-2):
    """Trainer with its default optimizer, a checkpoint every steps // 2 steps; returns the logged losses."""
    args = TrainingArguments(out, max_steps=steps, per_device_train_batch_size=2, save_steps=steps // 2,
                             logging_steps=1, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                             learning_rate=lr)
    tr = Trainer(model=model, args=args, train_dataset=data)
    tr.train(resume_from_checkpoint=resume)
    return [h["loss"] for h in tr.state.log_history if "loss" in h]


def _quest_run(model_dir, out, resume=None):
    m = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=QuESTConfig())
    return m, _train(m, out, _data(), resume)


def test_quest_trainer_resume_is_exact(llama_dir, tmp_path):
    m_a, loss_a = _quest_run(llama_dir, str(tmp_path / "a"))
    m_b, loss_b = _quest_run(llama_dir, str(tmp_path / "b"), resume=str(tmp_path / "a" / "checkpoint-2"))
    assert isinstance(m_b.model.layers[0].mlp.down_proj, QuESTLinear)
    assert loss_a[2:] == loss_b[-2:]
    for (n, p), (_, q) in zip(m_a.named_parameters(), m_b.named_parameters()):
        assert torch.equal(p, q), n
    m0 = AutoModelForCausalLM.from_pretrained(llama_dir, quantization_config=QuESTConfig())
    assert not torch.equal(m0.model.layers[0].mlp.down_proj.weight, m_a.model.layers[0].mlp.down_proj.weight)


def test_quest_codes_checkpoint_refused_by_a_qat_model(tmp_path):
    from safetensors.torch import load_file

    cfg = QuESTConfig(weight_bits=2, activation_bits=2, save_format="codes")
    quantize_model(tiny_model("llama"), cfg).save_pretrained(tmp_path)
    qat = quantize_model(tiny_model("llama"), QuESTConfig(weight_bits=2, activation_bits=2))
    with pytest.raises(ValueError, match="save_format='master'"):
        qat.load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=False)


def _nvfp4_lora_run(model_dir, out, resume=None):
    import peft

    m = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=NVFP4Config())
    pm = hfq.nvfp4.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    return pm, _train(pm, out, _data(), resume)


def test_nvfp4_lora_trainer_resume_is_exact(llama_dir, tmp_path):
    m_a, loss_a = _nvfp4_lora_run(llama_dir, str(tmp_path / "a"))
    m_b, loss_b = _nvfp4_lora_run(llama_dir, str(tmp_path / "b"), resume=str(tmp_path / "a" / "checkpoint-2"))
    assert loss_a[2:] == loss_b[-2:]
    sa, sb = m_a.state_dict(), m_b.state_dict()
    assert sa.keys() == sb.keys() and any("lora_B" in k for k in sa)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _quest_built(model_dir):
    return quantize_model(AutoModelForCausalLM.from_pretrained(model_dir), QuESTConfig())


def _qft_built(model_dir):
    m = AutoModelForCausalLM.from_pretrained(model_dir)
    hfq.qft.quantize_model_(m, QFTConfig())
    return m


@pytest.mark.parametrize("build", ["nvfp4", "quest-master", "qft", "quest-built", "qft-built"])
def test_checkpoint_tensors_load_strictly_without_unexpected_keys(llama_dir, tmp_path, build):
    """Trainer's resume reads model.safetensors with model.load_state_dict: the guard marker and the note are
    not unexpected keys there (a strict load passes and Trainer has nothing to warn about)."""
    from hfq._base.checkpoint import NOTE_KEY

    make = {"quest-built": _quest_built, "qft-built": _qft_built}.get(build)
    m = make(llama_dir) if make else AutoModelForCausalLM.from_pretrained(
        llama_dir, quantization_config=_METHODS[build])
    m.save_pretrained(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    assert NOTE_KEY in sd
    res = m.load_state_dict(sd, strict=True)
    assert res.unexpected_keys == [] and res.missing_keys == []
    sd["model.norm.bogus"] = torch.zeros(1)  # a real stray key is still reported
    with pytest.raises(RuntimeError, match="model.norm.bogus"):
        m.load_state_dict(sd, strict=True)
    # and a model reloaded from the checkpoint (the resume of a fresh interpreter) passes over it as well
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert again.load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=True).unexpected_keys == []
    # a dense state dict's weight at the guarded layer is the layer's real weight: reported like the others
    if build in ("nvfp4", "qft", "qft-built"):
        dense = AutoModelForCausalLM.from_pretrained(llama_dir).state_dict()
        res = m.load_state_dict(dense, strict=False)
        linears = [k for k in dense if k.endswith("_proj.weight")]
        assert sorted(k for k in res.unexpected_keys if k.endswith("_proj.weight")) == sorted(linears)


# ----------------------------------------------------------------------------- loading without import hfq
_LOADER = """
import sys, torch
if sys.argv[1] == "1":
    import hfq
from transformers import AutoModelForCausalLM
for d in sys.argv[2:]:
    try:
        m = AutoModelForCausalLM.from_pretrained(d)
    except Exception as e:
        print(d, "ERROR", type(e).__name__)
        continue
    with torch.no_grad():
        out = m(torch.load(d + "/ids.pt")).logits
    print(d, "LOADED", torch.equal(out, torch.load(d + "/ref.pt")), type(m.model.layers[0].mlp.down_proj).__name__)
"""

_METHODS = {"nvfp4": NVFP4Config(), "quest-master": QuESTConfig(), "quest-codes": QuESTConfig(save_format="codes"),
            "qft": QFTConfig(), "qft-int4": QFTConfig(weight_format="int4_group", group_size=32)}


def test_checkpoints_load_only_with_import_hfq(llama_dir, tmp_path):
    dirs = []
    for name, cfg in _METHODS.items():
        m = AutoModelForCausalLM.from_pretrained(llama_dir, quantization_config=cfg)
        d = str(tmp_path / name)
        m.save_pretrained(d)
        with torch.no_grad():
            torch.save(m(IDS).logits, d + "/ref.pt")
        torch.save(IDS, d + "/ids.pt")
        dirs.append(d)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    for with_hfq in ("0", "1"):
        res = subprocess.run([sys.executable, "-c", _LOADER, with_hfq, *dirs], capture_output=True, text=True,
                             env=env, timeout=600)
        lines = {ln.split()[0]: ln.split()[1:] for ln in res.stdout.splitlines() if ln.startswith(str(tmp_path))}
        assert set(lines) == set(dirs), res.stdout + res.stderr
        for d in dirs:
            if with_hfq == "1":
                assert lines[d][:2] == ["LOADED", "True"] and lines[d][2] != "Linear", (d, lines[d])
            else:  # refused (size mismatch on the guard), never re-initialised layers
                assert lines[d] == ["ERROR", "RuntimeError"], (d, lines[d], res.stderr[-2000:])
        if with_hfq == "0":  # the load report printed with the error names the fix
            assert res.stderr.count("hfq checkpoint: run `import hfq` before from_pretrained") >= len(dirs), \
                res.stderr[-3000:]
        if with_hfq == "1":
            assert "UNEXPECTED" not in res.stderr and "MISSING" not in res.stderr, res.stderr[-3000:]


# ----------------------------------------------------------------------------- QuEST block on real widths
def test_quest_default_hadamard_block_fits_a_576_wide_model():
    kw = dict(hidden=576, heads=9, kv_heads=3, intermediate=1536, layers=1)
    m = quantize_model(tiny_model("llama", **kw), QuESTConfig())
    assert m.model.layers[0].self_attn.q_proj.spec.block == 64  # largest power of two dividing 576
    assert m.model.layers[0].mlp.down_proj.spec.block == 128  # 1536 = 512 * 3, capped at 128
    with torch.no_grad():
        assert torch.isfinite(m(IDS).logits).all()
    with pytest.raises(ValueError, match=r"q_proj.*hadamard_block_size=128"):
        quantize_model(tiny_model("llama", **kw), QuESTConfig(hadamard_block_size=128))


# ----------------------------------------------------------------------------- export of tied weights
def test_export_stores_a_tied_lm_head_once(tmp_path):
    from transformers import CompressedTensorsConfig

    cfg = tiny_config("llama")
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    src = tmp_path / "tied"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(src)
    m = AutoModelForCausalLM.from_pretrained(src, quantization_config=NVFP4Config(), dtype=torch.bfloat16)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    out = hfq.nvfp4.export_compressed_tensors(m, str(tmp_path / "ct"))
    sd = load_file(os.path.join(out, "model.safetensors"))
    assert "lm_head.weight" not in sd and "model.embed_tokens.weight" in sd
    ct = AutoModelForCausalLM.from_pretrained(out, quantization_config=CompressedTensorsConfig(dequantize=True),
                                              dtype=torch.bfloat16)
    assert torch.equal(ct.lm_head.weight, m.lm_head.weight)
    with torch.no_grad():
        cos = torch.nn.functional.cosine_similarity(ct(IDS).logits.float().flatten(), m(IDS).logits.float().flatten(),
                                                    dim=0)
    assert cos > 0.999


# ----------------------------------------------------------------------------- on the real model
def _real_batch(model_dir, n=8, length=16):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = ("The quick brown fox jumps over the lazy dog. Quantization-aware training keeps a master copy of "
            "the weights and rounds them on the fly. ") * 8
    ids = torch.tensor(tok(text)["input_ids"][: n * length]).reshape(n, length)
    return [{"input_ids": r, "labels": r} for r in ids]


@pytest.mark.real_model
def test_real_quest_default_config_trains_and_resumes_exactly(smollm2, tmp_path):
    # QuEST on the first two blocks only (transformers' skip rule: entries are regexes matched at the start)
    cfg = QuESTConfig(modules_to_not_convert=["lm_head", r"model\.layers\.([2-9]|[12]\d)\."])

    def run(out, resume=None):
        m = AutoModelForCausalLM.from_pretrained(smollm2, quantization_config=cfg)
        return m, _train(m, out, _real_batch(smollm2, n=4, length=12), resume, steps=2, lr=1e-4)

    m_a, loss_a = run(str(tmp_path / "a"))
    assert [n for n, x in m_a.named_modules() if isinstance(x, QuESTLinear)][-1] == "model.layers.1.mlp.down_proj"
    assert m_a.model.layers[0].self_attn.q_proj.spec.block == 64  # hidden 576
    assert m_a.model.layers[0].mlp.down_proj.spec.block == 128  # intermediate 1536
    m_b, loss_b = run(str(tmp_path / "b"), resume=str(tmp_path / "a" / "checkpoint-1"))
    assert loss_a[1:] == loss_b[-1:]
    for (n, p), (_, q) in zip(m_a.named_parameters(), m_b.named_parameters()):
        assert torch.equal(p, q), n


@pytest.mark.real_model
def test_real_nvfp4_loads_only_with_import_hfq_and_exports_tied_lm_head_once(smollm2, tmp_path):
    ids = torch.stack([b["input_ids"] for b in _real_batch(smollm2, n=2, length=12)])
    m = AutoModelForCausalLM.from_pretrained(smollm2, quantization_config=NVFP4Config())
    d = str(tmp_path / "nvfp4")
    m.save_pretrained(d)
    with torch.no_grad():
        torch.save(m(ids).logits, d + "/ref.pt")
    torch.save(ids, d + "/ids.pt")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    for with_hfq, want in (("0", ["ERROR", "RuntimeError"]), ("1", ["LOADED", "True"])):
        res = subprocess.run([sys.executable, "-c", _LOADER, with_hfq, d], capture_output=True, text=True, env=env,
                             timeout=600)
        lines = {ln.split()[0]: ln.split()[1:3] for ln in res.stdout.splitlines() if ln.startswith(d)}
        assert lines == {d: want}, res.stdout + res.stderr[-3000:]
    out = hfq.nvfp4.export_compressed_tensors(m, str(tmp_path / "ct"))
    sd = load_file(os.path.join(out, "model.safetensors"))
    assert "lm_head.weight" not in sd
    size = os.path.getsize(os.path.join(out, "model.safetensors"))
    emb = m.model.embed_tokens.weight
    assert size < 1.5 * emb.numel() * emb.element_size() + 60e6, size  # one embedding copy + ~52 MB of NVFP4 linears


# ----------------------------------------------------------------------------- one skip rule
@pytest.mark.parametrize("cfg_cls,layer", [(NVFP4Config, "NVFP4Linear"), (QuESTConfig, "QuESTLinear"),
                                           (QFTConfig, "QLinear")])
def test_modules_to_not_convert_follows_transformers_rule(llama_dir, cfg_cls, layer):
    from transformers.quantizers.quantizers_utils import should_convert_module

    skip = ["lm_head", "model.layers.0", "down_proj", r"model\.layers\.\d+\.self_attn\.k_proj"]
    m = AutoModelForCausalLM.from_pretrained(llama_dir, quantization_config=cfg_cls(modules_to_not_convert=skip))
    kinds = {n: type(x).__name__ for n, x in m.named_modules() if type(x).__name__ in ("Linear", layer)}
    assert kinds == {n: ("Linear" if not should_convert_module(n, skip) else layer) for n in kinds}
    assert kinds["model.layers.1.mlp.up_proj"] == layer and kinds["model.layers.1.self_attn.q_proj"] == layer
    for n in ("model.layers.0.mlp.up_proj", "model.layers.1.mlp.down_proj", "model.layers.1.self_attn.k_proj",
              "lm_head"):
        assert kinds[n] == "Linear", n


@pytest.mark.parametrize("cfg", [QFTConfig(), QFTConfig(weight_format="fp8_e4m3_row")], ids=["qft", "eco-fp8"])
def test_sharded_checkpoint_loads_whole_through_trainers_loader(llama_dir, tmp_path, cfg):
    """Trainer's resume and load_best_model_at_end load a sharded checkpoint one file at a time
    (load_sharded_checkpoint: load_state_dict(shard, strict=False) per file): a QFT/ECO weight whose tensors fall
    in two files is loaded once its last piece arrives, not skipped."""
    import json

    from transformers.trainer_utils import load_sharded_checkpoint

    m = AutoModelForCausalLM.from_pretrained(llama_dir, quantization_config=cfg)
    with torch.no_grad():  # weights the fresh model below does not have
        for p in m.parameters():
            if p.dtype.is_floating_point and not isinstance(p, hfq.qparam.QParam):
                p.add_(0.01)
        for mod in m.modules():
            if isinstance(mod, hfq.qparam.QLinear):
                mod.weight.copy_(mod.weight.dequantize() * 1.5)
    for kb in range(20, 400, 4):  # a shard size at which some layer's tensors sit in two files
        m.save_pretrained(tmp_path, max_shard_size=f"{kb}KB")
        files = {}
        for k, f in json.load(open(tmp_path / "model.safetensors.index.json"))["weight_map"].items():
            if ".weight_" in k:
                files.setdefault(k.split(".weight_")[0], set()).add(f)
        if any(len(f) > 1 for f in files.values()):
            break
    else:
        pytest.fail("no shard size splits a layer")
    fresh = AutoModelForCausalLM.from_pretrained(llama_dir, quantization_config=cfg)
    load_sharded_checkpoint(fresh, str(tmp_path), strict=False)
    ids = torch.randint(4, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, m(ids).logits)


def test_reload_takes_run_options_and_refuses_what_the_checkpoint_decided(llama_dir, tmp_path):
    """from_pretrained(saved_dir, quantization_config=cfg): the options of how the model runs or trains
    (RELOAD_OPTIONS: QuEST's estimator / trust_scale, NVFP4's compute_dtype, QFT's gradient_bits) are taken from
    cfg; a field set away from its default to another value than the checkpoint's is an error naming it (it was
    dropped silently before); fields left at their defaults follow the checkpoint."""
    quest = AutoModelForCausalLM.from_pretrained(llama_dir, quantization_config=QuESTConfig(weight_bits=2))
    quest.save_pretrained(tmp_path / "quest")
    ste = AutoModelForCausalLM.from_pretrained(tmp_path / "quest", quantization_config=QuESTConfig(estimator="ste"))
    layer = ste.model.layers[0].mlp.down_proj
    assert isinstance(layer, QuESTLinear) and layer.spec.trust is False and layer.spec.wbits == 2
    assert ste.config.quantization_config.estimator == "ste"
    with pytest.warns(UserWarning, match=r"keeps its weight_bits=2 \(the QuESTConfig passed has the defaults"):
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "quest", quantization_config=QuESTConfig())
    assert plain.model.layers[0].mlp.down_proj.spec.wbits == 2  # defaults: the checkpoint's settings, said
    with pytest.raises(ValueError, match=r"weight_bits=3 \(the checkpoint has 2\).*\['estimator', 'trust_scale'\]"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "quest", quantization_config=QuESTConfig(weight_bits=3))

    AutoModelForCausalLM.from_pretrained(llama_dir, quantization_config=NVFP4Config()).save_pretrained(tmp_path / "fp4")
    bf = AutoModelForCausalLM.from_pretrained(tmp_path / "fp4", quantization_config=NVFP4Config(compute_dtype="bfloat16"))
    assert bf.model.layers[0].mlp.down_proj.compute_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="format='mxfp4'"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "fp4", quantization_config=NVFP4Config(format="mxfp4"))

    AutoModelForCausalLM.from_pretrained(llama_dir, quantization_config=QFTConfig()).save_pretrained(tmp_path / "qft")
    g8 = AutoModelForCausalLM.from_pretrained(tmp_path / "qft", quantization_config=QFTConfig(gradient_bits=8))
    assert g8.config.quantization_config.gradient_bits == 8
    with pytest.raises(ValueError, match="weight_format='fp8_e4m3_row'"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "qft", quantization_config=QFTConfig(weight_format="fp8_e4m3_row"))


@pytest.mark.parametrize("cfg", [QFTConfig(), QFTConfig(weight_format="fp8_e4m3_row")], ids=["qft", "eco-fp8"])
def test_qft_sequence_classifier_keeps_its_new_head_dense(llama_dir, tmp_path, cfg):
    """AutoModelForSequenceClassification from a causal LM checkpoint: the new `score` head (no weight in the
    checkpoint) stays dense and trainable, is reported, and the saved classifier reloads equal."""
    from transformers import AutoModelForSequenceClassification

    with pytest.warns(UserWarning, match=r"\['score'\] are not in the checkpoint"):
        m = AutoModelForSequenceClassification.from_pretrained(llama_dir, quantization_config=cfg, num_labels=3)
    assert type(m.score) is torch.nn.Linear and m.score.weight.requires_grad
    assert "score" in m.hfq_quantization_report["skipped"] and "score" not in m.hfq_quantization_report["quantized"]
    ids = torch.randint(4, 90, (2, 7), generator=torch.Generator().manual_seed(0))
    m(ids, labels=torch.tensor([0, 2])).loss.backward()
    assert m.score.weight.grad.abs().sum() > 0
    m.save_pretrained(tmp_path)
    again = AutoModelForSequenceClassification.from_pretrained(tmp_path)
    assert type(again.score) is torch.nn.Linear
    with torch.no_grad():
        assert torch.equal(again(ids).logits, m(ids).logits)
    # from an hfq QFT causal-LM checkpoint (pre-quantized, no score): the same, not an empty quantized placeholder
    AutoModelForCausalLM.from_pretrained(llama_dir, quantization_config=cfg).save_pretrained(tmp_path / "lm")
    with pytest.warns(UserWarning, match=r"\['score'\] are not in the checkpoint"):
        cls = AutoModelForSequenceClassification.from_pretrained(tmp_path / "lm", num_labels=3)
    assert type(cls.score) is torch.nn.Linear and cls.score.weight.requires_grad
    assert cls.score.weight.abs().max() > 1e-3 and "score" in cls.hfq_quantization_report["skipped"]


def test_qft_decoder_linear_missing_from_a_dense_checkpoint_is_an_error(tmp_path):
    """Only task heads (outside base_model_prefix) may lack a weight: a decoder linear missing from the checkpoint
    is a broken checkpoint, refused rather than kept dense."""
    from safetensors.torch import save_file

    src = save_tiny(tmp_path / "src", arch="llama")
    sd = load_file(str(tmp_path / "src" / "model.safetensors"))
    del sd["model.layers.0.self_attn.q_proj.weight"]
    save_file(sd, str(tmp_path / "src" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no weight was found in the checkpoint for \['model.layers.0.self_attn.q_proj'\]"):
        AutoModelForCausalLM.from_pretrained(src, quantization_config=QFTConfig())
