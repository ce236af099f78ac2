"""The command line is a package with one module per command (`qmtp.cli.chat`, `.convert`, `.synthetic`, `.doctor`,
`.bench`), the flags they share parsed in `qmtp.cli.options`; a new command is one module plus one line."""

import importlib
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMMAND_NAMES = ("chat", "convert", "synthetic", "doctor", "bench", "serve")


def test_every_command_is_a_module_with_register_and_run():
    from qmtp import cli

    assert Path(cli.__file__).name == "__init__.py"  # a package, not one file holding every command
    modules = [importlib.import_module(f"qmtp.cli.{name}") for name in COMMAND_NAMES]
    assert list(cli.COMMANDS) == modules
    for module in modules:
        assert callable(module.register) and callable(module.run)


def test_the_names_tests_and_users_import_stay_in_qmtp_cli():
    from qmtp.cli import ChatStream, TextStream, build_parser, json_destination, main, parse_bool, positive_int

    assert issubclass(ChatStream, TextStream)
    assert callable(main) and callable(build_parser)
    assert parse_bool("yes") is True and positive_int("3") == 3 and json_destination("x.json").name == "x.json"


def test_adding_a_command_is_one_module_and_one_line(monkeypatch, capsys):
    from qmtp import cli

    def register(commands):
        greet = commands.add_parser("greet", help="a command added later")
        greet.add_argument("--port", type=cli.positive_int, default=8000)
        greet.set_defaults(run=lambda args: print(f"serving on {args.port}") or 0)

    monkeypatch.setattr(cli, "COMMANDS", (*cli.COMMANDS, types.SimpleNamespace(register=register)))
    assert cli.main(["greet", "--port", "9"]) == 0
    assert capsys.readouterr().out == "serving on 9\n"
    assert cli.main(["greet", "--port", "0"]) == 2  # the shared validators, and main's one line, come with it
    assert capsys.readouterr().err.startswith("qmtp: error: python -m qmtp greet: argument --port")


def test_the_shared_flags_are_defined_once():
    """--ranks/--hostfile/--timeout and MODEL come from `options`, so chat and both benches say the same."""
    from qmtp.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    benches = commands["bench"]._subparsers._group_actions[0].choices
    helps = [{a.dest: a.help for a in p._actions} for p in (commands["chat"], benches["mtp"], benches["decode"])]
    for dest in ("model", "ranks", "hostfile", "timeout"):
        assert helps[0][dest] == helps[1][dest] == helps[2][dest]
    text = (REPO / "qmtp" / "cli" / "chat.py").read_text() + (REPO / "qmtp" / "cli" / "bench.py").read_text()
    assert '"--ranks"' not in text and '"--timeout"' not in text


@pytest.mark.parametrize("argv", [(), *((name,) for name in COMMAND_NAMES),
                                  ("bench", "mtp"), ("bench", "decode"), ("bench", "convert")])
def test_python_m_qmtp_help_works_for_every_command(argv):
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="120")
    result = subprocess.run([sys.executable, "-m", "qmtp", *argv, "--help"], capture_output=True, text=True, env=env,
                            timeout=60)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.startswith(f"usage: python -m qmtp {' '.join(argv)}".rstrip())
    if not argv:
        listed = result.stdout.split("{")[1].split("}")[0].split(",")
        assert tuple(listed) == COMMAND_NAMES


def function_lengths(path: Path) -> dict[str, int]:
    """Each function's lines from `def` to its last line, its docstring left out."""
    import ast

    lengths = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                length -= first.end_lineno - first.lineno + 1
            lengths[f"{path.name}:{node.name}"] = length
    return lengths


def test_no_function_of_the_command_line_is_over_80_lines():
    files = sorted((REPO / "qmtp" / "cli").glob("*.py")) + [REPO / "qmtp" / "launch.py"]
    lengths = {name: n for path in files for name, n in function_lengths(path).items()}
    assert {name: n for name, n in lengths.items() if n > 80} == {}
    assert lengths["__init__.py:build_parser"] < 80  # once 102 lines, when it held every command's flags
