"""QLion's fused step (hfq.qft.QLion) on INT8 weights and INT8 momentum: multi-tensor Triton kernels, one launch
per pass for a whole list of tensors, so the host cost of a step does not grow with the number of weights.

  qlion_dense_sparse_begin(items, ...) -> ctx;  ctx.sync.tolist();  qlion_dense_sparse_finish(ctx, synced)
  qlion_dense_sparse_step_(w, grad, mom, ...)                  one int8_dense_sparse weight (both halves)
  lion_plain_multi_step_(params, grads, moms, ...)              ordinary bf16/fp32 parameters, INT8 momentum

Formats: hfq_kernels/reference/intq.py (per-row asymmetric INT8 codes, fp32 scales, uint8 zeros; dense + sparse
weights add bf16 outliers as sorted (flat int32 index, value) pairs whose dense code is the zero point).

Layout. The launcher writes an int64 table, one record of NF fields per weight (data pointers, shape, where the
weight's rows start in the flat statistics buffers, its SR seed) and an int32 work list (weight, row), one entry
per program: a program handles one row. The dense + sparse step runs two passes per row:
  stats: the row's updated dense values (old outliers read as dense zeros) and momentum give the new row scale
         and zero point of both; the old outliers' updated values go to a buffer; counts of the new outlier list
         (total, and dense elements crossing the thresholds);
  write: codes and momentum written with those scales; the new outliers appended at the row's offset (an inclusive
         cumsum over all rows of all weights) and, where a row has both kinds, its segment sorted in the program
         (keys (index << 16 | bf16 bits)); the new list's row segments are written too (the next step and the
         decode read them instead of searching the list).
Between the passes one host sync per step reads every weight's new list length (to allocate the lists).
Arithmetic follows the references op for op, compiled without FMA contraction; codes are x * (1 / scale), the
reciprocal (IEEE division) once per row as reference.intq computes it; RTN results equal the references' on CPU
(tests/test_qft_kernels.py). SR draws: a 24-bit uniform per element from a 32-bit integer hash (murmur3's finalizer)
of the weight's seed and the element's global flat index (old outliers: another key); on the H100 QLion's step of 8
7B-shaped layers took 31.6 ms with it against 33.8 ms with Philox (tl.rand, SR_DRAW = "philox").
Launch shapes (benchmarks/qft_kernels.py --sweep, one 7B layer's seven weights on the H100): one-warp statistics
programs and two-warp write programs, the next block's loads issued before this block's arithmetic, and the
reciprocal instead of a division per element, took the step from 3.8 ms to 1.7-1.9 ms (fused bf16 AdamW: 1.29 ms):
the per-row prologue (dependent loads of the work item, record and row scales) is latency that only many small
programs in flight hide.
"""
from __future__ import annotations

import torch

from hfq_kernels._triton import LRU, TABLE_CODES, f32_to_bf16_rne, table_ptr, tl, triton, upload_table
from hfq_kernels.int8 import _qparams, _rint, _store_cast, row_segments, set_row_segments

# kernel -> (elements per inner step of a row program, warps); benchmarks/qft_kernels.py --sweep times the choices
LAUNCH = {"stats": (256, 1), "write": (512, 2), "plain": (1024, 8)}
OB = 64  # outliers per inner step of a row program
SR_DRAW = "hash"  # SR uniforms: "hash" (integer hash of seed and index) or "philox" (tl.rand)
PREFETCH = True  # issue the next block's loads before this block's arithmetic (stats and write kernels)
SORT_MAX = 4096  # longest row segment sorted inside the write kernel; longer ones are sorted by torch
NF = 23  # int64 fields per weight record


# ---- shared arithmetic ------------------------------------------------------------------------------------------
@triton.jit
def _int8_at(c, s, zf, offs, mask):
    """INT8 values at offs of a row with scale s and zero point zf (scalars, float32)."""
    return (tl.load(c + offs, mask=mask, other=0).to(tl.float32) - zf) * s


@triton.jit
def _row_sz(s, z, row):
    """A row's scale and zero point (as float32), read once per program."""
    return tl.load(s + row), tl.load(z + row).to(tl.float32)


@triton.jit
def _direction(m, gv, b1, omb1):
    c = m * b1 + gv * omb1
    return tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))


@triton.jit
def _lion_move(w, g, gs, gz, mc, ms, mz, offs, mask, decay, lr, b1, omb1, G_INT8: tl.constexpr):
    """Lion's update of the weight values w at `offs` (decay, then -lr * direction); also returns the gradient and
    momentum read there, float32."""
    if G_INT8:
        gv = _int8_at(g, gs, gz, offs, mask)
    else:
        gv = tl.load(g + offs, mask=mask, other=0.0).to(tl.float32)
    m = _int8_at(mc, ms, mz, offs, mask)
    w = w * decay
    w = w - _direction(m, gv, b1, omb1) * lr
    return w, gv, m


