"""Measuring a model on held-out text: next-token accuracy and perplexity, the head's accuracy, acceptance.

All figures the book and the bundled model card quote come from these functions. They live with the tiny model
(the card needs them to build) and `qmtp.book.evaluate` re-exports them for the chapters: `book` may import
`tiny`, never the reverse.

* Teacher-forced (one forward pass over real text): the trunk's next-token accuracy and perplexity; the
  head's top-1 accuracy for the token after next; and how often the head's top-1 equals the trunk's
  top-1 at the same position, which is what greedy drafting needs.
* Free-running (speculative decoding from prompts cut from held-out documents): the acceptance per draft
  position actually observed, for the model's own head or a replacement (`previous_head`: the bundled
  model's head before it was trained for chained drafting; `compare_heads` runs two heads interleaved). On the model's own greedy text, "head top-1 == trunk top-1" is exactly
  the greedy acceptance of the first draft, so the two views can be checked against each other.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import mlx.core as mx
import numpy as np

from ..model import Model
from ..mtp import MTPHead
from . import corpus

# A head-only stage's export keeps the head it started from; in a folder of its own, since a model folder's
# *.safetensors files are all read as the checkpoint.
PREVIOUS_HEAD_FILE = "previous_head/head.safetensors"


@dataclass
class TextMetrics:
    tokens: int
    accuracy: float  # trunk top-1 == next token
    perplexity: float  # exp(mean cross-entropy of the next token)
    head_accuracy: float  # head top-1 == the token after next (nan without a head)
    head_trunk_agreement: float  # head top-1 == trunk top-1 for the token after next (nan without a head)

    def as_dict(self) -> dict:
        return asdict(self)


def heldout_by_register(per_register: int = 40, seed: int = 0, n_train: int = corpus.DEFAULT_N_TRAIN,
                        n_heldout: int = corpus.DEFAULT_N_HELDOUT) -> dict[str, list[str]]:
    """Up to `per_register` unseen held-out documents of each register of the corpus."""
    out: dict[str, list[str]] = {r: [] for r in corpus.REGISTERS}
    for register, text in corpus.unseen_heldout(seed, n_train, n_heldout):
        if len(out[register]) < per_register:
            out[register].append(text)
    return out


def heldout_texts(per_register: int = 40) -> list[str]:
    """`heldout_by_register`'s documents, register after register, in one list."""
    return [t for docs in heldout_by_register(per_register).values() for t in docs]


def heldout_prompts(model: Model, per_register: int = 40) -> list[list[int]]:
    """Prompts (`prompts_from`) from `per_register` held-out documents of each register, register after register."""
    return [p for docs in heldout_by_register(per_register).values() for p in prompts_from(docs, model)]


def _windows(model: Model, texts: list[str], length: int) -> np.ndarray:
    """Documents as the model was trained on them (each after an end-of-text token), cut into rows."""
    tok = model.tokenizer
    stream = []
    for text in texts:
        stream += [tok.eos_id] + tok.encode(text)
    stream.append(tok.eos_id)
    n = max(1, (len(stream) - 1) // length)
    rows = [stream[i * length: i * length + length + 1] for i in range(n)]
    rows[-1] = rows[-1] + [tok.eos_id] * (length + 1 - len(rows[-1]))  # only a short stream needs padding
    return np.array(rows, dtype=np.int32)


def text_metrics(model: Model, texts: list[str], length: int = 128, batch: int = 8) -> TextMetrics:
    """Teacher-forced metrics of trunk and head over `texts`."""
    rows = _windows(model, texts, length)
    nll = correct = count = 0.0
    head_correct = agree = head_count = 0.0
    for start in range(0, len(rows), batch):
        chunk = mx.array(rows[start: start + batch])
        inputs, targets = chunk[:, :-1], chunk[:, 1:]
        _, h = model.trunk(inputs)
        logits = model.logits(h).astype(mx.float32)
        nll += float(mx.sum(mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, targets[..., None], -1)[..., 0]))
        trunk_top = mx.argmax(logits, axis=-1)
        correct += float(mx.sum(trunk_top == targets))
        count += targets.size
        if model.mtp is not None:
            head_logits = model.logits(model.head_states(h, inputs))
            head_top = mx.argmax(head_logits, axis=-1)
            head_correct += float(mx.sum(head_top == targets[:, 1:]))
            agree += float(mx.sum(head_top == trunk_top[:, 1:]))
            head_count += head_top.size
    nan = float("nan")
    return TextMetrics(
        tokens=int(count),
        accuracy=correct / count,
        perplexity=math.exp(nll / count),
        head_accuracy=head_correct / head_count if head_count else nan,
        head_trunk_agreement=agree / head_count if head_count else nan,
    )


