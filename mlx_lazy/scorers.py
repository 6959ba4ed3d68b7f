"""Scorers: how much each context token matters at a pruning layer.

A scorer is a small class with one ``score(ctx)`` that maps a :class:`ScoreContext` (the
scoring queries, the candidate keys, their positions) to one score per key; the engine then
keeps the top fraction of the candidates (:func:`top_k`), always keeping the anchors, the
newest token and whatever the scorer's :meth:`Scorer.always_kept` names. Adding a scorer is
one class plus one line in :data:`SCORERS`; ``PruningConfig(scorer=NAME)``, the CLI's
``--scorer`` and the benchmarks' ``lazy:scorer=NAME`` all read that registry.

* ``last`` (:class:`LastQuery`, the LazyLLM paper): attention of the query token (the last
  prompt token in prefill, the newest token in decode), reduced over heads.
* ``window`` (:class:`Window`, SnapKV's observation window): in prefill the mean over the last
  ``window`` prompt tokens' attention (each causal); those tokens are always kept, so a
  question at the end of the prompt is never pruned away. Decode scores with the newest token.

Both are grouped-query aware and reduce over heads by ``mean`` (the paper) or ``max``.
:class:`Pooled` wraps any scorer: each candidate's score becomes the maximum over itself and
``radius`` neighbouring candidates on each side, so kept tokens come in spans.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Dict, Optional, Type

import mlx.core as mx
import numpy as np

from .attention import attention_probs
from .errors import UserInputError

HEAD_REDUCTIONS = ("mean", "max")


@dataclass(frozen=True)
class ScoreContext:
    """What a scorer sees at one pruning layer.

    Attributes:
        layer: the pruning layer.
        queries: (1, H, m, d) queries of the scoring tokens (RoPE applied), in position
            order; the last row is the query token.
        query_positions: (m,) their positions.
        keys: (1, kv_heads, n, d) keys of the context at this layer.
        key_positions: (n,) their positions (cache order, not necessarily sorted).
        candidates: (n,) bool, the keys that may be kept.
        visible: (n,) bool keys the query token attends to (None: all).
        scale: the attention scale.
        reduce_heads: completes a reduction over this process's heads, ``(scores, "mean" |
            "max") -> scores``, into one over all heads of the model (tensor parallelism:
            :meth:`mlx_lazy.distributed.TensorParallel.reduce_heads`); identity by default.
    """

    layer: int
    queries: mx.array
    query_positions: np.ndarray
    keys: mx.array
    key_positions: np.ndarray
    candidates: np.ndarray
    visible: Optional[np.ndarray]
    scale: float
    reduce_heads: Callable[[mx.array, str], mx.array] = lambda scores, heads: scores


class Scorer:
    """Maps a :class:`ScoreContext` to one score per key (higher: keep)."""

    #: trailing prefill tokens whose queries :meth:`score` reads (the query token included)
    n_queries: int = 1

    def score(self, ctx: ScoreContext) -> np.ndarray:
        """(n,) float scores, one per key of ``ctx``; only candidates' scores are used."""
        raise NotImplementedError

    def always_kept(self, prompt_len: int) -> np.ndarray:
        """Positions kept at every cut whatever their score (besides anchors and the newest
        token)."""
        return np.empty(0, np.int64)


@dataclass(frozen=True)
class LastQuery(Scorer):
    """The query token's attention to each key, reduced over heads (LazyLLM)."""

    heads: str = "mean"

    def score(self, ctx: ScoreContext) -> np.ndarray:
        return _reduced_probs(ctx.queries[:, :, -1:], ctx, _visible(ctx), self.heads)


@dataclass(frozen=True)
class Window(Scorer):
    """Mean attention of the last ``size`` prompt tokens (each causal), reduced over heads;
    the window itself is always kept."""

    size: int = 8
    heads: str = "mean"

    @property
    def n_queries(self) -> int:  # type: ignore[override]
        return self.size

    def score(self, ctx: ScoreContext) -> np.ndarray:
        if len(ctx.query_positions) == 1:  # decode: the newest token sees every key
            return _reduced_probs(ctx.queries, ctx, _visible(ctx), self.heads)
        mask = ctx.key_positions[None, :] <= ctx.query_positions[:, None]
        if ctx.visible is not None:
            mask &= ctx.visible[None, :]
        return _reduced_probs(ctx.queries, ctx, mx.array(mask), self.heads)

    def always_kept(self, prompt_len: int) -> np.ndarray:
        return np.arange(max(0, prompt_len - self.size), prompt_len)


