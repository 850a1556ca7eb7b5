"""RolloutMixin: makes TRL's GRPOTrainer generate with hfq's RolloutEngine instead of `model.generate`.

Usage::

    class MyTrainer(RolloutMixin, trl.GRPOTrainer):
        pass

It overrides `GRPOTrainer._generate_single_turn` (TRL 1.16) for the `use_vllm=False` path and returns
what TRL's own transformers path returns: per-prompt completion id lists, each cut after its first
EOS (EOS kept), plus the sampling log-probs (TRL uses them only with vLLM's importance-sampling
correction; harmless otherwise). Requests the engine cannot serve (vLLM or continuous batching on,
images / multimodal fields, repetition_penalty != 1, extra generation kwargs, ZeRO-3 / FSDP,
unsupported architectures) go to `super()` with a one-time warning.

Optional knobs read from the trainer's args (e.g. added by a GRPOConfig subclass; defaults in brackets):
  rollout_engine [True], rollout_max_batch [rows of the first call], rollout_max_seq_len
  [longest prompt + max_completion_length, rounded up to 256], rollout_gpu_memory_utilization [None],
  rollout_kv_cache_gb [None], rollout_graph_mode ["auto"], rollout_return_logprobs [True].
"""
from __future__ import annotations

import math
import warnings

import torch

from .engine import RolloutEngine

_SUPPORTED_GEN_KWARGS = {"max_new_tokens", "do_sample", "pad_token_id", "bos_token_id", "eos_token_id", "temperature",
                         "top_p", "top_k", "min_p", "repetition_penalty", "cache_implementation"}


class RolloutMixin:
    """Put before `trl.GRPOTrainer` in the bases to generate rollouts with `hfq.rollout.RolloutEngine`."""

    _hfq_engine: RolloutEngine | None = None
    _hfq_warned: set | None = None

    def _hfq_fallback(self, reason: str):
        if self._hfq_warned is None:
            self._hfq_warned = set()
        if reason not in self._hfq_warned:
            self._hfq_warned.add(reason)
            warnings.warn(f"hfq.rollout: falling back to TRL's generation ({reason})", stacklevel=3)

    def _hfq_unsupported(self, images, multimodal_fields) -> str | None:
        args = self.args
        if not getattr(args, "rollout_engine", True):
            return "rollout_engine=False"
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
        args = self.args
        eng = self._hfq_engine
        max_batch = getattr(args, "rollout_max_batch", None) or n_rows
        max_len = getattr(args, "rollout_max_seq_len", None) or int(math.ceil(need_len / 256) * 256)
        if eng is not None and eng.model is model and eng.max_seq_len >= need_len:
            return eng
        if eng is not None:
            max_batch = max(max_batch, eng.max_batch)
            max_len = max(max_len, eng.max_seq_len, need_len)
            self._hfq_engine = eng = None
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
        self._hfq_engine = RolloutEngine(
            model, max_batch=max_batch, max_seq_len=max_len,
            graph_mode=getattr(args, "rollout_graph_mode", "auto"),
            gpu_memory_utilization=getattr(args, "rollout_gpu_memory_utilization", None),
            kv_cache_gb=getattr(args, "rollout_kv_cache_gb", None),
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
        max_new = int(gen_kw.get("max_new_tokens") or self.max_completion_length)
        need_len = max(len(p) for p in prompt_ids) + max_new
        want_lp = bool(getattr(self.args, "rollout_return_logprobs", True))
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
            try:
                engine = self._hfq_get_engine(model, len(prompt_ids), need_len)
            except ValueError as e:
                self._hfq_fallback(str(e))
                return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                     has_tool_images)
            do_sample = gen_kw.get("do_sample", True)
            temperature = gen_kw.get("temperature", self.temperature) if do_sample else 0.0
            for r0 in range(0, len(prompt_ids), engine.max_batch):
                chunk = prompt_ids[r0:r0 + engine.max_batch]
                seed = int(torch.randint(0, 2**62, (1,)).item())  # follows TRL's set_seed
                out = engine.generate(chunk, max_new_tokens=max_new, temperature=temperature,
                                      top_p=gen_kw.get("top_p", self.top_p), top_k=gen_kw.get("top_k", self.top_k),
                                      min_p=gen_kw.get("min_p", self.min_p),
                                      eos_token_ids=gen_kw.get("eos_token_id", self.eos_token_ids),
                                      seed=seed, return_logprobs=want_lp)
                completions += out.completion_lists()
                if want_lp:
                    logprobs += out.logprob_lists()
        return completions, logprobs
