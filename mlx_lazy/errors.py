"""The one error type for input the user can fix."""


class UserInputError(ValueError):
    """Bad input that the user can fix: a path, a flag, a schedule, a prompt, a model file.

    The command-line tools report it as one ``error: ...`` line and exit with status 2; any
    other exception is an internal error and keeps its traceback. It subclasses ValueError,
    so API callers may catch either.
    """
