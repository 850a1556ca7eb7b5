"""NVFP4 torch.library ops and their autograd: quantize, dequantize, W4A16 linear (+ its grad-input product).

CPU runs the torch reference (hfq_kernels.reference.fp4); CUDA runs the Triton kernels of nvfp4_quant.py
(quantize / dequantize) and, for the products, a per-call LinearPlan (nvfp4_plan.py: the route NVFP4Linear's
eager calls take too, with plans kept per input shape).
Interface (the layouts are the canonical compressed-tensors ones, read directly by the kernels):
  hfq::nvfp4_quantize(w[out,in]) -> (packed u8[out,in/2], scale f8e4m3[out,in/16], global_recip f32[1])
  hfq::nvfp4_dequantize(packed, scale, global_recip, dtype) -> [out,in]
  hfq::nvfp4_linear(x[...,in], packed, scale, global_recip, bias?) -> [...,out]  (grads: x, bias)
  hfq::nvfp4_linear_grad_input(grad[...,out], packed, scale, global_recip) -> [...,in]
The same on the g4 layout (hfq_kernels.nvfp4_gluon: NVFP4Linear's storage where the Gluon kernel runs; n, k are
the weight's [out, in]); CPU runs the torch reference (unrepack + fp4), CUDA the Gluon / Triton kernels:
  hfq::nvfp4_g4_dequantize(words, scales, global_recip, n, k, dtype) -> [n, k]
  hfq::nvfp4_g4_linear(x[...,k], words, scales, global_recip, n, k, bias?) -> [...,n]  (grads: x, bias)
  hfq::nvfp4_g4_linear_grad_input(grad[...,n], words, scales, global_recip, n, k) -> [...,k]
The linears and grad-inputs are triton_ops, traced into by torch.compile (see nvfp4_linear).
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from hfq_kernels._autotune import Tuner, m_bucket
from hfq_kernels._settings import SETTINGS
from hfq_kernels._triton import HAS_TRITON, on_gpu
from hfq_kernels import nvfp4_gluon as g4
from hfq_kernels.nvfp4_configs import KINDS, LINEAR_TUNER
from hfq_kernels.nvfp4_grad import fused_ok
from hfq_kernels.nvfp4_plan import (LinearPlan, check_g4_call, check_grad_width, check_linear, grad_input,
                                    grad_input_g4, plan_linear, plan_linear_g4)
from hfq_kernels.nvfp4_quant import check_packed, dequantize, dequantize_traced, quantize
from hfq_kernels.reference import fp4

# ----------------------------------------------------------------------------------------------- eager autograd
# The registered ops' autograd adds host time to every call (the custom-op autograd wrapper, two Python dispatches,
# then the grad-input op again in backward), and the op makes its plan per call. In plain eager (plain_eager(x))
# NVFP4Linear therefore runs the plan it keeps for x's shape through plan_apply instead.
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None)


class _KeptDense:
    """Bytes of dequantized weights that training forwards (plan_apply) keep alive for their grad-input, held
    under SETTINGS.grad_dense_gb. A kept weight is freed when autograd frees it: after its backward, or right after
    the forward under activation checkpointing (whose recompute keeps it again until that layer's backward).
    Kept weights are tracked by plain weak references, looked at (pruned) only when the running total would pass
    the budget or the list has doubled: a release callback would run Python on autograd's device thread in every
    backward, which cost more host time per layer call than this bookkeeping. A prune that finds the budget spent
    makes the next 64 checks refuse without pruning (weights are freed by backward passes, not within a forward)."""

    def __init__(self):
        self._refs: list = []  # (weakref to a kept weight, its bytes)
        self._upper = 0  # bytes of the weights in _refs, freed ones included until the next prune
        self._limit = 1024  # entries before a prune also for the list's sake (many small weights)
        self._skip = 0  # room() checks answered "no" without a prune after a prune found the budget spent

    @property
    def bytes(self) -> int:
        """Bytes of kept weights still alive."""
        self._prune()
        self._skip = 0
        return self._upper

    def room(self, nbytes: int) -> bool:
        cap = SETTINGS.grad_dense_gb * 2**30
        if self._upper + nbytes <= cap:
            return True
        if self._skip > 0:
            self._skip -= 1
            return False
        self._prune()
        if self._upper + nbytes <= cap:
            return True
        self._skip = 64
        return False

    def take(self, w: torch.Tensor) -> bool:
        nbytes = w.numel() * w.element_size()
        if not self.room(nbytes):
            return False
        if len(self._refs) >= self._limit:
            self._prune()
        self._refs.append((weakref.ref(w), nbytes))
        self._upper += nbytes
        return True

    def _prune(self) -> None:
        self._refs = [(r, n) for r, n in self._refs if r() is not None]
        self._upper = sum(n for _, n in self._refs)
        self._limit = max(1024, 2 * len(self._refs))  # amortized: a prune per as many takes as entries remain


KEPT_DENSE = _KeptDense()


class _PlanFn(torch.autograd.Function):
    """hfq::nvfp4_linear's autograd on a LinearPlan where no dense weight is kept for grad-input:
    forward(x, bias, plan, w) with w the weight the forward dequantized (None: the plan's own kernel), and a
    backward that runs the plan's grad (dequantize + matmul, or nvfp4_grad's kernel for few rows of a g4 weight).
    The plan holds the (frozen) weight."""

    @staticmethod
    def forward(ctx, x, bias, plan, w):
        ctx.plan = plan
        ctx.has_bias = bias is not None
        return plan.forward(x, bias) if w is None else F.linear(x, w, bias)

    @staticmethod
    @once_differentiable  # its kernels record no graph: a second derivative raises instead of coming out zero
    def backward(ctx, grad):
        gx = gb = None
        if ctx.needs_input_grad[0]:
            gx = ctx.plan.grad(grad)
        if ctx.has_bias and ctx.needs_input_grad[1]:
            gb = grad.reshape(-1, grad.shape[-1]).sum(0)
        return gx, gb, None, None


# Function.apply's Python wrapper binds default arguments and unwraps functorch's dead wrappers before the C++ apply;
# outside functorch transforms, with none of those, plan_apply calls the C++ apply itself (host time per call).
_c_apply = getattr(getattr(torch._C, "_FunctionBase", None), "__dict__", {}).get("apply")
_plan_fn_c = _c_apply.__get__(None, _PlanFn) if _c_apply is not None else _PlanFn.apply


def _plan_fn(x, bias, plan, w):
    if _functorch_active is not None and _functorch_active():
        return _PlanFn.apply(x, bias, plan, w)
    return _plan_fn_c(x, bias, plan, w)


def plan_apply(plan: LinearPlan, x: torch.Tensor, bias) -> torch.Tensor:
    """plan.forward(x, bias) with its gradient where one is wanted (x or bias requires one). A dense plan's
    training forward keeps the dense weight it made for grad-input where KEPT_DENSE allows: then the product is
    F.linear's own, whose C++ autograd saves that weight (so activation checkpointing drops and recomputes it) and
    runs grad-input as one cuBLAS call. Otherwise (and always for plans with their own few-row kernel, whose
    grad is nvfp4_grad's one-launch kernel) _PlanFn runs the plan's forward and its grad in backward."""
    if not (torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))):
        return plan.forward(x, bias)
    if plan.dequant is None:
        return _plan_fn(x, bias, plan, None)
    w = plan.dequant(x.dtype)
    if x.requires_grad and KEPT_DENSE.take(w):
        return F.linear(x, w, bias)
    return _plan_fn(x, bias, plan, w)


def _add_adapter(y, xl, a, b, scale: float) -> torch.Tensor:
    """y += scale * (xl a^T) b^T in place (one addmm_ on y's rows); returns t = xl a^T."""
    t = F.linear(xl, a)
    y.view(-1, y.shape[-1]).addmm_(t.view(-1, t.shape[-1]), b.t(), alpha=scale)
    return t


class _PlanLoraFn(torch.autograd.Function):
    """plan_lora_apply's training product as one autograd node: y = base(x) + scale * (xl a^T) b^T with the adapter's
    update added into the base output in place (one addmm_). Its backward makes s = scale * g b once, adds s a into
    the base's grad-input in place (x feeding both) and forms the adapter's grads from s, so the sum costs no view,
    add or transpose nodes. forward(x, xl, bias, a, b, plan, w, keep, scale): xl None when the adapter reads x
    itself (no dropout); w the dense weight a dense plan made (None: the plan's own kernel), kept for grad-input
    when `keep` (KEPT_DENSE allowed it), else grad-input is the plan's grad."""

    @staticmethod
    def forward(ctx, x, xl, bias, a, b, plan, w, keep, scale):
        y = F.linear(x, w, bias) if w is not None else plan.forward(x, bias)
        src = x if xl is None else xl
        t = _add_adapter(y, src, a, b, scale)
        ctx.save_for_backward(src, t, a, b, w if keep else None)
        ctx.plan, ctx.scale, ctx.own_x = plan, scale, xl is None
        return y

    @staticmethod
    @once_differentiable  # as _PlanFn's
    def backward(ctx, g):
        src, t, a, b, w = ctx.saved_tensors
        need_x, need_xl, need_bias, need_a, need_b = ctx.needs_input_grad[:5]
        g2 = g.reshape(-1, g.shape[-1])
        s = (g2 @ b).mul_(ctx.scale) if (need_x and ctx.own_x) or need_xl or need_a else None  # grad of t
        gx = gxl = gbias = ga = gb = None
        if need_x:
            gx = ctx.plan.grad(g) if w is None else g @ w
            if ctx.own_x:
                gx.view(-1, gx.shape[-1]).addmm_(s, a)
        if need_xl:
            gxl = (s @ a).view(src.shape)
        if need_bias:
            gbias = g2.sum(0)
        if need_a:
            ga = s.t() @ src.reshape(-1, src.shape[-1])
        if need_b:
            gb = (t.reshape(-1, t.shape[-1]).t() @ g2).mul_(ctx.scale).t()
        return gx, gxl, gbias, ga, gb, None, None, None, None


_plan_lora_fn = _c_apply.__get__(None, _PlanLoraFn) if _c_apply is not None else _PlanLoraFn.apply


def plan_lora_apply(plan: LinearPlan, x: torch.Tensor, bias, xl: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """plan_apply(plan, x, bias) + scale * (xl a^T) b^T: one LoRA adapter on the frozen base (xl is x or its
    dropout), as three products with one rounding of the sum (the adapter's update is added by addmm). Where a
    gradient is wanted, _PlanLoraFn runs it (the dense weight of a dense plan kept for grad-input as plan_apply
    keeps it). Adapter weights of another dtype (fp32 under autocast) take x's dtype first, as autocast's products
    would. Callers are plain eager (plain_eager: no functorch transform)."""
    if a.dtype != x.dtype:
        a = a.to(x.dtype)
    if b.dtype != x.dtype:
        b = b.to(x.dtype)
    grad = torch.is_grad_enabled() and (x.requires_grad or xl.requires_grad or a.requires_grad or b.requires_grad
                                        or (bias is not None and bias.requires_grad))
    if not grad:
        y = plan.forward(x, bias)
        _add_adapter(y, xl, a, b, scale)
        return y
    w = plan.dequant(x.dtype) if plan.dequant is not None else None
    keep = w is not None and x.requires_grad and KEPT_DENSE.take(w)  # else grad-input dequantizes again
    return _plan_lora_fn(x, None if xl is x else xl, bias, a, b, plan, w, keep, scale)


def plain_eager(x: torch.Tensor) -> bool:
    """True where a caller may run its kept plan (plan_apply) instead of the registered op for input x: a plain
    tensor on CUDA (or on CPU with SETTINGS.plan_on_cpu: tests, under the interpreter), no torch.compile, dispatch
    mode or functorch transform."""
    return (HAS_TRITON and type(x) is torch.Tensor and (x.is_cuda or (SETTINGS.plan_on_cpu and x.is_cpu))
            and not torch.compiler.is_compiling()
            and _dispatch_modes is not None and _dispatch_modes() == 0
            and not (_functorch_active is not None and _functorch_active()))


# ----------------------------------------------------------------------------------------------- ops
@torch.library.custom_op("hfq::nvfp4_quantize", mutates_args=())
def nvfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return fp4.nvfp4_quantize(w)


@nvfp4_quantize.register_kernel("cuda")
def _(w):
    return quantize(w) if on_gpu(w) else fp4.nvfp4_quantize(w)


@nvfp4_quantize.register_fake
def _(w):
    out, k = w.shape
    return (w.new_empty((out, k // 2), dtype=torch.uint8),
            w.new_empty((out, k // 16), dtype=torch.float8_e4m3fn),
            w.new_empty((1,), dtype=torch.float32))


@torch.library.custom_op("hfq::nvfp4_dequantize", mutates_args=())
def nvfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    return fp4.nvfp4_dequantize(packed, scale, global_scale, dtype)


@nvfp4_dequantize.register_kernel("cuda")
def _(packed, scale, global_scale, dtype):
    if on_gpu(packed):
        return dequantize(packed, scale, global_scale, dtype)
    return fp4.nvfp4_dequantize(packed, scale, global_scale, dtype)


@nvfp4_dequantize.register_fake
def _(packed, scale, global_scale, dtype):
    return packed.new_empty((packed.shape[0], packed.shape[1] * 2), dtype=dtype)


def _linear_ref(x, packed, scale, global_scale, bias):
    check_linear(x, packed, scale, global_scale, bias)
    return F.linear(x, fp4.nvfp4_dequantize(packed, scale, global_scale, x.dtype), bias)


def _traced(t: torch.Tensor) -> bool:
    """True while a tracer runs an op's body (torch.compile: fake or functional tensors, a dispatch mode)."""
    return type(t) is not torch.Tensor or (_dispatch_modes is not None and _dispatch_modes() > 0)


# The linears and their grad-inputs (both layouts) are triton_ops: torch.compile traces into them, so a call that
# dequantizes (more than FEW_ROWS rows, and every grad-input but the few-row g4 kernel's) becomes the dequantize kernel,
# launched from inductor's code, and a product inductor sees, with no per-call Python. Eager calls run the per-call
# plan. The few-row kernels (tuned canonical kernels, the Gluon forward, nvfp4_grad's grad-input) stay opaque ops
# inside a traced body.
@torch.library.triton_op("hfq::nvfp4_linear", mutates_args=())
def nvfp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    if not on_gpu(x):
        return _linear_ref(x, packed, scale, global_scale, bias)
    if not _traced(x):
        return plan_linear(x, packed, scale, global_scale, bias).forward(x, bias)
    check_linear(x, packed, scale, global_scale, bias)
    if x.numel() <= g4.FEW_ROWS * x.shape[-1]:
        return torch.ops.hfq.nvfp4_linear_rows(x, packed, scale, global_scale, bias)
    return F.linear(x, dequantize_traced(packed, scale, global_scale, x.dtype), bias)


@torch.library.triton_op("hfq::nvfp4_linear_grad_input", mutates_args=())
def nvfp4_linear_grad_input(grad: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                            global_scale: torch.Tensor) -> torch.Tensor:
    if not on_gpu(grad):
        return grad @ fp4.nvfp4_dequantize(packed, scale, global_scale, grad.dtype)
    if not _traced(grad):
        return grad_input(grad, packed, scale, global_scale)
    check_packed(packed, scale, global_scale)
    check_grad_width(grad, packed.shape[0], "nvfp4_linear_grad_input")
    return grad @ dequantize_traced(packed, scale, global_scale, grad.dtype)


@torch.library.custom_op("hfq::nvfp4_linear_rows", mutates_args=())
def nvfp4_linear_rows(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """nvfp4_linear's few-row route (the plan's tuned kernel) as an opaque op inside a traced body (CUDA)."""
    return plan_linear(x, packed, scale, global_scale, bias).forward(x, bias)


@nvfp4_linear_rows.register_fake
def _(x, packed, scale, global_scale, bias=None):
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


def _setup(ctx, inputs, output):
    x, packed, scale, global_scale, bias = inputs
    ctx.save_for_backward(packed, scale, global_scale)
    ctx.has_bias = bias is not None


def _backward(ctx, grad):
    packed, scale, global_scale = ctx.saved_tensors
    gx = gb = None
    if ctx.needs_input_grad[0]:
        gx = torch.ops.hfq.nvfp4_linear_grad_input(grad, packed, scale, global_scale)
    if ctx.has_bias and ctx.needs_input_grad[4]:
        gb = grad.reshape(-1, grad.shape[-1]).sum(0)
    return gx, None, None, None, gb


nvfp4_linear.register_autograd(_backward, setup_context=_setup)


# ----------------------------------------------------------------------------------------------- g4 layout ops
@torch.library.custom_op("hfq::nvfp4_g4_dequantize", mutates_args=())
def nvfp4_g4_dequantize(words: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, n: int, k: int,
                        dtype: torch.dtype) -> torch.Tensor:
    g4.check_g4(words, scales, n, k)
    return g4.dequantize_g4_ref(words, scales, global_scale, n, k, dtype)


@nvfp4_g4_dequantize.register_kernel("cuda")
def _(words, scales, global_scale, n, k, dtype):
    g4.check_g4(words, scales, n, k)
    if on_gpu(words):
        return g4.dequantize_g4(words, scales, global_scale, n, k, dtype)
    return g4.dequantize_g4_ref(words, scales, global_scale, n, k, dtype)


@nvfp4_g4_dequantize.register_fake
def _(words, scales, global_scale, n, k, dtype):
    return words.new_empty((n, k), dtype=dtype)


# The g4 layout's linear and grad-input: triton_ops like the canonical ones above.
@torch.library.triton_op("hfq::nvfp4_g4_linear", mutates_args=())
def nvfp4_g4_linear(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, n: int,
                    k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    check_g4_call(x, words, scales, global_scale, bias, n, k)
    if not on_gpu(x):
        return F.linear(x, g4.dequantize_g4_ref(words, scales, global_scale, n, k, x.dtype), bias)
    if not _traced(x):
        return plan_linear_g4(x, words, scales, global_scale, bias, n, k).forward(x, bias)
    if g4.supported(x.reshape(-1, k)):
        return torch.ops.hfq.nvfp4_g4_linear_rows(x, words, scales, global_scale, n, k, bias)
    return F.linear(x, g4.dequantize_g4_traced(words, scales, global_scale, n, k, x.dtype), bias)


@torch.library.triton_op("hfq::nvfp4_g4_linear_grad_input", mutates_args=())
def nvfp4_g4_linear_grad_input(grad: torch.Tensor, words: torch.Tensor, scales: torch.Tensor,
                               global_scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    check_grad_width(grad, n, "nvfp4_g4_linear_grad_input")
    if not on_gpu(grad):
        return grad @ g4.dequantize_g4_ref(words, scales, global_scale, n, k, grad.dtype)
    if not _traced(grad):
        return grad_input_g4(grad, words, scales, global_scale, n, k)
    if fused_ok(grad.reshape(-1, n), k):
        return torch.ops.hfq.nvfp4_g4_grad_input_rows(grad, words, scales, global_scale, n, k)
    return grad @ g4.dequantize_g4_traced(words, scales, global_scale, n, k, grad.dtype)


@torch.library.custom_op("hfq::nvfp4_g4_linear_rows", mutates_args=())
def nvfp4_g4_linear_rows(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                         n: int, k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """nvfp4_g4_linear's few-row route (the Gluon kernel's plan) as an opaque op inside a traced body (CUDA)."""
    return plan_linear_g4(x, words, scales, global_scale, bias, n, k).forward(x, bias)


@nvfp4_g4_linear_rows.register_fake
def _(x, words, scales, global_scale, n, k, bias=None):
    return x.new_empty((*x.shape[:-1], n))


@torch.library.custom_op("hfq::nvfp4_g4_grad_input_rows", mutates_args=())
def nvfp4_g4_grad_input_rows(grad: torch.Tensor, words: torch.Tensor, scales: torch.Tensor,
                             global_scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """nvfp4_g4_linear_grad_input's few-row kernel (nvfp4_grad) as an opaque op inside a traced body (CUDA)."""
    return grad_input_g4(grad, words, scales, global_scale, n, k)


@nvfp4_g4_grad_input_rows.register_fake
def _(grad, words, scales, global_scale, n, k):
    return grad.new_empty((*grad.shape[:-1], k))


def _g4_setup(ctx, inputs, output):
    x, words, scales, global_scale, n, k, bias = inputs
    ctx.save_for_backward(words, scales, global_scale)
    ctx.nk = (n, k)
    ctx.has_bias = bias is not None


def _g4_backward(ctx, grad):
    words, scales, global_scale = ctx.saved_tensors
    gx = gb = None
    if ctx.needs_input_grad[0]:
        gx = torch.ops.hfq.nvfp4_g4_linear_grad_input(grad, words, scales, global_scale, *ctx.nk)
    if ctx.has_bias and ctx.needs_input_grad[6]:
        gb = grad.reshape(-1, grad.shape[-1]).sum(0)
    return gx, None, None, None, None, None, gb


nvfp4_g4_linear.register_autograd(_g4_backward, setup_context=_g4_setup)

__all__ = ["nvfp4_quantize", "nvfp4_dequantize", "nvfp4_linear", "nvfp4_linear_grad_input", "quantize",
           "dequantize", "grad_input", "plain_eager", "check_packed", "m_bucket", "Tuner", "LINEAR_TUNER", "KINDS",
           "LinearPlan", "plan_linear", "plan_apply", "plan_lora_apply", "KEPT_DENSE",
           "nvfp4_g4_dequantize", "nvfp4_g4_linear", "nvfp4_g4_linear_grad_input", "plan_linear_g4"]
