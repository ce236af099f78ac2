"""`python -m qmtp chat`: generate text, plainly or with the MTP head drafting; a conversation through the chat
template (stdin lines are its turns), or plain text with --raw."""

from __future__ import annotations

import os
import sys

from ..errors import QmtpError, UsageError
from . import options, ranks
from .streams import ChatStream, TextStream


def register(commands) -> None:
    chat = commands.add_parser("chat", help="generate text, plainly or with the MTP head drafting")
    options.add_model(chat)
    chat.add_argument("--use-mtp", nargs="?", const=True, default=False, type=options.parse_bool, metavar="BOOL",
                      help="draft with the MTP head (--use-mtp, --use-mtp=true, --use-mtp=false)")
    chat.add_argument("--n-draft", type=options.n_draft, default=None, metavar="N|auto",
                      help="tokens per trunk pass counting the trunk's own (2 = one head draft; auto: chosen per "
                           "step); needs --use-mtp, whose default is auto")
    chat.add_argument("--temperature", type=float, default=None,
                      help="0: greedy (default: the model's generation_config.json, else greedy)")
    # The sampler: the model's generation_config.json settings unless these override them
    chat.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (0: all)")
    chat.add_argument("--top-p", type=float, default=None, help="keep the most likely tokens up to this mass")
    chat.add_argument("--min-p", type=float, default=None, help="drop tokens below this share of the most likely")
    chat.add_argument("--presence-penalty", type=float, default=None, help="per token generated before")
    chat.add_argument("--frequency-penalty", type=float, default=None, help="per time a token was generated")
    chat.add_argument("--repetition-penalty", type=float, default=None,
                      help="on tokens of the prompt and the generated text (1: none)")
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.add_argument("--seed", type=int, default=0,
                      help="random seed when sampling (turn n of a conversation, from 0, uses seed + n)")
    chat.add_argument("--prompt", help="generate once for this prompt (default: read prompts from stdin, each line a "
                                       "turn of one conversation; a line /reset starts a new one)")
    chat.add_argument("--raw", action="store_true",
                      help="feed the prompt as plain text, without the chat template (each line on its own; "
                           "the default for a model without one)")
    chat.add_argument("--system", metavar="TEXT", help="a system message opening the conversation")
    chat.add_argument("--thinking", nargs="?", const=True, default=None, type=options.parse_bool, metavar="BOOL",
                      help="--thinking=false asks the template for an answer without thinking (default: the "
                           "template's, on for Qwen)")
    chat.add_argument("--hide-thinking", action="store_true",
                      help="print the answer only (the thinking is otherwise shown on stderr, apart from it)")
    chat.add_argument("--preserve-thinking", action="store_true",
                      help="keep earlier turns' thinking in the conversation (Qwen3.6's preserve_thinking)")
    chat.add_argument("--stop", action="append", metavar="TEXT", type=options.unescaped,
                      help="end the reply where this text appears (repeat for several); backslash escapes are "
                           "unescaped: \\n a newline, \\t a tab, \\\\ a backslash, \\uHHHH")
    options.add_rank_options(chat)
    chat.set_defaults(run=run)


def sampler_flags(args) -> dict:
    """The sampler's flags as given (None: not given, the model's generation_config.json decides)."""
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                repetition_penalty=args.repetition_penalty)


def check_flags(args) -> None:
    """Every flag checked before the load: loading the real model takes a minute, and its warnings should not
    come first."""
    from ..sampling import Sampling

    options.drafting_width(args)
    if args.prompt is not None and not args.prompt:
        raise UsageError("the prompt is empty: give at least one token of text")
    if args.seed >= 2**64:  # MLX's random key takes 64 bits (a negative seed: generate says so)
        raise UsageError(f"--seed {args.seed}: give a whole number below 2**64")
    if args.raw and _template_flags(args):
        raise UsageError(f"{_template_flags(args)[0]} shapes the chat template's conversation, which --raw leaves "
                         f"out; drop one of them")
    if args.system is not None:
        args.system = options.utf8_argument(args.system, "--system")
    if args.prompt is not None:
        args.prompt = options.utf8_argument(args.prompt, "--prompt")
    for i, stop in enumerate(args.stop or ()):
        if not stop:
            raise UsageError("--stop: give non-empty text to stop at")
        args.stop[i] = options.utf8_argument(stop, "--stop")
    Sampling(**{k: v for k, v in sampler_flags(args).items() if v is not None})  # a bad flag is refused here


def _template_flags(args) -> list[str]:
    """The flags given that only the chat template's conversation uses."""
    return [flag for flag, on in (("--system", args.system is not None), ("--thinking", args.thinking is not None),
                                  ("--hide-thinking", args.hide_thinking),
                                  ("--preserve-thinking", args.preserve_thinking)) if on]


def _without_template(model, args) -> None:
    """A model with no chat template is continued as plain text, as --raw does and as mlx-lm does; said once."""
    where = "no chat_template.jinja, no chat_template in tokenizer_config.json"
    if _template_flags(args):
        raise UsageError(f"{_template_flags(args)[0]} shapes the chat template's conversation, and {model.path} has "
                         f"no chat template ({where})")
    print(f"qmtp: warning: {model.path} has no chat template ({where}): each prompt is continued as plain text, "
          f"as with --raw", file=sys.stderr, flush=True)
    args.raw = True


