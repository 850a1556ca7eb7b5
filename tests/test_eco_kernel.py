"""Fused Triton ECO-AdamW step (interpreter on CPU) vs its torch reference."""
import copy

import pytest
import torch

import hfq_kernels.eco as K
from hfq.eco import ECOAdamW
from hfq.formats.fp8 import dequantize_fp8_row, quantize_fp8_row
from hfq.qparam import QLinear

KW = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3)


DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _state(r, c, seed, state_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    codes, scales = quantize_fp8_row(torch.randn(r, c, generator=g))
    grad = torch.randn(r, c, generator=g).bfloat16()
    m = (torch.randn(r, c, generator=g) * 0.1).to(state_dtype)
    v = (torch.rand(r, c, generator=g) * 0.01).to(state_dtype)
    return [t.to(DEV) for t in (codes, scales, grad, m, v)]  # the Triton kernels need device tensors on a GPU


def _clone(s):
    return [t.clone() for t in s]


@pytest.mark.parametrize("shape,one_pass", [((5, 37), 8192), ((3, 300), 128), ((1, 64), 8192), ((4, 129), 64)])
def test_rtn_matches_reference(shape, one_pass, monkeypatch):
    monkeypatch.setattr(K, "MAX_ONE_PASS", one_pass)
    s = _state(*shape, seed=sum(shape))
    a, b = _clone(s), _clone(s)
    K.eco_adamw_fp8_step_triton(*a, rounding="rtn", **KW)
    K.eco_adamw_fp8_step_ref(*b, rounding="rtn", **KW)
    wa, wb = dequantize_fp8_row(a[0], a[1]), dequantize_fp8_row(b[0], b[1])
    if DEV == "cpu":  # the interpreter evaluates the same fp32 ops in the same order: bit-identical
        assert torch.equal(wa, wb)
    else:  # on the GPU, FMA contraction can flip a value sitting on a rounding boundary to its neighbour code
        same = (wa == wb).float().mean().item()
        assert same >= 0.999, same
        assert torch.allclose(wa, wb, rtol=2 ** -3, atol=0), "a code differs by more than one E4M3 step"
    torch.testing.assert_close(a[3], b[3], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a[4], b[4], rtol=1e-5, atol=1e-7)


def test_sr_neighbours_and_unbiased():
    s = _state(16, 96, seed=1)
    ref = _clone(s)
    K.eco_adamw_fp8_step_ref(*ref, rounding="rtn", **KW)
    rtn = dequantize_fp8_row(ref[0], ref[1])
    acc = torch.zeros_like(rtn)
    n = 24
    for seed in range(n):
        a = _clone(s)
        K.eco_adamw_fp8_step_triton(*a, rounding="sr", seed=seed, **KW)
        d = dequantize_fp8_row(a[0], a[1])
        ulp = (rtn.abs() / 4).clamp_min(ref[1] * 2 ** -8)
        assert ((d - rtn).abs() <= ulp).all()  # one of the two neighbours
        acc += d
    # the RTN value differs from the SR mean by the (signed) rounding error; the mean is closer to the target
    a = _clone(s)
    K.eco_adamw_fp8_step_triton(*a, rounding="sr", seed=0, **KW)
    assert not torch.equal(dequantize_fp8_row(a[0], a[1]), rtn)
    assert (acc / n - rtn).abs().max() < rtn.abs().max() / 8


def test_bad_shapes():
    s = _state(4, 32, seed=0)
    with pytest.raises(ValueError, match="exp_avg"):
        K.eco_adamw_fp8_step_ref(s[0], s[1], s[2], s[3][:, :8], s[4], rounding="rtn", **KW)
    with pytest.raises(ValueError, match="rounding"):
        K.eco_adamw_fp8_step_triton(*s, rounding="up", **KW)


def test_fused_optimizer_matches_reference_optimizer():
    torch.manual_seed(0)
    lin = torch.nn.Linear(40, 12)
    nets = [QLinear.from_linear(copy.deepcopy(lin)) for _ in range(2)]  # from_linear reuses the bias
    opts = [ECOAdamW(nets[0].parameters(), lr=1e-2, rounding="rtn", fused=True),
            ECOAdamW(nets[1].parameters(), lr=1e-2, rounding="rtn", fused=False)]
    x = torch.randn(8, 40)
    for _ in range(1):  # later steps drift apart: one flipped code changes e by a full grid step
        for n, o in zip(nets, opts):
            o.zero_grad()
            n(x).pow(2).mean().backward()
            o.step()
    d0, d1 = nets[0].weight.dequantize(torch.float32), nets[1].weight.dequantize(torch.float32)
    assert (nets[0].weight.codes.view(torch.uint8) == nets[1].weight.codes.view(torch.uint8)).float().mean() > 0.99
    torch.testing.assert_close(d0, d1, rtol=1e-5, atol=1e-3 * float(d1.abs().max()))
    torch.testing.assert_close(opts[0].state[nets[0].weight]["exp_avg"], opts[1].state[nets[1].weight]["exp_avg"],
                               rtol=1e-4, atol=1e-6)
