"""QeRLGRPOTrainer with the real TRL on a tiny NVFP4 + LoRA model: noise present exactly while sampling."""
import pytest
import torch
from datasets import Dataset

import hfq  # noqa: F401
from hfq.qerl import QeRLConfig, QeRLGRPOTrainer
from hfq.qerl.data import make_dataset
from hfq.qerl.rewards import accuracy_reward, format_reward


def _policy(path):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hfq.nvfp4 import NVFP4Config, NVFP4Linear, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=NVFP4Config(), dtype=torch.float32)
    assert isinstance(model.model.layers[0].self_attn.q_proj, NVFP4Linear)
    with torch.no_grad():  # distinct, non-trivial clean norm weights
        g = torch.Generator().manual_seed(0)
        for n, p in model.named_parameters():
            if "layernorm" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    lcfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"], task_type="CAUSAL_LM")
    return get_peft_model(model, lcfg), AutoTokenizer.from_pretrained(path)


def _config(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), learning_rate=1e-3, num_generations=4, per_device_train_batch_size=8,
                max_completion_length=10, max_steps=3, logging_steps=1, save_strategy="no", report_to="none",
                bf16=False, gradient_checkpointing=False, use_cpu=True, aqn_num_stages=2, aqn_sigma_start=2e-2,
                aqn_sigma_end=5e-3)
    base.update(kw)
    return QeRLConfig(**base)


def digit_reward(completions, **kwargs):
    """A dense reward (the random tiny policy never earns the math rewards), so GRPO has a gradient."""
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def _dataset():
    return Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in make_dataset(24, seed=5)])


@pytest.mark.parametrize("scope", ["rollout", "rollout_and_old_logprobs"])
def test_three_step_run_noise_only_while_sampling(tiny_dir, tmp_path, scope):
    model, tok = _policy(tiny_dir)
    trainer = QeRLGRPOTrainer(model=model, reward_funcs=[accuracy_reward, format_reward, digit_reward],
                              args=_config(tmp_path, aqn_scope=scope), train_dataset=_dataset(), processing_class=tok)
    targets = trainer.aqn.targets
    assert len(targets) == 4  # 2 blocks x (input, post-attention) norms
    clean = {n: m.weight.detach().clone() for n, m in targets}
    seen = []  # (step, grad enabled, in generate, name, weight as the forward saw it)
    in_gen = {"on": False}
    orig_generate = model.generate

    def generate(*a, **k):
        in_gen["on"] = True
        try:
            return orig_generate(*a, **k)
        finally:
            in_gen["on"] = False

    model.generate = generate  # observe which forwards belong to sampling (the real generate still runs)
    for name, mod in targets:
        mod.register_forward_pre_hook(lambda m, a, name=name: seen.append(
            (trainer.state.global_step, torch.is_grad_enabled(), in_gen["on"], name, m.weight.detach().clone())))
    trainer.train()

    sigmas = {h["step"] - 1: h["aqn/sigma"] for h in trainer.state.log_history if "aqn/sigma" in h}
    assert sigmas == {0: 0.0, 1: 2e-2, 2: 5e-3}  # stage 0, then Eq. 8 from start to end
    gen = [s for s in seen if s[2]]
    assert {s[0] for s in gen} == {0, 1, 2} and all(not s[1] for s in gen)
    for step, _, _, name, w in gen:
        d = w - clean[name]
        if sigmas[step] == 0:
            assert torch.equal(w, clean[name])
        else:  # every targeted norm is perturbed during sampling, with the scheduled std
            assert (d != 0).all(), f"{name} not perturbed at step {step}"
            assert d.std().item() == pytest.approx(sigmas[step], rel=0.45)
    # the update always sees clean norms
    assert all(torch.equal(w, clean[n]) for _, grad, g, n, w in seen if grad)
    noisy_scoring = [s for s in seen if not s[1] and not s[2] and not torch.equal(s[4], clean[s[3]])]
    if scope == "rollout":  # old log-probs (if any) are clean
        assert noisy_scoring == []
    else:  # old log-probs are recomputed under the very noise that generated the batch
        assert {s[0] for s in noisy_scoring} == {1, 2}
        for step, _, _, name, w in noisy_scoring:
            same_gen = [g[4] for g in gen if g[0] == step and g[3] == name]
            assert torch.equal(w, same_gen[0])
    for name, mod in targets:  # restored bit-exactly afterwards
        assert torch.equal(mod.weight, clean[name])
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert any(p.abs().sum() > 0 for p in lora_b)  # LoRA was trained
    h = [x for x in trainer.state.log_history if "entropy" in x]
    assert len(h) == 3 and all(x["entropy"] > 0 for x in h) and all("aqn/stage" in x for x in h)


