"""Where a QFT QLion step and a QFT linear forward+backward spend their time on the device (torch.profiler,
7B shapes): the top CUDA kernels and host ops. python benchmarks/qft_profile.py > qft_profile.txt"""
from __future__ import annotations

import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main():
    import hfq.qparam as qp
    from hfq.qft import QLion
    from hfq.qparam import Int8Grad, QParam

    torch.manual_seed(0)
    w = torch.randn(11008, 4096, device="cuda") * 0.02
    p = torch.nn.Parameter(QParam.from_float(w, "int8_dense_sparse", outlier_fraction=0.01))
    store = Int8Grad(torch.randn(11008, 4096, device="cuda", dtype=torch.bfloat16) * 1e-3)
    opt = QLion([p], lr=1e-5)
    x = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        opt.update_param_(p, store, opt.param_groups[0])

    def fb():
        qp.qlinear(x, p, store_int8=True).sum().backward()
        p.grad = None

    for name, fn in (("qlion_step", step), ("linear_fwd_bwd", fb)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        print(f"==== {name} (5 calls)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
