"""No silent no-op: every torch optimizer path given trainable quantized weights (QParam) either trains them
(hfq.optim's ECO / QLion, also on INT8 gradients) or refuses at its first step, before anything moves, with an
error naming the hfq optimizer to use. Checked directly and through the real Trainer on a tiny QFTConfig model.
Also what hfq's optimizers share: the same argument checks, and one NaN/Inf check reading the host once per step."""
import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import hfq  # noqa: F401  (registers hfq_qft)
from hfq.eco import ECOAdamW, ECOSGD, optimizer_cls_and_kwargs
from hfq.qft import QFTConfig, QLion, int8_grad, quantize_model_
from hfq.qparam import FORMATS, QLinear, QParam, QuantizedWriteError, accumulate_int8_grad_
from hfq.tiny import save_tiny, tiny_model

HINT = "ECOAdamW or ECOSGD"


def _codes(p: QParam):
    return [t.view(torch.uint8).clone() if t.dtype == torch.float8_e4m3fn else t.clone() for t in p.qtensors().values()]


def _layer(fmt="fp8_e4m3_row"):
    torch.manual_seed(0)
    lin = QLinear.from_linear(nn.Linear(64, 16), fmt)
    x = torch.randn(4, 64)
    lin(x).square().sum().backward()
    return lin


TORCH_OPTIMIZERS = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.SGD, {"lr": 0.1, "foreach": True}),
    (torch.optim.Adam, {"lr": 1e-3}),
    (torch.optim.AdamW, {"lr": 1e-3, "foreach": False}),
    (torch.optim.AdamW, {"lr": 1e-3, "foreach": True}),
    (torch.optim.AdamW, {"lr": 1e-3, "fused": True}),
    (torch.optim.Adam, {"lr": 1e-3, "fused": True}),
    (torch.optim.RMSprop, {"lr": 1e-3}),
    (torch.optim.Adagrad, {"lr": 1e-2}),
    (torch.optim.Adamax, {"lr": 1e-2}),
    (torch.optim.NAdam, {"lr": 1e-2}),
]


