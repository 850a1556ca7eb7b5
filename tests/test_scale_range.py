"""Weights far from 1 in magnitude: tiny tensors keep their values through every quantizer (scales stay normal
fp32, Triton kernels equal to the references), and tensors a format cannot hold are refused by name."""
import pytest
import torch

import hfq
from hfq.qparam import QParam
from hfq.tiny import save_tiny
from hfq_kernels import eco as ECO
from hfq_kernels import int8 as INT8
from hfq_kernels import nvfp4 as NV
from hfq_kernels.reference import fp4, fp8, intq

TINY = (1e-36, 1e-30)
FLOOR = 2.0 ** -127  # half of fp32's smallest normal: the error bound of rows below ~qmax * fp8.MIN_SCALE
# E4M3 rounds each value within 2^-4 of itself: the bound for rows whose scale is raised to fp8.MIN_SCALE
FORMAT_BOUND = {"fp8_e4m3_row": 2.0 ** -4}
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # Triton kernels: device tensors on a GPU, the interpreter on CPU


def _w(amax, rows=8, cols=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-1, 0, rows)[:, None]
    return w / w.abs().max() * amax


def _round_trips():
    def dense_sparse(w):
        d = intq.quantize_dense_sparse(w, intq.outlier_thresholds(w, 0.02))
        return intq.dequantize_dense_sparse(d["codes"], d["scales"], d["zeros"], d["sparse_idx"], d["sparse_val"])

    return {
        "nvfp4": lambda w: fp4.nvfp4_dequantize(*fp4.nvfp4_quantize(w), torch.float32),
        "mxfp4": lambda w: fp4.mxfp4_dequantize(*fp4.mxfp4_quantize(w), torch.float32),
        "fp8_e4m3_row": lambda w: fp8.dequantize_fp8_row(*fp8.quantize_fp8_row(w)),
        "int4_tensor": lambda w: intq.dequantize_int4(*intq.quantize_int4(w)),
        "int4_group": lambda w: intq.dequantize_int4(*intq.quantize_int4(w, 32), 32),
        "int8_asym": lambda w: intq.dequantize_int_asym(*intq.quantize_int_asym(w, 8)),
        "int8_dense_sparse": dense_sparse,
    }


def _unit(w):
    """w scaled by a power of two (exactly) to amax in [1, 2): the same mantissas at an ordinary scale."""
    return w * 2.0 ** -torch.floor(torch.log2(w.abs().max().double())).item()


def _assert_like_unit_scale(d, w, d1, w1, bound=0.0):
    """Round trip d of w within 1.3x the max error (relative to amax) of the same values at amax ~1 (or `bound`),
    plus FLOOR."""
    amax = w.abs().max().double()
    unit_err = ((d1.double() - w1.double()).abs().max() / w1.abs().max().double()).item()
    err = (d.double() - w.double()).abs().max().item()
    assert err <= max(1.3 * unit_err, bound) * amax + FLOOR, (err / amax.item(), unit_err)
    assert torch.equal(torch.sign(d[d != 0]), torch.sign(w[d != 0]))


@pytest.mark.parametrize("amax", TINY)
@pytest.mark.parametrize("fmt", list(_round_trips()))
def test_tiny_tensor_round_trip_keeps_format_error(fmt, amax):
    rt = _round_trips()[fmt]
    w = _w(amax)
    w1 = _unit(w)
    _assert_like_unit_scale(rt(w), w, rt(w1), w1, FORMAT_BOUND.get(fmt, 0.0))


def test_scales_stay_normal_fp32():
    w = _w(1e-36)
    assert (fp8.quantize_fp8_row(w)[1] >= fp8.MIN_SCALE).all()
    assert (intq.quantize_int_asym(w, 8)[1] >= fp8.MIN_SCALE).all()
    p, s, r = fp4.nvfp4_quantize(w)
    eff = s.float()[s.float() > 0] / r
    assert torch.isfinite(r).all() and (eff >= fp8.MIN_SCALE).all()


