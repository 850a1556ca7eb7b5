"""QFT's missing pieces: INT8 quantizer for gradients/momentum, QLion (Lion with INT8 momentum) against a float
Lion, the INT8 gradient store of QFTConfig(gradient_bits=8), bytes/param, a tiny Llama trained with Trainer + QLion
(loss falls, resume is bit-exact), and bad inputs."""
import copy
import io
import math

import pytest
import torch
from torch import nn
from transformers import (AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments,
                          get_cosine_schedule_with_warmup)

import hfq
from hfq_kernels.reference.intq import quantize_int_asym
from hfq.qft import Int8Grad, QFTConfig, QFTLinear, QLion, int8_grad, quantize_model_, quantize_rows, state_bytes
from hfq.qft import dequantize_rows
from hfq.qparam import QLinear, QParam


def _ref_lion_step(p, m, g, lr, b1, b2, wd):
    """Appendix A, written as the paper does: theta -= lr*(sign(c) + wd*theta); m = b2*m + (1-b2)*g."""
    c = b1 * m + (1 - b1) * g
    p = p - lr * (torch.sign(c) + wd * p)
    return p, b2 * m + (1 - b2) * g


def max_error(scales, shape):
    """Round-to-nearest error bound per element: half a step of its row (broadcast to `shape`)."""
    rows = scales.shape[0]
    return (scales / 2).expand(rows, math.prod(shape) // rows).reshape(shape)


def test_int8_rows_quantizer():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 40, generator=g) * torch.logspace(-3, 1, 16).unsqueeze(1)
    codes, scales, zeros = quantize_rows(x)
    ref = quantize_int_asym(x, 8)  # same eq. 1-2 as the weights' dense part
    for a, b in zip((codes, scales, zeros), ref):
        assert torch.equal(a, b)
    assert codes.dtype == torch.uint8 and scales.dtype == torch.float32 and scales.shape == (16, 1)
    back = dequantize_rows(codes, scales, zeros, x.shape)
    assert ((back - x).abs() <= max_error(scales, x.shape) * (1 + 1e-5)).all()  # round trip: half a step per row
    # 0-D / 1-D: one row; zeros stay exactly zero
    v = torch.tensor([0.0, 1.5, -0.25, 0.0])
    c, s, z = quantize_rows(v)
    assert c.shape == (1, 4) and dequantize_rows(c, s, z, v.shape)[0] == 0 and dequantize_rows(c, s, z, v.shape)[3] == 0
    c, s, z = quantize_rows(torch.zeros(3, 5))
    assert dequantize_rows(c, s, z, (3, 5)).abs().max() == 0


