"""ECO and QFT under FSDP2 on 2 CUDA GPUs (NCCL), as tests/test_scaleout.py checks them on 2 CPU processes, plus
transformers.Trainer under `accelerate launch --config_file examples/accelerate/fsdp2.yaml` with
`optimizer_cls_and_kwargs`. Skipped without 2 GPUs. Workers: tests/scripts/scaleout.py (SCALEOUT_DEVICE=cuda) and
tests/scripts/trainer_fsdp2.py.
"""
import os
import sys

import pytest
import torch

from test_scaleout import (CONFIGS, QP_LOGIT_TOL, ROOT, WORKER, _close_losses, _env,
                           _free_port, _run)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2 CUDA GPUs (FSDP2 over NCCL): run on the 2-GPU device kind")
TRAINER = os.path.join(ROOT, "tests", "scripts", "trainer_fsdp2.py")
GPU = dict(SCALEOUT_DEVICE="cuda")
QPARAM_FSDP2 = ("eco_bf16", "qft_bf16")  # on CUDA their optimizers take the fused Triton steps


def _one(out, methods, resume=None):
    _run([sys.executable, WORKER, str(out), "-", ",".join(methods)] + ([str(resume)] if resume else []),
         env=_env(CUDA_VISIBLE_DEVICES="0", **GPU))


def _two(out, methods, resume=None):
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
          WORKER, str(out), "-", ",".join(methods)] + ([str(resume)] if resume else []),
         env=_env(SCALEOUT_FSDP2="1", CUDA_VISIBLE_DEVICES="0,1", **GPU))


@pytest.fixture(scope="module")
def gpu_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("scaleout_gpu")
    _one(out, QPARAM_FSDP2)
    _two(out, QPARAM_FSDP2)
    _one(out, QPARAM_FSDP2, resume=2)
    _two(out, QPARAM_FSDP2, resume=1)

    def load(tag, method, rank=0):
        return torch.load(out / f"{method}_{tag}_rank{rank}.pt", weights_only=False)

    load.out = out
    return load


# The GPU runs compare 8 rows on one GPU with 4 + 4 reduced over NCCL in bf16: gradients differing by a bf16 ulp
# flip codes at FP8 rounding boundaries, so the losses drift apart by about 1e-3 per few steps. The CPU tests
# (gloo, fp32 sums) keep QP_LOSS_TOL; that the optimizer's rounding is the same on shards and on the whole weight
# is checked bit for bit by the kernel tests (-k row_shards).
GPU_LOSS_TOL = 5e-3


@pytest.mark.parametrize("method", QPARAM_FSDP2)
def test_nccl_fsdp2_matches_one_gpu_and_resumes_on_another_world_size(gpu_runs, method):
    one, a, b = gpu_runs("w1", method), gpu_runs("w2", method, 0), gpu_runs("w2", method, 1)
    assert a["strategy"] == "FSDP2" and sum(a["sharded"].values()) * 2 == sum(a["numel"].values())
    assert a["qparam_bytes"] < 0.6 * one["qparam_bytes"]
    for k in a["snap"]:
        assert torch.equal(a["snap"][k], b["snap"][k]), k
    _close_losses(a["losses"], one["losses"], GPU_LOSS_TOL)
    assert float((a["logits"] - one["logits"]).abs().max()) < QP_LOGIT_TOL
    on_one, on_two = gpu_runs("w1_from2", method), gpu_runs("w2_from1", method, 1)
    _close_losses(on_one["losses"], a["losses"][2:], GPU_LOSS_TOL)
    _close_losses(on_two["losses"], one["losses"][2:], GPU_LOSS_TOL)


@pytest.mark.parametrize("method", QPARAM_FSDP2)
def test_nccl_fsdp2_save_pretrained_loads_on_one_gpu(gpu_runs, method):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    import hfq  # noqa: F401  (registers hfq_qft with transformers, as a user's script does)

    two = gpu_runs("w2", method)
    path = gpu_runs.out / f"{method}_w2_pretrained"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    empty = [k for k, s in shapes.items() if 0 in s]
    assert len(empty) <= 1, f"0-element tensors beyond hfq's checkpoint guard (one layer's `weight`): {empty}"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with torch.no_grad():
        logits = model.cuda()(input_ids=two["probe"].cuda()).logits.float().cpu()
    assert float((logits - two["logits"]).abs().max()) < 2e-2


def _trainer(out, method, n, resume=None, state_dict_type="SHARDED_STATE_DICT"):
    """Trainer under accelerate's fsdp2.yaml on n GPUs; checkpoints as FSDP2 sharded state dicts (DCP) by default."""
    _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", os.path.join(CONFIGS, "fsdp2.yaml"),
          "--num_processes", str(n), "--fsdp_state_dict_type", state_dict_type, "--main_process_port",
          str(_free_port()), TRAINER, str(out), method] + ([str(resume)] if resume else []),
         env=_env(CUDA_VISIBLE_DEVICES=",".join(map(str, range(n))), **GPU))


