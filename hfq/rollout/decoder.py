"""A static-KV-cache forward for Llama-family decoders (Qwen2, Qwen3, Llama, Mistral).

It calls the model's own submodules (norms, projections, MLPs, rotary embedding, lm_head), so
quantized linears (hfq NVFP4, bitsandbytes), PEFT LoRA wrappers (unmerged) and in-place weight
changes (LoRA updates, AQN noise on norm weights) are used as they are; only attention and the
KV cache are ours, so a decode step has fixed shapes and no host synchronisation (graph-safe).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SUPPORTED_ARCHS = ("qwen2", "qwen3", "llama", "mistral")


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rope(x, cos, sin):
    return x * cos + _rotate_half(x) * sin


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


class DecoderAdapter:
    """Holds references to a causal LM's parts and runs prefill / decode against an external KV cache."""

    def __init__(self, model, max_seq_len: int):
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
        self.dtype = self.embed.weight.dtype

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

    def logits(self, hidden):
        return self.lm_head(hidden).float()
