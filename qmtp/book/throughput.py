"""The cost model of a decode step: bytes read, time, and what speculative decoding can gain.

Decoding is memory-bound on the machines this model is run on: a pass multiplies each weight it touches by a
handful of vectors, so its time is the time to read those weights (and the cached state), plus a fixed cost per
pass that does not depend on the model's width (dispatching kernels, Python, synchronising with the host).

**1. Experts a pass touches.** A verify pass over n tokens in a top-k of E MoE layer reads the union of the
experts its tokens chose. If each token chose k distinct experts independently and uniformly, an expert is
missed by all n tokens with probability (1 - k/E)^n, so the expected union is

    U(n) = E (1 - (1 - k/E)^n)                                                        (`expected_union`)

8 for one token, about 15.75 for two at E=256, k=8. Real routing is correlated between neighbouring tokens,
so measured unions are smaller; `qmtp.book.bench.mtp` measures them per layer.

**2. Bytes a pass reads** (`trunk_pass_bytes`), from the stored size of every tensor (`qmtp.sizes`):
every weight of the mixers (attention or gated DeltaNet), the routers, the shared experts, the final norm and
all of lm_head, once per pass however many tokens it holds (they multiply all n tokens in one matmul); U(n) of
the E routed experts in each layer; n rows of embed_tokens; the KV cache of each full-attention layer at the
context length, and each DeltaNet layer's recurrent state S [Hv, Dk, Dv] and conv state (read and written).
One draft step of the head (`head_step_bytes`) reads the head's own weights with k of its experts, its KV
cache, one embedding row and, again, all of lm_head.

**3. Time of a pass** (`Machine.seconds`): bytes / bandwidth + overhead. At the real model's widths the first
term dominates (the memory-bound regime); at the tiny model's widths a pass moves a few megabytes and its time
is almost all overhead (the dispatch regime). `fit_machine` recovers both numbers from measured pass times
where time follows bytes. Where it does not (the tiny model on a CPU: each token of a pass adds operations to
dispatch, while its bytes hardly grow), the line of time against bytes crosses zero bytes below zero seconds,
`fit_machine` can only clamp the overhead at 0 and the line through the origin is flatter than the data;
`fit_loop` prices a step by its tokens instead, plus what the decoding loop adds to every step (`LoopModel`).

**4. Speedup.** With per-position acceptance rates a_1, a_2, ... (a draft at position i is proposed only if
the ones before it were accepted), a step that verifies k = n_draft - 1 drafts emits on average

    tau = 1 + sum_{i=1..k} prod_{j<=i} a_j                                   (`adaptive.expected_tokens_per_pass`)

tokens and costs one trunk pass over n_draft tokens plus k head steps, against tau plain passes:

    speedup = tau * t_trunk(1) / (t_trunk(n_draft) + k * t_head)                      (`predicted_speedup`)

For a dense model of equal active size the verify pass reads the same weights as a one-token pass (U(n) = k
for every n), so only the head's cost stands against tau; for the MoE the union of experts grows with n and
eats most of the gain.

**A fixed cost per pass** moves the speedup either way, depending on who pays it. Paid once per step (by the
verify pass, the head's drafts sharing it, as in one compiled step), it is shared by the tau tokens of a step
and raises the speedup towards tau. Paid by every head draft as well, a step at n_draft pays it n_draft times
for tau < n_draft tokens, and it lowers the speedup towards tau / n_draft (`Machine.overhead`,
`Machine.head_overhead`; `overhead_effect` computes both).

**6. One bytes-only prediction for a machine** (`machine_prediction`): every page that prices MTP on a machine
whose pass costs its bytes (chapter 6, chapter 8's published rows, chapter 9) calls it, with the same
assumptions: the real config, its trunk at
`bits`, its head in bf16 (`HEAD_BITS`), purely memory-bound (no fixed cost), and the acceptance of `rates_for`
(`ACCEPTANCE_RULE` says it in words). Chapter 9's N machines (point 5) take the same head and acceptance. No
published engine runs this fast; `qmtp.book.cost_model` adds each machine's own overhead, calibrated by its
plain figure, and is the model the findings' bottom line rests on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..adaptive import expected_tokens_per_pass
from ..config import FULL, LINEAR, ModelConfig
from ..sizes import SizeReport, sizes
from .claimed import CLAIMS

GB = 1e9
HEAD_BITS = None  # the head in bf16: as this book converts it (chapter 4) and as the published engines load it
DEFAULT_CONTEXT = 4096  # tokens in the cache while decoding, where a page does not know them


# ---- 1. experts a pass touches --------------------------------------------------------------------------------
def expected_union(n_experts: int, top_k: int, n_tokens: int) -> float:
    """Expected number of distinct experts n tokens touch under independent uniform top-k routing."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** n_tokens)


