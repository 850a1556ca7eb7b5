import os

import torch

# Triton kernels run under the interpreter on CPU-only machines (CI); must be set before triton imports.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")

import pytest  # noqa: E402


@pytest.fixture
def tiny_dir(tmp_path):
    """A tiny random Qwen2 model + char tokenizer saved to disk (fp32)."""
    from hfq.tiny import save_tiny

    return str(save_tiny(tmp_path / "tiny_qwen2", arch="qwen2"))
