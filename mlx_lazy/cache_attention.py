"""Attention of a step's rows over one layer's cache, by original positions.

The engine's rows (a prompt chunk, revived tokens, a decode step's new token) attend over the
keys cached at a layer: each row sees the keys its step keeps visible at or before its own
position and, in a sliding-window or chunked layer, inside its window of original positions
(:func:`~mlx_lazy.attention.position_mask`), so a pruned token's absence never shifts what
another sees. :class:`CacheAttention` picks the cheapest of three shapes for the rows at hand
and counts the (query, key) pairs each scores.
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from .attention import BlockSparse, Window, attention, position_mask, window_start
from .cache import LayerKV
from .scorers import Mask


class CacheAttention:
    """The attention of one engine's layers.

    Args:
        scale: the model's attention scale.
        block_size: query rows per block of a first chunk's causal attention.
    """

    #: query rows per attention block of chunks and revived tokens after the first prefill
    revival_block = 64

    def __init__(self, scale: float, block_size: int = 256):
        self.scale, self.block_size = scale, block_size
        self.prefill_pairs = self.decode_pairs = 0

    def __call__(self, q: mx.array, kv: LayerKV, rows: np.ndarray, visible: Optional[Mask],
                 prompt: bool, n_ctx: int, window: Optional[Window] = None,
                 sinks: Optional[mx.array] = None, softcap: Optional[float] = None) -> mx.array:
        """Attention of queries ``q`` at sorted positions ``rows`` over the layer cache
        ``kv`` of a context of ``n_ctx`` tokens: each sees the ``visible`` keys (all when
        None) at or before its own position, inside its ``window`` when given, and the
        layer's attention ``sinks``, its logits soft-capped by ``softcap`` when given
        (:func:`~mlx_lazy.attention.attention`). ``prompt`` says which pair counter the work
        goes to."""
        kpos = kv.cached_positions()
        if isinstance(visible, mx.array):  # a decode step's device selection: one row
            return self.over_cache(q, *kv.fetch(), rows, kpos, visible, prompt, window, n_ctx,
                                   sinks, softcap)
        if len(rows) > 1 and len(rows) == len(kpos) and (visible is None or visible.all()) \
                and np.array_equal(rows, kpos):
            # The cache holds exactly these tokens in order (a first chunk): causal attention
            # over the buffers themselves, in query blocks, with no gather.
            keys, values = kv.fetch()
            return self.blocked(q, keys, values, prompt, rows, window, sinks, softcap)
        if len(rows) > self.revival_block:
            # Many rows: block-causal over the gathered visible keys in position order (the
            # blocks' keys stop at their last row, and the scores stay block-sized).
            keys = np.sort(kpos if visible is None else kpos[visible])
            return self.revived(q, kv, rows, keys, prompt, window, sinks, softcap)
        # A few rows over the whole layer cache with a mask: cheaper than gathering the
        # visible keys, which is slow on the CPU.
        keys, values = kv.fetch()
        return self.over_cache(q, keys, values, rows, kpos, visible, prompt, window, n_ctx,
                               sinks, softcap)

    def blocked(self, q: mx.array, k: mx.array, v: mx.array, prompt: bool,
                positions: Optional[np.ndarray] = None, window: Optional[Window] = None,
                sinks: Optional[mx.array] = None, softcap: Optional[float] = None) -> mx.array:
        """Causal attention of sorted tokens (at ``positions``) over themselves, in query
        blocks so memory never holds N x N scores; with a ``window``, each block's keys start
        at the first inside its first row's window and a mask by position bounds the rest."""
        n, bs = q.shape[2], self.block_size
        outs = []
        for i in range(0, n, bs):
            j = min(i + bs, n)
            s, mask = 0, "causal"
            if window is not None:
                s = int(np.searchsorted(positions, window_start(positions[i], window)))
                # a row starts later, or a block-sparse pattern
                if (isinstance(window, BlockSparse)
                        or window_start(positions[j - 1], window) > positions[s]):
                    mask = mx.array(position_mask(positions[i:j], positions[s:j], window))
            self._count((j - i) * (j - s), prompt)
            outs.append(attention(q[:, :, i:j], k[:, :, s:j], v[:, :, s:j], self.scale, mask,
                                  sinks, softcap))
            # One block's scores at a time: left lazy, the CPU backend may hold several.
            mx.eval(outs[-1])
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)

    def over_cache(self, q: mx.array, keys: mx.array, values: mx.array, rows: np.ndarray,
                   kpos: np.ndarray, visible: Optional[Mask], prompt: bool = False,
                   window: Optional[Window] = None, n_ctx: Optional[int] = None,
                   sinks: Optional[mx.array] = None, softcap: Optional[float] = None
                   ) -> mx.array:
        """Queries at positions ``rows`` over the whole layer cache (keys at ``kpos``): each
        sees the ``visible`` keys (all when None; host or device) at or before its own
        position, inside its ``window`` of positions when given. A single row at the
        context's newest position ``n_ctx - 1`` needs no mask by position."""
        self._count(len(rows) * len(kpos), prompt)
        if window is None and len(rows) == 1 and rows[0] == (n_ctx or 0) - 1:
            mask = visible  # the newest row of a global layer: sees every key
        else:
            mask = position_mask(rows, kpos, window)
            if isinstance(visible, mx.array):
                mask = mx.array(mask) & visible[None, :]
            elif visible is not None:
                mask &= visible[None, :]
        if isinstance(mask, np.ndarray):
            mask = None if mask.all() else mx.array(mask)
        return attention(q, keys, values, self.scale, mask, sinks, softcap)

    def indexed(self, q: mx.array, kv: LayerKV, rows: np.ndarray, visible: Optional[Mask],
                prompt: bool, narrow: Callable[[mx.array, mx.array, slice], mx.array]
                ) -> mx.array:
        """Attention of queries ``q`` at sorted positions ``rows`` over the whole layer cache
        ``kv``, in query blocks, each row's keys (the ``visible`` ones at or before it) narrowed
        by ``narrow(keys, mask, block)``: the (rows, keys) mask of the block (a slice of the
        rows), narrowed (DeepSeek-V3.2's lightning indexer: a row's top-k keys; MiniMax-M3's
        block indexer: per head, the keys of a row's top-k blocks)."""
        keys, values = kv.fetch()
        kpos = kv.cached_positions()
        outs = []
        for i in range(0, len(rows), self.block_size):
            block = slice(i, min(i + self.block_size, len(rows)))
            mask = mx.array(position_mask(rows[block], kpos))
            if visible is not None:
                mask = mask & mx.array(visible)[None]
            self._count(len(rows[block]) * len(kpos), prompt)
            outs.append(attention(q[:, :, block], keys, values, self.scale,
                                  narrow(keys, mask, block)))
            if len(rows) > self.block_size:  # one block's scores at a time
                mx.eval(outs[-1])
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)

    def revived(self, q: mx.array, kv: LayerKV, rows: np.ndarray, selected: np.ndarray,
                prompt: bool = False, window: Optional[Window] = None,
                sinks: Optional[mx.array] = None, softcap: Optional[float] = None) -> mx.array:
        """Attention of rows at sorted positions ``rows`` over the ``selected`` keys (sorted
        positions) at or before each row's position (and inside its ``window`` of positions
        when given), in query blocks whose keys stop at the block's last row (block-causal,
        like prefill) and, with a window, start at the first inside its first row's."""
        keys, values = kv.fetch(selected)
        outs, pending = [], 0
        for i in range(0, len(rows), self.revival_block):
            block = rows[i : i + self.revival_block]
            end = int(np.searchsorted(selected, block[-1], side="right"))
            s = 0 if window is None else int(np.searchsorted(selected,
                                                             window_start(block[0], window)))
            mask = position_mask(block, selected[s:end], window)
            self._count(len(block) * (end - s), prompt)
            outs.append(attention(q[:, :, i : i + len(block)], keys[:, :, s:end],
                                  values[:, :, s:end], self.scale, mx.array(mask), sinks,
                                  softcap))
            pending += len(block)
            if pending >= self.block_size:  # a prefill block's rows of scores at a time
                mx.eval(outs)
                pending = 0
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)

    def _count(self, pairs: int, prompt: bool) -> None:
        if prompt:
            self.prefill_pairs += pairs
        else:
            self.decode_pairs += pairs
