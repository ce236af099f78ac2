"""Training the bundled tiny model: `python -m qmtp.tiny.train OUT [--quick]`, or its head alone (`--head-only`).

The tiny model is the real architecture scaled down (every layer a 256-expert top-8 MoE with a gated
shared expert, 3 linear + 1 full attention layers repeated, gated attention with partial rotary, an MTP
head that is a full decoder layer with its own 256 experts). It is trained here on the generated corpus
of `qmtp.tiny.corpus` with three terms:

    loss = CE(trunk logits at t, x_{t+1})
         + mtp_weight * CE(head logits at t, x_{t+2})     # head sees h_t (post final norm) and embed(x_{t+1})
         + balance_weight * mean over MoE layers of E * sum_e f_e P_e

A second stage, `--head-only --chained K`, trains the head alone for chained drafting, the trunk frozen
(it resumes from the weights in `--from`, the bundled model by default). At decode time the head's second
and later drafts start from its own post-norm output z, not from a trunk state:

    z_1 = head(h_t, embed(x_{t+1}))         -> x_{t+2}
    z_j = head(z_{j-1}, embed(x_{t+j}))     -> x_{t+j+1}      (j = 2 .. K + 1)

so the loss adds, to the step on true trunk states, K teacher-forced steps on the head's own outputs
(the true next tokens as inputs, as DeepSeek-V3's MTP and EAGLE do), step j weighted chain_decay^(j-1):
sum_j w_j CE_j / sum_j w_j. Each step's attention reads exactly the keys the head's cache holds when it
drafts: true-state entries up to the step's start, its own chain entries after it (`chain_mask`). The
targets are the trunk's own next-token distributions (`--targets trunk`, what greedy acceptance asks the
head to match) or the text's tokens (`--targets text`). `--chained 0` is the same stage with the first step
only, the control that tells the chained steps' effect from that of more training.

Seeded and resumable: every `--save-every` steps the weights, optimizer state and loss history are
written to OUT/train_state (atomically), and a rerun with the same OUT continues from there. The result
is exported in the released Qwen3.6 layout by `qmtp.tiny.export`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..config import ModelConfig
from ..conventions import is_conv_kernel
from ..errors import QmtpError, UsageError
from ..model import Model

# The tiny model: real layer pattern and expert count, toy widths. 8 trunk layers + the head's layer,
# each with 256 experts of intermediate width 16 (its parameter count and size are in its model card).
TOKENIZER_SAMPLE_BYTES = 2_000_000  # the tokenizer is trained on the first this many bytes of the training split

TINY = dict(
    hidden_size=64,
    num_hidden_layers=8,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    rope_theta=10_000.0,
    partial_rotary_factor=0.25,
    max_position_embeddings=4096,
    mtp_num_hidden_layers=1,
)
# --quick: a smaller copy (same pattern, fewer experts) that trains in about a minute, for tests.
QUICK = dict(TINY, num_hidden_layers=4, num_experts=32, num_experts_per_tok=4, hidden_size=48)


def tiny_config(vocab_size: int, quick: bool = False) -> ModelConfig:
    return ModelConfig(vocab_size=vocab_size, **(QUICK if quick else TINY))


def initialise(model: Model, seed: int) -> None:
    """Fresh weights in effective form: norms at 1, linear maps ~ N(0, 1/fan_in), decays spread over [1, 16]."""
    rng = np.random.default_rng(seed)
    new = []
    n_layers = model.config.num_hidden_layers + 1
    for name, p in tree_flatten(model.parameters()):
        shape = p.shape
        if name.endswith("norm.weight"):
            value = np.ones(shape)
        elif name.endswith(".A_log"):
            value = np.log(rng.uniform(1.0, 16.0, shape))
        elif name.endswith(".dt_bias"):
            value = np.log(np.expm1(rng.uniform(0.001, 0.1, shape)))  # softplus^-1 of small time steps
        elif is_conv_kernel(name):
            value = rng.normal(0.0, shape[1] ** -0.5, shape)
        elif name == "embed_tokens.weight":
            value = rng.normal(0.0, 1.0, shape)
        else:
            std = shape[-1] ** -0.5
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                std /= math.sqrt(2 * n_layers)  # residual branches start small
            value = rng.normal(0.0, std, shape)
        new.append((name, mx.array(value.astype(np.float32))))
    model.update(tree_unflatten(new))


def moe_layers(model: Model):
    layers = list(model.layers) + (list(model.mtp.layers) if model.mtp is not None else [])
    return [layer.mlp for layer in layers]


def losses(model: Model, batch: mx.array, balance: bool = True, weights: mx.array | None = None) -> dict[str, mx.array]:
    """Trunk next-token CE, head CE for the token after next, and the balance term, on [B, T + 1] tokens.

    `weights` [B, T + 1]: how much each token counts as a target (the chat fine-tune's 1 for what the model
    writes, 0 for what it is only shown); None: every token, equally."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    mlps = moe_layers(model)
    for mlp in mlps:
        mlp.balance_log = [] if balance else None
    _, h = model.trunk(inputs)

    def mean(ce, w):
        return ce.mean() if w is None else (ce * w).sum() / mx.maximum(w.sum(), 1.0)

    trunk_ce = mean(nn.losses.cross_entropy(model.logits(h), targets), None if weights is None else weights[:, 1:])
    head_ce = mean(nn.losses.cross_entropy(model.logits(model.head_states(h, inputs)), targets[:, 1:]),
                   None if weights is None else weights[:, 2:])
    terms = [t for mlp in mlps for t in (mlp.balance_log or [])]
    for mlp in mlps:
        mlp.balance_log = None
    out = {"trunk": trunk_ce, "head": head_ce}
    out["balance"] = mx.mean(mx.stack(terms)) if terms else mx.array(0.0)
    return out


