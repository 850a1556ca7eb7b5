"""Rule-based rewards for math RL (QeRL App. E): the <think>/<answer> prompt suffix, answer extraction
(<answer> tags, GSM8K's `#### x`, else the whole completion), accuracy and format rewards in TRL's reward-function
form.

Equivalence uses `math-verify` when it imports; otherwise a numeric/string fallback: both sides are stripped of
`$`, `\\boxed{}`, thousands separators and trailing punctuation, compared as exact fractions when both parse as
numbers (`1/2`, `0.5`, `\\frac{1}{2}`, `\\sqrt{4}`; `50%` is not a number here), else as lower-cased whitespace-free strings.
Reward functions never raise on malformed completions: they score 0.
"""
from __future__ import annotations

import contextlib
import logging
import math
import re
import threading
from fractions import Fraction

PROMPT_SUFFIX = (
    "Solve the following math problem step by step. The reasoning process and direct answer are enclosed within "
    "<think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning process here </think> "
    "<answer> answer here </answer>: <think> ... </think> <answer> ... </answer>."
)

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_GSM8K_RE = re.compile(r"####\s*([^\n]+)")
_FORMAT_RE = re.compile(r"^\s*<think>(?:(?!</?think>|</?answer>).)*</think>\s*<answer>(?:(?!</?answer>).)+</answer>\s*$",
                        re.DOTALL)

try:  # pragma: no cover - exercised when installed, which is the dev setup
    from math_verify import parse as _mv_parse, verify as _mv_verify

    HAVE_MATH_VERIFY = True
except Exception:  # noqa: BLE001 - any import problem means "use the fallback"
    HAVE_MATH_VERIFY = False


def completion_text(completion) -> str:
    """Text of a TRL completion: a string, or a list of chat messages (the last assistant content)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    if isinstance(completion, (list, tuple)) and completion:
        last = completion[-1]
        if isinstance(last, dict):
            c = last.get("content", "")
            if isinstance(c, list):  # typed content blocks
                return "".join(b.get("text", "") for b in c if isinstance(b, dict))
            return str(c)
        return str(last)
    return ""


def extract_answer(text) -> str | None:
    """The model's final answer: last <answer>..</answer>, else GSM8K `#### x`, else None."""
    if not isinstance(text, str):
        return None
    m = _ANSWER_RE.findall(text)
    if m:
        return m[-1].strip() or None
    g = _GSM8K_RE.findall(text)
    if g:
        return g[-1].strip() or None
    return None


def extract_gold(answer) -> str | None:
    """A dataset's reference answer: GSM8K's `... #### 42` -> `42`; a plain value as is."""
    if answer is None:
        return None
    s = str(answer)
    g = _GSM8K_RE.findall(s)
    if g:
        return g[-1].strip()
    s = s.strip()
    return s or None


def _normalize(s: str) -> str:
    s = s.replace("$", "").strip()
    m = re.fullmatch(r"\\boxed\{(.*)\}", s, re.DOTALL)
    if m:
        s = m.group(1)
    s = s.replace("$", "").replace("\\!", "").strip().rstrip(".").strip()
    return s


_LATEX_FRAC = re.compile(r"(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")
_LATEX_SQRT = re.compile(r"(-?)\\sqrt\{([^{}]+)\}")


def _exact_sqrt(x: Fraction) -> Fraction | None:
    if x < 0:
        return None
    n, d = math.isqrt(x.numerator), math.isqrt(x.denominator)
    return Fraction(n, d) if n * n == x.numerator and d * d == x.denominator else None


