"""`NVFP4Linear`: a frozen FP4 linear layer holding compressed-tensors' buffers; the input gets a gradient."""
from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import hfq_kernels.nvfp4 as _K  # registers torch.ops.hfq.*
import hfq_kernels.nvfp4_calib  # noqa: F401  (torch.ops.hfq.nvfp4_quantize_search)
from hfq_kernels import nvfp4_gluon as _G4
from hfq_kernels.lora_nvfp4 import G4Operands
from hfq_kernels._triton import on_device_of
from hfq_kernels.reference import fp4

from hfq._settings import SETTINGS

from .._base.surgery import apply_keeping_buffer_dtypes

_BLOCK = {"nvfp4": fp4.NVFP4_BLOCK, "mxfp4": fp4.MXFP4_BLOCK}
_MAX_PLANS = 64  # per layer: distinct input shapes whose launch plans are kept
_CANON = ("weight_packed", "weight_scale")
_G4_BUFS = ("weight_g4", "weight_g4_scale")
_CODES_LEFT_OUT = contextvars.ContextVar("hfq_nvfp4_codes_left_out", default=False)
_WARNED_G4_OFFLOAD: list = []


@contextlib.contextmanager
def codes_left_out():
    """state_dict() without NVFP4 codes and block scales (global scales and biases stay): for adapter saves, which
    keep none of them, so that a g4 base is not converted back and copied to host memory for every save."""
    token = _CODES_LEFT_OUT.set(True)
    try:
        yield
    finally:
        _CODES_LEFT_OUT.reset(token)


