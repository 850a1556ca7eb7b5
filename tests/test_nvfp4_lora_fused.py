"""NVFP4LoraLinear's short forward (NVFP4Linear.forward_lora): the same outputs and gradients as PEFT's own
LoRA forward, taken only for the plain case, and PEFT's forward wherever something else is asked for."""
import pytest
import torch
from torch import nn

import hfq  # noqa: F401 (teaches PEFT to wrap NVFP4Linear)
from hfq_kernels._settings import SETTINGS

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _nodes(y) -> set:
    seen, todo = set(), [y.grad_fn]
    while todo:
        f = todo.pop()
        if f is not None and f not in seen:
            seen.add(f)
            todo += [g for g, _ in f.next_functions]
    return {f.name() for f in seen}


def _fused(y) -> bool:
    """The short route is one autograd node (base + adapter); PEFT's forward scales with a multiply and adds."""
    names = _nodes(y)
    return "_PlanLoraFnBackward" in names and "MulBackward0" not in names and "AddBackward0" not in names


class _Two(nn.Module):
    def __init__(self, k=96, n=48):
        super().__init__()
        self.up = nn.Linear(k, n, bias=True)
        self.down = nn.Linear(n, k, bias=False)

    def forward(self, x):
        return self.down(self.up(x))


def _model(dropout=0.0, r=8, seed=0):
    import peft
    from hfq.nvfp4 import NVFP4Linear

    torch.manual_seed(seed)
    m = _Two()
    for name in ("up", "down"):
        setattr(m, name, NVFP4Linear.from_linear(getattr(m, name)))
    m = m.to(DEV, torch.bfloat16)
    pm = peft.get_peft_model(m, peft.LoraConfig(r=r, lora_alpha=16, lora_dropout=dropout,
                                                target_modules=["up", "down"]))
    for n, p in pm.named_parameters():
        if "lora_" in n:
            p.data = p.data.to(torch.bfloat16)
            if "lora_B" in n:  # PEFT starts B at zero: make the adapter's gradients and output non-trivial
                nn.init.normal_(p, std=0.1)
    return pm


def _layers(pm):
    from hfq.nvfp4.peft_lora import NVFP4LoraLinear

    return [m for m in pm.modules() if isinstance(m, NVFP4LoraLinear)]


def _run(pm, x, seed=1):
    torch.manual_seed(seed)
    x = x.detach().clone().requires_grad_(True)
    y = pm(x)
    y.float().square().sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in pm.named_parameters() if p.grad is not None}
    pm.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


def _peft_path(pm):
    """Forces PEFT's own forward on every LoRA layer (a forward pre-hook on lora_A makes it leave the short one)."""
    return [lay.lora_A["default"].register_forward_pre_hook(lambda mod, args: None) for lay in _layers(pm)]


@pytest.fixture
def planned(monkeypatch):
    monkeypatch.setattr(SETTINGS, "plan_on_cpu", True)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("shape", [(5, 96), (2, 7, 96), (80, 96)])
def test_fused_matches_peft_forward_and_grads(planned, dropout, shape):
    pm = _model(dropout)
    x = torch.randn(*shape, dtype=torch.bfloat16, device=DEV)
    y_f, gx_f, g_f = _run(pm, x)
    hooks = _peft_path(pm)
    y_p, gx_p, g_p = _run(pm, x)
    for h in hooks:
        h.remove()
    assert set(g_f) == set(g_p) and len(g_f) == 4  # lora_A and lora_B of both layers
    for got, ref in [(y_f, y_p), (gx_f, gx_p)] + [(g_f[n], g_p[n]) for n in g_p]:
        err = float((got.float() - ref.float()).norm() / ref.float().norm())
        assert err < 2e-2, err  # bf16: PEFT rounds the adapter's product and its scaling separately


