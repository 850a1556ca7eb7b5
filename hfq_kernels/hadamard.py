"""Block-diagonal normalised Walsh-Hadamard transform along the last dim (Triton + torch reference).

The kernel multiplies each [BM, B] tile by the +-1 Sylvester matrix on the tensor cores (tl.dot; +-1
is exact in bf16/fp16, products are exact, sums in fp32) and scales by 1/sqrt(B) in fp32. At B = 128
that is 256 flop per element against 4 bytes moved (bf16), under the H100 ridge point, so the kernel
is bandwidth-bound like a copy. The +-1 matrix is generated in registers from the parity of i & j.

Op: hfq::hadamard(x[..., K], block) -> HT(x) (same dtype; CPU = hfq_kernels.reference.hadamard.fwht; the
transform is its own inverse, so it is also its own backward).
"""
from __future__ import annotations

import torch

from hfq_kernels._triton import on_gpu, tl, triton
from hfq_kernels.reference.hadamard import DEFAULT_BLOCK, effective_block, fwht

MIN_TRITON_BLOCK = 16  # tl.dot needs tiles of at least 16
MAX_TRITON_BLOCK = 256


@triton.jit
def hadamard_tile(B: tl.constexpr, dtype: tl.constexpr):
    """The unnormalised B x B Sylvester matrix: H[i, j] = (-1)^popcount(i & j), B <= 256."""
    i = tl.arange(0, B)
    v = i[:, None] & i[None, :]
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    return (1.0 - 2.0 * (v & 1).to(tl.float32)).to(dtype)


@triton.jit
def _fwht_kernel(x_ptr, y_ptr, R, K, inv_sqrt_b,
                 B: tl.constexpr, BM: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * B + tl.arange(0, B)
    offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
    m = (rows < R)[:, None]
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    if IEEE:  # fp32 input, or the CPU interpreter (its bf16 dot is wrong): exact fp32 products
        acc = tl.dot(x.to(tl.float32), hadamard_tile(B, tl.float32), input_precision="ieee")
    else:
        acc = tl.dot(x, hadamard_tile(B, x.dtype))
    tl.store(y_ptr + offs, (acc * inv_sqrt_b).to(y_ptr.dtype.element_ty), mask=m)


def use_ieee(x: torch.Tensor) -> bool:
    """fp32 dot for fp32 inputs and on CPU tensors (TRITON_INTERPRET computes bf16 dots wrongly)."""
    return x.dtype == torch.float32 or not x.is_cuda


def _rows_per_tile(dtype: torch.dtype, block: int) -> int:
    return 32 if (dtype == torch.float32 or block > 128) else 64


def triton_supported(x: torch.Tensor, block: int) -> bool:
    return (MIN_TRITON_BLOCK <= block <= MAX_TRITON_BLOCK
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16))


def hadamard_triton(x: torch.Tensor, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """Host launcher (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    K = x.shape[-1]
    b = effective_block(K, block)
    if not triton_supported(x, b):
        return fwht(x, b)
    x2 = x.reshape(-1, K).contiguous()
    R = x2.shape[0]
    y = torch.empty_like(x2)
    bm = _rows_per_tile(x.dtype, b)
    grid = (triton.cdiv(R, bm), K // b)
    _fwht_kernel[grid](x2, y, R, K, b ** -0.5, B=b, BM=bm, IEEE=use_ieee(x),
                       num_warps=4)
    return y.reshape(x.shape)


@torch.library.custom_op("hfq::hadamard", mutates_args=())
def hadamard(x: torch.Tensor, block: int) -> torch.Tensor:
    if on_gpu(x):
        return hadamard_triton(x, block)
    return fwht(x, block)


@hadamard.register_fake
def _(x, block):
    effective_block(x.shape[-1], block)
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.block = inputs[1]


def _backward(ctx, grad):
    return torch.ops.hfq.hadamard(grad, ctx.block), None


hadamard.register_autograd(_backward, setup_context=_setup)
