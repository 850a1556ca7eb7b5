"""RolloutMixin: makes TRL's GRPOTrainer generate with hfq's RolloutEngine instead of `model.generate`.

Usage::

    class MyTrainer(RolloutMixin, trl.GRPOTrainer):
        pass

It overrides `GRPOTrainer._generate_single_turn` (TRL 1.16) for the `use_vllm=False` path and returns
what TRL's own transformers path returns: per-prompt completion id lists, each cut after its first
EOS (EOS kept), and no sampling log-probs (as TRL's path: with them, `off_policy_mask_threshold` would measure
the sampler's top-k/top-p filtering and AQN's noise as off-policy drift; `rollout_return_logprobs=True` hands
them over anyway). The sampling settings are the ones `model.generate` would use: TRL's generation config
completed from the model's own `generation_config` (so `top_k=None` means the model's or transformers' default).
Requests the engine cannot serve (vLLM or continuous batching on, images / multimodal fields, any logits
processor besides temperature / top-k / top-p / min-p (repetition penalty, suppressed tokens, min_new_tokens,
n-gram blocking, ...), extra generation kwargs, ZeRO-3 / FSDP, a sequence longer than `rollout_max_seq_len`,
unsupported architectures) go to `super()` with a one-time warning. The engine samples with the model in eval
mode (no LoRA dropout); TRL's `model.generate` samples in train mode unless `disable_dropout=True`.

Its settings are the declared, validated fields of `RolloutArguments` (defaults in brackets):
  use_hfq_rollout [True], rollout_max_batch [rows of the first call], rollout_max_seq_len
  [longest prompt + max_completion_length, rounded up to 256], rollout_gpu_memory_utilization [None],
  rollout_kv_cache_gb [None], rollout_graph_mode ["auto"], rollout_return_logprobs [False].
`QeRLConfig` includes them; with a plain `trl.GRPOConfig` the defaults apply (or declare them:
`@dataclass class MyConfig(RolloutArguments, GRPOConfig)`).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, fields

import torch

from .engine import GRAPH_MODES, MAX_EOS_IDS, RolloutEngine

_SUPPORTED_GEN_KWARGS = {"max_new_tokens", "do_sample", "pad_token_id", "bos_token_id", "eos_token_id", "temperature",
                         "top_p", "top_k", "min_p", "repetition_penalty", "cache_implementation"}
# GenerationConfig fields that add a logits processor / change the search, with the values that leave sampling as
# the engine does it (temperature, top-k, top-p, min-p only)
_NEUTRAL_GEN = {"repetition_penalty": (None, 1.0), "encoder_repetition_penalty": (None, 1.0),
                "no_repeat_ngram_size": (None, 0), "encoder_no_repeat_ngram_size": (None, 0),
                "bad_words_ids": (None, []), "force_words_ids": (None, []), "constraints": (None, []),
                "min_length": (None, 0), "min_new_tokens": (None, 0), "suppress_tokens": (None, []),
                "begin_suppress_tokens": (None, []), "forced_bos_token_id": (None,), "forced_eos_token_id": (None,),
                "sequence_bias": (None, {}), "typical_p": (None, 1.0), "epsilon_cutoff": (None, 0.0),
                "eta_cutoff": (None, 0.0), "exponential_decay_length_penalty": (None,), "guidance_scale": (None, 1.0),
                "num_beams": (None, 1), "penalty_alpha": (None,), "watermarking_config": (None,),
                "stop_strings": (None, []), "top_h": (None,), "prompt_lookup_num_tokens": (None,),
                "token_healing": (None, False), "max_time": (None,)}


def effective_generation_config(trainer, model):
    """The GenerationConfig TRL's `model.generate` would sample with: the trainer's own (its
    generation_kwargs) completed by the model's `generation_config` and transformers' defaults."""
    gc = getattr(trainer, "generation_config", None)
    prep = getattr(model, "_prepare_generation_config", None)
    if gc is None or prep is None:
        return gc
    return prep(gc)[0]


def unsupported_generation(gc) -> str | None:
    """The first setting of `gc` that the engine's sampler cannot reproduce, as 'name=value'; None if none."""
    if gc is None:
        return None
    for name, neutral in _NEUTRAL_GEN.items():
        v = getattr(gc, name, None)
        if not any(v is n or (n is not None and v == n) for n in neutral):
            return f"{name}={v!r}"
    return None


