"""KV cache per layer, Aux Cache of hidden states, and per-token depth bookkeeping.

A token is computed at a layer only after every layer below it (a revived token is carried
up from its depth first), so over a whole generation the layers at which a token has been
computed form a prefix [0, depth). A token has KV at layer l exactly when depth > l; a
token that stopped below the top has its hidden state at that depth in the Aux Cache,
unless its ``limit`` (the depth it may ever reach) says it can never come back. Host-side
bookkeeping is numpy; tensors stay in MLX.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from .errors import UserInputError
from .scorers import Mask, ScoreMemo, position_order


class LayerKV:
    """One layer's keys and values, in the order tokens were computed.

    Buffers grow in steps of :attr:`step` tokens and are written in place, like mlx-lm's
    ``KVCache``; ``positions[slot]`` and ``slot_of[position]`` map between slots and token
    positions.
    """

    step = 256

    def __init__(self) -> None:
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.size = 0
        self.positions = np.zeros(0, np.int64)
        self.slot_of = np.zeros(0, np.int64)
        # Device copies of the positions and their sorting order, made on first use and
        # dropped whenever the slots change (a decode step reads them at every layer).
        self._device_positions: Optional[mx.array] = None
        self._order: Optional[Tuple[mx.array, mx.array]] = None
        # Decode steps' scoring weights over these keys, by the layer scoring them (another
        # layer may read these keys: Gemma 4's upper layers); new slots extend them,
        # rewritten or trimmed ones drop them.
        self._memos: Dict[int, ScoreMemo] = {}

    def append(self, k: mx.array, v: mx.array, positions: np.ndarray) -> None:
        """Store keys/values (1, kv_heads, n, d) of tokens at ``positions``."""
        end = self.size + k.shape[2]
        if self.keys is None or end > self.keys.shape[2]:
            cap = -(-end // self.step) * self.step
            shape_k = (1, k.shape[1], cap, k.shape[3])
            shape_v = (1, v.shape[1], cap, v.shape[3])
            new_k, new_v = mx.zeros(shape_k, k.dtype), mx.zeros(shape_v, v.dtype)
            if self.size:
                new_k[..., : self.size, :] = self.keys[..., : self.size, :]
                new_v[..., : self.size, :] = self.values[..., : self.size, :]
            self.keys, self.values = new_k, new_v
            self.positions = np.resize(self.positions, cap)
        self.keys[..., self.size : end, :] = k
        self.values[..., self.size : end, :] = v
        self.positions[self.size : end] = positions
        top = int(positions.max()) + 1
        if top > len(self.slot_of):
            grown = np.full(max(top, 2 * len(self.slot_of)), -1, np.int64)
            grown[: len(self.slot_of)] = self.slot_of
            self.slot_of = grown
        self.slot_of[positions] = np.arange(self.size, end)
        self.size = end
        self._device_positions = self._order = None

    def write(self, k: mx.array, v: mx.array, positions: np.ndarray) -> None:
        """Store keys/values of tokens at ``positions``, overwriting those already cached."""
        known = np.zeros(len(positions), bool)
        inside = positions < len(self.slot_of)
        known[inside] = self.slot_of[positions[inside]] >= 0
        if not known.any():
            self.append(k, v, positions)
            return
        self._memos = {}
        rows = mx.array(np.flatnonzero(known).astype(np.int32))
        slots = mx.array(self.slot_of[positions[known]].astype(np.int32))
        self.keys[:, :, slots] = k[:, :, rows]
        self.values[:, :, slots] = v[:, :, rows]
        if not known.all():
            rows = mx.array(np.flatnonzero(~known).astype(np.int32))
            self.append(k[:, :, rows], v[:, :, rows], positions[~known])

    def truncate(self, size: int) -> None:
        """Forget the slots from ``size`` on (appended after the first ``size``)."""
        if size != self.size:
            self._reindex(size, len(self.slot_of))

    def fetch(self, positions: Optional[np.ndarray] = None) -> Tuple[mx.array, mx.array]:
        """Keys and values of ``positions`` in that order, or of every cached token."""
        if positions is None:
            return self.keys[..., : self.size, :], self.values[..., : self.size, :]
        idx = mx.array(self.slot_of[positions].astype(np.int32))
        # Indexing is ~4x faster than mx.take(axis=2) on the CPU backend.
        return self.keys[:, :, idx], self.values[:, :, idx]

    def trim(self, length: int) -> None:
        """Forget the tokens at positions ``length`` and after."""
        keep = self.positions[: self.size] < length
        if keep.all():
            return
        slots = np.flatnonzero(keep)
        if len(slots) and slots[-1] != len(slots) - 1:  # not a prefix of the slots: compact
            idx = mx.array(slots.astype(np.int32))
            self.keys[..., : len(slots), :] = self.keys[:, :, idx]
            self.values[..., : len(slots), :] = self.values[:, :, idx]
            self.positions[: len(slots)] = self.positions[slots]
        self._reindex(len(slots), length)

    def _reindex(self, size: int, length: int) -> None:
        """Hold the first ``size`` slots, for positions below ``length``: the slot map
        rebuilt, what was derived from the old slots forgotten."""
        self.size = size
        self.slot_of = np.full(length, -1, np.int64)
        self.slot_of[self.positions[:size]] = np.arange(size)
        self._device_positions = self._order = None
        self._memos = {}

    def cached_positions(self) -> np.ndarray:
        """Positions of the cached tokens in slot order."""
        return self.positions[: self.size]

    def device_positions(self) -> mx.array:
        """:meth:`cached_positions` as an int32 MLX array."""
        if self._device_positions is None:
            self._device_positions = mx.array(self.cached_positions().astype(np.int32))
        return self._device_positions

    def mask_at(self, seen: Optional[Mask]) -> Optional[Mask]:
        """The by-position mask ``seen`` (host or device; None: all) at the cached keys, in
        slot order."""
        if seen is None or isinstance(seen, np.ndarray):
            return None if seen is None else seen[self.cached_positions()]
        return seen[self.device_positions()]

    def position_order(self) -> Tuple[mx.array, mx.array]:
        """:func:`~mlx_lazy.scorers.position_order` of :meth:`cached_positions`."""
        if self._order is None:
            self._order = position_order(self.cached_positions())
        return self._order

    def score_memo(self, layer: int) -> ScoreMemo:
        """The :class:`~mlx_lazy.scorers.ScoreMemo` of decode steps scoring these keys with
        ``layer``'s queries."""
        if layer not in self._memos:
            self._memos[layer] = ScoreMemo()
        return self._memos[layer]

    def copy(self) -> "LayerKV":
        """An independent copy (MLX copies a buffer when one of two holders writes to it)."""
        out = LayerKV()
        if self.keys is not None:
            out.keys, out.values = mx.array(self.keys), mx.array(self.values)
        out.size, out.positions, out.slot_of = self.size, self.positions.copy(), self.slot_of.copy()
        return out

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the buffers, filled or not."""
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    @property
    def nbytes(self) -> int:
        """Bytes held by the cached entries (from the arrays' shapes and dtypes)."""
        if self.keys is None:
            return 0
        per_slot = (self.keys.nbytes + self.values.nbytes) // self.keys.shape[2]
        return per_slot * self.size


class Rows:
    """Rows of a per-token tensor (1, heads..., m, ...) with their positions: hidden states
    (1, m, D) waiting at one depth, or a pruning layer's scoring queries (1, H, m, d)."""

    def __init__(self, positions: np.ndarray, data: mx.array, axis: int = 1):
        self.positions, self.data, self.axis = positions, data, axis

    def take(self, rows: np.ndarray) -> mx.array:
        """The data of ``rows`` (indices into :attr:`positions`)."""
        idx = mx.array(rows.astype(np.int32))
        return self.data[:, idx] if self.axis == 1 else self.data[:, :, idx]

    def keep(self, rows: np.ndarray) -> None:
        """Keep only ``rows`` (indices into :attr:`positions`)."""
        self.data, self.positions = self.take(rows), self.positions[rows]

    def copy(self) -> "Rows":
        return Rows(self.positions.copy(), mx.array(self.data), self.axis)


#: The :class:`Rows` maps of a :class:`LazyCache`, by depth or layer, and their row axis.
ROW_MAPS = {"aux": 1, "stash": 1, "window": 2}


class LazyCache:
    """Everything one LazyLLM/SPEED sequence keeps between steps, in one object.

    Per-layer KV (:class:`LayerKV`); each token's ``depth`` (layers computed), ``limit``
    (the depth it may ever reach) and ``computed`` counts per layer; ``aux``, by depth, the
    hidden states of tokens waiting to go deeper (the Aux Cache); ``stash``
    (``complete="exact"`` only) the hidden states of the last prompt chunk's tokens at its
    first cut that prunes, where each had seen every other, until the engine recomputes the
    layers above from them; ``window``, by pruning layer, the queries of the latest scoring
    tokens (a window scorer keeps reading them while decoding); ``prompt_len`` (tokens
    given as prompt, the rest generated) and ``always_kept`` (positions kept at every cut);
    ``recurrent``, by recurrent layer of a hybrid model, the state it holds after the tokens
    it has taken (the parts of mlx-lm's ``ArraysCache`` for it, e.g. Qwen3.5's
    ``[conv_state, recurrent_state]``).

    Like mlx-lm's caches it speaks :attr:`state` / :attr:`meta_state` /
    :meth:`from_state`, :meth:`copy`, :meth:`trim` and :attr:`nbytes`, so saving, loading,
    copying and trimming need no knowledge of its fields: a new piece of state is one field
    here.

    Args:
        num_layers: model depth.
    """

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.layers: List[LayerKV] = [LayerKV() for _ in range(num_layers)]
        self.aux: Dict[int, Rows] = {}
        self.stash: Dict[int, Rows] = {}
        self.window: Dict[int, Rows] = {}
        self.depth = np.zeros(0, np.int64)
        self.limit = np.zeros(0, np.int64)
        self.computed = np.zeros((num_layers, 0), np.int32)
        self.always_kept = np.zeros(0, np.int64)
        self.prompt_len = 0
        self.revivals = 0
        # By pruning layer, the tokens (by position) the last selecting step chose, and the
        # context length then: the decode steps until the next re-selection see them
        # (``reselect_every``). Copies, rollbacks and files keep them (a mask's length is the
        # context length then); a trimmed cache re-selects at its next step.
        self.choices: Dict[int, Mask] = {}
        self.chosen_at = 0
        # A recurrent layer's state cannot drop tokens: such a cache trims only to empty.
        self.recurrent: Dict[int, List[Optional[mx.array]]] = {}

    def copy(self) -> "LazyCache":
        """An independent copy of the whole state."""
        out = self.checkpoint()
        out.layers = [layer.copy() for layer in self.layers]
        out.computed = self.computed.copy()
        return out

    def checkpoint(self) -> "LazyCache":
        """What :meth:`rollback` returns to: a copy of everything but the KV, of which each
        layer keeps its number of slots, and but ``computed``, which the depths give back
        (cheap: a decode step copies O(tokens), not O(tokens x layers), and the rows' arrays
        are shared). Valid while tokens are only added (a prompt chunk and its revivals,
        decode steps): that appends slots and leaves the others as they are, and counts a
        computation only where a token had none (each token-layer once); a completion
        rewrites slots and counts again (``exact``), so it runs before a checkpoint."""
        out = LazyCache(self.num_layers)
        for mine, layer in zip(self.layers, out.layers):
            layer.size = mine.size
        for name in ROW_MAPS:
            setattr(out, name, {d: e.copy() for d, e in getattr(self, name).items()})
        for name in TOKEN_ARRAYS:
            if name != "computed":
                setattr(out, name, getattr(self, name).copy())
        out.prompt_len, out.revivals = self.prompt_len, self.revivals
        out.choices, out.chosen_at = dict(self.choices), self.chosen_at  # masks never mutated
        out.recurrent = {layer: list(state) for layer, state in self.recurrent.items()}
        return out

    def rollback(self, mark: "LazyCache") -> None:
        """Return to the state of ``mark`` (:meth:`checkpoint`): every slot written since is
        forgotten, and the bookkeeping and rows are the checkpoint's."""
        for layer, then in zip(self.layers, mark.layers):
            layer.truncate(then.size)
        # computations counted since: the new tokens', and those of old tokens that went
        # deeper (revived), at the layers between their old and new depths
        n, before = len(mark.depth), mark.depth
        self.computed[:, n:] = 0
        deeper = np.flatnonzero(self.depth[:n] != before)
        layers = np.arange(self.num_layers)[:, None]
        counted = self.computed[:, deeper]
        counted[(layers >= before[deeper]) & (layers < self.depth[deeper])] = 0
        self.computed[:, deeper] = counted
        for name in (*ROW_MAPS, *TOKEN_ARRAYS):
            if name != "computed":
                setattr(self, name, getattr(mark, name))
        self.prompt_len, self.revivals = mark.prompt_len, mark.revivals
        self.choices, self.chosen_at = dict(mark.choices), mark.chosen_at
        self.recurrent = {layer: list(state) for layer, state in mark.recurrent.items()}

    @property
    def length(self) -> int:
        """Number of tokens in the context."""
        return len(self.depth)

    def add_tokens(self, n: int) -> np.ndarray:
        """Append ``n`` new tokens (depth 0, no limit) and return their positions."""
        start = self.length
        self.depth = np.concatenate([self.depth, np.zeros(n, np.int64)])
        self.limit = np.concatenate([self.limit, np.full(n, self.num_layers, np.int64)])
        if self.computed.shape[1] < start + n:
            grown = np.zeros((self.num_layers, max(start + n, 2 * self.computed.shape[1])),
                             np.int32)
            grown[:, :start] = self.computed[:, :start]
            self.computed = grown
        return np.arange(start, start + n)

    def mark_computed(self, layer: int, positions: np.ndarray) -> None:
        """Record that ``positions`` went through ``layer`` (their depth is now layer+1)."""
        self.computed[layer, positions] += 1
        self.depth[positions] = layer + 1

    def aux_put(self, depth: int, positions: np.ndarray, hidden: mx.array) -> None:
        """Keep hidden states (1, m, D) of tokens that stopped at ``depth``."""
        entry = self.aux.get(depth)
        if entry is None:
            self.aux[depth] = Rows(positions, hidden)
        else:
            entry.positions = np.concatenate([entry.positions, positions])
            entry.data = mx.concatenate([entry.data, hidden], axis=1)

    def aux_take(self, depth: int, positions: np.ndarray,
                 revival: bool = True) -> Tuple[np.ndarray, mx.array]:
        """Remove ``positions`` from the Aux Cache at ``depth``; return them with their
        hidden states, in the entry's order. ``revival``: count them as revived (else they
        are being completed)."""
        entry = self.aux[depth]
        hit = np.isin(entry.positions, positions)
        taken, hidden = entry.positions[hit], entry.take(np.flatnonzero(hit))
        rest = np.flatnonzero(~hit)
        if len(rest) == 0:
            del self.aux[depth]
        else:
            entry.keep(rest)
        if revival:
            self.revivals += len(taken)
        return taken, hidden

    def window_put(self, layer: int, positions: np.ndarray, queries: mx.array, size: int) -> None:
        """Append scoring queries (1, H, m, d) of tokens at ``positions`` (newer than those
        held) to ``layer``'s window, keeping the latest ``size``."""
        entry = self.window.get(layer)
        if entry is not None:
            positions = np.concatenate([entry.positions, positions])
            queries = mx.concatenate([entry.data, queries], axis=2)
        if len(positions) > size:
            positions, queries = positions[-size:], queries[:, :, -size:]
        self.window[layer] = Rows(positions, queries, axis=2)

    def trim(self, length: int) -> None:
        """Forget every token at position ``length`` and after: its KV at every layer, its
        rows (Aux Cache, stash, window) and its bookkeeping.

        Raises:
            UserInputError: tokens to forget from recurrent layers' states (:attr:`recurrent`),
                which only trim to empty (:meth:`can_trim`).
        """
        if length == self.length:  # nothing to forget (a held choice stays held)
            return
        if not self.can_trim(length):
            raise UserInputError(
                f"cannot trim this cache to {length} of its {self.length} tokens: the "
                "recurrent (linear-attention) layers' state holds every token it took and "
                "cannot drop some; trim all of them, or none")
        if length == 0:
            self.recurrent = {}
        for layer in self.layers:
            layer.trim(length)
        for name in ROW_MAPS:
            entries = getattr(self, name)
            for depth, entry in list(entries.items()):
                keep = np.flatnonzero(entry.positions < length)
                if len(keep) == 0:
                    del entries[depth]
                elif len(keep) < len(entry.positions):
                    entry.keep(keep)
        self.depth, self.limit = self.depth[:length], self.limit[:length]
        self.computed[:, length:] = 0
        self.always_kept = self.always_kept[self.always_kept < length]
        self.prompt_len = min(self.prompt_len, length)
        self.choices = {}

    def recurrent_state(self, layer: int) -> List[Optional[mx.array]]:
        """The state of recurrent ``layer`` (:attr:`recurrent`): empty on first use, where
        the layer has taken no token (:meth:`~mlx_lazy.adapter.ModelAdapter.recurrent_block`
        gives it its parts)."""
        return self.recurrent.setdefault(layer, [])

    def can_trim(self, length: int) -> bool:
        """Whether :meth:`trim` can cut the cache to ``length`` tokens: always, but that a
        recurrent layer's state trims only to empty or not at all."""
        return not self.recurrent or length in (0, self.length)

    # ------------------------------------------------------------ cache protocol
    @property
    def state(self) -> Dict[str, mx.array]:
        """Every array of the state by a flat name (what a safetensors file holds)."""
        arrays = {name: mx.array(getattr(self, name)) for name in TOKEN_ARRAYS}
        arrays["computed"] = mx.array(self.computed[:, : self.length])
        for i, layer in enumerate(self.layers):
            if layer.size:
                keys, values = layer.fetch()
                arrays[f"layers.{i}.keys"], arrays[f"layers.{i}.values"] = keys, values
                arrays[f"layers.{i}.positions"] = mx.array(layer.cached_positions())
        for name in ROW_MAPS:
            for depth, entry in getattr(self, name).items():
                arrays[f"{name}.{depth}.data"] = entry.data
                arrays[f"{name}.{depth}.positions"] = mx.array(entry.positions)
        for layer, mask in self.choices.items():
            arrays[f"choices.{layer}"] = mx.array(mask)
        for layer, state in self.recurrent.items():
            for i, part in enumerate(state):
                arrays[f"recurrent.{layer}.{i}"] = part
        return arrays

    @property
    def meta_state(self) -> Dict[str, int]:
        """The state's scalars (JSON-friendly)."""
        return {"num_layers": self.num_layers, "prompt_len": self.prompt_len,
                "revivals": self.revivals}

    @classmethod
    def from_state(cls, state: Dict[str, mx.array], meta_state: Dict[str, int]) -> "LazyCache":
        """The cache whose :attr:`state` and :attr:`meta_state` these are.

        Raises:
            KeyError, ValueError, TypeError: arrays or scalars missing or of the wrong kind
            (the caller names the file).
        """
        out = cls(int(meta_state["num_layers"]))
        for name in TOKEN_ARRAYS:
            setattr(out, name, np.array(state[name]).astype(TOKEN_ARRAYS[name]))
        for i, layer in enumerate(out.layers):
            if f"layers.{i}.keys" in state:
                layer.append(state[f"layers.{i}.keys"], state[f"layers.{i}.values"],
                             np.array(state[f"layers.{i}.positions"]).astype(np.int64))
        for key in state:
            name, _, rest = key.partition(".")
            if name == "choices":
                out.choices[int(rest)] = np.array(state[key]).astype(bool)
                out.chosen_at = len(out.choices[int(rest)])
            elif name == "recurrent":
                layer, part = map(int, rest.split("."))
                parts = out.recurrent_state(layer)
                parts.extend([None] * (part + 1 - len(parts)))
                parts[part] = state[key]
            elif name in ROW_MAPS and rest.endswith(".positions"):
                depth = int(rest.split(".")[0])
                getattr(out, name)[depth] = Rows(np.array(state[key]).astype(np.int64),
                                                 state[f"{name}.{depth}.data"], ROW_MAPS[name])
        out.prompt_len, out.revivals = int(meta_state["prompt_len"]), int(meta_state["revivals"])
        return out

    @property
    def nbytes(self) -> int:
        """Bytes held: KV buffers (filled or not), every row map and recurrent states."""
        return sum(layer.allocated_bytes for layer in self.layers) + sum(
            e.data.nbytes for name in ROW_MAPS for e in getattr(self, name).values()) + sum(
            part.nbytes for state in self.recurrent.values() for part in state)

    @property
    def kv_bytes_per_layer(self) -> List[int]:
        """Bytes of keys and values held at each layer (filled positions only)."""
        return [layer.nbytes for layer in self.layers]

    @property
    def aux_bytes(self) -> int:
        """Bytes of the hidden states held (Aux Cache and stash)."""
        return sum(e.data.nbytes for e in (*self.aux.values(), *self.stash.values()))


#: The key in :attr:`LazyCache.recurrent` of an embedding's state where a token's embedding
#: reads earlier tokens' ids (LongCat-Flash-Ngram's: the last ones'): kept, saved and trimmed
#: (only to empty) as a recurrent layer's, before layer 0.
EMBEDDING_STATE = -1
#: The per-token numpy arrays of a :class:`LazyCache` and their dtypes.
TOKEN_ARRAYS = {"depth": np.int64, "limit": np.int64, "computed": np.int32, "always_kept": np.int64}
