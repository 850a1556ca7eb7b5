"""QuEST QAT: fused kernels vs references, trust-mask gradients (Alg. 2), STE, config, HF integration."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hfq  # noqa: F401  registers hfq_quest
from hfq_kernels.reference import gaussian
from hfq_kernels.reference.hadamard import fwht, hadamard_matrix
from hfq.quest import QuESTConfig, QuESTLinear, pack_codes, quantize_model, unpack_codes
from hfq_kernels import quest as K
from transformers import AutoModelForCausalLM

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # Triton kernels: device tensors on a GPU


# ----------------------------------------------------------------------------- kernels
@settings(max_examples=8, deadline=None)
@given(rows=st.integers(1, 40), nblk=st.integers(1, 3), logb=st.sampled_from([0, 4, 5, 6, 7]),
       bits=st.integers(1, 8), fp4=st.booleans(), s=st.sampled_from([1.0, 1.3]))
def test_quantize_kernel_matches_reference_fp32(rows, nblk, logb, bits, fp4, s):
    if fp4:
        bits = 4
    block = 2**logb if logb else 0
    width = nblk * (2**logb if logb else 37)  # no-HT case: odd widths
    x = torch.randn(rows, width) * 2
    x[0, 0] = 25.0  # an outlier
    xq, m, unit = (t.cpu() for t in K.quest_quantize_triton(x.to(DEV), bits, fp4, s, block))
    rq, rm, ru = K.quest_quantize_ref(x, bits, fp4, s, block)
    assert torch.allclose(unit, ru, rtol=1e-5)
    # identical up to elements within float rounding of a decision boundary
    off = (xq - rq).abs() > 1e-5 * rq.abs() + 1e-7
    assert off.float().mean() < 0.01 and torch.allclose(xq, rq, atol=2.1 * float(ru.max()))
    assert (K.unpack_mask(m, width) != K.unpack_mask(rm, width)).float().mean() < 0.01


def test_quantize_kernel_bf16_and_packed_padding():
    torch.manual_seed(3)
    x = (torch.randn(33, 256) * 0.1).bfloat16()
    xq, m, unit = (t.cpu() for t in K.quest_quantize_triton(x.to(DEV), 4, False, 1.0, 128))
    rq, rm, ru = K.quest_quantize_ref(x, 4, False, 1.0, 128)
    assert xq.dtype == torch.bfloat16 and m.shape == (33, 32)
    # the CPU interpreter truncates fp32 -> bf16; the GPU rounds: allow one bf16 ulp
    assert torch.allclose(xq.float(), rq.float(), rtol=2**-7, atol=0)
    assert torch.equal(m, rm)
    # no HT, a width that is not a multiple of 8: pad bits are zero
    _, m2, _ = K.quest_quantize_triton(torch.randn(5, 13, device=DEV), 2, False, 1.0, 0)
    assert m2.shape == (5, 2) and int((m2[:, 1] >> 5).max()) == 0


@pytest.mark.parametrize("block,width,dtype", [(128, 256, torch.float32), (0, 45, torch.float32),
                                               (32, 96, torch.bfloat16)])
def test_masked_ht_kernel_matches_reference(block, width, dtype):
    torch.manual_seed(width)
    g = torch.randn(21, width).to(dtype)
    mask = K.pack_mask(torch.rand(21, width) > 0.3)
    out = K.quest_masked_ht_triton(g.to(DEV), mask.to(DEV), block).cpu()
    ref = K.quest_masked_ht_ref(g.float(), mask, block)
    assert torch.allclose(out.float(), ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert torch.allclose(K.quest_masked_ht_triton(g.to(DEV), None, block).float().cpu(),
                          K.quest_masked_ht_ref(g.float(), None, block), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("knobs", [dict(ROW_KERNEL=False), dict(TWO_PASS_MIN_WAVES=0),
                                   dict(ROW_KERNEL=True, TWO_PASS_MIN_WAVES=1000, ROW_TILE_ELEMS=4096),
                                   dict(ROW_KERNEL=True, TWO_PASS_MIN_WAVES=1000, ROW_TILE_ELEMS=16384)],
                         ids=["two-pass", "two-pass-waves", "rows-4k", "rows-16k"])
def test_quantize_kernel_variants_match_reference(monkeypatch, knobs):
    """Both forward kernels (two-pass, whole-row with padded block counts) and their launch settings."""
    for k, v in knobs.items():
        monkeypatch.setattr(K, k, v)
    torch.manual_seed(11)
    for rows, width, block, bits, fp4 in ((19, 384, 128, 4, False), (3, 640, 64, 1, False), (40, 256, 16, 4, True)):
        x = torch.randn(rows, width) * 3
        x[1, 7] = 30.0
        for dt, out_dt in ((torch.float32, None), (torch.bfloat16, torch.float32)):
            xq, m, unit = (t.cpu() for t in K.quest_quantize_triton(x.to(dt).to(DEV), bits, fp4, 1.3, block, out_dt))
            rq, rm, ru = K.quest_quantize_ref(x.to(dt), bits, fp4, 1.3, block, out_dt)
            assert xq.dtype == rq.dtype and torch.allclose(unit, ru, rtol=1e-5)
            off = (xq.float() - rq.float()).abs() > 1e-5 * rq.float().abs() + 1e-7
            assert off.float().mean() < 0.01
            assert (K.unpack_mask(m, width) != K.unpack_mask(rm, width)).float().mean() < 0.01


def test_launch_plans_stay_bounded_over_many_row_counts():
    """Variable-length batches bring a new row count per call: the per-shape launch plans are an LRU, not a dict
    that grows for the whole run."""
    for rows in range(1, 700):
        K._quant_plan(torch.empty(rows, 64, device=DEV), 4, False, 1.0, 64)
    assert len(K._PLANS) <= 512
    assert K._quant_plan(torch.empty(3, 64, device=DEV), 4, False, 1.0, 64)[1] == (1,)


def test_mask_and_code_packing_roundtrip():
    torch.manual_seed(0)
    m = torch.rand(6, 29) > 0.5
    assert torch.equal(K.unpack_mask(K.pack_mask(m), 29), m)
    assert K.pack_mask(torch.tensor([[True, False, False, True, False, False, False, False, True]])).tolist() == [[9, 1]]
    for bits in range(1, 9):
        c = torch.randint(0, 2**bits, (4, 70), dtype=torch.uint8)
        p = pack_codes(c, bits)
        assert p.shape[-1] == math.ceil(70 * {1: 1, 2: 2, 3: 4, 4: 4}.get(bits, 8) / 8)
        assert torch.equal(unpack_codes(p, bits, 70), c)


# ----------------------------------------------------------------------------- gradients
def _layer(cfg, in_f=8, out_f=5, seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(in_f, out_f, bias=True, dtype=torch.float64)
    return QuESTLinear.from_linear(lin, cfg)


def test_trust_mask_zeroes_gradient_in_hadamard_domain_hand_checked():
    """Activation row built in the Hadamard domain as [6, 1, -1, 1, -1, 1, -1, 1] (2 bits): the outlier's
    error |x^ - x| = 2.2 units exceeds T = 1 unit, so its Hadamard-domain gradient is exactly zero;
    the others (error 0.13 units) receive dL/dx^_h unchanged."""
    cfg = QuESTConfig(weight_bits=8, activation_bits=2, hadamard_block_size=8)
    layer = _layer(cfg)
    xh = torch.tensor([[6.0, 1, -1, 1, -1, 1, -1, 1]], dtype=torch.float64)
    x = fwht(xh, 8).requires_grad_(True)  # x = HT(x_h), so HT(x) = x_h
    y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    grad_h = fwht(x.grad, 8)  # back to the Hadamard domain
    wq, _ = layer.quantized_weight_h()
    expected = dy @ wq.to(dy.dtype)
    assert grad_h[0, 0].abs().item() < 1e-12
    assert torch.allclose(grad_h[0, 1:], expected[0, 1:], atol=1e-10)
    assert expected[0, 0].abs().item() > 1e-3  # the STE would have passed a real gradient there


@pytest.mark.parametrize("estimator", ["trust", "ste"])
@pytest.mark.parametrize("hadamard,bits,grid", [(True, 4, "int"), (False, 2, "int"), (True, 1, "int"),
                                                (True, 4, "fp4")])
def test_gradients_follow_alg2(estimator, hadamard, bits, grid):
    """dx = IHT(M_x * dy w_h^), dw = IHT(M_w * dy^T x_h^); for the STE the masks are all ones, i.e. the
    straight-through gradient of y = Q(x) Q(w)^T with Q(t) = IHT(proj(HT(t)))."""
    cfg = QuESTConfig(weight_bits=bits, activation_bits=bits, grid=grid, hadamard=hadamard,
                      hadamard_block_size=16, estimator=estimator)
    layer = _layer(cfg, in_f=32, out_f=12, seed=bits)
    x = (torch.randn(2, 6, 32, dtype=torch.float64) * 2).requires_grad_(True)
    x.data[0, 0, :16] += 30.0 * hadamard_matrix(16, torch.float64)[3]  # a spike at 3 in the HT domain
    x.data[0, 1, 5] = 30.0  # and one in the original domain
    y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    blk = 16 if hadamard else 0
    T = (lambda t: fwht(t, blk)) if hadamard else (lambda t: t)
    s_a = cfg.outer_trust(bits)
    xq, mx, _ = gaussian.quest_project(T(x.detach().reshape(-1, 32)), bits, grid, s_a)
    wq, mw, _ = gaussian.quest_project(T(layer.weight.detach()), bits, grid, s_a)
    xq, wq = xq.double(), wq.double()
    d2 = dy.reshape(-1, 12)
    if estimator == "ste":
        mx, mw = torch.ones_like(mx), torch.ones_like(mw)
        # the straight-through gradient computed by autograd on a detach-trick graph
        xs = x.detach().reshape(-1, 32).requires_grad_(True)
        ws = layer.weight.detach().clone().requires_grad_(True)
        qx = xs + (T(xq) - xs).detach()
        qw = ws + (T(wq) - ws).detach()
        (qx @ qw.T).backward(d2)
        assert torch.allclose(x.grad.reshape(-1, 32), xs.grad, rtol=1e-5, atol=1e-5)
        assert torch.allclose(layer.weight.grad, ws.grad, rtol=1e-5, atol=1e-5)
    assert torch.allclose(y.reshape(-1, 12), xq @ wq.T + layer.bias, rtol=1e-5, atol=1e-5)
    assert torch.allclose(x.grad.reshape(-1, 32), T(mx * (d2 @ wq)), rtol=1e-5, atol=1e-5)
    assert torch.allclose(layer.weight.grad, T(mw * (d2.T @ xq)), rtol=1e-5, atol=1e-5)
    assert torch.allclose(layer.bias.grad, d2.sum(0))
    if estimator == "trust":
        assert not bool(mx.all())  # the outlier is masked: the test exercises the mask


def test_weight_only_gradient():
    cfg = QuESTConfig(weight_bits=2, activation_bits=None, hadamard_block_size=16)
    layer = _layer(cfg, in_f=32, out_f=7, seed=5)
    layer.weight.data[0, 0] = 20.0
    x = torch.randn(9, 32, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    wq, mw, _ = gaussian.quest_project(fwht(layer.weight.detach(), 16), 2, "int", 1.0)
    w_eff = fwht(wq.double(), 16)
    assert torch.allclose(y, x.detach() @ w_eff.T + layer.bias, rtol=1e-5, atol=1e-5)
    assert torch.allclose(x.grad, dy @ w_eff, rtol=1e-5, atol=1e-5)
    assert torch.allclose(layer.weight.grad, fwht(mw * fwht(dy.T @ x.detach(), 16), 16), rtol=1e-5, atol=1e-5)
    assert not bool(mw.all())


@pytest.mark.parametrize("activation_bits", [4, None])
def test_empty_input_gives_empty_output_and_zero_grads(activation_bits):
    """No rows (an MoE expert without tokens, an empty micro-batch) is an empty product, as nn.Linear's."""
    layer = QuESTLinear.from_linear(torch.nn.Linear(64, 24), QuESTConfig(activation_bits=activation_bits))
    x = torch.randn(2, 0, 64, requires_grad=True)
    y = layer(x)
    assert y.shape == (2, 0, 24)
    y.sum().backward()
    assert x.grad.shape == x.shape and not layer.weight.grad.any()


