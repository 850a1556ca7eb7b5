"""Dequantize-inside-the-GEMM on the g4 layout (hfq_kernels.nvfp4_g4mm) against its torch references: forward and
grad-input, odd shapes (rows / K not multiples of the tiles), three dtypes, bias, bad input. CPU runs the Triton
kernels under TRITON_INTERPRET=1 (conftest); on a GPU the same tests run the compiled kernels."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hfq_kernels import nvfp4_g4mm as MM
from hfq_kernels import nvfp4_gluon as G4
from hfq_kernels.reference import fp4

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}


def _g4(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 0.5, n)[:, None]
    w[0, :16] = 0.0  # a zero-scale block
    packed, scale, recip = fp4.nvfp4_quantize(w)
    wr, sr = G4.repack(packed, scale)
    return wr.to(DEV), sr.to(DEV), recip.float().to(DEV)


def _close(a, b, dt):
    torch.testing.assert_close(a.float().cpu(), b.float().cpu(), **TOL[dt])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,n,k", [(5, 37, 160), (70, 48, 64), (3, 16, 272), (33, 100, 96)])
def test_forward_and_grad_input_match_the_reference(m, n, k, dtype):
    wr, sr, recip = _g4(n, k, seed=m + n + k)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
    bias = torch.randn(n, generator=g).to(dtype).to(DEV)
    cfg = dict(BM=16, BN=32)  # several programs along both dims even at these sizes
    _close(MM.g4mm_linear(x, wr, sr, recip, n, k, bias, cfg=cfg), MM.g4mm_linear_ref(x, wr, sr, recip, n, k, bias),
           dtype)
    _close(MM.g4mm_linear(x, wr, sr, recip, n, k, None), MM.g4mm_linear_ref(x, wr, sr, recip, n, k), dtype)
    gy = torch.randn(m, n, generator=g).to(dtype).to(DEV)
    _close(MM.g4mm_grad_input(gy, wr, sr, recip, n, k, cfg=dict(BM=16, BN=16)),
           MM.g4mm_grad_input_ref(gy, wr, sr, recip, n, k), dtype)


@settings(max_examples=6, deadline=None)
@given(m=st.integers(1, 40), nt=st.integers(1, 5), kb=st.integers(1, 9), seed=st.integers(0, 1000))
def test_random_shapes_fp32_exact_values(m, nt, kb, seed):
    """fp32 activations: the decoded weight is the dequantize's exact value, so only the sum order differs."""
    n, k = 7 * nt + 2, 16 * kb
    wr, sr, recip = _g4(n, k, seed=seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed), device="cpu").to(DEV)
    _close(MM.g4mm_linear(x, wr, sr, recip, n, k, cfg=dict(BM=16, BN=16)), MM.g4mm_linear_ref(x, wr, sr, recip, n, k),
           torch.float32)
    g = torch.randn(m, n, generator=torch.Generator().manual_seed(seed + 1)).to(DEV)
    _close(MM.g4mm_grad_input(g, wr, sr, recip, n, k, cfg=dict(BM=16, BN=16)),
           MM.g4mm_grad_input_ref(g, wr, sr, recip, n, k), torch.float32)


def test_bad_input_names_the_problem():
    wr, sr, recip = _g4(16, 64)
    x = torch.randn(4, 64, device=DEV)
    with pytest.raises(ValueError, match="contiguous last dim"):
        MM.g4mm_linear(torch.randn(64, 4, device=DEV).t(), wr, sr, recip, 16, 64)
    with pytest.raises(ValueError, match="dtype"):
        MM.g4mm_linear(x.to(torch.float64), wr, sr, recip, 16, 64)
    with pytest.raises(ValueError, match="grad has 8 features"):
        MM.g4mm_grad_input(torch.randn(4, 8, device=DEV), wr, sr, recip, 16, 64)
    assert MM.g4mm_linear(x[:0], wr, sr, recip, 16, 64).shape == (0, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nvfp4_linear_uses_it_when_enabled_same_values_and_grads(monkeypatch, dtype):
    """HFQ_NVFP4_G4MM=1 (nvfp4_matmul.G4MM): an NVFP4Linear in the g4 layout at M > 64 plans "g4mm" for its forward
    and grad-input; outputs and input gradients match the dequantize + matmul plan."""
    from hfq.nvfp4 import NVFP4Linear
    from hfq_kernels import nvfp4 as K
    from hfq_kernels import nvfp4_matmul as NM

    monkeypatch.setattr(K, "EAGER_ON_CPU", True)
    lin = torch.nn.Linear(96, 40, dtype=dtype)
    ref = NVFP4Linear.from_linear(lin).to(DEV).to_g4_layout_()
    lay = NVFP4Linear.from_linear(lin).to(DEV).to_g4_layout_()
    x = torch.randn(2, 45, 96, dtype=dtype, device=DEV, requires_grad=True)  # M = 90 tokens
    ref(x).float().square().sum().backward()
    y_ref, g_ref, x.grad = ref(x).detach(), x.grad, None
    monkeypatch.setattr(NM, "G4MM", True)
    y = lay(x)
    y.float().square().sum().backward()
    kinds = {p.config.get("kind") for p in lay.__dict__["_hfq_plans"][1].values()}
    assert kinds == {"g4mm"}
    _close(y.detach(), y_ref, dtype)
    _close(x.grad, g_ref, dtype)
