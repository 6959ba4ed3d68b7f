"""Reading what a user names with bounds: a size limit (``/dev/zero`` never ends) and, for
JSON, a nesting limit (deep nesting exhausts the parser's recursion)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Any, BinaryIO, Optional, Union

import numpy as np

from .errors import UserInputError

MiB = 1 << 20
NOT_REGULAR = "is not a regular file (a FIFO, socket or device)"
#: The largest token count, position, layer index or other count a setting may hold: MLX
#: indexes with int32, and larger values would only fail later, inside numpy or MLX.
MAX_COUNT = 2**31 - 1
_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def is_int(x: Any, numpy: bool = False) -> bool:
    """Whether ``x`` is an integer: a Python int (with ``numpy``, a numpy integer too), never a
    bool (``True`` is an ``int`` to Python, and no count)."""
    kinds = (int, np.integer) if numpy else int
    return isinstance(x, kinds) and not isinstance(x, bool)


def parse_int(text: str) -> int:
    """An integer written in ASCII decimal digits, with an optional sign: Python's ``int``
    also reads ``"3_0"`` as 30, ``" 7 "`` as 7 and Arabic-Indic or fullwidth digits, which a
    user never means as a size.

    Raises:
        ValueError: anything else.
    """
    if not _INT.fullmatch(text):
        raise ValueError(f"not an integer in decimal digits: {text!r}")
    return int(text)


def parse_float(text: str) -> float:
    """A number written in ASCII decimal notation (``0.5``, ``.5``, ``5e-1``), as
    :func:`parse_int` (no ``nan``, ``inf``, underscores or other digits).

    Raises:
        ValueError: anything else.
    """
    if not _FLOAT.fullmatch(text):
        raise ValueError(f"not a decimal number: {text!r}")
    return float(text)


def read_stream(f: BinaryIO, what: str, limit: int) -> bytes:
    """At most ``limit`` bytes of ``f``, all of it.

    Raises:
        UserInputError: ``f`` holds more than ``limit`` bytes, naming ``what``.
    """
    data = f.read(limit + 1)
    if len(data) > limit:
        raise UserInputError(f"{what} is larger than the limit of {_size(limit)}")
    return data


def read_file(path: Union[str, Path], what: str, limit: int) -> bytes:
    """The bytes of the file at ``path`` (at most ``limit``).

    Raises:
        UserInputError: a missing, unreadable or larger file, naming ``what``.
    """
    try:
        with open(path, "rb") as f:
            return read_stream(f, what, limit)
    except FileNotFoundError:
        raise UserInputError(f"{what} does not exist") from None
    except OSError as e:
        raise UserInputError(f"cannot read {what}: {e.strerror or e}") from None


def as_path(path: Any, what: str) -> Path:
    """``path`` (a ``str`` or ``os.PathLike``, not empty) as a :class:`Path`: ``None``, a
    number (``open`` reads an int as a file descriptor) or bytes are no file name.

    Raises:
        UserInputError: naming ``what``.
    """
    if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes):
        raise UserInputError(f"{what} must be a file name (str or Path), got "
                             f"{type(path).__name__}")
    if not os.fspath(path):
        raise UserInputError(f"{what} is empty; give a file name")
    return Path(path)


def regular_file(path: Union[str, Path], what: str) -> Path:
    """``path``, checked to name an existing regular file: not empty, a folder, a FIFO or a
    device (which would block a reader, or be misread).

    Raises:
        UserInputError: naming ``what`` and what ``path`` is instead.
    """
    path = as_path(path, what)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise UserInputError(f"{what} {path} does not exist") from None
    except OSError as e:
        raise UserInputError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if stat.S_ISDIR(mode):
        raise UserInputError(f"{what} {path} is a folder; give a file")
    if not stat.S_ISREG(mode):
        raise UserInputError(f"{what} {path} {NOT_REGULAR}")
    return path


def read_json(path: Union[str, Path], what: str, limit: int, max_depth: int) -> Any:
    """The JSON document in the UTF-8 file at ``path``, at most ``limit`` bytes and
    ``max_depth`` arrays or objects deep.

    Raises:
        UserInputError: as :func:`read_file`, a FIFO, socket or device, or text that is
            not UTF-8, not JSON (numbers too long for Python's int conversion included) or
            nested too deeply.
    """
    # A FIFO nobody writes to would block the reader for good (a prompt may come through a
    # pipe, a JSON file does not); a missing path is read_file's to name.
    path = as_path(path, what)
    with contextlib.suppress(OSError):
        mode = os.stat(path).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise UserInputError(f"{what} {NOT_REGULAR}")
    data = read_file(path, what, limit)
    deep = f"{what} nests arrays or objects more than {max_depth} deep"
    try:
        doc = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UserInputError(f"{what} is not valid UTF-8 (offset {e.start})") from None
    except RecursionError:  # the parser's own depth limit, far beyond max_depth
        raise UserInputError(deep) from None
    except ValueError as e:  # JSONDecodeError, or an integer of thousands of digits
        raise UserInputError(f"{what} is not valid JSON: {e}") from None
    if json_depth(doc, max_depth) > max_depth:
        raise UserInputError(deep)
    return doc


def json_depth(doc: Any, limit: Optional[int] = None) -> int:
    """Nesting depth of arrays and objects in a parsed JSON document (a scalar: 0),
    without recursion; once past ``limit`` it stops looking (enough to refuse the document)."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, (list, dict)):
            deepest = max(deepest, level)
            if limit is not None and deepest > limit:
                break
            stack.extend((child, level + 1)
                         for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n % MiB == 0 else f"{n:,} bytes"
