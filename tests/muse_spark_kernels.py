"""mlx-lm's fused Muse Spark kernels (``mlx_lm.kernels``, Metal only) in plain MLX, for the
CPU: each computes every token's row alone, in float32, rounding to the input's dtype where the
kernel rounds (conftest's ``muse_spark_without_metal`` puts them in mlx-lm's module, for its
forward and the engine's alike)."""

from __future__ import annotations

import mlx.core as mx
from mlx import nn

F32 = mx.float32


def _normed(x: mx.array, eps: float) -> mx.array:
    """``x`` (float32) times the reciprocal RMS of its last axis."""
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps)


def qk_norm(qkvg: mx.array, *, n_heads: int, n_kv_heads: int, head_dim: int, eps: float,
            query_scale: float) -> list:
    """Each q and k head normed (weight-free), rounded; the queries times ``query_scale``."""
    t = qkvg.dtype
    heads = qkvg[..., :(n_heads + n_kv_heads) * head_dim].astype(F32)
    y = _normed(heads.reshape(*qkvg.shape[:-1], -1, head_dim), eps).astype(t)
    return [(y[..., :n_heads, :].astype(F32) * query_scale).astype(t), y[..., n_heads:, :]]


def qk_norm_rope(qkvg: mx.array, *, rope_base: float, offset, **sizes) -> list:
    """:func:`qk_norm`, then traditional RoPE of the rounded q and k at ``offset`` + the
    token's index in its batch row (an int, or one offset per batch row)."""
    def rotate(x: mx.array) -> mx.array:  # (B, L, H, D) -> by batch row
        y = mx.fast.rope(x.astype(F32).transpose(0, 2, 1, 3), x.shape[-1], traditional=True,
                         base=rope_base, scale=1.0, offset=offset)
        return y.transpose(0, 2, 1, 3).astype(x.dtype)

    return [rotate(x) for x in qk_norm(qkvg, **sizes)]


def rms_norm_sigmoid_gate(x: mx.array, gate: mx.array, *, eps: float) -> mx.array:
    """Each head of the attention output ``x`` (B, H, L, D) normed, times the sigmoid of its
    ``gate`` (B, L, H * D): (B, L, H * D), rounded once."""
    b, h, n, d = x.shape
    out = _normed(x.astype(F32), eps).transpose(0, 2, 1, 3).reshape(b, n, h * d)
    return (out * mx.sigmoid(gate.astype(F32))).astype(x.dtype)


def norm_add_norm(branch: mx.array, stream: mx.array, *, alpha: mx.array, beta: mx.array,
                  post_weight, post_eps: float, next_norm) -> tuple:
    """The branch (times ``post_weight`` in its dtype) normed and rounded, added to the float32
    stream as ``alpha * stream + beta * branch``; the sum normed by ``next_norm`` (rounded to
    the branch's dtype), or None."""
    t = branch.dtype
    v = branch.astype(F32)
    if post_weight is not None:
        v = (post_weight.astype(t).astype(F32) * v).astype(t).astype(F32)
    s = alpha * stream.astype(F32) + beta * _normed(v, post_eps).astype(t).astype(F32)
    return s, None if next_norm is None else pre_norm(s, next_norm, dtype=t)


def pre_norm(stream: mx.array, norm: nn.RMSNorm, *, dtype: mx.Dtype) -> mx.array:
    """``norm`` of the float32 stream, rounded to ``dtype``."""
    return (_normed(stream.astype(F32), norm.eps) * norm.weight.astype(F32)).astype(dtype)


def expert_routing(logits: mx.array, expert_bias: mx.array, *, top_k: int, multiplier: float,
                   score_eps: float, route_scale: float) -> list:
    """The top-k experts by sigmoid score plus bias, best first, and their scores over their
    sum (plus ``score_eps``) times ``route_scale``."""
    scores = mx.sigmoid(logits.astype(F32) * multiplier)
    inds = mx.argsort(-(scores + expert_bias), axis=-1)[..., :top_k]
    chosen = mx.take_along_axis(scores, inds, axis=-1)
    weights = chosen / (chosen.sum(axis=-1, keepdims=True) + score_eps) * route_scale
    return [inds.astype(mx.uint32), weights]


def post_expert_norm_combine(experts: mx.array, weights: mx.array, *, norm_weight: mx.array,
                             eps: float) -> mx.array:
    """Each expert's output (..., K, D) times ``norm_weight``, normed, added with its weight
    (rounded) in order, the sum rounded at each step."""
    t = experts.dtype
    v = experts.astype(F32) * norm_weight.astype(F32)
    normed, w = _normed(v, eps), weights.astype(t).astype(F32)
    acc = mx.zeros(experts.shape[:-2] + experts.shape[-1:], F32)
    for k in range(experts.shape[-2]):
        acc = (acc + normed[..., k, :] * w[..., k:k + 1]).astype(t).astype(F32)
    return acc.astype(t)


#: The kernels' names in ``mlx_lm.models.muse_spark``.
KERNELS = {f.__name__: f for f in (qk_norm, qk_norm_rope, rms_norm_sigmoid_gate, norm_add_norm,
                                   pre_norm, expert_routing, post_expert_norm_combine)}
