"""Which context tokens go on after a pruning layer (LazyLLM's dynamic selection).

At a cut the scorer scores the layer's cached keys from the scoring window's queries, and the
top ``keep`` fraction of the context (never fewer than :data:`MIN_KEEP` tokens) stays, ties
going to the lower position; the anchors, the newest token and the scorer's always-kept
positions stay whatever their score. A :class:`Selector` makes that choice in one of two places:

* :meth:`Selector.on_host` returns sorted positions (one host sync): for prompt chunks and
  for decode steps that may revive tokens from the Aux Cache, since the engine must then
  know which hidden states to move;
* :meth:`Selector.on_device` leaves the choice on the device as a by-position mask: for a
  decode step that computed only its new token and can revive nothing, which therefore
  never waits for its selections.

With a ``revive_margin`` M, a decode step divides the scores of tokens it would have to
revive by 1 + M before choosing: near-ties at the boundary stay with tokens that have KV.
Both count their selections and host syncs for the engine's stats.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Tuple

import mlx.core as mx
import numpy as np

from .errors import UserInputError
from .cache import LayerKV, LazyCache, Rows
from .schedule import Schedule
from .scorers import Mask, ScoreContext, top_k

ReduceHeads = Callable[[mx.array, str], mx.array]

#: The fewest tokens a cut keeps (all of a shorter context; a sequence's cuts start only with
#: a prompt chunk of twice this: :func:`cuts_select`). A keep fraction calibrated on
#: prompts of 700 tokens and more leaves too few in a short chat: SmolLM2's default (20% after
#: its second cut) drifted to mean KLD 3.4 (same-top-1 0.23) along 128 steps from 100-token
#: prompts, 1.7 from 300 and 0.52 from 500, against its 4-bit weights' 0.29-0.31 and 8-bit's
#: 0.001 on the same windows; with this floor 0 (nothing pruned), 0.12 and 0.19
#: (docs/fidelity.md). From 1,280 tokens on (256 / 20%)
#: it changes nothing. The environment variable ``MLX_LAZY_MIN_KEEP`` overrides it (the test
#: suite sets 0, so that its tiny models' few-hundred-token prompts prune).
DEFAULT_MIN_KEEP = 256


def _min_keep(text: Optional[str]) -> Optional[int]:
    if text is None:
        return DEFAULT_MIN_KEEP
    return int(text) if text.isdigit() else None  # refused when used (min_keep)


#: None: ``MLX_LAZY_MIN_KEEP`` is set to something else than a count.
MIN_KEEP: Optional[int] = _min_keep(os.environ.get("MLX_LAZY_MIN_KEEP"))


def min_keep() -> int:
    """:data:`MIN_KEEP`, the fewest tokens a cut keeps.

    Raises:
        UserInputError: ``MLX_LAZY_MIN_KEEP`` is set to something else than a non-negative
            integer (at import it would be a traceback; :func:`mlx_lazy.load` asks first).
    """
    if MIN_KEEP is None:
        raise UserInputError("MLX_LAZY_MIN_KEEP must be a non-negative integer, got "
                             f"{os.environ.get('MLX_LAZY_MIN_KEEP')!r}")
    return MIN_KEEP


@contextmanager
def keep_floor(n: int) -> Iterator[None]:
    """Within the block, a cut keeps at least ``n`` tokens instead of :data:`MIN_KEEP`.

    Calibration and its replays measure with 0: their prompts (700-1,024 tokens) stand for
    long ones, where a schedule keeps its fractions; under the floor a cut keeping 20% or 30%
    of a 700-token window keeps the same 256 tokens, and the evidence could not tell them apart.
    """
    global MIN_KEEP
    before, MIN_KEEP = MIN_KEEP, n
    try:
        yield
    finally:
        MIN_KEEP = before


def cuts_select(n_new: int) -> bool:
    """Whether a prompt chunk of ``n_new`` tokens starts pruning a sequence that has pruned
    nothing yet: not when it is shorter than twice :data:`MIN_KEEP` (the engine then runs it,
    and the decode steps after it, as the unpruned model). Such a cut would drop fewer than
    MIN_KEEP tokens: too little saved to pay for the decode steps' selections and revivals.
    At 320 tokens, keeping 256, the default's answer came up to 1.13x later than unpruned
    (SmolLM2; Gemma 3 1.06x), where from 512 tokens on no token came more than 4% later;
    deciding by the context's length instead moved the loss to where an answer's context
    crossed 512 (1.21x, docs/benchmarks.md). A sequence that has pruned (a long turn before)
    keeps selecting whatever its new chunk's length."""
    return n_new >= 2 * min_keep()


