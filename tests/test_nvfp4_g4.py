"""The g4 layout: NVFP4Linear's only weight copy on GPUs that run the Gluon decode kernel.

Checked on CPU (torch reference; Triton dequantize under TRITON_INTERPRET=1) and, with CUDA, on the GPU: the
canonical -> g4 -> canonical round trip is bit-exact, every product reads g4 with the canonical values, a layer
holds one copy, state_dict / save_pretrained / load / PEFT see the canonical compressed-tensors tensors.
"""
import contextlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hfq_kernels import nvfp4  # noqa: F401 (registers torch.ops.hfq.*)
from hfq_kernels._settings import SETTINGS
from hfq_kernels import nvfp4_gluon as G4
from hfq_kernels.reference import fp4

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(n, k, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 0.5, n)[:, None]
    w[0, :16] = 0.0  # scale 0, codes 0
    if k >= 32:
        w[0, 16:32] = -0.0  # scale 0, sign-only codes (must survive the round trip)
    w[min(1, n - 1), :16] *= 1e-5  # E4M3 subnormal block scale
    w[n - 1, k - 16:] = 448.0 * 6  # the largest block scale
    return w.to(dtype)


def _canonical(n, k, seed=0):
    return fp4.nvfp4_quantize(_weight(n, k, seed))


@pytest.mark.parametrize("n,k", [(16, 64), (37, 160), (5, 272), (64, 16), (33, 48)])
def test_round_trip_bit_exact(n, k):
    p, s, r = _canonical(n, k, seed=n * k)
    wr, sr = G4.repack(p, s)
    assert (wr.numel(), sr.numel()) == G4.g4_numel(n, k)
    p2, s2 = G4.unrepack(wr, sr, n, k)
    assert torch.equal(p2, p)
    assert torch.equal(s2.view(torch.uint8), s.view(torch.uint8))
    assert int((sr == G4.ZERO_SCALE_BYTE).sum()) >= 1  # the zero blocks (and the padding) use the zero byte
    ref = fp4.nvfp4_dequantize(p, s, r, torch.float32)
    assert torch.equal(G4.dequantize_g4_ref(wr, sr, r, n, k, torch.float32), ref)


def test_round_trip_in_row_chunks(monkeypatch):
    """Large weights convert a chunk of rows at a time: same words and bytes as one piece."""
    p, s, r = _canonical(83, 96, seed=2)
    whole = G4.repack(p, s)
    monkeypatch.setattr(G4, "_CHUNK_ROWS", 32)
    chunked = G4.repack(p, s)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
    p2, s2 = G4.unrepack(*chunked, 83, 96)
    assert torch.equal(p2, p) and torch.equal(s2.view(torch.uint8), s.view(torch.uint8))


