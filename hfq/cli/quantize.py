"""`hfq quantize MODEL_DIR --out DIR`: NVFP4/MXFP4-quantize a causal LM while loading, save, print a summary."""
from __future__ import annotations

import os

import torch

from . import copy_tokenizer


def add_arguments(p) -> None:
    p.add_argument("model_dir", help="a local Hugging Face causal-LM directory (safetensors)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--format", choices=["nvfp4", "mxfp4"], default="nvfp4")
    p.add_argument("--export", choices=["hfq", "compressed-tensors"], default="hfq",
                   help="hfq: reloadable with `import hfq`; compressed-tensors: nvfp4-pack-quantized for vLLM")
    p.add_argument("--strict", action="store_true", help="error on layers whose in_features don't fit the block")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])


def _linear_bytes(model) -> tuple[int, int]:
    from torch import nn

    from hfq.nvfp4.linear import NVFP4Linear

    before = after = 0
    for m in model.modules():
        if isinstance(m, NVFP4Linear):
            n = m.in_features * m.out_features
            before += 2 * n
            after += sum(b.numel() * b.element_size() for b in m.buffers(recurse=False) if b is not None)
        elif type(m) is nn.Linear:
            before += 2 * m.weight.numel()
            after += 2 * m.weight.numel()
    return before, after


def summary(model) -> str:
    rep = model.hfq_quantization_report
    errs = list(rep["rel_error"].values())
    before, after = _linear_bytes(model)
    rows = [("layers quantized", str(len(rep["quantized"]))), ("layers skipped", str(len(rep["skipped"]))),
            ("linear weights before (bf16)", f"{before / 2**20:.2f} MiB"),
            ("linear weights after", f"{after / 2**20:.2f} MiB ({before / max(after, 1):.2f}x smaller)")]
    if errs:
        rows += [("mean relative error", f"{sum(errs) / len(errs):.4f}"), ("max relative error", f"{max(errs):.4f}")]
    w = max(len(r[0]) for r in rows)
    lines = ["| what | value |", "|---|---|"] + [f"| {a.ljust(w)} | {b} |" for a, b in rows]
    for name, why in rep["skipped"].items():
        lines.append(f"| skipped: {name} | {why} |")
    return "\n".join(lines)


def main(args) -> int:
    from transformers import AutoModelForCausalLM

    from hfq.nvfp4.config import NVFP4Config
    from hfq.nvfp4.export import export_compressed_tensors

    if args.export == "compressed-tensors" and args.format != "nvfp4":
        raise SystemExit("--export compressed-tensors needs --format nvfp4")
    cfg = NVFP4Config(format=args.format, strict=args.strict)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, quantization_config=cfg,
                                                 dtype=getattr(torch, args.dtype), device_map=args.device)
    if args.export == "compressed-tensors":
        export_compressed_tensors(model, args.out)
    else:
        model.save_pretrained(args.out)
    copy_tokenizer(args.model_dir, args.out)
    print(summary(model))
    print(f"saved to {os.path.abspath(args.out)} ({args.export})")
    return 0
