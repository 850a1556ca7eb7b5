"""QFT's INT8 kernels: the dense + sparse weight decoded for the GEMMs, INT8 gradients quantized straight from the
backward, and the QLion step on INT8 weights and INT8 momentum.

Formats (exact layout: hfq_kernels/reference/intq.py): per-row asymmetric INT8, value = (code - zero) * scale, with
fp32 scales [R,1] and uint8 zeros [R,1]; dense + sparse weights add bf16 outliers as (flat int32 index, value) pairs
whose dense code is the zero point (value exactly 0).

  int8_dequantize(codes, scales, zeros, sparse_idx, sparse_val, dtype)   -> [R,C] weight for cuBLAS
  int8_quantize_rows_(g, codes, scales, zeros, accumulate)               INT8 gradient (+ accumulation), in place
  qlion_dense_sparse_step_(...)                                          QLion on an int8_dense_sparse weight

Why dequantize + cuBLAS for the linear (and not a GEMM that decodes inside its K loop): the outliers (1% of the
elements, unstructured) cannot be added inside a tensor-core tile without densifying them there, and applied as a
separate sparse product they cost M x nnz scattered multiply-adds, about the dense GEMM's own time at M = 2048 on
7B shapes. Decoding the whole weight reads 1 byte and writes 2 per element (~60 us for 4096 x 11008 on an H100),
a fraction of the GEMM it feeds; the bf16 weight is a per-call temporary of one layer.

The QLion step runs two passes per row (one program per row): statistics (new row range of the dense weight and of
the momentum, count of elements that cross the outlier thresholds), then the update and its quantization; the row's
new scale and zero point come from the same formulas as the reference in between. Outliers that were outliers
before are updated on the host side (a gather of nnz elements): the kernel sees them as dense zeros. Arithmetic
follows the reference op for op, compiled without FMA contraction, IEEE divisions; RTN codes equal the reference's
(tests/test_qft_kernels.py). SR draws come from Philox (tl.rand) keyed by a seed per step and weight.
"""
from __future__ import annotations

import torch

from hfq_kernels._triton import HAS_TRITON, INTERPRET, f32_to_bf16_rne, tl, triton  # noqa: F401

# kernel -> (elements per inner step of a row program, warps); benchmarks/qft_kernels.py --sweep times the choices
LAUNCH = {"decode": (2048, 4), "quant": (1024, 4), "stats": (1024, 8), "write": (1024, 8), "plain": (1024, 8)}
OB = 64  # outliers per inner step of a row program


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
    s = tl.where(hi > lo, tl.div_rn(hi - lo, 255.0), 1.0)
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
def _quant_rows_kernel(g, codes, scales, zeros, finite, C, ACC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * C
    so = tl.load(scales + row)
    zo = tl.load(zeros + row).to(tl.float32)
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
    lo = tl.min(lo, 0)
    hi = tl.max(hi, 0)
    s = tl.where(hi > lo, tl.div_rn(hi - lo, 255.0), 1.0)
    z = tl.minimum(tl.maximum(_rint(tl.div_rn(-lo, s)), 0.0), 255.0)
    for k in range(0, C, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        mask = offs < C
        x, fin = _grad_value(g, codes, so, zo, base + offs, mask, ACC)
        q = tl.minimum(tl.maximum(_rint(tl.div_rn(x, s)) + z, 0.0), 255.0)
        tl.store(codes + base + offs, q.to(tl.uint8), mask=mask)
    tl.store(scales + row, s)
    tl.store(zeros + row, z.to(tl.uint8))
    tl.store(finite + row, tl.min(ok.to(tl.int32), 0).to(tl.int8))


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
        _quant_rows_kernel[(rows,)](g, codes, scales, zeros, finite, cols, ACC=bool(accumulate), BLOCK=block,
                                    num_warps=warps,
                                    enable_fp_fusion=False)
    return finite.bool().all()


# ---- QLion on int8_dense_sparse -------------------------------------------------------------------------------
@triton.jit
def _int8_at(c, s, z, offs, row, mask):
    return (tl.load(c + offs, mask=mask, other=0).to(tl.float32) - tl.load(z + row).to(tl.float32)) * tl.load(s + row)


@triton.jit
def _direction(m, gv, b1, omb1):
    c = m * b1 + gv * omb1
    return tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))


