"""QuEST step on the GPU: per-kernel profile and launch-setting variants (issue 6, step <= 1.25x BF16).

  python benchmarks/quest_profile.py [--out DIR] [--batch 8 --seq 1024]
1. kernel variants on the shapes of the 800M Llama (activations [tokens, 2048 | 5632], weights),
   each checked against the torch reference first; the fastest settings are applied;
2. training step (same model as quest_step.py): BF16, QuEST W4A4 with the previous settings ("legacy":
   two-pass quantize, fp32 weight copy + fp32 HT, byte-tile masked HT, no input sharing), the tuned
   settings with and without input sharing;
3. torch.profiler table (CUDA time per kernel) of two steps of legacy and tuned QuEST and of BF16.
Writes DIR/quest_profile.json and DIR/quest_profile.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import triton

import hfq.quest.linear as QL
from hfq.quest import QuESTConfig, QuESTLinear, quantize_model
from hfq_kernels import quest as K
from hfq_kernels.hadamard import hadamard_triton


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


KNOBS = ("ROW_KERNEL", "PACK_DOT", "ROW_WARPS", "ROW_TILE_ELEMS", "MASKED_GATHER", "MASKED_BM")


def set_knobs(**kw):
    for k, v in kw.items():
        setattr(K, k, v)


def check_quant(x, bits=4):
    xq, m, u = K.quest_quantize_triton(x, bits, False, 1.0, 128)
    rq, rm, ru = K.quest_quantize_ref(x.float(), bits, False, 1.0, 128)
    rq = rq.to(x.dtype).float()
    off = float(((xq.float() - rq).abs() > 1e-2 * rq.abs() + 1e-6).float().mean())
    mm = float((m != rm).float().mean())
    return {"value_mismatch": off, "mask_byte_mismatch": mm, "unit_relerr": float((u - ru).abs().max() / ru.abs().max())}


def kernels() -> tuple[dict, list]:
    torch.manual_seed(0)
    acts = [torch.randn(8192, k, device="cuda", dtype=torch.bfloat16) for k in (2048, 5632)]
    wts = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n, k in ((2048, 2048), (5632, 2048), (2048, 5632))]
    # per layer of the model: q,k,v,o,gate,up quantize [8192, 2048], down [8192, 5632] (x counts)
    act_w = [6, 1]
    wt_w = [4, 2, 1]
    rows = []
    quant_variants = {
        "two-pass (legacy)": dict(ROW_KERNEL=False),
        "rows t16k w8": dict(ROW_KERNEL=True, PACK_DOT=False, ROW_WARPS=8, ROW_TILE_ELEMS=16384),
        "rows t16k w8 packdot": dict(ROW_KERNEL=True, PACK_DOT=True, ROW_WARPS=8, ROW_TILE_ELEMS=16384),
        "rows t16k w4": dict(ROW_KERNEL=True, PACK_DOT=False, ROW_WARPS=4, ROW_TILE_ELEMS=16384),
        "rows t8k w4": dict(ROW_KERNEL=True, PACK_DOT=False, ROW_WARPS=4, ROW_TILE_ELEMS=8192),
        "rows t8k w4 packdot": dict(ROW_KERNEL=True, PACK_DOT=True, ROW_WARPS=4, ROW_TILE_ELEMS=8192),
        "rows t32k w8": dict(ROW_KERNEL=True, PACK_DOT=False, ROW_WARPS=8, ROW_TILE_ELEMS=32768),
        "rows t32k w16": dict(ROW_KERNEL=True, PACK_DOT=False, ROW_WARPS=16, ROW_TILE_ELEMS=32768),
    }
    qtotal = {}
    for name, kw in quant_variants.items():
        set_knobs(**kw)
        ok = True
        chk = {}
        for x in acts + wts:
            try:
                c = check_quant(x)
            except Exception as e:  # noqa: BLE001  a variant that does not compile is skipped
                chk = {"error": repr(e)[:200]}
                ok = False
                break
            chk = {k: max(chk.get(k, 0.0), v) for k, v in c.items()}
        if not ok:
            rows.append({"group": "quantize", "variant": name, "ok": False, "check": chk})
            print(rows[-1], flush=True)
            continue
        ok = chk["value_mismatch"] < 1e-3 and chk["mask_byte_mismatch"] < 1e-3 and chk["unit_relerr"] < 1e-5
        ta = [bench(lambda x=x: K.quest_quantize_triton(x, 4, False, 1.0, 128)) for x in acts]
        tw = [bench(lambda w=w: K.quest_quantize_triton(w, 4, False, 1.0, 128)) for w in wts]
        per_layer = sum(a * b for a, b in zip(act_w, ta)) + sum(a * b for a, b in zip(wt_w, tw))
        if ok:
            qtotal[name] = per_layer
        rows.append({"group": "quantize", "variant": name, "ok": ok, "check": chk,
                     "ms_act": [round(t, 4) for t in ta], "ms_w": [round(t, 4) for t in tw],
                     "ms_per_layer": round(per_layer, 4)})
        print(rows[-1], flush=True)
    # the legacy weight path: fp32 copy, fp32 (ieee) HT + quantize, cast back
    set_knobs(ROW_KERNEL=False)
    tw = [bench(lambda w=w: K.quest_quantize_triton(w.float(), 4, False, 1.0, 128)[0].to(torch.bfloat16)) for w in wts]
    rows.append({"group": "weight", "variant": "legacy fp32 copy + ieee HT + cast", "ms_w": [round(t, 4) for t in tw],
                 "ms_per_layer": round(sum(a * b for a, b in zip(wt_w, tw)), 4)})
    print(rows[-1], flush=True)
    best_q = min(qtotal, key=qtotal.get)
    best = dict(quant_variants[best_q])

    masks = [torch.randint(0, 256, (x.shape[0], x.shape[1] // 8), device="cuda", dtype=torch.uint8) for x in acts + wts]
    grads = acts + wts
    g_w = act_w + [w for w in wt_w]
    mtotal = {}
    masked_variants = {
        "byte tile bm32 (legacy)": dict(MASKED_GATHER=False, MASKED_BM=32),
        "byte tile bm64": dict(MASKED_GATHER=False, MASKED_BM=64),
        "gather bm32": dict(MASKED_GATHER=True, MASKED_BM=32),
        "gather bm64": dict(MASKED_GATHER=True, MASKED_BM=64),
        "gather bm128": dict(MASKED_GATHER=True, MASKED_BM=128),
    }
    for name, kw in masked_variants.items():
        set_knobs(**kw)
        err = max(float((K.quest_masked_ht_triton(g, m, 128).float() - K.quest_masked_ht_ref(g.float(), m, 128)).norm()
                        / K.quest_masked_ht_ref(g.float(), m, 128).norm()) for g, m in zip(grads, masks))
        ts = [bench(lambda g=g, m=m: K.quest_masked_ht_triton(g, m, 128)) for g, m in zip(grads, masks)]
        per_layer = sum(a * b for a, b in zip(g_w, ts))
        ok = err < 5e-3
        if ok:
            mtotal[name] = per_layer
        rows.append({"group": "masked_ht", "variant": name, "ok": ok, "relerr": err, "ms": [round(t, 4) for t in ts],
                     "ms_per_layer": round(per_layer, 4)})
        print(rows[-1], flush=True)
    best.update(masked_variants[min(mtotal, key=mtotal.get)])
    x = acts[0]
    y = torch.empty_like(x)
    rows.append({"group": "ref", "variant": "copy / hadamard [8192,2048]", "ms": [round(bench(lambda: y.copy_(x)), 4),
                                                                              round(bench(lambda: hadamard_triton(x, 128)), 4)]})
    print(rows[-1], flush=True)
    print("best settings", best, flush=True)
    return best, rows


def legacy_weight_h(w, spec, out_dtype=torch.float32):
    wq, m, u = torch.ops.hfq.quest_quantize(w.detach().float(), spec.wbits, spec.fp4, spec.s_w, spec.block)
    return wq.to(out_dtype), m, u


def run_steps(model, ids, opt, n):
    times, losses = [], []
    for i in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        s.record()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
        losses.append(loss.item())
    return times, losses


def profile_table(model, ids, opt, rows=22) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_steps(model, ids, opt, 2)
    agg = {}
    for ev in prof.events():  # kernel events (device side): their own duration
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        a = agg.setdefault(ev.name, [0.0, 0])
        a[0] += ev.time_range.elapsed_us()
        a[1] += 1
    if not agg:
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=30), flush=True)
        return []
    items = sorted(agg.items(), key=lambda kv: -kv[1][0])
    total = sum(v[0] for v in agg.values())
    out = [{"kernel": k[:110], "ms_per_step": round(v[0] / 2e3, 3), "calls_per_step": v[1] // 2,
            "pct": round(100 * v[0] / total, 1)} for k, v in items[:rows]]
    out.append({"kernel": "TOTAL (all kernels)", "ms_per_step": round(total / 2e3, 3), "calls_per_step": sum(v[1] for v in agg.values()) // 2,
                "pct": 100.0})
    return out


def steps(best, batch, seq) -> tuple[list, dict]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                      num_key_value_heads=16, intermediate_size=5632, max_position_embeddings=seq,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    ids = torch.randint(0, 32000, (batch, seq), device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    rows, profs = [], {}
    legacy = dict(ROW_KERNEL=False, MASKED_GATHER=False, MASKED_BM=32)
    new_w = QL.quantize_weight_h
    variants = [("BF16", None, None, None), ("QuEST W4A4 legacy", legacy, legacy_weight_h, False),
                ("QuEST W4A4 tuned", best, new_w, True), ("QuEST W4A4 tuned, no input sharing", best, new_w, False),
                ("QuEST W4A4 tuned + legacy weight path", best, legacy_weight_h, True)]
    for name, knobs, wfn, share in variants:
        if knobs is not None:
            if not any(isinstance(m, QuESTLinear) for m in model.modules()):
                quantize_model(model, QuESTConfig(weight_bits=4, activation_bits=4))
            set_knobs(**knobs)
            QL.quantize_weight_h = wfn
            QuESTLinear.share_input_quantization = share
        torch.cuda.reset_peak_memory_stats()
        times, losses = run_steps(model, ids, opt, 13)
        times = times[3:]
        rows.append({"variant": name, "step_ms_median": round(statistics.median(times), 2),
                     "step_ms_min": round(min(times), 2), "peak_mem_GB": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                     "loss": [round(v, 4) for v in losses[:2]] + [round(losses[-1], 4)]})
        if name in ("BF16", "QuEST W4A4 legacy", "QuEST W4A4 tuned"):
            profs[name] = profile_table(model, ids, opt)
        print(rows[-1], flush=True)
    base = rows[0]["step_ms_median"]
    for r in rows:
        r["x_bf16"] = round(r["step_ms_median"] / base, 3)
    QL.quantize_weight_h = new_w
    QuESTLinear.share_input_quantization = True
    return rows, profs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    args = ap.parse_args()
    defaults = {k: getattr(K, k) for k in KNOBS}
    best, krows = kernels()
    srows, profs = steps(best, args.batch, args.seq)
    set_knobs(**defaults)
    doc = {"device": torch.cuda.get_device_name(), "commit": os.environ.get("HFQ_COMMIT", "unknown"),
           "defaults": defaults, "best": best, "kernels": krows, "steps": srows, "profiles": profs}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "quest_profile.json"), "w") as f:
        json.dump(doc, f, indent=1)
    md = ["# QuEST step profile and launch-setting variants", "",
          f"device {doc['device']}; commit {doc['commit'][:12]}; torch {torch.__version__}, triton {triton.__version__}", "",
          f"defaults in hfq_kernels/quest.py: {defaults}; fastest here: {best}", "",
          "## Step (800M Llama, batch %d x %d, bf16, fused AdamW)" % (args.batch, args.seq), "",
          "| variant | step ms | x BF16 | peak GB |", "|---|---|---|---|"]
    md += [f"| {r['variant']} | {r['step_ms_median']} | {r['x_bf16']} | {r['peak_mem_GB']} |" for r in srows]
    md += ["", "## Kernels (ms; per layer = weighted by the layer's call counts)", "",
           "| group | variant | ok | ms per layer | ms |", "|---|---|---|---|---|"]
    md += [f"| {r['group']} | {r['variant']} | {r.get('ok', '')} | {r.get('ms_per_layer', '')} | "
           f"{r.get('ms', r.get('ms_act', '')) if 'ms_w' not in r or 'ms_act' not in r else str(r['ms_act']) + ' / ' + str(r['ms_w'])} |"
           for r in krows]
    for name, tab in profs.items():
        md += ["", f"## CUDA time per kernel, {name} (per step, mean of 2)", "", "| kernel | ms | calls | % |", "|---|---|---|---|"]
        md += [f"| `{r['kernel']}` | {r['ms_per_step']} | {r['calls_per_step']} | {r['pct']} |" for r in tab]
    with open(os.path.join(args.out, "quest_profile.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md), flush=True)


if __name__ == "__main__":
    main()
