"""Realistic ways to get the two fixes wrong, as transforms a chapter can apply and measure.

Each mistake takes a model loaded with both fixes and changes the affected weights the way a careless
converter would have written them. Whether a mistake fails loudly (MLX refuses a shape) or silently
(the model runs and writes nonsense) is not argued here: chapter 2 runs each one and looks.
"""

from __future__ import annotations

from mlx.utils import tree_flatten, tree_unflatten

from .. import fixes
from ..conventions import conv_to_torch, is_conv_kernel
from ..loading import load
from ..model import Model


CONV_MISTAKES = {
    "correct: move axis 2 to 1": lambda stored: stored.moveaxis(2, 1),
    "reshape [C, 1, K] to [C, K, 1]": lambda stored: stored.reshape(stored.shape[0], stored.shape[2], 1),
    "left as stored, [C, 1, K]": lambda stored: stored,
    "transpose to [K, 1, C]": lambda stored: stored.transpose(2, 1, 0),
    "kernel reversed in time": lambda stored: stored.moveaxis(2, 1)[:, ::-1, :],
    "[C, K] read back as [K, C]": lambda stored: stored[:, 0, :].T.reshape(stored.shape[0], stored.shape[2], 1),
}

NORM_SHIFTS = {
    "not shifted (w)": -1.0,
    "shifted once (1 + w), correct": 0.0,
    "shifted twice (2 + w), a re-conversion": 1.0,
}


def _replace(model: Model, change) -> Model:
    """Apply `change(name, weight) -> weight or None` to every parameter; returns the same model."""
    updates = []
    for name, w in tree_flatten(model.parameters()):
        new = change(name, w)
        if new is not None:
            updates.append((name, new))
    model.update(tree_unflatten(updates))
    return model


def with_conv_mistake(path, mistake: str, **load_options) -> Model:
    """The model at `path` with its conv kernels converted the way `mistake` names (`load_options` go to
    `qmtp.load`: at full size chapter 2 loads only the first layers, `qmtp.book.budget`)."""
    transform = CONV_MISTAKES[mistake]
    model = load(path, **load_options)
    return _replace(model, lambda n, w: transform(conv_to_torch(w)) if is_conv_kernel(n) else None)


def with_norm_shift(path, shift: str, **load_options) -> Model:
    """The model at `path` with the zero-centred norms at w, 1 + w or 2 + w."""
    delta = NORM_SHIFTS[shift]
    model = load(path, **load_options)
    return _replace(model, lambda n, w: w + delta if fixes.is_zero_centred_norm(n) else None)


def norm_weights(path, **load_options) -> dict[str, list[float]]:
    """Stored and effective values of every zero-centred norm weight (for the histograms)."""
    import numpy as np

    model = load(path, **load_options)
    effective = [np.array(w).ravel() for n, w in tree_flatten(model.parameters()) if fixes.is_zero_centred_norm(n)]
    effective = np.concatenate(effective)
    return {"stored": (effective - 1.0).tolist(), "effective": effective.tolist()}


def outcome(make_model, texts: list[str], prompt: str, max_tokens: int = 30, length: int = 128) -> dict:
    """Run one variant: held-out accuracy and perplexity (windows of `length` tokens), how sure the model is of
    its choices, and a greedy continuation; or MLX's refusal."""
    import gc

    import mlx.core as mx

    from .evaluate import text_metrics
    from ..speculative import generate

    model = None
    try:
        model = make_model()
        metrics = text_metrics(model, texts, length=length)
        sure = confidence(model, texts, length=length)
        continuation = generate(model, prompt, max_tokens=max_tokens).text
    except ValueError as err:  # MLX refuses a kernel of the wrong shape
        return {"runs": False, "error": str(err).splitlines()[0]}
    finally:
        # The next variant's load checks the memory there is: MLX's cache of this model's freed buffers would
        # still count against it (at full size, a whole second model)
        del model
        gc.collect()
        mx.clear_cache()
    return {"runs": True, "accuracy": metrics.accuracy, "perplexity": metrics.perplexity, **sure,
            "continuation": continuation}


