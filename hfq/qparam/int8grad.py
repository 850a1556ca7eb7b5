"""QFT's INT8 weight gradients: `Int8Grad`, held as a QParam's `.grad` (INT8 codes + per-row scale / zero point,
no float copy), its accumulate / pop helpers, the fp32 mean over ranks done in backward before storage, and the
DDP attribute that keeps DistributedDataParallel away from those weights."""
from __future__ import annotations

import math
import zlib
from collections import deque

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from hfq_kernels import int8 as _int8k
from hfq_kernels.reference import intq as _intq
from .formats import int8_kernels
from .fsdp import local
from .tensor import QParam, QuantizedWriteError, _written_qparam


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
            raise QuantizedWriteError(f"INT8 gradient of {self.param_name or 'a weight'}: only scaling by a scalar is "
                                      f"supported, got a tensor of shape {tuple(f.shape)}")
        f = f.reshape(())
        self.finite &= torch.isfinite(f).to(self.finite.device)
        self.scales = self.scales * f
        return self

    @torch.no_grad()
    def rewrite_(self, fn) -> "Int8Grad":
        """Replace the stored gradient by fn(its fp32 value), requantized (an elementwise clamp: clip_grad_value_)."""
        finite, count = self.finite, self.count
        self.count = 0
        self.accumulate_(fn(self.dequantize(torch.float32)))
        self.finite, self.count = self.finite & finite, count
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
        if func in (aten.div_.Tensor, aten.div_.Scalar) and isinstance(args[0], Int8Grad):
            return args[0].scale_(torch.reciprocal(torch.as_tensor(args[1], dtype=torch.float32)))
        if func in _CLAMPS and isinstance(args[0], Int8Grad):
            rest, kw = args[1:], kwargs
            return args[0].rewrite_(lambda v: _CLAMPS[func](v, *rest, **kw))
        single = _FOREACH_SCALAR.get(func)
        if single is not None:  # one scalar for every tensor: INT8 gradients each take the single op above
            ints = [t for t in args[0] if isinstance(t, Int8Grad)]
            if len(ints) < len(args[0]):
                func([t for t in args[0] if not isinstance(t, Int8Grad)], *args[1:], **kwargs)
            for t in ints:
                single(t, *args[1:], **kwargs)
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
                ddp = (" Under DistributedDataParallel: wrap the model hfq.qft converted, or call "
                       "hfq.qft.ddp_ignore_int8_grad_weights_(module) on the module you wrap, before wrapping"
                       if torch.distributed.is_available() and torch.distributed.is_initialized() else "")
                raise QuantizedWriteError(
                    f"{func} would modify the INT8 gradient of {q.param_name or 'a quantized weight'} in place; "
                    "supported: scaling by a scalar (mul_, div_), clamping (clamp_, clip_grad_value_), zero_, or "
                    f"setting .grad = None.{ddp}")
        unwrap = lambda a: a.dequantize(a.dtype) if isinstance(a, Int8Grad) else a  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


_aten = torch.ops.aten
_CLAMPS = {_aten.clamp_.default: torch.clamp, _aten.clamp_.Tensor: torch.clamp,
           _aten.clamp_min_.default: torch.clamp_min, _aten.clamp_min_.Tensor: torch.clamp_min,
           _aten.clamp_max_.default: torch.clamp_max, _aten.clamp_max_.Tensor: torch.clamp_max}
_FOREACH_SCALAR = {_aten._foreach_mul_.Scalar: _aten.mul_.Scalar, _aten._foreach_mul_.Tensor: _aten.mul_.Tensor,
                   _aten._foreach_div_.Scalar: _aten.div_.Scalar, _aten._foreach_div_.Tensor: _aten.div_.Tensor,
                   _aten._foreach_clamp_min_.Scalar: _aten.clamp_min_.default,
                   _aten._foreach_clamp_max_.Scalar: _aten.clamp_max_.default}


def _float_grad_met(name, cur) -> TypeError:
    return TypeError(f"{name or 'a quantized weight'}: has an ordinary .grad ({cur.dtype}) and an INT8 gradient "
                     "arrives: its INT8 .grad was replaced by a float tensor (e.g. p.grad = p.grad * k, or "
                     "gradient_bits switched); zero the gradients (set_to_none) first")


def int8_grad(p: torch.Tensor) -> Int8Grad | None:
    """The INT8 gradient stored for parameter `p` (its `.grad` when that is an Int8Grad, or an FSDP2 DTensor
    holding this rank's shard of one; else None). Gradients still queued or in flight (IN_FLIGHT) are finished first."""
    IN_FLIGHT.drain()
    g = p.grad
    g = local(g) if g is not None else None
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
        raise _float_grad_met(name, cur)
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


