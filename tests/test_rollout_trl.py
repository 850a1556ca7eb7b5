"""RolloutMixin inside TRL's GRPOTrainer (real TRL, tiny model, CPU)."""
from dataclasses import dataclass

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from hfq.rollout import RolloutMixin
from hfq.rollout.mixin import RolloutArguments
from hfq.tiny import char_tokenizer, tiny_model


class Trainer(RolloutMixin, GRPOTrainer):
    pass


def reward_len(completions, **kw):
    return [float(len(c)) for c in completions]


@dataclass
class RolloutGRPOConfig(RolloutArguments, GRPOConfig):
    pass


def make(tmp_path, config_cls=GRPOConfig, **cfg_kw):
    tok = char_tokenizer()
    model = tiny_model("qwen2", seed=0, vocab=len(tok))
    ds = Dataset.from_dict({"prompt": ["12+3=", "hello ", "abc", "7*8="] * 2})
    cfg_kw = {"max_completion_length": 10, **cfg_kw}
    args = config_cls(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_steps=1,
                      report_to=[], logging_steps=1, save_strategy="no", use_cpu=True, bf16=False, seed=3, **cfg_kw)
    return Trainer(model=model, reward_funcs=reward_len, args=args, train_dataset=ds, processing_class=tok)


def test_mixin_generates_with_engine_and_trains(tmp_path):
    trainer = make(tmp_path)
    tok = trainer.processing_class
    prompt_ids = [tok("12+3=")["input_ids"], tok("hi")["input_ids"]] * 2
    torch.manual_seed(0)
    ids, lps = trainer._generate_single_turn(prompt_ids, None, {}, num_generations=2)
    assert trainer._hfq_engine is not None
    assert lps is None  # as TRL's own generate: no sampling log-probs for off_policy_mask_threshold to misread
    with_lp = make(tmp_path, RolloutGRPOConfig, rollout_return_logprobs=True)
    torch.manual_seed(0)
    ids2, lps = with_lp._generate_single_turn(prompt_ids, None, {}, num_generations=2)
    assert ids2 == ids and len(lps) == 4  # the same model and seed: the same samples, now with log-probs
    eos = set(trainer.eos_token_ids)
    for c, lp in zip(ids, lps):
        assert 1 <= len(c) <= 10 and len(lp) == len(c)
        assert all(t not in eos for t in c[:-1])  # cut after the first EOS, as TRL's own path does
        assert all(x <= 0 for x in lp)
    torch.manual_seed(0)
    again, _ = trainer._generate_single_turn(prompt_ids, None, {}, num_generations=2)
    assert again == ids  # seeds follow TRL's torch seed
    # weights changed in place (like an optimizer step) are seen by the next call
    before = trainer.model.model.layers[0].mlp.down_proj.weight.detach().clone()
    trainer.train()
    assert not torch.equal(before, trainer.model.model.layers[0].mlp.down_proj.weight)
    assert trainer.state.global_step == 1
    assert any("reward" in k for h in trainer.state.log_history for k in h)


def test_model_generation_config_is_honoured(tmp_path):
    """The engine samples with what model.generate would: TRL's settings completed by the model's generation_config
    (top_k=None -> the model's top_k); a logits processor it has not got sends the call to TRL, warning."""
    trainer = make(tmp_path, top_k=None)
    tok = trainer.processing_class
    trainer.model.generation_config.top_k = 1  # top-k 1 sampling is greedy: every row the same
    ids, _ = trainer._generate_single_turn([tok("12+3=")["input_ids"]] * 4, None, {}, num_generations=4)
    assert trainer._hfq_engine is not None and all(c == ids[0] for c in ids)
    trainer.model.generation_config.top_k = None
    trainer.model.generation_config.suppress_tokens = [tok("7")["input_ids"][-1]]
    with pytest.warns(UserWarning, match="suppress_tokens"):
        trainer._generate_single_turn([tok("ab")["input_ids"]] * 2, None, {}, num_generations=2)


def test_rollout_max_seq_len_is_a_cap(tmp_path):
    trainer = make(tmp_path, RolloutGRPOConfig, rollout_max_seq_len=8)
    tok = trainer.processing_class
    with pytest.warns(UserWarning, match="rollout_max_seq_len=8"):  # prompt 2 + 10 new tokens > 8
        ids, _ = trainer._generate_single_turn([tok("ab")["input_ids"]] * 2, None, {}, num_generations=2)
    assert trainer._hfq_engine is None and len(ids) == 2


