"""NVFP4 W4A16 linear: the per-shape plan, the one route from a call to the kernels.

A LinearPlan holds what y = x @ dequant(W)^T + bias needs for one weight and one input (shape, dtype, device),
decided once: validation, the config (gluon default / tuned table / autotuning), split-K, grids and kernel
meta-parameters. Its `forward` does only the per-call work (views, output allocation, launches) and its `grad`
is grad-input (dequantize + cuBLAS; a g4 weight's few-row grads: nvfp4_grad's kernel). NVFP4Linear keeps a plan
per input shape for its eager calls; the torch.library ops (torch.compile, CUDA graphs, direct callers) make one
per call. Canonical compressed-tensors weights: plan_linear; weights in the g4 layout (hfq_kernels.nvfp4_gluon):
plan_linear_g4.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from hfq_kernels import nvfp4_gluon as gluon
from hfq_kernels._autotune import Tuner
from hfq_kernels._autotune import _capturing as _autotune_capturing
from hfq_kernels._triton import INTERPRET, aligned16, cdiv, pdl_bound, sm_count
from hfq_kernels.nvfp4_configs import (KINDS, LINEAR_TUNER, MM_DTYPES, candidates, default_config, gluon_config,
                                       splits, words_default)
from hfq_kernels.nvfp4_grad import bound_grad, fused_rows_ok
from hfq_kernels.nvfp4_matmul import _gemv_kernel, _mm_kernel, _splitk_reduce_kernel, _words_kernel
from hfq_kernels.nvfp4_quant import _dequantize_kernel, check_packed, recip


# ----------------------------------------------------------------------------------------------- checks
def check_bias(bias, n):
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"nvfp4_linear: bias must have shape ({n},), got {tuple(bias.shape)}")


def check_linear(x, packed, scale, global_scale, bias) -> None:
    """Raise ValueError (naming the tensor and the allowed shape) unless x, the canonical weight and bias fit."""
    check_packed(packed, scale, global_scale)
    k = packed.shape[1] * 2
    check_bias(bias, packed.shape[0])
    if x.shape[-1] != k:
        raise ValueError(f"nvfp4_linear: x has in_features={x.shape[-1]} but the weight has {k}")


def check_g4_call(x, wr, sr, global_scale, bias, n, k, what="nvfp4_g4_linear"):
    """Raise ValueError (naming the tensor and the allowed shape) unless x, the g4 tensors and bias fit together."""
    gluon.check_g4(wr, sr, n, k)
    if global_scale.numel() != 1:
        raise ValueError(f"{what}: weight_global_scale must have one element, got shape {tuple(global_scale.shape)}")
    check_bias(bias, n)
    if x.shape[-1] != k:
        raise ValueError(f"{what}: x has in_features={x.shape[-1]} but the weight has {k}")


def check_grad_width(g, n: int, what: str) -> None:
    """Raise ValueError unless grad's last dimension is the weight's n rows."""
    if g.shape[-1] != n:
        raise ValueError(f"{what}: grad has {g.shape[-1]} features but the weight has {n} rows")


# ----------------------------------------------------------------------------------------------- dequantize
def dequantizer(packed, scale, global_scale):
    """`run(dtype) -> [n, k]`: the dense weight of one canonical NVFP4 weight (Triton; the global scale is read at
    each call, so in-place updates are seen)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    su8 = scale.view(torch.uint8)
    grid = (cdiv(n, 16), cdiv(k, 256))

    def run(dtype):
        w = torch.empty((n, k), dtype=dtype, device=packed.device)
        _dequantize_kernel[grid](packed, su8, recip(global_scale), w, n, k, BR=16, BC=256, num_warps=4)
        return w

    return run


def grad_input(g, packed, scale, global_scale):
    """grad_x = g @ dequant(W) for a canonical weight (a plan's `grad`): dequantize (Triton), then cuBLAS."""
    check_packed(packed, scale, global_scale)
    check_grad_width(g, packed.shape[0], "nvfp4_linear_grad_input")
    return g @ dequantizer(packed, scale, global_scale)(g.dtype)