def geometric_rates(first: float, second: float, n: int) -> list[float]:
    """n per-position rates starting first, second and shrinking by the same ratio: a way to extend two
    reported rates (e.g. 0.78 at n_draft=2 and 0.59 at n_draft=3) to longer drafts."""
    ratio = second / first
    return [first * ratio**i for i in range(n)]


# ---- 2. bytes a pass reads ------------------------------------------------------------------------------------
def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "layers" else None


def _union_per_layer(config: ModelConfig, n_tokens: int, union) -> list[float]:
    """The experts read per MoE layer: `union` as given (a number or one per layer), else the formula."""
    if union is None:
        union = expected_union(config.num_experts, config.num_experts_per_tok, n_tokens)
    if isinstance(union, (int, float)):
        return [float(union)] * config.num_hidden_layers
    union = [float(u) for u in union]
    if len(union) != config.num_hidden_layers:
        raise ValueError(f"union has {len(union)} entries for {config.num_hidden_layers} layers")
    return union


def state_bytes(config: ModelConfig, context: int, n_tokens: int = 1, cache_bytes: int = 2,
                recurrent_bytes: int = 4) -> dict[str, float]:
    """Bytes of cached state a trunk pass reads and writes.

    "KV cache": each full-attention layer reads keys and values of `context` earlier positions and writes those
    of its `n_tokens` new ones: 2 (K and V) * positions * kv heads * head_dim * cache_bytes.
    "linear state": each DeltaNet layer reads and writes its recurrent state S [Hv, Dk, Dv] (float32) once
    per pass (a fused kernel keeps S on chip across the pass's tokens) and its last K-1 conv inputs
    (cache_bytes each). cache_bytes: 2 for bf16 activations, 4 for float32 (qmtp on the CPU).
    """
    kinds = config.layer_types
    n_full, n_linear = kinds.count(FULL), kinds.count(LINEAR)
    per_position = 2 * config.num_key_value_heads * config.head_dim * cache_bytes
    kv = n_full * per_position * (context + n_tokens)
    S = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * recurrent_bytes
    conv = (config.linear_conv_kernel_dim - 1) * config.linear_conv_dim * cache_bytes
    return {"KV cache": float(kv), "linear state": float(n_linear * 2 * (S + conv))}


def trunk_pass_bytes(config: ModelConfig, report: SizeReport, n_tokens: int = 1, context: int = 0,
                     union=None, cache_bytes: int = 2) -> dict[str, float]:
    """Bytes one trunk pass over `n_tokens` tokens reads, by term (see the module docstring, point 2).

    `union`: experts read per layer (a number, or one per layer, e.g. measured); default: the
    independent-routing formula U(n_tokens). `context`: positions already in the caches. `cache_bytes`:
    bytes per cached number (`state_bytes`).
    """
    E = config.num_experts
    experts = _union_per_layer(config, n_tokens, union)
    out: dict[str, float] = {}
    for t in report.tensors:
        if t.is_head:
            continue
        if t.category == "routed experts":
            nbytes = t.nbytes / E * min(experts[_layer_of(t.name)], E)
        elif t.category == "embeddings":
            nbytes = t.nbytes / config.vocab_size * n_tokens  # one row per token
        else:
            nbytes = t.nbytes
        out[t.category] = out.get(t.category, 0.0) + nbytes
    out.update(state_bytes(config, context, n_tokens, cache_bytes))
    return out


