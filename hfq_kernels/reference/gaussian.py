"""QuEST's Gaussian grid: MSE-optimal clipping factors alpha* for N(0, 1), trust thresholds, rounding.

A tensor is RMS-normalised (so it looks like N(0, 1)), clipped at alpha* and rounded to a grid that
spans [-alpha*, alpha*]:
  int grid (b bits): 2^b uniform levels  alpha * (2k - (2^b - 1)) / (2^b - 1), k = 0 .. 2^b - 1
                     (symmetric, no zero level; b = 1 gives +-alpha).
  fp4 grid:          the E2M1 values +-{0, .5, 1, 1.5, 2, 3, 4, 6} scaled so that 6 -> alpha.
Every quantized value is `level * unit` with an exact small `level` (an odd integer for int, an E2M1
value for fp4) and `unit = alpha * rms / (2^b - 1)` (int) or `alpha * rms / 6` (fp4): half a step of
the int grid. `alpha*` minimises E[(xi - Q_alpha(xi))^2], xi ~ N(0,1); the table below was computed
by `solve_alpha` (Gauss-Legendre cell integrals + golden-section search); a test re-derives it.
"""
from __future__ import annotations

import math

import torch

from hfq_kernels.reference.fp4 import E2M1_VALUES, e2m1_decode, e2m1_encode

GRIDS = ("int", "fp4")
BITS = tuple(range(1, 9))

# alpha* for N(0,1), re-derived by tests/test_gaussian.py (tolerance 1e-6). The table in the public QuEST
# code agrees to 1e-4 up to 4 bits but sits up to 1% low at 5-8 bits (its MSE there is higher than ours).
INT_ALPHA = {
    1: 0.7978845608,  # = sqrt(2/pi): the two levels are the conditional means +-E|xi|
    2: 1.4935300555,
    3: 2.0510680542,
    4: 2.5140046063,
    5: 2.9161512511,
    6: 3.2779848083,
    7: 3.6110972046,
    8: 3.9222044347,
}
FP4_ALPHA = 2.9224750898

# Default outer trust scale s at 1 bit (paper App. A.2): 1.30 with the Hadamard transform, 1.25 without.
TRUST_SCALE_1BIT_HT = 1.30
TRUST_SCALE_1BIT_NO_HT = 1.25


def check_bits_grid(bits, grid: str = "int") -> None:
    if grid not in GRIDS:
        raise ValueError(f"grid: unknown {grid!r}; allowed {GRIDS}")
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"bits: {bits!r} not allowed; allowed integers 1..8")
    if grid == "fp4" and bits != 4:
        raise ValueError(f"bits: the fp4 grid has 4 bits, got {bits}")


# ----------------------------------------------------------------------------- levels and MSE
def grid_levels(bits: int, grid: str = "int", alpha: float = 1.0) -> list[float]:
    """All distinct quantization levels (ascending) of the grid scaled to [-alpha, alpha]."""
    check_bits_grid(bits, grid)
    if grid == "fp4":
        mags = [alpha * v / 6.0 for v in E2M1_VALUES]
        return sorted({-m for m in mags} | set(mags))
    n = 2**bits
    return [alpha * (2 * k - (n - 1)) / (n - 1) for k in range(n)]


_GL_NODES, _GL_WEIGHTS = None, None


def _gauss_legendre(n: int = 24):
    global _GL_NODES, _GL_WEIGHTS
    if _GL_NODES is None:
        import numpy as np

        _GL_NODES, _GL_WEIGHTS = (v.tolist() for v in np.polynomial.legendre.leggauss(n))
    return _GL_NODES, _GL_WEIGHTS


def _cell_integral(q: float, a: float, b: float) -> float:
    """int_a^b (x - q)^2 phi(x) dx by Gauss-Legendre (the integrand is smooth; no cancellation)."""
    nodes, weights = _gauss_legendre()
    half, mid = (b - a) / 2, (a + b) / 2
    c = 1.0 / math.sqrt(2.0 * math.pi)
    return half * sum(w * (mid + half * t - q) ** 2 * c * math.exp(-0.5 * (mid + half * t) ** 2)
                      for t, w in zip(nodes, weights))


def gaussian_mse(levels: list[float], tail: float = 12.0) -> float:
    """E[(xi - q(xi))^2] for xi ~ N(0,1) and nearest-level rounding q: a sum of per-cell integrals
    (the outermost cells integrated out to +-`tail` in pieces, beyond which phi < 1e-31)."""
    lv = sorted(levels)
    edges = [(lv[i] + lv[i + 1]) / 2 for i in range(len(lv) - 1)]
    lo_edge, hi_edge = -max(tail, abs(lv[0]) + 8), max(tail, lv[-1] + 8)
    edges = [lo_edge] + edges + [hi_edge]
    total = 0.0
    for q, a, b in zip(lv, edges[:-1], edges[1:]):
        pieces = max(1, math.ceil((b - a) / 1.0))  # unit-length pieces keep the quadrature exact
        for j in range(pieces):
            total += _cell_integral(q, a + (b - a) * j / pieces, a + (b - a) * (j + 1) / pieces)
    return total


