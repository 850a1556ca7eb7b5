"""Rewards on crafted completions: extraction (<answer>, GSM8K ####), equivalence, format, never crash."""
import pytest

from hfq.qerl import rewards as R


def test_extract_answer_forms():
    assert R.extract_answer("<think>2+2</think><answer> 4 </answer>") == "4"
    assert R.extract_answer("<answer>1</answer> then <answer>7</answer>") == "7"  # the last one
    assert R.extract_answer("so 3 + 4 = 7\n#### 7") == "7"
    assert R.extract_answer("no answer here 12") is None
    assert R.extract_answer(None) is None
    assert R.extract_gold("Natalia sold 48/2 = <<48/2=24>>24 clips\n#### 72") == "72"
    assert R.extract_gold(" 3/4 ") == "3/4"


def test_accuracy_reward_crafted():
    comps = ["<think>48+24=72</think><answer>72</answer>",
             "<think>x</think><answer>$1,000$</answer>",
             "<think>x</think><answer>0.75</answer>",
             "<think>x</think><answer>71</answer>",
             "#### 72",
             [{"role": "assistant", "content": "<answer>\\frac{1}{2}</answer>"}],
             "<answer></answer>", "", None, 42, ["<answer>"], {"content": "<answer>5</answer>"}]
    golds = ["Some work #### 72", "1000", "3/4", "72", "72", "0.5", "0", "1", "1", "42", "1", "5"]
    assert R.accuracy_reward(comps, answer=golds) == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_accuracy_reward_solution_column_and_missing_column():
    assert R.accuracy_reward(["<answer>\\sqrt{4}</answer>"], solution=["2"]) == [1.0]
    with pytest.raises(ValueError, match="answer/solution"):
        R.accuracy_reward(["<answer>1</answer>"], prompts=["q"])


def test_fallback_without_math_verify():
    assert R.answers_equal("1/2", "0.5", use_math_verify=False)
    assert R.answers_equal("\\boxed{12}", "12.", use_math_verify=False)
    assert R.answers_equal(" Paris ", "paris", use_math_verify=False)
    assert R.answers_equal("\\frac{1}{2}", "0.5", use_math_verify=False)  # simple LaTeX numbers are exact values
    assert R.answers_equal("-\\dfrac{6}{8}", "-3/4", use_math_verify=False)
    assert R.answers_equal("\\sqrt{4}", "2", use_math_verify=False)
    assert not R.answers_equal("\\sqrt{2}", "1.414", use_math_verify=False)  # irrational: no numeric value here
    assert not R.answers_equal("\\frac{1}{0}", "1", use_math_verify=False)
    assert not R.answers_equal("3", "4", use_math_verify=False)
    assert not R.answers_equal("1/0", "1/0x", use_math_verify=False)


def test_format_reward_crafted():
    comps = ["<think>a</think> <answer>1</answer>", "\n<think>a\nb</think>\n<answer>x</answer>\n",
             "<answer>1</answer>", "<think>a</think><answer></answer>", "pre <think>a</think><answer>1</answer>",
             "<think>a</think><answer>1</answer> post", "<think><think>a</think><answer>1</answer>",
             None, 3.5, [{"role": "assistant", "content": "<think>a</think><answer>2</answer>"}]]
    assert R.format_reward(comps) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_prompt_suffix_is_the_papers():
    p = R.add_suffix("What is 2+2?")
    assert p.startswith("What is 2+2?\nSolve the following math problem step by step.")
    assert p.endswith("<think> ... </think> <answer> ... </answer>.")
    with pytest.raises(ValueError, match="question"):
        R.add_suffix(None)


@pytest.mark.parametrize("mv", [False, True])
def test_lists_of_numbers_are_not_one_number(mv):
    """Only thousands separators are dropped: "1, 2" / "3 4" are two numbers, not 12 / 34 (they scored 1.0)."""
    from hfq.qerl.rewards import HAVE_MATH_VERIFY, answers_equal

    if mv and not HAVE_MATH_VERIFY:
        pytest.skip("math-verify is not installed")
    for pred, gold in (("1, 2", "12"), ("3 4", "34"), ("-1, 2", "-12"), ("23", "2, 3")):
        assert not answers_equal(pred, gold, use_math_verify=mv), (pred, gold)
    for pred, gold in (("1,234", "1234"), ("-1,234.5", "-1234.5"), ("$\\boxed{42}$", "42"), ("3 / 4", "0.75")):
        assert answers_equal(pred, gold, use_math_verify=mv), (pred, gold)
