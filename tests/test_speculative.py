"""Speculative decoding is lossless: greedy returns plain greedy's tokens, sampling keeps the trunk's law."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

from conftest import small_config, trunk_logits
import qmtp
from qmtp import adaptive, chat
from qmtp.tiny import synthetic
from qmtp.errors import QmtpError, UsageError


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    """A random model over 4 tokens: random drafts are accepted often enough to hit every rollback length."""
    config = small_config(vocab_size=4)
    return qmtp.load(synthetic.write_checkpoint(tmp_path_factory.mktemp("v4"), config, dtype="F32", seed=11))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    config = small_config()
    return qmtp.load(synthetic.write_checkpoint(tmp_path_factory.mktemp("v97"), config, dtype="F32", seed=5))


PROMPTS = [[0], [1, 2], [3, 0, 1, 2, 3], [2, 2, 2, 1], [1, 3, 0, 0, 2, 1, 3, 3, 0]]


@pytest.mark.parametrize("n_draft", [2, 3, 4, 5])
@pytest.mark.parametrize("rollback", ["record", "replay"])
def test_greedy_speculative_equals_plain_greedy(small_vocab_model, n_draft, rollback):
    partial_accepts = 0
    for prompt in PROMPTS:
        plain = qmtp.generate(small_vocab_model, prompt, max_tokens=24, n_draft=1)
        spec = qmtp.generate(small_vocab_model, prompt, max_tokens=24, n_draft=n_draft,
                             engine=qmtp.Engine(rollback=rollback))
        assert spec.tokens == plain.tokens
        partial_accepts += sum(0 < s.accepted < len(s.drafts) for s in spec.stats.steps)
    if n_draft > 2:
        assert partial_accepts > 0, "the test never exercised a partial accept"


def test_greedy_lossless_on_a_wider_vocabulary(model):
    rng = np.random.default_rng(0)
    for _ in range(4):
        prompt = rng.integers(0, 97, rng.integers(1, 12)).tolist()
        plain = qmtp.generate(model, prompt, max_tokens=16)
        for n_draft in range(2, 6):
            assert qmtp.generate(model, prompt, max_tokens=16, n_draft=n_draft).tokens == plain.tokens


def test_statistics_are_consistent(small_vocab_model):
    g = qmtp.generate(small_vocab_model, [1, 2, 3], max_tokens=30, n_draft=3,
                      engine=qmtp.Engine(track_experts=True))
    s = g.stats
    assert s.generated == len(g.tokens) == 30
    assert s.trunk_passes == len(s.steps) == len(s.tokens_per_pass) == len(s.experts_per_pass)
    assert all(d >= a for d, a in zip(s.drafted, s.accepted))
    assert s.drafted[0] == s.trunk_passes
    # a draft at position i is proposed only when all before it were accepted
    assert s.drafted[1] == s.accepted[0]
    config = small_vocab_model.config
    for per_layer, n in zip(s.experts_per_pass, s.tokens_per_pass):
        assert len(per_layer) == config.num_hidden_layers
        assert all(config.num_experts_per_tok <= e <= min(config.num_experts, n * config.num_experts_per_tok) for e in per_layer)


def sequence_law(model, prompt, temperature):
    """Exact trunk probability of every 2-token continuation, by enumeration."""
    V = model.config.vocab_size
    law = {}
    first = mx.softmax(trunk_logits(model, mx.array([prompt]))[0, -1] / temperature).tolist()
    for a in range(V):
        second = mx.softmax(trunk_logits(model, mx.array([prompt + [a]]))[0, -1] / temperature).tolist()
        for b in range(V):
            law[(a, b)] = first[a] * second[b]
    return law


def chi_square_p_value(counts: dict, law: dict, n: int) -> float:
    """Pearson's test of observed counts against a law; p-value by the Wilson-Hilferty approximation."""
    from math import erfc, sqrt

    observed = np.array([counts.get(k, 0) for k in law], dtype=float)
    expected = np.array([law[k] * n for k in law])
    keep = expected > 0
    assert observed[~keep].sum() == 0, "an outcome of probability zero occurred"
    stat = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / sqrt(2 / (9 * dof))
    return 0.5 * erfc(z / sqrt(2))


