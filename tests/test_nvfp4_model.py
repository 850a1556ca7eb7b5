"""NVFP4Config end to end with the real transformers / PEFT / compressed-tensors on tiny models."""
import json
import os

import peft
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import hfq
from hfq_kernels.reference import fp4
from hfq.nvfp4 import NVFP4Config, NVFP4Linear
from hfq.tiny import save_tiny

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _ids(n=2, t=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 100, (n, t), generator=g)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny(tmp_path_factory.mktemp("m") / "qwen2", arch="qwen2"))


@pytest.fixture(scope="module")
def qmodel(tiny):
    return AutoModelForCausalLM.from_pretrained(tiny, quantization_config=NVFP4Config())


def test_config_registered_and_validated():
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

    assert AUTO_QUANTIZATION_CONFIG_MAPPING["hfq_nvfp4"] is NVFP4Config
    assert AUTO_QUANTIZER_MAPPING["hfq_nvfp4"].__name__ == "NVFP4HfQuantizer"
    with pytest.raises(ValueError, match="format"):
        NVFP4Config(format="int4")
    with pytest.raises(ValueError, match="compute_dtype"):
        NVFP4Config(compute_dtype="int8")
    with pytest.raises(ValueError, match="modules_to_not_convert"):
        NVFP4Config(modules_to_not_convert="lm_head")
    assert NVFP4Config(compute_dtype=torch.bfloat16).compute_dtype == "bfloat16"
    assert NVFP4Config.from_dict(NVFP4Config(format="mxfp4").to_dict()).format == "mxfp4"


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_quantize_on_load_logits_close_to_dense(tmp_path, arch):
    d = save_tiny(tmp_path / arch, arch=arch)
    ref = AutoModelForCausalLM.from_pretrained(d)
    m = AutoModelForCausalLM.from_pretrained(d, quantization_config=NVFP4Config())
    lin = [n for n, mod in m.named_modules() if isinstance(mod, NVFP4Linear)]
    assert len(lin) == 7 * ref.config.num_hidden_layers
    assert type(m.lm_head) is torch.nn.Linear and type(m.model.embed_tokens) is torch.nn.Embedding
    assert not any(n.endswith(".weight") and "layers" in n and "norm" not in n for n in m.state_dict())
    x = _ids()
    a, b = ref(x).logits.flatten(), m(x).logits.flatten()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
    print(f"{arch}: NVFP4 vs fp32 logits cosine similarity {cos:.5f}")
    assert cos > 0.98
    rep = m.hfq_quantization_report
    assert set(rep["quantized"]) == set(lin) and "lm_head" in rep["skipped"]
    assert 0.05 < max(rep["rel_error"].values()) < 0.13


def test_layer_matches_reference_and_input_gets_grad(qmodel):
    layer = qmodel.model.layers[0].self_attn.q_proj  # Qwen2's q_proj has a bias
    assert layer.bias is not None
    w = fp4.nvfp4_dequantize(layer.weight_packed, layer.weight_scale, layer.weight_global_scale, torch.float32)
    x = torch.randn(3, layer.in_features, requires_grad=True)
    y = layer(x)
    assert torch.allclose(y, x @ w.T + layer.bias, atol=1e-5)
    y.sum().backward()
    assert torch.allclose(x.grad, w.sum(0).expand(3, -1), atol=1e-5)
    if layer.bias.requires_grad:  # the bias is an ordinary parameter; the codes are frozen buffers
        assert torch.allclose(layer.bias.grad, torch.full_like(layer.bias, 3.0))


def test_dtype_cast_keeps_codes_and_scales(qmodel, tiny):
    m = AutoModelForCausalLM.from_pretrained(tiny, quantization_config=NVFP4Config())
    layer = m.model.layers[0].self_attn.q_proj
    gs = layer.weight_global_scale.clone()
    m.to(torch.bfloat16)
    assert layer.weight_scale.dtype == torch.float8_e4m3fn and layer.weight_global_scale.dtype == torch.float32
    assert torch.equal(layer.weight_global_scale, gs)
    assert m(_ids()).logits.dtype == torch.bfloat16


def test_save_reload_identical(qmodel, tmp_path):
    qmodel.save_pretrained(tmp_path / "q")
    files = os.listdir(tmp_path / "q")
    assert "model.safetensors" in files and not any(f.endswith((".bin", ".pt", ".pkl")) for f in files)
    cfg = json.load(open(tmp_path / "q" / "config.json"))["quantization_config"]
    assert cfg["quant_method"] == "hfq_nvfp4" and cfg["format"] == "nvfp4"
    sd = load_file(tmp_path / "q" / "model.safetensors")
    k = "model.layers.0.self_attn.q_proj"
    assert sd[f"{k}.weight_packed"].dtype == torch.uint8 and sd[f"{k}.weight_scale"].dtype == torch.float8_e4m3fn
    m2 = AutoModelForCausalLM.from_pretrained(tmp_path / "q")  # no quantization_config passed
    assert isinstance(m2.model.layers[1].mlp.up_proj, NVFP4Linear)
    x = _ids()
    assert torch.equal(m2(x).logits, qmodel(x).logits)


