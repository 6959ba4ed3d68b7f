"""The CPU kernels: the polynomial exp2 and the MLPs' gated activations built on it, against
float64 references and MLX's own activations; the adapter runs its MLPs through them."""

from __future__ import annotations

import mlx_lazy  # noqa: F401  (OpenBLAS before mlx)

import math

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models.activations import swiglu

from mlx_lazy import kernels as K
from mlx_lazy.adapter import ModelAdapter
from numerics import rel_err
from tiny_models import build_tiny_model


def test_exp2_relative_error_over_the_whole_range():
    x = mx.array(np.linspace(-126, 0, 200_001, dtype=np.float32))[None]
    got = np.array(K.exp2(x, mx.zeros((1, 1))), dtype=np.float64)
    want = np.exp2(np.array(x, dtype=np.float64))
    # Elementwise relative: a degree-5 polynomial plus float32's own rounding (eps 1.2e-7).
    assert np.max(np.abs(got - want) / want) < 5e-7
    below = K.exp2(mx.array([[-200.0, -mx.inf, 0.0]]), mx.zeros((1, 1)))
    assert below.tolist() == [[0.0, 0.0, 1.0]]


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_exp2_of_half_precision_scores(dtype):
    # Quantized checkpoints run in float16 or bfloat16: their scores reach the float32 kernels.
    x = mx.array(np.linspace(-126, 0, 20_001, dtype=np.float32)).astype(dtype)[None]
    got = np.array(K.exp2(x, mx.zeros((1, 1), dtype)), dtype=np.float64)
    want = np.exp2(np.array(x.astype(mx.float32), dtype=np.float64))
    assert np.max(np.abs(got - want) / want) < 5e-7


def _exponent(x: np.ndarray, activation: str) -> np.ndarray:
    """z of ``x * sigmoid(z)`` (float64); tanh(u) = 2 sigmoid(2u) - 1 for gelu_approx."""
    return x if activation == "silu" else 2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)


@pytest.mark.parametrize("activation", K.ACTIVATIONS)
def test_gated_activation_relative_error(activation):
    x = np.linspace(-100, 100, 400_001, dtype=np.float32)
    up = np.random.default_rng(0).uniform(0.5, 2, x.shape).astype(np.float32)
    got = np.array(K.gated(mx.array(x), mx.array(up), activation), dtype=np.float64)
    z = _exponent(x.astype(np.float64), activation)
    # The sigmoid form in float64: 0.5 x (1 + tanh) would cancel to nothing far below zero.
    with np.errstate(over="ignore"):
        want = x / (1 + np.exp(-z)) * up
    err = np.abs(got - want) / np.maximum(np.abs(want), 1e-300)
    # Elementwise relative until the exponent e = -z log2 e reaches the cap: exp2's 5e-7, plus
    # float32's rounding of e itself (a few ulps of a number up to 126, which 2**e turns into
    # a relative error of that many times ln 2: the gelu's cube takes three roundings).
    e = -z * math.log2(math.e)
    inside = e <= 126
    assert np.all(err[inside] < 1e-6 + np.abs(e[inside]) * 2.5e-7)
    # Beyond it the exponent is capped: far below zero the output is 0 up to 2**-126 of the
    # gate, as it should be; never an overflow.
    assert np.isfinite(got).all()
    assert np.all(np.abs(got - want)[~inside] < 100 * 2 * 2.0**-126)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("activation", K.ACTIVATIONS)
def test_gated_activation_keeps_the_dtype(activation, dtype):
    gate = (mx.random.normal((3, 257), key=mx.random.key(1)) * 4).astype(dtype)
    up = mx.random.normal((3, 257), key=mx.random.key(2)).astype(dtype)
    got = K.gated(gate, up, activation)
    want = swiglu(gate, up) if activation == "silu" else nn.gelu_approx(gate) * up
    assert got.dtype == dtype
    # MLX rounds its own activation to the half dtype at each step; ours once at the end.
    assert rel_err(got.astype(mx.float32), want.astype(mx.float32)) < 1e-2


def test_gated_without_compiled_kernels_matches(monkeypatch):
    gate, up = mx.random.normal((2, 300)) * 5, mx.random.normal((2, 300))
    fused = K.gated(gate, up, "gelu_approx")
    monkeypatch.setattr(K, "_kernels", False)
    assert rel_err(K.gated(gate, up, "gelu_approx"), fused) < 1e-6


def test_gated_refuses_an_unknown_activation():
    with pytest.raises(ValueError, match="activation must be one of"):
        K.gated(mx.ones(3), mx.ones(3), "relu")


@pytest.mark.parametrize("kind,activation", [("llama", "silu"), ("phi3", "silu"),
                                             ("gemma3_text", "gelu_approx"),
                                             ("qwen3_moe", None)])  # None: has MoE blocks
def test_the_adapter_runs_gated_mlps_through_the_kernels(kind, activation, tmp_path,
                                                         monkeypatch):
    model, _ = mlx_lm.load(str(build_tiny_model(kind, tmp_path)))
    adapter = ModelAdapter(model)
    calls = []
    real = K.gated

    def counted(gate, up, name):
        calls.append(name)
        return real(gate, up, name)

    monkeypatch.setattr(K, "gated", counted)
    x = mx.random.normal((1, 5, model.args.hidden_size), key=mx.random.key(3))
    for layer, block in enumerate(adapter.layers):
        got = adapter._mlp(layer, x)
        assert rel_err(got, block.mlp(x)) < 1e-5  # float32 rounding of two summation orders
    # Every dense gated MLP takes the kernel, with its family's activation; a sparse MoE
    # block runs as mlx-lm's.
    dense = [hasattr(block.mlp, "down_proj") for block in adapter.layers]
    assert calls == [activation or "silu"] * sum(dense)
    assert all(dense) == (activation is not None)