def solve_alpha(bits: int, grid: str = "int", lo: float = 0.05, hi: float = 8.0) -> float:
    """Numerically find alpha* = argmin_alpha MSE(N(0,1), grid scaled to alpha): coarse scan, then
    golden-section search in the bracket around the best scan point."""
    check_bits_grid(bits, grid)
    f = lambda a: gaussian_mse(grid_levels(bits, grid, a))  # noqa: E731
    n_scan = 400
    xs = [lo + (hi - lo) * i / n_scan for i in range(n_scan + 1)]
    i_best = min(range(len(xs)), key=lambda i: f(xs[i]))
    a, b = xs[max(i_best - 1, 0)], xs[min(i_best + 1, n_scan)]
    g = (math.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    while b - a > 1e-11:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2


def alpha_star(bits: int, grid: str = "int") -> float:
    """MSE-optimal clip (in RMS units) for the grid."""
    check_bits_grid(bits, grid)
    return FP4_ALPHA if grid == "fp4" else INT_ALPHA[bits]


def max_level(bits: int, grid: str = "int") -> float:
    """Largest |level| in units of `unit`: 2^b - 1 (int) or 6 (fp4)."""
    check_bits_grid(bits, grid)
    return 6.0 if grid == "fp4" else float(2**bits - 1)


def unit_rms(bits: int, grid: str = "int") -> float:
    """`unit` per unit of RMS: alpha*/(2^b - 1) (int) or alpha*/6 (fp4)."""
    return alpha_star(bits, grid) / max_level(bits, grid)


def trust_threshold(bits: int, grid: str = "int") -> float:
    """Trust threshold T in RMS units: half the (largest) grid interval, i.e. alpha*/(2^b - 1) for int,
    alpha*/6 for fp4 (the 4 -> 6 interval of E2M1)."""
    return unit_rms(bits, grid)


def default_trust_scale(bits: int, hadamard: bool) -> float:
    """Outer trust scale s: 1.30 (HT) / 1.25 (no HT) at 1 bit, 1 otherwise (paper Sec. 3.3, App. A.2)."""
    if bits == 1:
        return TRUST_SCALE_1BIT_HT if hadamard else TRUST_SCALE_1BIT_NO_HT
    return 1.0


# ----------------------------------------------------------------------------- rounding
def round_to_levels(t: torch.Tensor, bits: int, grid: str = "int") -> torch.Tensor:
    """t = x / unit (float32) -> nearest level (float32, exact small numbers), clipped to the grid.
    int: odd integers in [-(2^b-1), 2^b-1] via k = floor((t + 2^b)/2); fp4: E2M1 (ties to even code)."""
    if grid == "fp4":
        return e2m1_decode(e2m1_encode(t))
    n = 2**bits
    k = torch.clamp(torch.floor((t + n) * 0.5), 0, n - 1)
    return 2.0 * k - (n - 1)


def levels_to_codes(level: torch.Tensor, bits: int, grid: str = "int") -> torch.Tensor:
    """Exact levels -> unsigned codes (uint8): k = (level + 2^b - 1)/2 for int; E2M1 sign|index for fp4."""
    if grid == "fp4":
        return e2m1_encode(level)
    n = 2**bits
    return torch.round((level + (n - 1)) * 0.5).to(torch.uint8)


def codes_to_levels(codes: torch.Tensor, bits: int, grid: str = "int") -> torch.Tensor:
    """Inverse of `levels_to_codes` (float32)."""
    if grid == "fp4":
        return e2m1_decode(codes)
    n = 2**bits
    return 2.0 * codes.float() - (n - 1)


def quest_project(xh: torch.Tensor, bits: int, grid: str = "int", trust_scale: float = 1.0,
                  eps: float = 1e-12):
    """QuEST projection of rows of `xh` (already in the Hadamard domain, or not, for the ablation).

    Returns (xq float32, trust mask bool, unit float32 [rows]): xq = level * unit per row,
    unit = unit_rms * RMS(row); mask = |xq - xh| <= T*RMS inside the clip range and <= s*T*RMS in the
    outermost regions (|xh| > alpha*RMS)."""
    check_bits_grid(bits, grid)
    x = xh.float()
    rms = torch.sqrt(torch.mean(x * x, dim=-1))
    unit = (unit_rms(bits, grid) * torch.clamp(rms, min=eps)).to(torch.float32)
    inv = 1.0 / unit
    t = x * inv[..., None]
    level = round_to_levels(t, bits, grid)
    xq = level * unit[..., None]
    err = (level - t).abs()  # in units of `unit` = T*RMS
    lim = max_level(bits, grid)
    mask = err <= torch.where(t.abs() <= lim, 1.0, float(trust_scale))
    return xq, mask, unit
