"""A row's tokens as text deltas a client may be sent now, and thinking apart from the answer.

A streamed delta can never be taken back, so text is held back while it may still change: a character whose
bytes are not all decoded yet (U+FFFD at the end), and the last characters while a stop string may be starting
there. At the end the rest comes from the row's final text (`Generation.text`), so the deltas put together
are exactly that text. `ThinkingSplit` cuts the same deltas at `</think>` (held back while a tag may be
starting), so streamed `reasoning_content` + `</think>` + `content` is the final text too.
"""

from __future__ import annotations

from ..chat import END_THINK

SETTLE_EVERY = 32  # tokens decoded again at most per step, past the last clean cut (not counting held ones)


class TextStream:
    """The text of a growing list of tokens, as deltas safe to send. `eos`: ids left out of the text (as
    `generate` leaves them); `stops`: the stop strings (the text ends before the first)."""

    def __init__(self, tokenizer, eos=frozenset(), stops: tuple[str, ...] = ()):
        self.tokenizer, self.eos, self.stops = tokenizer, frozenset(eos), tuple(stops)
        self.hold = max(map(len, self.stops), default=1) - 1
        self.pending: list[int] = []  # tokens past the last clean cut
        self.settled = ""  # the text of the tokens before it: byte-level decoding concatenates at a cut
        self.sent = ""
        self.stopped = False

    def feed(self, tokens: list[int]) -> str:
        """The new text these tokens make safe to send ("" if none)."""
        if self.stopped:
            return ""
        self.pending.extend(t for t in tokens if t not in self.eos)
        tail = self.tokenizer.decode(self.pending)
        text = self.settled + tail
        if self.stops:
            start = max(0, len(self.sent) - self.hold)
            found = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
            if found:
                self.stopped = True
                return self._send(text[:min(found)])
        if len(self.pending) >= SETTLE_EVERY and not tail.endswith("\ufffd"):
            self.settled, self.pending = text, []
        safe = text.rstrip("\ufffd")
        return self._send(safe[:len(safe) - self.hold] if self.hold else safe)

    def finish(self, final_text: str) -> str:
        """The rest of the final text (the deltas sent are a prefix of it)."""
        if not final_text.startswith(self.sent):  # cannot happen with byte-level decoding; never send twice
            return ""
        rest, self.sent = final_text[len(self.sent):], final_text
        return rest

    def _send(self, safe: str) -> str:
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta


class ThinkingSplit:
    """Deltas of a reply cut into (thinking, answer) at `</think>`: all answer unless the prompt `opened` a
    think block (`qmtp.chat.opens_thinking`); thinking up to the tag, answer after it, the tag in neither."""

    def __init__(self, opened: bool):
        self.thinking = opened
        self.held = ""

    def feed(self, delta: str) -> tuple[str, str]:
        if not self.thinking:
            return "", delta
        self.held += delta
        at = self.held.find(END_THINK)
        if at >= 0:
            thought, answer = self.held[:at], self.held[at + len(END_THINK):]
            self.thinking, self.held = False, ""
            return thought, answer
        keep = next((n for n in range(min(len(END_THINK) - 1, len(self.held)), 0, -1)
                     if END_THINK.startswith(self.held[-n:])), 0)
        thought, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return thought, ""

    def finish(self) -> tuple[str, str]:
        """What was held back: thinking cut short (no `</think>` came)."""
        thought, self.held = self.held, ""
        return thought, ""


def split_reply(text: str, opened: bool) -> tuple[str, str]:
    """(thinking, answer) of a whole reply, cut as the stream cuts it."""
    splitter = ThinkingSplit(opened)
    thought, answer = splitter.feed(text)
    rest, _ = splitter.finish()
    return thought + rest, answer
