"""Before/after timing of the decode kernel's scale-load fix (one scale byte per word instead of
tl.reshape(tl.join(...))), same process, interleaved. Production shapes through hfq_kernels.nvfp4.linear with the
shipped autotuned config (fp16 x: the dec kernel; bf16 x at M <= 64 goes to the g4 kernel, so bf16 is timed with
the same dec config forced), plus correctness of both. Usage: python dec_fix_timing.py OUTDIR"""
import importlib.util
import json
import os
import sys

import torch
import torch.nn.functional as F

from hfq_kernels import nvfp4 as NEW
from hfq_kernels._autotune import Tuner, bench_ms

OUT = sys.argv[1]
os.makedirs(OUT, exist_ok=True)
src = open(NEW.__file__).read()
for a, b in (("ks = tl.arange(0, BK // 8) // 2", "ks = tl.arange(0, BK // 16)"),
             ("        s2 = ((s.to(tl.int32) & 0x7F) << 7).to(tl.int16).to(tl.float16, bitcast=True) * 256.0\n",
              "        sh = ((s.to(tl.int32) & 0x7F) << 7).to(tl.int16).to(tl.float16, bitcast=True) * 256.0\n"
              "        s2 = tl.reshape(tl.join(sh, sh), (BN, BK // 8))\n")):
    assert src.count(a) == 1, a
    src = src.replace(a, b)
open("/tmp/hfq_nvfp4_old.py", "w").write(src)
spec = importlib.util.spec_from_file_location("hfq_nvfp4_old", "/tmp/hfq_nvfp4_old.py")
OLD = importlib.util.module_from_spec(spec)
spec.loader.exec_module(OLD)

ROUNDS = int(os.environ.get("ROUNDS", "5"))
rows = []
torch.manual_seed(0)
for k, n in ((3584, 18944), (18944, 3584)):
    p, s, r = NEW.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    w = NEW.dequantize(p, s, r, torch.float32)
    for m in (1, 8, 16):
        for dt in (torch.float16, torch.bfloat16):
            x = torch.randn(m, k, device="cuda", dtype=dt)
            ref = F.linear(x.float(), w)
            key = Tuner.key(m, n, k, torch.float16, x.device)
            cfg = NEW._LINEAR_TUNER.cache.get(key)
            if cfg is None or cfg.get("kind") != "dec":
                continue
            fns = {}
            for name, mod in (("old", OLD), ("new", NEW)):
                c = None if dt == torch.float16 else cfg  # fp16: linear picks the shipped tuned choice itself
                y = mod.linear(x, p, s, r, config=c).float()
                rel = float((y - ref).norm() / ref.norm())
                fns[name] = (lambda mod=mod, c=c: mod.linear(x, p, s, r, config=c), rel)
            best = {"old": [], "new": []}
            for _ in range(ROUNDS):  # interleaved rounds
                for name in ("old", "new"):
                    best[name].append(bench_ms(fns[name][0], warmup=5, rep=50))
            rec = dict(k=k, n=n, m=m, dtype=str(dt)[6:], cfg=cfg, rel_old=fns["old"][1], rel_new=fns["new"][1],
                       us_old=round(1000 * min(best["old"]), 2), us_new=round(1000 * min(best["new"]), 2))
            rec["new_over_old"] = round(rec["us_new"] / rec["us_old"], 3)
            rows.append(rec)
            print(json.dumps(rec), flush=True)

# every decode candidate the autotuner would try, old vs new (what re-tuning could reach), on one shape
if os.environ.get("SWEEP", "1") == "1":
    m, k, n = 1, 3584, 18944
    p, s, r = NEW.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    ref = F.linear(x.float(), NEW.dequantize(p, s, r, torch.float32))
    for c in NEW._dec_candidates(m, n, k):
        rec = dict(sweep=f"m{m} k{k} n{n} fp16", cfg=c)
        for name, mod in (("old", OLD), ("new", NEW)):
            y = mod.linear(x, p, s, r, config=c).float()
            rec[f"rel_{name}"] = float((y - ref).norm() / ref.norm())
        t = {"old": [], "new": []}
        for _ in range(3):
            for name, mod in (("old", OLD), ("new", NEW)):
                t[name].append(bench_ms(lambda mod=mod: mod.linear(x, p, s, r, config=c), warmup=3, rep=30))
        rec.update(us_old=round(1000 * min(t["old"]), 2), us_new=round(1000 * min(t["new"]), 2))
        rows.append(rec)
        print(json.dumps(rec), flush=True)
json.dump(rows, open(os.path.join(OUT, "dec_fix_timing.json"), "w"), indent=1)
