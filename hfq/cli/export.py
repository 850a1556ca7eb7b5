"""`hfq export MODEL_DIR --out DIR`: an hfq NVFP4 checkpoint (or a dense model, quantized on the way) to
compressed-tensors' nvfp4-pack-quantized layout; with `--adapter ADAPTER_DIR` (a PEFT LoRA adapter trained on that
checkpoint) `DIR/base` + `DIR/adapter` side by side, nothing re-quantized (vLLM's --enable-lora serves them)."""
from __future__ import annotations

import torch

from . import check_model_dir, checkpoint_quantization, copy_tokenizer, device, out_dir


def add_arguments(p) -> None:
    p.add_argument("model_dir", help="an hfq NVFP4 checkpoint, or a dense causal-LM directory")
    p.add_argument("--out", required=True, type=out_dir, help="output directory")
    p.add_argument("--adapter", default=None, help="a PEFT LoRA adapter directory trained on MODEL_DIR: write "
                   "OUT/base + OUT/adapter instead of merging")
    p.add_argument("--device", type=device, default="cuda" if torch.cuda.is_available() else "cpu")


def main(args) -> int:
    import os

    from transformers import AutoModelForCausalLM

    from hfq.nvfp4.config import NVFP4Config
    from hfq.nvfp4.export import export_compressed_tensors

    args.model_dir = check_model_dir(args.model_dir, local_only=True)
    if args.adapter and not os.path.isfile(os.path.join(os.path.expanduser(args.adapter), "adapter_config.json")):
        raise SystemExit(f"{args.adapter}: not a PEFT adapter directory (no adapter_config.json)")
    method = (checkpoint_quantization(args.model_dir) or {}).get("quant_method")
    if method not in (None, "hfq_nvfp4"):
        raise SystemExit(f"{args.model_dir}: quantization_config {method!r} is not hfq_nvfp4 (nor a dense model)")
    kw = {} if method == "hfq_nvfp4" else {"quantization_config": NVFP4Config()}
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16, device_map=args.device, **kw)
    if args.adapter:
        from peft import PeftModel

        from hfq.nvfp4.merge import export_with_adapter

        paths = export_with_adapter(PeftModel.from_pretrained(model, os.path.expanduser(args.adapter)), args.out)
        copy_tokenizer(args.model_dir, paths["base"])
        print(f"exported the NVFP4 base to {os.path.abspath(paths['base'])} and the adapter to "
              f"{os.path.abspath(paths['adapter'])}")
        return 0
    export_compressed_tensors(model, args.out)
    copy_tokenizer(args.model_dir, args.out)
    print(f"exported compressed-tensors nvfp4-pack-quantized checkpoint to {os.path.abspath(args.out)}")
    return 0
