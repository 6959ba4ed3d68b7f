"""Scorers: how much each context token matters at a pruning layer.

A scorer is a small class with one ``score(ctx)`` that maps a :class:`ScoreContext` (the
scoring queries, the candidate keys, their positions) to one score per key; the engine then
keeps the top fraction of the candidates (:func:`top_k`), always keeping the anchors, the
newest token and whatever the scorer's :meth:`Scorer.always_kept` names. Adding a scorer is
one class plus one line in :data:`SCORERS`: its dataclass fields are its parameters, and one
spec syntax names them everywhere (:func:`parse_scorer`): ``PruningConfig(scorer=SPEC)``, the
CLI's and server's ``scorer``, schedule files and the benchmarks' ``lazy:scorer=SPEC``, e.g.
``window:size=32:heads=max:pool=8``.

* ``last`` (:class:`LastQuery`, the LazyLLM paper): attention of the query token (the last
  prompt token in prefill, the newest token in decode), reduced over heads.
* ``window`` (:class:`Window`, SnapKV's observation window): in prefill the mean over the last
  ``size`` prompt tokens' attention (each causal); those tokens are always kept, so a
  question at the end of the prompt is never pruned away. Decoding keeps the window: the
  latest ``size`` tokens' queries at each pruning layer, generated tokens included (the cache
  keeps them), so the selection drifts with the answer instead of jumping to one token's.

Both are grouped-query aware and reduce over heads by ``mean`` (the paper) or ``max``.
:class:`Pooled` wraps any scorer: each candidate's score becomes the maximum over itself and
``radius`` neighbouring candidates on each side, so kept tokens come in spans.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, Optional, Tuple, Type, Union

import mlx.core as mx
import numpy as np

from .attention import attention_weights, log2_scores, masked
from .errors import UserInputError, shown
from .inputs import MAX_COUNT, is_int, parse_float, parse_int
from .kernels import exp2

HEAD_REDUCTIONS = ("mean", "max")
#: A per-key boolean mask, on the host or the device.
Mask = Union[np.ndarray, mx.array]


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
        candidates: (n,) bool, the keys that may be kept (numpy or MLX).
        visible: (n,) bool keys the query token attends to (None: all; numpy or MLX).
        scale: the attention scale.
        reduce_heads: completes a reduction over this process's heads, ``(scores, "mean" |
            "max") -> scores``, into one over all heads of the model (tensor parallelism:
            :meth:`mlx_lazy.distributed.TensorParallel.reduce_heads`); identity by default.
        key_order: :func:`position_order` of ``key_positions`` (None: computed when needed).
        memo: the layer's :class:`ScoreMemo` when the keys are its cache in slot order and
            the scoring carries on from earlier steps (decoding); None: computed afresh.
        softcap: the layer's attention logit soft-cap (Gemma 2,
            :meth:`mlx_lazy.adapter.ModelAdapter.softcap`): the scores are the softmax of
            the capped logits, as the model attends; None: none.
    """

    layer: int
    queries: mx.array
    query_positions: np.ndarray
    keys: mx.array
    key_positions: np.ndarray
    candidates: Mask
    visible: Optional[Mask]
    scale: float
    reduce_heads: Callable[[mx.array, str], mx.array] = lambda scores, heads: scores
    key_order: Optional[Tuple[mx.array, mx.array]] = None
    memo: Optional["ScoreMemo"] = None
    softcap: Optional[float] = None


class Scorer:
    """Maps a :class:`ScoreContext` to one score per key (higher: keep).

    A scorer is a frozen dataclass: its fields are its parameters (checked in
    ``__post_init__``, raising :class:`UserInputError`), and a spec string names them
    (:func:`parse_scorer`)."""

    #: trailing prefill tokens whose queries :meth:`score` reads (the query token included)
    n_queries: int = 1

    def score(self, ctx: ScoreContext) -> mx.array:
        """(n,) float scores on the device, one per key of ``ctx``; only candidates' scores
        are used."""
        raise NotImplementedError

    def always_kept(self, prompt_len: int) -> np.ndarray:
        """Positions kept at every cut whatever their score (besides anchors and the newest
        token)."""
        return np.empty(0, np.int64)

    def check_fits(self, context: int) -> None:
        """Refuse token counts longer than any prompt a model of ``context`` tokens takes.

        Raises:
            UserInputError: naming the scorer and the context.
        """
        if self.n_queries > context:
            raise UserInputError(f"scorer {scorer_spec(self)} reads {self.n_queries} query "
                                 f"tokens, more than the model's context of {context} tokens")


