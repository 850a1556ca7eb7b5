"""Hadamard transform: orthogonality, involution, block-diagonal layout, Triton kernel vs reference."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hfq_kernels.reference.hadamard import effective_block, fwht, hadamard_matrix
from hfq_kernels.hadamard import hadamard_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # Triton kernels: device tensors on a GPU


@pytest.mark.parametrize("n", [1, 2, 8, 64, 128, 256])
def test_matrix_orthogonal_symmetric(n):
    h = hadamard_matrix(n, torch.float64)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert torch.equal(h, h.T)
    assert set((h * n**0.5).round().unique().tolist()) <= {-1.0, 1.0}


@pytest.mark.parametrize("K,block", [(128, 128), (3584, 128), (96, 32), (64, 128), (40, 8)])
def test_fwht_is_blockwise_matmul_and_involution(K, block):
    torch.manual_seed(K)
    x = torch.randn(3, 5, K, dtype=torch.float64)
    b = effective_block(K, block)
    ref = (x.reshape(3, 5, K // b, b) @ hadamard_matrix(b, torch.float64)).reshape(3, 5, K)
    y = fwht(x, block)
    assert torch.allclose(y, ref, atol=1e-12)
    assert torch.allclose(fwht(y, block), x, atol=1e-12)  # HT(HT(x)) == x
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1))  # orthogonal


def test_matmul_invariance():
    torch.manual_seed(1)
    x, w = torch.randn(7, 256, dtype=torch.float64), torch.randn(9, 256, dtype=torch.float64)
    assert torch.allclose(fwht(x, 64) @ fwht(w, 64).T, x @ w.T, atol=1e-10)


def test_large_model_dims_covered():
    assert effective_block(3584, 128) == 128 and effective_block(18944, 128) == 128
    assert effective_block(64, 128) == 64  # a smaller power of two uses one full block


def test_bad_block_sizes():
    with pytest.raises(ValueError, match="hadamard_block_size"):
        effective_block(128, 48)
    with pytest.raises(ValueError, match="layers.0.mlp.down_proj"):
        effective_block(96, 64, "layers.0.mlp.down_proj")


@settings(max_examples=6, deadline=None)
@given(rows=st.integers(1, 70), nblk=st.integers(1, 3), logb=st.integers(4, 7),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_triton_matches_reference(rows, nblk, logb, dtype):
    b = 2**logb
    x = (torch.randn(rows, nblk * b) * 3).to(dtype)
    y = hadamard_triton(x.to(DEV), b).cpu()
    ref = fwht(x.double(), b)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.isfinite(y).all()
    assert ((y.double() - ref).norm() / ref.norm()).item() < tol


def test_triton_3d_and_self_inverse():
    x = torch.randn(2, 5, 384, device=DEV)
    y = hadamard_triton(x, 128)
    assert y.shape == x.shape
    assert torch.allclose(hadamard_triton(y, 128), x, atol=1e-5)


def test_op_autograd_and_fake():
    x = torch.randn(4, 32, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: torch.ops.hfq.hadamard(t, 16), (x,))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        f = torch.empty(3, 256)
        assert torch.ops.hfq.hadamard(f, 128).shape == (3, 256)
