"""Multi-process training of every hfq method on 2 CPU processes (gloo), with the launch configs of
examples/accelerate: DDP through `accelerate launch --config_file examples/accelerate/ddp.yaml` for QuEST,
NVFP4 + LoRA (QeRL's policy), ECO and QFT; FSDP2 (`fully_shard` per decoder layer + root, under torchrun: accelerate
runs FSDP on GPUs only) for QuEST and NVFP4 + LoRA; ECO / QFT under FSDP2 refused at `fully_shard`.

Checked: ranks end bit-identical; the mean loss over ranks equals a single process on the same global batch; a
checkpoint written by 2 ranks resumes on 1 and one written by 1 resumes on 2 (the optimizer state and ECO/QFT's SR
generators are replicated, so the world size may change), ending where the uninterrupted run ends.
The worker is tests/scripts/scaleout.py.
"""
import os
import socket
import subprocess
import sys

import pytest
import torch
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "scripts", "scaleout.py")
CONFIGS = os.path.join(ROOT, "examples", "accelerate")
METHODS = ("quest", "nvfp4_lora", "eco", "qft")
FSDP2_METHODS = ("quest", "nvfp4_lora")
TIMEOUT = 240


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra):
    return dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TQDM_DISABLE="1", **extra,
                PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))


def _run(cmd, env=None, ok=True):
    r = subprocess.run(cmd, env=env or _env(), capture_output=True, text=True, timeout=TIMEOUT)
    if ok:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return r


def _single(out, tiny, methods, resume=None):
    _run([sys.executable, WORKER, str(out), tiny, ",".join(methods)] + ([str(resume)] if resume else []))


def _ddp(out, tiny, methods, resume=None):
    _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", os.path.join(CONFIGS, "ddp.yaml"),
          "--main_process_port", str(_free_port()), WORKER, str(out), tiny, ",".join(methods)]
         + ([str(resume)] if resume else []))