def grad_input_g4(g, wr, sr, global_scale, n: int, k: int):
    """grad_x = g @ dequant(W) for a weight in the g4 layout: g4_grad for g's rows, run once."""
    check_grad_width(g, n, "nvfp4_g4_linear_grad_input")
    return g4_grad(g.numel() // n, n, k, wr, sr, global_scale, g.dtype, g.device)(g)


def g4_grad(m: int, n: int, k: int, wr, sr, global_scale, dtype, device, dequant=None, fixed: bool = False):
    """grad(g) -> g @ dequant(W) for grads g of m rows (dtype, device) and a g4 weight, decided once (a plan
    keeps it): for a few bf16 rows (nvfp4_grad.fused_rows_ok) one kernel that decodes the codes in registers,
    else dequantize (`dequant(dtype)`: a plan's own; default dequantize_g4), then cuBLAS. `fixed`: wr, sr and
    global_scale were checked for the kernel's launches (nvfp4_grad.grad_launcher)."""
    if fused_rows_ok(m, dtype, device):
        run = bound_grad(m, n, k, device, fixed)

        def grad(g):
            if g.is_contiguous():  # rows n apart, read in place; dx made in g's leading shape
                return run(g, wr, sr, recip(global_scale), n, (*g.shape[:-1], k))
            g2 = g.reshape(m, n)
            if g2.stride(-1) != 1:
                g2 = g2.contiguous()
            return run(g2, wr, sr, recip(global_scale)).view(*g.shape[:-1], k)
        return grad
    if dequant is None:
        def dequant(dt):
            return gluon.dequantize_g4(wr, sr, global_scale, n, k, dt)
    return lambda g: g @ dequant(g.dtype)


# ----------------------------------------------------------------------------------------------- launches
_ASM_FAILED: dict = {}  # constexpr-config -> error, for configs whose inline-PTX decode failed to build


def _use_asm(device: torch.device) -> bool:
    return (not INTERPRET and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0))


def _launch(kernel, grid, use_asm: bool, *args, **kw):
    """Launch; if this config's inline-PTX variant fails to build, remember it and use the plain decode."""
    key = (kernel.fn.__name__, tuple(sorted((k, v) for k, v in kw.items() if isinstance(v, (int, bool)))))
    if use_asm and key in _ASM_FAILED:
        use_asm = False
    try:
        kernel[grid](*args, USE_ASM=use_asm, **kw)
    except Exception as e:
        if not use_asm:
            raise
        _ASM_FAILED[key] = f"{type(e).__name__}: {str(e)[-1500:]}"
        warnings.warn(f"{key[0]}: the inline-PTX decode of config {dict(key[1])} failed to build "
                      f"({type(e).__name__}: {str(e)[-300:]}); this process uses the plain decode for it",
                      RuntimeWarning, stacklevel=2)
        kernel[grid](*args, USE_ASM=False, **kw)


def _atomic_launch(x2, packed, scale, rcp, bias, cfg):
    """"tile" and "gemv" kernels: split > 1 accumulates into an fp32 buffer with atomics, in no fixed order, so
    under torch.use_deterministic_algorithms(True) they run unsplit."""
    m, k = x2.shape
    n = packed.shape[0]
    bn, bm, bk = cfg["BN"], cfg["BM"], cfg["BK"]
    chunks = cdiv(k, bk)
    split, cps = splits(chunks, 1 if torch.are_deterministic_algorithms_enabled() else cfg.get("split", 1))
    atomic = split > 1
    if atomic:
        y = torch.zeros((m, n), dtype=torch.float32, device=x2.device)
    else:
        y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    meta = dict(BN=bn, BM=bm, BK=bk, HAS_BIAS=bias is not None and not atomic, ATOMIC=atomic,
                MASK_K=(k % bk) != 0 or (chunks % split) != 0, num_warps=cfg.get("warps", 4),
                num_stages=cfg.get("stages", 3))
    args = (x2, packed, scale.view(torch.uint8), rcp, bias if bias is not None else rcp, y,
            m, n, k, x2.stride(0), y.stride(0), cps)
    if cfg["kind"] == "gemv":
        _gemv_kernel[(cdiv(n, bn), split)](*args, **meta)
    else:
        _launch(_mm_kernel, (cdiv(n, bn), cdiv(m, bm), split), bool(cfg.get("asm", True)) and _use_asm(x2.device),
                *args, F32_DOT=INTERPRET, **meta)
    if atomic:
        if bias is not None:
            y += bias.float()
        return y.to(x2.dtype)
    return y


