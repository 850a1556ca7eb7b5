"""Does a 4-bit base sample with higher entropy than the full-precision one? (QeRL Sec. 3.2, Fig. 5)

The paper reports that NVFP4/MXFP4 Qwen2.5-7B policies sample with higher per-token entropy than BF16. Here the
same question is asked of the offline demo's pre-trained tiny Qwen2 (`hfq grpo`'s base; 100 steps on the bundled
arithmetic task), for several bases (pre-training seeds) and several prompt sets each:

  fp32, bf16            the base in full / half precision
  nvfp4, mxfp4          decoder linears quantized while loading (`NVFP4Config(format=...)`, fp32 activations),
                        lm_head and embeddings kept, exactly as the demo's policy before LoRA
  fp32+gauss            control: fp32 with i.i.d. Gaussian noise added to each decoder linear, its std equal to
                        that matrix's NVFP4 error RMS (is it "noise of that size", or the quantizer's particular error?)

Two measurements per (base, prompt set):
  sampling entropy      `hfq.qerl.entropy.sampling_entropy`: each model samples its own completions (T = 1, same
                        sampling seed), mean per-token entropy of its next-token distribution (the paper's quantity)
  teacher-forced        every model scored on the same contexts (the fp32 model's samples): a paired comparison,
                        plus KL(fp32 || model) to show how far the quantized distribution moved

    python examples/qerl_entropy.py            # 5 bases x 5 prompt sets x 32 prompts x 32 tokens (~5 min, 2 CPU cores)
    python examples/qerl_entropy.py --quick    # 1 base x 2 prompt sets x 8 prompts
Writes `<out>/qerl_entropy.{md,json}` (`_quick` with --quick).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = ("fp32", "bf16", "nvfp4", "mxfp4", "fp32+gauss")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bases", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="demo base pre-training seeds")
    p.add_argument("--prompt-sets", type=int, default=5, help="prompt sets (and sampling seeds) per base")
    p.add_argument("--n-prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--cache-dir", default=None, help="demo base model cache (default: the demo's)")
    p.add_argument("--out", default=str(ROOT / "examples" / "results"))
    args = p.parse_args(argv)
    if args.quick:
        args.bases, args.prompt_sets, args.n_prompts = args.bases[:1], 2, 8
    return args


# --------------------------------------------------------------------------- models
def load_models(path: str, gauss_seed: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    import hfq  # noqa: F401  (registers the quantizer)
    from hfq_kernels.reference.fp4 import nvfp4_dequantize, nvfp4_quantize
    from hfq.nvfp4 import NVFP4Config

    def load(**kw):
        return AutoModelForCausalLM.from_pretrained(path, **kw).eval()

    models = {"fp32": load(dtype=torch.float32), "bf16": load(dtype=torch.bfloat16),
              "nvfp4": load(dtype=torch.float32, quantization_config=NVFP4Config(format="nvfp4")),
              "mxfp4": load(dtype=torch.float32, quantization_config=NVFP4Config(format="mxfp4"))}
    noisy = load(dtype=torch.float32)
    g = torch.Generator().manual_seed(gauss_seed)
    with torch.no_grad():
        for name, mod in noisy.model.layers.named_modules():
            if isinstance(mod, torch.nn.Linear):
                w = mod.weight
                err = nvfp4_dequantize(*nvfp4_quantize(w), dtype=torch.float32) - w
                rms = err.pow(2).mean().sqrt()
                w.add_(torch.randn(w.shape, generator=g) * rms)
    models["fp32+gauss"] = noisy
    return models


# --------------------------------------------------------------------------- measurements
def sample(model, tok, prompts, max_new_tokens: int, seed: int):
    """The completions `sampling_entropy` draws (same generate call, same seed): (prompt encoding, sequences)."""
    import torch

    enc = tok(list(prompts), return_tensors="pt", padding=True, padding_side="left")
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, return_dict_in_generate=True, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
    return enc, out.sequences


def alive_mask(gen, eos_id):
    """Generated positions up to and including the first EOS."""
    import torch

    alive = torch.ones_like(gen, dtype=torch.bool)
    alive[:, 1:] = ~((gen == eos_id).cumsum(1)[:, :-1] > 0)
    return alive


def next_token_logprobs(model, enc, seqs):
    """log-softmax of the next-token logits at every generated position, teacher-forced on `seqs`: [B, T, V]."""
    import torch

    P = enc.input_ids.shape[1]
    mask = torch.cat([enc.attention_mask, torch.ones_like(seqs[:, P:])], 1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=seqs, attention_mask=mask, position_ids=pos).logits.float()
    return torch.log_softmax(logits[:, P - 1:-1], -1)


def measure(models, tok, prompts, max_new_tokens, seed):
    from hfq.qerl.entropy import sampling_entropy

    row = {f"sampling/{k}": sampling_entropy(m, tok, prompts, max_new_tokens=max_new_tokens, seed=seed)
           for k, m in models.items()}
    enc, seqs = sample(models["fp32"], tok, prompts, max_new_tokens, seed)
    alive = alive_mask(seqs[:, enc.input_ids.shape[1]:], tok.eos_token_id)
    ref = next_token_logprobs(models["fp32"], enc, seqs)
    for k, m in models.items():
        lp = ref if k == "fp32" else next_token_logprobs(m, enc, seqs)
        ent = -(lp.exp() * lp).sum(-1)
        kl = (ref.exp() * (ref - lp)).sum(-1)
        row[f"teacher/{k}"] = float(ent[alive].mean())
        row[f"kl/{k}"] = float(kl[alive].mean())
    # the two measurements agree where they must: fp32 scored on its own samples
    assert abs(row["teacher/fp32"] - row["sampling/fp32"]) < 1e-4, (row["teacher/fp32"], row["sampling/fp32"])
    row["tokens"] = int(alive.sum())
    return row


# --------------------------------------------------------------------------- report
def ms(xs):
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def f(xs, d=4):
    m, s = ms(xs)
    return f"{m:.{d}f} ± {s:.{d}f}"


def report(rows, args):
    bases = sorted({r["base"] for r in rows})
    n = len(rows)
    summary = {}
    for k in MODELS:
        s = {}
        for kind in ("sampling", "teacher"):
            vals = [r[f"{kind}/{k}"] for r in rows]
            d = [r[f"{kind}/{k}"] - r[f"{kind}/fp32"] for r in rows]
            per_base = [statistics.fmean(r[f"{kind}/{k}"] - r[f"{kind}/fp32"] for r in rows if r["base"] == b)
                        for b in bases]
            s[kind] = {"mean_std": ms(vals), "delta_mean_std": ms(d), "delta_pos": sum(x > 0 for x in d),
                       "delta_per_base": per_base}
        s["kl"] = ms([r[f"kl/{k}"] for r in rows])
        summary[k] = s
    L = ["# QeRL Fig. 5 on the demo's tiny model: sampling entropy of fp32 / bf16 / NVFP4 / MXFP4 bases", "",
         f"Demo base (tiny Qwen2, char tokenizer, 100 pre-training steps on the bundled arithmetic task) for "
         f"pre-training seeds {bases}; {args.prompt_sets} prompt sets of {args.n_prompts} prompts per base (from another generator seed than the pre-training data; the problem space is small, so many also occur there) "
         f"(sampling seed = prompt-set index), {args.max_new_tokens} new tokens, T = 1, no top-k/top-p. "
         f"Entropy in nats per generated token (up to and including EOS). Mean ± std over the {n} (base, prompt "
         f"set) pairs; Δ = model - fp32 on the same pair; 'Δ > 0' counts pairs. Produced by "
         f"`python examples/qerl_entropy.py{' --quick' if args.quick else ''}`.", "",
         "| base weights | sampling entropy | Δ vs fp32 | Δ > 0 | teacher-forced entropy (fp32's samples) | "
         "Δ vs fp32 | Δ > 0 | KL(fp32 ‖ model) |",
         "|---|---|---|---|---|---|---|---|"]
    for k in MODELS:
        s = summary[k]
        cells = []
        for kind in ("sampling", "teacher"):
            v = [r[f"{kind}/{k}"] for r in rows]
            d = [r[f"{kind}/{k}"] - r[f"{kind}/fp32"] for r in rows]
            cells += [f(v), "-" if k == "fp32" else f"{ms(d)[0]:+.4f} ± {ms(d)[1]:.4f}",
                      "-" if k == "fp32" else f"{s[kind]['delta_pos']}/{n}"]
        kl = [r[f"kl/{k}"] for r in rows]
        L.append(f"| {k} | " + " | ".join(cells) + f" | {ms(kl)[0]:.5f} |")
    L += ["", "Δ vs fp32 averaged per base (pre-training seed), sampling / teacher-forced:", "",
          "| base seed | " + " | ".join(k for k in MODELS if k != "fp32") + " |",
          "|---|" + "---|" * (len(MODELS) - 1)]
    for i, b in enumerate(bases):
        L.append(f"| {b} | " + " | ".join(f"{summary[k]['sampling']['delta_per_base'][i]:+.4f} / "
                                          f"{summary[k]['teacher']['delta_per_base'][i]:+.4f}"
                                          for k in MODELS if k != "fp32") + " |")
    path_md = Path(args.out) / ("qerl_entropy" + ("_quick" if args.quick else "") + ".md")
    note = "(to be written by whoever ran it: the numbers above are regenerated, this section is kept)"
    if path_md.exists() and "## Interpretation" in path_md.read_text():
        note = path_md.read_text().split("## Interpretation", 1)[1].strip()
    L += ["", "## Interpretation", "", note, ""]
    path_md.write_text("\n".join(L))
    path_md.with_suffix(".json").write_text(json.dumps(
        {"config": {"bases": bases, "prompt_sets": args.prompt_sets, "n_prompts": args.n_prompts,
                    "max_new_tokens": args.max_new_tokens}, "summary": summary, "rows": rows}, indent=1))
    return summary, path_md


def main(argv=None):
    args = parse_args(argv)
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from hfq.qerl.data import make_dataset
    from hfq.qerl.demo import DEMO_PRETRAIN_STEPS, build_demo_base

    torch.manual_seed(0)
    rows = []
    bar = tqdm(total=len(args.bases) * args.prompt_sets, desc="entropy")
    for b in args.bases:
        path = build_demo_base(args.cache_dir, steps=DEMO_PRETRAIN_STEPS, seed=b, log=tqdm.write)
        tok = AutoTokenizer.from_pretrained(path)
        models = load_models(path, gauss_seed=1000 + b)
        for ps in range(args.prompt_sets):
            # prompts the base was not pre-trained on: another generator seed than the demo's (seed + 1)
            prompts = [r["prompt"] for r in make_dataset(args.n_prompts, seed=50_000 + 100 * b + ps)]
            row = measure(models, tok, prompts, args.max_new_tokens, seed=ps)
            rows.append({"base": b, "prompt_set": ps, **row})
            bar.set_postfix_str(f"base {b}: fp32 {row['sampling/fp32']:.3f} nvfp4 {row['sampling/nvfp4']:.3f}")
            bar.update()
    bar.close()
    args.out and Path(args.out).mkdir(parents=True, exist_ok=True)
    summary, path_md = report(rows, args)
    for k in MODELS:
        s = summary[k]
        print(f"{k:11s} sampling {s['sampling']['mean_std'][0]:.4f}  Δ {s['sampling']['delta_mean_std'][0]:+.4f} "
              f"± {s['sampling']['delta_mean_std'][1]:.4f} ({s['sampling']['delta_pos']}/{len(rows)} > 0)   "
              f"teacher Δ {s['teacher']['delta_mean_std'][0]:+.4f} ± {s['teacher']['delta_mean_std'][1]:.4f} "
              f"({s['teacher']['delta_pos']}/{len(rows)} > 0)  KL {s['kl'][0]:.5f}")
    print(f"wrote {path_md} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
