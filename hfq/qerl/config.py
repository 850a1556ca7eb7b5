"""`QeRLConfig`: TRL's `GRPOConfig` plus the Adaptive Quantization Noise fields, and the paper's preset."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from trl import GRPOConfig

from ..rollout.mixin import RolloutArguments
from .aqn import SCHEDULES, SCOPES, AQNSchedule

_PRESETS = {
    # App. E, Tab. 6: GRPO on GSM8K (8 samples/prompt, 4 policy updates per rollout, 4096 tokens)
    "gsm8k": dict(loss_type="grpo", num_generations=8, per_device_train_batch_size=8, steps_per_generation=4,
                  max_completion_length=4096),
    # DAPO on BigMath (16 samples/prompt, on-policy, 8192 tokens)
    "bigmath": dict(loss_type="dapo", num_generations=16, per_device_train_batch_size=16, steps_per_generation=1,
                    max_completion_length=8192),
}


@dataclass
class QeRLConfig(RolloutArguments, GRPOConfig):
    """GRPOConfig + AQN + the rollout engine's settings. All TRL fields keep their meaning; the `aqn_*` fields
    control the noise, `use_hfq_rollout` / `rollout_*` the engine (`hfq.rollout.mixin.RolloutArguments`; the
    engine samples only on CUDA and without vLLM).

    `aqn_scope`: "rollout" (default, as public QeRL ports do) perturbs the norms only while sampling, so old
    log-probs and the update see the clean policy (parameter-space exploration); "rollout_and_old_logprobs"
    also computes the old-policy log-probs under the same noise, so the clipped importance ratio
    pi_clean / pi_noisy accounts for the perturbation.

    `bf16` left unset (None) means "where the device has it": True on a GPU with bf16 (TRL's default), False on a
    CPU-only machine or with `use_cpu` / `fp16`, so the same script runs on both; an explicit value is kept."""

    aqn: bool = field(default=True, metadata={"help": "Enable Adaptive Quantization Noise on the norms."})
    aqn_sigma_start: float = field(default=1e-2, metadata={"help": "Noise std of the first noisy stage."})
    aqn_sigma_end: float = field(default=5e-4, metadata={"help": "Noise std of the last stage."})
    aqn_num_stages: int = field(default=10, metadata={"help": "K noisy stages (after a noise-free stage 0)."})
    aqn_schedule: str = field(default="exponential", metadata={"help": f"One of {SCHEDULES}."})
    aqn_scope: str = field(default="rollout", metadata={"help": f"One of {SCOPES}."})
    aqn_seed: int | None = field(default=None, metadata={"help": "Noise seed (default: `seed`)."})
    aqn_norm_names: list[str] | None = field(
        default=None, metadata={"help": "Norm attribute names in a decoder block (default: by model_type)."})

    def __post_init__(self):
        if self.bf16 is None:
            from transformers.utils import is_torch_bf16_gpu_available

            self.bf16 = not self.fp16 and not self.use_cpu and is_torch_bf16_gpu_available()
        super().__post_init__()
        if self.aqn_scope not in SCOPES:
            raise ValueError(f"aqn_scope: unknown {self.aqn_scope!r}; allowed {SCOPES}")
        if self.aqn_norm_names is not None:
            if isinstance(self.aqn_norm_names, str):
                self.aqn_norm_names = [n.strip() for n in self.aqn_norm_names.split(",") if n.strip()]
            if not self.aqn_norm_names or not all(isinstance(n, str) and n for n in self.aqn_norm_names):
                raise ValueError(f"aqn_norm_names must be a non-empty list of names, got {self.aqn_norm_names!r}")
        if self.aqn_seed is not None and (isinstance(self.aqn_seed, bool) or not isinstance(self.aqn_seed, int)):
            raise ValueError(f"aqn_seed must be an int or None, got {self.aqn_seed!r}")
        self.aqn_schedule_obj  # validates sigma/K/kind, raising ValueError naming the field

    @property
    def aqn_schedule_obj(self) -> AQNSchedule:
        try:
            return AQNSchedule(self.aqn_sigma_start, self.aqn_sigma_end, self.aqn_num_stages, self.aqn_schedule)
        except ValueError as e:  # re-label with the config's field names
            msg = (str(e).replace("sigma_start", "aqn_sigma_start").replace("sigma_end", "aqn_sigma_end")
                   .replace("num_stages", "aqn_num_stages").replace("schedule kind", "aqn_schedule"))
            raise ValueError(msg) from None

    @classmethod
    def paper_preset(cls, task: str = "gsm8k", **overrides) -> "QeRLConfig":
        """App. E Tab. 6: lr 1e-5, clip 0.2/0.28, temperature 1.0, no KL, no entropy loss, noise 1e-2 -> 5e-4
        (exponential, K = 10); GRPO for GSM8K, DAPO loss for BigMath. Optimizer AdamW-8bit when bitsandbytes is
        installed, else AdamW. The per-device batch defaults to one prompt group; raise it (and gradient accumulation) toward the
        paper's 128 prompts per step as memory allows."""
        if task not in _PRESETS:
            raise ValueError(f"task: unknown {task!r}; allowed {tuple(_PRESETS)}")
        kw = dict(learning_rate=1e-5, epsilon=0.2, epsilon_high=0.28, temperature=1.0, beta=0.0, entropy_coef=0.0,
                  aqn=True, aqn_sigma_start=1e-2, aqn_sigma_end=5e-4, aqn_num_stages=10,
                  aqn_schedule="exponential",
                  optim="adamw_bnb_8bit" if importlib.util.find_spec("bitsandbytes") else "adamw_torch")
        kw.update(_PRESETS[task])
        kw.update(overrides)
        return cls(**kw)
