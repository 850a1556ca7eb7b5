"""LoRA on NVFP4Linear through the ordinary PEFT routes.

PEFT 0.21 picks a LoRA layer per target module in `LoraModel._create_new_module` (its dispatchers, then
`dispatch_default` for torch layers) and expands `target_modules="all-linear"` in
`tuners_utils._maybe_include_all_linear_layers` (nn.Linear / Conv1D only). NVFP4Linear is deliberately *not* an
nn.Linear subclass: it has no weight Parameter, and every nn.Linear consumer that writes `weight.data` (PEFT's own
LoRA/IA3/OFT merges, PiSSA/OLoRA init, weight init) would silently write into a temporary. So `import hfq` calls
`register_peft_dispatch()`, which extends exactly those two PEFT entry points, process-wide: LoRA wraps every
NVFP4Linear in `NVFP4LoraLinear`, and "all-linear" includes NVFP4Linear layers. That reaches every route that goes
through PEFT's LoRA injection: `peft.get_peft_model`, `PeftModel.from_pretrained`, `model.add_adapter`, TRL's
`peft_config`. Other PEFT methods keep refusing NVFP4Linear ("not supported"), and "all-linear" with them is refused
on a model with NVFP4 layers (they would adapt its dense linears alone). `modules_to_save` (PEFT's trainable copy,
`ModulesToSaveWrapper.update`) refuses a module that is or holds an NVFP4Linear: the copy would train none of it. It also extends the parameter count
behind `print_trainable_parameters()` (`PeftModel.get_nb_trainable_parameters`), which walks `parameters()` and would
leave out the NVFP4 weights (buffers), as bitsandbytes' 4-bit weights get their own case there.
"""
from __future__ import annotations

import functools
import inspect
import json
import os
import warnings

import torch
from torch import nn
from torch.nn.modules import module as _tm
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.tuners_utils import BaseTunerLayer, check_adapters_to_merge

from .._base.lora import dense_linear, lora_delta, merge_lora
from .linear import NVFP4Linear, codes_left_out

# init_lora_weights values that leave the base weight alone (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA rewrite it)
_BASE_PRESERVING_INITS = (True, False, "gaussian", "orthogonal", "eva")


