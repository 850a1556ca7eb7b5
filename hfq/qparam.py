"""QParam: a trainable low-precision weight (codes + scales) that behaves like a bf16 parameter.

A wrapper tensor subclass (torchao's NF4Tensor is the precedent): it reports a logical shape [out, in] and
dtype bf16, so autograd gives it an ordinary bf16 `.grad`, `nn.Parameter(QParam)` works, `.to(device)` moves
its codes, and hfq's optimizers (hfq.optim: ECO, QLion) call `dequantize()` / `requantize_(value)`. No other
update path can silently do nothing: any in-place write into a QParam (single-tensor, or inside the tensor lists of
foreach/fused kernels) raises, and a global optimizer step pre-hook refuses every other torch optimizer holding a
trainable QParam before its step touches anything, with a TypeError naming the hfq optimizer to use.
With `qlinear(..., store_int8=True)` (QFTConfig(gradient_bits=8)) dL/dW is kept as INT8 codes: the weight's `.grad`
is an `Int8Grad` (no float copy), which gradient clipping can measure and scale and hfq's optimizers consume.

`QLinear` is the Linear-like module that owns one: its forward never materialises a persistent
full-precision weight (the dequantized weight is a temporary, recomputed in backward), and its state_dict
stores the codes and scales as such (`<prefix>weight_codes`, `<prefix>weight_scales`, ...), so safetensors,
`save_pretrained`, `load_state_dict` and Trainer checkpoints work unchanged.

DistributedDataParallel: gradients are ordinary bf16 tensors, bucketed and all-reduced like any others. DDP's
construction-time broadcast goes through the logical value (a dequantized view copied back with `copy_`); copying a
QParam's own value back is a no-op, so ranks that hold the same codes keep them bit-exactly. Ranks that may hold
different codes call `broadcast_qparams_(model)` first (an exact broadcast of codes and scales). INT8 gradients
(store_int8) are averaged over ranks in backward, in fp32, before storage; DDP is told to ignore those weights
(`ddp_ignore_int8_grad_weights_`, which hfq.qft applies when it converts a model).

FSDP2 (`fully_shard`) and other parameter sharding are refused: splitting a QParam raises (FSDP2 chunks every
parameter along dim 0 in `fully_shard`), and hfq's optimizers refuse sharded (DTensor) parameters.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_map

from hfq_kernels import int8 as _int8k
from hfq_kernels._triton import checkpointing as _checkpointing
from hfq_kernels.reference import fp8 as _fp8
from hfq_kernels.reference import intq as _intq

USE_HFQ_OPTIMIZER = (
    "Quantized weights are updated only through requantize_: train them with hfq.ECOAdamW or ECOSGD "
    "(any weight_format; with Trainer: optimizer_cls_and_kwargs=hfq.eco.optimizer_cls_and_kwargs(args)) or "
    "hfq.QLion, or freeze them (requires_grad_(False)).")
FORMATS = ("fp8_e4m3_row", "int4_tensor", "int4_group", "int8_dense_sparse")
_NAMES = {
    "fp8_e4m3_row": ("codes", "scales"),
    "int4_tensor": ("codes", "scales"),
    "int4_group": ("codes", "scales"),
    "int8_dense_sparse": ("codes", "scales", "zeros", "thresholds", "sparse_idx", "sparse_val"),
}
MAX_OUTLIER_FRACTION = 0.2  # QFT keeps ~1% outliers; beyond 20% the sparse part costs more than the dense one
_VARIABLE = {"int8_dense_sparse": ("sparse_idx", "sparse_val")}  # stored tensors whose length varies with the data
_DEFAULT_META = {
    "fp8_e4m3_row": {},
    "int4_tensor": {},
    "int4_group": {"group_size": None},  # None: default_group_size of the weight's width
    "int8_dense_sparse": {"outlier_fraction": 0.01, "outlier_refresh_steps": 0},
}


DEFAULT_GROUP = 128


def default_group_size(in_features: int) -> int:
    """int4_group's group when none was chosen: DEFAULT_GROUP when it divides the width, else the largest divisor
    of the width below it (so a model of any width loads), announced with a warning."""
    g = next(d for d in range(min(DEFAULT_GROUP, in_features), 0, -1) if in_features % d == 0)
    if g != DEFAULT_GROUP:
        warnings.warn(f"int4_group: in_features {in_features} is not a multiple of {DEFAULT_GROUP}; using "
                      f"group_size {g} for it (pass group_size to choose)", UserWarning, stacklevel=3)
    return g


def check_format(fmt: str, shape=None, meta: dict | None = None) -> dict:
    """Validate a format name (+ shape and options); returns the full option dict (with a shape, int4_group's
    group resolved)."""
    if fmt not in FORMATS:
        raise ValueError(f"weight_format: unknown {fmt!r}; allowed {FORMATS}")
    full = dict(_DEFAULT_META[fmt])
    for k, v in (meta or {}).items():
        if k not in full:
            if v is None:
                continue
            raise ValueError(f"{fmt}: unknown option {k!r}; allowed {tuple(full)}")
        full[k] = v
    g = full.get("group_size")
    if fmt == "int4_group" and g is not None and (isinstance(g, bool) or not isinstance(g, int) or g <= 0):
        raise ValueError(f"int4_group: group_size must be a positive int or None (per layer), got {g!r}")
    if fmt == "int8_dense_sparse":
        f = full["outlier_fraction"]
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= MAX_OUTLIER_FRACTION:
            raise ValueError(f"outlier_fraction: expected a number in [0, {MAX_OUTLIER_FRACTION}] (the share of "
                             f"each int8_dense_sparse weight kept as bf16 outliers), got {f!r}")
        n = full["outlier_refresh_steps"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"outlier_refresh_steps: expected an int >= 0 (optimizer steps between re-selections "
                             f"of the outliers; 0 = never), got {n!r}")
    if shape is not None:
        if len(shape) != 2:
            raise ValueError(f"{fmt}: weight must be 2-D [out, in], got shape {tuple(shape)}")
        if fmt == "int4_group" and full["group_size"] is None:
            full["group_size"] = default_group_size(shape[-1])
        if fmt.startswith("int4"):
            _intq.check_int4_shape(shape, full.get("group_size"))
    return full


def _encode(fmt, w, meta, rounding, generator, thresholds=None) -> dict:
    if fmt == "fp8_e4m3_row":
        codes, scales = _fp8.quantize_fp8_row(w, rounding, generator)
        return {"codes": codes, "scales": scales}
    if fmt in ("int4_tensor", "int4_group"):
        codes, scales = _intq.quantize_int4(w, meta.get("group_size"), rounding, generator)
        return {"codes": codes, "scales": scales}
    if thresholds is None:
        thresholds = _intq.outlier_thresholds(w, meta["outlier_fraction"])
    d = _intq.quantize_dense_sparse(w, thresholds, rounding, generator)
    d["thresholds"] = thresholds.to(torch.float32)
    return d


def _decode(fmt, data, meta, dtype) -> torch.Tensor:
    if fmt == "fp8_e4m3_row":
        return _fp8.dequantize_fp8_row(data["codes"], data["scales"], dtype)
    if fmt in ("int4_tensor", "int4_group"):
        return _intq.dequantize_int4(data["codes"], data["scales"], meta.get("group_size"), dtype)
    if int8_kernels(data["codes"]):
        return _int8k.int8_dequantize(data["codes"], data["scales"], data["zeros"], data["sparse_idx"],
                                      data["sparse_val"], dtype)
    return _intq.dequantize_dense_sparse(data["codes"], data["scales"], data["zeros"], data["sparse_idx"],
                                         data["sparse_val"], dtype)


FORCE_INT8_KERNELS = False  # tests: route CPU tensors through the Triton kernels (TRITON_INTERPRET=1)


def int8_kernels(t: torch.Tensor) -> bool:
    """Whether QFT's INT8 paths (decode, INT8 gradients, QLion) take hfq_kernels.int8 for `t`: CUDA tensors with
    Triton; CPU tensors only when FORCE_INT8_KERNELS (under the interpreter). Elsewhere the torch references."""
    return (t.is_cuda and _int8k.HAS_TRITON) or (FORCE_INT8_KERNELS and _int8k.kernels_usable(t))


def empty_qtensors(fmt, shape, meta, device=None) -> dict:
    """Placeholder inner tensors (zeros) of the right shapes/dtypes, e.g. on 'meta' before loading."""
    rows, cols = shape
    z = lambda s, dt: torch.zeros(s, dtype=dt, device=device)  # noqa: E731
    if fmt == "fp8_e4m3_row":
        return {"codes": z((rows, cols), torch.float8_e4m3fn), "scales": z((rows, 1), torch.float32)}
    if fmt == "int4_tensor":
        return {"codes": z((rows, cols // 2), torch.uint8), "scales": z((1,), torch.float32)}
    if fmt == "int4_group":
        return {"codes": z((rows, cols // 2), torch.uint8),
                "scales": z((rows, cols // meta["group_size"]), torch.float32)}
    return {"codes": z((rows, cols), torch.uint8), "scales": z((rows, 1), torch.float32),
            "zeros": z((rows, 1), torch.uint8), "thresholds": z((2,), torch.float32),
            "sparse_idx": z((0,), torch.int32), "sparse_val": z((0,), torch.bfloat16)}


def check_qtensors(fmt: str, shape, meta: dict, data: dict, prefix: str = "") -> None:
    """Refuse stored tensors that do not fit together (e.g. a checkpoint whose dense and sparse parts disagree):
    ValueError naming the tensor (`prefix` + name), with the expected and found shape/dtype."""
    exp = empty_qtensors(fmt, tuple(shape), meta, "meta")
    for k in _NAMES[fmt]:
        if k not in data:
            raise ValueError(f"{prefix}{k}: missing ({fmt} needs {_NAMES[fmt]})")
        t, e = data[k], exp[k]
        fixed = k not in _VARIABLE.get(fmt, ())
        if t.dtype != e.dtype or (fixed and tuple(t.shape) != tuple(e.shape)) or (not fixed and t.dim() != 1):
            want = tuple(e.shape) if fixed else "(nnz,)"
            raise ValueError(f"{prefix}{k}: expected shape {want} {e.dtype} for a {fmt} weight of shape "
                             f"{tuple(shape)}, got {tuple(t.shape)} {t.dtype}")
    if fmt == "int8_dense_sparse":
        idx, val = data["sparse_idx"], data["sparse_val"]
        if idx.numel() != val.numel():
            raise ValueError(f"{prefix}sparse_val: {val.numel()} outlier values for {idx.numel()} indices in "
                             f"{prefix}sparse_idx (the dense and sparse parts disagree)")
        n = shape[0] * shape[1]
        if idx.numel() and idx.device.type != "meta" and bool(((idx < 0) | (idx >= n)).any()):
            raise ValueError(f"{prefix}sparse_idx: outlier indices must lie in [0, {n}) for a weight of shape "
                             f"{tuple(shape)}, got [{int(idx.min())}, {int(idx.max())}]")
        if idx.numel() > 1 and idx.device.type != "meta" and bool((idx[1:] <= idx[:-1]).any()):
            raise ValueError(f"{prefix}sparse_idx: outlier indices must be strictly increasing (each row's outliers "
                             "are read as one segment of the sorted list)")


class QParam(torch.Tensor):
    """Low-precision weight stored as codes + scales, seen by autograd as a bf16 tensor of logical shape."""

    @staticmethod
    def __new__(cls, data: dict, fmt: str, shape, meta: dict | None = None, requires_grad: bool = False,
                dtype: torch.dtype = torch.bfloat16):
        meta = check_format(fmt, shape, meta)
        if set(data) != set(_NAMES[fmt]):
            raise ValueError(f"{fmt}: inner tensors must be {_NAMES[fmt]}, got {tuple(data)}")
        device = data["codes"].device
        return torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device=device,
                                                   requires_grad=requires_grad)

    def __init__(self, data, fmt, shape, meta=None, requires_grad=False, dtype=torch.bfloat16):
        self.fmt = fmt
        self.meta = check_format(fmt, shape, meta)
        for k in _NAMES[fmt]:
            setattr(self, k, data[k])

    # ---- construction / conversion -------------------------------------------------------------
    @classmethod
    def from_float(cls, w: torch.Tensor, fmt: str = "fp8_e4m3_row", rounding: str = "rtn",
                   generator: torch.Generator | None = None, requires_grad: bool = True, **meta) -> "QParam":
        """Quantize a float weight [out, in]; the result is an nn.Parameter-ready QParam."""
        meta = check_format(fmt, tuple(w.shape), meta)
        with torch.no_grad():
            data = _encode(fmt, w.detach(), meta, rounding, generator)
        return cls(data, fmt, tuple(w.shape), meta, requires_grad=requires_grad)

    def qtensors(self) -> dict:
        """The stored tensors (name -> tensor), e.g. {'codes': float8 [out,in], 'scales': fp32 [out,1]}."""
        return {k: getattr(self, k) for k in _NAMES[self.fmt]}

    @property
    def storage_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.qtensors().values())

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A plain tensor of the logical shape (a fresh temporary: never kept by QParam)."""
        with torch.no_grad():
            return _decode(self.fmt, self.qtensors(), self.meta, dtype or self.dtype)

    @torch.no_grad()
    def requantize_(self, value: torch.Tensor, rounding: str = "rtn", generator: torch.Generator | None = None,
                    refresh_thresholds: bool = False) -> torch.Tensor:
        """Store Q(value) in place; returns the quantization error value - Q(value) (float32).

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
        new = _encode(self.fmt, value, self.meta, rounding, generator, thr)
        self.load_qtensors_(new)
        return value - self.dequantize(torch.float32)

    @torch.no_grad()
    def load_qtensors_(self, data: dict) -> None:
        """Overwrite the stored tensors: in place where shape and dtype match (aliases stay valid)."""
        for k in _NAMES[self.fmt]:
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

    def _replace(self, fn) -> "QParam":
        out = QParam({k: fn(t) for k, t in self.qtensors().items()}, self.fmt, tuple(self.shape), self.meta,
                     dtype=self.dtype)
        return out

    def __repr__(self):
        return (f"QParam(fmt={self.fmt}, shape={tuple(self.shape)}, logical_dtype={self.dtype}, "
                f"device={self.device}, requires_grad={self.requires_grad})")

    def __deepcopy__(self, memo):
        out = self._replace(lambda t: t.clone())
        out.requires_grad_(self.requires_grad)
        if getattr(self, "_is_param", False):
            out._is_param = True
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, proto):
        raise TypeError("QParam is not picklable: save through state_dict (safetensors stores codes and scales)")

    # ---- torch.compile / FSDP-style flattening -------------------------------------------------
    def __tensor_flatten__(self):
        return list(_NAMES[self.fmt]), (self.fmt, tuple(self.shape), tuple(sorted(self.meta.items())), self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        fmt, shape, meta, dtype = ctx
        return QParam(dict(inner), fmt, shape, dict(meta), dtype=dtype)

    # ---- operator handling ---------------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if isinstance(w, QParam) and not isinstance(x, QParam):
                return qlinear(x, w, b)
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
            return src._replace(lambda t: t.to(dev, non_blocking=nb))
        if func is aten.clone.default:
            return args[0]._replace(lambda t: t.clone())
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(src, QParam):
                if src.fmt != dst.fmt or src.shape != dst.shape:
                    raise ValueError(f"copy_: cannot copy a {src.fmt} {tuple(src.shape)} QParam into "
                                     f"a {dst.fmt} {tuple(dst.shape)} one")
                dst.load_qtensors_(src.qtensors())
            elif not _holds_value(dst, src):
                dst.requantize_(src, "rtn")
            # else: src is this weight's own value (e.g. DDP's construction-time broadcast of a dequantized view):
            # keep the codes. Requantizing a bf16 round trip would move codes and scales on every rank.
            return dst
        if func in _SHARDING_OPS and isinstance(args[0], QParam):
            raise NotImplementedError(sharding_refusal(f"{func} on a QParam {args[0].fmt} {tuple(args[0].shape)}"))
        if func._schema.is_mutable:
            q = _written_qparam(func, args, kwargs)
            if q is not None:
                raise TypeError(
                    f"{func} would modify a quantized weight (QParam {q.fmt} {tuple(q.shape)}) in place, which "
                    f"changes only a dequantized temporary. {USE_HFQ_OPTIMIZER}")
        unwrap = lambda a: a.dequantize() if isinstance(a, QParam) else a  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


_SHARDING_OPS = {torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default,
                 torch.ops.aten.chunk.default, torch.ops.aten.tensor_split.sections}


def sharding_refusal(what: str) -> str:
    """The error for parameter sharding (FSDP2's fully_shard, FSDP1) of a model holding QParams (ECO, QFT)."""
    return (f"ECO / QFT (QParam quantized weights) do not support FSDP2 (fully_shard) or other parameter "
            f"sharding: {what}. Sharding would split the codes and scales into plain dequantized tensors, "
            "which no longer train as quantized weights. Supported for ECO / QFT: DDP (`accelerate launch "
            "--config_file examples/accelerate/ddp.yaml ...`); QuEST and NVFP4/QeRL + LoRA also run under FSDP2.")


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


def broadcast_qparams_(module: nn.Module, src: int = 0, group=None, bucket_bytes: int = 250 * 2 ** 20) -> int:
    """Copy the stored codes and scales of every QParam in `module` from rank `src` (of `group`, default: the
    world) to all ranks, bit-exactly.

    DistributedDataParallel broadcasts parameters at construction through their logical (bf16) values; for a
    QParam that is exact only when the ranks already hold the same weights (then it is a no-op: see `copy_`),
    which is the normal case (same checkpoint, or the same seed). When ranks may differ (e.g. unseeded random
    init), call this before wrapping, on every rank. float8 codes travel as uint8 (gloo cannot send float8);
    the variable-length outlier lists of int8_dense_sparse are resized first. Returns the number of QParams."""
    import torch.distributed as dist

    qps = list({id(p): p for p in module.parameters() if isinstance(p, QParam)}.values())
    if not qps:
        return 0
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    var = [(p, k) for p in qps for k in _VARIABLE.get(p.fmt, ())]
    if var:
        n = torch.tensor([getattr(p, k).numel() for p, k in var], dtype=torch.int64, device=qps[0].codes.device)
        dist.broadcast(n, group=pg, group_src=src)
        for (p, k), ni in zip(var, n.tolist()):
            t = getattr(p, k)
            if t.numel() != ni:
                t.set_(t.new_empty((ni,)))  # same tensor object: aliases of this QParam follow
    wire = [t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t
            for p in qps for t in p.qtensors().values() if t.numel()]
    dist._broadcast_coalesced(pg, wire, bucket_bytes, src)
    return len(qps)


class Int8Grad(torch.Tensor):
    """A weight gradient stored as INT8 codes + per-row scale/zero point (QFT Algorithm 1: 'store as INT8'), held as
    the weight's `.grad` so that generic gradient code sees it: norms (torch/accelerate/Trainer `clip_grad_norm_`),
    in-place scaling by a scalar (the clip: only the fp32 row scales change), GradScaler's unscale, `zero_grad` (drops
    it). Other read-only ops see the dequantized value (`.float()` exactly); any other in-place op is refused.

    `accumulate_(g)`: gradient accumulation as dequantize + add + requantize (1 byte/element between micro-steps; an
    fp32 accumulator would cost 4). Each requantization adds at most half a step of the running sum's row scale, so
    k micro-steps are within sum_j s_j/2 of the exact sum (tests/test_qft_grads.py measures ~1.4x the one-shot error
    for k=4). `finite` is a device bool that turns False if any added gradient (or clip factor) had NaN/Inf; hfq's
    optimizers refuse the step, reading it in their one per-step sync. `param_name`: the parameter's module path if
    known."""

    @staticmethod
    def __new__(cls, g: torch.Tensor, name: str | None = None, dtype: torch.dtype = torch.bfloat16):
        return torch.Tensor._make_wrapper_subclass(cls, g.shape, dtype=dtype, device=g.device, requires_grad=False)

    def __init__(self, g, name=None, dtype=torch.bfloat16):
        self.param_name = name
        self.count = 0
        self.codes = self.scales = self.zeros = None
        self.finite = torch.ones((), dtype=torch.bool, device=g.device)
        self.accumulate_(g)

    @torch.no_grad()
    def accumulate_(self, g: torch.Tensor) -> "Int8Grad":
        """Add a float gradient of the same shape (the sum is requantized per row, round-to-nearest)."""
        if tuple(g.shape) != tuple(self.shape):
            raise ValueError(f"INT8 gradient of {self.param_name or 'a weight'}: added gradient has shape "
                             f"{tuple(g.shape)}, expected {tuple(self.shape)}")
        if int8_kernels(g):
            if not self.count:
                rows, cols = _intq.as_rows(self.shape)
                self.codes = torch.empty((rows, cols), dtype=torch.uint8, device=g.device)
                self.scales = torch.empty((rows, 1), dtype=torch.float32, device=g.device)
                self.zeros = torch.empty((rows, 1), dtype=torch.uint8, device=g.device)
            self.finite &= _int8k.int8_quantize_rows_(g, self.codes, self.scales, self.zeros, self.count > 0)
            self.count += 1
            return self
        self.finite &= torch.isfinite(g).all()
        g = torch.nan_to_num(g.float(), nan=0.0, posinf=0.0, neginf=0.0)
        if self.count:
            g = g + self.dequantize()
        self.codes, self.scales, self.zeros = _intq.quantize_int_asym(g, 8, check=False)
        self.count += 1
        return self

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        with torch._C.DisableTorchFunctionSubclass():
            return _intq.dequantize_int_asym(self.codes, self.scales, self.zeros, dtype, tuple(self.shape))

    @torch.no_grad()
    def scale_(self, factor) -> "Int8Grad":
        """Multiply the stored gradient by a scalar (a 0-d tensor or a number): exact up to fp32 rounding of the
        row scales, codes untouched."""
        f = torch.as_tensor(factor, dtype=torch.float32, device=self.scales.device)
        if f.numel() != 1:
            raise TypeError(f"INT8 gradient of {self.param_name or 'a weight'}: only scaling by a scalar is supported, "
                            f"got a tensor of shape {tuple(f.shape)}")
        f = f.reshape(())
        self.finite &= torch.isfinite(f).to(self.finite.device)
        self.scales = self.scales * f
        return self

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.zeros))

    def __repr__(self):
        return (f"Int8Grad(param_name={self.param_name}, shape={tuple(self.shape)}, count={self.count}, "
                f"device={self.device})")

    def __reduce_ex__(self, proto):
        raise TypeError("Int8Grad is not picklable: optimizers consume it at their step; checkpoints hold no gradients")

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func in (aten.mul_.Tensor, aten.mul_.Scalar) and isinstance(args[0], Int8Grad):
            return args[0].scale_(args[1])
        if func in (aten._foreach_mul_.Tensor, aten._foreach_mul_.Scalar):
            for t in args[0]:
                t.scale_(args[1]) if isinstance(t, Int8Grad) else t.mul_(args[1])
            return None
        if func is aten._amp_foreach_non_finite_check_and_unscale_.default:  # GradScaler.unscale_ (fp16 AMP)
            grads, found_inf, inv_scale = args
            plain = [t for t in grads if not isinstance(t, Int8Grad)]
            if plain:
                func(plain, found_inf, inv_scale)
            for t in grads:
                if isinstance(t, Int8Grad):
                    t.scale_(inv_scale)
                    torch.maximum(found_inf, (~t.finite).to(found_inf), out=found_inf)
            return None
        fp32 = lambda a: a.dequantize(torch.float32) if isinstance(a, Int8Grad) else a  # noqa: E731
        if func is aten.linalg_vector_norm.default and isinstance(args[0], Int8Grad):
            return func(fp32(args[0]), *args[1:], **kwargs)  # fp32, as the codes allow
        if func is aten._foreach_norm.Scalar:
            return func([fp32(t) for t in args[0]], *args[1:], **kwargs)
        if func is aten._to_copy.default and isinstance(args[0], Int8Grad):
            g = args[0]
            return g.dequantize(kwargs.get("dtype") or g.dtype).to(kwargs.get("device") or g.device)
        if func in (aten.detach.default, aten.detach_.default, aten.alias.default):
            return args[0]
        if func is aten.zero_.default:
            g = args[0]
            g.codes = g.zeros.expand_as(g.codes).clone()
            g.finite.fill_(True)
            return g
        if func._schema.is_mutable:
            q = _written_qparam(func, args, kwargs, Int8Grad)
            if q is not None:
                raise TypeError(f"{func} would modify the INT8 gradient of {q.param_name or 'a quantized weight'} "
                                "in place; supported: scaling by a scalar (mul_), zero_, or setting .grad = None. "
                                "Under DistributedDataParallel: wrap the model hfq.qft converted, or call "
                                "hfq.qft.ddp_ignore_int8_grad_weights_(module) on the module you wrap, before wrapping")
        unwrap = lambda a: a.dequantize(a.dtype) if isinstance(a, Int8Grad) else a  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


