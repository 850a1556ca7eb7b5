"""`import hfq` alone gives attribute access to every subpackage (README: `hfq.eco.optimizer_cls_and_kwargs(args)`)."""
import subprocess
import sys

import hfq

SUBPACKAGES = ("eco", "qerl", "qft", "quest", "nvfp4", "hub", "rollout", "optim")


def test_subpackages_are_attributes_in_a_fresh_interpreter():
    code = ("import sys, hfq\n"
            f"names = {SUBPACKAGES!r}\n"
            "assert not any(f'hfq.{n}' in sys.modules for n in ('eco', 'hub', 'rollout')), 'eager import'\n"
            "for n in names:\n"
            "    m = getattr(hfq, n)\n"
            "    assert m is sys.modules[f'hfq.{n}'], n\n"
            "assert callable(hfq.eco.optimizer_cls_and_kwargs)\n"
            "assert callable(hfq.hub.save_for_hub)\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_unknown_attribute_still_raises():
    try:
        hfq.not_a_module
    except AttributeError as e:
        assert "not_a_module" in str(e)
    else:
        raise AssertionError("hfq.not_a_module did not raise")
    assert set(SUBPACKAGES) <= set(dir(hfq))
