"""Fused ECO-AdamW step for fp8_e4m3_row QParams: dequantize, Adam moments, decoupled weight decay, new row
scale, requantize (RTN or SR), inject the error into the first moment. Multi-tensor: one launch updates a whole
list of weights (as torch's fused AdamW does), so the host cost of a step does not grow with the number of
parameters.

  eco_adamw_fp8_multi_step_(codes[], scales[], grads[], exp_avgs[], exp_avg_sqs[], lr=..., step=..., ...)
  hfq::eco_adamw_fp8_step(codes f8e4m3[R,C], scales f32[R,1], grad[R,C], exp_avg[R,C], exp_avg_sq[R,C],
                          lr, beta1, beta2, eps, weight_decay, step, rounding, seed) -> None (all in place)

Layout. The launcher writes an int64 table (one record per tensor: the five data pointers, rows, cols, the
tensor's random-stream id, the global index of its first row) and an int32 work list (tensor, first row) with one
entry per program; a program updates ROWS rows of one tensor, each row held in registers as [W, 8] (column =
8*j + k), so a row's absmax and new scale come from one pass over memory: codes 1 B + grad + both moments read
and written once. Rows wider than MAX_ONE_PASS (8192) take two passes (absmax, then update). Tensors are grouped
per launch by block width and dtypes; the tables are cached by their contents, so a steady training loop uploads
nothing.

Arithmetic mirrors the torch reference op for op (`eco_adamw_fp8_step_ref`: hfq.eco.functional +
hfq_kernels.reference.fp8, written with one rounding per op) and the kernel is compiled without FMA contraction
(enable_fp_fusion=False), so RTN codes and scales are bit-identical to the reference under the CPU interpreter;
on a GPU the reference's own kernels may round a last bit differently (see tests/test_eco_kernel.py).
Divisions are IEEE (div_rn) where the reference divides (m/denom, tmp/scale, amax/448); the E4M3 grid step is a
power of two and is applied by multiplication.

SR: Philox (counter = column group, global row, tensor stream; key = seed): one call serves 8 elements with 16-bit
uniforms u = (h + 1/2)/2^16. A row shard (FSDP2) given its first global row and the whole weight's stream draws
what the whole weight draws. Rounding up when u < frac (frac = exact fractional distance to the lower grid point)
happens with probability within 2^-17 of frac, so E[Q(x)] is unbiased to that. On the H100 one call per 8
elements made the 1B-shaped SR step 7.2-7.5 ms against 9.3-11.6 ms for one call (24-bit uniform) per element
(benchmarks/results/eco_sweep.md). Draws differ from the reference's generator.
"""
from __future__ import annotations

import torch

from hfq_kernels._triton import (HAS_TRITON, INTERPRET, LRU, TABLE_CODES, available, e4m3_to_f32,  # noqa: F401
                                 on_gpu, table_ptr, tl, triton, upload_table)
from hfq_kernels.reference import eco as Fn
from hfq_kernels.reference import fp8 as _fp8

_MIN_SCALE = tl.constexpr(_fp8.MIN_SCALE) if HAS_TRITON else _fp8.MIN_SCALE
MAX_ONE_PASS = 8192
MIN_BLOCK = 64
# block width -> (rows per program, num_warps); tuned on an H100 (benchmarks/eco.py --sweep), overridable
LAUNCH = {64: (16, 4), 128: (16, 4), 256: (8, 4), 512: (4, 4), 1024: (2, 4), 2048: (1, 8), 4096: (1, 8),
          8192: (1, 16)}


_S_CODES = {torch.float32: 0, torch.bfloat16: 1}


