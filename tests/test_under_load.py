"""qmtp.book.under_load: the expert-union cost model for B rows of n_draft tokens, and the chapter's tables."""

import pytest

from qmtp.book import cost_model, published, under_load
from qmtp.config import QWEN36_35B_A3B as REAL


def test_one_token_reads_its_eight_experts_and_a_full_batch_reads_all_256():
    assert under_load.experts_read(1, 1) == pytest.approx(REAL.num_experts_per_tok)
    assert under_load.experts_read(1, 2) == pytest.approx(256 * (1 - (1 - 8 / 256) ** 2))
    assert under_load.experts_read(4, 3) == pytest.approx(under_load.experts_read(12, 1))  # only B x n counts
    assert under_load.experts_read(512, 1) == pytest.approx(256, abs=1e-4)
    assert under_load.experts_read(512, 5) <= 256


def test_the_union_grows_with_every_token_and_never_past_the_experts_or_eight_per_token():
    seen = [under_load.experts_read(b, 1) for b in range(1, 300)]
    assert all(a < b for a, b in zip(seen, seen[1:]))
    assert all(u <= min(256, 8 * t) + 1e-9 for t, u in enumerate(seen, start=1))


def test_one_row_is_exactly_the_single_stream_cost_model():
    c, _ = cost_model.fitted_without(None)
    for key in under_load.MACHINES:
        row = under_load.machine(key)
        for n in (1, 2, 3, 5):
            assert under_load.step_seconds(row, 1, n, c) == pytest.approx(cost_model.step_seconds(row, n, c))
            assert under_load.step_seconds(row, 1, n, c, row_share=0.3) == pytest.approx(
                cost_model.step_seconds(row, n, c))
        assert under_load.aggregate_tps(row, 1, 1) == pytest.approx(row.plain_tps)


def test_bytes_grow_with_rows_and_a_full_union_stops_the_experts_growing():
    row = under_load.machine("vllm_mlx_m3_ultra")
    small = [under_load.pass_bytes(row.member, row.bits, row.context, b, 1)[0] for b in (1, 2, 4)]
    assert small[0] < small[1] < small[2]
    # past saturation a drafted token adds only its row's state and an embedding row, a tiny share
    full_plain = under_load.pass_bytes(row.member, row.bits, row.context, 512, 1)[0]
    full_wide = under_load.pass_bytes(row.member, row.bits, row.context, 512, 3)[0]
    near_plain = under_load.pass_bytes(row.member, row.bits, row.context, 1, 1)[0]
    near_wide = under_load.pass_bytes(row.member, row.bits, row.context, 1, 3)[0]
    assert full_wide / full_plain - 1 < 0.1 * (near_wide / near_plain - 1)


def test_the_row_share_reproduces_the_published_plain_batch_it_was_taken_from():
    share = under_load.fit_row_share()
    batch = next(r for r in published.UNDER_LOAD if r.key == under_load.PLAIN_BATCH)
    m3 = under_load.machine("vllm_mlx_m3_ultra")
    assert 0 <= share < 1
    assert under_load.aggregate_tps(m3, batch.requests, 1, share) == pytest.approx(batch.tps["plain"])


def test_per_token_drafting_stops_paying_and_its_gain_falls_towards_tau_over_n():
    _, fit = cost_model.fitted_without(None)
    m3 = under_load.machine("vllm_mlx_m3_ultra")
    assert under_load.best_width(m3, 1)[0] > 1  # one request: drafting pays (the single-stream model's answer)
    stop = under_load.break_even(m3)
    assert stop is not None and 1 < stop < 64
    assert under_load.best_width(m3, 4096, widths=(2,))[1] == pytest.approx(fit.tokens_per_pass(2) / 2, rel=0.02)


def test_the_chapter_tables_render_every_row():
    model_rows = under_load.model_rows()
    assert [r["batch"] for r in model_rows] == list(under_load.BATCHES)
    assert under_load.model_table(model_rows).count("\n") == len(model_rows) + 1
    field = under_load.field_rows()
    assert len(field) == len(published.UNDER_LOAD)
    assert all("{cite:p}`" in r["source"] for r in field)
    assert under_load.field_table(field).count("\n") == len(field) + 1


