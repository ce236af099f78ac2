"""qmtp: Qwen3.6-35B-A3B and its Multi-Token-Prediction head on MLX, as a readable package.

The book's chapters import this package; the names below are its stable public API.
"""

__version__ = "0.1.0"

from . import blas

blas.use_optimised()  # before anything imports mlx.core: see qmtp.blas

from .checkpoint import Checkpoint
from .config import QWEN36_35B_A3B, ModelConfig
from .errors import CheckpointError, ConfigError, IncompleteHeadError, QmtpError, TensorShapeError, UsageError
from .loading import load
from .model import Model

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "ConfigError",
    "IncompleteHeadError",
    "Model",
    "ModelConfig",
    "QWEN36_35B_A3B",
    "QmtpError",
    "TensorShapeError",
    "UsageError",
    "load",
]

from .sampling import Sampling  # noqa: E402
from .options import Engine, Settings  # noqa: E402
from .speculative import Generation, Stats, decode, generate  # noqa: E402
from .prefix_cache import PrefixCache  # noqa: E402
from .conversation import Conversation  # noqa: E402

__all__ += ["Conversation", "Engine", "Generation", "PrefixCache", "Sampling", "Settings", "Stats", "decode", "generate"]
from .batch import generate_batch  # noqa: E402
from .continuous import ContinuousBatch  # noqa: E402

__all__ += ["ContinuousBatch", "generate_batch"]