def total(breakdown: dict[str, float]) -> float:
    """The bytes of a breakdown, all terms together."""
    return math.fsum(breakdown.values())


def head_step_bytes(config: ModelConfig, report: SizeReport, context: int = 0, cache_bytes: int = 2) -> dict[str, float]:
    """Bytes one draft step of the MTP head reads: its own weights with k of its E experts, its KV cache at
    `context` positions, one embedding row, and the trunk's lm_head (shared) to score the draft."""
    E, k = config.num_experts, config.num_experts_per_tok
    out: dict[str, float] = {}
    for t in report.tensors:
        if t.is_head:
            nbytes = t.nbytes / E * k if t.category == "routed experts" else t.nbytes
        elif t.category == "embeddings":
            nbytes = t.nbytes / config.vocab_size
        elif t.category == "lm_head":
            nbytes = t.nbytes
        else:
            continue
        out[t.category] = out.get(t.category, 0.0) + nbytes
    out["KV cache"] = float(2 * config.num_key_value_heads * config.head_dim * cache_bytes * (context + 1))
    return out


def sizes_of(model) -> SizeReport:
    """The bytes every weight of a loaded `qmtp.Model` occupies in memory (what a pass really reads: float32
    on the CPU, or codes + scales + biases when quantized), as a report shaped like `qmtp.sizes.sizes`."""
    from mlx.utils import tree_flatten

    from ..sizes import TensorSize, category

    parts: dict[str, dict] = {}
    for name, w in tree_flatten(model.parameters()):
        base, _, leaf = name.rpartition(".")
        key = f"{base}.weight" if leaf in ("scales", "biases") else name
        parts.setdefault(key, {})[leaf] = w
    tensors = []
    for name, arrays in parts.items():
        weight = arrays.get("weight", next(iter(arrays.values())))
        shape = tuple(weight.shape)
        tensors.append(TensorSize(name, shape, category(name, shape), None, None, sum(a.nbytes for a in arrays.values())))
    return SizeReport.of(tensors, {"source": "model in memory"})


# ---- 3. time of a pass ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Machine:
    """What a pass costs: bytes / bandwidth + a fixed overhead (per trunk pass, and per head step)."""

    bandwidth: float  # bytes per second
    overhead: float = 0.0  # seconds per trunk pass that do not depend on bytes
    head_overhead: float = 0.0  # the same for one head draft step

    def seconds(self, nbytes: float, head: bool = False) -> float:
        return nbytes / self.bandwidth + (self.head_overhead if head else self.overhead)


def fit_machine(trunk_bytes, trunk_seconds, head_bytes=None, head_seconds=None) -> Machine:
    """Least-squares fit of t = overhead + bytes / bandwidth to measured trunk passes (at least two sizes of
    pass, e.g. verify passes over 2..5 tokens), with overhead >= 0; the head's overhead is then its mean time
    left over (>= 0).

    At the tiny model's widths the fitted "bandwidth" is not the memory's: it is the rate at which the
    extra work of a longer pass (more tokens, more experts) costs time, most of it dispatching more kernels.
    """
    n = len(trunk_bytes)
    if n < 2 or len(trunk_seconds) != n:
        raise ValueError("fit_machine needs at least two (bytes, seconds) pairs of trunk passes")
    mb, ms = sum(trunk_bytes) / n, sum(trunk_seconds) / n
    sxx = sum((b - mb) ** 2 for b in trunk_bytes)
    sxy = sum((b - mb) * (s - ms) for b, s in zip(trunk_bytes, trunk_seconds))
    if sxx == 0 or sxy <= 0:
        raise ValueError("pass times do not grow with bytes: the fit has no bandwidth to find")
    per_byte = sxy / sxx
    overhead = ms - per_byte * mb
    if overhead < 0:  # no overhead is the least a pass can have: fit the line through the origin instead
        per_byte = sum(b * s for b, s in zip(trunk_bytes, trunk_seconds)) / sum(b * b for b in trunk_bytes)
        overhead = 0.0
    head_overhead = 0.0
    if head_bytes:
        left = [s - b * per_byte for b, s in zip(head_bytes, head_seconds)]
        head_overhead = max(0.0, sum(left) / len(left))
    return Machine(bandwidth=1.0 / per_byte, overhead=overhead, head_overhead=head_overhead)


