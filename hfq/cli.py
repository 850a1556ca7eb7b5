"""`hfq` command line: quantize / export (NVFP4) and grpo (QeRL demo and training)."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, help). Each module defines `add_arguments(parser)` and `main(args) -> int`.
SUBCOMMANDS = {
    "quantize": ("hfq.nvfp4.cli", "quantize a causal LM's linear layers to NVFP4/MXFP4 and save it"),
    "export": ("hfq.nvfp4.cli_export", "write a compressed-tensors nvfp4-pack-quantized checkpoint (vLLM-loadable)"),
    "grpo": ("hfq.qerl.demo", "QeRL GRPO: with no arguments, the offline demo on a bundled tiny model and task"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hfq", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (mod, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_module=mod)
        try:
            importlib.import_module(mod).add_arguments(p)
        except ModuleNotFoundError as e:
            if not (e.name and mod.startswith(e.name)):
                raise
            p.set_defaults(_missing=True)
    return parser


def main(argv=None) -> int:
    import hfq  # noqa: F401  (registers quantizers)

    args = build_parser().parse_args(argv)
    if getattr(args, "_missing", False):
        print(f"hfq {args.command}: not available in this build", file=sys.stderr)
        return 2
    return int(importlib.import_module(args._module).main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
