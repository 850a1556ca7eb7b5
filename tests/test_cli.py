"""The `hfq` command: `hfq grpo --model PATH` on a CPU-only machine picks CPU settings by itself."""
import json

import pytest
import torch

from hfq.cli import build_parser, main


def test_parser_has_every_subcommand():
    p = build_parser()
    for cmd in ("quantize", "export", "grpo"):
        assert p.parse_args([cmd] + (["m", "--out", "o"] if cmd != "grpo" else []))._module == f"hfq.cli.{cmd}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's automatic settings")
def test_grpo_with_a_model_path_runs_on_cpu_without_flags(tiny_dir, tmp_path, capsys):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(dict(num_generations=2, per_device_train_batch_size=2, max_completion_length=6,
                                   save_strategy="no", aqn_num_stages=2)))
    out = tmp_path / "run"
    assert main(["grpo", "--model", tiny_dir, "--steps", "2", "--config", str(cfg), "--output-dir", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["summary"]["steps"] == 2 and metrics["summary"]["quant"] == "nvfp4"
    assert (out / "curves.png").stat().st_size > 0
    saved = json.loads((out / "final" / "adapter_config.json").read_text())
    assert saved["peft_type"] == "LORA"
    assert "step   2" in capsys.readouterr().out


def test_grpo_device_settings_follow_the_hardware():
    from hfq.cli.grpo import _device_settings

    kw, dtype = _device_settings(demo=False)
    if torch.cuda.is_available():
        assert kw["use_cpu"] is False and dtype == (torch.bfloat16 if kw["bf16"] else torch.float32)
    else:
        assert (kw["use_cpu"], kw["bf16"], dtype) == (True, False, torch.float32)
    assert _device_settings(demo=True)[1] == torch.float32
