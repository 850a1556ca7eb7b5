"""QuEST on the GPU: kernel correctness, Hadamard/fused-kernel bandwidth vs a measured copy, and the
training step of an 800M-shaped Llama (paper App. B.1: 16 blocks, hidden 2048) at W4A4 vs BF16.

  python benchmarks/quest_step.py [--out DIR] [--batch 8 --seq 1024]
Writes DIR/quest_step.json and DIR/quest_step.md (default benchmarks/results/).
Targets: QuEST step <= 1.25x BF16 step; HT kernel >= 70% of copy bandwidth.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess

import torch
import triton

from hfq_kernels.reference.hadamard import fwht
from hfq.quest import QuESTConfig, QuESTLinear, quantize_model
from hfq.quest.linear import _Spec
from hfq_kernels import quest as K
from hfq_kernels.hadamard import hadamard_triton


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")  # ms


def checks() -> dict:
    """GPU kernels against the torch references (computed on the CPU, float64 where it matters)."""
    out = {}
    torch.manual_seed(0)
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(4099, 3584, device="cuda").to(dt)
        out[f"ht_relerr_{str(dt)[6:]}"] = rel(hadamard_triton(x, 128).cpu(), fwht(x.cpu().double(), 128))
        y = hadamard_triton(hadamard_triton(x, 128), 128)
        out[f"ht_involution_relerr_{str(dt)[6:]}"] = rel(y.cpu(), x.cpu())
    for bits, fp4, blk in ((4, False, 128), (1, False, 128), (4, True, 128), (2, False, 0)):
        x = torch.randn(1031, 2048, device="cuda")
        x[0, 5] = 40.0
        xq, m, u = K.quest_quantize_triton(x, bits, fp4, 1.3 if bits == 1 else 1.0, blk)
        rq, rm, ru = K.quest_quantize_ref(x.cpu(), bits, fp4, 1.3 if bits == 1 else 1.0, blk)
        tag = f"W{bits}{'fp4' if fp4 else 'int'}{'' if blk else '_noHT'}"
        out[f"quant_{tag}_value_mismatch_frac"] = float(((xq.cpu() - rq).abs() > 1e-5 * rq.abs() + 1e-6).float().mean())
        out[f"quant_{tag}_mask_mismatch_frac"] = float((K.unpack_mask(m.cpu(), 2048) != K.unpack_mask(rm, 2048)).float().mean())
        out[f"quant_{tag}_unit_relerr"] = rel(u.cpu(), ru)
        g = torch.randn(1031, 2048, device="cuda", dtype=torch.bfloat16)
        out[f"masked_ht_{tag}_relerr"] = rel(K.quest_masked_ht_triton(g, m, blk).cpu(),
                                             K.quest_masked_ht_ref(g.cpu().double(), m.cpu(), blk))
    # a whole QuESTLinear, CUDA (Triton) vs CPU (reference), fp32
    lin = torch.nn.Linear(2048, 1024)
    xs = torch.randn(4, 300, 2048)
    res = {}
    for dev in ("cpu", "cuda"):
        layer = QuESTLinear.from_linear(torch.nn.Linear(2048, 1024).to(dev), QuESTConfig(weight_bits=4, activation_bits=4))
        layer.weight.data.copy_(lin.weight.data.to(dev))
        layer.bias.data.copy_(lin.bias.data.to(dev))
        x = xs.to(dev).detach().clone().requires_grad_(True)
        y = layer(x)
        y.backward(torch.ones_like(y) * 0.01 + y.detach() * 1e-3)
        res[dev] = (y.detach().cpu(), x.grad.cpu(), layer.weight.grad.cpu())
    for i, n in enumerate(("y", "dx", "dw")):
        out[f"layer_{n}_relerr_cuda_vs_cpu"] = rel(res["cuda"][i], res["cpu"][i])
    return out


def bandwidth(rows=32768, cols=4096) -> list[dict]:
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    n = x.numel()
    mask = torch.randint(0, 256, (rows, cols // 8), device="cuda", dtype=torch.uint8)
    cases = [
        ("copy (torch)", lambda: y.copy_(x), 4 * n),
        ("hadamard B=128", lambda: hadamard_triton(x, 128), 4 * n),
        ("hadamard B=64", lambda: hadamard_triton(x, 64), 4 * n),
        ("quest_quantize W4 B=128 (read + write + mask)", lambda: K.quest_quantize_triton(x, 4, False, 1.0, 128),
         4 * n + n // 8 + 4 * rows),
        ("quest_masked_ht B=128", lambda: K.quest_masked_ht_triton(x, mask, 128), 4 * n + n // 8),
    ]
    rows_out, copy_gbps = [], None
    for name, fn, nbytes in cases:
        ms = bench(fn)
        gbps = nbytes / ms / 1e6
        copy_gbps = copy_gbps or gbps
        rows_out.append({"kernel": name, "shape": [rows, cols], "dtype": "bf16", "ms": round(ms, 4),
                         "GBps": round(gbps, 1), "pct_copy": round(100 * gbps / copy_gbps, 1)})
    return rows_out


def step_times(batch: int, seq: int, n_steps: int = 10) -> list[dict]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                      num_key_value_heads=16, intermediate_size=5632, max_position_embeddings=seq,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    ids = torch.randint(0, 32000, (batch, seq), device="cuda")
    n_params = sum(p.numel() for p in model.parameters())
    rows = []
    for name, qcfg in (("BF16", None), ("QuEST W4A4", QuESTConfig(weight_bits=4, activation_bits=4)),
                       ("QuEST W4A4 no HT", QuESTConfig(weight_bits=4, activation_bits=4, hadamard=False)),
                       ("QuEST W1A1", QuESTConfig(weight_bits=1, activation_bits=1))):
        if qcfg is not None:
            for mod in model.modules():  # re-wrap: undo the previous variant's layers
                if isinstance(mod, QuESTLinear):
                    mod.config = qcfg
                    mod.spec = _Spec(qcfg, qcfg.block_for(mod.in_features))
            if not any(isinstance(m, QuESTLinear) for m in model.modules()):
                quantize_model(model, qcfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        torch.cuda.reset_peak_memory_stats()
        times, losses = [], []
        for i in range(3 + n_steps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            s.record()
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            e.record()
            torch.cuda.synchronize()
            if i >= 3:
                times.append(s.elapsed_time(e))
            losses.append(loss.item())
        del opt
        rows.append({"variant": name, "batch": batch, "seq": seq, "tokens": batch * seq, "params": n_params,
                     "step_ms_median": round(statistics.median(times), 2), "step_ms_min": round(min(times), 2),
                     "peak_mem_GB": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                     "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4)})
        print(rows[-1], flush=True)
    base = rows[0]["step_ms_median"]
    for r in rows:
        r["x_bf16"] = round(r["step_ms_median"] / base, 3)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("quest_step: needs a CUDA device")
    commit = os.environ.get("HFQ_COMMIT") or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                                            text=True).stdout.strip() or "unknown"
    chk = checks()
    print(json.dumps(chk, indent=1), flush=True)
    bw = bandwidth()
    for r in bw:
        print(r, flush=True)
    steps = step_times(args.batch, args.seq)
    doc = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "commit": commit, "torch": torch.__version__, "triton": triton.__version__, "checks": chk,
           "bandwidth": bw, "rows": steps}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "quest_step.json"), "w") as f:
        json.dump(doc, f, indent=1)
    ht = next(r for r in bw if r["kernel"] == "hadamard B=128")
    q = next(r for r in steps if r["variant"] == "QuEST W4A4")
    md = [f"# QuEST training step and kernels", "",
          f"device {doc['device']}; date {doc['date'][:19]}; commit {commit[:12]}; torch {torch.__version__}, "
          f"triton {triton.__version__}", "",
          f"## Training step: Llama 16 blocks x hidden 2048 (intermediate 5632, vocab 32000, "
          f"{steps[0]['params'] / 1e6:.0f}M params), bf16 weights, fused AdamW, batch {args.batch} x {args.seq}", "",
          "| variant | step ms (median) | x BF16 | peak GB | loss first -> last |", "|---|---|---|---|---|"]
    md += [f"| {r['variant']} | {r['step_ms_median']} | {r['x_bf16']} | {r['peak_mem_GB']} | "
           f"{r['loss_first']} -> {r['loss_last']} |" for r in steps]
    md += ["", f"Target QuEST W4A4 <= 1.25x BF16: **{q['x_bf16']}x** ({'met' if q['x_bf16'] <= 1.25 else 'missed'})",
           "", "## Kernel bandwidth (bf16, bytes = each input read + each output written once)", "",
           "| kernel | shape | ms | GB/s | % of copy |", "|---|---|---|---|---|"]
    md += [f"| {r['kernel']} | {r['shape'][0]}x{r['shape'][1]} | {r['ms']} | {r['GBps']} | {r['pct_copy']} |" for r in bw]
    md += ["", f"Target HT >= 70% of copy: **{ht['pct_copy']}%** ({'met' if ht['pct_copy'] >= 70 else 'missed'})",
           "", "## Correctness on the device (vs torch references)", "", "| check | value |", "|---|---|"]
    md += [f"| {k} | {v:.3g} |" for k, v in chk.items()]
    with open(os.path.join(args.out, "quest_step.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
