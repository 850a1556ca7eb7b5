"""NVFP4 ops: quantize, dequantize, W4A16 linear. Registered with torch.library.

CPU runs the torch reference (hfq.formats.fp4); CUDA runs Triton (see issue: hfq_kernels).
Interface (fixed; the layouts are the canonical compressed-tensors ones):
  hfq::nvfp4_quantize(w[out,in]) -> (packed u8[out,in/2], scale f8e4m3[out,in/16], global_recip f32[1])
  hfq::nvfp4_dequantize(packed, scale, global_recip, dtype) -> [out,in]
  hfq::nvfp4_linear(x[...,in], packed, scale, global_recip, bias?) -> [...,out]  (grad flows to x only)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hfq.formats import fp4


@torch.library.custom_op("hfq::nvfp4_quantize", mutates_args=())
def nvfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return fp4.nvfp4_quantize(w)


@nvfp4_quantize.register_fake
def _(w):
    out, k = w.shape
    return (w.new_empty((out, k // 2), dtype=torch.uint8),
            w.new_empty((out, k // 16), dtype=torch.float8_e4m3fn),
            w.new_empty((1,), dtype=torch.float32))


@torch.library.custom_op("hfq::nvfp4_dequantize", mutates_args=())
def nvfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    return fp4.nvfp4_dequantize(packed, scale, global_scale, dtype)


@nvfp4_dequantize.register_fake
def _(packed, scale, global_scale, dtype):
    return packed.new_empty((packed.shape[0], packed.shape[1] * 2), dtype=dtype)


@torch.library.custom_op("hfq::nvfp4_linear", mutates_args=())
def nvfp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    w = fp4.nvfp4_dequantize(packed, scale, global_scale, x.dtype)
    return F.linear(x, w, bias)


@nvfp4_linear.register_fake
def _(x, packed, scale, global_scale, bias=None):
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


def _linear_setup(ctx, inputs, output):
    x, packed, scale, global_scale, bias = inputs
    ctx.save_for_backward(packed, scale, global_scale)
    ctx.x_dtype = x.dtype


def _linear_backward(ctx, grad):
    packed, scale, global_scale = ctx.saved_tensors
    w = torch.ops.hfq.nvfp4_dequantize(packed, scale, global_scale, grad.dtype)
    return grad @ w, None, None, None, None


nvfp4_linear.register_autograd(_linear_backward, setup_context=_linear_setup)
