"""QFT's INT8 Triton kernels (hfq_kernels.int8; the interpreter on CPU) against their torch references, and QFT
training routed through them (decode, INT8 gradients, fused QLion) against the unfused torch path."""
import copy

import pytest
import torch

from hfq_kernels import int8 as K
from hfq_kernels import qlion as Q
from hfq_kernels.reference import intq, lion as R

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1, 1), (5, 7), (37, 301), (16, 1030), (3, 2049)]


def dense_sparse(rows, cols, seed, fraction=0.02, scale=0.02):
    torch.manual_seed(seed)
    w = torch.randn(rows, cols, device=DEV) * scale
    thr = intq.outlier_thresholds(w, fraction)
    d = intq.quantize_dense_sparse(w, thr)
    d["thresholds"] = thr
    return d


def int8(t):
    c, s, z = intq.quantize_int_asym(t, 8)
    return {"codes": c, "scales": s, "zeros": z}


def clone(d):
    return {k: v.clone() for k, v in d.items()}


@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_dequantize_matches_reference(rows, cols, dtype):
    d = dense_sparse(rows, cols, rows * cols)
    ref = intq.dequantize_dense_sparse(d["codes"], d["scales"], d["zeros"], d["sparse_idx"], d["sparse_val"], dtype)
    out = K.int8_dequantize_triton(d["codes"], d["scales"], d["zeros"], d["sparse_idx"], d["sparse_val"], dtype)
    assert out.dtype == dtype and torch.equal(out, ref)
    via_op = K.int8_dequantize(d["codes"], d["scales"], d["zeros"], d["sparse_idx"], d["sparse_val"], dtype)
    assert torch.equal(via_op, ref)


def test_dequantize_op_compiles():
    d = dense_sparse(16, 64, 0)
    fn = torch.compile(lambda c, s, z, i, v: K.int8_dequantize(c, s, z, i, v) * 2, fullgraph=True)
    ref = intq.dequantize_dense_sparse(d["codes"], d["scales"], d["zeros"], d["sparse_idx"], d["sparse_val"],
                                       torch.bfloat16) * 2
    assert torch.equal(fn(d["codes"], d["scales"], d["zeros"], d["sparse_idx"], d["sparse_val"]), ref)


@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("one_pass_max", [K.ONE_PASS_MAX, 0])  # each row read once / in blocks, twice
def test_quantize_rows_and_accumulate_match_reference(rows, cols, gdtype, one_pass_max, monkeypatch):
    monkeypatch.setattr(K, "ONE_PASS_MAX", one_pass_max)
    torch.manual_seed(cols)
    g1 = (torch.randn(rows, cols, device=DEV) * 1e-3).to(gdtype)
    g2 = (torch.randn(rows, cols, device=DEV) * 3e-3).to(gdtype)
    c = torch.empty(rows, cols, dtype=torch.uint8, device=DEV)
    s = torch.empty(rows, 1, device=DEV)
    z = torch.empty(rows, 1, dtype=torch.uint8, device=DEV)
    assert bool(K.int8_quantize_rows_(g1, c, s, z))
    same_codes(c, s, z, *intq.quantize_int_asym(g1, 8))
    stored = intq.dequantize_int_asym(c, s, z)
    assert bool(K.int8_quantize_rows_(g2, c, s, z, accumulate=True))
    same_codes(c, s, z, *intq.quantize_int_asym(g2.float() + stored, 8))


def same_codes(c, s, z, rc, rs, rz):
    """Equal to the reference on CPU (the interpreter follows its fp32 ops). On CUDA torch divides by a scalar
    through its reciprocal, so the reference's scales may differ by an ulp and a code sitting on a rounding
    boundary by one."""
    if DEV == "cpu":
        assert torch.equal(c, rc) and torch.equal(s, rs) and torch.equal(z, rz)
        return
    torch.testing.assert_close(s, rs, rtol=3e-7, atol=0)
    assert (z.int() - rz.int()).abs().max() <= 1  # a zero point on a rounding boundary shifts its row's codes
    a, b = intq.dequantize_int_asym(c, s, z), intq.dequantize_int_asym(rc, rs, rz)
    assert ((a - b).abs() <= s * 1.0001).all() and ((a - b).abs() > s * 0.5).float().mean() < 0.07