class NVFP4LoraLinear(LoraLinear):
    """PEFT's LoRA Linear beside a frozen NVFP4Linear: y = base(x) + B(A(dropout(x))) * scaling.

    Adapters, dropout and mixed-adapter batches are PEFT's own; the plain case (one adapter, no hooks) runs the
    same sum in three products instead of PEFT's forward (`_fused`). merge() swaps the base for a dense
    nn.Linear in the model's dtype holding dequant(W) + BA (the NVFP4 base is kept for an exact unmerge), so
    `merge_and_unload()` yields a dense model; `hfq.nvfp4.merge_and_requantize` gives an NVFP4 one.
    """

    def __init__(self, base_layer, adapter_name: str, config, r: int = 0, lora_alpha: int = 1, **kwargs):
        if config.init_lora_weights not in _BASE_PRESERVING_INITS:
            raise ValueError(f"init_lora_weights={config.init_lora_weights!r} rewrites the base weight, which is "
                             f"frozen NVFP4 codes here; use one of {_BASE_PRESERVING_INITS}")
        if config.fan_in_fan_out:
            raise ValueError("fan_in_fan_out=True: NVFP4Linear stores its weight as [out, in]; set it to False")
        if isinstance(base_layer, NVFP4Linear) and base_layer._offloaded():
            raise ValueError("LoRA on an NVFP4 layer whose codes accelerate offloads (device_map to 'cpu'/'disk' with "
                             "offload_buffers=True): PEFT places adapters where the base weight is, here on 'meta', "
                             "so they would hold no values and train nothing. Keep the layers you adapt on a device "
                             "(device_map, max_memory), or load with offload_buffers=False, which keeps NVFP4 codes "
                             "on the execution device")
        super().__init__(base_layer, adapter_name, config=config, r=r, lora_alpha=lora_alpha, **kwargs)
        self._nvfp4_base = None  # the quantized base while merged

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """PEFT's forward, or, for the plain case, the same sum in three products (`_fused`)."""
        if not args and not kwargs:
            y = self._fused(x)
            if y is not None:
                return y
        return super().forward(x, *args, **kwargs)

    def _fused(self, x: torch.Tensor) -> torch.Tensor | None:
        """base(x) + B(A(dropout(x))) * scaling through NVFP4Linear.forward_lora, or None where PEFT's own forward
        must run: torch.compile tracing, adapters disabled or merged, not exactly one plain LoRA adapter active, hooks
        on the base or adapter modules (or global ones), a bias on A or B, or a call the base cannot take (see
        forward_lora: e.g. fp32 adapters on bf16 inputs outside autocast, where PEFT computes the adapter in fp32)."""
        base = self.base_layer
        if (torch.compiler.is_compiling() or self.disable_adapters or self.merged or not isinstance(base, NVFP4Linear)
                or _global_hooks()):
            return None
        active = self.active_adapters
        if len(active) != 1 or active[0] not in self.lora_A or active[0] in self.lora_variant:
            return None
        name = active[0]
        a, b, drop = self.lora_A[name], self.lora_B[name], self.lora_dropout[name]
        if (type(a) is not nn.Linear or type(b) is not nn.Linear or b.bias is not None or a.bias is not None
                or any(_hooked(m) for m in (base, a, b, drop))):
            return None
        return base.forward_lora(x, a.weight, b.weight, self.scaling[name],
                                 None if isinstance(drop, nn.Identity) else drop)

    @property
    def lora_variants(self):
        return {(): None}  # plain LoRA: DoRA & co. need a float base weight

    def resolve_lora_variant(self, *, config, **kwargs):
        try:
            return super().resolve_lora_variant(config=config, **kwargs)
        except ValueError as e:
            raise ValueError(f"LoRA on NVFP4Linear supports plain LoRA only (no DoRA/aLoRA/...): {e}") from None

    def _get_in_out_features(self, module):
        if isinstance(module, NVFP4Linear):
            return module.in_features, module.out_features
        return super()._get_in_out_features(module)

    def _get_base_layer_device_and_dtype(self, base_layer):
        if isinstance(base_layer, NVFP4Linear):  # without dequantizing the whole weight
            return base_layer.qweight.device, base_layer.weight_dtype
        return super()._get_base_layer_device_and_dtype(base_layer)

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        return lora_delta(self, adapter)

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        # as PEFT's Linear.merge: only the adapters this layer holds (a model-wide merge of an adapter that targets
        # other layers must leave this one, and its active adapters, unmerged)
        adapter_names = [a for a in check_adapters_to_merge(self, adapter_names) if a in self.lora_A]
        if not adapter_names:
            return
        base = self.get_base_layer()
        if isinstance(base, NVFP4Linear):
            w, b, dtype = base.dequantize(torch.float32), base.bias, base.weight_dtype
        else:  # already dense (another adapter was merged before)
            w, b, dtype = base.weight, base.bias, base.weight.dtype
        w, merged_b, _ = merge_lora(self, w, b, adapter_names, name=type(self).__name__)
        dense = dense_linear(w, merged_b, dtype)
        if isinstance(b, nn.Parameter) and b.requires_grad and torch.equal(merged_b.to(b.dtype), b.detach()):
            dense.bias = b  # a trainable base bias (bias="all"/"lora_only") stays the one parameter that trains
        if isinstance(base, NVFP4Linear):  # kept for unmerge outside the module tree: no parameters, no state keys
            object.__setattr__(self, "_nvfp4_base", base)
        self.base_layer = dense
        self.merged_adapters.extend(adapter_names)

    def unmerge(self) -> None:
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
            return
        self.merged_adapters.clear()
        self.base_layer, self._nvfp4_base = self._nvfp4_base, None  # exact: the codes were never touched

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if self._nvfp4_base is not None and any(k.startswith(prefix + "base_layer.weight_") for k in state_dict):
            # merged: the NVFP4 base is held aside for unmerge, so these codes would reach no layer and the old
            # ones would come back on unmerge
            error_msgs.append(f"{prefix}base_layer: NVFP4 base weights given while adapters are merged into this "
                              "layer (merge_adapter); call unmerge_adapter() before loading base weights")
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _apply(self, fn, recurse=True):
        if self._nvfp4_base is not None:  # .to()/.cuda() while merged move the kept base too
            self._nvfp4_base._apply(fn, recurse)
        return super()._apply(fn, recurse)