@triton.jit
def _lion_move(w, g, gs, gz, mc, ms, mz, offs, mask, row, decay, lr, b1, omb1, G_INT8: tl.constexpr):
    """Lion's update of the weight values w at `offs` (decay, then -lr * direction); also returns the gradient and
    momentum read there, float32."""
    if G_INT8:
        gv = _int8_at(g, gs, gz, offs, row, mask)
    else:
        gv = tl.load(g + offs, mask=mask, other=0.0).to(tl.float32)
    m = _int8_at(mc, ms, mz, offs, row, mask)
    w = w * decay
    w = w - _direction(m, gv, b1, omb1) * lr
    return w, gv, m


@triton.jit
def _lion_values(wc, ws, wz, g, gs, gz, mc, ms, mz, offs, mask, row, decay, lr, b1, omb1, b2, omb2,
                 G_INT8: tl.constexpr):
    """Updated dense weight (float32; old outlier positions are dense zeros) and updated momentum at `offs`."""
    w, gv, m = _lion_move(_int8_at(wc, ws, wz, offs, row, mask), g, gs, gz, mc, ms, mz, offs, mask, row, decay, lr,
                          b1, omb1, G_INT8)
    m = m * b2
    m = m + gv * omb2
    return w, m


@triton.jit
def _outlier_values(sidx, sval, j, jmask, g, gs, gz, mc, ms, mz, row, t0, t1, decay, lr, b1, omb1,
                    G_INT8: tl.constexpr):
    """Row `row`'s old outliers j: (flat index, updated value, stays outside the thresholds)."""
    pos = tl.load(sidx + j, mask=jmask, other=0).to(tl.int64)
    v, _, _ = _lion_move(tl.load(sval + j, mask=jmask, other=0.0).to(tl.float32), g, gs, gz, mc, ms, mz, pos, jmask,
                         row, decay, lr, b1, omb1, G_INT8)
    return pos, v, ((v < t0) | (v > t1)) & jmask