# ----------------------------------------------------------------------------------------------- plans
class LinearPlan:
    """What one weight and one input (shape, dtype, device) need, decided once (see the module doc).
    `forward(x, bias)` and `grad(g)` do only the per-call work; a dense plan (dequantize + cuBLAS) also hands out
    `dequant(dtype)`, so that a training forward can keep the weight it made for grad-input (plans with their own
    kernel have none). `final` is False for a config picked while nothing may be tuned (graph capture): such a plan
    serves its call and is not kept.
    `gen` is LINEAR_TUNER.gen when it was made (a plan is stale once the tuned table changes). Callers keep plans
    per weight and rebuild them when the weight tensors are replaced."""

    __slots__ = ("forward", "grad", "final", "gen", "config", "dequant")

    def __init__(self, forward, grad, final: bool, gen: int, config, dequant=None):
        self.forward, self.grad, self.final, self.gen, self.config = forward, grad, final, gen, config
        self.dequant = dequant  # dtype -> the dense weight (F.linear's operand)


class _PlanCtx:
    """What a plan's launch closures read: the call's geometry and the weight's tensors."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def recip(self):
        return recip(self.global_scale)


def checked_runner(x2, packed, scale, global_scale, bias, tol: float = 2e-2):
    """Autotuning runner that first checks a candidate's product against dequantize + F.linear (fp32) and
    raises for a wrong one, so the tuner can never pick a config that miscomputes on this device/shape."""
    ref = {}

    def runner(c):
        if "y" not in ref:
            w = dequantizer(packed, scale, global_scale)(torch.float32)
            ref["y"] = F.linear(x2.float(), w, None if bias is None else bias.float())
        plan = plan_linear(x2, packed, scale, global_scale, bias, config=c)
        y = plan.forward(x2, bias).float()
        err = float((y - ref["y"]).norm() / ref["y"].norm().clamp_min(1e-30))
        if not err <= tol:
            raise ValueError(f"nvfp4 linear config {c}: relative error {err:.3g} > {tol} on this shape")
        return lambda: plan.forward(x2, bias)

    return runner


def _pick(x2, packed, scale, global_scale, bias, m, n, k) -> tuple[dict, bool]:
    """The config for this shape: gluon for bf16 decode, else the tuned choice, else tune now (or the default);
    and whether it may be kept: gluon defaults and tuned (stored) choices may, a heuristic default returned while
    tuning is impossible (graph capture / compile) may not."""
    if gluon.supported(x2):
        return gluon_config(m, n, k, x2.device), True
    config = LINEAR_TUNER.cached(m, n, k, x2.dtype, x2.device)
    if config is not None:
        return config, True
    if x2.device.type != "cuda":  # the tuner times with CUDA events: CPU calls (the interpreter) take the default
        return default_config(m, n, k, sm_count(x2.device)), True
    key = Tuner.key(m, n, k, x2.dtype, x2.device)
    config = LINEAR_TUNER.choose(key, candidates(m, n, k, sm_count(x2.device)),
                                 checked_runner(x2, packed, scale, global_scale, bias),
                                 default_config(m, n, k, sm_count(x2.device)),
                                 fallback=dict(kind="dequant"))  # dequantize + cuBLAS: needs no tuned kernel
    return config, not _autotune_capturing() or LINEAR_TUNER.cache.get(key) is config


def _finish(c: _PlanCtx, dst_split: int, launch):
    """forward(x, b, aux) around launch(x2, xs, b, dst, y, aux) (x2's M rows xs elements apart): y (x's leading
    shape, N) written directly (split 1) or via fp32 partials [split, M, N] and the reduce kernel. A contiguous x
    is read in place (its rows are K apart whatever its shape): no view is made, which autograd would track."""
    m, n, k = c.m, c.n, c.k
    rgrid = (cdiv(m * n, 1024),)
    reduce = {hb: pdl_bound(_splitk_reduce_kernel, rgrid, dict(HAS_BIAS=hb, BLOCK=1024, num_warps=4))
              for hb in (False, True)}

    def fwd(x, b, aux=None):
        if x.is_contiguous():
            x2, xs = x, k
        else:
            x2 = x.reshape(m, k)
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            xs = x2.stride(0)
        y = torch.empty(c.out_shape, dtype=c.dt, device=c.dev)
        if dst_split == 1:
            launch(x2, xs, b, y, y, aux)
        else:
            dst = torch.empty((dst_split, m, n), dtype=torch.float32, device=c.dev)
            launch(x2, xs, b, dst, y, aux)
            reduce[b is not None].pick(c.dev)(dst, b if b is not None else c.recip(), y, m, n, dst_split, n)
        return y

    return fwd


def _words(c: _PlanCtx, cfg: dict):
    """The planned forward of the words kernel for config `cfg`."""
    m, n, k = c.m, c.n, c.k
    bn, bm, bk = cfg["BN"], cfg["BM"], cfg["BK"]
    if bk < 128 or bm < 16 or bn < 32:
        raise ValueError(f"nvfp4 words kernel config: BK={bk}, BM={bm}, BN={bn}; need BK >= 128 (8 dots of "
                         f"K = BK/8 >= 16), BM >= 16 and BN >= 32 (BN = 16 gave wrong products on the H100)")
    chunks = cdiv(k, bk)
    split, cps = splits(chunks, cfg.get("split", 1))
    wq = (c.packed if c.packed.is_contiguous() else c.packed.contiguous()).view(torch.int32)
    su8 = c.scale.view(torch.uint8)
    grid = (cdiv(n, bn), cdiv(m, bm), split)
    meta = dict(BN=bn, BM=bm, BK=bk, HAS_BIAS=c.has_bias and split == 1, PARTIAL=split > 1,
                MASK_K=(k % bk) != 0 or (chunks % split) != 0, X_F16=c.dt == torch.float16,
                PREFETCH=bool(cfg.get("prefetch", True)), F32_DOT=INTERPRET,
                num_warps=cfg.get("warps", 4), num_stages=cfg.get("stages", 1))

    def launch(x2, xs, b, dst, y, aux):
        rcp = c.recip()
        _words_kernel[grid](x2, wq, su8, rcp, b if b is not None else rcp, dst, m, n, k, xs, n, cps, **meta)

    return _finish(c, split, launch)


def _gluon(c: _PlanCtx, config: dict, ws=None):
    """The planned forward of the Gluon kernel on tensors in the g4 layout, one launch (a split-K launch sums its
    own splits): forward(x, b) on the plan's ws = (wr, sr), or forward(x, b, (wr, sr)) where ws is None."""
    split, cps = splits(cdiv(c.k, 64), config.get("split", 1))
    run = gluon.bound_launcher(c.m, c.n, c.k, config, split, cps, c.has_bias, serial=True, fixed=c.fixed)
    if ws is not None:
        wr, sr = ws
        return _finish(c, 1, lambda x2, xs, b, dst, y, aux: run(x2, wr, sr, c.recip(), b, y, c.n, xs))
    return _finish(c, 1, lambda x2, xs, b, dst, y, w: run(x2, w[0], w[1], c.recip(), b, y, c.n, xs))