@pytest.mark.slow
def test_sampling_keeps_the_trunk_distribution(small_vocab_model):
    prompt, temperature, n = [1, 0, 3], 1.0, 800
    law = sequence_law(small_vocab_model, prompt, temperature)
    counts = {}
    for seed in range(n):
        g = qmtp.generate(small_vocab_model, prompt, max_tokens=2, n_draft=3, temperature=temperature, seed=seed)
        counts[tuple(g.tokens)] = counts.get(tuple(g.tokens), 0) + 1
    assert chi_square_p_value(counts, law, n) > 1e-3
    # The same test rejects a law that differs: the trunk's at another temperature.
    assert chi_square_p_value(counts, sequence_law(small_vocab_model, prompt, 0.5), n) < 1e-3


def test_bad_arguments_are_usage_errors(small_vocab_model):
    with pytest.raises(UsageError, match="n_draft"):
        qmtp.generate(small_vocab_model, [1], n_draft=0)
    with pytest.raises(UsageError, match="n_draft"):
        qmtp.generate(small_vocab_model, [1], n_draft=99)
    with pytest.raises(UsageError, match="empty"):
        qmtp.generate(small_vocab_model, [])
    with pytest.raises(UsageError, match="context"):
        qmtp.generate(small_vocab_model, [1] * 4090, max_tokens=10)
    with pytest.raises(UsageError, match="temperature"):
        qmtp.generate(small_vocab_model, [1], temperature=-1)


def test_a_model_without_head_cannot_draft(tmp_path):
    path = synthetic.write_checkpoint(tmp_path, small_config(), head=False)
    headless = qmtp.load(path)
    assert qmtp.generate(headless, [1, 2], max_tokens=3).tokens  # plain decoding works
    with pytest.raises(QmtpError, match="no MTP head"):
        qmtp.generate(headless, [1, 2], max_tokens=3, n_draft=2)


def test_acceptance_is_what_teacher_forcing_predicts(small_vocab_model):
    from qmtp.book.evaluate import predicted_acceptance

    for prompt in PROMPTS:
        plain = qmtp.generate(small_vocab_model, prompt, max_tokens=30, stop_at_eos=False)
        spec = qmtp.generate(small_vocab_model, prompt, max_tokens=30, n_draft=2, stop_at_eos=False)
        predicted = predicted_acceptance(small_vocab_model, prompt, plain.tokens)
        assert (predicted["proposed"], predicted["accepted"]) == (spec.stats.drafted[0], spec.stats.accepted[0])


def test_ablated_drafters_stay_lossless(small_vocab_model):
    from qmtp import mtp

    heads = {
        "no routed experts": mtp.without_routed_experts(small_vocab_model.mtp),
        "4-bit": mtp.with_weight_bits(small_vocab_model.mtp, 4, group_size=32),
    }
    assert heads["no routed experts"].layers[0].mlp.experts is None
    plain = qmtp.generate(small_vocab_model, [1, 2, 3], max_tokens=20)
    for head in heads.values():
        assert qmtp.generate(small_vocab_model, [1, 2, 3], max_tokens=20, n_draft=3,
                             engine=qmtp.Engine(head=head)).tokens == plain.tokens
    assert qmtp.generate(small_vocab_model, [1, 2, 3], max_tokens=20, n_draft=3,
                         engine=qmtp.Engine(hidden="pre")).tokens == plain.tokens


def test_quantized_head_differs_from_bf16_head(small_vocab_model):
    from qmtp import mtp

    x = mx.random.normal((1, 3, small_vocab_model.config.hidden_size))
    e = mx.random.normal((1, 3, small_vocab_model.config.hidden_size))
    full = np.array(small_vocab_model.mtp(x, e))
    three = np.array(mtp.with_weight_bits(small_vocab_model.mtp, 3, group_size=32)(x, e))
    eight = np.array(mtp.with_weight_bits(small_vocab_model.mtp, 8, group_size=32)(x, e))
    assert np.abs(eight - full).max() < np.abs(three - full).max()


@pytest.mark.parametrize("compiled,queue_ahead", [(False, True), (True, False), (False, False)])
def test_the_loop_without_compiling_or_queueing_ahead_makes_the_same_tokens(small_vocab_model, compiled, queue_ahead):
    for n_draft in (1, 3):
        for prompt in PROMPTS[:2]:
            lean = qmtp.generate(small_vocab_model, prompt, max_tokens=16, n_draft=n_draft)
            ablated = qmtp.generate(small_vocab_model, prompt, max_tokens=16, n_draft=n_draft,
                                    engine=qmtp.Engine(compiled=compiled, queue_ahead=queue_ahead))
            assert ablated.tokens == lean.tokens and ablated.stats.tokens_per_pass == lean.stats.tokens_per_pass


