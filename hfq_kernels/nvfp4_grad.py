"""NVFP4 grad-input for few rows: dx = g @ dequant(W) read straight from the g4 layout (hfq_kernels.nvfp4_gluon).

For M <= 64 rows of g (decode-sized micro-batches, GRPO scoring of short sequences) dequantize + cuBLAS writes
and re-reads the whole dense weight (2 bytes per element, twice) to use it once; this kernel reads the 4-bit codes
and their scale bytes once, decodes a [R, BC] tile in registers and multiplies it into [M, BC] partial sums.
Program (c, s): output columns BC*c .. BC*c + BC - 1, weight rows of split s; splits > 1 write fp32 partials that
nvfp4_matmul's split-K reduce sums. Decode: on GPUs the Gluon kernel's PTX (11 integer ops per 8 codes, each
code as bf16 e2m1 * scale * 2^-14, exact); under the interpreter the same values from the torch-reference-backed
helpers. The per-tensor 2^14 / global_recip multiplies the fp32 sums, so the weight is never rounded: the result
is within fp32 summation order of `g @ dequantize_g4(...)`, whose bf16 rounding of each weight it skips.
"""
from __future__ import annotations

import torch

from hfq_kernels._triton import HAS_TRITON, INTERPRET, LRU, BoundLaunch, cdiv, e2m1_raw, f32_to_bf16_rne, next_pow2, sm_count, tl, triton
from hfq_kernels.nvfp4_gluon import _g4_asm
from hfq_kernels.nvfp4_matmul import _splitk_reduce_kernel
from hfq_kernels.nvfp4_quant import recip as _recip

MAX_ROWS = 64  # rows of g the fused kernel takes; more go through dequantize + cuBLAS
_ASM = tl.constexpr(_g4_asm()) if HAS_TRITON else None


@triton.jit
def _code(word, I: tl.constexpr, H: tl.constexpr):
    """E2M1 code (i=I, h=H) of each g4 word (column 2I + H of its 8-column group)."""
    sm: tl.constexpr = 0 if I == 0 else (3 if I == 1 else (-3 if I == 2 else 6))
    ss: tl.constexpr = 0 if I == 0 else (3 if I == 1 else (1 if I == 2 else 2))
    return ((word >> (6 + 16 * H - sm)) & 7) | (((word >> (15 + 16 * H - ss)) & 1) << 3)


@triton.jit
def _columns(a00, a01, a10, a11, a20, a21, a30, a31, R: tl.constexpr, C: tl.constexpr):
    """Values a_ih [R, C/8] (column 2i + h of each 8-column group) -> [R, C] in column order."""
    # joins add the fastest axis last: i1, then i0, then h, so the flat index is 4 i1 + 2 i0 + h = 2i + h
    t0 = tl.join(tl.join(a00, a20), tl.join(a10, a30))
    t1 = tl.join(tl.join(a01, a21), tl.join(a11, a31))
    return tl.reshape(tl.join(t0, t1), (R, C))


