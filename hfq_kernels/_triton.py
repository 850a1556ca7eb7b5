"""Triton availability, interpreter handling, device facts and the decode helpers every kernel family shares.

Kernel modules import `triton` and `tl` from here. Without triton installed they get stand-ins: `@triton.jit`
still decorates (the kernel raises when launched) and `available(device)` is False, so callers take the torch
references and `import hfq_kernels.*` works on CPU-only installs.
"""
from __future__ import annotations

import functools
from collections import OrderedDict

import torch

from hfq_kernels._settings import SETTINGS

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU installs without triton keep the torch references
    HAS_TRITON = False

INTERPRET = SETTINGS.interpret

# CPU tensors (the interpreter) plan launches as for this many SMs, an H100's count, so tests on CPU exercise
# the same split-K / split-KV paths as the GPU.
NOMINAL_SMS = 132


class _NoTriton:
    """Stand-in for the triton modules: decorators work, kernels raise when launched."""

    def jit(self, fn=None, **_kw):
        if fn is None:
            return self.jit

        def missing(*_a, **_k):
            raise RuntimeError(f"{fn.__name__}: triton is not installed (pip install triton)")

        missing.__name__ = fn.__name__
        missing.fn = fn
        return missing

    def __getattr__(self, name):
        raise RuntimeError(f"triton.{name}: triton is not installed (pip install triton)")


if not HAS_TRITON:
    triton = tl = _NoTriton()

if HAS_TRITON and INTERPRET:
    # Two fixes to Triton 3.6's interpreter, applied where it patches triton.language for a launch: it turns loop
    # bounds into 1-element arrays and calls int() on them, which NumPy >= 2.3 refuses (__index__ reads the single
    # element instead), and its tl.sort is far too slow for CI (NumPy sorts instead).
    import numpy as np
    import triton.runtime.interpreter as _interp

    if not getattr(_interp._patch_lang_tensor, "_hfq_wrapped", False):
        _orig_patch = _interp._patch_lang_tensor

        def _np_sort(x, dim=None, descending=0):
            # The interpreter runs tl.sort as a bitonic network of Python-level reductions; NumPy gives the same
            # order.
            d = len(x.shape) - 1 if dim is None else int(getattr(dim, "value", dim))
            data = np.sort(x.handle.data, axis=d, kind="stable")
            if getattr(descending, "value", descending):
                data = np.flip(data, axis=d).copy()
            return tl.core.tensor(_interp.TensorHandle(data, x.handle.dtype), x.type)

        def _patch_lang_tensor(tensor, scope):
            _orig_patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
            scope.set_attr(tensor, "sort", _np_sort)
            scope.set_attr(tl, "sort", _np_sort)

        _patch_lang_tensor._hfq_wrapped = True
        _interp._patch_lang_tensor = _patch_lang_tensor


def available(device: torch.device) -> bool:
    """Whether Triton kernels can run on tensors of `device` (CUDA, or CPU under TRITON_INTERPRET=1)."""
    if not HAS_TRITON:
        return False
    return device.type == "cuda" or (device.type == "cpu" and INTERPRET)


def on_gpu(t: torch.Tensor) -> bool:
    """True for a CUDA tensor with triton installed (the ops' CUDA kernels use Triton only then)."""
    return HAS_TRITON and t.is_cuda


def switch_to_device_of(t):
    """A context making the CUDA device of t (a tensor or a torch.device) the current one, or None where it already
    is (or t is not on CUDA). Triton launches, streams and graphs use the current device: a layer on another GPU
    (device_map over several) needs this around its launches, or they run on the wrong device (an access error,
    or unordered access through peer memory). Under torch.compile, None: the compiled code guards its device."""
    dev = t if isinstance(t, torch.device) else t.device
    if (dev.type == "cuda" and dev.index is not None and not torch.compiler.is_compiling()
            and dev.index != torch._C._cuda_getDevice()):
        return torch.cuda.device(dev)
    return None


def on_device_of(pick):
    """Decorator: run the function with the CUDA device of pick(*args, **kwargs) (a tensor, a torch.device or None)
    current (switch_to_device_of); the one way hfq's layers and engine follow their own GPU."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t = pick(*args, **kwargs)
            ctx = None if t is None else switch_to_device_of(t)
            if ctx is None:
                return fn(*args, **kwargs)
            with ctx:
                return fn(*args, **kwargs)

        return wrapper

    return deco


def aligned16(*tensors) -> bool:
    """Whether every tensor given (None skipped) starts on a 16-byte boundary, as compiled launches assume."""
    return all(t is None or not t.data_ptr() & 15 for t in tensors)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


_PROPS: dict = {}  # CUDA device index -> (compute capability, SM count)


def card_props(device: torch.device) -> tuple[tuple[int, int], int] | None:
    """(compute capability, SM count) of a CUDA device (read once per device); None off CUDA."""
    if device.type != "cuda":
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    props = _PROPS.get(idx)
    if props is None:
        p = torch.cuda.get_device_properties(idx)
        props = _PROPS[idx] = ((p.major, p.minor), p.multi_processor_count)
    return props


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (read once per device); NOMINAL_SMS for CPU tensors."""
    props = card_props(device)
    return NOMINAL_SMS if props is None else props[1]


