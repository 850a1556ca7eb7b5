"""QLinear, the Linear-like module that owns a QParam, and `qlinear`, its autograd function: the forward never
keeps a full-precision weight (the decoded weight is a temporary, recomputed in backward), and the state_dict
stores the codes and scales as such (`<prefix>weight_codes`, `<prefix>weight_scales`, ...), so safetensors,
`save_pretrained`, `load_state_dict` and Trainer checkpoints work unchanged."""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from hfq_kernels._triton import checkpointing as _checkpointing
from hfq_kernels._triton import on_device_of
from . import formats as _formats
from .formats import check_format, check_qtensors, empty_qtensors
from .fsdp import (LIST_DTYPES, Gathering, forget_outliers_, gather_whole, list_from_bytes, list_to_bytes, local,
                   local_rows, rows_of)
from .int8grad import accumulate_int8_grad_, accumulate_sharded_int8_grad_, mean_over_ranks_then
from .tensor import QParam


class _QLinearFn(torch.autograd.Function):
    """y = x W^T + b with W dequantized on the fly; backward re-dequantizes (nothing full-precision saved; under
    activation checkpointing the recompute's decoded weight serves the backward right after it).

    dL/dW becomes W's bf16 `.grad`, or with `store_int8` goes to W's INT8 store (W.grad, an Int8Grad), averaged over
    ranks first when distributed: the float dL/dW then exists only inside this backward (one layer at a time) and
    autograd gets None for W. If W has a `grad_consumer` attribute (a callable(w, grad, name), set by
    hfq.qft.step_in_backward_), that float dL/dW goes to it instead of the INT8 store."""

    @staticmethod
    def forward(ctx, x, w, b, store_int8=False, name=None):
        ctx.w, ctx.store_int8 = w, store_int8
        # the weight's own name is looked up in backward, where only the INT8 store (run eagerly) reads it: a traced
        # read of a per-layer name here would guard every compiled layer on it and recompile per layer
        ctx.name = name
        ctx.has_b = b is not None
        wd = w.dequantize(x.dtype)
        # Under activation checkpointing the decoded weight is a saved tensor too: checkpointing drops it after the
        # forward and its recompute hands the backward a fresh one (one layer's worth), so dL/dx needs no decode.
        ctx.keep_w = _checkpointing()
        ctx.save_for_backward(x, wd) if ctx.keep_w else ctx.save_for_backward(x)
        return F.linear(x, wd, b if b is None or b.dtype == x.dtype else b.to(x.dtype))  # in x's dtype, as W

    @staticmethod
    def backward(ctx, gy):
        x, *kept = ctx.saved_tensors
        wd = kept[0] if kept else None
        w = ctx.w
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = gy @ (wd if wd is not None and wd.dtype == gy.dtype else w.dequantize(gy.dtype))
        del wd, kept
        if ctx.needs_input_grad[1]:
            gw = gy.reshape(-1, gy.shape[-1]).t() @ x.reshape(-1, x.shape[-1]).to(gy.dtype)
            shard = getattr(w, "fsdp_shard", None)
            name = (ctx.name or w.place.name) if ctx.store_int8 else None
            if ctx.store_int8 and shard is not None:  # FSDP2: w is the gathered weight of a sharded parameter
                if getattr(w, "grad_consumer", None) is not None:
                    raise NotImplementedError(f"{name or 'a quantized weight'}: QLion's step in backward "
                                              "(step_in_backward_) does not run under FSDP2; use the optimizer step")
                accumulate_sharded_int8_grad_(*shard, gw, name)
                gw = None
            elif ctx.store_int8:
                store = getattr(w, "grad_consumer", None) or accumulate_int8_grad_
                mean_over_ranks_then(gw, lambda g: store(w, g, name), name)
                gw = None
            else:
                gw = gw.to(w.dtype)
        if ctx.has_b and ctx.needs_input_grad[2]:
            gb = gy.reshape(-1, gy.shape[-1]).sum(0)
        return gx, gw, gb, None, None


_FP16_WARNED: list = []