def test_qlion_fp32_momentum_is_lion():
    """momentum_bits=None: plain fp32 params follow the reference Lion (Appendix A) to float rounding."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(8, 12))
    b = nn.Parameter(torch.randn(12))
    opt = QLion([p, b], lr=0.01, betas=(0.9, 0.99), weight_decay=0.1, momentum_bits=None)
    rp, rb, mp, mb = p.detach().clone(), b.detach().clone(), torch.zeros(8, 12), torch.zeros(12)
    for _ in range(6):
        gp, gb = torch.randn(8, 12), torch.randn(12)
        p.grad, b.grad = gp.clone(), gb.clone()
        opt.step()
        rp, mp = _ref_lion_step(rp, mp, gp, 0.01, 0.9, 0.99, 0.1)
        rb, mb = _ref_lion_step(rb, mb, gb, 0.01, 0.9, 0.99, 0.1)
    torch.testing.assert_close(p.detach(), rp, rtol=0, atol=1e-6)
    torch.testing.assert_close(b.detach(), rb, rtol=0, atol=1e-6)
    torch.testing.assert_close(opt.state[p]["exp_avg"], mp, rtol=0, atol=1e-6)


def test_qlion_int8_momentum_tracks_float_lion():
    """Same gradient sequence into INT8-momentum QLion and float Lion: the momentum differs by at most the
    accumulated half-steps sum_k beta2^(K-k) s_k/2, and an update sign differs only where |c| is within
    beta1 times that bound (paper Lemma 1's mechanism); few signs differ, weights stay within 2*lr per flip."""
    torch.manual_seed(1)
    lr, b1, b2, steps = 1e-2, 0.9, 0.99, 8
    p = nn.Parameter(torch.randn(32, 64))
    opt = QLion([p], lr=lr, betas=(b1, b2))
    rp, rm = p.detach().clone(), torch.zeros(32, 64)
    bound = torch.zeros(32, 1)
    flips, total = 0, 0
    for _ in range(steps):
        g = torch.randn(32, 64) + 0.3  # a drift so momentum builds up
        st = opt.state[p]
        mq = dequantize_rows(st["exp_avg_codes"], st["exp_avg_scales"], st["exp_avg_zeros"], p.shape) if st \
            else torch.zeros_like(rm)
        assert ((mq - rm).abs() <= bound * (1 + 1e-4) + 1e-7).all()
        c_ref = b1 * rm + (1 - b1) * g
        before = p.detach().clone()
        p.grad = g.clone()
        opt.step()
        d_q = torch.sign(before - p.detach())  # this step's update direction of QLion
        differ = d_q != torch.sign(c_ref)
        assert (c_ref[differ].abs() <= (b1 * bound.expand_as(c_ref))[differ] * (1 + 1e-4) + 1e-7).all()
        flips += int(differ.sum())
        total += differ.numel()
        # continue the float reference from QLion's weights, so the comparison is per step
        rp, rm = _ref_lion_step(before, rm, g, lr, b1, b2, 0.0)
        bound = b2 * bound + opt.state[p]["exp_avg_scales"] / 2
        assert ((p.detach() - rp).abs() <= 2 * lr * differ.float() + 1e-6).all()
    assert flips / total < 0.02, flips / total


def test_qparam_step_is_requantized_lion_step_and_rtn_freezes_small_updates():
    torch.manual_seed(2)
    w = torch.randn(16, 64) * 0.05
    q = nn.Parameter(QParam.from_float(w, "int8_dense_sparse"))
    g = torch.randn(16, 64)
    # one RTN step == Q(w - lr*(sign(c) + wd*w)) with the weight's own (lazy) thresholds
    expect = copy.deepcopy(q)
    w0 = q.dequantize(torch.float32)
    c = 0.1 * g  # m0 = 0, beta1 = 0.9
    expect.requantize_(w0 * (1 - 0.01 * 0.1) - 0.01 * torch.sign(c), "rtn")
    opt = QLion([q], lr=0.01, weight_decay=0.1, rounding="rtn")
    q.grad = g.to(torch.bfloat16)
    opt.step()
    for a, b in zip(q.qtensors().values(), expect.qtensors().values()):
        assert torch.equal(a, b)
    # lr far below half an INT8 step: RTN rounds every update away, SR moves the weights by lr on average
    step = q.scales.min().item()
    lr = step / 20
    moved = {}
    for rounding in ("rtn", "sr"):
        p = nn.Parameter(QParam.from_float(w, "int8_dense_sparse"))
        dense = p.codes.clone()
        start = p.dequantize(torch.float32)
        o = QLion([p], lr=lr, rounding=rounding, seed=3)
        for _ in range(10):
            p.grad = torch.ones_like(w, dtype=torch.bfloat16)  # sign(c) = +1 everywhere
            o.step()
        moved[rounding] = ((start - p.dequantize(torch.float32)) / (10 * lr))[p.codes == dense].numel(), \
            ((start - p.dequantize(torch.float32)) / (10 * lr)).mean().item()
        if rounding == "rtn":
            assert torch.equal(p.codes, dense)
    assert 0.7 < moved["sr"][1] < 1.3, moved  # unbiased: about lr per step


@pytest.mark.parametrize("fmt", ["int8_dense_sparse", "fp8_e4m3_row"])
def test_rtn_lr_below_half_a_step_warns_once_lrs_stop_rising(fmt):
    """rounding="rtn" with an lr below half the quantization step freezes the weights silently (above): once the lrs
    stop rising (step 2 at a constant lr, the end of a warm-up) QLion checks what a step of the peak lr does and
    warns when nearest rounding takes most of it back. Not during a warm-up, not for SR, not at a large lr."""
    import warnings

    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)) * 0.05
    small = QParam.from_float(w, fmt).dequantize(torch.float32).abs().max().item() / 2000  # << half a step

    def warned(rounding, lrs, first_lr):
        p = nn.Parameter(QParam.from_float(w, fmt))
        o = QLion([p], lr=first_lr, rounding=rounding)
        got = []
        for i, lr in enumerate(lrs):
            o.param_groups[0]["lr"] = lr
            p.grad = torch.randn(16, 64).to(torch.bfloat16)
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                o.step()
            got += [(i, str(r.message)) for r in rec if "rounding='rtn'" in str(r.message)]
        return got

    got = warned("rtn", [small] * 4, small)
    assert [i for i, _ in got] == [1] and "barely change" in got[0][1] and "rounding='sr'" in got[0][1], got
    assert warned("sr", [small] * 4, small) == []
    assert warned("rtn", [0.05] * 4, 0.05) == []  # lr far above half a step: the weights move
    warm = [small / 8, small / 4, small / 2, small, small, small]  # warm-up to a small peak: warned after it
    assert [i for i, _ in warned("rtn", warm, small)] == [4]
    assert warned("rtn", [small / 4, small, 0.05, 0.05], small) == []  # warm-up to a peak that moves the weights