@dataclass(frozen=True)
class LastQuery(Scorer):
    """The query token's attention to each key, reduced over heads (LazyLLM)."""

    heads: str = "mean"

    def __post_init__(self) -> None:
        _check_heads(self.heads)

    def score(self, ctx: ScoreContext) -> mx.array:
        return _reduced_probs(ctx.queries[:, :, -1:], ctx, _visible(ctx), self.heads)


@dataclass(frozen=True)
class Window(Scorer):
    """Mean attention of the latest ``size`` tokens (each causal), reduced over heads; the
    prompt's window itself is always kept."""

    size: int = 8
    heads: str = "mean"

    def __post_init__(self) -> None:
        _check_count("size", self.size, 1)
        _check_heads(self.heads)

    @property
    def n_queries(self) -> int:  # type: ignore[override]
        return self.size

    def score(self, ctx: ScoreContext) -> mx.array:
        if len(ctx.query_positions) == 1:  # decode: the newest token sees every key
            return _reduced_probs(ctx.queries, ctx, _visible(ctx), self.heads)
        if ctx.memo is not None:  # decoding: the rows and keys of earlier steps carry over
            weights = ctx.memo.weights(ctx.queries, ctx.query_positions, ctx.keys,
                                       ctx.key_positions, ctx.scale, ctx.softcap)
            return _reduced_weights(weights, ctx, _visible(ctx), self.heads)
        mask = mx.array(ctx.key_positions[None, :] <= ctx.query_positions[:, None])
        if ctx.visible is not None:
            mask = mask & mx.array(ctx.visible)[None, :]
        return _reduced_probs(ctx.queries, ctx, mask, self.heads)

    def always_kept(self, prompt_len: int) -> np.ndarray:
        return np.arange(max(0, prompt_len - self.size), prompt_len)


@dataclass(frozen=True)
class Pooled(Scorer):
    """``inner``'s scores (a registered scorer's) max-pooled over ``radius`` >= 1
    neighbouring candidates (in position order) on each side."""

    inner: Scorer
    radius: int

    def __post_init__(self) -> None:
        if not _registered(self.inner):
            raise UserInputError(f"Pooled wraps one of the scorers {', '.join(SCORERS)}, got "
                                 f"{_cut(self.inner)}")
        _check_count("pool", self.radius, 1)

    @property
    def n_queries(self) -> int:  # type: ignore[override]
        return self.inner.n_queries

    def score(self, ctx: ScoreContext) -> mx.array:
        return pool_by_position(ctx.key_positions, self.inner.score(ctx), self.radius,
                                ctx.candidates, ctx.key_order)

    def always_kept(self, prompt_len: int) -> np.ndarray:
        return self.inner.always_kept(prompt_len)

    def check_fits(self, context: int) -> None:
        self.inner.check_fits(context)
        if self.radius > context:
            raise UserInputError(f"pool={self.radius} is more than the model's context of "
                                 f"{context} tokens (lower pool)")


#: scorer name -> class. A scorer is a frozen dataclass whose fields are its parameters; its
#: spec (:func:`parse_scorer`, :func:`scorer_spec`) names them, so registering a class here is
#: all the API, CLI, server, schedule files and benchmarks need.
SCORERS: Dict[str, Type[Scorer]] = {
    "last": LastQuery,
    "window": Window,
}

#: The spec key that wraps any scorer in :class:`Pooled` (its ``radius``).
POOL_KEY = "pool"
_PARSERS: Dict[str, Callable[[str], Any]] = {"int": parse_int, "float": parse_float, "str": str}


