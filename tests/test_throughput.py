"""The cost model's arithmetic: the union of experts, tokens per pass, bytes per pass, speedups, the fit."""

import math

import numpy as np

import pytest

from conftest import small_config
import qmtp
from qmtp.book import throughput
from qmtp.tiny import synthetic
from qmtp.config import QWEN36_35B_A3B
from qmtp.sizes import UNQUANTIZED, sizes
from qmtp.book.throughput import (
    GB,
    Machine,
    expected_tokens_per_pass,
    expected_union,
    LoopModel,
    fit_line,
    fit_loop,
    fit_machine,
    geometric_rates,
    head_step_bytes,
    predicted_speedup,
    total,
    trunk_pass_bytes,
)

REAL = QWEN36_35B_A3B
STATE = ("KV cache", "linear state")


# ---- the union of experts -----------------------------------------------------------------------------------
def test_union_limits():
    assert expected_union(256, 8, 0) == 0
    assert expected_union(256, 8, 1) == pytest.approx(8)
    assert expected_union(256, 8, 2) == pytest.approx(15.75)  # 8 + 8 * (248/256)
    assert expected_union(256, 8, 10_000) == pytest.approx(256)
    assert expected_union(16, 16, 3) == 16  # every expert active: the union cannot grow
    assert expected_union(256, 1, 2) == pytest.approx(2 - 1 / 256)


def test_union_grows_and_stays_below_n_times_k():
    values = [expected_union(256, 8, n) for n in range(1, 9)]
    assert all(b > a for a, b in zip(values, values[1:]))
    assert all(u <= 8 * n for n, u in enumerate(values, 1))


# ---- tokens per pass ----------------------------------------------------------------------------------------
def test_tokens_per_pass_by_hand():
    assert expected_tokens_per_pass([]) == 1
    assert expected_tokens_per_pass([1, 1, 1]) == 4
    assert expected_tokens_per_pass([0.5]) == 1.5
    assert expected_tokens_per_pass([0.5, 0.5]) == 1.75
    assert expected_tokens_per_pass([0.8, 0.5, 0.25]) == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    assert expected_tokens_per_pass([0.0, 1.0]) == 1  # nothing after a draft that is never accepted


@pytest.mark.parametrize("a", [0.3, 0.78, 0.95])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_tokens_per_pass_is_the_geometric_sum_for_constant_acceptance(a, k):
    assert expected_tokens_per_pass([a] * k) == pytest.approx((1 - a ** (k + 1)) / (1 - a))


def test_geometric_rates():
    assert geometric_rates(0.78, 0.59, 3) == pytest.approx([0.78, 0.59, 0.59 * 0.59 / 0.78])


# ---- bytes per pass -----------------------------------------------------------------------------------------
def test_one_pass_over_every_expert_reads_what_sizes_says():
    report = sizes(REAL, 4)
    weights = {k: v for k, v in trunk_pass_bytes(REAL, report, 1, union=REAL.num_experts).items() if k not in STATE}
    embed = report.trunk["embeddings"]
    assert total(weights) == pytest.approx(report.trunk_bytes - embed + embed / REAL.vocab_size)


def test_one_token_reads_k_of_e_experts_and_one_embedding_row():
    report = sizes(REAL, 4)
    one = trunk_pass_bytes(REAL, report, 1)
    assert one["routed experts"] == pytest.approx(report.trunk["routed experts"] * 8 / 256)
    assert one["embeddings"] == pytest.approx(report.trunk["embeddings"] / REAL.vocab_size)
    for category in ("attention", "linear attention", "shared experts", "lm_head", "router and shared-expert gates"):
        assert one[category] == report.trunk[category]
    two = trunk_pass_bytes(REAL, report, 2)
    assert two["routed experts"] / one["routed experts"] == pytest.approx(15.75 / 8)
    assert two["lm_head"] == one["lm_head"]  # dense weights are read once per pass


def test_a_measured_union_per_layer_is_used_as_given():
    report = sizes(REAL, 4)
    per_layer = [8.0] * 20 + [16.0] * 20
    got = trunk_pass_bytes(REAL, report, 2, union=per_layer)["routed experts"]
    assert got == pytest.approx(report.trunk["routed experts"] * 12 / 256)
    with pytest.raises(ValueError, match="40 layers"):
        trunk_pass_bytes(REAL, report, 2, union=[8.0] * 3)


