"""`hfq quantize MODEL_DIR --out DIR [--calibrate data.jsonl]`: NVFP4/MXFP4-quantize a causal LM while loading (or
with GPTQ on calibration texts), save, print a summary."""
from __future__ import annotations

import os

import torch

from . import check_model_dir, checkpoint_quantization, copy_tokenizer, device, out_dir, positive_int


def add_arguments(p) -> None:
    p.add_argument("model_dir", help="a Hugging Face causal-LM directory (safetensors) or Hub id")
    p.add_argument("--out", required=True, type=out_dir, help="output directory")
    p.add_argument("--format", choices=["nvfp4", "mxfp4"], default="nvfp4")
    p.add_argument("--export", choices=["hfq", "compressed-tensors"], default="hfq",
                   help="hfq: reloadable with `import hfq`; compressed-tensors: nvfp4-pack-quantized for vLLM")
    p.add_argument("--strict", action="store_true", help="error on layers whose in_features don't fit the block")
    p.add_argument("--device", type=device, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--scales", choices=["amax", "mse"], default="amax",
                   help="NVFP4 scales: amax (round-to-nearest) or mse (block scales searched for the least "
                        "weight error; helps with --calibrate, alone measured no better than amax)")
    p.add_argument("--calibrate", metavar="JSONL", default=None,
                   help="GPTQ calibration texts, one JSON object with a \"text\" field (or a JSON string) per line")
    p.add_argument("--calib-max-length", type=positive_int, default=512, help="tokens per calibration text at most")
    p.add_argument("--calib-batch-size", type=positive_int, default=8)


def read_jsonl_texts(path: str) -> list[str]:
    """The texts of a calibration .jsonl: each non-blank line a JSON string or an object with a "text" string."""
    import json

    texts = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from None
            text = obj.get("text") if isinstance(obj, dict) else obj
            if not isinstance(text, str):
                raise ValueError(f"{path}:{i}: expected a JSON string or an object with a \"text\" string")
            texts.append(text)
    if not texts:
        raise ValueError(f"{path}: no calibration texts (the file is empty)")
    return texts


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

    args.model_dir = check_model_dir(args.model_dir)
    held = checkpoint_quantization(args.model_dir)
    if held is not None:  # transformers would load it as it is and ignore --format / --scales / --calibrate
        raise SystemExit(f"{args.model_dir}: already quantized ({held.get('quant_method', 'unknown')}); hfq quantize "
                         "takes a dense checkpoint "
                         "(`hfq export` turns an hfq_nvfp4 checkpoint into compressed-tensors as it is)")
    if args.export == "compressed-tensors" and args.format != "nvfp4":
        raise SystemExit("--export compressed-tensors needs --format nvfp4")
    if args.calibrate and args.format != "nvfp4":
        raise SystemExit("--calibrate needs --format nvfp4")
    cfg = NVFP4Config(format=args.format, strict=args.strict, scales=args.scales)
    report = None
    if args.calibrate:
        from transformers import AutoTokenizer

        from hfq.nvfp4.calibrate import calibrate_

        texts = read_jsonl_texts(args.calibrate)
        # the dense model stays in host memory; calibrate_ brings one decoder block at a time to the device
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype))
        report = calibrate_(model, texts, AutoTokenizer.from_pretrained(args.model_dir), cfg, device=args.device,
                            max_length=args.calib_max_length, batch_size=args.calib_batch_size)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, quantization_config=cfg,
                                                     dtype=getattr(torch, args.dtype), device_map=args.device)
    if args.export == "compressed-tensors":
        export_compressed_tensors(model, args.out)
    else:
        model.save_pretrained(args.out)
    copy_tokenizer(args.model_dir, args.out)
    if report is not None:
        print(report.table())
        print()
    print(summary(model))
    print(f"saved to {os.path.abspath(args.out)} ({args.export})")
    return 0
