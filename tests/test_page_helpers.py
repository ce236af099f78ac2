"""The qmtp.book functions the chapters now call for their tables, one table each."""

import qmtp
from qmtp import sizes
from qmtp.book import budget, evaluate, inventory, mistakes, outside_build, quality
from qmtp.loading import BUNDLED_MODEL


def _rows(table):
    return [line for line in table.splitlines() if line.startswith("|")][2:]


def test_budget_plan_is_the_chapters_plan_alone():
    plan = budget.plan("02_fixes")
    assert plan[0].isupper() and plan.endswith(".")
    assert "runs as written" not in plan and "QMTP_MODEL" not in plan


def test_checkpoint_tables_hold_a_row_per_entry():
    rows = inventory.by_category(BUNDLED_MODEL)
    assert len(_rows(inventory.category_table(rows))) == len(rows)
    counts = sizes.parameter_counts(qmtp.ModelConfig.from_file(BUNDLED_MODEL))
    assert len(_rows(inventory.count_table(counts))) == len(counts)
    reports = {bits: sizes.sizes(qmtp.QWEN36_35B_A3B, bits=bits) for bits in (4, 8)}
    variants = inventory.variant_rows(reports, {4: 20, 8: 37})
    assert [r["lemon-mlx-engine's card (GB)"] for r in variants] == [20, 37]
    assert len(_rows(inventory.variant_table(variants))) == 2
    listing = inventory.tensor_listing(qmtp.Checkpoint(BUNDLED_MODEL), "mtp.")
    assert listing and all(r["tensor"].startswith("mtp.") for r in listing)


def test_outcome_table_says_what_mlx_refused():
    results = {"runs": {"runs": True, "accuracy": 0.5, "perplexity": 3.0, "continuation": "a fox",
                        "top_probability": 0.4, "loss_when_wrong": 2.0},
               "refused": {"runs": False, "error": "conv weight shape"}}
    table = mistakes.outcome_table(results, "load", confidence=False)
    assert "MLX refuses: conv weight shape" in table and "| runs | 0.500 | 3.0 | a fox |" in table
    assert "top choice" not in table.splitlines()[0]


def test_width_and_acceptance_tables():
    measures = {"trunk_bytes": 2e6, "head_bytes": 1e6, "perplexity": 4.0, "acceptance_n_draft_2": 0.8}
    assert len(_rows(quality.trunk_width_table({8: measures, 4: measures}, measures))) == 3
    assert "| bf16 | 1.00 | 0.800 |" in quality.head_width_table({"bf16": measures})
    rate = {"rate": 0.8, "per_position": [0.8, 0.6], "tokens_per_trunk_pass": 2.3}
    assert "| greedy | 0.80 | 0.60 | 2.30 |" in evaluate.sampling_table({0.0: {2: rate, 3: rate}})
    chat = [{"sampler": "greedy", "thinking": True, **rate}]
    assert "| greedy | on | 0.80, 0.60 | 0.80 | 2.30 |" in evaluate.chat_table(chat)
    assert len(_rows(outside_build.on_bundled_table())) == len(outside_build.ON_BUNDLED)


def test_generated_text_note_sizes_the_tiny_model_from_its_config():
    config = qmtp.ModelConfig.from_file(BUNDLED_MODEL)
    millions = sizes.parameter_counts(config)["total"] / 1e6
    assert f"{millions:.1f} million parameters" in evaluate.generated_text_note(config, full=False)
    assert "tiny" not in evaluate.generated_text_note(qmtp.QWEN36_35B_A3B, full=True)
