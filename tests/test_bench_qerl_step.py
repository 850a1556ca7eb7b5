"""benchmarks/qerl_step.py on CPU: its table writer on made-up timings, and the methods' compiled decoder layers kept
in dynamo caches apart (each model's layers run their own copy of the forward code)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_selftest_tables_and_compiled_caches_apart():
    import qerl_step

    qerl_step.selftest()
