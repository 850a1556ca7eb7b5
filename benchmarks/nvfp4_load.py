"""Device check of the NVFP4 load path: quantize-while-loading time and peak GPU memory vs a BF16 load,
logits agreement, save/reload identity and a LoRA step on CUDA. Writes benchmarks/results/nvfp4_load.{json,md}.

    python benchmarks/nvfp4_load.py --config qwen2.5-1.5b
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout

CONFIGS = {  # real Qwen2.5 shapes (random init: speed/memory only)
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="qwen2.5-1.5b", choices=sorted(CONFIGS))
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    import peft
    from transformers import AutoModelForCausalLM, Qwen2Config

    import hfq

    cfg = Qwen2Config(vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=False,
                      **CONFIGS[args.config])
    d = tempfile.mkdtemp()
    with torch.device("cuda"):
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    m.save_pretrained(d)
    del m
    torch.cuda.empty_cache()
    rows = {}
    for name, kw in [("bf16", {}), ("nvfp4", {"quantization_config": hfq.NVFP4Config()})]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16, device_map="cuda", **kw)
        torch.cuda.synchronize()
        rows[name] = {"load_s": time.perf_counter() - t, "peak_gb": torch.cuda.max_memory_allocated() / 1e9,
                      "resident_gb": torch.cuda.memory_allocated() / 1e9}
        x = torch.randint(0, cfg.vocab_size, (2, 128), device="cuda",
                          generator=torch.Generator("cuda").manual_seed(0))  # the same prompts for both models
        with torch.no_grad():
            rows[name]["logits"] = model(x).logits.float()
        if name == "nvfp4":
            q = model
        else:
            del model
            torch.cuda.empty_cache()
    cos = torch.nn.functional.cosine_similarity(rows["bf16"]["logits"].flatten(), rows["nvfp4"]["logits"].flatten(),
                                                dim=0).item()
    d2 = tempfile.mkdtemp()
    q.save_pretrained(d2)
    q2 = AutoModelForCausalLM.from_pretrained(d2, device_map="cuda")
    with torch.no_grad():
        same = torch.equal(q2(x).logits.float(), rows["nvfp4"]["logits"])
    del q2
    pm = hfq.nvfp4.get_peft_model(q, peft.LoraConfig(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                           "gate_proj", "up_proj", "down_proj"]))
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-4)
    loss = pm(x, labels=x).loss
    loss.backward()
    opt.step()
    lora_ok = bool(torch.isfinite(loss)) and all(p.grad is not None for p in pm.parameters() if p.requires_grad)
    commit = os.environ.get("HFQ_COMMIT", "")  # set it on the device: its copy's git may not be this checkout's
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        except OSError:
            commit = ""
    commit = commit or "unknown"
    res = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "commit": commit,
           "model": args.config, "logits_cosine": cos, "reload_identical": same, "lora_step_ok": lora_ok,
           "rows": [{"weights": k, **{kk: round(vv, 3) for kk, vv in v.items() if kk != "logits"}}
                    for k, v in rows.items()]}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "nvfp4_load.json"), "w") as f:
        json.dump(res, f, indent=2)
    md = [f"# NVFP4 load path ({res['device']}, {res['date']}, commit {commit[:10]})", "",
          f"Model: {args.config} shapes, random init, BF16 checkpoint on local disk.", "",
          "| weights | load s | peak GPU GB | resident GB |", "|---|---|---|---|"]
    md += [f"| {r['weights']} | {r['load_s']} | {r['peak_gb']} | {r['resident_gb']} |" for r in res["rows"]]
    md += ["", f"logits cosine NVFP4 vs BF16: {cos:.4f}; save/reload identical: {same}; LoRA step on CUDA: {lora_ok}"]
    with open(os.path.join(args.out, "nvfp4_load.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
