"""Model cards for hfq models and adapters (Jinja templates in `model_cards/`) and the Hub upload of a saved folder.

A card is YAML front matter (`huggingface_hub.ModelCardData`) + markdown, rendered exactly as
`huggingface_hub.ModelCard.from_template` renders (the template gets `card_data` as YAML and the other fields as
variables), but strictly: a field the template uses and the caller did not give is an error, never left blank.
Four kinds, picked from the model: an NVFP4 base (NVFP4Linear layers), a LoRA adapter (a PEFT model, the QeRL card),
a QuEST model (QuESTLinear layers) and an ECO/QFT fine-tune (QParam weights).
"""
from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

# In a checkout hfq/model_cards is a symlink to the top-level model_cards/; a built wheel holds copies.
CARDS_DIR = Path(__file__).resolve().parent / "model_cards"

TEMPLATES = {"nvfp4": "nvfp4_model.md", "adapter": "lora_adapter.md", "quest": "quest_model.md",
             "qft": "qft_model.md"}
# trainer-args fields a card reports when they exist on the args object (TrainingArguments / GRPOConfig / QeRLConfig)
HPARAMS = ("learning_rate", "max_steps", "num_train_epochs", "per_device_train_batch_size",
           "gradient_accumulation_steps", "lr_scheduler_type", "warmup_ratio", "warmup_steps", "weight_decay",
           "max_grad_norm", "optim", "seed", "bf16", "num_generations", "max_completion_length", "temperature",
           "beta", "epsilon", "epsilon_high", "loss_type", "num_iterations", "steps_per_generation", "scale_rewards",
           "mask_truncated_completions", "aqn", "aqn_schedule", "aqn_scope", "aqn_sigma_start", "aqn_sigma_end",
           "aqn_num_stages", "aqn_seed", "aqn_norm_names")
_AQN_DETAILS = ("aqn_schedule", "aqn_scope", "aqn_sigma_start", "aqn_sigma_end", "aqn_num_stages", "aqn_seed",
                "aqn_norm_names")  # left out of a card whose run had aqn=False
# log_history keys whose last logged value a card reports
METRICS = ("loss", "train_loss", "eval_loss", "reward", "reward_std", "entropy", "kl", "aqn/sigma")
# files of a saved folder that never go to the Hub (Trainer's own upload skips the same)
IGNORE = ["_*", "checkpoint-*", "checkpoint-*/**", "runs/**", ".git/**", "*.pyc", "__pycache__/**"]
_UPLOADABLE_MARKERS = ("config.json", "adapter_config.json")


# --------------------------------------------------------------------------- rendering
def _strict_env():
    import jinja2

    class Strict(jinja2.StrictUndefined):
        @property
        def _undefined_message(self):  # the UndefinedError's text is the missing field's bare name
            return self._undefined_name

    return jinja2.Environment(undefined=Strict)  # same settings as the jinja2.Template that from_template builds


def _template(name: str) -> str:
    path = CARDS_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"model card template {name!r} not found in {CARDS_DIR}")
    return path.read_text()


def render(name: str, card_data=None, **fields) -> str:
    """Render template `name` with `card_data` (ModelCardData or dict; None = empty front matter) as YAML and the
    other fields as variables. Every field the template uses must be given (ValueError lists the missing ones)."""
    from huggingface_hub import ModelCardData
    from jinja2 import UndefinedError

    if isinstance(card_data, dict):
        card_data = ModelCardData(**card_data)
    template = _strict_env().from_string(_template(name))
    given, missing = dict(fields), []
    while True:
        try:
            return_text = template.render(card_data=card_data.to_yaml() if card_data else "", **given)
        except UndefinedError as e:
            if str(e) in given or len(missing) > 100:
                raise ValueError(f"model card {name!r}: template error: {e}") from None
            missing.append(str(e))
            given[str(e)] = ""
            continue
        if missing:
            raise ValueError(f"model card {name!r}: missing fields {sorted(missing)}")
        return return_text