@pytest.mark.parametrize("n_draft,max_tokens", [(1, 7), (3, 7), (3, 200)])
def test_streamed_tokens_are_the_output_as_it_comes(n_draft, max_tokens):
    model = qmtp.load()  # the bundled model: it has a tokenizer and ends its texts
    chunks = []
    g = qmtp.generate(model, "Once upon a time", max_tokens=max_tokens, n_draft=n_draft, on_tokens=chunks.append)
    assert [t for c in chunks for t in c] == g.tokens and all(chunks)
    assert len(chunks) <= 1 + g.stats.trunk_passes  # the prefill's token, then at most one chunk a pass
    if max_tokens == 200:
        # nothing streamed past the end of the text (the bundled model may end a story as it ends a reply)
        assert g.finish_reason == "end" and g.tokens[-1] in chat.end_ids(model)


def test_auto_drafting_is_lossless(small_vocab_model, model):
    for m in (small_vocab_model, model):
        for prompt in PROMPTS:
            plain = qmtp.generate(m, prompt, max_tokens=20)
            auto = qmtp.generate(m, prompt, max_tokens=20, n_draft="auto")
            assert auto.tokens == plain.tokens
            assert set(auto.stats.tokens_per_pass) <= set(adaptive.WIDTHS)
    assert auto.stats.n_draft == "auto"
    with pytest.raises(UsageError, match="auto"):
        qmtp.generate(model, [1], n_draft="fast")


class CyclingPlanner(adaptive.DraftPlanner):
    """Changes width at every step, then falls back to plain decoding: every switch the loop can make."""

    def __init__(self, order):
        super().__init__(costs={n: 1.0 for n in adaptive.WIDTHS})
        self.order = list(order)

    def choose(self):
        self.width = self.order.pop(0) if self.order else 1
        self.plain = not self.order  # then plain decoding for good: the head stops
        return self.width


@pytest.mark.parametrize("rollback", ["record", "replay"])
def test_switching_widths_between_steps_is_lossless(small_vocab_model, rollback):
    from conftest import decode_planned

    for prompt in PROMPTS:
        plain = qmtp.generate(small_vocab_model, prompt, max_tokens=30, stop_at_eos=False).tokens
        g = decode_planned(small_vocab_model, prompt, CyclingPlanner([3, 5, 2, 4, 2, 5, 5, 3, 4]), rollback,
                           max_tokens=30)
        widths = g.stats.tokens_per_pass
        assert g.tokens == plain
        assert widths[-1] == 1 and len(set(widths)) > 3


def test_a_plain_step_that_follows_keeps_the_heads_cache_whole(model):
    """Width 1 chosen by a learning planner before it gives up drafting: the head still reads each position, so
    the drafts after such steps are the ones a generation that never stopped drafting makes at the same
    positions."""
    from conftest import decode_planned

    def first_drafts(order, prompt):
        planner = CyclingPlanner(order)  # its widths 1 before the last: steps whose head follows
        g = decode_planned(model, prompt, planner, max_tokens=40)
        position, drafts = 1, {}  # after the prefill's token
        for step in g.stats.steps:
            if step.drafts:
                drafts[position] = step.drafts[0]  # d_1: the guess for the token after the pending one
            position += len(step.emitted)
        return drafts

    for prompt in ([1, 3, 0, 2], [3, 1, 2, 2, 0, 1]):
        drafting = first_drafts([2] * 40, prompt)
        interrupted = first_drafts([2, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 2] + [2] * 30, prompt)
        common = set(drafting) & set(interrupted)
        assert len(common) >= 20
        assert all(drafting[p] == interrupted[p] for p in common)


def test_planner_chooses_the_most_tokens_per_second():
    planner = adaptive.DraftPlanner(costs={1: 1.0, 2: 1.2, 3: 1.4, 4: 2.0, 5: 3.0}, prior=0.9)
    # before any draft, the prior: tau(2) = 2.71 in 1.4 is the best of 1.9/1.2, 2.71/1.4, 3.44/2, 4.1/3
    assert planner.choose() == 3
    for _ in range(40):  # a head that is always wrong: drafting stops paying, and plain decoding sticks
        planner.observe(drafts=planner.width - 1, accepted=0)
        if planner.choose() == 1:
            break
    assert planner.width == 1 and planner.steps >= planner.plain_after and planner.rates()[0] < 0.2
    for _ in range(10):
        planner.observe(drafts=0, accepted=0)
    assert planner.choose() == 1


