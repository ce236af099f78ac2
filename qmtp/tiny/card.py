"""The bundled model's card: measured, then written from the measurements.

    python -m qmtp.tiny.card MODEL_DIR [--train-dir runs/tiny]

measures the model in MODEL_DIR (held-out accuracy and perplexity with each fix and without, per register;
the head's accuracy; greedy acceptance for n_draft 2 to 5; continuations of a few prompts; with a chat template,
acceptance per draft position under it with the recommended samplers, thinking on and off, and a few replies), writes
`measurements.json` and renders `MODEL_CARD.md` and `loss_curve.png` from it. The card holds no number that
this module did not compute; a test re-renders it and compares.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from ..checkpoint import Checkpoint
from ..config import ModelConfig
from ..loading import load
from . import evaluate
from . import corpus
from .train import TOKENIZER_SAMPLE_BYTES

PROMPTS = (
    "Once upon a time, a little fox named",
    "Anna: Where is the",
    "Shopping list:\n1.",
    "7 + 5 =",
    "A cat is an animal.",
)
FIX_VARIANTS = {"both fixes": ("norm", "conv"), "norm fix left out": ("conv",), "conv fix left out": ("norm",)}
TRAINING_COMMAND = "python -m qmtp.tiny.train runs/tiny --steps {steps} --batch {batch} --length {length} --export runs/tiny/export"
HEAD_TRAINING_COMMAND = ("python -m qmtp.tiny.train runs/tiny-head --head-only --start-head previous --chained {chained} "
                         "--chain-decay {chain_decay} --targets {targets} --steps {steps} --batch {batch} --length {length} "
                         "--lr {lr} --export runs/tiny-head/export")
HEAD_TRAINING_FILE = "head_training.json"
CHAT_COMMAND = ("python -m qmtp.tiny.train runs/tiny-chat --chat --from {source} --start-head {start_head} "
                "--steps {steps} --documents {n_train} "
                "--batch {batch} --length {length} --lr {lr} --export runs/tiny-chat/export")
CHAT_HEAD_COMMAND = ("python -m qmtp.tiny.train runs/tiny-chat-head --head-only --chat --from runs/tiny-chat/export "
                     "--chained {chained} --steps {steps} --documents {n_train} --batch {batch} --length {length} "
                     "--lr {lr} --export runs/tiny-chat-head/export")
CHAT_TRAINING_FILE = "chat_training.json"  # = qmtp.tiny.train.CHAT_TRAINING_FILE
CHAT_HEAD_TRAINING_FILE = "chat_head_training.json"
CHAT_CONVERSATIONS = 12  # held-out conversations the card's chat acceptance is measured on
CHAT_REPLY_LIMIT = 300  # tokens: a story reply is up to about 200
CHAT_REPLIES = (  # (system, user) of the replies the card shows, greedy, thinking on and off
    (None, "Where is the red ball?"),
    ("Be brief.", "What is 7 + 5?"),
    (None, "Tell me a story."),
)


def measure(model_dir: Path, per_register: int = 40, prompts_per_register: int = 6, max_tokens: int = 48) -> dict:
    """Everything the card reports, computed on `model_dir`."""
    started = time.time()
    texts = evaluate.heldout_by_register(per_register)
    out: dict = {"per_register_documents": per_register, "fixes": {}, "registers": {}}
    for label, fixes in FIX_VARIANTS.items():
        model = load(model_dir, fixes=fixes)
        try:
            pooled = evaluate.text_metrics(model, [t for docs in texts.values() for t in docs])
            out["fixes"][label] = {"fixes": list(fixes), **pooled.as_dict()}
        except ValueError as err:  # MLX refuses the [C, 1, K] kernel: the loud failure the book shows
            out["fixes"][label] = {"fixes": list(fixes), "error": str(err).splitlines()[0]}

    model = load(model_dir)
    all_prompts = []
    for register, docs in texts.items():
        metrics = evaluate.text_metrics(model, docs).as_dict()
        prompts = evaluate.prompts_from(docs[:prompts_per_register], model)
        metrics["acceptance_n_draft_2"] = evaluate.acceptance(model, prompts, n_draft=2, max_tokens=max_tokens)
        out["registers"][register] = metrics
        all_prompts += prompts
    out["acceptance"] = {
        str(n): evaluate.acceptance(model, all_prompts, n_draft=n, max_tokens=max_tokens) for n in range(2, 6)
    }
    previous = evaluate.previous_head(model)
    if previous is not None:
        out["acceptance_previous_head"] = {
            str(n): evaluate.acceptance(model, all_prompts, n_draft=n, max_tokens=max_tokens, head=previous)
            for n in range(2, 6)
        }
    from ..speculative import generate

    out["continuations"] = [{"prompt": p, "text": generate(model, p, max_tokens=40).text} for p in PROMPTS]
    if model.tokenizer.chat_template is not None:
        conversations = evaluate.chat_prompts(CHAT_CONVERSATIONS)
        out["chat_acceptance"] = evaluate.chat_acceptance(model, conversations, n_draft=4, max_tokens=max_tokens)
        # How greedy replies end: at `<|im_end|>` (the turn's end, as trained), at `<|endoftext|>` (a document's end,
        # which the replies' text also ends with in the corpus; both are end ids in generation_config.json), or cut
        # at the limit
        endings = {}
        for thinking in (True, False):
            counts = {"<|im_end|>": 0, "<|endoftext|>": 0, "length": 0}
            for messages in conversations:
                reply = generate(model, messages=messages, enable_thinking=thinking, max_tokens=CHAT_REPLY_LIMIT)
                counts[model.tokenizer.decode(reply.tokens[-1:]) if reply.finish_reason == "end" else "length"] += 1
            endings["on" if thinking else "off"] = counts
        out["chat_endings"] = endings
        out["chat_replies"] = []
        for system, user in CHAT_REPLIES:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
            for thinking in (True, False):
                reply = generate(model, messages=messages, enable_thinking=thinking, max_tokens=80)
                ended = model.tokenizer.decode(reply.tokens[-1:]) if reply.finish_reason == "end" else "the limit"
                out["chat_replies"].append({"messages": messages, "thinking": thinking, "text": reply.text,
                                            "finish_reason": reply.finish_reason, "ended_by": ended})
    out["seconds"] = round(time.time() - started, 1)
    out["measured_with"] = {"python": platform.python_version(), "machine": platform.machine()}
    return out


def _fmt(x, digits=3):
    return "n/a" if x != x else f"{x:.{digits}f}"


def render(model_dir: Path, measurements: dict, training: dict) -> str:
    """MODEL_CARD.md from the measurements (and the training record), nothing typed by hand."""
    config = ModelConfig.from_file(model_dir)
    ckpt = Checkpoint(model_dir)
    params = sum(i.numel for i in ckpt.infos.values())
    head_params = sum(i.numel for n, i in ckpt.infos.items() if n.startswith("mtp."))
    lines = [
        "# The bundled tiny model",
        "",
        "The architecture of Qwen3.6-35B-A3B at toy widths, trained by `qmtp.tiny.train` on the generated corpus of",
        "`qmtp.tiny.corpus`, shipped in the released layout (multimodal `config.json`, `model.language_model.*` and",
        "`mtp.*` keys, fused experts, zero-centred norms stored as w, conv kernels as [C, 1, K], bfloat16).",
        "Every figure below was measured by `python -m qmtp.tiny.card` and is stored in `measurements.json`.",
        "",
        "## Configuration",
        "",
        "| field | value |",
        "|---|---|",
    ]
    for field in ("hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "shared_expert_intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                  "vocab_size", "mtp_num_hidden_layers"):
        lines.append(f"| {field} | {getattr(config, field)} |")
    lines += [
        f"| layer_types | {', '.join('L' if t == 'linear_attention' else 'F' for t in config.layer_types)} (L linear, F full) |",
        f"| parameters (trunk + head) | {params:,} ({head_params:,} in the head) |",
        f"| file size | {os.path.getsize(model_dir / 'model.safetensors') / 1e6:.1f} MB |",
        "",
        "## Corpus and training",
        "",
        f"Corpus: `qmtp.tiny.corpus.splits(seed={training['seed']}, n_train={training['n_train']}, "
        f"n_heldout={training['n_heldout']})`, registers {', '.join(corpus.REGISTERS)}; held-out documents that also",
        "occur verbatim in training are excluded from every measurement (`qmtp.tiny.corpus.unseen_heldout`).",
        f"Tokenizer: byte-level BPE, {config.vocab_size} tokens, trained on the first "
        f"{TOKENIZER_SAMPLE_BYTES / 1e6:g} MB of the training split.",
        "",
        f"Training: `{TRAINING_COMMAND.format(**training)}` (batch {training['batch']} x "
        f"{training['length']} tokens, {training['tokens']:,} tokens seen, {training['elapsed'] / 60:.0f} minutes on "
        f"{training['cores']} CPU cores). Loss: trunk cross-entropy + {training['mtp_weight']} x head cross-entropy + "
        f"{training['balance_weight']} x balance.",
        f"Final training loss: trunk {training['final']['trunk']:.3f}, head {training['final']['head']:.3f}; held-out "
        f"probe: trunk {training['final'].get('heldout_trunk', float('nan')):.3f}, head {training['final'].get('heldout_head', float('nan')):.3f}.",
        "",
        "![loss curve](loss_curve.png)",
        "",
    ]
    head_file = model_dir / HEAD_TRAINING_FILE
    if head_file.exists():
        head = json.loads(head_file.read_text())
        final = head["final"]
        steps = head["chained"] + 1
        lines += [
            "Then the head alone, trunk frozen, for chained drafting (`qmtp.tiny.train`'s head-only stage): "
            f"`{HEAD_TRAINING_COMMAND.format(**head)}` ({head['tokens']:,} tokens, {head['elapsed'] / 60:.0f} minutes "
            f"on {head['cores']} CPU cores). Loss: {steps} unrolled steps, step 1 on the trunk's states, steps 2 to "
            f"{steps} on the head's own outputs, weighted {head['chain_decay']}^(j-1), each against the "
            f"{'trunk' + chr(39) + 's next-token distribution' if head['targets'] == 'trunk' else 'text' + chr(39) + 's tokens'}"
            f"; + {head['balance_weight']} x the head's balance term. The head it started from is kept in "
            f"`{evaluate.PREVIOUS_HEAD_FILE}` (`qmtp.book.evaluate.previous_head`).",
            "Held-out probe, teacher-forced, head top-1 = trunk top-1 per unrolled step: before "
            + ", ".join(_fmt(head["first"][f"heldout_agree_{j}"]) for j in range(1, 5)) + "; after "
            + ", ".join(_fmt(final[f"heldout_agree_{j}"]) for j in range(1, 5)) + ".",
            "",
        ]
    chat_file = model_dir / CHAT_TRAINING_FILE
    if chat_file.exists():
        chat = json.loads(chat_file.read_text())
        head = json.loads((model_dir / CHAT_HEAD_TRAINING_FILE).read_text())
        before, after = chat["before"], chat["final"]
        lines += [
            "## Chat format",
            "",
            "Then the chat format of the family (`qmtp.tiny.chat_format`): `<|im_start|>` and `<|im_end|>` added as "
            "special tokens, `<think>` and `</think>` as added tokens, at ids "
            f"{chat['vocab_before']} to {config.vocab_size - 1}; the embedding and lm_head grown by one row each (the "
            "mean row plus noise), which the head shares; `chat_template.jinja` in the format of Qwen3.5/3.6; "
            "`generation_config.json` ending at `<|im_end|>` or `<|endoftext|>` with the card's thinking-mode sampler.",
            f"Fine-tune, trunk and head, from the bundled model as committed in {chat['source_commit']}, its head "
            "the one it had before its chained training (so that the head-only stage after this one measures "
            "again what chaining adds): "
            f"`{CHAT_COMMAND.format(**chat)}` ({chat['n_chat']:,} conversations of "
            f"`qmtp.tiny.chat_corpus`, rendered by the template, half with thinking, shuffled with the first "
            f"{chat['n_train']:,} training documents; {chat['tokens']:,} tokens, {chat['elapsed'] / 60:.0f} minutes on "
            f"{chat['cores']} CPU cores; the first training's loss, on every token of a document and on the last "
            "reply of a conversation as the model writes it, `<|im_end|>` included: `qmtp.tiny.train.reply_weights`).",
            "Held-out probe (trunk / head cross-entropy), before the fine-tune (new rows untrained) and after: plain "
            f"text {before['plain_trunk']:.3f} / {before['plain_head']:.3f} -> {after['plain_trunk']:.3f} / "
            f"{after['plain_head']:.3f}; replies in templated conversations {before['chat_trunk']:.3f} / "
            f"{before['chat_head']:.3f} -> {after['chat_trunk']:.3f} / {after['chat_head']:.3f}.",
            f"Then the head alone for chained drafting on the same mix: `{CHAT_HEAD_COMMAND.format(**head)}` "
            f"({head['tokens']:,} tokens, {head['elapsed'] / 60:.0f} minutes); held-out probe, head top-1 = trunk top-1 "
            "per unrolled step: before " + ", ".join(_fmt(head["first"][f"heldout_agree_{j}"]) for j in range(1, 5))
            + "; after " + ", ".join(_fmt(head["final"][f"heldout_agree_{j}"]) for j in range(1, 5)) + ". The head it "
            f"started from (the fine-tune's) is the one kept in `{evaluate.PREVIOUS_HEAD_FILE}`.",
            "",
        ]
        was = chat.get("before_card", {})
        if was.get("acceptance"):
            now = {n: a["rate"] for n, a in measurements["acceptance"].items()}
            changes = [now[n] - was["acceptance"][n] for n in now if n in was["acceptance"]]
            verdict = ("lower at every n_draft" if max(changes) < 0 else "higher at every n_draft" if min(changes) > 0
                       else "lower at some n_draft, not at others")
            lines += [
                "What the chat format cost on plain text, the measurements below against the same measurements of the "
                f"model before it (its card as committed in {chat['source_commit']}): next-token accuracy (both fixes) "
                f"{_fmt(was['accuracy'])} -> {_fmt(measurements['fixes']['both fixes']['accuracy'])}; greedy "
                "acceptance over all registers, n_draft 2 to 5: "
                + ", ".join(f"{_fmt(was['acceptance'][n])} -> {_fmt(now[n])}" for n in now if n in was["acceptance"])
                + f" ({verdict}); at n_draft 2 per register: "
                + ", ".join(f"{r} {_fmt(was['acceptance_n_draft_2'][r])} -> "
                            f"{_fmt(measurements['registers'][r]['acceptance_n_draft_2']['rate'])}"
                            for r in measurements["registers"] if r in was["acceptance_n_draft_2"]) + ".",
                "",
            ]
    lines += [
        "## Held-out text, with and without the fixes",
        "",
        "| load | next-token accuracy | perplexity | head top-1 (t+2) |",
        "|---|---|---|---|",
    ]
    for label, row in measurements["fixes"].items():
        if "error" in row:
            lines.append(f"| {label} | fails: `{row['error']}` | | |")
        else:
            lines.append(f"| {label} | {_fmt(row['accuracy'])} | {_fmt(row['perplexity'], 2)} | {_fmt(row['head_accuracy'])} |")
    lines += [
        "",
        "## Per register (both fixes)",
        "",
        "| register | tokens | accuracy | perplexity | head top-1 (t+2) | head = trunk top-1 | greedy acceptance, n_draft=2 |",
        "|---|---|---|---|---|---|---|",
    ]
    for register, m in measurements["registers"].items():
        lines.append(
            f"| {register} | {m['tokens']} | {_fmt(m['accuracy'])} | {_fmt(m['perplexity'], 2)} | {_fmt(m['head_accuracy'])} | "
            f"{_fmt(m['head_trunk_agreement'])} | {_fmt(m['acceptance_n_draft_2']['rate'])} |"
        )
    def acceptance_table(by_n: dict) -> list[str]:
        rows = ["| n_draft | acceptance per draft position | overall | tokens per trunk pass |", "|---|---|---|---|"]
        for n, a in by_n.items():
            per = ", ".join(_fmt(x, 2) for x in a["per_position"])
            rows.append(f"| {n} | {per} | {_fmt(a['rate'])} | {_fmt(a['tokens_per_trunk_pass'], 2)} |")
        return rows

    lines += ["", "## Acceptance by draft length (greedy, all registers)", ""]
    lines += acceptance_table(measurements["acceptance"])
    if "acceptance_previous_head" in measurements:
        lines += ["", "The same prompts with the head before its chained training (`qmtp.book.evaluate.previous_head`):", ""]
        lines += acceptance_table(measurements["acceptance_previous_head"])
    if "chat_acceptance" in measurements:
        rows = measurements["chat_acceptance"]
        lines += ["", "## Acceptance under the chat template (n_draft=4)", "",
                  f"Replies of up to 48 tokens to {CHAT_CONVERSATIONS} held-out conversations "
                  "(`qmtp.book.evaluate.chat_acceptance`), greedy and with the Qwen3.5/3.6 card's samplers "
                  "(temperature, top-p, top-k, min-p, presence penalty); sampled acceptance is that of rejection "
                  "sampling, so the output is exactly the sampler's.", "",
                  "| sampler | settings | thinking | acceptance per draft position | overall | tokens per trunk pass |",
                  "|---|---|---|---|---|---|"]
        for r in rows:
            settings = ", ".join(f"{k} {v:g}" for k, v in r["settings"].items()) or "temperature 0"
            per = ", ".join(_fmt(x, 2) for x in r["per_position"])
            lines.append(f"| {r['sampler']} | {settings} | {'on' if r['thinking'] else 'off'} | {per} | "
                         f"{_fmt(r['rate'])} | {_fmt(r['tokens_per_trunk_pass'], 2)} |")
    if "chat_endings" in measurements:
        lines += ["", f"How the greedy replies to the same conversations end (up to {CHAT_REPLY_LIMIT} tokens): "
                  + "; ".join(f"thinking {mode}: " + ", ".join(f"`{k}` {v}" for k, v in counts.items())
                              for mode, counts in measurements["chat_endings"].items())
                  + ". Both end ids stop a reply (generation_config.json lists both, as the release's does); "
                  "`<|endoftext|>` is where the corpus's documents, and so the replies' text, end."]
    lines += ["", "## Greedy continuations", ""]
    for c in measurements["continuations"]:
        lines += ["```text", c["prompt"] + c["text"], "```", ""]
    if "chat_replies" in measurements:
        lines += ["## Greedy replies under the chat template", ""]
        for r in measurements["chat_replies"]:
            asked = " / ".join(f"{m['role']}: {m['content']}" for m in r["messages"])
            lines += [f"{asked} (thinking {'on' if r['thinking'] else 'off'}, ended by `{r['ended_by']}`):", "",
                      "```text", r["text"], "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def training_record(train_dir: Path) -> dict:
    """What the training run did, from its own saved arguments and progress."""
    run = json.loads((train_dir / "run.json").read_text())
    latest = json.loads((train_dir / "latest.json").read_text())["state"]
    progress = json.loads((train_dir / latest / "progress.json").read_text())
    history = progress["history"]
    final = dict(history[-1])
    heldout = [r for r in history if "heldout_trunk" in r]
    if heldout:
        final["heldout_trunk"], final["heldout_head"] = heldout[-1]["heldout_trunk"], heldout[-1]["heldout_head"]
    return {
        "cores": os.cpu_count(),  # runs from before run.json recorded the training machine's cores
        **run,
        "steps": progress["step"],
        "tokens": history[-1]["tokens"],
        "elapsed": progress["elapsed"],
        "final": final,
    }


def head_training_record(train_dir: Path) -> dict:
    """What a head-only stage did, from its saved arguments and progress (first and last held-out probe)."""
    run = json.loads((train_dir / "run.json").read_text())
    latest = json.loads((train_dir / "latest.json").read_text())["state"]
    progress = json.loads((train_dir / latest / "progress.json").read_text())
    history = progress["history"]
    probes = [r for r in history if "heldout_agree_1" in r]
    return {**run, "source": Path(run["source"]).name, "steps": progress["step"], "tokens": history[-1]["tokens"],
            "elapsed": progress["elapsed"], "first": probes[0], "final": probes[-1]}


def chat_training_record(train_dir: Path) -> dict:
    """What the chat fine-tune did: its arguments, the vocabulary it grew from, and the held-out probes before
    its first step and at its last."""
    run = json.loads((train_dir / "run.json").read_text())
    latest = json.loads((train_dir / "latest.json").read_text())["state"]
    progress = json.loads((train_dir / latest / "progress.json").read_text())
    history = progress["history"]
    probes = [r for r in history if "chat_trunk" in r]
    source = ModelConfig.from_file(Path(run["source"]))
    import subprocess  # the commit that holds the weights it started from: the card's command names them by it

    commit = subprocess.run(["git", "-C", run["source"], "log", "-1", "--format=%h", "--", "model.safetensors"],
                            capture_output=True, text=True).stdout.strip() or "unknown"
    # What the source's own card measured (the same `measure`, on the model before the fine-tune), for the
    # before/after comparison the card states
    card = Path(run["source"]) / "measurements.json"
    measured = json.loads(card.read_text()) if card.exists() else {}
    before_card = {
        "accuracy": measured.get("fixes", {}).get("both fixes", {}).get("accuracy"),
        "acceptance": {n: a["rate"] for n, a in measured.get("acceptance", {}).items()},
        "acceptance_n_draft_2": {r: m["acceptance_n_draft_2"]["rate"] for r, m in measured.get("registers", {}).items()},
    }
    return {**run, "source": "qmtp/assets/tiny", "source_commit": commit, "vocab_before": source.vocab_size,
            "before_card": before_card,
            "steps": progress["step"],
            "tokens": history[-1]["tokens"], "elapsed": progress["elapsed"],
            "before": json.loads((train_dir / "before.json").read_text()), "final": probes[-1]}


def plot_loss_curve(curve: list[dict], path: Path) -> None:
    from .figures import loss_curve

    figure = loss_curve(curve)
    figure.savefig(path, dpi=110, bbox_inches="tight")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qmtp.tiny.card", description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--train-dir", type=Path, help="the training folder (writes training.json from its record)")
    parser.add_argument("--head-train-dir", type=Path, help=f"a head-only stage's folder (writes {HEAD_TRAINING_FILE})")
    parser.add_argument("--chat-train-dir", type=Path, help=f"the chat fine-tune's folder (writes {CHAT_TRAINING_FILE})")
    parser.add_argument("--chat-head-train-dir", type=Path,
                        help=f"the head-only stage after it (writes {CHAT_HEAD_TRAINING_FILE})")
    args = parser.parse_args(argv)
    if args.chat_train_dir is not None:
        record = chat_training_record(args.chat_train_dir)
        (args.model_dir / CHAT_TRAINING_FILE).write_text(json.dumps(record, indent=2) + "\n")
    if args.chat_head_train_dir is not None:
        record = head_training_record(args.chat_head_train_dir)
        (args.model_dir / CHAT_HEAD_TRAINING_FILE).write_text(json.dumps(record, indent=2) + "\n")
    if args.train_dir is not None:
        record = training_record(args.train_dir)
        (args.model_dir / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    if args.head_train_dir is not None:
        record = head_training_record(args.head_train_dir)
        (args.model_dir / HEAD_TRAINING_FILE).write_text(json.dumps(record, indent=2) + "\n")
    training = json.loads((args.model_dir / "training.json").read_text())
    measurements = measure(args.model_dir)
    (args.model_dir / "measurements.json").write_text(json.dumps(measurements, indent=2) + "\n")
    curve = json.loads((args.model_dir / "loss_curve.json").read_text())
    plot_loss_curve(curve, args.model_dir / "loss_curve.png")
    (args.model_dir / "MODEL_CARD.md").write_text(render(args.model_dir, measurements, training))
    print(f"wrote {args.model_dir / 'MODEL_CARD.md'} ({measurements['seconds']} s of measurement)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
