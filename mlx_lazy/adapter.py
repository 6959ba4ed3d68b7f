"""Run an mlx-lm model's own modules on arbitrary token subsets at explicit positions.

No weights are re-implemented: embeddings, projections, q/k norms, RoPE, MLP, norms and the
LM head are the loaded model's modules, so quantized and unquantized checkpoints of the
supported families behave alike.
"""

from __future__ import annotations

import base64
import hashlib
import operator
import re
import sys

from functools import lru_cache, partial
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Collection, List, Mapping, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import afm7, gear, muse_spark, nanochat
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE
from mlx_lm.utils import MODEL_REMAPPING

from . import _blas, kernels
from .attention import BlockSparse, Chunks, Window, attention
from .errors import UserInputError, shown

# qwen3_moe: its sparse MoE block sits at ``block.mlp`` and works per token like a dense MLP.
# seed_oss (Seed-OSS), ernie4_5 and ernie4_5_moe (ERNIE 4.5; traditional RoPE, its MoE
# block at ``block.mlp``): Llama's layout with biases.
# glm4_moe (GLM-4.5, 4.6, 4.7 and their Air models): Llama's layout with q/k/v biases,
# optional q/k norms, RoPE over part of each head, and from ``first_k_dense_replace`` on a
# sparse MoE block (grouped sigmoid routing, shared experts) at ``block.mlp``.
# phi3: fused ``qkv_proj`` (split here as mlx-lm splits it) and ``gate_up_proj`` (inside its
# MLP module), RoPE (plain or longrope's ``SuScaledRoPE``, possibly partial) as its module.
# gemma2 (Gemma 2): Gemma's RMSNorm (1 + w), embeddings scaled by sqrt(hidden), norms after
# attention and around the MLP, attention logits soft-capped (:meth:`ModelAdapter.softcap`),
# and so are the final logits; every layer global, as mlx-lm runs it (no sliding windows).
# gemma3_text (and the text model inside a ``gemma3`` checkpoint): Gemma's RMSNorm (1 + w),
# embeddings scaled by sqrt(hidden), q/k norms, norms after attention and around the MLP,
# sliding-window layers (:meth:`ModelAdapter.sliding_window`) with their own RoPE base.
# smollm3: Llama whose every fourth layer has no RoPE (mlx-lm's ``NoPE`` as its ``rope``).
# ministral3 (and the text model of a ``mistral3`` checkpoint, Ministral 3's): Llama whose
# queries are scaled by position (Llama 4's attention temperature, from
# ``original_max_position_embeddings`` on), possibly with sliding-window layers.
# gpt_oss: q/k/v and o_proj biases, YaRN RoPE, a sparse MoE block at ``block.mlp``,
# sliding-window layers (its ``layer_types``) and per-head attention sinks
# (:meth:`ModelAdapter.sinks`); its heads and scale named ``num_attention_heads``,
# ``num_key_value_heads``, ``sm_scale``.
# granite: Llama whose embeddings, residual branches and logits are scaled by its config's
# multipliers (its attention scale, ``attention_multiplier``, is its module's ``scale``).
# olmo2, olmo3, exaone4 (:data:`POST_NORM_TYPES`): no norm before attention or the MLP, one
# on each branch's output; OLMo's q/k norms span the whole projection (all heads at once),
# EXAONE 4's act per head. OLMo 3 and EXAONE 4 have sliding-window layers (OLMo 3's
# ``layer_types``, EXAONE 4's ``is_local``); EXAONE 4's global layers there have no RoPE.
# gemma4_text (and the text model of ``gemma4`` checkpoints): Gemma 3's layout and windows,
# plus per-layer head sizes and key/value heads (global layers wider, their values the keys'
# projection with ``attention_k_eq_v``), a scale-free norm on values, a scale of 1, partial
# ("proportional") RoPE in global layers, a per-layer output scalar and, in the MoE model, a
# sparse expert block beside the dense MLP. In the E2B/E4B layouts the upper layers attend
# over a lower layer's keys and values (:meth:`ModelAdapter.kv_layer`) and every layer takes
# a per-token input made from the token's id and embedding: the adapter's hidden state of a
# token carries, after its (hidden_size,) part, the inputs of the layers it has yet to run
# (each layer uses the first and drops it), so pruned, revived and cached tokens keep theirs.
# qwen3_5, qwen3_5_moe (:data:`HYBRID_TYPES`, the text model of Qwen3.5/3.6 checkpoints) and
# qwen3_next (Qwen3-Next, their layout before them, with MoE blocks): three Gated DeltaNet
# layers (linear attention, :meth:`ModelAdapter.recurrent`) to one of full attention whose
# q_proj also gives an output gate, q/k norms and partial RoPE.
# deepseek_v3 (DeepSeek-V3/R1, Kimi K2, Moonlight), glm4_moe_lite (GLM-4.7-Flash) and
# deepseek_v2 (DeepSeek-V2/V2-Lite) (:data:`MLA_TYPES`): multi-head latent attention
# (:meth:`ModelAdapter._latent_qkv`), queries through a low-rank ``q_a_proj``/``q_b_proj``
# or a plain ``q_proj``, traditional RoPE over the last ``qk_rope_head_dim`` of each query
# and over one key part shared by every head, a scale raised by YaRN's mscale; grouped
# sigmoid-routed (V2: softmax-routed) MoE blocks with shared experts at ``block.mlp``.
# mixtral (Mixtral 8x7B/8x22B; its heads named ``num_heads``, ``num_key_value_heads``),
# granitemoe (Granite's multipliers) and phimoe (Phi-3.5-MoE: LayerNorms with biases, biases
# on q/k/v, o_proj and the head, longrope's ``SuScaledRoPE``): Llama's layout with a sparse
# MoE block at ``block.block_sparse_moe`` (:func:`feed_forward`). qwen2_moe (Qwen1.5/2-MoE:
# q/k/v biases; experts beside a sigmoid-gated shared expert) and olmoe (OLMoE: pre-norms,
# q/k norms over all heads as OLMo's) have theirs at ``block.mlp``.
# glm4 (GLM-4-0414): Llama's layout with a norm after each branch too
# (``post_self_attn_layernorm``, ``post_mlp_layernorm``; ``post_attention_layernorm`` is the
# one before the MLP), fused ``gate_up_proj``, traditional RoPE over part of each head.
# starcoder2: LayerNorms with biases, biases on every projection, a plain (not gated) GELU MLP
# ``c_fc``/``c_proj`` run as its module; mlx-lm attends globally (no sliding window).
# cohere2 (Command R7B): one LayerNorm feeding attention and the MLP in parallel
# (:data:`PARALLEL_TYPES`), traditional RoPE in its sliding-window layers
# (``use_sliding_window``) and none in the global ones, logits times ``logit_scale``.
# helium (Kyutai Helium), internlm3: Llama's layout (InternLM3 with biases where its config
# says, dynamic NTK RoPE); helium's head is the embedding where ``tie_word_embeddings``.
# apertus: Llama's layout with per-head q/k norms, its norms named ``attention_layernorm``
# and ``feedforward_layernorm``, a plain (not gated) xIELU MLP run as its module.
# lfm2 (LFM2) and lfm2_moe (LFM2-8B-A1B) (:data:`LFM2_TYPES`): a hybrid of short gated
# convolutions (``block.conv``, recurrent: their state is the last few tokens' inputs) and
# grouped-query attention with per-head q/k norms; Llama's parts under other names
# (:data:`_LFM2_NAMES`), a SwiGLU (lfm2_moe: from ``num_dense_layers`` on, a sparse MoE) block.
# dots1 (dots.llm1): Llama's layout with per-head q/k norms, DeepSeek-V3's sigmoid routing
# (a correction bias) and shared experts at ``block.mlp`` from ``first_k_dense_replace`` on.
# bailing_moe (Ling, Ring): fused ``query_key_value`` (split as phi3's), attention at
# ``block.attention`` with its output ``dense``, embeddings ``word_embeddings``, optional
# per-head q/k norms (``query_layernorm``, ``key_layernorm``) before partial RoPE, grouped
# routing with an expert bias and shared experts at ``block.mlp``.
# hunyuan (Hunyuan-A13B, Hunyuan-Large): per-head q/k norms after RoPE, softmax-routed experts
# beside a shared MLP; with ``use_cla`` (cross-layer attention) a layer reads the keys and
# values of the layer below it (:meth:`ModelAdapter.kv_layer`), its own key norm weighed in
# through its queries (:meth:`ModelAdapter._key_norm_ratio`); the head is the embedding.
# llama4_text (mlx-lm's dense Llama 4 text model): a weight-free q/k RMS norm before RoPE,
# layers without RoPE where ``no_rope_layers`` says 0, the MLP at ``block.feed_forward``.
# llama4 (Llama 4 Scout/Maverick, their text model): chunked local attention
# (:class:`~mlx_lazy.attention.Chunks`: a query sees the keys of its own
# ``attention_chunk_size`` chunk) with RoPE and a weight-free L2 (RMS) q/k norm after it in
# three layers of four; every fourth global, without RoPE, its queries scaled by position
# (``attn_temperature_tuning``); MoE layers (top-1 sigmoid-weighted expert beside a shared
# expert) every ``interleave_moe_layer_step``-th, both at ``block.feed_forward``.
# exaone (EXAONE 3.0/3.5): Llama's layout named otherwise (``transformer.wte``, ``h``,
# ``ln_1``/``ln_2``, ``attn.attention`` with ``out_proj``, ``ln_f``: :data:`_PART_NAMES`), its
# SwiGLU MLP (gate ``c_fc_0``, up ``c_fc_1``, down ``c_proj``) through the CPU kernel.
# hunyuan_v1_dense (Hunyuan dense): per-head q/k norms (``query_layernorm``,
# ``key_layernorm``) AFTER RoPE, RoPE with NTK-alpha frequencies.
# stablelm (StableLM 2, Zephyr): LayerNorms, RoPE over part of each head, optional per-head
# q/k LayerNorms (``q_layernorm``, ``k_layernorm``) before it, optional parallel residual
# (``use_parallel_residual``: attention and MLP on one norm, as cohere2's).
# minicpm: Granite's multipliers from its own config: embeddings times ``scale_emb``,
# residual branches times ``scale_depth / sqrt(layers)``, an untied head's logits divided
# by ``hidden_size / dim_model_base`` (a tied one's not, as in mlx-lm).
# mimo (Xiaomi MiMo): Qwen2's layout; its multi-token-prediction layers are dropped on
# load by mlx-lm.
# nanochat: EXAONE 3's names (``transformer.wte``, ``h``, ``attn``) with ``c_q``/``c_k``/
# ``c_v``/``c_proj``; every norm weightless (mlx-lm's ``rms_norm``: the embeddings', before
# each branch, the final one, and the q/k norms after RoPE), RoPE with negated frequencies
# (mlx-lm's ``apply_rotary_emb``), a plain ReLU^2 MLP run as its module, logits soft-capped
# at 15.
# gemma (Gemma 1, CodeGemma): Llama's layout with Gemma's RMSNorm (1 + w), embeddings scaled by
# sqrt(hidden), head_dim from its config, an exact-GELU gated MLP (mlx-lm's ``nn.gelu``: run
# as its module, not the CPU kernel); the head is the embedding.
# cohere (Command R, R+, Aya 23): cohere2's parallel layers on one LayerNorm and its
# ``logit_scale``, traditional RoPE in every layer, no windows; with ``use_qk_norm`` (R+)
# per-head q/k LayerNorms (mlx-lm's ``LayerNorm2D``, a weight per head) before RoPE.
# phi (Phi-1.5, Phi-2): one LayerNorm (with bias) feeding attention and a plain GELU MLP
# (``fc1``/``fc2``, run as its module) in parallel (:data:`PARALLEL_TYPES`), biases on q/k/v and
# on the output ``dense``, RoPE over part of each head, ``final_layernorm``, a head with a bias.
# gpt_neox (Pythia, GPT-NeoX): fused ``query_key_value`` holding each head's q, k and v in turn
# (split per head, as mlx-lm does), attention at ``block.attention`` with its output ``dense``,
# RoPE over ``rotary_pct`` of each head, LayerNorms with biases, a plain GELU MLP; with
# ``use_parallel_residual`` attention and the MLP both on the block's input, each through its
# own norm; ``embed_in``, ``final_layer_norm`` and the head ``embed_out`` inside ``model``.
# internlm2 (InternLM2, InternLM2.5): Llama's layout under its own names (:data:`_PART_NAMES`:
# ``tok_embeddings``, ``attention`` with ``wo``, ``attention_norm``, ``ffn_norm``, a
# ``feed_forward`` of w1 the gate, w3 up, w2 down, the head ``output``), one fused ``wqkv``
# holding, for each key/value head, its group's queries, then its key and value; mlx-lm's
# linear or dynamic NTK RoPE.
# qwen (Qwen 1): EXAONE 3's GPT-2 names (``transformer.wte``, ``h``, ``ln_1``/``ln_2``,
# ``ln_f``), attention at ``attn``: a fused ``c_attn`` (all queries, keys, values; biases),
# ``c_proj``, RoPE ``rotary_emb``; no GQA; an MLP of w2 the gate, w1 up, c_proj down.
# gpt2 (GPT-2) and gpt_bigcode (StarCoder 1, SantaCoder; multi-query attention: one key/value
# head) (:data:`LEARNED_POSITION_TYPES`): no RoPE but a learned position embedding ``wpe``
# added to each token's embedding at its original position (:meth:`ModelAdapter.embed`),
# EXAONE 3's names (``wte``, ``h``, ``ln_1``/``ln_2``, ``attn``, ``ln_f``), fused ``c_attn``
# (split as mlx-lm splits it), LayerNorms with biases, a plain GELU MLP run as its module;
# their config names (``n_embd``, ``n_head``, ``n_inner``) read through :func:`config_value`.
# nemotron (Nemotron-3, Minitron): Llama's layout with LayerNorms of (1 + w) and a bias
# (mlx-lm's ``NemotronLayerNorm1P``, run as its modules), RoPE over part of each head, a plain
# (not gated) squared-ReLU MLP ``up_proj``/``down_proj`` run as its module.
# openelm (Apple's OpenELM): query and key/value heads and the MLP's width set per layer,
# fused ``qkv_proj`` (split as phi3's, by the layer's own heads), per-head q/k norms, the
# MLP's fused ``proj_1`` (gate, then up) and ``proj_2`` at ``block.ffn``, Llama's parts under
# other names (:data:`_PART_NAMES`, config fields :func:`config_value`), a tied head.
# deepseek (DeepSeek-MoE 16B, DeepSeek LLM 1): Llama's layout, from ``first_k_dense_replace`` on
# (every ``moe_layer_freq``-th) softmax-routed experts beside shared ones at ``block.mlp``.
# mellum (JetBrains Mellum): per-head q/k norms before RoPE, sliding-window layers (its
# ``args.layer_types``) with their own RoPE base, softmax-routed experts at ``block.mlp``.
# nanbeige: Llama's layout whose stack runs ``num_loops`` times over the same weights, each
# pass an engine layer of its own (:func:`_blocks`), the final norm also ending each loop but
# the last unless ``skip_loop_final_norm``.
# minicpm3 (MiniCPM3-4B) and youtu_llm (Youtu-LLM) (:data:`MLA_TYPES`): DeepSeek-V2's latent
# attention expanded per head (``kv_b_proj``), low-rank queries, dense SwiGLU MLPs; MiniCPM3
# with MiniCPM's multipliers, longrope's ``SuScaledRoPE`` and its scale ``softmax_scale``;
# Youtu-LLM with traditional RoPE and, where ``tie_word_embeddings``, the embedding as head.
# granitemoehybrid (Granite 4.0 H-Tiny/H-Small/H-Micro, and Micro's all-attention layout):
# Granite's multipliers; Mamba-2 layers (``block.mamba``, recurrent: a convolution state and an
# SSM state) where ``layer_types`` says ``mamba``, attention (RoPE, or none where
# ``position_embedding_type`` is ``nope``) elsewhere; a dense MLP, or sparse experts at
# ``block.block_sparse_moe`` beside a ``shared_mlp``.
# nemotron_h (Nemotron-H, Nemotron Nano 2, Nemotron 3 Nano): one mixer per layer after one norm
# (``block.mixer``, ``block.norm``; embeddings ``backbone.embeddings``, final norm ``norm_f``), by
# its ``hybrid_override_pattern``: Mamba-2 (``M``, recurrent), attention without RoPE (``*``: no
# MLP after it), or a ReLU^2 MLP (``-``) or sparse experts (``E``) alone, taken as recurrent
# layers that hold no state (no attention there to score with, nothing to revive).
# glm (GLM-4-9B-chat, ChatGLM's layout as mlx-lm's glm has it): Llama's layout with q/k/v
# biases, traditional RoPE over each whole head, a fused ``gate_up_proj``, a tied head.
# telechat3 (TeleChat 3): Llama's layout, biases on q/k/v and o_proj (``attention_bias``) and on
# the MLP (``mlp_bias``) where its config says.
# solar_open (Upstage Solar Open): mlx-lm's glm4_moe model under its own config (no q/k norms
# or biases by default).
# jamba (AI21 Jamba, Jamba 1.5/1.6/Mini/Large): Mamba (v1) layers (``block.mamba``, recurrent: a
# convolution state and an SSM state; called as ``(x, cache)``) and, where ``layers_block_type``
# says ``attention``, attention without RoPE; the MLP or sparse experts at ``block.feed_forward``
# after ``pre_ff_layernorm``, the final norm ``final_layernorm``.
# mistral4 (Mistral Small 4; also the text model of a ``mistral3`` checkpoint) (:data:`MLA_TYPES`):
# DeepSeek-V3's absorbed latent attention whose queries are also scaled by position, as
# ministral3's (``rope_parameters``' ``llama_4_scaling_beta`` and
# ``original_max_position_embeddings``), softmax-routed experts beside shared ones at ``block.mlp``
# from ``first_k_dense_replace`` on.
# qwen2_vl (Qwen2-VL; qwen2_5_vl: Qwen2.5-VL, read by mlx-lm's qwen2_vl), qwen3_vl (Qwen3-VL),
# qwen3_vl_moe (Qwen3-VL MoE), lfm2-vl (LFM2-VL), kimi_vl (Kimi-VL) and kimi_k25 (Kimi K2.5):
# vision-language checkpoints whose text model (``model.language_model``; mlx-lm drops the
# vision tower) runs as the family :data:`_WRAPPERS` names: qwen2, qwen3, qwen3_moe, lfm2,
# deepseek_v3.
# gptj (GPT-J): Phi-2's parallel attention and MLP on one LayerNorm ``ln_1`` (EXAONE 3's GPT-2
# names: ``wte``, ``h``, ``attn`` with ``out_proj``, ``ln_f``, inside ``model``), traditional RoPE
# over the first ``rotary_dim`` of each head, a plain GELU MLP ``fc_in``/``fc_out``, a biased head.
# dbrx (DBRX): a fused ``Wqkv`` whose output is clipped to +-``clip_qkv``, attention and its two
# LayerNorms (no biases) inside ``block.norm_attn_norm``, softmax-routed experts at ``block.ffn``,
# ``transformer.{wte, blocks, norm_f}``.
# phixtral (Phixtral): Phi-2's parallel layers on one LayerNorm ``ln`` with a fused, biased
# ``Wqkv`` (``block.mixer``, no GQA), sparse experts at ``block.moe``, ``transformer.embd.wte``;
# its head module ``lm_head`` holds the final norm ``ln`` and the head ``linear``.
# minimax (MiniMax-M2, M2.1): q/k RMS norms over the whole projection (OLMo's; split over ranks by
# mlx-lm's ``ShardedRMSNorm``), RoPE over ``rotary_dim`` of each head, sigmoid-routed experts (a
# correction bias) at ``block.block_sparse_moe``; its heads named ``num_attention_heads``.
# mimo_v2_flash (MiMo-V2-Flash): sliding-window layers (``hybrid_layer_pattern``, a window of
# ``sliding_window_size``) with their own heads, head sizes and RoPE base, values narrower than
# keys and times ``attention_value_scale``, per-head sinks (``attention_sink_bias``, as gpt-oss's),
# partial RoPE; a layer of another head size has its own scale, folded into its queries;
# DeepSeek-V3's grouped sigmoid routing at ``block.mlp`` where ``moe_layer_freq`` says.
# step3p5 (Step-3.5): sliding-window layers (``layer_types``) with their own heads, RoPE base and
# rotary fraction, per-head q/k norms, an output gate per head (``g_proj``, sigmoid), SwiGLU
# clamped at a per-layer limit (a dense one run as its module), sigmoid-routed experts (a router
# bias) beside a shared expert at ``block.mlp``.
# bailing_moe_v3 (Ling 2.5/3) (:data:`MLA_TYPES`): Kimi Delta Attention layers (``is_linear``:
# recurrent, a convolution state per projection and a delta-rule state, run as their module at
# ``block.attention``) and, every ``layer_group_size``-th layer, DeepSeek-V3's absorbed latent
# attention at ``block.attention`` with a sigmoid output gate per head (``g_proj``) before its
# ``dense``; bailing_moe's grouped sigmoid routing and shared experts at ``block.mlp``.
# longcat_flash (LongCat-Flash) (:data:`MLA_TYPES`): blocks of two absorbed latent attentions
# (queries and the normed latent scaled by ``mla_scale_q_lora``/``mla_scale_kv_lora``) and two
# dense MLPs, each pair an engine layer (:func:`_sublayer`); the block's MoE (softmax-routed, its
# identity "zero" experts adding the input) takes the first MLP's input and its output is added
# after the second MLP: a token's hidden state after the first layer carries it
# (:meth:`ModelAdapter.finish`), so pruned and revived tokens keep theirs.
# falcon_h1 (Falcon-H1): in every layer a Mamba-2 mixer (``block.mamba``) and attention (RoPE)
# side by side on one normed input, then an MLP at ``block.feed_forward``; each layer is a
# recurrent one (its state: the mixer's and the keys and values of every token it took,
# :meth:`ModelAdapter._falcon_h1_block`), so no layer is one a cut may follow; the tied head's
# logits times ``lm_head_multiplier / embedding_multiplier`` (its other multipliers are in the
# weights).
# plamo2 (PLaMo 2): Mamba layers (``block.mixer`` where ``is_mamba``, run as mlx-lm's block,
# recurrent) and attention layers (a fused ``qkv_proj``, a weight-free q/k RMS norm times a
# per-head ``q_weight``/``k_weight`` before RoPE, global as mlx-lm runs it); Gemma 2's four
# norms under its own names (:data:`_PART_NAMES`), the blocks at ``model.layers.layers``.
# lille-130m (Lille 130M): a fused ``qkv_proj`` (split as phi3's) after a norm inside its
# attention module (``block.attention.norm``), traditional RoPE, ``out_proj``; its SwiGLU MLP
# (``block.feed_forward``) holds its own norm and runs as its module; ``transformer.{
# tok_embeddings, norm}``, the embedding as head.
# plamo (PLaMo 1): one norm feeding attention and the MLP in parallel (:data:`PARALLEL_TYPES`);
# its ``ceil(heads / n_shared_head)`` key/value heads tiled (``mx.tile``: query head i reads
# key/value head i mod their count), run as grouped-query attention over its query heads
# reordered by the head they read (:meth:`ModelAdapter.qkv`, back in :meth:`ModelAdapter.finish`).
# bitnet (BitNet b1.58): Llama's layout of ternary ``BitLinear`` projections (mlx-lm's Metal
# kernel: refused without Metal), called as its modules; a norm on the attention output before
# o_proj (``attn_sub_norm``); a ReLU^2-gated MLP with its ``ffn_sub_norm``, run as its module.
# pixtral (Pixtral): a vision-language checkpoint whose text model is llama (:data:`_WRAPPERS`).
# deepseek_v32 (DeepSeek-V3.2) and glm_moe_dsa (GLM-5, deepseek_v32's model) (:data:`MLA_TYPES`):
# DeepSeek-V3's absorbed latent attention whose every query sees only the ``index_topk`` keys
# its lightning indexer (``self_attn.indexer``) scores highest among those present
# (:meth:`ModelAdapter.index_mask`); the indexer's key of a token is cached after its key
# (:meth:`ModelAdapter._latent_qkv`), its queries and head weights come as :meth:`qkv`'s gate.
# gear (Gear): Gemma 3's four (1 + w) norms, scaled embeddings, per-head q/k norms, sliding-window
# layers (``layer_types``) with their own RoPE base, optional attention and final logit soft-caps;
# ``conv_mixer`` layers (``block.local_mixer``: keys and values through short convolutions, gated
# by the queries, no softmax) are recurrent, run as mlx-lm's block (their state: the last few
# tokens' keys and values).
# recurrent_gemma (RecurrentGemma, Griffin): RG-LRU layers (``temporal_block``: a convolution and
# a gated linear recurrence, recurrent, run as mlx-lm's block) and local attention (one key/value
# head, RoPE over half of each head, every one a sliding window: no cut may follow any layer);
# Gemma's (1 + w) norms ``temporal_pre_norm``/``channel_pre_norm``, a GELU MLP ``mlp_block``,
# scaled embeddings, logits soft-capped at ``logits_soft_cap``.
# afm7 (Apple Foundation Model): a fused ``qkv_proj`` (mlx-lm's ``FusedLinear``, split by its own
# sizes), per-head q/k norms after traditional RoPE, keys and values rounded as mlx-lm's
# ``fake_8bit_quant`` does; its last ``num_kv_reuse_layers`` layers (``kv_reuse_layers``) attend
# over the keys and values of the last layer before them (:meth:`ModelAdapter.kv_layer`), their
# own queries only; Llama's parts under other names (:data:`_PART_NAMES`), a tied head.
# baichuan_m1 (Baichuan-M1): a fused ``W_pack`` (queries, keys, values), each key and value a
# convolution of its own and the previous token's (``conv_k``, ``conv_v``) before RoPE, so a
# token's keys need the token before it at that layer: every layer is a recurrent one (its state:
# the last raw key and value, and the keys and values of every token it took,
# :meth:`ModelAdapter._conv_kv_block`) and no cut may follow any; sliding-window layers
# (``sliding_window_layers``) with their own heads; an untied head mlx-lm normalises on load.
# olmo_hybrid (OLMo Hybrid): Gated DeltaNet layers (``block.linear_attn``, recurrent: a
# convolution state per projection and a delta-rule state) with pre-norms, and, where
# ``layer_types`` says ``full_attention``, OLMo 3's layers (:data:`POST_NORM_TYPES`: norms on
# each branch's output, q/k norms over all heads).
# kimi_linear (Kimi Linear) (:data:`MLA_TYPES`): Kimi Delta Attention layers (those
# ``linear_attn_config``'s ``kda_layers`` counts from 1; recurrent, at ``block.self_attn``) and
# DeepSeek-V3's absorbed latent attention without RoPE (plain ``q_proj``); sigmoid-routed
# experts (a correction bias) beside shared ones at ``block.mlp``.
# bailing_moe_linear (Ring-mini-linear, Ling-linear) and bailing_hybrid (Ring-2.5/Ling-2.5
# linear) (:data:`LIGHTNING_TYPES`): lightning (decaying linear) attention layers
# (``block.attention`` where not ``is_global``; recurrent: one state per head, run by
# :meth:`ModelAdapter._lightning_attention`, RoPE at each token's own position) and, every
# ``layer_group_size``-th layer, bailing_moe's attention (bailing_moe_linear) or DeepSeek-V3's
# absorbed latent attention (bailing_hybrid); grouped routing and shared experts at ``block.mlp``.
# gemma3n (Gemma 3n E2B/E4B, its text model ``model.language_model``): Gemma 4 E2B's windows,
# shared keys and values (``layer_idx_to_cache_idx``) and per-layer inputs, with plain RMS norms,
# AltUp (``altup_num_inputs`` streams of the hidden state, each layer predicting them all from
# them, running its attention and MLP on the active one and correcting them all by the result:
# :meth:`ModelAdapter.finish`; a token's hidden state holds them all, then its per-layer inputs),
# LAuReL (a low-rank branch beside attention), sparse MLP gates (a Gaussian top-k in the layers
# ``activation_sparsity_pattern`` names: run as its module); the streams merged into one by
# ``altup_unembed_projections`` before the final norm (:meth:`ModelAdapter.logits`).
# muse_glimmer (Muse Glimmer's text model): Gemma 2's four norms as (1 + w) RMS norms, a
# weight-free RMS norm on the embeddings and on each head's queries (then times
# ``qk_scale_factor``) and keys, a sigmoid output gate (``gate_proj``, as AFM's); sliding-window
# layers (``layer_types``) with RoPE, global ones without; logits times ``output_multiplier``,
# then soft-capped.
# muse_spark (Muse Spark's text model, ``model.language_model``; the vision tower dropped): mlx-lm's
# fused kernels (Metal only: refused without Metal) called on the tokens the engine has, each on
# its own token's row: the attention input (bfloat16 into the first layer, then the fused norm
# of the layer below, in the dtype mlx-lm's forward gives it), a fused ``qkvg_proj`` whose q/k
# norms, query scale and RoPE (layers with a ``layer_rope_theta``) are one kernel (each token a
# batch row at its own position), values and a sigmoid output gate after a norm per head, fixed
# gated residuals (``add_*_alpha``/``beta``) with norms, and a compressed-width MoE run as its
# module; logits as Muse Glimmer's.
# iquestloopcoder (IQuest-Coder's Loop models): Llama's layout whose stack runs twice over the
# same weights (each pass an engine layer of its own, as nanbeige's); a layer of the second loop
# attends with its queries over the keys and values of its first-loop layer (globally) and
# over its own (in a ``loop_window_size`` window), the two outputs mixed per head by a sigmoid
# gate of its queries (``model.gate_projections``, :meth:`ModelAdapter.mix_loops`).
# spark2_5 (Spark 2.5): a fused ``q_k_v_proj``, a sigmoid output gate per head (``g_proj``, as
# Step-3.5's), ``out_proj``; sliding-window layers (``layer_types``), each kind with its own RoPE
# (base, rotary fraction); an exact-GELU gated MLP run as its module; ``model.embedding``.
# phi3small (Phi-3-small): a fused ``query_key_value`` holding, for each key/value head, its
# group's queries, then its key and value (InternLM2's layout, biased), LayerNorms, a GeGELU MLP
# (``up_proj`` interleaving gate and linear halves, clipped, run as its module); block-sparse
# attention (:class:`~mlx_lazy.attention.BlockSparse`: local blocks and vertical strides, a
# pattern per head, by original positions) in every ``dense_attention_every_n_layers``-th layer
# from 0 and dense attention in the others; muP: embeddings times ``mup_embedding_multiplier``,
# attention scale ``mup_attn_multiplier / head_dim``, the tied head's logits divided by
# ``mup_width_multiplier``, mlx-lm's dummy token ids masked to -inf.
# prism_hadamard_qwen35 (Qwen3.5 packs of 2-bit linears with a Hadamard rotation folded into
# their inputs): mlx-lm's qwen3_5 text model whose packed modules (embedding and head included)
# rotate their own inputs, run as qwen3_5 (:data:`_WRAPPERS`) through those modules.
# longcat_flash_ngram (LongCat-Flash with an n-gram embedding): LongCat-Flash's blocks; a token's
# embedding adds those of the n-grams it ends (their ids hashed from the ids of the
# ``emb_neighbor_num - 1`` tokens before it) to its own, all computed before any pruning
# (:meth:`ModelAdapter.embed`, its state the ids of the last tokens, :data:`EMBEDDING_STATE`).
# minimax_m3_vl (MiniMax-M3, its text model ``language_model``): Gemma's (1 + w) norms, per-head
# q/k norms, RoPE over ``rotary_dim`` of each head, SwiGLU-OAI (clamped) dense MLPs and, where
# ``moe_layer_freq`` says, sigmoid-routed experts (a correction bias) beside a shared expert at
# ``block.block_sparse_moe``; in its sparse-attention layers each query sees the keys of the
# ``index_topk_blocks`` blocks (of ``index_block_size`` original positions: a pruned token is
# absent from its block) its indexer scores highest, its own block always
# (:meth:`ModelAdapter.index_mask`); the indexer's key of a token is cached after each of its
# keys, its queries come as :meth:`qkv`'s gate.
# deepseek_v41 (DeepSeek-V4): every layer runs as mlx-lm's block, a recurrent one (its state: its
# sliding window of keys, its compressed keys and its open group; no cut may follow any: a
# compressed key pools every token of a group), on a token's hidden state holding its
# hyper-connection streams, their collapse weights and what a layer hands to later ones of the
# same step (:meth:`ModelAdapter._deepseek_v4_block`); candidate blocks are refused.
# kimi_k3 (Kimi K3, its text model ``language_model``): Kimi Linear's layout (its KDA layers'
# q/k/v in one projection and convolution), latent attention with a sigmoid output gate
# (``mla_use_output_gate``), SiTU MLPs and experts (run as their modules; the experts on a
# low-rank latent) and attention residuals (``attn_res_block_size``): each layer's attention and
# MLP take a softmax mix of the inputs of the blocks begun so far and the sum since the last
# one (mlx-lm's ``_attn_res_mix``), so a token's hidden state carries, after that sum, its
# blocks' inputs (one more at each block's first layer; :meth:`ModelAdapter.finish`).
SUPPORTED_MODEL_TYPES = ("Klear", "afm7", "afmoe", "apertus", "baichuan_m1", "bailing_hybrid",
                         "bailing_moe", "bailing_moe_linear", "bailing_moe_v3", "bitnet", "cohere",
                         "cohere2", "dbrx", "deepseek", "deepseek_v2", "deepseek_v3",
                         "deepseek_v32", "deepseek_v41", "dots1", "ernie4_5", "ernie4_5_moe",
                         "exaone", "exaone4", "exaone_moe", "falcon_h1", "gear", "gemma", "gemma2",
                         "gemma3", "gemma3_text", "gemma3n", "gemma4", "gemma4_text", "glm",
                         "glm4", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "gpt2", "gpt_bigcode",
                         "gpt_neox", "gpt_oss", "gptj", "granite", "granitemoe",
                         "granitemoehybrid", "helium", "hunyuan", "hunyuan_v1_dense", "internlm2",
                         "internlm3", "iquestloopcoder", "jamba", "kimi_k25", "kimi_k3",
                         "kimi_linear", "kimi_vl", "laguna", "lfm2", "lfm2-vl", "lfm2_moe",
                         "lille-130m", "llama", "llama4", "llama4_text", "longcat_flash",
                         "longcat_flash_ngram", "mellum", "mimo", "mimo_v2_flash", "minicpm",
                         "minicpm3", "minimax", "minimax_m3_vl", "ministral3", "mistral",
                         "mistral3", "mistral4", "mixtral", "muse_glimmer", "muse_spark",
                         "nanbeige", "nanochat", "nemotron", "nemotron-nas", "nemotron_h", "olmo2",
                         "olmo3", "olmo_hybrid", "olmoe", "openelm", "phi", "phi3", "phi3small",
                         "phimoe", "phixtral", "pixtral", "plamo", "plamo2", "plamo3",
                         "prism_hadamard_qwen35", "qwen", "qwen2", "qwen2_moe", "qwen2_vl",
                         "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_moe", "qwen3_next", "qwen3_vl",
                         "qwen3_vl_moe", "recurrent_gemma", "seed_oss", "smollm3", "solar_open",
                         "spark2_5", "stablelm", "starcoder2", "step3p5", "talkie", "telechat3",
                         "youtu_llm")
