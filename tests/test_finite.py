"""Non-finite weights (issue 25, class 3): caught while decoding, at load, by convert and by doctor.

Every case is a copy of the bundled model with one value overwritten by NaN or Inf in place:

* a NaN in the embedding row of a token the model writes later used to end the text there with exit 0 (the NaN
  logits' argmax is the end-of-text id): every decoding step now checks the trunk's logits on the device, in
  the read that brings its tokens, and `generate` stops with one line naming the position and the token;
* a NaN in the MTP head makes every draft an arbitrary token, which verification rejects: the output stays the
  trunk's, and the drafts are counted (`Stats.nonfinite_drafts`, printed by chat);
* the small tensors in which one value changes every token (norms, A_log, dt_bias, conv kernels, routers) are
  refused by `load`, naming the tensor (an infinite A_log used to give a different, finite story);
* `convert` refuses a source tensor holding NaN or Inf (quantized, it would hide in a group), leaving nothing;
* `doctor` names a damaged norm, where it used to blame the fixes record of a conversion.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import helpers
import qmtp
from helpers import expect
from qmtp.checkpoint import Checkpoint
from qmtp.errors import NonFiniteLogitsError, NonFiniteWeightError
from qmtp.loading import BUNDLED_MODEL

REPO = Path(__file__).resolve().parents[1]
P = "model.language_model."  # the bundled model's trunk prefix
PROMPT = "Once upon a time"
NAN, INF = float("nan"), float("inf")


def run(*argv) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("QMTP_MODEL", None)
    return subprocess.run([sys.executable, "-m", "qmtp", *map(str, argv)], capture_output=True, text=True, env=env,
                          timeout=300)


def one_line_error(result, *fragments) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, (result.returncode, result.stdout[-300:], result.stderr)
    return helpers.one_line_error(result.stderr, *fragments)


def poke(path: Path, name: str, value: float, element: int = 3) -> None:
    """Overwrite element `element` of stored tensor `name` (BF16 or F32) in place."""
    info = Checkpoint(path).infos[name]
    if info.dtype == "BF16":
        raw = (np.array([value], np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    else:
        assert info.dtype == "F32", info.dtype
        raw = np.array([value], np.float32).tobytes()
    with open(info.file, "r+b") as f:
        f.seek(info.offset + len(raw) * element)
        f.write(raw)


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    """damaged(name, {tensor: (value, element)}): a copy of the bundled model with those values overwritten."""
    root = tmp_path_factory.mktemp("finite")

    def make(name, pokes):
        path = root / name
        shutil.copytree(BUNDLED_MODEL, path, ignore=shutil.ignore_patterns("previous_head", "*.png", "*.md"))
        for tensor, (value, element) in pokes.items():
            poke(path, tensor, value, element)
        return path

    return make


@pytest.fixture(scope="module")
def good():
    return qmtp.load()


# ---- decoding: every step's trunk logits are checked -------------------------------------------------------------
def later_token(model, n_draft, temperature, prompt_tokens, skip=4):
    """(index, token) of a generated token after the first `skip` that neither the prompt nor the text before
    it holds: with its embedding row damaged, decoding runs as before until that token is fed back."""
    tokens = qmtp.generate(model, PROMPT, max_tokens=30, n_draft=n_draft, temperature=temperature).tokens
    eos = model.tokenizer.eos_id
    for i in range(skip, len(tokens) - 1):
        t = tokens[i]
        if t != eos and t not in prompt_tokens and t not in tokens[:i]:
            return i, t
    raise AssertionError(f"no fresh token in {tokens}")


@pytest.mark.parametrize("n_draft", [1, 2, 3, 5, "auto"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_embedding_of_a_later_token_stops_generation(good, damaged, n_draft, temperature):
    """It used to end the text early with exit 0; now generate raises, naming the position and the token."""
    prompt_tokens = good.tokenizer.encode(PROMPT)
    i, token = later_token(good, 1, temperature, prompt_tokens)
    path = damaged(f"embed_{n_draft}_{temperature}", {P + "embed_tokens.weight": (NAN, token * 64 + 5)})
    model = qmtp.load(path)
    call = lambda: qmtp.generate(model, PROMPT, max_tokens=30, n_draft=n_draft, temperature=temperature)
    if n_draft == 1:  # the same tokens up to `token`, then the step that feeds it stops
        print(expect(NonFiniteLogitsError, call, "NaN or Inf logits at position",
                     f"position {len(prompt_tokens) + i} (after token {token} ", "doctor MODEL --scan"))
    elif temperature == 0:
        # greedy drafting writes plain greedy's tokens, so it stops at that step too, or at an earlier pass that
        # verified `token` as a draft (in attention a masked position weighs 0, and 0 x NaN is NaN): the message
        # names the token either way
        message = expect(NonFiniteLogitsError, call, "NaN or Inf logits at position", str(token))
        position = int(message.split("at position ")[1].split()[0])
        assert position == len(prompt_tokens) + i or (position < len(prompt_tokens) + i and "verifying" in message)
        print(message)
    else:
        # sampling with drafts follows another random path: it need not meet the token, but never ends quietly
        # on it (the text may not hold it, or it must stop there)
        try:
            out = call()
        except NonFiniteLogitsError as err:
            print(err)
        else:
            assert token not in out.tokens[:-1], out.tokens


def test_nan_logits_mid_text_are_not_the_end_of_text(damaged, good):
    """Before: the NaN logits' argmax was a token like any other (here the end-of-text id), ending the text
    early. The step's report now says how many of its rows were finite, in the same read as its tokens."""
    prompt_tokens = good.tokenizer.encode(PROMPT)
    i, token = later_token(good, 1, 0.0, prompt_tokens)
    model = qmtp.load(damaged("embed_report", {P + "embed_tokens.weight": (NAN, token * 64)}))
    out = []  # every token handed out, as streamed
    with pytest.raises(NonFiniteLogitsError):
        qmtp.generate(model, prompt_tokens, max_tokens=30, stop_at_eos=False, on_tokens=out.extend)
    assert out[-1] == token and len(out) == i + 1  # nothing chosen from the NaN logits was handed out


