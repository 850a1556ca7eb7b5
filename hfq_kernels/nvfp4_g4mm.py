"""NVFP4 W4A16 matmuls that dequantize the g4 layout inside the GEMM (Triton), for M > 64 (prefill, training).

The alternative, `dequantize_g4` + cuBLAS, writes and re-reads a full bf16 copy of the weight on every call
(~66 us per 3584x18944 weight on an H100, the forward and again for grad-input). Here each program decodes the
[rows, 64] slabs of the weight it needs straight from the int32 words into registers and feeds `tl.dot`:

- `g4mm_linear`:      y[M, N] = x[M, K] @ W^T (+ bias); program = BM tokens x BN weight rows, K in 64-wide chunks
- `g4mm_grad_input`:  dx[M, K] = g[M, N] @ W;      program = BM tokens x 64 input columns, N in BN-row steps

Each decoded value is the dequantize's exact value (e2m1 * scale / global_recip, rounded once to x's dtype), so
the result equals dequantize + matmul up to the order of the fp32 sums. References: `g4mm_linear_ref`,
`g4mm_grad_input_ref` (torch, through the g4 reference dequantize). The layout is documented in nvfp4_gluon.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hfq_kernels._triton import INTERPRET, BoundLaunch, cdiv, tl, triton
from hfq_kernels.nvfp4_gluon import dequantize_g4_ref, g4_decode_words

DEFAULT = dict(BM=64, BN=64, warps=4, stages=2)  # forward: tokens x weight rows per program
DEFAULT_GRAD = dict(BM=64, BN=64, warps=4, stages=2)  # grad-input: tokens per program, weight rows per step


@triton.jit
def _g4_slab(wr_ptr, sr_ptr, recip, rows, kc, KC, N, BR: tl.constexpr):
    """Weight rows `rows` ([BR]) x columns 64 kc .. 64 kc + 63 of a g4 weight as fp32 [BR, 64]: the dequantize's
    values before rounding (rows >= N read as 0)."""
    q = tl.arange(0, 8)  # the chunk's 8-column groups: c = q // 2, wsub = q % 2
    r16 = rows % 16
    hrow = (r16 // 8)[:, None]
    lane = (4 * (r16 % 8))[:, None] + (q // 2)[None, :]  # 4 g + c
    base = (((rows // 16)[:, None] * KC + kc) * 32 + lane).to(tl.int64)
    ok = (rows < N)[:, None] & (q < 8)[None, :]
    word = tl.load(wr_ptr + base * 4 + 2 * hrow + (q % 2)[None, :], mask=ok, other=0)
    sb = tl.load(sr_ptr + base * 2 + hrow, mask=ok, other=0)
    return g4_decode_words(word, sb, recip, BR, 64)


@triton.jit
def _rounded(v, dt: tl.constexpr):
    """fp32 -> the activations' dtype, as the dequantize rounds (bf16: round-to-nearest-even on the bits)."""
    if dt == tl.bfloat16:  # rounded on the fp32 bits, then an exact cast (no int16 bitcast: the interpreter's
        b = v.to(tl.int32, bitcast=True)  # tl.dot reads bitcast bf16 as integers)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        return b.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return v.to(dt)


@triton.jit
def _g4mm_kernel(x_ptr, wr_ptr, sr_ptr, recip_ptr, b_ptr, y_ptr, M, N, K, KC, sxm, sym,
                 HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    rm = pid_m * BM + tl.arange(0, BM)
    cols = tl.arange(0, 64)
    recip = tl.load(recip_ptr)
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros([BM, BN], tl.float32)
    for kc in range(0, KC):
        w = _rounded(_g4_slab(wr_ptr, sr_ptr, recip, rows, kc, KC, N, BN), dt)
        kk = kc * 64 + cols
        x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * sxm + kk[None, :], mask=(rm < M)[:, None] & (kk < K)[None, :],
                    other=0.0)
        if IEEE:  # fp32 activations, or the interpreter (its bf16/fp16 dot is wrong): fp32 products of the same values
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * sym + rows[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm < M)[:, None] & (rows < N)[None, :])


