"""FSDP2 (`fully_shard`) for QParams: row shards, and an all-gather that moves the stored bytes.

fully_shard splits every parameter along dim 0 (torch.chunk, new_zeros, narrow, copy_). A QParam answers with row
pieces that keep each row's codes together with its scales, zero points and outliers (`split_rows`); a piece
remembers its first global row (`RowPlace.row0`), which keys stochastic rounding (hfq.optim) and rebases outlier
indices. Refused, naming the parameter and what would work: per-tensor metadata that a row piece cannot own
(int4_tensor's single scale) and a row count that the number of shards does not divide (FSDP2 would pad the last
shard, and its all-gather extension needs pieces of one size).

The all-gather (QParam.fsdp_pre_all_gather / fsdp_post_all_gather, FSDP2's tensor-subclass extension) sends the
stored tensors: 1 byte per element plus row metadata for fp8_e4m3_row and int8_dense_sparse, half a byte for
int4_group, where bf16 would send 2. int8_dense_sparse's outlier lists (their lengths differ per rank and step)
are shared among the ranks once per optimizer step for all weights and kept whole on every rank
(`share_outliers_`), so unsharding a weight needs no collective or host sync for them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from . import formats as _formats


@dataclass
class RowPlace:
    """Where a QParam's rows sit in the whole weight: `name` (module path, for errors; None if unknown), `row0`
    (global index of its first row), `rows` (row count of the whole weight) and `sharded` (an FSDP2 shard, made
    through `new_zeros`). Views of one QParam share it."""

    name: str | None
    row0: int
    rows: int
    sharded: bool = False


def local(t):
    """What this rank holds of `t`: the local shard of an FSDP2 (DTensor) parameter or gradient, else `t` itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def local_rows(p) -> tuple[int, int]:
    """(first global row, row count) of this rank's shard of parameter `p` (the whole of a plain tensor)."""
    if not isinstance(p, DTensor):
        return 0, (p.shape[0] if p.dim() else 1)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return int(offset[0]), int(shape[0])


def shardable(q, pieces: int) -> str | None:
    """Why `q` cannot be cut into `pieces` equal row shards (None when it can)."""
    name = q.place.name or "a quantized weight"
    rows = q.shape[0]
    if q.fmt == "int4_tensor":
        return (f"{name} (int4_tensor {tuple(q.shape)}) has one scale for the whole tensor, which a row shard cannot "
                "own; under FSDP2 use weight_format='int4_group' (a scale per row and group) or 'fp8_e4m3_row'")
    if rows % pieces:
        return (f"{name} ({q.fmt} {tuple(q.shape)}): {rows} rows do not split evenly over {pieces} FSDP2 shards; "
                f"use a world size that divides {rows}, or keep this module out of the quantized set "
                "(QFTConfig(modules_to_not_convert=[...]))")
    return None


def rows_of(q, r0: int, r1: int, copy: bool = True) -> dict:
    """The stored tensors of rows [r0, r1) of `q` (row metadata with them; outlier indices rebased to the piece).
    Fixed-size tensors are views unless `copy`; outlier lists are always new tensors."""
    cols = q.shape[1]
    out = {}
    for k, t in q.qtensors().items():
        if k == "thresholds":
            out[k] = t.clone() if copy else t
        elif k in ("sparse_idx", "sparse_val"):
            continue
        else:
            piece = t[r0:r1]
            out[k] = piece.clone() if copy else piece
    if q.fmt == "int8_dense_sparse":
        idx = q.sparse_idx
        keep = (idx >= r0 * cols) & (idx < r1 * cols)
        out["sparse_idx"] = (idx[keep] - r0 * cols).to(idx.dtype)
        out["sparse_val"] = q.sparse_val[keep]
    return out


def split_rows(q, sizes) -> list:
    """torch.split / torch.chunk of a QParam along dim 0 into row pieces (refused where `shardable` says why)."""
    sizes = list(sizes)
    if len(set(sizes[:-1] + ([sizes[-1]] if sizes[-1] else []))) > 1 or sum(sizes) != q.shape[0]:
        raise NotImplementedError(shardable(q, len(sizes)) or _uneven(q, sizes))
    why = shardable(q, len(sizes))
    if why:
        raise NotImplementedError(why)
    out, r0 = [], 0
    for n in sizes:
        piece = type(q)(rows_of(q, r0, r0 + n), q.fmt, (n, q.shape[1]), q.meta, dtype=q.dtype,
                        place=RowPlace(q.place.name, q.place.row0 + r0, q.place.rows))
        out.append(piece)
        r0 += n
    return out