class NVFP4Linear(nn.Module):
    """y = x @ dequant(W)^T + b with W stored as E2M1 codes + block scales (+ global scale for NVFP4).

    Buffers (the on-disk names of compressed-tensors' nvfp4-pack-quantized): weight_packed u8 [out, in/2],
    weight_scale e4m3 [out, in/16] (MXFP4: biased E8M0 u8 [out, in/32]), weight_global_scale f32 [1]
    (the reciprocal 448*6/amax; NVFP4 only). The base weight is frozen: training goes through LoRA.
    `weight_dtype` is the dtype the weight has in the model (what `weight`, a merge or a dense rebuild give);
    it follows model casts such as `.to(torch.bfloat16)` while the codes and scales stay as they are.

    Layout: on a GPU where the Gluon decode kernel runs (`hfq_kernels.nvfp4_gluon.device_ok`) an NVFP4 layer keeps
    its codes and scales only in that kernel's "g4" layout (buffers `weight_g4` int32, `weight_g4_scale` u8, not
    persistent): decode, prefill, training forward and grad-input all read it, so there is one copy of the weight
    on the device. It is entered after loading, on a move to such a GPU, or at the first forward there; moving
    elsewhere returns to the canonical buffers. state_dict / save_pretrained always hold the canonical
    compressed-tensors tensors (converted back bit-exactly without leaving g4, as host-memory copies).
    Reading `weight_packed` / `weight_scale` returns the real canonical buffers (the layer converts back, so
    in-place writes are seen) and the next forward converts again; hold no reference to them across a forward.
    `allow_g4=False` keeps the canonical buffers, and the decode kernel then caches its own copy beside them (the
    default is hfq settings' nvfp4_g4: HFQ_NVFP4_G4, docs/settings.md).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, format: str = "nvfp4",
                 compute_dtype: torch.dtype | None = None, device=None, dtype=None):
        super().__init__()
        if format not in _BLOCK:
            raise ValueError(f"format: {format!r} is not supported; allowed {tuple(_BLOCK)}")
        blk = _BLOCK[format]
        if in_features % blk:
            raise ValueError(f"in_features={in_features} is not a multiple of the {format} block size {blk}")
        self.in_features, self.out_features = in_features, out_features
        self.format, self.compute_dtype = format, compute_dtype
        self.allow_g4 = SETTINGS.nvfp4_g4  # switch to the g4 layout where the Gluon kernel runs (see the class doc)
        self.scale_rule = "amax"  # how set_weight picks NVFP4 scales (NVFP4Config.scales)
        self.weight_dtype = dtype or torch.get_default_dtype()
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        sdt = torch.float8_e4m3fn if format == "nvfp4" else torch.uint8
        self.register_buffer("weight_scale", torch.zeros(out_features, in_features // blk, dtype=sdt, device=device))
        if format == "nvfp4":
            self.register_buffer("weight_global_scale", torch.ones(1, dtype=torch.float32, device=device))
        else:
            self.weight_global_scale = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=self.weight_dtype, device=device),
                                     requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, format: str = "nvfp4", compute_dtype=None, name: str = "weight"):
        """Quantize an nn.Linear (its weight is not kept)."""
        w = linear.weight.detach()
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, format, compute_dtype,
                  device=w.device, dtype=w.dtype)
        mod.set_weight(w, name=name)
        if linear.bias is not None:
            mod.bias.data.copy_(linear.bias.detach())
        return mod

    @torch.no_grad()
    @on_device_of(lambda self, w, *a, **k: w)
    def set_weight(self, w: torch.Tensor, name: str = "weight", canonical: bool = False) -> None:
        """Quantize `w` [out, in] into this layer's buffers (NaN/Inf refused, naming `name`); `canonical` keeps
        compressed-tensors' layout for a caller that reads the buffers out (a later forward converts as usual)."""
        if tuple(w.shape) != (self.out_features, self.in_features):
            raise ValueError(f"{name}: expected shape {(self.out_features, self.in_features)}, got {tuple(w.shape)}")
        fp4.check_finite(w, name)
        if self.format == "nvfp4":
            fp4.check_nvfp4_amax(w, name)
            op = torch.ops.hfq.nvfp4_quantize_search if self.scale_rule == "mse" else torch.ops.hfq.nvfp4_quantize
            packed, scale, gs = op(w)
            dev = self.qweight.device
            self.weight_global_scale = gs.to(dev) if dev.type != "meta" else gs
        else:
            packed, scale = fp4.mxfp4_quantize(w, name=name)
        was_g4 = self.layout == "g4"
        self._drop(_G4_BUFS)  # also drops the plans
        self.register_buffer("weight_packed", packed)
        self.register_buffer("weight_scale", scale)
        if not canonical and (was_g4 or self.g4_wanted(packed.device)):  # e.g. from_linear on the GPU
            self.to_g4_layout_()

    # ----------------------------------------------------------------------------------------- layouts
    @property
    def layout(self) -> str:
        """"g4" (the Gluon kernel's layout, on GPUs that run it) or "canonical" (compressed-tensors' buffers)."""
        return "g4" if "weight_g4" in self._buffers else "canonical"

    def g4_wanted(self, device: torch.device) -> bool:
        """Whether this layer keeps the g4 layout on `device` (NVFP4, allow_g4, the Gluon kernel runs there, no
        accelerate offload hook: it moves the canonical buffers it recorded by name, for each forward and when it is
        removed)."""
        return (self.format == "nvfp4" and self.allow_g4 and _G4.device_ok(device)
                and self._offload_hook() is None)

    def __getstate__(self):
        """Pickling and copy.deepcopy leave the kept plans behind: they are per-process caches of closures over this
        layer's tensors (not picklable; a copy would reach the original's), rebuilt on the next call."""
        state = self.__dict__.copy()
        state.pop("_hfq_plans", None)
        return state

    def _drop(self, names) -> None:
        for nm in names:
            self._buffers.pop(nm, None)
            self._non_persistent_buffers_set.discard(nm)  # a stale name here breaks accelerate's dispatch
        self.__dict__.pop("_hfq_plans", None)

    @torch.no_grad()
    @on_device_of(lambda self: self._buffers.get("weight_packed"))
    def to_g4_layout_(self) -> "NVFP4Linear":
        """Keep codes and scales in the g4 layout only (NVFP4 on a real device; a no-op otherwise). Works on any
        device (CPU tests use the torch reference on it); NVFP4Linear calls it itself where the kernel runs."""
        p = self._buffers.get("weight_packed")
        if self.format != "nvfp4" or p is None or p.device.type == "meta":
            return self
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return self  # no conversion (it syncs) inside a CUDA graph capture
        wr, sr = _G4.repack(p, self._buffers["weight_scale"])
        _G4.check_dequant(wr.device)  # for the compiled route's dequantize (once per device)
        self._drop(_CANON)
        self.register_buffer("weight_g4", wr, persistent=False)
        self.register_buffer("weight_g4_scale", sr, persistent=False)
        return self

    @torch.no_grad()
    def to_canonical_layout_(self) -> "NVFP4Linear":
        """Back to the canonical compressed-tensors buffers (bit-exact inverse of to_g4_layout_)."""
        if self.layout != "g4":
            return self
        packed, scale = self.canonical()
        self._drop(_G4_BUFS)
        self.register_buffer("weight_packed", packed)
        self.register_buffer("weight_scale", scale)
        return self

    def canonical(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight_packed, weight_scale) in the canonical layout, whatever this layer holds (a copy in g4)."""
        b = self._buffers
        if "weight_g4" in b:
            return _G4.unrepack(b["weight_g4"], b["weight_g4_scale"], self.out_features, self.in_features)
        return b["weight_packed"], b["weight_scale"]

    def __getattr__(self, name):
        if name in _CANON and "weight_g4" in self.__dict__.get("_buffers", {}):
            # the caller gets the real buffer (in-place writes land), so the layer goes back to canonical; a
            # layer that wants g4 returns to it at its next forward
            self.to_canonical_layout_()
        return super().__getattr__(name)

    def __setattr__(self, name, value):
        if name in _CANON and "weight_g4" in self.__dict__.get("_buffers", {}):
            self.to_canonical_layout_()  # an assigned canonical tensor replaces the g4 one (no stale copy)
        super().__setattr__(name, value)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if _CODES_LEFT_OUT.get():
            for name in _CANON:
                destination.pop(prefix + name, None)
        elif self.layout == "g4":
            # converted one layer at a time and kept in host memory: a state_dict() of the whole model (PEFT
            # calls it for every adapter save) must not put a second copy of the base model on the GPU
            packed, scale = self.canonical()
            destination[prefix + "weight_packed"] = packed.cpu()
            destination[prefix + "weight_scale"] = scale.cpu()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        g4 = self.layout == "g4"
        if g4 and not any(prefix + n in state_dict for n in _CANON):
            # no codes here (an adapter load: PEFT's set_peft_model_state_dict): the g4 codes stay as they are, with
            # no round trip through canonical (which made new tensors: plans and rollout graphs rebuilt); they are
            # reported missing as a canonical layer's would be
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)
            missing_keys.extend(prefix + n for n in _CANON)
            return
        dev = self.qweight.device
        if g4:
            self.to_canonical_layout_()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self.__dict__.pop("_hfq_plans", None)
        # load_state_dict(assign=True) puts the loaded tensors themselves here, possibly on another device: the
        # layer follows them (as nn.Linear does) and keeps g4 where it had it or where the kernel runs. A g4 layer's
        # own state_dict() holds host copies of the codes beside its device global scale: those follow the scale.
        if g4:
            new_dev = self.qweight.device
            if new_dev.type == "cpu" and self.weight_global_scale.device == dev != new_dev:
                self.weight_packed, self.weight_scale = self.weight_packed.to(dev), self.weight_scale.to(dev)
                new_dev = dev
            if new_dev == dev or self.g4_wanted(new_dev):
                self.to_g4_layout_()

    @on_device_of(lambda self, *a, **k: self._buffers.get("weight_g4", self._buffers.get("weight_packed")))
    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The weight as a dense [out, in] tensor."""
        b = self._buffers
        if "weight_g4" in b:
            return torch.ops.hfq.nvfp4_g4_dequantize(b["weight_g4"], b["weight_g4_scale"], self.weight_global_scale,
                                                     self.out_features, self.in_features, dtype)
        if self.format == "nvfp4":
            return torch.ops.hfq.nvfp4_dequantize(self.weight_packed, self.weight_scale, self.weight_global_scale, dtype)
        return fp4.mxfp4_dequantize(self.weight_packed, self.weight_scale, dtype)

    @on_device_of(lambda self, x: x)  # a layer on a GPU that is not the current one (device_map over several)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Plain eager NVFP4 calls run this layer's kept plan (_plan: hfq::nvfp4_linear's values and gradients);
        torch.compile, fake/subclass tensors, dispatch modes, functorch and CPU go through the registered op, whose
        CUDA kernel makes the same plan per call; MXFP4 dequantizes for F.linear."""
        if self.format == "nvfp4" and _K.plain_eager(x):
            plan, x2, b, in_dtype = self._plan(x)
            y = _K.plan_apply(plan, x2, b)
            return y if y.dtype == in_dtype else y.to(in_dtype)
        in_dtype = x.dtype
        if self.compute_dtype is not None:
            x = x.to(self.compute_dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        bufs = self._buffers
        if "weight_g4" in bufs:
            y = torch.ops.hfq.nvfp4_g4_linear(x, bufs["weight_g4"], bufs["weight_g4_scale"], self.weight_global_scale,
                                              self.out_features, self.in_features, bias)
        elif self.format == "nvfp4":
            y = torch.ops.hfq.nvfp4_linear(x, self.weight_packed, self.weight_scale, self.weight_global_scale, bias)
        else:
            y = F.linear(x, self.dequantize(x.dtype), bias)
        return y.to(in_dtype)

    @on_device_of(lambda self, x, *a, **k: x)
    def forward_lora(self, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float,
                     dropout=None) -> torch.Tensor | None:
        """forward(x) + scale * (dropout(x) lora_a^T) lora_b^T in three products (NVFP4LoraLinear's short route).
        None, with nothing computed, where this layer cannot take it: not a plain eager NVFP4 call, a compute-dtype
        cast, or adapter weights of another dtype than x outside an autocast region to x's dtype (inside one, the
        products run in x's dtype, as PEFT's do there)."""
        dev = x.device.type
        same = (torch.get_autocast_dtype(dev) == x.dtype if torch.is_autocast_enabled(dev)
                else lora_a.dtype == x.dtype and lora_b.dtype == x.dtype)
        if not (same and self.format == "nvfp4" and _K.plain_eager(x) and self.compute_dtype in (None, x.dtype)):
            return None
        plan, x, b, _ = self._plan(x)
        return _K.plan_lora_apply(plan, x, b, x if dropout is None else dropout(x), lora_a, lora_b, scale)

    def _plan(self, x: torch.Tensor):
        """(plan, x in the compute dtype, bias in x's dtype, x's dtype): the LinearPlan of hfq::nvfp4_linear kept
        per (x shape, dtype, device), so that a repeated call does no validation, config lookup or launch planning
        (hfq_kernels.nvfp4_plan). Plans are dropped when a weight tensor is replaced (set_weight, load, a move: see
        _apply) and rebuilt when the tuned table changes; a new shape is validated (and raises for bad input) when
        its plan is made."""
        if "weight_packed" in self._buffers and self.g4_wanted(x.device):
            self.to_g4_layout_()  # e.g. a layer built on the GPU directly (no load, no move)
        elif ("_hf_hook" in self.__dict__ and "weight_g4" in self._buffers and not _WARNED_G4_OFFLOAD
              and self._offload_hook() is not None):
            _WARNED_G4_OFFLOAD.append(True)
            warnings.warn("an NVFP4 layer in the g4 layout (the GPU kernel's) is under an accelerate offload hook "
                          "attached after loading (cpu_offload, disk_offload, dispatch_model): accelerate does not "
                          "offload its non-persistent buffers, so the codes stay on the GPU and the offload saves "
                          "nothing for NVFP4 layers. Offload while loading instead: from_pretrained(..., "
                          "device_map=..., offload_buffers=True)", stacklevel=3)
        in_dtype = x.dtype
        cdt = self.compute_dtype
        if cdt is not None and cdt != in_dtype:
            x = x.to(cdt)
        bufs = self._buffers
        g4 = "weight_g4" in bufs
        p, s = (bufs["weight_g4"], bufs["weight_g4_scale"]) if g4 else (bufs["weight_packed"], bufs["weight_scale"])
        g = bufs["weight_global_scale"]
        b = self._parameters["bias"]
        tok = (id(p), id(s), id(g), id(b), p.data_ptr(), s.data_ptr(), g.data_ptr(), p.shape, s.shape)
        st = self.__dict__.get("_hfq_plans")
        if st is None or st[0] != tok:
            st = self.__dict__["_hfq_plans"] = (tok, {})
        plans = st[1]
        key = (x.shape, x.dtype, x.device)
        plan = plans.get(key)
        if plan is None or plan.gen != _K.LINEAR_TUNER.gen:
            if g4:
                plan = _K.plan_linear_g4(x, p, s, g, b, self.out_features, self.in_features)
            else:
                plan = _K.plan_linear(x, p, s, g, b)
            if plan.final and not self._offloaded():
                if len(plans) >= _MAX_PLANS:  # e.g. many sequence lengths: start over rather than grow
                    plans.clear()
                plans[key] = plan
        if b is not None and b.dtype != x.dtype:
            b = b.to(x.dtype)
        return plan, x, b, in_dtype

    def _offload_hook(self):
        """accelerate's AlignDevicesHook that offloads this layer (dispatch with 'cpu'/'disk' in the device_map), or
        None. It records the layer's tensor names when attached and moves them by name, so the layer keeps its
        layout (canonical) under it."""
        hook = self.__dict__.get("_hf_hook")
        for h in (getattr(hook, "hooks", None) or (hook,)) if hook is not None else ():
            if getattr(h, "offload", False):
                return h
        return None

    def _offloaded(self) -> bool:
        """Whether accelerate offloads this layer's codes (its offload hook has offload_buffers): they come in for
        each forward and leave after it, so a kept plan would hold them (and is never reused). Without
        offload_buffers accelerate keeps buffers on the execution device."""
        return getattr(self._offload_hook(), "offload_buffers", False)

    def decode_operands(self, x2: torch.Tensor) -> G4Operands | None:
        """This layer's weight as the fused decode kernels read it (hfq_kernels.lora_nvfp4: grouped q/k/v and
        gate/up launches, LoRA with the reduce folded in), for input x2 [M, in_features]; None where they cannot
        stand in for forward(x2): not NVFP4 in the g4 layout, a compute-dtype cast, or another width. The rollout
        decoder asks every linear (without importing this class); hooks and autograd are its own checks."""
        bufs = self._buffers
        if ("weight_g4" not in bufs or self.compute_dtype not in (None, x2.dtype)
                or x2.shape[-1] != self.in_features):
            return None
        return G4Operands(bufs["weight_g4"], bufs["weight_g4_scale"], bufs["weight_global_scale"],
                          self._parameters["bias"], self.out_features)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (read-only, computed on access). While loading, the loader's placeholder."""
        if "weight" in self._parameters:
            return self._parameters["weight"]
        return self.dequantize(self.weight_dtype)

    @property
    def qweight(self) -> torch.Tensor:
        """The resident codes (canonical packed bytes or g4 words), under PEFT's name for a quantized layer's
        storage: PEFT reads its device from here instead of dequantizing `weight` several times per wrapped layer."""
        b = self._buffers
        return b["weight_g4"] if "weight_g4" in b else b["weight_packed"]

    def _apply(self, fn, recurse=True):
        # Moves follow `fn`; dtype casts (model.half(), .to(bfloat16)) must not touch codes and scales.
        dev0 = self.qweight.device
        self.__dict__.pop("_hfq_plans", None)  # plans hold the old tensors: a move must not keep a second copy
        self.weight_dtype = fn(torch.empty(0, dtype=self.weight_dtype)).dtype
        apply_keeping_buffer_dtypes(self, super()._apply, fn, recurse)
        dev = self.qweight.device
        if dev == dev0:  # a dtype cast: the layout stays
            return self
        if self.layout == "g4" and dev.type != "meta" and not self.g4_wanted(dev):
            self.to_canonical_layout_()
        elif self.layout == "canonical" and self.g4_wanted(dev):
            self.to_g4_layout_()
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"format={self.format}")


