"""Chapter 7's machinery: results saved per model and read back, and verdicts that follow the measurements."""

import copy
import json

import pytest

from qmtp.book import claims, results
from qmtp.tiny import synthetic
from qmtp.config import QWEN36_35B_A3B
from qmtp.loading import BUNDLED_MODEL

SAVED = {
    "01_anatomy": {"trunk_gb": {"4": 19.51, "6": 28.17, "8": 36.83},
                   "total_gib": {"4": 19.74, "6": 27.81, "8": 35.87}, "head_gb": {"bf16": 1.69, "8": 0.9, "6": 0.69, "4": 0.48}},
    "02_fixes": {"accuracy": {"neither fix": None, "conv fix only": 0.04, "norm fix only": None, "both fixes": 0.74},
                 "perplexity": {"neither fix": None, "conv fix only": 322.0, "norm fix only": None, "both fixes": 2.3},
                 "double_shift_accuracy": 0.1},
    "04_quantizing": {"head_width_acceptance": {"bf16": 0.854, "8": 0.854, "6": 0.86, "4": 0.858, "3": 0.845},
                      "head_bf16_over_4bit_mb": 0.9, "backend_faulty_widths": [], "simulated_fault_flagged": [6],
                      "mlx_version": "0.32.4"},
    "05_mtp_decoding": {"acceptance": {"2": 0.89, "3": 0.6, "4": 0.55, "5": 0.5},
                        "per_position": {"2": [0.89], "3": [0.86, 0.41], "4": [0.89, 0.39, 0.48], "5": [0.87, 0.4, 0.44, 0.47]},
                        "ablation": {"complete head, bf16": 0.87, "no routed experts": 0.31}},
    "06_throughput": {"predicted_moe_4bit": {"1": 1.0, "2": 1.21, "3": 1.16, "4": 1.03, "5": 0.89},
                      "measured_speedup": {"2": 0.91, "3": 0.92}},
}


def verdicts(saved, real_model=False):
    return {r["claim"]: r["verdict"] for r in claims.check(saved, real_model)}


def claim(key):
    return claims.CLAIMS[key].text


def test_every_claim_gets_one_row_with_a_verdict():
    rows = claims.check(SAVED, real_model=False)
    assert [r["claim"] for r in rows] == [c.text for c in claims.CLAIMS.values()]
    assert {r["verdict"] for r in rows} <= {claims.HOLDS, claims.FAILS, claims.UNTESTABLE}
    v = verdicts(SAVED)
    assert v[claim("fixes_needed")] == claims.HOLDS
    assert v[claim("head_size_gb")] == claims.FAILS  # 1.69 GB in bf16, not 0.5
    assert v[claim("variant_sizes_gb")] == claims.HOLDS
    assert v[claim("bf16_head")] == claims.FAILS
    assert v[claim("acceptance_n_draft_2")] == claims.UNTESTABLE  # a real-model figure, tiny model measured
    assert v[claim("rocm_6bit_fault")] == claims.UNTESTABLE


@pytest.mark.parametrize("key, chapter, path, value, expected", [
    ("fixes_needed", "02_fixes", ("accuracy", "conv fix only"), 0.7, claims.FAILS),
    ("double_shift", "02_fixes", ("double_shift_accuracy",), 0.7, claims.FAILS),
    ("head_size_gb", "01_anatomy", ("head_gb", "bf16"), 0.51, claims.HOLDS),
    ("variant_sizes_gb", "01_anatomy", ("total_gib", "6"), 33.0, claims.FAILS),
    ("crippled_head", "05_mtp_decoding", ("ablation", "no routed experts"), 0.8, claims.FAILS),
    ("bf16_head", "04_quantizing", ("head_width_acceptance", "4"), 0.70, claims.HOLDS),
    ("acceptance_n_draft_3", "05_mtp_decoding", ("per_position", "3"), [0.5, 0.6], claims.FAILS),
    ("speedup_moe", "06_throughput", ("predicted_moe_4bit", "2"), 2.5, claims.FAILS),
    ("rocm_6bit_fault", "04_quantizing", ("backend_faulty_widths",), [6], claims.HOLDS),
])
def test_verdicts_follow_the_measurements(key, chapter, path, value, expected):
    saved = copy.deepcopy(SAVED)
    target = saved[chapter]
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    assert verdicts(saved)[claim(key)] == expected


def test_real_model_figures_are_judged_only_on_the_real_model():
    saved = copy.deepcopy(SAVED)
    assert verdicts(saved, real_model=True)[claim("acceptance_n_draft_2")] == claims.FAILS  # 0.89 vs 0.78
    saved["05_mtp_decoding"]["acceptance"]["2"] = 0.77
    assert verdicts(saved, real_model=True)[claim("acceptance_n_draft_2")] == claims.HOLDS
    assert claims.is_real_model(QWEN36_35B_A3B)
    assert not claims.is_real_model(synthetic.small_config())


def test_results_round_trip_per_model(tmp_path, monkeypatch):
    monkeypatch.setenv(results.ENV, str(tmp_path / "store"))
    other = synthetic.write_checkpoint(tmp_path / "other", synthetic.small_config())
    with pytest.raises(results.MissingResultsError, match="run that chapter first"):
        results.load("02_fixes", BUNDLED_MODEL)
    results.save("02_fixes", BUNDLED_MODEL, {"x": 1})
    assert results.load("02_fixes", BUNDLED_MODEL) == {"x": 1}
    with pytest.raises(results.MissingResultsError):  # another model's results are kept apart
        results.load("02_fixes", other)
    written = list((tmp_path / "store").rglob("*"))
    assert not [p for p in written if p.name.endswith(".partial")]
    assert json.loads(next(p for p in written if p.suffix == ".json").read_text())["values"] == {"x": 1}


def test_results_live_in_the_book_build_folder(tmp_path, monkeypatch):
    monkeypatch.delenv(results.ENV, raising=False)
    (tmp_path / "_toc.yml").write_text("root: intro\n")
    (tmp_path / "notebooks").mkdir()
    assert results.root(tmp_path / "notebooks") == tmp_path / "_build" / "qmtp-results"
