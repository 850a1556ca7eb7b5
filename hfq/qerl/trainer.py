"""`QeRLGRPOTrainer`: TRL's GRPOTrainer with Adaptive Quantization Noise on the norm weights.

Only TRL's extension points are overridden:
- `_generate_and_score_completions` (once per generation batch, i.e. once per optimizer step with TRL's defaults):
  picks the stage / sigma for `state.global_step`, logs `aqn/sigma`, `aqn/stage`, `aqn/applied_std`, and for
  `aqn_scope="rollout_and_old_logprobs"` recomputes the old-policy log-probs under the same noise.
- `_generate`: the noise is present exactly while sampling (TRL's `model.generate`, hfq's rollout engine, or
  vLLM colocate: TRL syncs the weights inside `_generate`, so the noisy norms travel with the sync; LoRA and
  NVFP4 policies sync through `vllm_sync.vllm_weights`: adapters merged out of place, dense or compressed-tensors
  NVFP4 layout as vLLM loaded it).
- `_generate_single_turn`: routes to hfq's rollout engine (`hfq.rollout.RolloutMixin`) when `use_hfq_rollout` is
  on and the model is on CUDA without vLLM; otherwise TRL's own path.
- `create_model_card`: hfq's adapter card (hfq.hub) in `output_dir/README.md`, which `push_to_hub()` uploads.
`peft_config=LoraConfig(...)` works as in TRL: `import hfq` taught PEFT to wrap NVFP4Linear.
The policy entropy is TRL's `entropy` metric (computed on every loss call).
"""
from __future__ import annotations

import os
import warnings

import torch
from trl import GRPOTrainer

from ..rollout.mixin import RolloutMixin
from .aqn import AdaptiveQuantizationNoise
from .config import QeRLConfig