def fit_line(x, y) -> tuple[float, float]:
    """Ordinary least squares y = a + b x, nothing constrained: (a, b). `fit_machine` clamps a at zero; this
    is the line the data draw, whose intercept says whether a pass's time follows its bytes at all: a negative
    intercept means the time grows faster than the bytes, so some other cost (tokens) is in charge."""
    n = len(x)
    if n < 2 or len(y) != n:
        raise ValueError("fit_line needs at least two (x, y) pairs")
    mx_, my = sum(x) / n, sum(y) / n
    sxx = sum((v - mx_) ** 2 for v in x)
    if sxx == 0:
        raise ValueError("fit_line needs at least two different x")
    slope = sum((a - mx_) * (b - my) for a, b in zip(x, y)) / sxx
    return my - slope * mx_, slope


@dataclass(frozen=True)
class LoopModel:
    """What one step of the decoding loop costs on a machine where a pass's time follows its tokens, not its
    bytes (the tiny model on a CPU: every operation is dispatched, and each token of a pass adds its share):

        step(n_draft) = loop_overhead + pass_fixed + pass_per_token * n_draft + (n_draft - 1) * head_per_draft

    `pass_fixed` and `pass_per_token` are the line through the verify passes timed alone; `head_per_draft`
    the mean head draft step timed alone; `loop_overhead` what a step of the loop costs beyond its passes
    (calling the compiled step, queueing it, reading its report, the host's books), taken from plain decoding:
    its step in the loop (1 / tokens per second) less the line's pass at one token. So step(1) is plain
    decoding's step exactly, and every other width is predicted from it."""

    loop_overhead: float
    pass_fixed: float
    pass_per_token: float
    head_per_draft: float

    def pass_seconds(self, n_draft: int) -> float:
        return self.pass_fixed + self.pass_per_token * n_draft

    def step_seconds(self, n_draft: int) -> float:
        return self.loop_overhead + self.pass_seconds(n_draft) + (n_draft - 1) * self.head_per_draft

    def speedup(self, tokens_per_pass: float, n_draft: int) -> float:
        """Tokens per second at `n_draft` over plain decoding's."""
        return tokens_per_pass * self.step_seconds(1) / self.step_seconds(n_draft)


def fit_loop(tokens, pass_seconds, head_seconds, plain_step_seconds: float) -> LoopModel:
    """`LoopModel` from verify passes over `tokens` tokens timed alone (at least two widths), head draft
    steps timed alone, and plain decoding's step in the loop (seconds per token)."""
    fixed, per_token = fit_line(list(tokens), list(pass_seconds))
    head = sum(head_seconds) / len(head_seconds) if head_seconds else 0.0
    return LoopModel(plain_step_seconds - (fixed + per_token), fixed, per_token, head)


# ---- 4. speedup -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prediction:
    n_draft: int
    tokens_per_pass: float  # tau
    trunk_bytes: float  # one verify pass over n_draft tokens
    head_bytes: float  # all n_draft - 1 head steps of one step
    step_seconds: float  # one trunk pass + its head steps
    plain_seconds: float  # one plain decoding pass
    tokens_per_second: float
    speedup: float  # over plain decoding on the same machine


