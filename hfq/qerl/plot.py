"""Training curves of a (QeRL) GRPO run as a PNG: reward, loss, policy entropy and the AQN sigma."""
from __future__ import annotations

import math

# metric key, panel title, y-axis label
PANELS = (("reward", "training reward", "mean reward per sample"),
          ("loss", "GRPO loss", "loss"),
          ("entropy", "policy entropy", "nats per sampled token"),
          ("aqn/sigma", "AQN noise", "sigma (std of the norm noise)"))
FLAT = 1e-6  # a metric whose values all stay below this in magnitude carries nothing but rounding noise


def shown_panels(rows: list[dict]) -> list[tuple[str, str, str]]:
    """The PANELS with something to show: logged at least once beyond FLAT."""
    return [p for p in PANELS if any(abs(h.get(p[0], 0.0)) > FLAT for h in rows)]


def plot_curves(log_history: list[dict], path: str, heldout: dict | None = None) -> str:
    """Plot `trainer.state.log_history` (entries with a "step") to `path`; missing metrics show as gaps, a metric
    that is never logged or stays within FLAT of zero (the loss of a one-update-per-rollout GRPO, sigma without
    AQN) gets no panel. `heldout` ({"before", "after", "before_2se", "after_2se"}) adds the held-out reward to the reward panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [h for h in log_history if "step" in h and any(k in h for k, _, _ in PANELS)]
    if not rows:
        raise ValueError("plot_curves: log_history has no logged reward/loss/entropy/aqn entries")
    shown = shown_panels(rows)
    fig, ax = plt.subplots(1, len(shown), figsize=(4.2 * len(shown), 3.6), squeeze=False)
    steps = [h["step"] for h in rows]
    for a, (key, title, ylabel) in zip(ax[0], shown):
        a.plot(steps, [h.get(key, math.nan) for h in rows], marker=".", label="training samples")
        if key == "reward" and heldout:
            for x, k in ((0, "before"), (steps[-1], "after")):
                a.errorbar([x], [heldout[k]], yerr=[heldout[f"{k}_2se"]], fmt="s", color="C3", capsize=3,
                           label="held-out reward (2 SE)" if k == "before" else None)
            a.legend(fontsize=8)
        a.set_title(title)
        a.set_xlabel("GRPO step")
        a.set_ylabel(ylabel)
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