def _hooked(m: nn.Module) -> bool:
    """Torch hooks on m, or an accelerate hook (which replaces m.forward: an offloaded layer's tensors are brought in
    there, so a call that goes around m.forward would read them on meta)."""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                or "_hf_hook" in m.__dict__)


def _global_hooks() -> bool:
    return bool(_tm._global_forward_hooks or _tm._global_forward_pre_hooks or _tm._global_backward_hooks
                or _tm._global_backward_pre_hooks)


def _lora_for_nvfp4(create_new_module):
    """Wrap `LoraModel._create_new_module`: NVFP4Linear targets get NVFP4LoraLinear unless the config maps
    that type to a LoRA layer of its own (`LoraConfig._register_custom_module`)."""

    @functools.wraps(create_new_module)
    def _create_new_module(lora_config, adapter_name, target, **kwargs):
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        custom = lora_config._custom_modules or {}
        if isinstance(base, NVFP4Linear) and not any(isinstance(base, k) for k in custom):
            return NVFP4LoraLinear(target, adapter_name, config=lora_config, **kwargs)
        return create_new_module(lora_config, adapter_name, target, **kwargs)

    _create_new_module.hfq_wrapped = create_new_module
    return _create_new_module


def _all_linear_with_nvfp4(include_all_linear):
    """Wrap `_maybe_include_all_linear_layers`: for LoRA, "all-linear" also names every NVFP4Linear that is
    not already inside a PEFT layer."""
    from peft.utils import PeftType

    @functools.wraps(include_all_linear)
    def _maybe_include_all_linear_layers(peft_config, model):
        tm = getattr(peft_config, "target_modules", None)
        all_linear = isinstance(tm, str) and tm.lower() == "all-linear"
        peft_config = include_all_linear(peft_config, model)
        if not all_linear:
            return peft_config
        inside = {f"{p}.{s}" for p, m in model.named_modules() if isinstance(m, BaseTunerLayer)
                  for s, _ in m.named_modules() if s}
        nv = sorted({n for n, m in model.named_modules() if isinstance(m, NVFP4Linear)} - inside)
        if nv and peft_config.peft_type != PeftType.LORA:
            raise ValueError(
                f"target_modules='all-linear' with {peft_config.peft_type.value}: {len(nv)} linears of this model are "
                f"NVFP4Linear (e.g. {nv[0]}), which hfq supports with LoRA only; {peft_config.peft_type.value} would "
                "adapt the remaining dense linears alone. Use peft.LoraConfig, or name dense target_modules yourself")
        if nv:
            peft_config.target_modules = set(peft_config.target_modules) | set(nv)
        return peft_config

    _maybe_include_all_linear_layers.hfq_wrapped = include_all_linear
    return _maybe_include_all_linear_layers


def _refuse_nvfp4_modules_to_save(update):
    """Wrap `ModulesToSaveWrapper.update` (PEFT's trainable full copy of a `modules_to_save` module): a module that
    is or holds an NVFP4Linear is refused, since its copy would train nothing of those layers (their weights are
    frozen codes, not parameters)."""

    @functools.wraps(update)
    def update_checked(self, adapter_name, *args, **kwargs):
        held = [n for n, m in self.original_module.named_modules() if isinstance(m, NVFP4Linear)]
        if held:
            what = "is an NVFP4Linear" if held == [""] else f"holds NVFP4Linear layers ({held[0]}, ...)"
            raise ValueError(
                f"modules_to_save: the module for adapter {adapter_name!r} {what}, whose weights are frozen NVFP4 "
                "codes: a trainable copy of it would train none of them. Put those layers in target_modules (LoRA), "
                "or keep them out of quantization with NVFP4Config(modules_to_not_convert=[...]) to train them fully")
        return update(self, adapter_name, *args, **kwargs)

    update_checked.hfq_wrapped = update
    return update_checked


