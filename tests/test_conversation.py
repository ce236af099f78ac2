"""A conversation keeps its decoding state between turns: each turn prefills only what its prompt adds to the
ids the state holds, and its tokens are those of a fresh `generate` over the same ids."""

from dataclasses import replace

import numpy as np
import pytest

import qmtp
from qmtp import chat, continuous, decoding, speculative
from qmtp.config import LINEAR
from qmtp.errors import UsageError
from qmtp.prefix_cache import common_prefix

from helpers import expect
from test_chat import model_dir

TURNS = ["A story about a fox.", "And a rabbit?", "Who wins?"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The bundled model with a chat template of this family's format."""
    return qmtp.load(model_dir(tmp_path_factory.mktemp("templated")))


def fresh(model, g, conversation, turn):
    """What `generate` gives, without a kept state, over the ids turn `turn` generated after."""
    return qmtp.decode(model, g.prompt_tokens, replace(conversation.settings, seed=conversation.seed + turn))


def generation_prompt_start(model, messages, **template) -> int:
    """Where the generation prompt of `messages` starts (in token ids)."""
    tok = model.tokenizer
    return common_prefix(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=False, **template)),
                         tok.encode(tok.apply_chat_template(messages, **template)))


SAMPLED = {"temperature": 0.8}
PENALISED = {"temperature": 0.8, "top_p": 0.95, "presence_penalty": 1.5, "repetition_penalty": 1.1}


@pytest.mark.parametrize("n_draft, sampling", [(1, {}), (2, {}), (4, {}), ("auto", {}), (1, SAMPLED), (3, SAMPLED),
                                               (3, PENALISED)])
def test_each_turn_equals_a_fresh_run_when_the_template_drops_the_thinking(model, n_draft, sampling):
    """Thinking on: the template drops a reply's thinking once the next question follows, so the history parts
    from the ids the state holds at the reply's start; the turn resumes from the snapshot there. (The penalties'
    counts start again at each turn, the history being prompt.)"""
    conversation = qmtp.Conversation(model, "Tell stories.", n_draft=n_draft, seed=5, max_tokens=MAX_TOKENS,
                                     **sampling)
    before = None
    for turn, text in enumerate(TURNS):
        history = conversation.messages + [{"role": "user", "content": text}]
        g = conversation.send(text)
        assert g.tokens == fresh(model, g, conversation, turn).tokens, turn
        assert g.prompt_tokens == model.tokenizer.apply_chat_template(history, tokenize=True)
        if before is not None:
            held = before.prompt_tokens + before.tokens[:-1]  # the last token was chosen, never fed
            resumed_at = generation_prompt_start(model, history[:-2])
            assert common_prefix(g.prompt_tokens, held) < len(held)  # the template rendered it otherwise
            assert g.stats.prefilled_tokens == len(g.prompt_tokens) - resumed_at < len(g.prompt_tokens)
        else:
            assert g.stats.prefilled_tokens == g.stats.prompt_tokens
        before = g
    assert conversation.turns == len(TURNS) and len(conversation.messages) == 1 + 2 * len(TURNS)


def assert_close(a, b, what):
    a, b = np.array(a), np.array(b)
    assert np.allclose(a, b, rtol=1e-4, atol=1e-5), f"{what}: differs by {np.abs(a - b).max()}"


@pytest.mark.parametrize("thinking", [{}, {"chat_template_kwargs": {"preserve_thinking": True}}])
def test_the_kept_state_holds_what_a_fresh_run_computes(model, thinking):
    """Equal tokens could hide a head that reads stale positions (its drafts change a little, its argmax rarely):
    the kept state's KV entries (trunk and head) over the prompt are those of a fresh run, and so is the
    linear-attention state when both hold the same ids."""
    conversation = qmtp.Conversation(model, "Tell stories.", n_draft=3, max_tokens=MAX_TOKENS, **thinking)
    same_ids = 0
    for turn, text in enumerate(TURNS):
        g = conversation.send(text)
        cache = qmtp.PrefixCache()
        qmtp.decode(model, g.prompt_tokens, replace(conversation.settings, seed=conversation.seed + turn),
                    prefix_cache=cache)
        kept, fresh, n = conversation.cache.state, cache.state, len(g.prompt_tokens)
        for i, (layer, a, b) in enumerate(zip(model.layers, kept["layers"], fresh["layers"])):
            if layer.kind != LINEAR:
                for x, y in zip(a, b):
                    assert_close(x[:, :, :n], y[:, :, :n], f"turn {turn}, layer {i}'s KV")
            elif conversation.cache.tokens == cache.tokens:
                for x, y in zip(a, b):
                    assert_close(x, y, f"turn {turn}, layer {i}'s linear state")
        same_ids += conversation.cache.tokens == cache.tokens
        for x, y in zip(kept["head"], fresh["head"]):  # the head's entry i reads position i and the token after
            assert_close(x[:, :, :n - 1], y[:, :, :n - 1], f"turn {turn}, the head's KV")
    assert same_ids


