"""QParam: formats, SR unbiasedness, autograd, state_dict/safetensors, refusal of plain in-place updates."""
import copy

import pytest
import torch
from safetensors.torch import load, save

from hfq_kernels.reference.fp8 import dequantize_fp8_row, quantize_fp8_row, round_e4m3
from hfq.qparam import FORMATS, QLinear, QParam

META = {"int4_group": {"group_size": 16}}


def _w(shape=(24, 48), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 0.2


@pytest.mark.parametrize("fmt", FORMATS)
def test_roundtrip_and_error(fmt):
    w = _w()
    q = QParam.from_float(w, fmt, **META.get(fmt, {}))
    assert q.shape == w.shape and q.dtype == torch.bfloat16
    deq = q.dequantize(torch.float32)
    rel = float((deq - w).norm() / w.norm())
    assert rel < {"fp8_e4m3_row": 0.05, "int8_dense_sparse": 0.02}.get(fmt, 0.2), rel
    err = q.requantize_(w * 1.5, "rtn")
    torch.testing.assert_close(err, w * 1.5 - q.dequantize(torch.float32), rtol=0, atol=0)


def test_fp8_rtn_matches_torch_cast_and_sr_on_grid():
    x = torch.randn(4000) * 50
    assert torch.equal(round_e4m3(x, "rtn"), x.clamp(-448, 448).to(torch.float8_e4m3fn).float())
    s = round_e4m3(x, "sr", torch.Generator().manual_seed(1))
    assert torch.equal(s, s.to(torch.float8_e4m3fn).float())  # on the grid
    lo = torch.minimum(s, x)
    assert ((s - x).abs() <= (x.abs() / 8).clamp_min(2 ** -9)).all()  # a neighbour, never further
    assert lo.numel() == x.numel()


@pytest.mark.parametrize("fmt", ["fp8_e4m3_row", "int4_tensor"])
def test_sr_unbiased(fmt):
    w = _w((8, 32), seed=3)
    q = QParam.from_float(w, fmt)
    value = q.dequantize(torch.float32) * 0.97 + 0.003  # off-grid, same amax scale region
    gen = torch.Generator().manual_seed(0)
    n = 3000
    acc = torch.zeros_like(value)
    for _ in range(n):
        q.requantize_(value, "sr", gen)
        acc += q.dequantize(torch.float32)
    mean = acc / n
    rtn_err = (QParam.from_float(value, fmt).dequantize(torch.float32) - value).abs().mean()
    # the SR mean error shrinks like 1/sqrt(n); RTN's bias does not
    assert (mean - value).abs().mean() < 0.1 * rtn_err


def test_qlinear_grad_matches_dense():
    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 24)
    q = QLinear.from_linear(lin, "fp8_e4m3_row")
    ref = torch.nn.Linear(48, 24)
    with torch.no_grad():
        ref.weight.copy_(q.weight.dequantize(torch.float32))
        ref.bias.copy_(lin.bias)
    x = torch.randn(3, 5, 48, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    (q(x) ** 2).sum().backward()
    (ref(x2) ** 2).sum().backward()
    assert type(q.weight.grad) is torch.Tensor and q.weight.grad.dtype == torch.bfloat16
    assert q.weight.grad.shape == (24, 48)
    torch.testing.assert_close(q.weight.grad.float(), ref.weight.grad, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q.bias.grad, ref.bias.grad)
    # QParam also works as the weight of a plain nn.Linear (F.linear is intercepted)
    plain = torch.nn.Linear(48, 24)
    plain.weight = torch.nn.Parameter(QParam.from_float(lin.weight.detach()))
    plain(x.detach()).sum().backward()
    assert plain.weight.grad.shape == (24, 48)


def test_qlinear_computes_in_the_input_dtype_bias_included():
    """The weight is decoded in x's dtype, and so is the bias taken (as NVFP4Linear's): a bf16 x on an fp32 layer
    with a bias used to stop in F.linear on the dtypes; its gradient stays fp32."""
    q = QLinear.from_linear(torch.nn.Linear(48, 24), "fp8_e4m3_row")
    x = torch.randn(3, 48)
    y = q(x.bfloat16())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), q(x), rtol=2e-2, atol=2e-2)
    y.float().sum().backward()
    assert q.bias.grad.dtype == torch.float32 and torch.equal(q.bias.grad, torch.full((24,), 3.0))


@pytest.mark.parametrize("fmt", FORMATS)
def test_state_dict_safetensors_codes_and_scales(fmt):
    lin = torch.nn.Linear(48, 24)
    q = QLinear.from_linear(lin, fmt, **META.get(fmt, {}))
    sd = load(save(q.state_dict()))
    assert "weight" not in sd and "weight_codes" in sd and "weight_scales" in sd
    codes_dtype = {"fp8_e4m3_row": torch.float8_e4m3fn}.get(fmt, torch.uint8)
    assert sd["weight_codes"].dtype == codes_dtype
    q2 = QLinear(48, 24, True, fmt, **META.get(fmt, {}))
    q2.load_state_dict(sd)
    assert torch.equal(q2.weight.dequantize(), q.weight.dequantize())
    q3 = copy.deepcopy(q).to("cpu")
    assert isinstance(q3.weight, QParam) and q3.weight.codes is not q.weight.codes
    assert torch.equal(q3.weight.dequantize(), q.weight.dequantize())


