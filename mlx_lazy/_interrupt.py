"""Ctrl-C while one of mlx-lazy's command-line tools starts up: one line, not a traceback.

Importing mlx, mlx-lm and transformers takes seconds, and it happens before any ``main`` can
catch KeyboardInterrupt (``python -m mlx_lazy.generate`` imports the package first). So when
this process is one of our tools, the package installs an exception hook that reports an
uncaught KeyboardInterrupt as one line; Python then exits as killed by SIGINT (status 130 in
the shell), as it always does. Library users keep Python's own behaviour.

Compiled extensions do not survive a KeyboardInterrupt raised inside their initialisation:
mlx.core's nanobind bindings abort the process (SIGABRT, "Critical nanobind error") or turn
it into an ImportError. So a tool holds SIGINT back while mlx.core initialises
(:func:`held`), and the hook also reports an error raised from a KeyboardInterrupt as one.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

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


def _caused_by_interrupt(error: BaseException | None) -> bool:
    """True if ``error`` is a KeyboardInterrupt or was raised from (or while handling) one."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def _hook(kind, value, tb) -> None:
    if not _caused_by_interrupt(value):
        sys.__excepthook__(kind, value, tb)
        return
    print("interrupted", file=sys.stderr, flush=True)
    if not issubclass(kind, KeyboardInterrupt):
        # Python exits with status 130 only for a bare KeyboardInterrupt; die by SIGINT as it would.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)


def install() -> None:
    """Report Ctrl-C as one line when this process is one of our tools."""
    if running_a_tool() and sys.excepthook is sys.__excepthook__:
        sys.excepthook = _hook


@contextmanager
def held() -> Iterator[None]:
    """In one of our tools, a Ctrl-C during the block is raised as KeyboardInterrupt when the
    block ends instead of inside it. Elsewhere (a library user, another thread, SIGINT not
    handled by Python) the block runs as it is."""
    if (not running_a_tool() or threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    caught = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if caught:
        raise KeyboardInterrupt