class QeRLGRPOTrainer(RolloutMixin, GRPOTrainer):
    """GRPO/DAPO (as TRL provides) + AQN. Takes a `QeRLConfig`; everything else as `trl.GRPOTrainer`."""

    def __init__(self, model, reward_funcs=None, args: QeRLConfig | None = None, *more, **kwargs):
        if args is None:  # TRL's default output_dir: "<model name>-GRPO"
            name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "")
            args = QeRLConfig(output_dir=f"{str(name).rstrip('/').split('/')[-1] or 'QeRL'}-GRPO")
        if not isinstance(args, QeRLConfig):
            raise ValueError(f"args must be a QeRLConfig (GRPOConfig + AQN fields), got {type(args).__name__}")
        _check_columns(more[0] if more else kwargs.get("train_dataset"), reward_funcs)
        super().__init__(model, reward_funcs, args, *more, **kwargs)  # positional arguments as GRPOTrainer's
        self._refuse_fsdp()
        self.aqn_schedule = args.aqn_schedule_obj
        seed = args.seed if args.aqn_seed is None else args.aqn_seed
        self.aqn = (AdaptiveQuantizationNoise(self.accelerator.unwrap_model(self.model), args.aqn_norm_names, seed)
                    if args.aqn else None)
        self._aqn_now: tuple[int, float] | None = None  # (step, sigma) while a generation batch is being built
        self._aqn_stages_checked = False
        self.vllm_layout = None  # "dense" / "packed" when hfq's vLLM weight stream is installed
        if self.use_vllm:  # LoRA / NVFP4: LoRA-merged layers + noisy norms (see hfq.qerl.vllm_sync)
            from .vllm_sync import install_vllm_sync

            self.vllm_layout = install_vllm_sync(self)

    def _refuse_fsdp(self) -> None:
        """QeRL runs under DDP (or DeepSpeed ZeRO-1/2) only: AQN writes whole-shape noise into the norm weights and
        the rollout reads the full policy, neither of which knows about FSDP's sharded (DTensor) parameters or
        ZeRO-3's partitioned ones. Raised at construction, whether accelerate will shard the model (FSDP config) or
        the model arrives already sharded."""
        from torch.distributed.tensor import DTensor

        sharded = any(isinstance(p, DTensor) for p in self.model.parameters())
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None) if self.is_deepspeed_enabled else None
        if plugin is not None and getattr(plugin, "zero_stage", 0) == 3:
            # ZeRO-3 leaves each rank an empty local norm weight: the noise would silently add nothing
            raise ValueError("QeRL (QeRLGRPOTrainer: AQN in the norm weights) does not support DeepSpeed ZeRO-3 "
                             "(partitioned parameters); use ZeRO-2 or DDP: `accelerate launch --config_file "
                             "examples/accelerate/ddp.yaml ...`")
        if self.is_fsdp_enabled or sharded:
            raise ValueError(
                "QeRL (QeRLGRPOTrainer: NVFP4 + LoRA + AQN) does not support FSDP/FSDP2"
                f"{' (the model has sharded DTensor parameters)' if sharded else ' (accelerate FSDP config)'}; "
                "use DDP: `accelerate launch --config_file examples/accelerate/ddp.yaml ...`. The NVFP4 + LoRA "
                "model itself trains under FSDP2 (e.g. with transformers.Trainer), see examples/accelerate.")

    # ----------------------------------------------------------------- schedule
    def aqn_sigma(self, step: int | None = None) -> tuple[int, float]:
        """(stage, sigma) for an optimizer step (default: the current one)."""
        if self.aqn is None:
            return 0, 0.0
        step = self.state.global_step if step is None else step
        total = self.state.max_steps
        stage = self.aqn_schedule.stage(step, total)
        return stage, self.aqn_schedule.stage_sigma(stage)

    def _warn_unvisited_stages(self) -> None:
        """Noise is drawn once per generation batch, at its optimizer step's stage: a run with fewer generations than
        stages (or stages shorter than the steps one generation serves) never samples some of them; say which."""
        self._aqn_stages_checked = True
        total, ga = self.state.max_steps, self.args.gradient_accumulation_steps
        every = self.args.steps_per_generation * self.num_iterations  # micro-batches per generation (TRL's cadence)
        starts = range(0, total * ga, every)  # the micro-batches that generate
        seen = {self.aqn_schedule.stage(micro // ga, total) for micro in starts}
        missed = sorted(set(range(self.aqn_schedule.num_stages + 1)) - seen)
        if missed:
            warnings.warn(
                f"AQN: {len(starts)} generation batches over max_steps={total} sample stages "
                f"{sorted(seen)} of 0..{self.aqn_schedule.num_stages}; stages {missed} (sigma "
                f"{', '.join(f'{self.aqn_schedule.stage_sigma(k):.3g}' for k in missed)}) are never used. Lower "
                "aqn_num_stages or steps_per_generation, or train for more steps.", stacklevel=3)

    def _hfq_rollout_enabled(self) -> bool:
        return self.args.use_hfq_rollout and not self.use_vllm and next(self.model.parameters()).is_cuda

    # ----------------------------------------------------------------- TRL extension points
    def _generate_and_score_completions(self, inputs):
        if self.aqn is None or not self.model.training:
            return super()._generate_and_score_completions(inputs)
        if not self._aqn_stages_checked:
            self._warn_unvisited_stages()
        step = self.state.global_step
        stage, sigma = self.aqn_sigma(step)
        self._aqn_now = (step, sigma)
        try:
            out = super()._generate_and_score_completions(inputs)
        finally:
            self._aqn_now = None
        if self.args.aqn_scope == "rollout_and_old_logprobs" and sigma > 0:
            out["old_per_token_logps"] = self._noisy_old_logps(out, step, sigma)
        m = self._metrics["train"]
        m["aqn/sigma"].append(sigma)
        m["aqn/stage"].append(float(stage))
        m["aqn/applied_std"].append(self.aqn.last_applied_std)
        return out

    def _generate(self, prompts):
        if self._aqn_now is None:
            return super()._generate(prompts)
        step, sigma = self._aqn_now
        with self.aqn.noisy(step, sigma):
            if self.use_vllm:  # make TRL push the freshly perturbed norms to vLLM
                self._last_loaded_step = -1
            return super()._generate(prompts)

    def _generate_single_turn(self, *args, **kwargs):
        if not self._hfq_rollout_enabled():  # TRL's own path, without the mixin's fallback warning
            return GRPOTrainer._generate_single_turn(self, *args, **kwargs)
        return super()._generate_single_turn(*args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Trainer's save; a final save (`trainer.save_model(dir)`) also writes hfq's QeRL card there, in place of the
        empty template PEFT puts in every adapter folder, so `hfq push dir` uploads a card that loads the policy."""
        super().save_model(output_dir, _internal_call)
        if not _internal_call and self.is_world_process_zero():
            card = self._hfq_card()
            if card is not None:
                card.save(os.path.join(output_dir or self.args.output_dir, "README.md"))

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: str | list[str] | None = None, **kwargs):
        """hfq's QeRL adapter card (base model, NVFP4 format, LoRA and AQN settings, last reward) in
        `output_dir/README.md` instead of TRL's generic card, so `push_to_hub()` uploads it."""
        if not self.is_world_process_zero():
            return
        card = self._hfq_card(dataset_name=dataset_name, license=kwargs.get("license"))
        if card is None:  # neither an adapter nor hfq-quantized: TRL's card describes it
            return super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if tags:
            card.data.tags = list(dict.fromkeys(card.data.tags + ([tags] if isinstance(tags, str) else list(tags))))
        os.makedirs(self.args.output_dir, exist_ok=True)
        card.save(os.path.join(self.args.output_dir, "README.md"))

    def _hfq_card(self, **kw):
        """hfq's card of this trainer's model (hfq.hub.trainer_card), or None when the model is neither a PEFT
        adapter nor hfq-quantized."""
        from ..hub import detect_kind, trainer_card

        try:
            detect_kind(self.accelerator.unwrap_model(self.model))
        except ValueError:
            return None
        return trainer_card(self, **kw)

    # ----------------------------------------------------------------- helpers
    def _noisy_old_logps(self, out, step: int, sigma: float) -> torch.Tensor:
        """Old-policy log-probs of the batch under the noise that generated it (text-only models)."""
        from trl.models.utils import disable_gradient_checkpointing

        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs), \
                self.aqn.noisy(step, sigma):
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model, ids, mask, out["completion_ids"].size(1),
                batch_size=self.args.per_device_train_batch_size)
        return logps


def _check_columns(dataset, reward_funcs) -> None:
    """Before any rollout: the columns GRPO and hfq's accuracy reward read (TRL would fail after the first
    generation, deep in its code)."""
    from .rewards import accuracy_reward

    cols = getattr(dataset, "column_names", None)
    if not cols:  # an iterable dataset, or none given: TRL checks what it can
        return
    if "prompt" not in cols:
        raise ValueError(f"train_dataset has no 'prompt' column (columns: {cols}); GRPO samples completions of it")
    funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    golds = ("answer", "solution", "ground_truth", "target")
    if any(f is accuracy_reward for f in funcs) and not any(c in cols for c in golds):
        raise ValueError(f"accuracy_reward needs a reference column named one of {golds}; train_dataset has {cols}")