@pytest.mark.parametrize("fused", [False, True])
def test_sr_moves_the_bf16_outliers_too(monkeypatch, fused):
    """An outlier kept in bf16 moves by lr per step on average under SR (nearest rounding would return it to
    where it was whenever lr is below half its ulp, as here: |w| >= 2, lr 2e-3 < 2^-7 / 2)."""
    import hfq.qparam

    if fused:
        monkeypatch.setattr(hfq.qparam.formats, "FORCE_INT8_KERNELS", True)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 128, generator=g) * 0.05
    hot = torch.rand(8, 128, generator=g) < 0.03  # fewer than the upper tail's 5 %
    w[hot] = 2.0 + torch.rand(int(hot.sum()), generator=g)  # the outliers: bf16 ulp 2^-6 there
    lr, steps = 2e-3, 12
    drift = {}
    for rounding in ("rtn", "sr"):
        p = nn.Parameter(QParam.from_float(w, "int8_dense_sparse", outlier_fraction=0.1))
        idx0 = p.sparse_idx.clone().long()
        idx0 = idx0[hot.reshape(-1)[idx0]]  # the planted outliers (the lower tail holds some dense values too)
        start = p.dequantize(torch.float32).reshape(-1)[idx0]
        assert idx0.numel() == int(hot.sum()) > 15
        o = QLion([p], lr=lr, rounding=rounding, seed=1, fused=fused)
        for _ in range(steps):
            p.grad = torch.ones_like(w, dtype=torch.bfloat16)  # sign(c) = +1: every weight moves down by lr
            o.step()
        drift[rounding] = ((start - p.dequantize(torch.float32).reshape(-1)[idx0]) / (steps * lr)).mean().item()
    assert drift["rtn"] == 0.0  # nearest rounding undoes every step
    assert 0.6 < drift["sr"] < 1.4, drift  # unbiased: about lr per step


def _tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return AutoModelForCausalLM.from_config(cfg)


