"""`QFTHfQuantizer`: transformers' hook for `hfq_qft`.

Fresh load (a float checkpoint): each eligible nn.Linear stays a meta placeholder; the loader hands its weight
to `QFTQuantize`, which quantizes it into a QLinear there and then (the float copy is dropped layer by layer, so
the full-precision model never exists). Pre-quantized load (an hfq_qft checkpoint): QLinear placeholders expose
`weight_codes`, `weight_scales`, ... buffers that the loader fills; they become the QParam afterwards.
"""
from __future__ import annotations

import re
import warnings
from types import SimpleNamespace

import torch
from torch import nn

from .._base.checkpoint import checkpoint_index, raise_load_errors, refuse_nonfinite
from .._base.surgery import (PASSED_STATE_DICT, HfqQuantizer, QuantizeOnLoad, check_conversion, mark_quantized,
                             modules_to_skip, refuse_quantized, refuse_offloading, replace_linears, set_submodule,
                             should_convert)
from ..qparam import QLinear, ddp_ignore_int8_grad_weights_, name_qparams_
from ..qparam.fsdp import decode_lists
from ..qparam.fsdp import state_keys as fsdp_state_keys
from .config import QFTConfig
from .linear import convert_linears_, finalize_, layer_maker


class QFTQuantize(QuantizeOnLoad):
    """Loader op: receives one linear's full-precision weight and swaps the linear for its QLinear."""

    def quantize(self, model, name, module, value):
        make = layer_maker(self.hf_quantizer.quantization_config)
        layer = make(name, SimpleNamespace(weight=nn.Parameter(value), bias=module.bias))
        layer.weight._is_hf_initialized = True  # loaded: a parent's _init_weights (T5, CLIP) must not write it
        set_submodule(model, name, layer)
        self.hf_quantizer.note_error(name, value, layer)
        return {}


class QFTHfQuantizer(HfqQuantizer):
    quantization_config: QFTConfig
    QUANT_METHOD = QFTConfig.QUANT_METHOD
    signature = frozenset({"weight_codes", "weight_scales"})
    layer_types = (QLinear,)
    qat_trainable = True
    variable_tensors = ("weight_sparse_idx", "weight_sparse_val")

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.converted: list[str] = []
        self.errors: dict[str, str] = {}
        self._skip: list[str] = []
        self.lossy: dict[str, float] = {}  # layer -> relative quantization error above LOSSY (a fresh load)

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        if self.pre_quantized:
            return self.shape_may_differ(param_name)
        name, _, tensor = param_name.rpartition(".")
        if tensor != "weight" or not should_convert(name, self._skip):
            return False
        try:
            return type(model.get_submodule(name)) is nn.Linear
        except AttributeError:
            return False

    def validate_environment(self, *args, device_map=None, **kwargs):
        """A device_map that offloads (to "disk", or "cpu" beside accelerators) is refused: accelerate's offload
        rebuilds each weight as a plain tensor, which a QParam is not."""
        refuse_offloading(device_map, "QFT/ECO (hfq_qft)", "for QParam weights")

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        cfg = self.quantization_config
        self._skip = modules_to_skip(model, cfg, False)
        _refuse_tied_head(model, self._skip)
        if self.pre_quantized:
            index = checkpoint_index(checkpoint_files) if checkpoint_files else {}
            if index:
                self.check_checkpoint_method(index)
            # task heads saved dense (kept so at the first load) stay dense; so do those an older checkpoint lacks
            self._reasons = self.heads_kept_dense(model, self._skip, checkpoint_files, index)
            keep = [f"^{re.escape(n)}$" for n in self._reasons]
            self.converted = convert_linears_(model, cfg, placeholder=True, keep=keep)
            self.expect_guard(model)
        else:  # the loader converts these as their weights arrive (param_needs_quantization)
            self.converted = [n for n, m in model.named_modules()
                              if type(m) is nn.Linear and should_convert(n, self._skip)]
        self.conversion_report(model, self.converted, self._skip, getattr(self, "_reasons", None))
        return model

    def get_quantize_ops(self):
        return QFTQuantize(self)

    def state_keys(self, model):
        return fsdp_state_keys(model)  # no gather: Trainer saves an FSDP2 model's gathered dict on one rank

    def checkpoint_state(self, model):
        passed = PASSED_STATE_DICT.get()
        if passed is None:
            return super().checkpoint_state(model)
        token = PASSED_STATE_DICT.set(decode_lists(passed))  # an FSDP2 full state dict carries outlier lists as bytes
        try:
            return super().checkpoint_state(model)
        finally:
            PASSED_STATE_DICT.reset(token)

    def _process_model_after_weight_loading(self, model, **kwargs):
        raise_load_errors("QFT", self.errors)
        if self.pre_quantized:
            self.refuse_unloaded(model, self.converted)
            finalize_(model)
            refuse_nonfinite("hfq_qft", model, self.layer_types)
        else:
            self.refuse_weightless(  # the linears the loader gave no weight to quantize stayed nn.Linear
                model, [n for n, m in model.named_modules() if type(m) is nn.Linear and should_convert(n, self._skip)],
                "QFT")
            self.converted = [n for n, m in model.named_modules() if isinstance(m, QLinear)]
            self._warn_lossy(model)
        ddp_ignore_int8_grad_weights_(model)
        name_qparams_(model)
        return model


    def note_error(self, name: str, w: torch.Tensor, layer: QLinear) -> None:
        """Record how much of weight `w` the format lost in `layer` when that is above LOSSY (see _warn_lossy)."""
        with torch.no_grad():
            w = w.detach().float()
            rel = float((layer.weight.dequantize(torch.float32) - w).norm() / w.norm().clamp_min(1e-30))
        if rel > LOSSY:
            self.lossy[name] = rel

    def _warn_lossy(self, model: nn.Module) -> None:
        """A format that loses most of a pretrained layer (int4_tensor's one scale per tensor on heavy-tailed
        weights: ||Q(W) - W|| / ||W|| near 1) would start fine-tuning from noise: a warning names the worst layers;
        the errors are in model.hfq_quantization_report['relative_error']."""
        if not self.lossy:
            return
        report = getattr(model, "hfq_quantization_report", None)
        if report is not None:
            report["relative_error"] = dict(self.lossy)
        worst = sorted(self.lossy.items(), key=lambda kv: -kv[1])[:3]
        fmt = self.quantization_config.weight_format
        warnings.warn(f"QFT/ECO ({fmt}): {len(self.lossy)} of {len(self.converted)} layers keep less than half of "
                      f"their weight (relative error ||Q(W) - W|| / ||W|| above {LOSSY}; worst "
                      f"{', '.join(f'{n} {e:.2f}' for n, e in worst)}); training starts from a damaged model. A "
                      "finer format suits pretrained weights (int4_group, fp8_e4m3_row, int8_dense_sparse); "
                      "int4_tensor's one scale per tensor suits weights trained in it from scratch",
                      UserWarning, stacklevel=3)