# --------------------------------------------------------------------------- facts about a model
def hub_id(name) -> str | None:
    """`name` if it looks like a Hub model id (`org/name`, valid for huggingface_hub) and is not a local path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(name, str) or name.count("/") != 1 or os.path.exists(name):
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def _name_or_path(model) -> str:
    cfg = getattr(model, "config", None)
    return getattr(cfg, "_name_or_path", "") or getattr(model, "name_or_path", "") or ""


def _base_source(name: str) -> str:
    """How the body names a base that is not a Hub id (the local folder's name only, never the full path)."""
    return f"a local checkpoint (`{Path(name).name}`)" if name else "an unrecorded checkpoint"


def _qconfig_dict(model) -> dict:
    qc = getattr(getattr(model, "config", None), "quantization_config", None)
    if qc is None:
        return {}
    return dict(qc.to_dict() if hasattr(qc, "to_dict") else qc)


def _count(model, cls) -> int:
    return sum(isinstance(m, cls) for m in model.modules())


def detect_kind(model) -> str:
    """'adapter' (a PEFT model), 'nvfp4', 'quest' or 'qft' (QParam weights: ECO or QFT), from the layers present."""
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        return "adapter"
    from .nvfp4.linear import NVFP4Linear
    from .qparam import QParam
    from .quest.linear import QuESTLinear

    if _count(model, NVFP4Linear):
        return "nvfp4"
    if _count(model, QuESTLinear):
        return "quest"
    if any(isinstance(p, QParam) for p in model.parameters()):
        return "qft"
    raise ValueError(f"model: {type(model).__name__} holds no hfq layers (NVFP4Linear, QuESTLinear, QParam "
                     "weights) and is not a PEFT adapter; load it with an hfq quantization config first")


def _quant_facts(model) -> dict:
    """Quantization metadata of a (base) model: method, format, per-method settings and layer counts."""
    qc = _qconfig_dict(model)
    method = qc.get("quant_method")
    if method == "hfq_nvfp4" or (not method and _safe_kind(model) == "nvfp4"):
        from .nvfp4.config import BLOCK_SIZE
        from .nvfp4.linear import NVFP4Linear

        fmt = qc.get("format", "nvfp4")
        rep = getattr(model, "hfq_quantization_report", None) or {}
        errs = list((rep.get("rel_error") or {}).values())
        out = {"quant_method": "hfq_nvfp4", "format": fmt, "block_size": BLOCK_SIZE[fmt],
               "layers_quantized": _count(model, NVFP4Linear), "layers_kept_dense": len(rep.get("skipped") or {})}
        if getattr(getattr(model, "hf_quantizer", None), "merged_adapter", False):
            out["merged_adapter"] = True  # merge_and_requantize: the load's weight errors describe older codes
        elif errs:
            out["mean_relative_weight_error"] = round(sum(errs) / len(errs), 6)
        return out
    if method == "hfq_quest":
        from .quest.linear import QuESTLinear

        w, a, grid = qc.get("weight_bits"), qc.get("activation_bits"), qc.get("grid", "int")
        return {"quant_method": method, "format": f"w{w}a{a}" if a else f"w{w}", "grid": grid, "weight_bits": w,
                "activation_bits": a, "hadamard": qc.get("hadamard"), "estimator": qc.get("estimator"),
                "save_format": qc.get("save_format"), "layers_quantized": _count(model, QuESTLinear)}
    if method == "hfq_qft":
        from .qparam import QParam

        n = sum(isinstance(p, QParam) for p in model.parameters())
        return {"quant_method": method, "format": qc.get("weight_format"), "gradient_bits": qc.get("gradient_bits"),
                "rounding": qc.get("rounding"), "layers_quantized": n}
    return {"quant_method": method or "none", "format": qc.get("format") or "dense"}


def _safe_kind(model) -> str | None:
    try:
        return detect_kind(model)
    except ValueError:
        return None


def _plain(v):
    """A YAML-safe value (floats to 6 significant digits, lists element-wise, enums and other objects to str)."""
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, str):  # str enums (SchedulerType, OptimizerNames) dump as Python objects otherwise
        return str(getattr(v, "value", v))
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return float(f"{v:.6g}")
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
        return _plain(v.item())
    return str(getattr(v, "value", v))


