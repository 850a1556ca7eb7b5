"""How long GPTQ-calibrated NVFP4 (hfq.nvfp4.calibrate_) takes on a 7B-shaped model, and its peak GPU memory.

A random Llama-2-7B-shaped model (bf16, held in host memory: calibrate_ brings one decoder block at a time to the
GPU) calibrated on random token sequences; the time is what a real 7B costs (same shapes, same token count), the
errors are not meaningful for random weights. One timed run (calibrate_ converts the model in place).

    python benchmarks/nvfp4_calibrate.py                  # 32 layers, 256 x 512 tokens
    python benchmarks/nvfp4_calibrate.py --layers 4       # a quick check
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout

from _harness import add_args, run_facts, spread, sync, write  # noqa: E402


def random_7b(layers: int, hidden: int, inter: int, heads: int, vocab: int, device: str):
    """A Llama model of these shapes in bf16 on the host, filled with N(0, 0.02) drawn on `device` (fast on a GPU)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=4096)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, device=device, dtype=torch.bfloat16, generator=gen) * 0.02)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)  # its buffers were left empty by to_empty
    return model.eval()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seqs", type=int, default=256, help="calibration sequences")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--scales", choices=["amax", "mse"], default="amax")
    p.add_argument("--device", default="cuda", help="where calibrate_ runs (cpu: a functional check only)")
    args = add_args(p).parse_args()
    import hfq
    from hfq.nvfp4 import NVFP4Config, calibrate_

    t = time.perf_counter()
    model = random_7b(args.layers, args.hidden, args.intermediate, args.heads, args.vocab, args.device)
    build_s = time.perf_counter() - t
    ids = torch.randint(0, args.vocab, (args.seqs, args.seq_len), generator=torch.Generator().manual_seed(0))
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sync()
    t = time.perf_counter()
    report = calibrate_(model, ids, config=NVFP4Config(scales=args.scales), device=args.device,
                        max_length=args.seq_len, batch_size=args.batch_size)
    sync()
    secs = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    resident = torch.cuda.memory_allocated() / 2**30 if cuda else float("nan")
    with torch.no_grad():  # the calibrated model runs
        loss = float(model(input_ids=ids[:2, :128].to(args.device), labels=ids[:2, :128].to(args.device)).loss)
    rtn = sum(r["rtn"] for r in report.rows) / len(report.rows)
    cal = sum(r["calibrated"] for r in report.rows) / len(report.rows)
    row = {"layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate,
           "tokens": report.tokens, "scales": args.scales, "calibrate_s": round(secs, 1),
           "s_per_layer": round(secs / args.layers, 2), "peak_gib": round(peak, 2), "resident_gib": round(resident, 2),
           "mean_rtn_error": round(rtn, 4), "mean_calibrated_error": round(cal, 4), **report.seconds}
    notes = (f"Random Llama-shaped weights in bf16 on the host ({build_s:.0f} s to build), {args.seqs} random "
             f"sequences of {args.seq_len} tokens, batch {args.batch_size}. calibrate_ keeps the quantized blocks on "
             "the GPU and brings one dense block at a time: peak = quantized model + one dense block + Hessians + "
             f"calibration activations. Loss of the calibrated model on 2 x 128 random tokens: {loss:.3f} (finite "
             "= it runs). Errors: relative output error on the calibration inputs, meaningless for random weights "
             "except RTN vs calibrated. Phases (s): " + ", ".join(f"{k} {v}" for k, v in report.seconds.items()))
    write("nvfp4_calibrate", [row], notes=notes, out_dir=args.out, facts=run_facts(),
          extra={"timing": spread([secs]), "hfq": hfq.__version__},
          title="GPTQ-calibrated NVFP4 of a 7B-shaped model")
    print(row)


if __name__ == "__main__":
    main()