@dataclass
class RolloutArguments:
    """The rollout engine's trainer settings, as dataclass fields so `HfArgumentParser` parses them and bad values
    fail on construction, naming the field. Combine with a GRPOConfig: `class C(RolloutArguments, GRPOConfig)`."""

    use_hfq_rollout: bool = field(default=True, metadata={"help": "Sample GRPO rollouts with hfq's RolloutEngine "
                                                                  "where it can serve the request."})
    rollout_max_batch: int | None = field(default=None, metadata={"help": "Engine rows (default: the first call's)."})
    rollout_max_seq_len: int | None = field(
        default=None, metadata={"help": "Engine KV length (default: longest prompt + max_completion_length, to 256)."})
    rollout_gpu_memory_utilization: float | None = field(
        default=None, metadata={"help": "Share of GPU memory the KV cache may bring the total to, in (0, 1]."})
    rollout_kv_cache_gb: float | None = field(default=None, metadata={"help": "KV cache budget in GiB."})
    rollout_graph_mode: str = field(default="auto", metadata={"help": f"One of {GRAPH_MODES}."})
    rollout_return_logprobs: bool = field(default=False, metadata={
        "help": "Hand TRL the engine's sampling log-probs (after top-k/top-p filtering, under AQN noise); TRL's own "
                "generate hands none, and off_policy_mask_threshold then compares against them."})

    def __post_init__(self):
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        check_rollout_arguments(self)


def _check(name: str, value, ok, want: str) -> None:
    if value is not None and (isinstance(value, bool) or not ok(value)):
        raise ValueError(f"{name}: expected {want} or None, got {value!r}")


def check_rollout_arguments(args) -> None:
    """ValueError naming the first `RolloutArguments` field of `args` that is out of range."""
    for name in ("use_hfq_rollout", "rollout_return_logprobs"):
        if not isinstance(getattr(args, name), bool):
            raise ValueError(f"{name}: expected True or False, got {getattr(args, name)!r}")
    _check("rollout_max_batch", args.rollout_max_batch, lambda v: isinstance(v, int) and v >= 1, "an int >= 1")
    _check("rollout_max_seq_len", args.rollout_max_seq_len, lambda v: isinstance(v, int) and v >= 2, "an int >= 2")
    _check("rollout_kv_cache_gb", args.rollout_kv_cache_gb, lambda v: isinstance(v, (int, float)) and v > 0,
           "a number > 0")
    _check("rollout_gpu_memory_utilization", args.rollout_gpu_memory_utilization,
           lambda v: isinstance(v, (int, float)) and 0 < v <= 1, "a number in (0, 1]")
    if args.rollout_graph_mode not in GRAPH_MODES:
        raise ValueError(f"rollout_graph_mode: {args.rollout_graph_mode!r} not in {GRAPH_MODES}")


_DEFAULTS = {f.name: f.default for f in fields(RolloutArguments)}


