"""mlx-lazy: long-context token pruning (LazyLLM, SPEED) for Llama-family models on MLX."""

from . import _blas  # noqa: F401  (must precede any mlx import)
from . import _malloc  # noqa: F401
from .errors import UserInputError
from .engine import GenerationStats, LazyEngine
from .api import GenerationResponse, generate, load, stream_generate
from .schedule import METHODS, PruningConfig, Schedule

__all__ = [
    "METHODS",
    "GenerationResponse",
    "GenerationStats",
    "LazyEngine",
    "PruningConfig",
    "Schedule",
    "UserInputError",
    "generate",
    "load",
    "stream_generate",
]
