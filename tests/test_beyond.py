"""Chapter 9's helpers (qmtp.book.beyond) and the N-machine cost model it calls (qmtp.book.throughput, section 5):
the layout matches qmtp.parallel's blocks, the fit table is the smallest N that fits, the cost model prices
each all_sum exactly once per MoE layer per pass at the latencies given (published ones included), and
the token comparison finds a difference. Arithmetic only: no ranks are started here (tests/test_distributed.py
and the chapter itself run them)."""

import re
from pathlib import Path

import pytest

from qmtp import sizes
from qmtp.book import beyond, published
from qmtp.book.throughput import (
    Machine,
    parallel_head_seconds,
    parallel_pass_seconds,
    parallel_predictions,
    predicted_speedup,
)
from qmtp.config import QWEN36_35B_A3B as REAL
from qmtp.parallel import ExpertShard

ROOT = Path(__file__).resolve().parents[1]
REPORT = sizes.sizes(REAL, 4, mtp_bits=None)  # the head in bf16, as the book converts it
RATES = [0.78, 0.59, 0.45, 0.34]
MACHINE = Machine(published.M3_ULTRA.bandwidth)


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_blocks_are_the_experts_each_rank_holds(ranks):
    E = REAL.num_experts
    got = beyond.blocks(E, ranks)
    want = [ExpertShard(None, r, ranks, E).rows for r in range(ranks)]  # (first, stop) as the loader uses them
    assert got == [(first, stop - 1) for first, stop in want]
    held = [e for first, last in got for e in range(first, last + 1)]
    assert held == list(range(E))  # every expert on exactly one rank


def test_blocks_refuse_experts_that_do_not_split():
    with pytest.raises(ValueError):
        beyond.blocks(256, 3)


def test_layout_rows_are_per_rank_bytes():
    rows = beyond.layout_rows(REPORT, REAL.num_experts, unit=1)
    for row in rows:
        assert row["per rank"] == sizes.per_rank_bytes(REPORT, row["ranks"])
        assert row["of one process"] == pytest.approx(row["per rank"] / rows[0]["per rank"])
    shares = [r["of one process"] for r in rows]
    assert shares == sorted(shares, reverse=True) and shares[-1] > 1 / 8  # the replicated part stays


