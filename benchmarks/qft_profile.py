"""Where QFT spends its time on the device (torch.profiler, LLaMA-2-7B shapes): one QLion step of a weight (SR and
RTN), one QFT linear forward+backward, and a whole training step of a 2-layer 7B-shaped model (seq 2048, gradient
checkpointing) against bf16 AdamW: wall time, GPU busy time, top kernels and host ops. Also cProfiles of QLion.step
(step_host_profile) and of a forward+backward (fwd_bwd_host_profile): `bash benchmarks/gpu_session.sh qft_step qft_host`.
python benchmarks/qft_profile.py > qft_profile.txt"""
from __future__ import annotations

import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main():
    import hfq.qparam as qp
    from hfq.qft import QLion
    from hfq.qparam import Int8Grad, QParam

    torch.manual_seed(0)
    w = torch.randn(11008, 4096, device="cuda") * 0.02
    p = torch.nn.Parameter(QParam.from_float(w, "int8_dense_sparse", outlier_fraction=0.01))
    store = Int8Grad(torch.randn(11008, 4096, device="cuda", dtype=torch.bfloat16) * 1e-3)
    opt = QLion([p], lr=1e-5)
    x = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        opt.update_param_(p, store, opt.param_groups[0])

    def fb():
        qp.qlinear(x, p, store_int8=True).sum().backward()
        p.grad = None

    opt_rtn = QLion([p], lr=1e-5, rounding="rtn")

    def step_rtn():
        opt_rtn.update_param_(p, store, opt_rtn.param_groups[0])

    for name, fn in (("qlion_step", step), ("qlion_step_rtn", step_rtn), ("linear_fwd_bwd", fb)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        print(f"==== {name} (5 calls)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))


def _model(method: str, layers: int, fused=None):
    """A random-init LLaMA-2-7B-shaped model with `layers` layers, gradient checkpointing on, and its optimizer:
    QFT (INT8 gradients) + QLion, or bf16 weights + fused AdamW."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hfq.qft import QFTConfig, QLion, quantize_model_

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if method == "qft":
        quantize_model_(model, QFTConfig(gradient_bits=8))
        return model, QLion(model.parameters(), lr=1e-5, fused=fused)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)


def model_step(method: str, layers: int = 2, seq: int = 2048, fused=None):
    """Wall time of one training step and the GPU's busy time inside it (the rest is the GPU waiting for the host)."""
    model, opt = _model(method, layers, fused)
    ids = torch.randint(0, 32000, (1, seq), device="cuda")

    def one():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        one()
    torch.cuda.synchronize()
    import time

    t = time.perf_counter()
    for _ in range(3):
        one()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / 3
    fb, st = [], []
    for _ in range(3):  # the two phases timed apart (a sync between them)
        t = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        fb.append(time.perf_counter() - t)
        t = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        st.append(time.perf_counter() - t)
    print(f"phases {method}: forward+backward {1e3 * sorted(fb)[1]:.1f} ms, optimizer {1e3 * sorted(st)[1]:.1f} ms")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        one()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    busy = sum(e.self_device_time_total for e in ka if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
    print(f"==== model step {method} fused={fused}: {layers} layers, seq {seq}: wall {wall * 1e3:.1f} ms, GPU kernels {busy:.1f} ms")
    for e in sorted(ka, key=lambda e: -e.self_device_time_total)[:30]:
        print(f"  {e.self_device_time_total / 1e3:8.2f} ms GPU  {e.device_time_total / 1e3:8.2f} ms GPU incl  "
              f"{e.self_cpu_time_total / 1e3:8.2f} ms CPU  x{e.count:<5d} {e.key[:90]}")
    del model, opt
    torch.cuda.empty_cache()


def step_times(method: str, layers: int = 32, steps: int = 8, seq: int = 2048, gc_off: bool = False):
    """Each step's wall time (synced after each), allocator retries and device allocations during them, Python
    GC collections: what makes single steps slow."""
    import gc
    import time

    model, opt = _model(method, layers)
    ids = torch.randint(0, 32000, (1, seq), device="cuda")
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    if gc_off:
        gc.collect()
        gc.disable()
    counts = [0, 0, 0]
    cb = lambda phase, info: counts.__setitem__(info["generation"], counts[info["generation"]] + (phase == "stop"))
    gc.callbacks.append(cb)
    m0 = torch.cuda.memory_stats()
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        out.append(round(1e3 * (time.perf_counter() - t), 1))
    gc.callbacks.remove(cb)
    gc.enable()
    m1 = torch.cuda.memory_stats()
    print(f"step times {method} {layers} layers gc_off={gc_off}: {out} ms; alloc retries "
          f"{m1['num_alloc_retries'] - m0['num_alloc_retries']}, device mallocs "
          f"{m1.get('num_device_alloc', 0) - m0.get('num_device_alloc', 0)}, gc collections per generation {counts}",
          flush=True)
    del model, opt
    torch.cuda.empty_cache()


def opt_profile(layers: int = 8, seq: int = 2048):
    """torch.profiler of QLion.step alone (after a synced backward): every kernel it launches, by GPU time."""
    model, opt = _model("qft", layers)
    ids = torch.randint(0, 32000, (1, seq), device="cuda")
    for i in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        if i == 2:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                opt.step()
                torch.cuda.synchronize()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
    ka = prof.key_averages()
    print(f"==== QLion.step kernels, {layers} layers")
    for e in sorted(ka, key=lambda e: -e.self_device_time_total)[:25]:
        print(f"  {e.self_device_time_total / 1e3:8.2f} ms GPU  {e.self_cpu_time_total / 1e3:8.2f} ms CPU  "
              f"x{e.count:<5d} {e.key[:100]}")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70))
    del model, opt
    torch.cuda.empty_cache()


def step_host_profile(layers: int = 8, seq: int = 2048):
    """cProfile of QLion.step alone (after a synced backward): where its host time goes."""
    import cProfile
    import pstats
    import time

    model, opt = _model("qft", layers)
    ids = torch.randint(0, 32000, (1, seq), device="cuda")
    for i in range(4):
        model(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        t = time.perf_counter()
        if i == 3:
            prof = cProfile.Profile()
            prof.enable()
        opt.step()
        torch.cuda.synchronize()
        if i == 3:
            prof.disable()
        print(f"QLion.step wall {1e3 * (time.perf_counter() - t):.1f} ms", flush=True)
        opt.zero_grad()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def fwd_bwd_host_profile(layers: int = 8, seq: int = 2048):
    """cProfile of one QFT forward+backward (the GPU work queued behind it): the host cost per QFT linear call."""
    import cProfile
    import pstats

    model, opt = _model("qft", layers)
    ids = torch.randint(0, 32000, (1, seq), device="cuda")
    for i in range(3):
        torch.cuda.synchronize()
        if i == 2:
            prof = cProfile.Profile()
            prof.enable()
        model(input_ids=ids, labels=ids).loss.backward()
        if i == 2:
            prof.disable()
        torch.cuda.synchronize()
        opt.step()
        opt.zero_grad()
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumtime").print_stats(40)


if __name__ == "__main__":
    main()
    for m in ("bf16_adamw", "qft"):
        model_step(m)
