"""QFT's INT8 kernels: the dense + sparse weight decoded for the GEMMs and INT8 gradients quantized straight from
the backward (QLion's step on these formats: hfq_kernels/qlion.py).

Formats (exact layout: hfq_kernels/reference/intq.py): per-row asymmetric INT8, value = (code - zero) * scale, with
fp32 scales [R,1] and uint8 zeros [R,1]; dense + sparse weights add bf16 outliers as (flat int32 index, value) pairs
whose dense code is the zero point (value exactly 0).

  int8_dequantize(codes, scales, zeros, sparse_idx, sparse_val, dtype)   -> [R,C] weight for cuBLAS
  int8_quantize_rows_(g, codes, scales, zeros, accumulate)               INT8 gradient (+ accumulation), in place

Why dequantize + cuBLAS for the linear (and not a GEMM that decodes inside its K loop): the outliers (1% of the
elements, unstructured) cannot be added inside a tensor-core tile without densifying them there, and applied as a
separate sparse product they cost M x nnz scattered multiply-adds, about the dense GEMM's own time at M = 2048 on
7B shapes. Decoding the whole weight reads 1 byte and writes 2 per element (~60 us for 4096 x 11008 on an H100),
a fraction of the GEMM it feeds; the bf16 weight is a per-call temporary of one layer.

Arithmetic follows the references op for op, compiled without FMA contraction; a row's codes are x * (1 / scale) with
the reciprocal (IEEE division) once per row, as the reference computes them; RTN codes equal the reference's on CPU (tests/test_qft_kernels.py).
"""
from __future__ import annotations

import torch

from hfq_kernels._triton import HAS_TRITON, INTERPRET, f32_to_bf16_rne, tl, triton  # noqa: F401
from hfq_kernels.reference.fp8 import MIN_SCALE

_MIN_SCALE = tl.constexpr(MIN_SCALE) if HAS_TRITON else MIN_SCALE

# kernel -> (elements per inner step of a row program, warps); benchmarks/qft_kernels.py --sweep times the choices
LAUNCH = {"decode": (2048, 4), "quant": (1024, 4)}
OB = 64  # outliers per inner step of a row program
ONE_PASS_MAX = 16384  # INT8 gradient rows up to this length are read once (kept in registers); 0: always two passes