def predicted_speedup(config: ModelConfig, report: SizeReport, rates, n_draft: int, machine: Machine,
                      context: int = 0, union=None, dense: bool = False, cache_bytes: int = 2) -> Prediction:
    """Speculative decoding at `n_draft` against plain decoding (module docstring, point 4).

    rates: per-position acceptance rates (at least n_draft - 1 of them). union: experts per layer for the
    verify pass (number or per-layer list); default the independent-routing formula. dense=True: a dense
    model of the same active size, whose verify pass reads the experts of one token (U = k) at any n_draft.
    """
    k = n_draft - 1
    rates = list(rates)
    if len(rates) < k:
        raise ValueError(f"n_draft={n_draft} needs {k} acceptance rates, got {len(rates)}")
    tau = expected_tokens_per_pass(rates[:k])
    one_token = config.num_experts_per_tok
    plain = total(trunk_pass_bytes(config, report, 1, context, one_token, cache_bytes))
    trunk = total(trunk_pass_bytes(config, report, n_draft, context, one_token if dense else union, cache_bytes))
    head = k * total(head_step_bytes(config, report, context, cache_bytes))
    t_plain = machine.seconds(plain)
    t_step = machine.seconds(trunk) + (k * machine.seconds(head / k, head=True) if k else 0.0)
    return Prediction(n_draft, tau, trunk, head, t_step, t_plain, tau / t_step, tau * t_plain / t_step)


def real_model_table(bits=(4, 8), bandwidth: float = 256 * GB, rates=None, n_drafts=range(1, 6),
                     context: int = DEFAULT_CONTEXT, overhead: float = 0.0, head_overhead: float | None = None,
                     mtp_bits=None, config: ModelConfig | None = None) -> list[dict]:
    """Predicted tokens/s and speedup vs n_draft for Qwen3.6-35B-A3B (MoE) and a dense model of equal active
    size, at each trunk width in `bits`, on a machine of `bandwidth` bytes/s (`machine_prediction`).

    rates: per-position acceptance; default `reported_rates`. mtp_bits: None (the head in bf16, `HEAD_BITS`),
    "same" (the head at the trunk's width) or a width. overhead: seconds per trunk pass beyond reading bytes;
    head_overhead: the same per head step (default: equal to overhead).
    """
    n_drafts = list(n_drafts)
    rows = []
    for b in bits:
        head = b if mtp_bits == "same" else mtp_bits
        for n in n_drafts:
            for model, dense in (("MoE", False), ("dense, same active size", True)):
                p = machine_prediction(bandwidth, n, bits=b, context=context, rates=rates, dense=dense,
                                       overhead=overhead, head_overhead=head_overhead, mtp_bits=head,
                                       config=config)
                rows.append({
                    "bits": b, "model": model, "n_draft": n, "tokens_per_pass": p.tokens_per_pass,
                    "trunk_GB": p.trunk_bytes / GB, "head_GB": p.head_bytes / GB,
                    "step_ms": p.step_seconds * 1e3, "tokens_per_second": p.tokens_per_second,
                    "speedup": p.speedup,
                })
    return rows