@pytest.mark.parametrize("one_pass_max", [K.ONE_PASS_MAX, 0])
def test_quantize_rows_flags_nonfinite_and_zeroes_it(one_pass_max, monkeypatch):
    monkeypatch.setattr(K, "ONE_PASS_MAX", one_pass_max)
    g = torch.randn(4, 33, device=DEV)
    g[2, 7], g[3, 0] = float("nan"), float("-inf")
    c = torch.empty(4, 33, dtype=torch.uint8, device=DEV)
    s, z = torch.empty(4, 1, device=DEV), torch.empty(4, 1, dtype=torch.uint8, device=DEV)
    assert not bool(K.int8_quantize_rows_(g, c, s, z))
    same_codes(c, s, z, *intq.quantize_int_asym(torch.nan_to_num(g, 0.0, 0.0, 0.0), 8))


def _lion_case(rows, cols, seed, int8_grad):
    d = dense_sparse(rows, cols, seed)
    torch.manual_seed(seed + 1)
    g = torch.randn(rows, cols, device=DEV) * 1e-3
    grad = int8(g) if int8_grad else {"value": g.bfloat16()}
    return d, grad, int8(torch.randn(rows, cols, device=DEV) * 1e-3)


@pytest.mark.parametrize("rows,cols,lr,wd,int8_grad", [(37, 301, 1e-3, 0.0, True), (16, 1030, 3e-3, 0.1, False),
                                                        (5, 7, 5e-3, 0.0, True), (9, 2049, 1e-4, 0.01, True),
                                                        (12, 96, 2e-2, 0.0, True)])
def test_qlion_step_rtn_equals_reference(rows, cols, lr, wd, int8_grad):
    d, grad, mom = _lion_case(rows, cols, rows + cols, int8_grad)
    kw = dict(lr=lr, beta1=0.9, beta2=0.99, weight_decay=wd, rounding="rtn")
    d1, m1, d2, m2 = clone(d), clone(mom), clone(d), clone(mom)
    i1, v1 = Q.qlion_dense_sparse_step_(d1, grad, m1, **kw)
    i2, v2 = R.qlion_dense_sparse_step_ref(d2, grad, m2, **kw)
    same_codes(d1["codes"], d1["scales"], d1["zeros"], d2["codes"], d2["scales"], d2["zeros"])
    same_codes(m1["codes"], m1["scales"], m1["zeros"], m2["codes"], m2["scales"], m2["zeros"])
    assert torch.equal(i1, i2) and torch.equal(v1, v2)
    assert not torch.equal(d1["codes"], d["codes"])  # the step moved the weight
    if lr >= 2e-2:  # large steps: some outliers return to the dense part, some dense elements leave it
        assert not set(d["sparse_idx"].tolist()) <= set(i1.tolist())
        assert not set(i1.tolist()) <= set(d["sparse_idx"].tolist())


def test_qlion_step_sr_is_unbiased_and_within_one_step():
    d, grad, mom = _lion_case(3, 80, 3, True)
    kw = dict(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.0)
    d_ref, m_ref = clone(d), clone(mom)
    # the exact (unrounded) update, from the reference's float ops
    val = intq.dequantize_dense_sparse(d["codes"], d["scales"], d["zeros"], d["sparse_idx"], d["sparse_val"])
    g = intq.dequantize_int_asym(grad["codes"], grad["scales"], grad["zeros"])
    m = intq.dequantize_int_asym(mom["codes"], mom["scales"], mom["zeros"])
    exact = val - kw["lr"] * torch.sign(m * 0.9 + g * 0.1)
    R.qlion_dense_sparse_step_ref(d_ref, grad, m_ref, rounding="rtn", **kw)
    step = d_ref["scales"]
    runs = []
    for seed in range(120):
        d1, m1 = clone(d), clone(mom)

        i, v = Q.qlion_dense_sparse_step_(d1, grad, m1, rounding="sr", seed=seed, **kw)
        out = intq.dequantize_dense_sparse(d1["codes"], d1["scales"], d1["zeros"], i, v)
        assert ((out - exact).abs() <= step * 1.0001).all()
        runs.append(out)
    mean = torch.stack(runs).mean(0)
    assert ((mean - exact).abs() / step).mean() < 0.06  # RTN's mean error would be ~0.25 steps
    assert len({r.sum().item() for r in runs}) > 60  # different seeds draw differently


