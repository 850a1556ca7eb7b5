"""Helpers shared by test files (pytest puts tests/ on sys.path): bit-comparable snapshots, per-rank data, and
compiling Triton kernels for an H100 without one."""
import os
import subprocess
import sys

import pytest
import torch


def snapshot(model, sep: str = ".") -> dict:
    """name -> plain cloned tensors, for bit comparisons: a QParam gives each stored tensor (`name{sep}codes`, ...;
    float8 viewed as uint8), other parameters themselves."""
    from hfq.qparam import QParam

    out = {}
    for n, p in model.named_parameters():
        if isinstance(p, QParam):
            for k, t in p.qtensors().items():
                out[f"{n}{sep}{k}"] = (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).clone()
        else:
            out[n] = p.detach().clone()
    return out


def shard(step: int, rank: int, rows: int, seq: int) -> torch.Tensor:
    """Token ids [rows, seq] for one rank at one step: different data on every rank, the same in every run."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(4, 90, (rows, seq), generator=g)


def compile_for_sm90(code: str, *args) -> list[str]:
    """Run `code` in a fresh interpreter without TRITON_INTERPRET (no GPU needed: it only compiles for sm_90);
    returns its stdout words. Skips where this machine has no ptxas/backend."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "ptxas" in r.stderr.lower():
        pytest.skip(r.stderr[-200:])
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.split()
