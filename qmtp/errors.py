"""Errors that qmtp raises on purpose.

Every message names the file (and the tensor, where there is one) and says what is wrong, so a user
pointing qmtp at 70 GB of partial downloads learns in one line which file to fetch again.
"""

import errno
import os
from pathlib import Path


class QmtpError(Exception):
    """Base class: anything qmtp reports as the user's input being unusable."""


class CheckpointError(QmtpError):
    """A checkpoint file or index is missing, truncated, corrupt or inconsistent."""


class ConfigError(QmtpError):
    """config.json is missing, of another model family, or lacks fields the model needs."""


class TensorShapeError(CheckpointError):
    """A tensor exists but its shape or dtype is not what the config implies."""


class IncompleteHeadError(CheckpointError):
    """The MTP head is missing tensors (typically its routed experts)."""


class UsageError(QmtpError):
    """A call or command-line flag is outside what qmtp supports (bad n_draft, empty prompt...)."""


class TemplateError(QmtpError):
    """A chat template failed while compiling or rendering: it ran past a bound on time, size or nesting
    (`qmtp.template_bounds`), or raised from inside (a division by zero, a value of the wrong kind)."""


class TemplateTimeoutError(TemplateError):
    """A chat template ran past its time limit (perhaps only because the machine was busy)."""


class TemplateRefusedError(UsageError):
    """A chat template refuses the conversation (its `raise_exception`, or a message field of a kind it cannot
    read): the messages are what to change."""


class NonFiniteWeightError(CheckpointError):
    """A stored tensor holds NaN or Inf (named in the message): the checkpoint is damaged."""


class NonFiniteLogitsError(QmtpError):
    """The trunk computed NaN or Inf logits while decoding (the message names the position and the token):
    some weight it used is damaged. Raised from `generate` rather than returning tokens chosen from NaN."""


def user_path(path, what: str = "path") -> Path:
    """`path` as a user typed it, `~` expanded: a `~user` without a home directory, or a name longer than the
    filesystem allows, is a UsageError naming it (Python raises a RuntimeError or an OSError for them)."""
    text = os.fsdecode(path) if isinstance(path, bytes) else str(path)
    shown = text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"
    try:
        expanded = Path(path).expanduser()
    except RuntimeError:  # "Could not determine home directory"
        user = text.split("/", 1)[0]
        raise UsageError(f"{what} {shown}: there is no user {user[1:]!r}, so {user} has no home directory") from None
    try:
        os.lstat(expanded)
    except OSError as err:
        if err.errno == errno.ENAMETOOLONG:
            raise UsageError(f"{what} {shown}: {err.strerror} (at most {os.pathconf('/', 'PC_NAME_MAX')} "
                             f"characters a name, {os.pathconf('/', 'PC_PATH_MAX')} a path)") from None
    return expanded