# ---- through the model: decode, INT8 gradients and the fused step together -----------------------------------
def _tiny_qft(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    from hfq.qft import QFTConfig, quantize_model_

    torch.manual_seed(seed)
    # small: under the interpreter (CPU) every weight row is a Python-run program
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).to(DEV)
    quantize_model_(model, QFTConfig(gradient_bits=8, outlier_fraction=0.02))
    return model


def _train(model, opt, steps, seed=0):
    torch.manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 32, (2, 16), device=DEV)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("rounding", ["rtn", "sr"])
def test_qft_training_through_kernels_matches_torch_path(monkeypatch, rounding):
    import hfq.qparam
    from hfq.qft import QLion

    steps = 3 if rounding == "rtn" else 1  # SR: other draws, so trajectories part after the first step
    ref = _tiny_qft()
    _train(ref, QLion(ref.parameters(), lr=3e-3, rounding=rounding, fused=False), steps)
    monkeypatch.setattr(hfq.qparam.formats, "FORCE_INT8_KERNELS", True)
    fused = _tiny_qft()
    before = _snapshot(fused)
    _train(fused, QLion(fused.parameters(), lr=3e-3, rounding=rounding, fused=True), steps)
    a, b = _snapshot(ref), _snapshot(fused)
    assert a.keys() == b.keys()
    moved = [k for k in b if not torch.equal(b[k], before[k])]
    assert any(k.endswith("weight_codes") for k in moved)
    if rounding == "rtn" and DEV == "cpu":
        for k in a:
            assert torch.equal(a[k], b[k]), k
    elif rounding == "rtn":  # CUDA: torch's path divides by a scalar through its reciprocal (an ulp in the scales)
        for k in a:
            if k.endswith("weight_codes"):
                assert ((a[k].int() - b[k].int()).abs() > 1).float().mean() < 1e-3, k
    else:  # same gradients, other SR draws: every code within one step of the torch path's
        for k in a:
            if k.endswith("weight_codes"):
                diff = (a[k].int() - b[k].int()).abs()
                assert diff.max() <= 1 and 0 < diff.float().mean() < 0.6, k


def test_fused_qlion_resumes_bit_exactly(monkeypatch):
    import hfq.qparam
    from hfq.qft import QLion

    monkeypatch.setattr(hfq.qparam.formats, "FORCE_INT8_KERNELS", True)
    full = _tiny_qft()
    opt = QLion(full.parameters(), lr=3e-3, fused=True)
    _train(full, opt, 1, seed=1)
    sd_m, sd_o = _snapshot(full), copy.deepcopy(opt.state_dict())  # the checkpoint after step 1
    _train(full, opt, 1, seed=2)
    resumed = _tiny_qft(seed=5)  # other random weights until loaded
    resumed.load_state_dict(sd_m)
    opt_r = QLion(resumed.parameters(), lr=3e-3, fused=True)
    opt_r.load_state_dict(sd_o)
    _train(resumed, opt_r, 1, seed=2)
    a, b = _snapshot(full), _snapshot(resumed)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_thresholds_within_lr_of_zero_take_the_torch_path():
    """The kernels see old outliers as dense zeros; where an updated zero (+-lr) could itself cross the thresholds
    the step must not use them (it would list such outliers twice): QLion falls back to the torch ops."""
    from hfq.qft import QLion
    from hfq.qparam import QParam
    from hfq_kernels.qlion import zero_may_cross

    torch.manual_seed(0)
    w = torch.rand(8, 32, device=DEV) + 0.5  # all positive: the lower threshold is above -lr
    p = torch.nn.Parameter(QParam.from_float(w, "int8_dense_sparse", outlier_fraction=0.05))
    assert zero_may_cross(p.thresholds, 1e-3) and not zero_may_cross(torch.tensor([-1.0, 1.0], device=DEV), 1e-3)
    opt = QLion([p], lr=1e-3, fused=True)
    assert not opt._use_fused(p, opt.param_groups[0])
    ref = torch.nn.Parameter(QParam.from_float(w, "int8_dense_sparse", outlier_fraction=0.05))
    opt_ref = QLion([ref], lr=1e-3, fused=False)
    for q, o in ((p, opt), (ref, opt_ref)):
        q.grad = torch.randn(8, 32, device=DEV, generator=torch.Generator(device=DEV).manual_seed(1)).bfloat16()
        o.step()
    assert torch.equal(p.dequantize(), ref.dequantize())


