"""mlx-vlm's own Qwen3.5/3.6 MTP speculative decoding, on the same checkpoint, as a peer engine for the benchmarks.

mlx-vlm (the `peer` extra) loads the released layout itself: its qwen3_5_moe model drops the `mtp.*` tensors,
adds 1 to the zero-centred norms and transposes conv1d; its qwen3_5_mtp drafter takes the `mtp.*` tensors from
the same folder (the same two fixes applied), shares the trunk's embedding and lm_head, and drafts
autoregressively with its own KV cache. Nothing of mlx-vlm is imported before an engine is built: the base
install does not have it.
"""

from __future__ import annotations

import time

import mlx.core as mx

from ..errors import CheckpointError, UsageError

INSTALL_HINT = "pip install -e '.[peer]'"


def available() -> str | None:
    """None if mlx-vlm with Qwen3.5/3.6 MTP drafting can be imported, else why not, in one line."""
    try:
        import mlx_vlm
    except ImportError:
        return f"mlx-vlm is not installed: {INSTALL_HINT}"
    try:
        from mlx_vlm.generate.ar import generate_step  # noqa: F401
        from mlx_vlm.speculative.drafters.mtp_split import MTP_SPLITTERS
    except ImportError as err:
        return f"mlx-vlm {mlx_vlm.__version__} has no speculative drafters ({err}): {INSTALL_HINT}"
    if "qwen3_5_moe" not in MTP_SPLITTERS:
        return f"mlx-vlm {mlx_vlm.__version__} has no MTP drafter for qwen3_5_moe: {INSTALL_HINT}"
    return None


def _cast(module, dtype):
    from mlx.utils import tree_map

    module.update(tree_map(lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p,
                           module.parameters()))
    mx.eval(module.parameters())
    return module


