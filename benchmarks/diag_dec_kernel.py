"""Device diagnostic: which small decode-kernel configs miscompute (relative error vs float64), by parameter."""
import itertools
import json
import os
import sys

import torch

from hfq_kernels.reference import fp4
from hfq_kernels import nvfp4 as K

rows = []
for (m, k, n), bn, bk, split, pre in itertools.product(
        [(1, 96, 40), (5, 256, 40), (17, 528, 24), (3, 400, 48), (8, 1024, 256), (1, 3584, 512)],
        [32, 64, 128], [128, 256], [1, 2, 3], [True, False]):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g)
    p, s, r = K.quantize(w.cuda())
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
    ref = x.double().cpu() @ fp4.nvfp4_dequantize(p.cpu(), s.cpu(), r.cpu(), torch.float32).double().T
    cfg = dict(kind="dec", BN=bn, BM=16, BK=bk, split=split, prefetch=pre)
    try:
        y = K.linear(x, p, s, r, config=cfg).double().cpu()
        err = float((y - ref).norm() / ref.norm())
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {str(e)[:80]}"
    rows.append(dict(m=m, k=k, n=n, BN=bn, BK=bk, split=split, prefetch=pre, err=err))
bad = [r for r in rows if not isinstance(r["err"], float) or r["err"] > 1e-2]
print(f"{len(bad)} bad of {len(rows)}")
for r in bad[:60]:
    print(r)
os.makedirs(sys.argv[1], exist_ok=True)
json.dump(rows, open(os.path.join(sys.argv[1], "diag_dec.json"), "w"), indent=0)
