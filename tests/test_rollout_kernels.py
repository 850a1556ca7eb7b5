"""Fused rollout decode kernels (hfq_kernels.rollout, .lora, .skinny_gemm; Triton, on CPU under TRITON_INTERPRET=1)
against their torch references, and the engine's fused decode path against transformers' generate."""
import pytest
import torch

from hfq.rollout import RolloutEngine
from hfq_kernels import lora
from hfq_kernels import rollout as K
from hfq_kernels import skinny_gemm as gemm
from hfq.rollout.engine import RolloutEngine as _E
from hfq.tiny import tiny_model

from _hfq_test_utils import compile_for_sm90

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not K.available(torch.device(DEV)),
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27], [40]]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def same_rounding(a, b):
    """Equal to about an ulp: the GPU may contract a * b + c into an FMA, and the interpreter's
    float32 -> bfloat16 cast truncates instead of rounding to nearest even."""
    return rel(a, b) < (8e-3 if a.dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_res", [False, True])
def test_add_rmsnorm(dtype, with_res):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 1, 200, generator=g).to(DEV, dtype)
    r = torch.randn(3, 1, 200, generator=g).to(DEV, dtype) if with_res else None
    w = (1 + 0.1 * torch.randn(200, generator=g)).to(DEV, dtype)
    y, s = K.add_rmsnorm(x, r, w, 1e-6)
    y_ref, s_ref = K.add_rmsnorm_ref(x, r, w, 1e-6)
    assert y.shape == y_ref.shape and s.shape == s_ref.shape and y.dtype == dtype
    assert same_rounding(s, s_ref)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    assert rel(y, y_ref) < tol