class MlxVlmEngine:
    """The checkpoint at `path` in mlx-vlm, trunk and MTP drafter, floating parameters cast to `dtype`
    (default qmtp's compute dtype: float32 on the CPU, whose gather_mm computes only float32)."""

    def __init__(self, path=None, dtype=None):
        reason = available()
        if reason:
            raise UsageError(reason)
        import mlx_vlm
        from mlx_vlm.speculative.drafters import load_drafter
        from mlx_vlm.utils import load_model

        from ..loading import default_dtype, resolve_path

        self.path = resolve_path(path)
        self.dtype = dtype or default_dtype()
        self.version = mlx_vlm.__version__
        try:
            self.model = _cast(load_model(self.path), self.dtype)
            self.drafter = _cast(load_drafter(str(self.path), kind="mtp")[0], self.dtype)
        except (ValueError, KeyError, FileNotFoundError) as err:
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise CheckpointError(f"{self.path}: mlx-vlm {self.version} cannot load it: {first_line}") from None

    def generate(self, prompt_tokens: list[int], max_tokens: int, n_draft: int) -> dict:
        """Greedy decoding of `max_tokens` tokens (no stop at EOS); `n_draft` counts the trunk's own token as
        qmtp does (1: plain decoding, 2: one MTP draft per trunk pass; mlx-vlm's block size is the same number).

        Returns `tokens`; `seconds` from the first generated token to the last (prefill excluded, as in
        `qmtp.book.bench`); `passes`, the trunk passes after the prefill; and, when drafting, per draft position
        the drafts `proposed` and `accepted` (counted as qmtp's Stats counts them: a draft is proposed only if
        every draft before it in its pass was accepted), `acceptance` (all accepted over all proposed) and
        `acceptance_per_position`.
        """
        from mlx_vlm.generate.ar import generate_step

        if not prompt_tokens:
            raise UsageError("the prompt is empty: give at least one token")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise UsageError(f"max_tokens={max_tokens!r}: use a positive integer")
        if not isinstance(n_draft, int) or n_draft < 1:
            raise UsageError(f"n_draft={n_draft!r}: use 1 (plain decoding) or more")
        # The whole prompt in one prefill pass: mlx-vlm 0.7.10's chunked prefill keeps only the last prompt
        # token's hidden state for an MTP drafter, so its head would start with no prompt in its KV cache.
        options = dict(max_tokens=max_tokens, temperature=0.0, prefill_step_size=None)
        if n_draft > 1:
            options.update(draft_model=self.drafter, draft_kind="mtp", draft_block_size=n_draft)
        tokens, first = [], None
        for token, _ in generate_step(mx.array([prompt_tokens]), self.model, None, None, **options):
            tokens.append(int(token))
            if first is None:
                first = time.perf_counter()
        result = {"tokens": tokens, "seconds": time.perf_counter() - first, "passes": len(tokens) - 1,
                  "proposed": [], "accepted": [], "acceptance": None, "acceptance_per_position": None}
        if n_draft > 1:
            result.update(self._drafter_counts(n_draft))
        return result

    def _drafter_counts(self, n_draft: int) -> dict:
        """The drafter's record of the last generation (reset by every one): per round the drafts accepted and
        proposed, as qmtp's Stats counts them (a draft is proposed only if every draft before it in its pass
        was accepted). In a batch mlx-vlm records each round's accepted count averaged over its rows."""
        rounds = list(zip(self.drafter.accept_lens, self.drafter.draft_lens))
        proposed, accepted = [0] * (n_draft - 1), [0] * (n_draft - 1)
        for a, d in rounds:
            for i in range(min(int(a) + 1, d)):
                proposed[i] += 1
            for i in range(int(a)):
                accepted[i] += 1
        return {"passes": len(rounds), "proposed": proposed, "accepted": accepted,
                "acceptance": sum(accepted) / sum(proposed) if sum(proposed) else None,
                "acceptance_per_position": [a / p if p else None for a, p in zip(accepted, proposed)]}

    def generate_batch(self, prompts: list[list[int]], max_tokens: int, n_draft: int) -> dict:
        """The `prompts` (token ids) decoded together by mlx-vlm's `BatchGenerator`, greedy, `max_tokens` each
        (end ids ignored, as `bench batch` runs qmtp); `n_draft` as in `generate` (1: mlx-vlm's plain batch; more:
        its batched MTP drafting, `draft_kind="mtp"`, block size `n_draft`). mlx-vlm has no adaptive width.

        Returns `rows` (in the prompts' order), each with its `tokens`, `first_token_seconds` (from the call),
        `seconds` (its first token to its last) and `tokens_per_second` (tokens after the first over those
        seconds, as qmtp's Stats counts them); `seconds` and `tokens_per_second` of the whole batch (all rows'
        tokens over the call's wall time, prefill included); when drafting, the drafter's `passes`, `proposed`,
        `accepted` and `acceptance`, and `lockstep`: whether mlx-vlm makes every row accept the same number of
        drafts per round (`requires_uniform_batch_acceptance`, qwen3_5's rectangular cache), in which case each
        row's `acceptance` is the batch's; otherwise mlx-vlm records only each round's mean over rows, kept as
        `mean_accepted_per_round`, and `acceptance` is None, the batch's and each row's.
        """
        from mlx_vlm.generate.ar import BatchGenerator

        reason = batch_unavailable()
        if reason:
            raise UsageError(reason)
        if not prompts or not all(prompts):
            raise UsageError("every prompt needs at least one token")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise UsageError(f"max_tokens={max_tokens!r}: use a positive integer")
        if not isinstance(n_draft, int) or n_draft < 1:
            raise UsageError(f"n_draft={n_draft!r}: use 1 (plain decoding) or more (mlx-vlm has no auto width)")
        language_model = self.model.language_model
        drafting = dict(draft_model=self.drafter, draft_kind="mtp", draft_block_size=n_draft) if n_draft > 1 else {}
        started = time.perf_counter()
        # The whole prompt in one prefill pass, as in `generate`; each row brings its own embeddings (mlx-vlm's
        # batch prefill takes `inputs_embeds` per row, what its processor would make for a text-only prompt).
        generator = BatchGenerator(language_model, _NoStopProcessor(), max_tokens=max_tokens,
                                   prefill_batch_size=len(prompts), completion_batch_size=len(prompts),
                                   prefill_step_size=None, compute_logprobs=False, **drafting)
        try:
            row_inputs = []
            for prompt in prompts:
                embedded = self.model.get_input_embeddings(mx.array([prompt]), None).to_dict()
                row_inputs.append({k: v for k, v in embedded.items() if v is not None})
            uids = generator.insert(prompts, max_tokens, prompt_kwargs=row_inputs)
            tokens = {uid: [] for uid in uids}
            first, last = {}, {}
            while generator.has_work:
                _, responses = generator.next()
                now = time.perf_counter()
                for response in responses:
                    if response.token is None:
                        continue
                    tokens[response.uid].append(int(response.token))
                    first.setdefault(response.uid, now)
                    last[response.uid] = now
        finally:
            generator.close()
        seconds = time.perf_counter() - started
        rows = []
        for uid in uids:
            decode = last[uid] - first[uid]
            rows.append({"tokens": tokens[uid], "first_token_seconds": first[uid] - started, "seconds": decode,
                         "tokens_per_second": (len(tokens[uid]) - 1) / decode if decode else float("nan"),
                         "acceptance": None})
        result = {"rows": rows, "seconds": seconds,
                  "tokens_per_second": sum(len(r["tokens"]) for r in rows) / seconds,
                  "passes": None, "proposed": [], "accepted": [], "acceptance": None, "lockstep": None}
        if n_draft > 1:
            result.update(self._drafter_counts(n_draft))
            # mlx-vlm clamps every row to the smallest acceptance when the drafter or the target asks for it
            result["lockstep"] = len(prompts) == 1 or any(
                getattr(m, "requires_uniform_batch_acceptance", False) for m in (self.drafter, language_model))
            if result["lockstep"]:
                for row in rows:
                    row["acceptance"] = result["acceptance"]
            else:  # each round's count is a mean over rows: counting drafts proposed from it would be wrong
                rounds = self.drafter.accept_lens
                result.update(proposed=[], accepted=[], acceptance=None, acceptance_per_position=None,
                              mean_accepted_per_round=sum(rounds) / len(rounds) if rounds else None)
        return result


