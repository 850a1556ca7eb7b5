"""QeRL GRPO step on the device: QeRL (NVFP4 + LoRA + AQN) vs BF16 LoRA vs QLoRA (bnb NF4), same batch and lengths,
same run, all three rolled out by hfq's RolloutEngine. Phases timed separately: rollout / reward / log-probs / update.
Plus a 32B-shaped QeRL step built layer by layer (the BF16 model never exists on the GPU).

    python benchmarks/qerl_step.py [--batch 8 --prompt 256 --new 512 --methods qerl,bf16_lora,qlora,qerl_32b]

Random-init weights with real Qwen2.5 configs (speed/memory only). Writes benchmarks/results/qerl_step.{json,md}
(or --out DIR) after every row, so a killed run keeps what it measured.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

T0 = time.time()
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def qwen_config(size: str):
    from transformers import Qwen2Config

    shapes = {"7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064),
              "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                          num_key_value_heads=8, vocab_size=152064)}[size]
    return Qwen2Config(max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2, **shapes)


def build(method: str, size: str):
    """The policy: base weights in the method's format + LoRA r=32 on all decoder linears."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    cfg = qwen_config(size)
    torch.manual_seed(0)
    if size == "32b":  # layer by layer: only one BF16 layer is ever on the GPU
        from hfq.nvfp4 import NVFP4Linear
        from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        for mod in (model.model.embed_tokens, model.lm_head, model.model.norm):
            mod.to_empty(device="cuda")
        torch.nn.init.normal_(model.model.embed_tokens.weight, std=0.02)
        torch.nn.init.normal_(model.lm_head.weight, std=0.02)
        torch.nn.init.ones_(model.model.norm.weight)
        for layer in model.model.layers:
            layer.to_empty(device="cuda")
            for n, p in layer.named_parameters():
                torch.nn.init.ones_(p) if "norm" in n else (torch.nn.init.normal_(p, std=0.02) if p.dim() == 2
                                                            else torch.nn.init.zeros_(p))
            for parent in (layer.self_attn, layer.mlp):
                for n in LORA_TARGETS:
                    if hasattr(parent, n):
                        setattr(parent, n, NVFP4Linear.from_linear(getattr(parent, n)))
            torch.cuda.empty_cache()
        model.model.rotary_emb = Qwen2RotaryEmbedding(cfg, device="cuda")
    else:
        from rollout import build_model, swap, to_nf4, to_nvfp4

        model = build_model(cfg)
        if method == "qerl":
            swap(model, to_nvfp4(model))
        elif method == "qlora":
            swap(model, to_nf4(model))
        gc.collect()
        torch.cuda.empty_cache()
    lcfg = LoraConfig(r=32, lora_alpha=64, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    if method.startswith("qerl"):
        from hfq.nvfp4 import get_peft_model
    else:
        from peft import get_peft_model
    model = get_peft_model(model, lcfg)
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data = p.data.to(torch.bfloat16)
    return model


def per_token_logps(model, ids, n_new):
    """Log-probs of the last n_new tokens, as TRL computes them: logits only for the completion
    (logits_to_keep) and a row-by-row log-softmax, so no fp32 [batch, seq, vocab] tensor is ever held."""
    logits = model(input_ids=ids, logits_to_keep=n_new + 1, use_cache=False).logits[:, :-1]
    tgt = ids[:, -n_new:]
    rows = []
    for lg, t in zip(logits, tgt):  # [n_new, vocab] at a time
        lg = lg.float()
        rows.append(lg.gather(-1, t[:, None]).squeeze(-1) - torch.logsumexp(lg, -1))
    return torch.stack(rows)


def step(method, size, batch, plen, new, warm=True, grad_ckpt=False, compile_layers=False):
    from hfq.qerl.aqn import AQNSchedule, AdaptiveQuantizationNoise
    from hfq.qerl.rewards import accuracy_reward, format_reward
    from hfq.rollout import RolloutEngine

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = build(method, size)
    if grad_ckpt:  # as GRPOConfig(gradient_checkpointing=True) does; the rollout engine is unaffected
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compile_layers:  # regional compilation: each decoder layer (one graph serves all); the engine calls sub-modules
        for layer in model.get_base_model().model.layers:
            layer.compile()
    alloc = {"alloc_built_gb": round(torch.cuda.memory_allocated() / 2**30, 2)}
    log(f"{method} {size}: built, {alloc['alloc_built_gb']} GB allocated")
    aqn = AdaptiveQuantizationNoise(model, seed=0) if method.startswith("qerl") else None
    sigma = AQNSchedule().stage_sigma(1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    engine = RolloutEngine(model, max_batch=batch, max_seq_len=plen + new)
    V = model.config.vocab_size
    ids = torch.randint(3, V, (batch, plen), generator=torch.Generator().manual_seed(0)).cuda()
    engine.warmup(batch, plen, new, temperature=1.0)
    torch.cuda.synchronize()
    alloc["alloc_after_warmup_gb"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    timings = {}

    def sync_t():
        torch.cuda.synchronize()
        return time.perf_counter()

    peaks = {}

    def phase_peak(name):  # peak allocated during the phase that just ended, then start the next phase's count
        torch.cuda.synchronize()
        peaks[name] = max(peaks.get(name, 0.0), torch.cuda.max_memory_allocated() / 2**30)
        torch.cuda.reset_peak_memory_stats()

    phase_peak("build_and_warmup")
    for it in range(2 if warm else 1):  # the first step warms up kernels/allocator; the second is reported
        model.eval()
        t0 = sync_t()
        if aqn is not None:
            aqn.apply(it, sigma)
        out = engine.generate(ids, max_new_tokens=new, temperature=1.0, eos_token_ids=[], seed=it)
        if aqn is not None:
            aqn.restore()
        t1 = sync_t()
        phase_peak("rollout")
        comp = out.completion_ids
        texts = ["<think>" + " ".join(map(str, r[:8].tolist())) + "</think><answer>1</answer>" for r in comp.cpu()]
        rewards = torch.tensor([a + f for a, f in zip(accuracy_reward(texts, answer=["1"] * batch),
                                                        format_reward(texts))], device="cuda")
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        t2 = sync_t()
        full = torch.cat([ids, comp.to(ids.device)], 1)
        with torch.no_grad():
            old = per_token_logps(model, full, new)
        t3 = sync_t()
        phase_peak("logprob")
        model.train()
        for i in range(batch):  # one sequence per micro-batch (TRL's per-device batch 1 x grad accumulation)
            lp = per_token_logps(model, full[i:i + 1], new)
            ratio = torch.exp(lp - old[i:i + 1])
            loss = -(torch.minimum(ratio * adv[i], ratio.clamp(0.8, 1.28) * adv[i])).mean() / batch
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t4 = sync_t()
        phase_peak("update")
        timings = dict(rollout_s=t1 - t0, reward_s=t2 - t1, logprob_s=t3 - t2, update_s=t4 - t3, step_s=t4 - t0)
        log(f"{method} {size} step {it}: " + ", ".join(f"{k} {v:.2f}" for k, v in timings.items()))
    row = dict(method=method, model=f"qwen2.5-{size}-shaped", batch=batch, prompt_len=plen, completion_len=new,
               **{k: round(v, 3) for k, v in timings.items()}, rollout_tok_s=round(batch * new / timings["rollout_s"], 1),
               peak_gb=round(max(peaks.values()), 2), **alloc,
               **{f"peak_{k}_gb": round(v, 2) for k, v in peaks.items()})
    del engine, model, opt, aqn
    gc.collect()
    torch.cuda.empty_cache()
    return row


def write(rows, notes, out_dir, name="qerl_step"):
    os.makedirs(out_dir, exist_ok=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except Exception:  # noqa: BLE001
        commit = "unknown"
    commit = os.environ.get("HFQ_COMMIT") or commit
    res = dict(device=torch.cuda.get_device_name(0), date=datetime.date.today().isoformat(), commit=commit or "unknown",
               rows=rows, notes=notes)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(res, f, indent=1)
    base = {r["method"]: r for r in rows}
    lines = ["# QeRL GRPO step", "", f"device: {res['device']}  date: {res['date']}  commit: {res['commit']}", "",
             "Random-init Qwen2.5-shaped models, LoRA r=32 on all decoder linears, hfq RolloutEngine for every method,"
             " EOS off (every row generates completion_len tokens).", "",
             "| method | model | batch | prompt | completion | step s | rollout s | reward s | logprob s | update s |"
             " rollout tok/s | peak GB | step x bf16_lora | rollout x bf16_lora | step x qlora | mem / bf16_lora |",
             "|" + "---|" * 16]
    b, q = base.get("bf16_lora"), base.get("qlora")
    for r in rows:
        def ratio(x, key, inv=False):
            if x is None or r.get(key) in (None, 0) or x.get(key) in (None, 0):
                return ""
            return f"{(r[key] / x[key]) if inv else (x[key] / r[key]):.2f}"
        lines.append(f"| {r['method']} | {r['model']} | {r['batch']} | {r['prompt_len']} | {r['completion_len']} | "
                     f"{r.get('step_s')} | {r.get('rollout_s')} | {r.get('reward_s')} | {r.get('logprob_s')} | "
                     f"{r.get('update_s')} | {r.get('rollout_tok_s')} | {r.get('peak_gb')} | {ratio(b, 'step_s')} | "
                     f"{ratio(b, 'rollout_s')} | {ratio(q, 'step_s')} | {ratio(b, 'peak_gb', inv=True)} |")
    ph = [k for k in ("built", "after_warmup") if any(f"alloc_{k}_gb" in r for r in rows)]
    pk = ["build_and_warmup", "rollout", "logprob", "update"]
    lines += ["", "## Memory by phase (GB; allocated = held at that point, peak = max allocated during the phase)", "",
              "| method | " + " | ".join(f"allocated {k}" for k in ph) + " | " + " | ".join(f"peak {k}" for k in pk) + " |",
              "|" + "---|" * (1 + len(ph) + len(pk))]
    for r in rows:
        lines.append(f"| {r['method']} | " + " | ".join(str(r.get(f"alloc_{k}_gb", "")) for k in ph) + " | "
                     + " | ".join(str(r.get(f"peak_{k}_gb", "")) for k in pk) + " |")
    lines += ["", "## Notes"] + [f"- {n}" for n in notes]
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--methods", default="qerl,bf16_lora,qlora,qerl_32b")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing in the update (writes qerl_step_gc.*)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (writes qerl_step_compile.*)")
    a = ap.parse_args()
    rows, notes = [], []
    if a.grad_ckpt:
        notes.append("gradient checkpointing on (non-reentrant) in the update and log-prob passes of every method")
    if a.compile:
        notes.append("torch.compile on every decoder layer (regional; step 0 absorbs the compilation, step 1 reported)")
    for m in a.methods.split(","):
        size = "32b" if m == "qerl_32b" else "7b"
        try:
            rows.append(step(m, size, a.batch, a.prompt, a.new, warm=(size != "32b"), grad_ckpt=a.grad_ckpt,
                             compile_layers=a.compile))
        except Exception as e:  # noqa: BLE001 - record and go on: the other rows still count
            traceback.print_exc()
            notes.append(f"{m}: failed: {type(e).__name__}: {str(e)[:300]}")
            rows.append(dict(method=m, model=f"qwen2.5-{size}-shaped", batch=a.batch, prompt_len=a.prompt,
                             completion_len=a.new, step_s=None, rollout_s=None, reward_s=None, logprob_s=None,
                             update_s=None, rollout_tok_s=None, peak_gb=None))
            gc.collect()
            torch.cuda.empty_cache()
        write(rows, notes, a.out, "qerl_step" + ("_gc" if a.grad_ckpt else "") + ("_compile" if a.compile else ""))
    log("done")


if __name__ == "__main__":
    main()
