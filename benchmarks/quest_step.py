"""QuEST on the GPU: kernel correctness, Hadamard/fused-kernel bandwidth vs a measured copy, and the
training step of an 800M-shaped Llama (paper App. B.1: 16 blocks, hidden 2048) at W4A4 vs BF16.

  python benchmarks/quest_step.py [--out DIR] [--batch 8 --seq 1024 --rounds 3 --steps 4]
  python benchmarks/quest_step.py --selftest     # CPU: the interleaved rounds on a tiny model, table writing
Writes DIR/quest_step.json and DIR/quest_step.md (default benchmarks/results/).
Targets: QuEST step <= 1.25x BF16 step; HT kernel >= 70% of copy bandwidth.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import add_args, spread, table, write  # noqa: E402

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


VARIANTS = (("BF16", None), ("QuEST W4A4", dict(weight_bits=4, activation_bits=4)),
            ("QuEST W4A4 no HT", dict(weight_bits=4, activation_bits=4, hadamard=False)),
            ("QuEST W1A1", dict(weight_bits=1, activation_bits=1)))


def step_times(batch: int, seq: int, n_steps: int = 4, repeats: int = 3, device: str = "cuda",
               size: dict | None = None) -> list[dict]:
    """Training-step time of each variant, measured in `repeats` interleaved rounds (BF16, W4A4, no HT, W1A1,
    BF16, ...): per round one untimed step, then `n_steps` timed ones (their median is the round's time).
    Two models with the same initial weights: the BF16 one and a QuEST one whose layers switch settings per
    variant (they share its weights and optimizer). Peak memory is the variant's own: the peak allocated during
    its round minus what the other model holds."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    size = size or dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                        num_key_value_heads=16, intermediate_size=5632)
    cfg = LlamaConfig(max_position_embeddings=seq, tie_word_embeddings=False, **size)
    cuda = device == "cuda"
    alloc = torch.cuda.memory_allocated if cuda else (lambda: 0)

    def build():
        torch.manual_seed(0)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")

    held, models = {}, {}
    a0 = alloc()
    models["bf16"] = build()
    held["bf16"] = alloc() - a0
    a0 = alloc()
    models["quest"] = quantize_model(build(), QuESTConfig(**VARIANTS[1][1]))
    held["quest"] = alloc() - a0
    opts = {g: torch.optim.AdamW(m.parameters(), lr=1e-5, fused=cuda) for g, m in models.items()}
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    n_params = sum(p.numel() for p in models["bf16"].parameters())
    st = {name: dict(round_ms=[], all_ms=[], losses=[], peak=None) for name, _ in VARIANTS}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for _ in range(repeats):
        for name, kw in VARIANTS:
            g = "bf16" if kw is None else "quest"
            model, opt = models[g], opts[g]
            if kw is not None:
                qcfg = QuESTConfig(**kw)
                for mod in model.modules():
                    if isinstance(mod, QuESTLinear):
                        mod.config = qcfg
                        mod.spec = _Spec(qcfg, qcfg.block_for(mod.in_features))
            sync()
            before = alloc()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            times = []
            for i in range(1 + n_steps):
                sync()
                t = time.perf_counter()
                loss = model(ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                sync()
                if i >= 1:
                    times.append((time.perf_counter() - t) * 1e3)
                st[name]["losses"].append(loss.item())
            if cuda:
                peak = (torch.cuda.max_memory_allocated() - (before - held[g])) / 2**30
                st[name]["peak"] = max(st[name]["peak"] or 0.0, peak)
            held[g] += alloc() - before  # what this round left allocated (optimizer state on the first one)
            st[name]["round_ms"].append(spread(times)["median"])
            st[name]["all_ms"] += times
            print(name, [round(t, 2) for t in times], flush=True)
    return summarize(st, batch, seq, n_params)


def summarize(st: dict, batch: int, seq: int, n_params: int) -> list[dict]:
    """Rows: median over rounds of each round's median step time, its spread (min-max over rounds), and the
    ratio to BF16 (ratio of medians; spread = min-max of the per-round ratios)."""
    base = st["BF16"]["round_ms"]
    rows = []
    for name, s in st.items():
        r = s["round_ms"]
        ratios = [a / b for a, b in zip(r, base)]
        rows.append({"variant": name, "batch": batch, "seq": seq, "tokens": batch * seq, "params": n_params,
                     "rounds": len(r), "step_ms_median": round(spread(r)["median"], 2),
                     "step_ms_spread": [round(min(r), 2), round(max(r), 2)], "step_ms_min": round(min(s["all_ms"]), 2),
                     "round_ms": [round(t, 2) for t in r],
                     "peak_mem_GB": None if s["peak"] is None else round(s["peak"], 2),
                     "loss_first": round(s["losses"][0], 4), "loss_last": round(s["losses"][-1], 4),
                     "x_bf16": round(spread(r)["median"] / spread(base)["median"], 3),
                     "x_bf16_spread": [round(min(ratios), 3), round(max(ratios), 3)]})
    return rows


STEP_COLUMNS = {"variant": "variant", "step_ms_median": "step ms (median of rounds)", "spread": "spread (min-max)",
                "x": "x BF16 (spread)", "peak_mem_GB": "peak GB", "loss": "loss first -> last"}


def step_cells(steps: list[dict]) -> list[dict]:
    """The step table's cells for reading: spreads as lo-hi, x BF16 with its per-round spread."""
    return [dict(r, spread=f"{r['step_ms_spread'][0]}-{r['step_ms_spread'][1]}",
                 x=f"{r['x_bf16']} ({r['x_bf16_spread'][0]}-{r['x_bf16_spread'][1]})",
                 loss=f"{r['loss_first']} -> {r['loss_last']}") for r in steps]


def selftest() -> None:
    """CPU: the interleaved rounds on a tiny Llama (QuEST's torch reference path) and the table writing."""
    steps = step_times(2, 32, n_steps=2, repeats=3, device="cpu",
                       size=dict(vocab_size=128, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=2, intermediate_size=256))
    assert [r["variant"] for r in steps] == [v for v, _ in VARIANTS] and all(r["rounds"] == 3 for r in steps)
    assert steps[0]["x_bf16"] == 1.0 and all(r["step_ms_spread"][0] <= r["step_ms_median"] <= r["step_ms_spread"][1]
                                             for r in steps)
    print("\n".join(table(step_cells(steps), STEP_COLUMNS)))
    print("selftest ok")


def main():
    ap = add_args(argparse.ArgumentParser())
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per variant per round (after one untimed)")
    ap.add_argument("--selftest", action="store_true", help="CPU: tiny model through the rounds, table writing")
    args = ap.parse_args()
    if args.selftest:
        return selftest()
    if not torch.cuda.is_available():
        raise SystemExit("quest_step: needs a CUDA device")
    chk = checks()
    print(json.dumps(chk, indent=1), flush=True)
    bw = bandwidth()
    for r in bw:
        print(r, flush=True)
    steps = step_times(args.batch, args.seq, n_steps=args.steps, repeats=args.rounds)
    ht = next(r for r in bw if r["kernel"] == "hadamard B=128")
    q = next(r for r in steps if r["variant"] == "QuEST W4A4")
    bw_rows = [dict(r, shape=f"{r['shape'][0]}x{r['shape'][1]}") for r in bw]
    notes = [f"Training step: Llama 16 blocks x hidden 2048 (intermediate 5632, vocab 32000, "
             f"{steps[0]['params'] / 1e6:.0f}M params), bf16 weights, fused AdamW, batch {args.batch} x {args.seq}. "
             f"{args.rounds} interleaved rounds (BF16, W4A4, no HT, W1A1, BF16, ...), each one untimed step then "
             f"{args.steps} timed; a round's time is the median of its steps. Spread: min-max over rounds; x BF16: "
             "ratio of medians (min-max of the per-round ratios). Peak GB: the variant's own (the other model's "
             "memory subtracted).", "",
             f"Target QuEST W4A4 <= 1.25x BF16: **{q['x_bf16']}x** ({'met' if q['x_bf16'] <= 1.25 else 'missed'})",
             "", "## Kernel bandwidth (bf16, bytes = each input read + each output written once)", ""]
    notes += table(bw_rows, {"kernel": "kernel", "shape": "shape", "ms": "ms", "GBps": "GB/s", "pct_copy": "% of copy"})
    notes += ["", f"Target HT >= 70% of copy: **{ht['pct_copy']}%** ({'met' if ht['pct_copy'] >= 70 else 'missed'})",
              "", "## Correctness on the device (vs torch references)", ""]
    notes += table([{"check": k, "value": f"{v:.3g}"} for k, v in chk.items()])
    _, md = write("quest_step", steps, STEP_COLUMNS, "\n".join(notes), out_dir=args.out, md_rows=step_cells(steps),
                  title="QuEST training step and kernels", extra={"checks": chk, "bandwidth": bw})
    print(open(md).read())


if __name__ == "__main__":
    main()
