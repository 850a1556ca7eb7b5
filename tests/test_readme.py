"""README.md's python snippets run as written on a real model (SmolLM2-135M-Instruct, CPU).

Each `## ` section's python blocks run in order as one script in a fresh interpreter (as a user would run them:
no test environment, so CPU kernels take the torch path, not the Triton interpreter). The test prepends what the
prose leaves to the reader (`path`, a dataset `ds`, short TrainingArguments `args`, a loaded `model` and prompts
for the rollout engine), appends a check of the outcome, and applies only the substitutions in SCALE_DOWN
(GPU-scale lengths/batches -> CPU-sized); each must match the README exactly once, so a README edit that drops one
fails here instead of silently running the big version.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"

SCALE_DOWN = {
    "QeRL": [('QeRLConfig.paper_preset("gsm8k", output_dir="qerl-gsm8k")',
              'QeRLConfig.paper_preset("gsm8k", output_dir="qerl-gsm8k", max_steps=1, max_completion_length=8, '
              'num_generations=2, per_device_train_batch_size=2, steps_per_generation=1, use_cpu=True, bf16=False, '
              'report_to="none", save_strategy="no")')],
    "Rollout engine": [("max_batch=32, max_seq_len=2304", "max_batch=2, max_seq_len=64"),
                       ("max_new_tokens=512", "max_new_tokens=8")],
}

_LM_DATA = """
from datasets import Dataset
from transformers import AutoTokenizer, TrainingArguments
_tok = AutoTokenizer.from_pretrained(path)
_ids = _tok("The Eiffel Tower is in Paris. Water boils at 100 degrees Celsius at sea level. " * 8).input_ids
ds = Dataset.from_dict({"input_ids": [_ids[i * 32:(i + 1) * 32] for i in range(4)],
                       "labels": [_ids[i * 32:(i + 1) * 32] for i in range(4)]})
args = TrainingArguments(output_dir="run", max_steps=1, per_device_train_batch_size=2, use_cpu=True,
                         report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True)
"""

PRELUDE = {
    "ECO": _LM_DATA,
    "QFT": _LM_DATA,
    "QeRL": """
from datasets import Dataset
ds = Dataset.from_list([{"prompt": "What is 2 + 3? Answer with a number.", "answer": "5"},
                        {"prompt": "What is 4 + 4? Answer with a number.", "answer": "8"}])
""",
    "Rollout engine": """
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
_enc = AutoTokenizer.from_pretrained(path)(["The capital of France is", "Two plus two is"], return_tensors="pt",
                                           padding=True, padding_side="left")
input_ids, attention_mask = _enc.input_ids, _enc.attention_mask
""",
}

_OPT_STEPPED = "assert len(opt.state) > 0, 'the snippet optimizer never stepped'\n"
CHECKS = {
    "NVFP4": """
import os
from hfq.nvfp4 import NVFP4Linear
assert any(isinstance(m, NVFP4Linear) for m in merged.modules())
assert os.path.isfile("adapter/adapter_config.json") and os.path.isfile("export/config.json")
""",
    "QeRL": "assert trainer.state.global_step == 1\n",
    "Rollout engine": """
assert out.completion_ids.shape[0] == 2 and bool((out.lengths > 0).all())
assert issubclass(MyGRPOTrainer, RolloutMixin)
""",
    "ECO": _OPT_STEPPED,
    "QuEST": """
from hfq.quest.linear import QuESTLinear
assert any(isinstance(m, QuESTLinear) for m in model.modules())
""",
    "QFT": _OPT_STEPPED,
}


def sections() -> dict[str, list[str]]:
    """`## heading` (up to its ':') -> its python code blocks."""
    out = {}
    for block in re.split(r"^## ", README.read_text(), flags=re.M)[1:]:
        code = re.findall(r"^```python\n(.*?)^```", block, flags=re.M | re.S)
        if code:
            out[block.splitlines()[0].split(":")[0].strip()] = code
    return out


def test_every_python_snippet_is_covered():
    assert set(sections()) == set(CHECKS), "a README section with python code has no check here (or vice versa)"


@pytest.mark.real_model
@pytest.mark.parametrize("name", sorted(CHECKS))
def test_readme_snippet_runs_on_smollm2(name, smollm2, tmp_path):
    code = "\n".join(sections()[name])
    for old, new in SCALE_DOWN.get(name, []):
        assert code.count(old) == 1, f"README {name!r}: expected exactly one {old!r}"
        code = code.replace(old, new)
    script = f"path = {smollm2!r}\n{PRELUDE.get(name, '')}\n# --- README.md\n{code}\n# --- check\n{CHECKS[name]}"
    (tmp_path / "snippet.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    r = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, f"README {name!r} failed:\n{r.stderr[-4000:]}"