def test_sibling_layers_share_input_quantization():
    """Layers fed the same tensor (q/k/v) quantize it once: outputs and gradients equal the unshared
    ones; an in-place change of the input (version counter) or other settings miss the cache."""
    import hfq.quest.linear as QL

    cfg = QuESTConfig(weight_bits=4, activation_bits=4, hadamard_block_size=16)
    layers = [_layer(cfg, in_f=32, out_f=8, seed=s).float() for s in range(3)]
    calls = []
    orig = QL.quantize_input

    def counting(x2, spec):
        calls.append(1)
        return orig(x2, spec)

    res = {}
    try:
        QL.quantize_input = counting
        for share in (False, True):
            QuESTLinear.share_input_quantization = share
            QL._INPUT_CACHE.clear()
            calls.clear()
            x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(7)).requires_grad_(True)
            for m in layers:
                m.zero_grad()
            ys = [m(x) for m in layers]
            sum((y * (i + 1)).sum() for i, y in enumerate(ys)).backward()
            res[share] = ([y.detach() for y in ys], x.grad.clone(), [m.weight.grad.clone() for m in layers], len(calls))
            if share:
                with torch.no_grad():
                    x.mul_(2.0)  # in place: the cached quantization is stale
                layers[0](x)
                assert len(calls) == 2
    finally:
        QL.quantize_input = orig
        QuESTLinear.share_input_quantization = True
        QL._INPUT_CACHE.clear()
    assert res[False][3] == 3 and res[True][3] == 1
    for a, b in zip(res[False][0] + [res[False][1]] + res[False][2], res[True][0] + [res[True][1]] + res[True][2]):
        assert torch.equal(a, b)


