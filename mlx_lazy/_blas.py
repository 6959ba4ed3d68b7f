"""Load Debian's OpenBLAS before ``mlx.core`` so float32 matmuls run at full speed on Linux.

The ``mlx[cpu]`` wheel links against ``libblas.so.3``-style symbols and bundles netlib's
reference BLAS (~5 GFLOP/s). Loading OpenBLAS first with ``RTLD_GLOBAL`` makes the dynamic
linker resolve those symbols to OpenBLAS instead (25-60x faster, same results). This only
works if it happens before ``mlx.core`` is first imported in the process, which is why
``mlx_lazy/__init__.py`` imports this module before anything else.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

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
