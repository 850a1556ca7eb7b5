"""What an hfq checkpoint holds and how a load of one is checked: the guard that stops a plain transformers load
(without `import hfq`) from loading silently wrong, the checks of a `state_dict=` given to save_pretrained, the
tensors a load must have filled, and the task heads a checkpoint keeps dense."""
from __future__ import annotations

import functools
import json
import re

import torch
from torch import nn


def checked_state_dict(model: nn.Module, passed: dict) -> dict:
    """A copy of the `state_dict=` given to save_pretrained, which must hold what model.state_dict() holds (the same
    keys, shapes and dtypes: codes and scales as they are), else ValueError naming the first difference."""
    ref = model.state_dict()
    missing, extra = sorted(set(ref) - set(passed)), sorted(set(passed) - set(ref))
    if missing or extra:
        raise ValueError(f"save_pretrained(state_dict=...) of a quantized model: the dict must have the keys of "
                         f"model.state_dict() ({len(missing)} missing, e.g. {missing[:3]}; {len(extra)} unknown, "
                         f"e.g. {extra[:3]}): edit a copy of model.state_dict()")
    for k, t in ref.items():
        v = passed[k]
        if not isinstance(v, torch.Tensor) or v.shape != t.shape or v.dtype != t.dtype:
            what = (f"{type(v).__name__}" if not isinstance(v, torch.Tensor)
                    else f"{tuple(v.shape)} {v.dtype}")
            raise ValueError(f"save_pretrained(state_dict=...): {k} is {what}, the model holds {tuple(t.shape)} "
                             f"{t.dtype} (quantized tensors are saved as they are stored: edit a copy of "
                             "model.state_dict())")
    return dict(passed)


def whole_state_checked(keys: set, passed: dict) -> dict:
    """The gathered state dict (hfq.qparam.fsdp.whole_state_dict) of an FSDP2-sharded model for its save: the keys
    of model.state_dict() (`keys`), every value a whole tensor."""
    odd = sorted(k for k, v in passed.items() if not isinstance(v, torch.Tensor))
    if set(passed) != keys or odd:
        raise ValueError("save_pretrained(state_dict=...) of an FSDP2-sharded model takes the dict of "
                         "hfq.qparam.fsdp.whole_state_dict(model) (gathered on every rank): "
                         f"{len(keys - set(passed))} keys missing, {len(set(passed) - keys)} unknown, "
                         f"non-tensors {odd[:3]}")
    return dict(passed)


def checkpoint_index(files) -> dict[str, tuple[str, tuple]]:
    """key -> (safetensors dtype, shape) of a checkpoint's files, read from their headers only."""
    from safetensors import safe_open

    index = {}
    for f in files or []:
        if not str(f).endswith(".safetensors"):
            raise ValueError(f"{f}: hfq checkpoints are safetensors only (pickle is never loaded)")
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                index[k] = (sl.get_dtype(), tuple(sl.get_shape()))
    return index


def raise_load_errors(method: str, errors: dict[str, str]) -> None:
    if errors:
        lines = "; ".join(f"{k}: {v}" for k, v in errors.items())
        raise ValueError(f"{method} quantization failed for {len(errors)} layer(s): {lines}")


# ----------------------------------------------------------------------------- checkpoint guard
# transformers skips a quantization_config whose quant_method it does not know (a warning) and loads the
# checkpoint into a plain model, re-initialising every quantized linear. It does refuse a checkpoint tensor
# whose shape differs from the model's (size mismatch, an error). So each hfq checkpoint stores the `weight`
# of its first converted layer in a shape no plain model has: empty when the layer keeps no `weight` (codes
# only), else with a leading dim of 1; hfq reads it back (`unguard_weight`). A second entry, NOTE_KEY (the
# note below as bytes), is named by the instruction itself: transformers lists it among the unexpected keys of
# the load report it logs just before that error, so the report says to `import hfq`. hfq's loads ignore both.
GUARD_DOC = ("this checkpoint was written by hfq; `import hfq` before loading it (without it transformers "
             "skips the unknown quant_method and would re-initialise the quantized layers)")