def _uneven(q, sizes) -> str:
    return (f"{q.place.name or 'a quantized weight'} ({q.fmt} {tuple(q.shape)}): row pieces of sizes {sizes} are "
            "not equal; a QParam splits only into equal row shards along dim 0")


def new_zeros(q, size):
    """`new_zeros` on a QParam (FSDP2's padded shard): an all-zero weight of the same format and `size` rows."""
    size = tuple(size)
    if len(size) != 2 or size[1] != q.shape[1]:
        raise NotImplementedError(f"new_zeros{size} on a QParam {q.fmt} {tuple(q.shape)}: only whole rows "
                                  f"[n, {q.shape[1]}]")
    data = _formats.empty_qtensors(q.fmt, size, q.meta, q.device)
    if q.fmt == "int8_dense_sparse":
        data["thresholds"] = q.thresholds.clone()
    return type(q)(data, q.fmt, size, q.meta, dtype=q.dtype,
                   place=RowPlace(q.place.name, q.place.row0, q.place.rows, sharded=True))


def slice_rows(q, dim: int, start, end, step: int = 1):
    """`narrow` / `q[a:b]` along dim 0: the whole weight gives a view sharing every stored tensor (and the
    RowPlace); a part gives a row piece whose fixed-size tensors are views (writes reach `q`), outliers copied."""
    rows = q.shape[0]
    start = 0 if start is None else max(0, start + rows if start < 0 else start)
    end = rows if end is None else min(rows, end + rows if end < 0 else end)
    if dim not in (0, -2) or step != 1:
        raise NotImplementedError(f"slicing a QParam {q.fmt} {tuple(q.shape)} along dim {dim} (step {step}): only "
                                  "whole rows along dim 0")
    if start == 0 and end == rows:
        return q._replace(lambda t: t)
    return type(q)(rows_of(q, start, end, copy=False), q.fmt, (end - start, q.shape[1]), q.meta, dtype=q.dtype,
                   place=RowPlace(q.place.name, q.place.row0 + start, q.place.rows))


# ---- the all-gather ---------------------------------------------------------------------------------------
_WIRE = {torch.float8_e4m3fn: torch.uint8}  # gloo and NCCL collectives take float8 as bytes
_VARIABLE = ("thresholds", "sparse_idx", "sparse_val")


def pre_all_gather(q, mesh, module=None):
    """(inputs, metadata) for FSDP2's all-gather of this rank's shard `q`: its fixed-size stored tensors (codes and
    row metadata; float8 as bytes). FSDP2 sizes its buffers once, so the outlier lists, whose lengths change with
    every step, are gathered apart in `post_all_gather`."""
    names = [k for k in _formats._NAMES[q.fmt] if k not in _VARIABLE]
    inputs = tuple(getattr(q, k).view(_WIRE[getattr(q, k).dtype]) if getattr(q, k).dtype in _WIRE
                   else getattr(q, k) for k in names)
    param = next((v for v in (module._parameters.values() if module is not None else ())
                  if isinstance(v, DTensor) and v._local_tensor is q), None)
    return inputs, (names, [getattr(q, k).dtype for k in names], mesh.get_group(), param)


def _list_token(q) -> tuple:
    """Identifies the current contents of q's outlier list: set_ / copy_ bump a version, a new tensor its id."""
    idx, val = q.sparse_idx, q.sparse_val
    return id(idx), idx._version, idx.numel(), id(val), val._version


_SHARE_WORDS = 1 << 26  # int32 words per all-gather of outlier lists (256 MiB a rank)


def share_outliers_(params) -> None:
    """Give every rank the whole outlier lists of the FSDP2-sharded int8_dense_sparse parameters among `params`,
    kept until a list changes: the lengths in one all-gather (one host sync), then the lists in all-gathers of
    up to 256 MiB a rank, for all weights at once. The lists change only at optimizer steps (QLion.step calls
    this after its step) and loads, so unsharding a weight for forward and backward needs no collective for
    them. A collective: every rank calls it with the same parameters. Replicated: 6 bytes per outlier (1% of a
    7B model's weights: 0.46 GB a GPU)."""
    by_group: dict = {}
    for p in params:
        if isinstance(p, DTensor) and getattr(p._local_tensor, "fmt", None) == "int8_dense_sparse":
            by_group.setdefault(p.device_mesh.get_group(), []).append(p._local_tensor)
    for group, qs in by_group.items():
        _share(qs, group)