@pytest.mark.parametrize("method", QPARAM_FSDP2)
def test_trainer_fsdp2_sharded_checkpoint_resumes_on_another_world_size(tmp_path, method):
    """Trainer(optimizer_cls_and_kwargs=(ECOAdamW | QLion, ...)) on 2 GPUs matches 1 GPU on the same global batch;
    its checkpoint after 2 of 4 steps resumes on 1 GPU and ends where the 1-GPU run ends."""
    _trainer(tmp_path, method, 2)
    _trainer(tmp_path, method, 1)
    _trainer(tmp_path, method, 1, resume=tmp_path / f"{method}_w2" / "checkpoint-2")
    two = torch.load(tmp_path / f"{method}_w2.pt", weights_only=False)
    one = torch.load(tmp_path / f"{method}_w1.pt", weights_only=False)
    resumed = torch.load(tmp_path / f"{method}_w1_resumed.pt", weights_only=False)
    for run in (two, one, resumed):  # on the GPUs under FSDP2, not on CPU processes
        assert run["device"] == "cuda" and run["fsdp"], {k: run[k] for k in ("device", "fsdp", "world")}
    assert len(two["losses"]) == len(one["losses"]) == 4 and two["losses"][0] != two["losses"][-1]
    _close_losses(two["losses"], one["losses"], 1e-2)
    _close_losses(resumed["losses"][-2:], one["losses"][2:], 1e-2)
    assert float((resumed["logits"] - one["logits"]).abs().max()) < QP_LOGIT_TOL


@pytest.mark.parametrize("method", QPARAM_FSDP2)
def test_trainer_fsdp2_full_state_dict_saves_and_resumes_on_two_gpus(tmp_path, method):
    """fsdp2.yaml as shipped (FULL_STATE_DICT) with ECO / QFT: save_model() writes a folder that loads in one process
    with the trained model's logits, and the step-2 checkpoint resumes on 2 GPUs to the uninterrupted run's end."""
    from transformers import AutoModelForCausalLM

    import hfq  # noqa: F401

    _trainer(tmp_path, method, 2, state_dict_type="FULL_STATE_DICT")
    _trainer(tmp_path, method, 2, resume=tmp_path / f"{method}_w2" / "checkpoint-2", state_dict_type="FULL_STATE_DICT")
    run = torch.load(tmp_path / f"{method}_w2.pt", weights_only=False)
    resumed = torch.load(tmp_path / f"{method}_w2_resumed.pt", weights_only=False)
    assert run["device"] == "cuda" and run["fsdp"] and len(run["losses"]) == 4
    _close_losses(resumed["losses"][-2:], run["losses"][2:], 1e-2)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / f"{method}_w2_final").cuda()
    probe = torch.randint(4, 90, (8, 16), generator=torch.Generator().manual_seed(199)).cuda()  # the worker's batch(99)
    with torch.no_grad():
        assert float((back(input_ids=probe).logits.float().cpu() - run["logits"]).abs().max()) < QP_LOGIT_TOL


@pytest.mark.parametrize("method", ["nvfp4", "qft", "quest"])
def test_layers_on_a_gpu_that_is_not_current_match_the_current_one(tmp_path, method):
    """Triton launches on the current device: a model on cuda:1 while cuda:0 is current (device_map over several
    GPUs, or a policy beside a reference model) must give the bits of the same model on cuda:0, quantize-on-load,
    few-row (Gluon) and many-row forwards and the rollout engine alike."""
    import hfq
    from hfq.rollout import RolloutEngine
    from hfq.tiny import save_tiny
    from transformers import AutoModelForCausalLM

    torch.cuda.set_device(0)
    path = save_tiny(tmp_path / "tiny", arch="qwen2", seed=6, hidden=256, intermediate=512)
    cfg = {"nvfp4": hfq.NVFP4Config, "qft": hfq.QFTConfig, "quest": hfq.QuESTConfig}[method]
    load = lambda dev: AutoModelForCausalLM.from_pretrained(  # noqa: E731
        path, quantization_config=cfg(), dtype=torch.bfloat16, device_map=dev).eval()
    m0, m1 = load("cuda:0"), load("cuda:1")
    assert torch.cuda.current_device() == 0
    s0, s1 = m0.state_dict(), m1.state_dict()
    for name, t in s0.items():
        assert torch.equal(t.cpu().view(torch.uint8), s1[name].cpu().view(torch.uint8)), name
    for rows in (1, 8, 100):
        ids = torch.randint(0, m0.config.vocab_size, (1, rows), generator=torch.Generator().manual_seed(rows))
        with torch.no_grad():
            want, got = m0(ids.to("cuda:0")).logits.cpu(), m1(ids.to("cuda:1")).logits.cpu()
        assert torch.equal(got, want), rows
    if method == "nvfp4":
        prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
        outs = []
        for m in (m0, m1):
            eng = RolloutEngine(m, max_batch=2, max_seq_len=40, kv_block=16)
            outs.append(eng.generate(prompts, max_new_tokens=8, temperature=0, eos_token_ids=[]))
            assert eng.use_graphs
        assert torch.equal(outs[0].completion_ids.cpu(), outs[1].completion_ids.cpu())


def test_optimizer_over_quantized_weights_on_two_gpus_is_refused():
    """The fused steps launch over many weights on one device: quantized weights spread over GPUs in one process
    are refused by name, pointing to DDP / FSDP2."""
    from hfq.eco import ECOAdamW
    from hfq.qparam import QParam

    ps = [torch.nn.Parameter(QParam.from_float(torch.randn(32, 64, device=f"cuda:{i}"), "fp8_e4m3_row"))
          for i in (0, 1)]
    with pytest.raises(ValueError, match=r"several GPUs in one process \(cuda:0: .*cuda:1: .*DDP or FSDP2"):
        ECOAdamW(ps, lr=1e-3)
    ECOAdamW(ps[:1], lr=1e-3)
