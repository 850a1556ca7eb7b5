"""`hfq export MODEL_DIR --out DIR`: an hfq NVFP4 checkpoint (or a dense model, quantized on the way) to
compressed-tensors' nvfp4-pack-quantized layout."""
from __future__ import annotations

import torch

from . import copy_tokenizer


def add_arguments(p) -> None:
    p.add_argument("model_dir", help="an hfq NVFP4 checkpoint, or a dense causal-LM directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def main(args) -> int:
    import json
    import os

    from transformers import AutoModelForCausalLM

    from hfq.nvfp4.config import NVFP4Config
    from hfq.nvfp4.export import export_compressed_tensors

    with open(os.path.join(args.model_dir, "config.json")) as f:
        qc = json.load(f).get("quantization_config")
    method = (qc or {}).get("quant_method")
    if method not in (None, "hfq_nvfp4"):
        raise SystemExit(f"{args.model_dir}: quantization_config {method!r} is not hfq_nvfp4 (nor a dense model)")
    kw = {} if method == "hfq_nvfp4" else {"quantization_config": NVFP4Config()}
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16, device_map=args.device, **kw)
    export_compressed_tensors(model, args.out)
    copy_tokenizer(args.model_dir, args.out)
    print(f"exported compressed-tensors nvfp4-pack-quantized checkpoint to {os.path.abspath(args.out)}")
    return 0
