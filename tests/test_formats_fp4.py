"""The NVFP4/MXFP4 torch reference: the oracle for every kernel."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hfq_kernels.reference import fp4


def test_all_16_codes_roundtrip():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = fp4.e2m1_decode(codes)
    assert vals[:8].tolist() == list(fp4.E2M1_VALUES)
    assert torch.equal(fp4.e2m1_encode(vals), codes)
    assert torch.equal(fp4.unpack_fp4(fp4.pack_fp4(codes)), codes)
    # element 2i in the low nibble, 2i+1 in the high nibble
    assert fp4.pack_fp4(torch.tensor([3, 12], dtype=torch.uint8)).item() == 3 | (12 << 4)


def test_e2m1_rounding_ties_to_even_and_saturation():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 5.01, 7.0, 1e9, -1e9, -0.74])
    got = fp4.e2m1_decode(fp4.e2m1_encode(x))
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 6.0, 6.0, 6.0, -6.0, -0.5])
    assert torch.equal(got, want)


def test_negative_zero_keeps_sign():
    codes = fp4.e2m1_encode(torch.tensor([-0.0, 0.0]))
    assert codes.tolist() == [8, 0]
    back = fp4.e2m1_decode(codes)
    assert torch.signbit(back).tolist() == [True, False]


def _eff(scale, gs, k):
    return (scale.float() / gs).repeat_interleave(16, dim=1)[:, :k]


@pytest.mark.parametrize("shape", [(1, 16), (7, 48), (33, 160), (64, 512)])
def test_nvfp4_random_within_error_bound(shape):
    torch.manual_seed(0)  # the relative-error bound holds on average: 16 elements can exceed it
    w = torch.randn(shape) * torch.rand(shape[0], 1) * 3
    packed, scale, gs = fp4.nvfp4_quantize(w)
    assert packed.shape == (shape[0], shape[1] // 2) and packed.dtype == torch.uint8
    assert scale.shape == (shape[0], shape[1] // 16) and scale.dtype == torch.float8_e4m3fn
    assert gs.shape == (1,) and gs.dtype == torch.float32
    assert torch.allclose(gs, 448 * 6 / w.abs().max())
    deq = fp4.nvfp4_dequantize(packed, scale, gs, torch.float32)
    eff = _eff(scale, gs, shape[1])
    # half of the widest E2M1 gap (4 -> 6) plus the E4M3 rounding of the scale (<= 1/16 relative, times 6)
    assert ((deq - w).abs() <= eff * (1.0 + 6 / 16) + 1e-7).all()
    assert (deq - w).norm() / w.norm() < 0.13


def test_nvfp4_all_zero_blocks_and_tensor():
    w = torch.randn(4, 64)
    w[:, 16:32] = 0
    p, s, g = fp4.nvfp4_quantize(w)
    d = fp4.nvfp4_dequantize(p, s, g, torch.float32)
    assert (s[:, 1].float() == 0).all() and (d[:, 16:32] == 0).all()
    p, s, g = fp4.nvfp4_quantize(torch.zeros(3, 32))
    assert g.item() == 1.0 and (fp4.nvfp4_dequantize(p, s, g, torch.float32) == 0).all()


def test_nvfp4_scale_saturates_at_e4m3_max():
    w = torch.randn(2, 32)
    big = torch.tensor([1e6])  # a global scale so large that every block scale would exceed 448
    _, s, _ = fp4.nvfp4_quantize(w, global_scale=big)
    assert (s.float() == 448).all()
    p, s, g = fp4.nvfp4_quantize(w)
    assert s.float().max() <= 448 and torch.isfinite(s.float()).all()


def test_nvfp4_block_max_maps_to_top_code():
    w = torch.randn(8, 64)
    p, s, g = fp4.nvfp4_quantize(w)
    codes = fp4.unpack_fp4(p).reshape(8, 4, 16)
    blocks = w.reshape(8, 4, 16)
    top = blocks.abs().argmax(-1, keepdim=True)
    mags = (torch.gather(codes, -1, top) & 7)
    assert (mags >= 6).all()  # 4.0 or 6.0 depending on how the E4M3 scale rounded


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 9), blocks=st.integers(1, 6), scale=st.floats(1e-3, 1e3))
def test_nvfp4_pack_dequant_consistency(rows, blocks, scale):
    w = torch.randn(rows, 16 * blocks) * scale
    p, s, g = fp4.nvfp4_quantize(w)
    codes = fp4.unpack_fp4(p)
    d = fp4.nvfp4_dequantize(p, s, g, torch.float32)
    assert torch.equal(d, fp4.e2m1_decode(codes) * _eff(s, g, w.shape[1]))
    assert (d - w).norm() / w.norm() < 0.2


def test_mxfp4_power_of_two_scales_and_error_bound():
    w = torch.randn(16, 96) * 5
    w[0, :32] = 0
    p, s = fp4.mxfp4_quantize(w)
    assert s.dtype == torch.uint8 and s.shape == (16, 3)
    d = fp4.mxfp4_dequantize(p, s, torch.float32)
    assert (d[0, :32] == 0).all()
    mult = torch.exp2(s.float() - 127).repeat_interleave(32, dim=1)
    # half the widest gap (1 * 2^e), or saturation of a block max in [6, 8) * 2^e (< 2 * 2^e)
    assert ((d - w).abs() <= 2 * mult + 1e-7).all()
    # the block max lands at or below 6 * 2^e, and the E8M0 rule leaves it above 2^(e+2)
    bmax = w.reshape(16, 3, 32).abs().amax(-1)
    e = s.float() - 127
    nz = bmax > 0
    assert (bmax[nz] >= torch.exp2(e[nz] + 2)).all() and (bmax[nz] < torch.exp2(e[nz] + 3)).all()
    assert (d - w).norm() / w.norm() < 0.2


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_refused(bad):
    w = torch.randn(2, 32)
    w[1, 5] = bad
    with pytest.raises(ValueError, match="layer.x.*NaN/Inf"):
        fp4.nvfp4_quantize(w, name="layer.x")
    with pytest.raises(ValueError, match="NaN/Inf"):
        fp4.mxfp4_quantize(w)


def test_shape_errors_name_the_problem():
    with pytest.raises(ValueError, match="in_features=24 is not a multiple of the block size 16"):
        fp4.nvfp4_quantize(torch.randn(2, 24))
    with pytest.raises(ValueError, match="2-D"):
        fp4.nvfp4_quantize(torch.randn(32))