def test_state_bytes_by_hand():
    state = throughput.state_bytes(REAL, context=1000, n_tokens=1, cache_bytes=2)
    assert state["KV cache"] == 10 * 2 * 2 * 256 * 2 * 1001  # 10 full layers, K and V, 2 heads of 256
    S = 32 * 128 * 128 * 4
    conv = 3 * (2 * 2048 + 4096) * 2
    assert state["linear state"] == 30 * 2 * (S + conv)  # read and written


def test_head_step_reads_its_layer_with_k_experts_and_the_shared_lm_head():
    report = sizes(REAL, 4, mtp_bits=4)
    step = head_step_bytes(REAL, report, context=0)
    assert step["lm_head"] == report.trunk["lm_head"]
    assert step["routed experts"] == pytest.approx(report.head["routed experts"] * 8 / 256)
    assert step["mtp fc"] == report.head["mtp fc"]


def test_bytes_grow_with_width():
    assert total(trunk_pass_bytes(REAL, sizes(REAL, 8), 1)) > total(trunk_pass_bytes(REAL, sizes(REAL, 4), 1))


def test_sizes_of_a_loaded_model_match_the_arithmetic(tmp_path):
    config = small_config()
    model = qmtp.load(synthetic.write_checkpoint(tmp_path, config, dtype="F32"))
    in_memory = throughput.sizes_of(model)
    arithmetic = sizes(config, bits=UNQUANTIZED, mtp_bits=None, router_bits=UNQUANTIZED, dtype_bytes=4)
    assert in_memory.trunk == arithmetic.trunk
    assert in_memory.head == arithmetic.head


# ---- speedup ------------------------------------------------------------------------------------------------
def test_dispatch_regime_speedup_is_tokens_per_pass():
    """When a pass costs a fixed overhead and bytes cost nothing, drafting for free gains exactly tau."""
    report = sizes(REAL, 4)
    machine = Machine(bandwidth=math.inf, overhead=1e-3, head_overhead=0.0)
    rates = [0.8, 0.5]
    for n_draft in (1, 2, 3):
        p = predicted_speedup(REAL, report, rates, n_draft, machine)
        assert p.speedup == pytest.approx(expected_tokens_per_pass(rates[: n_draft - 1]))


def test_memory_bound_speedup_by_hand():
    report = sizes(REAL, 4)
    machine = Machine(bandwidth=256 * GB)
    one = total(trunk_pass_bytes(REAL, report, 1))
    two = total(trunk_pass_bytes(REAL, report, 2))
    head = total(head_step_bytes(REAL, report))
    p = predicted_speedup(REAL, report, [0.78], 2, machine)
    assert p.speedup == pytest.approx(1.78 * one / (two + head))
    dense = predicted_speedup(REAL, report, [0.78], 2, machine, dense=True)
    two_dense = total(trunk_pass_bytes(REAL, report, 2, union=8))  # the weights of one token; state for two
    assert two_dense == pytest.approx(one, rel=1e-3)
    assert dense.speedup == pytest.approx(1.78 * one / (two_dense + head))
    assert p.tokens_per_second == pytest.approx(1.78 / ((two + head) / (256 * GB)))


def test_moe_gains_less_than_dense_and_equal_when_every_expert_is_active():
    report = sizes(REAL, 4)
    machine = Machine(bandwidth=256 * GB)
    rates = geometric_rates(0.78, 0.59, 4)
    for n in (2, 3, 4, 5):
        moe = predicted_speedup(REAL, report, rates, n, machine).speedup
        dense = predicted_speedup(REAL, report, rates, n, machine, dense=True).speedup
        assert moe < dense
    assert predicted_speedup(REAL, report, rates, 1, machine).speedup == 1.0
    all_active = REAL.replace(num_experts=8)
    report = sizes(all_active, 4)
    for n in (2, 3):
        moe = predicted_speedup(all_active, report, rates, n, machine).speedup
        dense = predicted_speedup(all_active, report, rates, n, machine, dense=True).speedup
        assert moe == pytest.approx(dense)


def test_perfect_drafts_on_a_dense_model_gain_n_draft_less_the_heads_cost():
    report = sizes(REAL, 4)
    machine = Machine(bandwidth=256 * GB)
    p = predicted_speedup(REAL, report, [1.0] * 3, 4, machine, dense=True)
    one = total(trunk_pass_bytes(REAL, report, 1))
    four = total(trunk_pass_bytes(REAL, report, 4, union=8))
    assert p.tokens_per_pass == 4
    assert p.speedup == pytest.approx(4 * one / (four + 3 * total(head_step_bytes(REAL, report))))


