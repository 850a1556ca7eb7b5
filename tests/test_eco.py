"""ECO rules: exactness of the exact rule, the paper's Sec. 3.4 ordering, optimizer behaviour and safety."""
import math

import pytest
import torch

from hfq.eco import ECOAdamW, ECOSGD
from hfq_kernels.reference.eco import adamw_, eco_adamw_, eco_sgdm_
from hfq.optim.states import decode8, encode8
from hfq.qparam import QLinear, QParam

DELTA = 0.01


def _grid_sr(gen):
    """Stochastic rounding onto a uniform float64 grid (a quantizer the master-weight run can share)."""
    return lambda x: torch.floor(x / DELTA + torch.rand(x.shape, generator=gen, dtype=x.dtype)) * DELTA


def _quadratic(d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(d, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    h = a @ a.T + 0.1 * torch.eye(d, dtype=torch.float64)
    target = torch.randn(d, generator=g, dtype=torch.float64)
    noise = torch.randn(200, d, generator=g, dtype=torch.float64) * 0.05
    return lambda x, t: h @ (x - target) + noise[t]


@pytest.mark.parametrize("opt", ["sgdm", "adamw"])
def test_exact_rule_reproduces_master_weights_float64(opt):
    grad = _quadratic()
    steps = 120
    lrs = [0.05 * (0.5 + 0.5 * math.cos(math.pi * t / steps)) + 1e-3 for t in range(steps)]  # changing lr
    q_master, q_eco = _grid_sr(torch.Generator().manual_seed(7)), _grid_sr(torch.Generator().manual_seed(7))
    w = torch.randn(64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    theta_m = q_master(w)
    theta = q_eco(w)
    residual = w - theta
    v_m, m = torch.zeros_like(w), torch.zeros_like(w)
    s_m, s = torch.zeros_like(w), torch.zeros_like(w)
    kw = dict(beta1=0.9, beta2=0.99, eps=1e-8) if opt == "adamw" else dict(beta=0.9)
    mem_free = theta.clone()
    mf_m, mf_s = torch.zeros_like(w), torch.zeros_like(w)
    for t, lr in enumerate(lrs):
        # SGDM / AdamW with master weights, gradient at the quantized weights
        g = grad(theta_m, t)
        if opt == "adamw":
            adamw_(w, v_m, s_m, g, step=t + 1, lr=lr, weight_decay=0.1, **kw)
        else:
            v_m.mul_(0.9).add_(g)
            w.mul_(1 - lr * 0.1).add_(v_m, alpha=-lr)
        theta_m = q_master(w)
        # ECO exact rule: no master weights, residual stored
        box = {}

        def requant(tmp, box=box):
            box["theta"] = q_eco(tmp)
            return tmp - box["theta"]

        g = grad(theta, t)
        if opt == "adamw":
            eco_adamw_(theta, m, s, g, step=t + 1, lr=lr, weight_decay=0.1, requant=requant, rule="exact",
                       residual=residual, **kw)
        else:
            eco_sgdm_(theta, m, g, lr=lr, weight_decay=0.1, requant=requant, rule="exact", residual=residual, **kw)
        theta = box["theta"]
        assert torch.equal(theta, theta_m), f"step {t}"
        # memory-free rule on the same problem (must differ: the test above is not vacuous)
        gen_mf = torch.Generator().manual_seed(100 + t)
        qmf = _grid_sr(gen_mf)
        box2 = {}
        g = grad(mem_free, t)
        rq = lambda tmp: (box2.__setitem__("t", qmf(tmp)), tmp - box2["t"])[1]  # noqa: E731
        if opt == "adamw":
            eco_adamw_(mem_free, mf_m, mf_s, g, step=t + 1, lr=lr, weight_decay=0.1, requant=rq, **kw)
        else:
            eco_sgdm_(mem_free, mf_m, g, lr=lr, weight_decay=0.1, requant=rq, **kw)
        mem_free = box2["t"]
    torch.testing.assert_close(theta + residual, w, rtol=0, atol=1e-12)
    assert not torch.equal(mem_free, theta)


def _stationary_sq_grad(mode, lr, beta=0.9, sq=0.01, n=1000, seed=0):
    """Sec. 3.4: f(x) = x^2/2, Q(x) = x + xi with xi ~ N(0, sq^2) independent of x; returns E[f'(Q)^2]."""
    gen = torch.Generator().manual_seed(seed)
    q = lambda x: x + sq * torch.randn(x.shape, generator=gen, dtype=x.dtype)  # noqa: E731
    steps = int(20 / (lr / (1 - beta))) + 200
    theta = torch.full((n,), 0.5, dtype=torch.float64)
    m = torch.zeros_like(theta)
    acc, cnt = 0.0, 0
    for t in range(steps):
        g = theta.clone()
        if mode == "naive":
            m.mul_(beta).add_(g)
            theta = q(theta - lr * m)
        else:
            box = {}

            def requant(tmp, box=box):
                box["t"] = q(tmp)
                return tmp - box["t"]

            eco_sgdm_(theta, m, g, lr=lr, beta=beta, weight_decay=0.0, requant=requant)
            theta = box["t"]
        if t > steps // 2:
            acc += float((theta ** 2).mean())
            cnt += 1
    return acc / cnt


def test_noisy_quadratic_ordering():
    naive = {lr: _stationary_sq_grad("naive", lr) for lr in (0.1, 0.001)}
    eco = {lr: _stationary_sq_grad("eco", lr) for lr in (0.1, 0.001)}
    assert naive[0.001] > 4 * naive[0.1]  # naive removal: error ~ 1/lr
    assert eco[0.001] < 1.5 * eco[0.1]  # ECO: bounded as lr -> 0
    assert eco[0.001] < naive[0.001] / 4


def test_rtn_small_lr_naive_stalls_eco_converges():
    """Updates smaller than half a grid step vanish under naive RTN; ECO accumulates them in momentum."""
    q = lambda x: torch.round(x / 0.05) * 0.05  # noqa: E731
    out = {}
    for mode in ("naive", "eco"):
        theta, m = torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
        for _ in range(3000):
            g = theta.clone()
            if mode == "naive":
                m.mul_(0.9).add_(g)
                theta = q(theta - 1e-3 * m)
            else:
                box = {}
                eco_sgdm_(theta, m, g, lr=1e-3, beta=0.9, weight_decay=0.0,
                          requant=lambda t, box=box: (box.__setitem__("t", q(t)), t - box["t"])[1])
                theta = box["t"]
        out[mode] = float(theta.abs().max())
    assert out["naive"] == 1.0 and out["eco"] <= 0.05


def _net(seed=0):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    net[0] = QLinear.from_linear(net[0], "fp8_e4m3_row")
    return net


def _train(opt_fn, steps=60, seed=0):
    net = _net(seed)
    opt = opt_fn(net)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(128, 32, generator=g), torch.randn(128, 8, generator=g)
    losses = []
    for _ in range(steps):
        loss = ((net(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return net, opt, losses


@pytest.mark.parametrize("kw", [dict(), dict(rounding="rtn"), dict(state_dtype=torch.bfloat16),
                                dict(state_bits=8), dict(rule="exact")])
def test_ecoadamw_trains(kw):
    _, opt, losses = _train(lambda n: ECOAdamW(n.parameters(), lr=1e-2, **kw))
    assert losses[-1] < 0.5 * losses[0]
    st = opt.state[next(iter(opt.param_groups[0]["params"]))]
    if "state_dtype" in kw:
        assert st["exp_avg"].dtype == torch.bfloat16
    if "state_bits" in kw:
        assert st["exp_avg_q8"].dtype == torch.int8 and "exp_avg" not in st


@pytest.mark.parametrize("make,gscale", [(lambda ps, lr: ECOAdamW(ps, lr=lr, weight_decay=0.0, state_bits=8), 1),
                                         (lambda ps, lr: ECOSGD(ps, lr=lr, momentum=0.9, state_bits=8), 100)],
                         ids=["adamw", "sgd"])
def test_8bit_states_keep_small_updates_under_the_memory_free_rule(make, gscale):
    """The memory-free rule puts the quantization error (~1/lr times a gradient increment) into the momentum; its
    8-bit store must not round the increments away: under a constant gradient at lr 1e-6 the quantized weight
    moves as the same optimizer's float weight does (round-to-nearest storage gave 0.2 of it after 1000 steps)."""
    torch.manual_seed(0)
    w0, g = torch.randn(16, 256) * 0.02, torch.randn(16, 256) * 1e-3 * gscale  # SGD: a step of ~lr * 1e-3
    moved = {}
    for kind in ("float", "fp8"):
        p = torch.nn.Parameter(w0.clone() if kind == "float" else QParam.from_float(w0, "fp8_e4m3_row"))
        opt = make([p], 1e-6)
        for _ in range(300):
            p.grad = g.to(p.dtype)
            opt.step()
        w = p.detach() if kind == "float" else p.dequantize(torch.float32)
        moved[kind] = float(((w0 - w) * g.sign()).mean())
    assert moved["float"] > 0 and 0.85 < moved["fp8"] / moved["float"] < 1.15, moved


def test_encode8_stochastic_rounding_is_unbiased():
    x = torch.full((4 * 2048,), 0.3)
    x[0] = 1.0  # the block's absmax: 0.3 sits between two companded codes
    gen = torch.Generator().manual_seed(0)
    mean = torch.stack([decode8(*encode8(x, True, gen), x.shape, True)[1:2048] for _ in range(50)]).mean()
    nearest = decode8(*encode8(x, True), x.shape, True)[1]
    assert abs(float(mean) - 0.3) < 2e-4 < abs(float(nearest) - 0.3)


def test_ecosgd_trains():
    _, _, losses = _train(lambda n: ECOSGD(n.parameters(), lr=0.05, momentum=0.9))
    assert losses[-1] < 0.7 * losses[0]


def test_state_dict_roundtrip_resumes_exactly():
    mk = lambda n: ECOAdamW(n.parameters(), lr=1e-2, state_dtype=torch.bfloat16)  # noqa: E731
    net, opt, _ = _train(mk, steps=5)
    sd_net = {k: v.clone() for k, v in net.state_dict().items()}
    sd_opt = opt.state_dict()
    net2 = _net(5)
    net2.load_state_dict(sd_net)
    opt2 = mk(net2)
    opt2.load_state_dict(sd_opt)
    st = opt2.state[net2[0].weight]
    assert st["exp_avg"].dtype == torch.bfloat16  # not cast to the param dtype by torch
    x = torch.randn(16, 32)
    for n, o in ((net, opt), (net2, opt2)):
        for _ in range(3):
            o.zero_grad()
            n(x).pow(2).mean().backward()
            o.step()
    assert torch.equal(net[0].weight.codes.view(torch.uint8), net2[0].weight.codes.view(torch.uint8))


def test_bad_args_and_nan_refusal():
    net = _net()
    with pytest.raises(ValueError, match="lr"):
        ECOAdamW(net.parameters(), lr=0)
    with pytest.raises(ValueError, match="lr"):
        ECOSGD(net.parameters(), lr=float("nan"))
    with pytest.raises(ValueError, match="betas"):
        ECOAdamW(net.parameters(), betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="momentum"):
        ECOSGD(net.parameters(), momentum=0.0)
    with pytest.raises(ValueError, match="rounding"):
        ECOAdamW(net.parameters(), rounding="nearest")
    with pytest.raises(ValueError, match="rule"):
        ECOSGD(net.parameters(), rule="fast")
    opt = ECOAdamW(list(net.named_parameters()), lr=1e-2)
    net(torch.randn(4, 32)).sum().backward()
    net[0].weight.grad[0, 0] = float("nan")
    codes = net[0].weight.codes.clone()
    bias = net[2].bias.detach().clone()
    with pytest.raises(ValueError, match=r"0\.weight"):
        opt.step()
    assert torch.equal(net[0].weight.codes.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(net[2].bias, bias)


def test_8bit_states_roundtrip():
    x = torch.randn(5000) * torch.logspace(-4, 0, 5000)
    c, a = encode8(x, signed=True)
    y = decode8(c, a, x.shape, signed=True)
    assert ((y - x).abs() <= 0.02 * x.abs().max()).all()
    v = x ** 2
    c, a = encode8(v, signed=False)
    assert (decode8(c, a, v.shape, signed=False) >= 0).all()


def test_lr_zero_leaves_weights():
    net = _net()
    opt = ECOAdamW(net.parameters(), lr=1e-2)
    opt.param_groups[0]["lr"] = 0.0  # a warm-up scheduler's first step
    net(torch.randn(4, 32)).sum().backward()
    before = net[0].weight.dequantize()
    opt.step()
    assert torch.equal(net[0].weight.dequantize(), before)
    assert isinstance(net[0].weight, QParam)


def test_group_hyper_parameters_are_checked_before_anything_moves():
    """A parameter group's own value (momentum=0 is fine in torch's SGD, ECO divides by it; a beta of 1) is refused
    naming the group: at construction, by add_param_group, and at step() for a group edited since, before any
    parameter moves; numpy scalars are accepted as numbers."""
    import numpy as np

    net = _net()
    with pytest.raises(ValueError, match=r"ECOSGD param_groups\[1\]: momentum must be in \(0, 1\)"):
        ECOSGD([{"params": net[0].parameters()}, {"params": net[2].parameters(), "momentum": 0.0}])
    opt = ECOAdamW(net[0].parameters(), lr=np.float32(1e-2), betas=(np.float64(0.9), 0.999))
    with pytest.raises(ValueError, match=r"param_groups\[1\]: betas\[1\] must be in \(0, 1\), got 1.0"):
        opt.add_param_group({"params": net[2].parameters(), "betas": (0.9, 1.0)})
    opt = ECOSGD(net.parameters(), lr=1e-2)
    net(torch.randn(4, 32)).sum().backward()
    before = [p.detach().clone() for p in net.parameters()]
    opt.param_groups[0]["momentum"] = 0.0
    with pytest.raises(ValueError, match=r"param_groups\[0\]: momentum"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, (p.detach() for p in net.parameters())))
    opt.param_groups[0].update(momentum=0.9, lr=0.0)  # a warm-up's first lr
    opt.step()


@pytest.mark.parametrize("saved, loaded, what", [
    (dict(), dict(state_bits=8), "exp_avg_q8"), (dict(), dict(state_dtype=torch.bfloat16), "bfloat16"),
    (dict(rule="exact"), dict(), "residual"), (dict(), "sgd", r"has no \['momentum'\]")])
def test_a_checkpoint_of_other_state_options_is_refused_at_load(saved, loaded, what):
    """Resuming with other state options (or another ECO optimizer) used to fail at the first step with a
    KeyError, or keep the saved format silently (bf16 states asked, fp32 kept; the exact rule's residual dropped)."""
    _, opt, _ = _train(lambda n: ECOAdamW(n.parameters(), lr=1e-2, **saved), steps=2)
    net = _net()
    other = ECOSGD(net.parameters()) if loaded == "sgd" else ECOAdamW(net.parameters(), lr=1e-2, **loaded)
    with pytest.raises(ValueError, match=rf"load_state_dict: .*{what}"):
        other.load_state_dict(opt.state_dict())


@pytest.mark.parametrize("make", [lambda ps: ECOAdamW(ps, lr=1e-2), lambda ps: __import__("hfq").QLion(ps, lr=1e-3)])
def test_a_checkpoint_of_another_parameter_order_is_refused_at_load(make):
    """An optimizer built over the parameters in another order than the checkpoint's used to take the saved
    states of the wrong parameters (same dtypes) and fail half-way through its next step, some weights moved."""
    net, opt, _ = _train(lambda n: make(list(n.parameters())), steps=2)
    other = make(list(reversed(list(net.parameters()))))
    with pytest.raises(ValueError, match=r"load_state_dict: the saved .* has shape .*another order"):
        other.load_state_dict(opt.state_dict())
    same = make(list(net.parameters()))
    same.load_state_dict(opt.state_dict())


def test_trainer_kwargs_refuse_a_weight_decay_trainer_would_override_and_read_booleans():
    from transformers import TrainingArguments

    from hfq.eco import optimizer_cls_and_kwargs

    args = TrainingArguments("out", optim_args="check_finite=0,fused=yes", report_to="none")
    kw = optimizer_cls_and_kwargs(args)[1]
    assert (kw["check_finite"], kw["fused"]) == (False, True)
    with pytest.raises(ValueError, match=r"weight_decay: .*TrainingArguments\(weight_decay"):
        optimizer_cls_and_kwargs(args, weight_decay=0.1)
    with pytest.raises(ValueError, match="bad value for check_finite: 'ture' .*allowed"):
        optimizer_cls_and_kwargs(TrainingArguments("out", optim_args="check_finite=ture", report_to="none"))


def test_trainer_kwargs_take_the_runs_seed():
    """Stochastic rounding drew from the optimizer's seed=0 whatever TrainingArguments.seed said: a seed sweep repeated
    the same rounding noise in every run. The run's seed is the default; optim_args and keyword overrides win."""
    from transformers import TrainingArguments

    from hfq.eco import optimizer_cls_and_kwargs

    assert optimizer_cls_and_kwargs(TrainingArguments("out", seed=7, report_to="none"))[1]["seed"] == 7
    assert optimizer_cls_and_kwargs(TrainingArguments("out", seed=7, optim_args="seed=3", report_to="none"),
                                    "eco_sgd")[1]["seed"] == 3
    assert optimizer_cls_and_kwargs(TrainingArguments("out", seed=7, report_to="none"), seed=4)[1]["seed"] == 4
    steps = {}
    for seed in (1, 2):
        torch.manual_seed(0)
        net = _net()
        cls, kw = optimizer_cls_and_kwargs(TrainingArguments("out", seed=seed, learning_rate=1e-3, report_to="none"))
        opt = cls(net.parameters(), **{**kw, "rounding": "sr"})
        net(torch.ones(4, 32)).sum().backward()
        opt.step()
        steps[seed] = [p.detach().float().clone() for p in net.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(steps[1], steps[2]))


def test_trainer_kwargs_are_read_from_the_args_when_trainer_builds_the_optimizer(tmp_path):
    """optimizer_cls_and_kwargs(args) copied lr / betas / eps / seed when it was called: each trial of
    Trainer.hyperparameter_search (which sets the trial's values on trainer.args and rebuilds the optimizer) trained
    with the first values, silently. They are read when Trainer builds the optimizer; overrides still win."""
    from transformers import Trainer, TrainingArguments

    from hfq.eco import optimizer_cls_and_kwargs

    args = TrainingArguments(str(tmp_path), learning_rate=1e-2, report_to="none", use_cpu=True)
    pair = optimizer_cls_and_kwargs(args, rounding="sr")
    for lr, beta1, seed in ((1e-4, 0.5, 7), (3e-3, 0.8, 9)):  # two trials: what _hp_search_setup sets on args
        args.learning_rate, args.adam_beta1, args.seed = lr, beta1, seed
        tr = Trainer(model=_net(), args=args, optimizer_cls_and_kwargs=pair)
        opt = tr.create_optimizer()
        g = opt.param_groups[0]
        assert (g["lr"], g["betas"], opt._seed, opt.rounding) == (lr, (beta1, 0.999), seed, "sr")
    kw = pair[1]
    assert "params" not in kw and dict(kw) == {**kw} and kw["lr"] == 3e-3
    kw["lr"] = 5e-4  # set by hand: wins over the args
    args.learning_rate = 1.0
    assert kw["lr"] == 5e-4 and dict(kw)["eps"] == args.adam_epsilon


def test_fused_requests_the_step_cannot_honour_are_said_and_a_nan_update_names_its_parameter():
    from hfq.qft import QLion

    net = _net()
    with pytest.raises(ValueError, match="fused=True: .*momentum_bits=8"):
        QLion(net.parameters(), momentum_bits=None, fused=True)
    with pytest.warns(UserWarning, match="none of its parameters is an fp8_e4m3_row QParam"):
        ECOAdamW(net[2].parameters(), fused=True)
    opt = ECOAdamW(list(net.named_parameters()), lr=1e-2, check_finite=False)
    net(torch.randn(4, 32)).sum().backward()
    net[0].weight.grad[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"ECOAdamW.step: 0\.weight: .*check_finite=False"):
        opt.step()


def test_ecoadamw_bf16_second_moment_keeps_decaying():
    """bf16 states: the second moment follows its EMA once gradients shrink (nearest rounding kept it at its peak:
    0.999 decay per step is below half a bf16 step), so the update is not held small for the rest of the run."""
    w = torch.nn.Parameter(torch.zeros(64, 64))
    ref = torch.nn.Parameter(torch.zeros(64, 64))
    opt = ECOAdamW([w], lr=1e-3, weight_decay=0.0, state_dtype=torch.bfloat16)
    opt_ref = ECOAdamW([ref], lr=1e-3, weight_decay=0.0)
    for i in range(600):
        g = 1.0 if i < 50 else 0.01
        for p, o in ((w, opt), (ref, opt_ref)):
            p.grad = torch.full_like(p, g)
            o.step()
    v, v_ref = opt.state[w]["exp_avg_sq"].float(), opt_ref.state[ref]["exp_avg_sq"]
    assert opt.state[w]["exp_avg_sq"].dtype == torch.bfloat16
    ratio = float(v.mean() / v_ref.mean())
    assert abs(ratio - 1) < 0.03, ratio  # nearest rounding: ~1.7x (stuck near the 50-step peak)
