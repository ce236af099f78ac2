"""What a conversation's later turns cost with the kept decoding state, against a fresh run over the same ids.

    PYTHONPATH=. python tools/measure_conversation.py [MODEL] [--turns 3] [--repeats 5] [--max-tokens 64]

MODEL defaults to the bundled tiny model given the test suite's chat template (tests/templates/qwen_family.jinja,
in the Qwen3.5 / 3.6 format); a model with its own template is used as it is. For each setting (thinking off,
thinking on: the template drops the last reply's thinking, and preserve_thinking: it keeps it), each turn from
the second is timed twice: as `Conversation.send` (resuming the kept state) and as `qmtp.generate` over the same
prompt ids from nothing. Both give the same tokens (checked); the table shows the medians over the repeats of
the prompt's tokens, those prefilled, the time to the first token and the turn's wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import qmtp
from qmtp.loading import BUNDLED_MODEL

TEMPLATE = Path(__file__).resolve().parents[1] / "tests" / "templates" / "qwen_family.jinja"
TURNS = ["Tell me a story about a fox who lives by the river.", "What does the fox eat in winter?",
         "And who are its friends?", "How does the story end?", "Tell it again, shorter."]
SETTINGS = {"thinking off": dict(enable_thinking=False), "thinking on (dropped)": {},
            "thinking kept": dict(chat_template_kwargs={"preserve_thinking": True})}


def templated_bundled_model(where: Path) -> Path:
    """The bundled model's files (linked) with the test suite's chat template in tokenizer_config.json."""
    for f in Path(BUNDLED_MODEL).iterdir():
        if f.is_file() and f.name != "tokenizer_config.json":
            (where / f.name).symlink_to(f)
    config = json.loads((Path(BUNDLED_MODEL) / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE.read_text()
    (where / "tokenizer_config.json").write_text(json.dumps(config))
    return where


def one_conversation(model, turns: int, n_draft, max_tokens: int, template: dict) -> list[dict]:
    """Each turn as a Conversation turn and as a fresh generate over its ids: counts and times."""
    conversation = qmtp.Conversation(model, "Tell stories.", n_draft=n_draft, max_tokens=max_tokens, **template)
    rows = []
    for turn, text in enumerate(TURNS[:turns]):
        started = time.perf_counter()
        g = conversation.send(text)
        kept_seconds = time.perf_counter() - started
        started = time.perf_counter()
        f = qmtp.generate(model, g.prompt_tokens, n_draft=n_draft, max_tokens=max_tokens, seed=turn)
        fresh_seconds = time.perf_counter() - started
        if f.tokens != g.tokens:
            raise AssertionError(f"turn {turn + 1}: the conversation's tokens differ from a fresh run's")
        rows.append(dict(prompt=g.stats.prompt_tokens, generated=g.stats.generated,
                         prefilled=g.stats.prefilled_tokens, fresh_prefilled=f.stats.prefilled_tokens,
                         first_token=g.stats.first_token_seconds, fresh_first_token=f.stats.first_token_seconds,
                         seconds=kept_seconds, fresh_seconds=fresh_seconds))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--n-draft", default="1,3")
    parser.add_argument("--json", type=Path, help="write the medians here too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or templated_bundled_model(Path(tmp))
        model = qmtp.load(path)
        widths = [w if w == "auto" else int(w) for w in args.n_draft.split(",")]
        report = []
        print(f"{'setting':<22} {'n_draft':>7} {'turn':>4} {'prompt':>6} {'prefilled':>15} {'first token ms':>18} "
              f"{'turn ms':>18}")
        print(f"{'':<22} {'':>7} {'':>4} {'':>6} {'kept / fresh':>15} {'kept / fresh':>18} {'kept / fresh':>18}")
        for name, template in SETTINGS.items():
            for n_draft in widths:
                one_conversation(model, args.turns, n_draft, args.max_tokens, template)  # compiles every shape
                runs = [one_conversation(model, args.turns, n_draft, args.max_tokens, template)
                        for _ in range(args.repeats)]
                for turn in range(1, args.turns):
                    median = {key: statistics.median(run[turn][key] for run in runs) for key in runs[0][turn]}
                    report.append(dict(setting=name, n_draft=n_draft, turn=turn + 1, **median))
                    print(f"{name:<22} {n_draft!s:>7} {turn + 1:>4} {median['prompt']:>6.0f} "
                          f"{median['prefilled']:>7.0f} / {median['fresh_prefilled']:<5.0f} "
                          f"{1e3 * median['first_token']:>8.1f} / {1e3 * median['fresh_first_token']:<7.1f} "
                          f"{1e3 * median['seconds']:>8.1f} / {1e3 * median['fresh_seconds']:<7.1f}", flush=True)
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