@pytest.mark.parametrize("dtype,wd,shape", [(torch.bfloat16, 0.0, (13, 70)), (torch.bfloat16, 0.1, (33,)),
                                             (torch.float32, 0.01, (5, 2050))])
def test_plain_param_step_matches_reference_and_qlion(dtype, wd, shape):
    """Ordinary parameters (embeddings, norms, lm_head) under QLion with INT8 momentum: the two-launch kernel equals
    its one-rounding-per-op reference (bit for bit on CPU), and QLion(fused=True) stays within last bits of the
    torch path over 3 steps."""
    from hfq.qft import QLion
    from hfq_kernels.reference.intq import as_rows

    torch.manual_seed(0)
    init = torch.randn(shape, device=DEV).to(dtype)
    rows, cols = as_rows(shape)
    mom = int8(torch.randn(rows, cols, device=DEV) * 1e-2)
    g = torch.randn(shape, device=DEV).to(dtype)
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=wd)
    p1, p2, m1, m2 = init.clone(), init.clone(), clone(mom), clone(mom)
    Q.lion_plain_step_(p1, g, m1, **kw)
    R.lion_plain_step_ref(p2, g, m2, **kw)
    assert not torch.equal(p1, init)
    if DEV == "cpu":
        assert torch.equal(p1, p2)
        for k in m1:
            assert torch.equal(m1[k], m2[k]), k
    ps = [torch.nn.Parameter(init.clone()) for _ in range(2)]
    opts = [QLion([ps[0]], lr=1e-2, weight_decay=wd, fused=False, rounding="rtn"),  # SR: other draws per path
            QLion([ps[1]], lr=1e-2, weight_decay=wd, fused=True, rounding="rtn")]
    assert opts[1]._plain_fused(ps[1], ps[1]) and not opts[0]._plain_fused(ps[0], ps[0])
    for step in range(3):
        g = torch.randn(shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(step)).to(dtype)
        for p, o in zip(ps, opts):
            p.grad = g.clone()
            o.step()
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20
    assert ((ps[0].float() - ps[1].float()).abs() <= 2 * ulp * ps[0].float().abs().clamp_min(1e-2)).all()
    sa, sb = opts[0].state[ps[0]], opts[1].state[ps[1]]
    torch.testing.assert_close(sa["exp_avg_scales"], sb["exp_avg_scales"], rtol=1e-5, atol=0)
    assert (sa["exp_avg_codes"].int() - sb["exp_avg_codes"].int()).abs().max() <= 1


@pytest.mark.parametrize("sort_max", [4096, 1])
def test_multi_tensor_step_equals_reference_per_weight(monkeypatch, sort_max):
    """One QLion launch pair over weights of several shapes and gradient kinds (INT8 codes, bf16 values: two
    buckets) equals the reference weight by weight, on each of two steps (each from the kernel's own state): the
    second reads the row segments the first wrote (they equal a search of the new lists). sort_max=1: rows are
    merged by torch instead of in the kernel."""
    monkeypatch.setattr(Q, "SORT_MAX", sort_max)
    cases = [(13, 301, True), (6, 1030, False), (5, 7, True), (12, 96, True), (2, 9, False)]
    kw = dict(lr=2e-2, beta1=0.9, beta2=0.99, weight_decay=0.01, rounding="rtn")
    fused = []
    for i, (r, c, q8) in enumerate(cases):
        d, grad, mom = _lion_case(r, c, 100 + i, q8)
        assert not Q.zero_may_cross(d["thresholds"], kw["lr"])
        fused.append((d, grad, mom))
    for step in range(2):
        ref = [(clone(d), g, clone(m)) for d, g, m in fused]
        ctx = Q.qlion_dense_sparse_begin([(d, g, m, 7 + j) for j, (d, g, m) in enumerate(fused)], **kw)
        new = Q.qlion_dense_sparse_finish(ctx, ctx["sync"].tolist())
        for (d, g, m), (idx, val, ptr) in zip(fused, new):
            Q.store_outliers_(d["sparse_idx"], d["sparse_val"], (idx, val, ptr), d["codes"].shape[1])
            rows, cols = d["codes"].shape
            bounds = torch.arange(rows + 1, device=DEV, dtype=torch.int32) * cols
            assert torch.equal(ptr, torch.searchsorted(d["sparse_idx"], bounds).to(torch.int32))
            assert K.row_segments(d["sparse_idx"], rows, cols) is ptr
        moved = 0
        for (d1, _, m1), (d2, g2, m2) in zip(fused, ref):
            i2, v2 = R.qlion_dense_sparse_step_ref(d2, g2, m2, **kw)
            same_codes(d1["codes"], d1["scales"], d1["zeros"], d2["codes"], d2["scales"], d2["zeros"])
            same_codes(m1["codes"], m1["scales"], m1["zeros"], m2["codes"], m2["scales"], m2["zeros"])
            assert torch.equal(d1["sparse_idx"], i2) and torch.equal(d1["sparse_val"], v2)
            moved += i2.numel() != 0
        assert moved >= 3


