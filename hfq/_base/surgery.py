"""Model surgery shared by NVFP4, QuEST and QFT: which linears are converted, the swap itself, the check of what
a conversion left out (`check_conversion`), and `HfqQuantizer`, the quantizers' base (what a checkpoint holds and
how a load of one is checked: `checkpoint.py`).

Skip rule (`modules_to_not_convert`): transformers' own (`should_convert_module` of the installed version,
called, so hfq and transformers' quantizers always agree) — a module is skipped when an entry, read as a regular
expression, matches the start of its full name ("model.layers.0" skips that block, "lm_head" skips `lm_head`;
transformers 5.23 adds that the match must end at a module boundary) or when the name ends with the entry
("down_proj" skips every `...mlp.down_proj`).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import json
import threading
import warnings
from typing import Callable

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.base import HfQuantizer
from transformers.quantizers.quantizers_utils import should_convert_module

from hfq_kernels._triton import switch_to_device_of

from .checkpoint import (DENSE_HEADS_KEY, GUARD_DOC, NEW_HEAD, SAVED_DENSE_HEAD, checked_state_dict, converted_names,
                         dense_head, guard_key, guard_state_dict, ignore_guard_on_load, ignore_guard_on_state_dict_load,
                         new_layers_fix, recorded_dense_heads, task_head, unloaded_tensors,
                         whole_state_checked)


def should_convert(name: str, skip: list[str] | None) -> bool:
    """True when module `name` is not matched by any `modules_to_not_convert` entry (transformers' rule)."""
    return should_convert_module(name, list(skip) if skip else None)


def modules_to_skip(model: nn.Module, config, add_default_skips: bool) -> list[str]:
    """The config's `modules_to_not_convert` plus the model's `_keep_in_fp32_modules`; with
    `add_default_skips` (or when the config's list is None) also transformers' defaults for the model
    (its output embedding and the modules tied to it). An entry of the config's list that names no module of the
    model (a typo keeps nothing out) is a UserWarning naming it."""
    own = config.modules_to_not_convert
    if own != _default_skips(config):  # the defaults' "lm_head" is absent from e.g. a sequence classifier: no typo
        _warn_unmatched_skips(config.quant_method, model, own or ())
    if not hasattr(model, "get_output_embeddings"):  # a bare nn.Module: only the config's own list
        return list(own or [])
    return HfQuantizer.get_modules_to_not_convert(model, own, getattr(model, "_keep_in_fp32_modules", None),
                                                  add_default_skips=add_default_skips or own is None)


def _default_skips(config):
    """The config class's own default modules_to_not_convert (None where the field has none)."""
    f = next((f for f in dataclasses.fields(config) if f.name == "modules_to_not_convert"), None) \
        if dataclasses.is_dataclass(config) else None
    if f is None:
        return None
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _warn_unmatched_skips(method: str, model: nn.Module, entries) -> None:
    """An entry that matches no module (a typo), or only modules holding linears but none of the linears (e.g.
    "mlp": the rule matches the start or the end of a name), keeps nothing out: a UserWarning names it."""
    mods = [(n, m) for n, m in model.named_modules() if n]
    for e in entries:
        hit = [(n, m) for n, m in mods if not should_convert(n, [e])]
        if any(_linear_like(m) for _, m in hit):
            continue
        holder = next((n for n, m in hit if any(_linear_like(c) for c in m.modules())), None)
        if not hit or holder:
            why = (f"matches {holder}, which holds linear layers, but none of them (the rule matches the start or the "
                   f"end of a layer's name: write e.g. '{holder}' in full)" if holder else "matches no module")
            warnings.warn(f"{method}: modules_to_not_convert entry {e!r} {why}; it keeps nothing out",
                          UserWarning, stacklevel=3)


UNQUANTIZED_FIX = ("from_config builds a dense model whatever its config says: quantize it with "
                   "hfq.quest.quantize_model / hfq.qft.quantize_model_, or load a checkpoint with from_pretrained")


def hfq_method_named(config) -> str | None:
    """The hfq quant_method a model config's quantization_config names (an HfqConfig or a dict), else None."""
    qc = getattr(config, "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return method if isinstance(method, str) and method.startswith("hfq_") else None


def holds_layers_of(model: nn.Module, method: str) -> bool:
    """Whether `model` holds layers of hfq method `method` (its registered quantizer's layer_types)."""
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    types = getattr(AUTO_QUANTIZER_MAPPING.get(method), "layer_types", ())
    return bool(types) and any(isinstance(m, types) for m in model.modules())


def warning_from_config(from_config):
    """Wrap `PreTrainedModel._from_config` (what AutoModel*.from_config calls): a config naming an hfq method (e.g.
    AutoConfig.from_pretrained of an hfq checkpoint) still gives a dense model; a UserWarning says so, since
    training it would silently be plain training."""

    depth = threading.local()  # a task model's __init__ builds its backbone with from_config too: the outermost
    # call (of this thread) speaks

    @functools.wraps(from_config)
    def wrapper(cls, config, *args, **kwargs):
        outer = not getattr(depth, "n", 0)
        depth.n = getattr(depth, "n", 0) + 1
        try:
            model = from_config(cls, config, *args, **kwargs)
        finally:
            depth.n -= 1
        method = hfq_method_named(getattr(model, "config", None))
        building = any(p.device.type == "meta" for p in model.parameters())  # inside from_pretrained
        if (method is not None and outer and not building
                and not isinstance(getattr(model, "hf_quantizer", None), HfqQuantizer)):
            warnings.warn(f"{cls.__name__}.from_config: the config names quantization method {method}, but the model "
                          f"is dense ({UNQUANTIZED_FIX}); save_pretrained refuses it until it is quantized or the "
                          "config's quantization_config is deleted", UserWarning, stacklevel=3)
        return model

    wrapper.hfq_wrapped = from_config
    return wrapper


PASSED_STATE_DICT = contextvars.ContextVar("hfq_passed_state_dict", default=None)  # save_pretrained's state_dict=


def save_with_state_dict(save_pretrained):
    """Wrap `PreTrainedModel.save_pretrained`: transformers takes a quantized model's tensors from its quantizer and
    drops a `state_dict=` given (EMA or edited weights would be replaced by the live ones, silently); an hfq
    quantizer is handed that dict for the save (`HfqQuantizer.checkpoint_state` checks and writes it)."""

    sig = inspect.signature(save_pretrained)

    @functools.wraps(save_pretrained)
    def wrapper(self, *args, **kwargs):
        q = getattr(self, "hf_quantizer", None)
        if not isinstance(q, HfqQuantizer):
            method = hfq_method_named(getattr(self, "config", None))
            if method is not None and not holds_layers_of(self, method):  # (a backbone of an hfq model holds them)
                raise ValueError(
                    f"save_pretrained: this model's config names quantization method {method}, but the model was not "
                    f"quantized by it ({UNQUANTIZED_FIX}); its dense weights would be saved under that config. For a "
                    "dense checkpoint, `del model.config.quantization_config` first")
            return save_pretrained(self, *args, **kwargs)
        a = sig.bind_partial(self, *args, **kwargs).arguments
        token = PASSED_STATE_DICT.set(a.get("state_dict"))  # per thread / task: saves may overlap
        try:
            out = save_pretrained(self, *args, **kwargs)
        finally:
            PASSED_STATE_DICT.reset(token)
        if getattr(self, "_hf_peft_config_loaded", False) and a.get("is_main_process", True):
            q.after_adapter_save(self, str(a["save_directory"]))  # transformers saved the adapter only
        return out

    wrapper.hfq_wrapped = save_pretrained
    return wrapper


def refusing_quantized_head_resize(resize):
    """PreTrainedModel.resize_token_embeddings wrapped: when the output embeddings are one of hfq's quantized layers,
    a ValueError naming the head and the fix, raised before anything is resized (transformers itself would resize
    the input embeddings and then stop on the head with a TypeError)."""
    sig = inspect.signature(resize)

    @functools.wraps(resize)
    def wrapper(self, *args, **kwargs):
        q = getattr(self, "hf_quantizer", None)
        head = self.get_output_embeddings() if isinstance(q, HfqQuantizer) else None
        a = sig.bind_partial(self, *args, **kwargs).arguments
        resizing = a.get("new_num_tokens") is not None or a.get("pad_to_multiple_of") is not None
        if resizing and isinstance(head, q.layer_types if head is not None else ()):
            name = next((n for n, m in self.named_modules() if m is head), "lm_head")
            raise ValueError(
                f"resize_token_embeddings: the output embeddings `{name}` are a quantized {type(head).__name__} "
                f"({q.quantization_config.quant_method}), which cannot be resized; nothing was changed. Resize "
                "before quantizing (load the float model, resize_token_embeddings, save_pretrained, then load that "
                f"with the quantization_config), or keep the head unquantized: modules_to_not_convert=[..., '{name}']")
        return resize(self, *args, **kwargs)

    wrapper.hfq_wrapped = resize
    return wrapper


def footprint_with_stored_bytes(get_memory_footprint):
    """Wrap `PreTrainedModel.get_memory_footprint`: a parameter that stores other tensors than its shape and dtype
    say (a QFT/ECO QParam: codes, scales, outliers; it presents itself as a bf16 weight) counts its `storage_bytes`."""

    @functools.wraps(get_memory_footprint)
    def wrapper(self, *args, **kwargs):
        mem = get_memory_footprint(self, *args, **kwargs)
        for p in self.parameters():
            stored = getattr(p, "storage_bytes", None)
            if isinstance(stored, int):
                mem += stored - p.nelement() * p.element_size()
        return mem

    wrapper.hfq_wrapped = get_memory_footprint
    return wrapper


def apply_keeping_buffer_dtypes(module: nn.Module, module_apply, fn, recurse: bool = True):
    """`module_apply(fn, recurse)` (the layer's nn.Module._apply) with its buffers (codes, scales) following device
    moves but never dtype casts: model.to(bfloat16) must not round stored scales."""
    keep = {k: b for k, b in module._buffers.items() if b is not None}
    out = module_apply(fn, recurse)
    for k, old in keep.items():
        new = module._buffers[k]
        if new.dtype != old.dtype:
            module._buffers[k] = old.to(new.device)
    return out


def refuse_offloading(device_map, method: str, why: str) -> None:
    """Raise ValueError (naming `method` and `why`) for a device_map that offloads: "disk", or "cpu" beside
    accelerators. accelerate then rebuilds the offloaded layers' weights at each forward."""
    places = {str(v) for v in device_map.values()} if isinstance(device_map, dict) else set()
    if "disk" in places or ("cpu" in places and len(places) > 1):
        raise ValueError(f"{method}: device_map places modules on {sorted(places)}; offloading to the CPU or disk is "
                         f"not supported ({why}). Load onto one device (device_map={{'': 'cuda:0'}} or 'cpu') or "
                         "spread over accelerators only (max_memory without 'cpu')")


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


NOT_CONVERTED = "modules_to_not_convert"


def _linear_like(mod: nn.Module) -> bool:
    """A layer a user would expect a linear quantization to cover: nn.Linear (or a subclass) or transformers'
    Conv1D (GPT-2 style [in, out] linear)."""
    return isinstance(mod, nn.Linear) or type(mod).__name__ == "Conv1D"


def matrices_outside_linears(mod: nn.Module) -> list[str]:
    """Names of the weight matrices a module that is no linear holds itself (fused MoE experts' 3-D
    gate_up_proj/down_proj, a router's 2-D weight); an embedding's table and a convolution's kernel are not."""
    if isinstance(mod, (nn.Embedding, nn.modules.conv._ConvNd)) or _linear_like(mod):
        return []
    return [k for k, p in mod.named_parameters(recurse=False) if p.dim() >= 2]


ROUTER = "MoE router: not an nn.Linear, kept in full precision"


def _unconverted_reason(mod: nn.Module) -> str | None:
    """Why a module that holds weights was left as it is; None for a module without weight matrices."""
    if _linear_like(mod):
        if isinstance(mod, nn.Linear):
            return (f"{type(mod).__name__} is a subclass of nn.Linear with its own forward, which hfq does not "
                    "replace (it converts exactly nn.Linear)")
        return f"{type(mod).__name__} is not an nn.Linear (hfq converts exactly nn.Linear)"
    mats = matrices_outside_linears(mod)
    if not mats:
        return None
    if type(mod).__name__.endswith("Router"):
        return ROUTER
    return (f"{type(mod).__name__} holds weight tensors {mats} that are not nn.Linear layers (fused MoE experts): "
            "hfq converts exactly nn.Linear, so they stay in full precision")


def check_conversion(method: str, model: nn.Module, converted: list[str], skip: list[str] | None,
                     reasons: dict[str, str] | None = None, strict: bool = False, warn: bool = True) -> dict:
    """The one check after a conversion: every linear-like layer or other holder of weight matrices (fused MoE
    experts) left unconverted gets a reason (the method's own from `reasons`, the skip rule's, or its type).
    Layers skipped by `modules_to_not_convert` are the user's choice, and MoE routers stay in full precision as
    everywhere; any other is a UserWarning naming it (with `warn`), a ValueError under `strict`, and a
    ValueError when nothing at all was converted. Returns the report {"quantized": [...], "skipped": {...}}."""
    done = set(converted)
    skipped, by_type = {}, set()
    for name, mod in model.named_modules():
        if name in done:
            continue
        why = _unconverted_reason(mod)
        if why is None:
            continue
        if reasons and name in reasons:
            skipped[name] = reasons[name]
        elif not should_convert(name, skip):
            skipped[name] = NOT_CONVERTED
        else:
            skipped[name] = why
            by_type.add(name)
    unexpected = {n: r for n, r in skipped.items() if r not in (NOT_CONVERTED, ROUTER)}
    listing = "; ".join(f"{n}: {r}" for n, r in list(unexpected.items() or skipped.items())[:8])
    more = f" (+{len(unexpected or skipped) - 8} more)" if len(unexpected or skipped) > 8 else ""
    if not converted:
        fix = ("hfq has no conversion for this architecture's layers" if skipped and set(skipped) <= by_type else
               "Change the config (modules_to_not_convert, format) for this model; with strict=True any layer "
               "that cannot be converted is an error naming it")
        raise ValueError(f"{method}: no layer was converted, so the model would load unquantized under a "
                         f"quantized config. Left as they were: {listing or 'no linear layers found'}{more}. {fix}")
    if unexpected and strict:
        raise ValueError(f"{method}: {len(unexpected)} layer(s) cannot be converted (strict=True): {listing}{more}")
    if unexpected and warn:
        warnings.warn(f"{method}: {len(unexpected)} of {len(unexpected) + len(converted)} layers left "
                      f"unquantized: {listing}{more}. strict=True refuses this instead; "
                      f"model.hfq_quantization_report['skipped'] lists them", UserWarning, stacklevel=3)
    return {"quantized": list(converted), "skipped": skipped}


def replace_linears(model: nn.Module, make: Callable[[str, nn.Linear], nn.Module | None], skip: list[str] | None,
                    skipped: dict[str, str] | None = None) -> list[str]:
    """Swap every `nn.Linear` (exact type) that the skip rule converts for `make(name, linear)`.

    `make` returns the new module, or None to keep the linear (it records why in `skipped` itself). All new
    modules are built before any is swapped in, so an error from `make` (it names the layer) leaves the model
    unchanged. Returns the converted names; `skipped` (if given) gets name -> reason for the others."""
    skipped = {} if skipped is None else skipped
    built = []
    for name, mod in list(model.named_modules()):
        if type(mod) is not nn.Linear:
            continue
        if not should_convert(name, skip):
            skipped[name] = NOT_CONVERTED
            continue
        new = make(name, mod)
        if new is not None:
            built.append((name, new))
    for name, new in built:
        set_submodule(model, name, new)
    return [name for name, _ in built]


class QuantizeOnLoad(ConversionOps):
    """Base of the loader ops that quantize one linear's full-precision weight as it is read (transformers calls
    `convert` once per weight for which the quantizer's `param_needs_quantization` is true).

    Subclasses implement `quantize(model, name, module, value)` and return the tensors to set. A ValueError is kept in
    `hf_quantizer.errors` (transformers would turn it into a generic error) for the quantizer to raise, naming
    the layer, after loading."""

    def __init__(self, hf_quantizer):
        self.hf_quantizer = hf_quantizer

    def quantize(self, model: nn.Module, name: str, module: nn.Module, value: torch.Tensor) -> dict:
        raise NotImplementedError

    @torch.no_grad()
    def convert(self, input_dict, model=None, missing_keys=None, **kwargs):
        key, value = next(iter(input_dict.items()))
        value = value[0] if isinstance(value, list) else value
        name = key.rsplit(".", 1)[0]
        if missing_keys is not None:
            missing_keys.discard(key)
        try:
            with switch_to_device_of(value) or contextlib.nullcontext():  # a layer loaded onto a non-current GPU
                return self.quantize(model, name, model.get_submodule(name), value)
        except ValueError as e:
            self.hf_quantizer.errors[name] = str(e)
            return {}


def refuse_quantized(model: nn.Module, what: str) -> None:
    """`what` (a function quantizing a built model) stops on a model that is quantized already, naming its method,
    instead of reporting that no layer could be converted."""
    q = getattr(model, "hf_quantizer", None)
    if getattr(model, "is_quantized", False) and q is not None:
        raise ValueError(f"{what}: the model is already quantized ({q.quantization_config.quant_method}); load the "
                         "dense checkpoint (without quantization_config) and quantize that")


def mark_quantized(model: nn.Module, quantizer, report: dict) -> None:
    """Make an already-built model what a quantize-on-load gives (quest.quantize_model, qft.quantize_model_, NVFP4
    calibrate): its config names the method so save_pretrained writes an hfq checkpoint, Trainer sees a
    quantized model, `hfq_quantization_report` is set and a load_state_dict passes over the guard."""
    config = quantizer.quantization_config
    model.config.quantization_config = config
    model.hf_quantizer = quantizer
    model.is_quantized = True
    model.quantization_method = config.quant_method
    model.hfq_quantization_report = report
    ignore_guard_on_state_dict_load(model, quantizer.layer_types)


class HfqQuantizer(HfQuantizer):
    """Base of hfq's HfQuantizers: their flags, and the checkpoint guard (`save_pretrained` writes it, a
    pre-quantized load expects it).

    `layer_types` are the method's converted layer classes; `variable_tensors` the names of their stored
    tensors whose length depends on the data (so the loader's placeholders cannot have it);
    `checkpoint_state(model)` is what the method saves (the model's state_dict unless it overrides it)."""

    requires_calibration = False
    # tensor names (after the layer's prefix) that only this method's checkpoints hold, all of them together
    SIGNATURES: dict[str, frozenset] = {}
    QUANT_METHOD = ""
    signature: frozenset = frozenset()
    layer_types: tuple = ()
    variable_tensors: tuple = ()
    qat_trainable = False
    compileable = False
    _guard_key: str | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.QUANT_METHOD and cls.signature:
            HfqQuantizer.SIGNATURES[cls.QUANT_METHOD] = cls.signature

    def __init__(self, quantization_config, **kwargs):
        requested = quantization_config.__dict__.pop("hfq_requested", None)  # set by get_loading_attributes
        if requested is not None:
            conflicts, kept = quantization_config.reload_differences(requested)
            if kept and not conflicts:
                warnings.warn(f"{quantization_config.quant_method} checkpoint: keeps its {', '.join(kept)} (the "
                              f"{type(quantization_config).__name__} passed has the defaults there); a reload takes "
                              f"only {list(quantization_config.RELOAD_OPTIONS)} from the config passed",
                              UserWarning, stacklevel=3)
            if conflicts:
                cfg = type(quantization_config).__name__
                raise ValueError(
                    f"{quantization_config.quant_method} checkpoint: the {cfg} passed to from_pretrained asks for "
                    f"{', '.join(conflicts)}. A reload keeps what the checkpoint was saved with and takes only "
                    f"{list(quantization_config.RELOAD_OPTIONS)} from the config passed; pass the checkpoint's values "
                    "for the rest, or no quantization_config")
        # the quantizer (and the model it marks) keeps its own validated copy: see HfqConfig.checked_copy
        super().__init__(quantization_config.checked_copy(), **kwargs)

    def validate_environment(self, *args, **kwargs):
        return

    def _dequantize(self, model, dtype=None):
        method = self.quantization_config.quant_method
        raise NotImplementedError(f"model.dequantize(): {method} has none (hfq offers it for hfq_nvfp4); its "
                                  f"{self.layer_types[0].__name__} layers stay as they are")

    def conversion_report(self, model: nn.Module, converted: list[str], skip: list[str] | None,
                          reasons: dict[str, str] | None = None) -> dict:
        """`check_conversion` for this load (warnings on a fresh load only: a reload would repeat them), kept as
        `model.hfq_quantization_report`."""
        cfg = self.quantization_config
        report = check_conversion(cfg.quant_method, model, converted, skip, reasons, cfg.strict,
                                  warn=not self.pre_quantized)
        model.hfq_quantization_report = report
        ignore_guard_on_state_dict_load(model, self.layer_types)
        return report

    def after_adapter_save(self, model: nn.Module, save_directory: str) -> None:
        """Called after transformers' own save_pretrained wrote an adapter (model.add_adapter) of this base."""

    def keep_new_heads_dense(self, model: nn.Module, names: list[str]) -> None:
        """Task heads the checkpoint has no tensors for (a classifier's `score` on a causal LM's checkpoint) stay
        dense and trainable as transformers leaves them: an hfq layer made for one is replaced by an nn.Linear the
        model's own init fills. They are reported as skipped, with a warning (an error under strict=True)."""
        cfg = self.quantization_config
        method = cfg.quant_method
        if cfg.strict:
            raise ValueError(f"{method}: {names[:10]} are {NEW_HEAD.split(':')[0]}; strict=True refuses to leave "
                             "them dense (add them to modules_to_not_convert to keep them so)")
        warnings.warn(f"{method}: {names[:10]} are {NEW_HEAD} (add them to modules_to_not_convert to say so and "
                      "silence this)", UserWarning, stacklevel=4)
        for name in names:
            mod = model.get_submodule(name)
            if type(mod) is not nn.Linear:
                set_submodule(model, name, dense_head(model, mod))
        report = getattr(model, "hfq_quantization_report", None)
        if report is not None:
            report["quantized"] = [n for n in report["quantized"] if n not in names]
            report["skipped"].update({n: NEW_HEAD for n in names})
        if isinstance(getattr(self, "converted", None), list):
            self.converted = [n for n in self.converted if n not in names]

    def refuse_weightless(self, model: nn.Module, names: list[str], label: str) -> None:
        """After a fresh load: layers `names` got no weight from the checkpoint. Task heads are new heads
        (`keep_new_heads_dense`); any other is a ValueError (a truncated or renamed checkpoint, or a layer new in this
        architecture)."""
        lost = [n for n in names if not task_head(model, n)]
        if lost:
            raise ValueError(f"{label}: no weight was found in the checkpoint for {lost[:10]}; {new_layers_fix(lost)}")
        if names:  # a classifier's `score` on a causal LM's checkpoint
            self.keep_new_heads_dense(model, names)

    def heads_kept_dense(self, model: nn.Module, skip: list[str] | None, checkpoint_files, index: dict,
                         index_tells: bool = True) -> dict[str, str]:
        """Pre-quantized load: the task heads (nn.Linear outside `base_model_prefix` that `skip` would convert) to
        leave dense, name -> reason: those the save recorded as written dense (a new head at the first load), or,
        for a checkpoint that does not record them, those the checkpoint holds none of this method's tensors for
        (`index_tells`: where the method's tensors differ from a dense layer's; with a `weight`: saved dense,
        without: a new head)."""
        heads = [n for n, m in model.named_modules()
                 if type(m) is nn.Linear and task_head(model, n) and should_convert(n, skip)]
        recorded = recorded_dense_heads(checkpoint_files)
        if recorded is not None:
            kept = {n: SAVED_DENSE_HEAD for n in heads if n in recorded}
        elif not index or not index_tells:
            kept = {}
        else:
            kept = {n: SAVED_DENSE_HEAD if f"{n}.weight" in index else NEW_HEAD for n in heads
                    if not any(f"{n}.{t}" in index for t in self.signature)}
        self._new_heads = [n for n, why in kept.items() if why == NEW_HEAD]  # announced by refuse_unloaded
        return kept

    def refuse_unloaded(self, model: nn.Module, names: list[str]) -> None:
        """After the loader ran: layers `names` of this method must have had every tensor filled from the
        checkpoint. A task head with none of its tensors there is a new head (`keep_new_heads_dense`); any other gap
        is a ValueError naming the tensors (the loader would leave them as uninitialised memory)."""
        missing = unloaded_tensors(model, names)
        heads = [n for n, (_, whole) in missing.items() if whole and task_head(model, n)]
        heads += [n for n in self.__dict__.pop("_new_heads", ()) if n not in heads]
        rest = [f"{n}.{k}" for n, (ks, _) in missing.items() if n not in heads for k in ks]
        if rest:
            method = self.quantization_config.quant_method
            raise ValueError(
                f"{method}: the checkpoint has no {', '.join(rest[:8])}{' ...' if len(rest) > 8 else ''} "
                f"({len(rest)} tensor(s) of {len(missing) - len(heads)} quantized layer(s)), which the load would "
                f"leave as uninitialised memory: the checkpoint is truncated or belongs to another architecture; "
                f"{new_layers_fix([n for n in missing if n not in heads])}")
        if heads:
            self.keep_new_heads_dense(model, heads)

    def check_checkpoint_method(self, index: dict) -> None:
        """A pre-quantized checkpoint whose tensors are another hfq method's than the one its config names is a
        ValueError saying which method it holds and which was asked for."""
        suffixes = {k.rpartition(".")[2] for k in index}
        asked = self.quantization_config.quant_method
        held = [m for m, sig in HfqQuantizer.SIGNATURES.items() if sig <= suffixes]
        if held and asked not in held:
            example = next(k for k in index if k.rpartition(".")[2] in HfqQuantizer.SIGNATURES[held[0]])
            raise ValueError(f"this checkpoint holds {' / '.join(held)} tensors (e.g. {example}) but its "
                             f"quantization_config asks for {asked}: the config does not belong to these weights")

    def is_serializable(self, *args, **kwargs):
        return True

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_qat_trainable(self) -> bool:
        return self.qat_trainable

    @property
    def is_compileable(self) -> bool:
        return self.compileable

    def checkpoint_state(self, model: nn.Module) -> dict:
        from torch.distributed.tensor import DTensor

        passed = PASSED_STATE_DICT.get()
        if any(isinstance(p, DTensor) for p in model.parameters()):
            if passed is None or any(isinstance(v, DTensor) for v in passed.values()):
                raise ValueError(
                    "save_pretrained of an FSDP2-sharded hfq model: transformers reads model.state_dict() on the "
                    "saving rank only, which would need every rank to gather the shards. Call "
                    "hfq.qparam.fsdp.save_pretrained_whole(model, save_directory) on every rank instead (with "
                    "Trainer: on trainer.model after training; trainer.save_model() writes nothing under "
                    "fsdp_state_dict_type SHARDED_STATE_DICT), or save FSDP2's sharded checkpoints")
            return whole_state_checked(self.state_keys(model), passed)
        return model.state_dict() if passed is None else checked_state_dict(model, passed)

    def state_keys(self, model: nn.Module) -> set:
        """The keys of model.state_dict(), on whichever ranks call it (save_pretrained runs on the main one only)."""
        return set(model.state_dict())

    def check_layers_kept(self, model: nn.Module) -> None:
        """Raise ValueError before a save whose quantization_config would not describe the layers: a layer this
        method converted (model.hfq_quantization_report) that is no longer one of its layers, e.g. a dense
        nn.Linear that PEFT's merge_and_unload() put in its place. Such a checkpoint could not be reloaded."""
        gone, wrapped = [], []
        adapter_save = getattr(model, "_hf_peft_config_loaded", False)  # transformers then saves the adapter only
        for name in getattr(model, "hfq_quantization_report", {}).get("quantized", ()):
            try:
                mod = model.get_submodule(name)
            except AttributeError:
                continue  # not part of this (sub)model
            if hasattr(mod, "base_layer") and not adapter_save:
                wrapped.append((name, bool(getattr(mod, "merged", False))))
            while hasattr(mod, "base_layer"):  # a PEFT wrapper: its base layer is what is saved
                mod = mod.base_layer
            if not isinstance(mod, self.layer_types):
                gone.append((name, type(mod).__name__))
        if wrapped:
            name, merged = next((w for w in wrapped if w[1]), wrapped[0])
            raise ValueError(
                f"save_pretrained: {len(wrapped)} quantized layer(s) carry PEFT adapter layers (e.g. {name}"
                f"{', merged into it by merge_adapter()' if merged else ''}): this model's save would write PEFT's "
                "base_layer / lora_* tensors, which no from_pretrained reads back. Save the adapter with "
                "peft_model.save_pretrained(dir) (the base checkpoint stays as it is)"
                f"{', after unmerge_adapter()' if merged else ''}; or fold it in and save the result: "
                "hfq.nvfp4.merge_and_requantize(peft_model) for NVFP4")
        if gone:
            name, kind = gone[0]
            method = self.quantization_config.quant_method
            can_dequantize = type(self)._dequantize is not HfqQuantizer._dequantize
            raise ValueError(
                f"save_pretrained: {len(gone)} layer(s) that {method} quantized are no longer {method} layers (e.g. "
                f"{name} is now {kind}; PEFT's merge_and_unload() puts dense layers in their place), so the saved "
                f"quantization_config would not describe them and the checkpoint could not be reloaded. "
                + ("To save a dense model call model.dequantize() first (it turns the remaining quantized layers "
                   "dense and drops the quantization_config); for NVFP4 + LoRA, hfq.nvfp4.merge_and_requantize("
                   "peft_model) instead of merge_and_unload() keeps the merged layers in NVFP4" if can_dequantize else
                   f"Put {self.layer_types[0].__name__} layers back in their place before saving ({method} has no "
                   "model.dequantize())"))

    def get_state_dict_and_metadata(self, model):
        self.check_layers_kept(model)
        state = dict(self.checkpoint_state(model))
        guard_state_dict(state, converted_names(model, self.layer_types))
        skipped = getattr(model, "hfq_quantization_report", {}).get("skipped", {})
        heads = [n for n, why in skipped.items() if why in (NEW_HEAD, SAVED_DENSE_HEAD)]
        return state, {"hfq": GUARD_DOC, DENSE_HEADS_KEY: json.dumps(heads)}

    def expect_guard(self, model: nn.Module) -> None:
        """Call after the surgery of a pre-quantized load."""
        names = converted_names(model, self.layer_types)
        self._guard_key = guard_key(names)
        ignore_guard_on_load(model, names)

    def shape_may_differ(self, param_name: str) -> bool:
        """Pre-quantized load: the guard and the variable-length tensors are exempt from the loader's shape check
        (transformers exempts the tensors for which `param_needs_quantization` is true)."""
        return bool(self.pre_quantized) and (param_name == self._guard_key
                                             or param_name.rpartition(".")[2] in self.variable_tensors)
