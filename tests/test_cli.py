"""The `hfq` command: `hfq grpo --model PATH` on a CPU-only machine picks CPU settings by itself."""
import json
import re

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


def test_demo_verdict_reads_the_change_against_its_noise():
    from hfq.qerl.demo import verdict

    assert verdict([0.0] * 100, [1.0] * 50 + [0.0] * 50)[2] == "improved"
    assert verdict([1.0] * 50 + [0.0] * 50, [0.0] * 100)[2] == "got worse"
    change, noise, word = verdict([1.0, 0.0] * 50, [0.0, 1.0] * 50)  # same accuracy, answers swapped
    assert (change, word) == (0.0, "no change beyond noise") and noise > 0.15
    with pytest.raises(ValueError, match="equal-length"):
        verdict([1.0] * 3, [1.0] * 4)


def test_plot_leaves_out_panels_that_show_only_rounding_noise(tmp_path):
    from hfq.qerl.plot import plot_curves, shown_panels

    rows = [{"step": s, "reward": 0.5 + s / 100, "loss": 3e-8 * (-1) ** s, "entropy": 0.4, "aqn/sigma": 0.0}
            for s in range(1, 6)]
    assert [p[0] for p in shown_panels(rows)] == ["reward", "entropy"]
    assert all(p[2] for p in shown_panels(rows))  # every panel has a y-axis label
    path = plot_curves(rows, str(tmp_path / "c.png"), heldout={"before": 0.7, "after": 0.9, "before_2se": 0.05, "after_2se": 0.04})
    assert (tmp_path / "c.png").stat().st_size > 0 and path.endswith("c.png")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the demo's CPU path")
def test_demo_explains_itself_and_ends_with_a_heldout_verdict(tmp_path, capsys):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(dict(num_generations=4, per_device_train_batch_size=8, max_completion_length=8)))
    out = tmp_path / "run"
    assert main(["grpo", "--steps", "2", "--pretrain-steps", "2", "--cache-dir", str(tmp_path / "cache"),
                 "--config", str(cfg), "--output-dir", str(out)]) == 0
    text = capsys.readouterr().out
    assert "What this shows" in text and "stage 0 adds no noise" in text and "reward  = accuracy" in text
    assert "AQN stage 0/4 sigma 0.0e+00" in text
    summary = json.loads((out / "metrics.json").read_text())["summary"]
    for key in ("reward", "accuracy", "format"):
        held = summary[f"heldout_{key}"]
        assert held["problems"] == 200 and held["noise_2se"] >= 0
        assert f"held-out {key} {held['before']:.3f} -> {held['after']:.3f}" in text.split("verdict")[-1]
        assert held["verdict"] in text.split("verdict")[-1]
    assert (out / "curves.png").stat().st_size > 0


