"""Fused decode-step kernels for the rollout engine (Triton), each with its torch reference.

One decode step of a Llama-family block, besides its linears, is 6 kernels here instead of ~35 small ones
(HF RMSNorm's casts, RoPE's slices and cats, residual adds, the KV index_copy, SDPA with a mask):

- `add_rmsnorm`: residual add + RMSNorm (HF numerics: fp32 variance, cast to the input dtype, times weight)
- `rope_kv_write`: RoPE on q and k, q written out, k and v written into the static cache at column `col`
- `decode_attention`: split-KV attention of one query token per row over cache columns
  [0, min(kv_len, col + 1)) with the engine's additive mask (GQA without copying K/V), plus a combine kernel
- `silu_mul`: SiLU(gate) * up
- `gumbel_sample`: temperature sampling (Gumbel-max with counter-based noise) and the token's log-prob

Norm weights and the cache are read through their pointers on every launch, so in-place updates (AQN noise,
optimizer steps) are seen by captured CUDA graphs. Counter-based noise (`mix32`, `row_keys`, `uniform_noise`):
a hash of (row key, step, vocab index), identical on CPU and GPU, graph-safe (the step counter lives on the device).
On CPU the kernels run only under TRITON_INTERPRET=1 (tests); otherwise the `*_ref` torch versions are used.
The engine calls the launchers directly inside captured CUDA graphs (no per-call dispatch); they are not model
code, so they are not torch.library ops.
"""
from __future__ import annotations

import torch

from hfq_kernels._triton import (HAS_TRITON, available, next_pow2, pdl_enter, pdl_meta, sm_count, tl,  # noqa: F401
                                 triton)


# ------------------------------------------------------------------------------------------ references
# counter-based noise (torch): the Triton sampler reproduces these bits
_M32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (lowbias32) on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32  # the product may wrap past 2^63; only its low 32 bits are kept
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor) -> torch.Tensor:
    """Two independent 32-bit keys per row [B, 2] from int64 per-row seeds (row index already mixed in)."""
    lo = seeds & _M32
    hi = (seeds >> 32) & _M32
    a = mix32(lo ^ mix32(hi + 0x9E3779B9))
    b = mix32(a ^ 0x632BE5AB)
    return torch.stack([a, b], dim=-1)