def _kind_forward(c: _PlanCtx, kind: str, config: dict, x):
    """The planned forward for a chosen non-dequant kernel kind on a canonical weight."""
    m, n, k = c.m, c.n, c.k
    if kind == "words":
        return _words(c, config)
    if kind == "gluon":
        fallback = _words(c, words_default(m, n, k, sm_count(c.dev)))  # also while the g4 copy cannot be built
        if not gluon.supported(x.reshape(-1, k)):
            return fallback
        g4 = _gluon(c, config)

        def fwd(x, b):
            rep = gluon.repacked(c.packed, c.scale)  # cached per tensor and version (rebuilt after in-place updates)
            return g4(x, b, rep) if rep is not None else fallback(x, b)
        return fwd
    if kind in ("tile", "gemv"):
        def fwd(x, b):
            x2 = x.reshape(m, k)
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            return _atomic_launch(x2, c.packed, c.scale, c.recip(), b, config).view(c.out_shape)
        return fwd
    raise ValueError(f"nvfp4_linear config: unknown kind {kind!r}; kinds: {sorted(KINDS)}")


def plan_linear(x, packed, scale, global_scale, bias=None, config: dict | None = None) -> LinearPlan:
    """The LinearPlan of y = x @ dequant(W)^T + bias for x's shape/dtype/device and a canonical weight (raises
    for bad inputs). `config` forces a kernel config (tests, sweeps, the tuner's runs); else it is chosen."""
    check_linear(x, packed, scale, global_scale, bias)
    n, k = packed.shape[0], packed.shape[1] * 2
    x = x.detach()  # only looked at (and, for a first call that tunes, run); never kept
    dt, dev = x.dtype, x.device
    dequant = dequantizer(packed, scale, global_scale)

    def grad(g):
        return g @ dequant(g.dtype)

    def dense(x, b):
        return F.linear(x, dequant(x.dtype), b)

    m = x.numel() // k
    if m == 0 or dt not in MM_DTYPES:
        return LinearPlan(dense, grad, True, LINEAR_TUNER.gen, None, dequant)
    final = True
    if config is None:
        config = LINEAR_TUNER.cached(m, n, k, dt, dev) if m > gluon.FEW_ROWS else None
        if config is None or config["kind"] != "dequant":
            x2 = x.reshape(-1, k)
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            config, final = _pick(x2, packed, scale, global_scale, None if bias is None else bias.detach(), m, n, k)
    gen = LINEAR_TUNER.gen  # after the choice (tuning a new shape stores its result)
    kind = config["kind"]
    if kind == "dequant":
        return LinearPlan(dense, grad, final, gen, config, dequant)
    c = _PlanCtx(m=m, n=n, k=k, dt=dt, dev=dev, global_scale=global_scale, packed=packed, scale=scale,
                 has_bias=bias is not None, out_shape=(*x.shape[:-1], n),
                 fixed=False)  # a gluon kind reads its g4 copy per call (gluon.repacked), not fixed weights
    return LinearPlan(_kind_forward(c, kind, config, x), grad, final, gen, config)


