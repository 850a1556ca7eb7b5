"""QFTConfig models: load/quantize, save_pretrained/reload, Trainer + ECOAdamW with bit-exact resume, and no
full-precision weight alive during training."""
import gc

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, get_cosine_schedule_with_warmup

import hfq  # noqa: F401  (registers hfq_qft)
from hfq.eco import ECOAdamW
from hfq.qft import QFTConfig, quantize_model_
from hfq.qparam import QLinear, QParam
from hfq.tiny import save_tiny, tiny_model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return str(save_tiny(tmp_path_factory.mktemp("tiny") / "llama", arch="llama"))


def _same(m1, m2):
    for (n1, p1), (n2, p2) in zip(m1.named_parameters(), m2.named_parameters()):
        assert n1 == n2
        if isinstance(p1, QParam):
            for a, b in zip(p1.qtensors().values(), p2.qtensors().values()):
                assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                   b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), n1
        else:
            assert torch.equal(p1, p2), n1


@pytest.mark.parametrize("fmt", ["fp8_e4m3_row", "int8_dense_sparse", "int4_group"])
def test_from_pretrained_save_reload(llama_dir, tmp_path, fmt):
    m = AutoModelForCausalLM.from_pretrained(llama_dir, quantization_config=QFTConfig(weight_format=fmt, group_size=32))
    lin = m.model.layers[0].mlp.down_proj
    assert isinstance(lin, QLinear) and isinstance(lin.weight, QParam) and lin.weight.fmt == fmt
    assert not isinstance(m.lm_head, QLinear) and m.model.embed_tokens.weight.dtype == torch.float32
    x = torch.randint(4, 90, (2, 10))
    loss = m(x, labels=x).loss
    m.save_pretrained(tmp_path)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.down_proj.weight_codes" in keys and "model.layers.0.mlp.down_proj.weight" not in keys
    m2 = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(m2.model.layers[0].mlp.down_proj.weight, QParam)
    _same(m, m2)
    torch.testing.assert_close(m2(x, labels=x).loss, loss, rtol=0, atol=0)


def test_config_validation():
    with pytest.raises(ValueError, match="weight_format"):
        QFTConfig(weight_format="int3")
    with pytest.raises(ValueError, match="rounding"):
        QFTConfig(rounding="down")
    with pytest.raises(ValueError, match="group_size"):
        QFTConfig(weight_format="int4_group", group_size=0)


def _data(n=24):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(4, 90, (16,), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def _run(model_dir, out, resume=None):
    m = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=QFTConfig(weight_format="fp8_e4m3_row"))
    opt = ECOAdamW(m.parameters(), lr=1e-2, weight_decay=0.1, rounding="sr")
    sched = get_cosine_schedule_with_warmup(opt, 2, 6)
    args = TrainingArguments(out, max_steps=6, per_device_train_batch_size=4, save_steps=3, logging_steps=1,
                             report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    tr = Trainer(model=m, args=args, train_dataset=_data(), optimizers=(opt, sched))
    tr.train(resume_from_checkpoint=resume)
    return m, opt, [h["loss"] for h in tr.state.log_history if "loss" in h]


def test_trainer_resume_bit_exact(llama_dir, tmp_path):
    m_a, opt_a, loss_a = _run(llama_dir, str(tmp_path / "a"))
    q = m_a.model.layers[0].self_attn.q_proj.weight
    assert isinstance(q, QParam) and opt_a.state[q]["exp_avg"].dtype == torch.float32
    m_b, opt_b, loss_b = _run(llama_dir, str(tmp_path / "b"), resume=str(tmp_path / "a" / "checkpoint-3"))
    _same(m_a, m_b)
    assert loss_a[3:] == loss_b[-3:]
    q_b = m_b.model.layers[0].self_attn.q_proj.weight
    for k, v in opt_a.state[q].items():
        assert torch.equal(v, opt_b.state[q_b][k]), k
    # quantized weights moved during training
    m0 = AutoModelForCausalLM.from_pretrained(llama_dir, quantization_config=QFTConfig(weight_format="fp8_e4m3_row"))
    assert not torch.equal(m0.model.layers[0].self_attn.q_proj.weight.dequantize(), q.dequantize())


def _run_by_args(model_dir, out, resume=None):
    """Trainer builds ECOAdamW and its scheduler itself from TrainingArguments (optimizer_cls_and_kwargs)."""
    from hfq.eco import optimizer_cls_and_kwargs

    m = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=QFTConfig(weight_format="fp8_e4m3_row"))
    args = TrainingArguments(out, max_steps=6, per_device_train_batch_size=4, save_steps=3, logging_steps=1,
                             report_to=[], use_cpu=True, seed=0, disable_tqdm=True, learning_rate=1e-2,
                             weight_decay=0.1, adam_beta2=0.95, lr_scheduler_type="cosine", warmup_steps=2,
                             optim_args="rounding=sr,state_dtype=bfloat16,seed=5")
    tr = Trainer(model=m, args=args, train_dataset=_data(), optimizer_cls_and_kwargs=optimizer_cls_and_kwargs(args))
    tr.train(resume_from_checkpoint=resume)
    return m, tr.optimizer, [h["loss"] for h in tr.state.log_history if "loss" in h]


