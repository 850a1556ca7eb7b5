"""Launch-setting sweep of the fused ECO-AdamW step (device): rows per program / warps per block width and the
one-pass limit, timed on the 1B-shaped weight set of benchmarks/eco.py (bf16 states; RTN and SR).
Prints one JSON line per variant and writes OUT/eco_sweep.json.   python benchmarks/eco_sweep.py --out DIR"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from eco import make_params, shapes_1b, time_step  # noqa: E402

import hfq_kernels.eco as K  # noqa: E402
from hfq.eco import ECOAdamW  # noqa: E402

BASE = dict(K.LAUNCH)


def variants():  # name, LAUNCH overrides, MAX_ONE_PASS
    yield "default", {}, K.MAX_ONE_PASS
    for r, w in ((1, 4), (1, 16)):
        yield f"2048:{r}x{w}", {2048: (r, w)}, K.MAX_ONE_PASS
    for r, w in ((1, 32),):
        yield f"8192:{r}x{w}", {8192: (r, w)}, K.MAX_ONE_PASS


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/eco_sweep")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cuda")
    params = make_params(shapes_1b(), dev, "fp8")
    rows = []
    for name, launch, one_pass in variants():
        K.LAUNCH = {**BASE, **launch}
        K.MAX_ONE_PASS = one_pass
        for rounding in ("rtn", "sr"):
            opt = ECOAdamW(params, lr=1e-4, rounding=rounding, state_dtype=torch.bfloat16, fused=True)
            ms = time_step(opt, dev)
            row = dict(variant=name, rounding=rounding, ms=round(ms, 3))
            print(json.dumps(row), flush=True)
            rows.append(row)
            del opt
            torch.cuda.empty_cache()
    json.dump(dict(device=torch.cuda.get_device_name(0), commit=os.environ.get("HFQ_COMMIT", "unknown"), rows=rows),
              open(os.path.join(a.out, "eco_sweep.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
