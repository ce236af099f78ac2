"""Chapter 7's machinery: results saved per model and read back, and verdicts that follow the measurements."""

import copy
import json
import re
from pathlib import Path

import pytest

from conftest import small_config
from qmtp.book import claims, outside_build, published, results, throughput
from qmtp.tiny import synthetic
from qmtp.config import QWEN36_35B_A3B
from qmtp.loading import BUNDLED_MODEL

SAVED = {
    "01_anatomy": {"trunk_gb": {"4": 19.51, "6": 28.17, "8": 36.83}, "head_gb": {"bf16": 1.69, "8": 0.9, "6": 0.69, "4": 0.48}},
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
                      "measured_speedup": {"2": 0.91, "3": 0.92},
                      "real_width_summary": {"layers": 4, "measured_on": "real-width layers", "plain_ms": 700.0,
                                     "verify2_time_over_plain": 1.9, "verify2_bytes_over_plain": 1.1,
                                     "head_time_over_plain": 0.6, "break_even_n_draft_2": 2.5,
                                     "compute_bound": True}},
}
REAL_MODEL_CLAIMS = [c.key for c in claims.CLAIMS.values() if c.real_model]


def verdicts(saved, real_model=False):
    return {r["claim"]: r["verdict"] for r in claims.check(saved, real_model)}


def claim(key):
    return claims.CLAIMS[key].text


def test_every_claim_gets_one_row_with_a_verdict():
    rows = claims.check(SAVED, real_model=False)
    assert [r["claim"] for r in rows] == [c.text for c in claims.CLAIMS.values()]
    assert {r["verdict"] for r in rows} <= set(claims.VERDICTS)
    v = verdicts(SAVED)
    assert v[claim("fixes_needed")] == claims.PARTLY  # the norm half is silent garbage, the conv half fails loudly
    assert v[claim("head_size_gb")] == claims.FAILS  # 1.69 GB in bf16, not 0.5
    assert v[claim("variant_sizes_gb")] == claims.HOLDS
    assert v[claim("bf16_head")] == claims.UNTESTABLE  # a real-model figure, tiny model measured
    assert v[claim("acceptance_n_draft_2")] == claims.UNTESTABLE
    assert v[claim("rocm_6bit_fault")] == claims.UNTESTABLE


@pytest.mark.parametrize("key, chapter, path, value, real_model, expected", [
    ("fixes_needed", "02_fixes", ("accuracy", "conv fix only"), 0.7, False, claims.FAILS),
    ("fixes_needed", "02_fixes", ("accuracy", "norm fix only"), 0.05, False, claims.HOLDS),  # conv half silent too
    ("double_shift", "02_fixes", ("double_shift_accuracy",), 0.7, False, claims.FAILS),
    ("head_size_gb", "01_anatomy", ("head_gb", "bf16"), 0.51, False, claims.HOLDS),
    ("variant_sizes_gb", "01_anatomy", ("trunk_gb", "6"), 33.0, False, claims.FAILS),
    ("crippled_head", "05_mtp_decoding", ("ablation", "no routed experts"), 0.8, False, claims.FAILS),
    ("bf16_head", "04_quantizing", ("head_width_acceptance", "4"), 0.70, False, claims.UNTESTABLE),
    ("bf16_head", "04_quantizing", ("head_width_acceptance", "4"), 0.70, True, claims.HOLDS),
    ("bf16_head", "04_quantizing", ("head_width_acceptance", "4"), 0.853, True, claims.FAILS),
    ("acceptance_n_draft_3", "05_mtp_decoding", ("acceptance", "3"), 0.59, False, claims.UNTESTABLE),
    ("acceptance_n_draft_3", "05_mtp_decoding", ("acceptance", "3"), 0.59, True, claims.HOLDS),
    ("speedup_moe", "06_throughput", ("predicted_moe_4bit", "2"), 2.5, False, claims.UNTESTABLE),
    ("speedup_moe", "06_throughput", ("measured_speedup", "2"), 1.2, True, claims.HOLDS),
    ("speedup_moe", "06_throughput", ("measured_speedup", "2"), 0.5, True, claims.FAILS),
    ("rocm_6bit_fault", "04_quantizing", ("backend_faulty_widths",), [6], False, claims.HOLDS),
])
def test_verdicts_follow_the_measurements(key, chapter, path, value, real_model, expected):
    saved = copy.deepcopy(SAVED)
    target = saved[chapter]
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    assert verdicts(saved, real_model)[claim(key)] == expected


def test_the_rule_a_real_model_claim_is_not_testable_on_the_bundled_model():
    assert set(REAL_MODEL_CLAIMS) >= {"acceptance_n_draft_2", "acceptance_n_draft_3", "bf16_head", "speedup_moe"}
    rows = {r["key"]: r for r in claims.check(SAVED, real_model=False)}
    for key in REAL_MODEL_CLAIMS:
        assert rows[key]["verdict"] == claims.UNTESTABLE, key
        assert rows[key]["indicates"], f"{key}: what the bundled model indicates belongs in its own column"
    # on the real model each is judged
    real = {r["key"]: r for r in claims.check(SAVED, real_model=True)}
    assert all(real[k]["verdict"] != claims.UNTESTABLE for k in REAL_MODEL_CLAIMS if k != "speedup_radeon_890m")


