"""Scaled dot-product attention with a fast softmax on the CPU backend.

On the GPU this is ``mx.fast.scaled_dot_product_attention`` (``"fast"``; on CUDA at padded
shapes, :func:`padded_attention`). On the CPU, MLX's attention is unfused and its ``exp`` is
scalar (40-66 M/s on the 2-core x86 machines we test on), so the softmax dominates
long-context attention. There we compute the same thing from matmuls (BLAS) and a polynomial
``exp2`` fused by ``mx.compile`` (``"cpu-kernel"``; :func:`~mlx_lazy.kernels.exp2`, relative
error < 3e-7, like a vectorised libm) and row sums by a matrix-vector product: 2.5-3.7x faster
attention than ``mx.fast`` on those machines (1 to 16 query rows over 4,096 keys). If the CPU
compiler is unavailable, MLX's own ``exp`` is used.

The environment variable ``MLX_LAZY_ATTENTION`` (``fast`` | ``cpu-kernel``) overrides the
choice by device; the tests use it to run the GPU branch (masks and all) on the CPU, where
``mx.fast`` falls back to an exact reference computation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

import mlx.core as mx
import numpy as np

from .errors import UserInputError
from .kernels import LOG2E, exp2

IMPLEMENTATIONS = ("fast", "cpu-kernel")
ENV_VAR = "MLX_LAZY_ATTENTION"


def implementation() -> str:
    """The attention in use: ``$MLX_LAZY_ATTENTION`` when set, else ``"fast"`` on the GPU
    and ``"cpu-kernel"`` on the CPU."""
    name = os.environ.get(ENV_VAR)
    if not name:
        return "cpu-kernel" if mx.default_device() == mx.cpu else "fast"
    if name not in IMPLEMENTATIONS:
        raise UserInputError(f"{ENV_VAR} must be one of {', '.join(IMPLEMENTATIONS)}, got {name!r}")
    return name


#: On CUDA, ``mx.fast`` attends several query rows through cuDNN, which builds a graph for
#: each new shape of queries, keys and mask and keeps the last 256: revived rows and
#: completion blocks, whose counts and key lengths change at every step and layer, paid a
#: build almost every call (an 8,000-token completion took 11.5-11.9 s on an H200 against
#: 0.2 s for the whole prefill). There a call is padded to a power of two of rows and a
#: multiple of :data:`KEY_BUCKET` keys, so shapes repeat (3.1 s); Metal takes any shape.
PAD_SHAPES = mx.cuda.is_available()
KEY_BUCKET = 256


def padded_attention(q: mx.array, k: mx.array, v: mx.array, scale: float,
                     mask: Optional[mx.array], sinks: Optional[mx.array] = None) -> mx.array:
    """``mx.fast`` attention of queries (1, H, L, d) over keys/values (1, kv_heads, S, d)
    with ``mask`` (None or boolean, broadcastable to (L, S)), run at L rounded up to a
    power of two and S to a multiple of :data:`KEY_BUCKET`: padded keys are masked out,
    padded rows see the first key only and are dropped. The same numbers as unpadded (the
    masked keys weigh exactly 0)."""
    n, s = q.shape[2], k.shape[2]
    n_pad, s_pad = 1 << (n - 1).bit_length(), -(-s // KEY_BUCKET) * KEY_BUCKET
    if (n_pad, s_pad) == (n, s):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask,
                                                    sinks=sinks)
    keep = (mx.ones((n, s), mx.bool_) if mask is None  # (a block-sparse one: per head)
            else mx.broadcast_to(mask, (*mask.shape[:-2], n, s)))
    # padded keys: never seen
    keep = mx.pad(keep, [(0, 0)] * (keep.ndim - 2) + [(0, n_pad - n), (0, s_pad - s)])
    keep[..., n:, 0] = True  # a padded row sees the first key (a row that sees none is NaN)

    def rows(x: mx.array, size: int) -> mx.array:
        return mx.pad(x, [(0, 0), (0, 0), (0, size - x.shape[2]), (0, 0)])

    out = mx.fast.scaled_dot_product_attention(rows(q, n_pad), rows(k, s_pad), rows(v, s_pad),
                                               scale=scale, mask=keep, sinks=sinks)
    return out[:, :, :n]


def causal_mask(n_queries: int, n_keys: int) -> mx.array:
    """(n_queries, n_keys) mask aligned to the bottom right: row r sees keys up to
    ``n_keys - n_queries + r`` (mx.fast's ``"causal"``)."""
    rows = mx.arange(n_keys - n_queries, n_keys)[:, None]
    return mx.arange(n_keys)[None] <= rows


@dataclass(frozen=True)
class Chunks:
    """The window of a chunked local-attention layer (Llama 4's): positions are cut into
    chunks of ``size``, and a query at position p sees keys p - p % size .. p, those of its
    own chunk. Given where a sliding window (an int) is given."""

    size: int

    def __str__(self) -> str:
        return f"chunks of {self.size}"


@dataclass(frozen=True)
class BlockSparse:
    """The pattern of a block-sparse attention layer (Phi-3-small's, as mlx-lm masks it):
    positions are cut into blocks of ``block_size``; a query of block b sees, in head h of
    ``heads``, the keys of blocks b - local_blocks + 1 .. b and of every earlier block c with
    (c + h + 1) % vert_stride == 0. Given where a sliding window (an int) is given; its masks
    are per head (:func:`position_mask`)."""

    block_size: int
    local_blocks: int
    vert_stride: int
    heads: int

    def __str__(self) -> str:
        return (f"block-sparse: blocks of {self.block_size}, {self.local_blocks} local, "
                f"a stride of {self.vert_stride}")

    def pattern(self, qpos, kpos):
        """(heads, len(qpos), len(kpos)) of which keys each head's queries may see (causality
        aside), by positions (numpy or mx arrays)."""
        xp = mx if isinstance(kpos, mx.array) else np
        q_block, k_block = qpos // self.block_size, kpos // self.block_size
        local = (q_block[:, None] - k_block[None, :]) < self.local_blocks
        strided = (k_block[None, :] + xp.arange(1, self.heads + 1)[:, None]) % self.vert_stride
        return local[None] | (strided == 0)[:, None, :]


Window = Union[int, Chunks, BlockSparse]


def window_start(qpos, window: Window):
    """The first key position a query at ``qpos`` (a number or an array) sees through its
    ``window``: qpos - window + 1 for a sliding window, the start of its chunk for
    :class:`Chunks`, 0 for :class:`BlockSparse` (its strided blocks reach back to the first)."""
    if isinstance(window, Chunks):
        return qpos - qpos % window.size
    if isinstance(window, BlockSparse):
        return qpos * 0
    return qpos - window + 1


def position_mask(qpos, kpos, window: Optional[Window] = None):
    """(len(qpos), len(kpos)) mask of which keys each query sees, by original positions
    (numpy or mx arrays, in any order): a key is visible iff ``kpos <= qpos`` and, with a
    ``window`` (a sliding-window or chunked layer), ``kpos >= window_start(qpos, window)``;
    with a :class:`BlockSparse` one, (heads, len(qpos), len(kpos)): its pattern too.
    Positions, never indices: a pruned token's absence neither widens nor shifts a window."""
    mask = kpos[None, :] <= qpos[:, None]
    if isinstance(window, BlockSparse):
        return mask[None] & window.pattern(qpos, kpos)
    if window is not None:
        mask = mask & (kpos[None, :] >= window_start(qpos, window)[:, None])
    return mask


def log2_scores(q: mx.array, k: mx.array, scale: float,
                softcap: Optional[float] = None) -> mx.array:
    """Attention scores in log2 units (1, kv_heads, rep, L, S) of queries (1, H, L, d) over
    keys (1, kv_heads, S, d): softmax(s) = 2**(s log2 e - max) / sum. With a ``softcap`` c
    (Gemma 2), each logit s is first soft-capped to ``c tanh(s / c)``."""
    b, n_heads, n, d = q.shape
    kv_heads, s = k.shape[1], k.shape[2]
    rep = n_heads // kv_heads
    # Heads h = g * rep + r share key head g: queries of a group stacked as one matrix.
    factor = scale if softcap else scale * LOG2E  # a cap bends the logits, not log2 units
    scores = (q * factor).reshape(b, kv_heads, rep * n, d) @ k.swapaxes(-1, -2)
    if softcap:
        scores = mx.tanh(scores / softcap) * (softcap * LOG2E)
    return scores.reshape(b, kv_heads, rep, n, s)


def masked(scores: mx.array, mask: mx.array) -> mx.array:
    """``scores`` with -inf where the boolean ``mask`` (broadcastable to their trailing
    dimensions) is False.

    The mask becomes an additive 0 / -inf bias at its own size first: on the CPU,
    ``mx.where`` broadcast over the heads ran at ~5 ns per score, a broadcast add ~20x
    faster (3.8 against 0.16 ms on 737K scores), and adding 0.0 leaves a score exact.
    """
    return scores + mx.where(mask, 0.0, -mx.inf)


def attention_weights(q: mx.array, k: mx.array, scale: float, mask: Optional[mx.array],
                      sinks: Optional[mx.array] = None, softcap: Optional[float] = None):
    """Unnormalised softmax weights (1, kv_heads, rep, L, S) of queries (1, H, L, d) over keys
    (1, kv_heads, S, d), and their row sums (1, kv_heads, rep, L, 1); with ``sinks`` (H,),
    each head's sink logit joins every row's softmax (gpt-oss): in its maximum and its sum,
    with no value; with a ``softcap``, of the soft-capped logits (:func:`log2_scores`)."""
    scores = log2_scores(q, k, scale, softcap)
    if mask is not None and mask.ndim == 3:  # a block-sparse layer's, per head (H, L, S)
        mask = mask.reshape(k.shape[1], -1, *mask.shape[1:])
    if mask is not None:
        scores = masked(scores, mask)
    top = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = (sinks.astype(scores.dtype) * LOG2E).reshape(1, k.shape[1], -1, 1, 1)
        top = mx.maximum(top, sink)
    weights = exp2(scores, top)
    # A row sum as a matrix-vector product: BLAS, 10-20% of the CPU attention faster than
    # MLX's reduction (2.0 against 4.7 ms on 768 x 4096 x 3 weights).
    total = weights @ mx.ones((scores.shape[-1], 1), weights.dtype)
    if sinks is not None:
        total = total + exp2(sink, top)
    return weights, total


def attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float,
    mask: Union[None, str, mx.array] = None, sinks: Optional[mx.array] = None,
    softcap: Optional[float] = None,
) -> mx.array:
    """Attention of queries (1, H, L, d) over keys (1, kv_heads, S, d) and values
    (1, kv_heads, S, dv) -> (1, H, L, dv), grouped-query aware. ``mask``: None, ``"causal"``
    (aligned to the bottom right, as in ``mx.fast``) or a boolean array broadcastable to
    (L, S) or, per head, (H, L, S), True = attend. Every query row must see a key.
    ``sinks``: None or (H,) logits of a sink each head's softmax also weighs (gpt-oss).
    ``softcap``: None or c, each logit s soft-capped to ``c tanh(s / c)`` before the mask
    and softmax (Gemma 2); ``mx.fast`` cannot, so then every implementation computes the
    scores itself (as mlx-lm's Gemma 2 does)."""
    if implementation() == "fast" and not softcap:
        if PAD_SHAPES and not isinstance(mask, str) and q.shape[2] > 1:
            return padded_attention(q, k, v, scale, mask, sinks)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask,
                                                    sinks=sinks)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask must be None, 'causal' or a boolean array, got {mask!r}")
        mask = causal_mask(q.shape[2], k.shape[2])
    b, n_heads, n, _ = q.shape
    weights, total = attention_weights(q, k, scale, mask, sinks, softcap)
    # Normalise the (n, d) output rather than the (n, s) weights.
    rows = weights.reshape(b, k.shape[1], -1, k.shape[2])
    out = (rows @ v) / total.reshape(b, k.shape[1], -1, 1)
    return out.reshape(b, n_heads, n, v.shape[-1])  # values may be narrower than keys (MLA)
