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


# The shim (``_blas.load_gemv_shim``): what MLX binds ``cblas_sgemm`` to, and that every
# product of one row or a few through it is the matrix product, in float32 rounding (a dot product
# of k terms: ~k * 6e-8 relative at worst, far inside 1e-5 for k <= 700).
needs_shim = pytest.mark.skipif(_blas.gemv_path is None,
                                reason="no C compiler here, or MLX_LAZY_NO_GEMV is set")


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_the_shim_builds_where_a_compiler_is():
    """A shim that no longer compiles must not hide behind the skips below."""
    if os.environ.get("MLX_LAZY_NO_GEMV"):
        pytest.skip("MLX_LAZY_NO_GEMV is set")
    assert _blas.gemv_path is not None


@needs_shim
@pytest.mark.parametrize("k,n", [(576, 1536), (7, 5), (64, 3), (1, 9)])
def test_one_row_products_through_the_shim(k, n):
    import mlx.core as mx
    import numpy as np

    from numerics import rel_err

    rng = np.random.default_rng(k * 31 + n)
    x = rng.standard_normal((1, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)  # a Linear's weight: out x in
    c = rng.standard_normal((1, n)).astype(np.float32)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    # An output buffer MLX just freed, full of NaN: a product with beta = 0 must not read it
    # (the shim passes beta on; BLAS leaves c unread when it is 0).
    mx.eval(mx.full((1, n), mx.nan))
    assert rel_err(mx.array(x) @ mx.array(w).T, want) < 1e-5  # B transposed (a Linear)
    assert rel_err(mx.array(x) @ mx.array(w.T.copy()), want) < 1e-5  # B as stored
    assert rel_err(mx.array(x.T.copy()).T @ mx.array(w).T, want) < 1e-5  # A a column's view
    got = mx.addmm(mx.array(c), mx.array(x), mx.array(w).T, alpha=0.5, beta=2.0)
    assert rel_err(got, 2.0 * c + 0.5 * want) < 1e-5
    batched = mx.array(np.stack([x, 2 * x])) @ mx.array(w).T  # (2, 1, k): one row each
    assert rel_err(batched, np.stack([want, 2 * want])) < 1e-5
    rows = rng.standard_normal((3, k)).astype(np.float32)  # several rows: OpenBLAS's sgemm
    assert rel_err(mx.array(rows) @ mx.array(w).T, rows.astype(np.float64) @ w.T) < 1e-5


@needs_shim
@pytest.mark.parametrize("m", [2, 5, 8, 9, 16, 17])
@pytest.mark.parametrize("k,n", [(256, 1536), (301, 7), (600, 2051)])
def test_few_row_products_through_the_shim(m, k, n):
    """Products of 2-16 rows against a Linear's weight (k >= 256) go to the shim's own kernel:
    one pass of up to 8 rows or two, k with and without a tail of 8, n split between threads
    (1,536 and 2,051 columns) or not (7); 17 rows go to OpenBLAS. Float32 sums of <= 600
    terms, as above."""
    import mlx.core as mx
    import numpy as np

    from numerics import rel_err

    rng = np.random.default_rng(m * 1009 + k * 31 + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    c = rng.standard_normal((m, n)).astype(np.float32)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    mx.eval(mx.full((m, n), mx.nan))  # beta = 0 must not read the output buffer
    assert rel_err(mx.array(x) @ mx.array(w).T, want) < 1e-5
    got = mx.addmm(mx.array(c), mx.array(x), mx.array(w).T, alpha=0.5, beta=2.0)
    assert rel_err(got, 2.0 * c + 0.5 * want) < 1e-5
    wide = mx.array(np.concatenate([x, -x], axis=1))[:, :k]  # rows k apart in a 2k-wide array
    assert rel_err(wide @ mx.array(w).T, want) < 1e-5
    batched = mx.array(np.stack([x, 2 * x])) @ mx.array(w).T
    assert rel_err(batched, np.stack([want, 2 * want])) < 1e-5


_FORKED_PRODUCT = r"""
import ctypes, os, sys
import numpy as np
shim = ctypes.CDLL(sys.argv[1])
m, n, k = 4, 2048, 512
a, b = np.ones((m, k), np.float32), np.ones((n, k), np.float32)
def product():  # row-major c = a b^T through the shim's cblas_sgemm, as MLX calls it
    c = np.zeros((m, n), np.float32)
    p = lambda x: x.ctypes.data_as(ctypes.c_void_p)
    shim.cblas_sgemm(101, 111, 112, m, n, k, ctypes.c_float(1), p(a), k, p(b), k,
                     ctypes.c_float(0), p(c), n)
    return c
assert (product() == k).all()  # the parent's helper threads start here
pid = os.fork()
if pid == 0:
    os._exit(0 if (product() == k).all() else 3)
print("CHILD", os.waitpid(pid, 0)[1])
"""


@needs_shim
@pytest.mark.slow  # runs a process of its own
def test_few_row_products_in_a_forked_child():
    """The shim's helper threads are not in a forked child: a child that multiplies a few rows
    again starts its own instead of waiting for the parent's forever (GCC's OpenMP runtime
    would). Called through ctypes: MLX itself does not run in a forked child."""
    out = subprocess.run([sys.executable, "-c", _FORKED_PRODUCT, _blas.gemv_path],
                         capture_output=True, text=True, timeout=60, check=True)
    assert "CHILD 0" in out.stdout, out.stdout + out.stderr


@needs_shim
@pytest.mark.slow  # runs processes of their own
def test_mlx_binds_to_the_shim_and_the_opt_out():
    code = ("import mlx_lazy, mlx.core as mx; from mlx_lazy import _blas; "
            "mx.eval(mx.ones((1, 8)) @ mx.ones((8, 8))); print('SHIM', _blas.gemv_path)")
    env = {k: v for k, v in os.environ.items() if k != "MLX_LAZY_NO_GEMV"}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "LD_DEBUG": "bindings"},
                         capture_output=True, text=True, check=True)
    bound = [line for line in out.stderr.splitlines()
             if "libmlx" in line.split("to ")[0] and "`cblas_sgemm'" in line]
    assert len(bound) == 1 and _blas.gemv_path in bound[0], bound
    off = subprocess.run([sys.executable, "-c", code], env={**env, "MLX_LAZY_NO_GEMV": "1"},
                         capture_output=True, text=True, check=True)
    assert "SHIM None" in off.stdout
