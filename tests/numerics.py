"""Numerical comparisons for the tests: errors scaled by the reference's magnitude.

Two float32 paths that add the same terms in another order (another BLAS kernel, query
blocks, a fused exp2, sharded all-sums) differ by a few units in the last place of the
largest values involved, so an absolute bound passes or fails with the CPU's kernels and the
values' scale. Every comparison here is ``max|got - want| / max|want|``: the error in units
of the reference's own scale, which float32 rounding keeps near 1e-7 per operation.
``pytest.approx`` with its default (relative 1e-6) is for values that are exact but for float
rounding (ratios and means of given numbers).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np


def rel_err(got, want) -> float:
    """``max|got - want| / max|want|`` of two arrays (mlx or numpy), computed in float64, over
    the finite values of ``want``; its infinite ones (logits a head masks) ``got`` must equal,
    or the error is infinite."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    finite = np.isfinite(want)
    if not np.array_equal(got[~finite], want[~finite]):
        return float("inf")
    got, want = got[finite], want[finite]
    return float(np.abs(got - want).max() / np.abs(want).max())


def max_rel_err(pairs: Iterable[tuple]) -> float:
    """The largest :func:`rel_err` over ``(want, got)`` pairs, e.g. one pair of logits per step."""
    return max(rel_err(got, want) for want, got in pairs)
