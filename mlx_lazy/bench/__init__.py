"""Benchmarks for mlx-lazy.

- ``python -m mlx_lazy.bench``: accuracy vs time to first token on offline long-context
  tasks (:mod:`.tasks`, :mod:`.metrics`, :mod:`.harness`, :mod:`.plots`; see README.md).
- ``python -m mlx_lazy.bench.speed``: prefill/decode speed and the cost model
  (:mod:`.speed`, :mod:`.costmodel`).

Both record a run as one :class:`.common.RunRecord` and write their tables with
:func:`.common.markdown_table`.

Submodules are imported on demand so ``import mlx_lazy.bench`` stays cheap.
"""
