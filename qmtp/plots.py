"""Figures for the chapters and the model card, in one style (only notebooks and the card import this)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # no display needed; notebooks still show figures inline

import matplotlib.pyplot as plt  # noqa: E402

STYLE = {
    "figure.figsize": (7.0, 3.6),
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "font.size": 10,
}
plt.rcParams.update(STYLE)


def loss_curve(history: list[dict]):
    """Training losses (trunk, head) per step, with the held-out probe where it was measured."""
    fig, ax = plt.subplots()
    steps = [r["step"] for r in history]
    ax.plot(steps, [r["trunk"] for r in history], lw=0.8, alpha=0.6, label="trunk (train)")
    ax.plot(steps, [r["head"] for r in history], lw=0.8, alpha=0.6, label="MTP head (train)")
    probe = [r for r in history if "heldout_trunk" in r]
    if probe:
        ax.plot([r["step"] for r in probe], [r["heldout_trunk"] for r in probe], "o-", ms=3, label="trunk (held-out)")
        ax.plot([r["step"] for r in probe], [r["heldout_head"] for r in probe], "s-", ms=3, label="MTP head (held-out)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_ylim(bottom=0)
    ax.legend(frameon=False)
    return fig