def test_the_speedup_claim_carries_the_real_width_measurement():
    row = next(r for r in claims.check(SAVED, real_model=False) if r["key"] == "speedup_moe")
    assert "2.50 plain passes" in row["indicates"] and "cannot pay" in row["indicates"]
    assert "published (not measured here)" in row["indicates"]
    saved = copy.deepcopy(SAVED)
    del saved["06_throughput"]["real_width_summary"]  # results saved before chapter 6 kept it: said, not guessed
    row = next(r for r in claims.check(saved, real_model=False) if r["key"] == "speedup_moe")
    assert "no real-width measurement" in row["indicates"]


def test_the_fixes_claim_holds_in_part_when_the_conv_half_fails_loudly():
    row = next(r for r in claims.check(SAVED, real_model=False) if r["key"] == "fixes_needed")
    assert row["verdict"] == claims.PARTLY and "fails loudly" in row["why"]


def test_real_model_figures_are_judged_only_on_the_real_model():
    saved = copy.deepcopy(SAVED)
    assert verdicts(saved, real_model=False)[claim("acceptance_n_draft_2")] == claims.UNTESTABLE
    assert verdicts(saved, real_model=True)[claim("acceptance_n_draft_2")] == claims.FAILS  # 0.89 vs 0.78
    saved["05_mtp_decoding"]["acceptance"]["2"] = 0.77
    assert verdicts(saved, real_model=True)[claim("acceptance_n_draft_2")] == claims.HOLDS
    assert claims.is_real_model(QWEN36_35B_A3B)
    assert not claims.is_real_model(small_config())


def test_results_round_trip_per_model(tmp_path, monkeypatch):
    monkeypatch.setenv(results.ENV, str(tmp_path / "store"))
    other = synthetic.write_checkpoint(tmp_path / "other", small_config())
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


# ---- sources, the field's published figures, the draft-length convention, the glossary -------------------------
ROOT = Path(__file__).resolve().parent.parent


def bib_keys():
    return set(re.findall(r"^@\w+\{([^,]+),", (ROOT / "book" / "references.bib").read_text(), re.M))


def test_every_claim_and_published_row_has_a_source_in_the_bibliography():
    keys = bib_keys()
    for c in claims.CLAIMS.values():
        assert c.cite and set(c.cite) <= keys, c.key
    for row in published.FIELD:
        assert row.source in keys, row.key
        assert row.url.startswith("https://"), row.key
    assert published.sources() <= keys
    assert outside_build.sources() <= keys


def test_every_bibliography_entry_is_cited_somewhere():
    texts = [p.read_text() for p in [*(ROOT / "book").glob("*.md"), *(ROOT / "notebooks").glob("*.py")]]
    cited = set()
    for text in texts:
        for group in re.findall(r"\{cite(?::\w+)?\}`([^`]+)`", text):
            cited |= {k.strip() for k in group.split(",")}
    cited |= {k for c in claims.CLAIMS.values() for k in c.cite} | published.sources()  # cited in chapter 8's tables
    cited |= outside_build.sources()  # cited in chapters 5 and 8's tables of the project's own records
    assert bib_keys() <= cited, sorted(bib_keys() - cited)


def test_published_rows_are_labelled_as_published():
    for row in published.field_table():
        assert {"source", "url", "checked"} <= set(row)
        assert row["published speedup"] == pytest.approx(row["MTP tok/s"] / row["plain tok/s"])
    assert not outside_build.sources() & published.sources()  # the project's own records are not published


def test_the_projects_own_records_are_kept_apart_from_the_published():
    assert all(r["source"] for r in outside_build.ON_BUNDLED)
    assert not hasattr(published, "ELSEWHERE_ON_BUNDLED")
    for name in ("05_mtp_decoding", "08_claims"):
        text = (ROOT / "notebooks" / f"{name}.py").read_text()
        # the records themselves, or the table built from them (chapter 5 shows it through on_bundled_table)
        assert ("outside_build.ON_BUNDLED" in text or "outside_build.on_bundled_table" in text), name
        assert "outside_build.MEASURED_BY" in text or "outside_build.on_bundled_table" in text, name


@pytest.mark.parametrize("engine, value, n_draft", [
    ("qmtp", 2, 2), ("lemon-mlx-engine", 2, 2), ("mlx-vlm", 3, 3), ("llama.cpp", 1, 2), ("llama.cpp", 3, 4),
    ("vLLM", 1, 2), ("vLLM", 4, 5),
])
def test_n_draft_conversions(engine, value, n_draft):
    assert published.to_n_draft(engine, value) == n_draft
    assert published.from_n_draft(engine, n_draft) == value