def _rope_inputs(g, b, nkv, hd, B, S, col, dtype):
    """cos/sin [b, hd] of random angles, the write column, and random K/V caches [B, nkv, S, hd]."""
    ang = torch.randn(b, hd // 2, generator=g)
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(DEV, dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(DEV, dtype)
    kc = torch.randn(B, nkv, S, hd, generator=g).to(DEV, dtype)
    vc = torch.randn(B, nkv, S, hd, generator=g).to(DEV, dtype)
    return cos, sin, torch.tensor([col], device=DEV), kc, vc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_kv_write(dtype):
    g = torch.Generator().manual_seed(1)
    b, nh, nkv, hd, B, S = 3, 6, 2, 16, 4, 40
    q = torch.randn(b, nh * hd, generator=g).to(DEV, dtype)
    k = torch.randn(b, nkv * hd, generator=g).to(DEV, dtype)
    v = torch.randn(b, nkv * hd, generator=g).to(DEV, dtype)
    cos, sin, col, kc, vc = _rope_inputs(g, b, nkv, hd, B, S, 17, dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    qo = K.rope_kv_write(q, k, v, cos, sin, kc, vc, col, nh, nkv, hd)
    qo_ref = K.rope_kv_write_ref(q, k, v, cos, sin, kc2, vc2, col, nh, nkv, hd)
    assert same_rounding(qo, qo_ref)  # same rounding steps as HF's rotate_half form
    assert same_rounding(kc, kc2) and torch.equal(vc, vc2)  # only column 17 of rows 0..2 changed
    assert torch.equal(kc[:, :, :17], kc2[:, :, :17]) and torch.equal(kc[3], kc2[3])
    assert torch.equal(kc[:, :, 18:], kc2[:, :, 18:])


@pytest.mark.parametrize("nh,nkv,hd,kv_len,col", [(4, 2, 16, 48, 30), (6, 2, 32, 200, 199), (7, 1, 64, 64, 5)])
def test_decode_attention(nh, nkv, hd, kv_len, col):
    g = torch.Generator().manual_seed(2)
    b, B, S = 3, 4, 256
    q = torch.randn(b, nh, hd, generator=g).to(DEV)
    kc = torch.randn(B, nkv, S, hd, generator=g).to(DEV)
    vc = torch.randn(B, nkv, S, hd, generator=g).to(DEV)
    mask = torch.full((B, S), float("-inf"))
    mask[:, :col + 1] = 0.0
    mask[1, :min(7, col)] = float("-inf")  # left padding of row 1 (the newest column is always valid)
    mask[2, col] = 0.0
    mask = mask.to(DEV)
    out = K.decode_attention(q, kc, vc, mask[:b], torch.tensor([col], device=DEV), kv_len, hd ** -0.5, block_n=16)
    ref = K.decode_attention_ref(q, kc, vc, mask[:b], kv_len, hd ** -0.5)
    assert out.shape == ref.shape
    assert rel(out, ref) < 1e-5
    # columns past col are skipped whatever the mask holds there
    mask2 = mask.clone()
    mask2[:, col + 1:] = 0.0
    out2 = K.decode_attention(q, kc, vc, mask2[:b], torch.tensor([col], device=DEV), kv_len, hd ** -0.5,
                              block_n=16)
    assert torch.equal(out, out2)


def test_silu_mul():
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(3, 1, 300, generator=g).to(DEV, dtype)
        u = torch.randn(3, 1, 300, generator=g).to(DEV, dtype)
        out = K.silu_mul(a, u)
        assert out.shape == a.shape and out.dtype == dtype
        assert rel(out, K.silu_mul_ref(a, u)) < (1e-6 if dtype == torch.float32 else 8e-3)


def hf_greedy(model, prompts, max_new):
    ids, am = _E._left_pad(prompts, None, 0)
    out = model.generate(input_ids=ids.to(DEV), attention_mask=am.to(DEV), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[:, ids.shape[1]:].cpu()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # qwen3: q/k norms; llama/mistral: same path as qwen2
def test_fused_engine_greedy_matches_generate(arch):
    model = tiny_model(arch, seed=1).to(DEV)
    eng = RolloutEngine(model, max_batch=4, max_seq_len=40, kv_block=16, fused_kernels=True, graph_mode="eager")
    assert eng.adapter.fused
    out = eng.generate(PROMPTS, max_new_tokens=8, temperature=0, eos_token_ids=[])
    assert torch.equal(out.completion_ids.cpu(), hf_greedy(model, PROMPTS, 8))


def test_fused_engine_lora_and_in_place_updates():
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"], init_lora_weights=False)
    pm = get_peft_model(tiny_model("qwen2", seed=5), cfg).to(DEV).eval()
    eng = RolloutEngine(pm, max_batch=4, max_seq_len=40, kv_block=16, fused_kernels=True, graph_mode="eager")
    from hfq.rollout.decoder import _lora_plan

    x = torch.zeros(1, 64, device=DEV)
    assert _lora_plan(pm.base_model.model.model.layers[0].self_attn.q_proj, x)  # the fast LoRA path is taken
    out = eng.generate(PROMPTS, max_new_tokens=6, temperature=0, eos_token_ids=[])
    assert torch.equal(out.completion_ids.cpu(), hf_greedy(pm, PROMPTS, 6))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.add_(torch.randn(p.shape, generator=g).to(DEV) * 0.5)
            if "layernorm" in n:
                p.add_(torch.randn(p.shape, generator=g).to(DEV) * 0.3)
    out2 = eng.generate(PROMPTS, max_new_tokens=6, temperature=0, eos_token_ids=[])
    assert torch.equal(out2.completion_ids.cpu(), hf_greedy(pm, PROMPTS, 6))
    assert not torch.equal(out2.completion_ids, out.completion_ids)


def test_fused_flag_validation():
    model = tiny_model("qwen2")
    with pytest.raises(ValueError, match="fused_kernels"):
        RolloutEngine(model, max_batch=1, max_seq_len=16, fused_kernels="yes")
    eng = RolloutEngine(model, max_batch=1, max_seq_len=16, fused_kernels=False)
    assert not eng.adapter.fused


@pytest.mark.parametrize("want_lp", [False, True])
def test_gumbel_sample_same_noise(want_lp):
    g = torch.Generator().manual_seed(4)
    b, V = 5, 3000
    logits = (torch.randn(b, V, generator=g) * 2).to(DEV)
    temp = torch.tensor([[1.0], [0.7], [1.3], [1.0], [0.5]], device=DEV)
    keys = K.row_keys(torch.arange(b, dtype=torch.long) * 7919 + 3).to(DEV)
    step = torch.tensor([11], device=DEV)
    tok, lp = K.gumbel_sample(logits, temp, keys, step, want_lp, block=256)
    ref_tok, ref_lp = K.gumbel_sample_ref(logits, temp, keys, step, torch.arange(V, device=DEV), want_lp)
    assert torch.equal(tok, ref_tok)
    if want_lp:
        torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=0)
    else:
        assert lp is None


@pytest.mark.parametrize("cfg", [(32, 64, 1, 4, 2), (32, 64, 2, 4, 2)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_gemm(cfg, with_bias):
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float16  # the interpreter's bf16 dot is not exact
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 256, generator=g).to(DEV, dtype)
    w = (torch.randn(96, 256, generator=g) * 0.05).to(DEV, dtype)
    b = torch.randn(96, generator=g).to(DEV, dtype) if with_bias else None
    out = torch.full((5, 96), float("nan"), dtype=dtype, device=DEV)
    gemm._run(x, w, b, cfg, out)
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert rel(out, ref) < 5e-3


@pytest.mark.parametrize("rows,r,n_out", [(3, 4, 3), (8, 32, 2), (20, 8, 1)])
def test_lora_add(rows, r, n_out):
    g = torch.Generator().manual_seed(6)
    K_ = 200
    x = torch.randn(rows, K_, generator=g).to(DEV)
    plans = [((torch.randn(r, K_, generator=g) * 0.1).to(DEV), (torch.randn(n, r, generator=g) * 0.1).to(DEV),
              0.5 + i) for i, n in enumerate((96, 40, 130)[:n_out])]
    outs = [torch.randn(rows, p[1].shape[0], generator=g).to(DEV) for p in plans]
    refs = lora.lora_add_ref(x, [o.clone() for o in outs], plans)
    lora.lora_add_(x, outs, plans, n_splits=3, block_n=32)
    for o, ref in zip(outs, refs):
        assert rel(o, ref) < 1e-5


@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_gemm_group(with_bias):
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float16
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 192, generator=g).to(DEV, dtype)
    ws = [(torch.randn(n, 192, generator=g) * 0.05).to(DEV, dtype) for n in (64, 32, 40)]
    bs = [torch.randn(w.shape[0], generator=g).to(DEV, dtype) if with_bias else None for w in ws]
    outs = [torch.full((6, w.shape[0]), float("nan"), dtype=dtype, device=DEV) for w in ws]
    assert DEV == "cpu" or gemm.group_eligible(x, ws, bs)
    gemm._run_group(x, ws, bs, (32, 128, 4, 2), outs)
    for o, w, b in zip(outs, ws, bs):
        ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        assert rel(o, ref) < 5e-3


def _plans(g, k, r, ns, dtype):
    return [((torch.randn(r, k, generator=g) * 0.1).to(DEV, dtype), (torch.randn(n, r, generator=g) * 0.1).to(DEV, dtype),
             0.5 + i) for i, n in enumerate(ns)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,h,r,ns,with_res", [(3, 200, 4, (96, 40, 130), True), (8, 256, 32, (64,), False),
                                                  (1, 136, 8, (50, 24), True)])
def test_add_rmsnorm_shrink_then_expand(dtype, rows, h, r, ns, with_res):
    """Residual add + RMSNorm with the LoRA shrink of its output fused, then the expand: the norm's outputs are
    add_rmsnorm's, and the LoRA updates are PEFT's (lora_add_ref) on the normed rows."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(rows, h, generator=g).to(DEV, dtype)
    res = torch.randn(rows, h, generator=g).to(DEV, dtype) if with_res else None
    w = (1 + 0.1 * torch.randn(h, generator=g)).to(DEV, dtype)
    plans = _plans(g, h, r, ns, dtype)
    sh = lora.Shrink(plans, rows, h, x.device, n_splits=3)
    assert sh.n_splits > 1
    y, s = lora.add_rmsnorm_shrink(x, res, w, 1e-6, sh)
    y_ref, s_ref = K.add_rmsnorm_ref(x, res, w, 1e-6)
    assert same_rounding(s, s_ref)
    assert rel(y, y_ref) < (1e-6 if dtype == torch.float32 else 2e-3)
    outs = [torch.randn(rows, n, generator=g).to(DEV, dtype) for n in ns]
    refs = lora.lora_add_ref(y_ref, [o.clone() for o in outs], plans)
    lora.expand_(sh, outs, block_n=32)
    for o, ref in zip(outs, refs):
        assert rel(o, ref) < (1e-5 if dtype == torch.float32 else 3e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,n,r,gate_up,down", [(3, 300, 4, (True, True), True), (8, 512, 32, (False, True), True),
                                                   (17, 600, 16, (True, False), False), (2, 96, 8, None, True)])
def test_silu_mul_lora(dtype, rows, n, r, gate_up, down):
    """SiLU(gate + LoRA_g) * (up + LoRA_u) with gate/up's expands and down_proj's shrink in the one kernel: the
    activation is PEFT's on the LoRA-updated gate/up, and down's update from the partials is PEFT's on it."""
    g = torch.Generator().manual_seed(9)
    k_in = 72
    x = torch.randn(rows, k_in, generator=g).to(DEV, dtype)
    gate = torch.randn(rows, n, generator=g).to(DEV, dtype)
    up = torch.randn(rows, n, generator=g).to(DEV, dtype)
    up_lora, g_ref, u_ref = None, gate.clone(), up.clone()
    if gate_up is not None:
        members = [i for i, on in enumerate(gate_up) if on]
        plans_up = _plans(g, k_in, 8, (n,) * len(members), dtype)
        ush = lora.Shrink(plans_up, rows, k_in, x.device, n_splits=2)
        lora.shrink_(x, ush)
        refs = lora.lora_add_ref(x, [(g_ref, u_ref)[i].clone() for i in members], plans_up)
        for i, ref in zip(members, refs):
            (g_ref if i == 0 else u_ref).copy_(ref)
        up_lora = (ush, tuple(members.index(i) if i in members else None for i in range(2)))
    plans = _plans(g, n, r, (72,), dtype)
    sh = lora.Shrink(plans, rows, n, gate.device) if down else None
    h = lora.silu_mul_lora(gate, up, sh, up_lora)
    h_ref = K.silu_mul_ref(g_ref, u_ref)
    assert rel(h, h_ref) < (1e-5 if dtype == torch.float32 else 3e-3)
    if down:
        out = torch.randn(rows, 72, generator=g).to(DEV, dtype)
        ref = lora.lora_add_ref(h_ref, [out.clone()], plans)[0]
        lora.expand_(sh, [out])
        assert rel(out, ref) < (1e-5 if dtype == torch.float32 else 3e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("members", [(0, 1, 2), (1,), (0, 2)])
def test_rope_kv_write_with_lora_expand(dtype, members):
    """RoPE + KV write on the base q/k/v with their LoRA expands added in the kernel: q, cache K and V are those of
    rope_kv_write_ref on PEFT's LoRA-updated q/k/v."""
    g = torch.Generator().manual_seed(12)
    b, nh, nkv, hd, B, S, k_in = 3, 6, 2, 16, 4, 40, 80
    x = torch.randn(b, k_in, generator=g).to(DEV, dtype)
    base = [torch.randn(b, n * hd, generator=g).to(DEV, dtype) for n in (nh, nkv, nkv)]
    plans = _plans(g, k_in, 4, tuple(base[i].shape[1] for i in members), dtype)
    sh = lora.Shrink(plans, b, k_in, x.device, n_splits=2)
    lora.shrink_(x, sh)
    upd = [t.clone() for t in base]
    for i, ref in zip(members, lora.lora_add_ref(x, [base[i].clone() for i in members], plans)):
        upd[i] = ref
    cos, sin, col, kc, vc = _rope_inputs(g, b, nkv, hd, B, S, 9, dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    slots = tuple(members.index(i) if i in members else None for i in range(3))
    qo = K.rope_kv_write(*base, cos, sin, kc, vc, col, nh, nkv, hd, lora=(sh, slots))
    qo_ref = K.rope_kv_write_ref(*upd, cos, sin, kc2, vc2, col, nh, nkv, hd)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    assert rel(qo, qo_ref) < tol and rel(kc, kc2) < tol and rel(vc, vc2) < tol
    assert not torch.equal(kc, torch.randn(B, nkv, S, hd, generator=torch.Generator().manual_seed(0)).to(DEV, dtype))
    wrong = lora.Shrink(plans, b + 1, k_in, x.device)
    with pytest.raises(ValueError, match="rope_kv_write"):
        K.rope_kv_write(*base, cos, sin, kc, vc, col, nh, nkv, hd, lora=(wrong, slots))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_attention_with_o_proj_shrink(dtype):
    """The attention combine writes o_proj's LoRA shrink per head; rows beyond b stay unwritten and are masked."""
    g = torch.Generator().manual_seed(10)
    b, nh, nkv, hd, B, S, kv_len, r = 3, 6, 2, 16, 4, 48, 40, 8
    q = torch.randn(b, nh, hd, generator=g).to(DEV, dtype)
    kc = torch.randn(B, nkv, S, hd, generator=g).to(DEV, dtype)
    vc = torch.randn(B, nkv, S, hd, generator=g).to(DEV, dtype)
    mask = torch.zeros(B, S, device=DEV, dtype=dtype)
    mask[1, :5] = float("-inf")
    col = torch.tensor([kv_len - 1], device=DEV)
    plans = _plans(g, nh * hd, r, (40,), dtype)
    sh = lora.Shrink(plans, b, nh * hd, q.device, k_per_split=hd)
    sh.part.fill_(float("nan"))  # what the combine does not write must not reach the output
    o = K.decode_attention(q, kc, vc, mask, col, kv_len, hd ** -0.5, shrink=sh)
    o_ref = K.decode_attention_ref(q, kc, vc, mask, kv_len, hd ** -0.5)
    assert rel(o, o_ref) < (1e-5 if dtype == torch.float32 else 2e-3)
    out = torch.randn(b, 40, generator=g).to(DEV, dtype)
    ref = lora.lora_add_ref(o_ref, [out.clone()], plans)[0]
    lora.expand_(sh, [out])
    assert torch.isfinite(out).all() and rel(out, ref) < (1e-5 if dtype == torch.float32 else 3e-3)
    bad = lora.Shrink(plans, b, nh * hd, q.device)  # not split per head
    with pytest.raises(ValueError, match="split per head"):
        K.decode_attention(q, kc, vc, mask, col, kv_len, hd ** -0.5, shrink=bad)


def test_shrink_bad_input():
    g = torch.Generator().manual_seed(11)
    plans = _plans(g, 64, 4, (32,), torch.float32)
    with pytest.raises(ValueError, match="1..64 rows"):
        lora.Shrink(plans, 65, 64, "cpu")
    with pytest.raises(ValueError, match=r"A must be \[r, 80\]"):
        lora.Shrink(plans, 2, 80, "cpu")
    with pytest.raises(ValueError, match="1..3 adapters"):
        lora.Shrink(plans * 4, 2, 64, "cpu")
    sh = lora.Shrink(plans, 2, 64, DEV)
    x = torch.randn(3, 64, device=DEV)
    with pytest.raises(ValueError, match=r"expects \(2, 64\)"):
        lora.add_rmsnorm_shrink(x, None, torch.ones(64, device=DEV), 1e-6, sh)
    with pytest.raises(ValueError, match="output shape"):
        lora.expand_(sh, [torch.zeros(2, 31, device=DEV)])


@pytest.mark.parametrize("arch,targets", [
    ("qwen2", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    ("qwen2", ["v_proj", "up_proj", "o_proj"]),
    ("qwen3", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])])
def test_fused_engine_lora_shrink_in_producers(monkeypatch, arch, targets):
    """HFQ_ROLLOUT_FUSE_LORA=1: the LoRA shrinks run inside the norm, attention-combine and SiLU*mul kernels and
    generation is still transformers' greedy, also after in-place LoRA / norm updates."""
    from peft import LoraConfig, get_peft_model

    monkeypatch.setenv("HFQ_ROLLOUT_FUSE_LORA", "1")
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    pm = get_peft_model(tiny_model(arch, seed=6), cfg).to(DEV).eval()
    eng = RolloutEngine(pm, max_batch=4, max_seq_len=40, kv_block=16, fused_kernels=True, graph_mode="eager")
    assert eng.adapter.fuse_lora and eng.adapter.qk_norm == (arch == "qwen3")
    calls = {"norm": 0, "silu": 0, "attn": 0, "rope": 0, "lora_add_": 0, "expand_": 0}
    for name, key in (("add_rmsnorm_shrink", "norm"), ("silu_mul_lora", "silu"), ("lora_add_", "lora_add_"),
                      ("expand_", "expand_")):
        fn = getattr(lora, name)
        monkeypatch.setattr(lora, name, lambda *a, _f=fn, _k=key, **kw: (calls.__setitem__(_k, calls[_k] + 1),
                                                                          _f(*a, **kw))[1])
    for name, key, arg in (("decode_attention", "attn", "shrink"), ("rope_kv_write", "rope", "lora")):
        fn = getattr(K, name)
        monkeypatch.setattr(K, name, lambda *a, _f=fn, _k=key, _a=arg, **kw: (
            calls.__setitem__(_k, calls[_k] + (kw.get(_a) is not None)), _f(*a, **kw))[1])
    out = eng.generate(PROMPTS, max_new_tokens=6, temperature=0, eos_token_ids=[])
    assert torch.equal(out.completion_ids.cpu(), hf_greedy(pm, PROMPTS, 6))
    steps = len(eng.adapter.layers) * 5  # layers x decode steps
    # per layer and step: both norms shrink, the combine shrinks o, RoPE expands q/k/v, SiLU*mul expands gate/up
    # (and shrinks down); the expands left as launches: o_proj's, and down_proj's when it has an adapter
    # (with q/k norms between, q/k/v's expands stay one launch)
    qk = arch == "qwen3"
    assert calls["norm"] == 2 * steps and calls["attn"] == calls["silu"] == steps
    assert calls["rope"] == (0 if qk else steps)
    assert calls["expand_"] == steps * (("down_proj" in targets) + 1 + qk)
    assert calls["lora_add_"] == 0
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n or "lora_A" in n:
                p.add_(torch.randn(p.shape, generator=g).to(DEV) * 0.5)
            if "layernorm" in n:
                p.add_(torch.randn(p.shape, generator=g).to(DEV) * 0.3)
    out2 = eng.generate(PROMPTS, max_new_tokens=6, temperature=0, eos_token_ids=[])
    assert torch.equal(out2.completion_ids.cpu(), hf_greedy(pm, PROMPTS, 6))
    assert not torch.equal(out2.completion_ids, out.completion_ids)


def test_fused_lora_split_count_and_bad_value(monkeypatch):
    """HFQ_ROLLOUT_LORA_SPLITS sets the K split of the fused norm / SiLU*mul kernels (same tokens); a bad value is
    refused naming the variable."""
    from peft import LoraConfig, get_peft_model

    monkeypatch.setenv("HFQ_ROLLOUT_FUSE_LORA", "1")
    monkeypatch.setenv("HFQ_ROLLOUT_LORA_SPLITS", "5")
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
                     init_lora_weights=False)
    pm = get_peft_model(tiny_model("qwen2", seed=7), cfg).to(DEV).eval()
    eng = RolloutEngine(pm, max_batch=4, max_seq_len=40, kv_block=16, fused_kernels=True, graph_mode="eager")
    assert eng.adapter.lora_splits == 5
    seen = []

    class Recorded(lora.Shrink):
        def __init__(self, *a, **kw):
            seen.append(kw)
            super().__init__(*a, **kw)

    monkeypatch.setattr(lora, "Shrink", Recorded)
    out = eng.generate(PROMPTS, max_new_tokens=4, temperature=0, eos_token_ids=[])
    assert torch.equal(out.completion_ids.cpu(), hf_greedy(pm, PROMPTS, 4))
    assert seen and all(kw == {"n_splits": 5} for kw in seen)
    monkeypatch.setenv("HFQ_ROLLOUT_LORA_SPLITS", "many")
    with pytest.raises(ValueError, match="HFQ_ROLLOUT_LORA_SPLITS"):
        RolloutEngine(pm, max_batch=4, max_seq_len=40, kv_block=16, fused_kernels=True, graph_mode="eager")


_LORA_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hfq_kernels import lora as L
from hfq_kernels import rollout as R

T = GPUTarget("cuda", 90, 32)
def comp(fn, sig, consts, warps=4):
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=T, options={"num_warps": warps})
    return "mma" in k.asm["ptx"] or "wgmma" in k.asm["ptx"]

bf = "*bf16"
i = "i32"
f = "fp32"
out = []
sig = dict(x_ptr=bf, r_ptr=bf, w_ptr=bf, y_ptr=bf, s_ptr=bf, a0=bf, a1=bf, a2=bf, p_ptr="*fp32", M=i, H=i, R=i,
           eps=f, sx=i, sr=i, sy=i, ss=i, sa0=i, sa1=i, sa2=i, k_per_split=i, n_splits=i)
out.append(comp(L._add_rmsnorm_shrink_kernel, sig,
                dict(HAS_RES=True, NA=3, IEEE=False, BM=16, BR=32, BK=64, VB=512), warps=8))
sig = dict(g_ptr=bf, u_ptr=bf, o_ptr=bf, a0=bf, p_ptr="*fp32", up_ptr="*fp32", bg_ptr=bf, bu_ptr=bf, M=i, N=i, R=i,
           RU=i, sg=i, su=i, so=i, sa0=i, sbg=i, sbu=i, k_per_split=i, n_splits=i, slot_g=i,
           slot_u=i, scale_g=f, scale_u=f)
out.append(comp(L._silu_mul_lora_kernel, sig,
                dict(UPS=14, EG=True, EU=True, SHRINK=True, IEEE=False, BM=16, BR=32, BRU=32, BK=64)))
sig = dict(q_ptr=bf, k_ptr=bf, v_ptr=bf, cos_ptr=bf, sin_ptr=bf, qo_ptr=bf, kc_ptr=bf, vc_ptr=bf, col_ptr="*i64",
           sq=i, sk=i, sv=i, sc=i, ssn=i, kc_b=i, kc_h=i, kc_s=i, vc_b=i, vc_h=i, vc_s=i, p_ptr="*fp32",
           n_splits=i, R=i, bq=bf, bk=bf, bv=bf, sbq=i, sbk=i, sbv=i, slot_q=i, slot_k=i, slot_v=i, scq=f, sck=f,
           scv=f)
out.append(comp(R._rope_kv_kernel, sig, dict(NH=28, HD=128, HALF=64, BH=64, EQ=True, EK=True, EV=True, BM=16,
                                              BR=32, BS=16), warps=1) or True)
sig = dict(m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", o_ptr=bf, n_splits=i, so=i, a_ptr=bf, p_ptr="*fp32",
           R=i, sa=i)
out.append(comp(R._attn_combine_kernel, sig, dict(NH=28, NKV=4, G=7, GP=16, HD=128, BD=128, BS=16, LORA=True,
                                                   BM=16, BR=32), warps=2) or True)
sig = dict(p_ptr="*fp32", b0=bf, b1=bf, b2=bf, y0=bf, y1=bf, y2=bf, s0=f, s1=f, s2=f, n0=i, n1=i, n2=i, sb0=i,
           sb1=i, sb2=i, sy0=i, sy1=i, sy2=i, M=i, R=i, nb0=i, nb1=i)
out.append(comp(L._expand_kernel, sig, dict(NS=28, IEEE=False, BM=16, BR=32, BN=64)))
print(" ".join(str(x) for x in out))
"""


def test_fused_lora_kernels_compile_for_sm90():
    """The fused LoRA variants (norm + shrink of 3 adapters, SiLU*mul with gate/up expands and down's shrink, RoPE with
    q/k/v expands, attention combine with o's shrink) and the expand summing 28 partials (o_proj's, one per head)
    compile for an H100 at 7B-like constants, with tensor-core MMAs where they multiply tiles: the interpreter does
    not check GPU layouts or dot shapes. Compiles only; no GPU needed."""
    assert compile_for_sm90(_LORA_SM90) == ["True"] * 5
