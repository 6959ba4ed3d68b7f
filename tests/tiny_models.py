"""Tiny random-weight mlx-lm models (the :data:`KINDS`, and variants of some) with a real
tokenizer.

``build_tiny_model(kind, folder)`` writes a folder that ``mlx_lm.load`` reads (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json with a ChatML chat template) and
returns it; everything is float32 and seeded, so two builds are identical.
"""

from __future__ import annotations

import mlx_lazy  # noqa: F401  (loads OpenBLAS before mlx)

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from mlx_lm.models.bitlinear_layers import BitLinear
from mlx_lm.models.muse_spark import residual_gate_coefficients

from mlx_lazy.adapter import feed_forward

KINDS = ("llama", "qwen2", "qwen3", "qwen3_moe", "glm4_moe", "seed_oss", "ernie4_5",
         "ernie4_5_moe", "phi3", "gemma3_text", "smollm3", "ministral3", "gpt_oss", "granite",
         "olmo2", "olmo3", "exaone4", "gemma4_text", "qwen3_5", "qwen3_next", "deepseek_v3",
         "glm4_moe_lite", "deepseek_v2", "gemma2", "glm4", "starcoder2", "cohere2", "helium",
         "internlm3", "apertus", "mixtral", "qwen2_moe", "olmoe", "granitemoe", "phimoe", "lfm2",
         "lfm2_moe", "dots1", "bailing_moe", "hunyuan", "llama4_text", "exaone", "hunyuan_v1_dense",
         "stablelm", "minicpm", "mimo", "nanochat", "gemma", "cohere", "phi", "gpt_neox",
         "internlm2", "qwen", "gpt2", "gpt_bigcode", "nemotron", "openelm", "deepseek", "mellum",
         "nanbeige", "minicpm3", "youtu_llm", "granitemoehybrid", "nemotron_h", "glm",
         "telechat3", "solar_open", "jamba", "mistral4", "exaone_moe", "Klear", "afmoe", "gptj",
         "dbrx", "phixtral", "minimax", "mimo_v2_flash", "step3p5", "nemotron-nas", "plamo3",
         "laguna", "talkie", "bailing_moe_v3", "longcat_flash", "falcon_h1", "plamo2",
         "lille-130m", "plamo", "bitnet", "gear", "recurrent_gemma", "afm7", "baichuan_m1",
         "olmo_hybrid", "kimi_linear", "muse_glimmer", "spark2_5", "iquestloopcoder", "phi3small",
         "deepseek_v41", "kimi_k3")
VOCAB_SIZE = 384
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A language model predicts the next token "
    "from the tokens before it. Long prompts are expensive: every layer attends over every "
    "token. Pruning keeps the tokens that matter and skips the rest. The passkey is 12345. "
    "Remember it. What is the passkey? Question: where is the key? Answer: under the mat. "
) * 4

