"""examples/qerl_real.py: the generated task (deterministic, held-out split disjoint, answers right) and its reward."""
import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def qr():
    spec = importlib.util.spec_from_file_location("qerl_real", os.path.join(ROOT, "examples", "qerl_real.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _solve(q: str) -> int:
    """Independent solution of a generated question from its numbers and verbs."""
    n = [int(x) for x in re.findall(r"\d+", q)]
    if "finds" in q:
        return n[0] + n[1]
    if "gives" in q:
        return n[0] - n[1]
    if "boxes" in q:
        return n[0] * n[1]
    return n[0] + n[1] * n[2]


def test_task_is_deterministic_disjoint_and_correct(qr):
    train, held = qr.make_task(500, 64, seed=3)
    assert (train, held) == qr.make_task(500, 64, seed=3)
    assert len(train) == 500 and len(held) == 64
    assert not {r["question"] for r in train} & {r["question"] for r in held}
    assert {r["kind"] for r in train} == {"add", "sub", "mul", "two_step"}
    for r in train + held:
        assert int(r["answer"]) == _solve(r["question"]) and int(r["answer"]) >= 0


def test_reward_reads_the_last_integer_of_chat_completions(qr):
    comps = [[{"role": "assistant", "content": "3 + 4 = 7, so 1,207"}], [{"role": "assistant", "content": "It is 12."}],
             [{"role": "assistant", "content": "no idea"}], "answer: -5"]
    assert qr.answer_reward(comps, ["1207", "12", "0", "-5"]) == [1.0, 1.0, 0.0, 1.0]
    assert qr.answer_reward(comps[:2], ["7", "13"]) == [0.0, 0.0]
