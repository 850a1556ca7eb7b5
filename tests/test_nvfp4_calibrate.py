"""NVFP4 beyond round-to-nearest: scale search and GPTQ (reference vs ops, never worse than RTN), `calibrate_` on
real transformers models (same format: save / from_pretrained / compressed-tensors export / LoRA), bad input."""
import json
import os
import re

import peft
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import hfq
from hfq.nvfp4 import NVFP4Config, NVFP4Linear, calibrate_
from hfq.tiny import char_tokenizer, save_tiny
from hfq_kernels.reference import fp4
from hfq_kernels.reference import fp4_calib as fc

TEXTS = [f"Sample {i}: the quick brown fox jumps over the lazy dog, then counts to {i * 7} and rests." for i in range(24)]


def _sq_err(w, q):
    return float((fp4.nvfp4_dequantize(*q, torch.float32) - w.float()).square().sum())


def _h_err(w, q, h):
    d = fp4.nvfp4_dequantize(*q, torch.float32) - w.float()
    return float(((d @ h) * d).sum())


# ------------------------------------------------------------------------------------------- reference and ops
def test_e2m1_round_equals_the_encoder_on_boundaries_and_random():
    x = torch.randn(5000) * 3
    b = torch.tensor(fp4._BOUNDS + (0.0, 6.0, 7.0, 1e9))
    x = torch.cat([x, b, -b, torch.tensor([-0.0])])
    x = torch.cat([x, torch.nextafter(x, torch.full_like(x, 1e10)), torch.nextafter(x, torch.full_like(x, -1e10))])
    codes, vals = fc.e2m1_round(x)
    assert torch.equal(codes, fp4.e2m1_encode(x))
    assert torch.equal(vals, fp4.e2m1_decode(codes))


@pytest.mark.parametrize("shape", [(37, 48), (5, 160), (64, 16)])
def test_scale_search_same_format_never_worse_than_rtn(shape):
    g = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(*shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 0.1
    w[0, :16] = 0  # an all-zero block stays zero
    rtn = fp4.nvfp4_quantize(w)
    one = fc.nvfp4_quantize_search(w, global_factors=(1.0,), byte_offsets=(0,))
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(rtn, one))  # RTN is a candidate
    q = torch.ops.hfq.nvfp4_quantize_search(w)
    ref = fc.nvfp4_quantize_search(w, row_chunk=7)  # chunked rows: the same result
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(q, ref))
    assert q[0].dtype == torch.uint8 and q[1].dtype == torch.float8_e4m3fn and q[2].shape == (1,)
    assert _sq_err(w, q) < 0.95 * _sq_err(w, rtn)
    assert torch.equal(fp4.nvfp4_dequantize(*q, torch.float32)[0, :16], torch.zeros(16))


def test_encode_with_rtn_scales_is_the_rtn_quantizer():
    w = torch.randn(33, 80)
    packed, scale, recip = fp4.nvfp4_quantize(w)
    assert torch.equal(fc.encode(w, scale.float(), recip), packed)


def test_gptq_with_identity_hessian_is_rtn_and_lowers_output_error_otherwise():
    g = torch.Generator().manual_seed(0)
    rows, k = 45, 96
    w = torch.randn(rows, k, generator=g) * 0.05
    rtn = fp4.nvfp4_quantize(w)
    u = fc.hessian_inverse_factor(torch.eye(k), damp=0.0)
    packed, scale = torch.ops.hfq.nvfp4_gptq(w, u, rtn[2].expand(rows), 32, False)
    assert torch.equal(packed, rtn[0]) and torch.equal(scale.view(torch.uint8), rtn[1].view(torch.uint8))
    mix = torch.eye(k) + torch.randn(k, k, generator=g) / k ** 0.5  # correlated inputs of uneven size
    x = torch.randn(600, k, generator=g) @ mix * torch.rand(k, generator=g) * 2
    h = x.T @ x / 600
    u = fc.hessian_inverse_factor(h)
    for search in (False, True):
        q = torch.ops.hfq.nvfp4_gptq(w, u, rtn[2], 64, search) + (rtn[2],)
        ref = fc.nvfp4_gptq(w, u, rtn[2], 64, fc.BYTE_OFFSETS if search else (0,))
        assert torch.equal(q[0], ref[0])
        assert _h_err(w, q, h) < 0.85 * _h_err(w, rtn, h)


