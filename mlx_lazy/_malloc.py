"""Keep glibc from returning large freed blocks to the kernel between MLX ops on Linux.

MLX's CPU backend allocates every intermediate with ``malloc``. glibc serves large requests
with a fresh ``mmap`` (and trims the heap after large frees), so each attention-sized
intermediate is page-faulted in again at every op: on the 2-core test machines a masked
softmax over 512 x 4,096 scores spent most of its time in page faults. Raising the mmap and
trim thresholds makes freed blocks reusable, like the buffer cache MLX keeps on Metal.
Resident memory can stay up to :data:`TRIM_THRESHOLD` above the live arrays after a peak.

Set ``MLX_LAZY_NO_MALLOPT=1`` to skip; glibc's own ``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_`` environment variables take precedence when set.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: Requests below this come from the heap (glibc's default adapts between 128 KiB and 32 MiB).
MMAP_THRESHOLD = 256 << 20
#: Free memory kept at the top of the heap before it is returned to the kernel.
TRIM_THRESHOLD = 512 << 20

#: True when the thresholds were set by this module.
tuned = False


def tune_malloc() -> bool:
    """Raise glibc's mmap and trim thresholds (Linux only); return whether they were set."""
    global tuned
    if tuned or sys.platform != "linux" or os.environ.get("MLX_LAZY_NO_MALLOPT"):
        return tuned
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (e.g. musl)
        return False
    tuned = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    return tuned


tune_malloc()