def test_mixin_falls_back_with_warning(tmp_path):
    trainer = make(tmp_path, repetition_penalty=1.2)
    tok = trainer.processing_class
    with pytest.warns(UserWarning, match="repetition_penalty"):
        ids, lps = trainer._generate_single_turn([tok("ab")["input_ids"]] * 2, None, {}, num_generations=2)
    assert trainer._hfq_engine is None and lps is None and len(ids) == 2


def test_declared_settings_reach_the_engine(tmp_path):
    trainer = make(tmp_path, RolloutGRPOConfig, rollout_max_batch=3, rollout_max_seq_len=64)
    tok = trainer.processing_class
    trainer._generate_single_turn([tok("ab")["input_ids"]] * 2, None, {}, num_generations=2)
    assert (trainer._hfq_engine.max_batch, trainer._hfq_engine.max_seq_len) == (3, 64)
    with pytest.raises(ValueError, match="rollout_max_batch"):
        make(tmp_path, RolloutGRPOConfig, rollout_max_batch=-2)
    off = make(tmp_path, RolloutGRPOConfig, use_hfq_rollout=False)
    with pytest.warns(UserWarning, match="use_hfq_rollout=False"):
        ids, _ = off._generate_single_turn([tok("ab")["input_ids"]] * 2, None, {}, num_generations=2)
    assert off._hfq_engine is None and len(ids) == 2


def test_eos_and_length_settings_trl_reads_otherwise_go_to_trl(tmp_path):
    """Audit 18e: (1) generation_kwargs={"eos_token_id": X} with X outside TRL's eos_token_ids: the engine stopped and
    cut at X only, where TRL's generate stops at X but cuts completions at its eos ids, so completions ran past the
    tokenizer's EOS and ones TRL calls finished came back 'truncated' (all masked under mask_truncated_completions);
    such a call now goes to TRL, warning. (2) max_completion_length=None crashed with a bare TypeError, (3) more than
    16 EOS ids with the engine's ValueError: both go to TRL too."""
    tok = char_tokenizer()
    x = tok(".")["input_ids"][-1]
    trainer = make(tmp_path, generation_kwargs={"eos_token_id": x})
    assert x not in trainer.eos_token_ids
    with pytest.warns(UserWarning, match=rf"eos_token_id \[{x}\] beyond the EOS ids TRL ends completions at"):
        ids, _ = trainer._generate_single_turn([tok("ab")["input_ids"]] * 2, None, {}, num_generations=2)
    assert trainer._hfq_engine is None and len(ids) == 2
    same = make(tmp_path, generation_kwargs={"eos_token_id": trainer.eos_token_ids[0]})  # TRL's own: the engine runs
    same._generate_single_turn([tok("ab")["input_ids"]] * 2, None, {}, num_generations=2)
    assert same._hfq_engine is not None
    many = make(tmp_path)
    many.eos_token_ids = [*many.eos_token_ids, *range(40, 56)]  # 17 (TRL's: the tokenizer's, the model's)
    with pytest.warns(UserWarning, match=r"17 EOS ids \(the engine stops on at most 16\)"):
        many._generate_single_turn([tok("ab")["input_ids"]] * 2, None, {}, num_generations=2)
    unbounded = make(tmp_path, max_completion_length=None)
    with pytest.warns(UserWarning, match=r"max_completion_length=None"):
        ids, _ = unbounded._generate_single_turn([tok("ab")["input_ids"]] * 2, None, {}, num_generations=2)
    assert unbounded._hfq_engine is None and len(ids) == 2


def test_cast_lm_head_to_fp32_with_tied_embeddings(tmp_path):
    """GRPOConfig(cast_lm_head_to_fp32=True) on a bf16 model with tied embeddings (Qwen2.5-0.5B..3B, Llama-3.2): TRL
    makes the shared weight fp32 and casts the embedding's output back to bf16; the engine took its KV cache dtype
    from the embedding weight (fp32) and failed on the first rollout (index_copy_ dtype mismatch)."""
    tok = char_tokenizer()
    model = tiny_model("qwen2", seed=0, vocab=len(tok), dtype=torch.bfloat16, tie_word_embeddings=True)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, max_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                      cast_lm_head_to_fp32=True, seed=3)
    trainer = Trainer(model=model, reward_funcs=reward_len, args=args, processing_class=tok,
                      train_dataset=Dataset.from_dict({"prompt": ["12+3=", "hello "] * 2}))
    assert trainer.model.lm_head.weight.dtype == torch.float32
    ids, _ = trainer._generate_single_turn([tok("ab")["input_ids"]] * 2, None, {}, num_generations=2)
    assert trainer._hfq_engine is not None and trainer._hfq_engine.dtype == torch.bfloat16 and len(ids) == 2
