"""`hfq.qerl.entropy.sampling_entropy` (the QeRL Fig. 5 measurement) checked against hand computations.

Whether a 4-bit base raises the entropy is an experiment (`examples/qerl_entropy.py`, results in
`examples/results/qerl_entropy.md`), not asserted here: on small models its sign depends on the seed.
"""
import math

import pytest
import torch

from hfq.qerl.entropy import sampling_entropy
from hfq.tiny import char_tokenizer, tiny_model

PROMPTS = ["Q: 1+2?\nA: ", "Q: Tom has 7 pens and gets 5 more. How many pens now?\nA: ", "hi", "Q: 9-4?\nA: <think>"]


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matmuls: threads only add synchronisation (seconds per generate on a loaded 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _model(seed=0):
    m = tiny_model("qwen2", seed=seed, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)
    with torch.no_grad():
        m.lm_head.weight.mul_(25.0)  # peaked, position-dependent next-token distributions (random init is ~uniform)
    return m


def _entropies_one_by_one(model, tok, prompts, max_new_tokens, seed):
    """Hand computation: the same samples, then each row scored alone (no padding), entropy of the next-token
    distribution at each generated position up to and including its first EOS; mean over all those tokens."""
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    torch.manual_seed(seed)
    with torch.no_grad():
        seqs = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True, temperature=1.0, top_k=0,
                              top_p=1.0, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    P = enc.input_ids.shape[1]
    total, count, ended_early = 0.0, 0, 0
    for b, prompt in enumerate(prompts):
        p_ids = tok(prompt).input_ids
        gen = seqs[b, P:].tolist()
        assert seqs[b, P - len(p_ids):P].tolist() == p_ids  # left-padded: the prompt sits right before the gen
        n = gen.index(tok.eos_token_id) + 1 if tok.eos_token_id in gen else len(gen)
        ended_early += n < len(gen)
        ids = torch.tensor([p_ids + gen[:n]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(p_ids) - 1:len(p_ids) - 1 + n].double()
        p = torch.softmax(logits, -1)
        total += float(-(p * torch.log(p)).sum())
        count += n
    return total / count, ended_early


def test_uniform_policy_entropy_is_log_vocab():
    model, tok = _model(), char_tokenizer()
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every next-token distribution is uniform over the vocabulary
    h = sampling_entropy(model, tok, PROMPTS, max_new_tokens=6, seed=0)
    assert h == pytest.approx(math.log(model.config.vocab_size), abs=1e-5)


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_sampling_entropy_matches_hand_computation(padding_side):
    model, tok = _model(), char_tokenizer()
    # make EOS follow (a bit more peaked) the token the model samples most, so that some rows stop early and
    # others do not (the average must stop at each row's first EOS)
    with torch.no_grad():
        enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
        torch.manual_seed(0)
        gen = model.generate(**enc, max_new_tokens=12, do_sample=True, top_k=0, top_p=1.0,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)[:, enc.input_ids.shape[1]:]
        top = torch.bincount(gen.flatten(), minlength=model.config.vocab_size).argmax()
        model.lm_head.weight[tok.eos_token_id] = 1.2 * model.lm_head.weight[top]
    tok.padding_side = padding_side  # a tokenizer reloaded from disk pads on the right: must not matter
    h = sampling_entropy(model, tok, PROMPTS, max_new_tokens=12, seed=3)
    ref, ended_early = _entropies_one_by_one(model, tok, PROMPTS, max_new_tokens=12, seed=3)
    assert 1 <= ended_early < len(PROMPTS) and 0.05 < ref < math.log(model.config.vocab_size) - 0.5  # a non-trivial case
    assert h == pytest.approx(ref, abs=2e-4)


def test_sampling_entropy_leaves_the_callers_random_stream():
    """It samples under its own seed: a call (e.g. from a callback every N steps) reseeded torch's global generator,
    so every later random stream of the run (dropout, sampling) restarted from manual_seed(seed)."""
    model, tok = _model(), char_tokenizer()
    torch.manual_seed(123)
    want = torch.rand(4)
    torch.manual_seed(123)
    h1 = sampling_entropy(model, tok, PROMPTS, max_new_tokens=4, seed=5)
    assert torch.equal(torch.rand(4), want)
    assert sampling_entropy(model, tok, PROMPTS, max_new_tokens=4, seed=5) == h1  # still follows its seed