def _count_nvfp4_weights(get_nb):
    """get_nb_trainable_parameters plus the frozen NVFP4 weights' logical elements (out x in each); a merged layer's
    dense copy is an ordinary parameter."""

    @functools.wraps(get_nb)
    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        trainable, total = get_nb(self)
        total += sum(m.in_features * m.out_features for m in self.modules() if isinstance(m, NVFP4Linear))
        return trainable, total

    get_nb_trainable_parameters.hfq_wrapped = True
    return get_nb_trainable_parameters


def _codes_left_out_of_state_dict(fn, after):
    """PeftModel.save_pretrained / load_adapter (Trainer's and TRL's checkpoints and resumes of a LoRA run too, and
    PeftModel.from_pretrained) with the NVFP4 codes left out of the model's state_dict(), which PEFT reads whole to
    save or to match adapter keys: adapters hold none of them (NVFP4 layers are refused in modules_to_save), and a g4
    base would otherwise be converted back and copied to host memory, whole, each time. Then `after(model, args)`
    with fn's arguments by name: a save records the base's quantization (BASE_RECORD beside adapter_config.json),
    a load onto a base without NVFP4 layers names it in a warning."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        with codes_left_out():
            out = fn(self, *args, **kwargs)
        after(self, sig.bind(self, *args, **kwargs).arguments)
        return out

    wrapper.hfq_wrapped = True
    return wrapper


BASE_RECORD = "hfq_base.json"  # an adapter's base quantization, written beside adapter_config.json


def _nvfp4_config(model) -> dict | None:
    """The quantization_config of a (PEFT) model's base when it holds NVFP4 layers, else None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not any(isinstance(m, NVFP4Linear) for m in base.modules()):
        return None
    qc = getattr(getattr(base, "config", None), "quantization_config", None)
    qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(qc or {})
    return {k: v for k, v in qc.items() if k in ("quant_method", "format", "compute_dtype", "scales",
                                                 "modules_to_not_convert")} or {"quant_method": "hfq_nvfp4"}


def record_base(model, folders) -> None:
    """BASE_RECORD beside the adapter_config.json of each of `folders` when the model's base holds NVFP4 layers."""
    qc = _nvfp4_config(model)
    for folder in folders if qc is not None else ():
        if os.path.isfile(os.path.join(folder, "adapter_config.json")):
            with open(os.path.join(folder, BASE_RECORD), "w") as f:
                json.dump({"quantization_config": qc}, f, indent=1)


def _record_base(model, a: dict) -> None:
    """After PeftModel.save_pretrained: record_base for each saved adapter's folder."""
    if a.get("is_main_process", True):
        record_base(model, [a["save_directory"] if name == "default" else os.path.join(a["save_directory"], name)
                            for name in a.get("selected_adapters") or list(model.peft_config)])


def _check_base(model, a: dict) -> None:
    """After load_adapter (PEFT's, or transformers' own with peft_model_id): warn when the adapter at model_id (a
    folder, or a Hub repo where reachable) was trained on an NVFP4 base and this base has none."""
    if _nvfp4_config(model) is not None:
        return
    model_id = a["model_id"] if "model_id" in a else a.get("peft_model_id")
    if model_id is None:  # transformers' load_adapter from a state dict: no folder to read
        return
    adapter_name = a.get("adapter_name") or "default"
    given = {**(a.get("kwargs") or {}), **(a.get("adapter_kwargs") or {})}  # PEFT's / transformers' hub arguments
    if a.get("local_files_only"):
        given["local_files_only"] = True
    hub = {k: given[k] for k in ("revision", "token", "cache_dir", "local_files_only", "proxies")
           if given.get(k) is not None}
    subfolder = given.get("subfolder")
    path = os.path.join(str(model_id), subfolder or "", BASE_RECORD)
    if not os.path.isdir(str(model_id)):  # a Hub repo: the record was uploaded with the adapter, if hfq saved it
        try:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(str(model_id), BASE_RECORD, subfolder=subfolder or None, **hub)
        except Exception:  # noqa: BLE001 - no record (another tool saved it), offline: nothing to compare
            return
    if not os.path.isfile(path):
        return
    with open(path) as f:
        qc = json.load(f).get("quantization_config") or {}
    args = ", ".join(f"{k}={v!r}" for k, v in qc.items() if k in ("format", "scales") and v is not None)
    warnings.warn(f"adapter {adapter_name!r} ({model_id}) was trained on an NVFP4 base (hfq_nvfp4, {BASE_RECORD}) "
                  f"but this base holds no NVFP4 layers: its outputs are not the policy as trained. Load the base "
                  f"with quantization_config=hfq.NVFP4Config({args}) (AutoPeftModelForCausalLM.from_pretrained "
                  "passes it on too)", UserWarning, stacklevel=3)


