"""The bundled model card's figure: its training losses. Here, not in `qmtp.book.plots` (which re-exports it in
the book's style), because `tiny` never imports `book`."""

from __future__ import annotations

import matplotlib.pyplot as plt


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