@pytest.mark.parametrize("cls,kw", TORCH_OPTIMIZERS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_torch_optimizers_refused_before_anything_moves(cls, kw):
    lin = _layer()
    bias0, codes0 = lin.bias.detach().clone(), _codes(lin.weight)
    opt = cls(lin.parameters(), **kw)
    n_state = len(opt.state)  # Adagrad makes its state at construction, the others at their first step
    with pytest.raises(TypeError, match=HINT) as e:
        opt.step()
    assert "QParam fp8_e4m3_row (16, 64)" in str(e.value) and cls.__name__ in str(e.value)
    assert torch.equal(lin.bias, bias0)  # refused before the ordinary parameter was touched
    assert all(torch.equal(a, b) for a, b in zip(_codes(lin.weight), codes0))
    assert len(opt.state) == n_state  # no optimizer state was created either


def test_refusal_names_the_parameter():
    model = tiny_model("llama", layers=1)
    quantize_model_(model, QFTConfig(weight_format="fp8_e4m3_row"))
    opt = torch.optim.AdamW(model.named_parameters(), lr=1e-3)  # named params: torch keeps param_names
    with pytest.raises(TypeError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight"):
        opt.step()


def test_frozen_quantized_weights_and_legit_ops_are_allowed():
    """A torch optimizer over a model whose QParams are frozen (e.g. training only biases/adapters) works;
    deepcopy, .to(), state_dict round trips and in-place writes of *plain* tensors from a QParam are fine."""
    lin = _layer()
    lin.weight.requires_grad_(False)
    lin.weight.grad = None
    codes0, bias0 = _codes(lin.weight), lin.bias.detach().clone()
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-2, fused=True)
    opt.step()
    assert not torch.equal(lin.bias, bias0)
    assert all(torch.equal(a, b) for a, b in zip(_codes(lin.weight), codes0))
    clone = copy.deepcopy(lin).to("cpu")
    clone.load_state_dict(lin.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(_codes(clone.weight), codes0))
    out = torch.zeros(16, 64, dtype=torch.bfloat16)
    out.add_(lin.weight)  # reading a QParam into a plain tensor in place is not a write into the QParam
    assert torch.equal(out, lin.weight.dequantize())


def test_inplace_writes_into_a_qparam_raise():
    """Without the step hook in the way (raw foreach/fused kernels, single-tensor ops), any in-place write into a
    QParam raises: it would change only a dequantized temporary."""
    lin = _layer()
    w = lin.weight
    for write in (lambda: torch._foreach_add_([lin.bias, w], 1.0),
                  lambda: torch._foreach_mul_([w], 0.5),
                  lambda: w.detach().add_(1.0),
                  lambda: torch.add(lin.bias, 1.0, out=w)):
        with torch.no_grad(), pytest.raises(QuantizedWriteError, match=HINT):
            write()


@pytest.mark.parametrize("opt_fn", [lambda ps: ECOAdamW(ps, lr=1e-2), lambda ps: ECOSGD(ps, lr=1e-1),
                                    lambda ps: QLion(ps, lr=1e-2)], ids=["ECOAdamW", "ECOSGD", "QLion"])
def test_hfq_optimizers_train_int8_gradient_weights(opt_fn):
    """QFTConfig(gradient_bits=8): the weights' .grad is the INT8 store; ECO and QLion read (and consume) it."""
    model = tiny_model("llama", layers=1)
    quantize_model_(model, QFTConfig(weight_format="int8_dense_sparse", gradient_bits=8))
    w = model.model.layers[0].mlp.down_proj.weight
    for p in model.parameters():  # only the quantized weights train: their INT8 gradients must do the work
        p.requires_grad_(isinstance(p, QParam))
    x = torch.randint(4, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    model.train()
    opt = opt_fn(model.parameters())
    codes0, losses = _codes(w), []
    for _ in range(4):
        loss = model(x, labels=x).loss
        loss.backward()
        assert int8_grad(w) is w.grad and w.grad.codes.dtype == torch.uint8  # the .grad is the INT8 store
        opt.step()
        assert int8_grad(w) is None  # consumed
        losses.append(loss.item())
    assert any(not torch.equal(a, b) for a, b in zip(_codes(w), codes0))
    assert losses[-1] < losses[0] - 0.01, losses


# ---- the real Trainer on a tiny QFTConfig model ---------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return str(save_tiny(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", layers=1))


def _data(n=8):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(4, 90, (n, 16), generator=g)]


def _trainer(model_dir, out, cfg, **kw):
    m = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=cfg)
    args = TrainingArguments(out, max_steps=2, per_device_train_batch_size=4, report_to=[], use_cpu=True,
                             save_strategy="no", logging_steps=1, disable_tqdm=True, learning_rate=1e-2)
    return m, Trainer(model=m, args=args, train_dataset=_data(), **kw)


ROUTES = {
    "default": lambda m: {},
    "adamw_foreach": lambda m: {"optimizers": (torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True), None)},
    "adamw_fused": lambda m: {"optimizers": (torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True), None)},
}


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_trainer_torch_optimizers_refused(llama_dir, tmp_path, fmt, route):
    cfg = QFTConfig(weight_format=fmt, group_size=32)
    m = AutoModelForCausalLM.from_pretrained(llama_dir, quantization_config=cfg)
    args = TrainingArguments(tmp_path, max_steps=2, per_device_train_batch_size=4, report_to=[], use_cpu=True,
                             save_strategy="no", disable_tqdm=True)
    tr = Trainer(model=m, args=args, train_dataset=_data(), **ROUTES[route](m))
    w = m.model.layers[0].self_attn.q_proj.weight
    codes0 = _codes(w)
    with pytest.raises(TypeError, match=HINT):
        tr.train()
    if route == "default":
        assert type(tr.optimizer.optimizer) is torch.optim.AdamW and tr.optimizer.optimizer.defaults["fused"]
    assert all(torch.equal(a, b) for a, b in zip(_codes(w), codes0))


def test_trainer_default_optim_refused_with_int8_gradients(llama_dir, tmp_path):
    m, tr = _trainer(llama_dir, tmp_path, QFTConfig(weight_format="int8_dense_sparse", gradient_bits=8))
    with pytest.raises(TypeError, match=HINT):
        tr.train()