class _InFlight:
    """Gradient reductions that backward launched asynchronously, each finished (waited for on the current stream,
    then averaged and stored as INT8) once DEPTH newer ones are in flight or when the backward pass ends (an
    autograd engine callback): the collective runs while the next layers compute their gradients. pop_int8_grad
    finishes any still open (a backward that raised, a call outside backward) before an optimizer reads a store."""

    DEPTH = 2

    def __init__(self):
        self.queue: deque = deque()
        self.task = None  # the backward pass whose end callback is queued

    def add(self, work, finish) -> None:
        self.queue.append((work, finish))
        if not self.watch():  # not inside a backward pass: nothing would finish it later
            self.drain()
            return
        while len(self.queue) > self.DEPTH:
            self._finish_one()

    def watch(self) -> bool:
        """Make the end of the running backward pass drain (once per pass); False when no backward is running."""
        task = torch._C._current_graph_task_id()
        if task == -1:
            return False
        if task != self.task:
            self.task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end)
        return True

    def _finish_one(self) -> None:
        work, finish = self.queue.popleft()
        work.wait()
        finish()

    def drain(self) -> None:
        BUCKET.flush()
        while self.queue:
            self._finish_one()
        BUCKET.verify()

    def _end(self) -> None:
        self.task = None
        self.drain()


IN_FLIGHT = _InFlight()


def _wire(g: torch.Tensor) -> torch.Tensor:
    """g as the collectives reduce it: a bf16 gradient on CUDA stays bf16 (as DDP and FSDP2 reduce an ordinary
    bf16 .grad: half the bytes of fp32, one bf16 rounding of the sum), anything else goes as fp32."""
    return (g if g.dtype == torch.bfloat16 and g.is_cuda else g.float()).contiguous()


def mean_over_ranks_then(g: torch.Tensor, then, name: str | None = None) -> None:
    """`then(mean of g over ranks, fp32)`: under torch.distributed (world > 1, default group) the mean, as DDP
    averages a .grad, from an all-reduce (BUCKET: several weights per collective) that overlaps the rest of backward
    (IN_FLIGHT); else then(g) now.

    Done per layer in backward, before INT8 storage: every rank then quantizes the same sum and stores
    bit-identical codes, and the only INT8 error is one rounding of the global gradient (an INT8 all-reduce would
    add one rounding per rank and need a scale agreed on first). It runs on every micro-step, DDP's no_sync included
    (accumulation steps cost one all-reduce each), and for any multi-rank run, DDP or not."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        then(g)
        return
    BUCKET.add("all_reduce", None, _wire(g), then, name)


def accumulate_sharded_int8_grad_(param, group, g: torch.Tensor, name: str | None = None) -> None:
    """FSDP2: queue the whole-weight float gradient `g` for a reduce-scatter over the shard `group` (BUCKET: one
    collective for the gradients of several weights, the mean over ranks as FSDP2 reduces a .grad, in its dtype:
    `_wire`; overlapping the rest of backward, IN_FLIGHT), after which this rank's rows are added to the INT8 store
    of the sharded DTensor parameter `param` (its .grad: a DTensor whose local tensor is an Int8Grad). One INT8
    rounding per shard. Not FSDP2's own reduce-scatter with a hook storing the shard: FSDP2 keeps each layer's bf16
    reduce-scatter output alive until backward ends, the 2 bytes per parameter and rank that INT8 gradients exist to
    avoid; a bucket's are released as soon as its shards are stored."""
    BUCKET.add("reduce_scatter", group, _wire(g), lambda mine: _store_shard(param, mine, name), name)


