"""LazyLLM / SPEED forward passes over an mlx-lm model, on a state that lives across calls.

``extend`` runs prompt tokens on top of the state and ``decode`` one generated token, both
through ``_forward``, which re-selects the context at every pruning layer among all tokens,
old and new, reviving tokens from the Aux Cache when they come back (with ``reselect_every``
above 1, a decode step between re-selections sees the last choice instead); a first chunk
attends causally over itself in query blocks, so memory never holds N x N scores. ``complete``
carries waiting tokens through their remaining layers (with ``complete="exact"``, it first
recomputes the chunk's layers above its first cut that prunes from the hidden states stashed
there, so the state becomes the full model's). Every layer of every path is one routine,
``_layer``. Every token keeps its original position for RoPE and for the causal mask. At the
last layer only the newest token's output is ever used, so the other tokens computed there get
their keys and values and nothing more.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .adapter import ModelAdapter
from .cache import EMBEDDING_STATE, LazyCache, Rows
from .cache_attention import CacheAttention
from .distributed import TensorParallel, model_group
from .errors import UserInputError, shown
from .inputs import is_int
from .kernels import prepare
from .policies import check_hybrid_schedule
from .schedule import Schedule
from .scorers import Mask
from .selection import Selector, cuts_select, kept_count
from .token_ids import check_tokens, token_ids

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
    selections: int = 0
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
        model: a model from ``mlx_lm.load`` of a family :class:`ModelAdapter` supports.
        schedule: the resolved plan (:func:`mlx_lazy.resolve.resolve_config`); None runs
            everything (``"full"``).
        block_size: query block length of the prefill attention.

    Raises:
        TypeError: a ``schedule`` that is not a resolved :class:`Schedule`.
        UserInputError: unsupported model, or a schedule for another depth or one the model
            cannot run (a hybrid's: :func:`~mlx_lazy.policies.check_hybrid_schedule`).
    """

    #: The most rows of a layer whose output projection and MLP run as one graph: a long
    #: prompt's activations stay this many rows' (mlx-lm's prefill_step_size), where the
    #: whole prompt's MLP activations would outgrow the weights (Qwen2.5-Coder-0.5B at 16K).
    finish_rows = 2048

    def __init__(self, model: nn.Module, schedule: Optional[Schedule] = None,
                 block_size: int = 256):
        self.adapter = ModelAdapter(model)
        if schedule is not None and not isinstance(schedule, Schedule):
            raise TypeError("LazyEngine takes a resolved Schedule; resolve a PruningConfig "
                            "with mlx_lazy.resolve_config(model, config)")
        # Sharded by mlx_lazy.distributed.shard: the group its ranks reduce scores over.
        self.tp = TensorParallel(model, model_group(model))
        self.schedule = schedule or Schedule.full(self.adapter.num_layers)
        if self.schedule.num_layers != self.adapter.num_layers:
            raise UserInputError(f"the schedule is for {self.schedule.num_layers} layers, the "
                                 f"model has {self.adapter.num_layers}")
        check_hybrid_schedule(self.schedule, model)  # one made without the model's checks
        #: the layers' attention over the cache (its pair counters are per request)
        self.attention = CacheAttention(self.adapter.scale, block_size)
        self.scorer = self.schedule.scorer
        self.selector = Selector(self.schedule, self.adapter.scale, self.tp.reduce_heads,
                                 self.adapter.kv_layer, self.adapter.softcap)
        prepare()  # outside any timed region: the CPU kernels' one-time build
        self.cache = LazyCache(self.adapter.num_layers)
        self._atomic_depth = 0  # nested atomic() blocks: the outermost checkpoints
        self.start_request()

    def start_request(self) -> None:
        """Zero the per-request counters of :attr:`stats` (the cache and its
        once-per-layer counter live on)."""
        self.attention.prefill_pairs = self.attention.decode_pairs = 0
        self.prefill_tokens_per_layer = [0] * self.adapter.num_layers
        self.selector.selections = self.selector.host_syncs = 0
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
        from the Aux Cache, new ones not selected stop there and wait in it. An exception
        part-way (Ctrl-C, a ``progress`` callback that raises) leaves the state as it was.

        Raises:
            UserInputError: ``tokens`` empty or not ids of the model's vocabulary (MLX does
                not bounds-check its embedding lookup: one would read past the table).
        """
        ids = token_ids(tokens.reshape(-1) if isinstance(tokens, mx.array) else tokens)
        check_tokens(ids, self.adapter.vocab_size)
        tokens, n = mx.array(ids), len(ids)
        with self.atomic():  # new tokens see the recomputed states (an owed recompute first)
            return self._extend(tokens, n, progress)

    def _extend(self, tokens: mx.array, n: int, progress: Optional[ProgressFn]) -> mx.array:
        """:meth:`extend`'s work, once the tokens are checked and any completion is done."""
        start = self.cache.length
        positions = self.cache.add_tokens(n)
        self._set_prompt_limits(start, n)
        self.cache.always_kept = start + self.scorer.always_kept(n)
        self.cache.prompt_len = self.cache.length
        before = self.cache.computed.sum(axis=1)
        logits = self._forward(tokens, positions, prompt=True, progress=progress)
        done = self.cache.computed.sum(axis=1) - before
        self.prefill_tokens_per_layer = [a + int(b) for a, b in
                                         zip(self.prefill_tokens_per_layer, done)]
        return logits

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

    # ------------------------------------------------------------------- decode
    def decode(self, token: Union[int, mx.array]) -> mx.array:
        """Run one generated token; return its (vocab,) next-token logits.

        Raises:
            UserInputError: an int ``token`` outside the vocabulary (an array is not read
                back to check: it is the caller's, as :func:`~mlx_lazy.generate_step`'s).
            ValueError: an empty state (nothing to decode after: a caller's bug).
        """
        if self.cache.length == 0:
            raise ValueError("call prefill() before decode()")
        if not isinstance(token, mx.array):  # a device token is the caller's to check
            check_tokens(token_ids([token]), self.adapter.vocab_size)
            token = mx.array([token])
        token = token.reshape(1)
        with self.atomic():  # the step and the completion its mode runs first, or neither
            self.schedule.completion.before_decode(self)
            return self._forward(token, self.cache.add_tokens(1), prompt=False)

    @contextmanager
    def atomic(self) -> Iterator[None]:
        """Tokens added inside go in whole or not at all: an exception part-way (Ctrl-C, a
        progress callback, sampler or logits processor that raised) returns the state to what
        it was before, revived and completed tokens included (they were in flight, out of
        the Aux Cache). A recompute ``complete="exact"`` still owes (a stash) runs first,
        outside: it rewrites keys and values, which a checkpoint does not keep. Nested, only
        the outermost block checkpoints (and rolls back)."""
        if self._atomic_depth:
            yield
            return
        if self.cache.stash:
            self.complete()
        mark = self.cache.checkpoint()
        completed = self.completed_token_layers  # counts the state's work, as it goes back
        self._atomic_depth += 1
        try:
            yield
        except BaseException:
            self.cache.rollback(mark)
            self.completed_token_layers = completed
            raise
        finally:
            self._atomic_depth -= 1

    # ----------------------------------------------------------------- forward
    def _forward(self, tokens: mx.array, positions: np.ndarray, prompt: bool,
                 progress: Optional[ProgressFn] = None) -> mx.array:
        """New tokens at ``positions`` (the newest of the context: a prompt chunk, or one
        decoded token) through every layer on top of the cache, re-selecting the context at
        each pruning layer (LazyLLM; static cuts select in prompt chunks only); returns the
        (vocab,) logits after the last of them."""
        a, sched, cache, select = self.adapter, self.schedule, self.cache, self.selector
        comp = positions  # tokens computed at the current layer, sorted
        # layer 0's _restrict drops tokens a random drop keeps out; an n-gram embedding reads
        # the ids before them (computed before any pruning)
        h = a.embed(tokens, positions,
                    cache.recurrent_state(EMBEDDING_STATE) if a.context_width else None)
        chosen: Optional[Mask] = None  # by position, the tokens seen (None: all cached)
        # Once completion has left no token waiting, every token has KV wherever it may and is
        # seen there, and decode steps neither select nor revive: the cuts only spared
        # computing the prompt. Until then (progressive completion) steps select as usual.
        completing = not sched.completion.keeps_selecting and not cache.aux
        # A sequence starts selecting with a prompt chunk long enough to prune; once it has
        # (choices made, tokens waiting), every later chunk and step selects.
        started = bool(cache.choices) or bool(cache.aux) or (prompt and cuts_select(len(positions)))
        selects = started and (prompt or (sched.dynamic and not completing))
        n_ctx, first = cache.length, int(positions[0])
        # Between re-selections (reselect_every) a decode step sees what the last one chose.
        held = (not prompt and selects and bool(cache.choices)
                and n_ctx - cache.chosen_at < sched.reselect_every)
        for layer in range(a.num_layers):
            h, comp = self._restrict(layer, h, comp)
            seen = None if completing else chosen
            q, h, rows, visible = self._layer(layer, h, comp, seen, prompt)
            keep = sched.keep_after(layer, decoding=not prompt) if selects else None
            if keep is not None:
                m = min(self.scorer.n_queries, int((rows >= first).sum()))  # new tokens last
                window = select.window(cache, layer, q[:, :, -m:], rows[-m:])
                if held:
                    chosen = _widened(cache.choices[layer], n_ctx)
                elif prompt or len(comp) > 1 or select.may_revive(cache, layer):
                    selected, pruned = select.on_host(cache, layer, window, keep, n_ctx, visible,
                                                      None if prompt else comp)
                    chosen = np.zeros(n_ctx, bool)
                    chosen[selected] = True
                    if prompt and pruned:
                        self._stash(layer + 1, comp, h)
                    h, comp = self._advance(layer, h, comp, selected)
                else:  # only the new token computed, none to revive: the device decides alone
                    chosen = select.on_device(cache, layer, window, keep, n_ctx, visible)
                if not held:
                    cache.choices[layer], cache.chosen_at = chosen, n_ctx
            if prompt:
                # A chunk's layer is a natural step boundary: it bounds the graph (and peak
                # memory) and drives the progress callback, at no measurable cost.
                mx.eval(h)
                if progress is not None:
                    progress(layer + 1, a.num_layers)
        return a.logits(h[:, -1:])[0, 0]

    def _layer(self, layer: int, h: mx.array, comp: np.ndarray, seen: Optional[Mask],
               prompt: bool, output: bool = True
               ) -> Tuple[mx.array, Optional[mx.array], np.ndarray, Optional[Mask]]:
        """One layer for the tokens at sorted positions ``comp`` (hidden states ``h``): their
        keys and values stored (over any they had), then each token's attention over the
        keys cached there at or before its position (those ``seen`` marks, by position,
        when given), o_proj and MLP. A layer that reads a lower layer's keys and values
        (Gemma 4's E2B/E4B, :meth:`~mlx_lazy.adapter.ModelAdapter.kv_layer`) stores none and
        sees those of the tokens computed at it, as a layer with its own would; so does a
        second-loop layer of IQuest-Loop-Coder over its first-loop layer's, beside its own
        (:meth:`~mlx_lazy.adapter.ModelAdapter.loop_source`). Every forward, completion and
        recompute goes through here.

        Returns the queries, the hidden states after the layer, the positions they belong to
        and the keys they saw (``seen`` at the layer's cached keys; None: all). At the top
        layer only the newest token's output is ever used: with ``output`` the rows shrink to
        it, else (completion) the tokens get their keys and values and the hidden states are
        None.
        """
        a, cache = self.adapter, self.cache
        if a.attention_free(layer):
            return self._attention_free_layer(layer, h, comp, output)
        kv = cache.layers[a.kv_layer(layer)]
        q, k, v, gate = a.qkv(layer, h, comp)
        if k is not None:
            kv.write(k, v, comp)
        cache.mark_computed(layer, comp)
        rows = comp
        if layer == a.num_layers - 1:
            if not output:
                return q, None, rows, None
            if len(rows) > 1:
                q, h, rows = q[:, :, -1:], h[:, -1:], rows[-1:]
                gate = None if gate is None else gate[:, -1:]
        visible = kv.mask_at(seen)
        if k is None:  # the lower layer also holds tokens that stopped below this one
            visible = _and(visible, cache.depth[kv.cached_positions()] > layer)
        if a.index_topk(layer) is not None:  # DeepSeek-V3.2, MiniMax-M3: each row's keys
            # narrowed by its indexer (gate: its queries), among those present
            kpos = kv.cached_positions()
            out = self.attention.indexed(q, kv, rows, visible, prompt, lambda keys, mask, block:
                                         a.index_mask(layer, gate[:, block], keys, mask,
                                                      rows[block], kpos))
            return q, self._finish(layer, h, out), rows, visible
        out = self.attention(q, kv, rows, visible, prompt, cache.length,
                             a.sliding_window(layer), a.sinks(layer), a.softcap(layer))
        source = a.loop_source(layer)
        if source is not None:  # IQuest's second loop: also over the first loop's keys, of the
            first = cache.layers[source]  # tokens seen that reached this layer
            seen_there = _and(first.mask_at(seen), cache.depth[first.cached_positions()] > layer)
            out = a.mix_loops(layer, q, self.attention(q, first, rows, seen_there, prompt,
                                                       cache.length), out)
        return q, self._finish(layer, h, out, gate), rows, visible

    def _finish(self, layer: int, h: mx.array, out: mx.array,
                gate: Optional[mx.array] = None) -> mx.array:
        """The layer's output for its rows from their attention ``out`` (1, H, n, d)
        (:meth:`~mlx_lazy.adapter.ModelAdapter.finish`, row by row alike), in blocks of
        :attr:`finish_rows` rows, each evaluated before the next is built."""
        n, step = out.shape[2], self.finish_rows
        if n <= step:
            return self.adapter.finish(layer, h, out, gate)
        parts = []
        for i in range(0, n, step):
            block = slice(i, i + step)
            parts.append(self.adapter.finish(layer, h[:, block], out[:, :, block],
                                             None if gate is None else gate[:, block]))
            mx.eval(parts[-1])
        return mx.concatenate(parts, axis=1)

    def _attention_free_layer(self, layer: int, h: mx.array, comp: np.ndarray, output: bool
                              ) -> Tuple[None, Optional[mx.array], np.ndarray, None]:
        """:meth:`_layer` for a layer without attention: a recurrent one (Qwen3.5's linear
        attention, LFM2's convolutions, Mamba-2), whose state takes the tokens at ``comp`` in
        order (every one must follow the tokens it has taken; the schedules a hybrid model
        resolves to, no revival and no completion, keep it so), or a stateless one (Nemotron-H's
        MLPs, Llama-Nemotron's layers without attention), which takes any tokens. No queries
        (no cut follows such a layer), no keys seen."""
        a, cache = self.adapter, self.cache
        if a.recurrent(layer):
            # tokens from the first one on already taken there (O(new tokens): the newest)
            later = np.flatnonzero(cache.depth[comp[0]:] > layer)
            if len(later):
                raise RuntimeError(f"token {comp[0]} sent to recurrent layer {layer} after "
                                   f"token {comp[0] + later[-1]}: its state takes tokens in "
                                   "order only")
            cache.mark_computed(layer, comp)
            h = a.recurrent_block(layer, h, cache.recurrent_state(layer), comp)
        else:
            cache.mark_computed(layer, comp)
            h = a.stateless_block(layer, h)
        if layer == self.adapter.num_layers - 1:
            if not output:
                return None, None, comp, None
            h, comp = h[:, -1:], comp[-1:]
        return None, h, comp, None

    # -------------------------------------------------------------- completion
    def complete(self, max_token_layers: Optional[int] = None,
                 should_stop: Optional[Callable[[], bool]] = None) -> int:
        """Carry tokens waiting in the Aux Cache through their remaining layers, lowest
        depth first, so later steps need no revivals and see them at every layer.

        At each layer the waiting tokens attend causally to every key cached there, exactly
        as the full model's layer would given their hidden states; each (token, layer) is
        still computed at most once. Tokens stopped for good (SPEED, static, random drop)
        stay as they are. With ``complete="exact"`` the last chunk's layers above its first
        cut that prunes are recomputed first, for every token of it, from the hidden states
        stashed there, overwriting what the kept ones computed while others were pruned and
        dropping the pruned ones' Aux Cache entries: the state becomes the full model's.

        Args:
            max_token_layers: stop after about this many token-layers (None: finish all);
                the recompute of a stash is never split.
            should_stop: polled between layers; True stops early (a request arrived), leaving
                the rest where :meth:`complete` resumes it.

        An exception part-way (Ctrl-C) leaves the waiting tokens waiting, as before the call
        (:meth:`atomic`), but inside the recompute of a stash.

        Returns:
            The number of token-layers computed.

        Raises:
            UserInputError: ``max_token_layers`` is not None or a positive integer.
        """
        if max_token_layers is not None and (not is_int(max_token_layers, numpy=True)
                                             or max_token_layers < 1):
            raise UserInputError("max_token_layers must be a positive integer or None, got "
                                 f"{shown(max_token_layers, 80)}")
        cache, done = self.cache, 0
        if cache.stash:
            (depth, entry), = cache.stash.items()
            for d in list(cache.aux):
                if np.isin(cache.aux[d].positions, entry.positions).any():
                    cache.aux_take(d, entry.positions, revival=False)
            cache.stash = {}
            done, stopped = self._carry_up(depth, entry.positions, entry.data, None,
                                           should_stop, self._park_stash)
            if stopped:
                return done
        budget = None if max_token_layers is None else max_token_layers - done
        with self.atomic():  # an interrupt leaves the waiting tokens waiting
            more, _ = self._carry_up(0, np.empty(0, np.int64), None, budget, should_stop,
                                     self.cache.aux_put, absorb=True)
        return done + more

    def promote(self, share: float) -> int:
        """Before a decode step (:class:`~mlx_lazy.completion.Promote`): at each cut, lowest
        first, carry the best-scoring tokens waiting there through their remaining layers
        until ``share`` of the context (:func:`~mlx_lazy.selection.kept_count`) has keys above
        it; once it has, nothing. Returns the token-layers computed."""
        cache, done = self.cache, 0
        for layer in self.schedule.prune_layers:
            depth = layer + 1
            if depth not in cache.aux:
                continue
            have = int((cache.depth[: cache.length] > depth).sum())
            n = kept_count(share, cache.length) - have
            if n <= 0:
                continue
            best = self.selector.best_waiting(cache, layer, n)
            positions, h = _merged(np.empty(0, np.int64), None,
                                   *cache.aux_take(depth, best, revival=False))
            more, _ = self._carry_up(depth, positions, h, None, None, cache.aux_put)
            done += more
        return done

    def _carry_up(self, start: int, carried: np.ndarray, h: Optional[mx.array],
                  budget: Optional[int], should_stop: Optional[Callable[[], bool]],
                  park: Callable[[int, np.ndarray, mx.array], None],
                  absorb: bool = False) -> Tuple[int, bool]:
        """Carry tokens (sorted positions ``carried``, hidden states ``h``) from layer
        ``start`` up, each layer over every key cached there; with ``absorb``, the tokens
        waiting in the Aux Cache join at their depth. Past ``budget`` token-layers, or when
        ``should_stop`` says so, the rest are handed to ``park(layer, positions, h)`` and
        the oldest go on. Returns the token-layers computed and whether it stopped early."""
        cache, done = self.cache, 0
        for layer in range(start, self.adapter.num_layers):
            entry = cache.aux.get(layer) if absorb else None
            if entry is not None:
                carried, h = _merged(carried, h, *cache.aux_take(layer, entry.positions,
                                                                 revival=False))
            if h is None:
                continue
            h, carried = self._restrict(layer, h, carried)  # a SPEED limit stops them
            if not len(carried):
                h = None
                continue
            room = len(carried) if budget is None else budget - done
            if should_stop is not None and should_stop():
                room = 0
            if room < len(carried):  # park the rest again at this depth; the oldest go on
                room = max(room, 0)
                park(layer, carried[room:], h[:, room:])
                if room == 0:
                    return done, True
                carried, h = carried[:room], h[:, :room]
            _, h, _, _ = self._layer(layer, h, carried, None, prompt=False, output=False)
            self.completed_token_layers += len(carried)
            done += len(carried)
            if h is None:
                break
            mx.eval(h)
        return done, False

    def _park_stash(self, depth: int, positions: np.ndarray, h: mx.array) -> None:
        """A stopped recompute: its tokens wait in the stash at ``depth``."""
        self.cache.stash = {depth: Rows(positions, h)}

    def _stash(self, depth: int, positions: np.ndarray, h: mx.array) -> None:
        """``complete="exact"``: keep a prompt chunk's hidden states at its first cut that
        prunes (each token has seen every other up to there) for :meth:`complete`."""
        if self.schedule.completion.stashes and not self.cache.stash:
            self.cache.stash[depth] = Rows(positions.copy(), h)

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
        return _rows(h, np.flatnonzero(alive)), comp[alive]

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
                    cache.aux_put(depth, leave[back], _rows(h, rows))
            else:
                cache.limit[leave] = depth
            h, comp = _rows(h, np.flatnonzero(stay)), comp[stay]
        revive = selected[(cache.depth[selected] == depth) & ~np.isin(selected, comp)]
        if len(revive):
            comp, h = _merged(comp, h, *cache.aux_take(depth, revive))
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
            prefill_attention_pairs=self.attention.prefill_pairs,
            decode_attention_pairs=self.attention.decode_pairs,
            revivals=c.revivals - self._revivals_before,
            selections=self.selector.selections,
            host_syncs=self.selector.host_syncs,
            max_computations_per_token_layer=int(computed.max()) if computed.size else 0,
            completed_token_layers=self.completed_token_layers,
            ranks=self.tp.size,
            allsum_bytes=self.tp.model_bytes,
            score_allsum_bytes=self.tp.score_bytes,
        )


