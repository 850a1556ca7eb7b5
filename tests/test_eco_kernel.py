"""Fused Triton ECO-AdamW step (interpreter on CPU) vs its torch reference."""
import copy

import pytest
import torch

import hfq_kernels.eco as K
from hfq.eco import ECOAdamW
from hfq_kernels.reference import eco as Fn
from hfq_kernels.reference.fp8 import dequantize_fp8_row, e4m3_ulp, quantize_fp8_row
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


def _assert_step_matches(a, b):
    """Fused result a vs torch reference b (lists codes, scales, grad, exp_avg, exp_avg_sq)."""
    ca, cb = a[0].view(torch.uint8), b[0].view(torch.uint8)
    if DEV == "cpu":  # the interpreter evaluates the reference's fp32 ops in the same order: bit-identical
        assert torch.equal(ca, cb)
        for x, y in zip(a[1:], b[1:]):
            assert torch.equal(x, y)
        return
    # On a GPU the reference runs torch's own kernels; a last-bit difference in tmp = theta*decay - lr_t*m/denom
    # (e.g. a multiply-add fused in one of them) moves the row absmax, hence the new scale, by an ulp, and can flip
    # a value sitting on a rounding boundary to its neighbour code. Then that element's error feedback differs by
    # a grid step, so its exp_avg is compared only where the codes agree.
    torch.testing.assert_close(a[1], b[1], rtol=1e-6, atol=0)
    diff = ca != cb
    n = ca.numel()
    assert int(diff.sum()) <= max(2, int(1e-3 * n)), f"{int(diff.sum())} of {n} codes differ"
    qa, qb = a[0].float(), b[0].float()
    step = e4m3_ulp(torch.maximum(qa.abs(), qb.abs()))
    assert ((qa - qb).abs() <= step).all(), "a code differs by more than one E4M3 step"
    torch.testing.assert_close(a[3][~diff], b[3][~diff], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a[4], b[4], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("shape,one_pass", [((5, 37), 8192), ((3, 300), 128), ((1, 64), 8192), ((4, 129), 64)])
def test_rtn_matches_reference(shape, one_pass, monkeypatch):
    monkeypatch.setattr(K, "MAX_ONE_PASS", one_pass)
    s = _state(*shape, seed=sum(shape))
    a, b = _clone(s), _clone(s)
    K.eco_adamw_fp8_step_triton(*a, rounding="rtn", **KW)
    K.eco_adamw_fp8_step_ref(*b, rounding="rtn", **KW)
    _assert_step_matches(a, b)


def test_multi_tensor_step_matches_reference(monkeypatch):
    """One multi-tensor call over mixed widths (one-pass, two-pass) and dtypes == the reference per tensor."""
    monkeypatch.setattr(K, "MAX_ONE_PASS", 128)
    specs = [((4, 64), torch.float32), ((9, 200), torch.bfloat16), ((3, 64), torch.float32), ((2, 130), torch.float32),
             ((17, 16), torch.bfloat16)]
    states = [_state(*shape, seed=i, state_dtype=dt) for i, (shape, dt) in enumerate(specs)]
    states[3][2] = states[3][2].float()  # an fp32 gradient
    a, b = [_clone(s) for s in states], [_clone(s) for s in states]
    K.eco_adamw_fp8_multi_step_(*[list(x) for x in zip(*a)], rounding="rtn", **KW)
    for x in b:
        K.eco_adamw_fp8_step_ref(*x, rounding="rtn", **KW)
    for x, y in zip(a, b):
        _assert_step_matches(x, y)


def test_sr_is_unbiased():
    """Mean of SR results over seeds -> the unrounded target tmp (16-bit uniforms: bias < 2^-17 step)."""
    s = _state(8, 128, seed=3)
    tmp = {}

    def capture(t):
        tmp["t"] = t.clone()
        c, sc = quantize_fp8_row(t)
        tmp["s"] = sc
        return t - dequantize_fp8_row(c, sc)

    m, v = s[3].clone(), s[4].clone()
    Fn.eco_adamw_(dequantize_fp8_row(s[0], s[1]), m, v, s[2].float(), requant=capture,
                  **{k: KW[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay", "step")})
    target, scale = tmp["t"], tmp["s"]
    n = 48
    acc = torch.zeros_like(target)
    for seed in range(n):
        a = _clone(s)
        K.eco_adamw_fp8_step_triton(*a, rounding="sr", seed=seed, **KW)
        torch.testing.assert_close(a[1], scale, rtol=1e-6, atol=0)  # the scale does not depend on the rounding
        acc += dequantize_fp8_row(a[0], a[1])
    step = e4m3_ulp(target / scale) * scale
    z = ((acc / n - target) / step)  # per element: mean of n Bernoulli errors, sd <= 0.5/sqrt(n)
    assert z.abs().max() < 5 * 0.5 / n ** 0.5 + 1e-3
    assert abs(z.mean().item()) < 5 * 0.5 / (n * z.numel()) ** 0.5  # no systematic bias


def test_sr_streams_differ_between_tensors():
    s = _state(4, 256, seed=5)
    a, b = _clone(s), _clone(s)
    K.eco_adamw_fp8_multi_step_([a[0], b[0]], [a[1], b[1]], [a[2], b[2]], [a[3], b[3]], [a[4], b[4]], rounding="sr",
                                seed=7, **KW)
    assert not torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))


@pytest.mark.parametrize("rows, cols, pieces", [(8, 256, 2), (12, 96, 3), (6, 9000, 2)])
def test_sr_row_shards_draw_what_the_whole_weight_draws(rows, cols, pieces):
    """FSDP2 row shards stepped with their first global row and the weight's stream end bit-identical to the
    whole weight stepped at once (one-pass and two-pass rows)."""
    s = _state(rows, cols, seed=4)
    whole = _clone(s)
    K.eco_adamw_fp8_multi_step_(*[[t] for t in whole], rounding="sr", seed=11, streams=[5], **KW)
    n = rows // pieces
    parts = [[t[i * n:(i + 1) * n].clone() for t in s] for i in range(pieces)]
    K.eco_adamw_fp8_multi_step_(*[list(x) for x in zip(*parts)], rounding="sr", seed=11, streams=[5] * pieces,
                                first_rows=[i * n for i in range(pieces)], **KW)
    for k in range(5):
        got = torch.cat([p[k] for p in parts])
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                           whole[k].view(torch.uint8) if got.dtype == torch.float8_e4m3fn else whole[k]), k


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


@pytest.mark.parametrize("first", [True, False])
def test_fused_optimizer_refuses_nonfinite_grad_untouched(first):
    torch.manual_seed(0)
    net = torch.nn.Sequential(QLinear.from_linear(torch.nn.Linear(32, 16)), QLinear.from_linear(torch.nn.Linear(16, 8)))
    net = net.to(DEV)
    opt = ECOAdamW(net.parameters(), lr=1e-2, rounding="sr", fused=True)
    x = torch.randn(4, 32, device=DEV)
    if not first:
        net(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    net(x).pow(2).mean().backward()
    net[1].weight.grad[0, 0] = float("inf")
    codes = [m.weight.codes.clone() for m in net]
    scales = [m.weight.scales.clone() for m in net]
    sd = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="non-finite"):
        opt.step()
    for mod, c, sc in zip(net, codes, scales):
        assert torch.equal(mod.weight.codes.view(torch.uint8), c.view(torch.uint8))
        assert torch.equal(mod.weight.scales, sc)
    sd2 = opt.state_dict()
    assert sd2["state"].keys() == sd["state"].keys()
    for k, st in sd["state"].items():
        for name, t in st.items():
            assert torch.equal(sd2["state"][k][name], t), (k, name)


@pytest.mark.parametrize("one_pass", [8192, 64])
def test_bf16_second_moment_decays_with_state_sr(one_pass, monkeypatch):
    """A bf16 second moment under beta2 = 0.999 with no gradient: nearest rounding gives the old value back every
    step (0.1% decay < half a bf16 step), stochastic rounding (state_sr) follows 0.999^n on average; a fresh seed
    per step, as ECOAdamW draws it."""
    monkeypatch.setattr(K, "MAX_ONE_PASS", one_pass)
    s = _state(8, 128, seed=6, state_dtype=torch.bfloat16)
    s[2].zero_()
    s[4].fill_(1.0)
    kw = dict(KW, beta2=0.999)
    rtn, sr = _clone(s), _clone(s)
    n = 30
    for i in range(n):
        kw["step"] = 1000 + i  # bias corrections ~1: the weight barely moves
        K.eco_adamw_fp8_step_triton(*rtn, rounding="rtn", **kw)
        K.eco_adamw_fp8_multi_step_(*[[t] for t in sr], rounding="rtn", seed=100 + i, state_sr=True, **kw)
    assert torch.equal(rtn[4], torch.ones_like(rtn[4]))  # stuck
    target = 0.999 ** n
    mean = float(sr[4].float().mean())
    assert abs(mean - target) < 0.002, (mean, target)
    vals = sr[4].float().unique()
    assert len(vals) >= 2 and float(vals.max()) <= 1.0  # neighbours on the bf16 grid, never above the start
