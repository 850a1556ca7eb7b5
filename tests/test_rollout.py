"""RolloutEngine correctness on CPU (engine logic without CUDA graphs) against transformers' generate."""
import math
import warnings

import pytest
import torch

from hfq.rollout import RolloutEngine
from hfq.rollout.engine import RolloutEngine as _E
from hfq.rollout.sampling import SamplerFlags, process_logits, row_keys, sample, uniform_noise
from hfq.tiny import char_tokenizer, tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27], [40]]


def hf_greedy(model, prompts, max_new, eos):
    ids, am = _E._left_pad(prompts, None, 0)
    out = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=max_new, do_sample=False,
                         eos_token_id=eos, pad_token_id=0)
    return out[:, ids.shape[1]:]


def padded(out, width):
    c = out.completion_ids
    return torch.nn.functional.pad(c, (0, width - c.shape[1]), value=0)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama", "mistral"])
def test_greedy_matches_generate_ragged(arch):
    model = tiny_model(arch, seed=1)
    eng = RolloutEngine(model, max_batch=4, max_seq_len=48, kv_block=16, check_every=3)
    out = eng.generate(PROMPTS, max_new_tokens=24, temperature=0, eos_token_ids=[])
    ref = hf_greedy(model, PROMPTS, 24, None)
    assert torch.equal(out.completion_ids, ref)
    assert out.lengths.tolist() == [24] * 4
    # a bucket larger than the request (dummy rows) and tensor input with left padding give the same tokens
    ids, am = _E._left_pad(PROMPTS[:3], None, 0)
    out3 = eng.generate(ids, am, max_new_tokens=24, temperature=0, eos_token_ids=[])
    assert torch.equal(out3.completion_ids, ref[:3])


def test_eos_stops_rows_and_pads():
    model = tiny_model("qwen2", seed=2)
    eng = RolloutEngine(model, max_batch=4, max_seq_len=64, kv_block=16, check_every=2)
    free = eng.generate(PROMPTS, max_new_tokens=30, temperature=0, eos_token_ids=[]).completion_ids
    eos = int(free[0, 5])  # a token row 0 emits at step 5: it must stop there
    ref = hf_greedy(model, PROMPTS, 30, eos)
    out = eng.generate(PROMPTS, max_new_tokens=30, temperature=0, eos_token_ids=[eos])
    assert torch.equal(padded(out, ref.shape[1]), ref)
    first = [(row == eos).nonzero()[0, 0].item() + 1 if (row == eos).any() else 30 for row in free]
    assert out.lengths.tolist() == first
    assert out.lengths[0].item() <= 6
    for row, n in zip(out.completion_ids, out.lengths.tolist()):
        assert (row[n:] == 0).all()
    # right-padded tensors are re-padded on the left, never truncated
    ids = torch.zeros(4, 8, dtype=torch.long)
    am = torch.zeros(4, 8, dtype=torch.long)
    for i, p in enumerate(PROMPTS):
        ids[i, :len(p)] = torch.tensor(p)
        am[i, :len(p)] = 1
    out_r = eng.generate(ids, am, max_new_tokens=30, temperature=0, eos_token_ids=[eos])
    assert torch.equal(out_r.completion_ids, out.completion_ids)


