"""QLion's step applied during backward: each parameter is updated as soon as its gradient exists, so no gradient
store (INT8 or float) ever holds more than one parameter's gradient. The QFT stack taken to its end.

  model = AutoModelForCausalLM.from_pretrained(path, quantization_config=QFTConfig(gradient_bits=8))
  opt = QLion(model.parameters(), lr=1e-5)
  handle = step_in_backward_(model, opt)
  for batch in data:
      model(**batch).loss.backward()   # every parameter is updated here
      opt.step()                        # no-op for the parameters updated in that backward; ends the iteration
      opt.zero_grad()
  handle.remove()                       # back to backward + opt.step()

With transformers' Trainer: `callbacks=[StepInBackward()]` (installs it at train begin, removes it at train end).

Semantics:
- INT8-gradient QFT weights (QFTConfig(gradient_bits=8)): `_QLinearFn.backward` hands the float dL/dW (averaged over
  ranks when distributed) to the weight's `grad_consumer`, which passes it through the same INT8 quantizer as the
  store (`quantize_grad=True`, default: the update is bit-identical to backward + step() with rounding="rtn") and
  calls `QLion.update_param_`. Every other trainable parameter (embeddings, norms, biases, lm_head, QParams with
  bf16 gradients) is stepped from `register_post_accumulate_grad_hook` and its `.grad` set to None.
- optimizer.step() after the backward updates nothing already updated (their gradients are gone) and marks the end
  of the iteration. A second gradient for a parameter before that step (gradient accumulation, two backwards, or a
  weight used twice in one forward) raises RuntimeError: only gradient_accumulation_steps=1 works in this mode. The
  check fires at the first parameter of the second backward, before it changes anything.
- NaN/Inf (when the optimizer's check_finite, default): each gradient is checked right before its own parameter's
  update, one host sync per parameter; a non-finite one raises ValueError naming the parameter and leaves it (and
  every parameter whose gradient comes later) untouched, while the parameters updated earlier in this backward KEEP
  their update (the message says how many). A whole-step refusal, as step() gives, is impossible without storing
  every gradient. check_finite=False skips the checks (and the syncs).
- Gradient clipping cannot work: the global norm is known only when the backward ends, after every update. The
  Trainer callback refuses max_grad_norm > 0; in your own loop, do not call clip_grad_norm_ (it sees no gradients
  and returns 0).
- Single process only (DDP's reducer never sees the plain parameters' gradients before the hook steps them):
  refused when torch.distributed runs with more than one rank.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import TrainerCallback

from ..qparam import Int8Grad, QParam, int8_grad

_KEY = "_hfq_step_in_backward"


class StepInBackwardHandle:
    """What step_in_backward_ returns: `remove()` restores backward + optimizer.step(); `updated` counts the parameter
    updates made during backwards so far; `stepped_this_iteration` the parameters updated since the last step()."""

    def __init__(self, model: nn.Module, optimizer, quantize_grad: bool):
        self.optimizer = optimizer
        self.quantize_grad = quantize_grad
        self.updated = 0
        self._stepped: set[int] = set()
        self._hooks = []
        self._consumers = []
        self._removed = False
        self._names = {}
        for n, p in model.named_parameters(remove_duplicate=True):
            self._names.setdefault(id(p), n)
        self._where = {}  # positions, not the group dicts: optimizer.load_state_dict replaces those
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                self._where[id(p)] = (gi, pi)
                names = group.get("param_names")
                if names:
                    self._names[id(p)] = names[pi]
                else:
                    self._names.setdefault(id(p), f"param_groups[{gi}]['params'][{pi}] {tuple(p.shape)}")

    @property
    def stepped_this_iteration(self) -> int:
        return len(self._stepped)

    def _update(self, p: torch.Tensor, g: torch.Tensor, from_int8_path: bool) -> None:
        opt, name = self.optimizer, self._names[id(p)]
        if id(p) in self._stepped:
            raise RuntimeError(
                f"step_in_backward_: a second gradient for {name} arrived before optimizer.step(). The step is applied "
                "during backward, so gradient accumulation (gradient_accumulation_steps > 1), a second backward "
                "without optimizer.step() in between, and a weight used twice in one forward are not supported; "
                "call optimizer.step() after each backward, or handle.remove() to go back to stored gradients")
        if opt.check_finite and not bool(torch.isfinite(g).all()):
            done = len(self._stepped)
            self._stepped.clear()  # the backward is aborted: the next one starts a new iteration
            raise ValueError(
                f"non-finite gradient (NaN/Inf) in {name}: its update was refused and the backward stopped; "
                f"{done} parameter(s) updated earlier in this backward keep their update (step in backward cannot "
                "refuse a whole step)")
        with torch.no_grad():
            if from_int8_path and self.quantize_grad:
                g32 = Int8Grad(g, name, p.dtype)  # the INT8 store's round trip (the fused step reads its codes)
            else:
                g32 = g if g.dtype == torch.float32 else g.float()
            opt.update_param_(p, g32, self._group_of(p, name))
        self._stepped.add(id(p))
        self.updated += 1

    def _group_of(self, p: torch.Tensor, name: str) -> dict:
        """p's current param group (its settings as the LR scheduler or a loaded state left them)."""
        gi, pi = self._where[id(p)]
        groups = self.optimizer.param_groups
        if gi >= len(groups) or pi >= len(groups[gi]["params"]) or groups[gi]["params"][pi] is not p:
            raise RuntimeError(f"step_in_backward_: {name} is no longer where it was in optimizer.param_groups "
                               "when the hooks were installed; call handle.remove() and step_in_backward_ again "
                               "after changing the groups")
        return groups[gi]

    def _consume(self, p, g, name=None):  # QParam.grad_consumer: the float dL/dW from _QLinearFn.backward
        self._update(p, g, True)

    def _post_accumulate(self, p):  # register_post_accumulate_grad_hook: p.grad is complete
        g = p.grad
        if g is None:
            return
        if isinstance(g, Int8Grad):  # an INT8 store that was made before install (refused there) cannot appear here
            raise RuntimeError(f"step_in_backward_: {self._names[id(p)]} holds an INT8 gradient store")
        try:
            self._update(p, g, False)
        finally:
            p.grad = None

    def _after_step(self, optimizer, args, kwargs):
        self._stepped.clear()

    def remove(self) -> None:
        """Detach the hooks: backward stores gradients again (INT8 for QFT weights) and step() applies them."""
        if self._removed:
            return
        for h in self._hooks:
            h.remove()
        for p in self._consumers:
            if getattr(p, "grad_consumer", None) == self._consume:
                del p.grad_consumer
        self._hooks.clear()
        self._consumers.clear()
        self._removed = True
        if getattr(self.optimizer, _KEY, None) is self:
            delattr(self.optimizer, _KEY)


