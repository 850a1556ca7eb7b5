"""`calibrate_`: NVFP4 with GPTQ calibration on the user's texts, decoder block by block; the result is the ordinary
hfq_nvfp4 format (save_pretrained / from_pretrained / export_compressed_tensors / LoRA as after a plain load).

Each decoder block is brought to the compute device, run on the calibration activations (the outputs of the blocks
before it, already quantized) to collect every linear's input Hessian, its linears are quantized by GPTQ (linears
that read the same input, e.g. q/k/v, as one row-stacked matrix sharing the Hessian), and the quantized block is
run again to give the next block its inputs. Peak device memory: the quantized blocks so far, one dense block, the
Hessians of one block and the calibration activations.
"""
from __future__ import annotations

import math
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

import hfq_kernels.nvfp4_calib  # noqa: F401  (registers torch.ops.hfq.nvfp4_gptq / nvfp4_quantize_search)
from hfq_kernels.reference import fp4, fp4_calib

from .._base.surgery import mark_quantized, modules_to_skip, set_submodule, should_convert
from .config import NVFP4Config
from .linear import NVFP4Linear, mark_ddp_ignore


@dataclass
class CalibrationReport:
    """Per converted linear: calibration tokens, relative output error sqrt(tr(dW H dW^T) / tr(W H W^T)) on the
    calibration inputs for round-to-nearest and for the kept result, and which result was kept; the pass's wall
    time per phase."""

    rows: list[dict] = field(default_factory=list)
    tokens: int = 0
    sequences: int = 0
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per phase of the pass

    def table(self) -> str:
        L = [f"calibration: {self.sequences} sequences, {self.tokens} tokens", "",
             "errors on the calibration inputs (the data GPTQ was fitted to)", "",
             "| layer | RTN error | calibrated error | change | kept |", "|---|---|---|---|---|"]
        for r in self.rows:
            L.append(f"| {r['name']} | {r['rtn']:.4f} | {r['calibrated']:.4f} | "
                     f"{r['calibrated'] / max(r['rtn'], 1e-30) - 1:+.1%} | {r['kept']} |")
        if self.rows:
            a = sum(r["rtn"] for r in self.rows) / len(self.rows)
            b = sum(r["calibrated"] for r in self.rows) / len(self.rows)
            L.append(f"| mean of {len(self.rows)} | {a:.4f} | {b:.4f} | {b / max(a, 1e-30) - 1:+.1%} | |")
        return "\n".join(L)


