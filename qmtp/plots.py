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


def layer_pattern(config, title: str | None = None):
    """The stack drawn bottom to top: linear / full attention per layer, each with its MoE, then the head."""
    from matplotlib.patches import Rectangle

    kinds = list(config.layer_types) + (["mtp"] if config.has_mtp else [])
    colours = {"linear_attention": "#4C78A8", "full_attention": "#F58518", "mtp": "#54A24B"}
    labels = {"linear_attention": "gated DeltaNet", "full_attention": "gated attention", "mtp": "MTP head (full attention)"}
    width = max(6.0, 0.18 * len(kinds) + 2)
    fig, ax = plt.subplots(figsize=(width, 2.6))
    for i, kind in enumerate(kinds):
        ax.add_patch(Rectangle((i, 1.05), 0.9, 0.9, color=colours[kind]))
        ax.add_patch(Rectangle((i, 0.0), 0.9, 0.9, color="#B0B0B0"))
    ax.text(-0.3, 1.5, "mixer", ha="right", va="center")
    ax.text(-0.3, 0.45, f"MoE {config.num_experts}\ntop-{config.num_experts_per_tok}", ha="right", va="center")
    ax.set_xlim(-3.2, len(kinds) + 0.2)
    ax.set_ylim(-0.6, 2.3)
    ax.set_xticks([i + 0.45 for i in range(len(kinds))])
    ax.set_xticklabels([str(i) if k != "mtp" else "mtp" for i, k in enumerate(kinds)], fontsize=7)
    ax.set_yticks([])
    ax.grid(False)
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)
    handles = [Rectangle((0, 0), 1, 1, color=colours[k]) for k in colours if k in kinds]
    ax.legend(handles, [labels[k] for k in colours if k in kinds], loc="upper center", ncol=3, frameon=False,
              bbox_to_anchor=(0.55, 1.25), fontsize=8)
    if title:
        ax.set_title(title, pad=22)
    return fig
