"""Load Debian's OpenBLAS before ``mlx.core`` so float32 matmuls run at full speed on Linux.

The ``mlx[cpu]`` wheel links against ``libblas.so.3``-style symbols and bundles netlib's
reference BLAS (~5 GFLOP/s). Loading OpenBLAS first with ``RTLD_GLOBAL`` makes the dynamic
linker resolve those symbols to OpenBLAS instead (25-60x faster, same results). This only
works if it happens before ``mlx.core`` is first imported in the process, which is why
``mlx_lazy/__init__.py`` imports this module before anything else. A small shim loaded ahead
of OpenBLAS sends one-row products to its matrix-vector routine (:func:`load_gemv_shim`).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .folders import cache_root, sweep_stale_temps, temp_prefix

OPENBLAS_PATHS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)
INSTALL_HINT = "sudo apt-get install -y libopenblas0-pthread"

#: Path of the OpenBLAS library loaded by this module, or None.
loaded_path: str | None = None
#: False when mlx.core was already imported at load time: OpenBLAS is then mapped but unused.
loaded_before_mlx: bool = True
_warned = False


def load_openblas() -> str | None:
    """Load OpenBLAS globally if present; return its path (None on macOS or when missing).

    Idempotent. On Linux without OpenBLAS, prints one warning line to stderr naming the
    ``apt-get`` command. Set ``MLX_LAZY_NO_OPENBLAS=1`` to skip (used to measure the
    difference).
    """
    global loaded_path, loaded_before_mlx
    if loaded_path is not None or sys.platform != "linux":
        return loaded_path
    if os.environ.get("MLX_LAZY_NO_OPENBLAS"):
        return None
    for path in OPENBLAS_PATHS:
        if os.path.exists(path):
            load_gemv_shim(path)  # first: its cblas_sgemm must precede OpenBLAS's
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            loaded_path = path
            loaded_before_mlx = "mlx.core" not in sys.modules
            if not loaded_before_mlx:
                _warn("mlx.core was imported before mlx_lazy, so OpenBLAS is loaded but unused; "
                      "import mlx_lazy first")
            return path
    _warn(f"OpenBLAS not found; float32 matmuls on this {platform.machine()} CPU will be "
          f"~30x slower. Fix: {INSTALL_HINT}")
    return None


#: MLX multiplies float32 matrices with ``cblas_sgemm`` only, a decode step's one-row
#: products included, and OpenBLAS 0.3.21 runs those through its matrix path: a 576 -> 1,536
#: product of one row took 0.20-0.22 ms where its matrix-vector routine takes 0.13 (weights
#: from memory), and SmolLM2's whole decode step at 4K 61 against 47 ms. The shim defines
#: ``cblas_sgemm``, hands row-major products of one row to OpenBLAS's ``cblas_sgemv`` and
#: everything else to its ``cblas_sgemm``; loaded before OpenBLAS, it is what MLX binds to.
_GEMV_SHIM = r"""
#include <dlfcn.h>
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
typedef void (*sgemm_t)(int, int, int, int, int, int, float, const float *, int,
                        const float *, int, float, float *, int);
typedef void (*sgemv_t)(int, int, int, int, float, const float *, int, const float *, int,
                        float, float *, int);
static sgemm_t sgemm;
static sgemv_t sgemv;

__attribute__((constructor)) static void bind(void) {
  void *blas = dlopen(@OPENBLAS@, RTLD_NOW | RTLD_LOCAL);
  if (blas) {
    sgemm = (sgemm_t)dlsym(blas, "cblas_sgemm");
    sgemv = (sgemv_t)dlsym(blas, "cblas_sgemv");
  }
}

int mlx_lazy_gemv_bound(void) { return sgemm != 0 && sgemv != 0; }

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
  if (order == ROW_MAJOR && m == 1 && k > 0) {
    /* c (1 x n) = alpha a op(B) + beta c, so c^T = alpha op(B)^T a^T + beta c^T. a's k values
       are a row (stride 1), or a column of a transposed k x 1 matrix (stride lda). With beta
       0, BLAS does not read c (which may hold anything), as sgemm does not. */
    if (tb == NO_TRANS) /* B is k x n: c^T = B^T a^T */
      sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, ta == TRANS ? lda : 1, beta, c, 1);
    else /* B is stored n x k: c^T = B a^T */
      sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, ta == TRANS ? lda : 1, beta, c, 1);
    return;
  }
  sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
"""
#: Path of the loaded shim, or None (no C compiler, another platform, ``MLX_LAZY_NO_GEMV``).
gemv_path: str | None = None


def load_gemv_shim(openblas: str) -> str | None:
    """Build (once, into the user's cache, with the system C compiler) and load the one-row
    shim in front of the OpenBLAS at ``openblas``; return its path, None when it cannot be
    built or loaded (nothing changes then) or ``MLX_LAZY_NO_GEMV=1`` is set."""
    global gemv_path
    if gemv_path is not None or os.environ.get("MLX_LAZY_NO_GEMV"):
        return gemv_path
    source = _GEMV_SHIM.replace("@OPENBLAS@", json.dumps(openblas))
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    cache = cache_root()
    target = cache / f"gemv-{digest}.so"
    try:
        if not target.exists():
            compiler = shutil.which("cc") or shutil.which("gcc")
            if compiler is None:
                return None
            cache.mkdir(parents=True, exist_ok=True)
            sweep_stale_temps(cache)  # a build killed half-way
            with tempfile.TemporaryDirectory(prefix=temp_prefix(target), dir=cache) as tmp:
                c_file = Path(tmp) / "gemv.c"
                c_file.write_text(source)
                built = Path(tmp) / "gemv.so"
                subprocess.run([compiler, "-O2", "-shared", "-fPIC", str(c_file), "-o",
                                str(built), "-ldl"], check=True, capture_output=True,
                               timeout=60)
                os.replace(built, target)  # whole or not at all
        # Local first: a shim that found no OpenBLAS must never be what MLX binds to.
        if not ctypes.CDLL(str(target), mode=ctypes.RTLD_LOCAL).mlx_lazy_gemv_bound():
            return None
        ctypes.CDLL(str(target), mode=ctypes.RTLD_GLOBAL)
    except (OSError, subprocess.SubprocessError):
        return None
    gemv_path = str(target)
    return gemv_path


#: OpenBLAS 0.3's float32 gemm on x86-64 runs a matrix of n rows (1 < n < 64) far slower when
#: n is not a multiple of 16 (its kernel's row block): on the 2-core x86 VM a 576 -> 1536
#: layer took 0.48 ms for 8 rows, 0.75 ms for 12 and 0.33 ms for 16 (1 row: 0.19 ms, a
#: gemv). Rows that a decode step revives meet this at every layer above a cut.
GEMM_ROW_BLOCK = 16
_X86_64 = platform.machine() == "x86_64"  # read once: gemm_rows runs at every layer of a step


def gemm_rows(n: int) -> int:
    """Rows to give a float32 matmul of ``n`` rows on the CPU: ``n`` padded up to a multiple
    of :data:`GEMM_ROW_BLOCK` where OpenBLAS on x86-64 runs that faster (the remainder 3 or
    more, under 64 rows; measured in the comment above), else ``n``."""
    if (loaded_path is None or not _X86_64 or n >= 4 * GEMM_ROW_BLOCK
            or n % GEMM_ROW_BLOCK < 3):
        return n
    return -(-n // GEMM_ROW_BLOCK) * GEMM_ROW_BLOCK


def _warn(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        print(f"mlx_lazy: {message}", file=sys.stderr)


load_openblas()
