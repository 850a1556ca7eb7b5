"""QuEST Gaussian grid: alpha* table re-derived, trust thresholds, rounding and mask semantics."""
import math

import pytest
import torch

from hfq_kernels.reference import gaussian as g


@pytest.mark.parametrize("bits", list(range(1, 9)))
def test_int_alpha_table_rederived(bits):
    assert g.solve_alpha(bits, "int") == pytest.approx(g.INT_ALPHA[bits], rel=1e-6)


def test_fp4_alpha_rederived_and_1bit_closed_form():
    assert g.solve_alpha(4, "fp4") == pytest.approx(g.FP4_ALPHA, rel=1e-6)
    # 1 bit: levels +-alpha, optimum at E|xi| = sqrt(2/pi), MSE = 1 - 2/pi
    assert g.INT_ALPHA[1] == pytest.approx(math.sqrt(2 / math.pi), rel=1e-9)
    assert g.gaussian_mse(g.grid_levels(1, "int", g.INT_ALPHA[1])) == pytest.approx(1 - 2 / math.pi, rel=1e-9)


@pytest.mark.parametrize("bits,grid", [(1, "int"), (2, "int"), (4, "int"), (8, "int"), (4, "fp4")])
def test_alpha_is_minimum_under_independent_quadrature(bits, grid):
    """An independent check through the torch rounding actually used: dense trapezoid over x, alpha*
    beats alpha* +- 3% (and the MSE matches the Gauss-Legendre value)."""
    x = torch.linspace(-9, 9, 1_800_001, dtype=torch.float64)
    w = torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi) * (x[1] - x[0])
    a = g.alpha_star(bits, grid)

    def mse(alpha):
        unit = alpha / g.max_level(bits, grid)
        q = g.round_to_levels((x / unit).float(), bits, grid).double() * unit
        return float((w * (x - q) ** 2).sum())

    m0 = mse(a)
    assert m0 < mse(a * 1.03) and m0 < mse(a * 0.97)
    assert m0 == pytest.approx(g.gaussian_mse(g.grid_levels(bits, grid, a)), rel=2e-3)


def test_levels_and_trust_thresholds():
    for b in range(1, 9):
        lv = g.grid_levels(b, "int", 1.0)
        assert len(lv) == 2**b and lv[0] == -1.0 and lv[-1] == 1.0
        assert g.trust_threshold(b) == pytest.approx(g.INT_ALPHA[b] / (2**b - 1))  # half a step
        assert g.trust_threshold(b) == pytest.approx((lv[1] - lv[0]) / 2 * g.INT_ALPHA[b])
    fp4 = g.grid_levels(4, "fp4", 6.0)
    assert fp4 == [-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert g.trust_threshold(4, "fp4") == pytest.approx(g.FP4_ALPHA / 6)  # largest half interval
    assert g.default_trust_scale(1, True) == 1.30 and g.default_trust_scale(1, False) == 1.25
    assert g.default_trust_scale(2, True) == 1.0


@pytest.mark.parametrize("bad", [0, 9, 2.0, True, None])
def test_bad_bits_refused(bad):
    with pytest.raises(ValueError, match="bits"):
        g.alpha_star(bad)


def test_bad_grid_refused():
    with pytest.raises(ValueError, match="grid"):
        g.alpha_star(4, "nf4")
    with pytest.raises(ValueError, match="bits"):
        g.alpha_star(3, "fp4")


def test_codes_levels_roundtrip():
    torch.manual_seed(0)
    t = torch.randn(2000) * 9
    for b in range(1, 9):
        lv = g.round_to_levels(t, b)
        assert set(lv.unique().tolist()) <= {float(2 * k - (2**b - 1)) for k in range(2**b)}
        c = g.levels_to_codes(lv, b)
        assert int(c.max()) <= 2**b - 1
        assert torch.equal(g.codes_to_levels(c, b), lv)
    lv = g.round_to_levels(t, 4, "fp4")
    assert torch.equal(g.codes_to_levels(g.levels_to_codes(lv, 4, "fp4"), 4, "fp4"), lv)


def test_project_hand_checked_2bit():
    # row: one outlier 6 and +-1; RMS = sqrt(43/8); unit = alpha2/3 * RMS.  t(6) = 5.20 -> clipped to
    # level 3, error 2.2 units > T = 1 unit -> untrusted; t(+-1) = +-0.87 -> level +-1, error 0.13 -> trusted.
    x = torch.tensor([[6.0, 1, -1, 1, -1, 1, -1, 1]])
    xq, mask, unit = g.quest_project(x, 2)
    u = g.INT_ALPHA[2] / 3 * math.sqrt(43 / 8)
    assert float(unit) == pytest.approx(u, rel=1e-6)
    assert torch.allclose(xq, torch.tensor([[3.0, 1, -1, 1, -1, 1, -1, 1]]) * u)
    assert mask.tolist() == [[False] + [True] * 7]


def test_project_hand_checked_1bit_outer_scale():
    # 1 bit: levels +-alpha1*RMS. x0 = 1.05 -> t = 2.204 units (unit = alpha1*RMS): error 1.204 is
    # beyond T = 1 but within s*T = 1.3, so only the outer scale keeps it trusted.
    x = torch.tensor([[1.05, 0.5, -0.5, 0.5, -0.5, 0.5, -0.5, 0.5]])
    rms = math.sqrt((1.05**2 + 7 * 0.25) / 8)
    _, m13, unit = g.quest_project(x, 1, trust_scale=1.3)
    _, m10, _ = g.quest_project(x, 1, trust_scale=1.0)
    assert float(unit) == pytest.approx(g.INT_ALPHA[1] * rms, rel=1e-6)
    assert m13.tolist() == [[True] * 8]
    assert m10.tolist() == [[False] + [True] * 7]
