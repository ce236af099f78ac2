"""A reply's tokens as text: the one text machine of `generate`, the batch, the server and the CLI.

Tokens arrive a step at a time (several per step when drafts are kept), and a character may span tokens. Each
token is decoded once, as it comes (`tokenizers`' `DecodeStream`, which gives the text a token adds once its
characters are complete, and nothing while one is still open; `Tokenizer.ends_mid_character` tells bytes that
will never make a character from one still being decoded). The reply ends at its first end id, at
`max_tokens`, or at the token that completes a stop string, its text cut before the stop; a stop string is
searched where it could straddle the tokens just added.

Text handed out while the reply goes on (`delta`) is never taken back: it holds back an incomplete character
and any end of the text that may be the start of a stop string, so the deltas joined are exactly the final
text, whatever the stop strings and however the tokens split them. `ThinkingSplit` cuts the same deltas at
`</think>` (held back while the tag may be starting), so streamed thinking + `</think>` + answer is the final
text too.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from .chat import END_THINK


def find_stop(text: str, stops: tuple[str, ...], start: int = 0) -> int:
    """Where the first stop string in `text` begins (searching from `start`), or -1."""
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else -1


def stop_prefix(text: str, stops: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that begins some stop string (0 if none): what may still grow
    into a stop."""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
               default=0)


class ReplyText:
    """A reply's tokens and text as they come (`take`), where it ends and why, and the text safe to send.

    tokenizer: a `qmtp.tokenizer.Tokenizer` (None: tokens only, no text and no stop strings); eos: ids that end
    the reply (kept as its last token, left out of the text); stops: stop strings; max_tokens: None for no
    limit."""

    def __init__(self, tokenizer, eos=frozenset(), stops: tuple[str, ...] = (), max_tokens: int | None = None):
        self.tokenizer, self.eos, self.stops, self.max_tokens = tokenizer, frozenset(eos), tuple(stops), max_tokens
        self.tokens: list[int] = []  # the reply's tokens (its end id included; none past the stop's last)
        self.settled = ""  # the text of the tokens decoded so far, complete characters only (before any stop)
        self.finish_reason: str | None = None  # "end", "stop" or "length" once done
        self._stream = DecodeStream(skip_special_tokens=False) if tokenizer is not None else None
        self._sent = 0  # characters of `settled` handed out by `delta`
        self._open: list[int] = []  # tokens whose text is not complete yet (a character spans them)
        self._fed = 0  # tokens decoded so far

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def take(self, tokens: list[int]) -> list[int]:
        """Add a step's tokens; the ones that are part of the reply (none past an end id, `max_tokens` or the
        token completing a stop string). Without stop strings nothing is decoded here: the text is decoded
        when it is read (`delta`, `text`), so a generation nobody streams pays no decoding per step."""
        kept = []
        for token in tokens:
            if self.done:
                break
            self.tokens.append(token)
            kept.append(token)
            if token in self.eos:
                self.finish_reason = "end"
                break
            if self.stops:
                self._catch_up()
                if self.done:
                    break
            if self.max_tokens is not None and len(self.tokens) >= self.max_tokens:
                self.finish_reason = "length"
        return kept

    def _catch_up(self) -> None:
        """Decode the tokens taken and not decoded yet, each once, cutting the text at the first stop string
        (searched only where one could straddle the text just added)."""
        while self._stream is not None and self._fed < len(self.tokens) and self.finish_reason != "stop":
            token = self.tokens[self._fed]
            self._fed += 1
            piece = None if token in self.eos else self._decoded(int(token))
            if not piece:
                continue
            before = len(self.settled)
            self.settled += piece
            at = find_stop(self.settled, self.stops, max(0, before - max(map(len, self.stops)) + 1)) \
                if self.stops else -1
            if at >= 0:
                self.settled, self.finish_reason = self.settled[:at], "stop"

    def _decoded(self, token: int) -> str | None:
        """The text `token` completes (None while a character is still open). Bytes that can start no character
        (a lone continuation byte) are U+FFFD for good as soon as they come, as a whole decode shows them: the
        stream, which would wait for the next token to show them, starts again after them."""
        self._open.append(token)
        piece = self._stream.step(self.tokenizer.backend, token)
        if piece is None and not self.tokenizer.ends_mid_character(self._open):
            piece = self.tokenizer.decode(self._open)
            self._stream = DecodeStream(skip_special_tokens=False)
        if piece is not None:
            self._open = []
        return piece

    @property
    def text(self) -> str:
        """The reply's text so far, an incomplete last character shown as U+FFFD (as a whole decode shows it),
        cut before a stop string once one is found."""
        if self.tokenizer is None:
            return ""
        if self.finish_reason == "stop":
            return self.settled
        return self.tokenizer.decode([t for t in self.tokens if t not in self.eos])

    def delta(self) -> str:
        """The text not handed out yet that can be sent now: never a character still incomplete, nor, while the
        reply goes on, an end that may be the start of a stop string; all the rest once it is done."""
        self._catch_up()
        safe = self.text if self.done else self.settled[:len(self.settled) - stop_prefix(self.settled, self.stops)]
        if len(safe) <= self._sent:
            return ""
        delta, self._sent = safe[self._sent:], len(safe)
        return delta


    @property
    def sent(self) -> str:
        """The text `delta` has handed out so far."""
        self._catch_up()
        return (self.text if self.done else self.settled)[:self._sent]

    def finish(self, final_text: str) -> str:
        """The rest of `final_text` (the reply as its generation ended it, which may have stopped at
        `max_tokens` where this one was not told of it) after what `delta` handed out."""
        sent = self.sent
        if not final_text.startswith(sent):  # cannot happen for the same tokens; never send text twice
            return ""
        self._sent = len(final_text)
        return final_text[len(sent):]


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
        keep = stop_prefix(self.held, (END_THINK,))
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
