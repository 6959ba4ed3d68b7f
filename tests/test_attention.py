"""The CPU attention (polynomial exp2 fused by mx.compile) against mx.fast's attention."""

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlx_lazy import attention as A
from mlx_lazy import kernels as K
from numerics import rel_err

# The polynomial exp2 (5e-7 relative) and another summation order than mx.fast's; measured
# up to 3e-6 of the outputs' scale.
TOL = 1e-5


def _reference(q, k, v, scale, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


@pytest.mark.parametrize("n_heads,kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("n,s", [(1, 300), (37, 300), (256, 256)])
def test_attention_matches_mx_fast(n_heads, kv_heads, n, s):
    mx.random.seed(n * 7 + s + n_heads)
    q = mx.random.normal((1, n_heads, n, 32))
    k = mx.random.normal((1, kv_heads, s, 32))
    v = mx.random.normal((1, kv_heads, s, 32))
    ref = _reference(q, k, v, 0.3, "causal" if n > 1 else None)
    out = A.attention(q, k, v, 0.3, A.causal_mask(n, s) if n > 1 else None)
    assert rel_err(out, ref) < TOL
    out = A.attention(q, k, v, 0.3, "causal")
    assert rel_err(out, _reference(q, k, v, 0.3, "causal")) < TOL


def test_attention_with_arbitrary_mask_and_extreme_scores():
    mx.random.seed(1)
    q = mx.random.normal((1, 6, 5, 16)) * 8  # logits spread over hundreds: weights underflow
    k = mx.random.normal((1, 2, 200, 16)) * 8
    v = mx.random.normal((1, 2, 200, 16))
    mask = mx.array(np.random.default_rng(0).random((5, 200)) < 0.3)
    mask[:, 0] = True
    ref = _reference(q, k, v, 1.0, mask)
    out = A.attention(q, k, v, 1.0, mask)
    assert rel_err(out, ref) < TOL
    # A masked key with a huge score must not leak in.
    k_hot = mx.where(mx.arange(200)[None, None, :, None] == 199, 1e3, k)
    blocked = mx.array(np.arange(200) < 199)[None]
    out = A.attention(q[:, :, :1], k_hot, v, 1.0, blocked)
    ref = _reference(q[:, :, :1], k[:, :, :199], v[:, :, :199], 1.0, None)
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("implementation", A.IMPLEMENTATIONS)
@pytest.mark.parametrize("n", [1, 40])
def test_sinks_join_each_heads_softmax(monkeypatch, implementation, n):
    """gpt-oss's sinks: each head's softmax over [scores, sink], the sink's column dropped
    (a reference in numpy, float64), grouped heads and a mask; sinks both far above and
    below the scores, so the sink sets the row maximum in some heads."""
    monkeypatch.setenv(A.ENV_VAR, implementation)
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(shape).astype(np.float32)
               for shape in ((1, 6, n, 16), (1, 2, 90, 16), (1, 2, 90, 16)))
    sinks = np.array([-4.0, 0.0, 2.0, 9.0, 30.0, -30.0], np.float32)
    mask = rng.random((n, 90)) < 0.5
    mask[:, 0] = True
    out = A.attention(mx.array(q), mx.array(k), mx.array(v), 0.25, mx.array(mask),
                      sinks=mx.array(sinks))
    scores = np.einsum("hnd,hsd->hns", q[0], np.repeat(k[0], 3, axis=0)) * 0.25
    scores = np.where(mask, scores, -np.inf).astype(np.float64)
    full = np.concatenate([scores, np.broadcast_to(sinks[:, None, None], (6, n, 1))], -1)
    p = np.exp(full - full.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    ref = p[..., :-1] @ np.repeat(v[0], 3, axis=0)
    assert rel_err(out[0], ref) < TOL
    assert rel_err(out, A.attention(mx.array(q), mx.array(k), mx.array(v), 0.25,
                                    mx.array(mask))) > 0.01  # the sinks matter here


@pytest.mark.parametrize("implementation", A.IMPLEMENTATIONS)
@pytest.mark.parametrize("n", [1, 40])
def test_softcap_bends_each_logit_before_mask_and_softmax(monkeypatch, implementation, n):
    """Gemma 2's soft-capped attention: the softmax over c tanh(s / c) of the scaled logits
    s, far beyond the cap c here (a reference in numpy, float64), grouped heads and a mask;
    ``"causal"`` as its array. mx.fast cannot cap: both implementations compute it."""
    monkeypatch.setenv(A.ENV_VAR, implementation)
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal(shape).astype(np.float32)
               for shape in ((1, 6, n, 16), (1, 2, 90, 16), (1, 2, 90, 16)))
    mask = rng.random((n, 90)) < 0.5
    mask[:, 0] = True
    args = mx.array(q), mx.array(k), mx.array(v), 0.5
    out = A.attention(*args, mx.array(mask), softcap=3.0)
    logits = np.einsum("hnd,hsd->hns", q[0], np.repeat(k[0], 3, axis=0)) * 0.5
    assert np.abs(logits).max() > 2 * 3.0
    capped = np.where(mask, np.tanh(logits.astype(np.float64) / 3.0) * 3.0, -np.inf)
    p = np.exp(capped - capped.max(-1, keepdims=True))
    ref = (p / p.sum(-1, keepdims=True)) @ np.repeat(v[0], 3, axis=0)
    assert rel_err(out[0], ref) < TOL
    assert rel_err(out, A.attention(*args, mx.array(mask))) > 0.01  # the cap matters here
    causal = A.attention(*args, A.causal_mask(n, 90), softcap=3.0)
    assert rel_err(A.attention(*args, "causal", softcap=3.0), causal) < TOL


def test_fallback_without_compiled_kernels_matches(monkeypatch):
    monkeypatch.setattr(K, "_kernels", False)
    mx.random.seed(2)
    q, k, v = (mx.random.normal((1, 4, 20, 16)) for _ in range(3))
    out = A.attention(q, k, v, 0.25, A.causal_mask(20, 20))
    assert rel_err(out, _reference(q, k, v, 0.25, "causal")) < TOL


@pytest.mark.slow  # runs a process of its own
@pytest.mark.skipif(sys.platform != "linux", reason="glibc malloc tuning is Linux-only")
@pytest.mark.parametrize("env,expected", [({}, "True"), ({"MLX_LAZY_NO_MALLOPT": "1"}, "False")])
def test_malloc_tuning_on_import_and_opt_out(env, expected):
    code = "import mlx_lazy._malloc as m; print(m.tuned)"
    base = {k: v for k, v in os.environ.items() if k != "MLX_LAZY_NO_MALLOPT"}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env},
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected


