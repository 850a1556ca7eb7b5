"""NVFP4 W4A16 GEMM on the g4 layout for prefill / training (M > 64): the weight tile is decoded in registers and
fed to the tensor cores, so no dense bf16 weight is written per call.

forward:    y[M, N]  = x[M, K] @ W^T (+ bias)   tiles [BM, 16 RT] of y, K walked in chunks of 64 KCS
grad-input: gx[M, K] = g[M, N] @ W              tiles [BM, 64 KCS] of gx, N walked in row tiles of 16 RT

Both read the same decoded tile: rows 16 rt .. of W, K chunks kc .. (the g4 layout's units, see nvfp4_gluon),
values e2m1 * scale * 2^-14 in bf16 (exact: <= 5 significant bits, far from bf16's range limits), and the fp32
accumulator is multiplied by 2^14 / global_recip once. So the result is that of an fp32 GEMM on the exact weight
up to summation order, where dequantize + cuBLAS first rounds each weight divided by global_recip to bf16.

Each tile element gathers its word and scale byte and builds its bf16 bits with shifts and masks (the bit
placement of the Gluon kernel's PTX, one element at a time): a tile built by join + reshape, as the decode
kernels do, fails Triton 3.6's dot-operand pass ("Illegal shared layout"). Triton stages the decoded tile in
shared memory for the MMA, whose other operand (x or g) is loaded there by the pipeliner.
"""
from __future__ import annotations

import torch

from hfq_kernels import nvfp4_gluon as gluon
from hfq_kernels._triton import cdiv, tl, triton

_TWO14 = tl.constexpr(16384.0)


