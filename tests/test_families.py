"""Model families beyond the Llama layout, through the engine against mlx-lm's own forward pass:
Llama 3.1/3.2's RoPE scaling (``llama-llama3``), Phi-3 (``phi3``: fused ``qkv_proj`` and
``gate_up_proj``; plain RoPE, and longrope's SuScaledRoPE over part of each head), SmolLM3
(``smollm3``: layers without RoPE) and Ministral 3 (``ministral3``, alone and as the text model of
a ``mistral3`` checkpoint: YaRN RoPE, queries scaled by position, sliding-window layers in a
variant), GLM-4.5 (``glm4_moe``: partial RoPE, q/k norms and biases, grouped sigmoid-routed experts
beside a shared one), Seed-OSS (``seed_oss``: q/k/v biases, o_proj's here too), ERNIE 4.5
(``ernie4_5``, ``ernie4_5_moe``: biases everywhere, traditional RoPE, softmax-routed experts),
gpt-oss (``gpt_oss``: attention sinks, sliding-window layers, a sparse MoE, biases), Granite
(``granite``: multipliers on the embeddings, residual branches, logits and attention), and the
families with norms on each branch's output and none before: OLMo 2 and 3 (``olmo2``, ``olmo3``:
q/k norms over all heads at once; OLMo 3's sliding-window layers), EXAONE 4 (``exaone4``: per-head
q/k norms, sliding-window layers, global layers without RoPE) and Gemma 4 (``gemma4_text``, alone,
with its MoE block, in its E2B/E4B layout, and as the text model of a ``gemma4`` checkpoint: head
sizes and key/value heads by layer, values from the keys' projection, partial RoPE, a per-layer
scalar; upper layers reading lower layers' keys and values, per-layer inputs) and the multi-head
latent attention of DeepSeek-V3 and GLM-4.7-Flash (``deepseek_v3``, ``glm4_moe_lite``: one latent
key/value head, queries absorbed into it) and DeepSeek-V2 (``deepseek_v2``: the latent expanded per
head), with their MoE blocks, Mistral Small 4 (``mistral4``, alone and as the text model of a
``mistral3`` checkpoint: DeepSeek-V3's latent attention, queries scaled by position as
Ministral 3's), Gemma 2 (``gemma2``: attention and final logits soft-capped, Gemma's
norms and scaled embeddings). Sparse MoE families (:data:`MOE`): Mixtral (``mixtral``), Granite MoE
(``granitemoe``: Granite's multipliers) and Phi-3.5-MoE (``phimoe``: LayerNorms, biases, longrope)
with their MoE block at ``block_sparse_moe``, Qwen2-MoE (``qwen2_moe``: biases, a gated shared
expert) and OLMoE (``olmoe``: q/k norms over all heads) at ``mlp``. More MoE families
(:data:`MOE2`): dots.llm1 (``dots1``: q/k norms, sigmoid routing with a correction bias, shared
experts), Ling/Ring (``bailing_moe``: fused q/k/v, attention at ``attention``, grouped routing with
an expert bias), Hunyuan (``hunyuan``: q/k norms after RoPE, cross-layer attention reading the
layer below's keys) and Llama 4 (``llama4``: chunked local attention, NoPE global layers with
attention temperature, a weight-free q/k norm; mlx-lm's dense ``llama4_text`` too), DeepSeek-MoE
(``deepseek``: dense layer 0, softmax routing, a shared expert), Mellum (``mellum``: q/k norms,
sliding-window layers with their own RoPE base), K-EXAONE (``exaone_moe``: global layers without
RoPE), Klear (``Klear``: a shared expert mixed by coefficients), AFM (``afmoe``: an output
gate, norms around each branch, scaled embeddings), DBRX (``dbrx``: a fused, clipped q/k/v, its
attention inside its norms' module), Phixtral (``phixtral``: Phi-2's parallel layers with
experts), MiniMax-M2 (``minimax``: q/k norms over all
heads, partial RoPE), MiMo-V2-Flash (``mimo_v2_flash``: sliding-window layers with heads, head
sizes and sinks of their own, scaled values narrower than keys), Step-3.5 (``step3p5``:
sliding-window layers with their own heads, a gate per head, clamped SwiGLU), Laguna
(``laguna``: query heads by layer, a softplus gain per head, sliding layers with RoPE of their
own, YaRN over part of each head in the global ones) and LongCat-Flash (``longcat_flash``: two
latent attentions and MLPs a block, a shortcut MoE with identity experts).
Dense families (:data:`DENSE`): EXAONE 3.5
(``exaone``: Llama's layout named otherwise), Hunyuan dense (``hunyuan_v1_dense``: q/k norms after
RoPE), StableLM 2 (``stablelm``: LayerNorms, partial RoPE; ``stablelm-parallel``: per-head q/k
LayerNorms, parallel residual), MiniCPM (``minicpm``: scaled embeddings, residuals and logits),
MiMo (``mimo``: Qwen2's layout, MTP weights dropped), nanochat (``nanochat``: weightless norms,
soft-capped logits), Gemma 1 (``gemma``: Gemma's norms and scaled embeddings, an exact-GELU MLP),
Command R+ (``cohere``: parallel layers, per-head q/k LayerNorms, scaled logits), Phi-2 (``phi``:
parallel attention and MLP on one LayerNorm, partial RoPE, biases), GPT-NeoX (``gpt_neox``: fused
per-head q/k/v, parallel attention and MLP each on its own LayerNorm; ``gpt_neox-sequential``: one
after the other), InternLM2 (``internlm2``: a fused wqkv grouped by key/value head), Qwen 1
(``qwen``: GPT-2's names, a fused c_attn, w2 its MLP's gate), GPT-2 and StarCoder 1 (``gpt2``,
``gpt_bigcode``: learned positions, a fused c_attn; StarCoder's one key/value head), Nemotron
(``nemotron``: (1 + w) LayerNorms with biases, partial RoPE, squared-ReLU MLP), OpenELM
(``openelm``: heads and MLP widths per layer, fused q/k/v, per-head q/k norms, Llama's parts named
otherwise), Nanbeige (``nanbeige``: its blocks run twice, a norm between the loops;
``nanbeige-skip`` without it), two with DeepSeek-V2's latent attention: MiniCPM3 (``minicpm3``:
low-rank queries, longrope, MiniCPM's multipliers) and Youtu-LLM (``youtu_llm``: its args named
``config``, traditional RoPE, biases, a tied head), and Granite 4.0 Micro
(``granitemoehybrid-micro``: Granite 4.0's layers, every one attention; its hybrids are in
test_hybrid), GLM-4-9B (``glm``: traditional RoPE over whole heads, a fused gate_up_proj, a tied
head), TeleChat 3 (``telechat3``: biases on attention and the MLP) and GPT-J (``gptj``: parallel
layers, traditional RoPE over part of each head, a biased head); Solar Open
(``solar_open``, in MOE2: glm4_moe's model without q/k norms or biases); PLaMo 3 (``plamo3``:
fused q/k/v, per-head q/k norms, Gemma 2's four norms, sliding-window layers with their own RoPE
base); Talkie (``talkie``: weightless norms, gains per query head, on each branch and on the
normed embeddings every layer adds back); Lille 130M (``lille-130m``: a fused q/k/v, norms inside
its attention and MLP modules), PLaMo 1 (``plamo``: parallel layers, tiled key/value heads),
BitNet b1.58 (``bitnet``: ternary BitLinear projections, sub-norms, a ReLU^2-gated MLP), Muse
Glimmer (``muse_glimmer``: (1 + w) norms around each branch, weight-free norms on the embeddings
and q/k, an output gate, sliding layers with RoPE and global ones without, scaled and soft-capped
logits), Spark 2.5 (``spark2_5``: a fused q/k/v, a gate per head, sliding layers with RoPE of
their own, an exact-GELU MLP) and IQuest-Loop-Coder (``iquestloopcoder``: its blocks run twice,
the second loop attending over its own keys in a window and the first loop's, mixed by a gate per
head); Muse Spark's text model (``muse_spark``, in MOE2: mlx-lm's fused kernels, in plain MLX
without Metal, conftest's ``muse_spark_without_metal``). The text models of vision-language
checkpoints (:data:`VL`: Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
Qwen3-VL MoE, Kimi-VL, Kimi K2.5, Pixtral; LFM2-VL's in test_hybrid)."""

from __future__ import annotations

import json
import shutil

import mlx_lazy  # noqa: F401  (OpenBLAS before mlx)

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import CacheList, make_prompt_cache
from mlx_lm.utils import MODEL_REMAPPING

from mlx_lazy import (LazyEngine, PruningConfig, UserInputError, generate, load,
                      load_prompt_cache, make_prompt_cache as make_lazy_cache, resolve_config,
                      save_prompt_cache)
from mlx_lazy.adapter import (LONGCAT_TYPES, SUPPORTED_MODEL_TYPES, ModelAdapter, attention_module,
                              decode_identity, feed_forward, global_layers, identities_match,
                              recurrent_layers, sliding_windows, stateless_layers)
from mlx_lazy.attention import IMPLEMENTATIONS, Chunks, position_mask, window_start
from mlx_lazy.cache import EMBEDDING_STATE
from numerics import max_rel_err, rel_err
from test_engine import LOGITS_TOL, mlx_lm_error, random_prompt
from test_gemma3 import cut_after_layer_0, decode_one, dense_mask
from tiny_models import build_tiny_model, tiny_config

MLA = ("deepseek_v3", "glm4_moe_lite", "deepseek_v2")
#: DeepSeek-V3.2's sparse attention (its lightning indexer) and GLM-5's
DSA = ("deepseek_v32", "glm_moe_dsa")
#: Vision-language checkpoints' text models (mlx-lm's wrappers): Qwen2-VL's qwen2 (its config
#: flat), Qwen2.5-VL's (its own model_type, a text_config), Qwen3-VL's qwen3 and qwen3_moe,
#: Kimi-VL's and Kimi K2.5's DeepSeek-V3
VL = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "kimi_vl", "kimi_k25", "pixtral")
MOE = ("mixtral", "qwen2_moe", "olmoe", "granitemoe", "phimoe")
MOE2 = ("dots1", "bailing_moe", "hunyuan", "llama4_text", "llama4", "deepseek", "mellum",
        "solar_open", "exaone_moe", "Klear", "afmoe", "dbrx", "phixtral", "minimax",
        "mimo_v2_flash", "step3p5", "laguna", "longcat_flash", "minimax_m3_vl", "muse_spark")
DENSE = ("exaone", "hunyuan_v1_dense", "stablelm", "stablelm-parallel", "minicpm", "mimo",
         "nanochat", "gemma", "cohere", "phi", "gpt_neox", "internlm2", "qwen", "gpt2",
         "gpt_bigcode", "nemotron", "openelm", "nanbeige", "minicpm3", "youtu_llm",
         "granitemoehybrid-micro", "glm", "telechat3", "gptj", "plamo3", "talkie", "lille-130m",
         "plamo", "bitnet", "muse_glimmer", "spark2_5", "iquestloopcoder")
FAMILIES = ("llama-llama3", "phi3", "phi3-longrope", "smollm3", "ministral3",
            "ministral3-sliding", "mistral3",
            "glm4_moe", "seed_oss", "ernie4_5", "ernie4_5_moe", "gpt_oss", "granite", "olmo2",
            "olmo3", "exaone4", "exaone4-global", "gemma4_text", "gemma4_text-moe",
            "gemma4_text-e2b", "gemma4", *MLA, "mistral4", "mistral3-mistral4", *VL, "gemma2",
            "glm4", "starcoder2", "cohere2", *DSA, "gemma3n",
            "helium", "internlm3", "apertus", *MOE, *MOE2, *DENSE, "gpt_neox-sequential",
            "nanbeige-skip", "afm7", "longcat_flash_ngram")


#: The families whose attention asks more of an attention implementation than plain causal
#: attention (:func:`attention_features`): sliding windows or chunks (a mask by position), sinks,
#: values narrower than keys, Phi-3-small's block-sparse patterns (a mask per head). Their engine
#: tests run with both implementations (conftest's ``attention_implementation``); the other
#: families' attention is the plain one test_engine runs with both, so theirs run with the GPU's
#: (``fast``) alone.
ATTENTION_FEATURED = frozenset((
    "ministral3-sliding", "gpt_oss", "olmo3", "exaone4", "gemma4_text", "gemma4_text-moe",
    "gemma4_text-e2b", "gemma4", *MLA, "mistral4", "mistral3-mistral4", "kimi_vl", "kimi_k25",
    "cohere2", "llama4", "mellum", "exaone_moe", "afmoe", "mimo_v2_flash", "step3p5", "laguna",
    "longcat_flash", "minicpm3", "youtu_llm", "plamo3", "deepseek_v32", "glm_moe_dsa",
    "gemma3n", "muse_glimmer", "spark2_5", "iquestloopcoder", "longcat_flash_ngram",
    "phi3small", "minimax_m3_vl", "muse_spark"))
#: Logits tolerances other than LOGITS_TOL. Muse Spark's: mlx-lm rounds its final norm's output
#: to bfloat16, so a float32 difference of summation order in attention (about 1e-7) can flip
#: a rounding and move a logit by part of a bfloat16 step (2^-8 relative): 2e-5 measured on
#: the tiny one (a dropped cast: 2e-3).
LOGITS_TOLS = {"muse_spark": 5e-4}


#: Runs a test once with each attention implementation.
BOTH_IMPLEMENTATIONS = pytest.mark.usefixtures("attention_implementation")


def by_implementation(kinds):
    """Parametrizes a test over ``kinds``, a ``kind`` argument, each with both attention
    implementations for the :data:`ATTENTION_FEATURED` families, ``fast`` for the others."""
    cases = [pytest.param(kind, name, id=f"{kind}-{name}") for kind in kinds
             for name in (IMPLEMENTATIONS if kind in ATTENTION_FEATURED else ("fast",))]
    by_kind = pytest.mark.parametrize(("kind", "attention_implementation"), cases,
                                      indirect=["attention_implementation"])
    return lambda test: BOTH_IMPLEMENTATIONS(by_kind(test))