def _warn_fp16_loss_scaling(name: str) -> None:
    """Once per process: a quantized weight trained under fp16 autocast on CUDA (where fp16 loss scaling is the rule)
    gets a bf16 gradient, which GradScaler cannot unscale there: torch's CUDA unscale kernel has no bf16 variant and
    raises NotImplementedError at the first unscale_/step. INT8 gradients (their own unscale) are not affected."""
    if _FP16_WARNED:
        return
    _FP16_WARNED.append(name)
    warnings.warn(f"{name or 'a quantized weight'}: QFT/ECO quantized weights have bf16 gradients, which fp16 loss "
                  "scaling (GradScaler: Trainer fp16=True, accelerate mixed_precision='fp16') cannot unscale on CUDA "
                  "(torch raises NotImplementedError ... 'BFloat16' at the first step); train with bf16 (bf16=True) "
                  "or with QFT's INT8 gradients (QFTConfig(gradient_bits=8))", UserWarning, stacklevel=3)


def qlinear(x: torch.Tensor, w: QParam, b: torch.Tensor | None = None, *, store_int8: bool = False,
            name: str | None = None) -> torch.Tensor:
    """F.linear for a QParam weight; `store_int8` keeps dL/dW as INT8 (named `name` in errors) instead of .grad."""
    if (not store_int8 and x.is_cuda and w.requires_grad and torch.is_grad_enabled()
            and torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.float16):
        _warn_fp16_loss_scaling(name or w.place.name)
    return _QLinearFn.apply(x, w, b, store_int8, name)