_BASE = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash) and its MoE blocks
_MLA = {"tie_word_embeddings": False, "num_key_value_heads": 4, "kv_lora_rank": 32,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 32, "v_head_dim": 24,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "moe_intermediate_size": 32, "first_k_dense_replace": 1, "norm_topk_prob": True}
_KIND_CONFIG = {
    "llama": {"architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True},  # q/k/v bias
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "tie_word_embeddings": True},  # q/k norm
    # q/k norm; sparse MoE blocks (2 of 4 experts per token) except in the dense layer 1
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "tie_word_embeddings": False,
                  "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
                  "mlp_only_layers": [1], "moe_intermediate_size": 32, "norm_topk_prob": True},
    # GLM-4.5: q/k/v biases, q/k norms, RoPE over half of each head; sparse MoE blocks from
    # layer 1 on (2 of 4 experts in 2 groups, one group taken, sigmoid routing with a
    # correction bias, scaled by 2.5) beside a shared expert; layer 0 dense
    "glm4_moe": {"architectures": ["Glm4MoeForCausalLM"], "tie_word_embeddings": False,
                 "moe_intermediate_size": 32, "norm_topk_prob": True, "n_group": 2,
                 "topk_group": 1, "n_shared_experts": 1, "n_routed_experts": 4,
                 "routed_scaling_factor": 2.5, "num_experts_per_tok": 2,
                 "first_k_dense_replace": 1, "use_qk_norm": True, "attention_bias": True,
                 "partial_rotary_factor": 0.5, "rope_scaling": None},
    # Seed-OSS: biases on q/k/v and on o_proj
    "seed_oss": {"architectures": ["SeedOssForCausalLM"], "tie_word_embeddings": False,
                 "attention_bias": True, "attention_out_bias": True},
    # ERNIE 4.5: biases on every projection, traditional RoPE; its MoE layout: 2 of 4
    # experts (softmax routing) beside a shared expert from layer 1 on, layer 0 dense
    "ernie4_5": {"architectures": ["Ernie4_5_ForCausalLM"], "tie_word_embeddings": True,
                 "use_bias": True},
    "ernie4_5_moe": {"architectures": ["Ernie4_5_MoeForCausalLM"], "tie_word_embeddings": True,
                     "use_bias": False, "moe_num_experts": 4, "moe_k": 2,
                     "moe_layer_start_index": 1, "moe_intermediate_size": 32,
                     "moe_num_shared_experts": 1},
    # fused qkv_proj and gate_up_proj; head_dim is hidden_size / heads (16)
    "phi3": {"architectures": ["Phi3ForCausalLM"], "tie_word_embeddings": False},
    # Gemma 3: layers 0 and 2 slide over a 24-position window (RoPE base 10000), 1 and 3 are
    # global (base 1e6); q/k norms, (1 + w) norms, scaled embeddings, tied head; a
    # query_pre_attn_scalar unlike head_dim so a wrong scale shows
    "gemma3_text": {"architectures": ["Gemma3ForCausalLM"], "tie_word_embeddings": True,
                    "sliding_window": 24, "sliding_window_pattern": 2,
                    "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0,
                    "query_pre_attn_scalar": 24, "rms_norm_eps": 1e-6},
    # Gemma 2: (1 + w) norms, scaled embeddings, a tied head; a query_pre_attn_scalar unlike
    # head_dim (a wrong scale shows), attention and final logit soft-caps small enough to
    # bend random weights' logits (50 and 30 in the real ones)
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "tie_word_embeddings": True,
               "query_pre_attn_scalar": 4, "attn_logit_softcapping": 2.0,
               "final_logit_softcapping": 5.0, "rms_norm_eps": 1e-6},
    # SmolLM3: Llama with no RoPE in every second layer here (every fourth in the real one)
    "smollm3": {"architectures": ["SmolLM3ForCausalLM"], "tie_word_embeddings": True,
                "no_rope_layer_interval": 2, "pad_token_id": 0},
    # Ministral 3: Llama with YaRN RoPE and queries scaled by position, here from position 64
    # on (16,384 in the real one) so that a prompt of a few hundred tokens spans 5 scales
    "ministral3": {"architectures": ["Ministral3ForCausalLM"], "tie_word_embeddings": True,
                   "rope_parameters": {
                       "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                       "original_max_position_embeddings": 64, "beta_fast": 32.0,
                       "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                       "llama_4_scaling_beta": 0.1}},
    # gpt-oss: biases, YaRN RoPE, a sparse MoE in every layer (2 of 4 experts per token),
    # layers 0 and 2 sliding over a 24-position window, random attention sinks
    "gpt_oss": {"architectures": ["GptOssForCausalLM"], "tie_word_embeddings": False,
                "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 24,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
                "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "original_max_position_embeddings": 1024}},
    # Granite: multipliers far from 1 on the embeddings, residual branches, logits and
    # attention scale, so that a missing one shows; biases in attention and MLP
    "granite": {"architectures": ["GraniteForCausalLM"], "tie_word_embeddings": True,
                "embedding_multiplier": 6.0, "residual_multiplier": 0.3, "logits_scaling": 4.0,
                "attention_multiplier": 0.1, "attention_bias": True, "mlp_bias": True},
    # OLMo 2: norms on each branch's output and none before; q/k norms over all heads at once
    "olmo2": {"architectures": ["Olmo2ForCausalLM"], "tie_word_embeddings": False},
    # OLMo 3: OLMo 2's layers, 0 and 2 sliding over a 24-position window with plain RoPE,
    # 1 and 3 global with YaRN RoPE
    "olmo3": {"architectures": ["Olmo3ForCausalLM"], "tie_word_embeddings": False,
              "sliding_window": 24, "layer_types": ["sliding_attention", "full_attention"] * 2,
              "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "original_max_position_embeddings": 1024}},
    # EXAONE 4: OLMo 2's layout with per-head q/k norms; layers 0 and 2 slide over a
    # 24-position window, 1 and 3 are global without RoPE
    "exaone4": {"architectures": ["Exaone4ForCausalLM"], "tie_word_embeddings": False,
                "sliding_window": 24, "sliding_window_pattern": "LG", "rope_scaling": None,
                "layer_types": ["sliding_attention", "full_attention"] * 2},  # transformers
    # Gemma 4 (its 31B layout): layers 0 and 2 slide over a 24-position window with 16-wide
    # heads, 1 and 3 are global with 32-wide heads, one key/value head whose values are the
    # keys' projection, and partial RoPE; a per-layer output scalar, soft-capped logits
    "gemma4_text": {"architectures": ["Gemma4ForCausalLM"], "tie_word_embeddings": True,
                    "global_head_dim": 32, "num_global_key_value_heads": 1,
                    "attention_k_eq_v": True, "num_kv_shared_layers": 0,
                    "hidden_size_per_layer_input": 0, "sliding_window": 24,
                    "layer_types": ["sliding_attention", "full_attention"] * 2,
                    "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6},
    # Qwen3.5: a hybrid of three Gated DeltaNet (linear attention) layers to one of gated
    # full attention (layers 3 and 7 of 8) with q/k norms and RoPE over half of each head
    "qwen3_5": {"architectures": ["Qwen3_5ForCausalLM"], "tie_word_embeddings": False,
                "num_hidden_layers": 8, "full_attention_interval": 4,
                "linear_num_value_heads": 4, "linear_num_key_heads": 2,
                "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                "linear_conv_kernel_dim": 4,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                    "partial_rotary_factor": 0.5}},
    # Qwen3-Next, Qwen3.5's layout before it: the same layers (Gated DeltaNet with fused
    # in_proj_qkvz), sparse MoE blocks (2 of 4 experts and a shared one) but in layer 1
    "qwen3_next": {"architectures": ["Qwen3NextForCausalLM"], "tie_word_embeddings": False,
                   "num_hidden_layers": 8, "full_attention_interval": 4,
                   "linear_num_value_heads": 4, "linear_num_key_heads": 2,
                   "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                   "linear_conv_kernel_dim": 4, "partial_rotary_factor": 0.5,
                   "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
                   "mlp_only_layers": [1], "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32, "norm_topk_prob": True},
    # DeepSeek-V3: latent attention (absorbed, 4 heads over one 32-wide latent and 8 RoPE
    # dims; values 24 wide, unlike the 32 of q_nope), low-rank queries, YaRN whose mscale
    # raises the scale; MoE from layer 1 on as in glm4_moe, routed by random weights and bias
    "deepseek_v3": {"architectures": ["DeepseekV3ForCausalLM"], **_MLA, "q_lora_rank": 32,
                    "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
                    "rope_scaling": {"type": "yarn", "factor": 4.0, "mscale": 1.0,
                                     "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                                     "original_max_position_embeddings": 1024}},
    # Mistral Small 4: DeepSeek-V3's absorbed latent attention, YaRN, queries scaled by position
    # from 48 on (Llama 4's temperature, as ministral3's); softmax-routed MoE from layer 1 on
    "mistral4": {"architectures": ["Mistral4ForCausalLM"], **_MLA, "q_lora_rank": 32,
                 "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.5,
                 "rope_parameters": {"type": "yarn", "factor": 4.0, "mscale": 1.0,
                                     "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                                     "original_max_position_embeddings": 48,
                                     "llama_4_scaling_beta": 0.5, "rope_theta": 10000.0}},
    # GLM-4.7-Flash: DeepSeek-V3's layout, its low-rank norms' eps from the config, no RoPE
    # scaling
    "glm4_moe_lite": {"architectures": ["Glm4MoeLiteForCausalLM"], **_MLA, "q_lora_rank": 32,
                      "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.8,
                      "rope_scaling": None, "rms_norm_eps": 1e-5},
    # DeepSeek-V2-Lite: latent attention expanded per head (kv_b_proj), q_proj (no low-rank
    # queries), its own YaRN class (mscale on q_pe and k_pe themselves: 0.707 against 1.0),
    # softmax routing over 2 of 4 experts
    "deepseek_v2": {"architectures": ["DeepseekV2ForCausalLM"], **_MLA, "q_lora_rank": None,
                    "topk_method": "greedy", "rope_scaling": {
                        "type": "yarn", "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 1.0,
                        "beta_fast": 32, "beta_slow": 1,
                        "original_max_position_embeddings": 1024}},
    # Mixtral: Llama with 2 of 4 experts per token (softmax over the top 2) at
    # block_sparse_moe; its head_dim is hidden_size / heads
    "mixtral": {"architectures": ["MixtralForCausalLM"], "tie_word_embeddings": False,
                "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
    # Qwen1.5/2-MoE: q/k/v biases, 2 of 4 experts beside a shared expert whose output is
    # scaled by the sigmoid of its own gate
    "qwen2_moe": {"architectures": ["Qwen2MoeForCausalLM"], "tie_word_embeddings": False,
                  "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 64},
    # OLMoE: pre-norms, q/k norms over all heads at once, 2 of 4 experts (renormalised)
    "olmoe": {"architectures": ["OlmoeForCausalLM"], "tie_word_embeddings": False,
              "num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
              "norm_topk_prob": True},
    # Granite MoE: Granite's multipliers (far from 1), 2 of 4 experts at block_sparse_moe
    "granitemoe": {"architectures": ["GraniteMoeForCausalLM"], "tie_word_embeddings": True,
                   "embedding_multiplier": 6.0, "residual_multiplier": 0.3,
                   "logits_scaling": 4.0, "attention_multiplier": 0.1, "attention_bias": True,
                   "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
    # Phi-3.5-MoE: LayerNorms (with biases), biases on q/k/v, o_proj and the head, longrope's
    # SuScaledRoPE (its mscale 1.2), 2 of 4 experts chosen by sparsemixer
    "phimoe": {"architectures": ["PhiMoEForCausalLM"], "num_local_experts": 4,
               "num_experts_per_tok": 2, "intermediate_size": 32,
               "original_max_position_embeddings": 1024,
               "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8,
                                "long_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0],
                                "short_mscale": 1.2, "long_mscale": 1.2}},
    # GLM-4-0414: a norm before and after each branch, fused gate_up_proj, q/k/v biases,
    # traditional RoPE over half of each head
    "glm4": {"architectures": ["Glm4ForCausalLM"], "attention_bias": True,
             "partial_rotary_factor": 0.5, "pad_token_id": 0},
    # StarCoder2: LayerNorms with (random) biases, biases on every projection, a plain GELU MLP
    # (c_fc, c_proj), a tied head; head_dim is hidden_size / heads (16)
    "starcoder2": {"architectures": ["Starcoder2ForCausalLM"], "tie_word_embeddings": True,
                   "norm_epsilon": 1e-5},
    # Command R7B: attention and the MLP in parallel on one LayerNorm (with random biases);
    # layers 0 and 2 slide over a 24-position window with traditional RoPE, 1 and 3 are global
    # without RoPE; q/k/v/o biases; logits times 0.3 (0.0625 by default)
    "cohere2": {"architectures": ["Cohere2ForCausalLM"], "sliding_window": 24,
                "sliding_window_pattern": 2, "logit_scale": 0.3, "attention_bias": True,
                "layer_norm_bias": True, "layer_norm_eps": 1e-5},
    # Kyutai Helium: Llama's layout with traditional RoPE and MLP biases; tied here, where
    # mlx-lm still builds an lm_head (kept random: using it shows) but uses the embedding
    "helium": {"architectures": ["HeliumForCausalLM"], "tie_word_embeddings": True,
               "attention_bias": True, "mlp_bias": True},
    # InternLM3: Llama's layout with biases on q/k/v/o and the MLP; dynamic NTK RoPE (plain
    # below max_position_embeddings, as in the prompts here)
    "internlm3": {"architectures": ["InternLM3ForCausalLM"], "tie_word_embeddings": False,
                  "qkv_bias": True, "bias": True,
                  "rope_scaling": {"rope_type": "dynamic", "factor": 6.0}},
    # Apertus: per-head q/k norms, norms named attention_/feedforward_layernorm, a plain
    # xIELU MLP (its slopes random) with biases; Llama 3's RoPE scaling from position 64 on
    "apertus": {"architectures": ["ApertusForCausalLM"], "tie_word_embeddings": False,
                "mlp_bias": True, "attention_bias": False, "post_norm": False,
                "qk_norm": True, "rope_scaling": {
                    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    # LFM2: short gated convolutions (recurrent, 3 wide: a state of 2 tokens) and, in layers 3
    # and 7 of 8 as in Qwen3.5's tiny, grouped-query attention with q/k norms; SwiGLU
    # feed-forward (auto-adjusted to 96 wide), tied head, biases in the convolutions
    "lfm2": {"architectures": ["Lfm2ForCausalLM"], "num_hidden_layers": 8, "norm_eps": 1e-5,
             "conv_bias": True, "conv_L_cache": 3, "block_dim": 64, "block_ff_dim": 128,
             "block_multiple_of": 32, "block_ffn_dim_multiplier": 1.0,
             "block_auto_adjust_ff_dim": True,
             "layer_types": ["conv"] * 3 + ["full_attention"] + ["conv"] * 3 + ["full_attention"]},
    # LFM2-8B-A1B's layout: attention in layers 2 and 4 of 6, the last a convolution; dense
    # feed-forward in layers 0 and 1, then sparse MoE (2 of 4 experts, sigmoid routing with a
    # selection bias)
    "lfm2_moe": {"architectures": ["Lfm2MoeForCausalLM"], "num_hidden_layers": 6,
                 "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3,
                 "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                 "norm_topk_prob": True, "use_expert_bias": True, "num_dense_layers": 2,
                 "layer_types": ["conv", "conv", "full_attention", "conv", "full_attention",
                                 "conv"]},
    # Granite 4.0 H-Tiny's layout: Mamba-2 layers (8 heads of 16 in 2 groups, a state of 16, a
    # convolution over 4 tokens) but in layers 3 and 7 of 8 as in Qwen3.5's tiny, there
    # attention without RoPE; Granite's multipliers (far from 1); 2 of 4 experts beside a
    # shared MLP
    "granitemoehybrid": {"architectures": ["GraniteMoeHybridForCausalLM"],
                         "tie_word_embeddings": True, "embedding_multiplier": 6.0,
                         "residual_multiplier": 0.3, "logits_scaling": 4.0,
                         "attention_multiplier": 0.1, "attention_bias": False,
                         "position_embedding_type": "nope", "num_local_experts": 4,
                         "num_experts_per_tok": 2, "intermediate_size": 32,
                         "shared_intermediate_size": 32, "num_hidden_layers": 8,
                         "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16,
                         "mamba_n_groups": 2, "mamba_d_conv": 4, "mamba_conv_bias": True,
                         "mamba_proj_bias": False,
                         "layer_types": (["mamba"] * 3 + ["attention"]) * 2},
    # Nemotron-H's layers in Qwen3.5's tiny's places: attention (no RoPE) in 3 and 7 of 8,
    # Mamba-2 in 0, 2, 4 and 5 (8 heads of 16 in 2 groups), Nemotron 3 Nano's experts in 1 (2 of
    # 4, sigmoid routing with a correction bias, scaled by 2.5, a shared expert), a ReLU^2 MLP
    # in 6; biases in attention
    "nemotron_h": {"architectures": ["NemotronHForCausalLM"], "num_hidden_layers": 8,
                   "hybrid_override_pattern": ["M", "E", "M", "*", "M", "M", "-", "*"],
                   "attention_bias": True, "mamba_num_heads": 8, "mamba_head_dim": 16,
                   "mamba_proj_bias": False, "ssm_state_size": 16, "conv_kernel": 4,
                   "n_groups": 2, "mlp_bias": False, "layer_norm_epsilon": 1e-5,
                   "use_bias": False, "use_conv_bias": True, "tie_word_embeddings": False,
                   "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "moe_shared_expert_intermediate_size": 32, "n_shared_experts": 1,
                   "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
                   "routed_scaling_factor": 2.5},
    # Nemotron-NAS's layers in Qwen3.5's tiny's places: attention in 3 (2 key/value heads) and
    # 7 (1, no MLP after it); none in 0, 2 and 5, a linear map in its place in 1, 4 and 6; an
    # MLP 256 wide (ffn_mult's rounding) but none in 4, a linear map in 2
    "nemotron-nas": {"architectures": ["DeciLMForCausalLM"], "num_hidden_layers": 8,
                     "tie_word_embeddings": False, "block_configs": [
                         {"attention": attention, "ffn": ffn} for attention, ffn in zip(
                             [{"no_op": True}, {"replace_with_linear": True}, {"no_op": True},
                              {"n_heads_in_group": 2}, {"replace_with_linear": True},
                              {"no_op": True}, {"replace_with_linear": True},
                              {"n_heads_in_group": 4}],
                             [{"ffn_mult": 1.0}, {"ffn_mult": 1.5}, {"replace_with_linear": True},
                              {"ffn_mult": 1.0}, {"no_op": True}, {"ffn_mult": 2.0},
                              {"ffn_mult": 1.0}, {"no_op": True}])]},
    # Jamba's layout in Qwen3.5's tiny's places: Mamba (v1) layers (an inner width of 128, a
    # state of 16, a time-step rank of 32, a convolution over 4 tokens) but attention (no RoPE)
    # in layers 3 and 7 of 8; 2 of 4 experts in the odd layers, a dense MLP in the even ones;
    # an untied head
    "jamba": {"architectures": ["JambaForCausalLM"], "num_hidden_layers": 8,
              "attn_layer_offset": 3, "attn_layer_period": 4, "expert_layer_offset": 1,
              "expert_layer_period": 2, "mamba_d_conv": 4, "mamba_d_state": 16,
              "mamba_expand": 2, "mamba_dt_rank": 32, "num_experts": 4,
              "num_experts_per_tok": 2, "intermediate_size": 32, "mamba_conv_bias": True,
              "mamba_proj_bias": False, "tie_word_embeddings": False},
    # Falcon-H1's layers: Mamba-2 (8 heads of 16 in 2 groups, a state of 16, a convolution over
    # 4 tokens, its gated norm) beside attention (RoPE) in each of 4; a tied head whose logits
    # its multipliers scale by 0.5 / 4
    "falcon_h1": {"architectures": ["FalconH1ForCausalLM"], "mamba_d_ssm": 128,
                  "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16,
                  "mamba_n_groups": 2, "mamba_d_conv": 4, "mamba_rms_norm": True,
                  "mamba_chunk_size": 32, "embedding_multiplier": 4.0,
                  "lm_head_multiplier": 0.5, "tie_word_embeddings": True},
    # PLaMo 2's layout: Mamba layers (8 heads of 16, a state of 16) in 0 and 2, attention in 1
    # and 3 (every mamba_step-th), its four offset norms random; a tied head
    "plamo2": {"architectures": ["Plamo2ForCausalLM"], "hidden_size_per_head": 16,
               "mamba_num_heads": 8, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_step": 2,
               "mamba_chunk_size": 32, "attention_window_size": 4096,
               "tie_word_embeddings": True},
    # Lille 130M: a fused q/k/v after its attention's own norm, traditional RoPE, an MLP 256 wide
    # (its rounding) holding its own norm, both norms random; a tied head
    "lille-130m": {"architectures": ["LilleForCausalLM"], "block_size": 4096,
                   "layer_norm_eps": 1e-5, "n_embd": 64, "n_head": 4, "n_kv_heads": 2,
                   "n_layer": 4},
    # PLaMo 1: attention and MLP in parallel on one (random) norm; 2 key/value heads tiled over
    # 4 query heads (n_shared_head 2: head i reads i mod 2, not grouped-query's i // 2)
    "plamo": {"architectures": ["PlamoForCausalLM"], "n_shared_head": 2},
    # BitNet b1.58: ternary BitLinear projections (random, random scales), random norms, the
    # attention's and MLP's sub-norms too; a ReLU^2-gated MLP, a tied head
    "bitnet": {"architectures": ["BitNetForCausalLM"], "tie_word_embeddings": True},
    # Gear: convolution mixers (recurrent) in 0, 2 and 4, sliding-window attention over 24
    # positions in 1 and 5, global in 3; Gemma 2's scale unlike head_dim and soft-caps; biases
    "gear": {"architectures": ["GearForCausalLM"], "num_hidden_layers": 6, "conv_L_cache": 3,
             "layer_types": ["conv_mixer", "sliding_attention", "conv_mixer", "full_attention",
                             "conv_mixer", "sliding_attention"], "sliding_window": 24,
             "rope_local_base_freq": 10000.0, "rope_theta": 1e6, "query_pre_attn_scalar": 4,
             "attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0,
             "attention_bias": True, "tie_word_embeddings": True},
    # RecurrentGemma: RG-LRU layers (a convolution over 4 tokens) in 0, 1, 3 and 4, local
    # attention (one key/value head) over 24 positions in 2 and 5; logits soft-capped at 5
    "recurrent_gemma": {"architectures": ["RecurrentGemmaForCausalLM"], "num_hidden_layers": 6,
                        "attention_bias": False, "conv1d_width": 4, "logits_soft_cap": 5.0,
                        "num_key_value_heads": 1, "attention_window_size": 24,
                        "block_types": ["recurrent", "recurrent", "attention"]},
    # AFM: fused q/k/v, q/k norms after traditional RoPE, keys and values rounded to whole
    # numbers (mlx-lm's quantization scales of 1); layer 3 reuses layer 2's keys and values
    "afm7": {"architectures": ["AFMForCausalLM"], "hidden_dim": 64, "num_layers": 4,
             "num_kv_reuse_layers": 1, "num_heads": 4, "num_kv_heads": 2,
             "hidden_dim_scale_factor": 2.0},
    # Baichuan-M1: its keys and values mixed with the previous token's (random weights); layers
    # 0 and 2 slide over 24 positions with 8 heads of 8 over 4 key/value heads
    "baichuan_m1": {"architectures": ["BaichuanM1ForCausalLM"], "conv_window": 2,
                    "sliding_window": 24, "sliding_window_layers": [0, 2],
                    "num_swa_attention_heads": 8, "num_swa_key_value_heads": 4,
                    "tie_word_embeddings": False},
    # DeepSeek-V4: 4 hyper-connection streams; layer 0 attends over a window of 24 only, layer 1
    # compresses groups of 3 (keys and index keys; 100 tokens leave one open) and picks 4 of them
    # for itself and layer 2, which reads them, as does layer 3, whose own indexer picks again;
    # 2 of 4 experts beside a shared one
    "deepseek_v41": {"architectures": ["DeepseekV4ForCausalLM"], "head_dim": 32,
                     "q_lora_rank": 32, "qk_rope_head_dim": 8, "o_groups": 2, "o_lora_rank": 16,
                     "moe_intermediate_size": 32, "n_routed_experts": 4,
                     "num_experts_per_tok": 2, "sliding_window": 24,
                     "compress_ratios": [0, 3, 3, 3], "kv_source_layer_ids": [1],
                     "index_source_layer_ids": [1, 3], "index_n_heads": 2,
                     "index_head_dim": 32, "index_topk": 4, "hc_mult": 4},
    # dots.llm1: per-head q/k norms; from layer 1 on 2 of 4 experts (sigmoid routing with a
    # random correction bias, scaled by 2.5) beside a shared expert
    "dots1": {"architectures": ["Dots1ForCausalLM"], "tie_word_embeddings": False,
              "first_k_dense_replace": 1, "moe_intermediate_size": 32, "n_routed_experts": 4,
              "n_shared_experts": 1, "norm_topk_prob": True, "num_experts_per_tok": 2,
              "routed_scaling_factor": 2.5, "scoring_func": "noaux_tc"},
    # Ling / Ring: fused q/k/v (biases), q/k norms before RoPE over half of each head; from
    # layer 1 on 2 of 4 experts (sigmoid, 2 groups of which 1 taken, a random expert bias,
    # scaled by 2.5) beside a shared expert; biases on the output and MLP projections
    "bailing_moe": {"architectures": ["BailingMoeForCausalLM"], "tie_word_embeddings": False,
                    "first_k_dense_replace": 1, "moe_intermediate_size": 32, "num_experts": 4,
                    "num_shared_experts": 1, "norm_topk_prob": True, "num_experts_per_tok": 2,
                    "use_qk_norm": True, "use_qkv_bias": True, "use_bias": True,
                    "partial_rotary_factor": 0.5, "score_function": "sigmoid",
                    "moe_router_enable_expert_bias": True, "n_group": 2, "topk_group": 1,
                    "routed_scaling_factor": 2.5},
    # Ling 2.5: Kimi Delta Attention (recurrent) in Qwen3.5's tiny's places, latent attention
    # (absorbed, low-rank queries, 8 interleaved RoPE dims, values 24 wide, a gate per head)
    # in layers 3 and 7 of 8; from layer 1 on 2 of 4 experts (sigmoid, 2 groups of which 1
    # taken, a random expert bias, scaled by 2.5) beside a shared expert
    "bailing_moe_v3": {"architectures": ["BailingMoeV3ForCausalLM"], **_MLA,
                       "num_hidden_layers": 8, "layer_group_size": 4, "q_lora_rank": 32,
                       "num_experts": 4, "num_shared_experts": 1,
                       "moe_shared_expert_intermediate_size": 32, "n_group": 2, "topk_group": 1,
                       "routed_scaling_factor": 2.5, "short_conv_kernel_size": 4},
    # OLMo Hybrid: Gated DeltaNet layers (recurrent, pre-norms) in Qwen3.5's tiny's places,
    # OLMo 3's post-norm attention (q/k norms over all heads) in layers 3 and 7 of 8
    "olmo_hybrid": {"architectures": ["OlmoHybridForCausalLM"], "tie_word_embeddings": False,
                    "num_hidden_layers": 8, "linear_num_value_heads": 4,
                    "linear_num_key_heads": 2, "linear_key_head_dim": 16,
                    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                    "linear_allow_neg_eigval": True, "attention_bias": False},
    # Kimi Linear: Kimi Delta Attention (recurrent) in Qwen3.5's tiny's places, latent
    # attention (absorbed, no RoPE, a plain q_proj, values 24 wide) in layers 3 and 7 of 8;
    # from layer 1 on 2 of 4 experts (sigmoid, 2 groups of which 1 taken, a random
    # correction bias, scaled by 2.5) beside a shared expert
    "kimi_linear": {"architectures": ["KimiLinearForCausalLM"], **_MLA, "num_hidden_layers": 8,
                    "linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7], "num_heads": 2,
                                           "head_dim": 32, "short_conv_kernel_size": 4},
                    "model_max_length": 4096, "num_experts": 4, "num_experts_per_token": 2,
                    "num_shared_experts": 1, "num_expert_group": 2, "topk_group": 1,
                    "routed_scaling_factor": 2.5, "mla_use_nope": True},
    # Kimi K3: Kimi Linear's layout with low-rank queries and a sigmoid output gate in its
    # latent attention, SiTU MLPs, the experts on a 32-wide latent (normed) and attention
    # residuals: blocks of 3 layers (starting at 0, 3, 6), each layer's input a softmax mix of
    # the blocks' inputs and its own
    "kimi_k3": {"architectures": ["KimiK3ForCausalLM"], **_MLA, "num_hidden_layers": 8,
                "linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7], "num_heads": 2,
                                       "head_dim": 32, "short_conv_kernel_size": 4},
                "q_lora_rank": 32, "mla_use_output_gate": True, "num_experts": 4,
                "num_experts_per_token": 2, "num_shared_experts": 1, "num_expert_group": 2,
                "topk_group": 1, "routed_scaling_factor": 2.5, "routed_expert_hidden_size": 32,
                "latent_moe_use_norm": True, "hidden_act": "situ", "activation_situ_beta": 2.0,
                "activation_situ_linear_beta": 3.0, "attn_res_block_size": 3},
    # LongCat-Flash: 2 blocks of two latent attentions (absorbed, low-rank queries, queries and
    # latent scaled) and two MLPs each, the first MLP's input also through 2 of 4 experts and 2
    # identity ("zero") experts, softmax-routed, scaled by 2.5, added after the second MLP
    "longcat_flash": {"architectures": ["LongcatFlashForCausalLM"], **_MLA, "num_layers": 2,
                      "q_lora_rank": 32, "ffn_hidden_size": 128, "expert_ffn_hidden_size": 32,
                      "moe_topk": 2, "zero_expert_num": 2, "zero_expert_type": "identity",
                      "attention_method": "MLA", "mla_scale_q_lora": True,
                      "mla_scale_kv_lora": True, "attention_bias": False,
                      "routed_scaling_factor": 2.5},
    # Phi-3-small: block-sparse attention in layers 0 and 2 (blocks of 32, 2 local, every third
    # earlier block by head: 300 tokens span 10 blocks), dense in 1 and 3; a GeGELU clipped at 2
    # (20 in the real one), muP multipliers; its vocabulary as wide as the real one's, whose
    # last ids mlx-lm's head masks
    "phi3small": {"architectures": ["Phi3SmallForCausalLM"], "dense_attention_every_n_layers": 2,
                  "ff_intermediate_size": 64, "gegelu_limit": 2.0, "layer_norm_epsilon": 1e-5,
                  "vocab_size": 100352, "mup_attn_multiplier": 2.0,
                  "mup_embedding_multiplier": 10.0, "mup_width_multiplier": 8.0,
                  "rope_embedding_base": 1000000, "blocksparse_block_size": 32,
                  "blocksparse_num_local_blocks": 2, "blocksparse_vert_stride": 3},
    # Hunyuan: q/k norms after RoPE (NTK alpha-scaled base), layers 1 and 3 reading the keys
    # and values of 0 and 2 (CLA); 2 of 4 experts (softmax) beside a shared MLP; tied head
    "hunyuan": {"architectures": ["HunYuanMoEV1ForCausalLM"], "tie_word_embeddings": True,
                "attention_bias": True, "moe_topk": 2, "num_experts": 4, "num_shared_expert": 1,
                "use_mixed_mlp_moe": True, "use_qk_norm": True, "use_cla": True,
                "cla_share_factor": 2, "moe_intermediate_size": 32,
                "rope_scaling": {"alpha": 1000.0, "factor": 1.0, "type": "dynamic"}},
    # mlx-lm's llama4_text: dense, a weight-free q/k norm, no RoPE in layer 3
    "llama4_text": {"architectures": ["Llama4ForCausalLM"], "tie_word_embeddings": False,
                    "intermediate_size_mlp": 128, "no_rope_layers": [1, 1, 1, 0],
                    "use_qk_norm": True},
    # EXAONE 3.5: Llama's layout under other names (transformer.wte, h, ln_1/ln_2, attn.attention
    # with out_proj, c_fc_0/c_fc_1/c_proj, ln_f), biases here, a tied head
    "exaone": {"architectures": ["ExaoneForCausalLM"], "num_layers": 4,
               "layer_norm_epsilon": 1e-5, "attention_bias": True, "mlp_bias": True,
               "tie_word_embeddings": True},
    # Hunyuan dense: per-head q/k norms after RoPE, NTK-alpha RoPE (alpha 1000 as the 7B's),
    # q/k/v/o biases, a tied head
    "hunyuan_v1_dense": {"architectures": ["HunYuanDenseV1ForCausalLM"], "use_qk_norm": True,
                         "attention_bias": True, "tie_word_embeddings": True,
                         "rope_scaling": {"alpha": 1000.0, "factor": 1.0, "type": "dynamic"}},
    # StableLM 2 1.6B: LayerNorms (random biases), q/k/v biases, RoPE over a quarter of each
    # head; head_dim is hidden_size / heads (16)
    "stablelm": {"architectures": ["StableLmForCausalLM"], "use_qkv_bias": True,
                 "partial_rotary_factor": 0.25, "layer_norm_eps": 1e-5},
    # MiniCPM: embeddings times 12, residual branches times 1.4 / sqrt(4), an untied head's
    # logits divided by 64 / 16
    "minicpm": {"architectures": ["MiniCPMForCausalLM"], "tie_word_embeddings": False,
                "scale_emb": 12.0, "scale_depth": 1.4, "dim_model_base": 16},
    # Xiaomi MiMo: Qwen2's layout (q/k/v biases); its checkpoint's MTP layer weights, which
    # mlx-lm drops, are written too
    "mimo": {"architectures": ["MiMoForCausalLM"], "tie_word_embeddings": False,
             "num_nextn_predict_layers": 1},
    # nanochat: weightless norms, q/k norms after RoPE of negated frequencies, ReLU^2 MLP; its
    # head's weights scaled up so that the soft-cap at 15 bends the logits
    "nanochat": {"architectures": ["NanoChatForCausalLM"]},
    # Gemma 1: Gemma's (1 + w) norms (random w), embeddings times sqrt(64), an exact-GELU MLP,
    # heads 32 wide (head_dim, not hidden / heads), a tied head
    "gemma": {"architectures": ["GemmaForCausalLM"], "head_dim": 32},
    # Command R+: cohere2's parallel layers on one LayerNorm (no bias, random weights) without
    # windows, traditional RoPE everywhere, per-head q/k LayerNorms (random), q/k/v/o biases,
    # logits times 0.3
    "cohere": {"architectures": ["CohereForCausalLM"], "use_qk_norm": True, "logit_scale": 0.3,
               "attention_bias": True, "layer_norm_eps": 1e-5},
    # Phi-2: q/k/v, dense, fc1/fc2 and head biases, RoPE over 6 of 16 head dims (0.4), one
    # random LayerNorm per layer; grouped heads (2 key/value heads) as mlx-lm allows
    "phi": {"architectures": ["PhiForCausalLM"], "partial_rotary_factor": 0.4,
            "layer_norm_eps": 1e-5},
    # Pythia: fused per-head query_key_value, RoPE over a quarter of each head, random
    # LayerNorms, attention and the MLP in parallel (each its own norm); its MLP 4 x hidden
    "gpt_neox": {"architectures": ["GPTNeoXForCausalLM"], "num_key_value_heads": 4,
                 "rotary_pct": 0.25, "rotary_emb_base": 10000, "layer_norm_eps": 1e-5,
                 "use_parallel_residual": True, "tie_word_embeddings": False,
                 "intermediate_size": 256},
    # InternLM2.5: one wqkv (biased, as wo) holding each key/value head's 2 queries, key and
    # value; dynamic NTK RoPE (plain below max_position_embeddings); an untied head ``output``
    "internlm2": {"architectures": ["InternLM2ForCausalLM"], "bias": True,
                  "tie_word_embeddings": False, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
    # Qwen 1: GPT-2's names, fused c_attn, no GQA (mlx-lm reads no num_key_value_heads), an
    # MLP half intermediate_size wide (w2 the gate); biases everywhere, the head's too
    "qwen": {"architectures": ["QWenLMHeadModel"], "num_key_value_heads": 4, "kv_channels": 16,
             "layer_norm_epsilon": 1e-6, "no_bias": False},
    # GPT-2: learned positions (1,024; random), fused c_attn, LayerNorms and every projection
    # with random biases, a tied head; its config's own names (Llama's, unread by mlx-lm, say
    # the same for the GGUF tests)
    "gpt2": {"architectures": ["GPT2LMHeadModel"], "n_ctx": 1024, "n_embd": 64, "n_head": 4,
             "n_layer": 4, "n_positions": 1024, "layer_norm_epsilon": 1e-5,
             "num_key_value_heads": 4, "intermediate_size": 256, "max_position_embeddings": 1024},
    # StarCoder 1 / SantaCoder: GPT-2's layout with multi-query attention (one key/value
    # head), an exact-GELU MLP 128 wide, an untied head
    "gpt_bigcode": {"architectures": ["GPTBigCodeForCausalLM"], "n_embd": 64, "n_head": 4,
                    "n_layer": 4, "n_inner": 128, "n_positions": 1024,
                    "layer_norm_epsilon": 1e-5, "multi_query": True, "num_key_value_heads": 1,
                    "tie_word_embeddings": False, "max_position_embeddings": 1024},
    # Nemotron: (1 + w) LayerNorms with biases (both random), q/k/v/o and MLP biases, RoPE over
    # half of each head (its default), a squared-ReLU MLP, an untied head
    "nemotron": {"architectures": ["NemotronForCausalLM"], "hidden_act": "relu2",
                 "norm_eps": 1e-5, "attention_bias": True, "mlp_bias": True,
                 "partial_rotary_factor": 0.5},
    # OpenELM: 2, 4, 4 and 6 query heads over 1, 2, 2 and 3 key/value heads, MLPs 32, 64, 96
    # and 128 wide, per-head q/k norms (random), a tied head
    "openelm": {"architectures": ["OpenELMForCausalLM"], "model_dim": 64,
                "num_transformer_layers": 4, "num_query_heads": [2, 4, 4, 6],
                "num_kv_heads": [1, 2, 2, 3], "ffn_multipliers": [0.5, 1.0, 1.5, 2.0],
                "ffn_dim_divisor": 16, "share_input_output_layers": True},
    # DeepSeek-MoE: Llama's attention; layer 0 dense, then 2 of 4 experts (softmax over all,
    # not renormalised) beside a shared expert
    "deepseek": {"architectures": ["DeepseekForCausalLM"], "tie_word_embeddings": False,
                 "first_k_dense_replace": 1, "moe_layer_freq": 1, "moe_intermediate_size": 32,
                 "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2},
    # Nanbeige: Llama's layout (biases here) whose 2 blocks run twice (num_loops), the final
    # (random) norm also between the loops: 4 layers to the engine
    "nanbeige": {"architectures": ["NanbeigeForCausalLM"], "tie_word_embeddings": False,
                 "num_hidden_layers": 2, "num_loops": 2, "attention_bias": True},
    # PLaMo 3: fused q/k/v, per-head q/k norms, Gemma 2's four norms (random offsets from
    # mlx-lm's), layers 0 and 2 sliding (RoPE base 10000) over a window wider than the tests'
    # prompts, 1 and 3 global (base 1e6); plamo3-window's window is 24
    "plamo3": {"architectures": ["Plamo3ForCausalLM"], "sliding_window_pattern": 2,
               "window_size": 512, "rope_theta": 1e6, "rope_local_theta": 10000.0},
    # Laguna: 4, 8, 4 and 8 query heads over 2 key/value heads, per-head q/k norms, a softplus
    # gain per head; layers 0 and 2 slide over 24 positions (RoPE base 10000 over whole heads), 1
    # and 3 are global (YaRN at base 500000 over half of each head); layer 0 dense, then 2 of 4
    # experts (sigmoid, a random correction bias, scaled by 2.5) beside a shared expert
    "laguna": {"architectures": ["LagunaForCausalLM"], "tie_word_embeddings": False,
               "num_attention_heads_per_layer": [4, 8, 4, 8], "sliding_window": 24,
               "layer_types": ["sliding_attention", "full_attention"] * 2,
               "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
               "shared_expert_intermediate_size": 32, "moe_routed_scaling_factor": 2.5,
               "rope_parameters": {
                   "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 64,
                                      "partial_rotary_factor": 0.5},
                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # Talkie: weightless norms, RoPE of negated frequencies, 4 heads (no grouping); its gains
    # (per query head, on each branch, on the embeddings added back, on the head) random
    "talkie": {"architectures": ["TalkieForCausalLM"], "rope_theta": 10000.0},
    # Mellum: per-head q/k norms; layers 0 and 2 slide over a 24-position window (RoPE base
    # 10000), 1 and 3 are global (base 500000); 2 of 4 experts (renormalised) in every layer
    "mellum": {"architectures": ["MellumForCausalLM"], "tie_word_embeddings": False,
               "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
               "norm_topk_prob": True, "sliding_window": 24,
               "layer_types": ["sliding_attention", "full_attention"] * 2,
               "rope_parameters": {
                   "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # K-EXAONE: per-head q/k norms; layers 0 and 2 slide over a 24-position window with RoPE,
    # 1 and 3 are global without; layer 0 dense, then 2 of 4 experts (sigmoid, 2 groups of
    # which 1 taken, a random correction bias, scaled by 2.5) beside a shared expert
    "exaone_moe": {"architectures": ["ExaoneMoEForCausalLM"], "tie_word_embeddings": False,
                   "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                   "num_shared_experts": 1, "n_group": 2, "topk_group": 1,
                   "routed_scaling_factor": 2.5, "norm_topk_prob": True, "sliding_window": 24,
                   "is_moe_layer": [False, True, True, True],
                   "layer_types": ["sliding_attention", "full_attention"] * 2},
    # Klear: per-head q/k norms, q/k/v/o biases; layers 1 and 3 with 2 of 4 experts (sigmoid,
    # a random expert bias, renormalised) mixed with a shared expert by a learned coefficient
    "Klear": {"architectures": ["KlearForCausalLM"], "attention_bias": True,
              "mlp_only_layers": [], "decoder_sparse_step": 2, "num_experts": 4,
              "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 32,
              "norm_topk_prob": True},
    # AFM (afmoe): embeddings times sqrt(hidden), per-head q/k norms, a sigmoid output gate
    # per head dim (gate_proj), norms before and after each branch; layers 0 and 2 slide over
    # a 24-position window with RoPE, 1 and 3 are global without; layer 0 dense, then 2 of 4
    # experts (sigmoid, a random expert bias, scaled) beside a shared expert
    "afmoe": {"architectures": ["AfmoeForCausalLM"], "tie_word_embeddings": False,
              "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
              "num_shared_experts": 1, "num_dense_layers": 1, "route_scale": 2.826,
              "route_norm": True,
              "sliding_window": 24, "mup_enabled": True,
              "layer_types": ["sliding_attention", "full_attention"] * 2},
    # MiniCPM3: DeepSeek-V2's latent attention (per head, 4 heads over a 32-wide latent, 8
    # RoPE dims, values hidden / heads = 16 wide), low-rank queries, longrope's SuScaledRoPE
    # (its scale above 1: 4096 positions of 1024), MiniCPM's multipliers, an untied head
    "minicpm3": {"architectures": ["MiniCPM3ForCausalLM"], "tie_word_embeddings": False,
                 "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
                 "qk_nope_head_dim": 32, "qk_rope_head_dim": 8, "scale_emb": 12.0,
                 "scale_depth": 1.4, "dim_model_base": 16, "rope_scaling": {
                     "type": "longrope", "original_max_position_embeddings": 1024,
                     "short_factor": [1.0] * 4, "long_factor": [1.0, 1.5, 2.0, 4.0]}},
    # Youtu-LLM: the same latent attention, values 24 wide, traditional RoPE, biases on the
    # attention's and the MLP's projections, a tied head
    "youtu_llm": {"architectures": ["YoutuForCausalLM"], "tie_word_embeddings": True,
                  "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
                  "qk_nope_head_dim": 32, "qk_rope_head_dim": 8, "v_head_dim": 24,
                  "attention_bias": True, "mlp_bias": True},
    # GLM-4-9B (mlx-lm's glm): q/k/v biases, traditional RoPE over each whole head, a fused
    # gate_up_proj, a tied head
    "glm": {"architectures": ["GlmForCausalLM"], "tie_word_embeddings": True,
            "attention_bias": True},
    # TeleChat 3: biases on q/k/v, o_proj and the MLP, an untied head
    "telechat3": {"architectures": ["Telechat3ForCausalLM"], "tie_word_embeddings": False,
                  "attention_bias": True, "mlp_bias": True},
    # Solar Open: glm4_moe's model without q/k norms or biases, RoPE over every head dim, MoE
    # in every layer (2 of 4 experts, one group, sigmoid routing) beside a shared expert
    "solar_open": {"architectures": ["SolarOpenForCausalLM"], "tie_word_embeddings": False,
                   "moe_intermediate_size": 32, "norm_topk_prob": True, "n_group": 1,
                   "topk_group": 1, "n_shared_experts": 1, "n_routed_experts": 4,
                   "routed_scaling_factor": 1.0, "num_experts_per_tok": 2,
                   "first_k_dense_replace": 0, "partial_rotary_factor": 1.0},
    # GPT-J: attention and a plain GELU MLP (4 x hidden) in parallel on one random LayerNorm,
    # traditional RoPE over 6 of 16 head dims, no GQA, biases on the MLP and the head
    "gptj": {"architectures": ["GPTJForCausalLM"], "n_embd": 64, "n_head": 4, "n_layer": 4,
             "rotary_dim": 6, "n_positions": 2048, "layer_norm_epsilon": 1e-5},
    # DBRX: a fused Wqkv clipped at 0.5 (two fifths of these random q/k/v), 2 key/value
    # heads, LayerNorms without biases, 2 of 4 experts (softmax, renormalised) in every layer
    "dbrx": {"architectures": ["DbrxForCausalLM"], "d_model": 64, "n_heads": 4, "n_layers": 4,
             "attn_config": {"kv_n_heads": 2, "clip_qkv": 0.5, "rope_theta": 10000.0},
             "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}},
    # Phixtral: Phi-2's parallel layers (one random LayerNorm, a fused biased Wqkv, RoPE over 6
    # of 16 head dims) with 2 of 4 biased GELU experts (4 x hidden) in every layer
    "phixtral": {"architectures": ["PhiForCausalLM"], "num_vocab": VOCAB_SIZE, "model_dim": 64,
                 "num_heads": 4, "num_layers": 4, "rotary_dim": 6, "num_local_experts": 4,
                 "num_experts_per_tok": 2},
    # MiniMax-M2: q/k norms over the whole projection, RoPE over 8 of 16 head dims; 2 of 4
    # experts in every layer (sigmoid, a random correction bias, renormalised)
    "minimax": {"architectures": ["MiniMaxM2ForCausalLM"], "tie_word_embeddings": False,
                "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                "shared_intermediate_size": 0, "rotary_dim": 8, "use_qk_norm": True},
    # MiMo-V2-Flash: layers 0 and 2 slide over a 24-position window (4 heads of 24 over 1
    # key/value head, values 16 wide, random sinks, RoPE base 10000), 1 and 3 are global (4
    # heads of 16 over 2, values 8 wide, no sinks, base 500000), RoPE over half of each head,
    # values times 0.707; layer 0 dense, then 2 of 4 experts (sigmoid, 2 groups of which 1
    # taken, a random correction bias, scaled by 2.5) beside a shared expert
    "mimo_v2_flash": {"architectures": ["MiMoV2FlashForCausalLM"], "num_experts_per_tok": 2,
                      "hybrid_layer_pattern": [1, 0, 1, 0], "moe_layer_freq": [0, 1, 1, 1],
                      "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
                      "sliding_window_size": 24, "moe_intermediate_size": 32,
                      "n_shared_experts": 1, "n_routed_experts": 4, "routed_scaling_factor": 2.5,
                      "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
                      "n_group": 2, "topk_group": 1, "layernorm_epsilon": 1e-5,
                      "rope_theta": 500000.0, "swa_rope_theta": 10000.0,
                      "swa_num_attention_heads": 4, "swa_num_key_value_heads": 1,
                      "v_head_dim": 8, "swa_head_dim": 24, "swa_v_head_dim": 16,
                      "partial_rotary_factor": 0.5, "attention_value_scale": 0.707},
    # Step-3.5: layers 0 and 2 slide over a 24-position window (8 heads over 2 key/value
    # heads, RoPE base 10000 over every head dim), 1 and 3 are global (4 over 2, base 500000
    # over half of each head, Llama 3's scaling from position 64 on); per-head q/k norms and
    # output gates; layer 0 dense, then 2 of 4 experts (sigmoid, a random router bias,
    # renormalised, times 3) beside a shared expert; SwiGLU clamped at 0.2 in the dense MLP,
    # the experts of layers 1 and 2 and the shared experts of 1 and 3
    "step3p5": {"architectures": ["Step3p5ForCausalLM"], "tie_word_embeddings": False,
                "num_attention_groups": 2, "sliding_window": 24,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
                "attention_other_setting": {"num_attention_heads": 8, "num_attention_groups": 2},
                "rope_theta": [10000.0, 500000.0] * 2, "partial_rotary_factors": [1.0, 0.5] * 2,
                "yarn_only_types": ["full_attention"], "rope_scaling": {
                    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                "moe_num_experts": 4, "moe_top_k": 2, "moe_intermediate_size": 32,
                "share_expert_dim": 32, "moe_layers_enum": "1,2,3",
                "moe_router_scaling_factor": 3.0, "swiglu_limits": [0, 0.2, 0.2, 0],
                "swiglu_limits_shared": [0.2, 0.2, 0, 0.2]},
    # Muse Glimmer: (1 + w) norms around each branch (random w), weight-free norms on the
    # embeddings and q/k (queries times 3.87), a sigmoid output gate; layers 0 and 2 slide over
    # 24 positions with RoPE, 1 and 3 are global without; logits times 4 (up to 8 here),
    # soft-capped at 20
    "muse_glimmer": {"architectures": ["MuseGlimmerForCausalLM"], "sliding_window": 24,
                     "layer_types": ["sliding_attention", "full_attention"] * 2,
                     "output_multiplier": 4.0, "final_logit_softcapping": 20.0},
    # Spark 2.5: a fused q/k/v, a sigmoid gate per head; layers 0 and 2 slide over 24 positions
    # (RoPE base 10000), 1 and 3 are global (base 500000 over half of each head); an exact-GELU
    # gated MLP; the head tied
    "spark2_5": {"architectures": ["Spark2_5ForCausalLM"], "sliding_window": 24,
                 "layer_types": ["sliding_attention", "full_attention"] * 2,
                 "rope_parameters": {
                     "full_attention": {"rope_theta": 500000.0, "partial_rotary_factor": 0.5},
                     "sliding_attention": {"rope_theta": 10000.0}}},
    # IQuest-Loop-Coder: 2 blocks run twice (4 engine layers); the second loop's own keys in a
    # 24-position window, mixed with the first loop's by a random gate per head
    "iquestloopcoder": {"architectures": ["IQuestLoopCoderForCausalLM"], "num_hidden_layers": 2,
                        "loop_num": 2, "loop_window_size": 24},
}
#: Variants of a kind: ``llama-llama3``, Llama 3.1/3.2's RoPE scaling (mlx-lm's Llama3RoPE);
#: ``phi3-longrope``, phi3 with longrope scaling (mlx-lm's SuScaledRoPE
#: with per-frequency factors) over three quarters of each head (partial rotary);
#: ``ministral3-sliding``, whose layers 0 and 2 slide over a 24-position window;
#: ``exaone4-global``, EXAONE 4 without a pattern: every layer global, with RoPE;
#: ``gemma4_text-moe``, Gemma 4's 26B A4B layout: 2 of 4 experts beside each dense MLP;
#: ``gemma4_text-e2b``, its E2B/E4B layout: layers 2 and 3 read the keys and values of 0
#: and 1 (their MLPs twice as wide), every layer takes a 32-wide per-token input;
#: ``qwen3_5-moe``, Qwen3.5's MoE layout (``qwen3_5_moe``): 2 of 4 experts and a shared one;
#: ``qwen3_5-deep``, 16 layers (attention in 3, 7, 11, 15); ``qwen3_5-last``, 4 layers, only
#: the last attending; ``stablelm-parallel``, StableLM 2 12B's layout: per-head q/k
#: LayerNorms, attention and the MLP in parallel on one norm; ``gpt_neox-sequential``, GPT-NeoX
#: with attention, then the MLP (``use_parallel_residual`` false); ``nanbeige-skip``, Nanbeige
#: with ``skip_loop_final_norm``: no norm between its loops.
_VARIANTS = {
    # Ring-linear: Ling's tiny (q/k norms, biases, partial RoPE, its experts from layer 1 on)
    # with lightning attention (recurrent; its output norm in groups of 2 heads) in Qwen3.5's
    # tiny's places, attention in layers 3 and 7 of 8
    "bailing_moe_linear": ("bailing_moe", {
        "model_type": "bailing_moe_linear", "architectures": ["BailingMoeLinearV2ForCausalLM"],
        "num_hidden_layers": 8, "layer_group_size": 4, "group_norm_size": 2}),
    # Ling 2.5 linear: Ling 2.5's tiny (latent attention in layers 3 and 7 of 8, its experts)
    # with lightning attention (RoPE over half of each head) for Kimi Delta Attention
    "bailing_hybrid": ("bailing_moe_v3", {
        "model_type": "bailing_hybrid", "architectures": ["BailingMoeV2_5ForCausalLM"],
        "group_norm_size": 2}),
    # The MLA kinds as the conversion tests write them in llama.cpp's deepseek2 GGUF, which holds
    # one YaRN log multiplier (mscale = mscale_all_dim) and no renormalised softmax routing:
    # 16 RoPE dims, values as wide as the unrotated dims (GLM-4.7-Flash's wider), V2's two shared
    # experts scaled by 1.5, V3's 8 experts, the RMS epsilon 1e-6 that deepseek_v2/v3 hard-wire
    "deepseek_v2-gguf": ("deepseek_v2", {
        "qk_rope_head_dim": 16, "v_head_dim": 32, "rms_norm_eps": 1e-6, "scoring_func": "softmax",
        "norm_topk_prob": False, "n_shared_experts": 2, "routed_scaling_factor": 1.5,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                         "mscale_all_dim": 0.707}}),
    "deepseek_v3-gguf": ("deepseek_v3", {
        "qk_rope_head_dim": 16, "v_head_dim": 32, "rms_norm_eps": 1e-6, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "n_routed_experts": 8,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}),
    # Mistral Small 4 as llama.cpp converts it: no attention temperature (its converter writes
    # none), YaRN over an original context of 64
    "mistral4-gguf": ("mistral4", {
        "qk_rope_head_dim": 16, "v_head_dim": 32, "rms_norm_eps": 1e-6, "n_routed_experts": 8,
        "rope_parameters": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "llama_4_scaling_beta": 0.0, "rope_theta": 10000.0}}),
    # DeepSeek-V3.2: DeepSeek-V3's with a lightning indexer (16 heads 16 wide, RoPE over the
    # first 8 of them) letting each query see its top 24 keys; GLM-5's its model with the
    # indexer's RoPE traditional (interleaved), no RoPE scaling. (With 4 heads many scores are
    # exactly 0, every head's ReLU'd: ties at the top-k's edge, which argpartition breaks by
    # order; keys within float rounding of the edge differ from mlx-lm's at 16 on the tests'
    # prompts, at 24 at none.)
    "deepseek_v32": ("deepseek_v3", {"model_type": "deepseek_v32",
                                     "architectures": ["DeepseekV32ForCausalLM"],
                                     "index_n_heads": 16, "index_head_dim": 16, "index_topk": 24}),
    "glm_moe_dsa": ("deepseek_v32", {"model_type": "glm_moe_dsa",
                                     "architectures": ["GlmMoeDsaForCausalLM"],
                                     "rope_parameters": {"rope_theta": 10000.0,
                                                         "rope_type": "default"},
                                     "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                                     "moe_layer_freq": 1, "attention_bias": False,
                                     "indexer_rope_interleave": True}),
    # DeepSeek-V3.2 and GLM-5 as the conversion tests write them in llama.cpp's deepseek32 and
    # glm-dsa GGUFs: DeepSeek-V3's (YaRN; GLM-5 without) with each query's top 8 keys (TEXT
    # longer), 16 RoPE dims of 16-wide indexer heads
    "deepseek_v32-gguf": ("deepseek_v3-gguf", {"model_type": "deepseek_v32",
                                               "architectures": ["DeepseekV32ForCausalLM"],
                                               "index_n_heads": 16, "index_head_dim": 16,
                                               "index_topk": 8}),
    "glm_moe_dsa-gguf": ("deepseek_v32-gguf", {
        "model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"],
        "rope_scaling": None, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "moe_layer_freq": 1, "attention_bias": False, "indexer_rope_interleave": True}),
    "glm4_moe_lite-gguf": ("glm4_moe_lite", {
        "qk_rope_head_dim": 16, "v_head_dim": 64, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "rope_theta": 1e6, "num_nextn_predict_layers": 0}),
    # its original context short: every band (unscaled, smoothed, scaled) in a tiny head
    "llama-llama3": ("llama", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "qwen3_5-deep": ("qwen3_5", {"num_hidden_layers": 16}),
    # LongCat-Flash's blocks after an n-gram embedding: 2- to 4-grams, each split 4 ways (12
    # tables 5 wide of about 3,000 rows)
    "longcat_flash_ngram": ("longcat_flash", {"model_type": "longcat_flash_ngram",
                                              "architectures": ["LongcatFlashNgramForCausalLM"],
                                              "ngram_vocab_size_ratio": 8,
                                              "emb_neighbor_num": 4, "emb_split_num": 4}),
    # a width a 512-wide Hadamard block divides (the packed checkpoint's base)
    "qwen3_5-wide": ("qwen3_5", {"hidden_size": 512}),
    "qwen3_5-last": ("qwen3_5", {"num_hidden_layers": 4}),
    # no attention layer at all (mlx-lazy refuses it)
    "granitemoehybrid-mamba": ("granitemoehybrid", {"num_hidden_layers": 2,
                                                    "layer_types": ["mamba"] * 2}),
    # Granite 4.0 Micro's layout: every layer attention, with RoPE; a dense MLP
    "granitemoehybrid-micro": ("granitemoehybrid", {
        "num_hidden_layers": 4, "layer_types": ["attention"] * 4, "num_local_experts": 0,
        "intermediate_size": 128, "position_embedding_type": "rope"}),
    # Qwen2-VL's config.json: the text model's settings at the top (mlx-lm's qwen2_vl wraps them),
    # its M-RoPE (plain RoPE in mlx-lm)
    "qwen2_vl": ("qwen2", {"model_type": "qwen2_vl",
                           "architectures": ["Qwen2VLForConditionalGeneration"],
                           "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}),
    # Kimi K3 without attention residuals, output gate or low-rank queries
    "kimi_k3-plain": ("kimi_k3", {"attn_res_block_size": None, "mla_use_output_gate": False,
                                  "q_lora_rank": None}),
    "qwen3_5-moe": ("qwen3_5", {"model_type": "qwen3_5_moe",
                                "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                                "num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32,
                                "shared_expert_intermediate_size": 32}),
    "gemma4_text-e2b": ("gemma4_text", {"num_kv_shared_layers": 2, "use_double_wide_mlp": True,
                                        "hidden_size_per_layer_input": 32,
                                        "vocab_size_per_layer_input": VOCAB_SIZE,
                                        "attention_k_eq_v": False}),
    "gemma4_text-moe": ("gemma4_text", {"enable_moe_block": True, "num_experts": 4,
                                        "top_k_experts": 2, "moe_intermediate_size": 32}),
    "exaone4-global": ("exaone4", {"sliding_window": None, "sliding_window_pattern": None,
                                   "layer_types": ["full_attention"] * 4}),
    "ministral3-sliding": ("ministral3", {
        "sliding_window": 24,
        "layer_types": ["sliding_attention", "full_attention"] * 2}),
    "nanbeige-skip": ("nanbeige", {"skip_loop_final_norm": True}),
    "stablelm-parallel": ("stablelm", {"use_parallel_residual": True, "qk_layernorm": True}),
    "gpt_neox-sequential": ("gpt_neox", {"use_parallel_residual": False}),
    "plamo3-window": ("plamo3", {"window_size": 24}),
    "phi3-longrope": ("phi3", {
        "partial_rotary_factor": 0.75, "original_max_position_embeddings": 1024,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 6,
                         "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0]}}),
}


# kinds whose norms (weights and LayerNorm biases) are random rather than ones and zeros
#: Checkpoints of a tiny text model in a vision-language (or Gemma 4's) checkpoint, as mlx-lm's
#: wrappers hold it (``model.language_model``): kind -> (the text model's kind, the checkpoint's
#: architecture, the ``model_type`` its ``text_config`` names, as the real ones do)
_WRAPPED = {"gemma4": ("gemma4_text", "Gemma4ForConditionalGeneration", "gemma4_text"),
            "qwen2_5_vl": ("qwen2", "Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl_text"),
            "qwen3_vl": ("qwen3", "Qwen3VLForConditionalGeneration", "qwen3_vl_text"),
            "qwen3_vl_moe": ("qwen3_moe", "Qwen3VLMoeForConditionalGeneration",
                             "qwen3_vl_moe_text"),
            "lfm2-vl": ("lfm2", "Lfm2VlForConditionalGeneration", "lfm2"),
            "kimi_vl": ("deepseek_v3", "KimiVLForConditionalGeneration", "deepseek_v3"),
            "kimi_k25": ("deepseek_v3", "KimiK25ForConditionalGeneration", "kimi_k2"),
            "pixtral": ("llama", "LlavaForConditionalGeneration", "mistral")}
_RANDOM_NORMS = ("glm4", "starcoder2", "cohere2", "apertus", "step3p5", "lille-130m")
# kinds whose every norm module's weight (the final norm's, per-head ones) is random
_RANDOM_NORM_MODULES = ("exaone", "hunyuan_v1_dense", "stablelm", "minicpm", "mimo", "cohere",
                        "phi", "gpt_neox", "internlm2", "qwen", "gpt2", "gpt_bigcode", "nemotron",
                        "openelm", "nanbeige", "minicpm3", "youtu_llm", "granitemoehybrid",
                        "nemotron_h", "glm", "telechat3", "solar_open", "jamba", "exaone_moe",
                        "Klear", "afmoe", "gptj", "dbrx", "phixtral", "minimax", "mimo_v2_flash",
                        "nemotron-nas", "laguna", "bailing_moe_v3", "falcon_h1", "plamo",
                        "bitnet", "deepseek_v32", "glm_moe_dsa", "olmo_hybrid", "kimi_linear",
                        "bailing_moe_linear", "bailing_hybrid", "gemma3n", "muse_glimmer",
                        "spark2_5", "iquestloopcoder", "phi3small", "muse_spark", "kimi_k3")


def bitlinear_matmul(self: BitLinear, x: mx.array, packed: mx.array) -> mx.array:
    """mlx-lm's BitLinear kernel (Metal only) in plain MLX: output row ``j + i * rows`` of a
    packed weight of ``rows`` rows takes field i (bits 2i, 2i + 1, less one) of row j."""
    fields = [((packed >> (2 * i)) & 3).astype(x.dtype) - 1 for i in range(4)]
    weight = mx.concatenate(fields, axis=0)[:self.out_features]
    scale = 1 / self.weight_scale if self.invert_weight_scales else self.weight_scale
    return (x @ weight.T) * scale


#: Packed checkpoints built from a tiny float one: kind -> its base's kind.
_PACKED = {"prism_hadamard_qwen35": "qwen3_5-wide"}


def _hadamard_modules(layers: int) -> list:
    """The manifest of the tiny ``prism_hadamard_qwen35``: its embedding, head, every MLP's
    gate (a 512-wide Hadamard block) and up and down projections (none), the attention
    layers' q_proj and the recurrent ones' in_proj_qkv (512)."""
    paths = [("model.embed_tokens", 512), ("lm_head", 512)]
    for i in range(layers):
        paths += [(f"model.layers.{i}.mlp.gate_proj", 512), (f"model.layers.{i}.mlp.up_proj", 0),
                  (f"model.layers.{i}.mlp.down_proj", 0),
                  (f"model.layers.{i}." + ("self_attn.q_proj" if i % 4 == 3
                                           else "linear_attn.in_proj_qkv"), 512)]
    return [{"path": path, "embedding": path.endswith("embed_tokens"), "dtype": "float16",
             "block": block} for path, block in paths]


def _pack_hadamard(folder: Path, config: dict) -> None:
    """Rewrite a float checkpoint's modules that ``config``'s manifest names as the Hadamard
    pack holds them: each row times random signs and rotated in its blocks (the rotation its
    input then takes cancels), quantized to 2 bits in groups of 128, with its signs."""
    from mlx_lm.models.prism_hadamard_qwen35 import hadamard_rotate

    weights = mx.load(str(folder / "model.safetensors"))
    for record in config["modules"]:
        key, block = f"language_model.{record['path']}", record["block"]
        weight = weights.pop(f"{key}.weight")
        if block:
            signs = mx.where(mx.random.uniform(shape=weight.shape[-1:]) < 0.5, -1.0, 1.0)
            weight, weights[f"{key}.signs"] = hadamard_rotate(weight, block, signs), signs
        packed, scales, biases = mx.quantize(weight, group_size=128, bits=2)
        weights.update({f"{key}.weight": packed, f"{key}.scales": scales.astype(mx.float16),
                        f"{key}.biases": biases.astype(mx.float16)})
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def tiny_config(kind: str) -> dict:
    """The config.json of a tiny model of ``kind`` (one of KINDS, a variant of one such as
    ``phi3-longrope``, ``mistral3``: a Ministral 3 checkpoint, its text model a tiny
    ``ministral3``, or ``gemma4``: a Gemma 4 checkpoint of a tiny ``gemma4_text``)."""
    if kind in ("mistral3", "mistral3-mistral4"):  # (Mistral Small 4's: a mistral4 inside)
        return {"model_type": "mistral3", "architectures": ["Mistral3ForConditionalGeneration"],
                "text_config": tiny_config("ministral3" if kind == "mistral3" else "mistral4"),
                **{key: _BASE[key] for key in ("bos_token_id", "eos_token_id")}}
    if kind == "llama4":  # Llama 4 Scout's layout: chunks of 24, layer 3 global without RoPE
        # (its queries scaled from position 15 on), top-1 experts in layers 1 and 3
        text = {**_BASE, "model_type": "llama4_text", "attention_bias": False,
                "attention_chunk_size": 24, "interleave_moe_layer_step": 2,
                "intermediate_size": 32, "intermediate_size_mlp": 128, "num_local_experts": 4,
                "num_experts_per_tok": 1, "use_qk_norm": True, "attn_temperature_tuning": True,
                "floor_scale": 16, "attn_scale": 0.1, "rope_scaling": {
                    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}
        return {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
                "text_config": text,
                **{key: _BASE[key] for key in ("bos_token_id", "eos_token_id", "vocab_size")}}
    if kind == "gemma3n":  # Gemma 3n E2B's layout: 4 AltUp streams, LAuReL, 16-wide per-layer
        # inputs (a per-layer vocabulary short of the whole), sparse MLP gates in layers 0 and 1,
        # layers 0 and 2 sliding over 24 positions, layer 3 reading layer 1's keys and values
        text = {**_BASE, "model_type": "gemma3n_text", "num_kv_shared_layers": 1,
                "vocab_size_per_layer_input": 256, "hidden_size_per_layer_input": 16,
                "sliding_window": 24, "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0,
                "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
                "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0], "altup_num_inputs": 4,
                "altup_coef_clip": 120.0, "altup_correct_scale": True, "altup_active_idx": 0,
                "laurel_rank": 8}
        return {"model_type": "gemma3n", "architectures": ["Gemma3nForConditionalGeneration"],
                "text_config": text,
                **{key: _BASE[key] for key in ("bos_token_id", "eos_token_id", "vocab_size")}}
    if kind == "muse_spark":  # Muse Spark's text model: layers 0 and 2 slide over 24 positions
        # with RoPE, 1 and 3 are global without; 2 of 4 experts at a compressed width of 32;
        # logits (and router logits) times 4, soft-capped at 20
        text = {**{key: _BASE[key] for key in ("hidden_size", "num_hidden_layers",
                                               "num_attention_heads", "num_key_value_heads",
                                               "head_dim", "rms_norm_eps", "vocab_size",
                                               "bos_token_id", "eos_token_id")},
                "post_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 10000.0},
                "layer_rope_theta": [10000.0, 0, 10000.0, 0],
                "layer_types": ["sliding_attention", "full_attention"] * 2,
                "sliding_window": 24, "final_logit_softcapping": 20.0,
                "output_multiplier": 4.0, "num_local_experts": 4, "num_experts_per_tok": 2,
                "moe_hidden_size": 32, "moe_intermediate_size": 32,
                # (not 5.47: sharper attention on random weights amplifies float32 differences
                # of summation order past the final bfloat16 rounding, 6e-4 of the logits)
                "qk_scale_factor": 1.0,
                "mlp_layer_types": ["sparse"] * 4}
        return {"model_type": kind, "architectures": ["MuseSparkForConditionalGeneration"],
                "text_config": text, "audio_config": {"out_hidden_size": 64},  # (transformers')
                **{key: _BASE[key] for key in ("bos_token_id", "eos_token_id")}}
    if kind == "prism_hadamard_qwen35":  # Qwen3.5's text model, Hadamard-packed
        text = tiny_config(_PACKED[kind])
        return {"model_type": kind, "architectures": ["Qwen3_5ForCausalLM"], "text_config": text,
                "schema_version": 1, "tensor_namespace": "mlx-lm-text",
                "gdn_activation_layout": "grouped",
                "quantization": {"bits": 2, "group_size": 128, "mode": "affine"},
                "modules": _hadamard_modules(text["num_hidden_layers"]),
                **{key: _BASE[key] for key in ("bos_token_id", "eos_token_id", "vocab_size")}}
    if kind == "minimax_m3_vl":  # MiniMax-M3's text model: layer 0 dense, then 2 of 4 experts
        # beside a shared one (two experts wide), their layers sparse (as llama.cpp's), keeping
        # 4 blocks of 16 tokens: a prompt of a few hundred tokens is several times the budget
        text = {**_BASE, "intermediate_size": 32, "dense_intermediate_size": 128,
                "shared_intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
                "rotary_dim": 8, "moe_layer_freq": [0, 1, 1, 1],
                "sparse_attention_config": {
                    "sparse_num_index_heads": 2, "sparse_index_dim": 16,
                    "sparse_block_size": 16, "sparse_topk_blocks": 4, "sparse_local_block": 1,
                    "sparse_attention_freq": [0, 1, 1, 1]}}
        return {"model_type": kind, "architectures": ["MiniMaxM3ForConditionalGeneration"],
                "text_config": text,
                **{key: _BASE[key] for key in ("bos_token_id", "eos_token_id", "vocab_size")}}
    if kind in _WRAPPED:
        text, architecture, text_type = _WRAPPED[kind]
        return {"model_type": kind, "architectures": [architecture],
                "text_config": {**tiny_config(text), "model_type": text_type},
                **{key: _BASE[key] for key in ("bos_token_id", "eos_token_id", "vocab_size")}}
    if kind in _VARIANTS:
        base, extra = _VARIANTS[kind]
        return {**tiny_config(base), **extra}
    if kind not in KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; choose from {KINDS}")
    return {"model_type": kind, **_BASE, **_KIND_CONFIG[kind]}


def build_tokenizer(folder: Path) -> None:
    """Train a deterministic byte-level BPE (VOCAB_SIZE tokens) and save it into ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    assert tok.get_vocab_size() <= VOCAB_SIZE
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": _BASE["max_position_embeddings"],
    }, indent=2))


def build_tiny_model(kind: str, folder: str | Path, seed: int = 0) -> Path:
    """Write a tiny random-weight float32 model of ``kind`` into ``folder`` and return it."""
    from mlx_lm.utils import _get_classes, save_config, save_model

    folder = Path(folder)
    if kind in _PACKED:  # built as its float base, then packed
        _pack_hadamard(build_tiny_model(_PACKED[kind], folder, seed), tiny_config(kind))
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    config = tiny_config(kind)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    # Default inits leave biases at zero and norms at one; randomize them so q/k/v bias and
    # q_norm/k_norm actually matter in tests.
    params = tree_map(lambda p: p.astype(mx.float32), model.parameters())
    model.update(params)
    for layer in model.layers:
        # qwen3_5: linear; lfm2: convolution; bailing_moe: attention; exaone, nanochat: attn;
        # granitemoehybrid, jamba: mamba; nemotron_h, plamo2: its one mixer, the MLP or
        # experts too
        attn = (getattr(layer, "self_attn", None) or getattr(layer, "attention", None)
                or getattr(layer, "attn", None) or getattr(layer, "linear_attn", None)
                or getattr(layer, "conv", None) or getattr(layer, "mamba", None)
                or getattr(layer, "norm_attn_norm", None)  # dbrx: its norms' too
                or getattr(layer, "mixer", layer))  # nemotron-nas: the block, where none
        mlp = feed_forward(layer) or attn
        # every projection's bias (attention's, o_proj's, the MLP's and experts'), so that a
        # dropped one shows
        biases = [(name, 0.1 * mx.random.normal(p.shape)) for name, p in
                  tree_flatten(layer.parameters()) if name.endswith(".bias") and "norm" not in name]
        layer.update(tree_unflatten(biases))
        if hasattr(attn, "sinks"):  # gpt_oss: zeros by default
            attn.sinks = mx.random.normal(attn.sinks.shape)
        for hc in ("attn_hc", "ffn_hc"):  # deepseek_v41: zeros mix every token's streams alike
            if hc in layer:
                layer[hc].update({name: 0.1 * mx.random.normal(layer[hc][name].shape)
                                  for name in ("fn", "base")})
        gate = getattr(mlp, "gate", None)
        weight = getattr(gate, "weight", None)
        # glm4_moe's, DeepSeek's routers: zeros route no token apart
        if isinstance(weight, mx.array) and not mx.any(weight).item():
            gate.weight = mx.random.normal(gate.weight.shape)
        if hasattr(gate, "e_score_correction_bias"):
            gate.e_score_correction_bias = 0.1 * mx.random.normal(
                gate.e_score_correction_bias.shape)
        if "expert_bias" in mlp:  # lfm2_moe: zeros by default
            mlp.expert_bias = 0.1 * mx.random.normal(mlp.expert_bias.shape)
        for owner, name in ((mlp, "e_score_correction_bias"), (gate, "router_bias")):
            if owner is not None and name in owner:  # minimax's, step3p5's: zeros by default
                setattr(owner, name, 0.1 * mx.random.normal(owner[name].shape))
        if getattr(attn, "attention_sink_bias", None) is not None:  # mimo_v2_flash: ones
            attn.attention_sink_bias = mx.random.normal(attn.attention_sink_bias.shape)
        if getattr(gate, "expert_bias", None) is not None:  # bailing_moe's
            gate.expert_bias = 0.1 * mx.random.normal(gate.expert_bias.shape)
        if kind == "jamba" and "mamba" in layer:  # log(1..state) in every channel by default
            attn.A_log = attn.A_log + 0.5 * mx.random.normal(attn.A_log.shape)
            attn.D = 1.0 + 0.1 * mx.random.normal(attn.D.shape)
        for name in ("attn_gain", "mlp_gain", "embed_skip"):  # talkie: 0.35 and 0 by default
            if name in layer:
                layer[name].a_g = 0.5 + mx.random.uniform(shape=(1,))
        if "head_gain" in attn:  # talkie: ones by default
            attn.head_gain.head_g = 0.5 + mx.random.uniform(shape=attn.head_gain.head_g.shape)
        if kind == "plamo2":  # offset norms (zeros, the offset's scale) and q/k weights (ones)
            layer.update(tree_unflatten([
                (name, p + 0.1 * mx.random.normal(p.shape))
                for name, p in tree_flatten(layer.parameters()) if "norm" in name
                or name.endswith(("q_weight", "k_weight"))]))
        for name in ("conv_k", "conv_v"):  # baichuan_m1: zeros by default
            if name in attn:
                setattr(attn, name, mx.random.normal(attn[name].shape))
        if getattr(layer, "temporal_block_type", None) == "recurrent":  # zeros by default
            layer.temporal_block.update(tree_unflatten([
                (name, 0.3 * mx.random.normal(p.shape))
                for name, p in tree_flatten(layer.temporal_block.parameters())
                if name in ("conv_1d.weight", "rg_lru.input_gate_weight",
                            "rg_lru.recurrent_gate_weight")]))
        if "altup" in layer:  # gemma3n: zeros by default (no per-layer input would count)
            layer.altup.correct_output_scale = 1.0 + 0.1 * mx.random.normal((layer.hidden_size,))
        if "layer_scalar" in layer:  # gemma4: ones by default
            layer.layer_scalar = 0.5 + mx.random.uniform(shape=layer.layer_scalar.shape)
        for name in ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm",
                     "key_layernorm"):
            norm = getattr(attn, name, None)
            if norm is not None and "weight" in norm:  # (StableLM's: a LayerNorm per head)
                norm.weight = 1.0 + 0.1 * mx.random.normal(norm.weight.shape)
        if kind in _RANDOM_NORMS:  # every norm weight and bias, so a dropped norm shows
            layer.update(tree_unflatten([
                (name, (name.endswith(".weight") + 0.1 * mx.random.normal(p.shape)))
                for name, p in tree_flatten(layer.parameters())
                if "norm" in name.rsplit(".", 2)[-2] and "q_norm" not in name
                and "k_norm" not in name]))
        if kind == "apertus":  # xIELU's slopes, away from their defaults (its eps stays)
            act = layer.mlp.act_fn
            for name in ("alpha_p", "alpha_n", "beta"):
                setattr(act, name, getattr(act, name) + 0.2 * mx.random.normal(()))
        # Gemma's (1 + w) (and MiniMax-M3's)
        if kind.startswith(("gemma2", "gemma3_", "plamo3", "gear", "recurrent_gemma",
                            "muse_glimmer")) or kind in ("gemma", "minimax_m3_vl"):
            for name in ("input_layernorm", "post_attention_layernorm",  # norms: w = 0, the
                         "pre_feedforward_layernorm", "post_feedforward_layernorm",  # identity
                         "pre_mixer_norm", "post_mixer_norm", "pre_mlp_norm",  # (PLaMo 3's,
                         "post_mlp_norm",  # w plus an offset)
                         "temporal_pre_norm", "channel_pre_norm"):  # (RecurrentGemma's)
                norm = getattr(layer, name, None)  # (Gemma 1's: the first two)
                if norm is not None:
                    norm.weight = 0.1 * mx.random.normal(norm.weight.shape)
        if kind == "muse_spark":  # input-scale norms (ones) and residual gates (zero) at random
            for norm in (layer.post_feedforward_layernorm, layer.mlp.experts.post_expert_norm):
                norm.weight = 1.0 + 0.1 * mx.random.normal(norm.weight.shape)
            for name in ("add_attn", "add_ffn"):
                alpha, beta = residual_gate_coefficients(
                    mx.random.normal(layer.input_layernorm.weight.shape))
                setattr(layer, f"{name}_alpha", alpha)
                setattr(layer, f"{name}_beta", beta)
        if kind.startswith("lfm2"):  # ones by default, and both after the block's input
            for name in ("operator_norm", "ffn_norm"):
                norm = getattr(layer, name)
                norm.weight = 1.0 + 0.1 * mx.random.normal(norm.weight.shape)
    for gate in model.get("model", {}).get("gate_projections", []):  # iquestloopcoder's: zeros
        gate.weight = mx.random.normal(gate.weight.shape)
        gate.bias = mx.random.normal(gate.bias.shape)
    for _, module in model.named_modules():  # phimoe's LayerNorms: biases zero by default
        if isinstance(module, nn.LayerNorm) and "bias" in module:
            module.bias = 0.1 * mx.random.normal(module.bias.shape)
        if (kind.split("-")[0] in _RANDOM_NORM_MODULES
                and isinstance(module, (nn.LayerNorm, nn.RMSNorm)) and "weight" in module):
            module.weight = 1.0 + 0.1 * mx.random.normal(module.weight.shape)
    for _, module in model.named_modules():
        if isinstance(module, BitLinear):  # bitnet: four ternary fields a byte (0, 1, 2: -1,
            fields = mx.random.randint(0, 3, (4, *module.weight.shape))  # 0, 1), a scale
            module.weight = sum(f << (2 * i) for i, f in enumerate(fields)).astype(mx.uint8)
            module.weight_scale = 0.05 + 0.1 * mx.random.uniform(shape=(1,))
    if kind == "nanochat":
        model.lm_head.weight = 30 * model.lm_head.weight
    if kind == "talkie":  # a bare matrix, zeros by default, and its gain
        model.lm_head = mx.random.normal(model.lm_head.shape)
        model.lm_head_gain.w_g = mx.array([1.5])
    if kind.startswith("gemma3_"):
        model.pop("lm_head")  # tied, as Gemma 3 checkpoints are (mlx-lm ties when it is absent)
    mx.eval(model.parameters())
    save_model(folder, model)
    if kind == "mimo":  # what mlx-lm's sanitize drops: a multi-token-prediction layer
        weights = mx.load(str(folder / "model.safetensors"))
        weights["model.mtp_layers.0.input_layernorm.weight"] = mx.ones((64,))
        mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    save_config(dict(config), folder / "config.json")
    build_tokenizer(folder)
    return folder
