"""The optional extras: the library imports without them; the server and the plots without
theirs are one line naming the extra (an exception in a library, ``error:`` + status 2 in a
tool). A missing package is simulated with ``sys.modules[name] = None`` in a subprocess."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

import mlx_lazy

EXTRAS = {"server": ("fastapi", "uvicorn", "sse_starlette", "starlette", "pydantic"),
          "bench": ("matplotlib",)}
NEEDS_EXTRA = {"mlx_lazy.server": "server", "mlx_lazy.server_http": "server",
               "mlx_lazy.server_schemas": "server", "mlx_lazy.bench.plots": "bench"}


def run_without(packages: tuple[str, ...], code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter in which ``packages`` cannot be imported."""
    block = "".join(f"sys.modules[{p!r}] = None\n" for p in packages)
    return subprocess.run([sys.executable, "-c", f"import sys\n{block}{code}"],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # runs a process of its own
def test_the_library_imports_without_any_extra():
    modules = sorted(m.name for m in pkgutil.walk_packages(mlx_lazy.__path__, "mlx_lazy.")
                     if m.name not in NEEDS_EXTRA and not m.name.endswith("__main__"))
    assert "mlx_lazy.bench.harness" in modules and "mlx_lazy.cli" in modules
    code = "import importlib\nfor m in %r:\n    importlib.import_module(m)\nprint('ok')" % modules
    proc = run_without(sum(EXTRAS.values(), ()), code)
    assert proc.stdout.strip() == "ok", proc.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("module,missing", [("mlx_lazy.server", "fastapi"),
                                            ("mlx_lazy.server", "sse_starlette"),
                                            ("mlx_lazy.bench.plots", "matplotlib")])
def test_a_missing_extra_is_one_line_naming_it(module, missing):
    extra = NEEDS_EXTRA[module]
    feature = {"server": "the server", "bench": "the plots"}[extra]
    line = (f"{feature} needs the [{extra}] extra (no module named {missing!r}): "
            f"pip install 'mlx-lazy[{extra}]'")
    # A library user: one exception, the package's user-error type.
    proc = run_without((missing,), f"from mlx_lazy.errors import UserInputError\ntry:\n"
                                   f"    import {module}\nexcept UserInputError as e:\n"
                                   f"    print(e)")
    assert proc.stdout.strip() == line, proc.stderr[-2000:]
    # A tool (a console script's argv[0]): one error line and status 2, no traceback.
    proc = run_without((missing,), f"import runpy\nsys.argv = ['mlx-lazy-tool']\n"
                                   f"runpy.run_module({module!r}, run_name='__main__')")
    assert (proc.returncode, proc.stderr) == (2, f"error: {line}\n")
