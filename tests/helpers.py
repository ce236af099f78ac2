"""Assertions shared by the test files: one clear error, one line of it."""

import pytest

from qmtp.errors import QmtpError


def expect(error_type, fn, *fragments) -> str:
    """`fn()` raises `error_type` (or a subclass) with a one-line message containing every fragment."""
    with pytest.raises(QmtpError) as info:
        fn()
    assert isinstance(info.value, error_type), f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert str(fragment) in message, f"{fragment!r} not in: {message}"
    return message


def one_line_error(err: str, *fragments):
    """A CLI's stderr holds exactly one line, `qmtp: error: ...`, containing every fragment."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("qmtp: error:"), err
    for fragment in fragments:
        assert str(fragment) in lines[0], lines[0]
