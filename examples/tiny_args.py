"""Command-line options shared by the tiny-model examples: model shape and batch, with each example's defaults."""
from __future__ import annotations

import argparse


def add_model_args(ap: argparse.ArgumentParser, *, hidden: int, layers: int, seq: int, batch: int):
    """--hidden, --layers, --seq, --batch on `ap`; returns `ap`."""
    ap.add_argument("--hidden", type=int, default=hidden, help="model width")
    ap.add_argument("--layers", type=int, default=layers, help="decoder layers")
    ap.add_argument("--seq", type=int, default=seq, help="tokens per training sequence")
    ap.add_argument("--batch", type=int, default=batch, help="sequences per optimizer step")
    return ap
