"""NVFP4 W4A16 matmul: the config kinds, per-shape configs (heuristic defaults, the candidates the tuner times)
and the tuner holding the chosen ones (shipped table `nvfp4_linear_tuned.json`).

grad_input is always dequantize + cuBLAS: a transposed-read Triton kernel was 4-10x slower on every benchmark
shape (benchmarks/results/nvfp4_matmul_sweep.json, "grad"), so it is not shipped.
"""
from __future__ import annotations

import torch

from hfq_kernels import nvfp4_gluon as gluon
from hfq_kernels._autotune import Tuner
from hfq_kernels._triton import cdiv, sm_count

KINDS = {
    "dequant": "dequantize W to x's dtype, then cuBLAS (prefill / training, M > 64)",
    "tile": "Triton swap-AB tensor-core tile kernel, nibbles decoded by an inline-PTX lookup (fp32 atomics split-K)",
    "gemv": "Triton CUDA-core GEMV for M <= 4, no shared memory",
    "words": "Triton decode kernel: int32 words of 8 codes, fp16 tensor-core dots, split-K partials + reduce",
    "gluon": "Gluon decode kernel on the g4 layout (bf16 x, M <= 64; canonical callers get a cached g4 copy), "
             "split-K partials + reduce",
}
MM_DTYPES = (torch.bfloat16, torch.float16)


def default_config(m: int, n: int, k: int, sms: int) -> dict:
    """Heuristic config used when no tuned choice exists (and during graph capture / compile)."""
    return words_default(m, n, k, sms) if m <= gluon.FEW_ROWS else dict(kind="dequant")


def words_default(m: int, n: int, k: int, sms: int) -> dict:
    """Heuristic "words" config: BN=128 rows, BK=256, split-K until ~2 programs per SM."""
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    return dict(kind="words", BN=128, BM=bm, BK=256, split=_split_for(cdiv(n, 128) * cdiv(m, bm), cdiv(k, 256),
                                                                        2 * sms), warps=4, stages=1, prefetch=True)


def _split_for(tiles: int, chunks: int, programs: int, cap: int | None = None) -> int:
    """Smallest power-of-two split-K (<= chunks, <= cap) that gives at least `programs` programs."""
    split = 1
    while tiles * split < programs and split * 2 <= chunks and (cap is None or split < cap):
        split *= 2
    return split


def _words_candidates(m: int, n: int, k: int, sms: int) -> list[dict]:
    """"words" configs: tile shapes x split-K around the one that gives ~2 programs per SM."""
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    c = []
    for bn, bk, warps, pre in ((128, 256, 4, True), (64, 256, 4, True), (128, 512, 8, True), (256, 256, 8, True),
                               (128, 256, 8, True), (128, 256, 4, False)):
        chunks = cdiv(k, bk)
        base = _split_for(cdiv(n, bn) * cdiv(m, bm), chunks, 2 * sms)
        for split in sorted({max(1, base // 2), base, min(chunks, base * 2)}):
            c.append(dict(kind="words", BN=bn, BM=bm, BK=bk, split=split, warps=warps, stages=1, prefetch=pre))
    return c


def _split_range(n: int, bn: int, k: int, bk: int, splits, lo: int, hi: int):
    """The splits (of `splits`) that keep <= K chunks and, when > 1, lo..hi programs."""
    tiles, chunks = cdiv(n, bn), cdiv(k, bk)
    return [s for s in splits if s <= chunks and (s == 1 or lo <= tiles * s <= hi)]


def candidates(m: int, n: int, k: int, sms: int) -> list[dict]:
    """Every config the tuner times for this shape."""
    c = _words_candidates(m, n, k, sms) if m <= gluon.FEW_ROWS else []
    if m <= 4:
        bm = 1 if m == 1 else (2 if m == 2 else 4)
        for bn, bk, warps, stages in ((16, 256, 4, 3), (32, 256, 4, 3), (16, 512, 4, 2), (8, 512, 4, 3)):
            for split in _split_range(n, bn, k, bk, (1, 2, 4, 8), sms, 16 * sms):
                c.append(dict(kind="gemv", BN=bn, BM=bm, BK=bk, split=split, warps=warps, stages=stages))
    if m <= 16:
        for bn, bk, warps, stages in ((64, 256, 4, 4), (64, 512, 4, 3)):
            for split in _split_range(n, bn, k, bk, (1, 2, 4, 8, 16), sms, 8 * sms):
                c.append(dict(kind="tile", BN=bn, BM=16, BK=bk, split=split, warps=warps, stages=stages, asm=True))
    elif m <= gluon.FEW_ROWS:
        for bn, bm, bk, warps, stages in ((64, 32, 128, 4, 4), (64, 64, 128, 4, 4), (128, 64, 128, 8, 3),
                                          (128, 32, 256, 4, 3)):
            if bm < m / 2:
                continue
            for split in (1, 2, 4):
                c.append(dict(kind="tile", BN=bn, BM=bm, BK=bk, split=split, warps=warps, stages=stages, asm=True))
    else:  # measured on H100: dequantize + cuBLAS beats the fused Triton tile for M >= 128 (see benchmarks)
        c.append(dict(kind="dequant"))
        c.append(dict(kind="tile", BN=64, BM=128, BK=64, split=1, warps=4, stages=4, asm=True))
    return c


LINEAR_TUNER = Tuner("nvfp4_linear")


def gluon_config(m: int, n: int, k: int, device) -> dict:
    """The "gluon" config a plan uses for bf16 x with M <= 64: a tuned "gluon" entry, else the default."""
    dev = torch.device(device)
    for mm in ((m, 8) if m <= 8 else (m,)):  # M <= 8 share the BM=8 kernel: fall back to the M=8 entry
        hit = LINEAR_TUNER.cached(mm, n, k, torch.bfloat16, dev)
        if hit is not None and hit.get("kind") == "gluon":
            return dict(hit)
    return gluon.default_config(m, n, k, sm_count(dev))


def splits(chunks: int, want: int) -> tuple[int, int]:
    """(split, chunks per split) for a requested split-K over `chunks` K tiles, with no empty split."""
    split = max(1, min(want, chunks))
    cps = cdiv(chunks, split)
    return cdiv(chunks, cps), cps