@pytest.mark.parametrize("gradient_bits", [None, 8])
def test_trainer_eco_trains_every_quantized_weight(llama_dir, tmp_path, gradient_bits):
    """The route the error points to: every quantized decoder weight moves in two Trainer steps."""
    args = TrainingArguments(tmp_path, learning_rate=1e-2)
    cfg = QFTConfig(weight_format="int8_dense_sparse", gradient_bits=gradient_bits)
    m, tr = _trainer(llama_dir, tmp_path, cfg, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs(args))
    before = {n: _codes(p) for n, p in m.named_parameters() if isinstance(p, QParam)}
    tr.train()
    assert len(before) == 7
    for n, p in m.named_parameters():
        if n in before:
            assert any(not torch.equal(a, b) for a, b in zip(_codes(p), before[n])), n


# ---- what ECO and QLion share (hfq.optim.base) ---------------------------------------------------------------

HFQ_OPTIMIZERS = {"ECOAdamW": ECOAdamW, "ECOSGD": ECOSGD, "QLion": QLion}


class _HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor value back to the host (on a GPU each is a sync)."""

    READS = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.item")

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += str(func.overloadpacket) in self.READS
        return func(*args, **(kwargs or {}))


def _mixed_grads():
    """A QParam with a bf16 .grad, one with an INT8 store, an fp32 bias: three kinds the check must cover."""
    a, b = _layer(), _layer("int8_dense_sparse")
    g = b.weight.grad
    b.weight.grad = None
    accumulate_int8_grad_(b.weight, g.float(), "b.weight")
    return a, b


@pytest.mark.parametrize("name", sorted(HFQ_OPTIMIZERS))
def test_shared_checks_one_host_read_per_step_and_int8_nan_refused(name):
    cls = HFQ_OPTIMIZERS[name]
    a, b = _mixed_grads()
    params = list(a.parameters()) + list(b.parameters())
    for bad, field in ((dict(lr=0.0), "lr"), (dict(lr=float("nan")), "lr"), (dict(weight_decay=-1.0), "weight_decay"),
                       (dict(weight_decay=float("nan")), "weight_decay"), (dict(rounding="up"), "rounding"),
                       (dict(lr=True), "lr")):
        with pytest.raises(ValueError, match=field):
            cls(params, **bad)
    opt = cls(params, lr=1e-2)
    with _HostReads() as reads:
        opt._finish_check(opt._begin_step(None)[1])
    assert reads.n == 1  # one read for all gradients (float .grad of two dtypes and the INT8 store)
    int8_grad(b.weight).finite.fill_(False)  # as an INT8 store that received a NaN records it
    codes = [_codes(a.weight), _codes(b.weight)]
    bias = a.bias.detach().clone()
    with pytest.raises(ValueError, match=r"non-finite gradient \(NaN/Inf\) in b\.weight"):
        opt.step()
    assert torch.equal(a.bias, bias) and int8_grad(b.weight) is not None
    assert all(torch.equal(x, y) for x, y in zip(_codes(a.weight) + _codes(b.weight), codes[0] + codes[1]))


@pytest.mark.real_model
def test_smollm2_trainer_default_optim_refused(smollm2, tmp_path):
    """SmolLM2-135M-Instruct with QFTConfig() given to Trainer with no optimizer (transformers' default fused
    AdamW): refused at the first step with the hfq optimizer to use, every quantized weight untouched.
    Its first 4 decoder layers only (real weights and shapes; the full 30 take a minute to quantize on CPU)."""
    m = AutoModelForCausalLM.from_pretrained(smollm2, quantization_config=QFTConfig(), dtype=torch.bfloat16,
                                             num_hidden_layers=4)
    qps = {n: _codes(p) for n, p in m.named_parameters() if isinstance(p, QParam)}
    assert len(qps) == 7 * m.config.num_hidden_layers
    ids = torch.randint(100, 10_000, (2, 16), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(tmp_path, max_steps=1, per_device_train_batch_size=1, report_to=[], use_cpu=True,
                             save_strategy="no", disable_tqdm=True)
    tr = Trainer(model=m, args=args, train_dataset=[{"input_ids": x, "labels": x} for x in ids])
    with pytest.raises(TypeError, match=HINT):
        tr.train()
    assert tr.optimizer.optimizer.defaults["fused"]
    for n, p in m.named_parameters():
        if n in qps:
            assert all(torch.equal(a, b) for a, b in zip(_codes(p), qps[n])), n