@pytest.mark.parametrize("argv, said", [
    (["quantize", "/no/such/model", "--out", "o"], "/no/such/model: no such directory"),
    (["export", "./no_such_model", "--out", "o"], "./no_such_model: not a local checkpoint directory"),
    (["export", "org/name", "--out", "o"], "org/name: not a local checkpoint directory"),
    (["grpo", "--model", "~/no_such_model"], "~/no_such_model: no such directory"),
])
def test_missing_model_dir_stops_with_one_line(argv, said, tmp_path, monkeypatch):
    """A model path that is not there stops the command with its name, before anything loads."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=re.escape(said)):
        main(argv)


def test_quantize_refuses_a_quantized_checkpoint_and_export_a_missing_adapter(tiny_dir, tmp_path, monkeypatch):
    """`hfq quantize` of an already-quantized checkpoint would load it as it is and ignore --format / --scales
    (transformers keeps the checkpoint's config): it stops, naming the method; so does `hfq grpo` when --quant is
    not the checkpoint's format; `hfq export --adapter` with no adapter there stops before loading anything."""
    monkeypatch.chdir(tmp_path)
    assert main(["quantize", str(tiny_dir), "--out", "q"]) == 0
    with pytest.raises(SystemExit, match=re.escape("q: already quantized (hfq_nvfp4)")):
        main(["quantize", "q", "--out", "q2", "--format", "mxfp4"])
    assert not (tmp_path / "q2").exists()
    with pytest.raises(SystemExit, match=re.escape("nothere: not a PEFT adapter directory")):
        main(["export", "q", "--out", "e", "--adapter", "nothere"])
    for quant in ("mxfp4", "none"):  # grpo on it: only the format it holds
        with pytest.raises(SystemExit, match=re.escape(f"q: already quantized (hfq_nvfp4, nvfp4), not --quant {quant}")):
            main(["grpo", "--model", "q", "--quant", quant, "--output-dir", "g"])


def test_hub_errors_end_the_command_without_a_traceback(capsys, tmp_path, monkeypatch):
    """A Hub id that cannot be fetched (offline here) ends the command with exit status 1 and transformers' own
    message after `hfq quantize: error:`, no traceback."""
    monkeypatch.chdir(tmp_path)
    assert main(["quantize", "nobody-hfq-test/not-a-model", "--out", "o"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hfq quantize: error: ") and "Traceback" not in err


def test_model_dir_with_a_tilde_is_expanded(tmp_path, monkeypatch):
    """A quoted ~/... path (the shell left it as it is) names the home directory's folder, as it would unquoted."""
    from hfq.cli import check_model_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m").mkdir()
    assert check_model_dir("~/m") == str(tmp_path / "m") == check_model_dir("~/m", local_only=True)
    assert check_model_dir("org/name") == "org/name"


@pytest.mark.parametrize("argv, said", [
    (["grpo", "--steps", "0"], "argument --steps: expected a positive integer, got 0"),
    (["grpo", "--lora-r", "-1"], "argument --lora-r: expected a positive integer"),
    (["grpo", "--lr", "0"], "argument --lr: expected a positive number"),
    (["quantize", "m", "--out", "o", "--calib-batch-size", "0"], "argument --calib-batch-size"),
    (["quantize", "m", "--out", "o", "--device", "cuda:7"], "argument --device: cuda:7: this machine has"),
    (["quantize", "m", "--out", "afile"], "argument --out: afile is a file"),
])
def test_bad_values_stop_at_the_flag(argv, said, tmp_path, monkeypatch, capsys):
    """0 or a negative count is refused by argparse naming the flag (grpo read 0 as 'not given' and ran its
    default), an output path that is a file is refused (transformers only logged it and nothing was written), and
    a device this machine lacks is named before anything loads."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit):
        main(argv)
    assert said in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["grpo", "--preset", "gsm8k"], "--preset has no effect here"),
    (["grpo", "--dataset", "qa.jsonl"], "--dataset has no effect here"),
    (["grpo", "--model", ".", "--pretrain-steps", "5"], "--pretrain-steps has no effect here"),
    (["grpo", "--model", ".", "--dataset", "qa.jsonl", "--dataset-config", "main"], "--dataset-config has no effect"),
    (["grpo", "--no-aqn", "--aqn-scope", "rollout"], "--aqn-scope has no effect here"),
    (["grpo", "--model", ".", "--config", "bad.json"], "not valid JSON"),
    (["grpo", "--model", ".", "--config", "list.json"], "expected a JSON object"),
    (["grpo", "--model", ".", "--config", "unknown.json"], "['num_generation'] are not QeRLConfig fields"),
])
def test_grpo_options_the_mode_ignores_or_a_bad_config_stop_before_loading(argv, said, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "list.json").write_text("[1]")
    (tmp_path / "unknown.json").write_text('{"num_generation": 4}')
    with pytest.raises(SystemExit, match=re.escape(said)):
        main(argv)


def test_a_refused_value_is_one_line_not_a_traceback(tiny_dir, tmp_path, capsys):
    """ValueErrors (hfq's or the HF libraries' refusals, e.g. scales=mse with mxfp4) end the command with the message."""
    assert main(["quantize", tiny_dir, "--out", str(tmp_path / "q"), "--format", "mxfp4", "--scales", "mse",
                 "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hfq quantize: error: ") and "scales" in err and "Traceback" not in err


def test_grpo_config_file_seed_and_output_dir_are_kept_unless_flags_say_otherwise(tmp_path):
    from hfq.cli.grpo import _build_config, _check_args

    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(dict(seed=5, output_dir=str(tmp_path / "from-file"))))
    p = build_parser()
    args = p.parse_args(["grpo", "--model", ".", "--config", str(cfg)])
    _check_args(args)
    built = _build_config(args, demo=False)
    assert (built.seed, built.output_dir, args.seed) == (5, str(tmp_path / "from-file"), 5)
    args = p.parse_args(["grpo", "--model", ".", "--config", str(cfg), "--seed", "2", "--output-dir", "o"])
    _check_args(args)
    built = _build_config(args, demo=False)
    assert (built.seed, built.output_dir) == (2, "o")
    args = p.parse_args(["grpo", "--model", "."])
    _check_args(args)
    assert (args.seed, args.output_dir) == (0, "hfq-grpo-out")
