"""QuEST fused kernels: HT + RMS + quantize + trust mask (forward), masked inverse HT (backward).

Ops (CPU = torch reference below, CUDA = Triton):
  hfq::quest_quantize(x[R, K], bits, fp4, trust_scale, block) -> (xq[R, K] x.dtype, mask u8[R, ceil(K/8)],
      unit f32[R]).  xq = level * unit is the QuEST projection of HT(x) (block = 0: no HT); the trust
      mask bit is 1 where the gradient is trusted; element 8j+i is bit i of byte j.
  hfq::quest_masked_ht(g[R, K], mask, block) -> HT(g * mask)  (the inverse HT equals the HT).

Forward kernels. The block-orthogonal HT keeps row norms, so RMS(HT(x)) = RMS(x): the scale needs
no transform. Two-pass kernel, one program per BM = 16 rows: pass 1 sums x^2 over the row; pass 2
reloads the row (usually from L2), transforms each B-wide block with one tensor-core dot, rounds,
writes xq and one byte per 8 mask bits. Whole-row kernel (HT on): one program holds BM whole rows in
registers as one [BM * NB, B] tile (tile row = one B-wide block of one row, NB = next power of two
of K/B, pad blocks masked off), so x is read once. The two-pass kernel has only R/16 programs, each
walking its rows serially: it is used where it still fills the GPU (activations, R = tokens), the
whole-row kernel where it would not (weights, R = out_features).
hfq::quest_quantize takes an optional out_dtype for xq (default x.dtype): the weight path quantizes
the bf16 master weight directly (products with +-1 are exact, sums in fp32, as for an fp32 copy) and
asks for the matmul dtype (training) or fp32 (code export).

Masked inverse HT: one [BM, B] tile per program; with the transform each element loads its mask byte
(8 lanes share one) and takes its bit, without it the byte tile is expanded by a reshape (the expansions
the launcher used on the H100 runs of benchmarks/quest_step.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from hfq_kernels._triton import LRU, on_gpu, sm_count, tl, triton
from hfq_kernels.hadamard import MAX_TRITON_BLOCK, MIN_TRITON_BLOCK, hadamard_tile, use_ieee
from hfq_kernels.reference import gaussian
from hfq_kernels.reference.hadamard import effective_block, fwht

NO_HT_CHUNK = 128  # column tile of the kernels when there is no transform
EPS = 1e-12


# ----------------------------------------------------------------------------- references
def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool [..., K] -> uint8 [..., ceil(K/8)], element 8j+i in bit i of byte j (zero padded)."""
    K = mask.shape[-1]
    pad = (-K) % 8
    m = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad)).reshape(*mask.shape[:-1], (K + pad) // 8, 8)
    w = (1 << torch.arange(8, device=mask.device, dtype=torch.int32)).to(torch.uint8)
    return (m * w).sum(-1).to(torch.uint8)


def unpack_mask(packed: torch.Tensor, K: int) -> torch.Tensor:
    """uint8 [..., ceil(K/8)] -> bool [..., K]."""
    sh = torch.arange(8, device=packed.device, dtype=torch.uint8)
    bits = (packed[..., None] >> sh) & 1
    return bits.reshape(*packed.shape[:-1], packed.shape[-1] * 8)[..., :K].bool()


def _grid_name(fp4: bool) -> str:
    return "fp4" if fp4 else "int"


def quest_quantize_ref(x: torch.Tensor, bits: int, fp4: bool, trust_scale: float, block: int,
                      out_dtype: torch.dtype | None = None):
    """Torch reference of hfq::quest_quantize on a 2-D tensor (xq in out_dtype, default x.dtype)."""
    xh = fwht(x.float(), block) if block else x.float()  # transform kept in fp32, as the kernel
    xq, mask, unit = gaussian.quest_project(xh, bits, _grid_name(fp4), trust_scale, EPS)
    return xq.to(out_dtype or x.dtype), pack_mask(mask), unit


def quest_masked_ht_ref(g: torch.Tensor, mask: torch.Tensor | None, block: int) -> torch.Tensor:
    """Torch reference of hfq::quest_masked_ht on a 2-D tensor (mask None = all trusted)."""
    gm = g if mask is None else torch.where(unpack_mask(mask, g.shape[-1]), g, torch.zeros_like(g))
    if block:
        return fwht(gm, block)
    return gm.clone() if gm is g else gm  # an op output may not alias its input


# ----------------------------------------------------------------------------- Triton
@triton.jit
def _e2m1_level(t):
    """Nearest signed E2M1 value of t (saturating at +-6, ties to the even code, as reference.fp4)."""
    a = tl.abs(t)
    idx = (a > 0.25).to(tl.int32)
    idx += ((a > 0.75) | (a == 0.75)).to(tl.int32)
    idx += (a > 1.25).to(tl.int32)
    idx += ((a > 1.75) | (a == 1.75)).to(tl.int32)
    idx += (a > 2.5).to(tl.int32)
    idx += ((a > 3.5) | (a == 3.5)).to(tl.int32)
    idx += (a > 5.0).to(tl.int32)
    mag = tl.where(idx <= 4, idx.to(tl.float32) * 0.5,
                   tl.where(idx == 5, 3.0, tl.where(idx == 6, 4.0, 6.0)))
    return tl.where(t < 0, -mag, mag)


@triton.jit
def _quest_quantize_kernel(x_ptr, xq_ptr, mask_ptr, unit_ptr, R, K: tl.constexpr, KB, unit_rms, inv_sqrt_b,
                           outer_trust, eps,
                           NLEV: tl.constexpr, FP4: tl.constexpr, HT: tl.constexpr, B: tl.constexpr,
                           BM: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BM + tl.arange(0, BM)
    rmask = rows < R
    base = rows.to(tl.int64)[:, None] * K
    ar = tl.arange(0, B)
    acc = tl.zeros([BM, B], dtype=tl.float32)
    for k0 in range(0, K, B):
        cols = k0 + ar
        m = rmask[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
        acc += x * x
    rms = tl.sqrt(tl.sum(acc, axis=1) / K)
    unit = unit_rms * tl.maximum(rms, eps)
    inv = 1.0 / unit
    tl.store(unit_ptr + rows, unit, mask=rmask)
    if FP4:
        lim = 6.0
    else:
        lim = NLEV - 1.0
    if IEEE:
        h = hadamard_tile(B, tl.float32)
    else:
        h = hadamard_tile(B, x_ptr.dtype.element_ty)
    w8 = (1 << tl.arange(0, 8)).to(tl.int32)
    bcol = tl.arange(0, B // 8)
    for k0 in range(0, K, B):
        cols = k0 + ar
        cmask = (cols < K)[None, :]
        m = rmask[:, None] & cmask
        x = tl.load(x_ptr + base + cols[None, :], mask=m, other=0.0)
        if HT:
            if IEEE:
                xh = tl.dot(x.to(tl.float32), h, input_precision="ieee")
            else:
                xh = tl.dot(x, h)
            xh = xh * inv_sqrt_b
        else:
            xh = x.to(tl.float32)
        t = xh * inv[:, None]
        if FP4:
            level = _e2m1_level(t)
        else:
            k = tl.minimum(tl.maximum(tl.floor((t + NLEV) * 0.5), 0.0), NLEV - 1.0)
            level = 2.0 * k - (NLEV - 1.0)
        xq = level * unit[:, None]
        err = tl.abs(level - t)
        keep = (err <= tl.where(tl.abs(t) <= lim, 1.0, outer_trust)) & cmask
        tl.store(xq_ptr + base + cols[None, :], xq.to(xq_ptr.dtype.element_ty), mask=m)
        kb = tl.reshape(keep.to(tl.int32), (BM, B // 8, 8))
        byte = tl.sum(kb * w8[None, None, :], axis=2).to(tl.uint8)
        bcols = k0 // 8 + bcol
        tl.store(mask_ptr + rows.to(tl.int64)[:, None] * KB + bcols[None, :], byte,
                 mask=rmask[:, None] & (bcols < KB)[None, :])


@triton.jit
def _quest_quantize_rows_kernel(x_ptr, xq_ptr, mask_ptr, unit_ptr, R, K, KB, unit_rms, inv_sqrt_b,
                                outer_trust, eps,
                                NLEV: tl.constexpr, FP4: tl.constexpr, B: tl.constexpr, NB: tl.constexpr,
                                BM: tl.constexpr, IEEE: tl.constexpr):
    """HT on, whole rows in registers: tile row t is block t % NB of row pid * BM + t // NB."""
    pid = tl.program_id(0)
    t = tl.arange(0, BM * NB)
    r = pid * BM + t // NB
    j = t % NB
    tval = (r < R) & (j < K // B)
    ar = tl.arange(0, B)
    m = tval[:, None] & (ar < B)[None, :]
    offs = r.to(tl.int64)[:, None] * K + (j * B)[:, None] + ar[None, :]
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    xf = x.to(tl.float32)
    ss = tl.sum(tl.reshape(tl.sum(xf * xf, axis=1), (BM, NB)), axis=1)  # [BM] sums of squares
    unit_r = unit_rms * tl.maximum(tl.sqrt(ss / K), eps)
    rows = pid * BM + tl.arange(0, BM)
    tl.store(unit_ptr + rows, unit_r, mask=rows < R)
    unit = tl.reshape(tl.broadcast_to(unit_r[:, None], (BM, NB)), (BM * NB,))
    inv = 1.0 / unit
    if IEEE:
        xh = tl.dot(xf, hadamard_tile(B, tl.float32), input_precision="ieee")
    else:
        xh = tl.dot(x, hadamard_tile(B, x_ptr.dtype.element_ty))
    tq = xh * inv_sqrt_b * inv[:, None]
    if FP4:
        lim = 6.0
        level = _e2m1_level(tq)
    else:
        lim = NLEV - 1.0
        k = tl.minimum(tl.maximum(tl.floor((tq + NLEV) * 0.5), 0.0), NLEV - 1.0)
        level = 2.0 * k - (NLEV - 1.0)
    xq = level * unit[:, None]
    tl.store(xq_ptr + offs, xq.to(xq_ptr.dtype.element_ty), mask=m)
    keep = tl.abs(level - tq) <= tl.where(tl.abs(tq) <= lim, 1.0, outer_trust)
    w8 = (1 << tl.arange(0, 8)).to(tl.int32)
    kb = tl.reshape(keep.to(tl.int32), (BM * NB, B // 8, 8))
    byte = tl.sum(kb * w8[None, None, :], axis=2).to(tl.uint8)
    bcols = (j * (B // 8))[:, None] + tl.arange(0, B // 8)[None, :]
    tl.store(mask_ptr + r.to(tl.int64)[:, None] * KB + bcols, byte,
             mask=tval[:, None] & (bcols < KB))


@triton.jit
def _quest_masked_ht_kernel(g_ptr, mask_ptr, out_ptr, R, K, KB, inv_sqrt_b,
                            HAS_MASK: tl.constexpr, HT: tl.constexpr, B: tl.constexpr,
                            BM: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * B + tl.arange(0, B)
    rmask = rows < R
    m = rmask[:, None] & (cols < K)[None, :]
    offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
    g = tl.load(g_ptr + offs, mask=m, other=0.0)
    if HAS_MASK:
        if HT:  # byte c // 8 of the row, loaded per element (8 lanes share a byte), bit c % 8
            byte = tl.load(mask_ptr + rows.to(tl.int64)[:, None] * KB + (cols // 8)[None, :], mask=m,
                           other=0).to(tl.int32)
            keep = (byte >> (cols % 8)[None, :]) & 1
        else:  # the row's [B/8] byte tile, expanded to bits by a reshape
            bcols = pid_k * (B // 8) + tl.arange(0, B // 8)
            byte = tl.load(mask_ptr + rows.to(tl.int64)[:, None] * KB + bcols[None, :],
                           mask=rmask[:, None] & (bcols < KB)[None, :], other=0).to(tl.int32)
            bit = (byte[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1
            keep = tl.reshape(bit, (BM, B))
        g = tl.where(keep != 0, g, 0.0).to(g.dtype)
    if HT:
        if IEEE:
            out = tl.dot(g.to(tl.float32), hadamard_tile(B, tl.float32), input_precision="ieee")
        else:
            out = tl.dot(g, hadamard_tile(B, g.dtype))
        out = out * inv_sqrt_b
    else:
        out = g
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=m)


def _tile(block: int, K: int) -> tuple[int, bool]:
    """(column tile, transform on?) for the kernels; block 0 = no HT."""
    if block:
        return effective_block(K, block), True
    return NO_HT_CHUNK, False


def triton_supported(x: torch.Tensor, block: int) -> bool:
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if not block:
        return True
    b = effective_block(x.shape[-1], block)
    return MIN_TRITON_BLOCK <= b <= MAX_TRITON_BLOCK


# launch settings (the plans cache keys on them; tests set them to reach each kernel)
ROW_KERNEL = True        # whole-row kernel where the two-pass kernel would have too few programs
TWO_PASS_MIN_WAVES = 3   # two-pass kernel when it has >= this many programs per SM (activations)
ROW_TILE_ELEMS = 8192    # elements of the whole-row kernel's register tile [BM * NB, B]
ROW_WARPS = 4
MASKED_BM = 64           # masked HT rows per tile (16-bit inputs, B <= 128)

_PLANS = LRU(512)  # per (rows, width, settings): variable-length batches bring a new row count each


def _row_tile(K: int, B: int) -> tuple[int, int] | None:
    """(BM, NB) of the whole-row kernel for a row of K = nblk * B, or None when it does not fit."""
    nb = triton.next_power_of_2(K // B)
    tile_rows = max(16, ROW_TILE_ELEMS // B)  # tl.dot needs at least 16 rows
    if nb > tile_rows:
        return None
    return tile_rows // nb, nb


def _quant_plan(x: torch.Tensor, bits: int, fp4: bool, trust_scale: float, block: int):
    """(kernel, grid, scalar args, meta) for quest_quantize on x, cached per shape and settings."""
    R, K = x.shape
    key = (R, K, x.dtype, x.device.type, x.device.index, bits, fp4, trust_scale, block, ROW_KERNEL,
           TWO_PASS_MIN_WAVES, ROW_TILE_ELEMS, ROW_WARPS)

    def make():
        gaussian.check_bits_grid(bits, _grid_name(fp4))
        B, ht = _tile(block, K)
        scalars = (R, K, (K + 7) // 8, gaussian.unit_rms(bits, _grid_name(fp4)), B ** -0.5, float(trust_scale), EPS)
        rt = _row_tile(K, B) if (ht and ROW_KERNEL) else None
        if rt is not None and triton.cdiv(R, 16) < TWO_PASS_MIN_WAVES * sm_count(x.device):
            bm, nb = rt
            plan = (_quest_quantize_rows_kernel, (triton.cdiv(R, bm),), scalars,
                    dict(NLEV=2**bits, FP4=fp4, B=B, NB=nb, BM=bm, IEEE=use_ieee(x), num_warps=ROW_WARPS))
        else:
            bm = 16 if B <= 128 else 8
            plan = (_quest_quantize_kernel, (triton.cdiv(R, bm),), scalars,
                    dict(NLEV=2**bits, FP4=fp4, HT=ht, B=B, BM=bm, IEEE=use_ieee(x), num_warps=4))
        return plan

    return _PLANS.get_or(key, make)


def quest_quantize_triton(x: torch.Tensor, bits: int, fp4: bool, trust_scale: float, block: int,
                          out_dtype: torch.dtype | None = None):
    """Host launcher of the fused forward (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    if x.dim() != 2:
        raise ValueError(f"quest_quantize: x must be 2-D [rows, K], got shape {tuple(x.shape)}")
    if not triton_supported(x, block):
        gaussian.check_bits_grid(bits, _grid_name(fp4))
        return quest_quantize_ref(x, bits, fp4, trust_scale, block, out_dtype)
    x = x.contiguous()
    kernel, grid, scalars, meta = _quant_plan(x, bits, fp4, trust_scale, block)
    R, K, KB = scalars[0], scalars[1], scalars[2]
    xq = torch.empty((R, K), dtype=out_dtype or x.dtype, device=x.device)
    mask = torch.empty((R, KB), dtype=torch.uint8, device=x.device)
    unit = torch.empty((R,), dtype=torch.float32, device=x.device)
    kernel[grid](x, xq, mask, unit, *scalars, **meta)
    return xq, mask, unit


def quest_masked_ht_triton(g: torch.Tensor, mask: torch.Tensor | None, block: int) -> torch.Tensor:
    """Host launcher of the masked inverse HT (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    if g.dim() != 2:
        raise ValueError(f"quest_masked_ht: g must be 2-D [rows, K], got shape {tuple(g.shape)}")
    if not triton_supported(g, block):
        return quest_masked_ht_ref(g, mask, block)
    g = g.contiguous()
    R, K = g.shape
    key = ("mht", R, K, g.dtype, block, mask is not None, g.is_cuda, MASKED_BM)
    def make():
        B, ht = _tile(block, K)
        bm = MASKED_BM if (B <= 128 and g.dtype != torch.float32) else 16
        return ((triton.cdiv(R, bm), triton.cdiv(K, B)), (R, K, (K + 7) // 8, B ** -0.5),
                dict(HAS_MASK=mask is not None, HT=ht, B=B, BM=bm, IEEE=use_ieee(g), num_warps=4))

    grid, scalars, meta = _PLANS.get_or(key, make)
    out = torch.empty_like(g)
    _quest_masked_ht_kernel[grid](g, mask if mask is not None else g, out, *scalars, **meta)
    return out


# ----------------------------------------------------------------------------- torch.library ops
@torch.library.custom_op("hfq::quest_quantize", mutates_args=())
def quest_quantize(x: torch.Tensor, bits: int, fp4: bool, trust_scale: float, block: int,
                   out_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if on_gpu(x):
        return quest_quantize_triton(x, bits, fp4, trust_scale, block, out_dtype)
    return quest_quantize_ref(x, bits, fp4, trust_scale, block, out_dtype)


@quest_quantize.register_fake
def _(x, bits, fp4, trust_scale, block, out_dtype=None):
    R, K = x.shape
    return (x.new_empty((R, K), dtype=out_dtype or x.dtype), x.new_empty((R, (K + 7) // 8), dtype=torch.uint8),
            x.new_empty((R,), dtype=torch.float32))


@torch.library.custom_op("hfq::quest_masked_ht", mutates_args=())
def quest_masked_ht(g: torch.Tensor, mask: torch.Tensor | None, block: int) -> torch.Tensor:
    if on_gpu(g):
        return quest_masked_ht_triton(g, mask, block)
    return quest_masked_ht_ref(g, mask, block)


@quest_masked_ht.register_fake
def _(g, mask, block):
    return torch.empty_like(g)