def check_peft() -> None:
    """ImportError unless PEFT has the entry points hfq wraps (checked before anything is patched)."""
    from peft.tuners import tuners_utils
    from peft.tuners.lora.model import LoraModel

    missing = [n for n, owner in (("LoraModel._create_new_module", LoraModel),
                                   ("tuners_utils._maybe_include_all_linear_layers", tuners_utils))
               if not hasattr(owner, n.rpartition(".")[2])]
    if missing:
        raise ImportError(f"hfq: this PEFT version lacks {missing}, through which hfq lets LoRA wrap NVFP4Linear; "
                          "install a PEFT release hfq supports (see setup.cfg)")


def register_peft_dispatch() -> bool:
    """Teach PEFT's LoRA, process-wide, to wrap NVFP4Linear (see the module docstring). Called on `import hfq`;
    idempotent. Returns True when it installed the hooks now, False when they were already in place."""
    from peft import PeftMixedModel, PeftModel
    from peft.tuners import tuners_utils
    from peft.tuners.lora.model import LoraModel
    from peft.utils.other import ModulesToSaveWrapper

    check_peft()
    if getattr(LoraModel, "_hfq_nvfp4_dispatch", False):  # kept on PEFT's class: a reload of this module sees it
        return False
    LoraModel._create_new_module = staticmethod(_lora_for_nvfp4(LoraModel._create_new_module))
    tuners_utils._maybe_include_all_linear_layers = _all_linear_with_nvfp4(tuners_utils._maybe_include_all_linear_layers)
    if hasattr(ModulesToSaveWrapper, "update"):
        ModulesToSaveWrapper.update = _refuse_nvfp4_modules_to_save(ModulesToSaveWrapper.update)
    for owner in (PeftModel, PeftMixedModel):
        if hasattr(owner, "get_nb_trainable_parameters"):
            owner.get_nb_trainable_parameters = _count_nvfp4_weights(owner.get_nb_trainable_parameters)
    for name, after in (("save_pretrained", _record_base), ("load_adapter", _check_base)):
        if not hasattr(getattr(PeftModel, name), "hfq_wrapped"):
            setattr(PeftModel, name, _codes_left_out_of_state_dict(getattr(PeftModel, name), after))
    from transformers.integrations.peft import PeftAdapterMixin  # model.add_adapter / model.load_adapter

    if not hasattr(PeftAdapterMixin.load_adapter, "hfq_wrapped"):
        PeftAdapterMixin.load_adapter = _codes_left_out_of_state_dict(PeftAdapterMixin.load_adapter, _check_base)
    LoraModel._hfq_nvfp4_dispatch = True
    return True


def register_lora(lora_config):
    """Map NVFP4Linear to NVFP4LoraLinear on one LoraConfig. Not needed after `import hfq` (every config gets
    it); kept for code written against earlier hfq. Returns the config."""
    lora_config._register_custom_module({NVFP4Linear: NVFP4LoraLinear})
    return lora_config


def get_peft_model(model, lora_config, **kwargs):
    """`peft.get_peft_model` (which handles NVFP4 after `import hfq`) plus `mark_ddp_ignore` on the result (which
    DDP's construction also runs on whatever it wraps, after `import hfq`)."""
    import peft

    from .linear import mark_ddp_ignore

    pm = peft.get_peft_model(model, lora_config, **kwargs)
    mark_ddp_ignore(pm)
    return pm