def kept_count(keep: float, n_ctx: int) -> int:
    """How many of a context of ``n_ctx`` tokens a cut keeping the fraction ``keep`` keeps:
    ``round(keep * n_ctx)``, never fewer than :data:`MIN_KEEP` (nor than the context)."""
    return max(round(keep * n_ctx), min(n_ctx, min_keep()))


def forced_mask(positions: np.ndarray, n_ctx: int, anchors: int,
                always_kept: np.ndarray) -> np.ndarray:
    """Of the keys at ``positions`` in a context of ``n_ctx`` tokens, those a cut keeps
    whatever their score: the first ``anchors``, the newest token and the scorer's
    ``always_kept`` positions (:meth:`mlx_lazy.scorers.Scorer.always_kept`)."""
    return (positions < anchors) | (positions == n_ctx - 1) | np.isin(positions, always_kept)


class Selector:
    """The selections of one engine's schedule.

    Args:
        schedule: the resolved plan (its scorer, anchors and ``max_revivals``).
        scale: the model's attention scale.
        reduce_heads: completes a head reduction across tensor-parallel ranks
            (:meth:`mlx_lazy.distributed.TensorParallel.reduce_heads`).
        kv_layer: the layer whose keys a layer attends over
            (:meth:`mlx_lazy.adapter.ModelAdapter.kv_layer`); None: its own.
        softcap: a layer's attention logit soft-cap
            (:meth:`mlx_lazy.adapter.ModelAdapter.softcap`); None: none.
    """

    def __init__(self, schedule: Schedule, scale: float, reduce_heads: ReduceHeads,
                 kv_layer: Optional[Callable[[int], int]] = None,
                 softcap: Optional[Callable[[int], Optional[float]]] = None):
        self.schedule, self.scorer = schedule, schedule.scorer
        self.scale, self.reduce_heads = scale, reduce_heads
        self.kv_layer = kv_layer or (lambda layer: layer)
        self.softcap = softcap or (lambda layer: None)
        self.selections = self.host_syncs = 0

    def window(self, cache: LazyCache, layer: int, queries: mx.array,
               positions: np.ndarray) -> Rows:
        """The scoring queries at ``layer``: the newest tokens' (``queries`` at
        ``positions``) after the latest ones kept from earlier steps, the scorer's last
        ``n_queries`` in all (so a window scorer keeps its window while decoding)."""
        cache.window_put(layer, positions, queries, self.scorer.n_queries)
        return cache.window[layer]

    def may_revive(self, cache: LazyCache, layer: int) -> bool:
        """Whether a decode step's selection after ``layer`` may revive a token: some wait in
        the Aux Cache at depth layer+1 and revivals are allowed."""
        return layer + 1 in cache.aux and self.schedule.max_revivals != 0

    def on_host(
        self,
        cache: LazyCache,
        layer: int,
        window: Rows,
        keep: float,
        n_ctx: int,
        visible: Optional[Mask] = None,
        computed: Optional[np.ndarray] = None,
    ) -> Tuple[np.ndarray, bool]:
        """Sorted positions of the tokens kept after ``layer`` (the top ``keep`` fraction of
        the context by the scorer's scores of the ``window`` queries) and whether any
        candidate was left out: the host's selection (one sync), for steps that revive or
        prune what they computed.

        Of the keys cached at ``layer``, only those marked ``visible`` (all when None) and
        able to reach ``layer + 1`` are candidates. In a decode step (``computed``: the
        tokens it computed at ``layer``), at most ``max_revivals`` of the others may need a
        revival.
        """
        if isinstance(visible, mx.array):  # an earlier cut of this step chose on the device
            visible = np.array(visible)
            self.host_syncs += 1
        kv = cache.layers[self.kv_layer(layer)]
        positions, order = kv.cached_positions(), kv.position_order()
        eligible, forced = self._candidates(cache, layer, positions, n_ctx)
        if visible is not None:
            eligible &= visible
        scores = self._scores(layer, window, kv, eligible, visible,
                              decoding=computed is not None)
        kept_from: Mask = eligible
        budget, margin = self.schedule.max_revivals, self.schedule.revive_margin
        if computed is not None and (budget is not None or margin):
            # Waiting at depth layer+1 and not computed now: selecting it means a revival.
            waiting = (eligible & (cache.depth[positions] == layer + 1)
                       & ~np.isin(positions, computed) & ~forced)
            if margin:  # it displaces a token with KV only when it scores 1 + margin times more
                scores = mx.where(mx.array(waiting), scores / (1 + margin), scores)
            # All but the best ``budget`` of them sit this step out (fewer kept if need be).
            if budget == 0:
                kept_from = eligible & ~waiting
            elif budget is not None and waiting.sum() > budget:
                best = top_k(scores, positions, waiting, np.zeros_like(waiting), budget, order)
                kept_from = mx.array(eligible) & ~(mx.array(waiting) & ~best)
        kept = np.array(top_k(scores, positions, kept_from, forced, kept_count(keep, n_ctx), order))
        self.host_syncs += 1
        selected = np.sort(positions[kept])
        return selected, len(selected) < int(eligible.sum())

    def on_device(self, cache: LazyCache, layer: int, window: Rows, keep: float, n_ctx: int,
                  visible: Optional[Mask]) -> mx.array:
        """A decode step's selection after ``layer`` when it computed only its new token and
        can revive none (:meth:`may_revive` is False): :meth:`on_host`'s choice, as an
        (n_ctx,) mask by position left on the device, so the step never waits for it."""
        kv = cache.layers[self.kv_layer(layer)]
        positions = kv.cached_positions()
        eligible, forced = self._candidates(cache, layer, positions, n_ctx)
        # Tokens waiting at depth layer+1 (max_revivals=0) are scored but never kept.
        has_kv = cache.depth[positions] > layer + 1
        waiting = eligible & ~has_kv & ~forced
        candidates = mx.array(eligible)
        if visible is not None:
            candidates = candidates & visible
        scores = self._scores(layer, window, kv, candidates, visible, decoding=True)
        kept = top_k(scores, positions, candidates & mx.array(~waiting), forced,
                     kept_count(keep, n_ctx), kv.position_order())
        chosen = mx.zeros(n_ctx, mx.bool_)
        chosen[kv.device_positions()] = kept
        return chosen

    def best_waiting(self, cache: LazyCache, layer: int, n: int) -> np.ndarray:
        """Sorted positions of the ``n`` best-scoring tokens waiting at depth ``layer + 1`` (by
        the scorer's scores of the window's queries at ``layer``, ties to the lower position;
        one host sync): those :meth:`~mlx_lazy.engine.LazyEngine.promote` carries on."""
        kv = cache.layers[self.kv_layer(layer)]
        positions = kv.cached_positions()
        waiting = np.isin(positions, cache.aux[layer + 1].positions)
        scores = self._scores(layer, cache.window[layer], kv, waiting, None, decoding=False)
        best = np.array(top_k(scores, positions, waiting, np.zeros_like(waiting), n,
                              kv.position_order()))
        self.host_syncs += 1
        return np.sort(positions[best])

    def _candidates(self, cache: LazyCache, layer: int, positions: np.ndarray,
                    n_ctx: int) -> Tuple[np.ndarray, np.ndarray]:
        """Of the keys at ``positions``: those able to reach ``layer + 1`` (before visibility),
        and those kept whatever their score (the newest token, the anchors and the scorer's
        always-kept positions)."""
        eligible = cache.limit[positions] > layer + 1
        return eligible, forced_mask(positions, n_ctx, self.schedule.anchors,
                                     cache.always_kept)

    def _scores(self, layer: int, window: Rows, kv: LayerKV, candidates: Mask,
                visible: Optional[Mask], decoding: bool) -> mx.array:
        """The scorer's (n,) scores, on the device, of the keys cached in ``kv``; while
        ``decoding``, the scoring carries over from the last step (``kv``'s memo)."""
        # Tensor parallel: the scorer's head reduction is the one point where ranks exchange
        # data to decide; each holds only its own heads, every rank gets the reduction over
        # all of them, so every rank selects (and revives) the same tokens.
        ctx = ScoreContext(layer, window.data, window.positions, kv.fetch()[0],
                           kv.cached_positions(), candidates, visible, self.scale,
                           self.reduce_heads, kv.position_order(),
                           kv.score_memo(layer) if decoding else None, self.softcap(layer))
        self.selections += 1
        return self.scorer.score(ctx)