# --------------------------------------------------------------------------------------------- calibration data
def calibration_batches(data, tokenizer=None, max_length: int = 512, batch_size: int = 8,
                        min_tokens: int = 128) -> list[dict]:
    """Calibration data as a list of {"input_ids", "attention_mask"} CPU batches (right-padded).

    `data`: a list of strings (needs `tokenizer`; each truncated to `max_length` tokens), a list of token-id
    lists / 1-D tensors, a 2-D tensor of ids, a tokenizer's output (a mapping with "input_ids" and optionally
    "attention_mask": split into batches of `batch_size` rows), or an iterable of dicts with "input_ids"
    (+ "attention_mask"), e.g. a DataLoader, or with "text" (datasets rows; needs `tokenizer`). Raises ValueError
    for no data, an empty sequence, or fewer than `min_tokens` tokens in all."""
    if isinstance(data, torch.Tensor):
        data = list(data) if data.dim() == 2 else [data]
    if isinstance(data, str):
        raise ValueError("calibration data: got one string; pass a list of texts")
    if isinstance(data, Mapping):  # e.g. tokenizer(texts, padding=True, return_tensors="pt"): one batch of rows
        if "input_ids" not in data:
            raise ValueError(f"calibration data: a mapping needs 'input_ids' (a tokenizer's output); got keys "
                             f"{sorted(map(str, data))}")
        ids = torch.as_tensor(data["input_ids"])
        ids = ids[None] if ids.dim() == 1 else ids
        mask = torch.as_tensor(data["attention_mask"]) if "attention_mask" in data else torch.ones_like(ids)
        mask = mask[None] if mask.dim() == 1 else mask
        data = [{"input_ids": ids[i:i + batch_size], "attention_mask": mask[i:i + batch_size]}
                for i in range(0, ids.shape[0], batch_size)]
    items = list(data)
    if not items:
        raise ValueError("calibration data is empty: pass a non-empty list of texts (or token ids / batches)")
    if isinstance(items[0], Mapping) and "input_ids" not in items[0]:
        if "text" not in items[0]:
            raise ValueError(f"calibration data: rows need 'input_ids' or 'text'; got keys {sorted(map(str, items[0]))}")
        items = [r["text"] for r in items]
    batches = []
    if isinstance(items[0], Mapping):
        for i, b in enumerate(items):
            ids = torch.as_tensor(b["input_ids"])
            ids = ids[None] if ids.dim() == 1 else ids
            mask = torch.as_tensor(b.get("attention_mask", torch.ones_like(ids)))
            mask = mask[None] if mask.dim() == 1 else mask
            if mask.shape != ids.shape:
                raise ValueError(f"calibration batch {i}: attention_mask {tuple(mask.shape)} does not match "
                                 f"input_ids {tuple(ids.shape)}")
            batches.append({"input_ids": ids[:, :max_length], "attention_mask": mask[:, :max_length].long()})
    else:
        seqs = []
        for i, x in enumerate(items):
            if isinstance(x, str):
                if tokenizer is None:
                    raise ValueError("calibration data: texts need tokenizer=... (or pass token ids)")
                x = tokenizer(x, add_special_tokens=True, truncation=True, max_length=max_length)["input_ids"]
            ids = torch.as_tensor(x, dtype=torch.long).reshape(-1)[:max_length]
            if ids.numel() == 0:
                raise ValueError(f"calibration data: sequence {i} is empty (no tokens)")
            seqs.append(ids)
        for i in range(0, len(seqs), batch_size):
            chunk = seqs[i:i + batch_size]
            n = max(len(s) for s in chunk)
            ids = torch.zeros(len(chunk), n, dtype=torch.long)
            mask = torch.zeros(len(chunk), n, dtype=torch.long)
            for r, s in enumerate(chunk):
                ids[r, :len(s)], mask[r, :len(s)] = s, 1
            batches.append({"input_ids": ids, "attention_mask": mask})
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    if tokens < min_tokens:
        raise ValueError(f"calibration data too short: {tokens} tokens, at least min_tokens={min_tokens} needed "
                         "(a few hundred sequences of a few hundred tokens is typical)")
    return batches


# --------------------------------------------------------------------------------------------- Hessians
class _Hessians:
    """Forward pre-hooks on a block's linears accumulating sum(x x^T) over the unpadded tokens; linears fed the very
    same input tensor (found on the first batch) share one accumulator."""

    def __init__(self, linears: dict[str, nn.Linear]):
        self.linears = linears
        self.h: dict[str, torch.Tensor] = {}
        self.n: dict[str, int] = {}
        self.owner: dict[str, str] = {}
        self.mask: torch.Tensor | None = None
        self._first: dict[int, tuple[torch.Tensor, str]] | None = {}
        self._handles = [m.register_forward_pre_hook(self._hook(name)) for name, m in linears.items()]

    def _hook(self, name):
        def hook(mod, args):
            x = args[0]
            if self._first is not None and name not in self.owner:
                hit = self._first.get(x.data_ptr())
                own = hit[1] if hit is not None and hit[0] is x else name
                self._first.setdefault(x.data_ptr(), (x, name))  # kept alive: no address reuse in this batch
                self.owner[name] = own
            if self.owner.get(name, name) != name:
                return
            x2 = x.reshape(-1, x.shape[-1])
            if self.mask is not None and self.mask.numel() == x2.shape[0]:
                x2 = x2[self.mask.reshape(-1)]
            x2 = x2.float()
            h = self.h.get(name)
            if h is None:
                h = self.h[name] = torch.zeros(x2.shape[1], x2.shape[1], dtype=torch.float32, device=x2.device)
                self.n[name] = 0
            h.addmm_(x2.T, x2)
            self.n[name] += x2.shape[0]

        return hook

    def end_batch(self):
        self._first = None

    def groups(self) -> dict[str, list[str]]:
        """owner -> the linears sharing its input (in block order)."""
        out: dict[str, list[str]] = {}
        for name in self.linears:
            out.setdefault(self.owner.get(name, name), []).append(name)
        return out

    def close(self):
        for h in self._handles:
            h.remove()