def test_planner_waits_before_giving_up_drafting():
    planner = adaptive.DraftPlanner(costs={1: 1.0, 2: 1.5}, plain_after=16)
    for _ in range(15):
        assert planner.choose() == 2
        planner.observe(drafts=1, accepted=0)
    planner.observe(drafts=1, accepted=0)
    assert planner.choose() == 1


def test_planner_tries_again_a_width_a_low_rate_shut_out():
    # carried over: the second position's drafts were mostly rejected, so width 2 is the best...
    costs = {1: 1.0, 2: 1.0, 3: 1.2}
    planner = adaptive.DraftPlanner(costs, proposed=[20.0, 20.0], accepted=[18.0, 4.0])
    assert planner.choose() == 2
    # ... and at width 2 the second position is never proposed again; its count fades, its rate goes back
    # towards the first position's (still counted, 0.9), and width 3 is tried again
    for step in range(40):
        planner.observe(drafts=planner.width - 1, accepted=planner.width - 1 if step % 10 else 0)
        if planner.choose() == 3:
            break
    assert planner.width == 3 and step < 40 - 1


def test_planner_counts_fade():
    planner = adaptive.DraftPlanner(costs={1: 1.0, 2: 1.0, 3: 1.2}, decay=0.5)
    planner.observe(drafts=2, accepted=1)
    planner.observe(drafts=2, accepted=2)
    assert planner.proposed == pytest.approx([1.5, 1.5]) and planner.accepted == pytest.approx([1.5, 1.0])


def test_planner_starts_from_the_counts_of_the_last_generation(small_vocab_model):
    costs = {1: 1.0, 2: 1.1, 3: 1.2}
    assert adaptive.DraftPlanner(costs, proposed=[1000, 1000], accepted=[200, 100]).rates() == pytest.approx(
        [0.2, 0.1], abs=0.01)
    assert adaptive.DraftPlanner(costs, proposed=[100, 100], accepted=[95, 90]).choose() == 3
    # plain only after plain_after steps
    assert adaptive.DraftPlanner(costs, proposed=[100, 100], accepted=[5, 5]).choose() == 2
    small_vocab_model.__dict__.pop("_draft_counts", None)
    small_vocab_model.__dict__.pop("_step_costs", None)  # from the prior, which drafts
    qmtp.generate(small_vocab_model, [1, 2], max_tokens=12, n_draft="auto")
    ((proposed, accepted),) = small_vocab_model.__dict__["_draft_counts"].values()
    assert len(proposed) == len(accepted) == max(adaptive.WIDTHS) - 1
    assert 0 < proposed[0] and all(0 <= a <= p for a, p in zip(accepted, proposed))
    planner = adaptive.DraftPlanner(costs={n: 1.0 for n in adaptive.WIDTHS}, proposed=proposed, accepted=accepted)
    assert planner.proposed is not proposed  # the next generation counts into a copy


@pytest.mark.parametrize("temperature", [0.0, 0.6, 1.0])
def test_every_drafting_option_keeps_the_trunks_tokens(small_vocab_model, temperature):
    """The engines' choices (the head's cache reset each step, its input before the trunk's final norm, chained
    drafts fed the head's output before its own norm) change the drafts only. Greedy: the tokens are plain
    greedy's. Sampling draws from another random stream than plain sampling, so there the test is only that every
    option decodes and drafts (that rejection sampling keeps the trunk's distribution is tested on its own)."""
    options = [dict(head_cache="reset"), dict(hidden="pre"), dict(chain="pre"),
               dict(head_cache="reset", hidden="pre", chain="pre")]
    for prompt in PROMPTS[:2]:
        plain = qmtp.generate(small_vocab_model, prompt, max_tokens=20, temperature=temperature, seed=3)
        for opts in options:
            for n_draft in (2, 4):
                g = qmtp.generate(small_vocab_model, prompt, max_tokens=20, n_draft=n_draft,
                                  temperature=temperature, seed=3, engine=qmtp.Engine(**opts))
                assert sum(g.stats.drafted) > 0
                if temperature == 0:
                    assert g.tokens == plain.tokens, (opts, n_draft)


