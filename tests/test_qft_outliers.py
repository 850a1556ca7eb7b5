"""QFT's outliers (eq. 3, App. C): thresholds set at load, re-selected every `outlier_refresh_steps` optimizer steps
(QLion, ECOAdamW, ECOSGD) or by refresh_outliers_, within one INT8 step; memory of the sparse part; checkpoints."""
import io

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainerCallback, TrainingArguments

from hfq.eco import ECOAdamW, ECOSGD
from hfq.qft import (OutlierRefreshPerEpoch, QFTConfig, QFTLinear, QLion, quantize_model_, refresh_outliers_,
                     state_bytes)
from hfq.qparam import QParam
from hfq_kernels.reference.intq import outlier_thresholds


def _weight(rows=32, cols=128, seed=0, **meta):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    return nn.Parameter(QParam.from_float(w, "int8_dense_sparse", **meta))


def _outlier_set(q) -> set:
    return set(q.sparse_idx.tolist())


def _tiny_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return AutoModelForCausalLM.from_config(cfg)


def test_config_validation_names_the_field():
    for bad in (-1, 1.5, True, "3", None):
        with pytest.raises(ValueError, match="outlier_refresh_steps"):
            QFTConfig(outlier_refresh_steps=bad)
        with pytest.raises(ValueError, match="outlier_refresh_steps"):
            QFTConfig(weight_format="fp8_e4m3_row", outlier_refresh_steps=bad)  # refused whatever the format
    with pytest.raises(ValueError, match="outlier_refresh_steps"):
        QFTLinear.from_linear(nn.Linear(32, 8), "int8_dense_sparse", outlier_refresh_steps=-2)
    cfg = QFTConfig(outlier_refresh_steps=250)
    assert cfg.format_options == {"outlier_fraction": 0.01, "outlier_refresh_steps": 250}
    assert QFTConfig.from_dict(cfg.to_dict()).outlier_refresh_steps == 250
    assert QFTConfig().outlier_refresh_steps == 0
    assert "outlier_refresh_steps" not in QFTConfig(weight_format="fp8_e4m3_row").format_options


def test_refresh_within_one_int8_step_and_count_back_to_fraction():
    f = 0.02
    q = _weight(outlier_fraction=f)
    n, k = q.numel(), int(q.numel() * f / 2)
    assert len(_outlier_set(q)) == 2 * k == 80  # set at load: the two f/2 tails
    # every weight grows 1.5x under the thresholds set at load: far more elements now lie outside them
    q.requantize_(q.dequantize(torch.float32) * 1.5, "rtn")
    grown = _outlier_set(q)
    assert len(grown) > 4 * k
    before, s_old = q.dequantize(torch.float32), q.scales.clone()
    thr_old = q.thresholds.clone()
    assert refresh_outliers_(nn.Linear(4, 4)) == 0  # no int8_dense_sparse weight: nothing to do
    holder = nn.Module()
    holder.w = q
    assert refresh_outliers_(holder) == 1
    after, s_new = q.dequantize(torch.float32), q.scales
    assert len(_outlier_set(q)) == 2 * k  # back to fraction x numel
    assert torch.equal(q.thresholds, outlier_thresholds(before, f)) and not torch.equal(q.thresholds, thr_old)
    moved_to_dense = grown - _outlier_set(q)
    assert moved_to_dense and _outlier_set(q) <= grown  # outliers left the sparse part; none was added here
    # each element moved by at most half an INT8 step of its row (the larger of the old and new steps)
    bound = (torch.maximum(s_old, s_new) / 2).expand(-1, before.shape[1]) * (1 + 1e-5) + 1e-9
    assert ((after - before).abs() <= bound).all()
    # outliers that stayed sparse are bit-exact; the memory is back to the fraction at the price of coarser rows
    # (their dense part now spans the grown weights up to the new thresholds)
    kept = torch.tensor(sorted(_outlier_set(q)))
    assert torch.equal(after.reshape(-1)[kept], before.reshape(-1)[kept])
    assert (s_new >= s_old - 1e-12).all() and (s_new > s_old).any()
    assert n == 4096