def training_facts(trainer=None, training_args=None, metrics=None) -> tuple[dict, dict]:
    """(hyper-parameters, run metrics) from a Trainer (its args, optimizer and `state.log_history`) and/or the
    explicit `training_args` (an args object or a dict) and `metrics` dict, which take precedence."""
    args = training_args if training_args is not None else getattr(trainer, "args", None)
    if isinstance(args, dict):
        hp = {k: _plain(v) for k, v in args.items() if v is not None}
    else:
        hp = {k: _plain(getattr(args, k)) for k in HPARAMS if getattr(args, k, None) is not None}
    if hp.get("aqn") is False:
        for k in _AQN_DETAILS:
            hp.pop(k, None)
    steps = hp.get("max_steps")
    if isinstance(steps, int) and steps > 0:  # max_steps overrides the epoch count
        hp.pop("num_train_epochs", None)
    elif isinstance(steps, int):
        hp.pop("max_steps")
    if _optimizer_name(trainer):  # the optimizer class actually built or given, more exact than the `optim` name
        hp["optimizer"] = _optimizer_name(trainer)
        hp.pop("optim", None)
    state = getattr(trainer, "state", None)
    found = run_metrics(getattr(state, "log_history", None), getattr(state, "global_step", 0))
    found.update({k: _plain(v) for k, v in (metrics or {}).items()})
    return hp, found


def run_metrics(log_history, global_step=0) -> dict:
    """The last logged value of each METRICS key in a Trainer's log_history (+ global_step when any was logged)."""
    found = {}
    for entry in log_history or []:
        for k in METRICS:
            if k in entry:
                found[k] = _plain(entry[k])
    if found and global_step:
        found["global_step"] = int(global_step)
    return found


def _optimizer_name(trainer) -> str | None:
    """Class name of the trainer's optimizer (through accelerate's wrapper), or of optimizer_cls_and_kwargs."""
    opt = getattr(trainer, "optimizer", None)
    opt = getattr(opt, "optimizer", opt)
    if opt is not None:
        return type(opt).__name__
    cls_kw = getattr(trainer, "optimizer_cls_and_kwargs", None)
    return cls_kw[0].__name__ if cls_kw else None


def _method_from(kind: str, trainer, quant: dict) -> str:
    name = type(trainer).__name__ if trainer is not None else ""
    opt = _optimizer_name(trainer)
    if kind == "adapter":
        if name == "QeRLGRPOTrainer":  # without a trainer the method is unknown: model_card(method="qerl") says it
            return "qerl"
        return {"GRPOTrainer": "grpo", "SFTTrainer": "sft", "DPOTrainer": "dpo"}.get(name, "lora")
    if kind == "qft":
        if opt in ("ECOAdamW", "ECOSGD"):
            return "eco"
        if opt == "QLion" or quant.get("gradient_bits") == 8 or quant.get("format") == "int8_dense_sparse":
            return "qft"
        return "eco"
    return {"nvfp4": "nvfp4", "quest": "quest"}[kind]


def _config_expr(model) -> str:
    """`, quantization_config=hfq.XConfig(...)` that rebuilds the quantization a base was loaded with ("" when the
    base checkpoint was already quantized, or is dense)."""
    qc = getattr(getattr(model, "config", None), "quantization_config", None)
    quantizer = getattr(model, "hf_quantizer", None)
    if qc is None or not hasattr(qc, "to_dict") or getattr(quantizer, "pre_quantized", False):
        return ""
    cls = type(qc)
    if not cls.__module__.startswith("hfq."):
        return ""
    default, mine = cls().to_dict(), qc.to_dict()
    diff = ", ".join(f"{k}={mine[k]!r}" for k in mine if mine[k] != default.get(k))
    return f", quantization_config=hfq.{cls.__name__}({diff})"


