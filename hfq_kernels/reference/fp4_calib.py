"""NVFP4 beyond round-to-nearest, in pure torch (CPU and GPU): scale search and GPTQ. Same format as fp4.nvfp4_quantize.

Scale search (data-free): per tensor a global scale from `global_factors` times 448*6/amax, per 16-block the E4M3
scale among the RTN one and its neighbours on the E4M3 grid (`byte_offsets`), each chosen to minimise the squared
reconstruction error (blocks first, summed per tensor for the global). GPTQ (Frantar et al. 2022): columns quantized
in order against the inverse-Hessian Cholesky factor of the calibration inputs, each column's error pushed onto the
columns not yet quantized; a 16-block's scale is fixed from the error-updated weights when the pass reaches it.
Rows may carry their own global scale (several layers sharing one input are quantized as one row-stacked matrix).
"""
from __future__ import annotations

import torch

from . import fp4

# E2M1 decision boundaries as bucketize thresholds (count of thresholds strictly below |x| = magnitude index);
# a boundary whose tie goes up (to the even index above) is moved one float32 ulp down, so the result equals
# fp4.e2m1_encode bit for bit.
_TIE_UP = (False, True, False, True, False, True, False)
BYTE_OFFSETS = (0, -1, -2, 1)
GLOBAL_FACTORS = (1.0, 0.9375, 0.875, 0.8125, 0.75, 0.6875, 0.625, 0.5625)


def _thresholds(device) -> torch.Tensor:
    b = torch.tensor(fp4._BOUNDS, dtype=torch.float32, device=device)
    down = torch.nextafter(b, torch.full_like(b, -1.0))
    return torch.where(torch.tensor(_TIE_UP, device=device), down, b)


def e2m1_round(x: torch.Tensor, thresholds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8, values float32) of x rounded to E2M1 (saturating at +-6), equal to fp4.e2m1_encode/decode."""
    x = x.float()
    t = _thresholds(x.device) if thresholds is None else thresholds
    idx = torch.bucketize(x.abs(), t, right=False)
    table = torch.tensor(fp4.E2M1_VALUES, dtype=torch.float32, device=x.device)
    neg = torch.signbit(x)
    codes = idx.to(torch.uint8) | (neg.to(torch.uint8) << 3)
    mag = table[idx]
    return codes, torch.where(neg, -mag, mag)


def _e4m3_bytes(v: torch.Tensor) -> torch.Tensor:
    return v.clamp(max=fp4.E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int16)


def _from_bytes(b: torch.Tensor) -> torch.Tensor:
    return b.clamp(0, 0x7E).to(torch.uint8).view(torch.float8_e4m3fn).float()


def block_error(blocks: torch.Tensor, scale: torch.Tensor, recip: torch.Tensor, thresholds=None) -> torch.Tensor:
    """Squared error per block of `blocks` [..., nb, 16] quantized with E4M3 scales `scale` (float32 values,
    [..., nb]) and reciprocal global scale(s) `recip` (broadcast to [..., nb])."""
    eff = scale / recip
    safe = torch.where(eff > 0, eff, torch.ones_like(eff))
    _, vals = e2m1_round(torch.where((eff > 0)[..., None], blocks / safe[..., None], blocks * 0), thresholds)
    return (vals * eff[..., None] - blocks).square().sum(-1)


def search_block_scales(blocks: torch.Tensor, recip: torch.Tensor, byte_offsets=BYTE_OFFSETS, thresholds=None):
    """Per block, the E4M3 scale (float32 value) among the RTN scale's byte neighbours `byte_offsets` with the least
    squared error, and that error (None when the only candidate is offset 0). Ties keep the earliest offset (put 0 first to prefer round-to-nearest)."""
    bmax = blocks.abs().amax(-1)
    rtn = _e4m3_bytes(bmax / torch.full_like(bmax, fp4.E2M1_MAX) * recip)
    if tuple(byte_offsets) == (0,):
        return _from_bytes(rtn), None
    best_s = best_e = None
    for d in byte_offsets:
        s = _from_bytes(rtn + d)
        e = block_error(blocks, s, recip, thresholds)
        if best_s is None:
            best_s, best_e = s, e
        else:
            take = e < best_e
            best_s, best_e = torch.where(take, s, best_s), torch.where(take, e, best_e)
    return best_s, best_e


def encode(w: torch.Tensor, scale: torch.Tensor, recip: torch.Tensor) -> torch.Tensor:
    """Packed codes of w [out, in] for given E4M3 block scales (float32 values [out, in/16]) and recip (scalar or
    [out, 1]), rounding exactly as fp4.nvfp4_quantize does."""
    out, k = w.shape
    blocks = w.float().reshape(out, k // fp4.NVFP4_BLOCK, fp4.NVFP4_BLOCK)
    eff = scale / recip
    safe = torch.where(eff > 0, eff, torch.ones_like(eff))
    codes, _ = e2m1_round(torch.where((eff > 0)[..., None], blocks / safe[..., None], blocks * 0))
    return fp4.pack_fp4(codes.reshape(out, k))


def nvfp4_quantize_search(w: torch.Tensor, global_factors=GLOBAL_FACTORS, byte_offsets=BYTE_OFFSETS,
                          name: str = "weight", row_chunk: int = 4096):
    """NVFP4 of w [out, in] with searched scales: (packed u8 [out, in/2], scale e4m3 [out, in/16], recip f32 [1]).

    Never worse than fp4.nvfp4_quantize in squared error (its scales are the first candidates). Rows are processed
    `row_chunk` at a time to bound the extra memory to a few copies of that many rows in float32."""
    fp4._check_2d(w, fp4.NVFP4_BLOCK, name)
    fp4.check_finite(w, name)
    out, k = w.shape
    t = _thresholds(w.device)
    recip0 = fp4.nvfp4_global_scale(w.float())
    chunks = [w[i:i + row_chunk].float().reshape(-1, k // fp4.NVFP4_BLOCK, fp4.NVFP4_BLOCK)
              for i in range(0, out, row_chunk)]
    best = None
    for f in global_factors:
        recip = recip0 * f if f != 1.0 else recip0
        scales, err = [], 0.0
        for blocks in chunks:
            s, e = search_block_scales(blocks, recip, byte_offsets, t)
            scales.append(s)
            if len(global_factors) > 1:
                e = block_error(blocks, s, recip, t) if e is None else e
                err = err + e.double().sum()
        if best is None or err < best[0]:
            best = (err, recip, scales)
    _, recip, scales = best
    scale = torch.cat(scales).reshape(out, k // fp4.NVFP4_BLOCK)
    return encode(w, scale, recip), scale.to(torch.float8_e4m3fn), recip


def hessian_inverse_factor(h: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)^-1 (float32 [in, in]): what the GPTQ pass reads."""
    h = h.float().clone()
    d = h.diagonal()
    lam = damp * d.mean().clamp_min(1e-12)
    d.add_(lam)
    for _ in range(6):  # a near-singular H (few tokens): more damping until it factors
        L, info = torch.linalg.cholesky_ex(h)
        if int(info) == 0:
            break
        d.add_(lam * 9)
        lam = lam * 10
    else:
        raise ValueError("GPTQ: the calibration Hessian is not positive definite even with strong damping")
    hinv = torch.cholesky_inverse(L)
    return torch.linalg.cholesky(hinv, upper=True)


