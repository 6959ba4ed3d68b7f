#!/usr/bin/env bash
# Idempotent set-up: OpenBLAS on Debian/Ubuntu Linux (MLX's CPU build is ~40x slower without
# it), then an editable install of mlx-lazy with its test extra. Safe to run repeatedly.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python

if [ "$(uname -s)" = "Linux" ]; then
    arch="$(uname -m)"
    lib="/usr/lib/${arch}-linux-gnu/openblas-pthread/libopenblas.so.0"
    if [ ! -e "$lib" ]; then
        if ! command -v apt-get >/dev/null 2>&1; then
            echo "setup: not a Debian/Ubuntu system; install OpenBLAS (pthread build) yourself for full CPU speed." >&2
        elif [ "$(id -u)" = "0" ]; then
            echo "setup: installing libopenblas0-pthread"
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q libopenblas0-pthread >/dev/null \
                || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libopenblas0-pthread >/dev/null; } \
                || echo "setup: could not install libopenblas0-pthread; run: sudo apt-get install -y libopenblas0-pthread" >&2
        elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            sudo apt-get install -y -q libopenblas0-pthread >/dev/null \
                || { sudo apt-get update -q >/dev/null && sudo apt-get install -y -q libopenblas0-pthread >/dev/null; } \
                || echo "setup: could not install libopenblas0-pthread; run: sudo apt-get install -y libopenblas0-pthread" >&2
        else
            echo "setup: not root; for ~40x faster CPU matmuls run: sudo apt-get install -y libopenblas0-pthread" >&2
        fi
    fi
fi

# Reinstall only when pyproject.toml changed since the last successful install, when the
# [test] extra (server, plots and test packages) is not importable, or when the installed
# mlx_lazy is another checkout's (a moved or second clone: the console scripts and the
# subprocesses the tests start outside this folder would run that one, or fail).
stamp=".setup-stamp"
installed_here() {
    (cd / && "$PYTHON" -c 'import os, sys, mlx_lazy
sys.exit(os.path.realpath(os.path.dirname(mlx_lazy.__file__)) != os.path.realpath(sys.argv[1]))' \
        "$PWD/mlx_lazy") >/dev/null 2>&1
}
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || ! installed_here \
        || ! "$PYTHON" -c "import mlx_lazy, mlx_lm, fastapi, uvicorn, sse_starlette, matplotlib, pytest, xdist, openai, hypothesis, ruff" >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q -e ".[test]"
    touch "$stamp"
fi
