"""Gemma 3 (``gemma3_text``, and the text model of a ``gemma3`` checkpoint) through the
engine: unpruned against mlx-lm's own forward pass, and sliding-window layers under pruning
against a dense reference that masks by original positions."""

from __future__ import annotations

import mlx_lazy  # noqa: F401  (OpenBLAS before mlx)

from dataclasses import asdict

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models import gemma3

from mlx_lazy import LazyEngine, PruningConfig, resolve_config
from mlx_lazy.adapter import ModelAdapter
from mlx_lazy.attention import position_mask
from numerics import max_rel_err, rel_err
from test_engine import greedy_pair, mlx_lm_error, random_prompt, revival_case

# The engine and mlx-lm add the same float32 terms in another order (query blocks, a fused
# exp2, gathered keys) through four layers whose (1 + w) norms and sqrt(hidden)-scaled
# embeddings keep values O(1): a few ulps of the largest logits, as for the other families.
LOGITS_TOL = 1e-5
WINDOW = 24  # tests/tiny_models.py's sliding window


# Every test runs with both attention implementations (conftest's attention_implementation).
pytestmark = pytest.mark.usefixtures("attention_implementation")


@pytest.fixture(scope="module")
def gemma(tiny_model):
    return tiny_model("gemma3_text")[0]


