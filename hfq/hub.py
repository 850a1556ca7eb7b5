"""Model cards from `model_cards/` templates and Hub push helpers for hfq models and adapters."""
from __future__ import annotations

import os
import string
from pathlib import Path

# In a checkout hfq/model_cards is a symlink to the top-level model_cards/; a built wheel holds copies.
CARDS_DIR = Path(__file__).resolve().parent / "model_cards"


def _template(name: str) -> str:
    path = CARDS_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"model card template {name!r} not found in {CARDS_DIR}")
    return path.read_text()


def render(name: str, **fields) -> str:
    """Fill a template; every placeholder must be given (a missing one is an error, never left blank)."""
    text = _template(name)
    needed = {f for _, f, _, _ in string.Formatter().parse(text) if f}
    missing = needed - fields.keys()
    if missing:
        raise ValueError(f"model card {name!r}: missing fields {sorted(missing)}")
    return text.format(**fields)


def _base_name(model) -> str:
    return getattr(getattr(model, "config", None), "_name_or_path", "") or "unknown"


def nvfp4_model_card(model, repo_id: str) -> str:
    """Card for a model loaded with NVFP4Config (uses the quantization report gathered while loading)."""
    rep = getattr(model, "hfq_quantization_report", None) or {"quantized": [], "skipped": {}, "rel_error": {}}
    qc = model.config.quantization_config
    qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(qc)
    errs = list(rep["rel_error"].values())
    return render("nvfp4_model.md", base_model=_base_name(model), quant_method=qc["quant_method"],
                  format=qc["format"], format_upper=qc["format"].upper(), model_name=repo_id.split("/")[-1],
                  dense_dtype=str(model.dtype).removeprefix("torch."), n_quantized=len(rep["quantized"]),
                  n_skipped=len(rep["skipped"]), mean_rel_error=f"{sum(errs) / len(errs):.4f}" if errs else "n/a",
                  repo_id=repo_id)


def adapter_card(peft_model, repo_id: str, method: str = "qerl", training_summary: str = "") -> str:
    """Card for a PEFT LoRA adapter trained on an hfq base."""
    cfg = peft_model.peft_config[peft_model.active_adapter]
    base = peft_model.get_base_model()
    qc = getattr(base.config, "quantization_config", None)
    fmt = (qc.to_dict() if hasattr(qc, "to_dict") else dict(qc or {})).get("format", "dense")
    return render("lora_adapter.md", base_model=cfg.base_model_name_or_path or _base_name(base), method=method,
                  model_name=repo_id.split("/")[-1], r=cfg.r, lora_alpha=cfg.lora_alpha,
                  target_modules=", ".join(sorted(cfg.target_modules or [])), base_format=fmt.upper(),
                  training_summary=training_summary, repo_id=repo_id)


def save_for_hub(model, out_dir: str, repo_id: str, method: str = "qerl", training_summary: str = "") -> str:
    """Write the adapter (PEFT model) or quantized model with its card (README.md) into `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    card = (adapter_card(model, repo_id, method, training_summary) if hasattr(model, "peft_config")
            else nvfp4_model_card(model, repo_id))
    Path(out_dir, "README.md").write_text(card)
    return out_dir


def push_to_hub(model, repo_id: str, private: bool = True, token: str | None = None, method: str = "qerl",
                training_summary: str = "", commit_message: str = "Upload with hfq") -> str:
    """Save with a card and upload the folder (safetensors only) to the Hub; returns the repo URL."""
    import tempfile

    from huggingface_hub import HfApi

    with tempfile.TemporaryDirectory() as d:
        save_for_hub(model, d, repo_id, method, training_summary)
        api = HfApi(token=token)
        url = api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(folder_path=d, repo_id=repo_id, commit_message=commit_message,
                          allow_patterns=["*.safetensors", "*.json", "*.md", "*.jinja", "*.txt"])
    return str(url)
