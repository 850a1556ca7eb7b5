"""ECO under DistributedDataParallel (2 CPU processes, gloo): QParam survives DDP's construction-time broadcast,
gradients are all-reduced, both ranks keep bit-identical codes/scales, and the result is the single-process run on
the concatenated batch (bit-exact against a single process that reduces the two half-batch gradients the way DDP
does; within bf16-gradient tolerance against one backward on the whole batch). Also through `accelerate launch`.

This file is also the worker script: `python tests/test_eco_ddp.py ddp OUT` spawns 2 ranks with
torch.multiprocessing; `accelerate launch ... tests/test_eco_ddp.py accelerate OUT` runs one rank per process.
"""
import os
import socket
import subprocess
import sys

import torch
from _hfq_test_utils import shard, snapshot

STEPS, SHARD, SEQ, WORLD = 4, 4, 16, 2
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model(seed=0, fmt="fp8_e4m3_row"):
    from hfq.qft import QFTConfig, quantize_model_
    from hfq.tiny import tiny_model

    model = tiny_model("llama", seed=seed, hidden=64, intermediate=128, kv_heads=4).train()
    quantize_model_(model, QFTConfig(weight_format=fmt, group_size=32))
    return model


def _opt(params):
    from hfq.eco import ECOAdamW

    # bf16 states: their stochastically rounded second moments must draw alike on every rank
    return ECOAdamW(params, lr=1e-2, weight_decay=0.1, rounding="sr", seed=3, state_dtype=torch.bfloat16)


def _shard(step, rank):
    return shard(step, rank, SHARD, SEQ)


def _train(model, opt, rank, wrapped=None, backward=None):
    """STEPS optimizer steps on this rank's shards; returns snapshots after each step and the losses."""
    snaps, losses, grads = [], [], None
    wrapped = wrapped or model
    for step in range(STEPS):
        x = _shard(step, rank)
        loss = wrapped(input_ids=x, labels=x).loss
        (backward or (lambda t: t.backward()))(loss)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
        snaps.append(snapshot(model))
        losses.append(float(loss.detach()))
    return snaps, losses, grads


def _ddp_worker(rank, port, out):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hfq.qparam import broadcast_qparams_

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    res = {}
    # ranks that start from different weights: the first step refuses (they would train apart silently) ...
    m = _model(seed=rank)
    opt = _opt(m.parameters())
    x = _shard(0, rank)
    m(input_ids=x, labels=x).loss.backward()
    try:
        opt.step()
        res["unsynced_step"] = "stepped"
    except ValueError as e:
        res["unsynced_step"] = str(e)
    # ... and broadcast_qparams_ makes them rank 0's, bit-exactly
    for fmt in ("fp8_e4m3_row", "int8_dense_sparse"):
        m = _model(seed=rank, fmt=fmt)
        broadcast_qparams_(m)
        res[f"synced_{fmt}"] = {k: v for k, v in snapshot(m).items() if "layers" in k}
    model = _model(seed=0)
    res["before_ddp"] = snapshot(model)
    ddp = DDP(model)
    res["after_ddp"] = snapshot(model)
    res["snaps"], res["losses"], res["grads"] = _train(model, _opt(ddp.parameters()), rank, wrapped=ddp)
    torch.save(res, os.path.join(out, f"ddp_rank{rank}.pt"))
    dist.destroy_process_group()


def _accelerate_worker(out):
    from accelerate import Accelerator

    torch.set_num_threads(1)
    acc = Accelerator(cpu=True)
    model = _model(seed=0)
    before = snapshot(model)
    model, opt = acc.prepare(model, _opt(model.parameters()))
    snaps, losses, _ = _train(acc.unwrap_model(model), opt, acc.process_index, wrapped=model, backward=acc.backward)
    torch.save({"world": acc.num_processes, "kind": type(model).__name__, "before": before, "snaps": snaps,
                "losses": losses}, os.path.join(out, f"acc_rank{acc.process_index}.pt"))


# ------------------------------------------------------------------------------------------------ the test side
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))


def _equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _reference(emulate_allreduce):
    """Single process, concatenated batch. emulate_allreduce: backward per half-batch, then the gradient DDP's
    reducer forms (each half scaled by 1/world in the grad dtype, summed with one rounding); else one backward."""
    model = _model(seed=0)
    opt = _opt(model.parameters())
    snaps, losses = [], []
    for step in range(STEPS):
        shards = [_shard(step, r) for r in range(WORLD)]
        if emulate_allreduce:
            per = []
            for x in shards:
                model.zero_grad(set_to_none=True)
                model(input_ids=x, labels=x).loss.backward()
                per.append({n: p.grad for n, p in model.named_parameters()})
            for n, p in model.named_parameters():
                parts = [g[n] * (1.0 / WORLD) for g in per]
                p.grad = (parts[0].float() + parts[1].float()).to(parts[0].dtype)
        else:
            x = torch.cat(shards)
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            losses.append(float(loss.detach()))
        opt.step()
        snaps.append(snapshot(model))
    return snaps, losses


