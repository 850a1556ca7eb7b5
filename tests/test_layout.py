"""The layout rules of DESIGN.md, checked on the source: Triton only in hfq_kernels, method rooms that do not
import each other, and functions short enough to read in kernel and model code."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROOMS = {"nvfp4", "quest", "qft", "eco", "qerl", "rollout"}
ALLOWED = {"qerl": {"nvfp4", "rollout"}}  # QeRL builds on NVFP4 weights and the rollout engine
MAX_LINES = 80


def _py(*globs):
    return sorted(p for g in globs for p in ROOT.glob(g))


def _imported_modules(path: pathlib.Path):
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                yield ".".join(base + ([node.module] if node.module else []))
            elif node.module:
                yield node.module


def test_method_rooms_do_not_import_each_other():
    bad = []
    for room in ROOMS:
        for path in _py(f"hfq/{room}/**/*.py"):
            for mod in _imported_modules(path):
                parts = mod.split(".")
                if len(parts) > 1 and parts[0] == "hfq" and parts[1] in ROOMS - {room} - ALLOWED.get(room, set()):
                    bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not bad, bad


def test_triton_kernels_live_in_hfq_kernels():
    bad = [str(p.relative_to(ROOT)) for p in _py("hfq/**/*.py") if "@triton.jit" in p.read_text()]
    assert not bad, f"@triton.jit outside hfq_kernels: {bad}"


def test_kernel_and_model_code_functions_are_short():
    files = _py("hfq_kernels/**/*.py", "hfq/*/linear.py", "hfq/_base/*.py", "hfq/rollout/*.py")
    long = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long


def test_environment_read_only_in_the_settings_modules():
    """Every environment variable of hfq and hfq_kernels is read once, in their settings module."""
    allowed = {"hfq/_settings.py", "hfq_kernels/_settings.py"}
    bad = [str(p.relative_to(ROOT)) for p in _py("hfq/**/*.py", "hfq_kernels/**/*.py")
           if str(p.relative_to(ROOT)) not in allowed
           and any(s in p.read_text() for s in ("os.environ", "getenv(", "from os import environ"))]
    assert not bad, f"environment read outside the settings modules: {bad}"


def test_rollout_reaches_nvfp4_only_through_its_public_interface():
    """hfq.rollout hands NVFP4 linears to the fused decode kernels through their public decode_operands(): it names
    no hfq.nvfp4 class, reads no module's private buffers and tells modules apart by type, not by class name."""
    bad = []
    for path in _py("hfq/rollout/*.py"):
        text = path.read_text()
        bad += [f"{path.relative_to(ROOT)}: {s}" for s in ("NVFP4Linear", "_buffers", "weight_g4", "__name__ in",
                                                              "__name__ ==", "__name__ !=") if s in text]
    assert not bad, bad


def test_files_stay_readable():
    """Every module of hfq and hfq_kernels stays under 700 lines."""
    files = _py("hfq/**/*.py", "hfq_kernels/**/*.py")
    long = [f"{p.relative_to(ROOT)} ({n} lines)" for p in files if (n := len(p.read_text().splitlines())) > 700]
    assert not long, long