def spec_keys(name: str) -> Tuple[str, ...]:
    """The keys a spec of the registered scorer ``name`` takes: its own fields, then
    :data:`POOL_KEY` (empty for an unknown name)."""
    cls = SCORERS.get(name)
    return () if cls is None else (*(f.name for f in fields(cls)), POOL_KEY)


def parse_scorer(spec: Union[str, Scorer]) -> Scorer:
    """The scorer a spec names: ``NAME[:field=value...]`` with the registered class's own
    dataclass fields, plus ``pool=R`` to wrap it in :class:`Pooled`:
    ``"window:size=32:heads=max:pool=8"`` (``pool=0``: not pooled). A registered
    :class:`Scorer` (or one :class:`Pooled`) passes through.

    Raises:
        UserInputError: an unknown scorer or field, or a value the scorer refuses; a scorer
            object of a class not in :data:`SCORERS` (schedules, caches and reports name
            scorers by their spec).
    """
    if isinstance(spec, Scorer):
        if not isinstance(spec, Pooled) and not _registered(spec):
            raise UserInputError(f"scorer {type(spec).__name__} is not registered: add it to "
                                 "mlx_lazy.scorers.SCORERS")
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise UserInputError(f"scorer must be a non-empty spec such as 'window:size=32', "
                             f"got {_cut(spec)}")
    name, *pieces = spec.strip().split(":")
    if name not in SCORERS:
        raise UserInputError(f"unknown scorer {_cut(name)}; choose one of "
                             f"{', '.join(SCORERS)}")
    cls = SCORERS[name]
    params = {f.name: f for f in fields(cls)}
    values: Dict[str, Any] = {}
    radius = None
    for piece in pieces:
        key, sep, text = piece.partition("=")
        if not sep or key in values or (key == POOL_KEY and radius is not None):
            raise UserInputError(f"scorer {_cut(spec)}: each part after the name is "
                                 f"field=value, each field once, got {_cut(piece)}")
        if key == POOL_KEY:
            radius = _parse_field(spec, key, "int", text)
            _check_count(POOL_KEY, radius, 0)
        elif key in params:
            kind = params[key].type  # a string under ``from __future__ import annotations``
            values[key] = _parse_field(spec, key, getattr(kind, "__name__", str(kind)), text)
        else:
            raise UserInputError(f"scorer {name!r} has no field {_cut(key)}; its fields: "
                                 f"{', '.join(spec_keys(name))}")
    scorer = cls(**values)
    return Pooled(scorer, radius) if radius else scorer


def scorer_spec(scorer: Scorer) -> str:
    """The spec of ``scorer`` (its name and the fields that differ from their defaults):
    ``parse_scorer(scorer_spec(s)) == s``."""
    if isinstance(scorer, Pooled):
        return f"{scorer_spec(scorer.inner)}:{POOL_KEY}={scorer.radius}"
    name = next(n for n, cls in SCORERS.items() if type(scorer) is cls)
    changed = [f"{f.name}={getattr(scorer, f.name)}" for f in fields(scorer)
               if getattr(scorer, f.name) != f.default]
    return ":".join([name, *changed])


def _parse_field(spec: str, key: str, kind: str, text: str) -> Any:
    """A spec value as its field's type (``int``, ``float`` or ``str``)."""
    try:
        return _PARSERS[kind](text)
    except (KeyError, ValueError):
        raise UserInputError(f"scorer {_cut(spec)}: {key} must be {kind}, got "
                             f"{_cut(text)}") from None