def learning_rate(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


class Batches:
    """Random windows of a token stream, reproducible from (seed, step)."""

    def __init__(self, tokens: np.ndarray, batch: int, length: int, seed: int):
        self.tokens, self.batch, self.length, self.seed = tokens, batch, length, seed

    def __call__(self, step: int) -> mx.array:
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.tokens) - self.length - 1, self.batch)
        return mx.array(np.stack([self.tokens[s: s + self.length + 1] for s in starts]).astype(np.int32))


# ---- the head alone, trained for chained drafting ----------------------------------------------------------
def chain_mask(length: int, depth: int) -> np.ndarray:
    """Which keys step `depth` of an unrolled chain reads, [length, depth * length] booleans.

    Keys are the `depth` steps' entries side by side (step d's entry at position p is column (d-1)*length + p).
    A draft made by step j at position q starts from the true trunk state at q - j + 1; the head's cache then
    holds true-state (step 1) entries up to q - j + 1 and its own step-(j - (q - p)) entry at each later
    position p <= q. Position q < j - 1 has no such start: its row reads only its own entry and its loss is
    not counted (it never reaches a counted row either).
    """
    q = np.arange(length)[:, None, None]
    d = np.arange(1, depth + 1)[None, :, None]
    p = np.arange(length)[None, None, :]
    allowed = (p <= q) & (d == np.maximum(1, depth - (q - p)))
    return allowed.reshape(length, depth * length)


def chained_head_states(head, hidden: mx.array, next_embeddings: mx.array, depth: int) -> list[mx.array]:
    """The head unrolled `depth` steps, teacher-forced: [z_1, .., z_depth], each [B, L, H].

    hidden [B, L, H] holds the trunk states h_q and next_embeddings [B, L, H] embed(x_{q+1}); step j at position
    q reads z_{j-1} at q - 1 (zeros at q = 0) and embed(x_{q+1}) and predicts x_{q+2}, like the j-th draft of
    a decode step that started at q - j + 1. The layer is the head's own (its `step` over the head's KV buffers
    gives the same values one position at a time: tests/test_train.py checks it); only the attention is spelled out
    here, because each step reads earlier steps' keys (`chain_mask`)."""
    layer = head.layers[0]
    attn = layer.self_attn
    B, L, _ = hidden.shape
    keys, values, states = [], [], []
    embedded = head.pre_fc_norm_embedding(next_embeddings)
    for j in range(1, depth + 1):
        if j > 1:
            hidden = mx.concatenate([mx.zeros_like(states[-1][:, :1]), states[-1][:, :-1]], axis=1)
        x = head.fc(mx.concatenate([embedded, head.pre_fc_norm_hidden(hidden)], axis=-1))
        q, k, v, gate = attn.project(layer.input_layernorm(x), 0)
        keys.append(k)
        values.append(v)
        if j == 1:
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=attn.scale, mask="causal")
        else:
            mask = mx.array(chain_mask(L, j))
            out = mx.fast.scaled_dot_product_attention(q, mx.concatenate(keys, axis=2), mx.concatenate(values, axis=2),
                                                       scale=attn.scale, mask=mask)
        mixed = x + attn.output(out, gate)
        states.append(head.norm(mixed + layer.mlp(layer.post_attention_layernorm(mixed))))
    return states


def chain_weights(depth: int, decay: float) -> list[float]:
    return [decay ** j for j in range(depth)]


def head_losses(model: Model, batch: mx.array, depth: int, decay: float, targets: str,
                balance: bool = True) -> dict[str, mx.array]:
    """Per-step head cross-entropies on [B, T + 1] tokens, their weighted mean ("head") and the head's balance term.

    The trunk runs outside any gradient (frozen): its states and target distributions are constants."""
    inputs = batch[:, :-1]
    _, h = model.trunk(inputs)
    h = mx.stop_gradient(h)
    if targets == "trunk":
        goal = mx.stop_gradient(mx.softmax(model.logits(h[:, 1:]).astype(mx.float32), axis=-1))  # trunk's x_{q+2}
    else:
        goal = batch[:, 2:]
    embeddings = mx.stop_gradient(model.embed_tokens(inputs[:, 1:]))
    mlps = moe_layers(model)[-len(model.mtp.layers):]
    for mlp in mlps:
        mlp.balance_log = [] if balance else None
    states = chained_head_states(model.mtp, h[:, :-1], embeddings, depth)
    out = {}
    for j, z in enumerate(states, start=1):
        logits = model.logits(z[:, j - 1:]).astype(mx.float32)  # positions with a true start for step j
        if targets == "trunk":
            ce = -(goal[:, j - 1:] * (logits - mx.logsumexp(logits, axis=-1, keepdims=True))).sum(-1)
        else:
            ce = nn.losses.cross_entropy(logits, goal[:, j - 1:])
        out[f"head_{j}"] = ce.mean()
    weights = chain_weights(depth, decay)
    out["head"] = sum(w * out[f"head_{j}"] for j, w in enumerate(weights, start=1)) / sum(weights)
    terms = [t for mlp in mlps for t in (mlp.balance_log or [])]
    for mlp in mlps:
        mlp.balance_log = None
    out["balance"] = mx.mean(mx.stack(terms)) if terms else mx.array(0.0)
    return out