def test_default_config_runs_under_inference_mode(tiny_dir):
    """torch.inference_mode() (eval loops, serving): the default W4A4 model's forward and generate equal
    no_grad's (inference tensors have no version counter for the shared input quantization)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=QuESTConfig())
    ids = torch.randint(4, 90, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
        ref_gen = model.generate(ids, max_new_tokens=4, do_sample=False)
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, ref)
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), ref_gen)


# ----------------------------------------------------------------------------- config / bad input
@pytest.mark.parametrize("kw,field", [({"weight_bits": 0}, "weight_bits"), ({"activation_bits": 9}, "activation_bits"),
                                      ({"grid": "nf4"}, "grid"), ({"hadamard_block_size": 48}, "hadamard_block_size"),
                                      ({"grid": "fp4", "weight_bits": 2}, "weight_bits"),
                                      ({"estimator": "lsq"}, "estimator"), ({"trust_scale": -1.0}, "trust_scale"),
                                      ({"save_format": "pickle"}, "save_format")])
def test_config_validation(kw, field):
    with pytest.raises(ValueError, match=field):
        QuESTConfig(**kw)


def test_layer_dim_not_covered_names_layer_and_nan_refused():
    from hfq.tiny import tiny_model

    m = tiny_model("llama", hidden=96, heads=4, kv_heads=2, intermediate=128)
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_proj"):
        quantize_model(m, QuESTConfig(hadamard_block_size=64))
    m = tiny_model("llama")
    m.model.layers[1].mlp.up_proj.weight.data[2, 3] = float("nan")
    with pytest.raises(ValueError, match="up_proj.weight"):
        quantize_model(m, QuESTConfig())


@pytest.mark.parametrize("amax,match", [(1e19, r"row 0 .*sum of squares past fp32.*in_features=64"),
                                         (1e-30, r"row 0 has RMS .* below 1e-12"),
                                         (1e-36, r"row 0 has RMS .* below 1e-12")])
def test_weights_outside_fp32_rms_range_refused_by_name(tmp_path, amax, match):
    """A master weight whose per-row RMS overflows fp32 (NaN levels) or sits below the kernels' clamp (levels of
    the clamp's size, 1e17x the weight at 1e-30) is refused when quantized: quantize_model and from_pretrained."""
    from hfq.tiny import save_tiny, tiny_model

    m = tiny_model("llama")
    w = m.model.layers[1].mlp.up_proj.weight
    w.data.mul_(amax / w.abs().max())
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.up_proj\.weight: " + match):
        quantize_model(m, QuESTConfig())
    path = save_tiny(tmp_path / "m", "llama")
    m = AutoModelForCausalLM.from_pretrained(path)
    m.model.layers[1].mlp.up_proj.weight.data.mul_(amax / m.model.layers[1].mlp.up_proj.weight.abs().max())
    m.save_pretrained(path)
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.up_proj\.weight: " + match):
        AutoModelForCausalLM.from_pretrained(path, quantization_config=QuESTConfig(), dtype=torch.float32)


