"""NVFP4 with searched scales and GPTQ as torch.library ops (one torch implementation for CPU and CUDA: the search is
elementwise work over the weight and GPTQ a column loop of small updates, both plain torch on either device).

  hfq::nvfp4_quantize_search(w[out,in]) -> (packed u8[out,in/2], scale f8e4m3[out,in/16], global_recip f32[1])
  hfq::nvfp4_gptq(w[rows,in], u[in,in], recip[rows], block, search) -> (packed u8[rows,in/2], scale f8e4m3[rows,in/16])
Both are hfq_kernels.reference.fp4_calib (formats as in hfq_kernels.reference.fp4).
"""
from __future__ import annotations

import torch

from hfq_kernels.reference import fp4_calib


@torch.library.custom_op("hfq::nvfp4_quantize_search", mutates_args=())
def nvfp4_quantize_search(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return fp4_calib.nvfp4_quantize_search(w)


@nvfp4_quantize_search.register_fake
def _(w):
    out, k = w.shape
    return (w.new_empty((out, k // 2), dtype=torch.uint8), w.new_empty((out, k // 16), dtype=torch.float8_e4m3fn),
            w.new_empty((1,), dtype=torch.float32))


@torch.library.custom_op("hfq::nvfp4_gptq", mutates_args=())
def nvfp4_gptq(w: torch.Tensor, u: torch.Tensor, recip: torch.Tensor, block: int = 128,
               search: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = fp4_calib.BYTE_OFFSETS if search else (0,)
    return fp4_calib.nvfp4_gptq(w, u, recip, block, offsets)


@nvfp4_gptq.register_fake
def _(w, u, recip, block=128, search=False):
    rows, k = w.shape
    return w.new_empty((rows, k // 2), dtype=torch.uint8), w.new_empty((rows, k // 16), dtype=torch.float8_e4m3fn)


__all__ = ["nvfp4_gptq", "nvfp4_quantize_search"]
