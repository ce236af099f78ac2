"""`bench batch` beside mlx-vlm's batched decoding: its batch on the bundled model returns qmtp's greedy tokens
row by row, a missing feature is reported as a reason, and the bench's rows, table and goals carry mlx-vlm."""

import pytest

import qmtp
from qmtp.book import bench_batch, peer
from test_peer import engine, model  # noqa: F401 (fixtures: the bundled model and mlx-vlm's engine for its file)

needs_batch = pytest.mark.skipif(peer.batch_unavailable() is not None, reason=peer.batch_unavailable() or "")
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def prompts(model):
    return bench_batch.prompts_for(model, 2)  # two lengths: mlx-vlm left-pads the shorter


@pytest.fixture(scope="module")
def greedy(model, prompts):
    return [g.tokens for g in qmtp.generate_batch(model, prompts, max_tokens=MAX_TOKENS, stop_at_eos=False)]


@needs_batch
@pytest.mark.parametrize("n_draft", [1, 3])
def test_mlx_vlm_batch_returns_qmtps_greedy_tokens_per_row(engine, prompts, greedy, n_draft):
    result = engine.generate_batch(prompts, MAX_TOKENS, n_draft)
    assert [row["tokens"] for row in result["rows"]] == greedy
    assert result["seconds"] > 0 and all(row["first_token_seconds"] > 0 for row in result["rows"])
    if n_draft == 1:
        assert result["acceptance"] is None and result["lockstep"] is None
    else:
        assert result["passes"] < MAX_TOKENS - 1, "no draft was accepted: mlx-vlm's batched MTP did not run"
        assert 0 < result["acceptance"] <= 1
        # qwen3_5's target asks for uniform acceptance: each row's is the batch's
        assert result["lockstep"] is True
        assert [row["acceptance"] for row in result["rows"]] == [result["acceptance"]] * 2


@needs_batch
def test_mlx_vlm_batch_refuses_auto(engine, prompts):
    with pytest.raises(qmtp.errors.UsageError, match="no auto width"):
        engine.generate_batch(prompts, MAX_TOKENS, "auto")


def test_batch_unavailable_names_the_missing_round_loop(monkeypatch):
    mtp = pytest.importorskip("mlx_vlm.speculative.mtp")
    if peer.available() is not None:
        pytest.skip(peer.available())

    monkeypatch.delattr(mtp, "_mtp_rounds_batch", raising=False)
    assert "no batched MTP drafting" in peer.batch_unavailable()


def test_batch_unavailable_names_a_batch_generator_without_a_drafter(monkeypatch):
    ar = pytest.importorskip("mlx_vlm.generate.ar")  # (mlx_vlm.generate is also a name its package rebinds)
    if peer.available() is not None:
        pytest.skip(peer.available())

    class OlderBatchGenerator:
        def __init__(self, model, processor, *, max_tokens=128):
            pass

    monkeypatch.setattr(ar, "BatchGenerator", OlderBatchGenerator)
    reason = peer.batch_unavailable()
    assert "takes no drafter" in reason and "draft_kind" in reason


def test_batch_unavailable_passes_on_why_mlx_vlm_is_missing(monkeypatch):
    monkeypatch.setattr(peer, "available", lambda: "mlx-vlm is not installed: pip install")
    assert peer.batch_unavailable() == "mlx-vlm is not installed: pip install"


def test_an_unavailable_mlx_vlm_is_a_note_not_a_row(model, monkeypatch):
    monkeypatch.setattr(peer, "batch_unavailable", lambda: "mlx-vlm 0.0 has no batched MTP drafting")
    report = bench_batch.run(model, batches=(1,), n_drafts=(1,), max_tokens=4, rounds=1, peers=("mlx-vlm",))
    assert not [r for r in report["rows"] if r["engine"] == "mlx-vlm"]
    assert report["notes"] == ["mlx-vlm: not run, mlx-vlm 0.0 has no batched MTP drafting"]
    assert "mlx-vlm 0.0 has no batched MTP drafting" in bench_batch.table(report)


