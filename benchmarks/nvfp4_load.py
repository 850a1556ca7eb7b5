"""Device check of the NVFP4 load path: quantize-while-loading time and peak GPU memory vs a BF16 load (the two
loads alternated over --rounds rounds), logits agreement, save/reload identity and a LoRA step on CUDA.
Writes benchmarks/results/nvfp4_load.{json,md}.

    python benchmarks/nvfp4_load.py --config qwen2.5-1.5b
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import add_args, spread, write  # noqa: E402

CONFIGS = {  # real Qwen2.5 shapes (random init: speed/memory only)
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4),
}


def main():
    ap = add_args(argparse.ArgumentParser())
    ap.add_argument("--config", default="qwen2.5-1.5b", choices=sorted(CONFIGS))
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
    rows, loads, q = {}, {"bf16": [], "nvfp4": []}, None
    x = torch.randint(0, cfg.vocab_size, (2, 128), device="cuda",
                      generator=torch.Generator("cuda").manual_seed(0))  # the same prompts for both models
    for _ in range(args.rounds):  # bf16, nvfp4, bf16, nvfp4, ...: the first round also warms the kernels
        for name, kw in [("bf16", {}), ("nvfp4", {"quantization_config": hfq.NVFP4Config()})]:
            q = None
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16, device_map="cuda", **kw)
            torch.cuda.synchronize()
            loads[name].append(time.perf_counter() - t)
            rows[name] = {"peak_gb": torch.cuda.max_memory_allocated() / 1e9,
                          "resident_gb": torch.cuda.memory_allocated() / 1e9}
            with torch.no_grad():
                rows[name]["logits"] = model(x).logits.float()
            if name == "nvfp4":
                q = model
            del model
    for name, t in loads.items():
        st = spread(t)
        rows[name].update(load_s=st["median"], load_s_min=st["min"], load_s_max=st["max"], spread=st["spread"])
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
    table = [{"weights": k, **{kk: round(vv, 3) for kk, vv in v.items() if kk != "logits"}} for k, v in rows.items()]
    notes = (f"Model: {args.config} shapes, random init, BF16 checkpoint on local disk; load s: median over "
             f"{args.rounds} alternating loads (range min-max), peak and resident GB of the last load.\n\n"
             f"logits cosine NVFP4 vs BF16 (same prompts): {cos:.4f}; save/reload identical: {same}; "
             f"LoRA step on CUDA: {lora_ok}")
    columns = {"weights": "weights", "load_s": "load s", "load_s_min": "min", "load_s_max": "max",
               "spread": "spread", "peak_gb": "peak GPU GB", "resident_gb": "resident GB"}
    _, md = write("nvfp4_load", table, columns, notes, out_dir=args.out, title="NVFP4 load path",
                  extra={"model": args.config, "logits_cosine": cos, "reload_identical": same, "lora_step_ok": lora_ok})
    print(open(md).read())


if __name__ == "__main__":
    main()
