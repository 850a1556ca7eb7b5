"""NVFP4 beyond round-to-nearest, in pure torch (CPU and GPU): scale search and GPTQ. Same format as fp4.nvfp4_quantize.

Scale search (data-free): per 16-block the E4M3 scale among the RTN one and its neighbours on the E4M3 grid
(`byte_offsets`) with the least squared reconstruction error; optionally per tensor the global scale among
`global_factors` times 448*6/amax (least total error after the block search). GPTQ (Frantar et al. 2022): columns quantized
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
# Searching the global scale too (e.g. factors 1, 15/16, ..., 9/16 of 448*6/amax) removed 0.15% more squared error
# on SmolLM2's weights than the block search alone, at 5x the time: by default the global scale is amax's.
GLOBAL_FACTORS = (1.0,)


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


def e2m1_values(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the E2M1 grid as float32 values (no codes): steps of 0.5 below 2, 1 below 4, 2 up to 6, ties to
    the even code (torch.round is half-to-even on each step), saturating at +-6; equal to e2m1_round's values."""
    x = x.float()
    mag = x.abs()
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    return torch.copysign(torch.round(mag / step).mul_(step).clamp_(max=fp4.E2M1_MAX), x)


def block_error(blocks: torch.Tensor, scale: torch.Tensor, recip: torch.Tensor) -> torch.Tensor:
    """Squared error per block of `blocks` [..., nb, 16] quantized with E4M3 scales `scale` (float32 values,
    [..., nb]) and reciprocal global scale(s) `recip` (broadcast to [..., nb])."""
    eff = scale / recip
    safe = torch.where(eff > 0, eff, torch.ones_like(eff))
    vals = e2m1_values(blocks / safe[..., None]).mul_(eff[..., None])  # a zero scale gives zeros
    return vals.sub_(blocks).square_().sum(-1)


def search_block_scales(blocks: torch.Tensor, recip: torch.Tensor, byte_offsets=BYTE_OFFSETS):
    """Per block, the E4M3 scale (float32 value) among the RTN scale's byte neighbours `byte_offsets` with the least
    squared error, and that error (None when the only candidate is offset 0). Ties keep the earliest offset (put 0
    first to prefer round-to-nearest)."""
    bmax = blocks.abs().amax(-1)
    rtn = _e4m3_bytes(bmax / torch.full_like(bmax, fp4.E2M1_MAX) * recip)
    if tuple(byte_offsets) == (0,):
        return _from_bytes(rtn), None
    best_s = best_e = None
    for d in byte_offsets:
        s = _from_bytes(rtn + d)
        e = block_error(blocks, s, recip)
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
    recip0 = fp4.nvfp4_global_scale(w.float(), name)
    chunks = [w[i:i + row_chunk].float().reshape(-1, k // fp4.NVFP4_BLOCK, fp4.NVFP4_BLOCK)
              for i in range(0, out, row_chunk)]
    best = None
    for f in global_factors:
        recip = (recip0 * f).clamp(max=fp4.NVFP4_MAX_RECIP) if f != 1.0 else recip0
        scales, err = [], 0.0
        for blocks in chunks:
            s, e = search_block_scales(blocks, recip, byte_offsets)
            scales.append(s)
            if len(global_factors) > 1:
                e = block_error(blocks, s, recip) if e is None else e
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
    mean = d.mean().clamp_min(1e-12)
    d.add_(damp * mean)
    lam = max(damp, 1e-4) * mean  # the retries' step: grows even from damp = 0
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
    WT = w.float().T.contiguous()  # [in, rows]: a column of w is a contiguous row here
    r = recip.float().reshape(-1).expand(rows).reshape(rows, 1)
    VT = torch.empty(k, rows, dtype=torch.float32, device=w.device)  # E2M1 grid values; codes at the end
    scales = torch.empty(rows, k // G, dtype=torch.float32, device=w.device)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        W1 = WT[i1:i2]  # a view: updated in place
        U1 = u[i1:i2, i1:i2]
        E1 = torch.empty_like(W1)
        for j in range(i2 - i1):
            if j % G == 0:
                s, _ = search_block_scales(W1[j:j + G].T.reshape(rows, 1, G), r, byte_offsets)
                scales[:, (i1 + j) // G] = s[:, 0]
                eff = (s / r)[:, 0]
                live = eff > 0
                safe = torch.where(live, eff, torch.ones_like(eff))
            col = W1[j]
            v = torch.where(live, e2m1_values(col / safe), col * 0)
            VT[i1 + j] = v
            err = (col - v * eff) / U1[j, j]
            W1[j:].addr_(U1[j, j:], err, alpha=-1)
            E1[j] = err
        if i2 < k:
            WT[i2:].addmm_(u[i1:i2, i2:].T, E1, alpha=-1)
    codes, _ = e2m1_round(VT.T.contiguous())
    return fp4.pack_fp4(codes), scales.to(torch.float8_e4m3fn)
