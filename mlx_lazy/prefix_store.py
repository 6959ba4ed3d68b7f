"""The server's prefix caches: prompt caches kept between requests, as mlx-lm's server keeps
its LRU of prompt caches.

The rule for reuse across requests: by default an answer never depends on the requests
before it. A state that prunes nothing is the full model's whatever built it, so a request
that reuses one gets a fresh run's answer (up to the rounding of computing its prompt in two
chunks); those are shared. A pruned state is not: LazyLLM's cuts are chosen by the query,
the last prompt token, so the stored prefix was pruned for another request's query (with
``complete: exact`` the first token of a reuse then differs from a fresh run's, with
``after-first``, ``none`` and ``progressive`` every token, since decoding goes on from the
pruned state), and SPEED's depths differ for the tokens that were an earlier answer. Such
states are kept only with ``share_pruned`` (the server's ``--share-pruned-caches``), which
trades that independence for speed.
"""

from __future__ import annotations

from typing import List, Optional

import mlx.nn as nn

from .prompt_cache import (PromptCache, can_trim_prompt_cache, make_prompt_cache,
                           trim_prompt_cache)
from .schedule import Schedule


class PromptCacheStore:
    """Prompt caches kept between requests, as mlx-lm's server keeps its LRU of prefix caches.

    :meth:`checkout` finds, among the caches made for the same model and schedule, the one
    sharing the longest prefix with a request's tokens and hands out a copy trimmed to that
    prefix: copies share their buffers until one of them writes (MLX copies a buffer on the
    first write while another array holds it), so a copy costs little, no stored cache is
    ever used by two generations at once, and a request that fails or is cancelled leaves
    the stored cache as it was. :meth:`checkin` keeps a request's cache, replacing the
    stored caches it extends where it can trim back to them (a hybrid model's cannot: as
    mlx-lm's server does, it keeps them, and the worker checks in the state at the end of
    each prompt too). Caches of other pruning configs never mix. A stored cache is
    never written to (only copies are), so :attr:`nbytes` never exceeds ``max_bytes``.

    Args:
        max_entries: the most caches kept.
        max_bytes: the most bytes (KV buffers and Aux Cache) kept; least recently used
            caches are evicted first, and a cache larger than this is not kept.
        share_pruned: keep the caches of schedules that prune too (see the module
            docstring: a later request's answer then depends on the requests before it).
    """

    def __init__(self, max_entries: int, max_bytes: int, share_pruned: bool = False):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.share_pruned = share_pruned
        self._entries: List[PromptCache] = []  # least recently used first

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes held by the stored caches."""
        return sum(c.nbytes for c in self._entries)

    def checkout(self, model: nn.Module, schedule: Schedule, tokens: List[int]) -> PromptCache:
        """A private cache for ``tokens``: a copy of the stored one sharing the longest prefix
        with them, trimmed to it (an empty cache when none shares any); ``len(cache)``
        tokens of ``tokens`` need no computing."""
        best, common = None, 0
        for cache in self._entries:
            if cache.schedule == schedule and cache.model is model:
                n = cache.reusable(tokens)
                if n > common:
                    best, common = cache, n
        if best is None:
            return make_prompt_cache(model, schedule)
        self._entries.remove(best)  # the most recently used again
        self._entries.append(best)
        mine = best.copy()
        if common < len(mine):
            trim_prompt_cache(mine, len(mine) - common)
        return mine

    def keeps(self, schedule: Schedule) -> bool:
        """Whether caches of ``schedule`` are kept for later requests (the module's rule)."""
        return self.share_pruned or not schedule.prunes

    def checkin(self, cache: PromptCache) -> None:
        """Keep ``cache`` as the most recent, dropping the stored caches it extends (one that
        cannot trim, a hybrid model's, only those it equals: the others are what a request
        diverging after them can reuse) and evicting the least recent ones to fit; a cache
        larger than the bound, or one the rule does not share (:meth:`keeps`), is not kept
        (and the caches it extends stay)."""
        if (self.max_entries < 1 or cache.nbytes > self.max_bytes or not len(cache)
                or not self.keeps(cache.schedule)):
            return
        trims = can_trim_prompt_cache(cache)
        self._entries = [c for c in self._entries
                         if not (c.schedule == cache.schedule and c.model is cache.model
                                 and cache.tokens[: len(c)] == c.tokens
                                 and (trims or len(c) == len(cache)))]
        while self._entries and (len(self._entries) >= self.max_entries
                                 or self.nbytes + cache.nbytes > self.max_bytes):
            self._entries.pop(0)
        self._entries.append(cache)

    def most_recent(self) -> Optional[PromptCache]:
        """The cache used or kept last, if any."""
        return self._entries[-1] if self._entries else None
