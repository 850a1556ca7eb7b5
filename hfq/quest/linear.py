"""QuESTLinear: a linear layer trained with QuEST (Alg. 1 forward, Alg. 2 backward), and its packed form.

QAT state: a master `weight` in the module's dtype. Forward (W{b}A{b}):
    x_h^ , M_x = proj(HT(x));  w_h^ , M_w = proj(HT(w));  y = x_h^ w_h^T (+ bias)
Backward: dL/dx = IHT(M_x * (dy w_h^)),  dL/dw = IHT(M_w * (dy^T x_h^))  (STE: masks all ones).
Weight-only: y = x IHT(w_h^)^T, dL/dw = IHT(M_w * HT(dL/dw_eff)).
Packed state (inference): `weight_codes` (uint8, b-bit codes packed along the input dim) and
`weight_scale` (fp32 per output row, the grid's `unit`), both in the Hadamard domain; the weight is
level * unit, computed with the same fp32 arithmetic as the QAT forward, so logits are identical.
"""
from __future__ import annotations

import warnings
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

import hfq_kernels.hadamard  # noqa: F401  registers hfq::hadamard
import hfq_kernels.quest as _qk  # registers hfq::quest_quantize / hfq::quest_masked_ht
from hfq_kernels._triton import on_device_of
from hfq_kernels.reference import gaussian
from hfq_kernels.reference.fp4 import check_finite

from .._base.checkpoint import unguard_weight
from .._base.surgery import apply_keeping_buffer_dtypes
from .config import QuESTConfig


# ----------------------------------------------------------------------------- weight range
_F32_MAX = torch.finfo(torch.float32).max


def check_weight(w: torch.Tensor, name: str = "weight") -> None:
    """Refuse a master weight QuEST cannot quantize (ValueError naming it): NaN/Inf, a row whose fp32 sum of squares
    (the RMS the kernels normalise by) overflows, or a nonzero row whose RMS is below the kernels' clamp (its
    levels would be clamp-sized, not its values')."""
    check_finite(w, name)
    wf = w.detach().float().reshape(-1, w.shape[-1])
    k = wf.shape[-1]
    amax = wf.abs().amax(-1)
    ss = (wf / amax.clamp_min(1e-38)[:, None]).square().sum(-1).double() * amax.double().square()  # no overflow
    big = ss >= _F32_MAX / 2
    if bool(big.any()):
        r = int(big.nonzero()[0])
        raise ValueError(f"{name}: row {r} (max |w| {float(amax[r]):.3g}) has a sum of squares past fp32's range, "
                         f"where QuEST's per-row RMS overflows to inf (NaN weights); for in_features={k} every row "
                         f"needs sum(w^2) < {_F32_MAX / 2:.3g}, e.g. max |w| < {(_F32_MAX / 2 / k) ** 0.5:.3g}")
    small = (amax > 0) & ((ss / k).sqrt() < _qk.EPS)
    if bool(small.any()):
        r = int(small.nonzero()[0])
        raise ValueError(f"{name}: row {r} has RMS {float((ss[r] / k).sqrt()):.3g}, below {_qk.EPS:g}, the smallest "
                         "RMS QuEST normalises by (rows this small would quantize to levels of that size, not to their "
                         "values); rescale the weight or keep the layer unquantized (modules_to_not_convert)")