@triton.jit
def e4m3_to_f32(b):
    """E4M3 byte (int32 0..255) -> float32, exact (subnormals included)."""
    e = (b >> 3) & 15
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where((b & 128) != 0, -mag, mag)


@triton.jit
def f16_bits_to_f32(h):
    """The fp16 whose bits are the low 16 of int32 h, as float32 (exact)."""
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e2m1_raw(c):
    """4-bit E2M1 code (int32) -> float32 value * 2^-14 (the code's bits placed in an fp16; exact)."""
    return f16_bits_to_f32(((c & 7) << 9) | ((c & 8) << 12))


@triton.jit
def e2m1_to_f32(c):
    """4-bit E2M1 code (int32) -> float32 (exact, 0.5 included)."""
    return e2m1_raw(c) * 16384.0


_EMULATE_RNE = tl.constexpr(INTERPRET) if HAS_TRITON else INTERPRET


@triton.jit
def f32_to_bf16_rne(v):
    """fp32 -> bf16 with round-to-nearest-even (finite values): the GPU's cvt.rn; under the interpreter, whose cast
    truncates, the same rounding done on the bits."""
    if _EMULATE_RNE:
        b = v.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        out = b.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        out = v.to(tl.bfloat16)
    return out


@triton.jit
def shift(v, n: tl.constexpr):
    """v >> n for n >= 0, v << -n otherwise (n a compile-time constant)."""
    if n >= 0:
        out = v >> n
    else:
        out = v << (-n)
    return out


@triton.jit
def group_of(pid, nb0, nb1):
    """(member i, block within it) of program pid in a launch over up to 3 members of nb0, nb1, ... blocks."""
    i = (pid >= nb0).to(tl.int32) + (pid >= nb0 + nb1).to(tl.int32)
    return i, pid - tl.where(i == 0, 0, tl.where(i == 1, nb0, nb0 + nb1))


@triton.jit
def pick3(i, a, b, c):
    """a, b or c for the scalar i = 0, 1, 2 (pointers included: a branch, not a select)."""
    if i == 0:
        r = a
    elif i == 1:
        r = b
    else:
        r = c
    return r


@triton.jit
def sel3(i, a, b, c):
    """a, b or c for i = 0, 1, 2 (scalars: a select)."""
    return tl.where(i == 0, a, tl.where(i == 1, b, c))


@triton.jit
def member(i, n0, n1, n2, sa0, sa1, sa2, sb0, sb1, sb2, pa0, pa1, pa2, pb0, pb1, pb2):
    """Member i's geometry in a grouped launch: (rows N, two strides, two pointers) chosen from three members."""
    return (sel3(i, n0, n1, n2), sel3(i, sa0, sa1, sa2), sel3(i, sb0, sb1, sb2), pick3(i, pa0, pa1, pa2),
            pick3(i, pb0, pb1, pb2))


# ---- multi-tensor launches (hfq_kernels.eco, hfq_kernels.qlion): an int64 table, one record of fields per tensor ----
TABLE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # float dtype -> table_ptr's CODE


@triton.jit
def table_ptr(rec, i, CODE: tl.constexpr, ALIGNED: tl.constexpr):
    """Field i of a table record as a typed pointer (CODE: 0 fp32, 1 bf16, 2 fp16, 3 uint8, 4 int16, 5 int32);
    ALIGNED: the address is a multiple of 16 bytes (vector loads and stores)."""
    a = tl.load(rec + i)
    if CODE == 1:
        p = a.to(tl.pointer_type(tl.bfloat16))
    elif CODE == 2:
        p = a.to(tl.pointer_type(tl.float16))
    elif CODE == 3:
        p = a.to(tl.pointer_type(tl.uint8))
    elif CODE == 4:
        p = a.to(tl.pointer_type(tl.int16))
    elif CODE == 5:
        p = a.to(tl.pointer_type(tl.int32))
    else:
        p = a.to(tl.pointer_type(tl.float32))
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p


def upload_table(recs, device) -> torch.Tensor:
    """The records (lists of ints) as an int64 table on `device` (CUDA: through pinned memory, not waiting)."""
    t = torch.tensor(recs, dtype=torch.int64)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


