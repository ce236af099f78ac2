"""The compiled traces of decoding: one bounded cache per set of weights they read.

`mx.compile` traces a function once per shape and constant it closes over, and a trace holds the graph it
recorded. Decoding compiles its step per width, per row's sampler and cap (a sampler's temperature or top-p is a
constant of the trace) and per prompt-reading pattern, and the prefill compiles its chunk passes. A server whose
clients each send another temperature would keep one trace per value for as long as it runs, so the traces are
kept least recently used first, at most `Traces.limit` of them.

The cache lives with the weights the traces read: the drafting head's (`model.mtp`, or an ablation head an
`Engine` brings, whose traces go with it), or the model's when no head is read. A generation, a batch and the
server use the same one: `qmtp.generate` builds a batch of one per call, so traces kept by the batch object
would be traced again at every call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

LIMIT = 64  # traces kept per owner: every width x a few samplers x the prompt-reading patterns of a batch


class Traces:
    """Compiled functions by key, the least recently used dropped beyond `limit`; counts what it traced."""

    def __init__(self, limit: int = LIMIT):
        self.limit = limit
        self._traces: OrderedDict[Hashable, Callable] = OrderedDict()
        self.built = 0  # functions built (each traces at its first call)
        self.dropped = 0  # functions dropped to stay within the limit

    def get(self, key: Hashable, build: Callable[[], Callable]) -> Callable:
        """The function kept under `key`, or `build()`'s, kept from now on."""
        function = self._traces.get(key)
        if function is not None:
            self._traces.move_to_end(key)
            return function
        function = self._traces[key] = build()
        self.built += 1
        while len(self._traces) > self.limit:
            self._traces.popitem(last=False)
            self.dropped += 1
        return function

    def clear(self) -> None:
        self._traces.clear()

    def __len__(self) -> int:
        return len(self._traces)


def traces_of(owner) -> Traces:
    """The traces kept with `owner` (a model or a head: an `nn.Module`), made on first use."""
    return owner.__dict__.setdefault("_traces", Traces())
