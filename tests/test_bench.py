"""`python -m qmtp bench decode|mtp` on a small synthetic model: tables printed, JSON written and sensible."""

import json
import math

import mlx.core as mx
import pytest

from conftest import small_config, trunk_logits
import qmtp

from qmtp.book import bench
from qmtp.loading import BUNDLED_MODEL
from qmtp.tiny import synthetic
from qmtp.tokenizer import Tokenizer
from qmtp.cli import main
from qmtp.config import QWEN36_35B_A3B
from qmtp.sizes import sizes


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = small_config(num_experts=16, num_experts_per_tok=4)
    return synthetic.write_checkpoint(tmp_path_factory.mktemp("bench"), config, dtype="BF16", seed=2)


def test_bench_decode_compares_with_mlx_lm(checkpoint, tmp_path, capsys):
    pytest.importorskip("mlx_lm")
    out = tmp_path / "decode.json"
    assert main(["bench", "decode", str(checkpoint), "--max-tokens", "8", "--repeats", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "qmtp/mlx-lm" in printed and "same greedy tokens: yes" in printed
    report = json.loads(out.read_text())
    assert report["same_tokens"] and report["mismatched_prompts"] == []
    assert set(report["engines"]) == {"qmtp", "mlx-lm"}
    for engine in report["engines"].values():
        assert len(engine["rounds"]) == 2
        assert engine["tokens_per_second_min"] <= engine["tokens_per_second"] <= engine["tokens_per_second_max"]
    assert report["ratio_min"] <= report["ratio"] <= report["ratio_max"]
    assert report["dtype"] == "float32"  # bf16 weights computed in float32 on the CPU, by both engines


def test_bench_mtp_reports_unions_per_layer_and_a_cost_model(checkpoint, tmp_path, capsys):
    out = tmp_path / "mtp.json"
    args = ["bench", "mtp", str(checkpoint), "--max-tokens", "12", "--repeats", "1", "--n-draft-max", "3",
            "--prompts", "2", "--json", str(out)]
    assert main(args) == 0
    assert "experts per layer, measured" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["prompts"] == 2  # only the first N: a full-size model is benched on one
    # nothing is timed before auto's first token: it learns the widths' costs as it decodes
    assert 0 < report["auto"]["first_token_seconds"] and report["auto"]["first_token_over_plain"] > 0
    E, k, layers = 16, 4, 4
    assert [r["n_draft"] for r in report["results"]] == [1, 2, 3]
    for r in report["results"]:
        n = r["n_draft"]
        assert r["tokens_in_verify_pass"] == n
        assert len(r["experts_per_layer_measured"]) == layers
        assert all(k <= e <= min(E, n * k) for e in r["experts_per_layer_measured"])
        assert r["experts_per_layer_independent"] == pytest.approx(E * (1 - (1 - k / E) ** n))
        assert len(r["acceptance_per_position"]) == n - 1
        assert r["trunk_bytes_per_pass"] > 0 and r["trunk_seconds_per_pass"] > 0
    assert report["results"][0]["experts_per_layer_measured"] == [k] * layers  # one token: exactly k
    assert report["results"][0]["speedup_vs_plain"] == 1.0
    cost = report["cost_model"]
    assert math.isfinite(cost["loop_overhead"]) and math.isfinite(cost["bytes_intercept"])
    assert [p["n_draft"] for p in cost["predictions"]] == [1, 2, 3]
    assert cost["predictions"][0]["predicted_speedup"] == pytest.approx(1.0)  # plain decoding's own step
    for p in cost["predictions"]:  # the step in the loop is tokens per pass over tokens per second
        r = report["results"][p["n_draft"] - 1]
        assert p["loop_step_seconds"] == pytest.approx(r["tokens_per_trunk_pass"] / r["tokens_per_second"])


def test_bench_decode_refuses_model_and_scaled_together(checkpoint, tmp_path, capsys):
    assert main(["bench", "decode", str(checkpoint), "--scaled", str(tmp_path)]) == 2
    assert "not both" in capsys.readouterr().err


def test_the_scaled_model_has_the_real_layer_widths_and_fits():
    config = QWEN36_35B_A3B.replace(**bench.SCALED_REAL_WIDTHS)
    for field in ("hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts_per_tok",
                  "head_dim", "num_attention_heads", "num_key_value_heads", "linear_num_value_heads"):
        assert getattr(config, field) == getattr(QWEN36_35B_A3B, field)
    assert config.num_hidden_layers < 40 and config.num_experts < 256 and config.vocab_size < 248_320
    assert config.layer_types.count("full_attention") >= 1 and config.layer_types.count("linear_attention") >= 1
    assert sizes(config, bench.SCALED_BITS).total_bytes < 1.5e9
    assert sizes(config, 16, mtp_bits=None, router_bits=16).total_bytes < 3e9  # the bf16 source


def test_bench_convert_times_three_tools_on_the_same_source(tmp_path, capsys):
    pytest.importorskip("mlx_lm")
    from qmtp.book import bench_convert

    # the source carries the bundled tokenizer: the vocabulary holds its ids, chat tokens included
    vocab = Tokenizer.from_dir(BUNDLED_MODEL).vocab_size
    config = small_config(num_experts=16, num_experts_per_tok=4, hidden_size=64, vocab_size=vocab)
    report = bench_convert.run(tmp_path / "work", bits=4, rounds=1, config=config, progress=lambda line: None)
    assert set(report["tools"]) == {"cp", "qmtp", "mlx-lm"}
    source = report["source_bytes"]
    cp, qmtp, mlx_lm = (report["tools"][t] for t in ("cp", "qmtp", "mlx-lm"))
    assert cp["output_bytes"] >= source  # a copy of everything
    # 4-bit trunk + bf16 head, against mlx-lm's 4-bit trunk alone: smaller than the source, larger than mlx-lm's
    assert mlx_lm["output_bytes"] < qmtp["output_bytes"] < source
    for t in report["tools"].values():
        assert t["seconds"] > 0 and t["peak_rss_bytes"] >= 1e6
    assert report["qmtp_time_over_cp"] == pytest.approx(qmtp["seconds"] / cp["seconds"])
    assert not list((tmp_path / "work").glob("out-*"))  # outputs removed, the source kept for reuse
    again = bench_convert.run(tmp_path / "work", bits=4, rounds=1, config=config, progress=lambda line: None)
    assert again["source_bytes"] == source
    printed = bench_convert.table(report)
    assert "| qmtp |" in printed and "| mlx-lm |" in printed and "time / cp" in printed


def test_bench_convert_source_reaches_the_size_asked_for():
    from qmtp.book import bench_convert
    from qmtp.errors import UsageError
    from qmtp.sizes import UNQUANTIZED

    config = bench_convert.source_config(4.0)
    assert sizes(config, bits=UNQUANTIZED).total_bytes >= 4e9
    assert sizes(config.replace(num_experts=config.num_experts - 8), bits=UNQUANTIZED).total_bytes < 4e9
    assert config.hidden_size == QWEN36_35B_A3B.hidden_size
    with pytest.raises(UsageError, match="at most"):
        bench_convert.source_config(100)
    for bad in (dict(rounds=0), dict(gb=0), dict(gb=float("nan"))):
        with pytest.raises(UsageError):
            bench_convert.run(**bad)


def test_the_real_width_model_is_built_as_a_conversion_loads_and_routes_tokens_apart():
    from qmtp.moe import QuantizedStackedLinear

    model = bench.real_width_model(layers=4, hidden_size=256, moe_intermediate_size=64,
                                   shared_expert_intermediate_size=64, num_experts=16, vocab_size=1024,
                                   linear_num_key_heads=2, linear_num_value_heads=4, num_attention_heads=4,
                                   num_key_value_heads=1)
    assert isinstance(model.layers[0].mlp.experts.gate_proj, QuantizedStackedLinear)
    assert model.layers[0].mlp.experts.gate_proj.bits == 4
    assert model.layers[0].mlp.gate.bits == 8  # the router, as convert writes it
    assert model.mtp.layers[0].mlp.experts.gate_proj.weight.dtype == mx.bfloat16  # the head as stored
    assert model.dtype == mx.float32
    assert mx.isfinite(trunk_logits(model, mx.array([list(range(1, 9))]))).all().item()
    x = model.embed(mx.array([list(range(1, 9))]))
    first_choice = mx.argmax(model.layers[0].mlp.gate(model.layers[0].post_attention_layernorm(x)), axis=-1)
    assert len(set(first_choice.tolist()[0])) > 1  # seeded routers: tokens do not all go to one expert

    report = bench.real_width_passes(model, list(range(1, 9)), n_drafts=(2, 3), budget=0.05)
    rows = {r["pass"]: r for r in report["rows"]}
    assert list(rows) == ["plain, 1 token", "verify, 2 tokens", "verify, 3 tokens", "head draft"]
    assert rows["plain, 1 token"]["time_over_plain"] == 1 and rows["plain, 1 token"]["bytes_over_plain"] == 1
    assert 1 < rows["verify, 2 tokens"]["bytes_over_plain"] < rows["verify, 3 tokens"]["bytes_over_plain"]
    assert all(r["seconds"] > 0 for r in rows.values())
    assert report["layers"] == 4 and report["experts"] == 16


def test_mlx_lm_twin_runs_our_arrays_in_mlx_lm_with_the_same_tokens(checkpoint):
    """mlx-lm's model over qmtp's own arrays, float and quantized: the same greedy tokens as qmtp, and the arrays
    the same codes."""
    model = qmtp.load(checkpoint)
    twin = bench.mlx_lm_twin(model)
    report = bench.decode(model, [[1, 2, 3, 4, 5]], max_tokens=8, repeats=1, reference=twin)
    assert report["same_tokens"]
    quantized = bench.real_width_model(layers=4, hidden_size=256, moe_intermediate_size=64,
                                       shared_expert_intermediate_size=64, num_experts=16, vocab_size=1024,
                                       linear_num_key_heads=2, linear_num_value_heads=4, num_attention_heads=4,
                                       num_key_value_heads=1)
    twin = bench.mlx_lm_twin(quantized)
    assert twin.language_model.model.layers[0].mlp.switch_mlp.gate_proj.bits == 4
    assert twin.language_model.model.layers[0].mlp.switch_mlp.gate_proj.weight is not None
    assert bench.decode(quantized, [list(range(1, 9))], max_tokens=6, repeats=1, reference=twin)["same_tokens"]
    ours = quantized.layers[0].mlp.experts.gate_proj.weight
    assert mx.array_equal(twin.language_model.model.layers[0].mlp.switch_mlp.gate_proj.weight, ours)


def test_lean_loop_effects_split_the_ablation_into_its_halves():
    ablation = [
        {"loop": "not queued ahead", "n_draft": 1, "over_lean": 0.8},
        {"loop": "eager, not queued ahead", "n_draft": 1, "over_lean": 0.5},
        {"loop": "not queued ahead", "n_draft": 4, "over_lean": 1.25},
        {"loop": "eager, not queued ahead", "n_draft": 4, "over_lean": 1.0},
    ]
    effects = bench.lean_loop_effects(ablation)
    assert effects[1] == pytest.approx({"trace": 1.6, "queue ahead": 1.25, "both": 2.0})
    assert effects[4] == pytest.approx({"trace": 1.25, "queue ahead": 0.8, "both": 1.0})


@pytest.mark.parametrize("ratio, word", [(1.2, "faster"), (0.8, "slower"), (1.03, "no difference")])
def test_effect_phrase_follows_the_ratio(ratio, word):
    phrase = bench.effect_phrase("the trace", ratio)
    assert word in phrase and f"{ratio:.2f}x" in phrase


def test_interleaved_pass_costs_times_every_width_in_the_same_rounds(checkpoint, monkeypatch):
    model = qmtp.load(checkpoint)
    prompt = [1, 2, 3, 4, 5]
    clock_reads = []
    real_clock = bench.time.perf_counter
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock_reads.append(1) or real_clock())
    costs = bench.interleaved_pass_costs(model, prompt, (1, 2, 3), rounds=4, budget=1e9, warm=2)
    assert list(costs) == [1, 2, 3]
    assert set(costs[1]) == {"verify", "rounds"}  # a plain pass drafts nothing
    assert all(set(costs[n]) == {"verify", "rounds", "head_per_draft"} for n in (2, 3))
    assert [costs[n]["rounds"] for n in costs] == [4, 4, 4]  # the budget never ran out: every round ran
    assert all(c["verify"] > 0 for c in costs.values()) and all(costs[n]["head_per_draft"] > 0 for n in (2, 3))
    shapes = 5  # verify at 1, 2, 3; drafts at 2, 3
    assert len(clock_reads) == 2 * shapes * (2 + 4)  # each shape: 2 warm-up calls and one call per round
    spent = bench.interleaved_pass_costs(model, prompt, (1, 2), rounds=50, budget=0.0, warm=1)
    assert [c["rounds"] for c in spent.values()] == [3, 3]  # no budget left: the three rounds every median needs
    assert bench.pass_costs(model, prompt, 2, repeats=3, budget=1e9)["rounds"] == 3  # one width, timed alone