def test_gptq_refuses_bad_shapes():
    with pytest.raises(ValueError, match="in_features=40"):
        fc.nvfp4_gptq(torch.randn(4, 40), torch.eye(40), torch.ones(1))
    with pytest.raises(ValueError, match=r"\[32, 32\]"):
        fc.nvfp4_gptq(torch.randn(4, 32), torch.eye(16), torch.ones(1))


# ------------------------------------------------------------------------------------------- calibrate_ (tiny)
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny(tmp_path_factory.mktemp("m") / "llama", arch="llama"))


@pytest.fixture(scope="module")
def calibrated(tiny):
    m = AutoModelForCausalLM.from_pretrained(tiny)
    report = calibrate_(m, TEXTS, char_tokenizer(), progress=False, device="cpu")
    return m, report


def test_calibrate_converts_like_a_load_and_beats_rtn_per_layer(tiny, calibrated):
    m, report = calibrated
    rtn = AutoModelForCausalLM.from_pretrained(tiny, quantization_config=NVFP4Config())
    assert m.hfq_quantization_report["quantized"] == rtn.hfq_quantization_report["quantized"]
    assert m.hfq_quantization_report["skipped"] == {"lm_head": "modules_to_not_convert"}
    assert len(report.rows) == 14 and report.tokens == sum(len(t) + 0 for t in TEXTS)
    for r in report.rows:
        assert r["calibrated"] <= r["rtn"], r
    assert sum(r["calibrated"] for r in report.rows) < 0.8 * sum(r["rtn"] for r in report.rows)
    assert sum(r["kept"] == "gptq" for r in report.rows) >= 12
    table = report.table()
    assert "| model.layers.1.mlp.down_proj |" in table and "mean of 14" in table
    ids = torch.tensor([[4, 5, 6, 7, 8, 9, 10, 11]])
    ref = AutoModelForCausalLM.from_pretrained(tiny)
    dense = ref(ids).logits.detach()
    gap = lambda q: float((q(ids).logits - dense).square().mean().detach())  # noqa: E731
    assert gap(m) < gap(rtn)


def test_calibrated_roundtrips_save_load_and_compressed_tensors_bit_exactly(calibrated, tmp_path):
    from _hfq_test_utils import assert_ct_export_matches
    from transformers import CompressedTensorsConfig

    m, _ = calibrated
    m.save_pretrained(tmp_path / "q")
    assert json.load(open(tmp_path / "q" / "config.json"))["quantization_config"]["quant_method"] == "hfq_nvfp4"
    m2 = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    out = hfq.nvfp4.export_compressed_tensors(m, str(tmp_path / "ct"))
    sd = load_file(os.path.join(out, "model.safetensors"))
    ct = AutoModelForCausalLM.from_pretrained(out, quantization_config=CompressedTensorsConfig(dequantize=True))
    n_layers = 0
    for name, mod in m.named_modules():
        if not isinstance(mod, NVFP4Linear):
            continue
        n_layers += 1
        back = m2.get_submodule(name)
        for buf in ("weight_packed", "weight_scale", "weight_global_scale"):
            a, b = getattr(mod, buf), getattr(back, buf)
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (name, buf)
        assert_ct_export_matches(sd, name, mod, ct.get_submodule(name).weight, 2 ** -7)
    assert n_layers == 14
    ids = torch.tensor([[4, 5, 6, 7, 8, 9]])
    assert torch.equal(m2(ids).logits, m(ids).logits)