def step_in_backward_(model: nn.Module, optimizer, quantize_grad: bool = True) -> StepInBackwardHandle:
    """Apply `optimizer`'s step (QLion) to each parameter during backward, as soon as its gradient exists (see the
    module docstring for the semantics). `model`: a model converted with QFTConfig(gradient_bits=8) (other models
    work too: their parameters are stepped from post-accumulate-grad hooks). `quantize_grad`: the INT8 weights'
    gradients pass through the INT8 quantizer first (QFT's Algorithm 1; identical to the stored path), or, False, go
    to the optimizer in float. Returns a handle; `handle.remove()` restores the normal behaviour."""
    import torch.distributed as dist

    opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    if not callable(getattr(opt, "update_param_", None)):
        raise TypeError(f"step_in_backward_: the optimizer must be hfq.qft.QLion (it has the per-parameter "
                        f"update_param_), got {type(opt).__name__}")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError("step_in_backward_: single process only (under DDP the plain parameters' gradients are "
                           "all-reduced after the hook that would step them); use backward + optimizer.step()")
    if getattr(opt, _KEY, None) is not None:
        raise RuntimeError("step_in_backward_: already installed on this optimizer; call handle.remove() first")
    accum = getattr(getattr(optimizer, "gradient_state", None), "num_steps", 1)  # accelerate's AcceleratedOptimizer
    if accum != 1:
        raise ValueError(f"step_in_backward_: gradient accumulation ({accum} steps, Accelerator's "
                         "gradient_accumulation_steps) cannot work when the step is applied during each backward: "
                         "the first micro-step would update every weight from its share of the loss; use 1")
    params = [p for g in opt.param_groups for p in g["params"]]
    model_params = {id(p) for p in model.parameters()}
    for p in params:
        if p.requires_grad and (p.grad is not None or int8_grad(p) is not None):
            raise RuntimeError("step_in_backward_: the optimizer's parameters hold gradients from an earlier backward; "
                               "call optimizer.step() or optimizer.zero_grad() first")
    h = StepInBackwardHandle(model, opt, quantize_grad)
    for p in params:
        if not p.requires_grad:
            continue
        if id(p) not in model_params:
            h.remove()
            raise ValueError(f"step_in_backward_: optimizer parameter {h._names[id(p)]} is not a parameter of `model`")
        if isinstance(p, QParam):
            p.grad_consumer = h._consume
            h._consumers.append(p)
        h._hooks.append(p.register_post_accumulate_grad_hook(h._post_accumulate))
    h._hooks.append(opt.register_step_post_hook(h._after_step))
    setattr(opt, _KEY, h)
    return h


class StepInBackward(TrainerCallback):
    """transformers Trainer: QLion's step applied during backward (hfq.qft.step_in_backward_), installed at train
    begin and removed at train end. Refuses gradient_accumulation_steps > 1 and max_grad_norm > 0 (no gradient
    exists when Trainer would clip: set max_grad_norm=0). Trainer's own optimizer.step() is then a no-op."""

    def __init__(self, quantize_grad: bool = True):
        self.quantize_grad = quantize_grad
        self.handle = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if args.gradient_accumulation_steps != 1:
            raise ValueError(f"StepInBackward: gradient_accumulation_steps must be 1 (the step is applied during "
                             f"each backward), got {args.gradient_accumulation_steps}")
        if getattr(args, "fp16", False):
            raise ValueError("StepInBackward: fp16 loss scaling (fp16=True) cannot work when the step is applied "
                             "during backward: each weight is updated from the scaled gradient before the scaler can "
                             "unscale it or skip an overflowing step (and GradScaler then finds no gradient); train "
                             "with bf16=True")
        if args.max_grad_norm is not None and args.max_grad_norm > 0:
            raise ValueError(f"StepInBackward: gradient clipping cannot work when the step is applied during "
                             f"backward (the norm is known only after every update); set max_grad_norm=0, got "
                             f"{args.max_grad_norm}")
        if self.handle is not None:  # a previous train() that raised never reached on_train_end
            self.handle.remove()
        self.handle = step_in_backward_(model, optimizer, self.quantize_grad)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        return control
