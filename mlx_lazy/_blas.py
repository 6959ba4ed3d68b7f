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


#: Most rows the shim's few-row kernel multiplies (two passes of 8: 16 rows of Qwen's 896 ->
#: 4,864 layer 2.1 ms against OpenBLAS's 2.8, through MLX).
FEW_ROWS = 16

#: MLX multiplies float32 matrices with ``cblas_sgemm`` only, a decode step's one-row
#: products included, and OpenBLAS 0.3.21 runs those through its matrix path: a 576 -> 1,536
#: product of one row took 0.20-0.22 ms where its matrix-vector routine takes 0.13 (weights
#: from memory), and SmolLM2's whole decode step at 4K 61 against 47 ms. Products of a few
#: rows (the rows a pruned decode step revives, above every cut) fare worse: its matrix path
#: reads the weights at a quarter of the memory's speed (Qwen's 896 -> 4,864 layer: 1 row
#: 0.34 ms by sgemv, 2 rows 1.2 ms, 5 rows 1.7, 16 rows 1.4). The shim defines
#: ``cblas_sgemm``: row-major products of one row go to OpenBLAS's ``cblas_sgemv``, of 2-16
#: rows against a weight stored n x k (a Linear's) to ``few_rows`` below, which streams the
#: weight once for all rows, split across the cores (4 rows 0.39-0.43 ms, 8 rows 0.50), and the
#: rest to OpenBLAS's ``cblas_sgemm``. Loaded before OpenBLAS, it is what MLX binds to.
_GEMV_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
/* MIN_DEPTH: below it (attention's q k^T over 64-128 dimensions) the row sums cost more than
   the stream saves (7 queries x 4,096 keys x 64: 0.29 ms against OpenBLAS's 0.14). */
enum { FEW_ROWS = @FEW_ROWS@, PASS_ROWS = 8, MIN_DEPTH = 256, PREFETCH = 1024,
       PARALLEL_MIN = 1 << 16 };
typedef void (*sgemm_t)(int, int, int, int, int, int, float, const float *, int,
                        const float *, int, float, float *, int);
typedef void (*sgemv_t)(int, int, int, int, float, const float *, int, const float *, int,
                        float, float *, int);
typedef float v8 __attribute__((vector_size(32)));
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

static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }

/* c[i, j] = alpha sum_p a[i, p] b[j, p] + beta c[i, j] for i < rows (constant once inlined)
   and j0 <= j < j1: each row of b is read once, for all rows of a (which stay in cache). */
static inline __attribute__((always_inline)) void
dot_rows(const int rows, int j0, int j1, int k, float alpha, const float *a, int lda,
         const float *b, int ldb, float beta, float *c, int ldc) {
  const int k8 = k & ~7;
  for (int j = j0; j < j1; j++) {
    const float *bj = b + (long)j * ldb;
    v8 acc[PASS_ROWS] = {0};
    for (int p = 0; p < k8; p += 8) {
      __builtin_prefetch(bj + p + PREFETCH);
      v8 x = load8(bj + p);
      for (int i = 0; i < rows; i++) acc[i] += x * load8(a + (long)i * lda + p);
    }
    for (int i = 0; i < rows; i++) {
      float s = 0;
      for (int l = 0; l < 8; l++) s += acc[i][l];
      for (int p = k8; p < k; p++) s += a[(long)i * lda + p] * bj[p];
      float *out = c + (long)i * ldc + j;
      *out = beta == 0 ? alpha * s : alpha * s + beta * *out; /* beta 0: c unread, as BLAS */
    }
  }
}

static void dot_pass(int rows, int j0, int j1, int k, float alpha, const float *a, int lda,
                     const float *b, int ldb, float beta, float *c, int ldc) {
  switch (rows) {
#define ROWS(r) case r: dot_rows(r, j0, j1, k, alpha, a, lda, b, ldb, beta, c, ldc); break;
    ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
  }
}

/* All m rows, PASS_ROWS at a time, for the columns j0 <= j < j1. */
static void passes(int m, int j0, int j1, int k, float alpha, const float *a, int lda,
                   const float *b, int ldb, float beta, float *c, int ldc) {
  for (int i = 0; i < m; i += PASS_ROWS)
    dot_pass(m - i < PASS_ROWS ? m - i : PASS_ROWS, j0, j1, k, alpha, a + (long)i * lda, lda,
             b, ldb, beta, c + (long)i * ldc, ldc);
}

/* The rows' products split by columns between the caller and a few helper threads, which
   spin a little between products (a layer's come 0.1-1 ms apart; waking a sleeping thread
   costs about what a product of 5 rows saves) and then sleep on a condition variable. Not
   OpenMP: GCC's runtime hangs a forked child that multiplies again; here a child starts its
   own helpers. */
enum { MAX_THREADS = 8, SPIN_NS = 200000 };
static struct { int m, n, k, lda, ldb, ldc; float alpha, beta; const float *a, *b; float *c; } job;
static int threads = 1, started;
static _Atomic unsigned long round_;  /* bumped for each product the helpers share */
static _Atomic unsigned long busy;    /* helpers still on this round */
static pthread_mutex_t caller = PTHREAD_MUTEX_INITIALIZER, lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER, idle = PTHREAD_COND_INITIALIZER;

static inline void relax(void) {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

/* Spin up to SPIN_NS while (*x == v) == same; return whether that still holds. */
static int spin_while(_Atomic unsigned long *x, unsigned long v, int same) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  long long end = t.tv_sec * 1000000000LL + t.tv_nsec + SPIN_NS;
  while ((atomic_load(x) == v) == same) {
    for (int i = 0; i < 64; i++) relax();
    clock_gettime(CLOCK_MONOTONIC, &t);
    if (t.tv_sec * 1000000000LL + t.tv_nsec > end) return 1;
  }
  return 0;
}