def run(args) -> int:
    from .. import chat as chat_mod
    from ..loading import load
    from ..sampling import resolve as resolve_sampling

    check_flags(args)
    n_draft = args.n_draft if args.use_mtp else 1
    if ranks.ranked(args):
        return ranks.start_ranks(args)
    group = ranks.rank_group()
    if group is not None and group.rank():  # only rank 0 prints (text, thinking, statistics); every rank computes
        sys.stdout = sys.stderr = open(os.devnull, "w")  # every token; main() still reports this rank's errors
    model = load(args.model, group=group)
    if args.use_mtp:
        model.require_head()
    if model.tokenizer is None:
        raise UsageError(f"{model.path}: no tokenizer.json, so there is no text to chat with")
    if not args.raw and model.tokenizer.chat_template is None:
        _without_template(model, args)
    ends = chat_mod.end_ids(model)
    stops = tuple(args.stop or ())
    sampling = resolve_sampling(model, "model", **sampler_flags(args))
    prompts = [args.prompt] if args.prompt is not None else stdin_prompts()
    if group is not None and args.prompt is None:  # rank 0 reads them, every rank runs each turn
        prompts = ranks.shared_prompts(group, prompts)
    settings = dict(max_tokens=args.max_tokens, n_draft=n_draft, sampling=sampling, seed=args.seed,
                    stop=stops or None)
    if args.raw:
        _continue_each(model, prompts, ends, stops, settings)
    else:
        _converse(model, args, prompts, ends, stops, settings)
    return 0


def _continue_each(model, prompts, ends, stops, settings) -> None:
    """--raw: each prompt continued on its own, as plain text."""
    from ..speculative import generate

    for prompt in prompts:
        print(prompt, end="", flush=True)
        text = TextStream(model.tokenizer, ends, stops)
        g = _streamed(lambda: generate(model, prompt, on_tokens=text.add, **settings))
        text.finish(g.text)
        _report(g, settings["n_draft"], settings["sampling"])


def _converse(model, args, prompts, ends, stops, settings) -> None:
    """The conversation: each turn renders the whole history (its earlier thinking dropped or kept by the
    template) and prefills only what differs from the decoding state the last turn left."""
    from .. import chat as chat_mod
    from ..conversation import Conversation

    conversation = Conversation(model, args.system, enable_thinking=args.thinking,
                                chat_template_kwargs={"preserve_thinking": True} if args.preserve_thinking else None,
                                **settings)
    for prompt in prompts:
        if prompt.strip() == "/reset" and args.prompt is None:
            conversation.reset()
            print("[a new conversation]", file=sys.stderr, flush=True)
            continue
        opened = chat_mod.opens_thinking(conversation.next_prompt(prompt))
        stream = ChatStream(model.tokenizer, ends, stops, opened, args.hide_thinking)
        g = _streamed(lambda: conversation.send(prompt, on_tokens=stream.add))
        stream.finish(g.text)
        _report(g, settings["n_draft"], settings["sampling"])


def _streamed(run):
    """`run()`; damaged weights stop it mid-text: then the line streamed so far is ended before the error."""
    try:
        return run()
    except QmtpError:
        print(flush=True)
        raise


def _describe_sampling(settings) -> str:
    """The settings that differ from greedy decoding without penalties, as name=value."""
    from dataclasses import fields

    from ..sampling import Sampling

    default = Sampling()
    return ", ".join(f"{f.name}={getattr(settings, f.name):g}" for f in fields(settings)
                     if getattr(settings, f.name) != getattr(default, f.name))


def _report(g, n_draft, sampling) -> None:
    """The generation's statistics, and the sampling settings that are not greedy's, one line on stderr."""
    from ..sampling import Sampling

    s = g.stats
    kept = s.prompt_tokens - s.prefilled_tokens  # held by the decoding state the last turn left
    line = (f"[{s.generated} tokens, {s.tokens_per_second:.1f} tok/s, "
            + (f"{kept} tokens kept from the last turn, " if kept else "") + f"after a prompt of {s.prompt_tokens}")
    if n_draft != 1:
        # a position never proposed (every earlier draft rejected) has no rate: say so, not "nan"
        per_position = ", ".join("never reached" if d == 0 else f"{a:.2f}" for a, d in zip(s.acceptance, s.drafted))
        line += f", acceptance {s.acceptance_rate:.2f} (per position {per_position}), {s.tokens_per_trunk_pass:.2f} tokens per trunk pass"
        if s.nonfinite_drafts:  # rejected or not, the tokens are the trunk's: say why drafting fails
            line += (f", {s.nonfinite_drafts} drafts from NaN/Inf head logits (the MTP head's weights are "
                     f"damaged: `python -m qmtp doctor MODEL --scan`)")
    if sampling != Sampling():  # from generation_config.json, or the flags: say which were used
        line += f", sampling {_describe_sampling(sampling)}"
    print(line + "]", file=sys.stderr, flush=True)


def stdin_prompts():
    """The prompts, one a line of stdin (asked for with "> " on a terminal); blank lines (spaces at most) are
    skipped, not sent: an empty message would end the chat with an error."""
    for raw in _stdin_lines():
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise UsageError(f"stdin: a prompt line is not valid UTF-8 ({err.reason} at byte {err.start}); give "
                             f"UTF-8 text") from None
        line = line[:-1] if line.endswith("\r") else line  # a line ended by \r\n (Windows, a network tool)
        if line.strip():
            yield line


def _stdin_lines():
    """stdin's lines as bytes, without their newline: as `qmtp.launch` relayed them in a rank it started (each
    byte as typed; mlx.launch never closes a rank's stdin, so the relay says where the input ends)."""
    from .. import launch

    if os.environ.get(launch.RANKS_ENV):
        yield from launch.relayed_lines(sys.stdin.buffer)
        return
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        raw = sys.stdin.buffer.readline()
        if not raw:
            return
        yield raw[:-1] if raw.endswith(b"\n") else raw