@triton.jit
def _g4mm_grad_kernel(g_ptr, wr_ptr, sr_ptr, recip_ptr, dx_ptr, M, N, K, KC, sgm, sdm,
                      IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    kc = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = tl.arange(0, BN)
    recip = tl.load(recip_ptr)
    dt = g_ptr.dtype.element_ty
    acc = tl.zeros([BM, 64], tl.float32)
    for n0 in range(0, N, BN):
        rows = n0 + rn
        w = _rounded(_g4_slab(wr_ptr, sr_ptr, recip, rows, kc, KC, N, BN), dt)
        g = tl.load(g_ptr + rm.to(tl.int64)[:, None] * sgm + rows[None, :], mask=(rm < M)[:, None] & (rows < N)[None, :],
                    other=0.0)
        if IEEE:
            acc += tl.dot(g.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(g, w)
    kk = kc * 64 + tl.arange(0, 64)
    tl.store(dx_ptr + rm.to(tl.int64)[:, None] * sdm + kk[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=(rm < M)[:, None] & (kk < K)[None, :])


def _check(x2, wr, n, k, what):
    if x2.dim() != 2 or x2.stride(-1) != 1:
        raise ValueError(f"{what}: x must be 2-D with a contiguous last dim, got shape {tuple(x2.shape)}, "
                         f"strides {x2.stride()}")
    if x2.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{what}: x dtype {x2.dtype} not supported (bfloat16, float16, float32)")
    if x2.device != wr.device:
        raise ValueError(f"{what}: x is on {x2.device}, the weight on {wr.device}")


def linear_launcher(m: int, n: int, k: int, has_bias: bool, dtype: torch.dtype, cfg: dict | None = None):
    """run(x2, wr, sr, recip, bias, y) for one (M, N, K, dtype): grid and meta-parameters fixed, launch bound."""
    cfg = {**DEFAULT, **(cfg or {})}
    grid = (cdiv(n, cfg["BN"]), cdiv(m, cfg["BM"]))
    meta = dict(HAS_BIAS=has_bias, IEEE=dtype == torch.float32 or INTERPRET, BM=cfg["BM"], BN=cfg["BN"],
                num_warps=cfg["warps"], num_stages=cfg["stages"])
    bound = BoundLaunch(_g4mm_kernel, grid, meta)
    kc = cdiv(k, 64)

    def run(x2, wr, sr, recip, bias, y):
        bound(x2, wr, sr, recip, bias if bias is not None else recip, y, m, n, k, kc, x2.stride(0), y.stride(0))
        return y

    return run


def grad_launcher(m: int, n: int, k: int, dtype: torch.dtype, cfg: dict | None = None):
    """run(g2, wr, sr, recip, dx) for one (M, N, K, dtype)."""
    cfg = {**DEFAULT_GRAD, **(cfg or {})}
    kc = cdiv(k, 64)
    grid = (kc, cdiv(m, cfg["BM"]))
    meta = dict(IEEE=dtype == torch.float32 or INTERPRET, BM=cfg["BM"], BN=cfg["BN"], num_warps=cfg["warps"],
                num_stages=cfg["stages"])
    bound = BoundLaunch(_g4mm_grad_kernel, grid, meta)

    def run(g2, wr, sr, recip, dx):
        bound(g2, wr, sr, recip, dx, m, n, k, kc, g2.stride(0), dx.stride(0))
        return dx

    return run


def g4mm_linear(x2, wr, sr, recip, n: int, k: int, bias=None, cfg: dict | None = None):
    """y = x2 @ dequant(W)^T (+ bias), x2 [M, K] (contiguous rows), recip the fp32 global-scale tensor."""
    _check(x2, wr, n, k, "g4mm_linear")
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    if m == 0:
        return y
    return linear_launcher(m, n, k, bias is not None, x2.dtype, cfg)(x2, wr, sr, recip, bias, y)


def g4mm_grad_input(g2, wr, sr, recip, n: int, k: int, cfg: dict | None = None):
    """dx = g2 @ dequant(W), g2 [M, N] (contiguous rows)."""
    _check(g2, wr, n, k, "g4mm_grad_input")
    if g2.shape[1] != n:
        raise ValueError(f"g4mm_grad_input: grad has {g2.shape[1]} features but the weight has {n} rows")
    m = g2.shape[0]
    dx = torch.empty((m, k), dtype=g2.dtype, device=g2.device)
    if m == 0:
        return dx
    return grad_launcher(m, n, k, g2.dtype, cfg)(g2, wr, sr, recip, dx)


def g4mm_linear_ref(x2, wr, sr, recip, n: int, k: int, bias=None):
    """Torch reference: F.linear on the reference dequantize (in x's dtype)."""
    w = dequantize_g4_ref(wr.cpu(), sr.cpu(), recip.cpu(), n, k, x2.dtype).to(x2.device)
    return F.linear(x2, w, bias)


def g4mm_grad_input_ref(g2, wr, sr, recip, n: int, k: int):
    """Torch reference of g4mm_grad_input."""
    return g2 @ dequantize_g4_ref(wr.cpu(), sr.cpu(), recip.cpu(), n, k, g2.dtype).to(g2.device)
