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
        assert v.dtype == exported[k].dtype and torch.equal(v.cpu(), exported[k]), k


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