def test_measured_rows_read_a_bench_batch_report():
    def cell(engine, n, b, tps, acc=()):
        return {"engine": engine, "n_draft": n, "batch": b, "tokens_per_second": tps, "acceptance": list(acc)}

    report = {"rows": [cell("batch", "1", 1, 100.0, [float("nan")]), cell("batch", "2", 1, 130.0, [0.9]),
                       cell("singles", "1", 1, 95.0), cell("batch", "1", 2, 180.0, [float("nan")] * 2),
                       cell("batch", "2", 2, 170.0, [0.9, 0.7]), cell("singles", "1", 2, 96.0)]}
    gains = under_load.measured_gains(report)
    assert gains[1] == ("2", pytest.approx(1.3)) and gains[2][1] == pytest.approx(170 / 180)
    rows = under_load.measured_rows(report)
    assert rows[1]["acceptance 2"] == [0.9, 0.7] and rows[0]["acceptance 1"] == []
    table = under_load.measured_table(rows)
    assert "170 (0.70-0.90)" in table and "130 (0.90)" in table


def test_published_figures_under_load_have_sources_in_the_bibliography():
    import re
    from pathlib import Path

    bib = (Path(__file__).resolve().parents[1] / "book" / "references.bib").read_text()
    keys = set(re.findall(r"^@\w+\{([^,]+),", bib, re.M))
    assert {r.source for r in published.UNDER_LOAD} <= keys
    for r in published.UNDER_LOAD:
        assert r.url.startswith("https://") and r.where, r.key
        assert all(lo <= hi for lo, hi in r.ratio.values()), r.key


def test_real_width_passes_count_the_experts_a_batched_pass_reads():
    from qmtp.book import bench_batch

    small = dict(hidden_size=256, moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=16,
                 vocab_size=1024, linear_num_key_heads=2, linear_num_value_heads=4, num_attention_heads=4,
                 num_key_value_heads=1)
    report = bench_batch.real_width_passes((1, 4), (1, 3), context=8, budget=0.05, overrides=small)
    rows = {(r["batch"], r["n_draft"]): r for r in report["rows"]}
    assert rows[(1, 1)]["experts_read"] == 8 and rows[(1, 1)]["time_over_one_token"] == 1
    assert 8 < rows[(1, 3)]["experts_read"] <= rows[(4, 3)]["experts_read"] <= 16
    assert all(r["seconds"] > 0 and 8 <= r["experts_predicted"] <= 16 for r in rows.values())
    assert "experts read" in bench_batch.real_width_table(report)


def test_peer_rows_set_qmtp_beside_mlx_vlm_and_name_every_differing_row():
    def cell(engine, n, b, tps, acc=None, **more):
        return {"engine": engine, "n_draft": n, "batch": b, "tokens_per_second": tps, "acceptance": acc, **more}

    rows = [cell("batch", "1", 1, 100.0, [float("nan")]), cell("batch", "3", 1, 150.0, [0.8]),
            cell("mlx-vlm", "1", 1, 90.0, first_mismatch=[None]),
            cell("mlx-vlm", "3", 1, 120.0, [0.8], first_mismatch=[None]),
            cell("batch", "1", 4, 300.0, [float("nan")] * 4), cell("batch", "3", 4, 330.0, [0.7, 0.9, 0.8, 0.8]),
            cell("batch", "auto", 4, 352.0, [0.9] * 4),
            cell("mlx-vlm", "1", 4, 280.0, first_mismatch=[None] * 4),
            cell("mlx-vlm", "3", 4, 220.0, [0.5] * 4, first_mismatch=[None, None, 5, None])]
    from qmtp.book import bench_batch

    report = {"rows": rows, "goals": bench_batch.goals(rows), "notes": []}
    peers = under_load.peer_rows(report)
    assert [p["batch"] for p in peers] == [1, 4] and peers[1]["differ"] == [("3", 2, 5)]
    table = under_load.peer_table(report)
    assert "330 (0.70-0.90) / 220 (0.50)" in table and "n_draft 3 row 2 differs from position 5" in table
    assert "qmtp's, every row" in table
    text = under_load.peer_sentences(report)
    assert ("qmtp's best drafting width (n_draft auto) gave 1.60x the aggregate tokens/s of mlx-vlm's at n_draft 3, "
            "the one drafting width it ran, 1.50x at n_draft 3 both") in text
    assert "from 0.80 at 1 row to 0.50 at 4" in text
    assert "batch 4 n_draft 3 row 2 (from position 5)" in text


def test_a_peer_that_did_not_run_is_said_so():
    report = {"rows": [], "goals": {}, "notes": ["mlx-vlm: not run, mlx-vlm is not installed"]}
    assert under_load.peer_table(report) == "mlx-vlm: not run, mlx-vlm is not installed"
    assert under_load.peer_sentences(report) == "mlx-vlm: not run, mlx-vlm is not installed."
