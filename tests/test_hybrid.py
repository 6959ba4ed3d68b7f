"""Qwen3.5's and Qwen3-Next's hybrid layout through the engine (``qwen3_5``, ``qwen3_next``:
three Gated DeltaNet layers, recurrent, to one of gated full attention), LFM2's (``lfm2``,
``lfm2_moe``: short gated convolutions, recurrent, and attention), Granite 4.0's
(``granitemoehybrid``: Mamba-2 layers, recurrent, and attention) and Nemotron-H's
(``nemotron_h``: Mamba-2, attention, MLP and MoE layers) and Jamba's (``jamba``: Mamba layers,
recurrent, attention, MoE every other layer) and Ling 2.5's (``bailing_moe_v3``: Kimi
Delta Attention layers, recurrent, gated latent attention, MoE): unpruned equal to
mlx-lm, in one prompt or in turns; pruning, which a recurrent layer allows only without
revival, equal to a reference built from mlx-lm's own layers; interrupts, prompt caches and
what a hybrid refuses."""

from __future__ import annotations

import json

import mlx_lazy  # noqa: F401  (OpenBLAS before mlx)

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import ArraysCache, make_prompt_cache
from mlx_lm.models.kimi_k3 import ResidualBlocks, _attn_res_mix

from mlx_lazy import (LazyEngine, PruningConfig, UserInputError, build_schedule,
                      can_trim_prompt_cache, generate_step, load_prompt_cache,
                      make_prompt_cache as make_lazy_cache, resolve_config, save_prompt_cache,
                      trim_prompt_cache)
from mlx_lazy.adapter import (ModelAdapter, attention_module, global_layers, identities_match,
                              recurrent_layers, stateless_layers)
from numerics import rel_err
from test_engine import LOGITS_TOL, mlx_lm_error, random_prompt
from test_prompt_cache import same_state
from tiny_models import build_tiny_model

#: Qwen3.5 and Qwen3-Next, the same hybrid layout (Qwen3-Next's fuses the recurrent layers'
#: projections and puts MoE blocks in), and LFM2 (convolutions for recurrent layers) in the
#: same places, each through every test of the ``hybrid`` fixtures; Granite 4.0 H's too (Mamba-2
#: layers for recurrent ones, attention without RoPE, Granite's multipliers, shared experts) and
#: Nemotron-H's (a mixer a layer: Mamba-2, attention, or an MLP or experts, stateless) and
#: Jamba's (Mamba layers for recurrent ones, attention without RoPE, experts every other layer)
#: and Ling 2.5's (Kimi Delta Attention for recurrent ones, gated latent attention, experts)
#: and Kimi Linear's (the same, its latent attention without RoPE or gate) and OLMo Hybrid's
#: (Gated DeltaNet for recurrent ones, OLMo 3's post-norm attention) and Ring-linear's and Ling
#: 2.5 linear's (lightning attention for recurrent ones, Ling's attention or latent attention)
#: and Kimi K3's (Kimi Linear's, with attention residuals: each token's blocks carried).
KINDS = ("qwen3_5", "qwen3_next", "lfm2", "granitemoehybrid", "nemotron_h", "jamba",
         "bailing_moe_v3", "olmo_hybrid", "kimi_linear", "bailing_moe_linear", "bailing_hybrid",
         "kimi_k3")
STATIC = PruningConfig("static", prune_layers=(3,), keep=(0.3,))
NO_REVIVAL = PruningConfig("lazy", prune_layers=(3,), keep=(0.3,), revive=False)

# Every test runs with the GPU's attention implementation (conftest's attention_implementation):
# the implementations differ only in attention() itself, whose windows, sinks and narrower
# values test_families' ATTENTION_FEATURED families run with both.
pytestmark = [pytest.mark.usefixtures("attention_implementation"),
              pytest.mark.parametrize("attention_implementation", ["fast"], indirect=True)]


@pytest.fixture(scope="module", params=KINDS)
def hybrid_dir(request, tmp_path_factory):
    return build_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def hybrid(hybrid_dir):
    return mlx_lm.load(str(hybrid_dir))


def greedy(engine, prompt, steps):
    """The engine's greedy tokens and logits after ``prompt``."""
    logits = [engine.prefill(prompt)]
    tokens = [int(mx.argmax(logits[-1]))]
    for _ in range(steps):
        logits.append(engine.decode(tokens[-1]))
        tokens.append(int(mx.argmax(logits[-1])))
    return tokens, logits