def top_k(scores: mx.array, positions: np.ndarray, candidates: Mask, forced: Mask,
          k: int, order: Optional[Tuple[mx.array, mx.array]] = None) -> mx.array:
    """(n,) bool mask, on the device, of the ``k`` best-scoring ``candidates`` among entries
    at ``positions`` (never fewer than the ``forced`` ones, which are always kept); ties go to
    the lower position. ``scores``, ``candidates`` and ``forced`` are (n,); the masks may be
    numpy or MLX, so a selection needs no host round-trip. ``order`` is
    :func:`position_order` of ``positions`` when the caller has it."""
    n = len(positions)
    if n == 0:
        return mx.zeros(0, mx.bool_)
    cand = mx.array(candidates)
    forced = mx.array(forced) & cand
    s = mx.where(forced, mx.inf, mx.where(cand, scores, -mx.inf))
    k = mx.minimum(cand.sum(), mx.maximum(forced.sum(), max(int(k), 1)))
    # The k-th best value: entries above it are kept, then the tied ones lowest position first.
    kth = mx.sort(s)[mx.clip(n - k, 0, n - 1)]
    above = (s > kth) & cand
    tied = (s == kth) & cand
    order, inverse = order or position_order(positions)
    first_ties = mx.cumsum(tied[order].astype(mx.int32)) <= k - above.sum()
    return above | (tied & first_ties[inverse])


def pool_by_position(positions: np.ndarray, scores: Union[mx.array, np.ndarray], radius: int,
                     candidates: Optional[Mask] = None,
                     order: Optional[Tuple[mx.array, mx.array]] = None) -> mx.array:
    """Each candidate's score replaced by the maximum over ``radius`` neighbouring candidates
    (in position order) on each side; other entries unchanged. All candidates when None.
    ``order`` is :func:`position_order` of ``positions`` when the caller has it."""
    scores = mx.array(scores)
    n = len(positions)
    if n == 0 or radius == 0:
        return scores
    order, inverse = order or position_order(positions)
    cand = mx.ones(n, mx.bool_) if candidates is None else mx.array(candidates)[order]
    ranked = scores[order]
    # Pack the candidates, in position order, into the front of a row padded with -inf on
    # each side (the non-candidates all go to one spare slot past the end).
    rank = mx.cumsum(cand.astype(mx.int32)) - 1
    # A radius reaching past every entry pools over all of them: clamp it, so that the
    # padding is O(n) whatever the radius.
    radius = min(radius, n)
    packed = mx.full((n + 2 * radius + 1,), -mx.inf, scores.dtype)
    packed[mx.where(cand, rank + radius, n + 2 * radius)] = ranked
    packed = packed[: n + 2 * radius]
    # Window maxima of width 2r+1 from maxima over doubling widths (O(n log r) work).
    width, span = 2 * radius + 1, 1
    while 2 * span <= width:
        packed = mx.maximum(packed[:-span], packed[span:])
        span *= 2
    pooled = mx.maximum(packed[:n], packed[width - span: width - span + n])
    return mx.where(cand, pooled[mx.maximum(rank, 0)], ranked)[inverse]


def position_order(positions: np.ndarray) -> Tuple[mx.array, mx.array]:
    """Indices that sort ``positions`` (stable), and those that undo it, as MLX arrays."""
    order = np.argsort(positions, kind="stable")
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return mx.array(order.astype(np.int32)), mx.array(inverse.astype(np.int32))


def _cut(x: Any) -> str:
    """A user's spec or value, shown in one short line."""
    return shown(x, 60)


def _check_heads(heads: Any) -> None:
    if heads not in HEAD_REDUCTIONS:
        raise UserInputError(f"heads must be one of {', '.join(HEAD_REDUCTIONS)}, "
                             f"got {_cut(heads)}")


def _registered(scorer: Any) -> bool:
    """Whether ``scorer`` is of a class of :data:`SCORERS` (a spec can name it)."""
    return type(scorer) in SCORERS.values()


def _check_count(name: str, value: Any, low: int) -> None:
    if not is_int(value) or not low <= value <= MAX_COUNT:
        raise UserInputError(f"{name} must be an integer in [{low}, {MAX_COUNT}], "
                             f"got {_cut(value)}")


def _visible(ctx: ScoreContext) -> Optional[mx.array]:
    return None if ctx.visible is None else mx.array(ctx.visible)