class QLinear(nn.Module):
    """Linear layer whose weight is a QParam. state_dict keys: weight_<name> for each stored tensor, bias.

    Not an nn.Linear subclass on purpose: model code that re-initialises every nn.Linear in place
    (transformers' _init_weights) must not touch the codes."""

    full_tuning_method = "QFT/ECO"  # trains its own quantized weight: no PEFT adapters (hfq._base.peft_guard)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, weight_format: str = "fp8_e4m3_row",
                 device=None, dtype=None, placeholder: bool = False, **meta):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight_format = weight_format
        self.weight_meta = check_format(weight_format, (out_features, in_features), meta)
        data = empty_qtensors(weight_format, (out_features, in_features), self.weight_meta, device)
        if placeholder:  # loading a pre-quantized checkpoint: plain buffers the loader fills, then finalize()
            self.weight = None
            for k, t in data.items():
                self.register_buffer("weight_" + k, t)
        else:
            self.weight = nn.Parameter(QParam(data, weight_format, (out_features, in_features), self.weight_meta),
                                       requires_grad=True)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype or torch.bfloat16)) \
            if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Module, weight_format: str = "fp8_e4m3_row", rounding: str = "rtn",
                    generator: torch.Generator | None = None, **meta) -> "QLinear":
        """Quantize an nn.Linear; the float weight is not kept."""
        w = linear.weight
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.in_features, out.out_features = w.shape[1], w.shape[0]
        out.weight_format = weight_format
        out.weight_meta = check_format(weight_format, tuple(w.shape), meta)
        out.weight = nn.Parameter(QParam.from_float(w.detach(), weight_format, rounding, generator,
                                                    **out.weight_meta), requires_grad=w.requires_grad)
        out.bias = linear.bias
        return out

    def finalize(self, name: str = "") -> None:
        """Turn loaded placeholder buffers into the QParam weight (checked first; `name` prefixes errors)."""
        if self.weight is not None:
            return
        names = _formats._NAMES[self.weight_format]
        check_qtensors(self.weight_format, (self.out_features, self.in_features), self.weight_meta,
                       {k: self._buffers["weight_" + k] for k in names if "weight_" + k in self._buffers},
                       f"{name}.weight_" if name else "weight_")
        data = {k: self._buffers.pop("weight_" + k) for k in names}
        del self.weight
        self.weight = nn.Parameter(QParam(data, self.weight_format, (self.out_features, self.in_features),
                                          self.weight_meta), requires_grad=True)

    @on_device_of(lambda self, x: x)  # a layer on a GPU that is not the current one (device_map over several)
    def forward(self, x):
        return qlinear(x, self.weight, self.bias)

    def __getattr__(self, name):
        """`weight_<stored tensor>` names its state_dict entry (this rank's shard under FSDP2), so that code that
        walks state_dict keys as attribute paths (torch.distributed.checkpoint's state dicts) finds them."""
        fmt = self.__dict__.get("weight_format")
        w = self.__dict__.get("_parameters", {}).get("weight")
        if fmt is not None and w is not None and name.startswith("weight_") and name[7:] in _formats._NAMES[fmt]:
            return getattr(local(w), name[7:])
        return super().__getattr__(name)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self.weight is not None:
            w = self.weight
            sharded = local(w) is not w
            if sharded:  # FSDP2 shard: the whole weight's stored tensors, gathered on every rank
                w = gather_whole(w) if Gathering.on else local(w)
            for k, t in w.qtensors().items():
                if sharded and k in LIST_DTYPES:  # variable length: bytes (hfq.qparam.fsdp.list_to_bytes)
                    destination[prefix + "weight_" + k] = list_to_bytes(t)
                    continue
                destination[prefix + "weight_" + k] = t if keep_vars else t.detach()
        for name, buf in self._buffers.items():
            if buf is not None and name not in self._non_persistent_buffers_set:
                destination[prefix + name] = buf if keep_vars else buf.detach()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        names = _formats._NAMES[self.weight_format]
        keys = {k: prefix + "weight_" + k for k in names}
        present = [k for k in names if keys[k] in state_dict]
        given = {k: state_dict[keys[k]] for k in present}
        if self.weight is not None and 0 < len(present) < len(names):
            # a weight's tensors split over several calls (a sharded checkpoint loaded one file at a time, in no
            # particular order, as Trainer's resume and load_best_model_at_end do): kept until the set is whole,
            # then loaded; a piece arriving again starts a new set (another load began)
            held = self.__dict__.get("_hfq_partial", {})
            held = {} if held.keys() & given.keys() else held
            given = self.__dict__["_hfq_partial"] = {**held, **given}
            present = [k for k in names if k in given]
        if self.weight is None:
            for k in present:
                self._buffers["weight_" + k] = state_dict[keys[k]]
        elif len(present) == len(names):
            self.__dict__.pop("_hfq_partial", None)
            dev = local(self.weight).codes.device
            data = {k: (list_from_bytes(given[k], k, dev) if isinstance(given[k], bytes) else given[k])
                    for k in names}
            try:
                check_qtensors(self.weight_format, tuple(self.weight.shape), self.weight_meta, data, prefix + "weight_")
            except ValueError as e:
                error_msgs.append(str(e))
                return
            mine = local(self.weight)
            if mine is not self.weight:  # FSDP2 shard: this rank's rows of the whole weight
                whole = QParam(data, self.weight_format, tuple(self.weight.shape), self.weight_meta)
                data = rows_of(whole, mine.place.row0, mine.place.row0 + mine.shape[0])
            mine.load_qtensors_(data)
            forget_outliers_(mine)  # every rank loads: the lists are shared again at the next unshard
        for k in names:
            if k not in present:
                missing_keys.append(keys[k])
        if self.bias is not None:
            if prefix + "bias" in state_dict:
                value, mine = state_dict[prefix + "bias"], local(self.bias)
                if mine is not self.bias and local(value) is value:  # FSDP2 shard, whole bias given: its rows
                    r0, n = local_rows(self.bias)
                    value = value[r0:r0 + n]
                with torch.no_grad():
                    mine.copy_(local(value))
            else:
                missing_keys.append(prefix + "bias")
        if strict:
            expected = set(keys.values()) | {prefix + "bias"}
            if state_dict.get(prefix + "weight") is self.weight:  # torch.distributed.checkpoint lists parameters too
                expected.add(prefix + "weight")
            for k in state_dict:
                if k.startswith(prefix) and "." not in k[len(prefix):] and k not in expected:
                    unexpected_keys.append(k)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight_format={self.weight_format}")


def name_qparams_(model: nn.Module) -> int:
    """Record each QLinear weight's module path on it (`QParam.place.name`), so errors raised far from the model
    (FSDP2 sharding, the optimizers) name it. Returns how many were named."""
    n = 0
    for name, m in model.named_modules():
        if isinstance(m, QLinear) and isinstance(m.weight, QParam):
            m.weight.place.name = f"{name}.weight" if name else "weight"
            n += 1
    return n