def int8_grad(p: torch.Tensor) -> Int8Grad | None:
    """The INT8 gradient stored for parameter `p` (its `.grad` when that is an Int8Grad; else None)."""
    g = p.grad
    return g if isinstance(g, Int8Grad) else None


def accumulate_int8_grad_(p: torch.Tensor, g: torch.Tensor, name: str | None = None) -> Int8Grad:
    """Add a float weight gradient to p's INT8 store (creating it as p.grad); the float `g` can be freed right after."""
    cur = p.grad
    if cur is None:
        cur = Int8Grad(g, name, p.dtype)
        p.grad = cur
    elif isinstance(cur, Int8Grad):
        cur.accumulate_(g)
    else:
        raise TypeError(f"{name or 'a quantized weight'}: has an ordinary .grad ({cur.dtype}) and an INT8 gradient "
                        "arrives; zero the gradients (set_to_none) before switching gradient_bits")
    return cur


def pop_int8_grad(p: torch.Tensor) -> Int8Grad | None:
    """Take p's INT8 gradient out (p.grad becomes None): the optimizer consumes it, like the paper's stack pop."""
    cur = int8_grad(p)
    if cur is not None:
        p.grad = None
    return cur


def clear_int8_grads_(params) -> int:
    """Drop pending INT8 gradients of `params` (what zero_grad does for .grad); returns how many were dropped."""
    return sum(pop_int8_grad(p) is not None for p in params)