# --------------------------------------------------------------------------- cards
def model_card(model, repo_id: str, *, trainer=None, training_args=None, metrics=None, method: str | None = None,
               base_model: str | None = None, tokenizer: bool = False, dataset_name: str | None = None,
               license: str | None = None, training_summary: str = ""):
    """The `huggingface_hub.ModelCard` for an hfq model or PEFT adapter; the kind is picked from the model's layers.

    base_model: the Hub id it derives from (default: the adapter's base_model_name_or_path or the config's
    _name_or_path); written to the metadata only when it is a Hub id; for an adapter on a GPTQ-calibrated base
    (calibrate_), the repo of the saved calibrated base (without it the card names no base, with a warning).
    tokenizer: the repo will hold the tokenizer."""
    from huggingface_hub import ModelCard, ModelCardData
    from huggingface_hub.utils import validate_repo_id

    validate_repo_id(repo_id)
    kind = detect_kind(model)
    unwrapped = model.get_base_model() if kind == "adapter" else model
    quant = _quant_facts(unwrapped)
    method = method or _method_from(kind, trainer, quant)
    hp, found = training_facts(trainer, training_args, metrics)
    lora = {}
    if kind == "adapter":
        cfg = model.peft_config[model.active_adapter]
        lora = {"r": cfg.r, "lora_alpha": cfg.lora_alpha, "lora_dropout": _plain(cfg.lora_dropout),
                "target_modules": sorted(cfg.target_modules) if not isinstance(cfg.target_modules, str)
                else [cfg.target_modules]}
        candidates = [cfg.base_model_name_or_path, _name_or_path(unwrapped)]
    else:
        candidates = [_name_or_path(model)]
    quantizer = getattr(unwrapped, "hf_quantizer", None)
    calibrated = (kind == "adapter" and getattr(quantizer, "calibrated", False)
                  and not getattr(quantizer, "pre_quantized", False))
    if calibrated and not base_model:
        # the dense source is not the base: no quantization_config rebuilds GPTQ's codes from it
        warnings.warn("model_card: the adapter's base is GPTQ-calibrated NVFP4 (hfq.nvfp4.calibrate_), which no "
                      "quantization_config rebuilds from the dense model: the card names no base. Save the calibrated "
                      "base (save_pretrained, or `hfq quantize --calibrate`), push it and pass base_model=<its repo "
                      "id>", UserWarning, stacklevel=2)
        candidates = []
    if base_model:
        candidates = [base_model]
    base = next((hub_id(c) for c in candidates if hub_id(c)), None)
    source = base or next((c for c in candidates if c), "")
    fmt = str(quant.get("format") or "dense")
    merged = bool(quant.get("merged_adapter"))
    tags = ["hfq", method, quant["quant_method"], fmt] + (["lora", "peft"] if kind == "adapter" else []) + (
        ["lora", "merged"] if merged else []) + (
        ["trl", "grpo"] if method in ("qerl", "grpo") and trainer is not None else [])
    training = {"method": method} if (kind in ("adapter", "qft") or trainer is not None or hp or found) else {}
    if trainer is not None:
        training["trainer"] = type(trainer).__name__
    if hp:
        training["hyperparameters"] = hp
    if found:
        training["metrics"] = found
    if lora:
        training["lora"] = lora
    relation = {"adapter": "adapter", "nvfp4": "finetune" if merged else "quantized", "qft": "finetune"}.get(
        kind, "finetune" if (trainer is not None or found) else "quantized")
    data = ModelCardData(base_model=base, library_name="peft" if kind == "adapter" else "transformers",
                         pipeline_tag="text-generation", tags=tags, license=license,
                         datasets=[dataset_name] if dataset_name else None, quantization=quant,
                         training=training or None, base_model_relation=relation if base else None,
                         hfq_repo_id=repo_id)
    fields = dict(model_name=repo_id.split("/")[-1], repo_id=repo_id, base_model=base or "",
                  base_source=_base_source(source), method=method, quant=quant, format=fmt,
                  format_upper=fmt.upper(), hparams=hp, metrics=found, training_summary=training_summary,
                  tokenizer_repo=repo_id if tokenizer else (base or ""), dataset_name=dataset_name or "",
                  trainer_name=type(trainer).__name__ if trainer is not None else "",
                  aqn=hp.get("aqn", True) is not False)
    if kind == "adapter":
        # the base's dtype as trained: a checkpoint stored in another dtype loads in that one otherwise
        dtype = f', dtype="{str(unwrapped.dtype).removeprefix("torch.")}"' if hasattr(unwrapped, "dtype") else ""
        base_load, base_note = dtype + _config_expr(unwrapped), ""
        if calibrated:
            base_load = dtype
            base_note = ("the base is GPTQ-calibrated NVFP4 (hfq.nvfp4.calibrate_): load that saved checkpoint as it is"
                         if base_model else "the base is GPTQ-calibrated NVFP4 (hfq.nvfp4.calibrate_): load the "
                         "calibrated checkpoint it was saved as; re-quantizing the dense model gives other codes")
        fields.update(r=lora["r"], lora_alpha=lora["lora_alpha"], target_modules=", ".join(lora["target_modules"]),
                      base_format=fmt.upper(), base_load=base_load, base_note=base_note)
    return ModelCard(render(TEMPLATES[kind], data, **fields))


