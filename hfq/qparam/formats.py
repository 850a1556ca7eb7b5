"""The stored formats of a QParam: names, options, the tensors each one stores, encode / decode (through
hfq_kernels.reference, or hfq_kernels.int8 for QFT's INT8 decode on CUDA), and checks of loaded tensors."""
from __future__ import annotations

import warnings

import torch

from hfq_kernels import int8 as _int8k
from hfq_kernels.reference import fp8 as _fp8
from hfq_kernels.reference import intq as _intq

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
    """Validate a format name (+ shape and options); returns the full option dict."""
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


def _encode(fmt, w, meta, rounding, generator, thresholds=None, noise=None) -> dict:
    if fmt == "fp8_e4m3_row":
        codes, scales = _fp8.quantize_fp8_row(w, rounding, generator, noise)
        return {"codes": codes, "scales": scales}
    if fmt in ("int4_tensor", "int4_group"):
        codes, scales = _intq.quantize_int4(w, meta.get("group_size"), rounding, generator, noise)
        return {"codes": codes, "scales": scales}
    if thresholds is None:
        thresholds = _intq.outlier_thresholds(w, meta["outlier_fraction"])
    d = _intq.quantize_dense_sparse(w, thresholds, rounding, generator, noise)
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