@pytest.mark.parametrize("n_draft", [1, 3])
def test_a_history_rendered_as_decoded_prefills_only_the_new_tokens(model, n_draft):
    """preserve_thinking keeps each reply as it was decoded: a turn prefills the last reply's last token (chosen,
    never fed) and the new message, or, when the last step fed drafts past the reply's end, from that step's
    start."""
    conversation = qmtp.Conversation(model, "Tell stories.", chat_template_kwargs={"preserve_thinking": True},
                                     n_draft=n_draft, max_tokens=MAX_TOKENS)
    before = None
    for turn, text in enumerate(TURNS):
        g = conversation.send(text)
        assert g.tokens == fresh(model, g, conversation, turn).tokens
        if before is not None:
            fed = before.prompt_tokens + before.tokens[:-1]
            assert common_prefix(g.prompt_tokens, fed) == len(fed)  # the reply rendered as decoded
            new = len(g.prompt_tokens) - len(fed)
            # (a draft fed past the reply's end may also be the next token of the prompt, and be kept)
            assert 0 < g.stats.prefilled_tokens <= new + n_draft - 1
            if n_draft == 1:  # one token per step: nothing fed past the reply
                assert g.stats.prefilled_tokens == new
        before = g


def test_raw_conversations_continue_the_ids_and_grow_their_buffers(model):
    """raw=True appends each message to the ids before it; the KV buffers, made for the first turn, grow."""
    conversation = qmtp.Conversation(model, raw=True, n_draft=3, max_tokens=MAX_TOKENS, stop_at_eos=False)
    ids, capacities = [], []
    for turn, text in enumerate(["Once upon a time", " The fox said", [5, 6, 7]]):
        g = conversation.send(text)
        added = model.tokenizer.encode(text) if isinstance(text, str) else text
        assert g.prompt_tokens == ids + added
        assert g.tokens == fresh(model, g, conversation, turn).tokens
        ids = g.prompt_tokens + g.tokens
        assert conversation.tokens == ids
        capacities.append(decoding.capacity_of(model, conversation.cache.state))
        if turn:
            assert g.stats.prefilled_tokens <= len(added) + 3  # the message, the last reply's end
    first = decoding.capacity_for(len(model.tokenizer.encode("Once upon a time")) + MAX_TOKENS + 2 * 3)
    assert capacities[0] == first and capacities[-1] > first


def test_a_state_the_head_fell_behind_resumes_from_a_snapshot(model, monkeypatch):
    """"auto" that gives drafting up for good stops the head: the state the turn leaves misses the head's
    entries, so the next turn resumes where the head was whole (the prompt's end), and still equals a fresh run."""

    class GivesUp(continuous.DraftPlanner):
        def choose(self):
            if self.steps >= 3:
                self.plain = True
            return 1 if self.plain else 3

    monkeypatch.setattr(continuous, "DraftPlanner", GivesUp)
    conversation = qmtp.Conversation(model, raw=True, n_draft="auto", max_tokens=MAX_TOKENS, stop_at_eos=False)
    first = conversation.send("Once upon a time")
    assert first.stats.tokens_per_pass[0] == 3 and first.stats.tokens_per_pass[-1] == 1 and conversation.cache.pending is None
    second = conversation.send(" The fox said")
    assert second.tokens == fresh(model, second, conversation, 1).tokens
    assert second.stats.prefilled_tokens == len(second.prompt_tokens) - len(first.prompt_tokens)


def test_a_turn_that_fails_leaves_the_history_and_starts_the_state_anew(model):
    conversation = qmtp.Conversation(model, "Tell stories.", enable_thinking=False, max_tokens=MAX_TOKENS)
    conversation.send(TURNS[0])
    history = conversation.messages

    def interrupt(tokens):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        conversation.send(TURNS[1], on_tokens=interrupt)
    assert conversation.messages == history and conversation.turns == 1
    assert conversation.cache.state is None  # a state cut short is not kept
    g = conversation.send(TURNS[1])
    assert g.stats.prefilled_tokens == g.stats.prompt_tokens
    assert g.tokens == fresh(model, g, conversation, 1).tokens
    # a message the model refuses (too long for the context) keeps both history and state
    kept = conversation.cache.tokens
    expect(UsageError, lambda: conversation.send("fox " * 5000), "longer than the context")
    assert conversation.cache.tokens == kept and len(conversation.messages) == 5
    conversation.reset()
    assert conversation.messages == [{"role": "system", "content": "Tell stories."}] and conversation.turns == 0
    g = conversation.send(TURNS[0])
    assert g.stats.prefilled_tokens == g.stats.prompt_tokens


def test_stats_count_the_prefilled_tokens(model):
    g = qmtp.generate(model, "Once upon a time", max_tokens=4)
    assert g.stats.prefilled_tokens == g.stats.prompt_tokens == len(g.prompt_tokens)
    summary = g.stats.summary()
    assert summary["prefilled_tokens"] == summary["prompt_tokens"] == len(g.prompt_tokens)