def nvfp4_model_card(model, repo_id: str, **kw) -> str:
    """Card text for a model loaded with NVFP4Config (layer counts and error from the load's quantization report)."""
    return str(model_card(model, repo_id, **kw))


def adapter_card(peft_model, repo_id: str, method: str = "qerl", training_summary: str = "", **kw) -> str:
    """Card text for a PEFT LoRA adapter trained on an hfq base (the QeRL card by default)."""
    return str(model_card(peft_model, repo_id, method=method, training_summary=training_summary, **kw))


def trainer_card(trainer, repo_id: str | None = None, **kw):
    """The card of a trainer's model (its args, optimizer and log history filled in); repo id defaults to the
    trainer's hub_model_id, else the output_dir's name."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    repo_id = repo_id or getattr(trainer, "hub_model_id", None) or trainer.args.hub_model_id or (
        re.sub(r"[-.]{2,}", "-", re.sub(r"[^\w.-]", "-", Path(trainer.args.output_dir).resolve().name))
        .strip("-.")[:90] or "model")  # a valid repo id: no "--" / ".." runs
    tok = getattr(trainer, "processing_class", None)
    return model_card(model, repo_id, trainer=trainer, tokenizer=tok is not None, **kw)


# --------------------------------------------------------------------------- folders and upload
def save_for_hub(model, out_dir: str, repo_id: str, tokenizer=None, trainer=None, **card_kw) -> str:
    """Write the folder a push uploads: safetensors weights (or the adapter), the tokenizer files, README.md."""
    from huggingface_hub.utils import validate_repo_id

    validate_repo_id(repo_id)
    if tokenizer is None and trainer is not None:
        tokenizer = getattr(trainer, "processing_class", None)
    card = model_card(model, repo_id, trainer=trainer, tokenizer=tokenizer is not None, **card_kw)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    card.save(os.path.join(out_dir, "README.md"))
    return out_dir


def check_push(repo_id: str, token: str | None = None) -> None:
    """Fail before any work or network: a bad repo id raises huggingface_hub's HFValidationError, no token (argument,
    HF_TOKEN or `hf auth login`) its LocalTokenNotFoundError."""
    from huggingface_hub.utils import build_hf_headers, validate_repo_id

    validate_repo_id(repo_id)
    build_hf_headers(token=token if token else True)


def folder_card(folder: str, repo_id: str, base_model: str | None = None):
    """A card for an already saved hfq model or adapter folder, built from its config files (no weights loaded).
    base_model: the Hub id it derives from (a saved model folder does not record it: transformers 5 writes no
    _name_or_path into config.json)."""
    from huggingface_hub import ModelCard, ModelCardData

    folder = Path(folder)
    adapter = folder / "adapter_config.json"
    if adapter.is_file():
        cfg = json.loads(adapter.read_text())
        source = cfg.get("base_model_name_or_path") or ""
        base_cfg = Path(source) / "config.json"
        qc = json.loads(base_cfg.read_text()).get("quantization_config") or {} if base_cfg.is_file() else {}
        kind = "adapter"
    elif (folder / "config.json").is_file():
        cfg = json.loads((folder / "config.json").read_text())
        qc, source = cfg.get("quantization_config") or {}, cfg.get("_name_or_path") or ""
        kinds = {"hfq_nvfp4": "nvfp4", "hfq_quest": "quest", "hfq_qft": "qft"}
        if qc.get("quant_method") not in kinds:
            raise ValueError(f"{folder}: config.json has no hfq quantization_config (quant_method "
                             f"{qc.get('quant_method')!r}); save it with hfq or write README.md yourself")
        kind = kinds[qc["quant_method"]]
    else:
        raise ValueError(f"{folder}: neither config.json nor adapter_config.json found: not a saved model/adapter")
    state = folder / "trainer_state.json"
    found = {}
    if state.is_file():
        saved = json.loads(state.read_text())
        found = run_metrics(saved.get("log_history"), saved.get("global_step"))
    quant = {k: qc[k] for k in ("quant_method", "format", "weight_format", "weight_bits", "activation_bits", "grid",
                                "gradient_bits", "save_format", "hadamard", "estimator", "rounding")
             if qc.get(k) is not None}
    if kind == "nvfp4":
        from .nvfp4.config import BLOCK_SIZE

        quant["block_size"] = BLOCK_SIZE[quant.get("format", "nvfp4")]
    if not quant:  # an adapter folder does not record how its base was quantized on load
        quant = {"quant_method": "unrecorded"} if kind == "adapter" else {"quant_method": "none"}
    if "weight_format" in quant:
        quant["format"] = quant.pop("weight_format")
    if kind == "quest":
        w, a = quant.get("weight_bits"), quant.get("activation_bits")
        quant["format"] = f"w{w}a{a}" if a else f"w{w}"
    fmt = str(quant.get("format") or ("unrecorded" if quant["quant_method"] == "unrecorded" else "dense"))
    method = {"adapter": "lora", "nvfp4": "nvfp4",  # an adapter folder does not say how it was trained
              "quest": "quest", "qft": "qft" if fmt == "int8_dense_sparse" else "eco"}[kind]
    link = base_model or source
    base = hub_id(link)
    has_tok = any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    training = {"method": method, **({"metrics": found} if found else {})} if (kind in ("adapter", "qft") or found) \
        else None
    data = ModelCardData(base_model=base, library_name="peft" if kind == "adapter" else "transformers",
                         pipeline_tag="text-generation", quantization=quant, training=training,
                         tags=[t for t in ["hfq", method, quant["quant_method"], fmt] if t != "unrecorded"] +
                         (["lora", "peft"] if kind == "adapter" else []), hfq_repo_id=repo_id)
    fields = dict(model_name=repo_id.split("/")[-1], repo_id=repo_id, base_model=base or "",
                  base_source=_base_source(link), method=method, quant=quant, format=fmt, format_upper=fmt.upper(),
                  hparams={}, metrics=found, training_summary="", tokenizer_repo=repo_id if has_tok else (base or ""),
                  dataset_name="", trainer_name="")
    if kind == "adapter":
        tm = cfg.get("target_modules") or []
        fields.update(r=cfg.get("r"), lora_alpha=cfg.get("lora_alpha"),
                      base_format="(format not recorded in the folder)" if fmt == "unrecorded" else fmt.upper(),
                      target_modules=tm if isinstance(tm, str) else ", ".join(sorted(tm)),
                      base_load=", quantization_config=hfq.NVFP4Config()" if fmt == "unrecorded" or (
                          fmt in ("nvfp4", "mxfp4") and not (Path(source) / "config.json").is_file()) else "",
                      base_note="this folder does not record how the base was quantized for training: load it as it "
                      "was then (NVFP4 below, hfq's QeRL default)" if fmt == "unrecorded" else "")
    return ModelCard(render(TEMPLATES[kind], data, **fields))


def is_placeholder_card(path: str) -> bool:
    """README.md is the empty template PEFT's save_pretrained writes into every adapter folder (no hfq metadata,
    the local base path as base_model), not a card anyone wrote: a push replaces it with hfq's."""
    text = Path(path).read_text(errors="replace")
    return "# Model Card for Model ID" in text and "- hfq" not in text


