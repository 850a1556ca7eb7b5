"""A static-KV-cache forward for Llama-family decoders (Qwen2, Qwen3, Llama, Mistral).

It calls the model's own submodules (norms, projections, MLPs, rotary embedding, lm_head), so
quantized linears (hfq NVFP4, bitsandbytes), PEFT LoRA wrappers (unmerged) and in-place weight
changes (LoRA updates, AQN noise on norm weights) are used as they are; only attention and the
KV cache are ours, so a decode step has fixed shapes and no host synchronisation (graph-safe).

With `fused=True` (CUDA, or CPU under TRITON_INTERPRET=1) a decode step runs the norms, RoPE + KV write,
attention and SiLU*mul as the Triton kernels of `hfq_kernels.rollout`, reading the norm weights where they
live, runs hfq NVFP4 q/k/v and gate/up as one grouped Gluon launch each, and applies unmerged LoRA with one
shrink + one expand kernel per group of linears sharing an input (`hfq_kernels.lora`; q/k/v, gate/up, o, down);
any module it does not recognise (custom norms, hooks, DoRA, dropout in training, ...) is called as the model's
own module. An NVFP4 linear takes part in the fused launches through its public `decode_operands(x2)` (a duck-typed
protocol: this package does not import hfq.nvfp4).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hfq_kernels import _triton
from hfq_kernels import lora as _lora
from hfq_kernels import lora_nvfp4 as _nv
from hfq_kernels import rollout as K
from hfq_kernels import skinny_gemm as _gemm
from hfq_kernels.rollout import rope_ref as _rope

SUPPORTED_ARCHS = ("qwen2", "qwen3", "llama", "mistral")


def unwrap_causal_lm(model):
    """The transformers causal LM under PEFT / accelerate wrappers."""
    m = model
    for _ in range(4):
        if hasattr(m, "get_base_model"):  # PeftModel
            m = m.get_base_model()
        elif hasattr(m, "module") and isinstance(m.module, torch.nn.Module):  # DDP-like
            m = m.module
        else:
            break
    return m


def _rmsnorms() -> tuple:
    """transformers' RMSNorm classes of the supported architectures (weight * normalize(x), HF numerics)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    return Qwen2RMSNorm, Qwen3RMSNorm, LlamaRMSNorm, MistralRMSNorm


def _silus() -> tuple:
    """The SiLU activation modules the fused SiLU*mul kernel stands in for."""
    import transformers.activations as acts

    return (torch.nn.SiLU,) + ((acts.SiLUActivation,) if hasattr(acts, "SiLUActivation") else ())


def _has_hooks(mod) -> bool:
    return bool(mod._forward_hooks or mod._forward_pre_hooks or getattr(mod, "_forward_hooks_with_kwargs", None))


def _lora_plan(mod, x):
    """[(A weight, B weight, scale), ...] when `mod` is an unmerged PEFT LoRA layer whose forward is exactly
    base(x) + sum scale * B(A(x)) (eval-mode dropout, no DoRA / bias / variants, weights in x's dtype);
    None otherwise (then the module itself is called)."""
    if not all(hasattr(mod, n) for n in ("base_layer", "lora_A", "lora_B", "scaling", "active_adapters")):
        return None
    if getattr(mod, "disable_adapters", False) or getattr(mod, "merged", False) or _has_hooks(mod):
        return None
    if mod.training or x.dim() < 2:
        return None
    plan = []
    for name in mod.active_adapters:
        if name not in mod.lora_A:
            continue
        a, b = mod.lora_A[name], mod.lora_B[name]
        if not (type(a) is torch.nn.Linear and type(b) is torch.nn.Linear) or a.bias is not None or b.bias is not None:
            return None
        if getattr(mod, "use_dora", {}).get(name, False) or name in getattr(mod, "lora_variant", {}):
            return None
        drop = mod.lora_dropout[name] if name in getattr(mod, "lora_dropout", {}) else None
        if drop is not None and not isinstance(drop, torch.nn.Identity) and drop.training:
            return None
        if a.weight.dtype != x.dtype or b.weight.dtype != x.dtype or _has_hooks(a) or _has_hooks(b):
            return None
        scale = mod.scaling[name]
        if not isinstance(scale, (int, float)):
            return None
        plan.append((a.weight, b.weight, float(scale)))
    return plan


