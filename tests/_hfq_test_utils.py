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


def assert_ct_export_matches(sd: dict, name: str, mod, theirs_weight: torch.Tensor, rel_tol: float) -> None:
    """One NVFP4 layer's compressed-tensors export against the layer: identical codes (decoded by compressed-tensors'
    own unpacker), scales and global scale, and compressed-tensors' dequantized weight within rel_tol of ours."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    from hfq_kernels.reference import fp4

    n, k = mod.out_features, mod.in_features
    assert torch.equal(unpack_fp4_from_uint8(sd[f"{name}.weight_packed"], n, k, torch.float32),
                       fp4.e2m1_decode(fp4.unpack_fp4(mod.weight_packed))), name
    assert torch.equal(sd[f"{name}.weight_scale"].view(torch.uint8), mod.weight_scale.view(torch.uint8)), name
    assert torch.equal(sd[f"{name}.weight_global_scale"], mod.weight_global_scale), name
    ours = mod.dequantize(torch.float32)
    err = (theirs_weight.float() - ours).abs().max() / ours.abs().max()
    assert err < rel_tol, f"{name}: dequantized weights differ beyond bf16 ({err})"
