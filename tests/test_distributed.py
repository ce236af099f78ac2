"""Expert parallelism (qmtp.parallel) on two ranks of MLX's ring backend on localhost, started by mlx.launch.

Each test starts the ranks as a subprocess (`qmtp.launch.run`, bounded in time: a hang fails the test, it does
not stall the suite); tests/ep_worker.py is what each rank runs, and it writes what it found to a JSON file.
"""

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import qmtp
from qmtp import launch
from qmtp.loading import BUNDLED_MODEL

WORKER = str(Path(__file__).with_name("ep_worker.py"))
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def ranks_import_this_checkout():
    """The ranks (started with this environment) import the qmtp under test, not another installed one."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(REPO)
    yield
    if before is None:
        del os.environ["PYTHONPATH"]
    else:
        os.environ["PYTHONPATH"] = before
PROMPT, MAX_TOKENS, SEED = "Once upon a time", 24, 3


def run_ranks(ranks: int, *args, timeout: float = 120) -> tuple[int, str, list[dict]]:
    out_dir = Path(args[1])
    out, err = io.StringIO(), io.StringIO()
    code = launch.run([WORKER, *map(str, args)], ranks=ranks, timeout=timeout, out=out, err=err)
    found = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(ranks)
             if (out_dir / f"rank{r}.json").exists()]
    return code, out.getvalue() + err.getvalue(), found


@pytest.fixture(scope="module", params=["bundled", "4-bit"])
def model_path(request, tmp_path_factory):
    """The bundled model, and its qmtp conversion to 4 bits (head too: quantized expert stacks are split as well)."""
    if request.param == "bundled":
        return BUNDLED_MODEL
    from qmtp.convert import convert

    dst = tmp_path_factory.mktemp("q4") / "tiny-4bit"
    convert(BUNDLED_MODEL, dst, bits=4, mtp_bits=4, progress=False)
    return dst


@pytest.fixture(scope="module")
def two_ranks(model_path, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("ep")
    code, output, found = run_ranks(2, "decode", out_dir, model_path, timeout=400)
    assert code == 0 and len(found) == 2, output[-3000:]
    return found


@pytest.mark.slow
def test_each_rank_holds_half_of_the_experts(two_ranks, model_path):
    E = qmtp.load(model_path, tokenizer=False).config.num_experts
    for found in two_ranks:
        assert found["held"][0] == E // 2


@pytest.mark.slow
def test_every_moe_layer_equals_the_single_process_bit_for_bit(two_ranks):
    for found in two_ranks:
        for tokens, equal in found["moe_equal"].items():
            assert all(equal), f"rank {found['rank']}, {tokens} tokens: layers differing {equal}"


@pytest.mark.slow
def test_two_ranks_generate_the_single_process_tokens(two_ranks, model_path):
    whole = qmtp.load(model_path)  # this pytest process: one process, no group
    for n_draft in (1, 2, 3, 4, 5):
        for temperature in (0.0, 0.8):
            alone = qmtp.generate(whole, PROMPT, max_tokens=MAX_TOKENS, n_draft=n_draft, temperature=temperature,
                                  seed=SEED).tokens
            for found in two_ranks:
                assert found["tokens"][f"{n_draft}/{temperature}"] == alone, (n_draft, temperature, found["rank"])
    # greedy decoding emits the plain tokens whatever widths "auto" chose
    plain = qmtp.generate(whole, PROMPT, max_tokens=MAX_TOKENS, n_draft=1).tokens
    for found in two_ranks:
        assert found["tokens"]["auto/0.0"] == plain


@pytest.mark.slow
def test_auto_width_is_decided_once_for_every_rank(two_ranks):
    rank0, rank1 = two_ranks
    for temperature in ("0.0", "0.8"):
        assert rank0[f"auto_widths/{temperature}"] == rank1[f"auto_widths/{temperature}"]
        assert rank0[f"tokens"][f"auto/{temperature}"] == rank1["tokens"][f"auto/{temperature}"]
        # both planners learned the same costs (rank 0's timings): the same widths follow from the same tokens
        assert rank0[f"auto_costs/{temperature}"] == rank1[f"auto_costs/{temperature}"]
        assert rank0[f"auto_costs/{temperature}"] and rank0[f"auto_costs/{temperature}"][0]


@pytest.mark.slow
def test_two_ranks_hold_a_conversation_as_one_process(two_ranks, model_path):
    """Each turn resumes the kept state on every rank alike, and equals one process's fresh run (turn n is seeded
    with SEED + n)."""
    whole = qmtp.load(model_path)
    for temperature in (0.0, 0.8):
        rank0, rank1 = (found[f"conversation/{temperature}"] for found in two_ranks)
        assert rank0 == rank1
        for turn, found in enumerate(rank0):
            alone = qmtp.generate(whole, found["prompt"], max_tokens=MAX_TOKENS, n_draft=3, temperature=temperature,
                                  seed=SEED + turn)
            assert found["tokens"] == alone.tokens, (temperature, turn)
            assert found["prefilled"] < len(found["prompt"]) if turn else found["prefilled"] == len(found["prompt"])


def _copy_bundled(where: Path) -> Path:
    dst = where / "tiny"
    shutil.copytree(BUNDLED_MODEL, dst)
    return dst


def test_experts_that_do_not_split_evenly_are_an_error_on_every_rank(tmp_path):
    # the bundled model has 256 experts per layer: 3 ranks cannot hold equal blocks
    code, output, found = run_ranks(3, "load", tmp_path, BUNDLED_MODEL, BUNDLED_MODEL, BUNDLED_MODEL, timeout=90)
    assert code == 0 and len(found) == 3, output[-3000:]
    messages = {f["error"] for f in found}
    assert len(messages) == 1, messages
    (message,) = messages
    assert message is not None and "256 routed experts" in message and "3 ranks" in message


def test_ranks_that_opened_different_checkpoints_all_refuse(tmp_path):
    other = _copy_bundled(tmp_path)
    config = json.loads((other / "config.json").read_text())
    config["text_config"]["rms_norm_eps"] = 1e-5  # same tensors, another model
    (other / "config.json").write_text(json.dumps(config))
    code, output, found = run_ranks(2, "load", tmp_path, BUNDLED_MODEL, other, timeout=90)
    assert code == 0 and len(found) == 2, output[-3000:]
    for f in found:
        assert f["error"] is not None and "did not open the same checkpoint" in f["error"] and "rank 1" in f["error"]


def test_ranks_that_opened_the_same_checkpoint_load(tmp_path):
    code, output, found = run_ranks(2, "load", tmp_path, BUNDLED_MODEL, _copy_bundled(tmp_path), timeout=90)
    assert code == 0 and [f["error"] for f in found] == [None, None], output[-3000:]


def test_a_rank_that_dies_ends_the_others_with_one_line(tmp_path):
    script = tmp_path / "die.py"
    script.write_text(
        "import sys, time\nimport mlx.core as mx\n"
        "g = mx.distributed.init(strict=True)\n"
        "mx.eval(mx.distributed.all_sum(mx.ones(4), group=g))\n"
        "if g.rank() == 1:\n    sys.exit(3)\n"
        "mx.eval(mx.distributed.all_sum(mx.ones(4), group=g))\n"  # rank 0 waits on rank 1, which is gone
        "time.sleep(600)\n")
    out, err = io.StringIO(), io.StringIO()
    code = launch.run([str(script)], ranks=2, timeout=60, out=out, err=err)
    assert code != 0 and code != 124, err.getvalue()
    lines = [line for line in err.getvalue().splitlines() if line.startswith("qmtp: error:")]
    # rank 0, waiting on rank 1, fails too ("connection to a peer was lost"); whichever the launcher sees first, it
    # stops the other, sometimes before rank 1's own exit status is in (then "code -15"): every failed rank is named
    assert len(lines) == 1 and "rank 1 exited with code" in lines[0], err.getvalue()


def test_a_rank_that_hangs_is_ended_at_the_timeout(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import time\nimport mlx.core as mx\ng = mx.distributed.init(strict=True)\ntime.sleep(600)\n")
    err = io.StringIO()
    code = launch.run([str(script)], ranks=2, timeout=8, out=io.StringIO(), err=err)
    assert code == 124 and "did not finish within 8 s" in err.getvalue()


def chat(*argv, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qmtp", "chat", *argv], input=stdin, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONPATH=str(REPO)))


def test_chat_on_ranks_that_cannot_split_the_experts_says_so_in_one_line():
    done = chat("--raw", "--max-tokens", "4", "--ranks", "3", "--prompt", "The dog", "--timeout", "120")
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("qmtp: error: ") and "do not split evenly over 3 ranks" in lines[0]


@pytest.mark.slow
def test_chat_on_two_ranks_prints_the_single_process_text_once():
    args = ("--raw", "--use-mtp", "--n-draft", "3", "--max-tokens", "20")  # the bundled model has no template
    prompts = "Once upon a time\nThe dog\n"
    alone = chat(*args, stdin=prompts)
    ranked = chat(*args, "--ranks", "2", "--timeout", "240", stdin=prompts)
    assert alone.returncode == 0 and ranked.returncode == 0, ranked.stderr
    # rank 0 read the prompts and sent them to rank 1; only rank 0 printed, the single process's text
    assert ranked.stdout == alone.stdout and ranked.stdout.count("Once upon a time") == 1
    assert ranked.stderr.count("tokens per trunk pass") == 2, ranked.stderr


@pytest.mark.slow
def test_templated_chat_on_two_ranks_prints_the_single_process_conversation(tmp_path):
    """The interactive chat keeps its Conversation on every rank: rank 0 reads the turns, each rank resumes its
    own kept state, and rank 0 prints what one process prints."""
    from test_chat import model_dir

    args = (model_dir(tmp_path / "templated"), "--thinking=false", "--use-mtp", "--n-draft", "3", "--max-tokens", "12")
    prompts = "Tell me about foxes.\nAnd rabbits?\n/reset\nTell me about foxes.\n"
    alone = chat(*map(str, args), stdin=prompts)
    ranked = chat(*map(str, args), "--ranks", "2", "--timeout", "240", stdin=prompts)
    assert alone.returncode == 0 and ranked.returncode == 0, ranked.stderr
    assert ranked.stdout == alone.stdout
    assert ranked.stderr.count("kept from the last turn") == alone.stderr.count("kept from the last turn") == 1


def test_a_rank_that_cannot_open_its_checkpoint_ends_the_group(tmp_path):
    # rank 1 fails before the ranks compare checkpoints; rank 0, waiting for it in that collective, is stopped, or
    # (when rank 1 was gone before it got there: MLX's ring then reads zeros) names rank 1 as gone, never as another model
    code, output, found = run_ranks(2, "load", tmp_path, BUNDLED_MODEL, tmp_path / "absent", timeout=90)
    assert code not in (0, 124), output[-3000:]
    assert found == [] or [f["error"] for f in found] == ["rank 1 did not take part in comparing checkpoint files "
                                                          "(it stopped?)"], found
    assert "no such model directory" in output
    assert output.count("qmtp: error:") == 1 and "rank 1 exited with code" in output, output


@pytest.mark.slow
def test_bench_mtp_on_two_ranks_is_lossless_and_written_by_rank_0(tmp_path):
    report = tmp_path / "mtp.json"
    done = subprocess.run([sys.executable, "-m", "qmtp", "bench", "mtp", "--prompts", "1", "--max-tokens", "12",
                           "--repeats", "1", "--n-draft-max", "2", "--ranks", "2", "--timeout", "280",
                           "--json", str(report)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(report.read_text())["results"]
    assert [r["n_draft"] for r in results] == [1, 2] and all(r["same_tokens_as_plain"] for r in results)
    assert done.stdout.count("n_draft   tok/s") == 1  # one table: rank 1 printed nothing


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_per_rank_bytes_are_the_bytes_a_rank_holds(ranks):
    from types import SimpleNamespace

    import mlx.core as mx

    from qmtp import parallel, sizes
    from qmtp.config import ModelConfig
    from qmtp.loading import loaded_bytes
    from qmtp.model import Model

    config = ModelConfig.from_file(BUNDLED_MODEL)
    report = sizes.sizes(config, bits=sizes.UNQUANTIZED, mtp_bits=None, router_bits=sizes.UNQUANTIZED,
                         dtype_bytes=4)
    model = Model(config)  # placeholders only: nothing is read or allocated
    if ranks > 1:
        parallel.hold_experts(model, SimpleNamespace(held=config.num_experts // ranks))
    assert loaded_bytes(model, mx.float32) == sizes.per_rank_bytes(report, ranks)
