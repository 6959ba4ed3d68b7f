"""The one error type for input the user can fix, and how its message is shown."""


class UserInputError(ValueError):
    """Bad input that the user can fix: a path, a flag, a schedule, a prompt, a model file.

    The command-line tools report it as one ``error: ...`` line and exit with status 2; any
    other exception is an internal error and keeps its traceback. It subclasses ValueError,
    so API callers may catch either.
    """


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message collapsed onto one line and cut at ``limit`` characters (some
    libraries' messages list hundreds of names)."""
    msg = " ".join(str(exc).split()) or type(exc).__name__
    return msg if len(msg) <= limit else msg[: limit - 1] + "…"