class _Bucket:
    """Weight gradients waiting for one collective, the mean over ranks: an all-reduce (each weight's mean) or a
    reduce-scatter over an FSDP2 shard group (this rank's rows of each). Sent once they hold MAX_BYTES, when a
    gradient for another collective, group or dtype arrives, or when IN_FLIGHT drains (the end of backward, an
    optimizer reading a store); each weight's `then` gets its part of the result as fp32. The sums are taken element
    by element, so every rank must send the same weights in the same order: each collective carries a fingerprint
    of its weights' names and shapes (FP_LEN small integers, summed with the gradients), and when the queue drains
    (the end of backward) a rank whose sums were not world x its own raises, before any optimizer step (ranks whose
    backward passes reached different quantized weights, e.g. a data-dependent branch; buckets of different sizes
    fail in the collective itself)."""

    FP_LEN = 16  # 2-bit pieces of a CRC-32: their sums stay exact in bf16 up to 85 ranks

    MAX_BYTES = 1 << 28

    def __init__(self):
        self.items: list = []  # (gradient on the wire, then, weight name)
        self.checks: list = []  # (device bool: fingerprints differed, names) per finished collective
        self.bytes = 0
        self.key = None  # (collective, group, dtype)

    def add(self, op: str, group, g: torch.Tensor, then, name: str | None = None) -> None:
        key = (op, group, g.dtype)
        if self.items and key != self.key:
            self.flush()
        self.key = key
        self.items.append((g, then, name))
        self.bytes += g.nbytes
        if self.bytes >= self.MAX_BYTES:
            self.flush()
        if not IN_FLIGHT.watch():  # not inside a backward pass: nothing would flush it later
            IN_FLIGHT.drain()

    def flush(self) -> None:
        """One collective for the queued gradients. Reduce-scatter: rank r's part of the input is row block r of
        every weight, so its output is its own rows of each, one after the other."""
        import torch.distributed as dist

        if not self.items:
            return
        (op, group, _), items = self.key, self.items
        self.items, self.bytes = [], 0
        world = dist.get_world_size(group)
        fp = self._fingerprint(items, items[0][0])
        if op == "all_reduce":
            sent = torch.cat([g.reshape(-1) for g, _, _ in items] + [fp])
            out, shapes = sent, [g.shape for g, _, _ in items]
            work = dist.all_reduce(sent, group=group, async_op=True)
        else:
            rows = [g.reshape(world, -1) for g, _, _ in items] + [fp.expand(world, -1)]
            sent = torch.cat(rows, dim=1)
            out = sent.new_empty((sent.shape[1],))
            shapes = [(g.shape[0] // world,) + tuple(g.shape[1:]) for g, _, _ in items]
            # reduce_scatter_tensor's new name where torch has it (the old one warns there)
            rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            work = rs(out, sent.reshape(-1), group=group, async_op=True)

        def finish(_sent=sent):  # the collective's input is held until it is finished
            # compared on the device, read once when the queue drains (no host sync per collective)
            self.checks.append(((out[-self.FP_LEN:].float() != fp.float() * world).any(),
                                [nm or "?" for _, _, nm in items]))
            at = 0
            for shape, (_, then, _) in zip(shapes, items):
                n = math.prod(shape)
                then(out[at:at + n].view(shape).float().div_(world))
                at += n

        IN_FLIGHT.add(work, finish)

    def verify(self) -> None:
        """Raise if any finished collective's fingerprints differed between ranks (one host read for all of them)."""
        checks, self.checks = self.checks, []
        if not checks or not bool(torch.stack([bad for bad, _ in checks]).any()):
            return
        names = next(nm for bad, nm in checks if bool(bad))
        raise RuntimeError(
            f"INT8 gradients (QFTConfig(gradient_bits=8)): the ranks averaged different weights in one collective "
            f"(this rank sent {len(names)}: {names[:4]}{' ...' if len(names) > 4 else ''}); every rank's backward "
            "must reach the same quantized linears in the same order (a data-dependent branch or an unused layer "
            "breaks that). The INT8 gradients stored by this backward are wrong: zero them (optimizer.zero_grad()) "
            "rather than step")

    def _fingerprint(self, items, like: torch.Tensor) -> torch.Tensor:
        """FP_LEN 2-bit pieces of a CRC-32 of the items' names and shapes, in the wire's dtype and device."""
        h = zlib.crc32(";".join(f"{nm}:{tuple(g.shape)}" for g, _, nm in items).encode())
        return torch.tensor([(h >> (2 * j)) & 3 for j in range(self.FP_LEN)], dtype=like.dtype, device=like.device)


BUCKET = _Bucket()


def _store_shard(param, mine: torch.Tensor, name) -> None:
    """Add this rank's rows `mine` to the sharded parameter's INT8 store."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _from_local_no_grad

    cur = param.grad
    if cur is None:
        param.grad = _from_local_no_grad(Int8Grad(mine, name, param.dtype), param._spec)
        return
    store = local(cur)
    if not isinstance(store, Int8Grad):
        raise _float_grad_met(name, cur)
    store.accumulate_(mine)


def ddp_ignore_int8_grad_weights_(model: nn.Module) -> list[str]:
    """Tell DistributedDataParallel to leave the weights whose gradient is an INT8 store (QFTConfig(gradient_bits=8))
    alone: they are averaged over ranks in backward (see `mean_over_ranks_then`) and never reach DDP's reducer. Sets
    `model._ddp_params_and_buffers_to_ignore` (DDP's own attribute, read when it wraps `model`); returns the names."""
    names = [n for n, m in model.named_modules() if getattr(m, "gradient_bits", None) == 8
             and isinstance(getattr(m, "weight", None), QParam)]
    names = [f"{n}.weight" if n else "weight" for n in names]
    prev = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    model._ddp_params_and_buffers_to_ignore = prev + [n for n in names if n not in prev]
    return names

