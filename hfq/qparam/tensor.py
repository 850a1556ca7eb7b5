"""QParam, the tensor subclass: codes + scales seen by autograd as a bf16 tensor of logical shape [out, in].

A wrapper subclass (torchao's NF4Tensor is the precedent): `nn.Parameter(QParam)` works, `.to(device)` moves its
stored tensors, hfq's optimizers call `dequantize()` / `requantize_(value)`. Every other in-place write into it
(single-tensor ops, or inside the tensor lists of foreach/fused kernels) raises instead of changing a temporary.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from hfq_kernels._triton import switch_to_device_of
from hfq_kernels.reference import fp8 as _fp8
from . import formats as _formats
from . import fsdp as _fsdp
from .formats import check_format
from .fsdp import RowPlace


class QuantizedWriteError(RuntimeError):
    """An in-place write into a quantized weight (QParam) or an INT8 gradient that cannot be honoured. Not a
    TypeError: Python's in-place operators (`p -= x`, `p.grad /= k`) take PyTorch's TypeError as NotImplemented and
    fall back to `p = p - x`, which rebinds a name and leaves the weight as it was, silently."""


USE_HFQ_OPTIMIZER = (
    "Quantized weights are updated only through requantize_: train them with hfq.ECOAdamW or ECOSGD "
    "(any weight_format; with Trainer: optimizer_cls_and_kwargs=hfq.eco.optimizer_cls_and_kwargs(args)) or "
    "hfq.QLion, or freeze them (requires_grad_(False)).")
NO_DEEPSPEED = (
    "DeepSpeed's engine moves, flattens (ZeRO-1/2) and partitions (ZeRO-3) parameters into buffers of its own, which "
    "a quantized weight cannot become: train QFT/ECO models with DDP or FSDP2 instead (accelerate launch with "
    "examples/accelerate/ddp.yaml or fsdp2.yaml; docs/training.md).")


_TENSOR_DATA = torch._C.TensorBase.data


class QParam(torch.Tensor):
    """Low-precision weight stored as codes + scales, seen by autograd as a bf16 tensor of logical shape."""

    @staticmethod
    def __new__(cls, data: dict, fmt: str, shape, meta: dict | None = None, requires_grad: bool = False,
                dtype: torch.dtype = torch.bfloat16, place: RowPlace | None = None):
        meta = check_format(fmt, shape, meta)
        if set(data) != set(_formats._NAMES[fmt]):
            raise ValueError(f"{fmt}: inner tensors must be {_formats._NAMES[fmt]}, got {tuple(data)}")
        device = data["codes"].device
        return torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device=device,
                                                   requires_grad=requires_grad)

    def __init__(self, data, fmt, shape, meta=None, requires_grad=False, dtype=torch.bfloat16, place=None):
        self.fmt = fmt
        self.meta = check_format(fmt, shape, meta)
        self.place = place if place is not None else RowPlace(None, 0, shape[0])
        for k in _formats._NAMES[fmt]:
            setattr(self, k, data[k])

    @property
    def data(self):
        return _TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, value):
        # `w.data = t` with a plain t would leave the codes as they are (the wrapper has no storage to swap)
        if not isinstance(value, QParam):
            raise QuantizedWriteError(
                f"assigning a {type(value).__name__} to .data of a quantized weight (QParam {self.fmt} "
                f"{tuple(self.shape)}) would not change it: write it with `with torch.no_grad(): weight.copy_(t)` "
                f"(requantizes) or load a state_dict. {USE_HFQ_OPTIMIZER} If DeepSpeed made this write: "
                f"{NO_DEEPSPEED}")
        _TENSOR_DATA.__set__(self, value)

    # ---- construction / conversion -------------------------------------------------------------
    @classmethod
    def from_float(cls, w: torch.Tensor, fmt: str = "fp8_e4m3_row", rounding: str = "rtn",
                   generator: torch.Generator | None = None, requires_grad: bool = True, **meta) -> "QParam":
        """Quantize a float weight [out, in]; the result is an nn.Parameter-ready QParam."""
        meta = check_format(fmt, tuple(w.shape), meta)
        dev = switch_to_device_of(w) or contextlib.nullcontext()
        with torch.no_grad(), dev:
            data = _formats._encode(fmt, w.detach(), meta, rounding, generator)
        return cls(data, fmt, tuple(w.shape), meta, requires_grad=requires_grad)

    def qtensors(self) -> dict:
        """The stored tensors (name -> tensor), e.g. {'codes': float8 [out,in], 'scales': fp32 [out,1]}."""
        return {k: getattr(self, k) for k in _formats._NAMES[self.fmt]}

    def data_ptr(self) -> int:
        """The address of the codes. A wrapper subclass has no storage of its own (torch answers 0 for every
        QParam), and accelerate's FSDP2 prepare matches optimizer parameters to model parameters by data_ptr."""
        return self.codes.data_ptr()

    @property
    def storage_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.qtensors().values())

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A plain tensor of the logical shape (a fresh temporary: never kept by QParam)."""
        with torch.no_grad():
            return _formats._decode(self.fmt, self.qtensors(), self.meta, dtype or self.dtype)

    @torch.no_grad()
    def requantize_(self, value: torch.Tensor, rounding: str = "rtn", generator: torch.Generator | None = None,
                    refresh_thresholds: bool = False, noise: torch.Tensor | None = None) -> torch.Tensor:
        """Store Q(value) in place; returns the quantization error value - Q(value) (float32). SR draws from
        `generator`, or takes `noise` (uniform [0, 1), value's shape) when given.

        int8_dense_sparse: the outliers are the elements of `value` outside the stored thresholds (T_min, T_max),
        which are kept (QFT's lazy update, App. C) unless `refresh_thresholds`: then they are re-set to the
        outlier_fraction tails of `value` first, so the outlier count returns to that fraction of the weight."""
        _fp8.check_rounding(rounding)
        if tuple(value.shape) != tuple(self.shape):
            raise ValueError(f"requantize_: value shape {tuple(value.shape)} != weight shape {tuple(self.shape)}")
        if generator is not None and generator.device.type != value.device.type:
            raise ValueError(f"requantize_: generator on {generator.device}, value on {value.device}")
        value = value.detach().float()
        thr = None if (refresh_thresholds or self.fmt != "int8_dense_sparse") else self.thresholds
        new = _formats._encode(self.fmt, value, self.meta, rounding, generator, thr, noise)
        self.load_qtensors_(new)
        return value - self.dequantize(torch.float32)

    @torch.no_grad()
    def rtn_step_kept(self, step: float, rows: int = 256) -> torch.Tensor:
        """The share of a move by +-step (signs alternating along rows) that survives nearest rounding, as a 0-d
        tensor: the projection of Q(w + move) - w on the move over |move|^2 (about 1 where steps go through, about
        0 where they round back; a changed row scale moves the rest but not along the step). Estimated on about
        `rows` evenly spaced rows (row-wise scales and groups as stored; thresholds the weight's own); the weight
        itself is left as it is."""
        w = self.dequantize(torch.float32)
        if w.dim() == 2 and w.shape[0] > rows:
            w = w[::-(-w.shape[0] // rows)].contiguous()
        move = torch.full_like(w, float(step))
        move[..., 1::2] = -float(step)
        thr = self.thresholds if self.fmt == "int8_dense_sparse" else None
        moved = _formats._decode(self.fmt, _formats._encode(self.fmt, w + move, self.meta, "rtn", None, thr),
                                 self.meta, torch.float32)
        return ((moved - w) * move).sum() / (move * move).sum()

    @torch.no_grad()
    def load_qtensors_(self, data: dict) -> None:
        """Overwrite the stored tensors: in place where shape and dtype match (aliases stay valid)."""
        for k in _formats._NAMES[self.fmt]:
            if k not in data:
                raise ValueError(f"{self.fmt}: missing stored tensor {k!r}")
            cur, new = getattr(self, k), data[k]
            if cur.shape == new.shape and cur.dtype == new.dtype and cur.device.type != "meta":
                cur.copy_(new)
            elif cur.dtype == new.dtype and cur.device.type != "meta":
                # a new length (int8_dense_sparse outliers): swap the storage of the same tensor object, so that
                # other wrappers of it (param.detach(), as DDP and optimizers hold) see the change too
                cur.set_(new.detach().to(cur.device, copy=True))
            else:
                if k == "codes" and cur.dtype != new.dtype:
                    raise ValueError(f"{self.fmt}: codes dtype {new.dtype} != {cur.dtype}")
                setattr(self, k, new.to(self.device) if cur.device.type != "meta" else new)

    def _replace(self, fn, same_place: bool = True) -> "QParam":
        """A new wrapper of fn(each stored tensor); a view (`same_place`) shares this one's RowPlace."""
        place = self.place if same_place else RowPlace(self.place.name, self.place.row0, self.place.rows)
        out = QParam({k: fn(t) for k, t in self.qtensors().items()}, self.fmt, tuple(self.shape), self.meta,
                     dtype=self.dtype, place=place)
        if same_place and hasattr(self, "fsdp_shard"):
            out.fsdp_shard = self.fsdp_shard
        return out

    def __repr__(self):
        return (f"QParam(fmt={self.fmt}, shape={tuple(self.shape)}, logical_dtype={self.dtype}, "
                f"device={self.device}, requires_grad={self.requires_grad})")

    def __deepcopy__(self, memo):
        out = self._replace(lambda t: t.clone(), same_place=False)
        out.requires_grad_(self.requires_grad)
        if getattr(self, "_is_param", False):
            out._is_param = True
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, proto):
        raise TypeError("QParam is not picklable: save through state_dict (safetensors stores codes and scales)")

    # ---- torch.compile / FSDP-style flattening -------------------------------------------------
    def __tensor_flatten__(self):
        ctx = (self.fmt, tuple(self.shape), tuple(sorted(self.meta.items())), self.dtype)
        return list(_formats._NAMES[self.fmt]), ctx

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        fmt, shape, meta, dtype = ctx
        return QParam(dict(inner), fmt, shape, dict(meta), dtype=dtype)

    # ---- FSDP2's all-gather extension (hfq.qparam.fsdp) -------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return _fsdp.pre_all_gather(self, mesh, module)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        return _fsdp.post_all_gather(self, all_gather_outputs, metadata, param_dtype, out)

    # ---- operator handling ---------------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if isinstance(w, QParam) and not isinstance(x, QParam):
                from .linear import qlinear  # linear.py builds on this module

                return qlinear(x, w, b)
        if func in (torch.chunk, torch.Tensor.chunk) and isinstance(args[0], QParam):
            n = args[1] if len(args) > 1 else kwargs.get("chunks")
            why = _fsdp.shardable(args[0], n)  # torch.chunk would hand back fewer pieces than asked for
            if why:
                raise NotImplementedError(why)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func is aten.detach.default:
            return args[0]._replace(lambda t: t)
        if func is aten._to_copy.default:
            src = args[0]
            dev = kwargs.get("device") or src.device
            nb = kwargs.get("non_blocking", False)
            return src._replace(lambda t: t.to(dev, non_blocking=nb), same_place=False)
        if func is aten.clone.default:
            return args[0]._replace(lambda t: t.clone(), same_place=False)
        if func is aten.empty_like.default and kwargs.get("dtype") in (None, args[0].dtype):
            # Module.to_empty (a model rebuilt from the meta device): uninitialised inner tensors, still quantized,
            # for load_state_dict to fill
            dev = kwargs.get("device") or args[0].device
            return args[0]._replace(lambda t: torch.empty_like(t, device=dev), same_place=False)
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(src, QParam):
                if src.fmt != dst.fmt or src.shape != dst.shape:
                    raise ValueError(f"copy_: cannot copy a {src.fmt} {tuple(src.shape)} QParam into "
                                     f"a {dst.fmt} {tuple(dst.shape)} one")
                dst.load_qtensors_(src.qtensors())
                dst.place.row0, dst.place.rows = src.place.row0, src.place.rows
            elif not _holds_value(dst, src):
                dst.requantize_(src, "rtn")
            # else: src is this weight's own value (e.g. DDP's construction-time broadcast of a dequantized view):
            # keep the codes. Requantizing a bf16 round trip would move codes and scales on every rank.
            return dst
        if func in _ROW_OPS and isinstance(args[0], QParam):
            return _ROW_OPS[func](*args, **kwargs)
        if func._schema.is_mutable:
            q = _written_qparam(func, args, kwargs)
            if q is not None:
                raise QuantizedWriteError(
                    f"{func} would modify a quantized weight (QParam {q.fmt} {tuple(q.shape)}) in place, which "
                    f"changes only a dequantized temporary. {USE_HFQ_OPTIMIZER}")
        unwrap = lambda a: a.dequantize() if isinstance(a, QParam) else a  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


def _split(q, size, dim=0):
    if dim not in (0, -2):
        raise NotImplementedError(f"splitting a QParam {q.fmt} {tuple(q.shape)} along dim {dim}: only along dim 0 "
                                  "(rows, as FSDP2 shards)")
    rows = q.shape[0]
    return _fsdp.split_rows(q, [min(size, rows - i) for i in range(0, rows, size)] if size else [rows])


def _split_sizes(q, sizes, dim=0):
    if dim not in (0, -2):
        raise NotImplementedError(f"splitting a QParam {q.fmt} {tuple(q.shape)} along dim {dim}: only along dim 0")
    return _fsdp.split_rows(q, sizes)


def _as_strided(q, size, stride, storage_offset=0):
    if tuple(size) != tuple(q.shape) or tuple(stride) != (q.shape[1], 1) or storage_offset:
        raise NotImplementedError(f"as_strided{tuple(size), tuple(stride), storage_offset} on a QParam {q.fmt} "
                                  f"{tuple(q.shape)}: only the whole contiguous weight")
    return q._replace(lambda t: t)


def _view(q, size):
    """view of an FSDP2 shard as [-1]: FSDP2 keeps it as its handle on the flat shard, which only its default
    all-gather would read (a QParam's goes through fsdp_pre_all_gather), so the handle is the shard itself, not a
    dequantized copy. Any other view is one of the logical (dequantized) value, as DDP's broadcast takes it."""
    if q.place.sharded and list(size) in ([-1], [q.numel()]):
        return q._replace(lambda t: t)
    return torch.ops.aten.view.default(q.dequantize(), size)


_ROW_OPS = {  # what FSDP2's fully_shard and its unshard do with a parameter, by rows (hfq.qparam.fsdp)
    torch.ops.aten.split.Tensor: _split,
    torch.ops.aten.split_with_sizes.default: _split_sizes,
    torch.ops.aten.new_zeros.default: lambda q, size, **kw: _fsdp.new_zeros(q, size),
    torch.ops.aten.slice.Tensor: _fsdp.slice_rows,
    torch.ops.aten.as_strided.default: _as_strided,
    torch.ops.aten.view.default: _view,
}


def sharding_refusal(what: str) -> str:
    """The error for FSDP1's flattened parameters (FullyShardedDataParallel) of a model holding QParams."""
    return (f"ECO / QFT (QParam quantized weights) do not support FSDP1 (FullyShardedDataParallel, flattened "
            f"parameters): {what}. Flattening turns the codes and scales into plain dequantized values, which no "
            "longer train as quantized weights. Supported for ECO / QFT: FSDP2 (fully_shard; accelerate "
            "fsdp_version: 2, `accelerate launch --config_file examples/accelerate/fsdp2.yaml ...`) and DDP "
            "(examples/accelerate/ddp.yaml).")


def _written_qparam(func, args, kwargs, cls=None) -> QParam | None:
    """The first QParam (or `cls` instance) that a mutable op writes to (an argument marked `(a!)` in its schema, or a
    member of a written tensor list, as foreach and fused optimizer kernels take), else None."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(arg.name)
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(t, cls or QParam):
                return t
    return None



def _holds_value(q: QParam, value: torch.Tensor) -> bool:
    """True when `value` equals q's dequantized value in value's dtype (so storing it again changes nothing)."""
    if tuple(value.shape) != tuple(q.shape) or not value.is_floating_point():
        return False
    with torch.no_grad():
        return bool(torch.equal(q.dequantize(value.dtype).to(value.device), value))

