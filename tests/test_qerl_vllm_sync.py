"""The vLLM sync stream of an NVFP4 + LoRA policy equals what `hfq export` writes for the merged model."""
import torch
from safetensors.torch import load_file

import hfq  # noqa: F401
from hfq.qerl.aqn import AdaptiveQuantizationNoise
from hfq.qerl.vllm_sync import nvfp4_vllm_weights


def _policy(path):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from hfq.nvfp4 import NVFP4Config, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=NVFP4Config(), dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM")
    pm = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a non-zero delta (PEFT initialises B to zero)
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return pm


def test_stream_matches_merged_export(tiny_dir, tmp_path):
    import glob

    from hfq.nvfp4 import export_compressed_tensors, merge_and_requantize

    pm = _policy(tiny_dir)
    before = {n: b.clone() for n, b in pm.named_buffers()}
    stream = dict(nvfp4_vllm_weights(pm))
    assert all(torch.equal(b, before[n]) for n, b in pm.named_buffers())  # the policy is not touched
    lora_layers = {k.rsplit(".", 1)[0] for k in stream if k.endswith(".weight_packed")}
    assert len(lora_layers) == 3 * 2  # q, v, down in 2 blocks
    assert not any("lora_" in k or "base_layer" in k or k.startswith("base_model") for k in stream)
    norms = [k for k in stream if "norm" in k]
    assert len(norms) == 2 * 2 + 1  # input/post-attention norms per block + final norm

    merged, _ = merge_and_requantize(pm)
    export_compressed_tensors(merged, str(tmp_path / "ct"))
    exported = {}
    for f in glob.glob(str(tmp_path / "ct" / "*.safetensors")):
        exported.update(load_file(f))
    for k, v in stream.items():
        assert k in exported, k
        # the export is bf16 (compressed-tensors decompresses to bf16); vLLM's loader casts the streamed tensors
        assert v.dtype == exported[k].dtype or not k.endswith(("weight_packed", "weight_scale", "global_scale")), k
        assert torch.equal(v.cpu().to(exported[k].dtype), exported[k]), k


def test_stream_carries_aqn_noise(tiny_dir):
    pm = _policy(tiny_dir)
    aqn = AdaptiveQuantizationNoise(pm, seed=0)
    clean = {k: v.clone() for k, v in nvfp4_vllm_weights(pm) if "layernorm" in k}
    with aqn.noisy(3, 1e-2):
        noisy = {k: v.clone() for k, v in nvfp4_vllm_weights(pm) if "layernorm" in k}
    assert clean.keys() == noisy.keys() and len(clean) == 4
    for k in clean:
        d = noisy[k] - clean[k]
        assert d.abs().max() > 0, k
        assert 0.5e-2 < d.std().item() < 2e-2, (k, d.std().item())
    after = {k: v for k, v in nvfp4_vllm_weights(pm) if "layernorm" in k}
    assert all(torch.equal(after[k], clean[k]) for k in clean)


def test_dense_stream_is_the_policy_weights(tiny_dir):
    """Dense layout (vLLM serving the un-quantized checkpoint): every tensor under the base model's names, LoRA
    layers as dequant(W) + BA, NVFP4 layers without LoRA dequantized, the policy untouched."""
    from hfq.qerl.vllm_sync import vllm_weights

    pm = _policy(tiny_dir)
    before = {n: t.clone() for n, t in list(pm.named_buffers()) + list(pm.named_parameters())}
    stream = dict(vllm_weights(pm, "dense"))
    after = dict(list(pm.named_buffers()) + list(pm.named_parameters()))
    assert all(torch.equal(after[n], before[n]) for n in before)
    base = pm.get_base_model()
    expected = {n for n, _ in base.named_parameters() if ".lora_" not in n}
    expected = {n.replace(".base_layer", "") for n in expected}
    expected |= {n.rsplit(".", 1)[0].replace(".base_layer", "") + ".weight" for n, _ in base.named_buffers()
                 if n.endswith("weight_packed")}
    assert set(stream) == expected
    assert not any("weight_packed" in k or "lora_" in k for k in stream)
    q = pm.base_model.model.model.layers[0].self_attn.q_proj
    w = q.get_base_layer().dequantize(torch.float32)
    delta = (q.lora_B["default"].weight.float() @ q.lora_A["default"].weight.float()) * q.scaling["default"]
    assert torch.equal(stream["model.layers.0.self_attn.q_proj.weight"], (w + delta).to(torch.float32))
    assert (delta.abs() > 0).any()
    k = pm.base_model.model.model.layers[0].self_attn.k_proj  # NVFP4, no LoRA
    assert torch.equal(stream["model.layers.0.self_attn.k_proj.weight"], k.dequantize(k.weight_dtype))
    try:
        dict(vllm_weights(pm, "fp8"))
    except ValueError as e:
        assert "layout" in str(e)
    else:
        raise AssertionError("unknown layout accepted")


def test_packed_stream_makes_no_layout_round_trip_on_g4(tiny_dir, monkeypatch):
    """Each sync requantizes every LoRA layer for the stream. On a GPU that keeps the g4 layout the new layer was
    repacked to g4 and unpacked again to be read (two conversions per layer per sync); it is now made canonical.
    The stream equals the canonical base's. (A g4 device is emulated on CPU.)"""
    import hfq_kernels.nvfp4_gluon as G4
    from hfq.nvfp4 import NVFP4Linear
    from hfq_kernels._settings import SETTINGS

    monkeypatch.setattr(SETTINGS, "plan_on_cpu", True)
    torch.manual_seed(0)  # PEFT's init of lora_A
    plain = {k: v.clone() for k, v in nvfp4_vllm_weights(_policy(tiny_dir))}
    monkeypatch.setattr(G4, "device_ok", lambda d: d.type == "cpu")
    torch.manual_seed(0)
    pm = _policy(tiny_dir)
    assert pm.base_model.model.model.layers[0].self_attn.q_proj.base_layer.layout == "g4"
    calls = []  # (the CPU reference of the g4 dequantize unpacks; the GPU kernel reads g4 itself)
    for owner, fn in ((G4, "repack"), (NVFP4Linear, "to_canonical_layout_")):
        orig = getattr(owner, fn)
        monkeypatch.setattr(owner, fn, lambda *a, _o=orig, _f=fn, **k: calls.append(_f) or _o(*a, **k))
    stream = dict(nvfp4_vllm_weights(pm))
    assert calls == [] and stream.keys() == plain.keys()
    assert all(torch.equal(stream[k], plain[k]) for k in plain)