def test_a_reset_head_cache_forgets_the_text_and_a_kept_one_does_not(small_vocab_model):
    """With head_cache="reset" the drafts depend on the last position only: garbage in the head's cache changes
    nothing. With the cache kept the same garbage changes the head's distribution."""
    from qmtp import acceptance, decoding

    model = small_vocab_model
    state = decoding.empty_state(model, 64, head=True)
    state["head_offset"] = mx.array([5], mx.int32)
    noisy = dict(state, head=tuple(mx.random.normal(b.shape, key=mx.random.key(i)) for i, b in
                                   enumerate(state["head"])))
    H = model.config.hidden_size
    last = (mx.random.normal((1, 3, H), key=mx.random.key(7)), mx.array([[1, 2, 3]], mx.int32),
            mx.array([2], mx.int32))
    sample = acceptance.Rejection(1.0)
    key = mx.random.key(0)

    def dists(s, cache):
        return np.array(mx.stack(decoding.draft(model, model.mtp, 2, (sample,), (2,), s, last, [key], cache)[1][0]))

    reset = np.abs(dists(state, "reset") - dists(noisy, "reset")).max()
    kept = np.abs(dists(state, "keep") - dists(noisy, "keep")).max()
    assert reset < 1e-6 < 1e-3 < kept, (reset, kept)


def test_the_chain_option_changes_only_the_drafts_after_the_first(small_vocab_model):
    from qmtp import acceptance, decoding

    model = small_vocab_model
    state = decoding.empty_state(model, 64, head=True)
    H = model.config.hidden_size
    last = (mx.random.normal((1, 2, H), key=mx.random.key(1)), mx.array([[1, 2]], mx.int32),
            mx.array([2], mx.int32))
    sample, key = acceptance.Rejection(1.0), mx.random.key(0)
    post = decoding.draft(model, model.mtp, 3, (sample,), (3,), state, last, [key], "keep", "post")[1][0]
    pre = decoding.draft(model, model.mtp, 3, (sample,), (3,), state, last, [key], "keep", "pre")[1][0]
    first = np.abs(np.array(post[0]) - np.array(pre[0])).max()
    second = np.abs(np.array(post[1]) - np.array(pre[1])).max()
    assert first < 1e-6 < 1e-3 < second, (first, second)  # the first draft reads the trunk's state


def test_drafting_options_are_checked(small_vocab_model):
    from qmtp.errors import UsageError

    with pytest.raises(UsageError, match="head_cache"):
        qmtp.generate(small_vocab_model, [1, 2], max_tokens=4, n_draft=2, engine=qmtp.Engine(head_cache="none"))
    with pytest.raises(UsageError, match="chain"):
        qmtp.generate(small_vocab_model, [1, 2], max_tokens=4, n_draft=3, engine=qmtp.Engine(chain="raw"))


def test_pre_and_post_norm_inputs_differ_only_through_the_final_norms_weights(small_vocab_model):
    from qmtp.book import evaluate

    model = small_vocab_model
    measured = evaluate.head_input_agreement(model, PROMPTS[2:4])
    weight = model.norm.weight
    try:
        model.norm.weight = mx.full(weight.shape, 0.7)  # equal weights: the head cannot tell the two apart
        equal = evaluate.head_input_agreement(model, PROMPTS[2:4])
        model.norm.weight = mx.random.uniform(0.1, 3.0, weight.shape, key=mx.random.key(0))
        spread = evaluate.head_input_agreement(model, PROMPTS[2:4])
    finally:
        model.norm.weight = weight
    assert equal["cosine_min"] > 0.9999 and equal["norm_weight_spread"] < 1e-6
    assert spread["cosine"] < 0.99 and spread["norm_weight_spread"] > 0.3
    assert -1 <= measured["cosine_min"] <= measured["cosine"] <= 1