GEMMA3_TYPES = ("gemma3", "gemma3_text")
GEMMA4_TYPES = ("gemma4", "gemma4_text")
POST_NORM_TYPES = ("exaone4", "olmo2", "olmo3", "olmo_hybrid")
HYBRID_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
MLA_TYPES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "minicpm3", "mistral4", "youtu_llm",
             "bailing_moe_v3", "longcat_flash", "deepseek_v32", "glm_moe_dsa", "kimi_linear",
             "bailing_hybrid", "longcat_flash_ngram", "kimi_k3")
LIGHTNING_TYPES = ("bailing_moe_linear", "bailing_hybrid")
LONGCAT_TYPES = ("longcat_flash", "longcat_flash_ngram")
GRANITE_TYPES = ("granite", "granitemoe", "granitemoehybrid")
PARALLEL_TYPES = ("cohere2", "cohere", "phi", "gptj", "phixtral", "plamo")
LFM2_TYPES = ("lfm2", "lfm2_moe")
LEARNED_POSITION_TYPES = ("gpt2", "gpt_bigcode")
#: Llama's config names as other families' configs spell them (:func:`config_value`): GPT-2's
#: and StarCoder 1's, OpenELM's, DBRX's, Phixtral's, Step-3.5's, Lille's and AFM's.
_CONFIG_NAMES = {"hidden_size": ("n_embd", "model_dim", "d_model", "hidden_dim"),
                 "num_attention_heads": ("n_head", "num_query_heads", "n_heads", "num_heads"),
                 "vocab_size": ("num_vocab",),
                 "num_key_value_heads": ("num_kv_heads", "num_attention_groups", "n_kv_heads"),
                 "intermediate_size": ("n_inner",),
                 "max_position_embeddings": ("n_positions",)}
_LFM2_NAMES = {"input_layernorm": "operator_norm", "post_attention_layernorm": "ffn_norm",
               "o_proj": "out_proj", "q_norm": "q_layernorm", "k_norm": "k_layernorm",
               "linear_attn": "conv", "norm": "embedding_norm"}