def test_weights_at_the_edge_of_the_rms_range_quantize_finitely():
    from hfq.tiny import tiny_model

    m = tiny_model("llama")  # up_proj: in_features 64, so 1e18 keeps sum(w^2) < 1.7e38
    for amax in (1e18, 1e-11):
        lin = m.model.layers[1].mlp.up_proj
        layer = QuESTLinear.from_linear(torch.nn.Linear(64, 128), QuESTConfig(), "up")
        layer.weight.data.copy_(lin.weight.data * (amax / lin.weight.abs().max()))
        wq, unit = layer.quantized_weight_h()
        assert torch.isfinite(wq).all() and torch.isfinite(layer(torch.randn(2, 64))).all()
        assert 0.1 < float(wq.abs().max()) / amax < 10


def test_config_dict_roundtrip_and_registration():
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AutoQuantizationConfig

    assert AUTO_QUANTIZATION_CONFIG_MAPPING["hfq_quest"] is QuESTConfig
    c = QuESTConfig(weight_bits=1, activation_bits=1, trust_scale=1.2)
    c2 = AutoQuantizationConfig.from_dict(c.to_dict())
    assert c2 == c and c2.outer_trust(1) == 1.2 and c2.outer_trust(4) == 1.0
    assert QuESTConfig(weight_bits=1, activation_bits=1).outer_trust(1) == 1.30
    assert QuESTConfig(weight_bits=1, activation_bits=1, hadamard=False).outer_trust(1) == 1.25
    assert hfq.QuESTConfig is QuESTConfig