def test_no_aqn_and_bad_args(tiny_dir, tmp_path):
    from trl import GRPOConfig

    model, tok = _policy(tiny_dir)
    with pytest.raises(ValueError, match="QeRLConfig"):
        QeRLGRPOTrainer(model=model, reward_funcs=[format_reward], args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False),
                        train_dataset=_dataset(), processing_class=tok)
    trainer = QeRLGRPOTrainer(model=model, reward_funcs=[format_reward], args=_config(tmp_path, aqn=False, max_steps=1),
                              train_dataset=_dataset(), processing_class=tok)
    assert trainer.aqn is None
    trainer.train()
    assert trainer.aqn_sigma() == (0, 0.0)


def test_unrecognised_norms_error(tiny_dir, tmp_path):
    model, tok = _policy(tiny_dir)
    with pytest.raises(ValueError, match="no norm named.*input_layernorm"):
        QeRLGRPOTrainer(model=model, reward_funcs=[format_reward], args=_config(tmp_path, aqn_norm_names=["ln_x"]),
                        train_dataset=_dataset(), processing_class=tok)


@pytest.mark.parametrize("kw, field", [
    (dict(aqn_sigma_start=-0.1), "aqn_sigma_start"), (dict(aqn_sigma_end=0.5), "aqn_sigma_end"),
    (dict(aqn_num_stages=1), "aqn_num_stages"), (dict(aqn_schedule="step"), "aqn_schedule"),
    (dict(aqn_sigma_start=True), "aqn_sigma_start"), (dict(aqn_num_stages=True), "aqn_num_stages"),
    (dict(aqn_seed="abc"), "aqn_seed"), (dict(aqn_seed=1.5), "aqn_seed"),
    (dict(aqn_scope="everywhere"), "aqn_scope"), (dict(aqn_norm_names=[]), "aqn_norm_names"),
    (dict(rollout_max_batch=0), "rollout_max_batch"), (dict(rollout_max_seq_len=1), "rollout_max_seq_len"),
    (dict(rollout_gpu_memory_utilization=1.5), "rollout_gpu_memory_utilization"),
    (dict(rollout_kv_cache_gb=-1.0), "rollout_kv_cache_gb"), (dict(rollout_graph_mode="always"), "rollout_graph_mode"),
    (dict(use_hfq_rollout="yes"), "use_hfq_rollout"), (dict(rollout_return_logprobs=None), "rollout_return_logprobs"),
])
def test_config_validation(tmp_path, kw, field):
    with pytest.raises(ValueError, match=field):
        QeRLConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **kw)


def test_paper_preset(tmp_path):
    c = QeRLConfig.paper_preset("gsm8k", output_dir=str(tmp_path), use_cpu=True, bf16=False)
    assert (c.learning_rate, c.epsilon, c.epsilon_high, c.temperature, c.beta) == (1e-5, 0.2, 0.28, 1.0, 0.0)
    assert (c.loss_type, c.num_generations, c.max_completion_length) == ("grpo", 8, 4096)
    assert (c.aqn_sigma_start, c.aqn_sigma_end, c.aqn_num_stages, c.aqn_schedule) == (1e-2, 5e-4, 10, "exponential")
    d = QeRLConfig.paper_preset("bigmath", output_dir=str(tmp_path), use_cpu=True, bf16=False, learning_rate=2e-5)
    assert (d.loss_type, d.num_generations, d.learning_rate) == ("dapo", 16, 2e-5)
    with pytest.raises(ValueError, match="task"):
        QeRLConfig.paper_preset("math500")