def plan_linear_g4(x, wr, sr, global_scale, bias, n: int, k: int) -> LinearPlan:
    """plan_linear() for a weight in the g4 layout: the Gluon kernel where gluon.supported(x), else dequantize_g4 +
    cuBLAS (config kind "dequant"); grad is g4_grad's (<= MAX_ROWS bf16 rows: nvfp4_grad's one-launch
    kernel). Raises for bad inputs."""
    check_g4_call(x, wr, sr, global_scale, bias, n, k)
    run_dequant = gluon.dequantizer(wr, sr, n, k)

    def dequant(dtype):
        return run_dequant(recip(global_scale), dtype)

    def dense(x, b):
        return F.linear(x, dequant(x.dtype), b)

    x2 = x.detach().reshape(-1, k)
    m = x2.shape[0]
    fixed = aligned16(wr, sr, global_scale)
    grad = g4_grad(m, n, k, wr, sr, global_scale, x.dtype, x.device, dequant, fixed)
    if m == 0 or not gluon.supported(x2):
        return LinearPlan(dense, grad, True, LINEAR_TUNER.gen, {"kind": "dequant"}, dequant)
    config = gluon_config(m, n, k, x.device)
    c = _PlanCtx(m=m, n=n, k=k, dt=x.dtype, dev=x.device, global_scale=global_scale,
                 has_bias=bias is not None, out_shape=(*x.shape[:-1], n), fixed=fixed)
    return LinearPlan(_gluon(c, config, (wr, sr)), grad, True, LINEAR_TUNER.gen, config)