def test_seeded_sampling_reproducible_and_rows_differ():
    model = tiny_model("llama", seed=3)
    eng = RolloutEngine(model, max_batch=8, max_seq_len=40, kv_block=16)
    same = [PROMPTS[0]] * 6  # GRPO repeats each prompt: the rows must still differ
    kw = dict(max_new_tokens=16, temperature=1.0, top_p=0.95, top_k=50, min_p=0.01, eos_token_ids=[])
    a = eng.generate(same, seed=123, **kw).completion_ids
    torch.manual_seed(999)  # global RNG state must not matter
    b = eng.generate(same, seed=123, **kw).completion_ids
    c = eng.generate(same, seed=124, **kw).completion_ids
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert len({tuple(r.tolist()) for r in a}) > 1
    # seed=None follows torch.manual_seed
    torch.manual_seed(7)
    d = eng.generate(same, **kw).completion_ids
    torch.manual_seed(7)
    e = eng.generate(same, **kw).completion_ids
    assert torch.equal(d, e)


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 20)])
def test_logprobs_equal_teacher_forced_forward(temperature, top_p, top_k):
    model = tiny_model("qwen3", seed=4)
    eng = RolloutEngine(model, max_batch=4, max_seq_len=48, kv_block=16)
    out = eng.generate(PROMPTS, max_new_tokens=12, temperature=temperature, top_p=top_p, top_k=top_k,
                       eos_token_ids=[], seed=5, return_logprobs=True)
    ids, am = _E._left_pad(PROMPTS, None, 0)
    full = torch.cat([ids, out.completion_ids], 1)
    fam = torch.cat([am, torch.ones_like(out.completion_ids)], 1)
    pos = (fam.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=fam, position_ids=pos).logits.float()
    p = ids.shape[1]
    lg = logits[:, p - 1:-1]
    flags = SamplerFlags(top_k=top_k > 0, top_p=top_p < 1)
    n = lg.shape[0]
    proc = process_logits(lg.reshape(-1, lg.shape[-1]), flags, torch.full((n * 12, 1), temperature),
                          torch.full((n * 12, 1), top_k), torch.full((n * 12, 1), top_p), torch.zeros(n * 12, 1))
    ref = proc.log_softmax(-1).gather(1, out.completion_ids.reshape(-1, 1)).reshape(n, 12)
    assert torch.isfinite(out.logprobs).all()
    torch.testing.assert_close(out.logprobs, ref, atol=2e-4, rtol=0)
    assert (out.logprobs < 0).all()


def test_filters_match_transformers_warpers():
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 301, generator=g) * 3
    for t, k, p, mp in [(0.8, 13, 1.0, 0.0), (1.3, 0, 0.7, 0.0), (1.0, 40, 0.9, 0.05), (0.5, 0, 1.0, 0.2)]:
        ref = TemperatureLogitsWarper(t)(None, logits.clone())
        if k:
            ref = TopKLogitsWarper(k)(None, ref)
        if p < 1:
            ref = TopPLogitsWarper(p)(None, ref)
        if mp:
            ref = MinPLogitsWarper(mp)(None, ref)
        flags = SamplerFlags(top_k=k > 0, top_p=p < 1, min_p=mp > 0)
        ours = process_logits(logits, flags, torch.full((7, 1), t), torch.full((7, 1), k), torch.full((7, 1), p),
                              torch.full((7, 1), mp))
        assert torch.equal(torch.isinf(ours), torch.isinf(ref)), (t, k, p, mp)
        kept = ~torch.isinf(ref)
        torch.testing.assert_close(ours[kept], ref[kept])