def test_too_few_rates_is_an_error():
    with pytest.raises(ValueError, match="needs 2"):
        predicted_speedup(REAL, sizes(REAL, 4), [0.8], 3, Machine(256 * GB))


def test_real_model_table_reads_like_the_reports():
    """At 256 GB/s, 4-bit, acceptance 0.78: the MoE gains little (1.1x-1.4x is reported), a dense model more."""
    rows = throughput.real_model_table(bits=(4,), n_drafts=(1, 2))
    moe = next(r for r in rows if r["model"] == "MoE" and r["n_draft"] == 2)
    dense = next(r for r in rows if r["model"] != "MoE" and r["n_draft"] == 2)
    plain = next(r for r in rows if r["model"] == "MoE" and r["n_draft"] == 1)
    assert 1.0 < moe["speedup"] < 1.4 < dense["speedup"]
    assert 1.5 < plain["trunk_GB"] < 2.5  # about 3B active parameters at ~4.5 bits, plus lm_head and state


# ---- fitting overhead and bandwidth ---------------------------------------------------------------------------
def test_fit_recovers_a_known_machine():
    truth = Machine(bandwidth=2e9, overhead=3e-3, head_overhead=1e-3)
    trunk_bytes = [1e6, 2e6, 3.5e6, 5e6]
    head_bytes = [4e5, 4e5]
    fitted = fit_machine(trunk_bytes, [truth.seconds(b) for b in trunk_bytes],
                         head_bytes, [truth.seconds(b, head=True) for b in head_bytes])
    assert fitted.bandwidth == pytest.approx(truth.bandwidth)
    assert fitted.overhead == pytest.approx(truth.overhead)
    assert fitted.head_overhead == pytest.approx(truth.head_overhead)


def test_fit_never_finds_a_negative_overhead():
    bytes_, seconds = [1e6, 2e6, 3e6], [0.5e-3, 1.9e-3, 3.1e-3]  # the unconstrained line crosses below zero
    fitted = fit_machine(bytes_, seconds)
    assert fitted.overhead == 0
    per_byte = sum(b * s for b, s in zip(bytes_, seconds)) / sum(b * b for b in bytes_)
    assert fitted.bandwidth == pytest.approx(1 / per_byte)


def test_fit_needs_times_that_grow_with_bytes():
    with pytest.raises(ValueError):
        fit_machine([1e6], [1e-3])
    with pytest.raises(ValueError):
        fit_machine([1e6, 2e6], [2e-3, 1e-3])


# ---- experts over N machines ----------------------------------------------------------------------------------
def test_busiest_rank_of_one_is_the_whole_union():
    for n in (1, 2, 5):
        assert throughput.busiest_rank_experts(256, 8, n, 1) == pytest.approx(throughput.expected_union(256, 8, n))


@pytest.mark.parametrize("ranks,n_tokens", [(2, 1), (2, 3), (4, 2), (8, 5)])
def test_busiest_rank_matches_simulated_routing(ranks, n_tokens):
    """Independent uniform top-k routing simulated: the busiest rank's distinct experts, plus its block's first
    expert when a chosen expert lies outside the block and the first is not chosen (`parallel.ExpertShard`)."""
    E, k = 256, 8
    rng = np.random.default_rng(0)
    held = E // ranks
    totals = []
    for _ in range(4000):
        chosen = np.zeros(E, bool)
        for _ in range(n_tokens):
            chosen[rng.choice(E, k, replace=False)] = True
        per_rank = [chosen[r * held:(r + 1) * held].sum() + (not chosen[r * held] and chosen.sum() > chosen[r * held:(r + 1) * held].sum())
                    for r in range(ranks)]
        totals.append(max(per_rank))
    assert throughput.busiest_rank_experts(E, k, n_tokens, ranks) == pytest.approx(np.mean(totals), rel=0.05)


def test_one_rank_pass_is_the_single_machine_pass():
    from qmtp.config import QWEN36_35B_A3B

    report = sizes(QWEN36_35B_A3B, 4)
    machine = throughput.Machine(100e9, 1e-3)
    for n in (1, 3):
        alone = machine.seconds(throughput.total(throughput.trunk_pass_bytes(QWEN36_35B_A3B, report, n, 512)))
        assert throughput.parallel_pass_seconds(QWEN36_35B_A3B, report, n, 1, machine, 1.0, 512) == pytest.approx(alone)