def _reduced_probs(q: mx.array, ctx: ScoreContext, mask: Optional[mx.array],
                   heads: str) -> mx.array:
    """Attention probabilities of queries ``q`` over the context's keys, reduced over heads
    (mean or max, across every process's heads) and averaged over the queries: (n,)."""
    weights, total = attention_weights(q, ctx.keys, ctx.scale, mask, softcap=ctx.softcap)
    return _normalised(weights.swapaxes(-1, -2), total.swapaxes(-1, -2), ctx, heads)


def _reduced_weights(weights: mx.array, ctx: ScoreContext, visible: Optional[mx.array],
                     heads: str) -> mx.array:
    """:func:`_reduced_probs` from a :class:`ScoreMemo`'s unnormalised ``weights``
    (1, kv_heads, rep, n, m), keys by queries, each query's softmax taken over the
    ``visible`` keys."""
    if visible is None:
        total = weights.sum(axis=-2, keepdims=True)
    else:
        total = visible.astype(weights.dtype)[None, :] @ weights
    # A query that sees no visible key adds nothing (instead of 0/0).
    scores = _normalised(weights, mx.maximum(total, 1e-30), ctx, heads)
    return scores if visible is None else scores * visible  # 0 for invisible keys, as masked


def _normalised(weights: mx.array, total: mx.array, ctx: ScoreContext,
                heads: str) -> mx.array:
    """``weights`` (1, kv_heads, rep, n, m), keys by queries, normalised by each query's
    ``total`` (1, kv_heads, rep, 1, m), reduced over heads and averaged over the m queries:
    (n,)."""
    b, g, r, n, m = weights.shape
    if heads == "mean":
        # Linear in the probabilities: each key's sum over queries of weight / total is one
        # matrix-vector product per head, with no normalised (n, m) copy (a transposed
        # operand is a BLAS flag, not a copy).
        summed = weights @ (1 / total).swapaxes(-1, -2)
        return ctx.reduce_heads(summed.sum(axis=(0, 1, 2, 4)) * (1 / (g * r * m)), heads)
    per_head = (weights / total).reshape(g * r, n, m)
    return ctx.reduce_heads(per_head.max(axis=0), heads).mean(axis=-1)