def test_rollout_settings_are_declared_fields(tmp_path):
    """The engine's settings are QeRLConfig fields (parsed from the command line), with one on/off switch."""
    from transformers import HfArgumentParser

    fields = QeRLConfig.__dataclass_fields__
    assert {"use_hfq_rollout", "rollout_max_batch", "rollout_max_seq_len", "rollout_gpu_memory_utilization",
            "rollout_kv_cache_gb", "rollout_graph_mode", "rollout_return_logprobs"} <= set(fields)
    assert "rollout_engine" not in fields
    (cfg,) = HfArgumentParser(QeRLConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false", "--rollout_max_batch", "12",
         "--rollout_graph_mode", "eager", "--use_hfq_rollout", "false"])
    assert (cfg.rollout_max_batch, cfg.rollout_graph_mode, cfg.use_hfq_rollout) == (12, "eager", False)


def test_resume_from_checkpoint_continues_the_noise_schedule_exactly(tiny_dir, tmp_path):
    """TRL's `peft_config` route, 4 steps in one go vs stopped after checkpoint-2 and resumed in a new trainer on a
    freshly loaded base: same losses, rewards and AQN sigmas per step, identical adapters (AQN's noise is a function
    of (seed, step), the stage of the restored global_step)."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from hfq.nvfp4 import NVFP4Config

    class StopAfterSave(TrainerCallback):
        def on_save(self, args, state, control, **kw):
            control.should_training_stop = True

    def run(out, stop=False, resume=None):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=NVFP4Config(), dtype=torch.float32)
        lcfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], task_type="CAUSAL_LM")
        args = _config(tmp_path, output_dir=str(out), learning_rate=1e-2, max_steps=4, save_strategy="steps",
                       save_steps=2, aqn_num_stages=3, seed=3, max_completion_length=8)
        tr = QeRLGRPOTrainer(model=model, reward_funcs=[digit_reward], args=args, train_dataset=_dataset(),
                             processing_class=AutoTokenizer.from_pretrained(tiny_dir), peft_config=lcfg)
        if stop:
            tr.add_callback(StopAfterSave())
        tr.train(resume_from_checkpoint=resume)
        rows = [(h["step"], h["loss"], h["reward"], h["aqn/sigma"]) for h in tr.state.log_history if "loss" in h]
        return rows, {n: p.detach().clone() for n, p in tr.model.named_parameters() if "lora_" in n}

    full, lora_full = run(tmp_path / "a")
    first, _ = run(tmp_path / "b", stop=True)
    rest, lora_resumed = run(tmp_path / "b", resume=str(tmp_path / "b" / "checkpoint-2"))
    assert first == full[:2]
    assert rest == full and [r[0] for r in full] == [1, 2, 3, 4]  # the resumed trainer's history starts from the checkpoint's
    assert [r[3] for r in full] == [0.0, 2e-2, pytest.approx(1e-2), 5e-3]  # all four stages were crossed
    assert lora_full.keys() == lora_resumed.keys() and len(lora_full) == 12
    assert any(p.abs().sum() > 0 for n, p in lora_full.items() if "lora_B" in n)
    assert all(torch.equal(lora_full[n], lora_resumed[n]) for n in lora_full)


def test_dataset_columns_are_checked_before_any_rollout(tiny_dir, tmp_path):
    model, tok = _policy(tiny_dir)
    no_prompt = Dataset.from_list([{"question": "1+1?", "answer": "2"}] * 8)
    with pytest.raises(ValueError, match="no 'prompt' column"):
        QeRLGRPOTrainer(model=model, reward_funcs=[digit_reward], args=_config(tmp_path), train_dataset=no_prompt,
                        processing_class=tok)
    no_answer = Dataset.from_list([{"prompt": "1+1?"}] * 8)
    with pytest.raises(ValueError, match="accuracy_reward needs a reference column"):
        QeRLGRPOTrainer(model=model, reward_funcs=[accuracy_reward], args=_config(tmp_path), train_dataset=no_answer,
                        processing_class=tok)
    # GRPOTrainer's positional order (model, reward_funcs, args, train_dataset, ...), the check included
    with pytest.raises(ValueError, match="no 'prompt' column"):
        QeRLGRPOTrainer(model, [digit_reward], _config(tmp_path), no_prompt, None, tok)
    trainer = QeRLGRPOTrainer(model, [digit_reward], _config(tmp_path), _dataset(), None, tok)
    assert len(trainer.train_dataset) == 24 and trainer.processing_class is tok


def test_final_save_writes_hfq_card_for_any_output_dir_name(tiny_dir, tmp_path):
    """trainer.save_model(dir) puts hfq's card where PEFT wrote its empty template (what `hfq push dir` uploads); a
    run without AQN says so; an output_dir named like 'run--v2' (not a valid repo id) no longer stops the
    checkpoint's card."""
    from huggingface_hub import ModelCard

    from hfq import hub

    model, tok = _policy(tiny_dir)
    out = tmp_path / "run--v2"
    trainer = QeRLGRPOTrainer(model=model, reward_funcs=[digit_reward], train_dataset=_dataset(), processing_class=tok,
                              args=_config(tmp_path, output_dir=str(out), max_steps=1, save_strategy="steps",
                                           save_steps=1, aqn=False))
    trainer.train()
    trainer.save_model(str(out / "final"))
    card = ModelCard.load(out / "final" / "README.md")
    assert "hfq" in card.data.tags and card.data.quantization["quant_method"] == "hfq_nvfp4"
    assert "without Adaptive\nQuantization Noise" in card.text and "aqn_sigma_start" not in card.text
    assert "quantization_config=hfq.NVFP4Config()" in card.text
    # README's `hfq push ./run/final me/qwen-qerl`: the card names the output_dir; the push names the target repo
    assert 'PeftModel.from_pretrained(base, "run-v2")' in card.text
    assert hub.retarget_card(str(out / "final" / "README.md"), "me/qwen-qerl")
    card = ModelCard.load(out / "final" / "README.md")
    assert 'PeftModel.from_pretrained(base, "me/qwen-qerl")' in card.text and '"run-v2"' not in card.text
    assert "\n# qwen-qerl\n" in card.text and "hfq" in card.data.tags


@pytest.mark.parametrize("max_steps, spg, missed, seen", [(2, 1, "[2]", [0, 1]), (3, 1, None, [0, 1, 2]),
                                                     (6, 4, "[1]", [0, 2])])
def test_unvisited_aqn_stages_are_announced(tiny_dir, tmp_path, max_steps, spg, missed, seen):
    """Noise is drawn per generation batch: a run whose generations skip stages (too few steps, or one generation
    serving a whole stage and more) says which; one that samples every stage says nothing."""
    import warnings

    model, tok = _policy(tiny_dir)
    args = _config(tmp_path, max_steps=max_steps, per_device_train_batch_size=4, steps_per_generation=spg)
    trainer = QeRLGRPOTrainer(model=model, reward_funcs=[digit_reward], train_dataset=_dataset(), processing_class=tok,
                              args=args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    msgs = [str(w.message) for w in caught if "AQN:" in str(w.message)]
    if missed is None:
        assert msgs == []
    else:
        assert len(msgs) == 1 and f"stages {missed} (sigma" in msgs[0] and "aqn_num_stages" in msgs[0]
    stages = [h["aqn/stage"] for h in trainer.state.log_history if "aqn/stage" in h]
    assert sorted(set(stages)) == seen