def chain_agreement(model: Model, batch: mx.array, depth: int) -> list[float]:
    """Per unrolled step, teacher-forced: how often the head's top-1 is the trunk's top-1 (greedy acceptance's test)."""
    inputs = batch[:, :-1]
    _, h = model.trunk(inputs)
    trunk_top = mx.argmax(model.logits(h[:, 1:]), axis=-1)
    states = chained_head_states(model.require_head(), h[:, :-1], model.embed_tokens(inputs[:, 1:]), depth)
    return [float(mx.mean(mx.argmax(model.logits(z[:, j:]), axis=-1) == trunk_top[:, j:]))
            for j, z in enumerate(states)]


def token_stream(tokenizer, texts: list[str]) -> np.ndarray:
    """Documents tokenized and joined, each followed by end-of-text (as the trunk was trained)."""
    stream = []
    for start in range(0, len(texts), 5000):
        for ids in tokenizer.encode_batch(texts[start: start + 5000]):
            stream.extend(ids)
            stream.append(tokenizer.eos_id)
    return np.array(stream, dtype=np.uint16)


def chat_texts(tokenizer, n: int, seed: int, stream: str = "train") -> list[str]:
    """`n` conversations of `qmtp.tiny.chat_corpus` rendered by the tokenizer's chat template, as trained on."""
    from . import chat_corpus

    return [tokenizer.apply_chat_template(messages, add_generation_prompt=False)
            for messages, _ in chat_corpus.conversations(n, seed, stream)]


def mixed_texts(tokenizer, seed: int, n_train: int, n_chat: int) -> list[str]:
    """The first `n_train` documents of the corpus's training split and, with `n_chat`, that many rendered
    conversations, shuffled together (seeded): a fine-tune on conversations alone would let the plain
    registers drift, and the head and the book measure those too."""
    from . import corpus

    texts = [text for _, text in corpus.splits(seed=seed, n_train=n_train, n_heldout=0)["train"]]
    if n_chat:
        texts += chat_texts(tokenizer, n_chat, seed)
        order = np.random.default_rng(seed).permutation(len(texts))
        texts = [texts[i] for i in order]
    return texts


def prepare_head_data(out: Path, source: Path, seed: int, n_train: int, n_chat: int = 0) -> dict:
    """The training split (and `n_chat` conversations) tokenized with the source model's own tokenizer, cached
    in OUT/data."""
    import shutil

    from .. import tokenizer as tok
    from .export import TOKENIZER_FILES

    data_dir = out / "data"
    cached = data_dir / "tokens.npz"
    if not cached.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            if (source / name).exists():
                shutil.copy2(source / name, data_dir / name)
        tokenizer = tok.Tokenizer.from_dir(data_dir)
        print(f"generating and tokenizing {n_train} training documents and {n_chat} conversations (seed {seed})",
              flush=True)
        tmp = data_dir / "tokens.tmp.npz"
        np.savez(tmp, train=token_stream(tokenizer, mixed_texts(tokenizer, seed, n_train, n_chat)))
        os.replace(tmp, cached)
    return {"train": np.load(cached, allow_pickle=False)["train"], "tokenizer": tok.Tokenizer.from_dir(data_dir)}


def reply_weights(tokenizer, conversations) -> list[tuple[list[int], list[int]]]:
    """(ids, weights) of each conversation rendered whole: weight 1 on its last reply as the model writes it
    (after the generation prompt, up to and including `<|im_end|>`), 0 on everything it is shown. The prompt
    is rendered as `generate` renders it for that conversation's thinking mode, so with thinking off the empty
    `<think>\n\n</think>\n\n` counts as prompt: trained on, it would teach the model that a reply opened with
    `<think>\n` (thinking on) may close at once."""
    from .chat_format import IM_END

    end = tokenizer.token_to_id(IM_END)
    out = []
    for messages, thinking in conversations:
        prompt = tokenizer.apply_chat_template(messages[:-1], enable_thinking=thinking, tokenize=True)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
        if ids[:len(prompt)] != prompt or end not in ids[len(prompt):]:
            raise QmtpError("a rendered conversation does not continue its own prompt token for token")
        stop = ids.index(end, len(prompt)) + 1
        out.append((ids, [0] * len(prompt) + [1] * (stop - len(prompt)) + [0] * (len(ids) - stop)))
    return out


