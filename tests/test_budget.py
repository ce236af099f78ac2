"""The full-size budget (qmtp.book.budget), the machine line (qmtp.book.machine) and the in-memory trunk widths
chapter 4 uses at full size (qmtp.book.quality.round_trunk)."""

import warnings
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import qmtp
from qmtp.book import budget, machine, quality
from qmtp.config import QWEN36_35B_A3B
from qmtp.sizes import UNQUANTIZED

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qmtp.load()


def test_the_budget_applies_to_the_release_only(tiny):
    assert budget.active(QWEN36_35B_A3B) and not budget.active(tiny.config)
    assert "does not apply" in budget.statement("02_fixes", tiny.config)
    assert "applies to this model" in budget.statement("02_fixes", QWEN36_35B_A3B)


def test_first_layers_keeps_the_pattern():
    part = budget.first_layers(QWEN36_35B_A3B)
    assert part.num_hidden_layers == budget.LAYERS == len(part.layer_types)
    assert part.layer_types == ["linear_attention"] * 3 + ["full_attention"]


def test_widths_table_agrees_with_sizes():
    rows = {r["weights"]: r for r in budget.widths_table()}
    release, q4 = rows["bf16 (release)"], rows["4-bit trunk, bf16 head"]
    assert release["disk GB"] == pytest.approx(budget.stored_bytes(QWEN36_35B_A3B, UNQUANTIZED) / 1e9)
    assert release["loaded GiB, float32"] == pytest.approx(2 * release["loaded GiB, bf16"], rel=1e-3)
    assert release["64 GB machine"] == "does not fit" and release["128 GB machine"] == "bf16 only"
    assert q4["64 GB machine"] == "float32"


def test_every_budgeted_chapter_fits_the_smaller_machine():
    seconds = {"first_layers": 0.5, "full": 4.0, "head_draft": 0.5, "measured_layers": 4}
    plan = budget.chapters(seconds)
    assert [r["chapter"].split(".")[0] for r in plan] == [str(n) for n in range(1, 12)]  # every chapter, in order
    smallest = min(budget.MACHINES_GB)
    assert all(budget.fits(r["memory GiB"] * 2**30, smallest, runtime=False) for r in plan)
    assert all(r["minutes"] >= 0 for r in plan) and sum(r["minutes"] for r in plan) > 0


def test_chapter_10s_minutes_follow_its_passes_and_its_settings_are_the_notebooks():
    seconds = {"first_layers": 0.5, "full": 4.0, "head_draft": 0.5, "measured_layers": 4}
    slower = dict(seconds, full=8.0)
    conversations = [next(r for r in budget.chapters(s) if r["chapter"].startswith("10.")) for s in (seconds, slower)]
    assert conversations[1]["minutes"] > conversations[0]["minutes"] > 0
    assert conversations[0]["memory GiB"] > budget.RUNTIME_GB  # it holds the conversion
    # the chapter sets its full-size run itself: the budget must price the same run
    source = (ROOT / "notebooks" / "10_conversations.py").read_text()
    talk = budget.CONVERSATIONS
    assert f"MAX_TOKENS = {talk['max_tokens']} if FULL" in source
    assert f"REPEATS = {talk['repeats']} if FULL" in source
    assert f"QUESTIONS = conversations.QUESTIONS[:{talk['questions']}] if FULL" in source
    assert source.count(f"n_draft={talk['n_draft']}") >= 3


def test_pass_seconds_scales_the_measured_pass_by_bytes():
    rows = [{"pass": "plain, 1 token", "seconds": 1.0, "bytes": 1e9}, {"pass": "head draft", "seconds": 0.5,
                                                                         "bytes": 5e8}]
    seconds = budget.pass_seconds({"rows": rows, "layers": 4})
    assert seconds["head_draft"] == 0.5
    # the same seconds per byte for both: the whole model's pass reads several times the first layers'
    assert 3 < seconds["full"] / seconds["first_layers"] < budget.LAYERS * 40 / budget.LAYERS


def test_round_trunk_rounds_matrices_only(tiny):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = qmtp.load(head=True)
    before = dict(tree_flatten(model.parameters()))
    quality.round_trunk(model, 2)
    after = dict(tree_flatten(model.parameters()))
    changed = {n for n in before if not mx.array_equal(before[n], after[n]).item()}
    assert any(".mlp.experts." in n for n in changed)
    assert not any(n.startswith("mtp.") or n.endswith("norm.weight") or "conv1d" in n for n in changed)


def test_machine_line_names_cpu_os_mlx_and_blas():
    info = machine.describe()
    line = machine.line(info)
    assert info["cores"] >= 1 and info["mlx"] == mx.__version__
    for part in (info["cpu"], f"MLX {info['mlx']}", info["backend"], "BLAS"):
        assert part in line


def test_fitting_machines_are_named_as_the_prose_says():
    gib = 2**30
    assert budget.fitting(100 * gib, machines=(64, 128), runtime=False) == [128]
    assert budget.fitting(10 * gib, machines=(128, 64), runtime=False) == [64, 128]
    assert budget.fitting(200 * gib) == []
    assert budget.machines_phrase([128]) == "a 128 GB machine"
    assert budget.machines_phrase([64, 128]) == "a 64 GB or a 128 GB machine"
    assert budget.machines_phrase([]) == "neither machine"


def test_whole_book_time_is_given_only_for_a_machine_that_holds_the_peak():
    plan = [{"memory GiB": 27.8, "minutes": 20.0}, {"memory GiB": 10.0, "minutes": 15.0}]
    assert "no whole-book time" in budget.whole_book_sentence(plan, 24.0)
    assert "35 minutes" not in budget.whole_book_sentence(plan, 24.0)
    assert budget.whole_book_sentence(plan, 64.0) == "35 minutes for the whole book."
    assert "could not be read" in budget.whole_book_sentence(plan, None)


def test_conversion_sentence_reports_a_saved_run_and_a_floor_otherwise():
    assert "No full-size conversion was measured" in budget.conversion_sentence(None)
    report = {"where": "here", "when": "today", "source_bytes": 71e9, "bits": 4,
              "tools": {"qmtp": {"seconds": 600.0, "peak_rss_bytes": 2**31}, "cp": {"seconds": 5.0}}}
    text = budget.conversion_sentence(report)
    assert "here, today" in text and "10.0 min" in text and "2.0 GiB" in text