@triton.jit
def _qlion_stats_kernel(wc, ws, wz, g, gs, gz, mc, ms, mz, thr, sidx, sval, rowptr, vbuf, stats, counts, C, decay, lr,
                        b1, omb1, b2, omb2, G_INT8: tl.constexpr, BLOCK: tl.constexpr, OB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * C
    t0 = tl.load(thr)
    t1 = tl.load(thr + 1)
    wlo = tl.zeros((BLOCK,), tl.float32)
    whi = tl.zeros((BLOCK,), tl.float32)
    mlo = tl.zeros((BLOCK,), tl.float32)
    mhi = tl.zeros((BLOCK,), tl.float32)
    n = tl.zeros((BLOCK,), tl.int32)
    for k in range(0, C, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        mask = offs < C
        w, m = _lion_values(wc, ws, wz, g, gs, gz, mc, ms, mz, base + offs, mask, row, decay, lr, b1, omb1, b2, omb2,
                            G_INT8)
        out = ((w < t0) | (w > t1)) & mask
        dense = tl.where(out | ~mask, 0.0, w)
        wlo = tl.minimum(wlo, dense)
        whi = tl.maximum(whi, dense)
        m = tl.where(mask, m, 0.0)
        mlo = tl.minimum(mlo, m)
        mhi = tl.maximum(mhi, m)
        n += out.to(tl.int32)
    lo = tl.min(wlo, 0)
    hi = tl.max(whi, 0)
    n_all = tl.sum(n, 0)
    for j0 in range(tl.load(rowptr + row), tl.load(rowptr + row + 1), OB):  # old outliers of this row
        j = j0 + tl.arange(0, OB)
        jmask = j < tl.load(rowptr + row + 1)
        pos, v, stay = _outlier_values(sidx, sval, j, jmask, g, gs, gz, mc, ms, mz, row, t0, t1, decay, lr, b1, omb1,
                                       G_INT8)
        tl.store(vbuf + j, v, mask=jmask)  # the write pass reads it: by then the momentum codes are new
        back = tl.where(stay | ~jmask, 0.0, v)  # returning to the dense part: in the row's range
        lo = tl.minimum(lo, tl.min(back, 0))
        hi = tl.maximum(hi, tl.max(back, 0))
        n_all += tl.sum(stay.to(tl.int32), 0)
    s_w, z_w = _qparams(lo, hi)
    s_m, z_m = _qparams(tl.min(mlo, 0), tl.max(mhi, 0))
    tl.store(stats + row * 4, s_w)
    tl.store(stats + row * 4 + 1, z_w)
    tl.store(stats + row * 4 + 2, s_m)
    tl.store(stats + row * 4 + 3, z_m)
    tl.store(counts + row * 2, n_all)
    tl.store(counts + row * 2 + 1, tl.sum(n, 0))  # of which dense elements crossing the thresholds


@triton.jit
def _append(new_idx, new_val, at, sel, pos, v):
    """Write the selected (flat index, bf16 value) pairs at `at`, in order; returns the next free slot."""
    k = tl.sum(sel.to(tl.int32), 0)
    if k > 0:
        slot = at + tl.cumsum(sel.to(tl.int32), 0) - 1
        tl.store(new_idx + slot, pos.to(tl.int32), mask=sel)
        tl.store(new_val + slot, f32_to_bf16_rne(v), mask=sel)
    return at + k


@triton.jit
def _qlion_write_kernel(wc, ws, wz, g, gs, gz, mc, ms, mz, thr, sidx, sval, rowptr, vbuf, qs, counts, offsets, new_idx,
                        new_val, C, decay, lr, b1, omb1, b2, omb2, seed, G_INT8: tl.constexpr, SR: tl.constexpr,
                        BLOCK: tl.constexpr, OB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * C
    t0 = tl.load(thr)
    t1 = tl.load(thr + 1)
    s_w = tl.load(qs + row * 4)
    z_w = tl.load(qs + row * 4 + 1)
    s_m = tl.load(qs + row * 4 + 2)
    z_m = tl.load(qs + row * 4 + 3)
    at = tl.load(offsets + row)
    n_cross = tl.load(counts + row * 2 + 1)
    for k in range(0, C, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        mask = offs < C
        w, m = _lion_values(wc, ws, wz, g, gs, gz, mc, ms, mz, base + offs, mask, row, decay, lr, b1, omb1, b2, omb2,
                            G_INT8)
        out = ((w < t0) | (w > t1)) & mask
        x = tl.div_rn(tl.where(out, 0.0, w), s_w)
        if SR:
            r = tl.floor(x + tl.rand(seed, (base + offs).to(tl.int32)))
        else:
            r = _rint(x)
        tl.store(wc + base + offs, tl.minimum(tl.maximum(r + z_w, 0.0), 255.0).to(tl.uint8), mask=mask)
        qm = tl.minimum(tl.maximum(_rint(tl.div_rn(m, s_m)) + z_m, 0.0), 255.0)
        tl.store(mc + base + offs, qm.to(tl.uint8), mask=mask)
        if n_cross > 0:  # most rows have none: no block-wide scan then
            at = _append(new_idx, new_val, at, out, base + offs, w)
    tl.debug_barrier()  # the dense codes above are written before the old outliers' codes below replace them
    for j0 in range(tl.load(rowptr + row), tl.load(rowptr + row + 1), OB):
        j = j0 + tl.arange(0, OB)
        jmask = j < tl.load(rowptr + row + 1)
        pos = tl.load(sidx + j, mask=jmask, other=0).to(tl.int64)
        v = tl.load(vbuf + j, mask=jmask, other=0.0)
        stay = ((v < t0) | (v > t1)) & jmask
        x = tl.div_rn(tl.where(stay, 0.0, v), s_w)
        if SR:
            r = tl.floor(x + tl.rand(seed, pos.to(tl.int32)))
        else:
            r = _rint(x)
        tl.store(wc + pos, tl.minimum(tl.maximum(r + z_w, 0.0), 255.0).to(tl.uint8), mask=jmask)
        at = _append(new_idx, new_val, at, stay, pos, v)
    tl.debug_barrier()  # every thread has read the old row scales before they are replaced
    tl.store(ws + row, s_w)
    tl.store(wz + row, z_w.to(tl.uint8))
    tl.store(ms + row, s_m)
    tl.store(mz + row, z_m.to(tl.uint8))


def zero_may_cross(thr: torch.Tensor, lr: float) -> bool:
    """Whether an updated dense zero (-lr, 0 or lr) can fall outside the thresholds (thresholds within lr of 0):
    the kernels see old outliers as dense zeros and would list them twice, so the caller takes the torch ops.
    Read once per thresholds version (a host sync), then cached on the tensor."""
    key = (thr._version, thr.data_ptr())
    cached = getattr(thr, "_hfq_range", None)
    if cached is None or cached[0] != key:
        t0, t1 = thr.tolist()
        cached = thr._hfq_range = (key, t0, t1)
    return not (cached[1] <= -lr and cached[2] >= lr)


def qlion_dense_sparse_begin(w: dict, grad: dict, mom: dict, *, lr: float, beta1: float, beta2: float,
                             weight_decay: float, rounding: str = "sr", seed: int = 0) -> dict:
    """First half of qlion_dense_sparse_step_ (nothing modified yet): the statistics pass (new row scales and zero
    points of weight and momentum, counts of the new outlier list).
    Returns a context whose "size" (device int64: the new outlier list's length) the caller reads, for several
    weights at once if it likes (one host sync per optimizer step), before `qlion_dense_sparse_finish`."""
    rows, cols = w["codes"].shape
    dev = w["codes"].device
    decay = 1.0 - lr * weight_decay if weight_decay else 1.0
    g_int8 = "codes" in grad
    gargs = ((grad["codes"], grad["scales"], grad["zeros"]) if g_int8
             else (grad["value"].reshape(rows, cols).contiguous(), w["scales"], w["zeros"]))
    sidx = w["sparse_idx"]  # sorted: each row's outliers are one segment
    rowptr = row_segments(sidx, rows, cols)
    stats = torch.empty((rows, 4), dtype=torch.float32, device=dev)
    counts = torch.empty((rows, 2), dtype=torch.int32, device=dev)  # new list entries, of which crossings
    vbuf = torch.empty(sidx.numel(), dtype=torch.float32, device=dev)  # the old outliers' updated values
    common = (w["codes"], w["scales"], w["zeros"], *gargs, mom["codes"], mom["scales"], mom["zeros"],
              w["thresholds"], sidx, w["sparse_val"], rowptr, vbuf)
    hyper = (decay, lr, beta1, 1.0 - beta1, beta2, 1.0 - beta2)
    block, warps = LAUNCH["stats"]
    _qlion_stats_kernel[(rows,)](*common, stats, counts, cols, *hyper, G_INT8=g_int8, BLOCK=block, OB=OB,
                                 num_warps=warps, enable_fp_fusion=False)
    return dict(w=w, mom=mom, common=common, hyper=hyper, g_int8=g_int8, rows=rows, cols=cols, qs=stats, counts=counts,
                offsets=(torch.cumsum(counts[:, 0], 0) - counts[:, 0]).to(torch.int32),
                size=counts[:, 0].sum(dtype=torch.int64), rounding=rounding, seed=int(seed) & 0x7FFFFFFF)


def qlion_dense_sparse_finish(ctx: dict, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Second half: the update pass (weight and momentum codes written in place, old outliers' codes included) and
    the new outlier list sorted by index, returned for the caller to store. n: ctx["size"] read."""
    w, qs = ctx["w"], ctx["qs"]
    new_idx = torch.empty(n, dtype=torch.int32, device=qs.device)
    new_val = torch.empty(n, dtype=torch.bfloat16, device=qs.device)
    block, warps = LAUNCH["write"]
    _qlion_write_kernel[(ctx["rows"],)](*ctx["common"], qs, ctx["counts"], ctx["offsets"], new_idx, new_val,
                                        ctx["cols"], *ctx["hyper"], ctx["seed"], G_INT8=ctx["g_int8"],
                                        SR=ctx["rounding"] == "sr", BLOCK=block, OB=OB, num_warps=warps,
                                        enable_fp_fusion=False)
    keys, order = torch.sort(new_idx)
    return keys, new_val.index_select(0, order)


def qlion_dense_sparse_step_(w: dict, grad: dict, mom: dict, *, lr: float, beta1: float, beta2: float,
                             weight_decay: float, rounding: str = "sr", seed: int = 0) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
    """One QLion step of an int8_dense_sparse weight with the thresholds kept (QFT's lazy update).

    w: codes uint8 [R,C], scales fp32 [R,1], zeros uint8 [R,1], thresholds fp32 [2], sparse_idx int32 (sorted),
    sparse_val bf16 (the weight's stored tensors; codes/scales/zeros updated in place). grad: {codes, scales,
    zeros} (INT8 gradient) or {value} (float [R,C]). mom: INT8 momentum {codes, scales, zeros}, updated in place.
    Returns the new (sparse_idx, sparse_val), sorted by index, for the caller to store (their length changes).
    One host sync (the new list's length); QLion batches it over all weights of a step (begin / finish).
    Requires not zero_may_cross(thresholds, lr)."""
    ctx = qlion_dense_sparse_begin(w, grad, mom, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                                   rounding=rounding, seed=seed)
    return qlion_dense_sparse_finish(ctx, int(ctx["size"]))


# ---- QLion on an ordinary (bf16/fp32) parameter with INT8 momentum --------------------------------------------
@triton.jit
def _lion_plain_kernel(p, g, mc, ms, mz, stats, C, decay, lr, b1, omb1, b2, omb2, WRITE: tl.constexpr,
                       HAS_DECAY: tl.constexpr, P_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """WRITE=False: the new momentum's row range into stats [R,2]. WRITE=True: the parameter updated in place (in
    its dtype, rounded after each op as torch's in-place ops do) and the momentum requantized with stats' scale and
    zero point."""
    row = tl.program_id(0).to(tl.int64)
    base = row * C
    lo = tl.zeros((BLOCK,), tl.float32)
    hi = tl.zeros((BLOCK,), tl.float32)
    if WRITE:
        s_m = tl.load(stats + row * 2)
        z_m = tl.load(stats + row * 2 + 1)
    for k in range(0, C, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        mask = offs < C
        gv = tl.load(g + base + offs, mask=mask, other=0.0).to(tl.float32)
        m = _int8_at(mc, ms, mz, base + offs, row, mask)
        if WRITE:
            w = tl.load(p + base + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_DECAY:
                w = w * decay
                if P_BF16:
                    w = f32_to_bf16_rne(w).to(tl.float32)
            w = w - _direction(m, gv, b1, omb1) * lr
            _store_cast(p + base + offs, w, mask, P_BF16)
        m = m * b2
        m = m + gv * omb2
        if WRITE:
            qm = tl.minimum(tl.maximum(_rint(tl.div_rn(m, s_m)) + z_m, 0.0), 255.0)
            tl.store(mc + base + offs, qm.to(tl.uint8), mask=mask)
        else:
            m = tl.where(mask, m, 0.0)
            lo = tl.minimum(lo, m)
            hi = tl.maximum(hi, m)
    if WRITE:
        tl.debug_barrier()  # every thread has read the old row scale before it is replaced
        tl.store(ms + row, s_m)
        tl.store(mz + row, z_m.to(tl.uint8))
    else:
        s_new, z_new = _qparams(tl.min(lo, 0), tl.max(hi, 0))
        tl.store(stats + row * 2, s_new)
        tl.store(stats + row * 2 + 1, z_new)


def lion_plain_step_(p: torch.Tensor, g: torch.Tensor, mom: dict, *, lr: float, beta1: float, beta2: float,
                     weight_decay: float) -> None:
    """QLion's step of an ordinary parameter (bf16 or fp32, updated in place) with INT8 momentum {codes [R,C],
    scales, zeros} (rows: reference.intq.as_rows), in two launches; equal to the torch ops of hfq.qft.QLion."""
    rows, cols = mom["codes"].shape
    if p.dtype not in (torch.bfloat16, torch.float32) or not p.is_contiguous():
        raise ValueError(f"lion_plain_step_: parameter must be contiguous bf16/fp32, got {p.dtype}")
    g = g.reshape(rows, cols)
    if not g.is_contiguous():
        g = g.contiguous()
    stats = torch.empty((rows, 2), dtype=torch.float32, device=p.device)
    block, warps = LAUNCH["plain"]
    args = (p, g, mom["codes"], mom["scales"], mom["zeros"], stats, cols, 1.0 - lr * weight_decay, lr, beta1,
            1.0 - beta1, beta2, 1.0 - beta2)
    meta = dict(HAS_DECAY=bool(weight_decay), P_BF16=p.dtype == torch.bfloat16, BLOCK=block, num_warps=warps,
                enable_fp_fusion=False)
    _lion_plain_kernel[(rows,)](*args, WRITE=False, **meta)
    _lion_plain_kernel[(rows,)](*args, WRITE=True, **meta)


def lion_plain_step_ref(p: torch.Tensor, g: torch.Tensor, mom: dict, *, lr: float, beta1: float, beta2: float,
                        weight_decay: float) -> None:
    """Torch reference of lion_plain_step_, one rounding per op (torch's own bf16 `sub_(alpha=lr)` on CPU rounds lr
    to bf16 first, and its fp32 `add_(alpha=)` may fuse the multiply-add: hfq.qft.QLion's torch path differs from
    this by such last bits)."""
    from hfq_kernels.reference import intq

    rows, cols = mom["codes"].shape
    m = intq.dequantize_int_asym(mom["codes"], mom["scales"], mom["zeros"])
    g = g.reshape(rows, cols).float()
    d = torch.sign(m * beta1 + g * (1 - beta1))
    w = p.reshape(rows, cols).float()
    if weight_decay:
        w = (w * (1 - lr * weight_decay)).to(p.dtype).float()
    p.copy_((w - d * lr).to(p.dtype).reshape(p.shape))
    m = m * beta2 + g * (1 - beta2)
    c, s, z = intq.quantize_int_asym(m, 8, check=False)
    mom["codes"].copy_(c)
    mom["scales"].copy_(s)
    mom["zeros"].copy_(z)


def qlion_dense_sparse_step_ref(w: dict, grad: dict, mom: dict, *, lr, beta1, beta2, weight_decay, rounding="sr",
                                seed=0, generator=None):
    """Torch reference of qlion_dense_sparse_step_ (hfq.qft.QLion's unfused update, same in/out contract)."""
    from hfq_kernels.reference import intq

    rows, cols = w["codes"].shape
    val = intq.dequantize_dense_sparse(w["codes"], w["scales"], w["zeros"], w["sparse_idx"], w["sparse_val"])
    g = (intq.dequantize_int_asym(grad["codes"], grad["scales"], grad["zeros"]) if "codes" in grad
         else grad["value"].reshape(rows, cols).float())
    m = intq.dequantize_int_asym(mom["codes"], mom["scales"], mom["zeros"])
    if weight_decay:
        val.mul_(1 - lr * weight_decay)
    val.sub_(torch.sign(m * beta1 + g * (1 - beta1)), alpha=lr)
    if rounding == "sr" and generator is None:
        generator = torch.Generator(device=val.device)
        generator.manual_seed(int(seed))
    new = intq.quantize_dense_sparse(val, w["thresholds"], rounding, generator)
    for k in ("codes", "scales", "zeros"):
        w[k].copy_(new[k])
    m.mul_(beta2).add_(g, alpha=1 - beta2)
    c, s, z = intq.quantize_int_asym(m, 8, check=False)
    mom["codes"].copy_(c)
    mom["scales"].copy_(s)
    mom["zeros"].copy_(z)
    return new["sparse_idx"], new["sparse_val"]
