"""Fused ECO-AdamW step for an fp8_e4m3_row QParam: dequantize, Adam moments, decoupled weight decay, new
row scale, requantize (RTN or SR), inject the error into the first moment. One Triton program per row.

  hfq::eco_adamw_fp8_step(codes f8e4m3[R,C], scales f32[R,1], grad[R,C], exp_avg[R,C], exp_avg_sq[R,C],
                          lr, beta1, beta2, eps, weight_decay, step, rounding, seed) -> None (all in place)

CPU runs the torch reference (`eco_adamw_fp8_step_ref`, built from hfq.eco.functional + hfq.formats.fp8);
CUDA runs the kernel. The kernel's arithmetic mirrors the reference: RTN rounds half-to-even on the E4M3
grid; SR draws uniform numbers with Philox (tl.rand(seed, element index)), so its draws differ from torch's
generator but have the same law. Rows up to 8192 wide are processed from registers in one pass over memory
(codes 1 B + grad 2 B + two moments read and written once); wider rows take two passes.
"""
from __future__ import annotations

import os

import torch

from hfq.eco import functional as Fn
from hfq.formats import fp8 as _fp8

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
MAX_ONE_PASS = 8192

if HAS_TRITON:

    @triton.jit
    def _e4m3_decode(b):
        """E4M3 byte (int32 0..255) -> float32 (exact)."""
        e = (b >> 3) & 15
        m = b & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
        return tl.where((b & 128) != 0, -mag, mag)

    @triton.jit
    def _e4m3_round(x, u, SR: tl.constexpr):
        """x in [-448, 448] (fp32) -> nearest-even (or stochastic with uniform u) E4M3 grid value (fp32)."""
        bits = x.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 255) - 127
        e = tl.maximum(e, -6) - 3
        ulp = ((e + 127) << 23).to(tl.float32, bitcast=True)
        t = x / ulp  # exact: power of two
        lo = tl.floor(t)
        if SR:
            r = lo + (u < (t - lo)).to(tl.float32)
        else:
            r = tl.floor(t + 0.5)
            tie = (r - t) == 0.5
            odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
            r = tl.where(tie & odd, r - 1.0, r)
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
    def _adam_tmp(cb, s_old, g, m, v, beta1, beta2, eps, lr, weight_decay, step_size, inv_sqrt_bc2):
        theta = _e4m3_decode(cb) * s_old
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        denom = tl.sqrt_rn(v) * inv_sqrt_bc2 + eps
        tmp = theta * (1.0 - lr * weight_decay) - step_size * tl.div_rn(m, denom)
        return tmp, m, v, denom

    @triton.jit
    def _eco_adamw_fp8_kernel(codes_ptr, scales_ptr, g_ptr, m_ptr, v_ptr, n_cols,
                              lr, beta1, beta2, eps, weight_decay, step_size, inv_sqrt_bc2, inj, seed,
                              SR: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr):
        row = tl.program_id(0)
        base = row.to(tl.int64) * n_cols
        s_old = tl.load(scales_ptr + row)
        offs = tl.arange(0, BLOCK)
        if NB == 1:
            mask = offs < n_cols
            cb = tl.load(codes_ptr + base + offs, mask=mask, other=0).to(tl.int32)
            g = tl.load(g_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
            m = tl.load(m_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
            tmp, m, v, denom = _adam_tmp(cb, s_old, g, m, v, beta1, beta2, eps, lr, weight_decay, step_size,
                                         inv_sqrt_bc2)
            amax = tl.max(tl.where(mask, tl.abs(tmp), 0.0), axis=0)
            s_new = tl.where(amax > 0, tl.div_rn(amax, 448.0), 1.0)
            x = tl.minimum(tl.maximum(tl.div_rn(tmp, s_new), -448.0), 448.0)
            if SR:
                u = tl.rand(seed, (base + offs).to(tl.uint32))
            else:
                u = x
            q = _e4m3_round(x, u, SR)
            e = tmp - q * s_new
            m = m - inj * (e * denom)
            tl.store(codes_ptr + base + offs, _e4m3_encode(q).to(tl.uint8), mask=mask)
            tl.store(m_ptr + base + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
            tl.store(v_ptr + base + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
        else:
            amax = 0.0
            for b in range(NB):
                cols = b * BLOCK + offs
                mask = cols < n_cols
                cb = tl.load(codes_ptr + base + cols, mask=mask, other=0).to(tl.int32)
                g = tl.load(g_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
                m = tl.load(m_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
                v = tl.load(v_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
                tmp, m, v, denom = _adam_tmp(cb, s_old, g, m, v, beta1, beta2, eps, lr, weight_decay, step_size,
                                             inv_sqrt_bc2)
                amax = tl.maximum(amax, tl.max(tl.where(mask, tl.abs(tmp), 0.0), axis=0))
            s_new = tl.where(amax > 0, tl.div_rn(amax, 448.0), 1.0)
            for b in range(NB):
                cols = b * BLOCK + offs
                mask = cols < n_cols
                cb = tl.load(codes_ptr + base + cols, mask=mask, other=0).to(tl.int32)
                g = tl.load(g_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
                m = tl.load(m_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
                v = tl.load(v_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
                tmp, m, v, denom = _adam_tmp(cb, s_old, g, m, v, beta1, beta2, eps, lr, weight_decay, step_size,
                                             inv_sqrt_bc2)
                x = tl.minimum(tl.maximum(tl.div_rn(tmp, s_new), -448.0), 448.0)
                if SR:
                    u = tl.rand(seed, (base + cols).to(tl.uint32))
                else:
                    u = x
                q = _e4m3_round(x, u, SR)
                e = tmp - q * s_new
                m = m - inj * (e * denom)
                tl.store(codes_ptr + base + cols, _e4m3_encode(q).to(tl.uint8), mask=mask)
                tl.store(m_ptr + base + cols, m.to(m_ptr.dtype.element_ty), mask=mask)
                tl.store(v_ptr + base + cols, v.to(v_ptr.dtype.element_ty), mask=mask)
        tl.store(scales_ptr + row, s_new)


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
        if not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous")


def _coeffs(lr, beta1, beta2, step):
    bc1 = 1 - beta1 ** step
    bc2 = 1 - beta2 ** step
    step_size = lr / bc1
    return step_size, 1.0 / bc2 ** 0.5, (1 - beta1) / (beta1 * step_size)


def eco_adamw_fp8_step_triton(codes, scales, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay,
                              step, rounding="rtn", seed=0) -> None:
    """Host launcher (also runs on CPU tensors under TRITON_INTERPRET=1)."""
    _check(codes, scales, grad, exp_avg, exp_avg_sq, rounding)
    if lr == 0:  # master-weight semantics: moments move, the weight does not
        Fn.adam_moments_(exp_avg, exp_avg_sq, grad.float(), beta1=beta1, beta2=beta2, step=step, eps=eps, lr=lr)
        return
    r, c = codes.shape
    step_size, inv_sqrt_bc2, inj = _coeffs(lr, beta1, beta2, step)
    block = min(triton.next_power_of_2(c), MAX_ONE_PASS)
    nb = triton.cdiv(c, block)
    warps = 4 if block <= 1024 else (8 if block <= 4096 else 16)
    _eco_adamw_fp8_kernel[(r,)](codes.view(torch.uint8), scales, grad, exp_avg, exp_avg_sq, c,
                                float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
                                float(step_size), float(inv_sqrt_bc2), float(inj), int(seed),
                                SR=(rounding == "sr"), BLOCK=block, NB=nb, num_warps=warps)


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
    fn = eco_adamw_fp8_step_triton if HAS_TRITON else eco_adamw_fp8_step_ref
    fn(codes, scales, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
       weight_decay=weight_decay, step=step, rounding=rounding, seed=seed)


@_eco_op.register_fake
def _(codes, scales, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, rounding, seed):
    return None


def eco_adamw_fp8_step(codes, scales, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
                       rounding="rtn", seed=0) -> None:
    """In-place fused ECO-AdamW step (memory-free rule). CUDA: Triton; CPU: the Triton kernel under
    TRITON_INTERPRET=1, else the torch reference."""
    if codes.device.type == "cpu" and INTERPRET and HAS_TRITON:
        return eco_adamw_fp8_step_triton(codes, scales, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2,
                                         eps=eps, weight_decay=weight_decay, step=step, rounding=rounding, seed=seed)
    torch.ops.hfq.eco_adamw_fp8_step(codes, scales, grad, exp_avg, exp_avg_sq, float(lr), float(beta1),
                                     float(beta2), float(eps), float(weight_decay), int(step), rounding, int(seed))
