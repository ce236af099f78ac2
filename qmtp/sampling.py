"""The sampler users configure: temperature, top-k, top-p, min-p and three penalties, as one distribution.

`Sampling` holds the settings; `process` turns a row of logits and the history behind it into the logits
of the distribution a token is drawn from. The order is that of transformers' `generate` (processors, then
warpers), which vLLM follows too:

1. penalties, on the raw logits:
   - repetition (transformers' convention): every token present in the prompt or the generated tokens has
     its logit divided by `repetition_penalty` when positive, multiplied by it when negative;
   - presence and frequency (OpenAI's and vLLM's convention): counting the GENERATED tokens only, a token
     generated c times loses `presence_penalty` once (c > 0) and `frequency_penalty` * c;
2. temperature: the logits divided by it (0 is greedy: the argmax of the penalised logits, and the
   filters below, which never remove the most likely token, change nothing);
3. top-k: the `top_k` most likely tokens kept (ties with the k-th kept too; 0 keeps all);
4. top-p: the smallest set of most likely tokens whose probability reaches `top_p` (1 keeps all);
5. min-p: tokens less likely than `min_p` times the most likely removed (0 keeps all).

Speculative decoding (`qmtp.decoding`) applies the same function to the trunk's logits at every verified
position and to the head's logits at every draft, each with its own history (the drafts before it
included), so the acceptance (coupled or rejection sampling) keeps the output exactly that of sampling the
trunk alone with these settings.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import astuple, dataclass, fields, replace
from pathlib import Path

import mlx.core as mx

from .checkpoint import read_json
from .errors import CheckpointError, UsageError

GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class Sampling:
    """Sampler settings; the defaults are greedy decoding with no penalty.

    `Sampling.of_model(model)` reads the checkpoint's `generation_config.json` (what `generate(...,
    sampling="model")` uses)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1: no top-p filter
    min_p: float = 0.0  # 0: no min-p filter
    presence_penalty: float = 0.0  # per generated token seen at least once (generated tokens only)
    frequency_penalty: float = 0.0  # per occurrence among the generated tokens
    repetition_penalty: float = 1.0  # 1: none; > 1 discourages tokens of the prompt and the generated text

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                at_least = " >= 0" if f.name == "temperature" else ""
                raise UsageError(f"{f.name}={value!r:.40} must be a finite number{at_least}")
            # numpy scalars as Python numbers: they are baked into compiled steps and keys
            object.__setattr__(self, f.name, float(value) if f.name != "top_k" else value)
        if self.temperature < 0:
            raise UsageError(f"temperature={self.temperature} must be >= 0")
        if self.top_k < 0 or int(self.top_k) != self.top_k:
            raise UsageError(f"top_k={self.top_k} must be a whole number >= 0 (0: no top-k filter)")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top_p={self.top_p} must be in (0, 1] (1: no top-p filter)")
        if not 0 <= self.min_p < 1:
            raise UsageError(f"min_p={self.min_p} must be in [0, 1) (0: no min-p filter)")
        if self.repetition_penalty <= 0:
            raise UsageError(f"repetition_penalty={self.repetition_penalty} must be > 0 (1: none)")
        object.__setattr__(self, "top_k", int(self.top_k))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        """Whether a token's distribution depends on the tokens before it (beyond the model's own logits)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def filtered(self) -> bool:
        return bool(self.top_k or self.top_p < 1 or self.min_p)

    @property
    def key(self) -> tuple:
        return astuple(self)

    @classmethod
    def of_model(cls, model) -> Sampling:
        """The settings the checkpoint's `generation_config.json` declares (fields it leaves out keep the
        defaults above; `do_sample: false` is greedy); greedy when the file is absent (a model without a
        path has none). A file that is there but unreadable, not a JSON object, or holding a setting out of
        range is a CheckpointError naming it: never read as greedy."""
        path = Path(model.path) / GENERATION_CONFIG if getattr(model, "path", None) else None
        if path is None or not (path.exists() or path.is_symlink()):
            return cls()
        config = read_json(path, what=GENERATION_CONFIG)  # a directory, a FIFO, bad UTF-8 or JSON: one line
        if not isinstance(config, dict):
            raise CheckpointError(f"{path}: expected a JSON object of generation settings, not a "
                                  f"{type(config).__name__}")
        try:
            return cls.from_generation_config(config)
        except UsageError as err:
            raise CheckpointError(f"{path}: {err}") from None

    @classmethod
    def from_generation_config(cls, config: dict) -> Sampling:
        if not isinstance(config, dict):
            raise UsageError(f"a generation config is a dict of settings, not a {type(config).__name__}")
        do_sample = config.get("do_sample")
        if do_sample is not None and not isinstance(do_sample, bool):
            raise UsageError(f"do_sample={do_sample!r:.40} must be true or false")
        names = {f.name for f in fields(cls)}
        settings = cls(**{k: v for k, v in config.items() if k in names and v is not None})
        if do_sample is False:
            settings = replace(settings, temperature=0.0)
        return settings


def resolve(model, sampling, **overrides) -> Sampling:
    """`generate`'s settings: `sampling` (None: greedy; "model": the checkpoint's generation_config.json; or a
    `Sampling`), with the keyword arguments given (not None) in place of its fields."""
    if sampling is None:
        base = Sampling()
    elif isinstance(sampling, str) and sampling == "model":
        base = Sampling.of_model(model)
    elif isinstance(sampling, Sampling):
        base = sampling
    else:
        raise UsageError(f"sampling={sampling!r:.40}: give None (greedy), 'model' (its generation_config.json) "
                         f"or a qmtp.Sampling")
    given = {k: v for k, v in overrides.items() if v is not None}
    return replace(base, **given) if given else base


# ---- the distribution, on the device -----------------------------------------------------------------------
def one_hot(tokens: mx.array, vocab: int) -> mx.array:
    """Tokens [n] -> [n, vocab] float32 rows with a 1 at each token."""
    return (tokens.reshape(-1, 1) == mx.arange(vocab)[None]).astype(mx.float32)


def penalise(logits: mx.array, counts: mx.array, prompt_seen: mx.array, s: Sampling) -> mx.array:
    """Logits [n, V] with the penalties applied; counts [n, V]: how often each token was generated before
    each row's position; prompt_seen [V]: the tokens of the prompt."""
    # A penalty is a finite number but may be past what the logits' dtype holds (1e300 in float32, 1e5 in
    # float16): it is then inf there, and inf times a count of 0 (or a logit of 0) is NaN, which makes every
    # token's logit NaN and the argmax token 0. So no penalty multiplies what it leaves alone, and a penalised
    # logit that overflows stays at the dtype's largest magnitude: ties are still an argmax and a softmax.
    generated = counts > 0
    if s.repetition_penalty != 1:
        seen = generated | prompt_seen
        scaled = mx.where(logits > 0, logits / s.repetition_penalty,
                          mx.where(logits < 0, logits * s.repetition_penalty, logits))
        logits = mx.where(seen, scaled, logits)
    if s.presence_penalty:
        logits = mx.where(generated, logits - s.presence_penalty, logits)
    if s.frequency_penalty:
        logits = mx.where(generated, logits - s.frequency_penalty * counts, logits)
    if s.penalised:
        largest = mx.finfo(logits.dtype).max
        logits = mx.clip(logits, -largest, largest)
    return logits


def warp(logits: mx.array, s: Sampling) -> mx.array:
    """Logits [n, V] (penalised) -> the log-weights of the distribution to sample: temperature, then top-k,
    top-p and min-p, each removed token at -inf. Needs temperature > 0."""
    # Below float32's smallest normal a temperature divides to inf (and the max logit to NaN); at that
    # scale the distribution is already the argmax.
    temperature = max(float(s.temperature), 1.2e-38)
    x = (logits - logits.max(axis=-1, keepdims=True)) / temperature
    vocab = x.shape[-1]
    if 0 < s.top_k < vocab:
        kth = mx.topk(x, s.top_k, axis=-1).min(axis=-1, keepdims=True)
        x = mx.where(x >= kth, x, -mx.inf)
    if s.top_p < 1:
        probs = mx.softmax(x, axis=-1)
        ordered = -mx.sort(-probs, axis=-1)
        # a token is kept while the mass of the more likely ones is still short of top_p
        kept = ((mx.cumsum(ordered, axis=-1) - ordered) < s.top_p).sum(axis=-1, keepdims=True)
        smallest = mx.take_along_axis(ordered, mx.maximum(kept, 1) - 1, axis=-1)
        x = mx.where(probs >= smallest, x, -mx.inf)
    if s.min_p:
        probs = mx.softmax(x, axis=-1)
        x = mx.where(probs >= s.min_p * probs.max(axis=-1, keepdims=True), x, -mx.inf)
    return x
