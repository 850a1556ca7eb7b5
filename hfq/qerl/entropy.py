"""Sampling entropy of a causal LM: the QeRL paper's Fig. 5 measurement (quantized bases explore more)."""
from __future__ import annotations

import torch


def sampling_entropy(model, tok, prompts, max_new_tokens: int = 32, seed: int = 0) -> float:
    """Mean per-token entropy (nats) of the sampling distribution (T = 1) along sampled completions,
    counting each completion up to and including its first EOS. The samples follow `seed`; the caller's random
    streams (CPU and the model's GPU) are left where they were."""
    # Left padding whatever the tokenizer says, so generation continues right after each prompt.
    dev = next(model.parameters()).device
    enc = tok(list(prompts), return_tensors="pt", padding=True, padding_side="left").to(dev)
    gpus = [torch.cuda.current_device() if dev.index is None else dev.index] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=gpus), torch.no_grad():
        torch.manual_seed(seed)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    logits = torch.stack(out.logits, 1).float()  # [B, T, V]
    logp = torch.log_softmax(logits, -1)
    ent = -(logp.exp() * logp).sum(-1)
    gen = out.sequences[:, enc.input_ids.shape[1]:]
    alive = torch.ones_like(gen, dtype=torch.bool)
    eos = gen == tok.eos_token_id
    alive[:, 1:] = ~(eos.cumsum(1)[:, :-1] > 0)
    return float((ent * alive).sum() / alive.sum())