@pytest.mark.parametrize("runtime", [False, True])
def test_fit_rows_give_the_smallest_n_that_fits(runtime):
    from qmtp.book import budget

    machines = (16, 32, 64, 128, 192)
    rows = beyond.fit_rows(REAL, machines, runtime=runtime)
    assert [r["width"] for r in rows] == ["bf16", "8-bit", "6-bit", "4-bit"]
    for row, bits in zip(rows, (16, 8, 6, 4)):
        report = sizes.sizes(REAL, bits, mtp_bits=None, router_bits=16 if bits == 16 else 8)
        if bits != 16:  # the book's conversions: head in bf16 (budget.stored_bytes)
            assert report.total_bytes == budget.stored_bytes(REAL, bits)
        assert row["whole GB"] == report.total_bytes / beyond.GB
        room = budget.RUNTIME_GB * 2**30 if runtime else 0
        for m in machines:
            n = row[f"{m} GB"]
            if n is None:
                assert sizes.per_rank_bytes(report, 8) + room > m * 2**30
                continue
            assert sizes.per_rank_bytes(report, n) + room <= m * 2**30
            if n > 1:
                assert sizes.per_rank_bytes(report, n // 2) + room > m * 2**30
    # more memory never needs more machines
    for row in rows:
        cells = [row[f"{m} GB"] or 99 for m in machines]
        assert cells == sorted(cells, reverse=True)


# ---- the cost model with a link's latency (issue 27 item 7) -----------------------------------------------
def test_one_machine_is_the_single_process_model():
    """On one machine the N-machine model is chapter 6's predicted_speedup, whatever the latency (no all_sum)."""
    rows = parallel_predictions(REAL, REPORT, RATES, MACHINE, 300e-6, ranks=(1,), n_drafts=range(1, 5), context=512)
    for row in rows:
        p = predicted_speedup(REAL, REPORT, RATES, row["n_draft"], MACHINE, context=512)
        assert row["tokens_per_second"] == pytest.approx(p.tokens_per_second, rel=1e-9)


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("latency", [50e-6, 300e-6])
def test_each_pass_pays_one_all_sum_per_moe_layer(ranks, latency):
    L = REAL.num_hidden_layers
    for n in (1, 3):
        slow = parallel_pass_seconds(REAL, REPORT, n, ranks, MACHINE, latency)
        free = parallel_pass_seconds(REAL, REPORT, n, ranks, MACHINE, 0.0)
        assert slow - free == pytest.approx(L * latency, rel=1e-9)  # the same for a pass of 1 or 3 tokens
    head = parallel_head_seconds(REAL, REPORT, ranks, MACHINE, latency) - parallel_head_seconds(
        REAL, REPORT, ranks, MACHINE, 0.0)
    assert head == pytest.approx(latency, rel=1e-9)  # the head's one MoE layer


def test_a_step_costs_its_all_sums_exactly():
    """tokens per step / tokens per second is the step's time: with latency x it grows by L x for the trunk
    pass and x per head draft, at every n_draft."""
    L, x = REAL.num_hidden_layers, 300e-6
    slow = parallel_predictions(REAL, REPORT, RATES, MACHINE, x, ranks=(4,), n_drafts=range(1, 5))
    free = parallel_predictions(REAL, REPORT, RATES, MACHINE, 0.0, ranks=(4,), n_drafts=range(1, 5))
    from qmtp.adaptive import expected_tokens_per_pass

    for a, b in zip(slow, free):
        tau = expected_tokens_per_pass(RATES[: a["n_draft"] - 1])
        assert tau / a["tokens_per_second"] - tau / b["tokens_per_second"] == pytest.approx(
            L * x + (a["n_draft"] - 1) * x, rel=1e-6)


def test_prediction_rows_use_the_cited_latencies():
    links = {k.name: k.seconds for k in published.LINKS}
    rows = beyond.prediction_rows(REAL, 4, {"M3 Ultra": published.M3_ULTRA}, links)
    for k in published.LINKS:
        mine = [r for r in rows if r["link"] == k.name]
        assert [r["ranks"] for r in mine] == [1, 2, 4, 8]
        assert all(r["all_sum us"] == pytest.approx(k.seconds * 1e6) for r in mine)
    by = {(r["link"], r["ranks"]): r for r in rows}
    fast, slow = sorted(published.LINKS, key=lambda k: k.seconds)[0].name, sorted(
        published.LINKS, key=lambda k: k.seconds)[-1].name
    assert by[(fast, 1)]["plain tok/s"] == by[(slow, 1)]["plain tok/s"]  # one machine: no link
    for n in (2, 4, 8):
        assert by[(slow, n)]["plain tok/s"] < by[(fast, n)]["plain tok/s"]
        assert by[(slow, n)]["MTP speedup"] > by[(fast, n)]["MTP speedup"]  # the all_sums are shared
        assert by[(fast, n)]["best tok/s"] >= by[(fast, n)]["plain tok/s"]


def test_published_links_are_cited_and_labelled():
    keys = set(re.findall(r"^@\w+\{([^,]+),", (ROOT / "book" / "references.bib").read_text(), re.M))
    assert published.LINKS
    for k in published.LINKS:
        assert k.source in keys and k.url.startswith("https://") and k.bound in ("at most", "about")
        assert 0 < k.seconds < 1e-2 and k.where
    assert {k.source for k in published.LINKS} <= published.sources()


def test_verdicts_read_the_rows():
    rows = beyond.prediction_rows(REAL, 4, {"M3 Ultra": published.M3_ULTRA},
                                  {beyond.NO_LATENCY: 0.0, "slow": 300e-6})
    says = beyond.verdicts(rows)
    one = next(r for r in rows if r["ranks"] == 1)
    eight = next(r for r in rows if r["ranks"] == 8 and r["link"] == "slow")
    free = next(r for r in rows if r["ranks"] == 8 and r["link"] == beyond.NO_LATENCY)
    assert says["speedup_one"] == one["MTP speedup"] and says["most"] == 8 and says["pairs"] == 1
    assert says["speedup_free"] == free["MTP speedup"]
    assert says["speedup_many_min"] == says["speedup_many_max"] == eight["MTP speedup"]
    assert says["plain_slower"] is True and says["faster"].startswith("The best of several machines never")
    assert says["plain_free_faster"] is True  # the bound is excluded from plain_slower, and is faster
    assert says["best_slower"] == says["several"] == 3 and says["slow_link"] == "slow"
    assert says["slow_best_many"] == max(r["best tok/s"] for r in rows if r["link"] == "slow" and r["ranks"] > 1)
    assert says["slow_best_one"] == one["best tok/s"]


def test_rows_say_where_a_latency_was_measured():
    from qmtp.book.throughput import DEFAULT_CONTEXT

    memories = {"M3 Ultra": published.M3_ULTRA, "Strix Halo": published.STRIX_HALO}
    links = {k.name: k.seconds for k in published.LINKS}
    rows = beyond.prediction_rows(REAL, 4, memories, links,
                                  measured_on={k.name: k.measured_on for k in published.LINKS})
    for r in rows:
        assert r["assumed"] == (r["memory"] != "M3 Ultra")
        assert ("an assumption" in r["latency from"]) == r["assumed"]
    says = beyond.verdicts(rows)
    if any(r["assumed"] for r in rows if r["ranks"] > 1 and "Strix" in says["faster"]):
        assert "an assumption" in says["faster"]  # a case resting on Mac latencies says so
    # chapter 6's context by default
    explicit = beyond.prediction_rows(REAL, 4, memories, links, context=DEFAULT_CONTEXT)
    assert [r["best tok/s"] for r in explicit] == [r["best tok/s"] for r in rows]


def test_link_texts_do_not_call_the_latency_a_memory_access():
    bib = (ROOT / "book" / "references.bib").read_text()
    entry = bib[bib.index("@misc{geerling2025rdma"):]
    entry = entry[: entry.index("\n}")]
    assert "memory access latency" not in entry
    for k in published.LINKS:
        assert "memory access latency" not in k.where and "all_sum" in k.where


# ---- the live check's bookkeeping ----------------------------------------------------------------------------
def _live(tokens_rank1):
    ref = {"1/0.0": [1, 2, 3], "3/0.8": [4, 5, 6]}
    return ref, {"ranks": [{"rank": 0, "tokens": dict(ref)}, {"rank": 1, "tokens": tokens_rank1}]}


def test_compare_finds_the_first_difference():
    ref, live = _live({"1/0.0": [1, 2, 3], "3/0.8": [4, 9, 6]})
    rows = beyond.compare(live, ref)
    assert len(rows) == 4
    bad = [r for r in rows if not r["equal"]]
    assert len(bad) == 1 and bad[0]["rank"] == 1 and bad[0]["n_draft"] == 3 and bad[0]["first difference"] == 1
    assert bad[0]["sampling"] == "temperature 0.8"
    ref, live = _live({"1/0.0": [1, 2], "3/0.8": [4, 5, 6]})  # one token short
    short = [r for r in beyond.compare(live, ref) if not r["equal"]]
    assert len(short) == 1 and short[0]["first difference"] == 2


def test_memory_rows_are_shares_of_the_single_process():
    live = {"alone": {"held": 256, "weights_bytes": 100, "peak_rss": 1000},
            "ranks": [{"rank": r, "ranks": 2, "held": 128, "weights_bytes": 54, "peak_rss": 1100} for r in (0, 1)]}
    rows = beyond.memory_rows(live, unit=1)
    assert rows[0]["weights / one"] == 1.0
    assert [r["weights / one"] for r in rows[1:]] == [0.54, 0.54]
    assert [r["RSS / one"] for r in rows[1:]] == [1.1, 1.1]
