"""LazyLLM / SPEED forward passes over an mlx-lm model, on a state that lives across calls.

``extend`` runs prompt tokens on top of the state: the first chunk (``_prefill``) layer by
layer over its active set, in query blocks so memory never holds N x N scores; a later chunk
(a follow-up turn) and ``decode`` (one generated token) through ``_step``, which re-selects
the context at every pruning layer among all tokens, old and new, reviving tokens from the
Aux Cache when they come back. ``complete`` carries waiting tokens through their remaining
layers (with ``complete="exact"``, it recomputes the chunk's layers above its first cut that
prunes from the hidden states stashed there, so the state becomes the full model's). Every
token keeps its original position for RoPE and for the causal mask. At the last layer only
the newest token's output is ever used, so the other tokens computed there get their keys
and values and nothing more.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .adapter import ModelAdapter
from .attention import attention, prepare
from .cache import LayerKV, LazyCache, Rows
from .distributed import TensorParallel, model_group
from .config import PruningConfig
from .schedule import Schedule
from .scorers import ScoreContext, top_k

ProgressFn = Callable[[int, int], None]


@dataclass
class GenerationStats:
    """Counts and timings of one generation (docs/api.md describes each field)."""

    method: str = "full"
    schedule: dict = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    answer_s: float = 0.0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    peak_memory_bytes: int = 0
    kv_bytes: int = 0
    aux_bytes: int = 0
    kv_bytes_per_layer: List[int] = field(default_factory=list)
    prompt_tokens_computed_pct: float = 0.0
    prompt_token_layers_computed_pct: float = 0.0
    tokens_computed_per_layer: List[int] = field(default_factory=list)
    prefill_tokens_per_layer: List[int] = field(default_factory=list)
    prefill_attention_pairs: int = 0
    decode_attention_pairs: int = 0
    revivals: int = 0
    host_syncs: int = 0
    max_computations_per_token_layer: int = 0
    completed_token_layers: int = 0
    ranks: int = 1
    allsum_bytes: int = 0
    score_allsum_bytes: int = 0
    text: str = ""

    def as_dict(self) -> dict:
        """JSON-friendly form with the keys scripts rely on."""
        return asdict(self)


class LazyEngine:
    """Run one growing sequence with a pruning schedule: prompt chunks and decoded tokens.

    The engine's state (:attr:`cache`) lives across calls: :meth:`extend` processes more
    prompt on top of it (the first chunk is a prefill, a later one a follow-up turn or a tool
    result), :meth:`decode` one generated token; :meth:`complete` finishes pruned tokens'
    remaining layers from the Aux Cache. Over the whole life of the state every (token,
    layer) is computed at most once, except with ``complete="exact"``, which recomputes the
    kept tokens' layers above the first cut once.

    Args:
        model: a model from ``mlx_lm.load`` (llama, mistral, qwen2 or qwen3).
        schedule: the resolved plan (:func:`mlx_lazy.prompt_cache.resolve_config`); None runs
            everything (``"full"``).
        block_size: query block length of the prefill attention.

    Raises:
        ValueError: unsupported model.
    """

    #: query rows per attention block of chunks and revived tokens after the first prefill
    revival_block = 64

    def __init__(self, model: nn.Module, schedule: Optional[Schedule] = None,
                 block_size: int = 256):
        self.adapter = ModelAdapter(model)
        if schedule is not None and not isinstance(schedule, Schedule):
            raise TypeError("LazyEngine takes a resolved Schedule; resolve a PruningConfig "
                            "with mlx_lazy.resolve_config(model, config)")
        # Sharded by mlx_lazy.distributed.shard: the group its ranks reduce scores over.
        self.tp = TensorParallel(model, model_group(model))
        self.schedule = schedule or PruningConfig().resolve(self.adapter.num_layers)
        if self.schedule.num_layers != self.adapter.num_layers:
            raise ValueError(f"the schedule is for {self.schedule.num_layers} layers, the "
                             f"model has {self.adapter.num_layers}")
        self.block_size = block_size
        self.scorer = self.schedule.scorer
        prepare()  # outside any timed region: the CPU kernels' one-time build
        self.cache = LazyCache(self.adapter.num_layers)
        self.start_request()

    def start_request(self) -> None:
        """Zero the per-request counters of :attr:`stats` (the cache and its
        once-per-layer counter live on)."""
        self.prefill_attention_pairs = self.decode_attention_pairs = 0
        self.prefill_tokens_per_layer = [0] * self.adapter.num_layers
        self.host_syncs = 0
        self.completed_token_layers = 0
        self._revivals_before = self.cache.revivals
        self.tp.restart()

    def reset(self) -> None:
        """Forget the sequence: an empty state, counters zeroed."""
        self.cache = LazyCache(self.adapter.num_layers)
        self.start_request()

    # ------------------------------------------------------------------ prompt
    def prefill(self, tokens: Union[mx.array, List[int]],
                progress: Optional[ProgressFn] = None) -> mx.array:
        """Start a new sequence with ``tokens``; return the (vocab,) logits of the next token."""
        self.reset()
        return self.extend(tokens, progress)

    def extend(self, tokens: Union[mx.array, List[int]],
               progress: Optional[ProgressFn] = None) -> mx.array:
        """Process prompt ``tokens`` on top of the current state (the whole prompt on an
        empty one); return the (vocab,) logits of the token after them.

        The chunk runs through every layer over the whole context. At each pruning layer
        its scoring queries (the scorer's window within the chunk) select among all context
        tokens, old and new: old ones selected but not computed at that layer are revived
        from the Aux Cache, new ones not selected stop there and wait in it.
        """
        tokens = mx.array(tokens) if not isinstance(tokens, mx.array) else tokens.reshape(-1)
        n = tokens.size
        if n == 0:
            raise ValueError("the prompt is empty")
        if self.cache.stash:  # new tokens must see the recomputed states
            self.complete()
        start = self.cache.length
        positions = self.cache.add_tokens(n)
        self._set_prompt_limits(start, n)
        self.cache.always_kept = start + self.scorer.always_kept(n)
        self.cache.prompt_len = self.cache.length
        before = self.cache.computed.sum(axis=1)
        if start == 0:
            logits = self._prefill(tokens, positions, progress)
        else:
            logits = self._step(tokens, positions, prompt=True, progress=progress)
        done = self.cache.computed.sum(axis=1) - before
        self.prefill_tokens_per_layer = [a + int(b) for a, b in
                                         zip(self.prefill_tokens_per_layer, done)]
        return logits

    def _prefill(self, tokens: mx.array, active: np.ndarray,
                 progress: Optional[ProgressFn]) -> mx.array:
        """The first chunk: causal attention of the active tokens over themselves, in query
        blocks, with no gathers (the layer cache holds exactly the active tokens)."""
        sched, a, cache, n = self.schedule, self.adapter, self.cache, len(active)
        h = a.embed(tokens)
        kept = active[cache.limit[active] > 0]
        if len(kept) < n:  # random drop before layer 0
            h, active = h[:, mx.array(kept.astype(np.int32))], kept

        for layer in range(a.num_layers):
            h, active = self._restrict(layer, h, active)
            q, k, v = a.qkv(layer, h, active)
            cache.layers[layer].append(k, v, active)
            if layer == a.num_layers - 1:  # other tokens' outputs here are never used: KV only
                q, h = q[:, :, -1:], h[:, -1:]
            h = a.finish(layer, h, self._blocked_attention(q, k, v))
            cache.mark_computed(layer, active)
            keep = sched.keep_after(layer)
            if keep is not None:
                m = min(self.scorer.n_queries, len(active))  # scoring queries: the last m
                window = self._window(layer, q[:, :, -m:], active[-m:])
                selected, pruned = self._select(layer, window, k, active, keep, n)
                if pruned:
                    self._stash(layer + 1, active, h)
                h, active = self._advance(layer, h, active, selected)
            # A layer of prefill is a natural step boundary: it bounds the graph (and peak
            # memory) and drives the progress callback, at no measurable cost.
            mx.eval(h)
            if progress is not None:
                progress(layer + 1, a.num_layers)
        return a.logits(h[:, -1:])[0, 0]

    def _set_prompt_limits(self, start: int, n: int) -> None:
        """Depth limits of the prompt tokens ``start .. start+n-1`` dropped for good (random
        drop, SPEED)."""
        sched, limit = self.schedule, self.cache.limit
        positions = np.arange(start, start + n)
        protected = positions < sched.anchors
        protected[-1] = True  # the chunk's last token produces the next output token
        if sched.random_keep is not None:
            rng = np.random.default_rng(sched.seed if start == 0 else (sched.seed, start))
            free = positions[~protected]
            k = max(0, round(sched.random_keep * n) - int(protected.sum()))
            dropped = np.setdiff1d(free, rng.choice(free, size=min(k, len(free)), replace=False))
            limit[dropped] = 0
        free = positions[~protected]
        limit[free] = np.minimum(limit[free], sched.prompt_depth)

    def _blocked_attention(self, q: mx.array, k: mx.array, v: mx.array) -> mx.array:
        """Causal attention of sorted active tokens over themselves, in query blocks."""
        n, bs, scale = q.shape[2], self.block_size, self.adapter.scale
        if n == 1:  # the last token: it sees every key
            self.prefill_attention_pairs += k.shape[2]
            return attention(q, k, v, scale)
        outs = []
        for i in range(0, n, bs):
            j = min(i + bs, n)
            self.prefill_attention_pairs += (j - i) * j
            outs.append(attention(q[:, :, i:j], k[:, :, :j], v[:, :, :j], scale, "causal"))
            # One block's scores at a time: left lazy, the CPU backend may hold several.
            mx.eval(outs[-1])
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)

    # ------------------------------------------------------------------- decode
    def decode(self, token: Union[int, mx.array]) -> mx.array:
        """Run one generated token; return its (vocab,) next-token logits."""
        if self.cache.length == 0:
            raise ValueError("call prefill() before decode()")
        token = mx.array([token]) if isinstance(token, int) else token.reshape(1)
        self.schedule.completion.before_decode(self)
        return self._step(token, self.cache.add_tokens(1), prompt=False)

    def _step(self, tokens: mx.array, positions: np.ndarray, prompt: bool,
              progress: Optional[ProgressFn] = None) -> mx.array:
        """New tokens at ``positions`` (the newest of the context) through every layer on
        top of the cache, re-selecting the context at each pruning layer (LazyLLM; static
        cuts select in prompt chunks only)."""
        a, sched, cache = self.adapter, self.schedule, self.cache
        comp = positions  # tokens computed at the current layer, sorted
        h = a.embed(tokens)
        alive = cache.limit[comp] > 0
        if not alive.all():  # random drop before layer 0
            h, comp = h[:, mx.array(np.flatnonzero(alive).astype(np.int32))], comp[alive]
        selected: Optional[np.ndarray] = None  # None: every token cached at the layer
        chosen: Optional[np.ndarray] = None
        # Once completion has left no token waiting, every token has KV wherever it may and is
        # seen there, and decode steps neither select nor revive: the cuts only spared
        # computing the prompt. Until then (progressive completion) steps select as usual.
        completing = not sched.completion.keeps_selecting and not cache.aux
        n_ctx, first = cache.length, int(positions[0])
        for layer in range(a.num_layers):
            if selected is not None:
                selected = selected[cache.limit[selected] > layer]
            h, comp = self._restrict(layer, h, comp)
            q, k, v = a.qkv(layer, h, comp)
            kv = cache.layers[layer]
            kv.append(k, v, comp)
            kpos = kv.cached_positions()
            visible = None if selected is None or completing else chosen[kpos]
            rows = comp  # queries: the new tokens last, revived tokens before them
            if len(rows) > 1 and layer == a.num_layers - 1:  # others: KV only at the top
                q, h, rows = q[:, :, -1:], h[:, -1:], rows[-1:]
            out = self._rows_attention(q, kv, rows, kpos, visible, prompt)
            h = a.finish(layer, h, out)
            cache.mark_computed(layer, comp)
            selects = prompt or (sched.dynamic and not completing)
            keep = sched.keep_after(layer) if selects else None
            if keep is not None:
                m = min(self.scorer.n_queries, int((rows >= first).sum()))  # new tokens last
                window = self._window(layer, q[:, :, -m:], rows[-m:])
                selected, pruned = self._select(layer, window, kv.fetch()[0], kpos, keep, n_ctx,
                                                visible, None if prompt else comp)
                chosen = np.zeros(n_ctx, bool)
                chosen[selected] = True
                if prompt and pruned:
                    self._stash(layer + 1, comp, h)
                h, comp = self._advance(layer, h, comp, selected)
            if prompt:  # a chunk's layer is a step boundary, as in prefill
                mx.eval(h)
                if progress is not None:
                    progress(layer + 1, a.num_layers)
        return a.logits(h[:, -1:])[0, 0]

    def _rows_attention(self, q: mx.array, kv: LayerKV, rows: np.ndarray, kpos: np.ndarray,
                        visible: Optional[np.ndarray], prompt: bool = False) -> mx.array:
        """Attention of queries at positions ``rows`` over the layer cache ``kv`` (keys at
        ``kpos``): each sees the ``visible`` keys (all when None) at or before its own
        position."""
        if len(rows) > self.revival_block:
            # Many rows: block-causal over the gathered visible keys in position order (the
            # blocks' keys stop at their last row, and the scores stay block-sized).
            keys = np.sort(kpos if visible is None else kpos[visible])
            return self._revived_attention(q, kv, rows, keys, prompt)
        # A few rows over the whole layer cache with a mask: cheaper than gathering the
        # visible keys, which is slow on the CPU.
        keys, values = kv.fetch()
        return self._cache_attention(q, keys, values, rows, kpos, visible, prompt)

    def _cache_attention(self, q: mx.array, keys: mx.array, values: mx.array, rows: np.ndarray,
                         kpos: np.ndarray, visible: Optional[np.ndarray],
                         prompt: bool = False) -> mx.array:
        """Queries at positions ``rows`` over the whole layer cache (keys at ``kpos``): each
        sees the ``visible`` keys (all when None) at or before its own position."""
        self._count_pairs(len(rows) * len(kpos), prompt)
        if len(rows) == 1 and rows[0] == self.cache.length - 1:  # the newest: sees every key
            mask = visible
        else:
            mask = kpos[None, :] <= rows[:, None]
            if visible is not None:
                mask &= visible[None, :]
        mask = None if mask is None or mask.all() else mx.array(mask)
        return attention(q, keys, values, self.adapter.scale, mask)

    def _revived_attention(
        self, q: mx.array, kv: LayerKV, rows: np.ndarray, selected: np.ndarray,
        prompt: bool = False,
    ) -> mx.array:
        """Attention of rows at sorted positions ``rows`` over the ``selected`` keys (sorted
        positions) at or before each row's position, in query blocks whose keys stop at the
        block's last row (block-causal, like prefill)."""
        keys, values = kv.fetch(selected)
        outs = []
        for i in range(0, len(rows), self.revival_block):
            block = rows[i : i + self.revival_block]
            end = int(np.searchsorted(selected, block[-1], side="right"))
            mask = selected[None, :end] <= block[:, None]
            self._count_pairs(len(block) * end, prompt)
            outs.append(attention(q[:, :, i : i + len(block)], keys[:, :, :end],
                                  values[:, :, :end], self.adapter.scale, mx.array(mask)))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)

    def _count_pairs(self, pairs: int, prompt: bool) -> None:
        if prompt:
            self.prefill_attention_pairs += pairs
        else:
            self.decode_attention_pairs += pairs

    # -------------------------------------------------------------- completion
    def complete(self, max_token_layers: Optional[int] = None,
                 should_stop: Optional[Callable[[], bool]] = None) -> int:
        """Carry tokens waiting in the Aux Cache through their remaining layers, lowest
        depth first, so later steps need no revivals and see them at every layer.

        At each layer the waiting tokens attend causally to every key cached there, exactly
        as the full model's layer would given their hidden states; each (token, layer) is
        still computed at most once. Tokens stopped for good (SPEED, static, random drop)
        stay as they are. With ``complete="exact"`` the last chunk's layers above its first
        cut that prunes are recomputed first, for every token of it (:meth:`_recompute`).

        Args:
            max_token_layers: stop after about this many token-layers (None: finish all).
            should_stop: polled between layers; True stops early (a request arrived).

        Returns:
            The number of token-layers computed.
        """
        a, cache, done = self.adapter, self.cache, 0
        if cache.stash:
            done = self._recompute(should_stop)
            if cache.stash:  # stopped
                return done
        carried, h = np.empty(0, np.int64), None
        for layer in range(a.num_layers):
            entry = cache.aux.get(layer)
            if entry is not None:
                taken, hidden = cache.aux_take(layer, entry.positions, revival=False)
                h = hidden if h is None else mx.concatenate([h, hidden], axis=1)
                carried = np.concatenate([carried, taken])
                order = np.argsort(carried)
                carried, h = carried[order], h[:, mx.array(order.astype(np.int32))]
            if h is None:
                continue
            h, carried = self._restrict(layer, h, carried)  # a SPEED limit stops them
            if not len(carried):
                h = None
                continue
            room = len(carried) if max_token_layers is None else max_token_layers - done
            if should_stop is not None and should_stop():
                room = 0
            if room < len(carried):  # park the rest again at this depth; the oldest go on
                room = max(room, 0)
                cache.aux_put(layer, carried[room:], h[:, room:])
                if room == 0:
                    return done
                carried, h = carried[:room], h[:, :room]
            h = self._carry(layer, h, carried)
            done += len(carried)
            if h is None:
                break
        return done

    def _carry(self, layer: int, h: mx.array, carried: np.ndarray) -> Optional[mx.array]:
        """Compute ``layer`` for the ``carried`` tokens (hidden states ``h``) over every key
        cached there, storing their keys and values (over any they had); return their
        hidden states after it, or None at the top layer, where KV is all that is used."""
        a, kv = self.adapter, self.cache.layers[layer]
        q, k, v = a.qkv(layer, h, carried)
        kv.write(k, v, carried)
        self.cache.mark_computed(layer, carried)
        self.completed_token_layers += len(carried)
        if layer == a.num_layers - 1:
            return None
        h = a.finish(layer, h, self._rows_attention(q, kv, carried, kv.cached_positions(), None))
        mx.eval(h)
        return h

    def _stash(self, depth: int, positions: np.ndarray, h: mx.array) -> None:
        """``complete="exact"``: keep a prompt chunk's hidden states at its first cut that
        prunes (each token has seen every other up to there) for :meth:`_recompute`."""
        if self.schedule.completion.stashes and not self.cache.stash:
            self.cache.stash[depth] = Rows(positions.copy(), h)

    def _recompute(self, should_stop: Optional[Callable[[], bool]]) -> int:
        """Carry the stashed tokens through every layer above their stash depth over every
        key cached there, overwriting what the kept ones computed while others were pruned
        and dropping the pruned ones' Aux Cache entries: the state becomes the full model's.
        A stop parks them in the stash one layer up. Returns the token-layers computed."""
        a, cache, done = self.adapter, self.cache, 0
        (depth, entry), = cache.stash.items()
        carried, h = entry.positions, entry.data
        for d in list(cache.aux):
            if np.isin(cache.aux[d].positions, carried).any():
                cache.aux_take(d, carried, revival=False)
        for layer in range(depth, a.num_layers):
            h, carried = self._restrict(layer, h, carried)
            if not len(carried):
                break
            if should_stop is not None and should_stop():
                cache.stash = {layer: Rows(carried, h)}
                return done
            h = self._carry(layer, h, carried)
            done += len(carried)
            if h is None:
                break
        cache.stash = {}
        return done

    @property
    def pending_token_layers(self) -> int:
        """Token-layers :meth:`complete` would compute to finish every waiting token."""
        limit, stashed = self.cache.limit, np.empty(0, np.int64)
        total = 0
        for d, e in self.cache.stash.items():
            stashed = e.positions
            total += int(np.maximum(limit[stashed] - d, 0).sum())
        for d, e in self.cache.aux.items():
            waiting = e.positions[~np.isin(e.positions, stashed)]
            total += int((limit[waiting] - d).sum())
        return total

    # ------------------------------------------------------------ shared steps
    def _restrict(self, layer: int, h: mx.array, comp: np.ndarray):
        """Drop computed tokens whose depth limit is reached (SPEED cutoff)."""
        alive = self.cache.limit[comp] > layer
        if alive.all():
            return h, comp
        return h[:, mx.array(np.flatnonzero(alive).astype(np.int32))], comp[alive]

    def _window(self, layer: int, queries: mx.array, positions: np.ndarray) -> Rows:
        """The scoring queries at ``layer``: the newest tokens' (``queries`` at
        ``positions``) after the latest ones kept from earlier steps, the scorer's last
        ``n_queries`` in all (so a window scorer keeps its window while decoding)."""
        self.cache.window_put(layer, positions, queries, self.scorer.n_queries)
        return self.cache.window[layer]

    def _select(
        self,
        layer: int,
        window: Rows,
        keys: mx.array,
        positions: np.ndarray,
        keep: float,
        n_ctx: int,
        visible: Optional[np.ndarray] = None,
        computed: Optional[np.ndarray] = None,
    ) -> Tuple[np.ndarray, bool]:
        """Sorted positions of the tokens kept after ``layer`` (the top ``keep`` fraction of
        the context by the scorer's scores of the ``window`` queries) and whether any
        candidate was left out.

        ``keys`` (1, kv_heads, n, d) belong to ``positions`` in the same order; only those
        marked ``visible`` (all when None) and able to reach ``layer + 1`` are candidates.
        The newest token, the anchors and the scorer's always-kept positions are kept
        whatever their score. In a decode step (``computed``: the tokens it computed at
        ``layer``), at most ``max_revivals`` of the others may need a revival.
        """
        eligible = self.cache.limit[positions] > layer + 1
        if visible is not None:
            eligible &= visible
        # Tensor parallel: the scorer's head reduction (tp.reduce_heads) is the one point where
        # ranks exchange data to decide; each holds only its own heads, every rank gets the
        # reduction over all of them, so every rank selects (and revives) the same tokens.
        ctx = ScoreContext(layer, window.data, window.positions, keys, positions, eligible, visible,
                           self.adapter.scale, self.tp.reduce_heads)
        scores = self.scorer.score(ctx)[eligible]
        self.host_syncs += 1
        candidates = positions[eligible]
        forced = ((candidates < self.schedule.anchors) | (candidates == n_ctx - 1)
                  | np.isin(candidates, self.cache.always_kept))
        k, budget = round(keep * n_ctx), self.schedule.max_revivals
        if computed is not None and budget is not None:
            # Waiting at depth layer+1 and not computed now: selecting it means a revival.
            # All but the best ``budget`` of them sit this step out (fewer kept if need be).
            waiting = ((self.cache.depth[candidates] == layer + 1)
                       & ~np.isin(candidates, computed) & ~forced)
            rows = np.flatnonzero(waiting)
            if len(rows) > budget:
                best = rows[np.argsort(-scores[rows], kind="stable")[:budget]]
                waiting[best] = False
                candidates, scores, forced = (candidates[~waiting], scores[~waiting],
                                              forced[~waiting])
                k = min(k, len(candidates))
        kept = top_k(candidates, scores, forced, k)
        return kept, len(kept) < len(candidates)

    def _advance(self, layer: int, h: mx.array, comp: np.ndarray, selected: np.ndarray):
        """After pruning ``layer``: computed tokens outside ``selected`` stop (their hidden
        state goes to the Aux Cache when they may come back, else their depth is final);
        selected tokens whose depth is layer+1 and that were not just computed are revived
        from the Aux Cache."""
        cache, depth = self.cache, layer + 1
        stay = np.isin(comp, selected)
        leave = comp[~stay]
        if len(leave):
            if self.schedule.revive:
                back = cache.limit[leave] > depth
                rows = np.flatnonzero(~stay)[back]
                if len(rows):
                    cache.aux_put(depth, leave[back], h[:, mx.array(rows.astype(np.int32))])
            else:
                cache.limit[leave] = depth
            h, comp = h[:, mx.array(np.flatnonzero(stay).astype(np.int32))], comp[stay]
        revive = selected[(cache.depth[selected] == depth) & ~np.isin(selected, comp)]
        if len(revive):
            taken, hidden = cache.aux_take(depth, revive)
            comp = np.concatenate([comp, taken])
            order = np.argsort(comp)
            h = mx.concatenate([h, hidden], axis=1)[:, mx.array(order.astype(np.int32))]
            comp = comp[order]
        return h, comp

    # -------------------------------------------------------------------- stats
    @property
    def stats(self) -> GenerationStats:
        """Counts of this generation so far (timings are filled in by the caller)."""
        c = self.cache
        n = c.prompt_len
        kv = c.kv_bytes_per_layer
        computed = c.computed[:, : c.length]
        return GenerationStats(
            method=self.schedule.method,
            schedule=self.schedule.as_dict(),
            prompt_tokens=n,
            generation_tokens=max(0, c.length - n),
            kv_bytes=sum(kv),
            aux_bytes=c.aux_bytes,
            kv_bytes_per_layer=kv,
            prompt_tokens_computed_pct=(100.0 * float(np.mean(c.depth[:n] == c.num_layers))
                                        if n else 0.0),
            prompt_token_layers_computed_pct=(100.0 * float(np.mean(c.depth[:n])) / c.num_layers
                                              if n else 0.0),
            tokens_computed_per_layer=computed.sum(axis=1).tolist(),
            prefill_tokens_per_layer=list(self.prefill_tokens_per_layer),
            prefill_attention_pairs=self.prefill_attention_pairs,
            decode_attention_pairs=self.decode_attention_pairs,
            revivals=c.revivals - self._revivals_before,
            host_syncs=self.host_syncs,
            max_computations_per_token_layer=int(computed.max()) if computed.size else 0,
            completed_token_layers=self.completed_token_layers,
            ranks=self.tp.size,
            allsum_bytes=self.tp.model_bytes,
            score_allsum_bytes=self.tp.score_bytes,
        )