@settings(max_examples=12, deadline=None)
@given(nt=st.integers(1, 5), kb=st.integers(1, 9), seed=st.integers(0, 2 ** 16))
def test_round_trip_random_codes(nt, kb, seed):
    """Any bytes (all 16 codes, any finite non-negative E4M3 scale, zero scales) survive the round trip."""
    g = torch.Generator().manual_seed(seed)
    n, k = nt * 16 - (seed % 7), kb * 16
    p = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    s = torch.randint(0, 127, (n, k // 16), generator=g, dtype=torch.uint8)  # 0x00..0x7E: +0 .. 448
    s[torch.rand(s.shape, generator=g) < 0.2] = 0
    s = s.view(torch.float8_e4m3fn)
    p2, s2 = G4.unrepack(*G4.repack(p, s), n, k)
    assert torch.equal(p2, p) and torch.equal(s2.view(torch.uint8), s.view(torch.uint8))


def test_gluon_arithmetic_on_zero_scale_blocks():
    """The Gluon kernel's decode (emulated bit for bit in torch) reads byte 208 as scale 0 whatever the codes."""
    n, k = 32, 128
    p, s, r = _canonical(n, k, seed=5)
    p[0, :8] = 0x9F  # sign-and-magnitude codes in the all-zero block: still zero
    wr, sr = G4.repack(p, s)
    x = torch.randn(3, k)
    ref = x.double() @ fp4.nvfp4_dequantize(p, s, r, torch.float32).double().T
    assert ((G4.emulate(x, wr, sr, n, k, r) - ref).norm() / ref.norm()) < 1e-6


@pytest.mark.parametrize("n,k", [(37, 160), (16, 272), (48, 64), (20, 1040)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kernel", ["words", "gather", "auto"])
def test_triton_dequantize_bit_identical(n, k, dtype, kernel):
    p, s, r = _canonical(n, k, seed=n + k)
    wr, sr = (t.to(DEV) for t in G4.repack(p, s))
    out = torch.full((n, k), float("nan"), dtype=dtype, device=DEV)
    G4.dequantize_g4(wr, sr, r.to(DEV), n, k, dtype, out=out, kernel=kernel)
    assert torch.equal(out.cpu(), fp4.nvfp4_dequantize(p, s, r, dtype))
    if kernel == "auto":
        assert G4._FAST_CHECKED[(out.device, dtype)] is True  # the word-wise kernel passed its first-use check


def test_ops_registered_with_fake_and_autograd():
    n, k = 48, 64
    p, s, r = _canonical(n, k)
    wr, sr = G4.repack(p, s)
    x = torch.randn(3, k, requires_grad=True)
    b = torch.randn(n, requires_grad=True)
    torch.library.opcheck(torch.ops.hfq.nvfp4_g4_linear.default, (x, wr, sr, r, n, k, b))
    torch.library.opcheck(torch.ops.hfq.nvfp4_g4_dequantize.default, (wr, sr, r, n, k, torch.bfloat16))
    torch.library.opcheck(torch.ops.hfq.nvfp4_g4_linear_grad_input.default, (torch.randn(3, n), wr, sr, r, n, k))
    y = torch.ops.hfq.nvfp4_g4_linear(x, wr, sr, r, n, k, b)
    x2, b2 = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    y2 = torch.ops.hfq.nvfp4_linear(x2, p, s, r, b2)
    assert torch.equal(y, y2)
    gy = torch.randn_like(y)
    y.backward(gy)
    y2.backward(gy)
    assert torch.equal(x.grad, x2.grad) and torch.equal(b.grad, b2.grad)


@pytest.mark.skipif(not (torch.cuda.is_available() and G4.device_ok(torch.device("cuda"))),
                    reason="the ops' CUDA bodies need a GPU that runs the Gluon kernel")
def test_ops_opcheck_on_the_gpu():
    """opcheck on CUDA tensors (schema, fake tensors, autograd registration, and AOT dispatch, which runs the
    triton_ops' traced bodies) for the linears, their grad-inputs and the few-row opaque ops, both layouts."""
    opcheck = torch.library.opcheck
    canon_utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")  # the schema
    # check's input comparison has no float8 kernel on CUDA (the canonical ops take the e4m3 scales)
    n, k = 48, 64
    p, s, r = (t.cuda() for t in _canonical(n, k))
    wr, sr = G4.repack(p, s)
    b = torch.randn(n, device="cuda", requires_grad=True)
    for m, dt in ((3, torch.bfloat16), (80, torch.bfloat16), (80, torch.float32)):
        x = torch.randn(m, k, device="cuda", dtype=dt, requires_grad=True)
        g = torch.randn(m, n, device="cuda", dtype=dt)
        bd = b.detach().to(dt).requires_grad_(True)
        opcheck(torch.ops.hfq.nvfp4_g4_linear.default, (x, wr, sr, r, n, k, bd))
        opcheck(torch.ops.hfq.nvfp4_g4_linear_grad_input.default, (g, wr, sr, r, n, k))
        opcheck(torch.ops.hfq.nvfp4_linear_grad_input.default, (g, p, s, r), test_utils=canon_utils)
        if m <= 64 or dt == torch.float32:  # bf16 with more rows: the eager plan may take a tuned kernel
            opcheck(torch.ops.hfq.nvfp4_linear.default, (x, p, s, r, bd), test_utils=canon_utils)
    x = torch.randn(3, k, device="cuda", dtype=torch.bfloat16)
    opcheck(torch.ops.hfq.nvfp4_g4_linear_rows.default, (x, wr, sr, r, n, k, None))
    opcheck(torch.ops.hfq.nvfp4_linear_rows.default, (x, p, s, r, None), test_utils=canon_utils)
    opcheck(torch.ops.hfq.nvfp4_g4_grad_input_rows.default,
            (torch.randn(3, n, device="cuda", dtype=torch.bfloat16), wr, sr, r, n, k))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_traced_dequantize_helpers_match_eager(dtype):
    """The dequantizes the compiled route launches through wrap_triton (run eagerly here: under the interpreter on
    CPU) equal the eager kernels bit for bit, in both layouts."""
    from hfq_kernels import nvfp4_quant as Q

    n, k = 37, 160
    p, s, r = (t.to(DEV) for t in _canonical(n, k, seed=3))
    assert torch.equal(Q.dequantize_traced(p, s, r, dtype), Q.dequant_raw(p, s, r, dtype))
    wr, sr = G4.repack(p, s)
    assert torch.equal(G4.dequantize_g4_traced(wr, sr, r, n, k, dtype), G4.dequantize_g4(wr, sr, r, n, k, dtype))


def test_bad_g4_tensors_named():
    p, s, r = _canonical(16, 64)
    wr, sr = G4.repack(p, s)
    with pytest.raises(ValueError, match=r"g4 layout of \[16, 128\]"):
        torch.ops.hfq.nvfp4_g4_dequantize(wr, sr, r, 16, 128, torch.float32)
    with pytest.raises(ValueError, match="in_features=32 but the weight has 64"):
        torch.ops.hfq.nvfp4_g4_linear(torch.randn(2, 32), wr, sr, r, 16, 64, None)
    bad = s.clone()
    bad.view(torch.uint8)[0, 0] = 0x7F  # E4M3 NaN
    with pytest.raises(ValueError, match="scale outside the E4M3 range"):
        G4.repack(p, bad)


# ------------------------------------------------------------------------------------------- NVFP4Linear
def _layer(n=48, k=64, bias=True, dtype=torch.bfloat16, seed=0):
    from hfq.nvfp4 import NVFP4Linear

    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(_weight(n, k, seed) * 0.1)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return NVFP4Linear.from_linear(lin.to(dtype))


def _resident_bytes(mod):
    return sum(b.numel() * b.element_size() for b in mod.buffers())


def test_layer_holds_one_copy_and_computes_the_same():
    ref = _layer()
    lay = _layer().to_g4_layout_()
    assert lay.layout == "g4" and ref.layout == "canonical"
    assert set(lay._buffers) == {"weight_g4", "weight_g4_scale", "weight_global_scale"}
    assert _resident_bytes(lay) == _resident_bytes(ref)  # 48 x 64: no padding, the same bytes
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y2 = lay(x), ref(x2)
    assert torch.equal(y, y2)
    y.sum().backward()
    y2.sum().backward()
    assert torch.equal(x.grad, x2.grad)
    assert torch.equal(lay.weight, ref.weight) and torch.equal(lay.dequantize(torch.float32),
                                                                ref.dequantize(torch.float32))
    # the canonical names give the real buffers (the layer converts back), so in-place writes are seen
    assert torch.equal(lay.weight_packed, ref.weight_packed)
    assert lay.layout == "canonical" and set(lay._buffers) == set(ref._buffers)
    assert torch.equal(lay.weight_scale.view(torch.uint8), ref.weight_scale.view(torch.uint8))
    lay.to_g4_layout_()
    with torch.no_grad():
        lay.weight_packed.copy_(lay.weight_packed ^ 0x88)  # flip every sign
    assert torch.equal(lay(x.detach()), F.linear(x.detach(), -ref.dequantize(torch.bfloat16), ref.bias))
    lay.to_g4_layout_()
    lay.weight_packed = ref.weight_packed.clone()  # assignment replaces the g4 storage
    assert lay.layout == "canonical" and torch.equal(lay(x.detach()), y.detach())


def test_state_dict_and_load_are_canonical():
    ref = _layer(seed=1)
    lay = _layer(seed=1).to_g4_layout_()
    sd, sd_ref = lay.state_dict(), ref.state_dict()
    assert list(sd) == list(sd_ref) or set(sd) == set(sd_ref)
    for key in sd_ref:
        assert sd[key].dtype == sd_ref[key].dtype and torch.equal(sd[key].view(torch.uint8),
                                                                  sd_ref[key].view(torch.uint8)), key
    other = _layer(seed=2).to_g4_layout_()
    other.load_state_dict(sd_ref)  # a canonical checkpoint into a g4 layer: loaded, and g4 again
    assert other.layout == "g4"
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(other(x), ref(x))
    third = _layer(seed=5).to(DEV).to_g4_layout_()
    third.load_state_dict({k: v.to(DEV) for k, v in sd_ref.items()}, assign=True)
    assert third.layout == "g4" and third.weight_g4.device == third.bias.device
    torch.testing.assert_close(third(x.to(DEV)).cpu(), other(x), rtol=2e-2, atol=2e-2)  # GPU: Gluon's sum order
    sd3 = third.state_dict()  # the converted tensors are host copies (no second GPU copy at checkpoint time)
    assert sd3["weight_packed"].device.type == "cpu" and sd3["weight_scale"].device.type == "cpu"
    # assign=True with host tensors into a GPU layer: the layer follows the loaded tensors, as nn.Linear does
    fourth = _layer(seed=6).to(DEV).to_g4_layout_()
    fourth.load_state_dict({k: v.clone() for k, v in sd_ref.items()}, assign=True)
    assert {t.device.type for t in fourth.state_dict(keep_vars=True).values()} == {"cpu"}
    assert fourth.qweight.device.type == "cpu" and torch.equal(fourth(x), other(x))
    with pytest.raises(RuntimeError, match="weight_packed"):
        other.load_state_dict({**sd_ref, "weight_packed": sd_ref["weight_packed"][:, :16]})


def test_set_weight_keeps_the_layout_and_moves_stay_one_copy():
    lay = _layer(seed=3).to_g4_layout_()
    w = _weight(48, 64, seed=9)
    lay.set_weight(w)
    assert lay.layout == "g4"
    p, s, r = fp4.nvfp4_quantize(w)
    assert torch.equal(lay.canonical()[0], p) and lay.layout == "g4"  # canonical() converts a copy
    lay.to(torch.float16)  # a dtype cast leaves codes alone
    assert lay.layout == "g4" and lay.weight_g4.dtype == torch.int32 and lay.bias.dtype == torch.float16
    lay.to_canonical_layout_()
    assert set(lay._buffers) == {"weight_packed", "weight_scale", "weight_global_scale"}
    assert torch.equal(lay.weight_packed, p)


def test_eager_plan_path_reads_g4(monkeypatch):
    """The eager host path (per-shape plans) on g4: the Gluon kernel for bf16 decode on the GPU, else Triton
    dequantize of g4 (on CPU under the interpreter) + matmul; the layer converts itself on a kernel GPU."""
    monkeypatch.setattr(SETTINGS, "plan_on_cpu", True)
    ref = _layer(n=32, k=96, seed=4)
    ref.allow_g4 = False
    ref = ref.to(DEV)
    lay = _layer(n=32, k=96, seed=4).to(DEV).to_g4_layout_()
    assert lay.layout == "g4" and ref.layout == "canonical"
    lay.bias.requires_grad_(True)
    for shape in ((1, 96), (3, 7, 96), (80, 96)):
        x = torch.randn(*shape, dtype=torch.bfloat16, device=DEV, requires_grad=True)
        y = lay(x)
        plan = lay._hfq_plans[1][(x.shape, x.dtype, x.device)]
        x2 = x.detach().clone().requires_grad_()
        y2 = F.linear(x2, ref.dequantize(torch.bfloat16), ref.bias)
        if plan.config["kind"] == "dequant":
            assert torch.equal(y, y2)
        else:  # the Gluon kernel (fp32 accumulation in another order)
            assert plan.config["kind"] == "gluon" and DEV == "cuda"
            torch.testing.assert_close(y, y2, rtol=2e-2, atol=2e-2)
        gy = torch.randn_like(y)
        y.backward(gy)
        y2.backward(gy)
        if DEV == "cpu":
            assert torch.equal(x.grad, x2.grad)
        elif plan.config["kind"] == "dequant":  # the same dense weight; cuBLAS may pick another algorithm
            torch.testing.assert_close(x.grad, x2.grad)
        else:  # the few-row grad kernel: exact weights, not the bf16-rounded ones of the reference
            exact = gy.reshape(-1, 32).float() @ ref.dequantize(torch.float32)
            got, rounded = x.grad.reshape(-1, 96).float(), x2.grad.reshape(-1, 96).float()
            assert float((got - exact).norm()) <= 1.5 * float((rounded - exact).norm()) + 1e-6
            torch.testing.assert_close(x.grad, x2.grad, rtol=2e-2, atol=2e-2)
        with torch.no_grad():
            lay(x)
        assert lay._hfq_plans[1][(x.shape, x.dtype, x.device)] is plan
    assert lay.bias.grad is not None and lay.layout == "g4"


def test_compile_through_the_g4_op():
    """Traced by AOTAutograd, the g4 linear (a triton_op) gives the canonical layer's values and input gradient."""
    lay = _layer(n=32, k=64, seed=6).to_g4_layout_()
    ref = _layer(n=32, k=64, seed=6)
    x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    out = torch.compile(lay, backend="aot_eager", fullgraph=True)(x)
    want = ref(x2)
    assert torch.equal(out, want)
    gy = torch.randn_like(out)
    out.backward(gy)
    want.backward(gy)
    assert torch.equal(x.grad, x2.grad)


@pytest.mark.skipif(not (torch.cuda.is_available() and G4.device_ok(torch.device("cuda"))),
                    reason="inductor's route for the NVFP4 ops needs a GPU that runs the Gluon kernel")
@pytest.mark.parametrize("layout", ["g4", "canonical"])
@pytest.mark.parametrize("m", [8, 96])
def test_inductor_traces_into_the_linear(m, layout):
    """Compiled with inductor, a dequantizing NVFP4 linear (M > 64) is the dequantize kernel, launched from
    inductor's code, and products inductor sees: neither the linear nor its grad-input is called as an op. Few rows
    keep the Gluon forward / the tuned canonical kernel and the few-row g4 grad kernel as opaque ops. Outputs and
    gradients match eager's, in both layouts."""
    from torch._inductor.utils import run_and_get_code

    from hfq.nvfp4 import NVFP4Linear

    n, k = 4096, 4096
    torch.manual_seed(8)
    lin = torch.nn.Linear(k, n).to("cuda", torch.bfloat16)
    lay = NVFP4Linear(k, n, device="cuda", dtype=torch.bfloat16)
    lay.allow_g4 = layout == "g4"
    lay.set_weight(lin.weight.detach())
    lay.bias.data.copy_(lin.bias.detach())
    assert lay.layout == layout
    x = torch.randn(2, m // 2, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(2, m // 2, n, device="cuda", dtype=torch.bfloat16)
    y = lay(x)
    y.backward(gy)
    x2 = x.detach().clone().requires_grad_(True)
    torch._dynamo.reset()
    comp = torch.compile(lay, fullgraph=True)

    def run():
        out = comp(x2)
        out.backward(gy)
        return out

    y2, codes = run_and_get_code(run)
    code = "\n".join(codes)
    torch.testing.assert_close(y2, y, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(x2.grad, x.grad, rtol=2e-2, atol=2e-2)
    assert lay.layout == layout
    if layout == "g4":
        if m > 64:  # the word-wise dequantize, which check_dequant cleared when the layer entered g4
            assert "_g4_dequant_kernel" in code and "_g4_dequant_gather_kernel" not in code
            assert "hfq.nvfp4_g4_linear" not in code and "nvfp4_g4_grad_input" not in code
        else:
            assert "hfq.nvfp4_g4_linear_rows" in code and "hfq.nvfp4_g4_grad_input_rows" in code
    else:
        assert "_dequantize_kernel" in code and "nvfp4_linear_grad_input" not in code  # grad-input: always traced
        if m > 64:
            assert "hfq.nvfp4_linear" not in code
        else:
            assert "hfq.nvfp4_linear_rows" in code


# ------------------------------------------------------------------------------------------- model routes
def test_model_save_load_peft_in_g4(tmp_path):
    """A quantized model switched to g4: save_pretrained writes canonical tensors that a fresh interpreter loads
    to the same logits; plain PEFT LoRA trains on it."""
    import peft
    from transformers import AutoModelForCausalLM

    import hfq  # noqa: F401
    from hfq.nvfp4 import NVFP4Config, NVFP4Linear
    from hfq.tiny import save_tiny

    tiny = str(save_tiny(tmp_path / "tiny", arch="qwen2"))
    model = AutoModelForCausalLM.from_pretrained(tiny, quantization_config=NVFP4Config())
    ids = torch.randint(4, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    before = model(ids).logits
    lays = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
    canon_bytes = sum(_resident_bytes(m) for m in lays)
    for m in lays:
        m.to_g4_layout_()
    assert sum(_resident_bytes(m) for m in lays) <= canon_bytes * 1.5  # padding of tiny shapes only
    assert torch.equal(model(ids).logits, before)
    model.save_pretrained(tmp_path / "q")
    torch.save(before, tmp_path / "logits.pt")
    code = ("import torch, hfq; from transformers import AutoModelForCausalLM as A; "
            f"m = A.from_pretrained({str(tmp_path / 'q')!r}); "
            f"ids = torch.randint(4, 100, (2, 9), generator=torch.Generator().manual_seed(0)); "
            f"assert torch.equal(m(ids).logits, torch.load({str(tmp_path / 'logits.pt')!r})), 'logits differ'; "
            "print('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "up_proj"]))
    lora_b = [p for n, p in pm.named_parameters() if "lora_B" in n]
    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.1)
    pm(ids, labels=ids).loss.backward()
    opt.step()
    assert any(float(p.abs().sum()) > 0 for p in lora_b)
    assert all(m.layout == "g4" for m in lays)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bound_launch_same_values_and_jit_path_for_new_specializations(dtype):
    """BoundLaunch (plans' low-overhead launches): on the GPU the second call goes to the compiled kernel directly
    and gives the JIT's bits; a misaligned output takes the JIT path; on CPU (interpreter) it never binds."""
    from hfq_kernels._triton import BoundLaunch

    n, k = 37, 160
    p, s, r = _canonical(n, k, seed=11)
    wr, sr = (t.to(DEV) for t in G4.repack(p, s))
    recip = r.to(DEV)
    ref = G4.dequantize_g4_ref(wr.cpu(), sr.cpu(), r, n, k, dtype)
    bl = BoundLaunch(G4._g4_dequant_kernel, (G4.cdiv(n, 16), G4.cdiv(k, 256)), dict(BC=256, num_warps=4))
    for _ in range(3):
        out = torch.full((n, k), float("nan"), dtype=dtype, device=DEV)
        bl(wr, sr, recip, out, n, k, G4.cdiv(k, 64))
        assert torch.equal(out.cpu(), ref)
    assert (bl.ck is not None) == (DEV == "cuda")
    if DEV == "cuda":  # a launch hook (a profiler) installed: the bound launch still reports to it
        from triton import knobs

        seen = []
        hook = seen.append
        knobs.runtime.launch_enter_hook.add(hook)
        try:
            out = torch.full((n, k), float("nan"), dtype=dtype, device=DEV)
            bl(wr, sr, recip, out, n, k, G4.cdiv(k, 64))
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
        assert len(seen) == 1 and torch.equal(out.cpu(), ref)
    flat = torch.full((n * k + 1,), float("nan"), dtype=dtype, device=DEV)
    odd = flat[1:].view(n, k)  # 2 or 4 bytes off the first call's 16-byte alignment
    bl(wr, sr, recip, odd, n, k, G4.cdiv(k, 64))
    assert torch.equal(odd.cpu(), ref)
    run = G4.dequantizer(wr, sr, n, k)
    assert all(torch.equal(run(recip, dtype).cpu(), ref) for _ in range(2))
    # check names only the output: it alone is compared per call (the other arguments are the caller's fixed ones)
    out_name = G4._g4_dequant_kernel.arg_names[3]
    bc = BoundLaunch(G4._g4_dequant_kernel, (G4.cdiv(n, 16), G4.cdiv(k, 256)), dict(BC=256, num_warps=4),
                     check=(out_name,))
    with pytest.raises(ValueError, match="not parameters"):
        BoundLaunch(G4._g4_dequant_kernel, (1,), {}, check=("no_such_arg",))
    for out in (torch.full((n, k), float("nan"), dtype=dtype, device=DEV) for _ in range(2)):
        bc(wr, sr, recip, out, n, k, G4.cdiv(k, 64))
        assert torch.equal(out.cpu(), ref)
    if DEV == "cuda":
        assert [i for i, _ in bc.tensors] == [3] and bc.scalars == ()
    odd = torch.full((n * k + 1,), float("nan"), dtype=dtype, device=DEV)[1:].view(n, k)
    bc(wr, sr, recip, odd, n, k, G4.cdiv(k, 64))  # the checked argument off the alignment: the JIT path
    assert torch.equal(odd.cpu(), ref)


@pytest.mark.parametrize("m", [1, 8, 40])
def test_plans_on_misaligned_weights(m):
    """A plan whose weight tensors start off a 16-byte boundary (views into larger buffers): its bound launches see
    the misalignment and take the JIT path; forward and few-row grad match an aligned copy's, bit for bit."""
    from hfq_kernels.nvfp4_plan import plan_linear_g4

    n, k = 48, 320
    lay = _layer(n, k, bias=False, seed=5).to(DEV).to_g4_layout_()
    wr, sr, gs = lay.weight_g4, lay.weight_g4_scale, lay.weight_global_scale

    def shifted(t):  # the same values, 4 bytes (one word) past an aligned start
        flat = torch.empty(t.numel() * t.element_size() + 4, dtype=torch.uint8, device=t.device)
        v = flat[4:].view(t.dtype).view(t.shape)
        v.copy_(t)
        return v

    wr2, sr2 = shifted(wr), shifted(sr)
    assert wr2.data_ptr() & 15 and torch.equal(wr2, wr)
    x = torch.randn(m, k, dtype=torch.bfloat16, device=DEV)
    g = torch.randn(m, n, dtype=torch.bfloat16, device=DEV)
    want = plan_linear_g4(x, wr, sr, gs, None, n, k)
    got = plan_linear_g4(x, wr2, sr2, gs, None, n, k)
    for _ in range(2):  # the second call takes the bound launches where they exist
        assert torch.equal(got.forward(x, None), want.forward(x, None))
        assert torch.equal(got.grad(g), want.grad(g))


@pytest.mark.skipif(not (torch.cuda.is_available() and G4.device_ok(torch.device("cuda"))),
                    reason="bound launches exist on a GPU only (the interpreter takes the JIT path)")
@pytest.mark.parametrize("m, bias, keep_gb", [(8, False, 0.0), (8, True, 0.0), (8, True, 2.0), (96, True, 2.0)])
def test_training_calls_skip_the_triton_jit_once_planned(monkeypatch, m, bias, keep_gb):
    """After its first calls, an eager NVFP4 fwd+bwd (Gluon or dequantize forward, few-row or dequantize grad-input)
    launches every kernel through its bound launch: none goes back to Triton's JIT (tens of microseconds each)."""
    from triton.runtime.jit import JITFunction

    from hfq.nvfp4 import NVFP4Linear

    monkeypatch.setattr(SETTINGS, "grad_dense_gb", keep_gb)
    torch.manual_seed(0)
    lin = NVFP4Linear.from_linear(torch.nn.Linear(4096, 4096, bias=bias, device=DEV, dtype=torch.bfloat16))
    lin.requires_grad_(False)
    x = torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16)
    for _ in range(2):
        with torch.no_grad():
            lin(x)
        torch.autograd.grad(lin(x), [x], gy)
    jit_runs = []
    run = JITFunction.run

    def counted(self, *a, **kw):
        jit_runs.append(self.fn.__name__)
        return run(self, *a, **kw)

    monkeypatch.setattr(JITFunction, "run", counted)
    with torch.no_grad():
        lin(x)
    (gx,) = torch.autograd.grad(lin(x), [x], gy)
    assert jit_runs == []
    ref = gy.float() @ lin.dequantize(torch.float32)
    assert float((gx.float() - ref).norm() / ref.norm()) < 1e-2


def test_dequantize_falls_back_when_the_wordwise_kernel_fails(monkeypatch):
    """A build error (or a wrong value) of the word-wise kernel at its first-use check: gather kernel, warning."""
    class Broken:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                raise RuntimeError("simulated build failure")
            return launch

    monkeypatch.setattr(G4, "_g4_dequant_kernel", Broken())
    monkeypatch.setattr(G4, "_FAST_CHECKED", {})
    p, s, r = _canonical(32, 128, seed=1)
    wr, sr = (t.to(DEV) for t in G4.repack(p, s))
    with pytest.warns(RuntimeWarning, match="simulated build failure"):
        out = G4.dequantize_g4(wr, sr, r.to(DEV), 32, 128, torch.bfloat16)
    assert torch.equal(out.cpu(), fp4.nvfp4_dequantize(p, s, r, torch.bfloat16))
    assert G4._FAST_CHECKED[(out.device, torch.bfloat16)] is False


# ------------------------------------------------------------------------- user routes on a (simulated) kernel GPU
@pytest.fixture
def kernel_gpu(monkeypatch):
    """Make NVFP4Linear treat every device as one that runs the Gluon kernel, so the automatic conversions (after
    loading, on moves, at the first forward) happen on CPU, where the g4 ops run their torch reference."""
    monkeypatch.setattr(G4, "device_ok", lambda device: True)


def test_from_linear_on_a_kernel_gpu_builds_g4_directly(kernel_gpu):
    """A layer quantized where the kernel runs (from_linear / set_weight) holds no canonical copy, even before any
    forward (a torch.compile'd first forward never takes the eager conversion)."""
    from hfq.nvfp4 import NVFP4Linear

    lin = torch.nn.Linear(64, 48, dtype=torch.bfloat16)
    lay = NVFP4Linear.from_linear(lin)
    assert lay.layout == "g4" and {"weight_g4", "weight_g4_scale"} <= set(lay._buffers) and "weight_packed" not in lay._buffers
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(G4, "device_ok", lambda device: False)
        ref = NVFP4Linear.from_linear(lin)
    assert ref.layout == "canonical"
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    assert torch.equal(lay(x), ref(x))
    lay.set_weight(lin.weight.detach() * 2)
    assert lay.layout == "g4"


def _lora_trainer_run(model_dir, out, resume=None):
    import peft
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import hfq
    from hfq.nvfp4 import NVFP4Config, NVFP4Linear

    m = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=NVFP4Config())
    assert all(x.layout == "g4" for x in m.modules() if isinstance(x, NVFP4Linear))  # converted after loading
    pm = hfq.nvfp4.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": i, "labels": i} for i in (torch.randint(4, 90, (16,), generator=g) for _ in range(16))]
    args = TrainingArguments(out, max_steps=4, per_device_train_batch_size=2, save_steps=2, logging_steps=1,
                             report_to=[], use_cpu=True, seed=0, disable_tqdm=True, learning_rate=1e-2)
    tr = Trainer(model=pm, args=args, train_dataset=data)
    tr.train(resume_from_checkpoint=resume)
    assert all(x.layout == "g4" for x in m.modules() if isinstance(x, NVFP4Linear))  # saves did not convert back
    return pm, [h["loss"] for h in tr.state.log_history if "loss" in h]


def test_trainer_lora_resume_on_g4(kernel_gpu, tmp_path):
    from hfq.tiny import save_tiny

    tiny = str(save_tiny(tmp_path / "tiny", arch="llama"))
    a, loss_a = _lora_trainer_run(tiny, str(tmp_path / "a"))
    b, loss_b = _lora_trainer_run(tiny, str(tmp_path / "b"), resume=str(tmp_path / "a" / "checkpoint-2"))
    assert loss_a[2:] == loss_b[-2:]
    la = {n: p for n, p in a.named_parameters() if "lora_B" in n}
    assert la and any(float(p.detach().abs().sum()) > 0 for p in la.values())
    for n, p in b.named_parameters():
        if "lora_" in n:
            assert torch.equal(p, dict(a.named_parameters())[n]), n


def _length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def test_qerl_grpo_step_on_g4(kernel_gpu, tmp_path):
    """QeRLGRPOTrainer with TRL's peft_config on a g4 base: LoRA trains, the codes stay as they were."""
    pytest.importorskip("datasets", reason="the device image has no datasets/trl wheels; CI installs them")
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hfq.nvfp4 import NVFP4Config, NVFP4Linear
    from hfq.qerl import QeRLConfig, QeRLGRPOTrainer
    from hfq.qerl.data import make_dataset
    from hfq.tiny import save_tiny

    tiny = str(save_tiny(tmp_path / "tiny", arch="qwen2"))
    model = AutoModelForCausalLM.from_pretrained(tiny, quantization_config=NVFP4Config(), dtype=torch.float32)
    lays = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
    before = [m.canonical()[0].clone() for m in lays]
    ds = Dataset.from_list([{"prompt": r["prompt"]} for r in make_dataset(8, seed=3)])
    args = QeRLConfig(output_dir=str(tmp_path / "out"), learning_rate=1e-2, num_generations=4,
                      per_device_train_batch_size=4, max_completion_length=6, max_steps=1, logging_steps=1,
                      save_strategy="no", report_to="none", bf16=False, use_cpu=True)
    trainer = QeRLGRPOTrainer(model=model, reward_funcs=[_length_reward], args=args, train_dataset=ds,
                              processing_class=AutoTokenizer.from_pretrained(tiny), peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                     task_type="CAUSAL_LM"))
    trainer.train()
    assert any(p.abs().sum() > 0 for n, p in trainer.model.named_parameters() if "lora_B" in n)
    assert all(m.layout == "g4" for m in lays)
    assert all(torch.equal(m.canonical()[0], b) for m, b in zip(lays, before))


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("keep_gb", [2.0, 0.0])
def test_checkpoint_recompute_same_grads(monkeypatch, reentrant, keep_gb):
    """Under activation checkpointing the plan path gives the gradients of the plain call. Dequantizes: the plain
    call's forward serves its grad-input (1), checkpointed the forward and the recompute (2); with no budget for
    kept weights (HFQ_NVFP4_GRAD_DENSE_GB=0) grad-input dequantizes again (2 and 3). Nothing stays kept after."""
    from torch.utils.checkpoint import checkpoint

    from hfq_kernels.nvfp4 import KEPT_DENSE

    monkeypatch.setattr(SETTINGS, "plan_on_cpu", True)
    monkeypatch.setattr(SETTINGS, "grad_dense_gb", keep_gb)
    calls = []
    real = G4.dequantizer

    def counting(*a, **kw):  # every dequantize launch of the layer's plans
        run = real(*a, **kw)
        return lambda *b, **c: calls.append(1) or run(*b, **c)

    monkeypatch.setattr(G4, "dequantizer", counting)
    lay = _layer(n=32, k=96, seed=7).to(DEV).to_g4_layout_()
    x = torch.randn(80, 96, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    before = KEPT_DENSE.bytes
    loss = lay(x).float().square().sum()
    assert KEPT_DENSE.bytes - before == (32 * 96 * 2 if keep_gb else 0)
    loss.backward()
    del loss
    assert KEPT_DENSE.bytes == before and len(calls) == (1 if keep_gb else 2)
    ref, x.grad = x.grad, None
    calls.clear()
    checkpoint(lambda t: lay(t).float().square().sum(), x, use_reentrant=reentrant).backward()
    assert torch.equal(x.grad, ref)
    assert len(calls) == (2 if keep_gb else 3)
    assert KEPT_DENSE.bytes == before


@pytest.mark.real_model
def test_real_smollm2_in_g4_same_logits_and_checkpoint(smollm2, kernel_gpu, tmp_path):
    """SmolLM2-135M-Instruct (real weights) quantized to NVFP4: the automatic g4 layout gives the canonical layers'
    logits bit for bit, and its save_pretrained equals the canonical model's tensors exactly."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import hfq  # noqa: F401
    from hfq.nvfp4 import NVFP4Config, NVFP4Linear

    g4 = AutoModelForCausalLM.from_pretrained(smollm2, quantization_config=NVFP4Config())
    lays = [m for m in g4.modules() if isinstance(m, NVFP4Linear)]
    assert lays and all(m.layout == "g4" for m in lays)
    canon = AutoModelForCausalLM.from_pretrained(smollm2, quantization_config=NVFP4Config())
    for m in canon.modules():
        if isinstance(m, NVFP4Linear):
            m.to_canonical_layout_()
    ids = torch.randint(10, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(g4(ids).logits, canon(ids).logits)
    g4.save_pretrained(tmp_path / "g4")
    canon.save_pretrained(tmp_path / "canon")
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("g4", "canon"))
    assert a.keys() == b.keys() and any(k.endswith("weight_packed") for k in a)
    for key in a:
        assert torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)), key


_GLUON_GPU = torch.cuda.is_available() and G4.device_ok(torch.device("cuda"))


@pytest.mark.skipif(not _GLUON_GPU, reason="the Gluon decode kernel needs an sm_80+ GPU (the interpreter cannot run "
                                           "Gluon; the grouped reduce and the kernel's sm_90 build are checked on CPU)")
@pytest.mark.parametrize("m,ns,k,bias,split", [(8, (3584 // 7, 64, 64), 512, True, 4), (1, (48, 32), 1024, False, 1),
                                               (13, (208, 16, 96), 576, True, 3), (64, (32, 48), 128, False, 2)])
def test_grouped_g4_launch_bit_identical_to_per_weight_launches(m, ns, k, bias, split):
    """One grouped launch for 2-3 weights sharing x gives each weight's per-weight kernel bits at the same config and
    split, and matches x @ dequant(W)^T + b."""
    from hfq_kernels import lora_nvfp4 as LN, nvfp4_configs as CF

    dev = torch.device("cuda")
    ws = []
    for i, n in enumerate(ns):
        p, s, r = _canonical(n, k, seed=10 + i)
        wr, sr = (t.to(dev) for t in G4.repack(p, s))
        b = (torch.randn(n, generator=torch.Generator().manual_seed(i)) * 0.1).to(torch.bfloat16).to(dev) if bias else None
        ws.append((wr, sr, r.float().to(dev), b, n))
    x = torch.randn(m, k, device=dev).to(torch.bfloat16)
    cfg = dict(CF.gluon_config(m, sum(ns), k, dev), split=split)
    sp, cps = CF.splits(G4.cdiv(k, 64), split)
    assert LN.group_g4_ok(x, ws)
    run = G4.group_launcher(m, ns, k, cfg, sp, cps, bias)
    if sp == 1:
        outs = [torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev) for n in ns]
        run(x, [w[:4] for w in ws], outs)
    else:
        part = torch.empty(sp * m * sum(ns), dtype=torch.float32, device=dev)
        offs = [0, ns[0], ns[0] + ns[1]][:len(ns)]
        dsts = [part[o * sp * m:(o + n) * sp * m] for o, n in zip(offs, ns)]
        run(x, [w[:4] for w in ws], dsts)
    for i, (wr, sr, r, b, n) in enumerate(ws):
        one = G4.launcher(m, n, k, cfg, sp, cps, bias)
        if sp == 1:
            y = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
            one(x, wr, sr, r, b, y, n)
            assert torch.equal(outs[i], y)
        else:
            d = torch.empty((sp, m, n), dtype=torch.float32, device=dev)
            one(x, wr, sr, r, b, d, n)
            assert torch.equal(dsts[i].view(sp, m, n), d)
    ys = LN.linear_group_g4(x, ws)
    for (wr, sr, r, b, n), y in zip(ws, ys):
        w = G4.dequantize_g4_ref(wr.cpu(), sr.cpu(), r.cpu(), n, k, torch.float32).to(dev)
        ref = F.linear(x.float(), w, None if b is None else b.float())
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
    # what the grouped path refuses: one member, mixed bias presence, a non-fp32 global scale, fp16 x
    assert not LN.group_g4_ok(x, ws[:1])
    if bias:
        assert not LN.group_g4_ok(x, [ws[0], (*ws[1][:3], None, ws[1][4])])
    assert not LN.group_g4_ok(x, [ws[0], (ws[1][0], ws[1][1], ws[1][2].half(), ws[1][3], ws[1][4])])
    assert not LN.group_g4_ok(x.half(), ws)
    with pytest.raises(ValueError, match="nvfp4 grouped linear"):
        LN.linear_group_g4(x.half(), ws)


@pytest.mark.skipif(not _GLUON_GPU, reason="the Gluon decode kernel needs an sm_80+ GPU")
def test_rollout_groups_nvfp4_projections(tmp_path, monkeypatch):
    """The rollout engine runs q/k/v and gate/up of a bf16 NVFP4 model as grouped launches (2 per layer and step),
    also under unmerged LoRA, and a group's outputs equal the modules' own (LoRA included) within bf16 rounding."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from hfq.nvfp4 import NVFP4Config
    from hfq.nvfp4.peft_lora import get_peft_model
    from hfq.rollout import RolloutEngine
    from hfq.rollout import decoder as D
    from hfq.tiny import save_tiny

    path = save_tiny(tmp_path / "tiny", arch="qwen2", seed=6)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=NVFP4Config(), dtype=torch.bfloat16,
                                                 device_map="cuda").eval()  # the Gluon kernel takes bf16
    calls = []
    real = D._nv.linear_group_g4
    monkeypatch.setattr(D._nv, "linear_group_g4",
                        lambda x2, ws, **kw: calls.append(len(ws)) or real(x2, ws, **kw))
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    n_layers = model.config.num_hidden_layers
    for with_lora in (False, True):
        m = model
        if with_lora:
            m = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                 target_modules=["q_proj", "v_proj", "up_proj"]))
            m = m.to(torch.bfloat16).eval()
        calls.clear()
        eng = RolloutEngine(m, max_batch=2, max_seq_len=40, kv_block=16, graph_mode="eager")
        out = eng.generate(prompts, max_new_tokens=6, temperature=0, eos_token_ids=[])
        assert out.completion_ids.shape == (2, 6)
        assert calls.count(3) >= 5 * n_layers and calls.count(2) >= 5 * n_layers  # q/k/v and gate/up, every step
        x = torch.randn(3, 1, model.config.hidden_size, device="cuda").to(torch.bfloat16)
        for layer in D.unwrap_causal_lm(m).model.layers:
            for mods in ([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
                         [layer.mlp.gate_proj, layer.mlp.up_proj]):
                calls.clear()
                with torch.no_grad():
                    got = eng.adapter._linear_group(mods, x)
                    want = [mod(x) for mod in mods]
                assert calls == [len(mods)]
                for g, w in zip(got, want):
                    torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not (_GLUON_GPU and torch.cuda.get_device_capability()[0] >= 9),
                    reason="programmatic dependent launch needs an sm_90+ GPU")
def test_rollout_programmatic_dependent_launch_same_tokens(tmp_path, monkeypatch):
    """The decode graph captured with programmatic dependent launch (every decode kernel waits for the one before
    it inside the kernel) gives the bits of the graph without it: greedy tokens and log-probs, NVFP4 with and
    without LoRA on all seven projections; the PDL launches were taken."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from hfq.nvfp4 import NVFP4Config
    from hfq.nvfp4.peft_lora import get_peft_model
    from hfq.rollout import DecodeFusions, RolloutEngine
    from hfq.tiny import save_tiny
    from hfq_kernels import _triton as T

    path = save_tiny(tmp_path / "tiny", arch="qwen2", seed=7, hidden=256, intermediate=512)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=NVFP4Config(), dtype=torch.bfloat16,
                                                 device_map="cuda").eval()
    taken = []
    real = T.pdl
    monkeypatch.setattr(T, "pdl", lambda dev: taken.append(real(dev)) or taken[-1])
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40]]
    for lora in (False, True):
        m = model
        if lora:
            m = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, target_modules=[
                "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])).to(torch.bfloat16).eval()
        outs = {}
        for on in (True, False):
            taken.clear()
            # LoRA shrinks on the step's stream: PDL kept with LoRA
            eng = RolloutEngine(m, max_batch=4, max_seq_len=40, kv_block=16, graph_mode="cuda_graph",
                                fusions=DecodeFusions(pdl=on, lora_stream=False))
            outs[on] = eng.generate(prompts, max_new_tokens=12, temperature=0, eos_token_ids=[],
                                    return_logprobs=True)
            assert any(taken) == on, (lora, on)
        assert torch.equal(outs[True].completion_ids, outs[False].completion_ids), lora
        assert torch.equal(outs[True].logprobs, outs[False].logprobs), lora
        if lora:
            m.unload()


@pytest.mark.skipif(not _GLUON_GPU, reason="the Gluon decode kernel needs an sm_80+ GPU")
def test_rollout_lora_expand_with_the_reduce_folded_in_same_tokens(tmp_path, monkeypatch):
    """NVFP4 linears with LoRA in the decode step: their split-K reduce done by the LoRA expand's launch (the
    default) gives the bits of reduce, then expand (DecodeFusions(lora_in_reduce=False)): greedy tokens and log-probs under
    CUDA graphs and eager, LoRA on all seven projections and on v/up/o only (q/k/v and gate/up groups partly
    adapted keep the separate path); the fused path is taken for every fully adapted group."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from hfq.nvfp4 import NVFP4Config
    from hfq.nvfp4.peft_lora import get_peft_model
    from hfq.rollout import DecodeFusions, RolloutEngine
    from hfq.rollout import decoder as D
    from hfq.tiny import save_tiny

    path = save_tiny(tmp_path / "tiny", arch="qwen2", seed=8, hidden=256, intermediate=512)  # q/k/v biases
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=NVFP4Config(), dtype=torch.bfloat16,
                                                 device_map="cuda").eval()
    calls = []
    real = D._nv.linear_lora_g4
    monkeypatch.setattr(D._nv, "linear_lora_g4",
                        lambda x2, ws, sh, join=None: calls.append(len(ws)) or real(x2, ws, sh, join))
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40]]
    n_layers = model.config.num_hidden_layers
    all7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for targets, groups in ((all7, [3, 1, 2, 1]), (["v_proj", "up_proj", "o_proj"], [1])):
        m = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                             target_modules=targets)).to(torch.bfloat16).eval()
        for graph_mode in ("cuda_graph", "eager"):
            outs = {}
            for on in (True, False):
                # the side stream has its own test
                eng = RolloutEngine(m, max_batch=4, max_seq_len=40, kv_block=16, graph_mode=graph_mode,
                                    fusions=DecodeFusions(lora_in_reduce=on, lora_stream=False))
                assert eng.adapter.fused and eng.adapter.fusions.lora_in_reduce == on
                calls.clear()
                outs[on] = eng.generate(prompts, max_new_tokens=8, temperature=0, eos_token_ids=[],
                                        return_logprobs=True)
                if on and graph_mode == "eager":  # every decode step of every layer
                    assert sorted(calls) == sorted(groups * 7 * n_layers), (targets, calls[:8])
                elif not on:
                    assert not calls
            assert torch.equal(outs[True].completion_ids, outs[False].completion_ids), (targets, graph_mode)
            assert torch.equal(outs[True].logprobs, outs[False].logprobs), (targets, graph_mode)
        m.unload()


