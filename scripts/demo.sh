#!/usr/bin/env bash
# Set up (idempotent), obtain the default model if missing, and run the long-prompt demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PYTHON="${PYTHON:-python3}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python
exec "$PYTHON" -m mlx_lazy.demo "$@"