def test_the_tiny_hybrid_is_what_it_claims(hybrid):
    """Layers 3 and 7 attend, the others are recurrent; Qwen's q_proj gives a gate beside the
    queries, its RoPE turns half of each head; LFM2's recurrent layers are convolutions over
    3 tokens (a state of 2), its attention has per-head q/k norms and RoPE over whole heads;
    Granite 4.0's are Mamba-2 layers (a convolution over 4 tokens, 8 heads in 2 groups), its
    attention has no RoPE, its experts a shared MLP beside them; Nemotron-H's are Mamba-2
    layers, experts in layer 1 and an MLP in 6 (layers of their own without state, which take
    any tokens), its attention
    has no RoPE; Jamba's are Mamba layers (a convolution over 4 tokens, a state of 16), its
    attention has no RoPE, its odd layers experts; Ling 2.5's are Kimi Delta Attention layers
    (convolutions over 4 tokens), its attention absorbed latent attention with traditional RoPE
    and a gate per head, its layers from 1 on experts; Kimi Linear's are Kimi Delta Attention
    layers, its attention absorbed latent attention without RoPE, its layers from 1 on experts;
    Kimi K3's too, its latent attention with low-rank queries and a full-width gate, its
    experts on a normed latent, its SiTU's betas its config's, its residual blocks starting at
    layers 0, 3 and 6;
    OLMo Hybrid's are Gated DeltaNet layers, its attention has no norm before it, one after it
    and q/k norms over all heads; Ring-linear's and Ling 2.5 linear's are lightning attention
    layers (RoPE over half of each head, a decay per head), their attention Ling's (fused
    q/k/v) or absorbed latent attention."""
    model, _ = hybrid
    nemotron_h = model.model_type == "nemotron_h"  # its MLP layers 1 and 6 stateless
    assert recurrent_layers(model) == ((0, 2, 4, 5) if nemotron_h else (0, 1, 2, 4, 5, 6))
    assert stateless_layers(model) == ((1, 6) if nemotron_h else ())
    assert global_layers(model) == (3,)  # a cut may follow an attention layer, not the last
    attn = attention_module(model.layers[3])
    if model.model_type == "jamba":
        mamba = model.layers[0].mamba
        assert (mamba.conv_kernel_size, mamba.ssm_state_size) == (4, 16)
        assert not hasattr(attn, "rope") and "switch_mlp" in model.layers[3].feed_forward
        assert "switch_mlp" not in model.layers[2].feed_forward
    elif model.model_type == "bailing_moe_v3":
        assert model.layers[0].attention.conv_kernel_size == 4 and hasattr(attn, "embed_q")
        assert attn.g_proj.weight.shape[0] == attn.num_heads and attn.rope.traditional
        assert "switch_mlp" in model.layers[1].mlp and "switch_mlp" not in model.layers[0].mlp
    elif model.model_type == "kimi_linear":
        assert model.layers[0].self_attn.conv_kernel == 4 and hasattr(attn, "embed_q")
        assert "rope" not in attn and "switch_mlp" in model.layers[1].mlp
    elif model.model_type == "kimi_k3":
        assert model.layers[0].self_attn.conv_kernel == 4 and "rope" not in attn
        assert "q_a_proj" in attn and attn.g_proj.weight.shape[0] == 4 * attn.v_head_dim
        moe = model.layers[1].mlp
        assert "switch_mlp" in moe and moe.routed_expert_norm.weight.shape == (32,)
        assert (model.layers[0].mlp.beta, moe.switch_mlp.activation.linear_beta) == (2.0, 3.0)
        assert [layer.is_block_start for layer in model.layers] == [i % 3 == 0 for i in range(8)]
    elif model.model_type == "olmo_hybrid":
        assert "linear_attn" in model.layers[0] and "input_layernorm" not in model.layers[3]
        assert attn.q_norm.weight.shape[0] == attn.num_attention_heads * attn.head_dim
    elif model.model_type in ("bailing_moe_linear", "bailing_hybrid"):
        lightning = model.layers[0].attention
        assert lightning._slope.shape == (4,) and lightning.rope.dims == 8
        assert ("embed_q" in attn) == (model.model_type == "bailing_hybrid")
    elif model.model_type == "nemotron_h":
        assert "".join(layer.block_type for layer in model.layers) == "MEM*MM-*"
        assert not hasattr(attn, "rope") and model.layers[0].mixer.n_groups == 2
    elif model.model_type == "granitemoehybrid":
        mamba = model.layers[0].mamba
        assert (mamba.conv_kernel_size, mamba.num_heads, mamba.n_groups) == (4, 8, 2)
        assert attn.rope is None and "shared_mlp" in model.layers[3]
    elif model.model_type == "lfm2":
        assert model.layers[0].conv.L_cache == 3 and not hasattr(model.layers[3], "conv")
        assert attn.q_layernorm.weight.shape == (attn.head_dim,) and attn.rope.dims == 16
    else:
        assert attn.q_proj.weight.shape[0] == 2 * attn.num_attention_heads * attn.head_dim
        assert attn.rope.dims == attn.head_dim // 2


def test_unpruned_matches_mlx_lm(hybrid, monkeypatch):
    model, _ = hybrid
    prompt = random_prompt(300, ModelAdapter(model).vocab_size)
    monkeypatch.setattr(LazyEngine, "finish_rows", 64)  # a layer's output in row blocks
    assert mlx_lm_error(model, PruningConfig("full"), prompt, 32, block_size=64) < LOGITS_TOL


def test_nothing_pruned_by_a_cut_matches_mlx_lm(hybrid):
    """A static cut after the attention layer keeping every token: the recurrent layers
    above take the whole prompt, as mlx-lm's do."""
    model, _ = hybrid
    prompt = random_prompt(150, ModelAdapter(model).vocab_size, seed=11)
    nothing_pruned = PruningConfig("static", prune_layers=(3,), keep=(1.0,))
    assert mlx_lm_error(model, nothing_pruned, prompt, 8) < LOGITS_TOL


@pytest.mark.parametrize("kind", ["qwen3_5-moe", "lfm2-vl", "prism_hadamard_qwen35",
                                  "kimi_k3-plain"])
def test_the_moe_layout_matches_mlx_lm(tmp_path, kind):
    """``qwen3_5_moe``: its sparse MoE block (2 of 4 experts and a shared one) is the MLP;
    ``lfm2-vl`` (LFM2-VL): LFM2 as the text model of a vision-language checkpoint;
    ``prism_hadamard_qwen35``: Qwen3.5's with 2-bit packed linears, embedding and head that
    rotate their inputs (blocks of 512) or not; ``kimi_k3-plain``: Kimi K3's without attention
    residuals, output gate or low-rank queries; unpruned and through a cut that keeps every
    token (those three)."""
    model, _ = mlx_lm.load(str(build_tiny_model(kind, tmp_path)))
    prompt = random_prompt(200, ModelAdapter(model).vocab_size, seed=8)
    assert mlx_lm_error(model, PruningConfig("full"), prompt, 16) < LOGITS_TOL
    if kind != "qwen3_5-moe":
        nothing_pruned = PruningConfig("static", prune_layers=(3,), keep=(1.0,))
        assert mlx_lm_error(model, nothing_pruned, prompt, 8) < LOGITS_TOL
    if kind == "lfm2-vl":
        assert model.model_type == "lfm2-vl" and "conv" in model.layers[0]
    elif kind == "prism_hadamard_qwen35":
        blocks = [m.block for _, m in model.named_modules() if hasattr(m, "signs")]
        assert type(ModelAdapter(model)._embedding).__name__ == "HadamardQuantizedEmbedding"
        assert len(blocks) == 2 + 2 * 8 and set(blocks) == {512}
        assert ModelAdapter(model).variant() == "float32+q2g128"
    elif kind == "kimi_k3-plain":
        attn = model.layers[3].self_attn
        assert not model.layers[0].use_attn_res and "q_proj" in attn and "g_proj" not in attn
    else:
        assert model.model_type == "qwen3_5_moe" and hasattr(model.layers[0].mlp, "shared_expert")
    engine = LazyEngine(model, resolve_config(model, NO_REVIVAL))
    greedy(engine, prompt, 8)
    assert engine.stats.prefill_tokens_per_layer == [200] * 4 + [60] * 4