def confidence(model: Model, texts: list[str], length: int = 128) -> dict:
    """How sure the trunk is, teacher-forced over `texts`: the mean probability it gives its own top choice,
    and its mean cross-entropy (nats) at the positions where that choice is wrong. A model that spreads its
    probability (near uniform) and one that is sure and wrong can differ little in accuracy and a lot in
    perplexity: this tells them apart."""
    import mlx.core as mx
    import numpy as np

    from .evaluate import _windows

    rows = mx.array(_windows(model, texts, length))
    _, h = model.trunk(rows[:, :-1])
    probs = mx.softmax(model.logits(h).astype(mx.float32), axis=-1)
    targets = rows[:, 1:]
    top = np.array(probs.max(axis=-1))
    wrong = np.array(mx.argmax(probs, axis=-1) != targets)
    true = np.array(mx.take_along_axis(probs, targets[..., None], -1)[..., 0])
    loss = -np.log(np.maximum(true, np.finfo(np.float32).tiny))
    return {"top_probability": float(top.mean()),
            "loss_when_wrong": float(loss[wrong].mean()) if wrong.any() else float("nan")}


def norm_kinds(config) -> list[dict]:
    """Every kind of norm weight in the model `config` describes (layer numbers folded), how many there are
    and whether the norm fix shifts it (`qmtp.fixes.is_zero_centred_norm`): read from the module tree, so
    the list is the model's own, not a copy of the fix's."""
    import re

    names = [n for n, _ in tree_flatten(Model(config).parameters())
             if "norm" in n.rsplit(".", 2)[-2] and n.endswith(".weight")]
    kinds: dict[str, dict] = {}
    for name in names:
        kind = re.sub(r"layers\.\d+\.", "layers.N.", name)
        row = kinds.setdefault(kind, {"norm weight": kind, "count": 0, "shifted": fixes.is_zero_centred_norm(name)})
        row["count"] += 1
    return list(kinds.values())


def outcome_cells(result: dict) -> dict[str, str]:
    """`outcome`'s result as table cells: accuracy, perplexity and the continuation, or MLX's refusal."""
    import textwrap

    if not result["runs"]:
        return {"accuracy": "-", "perplexity": "-",
                "what happens": "MLX refuses: " + textwrap.shorten(result["error"], 90, placeholder=" …")}
    return {"accuracy": f"{result['accuracy']:.3f}", "perplexity": f"{result['perplexity']:.1f}",
            "what happens": textwrap.shorten(result["continuation"], 90, placeholder=" …")}


def outcome_table(results: dict[str, dict], label: str, confidence: bool = False) -> str:
    """Outcomes ({row label: `outcome` result}) as a Markdown table whose first column is headed `label`; with
    `confidence`, also the mean probability of the top choice and the mean loss where it is wrong."""
    from .inventory import markdown_table

    rows, columns = [], [label, "accuracy", "perplexity"]
    columns += ["top choice", "loss where wrong"] if confidence else []
    for name, result in results.items():
        row = {label: name, **outcome_cells(result)}
        if confidence:
            row["top choice"] = f"{result['top_probability']:.3f}"
            row["loss where wrong"] = f"{result['loss_when_wrong']:.2f}"
        rows.append(row)
    return markdown_table(rows, columns + ["what happens"])


def norm_kinds_table(kinds: list[dict]) -> str:
    """`norm_kinds` as a Markdown table: each norm weight, how many there are, whether the fix shifts it."""
    from .inventory import markdown_table

    shown = [{**k, "norm weight": f"`{k['norm weight']}`", "shifted": "1 + w" if k["shifted"] else "no: w as stored"}
             for k in kinds]
    return markdown_table(shown, ["norm weight", "count", "shifted"])