def nvfp4_gptq(w: torch.Tensor, u: torch.Tensor, recip: torch.Tensor, block: int = 128, byte_offsets=(0,)):
    """GPTQ into NVFP4: w [rows, in], u the upper inverse-Hessian factor [in, in] (hessian_inverse_factor), recip
    the reciprocal global scale per row [rows] (or [1]). Returns (packed u8 [rows, in/2], scale e4m3 [rows, in/16]).

    Each 16-block's scale is chosen when the pass reaches it, from the weights as updated by the error of the
    columns before, among `byte_offsets` around the RTN scale (least squared error); `block` is the lazy-update
    width (a multiple of 16)."""
    rows, k = w.shape
    G = fp4.NVFP4_BLOCK
    if k % G or block % G:
        raise ValueError(f"nvfp4_gptq: in_features={k} and block={block} must be multiples of {G}")
    if tuple(u.shape) != (k, k):
        raise ValueError(f"nvfp4_gptq: the Hessian factor must be [{k}, {k}], got {tuple(u.shape)}")
    t = _thresholds(w.device)
    W = w.float().clone()
    r = recip.float().reshape(-1).expand(rows).reshape(rows, 1)
    codes = torch.empty(rows, k, dtype=torch.uint8, device=w.device)
    scales = torch.empty(rows, k // G, dtype=torch.float32, device=w.device)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        W1 = W[:, i1:i2]  # a view: updated in place
        U1 = u[i1:i2, i1:i2]
        E1 = torch.empty_like(W1)
        for j in range(i2 - i1):
            if j % G == 0:
                s, _ = search_block_scales(W1[:, j:j + G].reshape(rows, 1, G), r, byte_offsets, t)
                scales[:, (i1 + j) // G] = s[:, 0]
                eff = (s / r)[:, 0]
                live = eff > 0
                safe = torch.where(live, eff, torch.ones_like(eff))
            col = W1[:, j]
            c, v = e2m1_round(torch.where(live, col / safe, col * 0), t)
            codes[:, i1 + j] = c
            err = (col - v * eff) / U1[j, j]
            W1[:, j:].addr_(err, U1[j, j:], alpha=-1)
            E1[:, j] = err
        if i2 < k:
            W[:, i2:].addmm_(E1, u[i1:i2, i2:], alpha=-1)
    return fp4.pack_fp4(codes), scales.to(torch.float8_e4m3fn)