class LRU(OrderedDict):
    """A small cache of launch tables and work lists, least recently used dropped first."""

    def __init__(self, size):
        super().__init__()
        self.size = size

    def get_or(self, key, make):
        v = self.get(key)
        if v is None:
            v = self[key] = make()
            if len(self) > self.size:
                self.popitem(last=False)
        else:
            self.move_to_end(key)
        return v


class _SplitScratch:
    """Scratch of split-K launches whose last program per output tile sums the partials itself (one launch, no
    reduce kernel): fp32 partials and int32 arrival counters, one pair per (device, stream), grown to the
    largest launch. Launches on one stream run one after another, so they share it safely; the summing program
    sets its tile's counter back to zero. Inside a CUDA graph capture each launch gets its own pair (the graph
    keeps it), so replays never share scratch with eager launches."""

    def __init__(self):
        self._bufs: dict = {}

    def get(self, device: torch.device, numel: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
        cuda = device.type == "cuda"
        if cuda and torch._C._cuda_isCurrentStreamCapturing():
            return (torch.empty(numel, dtype=torch.float32, device=device),
                    torch.zeros(tiles, dtype=torch.int32, device=device))
        if cuda and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = (device, torch._C._cuda_getCurrentRawStream(device.index) if cuda else 0)
        b = self._bufs.get(key)
        if b is None or b[0].numel() < numel or b[1].numel() < tiles:
            old = (0, 0) if b is None else (b[0].numel(), b[1].numel())
            # freed buffers are reused only by later work on this stream (the caching allocator's stream order)
            b = self._bufs[key] = (torch.empty(max(numel, old[0]), dtype=torch.float32, device=device),
                                   torch.zeros(max(tiles, old[1]), dtype=torch.int32, device=device))
        return b


SPLIT_SCRATCH = _SplitScratch()


def checkpointing() -> bool:
    """Whether torch.utils.checkpoint's saved-tensor hooks (its forward's, or its recompute's) are the active ones:
    a tensor saved for backward then lives only from the recompute to that layer's backward."""
    if torch.compiler.is_compiling():
        return False
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    name = getattr(top[0], "__qualname__", "") if top else ""
    return "_checkpoint_hook" in name or "_recomputation_hook" in name


# Programmatic dependent launch (sm_90+) for the decode-step kernels: inside `pdl_launches()` (the rollout engine's
# graph warm-up and capture) each kernel taking the PDL constexpr is launched with `launch_pdl`, so it may start
# while the kernel before it still runs; it waits (griddepcontrol.wait) before it touches memory an earlier kernel
# reads or writes, then lets the next kernel launch. That hides the launch gap between the many small kernels of a
# decode step; the NVFP4 GEMV also loads its first weight chunk before the wait (weights do not change inside a
# captured step). Outside the scope nothing changes (the engine opens none when told not to use PDL).
_PDL = [0]  # open pdl_launches() scopes
_PDL_CAP: dict = {}


class pdl_launches:
    """Context manager: kernels launched inside it (on sm_90+ GPUs) use programmatic dependent launch."""

    def __enter__(self):
        _PDL[0] += 1
        return self

    def __exit__(self, *exc):
        _PDL[0] -= 1
        return False


def pdl(device: torch.device) -> bool:
    """Whether a kernel launched now on `device` uses programmatic dependent launch (inside pdl_launches(), a CUDA
    sm_90+ device, not the interpreter)."""
    if not _PDL[0] or INTERPRET or not HAS_TRITON or device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ok = _PDL_CAP.get(idx)
    if ok is None:
        ok = _PDL_CAP[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return ok


def pdl_meta(device: torch.device) -> dict:
    """Launch meta-parameters for a kernel taking the PDL constexpr, for a launch made now on `device`."""
    return dict(PDL=True, launch_pdl=True) if pdl(device) else dict(PDL=False)


def pdl_bound(kernel, grid, meta: dict, check: tuple | None = None):
    """Two BoundLaunch of `kernel` (PDL off / on); call the result's `pick(device)` at launch time."""
    return _PdlBound(BoundLaunch(kernel, grid, dict(meta, PDL=False), check),
                     BoundLaunch(kernel, grid, dict(meta, PDL=True, launch_pdl=True), check))


class _PdlBound:
    __slots__ = ("off", "on")

    def __init__(self, off, on):
        self.off, self.on = off, on

    def pick(self, device):
        return self.on if pdl(device) else self.off


if HAS_TRITON:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        """With PDL: wait until the kernels before this one are done (their writes visible), then let the next
        kernel launch. Call before the first access to memory another kernel writes or reads."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
else:
    @triton.jit
    def pdl_enter(PDL):
        """Stand-in (no triton): kernels raise when launched."""


class BoundLaunch:
    """`kernel[grid](*args, **meta)` for a launch whose grid and meta-parameters are fixed (a per-shape plan's).
    The first call goes through Triton's JIT (compile or cache lookup) and keeps the compiled kernel; later calls
    launch it directly on the current stream, skipping the JIT's per-call binding, specialization, cache-key and
    launch-metadata work (tens of microseconds of host time per launch). A later call must match what Triton
    specialized on: the same scalar arguments, tensor dtypes and 16-byte alignment, and the same current device;
    one that does not, a CPU call (the interpreter), or SETTINGS.bind off (HFQ_TRITON_BIND=0) takes the JIT path.
    Launch hooks (profilers) are honoured: while one is installed the compiled kernel's own launcher is used.
    `check`: the kernel parameters (by name) compared per call (default: all). A caller whose other arguments are
    fixed for the launcher's life (a per-shape plan's weights, checked for dtype and alignment when it is made,
    its scalars, allocator-made outputs and scratch) names only the per-call ones."""

    __slots__ = ("kernel", "grid", "meta", "check", "ck", "tail", "tensors", "scalars", "dev", "raw")

    def __init__(self, kernel, grid, meta: dict, check: tuple | None = None):
        self.kernel, self.meta = kernel, dict(meta)
        self.check = None
        if check is not None:
            names = list(kernel.arg_names)
            unknown = [c for c in check if c not in names]
            if unknown:
                raise ValueError(f"BoundLaunch check: {unknown} are not parameters of {names}")
            self.check = tuple(names.index(c) for c in check)
        self.grid = tuple(grid) + (1,) * (3 - len(grid))  # the compiled kernel's launcher takes all three
        self.ck = self.tail = self.tensors = self.scalars = self.dev = self.raw = None

    def __call__(self, *args):
        ck = self.ck
        if ck is not None and self._matches(args) and torch._C._cuda_getDevice() == self.dev:
            stream = torch._C._cuda_getCurrentRawStream(self.dev)
            raw = self.raw
            if raw is not None and not (_HOOKS.launch_enter_hook.calls or _HOOKS.launch_exit_hook.calls):
                launch, fn, coop, pdl, md = raw
                g = self.grid
                launch(g[0], g[1], g[2], stream, fn, coop, pdl, None, None, md, None, None, None, *args, *self.tail)
            else:
                ck[self.grid](*args, *self.tail, stream=stream)
            return
        out = self.kernel[self.grid](*args, **self.meta)
        if ck is None and SETTINGS.bind and not INTERPRET and out is not None and hasattr(out, "__getitem__"):
            self._bind(out, args)

    def _matches(self, args) -> bool:
        for i, dt in self.tensors:
            a = args[i]
            if a.dtype is not dt or a.data_ptr() & 15:
                return False
        for i, v in self.scalars:
            if args[i] != v:
                return False
        return True

    def _bind(self, ck, args) -> None:
        tensors = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        if not tensors or not all(a.is_cuda and not a.data_ptr() & 15 for _, a in tensors):
            return
        if not all(isinstance(a, (int, float, bool, torch.Tensor)) or a is None for a in args):
            return
        tail = []
        for p in list(self.kernel.params)[len(args):]:  # the constexprs follow the runtime arguments
            if p.name in self.meta:
                tail.append(self.meta[p.name])
            elif p.has_default:
                tail.append(p.default)
            else:
                return
        self.tail = tuple(tail)
        per_call = range(len(args)) if self.check is None else self.check
        self.tensors = tuple((i, a.dtype) for i, a in tensors if i in per_call)
        self.scalars = tuple((i, a) for i, a in enumerate(args) if not isinstance(a, torch.Tensor) and i in per_call)
        self.dev = torch._C._cuda_getDevice()  # the device Triton loaded the kernel on (its current one)
        self.raw = _raw_launch(ck)
        self.ck = ck


def _raw_launch(ck):
    """(launch, function, cooperative, pdl, packed metadata) of a compiled kernel whose launcher needs no scratch
    buffers, for a direct call of its C launch function; None where this triton's launcher looks different."""
    if _HOOKS is None:
        return None
    try:
        run = ck.run
        launch = run.launch
        if run.global_scratch_size or run.profile_scratch_size or getattr(run, "num_ctas", 1) != 1:
            return None
        if getattr(launch, "__module__", None) not in (None, "__triton_launcher"):  # wrapped (tensor descriptors)
            return None
        return launch, ck.function, run.launch_cooperative_grid, run.launch_pdl, ck.packed_metadata
    except Exception:  # noqa: BLE001 - another triton version: the compiled kernel's own launcher serves
        return None


try:
    from triton import knobs as _knobs

    _HOOKS = _knobs.runtime
    _HOOKS.launch_enter_hook.calls, _HOOKS.launch_exit_hook.calls  # noqa: B018 - HookChain (triton >= 3.5)
except Exception:  # noqa: BLE001
    _HOOKS = None