def test_the_tiny_gemma3_is_what_it_claims(gemma):
    """Sliding layers 0 and 2 (window 24), global 1 and 3, q/k norms, a tied head."""
    a = ModelAdapter(gemma)
    assert [a.sliding_window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    assert a.lm_head is None and hasattr(gemma.layers[0].self_attn, "q_norm")
    assert a.scale == pytest.approx(24 ** -0.5)


@pytest.mark.parametrize("n, block_size", [(300, 64), (300, 256), (130, 64)])
def test_gemma3_unpruned_matches_mlx_lm(gemma, n, block_size):
    """300 tokens, far past the window: mlx-lm's rotating caches against the engine's masks
    by position (64: first-chunk blocks that start inside the window; 130: a last block of
    two rows past the window, whose mask a shortcut for one row once skipped)."""
    prompt = random_prompt(n, gemma.args.vocab_size)
    assert mlx_lm_error(gemma, PruningConfig("full"), prompt, 32,
                        block_size=block_size) < LOGITS_TOL


def test_gemma3_nothing_pruned_by_a_cut_matches_mlx_lm(gemma):
    prompt = random_prompt(200, gemma.args.vocab_size, seed=4)
    config = PruningConfig("lazy", prune_layers=(1,), keep=(1.0,))
    assert mlx_lm_error(gemma, config, prompt, 8) < LOGITS_TOL


def test_gemma3_checkpoint_text_model_matches_mlx_lm(gemma):
    """A ``gemma3`` (multimodal) checkpoint: the adapter runs its ``language_model``."""
    args = gemma3.ModelArgs(model_type="gemma3", text_config=asdict(gemma.args),
                            vocab_size=gemma.args.vocab_size)
    wrapped = gemma3.Model(args)
    wrapped.language_model = gemma
    prompt = random_prompt(120, gemma.args.vocab_size, seed=5)
    engine = LazyEngine(wrapped, resolve_config(wrapped, PruningConfig("full")))
    assert max_rel_err(greedy_pair(wrapped, engine, prompt, 4)) < LOGITS_TOL


# ------------------------------------------------------------- dense reference
def _dense_logits(model, tokens: np.ndarray, masks) -> mx.array:
    """mlx-lm's own blocks over every token, dense, with a (n, n) boolean mask per layer;
    the last token's logits."""
    inner = model.model
    h = inner.embed_tokens(mx.array(tokens)[None])
    h = h * mx.array(model.args.hidden_size ** 0.5, mx.bfloat16).astype(h.dtype)
    for block, mask in zip(inner.layers, masks):
        h = block(h, mx.array(mask), None)
    return inner.embed_tokens.as_linear(inner.norm(h))[0, -1]


def _window_of(model, layer):
    return ModelAdapter(model).sliding_window(layer)


def dense_mask(n, window, sees):
    """Causal (and windowed) by position, each query ``i`` restricted to keys ``sees[i]``
    (a boolean row; None: all); a block-sparse layer's per head."""
    pos = np.arange(n)
    mask = position_mask(pos, pos, window)
    for i, row in enumerate(sees):
        if row is not None:
            mask[..., i, :] &= row
        mask[..., i, i] = True  # rows the engine never computes: anything that attends to a key
    return mask


def cut_after_layer_0(model, vocab_size: int, monkeypatch, revival_block: int):
    """A cut after layer 0 keeping 40% of a 160-token random prompt, the engine's selections
    recorded (``revival_block`` 2 sends a decode step's rows through the gathered block path,
    64 through the masked whole-cache path): (engine, prompt, prefill logits, the tokens kept
    above the cut, selections)."""
    n = 160
    prompt = np.asarray(random_prompt(n, vocab_size, seed=7))
    config = PruningConfig("lazy", prune_layers=(0,), keep=(0.4,), complete="none")
    engine = LazyEngine(model, resolve_config(model, config), block_size=32)
    engine.attention.revival_block = revival_block
    selections = []
    advance = engine._advance

    def spy(layer, h, comp, selected):
        selections.append(np.array(selected))
        return advance(layer, h, comp, selected)

    monkeypatch.setattr(engine, "_advance", spy)
    logits = engine.prefill(mx.array(prompt))
    kept = engine.cache.computed[1, :n].astype(bool)
    assert 0 < kept.sum() < n
    return engine, prompt, logits, kept, selections


def decode_one(engine, prompt, logits, kept, selections):
    """One greedy decode step after :func:`cut_after_layer_0`: (the tokens, its logits, this
    step's selection above the cut, what each token sees there: the prefill's kept tokens
    their kept keys, a revived token and the new one the selection, a pruned token None; the
    revived positions)."""
    n = len(prompt)
    token = int(mx.argmax(logits))
    before = engine.cache.computed[1, :n].astype(bool).copy()
    logits = engine.decode(token)
    selected = np.zeros(n + 1, bool)
    selected[selections[-1]] = True
    revived = np.flatnonzero(engine.cache.computed[1, :n].astype(bool) & ~before)
    old = np.append(kept, False)
    sees = [old if old[i] else (selected if selected[i] else None) for i in range(n + 1)]
    return np.append(prompt, token), logits, selected, sees, revived


@pytest.mark.parametrize("revival_block", [64, 2])
def test_sliding_window_under_pruning_equals_a_dense_reference(gemma, monkeypatch,
                                                               revival_block):
    """A cut after layer 0 keeps 40%; a decode step re-selects and revives tokens. Against
    mlx-lm's blocks run densely with masks by original position: the prefill's kept tokens
    see only kept keys inside their window (tokens pruned inside a window do not let it
    reach further back), a revived token sees exactly this step's selection inside its
    window, the new token too. ``revival_block`` 2 sends the decode step's rows through the
    gathered block path, 64 through the masked whole-cache path."""
    engine, prompt, logits, kept, selections = cut_after_layer_0(
        gemma, gemma.args.vocab_size, monkeypatch, revival_block)
    n = len(prompt)
    L = gemma.args.num_hidden_layers
    windows = [_window_of(gemma, layer) for layer in range(L)]
    masks = [dense_mask(n, windows[0], [None] * n)]
    masks += [dense_mask(n, windows[layer], [kept] * n) for layer in range(1, L)]
    assert rel_err(logits, _dense_logits(gemma, prompt, masks)) < LOGITS_TOL
    # the last token's window holds tokens pruned at layer 0: a window counted among the
    # kept tokens would reach kept tokens before it
    assert not kept[n - WINDOW:].all() and kept[: n - WINDOW].any()

    tokens, logits, selected, sees, revived = decode_one(engine, prompt, logits, kept,
                                                         selections)
    assert engine.stats.revivals > 0 and len(revived)
    # a revived token with a token pruned inside its window, and one kept before it
    assert any((~selected[max(0, r - WINDOW + 1):r]).any() and selected[: r - WINDOW + 1].any()
               for r in revived)
    masks = [dense_mask(n + 1, windows[0], [None] * (n + 1))]
    masks += [dense_mask(n + 1, windows[layer], sees) for layer in range(1, L)]
    assert rel_err(logits, _dense_logits(gemma, tokens, masks)) < LOGITS_TOL


def test_window_masks_of_each_attention_path_against_numpy(gemma):
    """The three attention paths of a sliding layer against a direct numpy softmax over the
    keys inside each row's window of original positions: block-causal over the buffers (a
    first chunk with gaps, as random drop leaves), gathered blocks (revived rows) and the
    masked whole cache, with host and device visibility."""
    engine, kv, selected, rows, q, rng = revival_case(gemma, layer=0, block_size=8)
    heads, d = engine.adapter.n_heads, kv.keys.shape[-1]
    gathered = np.array(engine.attention.revived(q, kv, rows, selected, window=WINDOW))
    all_keys, all_values = kv.fetch()
    kpos = kv.cached_positions()
    visible = np.isin(kpos, selected)
    masked = np.array(engine.attention.over_cache(q, all_keys, all_values, rows, kpos, visible,
                                                       window=WINDOW))
    on_device = np.array(engine.attention.over_cache(q, all_keys, all_values, rows, kpos,
                                                          mx.array(visible), window=WINDOW))
    keys, values = (np.array(a) for a in kv.fetch(selected))
    qs = mx.array(rng.standard_normal((1, heads, len(selected), d)).astype(np.float32))
    blocked = np.array(engine.attention.blocked(qs, mx.array(keys), mx.array(values), False,
                                                    selected, WINDOW))
    rep = heads // keys.shape[1]

    def reference(qrow, pos, h):
        seen = (selected <= pos) & (selected > pos - WINDOW)
        logits = keys[0, h // rep, seen] @ qrow * engine.adapter.scale
        w = np.exp(logits - logits.max())
        return (w / w.sum()) @ values[0, h // rep, seen]

    for h in range(heads):
        for r, pos in enumerate(rows):
            ref = reference(np.array(q[0, h, r]), pos, h)
            for got in (gathered, masked, on_device):
                assert rel_err(got[0, h, r], ref) < 1e-5
        for r, pos in enumerate(selected):
            assert rel_err(blocked[0, h, r], reference(np.array(qs[0, h, r]), pos, h)) < 1e-5


def test_position_mask():
    q, k = np.array([3, 10, 11]), np.array([0, 3, 8, 9, 11, 12])
    assert position_mask(q, k).tolist() == [
        [True, True, False, False, False, False],
        [True, True, True, True, False, False],
        [True, True, True, True, True, False]]
    # window 3: keys q-2 .. q, whoever else is missing
    assert position_mask(q, k, 3).tolist() == [
        [False, True, False, False, False, False],
        [False, False, True, True, False, False],
        [False, False, False, True, True, False]]


# --------------------------------------------------- prompt cache, server, tensor parallel
def test_gemma3_prompt_cache_save_and_load(tiny_model, tmp_path):
    """A pruned Gemma 3 state (tokens waiting in the Aux Cache) saved and loaded: the next
    chunk's logits are identical, and the loaded state matches the same model only."""
    from mlx_lazy import load_prompt_cache, make_prompt_cache, save_prompt_cache

    model = tiny_model("gemma3_text")[0]
    config = PruningConfig("lazy", prune_layers=(0, 2), keep=(0.5, 0.2), complete="none")
    cache = make_prompt_cache(model, config)
    cache.process(np.asarray(random_prompt(150, model.args.vocab_size, seed=8)).tolist())
    assert cache.engine.cache.aux
    path = tmp_path / "gemma.safetensors"
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path, model)
    more = np.asarray(random_prompt(30, model.args.vocab_size, seed=9)).tolist()
    np.testing.assert_array_equal(np.array(cache.process(more)), np.array(loaded.process(more)))
    with pytest.raises(mlx_lazy.UserInputError):
        load_prompt_cache(path, tiny_model("llama")[0])


@pytest.mark.parametrize("attention_implementation", ["set-in-test"])
def test_gemma3_server_equals_in_process(tiny_model, tiny_model_dir, tmp_path):
    """The HTTP server on a Gemma 3 folder: a pruned chat request answers as in-process."""
    from test_server import LONG_TEXT, chat_prompt, expected, run_server

    folder = tiny_model_dir("gemma3_text")
    messages = [{"role": "user", "content": LONG_TEXT + "What is the passkey?"}]
    prompt = chat_prompt(tiny_model("gemma3_text")[1], messages)
    spec = {"method": "lazy", "prune_layers": [0], "keep": [0.3]}
    with run_server(folder, tmp_path=tmp_path) as server:
        r = server.client().chat.completions.create(model="any", messages=messages,
                                                    max_tokens=6, extra_body={"pruning": spec})
    want = expected(tiny_model("gemma3_text"), prompt, max_tokens=6,
                    config=PruningConfig.preset("lazy", prune_layers=(0,), keep=(0.3,)))
    assert r.choices[0].message.content == want
    assert r.usage.model_extra["pruning"]["method"] == "lazy"


# ------------------------------------------------------------------ the real Gemma 3 270M
@pytest.fixture(scope="module")
def gemma3_270m():
    from mlx_lazy import models

    return mlx_lm.load(str(models.model_path("gemma3-270m")))


@pytest.mark.slow
@pytest.mark.parametrize("attention_implementation", ["set-in-test"])
def test_gemma3_270m_unpruned_matches_mlx_lm(gemma3_270m):
    """The real model (PyPI chunks -> GGUF -> MLX float32) over 700 tokens, past its
    512-token window: the engine's masks by position against mlx-lm's rotating caches.
    Measured 3.9e-6 of the logits' scale; mlx-lm's own logits move by 1.2e-6 when its input
    embeddings move by 1e-7 (relative) on this prompt. (On repetitive text past the window
    the model is ill-conditioned: the same 1e-7 moves mlx-lm's logits by up to 3e-4, and the
    engine's float32 sums in another order by as much; so random tokens here.)"""
    model, _ = gemma3_270m
    assert ModelAdapter(model).sliding_window(0) == 512
    rng = np.random.default_rng(0)
    prompt = mx.array([2] + rng.integers(1000, 200000, 699).tolist())  # <bos>, then words
    assert mlx_lm_error(model, PruningConfig("full"), prompt, 8) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("attention_implementation", ["set-in-test"])
def test_gemma3_270m_perplexity_and_norm_convention(gemma3_270m):
    """Norms converted as w (llama.cpp stores 1 + w): English at a base model's perplexity;
    leaving llama.cpp's 1 + w in place (mlx-lm adds another 1) makes it far worse."""
    import mlx.nn as nn

    from test_convert import PARAGRAPH

    model, tokenizer = gemma3_270m
    ids = mx.array(tokenizer.encode(PARAGRAPH))[None]

    def perplexity():
        logits = model(ids[:, :-1]).astype(mx.float32)
        return mx.exp(nn.losses.cross_entropy(logits, ids[:, 1:]).mean()).item()

    ppl = perplexity()
    assert ppl < 20, ppl
    norms = [(block, name, getattr(block, name).weight) for block in model.layers
             for name in ("input_layernorm", "post_attention_layernorm",
                          "pre_feedforward_layernorm", "post_feedforward_layernorm")]
    try:
        for block, name, w in norms:
            getattr(block, name).weight = w + 1.0
        wrong = perplexity()
    finally:
        for block, name, w in norms:
            getattr(block, name).weight = w
    assert wrong > 3 * ppl, (ppl, wrong)
    assert tokenizer.decode(tokenizer.encode(PARAGRAPH)[1:]) == PARAGRAPH