def uniform_noise(keys: torch.Tensor, step: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """Uniform (0, 1) float32 noise [B, V] for `keys` [B, 2], a step counter [1] and vocab ids [V]."""
    s = mix32((step & _M32) ^ 0x2545F491)
    ka = mix32(keys[:, :1] ^ s)
    kb = mix32((keys[:, 1:] + s) & _M32)
    h = mix32(mix32(vocab_ids[None, :] ^ ka) ^ kb)
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def add_rmsnorm_ref(x, residual, weight, eps):
    """(norm(x + residual) * weight, x + residual); residual None: (norm(x) * weight, x). HF rounding."""
    s = x if residual is None else x + residual
    h = s.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(s.dtype), s


def rope_ref(x, cos, sin):
    """x * cos + rotate_half(x) * sin (HF's apply_rotary_pos_emb for one tensor)."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


def rope_kv_write_ref(q, k, v, cos, sin, k_cache, v_cache, col, n_heads, n_kv, head_dim):
    """q [b, nh*hd], k/v [b, nkv*hd], cos/sin [b, hd]; writes rotated k and v into cache column col[0]
    (cache [B, nkv, S, hd], rows [0, b)); returns rotated q [b, nh, hd]."""
    b = q.shape[0]
    q = q.reshape(b, n_heads, head_dim)
    k = k.reshape(b, n_kv, head_dim)
    c, s = cos[:, None], sin[:, None]
    qr = rope_ref(q, c, s)
    kr = rope_ref(k, c, s)
    k_cache[:b].index_copy_(2, col, kr[:, :, None])
    v_cache[:b].index_copy_(2, col, v.reshape(b, n_kv, 1, head_dim))
    return qr


def decode_attention_ref(q, k_cache, v_cache, mask, kv_len, scaling):
    """q [b, nh, hd]; attends to cache columns [0, kv_len) with the additive mask [b, >= kv_len];
    returns [b, nh*hd]."""
    b, nh, hd = q.shape
    n_kv = k_cache.shape[1]
    qg = q.reshape(b, n_kv, nh // n_kv, hd)
    o = torch.nn.functional.scaled_dot_product_attention(
        qg, k_cache[:b, :, :kv_len], v_cache[:b, :, :kv_len], attn_mask=mask[:b, None, None, :kv_len],
        scale=scaling)
    return o.reshape(b, nh * hd)


def silu_mul_ref(gate, up):
    """SiLU(gate) * up."""
    return torch.nn.functional.silu(gate) * up


def gumbel_sample_ref(logits, temperature, keys, step, vocab_ids, want_logprobs):
    """Gumbel-max draw from softmax(logits / temperature) with `uniform_noise` (plain temperature sampling, no
    top-k/top-p/min-p); returns (token [b], log-prob [b] or None)."""
    x = logits.float() / temperature
    u = uniform_noise(keys, step, vocab_ids)
    tok = (x - torch.log(-torch.log(u))).argmax(-1)
    lp = x.gather(1, tok[:, None])[:, 0] - torch.logsumexp(x, dim=-1) if want_logprobs else None
    return tok, lp


# ------------------------------------------------------------------------------------------ kernels
@triton.jit
def _safe_max(m):
    """m, with -inf (nothing seen yet) replaced by 0 so exp(x - m) stays finite."""
    return tl.where(m == float("-inf"), 0.0, m)



@triton.jit
def _add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, H, eps, sx, sr, sy, ss,
                        HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < H
    x = tl.load(x_ptr + row * sx + offs, mask=m, other=0.0)
    dt = x.dtype
    if HAS_RES:
        r = tl.load(r_ptr + row * sr + offs, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(s_ptr + row * ss + offs, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    y = w * (xf * rstd).to(dt).to(tl.float32)
    tl.store(y_ptr + row * sy + offs, y.to(dt), mask=m)

@triton.jit
def _rope_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qo_ptr, kc_ptr, vc_ptr, col_ptr,
                    sq, sk, sv, sc, ssn, kc_b, kc_h, kc_s, vc_b, vc_h, vc_s,
                    NH: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr, BH: tl.constexpr,
                    PDL: tl.constexpr = False):
    pdl_enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BH)
    dm = d < HALF
    c1 = tl.load(cos_ptr + b * sc + d, mask=dm, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + b * sc + HALF + d, mask=dm, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + b * ssn + d, mask=dm, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + b * ssn + HALF + d, mask=dm, other=0.0).to(tl.float32)
    if h < NH:
        src = q_ptr + b * sq + h * HD
    else:
        src = k_ptr + b * sk + (h - NH) * HD
    x1 = tl.load(src + d, mask=dm, other=0.0)
    x2 = tl.load(src + HALF + d, mask=dm, other=0.0)
    dt = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product rounded to the model dtype as in HF
    o1 = ((x1 * c1).to(dt).to(tl.float32) + (-(x2 * s1)).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
    if h < NH:
        dst = qo_ptr + (b * NH + h) * HD
        tl.store(dst + d, o1, mask=dm)
        tl.store(dst + HALF + d, o2, mask=dm)
    else:
        j = h - NH
        col = tl.load(col_ptr)
        dk = kc_ptr + b * kc_b + j * kc_h + col * kc_s
        tl.store(dk + d, o1, mask=dm)
        tl.store(dk + HALF + d, o2, mask=dm)
        dv = vc_ptr + b * vc_b + j * vc_h + col * vc_s
        vs = v_ptr + b * sv + j * HD
        tl.store(dv + d, tl.load(vs + d, mask=dm, other=0.0), mask=dm)
        tl.store(dv + HALF + d, tl.load(vs + HALF + d, mask=dm, other=0.0), mask=dm)

@triton.jit
def _partial_index(bh, sp, n_splits, GP: tl.constexpr):
    """First entry of split sp of bh = row * NKV + kv head in the split-KV partials (m, l: [B * NKV, splits, GP];
    acc: the same rows times BD), written by _attn_partial_kernel and reduced by _attn_combine_kernel."""
    return (bh * n_splits + sp) * GP


@triton.jit
def _attn_partial_kernel(q_ptr, kc_ptr, vc_ptr, mask_ptr, col_ptr, m_ptr, l_ptr, acc_ptr,
                         kv_len, chunk, scale, n_splits,
                         kc_b, kc_h, kc_s, vc_b, vc_h, vc_s, mk_b,
                         NKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr,
                         BD: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    bh = tl.program_id(0)  # row * NKV + kv head
    sp = tl.program_id(1)
    b = bh // NKV
    j = bh % NKV
    g = tl.arange(0, GP)
    d = tl.arange(0, BD)
    gm = g < G
    dm = d < HD
    q = tl.load(q_ptr + ((b * NKV + j) * G + g[:, None]) * HD + d[None, :], mask=gm[:, None] & dm[None, :],
                other=0.0)
    n_valid = tl.minimum(kv_len, tl.load(col_ptr) + 1)
    lo = sp * chunk
    hi = tl.minimum(lo + chunk, n_valid)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, BD], tl.float32)
    kb = kc_ptr + b * kc_b + j * kc_h
    vb = vc_ptr + b * vc_b + j * vc_h
    for start in range(lo, hi, BN):
        cols = start + tl.arange(0, BN)
        cm = cols < hi
        k = tl.load(kb + cols[:, None] * kc_s + d[None, :], mask=cm[:, None] & dm[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        am = tl.load(mask_ptr + b * mk_b + cols, mask=cm, other=float("-inf")).to(tl.float32)
        s = s * scale + am[None, :]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = _safe_max(m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vb + cols[:, None] * vc_s + d[None, :], mask=cm[:, None] & dm[None, :], other=0.0)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    base = _partial_index(bh, sp, n_splits, GP)
    tl.store(m_ptr + base + g, m_i)
    tl.store(l_ptr + base + g, l_i)
    tl.store(acc_ptr + (base + g[:, None]) * BD + d[None, :], acc)

@triton.jit
def _attn_combine_kernel(m_ptr, l_ptr, acc_ptr, o_ptr, n_splits, so,
                         NH: tl.constexpr, NKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                         HD: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    j = h // G
    gi = h % G
    sp = tl.arange(0, BS)
    d = tl.arange(0, BD)
    sm = sp < n_splits
    base = _partial_index(b * NKV + j, sp, n_splits, GP) + gi
    m = tl.load(m_ptr + base, mask=sm, other=float("-inf"))
    l = tl.load(l_ptr + base, mask=sm, other=0.0)
    mx = tl.max(m, axis=0)
    w = tl.exp(m - mx)
    acc = tl.load(acc_ptr + base[:, None] * BD + d[None, :], mask=sm[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(o_ptr + b * so + h * HD + d, out.to(o_ptr.dtype.element_ty), mask=d < HD)

@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, o_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(g_ptr + offs, mask=m, other=0.0)
    dt = g.dtype
    gf = g.to(tl.float32)
    a = (gf / (1.0 + tl.exp(-gf))).to(dt).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + offs, (a * u).to(dt), mask=m)


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)

@triton.jit
def _gumbel_partial_kernel(x_ptr, t_ptr, keys_ptr, step_ptr, best_ptr, arg_ptr, mx_ptr, se_ptr, V, sx, chunk,
                           n_parts, LP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    step = tl.load(step_ptr).to(tl.uint32)
    s = _mix32(step ^ 0x2545F491)
    ka = _mix32(tl.load(keys_ptr + row * 2).to(tl.uint32) ^ s)
    kb = _mix32(tl.load(keys_ptr + row * 2 + 1).to(tl.uint32) + s)
    t = tl.load(t_ptr + row)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    arg = tl.zeros([BLOCK], tl.int32)
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    se = tl.zeros([BLOCK], tl.float32)
    lo = part * chunk
    for start in range(lo, lo + chunk, BLOCK):
        v = start + tl.arange(0, BLOCK)
        vm = v < V
        x = tl.load(x_ptr + row * sx + v, mask=vm, other=float("-inf")).to(tl.float32) / t
        h = _mix32(_mix32(v.to(tl.uint32) ^ ka) ^ kb)
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        g = x - tl.log(-tl.log(u))
        g = tl.where(vm, g, float("-inf"))
        take = g > best
        best = tl.where(take, g, best)
        arg = tl.where(take, v, arg)
        if LP:
            m_new = tl.maximum(mx, x)
            m_safe = _safe_max(m_new)
            se = se * tl.exp(mx - m_safe) + tl.exp(x - m_safe)
            mx = m_new
    b = tl.max(best, axis=0)
    a = tl.min(tl.where(best == b, arg, 2147483647), axis=0)  # first index among ties, like argmax
    tl.store(best_ptr + row * n_parts + part, b)
    tl.store(arg_ptr + row * n_parts + part, a)
    if LP:
        m = tl.max(mx, axis=0)
        m_safe = _safe_max(m)
        tl.store(mx_ptr + row * n_parts + part, m)
        tl.store(se_ptr + row * n_parts + part, tl.sum(se * tl.exp(mx - m_safe), axis=0))

@triton.jit
def _gumbel_final_kernel(x_ptr, t_ptr, best_ptr, arg_ptr, mx_ptr, se_ptr, tok_ptr, lp_ptr, sx, n_parts,
                         LP: tl.constexpr, BP: tl.constexpr):
    row = tl.program_id(0)
    p = tl.arange(0, BP)
    pm = p < n_parts
    best = tl.load(best_ptr + row * n_parts + p, mask=pm, other=float("-inf"))
    arg = tl.load(arg_ptr + row * n_parts + p, mask=pm, other=2147483647)
    b = tl.max(best, axis=0)
    tok = tl.min(tl.where(best == b, arg, 2147483647), axis=0)
    tl.store(tok_ptr + row, tok.to(tl.int64))
    if LP:
        mx = tl.load(mx_ptr + row * n_parts + p, mask=pm, other=float("-inf"))
        se = tl.load(se_ptr + row * n_parts + p, mask=pm, other=0.0)
        m = tl.max(mx, axis=0)
        lse = m + tl.log(tl.sum(se * tl.exp(mx - m), axis=0))
        x = tl.load(x_ptr + row * sx + tok).to(tl.float32) / tl.load(t_ptr + row)
        tl.store(lp_ptr + row, x - lse)


# ------------------------------------------------------------------------------------------ launchers
def add_rmsnorm(x, residual, weight, eps):
    """x, residual: [rows, H] (last dim contiguous); returns (normed, x + residual or x)."""
    H = x.shape[-1]
    x2 = x.reshape(-1, H)
    rows = x2.shape[0]
    y = torch.empty_like(x2)
    if residual is None:
        s, r2, s_out = x, x2, x2
    else:
        r2 = residual.reshape(-1, H)
        s_out = torch.empty_like(x2)
        s = s_out.view(x.shape)
    block = next_pow2(H)
    _add_rmsnorm_kernel[(rows,)](x2, r2, weight, y, s_out, H, float(eps), x2.stride(0), r2.stride(0),
                                 y.stride(0), s_out.stride(0), HAS_RES=residual is not None, BLOCK=block,
                                 num_warps=max(1, min(16, block // 256)), **pdl_meta(x2.device))
    return y.view(x.shape), s


def rope_kv_write(q, k, v, cos, sin, k_cache, v_cache, col, n_heads, n_kv, head_dim):
    """See rope_kv_write_ref. q/k/v: [b, heads*hd] (last dim contiguous)."""
    b = q.shape[0]
    q2, k2, v2 = q.reshape(b, -1), k.reshape(b, -1), v.reshape(b, -1)
    cos2, sin2 = cos.reshape(b, -1), sin.reshape(b, -1)
    qo = torch.empty((b, n_heads, head_dim), dtype=q.dtype, device=q.device)
    half = head_dim // 2
    _rope_kv_kernel[(b, n_heads + n_kv)](
        q2, k2, v2, cos2, sin2, qo, k_cache, v_cache, col, q2.stride(0), k2.stride(0), v2.stride(0),
        cos2.stride(0), sin2.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NH=n_heads, HD=head_dim, HALF=half, BH=next_pow2(half), num_warps=1, **pdl_meta(q.device))
    return qo


def _splits(b, n_kv, kv_len, block_n, target_programs):
    """Columns per split (a multiple of block_n) so that b * n_kv * splits reaches target_programs."""
    want = max(1, -(-target_programs // (b * n_kv)))
    chunk = max(block_n, -(-kv_len // want))
    chunk = -(-chunk // block_n) * block_n
    return chunk, -(-kv_len // chunk)


def decode_attention(q, k_cache, v_cache, mask, col, kv_len, scaling, block_n=None):
    """q [b, nh, hd] (contiguous); attends to cache columns [0, min(kv_len, col + 1)) of rows [0, b) with the
    additive mask [b, >= kv_len] (last dim contiguous); returns [b, nh*hd] in q's dtype."""
    b, nh, hd = q.shape
    n_kv = k_cache.shape[1]
    G = nh // n_kv
    GP = max(16, next_pow2(G))
    BD = max(16, next_pow2(hd))
    if block_n is None:
        block_n = 64 if BD <= 128 else 32
    chunk, n_splits = _splits(b, n_kv, kv_len, block_n, 2 * sm_count(q.device))
    dev = q.device
    m = torch.empty((b * n_kv * n_splits * GP,), dtype=torch.float32, device=dev)
    l = torch.empty_like(m)
    acc = torch.empty((b * n_kv * n_splits * GP, BD), dtype=torch.float32, device=dev)
    ieee = q.dtype == torch.float32
    _attn_partial_kernel[(b * n_kv, n_splits)](
        q, k_cache, v_cache, mask, col, m, l, acc, int(kv_len), chunk, float(scaling), n_splits,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), mask.stride(0),
        NKV=n_kv, G=G, GP=GP, HD=hd, BD=BD, BN=block_n, IEEE=ieee, num_warps=4, num_stages=2, **pdl_meta(dev))
    o = torch.empty((b, nh * hd), dtype=q.dtype, device=dev)
    _attn_combine_kernel[(b, nh)](m, l, acc, o, n_splits, o.stride(0), NH=nh, NKV=n_kv, G=G, GP=GP, HD=hd, BD=BD,
                                  BS=max(2, next_pow2(n_splits)), num_warps=2, **pdl_meta(dev))
    return o


