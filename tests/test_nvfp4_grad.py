"""NVFP4 grad-input: the dense weight a training forward keeps for its backward (hfq_kernels.nvfp4.KEPT_DENSE,
HFQ_NVFP4_GRAD_DENSE_GB) and the plan's own grad (dequantize + matmul) where none is kept; both give the
reference gradients, and the kept total stays within the budget and returns to zero after backward.
"""
import pytest
import torch
import torch.nn.functional as F

from hfq_kernels import nvfp4  # noqa: F401 (registers torch.ops.hfq.*)
from hfq_kernels._settings import SETTINGS, KernelSettings

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _layer(n, k, seed):
    from hfq.nvfp4 import NVFP4Linear

    lin = torch.nn.Linear(k, n, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
    return NVFP4Linear.from_linear(lin).to(DEV).to_g4_layout_()


@pytest.mark.parametrize("keep_gb", [2.0, 0.0])
@pytest.mark.parametrize("shape", [(5, 96), (2, 3, 96), (80, 96)])
def test_layer_grads_through_both_grad_routes(monkeypatch, keep_gb, shape):
    """NVFP4Linear's eager route: the forward's kept weight (where it dequantizes and the budget allows) or the
    plan's grad (dequantize + matmul); every route gives the reference gradients."""
    monkeypatch.setattr(SETTINGS, "plan_on_cpu", True)
    monkeypatch.setattr(SETTINGS, "grad_dense_gb", keep_gb)
    lay = _layer(48, 96, seed=1)
    lay.bias.requires_grad_(True)
    x = torch.randn(*shape, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    y = lay(x)
    if keep_gb == 0.0:  # the plan's Function, applied through the C++ apply (plan_apply)
        assert type(y.grad_fn).__name__ == "_PlanFnBackward"
    gy = torch.randn_like(y)
    y.backward(gy)
    x2 = x.detach().clone().requires_grad_()
    F.linear(x2.float(), lay.dequantize(torch.float32)).backward(gy.float())
    ref = x2.grad.float()
    assert float((x.grad.float() - ref).norm() / ref.norm()) < 5e-3  # bf16 rounding of W and of dx
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


def _spy_grad_launches(monkeypatch):
    """Record (rows, features) of the grad read by every few-row grad-input kernel launch (the launchers that
    grad_input_g4_fused and the plans' grads take)."""
    from hfq_kernels import nvfp4_grad
    from hfq_kernels._triton import LRU

    calls = []
    real = nvfp4_grad.grad_launcher

    def spy(*a):
        run = real(*a)
        return lambda *b: calls.append((b[0].numel() // b[0].shape[-1], b[0].shape[-1])) or run(*b)

    monkeypatch.setattr(nvfp4_grad, "grad_launcher", spy)
    monkeypatch.setattr(nvfp4_grad, "_BOUND", LRU(8))
    return calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Gluon few-row forward runs on a GPU only")
@pytest.mark.parametrize("keep_gb", [2.0, 0.0])
def test_few_row_training_forward_runs_the_kernels_and_keeps_nothing(monkeypatch, keep_gb):
    """At few rows (the Gluon kernel's plans) a training forward runs the Gluon kernel, whatever the kept-weight
    budget, and keeps no dense weight; its backward is one few-row grad-input launch. The gradient is the
    reference's and the forward's output is the no_grad forward's, bit for bit."""
    from hfq_kernels import nvfp4_gluon
    from hfq_kernels.nvfp4 import KEPT_DENSE

    if not nvfp4_gluon.device_ok(torch.device(DEV)):
        pytest.skip("this GPU does not run the Gluon kernel")
    monkeypatch.setattr(SETTINGS, "grad_dense_gb", keep_gb)
    calls = _spy_grad_launches(monkeypatch)
    lay = _layer(48, 96, seed=5)
    x = torch.randn(8, 96, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    before = KEPT_DENSE.bytes
    with torch.no_grad():
        y0 = lay(x)
    y = lay(x)
    assert list(lay.__dict__["_hfq_plans"][1].values())[-1].config["kind"] == "gluon"
    assert KEPT_DENSE.bytes == before and torch.equal(y.detach(), y0)
    gy = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, [x], gy)
    assert calls == [(8, 48)]
    ref = gy.float() @ lay.dequantize(torch.float32)
    assert float((gx.float() - ref).norm() / ref.norm()) < 5e-3


@pytest.mark.parametrize("n,k", [(48, 272), (40, 96), (100, 48), (33, 160), (300, 96), (800, 96), (1040, 160)])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_fused_grad_input_matches_dequantize_then_matmul(n, k, m):
    """The few-row grad-input kernel (codes decoded in registers) against dequantize_g4 + matmul, odd shapes
    included (rows not a multiple of 16, K not a multiple of 64), with and without a split over the rows (the
    last program of a column block sums the splits: a second call gives the same bits, counters back at 0)."""
    from hfq_kernels import nvfp4_grad
    from hfq_kernels._triton import SPLIT_SCRATCH, sm_count
    from hfq_kernels.nvfp4_gluon import dequantize_g4_ref

    lay = _layer(n, k, seed=n + k)
    wr, sr, gs = lay.weight_g4, lay.weight_g4_scale, lay.weight_global_scale
    g = torch.randn(m, n, dtype=torch.bfloat16, device=DEV, generator=None)
    ref = g.float() @ dequantize_g4_ref(wr.cpu(), sr.cpu(), gs.cpu(), n, k, torch.bfloat16).float().to(DEV)
    got = nvfp4_grad.grad_input_g4_fused(g, wr, sr, gs, n, k)
    assert got.shape == (m, k) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))
    # the kernel multiplies the exact NVFP4 weights (the reference rounds each to bf16 first): no further off the
    # exact product than the reference is
    exact = g.double() @ dequantize_g4_ref(wr.cpu(), sr.cpu(), gs.cpu(), n, k, torch.float32).double().to(DEV)
    assert float((got.double() - exact).norm()) <= 1.05 * float((ref.to(torch.bfloat16).double() - exact).norm())
    split = nvfp4_grad.split_rows(n, k, sm_count(got.device) if got.is_cuda else 4)[0]
    if not got.is_cuda:
        assert (split > 1) == (n >= 800)  # the CPU plan (4 nominal SMs) splits only the two tallest weights
    assert torch.equal(nvfp4_grad.grad_input_g4_fused(g, wr, sr, gs, n, k), got)
    if split > 1:
        assert not any(bool(c.any()) for _, c in SPLIT_SCRATCH._bufs.values())


def test_few_row_grads_take_the_fused_kernel(monkeypatch):
    """g4_grad (every g4 plan's grad, and through grad_input_g4 the registered grad-input op's CUDA kernel) sends
    <= MAX_ROWS bf16 rows to the kernel and the rest to dequantize + matmul; both agree with the reference."""
    from hfq_kernels import nvfp4_grad, nvfp4_plan

    big = torch.zeros(1, 4096, dtype=torch.bfloat16, device=DEV)
    if not nvfp4_grad.fused_ok(big, 4096):
        pytest.skip("the kernel runs on CUDA or under the Triton interpreter")
    assert not nvfp4_grad.fused_ok(big.float(), 4096) and not nvfp4_grad.fused_ok(big.expand(17, 4096), 4096)
    calls = _spy_grad_launches(monkeypatch)
    lay = _layer(48, 96, seed=3)
    wr, sr, gs = lay.weight_g4, lay.weight_g4_scale, lay.weight_global_scale
    for shape in [(2, 5, 48), (20, 48)]:
        g = torch.randn(*shape, dtype=torch.bfloat16, device=DEV)
        got = nvfp4_plan.plan_linear_g4(torch.zeros(*shape[:-1], 96, dtype=g.dtype, device=DEV), wr, sr, gs, None,
                                        48, 96).grad(g)
        ref = g.float() @ lay.dequantize(torch.float32)
        assert got.shape == (*shape[:-1], 96)
        assert float((got.float() - ref).norm() / ref.norm()) < 1e-2
    assert calls == [(10, 48)]


@pytest.mark.parametrize("bias", [False, True])
def test_plan_reads_inputs_in_place_or_as_rows(bias):
    """A g4 plan's forward and few-row grad read a contiguous x / grad in place (any leading shape, size-1
    dimensions of any stride included) and others as [rows, features]; every layout gives the 2-D call's bits
    in x's leading shape, and the outputs are plain tensors (no views, which autograd would track)."""
    from hfq_kernels.nvfp4_plan import plan_linear_g4

    n, k = 48, 96
    lay = _layer(n, k, seed=9)
    wr, sr, gs = lay.weight_g4, lay.weight_g4_scale, lay.weight_global_scale
    b = torch.randn(n, dtype=torch.bfloat16, device=DEV) if bias else None
    x = torch.randn(12, k, dtype=torch.bfloat16, device=DEV)
    g = torch.randn(12, n, dtype=torch.bfloat16, device=DEV)
    flat = plan_linear_g4(x, wr, sr, gs, b, n, k)
    layouts = [(x.view(3, 4, k), g.view(3, 4, n)),
               (x.as_strided((12, 1, k), (k, 7, 1)), g.as_strided((12, 1, n), (n, 5, 1))),  # contiguous
               (x.t().contiguous().t(), g.t().contiguous().t()),  # column-major
               (x.view(4, 3, k).transpose(0, 1), g.view(4, 3, n).transpose(0, 1))]  # rows out of order
    for xv, gv in layouts:
        want_y = flat.forward(xv.reshape(12, k).contiguous(), b).view(*xv.shape[:-1], n)
        want_gx = flat.grad(gv.reshape(12, n).contiguous()).view(xv.shape)
        plan = plan_linear_g4(xv, wr, sr, gs, b, n, k)
        for _ in range(2):
            y, gx = plan.forward(xv, b), plan.grad(gv)
            if gv.is_contiguous():  # the few-row kernel wrote dx in place of a view
                assert gx._base is None
            assert torch.equal(gx, want_gx)
            if plan.config["kind"] == "gluon":  # the Gluon forward (GPU); on CPU: dequantize + F.linear
                assert torch.equal(y, want_y) and (y._base is None or not xv.is_contiguous())
            else:  # F.linear's own 2-D and 3-D routes may round the bias add differently
                torch.testing.assert_close(y, want_y, rtol=1e-2, atol=5e-2)


def test_plan_apply_under_functorch_takes_function_apply(monkeypatch):
    """Inside a functorch transform plan_apply goes through Function.apply, which refuses this old-style Function
    with functorch's own error, rather than the C++ apply that would bypass the transform."""
    from hfq_kernels.nvfp4 import plan_apply
    from hfq_kernels.nvfp4_plan import plan_linear_g4

    lay = _layer(48, 96, seed=4)
    x = torch.randn(3, 96, dtype=torch.bfloat16, device=DEV)
    plan = plan_linear_g4(x, lay.weight_g4, lay.weight_g4_scale, lay.weight_global_scale, None, 48, 96)
    monkeypatch.setattr(plan, "dequant", None)  # the plan's own Function, as for a few-row kernel plan
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda t: plan_apply(plan, t, None).float().sum())(x)


def test_kept_dense_bookkeeping_bounds_bytes_and_entries(monkeypatch):
    """KEPT_DENSE's weak-reference bookkeeping: room is refused past the budget and granted again once autograd has
    freed kept weights (the freed ones are pruned when the running total would pass the budget); after a prune finds
    the budget spent, the next checks refuse without pruning; many small kept weights do not grow the list without
    bound; `bytes` is exact."""
    from hfq_kernels.nvfp4 import _KeptDense

    monkeypatch.setattr(SETTINGS, "grad_dense_gb", 4096 / 2**30)  # 4 KiB
    k = _KeptDense()
    ws = [torch.empty(256) for _ in range(4)]  # 1 KiB each
    assert all(k.take(w) for w in ws) and k.bytes == 4096
    extra = torch.empty(256)
    assert not k.take(extra) and not k.room(1)  # spent: refused, then refused without a prune
    assert k._skip > 0
    del ws[:2]  # two weights freed (as autograd frees them after backward)
    assert k.bytes == 2048  # exact; and it ends the skipping
    assert k.take(extra) and k.bytes == 3072
    monkeypatch.setattr(SETTINGS, "grad_dense_gb", 1.0)
    k2 = _KeptDense()
    for _ in range(5000):
        assert k2.take(torch.empty(4))  # freed right away
    assert len(k2._refs) <= 1024 and k2.bytes == 0
    alive = [torch.empty(4) for _ in range(3000)]
    assert all(k2.take(w) for w in alive) and k2.bytes == 3000 * 16 and len(k2._refs) == 3000