def test_int8_gradient_store_and_bytes_per_param():
    base = _tiny_llama()
    m8, m16 = copy.deepcopy(base), copy.deepcopy(base)
    quantize_model_(m8, QFTConfig(weight_format="int8_dense_sparse", gradient_bits=8))
    quantize_model_(m16, QFTConfig(weight_format="int8_dense_sparse"))
    lin8, lin16 = m8.model.layers[0].mlp.down_proj, m16.model.layers[0].mlp.down_proj
    assert isinstance(lin8, QFTLinear) and lin8.gradient_bits == 8 and type(lin16) is QLinear
    x = torch.randint(3, 96, (4, 16))
    m8(x, labels=x).loss.backward()
    m16(x, labels=x).loss.backward()
    w8, w16 = lin8.weight, lin16.weight
    assert isinstance(w8.grad, Int8Grad) and type(w16.grad) is torch.Tensor  # no full-size float gradient is kept
    q8 = int8_grad(w8)
    assert q8.param_name == "model.layers.0.mlp.down_proj.weight" and q8.codes.dtype == torch.uint8
    ref = w16.grad.float()  # bf16 .grad: itself rounded to 2^-8 relative
    assert ((q8.dequantize() - ref).abs() <= max_error(q8.scales, ref.shape) + ref.abs() * 2 ** -8).all()
    # gradient accumulation: a second backward adds into the INT8 store
    m8(x, labels=x).loss.backward()
    assert q8.count == 2
    torch.testing.assert_close(q8.dequantize(), 2 * ref, rtol=0, atol=float(3 * q8.scales.max()))
    # memory after a QLion step + the next backward: weights + INT8 grads + INT8 momentum, measured
    opt = QLion(m8.parameters(), lr=1e-3)
    opt.step()
    assert int8_grad(w8) is None  # consumed
    m8(x, labels=x).loss.backward()
    qs = state_bytes(m8, opt, only_quantized=True)
    assert qs["grads"] > 0 and qs["optimizer"] > 0
    per = {k: qs[k] / qs["params"] for k in ("weights", "grads", "optimizer")}
    # codes 1 B + per-row scale/zero (5 B / in_features) + ~1% bf16 outliers with int32 index (6 B each)
    assert 1.0 < per["weights"] < 1.25 and 1.0 < per["grads"] < 1.1 and 1.0 < per["optimizer"] < 1.1, per
    assert qs["bytes_per_param"] < 3.4, qs
    # the same linears in bf16 with torch AdamW (bf16 states): 2 + 2 + 4 bytes/param
    bf = copy.deepcopy(base).to(torch.bfloat16)
    adam = torch.optim.AdamW(bf.parameters(), lr=1e-3)
    bf(x, labels=x).loss.backward()
    adam.step()
    lin_params = [n for n, _ in bf.named_parameters() if "layers" in n and n.endswith("proj.weight")]
    sub = nn.ParameterList([dict(bf.named_parameters())[n] for n in lin_params])
    bs = state_bytes(sub, adam)
    assert bs["bytes_per_param"] > 7.9, bs  # weights + grads + exp_avg + exp_avg_sq (+ step counters)
    opt.zero_grad()
    assert int8_grad(w8) is None


def test_validation_and_nan_refused():
    p = nn.Parameter(torch.randn(4, 4))
    for kw, field in [(dict(lr=0.0), "lr"), (dict(lr=-1e-3), "lr"), (dict(betas=(0.0, 0.99)), r"betas\[0\]"),
                      (dict(betas=(0.9, 1.0)), r"betas\[1\]"), (dict(betas=(0.9,)), "betas"),
                      (dict(weight_decay=-0.1), "weight_decay"), (dict(rounding="down"), "rounding"),
                      (dict(momentum_bits=4), "momentum_bits"), (dict(refresh_thresholds_every=0), "refresh")]:
        with pytest.raises(ValueError, match=field):
            QLion([p], **kw)
    for bad in (4, 16, True, "8"):
        with pytest.raises(ValueError, match="gradient_bits"):
            QFTConfig(gradient_bits=bad)
    # NaN in an INT8-stored weight gradient and in an ordinary .grad: refused, named, nothing changed
    m = _tiny_llama()
    quantize_model_(m, QFTConfig(gradient_bits=8))
    up = m.model.layers[1].mlp.up_proj
    rest = [p for p in m.parameters() if p is not up.weight]
    opt = QLion([{"params": [up.weight]}, {"params": rest}], lr=1e-2)  # up_proj is checked first
    x = torch.randint(3, 96, (2, 8))
    m(x, labels=x).loss.backward()
    opt.step()
    m.zero_grad()
    snap = copy.deepcopy(m.state_dict())
    state_snap = copy.deepcopy(opt.state_dict())

    def poison(mod, inp, out):
        out.register_hook(lambda g: g * float("nan"))

    h = up.register_forward_hook(poison)
    m(x, labels=x).loss.backward()  # backward completes; the INT8 store records the NaN
    h.remove()
    assert not bool(int8_grad(up.weight).finite)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*no parameter was updated"):
        opt.step()
    for k, v in m.state_dict().items():
        assert torch.equal(v, snap[k]), k
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(v, state_snap["state"][i][k]), (i, k)
    opt.zero_grad()  # drops the poisoned INT8 gradients as well
    assert int8_grad(up.weight) is None
    # named parameters name ordinary ones too
    opt = QLion(m.named_parameters(), lr=1e-2)
    m(x, labels=x).loss.backward()
    m.model.norm.weight.grad[3] = float("inf")
    with pytest.raises(ValueError, match=r"non-finite gradient \(NaN/Inf\) in model\.norm\.weight"):
        opt.step()