def prompts_from(texts: list[str], model: Model, n_tokens: int = 8) -> list[list[int]]:
    """The first `n_tokens` tokens of each document (after end-of-text), as generation prompts."""
    tok = model.tokenizer
    return [[tok.eos_id] + tok.encode(text)[:n_tokens] for text in texts]


def acceptance(model: Model, prompts: list[list[int]], n_draft: int = 2, max_tokens: int = 48,
               temperature: float | None = None, seed: int = 0, **engine) -> dict:
    """Greedy speculative decoding over `prompts`; acceptance per draft position, pooled over prompts."""
    from ..options import Engine
    from ..speculative import generate

    k = n_draft - 1
    drafted, accepted = [0] * k, [0] * k
    emitted = passes = 0
    for prompt in prompts:
        stats = generate(model, prompt, max_tokens=max_tokens, n_draft=n_draft, temperature=temperature,
                         seed=seed, engine=Engine(**engine)).stats
        drafted = [a + b for a, b in zip(drafted, stats.drafted)]
        accepted = [a + b for a, b in zip(accepted, stats.accepted)]
        emitted += sum(len(s.emitted) for s in stats.steps)
        passes += stats.trunk_passes
    return {
        "n_draft": n_draft,
        "per_position": [a / d if d else float("nan") for a, d in zip(accepted, drafted)],
        "rate": sum(accepted) / sum(drafted) if sum(drafted) else float("nan"),
        "tokens_per_trunk_pass": emitted / passes if passes else float("nan"),
        "drafted": drafted,
        "accepted": accepted,
    }


# The samplers the Qwen3.5/3.6 model card recommends, beside greedy (label -> qmtp.Sampling fields): the card's
# thinking mode, its precise-coding variant of thinking mode, and non-thinking mode.
CHAT_SAMPLERS = {
    "greedy": {},
    "thinking": {"temperature": 1.0, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "presence_penalty": 1.5},
    "precise coding": {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "presence_penalty": 0.0},
    "non-thinking": {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0, "presence_penalty": 1.5},
}


def chat_prompts(n: int, seed: int = 0) -> list[list[dict]]:
    """`n` held-out conversations of `qmtp.tiny.chat_corpus` without their last reply: what a user asks."""
    from . import chat_corpus

    return [messages[:-1] for messages, _ in chat_corpus.conversations(n, seed, "heldout")]


def chat_acceptance(model: Model, conversations: list[list[dict]], n_draft: int = 4, max_tokens: int = 48,
                    samplers: dict | None = None, seed: int = 0) -> list[dict]:
    """Speculative decoding of a reply to each conversation, rendered by the model's chat template with thinking on
    and off, under each sampler (`CHAT_SAMPLERS` by default); acceptance per draft position pooled over the
    conversations, one row per (sampler, thinking). Sampled runs use seeds seed, seed + 1, ... per
    conversation, the same in every row, so rows differ by their settings only."""
    from ..speculative import generate

    rows = []
    for label, settings in (samplers if samplers is not None else CHAT_SAMPLERS).items():
        for thinking in (True, False):
            k = n_draft - 1
            drafted, accepted = [0] * k, [0] * k
            emitted = passes = generated = 0
            for i, messages in enumerate(conversations):
                stats = generate(model, messages=messages, enable_thinking=thinking, max_tokens=max_tokens,
                                 n_draft=n_draft, seed=seed + i, **settings).stats
                drafted = [a + b for a, b in zip(drafted, stats.drafted)]
                accepted = [a + b for a, b in zip(accepted, stats.accepted)]
                emitted += sum(len(s.emitted) for s in stats.steps)
                passes += stats.trunk_passes
                generated += stats.generated
            rows.append({
                "sampler": label, "thinking": thinking, "settings": settings, "n_draft": n_draft,
                "per_position": [a / d if d else float("nan") for a, d in zip(accepted, drafted)],
                "rate": sum(accepted) / sum(drafted) if sum(drafted) else float("nan"),
                "tokens_per_trunk_pass": emitted / passes if passes else float("nan"),
                "generated": generated, "drafted": drafted, "accepted": accepted,
            })
    return rows