class RolloutMixin:
    """Put before `trl.GRPOTrainer` in the bases to generate rollouts with `hfq.rollout.RolloutEngine`."""

    _hfq_engine: RolloutEngine | None = None
    _hfq_warned: set | None = None

    def _rollout_setting(self, name: str):
        """A `RolloutArguments` field from the trainer's args, or its default when the args don't declare them."""
        return getattr(self.args, name) if isinstance(self.args, RolloutArguments) else _DEFAULTS[name]

    def _hfq_fallback(self, reason: str):
        if self._hfq_warned is None:
            self._hfq_warned = set()
        if reason not in self._hfq_warned:
            self._hfq_warned.add(reason)
            warnings.warn(f"hfq.rollout: falling back to TRL's generation ({reason})", stacklevel=3)

    def _hfq_unsupported(self, images, multimodal_fields) -> str | None:
        args = self.args
        if not self._rollout_setting("use_hfq_rollout"):
            return "use_hfq_rollout=False"
        if self.use_vllm:
            return "use_vllm=True"
        if getattr(self, "use_transformers_continuous_batching", False):
            return "use_transformers_continuous_batching=True"
        if images is not None and any(img for img in images if img):
            return "images in the prompts"
        if multimodal_fields:
            return "multimodal fields"
        if self.repetition_penalty not in (None, 1.0):
            return f"repetition_penalty={self.repetition_penalty}"
        extra = set(args.generation_kwargs or {}) - _SUPPORTED_GEN_KWARGS
        if extra:
            return f"generation_kwargs {sorted(extra)}"
        if getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False):
            return "DeepSpeed / FSDP sharded parameters"
        return None

    def _hfq_get_engine(self, model, n_rows: int, need_len: int) -> RolloutEngine:
        eng = self._hfq_engine
        max_batch = self._rollout_setting("rollout_max_batch") or n_rows
        max_len = self._rollout_setting("rollout_max_seq_len") or int(math.ceil(need_len / 256) * 256)
        if eng is not None and eng.model is model and eng.max_seq_len >= need_len:
            return eng
        if eng is not None:
            max_batch = max(max_batch, eng.max_batch)
            max_len = max(max_len, eng.max_seq_len, need_len)
            self._hfq_engine = eng = None
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
        self._hfq_engine = RolloutEngine(
            model, max_batch=max_batch, max_seq_len=max_len,
            graph_mode=self._rollout_setting("rollout_graph_mode"),
            gpu_memory_utilization=self._rollout_setting("rollout_gpu_memory_utilization"),
            kv_cache_gb=self._rollout_setting("rollout_kv_cache_gb"),
            pad_token_id=self._tokenizer.pad_token_id)
        return self._hfq_engine

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        reason = self._hfq_unsupported(images, multimodal_fields)
        if reason is not None:
            self._hfq_fallback(reason)
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        from trl.extras.profiling import profiling_context
        from trl.models import unwrap_model_for_generation

        gen_kw = dict(self.generation_kwargs)
        max_new = gen_kw.get("max_new_tokens") or self.max_completion_length
        if max_new is None:  # TRL's generate then stops at the generation config's max_length
            self._hfq_fallback("max_completion_length=None (the engine needs a completion length)")
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        max_new = int(max_new)
        need_len = max(len(p) for p in prompt_ids) + max_new
        cap = self._rollout_setting("rollout_max_seq_len")
        if cap is not None and need_len > cap:
            self._hfq_fallback(f"rollout_max_seq_len={cap} is shorter than a prompt + max_completion_length")
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        want_lp = self._rollout_setting("rollout_return_logprobs")
        completions, logprobs = [], [] if want_lp else None
        with (
            profiling_context(self, "hfq.rollout.generate"),
            unwrap_model_for_generation(
                self.model_wrapped, self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as model,
            torch.no_grad(),
        ):
            gc = effective_generation_config(self, model)
            reason = unsupported_generation(gc)
            eos = getattr(gc, "eos_token_id", None)
            eos = gen_kw.get("eos_token_id", self.eos_token_ids) if eos is None else eos
            beyond = sorted(set([eos] if isinstance(eos, int) else eos) - set(self.eos_token_ids))
            if reason is None and beyond:  # TRL's generate stops there but cuts completions at its eos ids only
                reason = f"eos_token_id {beyond} beyond the EOS ids TRL ends completions at ({self.eos_token_ids})"
            if reason is None and len(self.eos_token_ids) > MAX_EOS_IDS:
                reason = f"{len(self.eos_token_ids)} EOS ids (the engine stops on at most {MAX_EOS_IDS})"
            if reason is None:
                try:
                    engine = self._hfq_get_engine(model, len(prompt_ids), need_len)
                except ValueError as e:
                    reason = str(e)
            if reason is not None:
                self._hfq_fallback(reason)
                return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                     has_tool_images)
            if gc is not None:  # what model.generate would use (None fields: the defaults below)
                gen_kw.update({k: getattr(gc, k) for k in ("do_sample", "temperature", "top_p", "top_k", "min_p",
                                                           "eos_token_id") if getattr(gc, k, None) is not None})
            do_sample = gen_kw.get("do_sample", True)
            temperature = gen_kw.get("temperature", self.temperature) if do_sample else 0.0
            for r0 in range(0, len(prompt_ids), engine.max_batch):
                chunk = prompt_ids[r0:r0 + engine.max_batch]
                seed = int(torch.randint(0, 2**62, (1,)).item())  # follows TRL's set_seed
                out = engine.generate(chunk, max_new_tokens=max_new, temperature=temperature,
                                      top_p=gen_kw.get("top_p", self.top_p), top_k=gen_kw.get("top_k", self.top_k),
                                      min_p=gen_kw.get("min_p", self.min_p),
                                      eos_token_ids=self.eos_token_ids,  # TRL cuts at any of them
                                      seed=seed, return_logprobs=want_lp)
                completions += out.completion_lists()
                if want_lp:
                    logprobs += out.logprob_lists()
        return completions, logprobs