def test_ddp_two_processes_eco_matches_single_process(tmp_path):
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "ddp", str(tmp_path)], env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    a, b = (torch.load(tmp_path / f"ddp_rank{i}.pt") for i in range(WORLD))
    for r in (a, b):
        assert "ranks hold different quantized weights" in r["unsynced_step"] and "broadcast_qparams_" in r["unsynced_step"]
    # broadcast_qparams_: different random weights on the two ranks become rank 0's, bit-exactly
    for fmt in ("fp8_e4m3_row", "int8_dense_sparse"):
        _equal(a[f"synced_{fmt}"], b[f"synced_{fmt}"])
        rank0_own = {k: v for k, v in snapshot(_model(seed=0, fmt=fmt)).items() if "layers" in k}
        _equal(a[f"synced_{fmt}"], rank0_own)
    # DDP's construction-time broadcast leaves the codes and scales as they were
    _equal(a["before_ddp"], a["after_ddp"])
    _equal(b["before_ddp"], b["after_ddp"])
    # the gradients were all-reduced: same on both ranks although each rank saw different data
    _equal(a["grads"], b["grads"])
    q_grad = a["grads"]["model.layers.0.self_attn.q_proj.weight"]
    assert q_grad.dtype == torch.bfloat16 and q_grad.abs().sum() > 0
    assert a["losses"] != b["losses"]  # different data per rank
    # both ranks hold bit-identical codes/scales (and plain params) after every step
    for sa, sb in zip(a["snaps"], b["snaps"]):
        _equal(sa, sb)
    # the weights moved
    assert not torch.equal(a["snaps"][-1]["model.layers.0.mlp.down_proj.weight.codes"],
                           a["before_ddp"]["model.layers.0.mlp.down_proj.weight.codes"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        emulated, _ = _reference(emulate_allreduce=True)
        whole, whole_losses = _reference(emulate_allreduce=False)
    finally:
        torch.set_num_threads(threads)
    # bit-exact: a single process that averages the two half-batch gradients as the all-reduce does
    for s_ddp, s_ref in zip(a["snaps"], emulated):
        _equal(s_ddp, s_ref)
    # one backward over the concatenated batch: the gradients differ by bf16 rounding (and Adam amplifies the
    # sign of near-zero ones, SR then draws differently), so compare the updates: within 10% of their size
    from hfq_kernels.reference.fp8 import dequantize_fp8_row

    def value(snap, k):
        if k.endswith(".codes"):
            return dequantize_fp8_row(snap[k].view(torch.float8_e4m3fn), snap[k[:-len("codes")] + "scales"])
        return snap[k].float()

    final, ref, start = a["snaps"][-1], whole[-1], a["before_ddp"]
    for k in (k for k in final if not k.endswith(".scales")):
        diff = (value(final, k) - value(ref, k)).norm()
        assert float(diff / (value(ref, k) - value(start, k)).norm()) < 0.1, k
    mean_losses = [(la + lb) / 2 for la, lb in zip(a["losses"], b["losses"])]
    assert max(abs(x - y) for x, y in zip(mean_losses, whole_losses)) < 1e-3


def test_accelerate_launch_two_processes(tmp_path):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--main_process_port", str(_free_port()), "--mixed_precision", "no",
           "--dynamo_backend", "no", os.path.abspath(__file__), "accelerate", str(tmp_path)]
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    a, b = (torch.load(tmp_path / f"acc_rank{i}.pt") for i in range(WORLD))
    assert a["world"] == b["world"] == 2 and a["kind"] == "DistributedDataParallel"
    assert a["losses"] != b["losses"]
    for sa, sb in zip(a["snaps"], b["snaps"]):
        _equal(sa, sb)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        emulated, _ = _reference(emulate_allreduce=True)
    finally:
        torch.set_num_threads(threads)
    for s_acc, s_ref in zip(a["snaps"], emulated):
        _equal(s_acc, s_ref)


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "ddp":
        import torch.multiprocessing as mp

        mp.spawn(_ddp_worker, args=(_free_port(), out), nprocs=WORLD)
    else:
        _accelerate_worker(out)