# The engines' drafting choices, as `qmtp.Engine` switches (chapter 5 measures each): label -> switches.
ENGINE_CHOICES = {
    "qmtp (cache kept, post-norm)": {},
    "cache reset each step": {"head_cache": "reset"},
    "pre-norm trunk state": {"hidden": "pre"},
    "reset + pre-norm (lemon)": {"head_cache": "reset", "hidden": "pre"},
    "chain on pre-norm head output": {"chain": "pre"},
}


def head_input_agreement(model: Model, prompts: list[list[int]]) -> dict:
    """How alike the head's input is when it is fed the trunk's state before or after the final norm.

    The head normalises what it is fed (`pre_fc_norm_hidden`, an RMSNorm, blind to scale), and the final norm is
    an RMSNorm too, so the two inputs differ only through the final norm's weights, one per channel: with equal
    weights they would be the same. Returns the cosine between the head's normalised input from the pre-norm and
    from the post-norm state (mean and lowest over every position of `prompts`) and the spread of the final
    norm's weights (standard deviation over mean magnitude; 0 for equal weights)."""
    from .. import decoding

    cosines = []
    for prompt in prompts:
        state = decoding.empty_state(model, decoding.capacity_for(len(prompt)), head=False)
        pre, post, _, _ = decoding.trunk_step(model, mx.array([prompt], mx.int32), state, record=False)
        a = model.mtp.pre_fc_norm_hidden(pre).astype(mx.float32)[0]
        b = model.mtp.pre_fc_norm_hidden(post).astype(mx.float32)[0]
        cos = (a * b).sum(-1) / (mx.linalg.norm(a, axis=-1) * mx.linalg.norm(b, axis=-1))
        cosines += np.array(cos).tolist()
    w = np.array(model.norm.weight.astype(mx.float32))
    return {"cosine": float(np.mean(cosines)), "cosine_min": float(np.min(cosines)),
            "norm_weight_spread": float(w.std() / np.abs(w).mean())}


def predicted_acceptance(model: Model, prompt: list[int], generated: list[int]) -> dict:
    """The greedy acceptance at n_draft=2 that teacher forcing predicts for a given greedy generation.

    Teacher-forced over prompt + generated, the head's top-1 at position t (from h_t and x_{t+1}) is exactly
    the draft that speculative decoding proposes when a step starts at t, because the head's cache then
    holds the trunk's true states for every earlier position. A step that accepts moves on by two tokens,
    one that rejects by one; walking the agreement vector that way predicts every accept and reject.
    """
    tokens = mx.array([list(prompt) + list(generated)])
    _, h = model.trunk(tokens)
    trunk_top = np.array(mx.argmax(model.logits(h), axis=-1))[0]
    head_top = np.array(mx.argmax(model.logits(model.require_head()(h[:, :-1], model.embed_tokens(tokens[:, 1:]))), axis=-1))[0]
    agree = head_top == trunk_top[1:]  # agree[t]: the head's guess for x_{t+2} is the trunk's
    t, proposed, accepted = len(prompt) - 1, 0, 0
    # The last step that can draft starts where its pending token and its draft still lie inside the text.
    while t + 2 < len(prompt) + len(generated):
        proposed += 1
        if agree[t]:
            accepted += 1
            t += 2
        else:
            t += 1
    return {"proposed": proposed, "accepted": accepted, "rate": accepted / proposed if proposed else float("nan")}