NOTE_KEY = "hfq checkpoint: run `import hfq` before from_pretrained, without it its quantized layers cannot load"


def converted_names(model: nn.Module, layer_types: tuple) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, layer_types)]


def guard_state_dict(state: dict, names: list[str]) -> dict:
    """Add the size-mismatch marker for the first converted layer of `names`, and the note, to `state`."""
    if not names:
        return state
    key = names[0] + ".weight"
    w = state.get(key)
    state[key] = torch.empty(0, dtype=torch.uint8) if w is None else w.unsqueeze(0).clone()
    state[NOTE_KEY] = torch.tensor(list(GUARD_DOC.encode()), dtype=torch.uint8)
    return state


def guard_key(names: list[str]) -> str | None:
    return names[0] + ".weight" if names else None


def ignore_guard_on_load(model: nn.Module, names: list[str]) -> None:
    """Tell transformers' loader not to report the empty marker and the note as unexpected keys."""
    key = guard_key(names)
    if key is None:
        return
    patterns = {re.escape(key) + "$", re.escape(NOTE_KEY) + "$"}
    model._keys_to_ignore_on_load_unexpected = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None)
                                                   or ()) | patterns


def _is_marker(t) -> bool:
    """The guard's tensor (empty, or a weight with a leading dim of 1), not a linear's 2-D weight."""
    return torch.is_tensor(t) and (t.numel() == 0 or t.dim() != 2)


def _note_guard_markers(layer_types: tuple, module: nn.Module, state_dict, *args) -> None:
    """load_state_dict pre-hook: remember which keys at the guarded layer's `weight` hold the guard's marker (a
    dense state dict has the layer's real weight there, an unexpected key the load must report)."""
    key = guard_key(converted_names(module, layer_types))
    module.__dict__["_hfq_markers"] = set() if key is None else {
        k for k, v in state_dict.items() if (k == key or k.endswith("." + key)) and _is_marker(v)}


def _drop_guard_keys(module: nn.Module, incompatible) -> None:
    """load_state_dict post-hook: the guard's marker and the note are hfq's, not unexpected keys (Trainer's
    resume would warn about them, a strict load would fail on them)."""
    markers = module.__dict__.pop("_hfq_markers", set())
    incompatible.unexpected_keys[:] = [k for k in incompatible.unexpected_keys
                                       if k not in markers and k != NOTE_KEY and not k.endswith("." + NOTE_KEY)]


def ignore_guard_on_state_dict_load(model: nn.Module, layer_types: tuple) -> None:
    """Let `model.load_state_dict` of an hfq checkpoint's tensors (Trainer's resume) pass over the guard; the
    guarded layer is looked up when the load runs, so this may be called before the conversion."""
    if getattr(model, "_hfq_guard_hook", None) is None:
        model.register_load_state_dict_pre_hook(functools.partial(_note_guard_markers, tuple(layer_types)))
        model._hfq_guard_hook = model.register_load_state_dict_post_hook(_drop_guard_keys)


def _nonfinite(t: torch.Tensor) -> bool:
    if t.dtype == torch.float8_e4m3fn:  # no Inf in this format; NaN is S.1111.111
        return bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any())
    return not bool(torch.isfinite(t).all())


def refuse_nonfinite(method: str, model: nn.Module, layer_types: tuple) -> None:
    """After a pre-quantized load: a NaN/Inf in a quantized layer's own float tensors (codes' scales, master
    weights, outliers) means a corrupt checkpoint; a ValueError names them instead of a model that outputs NaN."""
    def parts(key, t):  # a tensor subclass (QParam) is checked through its inner tensors
        if type(t) in (torch.Tensor, nn.Parameter):
            yield key, t
        elif hasattr(t, "__tensor_flatten__"):
            for inner in t.__tensor_flatten__()[0]:
                yield from parts(f"{key}_{inner}", getattr(t, inner))  # its checkpoint name

    bad = []
    for name, mod in model.named_modules():
        if not isinstance(mod, layer_types):
            continue
        for key, t in [*mod._parameters.items(), *mod._buffers.items()]:
            for part, u in parts(key, t) if t is not None else ():
                if u.is_floating_point() and u.device.type != "meta" and _nonfinite(u.detach()):
                    bad.append(f"{name}.{part}")
    if bad:
        raise ValueError(f"{method} checkpoint holds NaN/Inf in {len(bad)} quantized tensor(s) ({', '.join(bad[:5])}"
                         f"{', ...' if len(bad) > 5 else ''}): the file is corrupt; hfq does not load non-finite "
                         "quantized weights or scales")