@pytest.mark.parametrize("make", [
    lambda ps: QLion(ps, lr=1e-3, rounding="rtn", momentum_bits=None),
    lambda ps: ECOAdamW(ps, lr=1e-3, rounding="rtn", weight_decay=0.0),
    lambda ps: ECOSGD(ps, lr=1e-3, rounding="rtn"),
], ids=["QLion", "ECOAdamW", "ECOSGD"])
def test_optimizer_moves_a_grown_weight_to_the_sparse_part_on_schedule(make):
    """All weights shrink 2x, one grows to 0.9 T_max: the thresholds from load keep it dense (it stretches its
    row's INT8 range) until the refresh on step 3 (outlier_refresh_steps=3) re-sets them and makes it an outlier."""
    f = 0.02
    q = _weight(outlier_fraction=f, outlier_refresh_steps=3)
    v = q.dequantize(torch.float32) * 0.5
    v[0, 5] = 0.9 * float(q.thresholds[1])
    q.requantize_(v, "rtn")
    assert 5 not in _outlier_set(q)
    thr0, scale0 = q.thresholds.clone(), float(q.scales[0])
    opt = make([q])
    q.grad = torch.zeros(q.shape, dtype=torch.bfloat16)  # zero gradient: the steps move (almost) nothing
    for step in (1, 2):
        opt.step()
        assert torch.equal(q.thresholds, thr0) and 5 not in _outlier_set(q), step
    before, s_before = q.dequantize(torch.float32), q.scales.clone()
    opt.step()
    assert not torch.equal(q.thresholds, thr0)
    assert 5 in _outlier_set(q) and len(_outlier_set(q)) == 2 * int(q.numel() * f / 2)
    assert float(q.scales[0]) < 0.8 * scale0  # row 0's INT8 range no longer spans the grown weight
    assert float(q.dequantize(torch.float32)[0, 5]) == pytest.approx(float(v[0, 5]), rel=1e-2)
    bound = (torch.maximum(s_before, q.scales) / 2).expand(-1, q.shape[1]) * (1 + 1e-5) + 1e-9
    assert ((q.dequantize(torch.float32) - before).abs() <= bound).all()
    thr3 = q.thresholds.clone()
    for _ in (4, 5):
        opt.step()
        assert torch.equal(q.thresholds, thr3)
    # the step count that schedules the refresh is optimizer state: it survives state_dict()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    opt2 = make([q])
    opt2.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    key = "outlier_step" if isinstance(opt, ECOSGD) else "step"
    assert int(opt2.state[q][key]) == 5
    opt2.step()
    assert not torch.equal(q.thresholds, thr3)  # step 6 refreshes


def test_never_by_default_and_qlion_override():
    q = _weight()
    assert q.meta["outlier_refresh_steps"] == 0
    q.grad = torch.randn(q.shape).to(torch.bfloat16)
    thr = q.thresholds.clone()
    opt = QLion([q], lr=1e-3)
    for _ in range(4):
        opt.step()
    assert torch.equal(q.thresholds, thr)  # 0 = the thresholds from load are kept
    opt = QLion([q], lr=1e-3, refresh_thresholds_every=2)  # the optimizer's setting overrides the weight's
    opt.step()
    assert torch.equal(q.thresholds, thr)
    opt.step()
    assert not torch.equal(q.thresholds, thr)


def test_outliers_grown_past_three_times_their_fraction_are_announced_once():
    """Without re-selection, elements that cross the load-time thresholds stay bf16 outliers: an optimizer says so
    once, naming the weight and both remedies; with a refresh schedule it stays quiet."""
    import warnings

    for make, quiet in ((lambda q: QLion([q], lr=0.05), False), (lambda q: ECOSGD([q], lr=0.5), False),
                        (lambda q: QLion([q], lr=0.05, refresh_thresholds_every=100), True)):
        q = _weight(seed=3)
        q.place.name = "layer.weight"
        opt = make(q)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            shares = []
            for i in range(6):
                q.grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
                opt.step()
                shares.append(q.sparse_idx.numel() / q.numel())
        hits = [w for w in seen if "bf16 outliers" in str(w.message)]
        if quiet:
            assert not hits
            continue
        assert max(shares) > 0.03, shares  # the setting grows the outliers past 3 x 1%
        assert len(hits) == 1, [str(w.message) for w in seen]
        msg = str(hits[0].message)
        assert "layer.weight" in msg and "OutlierRefreshPerEpoch" in msg and "outlier_refresh_steps=N" in msg