def test_plain_multi_step_equals_reference_per_parameter():
    """Ordinary parameters of mixed dtypes (fp32 / bf16 parameters, bf16 / fp32 gradients: several buckets) in one
    call equal lion_plain_step_ref one by one."""
    torch.manual_seed(3)
    shapes = [((13, 70), torch.bfloat16, torch.bfloat16), ((33,), torch.float32, torch.bfloat16),
              ((5, 2050), torch.float32, torch.float32), ((2, 3), torch.bfloat16, torch.float32)]
    from hfq_kernels.reference.intq import as_rows

    ps, gs, ms, refs = [], [], [], []
    for shape, pd, gd in shapes:
        p = torch.randn(shape, device=DEV).to(pd)
        m = int8(torch.randn(*as_rows(shape), device=DEV) * 1e-2)
        ps.append(p)
        gs.append(torch.randn(shape, device=DEV).to(gd))
        ms.append(m)
        refs.append((p.clone(), clone(m)))
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1)
    Q.lion_plain_multi_step_(ps, gs, ms, **kw)
    for p, g, m, (p2, m2) in zip(ps, gs, ms, refs):
        R.lion_plain_step_ref(p2, g, m2, **kw)
        if DEV == "cpu":
            assert torch.equal(p, p2)
            for k in m:
                assert torch.equal(m[k], m2[k]), k
        else:
            torch.testing.assert_close(p, p2, rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize("rows,cols,pieces,int8_grad", [(12, 301, 2, True), (9, 96, 3, False)])
def test_qlion_sr_row_shards_step_as_the_whole_weight(rows, cols, pieces, int8_grad):
    """FSDP2 row shards, each given the global flat index of its first element, take the SR step the whole
    weight takes: codes, row scales, momentum and outliers (rebased) bit-identical."""
    d, grad, mom = _lion_case(rows, cols, 40 + rows, int8_grad)
    kw = dict(lr=2e-2, beta1=0.9, beta2=0.99, weight_decay=0.0, rounding="sr")
    whole_d, whole_m = clone(d), clone(mom)
    whole_idx, whole_val = Q.qlion_dense_sparse_step_(whole_d, grad, whole_m, seed=9, **kw)
    n = rows // pieces
    items = []
    for i in range(pieces):
        r0, r1 = i * n, (i + 1) * n
        keep = (d["sparse_idx"] >= r0 * cols) & (d["sparse_idx"] < r1 * cols)
        piece = {k: (v.clone() if k == "thresholds" else v[r0:r1].clone()) for k, v in d.items()
                 if k not in ("sparse_idx", "sparse_val")}
        piece["sparse_idx"] = (d["sparse_idx"][keep] - r0 * cols).to(torch.int32)
        piece["sparse_val"] = d["sparse_val"][keep].clone()
        items.append((piece, {k: v[r0:r1].clone() for k, v in grad.items()},
                      {k: v[r0:r1].clone() for k, v in mom.items()}, 9, r0 * cols))
    ctx = Q.qlion_dense_sparse_begin(items, **kw)
    new = Q.qlion_dense_sparse_finish(ctx, ctx["sync"].tolist())
    for k in ("codes", "scales", "zeros"):
        assert torch.equal(torch.cat([it[0][k] for it in items]), whole_d[k]), k
        assert torch.equal(torch.cat([it[2][k] for it in items]), whole_m[k]), k
    assert torch.equal(torch.cat([idx + i * n * cols for i, (idx, _, _) in enumerate(new)]), whole_idx)
    assert torch.equal(torch.cat([val for _, val, _ in new]), whole_val) and whole_idx.numel() > 0
