"""What each chapter does on the full-size checkpoint, what that holds in memory and on disk, and how long it
is predicted to take: the budget that lets the whole book run on the real weights in bounded time and memory.

On the bundled model (or any smaller one) nothing here changes what a chapter does: `active(config)` is false and
every chapter runs as written. When `QMTP_MODEL` points at the full-size release (the bf16 weights, Qwen3.6-35B-A3B's
widths: `is_real_model`), the chapters that would hold or rewrite the whole model many times work on less:

* chapter 2 loads each of its variants with only the first `LAYERS` trunk layers (`qmtp.load(path, layers=...)`,
  no head), and measures them on fewer texts and shorter continuations;
* chapter 3 converts the whole model once, to `BITS` bits with the head in bf16, into `conversion(path)`, where
  chapters 4 to 6 find it, and checks the conversion on the first `LAYERS` layers;
* chapter 4 quantizes the first `LAYERS` layers in memory at each trunk width instead of converting the whole model
  once per width, and rounds the head of that one conversion in memory at each head width;
* chapters 5 and 6 decode with that conversion, on one prompt, fewer tokens and fewer widths;
* chapter 10 converses with that conversion over fewer questions and shorter replies (`CONVERSATIONS`).

Sizes come from `qmtp.sizes` (what a tensor weighs stored, and in memory: on the CPU qmtp computes in float32, so an
unquantized weight takes 4 bytes there). Times are predictions, from what chapter 6 measured on this machine at the
real widths (`pass_seconds`) and the sizes; reading the weights from disk is priced at `DISK_GB_PER_S`, an
assumption, not a measurement.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..config import QWEN36_35B_A3B, ModelConfig
from ..sizes import UNQUANTIZED, sizes

LAYERS = 4
"""Trunk layers chapters 2, 3 and 4 load at full size: one period of the pattern (three DeltaNet, one attention)."""
BITS = 4
"""The width of the one full-size conversion chapter 3 writes and chapters 4 to 6 decode with (head in bf16)."""
DISK_GB_PER_S = 1.0
"""Assumed rate of reading weights from disk (a local SSD); not measured in the build."""
MACHINES_GB = (64, 128)
"""The machines the budget is sized for, in GB of memory."""
RUNTIME_GB = 4.5
"""Python, MLX, the activations and the transient copies of the largest tensors (read in bf16, cast to float32,
rounded), on top of the weights: chapters 2 to 4's budgeted calls on the full-size synthetic checkpoint peaked at
20.3 GiB RSS for 16.3 GiB of weights (tests/test_full_size.py, 2026-12-04), plus 0.5 GiB of margin."""

# What each budgeted chapter runs at full size.
FIXES_TEXTS, FIXES_TOKENS, FIXES_LOADS = 1, 8, 14  # 4 fix variants, 3 norm shifts, 6 conv mistakes, 1 histogram
TEXT_TOKENS = 64  # positions per held-out text at full size (evaluate.text_metrics; 128 on the bundled model)
QUANT_TRUNK_WIDTHS, QUANT_HEAD_WIDTHS = (8, 6, 4, 3, 2), (None, 8, 6, 4, 3)
DECODE = {"prompts": 1, "max_tokens": 16, "n_drafts": (2, 3), "ablations": ("complete head, bf16",
                                                                           "no routed experts",
                                                                           "head weights 4-bit",
                                                                           "pre-norm hidden state")}
# chapter 5's chat section: conversations, the samplers of evaluate.CHAT_SAMPLERS it runs, each thinking on and off
CHAT = {"conversations": 1, "samplers": ("greedy", "thinking"), "n_draft": 3}
BENCH = {"max_tokens": 8, "repeats": 1, "n_drafts": (1, 2, 3, 4, 5), "pass_budget_s": 2.0}  # chapter 6
ENGINE = {"max_tokens": 8, "repeats": 1, "n_drafts": (1, 2, 3, 4), "ablate": (1, 4)}  # chapter 7
# chapter 10 (its setup cell sets the same at full size): questions, reply tokens, timed repeats (after one untimed),
# template modes, drafts per pass
CONVERSATIONS = {"questions": 3, "max_tokens": 12, "repeats": 1, "modes": 3, "n_draft": 3}


def active(config: ModelConfig) -> bool:
    """Whether the budget applies: the model has the full-size release's widths."""
    return is_real_model(config)


