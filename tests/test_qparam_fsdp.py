"""QParam row shards (what FSDP2's fully_shard does to a parameter) and SR keyed by global element, in one process.
The 2-process FSDP2 runs are in tests/test_scaleout.py."""
import pytest
import torch

from hfq.optim.base import keyed_uniform
from hfq.qparam import QParam
from hfq.qparam.fsdp import rows_of

CASES = [("fp8_e4m3_row", (12, 40), {}), ("int4_group", (9, 48), {"group_size": 16}),
         ("int8_dense_sparse", (10, 36), {"outlier_fraction": 0.1})]


def _q(fmt, shape, meta, seed=0):
    g = torch.Generator().manual_seed(seed)
    return QParam.from_float(torch.randn(shape, generator=g) * 0.3, fmt, **meta)


@pytest.mark.parametrize("fmt,shape,meta", CASES)
def test_row_shards_keep_each_rows_metadata(fmt, shape, meta):
    q = _q(fmt, shape, meta)
    pieces = torch.chunk(q, 3 if shape[0] % 3 == 0 else 2, dim=0) if shape[0] % 2 == 0 or shape[0] % 3 == 0 else []
    assert pieces and all(isinstance(p, QParam) for p in pieces)
    whole = q.dequantize(torch.float32)
    r0 = 0
    for p in pieces:
        assert p.place.row0 == r0 and p.place.rows == shape[0]
        assert torch.equal(p.dequantize(torch.float32), whole[r0:r0 + p.shape[0]])
        if fmt == "int8_dense_sparse":
            assert bool((p.sparse_idx >= 0).all() and (p.sparse_idx < p.numel()).all())
        r0 += p.shape[0]
    if fmt == "int8_dense_sparse":
        assert sum(p.sparse_idx.numel() for p in pieces) == q.sparse_idx.numel() > 0


@pytest.mark.parametrize("fmt,shape,meta", CASES)
def test_fully_shard_init_sequence_keeps_the_shard(fmt, shape, meta):
    """fully_shard: chunk, new_zeros(padded), narrow(...).copy_(chunk), narrow again: the last one is the shard."""
    q = _q(fmt, shape, meta, seed=1)
    rows = shape[0] // 3 if shape[0] % 3 == 0 else shape[0] // 2
    chunk = torch.chunk(q, shape[0] // rows, dim=0)[-1]
    padded = q.new_zeros((rows, shape[1]))
    padded.narrow(0, 0, rows).copy_(chunk)
    shard = padded.narrow(0, 0, rows)
    assert shard.place.row0 == shape[0] - rows and shard.place.sharded
    assert torch.equal(shard.dequantize(), chunk.dequantize())
    assert shard.view(-1) is not None and isinstance(shard.view(-1), QParam)  # FSDP2's handle: no decoded copy


def test_shard_refusals_name_what_works():
    q = _q("fp8_e4m3_row", (12, 40), {})
    with pytest.raises(NotImplementedError, match="only whole rows along dim 0"):
        q[:, :8]
    with pytest.raises(NotImplementedError, match="along dim 1"):
        torch.chunk(q, 2, dim=1)
    with pytest.raises(NotImplementedError, match=r"12 rows do not split evenly over 5 FSDP2 shards"):
        torch.chunk(q, 5, dim=0)


def test_keyed_uniform_is_the_same_for_any_row_split():
    whole = keyed_uniform((10, 33), 0, 1234, "cpu")
    parts = torch.cat([keyed_uniform((4, 33), 0, 1234, "cpu"), keyed_uniform((6, 33), 4, 1234, "cpu")])
    assert torch.equal(whole, parts)
    big = keyed_uniform((500, 512), 0, 7, "cpu")
    assert 0 <= float(big.min()) and float(big.max()) < 1
    assert abs(float(big.mean()) - 0.5) < 3e-3 and abs(float(big.std()) - 12 ** -0.5) < 3e-3
    assert not torch.equal(big, keyed_uniform((500, 512), 0, 8, "cpu"))
    assert float(torch.corrcoef(torch.stack((big[:, :-1].flatten(), big[:, 1:].flatten())))[0, 1]).__abs__() < 0.01


@pytest.mark.parametrize("fmt,shape,meta", CASES)
def test_keyed_sr_requantize_of_shards_equals_the_whole(fmt, shape, meta):
    """SR with keyed draws: requantizing each row shard with its rows' draws stores what the whole weight stores."""
    q = _q(fmt, shape, meta, seed=2)
    target = q.dequantize(torch.float32) * 0.9 + 0.01
    rows = shape[0] // 3 if shape[0] % 3 == 0 else shape[0] // 2
    pieces = [QParam(rows_of(q, r, r + rows), fmt, (rows, shape[1]), q.meta) for r in range(0, shape[0], rows)]
    q.requantize_(target, "sr", noise=keyed_uniform(shape, 0, 99, "cpu"))
    for i, p in enumerate(pieces):
        p.requantize_(target[i * rows:(i + 1) * rows], "sr", noise=keyed_uniform(p.shape, i * rows, 99, "cpu"))
        assert torch.equal(p.dequantize(), q.dequantize()[i * rows:(i + 1) * rows])


def test_keyed_sr_positions_follow_the_groups_as_they_are_now():
    """Keyed SR draws use a parameter's position in the optimizer: after the groups are rebuilt in another order
    the positions are those a freshly built optimizer over the same groups has, so a resumed run repeats."""
    from hfq.eco import ECOAdamW

    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(4, 8, dtype=torch.bfloat16)) for _ in range(3)]
    opt = ECOAdamW(ps, lr=1e-3, rounding="sr", keyed_sr=True, seed=1)
    assert [opt._ordinal(p) for p in ps] == [0, 1, 2]
    opt.param_groups[0]["params"] = ps[::-1]
    fresh = ECOAdamW(ps[::-1], lr=1e-3, rounding="sr", keyed_sr=True, seed=1)
    assert [opt._ordinal(p) for p in ps] == [fresh._ordinal(p) for p in ps] == [2, 1, 0]
    opt.param_groups[0]["params"] = ps[2:]
    opt.add_param_group({"params": ps[:2]})
    assert [opt._ordinal(p) for p in ps] == [1, 2, 0]


def test_shared_outlier_lists_refuse_a_list_changed_by_hand():
    """The whole outlier lists shared among ranks (share_outliers_, at each QLion step) serve an unshard only while
    this rank's list is the one they were taken from; one changed elsewhere raises instead of using stale lists,
    and a load forgets them (every rank shares again at the next unshard)."""
    from hfq.qparam.fsdp import _list_token, forget_outliers_, gather_outliers

    q = _q("int8_dense_sparse", (10, 36), {"outlier_fraction": 0.1})
    q.place.name = "layers.0.mlp.up_proj.weight"
    whole = (q.sparse_idx.clone(), q.sparse_val.clone())
    q.whole_outliers = (_list_token(q), *whole)
    assert gather_outliers(q, None)[0] is whole[0]
    q.sparse_val.mul_(2)
    with pytest.raises(RuntimeError, match="layers.0.mlp.up_proj.weight: its outlier list changed"):
        gather_outliers(q, None)
    forget_outliers_(q)
    assert "whole_outliers" not in q.__dict__
