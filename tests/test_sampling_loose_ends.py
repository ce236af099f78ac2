"""Sampling and conversation settings refused with one qmtp error, never a traceback or a silent default: a damaged
generation_config.json under sampling="model", a conversation's bad settings at construction, the prefix cache's
advice, and stop strings that must not match a character still being decoded."""

import json
import os
import shutil

import pytest

import qmtp
from qmtp import Sampling
from qmtp.errors import CheckpointError, QmtpError, UsageError


@pytest.fixture(scope="module")
def bundled():
    return qmtp.load()


@pytest.fixture()
def copied(tmp_path, bundled):
    """A copy of the bundled model whose generation_config.json a test may damage."""
    path = tmp_path / "tiny"
    shutil.copytree(bundled.path, path)
    return path


DAMAGED = {
    "truncated": b'{"temperature": 0.7, "top_p"',
    "not UTF-8": b'{"temperature": 0.7, "note": "\xff\xfe"}',
    "empty": b"",
    "nested too deep": b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    "a list": b"[0.7, 0.8]",
    "a string": b'"temperature=0.7"',
    "a number": b"0.7",
    "null": b"null",
    "a setting of a wrong kind": b'{"temperature": "hot"}',
    "a setting out of range": b'{"temperature": 0.7, "top_p": 2}',
    "do_sample not a boolean": b'{"do_sample": "false", "temperature": 0.7}',
    "NaN": b'{"temperature": NaN}',
}


@pytest.mark.parametrize("damage", list(DAMAGED))
def test_a_damaged_generation_config_is_one_error_naming_it(copied, damage):
    (copied / "generation_config.json").write_bytes(DAMAGED[damage])
    model = qmtp.load(copied)
    with pytest.raises(CheckpointError, match="generation_config.json") as caught:
        Sampling.of_model(model)
    assert "\n" not in str(caught.value)
    with pytest.raises(QmtpError, match="generation_config.json"):
        qmtp.generate(model, "Once upon a time", max_tokens=2, sampling="model")


def test_a_generation_config_that_is_a_directory_is_not_read_as_greedy(copied):
    os.remove(copied / "generation_config.json")
    (copied / "generation_config.json").mkdir()
    with pytest.raises(CheckpointError, match="generation_config.json.*directory"):
        Sampling.of_model(qmtp.load(copied))


def test_a_missing_generation_config_is_still_greedy(copied):
    os.remove(copied / "generation_config.json")
    assert Sampling.of_model(qmtp.load(copied)) == Sampling()


def test_the_cli_refuses_a_damaged_generation_config_with_exit_2(copied, capsys):
    from qmtp.cli import main

    (copied / "generation_config.json").write_bytes(DAMAGED["a list"])
    assert main(["chat", str(copied), "--raw", "--prompt", "Once", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "generation_config.json" in err and "Traceback" not in err


# ---- a conversation refuses bad settings when it is made, not at the first message ------------------------------
@pytest.mark.parametrize("bad, named", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"), (dict(max_tokens=10**9), "max_tokens"),
    (dict(stop_at_eos="no"), "stop_at_eos"), (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
    (dict(n_draft=0), "n_draft"), (dict(seed=-1), "seed"), (dict(stop=[""]), "stop"),
    (dict(sampling="card"), "sampling"),
])
def test_a_conversation_refuses_bad_settings_at_construction(bundled, bad, named):
    with pytest.raises(UsageError, match=named):
        qmtp.Conversation(bundled, raw=True, **bad)


def test_a_conversation_refuses_a_damaged_generation_config_at_construction(copied):
    (copied / "generation_config.json").write_bytes(DAMAGED["truncated"])
    with pytest.raises(CheckpointError, match="generation_config.json"):
        qmtp.Conversation(qmtp.load(copied), raw=True, sampling="model")


# ---- the prefix cache's advice is true -------------------------------------------------------------------------
def test_clearing_a_prefix_cache_frees_it_for_another_model(bundled, copied):
    other = qmtp.load(copied)
    cache = qmtp.PrefixCache()
    qmtp.generate(bundled, "Once upon a time", max_tokens=3, prefix_cache=cache)
    with pytest.raises(UsageError, match=r"clear\(\)"):
        qmtp.generate(other, "Once upon a time", max_tokens=3, prefix_cache=cache)
    cache.clear()  # what the error advises
    g = qmtp.generate(other, "Once upon a time", max_tokens=3, prefix_cache=cache)
    assert g.tokens == qmtp.generate(other, "Once upon a time", max_tokens=3).tokens


# ---- stop strings and characters still being decoded ---------------------------------------------------------
def collect(model, steps_tokens, stops, max_tokens=64):
    """The reply's text machine (`qmtp.text.ReplyText`, as the engine feeds it) over scripted steps: the first list
    is the prefill's token, then one list per pass."""
    from types import SimpleNamespace

    from qmtp.text import ReplyText

    reply = ReplyText(model.tokenizer, frozenset(), stops, max_tokens)
    for emitted in steps_tokens:
        reply.take(emitted)
        if reply.done:
            break
    return SimpleNamespace(text=reply.text, tokens=list(reply.tokens), finish_reason=reply.finish_reason or "length")


def test_a_replacement_character_stop_does_not_cut_a_character_being_decoded(bundled):
    tok = bundled.tokenizer
    ids = tok.encode("Hi \U0001F600 there")  # the emoji's four bytes are tokens of their own
    emoji = [i for i in range(len(ids)) if "\ufffd" in tok.decode(ids[:i + 1])]
    assert len(emoji) >= 2, "the emoji is not split over tokens: the test cannot tell"
    for cut in range(1, len(ids)):  # every way of splitting the tokens into two passes
        g = collect(bundled, [ids[:1], ids[1:cut], ids[cut:]] if cut > 1 else [ids[:1], ids[1:]], ("\ufffd",))
        assert g.finish_reason == "length" and g.text == "Hi \U0001F600 there", cut


def test_a_replacement_character_that_is_in_the_text_still_stops_it(bundled):
    """Bytes that never make a character (a lone continuation byte) are U+FFFD in the text for good: a stop string
    "\\ufffd" matches them as soon as the bytes after show they are no character's start."""
    tok = bundled.tokenizer
    ids = tok.encode("Hi \U0001F600 there")
    emoji = [i for i in range(len(ids)) if "\ufffd" in tok.decode(ids[:i + 1])]
    lone = ids[:emoji[0]] + ids[emoji[0] + 1:]  # the emoji without its first byte: continuation bytes alone
    g = collect(bundled, [lone[:1], lone[1:]], ("\ufffd",))
    assert g.finish_reason == "stop" and g.text == "Hi "
    text = tok.decode(g.tokens)
    assert "\ufffd" in text and "\ufffd" not in tok.decode(g.tokens[:-1])  # cut at the token that made it one


def test_a_stop_string_ending_in_a_character_matches_once_it_is_whole(bundled):
    tok = bundled.tokenizer
    ids = tok.encode("Hi \U0001F600 there")
    for cut in range(1, len(ids)):
        g = collect(bundled, [ids[:1], ids[1:cut], ids[cut:]] if cut > 1 else [ids[:1], ids[1:]], (" \U0001F600",))
        assert g.finish_reason == "stop" and g.text == "Hi", cut
        assert tok.decode(g.tokens).endswith("\U0001F600")  # kept up to the token that completed it
