"""NVFP4 grad-input for few rows: dx = g @ dequant(W) read straight from the g4 layout (hfq_kernels.nvfp4_gluon).

For M <= MAX_ROWS rows of g (decode-sized micro-batches), dequantize + cuBLAS writes and re-reads the whole dense
weight (2 bytes per element, twice) to use it for a few rows; this kernel reads the 4-bit codes and their scale
bytes once, decodes a [16 RT, BC] tile in registers (g4_decode_unscaled: e2m1 * scale, exact in
bf16, by inline PTX; the global scale is applied to the sums) and multiplies it into [M, BC] fp32 sums. Program
(c, s): output columns BC*c .. BC*c + BC - 1 over the weight rows of split s; with splits > 1 each writes fp32
partials and the last program of column block c to finish sums them in split order (one launch, no reduce kernel;
scratch from _triton.SPLIT_SCRATCH). The result is g @ W for W the exact NVFP4 values, up to fp32 summation order
(dequantize_g4 + matmul rounds each weight to bf16 first). It serves the grad-input of few-row eager training
calls (nvfp4_plan.g4_grad, every g4 plan's grad) and of compiled ones (hfq::nvfp4_g4_grad_input_rows).
"""
from __future__ import annotations

import torch

from hfq_kernels._triton import (HAS_TRITON, INTERPRET, LRU, SPLIT_SCRATCH, BoundLaunch, cdiv, f32_to_bf16_rne,
                                 sm_count, tl, triton)
from hfq_kernels.nvfp4_gluon import g4_asm, g4_decode_words
from hfq_kernels.nvfp4_quant import recip

MAX_ROWS = 16  # rows of g the kernel takes; more go through dequantize + cuBLAS
_BM, _BC, _RT = 16, 64, 8  # padded rows, output columns and 16-row weight tiles per step
_G4_ASM_HALVES = tl.constexpr(g4_asm(halves=True)) if HAS_TRITON else None


@triton.jit
def g4_decode_unscaled(word, sb, R: tl.constexpr, C: tl.constexpr):
    """Words [R, C/8] and their scale bytes -> bf16 e2m1 * scale * 2^-14 [R, C] in column order (exact; the
    global scale left to the caller: W = this * 2^14 / recip). Inline PTX, so GPU only; under the interpreter
    nvfp4_gluon.g4_decode_words(word, sb, 16384.0, ...) gives the same values in fp32."""
    s2 = sb.to(tl.int32) * 0x00100010 + 0x73007300
    v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
        _G4_ASM_HALVES, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [word, s2], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    # as in g4_decode_words: i1, then i0, then h fastest, so the flat index is 4 i1 + 2 i0 + h = 2i + h
    t0 = tl.join(tl.join(v0, v4), tl.join(v2, v6))
    t1 = tl.join(tl.join(v1, v5), tl.join(v3, v7))
    return tl.reshape(tl.join(t0, t1), (R, C))