# ---- 5. the experts spread over N machines (`qmtp.parallel`) ------------------------------------------------------
# Each of N ranks holds E/N experts of every MoE layer and everything else whole, and reads from its own memory
# while the others read theirs: a pass takes as long as its busiest rank, plus one all_sum per MoE layer. A
# verify pass over n tokens reads the union of their experts; spread over N machines, each reads its share of
# that union in parallel, so the union's growth with n costs each machine 1/N of what it costs one. The
# replicated part (mixers, routers, shared experts, lm_head) is read whole by every rank and does not shrink.
# This assumes one rank per machine: ranks sharing a machine share its memory bandwidth and cores.
def busiest_rank_experts(n_experts: int, top_k: int, n_tokens: int, ranks: int) -> float:
    """Expected experts of one layer the busiest of `ranks` ranks reads in a pass over `n_tokens` tokens.

    Under independent uniform routing each expert is in the pass's union with probability
    p = 1 - (1 - k/E)^n (`expected_union` / E); taking the experts as independent, a rank's count is
    Binomial(E/N, p) and the expected largest of N such counts is sum_{m>=0} (1 - F(m)^N), F the binomial CDF.
    With N > 1, a rank also reads the first expert of its block for the chosen experts it does not hold (their
    rows are computed there and thrown away, so the step keeps fixed shapes): one more expert, unless it is in
    the union already (probability p)."""
    if n_experts % ranks:
        raise ValueError(f"{n_experts} experts do not split over {ranks} ranks")
    if ranks == 1:
        return expected_union(n_experts, top_k, n_tokens)
    held = n_experts // ranks
    p = 1.0 - (1.0 - top_k / n_experts) ** n_tokens
    cdf, below, expected_max = 0.0, [], 0.0
    for m in range(held + 1):
        cdf += math.comb(held, m) * p**m * (1 - p) ** (held - m)
        below.append(min(cdf, 1.0))
    expected_max = sum(1.0 - f**ranks for f in below[:-1])
    return expected_max + (1.0 - p)


def parallel_pass_seconds(config: ModelConfig, report: SizeReport, n_tokens: int, ranks: int, machine: Machine,
                          all_sum_seconds: float, context: int = 0, cache_bytes: int = 2) -> float:
    """Seconds of one trunk pass over `n_tokens` tokens with the experts over `ranks` machines of `machine`'s
    bandwidth: the busiest rank's bytes (the replicated part, and `busiest_rank_experts` of each layer) over
    the bandwidth, the machine's overhead, and one all_sum per MoE layer (`all_sum_seconds` each)."""
    E, k, L = config.num_experts, config.num_experts_per_tok, config.num_hidden_layers
    breakdown = trunk_pass_bytes(config, report, n_tokens, context, 0, cache_bytes)  # 0 experts: the rest
    per_expert = report.trunk["routed experts"] / (E * L)
    experts = L * per_expert * busiest_rank_experts(E, k, n_tokens, ranks)
    return machine.seconds(total(breakdown) + experts) + (L * all_sum_seconds if ranks > 1 else 0.0)


def parallel_head_seconds(config: ModelConfig, report: SizeReport, ranks: int, machine: Machine,
                          all_sum_seconds: float, context: int = 0, cache_bytes: int = 2) -> float:
    """Seconds of one head draft step over `ranks` machines: its replicated part, the busiest rank's share of
    the k experts one token chooses, and the head layer's one all_sum."""
    E, k = config.num_experts, config.num_experts_per_tok
    whole = head_step_bytes(config, report, context, cache_bytes)
    routed = report.head["routed experts"]
    replicated = total(whole) - routed / E * k
    experts = routed / E * busiest_rank_experts(E, k, 1, ranks)
    return machine.seconds(replicated + experts, head=True) + (all_sum_seconds if ranks > 1 else 0.0)


# ---- 6. one prediction for a machine, the same on every page --------------------------------------------------
def reported_rates(positions: int) -> list[float]:
    """Per-position acceptance rates a_1, a_2, ... from the two reported overall rates (`CLAIMS`).

    An engine's "acceptance" is drafts accepted over drafts proposed; with every step proposing n_draft - 1
    drafts, tokens per pass are 1 + (n_draft - 1) * acceptance. So 0.78 at n_draft=2 is a_1, and 0.59 at
    n_draft=3 is (a_1 + a_1 a_2) / 2, which gives a_2; later positions shrink by the same ratio a_2 / a_1."""
    overall_2 = CLAIMS["acceptance_n_draft_2"].value
    overall_3 = CLAIMS["acceptance_n_draft_3"].value
    second = 2 * overall_3 / overall_2 - 1
    return geometric_rates(overall_2, second, positions)


