"""qmtp.book.conversations: chapter 10's prompt ends, card samplers and turn measurements, on the bundled model."""

import pytest

import qmtp
from qmtp.book import conversations
from qmtp.loading import BUNDLED_MODEL


@pytest.fixture(scope="module")
def model():
    return qmtp.load(BUNDLED_MODEL)


def test_thinking_on_opens_a_think_block_and_off_closes_an_empty_one(model):
    rows = conversations.prompt_ends(model, [{"role": "user", "content": "Hello."}])
    on, off = rows
    assert on["enable_thinking"] is None and on["opens_thinking"] and on["ends"].endswith("<think>\n")
    assert off["enable_thinking"] is False and not off["opens_thinking"]
    assert off["ends"].endswith("<think>\n\n</think>\n\n")
    table = conversations.prompt_ends_table(rows)
    assert "\\n" in table and "\n\n</think>" not in table  # newlines shown, not breaking the table's rows
    assert len(table.splitlines()) == 4


def test_card_samplers_are_what_generation_config_declares(model):
    rows = {r["field"]: r for r in conversations.card_samplers(model)}
    assert rows["temperature"]["declared"] == rows["temperature"]["read"] == 1.0
    assert rows["presence_penalty"]["read"] == 1.5
    assert rows["frequency_penalty"]["declared"] is None and rows["frequency_penalty"]["read"] == 0.0
    table = conversations.card_samplers_table(list(rows.values()))
    assert "generation_config.json" in table and "| `frequency_penalty` | - |" in table


def test_later_turns_prefill_less_and_reply_as_the_fresh_run(model):
    rows = conversations.measure_turns(model, ("Tell me about the sea.", "Why is it salty?"), max_tokens=4,
                                       repeats=1, warmup=False)
    first, second = rows
    assert first["conversation_prefilled"] == first["fresh_prefilled"] == first["prompt_tokens"]
    assert second["fresh_prefilled"] == second["prompt_tokens"] > second["conversation_prefilled"] > 0
    assert all(r["same"] and r["conversation_s"] > 0 and r["fresh_first_s"] > 0 for r in rows)
    summary = conversations.reuse_summary({"on": rows})
    assert summary["all_same"] and 0 < summary["prefilled_share"] == summary["prefilled_share_by_mode"]["on"] < 1
    assert "| on | 2 |" in conversations.turns_table({"on": rows})


def test_figure_draws_both_runs_per_mode():
    row = dict(turn=1, prompt_tokens=10, conversation_prefilled=10, fresh_prefilled=10, conversation_s=0.1,
               fresh_s=0.1, conversation_first_s=0.01, fresh_first_s=0.01, same=True)
    later = dict(row, turn=2, prompt_tokens=20, conversation_prefilled=8, fresh_prefilled=20, fresh_first_s=0.02)
    fig = conversations.turns_figure({"thinking on": [row, later], "thinking off": [row, later]})
    tokens_ax, time_ax = fig.axes
    assert len(tokens_ax.lines) == len(time_ax.lines) == 4
    assert list(tokens_ax.lines[0].get_ydata()) == [10, 8]