def _data(n=32):
    """Learnable synthetic sequences: each row counts up from a random start (mod 90)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = (torch.randint(0, 90, (1,), generator=g) + torch.arange(16)) % 90 + 3
        out.append({"input_ids": ids, "labels": ids})
    return out


def _train(model_dir, out, steps=10, resume=None):
    # outliers re-selected on steps 3 (before the step-5 checkpoint), 6 and 9 (after a resume from it)
    m = AutoModelForCausalLM.from_pretrained(
        model_dir, quantization_config=QFTConfig(weight_format="int8_dense_sparse", gradient_bits=8,
                                                 outlier_refresh_steps=3))
    opt = QLion(m.parameters(), lr=3e-3, weight_decay=0.01, rounding="sr", seed=1)
    sched = get_cosine_schedule_with_warmup(opt, 2, steps)
    args = TrainingArguments(out, max_steps=steps, per_device_train_batch_size=8, save_steps=steps // 2,
                             logging_steps=1, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                             max_grad_norm=0.0)
    tr = Trainer(model=m, args=args, train_dataset=_data(), optimizers=(opt, sched))
    tr.train(resume_from_checkpoint=resume)
    return m, opt, [h["loss"] for h in tr.state.log_history if "loss" in h]


def test_trainer_qlion_llama_learns_and_resumes_bit_exact(tmp_path):
    _tiny_llama().save_pretrained(tmp_path / "base")
    base = str(tmp_path / "base")
    m_0 = AutoModelForCausalLM.from_pretrained(base, quantization_config=QFTConfig(gradient_bits=8))
    thr_0 = m_0.model.layers[0].self_attn.q_proj.weight.thresholds.clone()  # as set at load
    m_a, opt_a, loss_a = _train(base, str(tmp_path / "a"))
    assert isinstance(m_a.model.layers[0].self_attn.q_proj, QFTLinear)
    assert loss_a[-1] < loss_a[0] - 0.3, loss_a
    q = m_a.model.layers[0].self_attn.q_proj.weight
    st = opt_a.state[q]
    assert st["exp_avg_codes"].dtype == torch.uint8 and st["exp_avg_scales"].dtype == torch.float32
    # resume from the half-way checkpoint: same losses afterwards, same weights and optimizer state, bit for bit
    m_b, opt_b, loss_b = _train(base, str(tmp_path / "b"), resume=str(tmp_path / "a" / "checkpoint-5"))
    assert loss_a[5:] == loss_b[-5:]
    sa, sb = m_a.state_dict(), m_b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    da, db = opt_a.state_dict(), opt_b.state_dict()
    for i in da["state"]:
        for k, v in da["state"][i].items():
            assert v.dtype == db["state"][i][k].dtype and torch.equal(v, db["state"][i][k]), (i, k)
    # the checkpoint reloads as a gradient_bits=8 QFT model, with the outliers re-selected on step 3
    re = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "checkpoint-5")
    assert isinstance(re.model.layers[1].mlp.gate_proj, QFTLinear) and re.config.quantization_config.gradient_bits == 8
    assert re.config.quantization_config.outlier_refresh_steps == 3
    thr_5 = re.model.layers[0].self_attn.q_proj.weight.thresholds
    assert not torch.equal(thr_5, thr_0) and not torch.equal(q.thresholds, thr_5)  # refreshed on 3, then on 6 or 9
    assert torch.equal(q.thresholds, m_b.model.layers[0].self_attn.q_proj.weight.thresholds)


def test_optimizer_state_dict_round_trip_bit_exact():
    m = _tiny_llama()
    quantize_model_(m, QFTConfig(gradient_bits=8))
    opt = QLion(m.parameters(), lr=1e-2, rounding="sr", seed=4)
    x = torch.randint(3, 96, (2, 8))
    for _ in range(2):
        m(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    m2 = copy.deepcopy(m)
    opt2 = QLion(m2.parameters(), lr=1e-2, rounding="sr", seed=99)
    opt2.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    for p, p2 in zip(m.parameters(), m2.parameters()):
        for k, v in opt.state[p].items():
            assert v.dtype == opt2.state[p2][k].dtype and torch.equal(v, opt2.state[p2][k]), k
    for mm, oo in ((m, opt), (m2, opt2)):  # continue both: identical (SR generator restored too)
        mm(x, labels=x).loss.backward()
        oo.step()
    for (n, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), n
    assert hfq.QLion is QLion


@pytest.mark.parametrize("opt", ["qlion", "qlion-fused", "eco_adamw", "eco_sgd"])
def test_sr_moves_plain_bf16_parameters_by_small_steps(opt):
    """Ordinary bf16 parameters (norms, embeddings of a bf16 QFT/ECO model) move by small steps on average
    under SR, as the quantized weights do; nearest rounding (rounding="rtn", as torch's own bf16 optimizers)
    leaves a weight of 1.0 where it is at any step below half its ulp (2^-8)."""
    lr, steps = (1e-4 if opt == "eco_sgd" else 1e-3), 30  # SGD's momentum (0.9) makes its steps ~10x lr
    drift = {}
    for rounding, dtype in (("rtn", torch.bfloat16), ("sr", torch.bfloat16), ("exact", torch.float32)):
        w = nn.Parameter(torch.ones(4, 64, dtype=dtype))
        r = "sr" if rounding == "exact" else rounding
        o = {"qlion": lambda: QLion([w], lr=lr, rounding=r, fused=False),
             "qlion-fused": lambda: QLion([w], lr=lr, rounding=r, fused=True),
             "eco_adamw": lambda: hfq.ECOAdamW([w], lr=lr, rounding=r, weight_decay=0.0),
             "eco_sgd": lambda: hfq.ECOSGD([w], lr=lr, rounding=r)}[opt]()
        for _ in range(steps):
            w.grad = torch.ones_like(w)  # a constant gradient: every step moves each weight down
            o.step()
        drift[rounding] = (1.0 - w.detach().float()).mean().item()
    assert drift["exact"] > 0.01  # the fp32 parameter's drift: what the bf16 one should follow on average
    assert drift["rtn"] == 0.0, drift
    assert 0.8 < drift["sr"] / drift["exact"] < 1.2, drift


def test_bf16_stochastic_rounding_keeps_nan_and_inf():
    """SR adds a draw to the float's bits: NaN patterns near the top (CUDA's 0x7FFFFFFF) would carry into -0/+0,
    so non-finite values take no draw; finite ones round to a bf16 neighbour, unbiased."""
    from hfq_kernels.reference.intq import round_bf16

    bits = torch.tensor([0x7FFFFFFF, -1, 0x7FC00000, 0x7F800000, -8388608], dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    out = round_bf16(x, "sr", noise=torch.full((5,), 0.999)).float()
    assert out[:3].isnan().all() and out[3] == float("inf") and out[4] == float("-inf")
    v = torch.full((20000,), 1.0 + 2.0 ** -10)  # an eighth of the way from 1 to the next bf16 value, 1 + 2^-7
    r = round_bf16(v, "sr", torch.Generator().manual_seed(0)).float()
    assert set(r.unique().tolist()) <= {1.0, 1.0 + 2.0 ** -7} and abs(r.mean().item() - v[0].item()) < 2e-4
