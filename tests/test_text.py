"""The one text machine (`qmtp.text.ReplyText`): tokens to text decoded once each, stops straddling tokens, and
streamed deltas that join to exactly the final text however the tokens are split and whatever the stops."""

import itertools

import pytest

import qmtp
from qmtp.text import ReplyText, ThinkingSplit, split_reply

TEXT = "one two three four 😀 five"


@pytest.fixture(scope="module")
def tokenizer():
    return qmtp.load().tokenizer


def splits(ids, pieces: int):
    """Every way of cutting `ids` into `pieces` consecutive non-empty steps."""
    for cuts in itertools.combinations(range(1, len(ids)), pieces - 1):
        bounds = (0, *cuts, len(ids))
        yield [ids[a:b] for a, b in zip(bounds, bounds[1:])]


def streamed(tokenizer, steps, stops, max_tokens=None):
    reply = ReplyText(tokenizer, stops=stops, max_tokens=max_tokens)
    deltas = []
    for step in steps:
        reply.take(step)
        deltas.append(reply.delta())
        if reply.done:
            break
    return reply, "".join(deltas)


@pytest.mark.parametrize("stops", [(), ("three",), ("two three four five six seven eight",), ("o",), (" 😀",),
                                   ("four 😀 five", "x"), ("e t",)])
def test_streamed_deltas_join_to_the_final_text_for_every_split(tokenizer, stops):
    """Issue 45 item 1: a stop string longer than the reply so far (held back from the wrong end before) and
    stops inside the first tokens; the deltas joined equal the whole reply's text, streamed or not."""
    ids = tokenizer.encode(TEXT)
    whole, _ = streamed(tokenizer, [ids], stops)
    cut = TEXT.find(stops[0]) if stops and stops[0] in TEXT else -1
    assert whole.text == (TEXT[:min(TEXT.find(s) for s in stops if s in TEXT)] if cut >= 0 else TEXT)
    assert whole.finish_reason == ("stop" if cut >= 0 else None)
    for pieces in (2, 3):
        for steps in splits(ids, pieces):
            reply, sent = streamed(tokenizer, steps, stops)
            assert reply.tokens == whole.tokens and reply.text == whole.text, steps
            assert whole.text.startswith(sent)
            assert sent + reply.finish(whole.text) == whole.text, steps


def test_a_stop_ends_the_reply_at_the_token_that_completes_it(tokenizer):
    ids = tokenizer.encode(TEXT)
    reply, _ = streamed(tokenizer, [ids], ("three",))
    assert "three" in tokenizer.decode(reply.tokens) and "three" not in tokenizer.decode(reply.tokens[:-1])


def test_end_ids_and_max_tokens_end_the_reply(tokenizer):
    ids = tokenizer.encode(TEXT)
    reply = ReplyText(tokenizer, eos={ids[3]})
    assert reply.take(ids) == ids[:4] and reply.finish_reason == "end"
    assert reply.text == tokenizer.decode(ids[:3])  # the end id is kept as a token, left out of the text
    reply = ReplyText(tokenizer, max_tokens=5)
    assert reply.take(ids[:2]) == ids[:2] and not reply.done
    assert reply.take(ids[2:]) == ids[2:5] and reply.finish_reason == "length"


def test_each_token_is_decoded_once(tokenizer, monkeypatch):
    """The machine never decodes the reply again as it grows: the text of a token is computed as it comes."""
    ids = tokenizer.encode(TEXT * 4)
    calls = []
    decode = type(tokenizer).decode
    monkeypatch.setattr(type(tokenizer), "decode", lambda self, t: calls.append(len(list(t))) or decode(self, t))
    reply = ReplyText(tokenizer, stops=("never there",))
    for t in ids:
        reply.take([t])
        reply.delta()
    assert max(calls, default=0) <= 4, calls  # never the reply: at most the bytes of one character


def test_thinking_is_split_at_the_tag_however_the_deltas_cut_it():
    split = ThinkingSplit(opened=True)
    pieces = [split.feed(d) for d in ("I think", " so</th", "ink>\n", "yes")] + [split.finish()]
    assert "".join(p[0] for p in pieces) == "I think so" and "".join(p[1] for p in pieces) == "\nyes"
    assert split_reply("a</think>b", opened=False) == ("", "a</think>b")
