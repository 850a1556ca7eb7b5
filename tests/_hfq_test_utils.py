"""Helpers shared by test files (pytest puts tests/ on sys.path): bit-comparable snapshots and per-rank data."""
import torch


def snapshot(model, sep: str = ".") -> dict:
    """name -> plain cloned tensors, for bit comparisons: a QParam gives each stored tensor (`name{sep}codes`, ...;
    float8 viewed as uint8), other parameters themselves."""
    from hfq.qparam import QParam

    out = {}
    for n, p in model.named_parameters():
        if isinstance(p, QParam):
            for k, t in p.qtensors().items():
                out[f"{n}{sep}{k}"] = (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).clone()
        else:
            out[n] = p.detach().clone()
    return out


def shard(step: int, rank: int, rows: int, seq: int) -> torch.Tensor:
    """Token ids [rows, seq] for one rank at one step: different data on every rank, the same in every run."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(4, 90, (rows, seq), generator=g)