LOSSY = 0.5  # relative quantization error of a layer above which a fresh load warns (QFTHfQuantizer._warn_lossy)


def _refuse_tied_head(model: nn.Module, skip: list[str]) -> None:
    """An output head tied to the input embeddings would become its own QParam: untied silently, and the saved
    checkpoint (still tie_word_embeddings) could not be reloaded. Refused, naming the entry that keeps it out."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if not isinstance(head, nn.Linear) or not getattr(cfg, "tie_word_embeddings", False):
        return
    name = next(n for n, m in model.named_modules() if m is head)
    if should_convert(name, skip):
        raise ValueError(f"QFT/ECO (hfq_qft): {name} is tied to the input embeddings (tie_word_embeddings=True); "
                         "quantizing it would untie them and the checkpoint could not be reloaded. Keep it out: "
                         f"modules_to_not_convert=[{name!r}, ...] (the default when modules_to_not_convert is None)")


def quantize_model_(model: nn.Module, config) -> list[str]:
    """Quantize an already-built model (e.g. from_config for pretraining) in place per a QFTConfig; the model is
    marked quantized with `hfq_qft` so that save_pretrained writes an hfq checkpoint."""
    refuse_quantized(model, "qft.quantize_model_")
    quantizer = QFTHfQuantizer(config, pre_quantized=False)
    config = quantizer.quantization_config
    skip = modules_to_skip(model, config, False)
    _refuse_tied_head(model, skip)
    make = layer_maker(config)

    def make_and_check(name, linear):
        layer = make(name, linear)
        quantizer.note_error(name, linear.weight, layer)
        return layer

    names = replace_linears(model, make_and_check, skip)
    report = check_conversion(config.quant_method, model, names, skip, strict=config.strict)
    model.hfq_quantization_report = report
    quantizer.converted = names
    quantizer._warn_lossy(model)
    ddp_ignore_int8_grad_weights_(model)
    name_qparams_(model)
    if hasattr(model, "config"):
        mark_quantized(model, quantizer, report)
    return names