def attention_features(model: nn.Module) -> set:
    """What the model's attention asks of an attention implementation beyond plain causal
    attention: ``"window"`` (sliding windows or chunks), ``"sinks"``, ``"narrow values"``."""
    adapter = ModelAdapter(model)
    h = adapter.embed(mx.array([1, 2]))
    features = set()
    for layer in range(adapter.num_layers):
        if adapter.attention_free(layer):
            continue
        if adapter.sliding_window(layer) is not None:
            features.add("window")
        if adapter.sinks(layer) is not None:
            features.add("sinks")
        if adapter.kv_layer(layer) == layer:
            _, k, v, *_ = adapter.qkv(layer, h, np.arange(2))
            if v.shape[-1] < k.shape[-1]:
                features.add("narrow values")
    return features


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    built = {}

    def get(kind):
        if kind not in built:
            built[kind] = build_tiny_model(kind, tmp_path_factory.mktemp(kind))
        return built[kind]

    return get


@pytest.fixture(scope="module")
def family(family_dir):
    loaded = {}

    def get(kind):
        if kind not in loaded:
            loaded[kind] = mlx_lm.load(str(family_dir(kind)))
        return loaded[kind]

    return get


def test_the_tiny_phi3_is_what_it_claims(family):
    """Fused projections, untied head, longrope's scaled RoPE on 12 of 16 head dims."""
    model, _ = family("phi3")
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert model.model_type == "phi3" and hasattr(attn, "qkv_proj") and hasattr(mlp, "gate_up_proj")
    assert not hasattr(attn, "q_proj") and attn.n_kv_heads < attn.n_heads
    rope = family("phi3-longrope")[0].layers[0].self_attn.rope
    assert type(rope).__name__ == "SuScaledRoPE" and rope.dim == 12 and rope._scale != 1.0


def test_the_tiny_llama3_is_what_it_claims(family):
    """Llama 3's RoPE: of its 8 frequencies the fastest unscaled, the slowest divided by 8,
    some smoothed between."""
    rope = family("llama-llama3")[0].layers[0].self_attn.rope
    plain = 10000.0 ** (mx.arange(0, 16, 2) / 16)
    divisors = (rope._freqs / plain).tolist()
    assert type(rope).__name__ == "Llama3RoPE" and abs(divisors[0] - 1) < 1e-6
    assert abs(divisors[-1] - 8) < 1e-5 and any(1.01 < d < 7.99 for d in divisors)


def test_the_tiny_smollm3_is_what_it_claims(family):
    """RoPE in layers 0 and 2, none in 1 and 3: keys there do not depend on positions."""
    model, _ = family("smollm3")
    ropes = [type(layer.self_attn.rope).__name__ for layer in model.layers]
    assert model.model_type == "smollm3" and ropes == ["RoPE", "NoPE", "RoPE", "NoPE"]


def test_the_tiny_ministral3_is_what_it_claims(family):
    """YaRN RoPE; queries scaled from position 64 on; a checkpoint's text model; windows of
    24 in layers 0 and 2 of the sliding variant, as the adapter reads them."""
    model, _ = family("ministral3")
    attn = model.layers[0].self_attn
    assert type(attn.rope).__name__ == "YarnRoPE"
    assert attn.scaling_beta == 0.1 and attn.original_max_position_embeddings == 64
    wrapped = family("mistral3")[0]
    assert wrapped.model_type == "mistral3" and wrapped.language_model.model_type == "ministral3"
    assert sliding_windows(model) == [None] * 4
    assert sliding_windows(family("ministral3-sliding")[0]) == [24, None, 24, None]


def test_the_tiny_glm4_moe_is_what_it_claims(family):
    """RoPE over 8 of 16 head dims, q/k norms, biases; layer 0 dense, the others 2 of 4
    experts in 2 groups beside a shared expert, routed by random weights and bias (mlx-lm
    starts both at zero: every token would take the same experts)."""
    model, _ = family("glm4_moe")
    attn, moe = model.layers[0].self_attn, model.layers[1].mlp
    assert model.model_type == "glm4_moe" and attn.rope.dims == 8 and attn.use_qk_norm
    assert "bias" in attn.q_proj and hasattr(model.layers[0].mlp, "down_proj")
    assert type(moe).__name__ == "MoE" and moe.gate.n_group == 2 and moe.gate.top_k == 2
    assert hasattr(moe, "shared_experts") and moe.switch_mlp.gate_proj.weight.shape[0] == 4
    assert float(mx.abs(moe.gate.weight).sum()) > 0
    assert float(mx.abs(moe.gate.e_score_correction_bias).sum()) > 0
    inds, _ = moe.gate(mx.random.normal((64, 64)))
    assert len({tuple(sorted(row)) for row in inds.tolist()}) > 1


def test_the_tiny_seed_oss_and_ernie_are_what_they_claim(family):
    """Random biases wherever the family has them (o_proj's too: a dropped one shows), ERNIE's
    traditional RoPE, its MoE layers from 1 on (2 of 4 experts, a shared one)."""
    seed, ernie, moe = (family(k)[0] for k in ("seed_oss", "ernie4_5", "ernie4_5_moe"))
    for model in (seed, ernie):
        attn = model.layers[0].self_attn
        assert all(float(mx.abs(getattr(attn, n).bias).sum()) > 0
                   for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert float(mx.abs(ernie.layers[0].mlp.down_proj.bias).sum()) > 0
    assert ernie.layers[0].self_attn.rope.traditional
    block = moe.layers[1].mlp
    assert hasattr(moe.layers[0].mlp, "down_proj") and block.k == 2
    assert block.switch_mlp.gate_proj.weight.shape[0] == 4 and block.shared_experts is not None


def test_the_tiny_gpt_oss_is_what_it_claims(family):
    """Sinks that differ by head, windows of 24 in layers 0 and 2, 2 of 4 experts."""
    model, _ = family("gpt_oss")
    adapter = ModelAdapter(model)
    assert model.model_type == "gpt_oss" and adapter.n_heads == 4 and adapter.n_kv_heads == 2
    assert np.ptp(np.array(adapter.sinks(0))) > 0.5 and adapter.scale == 16 ** -0.5
    assert sliding_windows(model) == [24, None, 24, None]
    assert model.layers[0].mlp.num_experts_per_tok == 2 and not hasattr(model.layers[0].mlp,
                                                                         "down_proj")


def test_the_tiny_post_norm_families_are_what_they_claim(family):
    """No norm before attention or the MLP; OLMo's q/k norms as wide as all heads, EXAONE
    4's one head wide; the windows and RoPE of each layer as the adapter reads them."""
    for kind in ("olmo2", "olmo3", "exaone4", "exaone4-global"):
        model, _ = family(kind)
        layer = model.layers[0]
        assert not hasattr(layer, "input_layernorm")
        assert hasattr(layer, "post_feedforward_layernorm")
        heads = 1 if kind.startswith("exaone4") else ModelAdapter(model).n_heads
        assert layer.self_attn.q_norm.weight.shape == (heads * 16,)
    ropes = [[type(getattr(layer.self_attn, "rope", None)).__name__ for layer in
              family(kind)[0].layers] for kind in ("olmo3", "exaone4", "exaone4-global")]
    assert ropes == [["RoPE", "YarnRoPE"] * 2, ["RoPE", "NoneType"] * 2, ["RoPE"] * 4]
    assert sliding_windows(family("olmo3")[0]) == sliding_windows(family("exaone4")[0]) == [
        24, None, 24, None]
    assert sliding_windows(family("exaone4-global")[0]) == [None] * 4


def test_the_tiny_gemma4_is_what_it_claims(family):
    """Sliding layers 16 wide with 2 key/value heads and plain RoPE; global ones 32 wide,
    one key/value head and no value projection, RoPE on a quarter of each head; scalars
    unlike 1; the MoE variant's experts; the checkpoint's text model."""
    model, _ = family("gemma4_text")
    attns = [layer.self_attn for layer in model.layers]
    assert [(a.head_dim, a.n_kv_heads, hasattr(a, "v_proj")) for a in attns] == [
        (16, 2, True), (32, 1, False)] * 2
    assert [type(a.rope).__name__ for a in attns] == ["RoPE", "ProportionalRoPE"] * 2
    assert sliding_windows(model) == [24, None, 24, None] and attns[0].scale == 1.0
    assert all(abs(layer.layer_scalar.item() - 1) > 0.01 for layer in model.layers)
    assert family("gemma4_text-moe")[0].layers[0].enable_moe
    wrapped = family("gemma4")[0]
    assert wrapped.model_type == "gemma4" and wrapped.language_model.model_type == "gemma4_text"
    e2b = ModelAdapter(family("gemma4_text-e2b")[0])
    assert [e2b.kv_layer(layer) for layer in range(4)] == [0, 1, 0, 1]
    assert [hasattr(layer.self_attn, "k_proj") for layer in e2b.layers] == [True] * 2 + [False] * 2
    assert e2b.embed(mx.array([1, 2])).shape == (1, 2, 64 + 4 * 32)  # hidden, 4 layers' inputs


def test_the_tiny_latent_attention_models_are_what_they_claim(family):
    """DeepSeek-V3 and GLM-4.7-Flash in mlx-lm's absorbed form (embed_q, unembed_out), their
    queries low-rank; DeepSeek-V2 with kv_b_proj and q_proj. 4 heads, a 32-wide latent, 8
    RoPE dims, q_nope 32 and values 24 wide; V3's and V2's YaRN raises the scale; MoE from
    layer 1 on, routed by random weights (mlx-lm starts them at zero). As the adapter sees
    them: the absorbed form's one key head [latent, k_pe] and one value head, the latent;
    V2's per-head keys [k_nope, k_pe] and 24-wide values."""
    shapes = {}
    for kind in MLA:
        model, _ = family(kind)
        attn, a = model.layers[0].self_attn, ModelAdapter(model)
        absorbed = kind != "deepseek_v2"
        assert hasattr(attn, "embed_q") == absorbed != hasattr(attn, "kv_b_proj")
        assert (attn.q_lora_rank is not None) == absorbed
        plain = 40 ** -0.5
        assert a.scale == attn.scale and (a.scale > 1.2 * plain) == (kind != "glm4_moe_lite")
        q, k, v, _ = a.qkv(0, a.embed(mx.array([1, 2, 3])), np.arange(3))
        shapes[kind] = q.shape, k.shape, v.shape
        assert hasattr(model.layers[0].mlp, "down_proj")
        moe = model.layers[1].mlp
        assert moe.switch_mlp.gate_proj.weight.shape[0] == 4 and moe.gate.top_k == 2
        inds, _ = moe.gate(mx.random.normal((64, 64)))
        assert len({tuple(sorted(row)) for row in inds.tolist()}) > 1
    assert shapes == {"deepseek_v3": ((1, 4, 3, 40), (1, 1, 3, 40), (1, 1, 3, 32)),
                      "glm4_moe_lite": ((1, 4, 3, 40), (1, 1, 3, 40), (1, 1, 3, 32)),
                      "deepseek_v2": ((1, 4, 3, 40), (1, 4, 3, 40), (1, 4, 3, 24))}
    assert type(family("deepseek_v3")[0].layers[0].self_attn.rope).__name__ == "YarnRoPE"
    assert type(family("deepseek_v2")[0].layers[0].self_attn.rope).__name__ == \
        "DeepseekV2YarnRotaryEmbedding"


@BOTH_IMPLEMENTATIONS
def test_the_tiny_deepseek_v32_and_glm5_are_what_they_claim(family):
    """DeepSeek-V3.2's and GLM-5's latent attention with a lightning indexer: 4 heads 16 wide,
    RoPE over 8 of them (GLM-5's traditional), each query's top 24 keys. As the adapter sees
    them: keys [latent, k_pe, indexer key] (32 + 8 + 16 wide), queries as wide with zeros at
    the end; a query over more than 24 keys sees the 24 its indexer scores highest (the sum
    over heads of each head's weight times its ReLU'd query . key), the others all theirs."""
    n = 40
    for kind in DSA:
        model, _ = family(kind)
        indexer, a = model.layers[0].self_attn.indexer, ModelAdapter(model)
        assert (indexer.n_heads, indexer.head_dim, a.index_topk(0)) == (16, 16, 24)
        assert indexer.rope.traditional == (kind == "glm_moe_dsa")
        q, k, v, index = a.qkv(0, a.embed(mx.arange(1, n + 1)), np.arange(n))
        assert (q.shape, k.shape, v.shape, index.shape) == (
            (1, 4, n, 56), (1, 1, n, 56), (1, 1, n, 32), (1, n, 16, 17))
        assert not mx.any(q[..., 40:]).item()
        mask = position_mask(np.arange(n), np.arange(n))
        seen = np.array(a.index_mask(0, index, k, mx.array(mask), np.arange(n), np.arange(n)))
        assert (seen.sum(axis=1) == np.minimum(np.arange(1, n + 1), 24)).all()
        assert not (seen & ~mask).any()
        index, keys = np.array(index[0]), np.array(k[0, 0, :, 40:])
        scores = (np.maximum(index[:, :, :-1] @ keys.T, 0) * index[:, :, -1:]).sum(axis=1)
        assert set(np.flatnonzero(seen[-1])) == set(np.argsort(scores[-1])[-24:])


def test_the_tiny_moe_families_are_what_they_claim(family):
    """Every layer's feed-forward a sparse MoE block of 4 experts, 2 per token (at
    ``block_sparse_moe`` in Mixtral, Granite MoE and Phi-3.5-MoE, at ``mlp`` in Qwen2-MoE and
    OLMoE), routed by random weights: tokens take different pairs. Qwen2-MoE's shared expert
    weighed by a gate far from 1 that differs by token; OLMoE's q/k norms over all heads;
    Granite MoE's multipliers unlike 1; Phi-3.5-MoE's LayerNorms with random biases, its
    head's bias and longrope's scaled RoPE."""
    x = mx.random.normal((64, 64), key=mx.random.key(1))
    for kind in MOE:
        model, _ = family(kind)
        for layer in model.layers:
            moe = feed_forward(layer)
            assert ("block_sparse_moe" in layer) == (kind in ("mixtral", "granitemoe", "phimoe"))
            assert moe.switch_mlp.gate_proj.weight.shape[0] == 4 and not hasattr(moe, "down_proj")
            k = getattr(moe, "num_experts_per_tok", None) or getattr(moe, "top_k", None)
            assert (k or moe.router.top_k) == 2
            router = moe.router.layer if kind == "granitemoe" else moe.gate
            pairs = np.sort(np.argsort(-np.array(router(x)), axis=-1)[:, :2], axis=-1)
            assert len({tuple(p) for p in pairs.tolist()}) > 2
    shared = family("qwen2_moe")[0].layers[0].mlp
    gate = np.array(mx.sigmoid(shared.shared_expert_gate(x)))
    assert hasattr(shared.shared_expert, "down_proj") and gate.max() < 0.9 and np.ptp(gate) > 0.05
    olmoe = family("olmoe")[0].layers[0].self_attn
    assert olmoe.q_norm.weight.shape == (4 * 16,) and olmoe.k_norm.weight.shape == (2 * 16,)
    args = family("granitemoe")[0].args
    assert (args.embedding_multiplier, args.residual_multiplier, args.logits_scaling,
            family("granitemoe")[0].layers[0].self_attn.scale) == (6.0, 0.3, 4.0, 0.1)
    phimoe = family("phimoe")[0]
    norms = [phimoe.model.norm] + [layer.input_layernorm for layer in phimoe.layers]
    assert all(isinstance(n, nn.LayerNorm) and float(mx.abs(n.bias).sum()) > 0 for n in norms)
    assert float(mx.abs(phimoe.lm_head.bias).sum()) > 0
    rope = phimoe.layers[0].self_attn.rope
    assert type(rope).__name__ == "SuScaledRoPE" and rope._scale == 1.2


def test_the_tiny_gemma2_is_what_it_claims(family, monkeypatch):
    """Every layer global, the scale 1/sqrt(query_pre_attn_scalar) (not 1/sqrt(head_dim)),
    attention logits capped at 2 (a cap of 0 or None: none) and final logits at 5, each cap
    below some of the raw logits of these random weights (so the caps bend them), a tied
    head."""
    model, _ = family("gemma2")
    a = ModelAdapter(model)
    assert model.model_type == "gemma2" and a.lm_head is None
    assert sliding_windows(model) == [None] * 4 and a.scale == 4 ** -0.5 != 16 ** -0.5
    assert [a.softcap(layer) for layer in range(4)] == [2.0] * 4
    tokens = mx.array(random_prompt(64, a.vocab_size))
    q, k, _, _ = a.qkv(0, a.embed(tokens), np.arange(64))
    raw = (q * a.scale).reshape(1, 2, 2 * 64, 16) @ k.swapaxes(-1, -2)
    assert float(mx.abs(raw).max()) > 2 * 1.5
    raw = model.model.embed_tokens.as_linear(model.model(tokens[None]))
    assert model.final_logit_softcapping == 5.0 and float(mx.abs(raw).max()) > 5 * 1.5
    for none in (0.0, None):
        monkeypatch.setattr(model.layers[1].self_attn, "attn_logit_softcapping", none)
        capped = ModelAdapter(model)  # caps are read once, when an adapter is made
        assert capped.softcap(1) is None and capped.softcap(0) == 2.0


def test_the_tiny_glm4_is_what_it_claims(family):
    """GLM-4-0414: random norms before and after each branch, fused gate_up_proj (SwiGLU on
    the CPU kernel), q/k/v biases, traditional RoPE over 8 of 16 head dims."""
    model, _ = family("glm4")
    layer = model.layers[0]
    norms = ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm",
             "post_mlp_layernorm")
    assert all(float(mx.abs(getattr(layer, n).weight - 1).max()) > 0.05 for n in norms)
    assert hasattr(layer.mlp, "gate_up_proj") and ModelAdapter(model)._activations[0] == "silu"
    attn = layer.self_attn
    assert attn.rope.dims == 8 and attn.rope.traditional and "bias" in attn.q_proj
    assert "bias" not in attn.o_proj


