"""Normalised fast Walsh-Hadamard transform (FWHT) along the last dim, block-diagonal: the reference.

HT(x) multiplies every contiguous block of `block` elements of the last dim by H_block / sqrt(block),
H the Sylvester Hadamard matrix (H_1 = [1], H_2n = [[H, H], [H, -H]]). It is orthogonal and symmetric,
so HT(HT(x)) == x and HT(x) @ HT(w)^T == x @ w^T when both use the same blocks.

Block size: 128 by default (QuEST's own choice). 128 divides every hidden/intermediate size of the
Llama/Qwen families (3584 = 28*128, 18944 = 148*128, 2048, 5632, ...), 7 butterfly stages spread
outliers over 128 coordinates, and a 128x128 +-1 matrix is one tensor-core tile for the Triton kernel.
A last dim that is a power of two smaller than the block uses one full-size block.
"""
from __future__ import annotations

import torch

DEFAULT_BLOCK = 128


def is_pow2(n: int) -> bool:
    return isinstance(n, int) and n > 0 and (n & (n - 1)) == 0


def check_block_size(block, field: str = "hadamard_block_size") -> None:
    if not is_pow2(block) or isinstance(block, bool):
        raise ValueError(f"{field}: must be a power of two >= 1, got {block!r}")


def effective_block(dim: int, block: int = DEFAULT_BLOCK, layer: str = "tensor") -> int:
    """The block used for a last dim of size `dim`: `block`, or `dim` itself when dim is a smaller power
    of two. Raises ValueError (naming `layer`) when the blocks cannot tile the dim."""
    check_block_size(block)
    if dim < block and is_pow2(dim):
        return dim
    if dim % block:
        raise ValueError(f"{layer}: input dim {dim} is not a multiple of hadamard_block_size={block}; "
                         f"choose a power-of-two block that divides {dim} or add the layer to "
                         f"modules_to_not_convert")
    return block


def hadamard_matrix(n: int, dtype=torch.float32, device=None, normalized: bool = True) -> torch.Tensor:
    """Sylvester Hadamard matrix H_n (n a power of two), divided by sqrt(n) when normalized."""
    check_block_size(n, "n")
    idx = torch.arange(n, device=device)
    parity = torch.zeros(n, n, dtype=torch.int64, device=device)
    v = idx[:, None] & idx[None, :]
    while bool(v.any()):
        parity ^= v & 1
        v = v >> 1
    h = (1 - 2 * parity).to(dtype)
    return h / (n ** 0.5) if normalized else h


def fwht(x: torch.Tensor, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """Block-diagonal normalised FWHT of the last dim by butterflies (float32 math, float64 kept)."""
    b = effective_block(x.shape[-1], block)
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    shape = x.shape
    y = x.to(dt).reshape(-1, shape[-1] // b, b)
    h = 1
    while h < b:
        y = y.reshape(y.shape[0], y.shape[1], b // (2 * h), 2, h)
        a, c = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + c, a - c), dim=-2)
        h *= 2
    y = y.reshape(shape) * (b ** -0.5)
    return y.to(x.dtype)


ifwht = fwht  # the normalised transform is its own inverse
