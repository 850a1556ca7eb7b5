"""NVFP4 grad-input: the fused kernel reading g4 weights for few rows (hfq_kernels.nvfp4_grad), and the dense
weight a training forward keeps for its backward (hfq_kernels.nvfp4.KEPT_DENSE, HFQ_NVFP4_GRAD_DENSE_GB).

On CPU the kernel runs under TRITON_INTERPRET=1 (plain decode); on a GPU its PTX decode, which must give the
plain decode's values bit for bit. Reference: g @ the fp32 dequantized weight (the kernel never rounds W).
"""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hfq_kernels import nvfp4  # noqa: F401 (registers torch.ops.hfq.*)
from hfq_kernels import nvfp4_gluon as G4
from hfq_kernels import nvfp4_grad as NG
from hfq_kernels._settings import SETTINGS, KernelSettings
from hfq_kernels.reference import fp4

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _g4_weight(n, k, seed=0):
    """A g4 weight with the awkward blocks: zero scale, sign-only zeros, an E4M3 subnormal scale, the largest."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 0.5, n)[:, None]
    w[0, :16] = 0.0
    if k >= 32:
        w[0, 16:32] = -0.0
    w[min(1, n - 1), :16] *= 1e-5
    w[n - 1, k - 16:] = 448.0 * 6
    packed, scale, gs = fp4.nvfp4_quantize(w)
    wr, sr = G4.repack(packed, scale)
    dense = fp4.nvfp4_dequantize(packed, scale, gs, torch.float32)
    return wr.to(DEV), sr.to(DEV), gs.to(DEV), dense.to(DEV)


def _check(m, n, k, seed=0):
    wr, sr, gs, dense = _g4_weight(n, k, seed)
    g = torch.randn(m, n, generator=torch.Generator().manual_seed(seed + 1)).to(DEV, torch.bfloat16)
    out = NG.grad_input_g4_fused(g, wr, sr, gs, n, k)
    ref = g.float() @ dense
    assert out.shape == (m, k) and out.dtype == torch.bfloat16
    err = float((out.float() - ref).norm() / ref.norm())
    assert err < 5e-3, (m, n, k, NG.grad_config(m, n, k, 132), err)


@pytest.mark.parametrize("m,n,k", [(1, 16, 64), (5, 37, 160), (16, 200, 272), (33, 64, 48), (64, 300, 1024),
                                   (8, 1100, 64), (3, 2048, 144)])
def test_fused_grad_input_matches_reference(m, n, k):
    """Odd row counts (padded row tiles), K not a multiple of 64 or of the 128-column block, splits over rows."""
    _check(m, n, k)


@settings(max_examples=8, deadline=None)
@given(m=st.integers(1, 64), n=st.integers(1, 90), kb=st.integers(1, 12), seed=st.integers(0, 99))
def test_fused_grad_input_random_shapes(m, n, kb, seed):
    _check(m, n, 16 * kb, seed)


def test_fused_takes_only_few_bf16_rows():
    g = torch.zeros(8, 32, dtype=torch.bfloat16, device=DEV)
    assert NG.fused_ok(g) == (DEV == "cuda" or SETTINGS.interpret)
    assert not NG.fused_ok(torch.zeros(65, 32, dtype=torch.bfloat16, device=DEV))
    assert not NG.fused_ok(g.half()) and not NG.fused_ok(g.float())


@pytest.mark.skipif(DEV != "cuda", reason="the PTX decode runs on GPUs only")
def test_ptx_decode_bit_identical_to_plain_decode(monkeypatch):
    m, n, k = 16, 3000, 1088
    wr, sr, gs, _ = _g4_weight(n, k, 3)
    g = torch.randn(m, n, device=DEV, dtype=torch.bfloat16)
    asm = NG.grad_input_g4_fused(g, wr, sr, gs, n, k)
    assert NG._ASM_OK.get(torch.device(DEV, torch.cuda.current_device())) or NG._ASM_OK.get(g.device)
    monkeypatch.setattr(NG, "_ASM_OK", {g.device: False})
    plain = NG.grad_input_g4_fused(g, wr, sr, gs, n, k)
    assert torch.equal(asm, plain)


def _layer(n, k, seed):
    from hfq.nvfp4 import NVFP4Linear

    lin = torch.nn.Linear(k, n, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
    return NVFP4Linear.from_linear(lin).to(DEV).to_g4_layout_()


@pytest.mark.parametrize("keep_gb", [2.0, 0.0])
@pytest.mark.parametrize("shape", [(5, 96), (2, 3, 96), (80, 96)])
def test_layer_grads_through_both_grad_routes(monkeypatch, keep_gb, shape):
    """NVFP4Linear's eager route: the forward's kept weight (where it dequantizes and the budget allows), the fused
    kernel (few bf16 rows) or dequantize + matmul; every route gives the reference gradients."""
    monkeypatch.setattr(SETTINGS, "plan_on_cpu", True)
    monkeypatch.setattr(SETTINGS, "grad_dense_gb", keep_gb)
    from hfq_kernels import nvfp4_plan

    fused = []
    real = nvfp4_plan.fused_grad
    monkeypatch.setattr(nvfp4_plan, "fused_grad", lambda *a: fused.append(1) or real(*a))
    lay = _layer(48, 96, seed=1)
    lay.bias.requires_grad_(True)
    x = torch.randn(*shape, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    y = lay(x)
    gy = torch.randn_like(y)
    y.backward(gy)
    x2 = x.detach().clone().requires_grad_()
    F.linear(x2.float(), lay.dequantize(torch.float32)).backward(gy.float())
    ref = x2.grad.float()
    assert float((x.grad.float() - ref).norm() / ref.norm()) < 5e-3  # bf16 rounding of W and of dx
    few = x.numel() // 96 <= NG.MAX_ROWS
    # CPU plans dequantize in the forward (kept within the budget); GPU forwards of few rows run the decode kernel
    assert len(fused) == (few and (DEV == "cuda" or keep_gb == 0))
    torch.testing.assert_close(lay.bias.grad.float(), gy.float().reshape(-1, 48).sum(0), rtol=1e-2, atol=1e-2)


def test_grad_dense_budget_is_read_and_checked():
    assert KernelSettings.from_env({}).grad_dense_gb == 2.0
    assert KernelSettings.from_env({"HFQ_NVFP4_GRAD_DENSE_GB": "0.5"}).grad_dense_gb == 0.5
    for bad in ("-1", "lots", "inf", "nan"):
        with pytest.raises(ValueError, match="HFQ_NVFP4_GRAD_DENSE_GB"):
            KernelSettings.from_env({"HFQ_NVFP4_GRAD_DENSE_GB": bad})


def test_budget_caps_the_kept_weights(monkeypatch):
    """Forwards keep their dense weights only while the kept total fits the budget; all are released after the
    backward, and the gradients do not depend on which layers kept theirs."""
    from hfq_kernels.nvfp4 import KEPT_DENSE

    monkeypatch.setattr(SETTINGS, "plan_on_cpu", True)
    layers = [_layer(48, 96, seed=s) for s in range(3)]
    one = 48 * 96 * 2
    x = torch.randn(80, 96, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    grads = []
    for gb in (2.0, 1.5 * one / 2**30, 0.0):
        monkeypatch.setattr(SETTINGS, "grad_dense_gb", gb)
        before = KEPT_DENSE.bytes
        h = x
        for lay in layers:
            h = lay(h).repeat(1, 2)
        assert KEPT_DENSE.bytes - before == {2.0: 3 * one, 0.0: 0}.get(gb, one)
        h.float().square().sum().backward()
        del h
        assert KEPT_DENSE.bytes == before
        grads.append(x.grad)
        x.grad = None
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], grads[2])