def test_the_tiny_starcoder2_and_apertus_are_what_they_claim(family):
    """Their MLPs are plain (not gated), run as mlx-lm's modules: StarCoder2's GELU c_fc and
    c_proj with biases, beside LayerNorms with random biases and a tied head; Apertus's xIELU
    with slopes off their defaults, its norms ``attention_layernorm`` and
    ``feedforward_layernorm``, per-head q/k norms, Llama 3's RoPE."""
    star, _ = family("starcoder2")
    layer, adapter = star.layers[0], ModelAdapter(star)
    assert float(mx.abs(layer.input_layernorm.bias).sum()) > 0
    assert all(float(mx.abs(p.bias).sum()) > 0 for p in (layer.mlp.c_fc, layer.mlp.c_proj,
                                                          layer.self_attn.o_proj))
    assert adapter._activations == [None] * 4 and adapter.lm_head is None
    apertus, _ = family("apertus")
    layer, adapter = apertus.layers[0], ModelAdapter(apertus)
    assert not hasattr(layer, "input_layernorm") and hasattr(layer, "feedforward_layernorm")
    assert adapter._activations == [None] * 4 and layer.self_attn.q_norm.weight.shape == (16,)
    assert abs(layer.mlp.act_fn.beta.item() - 0.5) > 0.01
    assert type(layer.self_attn.rope).__name__ == "Llama3RoPE"


def test_the_tiny_cohere2_is_what_it_claims(family):
    """Command R7B: one LayerNorm (random bias) and no other in a layer; windows of 24 in
    layers 0 and 2, RoPE there only (mlx-lm's global layers skip theirs); logits times 0.3;
    q/k/v/o biases; a tied head."""
    model, _ = family("cohere2")
    layer, adapter = model.layers[0], ModelAdapter(model)
    assert not hasattr(layer, "post_attention_layernorm")
    assert float(mx.abs(layer.input_layernorm.bias).sum()) > 0
    assert [block.self_attn.use_sliding_window for block in model.layers] == [True, False] * 2
    assert sliding_windows(model) == [24, None, 24, None]
    assert model.args.logit_scale == 0.3 and adapter.lm_head is None
    assert float(mx.abs(layer.self_attn.o_proj.bias).sum()) > 0


def test_the_tiny_helium_and_internlm3_are_what_they_claim(family):
    """Helium tied, with the random lm_head mlx-lm builds but does not use; InternLM3's
    dynamic NTK RoPE, biases on q/k/v/o and the MLP."""
    helium, _ = family("helium")
    assert helium.args.tie_word_embeddings and ModelAdapter(helium).lm_head is None
    assert float(mx.abs(helium.lm_head.weight - helium.model.embed_tokens.weight).max()) > 0.1
    intern, _ = family("internlm3")
    attn = intern.layers[0].self_attn
    assert type(attn.rope).__name__ == "DynamicNTKScalingRoPE" and attn.rope.factor == 6.0
    assert all(float(mx.abs(p.bias).sum()) > 0 for p in (attn.q_proj, attn.o_proj,
                                                          intern.layers[0].mlp.down_proj))


def _random(*weights) -> bool:
    """Whether every one of ``weights`` (norm weights) is away from the ones they start at."""
    return all(float(mx.abs(w - 1).max()) > 0.05 for w in weights)


