"""The API page's section on `python -m qmtp chat` names only options the command has, and the main ones."""

import re
from pathlib import Path

from qmtp.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


def _chat_options():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command")
    return {o for a in commands.choices["chat"]._actions for o in a.option_strings}


def test_the_chat_section_names_real_options():
    page = (ROOT / "book" / "api.md").read_text()
    section = page.split("## The chat command", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"(--[a-z][a-z-]*)", section))
    options = _chat_options()
    assert not named - options, named - options
    assert {"--use-mtp", "--n-draft", "--thinking", "--system", "--prompt", "--temperature"} <= named
