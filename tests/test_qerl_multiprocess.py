"""`accelerate launch --multi_gpu` with 2 processes (CPU/gloo here, NCCL on GPUs): the ranks sample with the same AQN noise and end with the same LoRA."""
import os
import subprocess
import sys

import torch


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_share_noise_and_weights(tiny_dir, tmp_path):
    script = os.path.join(os.path.dirname(__file__), "scripts", "qerl_two_process.py")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's hfq, not another install
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", str(_free_port()), "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", script, tiny_dir, str(tmp_path)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    a, b = (torch.load(tmp_path / f"rank{i}.pt") for i in (0, 1))
    assert a["world"] == b["world"] == 2
    assert sorted(a["sampled"]) == sorted(b["sampled"]) == [0, 1]
    for step in a["sampled"]:  # one perturbed policy per step, identical on every rank
        assert torch.equal(a["sampled"][step], b["sampled"][step])
    assert a["lora"].keys() == b["lora"].keys() and a["lora"]
    for n in a["lora"]:  # DDP kept the replicas identical
        assert torch.allclose(a["lora"][n], b["lora"][n], rtol=0, atol=1e-6), n
    assert any(v.abs().sum() > 0 for n, v in a["lora"].items() if "lora_B" in n)  # and they trained
