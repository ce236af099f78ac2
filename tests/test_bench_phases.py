"""A step's time in bench.mtp covers the loop's phases measured over the same runs (chapter 7's table: its "queue"
column once exceeded its "step" one, a median speed set beside phase totals over every round)."""

import pytest

from conftest import small_config
import qmtp
from qmtp.book import bench
from qmtp.tiny import synthetic


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    config = small_config(num_experts=16, num_experts_per_tok=4)
    return qmtp.load(synthetic.write_checkpoint(tmp_path_factory.mktemp("phases"), config, dtype="BF16", seed=2))


def test_the_mean_step_bounds_its_phases(model):
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8]]
    report = bench.mtp(model, prompts, max_tokens=10, n_drafts=(1, 2), repeats=3)
    for r in report["results"]:
        phases = sum(r["phase_seconds_per_pass"].values())
        assert 0 < phases <= r["step_seconds_mean"], r["n_draft"]


def test_lm_head_is_timed_whole_and_as_qmtp_runs_it(model):
    timed = bench.lm_head_seconds(model, repeats=2)
    assert timed["split"] > 0 and timed["whole"] > 0
    assert timed["blocks"] == (1 if model._lm_head_split is None else len(model._lm_head_split.blocks))
