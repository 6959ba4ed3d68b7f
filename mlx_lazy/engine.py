"""LazyLLM / SPEED forward passes over an mlx-lm model.

``prefill`` runs the prompt layer by layer over its active set, in query blocks so memory
never holds N x N scores; ``decode`` runs one new token and, for LazyLLM, re-selects the
context at every pruning layer, reviving tokens from the Aux Cache when they come back.
Every token keeps its original position for RoPE and for the causal mask. At the last layer
only the newest token's output is ever used, so the other tokens computed there (the prompt
in prefill, revived tokens in decode) get their keys and values and nothing more.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .adapter import ModelAdapter
from .attention import attention, prepare
from .cache import LayerKV, LazyCache
from .distributed import TensorParallel, model_group
from .schedule import PruningConfig, calibrated
from .scorers import ScoreContext, top_k

ProgressFn = Callable[[int, int], None]


@dataclass
class GenerationStats:
    """Counts and timings of one generation (see the README for each field)."""

    method: str = "full"
    schedule: dict = field(default_factory=dict)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    peak_memory_bytes: int = 0
    kv_bytes: int = 0
    aux_bytes: int = 0
    kv_bytes_per_layer: List[int] = field(default_factory=list)
    prompt_tokens_computed_pct: float = 0.0
    tokens_computed_per_layer: List[int] = field(default_factory=list)
    prefill_tokens_per_layer: List[int] = field(default_factory=list)
    prefill_attention_pairs: int = 0
    decode_attention_pairs: int = 0
    revivals: int = 0
    host_syncs: int = 0
    max_computations_per_token_layer: int = 0
    ranks: int = 1
    allsum_bytes: int = 0
    score_allsum_bytes: int = 0
    text: str = ""

    def as_dict(self) -> dict:
        """JSON-friendly form with the keys scripts rely on."""
        return asdict(self)


class LazyEngine:
    """Prefill and decode one sequence with a pruning schedule.

    Args:
        model: a model from ``mlx_lm.load`` (llama, mistral, qwen2 or qwen3).
        config: the pruning configuration; None runs everything (``"full"``). A plain
            ``"lazy"`` takes the model's calibrated schedule when there is one (see
            :func:`mlx_lazy.schedule.calibrated`).
        block_size: query block length of the prefill attention.

    Raises:
        ValueError: unsupported model or invalid configuration.
    """

    #: query rows per attention block of tokens revived in decode
    revival_block = 64

    def __init__(
        self, model: nn.Module, config: Optional[PruningConfig] = None, block_size: int = 256
    ):
        self.adapter = ModelAdapter(model)
        # Sharded by mlx_lazy.distributed.shard: the group its ranks reduce scores over.
        self.tp = TensorParallel(model, model_group(model))
        fingerprint = self.adapter.fingerprint()
        self.config = calibrated(config or PruningConfig(), fingerprint,
                                 getattr(model, "mlx_lazy_schedule", None))
        self.config.check_model(fingerprint)
        self.schedule = self.config.resolve(self.adapter.num_layers)
        self.block_size = block_size
        self.scorer = self.schedule.make_scorer()
        prepare()  # outside any timed region: the CPU kernels' one-time build
        self.cache = LazyCache(self.adapter.num_layers)
        self.prompt_len = 0
        self.prefill_attention_pairs = 0
        self.decode_attention_pairs = 0
        self.prefill_tokens_per_layer: List[int] = []
        self.host_syncs = 0

    # ------------------------------------------------------------------ prefill
    def prefill(self, tokens: Union[mx.array, List[int]], progress: Optional[ProgressFn] = None) -> mx.array:
        """Run the prompt; return the (vocab,) logits of the first output token (lazy)."""
        tokens = mx.array(tokens) if not isinstance(tokens, mx.array) else tokens.reshape(-1)
        n = tokens.size
        if n == 0:
            raise ValueError("the prompt is empty")
        sched, a = self.schedule, self.adapter
        cache = self.cache = LazyCache(a.num_layers)
        self.prompt_len, self.host_syncs = n, 0
        self.always_kept = self.scorer.always_kept(n)
        self.prefill_attention_pairs = self.decode_attention_pairs = 0
        self.tp.restart()
        active = cache.add_tokens(n)
        self._set_prompt_limits(n)
        h = a.embed(tokens)
        kept = active[cache.limit > 0]
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
                selected = self._select(layer, q[:, :, -m:], active[-m:], k, active, keep, n)
                h, active = self._advance(layer, h, active, selected)
            # A layer of prefill is a natural step boundary: it bounds the graph (and peak
            # memory) and drives the progress callback, at no measurable cost.
            mx.eval(h)
            if progress is not None:
                progress(layer + 1, a.num_layers)
        self.prefill_tokens_per_layer = cache.computed.sum(axis=1).tolist()
        return a.logits(h[:, -1:])[0, 0]

    def _set_prompt_limits(self, n: int) -> None:
        """Depth limits of prompt tokens dropped for good (random drop, SPEED)."""
        sched, limit = self.schedule, self.cache.limit
        protected = np.zeros(n, bool)
        protected[: sched.anchors] = True
        protected[n - 1] = True  # the query token produces the first output token
        if sched.random_keep is not None:
            rng = np.random.default_rng(sched.seed)
            free = np.flatnonzero(~protected)
            k = max(0, round(sched.random_keep * n) - int(protected.sum()))
            dropped = np.setdiff1d(free, rng.choice(free, size=min(k, len(free)), replace=False))
            limit[dropped] = 0
        limit[:n][~protected] = np.minimum(limit[:n][~protected], sched.prompt_depth)

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
        """Run one new token through the model; return its (vocab,) next-token logits."""
        if self.prompt_len == 0:
            raise ValueError("call prefill() before decode()")
        a, sched, cache = self.adapter, self.schedule, self.cache
        token = mx.array([token]) if isinstance(token, int) else token.reshape(1)
        comp = cache.add_tokens(1)  # tokens computed at the current layer
        h = a.embed(token)
        selected: Optional[np.ndarray] = None  # None: every token cached at the layer
        n_ctx = cache.length
        for layer in range(a.num_layers):
            if selected is not None:
                selected = selected[cache.limit[selected] > layer]
                h, comp = self._restrict(layer, h, comp)
            q, k, v = a.qkv(layer, h, comp)
            kv = cache.layers[layer]
            kv.append(k, v, comp)
            keys, values = kv.fetch()
            kpos = kv.cached_positions()
            visible = None if selected is None else np.isin(kpos, selected)
            rows = comp  # queries: the new token last, revived tokens before it
            if len(rows) > 1 and layer == a.num_layers - 1:  # revived: KV only at the top
                q, h, rows = q[:, :, -1:], h[:, -1:], rows[-1:]
            if len(rows) > self.revival_block:
                # Many revived tokens: block-causal over the gathered selected keys.
                revived = self._revived_attention(q[:, :, :-1], kv, rows[:-1], selected)
                new = self._cache_attention(q[:, :, -1:], keys, values, rows[-1:], kpos, visible)
                out = mx.concatenate([revived, new], axis=2)
            else:
                # The new token (and a few revived ones) over the whole layer cache with a
                # mask: cheaper than gathering the selected keys, which is slow on the CPU.
                out = self._cache_attention(q, keys, values, rows, kpos, visible)
            h = a.finish(layer, h, out)
            cache.mark_computed(layer, comp)
            keep = sched.keep_after(layer) if sched.dynamic else None
            if keep is not None:
                selected = self._select(layer, q[:, :, -1:], rows[-1:], keys, kpos, keep, n_ctx,
                                        visible)
                h, comp = self._advance(layer, h, comp, selected)
        return a.logits(h[:, -1:])[0, 0]

    def _cache_attention(self, q: mx.array, keys: mx.array, values: mx.array, rows: np.ndarray,
                         kpos: np.ndarray, visible: Optional[np.ndarray]) -> mx.array:
        """Queries at positions ``rows`` over the whole layer cache (keys at ``kpos``): each
        sees the ``visible`` keys (all when None) at or before its own position."""
        self.decode_attention_pairs += len(rows) * len(kpos)
        if len(rows) == 1:  # the newest token: every cached key is at or before it
            mask = visible
        else:
            mask = kpos[None, :] <= rows[:, None]
            if visible is not None:
                mask &= visible[None, :]
        mask = None if mask is None or mask.all() else mx.array(mask)
        return attention(q, keys, values, self.adapter.scale, mask)

    def _revived_attention(
        self, q: mx.array, kv: LayerKV, rows: np.ndarray, selected: np.ndarray
    ) -> mx.array:
        """Attention of revived tokens at sorted positions ``rows`` over the selected keys
        at or before each row's position, in query blocks whose keys stop at the block's
        last row (block-causal, like prefill)."""
        keys, values = kv.fetch(selected)
        outs = []
        for i in range(0, len(rows), self.revival_block):
            block = rows[i : i + self.revival_block]
            end = int(np.searchsorted(selected, block[-1], side="right"))
            mask = selected[None, :end] <= block[:, None]
            self.decode_attention_pairs += len(block) * end
            outs.append(attention(q[:, :, i : i + len(block)], keys[:, :, :end],
                                  values[:, :, :end], self.adapter.scale, mx.array(mask)))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)

    # ------------------------------------------------------------ shared steps
    def _restrict(self, layer: int, h: mx.array, comp: np.ndarray):
        """Drop computed tokens whose depth limit is reached (SPEED cutoff)."""
        alive = self.cache.limit[comp] > layer
        if alive.all():
            return h, comp
        return h[:, mx.array(np.flatnonzero(alive).astype(np.int32))], comp[alive]

    def _select(
        self,
        layer: int,
        queries: mx.array,
        query_positions: np.ndarray,
        keys: mx.array,
        positions: np.ndarray,
        keep: float,
        n_ctx: int,
        visible: Optional[np.ndarray] = None,
    ) -> np.ndarray:
        """Sorted positions of the tokens kept after ``layer``: the top ``keep`` fraction of
        the context by the scorer's scores.

        ``keys`` (1, kv_heads, n, d) belong to ``positions`` in the same order; only those
        marked ``visible`` (all when None) and able to reach ``layer + 1`` are candidates.
        The query token (the last position), the anchors and the scorer's always-kept
        positions are kept whatever their score.
        """
        eligible = self.cache.limit[positions] > layer + 1
        if visible is not None:
            eligible &= visible
        # Tensor parallel: the scorer's head reduction (tp.reduce_heads) is the one point where
        # ranks exchange data to decide; each holds only its own heads, every rank gets the
        # reduction over all of them, so every rank selects (and revives) the same tokens.
        ctx = ScoreContext(layer, queries, query_positions, keys, positions, eligible, visible,
                           self.adapter.scale, self.tp.reduce_heads)
        scores = self.scorer.score(ctx)[eligible]
        self.host_syncs += 1
        candidates = positions[eligible]
        forced = ((candidates < self.schedule.anchors) | (candidates == n_ctx - 1)
                  | np.isin(candidates, self.always_kept))
        return top_k(candidates, scores, forced, round(keep * n_ctx))

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
        c, n = self.cache, self.prompt_len
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
            prompt_tokens_computed_pct=100.0 * float(np.mean(c.depth[:n] == c.num_layers)) if n else 0.0,
            tokens_computed_per_layer=computed.sum(axis=1).tolist(),
            prefill_tokens_per_layer=list(self.prefill_tokens_per_layer),
            prefill_attention_pairs=self.prefill_attention_pairs,
            decode_attention_pairs=self.decode_attention_pairs,
            revivals=c.revivals,
            host_syncs=self.host_syncs,
            max_computations_per_token_layer=int(computed.max()) if computed.size else 0,
            ranks=self.tp.size,
            allsum_bytes=self.tp.model_bytes,
            score_allsum_bytes=self.tp.score_bytes,
        )