class _NeverStop:
    """Stopping criteria that never stop: the bench runs every row its `max_tokens`, end ids included, as it runs
    qmtp."""

    def add_eos_token_ids(self, token_ids):
        pass

    def __call__(self, token) -> bool:
        return False


class _NoStopProcessor:
    """All `BatchGenerator` asks of a processor when no text is decoded: its stopping criteria."""

    def __init__(self):
        self.stopping_criteria = _NeverStop()


def batch_unavailable() -> str | None:
    """None if the installed mlx-vlm decodes a batch with MTP drafts, else why not, in one line. Checked by
    feature: `BatchGenerator` taking a drafter (`draft_model`, `draft_kind`, `draft_block_size`) and a batched MTP
    round loop in `mlx_vlm.speculative.mtp`."""
    import inspect

    reason = available()
    if reason:
        return reason
    import mlx_vlm

    try:
        from mlx_vlm.generate.ar import BatchGenerator
        from mlx_vlm.speculative import mtp
    except ImportError as err:
        return f"mlx-vlm {mlx_vlm.__version__} has no batch generator ({err}): {INSTALL_HINT}"
    missing = [name for name in ("draft_model", "draft_kind", "draft_block_size")
               if name not in inspect.signature(BatchGenerator).parameters]
    if missing:
        return (f"mlx-vlm {mlx_vlm.__version__}'s BatchGenerator takes no drafter ({', '.join(missing)} missing): "
                f"{INSTALL_HINT}")
    if not callable(getattr(mtp, "_mtp_rounds_batch", None)):
        return f"mlx-vlm {mlx_vlm.__version__} has no batched MTP drafting (no _mtp_rounds_batch): {INSTALL_HINT}"
    return None


ROCM_MARK = ".rocm"  # written into the venv by `make rocm-venv` (the Makefile's ROCM_MARK)


def not_installed_reason(prefix=None) -> str | None:
    """None if mlx-vlm can run here; else why not, in one line. A venv made by `make rocm-venv` (`prefix`, default
    this interpreter's) leaves mlx-vlm out on purpose: its mlx wheel would replace the machine's ROCm build."""
    import sys
    from pathlib import Path

    why = available()
    if why is not None and (Path(prefix or sys.prefix) / ROCM_MARK).is_file():
        return ("this install is `make rocm-venv`'s, which leaves out the `peer` extra (mlx-vlm) because its mlx "
                "wheel would replace the machine's ROCm build of MLX")
    return why


def real_width_gap(qmtp_tps: float, mlx_lm_tps: float, whole_ms: float, split_ms: float, blocks: int) -> str:
    """Why qmtp and mlx-lm decode at different speeds at the real widths, as far as chapter 7 measured it: how
    much of the gap per token the split lm_head (`qmtp.cores`, timed alone: `whole_ms` as mlx-lm runs it,
    `split_ms` in `blocks` blocks as qmtp does) accounts for. Chapter 7 and the findings page say this alike."""
    gap_ms = (1 / mlx_lm_tps - 1 / qmtp_tps) * 1e3
    saved_ms = whole_ms - split_ms
    if blocks == 1:
        return ("qmtp does not split lm_head on this machine (one usable core, or a float weight under "
                "OpenBLAS), so the split explains none of the gap, and what does is not measured here")
    if saved_ms <= 0:
        return "the split lm_head saves nothing measurable here, so the gap comes from elsewhere, not measured here"
    if gap_ms <= 0:
        return (f"the split lm_head saves {saved_ms:.0f} ms a token, yet qmtp is not the faster engine here: "
                "what it loses elsewhere is not measured apart here")
    if saved_ms >= gap_ms:
        return (f"the gap is {gap_ms:.0f} ms a token and the split lm_head saves {saved_ms:.0f} ms, as much as "
                "the whole gap or more, so it accounts for qmtp's lead; what qmtp spends of that saving elsewhere "
                "is not measured apart here")
    return (f"the gap is {gap_ms:.0f} ms a token and the split lm_head saves {saved_ms:.0f} ms of it "
            f"({saved_ms / gap_ms:.0%}); the rest is not measured apart here (the other difference between the "
            "two engines' code is qmtp's compiled step, which fuses the elementwise work between the products)")
