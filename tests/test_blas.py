"""Every entry point runs with Debian's OpenBLAS loaded before mlx.core, with no variable set.

Checked from the child process's memory maps (/proc/<pid>/maps), not by timing.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import time
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

import pytest

from mlx_lazy import _blas

REPO = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"),
                       reason="OpenBLAS preload is Linux-only"),
    pytest.mark.skipif(_blas.loaded_path is None,
                       reason=f"OpenBLAS is not installed here ({_blas.INSTALL_HINT})"),
]

# Run an entry point as __main__ (as `python -m` / `python script.py` / a console script
# would), and at exit print what the process has mapped. If the entry point never imported
# mlx itself (e.g. --help), import it in the hook: OpenBLAS must already be there by then.
_HOOK = r"""
import atexit, runpy, sys
kind, target, *args = sys.argv[1:]
def report():
    import mlx.core as mx
    mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))
    blas = sys.modules.get("mlx_lazy._blas")
    maps = open("/proc/self/maps").read()
    libs = sorted({line.split()[-1] for line in maps.splitlines() if "blas" in line.lower()})
    print("REPORT", repr({"libs": libs, "before_mlx": getattr(blas, "loaded_before_mlx", None)}))
atexit.register(report)
sys.argv = [target, *args]
if kind == "module":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    sys.path.insert(0, __import__("os").path.dirname(target))
    runpy.run_path(target, run_name="__main__")
"""


def _runs_as_main(path: Path) -> bool:
    """Whether the module has a top-level ``if __name__ == "__main__":`` block (parsed, so
    quotes and spacing do not matter)."""
    return any(isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"
               for node in ast.parse(path.read_text()).body)


def _console_scripts() -> list[EntryPoint]:
    """The installed distribution's console scripts."""
    return [ep for ep in entry_points(group="console_scripts") if ep.value.startswith("mlx_lazy")]


def _entry_points() -> list[tuple[str, str]]:
    """(kind, target) for every module with a __main__ block, script, and installed console
    script."""
    found = []
    for path in sorted((REPO / "mlx_lazy").rglob("*.py")):
        if _runs_as_main(path):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found.append(("module", module.removesuffix(".__main__")))
    for folder in ("convert", "examples"):
        found += [("script", str(p)) for p in sorted((REPO / folder).glob("*.py"))]
    # The interpreter's own scripts first: a virtual environment not on PATH (PYTHON=venv/bin/
    # python bash scripts/test.sh) would otherwise find another install's (a pyenv shim).
    search = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    found += [("script", exe) for exe in (shutil.which(ep.name, path=search)
                                          for ep in _console_scripts()) if exe]
    return found


ENTRY_POINTS = _entry_points()


def _report(out: str) -> dict:
    line = [line for line in out.splitlines() if line.startswith("REPORT ")]
    assert line, out[-2000:]
    return eval(line[-1][len("REPORT "):])  # noqa: S307 (our own repr)


@pytest.mark.slow
@pytest.mark.parametrize("kind,target", ENTRY_POINTS,
                         ids=[Path(t).name if k == "script" else t for k, t in ENTRY_POINTS])
def test_entry_point_loads_openblas(kind, target):
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "MLX_LAZY_NO_OPENBLAS")}
    proc = subprocess.run([sys.executable, "-c", _HOOK, kind, target, "--help"],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    report = _report(proc.stdout)
    assert any("openblas-pthread/libopenblas" in lib for lib in report["libs"]), report
    assert report["before_mlx"] is True, report


def test_every_installed_console_script_and_main_module_is_covered():
    scripts = _console_scripts()
    assert scripts and all(("script", shutil.which(ep.name)) in ENTRY_POINTS for ep in scripts)
    # Each console script's module, run with -m, is the same tool: it has a __main__ block too
    # or a sibling that runs it (mlx_lazy.generate for mlx_lazy.cli).
    modules = {t for k, t in ENTRY_POINTS if k == "module"}
    assert {ep.module for ep in scripts} - modules <= {"mlx_lazy.cli"}


@pytest.mark.slow  # runs a process of its own
def test_cli_generation_as_a_user_runs_it(tiny_model_path):
    """`python -m mlx_lazy.generate` doing real work, unwrapped: its live /proc/<pid>/maps."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    cmd = [sys.executable, "-m", "mlx_lazy.generate", "--model", str(tiny_model_path),
           "-p", "The quick brown fox " * 20, "-m", "32"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    seen_mlx = seen_openblas = False
    try:
        while proc.poll() is None:
            try:
                maps = Path(f"/proc/{proc.pid}/maps").read_text()
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                break
            if "libmlx" in maps:  # mlx is loaded: OpenBLAS must be there already
                seen_mlx = True
                seen_openblas = "openblas-pthread/libopenblas" in maps
                break
            time.sleep(0.01)
    finally:
        _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    assert seen_mlx, "the CLI exited before its maps could be read"
    assert seen_openblas
