"""Errors that qmtp raises on purpose.

Every message names the file (and the tensor, where there is one) and says what is wrong, so a user
pointing qmtp at 70 GB of partial downloads learns in one line which file to fetch again.
"""


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


class NonFiniteWeightError(CheckpointError):
    """A stored tensor holds NaN or Inf (named in the message): the checkpoint is damaged."""


class NonFiniteLogitsError(QmtpError):
    """The trunk computed NaN or Inf logits while decoding (the message names the position and the token):
    some weight it used is damaged. Raised from `generate` rather than returning tokens chosen from NaN."""