def test_n_draft_conversion_table_and_unknown_engines():
    rows = {r["engine"]: r for r in published.conversion_table(range(1, 4))}
    assert [rows[e]["n_draft=2"] for e in ("qmtp", "lemon-mlx-engine", "mlx-vlm", "llama.cpp", "vLLM")] == [2, 2, 2, 1, 1]
    assert rows["vLLM"]["option"] == "num_speculative_tokens" and rows["llama.cpp"]["n_draft=3"] == 2
    with pytest.raises(KeyError):
        published.to_n_draft("sglang", 1)
    row = next(r for r in published.FIELD if r.key == "llama_cpp_3060_laptop_2")
    assert row.engine_draft == 2 and row.n_draft == 3


def test_the_cost_model_beside_a_published_row():
    assert published.STRIX_HALO.bandwidth == pytest.approx(256e9)
    assert published.M3_ULTRA.bandwidth == pytest.approx(819.2e9)
    for tau, k in ((1.8, 1), (2.4, 2), (3.0, 4)):
        a = throughput.constant_rate(tau, k)
        assert 1 + sum(a**i for i in range(1, k + 1)) == pytest.approx(tau, abs=1e-9)
    row = next(r for r in published.FIELD if r.key == "vllm_mlx_m3_ultra")
    p = published.predict(row)
    assert p.n_draft == 2 and not p.assumed and p.tokens_per_pass == pytest.approx(1.795)
    assert 1.0 < p.speedup < p.tokens_per_pass  # the union of experts and the head's reads eat part of tau
    unknown = next(r for r in published.FIELD if r.n_draft is None)
    assert set(published.predict(unknown).assumed) == {"n_draft", "acceptance"}
    long = next(r for r in published.FIELD if r.key == "rocm_vllm_strix_halo_4096")
    assert "long_context" in published.predict(long).reasons  # published below the model: the row says why


def test_every_page_prices_a_machine_by_the_same_prediction():
    """Chapter 6 (`real_model_table`, whose numbers the findings page reads) and chapter 8 (`published.predict`)
    give the same number for the same machine, width, context, draft length and acceptance."""
    for row in published.FIELD:
        p = published.predict(row)
        same = throughput.machine_prediction(row.bandwidth, p.n_draft, bits=row.bits, context=row.context,
                                             acceptance=row.acceptance_mid)
        assert p.speedup == pytest.approx(same.speedup, rel=1e-12), row.key
        rates = throughput.rates_for(p.n_draft, row.acceptance_mid)
        table = throughput.real_model_table(bits=(row.bits,), bandwidth=row.bandwidth, n_drafts=(p.n_draft,),
                                            context=row.context, rates=rates)
        moe = next(r for r in table if r["model"] == "MoE")
        assert moe["speedup"] == pytest.approx(p.speedup, rel=1e-12), row.key
    # a row without an acceptance is priced with chapter 6's default, the reported rates
    unknown = next(r for r in published.FIELD if r.acceptance is None)
    p = published.predict(unknown)
    chapter_6 = throughput.real_model_table(bits=(unknown.bits,), bandwidth=unknown.bandwidth,
                                            n_drafts=(p.n_draft,), context=unknown.context)
    assert next(r for r in chapter_6 if r["model"] == "MoE")["speedup"] == pytest.approx(p.speedup, rel=1e-12)


def test_reported_rates_give_the_reported_overall_acceptance():
    a2, a3 = (claims.CLAIMS[k].value for k in ("acceptance_n_draft_2", "acceptance_n_draft_3"))
    r1, r2 = throughput.reported_rates(2)
    assert r1 == pytest.approx(a2)
    assert (r1 + r1 * r2) / 2 == pytest.approx(a3)  # drafts accepted over drafts proposed at n_draft=3
    assert throughput.rates_for(3, 0.7) == pytest.approx([throughput.constant_rate(2.4, 2)] * 2)


def test_a_partly_offloaded_row_is_not_priced():
    offloaded = [r for r in published.field_table() if "partial_offload" in r["prediction"].row.conditions]
    assert offloaded
    for r in offloaded:
        assert r["predicted speedup"] is None and not r["comparable"]
        assert not published.agrees(r["prediction"])
        assert r["why"].startswith("not comparable")
    assert all(r["comparable"] for r in published.field_table() if r not in offloaded)


def test_a_fixed_cost_moves_the_speedup_by_who_pays_it():
    effect = throughput.overhead_effect(256e9, 2, overhead=0.002)
    assert effect["once per step"] > effect["memory-bound"] > effect["every pass and draft"]


def test_glossary_page_defines_the_terms_and_is_in_the_toc():
    text = (ROOT / "book" / "glossary.md").read_text()
    assert "```{glossary}" in text
    for term in ("n_draft", "trunk", "head", "draft", "verify", "pending token", "acceptance", "tokens per pass",
                 "register", "A3B", "Qwen3-Next", "Qwen3.5", "Qwen3.6", "model_type"):
        assert re.search(rf"^{re.escape(term)}$", text, re.M), term
    assert "book/glossary" in (ROOT / "_toc.yml").read_text()