# --------------------------------------------------------------------------------------------- quantization
def _rel_error(dw: torch.Tensor, w: torch.Tensor, h: torch.Tensor) -> float:
    num = ((dw @ h) * dw).sum()
    den = ((w @ h) * w).sum().clamp_min(1e-30)
    return float((num / den).clamp_min(0).sqrt())


def _global_recip(w: torch.Tensor, search: bool) -> torch.Tensor:
    if search:
        return torch.ops.hfq.nvfp4_quantize_search(w)[2]
    return torch.ops.hfq.nvfp4_quantize(w)[2]


def _quantize_group(names, weights, h, n, config: NVFP4Config, damp: float, block: int, where: str = ""):
    """GPTQ for the linears `names` sharing Hessian sum `h` over `n` tokens; per linear, the kept codes (GPTQ's or
    the data-free quantizer's, whichever has the smaller output error on the calibration inputs) and report rows.
    `where`: the block's name, for errors."""
    search = config.scales == "mse"
    full = [f"{where}.{nm}" if where else nm for nm in names]
    for nm, w in zip(full, weights):
        fp4.check_finite(w, f"{nm}.weight")
    if not bool(torch.isfinite(h).all()):
        raise ValueError(f"calibrate_: non-finite activations (NaN/Inf) enter {full}: the calibration Hessian "
                         "cannot be formed (an overflow in the blocks before, e.g. fp16/bf16 activations?)")
    h = h / n
    try:
        u = fp4_calib.hessian_inverse_factor(h, damp)
    except ValueError as e:
        raise ValueError(f"calibrate_: {full}: {e}") from None
    recips = [_global_recip(w, search) for w in weights]
    rows = torch.cat([r.expand(w.shape[0]) for r, w in zip(recips, weights)])
    packed, scale = torch.ops.hfq.nvfp4_gptq(torch.cat(weights).float(), u, rows, block, search)
    out, r0 = [], 0
    for name, w, recip in zip(names, weights, recips):
        w32 = w.float()
        k = w.shape[0]
        gptq = (packed[r0:r0 + k], scale[r0:r0 + k], recip)
        r0 += k
        base = (torch.ops.hfq.nvfp4_quantize_search if search else torch.ops.hfq.nvfp4_quantize)(w)
        rtn = base if not search else torch.ops.hfq.nvfp4_quantize(w)
        err = {}
        for label, q in (("gptq", gptq), ("data-free" if search else "rtn", base), ("rtn", rtn)):
            if label not in err:
                deq = torch.ops.hfq.nvfp4_dequantize(*q, torch.float32)
                err[label] = (_rel_error(deq - w32, w32, h), q)
        kept = min(err, key=lambda lb: err[lb][0])
        deq = torch.ops.hfq.nvfp4_dequantize(*err[kept][1], torch.float32)
        wrel = float((deq - w32).norm() / w32.norm().clamp_min(1e-30))
        out.append((name, err[kept][1], {"name": name, "tokens": n, "rtn": err["rtn"][0],
                                         "calibrated": err[kept][0], "kept": kept, "weight_rel_error": wrel}))
    return out


def _nvfp4_from(lin: nn.Linear, q, config: NVFP4Config) -> NVFP4Linear:
    packed, scale, recip = q
    dev = lin.weight.device
    mod = NVFP4Linear(lin.in_features, lin.out_features, lin.bias is not None, "nvfp4", config.torch_compute_dtype,
                      device="meta", dtype=lin.weight.dtype)
    mod.register_buffer("weight_packed", packed.to(dev))
    mod.register_buffer("weight_scale", scale.to(dev))
    mod.register_buffer("weight_global_scale", recip.to(dev))
    if lin.bias is not None:
        mod.bias = nn.Parameter(lin.bias.detach().clone(), requires_grad=False)
    mod.scale_rule = config.scales
    if mod.g4_wanted(dev):
        mod.to_g4_layout_()
    return mod


