"""Where should the Adaptive Quantization Noise act? A small comparison on the offline `hfq grpo` demo.

Three arms, same seeds, same steps, everything else the demo's defaults (tiny pre-trained Qwen2, NVFP4 base,
LoRA r=16, GRPO, 60 steps, AQN exponential 1e-2 -> 5e-4 with K=4):

  rollout                   AQN perturbs the norms only while sampling (hfq's default)
  rollout_and_old_logprobs  the old-policy log-probs are also computed under the sampling noise
  no_aqn                    no added noise (quantization noise only)

Each run is `python -m hfq.cli grpo --seed S ...` in a subprocess (so runs can go in parallel), with its
metrics.json read back. Writes `<out>/qerl_aqn_scope.{md,json,png}` (`_quick` suffix with --quick).

    python examples/qerl_aqn_scope.py                 # 3 seeds x 3 arms x 60 steps (~45-50 min on 2 CPU cores)
    python examples/qerl_aqn_scope.py --quick         # 1 seed x 3 arms x 8 steps (a smoke run)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = {
    "rollout": ["--aqn-scope", "rollout"],
    "rollout_and_old_logprobs": ["--aqn-scope", "rollout_and_old_logprobs"],
    "no_aqn": ["--no-aqn"],
}
LAST = 10  # "end of training" = mean of the last LAST logged steps


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default: the demo's 60)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel")
    p.add_argument("--quick", action="store_true", help="1 seed, 8 steps: a smoke run")
    p.add_argument("--work-dir", default="/tmp/hfq_qerl_aqn_scope", help="per-run output folders")
    p.add_argument("--cache-dir", default=None, help="demo base model cache (default: the demo's)")
    p.add_argument("--out", default=str(ROOT / "examples" / "results"))
    p.add_argument("--resume", action="store_true", help="reuse runs whose metrics.json already exists")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.steps = args.seeds[:1], args.steps or 8
    return args


def run_one(arm: str, seed: int, args, threads: int) -> dict:
    out = Path(args.work_dir) / f"{arm}_seed{seed}"
    metrics = out / "metrics.json"
    if not (args.resume and metrics.exists()):
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "hfq.cli", "grpo", "--seed", str(seed), "--output-dir", str(out), "--no-plot",
               *ARMS[arm]]
        if args.steps:
            cmd += ["--steps", str(args.steps)]
        if args.cache_dir:
            cmd += ["--cache-dir", args.cache_dir]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false", TQDM_DISABLE="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        t0 = time.time()
        with open(out / "log.txt", "w") as log:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            raise RuntimeError(f"{arm} seed {seed}: exit {rc}, see {out / 'log.txt'}")
        (out / "wall_s").write_text(f"{time.time() - t0:.1f}\n")
    m = json.loads(metrics.read_text())
    wall = float((out / "wall_s").read_text()) if (out / "wall_s").exists() else m["summary"]["seconds"]
    hist = m["history"]
    rew = [h["reward"] for h in hist]
    ent = [h.get("entropy", math.nan) for h in hist]
    acc = [h.get("rewards/accuracy_reward/mean", math.nan) for h in hist]
    n = min(LAST, len(rew))
    return {"arm": arm, "seed": seed, "steps": len(rew), "wall_s": wall, "train_s": m["summary"]["seconds"],
            "reward_final": rew[-1], "reward_last10": sum(rew[-n:]) / n, "reward_mean_all": sum(rew) / len(rew),
            "accuracy_last10": sum(acc[-n:]) / n, "entropy_final": ent[-1], "entropy_last10": sum(ent[-n:]) / n,
            "entropy_mean_all": sum(ent) / len(ent), "sampling_entropy_before": m["summary"].get("sampling_entropy"),
            "reward": rew, "entropy": ent, "sigma": [h.get("aqn/sigma", 0.0) for h in hist]}


def ms(xs):
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return math.nan, math.nan
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def fmt(xs, d=3):
    m, s = ms(xs)
    return f"{m:.{d}f} ± {s:.{d}f}" if len(xs) > 1 else f"{m:.{d}f}"


def summarize(runs, arms):
    out = {}
    for arm in arms:
        rs = [r for r in runs if r["arm"] == arm]
        out[arm] = {k: ms([r[k] for r in rs]) for k in ("reward_final", "reward_last10", "reward_mean_all",
                                                        "accuracy_last10", "entropy_final", "entropy_last10",
                                                        "entropy_mean_all", "wall_s")}
        out[arm]["n_seeds"] = len(rs)
    return out


def plot(runs, arms, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(y, w=5):
        return [statistics.fmean(y[max(0, i - w + 1):i + 1]) for i in range(len(y))]

    colors = dict(zip(ARMS, ("tab:blue", "tab:orange", "tab:gray")))
    fig, ax = plt.subplots(1, 2, figsize=(12, 3.8))
    for arm in arms:
        rs = [r for r in runs if r["arm"] == arm]
        T = min(len(r["reward"]) for r in rs)
        for key, a in (("reward", ax[0]), ("entropy", ax[1])):
            for r in rs:
                a.plot(range(1, T + 1), smooth(r[key][:T]), color=colors[arm], alpha=0.25, lw=0.8)
            mean = [statistics.fmean(r[key][t] for r in rs) for t in range(T)]
            a.plot(range(1, T + 1), smooth(mean), color=colors[arm], lw=2, label=f"{arm} (mean of {len(rs)})")
    ax[0].set_title("reward (accuracy + format), 5-step moving average")
    ax[1].set_title("policy entropy (TRL, clean policy), 5-step moving average")
    for a in ax:
        a.set_xlabel("GRPO step")
        a.grid(alpha=0.3)
    ax[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_md(path, runs, summ, arms, args, png_name):
    seeds = sorted({r["seed"] for r in runs})
    steps = runs[0]["steps"]
    how = " --quick" if args.quick else ("" if args.seeds == [0, 1, 2] else " --seeds " + " ".join(map(str, seeds)))
    L = [f"# QeRL: where the AQN noise acts (offline `hfq grpo` demo, {len(seeds)} seed(s) x {steps} steps)", "",
         "Tiny pre-trained Qwen2 (demo base, char tokenizer), NVFP4 base + LoRA r=16, GRPO (8 samples/prompt, "
         "64 completions/step, lr 2e-3), rewards = accuracy + format on the bundled arithmetic task; AQN exponential "
         "1e-2 -> 5e-4 with K=4 (stage 0 = first fifth of the run without added noise). Same seed = same base "
         "model, same data order, same AQN noise. "
         f"CPU, runs {args.jobs} at a time with {max(1, (os.cpu_count() or 1) // max(1, args.jobs))} thread(s) each "
         f"(wall time includes model loading). Produced by `python examples/qerl_aqn_scope.py{how}`; curves: "
         f"`{png_name}`.", "",
         f"Mean ± std over seeds {seeds}; 'last 10' = mean over the last {LAST} logged steps.", "",
         "| AQN | reward final | reward last 10 | reward mean (all steps) | accuracy last 10 | entropy final | "
         "entropy last 10 | wall s / run |",
         "|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        rs = [r for r in runs if r["arm"] == arm]
        L.append(f"| {arm} | {fmt([r['reward_final'] for r in rs])} | {fmt([r['reward_last10'] for r in rs])} | "
                 f"{fmt([r['reward_mean_all'] for r in rs])} | {fmt([r['accuracy_last10'] for r in rs])} | "
                 f"{fmt([r['entropy_final'] for r in rs])} | {fmt([r['entropy_last10'] for r in rs])} | "
                 f"{fmt([r['wall_s'] for r in rs], 0)} |")
    L += ["", "Per seed (reward last 10 / entropy last 10):", "",
          "| seed | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
    for s in seeds:
        cells = []
        for arm in arms:
            r = next((r for r in runs if r["arm"] == arm and r["seed"] == s), None)
            cells.append("-" if r is None else f"{r['reward_last10']:.3f} / {r['entropy_last10']:.3f}")
        L.append(f"| {s} | " + " | ".join(cells) + " |")
    note = "(to be written by whoever ran it: the numbers above are regenerated, this section is kept)"
    if Path(path).exists() and "## Interpretation" in Path(path).read_text():
        note = Path(path).read_text().split("## Interpretation", 1)[1].strip()
    L += ["", "## Interpretation", "", note, ""]
    Path(path).write_text("\n".join(L))


def main(argv=None):
    args = parse_args(argv)
    from tqdm.auto import tqdm

    sys.path.insert(0, str(ROOT))
    from hfq.qerl.demo import DEMO_PRETRAIN_STEPS, build_demo_base

    for s in args.seeds:  # build the bases up front, one at a time (the cache is not safe for concurrent builds)
        build_demo_base(args.cache_dir, steps=DEMO_PRETRAIN_STEPS, seed=s, log=tqdm.write)
    jobs = [(arm, s) for s in args.seeds for arm in args.arms]
    threads = max(1, (os.cpu_count() or 1) // max(1, args.jobs))
    runs = []
    with ThreadPoolExecutor(args.jobs) as ex, tqdm(total=len(jobs), desc="GRPO runs") as bar:
        futs = {ex.submit(run_one, arm, s, args, threads): (arm, s) for arm, s in jobs}
        for f in as_completed(futs):
            r = f.result()
            runs.append(r)
            bar.set_postfix_str(f"{r['arm']} s{r['seed']}: reward last10 {r['reward_last10']:.3f}")
            bar.update()
    runs.sort(key=lambda r: (args.arms.index(r["arm"]), r["seed"]))
    summ = summarize(runs, args.arms)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "qerl_aqn_scope" + ("_quick" if args.quick else "")
    plot(runs, args.arms, out / f"{stem}.png")
    (out / f"{stem}.json").write_text(json.dumps({"config": {"seeds": args.seeds, "steps": runs[0]["steps"],
                                                             "arms": args.arms, "jobs": args.jobs,
                                                             "threads_per_run": threads, "last_n": LAST},
                                                  "summary": summ, "runs": runs}, indent=1))
    write_md(out / f"{stem}.md", runs, summ, args.arms, args, f"{stem}.png")
    for arm in args.arms:
        s = summ[arm]
        print(f"{arm:26s} reward last10 {s['reward_last10'][0]:.3f} ± {s['reward_last10'][1]:.3f}  "
              f"entropy last10 {s['entropy_last10'][0]:.3f} ± {s['entropy_last10'][1]:.3f}  "
              f"wall {s['wall_s'][0]:.0f} s")
    print(f"wrote {out / stem}.md/.json/.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