_CODE_BUFFERS = ("weight_packed", "weight_scale", "weight_global_scale", "weight_g4", "weight_g4_scale")


def marking_codes_for_ddp(init):
    """DistributedDataParallel.__init__ that first runs mark_ddp_ignore on the module it wraps when that holds NVFP4
    layers, so the names are relative to what DDP sees whatever wrapped the layers after loading (PEFT's
    get_peft_model / add_adapter move them under `base_layer`; installed by `import hfq`)."""
    @functools.wraps(init)
    def wrapped(self, module, *args, **kwargs):
        if isinstance(module, nn.Module) and any(isinstance(m, NVFP4Linear) for m in module.modules()):
            mark_ddp_ignore(module)
        init(self, module, *args, **kwargs)

    wrapped.hfq_wrapped = True
    return wrapped


def canonical_before_set(set_tensor):
    """accelerate's set_module_tensor_to_device (load_checkpoint_in_model, load_checkpoint_and_dispatch with a
    device_map) finds a tensor by name in the module's _parameters / _buffers: an NVFP4 layer in the g4 layout, asked
    for a canonical name, returns to the canonical layout first, as attribute access makes it (it goes back to g4 at
    its next forward on a device that runs the kernel). Installed by `import hfq`."""
    @functools.wraps(set_tensor)
    def wrapped(module, tensor_name, *args, **kwargs):
        owner, name = module, tensor_name
        if isinstance(tensor_name, str) and "." in tensor_name:
            path, name = tensor_name.rsplit(".", 1)
            try:
                owner = module.get_submodule(path)
            except AttributeError:
                owner = None  # accelerate reports the bad name itself
        if isinstance(owner, NVFP4Linear) and name in _CANON and "weight_g4" in owner._buffers:
            owner.to_canonical_layout_()
        return set_tensor(module, tensor_name, *args, **kwargs)

    wrapped.hfq_wrapped = True
    return wrapped


def mark_ddp_ignore(model: nn.Module) -> list[str]:
    """Tell DistributedDataParallel to leave the frozen NVFP4 codes/scales alone.

    By default DDP broadcasts every buffer at construction and before every forward: for NVFP4 codes that is the
    whole base model each step, and gloo cannot broadcast float8 scales at all. Every rank loads the same
    checkpoint, so the codes need no sync. Uses DDP's `_ddp_params_and_buffers_to_ignore` (names relative to
    the module handed to DDP, which runs this itself after `import hfq`: marking_codes_for_ddp). Returns the names
    added."""
    names = [f"{mn}.{b}" if mn else b for mn, m in model.named_modules() if isinstance(m, NVFP4Linear)
             for b in _CODE_BUFFERS if b in m._buffers or m.format == "nvfp4"]  # both layouts: it may change
    prev = list(model.__dict__.get("_ddp_params_and_buffers_to_ignore", []))
    object.__setattr__(model, "_ddp_params_and_buffers_to_ignore", sorted(set(prev) | set(names)))
    return names
