"""mlx-lazy: long-context token pruning (LazyLLM, SPEED) for Llama-family models on MLX."""

import importlib
import sys
import types

from . import _interrupt

_interrupt.install()  # before the slow imports below: Ctrl-C there is one line in our tools

from . import _blas  # noqa: E402,F401  (must precede any mlx import)
from . import _malloc  # noqa: E402,F401

with _interrupt.held():  # a Ctrl-C inside mlx.core's C++ initialisation aborts the process
    importlib.import_module("mlx.core")
from .errors import UserInputError  # noqa: E402
from .engine import GenerationStats, LazyEngine  # noqa: E402
from .prompt_cache import (PromptCache, can_trim_prompt_cache, load_prompt_cache,  # noqa: E402
                           make_prompt_cache, save_prompt_cache, trim_prompt_cache)
from .resolve import resolve_config  # noqa: E402
from .api import GenerationResponse, generate, generate_step, load, stream_generate  # noqa: E402
from .config import PruningConfig, build_schedule  # noqa: E402
from .policies import METHODS  # noqa: E402
from .schedule import Schedule  # noqa: E402
from .schedule_files import read_schedule, write_schedule  # noqa: E402


class _Package(types.ModuleType):
    """This package's module type. Importing the submodule ``mlx_lazy.generate`` (the
    command-line entry, named like mlx-lm's) makes Python set it as the package attribute
    ``generate``; that assignment is ignored so ``mlx_lazy.generate`` stays the function in
    every import order. The submodule itself is in ``sys.modules`` as usual."""

    def __setattr__(self, name: str, value) -> None:
        if name == "generate" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = [
    "METHODS",
    "GenerationResponse",
    "GenerationStats",
    "LazyEngine",
    "PromptCache",
    "PruningConfig",
    "Schedule",
    "UserInputError",
    "build_schedule",
    "can_trim_prompt_cache",
    "generate",
    "generate_step",
    "load",
    "load_prompt_cache",
    "make_prompt_cache",
    "read_schedule",
    "resolve_config",
    "save_prompt_cache",
    "stream_generate",
    "trim_prompt_cache",
    "write_schedule",
]