@triton.jit
def _g4_tile(wr_ptr, sr_ptr, rt0, kc0, KC, NT, RT: tl.constexpr, KCS: tl.constexpr, BCAST: tl.constexpr,
             SR32: tl.constexpr):
    """Rows 16 rt0 .. 16 (rt0 + RT) and K chunks kc0 .. kc0 + KCS of a g4 weight -> [16 RT, 64 KCS] bf16 values
    e2m1 * scale * 2^-14 (exact; no subnormal on the way: the code becomes an fp16, the scale an fp32). Row tiles past NT - 1 and chunks past KC - 1 read the last ones (callers mask
    what they contribute). Each element gathers its own word and scale byte (8 and 16 elements share one, so
    the loads hit L1) and decodes in place: no reshape reaches the MMA operand."""
    R: tl.constexpr = 16 * RT
    C: tl.constexpr = 64 * KCS
    r = tl.arange(0, R)[:, None]
    if BCAST:  # one load per word and scale byte, widened to the 8 columns in registers
        q = tl.arange(0, C // 8)[None, :]
        rt = tl.minimum(rt0 + r // 16, NT - 1)
        kc = tl.minimum(kc0 + q // 8, KC - 1)
        hrow = (r % 16) // 8
        base = (rt * KC + kc).to(tl.int64) * 32 + 4 * (r % 8) + (q % 8) // 2
        word = tl.load(wr_ptr + base * 4 + 2 * hrow + q % 2)
        if SR32:  # scale bytes read as int32 words (4 bytes: lanes 4g + c, c even and odd, both hrow)
            sw = tl.load(sr_ptr + (base >> 1))
            sb = (sw >> (8 * (2 * ((q % 8) // 2 % 2) + hrow))) & 255
        else:
            sb = tl.load(sr_ptr + base * 2 + hrow).to(tl.int32)
        word = tl.reshape(tl.broadcast_to(word[:, :, None], (R, C // 8, 8)), (R, C))
        sb = tl.reshape(tl.broadcast_to(sb[:, :, None], (R, C // 8, 8)), (R, C))
        col = tl.arange(0, C)[None, :]
    else:
        col = tl.arange(0, C)[None, :]
        rt = tl.minimum(rt0 + r // 16, NT - 1)
        kc = tl.minimum(kc0 + col // 64, KC - 1)
        hrow = (r % 16) // 8
        lane = 4 * (r % 8) + (col % 64) // 16  # 4 g + c
        base = (rt * KC + kc).to(tl.int64) * 32 + lane
        word = tl.load(wr_ptr + base * 4 + 2 * hrow + (col % 16) // 8)
        if SR32:
            sb = (tl.load(sr_ptr + (base >> 1)) >> (8 * (2 * ((col % 64) // 16 % 2) + hrow))) & 255
        else:
            sb = tl.load(sr_ptr + base * 2 + hrow).to(tl.int32)
    i = (col % 8) // 2
    h16 = 16 * (col % 2)
    sm = tl.where(i == 0, 0, tl.where(i == 1, 3, tl.where(i == 2, -3, 6)))
    ss = tl.where(i == 0, 0, tl.where(i == 1, 3, tl.where(i == 2, 1, 2)))
    a = h16 - sm - 3  # the code's magnitude bits sit at 9 + a .. 11 + a: move them to fp16's 9 .. 11
    mag = tl.where(a >= 0, word >> a, word << -a) & 0xE00
    b = h16 - ss  # and the sign bit at 15 + b: move it to 15
    sgn = tl.where(b >= 0, word >> b, word << -b) & 0x8000
    v = (mag | sgn).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)  # e2m1 * 2^-14, exact
    # the byte's bf16(scale * 2^112) as fp32 bits, exponent lowered by 112: the E4M3 scale exactly (>= 2^-9)
    sval = tl.where(sb == 208, 0.0, ((sb << 20) + (118 << 23)).to(tl.float32, bitcast=True))
    return (v * sval).to(tl.bfloat16)


@triton.jit
def _tile_ids(M, NB, BM: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_b): program id -> M tile and output-column tile, GROUP_M M tiles walked together so that
    consecutive programs share weight tiles in L2."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BM)
    per_group = GROUP_M * NB
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(n_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % rows, (pid % per_group) // rows


@triton.jit
def _g4mm_fwd_kernel(x_ptr, wr_ptr, sr_ptr, recip_ptr, b_ptr, y_ptr, M, N, K, KC, NT, stride_xm, stride_ym,
                     BM: tl.constexpr, RT: tl.constexpr, KCS: tl.constexpr, GROUP_M: tl.constexpr,
                     HAS_BIAS: tl.constexpr, F32_DOT: tl.constexpr, BCAST: tl.constexpr = False,
                     MASK_K: tl.constexpr = True, SR32: tl.constexpr = False):
    """y = x @ W^T (+ bias) for one [BM, 16 RT] tile of y."""
    BN: tl.constexpr = 16 * RT
    BK: tl.constexpr = 64 * KCS
    pid_m, pid_n = _tile_ids(M, tl.cdiv(N, BN), BM, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    x_ptrs = x_ptr + (rm % M).to(tl.int64)[:, None] * stride_xm + rk[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kc in range(0, KC, KCS):
        if MASK_K:  # K not a multiple of the chunk: columns past K load as zeros
            xt = tl.load(x_ptrs, mask=(kc * 64 + rk < K)[None, :], other=0.0)
        else:
            xt = tl.load(x_ptrs)
        x_ptrs += BK
        w = _g4_tile(wr_ptr, sr_ptr, pid_n * RT, kc, KC, NT, RT, KCS, BCAST, SR32)
        if F32_DOT:  # the interpreter's dot reads bf16 operands as raw integers
            acc = tl.dot(xt.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
        else:
            acc = tl.dot(xt, tl.trans(w), acc)
    acc = acc * (_TWO14 / tl.load(recip_ptr))
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    yp = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _g4mm_grad_kernel(g_ptr, wr_ptr, sr_ptr, recip_ptr, y_ptr, M, N, K, KC, NT, stride_gm, stride_ym,
                      BM: tl.constexpr, RT: tl.constexpr, KCS: tl.constexpr, GROUP_M: tl.constexpr,
                      F32_DOT: tl.constexpr, BCAST: tl.constexpr = False, SR32: tl.constexpr = False):
    """gx = g @ W for one [BM, 64 KCS] tile of gx (W's row tiles are the reduction)."""
    BN: tl.constexpr = 16 * RT
    BK: tl.constexpr = 64 * KCS
    pid_m, pid_k = _tile_ids(M, tl.cdiv(K, BK), BM, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rk = pid_k * BK + tl.arange(0, BK)
    rn = tl.arange(0, BN)
    g_rows = g_ptr + tl.where(rm < M, rm, 0).to(tl.int64)[:, None] * stride_gm
    acc = tl.zeros((BM, BK), dtype=tl.float32)
    for rt in range(0, NT, RT):
        n = rt * 16 + rn
        gt = tl.load(g_rows + n[None, :], mask=(n < N)[None, :], other=0.0)
        w = _g4_tile(wr_ptr, sr_ptr, rt, pid_k * KCS, KC, NT, RT, KCS, BCAST, SR32)
        if F32_DOT:
            acc = tl.dot(gt.to(tl.float32), w.to(tl.float32), acc)
        else:
            acc = tl.dot(gt, w, acc)
    acc = acc * (_TWO14 / tl.load(recip_ptr))
    yp = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rk[None, :]
    tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rk < K)[None, :])


# ----------------------------------------------------------------------------------------------- launchers
DEFAULT = {"kind": "g4mm", "BM": 128, "RT": 8, "KCS": 1, "warps": 8, "stages": 3, "group_m": 8, "bcast": True}


def candidates() -> list[dict]:
    """Tile configs worth timing per shape (the tuner's list; the first is the default)."""
    out = [dict(DEFAULT)]
    for bm, rt, kcs, w, s in ((128, 16, 1, 8, 3), (256, 8, 1, 8, 3), (64, 8, 1, 4, 4), (128, 8, 2, 8, 3),
                              (128, 4, 2, 4, 4), (256, 16, 1, 8, 2), (128, 8, 1, 4, 4)):
        out.append({**DEFAULT, "BM": bm, "RT": rt, "KCS": kcs, "warps": w, "stages": s})
    return out


def check_call(a2: torch.Tensor, wr, sr, n: int, k: int, width: int, what: str) -> None:
    """Raise ValueError unless a2 is a [rows, width] bf16/fp16 matrix with contiguous rows and (wr, sr) a g4 weight."""
    gluon.check_g4(wr, sr, n, k, what)
    if a2.dim() != 2 or a2.shape[1] != width or a2.dtype not in (torch.bfloat16, torch.float16) or a2.stride(1) != 1:
        raise ValueError(f"{what}: needs a bf16/fp16 [rows, {width}] input with contiguous rows, got "
                         f"{a2.dtype} {tuple(a2.shape)} strides {a2.stride()}")


def _scales(sr: torch.Tensor):
    """The scale bytes as int32 words where aligned (one 4-byte load per 4 bytes, which the pipeliner can stage),
    else as bytes."""
    if sr.data_ptr() % 4 == 0 and sr.numel() % 4 == 0 and sr.is_contiguous():
        return sr.view(torch.int32), True
    return sr, False


def linear(x2, wr, sr, recip, bias, n: int, k: int, cfg: dict | None = None, out=None):
    """y = x2 @ W^T (+ bias) for a g4 weight [n, k]: x2 [M, k] bf16/fp16 with contiguous rows, recip the fp32
    global scale (1 element), bias [n] in x2's dtype or None. Inputs are not validated (see check_call)."""
    cfg = cfg or DEFAULT
    m = x2.shape[0]
    y = out if out is not None else torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    bm, rt, kcs = cfg["BM"], cfg["RT"], cfg["KCS"]
    srv, sr32 = _scales(sr)
    grid = (cdiv(m, bm) * cdiv(n, 16 * rt),)
    _g4mm_fwd_kernel[grid](x2, wr, srv, recip, bias if bias is not None else recip, y, m, n, k, cdiv(k, 64),
                           cdiv(n, 16), x2.stride(0), y.stride(0), BM=bm, RT=rt, KCS=kcs, GROUP_M=cfg["group_m"],
                           HAS_BIAS=bias is not None, F32_DOT=not x2.is_cuda, BCAST=cfg.get("bcast", True),
                           MASK_K=k % (64 * kcs) != 0, SR32=sr32, num_warps=cfg["warps"],
                           num_stages=cfg["stages"])
    return y


def grad_input(g2, wr, sr, recip, n: int, k: int, cfg: dict | None = None, out=None):
    """gx = g2 @ W for a g4 weight [n, k]: g2 [M, n] bf16/fp16 with contiguous rows. Not validated (check_call)."""
    cfg = cfg or DEFAULT
    m = g2.shape[0]
    y = out if out is not None else torch.empty((m, k), dtype=g2.dtype, device=g2.device)
    bm, kcs = cfg["BM"], cfg["KCS"]
    srv, sr32 = _scales(sr)
    grid = (cdiv(m, bm) * cdiv(k, 64 * kcs),)
    _g4mm_grad_kernel[grid](g2, wr, srv, recip, y, m, n, k, cdiv(k, 64), cdiv(n, 16), g2.stride(0), y.stride(0),
                            BM=bm, RT=cfg["RT"], KCS=kcs, GROUP_M=cfg["group_m"], F32_DOT=not g2.is_cuda,
                            BCAST=cfg.get("bcast", True), SR32=sr32, num_warps=cfg["warps"],
                            num_stages=cfg["stages"])
    return y


def reference(a2, wr, sr, recip, n: int, k: int, bias=None, grad: bool = False):
    """Torch reference (fp32): x @ W^T (+ bias) or g @ W with W the exact e2m1 * scale / global_recip."""
    from hfq_kernels.reference import fp4

    packed, scale = gluon.unrepack(wr, sr, n, k)
    w = fp4.nvfp4_dequantize(packed, scale, torch.ones((), dtype=torch.float32, device=wr.device),
                             torch.float32) / recip.float().reshape(())
    if grad:
        return a2.float() @ w
    y = a2.float() @ w.t()
    return y if bias is None else y + bias.float()