def forget_outliers_(q) -> None:
    """Drop the whole outlier lists kept for shard q (its list was replaced on every rank, e.g. by a load)."""
    q.__dict__.pop("whole_outliers", None)


def _share(qs: list, group) -> None:
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world == 1:
        for q in qs:
            q.whole_outliers = (_list_token(q), q.sparse_idx, q.sparse_val)
        return
    for q in qs:
        if q.sparse_idx.dtype != torch.int32 or q.sparse_val.element_size() != 2:
            raise TypeError(f"{q.place.name or 'a quantized weight'}: outlier lists must be int32 indices and 16-bit "
                            f"values to be gathered, got {q.sparse_idx.dtype} and {q.sparse_val.dtype}")
    dev = qs[0].codes.device
    mine = torch.tensor([q.sparse_idx.numel() for q in qs], dtype=torch.int64).to(dev)
    every = mine.new_empty((world * len(qs),))
    dist.all_gather_into_tensor(every, mine, group=group)
    table = every.view(world, len(qs)).tolist()
    batch, words = [], 0
    for j, q in enumerate(qs):
        counts = [row[j] for row in table]
        cap = max(counts)
        batch.append((q, counts, cap, (cap + 1) // 2))  # two bf16 values to an int32 word
        words += cap + (cap + 1) // 2
        if words >= _SHARE_WORDS or j == len(qs) - 1:
            _gather_lists(batch, words, world, group)
            batch, words = [], 0


def _gather_lists(batch, words: int, world: int, group) -> None:
    """One all-gather of the padded lists of `batch` [(shard, every rank's length, longest, value words)]."""
    import torch.distributed as dist

    pieces = []
    for q, counts, cap, half in batch:
        idx, val = q.sparse_idx, q.sparse_val
        pieces += [idx, idx.new_zeros((cap - idx.numel(),)),
                   torch.cat((val, val.new_zeros((2 * half - val.numel(),)))).view(torch.int32)]
    buf = torch.cat(pieces)
    every = buf.new_empty((world * words,))
    dist.all_gather_into_tensor(every, buf, group=group)
    every = every.view(world, words)
    at = 0
    for q, counts, cap, half in batch:
        vals = every[:, at + cap:at + cap + half].contiguous().view(q.sparse_val.dtype)
        shard = q.numel()
        idx_all = torch.cat([every[r, at:at + counts[r]] + r * shard for r in range(world)])
        val_all = torch.cat([vals[r, :counts[r]] for r in range(world)])
        q.whole_outliers = (_list_token(q), idx_all, val_all)
        at += cap + half


def gather_outliers(q, group) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole weight's outlier lists (indices in whole-weight positions, sorted) for shard q: kept from the last
    `share_outliers_`, or shared now (a collective on every rank alike: the lists are kept and forgotten on all
    ranks together, at steps and loads). A list changed on this rank since raises, naming the weight."""
    got = q.__dict__.get("whole_outliers")
    if got is None:
        _share([q], group)
        got = q.whole_outliers
    elif got[0] != _list_token(q):
        raise RuntimeError(f"{q.place.name or 'a quantized weight'}: its outlier list changed on this rank since "
                           "the ranks last shared them (QLion.step and loads do that); after changing outliers by "
                           "hand, call hfq.qparam.fsdp.share_outliers_(model.parameters()) on every rank")
    return got[1], got[2]


def post_all_gather(q, outputs, metadata, param_dtype, out=None):
    """The whole QParam from the gathered tensors (outputs[i]: every rank's input i, in rank order, along dim 0);
    fixed-size tensors are views of FSDP2's buffers, refilled in place by later gathers (then `out` is the
    QParam built the first time, and only its outliers are replaced)."""
    import torch.distributed as dist

    names, dtypes, group, param = metadata
    if len(outputs) == 1 < len(names) and dist.get_world_size(group) == 1:
        outputs = _one_rank_outputs(q, outputs, names, out)
    if len(outputs) != len(names):
        raise RuntimeError(f"FSDP2 all-gather of a {q.fmt} QParam {tuple(q.shape)}: expected {len(names)} gathered "
                           f"tensors {names}, got {len(outputs)} "
                           f"{[(tuple(t.shape), t.dtype) for t in outputs]}")
    data = {k: (t.view(dt) if t.dtype != dt else t) for k, t, dt in zip(names, outputs, dtypes)}
    if q.fmt == "int8_dense_sparse":
        data["sparse_idx"], data["sparse_val"] = gather_outliers(q, group)
        data["thresholds"] = q.thresholds
    if out is not None:
        for k in _VARIABLE:
            if k in data:
                setattr(out, k, data[k])
        out.fsdp_shard = (param, group)
        return None
    rows = data["codes"].shape[0]
    full = type(q)(data, q.fmt, (rows, q.shape[1]), q.meta, dtype=param_dtype or q.dtype,
                   place=RowPlace(q.place.name, 0, rows))
    full.fsdp_shard = (param, group)  # QFT's INT8 gradient goes to the sharded parameter (hfq.qparam.int8grad)
    return full, tuple(data[k] for k in names)


def _one_rank_outputs(q, outputs, names, out):
    """FSDP2 on a mesh of one rank copies only the first all-gather input (the codes) into its buffer. The other
    fixed-size tensors (row metadata) come from the shard, which is then the whole weight: cloned the first time
    (FSDP2 frees and reallocates them with the codes between unshards), copied into `out`'s afterwards."""
    rest = []
    for k in names[1:]:
        t = getattr(q, k)
        if out is None:
            t = t.clone()
        else:
            getattr(out, k).copy_(t)
            t = getattr(out, k)
        rest.append(t.view(_WIRE[t.dtype]) if t.dtype in _WIRE else t)
    return (outputs[0], *rest)


def gather_whole(param):
    """The whole QParam of an FSDP2-sharded QParam parameter, on every rank (a collective of its shard group):
    the same all-gather as FSDP2's unshard, for full state dicts and checkpoints."""
    import torch.distributed as dist

    q = local(param)
    inputs, metadata = pre_all_gather(q, param.device_mesh)
    group = metadata[2]
    world = dist.get_world_size(group)
    outputs = []
    for t in inputs:
        o = t.new_empty((world * t.shape[0],) + tuple(t.shape[1:]))
        dist.all_gather_into_tensor(o, t.contiguous(), group=group)
        outputs.append(o)
    whole, _ = post_all_gather(q, outputs, metadata, q.dtype)
    del whole.fsdp_shard
    return whole


def load_whole_state_dict_(model, state_dict: dict, strict: bool = True):
    """Load a whole-model state dict (as one process saves it, or `whole_state_dict`) into an FSDP2-sharded model:
    each DTensor parameter or buffer takes its rows, QLinear cuts its own. torch.distributed.checkpoint's
    set_model_state_dict expects one key per parameter, which QLinear's codes / scales keys are not."""
    own = dict(model.named_parameters())
    own.update(model.named_buffers())
    sd = {}
    for k, v in state_dict.items():
        t = own.get(k)
        if isinstance(t, DTensor) and not isinstance(v, DTensor):
            r0, n = local_rows(t)
            v = DTensor.from_local(v[r0:r0 + n].to(t.device), t.device_mesh, t.placements, run_check=False,
                                   shape=t.shape, stride=t.stride())
        sd[k] = v
    return model.load_state_dict(sd, strict=strict)


# The outlier lists of a sharded weight enter its state dict as bytes: torch.distributed.checkpoint loads a tensor
# only into a template tensor of the same shape, and these lists change length as the weights train; an object
# (bytes) it saves and loads whole. Only sharded weights do this (save_pretrained's safetensors need tensors).
LIST_DTYPES = {"sparse_idx": torch.int32, "sparse_val": torch.bfloat16}


def list_to_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def list_from_bytes(b: bytes, name: str, device) -> torch.Tensor:
    """An outlier list ("sparse_idx" / "sparse_val") back from `list_to_bytes`, on `device`."""
    dtype = LIST_DTYPES[name]
    if not b:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.frombuffer(bytearray(b), dtype=torch.uint8).view(dtype).to(device)


class Gathering:
    """Whether QLinear's state_dict gathers an FSDP2-sharded weight (off inside `state_keys`)."""

    on = True


def state_keys(model) -> set:
    """The keys of model.state_dict() of an FSDP2-sharded model, computed on one rank alone: a sharded QLinear
    lists its stored tensors without gathering them (a gather is a collective of every rank)."""
    Gathering.on = False
    try:
        return set(model.state_dict())
    finally:
        Gathering.on = True


def decode_lists(state: dict) -> dict:
    """A gathered state dict with the outlier lists' bytes (how a sharded weight's state dict carries them: see
    LIST_DTYPES) turned back into tensors, as safetensors needs."""
    out = dict(state)
    for k, v in state.items():
        if isinstance(v, bytes):
            out[k] = list_from_bytes(v, k.rpartition(".")[2].removeprefix("weight_"), "cpu")
    return out


def loading_whole_state_dicts(set_model_state_dict):
    """Wrap accelerate's `fsdp_utils._set_model_state_dict` (what `load_fsdp_model` ends with, so Trainer's resume
    too): a full state dict (FSDP2 with fsdp_state_dict_type FULL_STATE_DICT, read on the main rank only) of a model
    with sharded QParams is broadcast to every rank and loaded with `load_whole_state_dict_`. torch's
    set_model_state_dict expects one key per parameter, which a QLinear's stored tensors are not, and its broadcast
    has no float8 on gloo."""
    import functools

    @functools.wraps(set_model_state_dict)
    def wrapper(model, state_dict, *args, sd_options=None, **kwargs):
        import torch.distributed as dist

        from .tensor import QParam

        sharded_q = any(isinstance(p, DTensor) and isinstance(local(p), QParam) for p in model.parameters())
        if not (sharded_q and sd_options is not None and sd_options.full_state_dict):  # (no adapters on QParams)
            return set_model_state_dict(model, state_dict, *args, sd_options=sd_options, **kwargs)
        if dist.is_initialized() and dist.get_world_size() > 1:
            state_dict = _broadcast_state(state_dict if dist.get_rank() == 0 else None)
        return load_whole_state_dict_(model, decode_lists(state_dict), strict=sd_options.strict)

    wrapper.hfq_wrapped = set_model_state_dict
    return wrapper


def _broadcast_state(state: dict | None) -> dict:
    """Rank 0's state dict on every rank: names, dtypes, shapes and non-tensor values as objects, each tensor's bytes
    as uint8 (a float8 tensor pickles, but torch's unpickling of it in broadcast_object_list fails)."""
    import torch.distributed as dist

    meta = [None if state is None else [(k, (v.dtype, tuple(v.shape)) if torch.is_tensor(v) else v)
                                        for k, v in state.items()]]
    dist.broadcast_object_list(meta, src=0)
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    out = {}
    for k, m in meta[0]:
        if not (isinstance(m, tuple) and len(m) == 2 and isinstance(m[0], torch.dtype)):
            out[k] = m if state is None else state[k]
            continue
        dtype, shape = m
        t = state[k].detach().to(dev).contiguous() if state is not None else torch.empty(shape, dtype=dtype, device=dev)
        if t.numel():
            dist.broadcast(t.reshape(-1).view(torch.uint8), src=0)
        out[k] = t
    return out


def whole_state_dict(model) -> dict:
    """The state dict of an FSDP2-sharded model with every tensor whole, on every rank (a collective: call it on
    all ranks): QLinear gathers its stored tensors, DTensors are gathered here. Loads in one process."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
            for k, v in decode_lists(model.state_dict()).items()}


def save_pretrained_whole(model, save_directory: str, **kwargs) -> None:
    """save_pretrained of an FSDP2-sharded hfq model (ECO, QFT, QuEST) as an ordinary checkpoint that loads in one
    process: every rank gathers the whole state dict and runs save_pretrained (a collective: call it on all
    ranks), the main rank writes the files.
    With Trainer under fsdp_state_dict_type SHARDED_STATE_DICT, whose save_model() writes nothing, call it on
    trainer.model after training."""
    import torch.distributed as dist

    sd = whole_state_dict(model)
    main = not dist.is_initialized() or dist.get_rank() == 0
    model.save_pretrained(save_directory, state_dict=sd, is_main_process=main, **kwargs)  # its gathers run everywhere
    if dist.is_initialized():
        dist.barrier()
