"""TRL's fused LM head on a quantized output head: refused, saying what to do.

DPOTrainer, GRPOTrainer (QeRLGRPOTrainer too) and KTOTrainer call `trl.trainer.utils.add_fused_lm_head(model)` and
score log-probabilities with `model(..., fused_lm_head=True)`, which multiplies the hidden states by
`lm_head.weight` itself: the head's own forward never runs. For a QuEST head that weight is the full-precision
master (the trainer would silently never see the head's quantization); for a QFT/ECO head it is a QParam the product
cannot take. hfq does not import TRL: the wrap is put into `trl.trainer.utils` when that module is imported (or at
once, where it already is), before the trainers bind the name.
"""
from __future__ import annotations

import functools
import importlib.abc
import sys

_MODULE = "trl.trainer.utils"
_NAME = "add_fused_lm_head"


def refusing_quantized_heads(add_fused_lm_head):
    @functools.wraps(add_fused_lm_head)
    def wrapper(model, *args, **kwargs):
        from .surgery import HfqQuantizer

        q = getattr(model, "hf_quantizer", None)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if isinstance(q, HfqQuantizer) and head is not None and isinstance(head, q.layer_types):
            name = next((n for n, m in model.named_modules() if m is head), "lm_head")
            method = q.quantization_config.quant_method
            what = ("its full-precision master weight, so the trainer would never see the head's quantization"
                    if method == "hfq_quest" else "a quantized parameter that product cannot take")
            raise ValueError(
                f"TRL's fused LM head (model(..., fused_lm_head=True), which DPOTrainer / GRPOTrainer / "
                f"QeRLGRPOTrainer / KTOTrainer score log-probabilities with) multiplies by `{name}.weight` itself; "
                f"`{name}` is a {method} {type(head).__name__} here, whose weight is {what}. Keep the output head "
                f"unquantized: leave '{name}' in modules_to_not_convert (None, the default, keeps it out)")
        return add_fused_lm_head(model, *args, **kwargs)

    wrapper.hfq_wrapped = add_fused_lm_head
    return wrapper


def _wrap(module) -> None:
    fn = getattr(module, _NAME, None)
    if fn is None or hasattr(fn, "hfq_wrapped"):
        return
    wrapped = refusing_quantized_heads(fn)
    for mod in [m for k, m in list(sys.modules.items()) if k == "trl" or k.startswith("trl.")]:
        if getattr(mod, _NAME, None) is fn:  # modules that bound the name already (trl imported before hfq)
            setattr(mod, _NAME, wrapped)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for `trl.trainer.utils`, it lets the other finders find it and wraps the name once the
    module has run."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                run = spec.loader.exec_module

                def exec_module(module, run=run):
                    run(module)
                    _wrap(module)

                spec.loader.exec_module = exec_module
                return spec
        return None


def install() -> None:
    """Wrap add_fused_lm_head now where TRL is loaded, else when it is; idempotent (a reload of this module too)."""
    if _MODULE in sys.modules:
        _wrap(sys.modules[_MODULE])
    elif not any(type(f).__name__ == _AfterImport.__name__ and type(f).__module__ == __name__ for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
