"""``python -m mlx_lazy.calibrate``: calibrate a LazyLLM schedule for one model.

The work is done in :mod:`mlx_lazy.bench.calibrate` (it runs the offline benchmark tasks).
"""

from .bench.calibrate import main

if __name__ == "__main__":
    raise SystemExit(main())
