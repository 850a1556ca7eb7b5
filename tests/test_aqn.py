"""AQN: schedules equal their formulas, noise statistics, bit-exact restore, seeding, norm resolution."""
import math

import pytest
import torch

from hfq.qerl.aqn import AQNSchedule, AdaptiveQuantizationNoise, resolve_norms
from hfq.tiny import tiny_model


def test_exponential_schedule_is_eq8():
    s = AQNSchedule(1e-2, 5e-4, 10, "exponential")
    assert s.stage_sigma(0) == 0.0
    for k in range(1, 11):
        assert s.stage_sigma(k) == pytest.approx(1e-2 * (5e-4 / 1e-2) ** ((k - 1) / 9), rel=1e-12)
    assert s.stage_sigma(1) == pytest.approx(1e-2) and s.stage_sigma(10) == pytest.approx(5e-4)


@pytest.mark.parametrize("kind", ["linear", "cosine", "logarithmic"])
def test_other_schedules_formulas_and_monotone(kind):
    s0, s1, K = 2e-2, 1e-3, 7
    s = AQNSchedule(s0, s1, K, kind)
    vals = [s.stage_sigma(k) for k in range(1, K + 1)]
    for k, v in zip(range(1, K + 1), vals):
        t = (k - 1) / (K - 1)
        expect = {"linear": s0 + (s1 - s0) * t,
                  "cosine": s1 + (s0 - s1) * 0.5 * (1 + math.cos(math.pi * t)),
                  "logarithmic": s0 + (s1 - s0) * math.log1p((K - 1) * t) / math.log(K)}[kind]
        assert v == pytest.approx(expect, rel=1e-12)
    assert vals[0] == pytest.approx(s0) and vals[-1] == pytest.approx(s1)
    assert all(a > b for a, b in zip(vals, vals[1:]))


def test_stages_spread_evenly_over_steps():
    s = AQNSchedule(1e-2, 5e-4, 10)
    total = 110  # K + 1 = 11 intervals of 10 steps
    stages = [s.stage(step, total) for step in range(total)]
    assert stages[:10] == [0] * 10 and stages[10] == 1 and stages[-1] == 10
    assert all(stages.count(k) == 10 for k in range(11))
    assert s.sigma(5, total) == 0.0 and s.sigma(109, total) == pytest.approx(5e-4)
    assert s.stage(500, total) == 10  # clamped past the end


@pytest.mark.parametrize("kw, field", [
    (dict(sigma_start=-1e-2), "sigma_start"), (dict(sigma_end=-1.0), "sigma_end"),
    (dict(sigma_start=1e-3, sigma_end=1e-2), "sigma_end"), (dict(num_stages=1), "num_stages"),
    (dict(kind="gaussian"), "kind"), (dict(sigma_start=float("nan")), "sigma_start"),
])
def test_bad_schedule_raises_naming_field(kw, field):
    with pytest.raises(ValueError, match=field.replace("kind", "schedule kind")):
        AQNSchedule(**kw)


def test_bad_steps_raise():
    s = AQNSchedule()
    with pytest.raises(ValueError, match="total_steps"):
        s.stage(0, 0)
    with pytest.raises(ValueError, match="stage"):
        s.stage_sigma(11)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama", "mistral"])
def test_norms_resolved_per_arch(arch):
    m = tiny_model(arch, layers=3)
    names = [n for n, _ in resolve_norms(m)]
    assert len(names) == 6
    for i in range(3):
        assert f"model.layers.{i}.input_layernorm" in names
        assert f"model.layers.{i}.post_attention_layernorm" in names
    assert not any("q_norm" in n or n == "model.norm" for n in names)  # Qwen3's q/k norms and the final norm