def _rows(h: mx.array, rows: np.ndarray) -> mx.array:
    """The token rows ``rows`` (indices) of hidden states ``h`` (1, tokens, ...)."""
    return h[:, mx.array(rows.astype(np.int32))]


def _merged(positions: np.ndarray, h: Optional[mx.array], more: np.ndarray,
            hidden: mx.array) -> Tuple[np.ndarray, mx.array]:
    """Tokens at ``positions`` with hidden states ``h`` (None: no tokens) joined by those at
    ``more`` with ``hidden``, in position order."""
    positions = np.concatenate([positions, more])
    h = hidden if h is None else mx.concatenate([h, hidden], axis=1)
    order = np.argsort(positions)
    return positions[order], _rows(h, order)


def _and(mask: Optional[Mask], host: np.ndarray) -> Optional[Mask]:
    """``mask`` (None: all; host or device) and the host mask ``host``, None if all."""
    if host.all():
        return mask
    if mask is None or isinstance(mask, np.ndarray):
        return host if mask is None else mask & host
    return mask & mx.array(host)


def _widened(mask: Mask, n: int) -> Mask:
    """A by-position ``mask`` extended to ``n`` positions, the new ones seen."""
    if isinstance(mask, np.ndarray):
        return np.concatenate([mask, np.ones(n - len(mask), bool)])
    return mx.concatenate([mask, mx.ones(n - mask.size, mx.bool_)])