def _as_number(s: str) -> Fraction | None:
    """An exact value for a plain number, `a/b`, or the simple LaTeX forms `\\frac{a}{b}` and `\\sqrt{x}` (when
    the root is rational); None otherwise."""
    t = s.strip()
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", t):  # thousands separators only: "1, 2" is a list, not 12
        t = t.replace(",", "")
    t = re.sub(r"(?<=[-\\{}])\s+|\s+(?=[{}/])|(?<=/)\s+", "", t)  # spaces inside \frac{ a }{ b } or "3 / 4"
    for pat, fn in ((_LATEX_FRAC, lambda a, b: None if a is None or b is None or b == 0 else a / b),
                    (_LATEX_SQRT, lambda a: None if a is None else _exact_sqrt(a))):
        m = pat.fullmatch(t)
        if m:
            v = fn(*(_as_number(g) for g in m.groups()[1:]))
            return None if v is None else (-v if m.group(1) else v)
    if not re.fullmatch(r"-?\d+(?:\.\d+)?(?:/\d+)?", t):
        return None
    try:
        if "/" in t:
            a, b = t.split("/")
            return Fraction(Fraction(a), Fraction(b))
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


def fallback_equal(pred: str, gold: str) -> bool:
    p, g = _normalize(pred), _normalize(gold)
    pn, gn = _as_number(p), _as_number(g)
    if pn is not None and gn is not None:
        return pn == gn
    return _squash(p) == _squash(g) and p != ""


def _squash(s: str) -> str:
    """Lower-cased, whitespace removed except between two digits ("3 4" is two numbers, not 34)."""
    return re.sub(r"\s+", "", re.sub(r"(?<=\d)\s+(?=\d)", "|", s)).lower()


@contextlib.contextmanager
def _quiet_math_verify():
    log = logging.getLogger("math_verify")
    old = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(old)


def answers_equal(pred, gold, use_math_verify: bool | None = None) -> bool:
    """Equivalence of a predicted and a reference answer (math-verify if available, else the fallback)."""
    if not isinstance(pred, str) or not isinstance(gold, str) or not pred.strip() or not gold.strip():
        return False
    if fallback_equal(pred, gold):
        return True
    if use_math_verify is None:
        use_math_verify = HAVE_MATH_VERIFY
    if use_math_verify and HAVE_MATH_VERIFY:
        # math-verify's timeouts use SIGALRM, which only works on the main thread
        t = 5 if threading.current_thread() is threading.main_thread() else None
        try:
            with _quiet_math_verify():
                g = _mv_parse(gold if "$" in gold else f"${gold}$", parsing_timeout=t)
                p = _mv_parse(pred if "$" in pred else f"${pred}$", parsing_timeout=t)
                return bool(g) and bool(p) and bool(_mv_verify(g, p, timeout_seconds=t))
        except Exception:  # noqa: BLE001 - a verifier failure is a wrong answer, never a crash
            return False
    return False


def _golds(kwargs, n):
    for key in ("answer", "solution", "ground_truth", "target"):
        if key in kwargs and kwargs[key] is not None:
            v = kwargs[key]
            return list(v) if isinstance(v, (list, tuple)) else [v] * n
    raise ValueError("accuracy_reward needs a dataset column named one of answer/solution/ground_truth/target")


def accuracy_reward(completions, **kwargs) -> list[float]:
    """1.0 when the extracted answer equals the reference (column `answer`, `solution`, ...), else 0.0."""
    golds = _golds(kwargs, len(completions))
    out = []
    for c, gold in zip(completions, golds):
        try:
            pred = extract_answer(completion_text(c))
            g = extract_gold(gold)
            out.append(1.0 if (pred is not None and g is not None and answers_equal(pred, g)) else 0.0)
        except Exception:  # noqa: BLE001
            out.append(0.0)
    return out


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 for exactly `<think>...</think> <answer>...</answer>` (nothing else around), else 0.0."""
    out = []
    for c in completions:
        try:
            out.append(1.0 if _FORMAT_RE.match(completion_text(c)) else 0.0)
        except Exception:  # noqa: BLE001
            out.append(0.0)
    return out


def add_suffix(question: str, suffix: str = PROMPT_SUFFIX) -> str:
    """The paper's prompt: the problem followed by the <think>/<answer> instruction."""
    if not isinstance(question, str):
        raise ValueError(f"question must be a str, got {type(question).__name__}")
    return f"{question.strip()}\n{suffix}"
