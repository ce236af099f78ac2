"""The compiled traces of decoding: bounded, kept with the weights they read, freed with them."""

import gc
import weakref

import pytest

import qmtp
from qmtp import mtp
from qmtp.traces import Traces, traces_of


@pytest.fixture(scope="module")
def bundled():
    return qmtp.load()


def test_the_least_recently_used_trace_goes_first():
    traces = Traces(limit=2)
    built = []

    def build(name):
        return lambda: built.append(name) or name

    assert traces.get("a", build("a")) == "a" and traces.get("b", build("b")) == "b"
    assert traces.get("a", build("a again")) == "a"  # kept: not built again, and now the most recent
    traces.get("c", build("c"))
    assert built == ["a", "b", "c"] and len(traces) == 2 and traces.dropped == 1
    assert traces.get("a", build("a again")) == "a"  # "b" went, "a" stayed
    assert traces.get("b", build("b again")) == "b again"


def test_a_server_of_many_temperatures_keeps_a_bounded_number_of_traces(bundled, monkeypatch):
    """A trace per sampler value: each new temperature traces the step again, and the oldest go past the limit;
    a dropped trace is traced again when its sampler comes back, with the same tokens."""
    traces = traces_of(bundled.mtp)
    monkeypatch.setattr(traces, "limit", 3)
    prompt = "Once upon a time"
    first = qmtp.generate(bundled, prompt, max_tokens=12, n_draft=3, temperature=0.5, seed=1)
    for temperature in (0.6, 0.7, 0.8, 0.9):
        qmtp.generate(bundled, prompt, max_tokens=12, n_draft=3, temperature=temperature, seed=1)
        assert len(traces) <= 3
    assert traces.dropped >= 2
    again = qmtp.generate(bundled, prompt, max_tokens=12, n_draft=3, temperature=0.5, seed=1)
    assert again.tokens == first.tokens


def test_an_ablation_heads_traces_are_freed_with_it(bundled):
    head = mtp.without_routed_experts(bundled.mtp)
    plain = qmtp.generate(bundled, "The old dog", max_tokens=10)
    drafted = qmtp.generate(bundled, "The old dog", max_tokens=10, n_draft=3, engine=qmtp.Engine(head=head))
    assert drafted.tokens == plain.tokens and len(traces_of(head)) > 0
    gone = weakref.ref(head)
    del head
    gc.collect()
    assert gone() is None  # nothing the model keeps holds it (or its traces)