def logit_agreement(model_a: Model, model_b, texts: list[str], length: int = 128) -> dict:
    """How close two models' logits are on the same text: top-1 agreement and relative error.

    `model_b` may be any callable that maps tokens [B, T] to logits (an mlx-lm model, for instance).
    """
    rows = _windows(model_a, texts, length)[:4, :-1]
    a = np.array(model_a(mx.array(rows)).astype(mx.float32), dtype=np.float64)
    b = np.array(model_b(mx.array(rows)).astype(mx.float32), dtype=np.float64)
    return {
        "tokens": int(rows.size),
        "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).mean()),
        "max_relative_error": float(np.abs(a - b).max() / np.abs(b).max()),
    }


def load_head(model: Model, path) -> MTPHead:
    """An MTP head saved by `qmtp.tiny.train.save_head` (effective weights, qmtp's own names), for `model`'s config."""
    from mlx.utils import tree_unflatten

    head = MTPHead(model.config)
    head.update(tree_unflatten([(n, w.astype(model.dtype)) for n, w in mx.load(str(path)).items()]))
    head.eval()
    return head


def previous_head(model: Model) -> MTPHead | None:
    """The head `model`'s own head was trained from by `qmtp.tiny.train --head-only`, if its folder keeps it
    (the bundled model does: its head before chained training), else None."""
    path = model.path / PREVIOUS_HEAD_FILE if model.path is not None else None
    return load_head(model, path) if path is not None and path.exists() else None


def compare_heads(model: Model, heads: dict, prompts: list[list[int]], n_drafts=(2, 3, 4, 5),
                  max_tokens: int = 48, repeats: int = 1) -> dict:
    """Greedy speculative decoding with each head in `heads` (label -> MTPHead, None for the model's own),
    interleaved: for every prompt and n_draft the heads run one after the other, so that a slower spell of a
    shared machine hits them alike. Per head and n_draft: acceptance per position, tokens per trunk pass and
    decode speed pooled over the runs; per n_draft, the median over (prompt, repeat) pairs of each head's
    speed over the first head's (the ratio the noise of single timings does not swamp).
    """
    from ..options import Engine
    from ..speculative import generate

    labels = list(heads)
    tally = {(label, n): {"drafted": [0] * (n - 1), "accepted": [0] * (n - 1), "emitted": 0, "passes": 0,
                          "generated": 0, "seconds": 0.0} for label in labels for n in n_drafts}
    ratios = {(label, n): [] for label in labels for n in n_drafts}
    for _ in range(repeats):
        for prompt in prompts:
            for n in n_drafts:
                speeds = {}
                for label in labels:
                    stats = generate(model, prompt, max_tokens=max_tokens, n_draft=n,
                                     engine=Engine(head=heads[label])).stats
                    t = tally[(label, n)]
                    t["drafted"] = [a + b for a, b in zip(t["drafted"], stats.drafted)]
                    t["accepted"] = [a + b for a, b in zip(t["accepted"], stats.accepted)]
                    t["emitted"] += sum(len(s.emitted) for s in stats.steps)
                    t["passes"] += stats.trunk_passes
                    t["generated"] += stats.generated
                    t["seconds"] += stats.decode_seconds
                    speeds[label] = stats.tokens_per_second
                for label in labels:
                    ratios[(label, n)].append(speeds[label] / speeds[labels[0]])
    out: dict = {label: {} for label in labels}
    for (label, n), t in tally.items():
        out[label][n] = {
            "per_position": [a / d if d else float("nan") for a, d in zip(t["accepted"], t["drafted"])],
            "tokens_per_trunk_pass": t["emitted"] / t["passes"] if t["passes"] else float("nan"),
            "tokens_per_second": t["generated"] / t["seconds"] if t["seconds"] else float("nan"),
            "speed_ratio_to_first": float(np.median(ratios[(label, n)])),
        }
    return out
