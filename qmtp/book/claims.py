"""What lemon-mlx-engine's model card and reports claim, as data, each with where it comes from, and the check that
sets each claim beside what the chapters measured.

Only claims live here as typed values. Every measured value comes from a chapter's saved results
(`qmtp.book.results`); `check` turns them into chapter 8's table, with a verdict computed by the rule stated
next to each claim: holds, holds in part, does not hold, or not testable here (and why).

One rule decides what can be judged where: a claim about the real model's numbers (acceptance, what a
quantized head costs, speedups) is judged only on the real model. On the bundled tiny model its verdict is
"not testable here", and what the tiny model shows goes in its own column as a direction, never a verdict.
Claims about the real config's arithmetic (sizes) or about behaviour every model of this architecture shares
(what the fixes do) are judged on whichever model the chapters ran.
"""

from __future__ import annotations


from .budget import is_real_model  # noqa: F401  (chapters 6 and 8 call it here)
from .claimed import CLAIMS, Claim  # noqa: F401  (the claims as data; chapter 8 reads them here)

HOLDS, PARTLY, FAILS, UNTESTABLE = "holds", "holds in part", "does not hold", "not testable here"
VERDICTS = (HOLDS, PARTLY, FAILS, UNTESTABLE)

# The rules' thresholds.
BROKEN = 0.5  # a variant "breaks" the model when its next-token accuracy is below half the correct load's
SIZE_TOLERANCE = 0.05  # a size "about X" holds within 5%
ACCEPTANCE_TOLERANCE = 0.05  # an acceptance "about a" holds within 0.05
CRIPPLED = 0.5  # a head is "crippled" when it keeps less than half the complete head's acceptance
HEAD_WIDTH_COST = 0.02  # quantizing the head "costs acceptance" when a 4-bit head loses at least 0.02
GIB = 2**30

# The chapters whose saved results chapter 8 reads, and the chapter (document name) that shows each claim.
CHAPTERS = ("01_anatomy", "02_fixes", "04_quantizing", "05_mtp_decoding", "06_throughput")
NOT_REAL = ("the figure belongs to the real weights: on the bundled model the verdict is not testable here "
            "(set QMTP_MODEL to the real checkpoint)")


def check(results: dict[str, dict], real_model: bool) -> list[dict]:
    """One row per claim: the claim, its sources, the chapter that tests it, what was measured there, what the
    bundled model indicates (a direction, never a verdict), the verdict and why.

    The rule: a claim about the real model's numbers (`Claim.real_model`) is judged only when `results` were
    measured on the real Qwen3.6-35B-A3B (`real_model`); on any other model its verdict is UNTESTABLE and what
    that model shows goes in "indicates". Claims about the real config's arithmetic or about behaviour any
    model of this architecture shares are judged on whatever model the chapters ran."""
    r = results
    rows = [
        _fixes(r["02_fixes"]),
        _double_shift(r["02_fixes"]),
        _variant_sizes(r["01_anatomy"]),
        _head_size(r["01_anatomy"]),
        _acceptance(r["05_mtp_decoding"], real_model),
        _acceptance_falls(r["05_mtp_decoding"], real_model),
        _crippled_head(r["05_mtp_decoding"]),
        _bf16_head(r["04_quantizing"], real_model),
        _speedup(r["06_throughput"], real_model),
        _radeon(r["06_throughput"], real_model),
        _six_bit(r["04_quantizing"]),
    ]
    return rows


def _row(key, chapter, measured, verdict, why, indicates=""):
    claim = CLAIMS[key]
    return {"key": key, "claim": claim.text, "source": claim.source, "cite": claim.cite, "chapter": chapter,
            "measured": measured, "indicates": indicates, "verdict": verdict, "why": why}


