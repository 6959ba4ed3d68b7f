#!/usr/bin/env bash
# Idempotent set-up: OpenBLAS on Debian/Ubuntu Linux (MLX's CPU build is ~30x slower without
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
            echo "setup: not root; for ~30x faster CPU matmuls run: sudo apt-get install -y libopenblas0-pthread" >&2
        fi
    fi
fi

# Reinstall only when pyproject.toml changed since the last successful install, or when the
# [test] extra (server, plots and test packages) is not importable.
stamp=".setup-stamp"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] \
        || ! "$PYTHON" -c "import mlx_lazy, mlx_lm, fastapi, uvicorn, sse_starlette, matplotlib, pytest, openai, hypothesis" >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q -e ".[test]"
    touch "$stamp"
fi
