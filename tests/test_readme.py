"""README.md's python snippets run as written on a real model (SmolLM2-135M-Instruct, CPU).

Each `## ` section's python blocks run in order in one namespace. The test provides what the prose leaves to the
reader (`path`, a dataset `ds`, short TrainingArguments `args`, a loaded `model` and prompts for the rollout
engine) and applies only the substitutions in SCALE_DOWN (GPU-scale lengths/batches -> CPU-sized); each must match
the README exactly once, so a README edit that drops one fails here instead of silently running the big version.
"""
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"

SCALE_DOWN = {
    "QeRL": [('QeRLConfig.paper_preset("gsm8k", output_dir="qerl-gsm8k")',
              'QeRLConfig.paper_preset("gsm8k", output_dir="qerl-gsm8k", max_steps=1, max_completion_length=8, '
              'num_generations=2, per_device_train_batch_size=2, steps_per_generation=1, use_cpu=True, bf16=False, '
              'report_to="none", save_strategy="no")')],
    "Rollout engine": [("max_batch=32, max_seq_len=2304", "max_batch=2, max_seq_len=64"),
                       ("max_new_tokens=512", "max_new_tokens=8")],
}


def sections() -> dict[str, list[str]]:
    """`## heading` (first word(s) before ':') -> its python code blocks."""
    out, name = {}, None
    for block in re.split(r"^## ", README.read_text(), flags=re.M)[1:]:
        name = block.splitlines()[0].split(":")[0].strip()
        code = re.findall(r"^```python\n(.*?)^```", block, flags=re.M | re.S)
        if code:
            out[name] = code
    return out


def _lm_dataset(tok, n=4, length=32):
    from datasets import Dataset

    text = ("The Eiffel Tower is in Paris. Water boils at 100 degrees Celsius at sea level. "
            "A triangle has three sides and its angles add up to 180 degrees. ") * 4
    ids = tok(text).input_ids
    rows = [ids[i * length:(i + 1) * length] for i in range(n)]
    return Dataset.from_dict({"input_ids": rows, "labels": rows})


def _train_args(out):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(out), max_steps=2, per_device_train_batch_size=2, use_cpu=True,
                             report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True)


def _context(name, smollm2, tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    ns = {"path": smollm2}
    if name in ("ECO", "QFT"):
        ns.update(ds=_lm_dataset(tok), args=_train_args(tmp_path / "run"))
    if name == "QeRL":
        ns["ds"] = Dataset.from_list([{"prompt": "What is 2 + 3? Answer with a number.", "answer": "5"},
                                      {"prompt": "What is 4 + 4? Answer with a number.", "answer": "8"}])
    if name == "Rollout engine":
        ns["model"] = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.bfloat16)
        enc = tok(["The capital of France is", "Two plus two is"], return_tensors="pt", padding=True,
                  padding_side="left")
        ns.update(input_ids=enc.input_ids, attention_mask=enc.attention_mask)
    return ns


def _check_nvfp4(ns, tmp_path):
    from hfq.nvfp4 import NVFP4Linear

    assert any(isinstance(m, NVFP4Linear) for m in ns["merged"].modules())
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "export" / "config.json").is_file()


def _check_qerl(ns, tmp_path):
    assert ns["trainer"].state.global_step == 1


def _check_optimizer_stepped(ns, tmp_path):
    """The snippet's own optimizer (`opt`) holds state: it stepped on the quantized weights."""
    assert len(ns["opt"].state) > 0


def _check_rollout(ns, tmp_path):
    out = ns["out"]
    assert out.completion_ids.shape[0] == 2 and bool((out.lengths > 0).all())
    assert issubclass(ns["MyGRPOTrainer"], ns["RolloutMixin"])


def _check_quest(ns, tmp_path):
    from hfq.quest.linear import QuESTLinear

    assert any(isinstance(m, QuESTLinear) for m in ns["model"].modules())


CHECKS = {"NVFP4": _check_nvfp4, "QeRL": _check_qerl, "Rollout engine": _check_rollout,
          "ECO": _check_optimizer_stepped, "QuEST": _check_quest, "QFT": _check_optimizer_stepped}


def test_every_python_snippet_is_covered():
    assert set(sections()) == set(CHECKS), "a README section with python code has no check here (or vice versa)"


@pytest.mark.real_model
@pytest.mark.parametrize("name", sorted(CHECKS))
def test_readme_snippet_runs_on_smollm2(name, smollm2, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = "\n".join(sections()[name])
    for old, new in SCALE_DOWN.get(name, []):
        assert code.count(old) == 1, f"README {name!r}: expected exactly one {old!r}"
        code = code.replace(old, new)
    ns = _context(name, smollm2, tmp_path)
    exec(compile(code, f"README.md:{name}", "exec"), ns)
    CHECKS[name](ns, tmp_path)
