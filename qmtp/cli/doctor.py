"""`python -m qmtp doctor [MODEL] [--scan]`: check the MLX backend and, given a model, what the checkpoint holds:
completeness, the head, the tokenizer and its chat template, the fixes, the widths, NaN/Inf."""

from __future__ import annotations

from pathlib import Path

from ..errors import QmtpError, UsageError, user_path


def register(commands) -> None:
    doctor = commands.add_parser("doctor", help="check the MLX backend and, given a model, the checkpoint")
    doctor.add_argument("model", nargs="?", help="checkpoint directory to check (default: the backend only)")
    doctor.add_argument("--scan", action="store_true", help="also read every tensor and look for NaN/Inf")
    doctor.set_defaults(run=run)


def run(args) -> int:
    import mlx.core as mx

    from .. import __version__
    from ..quant import check_backend, report

    print(f"qmtp {__version__}, mlx {mx.__version__}, default device {mx.default_device()}")
    checks = check_backend()
    print(report(checks))
    problems = []
    bad = [c.bits for c in checks if not c.ok]
    if bad:
        problems.append(f"the installed MLX computes quantized matmul wrongly at {', '.join(map(str, bad))} bits")
    if args.model is not None:
        problems += _doctor_model(user_path(args.model, "model directory"), args.scan)
    if problems:
        raise QmtpError("; ".join(problems))
    return 0


def _doctor_model(path: Path, scan: bool) -> list[str]:
    """Print what the checkpoint at `path` holds; return its problems (empty: complete and finite)."""
    from ..source import Source

    if not path.exists():
        raise UsageError(f"{path}: no such model directory")
    source = Source.open(path)
    print(f"\n{source.ckpt!r}")
    problems = _doctor_trunk(source, path) + _doctor_head(source, path) + _doctor_tokenizer(source, path)
    plan = source.plan
    if plan.unknown or plan.skipped:
        print(f"not used: {len(plan.unknown)} unmapped tensors, {len(plan.skipped)} vision tensors")
    problems += _doctor_small_tensors(source) + _doctor_fixes(source)
    _doctor_widths(source)
    if scan:
        bad = _scan(source.ckpt)
        print(f"scan: {len(source.ckpt)} tensors read, "
              + (f"{len(bad)} with NaN/Inf: {', '.join(bad[:5])}" if bad else "all finite"))
        if bad:
            problems.append(f"{path}: {len(bad)} tensors hold NaN or Inf (first: {bad[0]})")
    source.check_unchanged()  # what was reported is one checkpoint, not two conversions mixed
    return problems


def _doctor_trunk(source, path: Path) -> list[str]:
    """Whether every trunk tensor config.json declares is stored, and no layer beyond them."""
    from .. import layout

    expected = layout.expected_shapes(source.config, head=False)
    missing, undeclared, beyond = source.missing_trunk(), source.undeclared(), source.plan.beyond
    print(f"trunk: {len(expected) - len(missing)} of {len(expected)} tensors"
          + (f", MISSING {missing[0]} and {len(missing) - 1} more" if missing else ", complete")
          + (f"; MORE LAYERS STORED THAN config.json DECLARES ({len(beyond)} tensors, e.g. {beyond[0]})"
             if undeclared else ""))
    problems = [f"{path}: trunk tensor {missing[0]} is missing ({len(missing)} in all)"] if missing else []
    return problems + ([undeclared] if undeclared else [])


def _doctor_head(source, path: Path) -> list[str]:
    """Whether the MTP head config.json declares is stored, with its routed experts."""
    from ..source import HEAD_FULL, HEAD_MISSING, HEAD_NOT_DECLARED

    try:
        status = source.head_status()
    except QmtpError as err:
        print(f"MTP head: INCOMPLETE ({err})")
        return [str(err)]
    if status == HEAD_NOT_DECLARED:
        print("MTP head: none declared in config.json")
    elif status == HEAD_MISSING:
        print("MTP head: MISSING (config.json declares one, no mtp.* tensors are stored)")
        return [f"{path}: no MTP head tensors (mtp.*), though config.json declares a head"]
    elif status == HEAD_FULL:
        print("MTP head: complete, with its routed experts")
    else:
        print("MTP head: INCOMPLETE, no routed experts (it would draft with its shared expert alone)")
        return [f"{path}: the MTP head has no routed experts (mtp.layers.0.mlp.experts.*)"]
    return []


