"""hfq_kernels stands alone: every module imports without hfq or transformers, and without triton (CPU references)."""
import os
import pkgutil
import subprocess
import sys

import pytest

import hfq_kernels
import hfq_kernels.reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = sorted(["hfq_kernels"] + [m.name for m in pkgutil.walk_packages(hfq_kernels.__path__, "hfq_kernels.")])

_CHECK = """
import importlib, sys
blocked = sys.argv[1].split(",") if sys.argv[1] else []
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ImportError(f"{name} is blocked in this test")
sys.meta_path.insert(0, Block())
for name in sys.argv[2:]:
    importlib.import_module(name)
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("hfq", "transformers"))
print("LOADED", ",".join(bad))
"""


def _run(blocked, modules):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", _CHECK, ",".join(blocked), *modules], env=env, capture_output=True,
                          text=True, timeout=300)


def test_module_list_is_complete():
    assert {"hfq_kernels.nvfp4", "hfq_kernels.rollout", "hfq_kernels.reference.fp4", "hfq_kernels._triton"} <= set(
        MODULES)


def test_modules_import_neither_hfq_nor_transformers():
    """Every module in one fresh interpreter where hfq and transformers are blocked: none needs them (an import of
    either raises, naming the module that asked)."""
    r = _run(["hfq", "transformers"], MODULES)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-1] == "LOADED", r.stdout


def test_all_modules_import_without_triton_and_ops_run_on_cpu():
    """With triton blocked the kernel modules still import and the registered ops run their torch references."""
    code = _CHECK + """
import torch
import hfq_kernels._triton as T
assert not T.HAS_TRITON and not T.available(torch.device("cpu"))
w = torch.randn(8, 32)
p, s, g = torch.ops.hfq.nvfp4_quantize(w)
y = torch.ops.hfq.nvfp4_linear(torch.randn(2, 32), p, s, g, None)
h = torch.ops.hfq.hadamard(torch.randn(4, 32), 16)
print("OPS", tuple(y.shape), tuple(h.shape))
"""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", code, "triton,hfq,transformers", *MODULES], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "OPS (2, 8) (4, 32)" in r.stdout, r.stdout


def test_settings_read_from_the_environment_once():
    """hfq_kernels' settings object parses each variable (0/1 switches, a path) and refuses other switch values,
    naming the variable; unset variables give the documented defaults (docs/settings.md)."""
    from hfq_kernels._settings import KernelSettings

    s = KernelSettings.from_env({"TRITON_INTERPRET": "1", "HFQ_NVFP4_GLUON": "0", "HFQ_AUTOTUNE": "0",
                                 "HFQ_AUTOTUNE_CACHE": "/tmp/t.json", "HFQ_TRITON_BIND": "0"})
    assert (s.interpret, s.gluon, s.autotune, s.autotune_cache, s.bind, s.plan_on_cpu) == (
        True, False, False, "/tmp/t.json", False, False)
    d = KernelSettings.from_env({})
    assert (d.interpret, d.gluon, d.autotune, d.autotune_cache, d.bind) == (False, True, True, None, True)
    # TRITON_INTERPRET is Triton's variable: on where Triton reads it as on
    assert [KernelSettings.from_env({"TRITON_INTERPRET": v}).interpret
            for v in ("true", "ON", "yes", "0", "false")] == [True, True, True, False, False]
    with pytest.raises(ValueError, match="HFQ_AUTOTUNE='off': allowed values are 0"):
        KernelSettings.from_env({"HFQ_AUTOTUNE": "off"})