@dataclass
class DecodeFusions:
    """The fused decode step's optional fusions, each on by default (measured faster on the H100, 7B-shaped, batch
    8) and, off, replaced by separate launches giving the same bits (for A/B runs and tests).
    group_nvfp4: NVFP4 (g4) q/k/v and gate/up as one grouped Gluon launch each. lora_in_reduce: NVFP4 linears with
    LoRA get their split-K reduce done by the LoRA expand's launch. lora_stream: their LoRA shrink runs on a side
    stream, concurrent with the base GEMV, joined before the expand. pdl: programmatic dependent launch (sm_90+) in
    the engine's graph warm-up and capture (not combined with a forking lora_stream step: slower there)."""

    group_nvfp4: bool = True
    lora_in_reduce: bool = True
    lora_stream: bool = True
    pdl: bool = True


class DecoderAdapter:
    """Holds references to a causal LM's parts and runs prefill / decode against an external KV cache.

    fused_kernels ("auto": on CUDA where Triton runs, True, False): decode steps run the Triton kernels of
    hfq_kernels.rollout and the fusions of `fusions` (True on CPU needs TRITON_INTERPRET=1). skinny_gemm: with them
    on CUDA, plain BF16/FP16 nn.Linear at <= 16 rows through the skinny Triton GEMM (RolloutEngine's arguments)."""

    def __init__(self, model, max_seq_len: int, fused_kernels: bool | str = False, skinny_gemm: bool = False,
                 fusions: DecodeFusions | None = None):
        lm = unwrap_causal_lm(model)
        cfg = getattr(lm, "config", None)
        arch = getattr(cfg, "model_type", None)
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"model: architecture {arch!r} is not supported by the rollout engine; "
                             f"supported: {SUPPORTED_ARCHS}")
        inner = lm.model
        self.model = lm
        self.config = cfg
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = lm.lm_head
        attn = self.layers[0].self_attn
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = attn.head_dim
        self.groups = self.n_heads // self.n_kv
        self.scaling = attn.scaling
        self.qk_norm = hasattr(attn, "q_norm")
        rope_type = (getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
        rope_type = rope_type.get("rope_type", rope_type.get("type", "default")) if isinstance(rope_type, dict) else "default"
        if rope_type == "dynamic":
            raise ValueError("model: rope_type 'dynamic' recomputes frequencies from the sequence length "
                             "(a host decision per step) and is not supported by the rollout engine")
        windows = set()
        for i, layer in enumerate(self.layers):
            w = getattr(layer.self_attn, "sliding_window", None)
            if w is None and arch == "mistral":
                w = getattr(cfg, "sliding_window", None)
            if w is not None:
                windows.add(int(w))
        if windows and min(windows) < max_seq_len:
            raise ValueError(f"max_seq_len: {max_seq_len} exceeds the model's sliding window {min(windows)}; "
                             "sliding-window attention is not implemented by the rollout engine, use "
                             f"max_seq_len <= {min(windows)}")
        self.vocab_size = self.lm_head.out_features if hasattr(self.lm_head, "out_features") else cfg.vocab_size
        self.device = self.embed.weight.device
        with torch.no_grad():  # what the layers compute in: the embedding's output after its hooks (TRL's
            # cast_lm_head_to_fp32 makes a tied embedding's weight fp32 and casts its output back)
            self.dtype = self.embed(torch.zeros(1, dtype=torch.long, device=self.device)).dtype
        can_fuse = _triton.available(self.device)
        if fused_kernels is True and not can_fuse:
            raise ValueError(f"fused_kernels=True: the Triton kernels cannot run on {self.device} (need CUDA and "
                             "triton, or TRITON_INTERPRET=1 on CPU)")
        self.fused = can_fuse and (fused_kernels is True or (fused_kernels == "auto" and self.device.type == "cuda"))
        self.gemm = bool(skinny_gemm) and self.fused and self.device.type == "cuda"
        self.fusions = fusions if fusions is not None else DecodeFusions()
        self._norm_types, self._silu_types = _rmsnorms(), _silus()  # exact types: subclasses may compute otherwise
        # a step that forks LoRA shrinks onto the side stream is captured without programmatic dependent launch (the
        # engine reads `forked` after a warm-up): on the H100 the fork/join edges cost more than PDL saves there
        self._side = {}  # device -> the side stream
        self.forked = False  # set when a shrink is forked onto the side stream (the engine resets it)

    def drop_fused(self) -> None:
        """Decode with the model's own modules from now on (the engine's fallback when a fused kernel fails)."""
        self.fused = self.gemm = False

    def _qkv(self, attn, x, cos, sin):
        b, n, _ = x.shape
        q = attn.q_proj(x).view(b, n, self.n_heads, self.head_dim)
        k = attn.k_proj(x).view(b, n, self.n_kv, self.head_dim)
        v = attn.v_proj(x).view(b, n, self.n_kv, self.head_dim)
        if self.qk_norm:
            q = attn.q_norm(q)
            k = attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def _mlp_block(self, layer, h, attn_out):
        h = h + attn_out
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def prefill(self, ids, pos, key_mask, k_cache, v_cache, rows: slice):
        """Run the prompt [b, P] (left padded; key_mask bool [b, P]), write K/V into cache columns [0, P)
        of cache rows `rows`, and return the last position's hidden state [b, hidden]."""
        b, n = ids.shape
        causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
        eye = torch.eye(n, dtype=torch.bool, device=ids.device)
        # pad queries attend to themselves so no row is fully masked (a NaN would leak through V)
        allowed = ((causal[None] & key_mask[:, None, :]) | eye[None])[:, None]
        h = self.embed(ids)
        cos, sin = self.rotary(h, pos)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, k, v = self._qkv(attn, layer.input_layernorm(h), cos, sin)
            k_cache[i][rows, :, :n].copy_(k)
            v_cache[i][rows, :, :n].copy_(v)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scaling,
                                               enable_gqa=self.groups > 1)
            o = attn.o_proj(o.transpose(1, 2).reshape(b, n, self.n_heads * self.head_dim))
            h = self._mlp_block(layer, h, o)
        return self.norm(h[:, -1])

    def decode(self, ids, pos, col, add_mask, k_cache, v_cache, b: int, kv_len: int):
        """One token per row: ids/pos [b], write column `col` ([1] int64 on device), attend to columns
        [0, kv_len) with the additive mask [b, kv_len]. Returns the hidden state [b, hidden]."""
        if self.fused:
            return self.decode_fused(ids, pos, col, add_mask, k_cache, v_cache, b, kv_len)
        h = self.embed(ids[:, None])
        cos, sin = self.rotary(h, pos[:, None])
        mask = add_mask[:, None, None, :]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, k, v = self._qkv(attn, layer.input_layernorm(h), cos, sin)
            kc, vc = k_cache[i][:b], v_cache[i][:b]
            kc.index_copy_(2, col, k)
            vc.index_copy_(2, col, v)
            # GQA without copying K/V: the query heads of one KV head become its query rows
            qg = q.reshape(b, self.n_kv, self.groups, self.head_dim)
            o = F.scaled_dot_product_attention(qg, kc[:, :, :kv_len], vc[:, :, :kv_len], attn_mask=mask,
                                               scale=self.scaling)
            o = attn.o_proj(o.reshape(b, 1, self.n_heads * self.head_dim))
            h = self._mlp_block(layer, h, o)
        return self.norm(h[:, 0])

    # ------------------------------------------------------------------ fused decode
    def _plain_norm(self, mod, x):
        """mod is an HF RMSNorm (weight * normalize(x), weight in x's dtype) with no hooks."""
        return (type(mod) in self._norm_types and isinstance(getattr(mod, "weight", None), torch.Tensor)
                and mod.weight.dim() == 1 and mod.weight.dtype == x.dtype and not _has_hooks(mod)
                and hasattr(mod, "variance_epsilon"))

    def _norm(self, mod, x, residual):
        """(mod(x + residual), x + residual); residual None: (mod(x), x)."""
        if self._plain_norm(mod, x):
            return K.add_rmsnorm(x, residual, mod.weight, mod.variance_epsilon)
        s = x if residual is None else x + residual
        return mod(s), s

    def _linear(self, mod, x):
        """mod(x); unmerged PEFT LoRA as base(x) then y += scale * (x A^T) B^T in one accumulating GEMM."""
        if self.gemm and type(mod) is torch.nn.Linear and not _has_hooks(mod) and _gemm.eligible(x, mod.weight):
            return _gemm.linear(x, mod.weight, mod.bias)
        plan = _lora_plan(mod, x)
        if plan is None:
            return mod(x)
        y = self._linear(mod.base_layer, x) if not _has_hooks(mod.base_layer) else mod.base_layer(x)
        if y.dtype != x.dtype or not y.is_contiguous():
            for a, b, scale in plan:
                y = y + F.linear(F.linear(x, a), b) * scale
            return y
        y2 = y.view(-1, y.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        for a, b, scale in plan:
            y2.addmm_(F.linear(x2, a), b.t(), alpha=scale)
        return y

    def _linear_group(self, mods, x):
        """[m(x) for m in mods]; the single-adapter LoRA ones among them get their updates from one shrink and
        one expand kernel for the whole group (`lora.lora_add_`)."""
        plans = [_lora_plan(m, x) for m in mods]
        grp = [i for i, p in enumerate(plans) if p is not None and len(p) == 1]
        x2 = x.reshape(-1, x.shape[-1])
        if (len(grp) < 1 or x2.shape[0] > 64 or x2.stride(-1) != 1
                or len({plans[i][0][0].shape[0] for i in grp}) != 1 or plans[grp[0]][0][0].shape[0] > 128):
            grp = []
        base = [m.base_layer if i in grp else m for i, m in enumerate(mods)]
        fz = self.fusions
        if fz.lora_in_reduce and grp and len(grp) == len(mods) and (fz.group_nvfp4 or len(mods) == 1):
            ws = self._g4_weights(base, x2)
            if ws is not None and _nv.lora_g4_ok(x2, ws):
                sh = _lora.Shrink([p[0] for p in plans], x2.shape[0], x2.shape[1], x2.device)
                join = None
                if fz.lora_stream and x2.is_cuda:
                    cur, side = torch.cuda.current_stream(x2.device), self._side_stream(x2.device)
                    self.forked = True
                    side.wait_stream(cur)
                    with torch.cuda.stream(side):
                        _lora.shrink_(x2, sh)
                    join = lambda: cur.wait_stream(side)  # noqa: E731 - before the expand reads the partials
                else:
                    _lora.shrink_(x2, sh)
                return [y.view(*x.shape[:-1], y.shape[-1]) for y in _nv.linear_lora_g4(x2, ws, sh, join)]
        g4 = self._g4_group(base, x2) if fz.group_nvfp4 else None
        if g4 is not None:
            outs = [y.view(*x.shape[:-1], y.shape[-1]) for y in _nv.linear_group_g4(x2, g4, checked=True)]
        elif (self.gemm and len(base) > 1 and all(type(m) is torch.nn.Linear and not _has_hooks(m) for m in base)
                and _gemm.group_eligible(x, [m.weight for m in base], [m.bias for m in base])):
            outs = _gemm.linear_group(x, [m.weight for m in base], [m.bias for m in base])
        else:
            outs = [self._linear(m, x) for m in base]
        if not grp:
            return outs
        if any(outs[i].dtype != x.dtype or not outs[i].is_contiguous() for i in grp):
            for i in grp:
                for a, b, scale in plans[i]:
                    outs[i] = outs[i] + F.linear(F.linear(x, a), b) * scale
            return outs
        _lora.lora_add_(x2, [outs[i].view(-1, outs[i].shape[-1]) for i in grp], [plans[i][0] for i in grp])
        return outs

    def _side_stream(self, device) -> torch.cuda.Stream:
        """The stream the LoRA shrinks run on beside the base GEMVs (one per device, made on first use)."""
        st = self._side.get(device)
        if st is None:
            st = self._side[device] = torch.cuda.Stream(device)
        return st

    @staticmethod
    def _g4_group(mods, x2):
        """_g4_weights of 2-3 linears that one grouped Gluon launch can serve for x2; else None (each runs as its
        own module)."""
        ws = DecoderAdapter._g4_weights(mods, x2) if len(mods) >= 2 else None
        return ws if ws is not None and _nv.group_g4_ok(x2, ws) else None

    @staticmethod
    def _g4_weights(mods, x2):
        """[m.decode_operands(x2)] when `mods` are 1-3 linears that hand out g4 decode operands for x2 (hfq NVFP4 in
        the g4 layout) and have no hooks, without autograd; else None."""
        if not 1 <= len(mods) <= 3 or (torch.is_grad_enabled() and x2.requires_grad):
            return None
        ws = []
        for m in mods:
            ops = getattr(m, "decode_operands", None)
            w = ops(x2) if callable(ops) and not _has_hooks(m) else None
            if w is None:
                return None
            ws.append(w)
        return ws

    def _mlp(self, mlp, x):
        if (all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
                and type(getattr(mlp, "act_fn", None)) in self._silu_types
                and not _has_hooks(mlp) and not _has_hooks(mlp.act_fn)):
            g, u = self._linear_group([mlp.gate_proj, mlp.up_proj], x)
            if g.is_contiguous() and u.is_contiguous() and g.dtype == u.dtype:
                return self._linear_group([mlp.down_proj], K.silu_mul(g, u))[0]
            return self._linear_group([mlp.down_proj], mlp.act_fn(g) * u)[0]
        return mlp(x)

    def decode_fused(self, ids, pos, col, add_mask, k_cache, v_cache, b: int, kv_len: int):
        """`decode` with the fused kernels (same arguments and result)."""
        h = self.embed(ids[:, None])
        cos, sin = self.rotary(h, pos[:, None])
        cos, sin = cos.reshape(b, -1).contiguous(), sin.reshape(b, -1).contiguous()
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        x, res = h, None
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            xn, res = self._norm(layer.input_layernorm, x, res)
            q, k, v = self._linear_group([attn.q_proj, attn.k_proj, attn.v_proj], xn)
            if self.qk_norm:
                q = attn.q_norm(q.view(b, 1, nh, hd))
                k = attn.k_norm(k.view(b, 1, nkv, hd))
            q, k, v = (t.reshape(b, -1).contiguous() for t in (q, k, v))
            qr = K.rope_kv_write(q, k, v, cos, sin, k_cache[i], v_cache[i], col, nh, nkv, hd)
            o = K.decode_attention(qr, k_cache[i], v_cache[i], add_mask, col, kv_len, self.scaling)
            o = self._linear_group([attn.o_proj], o.view(b, 1, nh * hd))[0]
            xn, res = self._norm(layer.post_attention_layernorm, o, res)
            x = self._mlp(layer.mlp, xn)
        out, _ = self._norm(self.norm, x, res)
        return out[:, 0]

    def logits(self, hidden):
        if self.fused:
            return self._linear(self.lm_head, hidden).float()
        return self.lm_head(hidden).float()