static void share(int t) {
  passes(job.m, (int)((long)job.n * t / threads), (int)((long)job.n * (t + 1) / threads),
         job.k, job.alpha, job.a, job.lda, job.b, job.ldb, job.beta, job.c, job.ldc);
}

static void *helper(void *arg) {
  int t = (int)(long)arg;
  unsigned long seen = 0;
  for (;;) {
    if (spin_while(&round_, seen, 1)) {
      pthread_mutex_lock(&lock);
      while (atomic_load(&round_) == seen) pthread_cond_wait(&wake, &lock);
      pthread_mutex_unlock(&lock);
    }
    seen = atomic_load(&round_);
    share(t);
    if (atomic_fetch_sub(&busy, 1) == 1) {
      pthread_mutex_lock(&lock);
      pthread_cond_signal(&idle);
      pthread_mutex_unlock(&lock);
    }
  }
  return 0;
}

static void after_fork_in_child(void) {  /* the parent's helpers are not in the child */
  pthread_mutex_init(&caller, 0); pthread_mutex_init(&lock, 0);
  pthread_cond_init(&wake, 0); pthread_cond_init(&idle, 0);
  threads = 1; started = 0; atomic_store(&round_, 0); atomic_store(&busy, 0);
}

static pthread_once_t at_fork = PTHREAD_ONCE_INIT;
static void register_at_fork(void) { pthread_atfork(0, 0, after_fork_in_child); }

static void start_helpers(void) {
  cpu_set_t cpus;
  int cores = sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
  int wanted = cores < MAX_THREADS ? cores : MAX_THREADS;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_t id;
  for (threads = 1; threads < wanted; threads++)
    if (pthread_create(&id, &attr, helper, (void *)(long)threads) != 0) break;
  pthread_attr_destroy(&attr);
  started = 1;
  pthread_once(&at_fork, register_at_fork);  /* once per process image, not per fork */
}

static void few_rows(int m, int n, int k, float alpha, const float *a, int lda, const float *b,
                     int ldb, float beta, float *c, int ldc) {
  if ((long)n * k < PARALLEL_MIN || pthread_mutex_trylock(&caller) != 0) {
    passes(m, 0, n, k, alpha, a, lda, b, ldb, beta, c, ldc);  /* small, or another caller */
    return;
  }
  if (!started) start_helpers();
  job.m = m; job.n = n; job.k = k; job.alpha = alpha; job.beta = beta;
  job.a = a; job.lda = lda; job.b = b; job.ldb = ldb; job.c = c; job.ldc = ldc;
  atomic_store(&busy, threads - 1);
  pthread_mutex_lock(&lock);
  atomic_fetch_add(&round_, 1);  /* publishes job: sequentially consistent */
  pthread_cond_broadcast(&wake);
  pthread_mutex_unlock(&lock);
  share(0);
  if (spin_while(&busy, 0, 0)) {
    pthread_mutex_lock(&lock);
    while (atomic_load(&busy)) pthread_cond_wait(&idle, &lock);
    pthread_mutex_unlock(&lock);
  }
  pthread_mutex_unlock(&caller);
}

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
  if (order == ROW_MAJOR && ta == NO_TRANS && tb == TRANS && m <= FEW_ROWS && k >= MIN_DEPTH) {
    few_rows(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
"""
def _cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty when unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f
                         if line.startswith("flags")), set())
    except OSError:
        return set()


#: The shim's compiler flags: AVX2 and FMA where this CPU has them (named, not -march=native,
#: so the cache digest tells a folder shared by two kinds of machine which build is whose).
SHIM_FLAGS = ("-O3", "-shared", "-fPIC", "-pthread",
              *(("-mavx2", "-mfma") if {"avx2", "fma"} <= _cpu_flags() else ()))
#: Path of the loaded shim, or None (no C compiler, another platform, ``MLX_LAZY_NO_GEMV``).
gemv_path: str | None = None


def load_gemv_shim(openblas: str) -> str | None:
    """Build (once, into the user's cache, with the system C compiler) and load the shim for
    products of one row and of a few in front of the OpenBLAS at ``openblas``; return its
    path, None when it cannot be built (one warning line) or loaded (nothing changes then)
    or ``MLX_LAZY_NO_GEMV=1`` is set."""
    global gemv_path
    if gemv_path is not None or os.environ.get("MLX_LAZY_NO_GEMV"):
        return gemv_path
    source = (_GEMV_SHIM.replace("@OPENBLAS@", json.dumps(openblas))
              .replace("@FEW_ROWS@", str(FEW_ROWS)))
    digest = hashlib.sha256((source + " ".join(SHIM_FLAGS)).encode()).hexdigest()[:16]
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
                build = subprocess.run([compiler, *SHIM_FLAGS, str(c_file), "-o",
                                        str(built), "-ldl"], capture_output=True, text=True,
                                       timeout=60)
                if build.returncode != 0:
                    first = next(iter(build.stderr.strip().splitlines()), "no message")
                    _warn(f"the BLAS shim did not build ({first}); products of 1-16 rows "
                          "stay on OpenBLAS's sgemm")
                    return None
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
    more, under 64 rows; measured in the comment above), else ``n``: unpadded up to
    :data:`FEW_ROWS` when the shim's few-row kernel takes them."""
    if (loaded_path is None or not _X86_64 or (gemv_path is not None and n <= FEW_ROWS)
            or n >= 4 * GEMM_ROW_BLOCK or n % GEMM_ROW_BLOCK < 3):
        return n
    return -(-n // GEMM_ROW_BLOCK) * GEMM_ROW_BLOCK


def _warn(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        print(f"mlx_lazy: {message}", file=sys.stderr)


load_openblas()