def _fixes(ch2):
    both, no_norm, no_conv = ch2["accuracy"]["both fixes"], ch2["accuracy"]["conv fix only"], ch2["accuracy"]["norm fix only"]
    conv_refused = no_conv is None
    norm_breaks = no_norm is not None and no_norm < BROKEN * both
    conv_breaks = not conv_refused and no_conv < BROKEN * both
    conv_text = "MLX refuses the stored kernel" if conv_refused else f"accuracy {no_conv:.3f}"
    measured = (f"accuracy {both:.3f} with both fixes; without the norm fix {no_norm:.3f} (perplexity "
                f"{ch2['perplexity']['conv fix only']:.0f}); without the conv fix: {conv_text}")
    norm_half = ("the norm half holds: without the +1 shift the model runs and writes fluent-looking garbage, "
                 "with no error" if norm_breaks else
                 f"the norm half does not: without the +1 shift the model keeps at least {BROKEN:.0%} of its accuracy")
    conv_half = ("the conv half does not: left out, it fails loudly (MLX refuses the stored kernel), so there is "
                 "no output to be incoherent" if conv_refused else
                 "the conv half holds: without the layout fix the output is garbage" if conv_breaks else
                 f"the conv half does not: without the layout fix the model keeps at least {BROKEN:.0%} of its accuracy")
    verdict = HOLDS if norm_breaks and conv_breaks else PARTLY if norm_breaks or conv_breaks else FAILS
    return _row("fixes_needed", "02_fixes", measured, verdict, f"{norm_half}; {conv_half}")


def _double_shift(ch2):
    both, twice = ch2["accuracy"]["both fixes"], ch2["double_shift_accuracy"]
    measured = f"accuracy {twice:.3f} with the norms at 2 + w, against {both:.3f}"
    verdict = HOLDS if twice < BROKEN * both else FAILS
    return _row("double_shift", "02_fixes", measured, verdict,
                f"{'below' if verdict == HOLDS else 'not below'} half the correct accuracy; qmtp records the "
                f"fixes in the file and refuses to convert a converted checkpoint")


def _variant_sizes(ch1):
    claimed = CLAIMS["variant_sizes_gb"].value
    head = ch1["head_gb"]["bf16"]
    totals = {int(b): (gb + head) * 1e9 / GIB for b, gb in ch1["trunk_gb"].items()}  # trunk + bf16 head, GiB
    off = {b: abs(totals[b] - claimed[b]) / claimed[b] for b in claimed}
    measured = ", ".join(f"{b}-bit {totals[b]:.1f} GiB" for b in sorted(claimed))
    verdict = HOLDS if max(off.values()) <= SIZE_TOLERANCE else FAILS
    return _row("variant_sizes_gb", "01_anatomy", f"whole file (trunk + bf16 head) from the real config: {measured}",
                verdict, f"the card's GB are GiB of the whole file; largest difference {max(off.values()):.1%} "
                         f"(rule: within {SIZE_TOLERANCE:.0%})")


def _head_size(ch1):
    claimed, heads = CLAIMS["head_size_gb"].value, ch1["head_gb"]
    bf16, four = heads["bf16"], heads["4"]
    verdict = HOLDS if abs(bf16 - claimed) / claimed <= SIZE_TOLERANCE else FAILS
    why = (f"{bf16:.2f} GB in bf16 ({heads['8']:.2f} GB at 8 bits); the stated size is that of a 4-bit head "
           f"({four:.2f} GB)" if verdict == FAILS else f"{bf16:.2f} GB in bf16")
    return _row("head_size_gb", "01_anatomy", f"head of the real config: {bf16:.2f} GB bf16, {four:.2f} GB 4-bit",
                verdict, why)


def _acceptance(ch5, real_model):
    claimed, measured = CLAIMS["acceptance_n_draft_2"].value, ch5["acceptance"]["2"]
    text = f"{measured:.2f} at n_draft=2, greedy, held-out prompts"
    if not real_model:
        return _row("acceptance_n_draft_2", "05_mtp_decoding", text, UNTESTABLE, NOT_REAL,
                    f"{'higher' if measured > claimed else 'lower'} than {claimed}: the bundled head drafts for a "
                    f"much smaller model on an easier corpus, and was trained on its own drafts")
    verdict = HOLDS if abs(measured - claimed) <= ACCEPTANCE_TOLERANCE else FAILS
    return _row("acceptance_n_draft_2", "05_mtp_decoding", text, verdict,
                f"rule: within {ACCEPTANCE_TOLERANCE} of {claimed}")