@dataclass(frozen=True)
class Pooled(Scorer):
    """``inner``'s scores max-pooled over ``radius`` neighbouring candidates (in position
    order) on each side."""

    inner: Scorer
    radius: int

    @property
    def n_queries(self) -> int:  # type: ignore[override]
        return self.inner.n_queries

    def score(self, ctx: ScoreContext) -> np.ndarray:
        scores = self.inner.score(ctx)
        c = ctx.candidates
        scores[c] = pool_by_position(ctx.key_positions[c], scores[c], self.radius)
        return scores

    def always_kept(self, prompt_len: int) -> np.ndarray:
        return self.inner.always_kept(prompt_len)


#: scorer name -> class (a dataclass with ``heads`` and, for windowed ones, ``size``)
SCORERS: Dict[str, Type[Scorer]] = {
    "last": LastQuery,
    "window": Window,
}


def make_scorer(name: str, heads: str = "mean", window: Optional[int] = None,
                pool: int = 0) -> Scorer:
    """Build the registered scorer ``name`` (``window`` sets its ``size`` when it has one),
    wrapped in :class:`Pooled` when ``pool``.

    Raises:
        UserInputError: unknown scorer or head reduction, or a window for a scorer without.
    """
    if name not in SCORERS:
        raise UserInputError(f"unknown scorer {name!r}; choose one of {', '.join(SCORERS)}")
    if heads not in HEAD_REDUCTIONS:
        raise UserInputError(f"heads must be one of {', '.join(HEAD_REDUCTIONS)}, got {heads!r}")
    kwargs: Dict[str, object] = {"heads": heads}
    if window is not None:
        if default_window(name) is None:
            windowed = ", ".join(n for n in SCORERS if default_window(n) is not None)
            raise UserInputError(f"window applies to scorers with a window ({windowed}), "
                                 f"not {name!r}")
        kwargs["size"] = window
    scorer = SCORERS[name](**kwargs)
    return Pooled(scorer, pool) if pool else scorer


def default_window(name: str) -> Optional[int]:
    """The registered scorer's default window ``size``; None when it has no window."""
    return next((f.default for f in fields(SCORERS[name]) if f.name == "size"), None)


def top_k(candidates: np.ndarray, scores: np.ndarray, forced: np.ndarray, k: int) -> np.ndarray:
    """Sorted positions of the ``k`` best-scoring ``candidates`` (never fewer than the
    ``forced`` ones, which are always kept); ties go to the lower position."""
    n = len(candidates)
    scores = np.where(forced, np.inf, scores)
    k = min(n, max(int(forced.sum()), k, 1))
    if k >= n:
        return np.sort(candidates)
    # argpartition is not stable: keep every score above the k-th best, then fill up with the
    # lowest positions among those equal to it (O(n), plus a sort of the ties only).
    kth = np.partition(scores, n - k)[n - k]
    above = np.flatnonzero(scores > kth)
    tied = np.flatnonzero(scores == kth)
    tied = tied[np.argsort(candidates[tied])[: k - len(above)]]
    return np.sort(candidates[np.concatenate([above, tied])])


def pool_by_position(positions: np.ndarray, scores: np.ndarray, radius: int) -> np.ndarray:
    """Each score replaced by the maximum over ``radius`` neighbouring entries (in position
    order) on each side."""
    # A radius reaching past every entry pools over all of them: clamp it, so that the
    # padding is O(len(scores)) whatever the radius.
    radius = min(radius, len(scores))
    order = np.argsort(positions)
    padded = np.pad(scores[order], radius, constant_values=-np.inf)
    pooled = np.lib.stride_tricks.sliding_window_view(padded, 2 * radius + 1).max(axis=1)
    out = np.empty_like(scores)
    out[order] = pooled
    return out


def _visible(ctx: ScoreContext) -> Optional[mx.array]:
    return None if ctx.visible is None else mx.array(ctx.visible)


def _reduced_probs(q: mx.array, ctx: ScoreContext, mask: Optional[mx.array],
                   heads: str) -> np.ndarray:
    """Attention probabilities of queries ``q`` over the context's keys, reduced over heads
    (mean or max, across every process's heads) and averaged over the queries: (n,) numpy."""
    probs = attention_probs(q, ctx.keys, ctx.scale, mask)  # (1, kv_heads, rep, m, n)
    b, g, r, m, n = probs.shape
    per_head = probs.transpose(0, 3, 1, 2, 4).reshape(m, g * r, n)
    if heads == "mean":  # linear: average the queries first, reduce (m times) fewer scores
        return np.array(ctx.reduce_heads(per_head.mean(axis=(0, 1)), heads))
    return np.array(ctx.reduce_heads(per_head.max(axis=1), heads).mean(axis=0))
