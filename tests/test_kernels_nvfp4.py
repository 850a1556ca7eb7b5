"""NVFP4 Triton kernels vs the torch oracle (hfq_kernels.reference.fp4).

On CPU the kernels run under TRITON_INTERPRET=1 at small shapes (odd multiples of 16 included); with CUDA the
same tests run on the GPU, plus full-shape checks. Outputs are poisoned with NaN before each run.
"""
import json
import math
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

from hfq_kernels.reference import fp4
from hfq_kernels import lora_nvfp4 as LN
from hfq_kernels import nvfp4 as K
from hfq_kernels import nvfp4_configs as CF
from hfq_kernels import nvfp4_gluon as gluon
from hfq_kernels import nvfp4_matmul as MM
from hfq_kernels import nvfp4_plan as P

from _hfq_test_utils import compile_for_sm90

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(n, k, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 0.5, n)[:, None]
    w[0, :16] = 0.0  # an all-zero block
    if k >= 32:
        w[0, 16:32] = -0.0
    w[min(1, n - 1), :16] *= 1e-5  # block scale in E4M3's subnormal range
    return w.to(dtype).to(DEV)


def _rel(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


def _linear(x, p, s, r, b=None, config=None):
    """y through a plan made for this call: what hfq::nvfp4_linear's CUDA kernel runs (config forced or chosen)."""
    return K.plan_linear(x, p, s, r, b, config=config).forward(x, b)


@pytest.mark.parametrize("n,k", [(37, 160), (16, 48), (5, 272)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_bit_identical(n, k, dtype):
    w = _weight(n, k, dtype, seed=n + k)
    p, s, r = K.quantize(w)
    rp, rs, rr = fp4.nvfp4_quantize(w.cpu())
    assert torch.equal(p.cpu(), rp)
    assert torch.equal(s.view(torch.uint8).cpu(), rs.view(torch.uint8))
    assert torch.equal(r.cpu(), rr)


def test_quantize_rounding_ties_and_extremes():
    # values landing exactly on E2M1 decision boundaries and on E4M3 rounding ties
    k = 64
    base = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -2.5, -5.0, 0.1, -6.0, 3.0, 1.0])
    w = torch.stack([base * 2.0 ** e for e in range(-8, 8)]).repeat(1, k // 16)
    w[:, 16:32] *= 1.0 + 2.0 ** -4  # E4M3 ties in the block scale
    w = w.to(DEV)
    p, s, r = K.quantize(w)
    rp, rs, rr = fp4.nvfp4_quantize(w.cpu())
    assert torch.equal(p.cpu(), rp) and torch.equal(s.view(torch.uint8).cpu(), rs.view(torch.uint8))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_bit_identical(out_dtype):
    w = _weight(29, 96, seed=3)
    p, s, r = K.quantize(w)
    out = torch.full((29, 96), float("nan"), dtype=out_dtype, device=DEV)
    d = K.dequantize(p, s, r, out_dtype, out=out)
    ref = fp4.nvfp4_dequantize(p.cpu(), s.cpu(), r.cpu(), out_dtype)
    assert torch.equal(d.cpu(), ref)


LINEAR_CASES = [
    # (M, K, N, config): swap-AB decode tiles with/without split-K (even, uneven, K tail), large-M tiles
    (1, 96, 40, dict(kind="tile", BN=32, BM=16, BK=32, split=1, warps=4, stages=2)),
    (1, 96, 40, dict(kind="gemv", BN=16, BM=1, BK=32, split=1, warps=4, stages=2)),  # CUDA-core GEMV
    (3, 160, 24, dict(kind="gemv", BN=8, BM=4, BK=64, split=2, warps=4, stages=2)),  # K tail, uneven split
    (3, 160, 48, dict(kind="tile", BN=16, BM=16, BK=64, split=2, warps=4, stages=2)),  # K tail + uneven split
    (16, 256, 32, dict(kind="tile", BN=32, BM=16, BK=64, split=4, warps=4, stages=2)),
    (17, 80, 24, dict(kind="tile", BN=16, BM=32, BK=32, split=1, warps=4, stages=2)),
    (70, 128, 72, dict(kind="tile", BN=64, BM=32, BK=64, split=1, warps=4, stages=2)),
    # decode kernel: int32 word loads, fp16 decode, per-row x scaling; prefetch, split-K partials + reduce
    # (BK >= 128: each of the 8 per-code-position tensor-core dots needs K >= 16 on the GPU)
    (1, 96, 40, dict(kind="words", BN=32, BM=16, BK=128, split=1, prefetch=True)),  # K < BK
    (3, 400, 48, dict(kind="words", BN=32, BM=16, BK=128, split=2, prefetch=True)),  # K tail + uneven split
    (17, 528, 24, dict(kind="words", BN=32, BM=16, BK=128, split=3, prefetch=False)),
    (5, 256, 64, dict(kind="words", BN=32, BM=16, BK=128, split=2, prefetch=True)),  # one K tile per split, no tail
]


@pytest.mark.parametrize("m,k,n,cfg", LINEAR_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_kernel_matches_float64(m, k, n, cfg, bias):
    g = torch.Generator().manual_seed(m * 7 + n)
    p, s, r = K.quantize(_weight(n, k, seed=m + n))
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEV)
    b = torch.randn(n, generator=g).to(torch.bfloat16).to(DEV) if bias else None
    ref = x.double() @ fp4.nvfp4_dequantize(p, s, r, torch.float32).double().T
    if bias:
        ref = ref + b.double()
    y = _linear(x, p, s, r, b, config=cfg)
    assert torch.isfinite(y).all()
    assert _rel(y, ref) <= 1e-2


def test_words_kernel_wide_x_range_and_fp16():
    """Rows of x spanning 1e-4..1e3 (bf16: per-row power-of-two scaling into fp16) and an fp16 input."""
    p, s, r = K.quantize(_weight(40, 256, seed=11))
    wf = fp4.nvfp4_dequantize(p, s, r, torch.float32).double()
    cfg = dict(kind="words", BN=32, BM=16, BK=128, split=2, prefetch=True)
    for dt, hi in ((torch.bfloat16, 3.0), (torch.float16, 1.0)):
        x = (torch.randn(5, 256) * torch.logspace(-4, hi, 5)[:, None]).to(dt).to(DEV)
        y = _linear(x, p, s, r, config=cfg)
        ref = x.double() @ wf.T
        for i in range(5):  # every row accurate on its own, not only the large ones
            assert _rel(y[i], ref[i]) <= 1e-2


@pytest.mark.parametrize("kind", ["tile", "gemv"])
def test_atomic_kinds_run_unsplit_under_deterministic_algorithms(monkeypatch, kind):
    """tile / gemv split over K add their partial sums with float atomics in no fixed order (bits differ from run
    to run on a GPU); under torch.use_deterministic_algorithms(True) they run one split, with the same values."""
    p, s, r = K.quantize(_weight(40, 256, seed=2))
    x = torch.randn(3, 256).to(torch.bfloat16).to(DEV)
    cfg = dict(kind=kind, BN=16 if kind == "tile" else 8, BM=16 if kind == "tile" else 4, BK=64, split=4, warps=4,
               stages=2)
    seen, launch, gemv = [], P._launch, MM._gemv_kernel
    monkeypatch.setattr(P, "_launch",
                        lambda kern, grid, *a, **kw: seen.append(grid[-1]) or launch(kern, grid, *a, **kw))
    monkeypatch.setattr(P, "_gemv_kernel", _GridSpy(gemv, seen))
    split = _linear(x, p, s, r, config=cfg)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        one = _linear(x, p, s, r, config=cfg)
    finally:
        torch.use_deterministic_algorithms(was)
    assert seen == [4, 1]
    ref = x.double() @ fp4.nvfp4_dequantize(p, s, r, torch.float32).double().T
    assert _rel(one, ref) <= 1e-2 and _rel(one, split) <= 1e-2


class _GridSpy:
    """kernel[grid](...) that records the grid's last axis (the split) before launching."""

    def __init__(self, kernel, seen):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        self.seen.append(grid[-1])
        return self.kernel[grid]


def test_linear_fp16_and_batch_dims():
    p, s, r = K.quantize(_weight(24, 64, seed=5))
    x = torch.randn(2, 3, 64).to(torch.float16).to(DEV)
    y = _linear(x, p, s, r, config=dict(kind="tile", BN=16, BM=16, BK=32, split=2, warps=4, stages=2))
    ref = x.double() @ fp4.nvfp4_dequantize(p, s, r, torch.float32).double().T
    assert y.shape == (2, 3, 24) and y.dtype == torch.float16
    assert _rel(y, ref) <= 1e-2


@pytest.mark.parametrize("m,n,k", [(5, 48, 64), (33, 64, 96)])
def test_grad_input_matches_float64(m, n, k):
    p, s, r = K.quantize(_weight(n, k, seed=n))
    gy = torch.randn(m, n).to(torch.bfloat16).to(DEV)
    gx = K.grad_input(gy, p, s, r)
    ref = gy.double() @ fp4.nvfp4_dequantize(p, s, r, torch.float32).double()
    assert gx.shape == (m, k) and torch.isfinite(gx).all() and _rel(gx, ref) <= 1e-2
    assert torch.equal(K.plan_linear(torch.zeros(3, k, device=DEV), p, s, r).grad(gy), gx)
    assert _rel(K.grad_input(gy.view(1, m, n), p, s, r), ref) <= 1e-2


PLAN_CASES = [  # (x shape, dtype, table entry for this shape; None: the M > 64 default / no tuning)
    ((2, 3, 64), torch.bfloat16, dict(kind="words", BN=32, BM=16, BK=128, split=1, prefetch=True)),
    ((5, 64), torch.float16, dict(kind="words", BN=32, BM=16, BK=128, split=2, prefetch=False)),
    ((3, 64), torch.bfloat16, dict(kind="gemv", BN=16, BM=4, BK=32, split=2, warps=4, stages=2)),
    ((9, 64), torch.float16, dict(kind="tile", BN=16, BM=16, BK=32, split=1, warps=4, stages=2)),
    ((70, 64), torch.bfloat16, dict(kind="dequant")),
    ((4, 64), torch.float32, None),  # not a matmul dtype: dequantize + F.linear
]


@pytest.mark.parametrize("shape,dtype,cfg", PLAN_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_plan_matches_linear_and_grad_input(monkeypatch, shape, dtype, cfg, bias):
    """A LinearPlan kept for a shape (NVFP4Linear's eager path) computes what a plan made per call with the same
    config (the op's path) and grad_input() compute, bit for bit; a change of the tuned table marks it stale."""
    p, s, r = K.quantize(_weight(40, 64, seed=3))
    x = torch.randn(*shape).to(dtype).to(DEV)
    b = torch.randn(40).to(dtype).to(DEV) if bias else None
    m = x.numel() // 64
    if cfg is not None and not gluon.supported(x.reshape(-1, 64)):
        monkeypatch.setitem(CF.LINEAR_TUNER.cache, K.Tuner.key(m, 40, 64, dtype, x.device), cfg)
    plan = K.plan_linear(x, p, s, r, b)
    assert plan.final and plan.gen == CF.LINEAR_TUNER.gen
    want = cfg if cfg is not None and plan.config is not None and plan.config["kind"] != "gluon" else plan.config
    assert plan.config == want
    y = plan.forward(x, b)
    ref = (_linear(x, p, s, r, b, config=plan.config) if plan.config
           else F.linear(x, K.dequantize(p, s, r, dtype), b))
    assert y.shape == (*shape[:-1], 40) and y.dtype == dtype
    assert torch.equal(y, ref)
    assert torch.equal(plan.forward(x, b), ref)  # reusable
    gy = torch.randn_like(y)
    assert torch.equal(plan.grad(gy), K.grad_input(gy, p, s, r))
    monkeypatch.setitem(CF.LINEAR_TUNER.cache, "hfq-test-entry", {"kind": "dequant"})
    assert plan.gen != CF.LINEAR_TUNER.gen


def test_plan_validates_once_with_linears_errors():
    p, s, r = K.quantize(_weight(16, 32))
    x = torch.randn(2, 32, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="in_features"):
        K.plan_linear(torch.randn(2, 48, device=DEV, dtype=torch.bfloat16), p, s, r)
    with pytest.raises(ValueError, match="weight_scale"):
        K.plan_linear(x, p, s[:, :1], r)
    with pytest.raises(ValueError, match="bias must have shape"):
        K.plan_linear(x, p, s, r, torch.zeros(15, device=DEV, dtype=torch.bfloat16))


def test_tuner_gen_follows_every_cache_change():
    t = K.Tuner("hfq_test_gen")
    seen = [t.gen]
    for change in (lambda: t.cache.__setitem__("a", {}), lambda: t.cache.update(b={}), lambda: t.cache.pop("a"),
                   lambda: t.cache.setdefault("c", {}), lambda: t.cache.clear(), lambda: setattr(t, "cache", {"d": {}})):
        change()
        assert t.gen not in seen
        seen.append(t.gen)
    assert t.cache == {"d": {}} and t.cached(1, 2, 3, torch.float16, torch.device("cpu")) is None


def test_unknown_config_kind_raises():
    p, s, r = K.quantize(_weight(16, 32))
    x = torch.randn(2, 32).to(torch.bfloat16).to(DEV)
    with pytest.raises(ValueError, match="unknown kind"):
        _linear(x, p, s, r, config=dict(kind="t"))


def test_shipped_tables_name_known_kinds():
    """Every shipped tuned entry names a kind that a plan can run."""
    for key, cfg in CF.LINEAR_TUNER.cache.items():
        assert cfg["kind"] in CF.KINDS, (key, cfg)


def test_op_autograd_x_and_bias():
    w = _weight(24, 48, seed=9)
    p, s, r = torch.ops.hfq.nvfp4_quantize(w)
    x = torch.randn(4, 48, dtype=torch.float32, device=DEV, requires_grad=True)
    b = torch.randn(24, dtype=torch.float32, device=DEV, requires_grad=True)
    y = torch.ops.hfq.nvfp4_linear(x, p, s, r, b)
    gy = torch.randn_like(y)
    y.backward(gy)
    wd = fp4.nvfp4_dequantize(p, s, r, torch.float32).to(DEV)
    x2 = x.detach().clone().requires_grad_()
    b2 = b.detach().clone().requires_grad_()
    F.linear(x2, wd, b2).backward(gy)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad, b2.grad, rtol=1e-5, atol=1e-5)


def test_op_bias_without_grad_and_x_without_grad():
    p, s, r = torch.ops.hfq.nvfp4_quantize(_weight(16, 32, seed=2))
    x = torch.randn(3, 32, device=DEV)
    b = torch.randn(16, device=DEV, requires_grad=True)
    torch.ops.hfq.nvfp4_linear(x, p, s, r, b).sum().backward()
    torch.testing.assert_close(b.grad, torch.full_like(b, 3.0))


def test_bad_inputs_raise_value_error():
    p, s, r = K.quantize(_weight(16, 32))
    with pytest.raises(ValueError, match="in_features"):
        _linear(torch.randn(2, 48, device=DEV, dtype=torch.bfloat16), p, s, r)
    with pytest.raises(ValueError, match="weight_scale"):
        _linear(torch.randn(2, 32, device=DEV, dtype=torch.bfloat16), p, s[:, :1], r)
    with pytest.raises(ValueError, match="NaN"):
        K.quantize(torch.full((4, 16), float("nan"), device=DEV))
    with pytest.raises(ValueError, match="multiple of the block size"):
        K.quantize(torch.randn(4, 24, device=DEV))


def test_autotune_bucket_and_cache_key():
    assert [K.m_bucket(m) for m in (1, 2, 3, 16, 17, 1000, 9000)] == [1, 2, 4, 16, 32, 1024, 4096]
    key = K.Tuner.key(3, 512, 3584, torch.bfloat16, torch.device("cpu"))
    assert key == "m4|n512|k3584|bfloat16|cpu"
    t = K.Tuner("hfq_test_op")
    calls = []
    best = t.choose(key, [{"a": 1}], lambda c: (lambda: calls.append(c)), default={"a": 0}) if DEV == "cuda" else None
    if DEV == "cuda":
        assert best == {"a": 1} and t.choose(key, [], None, default={}) == {"a": 1}


def test_tuner_reads_a_same_kind_cards_entries(monkeypatch):
    """A card without entries of its own reads those of a listed card with its compute capability and SM count
    (never another kind's); once it has its own entry for a shape, that one is used."""
    from hfq_kernels import _autotune as A

    cards = {"Card A": {"capability": [9, 0], "sms": 132}, "Card B": {"capability": [8, 0], "sms": 108},
             "Card C": {"capability": [9, 0], "sms": 114}}
    assert A.same_kind(cards, "Card D", ((9, 0), 132)) == ["Card A"]
    assert A.same_kind(cards, "Card A", ((9, 0), 132)) == []
    assert A.same_kind(cards, "Card D", None) == []
    t = K.Tuner("hfq_test_kind")
    t.cards = cards
    monkeypatch.setattr(A, "device_name", lambda device: "Card D" if device.type == "cuda" else device.type)
    monkeypatch.setattr(A, "card_props", lambda device: ((9, 0), 132) if device.type == "cuda" else None)
    dev = torch.device("cuda", 0)
    a_cfg, b_cfg, own_cfg = {"kind": "a"}, {"kind": "b"}, {"kind": "own"}
    t.cache[K.Tuner.card_key(8, 64, 32, torch.bfloat16, "Card B")] = b_cfg
    assert t.cached(8, 64, 32, torch.bfloat16, dev) is None
    t.cache[K.Tuner.card_key(8, 64, 32, torch.bfloat16, "Card A")] = a_cfg
    assert t.cached(8, 64, 32, torch.bfloat16, dev) is a_cfg
    assert t.cached(5, 64, 32, torch.bfloat16, dev) is a_cfg  # the same M bucket
    assert t.cached(8, 64, 32, torch.bfloat16, torch.device("cpu")) is None
    t.cache[K.Tuner.key(8, 64, 32, torch.bfloat16, dev)] = own_cfg
    assert K.Tuner.key(8, 64, 32, torch.bfloat16, dev).endswith("|Card D")
    assert t.cached(8, 64, 32, torch.bfloat16, dev) is own_cfg


def test_shipped_table_lists_its_card():
    """Every card with entries in the shipped file is listed there (the live cache also holds this run's tunings)."""
    import json
    from pathlib import Path

    import hfq_kernels._autotune as AT

    data = json.loads((Path(AT.__file__).parent / "nvfp4_linear_tuned.json").read_text())
    assert data["cards"]["NVIDIA H100 80GB HBM3"] == {"capability": [9, 0], "sms": 132}
    assert CF.LINEAR_TUNER.cards["NVIDIA H100 80GB HBM3"] == {"capability": [9, 0], "sms": 132}
    cards = {k.rsplit("|", 1)[1] for k in data["nvfp4_linear"] if k.count("|") == 4}
    assert "NVIDIA H100 80GB HBM3" in cards and cards <= set(data["cards"]), cards - set(data["cards"])


@pytest.mark.skipif(DEV != "cuda", reason="needs a CUDA card's properties")
def test_gluon_config_on_this_card_follows_the_table():
    """On an H100 SXM or a card of its kind (H200: sm_90, 132 SMs) the decode config is the H100-tuned entry."""
    from hfq_kernels._autotune import device_name, same_kind
    from hfq_kernels._triton import card_props

    dev = torch.device("cuda", torch.cuda.current_device())
    h100 = "NVIDIA H100 80GB HBM3"
    t = CF.LINEAR_TUNER
    tuned = t.cache[K.Tuner.card_key(8, 18944, 3584, torch.bfloat16, h100)]
    own = t.cache.get(K.Tuner.key(8, 18944, 3584, torch.bfloat16, dev))
    got = CF.gluon_config(8, 18944, 3584, dev)
    if own is not None:
        assert got == own
    elif h100 in same_kind(t.cards, device_name(dev), card_props(dev)):
        assert got == tuned
    else:
        assert got == gluon.default_config(8, 18944, 3584, torch.cuda.get_device_properties(dev).multi_processor_count)


def test_tuner_margin_keeps_the_baseline_and_skips_failures():
    """choose() with a custom bench: a candidate must beat candidates[0] by the margin; a raising runner loses."""
    times = {"base": 1.0, "close": 0.98, "fast": 0.9, "bad": 0.1}

    def runner(c):
        if c["name"] == "bad":
            raise ValueError("miscomputes")
        return c["name"]

    t = K.Tuner("hfq_test_margin")
    pick = lambda key, names: t.choose(key, [{"name": n} for n in names], runner, {"name": "default"},
                                       bench=lambda fn: times[fn], margin=0.97)["name"]
    assert pick("a", ["base", "close", "bad"]) == "base"
    assert pick("b", ["base", "close", "fast", "bad"]) == "fast"
    assert pick("a", ["base", "fast"]) == "base"  # cached
    assert t.log[1]["timings"][-1][1]["error"].startswith("ValueError")


def test_tuner_with_every_candidate_failing_warns_and_does_not_store_the_fallback(tmp_path, monkeypatch):
    """A shape whose every candidate raises gets the fallback with a warning, for this process only: the cache
    file keeps the shapes that were really tuned, so a later process tries again."""
    from hfq_kernels._settings import SETTINGS

    path = tmp_path / "tuned.json"
    monkeypatch.setattr(SETTINGS, "autotune_cache", str(path))
    t = K.Tuner("hfq_test_all_fail")

    def runner(c):
        if c["name"] != "good":
            raise RuntimeError(f"{c['name']} does not build")
        return c["name"]

    with pytest.warns(RuntimeWarning, match="every candidate config failed.*bad does not build"):
        got = t.choose("k_fail", [{"name": "bad"}, {"name": "worse"}], runner, {"name": "default"},
                       bench=lambda fn: 1.0, fallback={"name": "safe"})
    assert got == {"name": "safe"} and t.cache["k_fail"] == got
    assert t.choose("k_fail", [], None, {"name": "default"}) == got  # kept in this process: no retuning per call
    t.choose("k_ok", [{"name": "bad"}, {"name": "good"}], runner, {"name": "default"}, bench=lambda fn: 1.0)
    stored = json.loads(path.read_text())["hfq_test_all_fail"]
    assert stored == {"k_ok": {"name": "good"}}
    with pytest.warns(RuntimeWarning, match="using {'name': 'default'}"):  # no fallback given: the default
        t.choose("k_fail2", [{"name": "bad"}], runner, {"name": "default"}, bench=lambda fn: 1.0)


def test_inline_ptx_build_failure_is_announced_once_and_the_plain_decode_runs():
    """_launch: a config whose inline-PTX decode fails to build runs the plain decode, with one warning."""
    calls = []

    class Kernel:  # stands in for a Triton kernel whose USE_ASM=True variant fails to compile
        fn = types.SimpleNamespace(__name__="_fake_mm_kernel")

        def __getitem__(self, grid):
            def launch(*args, USE_ASM, **kw):
                if USE_ASM:
                    raise RuntimeError("ptxas: unknown instruction")
                calls.append(kw["BN"])
            return launch

    with pytest.warns(RuntimeWarning, match="_fake_mm_kernel.*inline-PTX.*ptxas"):
        P._launch(Kernel(), (1,), True, BN=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        P._launch(Kernel(), (1,), True, BN=64)  # remembered: plain decode at once, no second warning
    assert calls == [64, 64]
    P._ASM_FAILED.pop(("_fake_mm_kernel", (("BN", 64),)))


def test_torch_compile_fullgraph_tiny_model():
    """A tiny Qwen2 whose decoder linears call hfq::nvfp4_linear compiles with fullgraph=True."""
    from hfq.tiny import tiny_model

    model = tiny_model("qwen2", hidden=64, intermediate=128)
    model = model.to(DEV)

    class Lin(torch.nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.p, self.s, self.r = torch.ops.hfq.nvfp4_quantize(lin.weight.data)
            self.bias = lin.bias

        def forward(self, x):
            return torch.ops.hfq.nvfp4_linear(x, self.p, self.s, self.r, self.bias)

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, mod in list(parent.named_children()):
                if isinstance(mod, torch.nn.Linear):
                    setattr(parent, name, Lin(mod))
    ids = torch.randint(4, 90, (2, 1), device=DEV)
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits
        torch._dynamo.reset()
        compiled = torch.compile(lambda t: model(t, use_cache=False).logits, fullgraph=True)
        out = compiled(ids)
    assert math.isfinite(out.float().sum().item())
    torch.testing.assert_close(out, eager, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="full-shape GPU check (CPU runs the small shapes above)")
@pytest.mark.parametrize("k,n", [(3584, 18944), (18944, 3584), (5120, 27648), (11008, 512)])
@pytest.mark.parametrize("m", [1, 3, 16, 17, 128, 1000])
def test_linear_full_shapes_gpu(k, n, m):
    p, s, r = K.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.ops.hfq.nvfp4_linear(x, p, s, r, None)
    ref = x.double() @ fp4.nvfp4_dequantize(p, s, r, torch.float32).double().T
    assert _rel(y, ref) <= 1e-2


@pytest.mark.parametrize("n,k", [(37, 160), (528, 3600), (16, 64)])
def test_g4_repack_layout_matches_reference(n, k):
    """gluon.repack + the Gluon kernel's bit-level decode (emulated in torch) give the canonical product."""
    w = _weight(n, k, seed=n + k).cpu()
    p, s, r = fp4.nvfp4_quantize(w)
    wr, sr = gluon.repack(p, s)
    assert wr.dtype == torch.int32 and wr.numel() == -(-n // 16) * 16 * -(-k // 64) * 64 // 8
    assert sr.dtype == torch.uint8 and sr.numel() == wr.numel() // 2
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    ref = x.double() @ fp4.nvfp4_dequantize(p, s, r, torch.float32).double().T
    assert _rel(gluon.emulate(x, wr, sr, n, k, r), ref) < 1e-6


_WORDS_SM90_IR = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hfq_kernels import nvfp4_matmul as MM

prefetch, cps1 = sys.argv[1] == "1", sys.argv[2] == "1"
sig = {"x_ptr": "*bf16", "wq_ptr": "*i32", "ws_ptr": "*u8", "recip_ptr": "*fp32", "b_ptr": "*fp32", "y_ptr": "*fp32",
       "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_ym": "i32", "chunks_per_split": "i32"}
consts = dict(BN=32, BM=16, BK=128, HAS_BIAS=False, PARTIAL=True, MASK_K=False, X_F16=False, PREFETCH=prefetch,
              F32_DOT=False)
if cps1:  # the launcher's chunks_per_split == 1 is specialised to a constant: no K loop
    consts["chunks_per_split"] = 1
k = triton.compile(ASTSource(fn=MM._words_kernel, signature=sig, constexprs=consts),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 1})
ir = k.asm["ttgir"]
print("dot", "tt.dot" in ir, "reshape", "tt.reshape" in ir, "join", "tt.join" in ir)
"""

_GLUON_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from hfq_kernels import nvfp4_gluon as gluon

if not gluon.HAS_GLUON:
    print("NO_GLUON")
    raise SystemExit(0)
sig = {"x_ptr": "*bf16", "wr_ptr": "*i32", "sr_ptr": "*u8", "recip_ptr": "*fp32", "b_ptr": "*bf16",
       "y_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "KC": "i32", "NT": "i32", "stride_xm": "i32",
       "stride_ym": "i32", "cps": "i32"}
src = GluonASTSource(fn=gluon._g4_kernel, signature=sig,
                     constexprs=dict(BM=16, R=2, HAS_BIAS=False, PARTIAL=True, PREFETCH=True))
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
print("shared", k.metadata.shared, "mma", "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in k.asm["ptx"])
# programmatic dependent launch: the wait comes after the first weight chunk's loads, before x's
src = GluonASTSource(fn=gluon._g4_kernel, signature=sig,
                     constexprs=dict(BM=16, R=2, HAS_BIAS=False, PARTIAL=True, PREFETCH=True, PDL=True))
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "launch_pdl": True})
ptx = k.asm["ptx"]
print("pdl", k.metadata.launch_pdl, ptx.count("griddepcontrol.wait") == 1,
      ptx.index("ld.global") < ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents"))
gsig = {"x_ptr": "*bf16"}
for g in range(3):
    gsig.update({f"wr{g}": "*i32", f"sr{g}": "*u8", f"rc{g}": "*fp32", f"b{g}": "*bf16", f"y{g}": "*fp32"})
gsig.update({n: "i32" for n in ("M", "K", "KC", "N0", "N1", "N2", "T0", "T1", "stride_xm", "cps")})
for groups in (2, 3):
    src = GluonASTSource(fn=gluon._g4_group_kernel, signature=gsig,
                         constexprs=dict(BM=8, R=2, HAS_BIAS=False, PARTIAL=True, PREFETCH=True, G=groups))
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    print("group", groups, "shared", k.metadata.shared,
          "mma", k.asm["ptx"].count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") > 0)
"""


def test_words_kernel_sm90_has_no_scale_reshape(prefetch=True, cps1=True):
    """Guard for an H100 miscompile (Triton 3.6): widening the [BN, BK/16] scale tile with tl.reshape(tl.join(...))
    gets the dot-operand layout (kWidth=8) pushed through it at BN=32 and every product comes out wrong; the kernel
    loads one scale byte per weight word, so no join/reshape may reach the IR. Checked in the configuration that
    fails (one K tile per split, so the scale tile is no loop-carried value)."""
    out = compile_for_sm90(_WORDS_SM90_IR, str(int(prefetch)), str(int(cps1)))
    assert out == ["dot", "True", "reshape", "False", "join", "False"]


_TILE_PTX_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hfq_kernels import nvfp4_matmul as MM

for dt in ("bf16", "fp16"):
    sig = {"x_ptr": "*" + dt, "wp_ptr": "*u8", "ws_ptr": "*u8", "recip_ptr": "*fp32", "b_ptr": "*" + dt,
           "y_ptr": "*" + dt, "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_ym": "i32",
           "chunks_per_split": "i32"}
    consts = dict(BN=64, BM=32, BK=128, HAS_BIAS=True, ATOMIC=False, USE_ASM=True, MASK_K=True, F32_DOT=False)
    k = triton.compile(ASTSource(fn=MM._mm_kernel, signature=sig, constexprs=consts),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})
    print(dt, "prmt.b32" in k.asm["ptx"])
"""


def test_tile_kernel_ptx_decode_compiles_for_sm90():
    """The tile kernel's inline-PTX decode builds (its PTX strings are constexpr globals: a plain str global made
    every build fail, and each config ran the plain decode after a warning)."""
    assert compile_for_sm90(_TILE_PTX_SM90) == ["bf16", "True", "fp16", "True"]


def test_g4_kernel_compiles_for_sm90_without_shared_memory():
    """The Gluon kernel's layout conversions are all register-only (assert_trivial) and it uses no shared memory."""
    out = compile_for_sm90(_GLUON_SM90)
    if out == ["NO_GLUON"]:
        pytest.skip("no gluon")
    assert out[:4] == ["shared", "0", "mma", "True"]
    assert out[4:8] == ["pdl", "True", "True", "True"]
    out = out[:4] + out[8:]
    # the grouped launch (q/k/v, gate/up) compiles with 2 and 3 members, also without shared memory
    assert out[4:] == ["group", "2", "shared", "0", "mma", "True", "group", "3", "shared", "0", "mma", "True"]


def test_autotune_rejects_a_config_that_miscomputes(monkeypatch):
    """The tuner's runner checks each candidate against dequantize + F.linear before timing it."""
    p, s, r = K.quantize(_weight(48, 128, seed=4))
    x = torch.randn(3, 128).to(torch.bfloat16).to(DEV)
    runner = P.checked_runner(x, p, s, r, None)
    assert callable(runner(dict(kind="dequant")))
    real = P.plan_linear

    def wrong_when_bad(*a, config=None, **kw):
        plan = real(*a, config=config, **kw)
        if config.get("bad"):
            plan.forward = (lambda fwd: lambda x, b: fwd(x, b) * 1.5)(plan.forward)
        return plan

    monkeypatch.setattr(P, "plan_linear", wrong_when_bad)
    with pytest.raises(ValueError, match="relative error"):
        runner(dict(kind="dequant", bad=True))


@pytest.mark.parametrize("m,ns,split,bias,dtype", [(1, (48, 16), 3, False, torch.bfloat16),
                                                   (5, (32, 16, 80), 2, True, torch.float16),
                                                   (13, (16, 64, 16), 7, True, torch.float32),
                                                   (3, (112, 48), 1, True, torch.bfloat16)])
def test_grouped_splitk_reduce_matches_torch(m, ns, split, bias, dtype):
    """The grouped launch's reduce: member g's partials [split, M, N_g], stored one member after another in one
    buffer, summed in split order (+ bias) into its own output; the per-weight reduce kernel's bits."""
    g = torch.Generator().manual_seed(m + split)
    parts = [torch.randn(split, m, n, generator=g) for n in ns]
    flat = torch.cat([p.reshape(-1) for p in parts]).to(DEV)
    bs = [torch.randn(n, generator=g).to(dtype).to(DEV) for n in ns]
    outs = [torch.full((m, n), float("nan"), dtype=dtype, device=DEV) for n in ns]
    three = (bs + bs[-1:], outs + outs[-1:]) if len(ns) == 2 else (bs, outs)
    n2 = ns[2] if len(ns) == 3 else ns[1]
    MM._splitk_reduce_group_kernel[(CF.cdiv(m * max(ns), 1024), len(ns))](
        flat, *three[0], *three[1], m, ns[0], ns[1], n2, split, HAS_BIAS=bias, BLOCK=1024)
    for p, b, y in zip(parts, bs, outs):
        single = torch.full_like(y, float("nan"))
        MM._splitk_reduce_kernel[(CF.cdiv(m * p.shape[2], 1024),)](p.contiguous().to(DEV), b, single, m, p.shape[2],
                                                                   split, p.shape[2], HAS_BIAS=bias, BLOCK=1024)
        assert torch.equal(y, single)
        ref = torch.zeros(m, p.shape[2])
        for part in p:  # split order, fp32
            ref += part
        ref += b.float().cpu() if bias else 0.0
        # within one rounding of the output dtype (the interpreter's fp32 -> bf16 cast is not round-to-nearest)
        tol = {torch.float32: 0.0, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
        torch.testing.assert_close(y.float().cpu(), ref, rtol=tol, atol=tol)


def test_grouped_linear_refuses_what_the_gluon_kernel_cannot_take():
    """linear_group_g4 raises (naming shapes, dtypes and scales) for input it cannot serve: here fp32 x on this
    device, or a single weight; the decoder asks group_g4_ok first and falls back to one launch per linear."""
    p, s, r = K.quantize(_weight(32, 64, seed=3))
    wr, sr = gluon.repack(p, s)
    w = (wr.to(DEV), sr.to(DEV), r.to(DEV), None, 32)
    x = torch.randn(2, 64, device=DEV)
    assert not LN.group_g4_ok(x, [w, w])
    with pytest.raises(ValueError, match=r"nvfp4 grouped linear: .*x \(2, 64\) torch.float32"):
        LN.linear_group_g4(x, [w, w])
    with pytest.raises(ValueError, match="2-3 g4 weights"):
        LN.linear_group_g4(x.to(torch.bfloat16), [w])