def test_mxfp4_format_roundtrip(tiny, tmp_path):
    m = AutoModelForCausalLM.from_pretrained(tiny, quantization_config=NVFP4Config(format="mxfp4"))
    layer = m.model.layers[0].self_attn.q_proj
    assert layer.format == "mxfp4" and layer.weight_scale.dtype == torch.uint8 and layer.weight_global_scale is None
    m.save_pretrained(tmp_path / "mx")
    m2 = AutoModelForCausalLM.from_pretrained(tmp_path / "mx")
    x = _ids()
    assert torch.equal(m2(x).logits, m(x).logits)


def test_compressed_tensors_interop(tiny, tmp_path):
    from _hfq_test_utils import assert_ct_export_matches
    from transformers import CompressedTensorsConfig

    m = AutoModelForCausalLM.from_pretrained(tiny, quantization_config=NVFP4Config(), dtype=torch.bfloat16)
    out = hfq.nvfp4.export_compressed_tensors(m, str(tmp_path / "ct"))
    cfg = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
    assert cfg["format"] == "nvfp4-pack-quantized" and "lm_head" in cfg["ignore"]
    sd = load_file(os.path.join(out, "model.safetensors"))
    ct = AutoModelForCausalLM.from_pretrained(out, quantization_config=CompressedTensorsConfig(dequantize=True),
                                              dtype=torch.bfloat16)
    for name, mod in m.named_modules():
        if not isinstance(mod, NVFP4Linear):
            continue
        assert_ct_export_matches(sd, name, mod, ct.get_submodule(name).weight, 2 ** -7)
    x = _ids()
    cos = torch.nn.functional.cosine_similarity(ct(x).logits.float().flatten(), m(x).logits.float().flatten(), dim=0)
    assert cos > 0.999


