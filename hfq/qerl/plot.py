"""Training curves of a (QeRL) GRPO run as a PNG: reward, loss, policy entropy and the AQN sigma."""
from __future__ import annotations

import math

PANELS = (("reward", "reward"), ("loss", "loss"), ("entropy", "policy entropy"), ("aqn/sigma", "AQN sigma"))


def plot_curves(log_history: list[dict], path: str) -> str:
    """Plot `trainer.state.log_history` (entries with a "step") to `path`; missing metrics show as gaps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [h for h in log_history if "step" in h and any(k in h for k, _ in PANELS)]
    if not rows:
        raise ValueError("plot_curves: log_history has no logged reward/loss/entropy/aqn entries")
    fig, ax = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.4))
    for a, (key, title) in zip(ax, PANELS):
        a.plot([h["step"] for h in rows], [h.get(key, math.nan) for h in rows], marker=".")
        a.set_title(title)
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