def _doctor_tokenizer(source, path: Path) -> list[str]:
    """Whether the tokenizer loads and fits the embedding, and its chat template compiles."""
    from ..tokenizer import Tokenizer

    try:
        tokenizer = Tokenizer.check_dir(path, source.config.vocab_size)
    except QmtpError as err:
        print(f"tokenizer: UNUSABLE ({err})")
        return [str(err)]
    print(f"tokenizer: {tokenizer.vocab_size} ids" if tokenizer else "tokenizer: none (chat needs tokenizer.json)")
    return _doctor_template(tokenizer) if tokenizer is not None else []


def _doctor_small_tensors(source) -> list[str]:
    """One NaN in a norm, A_log, dt_bias, conv kernel or router changes every token (and a norm's would make the
    fixes record look contradicted): these few MB are always read, every tensor only with --scan."""
    small = source.nonfinite_small()
    print(f"small tensors (norms, A_log, dt_bias, conv kernels, routers): {len(source.small_critical())} read, "
          + (f"{len(small)} with NaN/Inf: {', '.join(small[:5])}" if small else "all finite"))
    if not small:
        return []
    return [str(source.nonfinite_error(small[0], f"{len(small)} small tensors in all" if len(small) > 1 else ""))]


def _doctor_fixes(source) -> list[str]:
    """The fixes the weights carry (recorded or inferred), and whether the record and the tensors agree."""
    from .. import fixes as fixes_mod

    problems = []
    try:
        source.check_carried()
    except QmtpError as err:
        print(f"fixes: RECORD AND TENSORS DISAGREE ({err})")
        problems.append(str(err))
    origin = "recorded in the file" if source.recorded is not None else "inferred from the conv layout (no record)"
    print(f"fixes in the weights: {', '.join(source.carried) or 'none'} ({origin}); qmtp.load applies: "
          f"{', '.join(fixes_mod.still_needed(source.carried, source.has_conv)) or 'nothing'}")
    return problems


def _doctor_widths(source) -> None:
    """How many weights are quantized at each width, and where a conversion came from."""
    if source.widths:
        counts: dict = {}
        for bits, group in source.widths.values():
            counts[(bits, group)] = counts.get((bits, group), 0) + 1
        text = ", ".join(f"{n} at {b}-bit/{g}" for (b, g), n in sorted(counts.items()))
        print(f"quantized weights: {text}")
    else:
        print("quantized weights: none")
    metadata = source.ckpt.metadata
    if "qmtp.source_digest" in metadata:
        print(f"converted by qmtp {metadata.get('qmtp.version', '?')} from source "
              f"{metadata['qmtp.source_digest'][:16]}...")


def _doctor_template(tokenizer) -> list[str]:
    """Say whether the model has a chat template and whether it compiles; return its problem, if any."""
    from ..chat import compile_template

    if tokenizer.chat_template is None:
        print("chat template: none (chat continues the text raw, as --raw does; generate takes text or ids, not "
              "messages)")
        return []
    try:
        compile_template(tokenizer.chat_template)
    except QmtpError as err:
        print(f"chat template: BROKEN ({err})")
        return [f"{tokenizer.source}: {err}"]
    print(f"chat template: {len(tokenizer.chat_template)} characters, compiles")
    return []


def _scan(ckpt) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an Inf, reading one tensor at a time."""
    import mlx.core as mx

    from tqdm import tqdm

    bad = []
    for name in tqdm(ckpt.names(), desc="scan", unit="tensor", leave=False, disable=None):  # bar on a terminal only
        w = ckpt.load(name)
        if mx.issubdtype(w.dtype, mx.floating) and not mx.all(mx.isfinite(w)).item():
            bad.append(name)
    return bad