@triton.jit
def _raw(wc, g, mc, offs, mask, G_INT8: tl.constexpr):
    """The stored weight codes, gradient (codes or floats) and momentum codes at `offs`, as loaded."""
    if G_INT8:
        gr = tl.load(g + offs, mask=mask, other=0)
    else:
        gr = tl.load(g + offs, mask=mask, other=0.0)
    return tl.load(wc + offs, mask=mask, other=0), gr, tl.load(mc + offs, mask=mask, other=0)


@triton.jit
def _lion_values(raw, ws, wz, gs, gz, ms, mz, decay, lr, b1, omb1, b2, omb2, G_INT8: tl.constexpr):
    """From _raw's loads: the dense weight before and after the update (float32; old outlier positions are dense
    zeros) and the updated momentum."""
    wr, gr, mr = raw
    w0 = (wr.to(tl.float32) - wz) * ws
    if G_INT8:
        gv = (gr.to(tl.float32) - gz) * gs
    else:
        gv = gr.to(tl.float32)
    m = (mr.to(tl.float32) - mz) * ms
    w = w0 * decay
    w = w - _direction(m, gv, b1, omb1) * lr
    m = m * b2
    m = m + gv * omb2
    return w0, w, m


@triton.jit
def _next_raw(wc, g, mc, base, k, C, nxt, BLOCK: tl.constexpr, G_INT8: tl.constexpr, PREFETCH: tl.constexpr):
    """(this block's loads, the loads carried to the next iteration): with PREFETCH the next block's loads are
    issued before this block's arithmetic (twice the bytes in flight per thread)."""
    offs = k + tl.arange(0, BLOCK)
    if PREFETCH:
        cur = nxt
        o2 = offs + BLOCK
        nxt = _raw(wc, g, mc, base + o2, o2 < C, G_INT8)
    else:
        cur = _raw(wc, g, mc, base + offs, offs < C, G_INT8)
    return cur, nxt


@triton.jit
def _weight_ptrs(rec, G_DT: tl.constexpr, ALIGNED: tl.constexpr):
    """The record's weight, gradient and momentum pointers (fields 0-8)."""
    return (table_ptr(rec, 0, 3, ALIGNED), table_ptr(rec, 1, 0, False), table_ptr(rec, 2, 3, False),
            table_ptr(rec, 3, G_DT, ALIGNED), table_ptr(rec, 4, 0, False), table_ptr(rec, 5, 3, False),
            table_ptr(rec, 6, 3, ALIGNED), table_ptr(rec, 7, 0, False), table_ptr(rec, 8, 3, False))


@triton.jit
def _program(tab, work, NFIELDS: tl.constexpr, ALIGNED: tl.constexpr):
    """(record, row, row's index in the flat per-row buffers, columns) of this program."""
    pid = tl.program_id(0)
    t = tl.load(work + 2 * pid).to(tl.int64)
    row = tl.load(work + 2 * pid + 1).to(tl.int64)
    rec = tab + t * NFIELDS
    C = tl.load(rec + 13).to(tl.int32)
    if ALIGNED:
        C = tl.multiple_of(C, 16)
    return rec, row, tl.load(rec + 14) + row, C


# ---- QLion on int8_dense_sparse weights ---------------------------------------------------------------------------
@triton.jit
def _outlier_values(sidx, sval, j, jmask, g, gs, gz, mc, ms, mz, t0, t1, decay, lr, b1, omb1,
                    G_INT8: tl.constexpr):
    """Row `row`'s old outliers j: (flat index, updated value, stays outside the thresholds, Lion's direction)."""
    pos = tl.load(sidx + j, mask=jmask, other=0).to(tl.int64)
    v, gv, m = _lion_move(tl.load(sval + j, mask=jmask, other=0.0).to(tl.float32), g, gs, gz, mc, ms, mz, pos,
                          jmask, decay, lr, b1, omb1, G_INT8)
    return pos, v, ((v < t0) | (v > t1)) & jmask, _direction(m, gv, b1, omb1)


