"""Statistics for small evaluations: Wilson intervals and paired comparisons.

With n samples a 0/1 score's 95% interval is about ±1/√n wide, so claims need many samples;
a *paired* comparison of a pruned method against the unpruned path on the same prompts
(answers lost and won) is far more sensitive than two separate scores.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

Z95 = 1.959963984540054


def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion (``successes`` may be a sum of scores in [0, 1])."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    lo = 0.0 if successes <= 0 else max(0.0, centre - half)
    hi = 1.0 if successes >= n else min(1.0, centre + half)
    return (lo, hi)


@dataclass(frozen=True)
class Paired:
    """A method against the unpruned path on the same samples.

    Attributes:
        n: paired samples.
        base: mean score of the unpruned path; ``base_ci`` its Wilson interval.
        score: mean score of the method; ``score_ci`` its Wilson interval.
        lost: samples the unpruned path got right (score ≥ 0.5) and the method wrong.
        won: the reverse.
        lost_ci: Wilson interval of the fraction of the unpruned path's right answers that
            the method lost: with none lost the bootstrap interval of ``rel_loss`` collapses
            to zero, this one still says how large a loss the samples cannot exclude.
        rel_loss: (base − score) / base (negative: the method scored higher).
        rel_loss_ci: 95% paired-bootstrap interval of ``rel_loss``.
    """

    n: int
    base: float
    base_ci: tuple[float, float]
    score: float
    score_ci: tuple[float, float]
    lost: int
    won: int
    lost_ci: tuple[float, float]
    rel_loss: float
    rel_loss_ci: tuple[float, float]

    def as_dict(self) -> dict:
        """JSON-friendly form."""
        return asdict(self)


def paired(base: Sequence[float], method: Sequence[float], resamples: int = 4000,
           seed: int = 0) -> Paired:
    """Compare per-sample scores of a method with the unpruned path's on the same samples."""
    b, m = np.asarray(base, float), np.asarray(method, float)
    if b.shape != m.shape or b.ndim != 1:
        raise ValueError(f"paired scores need equal 1-D shapes, got {b.shape} and {m.shape}")
    n = len(b)
    rel = (b.mean() - m.mean()) / b.mean() if n and b.mean() > 0 else 0.0
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, (resamples, n)) if n else np.zeros((0, 0), int)
    bb, mm = b[idx].mean(axis=1), m[idx].mean(axis=1)
    ok = bb > 0
    boot = (bb[ok] - mm[ok]) / bb[ok]
    ci = ((float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))) if boot.size
          else (0.0, 0.0))
    right_b, right_m = b >= 0.5, m >= 0.5
    return Paired(
        n=n,
        base=float(b.mean()) if n else 0.0,
        base_ci=wilson(float(b.sum()), n),
        score=float(m.mean()) if n else 0.0,
        score_ci=wilson(float(m.sum()), n),
        lost=int(np.sum(right_b & ~right_m)),
        won=int(np.sum(~right_b & right_m)),
        lost_ci=wilson(int(np.sum(right_b & ~right_m)), int(right_b.sum())),
        rel_loss=float(rel),
        rel_loss_ci=ci,
    )