def test_norm_names_configurable_and_missing_norms_listed():
    m = tiny_model("llama")
    assert len(resolve_norms(m, ["input_layernorm"])) == 2
    with pytest.raises(ValueError, match=r"no norm named \['ln_1'\].*input_layernorm \(LlamaRMSNorm\)"):
        resolve_norms(m, ["ln_1"])
    with pytest.raises(ValueError, match="norm-like modules present: none"):
        resolve_norms(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_norms_found_through_peft_wrapper():
    from peft import LoraConfig, get_peft_model

    m = get_peft_model(tiny_model("qwen2"), LoraConfig(r=2, target_modules=["q_proj"]))
    assert len(resolve_norms(m)) == 4


def test_noise_statistics_mean_zero_std_sigma():
    m = tiny_model("qwen2", hidden=128)
    aqn = AdaptiveQuantizationNoise(m, seed=3)
    sigma = 7e-3
    z = torch.cat([v for step in range(40) for v in aqn.sample(step, sigma)])
    assert z.numel() == 40 * 4 * 128
    assert abs(z.mean().item()) < 4 * sigma / math.sqrt(z.numel())
    assert z.std().item() == pytest.approx(sigma, rel=0.03)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_restore_bit_exact(dtype):
    m = tiny_model("qwen2", dtype=dtype)
    with torch.no_grad():  # non-trivial clean weights (not all ones)
        for _, mod in resolve_norms(m):
            mod.weight.add_(torch.randn_like(mod.weight) * 0.1)
    aqn = AdaptiveQuantizationNoise(m, seed=0)
    clean = [mod.weight.detach().clone() for _, mod in aqn.targets]
    other = {n: p.detach().clone() for n, p in m.named_parameters() if "layernorm" not in n}
    with aqn.noisy(step=4, sigma=0.05):
        for (_, mod), c in zip(aqn.targets, clean):
            assert not torch.equal(mod.weight, c)
    for (_, mod), c in zip(aqn.targets, clean):
        assert torch.equal(mod.weight, c)
    assert all(torch.equal(p, other[n]) for n, p in m.named_parameters() if n in other)
    with pytest.raises(RuntimeError):  # restored even when the body raises
        with aqn.noisy(1, 0.05):
            raise RuntimeError("boom")
    assert all(torch.equal(mod.weight, c) for (_, mod), c in zip(aqn.targets, clean))


def test_noise_reproducible_per_seed_and_step():
    m = tiny_model("qwen2")
    a, b = AdaptiveQuantizationNoise(m, seed=11), AdaptiveQuantizationNoise(m, seed=11)
    za, zb = a.sample(5, 1e-2), b.sample(5, 1e-2)
    assert all(torch.equal(x, y) for x, y in zip(za, zb))
    assert not torch.equal(a.sample(6, 1e-2)[0], za[0])
    assert not torch.equal(AdaptiveQuantizationNoise(m, seed=12).sample(5, 1e-2)[0], za[0])
    assert not torch.equal(za[0], za[1])  # one independent vector per norm


def test_bf16_applied_std_reports_rounding():
    m = tiny_model("qwen2", dtype=torch.bfloat16)  # norm weights = 1.0: bf16 spacing 2^-7 swallows tiny noise
    aqn = AdaptiveQuantizationNoise(m, seed=0)
    with pytest.warns(UserWarning, match="rounds most of it away"), aqn.noisy(0, 5e-4):  # said once
        assert aqn.last_applied_std < 2.5e-4
    with aqn.noisy(0, 5e-2):
        assert aqn.last_applied_std == pytest.approx(5e-2, rel=0.15)


def test_norm_names_of_gemma_and_a_warning_for_unknown_model_types():
    """Gemma 2/3 put post_attention_layernorm on the attention output: AQN takes pre_feedforward_layernorm there; a
    model_type hfq does not know gets the defaults with a warning naming aqn_norm_names."""
    from hfq.qerl.aqn import NORM_NAMES, resolve_norms
    from hfq.tiny import tiny_model

    assert NORM_NAMES["gemma2"] == NORM_NAMES["gemma3_text"] == ("input_layernorm", "pre_feedforward_layernorm")
    m = tiny_model("llama")
    m.config.model_type = "granite"
    with pytest.warns(UserWarning, match=r"model_type 'granite' is not one .*perturbing \['input_layernorm', "
                                         r"'post_attention_layernorm'\].*aqn_norm_names"):
        resolve_norms(m)


def test_post_norm_blocks_refused_and_names_that_match_nothing_said():
    """OLMo-2 norms the attention and MLP outputs only: the defaults used to perturb its post_attention_layernorm
    (the attention output's scale, no linear's input) under a warning naming an input_layernorm it lacks."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("olmo2", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=64)
    m = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="model_type 'olmo2' norms the outputs .*aqn=False"):
        resolve_norms(m)
    with pytest.warns(UserWarning, match=r"no module is named \['input_layernorm'\]; only "
                                         r"\['post_attention_layernorm'\] are perturbed"):
        assert len(resolve_norms(m, ["input_layernorm", "post_attention_layernorm"])) == 2