# --------------------------------------------------------------------------------------------- the pass
class _Clock:
    """Adds the wall time since the last call to `into[phase]` (synchronising the device first)."""

    def __init__(self, device, into: dict):
        self.device, self.into = device, into
        self.t = self._now()

    def _now(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def __call__(self, phase: str):
        t = self._now()
        self.into[phase] = round(self.into.get(phase, 0.0) + t - self.t, 2)
        self.t = t


class _Stop(Exception):
    pass


def _decoder_layers(model) -> nn.ModuleList:
    dec = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(dec, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(f"calibrate_: cannot find the decoder's block list (model.model.layers) in "
                         f"{type(model).__name__}")
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    types = {getattr(layer, "attention_type", None) for layer in layers} | set(getattr(cfg, "layer_types", None)
                                                                               or ())
    types.discard(None)
    if len(types) > 1:
        raise ValueError(f"calibrate_: decoder blocks of several attention types {sorted(map(str, types))} "
                         "(sliding-window layers) are not supported: the blocks' inputs are captured once")
    return layers


def _capture_inputs(model, layers, batches, device):
    """Run the model up to the first block for every batch: [(hidden_states, kwargs)] on `device`."""
    captured = []

    def grab(mod, args, kwargs):
        hs = args[0] if args else kwargs.pop("hidden_states")
        captured.append((hs, {k: v for k, v in kwargs.items() if k != "hidden_states"}))
        raise _Stop

    handle = layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for b in batches:
            try:
                model(input_ids=b["input_ids"].to(device), attention_mask=b["attention_mask"].to(device),
                      use_cache=False)
            except _Stop:
                pass
    finally:
        handle.remove()
    if len(captured) != len(batches):
        raise ValueError("calibrate_: the model's forward did not reach its first decoder block")
    return captured


def _run_block(layer, states, batches, hess: _Hessians | None = None):
    outs = []
    for (hs, kw), b in zip(states, batches):
        if hess is not None:
            hess.mask = b["attention_mask"].to(hs.device).bool()
        y = layer(hs, **kw)
        outs.append((y[0] if isinstance(y, tuple) else y, kw))
        if hess is not None:
            hess.end_batch()
    return outs


def _progress(it, total, desc, enabled):
    if not enabled:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, total=total, desc=desc)


@torch.no_grad()
def calibrate_(model: nn.Module, data, tokenizer=None, config: NVFP4Config | None = None, *, device=None,
               max_length: int = 512, batch_size: int = 8, min_tokens: int = 128, damp: float = 0.01,
               block: int = 128, progress: bool = True) -> CalibrationReport:
    """Quantize the dense causal LM `model` to NVFP4 in place with GPTQ on calibration `data` (see
    calibration_batches), decoder block by decoder block on `device` (default: CUDA if available, else CPU; a
    model held on the CPU is moved there one block at a time). Linears follow `config` (NVFP4Config: its
    modules_to_not_convert, compute_dtype, and `scales`: "mse" also searches the block scales within GPTQ; the
    global scale stays amax's). Per layer the result with the smaller output error on the calibration inputs is
    kept between GPTQ and the data-free quantizer, so no layer is worse than round-to-nearest there (on held-out
    inputs that holds only with enough data: a warning names groups with fewer tokens than twice their input
    width). `max_length` is cut to the model's max_position_embeddings. If the pass fails, the model is put back
    as it was (every replaced linear restored). Afterwards the model is an ordinary hfq_nvfp4 model
    (save_pretrained writes the hfq checkpoint). Returns the per-layer report."""
    config = (config or NVFP4Config()).checked_copy()
    if config.format != "nvfp4":
        raise ValueError(f"calibrate_: format={config.format!r} is not supported; GPTQ calibration writes 'nvfp4'")
    if not (isinstance(damp, (int, float)) and math.isfinite(damp) and damp >= 0):
        raise ValueError(f"calibrate_: damp={damp!r}; allowed: a finite number >= 0 (a fraction of mean(diag H))")
    if not (isinstance(block, int) and block > 0 and block % fp4.NVFP4_BLOCK == 0):
        raise ValueError(f"calibrate_: block={block!r}; allowed: a positive multiple of {fp4.NVFP4_BLOCK}")
    _check_dense(model)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    max_length = _within_context(model, max_length)
    batches = calibration_batches(data, tokenizer, max_length, batch_size, min_tokens)
    layers = _decoder_layers(model)
    replaced: list[tuple[nn.Module, str, nn.Module]] = []  # (parent, name, original linear): undone on failure
    try:
        return _calibrate(model, layers, batches, config, device, damp, block, progress, replaced)
    except BaseException:
        for parent, name, lin in reversed(replaced):
            dev = next((t.device for t in parent.parameters()), None)
            set_submodule(parent, name, lin if dev is None else lin.to(dev))
        raise


def _check_dense(model) -> None:
    """Refuse what calibrate_ cannot quantize as a whole: an hfq/other quantized model, or one holding PEFT adapters
    (whose own linears would be quantized and frozen)."""
    if any(isinstance(m, NVFP4Linear) for m in model.modules()):
        raise ValueError("calibrate_: the model is already quantized; load the dense checkpoint (without "
                         "quantization_config) and calibrate that")
    qc = getattr(getattr(model, "config", None), "quantization_config", None)
    if qc is not None or getattr(model, "hf_quantizer", None) is not None or getattr(model, "is_quantized", False):
        method = getattr(qc, "quant_method", None) or (qc.get("quant_method") if isinstance(qc, dict) else None)
        raise ValueError(f"calibrate_: the model is already quantized (quant_method {method!r}); load the dense "
                         "checkpoint (without quantization_config) and calibrate that")
    if getattr(model, "peft_config", None) or any(hasattr(m, "lora_A") or type(m).__module__.startswith("peft.")
                                                  for m in model.modules()):
        raise ValueError("calibrate_: the model holds PEFT adapters, whose own linears would be quantized and "
                         "frozen; calibrate the dense model first, then attach LoRA (peft.get_peft_model)")


def _to_host(lin: nn.Module) -> nn.Module:
    """A replaced block linear kept for calibrate_'s undo, its tensors rebound to host copies so that device memory
    holds no dense weight of a block already quantized."""
    for group in (lin._parameters, lin._buffers):
        for k, t in group.items():
            if t is not None and t.device.type != "cpu":
                c = t.detach().cpu()
                group[k] = nn.Parameter(c, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else c
    return lin


def _within_context(model, max_length: int) -> int:
    """max_length, cut to the model's max_position_embeddings (longer calibration samples would index past learned
    position tables or run RoPE at positions the model never saw)."""
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    limit = getattr(cfg, "max_position_embeddings", None)
    return min(max_length, limit) if isinstance(limit, int) and limit > 0 else max_length


def _calibrate(model, layers, batches, config, device, damp, block, progress, replaced) -> CalibrationReport:
    """calibrate_'s pass (its arguments checked); every replaced linear is listed in `replaced` as it goes."""
    from .quantizer import NVFP4HfQuantizer

    skip = modules_to_skip(model, config, config.ADD_DEFAULT_SKIPS)
    prefix = {id(layer): n for n, layer in model.named_modules() if any(layer is x for x in layers)}
    model.eval()
    kept_layers, model_layers = layers, _decoder_parent(model)
    model_layers.layers = nn.ModuleList()  # everything but the blocks goes to the device now
    try:
        model.to(device)
    finally:
        model_layers.layers = kept_layers
    states = None
    report = CalibrationReport(tokens=sum(int(b["attention_mask"].sum()) for b in batches),
                               sequences=sum(b["input_ids"].shape[0] for b in batches))
    converted, skipped, few = [], {}, []
    clock = _Clock(device, report.seconds)
    for i, layer in _progress(enumerate(layers), len(layers), "NVFP4 GPTQ", progress):
        layer.to(device)
        if states is None:
            states = _capture_inputs(model, layers, batches, device)
            clock("capture")
        pre = prefix[id(layer)]
        linears = {}
        for n, m in layer.named_modules():
            full = f"{pre}.{n}"
            if type(m) is not nn.Linear:
                continue
            if not should_convert(full, skip):
                skipped[full] = "modules_to_not_convert"
            elif m.in_features % config.block_size:
                if config.strict:
                    raise ValueError(f"{full}: in_features={m.in_features} not a multiple of block size "
                                     f"{config.block_size} (strict=True)")
                skipped[full] = f"in_features={m.in_features} not a multiple of block size {config.block_size}"
            else:
                linears[n] = m
        hess = _Hessians(linears)
        try:
            _run_block(layer, states, batches, hess)
        finally:
            hess.close()
        clock("hessians")
        groups = hess.groups()
        for owner, names in groups.items():
            if hess.n.get(owner, 0) == 0:
                raise ValueError(f"calibrate_: no calibration token reached {pre}.{owner} (and {names}); every "
                                 "quantized linear needs calibration inputs (e.g. MoE experts need more data, "
                                 "or list the layer in modules_to_not_convert)")
            if hess.n[owner] < 2 * linears[owner].in_features:
                few.append(f"{pre}.{owner} ({hess.n[owner]} tokens, {linears[owner].in_features} inputs)")
        for owner, names in groups.items():
            weights = [linears[n].weight.detach() for n in names]
            for n, q, row in _quantize_group(names, weights, hess.h.pop(owner), hess.n[owner], config, damp, block,
                                             pre):
                set_submodule(layer, n, _nvfp4_from(linears[n], q, config))
                replaced.append((layer, n, _to_host(linears[n])))
                row["name"] = f"{pre}.{n}"
                report.rows.append(row)
                converted.append(row["name"])
        clock("gptq")
        states = _run_block(layer, states, batches)
        clock("propagate")
    del states
    in_blocks = set(converted) | set(skipped)
    for name, m in list(model.named_modules()):  # linears outside the blocks: as a quantize-on-load does
        if type(m) is not nn.Linear or name in in_blocks:
            continue
        if not should_convert(name, skip) or m.in_features % config.block_size:
            skipped[name] = ("modules_to_not_convert" if not should_convert(name, skip) else
                             f"in_features={m.in_features} not a multiple of block size {config.block_size}")
            continue
        fp4.check_finite(m.weight, f"{name}.weight")
        q = (torch.ops.hfq.nvfp4_quantize_search if config.scales == "mse" else torch.ops.hfq.nvfp4_quantize)(
            m.weight.detach())
        parent, _, leaf = name.rpartition(".")
        set_submodule(model, name, _nvfp4_from(m, q, config))
        replaced.append((model.get_submodule(parent), leaf, m))
        converted.append(name)
    if not converted:
        raise ValueError(f"calibrate_: no linear of {type(model).__name__} was converted (skipped: {skipped}); "
                         "nothing to calibrate")
    if few:
        warnings.warn(f"calibrate_: {len(few)} linear group(s) saw fewer calibration tokens than twice their input "
                      f"width, e.g. {few[0]}: their Hessians are (near) rank-deficient and GPTQ fits the calibration "
                      "tokens, so held-out error may exceed round-to-nearest's; pass more data (a few hundred "
                      "sequences of a few hundred tokens)", UserWarning, stacklevel=3)
    model.to(device)
    rel = {r["name"]: r["weight_rel_error"] for r in report.rows}
    _mark_quantized(model, config, converted, skipped, rel, NVFP4HfQuantizer)
    return report


def _decoder_parent(model) -> nn.Module:
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


def _mark_quantized(model, config, converted, skipped, rel_error, quantizer_cls) -> None:
    """Make `model` what a quantize-on-load gives: config + quantizer for save_pretrained, report, DDP ignore."""
    q = quantizer_cls(config, pre_quantized=False)
    q.converted, q.skipped, q.rel_error = list(converted), dict(skipped), dict(rel_error)
    q.calibrated = True
    mark_quantized(model, q, {"quantized": list(converted), "skipped": dict(skipped), "rel_error": dict(rel_error)})
    mark_ddp_ignore(model)
