"""The one error type for input the user can fix, and how its message is shown."""

import math
from typing import Any, Optional


class UserInputError(ValueError):
    """Bad input that the user can fix: a path, a flag, a schedule, a prompt, a model file.

    The command-line tools report it as one ``error: ...`` line and exit with status 2; any
    other exception is an internal error and keeps its traceback. It subclasses ValueError,
    so API callers may catch either.
    """

    #: The setting refused, where one is (``keep[1]``, ``scorer``): what a caller that names
    #: fields (the server's ``param``) names.
    field: Optional[str] = None


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message collapsed onto one line and cut at ``limit`` characters (some
    libraries' messages list hundreds of names)."""
    msg = " ".join(str(exc).split()) or type(exc).__name__
    return msg if len(msg) <= limit else msg[: limit - 1] + "…"


def shown(x: Any, limit: Optional[int] = None) -> str:
    """``repr(x)`` for an error message: an integer too long to read is shown by its number of
    digits (Python refuses to print one past 4,300 digits, even inside a list), and with
    ``limit`` the text is cut to that many characters."""
    if isinstance(x, int) and x.bit_length() > 64:
        return f"an integer of about {round(x.bit_length() * math.log10(2))} digits"
    try:
        text = repr(x)
    except ValueError:
        return f"a {type(x).__name__} holding an integer too long to print"
    return text if limit is None or len(text) <= limit else text[: limit - 4] + "...'"
