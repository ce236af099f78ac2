"""Conversations for the bundled model's chat fine-tune: the corpus's registers as requests and replies.

Qwen3.6 meets its users through the chat template (`<|im_start|>ROLE\\n...<|im_end|>\\n`, thinking in
`<think>...</think>`), so the bundled model is fine-tuned on conversations rendered by a template of the same
format (`qmtp/assets/tiny/chat_template.jinja`). Each conversation is a list of messages, as `generate`
takes them: an optional system message, then one to three user requests, each answered by the assistant
with text of one of the corpus's registers (`qmtp.tiny.corpus`): a story, a dialogue exchange, a list, sums,
facts. The last reply carries a short `reasoning_content` when thinking is on; with thinking off the
template renders the empty `<think>\\n\\n</think>\\n\\n` that `enable_thinking=False` puts in a prompt, so the
model learns both of the generation prompts it will be given. Earlier replies lose their thinking, as the
template drops it.

Deterministic as the corpus is: conversation *i* of a stream depends only on (stream, seed, i), seeded by
SHA-256, and streams "train" and "heldout" never share a seed.
"""

from __future__ import annotations

import hashlib
import random

from . import corpus

__all__ = ["conversation", "conversations", "SYSTEM_PROMPTS", "THINKING_SHARE"]

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a friendly assistant. Answer briefly.",
    "Be brief.",
    "You help children learn to read.",
)
THINKING_SHARE = 0.5  # half the conversations end with thinking on, half with it off, as a user may ask either way
_NO_SYSTEM_SHARE = 0.4


def _seed(stream: str, seed: int, index: int) -> int:
    digest = hashlib.sha256(f"qmtp.chat_corpus/{stream}/{seed}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def _request(rng: random.Random) -> tuple[str, str, str]:
    """(request, reply, thought): one user request answered with one of the corpus's registers, and the short
    reasoning a thinking reply starts with (it names the task, as a model's plan does, and never the answer)."""
    kind = rng.randrange(6)
    if kind == 0:
        question, answer = corpus._exchange(rng, rng.choice(corpus._GIRLS + corpus._BOYS), [])
        return question, answer, "A short question. I answer it in one sentence."
    if kind == 1:
        request = rng.choice(("Tell me a story.", "Can you tell me a story?", "Tell me a short story, please."))
        return request, corpus._story(rng), "The user wants a story. I will tell a short story with a friend in it."
    if kind == 2:
        request = rng.choice(("Write a list.", "Can you make a list for me?", "Please write a short list."))
        return request, corpus._list(rng), "The user wants a list. I will write one item on each line."
    if kind == 3:
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        if rng.random() < 0.5:
            return f"What is {a} + {b}?", f"{a} + {b} = {a + b}", f"I add {b} to {a}."
        a, b = max(a, b), min(a, b)
        return f"What is {a} - {b}?", f"{a} - {b} = {a - b}", f"I take {b} away from {a}."
    if kind == 4:
        request = rng.choice(("Give me some sums.", "Can you do some sums?", "Show me some arithmetic."))
        return request, corpus._arithmetic(rng), "The user wants sums. I will write one on each line and check each one."
    request = rng.choice(("Tell me some facts.", "Tell me something true.", "What do you know about animals?"))
    return request, corpus._facts(rng), "The user wants facts. I will say a few simple true things."


def conversation(rng: random.Random) -> tuple[list[dict], bool]:
    """(messages, thinking): a conversation ending with an assistant reply, and whether that reply thinks."""
    messages: list[dict] = []
    if rng.random() >= _NO_SYSTEM_SHARE:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    thinking = rng.random() < THINKING_SHARE
    turns = rng.choice((1, 1, 1, 2, 2, 3))
    for turn in range(turns):
        request, reply, thought = _request(rng)
        messages.append({"role": "user", "content": request})
        last = turn == turns - 1
        # Thinking off renders an empty think block, exactly the prompt enable_thinking=False gives.
        messages.append({"role": "assistant", "content": reply, "reasoning_content": thought if last and thinking else ""})
    return messages, thinking


def conversations(n: int, seed: int = 0, stream: str = "train") -> list[tuple[list[dict], bool]]:
    """`n` conversations of `stream`; conversation i depends only on (stream, seed, i)."""
    return [conversation(random.Random(_seed(stream, seed, i))) for i in range(n)]