def _mean_over_ranks(g: torch.Tensor) -> torch.Tensor:
    """Under torch.distributed (world > 1, default group): the fp32 mean of `g` over ranks, as DDP averages a .grad.

    Done per layer in backward, before INT8 storage: every rank then quantizes the same fp32 sum and stores
    bit-identical codes, and the only INT8 error is one rounding of the global gradient (an INT8 all-reduce would
    add one rounding per rank and need a scale agreed on first). It runs on every micro-step, DDP's no_sync included
    (the sum stays exact; accumulation steps cost one all-reduce each), and for any multi-rank run, DDP or not."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return g
    g = g.float().contiguous()
    dist.all_reduce(g)
    return g.div_(dist.get_world_size())


def ddp_ignore_int8_grad_weights_(model: nn.Module) -> list[str]:
    """Tell DistributedDataParallel to leave the weights whose gradient is an INT8 store (QFTConfig(gradient_bits=8))
    alone: they are averaged over ranks in backward (see `_mean_over_ranks`) and never reach DDP's reducer. Sets
    `model._ddp_params_and_buffers_to_ignore` (DDP's own attribute, read when it wraps `model`); returns the names."""
    names = [n for n, m in model.named_modules() if getattr(m, "gradient_bits", None) == 8
             and isinstance(getattr(m, "weight", None), QParam)]
    names = [f"{n}.weight" if n else "weight" for n in names]
    prev = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    model._ddp_params_and_buffers_to_ignore = prev + [n for n in names if n not in prev]
    return names


class _QLinearFn(torch.autograd.Function):
    """y = x W^T + b with W dequantized on the fly; backward re-dequantizes (nothing full-precision saved; under
    activation checkpointing the recompute's decoded weight serves the backward right after it).

    dL/dW becomes W's bf16 `.grad`, or with `store_int8` goes to W's INT8 store (W.grad, an Int8Grad), averaged over
    ranks first when distributed: the float dL/dW then exists only inside this backward (one layer at a time) and
    autograd gets None for W. If W has a `grad_consumer` attribute (a callable(w, grad, name), set by
    hfq.qft.step_in_backward_), that float dL/dW goes to it instead of the INT8 store."""

    @staticmethod
    def forward(ctx, x, w, b, store_int8=False, name=None):
        ctx.w, ctx.store_int8, ctx.name = w, store_int8, name
        ctx.has_b = b is not None
        wd = w.dequantize(x.dtype)
        # Under activation checkpointing the decoded weight is a saved tensor too: checkpointing drops it after the
        # forward and its recompute hands the backward a fresh one (one layer's worth), so dL/dx needs no decode.
        ctx.keep_w = _checkpointing()
        ctx.save_for_backward(x, wd) if ctx.keep_w else ctx.save_for_backward(x)
        return F.linear(x, wd, b)

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
            if ctx.store_int8:
                gw = _mean_over_ranks(gw)
                consumer = getattr(w, "grad_consumer", None)
                consumer(w, gw, ctx.name) if consumer is not None else accumulate_int8_grad_(w, gw, ctx.name)
                gw = None
            else:
                gw = gw.to(w.dtype)
        if ctx.has_b and ctx.needs_input_grad[2]:
            gb = gy.reshape(-1, gy.shape[-1]).sum(0)
        return gx, gw, gb, None, None


def qlinear(x: torch.Tensor, w: QParam, b: torch.Tensor | None = None, *, store_int8: bool = False,
            name: str | None = None) -> torch.Tensor:
    """F.linear for a QParam weight; `store_int8` keeps dL/dW as INT8 (named `name` in errors) instead of .grad."""
    return _QLinearFn.apply(x, w, b, store_int8, name)


class QLinear(nn.Module):
    """Linear layer whose weight is a QParam. state_dict keys: weight_<name> for each stored tensor, bias.

    Not an nn.Linear subclass on purpose: model code that re-initialises every nn.Linear in place
    (transformers' _init_weights) must not touch the codes."""

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
        names = _NAMES[self.weight_format]
        check_qtensors(self.weight_format, (self.out_features, self.in_features), self.weight_meta,
                       {k: self._buffers["weight_" + k] for k in names if "weight_" + k in self._buffers},
                       f"{name}.weight_" if name else "weight_")
        data = {k: self._buffers.pop("weight_" + k) for k in names}
        del self.weight
        self.weight = nn.Parameter(QParam(data, self.weight_format, (self.out_features, self.in_features),
                                          self.weight_meta), requires_grad=True)

    def forward(self, x):
        return qlinear(x, self.weight, self.bias)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self.weight is not None:
            for k, t in self.weight.qtensors().items():
                destination[prefix + "weight_" + k] = t if keep_vars else t.detach()
        for name, buf in self._buffers.items():
            if buf is not None and name not in self._non_persistent_buffers_set:
                destination[prefix + name] = buf if keep_vars else buf.detach()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        names = _NAMES[self.weight_format]
        keys = {k: prefix + "weight_" + k for k in names}
        present = [k for k in names if keys[k] in state_dict]
        if self.weight is None:
            for k in present:
                self._buffers["weight_" + k] = state_dict[keys[k]]
        elif len(present) == len(names):
            data = {k: state_dict[keys[k]] for k in names}
            try:
                check_qtensors(self.weight_format, tuple(self.weight.shape), self.weight_meta, data, prefix + "weight_")
            except ValueError as e:
                error_msgs.append(str(e))
                return
            self.weight.load_qtensors_(data)
        for k in names:
            if k not in present:
                missing_keys.append(keys[k])
        if self.bias is not None:
            if prefix + "bias" in state_dict:
                with torch.no_grad():
                    self.bias.copy_(state_dict[prefix + "bias"])
            else:
                missing_keys.append(prefix + "bias")
        if strict:
            expected = set(keys.values()) | {prefix + "bias"}
            for k in state_dict:
                if k.startswith(prefix) and "." not in k[len(prefix):] and k not in expected:
                    unexpected_keys.append(k)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight_format={self.weight_format}")


def _refuse_plain_optimizer(optimizer, args, kwargs):
    """Global optimizer step pre-hook: only optimizers marked `updates_qparams` (hfq.optim's) step over a trainable
    QParam. Any other would leave it unchanged without a word (its foreach/fused kernels write into dequantized
    temporaries; INT8-gradient weights have no .grad to read), so the step is refused before anything moves."""
    if getattr(optimizer, "updates_qparams", False) or getattr(getattr(optimizer, "optimizer", None),
                                                                "updates_qparams", False):
        return None  # hfq's, or a wrapper delegating to one (accelerate's AcceleratedOptimizer)
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if isinstance(p, QParam) and p.requires_grad:
                names = group.get("param_names")
                what = names[pi] if names else f"param_groups[{gi}]['params'][{pi}]"
                raise TypeError(f"{type(optimizer).__name__} cannot train {what}, a quantized weight (QParam "
                                f"{p.fmt} {tuple(p.shape)}): it would stay unchanged. {USE_HFQ_OPTIMIZER}")
    return None


register_optimizer_step_pre_hook(_refuse_plain_optimizer)