def retarget_card(path: str, repo_id: str) -> bool:
    """Rewrite an hfq card written for another repo id (`trainer.save_model` names the output folder) so its title,
    metadata and snippet name repo_id; cards hfq did not write are left alone. Returns whether it changed."""
    from huggingface_hub import ModelCard

    card = ModelCard.load(path)
    old = card.data.to_dict().get("hfq_repo_id")
    if not old or old == repo_id:
        return False
    card.data.hfq_repo_id = repo_id
    card.text = re.sub(rf"^# {re.escape(old.split('/')[-1])}$", f"# {repo_id.split('/')[-1]}", card.text, count=1,
                       flags=re.M).replace(f'"{old}"', f'"{repo_id}"')
    card.save(path)
    return True


def upload_folder(folder: str, repo_id: str, private: bool = True, token: str | None = None,
                  commit_message: str = "Upload with hfq", base_model: str | None = None) -> str:
    """Upload a saved model/adapter folder as is (weights, tokenizer, README.md; hfq's card is added when there is
    none, or only PEFT's empty template; base_model: see folder_card)."""
    from huggingface_hub import HfApi

    check_push(repo_id, token)
    folder = str(folder)
    if not any(os.path.isfile(os.path.join(folder, m)) for m in _UPLOADABLE_MARKERS):
        raise ValueError(f"{folder}: neither config.json nor adapter_config.json found: not a saved model/adapter")
    readme = os.path.join(folder, "README.md")
    if not os.path.isfile(readme) or is_placeholder_card(readme):
        folder_card(folder, repo_id, base_model).save(readme)
    else:
        retarget_card(readme, repo_id)
    api = HfApi(token=token)
    url = api.create_repo(repo_id, private=private, exist_ok=True)
    api.upload_folder(folder_path=folder, repo_id=repo_id, commit_message=commit_message, ignore_patterns=IGNORE)
    return str(url)


def push_to_hub(model, repo_id: str, tokenizer=None, trainer=None, private: bool = True, token: str | None = None,
                commit_message: str = "Upload with hfq", **card_kw) -> str:
    """Build the `save_for_hub` folder in a temporary directory and upload it; returns the repo URL. A bad repo id or
    a missing token fails (huggingface_hub's own errors) before anything is saved or sent."""
    import tempfile

    check_push(repo_id, token)
    with tempfile.TemporaryDirectory() as d:
        save_for_hub(model, d, repo_id, tokenizer=tokenizer, trainer=trainer, **card_kw)
        return upload_folder(d, repo_id, private=private, token=token, commit_message=commit_message)