def test_top_p_cuts_a_tie_group_as_transformers_does():
    """Equal logits straddling the nucleus boundary (common in bf16): the engine kept the whole tie group where
    transformers' TopPLogitsWarper (and vLLM) cut through it, so about a quarter of top-p steps on a bf16 policy
    sampled from a wider distribution than TRL's generate (audit 18e F4: [2, 1, 1, 0] at top_p 0.6, TV 0.21)."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(1)
    cases = [(torch.tensor([[2.0, 1.0, 1.0, 0.0]]), 0, 0.6)]
    cases += [((torch.randn(16, 517, generator=g) * 2).bfloat16().float(), k, p) for k in (0, 50) for p in (0.5, 0.9)]
    for logits, k, p in cases:
        ref = TopKLogitsWarper(k)(None, logits.clone()) if k else logits.clone()
        ref = TopPLogitsWarper(p)(None, ref)
        n = logits.shape[0]
        ours = process_logits(logits, SamplerFlags(top_k=k > 0, top_p=True), torch.ones(n, 1),
                              torch.full((n, 1), k), torch.full((n, 1), p), torch.zeros(n, 1))
        assert torch.equal(torch.isinf(ours), torch.isinf(ref)), (k, p)


def test_gumbel_sampling_follows_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    probs = logits.softmax(-1)[0]
    rows = 20000
    keys = row_keys(torch.arange(rows, dtype=torch.long) * 7919 + 17)
    u = uniform_noise(keys, torch.tensor([3]), torch.arange(6))
    assert 0 < u.min() and u.max() < 1
    tok, _ = sample(logits.expand(rows, -1), SamplerFlags(), torch.ones(rows, 1), torch.zeros(rows, 1, dtype=torch.long),
                    torch.ones(rows, 1), torch.zeros(rows, 1), keys, torch.tensor([3]), torch.arange(6))
    freq = torch.bincount(tok, minlength=6).float() / rows
    # 4.5 standard errors of a multinomial frequency
    assert ((freq - probs).abs() <= 4.5 * (probs * (1 - probs) / rows).sqrt() + 1e-3).all(), (freq, probs)


def test_lora_unmerged_and_in_place_updates_are_seen():
    from peft import LoraConfig, get_peft_model

    model = tiny_model("qwen2", seed=5)
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, cfg).eval()
    eng = RolloutEngine(peft_model, max_batch=4, max_seq_len=48, kv_block=16)
    out = eng.generate(PROMPTS, max_new_tokens=16, temperature=0, eos_token_ids=[])
    assert torch.equal(out.completion_ids, hf_greedy(peft_model, PROMPTS, 16, None))
    with peft_model.disable_adapter():
        base = hf_greedy(peft_model, PROMPTS, 16, None)
    assert not torch.equal(out.completion_ids, base)  # the adapters really are applied
    # an optimizer-like in-place update of LoRA weights and AQN-like noise on norm weights
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.5)
            if "layernorm" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    out2 = eng.generate(PROMPTS, max_new_tokens=16, temperature=0, eos_token_ids=[])
    ref2 = hf_greedy(peft_model, PROMPTS, 16, None)
    assert torch.equal(out2.completion_ids, ref2)
    assert not torch.equal(out2.completion_ids, out.completion_ids)
    peft_model.train()
    eng.generate(PROMPTS[:1], max_new_tokens=2, temperature=0)
    assert peft_model.training  # the caller's mode is restored


def _nvfp4_model(tmp_path):
    from hfq.nvfp4 import NVFP4Config
    from hfq.tiny import save_tiny
    from transformers import AutoModelForCausalLM

    path = save_tiny(tmp_path / "tiny", arch="qwen2", seed=6)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=NVFP4Config()).eval()


def test_nvfp4_greedy_with_and_without_lora(tmp_path):
    from peft import LoraConfig

    from hfq.nvfp4 import NVFP4Linear
    from hfq.nvfp4.peft_lora import get_peft_model

    model = _nvfp4_model(tmp_path)
    assert isinstance(model.model.layers[0].self_attn.q_proj, NVFP4Linear)
    eng = RolloutEngine(model, max_batch=4, max_seq_len=40, kv_block=16)
    out = eng.generate(PROMPTS, max_new_tokens=12, temperature=0, eos_token_ids=[])
    assert torch.equal(out.completion_ids, hf_greedy(model, PROMPTS, 12, None))
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    pm = get_peft_model(model, cfg).eval()
    eng = RolloutEngine(pm, max_batch=4, max_seq_len=40, kv_block=16)
    out = eng.generate(PROMPTS, max_new_tokens=12, temperature=0, eos_token_ids=[])
    assert torch.equal(out.completion_ids, hf_greedy(pm, PROMPTS, 12, None))


def test_in_place_writes_to_nvfp4_codes_change_the_graph_fingerprint(tmp_path):
    """load_state_dict copies into the NVFP4 code buffers at the same addresses; a layer may keep a copy derived
    from them (the canonical layout's g4 copy) that a captured graph reads by address: the graphs are re-captured."""
    model = _nvfp4_model(tmp_path)
    eng = RolloutEngine(model, max_batch=4, max_seq_len=40, kv_block=16)
    eng.generate(PROMPTS, max_new_tokens=4, temperature=0, eos_token_ids=[])
    fp = eng._model_fingerprint()
    other = _nvfp4_model(tmp_path / "other")
    down = other.model.layers[0].mlp.down_proj
    down.set_weight(torch.randn(down.out_features, down.in_features))
    model.load_state_dict(other.state_dict())
    assert eng._model_fingerprint() != fp
    out = eng.generate(PROMPTS, max_new_tokens=12, temperature=0, eos_token_ids=[])
    assert torch.equal(out.completion_ids.cpu(), hf_greedy(model, PROMPTS, 12, None).cpu())


def test_stop_strings():
    tok = char_tokenizer()
    model = tiny_model("llama", seed=7, vocab=len(tok))
    eng = RolloutEngine(model, max_batch=4, max_seq_len=48, kv_block=16, check_every=5)
    prompts = [tok("ab")["input_ids"], tok("hello")["input_ids"]]
    free = eng.generate(prompts, max_new_tokens=20, temperature=0, eos_token_ids=[])
    text = tok.decode(free.completion_ids[0, :9].tolist())
    stop = text[-2:]  # completes at (or before) token 9 of row 0
    out = eng.generate(prompts, max_new_tokens=20, temperature=0, eos_token_ids=[], stop_strings=[stop],
                       tokenizer=tok)
    n0 = out.lengths[0].item()
    assert n0 <= 9 and stop in tok.decode(out.completion_ids[0, :n0].tolist())
    assert stop not in tok.decode(out.completion_ids[0, :n0 - 1].tolist())
    assert torch.equal(out.completion_ids[0, :n0], free.completion_ids[0, :n0])
    assert (out.completion_ids[0, n0:] == 0).all()


def test_bad_input_and_memory_knob():
    model = tiny_model("qwen2")
    eng = RolloutEngine(model, max_batch=2, max_seq_len=16, kv_block=16)
    with pytest.raises(ValueError, match="max_seq_len=16"):
        eng.generate([[1] * 10], max_new_tokens=8)
    with pytest.raises(ValueError, match="max_batch=2"):
        eng.generate([[3], [4], [5]], max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p"):
        eng.generate([[3]], max_new_tokens=2, top_p=0.0)
    with pytest.raises(ValueError, match="kv_cache_gb"):
        RolloutEngine(model, max_batch=64, max_seq_len=4096, kv_cache_gb=0.001)
    with pytest.raises(ValueError, match="graph_mode"):
        RolloutEngine(model, graph_mode="fast")
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="not supported"):
        RolloutEngine(gpt2, max_batch=1, max_seq_len=16)
    eng_ok = RolloutEngine(model, max_batch=1, max_seq_len=16, kv_cache_gb=1.0)
    assert math.isclose(eng_ok.kv_bytes, 2 * 2 * 1 * 2 * 64 * 16 * 4)


def _greedy_on(model, prompts, max_new):
    ids, am = _E._left_pad(prompts, None, 0)
    dev = next(model.parameters()).device
    out = model.generate(input_ids=ids.to(dev), attention_mask=am.to(dev), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[:, ids.shape[1]:].cpu()


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_adapter_state_changes_reach_captured_decode_graphs(device):
    """disable_adapter(), rescale_adapter_scale, and transformers' set_adapter / disable_adapters move no tensor: the
    engine's graph fingerprint must still change, or a captured decode step replays the old adapter state."""
    from peft import LoraConfig, get_peft_model
    from peft.helpers import rescale_adapter_scale

    targets = ["q_proj", "v_proj", "down_proj"]
    pm = get_peft_model(tiny_model("qwen2", seed=5).to(device),
                        LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False)).eval()
    eng = RolloutEngine(pm, max_batch=4, max_seq_len=48, kv_block=16)

    def check(model, eng):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out = eng.generate(PROMPTS, max_new_tokens=8, temperature=0, eos_token_ids=[])
        # re-captures after a change must work (a dropped graph pool is not reused): no fallback to eager decoding
        assert not [w for w in seen if "hfq.rollout" in str(w.message)], [str(w.message) for w in seen]
        assert eng.use_graphs == (device == "cuda")
        assert torch.equal(out.completion_ids.cpu(), _greedy_on(model, PROMPTS, 8))
        return eng._model_fingerprint(), out.completion_ids.cpu()

    fp, lora_out = check(pm, eng)
    with pm.disable_adapter():
        fp1, base_out = check(pm, eng)
    assert fp1 != fp and not torch.equal(base_out, lora_out)
    with rescale_adapter_scale(pm, 0.25):
        assert check(pm, eng)[0] != fp
    fp2, out2 = check(pm, eng)
    assert fp2 == fp and torch.equal(out2, lora_out)

    model = tiny_model("qwen2", seed=5).to(device).eval()
    from test_peft_routes import _transformers_needs_newer_peft

    if _transformers_needs_newer_peft():  # transformers >= 5.24's add_adapter asks PEFT >= 0.22 (not released yet)
        with pytest.raises(ValueError, match="PEFT"):
            model.add_adapter(LoraConfig(r=8, target_modules=targets), adapter_name="A")
        return
    for name in ("A", "B"):
        model.add_adapter(LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False),
                          adapter_name=name)
    model.set_adapter("A")
    eng = RolloutEngine(model, max_batch=4, max_seq_len=48, kv_block=16)
    fp, _ = check(model, eng)
    for change, undo in ((lambda: model.set_adapter("B"), lambda: model.set_adapter("A")),
                         (model.disable_adapters, model.enable_adapters)):
        change()
        assert check(model, eng)[0] != fp
        undo()
        assert check(model, eng)[0] == fp


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_graphs_follow_outlier_lists_an_optimizer_replaced(device):
    """QLion gives an int8_dense_sparse weight new outlier lists (new storage, new length) while its codes keep their
    address: the graph fingerprint must change, and decoding (graphs on CUDA) equals eager decoding afterwards."""
    from hfq.qft import QFTConfig, QLion, quantize_model_

    model = tiny_model("qwen2", seed=3, dtype=torch.bfloat16).to(device)
    quantize_model_(model, QFTConfig(weight_format="int8_dense_sparse", outlier_fraction=0.05))
    kw = dict(max_new_tokens=8, temperature=0, eos_token_ids=[])
    graphs = RolloutEngine(model, max_batch=4, max_seq_len=40, kv_block=16)
    eager = RolloutEngine(model, max_batch=4, max_seq_len=40, kv_block=16, graph_mode="eager")
    graphs.generate(PROMPTS[:2], **kw)
    fp = graphs._model_fingerprint()
    q = model.model.layers[0].mlp.down_proj.weight
    before = (q.sparse_idx.data_ptr(), q.sparse_idx.numel())
    opt = QLion(model.parameters(), lr=3e-2)
    g = torch.Generator(device=device).manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, model.config.vocab_size, (2, 12), device=device, generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert (q.sparse_idx.data_ptr(), q.sparse_idx.numel()) != before  # the lists were replaced
    assert graphs._model_fingerprint() != fp
    got, want = graphs.generate(PROMPTS[:2], **kw), eager.generate(PROMPTS[:2], **kw)
    assert graphs.use_graphs == (device == "cuda")
    assert torch.equal(got.completion_ids, want.completion_ids)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture")