def test_calibrated_model_trains_with_lora(calibrated):
    m, _ = calibrated
    pm = hfq.nvfp4.get_peft_model(m, peft.LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    ids = torch.tensor([[4, 5, 6, 7, 8, 9, 10]])
    pm(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for n, p in pm.named_parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
    pm.unload()  # leave the module fixture's model as it was


def test_calibrate_accepts_token_ids_and_batches(tiny):
    tok = char_tokenizer()
    ids = [tok(t)["input_ids"] for t in TEXTS]
    a = AutoModelForCausalLM.from_pretrained(tiny)
    ra = calibrate_(a, ids, progress=False, batch_size=5, device="cpu")
    b = AutoModelForCausalLM.from_pretrained(tiny)
    batches = [tok(TEXTS[i:i + 6], return_tensors="pt", padding=True) for i in range(0, len(TEXTS), 6)]
    rb = calibrate_(b, [dict(x) for x in batches], progress=False, device="cpu")
    assert ra.tokens == rb.tokens == sum(map(len, ids))  # padding is not counted (nor used in the Hessians)
    for x, y in zip(ra.rows, rb.rows):
        assert x["calibrated"] == pytest.approx(y["calibrated"], rel=1e-3)


def test_calibrate_bad_input_errors(tiny):
    tok = char_tokenizer()
    m = AutoModelForCausalLM.from_pretrained(tiny)
    with pytest.raises(ValueError, match="calibration data is empty"):
        calibrate_(m, [], tok, progress=False, device="cpu")
    with pytest.raises(ValueError, match="too short: 5 tokens.*min_tokens=128"):
        calibrate_(m, ["hello"], tok, progress=False, device="cpu")
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        calibrate_(m, ["hello", ""], tok, progress=False, device="cpu")
    with pytest.raises(ValueError, match="need tokenizer"):
        calibrate_(m, TEXTS, progress=False, device="cpu")
    with pytest.raises(ValueError, match="format='mxfp4'"):
        calibrate_(m, TEXTS, tok, NVFP4Config(format="mxfp4"), progress=False, device="cpu")
    m.model.layers[1].mlp.unused = torch.nn.Linear(64, 64)  # in the block, never called by its forward
    with pytest.raises(ValueError, match=r"no calibration token reached model\.layers\.1\.mlp\.unused"):
        calibrate_(m, TEXTS, tok, progress=False, device="cpu")
    q = AutoModelForCausalLM.from_pretrained(tiny, quantization_config=NVFP4Config())
    with pytest.raises(ValueError, match="already quantized"):
        calibrate_(q, TEXTS, tok, progress=False, device="cpu")
    with pytest.raises(ValueError, match="scales='mse' applies to format='nvfp4'"):
        NVFP4Config(format="mxfp4", scales="mse")
    with pytest.raises(ValueError, match="scales"):
        NVFP4Config(scales="percentile")


def test_calibrate_refuses_models_it_cannot_quantize_whole(tiny):
    """A model holding PEFT adapters (their own linears would become frozen NVFP4) and a model quantized by another
    method (it would be relabelled hfq_nvfp4 with nothing converted) are refused before anything changes."""
    tok = char_tokenizer()
    pm = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tiny), peft.LoraConfig(r=16, target_modules=["q_proj"]))
    for target in (pm, pm.base_model.model):
        with pytest.raises(ValueError, match="holds PEFT adapters.*calibrate the dense model first"):
            calibrate_(target, TEXTS, tok, progress=False, device="cpu")
    assert not any(isinstance(m, NVFP4Linear) for m in pm.modules())
    qm = hfq.quest.quantize_model(AutoModelForCausalLM.from_pretrained(tiny), hfq.QuESTConfig(weight_bits=4, activation_bits=None))
    with pytest.raises(ValueError, match="already quantized \\(quant_method 'hfq_quest'\\)"):
        calibrate_(qm, TEXTS, tok, progress=False, device="cpu")
    assert qm.config.quantization_config.quant_method == "hfq_quest"


