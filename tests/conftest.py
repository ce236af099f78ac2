"""Shared by the test files (`from conftest import ...`): a config of the real architecture at toy widths, its
random weights as a checkpoint stores them, and the model run over whole sequences by the decoding path
(`qmtp.decoding.trunk_step`), which is how the tests compare it with references and with itself. It imports MLX
and qmtp only inside its functions: every test session loads it, those of tests that need neither too."""

from __future__ import annotations


def small_config(**overrides):
    """A config of the real architecture at toy widths: 4 layers (3 linear + 1 full), 8 experts top-2."""
    from qmtp.config import ModelConfig

    values = dict(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        rope_theta=10_000.0,
        partial_rotary_factor=0.25,
        max_position_embeddings=4096,
    )
    values.update(overrides)
    return ModelConfig(**values)


def random_weights(config, seed: int = 0, head: bool = True) -> dict:
    """All internal tensors (as stored: zero-centred norms, [C, 1, K] conv) in float32, the values
    `qmtp.tiny.synthetic.write_checkpoint` writes with the same seed."""
    from qmtp.layout import expected_shapes
    from qmtp.tiny.synthetic import stored_value

    return {n: stored_value(n, s, seed) for n, s in expected_shapes(config, head=head).items()}


# ---- the model over whole sequences, by the decoding path ------------------------------------------------------
def trunk_state(model, batch: int, capacity: int) -> dict:
    """The trunk's decoding state with no past, for `batch` rows at the same position (`decoding.empty_state`
    is the one-row case) and KV buffers of `capacity` positions."""
    import mlx.core as mx

    return {"layers": [layer.empty_state(batch, capacity, model.dtype) for layer in model.layers],
            "offset": mx.array(0, mx.int32)}


def run_trunk(model, tokens, state: dict | None = None):
    """The trunk over tokens [B, T] after the positions `state` holds (none if None): (its output before and
    after the final norm, both [B, T, H], the state holding tokens too)."""
    from qmtp import decoding

    if state is None:
        state = trunk_state(model, tokens.shape[0], tokens.shape[1])
    pre, post, _, layers = decoding.trunk_step(model, tokens, state, record=False)
    return pre, post, {"layers": layers, "offset": state["offset"] + tokens.shape[1]}


def trunk_logits(model, tokens):
    """The trunk's logits [B, T, vocab] over tokens [B, T] from no past."""
    return model.logits(run_trunk(model, tokens)[1])


def mtp_logits(model, tokens):
    """The head's teacher-forced logits [B, T-1, vocab]: position t from the trunk's h_t (after the final norm)
    and x_{t+1}, predicting x_{t+2}."""
    return model.logits(model.head_states(run_trunk(model, tokens)[1], tokens))


# ---- property-based tests: one budget and seed rule for every fuzz file ----------------------------------------
def fuzz(default_examples: int):
    """Hypothesis settings for one property: `default_examples`, or QMTP_FUZZ_EXAMPLES when that is set;
    derandomized (the same source tree gives the same examples) unless QMTP_FUZZ_SEED picks another stream."""
    import os

    from hypothesis import HealthCheck, seed, settings

    examples = int(os.environ.get("QMTP_FUZZ_EXAMPLES", "0") or 0)
    chosen = os.environ.get("QMTP_FUZZ_SEED")

    def wrap(test):
        configured = settings(
            max_examples=examples or default_examples,
            deadline=None,  # a loaded 2-core machine makes per-example timings meaningless
            derandomize=chosen is None,
            database=None,  # no failing examples saved to or replayed from .hypothesis/
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
            print_blob=True,
        )(test)
        return seed(int(chosen))(configured) if chosen is not None else configured

    return wrap


def event(what: str) -> None:
    """Count an outcome for --hypothesis-show-statistics (a no-op outside a property, in plain tests)."""
    from hypothesis import currently_in_test_context
    from hypothesis import event as count

    if currently_in_test_context():
        count(what)


def decode_planned(model, prompt, planner, rollback: str = "record", **settings):
    """`prompt` decoded as a batch of one whose "auto" widths `planner` (a `qmtp.adaptive.DraftPlanner`) chooses:
    every switch of width the engine can make, as a test scripts it. `settings`: `qmtp.Settings.of`'s."""
    import qmtp
    from qmtp.continuous import ContinuousBatch

    batch = ContinuousBatch(model, max_batch=1, engine=qmtp.Engine(rollback=rollback), cache_entries=0,
                            planner=planner)
    request = batch.submit(list(prompt), qmtp.Settings.of(n_draft="auto", stop_at_eos=False, **settings))
    while batch.step():
        pass
    if request.error is not None:
        raise request.error
    return request.generation()