def constant_rate(tokens_per_pass: float, drafts: int) -> float:
    """The one per-position rate a with 1 + a + a^2 + ... + a^drafts = tokens_per_pass (bisection)."""
    target = tokens_per_pass - 1.0
    if drafts == 0 or target <= 0:
        return 0.0
    if target >= drafts:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(1, drafts + 1)) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def rates_for(n_draft: int, acceptance: float | None = None) -> list[float]:
    """The per-position rates a prediction at `n_draft` assumes: where an engine's measured acceptance (drafts
    accepted over proposed) is known, the one rate for every position that gives its tokens per pass,
    1 + (n_draft - 1) * acceptance; where none is, `reported_rates`."""
    drafts = n_draft - 1
    if acceptance is None:
        return reported_rates(drafts)
    return [constant_rate(1.0 + drafts * acceptance, drafts)] * drafts


ACCEPTANCE_RULE = (
    "acceptance as the engines count it, drafts accepted over drafts proposed: a run's own where its source "
    "gives one (one rate for every draft position, giving the same tokens per pass), and otherwise {reported}")
REPORTED_ACCEPTANCE = (
    "the reported overall acceptance, {a2:.2f} at n_draft=2 and {a3:.2f} at n_draft=3, read as per-position "
    "rates of {r1:.2f} and {r2:.2f} that shrink by the same ratio at later positions")


def reported_acceptance() -> str:
    """`REPORTED_ACCEPTANCE` with its numbers: the acceptance a prediction assumes where none is given."""
    r1, r2 = reported_rates(2)
    return REPORTED_ACCEPTANCE.format(a2=CLAIMS["acceptance_n_draft_2"].value,
                                      a3=CLAIMS["acceptance_n_draft_3"].value, r1=r1, r2=r2)


def acceptance_rule() -> str:
    """`ACCEPTANCE_RULE` with its numbers: the sentence every page that predicts a speedup shows."""
    return ACCEPTANCE_RULE.format(reported=reported_acceptance())


def machine_prediction(bandwidth: float, n_draft: int, bits: int = 4, context: int = DEFAULT_CONTEXT,
                       acceptance: float | None = None, rates=None, dense: bool = False,
                       overhead: float = 0.0, head_overhead: float | None = None, mtp_bits=HEAD_BITS,
                       config: ModelConfig | None = None) -> Prediction:
    """MTP at `n_draft` against plain decoding for the real config on a machine of `bandwidth` bytes/s.

    The one prediction every page uses (module docstring, point 6): trunk at `bits`, head in bf16, memory-bound
    unless `overhead` (per trunk pass) or `head_overhead` (per head step; default equal to overhead) is given;
    acceptance from `rates_for(n_draft, acceptance)` unless `rates` gives per-position rates."""
    from ..config import QWEN36_35B_A3B

    config = config or QWEN36_35B_A3B
    if rates is None:
        rates = rates_for(n_draft, acceptance)
    report = sizes(config, bits, mtp_bits=mtp_bits)
    machine = Machine(bandwidth, overhead, overhead if head_overhead is None else head_overhead)
    return predicted_speedup(config, report, list(rates), n_draft, machine, context, dense=dense)


def overhead_effect(bandwidth: float, n_draft: int, overhead: float, bits: int = 4,
                    context: int = DEFAULT_CONTEXT) -> dict[str, float]:
    """The memory-bound prediction beside the same with a fixed cost per pass, paid once per step (the verify
    pass alone) or also by every head draft: the direction a fixed cost moves the speedup depends on which."""
    return {
        "memory-bound": machine_prediction(bandwidth, n_draft, bits, context).speedup,
        "once per step": machine_prediction(bandwidth, n_draft, bits, context, overhead=overhead,
                                            head_overhead=0.0).speedup,
        "every pass and draft": machine_prediction(bandwidth, n_draft, bits, context, overhead=overhead,
                                                   head_overhead=overhead).speedup,
    }


# ---- chapter 6's tables: each function returns one Markdown table --------------------------------------------
def _table(rows: list[dict], formats: dict) -> str:
    from .inventory import markdown_table

    return markdown_table(rows, list(rows[0]), formats)