def _acceptance_falls(ch5, real_model):
    claimed = CLAIMS["acceptance_n_draft_3"].value
    first, second = ch5["per_position"]["3"][:2]
    rate = ch5["acceptance"]["3"]
    text = f"n_draft=3: first draft {first:.2f}, second {second:.2f}; overall {rate:.2f}"
    if not real_model:
        return _row("acceptance_n_draft_3", "05_mtp_decoding", text, UNTESTABLE, NOT_REAL,
                    f"acceptance {'falls' if second < first else 'does not fall'} from the first draft to the "
                    f"second here ({first:.2f} to {second:.2f}), the direction the claim implies")
    verdict = HOLDS if abs(rate - claimed) <= ACCEPTANCE_TOLERANCE else FAILS
    return _row("acceptance_n_draft_3", "05_mtp_decoding", text, verdict,
                f"rule: within {ACCEPTANCE_TOLERANCE} of {claimed}")


def _crippled_head(ch5):
    complete, crippled = ch5["ablation"]["complete head, bf16"], ch5["ablation"]["no routed experts"]
    verdict = HOLDS if crippled < CRIPPLED * complete else FAILS
    return _row("crippled_head", "05_mtp_decoding",
                f"acceptance {crippled:.2f} without routed experts, {complete:.2f} complete",
                verdict, f"it keeps {crippled / complete:.0%} of the complete head's acceptance (rule: under "
                         f"{CRIPPLED:.0%}); dropping the experts alone leaves the shared expert drafting, so not 0")


def head_width_cost(by_width: dict) -> str:
    """What quantizing the head to 4 bits did to acceptance, in the one wording chapters 4 and 8 both use:
    `by_width` maps "bf16" and "4" (or 4) to acceptance at n_draft=2, the trunk at 8 bits."""
    bf16, four = by_width["bf16"], by_width.get("4", by_width.get(4))
    loss = bf16 - four
    change = (f"costs {loss:.3f} of acceptance" if loss > 0 else
              f"adds {-loss:.3f} to acceptance" if loss < 0 else "leaves acceptance unchanged")
    rule = "at least" if loss >= HEAD_WIDTH_COST else "less than"
    return (f"a 4-bit head is accepted {four:.3f} of the time against {bf16:.3f} in bf16: quantizing it to 4 bits {change}, "
            f"{rule} the {HEAD_WIDTH_COST} that counts as a cost")


def _bf16_head(ch4, real_model):
    by_width = ch4["head_width_acceptance"]
    loss = by_width["bf16"] - by_width["4"]
    measured = f"acceptance bf16 {by_width['bf16']:.3f}, 4-bit {by_width['4']:.3f}, 3-bit {by_width['3']:.3f}"
    if not real_model:
        return _row("bf16_head", "04_quantizing", measured, UNTESTABLE, NOT_REAL,
                    f"on the bundled model {head_width_cost(by_width)}; its head is small and its task easy, so "
                    f"this cannot show what 4 bits do to the real head")
    verdict = HOLDS if loss >= HEAD_WIDTH_COST else FAILS
    return _row("bf16_head", "04_quantizing", measured, verdict,
                f"{head_width_cost(by_width)}; the bf16 head is {ch4['head_bf16_over_4bit_mb']:.1f} MB larger here")


def _field_speedups():
    from .published import FIELD

    speedups = [r.speedup for r in FIELD]
    return min(speedups), max(speedups), len(FIELD)


def _span(widths) -> str:
    return str(widths[0]) if len(widths) == 1 else f"{widths[0]} to {widths[-1]}"


