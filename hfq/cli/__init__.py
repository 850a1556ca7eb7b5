"""`hfq` command line: quantize / export (NVFP4), grpo (QeRL demo and training) and push (upload to the Hub)."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, help). Each module defines `add_arguments(parser)` and `main(args) -> int`.
SUBCOMMANDS = {
    "quantize": ("hfq.cli.quantize", "quantize a causal LM's linear layers to NVFP4/MXFP4 and save it"),
    "export": ("hfq.cli.export", "write a compressed-tensors nvfp4-pack-quantized checkpoint (vLLM-loadable)"),
    "grpo": ("hfq.cli.grpo", "QeRL GRPO: with no arguments, the offline demo on a bundled tiny model and task"),
    "push": ("hfq.cli.push", "upload a saved model/adapter folder to the Hub (hfq's model card added or aimed at it)"),
}


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (0 or a negative count is refused, not read as "the default")."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return v


def device(text: str) -> str:
    """argparse type: cpu, cuda or cuda:N, refused at once when this machine has no such GPU."""
    import torch

    kind, _, idx = text.partition(":")
    if kind not in ("cpu", "cuda") or (idx and not idx.isdigit()) or (kind == "cpu" and idx):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    if kind == "cuda" and not (torch.cuda.is_available() and int(idx or 0) < torch.cuda.device_count()):
        raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return text


def out_dir(text: str) -> str:
    """argparse type: an output directory, which may exist but must not be a file."""
    import os

    if os.path.isfile(os.path.expanduser(text)):
        raise argparse.ArgumentTypeError(f"{text} is a file, not a directory")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hfq", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (mod, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_module=mod)
        importlib.import_module(mod).add_arguments(p)
    return parser


def checkpoint_quantization(path: str) -> dict | None:
    """The checkpoint's quantization_config as a dict (None for a dense checkpoint)."""
    from transformers import AutoConfig

    qc = getattr(AutoConfig.from_pretrained(path), "quantization_config", None)
    return qc if qc is None or isinstance(qc, dict) else qc.to_dict()


def copy_tokenizer(src: str, out: str) -> None:
    """Save `src`'s tokenizer next to a converted model; a model directory without one is fine."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(src)
    except (OSError, ValueError):
        return
    tok.save_pretrained(out)


def check_model_dir(path: str, local_only: bool = False) -> str:
    """The model path to load (~ expanded), or a one-line stop for one that is not there: a path-like name (absolute,
    ./, ../, ~) that is no directory, or with `local_only` any name that is not a local directory (a Hub id is fine
    otherwise)."""
    import os

    full = os.path.expanduser(path)
    if os.path.isdir(full):
        return full
    if local_only:
        raise SystemExit(f"{path}: not a local checkpoint directory")
    if os.path.isabs(full) or path.startswith((".", "~")):
        raise SystemExit(f"{path}: no such directory")
    return path


def main(argv=None) -> int:
    import hfq  # noqa: F401  (registers quantizers)

    args = build_parser().parse_args(argv)
    try:
        return int(importlib.import_module(args._module).main(args) or 0)
    except (OSError, ValueError) as e:  # a file, network or Hub error (missing checkpoint, offline), or input hfq or
        # the HF libraries refused with a message naming it: that message, no traceback
        print(f"hfq {args.command}: error: {e}", file=sys.stderr)
        return 1