@triton.jit
def _e4m3_round(x, u, SR: tl.constexpr):
    """x in [-448, 448] (fp32) -> nearest-even (or stochastic with uniform u) E4M3 grid value (fp32)."""
    bits = x.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 255) - 127, -6)  # grid step 2^(e-3)
    ulp = ((e + 124) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((130 - e) << 23).to(tl.float32, bitcast=True)
    t = x * inv_ulp  # exact: power of two
    lo = tl.floor(t)
    if SR:
        r = lo + (u < (t - lo)).to(tl.float32)
    else:
        r = tl.floor(t + 0.5)  # t + 0.5 is exact: |t| < 16
        tie = (r - t) == 0.5
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        r = tl.where(tie & odd, r - 1.0, r)
        r = tl.where(r == 0.0, x * 0.0, r)  # keep the sign of a value rounded to zero, as torch's cast does
    q = r * ulp
    return tl.minimum(tl.maximum(q, -448.0), 448.0)


@triton.jit
def _e4m3_encode(q):
    """Exact E4M3 value (fp32) -> its byte (int32)."""
    bits = q.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 128
    a = tl.abs(q)
    ab = a.to(tl.int32, bitcast=True)
    normal = ((((ab >> 23) & 255) - 120) << 3) | ((ab >> 20) & 7)
    sub = (a * 512.0).to(tl.int32)
    code = tl.where(a < 0.015625, sub, normal)
    return code | sign


@triton.jit
def _to_state(x, p, INTERP: tl.constexpr):
    """fp32 -> the state tensor's dtype, nearest-even. The interpreter's fp32->bf16 cast truncates, so there
    the value is first rounded onto the bf16 grid by integer ops (then the cast is exact)."""
    if INTERP:
        if p.dtype.element_ty == tl.bfloat16:
            b = x.to(tl.int32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
            x = b.to(tl.float32, bitcast=True)
    return x.to(p.dtype.element_ty)


@triton.jit
def _uniform(seed, rows, jg, stream, lane):
    """[ROWS, W, 8] uniforms in (0, 1) for the SR step: one Philox call per row and column group of 8 (4 words x 2
    halves: 16-bit uniforms). Counter = (group, row, tensor stream, lane), key = seed; lane 1 rounds the weight,
    lane 2 the second moment."""
    c0 = (jg[None, :] + rows[:, None] * 0).to(tl.uint32)
    c1 = (rows[:, None] + jg[None, :] * 0).to(tl.uint32)
    c2 = c1 * 0 + stream.to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c2 * 0 + lane)
    kk = tl.arange(0, 8)[None, None, :]
    sel = kk & 3
    r = tl.where(sel == 0, r0[:, :, None], tl.where(sel == 1, r1[:, :, None],
                                                     tl.where(sel == 2, r2[:, :, None], r3[:, :, None])))
    h = tl.where(kk < 4, r & 0xFFFF, r >> 16)
    return (h.to(tl.float32) + 0.5) * 0.0000152587890625  # 2^-16


@triton.jit
def _adam_tmp(cb, s_old, g, m, v, decay, beta1, omb1, beta2, omb2, eps, step_size, inv_sqrt_bc2):
    # one rounding per op, in the reference's order (the kernel is compiled without FMA contraction)
    theta = e4m3_to_f32(cb) * s_old
    m = beta1 * m + g * omb1
    v = beta2 * v + (g * g) * omb2
    denom = tl.sqrt_rn(v) * inv_sqrt_bc2 + eps
    tmp = theta * decay - step_size * tl.div_rn(m, denom)
    return tmp, m, v, denom


@triton.jit
def _load_tmp(codes_ptr, g_ptr, m_ptr, v_ptr, offs, mask, s_old, decay, beta1, omb1, beta2, omb2, eps, step_size,
              inv_sqrt_bc2):
    """Load one tile (codes, grad, moments) and run the Adam part of the step: (tmp, m, v, denom)."""
    cb = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return _adam_tmp(cb, s_old, g, m, v, decay, beta1, omb1, beta2, omb2, eps, step_size, inv_sqrt_bc2)


@triton.jit
def _requant_store(tmp, m, v, denom, s3, inj, codes_ptr, m_ptr, v_ptr, offs, mask, seed, rows, jg, stream,
                   SR: tl.constexpr, SR_V: tl.constexpr, INTERP: tl.constexpr):
    """Requantize tmp with the new row scale s3 (RTN or SR), inject the error into m, store codes and moments
    (SR_V: the bf16 second moment rounded stochastically, its 16 dropped bits against a 16-bit uniform)."""
    x = tl.minimum(tl.maximum(tl.div_rn(tmp, s3), -448.0), 448.0)
    if SR_V:
        h = (_uniform(seed, rows, jg, stream, 2) * 65536.0).to(tl.int32)  # (h + 1/2) / 2^16 -> h
        vb = v.to(tl.int32, bitcast=True) + tl.where((v - v) == 0.0, h, 0)  # NaN/Inf bits kept
        v = (vb & -65536).to(tl.float32, bitcast=True)  # on the bf16 grid: the store's cast is exact
    if SR:
        u = _uniform(seed, rows, jg, stream, 1)
    else:
        u = x
    q = _e4m3_round(x, u, SR)
    e = tmp - q * s3
    m = m - (e * denom) * inj
    tl.store(codes_ptr + offs, _e4m3_encode(q).to(tl.uint8), mask=mask)
    tl.store(m_ptr + offs, _to_state(m, m_ptr, INTERP), mask=mask)
    tl.store(v_ptr + offs, _to_state(v, v_ptr, INTERP), mask=mask)


@triton.jit
def _block_offs(b, cols0, rmask, base, n_cols, BLOCK: tl.constexpr):
    """(mask, offsets) of column block b of the program's rows (two-pass path)."""
    cols = b * BLOCK + cols0
    return rmask[:, None, None] & (cols < n_cols), base + cols


# seed changes every SR step: unspecialised, or each new value class (== 1, % 16 == 0) would compile anew
@triton.jit(do_not_specialize=["seed"])
def _eco_adamw_fp8_kernel(tab_ptr, work_ptr, decay, beta1, omb1, beta2, omb2, eps, step_size, inv_sqrt_bc2,
                          inj, seed, G_DT: tl.constexpr, M_DT: tl.constexpr, V_DT: tl.constexpr,
                          SR: tl.constexpr, SR_V: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                          TWO_PASS: tl.constexpr,
                          ALIGNED: tl.constexpr, INTERP: tl.constexpr):
    W: tl.constexpr = BLOCK // 8
    pid = tl.program_id(0)
    t = tl.load(work_ptr + 2 * pid).to(tl.int64)
    row0 = tl.load(work_ptr + 2 * pid + 1)
    rec = tab_ptr + t * 9
    codes_ptr = table_ptr(rec, 0, 3, ALIGNED)
    scales_ptr = table_ptr(rec, 1, 0, False)
    g_ptr = table_ptr(rec, 2, G_DT, ALIGNED)
    m_ptr = table_ptr(rec, 3, M_DT, ALIGNED)
    v_ptr = table_ptr(rec, 4, V_DT, ALIGNED)
    n_rows = tl.load(rec + 5)
    n_cols = tl.load(rec + 6)
    if ALIGNED:
        n_cols = tl.multiple_of(n_cols, 16)
    stream = tl.load(rec + 7)

    rows = row0 + tl.arange(0, ROWS)
    grows = rows + tl.load(rec + 8)  # global rows: the SR counter
    rmask = rows < n_rows
    base = (rows.to(tl.int64) * n_cols)[:, None, None]
    jj = tl.arange(0, W)
    cols0 = jj[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]  # [1, W, 8]
    s_old = tl.load(scales_ptr + rows, mask=rmask, other=1.0)[:, None, None]
    if not TWO_PASS:
        mask = rmask[:, None, None] & (cols0 < n_cols)
        offs = base + cols0
        tmp, m, v, denom = _load_tmp(codes_ptr, g_ptr, m_ptr, v_ptr, offs, mask, s_old, decay, beta1, omb1, beta2,
                                     omb2, eps, step_size, inv_sqrt_bc2)
        amax = tl.max(tl.max(tl.where(mask, tl.abs(tmp), 0.0), axis=2), axis=1)
        s_new = tl.where(amax > 0, tl.maximum(tl.div_rn(amax, 448.0), _MIN_SCALE), 1.0)
        s3 = s_new[:, None, None]
        _requant_store(tmp, m, v, denom, s3, inj, codes_ptr, m_ptr, v_ptr, offs, mask, seed, grows, jj,
                       stream, SR, SR_V, INTERP)
    else:
        nb = tl.cdiv(n_cols, BLOCK)
        amax = tl.zeros([ROWS], dtype=tl.float32)
        for b in range(nb):
            mask, offs = _block_offs(b, cols0, rmask, base, n_cols, BLOCK)
            tmp, m, v, denom = _load_tmp(codes_ptr, g_ptr, m_ptr, v_ptr, offs, mask, s_old, decay, beta1, omb1,
                                         beta2, omb2, eps, step_size, inv_sqrt_bc2)
            amax = tl.maximum(amax, tl.max(tl.max(tl.where(mask, tl.abs(tmp), 0.0), axis=2), axis=1))
        s_new = tl.where(amax > 0, tl.maximum(tl.div_rn(amax, 448.0), _MIN_SCALE), 1.0)
        s3 = s_new[:, None, None]
        for b in range(nb):
            mask, offs = _block_offs(b, cols0, rmask, base, n_cols, BLOCK)
            tmp, m, v, denom = _load_tmp(codes_ptr, g_ptr, m_ptr, v_ptr, offs, mask, s_old, decay, beta1, omb1,
                                         beta2, omb2, eps, step_size, inv_sqrt_bc2)
            _requant_store(tmp, m, v, denom, s3, inj, codes_ptr, m_ptr, v_ptr, offs, mask, seed, grows,
                           b * W + jj, stream, SR, SR_V, INTERP)
    tl.store(scales_ptr + rows, s_new, mask=rmask)


def _check(codes, scales, grad, exp_avg, exp_avg_sq, rounding):
    _fp8.check_rounding(rounding)
    if codes.dtype != torch.float8_e4m3fn or codes.dim() != 2:
        raise ValueError(f"codes: expected 2-D float8_e4m3fn, got {codes.dtype} {tuple(codes.shape)}")
    r, c = codes.shape
    if tuple(scales.shape) != (r, 1) or scales.dtype != torch.float32:
        raise ValueError(f"scales: expected float32 [{r}, 1], got {scales.dtype} {tuple(scales.shape)}")
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if tuple(t.shape) != (r, c):
            raise ValueError(f"{name}: expected shape {(r, c)}, got {tuple(t.shape)}")
    for name, t in (("codes", codes), ("scales", scales), ("grad", grad), ("exp_avg", exp_avg),
                    ("exp_avg_sq", exp_avg_sq)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous")


def _coeffs(lr, beta1, beta2, step, weight_decay):
    """The reference's host scalars (Python doubles, rounded to fp32 at launch as torch rounds them)."""
    bc1 = 1 - beta1 ** step
    bc2 = 1 - beta2 ** step
    step_size = lr / bc1
    return dict(decay=1 - lr * weight_decay, omb1=1 - beta1, omb2=1 - beta2, step_size=step_size,
                inv_sqrt_bc2=1 / bc2 ** 0.5, inj=(1 - beta1) / (beta1 * step_size))


def _block(c):
    return max(MIN_BLOCK, min(triton.next_power_of_2(c), MAX_ONE_PASS))


_TABLES = LRU(32)  # (device, pointer/shape records) -> int64 table on the device
_WORK = LRU(32)  # (device, rows per tensor, ROWS) -> int32 work list on the device


def _work_list(device, n_rows, rows_per_prog):
    def make():
        parts = [torch.stack((torch.full(((r + rows_per_prog - 1) // rows_per_prog,), i, dtype=torch.int32),
                              torch.arange(0, r, rows_per_prog, dtype=torch.int32)), 1)
                 for i, r in enumerate(n_rows)]
        return torch.cat(parts).contiguous().to(device)
    return _WORK.get_or((str(device), n_rows, rows_per_prog), make)


class _Plan:
    """Validated launch buckets for one list of weights: device tables built (or found in the cache)."""

    def __init__(self, device, buckets, moments):
        self.device, self.buckets, self.moments = device, buckets, moments


def eco_adamw_fp8_prepare(codes, scales, grads, exp_avgs, exp_avg_sqs, *, streams=None, first_rows=None,
                          check=True) -> _Plan:
    """Host half of a multi-tensor step: checks, buckets by (block width, dtypes), pointer tables and work lists
    (cached by content: a steady training loop uploads nothing). The optimizer runs it while the GPU is still
    busy with the gradients' finite check. The tensors must not be replaced before `eco_adamw_fp8_launch`.
    streams[i] (default i) names tensor i's SR stream, first_rows[i] (default 0) the global index of its first
    row: a row shard of a weight with its weight's stream and first row draws what the whole weight draws."""
    n = len(codes)
    streams = list(range(n)) if streams is None else list(streams)
    first_rows = [0] * n if first_rows is None else list(first_rows)
    if not (len(scales) == len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(streams) == len(first_rows) == n):
        raise ValueError("eco_adamw_fp8: lists of different lengths")
    buckets: dict = {}
    device = codes[0].device if n else None
    for i in range(n):
        c, g, m, v = codes[i], grads[i], exp_avgs[i], exp_avg_sqs[i]
        if check:
            _check(c, scales[i], g, m, v, "rtn")
            if any(t.device != device for t in (c, scales[i], g, m, v)):
                raise ValueError("eco_adamw_fp8: all tensors must be on one device")
        r, cols = c.shape
        try:
            dts = (TABLE_CODES[g.dtype], _S_CODES[m.dtype], _S_CODES[v.dtype])
        except KeyError:
            raise ValueError(f"unsupported dtypes grad {g.dtype}, exp_avg {m.dtype}, exp_avg_sq {v.dtype}") from None
        ptrs = (c.data_ptr(), scales[i].data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr())
        aligned = cols % 16 == 0 and all(p % 16 == 0 for p in ptrs)
        block = _block(cols)
        buckets.setdefault((block, cols > MAX_ONE_PASS, dts, aligned), []).append(
            ptrs + (r, cols, int(streams[i]), int(first_rows[i])))
    out = []
    for (block, two_pass, dts, aligned), recs in buckets.items():
        rows_per_prog, warps = LAUNCH.get(block, (1, 4))
        recs = tuple(recs)

        tab = _TABLES.get_or((str(device), recs), lambda recs=recs: upload_table(recs, device))
        work = _work_list(device, tuple(rec[5] for rec in recs), rows_per_prog)
        out.append((tab, work, block, two_pass, dts, aligned, rows_per_prog, warps))
    return _Plan(device, out, (list(exp_avgs), list(exp_avg_sqs), list(grads)))


def eco_adamw_fp8_launch(plan: _Plan, *, lr, beta1, beta2, eps, weight_decay, step, rounding="rtn", seed=0,
                         state_sr: bool = False) -> None:
    """Device half: one kernel launch per bucket of `plan`. `state_sr`: bf16 second moments are stored with
    stochastic rounding (lane 2 of `seed`'s Philox stream; pass a new seed every step)."""
    _fp8.check_rounding(rounding)
    if plan.device is None:
        return
    if lr == 0:  # master-weight semantics: moments move, the weight does not
        for m, v, g in zip(*plan.moments):
            Fn.adam_moments_(m, v, g.float(), beta1=beta1, beta2=beta2, step=step, eps=eps, lr=lr)
        return
    k = _coeffs(lr, beta1, beta2, step, weight_decay)
    for tab, work, block, two_pass, (gd, md, vd), aligned, rows_per_prog, warps in plan.buckets:
        _eco_adamw_fp8_kernel[(work.shape[0],)](
            tab, work, k["decay"], beta1, k["omb1"], beta2, k["omb2"], eps, k["step_size"], k["inv_sqrt_bc2"],
            k["inj"], int(seed), G_DT=gd, M_DT=md, V_DT=vd, SR=(rounding == "sr"),
            SR_V=bool(state_sr) and vd == _S_CODES[torch.bfloat16], BLOCK=block, ROWS=rows_per_prog,
            TWO_PASS=two_pass, ALIGNED=aligned, INTERP=plan.device.type == "cpu", num_warps=warps,
            enable_fp_fusion=False)  # no FMA contraction: the fp32 arithmetic equals the reference's op for op


def eco_adamw_fp8_multi_step_(codes, scales, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay,
                              step, rounding="rtn", seed=0, streams=None, first_rows=None, state_sr=False) -> None:
    """In-place fused ECO-AdamW step (memory-free rule) over lists of fp8_e4m3_row weights that share the
    hyper-parameters and step count; the i-th tensor draws its SR noise from stream streams[i] (default i) of
    `seed`, its rows counted from first_rows[i] (default 0). CUDA tensors, or CPU tensors under TRITON_INTERPRET=1."""
    _fp8.check_rounding(rounding)
    plan = eco_adamw_fp8_prepare(codes, scales, grads, exp_avgs, exp_avg_sqs, streams=streams, first_rows=first_rows)
    eco_adamw_fp8_launch(plan, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
                         rounding=rounding, seed=seed, state_sr=state_sr)


def eco_adamw_fp8_step_triton(codes, scales, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay,
                              step, rounding="rtn", seed=0) -> None:
    """Host launcher for one weight (also runs on CPU tensors under TRITON_INTERPRET=1)."""
    eco_adamw_fp8_multi_step_([codes], [scales], [grad], [exp_avg], [exp_avg_sq], lr=lr, beta1=beta1, beta2=beta2,
                              eps=eps, weight_decay=weight_decay, step=step, rounding=rounding, seed=seed)


def eco_adamw_fp8_step_ref(codes, scales, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay,
                           step, rounding="rtn", seed=0) -> None:
    """Torch reference of the fused step (hfq.eco.functional.eco_adamw_ on an fp8_e4m3_row weight)."""
    _check(codes, scales, grad, exp_avg, exp_avg_sq, rounding)
    gen = None
    if rounding == "sr":
        gen = torch.Generator(device=codes.device)
        gen.manual_seed(int(seed))
    m, v = exp_avg.float(), exp_avg_sq.float()
    theta = _fp8.dequantize_fp8_row(codes, scales)

    def requant(tmp):
        c, s = _fp8.quantize_fp8_row(tmp, rounding, gen)
        codes.copy_(c)
        scales.copy_(s)
        return tmp - _fp8.dequantize_fp8_row(c, s)

    Fn.eco_adamw_(theta, m, v, grad.float(), step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                  weight_decay=weight_decay, requant=requant)
    if exp_avg is not m:
        exp_avg.copy_(m)
    if exp_avg_sq is not v:
        exp_avg_sq.copy_(v)


@torch.library.custom_op("hfq::eco_adamw_fp8_step", mutates_args=("codes", "scales", "exp_avg", "exp_avg_sq"))
def _eco_op(codes: torch.Tensor, scales: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
            exp_avg_sq: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
            step: int, rounding: str, seed: int) -> None:
    eco_adamw_fp8_step_ref(codes, scales, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                           weight_decay=weight_decay, step=step, rounding=rounding, seed=seed)


@_eco_op.register_kernel("cuda")
def _(codes, scales, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, rounding, seed):
    fn = eco_adamw_fp8_step_triton if on_gpu(codes) else eco_adamw_fp8_step_ref
    fn(codes, scales, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
       weight_decay=weight_decay, step=step, rounding=rounding, seed=seed)


@_eco_op.register_fake
def _(codes, scales, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, rounding, seed):
    return None


def eco_adamw_fp8_step(codes, scales, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
                       rounding="rtn", seed=0) -> None:
    """In-place fused ECO-AdamW step (memory-free rule) for one weight, through the torch.library op. CUDA:
    Triton; CPU: the Triton kernel under TRITON_INTERPRET=1, else the torch reference."""
    if codes.device.type == "cpu" and available(codes.device):
        return eco_adamw_fp8_step_triton(codes, scales, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2,
                                         eps=eps, weight_decay=weight_decay, step=step, rounding=rounding, seed=seed)
    torch.ops.hfq.eco_adamw_fp8_step(codes, scales, grad, exp_avg, exp_avg_sq, float(lr), float(beta1),
                                     float(beta2), float(eps), float(weight_decay), int(step), rounding, int(seed))
