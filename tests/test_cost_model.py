"""The calibrated cost model (`qmtp.book.cost_model`): a pass costs at least its bytes, a machine is calibrated by
its plain figure alone, every MTP row is predicted from other sources only, and the book's numbers come from it."""

import dataclasses

import pytest

from qmtp.book import cost_model as cm
from qmtp.book import published


@pytest.fixture
def fresh_fits():
    """The model's caches emptied before and after, so a test may change the rows it fits on."""
    cm.fitted_without.cache_clear()
    cm.validate.cache_clear()
    yield
    cm.fitted_without.cache_clear()
    cm.validate.cache_clear()


def row(key):
    return next(r for r in cm.rows() if r.key == key)


def test_plain_decoding_is_the_plain_figure_exactly():
    c, fit = cm.fitted_without(None)
    for r in cm.rows():
        if cm.comparable(r)[0]:
            assert cm.predicted_tps(r, 1, c, fit) == pytest.approx(r.plain_tps)


def test_a_pass_costs_at_least_its_bytes_over_the_bandwidth():
    r = row("llama_cpp_a100")
    for n in range(1, 6):
        trunk, head = cm._bytes(r.member, r.bits, r.context, n)
        assert cm.step_seconds(r, n, 0.0) >= (trunk + (n - 1) * head) / r.bandwidth
    fast = dataclasses.replace(r, plain_tps=1e6)  # a plain figure above the bandwidth bound: no negative overhead
    assert cm.calibrate(fast).overhead == 0.0


def test_the_extra_position_share_decides_whether_drafting_pays():
    r = row("vllm_strix_halo_awq_1")  # a pass mostly overhead
    _, fit = cm.fitted_without(None)
    once_per_pass = cm.predicted_tps(r, 4, 0.0, fit) / r.plain_tps
    once_per_token = cm.predicted_tps(r, 4, 1.0, fit) / r.plain_tps
    assert once_per_pass > 1.5 and once_per_token < 1.0


def test_the_fit_recovers_a_known_share(monkeypatch, fresh_fits):
    # rows made by the model itself at c = 0.3: the fit must find 0.3 again
    _, fit = cm.fitted_without(None)
    made = tuple(dataclasses.replace(r, mtp_tps=cm.predicted_tps(r, r.n_draft, 0.3, fit))
                 for r in published.FIELD if cm._trainable(r))
    assert cm.fit_extra_position(list(made), fit) == pytest.approx(0.3, abs=0.003)


def test_a_source_is_predicted_without_its_own_figures(monkeypatch, fresh_fits):
    """Doubling every MTP figure of one source and changing its acceptance leaves its strict predictions (which
    read no acceptance of the row itself) unchanged, while the other sources' predictions move."""
    source = "llamacpp22673"
    before = {v.row.key: (v.strict_tps, v.predicted_tps) for v in cm.validate() if v.comparable}
    changed = tuple(dataclasses.replace(r, mtp_tps=r.mtp_tps * 2, acceptance=0.3) if r.source == source else r
                    for r in published.FIELD)
    monkeypatch.setattr(cm, "FIELD", changed)
    cm.fitted_without.cache_clear()
    cm.validate.cache_clear()
    after = {v.row.key: (v.strict_tps, v.predicted_tps) for v in cm.validate() if v.comparable}
    own = [k for k in after if row(k).source == source]
    assert own and all(after[k][0] == pytest.approx(before[k][0]) for k in own)
    assert any(after[k][1] != pytest.approx(before[k][1], rel=1e-9) for k in after if k not in own)


def test_every_published_row_stays_in_the_table():
    table = cm.table()
    assert [t["key"] for t in table] == [r.key for r in published.FIELD + published.FAMILY]
    for t in table:
        assert t["comparable"] == (t["predicted tok/s"] is not None)
        assert t["comparable"] or t["why not"]
    assert row("llama_cpp_3060_laptop_2").key in {t["key"] for t in table if t["comparable"]}  # offload: calibrated


def test_fitted_parameters_name_their_data():
    params = cm.fitted_parameters()
    names = [p["parameter"] for p in params]
    assert names[0].startswith("c,") and "acceptance" in names[1] and "acceptance" in names[2]
    c = params[0]
    assert "rocm_vllm_strix_halo_128" not in c["fitted on"]  # no draft length: not fitted on
    assert "llama_cpp_a100" in c["fitted on"]
    low, high = c["range out of sample"]
    assert low <= c["value"] <= high
    overheads = [p for p in params if p["parameter"].startswith("overhead of a plain pass")]
    assert overheads and all("plain figure alone" in p["fitted on"] for p in overheads)


def test_agreement_and_verdict_come_from_the_table():
    table = [t for t in cm.table() if t["comparable"]]
    a = cm.agreement()
    assert a["comparable"] == len(table)
    assert a["within"][0.15] == sum(abs(t["error"]) <= 0.15 for t in table)
    text = cm.verdict()
    assert text.startswith("Tested out of sample")
    assert f"within 15% of {a['within'][0.15]}" in text


def test_the_sweeps_best_widths():
    runs = {s["source"]: s for s in cm.sweeps()}
    assert runs["llamacpp22673"]["published best"] == 3 and runs["llamacpp22673"]["right"]
    assert runs["kyuz0strix53"]["published best"] == 5 and runs["kyuz0strix53"]["right"]


def test_engine_options_beside_n_draft():
    assert cm.engine_option(row("llama_cpp_strix_halo_vulkan"), 3) == "--spec-draft-n-max 2"
    assert cm.engine_option(row("vllm_mlx_m3_ultra"), 2) == "num_speculative_tokens 1"
    assert cm.engine_option(row("lemon_radeon_890m"), 2) == "--n-draft 2"


def test_bottom_line_names_kinds_engines_and_sources():
    table = cm.bottom_line({"break_even_n_draft_2": 2.6}, 24)
    kinds = [t["hardware"] for t in table]
    for word in ("Strix Halo", "Apple", "NVIDIA", "CPU"):
        assert any(word in k for k in kinds)
    for t in table:
        assert t["engines"] and set(t["sources"]) <= published.sources()
    cpu = next(t for t in table if "CPU" in t["hardware"])
    assert cpu["n_draft"].startswith("1")  # a step costs more plain passes than it yields tokens
    assert cm.bottom_line({"break_even_n_draft_2": 1.2}, 24)[-1]["n_draft"] == "2"
    assert "Strix Halo" in cm.bottom_line_prose(table) or "GPU" in cm.bottom_line_prose(table)


def test_widths_that_fit():
    assert "4-bit" in cm.widths_that_fit(128) and "bf16" in cm.widths_that_fit(128)
    assert cm.widths_that_fit(8) == []