# ----------------------------------------------------------------------------- HF integration
def _train_steps(model, ids, steps=3, lr=1e-2):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("cfg", [
    QuESTConfig(weight_bits=4, activation_bits=4, save_format="codes"),
    QuESTConfig(weight_bits=1, activation_bits=1, save_format="codes"),
    QuESTConfig(weight_bits=4, activation_bits=None, grid="fp4", save_format="codes"),
    QuESTConfig(weight_bits=3, activation_bits=3, hadamard=False, save_format="codes"),
], ids=["W4A4", "W1A1", "fp4-weight-only", "W3A3-noHT"])
def test_save_codes_reload_after_qat_identical_logits(tmp_path, cfg):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hfq.tiny import tiny_model

    model = quantize_model(tiny_model("llama"), cfg)
    ids = torch.randint(4, 90, (2, 24), generator=torch.Generator().manual_seed(0))
    _train_steps(model, ids)
    model.eval()
    with torch.no_grad():
        ref = model(ids).logits
    model.save_pretrained(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    key = "model.layers.0.mlp.down_proj"
    assert key + ".weight" not in sd and sd["model.layers.0.self_attn.q_proj.weight"].numel() == 0  # the guard
    assert sd[key + ".weight_codes"].dtype == torch.uint8
    assert sd[key + ".weight_codes"].shape == (64, 128 * {4: 4, 1: 1, 3: 4}[cfg.weight_bits] // 8)
    assert sd[key + ".weight_scale"].dtype == torch.float32
    assert "lm_head.weight" in sd  # kept in full precision
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    layer = reloaded.model.layers[0].mlp.down_proj
    assert isinstance(layer, QuESTLinear) and layer.packed and layer.weight is None
    with torch.no_grad():
        out = reloaded(ids).logits
    assert torch.equal(out, ref)


def test_master_save_format_resumes_qat(tmp_path):
    from transformers import AutoModelForCausalLM

    from hfq.tiny import tiny_model

    model = quantize_model(tiny_model("qwen2"), QuESTConfig(weight_bits=2, activation_bits=2, save_format="master"))
    ids = torch.randint(4, 90, (2, 16), generator=torch.Generator().manual_seed(1))
    _train_steps(model, ids, steps=2)
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    a, b = model.model.layers[1].self_attn.v_proj, again.model.layers[1].self_attn.v_proj
    assert isinstance(b, QuESTLinear) and not b.packed and torch.equal(a.weight, b.weight)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)


def test_from_pretrained_qat_with_trainer_lowers_loss(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from hfq.tiny import char_tokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=QuESTConfig(weight_bits=4, activation_bits=4))
    assert isinstance(model.model.layers[0].mlp.down_proj, QuESTLinear)
    assert type(model.lm_head) is torch.nn.Linear
    tok = char_tokenizer()
    ids = torch.tensor(tok("the quick brown fox jumps over the lazy dog. " * 3)["input_ids"][:64])

    class DS(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return {"input_ids": ids, "labels": ids}

    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=24,
                             learning_rate=3e-3, logging_steps=4, report_to=[], save_strategy="no",
                             use_cpu=True, disable_tqdm=True, warmup_steps=0)
    trainer = Trainer(model=model, args=args, train_dataset=DS())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0] - 0.5
    assert all(math.isfinite(v) for v in losses)


def test_input_cache_lets_the_activation_go_with_its_input(tmp_path):
    """The shared-input cache kept the last quantized activation (x_h^ and its mask) alive after the step, even after
    the model was deleted: on a 7B step about 0.5 GB held until the next QuEST forward. It now drops the entry
    when its input tensor is freed."""
    from transformers import AutoModelForCausalLM

    import hfq
    from hfq.quest import linear as QL
    from hfq.tiny import save_tiny

    m = AutoModelForCausalLM.from_pretrained(str(save_tiny(tmp_path / "t", arch="qwen2")),
                                             quantization_config=hfq.QuESTConfig())
    ids = torch.randint(5, 60, (2, 16))
    m(input_ids=ids, labels=ids).loss.backward()
    assert QL._INPUT_CACHE.value is None
    with torch.no_grad():
        m(input_ids=ids)
    assert QL._INPUT_CACHE.value is None