def test_out_of_memory_while_capturing_is_retried_by_a_later_call(monkeypatch):
    """An out-of-memory while capturing (memory tight for a moment mid-training) makes that call decode eagerly;
    a later call captures again, fused kernels kept, instead of eager unfused decoding for the engine's life."""
    model = tiny_model("qwen2", seed=1, dtype=torch.bfloat16).cuda().eval()
    eng = RolloutEngine(model, max_batch=4, max_seq_len=48, kv_block=16)
    fused = eng.adapter.fused
    real, fails = eng._decode_body, [2]

    def flaky(*a, **kw):
        if fails[0] and torch.cuda.is_current_stream_capturing():
            fails[0] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(*a, **kw)

    monkeypatch.setattr(eng, "_decode_body", flaky)
    kw = dict(max_new_tokens=8, temperature=0, eos_token_ids=[])
    with pytest.warns(UserWarning, match="out of memory while capturing"):
        first = eng.generate(PROMPTS, **kw)
    later = [eng.generate(PROMPTS, **kw) for _ in range(2)]
    assert fails == [0] and eng.use_graphs and eng.adapter.fused == fused
    assert eng._graphs and all(g is not None for g in eng._graphs.values())
    for out in later:
        assert torch.equal(out.completion_ids, first.completion_ids)