#: The parts of a block (and the final norm) that a family names otherwise than Llama's
#: layout, by Llama's name (:meth:`ModelAdapter._part`).
_PART_NAMES = {"apertus": {"input_layernorm": "attention_layernorm",
                           "post_attention_layernorm": "feedforward_layernorm"},
               "bailing_moe": {"o_proj": "dense", "q_norm": "query_layernorm",
                               "k_norm": "key_layernorm", "embed_tokens": "word_embeddings"},
               "longcat_flash_ngram": {"embed_tokens": "ngram_embeddings.word_embeddings"},
               "bailing_moe_v3": {"o_proj": "dense", "embed_tokens": "word_embeddings",
                                  "linear_attn": "attention"},
               **dict.fromkeys(LIGHTNING_TYPES, {
                   "o_proj": "dense", "q_norm": "query_layernorm", "k_norm": "key_layernorm",
                   "embed_tokens": "word_embeddings", "linear_attn": "attention"}),
               "exaone": {"input_layernorm": "ln_1", "post_attention_layernorm": "ln_2",
                          "o_proj": "out_proj", "embed_tokens": "wte", "norm": "ln_f"},
               **dict.fromkeys(("hunyuan", "hunyuan_v1_dense"),
                               {"q_norm": "query_layernorm", "k_norm": "key_layernorm"}),
               "nanochat": {"q_proj": "c_q", "k_proj": "c_k", "v_proj": "c_v", "o_proj": "c_proj",
                            "embed_tokens": "wte", "norm": "ln_f"},
               "openelm": {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                           "o_proj": "out_proj", "embed_tokens": "token_embeddings"},
               "stablelm": {"q_norm": "q_layernorm", "k_norm": "k_layernorm"},
               "phi": {"o_proj": "dense", "norm": "final_layernorm"},
               "phi3small": {"o_proj": "dense", "norm": "final_layernorm"},
               "gpt_neox": {"o_proj": "dense", "embed_tokens": "embed_in",
                            "norm": "final_layer_norm"},
               "internlm2": {"input_layernorm": "attention_norm",
                             "post_attention_layernorm": "ffn_norm", "o_proj": "wo",
                             "embed_tokens": "tok_embeddings"},
               "qwen": {"input_layernorm": "ln_1", "post_attention_layernorm": "ln_2",
                        "o_proj": "c_proj", "embed_tokens": "wte", "norm": "ln_f",
                        "rope": "rotary_emb"},
               **dict.fromkeys(LEARNED_POSITION_TYPES,
                               {"input_layernorm": "ln_1", "post_attention_layernorm": "ln_2",
                                "o_proj": "c_proj", "embed_tokens": "wte", "norm": "ln_f"}),
               **dict.fromkeys(LFM2_TYPES, _LFM2_NAMES),
               "granitemoehybrid": {"linear_attn": "mamba"},
               **dict.fromkeys(("kimi_linear", "kimi_k3"), {"linear_attn": "self_attn"}),
               "jamba": {"linear_attn": "mamba", "post_attention_layernorm": "pre_ff_layernorm",
                         "norm": "final_layernorm"},
               "nemotron_h": {"input_layernorm": "norm", "linear_attn": "mixer",
                              "embed_tokens": "embeddings", "norm": "norm_f"},
               "afmoe": {"pre_feedforward_layernorm": "pre_mlp_layernorm",
                         "post_feedforward_layernorm": "post_mlp_layernorm"},
               "gptj": {"input_layernorm": "ln_1", "o_proj": "out_proj", "embed_tokens": "wte",
                        "norm": "ln_f"},
               "dbrx": {"input_layernorm": "norm_attn_norm.norm_1",
                        "post_attention_layernorm": "norm_attn_norm.norm_2", "o_proj": "out_proj",
                        "embed_tokens": "wte", "norm": "norm_f"},
               "phixtral": {"input_layernorm": "ln", "o_proj": "out_proj",
                            "embed_tokens": "embd.wte"},
               "spark2_5": {"o_proj": "out_proj", "embed_tokens": "embedding"},
               "talkie": {"q_proj": "attn_query", "k_proj": "attn_key", "v_proj": "attn_value",
                          "o_proj": "attn_resid", "embed_tokens": "embed"},
               "falcon_h1": {"linear_attn": "mamba",
                             "post_attention_layernorm": "pre_ff_layernorm",
                             "norm": "final_layernorm"},
               "lille-130m": {"input_layernorm": "attention.norm", "o_proj": "out_proj",
                              "embed_tokens": "tok_embeddings"},
               "plamo": {"input_layernorm": "norm", "rope": "rotary_emb"},
               **dict.fromkeys(("plamo2", "plamo3"), {
                   "input_layernorm": "pre_mixer_norm",
                   "post_attention_layernorm": "post_mixer_norm",
                   "pre_feedforward_layernorm": "pre_mlp_norm",
                   "post_feedforward_layernorm": "post_mlp_norm"}),
               "gear": {"linear_attn": "local_mixer"},
               "afm7": {"o_proj": "out_proj", "embed_tokens": "embedding", "norm": "output_norm"},
               "recurrent_gemma": {"input_layernorm": "temporal_pre_norm",
                                   "post_attention_layernorm": "channel_pre_norm",
                                   "linear_attn": "temporal_block", "norm": "final_norm"}}
#: Families whose per-head q/k norms act after RoPE (the others' before it).
_NORMS_AFTER_ROPE = ("hunyuan", "hunyuan_v1_dense", "llama4", "nanochat", "talkie", "afm7")
# Checkpoints whose text model is ``model.language_model`` (mlx-lm drops the vision tower), each
# with the type that text model runs as where the checkpoint says it (None: the text model's own
# ``model_type``; a VL checkpoint's text model names its checkpoint, or nothing: Kimi's).
_WRAPPERS = {"gemma3": None, "gemma4": None, "llama4": None, "mistral3": None, "qwen3_5": None,
             "qwen3_5_moe": None, "qwen2_vl": "qwen2", "qwen3_vl": "qwen3",
             "qwen3_vl_moe": "qwen3_moe", "lfm2-vl": "lfm2", "kimi_vl": "deepseek_v3",
             "kimi_k25": "deepseek_v3", "pixtral": "llama",
             "prism_hadamard_qwen35": "qwen3_5", "minimax_m3_vl": "minimax_m3_vl",
             "muse_spark": "muse_spark", "kimi_k3": "kimi_k3"}
# The mlx-lm releases whose model internals this adapter is tested against (it reads
# ``self_attn.{rope, scale, n_heads, n_kv_heads, q_norm, k_norm, scaling_beta,
# original_max_position_embeddings, sinks, is_local, v_norm, use_sliding_window}``, ``use_sliding``,
# ``post_self_attn_layernorm``, ``post_mlp_layernorm``, ``attention_layernorm``,
# ``feedforward_layernorm``, ``args.{logit_scale, tie_word_embeddings}``,
# ``rope_utils.DynamicNTKScalingRoPE`` (its base from where a call ends), ``layer_types``,
# ``layer_scalar``, ``enable_moe``, ``router``, ``experts``, ``embed_tokens.as_linear``,
# ``linear_attn`` (LFM2's ``conv``, Granite 4.0's ``mamba``) called as ``(x, mask, ArraysCache)``,
# Granite 4.0's ``shared_mlp``; LFM2's names in
# :data:`_LFM2_NAMES`; latent attention's ``self_attn.{num_heads, q_lora_rank, q_proj, q_a_proj,
# q_a_layernorm, q_b_proj, qk_nope_head_dim, kv_lora_rank, kv_a_proj_with_mqa, kv_a_layernorm,
# kv_b_proj, embed_q, unembed_out}``; the feed-forward at ``mlp`` or ``block_sparse_moe``, mixtral's
# heads at ``self_attn.{num_heads, num_key_value_heads}``, Gemma 2's
# ``self_attn.attn_logit_softcapping``, EXAONE 3's ``transformer.{wte, h, ln_f}``, ``ln_1``,
# ``ln_2``, ``attn.attention.out_proj``, Hunyuan's ``self_attn.{query_layernorm, key_layernorm}``,
# StableLM's ``self_attn.{q_layernorm, k_layernorm, head_dim}`` and ``args.use_parallel_residual``,
# MiniCPM's ``args.{scale_emb, scale_depth, dim_model_base}``, MiniCPM3's
# ``self_attn.softmax_scale``, nanochat's
# ``models.nanochat.{rms_norm, apply_rotary_emb}``, ``attn.{c_q, c_k, c_v, c_proj, num_kv_heads,
# _rope_freqs}`` and its soft-cap of 15; bailing_moe's ``attention.{query_key_value, dense,
# query_layernorm, key_layernorm}``, ``model.word_embeddings``; hunyuan's ``args.{use_cla,
# cla_share_factor}``, ``self_attn.key_layernorm``; llama4's ``self_attn.{use_rope, use_qk_norm,
# attn_temperature_tuning, floor_scale, attn_scale}``, ``args.attention_chunk_size``,
# ``block.feed_forward``, llama4_text's ``output``; phi's ``self_attn.dense``, ``final_layernorm``;
# gpt_neox's ``model.{h, embed_in, embed_out, final_layer_norm}``, ``attention.{query_key_value,
# dense, num_attention_heads}``; internlm2's ``attention.{wqkv, n_kv_groups, head_dim}``,
# ``output``; qwen's ``attn.{c_attn, rotary_emb}``, ``mlp.{w1, w2}``; GPT-2's and StarCoder 1's
# ``attn.{c_attn, n_head, n_heads, n_kv_heads, head_dim}``, ``wpe``; openelm's ``attn.{qkv_proj,
# out_proj, head_dim, n_heads, n_kv_heads}``, ``ffn.{proj_1, proj_2}``,
# ``transformer.token_embeddings``, ``args.{model_dim, num_query_heads, num_kv_heads}``;
# mellum's ``args.layer_types``, nanbeige's ``model.num_loops``, ``args.skip_loop_final_norm``;
# granitemoehybrid's ``block.{mamba, shared_mlp}``; nemotron_h's ``backbone.{embeddings,
# norm_f}``, ``block.{norm, mixer, block_type}``, its MLP mixers called as ``(x)``; jamba's
# ``block.{mamba, pre_ff_layernorm, feed_forward}`` (the mamba called as ``(x, ArraysCache)``),
# ``model.final_layernorm``; exaone_moe's and afmoe's ``args.layer_types``, afmoe's
# ``self_attn.gate_proj``, ``args.mup_enabled``, ``block.{pre_mlp_layernorm,
# post_mlp_layernorm}``; gptj's ``model.{wte, h, ln_f}``, ``block.{ln_1, attn, mlp}``,
# ``attn.{out_proj, num_attention_heads, head_dim, rope}``; dbrx's ``transformer.{wte, blocks,
# norm_f}``, ``block.{norm_attn_norm.{norm_1, attn, norm_2}, ffn}``, ``attn.{Wqkv, clip_qkv,
# out_proj, num_heads, num_key_value_heads, scale}``; phixtral's ``transformer.{embd.wte, h}``,
# ``block.{ln, mixer, moe}``, ``mixer.{Wqkv, out_proj, num_heads}``, ``lm_head.{ln, linear}``;
# minimax's ``self_attn.{num_attention_heads, num_key_value_heads}``,
# ``block.block_sparse_moe``; mimo_v2_flash's ``self_attn.{attention_sink_bias, value_scale,
# scale}``, ``block.is_sliding_window``, ``args.sliding_window_size``; step3p5's
# ``self_attn.{num_heads, num_kv_heads, g_proj}``, ``block.is_sliding``, its MLP's ``limit``;
# nemotron-nas's ``block.attention_config``, its blocks called as
# ``(x)``; plamo3's ``model.layers.layers``, ``block.{mixer, full_attn, pre_mixer_norm,
# post_mixer_norm, pre_mlp_norm, post_mlp_norm}``, ``mixer.{qkv_proj, q_num_heads, k_num_heads}``,
# ``config.window_size``; laguna's ``self_attn.g_proj``, ``args.layer_types``; talkie's
# ``model.{embed, blocks}``, ``attn.{attn_query, attn_key, attn_value, attn_resid, head_gain,
# _rope_freqs}``, ``block.{attn_gain, mlp_gain, embed_skip}``, ``lm_head``, ``lm_head_gain``;
# bailing_moe_v3's ``block.is_linear``, ``attention.{g_proj, v_head_dim,
# dense}`` and its KDA called as ``(x, mask, ArraysCache(4))``; longcat_flash's ``block.{self_attn,
# mlps, input_layernorm, post_attention_layernorm}`` as lists of two, ``block.mlp``,
# ``self_attn.{num_attention_heads, mla_scale_q_lora, mla_scale_kv_lora}``;
# falcon_h1's ``block.{mamba, self_attn, pre_ff_layernorm, feed_forward}``
# (the mamba called as ``(x, cache=ArraysCache)``), ``args.{lm_head_multiplier,
# embedding_multiplier}``, ``model.final_layernorm``;
# plamo2's ``model.layers.layers`` (its ``layers``), ``block.{is_mamba, mixer, pre_mixer_norm,
# post_mixer_norm, pre_mlp_norm, post_mlp_norm}``, its Mamba blocks called as ``(h, None,
# ArraysCache)``, ``mixer.{qkv_proj, q_weight, k_weight, q_num_heads, k_num_heads}``;
# lille-130m's ``transformer.{tok_embeddings, norm}``, ``block.{attention, feed_forward}``,
# ``attention.{norm, qkv_proj, out_proj, n_head, n_kv_heads}``, its MLP called as ``(x)``;
# plamo's ``block.norm``, ``self_attn.{rotary_emb, q_num_heads, k_num_heads}``,
# ``args.n_shared_head``; bitnet's ``self_attn.attn_sub_norm``, its MLP called as ``(x)``;
# deepseek_v32's ``self_attn.indexer.{wq_b, wk, k_norm, weights_proj, rope, n_heads, head_dim,
# softmax_scale, index_topk}``; gear's ``block.local_mixer``, ``models.gear._activation``,
# ``args.{hidden_activation, final_logit_softcapping}``, its blocks called as ``(h, mask=None,
# cache=ArraysCache(2))``;
# recurrent_gemma's ``block.{temporal_block, temporal_block_type, temporal_pre_norm,
# channel_pre_norm, mlp_block}``, ``model.final_norm``, ``args.{attention_window_size,
# logits_soft_cap, embeddings_scale_by_sqrt_dim}``, its blocks called likewise; afm7's
# ``model.{embedding, layers, kv_reuse_layers, output_norm}``, ``self_attn.{qkv_proj, out_proj,
# quant_key_scale, quant_value_scale}``, ``FusedLinear.indices``, ``afm7.fake_8bit_quant``;
# baichuan_m1's ``self_attn.{W_pack, conv_k, conv_v, num_kv_heads, head_dim,
# _custom_convolution}``, ``config.sliding_window_layers``;
# olmo_hybrid's ``block.linear_attn`` called as ``(x, mask, ArraysCache(4))``; kimi_linear's
# ``block.{is_linear, self_attn}``, its KDA called as ``(x, mask, ArraysCache(4))``, its latent
# attention's ``self_attn.{num_heads, q_proj, embed_q, unembed_out}`` without ``rope``;
# bailing_moe_linear's and bailing_hybrid's ``block.is_global``, lightning attention's
# ``attention.{query_key_value, use_qk_norm, query_layernorm, key_layernorm, rope, _slope, scale,
# g_norm, g_proj, dense, head_dim}``, its module's ``recurrent_gla(q, k, v, g, scale=, h=)``;
# gemma3n's ``model.language_model``, its ``{get,project}_per_layer_inputs``,
# ``layer_idx_to_cache_idx``, ``altup_projections``, ``altup_unembed_projections``,
# ``block.{altup.{predict, correct, correct_output_scale}, laurel, config.altup_correct_scale,
# per_layer_input_gate, per_layer_projection, post_per_layer_input_norm}``,
# ``mlp.activation_sparsity``;
# muse_glimmer's ``self_attn.{qk_scale_factor, eps, gate_proj, use_rope}``, ``args.{layer_types,
# output_multiplier, final_logit_softcapping}``; spark2_5's ``self_attn.{q_k_v_proj, g_proj,
# out_proj}``, ``model.embedding``, ``args.layer_types``; iquestloopcoder's ``model.{loop_num,
# gate_projections}`` (called as ``(queries)``), ``args.loop_window_size``; muse_spark's
# ``model.language_model``, ``models.muse_spark.{qk_norm_rope, qk_norm, rms_norm_sigmoid_gate,
# norm_add_norm, pre_norm}``, ``self_attn.{qkvg_proj, use_rope, query_scale, eps}``,
# ``block.{add_attn_alpha, add_attn_beta, add_ffn_alpha, add_ffn_beta, post_norm_eps}``, its
# blocks called as ``(h, attn_input=, next_norm=)``; kimi_k3's
# ``block.{is_block_start, self_attention_res_norm, self_attention_res_proj, mlp_res_norm,
# mlp_res_proj}``, ``model.{output_attn_res_norm, output_attn_res_proj}``,
# ``kimi_k3.{ResidualBlocks, _attn_res_mix}``, its KDA called as ``(x, mask, ArraysCache(2))``):
# at least the first, below the second. Same as pyproject.toml.
MLX_LM_VERSIONS = ((0, 32), (0, 33))


#: Suffixes that name a variant of a supported type in :func:`supported_types`.
_VARIANT_SUFFIXES = ("_text", "_moe", "_lite")


def supported_types() -> str:
    """:data:`SUPPORTED_MODEL_TYPES` as a message shows them, each with its variants:
    ``gemma3(_text), ..., glm4(_moe)(_moe_lite), ..., qwen3_5(_moe)`` (a variant of a variant
    folded into the first)."""
    types = sorted(SUPPORTED_MODEL_TYPES)

    def root(t: str) -> str:
        return next((root(t[:-len(v)]) for v in _VARIANT_SUFFIXES
                     if t.endswith(v) and t[:-len(v)] in types), t)

    return ", ".join(r + "".join(f"({t[len(r):]})" for t in types if t != r and root(t) == r)
                     for r in types if root(r) == r)


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


def config_value(args: Any, name: str, default: Any = None) -> Any:
    """``args.<name>`` (Llama's config name), or the same setting under another family's name
    (:data:`_CONFIG_NAMES`: GPT-2's ``n_embd``, OpenELM's ``model_dim``, ...); ``default``
    where none is there (GPT-2's MLP width, 4 x hidden in mlx-lm)."""
    for spelling in (name, *_CONFIG_NAMES.get(name, ())):
        if hasattr(args, spelling):
            return getattr(args, spelling)
    return default


def kv_heads(args: Any) -> int:
    """All ranks' key/value heads in a text model's config: ``num_key_value_heads`` (or its
    name in :data:`_CONFIG_NAMES`), DBRX's ``attn_config["kv_n_heads"]``, else one per query head
    (GPT-J, Phixtral: no GQA)."""
    return _total(config_value(args, "num_key_value_heads")
                  or (getattr(args, "attn_config", None) or {}).get("kv_n_heads")
                  or config_value(args, "num_attention_heads"))


def _total(count: Any) -> int:
    """A count, or the sum of one given per layer (OpenELM's heads)."""
    return int(sum(count) if isinstance(count, list) else count)


def model_family(model_type: Optional[str]) -> Optional[str]:
    """The model type a checkpoint's ``model_type`` runs as: mlx-lm builds some under another
    one's module (its ``MODEL_REMAPPING``: Kimi K2's ``kimi_k2`` as ``deepseek_v3``,
    MiniMax-M2's ``minimax_m2`` as ``minimax``, ``xverse`` as ``llama``, ``qwen2_5_vl`` as
    ``qwen2_vl``) and the model keeps the checkpoint's name."""
    return MODEL_REMAPPING.get(model_type, model_type)


def _family(module: nn.Module) -> Optional[str]:
    return model_family(getattr(module, "model_type", None))


def _text_model(model: nn.Module) -> nn.Module:
    if _family(model) in ("gemma3n", "muse_spark"):  # (their vision and audio towers dropped)
        return model.model.language_model
    return model.language_model if _family(model) in _WRAPPERS else model


def _text_type(model: nn.Module) -> Optional[str]:
    """The type a model's text model runs as (:data:`_WRAPPERS`): a VL checkpoint's text
    model's family, else the text model's own ``model_type``'s family."""
    return _WRAPPERS.get(_family(model)) or _family(_text_model(model))


def text_args(text: nn.Module) -> Any:
    """The ``ModelArgs`` of a text model: its ``args`` (Youtu-LLM's ``config``); None for
    neither."""
    return getattr(text, "args", None) or getattr(text, "config", None)