@triton.jit
def _stats_kernel(tab, work, stats, counts, vbuf, decay, lr, b1, omb1, b2, omb2, G_DT: tl.constexpr,
                  BLOCK: tl.constexpr, OB: tl.constexpr, NFIELDS: tl.constexpr, ALIGNED: tl.constexpr,
                  PREFETCH: tl.constexpr):
    rec, row, rb, C = _program(tab, work, NFIELDS, ALIGNED)
    wc, ws, wz, g, gs, gz, mc, ms, mz = _weight_ptrs(rec, G_DT, ALIGNED)
    sw, zw = _row_sz(ws, wz, row)
    sg, zg = _row_sz(gs, gz, row)
    sm, zm = _row_sz(ms, mz, row)
    thr, sidx = table_ptr(rec, 9, 0, False), table_ptr(rec, 10, 5, False)
    sval, rowptr = table_ptr(rec, 11, 1, False), table_ptr(rec, 12, 5, False)
    vb = vbuf + tl.load(rec + 15)
    base = row * C
    t0 = tl.load(thr)
    t1 = tl.load(thr + 1)
    wlo = tl.zeros((BLOCK,), tl.float32)
    whi = tl.zeros((BLOCK,), tl.float32)
    mlo = tl.zeros((BLOCK,), tl.float32)
    mhi = tl.zeros((BLOCK,), tl.float32)
    n = tl.zeros((BLOCK,), tl.int32)
    n_up = tl.zeros((BLOCK,), tl.int32)  # dense zeros moved to +lr / -lr: old outliers' positions among them
    n_dn = tl.zeros((BLOCK,), tl.int32)
    nxt = _raw(wc, g, mc, base + tl.arange(0, BLOCK), tl.arange(0, BLOCK) < C, G_DT == 3)
    for k in range(0, C, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        mask = offs < C
        raw, nxt = _next_raw(wc, g, mc, base, k, C, nxt, BLOCK, G_DT == 3, PREFETCH)
        w0, w, m = _lion_values(raw, sw, zw, sg, zg, sm, zm, decay, lr, b1, omb1, b2, omb2, G_DT == 3)
        out = ((w < t0) | (w > t1)) & mask
        zero = (w0 == 0.0) & mask  # moved to exactly -lr*direction: counted, not ranged (see below)
        n_up += (zero & (w > 0)).to(tl.int32)
        n_dn += (zero & (w < 0)).to(tl.int32)
        dense = tl.where(out | ~mask | zero, 0.0, w)
        wlo = tl.minimum(wlo, dense)
        whi = tl.maximum(whi, dense)
        m = tl.where(mask, m, 0.0)
        mlo = tl.minimum(mlo, m)
        mhi = tl.maximum(mhi, m)
        n += out.to(tl.int32)
    lo = tl.min(wlo, 0)
    hi = tl.max(whi, 0)
    n_all = tl.sum(n, 0)
    up = tl.sum(n_up, 0)
    dn = tl.sum(n_dn, 0)
    for j0 in range(tl.load(rowptr + row), tl.load(rowptr + row + 1), OB):  # old outliers of this row
        j = j0 + tl.arange(0, OB)
        jmask = j < tl.load(rowptr + row + 1)
        pos, v, stay, d = _outlier_values(sidx, sval, j, jmask, g, sg, zg, mc, sm, zm, t0, t1, decay, lr, b1, omb1,
                                          G_DT == 3)
        tl.store(vb + j, v, mask=jmask)  # the write pass reads it: by then the momentum codes are new
        back = tl.where(stay | ~jmask, 0.0, v)  # returning to the dense part: in the row's range
        lo = tl.minimum(lo, tl.min(back, 0))
        hi = tl.maximum(hi, tl.max(back, 0))
        n_all += tl.sum(stay.to(tl.int32), 0)
        up -= tl.sum((jmask & (d < 0)).to(tl.int32), 0)  # the dense pass saw this position as a zero moved to +lr
        dn -= tl.sum((jmask & (d > 0)).to(tl.int32), 0)
    # dense zeros moved by +-lr are in the range only where they are dense elements, not old outliers' places
    hi = tl.where(up > 0, tl.maximum(hi, lr), hi)
    lo = tl.where(dn > 0, tl.minimum(lo, -lr), lo)
    s_w, z_w = _qparams(lo, hi)
    s_m, z_m = _qparams(tl.min(mlo, 0), tl.max(mhi, 0))
    tl.store(stats + rb * 4, s_w)
    tl.store(stats + rb * 4 + 1, z_w)
    tl.store(stats + rb * 4 + 2, s_m)
    tl.store(stats + rb * 4 + 3, z_m)
    tl.store(counts + rb * 2, n_all)
    tl.store(counts + rb * 2 + 1, tl.sum(n, 0))  # of which dense elements crossing the thresholds


@triton.jit
def _append(new_idx, new_val, at, sel, pos, v, seed, e0, SR: tl.constexpr, HASH: tl.constexpr):
    """Write the selected (flat index, bf16 value) pairs at `at`, in order; returns the next free slot. The value
    is rounded to bf16 stochastically under SR (draws keyed by the global index e0 + pos), as reference.intq's
    quantize_dense_sparse does: nearest would freeze every outlier whose step is below half its ulp."""
    k = tl.sum(sel.to(tl.int32), 0)
    if k > 0:
        slot = at + tl.cumsum(sel.to(tl.int32), 0) - 1
        tl.store(new_idx + slot, pos.to(tl.int32), mask=sel)
        if SR:
            tl.store(new_val + slot, _bf16_sr(v, seed, e0 + pos, HASH), mask=sel)
        else:
            tl.store(new_val + slot, f32_to_bf16_rne(v), mask=sel)
    return at + k


@triton.jit
def _bf16_sr(v, seed, pos, HASH: tl.constexpr):
    """Finite fp32 v -> bf16, rounded up in magnitude with probability the fraction of the bf16 step (unbiased),
    the draw keyed by (seed, pos): reference.intq.round_bf16's rule."""
    u = (_uniform(seed, pos, HASH) * 65536.0).to(tl.int32)
    u = tl.where(tl.abs(v) < float("inf"), u, 0)  # NaN/Inf bits stay NaN/Inf
    b = (v.to(tl.int32, bitcast=True) + u) >> 16
    return b.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _mix(h):
    """murmur3's 32-bit finalizer (wrapping int32 products, logical shifts)."""
    h = h ^ (h >> 16)
    h = (h.to(tl.int32, bitcast=True) * -2048144789).to(tl.uint32, bitcast=True)  # 0x85EBCA6B
    h = h ^ (h >> 13)
    h = (h.to(tl.int32, bitcast=True) * -1028477387).to(tl.uint32, bitcast=True)  # 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _uniform(seed, pos, HASH: tl.constexpr):
    """A uniform draw in [0, 1) per flat index pos: Philox (tl.rand), or with HASH a 24-bit uniform from a hash of
    (seed, index), ~10 integer ops instead of Philox's ~100 (SR needs uniformity and no dependence on the value)."""
    if HASH:
        s = _mix(seed.to(tl.uint32))
        h = _mix((pos.to(tl.int32) * -1640531535).to(tl.uint32, bitcast=True) ^ s)  # 0x9E3779B1
        u = (h >> 8).to(tl.float32) * 5.9604644775390625e-08
    else:
        u = tl.rand(seed, pos.to(tl.int32))
    return u


@triton.jit
def _round(x, seed, pos, SR: tl.constexpr, HASH: tl.constexpr):
    if SR:
        r = tl.floor(x + _uniform(seed, pos, HASH))
    else:
        r = _rint(x)
    return r


@triton.jit
def _sort_segment(new_idx, new_bits, at, n, SEG: tl.constexpr):
    """Sort the n entries at `at` by index (the dense crossings and the staying outliers are each sorted already)."""
    o = tl.arange(0, SEG)
    msk = o < n
    idx = tl.load(new_idx + at + o, mask=msk, other=0).to(tl.int64)
    bits = tl.load(new_bits + at + o, mask=msk, other=0).to(tl.int32) & 0xFFFF
    key = tl.where(msk, (idx << 16) | bits.to(tl.int64), 0x7FFFFFFFFFFFFFFF)
    key = tl.sort(key)
    tl.store(new_idx + at + o, (key >> 16).to(tl.int32), mask=msk)
    tl.store(new_bits + at + o, (key & 0xFFFF).to(tl.int16), mask=msk)


@triton.jit
def _write_kernel(tab, work, qs, counts, cum, vbuf, decay, lr, b1, omb1, b2, omb2, G_DT: tl.constexpr,
                  SR: tl.constexpr, BLOCK: tl.constexpr, OB: tl.constexpr, SEG: tl.constexpr,
                  NFIELDS: tl.constexpr, ALIGNED: tl.constexpr, HASH: tl.constexpr,
                  PREFETCH: tl.constexpr):
    rec, row, rb, C = _program(tab, work, NFIELDS, ALIGNED)
    wc, ws, wz, g, gs, gz, mc, ms, mz = _weight_ptrs(rec, G_DT, ALIGNED)
    sw, zw = _row_sz(ws, wz, row)
    sg, zg = _row_sz(gs, gz, row)
    sm, zm = _row_sz(ms, mz, row)
    thr, sidx, rowptr = table_ptr(rec, 9, 0, False), table_ptr(rec, 10, 5, False), table_ptr(rec, 12, 5, False)
    vb = vbuf + tl.load(rec + 15)
    seed = tl.load(rec + 16)
    e0 = tl.load(rec + 22)  # global flat index of the weight's first element (a row shard's offset): SR position
    new_idx, new_val, new_ptr = table_ptr(rec, 17, 5, False), table_ptr(rec, 18, 1, False), table_ptr(rec, 19, 5, False)
    base = row * C
    t0 = tl.load(thr)
    t1 = tl.load(thr + 1)
    s_w = tl.load(qs + rb * 4)
    z_w = tl.load(qs + rb * 4 + 1)
    s_m = tl.load(qs + rb * 4 + 2)
    z_m = tl.load(qs + rb * 4 + 3)
    r_w = tl.div_rn(1.0, s_w)  # codes are x * (1 / scale), as reference.intq computes them
    r_m = tl.div_rn(1.0, s_m)
    n_all = tl.load(counts + rb * 2)
    n_cross = tl.load(counts + rb * 2 + 1)
    at0 = (tl.load(cum + rb) - n_all - tl.load(rec + 20)).to(tl.int32)  # this row's start in the weight's new list
    tl.store(new_ptr + row, at0)
    if row == tl.load(rec + 21) - 1:
        tl.store(new_ptr + row + 1, at0 + n_all)
    at = at0
    nxt = _raw(wc, g, mc, base + tl.arange(0, BLOCK), tl.arange(0, BLOCK) < C, G_DT == 3)
    for k in range(0, C, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        mask = offs < C
        raw, nxt = _next_raw(wc, g, mc, base, k, C, nxt, BLOCK, G_DT == 3, PREFETCH)
        _, w, m = _lion_values(raw, sw, zw, sg, zg, sm, zm, decay, lr, b1, omb1, b2, omb2, G_DT == 3)
        out = ((w < t0) | (w > t1)) & mask
        r = _round(tl.where(out, 0.0, w) * r_w, seed, e0 + base + offs, SR, HASH)
        tl.store(wc + base + offs, tl.minimum(tl.maximum(r + z_w, 0.0), 255.0).to(tl.uint8), mask=mask)
        qm = tl.minimum(tl.maximum(_rint(m * r_m) + z_m, 0.0), 255.0)
        tl.store(mc + base + offs, qm.to(tl.uint8), mask=mask)
        if n_cross > 0:  # most rows have none: no block-wide scan then
            at = _append(new_idx, new_val, at, out, base + offs, w, seed ^ 0x6A09E667, e0, SR, HASH)
    tl.debug_barrier()  # the dense codes above are written before the old outliers' codes below replace them
    j_end = tl.load(rowptr + row + 1)
    for j0 in range(tl.load(rowptr + row), j_end, OB):
        j = j0 + tl.arange(0, OB)
        jmask = j < j_end
        pos = tl.load(sidx + j, mask=jmask, other=0).to(tl.int64)
        v = tl.load(vb + j, mask=jmask, other=0.0)
        stay = ((v < t0) | (v > t1)) & jmask
        r = _round(tl.where(stay, 0.0, v) * r_w, seed ^ 0x2545F491, e0 + pos, SR, HASH)  # a stream of its own
        tl.store(wc + pos, tl.minimum(tl.maximum(r + z_w, 0.0), 255.0).to(tl.uint8), mask=jmask)
        at = _append(new_idx, new_val, at, stay, pos, v, seed ^ 0x6A09E667, e0, SR, HASH)
    if SEG > 0:
        if (n_cross > 0) & (n_all > n_cross):  # both runs present: merge them
            tl.debug_barrier()
            _sort_segment(new_idx, table_ptr(rec, 18, 4, False), at0, n_all, SEG)
    tl.debug_barrier()  # every thread has read the old row scales before they are replaced
    tl.store(ws + row, s_w)
    tl.store(wz + row, z_w.to(tl.uint8))
    tl.store(ms + row, s_m)
    tl.store(mz + row, z_m.to(tl.uint8))


_WORK = LRU(64)  # (device, (record, rows) pairs) -> int32 work list
_ENDS = LRU(64)  # (device, rows per weight) -> int64 index of each weight's last row in the flat buffers


def _work_list(device, recs_rows) -> torch.Tensor:
    def make():
        parts = [torch.stack((torch.full((r,), i, dtype=torch.int32), torch.arange(r, dtype=torch.int32)), 1)
                 for i, r in recs_rows]
        return torch.cat(parts).contiguous().to(device)
    return _WORK.get_or((str(device), tuple(recs_rows)), make)


def _aligned(*ptrs, cols: int) -> bool:
    return cols % 16 == 0 and all(p % 16 == 0 for p in ptrs)


def _g_code(grad: dict) -> int:
    """table_ptr's CODE of the gradient: a float dtype's, or 3 for INT8 gradient codes."""
    if "codes" in grad:
        return 3
    try:
        return TABLE_CODES[grad["value"].dtype]
    except KeyError:
        raise ValueError(f"qlion: gradient dtype {grad['value'].dtype} not supported "
                         f"(allowed {tuple(TABLE_CODES)} or INT8 codes)") from None


def _hyper(lr, beta1, beta2, weight_decay):
    decay = 1.0 - lr * weight_decay if weight_decay else 1.0
    return (decay, lr, beta1, 1.0 - beta1, beta2, 1.0 - beta2)


def _record(w, grad, mom, rowptr, rows, cols, rb, vb, seed) -> list:
    """Fields 0-16 of a weight's record (17-21 are added once the new outlier lists are allocated)."""
    if "codes" in grad:
        g = (grad["codes"], grad["scales"], grad["zeros"])
    else:
        g = (grad["value"], w["scales"], w["zeros"])
    ts = (w["codes"], w["scales"], w["zeros"], *g, mom["codes"], mom["scales"], mom["zeros"], w["thresholds"],
          w["sparse_idx"], w["sparse_val"], rowptr)
    return [t.data_ptr() for t in ts] + [cols, rb, vb, int(seed) & 0x7FFFFFFF]


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


def qlion_dense_sparse_begin(items, *, lr: float, beta1: float, beta2: float, weight_decay: float,
                             rounding: str = "sr") -> dict:
    """First half of a multi-tensor QLion step on int8_dense_sparse weights (nothing modified yet): the statistics
    pass. items: (w, grad, mom, seed[, first]) per weight, one device, dicts as in qlion_dense_sparse_step_; first
    (default 0): the global flat index of w's first element, where w is a row shard (SR draws are keyed by the
    global index, so shards draw what the whole weight draws). Returns a
    context whose "sync" (device int64) the caller reads with .tolist() (one host sync per step; several contexts
    may be read together) and hands to qlion_dense_sparse_finish."""
    items = [tuple(it) + (0,) * (5 - len(it)) for it in items if it[0]["codes"].numel()]
    dev = items[0][0]["codes"].device if items else torch.device("cpu")
    recs, keep, rows_l, codes_l = [], [], [], []
    rb = vb = 0
    for w, grad, mom, seed, _ in items:
        rows, cols = w["codes"].shape
        if "value" in grad:
            grad = {"value": grad["value"].reshape(rows, cols).contiguous()}
        rowptr = row_segments(w["sparse_idx"], rows, cols)
        keep.append((grad, rowptr))
        recs.append(_record(w, grad, mom, rowptr, rows, cols, rb, vb, seed))
        rows_l.append(rows)
        codes_l.append((_g_code(grad), _aligned(recs[-1][0], recs[-1][3], recs[-1][6], cols=cols)))
        rb += rows
        vb += w["sparse_idx"].numel()
    stats = torch.empty(rb * 4, dtype=torch.float32, device=dev)
    counts = torch.empty((rb, 2), dtype=torch.int32, device=dev)  # new list entries, of which crossings
    vbuf = torch.empty(max(vb, 1), dtype=torch.float32, device=dev)  # the old outliers' updated values
    hyper = _hyper(lr, beta1, beta2, weight_decay)
    ctx = dict(items=items, keep=keep, recs=recs, rows=rows_l, codes=codes_l, hyper=hyper, stats=stats,
               counts=counts, vbuf=vbuf, dev=dev, sr=rounding == "sr")
    if not items:
        ctx["sync"] = torch.zeros(1, dtype=torch.int64)
        return ctx
    tab = upload_table([r + [0] * (NF - len(r)) for r in recs], dev)
    block, warps = LAUNCH["stats"]
    for key in sorted(set(codes_l)):
        work = _work_list(dev, [(i, r) for i, (r, c) in enumerate(zip(rows_l, codes_l)) if c == key])
        _stats_kernel[(work.shape[0],)](tab, work, stats, counts, vbuf, *hyper, G_DT=key[0], BLOCK=block, OB=OB,
                                        NFIELDS=NF, ALIGNED=key[1], PREFETCH=PREFETCH, num_warps=warps,
                                        enable_fp_fusion=False)
    cnt = counts[:, 0]
    ctx["cum"] = cum = torch.cumsum(cnt, 0, dtype=torch.int64)
    ends = _ENDS.get_or((str(dev), tuple(rows_l)), lambda: torch.tensor(rows_l).cumsum(0).sub(1).to(dev))
    need = torch.where((counts[:, 1] > 0) & (cnt > counts[:, 1]), cnt, 0).max().to(torch.int64)
    ctx["sync"] = torch.cat((cum.index_select(0, ends), need.view(1)))
    return ctx


def qlion_dense_sparse_finish(ctx: dict, synced: list) -> list:
    """Second half: the update pass (weight and momentum codes in place, old outliers' codes included; the row
    scales last). synced: ctx["sync"].tolist(). Returns per item the new (sparse_idx, sparse_val, row segments),
    the list sorted by index, for the caller to store (their length changes)."""
    items, dev = ctx["items"], ctx["dev"]
    if not items:
        return []
    ends, need = synced[:-1], synced[-1]
    seg = _seg_bucket(need)
    out, recs, start = [], [], 0
    for (w, *_, first), rec, rows, end in zip(items, ctx["recs"], ctx["rows"], ends):
        n = end - start
        idx = torch.empty(n, dtype=torch.int32, device=dev)
        val = torch.empty(n, dtype=torch.bfloat16, device=dev)
        ptr = torch.empty(rows + 1, dtype=torch.int32, device=dev)
        out.append((idx, val, ptr))
        recs.append(rec + [idx.data_ptr(), val.data_ptr(), ptr.data_ptr(), start, rows, int(first)])
        start = end
    tab = upload_table(recs, dev)
    block, warps = LAUNCH["write"]
    rows_l, codes_l = ctx["rows"], ctx["codes"]
    for key in sorted(set(codes_l)):
        work = _work_list(dev, [(i, r) for i, (r, c) in enumerate(zip(rows_l, codes_l)) if c == key])
        launch = dict(G_DT=key[0], SR=ctx["sr"], BLOCK=block, OB=OB, NFIELDS=NF, ALIGNED=key[1],
                      HASH=SR_DRAW == "hash", PREFETCH=PREFETCH, num_warps=warps, enable_fp_fusion=False)
        args = (tab, work, ctx["stats"], ctx["counts"], ctx["cum"], ctx["vbuf"], *ctx["hyper"])
        _compile_buckets(args, launch, dev)
        _write_kernel[(work.shape[0],)](*args, SEG=seg, **launch)
    if seg == 0:  # some row's new segment is too long to sort in a program
        out = [(*_sorted(idx, val), ptr) for idx, val, ptr in out]
    return out


SEG_BUCKETS = (64, 512, SORT_MAX)  # in-kernel merge sizes: each is a compiled variant of the write kernel
PRECOMPILE = True  # compile every merge size of a write-kernel variant at its first use
_COMPILED: set = set()


def _seg_bucket(need: int) -> int:
    """The write kernel's merge size for a longest mixed row segment of `need` (0: torch sorts after it)."""
    return next((b for b in SEG_BUCKETS if need <= b <= SORT_MAX), 0)


def _compile_buckets(args, launch: dict, dev) -> None:
    """Compile every merge size of this write-kernel variant at its first use (launches of an empty grid), so
    that a step whose longest mixed row first reaches a larger bucket does not stall on the JIT mid-training."""
    key = (str(dev), tuple(sorted(launch.items())))
    if not PRECOMPILE or key in _COMPILED or dev.type != "cuda":
        return
    for seg in (0,) + SEG_BUCKETS:
        _write_kernel[(0,)](*args, SEG=seg, **launch)
    _COMPILED.add(key)


def _sorted(idx, val):
    keys, order = torch.sort(idx)
    return keys, val.index_select(0, order)


def store_outliers_(sparse_idx: torch.Tensor, sparse_val: torch.Tensor, new, cols: int) -> None:
    """Replace a weight's outlier list by `new` (sparse_idx, sparse_val, row segments) in place (same tensor
    objects: aliases follow), keeping the row segments for the next step and the decode."""
    idx, val, ptr = new
    sparse_idx.set_(idx)
    sparse_val.set_(val)
    set_row_segments(sparse_idx, ptr.numel() - 1, cols, ptr)


def qlion_dense_sparse_step_(w: dict, grad: dict, mom: dict, *, lr: float, beta1: float, beta2: float,
                             weight_decay: float, rounding: str = "sr", seed: int = 0) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
    """One QLion step of an int8_dense_sparse weight with the thresholds kept (QFT's lazy update).

    w: codes uint8 [R,C], scales fp32 [R,1], zeros uint8 [R,1], thresholds fp32 [2], sparse_idx int32 (sorted),
    sparse_val bf16 (the weight's stored tensors; codes/scales/zeros updated in place). grad: {codes, scales,
    zeros} (INT8 gradient) or {value} (float [R,C]). mom: INT8 momentum {codes, scales, zeros}, updated in place.
    Returns the new (sparse_idx, sparse_val), sorted by index, for the caller to store (their length changes).
    Requires not zero_may_cross(thresholds, lr)."""
    ctx = qlion_dense_sparse_begin([(w, grad, mom, seed)], lr=lr, beta1=beta1, beta2=beta2,
                                   weight_decay=weight_decay, rounding=rounding)
    res = qlion_dense_sparse_finish(ctx, ctx["sync"].tolist())
    if not res:
        return w["sparse_idx"].clone(), w["sparse_val"].clone()
    return res[0][0], res[0][1]


# ---- QLion on ordinary (bf16/fp32) parameters with INT8 momentum ---------------------------------------------------
NF_PLAIN = 8  # p, g, momentum codes / scales / zeros, -, cols, row base


@triton.jit
def _plain_kernel(tab, work, stats, decay, lr, b1, omb1, b2, omb2, WRITE: tl.constexpr, HAS_DECAY: tl.constexpr,
                  P_DT: tl.constexpr, G_DT: tl.constexpr, BLOCK: tl.constexpr, NFIELDS: tl.constexpr,
                  ALIGNED: tl.constexpr, SR: tl.constexpr = False, HASH: tl.constexpr = True):
    """WRITE=False: the new momentum's row scale and zero point into stats. WRITE=True: the parameter updated in
    place (in its dtype, rounded after each op as torch's in-place ops do; with SR a bf16 parameter's update is
    computed in fp32 and rounded once, stochastically, keyed by the record's seed) and the momentum requantized
    with them."""
    pid = tl.program_id(0)
    rec = tab + tl.load(work + 2 * pid).to(tl.int64) * NFIELDS
    row = tl.load(work + 2 * pid + 1).to(tl.int64)
    p, g, mc = table_ptr(rec, 0, P_DT, ALIGNED), table_ptr(rec, 1, G_DT, ALIGNED), table_ptr(rec, 2, 3, ALIGNED)
    ms, mz = table_ptr(rec, 3, 0, False), table_ptr(rec, 4, 3, False)
    C = tl.load(rec + 6).to(tl.int32)
    if ALIGNED:
        C = tl.multiple_of(C, 16)
    rb = tl.load(rec + 7) + row
    base = row * C
    sm0, zm0 = _row_sz(ms, mz, row)
    lo = tl.zeros((BLOCK,), tl.float32)
    hi = tl.zeros((BLOCK,), tl.float32)
    if WRITE:
        s_m = tl.load(stats + rb * 2)
        z_m = tl.load(stats + rb * 2 + 1)
        r_m = tl.div_rn(1.0, s_m)
    for k in range(0, C, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        mask = offs < C
        gv = tl.load(g + base + offs, mask=mask, other=0.0).to(tl.float32)
        m = _int8_at(mc, sm0, zm0, base + offs, mask)
        if WRITE:
            w = tl.load(p + base + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_DECAY:
                w = w * decay
                if (P_DT == 1) and not SR:
                    w = f32_to_bf16_rne(w).to(tl.float32)
            w = w - _direction(m, gv, b1, omb1) * lr
            if SR and (P_DT == 1):
                tl.store(p + base + offs, _bf16_sr(w, tl.load(rec + 5), base + offs, HASH), mask=mask)
            else:
                _store_cast(p + base + offs, w, mask, P_DT == 1)
        m = m * b2
        m = m + gv * omb2
        if WRITE:
            qm = tl.minimum(tl.maximum(_rint(m * r_m) + z_m, 0.0), 255.0)
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
        tl.store(stats + rb * 2, s_new)
        tl.store(stats + rb * 2 + 1, z_new)


def lion_plain_multi_step_(params, grads, moms, *, lr: float, beta1: float, beta2: float,
                           weight_decay: float, rounding: str = "rtn", seeds=None) -> None:
    """QLion's step of ordinary parameters (bf16 or fp32, contiguous, updated in place) with INT8 momentum {codes
    [R,C], scales, zeros} (rows: reference.intq.as_rows), two launches per (parameter, gradient) dtype pair; equal
    to reference.lion.lion_plain_step_ref per parameter. rounding="sr": bf16 parameters are rounded stochastically
    (draws keyed by `seeds`, one int per parameter, and the element index)."""
    sr = rounding == "sr"
    seeds = list(seeds) if seeds is not None else [0] * len(params)
    recs, keep, buckets = [], [], {}
    rb = 0
    dev = None
    for p, g, mom, seed in zip(params, grads, moms, seeds):
        rows, cols = mom["codes"].shape
        if p.dtype not in (torch.bfloat16, torch.float32) or not p.is_contiguous():
            raise ValueError(f"lion_plain_step_: parameter must be contiguous bf16/fp32, got {p.dtype}")
        if g.dtype not in TABLE_CODES:
            raise ValueError(f"lion_plain_step_: gradient dtype {g.dtype} not supported (allowed {tuple(TABLE_CODES)})")
        if not rows * cols:
            continue
        g = g.reshape(rows, cols).contiguous()
        keep.append(g)
        dev = p.device
        key = (TABLE_CODES[p.dtype], TABLE_CODES[g.dtype], _aligned(p.data_ptr(), g.data_ptr(), mom["codes"].data_ptr(),
                                                              cols=cols))
        buckets.setdefault(key, []).append((len(recs), rows))
        recs.append([p.data_ptr(), g.data_ptr(), mom["codes"].data_ptr(), mom["scales"].data_ptr(),
                     mom["zeros"].data_ptr(), int(seed) % (2 ** 31 - 1), cols, rb])
        rb += rows
    if not recs:
        return
    tab = upload_table(recs, dev)
    stats = torch.empty(rb * 2, dtype=torch.float32, device=dev)
    block, warps = LAUNCH["plain"]
    hyper = _hyper(lr, beta1, beta2, weight_decay)
    for (pd, gd, aligned), rec_rows in buckets.items():
        work = _work_list(dev, rec_rows)
        for write in (False, True):
            _plain_kernel[(work.shape[0],)](tab, work, stats, *hyper, WRITE=write, HAS_DECAY=bool(weight_decay),
                                            P_DT=pd, G_DT=gd, BLOCK=block, NFIELDS=NF_PLAIN, ALIGNED=aligned,
                                            SR=sr, HASH=SR_DRAW == "hash", num_warps=warps,
                                            enable_fp_fusion=False)


def lion_plain_step_(p: torch.Tensor, g: torch.Tensor, mom: dict, *, lr: float, beta1: float, beta2: float,
                     weight_decay: float, rounding: str = "rtn", seed: int = 0) -> None:
    """lion_plain_multi_step_ for one parameter."""
    lion_plain_multi_step_([p], [g], [mom], lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                           rounding=rounding, seeds=[seed])
