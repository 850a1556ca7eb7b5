"""The `hf_stack` marker (tests/conftest.py) picks the tests CI reruns on the newest transformers/PEFT/TRL."""
from pathlib import Path

pytest_plugins = ["pytester"]

CASES = '''
import subprocess, sys
import torch

def _helper():
    from peft import LoraConfig
    return LoraConfig

def test_pure_torch():
    assert torch.zeros(1).sum() == 0

def test_import_inside():
    import transformers
    assert transformers

def test_via_helper():
    assert _helper()

def test_via_fixture(hf_fixture):
    assert hf_fixture

def test_subprocess_code():
    subprocess.run([sys.executable, "-c", "import sys, hfq"], check=False)

def test_script():
    subprocess.run([sys.executable, "uses_hfq.py"], check=False)
'''


def test_hf_stack_marks_exactly_the_tests_that_reach_the_hf_stack(pytester):
    conftest = (Path(__file__).parent / "conftest.py").read_text()
    pytester.makeconftest(conftest + "\n\n@pytest.fixture\ndef hf_fixture():\n    import trl\n    return trl\n")
    pytester.makepyfile(test_cases=CASES)
    pytester.mkdir("scripts")
    (pytester.path / "scripts" / "uses_hfq.py").write_text("import hfq\n")
    res = pytester.runpytest("--collect-only", "-q", "-m", "hf_stack", "-p", "no:cacheprovider")
    picked = {line.split("::")[1] for line in res.outlines if "::" in line}
    assert picked == {"test_import_inside", "test_via_helper", "test_via_fixture", "test_subprocess_code",
                      "test_script"}