def test_nvfp4_refuses_tensor_below_its_range():
    w = _w(fp4.NVFP4_MIN_AMAX / 2)
    with pytest.raises(ValueError, match=r"layer\.weight: max \|value\| .* below .*2\^-120.*modules_to_not_convert"):
        fp4.nvfp4_quantize(w, name="layer.weight")
    lin = torch.nn.Linear(64, 8, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    with pytest.raises(ValueError, match=r"proj: max \|value\|"):
        hfq.nvfp4.NVFP4Linear.from_linear(lin, name="proj")
    assert fp4.nvfp4_quantize(torch.zeros(8, 64))[2].item() == 1.0  # all zero stays allowed


@pytest.mark.parametrize("amax", TINY)
def test_nvfp4_kernel_equals_reference_on_tiny_tensors(amax):
    w = _w(amax, 16, 64)
    p, s, r = NV.quantize(w.to(DEV))
    rp, rs, rr = fp4.nvfp4_quantize(w)
    assert torch.equal(p.cpu(), rp) and torch.equal(s.view(torch.uint8).cpu(), rs.view(torch.uint8))
    assert torch.equal(r.cpu(), rr)
    assert torch.equal(NV.dequantize(p, s, r, torch.float32).cpu(), fp4.nvfp4_dequantize(rp, rs, rr, torch.float32))


@pytest.mark.parametrize("amax", TINY + (1e-38,))
def test_int8_kernel_equals_reference_on_tiny_rows(amax):
    g = _w(amax, 5, 70)
    c, s, z = (torch.zeros(5, 70, dtype=torch.uint8, device=DEV), torch.zeros(5, 1, device=DEV),
               torch.zeros(5, 1, dtype=torch.uint8, device=DEV))
    assert bool(INT8.int8_quantize_rows_(g.to(DEV), c, s, z))
    rc, rs, rz = intq.quantize_int_asym(g, 8)
    assert torch.equal(c.cpu(), rc) and torch.equal(s.cpu(), rs) and torch.equal(z.cpu(), rz)


@pytest.mark.parametrize("amax", TINY)
def test_eco_kernel_equals_reference_on_tiny_rows(amax):
    codes, scales = fp8.quantize_fp8_row(_w(amax, 4, 64))
    g = torch.Generator().manual_seed(1)
    grad = (torch.randn(4, 64, generator=g) * amax).bfloat16()
    states = [codes, scales, grad, torch.zeros(4, 64), torch.zeros(4, 64)]
    a, b = [t.clone().to(DEV) for t in states], [t.clone() for t in states]
    kw = dict(lr=1e-3 * amax, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step=1)
    ECO.eco_adamw_fp8_step_triton(*a, rounding="rtn", **kw)
    ECO.eco_adamw_fp8_step_ref(*b, rounding="rtn", **kw)
    a = [t.cpu() for t in a]
    ca, cb = a[0].view(torch.uint8), b[0].view(torch.uint8)
    if DEV == "cpu":  # the interpreter runs the reference's fp32 ops in the same order: bit-identical
        assert torch.equal(ca, cb) and torch.equal(a[1], b[1])
    else:  # torch's GPU kernels may fuse a multiply-add: an ulp in the scale, a code on a boundary flipped
        torch.testing.assert_close(a[1], b[1], rtol=1e-6, atol=0)
        assert (ca != cb).float().mean() < 0.02
    assert (a[1] >= fp8.MIN_SCALE).all() and (a[0].float() != 0).any()


@pytest.mark.parametrize("amax", TINY)
@pytest.mark.parametrize("cfg", [hfq.NVFP4Config(), hfq.QFTConfig(weight_format="int8_dense_sparse"),
                                 hfq.QFTConfig(weight_format="fp8_e4m3_row"), hfq.QFTConfig(weight_format="int4_group")],
                         ids=["nvfp4", "qft_int8", "eco_fp8", "eco_int4"])
def test_from_pretrained_keeps_a_tiny_layer(tmp_path, cfg, amax):
    """A checkpoint whose q_proj has amax `amax` loads quantized with its values, not zeros."""
    from transformers import AutoModelForCausalLM

    path = save_tiny(tmp_path / "m", layers=1)
    m = AutoModelForCausalLM.from_pretrained(path)
    w = m.model.layers[0].self_attn.q_proj.weight
    with torch.no_grad():
        w.mul_(amax / w.abs().max())
    m.save_pretrained(path)
    w = w.detach().clone()
    q = AutoModelForCausalLM.from_pretrained(path, quantization_config=cfg).model.layers[0].self_attn.q_proj
    d = q.dequantize(torch.float32) if hasattr(q, "dequantize") else q.weight.dequantize(torch.float32)
    assert isinstance(getattr(q, "weight", None), QParam) or hasattr(q, "weight_packed")
    rel = ((d.double() - w.double()).norm() / w.double().norm()).item()
    assert rel < 0.15, rel