class ScoreMemo:
    """Unnormalised causal attention weights of a window of scoring queries over one layer's
    cached keys, kept from one decode step to the next.

    A query's weight on a key never changes (neither does, once computed), so a step computes
    only its new queries' weights and those of keys cached since the last step (a new
    token's, which the older queries do not see, and revived ones'); the visibility of the
    step is applied when they are normalised (:func:`_reduced_weights`), so the scores are
    those of a fresh computation up to rounding. Query i's weights are ``2**(s_ij - c_i)`` in
    log2 units, with ``c_i`` their maximum when they were made; a later key may exceed it, so
    weights are capped at ``2**64`` (a key that far above every other has probability 1 either
    way).

    The weights live in a buffer written in place, keys by queries, like a KV cache's: a new
    query takes the slot of the one that left the window, new keys fill the next key slots,
    and the scores read the filled part with no copy (rebuilding the whole window each step
    moved ~5 MB per cut on SmolLM2 at 4K). Query slots are in no particular order; the scores
    reduce over them. Made by :class:`~mlx_lazy.cache.LayerKV`, which drops it when its slots
    are rewritten.
    """

    #: largest log2 weight of a key above its query's shift
    cap = 64.0
    #: key slots the buffer grows by
    step = 256

    def __init__(self) -> None:
        self.positions = np.zeros(0, np.int64)  # each query slot's position
        self.table: Optional[mx.array] = None  # (1, kv_heads, rep, key slots, query slots)
        self.shift: Optional[mx.array] = None  # (1, kv_heads, rep, 1, query slots)
        self.keys = 0  # the layer's first key slots that the table covers

    def weights(self, q: mx.array, qpos: np.ndarray, keys: mx.array, kpos: np.ndarray,
                scale: float, softcap: Optional[float] = None) -> mx.array:
        """The (1, kv_heads, rep, n, m) weights over ``keys`` (1, kv_heads, n, d) at ``kpos``
        (the layer's slots, whose first ones the memo already covers) of queries ``q``
        (1, H, m, d) at ascending positions ``qpos``, zero where a key comes after its query
        (logits soft-capped by ``softcap`` when given); the queries in slot order
        (:attr:`positions`)."""
        n = keys.shape[2]
        held = np.isin(self.positions, qpos)
        fresh = np.flatnonzero(~np.isin(qpos, self.positions))  # indices into qpos
        free = np.flatnonzero(~held)
        if self.keys > n or len(fresh) < len(free):  # fewer keys or queries: start over
            self.positions, self.keys = np.zeros(0, np.int64), 0
            held, free, fresh = np.zeros(0, bool), np.zeros(0, np.int64), np.arange(len(qpos))
        # New queries take the slots of those gone from the window, then new slots.
        added = len(fresh) - len(free)
        slots = np.concatenate([free, len(self.positions) + np.arange(added)])
        self._reserve(len(self.positions) + added, n, keys.shape[1],
                      q.shape[1] // keys.shape[1], q.dtype)
        self.positions = np.concatenate([self.positions, np.zeros(added, np.int64)])
        self.positions[slots] = qpos[fresh]
        used, have = len(self.positions), self.keys
        if n > have and held.any():  # the queries kept: their weights on the keys new since
            index = mx.array(np.searchsorted(qpos, self.positions).astype(np.int32))
            shift = self.shift[..., :used]
            new = _causal_log2(q[:, :, index], keys[:, :, have:], self.positions, kpos[have:],
                               scale, softcap).swapaxes(-1, -2)
            self.table[..., have:n, :used] = exp2(mx.minimum(new, shift + self.cap), shift)
        if len(fresh):
            s = _causal_log2(q[:, :, mx.array(fresh.astype(np.int32))], keys, qpos[fresh],
                             kpos, scale, softcap).swapaxes(-1, -2)
            shift = s.max(axis=-2, keepdims=True)
            made = exp2(s, shift)
            for j0, j1 in _runs(slots):  # contiguous slots: one slice each
                a, b = int(slots[j0]), int(slots[j0]) + j1 - j0
                self.table[..., :n, a:b] = made[..., j0:j1]
                self.shift[..., a:b] = shift[..., j0:j1]
        self.keys = n
        return self.table[..., :n, :used]

    def _reserve(self, queries: int, keys: int, kv_heads: int, rep: int,
                 dtype: mx.Dtype) -> None:
        """A table with room for ``queries`` query slots and ``keys`` key slots, keeping what
        the slots in use hold."""
        if self.table is not None:
            if queries <= self.table.shape[4] and keys <= self.table.shape[3]:
                return
            queries, keys = max(queries, self.table.shape[4]), max(keys, self.table.shape[3])
        table = mx.zeros((1, kv_heads, rep, -(-keys // self.step) * self.step, queries), dtype)
        shift = mx.zeros((1, kv_heads, rep, 1, queries), dtype)
        used = len(self.positions)
        if self.table is not None and used and self.keys:
            table[..., :self.keys, :used] = self.table[..., :self.keys, :used]
            shift[..., :used] = self.shift[..., :used]
        self.table, self.shift = table, shift


def _runs(index: np.ndarray) -> list[Tuple[int, int]]:
    """(start, end) of each stretch of ``index`` whose values rise by one."""
    bounds = [0, *(np.flatnonzero(np.diff(index) != 1) + 1).tolist(), len(index)]
    return list(zip(bounds[:-1], bounds[1:]))


def _causal_log2(q: mx.array, keys: mx.array, qpos: np.ndarray, kpos: np.ndarray,
                 scale: float, softcap: Optional[float]) -> mx.array:
    """:func:`~mlx_lazy.attention.log2_scores`, -inf where a key comes after its query."""
    return masked(log2_scores(q, keys, scale, softcap),
                  mx.array(kpos[None, :] <= qpos[:, None]))