def test_compressed_tensors_export_writes_checkpoint_names_and_refuses_moe(tmp_path):
    """transformers 5 renames some modules at load (GPT-NeoX's embed_out is its lm_head): the export used to write
    the internal names, not the checkpoint's that save_pretrained (and vLLM's loaders) use. MoE models, whose
    experts and routers hfq leaves in full precision outside nn.Linear, are refused."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("gpt_neox", vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "neox")
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "neox", quantization_config=NVFP4Config(),
                                             dtype=torch.bfloat16)
    out = hfq.nvfp4.export_compressed_tensors(m, str(tmp_path / "ct"))
    sd = load_file(os.path.join(out, "model.safetensors"))
    assert "embed_out.weight" in sd and not any(k.startswith("lm_head") for k in sd)
    assert {"lm_head", "embed_out"} <= set(json.load(open(os.path.join(out, "config.json")))["quantization_config"]
                                           ["ignore"])
    ct = AutoModelForCausalLM.from_pretrained(out)
    x = _ids()
    with torch.no_grad():
        assert torch.equal(ct(x).logits, m(x).logits)
    moe = AutoConfig.for_model("mixtral", vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1, intermediate_size=64, num_local_experts=2)
    AutoModelForCausalLM.from_config(moe).save_pretrained(tmp_path / "moe")
    with pytest.warns(UserWarning, match="experts"):
        m = AutoModelForCausalLM.from_pretrained(tmp_path / "moe", quantization_config=NVFP4Config())
    with pytest.raises(ValueError, match=r"hold weights outside nn.Linear layers \(fused MoE experts, routers\)"):
        hfq.nvfp4.export_compressed_tensors(m, str(tmp_path / "ct_moe"))


def test_compressed_tensors_export_of_an_fp32_model_is_bf16_and_runs(tiny, tmp_path):
    """compressed-tensors decompresses NVFP4 to bf16 whatever the config says: an fp32 model's export is bf16 (with
    a warning), so transformers' default load of it runs (with fp32 weights beside it, its first product failed)."""
    m = AutoModelForCausalLM.from_pretrained(tiny, quantization_config=NVFP4Config())
    assert m.dtype == torch.float32
    with pytest.warns(UserWarning, match="export is bfloat16"):
        out = hfq.nvfp4.export_compressed_tensors(m, str(tmp_path / "ct32"))
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"
    sd = load_file(os.path.join(out, "model.safetensors"))
    assert sd["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert sd["model.layers.0.mlp.down_proj.weight_global_scale"].dtype == torch.float32
    ct = AutoModelForCausalLM.from_pretrained(out)  # defaults, as `vllm serve` / a user would
    x = _ids()
    with torch.no_grad():
        cos = torch.nn.functional.cosine_similarity(ct(x).logits.float().flatten(), m(x).logits.flatten(), dim=0)
    assert cos > 0.999


def test_lora_trains_only_adapters_and_lowers_loss(tiny, tmp_path):
    m = AutoModelForCausalLM.from_pretrained(tiny, quantization_config=NVFP4Config())
    pm = hfq.nvfp4.get_peft_model(m, peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    wrapped = [n for n, mod in pm.named_modules() if isinstance(mod, hfq.nvfp4.NVFP4LoraLinear)]
    assert len(wrapped) == 7 * m.config.num_hidden_layers
    trainable = {n for n, p in pm.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    before = {n: t.detach().clone() for n, t in list(pm.named_parameters()) + list(pm.named_buffers())}
    x = _ids(4, 16)
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=5e-3)
    losses = []
    for _ in range(8):
        loss = pm(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05
    after = dict(list(pm.named_parameters()) + list(pm.named_buffers()))
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all("lora_B" in n or "lora_A" in n for n in changed)
    pm.save_pretrained(tmp_path / "adapter")
    assert os.path.exists(tmp_path / "adapter" / "adapter_model.safetensors")
    # the adapter reloads onto a fresh NVFP4 base (hfq's LoRA layer through the registered config)
    base = AutoModelForCausalLM.from_pretrained(tiny, quantization_config=NVFP4Config())
    cfg = hfq.nvfp4.register_lora(peft.LoraConfig.from_pretrained(tmp_path / "adapter"))
    re = peft.PeftModel.from_pretrained(base, tmp_path / "adapter", config=cfg)
    assert torch.allclose(re(x).logits, pm(x).logits, atol=1e-5)


def test_merge_and_unload_gives_dense_model_and_requantize(tiny, tmp_path):
    torch.manual_seed(0)  # the random adapter (init_lora_weights=False) sets how far requantization moves the logits
    m = AutoModelForCausalLM.from_pretrained(tiny, quantization_config=NVFP4Config())
    pm = hfq.nvfp4.get_peft_model(m, peft.LoraConfig(r=4, target_modules=TARGETS, init_lora_weights=False))
    x = _ids()
    y = pm(x).logits
    pm.merge_adapter()
    assert torch.allclose(pm(x).logits, y, atol=1e-4)
    pm.unmerge_adapter()
    assert torch.equal(pm(x).logits, y)  # unmerge restores the exact NVFP4 base
    nv, report = hfq.nvfp4.merge_and_requantize(pm)
    assert isinstance(nv.model.layers[0].self_attn.q_proj, NVFP4Linear)
    assert set(report) == {n for n, mod in nv.named_modules() if isinstance(mod, NVFP4Linear)}
    assert all(0 < r["requant_rel_error"] < 0.13 for r in report.values())
    cos = torch.nn.functional.cosine_similarity(nv(x).logits.flatten(), y.flatten(), dim=0)
    assert cos > 0.95

    m = AutoModelForCausalLM.from_pretrained(tiny, quantization_config=NVFP4Config())
    pm = hfq.nvfp4.get_peft_model(m, peft.LoraConfig(r=4, target_modules=TARGETS, init_lora_weights=False))
    y = pm(x).logits
    dense = pm.merge_and_unload()
    assert type(dense.model.layers[0].mlp.down_proj) is torch.nn.Linear
    assert torch.allclose(dense(x).logits, y, atol=1e-4)
    dense = dense.dequantize()  # drops the quantization config so it saves as a plain model
    dense.save_pretrained(tmp_path / "dense")
    assert "quantization_config" not in json.load(open(tmp_path / "dense" / "config.json"))
    assert torch.allclose(AutoModelForCausalLM.from_pretrained(tmp_path / "dense")(x).logits, y, atol=1e-4)


def test_block_misfit_layer_left_dense_or_strict_error(tmp_path):
    d = save_tiny(tmp_path / "odd", arch="qwen2", intermediate=72)  # down_proj in_features=72
    m = AutoModelForCausalLM.from_pretrained(d, quantization_config=NVFP4Config())
    assert type(m.model.layers[0].mlp.down_proj) is torch.nn.Linear
    assert isinstance(m.model.layers[0].mlp.up_proj, NVFP4Linear)
    assert "not a multiple of block size 16" in m.hfq_quantization_report["skipped"]["model.layers.0.mlp.down_proj"]
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj: in_features=72.*strict"):
        AutoModelForCausalLM.from_pretrained(d, quantization_config=NVFP4Config(strict=True))


def test_nan_weight_refused_naming_layer(tiny, tmp_path):
    sd = load_file(os.path.join(tiny, "model.safetensors"))
    sd["model.layers.1.mlp.up_proj.weight"][3, 7] = float("nan")
    d = tmp_path / "nan"
    os.makedirs(d)
    for f in os.listdir(tiny):
        if f != "model.safetensors":
            os.symlink(os.path.join(tiny, f), d / f)
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj.*NaN/Inf"):
        AutoModelForCausalLM.from_pretrained(d, quantization_config=NVFP4Config())


@pytest.mark.parametrize("corrupt", ["missing", "dtype", "shape"])
def test_corrupt_checkpoint_names_the_tensor(qmodel, tmp_path, corrupt):
    qmodel.save_pretrained(tmp_path / "q")
    path = tmp_path / "q" / "model.safetensors"
    sd = load_file(path)
    key = "model.layers.1.self_attn.k_proj.weight_scale"
    if corrupt == "missing":
        del sd[key]
    elif corrupt == "dtype":
        sd[key] = sd[key].view(torch.uint8)
    else:
        sd[key] = sd[key][:, :1].contiguous()
    save_file(sd, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        AutoModelForCausalLM.from_pretrained(tmp_path / "q")


def test_cli_quantize_and_export_end_to_end(tiny, tmp_path, capsys):
    from hfq.cli import main

    assert main(["quantize", tiny, "--out", str(tmp_path / "q")]) == 0
    out = capsys.readouterr().out
    assert "layers quantized" in out and "| 14 |" in out.replace(" ", "").replace("|14|", "| 14 |")
    assert "max relative error" in out and "lm_head" in out
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert isinstance(m.model.layers[0].self_attn.o_proj, NVFP4Linear)
    assert main(["export", str(tmp_path / "q"), "--out", str(tmp_path / "ct")]) == 0
    cfg = json.load(open(tmp_path / "ct" / "config.json"))["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors"
    assert main(["quantize", tiny, "--out", str(tmp_path / "ct2"), "--export", "compressed-tensors"]) == 0
    assert load_file(tmp_path / "ct2" / "model.safetensors")["model.layers.0.mlp.up_proj.weight_packed"].dtype == torch.uint8
    with pytest.raises(SystemExit, match="compressed-tensors.*not hfq_nvfp4"):
        main(["export", str(tmp_path / "ct"), "--out", str(tmp_path / "ct3")])


# ------------------------------------------------------------------ the eager per-shape plan path of NVFP4Linear
# On CUDA a plain eager call takes NVFP4Linear's kept plan (_plan); SETTINGS.plan_on_cpu sends CPU tensors the same
# way (kernels under TRITON_INTERPRET=1), so these run that host path on both.
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def eager(monkeypatch):
    import hfq_kernels.nvfp4 as K
    from hfq_kernels._settings import SETTINGS

    monkeypatch.setattr(SETTINGS, "plan_on_cpu", True)
    return K


def _layer(n=48, k=64, bias=True, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.1)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return NVFP4Linear.from_linear(lin.to(dtype).to(DEV))


def test_eager_plan_values_grads_and_reuse(eager):
    layer = _layer()
    layer.bias.requires_grad_(True)
    p, s, g = layer.weight_packed, layer.weight_scale, layer.weight_global_scale
    for shape in ((1, 64), (2, 5, 64), (80, 64)):
        x = torch.randn(*shape, dtype=torch.bfloat16, device=DEV, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        b2 = layer.bias.detach().clone().requires_grad_()
        y2 = torch.ops.hfq.nvfp4_linear(x2, p, s, g, b2)  # the registered op (may tune this shape first)
        y = layer(x)
        plans = layer._hfq_plans[1]
        plan = plans[(x.shape, x.dtype, x.device)]
        b = layer.bias.detach()
        assert torch.equal(y, eager.plan_linear(x.detach(), p, s, g, b, config=plan.config).forward(x.detach(), b)
                           if plan.config else None)
        gy = torch.randn_like(y)
        y.backward(gy)
        y2.backward(gy)  # the registered op's autograd
        torch.testing.assert_close(x.grad, x2.grad)
        torch.testing.assert_close(layer.bias.grad, b2.grad, rtol=2e-2, atol=2e-2)
        layer.bias.grad = None
        with torch.no_grad():
            layer(x)
        assert plans[(x.shape, x.dtype, x.device)] is plan  # no second planning for a known shape
    assert len(layer._hfq_plans[1]) == 3


def test_eager_plan_errors_on_first_call_of_a_shape(eager):
    layer = _layer(bias=True)
    layer(torch.randn(3, 64, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match="in_features"):
        layer(torch.randn(3, 32, dtype=torch.bfloat16, device=DEV))
    layer.bias = torch.nn.Parameter(torch.zeros(47, dtype=torch.bfloat16, device=DEV), requires_grad=False)
    with pytest.raises(ValueError, match="bias must have shape"):  # a replaced tensor drops the checked plans
        layer(torch.randn(3, 64, dtype=torch.bfloat16, device=DEV))


def test_eager_plan_follows_new_weights_and_table(eager, monkeypatch):
    layer = _layer(bias=False)
    x = torch.randn(4, 64, dtype=torch.bfloat16, device=DEV)
    y0 = layer(x)
    plan = layer._hfq_plans[1][(x.shape, x.dtype, x.device)]
    monkeypatch.setitem(eager.LINEAR_TUNER.cache, "hfq-test-entry", {"kind": "dequant"})
    layer(x)
    assert layer._hfq_plans[1][(x.shape, x.dtype, x.device)] is not plan  # the tuned table changed: re-planned
    layer.set_weight(-layer.dequantize(torch.float32))
    assert "_hfq_plans" not in layer.__dict__
    torch.testing.assert_close(layer(x), -y0)
    with torch.no_grad():  # in-place update of the codes (e.g. load_state_dict): the plan reads the same tensors
        layer.weight_packed.copy_(_layer(bias=False, seed=1).weight_packed)
        layer.weight_scale.copy_(_layer(bias=False, seed=1).weight_scale)
        layer.weight_global_scale.copy_(_layer(bias=False, seed=1).weight_global_scale)
    torch.testing.assert_close(layer(x), _layer(bias=False, seed=1)(x))


def test_eager_plan_gradient_checkpointing(eager):
    from torch.utils.checkpoint import checkpoint

    layer = _layer()
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    layer(x).float().square().sum().backward()
    ref, x.grad = x.grad, None
    for reentrant in (False, True):
        checkpoint(lambda t: layer(t).float().square().sum(), x, use_reentrant=reentrant).backward()
        torch.testing.assert_close(x.grad, ref)
        x.grad = None


def test_eager_plan_dropped_on_move_and_cast(eager):
    import gc
    import weakref

    layer = _layer()
    layer(torch.randn(2, 64, dtype=torch.bfloat16, device=DEV))
    old = weakref.ref(layer.weight_packed)
    layer.to("meta")  # a move: the plans held the old tensors, which must not survive it
    gc.collect()
    assert old() is None and "_hfq_plans" not in layer.__dict__
    layer = _layer().to(torch.float16)  # a cast keeps the codes; x in fp16 gets an fp16 output
    x = torch.randn(2, 64, dtype=torch.float16, device=DEV)
    assert layer(x).dtype == torch.float16 and layer(x.bfloat16()).dtype == torch.bfloat16


def test_eager_plan_lora_bf16_with_gradient_checkpointing(tiny, monkeypatch):
    """A bf16 NVFP4 + PEFT LoRA model under HF gradient checkpointing: the planned eager path gives the registered
    op's loss and adapter gradients."""
    from hfq_kernels._settings import SETTINGS

    m = AutoModelForCausalLM.from_pretrained(tiny, quantization_config=NVFP4Config(), dtype=torch.bfloat16).to(DEV)
    pm = hfq.nvfp4.get_peft_model(m, peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS,
                                                     init_lora_weights="gaussian"))
    pm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    pm.enable_input_require_grads()
    pm.train()
    x = _ids(2, 12).to(DEV)
    res = []
    for on in (False, True):  # the registered op (CPU: its torch reference), then the planned path
        monkeypatch.setattr(SETTINGS, "plan_on_cpu", on)
        loss = pm(x, labels=x).loss
        loss.backward()
        res.append((loss.detach(), {n: p.grad.clone() for n, p in pm.named_parameters() if p.requires_grad}))
        pm.zero_grad(set_to_none=True)
    layer = pm.base_model.model.model.layers[0].mlp.up_proj.base_layer
    assert isinstance(layer, NVFP4Linear) and "_hfq_plans" in layer.__dict__
    torch.testing.assert_close(res[1][0], res[0][0], rtol=2e-2, atol=2e-2)
    for n, g in res[0][1].items():
        torch.testing.assert_close(res[1][1][n].float(), g.float(), rtol=0.1, atol=0.1 * g.abs().max().item() + 1e-6)