def assert_saves_loads_and_quantizes(model, cache, nothing_pruned: PruningConfig,
                                     prompt: np.ndarray, tmp_path) -> None:
    """``cache`` (a prompt processed) saves and loads, a turn after it answering alike; then a
    4-bit copy of ``model`` under ``nothing_pruned`` is mlx-lm's."""
    save_prompt_cache(tmp_path / "c.safetensors", cache)
    loaded = load_prompt_cache(tmp_path / "c.safetensors", model)
    turn = random_prompt(20, ModelAdapter(model).vocab_size, seed=9).tolist()
    assert rel_err(loaded.process(turn), cache.process(turn)) == 0
    nn.quantize(model, group_size=32, bits=4)
    assert mlx_lm_error(model, nothing_pruned, prompt, 4) < LOGITS_TOL


def test_the_lfm2_moe_layout_matches_mlx_lm_and_a_reference(tmp_path):
    """``lfm2_moe`` (LFM2-8B-A1B's layout): attention in layers 2 and 4 of 6, the top layer
    a convolution, dense feed-forward in layers 0 and 1, then sparse MoE. Unpruned and with
    nothing pruned equal to mlx-lm; a static cut after layer 2 keeps the tokens and gives
    the logits of mlx-lm's own layers; its prompt cache saves and loads; a 4-bit copy (its
    experts and router quantized) with nothing pruned is mlx-lm's."""
    model, _ = mlx_lm.load(str(build_tiny_model("lfm2_moe", tmp_path / "model")))
    assert recurrent_layers(model) == (0, 1, 3, 5) and global_layers(model) == (2, 4)
    ffn = [layer.feed_forward for layer in model.layers]
    assert hasattr(ffn[1], "down_proj") and hasattr(ffn[2], "switch_mlp")
    prompt = random_prompt(200, ModelAdapter(model).vocab_size, seed=8)
    assert mlx_lm_error(model, PruningConfig("full"), prompt, 16) < LOGITS_TOL
    nothing_pruned = PruningConfig("static", prune_layers=(2,), keep=(1.0,))
    assert mlx_lm_error(model, nothing_pruned, prompt, 4) < LOGITS_TOL
    kept, want = reference_static(model, prompt, 0.3, 8, cut=2)
    static = PruningConfig("static", prune_layers=(2,), keep=(0.3,))
    engine = LazyEngine(model, resolve_config(model, static))
    _, got = greedy(engine, prompt, 8)
    assert np.array_equal(np.flatnonzero(engine.cache.depth[:200] > 3), kept)
    assert max(rel_err(a, b) for a, b in zip(got, want)) < LOGITS_TOL

    cache = make_lazy_cache(model, static)
    cache.process(prompt.tolist())
    assert_saves_loads_and_quantizes(model, cache, nothing_pruned, prompt, tmp_path)


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the kernel runs on the CPU only")
def test_lfm2s_feed_forward_takes_its_activation_from_the_cpu_kernel(tmp_path, monkeypatch):
    """LFM2's dense SwiGLU (w1 the gate, w3 up, w2 down) runs as other families' dense MLPs
    do on the CPU, its activation from kernels.gated: in every layer, mlx-lm's logits."""
    from mlx_lazy import kernels

    model, _ = mlx_lm.load(str(build_tiny_model("lfm2", tmp_path)))
    calls, gated = [], kernels.gated
    monkeypatch.setattr(kernels, "gated", lambda *args: calls.append(args[2]) or gated(*args))
    prompt = random_prompt(50, ModelAdapter(model).vocab_size, seed=10)
    assert mlx_lm_error(model, PruningConfig("full"), prompt, 2) < LOGITS_TOL
    assert set(calls) == {"silu"} and len(calls) == 8 * 3  # the prompt, then 2 steps


def test_a_quantized_copy_matches_mlx_lm_and_keeps_its_identity(hybrid_dir):
    model, _ = mlx_lm.load(str(hybrid_dir))
    base = ModelAdapter(model).identity()
    nn.quantize(model, group_size=32, bits=4,  # (not Kimi K3's 1-wide res_proj: mlx-lm's nor)
                class_predicate=lambda path, m: hasattr(m, "to_quantized")
                and not path.endswith("res_proj"))
    assert identities_match(base, ModelAdapter(model).identity())
    prompt = random_prompt(100, ModelAdapter(model).vocab_size, seed=2)
    nothing_pruned = PruningConfig("lazy", prune_layers=(3,), keep=(1.0,), revive=False)
    assert mlx_lm_error(model, nothing_pruned, prompt, 4) < LOGITS_TOL


def test_a_prompt_in_turns_matches_mlx_lm(hybrid):
    """Chunks on top of the state (turns of a chat) carry the recurrent states on; a chunk
    of 37 tokens, which the CPU's float32 matmuls pad to 48 rows, feeds the states its own
    37 only."""
    model, _ = hybrid
    prompt = random_prompt(300, ModelAdapter(model).vocab_size, seed=1)
    ref = model(prompt[None], cache=make_prompt_cache(model))[0, -1]
    engine = LazyEngine(model)
    engine.prefill(prompt[:100])
    engine.extend(prompt[100:137])
    assert rel_err(engine.extend(prompt[137:]), ref) < LOGITS_TOL


def _rope_at(rope, x, positions):
    """RoPE at each token's own position (a pruned context's are scattered); none where
    ``rope`` is None (Granite 4.0's, Nemotron-H's)."""
    if rope is None:
        return x
    offsets = mx.array(np.asarray(positions, np.int32))
    return rope(x.transpose(2, 1, 0, 3), offset=offsets).transpose(2, 1, 0, 3)