def kernels_usable(t: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on `t`'s device: CUDA, or CPU under TRITON_INTERPRET=1."""
    return HAS_TRITON and (t.is_cuda or (t.device.type == "cpu" and INTERPRET))


@triton.jit
def _rint(x):
    """Nearest-even integer of |x| < 2^22 (float32), as torch.round."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _qparams(lo, hi):
    """Row scale and zero point from the row range (lo <= 0 <= hi), as reference.intq.quantize_int_asym."""
    s = tl.where(hi > lo, tl.maximum(tl.div_rn(hi - lo, 255.0), _MIN_SCALE), 1.0)
    return s, tl.minimum(tl.maximum(_rint(tl.div_rn(-lo, s)), 0.0), 255.0)


@triton.jit
def _store_cast(ptr, v, mask, OUT_BF16: tl.constexpr):
    if OUT_BF16:
        tl.store(ptr, f32_to_bf16_rne(v), mask=mask)
    else:
        tl.store(ptr, v.to(ptr.dtype.element_ty), mask=mask)


# ---- decode ---------------------------------------------------------------------------------------------------
def int8_dequantize(codes, scales, zeros, sparse_idx=None, sparse_val=None, dtype=torch.bfloat16) -> torch.Tensor:
    """(codes - zeros) * scales per row, then the outliers written over their (zero-valued) dense positions;
    through the torch.library op hfq::int8_dequantize (Triton on CUDA / under the interpreter, else the torch
    reference), so torch.compile sees one opaque op."""
    if sparse_idx is None:
        sparse_idx = torch.empty(0, dtype=torch.int32, device=codes.device)
        sparse_val = torch.empty(0, dtype=torch.bfloat16, device=codes.device)
    if kernels_usable(codes) and not torch.compiler.is_compiling():  # eager: skip the op's dispatch (~100 us)
        return int8_dequantize_triton(codes, scales, zeros, sparse_idx, sparse_val, dtype)
    return torch.ops.hfq.int8_dequantize(codes, scales, zeros, sparse_idx, sparse_val, dtype)


@torch.library.custom_op("hfq::int8_dequantize", mutates_args=())
def _int8_dequantize_op(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, sparse_idx: torch.Tensor,
                        sparse_val: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if kernels_usable(codes):
        return int8_dequantize_triton(codes, scales, zeros, sparse_idx, sparse_val, dtype)
    from hfq_kernels.reference.intq import dequantize_dense_sparse

    return dequantize_dense_sparse(codes, scales, zeros, sparse_idx, sparse_val, dtype)


@_int8_dequantize_op.register_fake
def _(codes, scales, zeros, sparse_idx, sparse_val, dtype):
    return codes.new_empty(codes.shape, dtype=dtype)


@triton.jit
def _dequant_rows_kernel(codes, scales, zeros, sidx, sval, rowptr, out, C, BLOCK: tl.constexpr, OB: tl.constexpr,
                         OUT_BF16: tl.constexpr):
    """One row per program: the dense part, then the row's outliers (a segment of the sorted index list) over it."""
    row = tl.program_id(0).to(tl.int64)
    base = row * C
    s = tl.load(scales + row)
    z = tl.load(zeros + row).to(tl.float32)
    for k in range(0, C, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        mask = offs < C
        c = tl.load(codes + base + offs, mask=mask, other=0).to(tl.float32)
        _store_cast(out + base + offs, (c - z) * s, mask, OUT_BF16)
    tl.debug_barrier()  # the outliers replace dense values written above by other threads
    end = tl.load(rowptr + row + 1)
    for j0 in range(tl.load(rowptr + row), end, OB):
        j = j0 + tl.arange(0, OB)
        jmask = j < end
        pos = tl.load(sidx + j, mask=jmask, other=0).to(tl.int64)
        _store_cast(out + pos, tl.load(sval + j, mask=jmask, other=0.0).to(tl.float32), jmask, OUT_BF16)


def set_row_segments(sparse_idx: torch.Tensor, rows: int, cols: int, ptr: torch.Tensor) -> None:
    """Record `ptr` (int32 [rows+1], known to its producer, e.g. the QLion step that wrote the list) as the row
    segments of sparse_idx as it is now, so row_segments does not search for them."""
    sparse_idx._hfq_rowptr = ((sparse_idx._version, sparse_idx.data_ptr(), sparse_idx.numel(), rows, cols), ptr)


def row_segments(sparse_idx: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """int32 [rows+1]: where each row's outliers start in the sorted flat index list. Cached on the index tensor
    until it changes (its version, storage or length), so a weight's decodes between optimizer steps share it."""
    key = (sparse_idx._version, sparse_idx.data_ptr(), sparse_idx.numel(), rows, cols)
    cached = getattr(sparse_idx, "_hfq_rowptr", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    bounds = torch.arange(rows + 1, dtype=torch.int32, device=sparse_idx.device) * cols
    ptr = torch.searchsorted(sparse_idx, bounds).to(torch.int32)
    sparse_idx._hfq_rowptr = (key, ptr)
    return ptr


def int8_dequantize_triton(codes, scales, zeros, sparse_idx, sparse_val, dtype=torch.bfloat16) -> torch.Tensor:
    """Host launcher of the decode (CUDA, or CPU tensors under TRITON_INTERPRET=1): one launch, a row per program.
    sparse_idx must be sorted (as every hfq writer leaves it)."""
    rows, cols = codes.shape
    out = torch.empty((rows, cols), dtype=dtype, device=codes.device)
    if out.numel() == 0:
        return out
    ptr = row_segments(sparse_idx, rows, cols)
    block, warps = LAUNCH["decode"]
    _dequant_rows_kernel[(rows,)](codes, scales, zeros, sparse_idx, sparse_val, ptr, out, cols, BLOCK=block, OB=OB,
                                  OUT_BF16=dtype == torch.bfloat16, num_warps=warps)
    return out


# ---- INT8 gradients ---------------------------------------------------------------------------------------------
@triton.jit
def _grad_value(g, codes, so, zo, offs, mask, ACC: tl.constexpr):
    """Cleaned float gradient (NaN/Inf -> 0) plus, when accumulating, the stored INT8 value."""
    x = tl.load(g + offs, mask=mask, other=0.0).to(tl.float32)
    ok = (x == x) & (tl.abs(x) != float("inf"))
    x = tl.where(ok, x, 0.0)
    if ACC:
        x = x + (tl.load(codes + offs, mask=mask, other=0).to(tl.float32) - zo) * so
    return x, ok | ~mask


@triton.jit
def _row_range(g, codes, so, zo, base, C, BLOCK: tl.constexpr, ACC: tl.constexpr):
    """(lo, hi, all finite) of a row's values (0 included in the range), one block at a time."""
    lo = tl.zeros((BLOCK,), tl.float32)
    hi = tl.zeros((BLOCK,), tl.float32)
    ok = tl.full((BLOCK,), 1, tl.int1)
    for k in range(0, C, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        mask = offs < C
        x, fin = _grad_value(g, codes, so, zo, base + offs, mask, ACC)
        lo = tl.minimum(lo, tl.where(mask, x, 0.0))
        hi = tl.maximum(hi, tl.where(mask, x, 0.0))
        ok = ok & fin
    return tl.min(lo, 0), tl.max(hi, 0), tl.min(ok.to(tl.int32), 0)


@triton.jit
def _quant_rows_kernel(g, codes, scales, zeros, finite, C, ACC: tl.constexpr, BLOCK: tl.constexpr,
                       ONE_PASS: tl.constexpr):
    """A row per program: its range, then its codes. ONE_PASS (BLOCK >= C): the row is read once and kept in
    registers between the two (3 bytes per element moved instead of 5)."""
    row = tl.program_id(0).to(tl.int64)
    base = row * C
    so = tl.load(scales + row)
    zo = tl.load(zeros + row).to(tl.float32)
    if ONE_PASS:
        offs = tl.arange(0, BLOCK)
        mask = offs < C
        x, fin = _grad_value(g, codes, so, zo, base + offs, mask, ACC)
        lo = tl.minimum(tl.min(tl.where(mask, x, 0.0), 0), 0.0)
        hi = tl.maximum(tl.max(tl.where(mask, x, 0.0), 0), 0.0)
        ok = tl.min((fin | ~mask).to(tl.int32), 0)
    else:
        lo, hi, ok = _row_range(g, codes, so, zo, base, C, BLOCK, ACC)
    s = tl.where(hi > lo, tl.maximum(tl.div_rn(hi - lo, 255.0), _MIN_SCALE), 1.0)
    z = tl.minimum(tl.maximum(_rint(tl.div_rn(-lo, s)), 0.0), 255.0)
    r = tl.div_rn(1.0, s)
    if ONE_PASS:
        q = tl.minimum(tl.maximum(_rint(x * r) + z, 0.0), 255.0)
        tl.debug_barrier()  # with ACC every thread has read its old codes before any are replaced
        tl.store(codes + base + offs, q.to(tl.uint8), mask=mask)
    else:
        for k in range(0, C, BLOCK):
            offs = k + tl.arange(0, BLOCK)
            mask = offs < C
            x, fin = _grad_value(g, codes, so, zo, base + offs, mask, ACC)
            q = tl.minimum(tl.maximum(_rint(x * r) + z, 0.0), 255.0)
            tl.store(codes + base + offs, q.to(tl.uint8), mask=mask)
    tl.store(scales + row, s)
    tl.store(zeros + row, z.to(tl.uint8))
    tl.store(finite + row, ok.to(tl.int8))


def int8_quantize_rows_(g, codes, scales, zeros, accumulate: bool = False) -> torch.Tensor:
    """Per-row asymmetric INT8 (RTN) of g [R,C] (NaN/Inf counted as 0) into codes/scales/zeros, in place; with
    `accumulate` the stored value is added first (QFT's INT8 gradient accumulation). Returns a device bool: all
    elements of g finite."""
    rows, cols = codes.shape
    g = g.reshape(rows, cols)
    if not g.is_contiguous():
        g = g.contiguous()
    finite = torch.empty(rows, dtype=torch.int8, device=codes.device)
    if rows and cols:
        block, warps = LAUNCH["quant"]
        one = cols <= ONE_PASS_MAX
        if one:  # the whole row in one block, ~32 elements per thread
            block = max(16, triton.next_power_of_2(cols))
            warps = max(1, min(16, block // 1024))
        _quant_rows_kernel[(rows,)](g, codes, scales, zeros, finite, cols, ACC=bool(accumulate), BLOCK=block,
                                    ONE_PASS=one, num_warps=warps, enable_fp_fusion=False)
    return finite.bool().all()