def test_trainer_builds_eco_from_training_arguments_and_resumes(llama_dir, tmp_path):
    m_a, opt_a, loss_a = _run_by_args(llama_dir, str(tmp_path / "a"))
    eco = getattr(opt_a, "optimizer", opt_a)  # accelerate's wrapper
    assert isinstance(eco, ECOAdamW) and eco.rounding == "sr" and eco._seed == 5
    assert eco.param_groups[0]["betas"] == (0.9, 0.95)
    q = m_a.model.layers[0].self_attn.q_proj.weight
    norm = m_a.model.layers[0].input_layernorm.weight
    wd = {id(p): g["weight_decay"] for g in eco.param_groups for p in g["params"]}
    assert wd[id(q)] == 0.1 and wd[id(norm)] == 0.0  # Trainer's groups: no decay on norms
    assert eco.state[q]["exp_avg"].dtype == torch.bfloat16
    m_b, opt_b, loss_b = _run_by_args(llama_dir, str(tmp_path / "b"), resume=str(tmp_path / "a" / "checkpoint-3"))
    _same(m_a, m_b)
    assert loss_a[3:] == loss_b[-3:]
    m0 = AutoModelForCausalLM.from_pretrained(llama_dir, quantization_config=QFTConfig(weight_format="fp8_e4m3_row"))
    assert not torch.equal(m0.model.layers[0].self_attn.q_proj.weight.dequantize(), q.dequantize())


def test_optimizer_cls_and_kwargs_validation():
    from hfq.eco import ECOSGD, optimizer_cls_and_kwargs

    args = TrainingArguments("unused", learning_rate=3e-4, optim_args="momentum=0.8,rule=exact", report_to=[])
    cls, kw = optimizer_cls_and_kwargs(args, "eco_sgd", rounding="rtn")
    assert cls is ECOSGD and kw == {"lr": 3e-4, "seed": args.seed, "momentum": 0.8, "rule": "exact", "rounding": "rtn"}
    with pytest.raises(ValueError, match="momentum"):
        optimizer_cls_and_kwargs(args)
    with pytest.raises(ValueError, match="unknown"):
        optimizer_cls_and_kwargs(args, "eco_lion")
    with pytest.raises(ValueError, match="optim_args"):
        optimizer_cls_and_kwargs(TrainingArguments("unused", optim_args="lr_mult=2", report_to=[]))
    with pytest.raises(ValueError, match="eco_adamw"):  # transformers' closed enum: no name registration
        TrainingArguments("unused", optim="eco_adamw", report_to=[])


def test_no_full_precision_weight_alive():
    model = tiny_model("llama", hidden=96, intermediate=160)
    quantize_model_(model, QFTConfig(weight_format="fp8_e4m3_row"))
    model.train()
    qshapes = {tuple(p.shape) for p in model.parameters() if isinstance(p, QParam)}
    opt = ECOAdamW(model.parameters(), lr=1e-3)
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    x = torch.randint(4, 90, (2, 12))
    for _ in range(2):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert not [s for s in saved if s[0] in qshapes and s[1] != torch.float8_e4m3fn], "a weight-shaped tensor was saved for backward"
    states = {id(t) for st in opt.state.values() for t in st.values() if torch.is_tensor(t)}
    del loss
    gc.collect()
    alive = [o for o in gc.get_objects() if torch.is_tensor(o) and not isinstance(o, QParam)
             and all(type(d) is int for d in o.shape) and tuple(o.shape) in qshapes and o.is_floating_point() and o.element_size() >= 2
             and id(o) not in states]
    assert not alive, [(tuple(t.shape), t.dtype) for t in alive]


def _u8(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_sr_load_follows_the_seed_and_leaves_torchs_stream(llama_dir):
    """QFTConfig(rounding="sr") drew its rounding from torch's global generator: a load advanced the user's random
    stream, and the same checkpoint after the same seed gave other codes if anything had drawn before. Each layer
    now draws from its own generator seeded by torch.initial_seed() and its name."""
    def codes(pre_draws=0):
        torch.manual_seed(5)
        torch.rand(pre_draws)
        m = AutoModelForCausalLM.from_pretrained(llama_dir, quantization_config=QFTConfig(rounding="sr"))
        after = torch.rand(3)
        torch.manual_seed(5)
        torch.rand(pre_draws)
        assert torch.equal(after, torch.rand(3))  # the load drew nothing from torch's stream
        return [_u8(next(iter(p.qtensors().values()))).clone() for p in m.parameters() if isinstance(p, QParam)]

    a, b = codes(), codes(pre_draws=100)
    assert len(a) > 0 and all(torch.equal(x, y) for x, y in zip(a, b))
    torch.manual_seed(6)
    m = AutoModelForCausalLM.from_pretrained(llama_dir, quantization_config=QFTConfig(rounding="sr"))
    c = [_u8(next(iter(p.qtensors().values()))) for p in m.parameters() if isinstance(p, QParam)]
    assert any(not torch.equal(x, y) for x, y in zip(a, c))  # another seed: other rounding draws