def _fsdp2(out, tiny, methods, ok=True):
    return _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                 str(_free_port()), WORKER, str(out), tiny, ",".join(methods)], env=_env(SCALEOUT_FSDP2="1"), ok=ok)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run once: 1 process, 2 DDP ranks, each resumed from the other's checkpoint, FSDP2 and its 2 -> 1
    resume. Returns a loader: load(tag, method, rank) -> what the worker saved."""
    from hfq.tiny import save_tiny

    base = tmp_path_factory.mktemp("scaleout")
    tiny = str(save_tiny(base / "tiny", arch="qwen2"))
    ddp, fsdp = base / "ddp", base / "fsdp2"
    ddp.mkdir()
    fsdp.mkdir()
    _single(ddp, tiny, METHODS)
    _ddp(ddp, tiny, METHODS)
    _single(ddp, tiny, METHODS, resume=2)
    _ddp(ddp, tiny, METHODS, resume=1)
    _fsdp2(fsdp, tiny, FSDP2_METHODS)
    _single(fsdp, tiny, FSDP2_METHODS, resume=2)

    def load(kind, tag, method, rank=0):
        return torch.load((ddp if kind == "ddp" else fsdp) / f"{method}_{tag}_rank{rank}.pt", weights_only=False)

    return load


def _maxdiff(a, b):
    """Largest difference over the floating tensors (codes are compared through the losses)."""
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a if a[k].is_floating_point())


def _close_losses(a, b, tol):
    assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol, (a, b)


# Loss tolerance vs one process: ECO's bf16 gradients are averaged in bf16 by the all-reduce (and SR then rounds
# differently), the other methods reduce fp32 or INT8-in-fp32 gradients.
LOSS_TOL = {"quest": 1e-4, "nvfp4_lora": 1e-4, "eco": 2e-3, "qft": 1e-4}
PARAM_TOL = {"quest": 1e-4, "nvfp4_lora": 1e-5}


def test_configs_are_accelerate_configs():
    from accelerate.commands.config.config_args import load_config_from_file

    ddp = load_config_from_file(os.path.join(CONFIGS, "ddp.yaml"))
    fsdp = load_config_from_file(os.path.join(CONFIGS, "fsdp2.yaml"))
    assert ddp.distributed_type.value == "MULTI_GPU" and ddp.num_processes == 2
    assert fsdp.distributed_type.value == "FSDP" and fsdp.fsdp_config["fsdp_version"] == 2
    with open(os.path.join(CONFIGS, "fsdp2.yaml")) as f:
        assert yaml.safe_load(f)["fsdp_config"]["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"


@pytest.mark.parametrize("method", METHODS)
def test_ddp_matches_single_process(runs, method):
    one, a, b = runs("ddp", "w1", method), runs("ddp", "w2", method, 0), runs("ddp", "w2", method, 1)
    assert a["world"] == 2 and a["wrapper"] == "DistributedDataParallel" and one["world"] == 1
    for k in a["snap"]:  # the replicas stay bit-identical (codes and scales included)
        assert torch.equal(a["snap"][k], b["snap"][k]), k
    _close_losses(a["losses"], one["losses"], LOSS_TOL[method])
    if method in PARAM_TOL:
        assert _maxdiff(a["snap"], one["snap"]) < PARAM_TOL[method]
    assert a["losses"][0] != a["losses"][-1]  # it trained


@pytest.mark.parametrize("method", METHODS)
def test_ddp_checkpoint_resumes_with_another_world_size(runs, method):
    """2 ranks -> 1 process and 1 process -> 2 ranks, after 2 of 4 steps: the resumed run ends where the
    uninterrupted run of the new world size ends."""
    one, two = runs("ddp", "w1", method), runs("ddp", "w2", method)
    on_one, on_two = runs("ddp", "w1_from2", method), runs("ddp", "w2_from1", method, 1)
    _close_losses(on_one["losses"], two["losses"][2:], LOSS_TOL[method])
    _close_losses(on_two["losses"], one["losses"][2:], LOSS_TOL[method])
    if method in PARAM_TOL:
        assert _maxdiff(on_one["snap"], one["snap"]) < PARAM_TOL[method]
        assert _maxdiff(on_two["snap"], two["snap"]) < PARAM_TOL[method]
    if method == "qft":  # INT8 gradients averaged in fp32: the resumed runs are exact
        for k in one["snap"]:
            assert torch.equal(on_one["snap"][k], one["snap"][k]), k


@pytest.mark.parametrize("method", FSDP2_METHODS)
def test_fsdp2_matches_single_process_and_resumes_on_one(runs, method):
    one, a, b = runs("ddp", "w1", method), runs("fsdp2", "w2", method, 0), runs("fsdp2", "w2", method, 1)
    assert a["strategy"] == "FSDP2" and a["wrapper"].startswith("FSDP")
    # every parameter is sharded (each rank holds half); no buffer is: NVFP4 codes and scales stay replicated
    assert a["sharded"].keys() == a["numel"].keys() and not a["sharded_buffers"]
    assert sum(a["sharded"].values()) * 2 == sum(a["numel"].values())
    for k in a["snap"]:
        assert torch.equal(a["snap"][k], b["snap"][k]), k
    _close_losses(a["losses"], one["losses"], LOSS_TOL[method])
    assert _maxdiff(a["snap"], one["snap"]) < PARAM_TOL[method]
    if method == "nvfp4_lora":
        packed = [k for k in a["snap"] if k.endswith("weight_packed")]
        assert packed and all(torch.equal(a["snap"][k], one["snap"][k]) for k in packed)  # frozen base
    resumed = runs("fsdp2", "w1_from2", method)  # the FSDP2 checkpoint (full state dicts) on one process
    _close_losses(resumed["losses"], a["losses"][2:], LOSS_TOL[method])
    assert _maxdiff(resumed["snap"], one["snap"]) < PARAM_TOL[method]


def test_fsdp2_refused_for_eco_at_start(tmp_path):
    """fully_shard on a model holding QParams fails in fully_shard itself, before any step,
    naming the methods, the strategy and what is supported; the launch exits instead of hanging."""
    from hfq.tiny import save_tiny

    tiny = str(save_tiny(tmp_path / "tiny", arch="qwen2"))
    r = _fsdp2(tmp_path, tiny, ["eco"], ok=False)
    assert r.returncode != 0
    msg = "ECO / QFT (QParam quantized weights) do not support FSDP2 (fully_shard)"
    # the first rank to fail prints it; torchrun may stop the other before it does
    assert msg in r.stderr, r.stderr[-4000:]
    assert "Supported for ECO / QFT: DDP" in r.stderr and "fully_shard" in r.stderr
    assert not list(tmp_path.glob("eco_*"))


def test_fsdp2_refused_for_qerl_trainer_at_construction(tmp_path):
    """QeRLGRPOTrainer given an FSDP2-sharded NVFP4 + LoRA policy refuses at construction (AQN and the rollout
    need the full norm weights and policy), naming QeRL, FSDP2 and DDP."""
    from hfq.tiny import save_tiny

    tiny = str(save_tiny(tmp_path / "tiny", arch="qwen2"))
    r = _fsdp2(tmp_path, tiny, ["qerl"], ok=False)
    assert r.returncode != 0
    msg = "QeRL (QeRLGRPOTrainer: NVFP4 + LoRA + AQN) does not support FSDP/FSDP2 (the model has sharded DTensor"
    assert msg in r.stderr, r.stderr[-4000:]
    assert "examples/accelerate/ddp.yaml" in r.stderr
    assert not list(tmp_path.glob("qerl_constructed_*"))


def test_qparam_split_and_sharded_optimizer_params_refused():
    """The refusal points, in one process (a world of 1): splitting a QParam (what fully_shard does), hfq's
    optimizers given DTensor (FSDP2) parameters at construction or swapped in before the first step (as accelerate
    does with an optimizer built before `prepare`), and parameters flattened by FSDP1 (in bf16, where FSDP1 would
    otherwise dequantize the QParams without an error)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    from torch.distributed.tensor import Shard, distribute_tensor

    from hfq.eco import ECOAdamW
    from hfq.optim.lion import QLion
    from hfq.qft import QFTConfig, quantize_model_
    from hfq.qparam import QParam
    from hfq.tiny import tiny_model

    q = torch.nn.Parameter(QParam.from_float(torch.randn(8, 64), "int8_dense_sparse"))
    with pytest.raises(NotImplementedError, match=r"int8_dense_sparse \(8, 64\).*DDP"):
        torch.chunk(q, 2, dim=0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        p = torch.nn.Parameter(distribute_tensor(torch.randn(8, 64), mesh, [Shard(0)]))
        with pytest.raises(ValueError, match=r"QLion: ECO / QFT .* FSDP2.*sharded DTensor"):
            QLion([p], lr=1e-3)
        w = torch.nn.Parameter(torch.randn(8, 64))
        opt = ECOAdamW([w], lr=1e-3)
        opt.param_groups[0]["params"] = [p]
        p.grad = torch.ones_like(p)
        before = p.detach().full_tensor().clone()
        with pytest.raises(ValueError, match=r"ECOAdamW: ECO / QFT .* FSDP2.*sharded DTensor"):
            opt.step()
        assert torch.equal(p.detach().full_tensor(), before) and not opt.state  # nothing was touched
        model = tiny_model("llama", hidden=64, intermediate=128, kv_heads=4, dtype=torch.bfloat16).train()
        quantize_model_(model, QFTConfig(weight_format="int8_dense_sparse", gradient_bits=8))
        wrapped = FSDP1(model, device_id=torch.device("cpu"), use_orig_params=False)
        with pytest.raises(ValueError, match=r"QLion: ECO / QFT .*flattened by FSDP \(FullyShardedDataParallel\)"):
            QLion(wrapped.parameters(), lr=1e-3)
    finally:
        dist.destroy_process_group()