def _speedup(ch6, real_model):
    from .cost_model import calibrated_best

    low, high = CLAIMS["speedup_moe"].value
    predicted = ch6["predicted_moe_4bit"]  # n_draft -> predicted speedup, real config, memory-bound
    best_n = max(predicted, key=predicted.get)
    best = predicted[best_n]
    measured = ch6["measured_speedup"]
    measured_best = max(measured.values())
    width = ch6.get("real_width_summary")
    calibrated = calibrated_best()
    inside = low <= calibrated["low"] and calibrated["high"] <= high
    cost = (f"cost model calibrated on the {calibrated['machines']} published machines' plain figures: best "
            f"{calibrated['low']:.2f}x to {calibrated['high']:.2f}x at n_draft {_span(calibrated['widths'])}, "
            f"{'inside' if inside else 'not inside'} the claimed range; priced by bytes alone (a memory-bound "
            f"machine): best {best:.2f}x at n_draft={best_n}")
    if width:
        here = (f"at the real widths on this CPU a step at n_draft=2 costs {width['break_even_n_draft_2']:.2f} "
                f"plain passes, so drafting {'cannot' if width['break_even_n_draft_2'] >= 2 else 'can'} pay here "
                f"({'compute-bound' if width['compute_bound'] else 'close to memory-bound'})")
    else:
        here = "no real-width measurement saved (rerun chapter 6)"
    f_low, f_high, f_n = _field_speedups()
    field = f"published (not measured here): {f_low:.2f}x to {f_high:.2f}x in {f_n} runs elsewhere"
    if not real_model:
        return _row("speedup_moe", "06_throughput", f"bundled model, this CPU: best {measured_best:.2f}x (dispatch-bound)",
                    UNTESTABLE, NOT_REAL + ("; it also needs a machine on which a pass costs its bytes, which "
                                            "this CPU is not at the real widths" if width and width["compute_bound"]
                                            else ""),
                    f"{cost}; {here}; {field}")
    verdict = HOLDS if low <= measured_best <= high else FAILS
    return _row("speedup_moe", "06_throughput", f"real model, this machine: best {measured_best:.2f}x", verdict,
                f"rule: the best measured speedup lies in the reported {low}x to {high}x; on this machine "
                f"({here}); {cost}", f"{field}")


def _radeon(ch6, real_model):
    from .cost_model import validate

    plain, mtp = CLAIMS["speedup_radeon_890m"].value
    v = next(v for v in validate() if v.row.key == "lemon_radeon_890m")  # the same model as the findings page
    assumed = " (assumed: the source gives none)" if v.assumed else ""
    return _row("speedup_radeon_890m", "06_throughput",
                f"reported {mtp / plain:.2f}x (published, not measured here)", UNTESTABLE,
                "needs a Radeon 890M and the real weights",
                f"the cost model calibrated on the 890M's plain {plain} tok/s and fitted without this source predicts "
                f"{v.predicted_tps:.1f} tok/s ({v.predicted_tps / plain:.2f}x) at n_draft={v.n_draft}{assumed}, "
                f"{v.error:+.0%} from the published {mtp} tok/s")


def _six_bit(ch4):
    faulty, simulated = ch4["backend_faulty_widths"], ch4["simulated_fault_flagged"]
    text = (f"this MLX ({ch4['mlx_version']}): {'wrong at ' + _widths(faulty) if faulty else 'every width correct'}; "
            f"with a 6-bit fault simulated, the self-check flags {_widths(simulated)}")
    if 6 in faulty:
        return _row("rocm_6bit_fault", "04_quantizing", text, HOLDS, "the installed MLX computes 6-bit matmuls wrongly")
    return _row("rocm_6bit_fault", "04_quantizing", text, UNTESTABLE,
                "needs a ROCm build of MLX; `python -m qmtp doctor` run there says whether it has the fault"
                + ("" if simulated == [6] else "; WARNING: the self-check missed the simulated fault"))


def _widths(bits) -> str:
    return ", ".join(f"{b}-bit" for b in bits) or "nothing"
