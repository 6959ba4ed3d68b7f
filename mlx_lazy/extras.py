"""The optional extras: the base install is the library; ``[server]`` (fastapi, uvicorn,
sse-starlette) adds :mod:`mlx_lazy.server` and ``[bench]`` (matplotlib) the plots of
:mod:`mlx_lazy.bench.plots`. Importing either without its extra is one line naming it."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

from ._interrupt import running_a_tool
from .errors import UserInputError


@contextmanager
def needs_extra(extra: str, feature: str) -> Iterator[None]:
    """Wrap the imports of an optional feature: a missing package becomes
    ``"<feature> needs the [<extra>] extra ...: pip install 'mlx-lazy[<extra>]'"``.

    Raises:
        UserInputError: with that message, in a library user's process.
        SystemExit: status 2 after printing it as one ``error:`` line, in one of mlx-lazy's
            command-line tools (their imports run before any ``main`` could catch it).
    """
    try:
        yield
    except ModuleNotFoundError as e:
        message = (f"{feature} needs the [{extra}] extra (no module named {e.name!r}): "
                   f"pip install 'mlx-lazy[{extra}]'")
        if running_a_tool():
            print(f"error: {message}", file=sys.stderr)
            raise SystemExit(2) from None
        raise UserInputError(message) from e
