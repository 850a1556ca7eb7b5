"""A bundled, code-generated arithmetic word-problem task for the offline demo and tests (no downloads).

Each example has a `prompt` (the question), an `answer` (GSM8K style: `<work> #### <value>`) and a
`completion` (the ideal `<think>a+b=c</think><answer>c</answer>` answer, used only for the brief pre-training).
Deterministic for a seed.
"""
from __future__ import annotations

import random

NAMES = ("Tom", "Ann", "Bob", "Eve", "Sam", "Mia", "Leo", "Zoe")
ITEMS = ("apple", "pen", "cup", "book", "coin", "egg", "card", "ball")


def make_problem(rng: random.Random) -> dict:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.choice(("add", "sub", "add"))
    if kind == "add":
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        q = f"{name} has {a} {item}s and gets {b} more. How many {item}s now?"
        work, c = f"{a}+{b}={a + b}", a + b
    else:
        a = rng.randint(2, 18)
        b = rng.randint(1, min(9, a - 1))
        q = f"{name} has {a} {item}s and gives {b} away. How many {item}s now?"
        work, c = f"{a}-{b}={a - b}", a - b
    return {"prompt": f"Q: {q}\nA: ", "answer": f"{work} #### {c}",
            "completion": f"<think>{work}</think><answer>{c}</answer>"}


def make_dataset(n: int, seed: int = 0) -> list[dict]:
    """n problems, deterministic for a seed."""
    if not isinstance(n, int) or n <= 0:
        raise ValueError(f"n must be a positive int, got {n!r}")
    rng = random.Random(seed)
    return [make_problem(rng) for _ in range(n)]