@pytest.mark.parametrize("keep_gb", [0.0, 2.0])
def test_fused_path_is_taken_and_matches_without_grad(planned, monkeypatch, keep_gb):
    """The same kernels with and without grad give the same bits, whatever the kept-weight budget (few-row
    training forwards keep no dense weight)."""
    monkeypatch.setattr(SETTINGS, "grad_dense_gb", keep_gb)
    pm = _model()
    x = torch.randn(6, 96, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    y = pm(x)
    assert _fused(y)
    with torch.no_grad():
        y0 = pm(x)
    torch.testing.assert_close(y0, y.detach(), rtol=0, atol=0)


def _peft_taken(pm, x) -> bool:
    y = pm(x)
    return not _fused(y) and "MulBackward0" in _nodes(y)


def test_peft_forward_runs_where_the_fused_node_does_not_apply(planned):
    pm = _model()
    x = torch.randn(4, 96, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    assert not _peft_taken(pm, x)
    lay = _layers(pm)[1]
    h = lay.lora_B["default"].register_forward_hook(lambda *a: None)
    assert _peft_taken(pm, x)
    h.remove()
    with torch.autocast(DEV, dtype=torch.float16):  # autocast to another dtype than x's: PEFT's forward
        assert _peft_taken(pm, x)
    with pm.disable_adapter():
        pm(x).float().sum().backward()
    assert all(p.grad is None for n, p in pm.named_parameters() if "lora_" in n)
    pm.add_adapter("second", __import__("peft").LoraConfig(r=4, target_modules=["up", "down"]))
    pm.base_model.set_adapter(["default", "second"])
    assert _peft_taken(pm, x)
    pm.base_model.set_adapter("default")
    assert not _peft_taken(pm, x)
    lay.lora_A["default"].float()
    lay.lora_B["default"].float()
    assert _peft_taken(pm, x)  # adapter weights in fp32: PEFT casts the input, as it always did
    lay.lora_A["default"].bfloat16()
    lay.lora_B["default"].bfloat16()
    lay.merge()  # the layer's base is now dense: one product, no adapter path
    names = _nodes(lay(torch.randn(4, 48, dtype=torch.bfloat16, device=DEV, requires_grad=True)))
    assert not names & {"_PlanLoraFnBackward", "AddmmBackward0", "MulBackward0"}


def test_fp32_adapters_under_autocast_match_peft(planned):
    """PEFT's default adapters are fp32 on a bf16 model; Trainer / accelerate run bf16 training under autocast,
    where the short route's products run in bf16 as PEFT's do. Outside autocast such adapters keep PEFT's forward
    (it computes the adapter in fp32)."""
    pm = _model()
    for n, p in pm.named_parameters():
        if "lora_" in n:
            p.data = p.data.float()
    x = torch.randn(2, 7, 96, dtype=torch.bfloat16, device=DEV)
    assert _peft_taken(pm, x.requires_grad_(True))
    results = []
    for force_peft in (False, True):
        hooks = _peft_path(pm) if force_peft else []
        with torch.autocast(DEV, dtype=torch.bfloat16):
            xx = x.detach().clone().requires_grad_(True)
            y = pm(xx)
            assert _fused(y) != force_peft
        y.float().square().sum().backward()
        grads = {n: p.grad.clone() for n, p in pm.named_parameters() if p.grad is not None}
        results.append((y.detach(), xx.grad, grads))
        pm.zero_grad(set_to_none=True)
        for h in hooks:
            h.remove()
    (y_f, gx_f, g_f), (y_p, gx_p, g_p) = results
    assert set(g_f) == set(g_p) and all(g.dtype == torch.float32 for g in g_f.values())
    for got, ref in [(y_f, y_p), (gx_f, gx_p)] + [(g_f[n], g_p[n]) for n in g_p]:
        err = float((got.float() - ref.float()).norm() / ref.float().norm())
        assert err < 2e-2, err


def test_fused_under_activation_checkpointing(planned):
    from torch.utils.checkpoint import checkpoint

    pm = _model()
    x = torch.randn(80, 96, dtype=torch.bfloat16, device=DEV)
    y_ref, gx_ref, g_ref = _run(pm, x)
    xx = x.clone().requires_grad_(True)
    y = checkpoint(pm, xx, use_reentrant=False)
    y.float().square().sum().backward()
    assert torch.equal(y.detach(), y_ref) and torch.equal(xx.grad, gx_ref)
    for n, p in pm.named_parameters():
        if p.grad is not None:
            assert torch.equal(p.grad, g_ref[n]), n


@pytest.mark.parametrize("x_grad,train_bias,keep_gb,dropout", [(True, True, 0.0, 0.0), (False, False, 2.0, 0.3),
                                                               (False, True, 2.0, 0.0), (True, False, 0.0, 0.3)])
@pytest.mark.parametrize("rows", [5, 80])
def test_fused_node_gradients_for_every_input(planned, monkeypatch, x_grad, train_bias, keep_gb, dropout, rows):
    """The one-node route's gradient for each input against PEFT's forward: x with and without a gradient, a
    trainable base bias, dropout, few rows (the plan's own kernel) and many (dense weight kept, or no room for it)."""
    monkeypatch.setattr(SETTINGS, "grad_dense_gb", keep_gb)
    pm = _model(dropout)
    if train_bias:
        for lay in _layers(pm):
            if lay.base_layer.bias is not None:
                lay.base_layer.bias.requires_grad_(True)
    x = torch.randn(rows, 96, dtype=torch.bfloat16, device=DEV)
    out = []
    for force_peft in (False, True):
        hooks = _peft_path(pm) if force_peft else []
        torch.manual_seed(1)
        xx = x.clone().requires_grad_(x_grad)
        y = pm(xx)
        assert ("_PlanLoraFnBackward" in _nodes(y)) != force_peft  # (dropout adds a multiply of its own)
        y.float().square().sum().backward()
        out.append((y.detach(), xx.grad, {n: p.grad.clone() for n, p in pm.named_parameters() if p.grad is not None}))
        pm.zero_grad(set_to_none=True)
        for h in hooks:
            h.remove()
    (y_f, gx_f, g_f), (y_p, gx_p, g_p) = out
    assert set(g_f) == set(g_p) and len(g_f) == 4 + (1 if train_bias else 0)
    assert (gx_f is None) == (gx_p is None) == (not x_grad)
    pairs = [(y_f, y_p)] + ([(gx_f, gx_p)] if x_grad else []) + [(g_f[n], g_p[n]) for n in g_p]
    for got, ref in pairs:
        err = float((got.float() - ref.float()).norm() / ref.float().norm())
        assert err < 2e-2, err


@pytest.mark.parametrize("rows", [5, 80])
def test_second_derivatives_raise(planned, rows):
    """The planned nodes' backward runs kernels that record no graph: differentiating their gradient again raises
    (it would otherwise miss the base weight's part and come out wrong without a word). A plain layer's dense
    training product (many rows) is F.linear's own and stays twice differentiable."""
    from hfq.nvfp4 import NVFP4Linear

    pm = _model()
    plain = NVFP4Linear.from_linear(nn.Linear(96, 48).to(DEV, torch.bfloat16))
    for mod in (pm, plain) if rows <= 64 else (pm,):
        x = torch.randn(rows, 96, dtype=torch.bfloat16, device=DEV, requires_grad=True)
        (gx,) = torch.autograd.grad(mod(x).float().square().sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match="differentiate twice"):
            gx.float().sum().backward()