def is_real_model(config) -> bool:
    """Whether `config` is Qwen3.6-35B-A3B's (the widths that decide its numbers), not a smaller stand-in."""
    fields = ("hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "vocab_size")
    return all(getattr(config, f) == getattr(QWEN36_35B_A3B, f) for f in fields)


def first_layers(config: ModelConfig, layers: int = LAYERS) -> ModelConfig:
    """The config of the first `layers` trunk layers (what `qmtp.load(path, layers=layers)` holds)."""
    return dataclasses.replace(config, num_hidden_layers=layers, layer_types=list(config.layer_types[:layers]))


def conversion(path) -> Path:
    """Where chapter 3 writes the full-size conversion and chapters 4 to 6 read it: beside the book's results for
    this model (`qmtp.book.results`), so that it is made once per model and found again."""
    from . import results

    return results.folder(path) / f"q{BITS}"


def decoding_model(path) -> Path:
    """The model chapters 4 to 6 decode with: the conversion at full size (made by chapter 3), else `path`."""
    from ..config import ModelConfig as Config

    config = Config.from_file(path)
    if not active(config):
        return Path(path)
    converted = conversion(path)
    if not (converted / "config.json").is_file():
        from ..convert import convert

        convert(path, converted, bits=BITS, progress=False)
    return converted


# ---- sizes --------------------------------------------------------------------------------------------------------
def stored_bytes(config: ModelConfig = QWEN36_35B_A3B, bits: int = UNQUANTIZED) -> int:
    """Bytes on disk: the bf16 release (`bits=UNQUANTIZED`) or a conversion at `bits`, head in bf16."""
    return sizes(config, bits=bits).total_bytes


def memory_bytes(config: ModelConfig = QWEN36_35B_A3B, bits: int = UNQUANTIZED, head: bool = True,
                 dtype_bytes: int = 4) -> int:
    """Bytes of the weights once loaded: quantized codes as stored, their scales, biases and every unquantized
    weight at `dtype_bytes` (4: float32, what qmtp computes in on the CPU; 2: the bfloat16 it falls back to when
    float32 does not fit)."""
    report = sizes(config, bits=bits, dtype_bytes=dtype_bytes)
    return report.total_bytes if head else report.trunk_bytes


def fits(loaded: int, machine_gb: int, runtime: bool = True) -> bool:
    """Whether `loaded` bytes of weights (and `RUNTIME_GB` with `runtime`) fit a machine of `machine_gb` GiB."""
    return loaded + (RUNTIME_GB * 2**30 if runtime else 0) <= machine_gb * 2**30


def fitting(loaded: int, machines=MACHINES_GB, runtime: bool = True) -> list[int]:
    """The machines (GiB) among `machines` that hold `loaded` bytes, smallest first."""
    return sorted(m for m in machines if fits(loaded, m, runtime))


def machines_phrase(machines: list[int]) -> str:
    """`fitting`'s answer as the prose says it: "a 128 GB machine", "a 64 GB or a 128 GB machine", "neither machine"."""
    if not machines:
        return "neither machine"
    return " or a ".join(f"{m} GB" for m in machines).join(("a ", " machine"))


def widths_table(config: ModelConfig = QWEN36_35B_A3B) -> list[dict]:
    """The full-size model at each width: GB on disk, GiB loaded (float32, and bfloat16 as qmtp falls back to), and
    how each machine of `MACHINES_GB` holds it."""
    rows = []
    for bits in (UNQUANTIZED, 8, 6, 4):
        f32, bf16 = memory_bytes(config, bits), memory_bytes(config, bits, dtype_bytes=2)
        row = {"weights": "bf16 (release)" if bits == UNQUANTIZED else f"{bits}-bit trunk, bf16 head",
               "disk GB": stored_bytes(config, bits) / 1e9, "loaded GiB, float32": f32 / 2**30,
               "loaded GiB, bf16": bf16 / 2**30}
        for machine in MACHINES_GB:
            row[f"{machine} GB machine"] = ("float32" if fits(f32, machine) else
                                            "bf16 only" if fits(bf16, machine) else "does not fit")
        rows.append(row)
    return rows


# ---- time ---------------------------------------------------------------------------------------------------------
def pass_seconds(real_width: dict, config: ModelConfig = QWEN36_35B_A3B) -> dict:
    """Predicted seconds, on the machine chapter 6 measured, of one plain pass of the first `LAYERS` layers and of
    the whole model at `BITS` bits, and of one head draft (measured).

    `real_width` is what chapter 6 saved of its real-width passes (`bench.real_width_passes`: a model of the first
    layers at the release's widths, seconds and bytes per pass). This machine's quantized kernels run at a rate of
    weight bytes that does not depend on the layer, so the whole model's pass is priced at the measured pass's
    seconds per byte, times the bytes the whole model's pass reads (`throughput.trunk_pass_bytes`)."""
    from . import throughput

    plain = next(r for r in real_width["rows"] if r["pass"] == "plain, 1 token")
    head = next(r for r in real_width["rows"] if r["pass"] == "head draft")
    per_byte = plain["seconds"] / plain["bytes"]

    def pass_bytes(c: ModelConfig) -> float:
        return throughput.total(throughput.trunk_pass_bytes(c, sizes(c, bits=BITS, dtype_bytes=4), 1, 0, None, 4))

    return {"first_layers": per_byte * pass_bytes(first_layers(config)), "full": per_byte * pass_bytes(config),
            "head_draft": head["seconds"], "measured_layers": real_width["layers"]}


def chapters(seconds: dict, config: ModelConfig = QWEN36_35B_A3B) -> list[dict]:
    """Each chapter at full size under the budget: what it does, its peak memory (the weights it holds at once and
    `RUNTIME_GB`, GiB), what it writes to disk (GB) and its predicted minutes on the machine `seconds` (from
    `pass_seconds`) was measured on.

    A pass over n positions is priced as n plain passes: on a CPU whose quantized kernels are compute-bound (chapter 6)
    that is what it costs. Reading weights is priced at `DISK_GB_PER_S`. A generated token is priced at one pass and
    one head draft, its prompt's prefill not at all: chapter 10's fresh runs prefill whole histories, so its minutes
    are a floor. Chapters 9 and 11 run on the bundled model whatever `QMTP_MODEL` says."""
    from .bench import PASS_BUDGET_S
    part = first_layers(config)
    part_gib = memory_bytes(part, UNQUANTIZED, head=False) / 2**30
    part_read = sizes(part, bits=UNQUANTIZED).trunk_bytes / 1e9
    full_gib = memory_bytes(config, BITS) / 2**30
    release = stored_bytes(config) / 1e9
    converted = stored_bytes(config, BITS) / 1e9
    layer_pass, full_pass, draft = seconds["first_layers"], seconds["full"], seconds["head_draft"]

    def minutes(read_gb: float, passes: float) -> float:
        return (read_gb / DISK_GB_PER_S + passes) / 60

    def interleaved(n_drafts, budget_s: float) -> float:
        # bench.interleaved_pass_costs: one verify pass and the drafts of each width per round, at least one warm-up
        # call and three timed rounds, and about one and a half budgets of calls where rounds are short
        one_round = sum(n * full_pass + (n - 1) * draft for n in n_drafts)
        return max(4 * one_round, 1.5 * budget_s)

    fixes_positions = FIXES_LOADS * (FIXES_TEXTS * TEXT_TOKENS + FIXES_TOKENS)
    decode_tokens = DECODE["prompts"] * DECODE["max_tokens"]
    # chapter 5: the worked example, the lossless check (plain and each width), acceptance per width, ablations;
    # a step at n_draft n costs one pass and n - 1 head drafts, and yields up to n tokens (priced at one per step)
    from ..tiny.corpus import REGISTERS

    from .evaluate import ENGINE_CHOICES

    # ... and the engines' choices and two sampling temperatures, each at n_draft 2 and 3, and the chat section
    n_runs = (2 + 2 * len(DECODE["n_drafts"]) + len(REGISTERS) + len(DECODE["ablations"])
              + 2 * len(ENGINE_CHOICES) + 2 * 2 + CHAT["conversations"] * len(CHAT["samplers"]) * 2)
    ch5_seconds = n_runs * decode_tokens * (full_pass + draft)
    # chapter 6: each width decoded, then its passes timed by the benchmark and again at the real widths (plain and
    # verify over 2 and 3 tokens, `BENCH["pass_budget_s"]` of calls per width)
    bench_runs = len(BENCH["n_drafts"]) * BENCH["repeats"]
    timing = interleaved(BENCH["n_drafts"], PASS_BUDGET_S) + interleaved((1, 2, 3), 3 * BENCH["pass_budget_s"])
    ch6_seconds = bench_runs * BENCH["max_tokens"] * (full_pass + draft) + timing
    # chapter 7: each width, auto, and the loop ablations (eager and not queued ahead, at each of ENGINE["ablate"])
    engine_runs = (len(ENGINE["n_drafts"]) + 1 + 2 * len(ENGINE["ablate"])) * ENGINE["repeats"]
    ch7_seconds = engine_runs * ENGINE["max_tokens"] * (full_pass + draft)
    # chapter 10: a reply, a sampled reply, a conversation's two turns, then every mode's conversation, each turn
    # beside a fresh run of the same history, after one untimed repeat
    talk = CONVERSATIONS
    conversation_runs = 4 + talk["modes"] * (talk["repeats"] + 1) * talk["questions"] * 2
    ch10_seconds = conversation_runs * talk["max_tokens"] * (full_pass + draft)
    rows = [
        {"chapter": "1. Anatomy", "at full size": "reads the headers only", "memory GiB": 0.0, "disk GB": 0.0,
         "minutes": 0.0},
        {"chapter": "2. Fixes", "at full size": f"{FIXES_LOADS} loads of the first {LAYERS} layers (no head), "
                                                f"{FIXES_TEXTS} text{'s' * (FIXES_TEXTS != 1)} and "
                                                f"{FIXES_TOKENS}-token continuations each",
         "memory GiB": part_gib, "disk GB": 0.0,
         "minutes": minutes(FIXES_LOADS * part_read, fixes_positions * layer_pass)},
        {"chapter": "3. Converting", "at full size": f"one {BITS}-bit conversion (head bf16), kept for chapters 4-6; "
                                                     f"checked on the first {LAYERS} layers; mlx-lm not loaded",
         "memory GiB": part_gib + memory_bytes(part, BITS, head=False) / 2**30, "disk GB": converted,
         "minutes": minutes(release + converted + 2 * part_read, FIXES_TEXTS * TEXT_TOKENS * layer_pass * 2)},
        {"chapter": "4. Quantizing", "at full size": f"trunk widths {QUANT_TRUNK_WIDTHS} on the first {LAYERS} "
                                                     f"layers in memory; head widths rounded in memory on the "
                                                     f"{BITS}-bit model",
         "memory GiB": max(part_gib, full_gib), "disk GB": 0.0,
         "minutes": minutes(len(QUANT_TRUNK_WIDTHS) * part_read + converted,
                            len(QUANT_TRUNK_WIDTHS) * FIXES_TEXTS * TEXT_TOKENS * layer_pass
                            + len(QUANT_HEAD_WIDTHS) * decode_tokens * (full_pass + draft))},
        {"chapter": "5. MTP decoding", "at full size": f"the {BITS}-bit model, {DECODE['prompts']} prompt, "
                                                       f"{DECODE['max_tokens']} tokens, n_draft "
                                                       f"{', '.join(map(str, DECODE['n_drafts']))}, "
                                                       f"{len(DECODE['ablations']) - 1} ablations",
         "memory GiB": full_gib, "disk GB": 0.0, "minutes": minutes(converted, ch5_seconds)},
        {"chapter": "6. Does MTP pay?", "at full size": f"the {BITS}-bit model, {BENCH['max_tokens']} tokens, "
                                                       f"n_draft {BENCH['n_drafts'][0]}-{BENCH['n_drafts'][-1]}, "
                                                       f"one repeat; its own passes timed",
         "memory GiB": full_gib, "disk GB": 0.0, "minutes": minutes(converted, ch6_seconds)},
        {"chapter": "7. The engine", "at full size": f"the {BITS}-bit model, {ENGINE['max_tokens']} tokens, "
                                                     f"n_draft {ENGINE['n_drafts'][0]}-{ENGINE['n_drafts'][-1]} "
                                                     f"and auto, the loop's ablations, one repeat; mlx-lm and "
                                                     f"mlx-vlm not loaded",
         "memory GiB": full_gib, "disk GB": 0.0, "minutes": minutes(converted, ch7_seconds)},
        {"chapter": "8. Claims", "at full size": "reads what chapters 1-7 saved", "memory GiB": 0.0, "disk GB": 0.0,
         "minutes": 0.0},
        {"chapter": "9. Beyond", "at full size": "runs on the bundled model, as written", "memory GiB": 0.0,
         "disk GB": 0.0, "minutes": 0.0},
        {"chapter": "10. Conversations", "at full size": f"the {BITS}-bit model, {talk['questions']} questions, "
                                                         f"{talk['max_tokens']}-token replies at n_draft "
                                                         f"{talk['n_draft']}, {talk['modes']} template modes, one "
                                                         f"timed repeat",
         "memory GiB": full_gib, "disk GB": 0.0, "minutes": minutes(converted, ch10_seconds)},
        {"chapter": "11. Under load", "at full size": "runs on the bundled model, as written; reads the real-width "
                                                      "passes measured outside the build",
         "memory GiB": 0.0, "disk GB": 0.0, "minutes": 0.0},
    ]
    for row in rows:  # the weights held at once, and the runtime around them
        row["memory GiB"] += RUNTIME_GB if row["memory GiB"] else 0.0
    return rows


# ---- what each chapter says about its budget ----------------------------------------------------------------------
def _plans() -> dict[str, str]:
    return {
        "02_fixes": f"each variant is loaded with only the first {LAYERS} trunk layers and no head "
                    f"(`qmtp.load(path, layers={LAYERS}, head=False)`), measured on {FIXES_TEXTS} held-out "
                    f"text{'s' * (FIXES_TEXTS != 1)} in "
                    f"windows of {TEXT_TOKENS} tokens with {FIXES_TOKENS}-token continuations, instead of the whole "
                    f"model {FIXES_LOADS} times",
        "03_converting": f"the whole model is converted once, to {BITS} bits with the head in bf16, into a folder kept "
                         f"for chapters 4 to 6; the check against the source compares their first {LAYERS} layers; "
                         f"mlx-lm is not loaded (it would hold a second whole model)",
        "04_quantizing": f"each trunk width is measured on the first {LAYERS} layers rounded in memory, instead of "
                         f"converting the whole model once per width; each head width rounds the head of chapter "
                         f"3's {BITS}-bit conversion in memory; the simulated fault is shown by the backend check only",
        "05_mtp_decoding": f"chapter 3's {BITS}-bit conversion decodes {DECODE['prompts']} prompt for "
                           f"{DECODE['max_tokens']} tokens at n_draft {', '.join(map(str, DECODE['n_drafts']))}, "
                           f"with {len(DECODE['ablations']) - 1} ablations",
        "06_throughput": f"chapter 3's {BITS}-bit conversion is benchmarked over {BENCH['max_tokens']} tokens at "
                         f"n_draft {BENCH['n_drafts'][0]} to {BENCH['n_drafts'][-1]}, once each; its own passes are "
                         f"timed in place of the real-width stand-in",
        "07_engine": f"chapter 3's {BITS}-bit conversion runs the loop's variants over {ENGINE['max_tokens']} tokens, "
                     f"once each; mlx-lm and mlx-vlm are not loaded (each would hold a second whole model), nor is "
                     f"the real-width stand-in",
    }


def statement(chapter: str, config: ModelConfig) -> str:
    """The chapter's budget in one sentence of Markdown, and whether it applies to the model this build uses."""
    where = ("it applies to this model, which has the release's widths" if active(config) else
             "it does not apply to this model, so everything below runs as written")
    return f"With `QMTP_MODEL` at the full-size release, {_plans()[chapter]}: {where}."


def plan(chapter: str) -> str:
    """What the chapter does at full size, as one sentence of Markdown (whether it applies is said once, on the
    real-checkpoint page)."""
    text = _plans()[chapter]
    return text[0].upper() + text[1:] + "."


def whole_book_sentence(plan: list[dict], machine_gib: float | None) -> str:
    """The whole book's predicted minutes on a machine of `machine_gib` GiB, only where that machine holds the
    budget's peak (`chapters`' largest "memory GiB"); otherwise why no time is given."""
    peak = max(r["memory GiB"] for r in plan)
    if machine_gib is None:
        return "its memory could not be read, so no whole-book time is given."
    if machine_gib < peak:
        return (f"it has {machine_gib:.0f} GiB of memory and the budget peaks at {peak:.1f} GiB, so it cannot run "
                f"the book at full size and no whole-book time is given for it (the table's minutes price each "
                f"chapter's passes at its measured speed as if it had the memory).")
    return f"{sum(r['minutes'] for r in plan):.0f} minutes for the whole book."


# ---- the full-size conversion, measured outside the build ---------------------------------------------------------
CONVERT_RESULT = Path(__file__).resolve().parents[2] / "book" / "measured" / "bench_convert_full.json"
"""`bench_convert.run(preset="qwen3.6-35b-a3b", tools=("cp", "qmtp"))`'s report, with `where` and `when` added:
the full-size conversion takes minutes, so it runs outside the build and the page reads what it saved."""
ASSUMED_DISK_GB_PER_S = {"an NVMe SSD": 3.0, "a SATA SSD": 0.5}
"""Sequential read rates assumed (not measured) to bound a reader's conversion from below."""


def saved_conversion(path: Path = CONVERT_RESULT) -> dict | None:
    """The saved full-size conversion report, or None where none was saved."""
    import json

    return json.loads(path.read_text()) if path.is_file() else None


def conversion_sentence(report: dict | None, config: ModelConfig = QWEN36_35B_A3B) -> str:
    """What the page says of a full-size conversion's time: the measured one, where and when, and a floor for a
    reader's disk (reading the release and writing the conversion at an assumed rate each; the CPU's share of
    the measured time does not carry to another machine, so no more is predicted)."""
    release, converted = stored_bytes(config) / 1e9, stored_bytes(config, BITS) / 1e9
    floors = "; ".join(f"on {disk} (assumed {rate:g} GB/s) at least {(release + converted) / rate / 60:.0f} min"
                       for disk, rate in ASSUMED_DISK_GB_PER_S.items())
    floor = (f"A reader's conversion moves at least {release:.0f} GB in and {converted:.0f} GB out: {floors}; "
             f"what the CPU adds on top is not predicted here from one machine's measurement.")
    if report is None:
        return f"No full-size conversion was measured for this build (`python -m qmtp bench convert --preset ...`). {floor}"
    qmtp_run, cp_run = report["tools"]["qmtp"], report["tools"]["cp"]
    return (f"Measured outside the build ({report['where']}, {report['when']}), `qmtp convert` turned the full-size "
            f"sparse synthetic checkpoint ({report['source_bytes'] / 1e9:.0f} GB apparent) into a {report['bits']}-bit "
            f"one in {qmtp_run['seconds'] / 60:.1f} min, peak {qmtp_run['peak_rss_bytes'] / 2**30:.1f} GiB "
            f"(`cp` of the same source: {cp_run['seconds']:.0f} s, holes skipped; the experts are holes, read as zeros from no disk, so the source cost no disk reads). {floor}")