def test_bad_inputs():
    w = _w()
    with pytest.raises(ValueError, match="weight_format"):
        QParam.from_float(w, "fp7")
    with pytest.raises(ValueError, match="rounding"):
        QParam.from_float(w).requantize_(w, "stochastic")
    bad = w.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        QParam.from_float(bad)
    with pytest.raises(ValueError, match="group_size"):
        QParam.from_float(w, "int4_group", group_size=10)
    with pytest.raises(ValueError, match="even"):
        QParam.from_float(torch.randn(4, 7), "int4_tensor")
    q = torch.nn.Parameter(QParam.from_float(w))
    q.grad = torch.randn(w.shape, dtype=torch.bfloat16)
    before = q.codes.clone()
    with pytest.raises(TypeError, match="ECOAdamW"):
        torch.optim.AdamW([q], lr=1e-3).step()
    assert torch.equal(q.codes.view(torch.uint8), before.view(torch.uint8))


def test_fp8_reference_quantizer_rows():
    w = _w()
    codes, scales = quantize_fp8_row(w)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (24, 1)
    torch.testing.assert_close(scales.squeeze(1), w.abs().amax(1) / 448)
    assert (dequantize_fp8_row(codes, scales).abs().amax(1) - w.abs().amax(1)).abs().max() < 1e-6


@pytest.mark.parametrize("fmt", FORMATS)
def test_copy_of_own_value_keeps_codes(fmt):
    """DDP's construction-time broadcast copies each parameter's (dequantized, bf16) value back into it: that must
    not requantize (a bf16 round trip would move codes and scales); a different value still requantizes."""
    q = QParam.from_float(_w(), fmt, **META.get(fmt, {}))
    before = {k: t.clone() for k, t in q.qtensors().items()}
    q.detach().copy_(q.detach().view(-1).view(q.shape))  # what torch.distributed._broadcast_coalesced does
    for k, t in q.qtensors().items():
        assert torch.equal(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t,
                           before[k].view(torch.uint8) if t.dtype == torch.float8_e4m3fn else before[k]), k
    target = _w(seed=5)
    q.detach().copy_(target)
    ref = QParam.from_float(_w(), fmt, **META.get(fmt, {}))
    ref.requantize_(target, "rtn")  # (int8_dense_sparse keeps its outlier thresholds)
    assert torch.equal(q.dequantize(), ref.dequantize())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA autocast and GradScaler")
def test_fp16_autocast_training_on_cuda_announces_the_bf16_gradient(monkeypatch):
    """A QParam's gradient is bf16, which GradScaler cannot unscale on CUDA (torch's kernel has no bf16 variant):
    a training forward under fp16 autocast says so once, naming what works; bf16 autocast and no_grad stay quiet."""
    import warnings

    from hfq.qparam import linear as QL

    monkeypatch.setattr(QL, "_FP16_WARNED", [])
    lin = QLinear.from_linear(torch.nn.Linear(64, 32).cuda())
    x = torch.randn(4, 64, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            lin(x).float().sum().backward()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            lin(x)
    assert lin.weight.grad.dtype == torch.bfloat16
    lin.zero_grad()
    scaler = torch.amp.GradScaler("cuda")
    with pytest.warns(UserWarning, match="bf16 gradients.*fp16 loss scaling.*gradient_bits=8"):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = lin(x).float().sum()
    scaler.scale(loss).backward()
    with pytest.raises(NotImplementedError, match="BFloat16"):  # what the warning foretells
        scaler.unscale_(torch.optim.SGD(lin.parameters(), lr=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cuda", dtype=torch.float16):
            lin(x)  # once per process


@pytest.mark.parametrize("fmt", ["int8_dense_sparse", "fp8_e4m3_row"])
def test_meta_then_to_empty_then_load_state_dict_rebuilds_the_model(fmt):
    """model.to("meta"); model.to_empty(device=...); load_state_dict(sd): the route that rebuilds a model without
    allocating it twice. Quantized weights stay quantized through empty_like (they became plain bf16 parameters
    of garbage, and the load then failed with an AttributeError)."""
    from hfq.qft import QFTConfig, quantize_model_
    from hfq.tiny import tiny_model

    model = tiny_model("llama", seed=0, hidden=64, intermediate=128, kv_heads=4).eval()
    quantize_model_(model, QFTConfig(weight_format=fmt))
    ids = torch.tensor([[4, 5, 6, 7, 8]])
    with torch.no_grad():
        ref = model(ids).logits
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    rebuilt = copy.deepcopy(model).to("meta")
    rebuilt.to_empty(device="cpu")
    w = rebuilt.model.layers[0].self_attn.q_proj.weight
    assert isinstance(w, QParam) and w.fmt == fmt and w.device.type == "cpu"
    rebuilt.load_state_dict(sd)
    for (n, b), (_, b0) in zip(rebuilt.named_buffers(), model.named_buffers()):
        if n.endswith("inv_freq"):  # not persistent: transformers recomputes it at init
            b.copy_(b0)
    with torch.no_grad():
        assert torch.equal(rebuilt(ids).logits, ref)