def _attention_qkv(layer, h, positions):
    """mlx-lm's attention block's queries, keys and values (1, heads, n, head_dim), RoPE
    applied at ``positions``, and output gate (None in LFM2's and Granite's) of hidden states
    ``h``: Qwen's q_proj gives each head's queries, then its gate; LFM2 names its parts its own
    way; Granite's has no q/k norms; Ling 2.5's latent attention (absorbed: one key head
    [latent, k_pe], the latent its value) a gate per head, Kimi Linear's neither low-rank
    queries, RoPE nor gate, Ling 2.5 linear's no gate; OLMo Hybrid's no norm before it, q/k
    norms over all heads; Ring-linear's fused q/k/v, per-head q/k norms."""
    attn, n, lfm2 = attention_module(layer), h.shape[1], hasattr(layer, "operator_norm")
    olmo = "post_feedforward_layernorm" in layer  # olmo_hybrid: no norm before attention
    qwen = hasattr(attn, "q_norm") and not olmo
    norm = getattr(layer, "operator_norm", None) or getattr(layer, "input_layernorm", None)
    if "self_attention_res_norm" in layer:  # kimi_k3: the mix of its residual blocks
        h = _attn_res_mix(*_residual_blocks(h, layer)[::-1], layer._attn_res_w_eff, layer.eps)
    x = h if olmo else (norm or layer.norm)(h)  # nemotron_h: norm
    rope = getattr(attn, "rope", None)
    if "embed_q" in attn:  # bailing_moe_v3
        q = (attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))) if "q_a_proj" in attn
             else attn.q_proj(x))  # kimi_linear: a plain q_proj
        q_nope, q_pe = mx.split(q.reshape(1, n, attn.num_heads, -1).transpose(0, 2, 1, 3),
                                [attn.qk_nope_head_dim], axis=-1)
        latent, k_pe = mx.split(attn.kv_a_proj_with_mqa(x), [attn.kv_lora_rank], axis=-1)
        latent = attn.kv_a_layernorm(latent)[:, None]
        q = mx.concatenate([attn.embed_q(q_nope), _rope_at(rope, q_pe, positions)], axis=-1)
        k = mx.concatenate([latent, _rope_at(rope, k_pe[:, None], positions)], axis=-1)
        gate = (mx.repeat(attn.g_proj(x), attn.v_head_dim, axis=-1) if "g_proj" in attn
                else None)
        return q, k, latent, gate
    heads = next(getattr(attn, k) for k in ("num_attention_heads", "n_heads", "num_heads")
                 if hasattr(attn, k))
    kv_heads = getattr(attn, "num_key_value_heads", None) or attn.n_kv_heads
    if "query_key_value" in attn:  # bailing_moe_linear
        q, k, v = mx.split(attn.query_key_value(x).reshape(1, n, -1, attn.head_dim),
                           [heads, heads + kv_heads], axis=2)
        q, k = attn.query_layernorm(q), attn.key_layernorm(k)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        return _rope_at(rope, q, positions), _rope_at(rope, k, positions), v, None
    q, k = attn.q_proj(x), attn.k_proj(x)
    if olmo:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, gate = q.reshape(1, n, heads, -1), None
    if qwen:
        q, gate = mx.split(q, 2, axis=-1)
        gate = gate.reshape(1, n, -1)
    k = k.reshape(1, n, kv_heads, -1)
    v = attn.v_proj(x).reshape(1, n, kv_heads, -1).transpose(0, 2, 1, 3)
    if lfm2 or qwen:
        q_norm, k_norm = (attn.q_layernorm, attn.k_layernorm) if lfm2 else (attn.q_norm,
                                                                             attn.k_norm)
        q, k = q_norm(q), k_norm(k)
    q, k = (_rope_at(rope, t.transpose(0, 2, 1, 3), positions) for t in (q, k))
    return q, k, v, gate