@pytest.mark.skipif(not _GLUON_GPU, reason="the Gluon decode kernel needs an sm_80+ GPU")
def test_rollout_lora_shrink_on_a_side_stream_same_tokens(tmp_path, monkeypatch):
    """The LoRA shrinks of NVFP4 + LoRA groups run on a side stream, concurrent with the base GEMV, and are joined
    before the expand (the default): greedy tokens and log-probs equal those of shrinks on the main stream
    (DecodeFusions(lora_stream=False)) under CUDA graphs (fork and join inside the captured step) and eagerly; with it
    on, every shrink runs on the adapter's side stream and the adapter reports the fork (so the engine's capture
    scope has no programmatic dependent launch), with it off neither."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from hfq.nvfp4 import NVFP4Config
    from hfq.nvfp4.peft_lora import get_peft_model
    from hfq.rollout import DecodeFusions, RolloutEngine
    from hfq.rollout import decoder as D
    from hfq.tiny import save_tiny

    path = save_tiny(tmp_path / "tiny", arch="qwen2", seed=9, hidden=256, intermediate=512)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=NVFP4Config(), dtype=torch.bfloat16,
                                                 device_map="cuda").eval()
    m = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])).to(torch.bfloat16).eval()
    streams = []
    real = D._lora.shrink_
    monkeypatch.setattr(D._lora, "shrink_", lambda x2, sh: streams.append(torch.cuda.current_stream()) or
                        real(x2, sh))
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40], [7, 7]]
    for graph_mode in ("cuda_graph", "eager"):
        outs = {}
        for on in (True, False):
            eng = RolloutEngine(m, max_batch=4, max_seq_len=48, kv_block=16, graph_mode=graph_mode,
                                fusions=DecodeFusions(lora_stream=on))
            assert eng.adapter.fusions.lora_in_reduce and eng.adapter.fusions.lora_stream == on
            streams.clear()
            outs[on] = eng.generate(prompts, max_new_tokens=10, temperature=0, eos_token_ids=[],
                                    return_logprobs=True)
            sides = list(eng.adapter._side.values())
            assert streams and len(sides) == int(on), (graph_mode, on, len(sides))
            # a step that forks is captured without programmatic dependent launch (engine._pdl reads the flag)
            assert eng.adapter.forked == on
            assert isinstance(eng._pdl(), contextlib.nullcontext) == on
            assert all((s in sides) == on for s in streams), (graph_mode, on)
        assert torch.equal(outs[True].completion_ids, outs[False].completion_ids), graph_mode
        assert torch.equal(outs[True].logprobs, outs[False].logprobs), graph_mode
    m.unload()
