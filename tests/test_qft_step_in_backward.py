"""hfq.qft.step_in_backward_: QLion's step applied during backward on a small Llama converted with
QFTConfig(gradient_bits=8). Against backward + optimizer.step(): bit-identical with RTN (gradient checkpointing on and
off, outlier refresh included), within one INT8 step with SR; no gradient store after backward; step() after it is a
no-op and a second backward before it is refused; handle.remove() restores stored gradients; optimizer state_dict
resume is bit-exact; NaN naming; Trainer route (callback) and its refusals (clipping, accumulation)."""
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments

from hfq.eco import ECOAdamW
from hfq.qft import QFTConfig, QLion, StepInBackward, int8_grad, quantize_model_, state_bytes, step_in_backward_
from hfq.qparam import Int8Grad, QParam
from _hfq_test_utils import snapshot

SEQ = 16


def _llama(seed=0, gradient_bits=8, ckpt=False):
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).train()
    quantize_model_(model, QFTConfig(gradient_bits=gradient_bits))
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _batch(i, n=4):
    g = torch.Generator().manual_seed(100 + i)
    ids = torch.randint(3, 96, (n, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


def _assert_same_state(o1, o2):
    s1, s2 = o1.state_dict()["state"], o2.state_dict()["state"]
    assert s1.keys() == s2.keys() and len(s1) > 0
    for i in s1:
        assert s1[i].keys() == s2[i].keys()
        for k in s1[i]:
            assert torch.equal(s1[i][k], s2[i][k]), (i, k)


def _opt(model, **kw):
    return QLion(model.parameters(), **dict(dict(lr=2e-3, weight_decay=0.05, rounding="rtn", seed=3), **kw))


@pytest.mark.parametrize("ckpt", [False, True])
def test_matches_backward_then_step_bit_exact_with_rtn(ckpt):
    """4 steps, outlier thresholds re-selected every 2nd step: every stored tensor and the INT8 momentum equal."""
    ref, fused = _llama(ckpt=ckpt), _llama(ckpt=ckpt)
    _assert_same(snapshot(ref, ":"), snapshot(fused, ":"))
    o_ref, o_fused = _opt(ref, refresh_thresholds_every=2), _opt(fused, refresh_thresholds_every=2)
    h = step_in_backward_(fused, o_fused)
    start = snapshot(ref, ":")
    for i in range(4):
        ref(**_batch(i)).loss.backward()
        o_ref.step()
        o_ref.zero_grad()
        fused(**_batch(i)).loss.backward()
        o_fused.step()
        o_fused.zero_grad()
    assert h.updated == 4 * len(list(fused.parameters()))
    a, b = snapshot(ref, ":"), snapshot(fused, ":")
    _assert_same(a, b)
    _assert_same_state(o_ref, o_fused)
    moved = [k for k in a if k.endswith(":codes") and not torch.equal(a[k], start[k])]
    assert len(moved) == 14  # every quantized linear (2 layers x 7) changed: the comparison is not vacuous


def test_sr_within_one_int8_step():
    """SR: the fused run consumes the generator in backward order, so codes may differ, by at most one step; the
    row scales (from the unrounded target) and all plain parameters are identical."""
    ref, fused = _llama(), _llama()
    o_ref, o_fused = _opt(ref, rounding="sr"), _opt(fused, rounding="sr")
    step_in_backward_(fused, o_fused)
    ref(**_batch(0)).loss.backward()
    o_ref.step()
    fused(**_batch(0)).loss.backward()
    a, b = snapshot(ref, ":"), snapshot(fused, ":")
    differ = 0
    for k in a:
        if k.endswith(":codes"):
            d = (a[k].int() - b[k].int()).abs()
            assert int(d.max()) <= 1, k
            differ += int((d > 0).sum())
        elif ":" not in k or k.endswith(":scales"):
            assert torch.equal(a[k], b[k]), k
    assert differ > 0  # the SR draws really differ (so the bound above is what is being tested)


def test_no_gradient_store_after_backward_and_step_is_a_no_op():
    model = _llama()
    opt = _opt(model)
    before = snapshot(model, ":")
    h = step_in_backward_(model, opt)
    model(**_batch(0)).loss.backward()
    assert all(p.grad is None and int8_grad(p) is None for p in model.parameters())
    assert state_bytes(model, opt)["grads"] == 0
    after = snapshot(model, ":")
    changed = [k for k in after if not torch.equal(after[k], before[k])]
    assert any(k.startswith("model.layers.0.self_attn.q_proj.weight") for k in changed)
    assert "model.embed_tokens.weight" in changed and "lm_head.weight" in changed  # plain params: post-acc. hooks
    assert h.stepped_this_iteration == len(list(model.parameters()))
    state = copy.deepcopy(opt.state_dict())
    opt.step()  # no double step
    _assert_same(snapshot(model, ":"), after)
    s2 = opt.state_dict()["state"]
    assert all(torch.equal(s2[i][k], state["state"][i][k]) for i in s2 for k in s2[i])
    assert h.stepped_this_iteration == 0


def test_second_backward_before_step_refused_before_any_change():
    model = _llama()
    opt = _opt(model)
    step_in_backward_(model, opt)
    model(**_batch(0)).loss.backward()
    snap = snapshot(model, ":")
    with pytest.raises(RuntimeError, match="second gradient for .* before optimizer.step"):
        model(**_batch(1)).loss.backward()
    _assert_same(snapshot(model, ":"), snap)
    opt.step()
    model(**_batch(1)).loss.backward()  # after step() the next iteration runs
    assert not torch.equal(snapshot(model, ":")["lm_head.weight"], snap["lm_head.weight"])


def test_remove_restores_stored_gradients_and_step():
    model = _llama()
    opt = _opt(model)
    h = step_in_backward_(model, opt)
    with pytest.raises(RuntimeError, match="already installed"):
        step_in_backward_(model, opt)
    model(**_batch(0)).loss.backward()
    opt.step()
    h.remove()
    h.remove()  # idempotent
    assert not any(hasattr(p, "grad_consumer") for p in model.parameters())
    snap = snapshot(model, ":")
    model(**_batch(1)).loss.backward()
    _assert_same(snapshot(model, ":"), snap)  # backward alone changes nothing now
    q = model.model.layers[1].mlp.down_proj.weight
    assert isinstance(q.grad, Int8Grad) and model.lm_head.weight.grad is not None
    opt.step()
    assert not torch.equal(q.codes, snap["model.layers.1.mlp.down_proj.weight:codes"])
    opt.zero_grad()
    step_in_backward_(model, opt).remove()  # re-installable after remove


def test_resume_from_state_dicts_bit_exact_with_sr():
    """3 fused steps in one go vs 2 steps, save (model + optimizer state_dict incl. the SR generator), fresh model and
    optimizer, load, install, 1 step: identical."""
    a = _llama()
    oa = _opt(a, rounding="sr")
    step_in_backward_(a, oa)
    for i in range(2):
        a(**_batch(i)).loss.backward()
        oa.step()
    msd, osd = copy.deepcopy(a.state_dict()), copy.deepcopy(oa.state_dict())
    a(**_batch(2)).loss.backward()
    oa.step()

    b = _llama(seed=7)  # different init: everything must come from the checkpoint
    b.load_state_dict(msd)
    ob = _opt(b, rounding="sr")
    ob.load_state_dict(osd)
    step_in_backward_(b, ob)
    b(**_batch(2)).loss.backward()
    ob.step()
    _assert_same(snapshot(a, ":"), snapshot(b, ":"))
    _assert_same_state(oa, ob)


def test_group_settings_read_at_each_update_after_load_state_dict():
    """optimizer.load_state_dict after install replaces the param-group dicts: the hooks must step with the new
    groups (their lr as a scheduler sets it), as backward + step() does; a parameter moved out of its place is
    refused by name."""
    fused, ref = _llama(), _llama()
    of, orf = _opt(fused), _opt(ref)
    step_in_backward_(fused, of)
    for o in (of, orf):
        o.load_state_dict(copy.deepcopy(o.state_dict()))
        for g in o.param_groups:
            g["lr"] = 5e-4
    for m, o in ((fused, of), (ref, orf)):
        m(**_batch(0)).loss.backward()
        o.step()
    _assert_same(snapshot(fused, ":"), snapshot(ref, ":"))
    for g in of.param_groups:
        g["lr"] = 0.0
    before = snapshot(fused, ":")
    fused(**_batch(1)).loss.backward()
    of.step()
    _assert_same(snapshot(fused, ":"), before)  # lr 0: no update at all
    of.param_groups[0]["params"].reverse()
    with pytest.raises(RuntimeError, match="no longer where it was"):
        fused(**_batch(2)).loss.backward()


def test_nan_gradient_names_the_parameter_and_says_what_was_updated():
    model = _llama()
    opt = _opt(model)
    h = step_in_backward_(model, opt)
    snap = snapshot(model, ":")
    up = model.model.layers[0].mlp.up_proj

    def poison(mod, inp, out):
        out.register_hook(lambda g: g * float("nan"))

    hook = up.register_forward_hook(poison)
    with pytest.raises(ValueError, match=r"non-finite gradient \(NaN/Inf\) in model\.layers\.0\.mlp\.up_proj\.weight"
                                         r".* parameter\(s\) updated earlier in this backward keep their update"):
        model(**_batch(0)).loss.backward()
    hook.remove()
    now = snapshot(model, ":")
    assert torch.equal(now["model.layers.0.mlp.up_proj.weight:codes"], snap["model.layers.0.mlp.up_proj.weight:codes"])
    assert torch.equal(now["model.embed_tokens.weight"], snap["model.embed_tokens.weight"])  # comes later: untouched
    assert not torch.equal(now["lm_head.weight"], snap["lm_head.weight"])  # came earlier: updated (documented)
    assert not torch.equal(now["model.layers.1.mlp.down_proj.weight:codes"],
                           snap["model.layers.1.mlp.down_proj.weight:codes"])
    assert h.stepped_this_iteration == 0  # aborted backward: the next one is a new iteration
    opt.zero_grad()
    model(**_batch(1)).loss.backward()
    assert all(torch.isfinite(p.dequantize() if isinstance(p, QParam) else p).all() for p in model.parameters())


def test_refusals():
    model = _llama()
    with pytest.raises(TypeError, match="QLion"):
        step_in_backward_(model, ECOAdamW(model.parameters(), lr=1e-3))
    opt = _opt(model)
    model(**_batch(0)).loss.backward()
    with pytest.raises(RuntimeError, match="hold gradients from an earlier backward"):
        step_in_backward_(model, opt)
    opt.zero_grad()
    other = _llama(seed=1)
    with pytest.raises(ValueError, match="is not a parameter of `model`"):
        step_in_backward_(other, opt)
    assert not any(hasattr(p, "grad_consumer") for p in model.parameters())  # the failed install left nothing


def test_accelerate_gradient_accumulation_refused_at_install():
    """An Accelerator with gradient_accumulation_steps=2: refused when the step is installed, before the first
    micro-step would update every weight from half the loss (it raised only at the second micro-step)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    model = _llama()
    try:
        acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
        pmodel, popt = acc.prepare(model, _opt(model))
        before = {n: p.detach().clone() for n, p in model.named_parameters() if not isinstance(p, QParam)}
        with pytest.raises(ValueError, match="gradient accumulation \\(2 steps"):
            step_in_backward_(pmodel, popt)
        assert not any(hasattr(p, "grad_consumer") for p in model.parameters())
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def _data(n=16):
    return [{k: v[0] for k, v in _batch(1000 + i, 1).items()} for i in range(n)]


def _trainer(out, callbacks=(), steps=3, **kw):
    model = _llama()
    opt = _opt(model)
    args = TrainingArguments(out, **dict(dict(max_steps=steps, per_device_train_batch_size=4, max_grad_norm=0.0,
                                              report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                                              save_strategy="no", lr_scheduler_type="linear", logging_steps=1), **kw))
    return model, opt, Trainer(model=model, args=args, train_dataset=_data(), optimizers=(opt, None),
                               callbacks=list(callbacks))


def test_trainer_callback_matches_trainer_without_it(tmp_path):
    """Trainer (its optimizer.step() and linear lr schedule included) with StepInBackward == plain Trainer, bit for
    bit with RTN; the callback removes its hooks at train end."""
    m_ref, o_ref, t_ref = _trainer(str(tmp_path / "ref"))
    t_ref.train()
    from transformers import TrainerCallback

    class NoGrads(TrainerCallback):  # what Trainer's optimizer.step() finds: no gradient at all, weights updated
        seen = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            self.seen.append(sum(p.grad is not None for p in model.parameters()))

    cb = StepInBackward()
    m_f, o_f, t_f = _trainer(str(tmp_path / "fused"), [cb, NoGrads()])
    t_f.train()
    assert NoGrads.seen == [0, 0, 0]
    _assert_same(snapshot(m_ref, ":"), snapshot(m_f, ":"))
    _assert_same_state(o_ref, o_f)
    assert cb.handle is None and not any(hasattr(p, "grad_consumer") for p in m_f.parameters())
    la = [h["loss"] for h in t_ref.state.log_history if "loss" in h]
    lb = [h["loss"] for h in t_f.state.log_history if "loss" in h]
    assert la == lb and len(la) == 3


def test_trainer_callback_refuses_clipping_and_accumulation(tmp_path):
    _, _, t = _trainer(str(tmp_path / "a"), [StepInBackward()], max_grad_norm=1.0)
    with pytest.raises(ValueError, match="gradient clipping cannot work.*max_grad_norm=0"):
        t.train()
    _, _, t = _trainer(str(tmp_path / "b"), [StepInBackward()], gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be 1"):
        t.train()


def test_trainer_callback_refuses_fp16_loss_scaling(tmp_path):
    """fp16 loss scaling cannot unscale or skip a step already applied in backward (and GradScaler then finds no
    gradient to unscale): refused at train begin, before any weight moves."""
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), fp16=True, use_cpu=True, max_grad_norm=0, report_to=[])
    with pytest.raises(ValueError, match="fp16 loss scaling.*bf16=True"):
        StepInBackward().on_train_begin(args, None, None, model=torch.nn.Linear(2, 2), optimizer=None)