def _attention(layer, h, positions, store):
    """mlx-lm's attention block (Qwen3NextAttention, LFM2's, Granite 4.0's) and the MLP after it
    for hidden states ``h`` at ``positions``, over the keys in ``store`` and their own."""
    attn, n = attention_module(layer), h.shape[1]
    q, k, v, gate = _attention_qkv(layer, h, positions)
    for name, new in (("keys", k), ("values", v)):
        store[name] = new if name not in store else mx.concatenate([store[name], new], axis=2)
    store["positions"] = np.concatenate([store.get("positions", []), positions])
    mask = mx.array(store["positions"][None, :] <= np.asarray(positions)[:, None])
    out = mx.fast.scaled_dot_product_attention(q, store["keys"], store["values"],
                                               scale=attn.scale, mask=mask)
    if "unembed_out" in attn:  # bailing_moe_v3: the latent output to each head's values
        out = attn.unembed_out(out)
    out = out.transpose(0, 2, 1, 3).reshape(1, n, -1)
    if hasattr(layer, "operator_norm"):  # lfm2
        h = h + attn.out_proj(out)
        return h + layer.feed_forward(layer.ffn_norm(h))
    if "pre_ff_layernorm" in layer:  # jamba
        h = h + attn.o_proj(out)
        return h + layer.feed_forward(layer.pre_ff_layernorm(h))
    if "mixer" in layer:  # nemotron_h: attention alone
        return h + attn.o_proj(out)
    if "post_feedforward_layernorm" in layer:  # olmo_hybrid: norms after each branch
        h = h + layer.post_attention_layernorm(attn.o_proj(out))
        return h + layer.post_feedforward_layernorm(layer.mlp(h))
    if ("embed_q" in attn or "query_key_value" in attn) and gate is None:  # kimi_linear, the
        h = h + (attn.dense if "dense" in attn else attn.o_proj)(out)  # bailing hybrids
        return h + layer.mlp(layer.post_attention_layernorm(h))
    if gate is None:  # granitemoehybrid: residual multipliers, experts beside a shared MLP
        h = h + attn.o_proj(out) * layer.residual_multiplier
        x = layer.post_attention_layernorm(h)
        return h + (layer.block_sparse_moe(x) + layer.shared_mlp(x)) * layer.residual_multiplier
    o_proj = attn.dense if "dense" in attn else attn.o_proj  # bailing_moe_v3's
    h = h + o_proj(out * mx.sigmoid(gate))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _residual_blocks(h, layer):
    """Kimi K3's hidden states ``h`` carrying each token's residual blocks after its sum (the
    engine's layout) as mlx-lm's layer takes them: the sum and a ``ResidualBlocks``."""
    d = layer.mlp_res_norm.weight.shape[0]
    blocks = ResidualBlocks(layer.eps)
    for k in range(1, h.shape[-1] // d):
        blocks.append(h[..., k * d:(k + 1) * d])
    return h[..., :d], blocks


def _carrying_blocks(layer):
    """Kimi K3's block called as the others' are, on hidden states that carry the residual
    blocks (:func:`_residual_blocks`), with mlx-lm's model's masks (causal in attention; its
    attention has no RoPE, so the kept tokens' positions change nothing)."""
    def call(h, mask=None, cache=None):
        h, blocks = _residual_blocks(h, layer)
        mask = None if layer.is_linear else create_attention_mask(h, cache, return_array=True)
        h, blocks = layer(h, mask=mask, cache=cache, blocks=blocks)
        return mx.concatenate([h, *blocks.raw], axis=-1)
    return call


def _recurrent(layer, h, positions, cache):
    """mlx-lm's block (recurrent, or attention over its cache) on hidden states ``h`` at
    ``positions``; a lightning-attention one (bailing_moe_linear's, bailing_hybrid's) a token at
    a time, its RoPE's offset the token's own position."""
    if getattr(layer, "is_global", True):
        return layer(h, mask=None, cache=cache)
    return mx.concatenate([layer(h[:, j:j + 1], None, cache, offset=int(p))
                           for j, p in enumerate(positions)], axis=1)


def reference_static(model, prompt, keep, steps, cut=3):
    """Greedy logits of a static cut after layer ``cut`` keeping ``keep`` of the prompt, from
    mlx-lm's own layers: layers up to the cut over the whole prompt; the last prompt token's
    head-averaged attention at the cut ranks the others (the first and the last kept);
    the recurrent layers above take the kept tokens in order, the attention layers attend
    over them at their own positions; generated tokens go through every layer."""
    outer = getattr(model, "language_model", model)  # Qwen3.5's text model, or the model
    text = getattr(outer, "backbone", None) or outer.model  # nemotron_h's backbone
    layers, caches, n = text.layers, make_prompt_cache(model), len(prompt)
    calls = [_carrying_blocks(layer) if "mlp_res_norm" in layer else layer for layer in layers]
    if len(caches) < len(layers):  # nemotron_h: none for its MLP layers
        given = iter(caches)
        caches = [next(given) if layer.block_type in "M*" else None for layer in layers]
    scale = getattr(text, "embedding_multiplier", 1.0)  # granitemoehybrid's multipliers
    embed = (getattr(text, "embed_tokens", None) or getattr(text, "word_embeddings", None)
             or text.embeddings)  # bailing_moe_v3's, nemotron_h's
    h = embed(prompt[None]) * scale
    for i in range(cut + 1):
        h_in = h
        h = calls[i](h, mask=create_attention_mask(h, return_array=True) if i == cut else None,
                     cache=caches[i])
    attn = attention_module(layers[cut])
    q = _attention_qkv(layers[cut], h_in[:, -1:], [n - 1])[0]
    state = caches[cut].state  # bailing_moe_v3: the latent, then k_pe (its key together)
    keys = (mx.concatenate(state[:2], axis=-1) if "embed_q" in attn else state[0])[:, :, :n]
    keys = mx.repeat(keys, q.shape[1] // keys.shape[1], axis=1)
    scores = np.array(mx.softmax(q @ keys.transpose(0, 1, 3, 2) * attn.scale, axis=-1)
                      .mean(axis=1)[0, 0])
    scores[[0, n - 1]] = np.inf
    kept = np.sort(np.argsort(-scores, kind="stable")[: round(keep * n)])
    h, positions = h[:, mx.array(kept)], kept
    stores = {i: {} for i in range(cut + 1, len(layers))  # (kimi_k3's attention: its own)
              if i not in recurrent_layers(model) + stateless_layers(model)
              and calls[i] is layers[i]}
    head = getattr(outer, "lm_head", None) or embed.as_linear  # lfm2: tied
    norm = (getattr(text, "norm", None) or getattr(text, "embedding_norm", None)  # lfm2's
            or getattr(text, "final_layernorm", None)  # jamba's
            or text.norm_f)  # nemotron_h's final norm
    logits = []
    for step in range(steps + 1):
        for i in range(cut + 1, len(layers)):
            h = (_attention(layers[i], h, positions, stores[i]) if i in stores
                 else _recurrent(calls[i], h, positions, caches[i]))
        last = h[:, -1]
        if "output_attn_res_norm" in text:  # kimi_k3: its residual blocks and sum mixed
            weight = text.output_attn_res_norm.weight * text.output_attn_res_proj.weight[0]
            last = _attn_res_mix(*_residual_blocks(last, layers[0])[::-1], weight,
                                 layers[0].eps)
        logits.append(head(norm(last))[0] / getattr(outer, "logits_scaling", 1.0))
        token = mx.argmax(logits[-1])
        positions = np.array([n + step])
        h = embed(token.reshape(1, 1)) * scale
        for i in range(cut + 1):
            h = _recurrent(calls[i], h, positions, caches[i])
    return kept, logits


def test_a_static_cut_matches_a_reference_of_mlx_lm_layers(hybrid):
    """The pruned prefill and the decode steps after it: the same tokens kept, the same
    logits as mlx-lm's own layers given the kept tokens (relative 1e-5: float32 sums in
    another order, as unpruned)."""
    model, _ = hybrid
    prompt = random_prompt(300, ModelAdapter(model).vocab_size, seed=2)
    kept, want = reference_static(model, prompt, 0.3, 12)
    engine = LazyEngine(model, resolve_config(model, STATIC))
    _, got = greedy(engine, prompt, 12)
    assert np.array_equal(np.flatnonzero(engine.cache.depth[:300] > 4), kept)
    assert max(rel_err(a, b) for a, b in zip(got, want)) < LOGITS_TOL


def test_lazy_without_revival_computes_each_token_layer_once(hybrid):
    """LazyLLM's re-selection at every step, no revival: fewer prompt tokens above the cut,
    none computed twice, none revived."""
    model, _ = hybrid
    n = 300
    engine = LazyEngine(model, resolve_config(model, NO_REVIVAL))
    greedy(engine, random_prompt(n, ModelAdapter(model).vocab_size, seed=3), 24)
    stats = engine.stats
    assert stats.prefill_tokens_per_layer == [n] * 4 + [90] * 4
    assert stats.max_computations_per_token_layer == 1 and stats.revivals == 0
    assert stats.selections > 0


def test_a_plain_lazy_resolves_without_revival(hybrid):
    """The transfer rule's cut moved onto the attention layer, no revival."""
    model, _ = hybrid
    schedule = resolve_config(model, "lazy")
    assert schedule.source == "transfer" and schedule.prune_layers == (3,)
    assert not schedule.revive and schedule.complete == "none"


@pytest.mark.parametrize("config, layers, keep, source", [
    (PruningConfig("lazy", prune_layers=(3,), keep=(0.3,)), (3,), (0.3,), "user"),
    (PruningConfig("static"), (3,), (0.4,), "preset"),  # its cut after layer 1, moved
    (PruningConfig("lazy+speed"), (3,), (0.25,), "preset"),  # after 5, moved
    (PruningConfig("lazy", scorer="last"), (3,), (0.25,), "user"),  # after 5 and 6: merged
    (PruningConfig("lazy", keep=(0.3,)), (3,), (0.3,), "user"),  # one fraction: one cut runs
])
def test_any_lazy_runs_without_revival_and_presets_cut_after_attention(hybrid, config, layers,
                                                                       keep, source):
    """``revive`` is True by default everywhere, so a hybrid cannot take it as asked for:
    every request runs without revival; a preset's cuts move onto the attention layer."""
    model, _ = hybrid
    schedule = resolve_config(model, config)
    assert (schedule.prune_layers, schedule.keep, schedule.source) == (layers, keep, source)
    assert not schedule.revive and schedule.complete == "none"


def test_a_preset_cut_moves_only_below_the_speed_cutoff(tmp_path):
    """On 16 layers lazy+speed's preset cuts after layer 10 with SPEED's cutoff at 12: the
    nearest attention layer, 11, would leave no layer below the cutoff after the cut, so the
    cut goes to 7."""
    model, _ = mlx_lm.load(str(build_tiny_model("qwen3_5-deep", tmp_path)))
    schedule = resolve_config(model, "lazy+speed")
    assert (schedule.prune_layers, schedule.prompt_depth) == ((7,), 12)


def test_a_speed_cutoff_below_every_attention_layer_is_named(hybrid):
    """lazy+speed under a cutoff that leaves no attention layer with one after it below it:
    the message said to cut after layer 3, which the cutoff then refused."""
    model, _ = hybrid
    with pytest.raises(UserInputError, match="no attention layer of this model lies "
                                             "below the SPEED cutoff 4 .* at least 5 layers"):
        resolve_config(model, PruningConfig("lazy+speed", speed_cutoff=4))
    assert resolve_config(model, PruningConfig("lazy+speed", speed_cutoff=5)).prune_layers == (3,)


def test_a_hybrid_attending_only_in_its_last_layer_takes_no_cut(tmp_path):
    model, _ = mlx_lm.load(str(build_tiny_model("qwen3_5-last", tmp_path)))
    with pytest.raises(UserInputError, match="has none a cut may follow .*: use speed"):
        resolve_config(model, "lazy")
    assert resolve_config(model, "speed").prompt_depth == 3


def test_falcon_h1_runs_as_mlx_lm_and_takes_no_cut(tmp_path):
    """``falcon_h1``: a Mamba-2 mixer and attention side by side in every layer, so every
    layer is recurrent (its state holds its keys and values too) and none takes a cut (lazy and
    calibrate refused in one line); its tied head scaled by its multipliers; a layer's tokens
    with gaps between them (others dropped below it) turned at their own positions. Unpruned
    equal to mlx-lm, in one prompt and in turns (of 37 tokens: the float32 matmuls' padding
    never reaches a state), quantized too; its prompt cache, the keys and values grown by each
    turn, saves and loads."""
    model, _ = mlx_lm.load(str(build_tiny_model("falcon_h1", tmp_path / "model")))
    assert recurrent_layers(model) == (0, 1, 2, 3) and global_layers(model) == ()
    layer = model.layers[0]
    assert layer.mamba.n_groups == 2 and layer.self_attn.rope.dims == 16
    assert model.args.lm_head_multiplier / model.args.embedding_multiplier == 0.125
    vocab = ModelAdapter(model).vocab_size
    prompt = random_prompt(300, vocab, seed=1)
    assert mlx_lm_error(model, PruningConfig("full"), prompt, 16, block_size=64) < LOGITS_TOL
    ref = model(prompt[None], cache=make_prompt_cache(model))[0, -1]
    engine = LazyEngine(model)
    engine.prefill(prompt[:100])
    engine.extend(prompt[100:137])
    assert rel_err(engine.extend(prompt[137:]), ref) < LOGITS_TOL
    with pytest.raises(UserInputError, match="'lazy' cuts after an attention layer, and this "
                                             "model has none a cut may follow"):
        resolve_config(model, "lazy")
    from mlx_lazy.bench import calibrate

    with pytest.raises(UserInputError, match="no layer a cut may follow .*: nothing to "
                                             "calibrate; run speed, random or full$"):
        calibrate.candidates(model, 512)

    # tokens with gaps between them (others dropped below the layer): RoPE at their own
    # positions, as mlx-lm's parts compute the layer
    h, positions, attn = mx.random.normal((1, 3, 64)), np.array([0, 5, 9]), layer.self_attn
    x = layer.input_layernorm(h)
    q, k, v = (proj(x).reshape(1, 3, -1, 16).transpose(0, 2, 1, 3)
               for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    q, k = _rope_at(attn.rope, q, positions), _rope_at(attn.rope, k, positions)
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=attn.scale, mask="causal")
    mid = h + layer.mamba(x, cache=ArraysCache(2)) + attn.o_proj(
        out.transpose(0, 2, 1, 3).reshape(1, 3, -1))
    want = mid + layer.feed_forward(layer.pre_ff_layernorm(mid))
    assert rel_err(ModelAdapter(model).recurrent_block(0, h, [], positions), want) < LOGITS_TOL

    cache = make_lazy_cache(model, "full")
    cache.process(prompt[:100].tolist())
    save_prompt_cache(tmp_path / "c.safetensors", cache)
    loaded = load_prompt_cache(tmp_path / "c.safetensors", model)
    turn = prompt[100:120].tolist()
    assert rel_err(loaded.process(turn), cache.process(turn)) == 0

    nn.quantize(model, group_size=32, bits=4)
    assert mlx_lm_error(model, PruningConfig("full"), prompt[:100], 4) < LOGITS_TOL


def test_plamo2_matches_mlx_lm_and_cuts_after_its_attention(tmp_path):
    """``plamo2`` (PLaMo 2): Mamba layers 0 and 2, attention in 1 and 3 (a fused q/k/v, a
    weight-free q/k norm times a weight per head), four offset norms a layer. Unpruned and with
    nothing pruned by a cut after layer 1 equal to mlx-lm, quantized too; a static cut there
    keeps 30% of the prompt above it; its prompt cache saves and loads."""
    model, _ = mlx_lm.load(str(build_tiny_model("plamo2", tmp_path / "model")))
    assert recurrent_layers(model) == (0, 2) and global_layers(model) == (1,)
    attn = model.layers[1].mixer
    assert hasattr(attn, "qkv_proj") and attn.q_weight.shape == (4, 16)
    prompt = random_prompt(200, ModelAdapter(model).vocab_size, seed=8)
    assert mlx_lm_error(model, PruningConfig("full"), prompt, 16) < LOGITS_TOL
    nothing_pruned = PruningConfig("static", prune_layers=(1,), keep=(1.0,))
    assert mlx_lm_error(model, nothing_pruned, prompt, 4) < LOGITS_TOL
    static = PruningConfig("static", prune_layers=(1,), keep=(0.3,))
    cache = make_lazy_cache(model, static)
    cache.process(prompt.tolist())
    assert cache.engine.stats.prefill_tokens_per_layer == [200] * 2 + [60] * 2
    assert_saves_loads_and_quantizes(model, cache, nothing_pruned, prompt, tmp_path)


#: Hybrids run against mlx-lm in :func:`test_gear_recurrent_gemma_and_baichuan_m1_match_mlx_lm`:
#: their recurrent layers and the layers a cut may follow
RECURRENT_AND_CUTS = {"gear": ((0, 2, 4), (3,)), "recurrent_gemma": ((0, 1, 3, 4), ()),
                      "baichuan_m1": ((0, 1, 2, 3), ()), "deepseek_v41": ((0, 1, 2, 3), ())}


@pytest.mark.parametrize("kind", RECURRENT_AND_CUTS)
def test_gear_recurrent_gemma_and_baichuan_m1_match_mlx_lm(tmp_path, kind):
    """``gear``: convolution mixers (recurrent, run as mlx-lm's block) in layers 0, 2 and 4,
    attention over a window of 24 in 1 and 5 and global in 3 (soft-capped, Gemma's four norms):
    a cut may follow layer 3 only; ``recurrent_gemma``: RG-LRU layers (recurrent) in 0, 1, 3 and
    4, local attention over 24 positions in 2 and 5; ``baichuan_m1``: attention whose keys and
    values mix in the previous token's in every layer, so each is recurrent (layers 0 and 2 over
    a window of 24, with 8 heads to the others' 4); ``deepseek_v41``: DeepSeek-V4's layers,
    each recurrent (hyper-connection streams, compressed keys and indexers reading another
    layer's; one whose indexer keeps to candidate blocks refused in one line, as is a SPEED
    cutoff below its last layer; SPEED at full depth equal to mlx-lm). Unpruned equal
    to mlx-lm over 200 tokens
    (past the windows), quantized too, and its prompt cache saves and loads; Gear's with nothing
    pruned by its cut, its static cut keeping 30% above it and a plain lazy cutting there
    without revival; the others take no cut (lazy refused in one line) and run a prompt in
    turns as mlx-lm runs it whole. None is split over ranks (mlx-lm has no ``shard`` for them).
    Loaded without a tokenizer: transformers cannot read Gear's config (its ``conv_mixer``
    layers)."""
    from mlx_lm.utils import load_model

    from mlx_lazy import distributed

    class TwoRanks:
        def size(self):
            return 2

    model, _ = load_model(build_tiny_model(kind, tmp_path / "model"))
    recurrent, cuts = RECURRENT_AND_CUTS[kind]
    assert recurrent_layers(model) == recurrent and global_layers(model) == cuts
    if kind == "baichuan_m1":
        assert [layer.self_attn.num_heads for layer in model.layers] == [8, 4, 8, 4]
    if kind == "deepseek_v41":  # layer 3's indexer keeping to the blocks layer 1 chooses
        config = json.loads((tmp_path / "model" / "config.json").read_text())
        args = model.args.from_dict({**config, "candidate_source_layer_id": 1})
        with pytest.raises(UserInputError, match="^this deepseek_v41 model's indexers keep to "
                                                 "candidate key blocks .layer 1 chooses them.,"):
            ModelAdapter(type(model)(args))
        with pytest.raises(UserInputError, match="^a SPEED cutoff at layer 3 of 4 would leave "
                                                 "this deepseek_v41 model's upper layers"):
            resolve_config(model, "speed")
    prompt = random_prompt(200, ModelAdapter(model).vocab_size, seed=8)
    assert mlx_lm_error(model, PruningConfig("full"), prompt, 16, block_size=64) < LOGITS_TOL
    if kind == "deepseek_v41":  # SPEED at full depth
        speed = PruningConfig("speed", speed_cutoff=1.0)
        assert mlx_lm_error(model, speed, prompt, 4) < LOGITS_TOL
    with pytest.raises(UserInputError, match=f"cannot shard '{kind}' models"):
        distributed.shard(model, TwoRanks())
    if cuts:  # a plain lazy: its cut moved onto the global attention layer, no revival
        schedule = resolve_config(model, "lazy")
        assert schedule.prune_layers == cuts and not schedule.revive
        nothing_pruned = PruningConfig("static", prune_layers=cuts, keep=(1.0,))
        assert mlx_lm_error(model, nothing_pruned, prompt, 4) < LOGITS_TOL
        cache = make_lazy_cache(model, PruningConfig("static", prune_layers=cuts, keep=(0.3,)))
        cache.process(prompt.tolist())
        assert cache.engine.stats.prefill_tokens_per_layer == [200] * 4 + [60] * 2
        assert_saves_loads_and_quantizes(model, cache, nothing_pruned, prompt, tmp_path)
        return
    with pytest.raises(UserInputError, match="'lazy' cuts after an attention layer, and "
                                             "this model has none a cut may follow"):
        resolve_config(model, "lazy")
    ref = model(prompt[None], cache=make_prompt_cache(model))[0, -1]
    engine = LazyEngine(model)
    engine.prefill(prompt[:100])
    engine.extend(prompt[100:137])
    assert rel_err(engine.extend(prompt[137:]), ref) < LOGITS_TOL
    cache = make_lazy_cache(model, "full")
    cache.process(prompt[:100].tolist())
    assert_saves_loads_and_quantizes(model, cache, PruningConfig("full"), prompt[:100], tmp_path)


def test_a_model_without_attention_is_refused(tmp_path):
    """A Granite 4.0 config of Mamba-2 layers only: nothing to prune with, refused in one line
    (it stopped on an internal StopIteration)."""
    model, _ = mlx_lm.load(str(build_tiny_model("granitemoehybrid-mamba", tmp_path)))
    with pytest.raises(UserInputError, match="^this granitemoehybrid model has no attention "
                                             "layer; mlx-lazy runs models with at least one$"):
        ModelAdapter(model)


@pytest.mark.parametrize("config, match", [
    (PruningConfig("lazy", complete="after-first"), "cannot come back: drop complete="),
    (PruningConfig("lazy", prune_layers=(3,), keep=(0.3,), complete="exact"),
     "cannot come back: drop complete=exact$"),
    (PruningConfig("lazy", max_revivals=2, revive_margin=1.0),
     "drop max_revivals=2, revive_margin=1.0"),
    (PruningConfig("lazy", prune_layers=(2,), keep=(0.3,), revive=False),
     "not layer 2; its attention layers .*: 3"),
])
def test_what_a_hybrid_cannot_run_is_refused(hybrid, config, match):
    model, _ = hybrid
    with pytest.raises(UserInputError, match=match):
        resolve_config(model, config)


def test_a_schedule_made_without_the_models_checks_is_refused_by_the_engine(hybrid):
    """The engine (under make_prompt_cache's Schedule path, loaded files and the server)
    runs the hybrid checks itself."""
    model, _ = hybrid
    for config, match in ((PruningConfig("lazy", prune_layers=(3,), keep=(0.3,)), "revive=False"),
                          (PruningConfig("static", prune_layers=(1,), keep=(0.3,)), "layer 1")):
        with pytest.raises(UserInputError, match=match):
            make_lazy_cache(model, build_schedule(config, 8))


def test_a_token_sent_back_into_a_recurrent_layer_is_an_internal_error(hybrid):
    """Were the engine to revive (a bug: a reviving schedule put in after its checks), a
    recurrent layer would take an older token: the engine stops instead of computing
    something wrong."""
    model, _ = hybrid
    engine = LazyEngine(model, resolve_config(model, NO_REVIVAL))
    engine.schedule = build_schedule(PruningConfig("lazy", prune_layers=(3,), keep=(0.3,),
                                                   complete="none"), 8)
    with pytest.raises(RuntimeError, match="recurrent layer 4"):
        greedy(engine, random_prompt(300, ModelAdapter(model).vocab_size, seed=3), 24)


def test_an_interrupted_step_leaves_the_recurrent_states_as_they_were(hybrid):
    """A prompt chunk stopped part-way (a progress callback that raises) rolls back; the
    run then goes on as if it had never started."""
    model, _ = hybrid
    prompt = random_prompt(200, ModelAdapter(model).vocab_size, seed=4)
    engine, clean = (LazyEngine(model, resolve_config(model, NO_REVIVAL)) for _ in range(2))
    engine.prefill(prompt[:150])
    clean.prefill(prompt[:150])
    before = same_state(engine.cache)

    def stop(done, total):
        if done == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        engine.extend(prompt[150:], stop)
    before(engine.cache)  # the recurrent layers' states included
    assert rel_err(engine.extend(prompt[150:]), clean.extend(prompt[150:])) == 0


def test_a_recurrent_state_trims_to_empty_or_not_at_all(hybrid):
    """mlx-lm's recurrent caches cannot trim; neither can ours, but all of it: a cache then
    serves a prompt only when it holds a prefix of it whole."""
    model, _ = hybrid
    prompt = random_prompt(120, ModelAdapter(model).vocab_size, seed=5).tolist()
    cache = make_lazy_cache(model, NO_REVIVAL)
    cache.process(prompt)
    assert not can_trim_prompt_cache(cache)
    assert cache.reusable(prompt + [7, 8]) == 120
    assert cache.reusable(prompt[:60] + [7, 8]) == 0  # 60 shared, but not the whole cache
    with pytest.raises(UserInputError, match="cannot trim this cache to 119 of its 120"):
        trim_prompt_cache(cache, 1)
    held = same_state(cache.engine.cache)
    trim_prompt_cache(cache, 0)  # nothing to forget: a no-op, a held choice included
    held(cache.engine.cache)
    trim_prompt_cache(cache, 120)
    fresh = make_lazy_cache(model, NO_REVIVAL)
    assert rel_err(cache.process(prompt[:50]), fresh.process(prompt[:50])) == 0


def test_a_pruned_prompt_cache_saves_and_loads(hybrid, tmp_path):
    """The recurrent states go into the file; loaded, the cache answers the next turn as
    the live one does, and a file whose state is missing or misshapen is refused."""
    model, _ = hybrid
    vocab = ModelAdapter(model).vocab_size
    cache = make_lazy_cache(model, NO_REVIVAL)
    list(generate_step(random_prompt(200, vocab, seed=6).tolist(), model, prompt_cache=cache,
                       max_tokens=4))
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path, model)
    turn = random_prompt(20, vocab, seed=7).tolist()
    assert rel_err(loaded.process(turn), cache.process(turn)) == 0

    arrays, metadata = mx.load(str(path), return_metadata=True)
    state = cache.engine.cache.recurrent[4]  # Qwen's has two parts, LFM2's one
    for name, broken in ((f"recurrent.4.{len(state) - 1}", None),
                         ("recurrent.5.0", mx.zeros((1, 2, 3)))):
        bad = dict(arrays)
        if broken is None:
            del bad[name]
        else:
            bad[name] = broken
        mx.save_safetensors(str(tmp_path / "bad.safetensors"), bad, metadata)
        with pytest.raises(UserInputError, match=f"corrupt: .*{name}"):
            load_prompt_cache(tmp_path / "bad.safetensors", model)
    # a schedule edited to revive: one the model cannot run, refused as the file's
    info = json.loads(metadata["mlx_lazy"])
    info["schedule"].update(revive=True, complete="exact")
    mx.save_safetensors(str(tmp_path / "bad.safetensors"), arrays,
                        {**metadata, "mlx_lazy": json.dumps(info)})
    with pytest.raises(UserInputError, match="corrupt: schedule: .*use revive=False"):
        load_prompt_cache(tmp_path / "bad.safetensors", model)


def test_calibrate_runs_its_candidates_without_revival_and_refuses_a_named_mode(
        hybrid, hybrid_dir, tmp_path, monkeypatch, capsys):
    """Calibrate's candidates on a hybrid revive nothing, cut after attention layers and run;
    ``--complete exact`` named on the command line is refused as ``complete="exact"`` is by
    resolve_config (it once became none silently), at once and with nothing written."""
    from mlx_lazy.bench import calibrate

    model, _ = hybrid
    cands = calibrate.candidates(model, 512)
    assert cands and all(not c.config.revive and c.config.complete is None for c in cands)
    for c in cands:
        assert set(c.config.prune_layers) <= set(global_layers(model))
        LazyEngine(model, resolve_config(model, c.config))  # the engine's own checks pass
    with pytest.raises(UserInputError, match="drop complete=exact$"):
        calibrate.candidates(model, 512, decode={"complete": "exact"})

    def no_samples(*a, **k):
        raise AssertionError("prompts were built")

    monkeypatch.setattr(calibrate, "build_samples", no_samples)
    out = tmp_path / "cal"
    assert calibrate.main(["--model", str(hybrid_dir), "--complete", "exact",
                           "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "drop complete=exact" in err and not out.exists()
