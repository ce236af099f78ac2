"""`python -m qmtp.serve [MODEL] --host 127.0.0.1 --port 8000`: the model behind the OpenAI API (uvicorn)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..cli.options import n_draft as n_draft_argument
from ..errors import QmtpError, UsageError
from ..options import DRAFTING_N_DRAFT


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m qmtp serve", description="Serve a model over the OpenAI API "
                                "(/v1/chat/completions, /v1/completions, /v1/models, /health).")
    p.add_argument("model", nargs="?", default=None,
                   help="a qmtp or mlx-lm checkpoint folder (default: $QMTP_MODEL, else the bundled tiny model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--n-draft", type=n_draft_argument, default=None, metavar="N|auto",
                   help=f"tokens per trunk pass counting the trunk's own (1: no drafting; default "
                        f"{DRAFTING_N_DRAFT} with an MTP head, else 1); a request's n_draft overrides it")
    p.add_argument("--max-batch", type=_positive, default=8, help="rows decoded together at most")
    p.add_argument("--max-queue", type=_positive, default=64,
                   help="requests waiting for a row at most, once --max-batch rows are busy; one more is answered 429")
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on /v1/ routes")
    p.add_argument("--model-name", default=None, help="the name /v1/models gives (default: the folder's name)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    return p


def engine_class():
    """The engine a server decodes with: the continuous batch, whose rows share every decoding step."""
    from ..continuous import ContinuousBatch

    return ContinuousBatch


def build(model, n_draft=None, max_batch: int = 8, max_queue: int = 64, api_key: str | None = None,
          name: str | None = None, engine=None):
    """The app serving `model` (a loaded `qmtp.Model`), with `engine` (default: `engine_class()`)."""
    from .app import create_app
    from .protocol import Served, defaults

    if n_draft is None:
        n_draft = DRAFTING_N_DRAFT if model.mtp is not None else 1
    if engine is None:
        engine = engine_class()(model, max_batch=max_batch)
    name = name or (Path(model.path).name if model.path else "qmtp")
    served = Served(model, name, n_draft, defaults(model))  # read once, not at every request
    return create_app(served, engine, api_key=api_key, max_queue=max_queue)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        import sse_starlette  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as error:
        print(f"qmtp serve needs the web stack ({error.name} is missing): pip install 'qmtp[serve]'", file=sys.stderr)
        return 2
    try:
        from .. import load

        model = load(args.model)
        if args.n_draft not in (None, 1) and model.mtp is None:
            raise UsageError(f"--n-draft {args.n_draft}: {model.path} has no MTP head to draft with")
        app = build(model, args.n_draft, args.max_batch, args.max_queue, args.api_key, args.model_name)
    except QmtpError as error:
        print(f"qmtp serve: {error}", file=sys.stderr)
        return 2
    print(f"qmtp serve: {app.state.server.served.name} on http://{args.host}:{args.port}/v1 "
          f"(n_draft {app.state.server.served.n_draft})", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