def test_calibrate_that_fails_part_way_leaves_the_model_as_it_was(tiny, tmp_path):
    """An error in block 1 (after block 0 was quantized) restores every replaced linear, bit for bit, so that fixing
    the cause and calling again works and nothing half-quantized can be saved."""
    tok = char_tokenizer()
    m = AutoModelForCausalLM.from_pretrained(tiny)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    m.model.layers[1].mlp.unused = torch.nn.Linear(64, 64)  # in the block, never called by its forward
    with pytest.raises(ValueError, match="no calibration token reached"):
        calibrate_(m, TEXTS, tok, progress=False, device="cpu")
    del m.model.layers[1].mlp.unused
    assert not any(isinstance(x, NVFP4Linear) for x in m.modules())
    assert getattr(m.config, "quantization_config", None) is None
    after = m.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    m.model.layers[1].mlp.up_proj.weight.data[0, 0] = float("nan")  # a later block's weight: named, undone
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight: 1 NaN/Inf"):
        calibrate_(m, TEXTS, tok, progress=False, device="cpu")
    assert not any(isinstance(x, NVFP4Linear) for x in m.modules())
    m.model.layers[1].mlp.up_proj.weight.data[0, 0] = before["model.layers.1.mlp.up_proj.weight"][0, 0]
    calibrate_(m, TEXTS, tok, progress=False, device="cpu")
    assert sum(isinstance(x, NVFP4Linear) for x in m.modules()) == 14


def test_calibrate_takes_a_tokenizer_output_and_text_rows(tiny):
    """tok(texts, padding=True, return_tensors="pt") is one batch of rows (not two texts named by its keys), and
    datasets-style {"text": ...} rows are tokenized: both calibrate on the same tokens as the list of texts."""
    tok = char_tokenizer()
    ref = calibrate_(AutoModelForCausalLM.from_pretrained(tiny), TEXTS, tok, progress=False, device="cpu")
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    a = calibrate_(AutoModelForCausalLM.from_pretrained(tiny), enc, progress=False, device="cpu", batch_size=5)
    b = calibrate_(AutoModelForCausalLM.from_pretrained(tiny), [{"text": t} for t in TEXTS], tok, progress=False,
                   device="cpu")
    assert a.tokens == b.tokens == ref.tokens and a.sequences == b.sequences == len(TEXTS)
    for x, y in zip(ref.rows, a.rows):
        assert x["calibrated"] == pytest.approx(y["calibrated"], rel=1e-3)
    m = AutoModelForCausalLM.from_pretrained(tiny)
    with pytest.raises(ValueError, match="needs 'input_ids'.*got keys \\['ids'\\]"):
        calibrate_(m, {"ids": enc["input_ids"]}, progress=False, device="cpu")
    with pytest.raises(ValueError, match="rows need 'input_ids' or 'text'; got keys \\['content'\\]"):
        calibrate_(m, [{"content": t} for t in TEXTS], tok, progress=False, device="cpu")


def test_calibrate_numeric_arguments_context_and_little_data(tiny):
    tok = char_tokenizer()
    m = AutoModelForCausalLM.from_pretrained(tiny)
    for kw, msg in ((dict(damp=-1.0), "damp=-1.0; allowed"), (dict(damp=float("nan")), "damp=nan"),
                    (dict(block=0), "block=0; allowed: a positive multiple of 16"), (dict(block=24), "block=24")):
        with pytest.raises(ValueError, match=msg):
            calibrate_(m, TEXTS, tok, progress=False, device="cpu", **kw)
    m.model.embed_tokens.weight.data[tok(TEXTS[0])["input_ids"][-1]] = float("inf")  # overflowing activations
    with pytest.raises(ValueError, match=r"non-finite activations \(NaN/Inf\) enter \['model\.layers\.0\.self_attn"):
        calibrate_(m, TEXTS, tok, progress=False, device="cpu")
    m = AutoModelForCausalLM.from_pretrained(tiny)
    m.config.max_position_embeddings = 32  # samples are cut to the model's context, not max_length=512
    r = calibrate_(m, TEXTS, tok, progress=False, device="cpu", damp=0.0)  # damp 0 factors (its retries grow)
    assert r.tokens == sum(min(len(tok(t)["input_ids"]), 32) for t in TEXTS)
    m = AutoModelForCausalLM.from_pretrained(tiny)
    with pytest.warns(UserWarning, match="fewer calibration tokens than twice their input width"):
        calibrate_(m, TEXTS[:1], tok, progress=False, device="cpu", min_tokens=16)


