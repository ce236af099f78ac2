"""The training script: quick mode end to end, resuming gives the same weights as not stopping (both stages), and
the head-only stage's unrolled chain computes what drafting does."""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from conftest import mtp_logits
import qmtp
from qmtp.book import evaluate
from qmtp.tiny import train


def run_train(*args):
    result = subprocess.run([sys.executable, "-m", "qmtp.tiny.train", *map(str, args)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def final_weights(out):
    state = json.loads((out / "latest.json").read_text())["state"]
    return mx.load(str(out / state / "weights.safetensors"))


@pytest.mark.slow
def test_quick_training_resumes_exactly_and_exports_a_loadable_model(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_train(straight, "--quick", "--steps", 6, "--save-every", 3, "--export", straight / "export")
    first = run_train(resumed, "--quick", "--steps", 6, "--stop-after", 4, "--export", resumed / "export")
    assert "run the same command again to resume" in first.stdout
    assert not (resumed / "export").exists()
    second = run_train(resumed, "--quick", "--steps", 6, "--export", resumed / "export")
    assert "resuming from step 4" in second.stdout
    a, b = final_weights(straight), final_weights(resumed)
    assert a.keys() == b.keys()
    assert all(np.array_equal(np.array(a[k]), np.array(b[k])) for k in a)

    curve = json.loads((straight / "loss_curve.json").read_text())
    assert [r["step"] for r in curve] == list(range(1, 7))
    assert curve[-1]["trunk"] < curve[0]["trunk"]

    model = qmtp.load(straight / "export")
    assert model.fixes_applied == ("norm", "conv")
    assert model.mtp is not None and model.mtp.has_routed_experts
    stored = qmtp.Checkpoint(straight / "export")
    assert stored.infos["model.language_model.layers.0.linear_attn.conv1d.weight"].shape[1] == 1  # [C, 1, K]
    assert stored.infos["model.language_model.norm.weight"].dtype == "BF16"
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in stored
    # The export holds the trained weights: the norm stored as (effective - 1).
    trained = np.array(a["norm.weight"].astype(mx.float32))
    shipped = np.array(stored.load("model.language_model.norm.weight").astype(mx.float32))
    assert np.allclose(shipped + 1.0, trained, atol=1e-2)
    assert qmtp.generate(model, "Once upon a time", max_tokens=5, n_draft=2).stats.generated == 5


@pytest.mark.slow
def test_head_only_training_resumes_exactly_and_leaves_the_trunk_alone(tmp_path):
    base = tmp_path / "base"
    run_train(base, "--quick", "--steps", 2, "--export", base / "export")
    source = base / "export"
    common = ["--head-only", "--from", source, "--chained", 2, "--steps", 4, "--documents", 3000, "--length", 64]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_train(straight, *common, "--save-every", 2, "--export", straight / "export")
    first = run_train(resumed, *common, "--stop-after", 3, "--export", resumed / "export")
    assert "run the same command again to resume" in first.stdout
    second = run_train(resumed, *common, "--export", resumed / "export")
    assert "resuming from step 3" in second.stdout
    a, b = final_weights(straight), final_weights(resumed)
    assert a.keys() == b.keys() and all(k.startswith(("layers.0.", "fc.", "pre_fc_norm", "norm.")) for k in a)
    assert all(np.array_equal(np.array(a[k]), np.array(b[k])) for k in a)

    curve = json.loads((straight / "head_loss_curve.json").read_text())
    assert [r["step"] for r in curve] == [1, 2, 3, 4]
    assert {"head_1", "head_2", "head_3", "heldout_agree_4"} <= set(curve[-1])

    before, after = qmtp.Checkpoint(source), qmtp.Checkpoint(straight / "export")
    assert before.names() == after.names()
    trunk = [n for n in before.names() if not n.startswith("mtp.")]
    assert all(mx.array_equal(before.load(n), after.load(n)).item() for n in trunk)
    assert not all(mx.array_equal(before.load(n), after.load(n)).item() for n in before.names() if n.startswith("mtp."))
    # The export keeps the head it started from, loadable as a drafter for the new model.
    old, new = qmtp.load(source), qmtp.load(straight / "export")
    kept = evaluate.previous_head(new)
    tokens = mx.array([list(range(3, 20))])
    assert np.array_equal(np.array(mtp_logits(old, tokens)),
                          np.array(new.logits(kept(new.trunk(tokens)[1][:, :-1], new.embed_tokens(tokens[:, 1:])))))


def test_head_only_refuses_unknown_targets(tmp_path):
    result = subprocess.run([sys.executable, "-m", "qmtp.tiny.train", str(tmp_path / "x"), "--head-only", "--targets", "soft"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "--targets soft" in result.stderr


def test_chained_unroll_is_what_drafting_with_a_cache_computes():
    """Step j of the teacher-forced unroll at position t + j - 1 equals the j-th draft of a decode step that
    started at t: the head's layer stepped position by position over its KV buffers, true states up to t, then
    its own outputs (the drafts' tokens taken as the true ones, as when the earlier drafts are accepted)."""
    model = qmtp.load()
    rows = mx.array(evaluate._windows(model, evaluate.heldout_texts(1), 48)[:2])
    inputs = rows[:, :-1]
    _, h = model.trunk(inputs)
    embedded = model.embed_tokens(inputs[:, 1:])
    states = train.chained_head_states(model.mtp, h[:, :-1], embedded, 4)
    assert np.array_equal(np.array(states[0]), np.array(model.head_states(h, inputs)))
    head = model.mtp

    def head_step(hidden, next_embedding, buffers, offset):
        z, buffers, _, _ = head.layers[0].step(head.combine(hidden, next_embedding), buffers, mx.array(offset, mx.int32))
        return head.norm(z), buffers

    for t in (0, 7, 40):
        buffers = head.layers[0].empty_state(h.shape[0], t + 5, model.dtype)
        z, buffers = head_step(h[:, : t + 1], embedded[:, : t + 1], buffers, 0)
        z = z[:, -1:]
        drafted = [z]
        for j in range(2, 5):
            z, buffers = head_step(z, embedded[:, t + j - 1: t + j], buffers, t + j - 1)
            drafted.append(z)
        for j, z in enumerate(drafted, start=1):
            np.testing.assert_allclose(np.array(z[:, 0]), np.array(states[j - 1][:, t + j - 1]), atol=1e-5)


def test_chain_mask_reads_one_entry_per_earlier_position():
    for depth in (1, 2, 4):
        mask = train.chain_mask(10, depth).reshape(10, depth, 10)
        assert (mask.sum(axis=(1, 2)) == np.arange(1, 11)).all()  # query q reads positions 0..q, once each
        assert mask.any(axis=1).sum(axis=1).tolist() == list(range(1, 11))
        assert mask[9, depth - 1, 9] and (depth == 1 or not mask[9, 0, 9])  # its own step at its own position
