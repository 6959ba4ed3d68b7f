"""Run an mlx-lm model's own modules on arbitrary token subsets at explicit positions.

No weights are re-implemented: embeddings, projections, q/k norms, RoPE, MLP, norms and the
LM head are the loaded model's modules, so quantized and unquantized checkpoints of the
supported families behave alike.
"""

from __future__ import annotations

import hashlib

from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from typing import Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .errors import UserInputError

# qwen3_moe: its sparse MoE block sits at ``block.mlp`` and works per token like a dense MLP.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
# The mlx-lm releases whose model internals this adapter is tested against (it reads
# ``self_attn.{rope, scale, n_heads, n_kv_heads, q_norm, k_norm}``, ``use_sliding``,
# ``embed_tokens.as_linear``): at least the first, below the second. Same as pyproject.toml.
MLX_LM_VERSIONS = ((0, 32), (0, 33))


def check_mlx_lm_version(installed: str | None = None) -> None:
    """Raise UserInputError when the installed mlx-lm is outside :data:`MLX_LM_VERSIONS`."""
    installed = installed or _installed_mlx_lm()
    if installed is None:  # e.g. a source checkout on sys.path: trust it
        return
    lo, hi = (".".join(map(str, v)) for v in MLX_LM_VERSIONS)
    try:
        release = tuple(int(x) for x in installed.split(".")[:2])
    except ValueError:
        release = None
    if release is None or not MLX_LM_VERSIONS[0] <= release < MLX_LM_VERSIONS[1]:
        raise UserInputError(
            f"mlx-lazy works with mlx-lm >={lo},<{hi} but mlx-lm {installed} is installed; "
            f"run: pip install 'mlx-lm>={lo},<{hi}'"
        )


@lru_cache(maxsize=None)
def _installed_mlx_lm() -> str | None:
    try:
        return version("mlx-lm")
    except PackageNotFoundError:
        return None


class ModelAdapter:
    """Layer-level access to a Llama-family mlx-lm model.

    Args:
        model: a model returned by ``mlx_lm.load``.

    Raises:
        UserInputError: for model types other than :data:`SUPPORTED_MODEL_TYPES`, models
            with sliding-window layers, or an mlx-lm outside :data:`MLX_LM_VERSIONS`.
    """

    def __init__(self, model: nn.Module):
        check_mlx_lm_version()
        model_type = getattr(model, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UserInputError(
                f"unsupported model type {model_type!r}; mlx-lazy supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        self.model = model
        self.inner = model.model
        self.layers = list(self.inner.layers)
        if any(getattr(layer, "use_sliding", False) for layer in self.layers):
            raise UserInputError("sliding-window attention layers are not supported")
        attn = self.layers[0].self_attn
        self.n_heads: int = attn.n_heads
        self.n_kv_heads: int = attn.n_kv_heads
        self.scale: float = attn.scale
        self.lm_head = getattr(model, "lm_head", None)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def fingerprint(self) -> dict:
        """What a calibrated schedule or a prompt cache must match: the architecture, shapes
        and (by :meth:`weights_digest`) weights of the model."""
        args = self.model.args
        return {
            "model_type": self.model.model_type,
            "num_layers": self.num_layers,
            "hidden_size": int(args.hidden_size),
            "num_attention_heads": int(args.num_attention_heads),  # all ranks' heads
            "num_key_value_heads": int(args.num_key_value_heads),
            "vocab_size": int(args.vocab_size),
            "weights": self.weights_digest(),
        }

    def weights_digest(self) -> str:
        """A short digest of a few fixed tensors (the embedding's first rows, the last
        norm): tells apart models of the same shapes, e.g. Qwen2.5-Coder-0.5B from
        Qwen2.5-0.5B. Both tensors are whole on every rank of a sharded model."""
        digest = hashlib.sha256()
        for array in (self.inner.embed_tokens.weight[:16], self.inner.norm.weight):
            digest.update(np.array(array.astype(mx.float32)).tobytes())
        return digest.hexdigest()[:16]

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding table: valid token ids are 0 to vocab_size - 1."""
        return self.inner.embed_tokens.weight.shape[0]

    def embed(self, tokens: mx.array) -> mx.array:
        """(n,) token ids -> (1, n, D) hidden states."""
        return self.inner.embed_tokens(tokens[None])

    def logits(self, h: mx.array) -> mx.array:
        """Final norm and LM head on (1, n, D) hidden states."""
        h = self.inner.norm(h)
        if self.lm_head is None:
            return self.inner.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def qkv(self, layer: int, h: mx.array, positions: np.ndarray) -> Tuple[mx.array, ...]:
        """Queries, keys and values of ``h`` (1, n, D) at ``positions`` (n,), RoPE applied.

        Returns arrays shaped (1, heads, n, head_dim).
        """
        block = self.layers[layer]
        attn = block.self_attn
        x = block.input_layernorm(h)
        n = x.shape[1]
        q = attn.q_proj(x).reshape(1, n, self.n_heads, -1)
        k = attn.k_proj(x).reshape(1, n, self.n_kv_heads, -1)
        v = attn.v_proj(x).reshape(1, n, self.n_kv_heads, -1)
        if hasattr(attn, "q_norm"):  # qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        return _rope(attn.rope, q, positions), _rope(attn.rope, k, positions), v

    def finish(self, layer: int, h: mx.array, attn_out: mx.array) -> mx.array:
        """Output projection, residual and MLP: attention output (1, H, n, d) -> new h."""
        block = self.layers[layer]
        n = attn_out.shape[2]
        h = h + block.self_attn.o_proj(attn_out.transpose(0, 2, 1, 3).reshape(1, n, -1))
        return h + block.mlp(block.post_attention_layernorm(h))


def _rope(rope: nn.Module, x: mx.array, positions: np.ndarray) -> mx.array:
    start = int(positions[0])
    if positions[-1] - start == len(positions) - 1:  # contiguous (sorted, unique)
        return rope(x, offset=start)
    # mx.fast.rope takes one offset per batch row: move tokens onto the batch axis.
    offsets = mx.array(positions.astype(np.int32))
    return rope(x.transpose(2, 1, 0, 3), offset=offsets).transpose(2, 1, 0, 3)