def test_calibrate_refuses_blocks_of_mixed_attention_types(tmp_path):
    """Gemma 2/3 alternate sliding and full attention (config.layer_types; their blocks have no attention_type
    in transformers 5): every block would be calibrated with the first block's mask and RoPE."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("gemma2", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=16, intermediate_size=64, sliding_window=8)
    assert sorted(set(cfg.layer_types)) == ["full_attention", "sliding_attention"]
    m = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match=r"several attention types \['full_attention', 'sliding_attention'\]"):
        calibrate_(m, TEXTS, char_tokenizer(), progress=False, device="cpu")


def test_cli_quantize_with_calibration(tiny, tmp_path, capsys):
    from hfq.cli import main

    char_tokenizer().save_pretrained(tiny)
    data = tmp_path / "calib.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in TEXTS) + "\n")
    assert main(["quantize", tiny, "--out", str(tmp_path / "q"), "--calibrate", str(data)]) == 0
    out = capsys.readouterr().out
    assert "| RTN error | calibrated error |" in out and "mean of 14" in out and "layers quantized" in out
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert isinstance(m.model.layers[1].mlp.down_proj, NVFP4Linear)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": 3}\n')
    capsys.readouterr()
    assert main(["quantize", tiny, "--out", str(tmp_path / "q2"), "--calibrate", str(bad)]) == 1
    assert re.search(r"hfq quantize: error: .*bad\.jsonl:2: expected a JSON string", capsys.readouterr().err)


def test_mse_scales_on_load_never_worse_than_rtn(tiny, tmp_path):
    rtn = AutoModelForCausalLM.from_pretrained(tiny, quantization_config=NVFP4Config())
    mse = AutoModelForCausalLM.from_pretrained(tiny, quantization_config=NVFP4Config(scales="mse"))
    a, b = rtn.hfq_quantization_report["rel_error"], mse.hfq_quantization_report["rel_error"]
    assert all(b[n] <= a[n] for n in a) and sum(b.values()) < 0.95 * sum(a.values())
    mse.save_pretrained(tmp_path / "m")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    layer = "model.layers.0.mlp.up_proj"
    assert torch.equal(back.get_submodule(layer).weight_packed, mse.get_submodule(layer).weight_packed)


# ------------------------------------------------------------------------------------------- the real model
@pytest.mark.real_model
def test_real_model_calibration_beats_rtn_in_every_layer(smollm2):
    tok = AutoTokenizer.from_pretrained(smollm2)
    texts = [t for t in open(os.path.join(os.path.dirname(__file__), "..", "examples", "data",
                                          "qft_real_train.txt")).read().split("\n\n") if t.strip()]
    m = AutoModelForCausalLM.from_pretrained(smollm2, num_hidden_layers=2)  # the first blocks: fast, same shapes
    report = calibrate_(m, texts[:12], tok, progress=False, device="cpu")
    assert len(report.rows) == 14 and report.tokens > 1000
    for r in report.rows:
        assert r["calibrated"] <= r["rtn"], r
    gain = [1 - r["calibrated"] / r["rtn"] for r in report.rows]
    print(report.table())
    assert sum(gain) / len(gain) > 0.2 and sum(r["kept"] == "gptq" for r in report.rows) >= 13


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path of calibrate_ (the CPU path is tested above)")
def test_calibrate_on_cuda_from_a_host_model(tiny):
    tok = char_tokenizer()
    cpu = AutoModelForCausalLM.from_pretrained(tiny)
    rc = calibrate_(cpu, TEXTS, tok, progress=False, device="cpu")
    m = AutoModelForCausalLM.from_pretrained(tiny)  # held on the host; blocks go to the GPU one at a time
    rg = calibrate_(m, TEXTS, tok, progress=False, device="cuda")
    assert all(p.device.type == "cuda" for p in m.parameters())
    for a, b in zip(rc.rows, rg.rows):
        assert b["calibrated"] <= b["rtn"] and b["calibrated"] == pytest.approx(a["calibrated"], rel=0.05, abs=1e-3)
    ids = torch.tensor([[4, 5, 6, 7, 8, 9]])
    torch.testing.assert_close(m(ids.cuda()).logits.cpu(), cpu(ids).logits, rtol=0.05, atol=0.05)