@pytest.mark.parametrize("softcap", [None, 1.5])
def test_attention_weights_match_softmax_grouped_by_key_head(softcap):
    """What the scorers see: the softmax of the logits, soft-capped (Gemma 2) when the layer
    has a cap, as the model attends."""
    mx.random.seed(3)
    q, k = mx.random.normal((1, 6, 4, 16)), mx.random.normal((1, 2, 50, 16))
    mask = mx.array(np.random.default_rng(1).random((4, 50)) < 0.5)
    mask[:, 3] = True
    weights, total = A.attention_weights(q, k, 0.5, mask,  # (1, 2, 3, 4, 50), (..., 1)
                                         softcap=softcap)
    probs = weights / total
    logits = (q.reshape(1, 2, 3, 4, 16) * 0.5) @ k[:, :, None].swapaxes(-1, -2)
    if softcap:
        assert float(mx.abs(logits).max()) > 2 * softcap  # the cap bends these logits
        logits = mx.tanh(logits / softcap) * softcap
    ref = mx.softmax(mx.where(mask, logits, -mx.inf), axis=-1, precise=True)
    assert probs.shape == (1, 2, 3, 4, 50)
    assert rel_err(probs, ref) < TOL


@pytest.mark.parametrize("n,s,mask_kind", [(5, 300, "random"), (3, 10, None), (17, 257, "keys"),
                                           (64, 512, "random"), (17, 257, "heads")])
def test_padded_attention_matches_unpadded(n, s, mask_kind):
    # CUDA's shape buckets: padded keys masked out, padded rows dropped; the same sums plus
    # exact zeros, so within the summation-order tolerance of mx.fast itself.
    mx.random.seed(n + s)
    q = mx.random.normal((1, 9, n, 16))
    k, v = mx.random.normal((1, 3, s, 16)), mx.random.normal((1, 3, s, 16))
    rng = np.random.default_rng(n)
    mask = {None: None,
            "random": mx.array(rng.random((n, s)) < 0.4) | (mx.arange(s) == 0),
            "keys": mx.array(rng.random(s) < 0.5) | (mx.arange(s) == 1),
            # a mask per head (Phi-3-small's block-sparse layers)
            "heads": mx.array(rng.random((9, n, s)) < 0.4) | (mx.arange(s) == 0)}[mask_kind]
    out = A.padded_attention(q, k, v, 0.3, mask)
    assert out.shape == (1, 9, n, 16)
    assert rel_err(out, _reference(q, k, v, 0.3, mask)) < TOL


def test_engine_with_padded_shapes_matches(tiny_model, monkeypatch):
    """Prefill, completion blocks and revived rows through the padded calls give the same
    logits as unpadded ones (the GPU branch, here on mx.fast's CPU fallback)."""
    from mlx_lazy import LazyEngine, PruningConfig, resolve_config
    model, _ = tiny_model("llama")
    monkeypatch.setenv(A.ENV_VAR, "fast")
    prompt = mx.array(np.random.default_rng(5).integers(0, model.args.vocab_size, 300)
                      .astype(np.int32))
    padded_calls = []
    padded = A.padded_attention
    monkeypatch.setattr(A, "padded_attention",
                        lambda q, *rest: padded_calls.append(q.shape[2]) or padded(q, *rest))
    logits = {}
    for pad in (False, True):
        monkeypatch.setattr(A, "PAD_SHAPES", pad)
        for complete in ("none", "after-first"):
            engine = LazyEngine(model, resolve_config(model, PruningConfig(
                "lazy", prune_layers=(0, 1), keep=(0.5, 0.2), complete=complete)))
            out = [engine.prefill(prompt)]
            for _ in range(8):
                out.append(engine.decode(int(mx.argmax(out[-1]))))
            logits[pad, complete] = mx.stack(out)
            if complete == "none":
                assert engine.stats.revivals > 0
        # Only with padding on, and on calls of several rows some of which need padding.
        assert (len(padded_calls) > 0) == pad and all(n > 1 for n in padded_calls)
        assert not pad or any(n & (n - 1) for n in padded_calls)
    for complete in ("none", "after-first"):
        assert rel_err(logits[True, complete], logits[False, complete]) < TOL