def unguard_weight(w: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor | None:
    """The weight as [out, in] when `w` is that or the guarded [1, out, in]; None for the empty marker."""
    if w.numel() == 0:
        return None
    if tuple(w.shape) == (1, out_features, in_features):
        return w[0]
    return w


def new_layers_fix(names: list[str]) -> str:
    """What to do about layers a checkpoint lacks that are new in the model being loaded."""
    return ("if they are new in this architecture (e.g. a pooler a masked-LM checkpoint lacks), keep them out of "
            f"quantization, modules_to_not_convert=[..., {', '.join(repr(n) for n in names[:4])}], and transformers "
            "initialises them")


NEW_HEAD = "not in the checkpoint (a new head, initialised by transformers): kept dense and trainable"
SAVED_DENSE_HEAD = "saved dense in the checkpoint (a new head at the first load)"
DENSE_HEADS_KEY = "hfq_dense_heads"  # safetensors metadata of an hfq save: the task heads it wrote dense (JSON list)


def recorded_dense_heads(files) -> list[str] | None:
    """The task heads an hfq save recorded as written dense (DENSE_HEADS_KEY); None for files that do not say."""
    from safetensors import safe_open

    for f in files or []:
        if str(f).endswith(".safetensors"):
            with safe_open(str(f), framework="pt") as h:
                held = (h.metadata() or {}).get(DENSE_HEADS_KEY)
            if held is not None:
                return list(json.loads(held))
    return None


def task_head(model: nn.Module, name: str) -> bool:
    """Whether module `name` lies outside the base model (`base_model_prefix`): a task head such as a classifier's
    `score`, which a checkpoint of another head type does not have."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    return not prefix or not (name == prefix or name.startswith(prefix + "."))


def unloaded_tensors(model: nn.Module, names: list[str]) -> dict[str, tuple[list[str], bool]]:
    """name -> (the tensors of layer `name` that the load did not fill, whether that is all of them). transformers
    marks every tensor it loads `_is_hf_initialized`; a key missing from the checkpoint (or named otherwise) is left
    as `torch.empty` memory, since its weight init passes over hfq's layers. Offloaded (meta) tensors are not
    judged."""
    out = {}
    for name in names:
        mod = model.get_submodule(name)
        held = [(k, t) for k, t in mod._parameters.items() if t is not None]
        held += [(k, t) for k, t in mod._buffers.items() if t is not None and k not in mod._non_persistent_buffers_set]
        miss = [k for k, t in held if t.device.type != "meta" and not getattr(t, "_is_hf_initialized", False)]
        if miss:
            out[name] = (miss, len(miss) == len(held))
    return out


def dense_head(model: nn.Module, mod: nn.Module) -> nn.Linear:
    """A plain nn.Linear for hfq layer `mod` that the checkpoint held nothing for, on its device and in the dtype of
    its float parameters (else the model's), initialised by the model's own `_init_weights` as transformers does for a
    new head."""
    ts = [t for t in (*mod._parameters.values(), *mod._buffers.values()) if t is not None]
    dev = next((t.device for t in ts if t.device.type != "meta"), None)
    params = [p for p in mod._parameters.values() if p is not None] or list(model.parameters())
    dtype = next((p.dtype for p in params if p.is_floating_point()), torch.float32)
    lin = nn.Linear(mod.in_features, mod.out_features, getattr(mod, "bias", None) is not None, device=dev,
                    dtype=dtype)
    init = getattr(model, "_init_weights", None)
    if init is not None:
        init(lin)
    return lin
