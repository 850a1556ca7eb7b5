"""Device diagnostic: NVFP4 CUDA path vs the CPU oracle on a Qwen2.5-1.5B-shaped model (layer and logits level)."""
import json
import os
import sys
import tempfile

import torch

import hfq
from hfq_kernels.reference import fp4
from hfq_kernels import nvfp4 as K

out = {}
torch.manual_seed(0)
w = (torch.randn(1536, 1536) * 0.02).to(torch.bfloat16)
p, s, r = K.quantize(w.cuda())
rp, rs, rr = fp4.nvfp4_quantize(w)
out["quantize_equal"] = bool(torch.equal(p.cpu(), rp) and torch.equal(s.cpu().view(torch.uint8), rs.view(torch.uint8))
                             and torch.equal(r.cpu(), rr))
deq = fp4.nvfp4_dequantize(rp, rs, rr, torch.float32)
out["weight_relerr"] = float((deq - w.float()).norm() / w.float().norm())
for m in (1, 8, 256, 1000):
    x = torch.randn(m, 1536, dtype=torch.bfloat16, device="cuda")
    y = torch.ops.hfq.nvfp4_linear(x, p, s, r, None).float().cpu()
    ref = x.float().cpu() @ deq.t()
    out[f"linear_relerr_M{m}"] = float((y - ref).norm() / ref.norm())

from transformers import AutoModelForCausalLM, Qwen2Config

cfg = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=False)
d = tempfile.mkdtemp()
torch.manual_seed(0)
with torch.device("cuda"):
    m0 = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
m0.save_pretrained(d)
x = torch.randint(0, cfg.vocab_size, (2, 64), device="cuda")
with torch.no_grad():
    l0 = m0(x).logits.float()
q = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16, device_map="cuda",
                                         quantization_config=hfq.NVFP4Config())
lin = q.model.layers[0].self_attn.q_proj
w0 = m0.model.layers[0].self_attn.q_proj.weight.float()
out["layer0_q_weight_relerr"] = float((lin.dequantize(torch.float32) - w0).norm() / w0.norm())
ref_p, ref_s, ref_r = fp4.nvfp4_quantize(m0.model.layers[0].self_attn.q_proj.weight.cpu())
out["layer0_codes_equal_oracle"] = bool(torch.equal(lin.weight_packed.cpu(), ref_p))
with torch.no_grad():
    l1 = q(x).logits.float()
cos = torch.nn.functional.cosine_similarity
out["logits_cos_flat"] = float(cos(l0.flatten(), l1.flatten(), dim=0))
out["logits_cos_rowmean"] = float(cos(l0.flatten(0, 1), l1.flatten(0, 1), dim=-1).mean())
out["logits_std_bf16"] = float(l0.std())
# one noise yardstick: the same BF16 model with its weights perturbed by ~ the NVFP4 error size, random direction
with torch.no_grad():
    for mod in m0.model.layers.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.weight.add_(torch.randn_like(mod.weight) * mod.weight.float().std().to(mod.weight.dtype) * 0.1)
    l2 = m0(x).logits.float()
out["logits_cos_flat_bf16_with_10pct_noise"] = float(cos(l0.flatten(), l2.flatten(), dim=0))
print(json.dumps(out, indent=1))
os.makedirs(sys.argv[1], exist_ok=True)
json.dump(out, open(os.path.join(sys.argv[1], "diag.json"), "w"), indent=1)