def silu_mul(gate, up):
    """SiLU(gate) * up for contiguous gate/up of one dtype."""
    out = torch.empty_like(gate)
    n = gate.numel()
    block = 1024
    _silu_mul_kernel[(triton.cdiv(n, block),)](gate, up, out, n, BLOCK=block, num_warps=4, **pdl_meta(gate.device))
    return out


def gumbel_sample(logits, temperature, keys, step, want_logprobs, block=1024):
    """Triton version of `gumbel_sample_ref` (same noise bits): logits [b, V] (last dim contiguous),
    temperature [b, 1] float32, keys [b, 2] int64 (< 2^32), step [1] int64."""
    b, V = logits.shape
    n_parts = max(1, min(64, triton.cdiv(V, 8 * block)))
    chunk = triton.cdiv(triton.cdiv(V, n_parts), block) * block
    n_parts = triton.cdiv(V, chunk)
    dev = logits.device
    best = torch.empty((b, n_parts), dtype=torch.float32, device=dev)
    arg = torch.empty((b, n_parts), dtype=torch.int32, device=dev)
    mx = torch.empty((b, n_parts), dtype=torch.float32, device=dev) if want_logprobs else best
    se = torch.empty((b, n_parts), dtype=torch.float32, device=dev) if want_logprobs else best
    t = temperature.reshape(b).float().contiguous()
    keys = keys.contiguous()
    _gumbel_partial_kernel[(b, n_parts)](logits, t, keys, step, best, arg, mx, se, V, logits.stride(0), chunk,
                                         n_parts, LP=want_logprobs, BLOCK=block, num_warps=4)
    tok = torch.empty(b, dtype=torch.long, device=dev)
    lp = torch.empty(b, dtype=torch.float32, device=dev) if want_logprobs else None
    _gumbel_final_kernel[(b,)](logits, t, best, arg, mx, se, tok, lp if lp is not None else best, logits.stride(0),
                               n_parts, LP=want_logprobs, BP=max(2, next_pow2(n_parts)), num_warps=1)
    return tok, lp