def test_a_prefix_cache_serves_one_model(model):
    cache = qmtp.PrefixCache()
    qmtp.generate(model, "Once upon a time", max_tokens=4, prefix_cache=cache)
    other = qmtp.load()
    expect(UsageError, lambda: qmtp.generate(other, "Once upon a time", max_tokens=4, prefix_cache=cache),
           "another model")
    expect(UsageError, lambda: qmtp.generate(model, "a", prefix_cache={}), "PrefixCache")
    # drafting starts it anew: the state it held has no head
    g = qmtp.generate(model, "Once upon a time, a fox", max_tokens=4, n_draft=3, prefix_cache=cache)
    assert g.stats.prefilled_tokens == g.stats.prompt_tokens
    g = qmtp.generate(model, "Once upon a time, a fox and a hare", max_tokens=4, n_draft=3, prefix_cache=cache)
    assert g.stats.prefilled_tokens < g.stats.prompt_tokens


@pytest.mark.parametrize("kwargs, fragment", [
    ({"n_draft": "two"}, "n_draft"),
    ({"n_draft": 9}, "out of range"),
    ({"max_tokens": "8"}, "max_tokens"),
    ({"seed": -1}, "seed"),
    ({"stop": 5}, "stop=5"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 2.0}, "top_p"),
    ({"system": 5}, "system"),
    ({"enable_thinking": "off"}, "enable_thinking"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"raw": True, "system": "x"}, "raw=True"),
    ({"raw": "yes"}, "raw"),
])
def test_bad_settings_are_refused_at_once(model, kwargs, fragment):
    expect(UsageError, lambda: qmtp.Conversation(model, **kwargs), fragment)


@pytest.mark.parametrize("variables, fragment", [
    ({"enable_thinking": "no"}, "enable_thinking='no'"),
    ({"tools": "x"}, "chat_template_kwargs: tools"),
    ({"messages": []}, "messages cannot be a template variable"),  # was a TypeError from apply_chat_template
    ({"\ud800": 1}, "lone surrogate"),
    ({"x": object()}, "chat_template_kwargs['x']"),
    ({"chat_template": 3}, "chat_template must be"),
])
def test_bad_template_variables_are_refused_when_the_conversation_is_made(model, variables, fragment):
    """The fuzz found these accepted by the constructor, then refused at the first message (or, for
    `messages`, a bare TypeError there)."""
    message = expect(UsageError, lambda: qmtp.Conversation(model, chat_template_kwargs=variables), fragment)
    assert "chat_template_kwargs" in message


def test_an_unknown_keyword_is_a_usage_error_naming_it(model):
    message = expect(UsageError, lambda: qmtp.Conversation(model, max_new_tokens=8), "Conversation",
                     "'max_new_tokens'", "did you mean 'max_tokens'")
    conversation = qmtp.Conversation(model, max_tokens=2)
    expect(UsageError, lambda: conversation.send("Hi", stream=True), "Conversation.send", "'stream'")
    expect(UsageError, lambda: conversation.next_prompt(), "Conversation.next_prompt", "message")
    with pytest.raises(TypeError):  # still the TypeError Python raises for it
        conversation.send("Hi", 3)
    assert conversation.turns == 0 and "\n" not in message


def test_bad_messages_are_refused(model, tmp_path):
    conversation = qmtp.Conversation(model)
    for message, fragment in [("", "empty"), ("  \n", "empty"), (None, "text"), (["hi"], "text"),
                              ({"role": "user", "content": "hi"}, "text")]:
        expect(UsageError, lambda: conversation.send(message), fragment)
    assert conversation.messages == [] and conversation.turns == 0
    raw = qmtp.Conversation(model, raw=True)
    for message, fragment in [("", "empty"), ([], "empty"), (b"hi", "bytes"), ([1.5], "token ids")]:
        expect(UsageError, lambda: raw.send(message), fragment)
    expect(UsageError, lambda: raw.send([5000]), "outside the vocabulary")
    assert raw.tokens == []
    expect(UsageError, lambda: qmtp.Conversation("model"), "qmtp Model")
    untemplated = qmtp.load(model_dir(tmp_path / "untemplated", template=None))
    expect(UsageError, lambda: qmtp.Conversation(untemplated), "no chat template", "raw=True")


def test_chat_keeps_the_state_between_turns(model):
    """The interactive chat is a Conversation: its second turn says how many prompt tokens it kept."""
    from test_chat import run_chat, stats_lines

    result = run_chat(model.path, "--thinking=false", "--max-tokens", "8", "--use-mtp", "--n-draft", "3",
                      input="Tell me about foxes.\nAnd rabbits?\n/reset\nTell me about foxes.\n")
    assert result.returncode == 0, result.stderr
    lines = stats_lines(result.stderr)
    assert len(lines) == 3
    assert "kept from the last turn" not in lines[0] and "kept from the last turn" in lines[1]
    assert "kept from the last turn" not in lines[2]  # /reset starts anew
    conversation = qmtp.Conversation(model, enable_thinking=False, max_tokens=8, n_draft=3)
    answers = [chat.split_thinking(conversation.send(t).text)[1] for t in ("Tell me about foxes.", "And rabbits?")]
    assert result.stdout.startswith("".join(a + "\n" for a in answers))