@triton.jit
def _g4_grad_kernel(g_ptr, wr_ptr, sr_ptr, recip_ptr, out_ptr, y_ptr, cnt_ptr, M, N, K, KC, NT, stride_gm,
                    tiles_per_split, BM: tl.constexpr, BC: tl.constexpr, RT: tl.constexpr, PARTIAL: tl.constexpr,
                    F32_DOT: tl.constexpr):
    """out[:, BC*c : BC*c + BC] (+)= g[:, rows of split s] @ W[rows of split s, same columns]. PARTIAL: out is
    fp32 partials [split, M, K]; the last program of a column block to finish (counted in cnt_ptr[c]) sums
    them in split order into y [M, K] and resets its counter. The sums are kept transposed ([BC, BM]: the
    decoded weight is the dot's left operand, which Hopper's wgmma takes from registers)."""
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
    acc = tl.zeros((BC, BM), dtype=tl.float32)
    t_lo = ps * tiles_per_split
    t_hi = tl.minimum(t_lo + tiles_per_split, NT)
    for t0 in range(t_lo, t_hi, RT):
        rt = t0 + r // 16
        ok = in_k & (rt < t_hi)[:, None]
        base = ((rt[:, None] * KC + (q // 8)[None, :]) * 32 + lane).to(tl.int64)
        word = tl.load(wr_ptr + base * 4 + 2 * hrow + (q % 2)[None, :], mask=ok, other=0)
        sb = tl.load(sr_ptr + base * 2 + hrow, mask=ok, other=0)
        n = t0 * 16 + r
        gt = tl.load(g_ptr + m[:, None].to(tl.int64) * stride_gm + n[None, :], mask=m_ok & (n < N)[None, :],
                     other=0.0)
        if F32_DOT:  # the interpreter: no inline PTX, and its dot reads bf16 operands as raw integers
            w = g4_decode_words(word, sb, 16384.0, R, BC)  # the same exact values, in fp32
            acc = tl.dot(tl.trans(w), tl.trans(gt.to(tl.float32)), acc)
        else:
            acc = tl.dot(tl.trans(g4_decode_unscaled(word, sb, R, BC)), tl.trans(gt), acc)
    acc = tl.trans(acc) * (16384.0 / tl.load(recip_ptr))
    col = pc * BC + tl.arange(0, BC)
    omask = m_ok & (col < K)[None, :]
    if PARTIAL:
        tl.store(out_ptr + (ps * M + m[:, None]).to(tl.int64) * K + col[None, :], acc, mask=omask)
        tl.debug_barrier()  # every thread's partial is written before the arrival is counted
        if tl.atomic_add(cnt_ptr + pc, 1, sem="acq_rel") == tl.num_programs(1) - 1:
            tot = tl.zeros((BM, BC), dtype=tl.float32)
            for s in range(0, tl.num_programs(1)):
                tot += tl.load(out_ptr + (s * M + m[:, None]).to(tl.int64) * K + col[None, :], mask=omask,
                               other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + m[:, None].to(tl.int64) * K + col[None, :], f32_to_bf16_rne(tot), mask=omask)
            tl.atomic_xchg(cnt_ptr + pc, 0)
    else:
        tl.store(out_ptr + m[:, None].to(tl.int64) * K + col[None, :], f32_to_bf16_rne(acc), mask=omask)


def fused_ok(g2: torch.Tensor, k: int) -> bool:
    """Whether grad_input_g4_fused serves g2 [M, N] for an [N, k] weight: bf16, 1 <= M <= MAX_ROWS, on CUDA (CPU
    under the interpreter)."""
    return fused_rows_ok(g2.shape[0], g2.dtype, g2.device)


def fused_rows_ok(m: int, dtype: torch.dtype, device: torch.device) -> bool:
    """fused_ok for grads of m rows of `dtype` on `device`."""
    return (dtype == torch.bfloat16 and 0 < m <= MAX_ROWS
            and (device.type == "cuda" or (INTERPRET and device.type == "cpu")))


def split_rows(n: int, k: int, sms: int) -> tuple[int, int]:
    """(splits, 16-row tiles per split): splits over the weight rows until about 8 programs per SM, each keeping
    at least three steps of RT tiles."""
    nt = cdiv(n, 16)
    split = max(1, min(cdiv(8 * sms, cdiv(k, _BC)), nt // (3 * _RT)))
    tiles = cdiv(cdiv(nt, split), _RT) * _RT
    return cdiv(nt, tiles), tiles


def grad_launcher(m: int, n: int, k: int, dev: torch.device, fixed: bool = False):
    """run(g2, wr, sr, recip, g_stride=None, out_shape=None) -> dx [m, k] (or out_shape, m rows of k) for a bf16
    g2 of m rows of n (see fused_ok), rows g_stride apart (default g2.stride(0)): the launch of this shape
    decided once (grid, split over the weight rows, scratch sizes), one kernel per call. `fixed`: a plan's
    launches, whose wr, sr and recip were checked once (g4 dtypes, 16-byte aligned): only g2 and its row stride
    are compared per call."""
    split, tiles = split_rows(n, k, sm_count(dev) if dev.type == "cuda" else 4)
    grad = BoundLaunch(_g4_grad_kernel, (cdiv(k, _BC), split),
                       dict(BM=_BM, BC=_BC, RT=_RT, PARTIAL=split > 1, F32_DOT=INTERPRET, num_warps=4,
                            num_stages=3), check=("g_ptr", "stride_gm") if fixed else None)
    kc, nt, cols, numel = cdiv(k, 64), cdiv(n, 16), cdiv(k, _BC), split * m * k

    def run(g2, wr, sr, rcp, g_stride=None, out_shape=None):
        out = torch.empty((m, k) if out_shape is None else out_shape, dtype=g2.dtype, device=dev)
        part, cnt = SPLIT_SCRATCH.get(dev, numel, cols) if split > 1 else (out, out)
        grad(g2, wr, sr, rcp, part, out, cnt, m, n, k, kc, nt, g2.stride(0) if g_stride is None else g_stride,
             tiles)
        return out

    return run


_BOUND = LRU(512)  # (m, n, k, device, fixed) -> grad_launcher(m, n, k, device, fixed)


def bound_grad(m: int, n: int, k: int, dev: torch.device, fixed: bool = False):
    """grad_launcher() of this shape, made once and kept (shared by the plans and calls of one shape)."""
    return _BOUND.get_or((m, n, k, dev, fixed), lambda: grad_launcher(m, n, k, dev, fixed))


def grad_input_g4_fused(g2: torch.Tensor, wr, sr, global_scale, n: int, k: int) -> torch.Tensor:
    """dx [M, k] = g2 [M, n] @ dequant(W) for a g4 weight (see fused_ok) in one launch; no shape checks
    (callers validate)."""
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    return bound_grad(g2.shape[0], n, k, g2.device)(g2, wr, sr, recip(global_scale))