@triton.jit
def _halves(o):
    """A bf16 pair packed in int32 -> (low, high) as bf16."""
    return o.to(tl.int16).to(tl.bfloat16, bitcast=True), (o >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _decode_tile(word, sb, R: tl.constexpr, C: tl.constexpr, USE_ASM: tl.constexpr):
    """Words [R, C/8] and scale bytes -> bf16 [R, C] = e2m1 * scale * 2^-14 (exact in bf16)."""
    sb = sb.to(tl.int32)
    if USE_ASM:
        s2 = sb * 0x00100010 + 0x73007300  # bf16x2 (scale * 2^112, twice); byte 208 gives -0.0
        o0, o1, o2, o3 = tl.inline_asm_elementwise(_ASM, "=r,=r,=r,=r,r,r", [word, s2],
                                                   dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                                   is_pure=True, pack=1)
        a00, a01 = _halves(o0)
        a10, a11 = _halves(o1)
        a20, a21 = _halves(o2)
        a30, a31 = _halves(o3)
        return _columns(a00, a01, a10, a11, a20, a21, a30, a31, R, C)
    # the byte's bf16(scale * 2^112) as fp32 bits, exponent lowered by 112: the E4M3 scale exactly
    s = tl.where(sb == 208, 0.0, ((sb << 20) + (118 << 23)).to(tl.float32, bitcast=True))
    v = _columns(e2m1_raw(_code(word, 0, 0)) * s, e2m1_raw(_code(word, 0, 1)) * s,
                 e2m1_raw(_code(word, 1, 0)) * s, e2m1_raw(_code(word, 1, 1)) * s,
                 e2m1_raw(_code(word, 2, 0)) * s, e2m1_raw(_code(word, 2, 1)) * s,
                 e2m1_raw(_code(word, 3, 0)) * s, e2m1_raw(_code(word, 3, 1)) * s, R, C)
    return v.to(tl.bfloat16)


@triton.jit
def _g4_grad_kernel(g_ptr, wr_ptr, sr_ptr, recip_ptr, out_ptr, M, N, K, KC, NT, stride_gm, tiles_per_split,
                    BM: tl.constexpr, BC: tl.constexpr, RT: tl.constexpr, PARTIAL: tl.constexpr,
                    USE_ASM: tl.constexpr, F32_DOT: tl.constexpr):
    """out[:, BC*c : BC*c + BC] (+)= g[:, rows of split s] @ W[rows of split s, same columns]."""
    R: tl.constexpr = 16 * RT
    pc = tl.program_id(0)
    ps = tl.program_id(1)
    m = tl.arange(0, BM)
    r = tl.arange(0, R)
    q = pc * (BC // 8) + tl.arange(0, BC // 8)  # 8-column group: chunk q // 8, lane c = (q % 8) // 2, wsub = q % 2
    g_rows = g_ptr + m[:, None].to(tl.int64) * stride_gm
    m_ok = (m < M)[:, None]
    q_ok = (q < KC * 8)[None, :]
    lane_q = ((q % 8) // 2)[None, :]
    acc = tl.zeros((BM, BC), dtype=tl.float32)
    t_lo = ps * tiles_per_split
    t_hi = tl.minimum(t_lo + tiles_per_split, NT)
    for t0 in range(t_lo, t_hi, RT):
        rt = t0 + r // 16
        ok = q_ok & (rt < t_hi)[:, None]
        base = ((rt[:, None] * KC + (q // 8)[None, :]) * 32 + 4 * (r % 8)[:, None] + lane_q).to(tl.int64)
        hrow = ((r % 16) // 8)[:, None]
        word = tl.load(wr_ptr + base * 4 + 2 * hrow + (q % 2)[None, :], mask=ok, other=0)
        sb = tl.load(sr_ptr + base * 2 + hrow, mask=ok, other=0)
        w = _decode_tile(word, sb, R, BC, USE_ASM)
        n = t0 * 16 + r
        gt = tl.load(g_rows + n[None, :], mask=m_ok & (n < N)[None, :], other=0.0)
        if F32_DOT:  # the interpreter's dot reads bf16 operands as raw uint16
            acc = tl.dot(gt.to(tl.float32), w.to(tl.float32), acc)
        else:
            acc = tl.dot(gt, w, acc)
    acc = acc * (16384.0 / tl.load(recip_ptr))
    col = pc * BC + tl.arange(0, BC)
    omask = m_ok & (col < K)[None, :]
    if PARTIAL:
        tl.store(out_ptr + (ps * M + m[:, None]).to(tl.int64) * K + col[None, :], acc, mask=omask)
    else:
        tl.store(out_ptr + m[:, None].to(tl.int64) * K + col[None, :], f32_to_bf16_rne(acc), mask=omask)


def fused_ok(g2: torch.Tensor) -> bool:
    """Whether grad_input_g4_fused takes g2 [M, N]: bf16, M <= MAX_ROWS, on CUDA (or CPU under the interpreter)."""
    return (g2.dtype == torch.bfloat16 and 0 < g2.shape[0] <= MAX_ROWS
            and (g2.is_cuda or (INTERPRET and g2.is_cpu)))


def grad_config(m: int, n: int, k: int, sms: int) -> dict:
    """Tile and split for M rows: BC = 128 output columns, RT = 4 row tiles (64 weight rows) per step, splits
    over the rows until about 4 programs per SM, each keeping at least 8 steps."""
    bc, rt = 128, 4
    nt = cdiv(n, 16)
    cols = cdiv(k, bc)
    split = max(1, min(cdiv(4 * sms, cols), nt // (8 * rt)))
    tiles = cdiv(cdiv(nt, split), rt) * rt
    return dict(BM=max(16, next_pow2(m)), BC=bc, RT=rt, split=cdiv(nt, tiles), tiles=tiles)


_ASM_OK: dict = {}  # device -> whether the PTX decode built (else the plain decode serves)
_BOUND = LRU(512)


def grad_input_g4_fused(g2: torch.Tensor, wr, sr, global_scale, n: int, k: int) -> torch.Tensor:
    """dx [M, k] = g2 [M, n] @ dequant(W) for a g4 weight, M <= MAX_ROWS, bf16 (fused_ok); no shape checks
    (callers validate once)."""
    m = g2.shape[0]
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    dev = g2.device
    cfg = grad_config(m, n, k, sm_count(dev))
    split = cfg["split"]
    out = torch.empty((m, k), dtype=g2.dtype, device=dev)
    dst = out if split == 1 else torch.empty((split, m, k), dtype=torch.float32, device=dev)
    use_asm = dev.type == "cuda" and not INTERPRET and _ASM_OK.get(dev, True)
    args = (g2, wr, sr, _recip(global_scale), dst, m, n, k, cdiv(k, 64), cdiv(n, 16), g2.stride(0), cfg["tiles"])

    def launch(asm):
        meta = dict(BM=cfg["BM"], BC=cfg["BC"], RT=cfg["RT"], PARTIAL=split > 1, USE_ASM=asm, F32_DOT=INTERPRET,
                    num_warps=4)
        key = (m, n, k, split, asm, dev)
        _BOUND.get_or(key, lambda: BoundLaunch(_g4_grad_kernel, (cdiv(k, cfg["BC"]), split), meta))(*args)

    if use_asm and dev not in _ASM_OK:
        try:
            launch(True)
            _ASM_OK[dev] = True
        except Exception:  # noqa: BLE001 - this device's PTX build failed: the plain decode gives the same values
            _ASM_OK[dev] = False
            launch(False)
    else:
        launch(use_asm)
    if split > 1:
        _splitk_reduce_kernel[(cdiv(m * k, 1024),)](dst, dst, out, m, k, split, k, HAS_BIAS=False, BLOCK=1024,
                                                    num_warps=4)
    return out
