"""Ctrl-C while one of mlx-lazy's command-line tools starts up: one line, not a traceback.

Importing mlx, mlx-lm and transformers takes seconds, and it happens before any ``main`` can
catch KeyboardInterrupt (``python -m mlx_lazy.generate`` imports the package first). So when
this process is one of our tools, the package installs an exception hook that reports an
uncaught KeyboardInterrupt as one line; Python then exits as killed by SIGINT (status 130 in
the shell), as it always does. Library users keep Python's own behaviour.
"""

from __future__ import annotations

import os
import sys

SCRIPT_PREFIX = "mlx-lazy-"  # console scripts: mlx-lazy-generate, mlx-lazy-convert
MODULE_PREFIX = "mlx_lazy"  # python -m mlx_lazy.generate, mlx_lazy.convert, mlx_lazy.bench


def running_a_tool() -> bool:
    """True when this process was started as an mlx-lazy console script or ``-m`` module."""
    argv = list(getattr(sys, "orig_argv", ()))[1:]
    while argv and argv[0].startswith("-") and argv[0] != "-c":  # interpreter options
        arg = argv.pop(0)
        if arg == "-m":
            return bool(argv) and argv[0].split(".")[0] == MODULE_PREFIX
        if arg.startswith("-m"):
            return arg[2:].split(".")[0] == MODULE_PREFIX
        if arg in ("-W", "-X") and argv:  # options with a separate value
            argv.pop(0)
    return os.path.basename(sys.argv[0] if sys.argv else "").startswith(SCRIPT_PREFIX)


def _hook(kind, value, tb) -> None:
    if issubclass(kind, KeyboardInterrupt):
        print("interrupted", file=sys.stderr)
    else:
        sys.__excepthook__(kind, value, tb)


def install() -> None:
    """Report Ctrl-C as one line when this process is one of our tools."""
    if running_a_tool() and sys.excepthook is sys.__excepthook__:
        sys.excepthook = _hook