def _blocks(text: nn.Module) -> List[nn.Module]:
    """The transformer blocks of a text model: ``model.layers``, or ``transformer.h`` (EXAONE
    3's, nanochat's, StarCoder 1's) and GPT-NeoX's and GPT-2's ``model.h`` through the model's
    ``layers``; Nanbeige's once per loop (its stack runs ``num_loops`` times over the same
    weights, each pass a layer with its own keys and values; IQuest-Loop-Coder's twice, its
    ``loop_num``)."""
    if _family(text) in ("nanbeige", "iquestloopcoder"):
        return text.model.layers * (getattr(text.model, "num_loops", None) or text.model.loop_num)
    if _family(text) in LONGCAT_TYPES:
        return [_sublayer(block, i) for block in text.model.layers for i in range(2)]
    # (PLaMo 3's model.layers is a module holding them: its model's layers; AFM's, its layers
    # before the KV-reuse ones: its model's layers)
    return (text.model.layers if _family(text) != "afm7" and "model" in text
            and isinstance(text.model.get("layers"), list) else text.layers)


def num_layers(model: nn.Module) -> int:
    """The engine's depth on an mlx-lm ``model``: what a schedule's layer indices and depth
    fractions count (a looped Nanbeige's passes, not ``len(model.layers)``, its blocks)."""
    return len(_blocks(_text_model(model)))


def _sublayer(block: nn.Module, i: int) -> nn.Module:
    """LongCat-Flash's decoder block as two layers of Llama's layout: the ``i``-th of its
    attentions with its norms and dense MLP; the first also holds the block's MoE
    (``shortcut``), which takes the first MLP's input and whose output the second adds last."""
    layer = nn.Module()
    for name in ("input_layernorm", "self_attn", "post_attention_layernorm"):
        setattr(layer, name, block[name][i])
    layer.mlp = block.mlps[i]
    if i == 0:
        layer.shortcut = block.mlp
    return layer


def sliding_windows(model: nn.Module) -> List[Optional[Window]]:
    """Each layer's sliding window on an mlx-lm ``model`` of :data:`SUPPORTED_MODEL_TYPES`
    (a query at position p sees keys at positions p - window + 1 .. p), None where it
    attends globally: Gemma 3's, Gemma 4's, EXAONE 4's and Command R7B's local layers have one,
    and Ministral 3's, gpt-oss's, OLMo 3's, Mellum's, K-EXAONE's, AFM's, Step-3.5's and Laguna's
    where the config says ``sliding_attention``, MiMo-V2-Flash's where ``hybrid_layer_pattern``
    says 1, PLaMo 3's but every ``sliding_window_pattern``-th, Gear's where ``layer_types`` says
    ``sliding_attention``, Baichuan-M1's ``sliding_window_layers``, every RecurrentGemma
    attention layer, Gemma 3n's as Gemma 3's;
    Llama 4's local layers (those with RoPE, as mlx-lm picks them) attend within chunks
    (:class:`~mlx_lazy.attention.Chunks`); no other supported family's do."""
    text = _text_model(model)
    if _family(model) == "llama4":
        chunks = Chunks(int(text.args.attention_chunk_size))
        return [chunks if block.self_attn.use_rope else None for block in _blocks(text)]
    window, text_type = getattr(text_args(text), "sliding_window", None), _text_type(model)
    if _family(model) in (*GEMMA3_TYPES, *GEMMA4_TYPES, "gemma3n"):
        sliding = [block.self_attn.is_sliding for block in _blocks(text)]
    elif text_type == "ministral3":
        sliding = [block.use_sliding for block in _blocks(text)]
    elif text_type in ("gpt_oss", "olmo3"):
        sliding = [kind == "sliding_attention" for kind in text.model.layer_types]
    elif text_type == "exaone4":
        sliding = [block.self_attn.is_local for block in _blocks(text)]
    elif text_type == "cohere2":
        sliding = [block.self_attn.use_sliding_window for block in _blocks(text)]
    elif text_type in ("mellum", "exaone_moe", "afmoe", "laguna", "gear", "muse_glimmer",
                       "spark2_5", "muse_spark"):
        sliding = [kind == "sliding_attention" for kind in text.args.layer_types]
    elif text_type == "step3p5":
        sliding = [block.is_sliding for block in _blocks(text)]
    elif text_type == "baichuan_m1":
        sliding = [i in text.config.sliding_window_layers for i in range(len(_blocks(text)))]
    elif text_type == "recurrent_gemma":  # every attention layer
        window = text.args.attention_window_size
        sliding = [block.temporal_block_type == "attention" for block in _blocks(text)]
    elif text_type == "mimo_v2_flash":
        window = text.args.sliding_window_size
        sliding = [block.is_sliding_window for block in _blocks(text)]
    elif text_type == "phi3small":  # its block-sparse layers: a pattern, not a window
        args = text.args
        pattern = BlockSparse(args.blocksparse_block_size, args.blocksparse_num_local_blocks,
                              args.blocksparse_vert_stride, args.num_attention_heads)
        return [pattern if block.self_attn.block_sparse else None for block in _blocks(text)]
    elif text_type == "iquestloopcoder":  # the second loop's own keys and values
        window, blocks = text.args.loop_window_size, len(text.model.layers)
        sliding = [False] * blocks + [True] * blocks
    elif text_type == "plamo3":  # the window of mlx-lm's caches and of llama.cpp (mlx-lm's
        # prompt mask, window_size + 1 wide, disagrees with its own caches' window_size)
        sliding, window = [not block.full_attn for block in _blocks(text)], text.config.window_size
    else:
        sliding = [False] * len(_blocks(text))
    return [int(window) if s else None for s in sliding]


def global_layers(model: nn.Module) -> Tuple[int, ...]:
    """The layers a cut may follow on a ``model`` where not every layer may: those that
    attend globally (not through a sliding window, not recurrent nor without attention), but
    the last (see :func:`mlx_lazy.policies.at_global_layers`); () on a model whose layers all
    attend globally, where any may."""
    windows = sliding_windows(model)
    other = set(recurrent_layers(model)) | set(stateless_layers(model))
    if all(w is None for w in windows) and not other:
        return ()
    return tuple(layer for layer, w in enumerate(windows[:-1])
                 if w is None and layer not in other)


def recurrent_layers(model: nn.Module) -> Tuple[int, ...]:
    """The recurrent (linear-attention) layers of a hybrid ``model`` (Qwen3.5's Gated
    DeltaNet layers, LFM2's convolutions, Jamba's Mamba layers, Granite 4.0's and Nemotron-H's
    Mamba-2 layers, PLaMo 2's Mamba layers, Ling 2.5's and Kimi Linear's Kimi Delta Attention
    layers, OLMo Hybrid's Gated DeltaNet layers, Ring-linear's lightning attention layers, every
    Falcon-H1 layer, its Mamba-2 mixer beside its attention, Gear's convolution mixers,
    RecurrentGemma's RG-LRU layers, every Baichuan-M1 layer, its keys mixing in the previous
    token's, every DeepSeek-V4 layer, its compressed keys pooling groups of tokens); () for
    every other family. Such
    a layer holds one state that has taken its tokens in order, not keys and values: a token
    pruned below it can never enter it later, and no cut can follow it (it gives no attention
    to score with)."""
    return tuple(layer for layer, block in enumerate(_blocks(_text_model(model)))
                 if not _stateless(block) and (
                     hasattr(block, "linear_attn") or hasattr(block, "conv")
                     or hasattr(block, "mamba") or getattr(block, "block_type", "*") != "*"
                     or getattr(block, "is_mamba", False)
                     or getattr(block, "is_linear", False)  # KDA
                     or hasattr(block, "local_mixer")  # gear
                     or "conv_k" in getattr(block, "self_attn", {})  # baichuan_m1
                     or hasattr(block, "attn_hc")  # deepseek_v41
                     or getattr(block, "temporal_block_type", None) == "recurrent"
                     or not getattr(block, "is_global", True)))  # lightning attention


def stateless_layers(model: nn.Module) -> Tuple[int, ...]:
    """The layers of ``model`` without attention that compute each token alone, holding no
    state (Nemotron-H's MLP or experts, Llama-Nemotron's layers whose attention is a no-op or
    one linear map): run as mlx-lm's own block, on any tokens in any order (a revived one
    too); no cut can follow one (it gives no attention to score with)."""
    return tuple(layer for layer, block in enumerate(_blocks(_text_model(model)))
                 if _stateless(block))


def _stateless(block: nn.Module) -> bool:
    config = getattr(block, "attention_config", None)  # nemotron-nas
    return (getattr(block, "block_type", None) in ("-", "E")
            or config is not None and (config.no_op or config.replace_with_linear))


