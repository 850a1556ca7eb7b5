"""GPU sampling with counter-based noise: temperature, top-k, top-p, min-p, and the sampled token's log-prob.

Noise comes from a hash of (row key, step, vocab index), not from torch's RNG, so sampling is
reproducible for a seed, identical on CPU and GPU, independent of global RNG state, and safe
to capture in a CUDA graph (the step counter lives on the device).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (lowbias32) on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32  # the product may wrap past 2^63; only its low 32 bits are kept
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor) -> torch.Tensor:
    """Two independent 32-bit keys per row [B, 2] from int64 per-row seeds (row index already mixed in)."""
    lo = seeds & _M32
    hi = (seeds >> 32) & _M32
    a = mix32(lo ^ mix32(hi + 0x9E3779B9))
    b = mix32(a ^ 0x632BE5AB)
    return torch.stack([a, b], dim=-1)


def uniform_noise(keys: torch.Tensor, step: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """Uniform (0, 1) float32 noise [B, V] for `keys` [B, 2], a step counter [1] and vocab ids [V]."""
    s = mix32((step & _M32) ^ 0x2545F491)
    ka = mix32(keys[:, :1] ^ s)
    kb = mix32((keys[:, 1:] + s) & _M32)
    h = mix32(mix32(vocab_ids[None, :] ^ ka) ^ kb)
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


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
    if flags.top_k or flags.top_p:
        srt, _ = torch.sort(x, dim=-1, descending=True)
        vocab = x.shape[-1]
        if flags.top_k:
            k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab) - 1
            kth = srt.gather(1, k)
            x = x.masked_fill(x < kth, neg)
            srt = srt.masked_fill(srt < kth, neg)
        if flags.top_p:
            probs = srt.softmax(-1)
            before = probs.cumsum(-1) - probs  # mass strictly ahead of each sorted entry
            remove = before >= top_p
            remove[:, 0] = False
            # the smallest kept value is the threshold; ties at it are kept, as in transformers
            kept_min = srt.masked_fill(remove, float("inf")).amin(-1, keepdim=True)
            x = x.masked_fill(x < kept_min, neg)
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
    same noise bits (`kernels.gumbel_sample`) instead of ~40 elementwise kernels."""
    if fused and not (flags.greedy or flags.top_k or flags.top_p or flags.min_p) and logits.stride(-1) == 1:
        from .kernels import gumbel_sample

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