def chat_stream(tokenizer, seed: int, n_train: int, n_chat: int, stream: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """The chat fine-tune's tokens and target weights: the first `n_train` training documents (every token
    counts) and `n_chat` conversations (their last reply counts, `reply_weights`), shuffled together (seeded),
    each followed by end-of-text; a fine-tune on conversations alone would let the plain registers drift."""
    from . import chat_corpus, corpus

    texts = [text for _, text in corpus.splits(seed=seed, n_train=n_train, n_heldout=0)["train"]] if n_train else []
    docs = [(ids, [1] * len(ids)) for ids in tokenizer.encode_batch(texts)]
    docs += reply_weights(tokenizer, chat_corpus.conversations(n_chat, seed, stream))
    tokens, weights = [], []
    for i in np.random.default_rng(seed).permutation(len(docs)):
        ids, w = docs[i]
        tokens += ids + [tokenizer.eos_id]
        weights += w + [1 if w[-1] else 0]  # end-of-text counts after a plain document, not after a reply
    return np.array(tokens, dtype=np.uint16), np.array(weights, dtype=np.uint8)


class WeightedBatches(Batches):
    """`Batches` of tokens with their target weights, stacked: [2, B, T + 1] (tokens, then weights)."""

    def __init__(self, tokens: np.ndarray, weights: np.ndarray, batch: int, length: int, seed: int):
        super().__init__(np.stack([tokens.astype(np.int32), weights.astype(np.int32)], axis=1), batch, length, seed)

    def __call__(self, step: int) -> mx.array:
        return super().__call__(step).transpose(2, 0, 1)


def prepare_chat_data(out: Path, source: Path, seed: int, n_train: int, n_chat: int) -> dict:
    """The chat fine-tune's data, cached in OUT/data: the source's tokenizer extended with the chat tokens
    (`qmtp.tiny.chat_format`), and `chat_stream` tokenized with it."""
    from .. import tokenizer as tok
    from .chat_format import extend_tokenizer

    data_dir = out / "data"
    cached = data_dir / "tokens.npz"
    if not cached.exists():
        tokenizer = extend_tokenizer(source, data_dir)
        print(f"generating and tokenizing {n_train} training documents and {n_chat} conversations (seed {seed})",
              flush=True)
        tokens, weights = chat_stream(tokenizer, seed, n_train, n_chat)
        tmp = data_dir / "tokens.tmp.npz"
        np.savez(tmp, train=tokens, weights=weights)
        os.replace(tmp, cached)
    arrays = np.load(cached, allow_pickle=False)
    return {"train": arrays["train"], "weights": arrays["weights"], "tokenizer": tok.Tokenizer.from_dir(data_dir)}


def load_start(source: Path, start: str) -> Model:
    """The model in `source`, in float32, with the head a head-only stage starts from: its own ("own"), or the
    one its folder keeps from before its last head-only stage ("previous", which reruns that stage exactly)."""
    from . import evaluate
    from ..loading import load

    if start not in ("own", "previous"):
        raise UsageError(f"--start-head {start}: use 'own' (the model's head) or 'previous' (the head it keeps)")
    model = load(source, dtype=mx.float32)
    if start == "previous":
        head = evaluate.previous_head(model)
        if head is None:
            raise UsageError(f"--start-head previous: {source} keeps no {evaluate.PREVIOUS_HEAD_FILE}")
        model.mtp.update(head.parameters())
    return model


def train_head(out: Path, source: Path, steps: int, batch: int, length: int, lr: float, seed: int, chained: int,
               chain_decay: float, targets: str, balance_weight: float, save_every: int, eval_every: int,
               n_train: int, stop_after: int | None = None, start: str = "own", n_chat: int = 0) -> tuple[Model, bool]:
    """Train (or resume) the head of the model in `source` for chained drafting; the trunk stays as loaded."""
    from . import evaluate

    if targets not in ("trunk", "text"):
        raise UsageError(f"--targets {targets}: use 'trunk' (the trunk's distributions) or 'text' (the text's tokens)")
    if chained < 0:
        raise UsageError(f"--chained {chained}: give the number of steps on the head's own outputs, 0 or more")
    out.mkdir(parents=True, exist_ok=True)
    run = {"stage": "head-only", "source": str(source), "start_head": start, "steps": steps, "batch": batch, "length": length, "lr": lr,
           "seed": seed, "chained": chained, "chain_decay": chain_decay, "targets": targets,
           "balance_weight": balance_weight, "n_train": n_train, "n_chat": n_chat, "cores": os.cpu_count()}
    (out / "run.json").write_text(json.dumps(run, indent=2) + "\n")
    data = prepare_head_data(out, source, seed, n_train, n_chat)
    mx.random.seed(seed)
    model = load_start(source, start)
    model.freeze()
    model.mtp.unfreeze()
    model.mtp.train()
    optimizer = optim.AdamW(learning_rate=lr, weight_decay=0.01)
    depth = chained + 1

    def objective(head, batch):
        parts = head_losses(model, batch, depth, chain_decay, targets)
        return parts["head"] + balance_weight * parts["balance"], parts

    probe_texts = evaluate.heldout_texts(8)
    probe = mx.array(evaluate._windows(model, probe_texts, length)[:8])
    probe_depth = max(depth, 4)  # the probe always measures four steps, so runs with any --chained compare

    def measure(step):
        if not (step == 0 or (step + 1) % eval_every == 0 or step + 1 == steps):
            return {}
        held = head_losses(model, probe, probe_depth, chain_decay, "text", balance=False)
        return {**{f"heldout_{k}": float(v) for k, v in held.items() if k.startswith("head_")},
                **{f"heldout_agree_{j}": a for j, a in enumerate(chain_agreement(model, probe, probe_depth), 1)}}

    progress = optimise(out, model.mtp, optimizer, objective, Batches(data["train"], batch, length, seed),
                        steps, lr, max(1, min(50, steps // 20)), save_every, stop_after, "training the head",
                        measure, lambda record: {k: f"{record[k]:.3f}" for k in record if k.startswith("head_")})
    (out / "head_loss_curve.json").write_text(json.dumps(progress["history"]))
    model.mtp.eval()
    return model, progress["step"] >= steps


def save_head(head, path: Path) -> None:
    """A head's effective weights in bfloat16 under qmtp's own names (`qmtp.book.evaluate.load_head` reads them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial.safetensors")
    weights = {n: w.astype(mx.bfloat16) for n, w in tree_flatten(head.parameters())}
    mx.save_safetensors(str(tmp), weights, metadata={"format": "mlx", "content": "qmtp MTPHead, effective weights"})
    os.replace(tmp, path)


def export_head_stage(model: Model, source: Path, dest: Path, out: Path, start: str = "own", chat: bool = False) -> None:
    """The source model with its new head, in the released layout, with the source's tokenizer and loss curve
    (the trunk's training), the head stage's own curve, and the source's head as it was (for comparisons). After
    a chat fine-tune (`chat`) the first head stage's records pass through and this one's curve is the chat one."""
    import shutil

    from ..checkpoint import Checkpoint, write_safetensors
    from .evaluate import PREVIOUS_HEAD_FILE
    from .export import TOKENIZER_FILES, export_released

    export_released(model, dest)
    # The trunk's tensors are copied as stored: a zero-centred norm weight w that went through its effective
    # form 1 + w in float32 and back can lose its lowest bits, and the trunk must not change at all.
    kept, written = Checkpoint(source), Checkpoint(dest)
    if sorted(kept.names()) != sorted(written.names()):
        raise QmtpError(f"{source}: its tensors are not the ones the head-only export writes; export it afresh")

    def stored_bytes(info):
        def read() -> bytes:
            with open(info.file, "rb") as f:
                f.seek(info.offset)
                return f.read(info.nbytes)
        return read

    def chosen(name: str):
        return (written if name.startswith("mtp.") else kept).infos[name]

    entries = [(n, chosen(n).dtype, chosen(n).shape, stored_bytes(chosen(n))) for n in written.names()]
    tmp = dest / "model.partial"
    write_safetensors(tmp, entries, {"format": "pt"})
    os.replace(tmp, dest / "model.safetensors")
    save_head(load_start(source, start).mtp, dest / PREVIOUS_HEAD_FILE)
    for name in (*TOKENIZER_FILES, "loss_curve.json", "training.json", CHAT_CURVE_FILE,
                 *(FIRST_HEAD_RECORDS if chat else ())):
        if (source / name).exists():
            shutil.copy2(source / name, dest / name)
    shutil.copy2(out / "head_loss_curve.json", dest / (CHAT_HEAD_CURVE_FILE if chat else "head_loss_curve.json"))


# ---- data ------------------------------------------------------------------------------------------------
def prepare_data(out: Path, seed: int, n_train: int, n_heldout: int, vocab_size: int) -> dict:
    """Corpus -> tokenizer -> token streams, cached in OUT/data so a resumed run does not redo them."""
    from . import corpus
    from .bpe import train_bpe
    from .. import tokenizer as tok

    data_dir = out / "data"
    cached = data_dir / "tokens.npz"
    if cached.exists():
        arrays = np.load(cached, allow_pickle=False)
        heldout = json.loads((data_dir / "heldout.json").read_text())
        return {"train": arrays["train"], "heldout": heldout, "tokenizer": tok.Tokenizer.from_dir(data_dir)}

    print(f"generating {n_train} training and {n_heldout} held-out documents (seed {seed})", flush=True)
    docs = corpus.splits(seed=seed, n_train=n_train, n_heldout=n_heldout)
    heldout = corpus.drop_seen(docs["heldout"], docs["train"])
    sample, size = [], 0
    for _, text in docs["train"]:
        sample.append(text)
        size += len(text)
        if size > TOKENIZER_SAMPLE_BYTES:
            break
    backend = train_bpe(sample, vocab_size=vocab_size)
    data_dir.mkdir(parents=True, exist_ok=True)
    tok.save(backend, data_dir)
    tokenizer = tok.Tokenizer.from_dir(data_dir)
    print("tokenizing the training corpus", flush=True)
    eos = tokenizer.eos_id
    stream = []
    texts = [text for _, text in docs["train"]]
    for start in range(0, len(texts), 5000):
        for ids in tokenizer.encode_batch(texts[start: start + 5000]):
            stream.extend(ids)
            stream.append(eos)
    train = np.array(stream, dtype=np.uint16)
    tmp = data_dir / "tokens.tmp.npz"
    np.savez(tmp, train=train)
    (data_dir / "heldout.json").write_text(json.dumps([{"register": r, "text": t} for r, t in heldout]))
    os.replace(tmp, cached)
    return {"train": train, "heldout": [{"register": r, "text": t} for r, t in heldout], "tokenizer": tokenizer}


def heldout_batch(heldout: list[dict], tokenizer, batch: int, length: int) -> mx.array:
    """A fixed held-out batch for the loss curve: documents joined by end-of-text, cut into rows."""
    ids = []
    for doc in heldout:
        ids.extend(tokenizer.encode(doc["text"]) + [tokenizer.eos_id])
        if len(ids) >= batch * (length + 1):
            break
    rows = np.array(ids[: batch * (length + 1)], dtype=np.int32).reshape(batch, length + 1)
    return mx.array(rows)


# ---- resumable state -------------------------------------------------------------------------------------
def save_state(out: Path, model: Model, optimizer, progress: dict) -> None:
    """Write weights, optimizer state and progress to a new folder, then point `latest.json` at it."""
    state_dir = out / f"state-{progress['step']:06d}"
    tmp = out / f".tmp-{state_dir.name}"
    tmp.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(tmp / "weights.safetensors"), dict(tree_flatten(model.parameters())))
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
    (tmp / "progress.json").write_text(json.dumps(progress))
    os.replace(tmp, state_dir)
    latest = out / "latest.json"
    previous = json.loads(latest.read_text())["state"] if latest.exists() else None
    (out / "latest.tmp.json").write_text(json.dumps({"state": state_dir.name}))
    os.replace(out / "latest.tmp.json", latest)
    if previous and previous != state_dir.name:
        import shutil

        shutil.rmtree(out / previous, ignore_errors=True)


def load_state(out: Path, model: Model, optimizer) -> dict | None:
    latest = out / "latest.json"
    if not latest.exists():
        return None
    state_dir = out / json.loads(latest.read_text())["state"]
    model.update(tree_unflatten(list(mx.load(str(state_dir / "weights.safetensors")).items())))
    optimizer.state = tree_unflatten(list(mx.load(str(state_dir / "optimizer.safetensors")).items()))
    return json.loads((state_dir / "progress.json").read_text())


# ---- the loop --------------------------------------------------------------------------------------------
def optimise(out: Path, module, optimizer, objective, batches, steps: int, lr: float, warmup: int, save_every: int,
             stop_after: int | None, desc: str, measure, postfix) -> dict:
    """The loop both stages run: resume from the state saved in `out`, then AdamW steps on `module` (clipped to
    norm 1, warm-up then cosine) up to `steps`, or `stop_after` more; each step's losses, and what
    `measure(step)` adds, go into the history; the state is saved every `save_every` steps and at the end."""
    from tqdm import tqdm

    progress = load_state(out, module, optimizer) or {"step": 0, "history": [], "elapsed": 0.0}
    if progress["step"]:
        print(f"resuming from step {progress['step']}", flush=True)
    value_and_grad = nn.value_and_grad(module, objective)
    bar = tqdm(total=steps, initial=progress["step"], desc=desc, unit="step", dynamic_ncols=True)
    started = time.time() - progress["elapsed"]
    stop_at = steps if stop_after is None else min(steps, progress["step"] + stop_after)
    while progress["step"] < stop_at:
        step = progress["step"]
        optimizer.learning_rate = learning_rate(step, steps, lr, warmup)
        (loss, parts), grads = value_and_grad(module, batches(step))
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(module, grads)
        mx.eval(module.parameters(), optimizer.state, loss, parts)
        progress["step"] = step + 1
        record = {"step": step + 1, "tokens": (step + 1) * batches.batch * batches.length, "loss": float(loss),
                  **{k: float(v) for k, v in parts.items()}, **measure(step)}
        progress["history"].append(record)
        progress["elapsed"] = time.time() - started
        bar.update(1)
        bar.set_postfix(**postfix(record))
        if (step + 1) % save_every == 0 or step + 1 in (steps, stop_at):
            save_state(out, module, optimizer, progress)
    bar.close()
    return progress


def train(out: Path, steps: int, batch: int, length: int, lr: float, seed: int, quick: bool,
          mtp_weight: float, balance_weight: float, save_every: int, eval_every: int,
          n_train: int, n_heldout: int, vocab_size: int, stop_after: int | None = None) -> tuple[Model, bool]:
    """Train (or resume) in `out`; returns the model and whether all `steps` are done."""
    out.mkdir(parents=True, exist_ok=True)
    run = {"steps": steps, "batch": batch, "length": length, "lr": lr, "seed": seed, "quick": quick,
           "mtp_weight": mtp_weight, "balance_weight": balance_weight, "n_train": n_train, "n_heldout": n_heldout,
           "vocab_size": vocab_size, "cores": os.cpu_count()}  # the machine that trains, for the card
    (out / "run.json").write_text(json.dumps(run, indent=2) + "\n")
    data = prepare_data(out, seed, n_train, n_heldout, vocab_size)
    tokenizer = data["tokenizer"]
    config = tiny_config(tokenizer.vocab_size, quick=quick)
    (out / "config.json").write_text(json.dumps(config.to_released_dict(), indent=2))
    mx.random.seed(seed)
    model = Model(config)
    initialise(model, seed)
    optimizer = optim.AdamW(learning_rate=lr, weight_decay=0.01)

    def objective(model, batch):
        parts = losses(model, batch)
        return parts["trunk"] + mtp_weight * parts["head"] + balance_weight * parts["balance"], parts

    probe = heldout_batch(data["heldout"], tokenizer, 8, length)

    def measure(step):
        if not ((step + 1) % eval_every == 0 or step + 1 == steps):
            return {}
        held = losses(model, probe, balance=False)
        return {"heldout_trunk": float(held["trunk"]), "heldout_head": float(held["head"])}

    progress = optimise(out, model, optimizer, objective, Batches(data["train"], batch, length, seed), steps, lr,
                        max(1, min(100, steps // 10)), save_every, stop_after, "training", measure,
                        lambda r: {"trunk": f"{r['trunk']:.3f}", "head": f"{r['head']:.3f}", "bal": f"{r['balance']:.2f}"})
    (out / "loss_curve.json").write_text(json.dumps(progress["history"]))
    model.tokenizer = tokenizer
    return model, progress["step"] >= steps


# ---- the chat fine-tune: the trained model taught its family's chat format -------------------------------
CHAT_TRAINING_FILE = "chat_training.json"  # the record `qmtp.tiny.card` renders, written beside the model
CHAT_CURVE_FILE = "chat_loss_curve.json"
CHAT_HEAD_CURVE_FILE = "chat_head_loss_curve.json"  # the head-only stage after the chat fine-tune
FIRST_HEAD_RECORDS = ("head_training.json", "head_loss_curve.json")  # the first head-only stage's, kept through


def chat_probes(model: Model, tokenizer, seed: int, length: int) -> dict[str, tuple[mx.array, mx.array | None]]:
    """Fixed held-out batches for the fine-tune's curve, (tokens, weights): plain text (the corpus's held-out
    split, every token, as the first training's probe) and templated conversations of the held-out stream
    (their replies, as trained)."""
    plain = []
    for doc in _heldout_plain(seed):
        plain.extend(tokenizer.encode(doc) + [tokenizer.eos_id])
        if len(plain) >= 8 * (length + 1):
            break
    chats, weights = chat_stream(tokenizer, seed, 0, 200, "heldout")
    rows = lambda ids: mx.array(np.array(ids[: 8 * (length + 1)], dtype=np.int32).reshape(8, length + 1))
    return {"plain": (rows(plain), None), "chat": (rows(chats), rows(weights).astype(mx.float32))}


def _heldout_plain(seed: int) -> list[str]:
    from . import corpus

    return [text for _, text in corpus.unseen_heldout(seed)]


def train_chat(out: Path, source: Path, steps: int, batch: int, length: int, lr: float, seed: int, mtp_weight: float,
               balance_weight: float, save_every: int, eval_every: int, n_train: int, n_chat: int,
               stop_after: int | None = None, start: str = "own") -> tuple[Model, bool]:
    """Fine-tune (or resume) the model in `source`, trunk and head, on its corpus mixed with templated
    conversations, its vocabulary grown by the chat tokens; the objective is the first training's. `start`
    "previous" starts the head from the one `source` keeps from before its chained training: then this stage
    repeats the first training's single-step objective on a head that never learned chaining, and a head-only
    stage after it measures again what chaining adds (chapter 5)."""
    from .chat_format import grow_vocabulary

    out.mkdir(parents=True, exist_ok=True)
    run = {"stage": "chat", "source": str(source), "start_head": start, "steps": steps, "batch": batch, "length": length, "lr": lr,
           "seed": seed, "mtp_weight": mtp_weight, "balance_weight": balance_weight, "n_train": n_train,
           "n_chat": n_chat, "cores": os.cpu_count()}
    (out / "run.json").write_text(json.dumps(run, indent=2) + "\n")
    data = prepare_chat_data(out, source, seed, n_train, n_chat)
    tokenizer = data["tokenizer"]
    mx.random.seed(seed)
    model = load_start(source, start)
    grow_vocabulary(model, tokenizer.vocab_size, seed)
    model.tokenizer = tokenizer
    optimizer = optim.AdamW(learning_rate=lr, weight_decay=0.01)

    def objective(model, batch):
        parts = losses(model, batch[0], weights=batch[1].astype(mx.float32))
        return parts["trunk"] + mtp_weight * parts["head"] + balance_weight * parts["balance"], parts

    probes = chat_probes(model, tokenizer, seed, length)

    def probe_losses() -> dict:
        found = {}
        for name, (rows, weights) in probes.items():
            held = losses(model, rows, balance=False, weights=weights)
            found[f"{name}_trunk"], found[f"{name}_head"] = float(held["trunk"]), float(held["head"])
        return found

    before = out / "before.json"  # the probes on the grown model before any step: the fine-tune's starting point
    if not before.exists():
        before.write_text(json.dumps(probe_losses(), indent=2) + "\n")

    def measure(step):
        if not ((step + 1) % eval_every == 0 or step + 1 == steps):
            return {}
        return probe_losses()

    batches = WeightedBatches(data["train"], data["weights"], batch, length, seed)
    progress = optimise(out, model, optimizer, objective, batches, steps, lr,
                        max(1, min(50, steps // 10)), save_every, stop_after, "chat fine-tune", measure,
                        lambda r: {"trunk": f"{r['trunk']:.3f}", "head": f"{r['head']:.3f}"})
    (out / CHAT_CURVE_FILE).write_text(json.dumps(progress["history"]))
    return model, progress["step"] >= steps


def export_chat_stage(model: Model, source: Path, dest: Path, out: Path) -> None:
    """The fine-tuned model in the released layout with its chat tokenizer, template and generation config, the
    source's records of its first training (loss curve, training.json, head stage) and the fine-tune's own."""
    import shutil

    from .export import export_released

    export_released(model, dest, training_dir=out)
    for name in ("loss_curve.json", "training.json", *FIRST_HEAD_RECORDS):
        if (source / name).exists():
            shutil.copy2(source / name, dest / name)
    shutil.copy2(out / CHAT_CURVE_FILE, dest / CHAT_CURVE_FILE)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qmtp.tiny.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="working folder (resumable state, data cache, loss curve)")
    parser.add_argument("--export", type=Path, help="write the trained model here in the released layout")
    parser.add_argument("--quick", action="store_true", help="a smaller copy in about a minute (for tests)")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--lr", type=float, help="peak learning rate (default 3e-3; 1e-3 with --head-only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mtp-weight", type=float, default=0.5)
    parser.add_argument("--balance-weight", type=float, default=0.01)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--documents", type=int, help="training documents to generate")
    parser.add_argument("--stop-after", type=int, help="stop after this many steps (resume later with the same command)")
    parser.add_argument("--head-only", action="store_true", help="train only the MTP head of --from, the trunk frozen")
    parser.add_argument("--from", dest="source", type=Path, help="--head-only: the model to start from (default: bundled)")
    parser.add_argument("--chained", type=int, default=3, help="--head-only: steps on the head's own outputs (0: none)")
    parser.add_argument("--chain-decay", type=float, default=0.8, help="--head-only: weight of chained step j is decay^(j-1)")
    parser.add_argument("--targets", default="trunk", help="--head-only: 'trunk' (its distributions) or 'text' (tokens)")
    parser.add_argument("--chat", action="store_true", help="fine-tune --from (default: bundled) on its corpus mixed "
                        "with templated conversations, its tokenizer given the chat tokens; with --head-only: mix the "
                        "conversations into the head's data")
    parser.add_argument("--conversations", type=int, help="--chat: conversations to generate (default: as many as documents)")
    parser.add_argument("--start-head", default="own", help="--head-only, --chat: 'own' (--from's head) or 'previous' (the "
                        "head --from keeps from before its last head-only stage: reruns that stage)")
    args = parser.parse_args(argv)
    if args.head_only:
        return main_head_only(args)
    if args.chat:
        return main_chat(args)
    if args.quick:
        steps, n_train, n_heldout, vocab = args.steps or 40, args.documents or 3000, 300, min(args.vocab_size, 512)
    else:
        steps, n_train, n_heldout, vocab = args.steps or 900, args.documents or 100_000, 2000, args.vocab_size
    model, finished = train(args.out, steps, args.batch, args.length, args.lr or 3e-3, args.seed, args.quick, args.mtp_weight,
                  args.balance_weight, min(args.save_every, steps), min(args.eval_every, steps), n_train, n_heldout, vocab,
                  args.stop_after)
    if not finished:
        print(f"stopped before step {steps}: run the same command again to resume")
    elif args.export:
        from .export import export_released

        export_released(model, args.export, training_dir=args.out)
        print(f"exported to {args.export}")
    return 0


def main_head_only(args) -> int:
    from ..loading import BUNDLED_MODEL, resolve_path

    source = resolve_path(args.source or BUNDLED_MODEL)
    steps = args.steps or 600
    lr = args.lr or 1e-3  # a fine-tune of a trained head starts lower than training from scratch
    try:
        model, finished = train_head(args.out, source, steps, args.batch, args.length, lr, args.seed, args.chained,
                                     args.chain_decay, args.targets, args.balance_weight, min(args.save_every, steps),
                                     min(args.eval_every, steps), args.documents or 100_000, args.stop_after,
                                     args.start_head, chat_count(args))
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not finished:
        print(f"stopped before step {steps}: run the same command again to resume")
    elif args.export:
        export_head_stage(model, source, args.export, args.out, args.start_head, chat=args.chat)
        print(f"exported to {args.export}")
    return 0


def chat_count(args) -> int:
    if not args.chat:
        return 0
    return args.conversations if args.conversations is not None else args.documents or CHAT_DOCUMENTS


CHAT_DOCUMENTS = 20_000  # a fifth of the first training's documents: the fine-tune sees a small part of each


def main_chat(args) -> int:
    from ..loading import BUNDLED_MODEL, resolve_path

    source = resolve_path(args.source or BUNDLED_MODEL)
    steps = args.steps or 200
    lr = args.lr or 1e-3  # a fine-tune: a third of the first training's peak
    try:
        model, finished = train_chat(args.out, source, steps, args.batch, args.length, lr, args.seed, args.mtp_weight,
                                     args.balance_weight, min(args.save_every, steps), min(args.eval_every, steps),
                                     args.documents or CHAT_DOCUMENTS, chat_count(args), args.stop_after,
                                     args.start_head)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not finished:
        print(f"stopped before step {steps}: run the same command again to resume")
    elif args.export:
        export_chat_stage(model, source, args.export, args.out)
        print(f"exported to {args.export}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