def test_step_costs_price_unmeasured_widths_from_the_measured_ones():
    costs = adaptive.StepCosts(prior_slope=0.5)
    # nothing measured: the prior line, up to a scale (only ratios decide)
    assert costs.prices([1, 2, 3]) == pytest.approx({1: 1.0, 2: 1.5, 3: 2.0})
    costs.observe(2, 0.010)
    assert costs.prices([2, 3]) == pytest.approx({2: 1.5, 3: 2.0})  # one interval is not a measurement yet
    costs.observe(2, 0.010)
    # one width measured: the prior's slope through it
    assert costs.prices([1, 2, 3]) == pytest.approx({1: 0.010 / 1.5, 2: 0.010, 3: 0.010 * 2 / 1.5})
    for seconds in (0.012, 0.012, 0.5):  # width 3, with one slow step: the median ignores it
        costs.observe(3, seconds)
    # two widths measured: the line through them prices the others, plain decoding included
    assert costs.prices([1, 2, 3, 4, 5]) == pytest.approx({1: 0.008, 2: 0.010, 3: 0.012, 4: 0.014, 5: 0.016})
    # a line steepened by noise (width 3 timed in a slow spell): width 1 is priced no lower than half the prior's
    # ratio below width 2 (not free), and the next width up no higher than the prior's slope above width 3 (so
    # that it is tried and timed)
    noisy = adaptive.StepCosts(prior_slope=0.5)
    for n, seconds in ((2, 0.010), (2, 0.010), (3, 0.030), (3, 0.030)):
        noisy.observe(n, seconds)
    assert noisy.prices([1, 4]) == pytest.approx({1: 0.5 * 0.010 / 1.5, 4: 0.030 + 0.5 * 0.010 / 1.5})


def simulated_generation(planner, cost, acceptance, steps, rng):
    """Runs `planner` as the decoding loop would, on a machine where a step at width n takes cost(n) seconds
    (times noise) and every draft is accepted with probability `acceptance`; the widths chosen."""
    widths = []
    for _ in range(steps):
        n = planner.choose()
        accepted = 0
        while accepted < n - 1 and rng.random() < acceptance:
            accepted += 1
        planner.observe(n - 1, accepted)
        if widths and widths[-1] == n:  # the loop times only steps beside steps of their width
            planner.observe_cost(n, cost(n) * rng.uniform(0.8, 1.25))
        widths.append(n)
    return widths


@pytest.mark.parametrize("acceptance, slope", [(0.85, 0.1), (0.85, 0.5), (0.7, 0.3), (0.6, 0.5), (0.3, 0.2),
                                               (0.85, 1.0)])
def test_a_learning_planner_is_within_5_percent_of_the_best_fixed_width(acceptance, slope):
    """From nothing (no cost known, no draft seen), 150 steps on a simulated machine reach, on average, 95% of
    the tokens per second of the best fixed width, exploration included (the best: 5, 3, 3, 2, 2 and plain;
    at (0.6, 0.5) plain decoding is 6% slower than width 2, which noise must not make it give up for)."""

    def cost(n):
        return 0.01 * (1 + slope * (n - 1))

    def tau(n):
        return adaptive.expected_tokens_per_pass([acceptance] * (n - 1))

    best = max(range(1, 6), key=lambda n: tau(n) / cost(n))
    for seed in range(3):
        planner = adaptive.DraftPlanner(learned=adaptive.StepCosts())
        widths = simulated_generation(planner, cost, acceptance, 150, np.random.default_rng(seed))
        achieved = sum(tau(n) for n in widths) / sum(cost(n) for n in widths)
        assert achieved >= 0.95 * tau(best) / cost(best), (best, widths)
        runs = [len(list(g)) for _, g in itertools.groupby(widths)][:-1]  # the last may be cut short
        assert all(r >= planner.run for r in runs)  # a width is kept for a run, so that its steps are timed
    with pytest.raises(ValueError):
        adaptive.DraftPlanner()


def test_auto_times_its_own_steps_and_carries_them(model):
    model.__dict__.pop("_step_costs", None)
    first = qmtp.generate(model, [1, 2, 3], max_tokens=40, n_draft="auto", stop_at_eos=False)
    ((by_rows,),) = [list(model.__dict__["_step_costs"].values())]
    costs = by_rows[1]  # a generation is a batch of one
    timed = {n: len(t) for n, t in costs.samples.items()}
    widths = first.stats.tokens_per_pass
    assert timed and set(timed) <= set(widths)
    # only steps inside a run of their width are timed: fewer than the steps at that width
    assert all(0 < timed[n] < widths.count(n) for n in timed)
    qmtp.generate(model, [3, 2, 1], max_tokens=40, n_draft="auto", stop_at_eos=False)
    assert list(model.__dict__["_step_costs"].values()) == [{1: costs}]  # the second generation went on timing it
    assert costs.timed > sum(timed.values())