def widths_table(report: dict) -> str:
    """`bench.mtp`'s report, one row per n_draft: decoding speed (median, slowest-fastest round, over plain),
    tokens per trunk pass, a verify pass's and a head draft's time (timed in the same rounds) and the experts a
    verify pass read per layer."""
    rows = [{"n_draft": r["n_draft"], "tok/s": r["tokens_per_second"],
             "slowest-fastest": f"{r['tokens_per_second_min']:.0f}-{r['tokens_per_second_max']:.0f}",
             "vs plain": r["speedup_vs_plain"], "tokens/pass": r["tokens_per_trunk_pass"],
             "verify ms": r["trunk_seconds_per_pass"] * 1e3, "head ms/draft": r["head_seconds_per_draft"] * 1e3,
             "experts/layer": r["experts_per_pass_measured"]} for r in report["results"]]
    return _table(rows, {"tok/s": "{:.0f}", "vs plain": "{:.2f}x", "tokens/pass": "{:.2f}", "verify ms": "{:.2f}",
                         "head ms/draft": "{:.2f}", "experts/layer": "{:.1f}"})


def predictions_table(rows: list[dict], n_drafts=range(2, 6)) -> str:
    """`real_model_table`'s rows, one per trunk width and n_draft: tokens per pass, the MoE's step and speed, and
    the speedup of the MoE and of a dense model of the same active size."""
    by = {(r["bits"], r["model"], r["n_draft"]): r for r in rows}
    table = [{"bits": b, "n_draft": n, "tokens/pass": by[b, "MoE", n]["tokens_per_pass"],
              "MoE ms/step": by[b, "MoE", n]["step_ms"], "MoE tok/s": by[b, "MoE", n]["tokens_per_second"],
              "MoE speedup": by[b, "MoE", n]["speedup"],
              "dense speedup": by[b, "dense, same active size", n]["speedup"]}
             for b in dict.fromkeys(r["bits"] for r in rows) for n in n_drafts]
    return _table(table, {"tokens/pass": "{:.2f}", "MoE ms/step": "{:.1f}", "MoE tok/s": "{:.0f}",
                          "MoE speedup": "{:.2f}x", "dense speedup": "{:.2f}x"})


def loop_model_table(report: dict) -> str:
    """`bench.mtp`'s cost model beside its measurement, one row per n_draft: a step's passes timed alone, the step
    as the loop ran it, the loop model's step, the measured speed, and the speedup measured, from the loop model
    and from the bytes model."""
    speed = {r["n_draft"]: r["tokens_per_second"] for r in report["results"]}
    rows = [{"n_draft": p["n_draft"], "tokens/pass": p["tokens_per_pass"],
             "passes ms": p["measured_step_seconds"] * 1e3, "loop ms": p["loop_step_seconds"] * 1e3,
             "model ms": p["predicted_step_seconds"] * 1e3, "tok/s": speed[p["n_draft"]],
             "measured": p["measured_speedup"], "loop model": p["predicted_speedup"],
             "bytes model": p["bytes_model_speedup"]} for p in report["cost_model"]["predictions"]]
    return _table(rows, {"tokens/pass": "{:.2f}", "passes ms": "{:.1f}", "loop ms": "{:.1f}", "model ms": "{:.1f}",
                         "tok/s": "{:.0f}", "measured": "{:.2f}x", "loop model": "{:.2f}x",
                         "bytes model": "{:.2f}x"})


def real_width_table(report: dict) -> str:
    """`bench.real_width_passes`' rows: each pass's time and bytes, each over the plain pass's."""
    rows = [{"pass": r["pass"], "ms": r["seconds"] * 1e3, "time / plain": r["time_over_plain"],
             "MB read": r["bytes"] / 1e6, "bytes / plain": r["bytes_over_plain"]} for r in report["rows"]]
    return _table(rows, {"ms": "{:.0f}", "time / plain": "{:.2f}x", "MB read": "{:.0f}", "bytes / plain": "{:.2f}x"})