def test_state_bytes_counts_the_sparse_part_by_hand():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 16, bias=False), nn.Linear(32, 8, bias=False))
    quantize_model_(model, QFTConfig(outlier_fraction=0.05, modules_to_not_convert=[]))
    a, b = model[0].weight, model[1].weight
    assert isinstance(a, QParam) and isinstance(b, QParam)
    # [16, 64]: 1024 B codes + 16 x (4 B scale + 1 B zero point) + 8 B thresholds + 2 x int(1024 x 0.025) = 50
    # outliers x (4 B int32 index + 2 B bf16 value); [8, 32]: 256 + 8 x 5 + 8 + 2 x int(6.4) = 12 outliers x 6 B
    s = state_bytes(model)
    assert (s["outliers"], s["weights_sparse"]) == (62, 62 * 6)
    assert s["weights"] == (1024 + 80 + 8 + 300) + (256 + 40 + 8 + 72) == 1788
    assert s["params"] == 1024 + 256 and s["total"] == 1788
    # the count follows the data: a weight that grows past the thresholds from load adds 6 B per new outlier
    a.requantize_(a.dequantize(torch.float32) * 2, "rtn")
    s2 = state_bytes(model)
    extra = a.sparse_idx.numel() - 50
    assert extra > 0 and s2["weights_sparse"] - s["weights_sparse"] == 6 * extra == s2["weights"] - s["weights"]


def test_refreshed_outliers_round_trip_save_pretrained(tmp_path):
    m = _tiny_llama()
    quantize_model_(m, QFTConfig(gradient_bits=8, outlier_fraction=0.05, outlier_refresh_steps=2))
    q = m.model.layers[0].mlp.down_proj.weight
    thr0 = q.thresholds.clone()
    opt = QLion(m.parameters(), lr=3e-3, seed=2)
    x = torch.randint(3, 96, (2, 12))
    for _ in range(3):  # refresh on step 2, then one step under the new thresholds
        m(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    assert not torch.equal(q.thresholds, thr0)
    m.save_pretrained(tmp_path)
    m2 = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert m2.config.quantization_config.outlier_refresh_steps == 2
    q2 = m2.model.layers[0].mlp.down_proj.weight
    assert isinstance(q2, QParam) and q2.meta["outlier_refresh_steps"] == 2
    sa, sb = m.state_dict(), m2.state_dict()
    assert sa.keys() == sb.keys() and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)


class _Thresholds(TrainerCallback):
    def __init__(self, q):
        self.q, self.seen = q, []

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append(self.q.thresholds.clone())


def test_trainer_callback_refreshes_once_per_epoch(tmp_path):
    m = _tiny_llama()
    quantize_model_(m, QFTConfig(gradient_bits=8))  # outlier_refresh_steps=0: only the callback's schedule
    q = m.model.layers[1].self_attn.o_proj.weight
    thr0 = q.thresholds.clone()
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, 96, (16, 12), generator=g)]
    opt = QLion(m.parameters(), lr=3e-3)
    rec = _Thresholds(q)
    # 16 rows / batch 4 = 4 batches, 2 per optimizer step: 2 steps per epoch, 2 epochs
    args = TrainingArguments(str(tmp_path), num_train_epochs=2, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                             save_strategy="no", max_grad_norm=0.0)
    Trainer(model=m, args=args, train_dataset=data, optimizers=(opt, None),
            callbacks=[OutlierRefreshPerEpoch(), rec]).train()
    assert opt.refresh_thresholds_every == 2 and len(rec.seen) == 4
    changed = [not torch.equal(a, b) for a, b in zip([thr0] + rec.seen, rec.seen)]
    assert changed == [False, True, False, True]  # the steps that end epoch 1 and epoch 2
    with pytest.raises(TypeError, match="hfq optimizer"):
        OutlierRefreshPerEpoch().on_train_begin(args, None, None, optimizer=torch.optim.SGD([nn.Parameter(
            torch.zeros(1))], lr=0.1), train_dataloader=[0])
    with pytest.raises(ValueError, match="outlier_refresh_steps"):
        OutlierRefreshPerEpoch().on_train_begin(args, None, None, optimizer=opt, train_dataloader=iter([0]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA route of outlier_thresholds (sort)")
@pytest.mark.parametrize("shape", [(1, 1000), (37, 129), (512, 2048)])
def test_outlier_thresholds_on_cuda_equal_the_cpu_kthvalue(shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 0.02
    for fraction in (0.0, 0.001, 0.01, 0.2):
        assert torch.equal(outlier_thresholds(w.cuda(), fraction).cpu(), outlier_thresholds(w, fraction))
