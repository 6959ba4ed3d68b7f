#!/usr/bin/env bash
# Set up (idempotent), lint with ruff, then run the whole test suite, real-model tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PYTHON="${PYTHON:-python3}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python
"$PYTHON" -m ruff check mlx_lazy tests convert
exec "$PYTHON" -m pytest -q tests "$@"
