"""Fused rollout decode kernels (hfq_kernels.rollout, .lora, .skinny_gemm; Triton, on CPU under TRITON_INTERPRET=1)
against their torch references, and the engine's fused decode path against transformers' generate."""
import pytest
import torch
import triton

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else []))
@pytest.mark.parametrize("rows,split,widths,bias", [(1, 1, (48,), False), (8, 3, (96, 40, 130), True),
                                                    (5, 19, (33, 70), False), (13, 2, (200,), True)])
def test_expand_with_the_split_k_reduce_folded_in_is_bit_identical(rows, split, widths, bias, dtype):
    """expand_(base=...) writes the base linear's split-K reduce plus the LoRA update in one launch: the same bits
    as nvfp4_matmul's reduce kernel (per member, or grouped) followed by expand_, and the torch reference's values.
    bf16 on CUDA only: the interpreter's bf16 dot returns garbage (for both sides alike)."""
    from hfq_kernels import nvfp4_matmul as MM

    g = torch.Generator().manual_seed(rows * 31 + split)
    k = 96
    x = torch.randn(rows, k, generator=g).to(DEV, dtype)
    plans = _plans(g, k, 8, widths, dtype)
    parts = [torch.randn(split, rows, n, generator=g).to(DEV) for n in widths]
    biases = [torch.randn(n, generator=g).to(DEV, dtype) if bias else None for n in widths]
    sh = lora.Shrink(plans, rows, k, DEV, n_splits=2)
    lora.shrink_(x, sh)
    want = []
    for q, b, n in zip(parts, biases, widths):
        y = torch.empty(rows, n, dtype=dtype, device=DEV)
        MM._splitk_reduce_kernel[(triton.cdiv(rows * n, 1024),)](q, b if bias else q, y, rows, n, split, n,
                                                                 HAS_BIAS=bias, BLOCK=1024)
        want.append(y)
    lora.expand_(sh, want, block_n=32)
    got = [torch.full((rows, n), float("nan"), dtype=dtype, device=DEV) for n in widths]
    lora.expand_(sh, got, block_n=32, base=(parts, split, biases))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # torch reference: the partials summed in split order (+ bias), cast, then PEFT's LoRA update
    ref = [(q.sum(0) + (b.float() if bias else 0)).to(dtype) for q, b in zip(parts, biases)]
    lora.lora_add_ref(x, ref, plans)
    for a, r in zip(got, ref):
        assert rel(a.float(), r.float()) < (1e-5 if dtype == torch.float32 else 1e-2)
    with pytest.raises(ValueError, match="base partials must be contiguous float32"):
        lora.expand_(sh, got, base=([q[:, :, :-1] for q in parts], split, biases))
    with pytest.raises(ValueError, match="biases must be all None or contiguous"):
        lora.expand_(sh, got, base=(parts, split, [torch.zeros(3, device=DEV)] * len(widths)))


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
    with pytest.raises(ValueError, match="output shape"):
        lora.expand_(sh, [torch.zeros(2, 31, device=DEV)])


_LORA_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hfq_kernels import lora as L

bf = "*bf16"
i = "i32"
f = "fp32"
sig = dict(p_ptr="*fp32", b0=bf, b1=bf, b2=bf, y0=bf, y1=bf, y2=bf, s0=f, s1=f, s2=f, n0=i, n1=i, n2=i, sb0=i,
           sb1=i, sb2=i, sy0=i, sy1=i, sy2=i, q0="*fp32", q1="*fp32", q2="*fp32", c0=bf, c1=bf, c2=bf, M=i, R=i,
           nb0=i, nb1=i)
for qs in (0, 19):  # plain expand; with the base linear's 19-way split-K reduce folded in
    k = triton.compile(ASTSource(fn=L._expand_kernel, signature=sig, constexprs=dict(NS=16, IEEE=False, BM=16,
                                                                                      BR=32, BN=64, QS=qs,
                                                                                      HAS_BIAS=qs > 0)),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    print("mma" in k.asm["ptx"] or "wgmma" in k.asm["ptx"])
"""


def test_lora_expand_compiles_for_sm90():
    """The LoRA expand summing 16 K-split partials (unrolled) compiles for an H100 with tensor-core MMAs: the
    interpreter does not check GPU layouts or dot shapes. Compiles only; no GPU needed."""
    assert compile_for_sm90(_LORA_SM90) == ["True", "True"]


_PDL_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hfq_kernels import lora as L, nvfp4_matmul as MM, rollout as R

def first_wait(fn, sig, consts, warps=4):
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=dict(consts, PDL=True)),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "launch_pdl": True})
    ptx = k.asm["ptx"]
    w = ptx.find("griddepcontrol.wait")
    ok = (k.metadata.launch_pdl and 0 <= w < ptx.index("griddepcontrol.launch_dependents")
          and w < ptx.index("ld.global") and w < ptx.index("st.global"))
    print(fn.__name__, ok)

i32, bf16, f32 = "i32", "*bf16", "*fp32"
first_wait(R._add_rmsnorm_kernel, dict(x_ptr=bf16, r_ptr=bf16, w_ptr=bf16, y_ptr=bf16, s_ptr=bf16, H=i32, eps="fp32",
           sx=i32, sr=i32, sy=i32, ss=i32), dict(HAS_RES=True, BLOCK=4096), 16)
first_wait(R._silu_mul_kernel, dict(g_ptr=bf16, u_ptr=bf16, o_ptr=bf16, n=i32), dict(BLOCK=1024))
first_wait(MM._splitk_reduce_kernel, dict(p_ptr=f32, b_ptr=bf16, y_ptr=bf16, M=i32, N=i32, SPLIT=i32, stride_ym=i32),
           dict(HAS_BIAS=True, BLOCK=1024))
first_wait(L._shrink_kernel, dict(x_ptr=bf16, a0=bf16, a1=bf16, a2=bf16, p_ptr=f32, M=i32, K=i32, R=i32, sxm=i32,
           sa0=i32, sa1=i32, sa2=i32, k_per_split=i32, n_splits=i32), dict(IEEE=False, BM=16, BR=32, BK=64))
"""


def test_pdl_kernels_wait_before_touching_memory_sm90():
    """With PDL on, the decode kernels (compiled for sm_90, no GPU needed) wait for the kernel before them ahead of
    their first global load and store, and only then let the next kernel launch."""
    out = compile_for_sm90(_PDL_SM90)
    assert out == ["_add_rmsnorm_kernel", "True", "_silu_mul_kernel", "True",
                   "_splitk_reduce_kernel", "True", "_shrink_kernel", "True"], out