def test_spreading_the_experts_shrinks_the_verify_pass_more_than_the_plain_one():
    from qmtp.config import QWEN36_35B_A3B

    report = sizes(QWEN36_35B_A3B, 4)
    machine = throughput.Machine(100e9)
    cost = {N: [throughput.parallel_pass_seconds(QWEN36_35B_A3B, report, n, N, machine, 0.0) for n in (1, 4)]
            for N in (1, 4)}
    # what each extra verified token costs over a plain pass falls when each machine reads 1/N of the union
    assert cost[4][1] - cost[4][0] < (cost[1][1] - cost[1][0]) / 2
# ---- the loop model: a step priced by its tokens ------------------------------------------------------------
def test_fit_line_keeps_a_negative_intercept():
    """Where time grows faster than bytes the line crosses zero bytes below zero: fit_machine clamps that
    overhead at 0, fit_line reports it (the reason a bytes model underpredicts the long passes)."""
    bytes_, seconds = [1e6, 2e6, 3e6], [0.5e-3, 1.9e-3, 3.1e-3]
    intercept, slope = fit_line(bytes_, seconds)
    assert intercept == pytest.approx(-0.7667e-3, rel=1e-3) and slope == pytest.approx(1.3e-9)
    assert fit_machine(bytes_, seconds).overhead == 0
    with pytest.raises(ValueError):
        fit_line([1.0, 1.0], [1.0, 2.0])


def test_fit_loop_recovers_a_known_loop_and_prices_plain_decoding_exactly():
    truth = LoopModel(loop_overhead=2e-3, pass_fixed=1e-3, pass_per_token=0.5e-3, head_per_draft=0.3e-3)
    widths = [2, 3, 4, 5]
    fitted = fit_loop(widths, [truth.pass_seconds(n) for n in widths], [0.3e-3] * 4, truth.step_seconds(1))
    for field in ("loop_overhead", "pass_fixed", "pass_per_token", "head_per_draft"):
        assert getattr(fitted, field) == pytest.approx(getattr(truth, field))
    assert fitted.speedup(1.0, 1) == pytest.approx(1.0)
    # the loop's cost per step is paid once per step, so it is shared by the tokens a step yields
    assert fitted.speedup(2.0, 2) == pytest.approx(2.0 * 3.5e-3 / (2e-3 + 2e-3 + 0.3e-3))


def test_a_loop_dominated_by_its_own_cost_gains_almost_tau():
    loop = LoopModel(loop_overhead=1.0, pass_fixed=1e-4, pass_per_token=1e-4, head_per_draft=1e-4)
    assert 2.9 < loop.speedup(3.0, 4) < 3.0


def test_chapter_6s_tables_have_one_row_per_width_and_their_columns():
    result = {"n_draft": 2, "tokens_per_second": 100.0, "tokens_per_second_min": 90.0, "tokens_per_second_max": 110.0,
              "speedup_vs_plain": 1.25, "tokens_per_trunk_pass": 1.5, "trunk_seconds_per_pass": 0.003,
              "head_seconds_per_draft": 0.0005, "experts_per_pass_measured": 6.0}
    prediction = {"n_draft": 2, "tokens_per_pass": 1.5, "measured_step_seconds": 0.004, "loop_step_seconds": 0.006,
                  "predicted_step_seconds": 0.005, "measured_speedup": 1.25, "predicted_speedup": 1.3,
                  "bytes_model_speedup": 1.1}
    report = {"results": [result, dict(result, n_draft=3)],
              "cost_model": {"predictions": [prediction, dict(prediction, n_draft=3)]}}
    widths = throughput.widths_table(report).splitlines()
    assert len(widths) == 2 + 2 and widths[0].startswith("| n_draft | tok/s | slowest-fastest | vs plain")
    assert "| 2 | 100 | 90-110 | 1.25x | 1.50 | 3.00 | 0.50 | 6.0 |" == widths[2]
    loop = throughput.loop_model_table(report).splitlines()
    assert len(loop) == 4 and "| 3 | 1.50 | 4.0 | 6.0 | 5.0 | 100 | 1.25x | 1.30x | 1.10x |" == loop[3]
    predictions = throughput.predictions_table(throughput.real_model_table(bits=(4, 8))).splitlines()
    assert len(predictions) == 2 + 2 * 4  # two trunk widths, n_draft 2 to 5
    real = {"rows": [{"pass": "plain, 1 token", "seconds": 0.2, "bytes": 4e8, "time_over_plain": 1.0,
                      "bytes_over_plain": 1.0}]}
    assert throughput.real_width_table(real).splitlines()[2] == "| plain, 1 token | 200 | 1.00x | 400 | 1.00x |"