@needs_batch
def test_the_bench_rows_carry_mlx_vlm_at_each_fixed_width(model):
    report = bench_batch.run(model, batches=(1, 2), n_drafts=(1, 2, "auto"), max_tokens=6, rounds=1,
                             peers=("mlx-vlm",))
    theirs = {(r["n_draft"], r["batch"]): r for r in report["rows"] if r["engine"] == "mlx-vlm"}
    assert sorted(theirs) == [("1", 1), ("1", 2), ("2", 1), ("2", 2)]  # no auto: mlx-vlm has none
    assert all(r["first_mismatch"] == [None] * r["batch"] for r in theirs.values())
    assert theirs[("2", 2)]["lockstep"] is True and len(theirs[("2", 2)]["acceptance"]) == 2
    assert report["notes"] == [f"mlx-vlm auto: not run, {bench_batch.NO_AUTO}"]
    table = bench_batch.table(report)
    assert bench_batch.NO_AUTO in table and "lockstep" in table and "MISMATCH" not in table
    goal = bench_batch.goals(report["rows"], size=2)["drafting_over_mlx_vlm_drafting"]
    assert goal["mlx_vlm_n_draft"] == "2" and goal["ratio"] > 0


def test_first_mismatch_finds_the_first_differing_position_or_a_length_difference():
    assert bench_batch.first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert bench_batch.first_mismatch([1, 5, 3], [1, 2, 3]) == 1
    assert bench_batch.first_mismatch([1, 2], [1, 2, 3]) == 2


def test_the_table_names_every_mismatched_row():
    def row(engine, n, b, tps, **more):
        return {"engine": engine, "n_draft": n, "batch": b, "tokens_per_second": tps, **more}

    rows = [row("batch", "1", 4, 100.0), row("batch", "3", 4, 150.0), row("batch", "auto", 4, 180.0),
            row("mlx-vlm", "1", 4, 90.0), row("mlx-vlm", "3", 4, 120.0, first_mismatch=[None, 7, None, 2], lockstep=True)]
    report = {"rows": rows, "goals": bench_batch.goals(rows)}
    table = bench_batch.table(report)
    assert "= @7 = @2" in table
    assert "MISMATCH mlx-vlm n_draft 3 batch 4: rows [1, 3]" in table
    goal = report["goals"]["drafting_over_mlx_vlm_drafting"]
    assert goal["ratio"] == pytest.approx(180 / 120) and goal["at_same_width"] == {"3": pytest.approx(150 / 120)}
    assert "drafting_over_mlx_vlm_drafting: 1.50x (n_draft auto over 3; at n_draft 3 both 1.25x) (goal 1.0x) met" in table
    rows.pop(2)  # without auto qmtp's best is n_draft 3 too: the ratio is said once
    assert "drafting_over_mlx_vlm_drafting: 1.25x (n_draft 3 over 3) (goal 1.0x) met" in bench_batch.table(
        {"rows": rows, "goals": bench_batch.goals(rows)})


@needs_batch
def test_without_lockstep_no_acceptance_is_made_up(engine, prompts, monkeypatch):
    """Were mlx-vlm's rows to accept each their own count, its record would hold only each round's mean over
    rows: the batch then reports that mean, and no acceptance, rather than one counted from it."""
    lm = engine.model.language_model
    monkeypatch.setattr(type(lm), "requires_uniform_batch_acceptance", False)
    monkeypatch.setattr(type(engine.drafter), "requires_uniform_batch_acceptance", False)
    result = engine.generate_batch(prompts, MAX_TOKENS, 3)
    assert result["lockstep"] is False and result["acceptance"] is None
    assert all(row["acceptance"] is None for row in result["rows"])
    assert 0 <= result["mean_accepted_per_round"] <= 2
