"""Model surgery shared by NVFP4, QuEST and QFT: which linears are converted, the swap itself, and the
checkpoint guard that stops a plain transformers load (without `import hfq`) from loading silently wrong.

Skip rule (`modules_to_not_convert`): transformers' own (`should_convert_module` of the installed version,
called, so hfq and transformers' quantizers always agree) — a module is skipped when an entry, read as a regular
expression, matches the start of its full name ("model.layers.0" skips that block, "lm_head" skips `lm_head`;
transformers 5.23 adds that the match must end at a module boundary) or when the name ends with the entry
("down_proj" skips every `...mlp.down_proj`).
"""
from __future__ import annotations

import re
from typing import Callable

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.base import HfQuantizer
from transformers.quantizers.quantizers_utils import should_convert_module


def should_convert(name: str, skip: list[str] | None) -> bool:
    """True when module `name` is not matched by any `modules_to_not_convert` entry (transformers' rule)."""
    return should_convert_module(name, list(skip) if skip else None)


def modules_to_skip(model: nn.Module, config, add_default_skips: bool) -> list[str]:
    """The config's `modules_to_not_convert` plus the model's `_keep_in_fp32_modules`; with
    `add_default_skips` (or when the config's list is None) also transformers' defaults for the model
    (its output embedding and the modules tied to it)."""
    own = config.modules_to_not_convert
    if not hasattr(model, "get_output_embeddings"):  # a bare nn.Module: only the config's own list
        return list(own or [])
    return HfQuantizer.get_modules_to_not_convert(model, own, getattr(model, "_keep_in_fp32_modules", None),
                                                  add_default_skips=add_default_skips or own is None)


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


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
            skipped[name] = "modules_to_not_convert"
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
            return self.quantize(model, name, model.get_submodule(name), value)
        except ValueError as e:
            self.hf_quantizer.errors[name] = str(e)
            return {}


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
# note below as bytes), is listed among the unexpected keys of the load report that transformers prints
# with that error, so the report says to `import hfq`. hfq's own loads ignore both.
GUARD_DOC = ("this checkpoint was written by hfq; `import hfq` before loading it (without it transformers "
             "skips the unknown quant_method and would re-initialise the quantized layers)")
NOTE_KEY = "hfq_checkpoint.import_hfq_before_loading"


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


def unguard_weight(w: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor | None:
    """The weight as [out, in] when `w` is that or the guarded [1, out, in]; None for the empty marker."""
    if w.numel() == 0:
        return None
    if tuple(w.shape) == (1, out_features, in_features):
        return w[0]
    return w


class HfqQuantizer(HfQuantizer):
    """Base of hfq's HfQuantizers: their flags, and the checkpoint guard (`save_pretrained` writes it, a
    pre-quantized load expects it).

    `layer_types` are the method's converted layer classes; `variable_tensors` the names of their stored
    tensors whose length depends on the data (so the loader's placeholders cannot have it);
    `checkpoint_state(model)` is what the method saves (the model's state_dict unless it overrides it)."""

    requires_calibration = False
    layer_types: tuple = ()
    variable_tensors: tuple = ()
    qat_trainable = False
    compileable = False
    _guard_key: str | None = None

    def validate_environment(self, *args, **kwargs):
        return

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

        if any(isinstance(p, DTensor) for p in model.parameters()):
            raise ValueError(
                "save_pretrained of an FSDP2-sharded hfq model: transformers reads model.state_dict() on the saving "
                "rank only (it ignores state_dict=), which would need every rank to gather the shards. Gather on "
                "every rank instead: sd = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in "
                "model.state_dict().items()} (quantized weights come whole), then on rank 0 load sd into an "
                "unsharded copy of the model and save_pretrained that; or save FSDP2's sharded checkpoints "
                "(fsdp_state_dict_type: SHARDED_STATE_DICT)")
        return model.state_dict()

    def get_state_dict_and_metadata(self, model):
        state = dict(self.checkpoint_state(model))
        guard_state_dict(state, converted_names(model, self.layer_types))
        return state, {"hfq": GUARD_DOC}

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
