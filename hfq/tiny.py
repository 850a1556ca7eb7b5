"""Tiny offline models and a character tokenizer, for tests, examples and the default demo (no hub)."""
from __future__ import annotations

import string

import torch

_ARCHS = ("qwen2", "qwen3", "llama", "mistral")
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"
SPECIAL = ("<pad>", "<s>", "</s>", "<unk>")


def tiny_config(arch: str = "qwen2", hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                intermediate: int = 128, vocab: int | None = None, max_pos: int = 512, **kw):
    """A small config of a real architecture; every linear in_features is a multiple of 32 by default."""
    import transformers as tf

    if arch not in _ARCHS:
        raise ValueError(f"arch: unknown {arch!r}; allowed {_ARCHS}")
    vocab = vocab or (len(CHARS) + len(SPECIAL))
    cls = {"qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config, "llama": tf.LlamaConfig,
           "mistral": tf.MistralConfig}[arch]
    extra = {"head_dim": hidden // heads} if arch in ("qwen3", "mistral") else {}
    kw = {"tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **extra, **kw}
    return cls(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=kv_heads, intermediate_size=intermediate, max_position_embeddings=max_pos, **kw)


def tiny_model(arch: str = "qwen2", seed: int = 0, dtype=torch.float32, **cfg_kw):
    """A randomly initialised causal LM of `tiny_config(arch, **cfg_kw)`, deterministic for a seed."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **cfg_kw), dtype=dtype)
    return model.eval()


def char_tokenizer():
    """A character-level tokenizer (byte-level BPE with no merges) over digits, letters, punctuation,
    space and newline. Byte-level so that any tokenizer class transformers picks for the model type
    (e.g. Qwen2Tokenizer) rebuilds it identically."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    to_sym = {" ": "\u0120", "\n": "\u010a"}
    vocab = {t: i for i, t in enumerate(SPECIAL)}
    for c in CHARS:
        vocab[to_sym.get(c, c)] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")
    fast.padding_side = "left"
    # A minimal chat template so TRL's conversational paths work with the tiny models.
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}a:{% endif %}"
    )
    return fast


def save_tiny(path, arch: str = "qwen2", seed: int = 0, dtype=torch.float32, **cfg_kw):
    """Write a tiny model + tokenizer to `path` (safetensors) and return the path."""
    model = tiny_model(arch, seed=seed, dtype=dtype, **cfg_kw)
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path
