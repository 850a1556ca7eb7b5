"""GPU sampling with counter-based noise: temperature, top-k, top-p, min-p, and the sampled token's log-prob.

Noise comes from a hash of (row key, step, vocab index) (`hfq_kernels.rollout.uniform_noise`), not from
torch's RNG, so sampling is reproducible for a seed, identical on CPU and GPU, independent of global RNG
state, and safe to capture in a CUDA graph (the step counter lives on the device).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hfq_kernels.rollout import gumbel_sample, mix32, row_keys, uniform_noise  # noqa: F401  (re-exported)

@dataclass(frozen=True)
class SamplerFlags:
    """Which filters a captured decode step applies (values live in tensors; flags pick the graph)."""

    greedy: bool = False
    top_k: bool = False
    top_p: bool = False
    min_p: bool = False
    logprobs: bool = False


def process_logits(logits: torch.Tensor, flags: SamplerFlags, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Apply temperature, then top-k, top-p, min-p (transformers' order); filtered entries become -inf.

    logits [B, V] float32; temperature/top_p/min_p [B, 1] float32; top_k [B, 1] int64 (<= 0: off)."""
    if flags.greedy:
        return logits
    # Python-scalar fills only: building a device tensor from a host value here would be a host copy,
    # which is illegal inside CUDA-graph capture
    neg = float("-inf")
    x = logits / temperature
    if flags.top_k:  # ties with the k-th value are kept, as transformers keeps them
        vocab = x.shape[-1]
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab) - 1
        kth = torch.sort(x, dim=-1, descending=True)[0].gather(1, k)
        x = x.masked_fill(x < kth, neg)
    if flags.top_p:  # transformers' rule: ascending order, an entry goes while the mass up to it is <= 1 - top_p
        asc, idx = torch.sort(x, dim=-1)  # (a tie group at the boundary is cut in the sort's order, as there)
        remove = asc.softmax(-1).cumsum(-1) <= 1 - top_p
        remove[:, -1] = False
        x = x.masked_fill(torch.zeros_like(remove).scatter(1, idx, remove), neg)
    if flags.min_p:
        probs = x.softmax(-1)
        thresh = min_p * probs.amax(-1, keepdim=True)
        x = x.masked_fill(probs < thresh, neg)
    return x


def sample(logits: torch.Tensor, flags: SamplerFlags, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, min_p: torch.Tensor, keys: torch.Tensor, step: torch.Tensor,
           vocab_ids: torch.Tensor, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Next token [B] (int64) and, if flags.logprobs, its log-prob [B] under the processed distribution
    (after temperature and filtering, what vLLM calls processed logprobs; raw log-softmax when greedy).

    fused: plain temperature sampling (no top-k/top-p/min-p) as one Triton pass over the logits with the
    same noise bits (`hfq_kernels.rollout.gumbel_sample`) instead of ~40 elementwise kernels."""
    if fused and not (flags.greedy or flags.top_k or flags.top_p or flags.min_p) and logits.stride(-1) == 1:
        return gumbel_sample(logits, temperature, keys, step, flags.logprobs)
    x = process_logits(logits.float(), flags, temperature, top_k, top_p, min_p)
    if flags.greedy:
        tok = x.argmax(-1)
    else:
        u = uniform_noise(keys, step, vocab_ids)
        tok = (x - torch.log(-torch.log(u))).argmax(-1)  # Gumbel-max: an exact draw from softmax(x)
    lp = None
    if flags.logprobs:
        lp = x.gather(1, tok[:, None])[:, 0] - torch.logsumexp(x, dim=-1)
    return tok, lp