def test_nan_in_the_head_is_counted_not_fatal(good, damaged):
    """A damaged head drafts from NaN logits: verification rejects its drafts, the text is plain greedy's, and
    the drafts are counted."""
    model = qmtp.load(damaged("head_fc", {"mtp.fc.weight": (NAN, 10)}))
    plain = qmtp.generate(good, PROMPT, max_tokens=24).tokens
    for n_draft in (2, 3, "auto"):
        out = qmtp.generate(model, PROMPT, max_tokens=24, n_draft=n_draft)
        assert out.tokens == plain
        assert out.stats.nonfinite_drafts == sum(out.stats.drafted) > 0
        assert out.stats.summary()["nonfinite_drafts"] == out.stats.nonfinite_drafts
    sampled = qmtp.generate(model, PROMPT, max_tokens=24, n_draft=2, temperature=0.8)
    assert sampled.stats.nonfinite_drafts > 0 and sum(sampled.stats.accepted) == 0
    assert qmtp.generate(good, PROMPT, max_tokens=24, n_draft=3).stats.nonfinite_drafts == 0


def test_nan_in_a_large_expert_tensor_is_caught_while_decoding(damaged):
    """Load checks only the small tensors; a NaN in one expert shows when a token is routed to it."""
    path = damaged("expert_decode", {P + "layers.2.mlp.experts.gate_up_proj": (NAN, 64 * 32 * 7 + 5)})
    model = qmtp.load(path)
    for n_draft in (1, 2):
        print(expect(NonFiniteLogitsError, lambda: qmtp.generate(model, PROMPT, max_tokens=40, n_draft=n_draft),
                     str(path), "NaN or Inf logits at position"))


# ---- load: the small tensors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("tensor, value", [
    (P + "layers.1.linear_attn.A_log", INF),  # gave a different finite story
    (P + "layers.1.linear_attn.A_log", NAN),
    (P + "layers.2.mlp.gate.weight", NAN),  # a router
    (P + "layers.4.mlp.shared_expert_gate.weight", -INF),
    (P + "layers.0.linear_attn.dt_bias", NAN),
    (P + "layers.0.linear_attn.conv1d.weight", NAN),
    (P + "layers.5.linear_attn.norm.weight", NAN),
    (P + "layers.3.self_attn.q_norm.weight", NAN),
    (P + "norm.weight", INF),
    ("mtp.pre_fc_norm_hidden.weight", NAN),
])
def test_load_refuses_a_nonfinite_small_tensor(damaged, tensor, value):
    path = damaged("small_" + tensor.replace(P, "").replace(".", "_") + str(value), {tensor: (value, 1)})
    print(expect(NonFiniteWeightError, lambda: qmtp.load(path), str(path), f"tensor {tensor} in model.safetensors",
                 "holds NaN or Inf"))


def test_cli_refuses_inf_a_log_in_one_line(damaged):
    path = damaged("a_log_cli", {P + "layers.1.linear_attn.A_log": (INF, 0)})
    print(one_line_error(run("chat", "--raw", path, "--prompt", PROMPT, "--max-tokens", "4"), P + "layers.1.linear_attn.A_log",
                         "holds NaN or Inf"))


