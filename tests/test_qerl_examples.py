"""examples/qerl_math.py end to end (both tasks) on a tiny local model and a local GSM8K-style file."""
import json
import os
import subprocess
import sys

import pytest

from hfq.qerl.data import make_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("task, qcol, loss", [("gsm8k", "question", "grpo"), ("bigmath", "problem", "dapo")])
def test_example_runs_offline(tiny_dir, tmp_path, task, qcol, loss):
    data = tmp_path / "train.jsonl"
    with open(data, "w") as f:
        for r in make_dataset(16, seed=1):
            f.write(json.dumps({qcol: r["prompt"], "answer": r["answer"]}) + "\n")
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(ROOT, "examples", "qerl_math.py"), "--task", task,
           "--model_name_or_path", tiny_dir,
           "--dataset_name", "json", "--data_files", str(data), "--dataset_config", "default",
           "--output_dir", str(out), "--max_steps", "2", "--num_generations", "4",
           "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--max_completion_length", "8",
           "--use_cpu", "true", "--bf16", "false", "--report_to", "none", "--logging_steps", "1", "--lora_r", "4",
           "--save_strategy", "no", "--learning_rate", "1e-3"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    assert (out / "curves.png").stat().st_size > 1000
    assert (out / "adapter_model.safetensors").exists()
    cfg = json.load(open(out / "adapter_config.json"))
    assert cfg["r"] == 4
    targets = set(cfg["target_modules"])
    assert {"q_proj", "down_proj"} <= targets
    assert f"task={task} loss_type={loss}" in r.stdout  # the preset of the task
