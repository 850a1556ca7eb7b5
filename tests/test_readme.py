"""README.md's python snippets run as written on a real model (SmolLM2-135M-Instruct, CPU), and README stays a guide.

Each `## ` section's python blocks run in order as one script in a fresh interpreter (as a user would run them:
no test environment, so CPU kernels take the torch path, not the Triton interpreter). Every snippet is complete
(model, data, arguments); the one change is MODEL_ID, the Hub id of the same model, pointed at its local copy
(no network here), stored in fp32 on CPU so that snippets loading the checkpoint's dtype do not run bf16 GEMMs on
a CPU without bf16 instructions (a snippet that names a dtype keeps it). The test appends a check of the outcome.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
MODEL_ID = 'model_id = "HuggingFaceTB/SmolLM2-135M-Instruct"'
MAX_LINES = 220

_OPT_STEPPED = "assert len(opt.state) > 0, 'the snippet optimizer never stepped'\n"
CHECKS = {
    "NVFP4": """
import os
from hfq.nvfp4 import NVFP4Linear
assert any(isinstance(m, NVFP4Linear) for m in merged.modules())
assert os.path.isfile("adapter/adapter_config.json") and os.path.isfile("export/config.json")
assert model.hfq_quantization_report["skipped"] == {"lm_head": "modules_to_not_convert"}  # what the README prints
""",
    "QeRL": """
from transformers.utils import is_torch_bf16_gpu_available
assert trainer.state.global_step == 1
assert trainer.args.bf16 == is_torch_bf16_gpu_available()
""",
    "Rollout engine": """
assert out.completion_ids.shape[0] == 2 and bool((out.lengths > 0).all())
assert issubclass(MyGRPOTrainer, RolloutMixin)
""",
    "ECO": _OPT_STEPPED + "assert trainer.state.global_step == args.max_steps  # the optimizer_cls_and_kwargs route\n",
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


def test_readme_is_a_guide_linking_existing_docs():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_LINES, "README.md is the user guide: internals go to docs/"
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (REPO / link).is_file(), f"README links {link}, which does not exist"


def test_every_python_snippet_is_covered():
    assert set(sections()) == set(CHECKS), "a README section with python code has no check here (or vice versa)"


@pytest.mark.real_model
@pytest.mark.parametrize("name", sorted(CHECKS))
def test_readme_snippet_runs_on_smollm2(name, smollm2, request, tmp_path):
    code = "\n".join(sections()[name])
    assert code.count(MODEL_ID) == 1, f"README {name!r}: the snippet must define {MODEL_ID} once"
    local = smollm2 if torch.cuda.is_available() else request.getfixturevalue("smollm2_fp32")
    code = code.replace(MODEL_ID, f"model_id = {local!r}")
    script = f"# --- README.md\n{code}\n# --- check\n{CHECKS[name]}"
    (tmp_path / "snippet.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    r = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, f"README {name!r} failed:\n{r.stderr[-4000:]}"