# ---- convert ------------------------------------------------------------------------------------------------------
def test_convert_refuses_a_nan_expert_and_leaves_nothing(damaged, tmp_path):
    tensor = P + "layers.2.mlp.experts.gate_up_proj"
    path = damaged("expert_convert", {tensor: (NAN, 64 * 32 * 7 + 5)})  # expert 7
    dst = tmp_path / "out"
    from qmtp.convert import convert

    print(expect(NonFiniteWeightError, lambda: convert(path, dst, bits=4, progress=False), str(path),
                 f"tensor {tensor}", "row 7 of layers.2.mlp.experts.gate_proj.weight"))
    assert list(tmp_path.iterdir()) == []  # no destination, no partial folder, no lock
    result = run("convert", path, dst, "--bits", "4", "--quiet")
    print(one_line_error(result, tensor, "holds NaN or Inf"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tensor", ["mtp.norm.weight", P + "layers.1.linear_attn.A_log", "lm_head.weight"])
def test_convert_refuses_nonfinite_unquantized_and_float32_tensors(damaged, tmp_path, tensor):
    path = damaged("convert_" + tensor.replace(".", "_"), {tensor: (INF, 2)})
    from qmtp.convert import convert

    expect(NonFiniteWeightError, lambda: convert(path, tmp_path / "out", bits=4, progress=False), f"tensor {tensor}")
    assert list(tmp_path.iterdir()) == []


# ---- doctor -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from qmtp.convert import convert

    dst = tmp_path_factory.mktemp("finite_converted") / "q4"
    convert(BUNDLED_MODEL, dst, bits=4, progress=False)
    return dst


def test_doctor_names_a_nan_norm_of_a_conversion(converted, tmp_path):
    """It used to say the fixes record and the tensors disagree (the NaN made the norms' median mean NaN)."""
    path = tmp_path / "nan_norm"
    shutil.copytree(converted, path)
    tensor = "language_model.model.layers.0.input_layernorm.weight"
    poke(path, tensor, NAN, 3)
    result = run("doctor", path)
    assert f"1 with NaN/Inf: {tensor}" in result.stdout
    assert "DISAGREE" not in result.stdout and "record" not in result.stderr, result.stdout
    print(one_line_error(result, path, f"tensor {tensor}", "holds NaN or Inf"))
    print(one_line_error(run("chat", "--raw", path, "--prompt", PROMPT), f"tensor {tensor}", "holds NaN or Inf"))


def test_load_checks_a_quantized_routers_scales(converted, tmp_path):
    path = tmp_path / "nan_router_scales"
    shutil.copytree(converted, path)
    tensor = "language_model.model.layers.2.mlp.gate.scales"
    poke(path, tensor, NAN, 0)
    expect(NonFiniteWeightError, lambda: qmtp.load(path), f"tensor {tensor}")


def test_doctor_reports_small_tensors_finite(converted):
    result = run("doctor", converted)
    assert result.returncode == 0, result.stderr
    assert "small tensors (norms, A_log, dt_bias, conv kernels, routers):" in result.stdout
    assert "all finite" in result.stdout


# ---- the command line ---------------------------------------------------------------------------------------------
def test_chat_stops_in_one_line_on_a_nan_embedding(good, damaged):
    prompt_tokens = good.tokenizer.encode(PROMPT)
    i, token = later_token(good, 1, 0.0, prompt_tokens)
    path = damaged("embed_cli", {P + "embed_tokens.weight": (NAN, token * 64 + 1)})
    # greedy (--temperature 0), so that the poisoned token is the one the run reaches at step i
    result = run("chat", "--raw", path, "--prompt", PROMPT, "--max-tokens", "30", "--temperature", "0")
    print(one_line_error(result, path, f"NaN or Inf logits at position {len(prompt_tokens) + i} (after token {token}"))
    assert result.stdout.startswith(PROMPT) and result.stdout.endswith("\n")  # the text so far, its line ended
    result = run("chat", "--raw", path, "--prompt", PROMPT, "--max-tokens", "30", "--use-mtp", "--n-draft", "3",
                 "--temperature", "0")
    print(one_line_error(result, path, "NaN or Inf logits at position", str(token)))  # maybe as a draft


def test_chat_reports_drafts_from_a_nan_head(damaged):
    path = damaged("head_cli", {"mtp.fc.weight": (NAN, 10)})
    # one draft a step (--use-mtp alone is auto, whose widths vary): 7 steps after the first token
    result = run("chat", "--raw", path, "--use-mtp", "--n-draft", "2", "--prompt", PROMPT, "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert "7 drafts from NaN/Inf head logits" in result.stderr, result.stderr