class ModelAdapter:
    """Layer-level access to a Llama-family mlx-lm model.

    Args:
        model: a model returned by ``mlx_lm.load``.

    Raises:
        UserInputError: for model types other than :data:`SUPPORTED_MODEL_TYPES`, models
            with sliding-window layers other than those :func:`sliding_windows` reads, or an
            mlx-lm outside :data:`MLX_LM_VERSIONS`.
    """

    def __init__(self, model: nn.Module):
        check_mlx_lm_version()
        if not isinstance(model, nn.Module):  # a name or a path: "unsupported model type None"
            raise UserInputError(f"the model must be one that mlx_lazy.load returns, got "
                                 f"{type(model).__name__} {shown(model, 80)}")
        model_type = _family(model)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UserInputError(f"unsupported model type {getattr(model, 'model_type', None)!r}; "
                                 f"mlx-lazy supports {supported_types()}")
        self.model = model
        self.text = _text_model(model)
        text_type = _text_type(model)
        model_type = _WRAPPERS.get(model_type) or model_type  # a VL checkpoint's: its text's
        if model_type == "mistral3" and text_type not in ("llama", "ministral3", "mistral4"):
            raise UserInputError(f"unsupported text model type {text_type!r} in a "
                                 "mistral3 checkpoint; mlx-lazy supports llama, ministral3, "
                                 "mistral4")
        self._gemma2 = model_type == "gemma2"
        self._gemma3 = model_type in GEMMA3_TYPES
        self._gemma4 = model_type in GEMMA4_TYPES
        self._gemma3n = model_type == "gemma3n"
        self._post_norms = model_type in POST_NORM_TYPES
        self._parallel = model_type in PARALLEL_TYPES or (
            model_type in ("stablelm", "gpt_neox") and self.text.args.use_parallel_residual)
        # the norm a parallel block's MLP takes: attention's, but GPT-NeoX's own
        self._parallel_norm = ("post_attention_layernorm" if model_type == "gpt_neox"
                               else "input_layernorm")
        self._qkv_by_head = model_type == "gpt_neox"  # its fused q, k, v: head by head
        # each key/value head's queries, then its key and value (InternLM2's wqkv's layout)
        self._qkv_grouped = model_type == "phi3small"
        self._sandwich = model_type == "glm4"  # a norm before and after each branch
        self._afmoe = model_type == "afmoe"  # Gemma 2's four norms under its own names
        self._softplus_gate = model_type == "laguna"  # its g_proj's gain per head
        self._plamo2 = model_type == "plamo2"
        self._four_norms = (self._afmoe or self._plamo2  # (PLaMo's, Muse Glimmer's too)
                            or model_type in ("plamo3", "gear", "muse_glimmer"))
        # recurrent layers run as mlx-lm's whole block (their norms and MLP)
        self._whole_block = self._plamo2 or model_type in ("gear", "recurrent_gemma")
        # EXAONE 3's and nanochat's transformer, Nemotron-H's backbone, or the model
        self.inner = next((self.text[k] for k in ("transformer", "backbone", "model")
                           if k in self.text), self.text)  # (Gemma 3n's: the text model)
        self._names = _PART_NAMES.get(model_type, {})
        self.layers = list(_blocks(self.text))
        # nanochat's every norm: one function, no weights
        self._weightless = nanochat.rms_norm if model_type == "nanochat" else None
        self._embed_skip = model_type == "talkie"  # the normed embeddings carried in h
        if self._embed_skip:  # talkie's every norm: its own epsilon
            self._weightless = partial(mx.fast.rms_norm, weight=None,
                                       eps=text_args(self.text).rms_norm_eps)
        # the norm on the embeddings: nanochat's and Talkie's weightless one, Muse Glimmer's
        self._embed_norm = self._weightless or (
            partial(mx.fast.rms_norm, weight=None, eps=text_args(self.text).rms_norm_eps)
            if model_type in ("muse_glimmer", "muse_spark") else None)
        self._windows = sliding_windows(model)
        if any(getattr(layer, "use_sliding", False) and window is None
               for layer, window in zip(self.layers, self._windows)):
            raise UserInputError("sliding-window attention layers are not supported")
        self._recurrent = frozenset(recurrent_layers(model))
        self._stateless = frozenset(stateless_layers(model))
        self._mixer_mask = model_type != "jamba"  # Jamba's Mamba takes no mask
        # its recurrent layers' state: 4 arrays (KDA's; OLMo Hybrid's Gated DeltaNet's too)
        self._kda = model_type in ("bailing_moe_v3", "kimi_linear", "olmo_hybrid")
        self._lightning = model_type in LIGHTNING_TYPES  # its recurrent layers' state: 1 array
        # kimi_k3's attention residuals: a token's hidden state (1 + blocks) x hidden_size wide
        self._attn_res = (model_type == "kimi_k3"
                          and text_args(self.text).attn_res_block_size is not None)
        # longcat_flash: a token's hidden state after each even layer carries its block's MoE
        # output after its (hidden_size,) part, which the odd layer adds
        self._shortcut = model_type in LONGCAT_TYPES
        # each layer's attention module (None in a recurrent or stateless layer), found once:
        # read per layer and step; sharding changes their projections in place, not the
        # modules (Falcon-H1's recurrent layers each hold one, beside the mixer)
        self._falcon_h1 = model_type == "falcon_h1"
        if model_type == "bitnet" and not mx.metal.is_available():
            raise UserInputError("mlx-lazy cannot run bitnet models here: mlx-lm's BitLinear "
                                 "layers are a Metal kernel, and this machine has no Metal")
        self._fused = model_type == "muse_spark"  # mlx-lm's fused kernels (Metal only)
        if self._fused and not mx.metal.is_available():
            raise UserInputError("mlx-lazy cannot run muse_spark models here: mlx-lm runs their "
                                 "layers with Metal kernels, and this machine has no Metal")
        self._conv_kv = model_type == "baichuan_m1"  # its recurrent layers attend too
        self._deepseek_v4 = model_type == "deepseek_v41"  # (so do these)
        self._attns = [None if i in self._stateless
                       or (i in self._recurrent
                           and not (self._falcon_h1 or self._conv_kv or self._deepseek_v4))
                       else attention_module(block) for i, block in enumerate(self.layers)]
        self._softcaps = [getattr(a, "attn_logit_softcapping", None) or None for a in self._attns]
        # minimax_m3_vl: its sparse-attention layers, whose indexer chooses key blocks
        self._block_indexed = [getattr(a, "is_sparse_attn", False) for a in self._attns]
        # what index_topk gives, read once: the engine asks at every layer of every step
        self._index_topks = [attn.index_topk_blocks * attn.index_block_size if sparse else
                             getattr(getattr(attn, "indexer", None), "index_topk", None)
                             for attn, sparse in zip(self._attns, self._block_indexed)]
        attn = next((a for a in self._attns if a is not None), None)
        if attn is None:  # (a Mamba-only Granite 4.0 config, say)
            raise UserInputError(f"this {model_type} model has no attention layer; mlx-lazy "
                                 "runs models with at least one")
        self._gated = model_type in HYBRID_TYPES  # q_proj gives queries, then output gates
        self._mla = text_type in MLA_TYPES  # (a mistral3 checkpoint's mistral4)
        if self._mla:  # the absorbed form (embed_q) has one key/value head, the latent
            self.n_heads: int = getattr(attn, "num_heads", None) or attn.num_attention_heads
            self.n_kv_heads: int = 1 if hasattr(attn, "embed_q") else attn.num_heads
        else:
            self.n_heads = (getattr(attn, "n_heads", None) or getattr(attn, "num_heads", None)
                            or getattr(attn, "n_head", None)  # gpt2
                            or getattr(attn, "q_num_heads", None)  # plamo2, plamo3
                            or attn.num_attention_heads)  # mixtral: num_heads
            self.n_kv_heads = (getattr(attn, "n_kv_heads", None)
                               or getattr(attn, "num_kv_heads", None)  # nanochat
                               or getattr(attn, "num_key_value_heads", None)
                               or getattr(attn, "k_num_heads", None)  # plamo2, plamo3
                               or self.n_heads)  # gpt_neox, gpt2: one per query head
            if model_type == "recurrent_gemma":  # one key/value head (its config's unread)
                self.n_kv_heads = 1
        head_dim = getattr(attn, "head_dim", None) or (  # phixtral's: hidden / heads
            config_value(text_args(self.text), "hidden_size") // self.n_heads)
        self.scale: float = (getattr(attn, "scale", None) or getattr(attn, "sm_scale", None)
                             or getattr(attn, "softmax_scale", None)  # minicpm3
                             or head_dim ** -0.5)  # stablelm: 1/sqrt(head_dim)
        # mimo_v2_flash: a layer whose heads are of another size (its own scale) has its
        # queries times (its scale / self.scale), the scale every layer's attention takes
        self._query_ratios = [a.scale / self.scale if isinstance(getattr(a, "scale", None), float)
                              and a.scale != self.scale else None for a in self._attns]
        self.lm_head = getattr(self.text, "lm_head", None)
        if model_type in ("llama4_text", "internlm2") and not self.text.args.tie_word_embeddings:
            self.lm_head = self.text.output
        if model_type == "gpt_neox":
            self.lm_head = self.inner.embed_out
        if model_type == "helium" and self.text.args.tie_word_embeddings:
            self.lm_head = None  # mlx-lm builds one but uses the embedding
        self._float32 = self.variant() == "float32"  # OpenBLAS runs its matmuls on the CPU
        gemma = self._gemma2 or self._gemma3 or self._gemma4 or self._gemma3n
        self._feed_forwards = [feed_forward(block) for block in self.layers]
        self._shared_mlps = [getattr(block, "shared_mlp", None) for block in self.layers]
        # Gear's MLP activation, by its config (tanh GELU, exact GELU or SiLU)
        gear_act = (gear._activation(text_args(self.text).hidden_activation)
                    if model_type == "gear" else None)
        gelu = gemma or model_type == "recurrent_gemma" or gear_act is nn.gelu_approx
        # Gemma 1's, Gear's and Spark 2.5's exact GELU have no CPU kernel, nor BitNet's ReLU^2
        # and sub-norm, nor Gemma 3n's sparse gates (a top-k of each token's gate values), and
        # Lille's MLP holds its own norm (and Kimi K3's SiTU): mlx-lm's module runs them
        self._mlp_normed = model_type == "lille-130m"
        self._activations = [None if model_type in ("gemma", "bitnet", "spark2_5", "kimi_k3")
                             or self._mlp_normed or gear_act is nn.gelu
                             or getattr(mlp, "activation_sparsity", 0) > 0
                             else _gated_activation(mlp, gelu) for mlp in self._feed_forwards]
        args = text_args(self.text)
        # plamo: its key/value heads tiled, query head i reading i mod their count; the
        # engine's grouped-query attention has head i read i // (heads per key/value head):
        # queries go in the order of the head they read, their outputs back (finish)
        self._head_order = self._head_return = None
        if model_type == "plamo":
            if self.n_heads != self.n_kv_heads * args.n_shared_head:
                raise UserInputError(
                    f"this plamo model's {self.n_heads} heads are not its {self.n_kv_heads} "
                    f"key/value heads times n_shared_head ({args.n_shared_head}); mlx-lazy "
                    "cannot run it")
            order = np.arange(self.n_heads).reshape(-1, self.n_kv_heads).T.ravel()
            self._head_order, self._head_return = mx.array(order), mx.array(np.argsort(order))
        # Gemma 4's E2B/E4B: the layer whose keys and values each layer attends over, and
        # the width of each layer's per-token input
        self._kv_layers = list(getattr(self.inner, "previous_kvs", None)
                               or getattr(self.inner, "layer_idx_to_cache_idx", None)  # gemma3n
                               or range(len(self.layers)))
        if model_type == "hunyuan" and args.use_cla:  # the layer below, as mlx-lm shares
            self._kv_layers = [i - i % args.cla_share_factor for i in range(len(self.layers))]
        if model_type == "afm7":  # the KV-reuse layers: those of the last layer before them
            below = len(self.inner.layers)
            self._kv_layers = [min(i, below - 1) for i in range(len(self.layers))]
        self._norms_after_rope = model_type in _NORMS_AFTER_ROPE
        # mistral4's (beta, original_max_position_embeddings) of Llama 4's attention temperature
        self._query_scaling = (
            (args.rope_parameters["llama_4_scaling_beta"],
             args.rope_parameters["original_max_position_embeddings"])
            if text_type == "mistral4" else None)
        # llama4(_text)'s weight-free q/k norm's epsilon
        self._l2_eps = (1e-6 if model_type == "llama4" else
                        args.rms_norm_eps if model_type == "llama4_text" else None)
        self._key_ratios = {layer: self._key_norm_ratio(layer) for layer, kv in
                            enumerate(self._kv_layers) if kv != layer and model_type == "hunyuan"}
        self._embedding = self._part(self.inner, "embed_tokens")
        self._ngram = getattr(self.inner, "ngram_embeddings", None)  # longcat_flash_ngram
        self._position_embedding = getattr(self.inner, "wpe", None)  # GPT-2's, StarCoder 1's
        self._final_norm = self._weightless or self._part(self.inner, "norm")
        if model_type == "phixtral":  # its head module: the final norm, then the head
            self._final_norm, self.lm_head = self.text.lm_head.ln, self.text.lm_head.linear
        if self._fused:  # the head on the wrapper
            self.lm_head = model.lm_head
        # Nanbeige: the final norm also ends each loop but the last, unless skip_loop_final_norm
        blocks = len(self.layers) // getattr(self.inner, "num_loops", 1)
        self._loop_ends = frozenset(
            () if getattr(args, "skip_loop_final_norm", True) else
            range(blocks - 1, len(self.layers) - 1, blocks))
        # IQuest-Loop-Coder: the first-loop layer each second-loop layer also attends over
        first_loop = (len(self.inner.layers) if model_type == "iquestloopcoder"
                      else len(self.layers))
        self._loop_sources = [layer - first_loop if layer >= first_loop else None
                              for layer in range(len(self.layers))]
        self._layer_input = ((args.hidden_size_per_layer_input or 0)
                             if self._gemma4 or self._gemma3n else 0)
        self._hidden = int(config_value(args, "hidden_size"))
        # muse_spark: the dtype of each layer's attention input in mlx-lm's forward (read off
        # one token's graph through its blocks, never evaluated)
        self._input_dtypes = self._fused_input_dtypes() if self._fused else None
        if self._deepseek_v4:
            self._check_deepseek_v4(args)
        # Gemma 3n's AltUp: the width of a token's streams (all of them), its active stream
        self._streams = self._hidden * (args.altup_num_inputs if self._gemma3n else 1)
        self._active = args.altup_active_idx if self._gemma3n else 0
        self._softcap = (getattr(args, "final_logit_softcapping", None)
                         if gemma or model_type in ("gear", "muse_glimmer", "muse_spark") else
                         args.logits_soft_cap if model_type == "recurrent_gemma" else
                         15.0 if model_type == "nanochat" else None)  # mlx-lm's nanochat.softcap
        granite, minicpm = model_type in GRANITE_TYPES, model_type in ("minicpm", "minicpm3")
        # what the embeddings are multiplied by: mlx-lm's Gemma 3 multiplies by sqrt(hidden)
        # rounded to bfloat16, as Gemma's reference does; Gemma 1, 2 and 4 by sqrt(hidden), a
        # float
        self._embed_scale = (mx.array(args.hidden_size ** 0.5, mx.bfloat16) if self._gemma3 else
                             args.hidden_size ** 0.5 if gemma or model_type in ("gemma", "gear")
                             else args.hidden_size ** 0.5 if model_type == "recurrent_gemma"
                             and args.embeddings_scale_by_sqrt_dim else
                             args.hidden_size ** 0.5 if self._afmoe and args.mup_enabled else
                             args.embedding_multiplier if granite else
                             args.scale_emb if minicpm else
                             args.mup_embedding_multiplier or None
                             if model_type == "phi3small" else None)
        # MiniCPM's multipliers as Granite's, in mlx-lm's arithmetic
        self._residual_multiplier = (args.residual_multiplier if granite else
                                     args.scale_depth / args.num_hidden_layers ** 0.5
                                     if minicpm else None)
        self._logits_scaling = (args.logits_scaling if granite else
                                1 / args.logit_scale if model_type in ("cohere", "cohere2") else
                                args.hidden_size / args.dim_model_base
                                if minicpm and not args.tie_word_embeddings else
                                args.embedding_multiplier / args.lm_head_multiplier
                                if self._falcon_h1 and args.tie_word_embeddings else
                                1 / args.output_multiplier
                                if model_type in ("muse_glimmer", "muse_spark")
                                else args.mup_width_multiplier or None
                                if model_type == "phi3small" else None)
        # phi3small: the ids mlx-lm's head masks to -inf (those inside the vocabulary)
        masked = getattr(self.text, "_dummy_tokenizer_ids", None)
        self._masked_ids = (None if masked is None else
                            mx.array([i for i in masked.tolist() if i < self.vocab_size],
                                     mx.int32))

    def _fused_input_dtypes(self) -> List[mx.Dtype]:
        """Muse Spark: each block's attention input's dtype in mlx-lm's forward (bfloat16
        into the first, then that of the fused norm of the block below: its MLP's output's)."""
        h = mx.zeros((1, 1, self._hidden), mx.float32)
        x = self.layers[0].input_layernorm(h).astype(mx.bfloat16)
        dtypes = [x.dtype]
        for block, above in zip(self.layers, self.layers[1:]):
            h, x = block(h, attn_input=x, next_norm=above.input_layernorm)
            dtypes.append(x.dtype)
        return dtypes

    def sliding_window(self, layer: int) -> Optional[Window]:
        """The window of a sliding-window layer (a query at position p sees keys at
        positions p - window + 1 .. p, original positions) or a chunked one
        (:class:`~mlx_lazy.attention.Chunks`), None for a global layer and for families
        without either."""
        return self._windows[layer]

    def kv_layer(self, layer: int) -> int:
        """The layer whose keys and values ``layer`` attends over: itself, or for the upper
        layers of Gemma 4's E2B/E4B the last lower layer of its kind (sliding or global), for
        Hunyuan's cross-layer attention the first of its group of ``cla_share_factor``,
        whose cache it reads; :meth:`qkv` gives them no keys and values."""
        return self._kv_layers[layer]

    def loop_source(self, layer: int) -> Optional[int]:
        """The first-loop layer whose keys and values a second-loop layer of IQuest-Loop-Coder
        also attends over, globally, beside its own in a window (:meth:`mix_loops`); None for
        every other layer and family."""
        return self._loop_sources[layer]

    def mix_loops(self, layer: int, q: mx.array, first: mx.array, own: mx.array) -> mx.array:
        """A second-loop layer's attention output (1, H, n, head_dim): ``first`` (over the keys
        of :meth:`loop_source`) and ``own`` (over its own) mixed per head by the sigmoid gate
        of its queries ``q`` (RoPE applied), as mlx-lm's iquestloopcoder mixes them."""
        gate = self.inner.gate_projections[self._loop_sources[layer]](q)
        return gate * first + (1 - gate) * own

    def recurrent(self, layer: int) -> bool:
        """Whether ``layer`` is recurrent (:func:`recurrent_layers`): it runs through
        :meth:`recurrent_block`, not :meth:`qkv` and :meth:`finish`."""
        return layer in self._recurrent

    def attention_free(self, layer: int) -> bool:
        """Whether ``layer`` runs without :meth:`qkv` and :meth:`finish`: a recurrent or a
        stateless one (no queries: no cut can follow it)."""
        return layer in self._recurrent or layer in self._stateless

    def stateless(self, layer: int) -> bool:
        """Whether ``layer`` is one without attention that computes each token alone
        (:func:`stateless_layers`): it runs through :meth:`stateless_block`."""
        return layer in self._stateless

    def stateless_block(self, layer: int, h: mx.array) -> mx.array:
        """A layer of :func:`stateless_layers` on hidden states ``h`` (1, n, D): mlx-lm's own
        block (its norms, the no-op or linear map for attention, the MLP)."""
        return self.layers[layer](h)

    def _part(self, module: nn.Module, name: str) -> Optional[nn.Module]:
        """The part of ``module`` that Llama's layout names ``name`` (under the family's own
        name, :data:`_PART_NAMES`, a dotted path where it lies deeper); None where it has none."""
        for part in self._names.get(name, name).split("."):  # dbrx's norm_attn_norm.norm_1
            module = getattr(module, part, None)
        return module

    def sinks(self, layer: int) -> Optional[mx.array]:
        """The layer's attention sinks, one logit per head that each head's softmax also
        weighs (gpt-oss's ``sinks``, MiMo-V2-Flash's ``attention_sink_bias``); None for
        families and layers without them."""
        attn = self._attns[layer]
        return getattr(attn, "sinks", getattr(attn, "attention_sink_bias", None))

    def softcap(self, layer: int) -> Optional[float]:
        """The layer's attention logit soft-cap c (Gemma 2's ``attn_logit_softcapping``):
        each logit s becomes ``c tanh(s / c)`` before the mask and softmax; None for
        families without one."""
        return self._softcaps[layer]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def fingerprint(self) -> dict:
        """The model's architecture, shapes, exact weights (:meth:`weights_digest`: what a
        prompt cache must match), weights up to quantization and dtype (:meth:`identity`:
        what a calibrated schedule must match, see :func:`identities_match`) and the variant
        of its weights (:meth:`variant`, informative)."""
        args = text_args(self.text)
        return {
            "model_type": self.model.model_type,
            "num_layers": self.num_layers,
            "hidden_size": self._hidden,
            # all ranks' heads (OpenELM's, given per layer, summed)
            "num_attention_heads": _total(config_value(args, "num_attention_heads")),
            "num_key_value_heads": kv_heads(args),
            "vocab_size": int(config_value(args, "vocab_size")),
            "weights": self.weights_digest(),
            "identity": self.identity(),
            "variant": self.variant(),
        }

    def weights_digest(self) -> str:
        """A short digest of a few fixed tensors (the embedding's first rows, the last
        norm) as stored: tells apart models of the same shapes, e.g. Qwen2.5-Coder-0.5B from
        Qwen2.5-0.5B, and also a model from its own quantized or cast copy. Both tensors are
        whole on every rank of a sharded model."""
        digest = hashlib.sha256()
        norm = getattr(self._final_norm, "weight", None)  # nanochat's has none
        for array in (self._embedding.weight[:16], *([] if norm is None else [norm])):
            digest.update(np.array(array.astype(mx.float32)).tobytes())
        return digest.hexdigest()[:16]

    def identity(self) -> str:
        """The model's weights up to quantization and dtype: sketches of a few dequantized
        embedding rows and of every norm weight (:func:`identities_match` compares two).

        mlx-lm's quantization (``mlx_lm.convert -q``, ``nn.quantize``; GGUF Q4/Q8) rounds
        linear and embedding weights only: norms stay floating point, so a cast (at most
        2**-9 relative for bfloat16) is all that touches them, and they tell apart two
        trainings of one architecture; the embedding rows, read through the embedding
        (dequantized), tell apart models whose norms were never trained. Each part is a
        count sketch (:data:`SKETCH_SIZE` signed bucket sums, float16): distances between
        sketches estimate distances between the tensors. All of it is whole on every rank of
        a sharded model. 4-9 ms on Qwen2.5-Coder-0.5B (this 2-core CPU)."""
        return _encode_identity((self._embedding_rows(), self._norm_weights()))

    def _embedding_rows(self) -> np.ndarray:
        vocab = self.vocab_size
        # rows spread over the first 90% of the table: the tail of a padded vocabulary
        # (Qwen's) holds rows no token uses, left as initialised
        rows = np.unique(np.linspace(0, max(0, int(0.9 * vocab) - 1),
                                     IDENTITY_ROWS).round().astype(np.int32))
        out = self._embedding(mx.array(rows)).astype(mx.float32)
        return np.array(out).ravel()

    def _norm_weights(self) -> np.ndarray:
        found = sorted(((name, p) for name, p in tree_flatten(self.inner.parameters())
                        if p.ndim == 1 and ("norm" in name or re.search(r"(^|\.)ln[_.]", name))),
                       key=lambda item: item[0])  # EXAONE 3's are ln_1, ln_2, ln_f; Phixtral's ln
        if not found:
            return np.zeros(0, np.float32)
        return np.array(mx.concatenate([p.astype(mx.float32) for _, p in found]))

    def variant(self) -> str:
        """How the weights are stored: the float dtype of the unquantized parameters, then
        each quantization found (``+q4g64``: 4 bits, groups of 64; ``+mxfp4g32``), e.g.
        ``float32``, ``bfloat16+q4g64``, ``float32+q4g32+q8g32`` (SmolLM2's GGUF)."""
        weight = getattr(self._part(self.inner, "norm"), "weight", None)
        if weight is None:  # nanochat: no norm weights; its float parameters' dtype
            weight = next(p for _, p in tree_flatten(self.text.parameters())
                          if mx.issubdtype(p.dtype, mx.floating))
        dtype = str(weight.dtype).removeprefix("mlx.core.")
        return dtype + "".join(f"+{q}" for q in quantizations(self.text))

    @property
    def hidden_size(self) -> int:
        """Width of a token's hidden state (without Gemma 4 E2B/E4B's per-layer inputs; one
        of Gemma 3n's AltUp streams)."""
        return self._hidden

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding table: valid token ids are 0 to vocab_size - 1."""
        return self._embedding.weight.shape[0]

    @property
    def context_width(self) -> int:
        """How many earlier tokens' ids a token's embedding reads (LongCat-Flash-Ngram's
        ``emb_neighbor_num - 1``); 0 for the others."""
        return 0 if self._ngram is None else self._ngram.n - 1

    def embed(self, tokens: mx.array, positions: Optional[np.ndarray] = None,
              context: Optional[List[Optional[mx.array]]] = None) -> mx.array:
        """(n,) token ids at ``positions`` (n,) (None: 0 .. n - 1) -> (1, n, D) hidden states
        (with Gemma 4 E2B/E4B's per-layer inputs after them: D is hidden_size + layers x their
        width; Gemma 3n's: its AltUp streams, altup_num_inputs x hidden_size, then those
        inputs; Talkie's normed embeddings: twice hidden_size). Only a learned position
        embedding (GPT-2's) reads the positions; only an n-gram embedding
        (:attr:`context_width`) the ``context``, the ids (1, <= context_width) of the last
        tokens before these (mlx-lm's ``ArraysCache`` part, empty before the first; None:
        these start the sequence), which it advances in place.

        Raises:
            UserInputError: a position past those a learned position embedding holds.
        """
        if self._ngram is not None:
            cache = None
            if context is not None:
                context.extend([None] * (1 - len(context)))
                cache = ArraysCache(1)
                cache.cache = context
            return self._ngram(tokens[None], cache)
        h = self._embedding(tokens[None])
        if self._position_embedding is not None:
            table = self._position_embedding
            positions = np.arange(len(tokens)) if positions is None else positions
            if len(positions) and int(positions.max()) >= table.weight.shape[0]:
                raise UserInputError(
                    f"position {int(positions.max())} is past the model's "
                    f"{table.weight.shape[0]} learned positions; shorten the prompt or the "
                    "generation")
            h = h + table(mx.array(positions))
        if self._embed_norm is not None:  # nanochat, talkie, muse_glimmer: normed embeddings
            h = self._embed_norm(h)
        if self._embed_skip:  # talkie: and a copy of them, which every layer adds back
            return mx.concatenate([h, h], axis=-1)
        scale = self._embed_scale
        if scale is not None:
            h = h * (scale.astype(h.dtype) if isinstance(scale, mx.array) else scale)
        if self._deepseek_v4:
            return self._deepseek_v4_hidden(
                mx.broadcast_to(h[:, :, None], (*h.shape[:2], self._hc, self._hidden)))
        if not self._layer_input:
            return h
        inner = self.inner  # mlx-lm's own two steps, as its forward takes them (Gemma 3n's
        # named without the underscore)
        get = getattr(inner, "_get_per_layer_inputs", None) or inner.get_per_layer_inputs
        project = (getattr(inner, "_project_per_layer_inputs", None)
                   or inner.project_per_layer_inputs)
        inputs = project(h, get(tokens[None]))
        if self._gemma3n:  # AltUp's other streams: projections of the embeddings, rescaled
            h = mx.concatenate([h, *(_rescaled(p(h), h) for p in inner.altup_projections)], -1)
        return mx.concatenate([h, inputs.reshape(*h.shape[:2], -1).astype(h.dtype)], axis=-1)

    def logits(self, h: mx.array) -> mx.array:
        """Final norm and LM head on (1, n, D) hidden states."""
        if self._gemma3n:  # AltUp's streams merged: the others projected back, at the
            # active one's magnitude, and all averaged
            first, others = h[..., :self._hidden], h[..., self._hidden:]
            others = [_rescaled(p(others[..., i * self._hidden:(i + 1) * self._hidden]), first)
                      for i, p in enumerate(self.inner.altup_unembed_projections)]
            h = mx.mean(mx.stack([first, *others]), axis=0)
        if self._deepseek_v4:  # the streams collapsed by the last layer's weights
            from mlx_lm.models.deepseek_v41 import _collapse

            h = _collapse(*self._deepseek_v4_parts(h)[:2])
        if self._attn_res:  # kimi_k3: the blocks' inputs and the last sum mixed
            h = self._residual_mix(h, self.inner.output_attn_res_norm,
                                   self.inner.output_attn_res_proj)
        h = self._final_norm(h[..., :self._hidden] if self._embed_skip else h)
        if self._fused:  # muse_spark: rounded to bfloat16 before the head, as mlx-lm's
            h = h.astype(mx.bfloat16)
        if self._embed_skip:  # talkie: a bare matrix times a gain
            out = self.text.lm_head_gain(h @ self.text.lm_head.T)
        elif self.lm_head is None:
            out = self._embedding.as_linear(h)
        else:
            out = self.lm_head(h)
        if self._logits_scaling is not None:
            out = out / self._logits_scaling
        if self._softcap:  # Gemma 2 style final soft-capping, where a config has it
            out = mx.tanh(out / self._softcap) * self._softcap
        if self._masked_ids is not None:
            out[..., self._masked_ids] = -mx.inf
        return out

    def qkv(self, layer: int, h: mx.array, positions: np.ndarray) -> Tuple[mx.array, ...]:
        """Queries, keys and values of ``h`` (1, n, D) at ``positions`` (n,), RoPE applied,
        and the output gate of a gated attention (Qwen3.5's, AFM's; Step-3.5's and Laguna's, one
        per head) for :meth:`finish`, or in a layer with a lightning indexer its queries
        (:meth:`index_mask`; :meth:`finish` takes none there).

        Returns arrays shaped (1, heads, n, head_dim) (latent attention's values narrower than
        its keys: :meth:`_latent_qkv`); keys and values None where the layer reads another's
        (:meth:`kv_layer`); the gate (1, n, heads x head_dim; Laguna's (1, n, heads)) None but in
        a gated attention.
        """
        if self._fused:
            return self._fused_qkv(layer, h, positions)
        block, attn = self.layers[layer], self._attns[layer]
        n = h.shape[1]
        x = self._blas_rows(self._altup_predict(block, h)[self._active] if self._gemma3n else
                            self._residual_mix(h, block.self_attention_res_norm,
                                               block.self_attention_res_proj)
                            if self._attn_res else h[..., :self._hidden]
                            if self._layer_input or self._embed_skip or self._shortcut else h)
        if not self._post_norms:
            x = self._norm(block, "input_layernorm")(x)
        gate = None
        if self._mla:
            q, k, v, gate = self._latent_qkv(attn, x, n, positions)
            if self._query_scaling is not None:  # mistral4: every query scaled by position
                q = q * _query_scale(positions, *self._query_scaling).astype(q.dtype)
            if "g_proj" in attn:  # bailing_moe_v3: a gate per head (finish)
                gate = attn.g_proj(x)[:, :n]
            return q, k, v, gate
        # gemma4, openelm, mimo_v2_flash, step3p5 (num_*): by layer
        heads = getattr(attn, "n_heads", None) or getattr(attn, "num_heads", self.n_heads)
        kv_heads = getattr(attn, "n_kv_heads", None) or getattr(attn, "num_kv_heads",
                                                                self.n_kv_heads)
        fused = (getattr(attn, "qkv_proj", None) or getattr(attn, "query_key_value", None)
                 or getattr(attn, "c_attn", None) or getattr(attn, "Wqkv", None)
                 or getattr(attn, "q_k_v_proj", None))  # spark2_5's
        if fused is not None and self._qkv_by_head:  # gpt_neox: each head's q, k, v in turn
            q, k, v = mx.split(fused(x).reshape(1, x.shape[1], heads, -1), 3, axis=-1)
        elif fused is not None and "indices" in fused:  # afm7's FusedLinear: split as it splits
            q, k, v = fused(x)
        elif fused is not None and not self._qkv_grouped:  # phi3, bailing_moe, qwen, gpt2,
            # openelm, dbrx, phixtral: split
            qkv = fused(x)  # as mlx-lm does
            if getattr(attn, "clip_qkv", None):  # dbrx
                qkv = mx.clip(qkv, -attn.clip_qkv, attn.clip_qkv)
            head_dim = qkv.shape[-1] // (heads + 2 * kv_heads)
            q_end = heads * head_dim
            q, k, v = mx.split(qkv, [q_end, q_end + kv_heads * head_dim], axis=-1)
        elif "wqkv" in attn or self._qkv_grouped:  # internlm2, phi3small: each key/value
            # head's queries, key and value
            qkv = (fused or attn.wqkv)(x).reshape(*x.shape[:2], kv_heads, -1, attn.head_dim)
            q, k, v = (t.reshape(*x.shape[:2], -1) for t in
                       (qkv[..., :-2, :], qkv[..., -2, :], qkv[..., -1, :]))
        elif self.kv_layer(layer) != layer and (self._gemma4 or self._gemma3n):  # a lower
            # layer's keys and values
            q = attn.q_norm(attn.q_proj(x)[:, :n].reshape(1, n, self.n_heads, -1))
            return _rope(attn.rope, q.transpose(0, 2, 1, 3), positions), None, None, None
        elif self.kv_layer(layer) != layer:  # hunyuan's CLA: those of the layer below (afm7's
            # KV reuse: of the last layer before them)
            q = attn.q_proj(x)[:, :n].reshape(1, n, self.n_heads, -1).transpose(0, 2, 1, 3)
            q = _rope(attn.rope, q, positions)
            ratio = self._key_ratios.get(layer)
            if ratio is not None:
                q = attn.query_layernorm(q) * ratio.astype(q.dtype)
            elif "q_norm" in attn:  # afm7: after RoPE
                q = attn.q_norm(q)
            return q, None, None, None
        elif self._gated:  # each head's queries, then its gate, as mlx-lm splits them
            q, gate = mx.split(attn.q_proj(x).reshape(1, x.shape[1], self.n_heads, -1), 2, -1)
            q, gate = q.reshape(1, x.shape[1], -1), gate.reshape(1, x.shape[1], -1)[:, :n]
            k, v = attn.k_proj(x), attn.v_proj(x)
        else:
            q, k = self._part(attn, "q_proj")(x), self._part(attn, "k_proj")(x)
            v_proj = self._part(attn, "v_proj")
            v = k if v_proj is None else v_proj(x)  # gemma4's k_eq_v layers
            if "gate_proj" in attn:  # afmoe: an output gate from the attention's input
                gate = attn.gate_proj(x)[:, :n]
        if "g_proj" in attn:  # step3p5, laguna, spark2_5: one per head, from the attention's input
            gate = attn.g_proj(x)[:, :n]
        if q.shape[1] > n:
            q, k, v = q[:, :n], k[:, :n], v[:, :n]
        q_norm, k_norm = self._head_norms(attn)
        if getattr(q_norm, "weight", None) is not None and q_norm.weight.shape[-1] == q.shape[-1]:
            q, k = q_norm(q), k_norm(k)  # olmo: over all heads
            q_norm = None
        q = q.reshape(1, n, heads, -1)
        if self._head_order is not None:
            q = q[:, :, self._head_order]
        k = k.reshape(1, n, kv_heads, -1)
        v = v.reshape(1, n, kv_heads, -1)
        if q_norm is not None and not self._norms_after_rope:
            q, k = q_norm(q), k_norm(k)
        if hasattr(attn, "v_norm"):  # gemma4
            v = attn.v_norm(v)
        if getattr(attn, "value_scale", None) is not None:  # mimo_v2_flash
            v = v * attn.value_scale
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        # none in EXAONE 4's global layers; Command R7B's global layers skip theirs
        rope = self._part(attn, "rope") if getattr(attn, "use_sliding_window", True) else None
        if hasattr(attn, "_rope_freqs"):  # nanochat's: a function of the layer's frequencies
            rope = partial(nanochat.apply_rotary_emb, freqs=attn._rope_freqs)
        if rope is not None:
            q, k = _rope(rope, q, positions), _rope(rope, k, positions)
        if q_norm is not None and self._norms_after_rope:
            q, k = q_norm(q), k_norm(k)
        if "quant_key_scale" in attn:  # afm7: keys and values rounded to 8-bit steps
            k, v = (afm7.fake_8bit_quant(k, attn.quant_key_scale),
                    afm7.fake_8bit_quant(v, attn.quant_value_scale))
        if "head_gain" in attn:  # talkie: a gain per query head, after its norm
            q = attn.head_gain(q)
        if hasattr(attn, "scaling_beta"):  # ministral3
            q = q * _query_scale(positions, attn.scaling_beta,
                                 attn.original_max_position_embeddings).astype(q.dtype)
        if getattr(attn, "attn_temperature_tuning", 0) and not attn.use_rope:  # llama4 NoPE
            q = q * _query_scale(positions + 1, attn.attn_scale, attn.floor_scale).astype(q.dtype)
        if self._query_ratios[layer] is not None:
            q = q * self._query_ratios[layer]
        if self._block_indexed[layer]:  # minimax_m3_vl: the indexer's key after each key
            gate, index_keys = self._block_indexer(attn, x, n, positions)
            q = mx.pad(q, [(0, 0), (0, 0), (0, 0), (0, index_keys.shape[-1])])
            k = mx.concatenate([k, mx.broadcast_to(index_keys, (*k.shape[:3],
                                                                index_keys.shape[-1]))], axis=-1)
        return q, k, v, gate

    def _fused_qkv(self, layer: int, h: mx.array, positions: np.ndarray
                   ) -> Tuple[mx.array, mx.array, mx.array, mx.array]:
        """Muse Spark's :meth:`qkv`: its attention input as mlx-lm's forward makes it, then its
        fused q/k norms (and RoPE) with each token a batch row of its own, at its position."""
        block, attn = self.layers[layer], self._attns[layer]
        n, norm, stream = h.shape[1], block.input_layernorm, h.astype(mx.float32)
        x = (norm(stream).astype(mx.bfloat16) if layer == 0 else
             muse_spark.pre_norm(stream, norm, dtype=self._input_dtypes[layer]))
        qkvg = attn.qkvg_proj(x).reshape(n, 1, -1)
        sizes = {"n_heads": attn.n_heads, "n_kv_heads": attn.n_kv_heads,
                 "head_dim": attn.head_dim, "eps": attn.eps, "query_scale": attn.query_scale}
        if attn.use_rope:
            q, k = muse_spark.qk_norm_rope(qkvg, **sizes, rope_base=attn.rope.base,
                                           offset=mx.array(positions.astype(np.int32)))
        else:
            q, k = muse_spark.qk_norm(qkvg, **sizes)
        q_end, kv_width = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
        v = qkvg[..., q_end + kv_width:q_end + 2 * kv_width]
        gate = qkvg[..., q_end + 2 * kv_width:].reshape(1, n, -1)
        q, k, v = (t.reshape(1, n, -1, attn.head_dim).transpose(0, 2, 1, 3) for t in (q, k, v))
        return q, k, v, gate

    def _fused_finish(self, block: nn.Module, h: mx.array, attn_out: mx.array,
                      gate: mx.array) -> mx.array:
        """Muse Spark's :meth:`finish`, as its block: the output norm and gate per head, the
        fixed-gated residuals (the MLP's branch under its norm), the MoE as its module."""
        attn = block.self_attn
        out = muse_spark.rms_norm_sigmoid_gate(attn_out, gate, eps=attn.eps)
        h, x = muse_spark.norm_add_norm(
            attn.o_proj(out), h.astype(mx.float32), alpha=block.add_attn_alpha,
            beta=block.add_attn_beta, post_weight=None, post_eps=block.post_norm_eps,
            next_norm=block.pre_feedforward_layernorm)
        post = block.post_feedforward_layernorm
        return muse_spark.norm_add_norm(block.mlp(x), h, alpha=block.add_ffn_alpha,
                                        beta=block.add_ffn_beta, post_weight=post.weight,
                                        post_eps=post.eps, next_norm=None)[0]

    def _head_norms(self, attn: nn.Module) -> Tuple[Optional[Any], Optional[Any]]:
        """The q/k norms of ``attn``: mlx-lm's modules (per head, or OLMo's over all heads),
        or a weight-free RMS norm (nanochat's in every layer, Llama 4's where ``use_qk_norm``);
        (None, None) without. They act before RoPE, or after it in :data:`_NORMS_AFTER_ROPE`."""
        q_norm = self._part(attn, "q_norm")
        if q_norm is not None:
            return q_norm, self._part(attn, "k_norm")
        if "q_weight" in attn:  # plamo2: weight-free, then times a weight per head
            return (partial(_scaled_rms_norm, weight=attn.q_weight),
                    partial(_scaled_rms_norm, weight=attn.k_weight))
        if hasattr(attn, "qk_scale_factor"):  # muse_glimmer: weight-free, queries then scaled
            return (partial(_scaled_rms_norm, weight=attn.qk_scale_factor, eps=attn.eps),
                    partial(mx.fast.rms_norm, weight=None, eps=attn.eps))
        if self._weightless is not None:
            return self._weightless, self._weightless
        if self._l2_eps is not None and attn.use_qk_norm:
            norm = partial(mx.fast.rms_norm, weight=None, eps=self._l2_eps)
            return norm, norm
        return None, None

    def _norm(self, block: nn.Module, name: str) -> Any:
        """The layer's norm that Llama's layout names ``name`` (:meth:`_part`; nanochat's
        weight-free function)."""
        return self._weightless or self._part(block, name)

    def _key_norm_ratio(self, layer: int) -> Optional[mx.array]:
        """Hunyuan's CLA: a layer's keys are the lower layer's raw keys through its OWN key
        norm, i.e. the lower layer's cached keys times (its weight / theirs); weighed into its
        queries, its scores over the cached keys are its own. None without q/k norms."""
        norm = getattr(self.layers[layer].self_attn, "key_layernorm", None)
        if norm is None:
            return None
        below = self.layers[self._kv_layers[layer]].self_attn.key_layernorm.weight
        if not mx.all(below != 0).item():
            raise UserInputError(f"layer {layer} shares keys with a layer whose key norm has a "
                                 "zero weight; mlx-lazy cannot run this hunyuan checkpoint")
        return norm.weight.astype(mx.float32) / below.astype(mx.float32)

    def _latent_qkv(self, attn: nn.Module, x: mx.array, n: int, positions: np.ndarray
                    ) -> Tuple[mx.array, mx.array, mx.array, Optional[mx.array]]:
        """:meth:`qkv` of multi-head latent attention (:data:`MLA_TYPES`) on normed ``x``
        (1, >= n, D): each head's query is [q_nope, rope(q_pe)], and every key shares one
        latent (``kv_a_layernorm`` of part of ``kv_a_proj_with_mqa``) and one rope(k_pe).

        deepseek_v2, minicpm3 and youtu_llm expand the latent per head (``kv_b_proj``) into
        [k_nope, rope(k_pe)] keys and values, as mlx-lm does. The absorbed form (deepseek_v3,
        glm4_moe_lite) keeps it: queries [embed_q(q_nope), rope(q_pe)] over ONE key head [latent,
        rope(k_pe)], ONE value head the latent (:meth:`finish` applies ``unembed_out``), so
        a score is mlx-lm's ``scale (embed_q(q_nope) . latent + q_pe . k_pe)`` and the cache
        holds the latent, not per-head keys.

        With a lightning indexer (deepseek_v32, glm_moe_dsa) each key also holds, after
        [latent, rope(k_pe)], the token's indexer key, and each query as many zeros (its
        scores unchanged); the fourth array is the indexer's queries (:meth:`_indexer`), else
        None."""
        heads = self.n_heads
        qr = (None if getattr(attn, "q_lora_rank", None) is None  # kimi_linear: one step
              else attn.q_a_layernorm(attn.q_a_proj(x)))
        q = attn.q_proj(x) if qr is None else attn.q_b_proj(qr)
        q = q[:, :n].reshape(1, n, heads, -1).transpose(0, 2, 1, 3)
        # longcat_flash: queries and the normed latent scaled (sqrt(hidden / rank))
        q = q * getattr(attn, "mla_scale_q_lora", 1.0)
        q_nope, q_pe = mx.split(q, [attn.qk_nope_head_dim], axis=-1)
        latent, k_pe = mx.split(attn.kv_a_proj_with_mqa(x)[:, :n], [attn.kv_lora_rank], axis=-1)
        latent = attn.kv_a_layernorm(latent) * getattr(attn, "mla_scale_kv_lora", 1.0)
        k_pe = k_pe[:, None]  # (1, 1, n, rope dims)
        if "rope" in attn:  # (none in kimi_linear's)
            q_pe, k_pe = _rope(attn.rope, q_pe, positions), _rope(attn.rope, k_pe, positions)
        if hasattr(attn, "kv_b_proj"):  # deepseek_v2, minicpm3, youtu_llm
            kv = attn.kv_b_proj(latent).reshape(1, n, heads, -1).transpose(0, 2, 1, 3)
            k_nope, v = mx.split(kv, [attn.qk_nope_head_dim], axis=-1)
            k_pe = mx.broadcast_to(k_pe, (1, heads, n, k_pe.shape[-1]))
            return (mx.concatenate([q_nope, q_pe], axis=-1),
                    mx.concatenate([k_nope, k_pe], axis=-1), v, None)
        latent = latent[:, None]
        q, k = mx.concatenate([attn.embed_q(q_nope), q_pe], axis=-1), [latent, k_pe]
        index = None
        if "indexer" in attn:
            index, index_keys = self._indexer(attn.indexer, x, qr, n, positions)
            q = mx.pad(q, [(0, 0), (0, 0), (0, 0), (0, index_keys.shape[-1])])
            k.append(index_keys)
        return q, mx.concatenate(k, axis=-1), latent, index

    @staticmethod
    def _indexer(indexer: nn.Module, x: mx.array, qr: mx.array, n: int,
                 positions: np.ndarray) -> Tuple[mx.array, mx.array]:
        """DeepSeek-V3.2's lightning indexer on normed ``x`` (1, >= n, D) and the normed
        low-rank queries ``qr``, as mlx-lm's ``Indexer`` computes them: its queries, each head's
        (index_head_dim,) query then its weight, (1, n, heads, index_head_dim + 1), and its
        keys (1, 1, n, index_head_dim), one per token, RoPE applied to both."""
        q = indexer.wq_b(qr)[:, :n].reshape(1, n, indexer.n_heads, indexer.head_dim)
        k = indexer.k_norm(indexer.wk(x)[:, :n])[:, None]
        q = _rope(indexer.rope, q.swapaxes(1, 2), positions).swapaxes(1, 2)
        weights = indexer.weights_proj(x)[:, :n] * (indexer.n_heads ** -0.5
                                                    * indexer.softmax_scale)
        return (mx.concatenate([q, weights[..., None].astype(q.dtype)], axis=-1),
                _rope(indexer.rope, k, positions))

    @staticmethod
    def _block_indexer(attn: nn.Module, x: mx.array, n: int, positions: np.ndarray
                       ) -> Tuple[mx.array, mx.array]:
        """MiniMax-M3's block indexer on normed ``x`` (1, >= n, D), as mlx-lm's ``Attention``
        computes it: its queries (1, n, index heads, index_head_dim) and its keys (1, 1, n,
        index_head_dim), one per token, normed, RoPE applied to both."""
        x = x[:, :n]
        q = attn.index_q_norm(attn.index_q_proj(x).reshape(1, n, attn.index_n_heads, -1))
        k = attn.index_k_norm(attn.index_k_proj(x).reshape(1, n, 1, -1))
        q = _rope(attn.index_rope, q.swapaxes(1, 2), positions).swapaxes(1, 2)
        return q, _rope(attn.index_rope, k.swapaxes(1, 2), positions)

    def index_topk(self, layer: int) -> Optional[int]:
        """How many keys each query of ``layer`` sees at most, those its indexer scores
        highest (DeepSeek-V3.2's lightning indexer's ``index_topk``; MiniMax-M3's
        ``index_topk_blocks`` blocks of ``index_block_size``); None for a layer without one."""
        return self._index_topks[layer]

    def index_mask(self, layer: int, index: mx.array, keys: mx.array, mask: mx.array,
                   rows: np.ndarray, kpos: np.ndarray) -> mx.array:
        """``mask`` (m, S), which of the layer's cached ``keys`` (1, kv_heads, S, d) at
        positions ``kpos`` each of m queries at positions ``rows`` sees, narrowed to the
        :meth:`index_topk` keys its indexer scores highest among them (all of them where a
        query sees no more), for the queries' ``index`` from :meth:`qkv`; MiniMax-M3's per
        query head, (heads, m, S).

        DeepSeek-V3.2's lightning indexer (``index`` (1, m, heads, index_head_dim + 1)): mlx-lm's
        ``Indexer`` scores, the sum over heads of each head's weight times its ReLU'd query .
        key, over the indexer keys at the end of ``keys``. MiniMax-M3's: :meth:`_block_mask`."""
        if self._block_indexed[layer]:
            return self._block_mask(self._attns[layer], index, keys, mask, rows, kpos)
        topk = self.index_topk(layer)
        if keys.shape[2] <= topk:
            return mask
        q, weights = index[..., :-1].swapaxes(1, 2), index[..., -1:].swapaxes(1, 2)
        scores = mx.maximum(q @ keys[..., -q.shape[-1]:].swapaxes(-1, -2), 0) * weights
        # summed over heads as mlx-lm sums them (one by one for several rows)
        scores = (scores.sum(axis=1, keepdims=True) if scores.shape[2] == 1
                  else sum(scores[:, h:h + 1] for h in range(scores.shape[1])))
        scores = mx.where(mask, scores, -mx.inf)
        top = mx.argpartition(scores, kth=-topk, axis=-1)[..., -topk:]
        chosen = mx.put_along_axis(mx.zeros(scores.shape, mx.bool_), top, mx.array(True), -1)
        return chosen[0, 0] & mask

    @staticmethod
    def _block_mask(attn: nn.Module, index: mx.array, keys: mx.array, mask: mx.array,
                    rows: np.ndarray, kpos: np.ndarray) -> mx.array:
        """:meth:`index_mask` of MiniMax-M3's block indexer, as mlx-lm's ``_block_mask``
        chooses: each index head's scores (query . key, float32) over the keys ``mask`` shows,
        a block's score the highest of its keys' (blocks of ``index_block_size`` ORIGINAL
        positions: a pruned or unseen token is absent from its block, whose score it leaves),
        each query's ``index_local_blocks`` last blocks (its own one on) always kept, then the
        ``index_topk_blocks`` best. Returns (heads, m, S): each index head's choice for the
        query heads of its group."""
        size, topk = attn.index_block_size, attn.index_topk_blocks
        n_blocks = int(rows[-1]) // size + 1
        if n_blocks <= topk:  # every block fits the budget
            return mask
        q = index.swapaxes(1, 2).astype(mx.float32)  # (1, index heads, m, index_head_dim)
        scores = q @ keys[:, :1, :, -q.shape[-1]:].astype(mx.float32).swapaxes(-1, -2)
        scores = mx.where(mask, scores, -mx.inf)
        # the scores by position (a key past the last block, never seen, left out), -inf where
        # no key is cached: one column appended
        inside = np.flatnonzero(kpos < n_blocks * size)
        slot = np.full(n_blocks * size, len(kpos), np.int32)
        slot[kpos[inside]] = inside
        scores = mx.concatenate([scores, mx.full((*scores.shape[:-1], 1), -mx.inf)], axis=-1)
        blocks = scores[..., mx.array(slot)].reshape(*scores.shape[:-1], n_blocks, size)
        blocks = blocks.max(axis=-1)
        own = mx.array(rows // size)[:, None]
        ids = mx.arange(n_blocks)
        blocks = mx.where((ids <= own) & (ids > own - attn.index_local_blocks), mx.inf, blocks)
        top = mx.argpartition(-blocks, kth=topk - 1, axis=-1)[..., :topk]
        chosen = mx.put_along_axis(mx.zeros(blocks.shape, mx.bool_), top, mx.array(True), -1)
        chosen = chosen[0][..., mx.array(np.minimum(kpos // size, n_blocks - 1))] & mask
        return mx.repeat(chosen, attn.num_attention_heads // attn.index_n_heads, axis=0)

    def finish(self, layer: int, h: mx.array, attn_out: mx.array,
               gate: Optional[mx.array] = None) -> mx.array:
        """Output projection, residual and MLP: attention output (1, H, n, d), times the
        sigmoid of :meth:`qkv`'s ``gate`` where it gave one (Step-3.5's one per head; Laguna's:
        the softplus of a gain per head), -> new h."""
        block, attn = self.layers[layer], self._attns[layer]
        if self._fused:
            return self._fused_finish(block, h, attn_out, gate)
        n = attn_out.shape[2]
        if "indexer" in attn or self._block_indexed[layer]:  # what qkv gave: the indexer's
            gate = None  # queries, no gate
        if hasattr(attn, "unembed_out"):  # absorbed latent attention: the latent
            attn_out = attn.unembed_out(attn_out)  # output to each head's values
        if self._head_return is not None:
            attn_out = attn_out[:, self._head_return]
        out = attn_out.transpose(0, 2, 1, 3).reshape(1, n, -1)
        if "attn_sub_norm" in attn:  # bitnet
            out = attn.attn_sub_norm(out)
        if gate is not None and "g_proj" in attn:  # one gain per head: Laguna's softplus of it
            # (in float32, as mlx-lm's), Step-3.5's sigmoid
            gain = (nn.softplus(gate.astype(mx.float32)).astype(out.dtype) if self._softplus_gate
                    else mx.sigmoid(gate))
            out = (out.reshape(1, n, gain.shape[-1], -1) * gain[..., None]).reshape(1, n, -1)
        elif gate is not None:
            out = out * mx.sigmoid(gate)
        r = self._part(attn, "o_proj")(self._blas_rows(out))
        if self._attn_res:
            return self._residual_finish(layer, h[:, :n], r[:, :n])
        if self._layer_input:  # gemma4 E2B/E4B: this layer's input, then the later layers'
            width = self._layer_input  # (after Gemma 3n's streams)
            h, given, later = (h[..., :self._streams], h[..., self._streams:self._streams + width],
                               h[..., self._streams + width:])
        h = self._blas_rows(h)
        shortcut = None
        if self._shortcut and layer % 2:  # longcat_flash: the first sublayer's MoE output
            h, shortcut = h[..., :self._hidden], h[..., self._hidden:]
        if self._gemma2 or self._gemma3 or self._four_norms:  # norms after attention, around
            from mlx_lm.models.gemma3_text import clip_residual  # the MLP

            add = clip_residual if self._gemma3 else operator.add  # Gemma 3's float16-safe
            h = add(h, self._part(block, "post_attention_layernorm")(r))
            h = add(h, self._part(block, "post_feedforward_layernorm")(
                self._mlp(layer, self._part(block, "pre_feedforward_layernorm")(h))))
        elif self._gemma3n:
            return mx.concatenate([self._altup_finish(layer, h, r, given, n), later], axis=-1)
        elif self._gemma4:
            h = h + block.post_attention_layernorm(r)
            x = self._mlp(layer, block.pre_feedforward_layernorm(h))
            if block.enable_moe:  # experts beside the dense MLP, each with its own norms
                experts = block.experts(block.pre_feedforward_layernorm_2(h), *block.router(h))
                x = (block.post_feedforward_layernorm_1(x)
                     + block.post_feedforward_layernorm_2(experts))
            h = h + block.post_feedforward_layernorm(x)
            if self._layer_input:
                gate = nn.gelu_approx(block.per_layer_input_gate(h)[:, :n]) * given
                h = h[:, :n] + block.post_per_layer_input_norm(block.per_layer_projection(gate))
                return mx.concatenate([h * block.layer_scalar, later], axis=-1)
            h = h * block.layer_scalar
        elif self._post_norms:
            h = h + block.post_attention_layernorm(r)
            h = h + block.post_feedforward_layernorm(self._mlp(layer, h))
        elif self._embed_skip:  # talkie: gains on each branch, the normed embeddings added back
            x, embedded = h[..., :self._hidden], h[..., self._hidden:]
            x = x + block.attn_gain(r)
            x = x + block.mlp_gain(self._mlp(layer, self._weightless(x)))
            h = mx.concatenate([x + block.embed_skip(embedded), embedded], axis=-1)
        elif self._sandwich:  # glm4
            h = h + block.post_self_attn_layernorm(r)
            h = h + block.post_mlp_layernorm(self._mlp(layer, block.post_attention_layernorm(h)))
        elif self._parallel:  # attention and the MLP both on the input (one norm, or two)
            h = r + self._mlp(layer, self._part(block, self._parallel_norm)(h)) + h
        elif self._residual_multiplier is not None:  # granite
            h = h + r * self._residual_multiplier
            h = h + self._mlp(layer, block.post_attention_layernorm(h)) * self._residual_multiplier
        elif self._shortcut:  # longcat_flash: its MoE beside the first MLP, added after the second
            h = h + r
            x = block.post_attention_layernorm(h)
            h = h + self._mlp(layer, x)
            h = (mx.concatenate([h, block.shortcut(x)], axis=-1) if shortcut is None
                 else h + shortcut)
        else:
            h = h + r
            if self._feed_forwards[layer] is not None:  # (none after Nemotron-H's attention)
                h = h + self._mlp(layer, h if self._mlp_normed
                                  else self._norm(block, "post_attention_layernorm")(h))
        h = h[:, :n] if h.shape[1] > n else h
        return self._final_norm(h) if layer in self._loop_ends else h

    def recurrent_block(self, layer: int, h: mx.array, state: List[Optional[mx.array]],
                        positions: np.ndarray) -> mx.array:
        """A recurrent layer on hidden states ``h`` (1, n, D) of tokens that follow, in
        order, every token its ``state`` has taken (mlx-lm's ``ArraysCache`` parts: Qwen3.5's
        ``[conv_state, recurrent_state]``, Mamba's (Jamba's) and Mamba-2's ``[conv_state,
        ssm_state]``, LFM2's ``[conv_state]``, Falcon-H1's ``[conv_state, ssm_state, keys,
        values]``, lightning attention's ``[state]``; empty before the first) at ``positions``
        (n,) (Falcon-H1's attention and lightning attention turn queries and keys by them):
        ``state`` advances over them in place; returns their hidden states after the layer,
        MLP included (each branch times Granite's residual multiplier)."""
        block, n = self.layers[layer], h.shape[1]
        mixer, norm = self._part(block, "linear_attn"), self._part(block, "input_layernorm")
        if not state:  # mlx-lm's make_cache: ArraysCache(1) for a convolution, 4 for KDA (a
            # convolution of q, k and v each, the delta rule's) and Falcon-H1 (its keys and
            # values too), 5 for Baichuan-M1 (:meth:`_conv_kv_block`), else 2
            state.extend([None] * (1 if "conv" in block or self._lightning else 5 if self._conv_kv
                                   else 4 if self._kda or self._falcon_h1 else 2))
        cache = ArraysCache(len(state))
        cache.cache = state
        if self._falcon_h1:
            return self._falcon_h1_block(layer, h, cache, positions)
        if self._conv_kv:
            return self._conv_kv_block(layer, h, cache, positions)
        if self._deepseek_v4:
            return self._deepseek_v4_block(layer, h, state, positions)
        if self._whole_block:  # mlx-lm's block, its norms and MLP included
            return block(h, mask=None, cache=cache)
        if self._attn_res:  # kimi_k3
            x = self._residual_mix(h, block.self_attention_res_norm, block.self_attention_res_proj)
            return self._residual_finish(layer, h, mixer(norm(x), None, cache)[:, :n])
        x = (self._lightning_attention(mixer, norm(h), cache, positions) if self._lightning
             else mixer(norm(h), None, cache) if self._mixer_mask else mixer(norm(h), cache))
        h = self._blas_rows(h + self._branch(x))
        if self._feed_forwards[layer] is None:  # nemotron_h: the mixer alone
            return h[:, :n]
        mlp = self._mlp(layer, self._part(block, "post_attention_layernorm")(h))
        return (h + self._branch(mlp))[:, :n]

    def _lightning_attention(self, attn: nn.Module, x: mx.array, cache: ArraysCache,
                             positions: np.ndarray) -> mx.array:
        """bailing_moe_linear's and bailing_hybrid's linear attention on normed ``x`` (1, n, D)
        at ``positions``, its state (one per head) in ``cache[0]``: mlx-lm's module but for
        RoPE, which it turns from one offset and which turns here each token at its own
        position (a cut's gaps), as attention does."""
        n, heads = x.shape[1], attn.num_attention_heads
        qkv = attn.query_key_value(x).reshape(1, n, -1, attn.head_dim).transpose(0, 2, 1, 3)
        q, k, v = mx.split(qkv, [heads, heads + attn.num_key_value_heads], axis=1)
        if attn.use_qk_norm:
            q, k = attn.query_layernorm(q), attn.key_layernorm(k)
        q, k = _rope(attn.rope, q, positions), _rope(attn.rope, k, positions)
        recurrence = sys.modules[type(attn).__module__].recurrent_gla  # (the module's own)
        out, cache[0] = recurrence(q, k, v, attn._slope, scale=attn.scale, h=cache[0])
        out = attn.g_norm(out.transpose(0, 2, 1, 3).reshape(1, n, -1))
        return attn.dense(out * mx.sigmoid(attn.g_proj(x)))

    def _falcon_h1_block(self, layer: int, h: mx.array, cache: ArraysCache,
                         positions: np.ndarray) -> mx.array:
        """Falcon-H1's layer on ``h`` (1, n, D) at ``positions``, the tokens that follow those
        ``cache`` has taken: the Mamba-2 mixer (its state in ``cache[0]``, ``cache[1]``) and
        attention over the keys and values of every token taken before (``cache[2]``,
        ``cache[3]``, RoPE at each token's own position, which a token dropped below the
        layer leaves a gap in) and its own, side by side on one normed input, then the MLP
        (:meth:`finish`)."""
        block = self.layers[layer]
        mixed = block.mamba(self._norm(block, "input_layernorm")(h), cache=cache)
        q, k, v, _ = self.qkv(layer, h, positions)
        if cache[2] is not None:
            k, v = mx.concatenate([cache[2], k], axis=2), mx.concatenate([cache[3], v], axis=2)
        cache[2], cache[3] = k, v
        out = attention(q, k, v, self.scale, "causal" if h.shape[1] > 1 else None)
        return self.finish(layer, h + mixed, out)

    def _conv_kv_block(self, layer: int, h: mx.array, cache: ArraysCache,
                       positions: np.ndarray) -> mx.array:
        """Baichuan-M1's layer on ``h`` (1, n, D) at ``positions``, the tokens that follow those
        ``cache`` has taken: each key and value mixed with the raw one of the token before it
        (mlx-lm's convolution; ``cache[0]``, ``cache[1]``: the last raw key and value taken),
        keys turned at their own positions, attention over the keys and values of every token
        taken before (``cache[2]``, ``cache[3]``, at positions ``cache[4]``; a sliding-window
        layer's within its window) and their own, then the MLP (:meth:`finish`)."""
        attn, n = self._attns[layer], h.shape[1]
        x = self._norm(self.layers[layer], "input_layernorm")(h)
        kv_width = attn.num_kv_heads * attn.head_dim
        q, k, v = (t.reshape(1, n, -1, attn.head_dim).transpose(0, 2, 1, 3) for t in mx.split(
            attn.W_pack(x), [self._hidden, self._hidden + kv_width], axis=-1))
        mixed_k = attn._custom_convolution(k, attn.conv_k, state=cache[0])
        mixed_v = attn._custom_convolution(v, attn.conv_v, state=cache[1])
        cache[0], cache[1] = k[:, :, -1:], v[:, :, -1:]
        q, k = _rope(attn.rope, q, positions), _rope(attn.rope, mixed_k, positions)
        at = mx.array(positions.astype(np.int32))[None]  # (1, n), as every part: batch first
        keys = at if cache[4] is None else mx.concatenate([cache[4], at], axis=1)
        if cache[2] is not None:
            k, mixed_v = (mx.concatenate([cache[2], k], axis=2),
                          mx.concatenate([cache[3], mixed_v], axis=2))
        cache[2], cache[3], cache[4] = k, mixed_v, keys
        at = at.T
        mask = keys <= at
        window = self._windows[layer]
        if window is not None:
            mask = mask & (keys > at - window)
        return self.finish(layer, h, attention(q, k, mixed_v, attn.scale, mask))

    def _check_deepseek_v4(self, args: Any) -> None:
        """Keep DeepSeek-V4's widths; refuse candidate blocks (a layer's choice of key blocks
        that a later indexer keeps to: their width grows with the context, so no token's
        hidden state can hand them on)."""
        from mlx_lm.models.deepseek_v41 import _shared_reads

        if any("candidates" in _shared_reads(args, layer) for layer in range(len(self.layers))):
            raise UserInputError(
                f"this deepseek_v41 model's indexers keep to candidate key blocks (layer "
                f"{args.candidate_source_layer_id} chooses them), which mlx-lazy does not run")
        self._hc = args.hc_mult
        # a token's hidden state: its streams, their collapse weights (the last layer's), the
        # compressed key and index key of a group the last source closed in this step (the
        # step's new ones in its first tokens' rows) and the last indexer's picks (-1 after
        # them)
        self._v4_widths = [self._hc * self._hidden, self._hc, args.head_dim,
                           args.index_head_dim, args.index_topk]
        self._v4_dtype = self._embedding(mx.array([0])).dtype  # the streams'
        # the width and dtype of each part of a layer's state (its compressor's in float32)
        self._v4_state = [(args.head_dim, self._v4_dtype), (args.head_dim, self._v4_dtype),
                          (args.index_head_dim, self._v4_dtype), (args.head_dim, mx.float32),
                          (args.head_dim, mx.float32)]

    def _deepseek_v4_hidden(self, streams: mx.array, *parts: mx.array) -> mx.array:
        """A DeepSeek-V4 token's hidden state (float32, which holds each part exactly) from its
        streams (1, n, hc, D) and the parts after them (none: those the embedding starts)."""
        n = streams.shape[1]
        if not parts:
            first = mx.arange(self._hc) == 0  # mlx-lm's first collapse: the first stream
            parts = (mx.broadcast_to(first.astype(mx.float32), (1, n, self._hc)),
                     *(mx.zeros((1, n, w)) for w in self._v4_widths[2:4]),
                     mx.full((1, n, self._v4_widths[4]), -1.0))
        return mx.concatenate([streams.reshape(1, n, -1).astype(mx.float32),
                               *(p.astype(mx.float32) for p in parts)], axis=-1)

    def _deepseek_v4_parts(self, h: mx.array) -> List[mx.array]:
        """:meth:`_deepseek_v4_hidden`'s parts: the streams (1, n, hc, D) in their dtype, the
        collapse weights, the compressed key and index key rows, the picks (int32)."""
        bounds = np.cumsum(self._v4_widths)[:-1].tolist()
        streams, pre_mix, kv, index_k, topk = mx.split(h, bounds, axis=-1)
        return [streams.reshape(*h.shape[:2], self._hc, -1).astype(self._v4_dtype), pre_mix,
                kv.astype(self._v4_dtype), index_k.astype(self._v4_dtype),
                topk.astype(mx.int32)]

    def _deepseek_v4_block(self, layer: int, h: mx.array, state: List[Optional[mx.array]],
                           positions: np.ndarray) -> mx.array:
        """DeepSeek-V4's layer as mlx-lm's block: ``state`` holds its ``LayerCache`` (window,
        compressed keys, index keys, the open group's rows and gates; empty ones 0 rows wide);
        what mlx-lm's forward shares from earlier layers comes in ``h``
        (:meth:`_deepseek_v4_hidden`), the compressed and index keys a layer reads from its
        source appended to its own copy of them. Returns the next hidden states."""
        from mlx_lm.models import deepseek_v41 as v4

        args, n = text_args(self.text), h.shape[1]
        streams, pre_mix, kv, index_k, topk = self._deepseek_v4_parts(h)
        cache = v4.LayerCache(args.sliding_window)
        fields = ("window", "compress_kv", "index_k", "pending_kv", "pending_gate")
        for name, part in zip(fields, state or [None] * len(fields)):
            setattr(cache, name, None if part is None or part.shape[1] == 0 else part)
        start, end = int(positions[0]), int(positions[0]) + n
        if positions[-1] != end - 1:  # (mlx-lm's block runs from an offset on)
            raise RuntimeError(f"deepseek_v41 layer {layer} sent positions {positions[0]}.."
                               f"{positions[-1]} that do not follow each other")
        cache.offset = start
        reads, shared, before = v4._shared_reads(args, layer), {}, {}
        for key, rows in (("compress_kv", kv), ("index_k", index_k)):
            source = reads.get(key)
            before[key] = 0 if getattr(cache, key) is None else getattr(cache, key).shape[1]
            if source is not None and source != layer:  # another layer's: its new ones
                new = v4._entries(args, source, end) - v4._entries(args, source, start)
                if new:
                    setattr(cache, key, v4._append(getattr(cache, key), rows[:, :new]))
                shared[key] = getattr(cache, key)
        if "topk_idx" in reads:
            width = min(args.index_topk, v4._index_keys(args, reads["topk_idx"], end))
            shared["topk_idx"] = topk[..., :width]
        previous = 0 if cache.window is None else cache.window.shape[1]
        window = v4._window_indices(previous=previous, length=n, window=args.sliding_window)
        streams, pre_mix = self.layers[layer](streams, pre_mix, start_pos=start,
                                              window_idx=window[None], cache=cache,
                                              shared=shared)
        handed = []
        for key, rows in (("compress_kv", kv), ("index_k", index_k)):
            if reads.get(key) == layer and getattr(cache, key) is not None:  # its own new ones
                new = getattr(cache, key)[:, before[key]:]
                rows = mx.concatenate([new.astype(rows.dtype), rows[:, new.shape[1]:]], axis=1)
            handed.append(rows)
        attn = self.layers[layer].self_attn
        if "indexer" in attn and attn.ratio:  # its own picks (an indexer picks where it compresses)
            picks = shared["topk_idx"]
            topk = mx.pad(picks, [(0, 0), (0, 0), (0, args.index_topk - picks.shape[-1])],
                          constant_values=-1)
        state[:] = [mx.zeros((1, 0, width), dtype) if getattr(cache, name) is None
                    else getattr(cache, name)
                    for name, (width, dtype) in zip(fields, self._v4_state)]
        return self._deepseek_v4_hidden(streams, pre_mix, *handed, topk)

    def state_rows(self, layer: int, took: int) -> Optional[List[int]]:
        """The rows of each part of recurrent ``layer``'s state after ``took`` tokens where
        they do not grow by one a token (DeepSeek-V4's: :meth:`_deepseek_v4_block`); None for
        every other family."""
        if not self._deepseek_v4:
            return None
        from mlx_lm.models.deepseek_v41 import _entries, _shared_reads

        args = text_args(self.text)
        reads = _shared_reads(args, layer)
        ratio = args.compress_ratios[layer] if reads.get("compress_kv") == layer else 0
        pending = took % ratio if ratio > 1 else 0  # the open group's
        return [min(took, args.sliding_window), _entries(args, reads.get("compress_kv"), took),
                _entries(args, reads.get("index_k"), took), pending, pending]

    def _altup_predict(self, block: nn.Module, h: mx.array) -> mx.array:
        """Gemma 3n's AltUp: a layer's prediction (S, 1, n, D) of the S streams of hidden
        states ``h`` (1, n, S x D + ...), its active one its attention's input."""
        n = h.shape[1]
        streams = h[..., :self._streams].reshape(1, n, -1, self._hidden).transpose(2, 0, 1, 3)
        return block.altup.predict(streams)

    def _altup_finish(self, layer: int, h: mx.array, r: mx.array, given: mx.array,
                      n: int) -> mx.array:
        """Gemma 3n's layer after attention's ``o_proj`` output ``r`` on the streams ``h``
        (1, >= n, S x D) of n tokens whose per-layer inputs are ``given`` (1, n, width):
        attention, LAuReL and the MLP on the active predicted stream, the streams corrected by
        the result, the per-layer input's projection added to all but the active one; ->
        (1, n, S x D)."""
        block = self.layers[layer]
        predictions = self._altup_predict(block, h)
        active = predictions[self._active]
        x = active + block.post_attention_layernorm(r)
        x = (x + block.laurel(block.input_layernorm(active))) * 2.0 ** -0.5
        x = x + block.post_feedforward_layernorm(
            self._mlp(layer, block.pre_feedforward_layernorm(x)))
        corrected = block.altup.correct(predictions, x)[:, :, :n]
        first = corrected[self._active]
        if block.config.altup_correct_scale:
            first = first * block.altup.correct_output_scale
        first = nn.gelu_approx(block.per_layer_input_gate(first)) * given
        corrected[1:] = corrected[1:] + block.post_per_layer_input_norm(
            block.per_layer_projection(first))
        return corrected.transpose(1, 2, 0, 3).reshape(1, n, -1)

    def _residual_mix(self, h: mx.array, norm: nn.Module, proj: nn.Module) -> mx.array:
        """Kimi K3's attention residuals: the input (1, n, D) that a layer's attention or MLP
        (its ``norm`` and ``proj``), or the final norm, takes from hidden states ``h``
        (1, n, (1 + K) x D: the sum since the last block began, then the K blocks' inputs):
        mlx-lm's softmax mix of them all, by its own function."""
        from mlx_lm.models.kimi_k3 import ResidualBlocks, _attn_res_mix

        blocks, d = ResidualBlocks(text_args(self.text).rms_norm_eps), self._hidden
        for k in range(1, h.shape[-1] // d):
            blocks.append(h[..., k * d:(k + 1) * d])
        weight = norm.weight.astype(mx.float32) * proj.weight.reshape(-1)
        return _attn_res_mix(blocks, h[..., :d], weight, blocks.eps)

    def _residual_finish(self, layer: int, h: mx.array, r: mx.array) -> mx.array:
        """Kimi K3's layer after its attention (or KDA) output ``r`` (1, n, D) on hidden
        states ``h`` (1, n, (1 + K) x D, :meth:`_residual_mix`): at a block's first layer the
        sum so far becomes the new block's input and the sum restarts from ``r``, else ``r`` is
        added to it; then the MLP on the mix, added to the sum."""
        block, d = self.layers[layer], self._hidden
        total, blocks = h[..., :d], h[..., d:]
        if block.is_block_start:
            total, blocks = r, mx.concatenate([blocks, total], axis=-1)
        else:
            total = total + r
        x = self._residual_mix(mx.concatenate([total, blocks], axis=-1), block.mlp_res_norm,
                               block.mlp_res_proj)
        total = total + self._mlp(layer, block.post_attention_layernorm(x))
        return mx.concatenate([total, blocks], axis=-1)

    def _branch(self, x: mx.array) -> mx.array:
        """A residual branch's output as it is added: times Granite's residual multiplier."""
        return x if self._residual_multiplier is None else x * self._residual_multiplier

    def _mlp(self, layer: int, x: mx.array) -> mx.array:
        """The layer's feed-forward (:func:`feed_forward`); on the CPU a dense gated one takes
        its activation from :func:`~mlx_lazy.kernels.gated` (MLX's sigmoid and tanh are scalar
        there: half of a 4,096-token prompt's MLP time, and most of what a revived row adds to
        a layer)."""
        mlp, activation = self._feed_forwards[layer], self._activations[layer]
        shared = self._shared_mlps[layer]
        if shared is not None:  # granitemoehybrid: a shared MLP beside the experts
            return mlp(x) + shared(x)
        if activation is None or mx.default_device() != mx.cpu:
            return mlp(x)
        if hasattr(mlp, "w3"):  # lfm2, internlm2: w1 the gate, w3 up, w2 down
            return mlp.w2(kernels.gated(mlp.w1(x), mlp.w3(x), activation))
        if hasattr(mlp, "w2"):  # qwen: w2 the gate, w1 up, c_proj down
            return mlp.c_proj(kernels.gated(mlp.w2(x), mlp.w1(x), activation))
        if hasattr(mlp, "gate_up_proj"):  # phi3
            gate, up = mx.split(mlp.gate_up_proj(x), 2, axis=-1)
        elif hasattr(mlp, "proj_1"):  # openelm
            gate, up = mx.split(mlp.proj_1(x), 2, axis=-1)
            return mlp.proj_2(kernels.gated(gate, up, activation))
        elif hasattr(mlp, "c_fc_0"):  # exaone
            return mlp.c_proj(kernels.gated(mlp.c_fc_0(x), mlp.c_fc_1(x), activation))
        else:
            gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        return mlp.down_proj(kernels.gated(gate, up, activation))

    def _blas_rows(self, x: mx.array) -> mx.array:
        """``x`` (1, n, D) with zero rows appended up to :func:`~mlx_lazy._blas.gemm_rows`
        where the layer's matmuls run on OpenBLAS (float32 weights on the CPU): every
        operation of a layer but attention is row by row, so the extra rows change no real
        one, and the matmuls run faster."""
        n = x.shape[1]
        if not self._float32 or mx.default_device() != mx.cpu:
            return x
        rows = _blas.gemm_rows(n)
        if rows == n:
            return x
        return mx.concatenate([x, mx.zeros((1, rows - n, x.shape[2]), x.dtype)], axis=1)


#: Embedding rows an identity reads, spread over the table.
IDENTITY_ROWS = 64
#: Buckets of each count sketch in an identity.
SKETCH_SIZE = 32
#: Largest relative distance between two identities' sketches of one model: the embedding
#: rows (4-bit rounding moves them by about 0.1, two different models by about 1.4) and
#: the norm weights (a bfloat16 cast by at most 0.002; two trainings by far more).
IDENTITY_TOLERANCE = {"embedding": 0.5, "norms": 0.02}
_IDENTITY_PREFIX = "i1:"
_MAX_EXPONENT = 128  # sketches of weights are far inside it; squares stay finite in float64
_PART = re.compile(r"^(-?[0-9]{1,3})\.([A-Za-z0-9_-]{%d})$" % ((SKETCH_SIZE * 2 * 4 + 2) // 3))


def _sketch(x: np.ndarray, seed: int) -> np.ndarray:
    """A count sketch of ``x``: each element added, with a random sign, to one of
    :data:`SKETCH_SIZE` buckets, both drawn from (seed, len(x)): for any x and y of one
    length, the distance between sketches estimates ``|x - y|``."""
    buckets, signs = _sketch_hash(seed, x.size)
    return np.bincount(buckets, weights=signs * x.astype(np.float64), minlength=SKETCH_SIZE)


@lru_cache(maxsize=8)
def _sketch_hash(seed: int, size: int) -> Tuple[np.ndarray, np.ndarray]:
    """The buckets and signs of :func:`_sketch` for one length (2 bytes per element, kept:
    one model asks for the same two lengths again and again)."""
    rng = np.random.default_rng([seed, size])
    buckets = rng.integers(0, SKETCH_SIZE, size).astype(np.int8)
    signs = (rng.integers(0, 2, size) * 2 - 1).astype(np.int8)
    buckets.flags.writeable = signs.flags.writeable = False
    return buckets, signs


def _encode_identity(parts: Tuple[np.ndarray, ...]) -> str:
    out = []
    for seed, x in enumerate(parts):
        s = _sketch(x, seed)
        peak = float(np.abs(s).max()) if s.size else 0.0
        e = int(np.ceil(np.log2(peak))) if peak > 0 and np.isfinite(peak) else 0
        e = max(-_MAX_EXPONENT, min(_MAX_EXPONENT, e))
        half = (s / 2.0 ** e).astype("<f2")
        out.append(f"{e}.{base64.urlsafe_b64encode(half.tobytes()).decode().rstrip('=')}")
    return _IDENTITY_PREFIX + ":".join(out)


def decode_identity(identity: object) -> Tuple[np.ndarray, np.ndarray]:
    """The (embedding, norms) sketches of an identity written by :meth:`ModelAdapter.identity`.

    Raises:
        ValueError: anything else (the caller names the field).
    """
    if not isinstance(identity, str) or not identity.startswith(_IDENTITY_PREFIX):
        raise ValueError(f"an identity starts with {_IDENTITY_PREFIX!r}")
    parts = identity[len(_IDENTITY_PREFIX):].split(":")
    if len(parts) != 2:
        raise ValueError("an identity has two parts")
    out = []
    for part in parts:
        m = _PART.match(part)
        if m is None:
            raise ValueError(f"malformed identity part {part[:24]!r}")
        if abs(int(m.group(1))) > _MAX_EXPONENT:
            raise ValueError(f"an identity's scale is 2**-{_MAX_EXPONENT} to 2**{_MAX_EXPONENT}")
        raw = base64.urlsafe_b64decode(m.group(2) + "=" * (-len(m.group(2)) % 4))
        values = np.frombuffer(raw, "<f2").astype(np.float64) * 2.0 ** int(m.group(1))
        if not np.isfinite(values).all():
            raise ValueError("an identity holds a value that is not finite")
        out.append(values)
    return out[0], out[1]


def identity_distances(a: str, b: str) -> dict:
    """Relative distances, by part, between two identities (0: the same tensors)."""
    out = {}
    for name, x, y in zip(IDENTITY_TOLERANCE, decode_identity(a), decode_identity(b)):
        scale = max(np.linalg.norm(x), np.linalg.norm(y))
        out[name] = float(np.linalg.norm(x - y) / scale) if scale > 0 else 0.0
    return out


def fingerprint_difference(saved: Mapping[str, Any], ours: Mapping[str, Any],
                           ignore: Collection[str] = ()) -> Optional[str]:
    """The first key of the fingerprint ``ours`` (:meth:`ModelAdapter.fingerprint`) whose
    value ``saved`` (a file's, another model's) does not hold, but those in ``ignore``; None
    when all agree."""
    return next((k for k in ours if k not in ignore and saved.get(k) != ours[k]), None)


def identities_match(a: str, b: str) -> bool:
    """Whether two identities are of one model, whatever the quantization (any bits, any
    group size) and float dtype of either copy: every part within
    :data:`IDENTITY_TOLERANCE`. A malformed identity matches nothing."""
    try:
        distances = identity_distances(a, b)
    except ValueError:
        return False
    return all(distances[k] <= IDENTITY_TOLERANCE[k] for k in distances)


def quantizations(model: nn.Module) -> List[str]:
    """The quantizations of ``model``'s quantized layers, sorted: ``q4g64`` (affine, 4 bits,
    groups of 64), ``mxfp4g32``; empty for an unquantized model."""
    found = set()
    for _, module in model.named_modules():
        bits = getattr(module, "bits", None)
        if isinstance(bits, int) and hasattr(module, "group_size") and "scales" in module:
            mode = getattr(module, "mode", "affine")
            found.add((f"q{bits}" if mode == "affine" else str(mode), int(module.group_size)))
    return [f"{kind}g{group}" for kind, group in sorted(found)]


def feed_forward(block: nn.Module) -> Optional[nn.Module]:
    """A layer's feed-forward module as mlx-lm's block calls it: ``block.mlp`` (a dense MLP
    or a sparse MoE block), the ``block_sparse_moe`` of Mixtral, Granite MoE and
    Phi-3.5-MoE, LFM2's and Llama 4's ``feed_forward``, OpenELM's and DBRX's ``ffn`` or
    Phixtral's ``moe``, RecurrentGemma's ``mlp_block``; None in Nemotron-H's blocks (one mixer
    each: its MLPs are layers of their own)."""
    for name in ("mlp", "block_sparse_moe", "ffn", "moe", "mlp_block"):
        if name in block:
            return block[name]
    return getattr(block, "feed_forward", None)


def attention_module(block: nn.Module) -> nn.Module:
    """A layer's attention module, the one that holds its projections: ``block.self_attn``,
    bailing_moe's ``block.attention``, Nemotron-H's ``block.mixer``, EXAONE 3's
    ``block.attn.attention``, nanochat's and GPT-J's ``block.attn``, Phixtral's ``block.mixer`` or
    DBRX's ``block.norm_attn_norm.attn``, RecurrentGemma's ``block.temporal_block``."""
    if "norm_attn_norm" in block:
        return block.norm_attn_norm.attn
    for name in ("self_attn", "attention", "mixer", "temporal_block"):
        if name in block:
            return block[name]
    return block.attn.attention if "attention" in block.attn else block.attn


def _gated_activation(mlp: nn.Module, gemma: bool) -> Optional[str]:
    """The :func:`~mlx_lazy.kernels.gated` activation of mlx-lm's dense gated MLPs (Gemma's
    ``gelu_approx``, the others' SwiGLU); None for any other block (a sparse MoE, Step-3.5's
    clamped SwiGLU)."""
    if getattr(mlp, "limit", None) is not None or hasattr(mlp, "activation"):
        return None  # (MiniMax-M3's SwiGLU-OAI: its module)
    if hasattr(mlp, "w2") or hasattr(mlp, "c_fc_0") or hasattr(mlp, "proj_1"):
        return "silu"  # lfm2's, internlm2's, qwen's, exaone's, openelm's SwiGLU
    if not hasattr(mlp, "down_proj"):
        return None
    if hasattr(mlp, "gate_up_proj") or (hasattr(mlp, "gate_proj") and hasattr(mlp, "up_proj")):
        return "gelu_approx" if gemma else "silu"
    return None


def _scaled_rms_norm(x: mx.array, weight: mx.array | float, eps: float = 1e-6) -> mx.array:
    """PLaMo 2's q/k norm of ``x`` (1, n, heads, head_dim): a weight-free RMS norm (epsilon
    1e-6, as mlx-lm's), times ``weight`` (heads, head_dim; Muse Glimmer's queries: a scalar)."""
    return mx.fast.rms_norm(x, weight=None, eps=eps) * weight


def _rescaled(x: mx.array, like: mx.array) -> mx.array:
    """Gemma 3n's AltUp: ``x`` scaled, token by token, to the RMS magnitude of ``like``, in
    mlx-lm's arithmetic."""
    magnitude = mx.mean(x ** 2, axis=-1, keepdims=True) ** 0.5
    target = mx.mean(like ** 2, axis=-1, keepdims=True) ** 0.5
    return x * (target / mx.maximum(magnitude, mx.finfo(like.dtype).min))


def _query_scale(positions: np.ndarray, beta: float, original_max: int) -> mx.array:
    """Llama 4's attention temperature as mlx-lm's ministral3 applies it to queries:
    ``1 + beta * log(1 + floor(p / original_max))`` at each position p, shaped (n, 1)."""
    p = mx.array(positions.astype(np.float32))
    return (1 + beta * mx.log(1 + mx.floor(p / original_max)))[:, None]


def _rope(rope: nn.Module, x: mx.array, positions: np.ndarray) -> mx.array:
    start = int(positions[0])
    if positions[-1] - start == len(positions) - 1:  # contiguous (sorted, unique)
        return rope(x, offset=start)
    if isinstance(rope, DynamicNTKScalingRoPE):  # its base from where one call ends (an int):
        # one call over the span, as over a chunk of the same last position
        rows = mx.array((positions - start).astype(np.int32))
        span = mx.zeros((*x.shape[:2], int(positions.max()) - start + 1, x.shape[3]), x.dtype)
        span[:, :, rows] = x
        return rope(span, offset=start)[:, :, rows]
    # mx.fast.rope takes one offset per batch row: move tokens onto the batch axis.
    offsets = mx.array(positions.astype(np.int32))
    return rope(x.transpose(2, 1, 0, 3), offset=offsets).transpose(2, 1, 0, 3)
