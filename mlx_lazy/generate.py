"""``python -m mlx_lazy.generate``: the command-line interface, named like mlx-lm's.

The code lives in :mod:`mlx_lazy.cli`; the Python API (``mlx_lazy.generate`` the function)
lives in :mod:`mlx_lazy.api`. Keeping this module out of the package's imports lets runpy
start it without a "found in sys.modules" warning; importing it does not replace the package
attribute ``mlx_lazy.generate`` (the function), see ``mlx_lazy/__init__.py``.
"""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
