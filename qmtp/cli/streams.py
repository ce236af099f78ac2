"""Text printed as its tokens arrive: a plain continuation (`TextStream`), or a reply with its thinking shown
apart from its answer (`ChatStream`)."""

from __future__ import annotations

import os
import sys

from ..text import ReplyText, stop_prefix


def print_delta(shown: str, text: str, file) -> None:
    """Print what `text` adds to `shown`; if decoding changed what was shown (rare), the rest from where the two part."""
    common = len(shown) if text.startswith(shown) else len(os.path.commonprefix([text, shown]))
    print(text[common:], end="", file=file, flush=True)


class TextStream:
    """Prints a generation's text as its tokens arrive (a step of the real model can take seconds), as the
    reply's text machine (`qmtp.text.ReplyText`) lets it out: an incomplete character waits for the next step,
    and so does an end that may be the start of a stop string."""

    def __init__(self, tokenizer, ends=None, stops=()):
        self.tokenizer, self.shown = tokenizer, ""
        self.reply = ReplyText(tokenizer, frozenset(ends) if ends is not None else tokenizer.end_ids, tuple(stops))

    def add(self, tokens: list[int]) -> None:
        self.reply.take(tokens)
        if self.reply.delta():
            self._show(self.reply.sent)

    def finish(self, text: str) -> None:
        self._show(text)
        print(flush=True)

    def _show(self, text: str) -> None:
        print_delta(self.shown, text, sys.stdout)
        self.shown = text


class ChatStream(TextStream):
    """Prints a reply as its tokens arrive, the thinking apart from the answer: the thinking on stderr between
    lines `[thinking]` and `[/thinking]` (or not at all, `hide`), the answer on stdout. `opened`: the prompt left
    the reply inside a think block (thinking on); a reply may also open one itself."""

    def __init__(self, tokenizer, ends, stops, opened: bool, hide: bool = False):
        super().__init__(tokenizer, ends, stops)
        self.opened, self.hide = opened, hide
        self.thinking, self.state = "", "before"  # state: before, thinking (its block open), after

    def _show(self, text: str, final: bool = False) -> None:
        from ..chat import END_THINK, THINK, split_thinking

        if not final and not self.opened and THINK.startswith(text.lstrip()):
            return  # the reply may be opening a think block itself: wait and see
        thinks = self.opened or text.lstrip().startswith(THINK)
        done = END_THINK in text or not thinks
        if not done and not final:  # an end that may be the start of </think> waits for the next step
            text = text[:len(text) - stop_prefix(text, (END_THINK,))]
        thinking, answer = split_thinking(text, self.opened)
        if thinks and not self.hide and (thinking or done) and self.state == "before":
            print("[thinking]", file=sys.stderr, flush=True)
            self.state = "thinking"
        if self.state == "thinking":
            print_delta(self.thinking, thinking, sys.stderr)
            if done or final:
                print("\n[/thinking]", file=sys.stderr, flush=True)
                self.state = "after"
        self.thinking = thinking
        print_delta(self.shown, answer, sys.stdout)
        self.shown = answer

    def finish(self, text: str) -> tuple[str, str]:
        """Show the rest of the reply (`text`, the generation's); return its (thinking, answer)."""
        from ..chat import split_thinking

        self._show(text, final=True)
        print(flush=True)
        return split_thinking(text, self.opened)