def test_the_tiny_dense_families_are_what_they_claim(family, family_dir):
    """EXAONE 3.5 under its own names (``transformer.wte``, ``h``, ``ln_1``, ``ln_2``,
    ``attn.attention.out_proj``, ``ln_f``), its norms random and in the identity, biases, a
    tied head, its SwiGLU on the CPU kernel; Hunyuan's per-head query/key norms random, its
    RoPE frequencies NTK-alpha scaled; StableLM 2's LayerNorms random, RoPE over 4 of 16
    head dims, the scale 1/sqrt(head_dim); its parallel variant's random per-head q/k
    LayerNorms and one norm per layer; MiniCPM's multipliers unlike 1 and untied head;
    MiMo's checkpoint holding an MTP layer that mlx-lm dropped, its q/k/v biases."""
    exaone, _ = family("exaone")
    layer, a = exaone.layers[0], ModelAdapter(exaone)
    assert "self_attn" not in layer and attention_module(layer) is layer.attn.attention
    assert "out_proj" in attention_module(layer) and "bias" in attention_module(layer).out_proj
    assert a._embedding is exaone.transformer.wte and a._final_norm is exaone.transformer.ln_f
    assert a._activations[0] == "silu"  # its c_fc_0/c_fc_1 SwiGLU through the CPU kernel
    assert a.lm_head is None and _random(layer.ln_1.weight, layer.ln_2.weight, a._final_norm.weight)
    assert np.abs(decode_identity(a.identity())[1]).max() > 0  # its norms, named ln_*
    hunyuan = family("hunyuan_v1_dense")[0].layers[0].self_attn
    assert _random(hunyuan.query_layernorm.weight, hunyuan.key_layernorm.weight)
    plain = 10000.0 ** (mx.arange(0, 16, 2) / 16)
    assert float((hunyuan.rope._freqs / plain)[-1]) > 100
    stablelm, _ = family("stablelm")
    layer, a = stablelm.layers[0], ModelAdapter(stablelm)
    assert layer.self_attn.rope.dims == 4 and a.scale == 16 ** -0.5 and not a._parallel
    assert _random(layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    assert float(mx.abs(layer.input_layernorm.bias).sum()) > 0
    parallel, _ = family("stablelm-parallel")
    layer = parallel.layers[0]
    assert ModelAdapter(parallel)._parallel and "post_attention_layernorm" not in layer
    assert _random(*(n.weight for n in layer.self_attn.q_layernorm.norms),
                   *(n.weight for n in layer.self_attn.k_layernorm.norms))
    minicpm, _ = family("minicpm")
    args = minicpm.args
    assert (args.scale_emb, args.scale_depth, args.dim_model_base) == (12.0, 1.4, 16)
    assert not args.tie_word_embeddings and ModelAdapter(minicpm).lm_head is minicpm.lm_head
    mimo, _ = family("mimo")
    assert "model.mtp_layers.0.input_layernorm.weight" in mx.load(
        str(family_dir("mimo") / "model.safetensors"))
    assert not any("mtp" in name for name, _ in tree_flatten(mimo.parameters()))
    assert float(mx.abs(mimo.layers[0].self_attn.k_proj.bias).sum()) > 0


@BOTH_IMPLEMENTATIONS
def test_the_tiny_phi3small_is_what_it_claims_and_matches_mlx_lm(family):
    """Phi-3-small: block-sparse layers 0 and 2 (their pattern, per head, by original
    positions: on any tokens the rows and columns of mlx-lm's dense mask), dense 1 and 3, a
    fused q/k/v grouped by key/value head, muP multipliers unlike 1, masked dummy ids. Unpruned
    and through a cut that keeps all, our logits are mlx-lm's fed the prompt one token a step:
    its prompt pass adds its boolean causal mask to the block-sparse layers' scores (+1, not
    -inf) and aligns query blocks to the prompt's end, so there a query sees the later keys
    of its block, and a prompt's logits differ from its decode steps'."""
    model, _ = family("phi3small")
    windows, a = sliding_windows(model), ModelAdapter(model)
    assert [w is None for w in windows] == [False, True, False, True]
    assert global_layers(model) == (1,) and a.scale == 2.0 / 16
    assert a._embed_scale == 10.0 and a._logits_scaling == 8.0 and a._activations[0] is None
    _, dense = model.layers[0].self_attn._block_sparse_mask(320, 320)
    causal = np.tril(np.ones((320, 320), bool))
    rng = np.random.default_rng(0)
    rows, keys = (np.sort(rng.choice(320, size, replace=False)) for size in (40, 120))
    want = (np.array(dense).reshape(4, 320, 320) & causal)[:, rows][:, :, keys]
    assert np.array_equal(position_mask(rows, keys, windows[0]), want)
    assert 0.2 < want.mean() < 0.5 and not np.array_equal(want[0], want[1])
    logits = a.logits(a.embed(mx.array([5])))
    assert bool(mx.isinf(logits[0, 0, 100256])) and not bool(mx.isinf(logits[0, 0, 100255]))
    prompt = random_prompt(120, a.vocab_size)  # 4 blocks, the last one partial
    for config in (PruningConfig("full"), PruningConfig("lazy", prune_layers=(1,), keep=(1.0,))):
        cache = make_prompt_cache(model)
        for token in prompt[:-1]:  # (the inner model: no 100,352 logits a step)
            model.model(token.reshape(1, 1), cache=cache)
        engine = LazyEngine(model, resolve_config(model, config), block_size=64)
        pairs = [(model(prompt[-1:][None], cache=cache)[0, -1], engine.prefill(prompt))]
        for _ in range(8):
            token = int(mx.argmax(pairs[-1][0]))
            pairs.append((model(mx.array([[token]]), cache=cache)[0, -1], engine.decode(token)))
        assert max_rel_err(pairs) < LOGITS_TOL


def _phi3small_dense_logits(model, tokens: np.ndarray, masks, monkeypatch) -> mx.array:
    """mlx-lm's Phi-3-small blocks over every token, dense (its block-sparse layers' own
    pattern off: the masks, per head there, carry it), each with its boolean mask as 0/-inf;
    the last token's logits."""
    inner = model.model
    h = inner.embed_tokens(mx.array(tokens)[None]) * model.args.mup_embedding_multiplier
    for block, mask in zip(inner.layers, masks):
        monkeypatch.setattr(block.self_attn, "block_sparse", False)
        h = block(h, mx.where(mx.array(mask), 0.0, -mx.inf), None)
    out = inner.embed_tokens.as_linear(inner.final_layernorm(h))[0, -1]
    out = out / model.args.mup_width_multiplier
    out[model._dummy_tokenizer_ids] = -mx.inf
    return out


@BOTH_IMPLEMENTATIONS
@pytest.mark.parametrize("revival_block", [64, 2])
def test_phi3small_block_sparse_under_pruning_equals_a_dense_reference(family, monkeypatch,
                                                                       revival_block):
    """A cut after layer 0 (block-sparse) keeps 40%; a decode step re-selects and revives
    tokens. Against mlx-lm's blocks run densely with masks by original position: in the
    block-sparse layer 2 each head's pattern of the kept (prefill) or selected (revived, new)
    tokens, pruned ones neither shifting nor widening it; ``revival_block`` 2 sends the decode
    step's rows through the gathered block path, 64 through the masked whole-cache path."""
    model, _ = family("phi3small")
    engine, prompt, logits, kept, selections = cut_after_layer_0(
        model, ModelAdapter(model).vocab_size, monkeypatch, revival_block)
    n, windows = len(prompt), sliding_windows(model)
    masks = [dense_mask(n, windows[0], [None] * n)]
    masks += [dense_mask(n, w, [kept] * n) for w in windows[1:]]
    assert rel_err(logits, _phi3small_dense_logits(model, prompt, masks, monkeypatch)) < LOGITS_TOL
    tokens, logits, _, sees, revived = decode_one(engine, prompt, logits, kept, selections)
    assert len(revived)
    masks = [dense_mask(n + 1, windows[0], [None] * (n + 1))]
    masks += [dense_mask(n + 1, w, sees) for w in windows[1:]]
    assert rel_err(logits, _phi3small_dense_logits(model, tokens, masks, monkeypatch)) < LOGITS_TOL


def test_the_tiny_internlm2_and_qwen_are_what_they_claim(family):
    """InternLM2: one biased wqkv whose rows hold, for each of 2 key/value heads, its 2
    queries, key and value (the adapter's q/k/v: those rows, not thirds); dynamic NTK RoPE,
    random norms, the untied head ``output``. Qwen 1: one biased c_attn of thirds, as many
    key/value heads as heads, random biases on c_proj and the MLP (w2 its gate), an lm_head
    with a bias."""
    intern, _ = family("internlm2")
    attn, a = intern.layers[0].attention, ModelAdapter(intern)
    assert (attn.n_kv_heads, attn.n_kv_groups, a.n_heads, a.n_kv_heads) == (2, 2, 4, 2)
    assert attn.wqkv.weight.shape == (2 * (2 + 2) * 16, 64) and "bias" in attn.wo
    assert type(attn.rope).__name__ == "DynamicNTKScalingRoPE" and a.lm_head is intern.output
    assert _random(intern.layers[0].attention_norm.weight, intern.model.norm.weight)
    x = a.embed(mx.array([1, 2, 3]))
    q, k, v, _ = a.qkv(0, x, np.arange(3))
    rows = attn.wqkv(intern.layers[0].attention_norm(x)).reshape(3, 2, 4, 16)
    assert rel_err(v, rows[:, :, 3].transpose(1, 0, 2)[None]) < 1e-6
    qwen, _ = family("qwen")
    attn, a = qwen.layers[0].attn, ModelAdapter(qwen)
    assert (a.n_heads, a.n_kv_heads, a.scale) == (4, 4, 16 ** -0.5) and a.lm_head is qwen.lm_head
    assert attn.c_attn.weight.shape == (3 * 64, 64) and "bias" in qwen.lm_head
    assert all(float(mx.abs(p.bias).sum()) > 0 for p in (attn.c_attn, attn.c_proj,
                                                          qwen.layers[0].mlp.w2))
    assert a._activations == ["silu"] * 4 and _random(qwen.transformer.ln_f.weight)


def test_the_tiny_nanochat_is_what_it_claims(family):
    """No norm weights anywhere (mlx-lm's rms_norm function is every norm, the identity's
    norm part empty), no biases, 2 key/value heads to 4 query heads, raw logits far past
    the soft-cap of 15, so that a dropped cap shows."""
    from mlx_lm.models import nanochat

    model, _ = family("nanochat")
    a = ModelAdapter(model)
    names = [name for name, _ in tree_flatten(model.parameters())]
    assert not any("norm" in name or "bias" in name for name in names)
    assert a._final_norm is nanochat.rms_norm and not decode_identity(a.identity())[1].any()
    assert (a.n_heads, a.n_kv_heads, a.variant()) == (4, 2, "float32")
    raw = model.lm_head(model.transformer(mx.array(random_prompt(64, a.vocab_size))[None]))
    assert float(mx.abs(raw).max()) > 15 * 1.5


def test_the_tiny_gemma_and_cohere_are_what_they_claim(family):
    """Gemma 1: (1 + w) norms with w random, heads 32 wide (head_dim, not 64 / 4), a tied
    head, its exact-GELU MLP run as mlx-lm's module (the CPU kernel's tanh GELU differs);
    Command R+: one random LayerNorm a layer, every layer global with traditional RoPE,
    per-head q/k LayerNorms (a random weight per head), logits times 0.3, a tied head."""
    gemma, _ = family("gemma")
    layer, a = gemma.layers[0], ModelAdapter(gemma)
    assert float(mx.abs(layer.input_layernorm.weight).max()) > 0.05
    assert layer.self_attn.head_dim == 32 and layer.self_attn.q_proj.weight.shape == (128, 64)
    assert a.lm_head is None and a._activations == [None] * 4 and a._embed_scale == 8.0
    cohere, _ = family("cohere")
    layer, a = cohere.layers[0], ModelAdapter(cohere)
    assert "post_attention_layernorm" not in layer and a._parallel
    assert _random(layer.input_layernorm.weight) and "bias" not in layer.input_layernorm
    assert sliding_windows(cohere) == [None] * 4 and layer.self_attn.rope.traditional
    assert layer.self_attn.q_norm.weight.shape == (4, 16) and _random(
        layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight)
    assert cohere.args.logit_scale == 0.3 and a.lm_head is None


def test_the_tiny_phi_and_gpt_neox_are_what_they_claim(family):
    """Phi-2: one random LayerNorm per layer, RoPE over 6 of 16 head dims, grouped heads, a
    head with a bias; GPT-NeoX: one fused q/k/v (3 x 4 heads x 16), RoPE over 4 dims, two
    random LayerNorms per layer (parallel, or one after the other), its head ``embed_out``."""
    phi, _ = family("phi")
    layer, a = phi.layers[0], ModelAdapter(phi)
    assert a._parallel and "post_attention_layernorm" not in layer
    assert layer.self_attn.rope.dims == 6 and a.n_kv_heads == 2 and a.n_heads == 4
    assert _random(layer.input_layernorm.weight, a._final_norm.weight)
    assert a.lm_head is phi.lm_head and float(mx.abs(phi.lm_head.bias).sum()) > 0
    for kind, parallel in (("gpt_neox", True), ("gpt_neox-sequential", False)):
        neox, _ = family(kind)
        layer, a = neox.layers[0], ModelAdapter(neox)
        assert layer.attention.query_key_value.weight.shape == (3 * 64, 64)
        assert layer.attention.rope.dims == 4 and a.n_kv_heads == a.n_heads == 4
        assert a._parallel == parallel and a.lm_head is neox.model.embed_out
        assert _random(layer.input_layernorm.weight, layer.post_attention_layernorm.weight)


def test_the_tiny_gptj_dbrx_and_phixtral_are_what_they_claim(family):
    """GPT-J: traditional RoPE over 6 of 16 head dims, parallel layers, a biased head; DBRX: its
    clip_qkv (0.5) below two fifths of the fused q/k/v of random inputs, 2 key/value heads (in
    its config's attn_config), LayerNorms without biases; Phixtral: the final norm and head of its
    head module; each one's random norms in its identity."""
    gptj, dbrx, phixtral = (family(kind)[0] for kind in ("gptj", "dbrx", "phixtral"))
    rope = gptj.layers[0].attn.rope
    assert rope.dims == 6 and rope.traditional and ModelAdapter(gptj)._parallel
    assert float(mx.abs(gptj.lm_head.bias).sum()) > 0
    attn = attention_module(dbrx.layers[0])
    x = mx.random.normal((64, 64), key=mx.random.key(1))
    assert attn.clip_qkv == 0.5 and float((mx.abs(attn.Wqkv(x)) > 0.5).mean()) > 0.3
    assert ModelAdapter(dbrx).fingerprint()["num_key_value_heads"] == 2
    assert "bias" not in dbrx.layers[0].norm_attn_norm.norm_1
    a = ModelAdapter(phixtral)
    assert a._final_norm is phixtral.lm_head.ln and a.lm_head is phixtral.lm_head.linear
    for model in (gptj, dbrx, phixtral):
        assert np.abs(decode_identity(ModelAdapter(model).identity())[1]).max() > 0


def test_the_tiny_nemotron_and_openelm_are_what_they_claim(family):
    """Nemotron's LayerNorms of (1 + w), their weights and biases random, RoPE over 8 of 16
    head dims, a plain MLP (no CPU kernel); OpenELM's query and key/value heads differing by
    layer (the fingerprint sums them), its norms (q/k per head) random and named otherwise,
    its SwiGLU on the CPU kernel, a tied head."""
    model, _ = family("nemotron")
    layer, a = model.layers[0], ModelAdapter(model)
    norm = layer.input_layernorm
    assert type(norm).__name__ == "NemotronLayerNorm1P" and _random(norm.weight)
    assert float(mx.abs(norm.bias).sum()) > 0 and layer.self_attn.rope.dims == 8
    assert a._activations == [None] * 4 and a.lm_head is model.lm_head
    model, _ = family("openelm")
    a = ModelAdapter(model)
    heads = [(layer.attn.n_heads, layer.attn.n_kv_heads) for layer in model.layers]
    assert heads == [(2, 1), (4, 2), (4, 2), (6, 3)]
    assert (a.fingerprint()["num_attention_heads"], a.fingerprint()["hidden_size"]) == (16, 64)
    layer = model.layers[1]
    assert _random(layer.attn_norm.weight, layer.ffn_norm.weight, layer.attn.q_norm.weight,
                   a._final_norm.weight)
    assert a._activations[0] == "silu" and a.lm_head is None


@BOTH_IMPLEMENTATIONS
def test_the_tiny_plamo3_is_what_it_claims_and_slides_as_mlx_lms_caches(family):
    """PLaMo 3's fused q/k/v and gate/up, its four norms (random weights beside mlx-lm's
    offsets) named otherwise, layers 0 and 2 sliding with RoPE at base 10000, 1 and 3 global at
    1e6; over a window of 24 the engine's decode steps see what mlx-lm's caches keep (24 keys;
    mlx-lm's prompt mask sees 25, so the prompt stays inside the window)."""
    model, _ = family("plamo3")
    layer, a = model.layers[0], ModelAdapter(model)
    assert "qkv_proj" in layer.mixer and "gate_up_proj" in layer.mlp and a._activations[0]
    assert all(float(mx.abs(norm.weight).max()) > 0.05 for norm in (
        layer.pre_mixer_norm, layer.post_mixer_norm, layer.pre_mlp_norm, layer.post_mlp_norm))
    assert [lyr.mixer.rope.base for lyr in model.layers] == [10000.0, 1e6] * 2
    assert sliding_windows(family("plamo3-window")[0]) == [24, None, 24, None]
    prompt = random_prompt(16, a.vocab_size, seed=5)
    assert mlx_lm_error(family("plamo3-window")[0], PruningConfig("full"), prompt, 30) < LOGITS_TOL


def test_the_tiny_lille_plamo_and_bitnet_are_what_they_claim(family, monkeypatch):
    """Lille's norms inside its attention and MLP modules, random, its MLP run as its module
    (its norm once); PLaMo 1's one random norm, 2 key/value heads tiled over 4 query heads
    (head i reads i mod 2), their order for the engine's groups; BitNet's every ternary value,
    scales unlike 1, random sub-norms, its MLP run as its module; without Metal, refused."""
    lille, _ = family("lille-130m")
    layer, a = lille.layers[0], ModelAdapter(lille)
    assert _random(layer.attention.norm.weight, layer.feed_forward.norm.weight)
    assert a._activations == [None] * 4 and a.lm_head is None and "qkv_proj" in layer.attention
    plamo, _ = family("plamo")
    layer, a = plamo.layers[0], ModelAdapter(plamo)
    assert _random(layer.norm.weight) and a._parallel and (a.n_heads, a.n_kv_heads) == (4, 2)
    assert a._head_order.tolist() == [0, 2, 1, 3] and a._head_return.tolist() == [0, 2, 1, 3]
    bitnet, _ = family("bitnet")
    attn = bitnet.layers[0].self_attn
    values = np.unique(np.concatenate([(np.array(attn.q_proj.weight) >> s) & 3
                                       for s in (0, 2, 4, 6)]))
    assert values.tolist() == [0, 1, 2] and abs(float(attn.q_proj.weight_scale[0]) - 1) > 0.5
    assert _random(attn.attn_sub_norm.weight, bitnet.layers[0].mlp.ffn_sub_norm.weight)
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    with pytest.raises(UserInputError, match="cannot run bitnet models here: .* no Metal"):
        ModelAdapter(bitnet)
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    assert ModelAdapter(bitnet)._activations == [None] * 4


def test_a_plamo_whose_heads_are_not_its_tiled_heads_is_refused():
    """PLaMo 1 tiles ceil(heads / n_shared_head) key/value heads n_shared_head times: 4 heads
    over n_shared_head 3 (2 key/value heads, 6 tiled) is no model mlx-lm runs either."""
    model_class, args_class = mlx_lm.utils._get_classes(tiny_config("plamo"))
    model = model_class(args_class.from_dict({**tiny_config("plamo"), "n_shared_head": 3}))
    with pytest.raises(UserInputError, match="4 heads are not its 2 key/value heads times"):
        ModelAdapter(model)


def test_the_tiny_laguna_is_what_it_claims(family):
    """Laguna's query heads by layer over 2 key/value heads, its gain per head (the softplus of
    g_proj's, from 0.02 to 4 here: a gate taken as a sigmoid or dropped shows), RoPE over whole
    heads in the sliding layers and YaRN over half of each in the global ones; layer 0 dense,
    the others 2 of 4 experts beside a shared one."""
    model, _ = family("laguna")
    a = ModelAdapter(model)
    assert [(lyr.self_attn.n_heads, lyr.self_attn.n_kv_heads) for lyr in model.layers] == [
        (4, 2), (8, 2), (4, 2), (8, 2)]
    assert sliding_windows(model) == [24, None, 24, None]
    ropes = [(type(lyr.self_attn.rope).__name__, lyr.self_attn.rope.dims) for lyr in model.layers]
    assert ropes == [("RoPE", 16), ("YarnRoPE", 8)] * 2
    x = a.layers[1].input_layernorm(mx.random.normal((1, 64, 64), key=mx.random.key(0)))
    gain = nn.softplus(model.layers[1].self_attn.g_proj(x))
    assert gain.shape == (1, 64, 8) and float(gain.min()) < 0.5 < 2 < float(gain.max())
    assert a._activations[0] == "silu" and model.layers[1].mlp.gate.top_k == 2
    assert "shared_expert" in model.layers[1].mlp


def test_the_tiny_talkie_is_what_it_claims(family):
    """Talkie's gains random (a dropped one shows), its head a bare matrix; a token's hidden
    state carries its normed embedding after its own (twice the hidden width), which no layer
    changes."""
    model, _ = family("talkie")
    a, block = ModelAdapter(model), model.layers[1]
    gains = [block.attn_gain.a_g, block.mlp_gain.a_g, block.embed_skip.a_g,
             block.attn.head_gain.head_g, model.lm_head_gain.w_g]
    assert all(float(mx.abs(g - 1).min()) > 0.01 and float(mx.abs(g).min()) > 0.4 for g in gains)
    tokens = mx.array([5, 9, 11])
    h = a.embed(tokens)
    embedded = mx.fast.rms_norm(model.model.embed(tokens), None, model.args.rms_norm_eps)
    assert h.shape == (1, 3, 128) and mx.array_equal(h[..., 64:], embedded[None])
    positions = np.arange(3)
    q, k, v, gate = a.qkv(0, h, positions)
    out = a.finish(0, h, mx.fast.scaled_dot_product_attention(q, k, v, scale=a.scale,
                                                              mask="causal"), gate)
    assert mx.array_equal(out[..., 64:], h[..., 64:])


def test_the_tiny_nanbeige_is_what_it_claims(family):
    """Nanbeige's 2 blocks run twice (``num_loops``), each pass with its own keys and values
    (mlx-lm's cache has 4 entries): 4 layers to the engine, the final (random) norm also
    after layer 1, where the first loop ends, but in the variant that skips it."""
    model, _ = family("nanbeige")
    a = ModelAdapter(model)
    assert len(model.layers) == 2 and a.num_layers == 4 and len(make_prompt_cache(model)) == 4
    assert a.layers[2] is a.layers[0] and a.layers[3] is a.layers[1]
    assert a._loop_ends == {1} and _random(model.model.norm.weight)
    assert not ModelAdapter(family("nanbeige-skip")[0])._loop_ends


def test_the_tiny_minicpm3_and_youtu_are_what_they_claim(family):
    """Both: latent attention expanded per head (``kv_b_proj``, no absorbed form) with
    low-rank queries, random norms (the two low-rank ones too), 4 heads whose keys are 32
    unrotated and 8 rotated dims, the scale 1/sqrt(40). MiniCPM3: values hidden / heads = 16
    wide, longrope's SuScaledRoPE with long factors and a scale above 1, its scale named
    ``softmax_scale``, MiniCPM's multipliers, an untied head. Youtu-LLM: its args at
    ``config`` (no ``args``), values 24 wide, traditional RoPE, biases on q_a_proj, o_proj
    and the MLP, a tied head."""
    widths = {}
    for kind in ("minicpm3", "youtu_llm"):
        model, _ = family(kind)
        attn, a = model.layers[0].self_attn, ModelAdapter(model)
        assert hasattr(attn, "kv_b_proj") and not hasattr(attn, "embed_q")
        assert attn.q_lora_rank == 32 and a._mla and a.scale == 40 ** -0.5
        assert _random(attn.q_a_layernorm.weight, attn.kv_a_layernorm.weight,
                       model.layers[0].input_layernorm.weight)
        q, k, v, _ = a.qkv(0, a.embed(mx.array([1, 2, 3])), np.arange(3))
        widths[kind] = q.shape[-1], k.shape[-1], v.shape[-1]
    minicpm3, _ = family("minicpm3")
    attn, args = minicpm3.layers[0].self_attn, minicpm3.args
    assert type(attn.rope).__name__ == "SuScaledRoPE" and attn.rope._scale > 1
    assert attn.softmax_scale == 40 ** -0.5 and not hasattr(attn, "scale")
    assert (args.scale_emb, args.scale_depth, args.dim_model_base) == (12.0, 1.4, 16)
    assert ModelAdapter(minicpm3).lm_head is minicpm3.lm_head
    youtu, _ = family("youtu_llm")
    attn = youtu.layers[0].self_attn
    assert not hasattr(youtu, "args") and youtu.config.tie_word_embeddings
    assert attn.rope.traditional and ModelAdapter(youtu).lm_head is None
    assert all(float(mx.abs(p.bias).sum()) > 0 for p in (attn.q_a_proj, attn.o_proj,
                                                          youtu.layers[0].mlp.down_proj))
    assert widths == {"minicpm3": (40, 40, 16), "youtu_llm": (40, 40, 24)}


def test_a_tied_minicpm_leaves_its_logits_unscaled(family):
    """mlx-lm's MiniCPM divides the logits by hidden_size / dim_model_base only through an
    untied head; a tied one (which its loader cannot read: built here from the untied
    model's weights) multiplies by the embedding unscaled, and so does the adapter."""
    from mlx_lm.models import minicpm

    untied, _ = family("minicpm")
    model = minicpm.Model(minicpm.ModelArgs.from_dict(
        {**tiny_config("minicpm"), "tie_word_embeddings": True}))
    model.load_weights([(k, v) for k, v in tree_flatten(untied.parameters())
                        if not k.startswith("lm_head")])
    prompt = random_prompt(100, ModelAdapter(model).vocab_size, seed=2)
    assert mlx_lm_error(model, PruningConfig("full"), prompt, 4) < LOGITS_TOL


def test_the_tiny_gpt2_and_starcoder_are_what_they_claim(family):
    """GPT-2 and StarCoder 1: fused c_attn (StarCoder's multi-query: one key/value head),
    random LayerNorms, a tied (GPT-2) and an untied (StarCoder) head, config names of their
    own; the learned positions random, added at the positions given (not the rows), none past
    the table's 1,024 (refused in one line), which is also the context api reads."""
    from mlx_lazy.api import context_length

    gpt2, _ = family("gpt2")
    starcoder, _ = family("gpt_bigcode")
    for model, kv_heads in ((gpt2, 4), (starcoder, 1)):
        a, layer = ModelAdapter(model), model.layers[0]
        assert "c_attn" in layer.attn and "q_proj" not in layer.attn
        assert (a.n_heads, a.n_kv_heads) == (4, kv_heads)
        assert not hasattr(model.args, "hidden_size") and a.fingerprint()["hidden_size"] == 64
        assert _random(layer.ln_1.weight, layer.ln_2.weight, a._final_norm.weight)
        assert context_length(model, None) == 1024
        tokens, positions = mx.array([5, 9]), np.array([0, 700])
        expected = a._embedding(tokens) + a._position_embedding(mx.array(positions))
        assert mx.array_equal(a.embed(tokens, positions)[0], expected)
        assert not mx.array_equal(a.embed(tokens)[0], expected)
        with pytest.raises(UserInputError, match="position 1024 is past the model's 1024"):
            a.embed(tokens, np.array([1023, 1024]))
    assert ModelAdapter(gpt2).lm_head is None
    assert ModelAdapter(starcoder).lm_head is starcoder.lm_head


@pytest.mark.parametrize("kind", ("gpt2", "gpt_bigcode"))
def test_a_later_chunk_takes_its_learned_positions(family, kind):
    """A follow-up prompt chunk (positions 200 to 299) gets the learned position embedding at
    its tokens' original positions: those pruned at the cut and revived by decode steps have
    the keys and values of mlx-lm's one forward over the whole prompt."""
    keys, values, ref_keys, ref_values = _revived_kv(family(kind)[0], first=200)
    assert rel_err(keys, ref_keys) < 1e-5
    assert rel_err(values, ref_values) < 1e-5


def test_dynamic_ntk_rope_on_scattered_positions_is_one_call_over_their_span():
    """InternLM3's dynamic NTK RoPE takes its base from where a call ends (past
    max_position_embeddings, 64 here, the base grows): tokens at scattered positions get
    what mlx-lm's one call over positions 3..100 gives them (a chunk ending where they end),
    unlike the unscaled base."""
    from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE

    from mlx_lazy.adapter import _rope

    rope = DynamicNTKScalingRoPE(16, 64, False, 10000.0, 6.0)
    x = mx.random.normal((1, 2, 98, 16), key=mx.random.key(0))
    positions = np.array([3, 10, 70, 100])
    rows = mx.array(positions - 3)
    want = rope(x, offset=3)[:, :, rows]
    assert rel_err(_rope(rope, x[:, :, rows], positions), want) < 1e-6
    plain = nn.RoPE(16, base=10000.0)(x, offset=3)[:, :, rows]
    assert rel_err(plain, want) > 1e-3


def _mlx_lm_kv(model, layer: int, layer_cache):
    """mlx-lm's cached keys and values of ``layer`` as the engine holds them: the absorbed
    latent attention caches the latent and rope(k_pe), whose concatenation is the engine's
    key and the latent its value; DeepSeek-V3.2's its indexer keys too (a second cache), after
    them in the engine's; MiniMax-M3's sparse layers' indexer keys after each key head's."""
    index_keys = []
    if isinstance(layer_cache, CacheList):
        layer_cache, index_keys = layer_cache[0], [c.keys for c in layer_cache.caches[1:]]
    keys, values = layer_cache.keys, layer_cache.values
    if hasattr(attention_module(ModelAdapter(model).layers[layer]), "embed_q"):
        return mx.concatenate([keys, values, *index_keys], axis=-1), keys
    if index_keys:  # MiniMax-M3
        index_keys = mx.broadcast_to(index_keys[0], (*keys.shape[:3], index_keys[0].shape[-1]))
        return mx.concatenate([keys, index_keys], axis=-1), values
    return keys, values


@BOTH_IMPLEMENTATIONS
def test_a_waiting_token_keeps_the_inputs_of_the_layers_ahead(family):
    """Gemma 4 E2B/E4B: a token pruned after layer 1 waits in the Aux Cache with its hidden
    state and the per-layer inputs of layers 2 and 3 (those mlx-lm's forward makes from its
    id and embedding), which a revival or a completion then uses; past the last layer none
    are left."""
    model, _ = family("gemma4_text-e2b")
    a = ModelAdapter(model)
    prompt = random_prompt(200, a.vocab_size, seed=6)
    engine = LazyEngine(model, resolve_config(model, PruningConfig(
        "lazy", prune_layers=(1,), keep=(0.3,), complete="none")))
    engine.prefill(prompt)
    entry = engine.cache.aux[2]
    inner = model.model
    h = inner.embed_tokens(prompt[None]) * inner.embed_scale
    inputs = inner._project_per_layer_inputs(h, inner._get_per_layer_inputs(prompt[None]))
    want = inputs[0, mx.array(entry.positions.astype(np.int32)), 2:].reshape(
        1, len(entry.positions), -1)
    assert entry.data.shape[2] == 64 + 2 * 32
    assert rel_err(entry.data[..., 64:], want) < 1e-6
    assert engine.decode(int(prompt[-1])).shape == (a.vocab_size,)


@BOTH_IMPLEMENTATIONS
def test_a_waiting_gemma3n_token_keeps_its_streams_and_the_inputs_ahead(family):
    """Gemma 3n (the tiny one: sparse MLP gates in layers 0 and 1, layers 0 and 2 sliding,
    layer 3 reading layer 1's keys and values, AltUp's output scale not zero): a token pruned
    after layer 1 waits with its 4 AltUp streams as mlx-lm's own layers 0 and 1 leave them, then
    the per-layer inputs of layers 2 and 3; a revival or a completion goes on from them."""
    from mlx_lm.models.base import create_attention_mask

    model, _ = family("gemma3n")
    a, text = ModelAdapter(model), model.model.language_model
    assert [layer.mlp.activation_sparsity for layer in a.layers] == [0.95, 0.95, 0.0, 0.0]
    assert [a.kv_layer(layer) for layer in range(4)] == [0, 1, 2, 1]
    assert sliding_windows(model) == [24, None, 24, None]
    assert all(float(mx.abs(layer.altup.correct_output_scale).min()) > 0.5 for layer in a.layers)
    prompt = random_prompt(200, a.vocab_size, seed=6)
    engine = LazyEngine(model, resolve_config(model, PruningConfig(
        "lazy", prune_layers=(1,), keep=(0.3,), complete="none")))
    engine.prefill(prompt)
    entry = engine.cache.aux[2]
    h = text.embed_tokens(prompt[None]) * 64 ** 0.5  # mlx-lm's forward, up to layer 2
    inputs = text.project_per_layer_inputs(h, text.get_per_layer_inputs(prompt[None]))
    streams = mx.stack([h, *(p(h) for p in text.altup_projections)])
    rms = [mx.mean(x ** 2, axis=-1, keepdims=True) ** 0.5 for x in (h, streams[1:])]
    streams[1:] = streams[1:] * (rms[0] / rms[1])
    for layer, window in enumerate((24, None)):
        streams = text.layers[layer](streams, create_attention_mask(h, None, window), None,
                                     inputs[:, :, layer])
    rows = mx.array(entry.positions.astype(np.int32))
    want = mx.concatenate([streams[:, 0, rows].transpose(1, 0, 2).reshape(len(rows), -1),
                           inputs[0, rows, 2:].reshape(len(rows), -1)], axis=-1)
    assert entry.data.shape == (1, len(rows), 4 * 64 + 2 * 16)
    assert rel_err(entry.data[0], want) < 1e-5
    assert engine.decode(int(prompt[-1])).shape == (a.vocab_size,)


@by_implementation(["gemma4_text-e2b", "gpt_oss", "olmo3", "deepseek_v3",
                                  "deepseek_v2", "gemma2", "hunyuan", "llama4", "exaone",
                                  "nanochat", "nanbeige", "deepseek_v32", "gemma3n",
                                  "longcat_flash_ngram", "minimax_m3_vl"])
def test_a_pruned_prompt_cache_saves_and_loads(family, kind, tmp_path):
    """A pruned prompt cache (tokens waiting, KV at some layers only, Gemma 4 E2B's layers
    holding none and its tokens' per-layer inputs, latent attention's values narrower than
    its keys, EXAONE 3's weights named otherwise, nanochat's without norm weights, Nanbeige's
    layers twice its blocks, Gemma 3n's AltUp streams, MiniMax-M3's indexer keys after its
    keys, past its block budget) is
    written, checked on load and answers the next turn as the live cache
    does."""
    model, tokenizer = family(kind)
    config = PruningConfig("lazy", prune_layers=(1,), keep=(0.3,), complete="none")
    live = make_lazy_cache(model, config)
    text = "The quick brown fox jumps over the lazy dog. " * 30
    generate(model, tokenizer, text, max_tokens=4, prompt_cache=live, config=config)
    assert live.engine.cache.aux, "some tokens should wait in the Aux Cache"
    save_prompt_cache(tmp_path / "c.safetensors", live)
    loaded = load_prompt_cache(tmp_path / "c.safetensors", model)
    answers = [generate(model, tokenizer, " And then?", max_tokens=8, prompt_cache=cache,
                        config=config) for cache in (loaded, live)]
    assert answers[0] == answers[1]


def _seen_keys(engine):
    """Records, for every attention of ``engine`` as it happens: its layer, whether every
    key it sees belongs to a token computed at that layer, and whether the keys it reads
    hold any token that was not."""
    seen, current = [], []
    qkv, attention = engine.adapter.qkv, engine.attention

    def recording_qkv(layer, h, positions):
        current[:] = [layer]
        return qkv(layer, h, positions)

    def recording_attention(q, kv, rows, visible, *args):
        layer, keys = current[0], kv.cached_positions()
        shown = keys if visible is None else keys[np.array(visible)]
        computed = engine.cache.computed[layer]
        seen.append((layer, bool((computed[shown] > 0).all()), bool((computed[keys] == 0).any())))
        return attention(q, kv, rows, visible, *args)

    engine.adapter.qkv, engine.attention = recording_qkv, recording_attention
    return seen


@BOTH_IMPLEMENTATIONS
@pytest.mark.parametrize("kind, config, reading", [
    ("gemma4_text-e2b", PruningConfig("speed", speed_cutoff=2), {2, 3}),
    ("gemma4_text-e2b", PruningConfig("lazy", prune_layers=(0, 1), keep=(0.6, 0.3),
                                      complete="none"), {2, 3}),
    ("gemma4_text-e2b", PruningConfig("lazy", prune_layers=(1, 2), keep=(0.5, 0.2),
                                      complete="progressive:40"), {2, 3}),
    ("hunyuan", PruningConfig("lazy", prune_layers=(0, 2), keep=(0.5, 0.3),
                              complete="progressive:40"), {1, 3}),
    ("afm7", PruningConfig("lazy", prune_layers=(1, 2), keep=(0.5, 0.3),
                           complete="progressive:40"), {3}),
    ("iquestloopcoder", PruningConfig("lazy", prune_layers=(0, 1), keep=(0.5, 0.3),
                                      complete="progressive:40"), {2, 3})])
def test_a_layer_reading_lower_keys_sees_only_tokens_computed_there(family, kind, config,
                                                                     reading):
    """Gemma 4's layers 2 and 3 read the keys and values of layers 0 and 1, Hunyuan's CLA
    layers 1 and 3 those of 0 and 2, IQuest-Loop-Coder's second loop (2, 3) those of its first
    beside its own, which also hold the tokens that stopped below them
    (SPEED's prompt, pruned tokens): each sees, as a layer with its own keys would, only the
    keys of tokens computed at it, through prefill, decode steps (revivals) and completion."""
    model, _ = family(kind)
    engine = LazyEngine(model, resolve_config(model, config))
    seen = _seen_keys(engine)
    token = int(mx.argmax(engine.prefill(random_prompt(200, 384, seed=5))))
    for _ in range(12):
        token = int(mx.argmax(engine.decode(token)))
    engine.complete()
    assert all(only_computed for _, only_computed, _ in seen)
    assert {layer for layer, _, others in seen if others} == reading, \
        "exactly the reading layers should have been given keys of tokens not computed at them"
    assert engine.stats.max_computations_per_token_layer == 1


@pytest.mark.parametrize("kind", FAMILIES)
def test_the_families_run_with_both_attention_implementations_are_those_that_need_it(family,
                                                                                     kind):
    """:data:`ATTENTION_FEATURED` is exactly the families whose attention has a feature an
    implementation may get wrong: a family gaining one runs with both, or this fails."""
    assert bool(attention_features(family(kind)[0])) == (kind in ATTENTION_FEATURED)


@by_implementation(FAMILIES)
def test_unpruned_matches_mlx_lm(family, kind, monkeypatch):
    model, _ = family(kind)
    prompt = random_prompt(300, ModelAdapter(model).vocab_size)
    monkeypatch.setattr(LazyEngine, "finish_rows", 64)  # a layer's output in row blocks
    assert (mlx_lm_error(model, PruningConfig("full"), prompt, 32, block_size=64)
            < LOGITS_TOLS.get(kind, LOGITS_TOL))


@by_implementation(FAMILIES)
def test_nothing_pruned_by_a_cut_matches_mlx_lm(family, kind):
    """The pruning path (a cut that keeps everything, tokens at explicit positions) too."""
    model, _ = family(kind)
    prompt = random_prompt(200, ModelAdapter(model).vocab_size, seed=4)
    config = PruningConfig("lazy", prune_layers=(1,), keep=(1.0,))
    assert mlx_lm_error(model, config, prompt, 8) < LOGITS_TOLS.get(kind, LOGITS_TOL)


@by_implementation(("phi3", "smollm3", "mistral3", "glm4_moe", "seed_oss",
                                  "ernie4_5_moe", "gpt_oss", "olmo3", "exaone4",
                                  "gemma4_text-moe", "gemma4_text-e2b", "deepseek_v3",
                                  "deepseek_v2", "mistral4", "kimi_vl", "gemma2", "glm4",
                                  "starcoder2", "cohere2", "deepseek_v32",
                                  "helium", "internlm3", "apertus", *MOE, *MOE2, *DENSE))
def test_quantized_unpruned_matches_mlx_lm(family_dir, kind):
    model, _ = mlx_lm.load(str(family_dir(kind)))
    base = ModelAdapter(model).identity()
    # Muse Spark's: what mlx-lm's quant_predicate quantizes (its forward casts the head's input
    # to the head's weight dtype: a quantized head's is uint32)
    nn.quantize(model, group_size=32, bits=4,
                class_predicate=model.quant_predicate if kind == "muse_spark" else None)
    assert identities_match(base, ModelAdapter(model).identity())
    prompt = random_prompt(100, ModelAdapter(model).vocab_size, seed=2)
    nothing_pruned = PruningConfig("lazy", prune_layers=(1,), keep=(1.0,))
    assert mlx_lm_error(model, nothing_pruned, prompt, 4) < LOGITS_TOLS.get(kind, LOGITS_TOL)


def _revived_kv(model, first: int = 300, layer: int = 2, cut: int | None = None,
                cache_of: int | None = None) -> tuple:
    """Layer ``layer``'s keys and values of the prompt tokens a cut after ``cut`` (the layer
    below by default) pruned and 16 decode steps revived from the Aux Cache, beside mlx-lm's of
    the same tokens from one forward over the whole 300-token prompt, its cache ``cache_of``
    (the layer's by default; LongCat-Flash's: two layers a block, a cache each). ``first`` <
    300: the rest is a follow-up chunk (``extend``) and only its tokens count."""
    prompt = random_prompt(300, ModelAdapter(model).vocab_size, seed=3)
    cache = make_prompt_cache(model)
    model(prompt[None], cache=cache)
    cut = layer - 1 if cut is None else cut
    engine = LazyEngine(model, resolve_config(model, PruningConfig(
        "lazy", prune_layers=(cut,), keep=(0.3,))))
    logits = engine.prefill(prompt[:first])
    start = 0
    if first < len(prompt):
        logits, start = engine.extend(prompt[first:]), first
    waiting = {p for p in engine.cache.aux[cut + 1].positions.tolist() if p >= start}
    token = int(mx.argmax(logits))
    for _ in range(16):
        token = int(mx.argmax(engine.decode(token)))
    kv = engine.cache.layers[layer]
    revived = [p for p in kv.cached_positions().tolist() if p in waiting]
    assert revived, "the schedule should revive some prompt tokens"
    keys, values = kv.fetch(np.array(revived))
    longcat = model.model_type in LONGCAT_TYPES  # (the n-gram model's first: its context)
    ref_keys, ref_values = _mlx_lm_kv(
        model, layer, cache[-len(model.layers):][layer // 2][layer % 2] if longcat
        else cache[layer if cache_of is None else cache_of])
    return keys, values, ref_keys[:, :, revived], ref_values[:, :, revived]


@by_implementation([kind for kind in FAMILIES if kind != "gemma4_text-e2b"])
def test_revived_token_kv_matches_full_forward(family, kind):
    """Tokens pruned at the cut wait in the Aux Cache; revived, their keys and values (RoPE
    at their original, scattered positions) equal mlx-lm's full forward."""
    keys, values, ref_keys, ref_values = _revived_kv(family(kind)[0])
    assert rel_err(keys, ref_keys) < 1e-5
    assert rel_err(values, ref_values) < 1e-5


@by_implementation((*FAMILIES, "phi3small"))
def test_pruning_runs_through(family, kind):
    """An aggressive LazyLLM schedule runs through the family: each (token, layer) computed once,
    tokens revived, fewer prompt tokens computed; a plain ``lazy`` generates."""
    model, tokenizer = family(kind)
    n = 400
    config = PruningConfig("lazy", prune_layers=(0, 1, 2), keep=(0.5, 0.2, 0.05),
                           complete="none")  # decode steps revive; each (token, layer) once
    engine = LazyEngine(model, resolve_config(model, config))
    token = int(mx.argmax(engine.prefill(random_prompt(n, ModelAdapter(model).vocab_size))))
    for _ in range(32):
        token = int(mx.argmax(engine.decode(token)))
    stats = engine.stats
    assert stats.max_computations_per_token_layer == 1 and stats.revivals > 0
    assert stats.prefill_tokens_per_layer == [n, 200, 80, 20]
    assert 0 < stats.prompt_tokens_computed_pct < 100
    text = generate(model, tokenizer, "The quick brown fox " * 20, max_tokens=4, config="lazy")
    assert isinstance(text, str)


#: mlx-lm's other names of supported types (its ``MODEL_REMAPPING``): Kimi K2's, MiniMax-M2's,
#: XVERSE's, Qwen2.5-VL's, LLaVA-format Mistral 3's and others'
ALIASES = sorted(alias for alias, family in MODEL_REMAPPING.items()
                 if family in SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("alias", ALIASES)
def test_a_checkpoint_under_another_name_runs_as_its_family(family_dir, alias, tmp_path):
    """A checkpoint whose config names a type mlx-lm builds under another one's module (the
    model keeps the checkpoint's name) loads, runs unpruned equal to mlx-lm, and prunes."""
    folder = tmp_path / alias
    shutil.copytree(family_dir(MODEL_REMAPPING[alias]), folder)
    config = json.loads((folder / "config.json").read_text())
    # without rope_scaling: transformers' AutoTokenizer refuses an unknown type's (Kimi K2's),
    # through mlx-lm's load as through ours
    (folder / "config.json").write_text(json.dumps(
        {**config, "model_type": alias, "rope_scaling": None}))
    model, _ = load(folder)
    assert model.model_type == alias
    prompt = random_prompt(200, ModelAdapter(model).vocab_size, seed=5)
    assert mlx_lm_error(model, PruningConfig("full"), prompt, 8) < LOGITS_TOL
    if alias == "deepseek_v41_text":  # (DeepSeek-V4's text model: no cut follows its layers)
        return
    engine = LazyEngine(model, resolve_config(model, PruningConfig(
        "lazy", prune_layers=(1,), keep=(0.3,), complete="none")))
    engine.prefill(prompt)
    assert engine.stats.prefill_tokens_per_layer[2] == 60


def test_llama_nemotron_revives_through_its_layers_without_attention(family, tmp_path):
    """Llama-Nemotron (``nemotron-nas``, the tiny's attention in layers 3 and 7; none in 0, 2
    and 5; one linear map for it in 1, 4 and 6; a linear MLP in 2, none in 4 and 7): a layer
    without attention computes each token alone, so the model prunes as a dense one does.
    Unpruned, and with nothing pruned by a cut after layer 3, equal to mlx-lm; tokens that cut
    prunes wait in the Aux Cache and, revived, pass through layers 4-6 to layer 7, whose keys
    and values of them equal mlx-lm's forward (the 2nd of its caches: one per layer with
    attention or a linear map for it); decoding on the pruned state revives, each (token,
    layer) computed once; a plain ``lazy`` revives and cuts after layer 3 only; a pruned prompt
    cache saves and loads; a
    cut after a layer without attention is refused naming the one that has it."""
    model, tokenizer = family("nemotron-nas")
    assert recurrent_layers(model) == () and global_layers(model) == (3,)
    assert stateless_layers(model) == (0, 1, 2, 4, 5, 6)
    assert [type(layer.self_attn).__name__ for layer in model.layers[:3]] == [
        "NoneType", "LinearSubblockReplacement", "NoneType"]
    assert type(model.layers[2].mlp).__name__ == "LinearSubblockReplacement"
    assert model.layers[4].mlp is None and model.layers[7].mlp is None
    assert [attention_module(model.layers[i]).n_kv_heads for i in (3, 7)] == [2, 1]
    prompt = random_prompt(300, ModelAdapter(model).vocab_size)
    assert mlx_lm_error(model, PruningConfig("full"), prompt, 16) < LOGITS_TOL
    nothing_pruned = PruningConfig("lazy", prune_layers=(3,), keep=(1.0,))
    assert mlx_lm_error(model, nothing_pruned, prompt[:200], 8) < LOGITS_TOL
    keys, values, ref_keys, ref_values = _revived_kv(model, layer=7, cut=3, cache_of=4)
    assert rel_err(keys, ref_keys) < 1e-5 and rel_err(values, ref_values) < 1e-5
    schedule = resolve_config(model, "lazy")
    assert schedule.revive and set(schedule.prune_layers) == {3}
    config = PruningConfig("lazy", prune_layers=(3,), keep=(0.3,), complete="none")
    live = make_lazy_cache(model, config)
    generate(model, tokenizer, "The quick brown fox jumps over the lazy dog. " * 30,
             max_tokens=8, prompt_cache=live, config=config)
    stats = live.engine.stats
    assert stats.max_computations_per_token_layer == 1 and stats.revivals > 0
    save_prompt_cache(tmp_path / "c.safetensors", live)
    loaded = load_prompt_cache(tmp_path / "c.safetensors", model)
    answers = [generate(model, tokenizer, " And then?", max_tokens=8, prompt_cache=cache,
                        config=config) for cache in (loaded, live)]
    assert answers[0] == answers[1]
    with pytest.raises(UserInputError, match="a cut must follow an attention layer of this "
                                             "model, not layer 1; its attention layers .*: 3"):
        resolve_config(model, PruningConfig("lazy", prune_layers=(1,), keep=(0.5,)))


def test_a_mistral3_checkpoint_of_another_text_model_is_refused(family_dir):
    """A ``mistral3`` checkpoint of a text model other than llama, ministral3 or mistral4
    (what mlx-lm's ``mistral3`` wraps): one error naming the text model, not a failure inside
    a layer."""
    model, _ = mlx_lm.load(str(family_dir("mistral3")))
    model.language_model.model_type = "qwen2"
    with pytest.raises(UserInputError, match="'qwen2' in a mistral3 checkpoint"):
        ModelAdapter(model)


def _dense_logits(model, tokens: np.ndarray, masks, head=None) -> mx.array:
    """mlx-lm's own blocks of a Llama-layout ``model`` (or Gemma 2's: embeddings scaled by
    sqrt(hidden), a tied head, soft-capped logits) over every token, dense, with a (n, n)
    boolean mask per layer; the last token's logits through ``head`` (the model's lm_head by
    default; MiniMax-M3's its text model's)."""
    inner = model.model
    h = inner.embed_tokens(mx.array(tokens)[None])
    if model.model_type == "gemma2":
        h = h * model.args.hidden_size ** 0.5
    for block, mask in zip(inner.layers, masks):
        h = block(h, mx.array(mask), None)
    if model.model_type != "gemma2":
        return (head or getattr(model, "language_model", model).lm_head)(inner.norm(h))[0, -1]
    cap = model.final_logit_softcapping
    return mx.tanh(inner.embed_tokens.as_linear(inner.norm(h))[0, -1] / cap) * cap


@BOTH_IMPLEMENTATIONS
@pytest.mark.parametrize("revival_block", [64, 2])
@pytest.mark.parametrize("kind", (*MLA, "deepseek_v32", "gemma2", "minimax_m3_vl"))
def test_pruned_latent_attention_equals_a_dense_reference(family, monkeypatch, kind,
                                                          revival_block):
    """A cut after layer 0 keeps 40%; a decode step re-selects and revives tokens. Against
    mlx-lm's blocks run densely with masks: above the cut the prefill's kept tokens see only
    kept keys, a revived token and the new one exactly this step's selection.
    ``revival_block`` 2 sends the decode step's rows through the gathered block path, 64
    through the masked whole-cache path. Gemma 2 too: its soft-capped attention in each
    path; and MiniMax-M3, its indexer choosing among blocks of original positions (10 of 16
    tokens, 4 kept) from which the pruned tokens are absent, as mlx-lm's chooses under the
    mask."""
    model, _ = family(kind)
    engine, prompt, logits, kept, selections = cut_after_layer_0(
        model, ModelAdapter(model).vocab_size, monkeypatch, revival_block)
    n = len(prompt)
    layers = len(model.layers)
    masks = [dense_mask(n, None, [None] * n)] + [dense_mask(n, None, [kept] * n)] * (layers - 1)
    assert rel_err(logits, _dense_logits(model, prompt, masks)) < LOGITS_TOL

    tokens, logits, _, sees, revived = decode_one(engine, prompt, logits, kept, selections)
    assert engine.stats.revivals > 0 and len(revived)
    masks = [dense_mask(n + 1, None, [None] * (n + 1))]
    masks += [dense_mask(n + 1, None, sees)] * (layers - 1)
    assert rel_err(logits, _dense_logits(model, tokens, masks)) < LOGITS_TOL


@BOTH_IMPLEMENTATIONS
@pytest.mark.parametrize("revival_block", [64, 2])
def test_pruned_cohere2_equals_a_dense_reference(family, monkeypatch, revival_block):
    """Command R7B under a cut after layer 0 (40% kept) and a decode step that revives,
    against mlx-lm's blocks run densely with masks by original position: its sliding layer
    2 (mlx-lm's window, args.sliding_window) over kept keys inside each window only, its
    global layers 1 and 3 (no RoPE) over every kept key; attention and MLP in parallel on one
    norm, logits times logit_scale, all as mlx-lm computes them."""
    model, _ = family("cohere2")
    window = model.args.sliding_window
    windows = [window if block.self_attn.use_sliding_window else None for block in model.layers]
    engine, prompt, logits, kept, selections = cut_after_layer_0(
        model, model.args.vocab_size, monkeypatch, revival_block)
    n = len(prompt)

    def head(h):
        return model.model.embed_tokens.as_linear(h) * model.args.logit_scale

    masks = [dense_mask(n, windows[0], [None] * n)]
    masks += [dense_mask(n, w, [kept] * n) for w in windows[1:]]
    assert rel_err(logits, _dense_logits(model, prompt, masks, head)) < LOGITS_TOL
    # the last token's window holds tokens pruned at layer 0, and kept ones lie before it
    assert not kept[n - window:].all() and kept[: n - window].any()

    tokens, logits, _, sees, revived = decode_one(engine, prompt, logits, kept, selections)
    assert engine.stats.revivals > 0 and len(revived)
    masks = [dense_mask(n + 1, windows[0], [None] * (n + 1))]
    masks += [dense_mask(n + 1, w, sees) for w in windows[1:]]
    assert rel_err(logits, _dense_logits(model, tokens, masks, head)) < LOGITS_TOL


def _pairs(logits) -> np.ndarray:
    """The two experts each row of router ``logits`` takes, sorted."""
    return np.sort(np.argsort(-np.array(logits), axis=-1)[:, :2], axis=-1)


def _routes_apart(router, x) -> bool:
    """Whether ``router`` (logits of each row of ``x``) sends tokens to different pairs."""
    return len({tuple(p) for p in _pairs(router(x)).tolist()}) > 2


def test_the_tiny_dots1_and_bailing_moe_are_what_they_claim(family):
    """dots.llm1: per-head q/k norms (random), layer 0 dense, then 2 of 4 experts routed by
    random weights with a random correction bias, beside a shared expert. Ling: fused
    q/k/v with biases, its attention at ``attention`` with output ``dense`` and embeddings
    ``word_embeddings``, random per-head q/k norms, RoPE over half of each head, grouped
    sigmoid routing with a random expert bias and a shared expert."""
    x = mx.random.normal((64, 64), key=mx.random.key(1))
    dots = family("dots1")[0]
    assert not hasattr(dots.layers[0].mlp, "gate")
    assert dots.layers[0].self_attn.q_norm.weight.shape == (16,)
    for layer in dots.layers[1:]:
        moe = layer.mlp
        assert moe.experts.gate_proj.weight.shape[0] == 4 and moe.gate.top_k == 2
        assert float(mx.abs(moe.gate.e_score_correction_bias).min()) > 0
        assert hasattr(moe.shared_experts, "down_proj")
        assert _routes_apart(lambda t: t @ moe.gate.weight.T, x)
        scores = mx.sigmoid(x @ moe.gate.weight.T)
        assert (_pairs(scores) != _pairs(scores + moe.gate.e_score_correction_bias)).any()
    ling = family("bailing_moe")[0]
    assert "word_embeddings" in ling.model and "embed_tokens" not in ling.model
    attn = ling.layers[0].attention
    assert float(mx.abs(attn.query_key_value.bias).sum()) > 0 and "dense" in attn
    assert float(mx.abs(attn.key_layernorm.weight - 1).max()) > 0.01 and attn.rope.dims == 8
    for layer in ling.layers[1:]:
        gate = layer.mlp.gate
        assert (gate.score_function, gate.n_group, gate.topk_group, gate.top_k) == (
            "sigmoid", 2, 1, 2)
        assert float(mx.abs(gate.expert_bias).min()) > 0 and layer.mlp.shared_experts is not None
        assert _routes_apart(gate.gate_proj, x)
        scores = mx.sigmoid(gate.gate_proj(x))
        assert (_pairs(scores) != _pairs(scores + gate.expert_bias)).any()


def test_the_tiny_longcat_flash_is_what_it_claims(family):
    """LongCat-Flash: each of its 2 blocks two engine layers (its two latent attentions, with
    their norms and MLPs; the block's MoE beside the first MLP), queries and latents scaled,
    4 experts and 2 identity ones, 2 a token. A token pruned after an even layer waits with its
    MoE output, which the odd layer adds: revived there, its keys and values are mlx-lm's."""
    model, _ = family("longcat_flash")
    a = ModelAdapter(model)
    block = model.layers[0]
    assert a.num_layers == 4 and len(model.layers) == 2
    assert attention_module(a.layers[1]) is block.self_attn[1]
    assert feed_forward(a.layers[1]) is block.mlps[1] and "shortcut" not in a.layers[1]
    assert a.layers[0].shortcut is block.mlp and block.mlp.router.n_routed_experts == 6
    assert block.self_attn[0].mla_scale_q_lora == 2 ** 0.5 == block.self_attn[0].mla_scale_kv_lora
    keys, values, ref_keys, ref_values = _revived_kv(model, layer=1)
    assert rel_err(keys, ref_keys) < 1e-5 and rel_err(values, ref_values) < 1e-5


@BOTH_IMPLEMENTATIONS
def test_the_tiny_longcat_flash_ngram_embeds_tokens_by_the_ids_before_them(family, tmp_path):
    """LongCat-Flash-Ngram: a token's embedding reads the ids of the 3 tokens before it, which
    the engine's state keeps past the prompt (decode steps, later turns, the revived tokens'
    hidden states carry theirs); a prompt-cache file's must be the last 3 tokens' ids."""
    model, tokenizer = family("longcat_flash_ngram")
    a = ModelAdapter(model)
    assert a.context_width == 3 and a.vocab_size == 384
    token = mx.array([7])
    after = [a.embed(token, context=[mx.array([[i, 5, 6]], mx.int64)]) for i in (4, 9)]
    assert rel_err(after[0], after[1]) > 0.01  # the 4-gram's part
    assert rel_err(after[0], a.embed(token)) > 0.01  # and the sequence's start
    cache = make_lazy_cache(model, "full")
    generate(model, tokenizer, "The quick brown fox", max_tokens=2, prompt_cache=cache)
    context = cache.engine.cache.recurrent[EMBEDDING_STATE][0]
    assert context.tolist() == [cache.tokens[-3:]]
    save_prompt_cache(tmp_path / "c.safetensors", cache)
    arrays, meta = mx.load(str(tmp_path / "c.safetensors"), return_metadata=True)
    arrays[f"recurrent.{EMBEDDING_STATE}.0"] = context + 1
    mx.save_safetensors(str(tmp_path / "bad.safetensors"), arrays, metadata=meta)
    with pytest.raises(UserInputError, match="the ids of the last 3 tokens"):
        load_prompt_cache(tmp_path / "bad.safetensors", model)


def test_the_tiny_minimax_m3_is_what_it_claims(family):
    """MiniMax-M3's text model: layers 1 to 3 sparse (an indexer of 2 heads 16 wide over
    blocks of 16 keeping 4, its own block always), Gemma's norms, RoPE over half of each head,
    its SwiGLU-OAI run as its module, experts from layer 1 on. As the adapter sees a sparse
    layer: keys with the indexer's key after each key head's (queries as wide, zeros at the
    end); the blocks each query sees are those mlx-lm's ``_block_mask`` keeps under the same
    mask (some keys absent), whatever order the cache holds the keys in. A follow-up chunk
    past the budget (its queries' blocks by position, after the cached ones) equals mlx-lm's."""
    model, _ = family("minimax_m3_vl")
    a = ModelAdapter(model)
    assert [layer.self_attn.is_sparse_attn for layer in model.layers] == [False] + [True] * 3
    assert a._block_indexed == [False] + [True] * 3 and a._activations == [None] * 4
    assert a.index_topk(0) is None and a.index_topk(1) == 64
    assert model.layers[0].self_attn.rope.dims == 8 and "block_sparse_moe" in model.layers[1]
    n, attn = 150, model.layers[1].self_attn
    x = a.embed(mx.arange(1, n + 1))
    q, k, v, index = a.qkv(1, x, np.arange(n))
    assert (q.shape, k.shape, v.shape, index.shape) == (
        (1, 4, n, 32), (1, 2, n, 32), (1, 2, n, 16), (1, n, 2, 16))
    assert not mx.any(q[..., 16:]).item()
    mask = position_mask(np.arange(n), np.arange(n))
    mask[:, np.random.default_rng(0).random(n) < 0.3] = False  # pruned tokens
    mask[np.arange(n), np.arange(n)] = True
    want = np.array(attn._block_mask(model.layers[1].input_layernorm(x), mx.array(mask), 0,
                                     None))[0]
    order = np.random.default_rng(1).permutation(n)  # the cache's own order
    seen = np.array(a.index_mask(1, index, k[:, :, mx.array(order)], mx.array(mask[:, order]),
                                 np.arange(n), order))
    assert (seen == want[..., order]).all() and want.shape == (4, n, n)
    chosen = [len({p // 16 for p in np.flatnonzero(row)}) for row in want[0]]
    assert max(chosen) == 4 and not (want & ~mask).any()
    prompt = random_prompt(300, a.vocab_size)
    cache = make_prompt_cache(model)
    model(prompt[None, :200], cache=cache)
    engine = LazyEngine(model, resolve_config(model, PruningConfig("full")))
    engine.prefill(prompt[:200])
    assert rel_err(engine.extend(prompt[200:]),
                   model(prompt[None, 200:], cache=cache)[0, -1]) < LOGITS_TOL


def test_the_tiny_exaone_moe_klear_and_afmoe_are_what_they_claim(family):
    """K-EXAONE and AFM: layers 0 and 2 slide over 24 positions with RoPE, 1 and 3 are global
    without; layer 0 dense, then 2 of 4 experts routed by random weights (a random bias
    moving the choice) beside a shared expert. AFM's output gate per head dim, its four
    random norms, its embeddings times sqrt(hidden). Klear: random q/k/v biases, its experts
    in layers 1 and 3 mixed with a shared one by learned coefficients."""
    x = mx.random.normal((64, 64), key=mx.random.key(1))
    for kind in ("exaone_moe", "afmoe"):
        model = family(kind)[0]
        assert sliding_windows(model) == [24, None, 24, None]
        assert [hasattr(layer.self_attn, "rope") and layer.self_attn.rope is not None
                for layer in model.layers] == [True, False, True, False]
        assert hasattr(model.layers[0].mlp, "down_proj")
        for layer in model.layers[1:]:
            moe = layer.mlp
            router = moe.router.gate if kind == "afmoe" else (lambda t: t @ moe.gate.weight.T)
            bias = moe.expert_bias if kind == "afmoe" else moe.gate.e_score_correction_bias
            assert hasattr(moe.shared_experts, "down_proj") and _routes_apart(router, x)
            scores = mx.sigmoid(router(x))
            assert (_pairs(scores) != _pairs(scores + bias)).any()
    afmoe = family("afmoe")[0]
    assert afmoe.args.mup_enabled and afmoe.layers[0].self_attn.gate_proj.weight.shape == (64, 64)
    for name in ("post_attention_layernorm", "pre_mlp_layernorm", "post_mlp_layernorm"):
        assert float(mx.abs(afmoe.layers[0][name].weight - 1).max()) > 0.01
    klear = family("Klear")[0]
    assert float(mx.abs(klear.layers[0].self_attn.q_proj.bias).sum()) > 0
    assert [hasattr(layer.mlp, "coefficient") for layer in klear.layers] == [False, True] * 2
    coef = mx.softmax(klear.layers[1].mlp.coefficient(x), axis=-1)
    assert float(coef.min()) > 0.01 and float(coef.max()) < 0.99


def test_the_tiny_minimax_mimo_v2_flash_and_step3p5_are_what_they_claim(family):
    """MiniMax-M2: q/k norms over all 4 heads (random), RoPE over 8 of 16 dims, 2 of 4 experts
    moved by a random correction bias. MiMo-V2-Flash: layers 0 and 2 slide over 24 positions with
    4 heads of 24 (values 16) and random sinks, 1 and 3 global with 4 of 16 (values 8), no sinks,
    their queries rescaled to their own scale; values times 0.707. Step-3.5: 8 heads in the
    sliding layers, 4 in the global ones, a gate per head, its clamp at 0.2 changing the dense
    MLP's output, a random router bias."""
    x = mx.random.normal((64, 64), key=mx.random.key(1))
    minimax = family("minimax")[0]
    attn, moe = minimax.layers[0].self_attn, minimax.layers[0].block_sparse_moe
    assert attn.q_norm.weight.shape == (64,) and float(mx.abs(attn.q_norm.weight - 1).max()) > 0.01
    assert attn.rope.dims == 8 and _routes_apart(moe.gate, x)
    scores = mx.sigmoid(moe.gate(x))
    assert (_pairs(scores) != _pairs(scores + moe.e_score_correction_bias)).any()
    mimo = family("mimo_v2_flash")[0]
    adapter = ModelAdapter(mimo)
    assert sliding_windows(mimo) == [24, None, 24, None] and adapter._query_ratios[0] is None
    assert adapter._query_ratios[1] == pytest.approx((16 / 24) ** -0.5)
    assert [(layer.self_attn.v_proj.weight.shape[0], layer.self_attn.value_scale)
            for layer in mimo.layers] == [(16, 0.707), (16, 0.707)] * 2
    assert [float(mx.abs(adapter.sinks(i)).min()) > 0 if i % 2 == 0 else adapter.sinks(i) is None
            for i in range(4)] == [True] * 4
    step = family("step3p5")[0]
    assert sliding_windows(step) == [24, None, 24, None]
    assert [(layer.self_attn.num_heads, layer.self_attn.g_proj.weight.shape[0])
            for layer in step.layers] == [(8, 8), (4, 4)] * 2
    mlp = step.layers[0].mlp
    clamped, plain = mlp(x), mlp.down_proj(nn.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert mlp.limit == 0.2 and rel_err(clamped, plain) > 0.1
    assert float(mx.abs(step.layers[1].mlp.gate.router_bias).min()) > 0


@pytest.mark.parametrize("kind", ["muse_spark"])
def test_the_tiny_muse_spark_is_what_it_claims(family, kind, monkeypatch):
    """Muse Spark: its residual gates and input-scale norms at random, layers 0 and 2 sliding
    with RoPE, 1 and 3 global without, the first layer's attention input in bfloat16 (the
    others' float32, as its fused norms give them); without Metal (mlx-lm's kernels, conftest's
    stand-ins here), refused."""
    model = family(kind)[0]
    blocks = model.layers
    assert [block.self_attn.use_rope for block in blocks] == [True, False] * 2
    assert sliding_windows(model) == [24, None] * 2
    for block in blocks:
        for part in (block.add_attn_beta, block.add_ffn_alpha,
                     block.post_feedforward_layernorm.weight,
                     block.mlp.experts.post_expert_norm.weight):
            assert float(part.max() - part.min()) > 0.05
    assert ModelAdapter(model)._input_dtypes == [mx.bfloat16] + [mx.float32] * 3
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    with pytest.raises(UserInputError, match="cannot run muse_spark models here: .* no Metal"):
        ModelAdapter(model)


def test_the_tiny_muse_glimmer_spark2_5_and_iquestloopcoder_are_what_they_claim(family):
    """Muse Glimmer: layers 0 and 2 slide over 24 positions with RoPE, 1 and 3 are global
    without; random (1 + w) norms, queries times 3.87, logits times 4 then soft-capped at 20 where
    the cap bites. Spark 2.5: the same windows, RoPE over whole heads (base 10000) in the
    sliding layers and half of each (500000) in the global ones, a gate per head, exact GELU.
    IQuest-Loop-Coder: 2 blocks run twice, the second loop's own keys in a 24-position window,
    its loop gates random (zeros would mix the two attentions half and half)."""
    glimmer = family("muse_glimmer")[0]
    assert sliding_windows(glimmer) == [24, None, 24, None]
    assert [layer.self_attn.use_rope for layer in glimmer.layers] == [True, False] * 2
    norm = glimmer.layers[0].post_feedforward_layernorm
    assert float(mx.abs(norm.weight).min()) > 0 and glimmer.layers[0].self_attn.qk_scale_factor > 1
    raw = glimmer.lm_head(glimmer.model(mx.array([[5, 6, 7]]))) * glimmer.args.output_multiplier
    assert glimmer.args.final_logit_softcapping == 20 and float(mx.abs(raw).max()) > 5
    spark = family("spark2_5")[0]
    assert sliding_windows(spark) == [24, None, 24, None]
    assert [(layer.self_attn.rope.dims, layer.self_attn.rope.base) for layer in spark.layers] == [
        (16, 10000.0), (8, 500000.0)] * 2
    assert spark.layers[0].self_attn.g_proj.weight.shape == (4, 64)
    assert ModelAdapter(spark)._activations == [None] * 4 and spark.args.tie_word_embeddings
    loop = family("iquestloopcoder")[0]
    assert sliding_windows(loop) == [None, None, 24, 24]
    gate = loop.model.gate_projections[1]
    assert float(mx.abs(gate.weight).max()) > 0.5 and float(mx.abs(gate.bias).max()) > 0.5


def test_the_tiny_hunyuan_is_what_it_claims(family):
    """Layers 1 and 3 have no k/v projections: they read the raw keys and values of 0 and 2
    through their own (random, different) key norms, after RoPE; 2 of 4 experts (softmax)
    routed apart, a shared MLP; the head is the embedding."""
    model, _ = family("hunyuan")
    a = ModelAdapter(model)
    assert [a.kv_layer(i) for i in range(4)] == [0, 0, 2, 2]
    assert ["k_proj" in layer.self_attn for layer in model.layers] == [True, False] * 2
    norms = [layer.self_attn.key_layernorm.weight for layer in model.layers]
    assert float(mx.abs(norms[1] - norms[0]).max()) > 0.05 and a.lm_head is None
    x = mx.random.normal((64, 64), key=mx.random.key(1))
    for layer in model.layers:
        assert layer.mlp.top_k == 2 and hasattr(layer.mlp, "shared_mlp")
        assert _routes_apart(layer.mlp.gate, x)


def test_a_hunyuan_key_norm_with_a_zero_weight_is_refused(family_dir):
    """A reading layer's keys cannot be made from a lower layer's cached keys normed by a
    zero weight: one error, not infinities."""
    model, _ = mlx_lm.load(str(family_dir("hunyuan")))
    norm = model.layers[0].self_attn.key_layernorm
    norm.weight = mx.where(mx.arange(16) == 3, 0.0, norm.weight)
    with pytest.raises(UserInputError, match="layer 1 shares keys with a layer whose key norm"):
        ModelAdapter(model)


def test_the_tiny_llama4_models_are_what_they_claim(family):
    """Llama 4 (a ``llama4`` checkpoint's text model): layers 0-2 attend within chunks of 24
    positions (shorter than every test prompt) with RoPE and the weight-free q/k norm, layer
    3 globally without either, its queries scaled from position 15 on (floor_scale 16);
    layers 1 and 3 top-1 MoE beside a shared expert, 0 and 2 dense. mlx-lm's dense
    ``llama4_text``: no RoPE in layer 3, its MLP at ``feed_forward``, an untied ``output``."""
    model, _ = family("llama4")
    text = model.language_model
    assert model.model_type == "llama4" and text.args.attention_chunk_size == 24
    assert sliding_windows(model) == [Chunks(24)] * 3 + [None]
    attns = [layer.self_attn for layer in model.layers]
    assert [a.use_rope for a in attns] == [1, 1, 1, 0] == [a.use_qk_norm for a in attns]
    assert (attns[3].attn_temperature_tuning, attns[3].floor_scale) == (True, 16)
    assert [layer.is_moe_layer for layer in model.layers] == [False, True] * 2
    moe = model.layers[1].feed_forward
    assert moe.top_k == 1 and hasattr(moe.shared_expert, "down_proj")
    assert _routes_apart(moe.router, mx.random.normal((64, 64), key=mx.random.key(1)))
    dense = family("llama4_text")[0]
    assert ["rope" in layer.self_attn for layer in dense.layers] == [True] * 3 + [False]
    assert dense.layers[0].self_attn.use_qk_norm and ModelAdapter(dense).lm_head is dense.output


def test_chunked_position_mask():
    """A query sees the keys of its own chunk, at or before it: by original position."""
    q, k = np.array([3, 7, 8, 13]), np.array([0, 3, 4, 7, 8, 9, 12])
    assert position_mask(q, k, Chunks(4)).astype(int).tolist() == [
        [1, 1, 0, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 1, 0, 0],
        [0, 0, 0, 0, 0, 0, 1]]
    assert window_start(np.array([0, 23, 24, 50]), Chunks(24)).tolist() == [0, 0, 24, 48]


@BOTH_IMPLEMENTATIONS
@pytest.mark.parametrize("revival_block", [64, 2])
def test_pruned_llama4_equals_a_dense_reference(family, monkeypatch, revival_block):
    """Llama 4 under a cut after layer 0 (40% kept) and a decode step that revives, against
    mlx-lm's blocks run densely with masks by original position: its chunked layers 1 and 2
    over the kept keys of each query's own chunk of 24 (tokens pruned in a chunk do not let
    it reach back), its global NoPE layer 3 over every kept key. The chunks are built here
    from positions, not from the engine's mask."""
    model = family("llama4")[0]
    text = model.language_model
    size = text.args.attention_chunk_size
    engine, prompt, logits, kept, selections = cut_after_layer_0(
        model, text.args.vocab_size, monkeypatch, revival_block)
    n = len(prompt)

    def masks(n, sees):
        pos = np.arange(n)
        chunk = pos[:, None] // size == pos[None, :] // size
        return [dense_mask(n, None, [None] * n) & chunk] + [
            dense_mask(n, None, sees) & (chunk if layer.self_attn.use_rope else True)
            for layer in model.layers[1:]]

    assert rel_err(logits, _dense_logits(text, prompt, masks(n, [kept] * n))) < LOGITS_TOL
    # the last token's chunk holds pruned tokens, and kept ones lie before it
    start = (n - 1) // size * size
    assert not kept[start:].all() and kept[:start].any()
    tokens, logits, _, sees, revived = decode_one(engine, prompt, logits, kept, selections)
    assert engine.stats.revivals > 0 and len(revived)
    assert rel_err(logits, _dense_logits(text, tokens, masks(n + 1, sees))) < LOGITS_TOL


@BOTH_IMPLEMENTATIONS
@pytest.mark.parametrize("revival_block", [64, 2])
def test_pruned_hunyuan_equals_a_dense_reference(family, monkeypatch, revival_block):
    """Hunyuan under a cut after layer 0 (40% kept) and a decode step that revives, against
    mlx-lm's blocks run densely with masks, each pair passing layer 0's (2's) raw keys and
    values to layer 1 (3), as mlx-lm's forward does: the reading layers score the lower
    layer's cached keys through their own key norm, over the kept keys only."""
    model, _ = family("hunyuan")
    engine, prompt, logits, kept, selections = cut_after_layer_0(
        model, model.args.vocab_size, monkeypatch, revival_block)
    n = len(prompt)

    def dense(tokens, masks):
        inner, shared = model.model, None
        h = inner.embed_tokens(mx.array(tokens)[None])
        for i, (block, mask) in enumerate(zip(inner.layers, masks)):
            shared = None if i % model.args.cla_share_factor == 0 else shared
            h, shared = block(h, mx.array(mask), None, shared)
        return inner.embed_tokens.as_linear(inner.norm(h))[0, -1]

    masks = [dense_mask(n, None, [None] * n)] + [dense_mask(n, None, [kept] * n)] * 3
    assert rel_err(logits, dense(prompt, masks)) < LOGITS_TOL
    tokens, logits, _, sees, revived = decode_one(engine, prompt, logits, kept, selections)
    assert engine.stats.revivals > 0 and len(revived)
    masks = [dense_mask(n + 1, None, [None] * (n + 1))] + [dense_mask(n + 1, None, sees)] * 3
    assert rel_err(logits, dense(tokens, masks)) < LOGITS_TOL
