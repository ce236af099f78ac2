"""The training script: quick mode end to end, and resuming gives the same weights as not stopping."""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import qmtp


def run_train(*args):
    result = subprocess.run([sys.executable, "-m", "qmtp.train", *map(str, args)], capture_output=True, text=True)
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
