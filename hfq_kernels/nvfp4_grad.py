"""NVFP4 grad-input for few rows: dx = g @ dequant(W) read straight from the g4 layout (hfq_kernels.nvfp4_gluon).

For M <= MAX_ROWS rows of g (decode-sized micro-batches) and weights of at least MIN_WEIGHT elements,
dequantize + cuBLAS writes and re-reads the whole dense weight (2 bytes per element, twice) to use it for a few
rows; this kernel reads the 4-bit codes and their scale bytes once, decodes a [32, BC] tile in registers
(nvfp4_gluon.g4_decode_words: the values dequantize_g4 writes, rounded to bf16 the same way) and multiplies it
into [M, BC] fp32 sums. Program (c, s): output columns BC*c .. BC*c + BC - 1 over the weight rows of split s;
splits > 1 write fp32 partials that nvfp4_matmul's split-K reduce sums. The result is `g @ dequantize_g4(...)`
up to fp32 summation order. It serves the grad-input of few-row calls that keep no dense weight: eager ones once
HFQ_NVFP4_GRAD_DENSE_GB is spent (before that, a training forward keeps its weight: hfq_kernels.nvfp4.plan_apply)
and compiled ones (hfq::nvfp4_g4_grad_input_rows).
"""
from __future__ import annotations

import torch

from hfq_kernels._triton import INTERPRET, LRU, BoundLaunch, cdiv, f32_to_bf16_rne, sm_count, tl, triton
from hfq_kernels.nvfp4_gluon import g4_decode_words
from hfq_kernels.nvfp4_matmul import _splitk_reduce_kernel
from hfq_kernels.nvfp4_quant import recip

MAX_ROWS = 16  # rows of g the kernel takes; more go through dequantize + cuBLAS
# weights (out x in elements) the kernel takes: below this its second launch (the split reduce) costs more host
# time than its decode saves GPU time (7B shapes on the H100: 3584 x 3584 stays with dequantize + cuBLAS)
MIN_WEIGHT = 1 << 24
_BM, _BC, _RT = 16, 64, 2  # padded rows, output columns and 16-row weight tiles per step


@triton.jit
def _g4_grad_kernel(g_ptr, wr_ptr, sr_ptr, recip_ptr, out_ptr, M, N, K, KC, NT, stride_gm, tiles_per_split,
                    BM: tl.constexpr, BC: tl.constexpr, RT: tl.constexpr, PARTIAL: tl.constexpr,
                    F32_DOT: tl.constexpr):
    """out[:, BC*c : BC*c + BC] (+)= g[:, rows of split s] @ W[rows of split s, same columns]."""
    R: tl.constexpr = 16 * RT
    pc = tl.program_id(0)
    ps = tl.program_id(1)
    r = tl.arange(0, R)
    q = pc * (BC // 8) + tl.arange(0, BC // 8)  # 8-column group: chunk q // 8, lane c = (q % 8) // 2, wsub = q % 2
    hrow = ((r % 16) // 8)[:, None]
    lane = (4 * (r % 8))[:, None] + ((q % 8) // 2)[None, :]
    in_k = (q < KC * 8)[None, :]
    m = tl.arange(0, BM)
    m_ok = (m < M)[:, None]
    rcp = tl.load(recip_ptr)
    acc = tl.zeros((BM, BC), dtype=tl.float32)
    t_lo = ps * tiles_per_split
    t_hi = tl.minimum(t_lo + tiles_per_split, NT)
    for t0 in range(t_lo, t_hi, RT):
        rt = t0 + r // 16
        ok = in_k & (rt < t_hi)[:, None]
        base = ((rt[:, None] * KC + (q // 8)[None, :]) * 32 + lane).to(tl.int64)
        word = tl.load(wr_ptr + base * 4 + 2 * hrow + (q % 2)[None, :], mask=ok, other=0)
        sb = tl.load(sr_ptr + base * 2 + hrow, mask=ok, other=0)
        w = g4_decode_words(word, sb, rcp, R, BC)
        n = t0 * 16 + r
        gt = tl.load(g_ptr + m[:, None].to(tl.int64) * stride_gm + n[None, :], mask=m_ok & (n < N)[None, :],
                     other=0.0)
        if F32_DOT:  # the interpreter's dot reads bf16 operands as raw integers (and its casts truncate)
            acc = tl.dot(gt.to(tl.float32), f32_to_bf16_rne(w).to(tl.float32), acc)
        else:
            acc = tl.dot(gt, w.to(tl.bfloat16), acc)
    col = pc * BC + tl.arange(0, BC)
    omask = m_ok & (col < K)[None, :]
    if PARTIAL:
        tl.store(out_ptr + (ps * M + m[:, None]).to(tl.int64) * K + col[None, :], acc, mask=omask)
    else:
        tl.store(out_ptr + m[:, None].to(tl.int64) * K + col[None, :], f32_to_bf16_rne(acc), mask=omask)


def fused_ok(g2: torch.Tensor, k: int) -> bool:
    """Whether grad_input_g4_fused serves g2 [M, N] for an [N, k] weight: bf16, 1 <= M <= MAX_ROWS, N k >=
    MIN_WEIGHT, on CUDA (CPU under the interpreter)."""
    return (g2.dtype == torch.bfloat16 and 0 < g2.shape[0] <= MAX_ROWS and g2.shape[1] * k >= MIN_WEIGHT
            and (g2.is_cuda or (INTERPRET and g2.is_cpu)))


def split_rows(n: int, k: int, sms: int) -> tuple[int, int]:
    """(splits, 16-row tiles per split): splits over the weight rows until about 4 programs per SM, each keeping
    at least two steps of RT tiles."""
    nt = cdiv(n, 16)
    split = max(1, min(cdiv(4 * sms, cdiv(k, _BC)), nt // (2 * _RT)))
    tiles = cdiv(cdiv(nt, split), _RT) * _RT
    return cdiv(nt, tiles), tiles


_BOUND = LRU(512)  # (m, n, k, device) -> (grad launch, reduce launch or None, splits, tiles per split)


def _launches(m: int, n: int, k: int, dev: torch.device):
    sms = sm_count(dev) if dev.type == "cuda" else 4
    split, tiles = split_rows(n, k, sms)
    grad = BoundLaunch(_g4_grad_kernel, (cdiv(k, _BC), split),
                       dict(BM=_BM, BC=_BC, RT=_RT, PARTIAL=split > 1, F32_DOT=INTERPRET, num_warps=4,
                            num_stages=3))
    red = None
    if split > 1:
        red = BoundLaunch(_splitk_reduce_kernel, (cdiv(m * k, 1024),), dict(HAS_BIAS=False, BLOCK=1024, num_warps=4))
    return grad, red, split, tiles


def grad_input_g4_fused(g2: torch.Tensor, wr, sr, global_scale, n: int, k: int) -> torch.Tensor:
    """dx [M, k] = g2 [M, n] @ dequant(W) for a g4 weight (see fused_ok); no shape checks (callers validate)."""
    m = g2.shape[0]
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    dev = g2.device
    grad, red, split, tiles = _BOUND.get_or((m, n, k, dev), lambda: _launches(m, n, k, dev))
    out = torch.empty((m, k), dtype=g2.dtype, device=dev)
    dst = out if red is None else torch.empty((split, m, k), dtype=torch.float32, device=dev)
    rcp = recip(global_scale)
    grad(g2, wr, sr, rcp, dst, m, n, k, cdiv(k, 64), cdiv(n, 16), g2.stride(0), tiles)
    if red is not None:
        red(dst, dst, out, m, k, split, k)
    return out