# ----------------------------------------------------------------------------- code packing
def storage_bits(bits: int) -> int:
    """Bits per stored code: the next of 1, 2, 4, 8 (3 -> 4, 5..7 -> 8)."""
    return next(c for c in (1, 2, 4, 8) if c >= bits)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., K] -> uint8 [..., ceil(K*c/8)], c = storage_bits(bits); element i of a byte's
    group sits in bits [i*c, (i+1)*c) (low bits first), zero padded."""
    c = storage_bits(bits)
    per = 8 // c
    K = codes.shape[-1]
    pad = (-K) % per
    v = F.pad(codes.to(torch.int32), (0, pad)).reshape(*codes.shape[:-1], -1, per)
    sh = torch.arange(per, device=codes.device, dtype=torch.int32) * c
    return (v << sh).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, K: int) -> torch.Tensor:
    c = storage_bits(bits)
    per = 8 // c
    sh = torch.arange(per, device=packed.device, dtype=torch.int32) * c
    v = (packed.to(torch.int32)[..., None] >> sh) & ((1 << c) - 1)
    return v.reshape(*packed.shape[:-1], -1)[..., :K].to(torch.uint8)


# ----------------------------------------------------------------------------- autograd
class _Spec:
    """Static per-layer settings passed to the autograd functions."""

    __slots__ = ("wbits", "abits", "fp4", "block", "s_w", "s_a", "trust")

    def __init__(self, cfg: QuESTConfig, block: int):
        self.wbits, self.abits = cfg.weight_bits, cfg.activation_bits
        self.fp4 = cfg.grid == "fp4"
        self.block = block
        self.s_w = cfg.outer_trust(cfg.weight_bits)
        self.s_a = cfg.outer_trust(cfg.activation_bits) if cfg.activation_bits else 1.0
        self.trust = cfg.estimator == "trust"


# Eager CUDA calls go straight to the Triton launchers (the torch.library dispatch of a Python custom op
# costs tens of microseconds, and a step makes ~4 such calls per linear layer); under torch.compile, and
# on CPU, the registered ops are called.
EAGER_DIRECT = True


def _quantize(x, bits, fp4, s, block, out_dtype=None):
    if EAGER_DIRECT and x.is_cuda and not torch.compiler.is_compiling():
        return _qk.quest_quantize_triton(x, bits, fp4, s, block, out_dtype)
    return torch.ops.hfq.quest_quantize(x, bits, fp4, s, block, out_dtype)


def _masked_ht(g, mask, block):
    if EAGER_DIRECT and g.is_cuda and not torch.compiler.is_compiling():
        return _qk.quest_masked_ht_triton(g, mask, block)
    return torch.ops.hfq.quest_masked_ht(g, mask, block)


def quantize_weight_h(w: torch.Tensor, spec: _Spec, out_dtype: torch.dtype = torch.float32):
    """QuEST projection of the weight in the Hadamard domain: (w_h^ in out_dtype, mask, unit fp32).
    The master weight is read in its own dtype (a bf16 weight times +-1 is exact; the HT sums and the
    projection run in fp32 either way), so training (out_dtype = matmul dtype) and code export (fp32)
    see the same levels."""
    return _quantize(w.detach(), spec.wbits, spec.fp4, spec.s_w, spec.block, out_dtype)


def quantize_input(x2: torch.Tensor, spec: _Spec):
    """(x_h^, mask) of a 2-D activation."""
    xq, mx, _ = _quantize(x2.detach(), spec.abits, spec.fp4, spec.s_a, spec.block)
    return xq, mx


class _InputCache:
    """The last activation quantized, so that sibling layers fed the same tensor (q/k/v, gate/up) share
    one quantization: hit only for the same tensor object (held by weak reference), unchanged since
    (version counter), same dtype and same activation settings. Inference tensors (torch.inference_mode) have no
    version counter: never shared."""

    def __init__(self):
        self.ref, self.version, self.key, self.value = None, None, None, None

    def get(self, x: torch.Tensor, key):
        if (self.ref is not None and self.ref() is x and not x.is_inference() and self.version == x._version
                and self.key == key):
            return self.value
        return None

    def put(self, x: torch.Tensor, key, value):
        if x.is_inference():
            self.clear()
            return
        # dropped with x: the cache never keeps a quantized activation alive past its input's life
        self.ref, self.version, self.key, self.value = weakref.ref(x, self._drop), x._version, key, value

    def _drop(self, ref) -> None:
        if self.ref is ref:
            self.clear()

    def clear(self):
        self.ref, self.version, self.key, self.value = None, None, None, None


_INPUT_CACHE = _InputCache()


class QuESTMatmul(torch.autograd.Function):
    """y = proj(HT(x)) proj(HT(w))^T + b with trust-masked gradients (Alg. 1 / Alg. 2); x_h^ and its
    mask come in precomputed (quantize_input) so that layers sharing an input share them."""

    @staticmethod
    def forward(ctx, x2, xq, mx, w, bias, spec):
        wq, mw, _ = quantize_weight_h(w, spec, x2.dtype)
        y = xq @ wq.t()
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(xq, wq, mx if spec.trust else None, mw if spec.trust else None)
        ctx.spec, ctx.has_bias, ctx.w_dtype = spec, bias is not None, w.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        xq, wq, mx, mw = ctx.saved_tensors
        spec = ctx.spec
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _masked_ht((dy @ wq).contiguous(), mx, spec.block)
        if ctx.needs_input_grad[3]:
            dw = _masked_ht((dy.t() @ xq).contiguous(), mw, spec.block).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[4]:
            db = dy.sum(0)
        return dx, None, None, dw, db, None


class QuESTWeight(torch.autograd.Function):
    """Effective weight IHT(proj(HT(w))) for weight-only QAT, gradient IHT(M_w * HT(g))."""

    @staticmethod
    def forward(ctx, w, spec):
        wq32, mw, _ = quantize_weight_h(w, spec)
        ctx.save_for_backward(mw if spec.trust else None)
        ctx.spec = spec
        return weight_from_hadamard(wq32, spec.block).to(w.dtype)

    @staticmethod
    def backward(ctx, g):
        (mw,) = ctx.saved_tensors
        spec = ctx.spec
        gh = torch.ops.hfq.hadamard(g.contiguous(), spec.block) if spec.block else g
        return torch.ops.hfq.quest_masked_ht(gh.contiguous(), mw, spec.block).to(g.dtype), None


def weight_from_hadamard(wq32: torch.Tensor, block: int) -> torch.Tensor:
    return torch.ops.hfq.hadamard(wq32, block) if block else wq32


# ----------------------------------------------------------------------------- module
_LOW = (torch.bfloat16, torch.float16)


class WarnedOnce:
    """The layers of one conversion (one model) share one: the low-precision master warning is given once per
    model, by its load or its first training forward, whatever another model said."""
    warned = False


_UNOWNED = WarnedOnce()  # layers built by hand, outside a conversion: once per process


def warn_low_precision_master(dtype: torch.dtype, stacklevel: int = 2, owner: WarnedOnce | None = None) -> None:
    """Warn that QuEST master weights are bf16/fp16: QAT steps below half their ulp are lost. `owner`: warn only
    if its layers were not warned about yet (the training forward's check); None: warn (a load)."""
    if owner is not None:
        if owner.warned:
            return
        owner.warned = True
    low = str(dtype).removeprefix("torch.")
    warnings.warn(f"hfq_quest: the QuEST master weights are {low} (the model's dtype): for QAT load with "
                  "dtype=torch.float32 and keep them fp32 (Trainer's bf16=True then computes in bf16), since a "
                  f"{low} master weight loses every optimizer step below half its ulp (AdamW at lr 1e-4 leaves most "
                  "weights of a pretrained model unchanged); for inference this does not matter",
                  UserWarning, stacklevel=stacklevel + 1)


class QuESTLinear(nn.Module):
    """Drop-in nn.Linear trained with QuEST; `packed=True` builds the inference form (codes + scales).
    share_input_quantization: layers called on the very same input tensor (q/k/v, gate/up) quantize it
    once (outside torch.compile); the result is identical, it only saves the kernel and the memory."""

    full_tuning_method = "QuEST"  # trains its own quantized weight: no PEFT adapters (hfq._base.peft_guard)

    share_input_quantization = True

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 config: QuESTConfig | None = None, packed: bool = False, name: str = "linear",
                 device=None, dtype=None):
        super().__init__()
        self.config = config or QuESTConfig()
        self.in_features, self.out_features = in_features, out_features
        self.spec = _Spec(self.config, self.config.block_for(in_features, name))
        self.packed = packed
        if packed:
            nb = (in_features * storage_bits(self.config.weight_bits) + 7) // 8
            self.register_buffer("weight_codes", torch.zeros(out_features, nb, dtype=torch.uint8, device=device))
            self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
            self.weight = None
        else:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    @classmethod
    def from_linear(cls, lin: nn.Linear, config: QuESTConfig, name: str = "linear") -> "QuESTLinear":
        """Wrap an existing nn.Linear, reusing its parameters (master weights stay as they are); a weight
        check_weight refuses raises naming `name`."""
        if lin.weight.device.type != "meta":
            check_weight(lin.weight, f"{name}.weight")
        m = cls(lin.in_features, lin.out_features, lin.bias is not None, config, name=name, device="meta")
        m.weight = lin.weight
        m.bias = lin.bias
        return m

    def _apply(self, fn, recurse=True):  # a packed layer's codes and fp32 row scales: moved, never cast
        return apply_keeping_buffer_dtypes(self, super()._apply, fn, recurse)

    def extra_repr(self) -> str:
        c = self.config
        a = f"A{c.activation_bits}" if c.activation_bits else "A16"
        return (f"in_features={self.in_features}, out_features={self.out_features}, W{c.weight_bits}{a}, "
                f"grid={c.grid}, ht_block={self.spec.block}, estimator={c.estimator}, packed={self.packed}")

    # -- weights in the Hadamard domain
    def quantized_weight_h(self, weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_h^ fp32 [out, in], unit fp32 [out]): dequantized from codes when packed, else `weight` (default: the
        master weight) projected."""
        if self.packed:
            codes = unpack_codes(self.weight_codes, self.config.weight_bits, self.in_features)
            level = gaussian.codes_to_levels(codes, self.config.weight_bits, self.config.grid)
            return level * self.weight_scale[:, None], self.weight_scale
        weight = self.weight if weight is None else weight
        check_weight(weight, "weight")
        wq32, _, unit = quantize_weight_h(weight, self.spec)
        return wq32, unit

    def export_codes(self, weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight_codes uint8 packed, weight_scale fp32) of `weight` (default: the current master weight)."""
        if self.packed:
            return self.weight_codes, self.weight_scale
        with torch.no_grad():
            wq32, unit = self.quantized_weight_h(weight)
            level = wq32 / unit[:, None]  # exact up to an ulp; levels_to_codes rounds to the grid
            codes = gaussian.levels_to_codes(level, self.config.weight_bits, self.config.grid)
        return pack_codes(codes, self.config.weight_bits), unit.contiguous()

    @on_device_of(lambda self, x: x)  # a layer on a GPU that is not the current one (device_map over several)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if shape[-1] != self.in_features:
            raise ValueError(f"QuESTLinear: input last dim {shape[-1]} != in_features {self.in_features}")
        spec = self.spec
        if self.packed:
            if self.training and torch.is_grad_enabled():
                raise ValueError(
                    "QuESTLinear: this layer was loaded from a save_format='codes' checkpoint (packed codes, no master "
                    "weights): it is inference-only, and a training forward would train none of it (no gradient "
                    "reaches its codes, bias or input through the activation quantizer). Continue QAT from a "
                    "save_format='master' checkpoint; for inference call model.eval() or run under torch.no_grad()")
            return self._forward_packed(x)
        if self.training and self.weight.dtype in _LOW and self.weight.requires_grad and torch.is_grad_enabled():
            # e.g. model.to(torch.bfloat16) after load
            warn_low_precision_master(self.weight.dtype, stacklevel=3, owner=self.__dict__.get("_hfq_owner", _UNOWNED))
        dev = x.device.type
        # under autocast the matmuls run in the autocast dtype; the weight is still quantized in fp32
        cdt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else self.weight.dtype
        if spec.abits is None:
            w_eff = QuESTWeight.apply(self.weight, spec)
            return F.linear(x.to(cdt), w_eff.to(cdt), None if self.bias is None else self.bias.to(cdt))
        x2 = x.reshape(-1, shape[-1]).to(cdt).contiguous()
        with torch.autocast(dev, enabled=False):
            xqm = None
            share = self.share_input_quantization and not torch.compiler.is_compiling()
            if share:
                key = (cdt, spec.abits, spec.fp4, spec.s_a, spec.block, spec.trust)
                xqm = _INPUT_CACHE.get(x, key)
            if xqm is None:
                xqm = quantize_input(x2, spec)
                if share:
                    _INPUT_CACHE.put(x, key, xqm)
            y = QuESTMatmul.apply(x2, *xqm, self.weight, self.bias, spec)
        return y.reshape(*shape[:-1], self.out_features)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """Reads the guarded [1, out, in] master weight of an hfq checkpoint; refuses a codes-only checkpoint
        in a QAT layer (its master weights are gone, so training could not resume from it)."""
        key = prefix + "weight"
        if not self.packed and key not in state_dict and prefix + "weight_codes" in state_dict:
            raise ValueError(f"{prefix}weight_codes: this checkpoint holds QuEST codes only "
                             "(save_format='codes', an inference checkpoint) and no master weights, so a QAT model "
                             "cannot load it (Trainer's resume_from_checkpoint and load_best_model_at_end both do); "
                             "train with QuESTConfig(save_format='master') and save codes at the end")
        if not self.packed and key in state_dict:
            w = unguard_weight(state_dict[key], self.out_features, self.in_features)
            state_dict = dict(state_dict)
            if w is None:
                del state_dict[key]
            else:
                state_dict[key] = w
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    @torch.no_grad()
    def _forward_packed(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        wq32, _ = self.quantized_weight_h()
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if spec.abits is None:
            return F.linear(x, weight_from_hadamard(wq32, spec.block).to(x.dtype), bias)
        shape = x.shape
        xq, _, _ = torch.ops.hfq.quest_quantize(x.reshape(-1, shape[-1]).contiguous(), spec.abits, spec.fp4,
                                                spec.s_a, spec.block)
        y = xq @ wq32.to(x.dtype).t()
        if bias is not None:
            y = y + bias
        return y.reshape(*shape[:-1], self.out_features)


# ----------------------------------------------------------------------------- model surgery
def layer_maker(config: QuESTConfig, packed: bool = False, reuse: bool = False):
    """The surgery's builder: a QuESTLinear for an nn.Linear. reuse=True keeps the existing parameters (QAT of
    an instantiated model; a weight check_weight refuses raises naming it); otherwise the layer is built on the
    linear's device (meta while from_pretrained loads). A width the HT cannot cover raises naming the layer."""

    owner = WarnedOnce()  # this conversion's layers: one model

    def make(name: str, lin: nn.Linear) -> QuESTLinear:
        if reuse:
            config.block_for(lin.in_features, name)
            m = QuESTLinear.from_linear(lin, config, name)
        else:
            m = QuESTLinear(lin.in_features, lin.out_features, lin.bias is not None, config, packed=packed,
                            name=name, device=lin.weight.device, dtype=lin.weight.dtype)
        m._hfq_owner = owner
        return m

    return make
