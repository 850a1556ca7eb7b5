"""What `import hfq` puts into transformers / PEFT: checked before anything is patched, re-registration after a
notebook reload, and configs of one class name from two methods told apart at from_pretrained."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

import hfq
from hfq.tiny import save_tiny

REPO = Path(__file__).resolve().parent.parent


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_a_peft_without_the_wrapped_entry_points_fails_import_clearly_and_patches_nothing():
    out = _run("""
import peft.tuners.tuners_utils as tu
del tu._maybe_include_all_linear_layers
import transformers
from torch.nn.parallel import DistributedDataParallel as DDP
try:
    import hfq
except ImportError as e:
    print("ImportError:", e)
print("patched:", hasattr(transformers.PreTrainedModel.save_pretrained, "hfq_wrapped"),
      hasattr(DDP.__init__, "hfq_wrapped"),
      "hfq_nvfp4" in transformers.quantizers.auto.AUTO_QUANTIZER_MAPPING)
""")
    assert "ImportError: hfq: this PEFT version lacks ['tuners_utils._maybe_include_all_linear_layers']" in out.stdout, \
        out.stdout + out.stderr
    assert "patched: False False False" in out.stdout, out.stdout + out.stderr


def test_reregistration_after_reloading_a_config_module():
    out = _run("""
import importlib
import hfq, hfq._register as r, hfq.nvfp4.config as c
importlib.reload(c)
r._DONE = False
r.register_all()
from transformers.quantizers import auto
print("ok", auto.AUTO_QUANTIZATION_CONFIG_MAPPING["hfq_nvfp4"] is c.NVFP4Config)
""")
    assert "ok True" in out.stdout, out.stdout + out.stderr


def test_another_packages_class_under_our_method_is_refused(monkeypatch):
    from transformers.quantizers import auto

    from hfq import _register

    class NVFP4Config(transformers.utils.quantization_config.QuantizationConfigMixin):
        pass

    monkeypatch.setitem(auto.AUTO_QUANTIZATION_CONFIG_MAPPING, "hfq_nvfp4", NVFP4Config)
    monkeypatch.setattr(_register, "_DONE", False)
    with pytest.raises(RuntimeError, match="'hfq_nvfp4' is already registered by another package"):
        _register.register_all()


def test_configs_sharing_transformers_class_name_are_told_apart(tmp_path):
    """hfq.NVFP4Config and transformers.NVFP4Config share a name, by which transformers compares configs: a
    checkpoint of either method loaded with the other's config is refused, not loaded with the checkpoint's method."""
    path = save_tiny(tmp_path / "tiny", arch="qwen2")
    AutoModelForCausalLM.from_pretrained(path, quantization_config=hfq.NVFP4Config()).save_pretrained(tmp_path / "hq")
    with pytest.raises(ValueError, match="quantized with quant_method 'hfq_nvfp4'.*class named NVFP4Config"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "hq", quantization_config=transformers.NVFP4Config())
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "hq", quantization_config=hfq.NVFP4Config())
    assert type(again.model.layers[0].self_attn.q_proj).__name__ == "NVFP4Linear"
    cfg = json.loads((Path(path) / "config.json").read_text())  # a checkpoint of transformers' own NVFP4 method
    cfg["quantization_config"] = {"quant_method": "nvfp4"}
    (Path(path) / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantized with quant_method 'nvfp4'.*hfq.nvfp4.config.NVFP4Config"):
        AutoModelForCausalLM.from_pretrained(path, quantization_config=hfq.NVFP4Config(), dtype=torch.float32)


def test_reloading_the_registering_modules_patches_nothing_twice():
    """A notebook reload (%autoreload, importlib.reload) of the modules that patch PEFT and torch must not wrap
    them again: PEFT would count the NVFP4 weights twice and every optimizer step run the QParam check twice."""
    out = _run("""
import importlib, tempfile, torch, peft
import hfq
from hfq.tiny import save_tiny
from torch.optim import optimizer as O
from transformers import AutoModelForCausalLM
path = save_tiny(tempfile.mkdtemp() + "/t", arch="qwen2")
def count():
    m = AutoModelForCausalLM.from_pretrained(path, quantization_config=hfq.NVFP4Config())
    return peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules="all-linear")).get_nb_trainable_parameters()
before = count(), len(O._global_optimizer_pre_hooks)
importlib.reload(importlib.import_module("hfq._base.peft_guard")).install()
importlib.reload(importlib.import_module("hfq.nvfp4.peft_lora")).register_peft_dispatch()
importlib.reload(importlib.import_module("hfq.qparam.guard"))
print("same", before == (count(), len(O._global_optimizer_pre_hooks)))
""")
    assert "same True" in out.stdout, out.stdout + out.stderr


def test_other_methods_config_is_refused_without_a_false_name_clash(tmp_path):
    """A QuEST checkpoint loaded with QFTConfig: refused, and the message no longer claims transformers has a class
    of that name (only NVFP4Config is shared)."""
    path = save_tiny(tmp_path / "tiny", arch="qwen2")
    AutoModelForCausalLM.from_pretrained(path, quantization_config=hfq.QuESTConfig()).save_pretrained(tmp_path / "q")
    with pytest.raises(ValueError, match=r"quant_method 'hfq_quest' .*hfq.qft.config.QFTConfig \(quant_method "
                                         r"'hfq_qft'\)\. Load") as e:
        AutoModelForCausalLM.from_pretrained(tmp_path / "q", quantization_config=hfq.QFTConfig())
    assert "class named" not in str(e.value)
