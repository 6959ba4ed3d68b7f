"""A GGUF's tensors as mlx-lm's named arrays (for :mod:`mlx_lazy.conversion`): mlx-lm's
parameter names, llama.cpp's layouts undone, dequantization and kept quantization.

Every tensor type the ``gguf`` package dequantizes is read. Q4_0/Q4_1/Q8_0 matrices map exactly
onto MLX affine quantization (group size 32), MXFP4 ones (gpt-oss's experts) onto MLX's
``mxfp4``, and stay quantized unless a dtype is given (the experts' stacks too); the other
types are dequantized (to float32 on Linux, float16 elsewhere, unless a dtype is given).
llama (Mixtral's too), smollm3, granite, granitemoe, granitehybrid, mistral3, minicpm, deepseek,
nanbeige, muse-glimmer and deci (by each layer's heads) q/k rows are un-permuted from
llama.cpp's RoPE layout to the Hugging Face one (InternLM2's and Ling 1's too, fused again:
:func:`internlm2_tensors`).
LFM2's convolution kernels become MLX's Conv1d layout (:func:`lfm2_tensors`), Granite 4.0's
Mamba-2 tensors and Jamba's Mamba ones mlx-lm's (:func:`granitehybrid_tensors`,
:func:`jamba_tensors`), Kimi Linear's and Ling 2.5/3's Kimi Delta Attention ones mlx-lm's
(:func:`kimi_linear_tensors`, :func:`bailingmoe3_tensors`; Kimi K3's fused as mlx-lm's:
:func:`kimi_k3_tensors`); a deci layer's linear map for attention
its ``self_attn.linear`` (:func:`deci_tensors`).
"""

from __future__ import annotations

from . import _blas  # noqa: F401  (must precede any mlx import)

import sys
from functools import partial
from typing import Any, Callable, Iterator, NamedTuple

import mlx.core as mx
import numpy as np

from .errors import UserInputError, shown

GGUF_GROUP_SIZE = 32
# Float dtype of dequantized GGUF tensors when none is given: float16 and quantized matmuls
# bypass BLAS on the Linux CPU.
DEFAULT_GGUF_DTYPE = "float32" if sys.platform == "linux" else "float16"
# llama.cpp's converter permutes q/k rows (and biases) for its LlamaModel family (Ministral 3's
# and Mistral's own format arrive in that layout too)
LLAMA_FAMILY = ("llama", "smollm3", "granite", "granitemoe", "mistral3", "minicpm", "deepseek",
                "nanbeige", "granitehybrid", "deci", "muse-glimmer")
# Qwen3.5/3.6 (Gated DeltaNet linear attention, every n-th layer full attention): llama.cpp's
# architectures, and what mlx-lm's qwen3_5 names its parameters under
QWEN35 = ("qwen35", "qwen35moe")
_QWEN35_PREFIX = "language_model."
# The Gated DeltaNet hybrids: Qwen3.5/3.6 and Qwen3-Next, its predecessor
DELTA_NET = (*QWEN35, "qwen3next")
# mlx-lm's model types whose value heads llama.cpp's converter tiles (Qwen3.5's, not Qwen3-Next's)
_TILED_V_HEADS = ("qwen3_5", "qwen3_5_moe")
# The architectures whose GGUFs may hold multi-token prediction (NextN) blocks after the model's
NEXTN = (*DELTA_NET, "glm4moe", "deepseek2", "glm4", "exaone-moe", "mimo2", "step35",
         "bailingmoe2", "nemotron_h_moe", "deepseek32", "glm-dsa", "bailingmoe3")
# Ling/Ring 1 and 2.0 (mlx-lm's bailing_moe)
BAILING = ("bailingmoe", "bailingmoe2")

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Qwen3-MoE: the router and the experts' weights, one (experts, out, in) stack each
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
# Gemma 1, 2 and 3 as llama.cpp's converter writes them: norm weights as 1 + w (mlx-lm's as w),
# a SentencePiece vocabulary in Gemma's layout
GEMMA = ("gemma", "gemma2", "gemma3")
# The architectures with Gemma's SentencePiece vocabulary: Gemma 3n's too (its norms stored as w)
GEMMA_VOCABULARY = (*GEMMA, "gemma3n")
# The architectures whose norm weights llama.cpp's converter stores as 1 + w (mlx-lm's models as
# w): Gemma's, Nemotron's LayerNorms (not their biases)
_NORMS_PLUS_ONE = (*GEMMA, "nemotron")
# Gemma 2's and 3's four norms per layer: llama.cpp's ``ffn_norm`` is the norm before the MLP
# there (Gemma 3's q/k norms too)
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3: q, k, v rows in one tensor and the MLP's gate then up rows in another, fused as in
# mlx-lm's phi3 (llama.cpp's converter writes Hugging Face's tensors unpermuted: NeoX RoPE)
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj",
                     "ffn_up": "mlp.gate_up_proj"}
# gpt-oss, Qwen3.5, Qwen3-Next, Seed-OSS, GLM-4.5: the norm before the MLP is llama.cpp's
# post_attention_norm
_POST_ATTENTION_NORM_NAMES = {**{k: v for k, v in _LAYER_NAMES.items() if k != "ffn_norm"},
                              "post_attention_norm": "post_attention_layernorm"}
# gpt-oss: the router and the experts' stacks (with biases) under mlx-lm's names; the attention
# sinks are a parameter of their own (a "role.suffix" key names a whole parameter)
_GPT_OSS_LAYER_NAMES = {
    **_POST_ATTENTION_NORM_NAMES,
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# OLMo 2, EXAONE 4: a norm on each branch's output and none before it
_POST_NORM_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if k not in ("attn_norm", "ffn_norm")},
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# A shared expert (one MLP) and its gate: Qwen1.5/2-MoE's, Qwen3.5's
_SHARED_EXPERT_NAMES = {"ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                        **{f"ffn_{p}_shexp": f"mlp.shared_expert.{p}_proj"
                           for p in ("gate", "up", "down")}}
# Qwen3.5/3.6: the linear-attention layers' projections (attn_qkv: q, k, v rows; attn_gate: z),
# its conv, A and dt bias (parameters of their own; a key without a suffix names one too) and
# gated norm; the MoE's shared expert and its gate
_QWEN35_LAYER_NAMES = {
    **_POST_ATTENTION_NORM_NAMES,
    "ssm_a": "linear_attn.A_log",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_out": "linear_attn.out_proj",
    "ssm_norm": "linear_attn.norm",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_dt.bias": "linear_attn.dt_bias",
    **_SHARED_EXPERT_NAMES,
}
# Gemma 4: Gemma 3's norms (stored as w, not 1 + w), and its MoE layers' dense MLP beside the
# experts, each with norms of its own, the router's weight, input scale and per-expert output
# scales (llama.cpp's ffn_down_exps.scale), the experts' gate and up halves (ffn_gate_up_exps
# is split into them: gemma4_tensors); a scalar per layer; E2B/E4B's per-layer input gates
_GEMMA4_LAYER_NAMES = {
    **_GEMMA3_LAYER_NAMES,
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
    "ffn_gate_inp": "router.proj",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_exps": "experts.switch_glu.gate_proj",
    "ffn_up_exps": "experts.switch_glu.up_proj",
    "ffn_down_exps": "experts.switch_glu.down_proj",
    "layer_output_scale.weight": "layer_scalar",
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
}
# Gemma 3n: Gemma 3's four norms (stored as w), Gemma 4's per-layer input gates, AltUp's
# coefficients, router and output scale, LAuReL's two projections and norm
_GEMMA3N_LAYER_NAMES = {
    **_GEMMA3_LAYER_NAMES,
    **{k: _GEMMA4_LAYER_NAMES[k] for k in ("inp_gate", "proj", "post_norm")},
    "altup_correct_coef": "altup.correction_coefs",
    "altup_correct_scale.weight": "altup.correct_output_scale",
    "altup_predict_coef": "altup.prediction_coefs",
    "altup_router": "altup.modality_router",
    "altup_router_norm": "altup.router_norm",
    "laurel_l": "laurel.linear_left",
    "laurel_r": "laurel.linear_right",
    "laurel_post_norm": "laurel.post_laurel_norm",
}
# Mixtral (a llama GGUF with experts; a dense one has none of these tensors), Phi-3.5-MoE and
# Granite MoE: the router and the experts' stacks at mlx-lm's block_sparse_moe
_BLOCK_SPARSE_MOE_NAMES = {**_LAYER_NAMES, **{
    k: "block_sparse_moe." + v.removeprefix("mlp.") for k, v in _LAYER_NAMES.items()
    if k.startswith("ffn_") and k.endswith(("_exps", "_inp"))}}
# MiniMax-M2: Mixtral's, its experts' correction bias on the MoE block
_MINIMAX_M2_LAYER_NAMES = {**_BLOCK_SPARSE_MOE_NAMES,
                           "exp_probs_b.bias": "block_sparse_moe.e_score_correction_bias"}
# MiniMax-M3: M2's, the shared expert beside the experts and the sparse layers' indexer
_MINIMAX_M3_LAYER_NAMES = {
    **_MINIMAX_M2_LAYER_NAMES,
    **{f"ffn_{p}_shexp": f"block_sparse_moe.shared_experts.{p}_proj"
       for p in ("gate", "up", "down")},
    **{f"indexer.{p}": f"self_attn.index_{p}" for p in ("q_proj", "k_proj", "q_norm", "k_norm")}}
_GRANITEMOE_LAYER_NAMES = {**_BLOCK_SPARSE_MOE_NAMES,
                           "ffn_gate_inp": "block_sparse_moe.router.layer"}
# Granite 4.0 (H): Mamba-2 layers (A, D and the gated norm's weight as granitehybrid_tensors
# shapes them, a key without a suffix naming A and D), attention, a dense MLP or experts beside
# a shared MLP (its gate and up halves fused by granitehybrid_tensors)
_GRANITEHYBRID_LAYER_NAMES = {**_GRANITEMOE_LAYER_NAMES, "ssm_in": "mamba.in_proj",
                              "ssm_conv1d": "mamba.conv1d", "ssm_dt.bias": "mamba.dt_bias",
                              "ssm_a": "mamba.A_log", "ssm_d": "mamba.D",
                              "ssm_norm": "mamba.norm", "ssm_out": "mamba.out_proj",
                              "ffn_gate_up_shexp": "shared_mlp.input_linear",
                              "ffn_down_shexp": "shared_mlp.output_linear"}
# Nemotron-H: one norm and one mixer a layer: Granite 4.0's Mamba-2 parts, attention (its q/k
# rows as llama.cpp's converter permuted them, each head's alike: without RoPE the same scores),
# a squared-ReLU MLP or experts
_NEMOTRON_H_LAYER_NAMES = {"attn_norm": "norm", **{
    k: "mixer." + v.split(".", 1)[1] for k, v in _GRANITEHYBRID_LAYER_NAMES.items()
    if k.startswith("ssm_") or k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_up",
                                     "ffn_down")},
    # Nemotron 3 Nano's experts (their router and correction bias at gate, latent projections)
    # beside a shared expert
    "ffn_gate_inp": "mixer.gate", "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
    "ffn_up_exps": "mixer.switch_mlp.fc1", "ffn_down_exps": "mixer.switch_mlp.fc2",
    "ffn_up_shexp": "mixer.shared_experts.up_proj",
    "ffn_down_shexp": "mixer.shared_experts.down_proj",
    "ffn_latent_down": "mixer.fc1_latent_proj", "ffn_latent_up": "mixer.fc2_latent_proj"}
# PLaMo 2: four norms a layer (the post ones named without a suffix), a fused q/k/v and the
# per-head q/k weights, Mamba layers (their dt/B/C norms without a suffix; A_log as
# plamo2_tensors makes it), the MLP's fused gate and up
_PLAMO2_LAYER_NAMES = {"attn_norm": "pre_mixer_norm", "attn_qkv": "mixer.qkv_proj",
                       "attn_output": "mixer.o_proj", "attn_q_norm.weight": "mixer.q_weight",
                       "attn_k_norm.weight": "mixer.k_weight",
                       "post_attention_norm": "post_mixer_norm.weight",
                       "ffn_norm": "pre_mlp_norm", "post_ffw_norm": "post_mlp_norm.weight",
                       "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj",
                       "ssm_in": "mixer.in_proj", "ssm_conv1d": "mixer.conv1d",
                       "ssm_x": "mixer.bcdt_proj", "ssm_dt": "mixer.dt_proj",
                       "ssm_dt.bias": "mixer.dt_bias", "ssm_dt_norm": "mixer.dt_norm_weight",
                       "ssm_b_norm": "mixer.B_norm_weight", "ssm_c_norm": "mixer.C_norm_weight",
                       "ssm_a": "mixer.A_log", "ssm_d": "mixer.D", "ssm_out": "mixer.out_proj"}
#: What llama.cpp's converter adds to each PLaMo 2 norm weight (mlx-lm's RMSNorm offsets), by
#: the norm's GGUF name's end
_PLAMO2_NORM_OFFSETS = {".attn_norm.weight": 1.0, ".post_attention_norm": 1 / 5,
                       ".ffn_norm.weight": 1.0, ".post_ffw_norm": 1 / 5 ** 1.5,
                       "output_norm.weight": 1.0}
# PLaMo 3: PLaMo 2's attention layers with per-head q/k norms (their weights plus 1 too)
_PLAMO3_LAYER_NAMES = {**_PLAMO2_LAYER_NAMES, "attn_q_norm.weight": "mixer.q_norm.weight",
                       "attn_k_norm.weight": "mixer.k_norm.weight"}
_PLAMO3_NORM_OFFSETS = {**_PLAMO2_NORM_OFFSETS, ".attn_q_norm.weight": 1.0,
                        ".attn_k_norm.weight": 1.0}
# Jamba: Mamba layers (A_log as jamba_tensors makes it, A and D named without a suffix; the time
# step's projection with its bias), attention, a dense MLP at feed_forward after pre_ff_layernorm
_JAMBA_LAYER_NAMES = {**{k: v.replace("mlp.", "feed_forward.") for k, v in _LAYER_NAMES.items()
                         if k in ("attn_q", "attn_k", "attn_v", "attn_output", "attn_norm",
                                  "ffn_gate", "ffn_up", "ffn_down")},
                      "ffn_norm": "pre_ff_layernorm", "ssm_in": "mamba.in_proj",
                      "ssm_conv1d": "mamba.conv1d", "ssm_x": "mamba.x_proj",
                      "ssm_dt": "mamba.dt_proj", "ssm_dt_norm": "mamba.dt_layernorm",
                      "ssm_b_norm": "mamba.b_layernorm", "ssm_c_norm": "mamba.c_layernorm",
                      "ssm_a": "mamba.A_log", "ssm_d": "mamba.D", "ssm_out": "mamba.out_proj"}
# Falcon-H1: Jamba's attention and MLP names beside Granite 4.0's Mamba-2 parts; its MLP's norm
# named without a suffix (llama.cpp's converter maps the checkpoint's whole name to ffn_norm)
_FALCON_H1_LAYER_NAMES = {**{k: v for k, v in _JAMBA_LAYER_NAMES.items()
                             if not k.startswith("ssm_")},
                          **{k: v for k, v in _GRANITEHYBRID_LAYER_NAMES.items()
                             if k.startswith("ssm_")},
                          "ffn_norm": "pre_ff_layernorm.weight"}
# The shared experts of ERNIE 4.5 MoE and GLM-4.5 (plural in mlx-lm's models)
_SHARED_EXPERTS_NAMES = {f"ffn_{p}_shexp": f"mlp.shared_experts.{p}_proj"
                         for p in ("gate", "up", "down")}
# Ling/Ring: attention under its own names (q/k/v fused: bailingmoe2's attn_qkv as it is,
# bailingmoe's attn_q/k/v fused again by internlm2_tensors), the router and its selection bias
# at mlp.gate, the shared experts
_BAILING_LAYER_NAMES = {**_LAYER_NAMES, **_SHARED_EXPERTS_NAMES,
                        "attn_qkv": "attention.query_key_value", "attn_output": "attention.dense",
                        "attn_q_norm": "attention.query_layernorm",
                        "attn_k_norm": "attention.key_layernorm",
                        "ffn_gate_inp": "mlp.gate.gate_proj",
                        "exp_probs_b.bias": "mlp.gate.expert_bias"}
# ERNIE 4.5 MoE: Qwen3-MoE's router and experts' stacks, beside its shared experts (one MLP)
_ERNIE45_MOE_LAYER_NAMES = {**_LAYER_NAMES, **_SHARED_EXPERTS_NAMES}
# Qwen3-Next: Qwen3.5's names, but its fused projections: q, k, v and z rows grouped by key head
# (ssm_in, which qwen3next_tensors makes of attn_qkv and attn_gate), b and a rows (ssm_ba)
_QWEN3NEXT_LAYER_NAMES = {
    **{k: v for k, v in _QWEN35_LAYER_NAMES.items()
       if k not in ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha")},
    "ssm_in": "linear_attn.in_proj_qkvz",
    "ssm_ba": "linear_attn.in_proj_ba",
}
# The router's expert-score correction bias (a parameter of the router: GLM-4.5's, DeepSeek-V3's)
_CORRECTION_BIAS_NAMES = {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"}
# GLM-4.5: the correction bias, the shared experts
_GLM4MOE_LAYER_NAMES = {**_POST_ATTENTION_NORM_NAMES, **_SHARED_EXPERTS_NAMES,
                        **_CORRECTION_BIAS_NAMES}
# deepseek2 (DeepSeek-V2/V3, GLM-4.7-Flash): multi-head latent attention's projections and
# latent norms; its keys' and values' up-projection as mlx-lm's deepseek_v2 holds it (kv_b_proj)
# or as deepseek_v3 and glm4_moe_lite do (embed_q: llama.cpp's attn_k_b, unembed_out: attn_v_b;
# deepseek2_tensors makes either of the other); the correction bias, the shared experts
_DEEPSEEK2_LAYER_NAMES = {**_LAYER_NAMES, **_SHARED_EXPERTS_NAMES, **_CORRECTION_BIAS_NAMES,
                          "attn_q_a": "self_attn.q_a_proj",
                          "attn_q_a_norm": "self_attn.q_a_layernorm",
                          "attn_q_b": "self_attn.q_b_proj",
                          "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                          "attn_kv_a_norm": "self_attn.kv_a_layernorm",
                          "attn_kv_b": "self_attn.kv_b_proj",
                          "attn_k_b": "self_attn.embed_q", "attn_v_b": "self_attn.unembed_out"}
# DeepSeek-V3.2, GLM-5: deepseek2's and each layer's lightning indexer
_DSA_LAYER_NAMES = {**_DEEPSEEK2_LAYER_NAMES, "indexer.attn_q_b": "self_attn.indexer.wq_b",
                    "indexer.attn_k": "self_attn.indexer.wk",
                    "indexer.k_norm": "self_attn.indexer.k_norm",
                    "indexer.proj": "self_attn.indexer.weights_proj"}
# Kimi Linear: deepseek2's latent attention (queries in one step) and experts, the selection
# bias beside the router; Kimi Delta Attention's convolutions, gate and decay projections,
# A_log (named without a suffix) and dt_bias, its output norm
_KIMI_LINEAR_LAYER_NAMES = {**_DEEPSEEK2_LAYER_NAMES,
                            "exp_probs_b.bias": "mlp.e_score_correction_bias",
                            **{f"ssm_conv1d_{p}": f"self_attn.{p}_conv.conv" for p in "qkv"},
                            **{f"ssm_{p}_{ab}": f"self_attn.{p}_{ab}_proj"
                               for p in "fg" for ab in "ab"},
                            "ssm_beta": "self_attn.b_proj", "ssm_a": "self_attn.A_log",
                            "ssm_dt.bias": "self_attn.dt_bias", "ssm_norm": "self_attn.o_norm"}
# Kimi K3: Kimi Linear's, the KDA layers' q/k/v projections and kernels fused (kimi_k3_tensors),
# their full-rank gate and the latent attention's output gate (both g_proj), the residual
# scores as res_proj (under norms of ones), the experts' latent projections and norm
_KIMI_K3_LAYER_NAMES = {**_KIMI_LINEAR_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj",
                        "ssm_conv1d_qkv": "self_attn.qkv_conv.conv", "ssm_g": "self_attn.g_proj",
                        "attn_gate": "self_attn.g_proj",
                        **{f"{a}_res_{b}": f"{m}_res_{b.replace('score', 'proj')}"
                           for a, m in (("attn", "self_attention"), ("ffn", "mlp"))
                           for b in ("score", "norm")},
                        "ffn_routed_down": "mlp.routed_expert_down_proj",
                        "ffn_routed_up": "mlp.routed_expert_up_proj",
                        "ffn_routed_norm": "mlp.routed_expert_norm"}
# Ling 2.5/3: Kimi Linear's names at block.attention (the KDA layers' full-rank gate projections
# f_proj and g_proj), the latent attention's output dense (bailingmoe3_tensors names it apart)
# and gate per head; Ling's router, its selection bias, its experts and shared ones
_BAILINGMOE3_LAYER_NAMES = {
    **{k: v.replace("self_attn.", "attention.").replace("_conv.conv", "_conv1d")
       for k, v in _KIMI_LINEAR_LAYER_NAMES.items() if not k.startswith(("ssm_f_", "ssm_g_"))},
    "ssm_f_a": "attention.f_proj", "ssm_g_a": "attention.g_proj", "attn_gate": "attention.g_proj",
    "attn_dense": "attention.dense", "ffn_gate_inp": "mlp.gate",
    "exp_probs_b.bias": "mlp.gate.expert_bias"}
# GLM-4-0414: a norm after each branch (llama.cpp's post_attention_norm and post_ffw_norm) besides
# the ones before it (its ffn_norm mlx-lm's post_attention_layernorm); the MLP's gate then up
# rows in one tensor, as in mlx-lm's glm4
_GLM4_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_self_attn_layernorm",
                     "ffn_norm": "post_attention_layernorm", "ffn_up": "mlp.gate_up_proj",
                     "post_ffw_norm": "post_mlp_layernorm"}
# StarCoder2: a plain GELU MLP
_STARCODER2_LAYER_NAMES = {**_LAYER_NAMES, "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
# Apertus: its norms' names, and its xIELU's parameters (from llama.cpp's metadata:
# xielu_tensors)
_APERTUS_LAYER_NAMES = {**_LAYER_NAMES, "attn_norm": "attention_layernorm",
                        "ffn_norm": "feedforward_layernorm",
                        **{f"xielu_{p}": f"mlp.act_fn.{p}"
                           for p in ("alpha_p", "alpha_n", "beta", "eps")}}
# EXAONE 3.0/3.5: GPT-2's names in mlx-lm's exaone (the MLP's gate c_fc_0, its up c_fc_1)
_EXAONE_LAYER_NAMES = {"attn_norm": "ln_1", "ffn_norm": "ln_2",
                       **{f"attn_{p}": f"attn.attention.{p}_proj" for p in "qkv"},
                       "attn_output": "attn.attention.out_proj", "ffn_gate": "mlp.c_fc_0",
                       "ffn_up": "mlp.c_fc_1", "ffn_down": "mlp.c_proj"}
# LFM2: the operator's norm, attention (out_proj, q/k layernorms) or a short convolution
# (llama.cpp's shortconv.*), a SwiGLU feed-forward (w1 the gate, w3 up, w2 down)
_LFM2_LAYER_NAMES = {**{k: v for k, v in _LAYER_NAMES.items()
                        if k.startswith("attn_") and k != "attn_output"},
                     "attn_output": "self_attn.out_proj", "attn_q_norm": "self_attn.q_layernorm",
                     "attn_k_norm": "self_attn.k_layernorm", "attn_norm": "operator_norm",
                     "ffn_norm": "ffn_norm",
                     **{f"shortconv.{p}": f"conv.{p}" for p in ("conv", "in_proj", "out_proj")},
                     "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3",
                     "ffn_down": "feed_forward.w2"}
# LFM2-8B-A1B: its dense layers' MLP by Llama's names, the router, experts' stacks and
# selection bias at feed_forward
_LFM2MOE_LAYER_NAMES = {**_LFM2_LAYER_NAMES,
                        **{k: "feed_forward." + v.removeprefix("mlp.")
                           for k, v in _LAYER_NAMES.items() if k.startswith("ffn_")
                           and k != "ffn_norm"},
                        "exp_probs_b.bias": "feed_forward.expert_bias"}
# Hunyuan dense: its q/k norms' names
_HUNYUAN_LAYER_NAMES = {**_LAYER_NAMES, "attn_q_norm": "self_attn.query_layernorm",
                        "attn_k_norm": "self_attn.key_layernorm"}
# StableLM: its per-head q/k LayerNorms, one module per head (stablelm_tensors splits llama.cpp's
# stacks into attn_q_norm.norms.<head>)
_STABLELM_LAYER_NAMES = {**_LAYER_NAMES, "attn_q_norm": "self_attn.q_layernorm",
                         "attn_k_norm": "self_attn.k_layernorm"}
# dots.llm1: GLM-4.5's router, correction bias and shared experts, its experts' stacks at
# mlp.experts, the norm before the MLP llama.cpp's ffn_norm
_DOTS1_LAYER_NAMES = {**_LAYER_NAMES, **_SHARED_EXPERTS_NAMES, **_CORRECTION_BIAS_NAMES,
                      **{f"ffn_{p}_exps": f"mlp.experts.{p}_proj" for p in ("gate", "up", "down")}}
# Llama 4: its MLPs, the MoE's router, experts' stacks and shared expert at feed_forward
_LLAMA4_LAYER_NAMES = {**_LAYER_NAMES,
                       **{f"ffn_{p}": f"feed_forward.{p}_proj" for p in ("gate", "up", "down")},
                       **{f"ffn_{p}_exps": f"feed_forward.experts.{p}_proj"
                          for p in ("gate", "up", "down")},
                       **{f"ffn_{p}_shexp": f"feed_forward.shared_expert.{p}_proj"
                          for p in ("gate", "up", "down")},
                       "ffn_gate_inp": "feed_forward.router"}
# Phi-2: its output projection, plain MLP (fc1, fc2), q/k/v as three (phi2_tensors cuts a fused
# attn_qkv)
_PHI2_LAYER_NAMES = {**_LAYER_NAMES, "attn_output": "self_attn.dense", "ffn_up": "mlp.fc1",
                     "ffn_down": "mlp.fc2"}
# GPT-NeoX: attention at ``attention``, its fused q/k/v (gptneox_tensors reorders its rows), a
# plain MLP
_GPTNEOX_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                        "attn_qkv": "attention.query_key_value", "attn_output": "attention.dense",
                        "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"}
# InternLM2: its names (wqkv made of attn_q/k/v by internlm2_tensors; w1 the gate, w3 up)
_INTERNLM2_LAYER_NAMES = {"attn_norm": "attention_norm", "ffn_norm": "ffn_norm",
                          "attn_qkv": "attention.wqkv", "attn_output": "attention.wo",
                          "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3",
                          "ffn_down": "feed_forward.w2"}
# Qwen 1: GPT-2's names in mlx-lm's qwen, q/k/v fused in c_attn, the MLP's gate w2 and up w1
_QWEN_LAYER_NAMES = {"attn_norm": "ln_1", "ffn_norm": "ln_2", "attn_qkv": "attn.c_attn",
                     "attn_output": "attn.c_proj", "ffn_gate": "mlp.w2", "ffn_up": "mlp.w1",
                     "ffn_down": "mlp.c_proj"}
# GPT-2, StarCoder 1: fused q/k/v (mlx-lm's c_attn, the same rows), LayerNorms, a plain MLP
_GPT2_LAYER_NAMES = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
                     "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
# OpenELM: its norms', attention's and MLP's names; the MLP's gate then up rows in one tensor
# (ffn_gate_up, which openelm_tensors fuses from llama.cpp's ffn_gate and ffn_up)
_OPENELM_LAYER_NAMES = {"attn_norm": "attn_norm", "ffn_norm": "ffn_norm",
                        "attn_qkv": "attn.qkv_proj", "attn_q_norm": "attn.q_norm",
                        "attn_k_norm": "attn.k_norm", "attn_output": "attn.out_proj",
                        "ffn_gate_up": "ffn.proj_1", "ffn_down": "ffn.proj_2"}
_ARCH_LAYER_NAMES = {**dict.fromkeys(("gemma2", "gemma3"), _GEMMA3_LAYER_NAMES),
                     "phi3": _PHI3_LAYER_NAMES,
                     "seed_oss": _POST_ATTENTION_NORM_NAMES,
                     "ernie4_5-moe": _ERNIE45_MOE_LAYER_NAMES,
                     "glm4moe": _GLM4MOE_LAYER_NAMES, "qwen3next": _QWEN3NEXT_LAYER_NAMES,
                     **dict.fromkeys(("deepseek2", "minicpm3", "mistral4"),
                                     _DEEPSEEK2_LAYER_NAMES),
                     **dict.fromkeys(("deepseek32", "glm-dsa"), _DSA_LAYER_NAMES),
                     "llama": _BLOCK_SPARSE_MOE_NAMES, "granitemoe": _GRANITEMOE_LAYER_NAMES,
                     "phimoe": _BLOCK_SPARSE_MOE_NAMES,
                     "minimax-m2": _MINIMAX_M2_LAYER_NAMES,
                     "minimax-m3": _MINIMAX_M3_LAYER_NAMES,
                     # MiMo-V2-Flash: DeepSeek's router at mlp.gate, its correction bias, sinks
                     "mimo2": {**_LAYER_NAMES, **_CORRECTION_BIAS_NAMES,
                               "attn_sinks.weight": "self_attn.attention_sink_bias"},
                     # Step-3.5: its gates, router (and its selection bias) at mlp.gate.gate,
                     # shared expert at mlp.share_expert
                     "step35": {**_LAYER_NAMES, "attn_gate": "self_attn.g_proj",
                                "ffn_gate_inp": "mlp.gate.gate",
                                "exp_probs_b.bias": "mlp.gate.router_bias",
                                **{f"ffn_{p}_shexp": f"mlp.share_expert.{p}_proj"
                                   for p in ("gate", "up", "down")}},
                     "granitehybrid": _GRANITEHYBRID_LAYER_NAMES, "jamba": _JAMBA_LAYER_NAMES,
                     # Nemotron-NAS: a linear map for attention (deci_tensors' attn_linear)
                     "deci": {**_LAYER_NAMES, "attn_linear": "self_attn.linear"},
                     # Laguna: its output gate, DeepSeek's router (a layer of its own) with the
                     # correction bias, its shared expert
                     "laguna": {**_LAYER_NAMES, **_CORRECTION_BIAS_NAMES,
                                "attn_gate": "self_attn.g_proj", "ffn_gate_inp": "mlp.gate.proj",
                                **{f"ffn_{p}_shexp": f"mlp.shared_expert.{p}_proj"
                                   for p in ("gate", "up", "down")}},
                     # Talkie: its parts' names, its gains (talkie_tensors)
                     "talkie": {"attn_q": "attn.attn_query", "attn_k": "attn.attn_key",
                                "attn_v": "attn.attn_value", "attn_output": "attn.attn_resid",
                                "attn_q_norm.weight": "attn.head_gain.head_g",
                                "attn_output.scale": "attn_gain.a_g",
                                "ffn_down.scale": "mlp_gain.a_g",
                                "layer_output_scale.weight": "embed_skip.a_g",
                                "ffn_gate": "mlp.mlp_gate", "ffn_up": "mlp.mlp_linear",
                                "ffn_down": "mlp.mlp_resid"},
                     **dict.fromkeys(("nemotron_h", "nemotron_h_moe"), _NEMOTRON_H_LAYER_NAMES),
                     "falcon-h1": _FALCON_H1_LAYER_NAMES,
                     "plamo2": _PLAMO2_LAYER_NAMES, "plamo3": _PLAMO3_LAYER_NAMES,
                     # PLaMo 1: one norm before attention and the MLP
                     "plamo": {**_LAYER_NAMES, "attn_norm": "norm"},
                     # Muse Glimmer: Gemma 3's four norms, the output gate (muse_glimmer_tensors
                     # drops the q/k norms: the config's qk_scale_factor)
                     "muse-glimmer": {**_GEMMA3_LAYER_NAMES, "attn_gate": "self_attn.gate_proj"},
                     # Spark 2.5: the fused q/k/v, the gate per head, the output projection
                     "spark2_5": {**_LAYER_NAMES, "attn_qkv": "self_attn.q_k_v_proj",
                                  "attn_gate": "self_attn.g_proj",
                                  "attn_output": "self_attn.out_proj"},
                     "qwen2moe": {**_LAYER_NAMES, **_SHARED_EXPERT_NAMES},
                     "gemma4": _GEMMA4_LAYER_NAMES, "gemma3n": _GEMMA3N_LAYER_NAMES,
                     "olmo2": _POST_NORM_LAYER_NAMES,
                     "exaone4": _POST_NORM_LAYER_NAMES, "gpt-oss": _GPT_OSS_LAYER_NAMES,
                     "glm4": _GLM4_LAYER_NAMES, "starcoder2": _STARCODER2_LAYER_NAMES,
                     "apertus": _APERTUS_LAYER_NAMES, "exaone": _EXAONE_LAYER_NAMES,
                     "lfm2": _LFM2_LAYER_NAMES, "lfm2moe": _LFM2MOE_LAYER_NAMES,
                     "hunyuan-dense": _HUNYUAN_LAYER_NAMES, "stablelm": _STABLELM_LAYER_NAMES,
                     "dots1": _DOTS1_LAYER_NAMES, "llama4": _LLAMA4_LAYER_NAMES,
                     # K-EXAONE: Qwen3-MoE's router and stacks, the correction bias, shared experts
                     "exaone-moe": {**_LAYER_NAMES, **_SHARED_EXPERTS_NAMES,
                                    **_CORRECTION_BIAS_NAMES},
                     # AFM: Gemma 3's four norms (its own names), the output gate, the router
                     # at router.gate, the selection bias and experts' stacks on the MoE block
                     "afmoe": {**_LAYER_NAMES, **_SHARED_EXPERTS_NAMES,
                               "attn_gate": "self_attn.gate_proj",
                               "post_attention_norm": "post_attention_layernorm",
                               "ffn_norm": "pre_mlp_layernorm",
                               "post_ffw_norm": "post_mlp_layernorm",
                               "ffn_gate_inp": "mlp.router.gate",
                               "exp_probs_b.bias": "mlp.expert_bias",
                               **{f"ffn_{p}_exps": f"mlp.experts.{p}_proj"
                                  for p in ("gate", "up", "down")}},
                     "phi2": _PHI2_LAYER_NAMES, "gptneox": _GPTNEOX_LAYER_NAMES,
                     "internlm2": _INTERNLM2_LAYER_NAMES, "qwen": _QWEN_LAYER_NAMES,
                     **dict.fromkeys(("gpt2", "starcoder"), _GPT2_LAYER_NAMES),
                     "openelm": _OPENELM_LAYER_NAMES,
                     "kimi-linear": _KIMI_LINEAR_LAYER_NAMES, "kimi-k3": _KIMI_K3_LAYER_NAMES,
                     "bailingmoe3": _BAILINGMOE3_LAYER_NAMES,
                     **dict.fromkeys(BAILING, _BAILING_LAYER_NAMES),
                     # DeepSeek-MoE: Qwen3-MoE's router and experts' stacks, its shared experts
                     "deepseek": {**_LAYER_NAMES, **_SHARED_EXPERTS_NAMES},
                     # GLM-4-9B: the MLP's gate and up rows fused, as in mlx-lm's glm
                     "chatglm": {**_LAYER_NAMES, "ffn_up": "mlp.gate_up_proj"},
                     # DBRX: its attention and norms inside norm_attn_norm, its experts one MLP
                     # each (dbrx_tensors cuts the stacks into ffn_exps.<expert>.<w1|v1|w2>)
                     "dbrx": {"attn_norm": "norm_attn_norm.norm_1",
                              "attn_qkv": "norm_attn_norm.attn.Wqkv",
                              "attn_output": "norm_attn_norm.attn.out_proj",
                              "attn_output_norm": "norm_attn_norm.norm_2",
                              "ffn_gate_inp": "ffn.router.layer", "ffn_exps": "ffn.experts"},
                     # by mlx-lm's model type: the names in its text model
                     "qwen3_5": _QWEN35_LAYER_NAMES}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head",
              # Gemma 4 E2B/E4B: the per-layer inputs' embedding, projection and its norm
              "per_layer_token_embd": "model.embed_tokens_per_layer",
              "per_layer_model_proj": "model.per_layer_model_projection",
              "per_layer_proj_norm": "model.per_layer_projection_norm"}
# Where mlx-lm's model holds its layers, and its top tensors' names, where not model.layers and
# _TOP_NAMES: EXAONE 3.0/3.5's and Qwen 1's GPT-2 layout
_ARCH_LAYOUT = {**dict.fromkeys(("exaone", "qwen"), (
                    "transformer.h", {"token_embd": "transformer.wte",
                                      "output_norm": "transformer.ln_f", "output": "lm_head"})),
                "internlm2": ("model.layers", {"token_embd": "model.tok_embeddings",
                                               "output_norm": "model.norm", "output": "output"}),
                # LFM2's final norm: llama.cpp's token_embd_norm, mlx-lm's embedding_norm
                # Llama 4: its text model's
                "llama4": ("language_model.model.layers", {
                    "token_embd": "language_model.model.embed_tokens",
                    "output_norm": "language_model.model.norm",
                    "output": "language_model.lm_head"}),
                # Kimi K3: its text model's, with the final residual score and its norm
                "kimi-k3": ("language_model.model.layers", {
                    "token_embd": "language_model.model.embed_tokens",
                    "output_norm": "language_model.model.norm",
                    "output": "language_model.lm_head",
                    **{f"output_res_{p}": f"language_model.model.output_attn_res_{q}"
                       for p, q in (("score", "proj"), ("norm", "norm"))}}),
                # MiniMax-M3: its text model's
                "minimax-m3": ("language_model.model.layers", {
                    "token_embd": "language_model.model.embed_tokens",
                    "output_norm": "language_model.model.norm",
                    "output": "language_model.lm_head"}),
                # Phi-2's and Jamba's final norm; GPT-NeoX's layers at model.h, its head inside
                # model
                **dict.fromkeys(("phi2", "jamba", "falcon-h1"), (
                    "model.layers", {**_TOP_NAMES, "output_norm": "model.final_layernorm"})),
                # Talkie's blocks, embedding, its head a bare matrix and the head's gain
                "talkie": ("model.blocks", {"token_embd": "model.embed", "output.weight": "lm_head",
                                            "output_gain": "lm_head_gain"}),
                # their PlamoDecoder's layers
                **dict.fromkeys(("plamo", "plamo2", "plamo3"), ("model.layers.layers", _TOP_NAMES)),
                # Gemma 3n: its text model's, AltUp's projections a matrix per stream (split by
                # gemma3n_tensors)
                "gemma3n": ("model.language_model.layers", {
                    **{k: v.replace("model.", "model.language_model.", 1)
                       for k, v in _TOP_NAMES.items() if k != "output"},
                    "altup_proj": "model.language_model.altup_projections",
                    "altup_unembd_proj": "model.language_model.altup_unembed_projections"}),
                "spark2_5": ("model.layers", {**_TOP_NAMES, "token_embd": "model.embedding"}),
                **dict.fromkeys(("nemotron_h", "nemotron_h_moe"), (
                    "backbone.layers", {"token_embd": "backbone.embeddings",
                                        "output_norm": "backbone.norm_f", "output": "lm_head"})),
                "gptneox": ("model.h", {"token_embd": "model.embed_in",
                                        "output_norm": "model.final_layer_norm",
                                        "output": "model.embed_out"}),
                # GPT-2's (model.h) and StarCoder 1's (transformer.h), their learned positions
                "gpt2": ("model.h", {"token_embd": "model.wte", "position_embd": "model.wpe",
                                     "output_norm": "model.ln_f"}),
                "starcoder": ("transformer.h", {"token_embd": "transformer.wte",
                                                "position_embd": "transformer.wpe",
                                                "output_norm": "transformer.ln_f",
                                                "output": "lm_head"}),
                "dbrx": ("transformer.blocks", {"token_embd": "transformer.wte",
                                                "output_norm": "transformer.norm_f",
                                                "output": "lm_head"}),
                "openelm": ("transformer.layers", {"token_embd": "transformer.token_embeddings",
                                                   "output_norm": "transformer.norm",
                                                   "output": "lm_head"}),
                **dict.fromkeys((*BAILING, "bailingmoe3"), ("model.layers", {
                    **_TOP_NAMES, "token_embd": "model.word_embeddings"})),
                **dict.fromkeys(("lfm2", "lfm2moe"), (
                    "model.layers", {"token_embd": "model.embed_tokens",
                                     "token_embd_norm": "model.embedding_norm"}))}


def nextn_blocks(arch: str, meta: dict) -> int:
    """How many of a GGUF's blocks are multi-token prediction blocks, after the model's own
    (``nextn_predict_layers``; llama.cpp's converter appends them for the :data:`NEXTN`
    architectures unless told not to)."""
    key = f"{arch}.nextn_predict_layers"
    n, blocks = meta.get(key, 0), meta.get(f"{arch}.block_count")
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 0 or \
            (isinstance(blocks, (int, np.integer)) and n >= blocks):
        raise UserInputError(f"GGUF metadata {key} must be an integer in [0, "
                             f"{arch}.block_count), got {shown(n, 40)}")
    return int(n)


def trunk_tensors(arch: str, meta: dict, tensors: dict) -> dict:
    """A GGUF's tensors without its multi-token prediction blocks (mlx-lm's qwen3_5, qwen3_next
    and glm4_moe have none: they drop them from Hugging Face checkpoints too), refusing the
    layouts of llama.cpp's optional fusions."""
    blocks = meta.get(f"{arch}.block_count")
    trunk = blocks - nextn_blocks(arch, meta) if isinstance(blocks, (int, np.integer)) else None
    kept = {name: t for name, t in tensors.items() if trunk is None or
            not (name.startswith("blk.") and name.split(".")[1].isdigit()
                 and int(name.split(".")[1]) >= trunk)}
    for name in kept:
        if ".ffn_gate_up_exps." in name:
            raise UserInputError(f"GGUF {arch} with fused gate/up experts ({name}; llama.cpp's "
                                 "--fuse-gate-up-exps) is not supported")
        if name.endswith(".attn_qkv.weight") and arch != "bailingmoe2" and \
                name.replace(".attn_qkv.", ".ssm_conv1d.") not in kept:  # no linear attention
            raise UserInputError(f"GGUF {arch} with fused q/k/v attention ({name}; llama.cpp's "
                                 "--fuse-qkv) is not supported")
    return kept


def _qwen35_role(gguf_name: str) -> str:
    """A Qwen3.5 or Qwen3-Next GGUF tensor's role: ``blk.3.ssm_dt.bias`` -> ``ssm_dt``."""
    parts = gguf_name.split(".")
    return parts[2] if parts[0] == "blk" and len(parts) > 2 else parts[0]


#: The linear-attention tensors whose value heads llama.cpp's converter tiles (see
#: :func:`_untile_v_heads`): the axis, and whether only the rows past q and k move
_QWEN35_V_HEADS = {"attn_qkv": (0, True), "ssm_conv1d": (0, True), "attn_gate": (0, False),
                   "ssm_beta": (0, False), "ssm_alpha": (0, False), "ssm_a": (0, False),
                   "ssm_dt": (0, False), "ssm_out": (-1, False)}


def _untile_v_heads(x: np.ndarray, axis: int, n_k: int, n_v: int) -> np.ndarray:
    """Undo llama.cpp's tiling of Qwen3.5's value heads along ``axis``: value head h = r·n_k + k
    back to k·(n_v / n_k) + r, grouped under the key head k it reads, as mlx-lm's repeat of the
    keys has them (ggml's broadcast takes key head h % n_k). Each head's slice moves whole, so
    packed quantized weights and their scales move with it."""
    x = np.moveaxis(x, axis, 0)
    r, rest = n_v // n_k, x.shape[1:]
    x = x.reshape(r, n_k, -1, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.moveaxis(x, 0, axis)


def _qwen35_straddles(t: Any, config: dict | None) -> bool:
    """Whether the GGUF tensor ``t`` is a Qwen3.5 ``ssm_out`` whose value heads, tiled by
    llama.cpp, do not fill whole blocks of 32 columns: it cannot stay quantized."""
    return (config is not None and config["model_type"] in _TILED_V_HEADS
            and _qwen35_role(t.name) == "ssm_out"
            and config["linear_num_key_heads"] != config["linear_num_value_heads"]
            and config["linear_value_head_dim"] % GGUF_GROUP_SIZE != 0)


def _delta_net_layout(gguf_name: str, x: np.ndarray, config: dict) -> np.ndarray:
    """A Qwen3.5 or Qwen3-Next GGUF array (a tensor, or a quantized one's packed weights, scales
    or biases) in mlx-lm's layout: Qwen3.5's value heads untiled; ``ssm_a`` (llama.cpp stores
    −exp(A_log)) as A_log; the conv's (channels, kernel) as MLX's (channels, kernel, 1). Norms
    need nothing: llama.cpp and mlx-lm both store Qwen's 1 + w (its gated norm's w as it is)."""
    role = _qwen35_role(gguf_name)
    n_k, n_v = config["linear_num_key_heads"], config["linear_num_value_heads"]
    if role in _QWEN35_V_HEADS and n_k != n_v and config["model_type"] in _TILED_V_HEADS:
        axis, past_qk = _QWEN35_V_HEADS[role]
        if past_qk:  # the rows of q and k, then those of v
            qk = 2 * config["linear_num_key_heads"] * config["linear_key_head_dim"]
            x = np.concatenate([x[:qk], _untile_v_heads(x[qk:], axis, n_k, n_v)])
        else:
            x = _untile_v_heads(x, axis, n_k, n_v)
    if role == "ssm_a":
        x = _a_log(gguf_name, x)
    if role == "ssm_conv1d":
        x = x[..., None]
    return x


def _a_log(gguf_name: str, a: np.ndarray) -> np.ndarray:
    """A Mamba-2 or Gated DeltaNet layer's A_log of what llama.cpp stores, -exp(A_log)."""
    a = a.astype(np.float64)
    if not np.all(np.isfinite(a) & (a < 0)):
        bad = a[~(np.isfinite(a) & (a < 0))][0]
        raise UserInputError(f"GGUF {gguf_name} must hold negative numbers (llama.cpp "
                             f"stores -exp(A_log)), got {bad}")
    return np.log(-a).astype(np.float32)


class _Part(NamedTuple):
    """A GGUF tensor's stand-in, read as the reader's tensors are: half of a fused tensor's
    rows, two tensors' rows regrouped (:func:`_rows`), or what llama.cpp takes where the
    file has no such tensor."""
    name: str
    tensor_type: Any
    shape: np.ndarray  # GGUF's order: columns first
    data: Any  # an array, or what np.asarray makes one of


def gemma4_tensors(tensors: dict, config: dict) -> dict:
    """A Gemma 4 GGUF's tensors as mlx-lm's gemma4_text has its parameters: the experts' fused
    gate/up stacks split into their gate and up halves (the gate first, as llama.cpp reads
    them); layer scalars and per-expert scales of 1 where the file has none (llama.cpp then
    scales by nothing); the unused key/value projections of layers that share keys dropped."""
    from gguf import GGMLQuantizationType as T

    n_layers = config["num_hidden_layers"]
    first_shared = n_layers - config["num_kv_shared_layers"]
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if parts[0] != "blk" or len(parts) != 4:
            out[name] = t
        elif int(parts[1]) >= first_shared and parts[2] in ("attn_k", "attn_v", "attn_k_norm"):
            continue  # llama.cpp reads a lower layer's keys and values there
        elif parts[2:] == ["ffn_gate_up_exps", "weight"]:
            shape = np.array(t.shape.tolist())
            if len(shape) != 3 or shape[1] % 2:
                raise UserInputError(f"GGUF {name} has shape {_shape(t)}, not the experts' "
                                     "gate and up rows")
            shape[1] //= 2
            halves = np.split(np.asarray(t.data), 2, axis=-2)
            for half, data in zip(("ffn_gate_exps", "ffn_up_exps"), halves):
                split = f"blk.{parts[1]}.{half}.weight"
                if split in tensors:
                    raise UserInputError(f"GGUF has both {name} and {split}")
                out[split] = _Part(split, t.tensor_type, shape, data)
        else:
            out[name] = t
    for i in range(n_layers):
        ones = {f"blk.{i}.layer_output_scale.weight": 1}
        if config["enable_moe_block"]:
            ones[f"blk.{i}.ffn_down_exps.scale"] = config["num_experts"]
        for name, n in ones.items():
            if name not in out:
                out[name] = _Part(name, T.F32, np.array([n]), np.ones(n, np.float32))
    return out


def gemma3n_tensors(tensors: dict, config: dict) -> dict:
    """A Gemma 3n GGUF's tensors as mlx-lm's gemma3n has its parameters: AltUp's stacked
    projections (``altup_proj``, ``altup_unembd_proj``: a matrix for each stream but the
    first) cut into one tensor each, ``<name>.<i>.weight``."""
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        if name not in ("altup_proj.weight", "altup_unembd_proj.weight"):
            out[name] = t
            continue
        shape = np.array(t.shape.tolist())
        if len(shape) != 3:
            raise UserInputError(f"GGUF {name} has shape {_shape(t)}, not a stack of matrices")
        for i, data in enumerate(np.asarray(t.data)):
            part = name.replace(".weight", f".{i}.weight")
            out[part] = _Part(part, t.tensor_type, shape[:2], data)
    return out


def ernie45_moe_tensors(tensors: dict, config: dict) -> dict:
    """An ERNIE 4.5 MoE GGUF's tensors without its routers' correction biases
    (``exp_probs_b``), which mlx-lm's ernie4_5_moe has no place for (it drops them from
    Hugging Face checkpoints too). llama.cpp adds a layer's bias to the experts' probabilities
    to pick them: one value for every expert picks the same ones and may go; any other is a
    :class:`UserInputError`, as mlx-lm would route otherwise, and so is a bias that is not one
    value per expert of a layer with a router (llama.cpp refuses such a file)."""
    out = {}
    for name, t in tensors.items():
        if ".exp_probs_b." not in name:
            out[name] = t
            continue
        bias, n = dequantized(t).ravel(), config["moe_num_experts"]
        router = name.replace(".exp_probs_b.bias", ".ffn_gate_inp.weight")
        if bias.size != n or router not in tensors:
            raise UserInputError(f"GGUF {name} must hold one value for each of the {n} experts "
                                 f"of a layer with a router ({router}); it holds {bias.size}"
                                 + ("" if router in tensors else " in a layer without one"))
        if not np.all(bias == bias[0]):
            raise UserInputError(f"GGUF ernie4_5-moe whose router correction bias ({name}) "
                                 "differs between experts is not supported: mlx-lm's "
                                 "ernie4_5_moe picks experts without it")
    return out


class _Lazy:
    """An array computed only when read (``np.asarray``, as the reader's tensors are)."""

    def __init__(self, make: Callable[[], np.ndarray]) -> None:
        self.make = make

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        x = self.make()
        return x if dtype is None else x.astype(dtype)


def _rows(tensors: list, order: np.ndarray, dequantize: bool) -> _Lazy:
    """GGUF tensors' rows stacked and put in the ``order`` given, gathered only when read,
    one tensor's memory at a time: their raw blocks (a row holds whole blocks, so rows move
    whole), or their values dequantized to float32 where the tensors' types differ."""
    def gather() -> np.ndarray:
        rows = [(dequantized(t) if dequantize else np.asarray(t.data)) for t in tensors]
        return np.concatenate([r.reshape(r.shape[0], -1) for r in rows])[order]

    return _Lazy(gather)


def qwen3next_tensors(tensors: dict, config: dict) -> dict:
    """A Qwen3-Next GGUF's tensors as mlx-lm's qwen3_next has its parameters: each
    linear-attention layer's ``attn_qkv`` (every key head's q rows, then every key head's k
    rows, then every value head's v rows) and ``attn_gate`` (z), which llama.cpp's converter
    cut out of the checkpoint's ``in_proj_qkvz``, put back in its order (for each key head its
    q, its k, then the v and the z of the value heads that read it) as one ``ssm_in``
    (llama.cpp's older GGUFs store it so). Both kept quantized where they are of one type,
    else dequantized."""
    from gguf import GGMLQuantizationType as T

    n_k, n_v = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    qk, v = n_k * dk, n_v * dv  # rows of q (and of k), of v (and of z)
    r = v // n_k  # v (and z) rows of the value heads reading one key head
    order = np.concatenate([np.r_[h * dk:(h + 1) * dk, qk + h * dk:qk + (h + 1) * dk,
                                  2 * qk + h * r:2 * qk + (h + 1) * r,
                                  2 * qk + v + h * r:2 * qk + v + (h + 1) * r]
                            for h in range(n_k)])
    out = dict(tensors)
    for name in tensors:
        if name.endswith(".attn_gate.weight") and \
                name.replace(".attn_gate.", ".attn_qkv.") not in tensors:
            raise UserInputError(f"GGUF has {name} without "
                                 f"{name.replace('.attn_gate.', '.attn_qkv.')}")
        if not name.endswith(".attn_qkv.weight"):
            continue
        gate, fused = (name.replace(".attn_qkv.", f".{role}.") for role in ("attn_gate", "ssm_in"))
        if gate not in tensors:
            raise UserInputError(f"GGUF has {name} without {gate}")
        if fused in tensors:
            raise UserInputError(f"GGUF has both {name} and {fused}")
        qkv, z = tensors[name], tensors[gate]
        for t, rows in ((qkv, 2 * qk + v), (z, v)):
            if _shape(t) != (rows, config["hidden_size"]):
                raise UserInputError(f"GGUF {t.name} has shape {_shape(t)}, the metadata implies "
                                     f"{(rows, config['hidden_size'])}")
        same = qkv.tensor_type == z.tensor_type
        out[fused] = _Part(fused, qkv.tensor_type if same else T.F32,
                           np.array([config["hidden_size"], len(order)]),
                           _rows([qkv, z], order, dequantize=not same))
        del out[name], out[gate]
    return out


def deepseek2_tensors(tensors: dict, config: dict) -> dict:
    """A deepseek2 GGUF's tensors as mlx-lm's model has its keys' and values' up-projection:
    llama.cpp's ``attn_k_b`` (heads, kv_lora_rank, qk_nope: each head's key rows transposed)
    and ``attn_v_b`` (heads, v_head, kv_lora_rank), which its converter cut out of the
    checkpoint's ``kv_b_proj`` (for each head its key rows, then its value rows), are
    deepseek_v3's and glm4_moe_lite's ``embed_q`` and ``unembed_out`` as they are, and fused
    back into ``attn_kv_b`` (dequantized: the key rows' blocks run along the other axis) for
    deepseek_v2 and youtu_llm; an older file's ``attn_kv_b`` is theirs as it is, and cut as
    mlx-lm's sanitize cuts it for the others (its value rows moved whole, kept quantized)."""
    from gguf import GGMLQuantizationType as T

    heads, rank = config["num_attention_heads"], config["kv_lora_rank"]
    nope, v = config["qk_nope_head_dim"], config["v_head_dim"]
    fused = config["model_type"] in ("deepseek_v2", "youtu_llm")
    shapes = {"attn_kv_b": (heads * (nope + v), rank), "attn_k_b": (heads, rank, nope),
              "attn_v_b": (heads, v, rank)}
    out = dict(tensors)
    for name, t in tensors.items():
        role = name.split(".")[2] if name.startswith("blk.") and name.count(".") == 3 else None
        if role not in shapes:
            continue
        if _shape(t) != shapes[role]:
            raise UserInputError(f"GGUF {name} has shape {_shape(t)}, the metadata implies "
                                 f"{shapes[role]}")
        kv, k, vb = (name.replace(f".{role}.", f".{r}.") for r in shapes)
        if role == "attn_kv_b" and (k in tensors or vb in tensors):
            raise UserInputError(f"GGUF has both {name} and {k if k in tensors else vb}")
        if role != "attn_kv_b" and not (k in tensors and vb in tensors):
            raise UserInputError(f"GGUF has {name} without {vb if k in tensors else k}")
        if role == "attn_kv_b" and not fused:  # each head's key rows transposed, its value rows
            def key_rows(t: Any = t) -> np.ndarray:
                rows = dequantized(t).reshape(heads, nope + v, rank)[:, :nope]
                return np.ascontiguousarray(rows.transpose(0, 2, 1))

            values = np.concatenate([np.arange(h * (nope + v) + nope, (h + 1) * (nope + v))
                                     for h in range(heads)])
            out[k] = _Part(k, T.F32, np.array([nope, rank, heads]), _Lazy(key_rows))
            out[vb] = _Part(vb, t.tensor_type, np.array([rank, v, heads]),
                            _rows([t], values, dequantize=False))
            del out[name]
        elif role == "attn_k_b" and fused:  # each head's key rows, then its value rows
            def kv_rows(kt: Any = t, vt: Any = tensors[vb]) -> np.ndarray:
                return np.concatenate([dequantized(kt).transpose(0, 2, 1), dequantized(vt)],
                                      axis=1).reshape(-1, rank)

            out[kv] = _Part(kv, T.F32, np.array([rank, heads * (nope + v)]), _Lazy(kv_rows))
            del out[name], out[vb]
    return out


def glm4_tensors(tensors: dict, config: dict) -> dict:
    """A GLM-4-0414 (or MiniCPM, MiniCPM3, DeepSeek-MoE) GGUF's tensors with a head: the
    embedding's where it has no ``output.weight``, as llama.cpp reads it (mlx-lm's glm4 and
    deepseek always have a head of their own; mlx-lm's minicpm and minicpm3 scale the logits only
    through one)."""
    out = dict(tensors)
    if "output.weight" not in tensors:
        t = tensors["token_embd.weight"]
        out["output.weight"] = _Part("output.weight", t.tensor_type, t.shape, t.data)
    return out


def xielu_tensors(tensors: dict, parameters: dict[str, list[float]]) -> dict:
    """An Apertus GGUF's tensors with its xIELU parameters (llama.cpp's metadata, a value per
    layer by mlx-lm's name: :func:`mlx_lazy.gguf_config.xielu_parameters`) as a float32
    scalar each, as mlx-lm's apertus holds them."""
    from gguf import GGMLQuantizationType as T

    out = dict(tensors)
    for name, values in parameters.items():
        for i, v in enumerate(values):
            key = f"blk.{i}.xielu_{name}"
            out[key] = _Part(key, T.F32, np.array([], np.int64), np.array(v, np.float32))
    return out


def lfm2_tensors(tensors: dict, config: dict, conv: str = ".shortconv.conv.weight") -> dict:
    """An LFM2 GGUF's tensors with each short convolution's kernel (those named ``*conv``),
    (channels, width) as llama.cpp's converter squeezed it, in MLX's Conv1d layout (channels,
    width, 1): the same taps in the same order (both convolve as a cross-correlation over the
    last width tokens)."""
    from gguf import GGMLQuantizationType as T

    out = dict(tensors)
    for name, t in tensors.items():
        if name.endswith(conv):
            shape = _shape(t)
            if len(shape) != 2:
                raise UserInputError(f"GGUF {name} has shape {shape}, not (channels, width)")
            out[name] = _Part(name, T.F32, np.array([1, shape[1], shape[0]]),
                              _Lazy(lambda t=t: dequantized(t)[..., None]))
    return out


def granitehybrid_tensors(tensors: dict, config: dict) -> dict:
    """A Granite 4.0 GGUF's tensors as mlx-lm's granitemoehybrid has its parameters: the
    Mamba-2 layers' conv kernels in MLX's layout (:func:`lfm2_tensors`), A_log of llama.cpp's
    -exp(A_log), A and D (heads, 1) and the gated norm's weight (groups, inner / groups) as
    vectors; each MoE layer's shared gate and up halves fused into ``input_linear`` (the gate
    first, as mlx-lm splits it), kept quantized where both are of one type."""
    from gguf import GGMLQuantizationType as T

    out = lfm2_tensors(tensors, config, ".ssm_conv1d.weight")
    for name, t in tensors.items():
        if name.endswith((".ssm_a", ".ssm_d", ".ssm_norm.weight")):
            size = int(np.prod(_shape(t)))
            a = name.endswith(".ssm_a")
            out[name] = _Part(name, T.F32, np.array([size]), _Lazy(
                lambda t=t, a=a: _a_log(t.name, dequantized(t)).ravel() if a
                else dequantized(t).ravel()))
        if not name.endswith(".ffn_gate_shexp.weight"):
            continue
        up = name.replace(".ffn_gate_shexp.", ".ffn_up_shexp.")
        if up not in tensors or _shape(tensors[up]) != _shape(t):
            raise UserInputError(f"GGUF {name} needs an {up} of its shape {_shape(t)}")
        fused, same = name.replace("_gate_shexp.", "_gate_up_shexp."), \
            t.tensor_type == tensors[up].tensor_type
        rows, cols = _shape(t)
        out[fused] = _Part(fused, t.tensor_type if same else T.F32, np.array([cols, 2 * rows]),
                           _rows([t, tensors[up]], np.arange(2 * rows), dequantize=not same))
        del out[name], out[up]
    return out


def mamba2_tensors_with_head(tensors: dict, config: dict) -> dict:
    """A Nemotron-H or Falcon-H1 GGUF's tensors: Granite 4.0's Mamba-2 layout
    (:func:`granitehybrid_tensors`) and a head, the embedding's where the GGUF has none
    (:func:`glm4_tensors`: mlx-lm's nemotron_h always has one; llama.cpp's Falcon-H1 head is
    the embedding as stored, which mlx-lm's tied falcon_h1 would scale)."""
    return glm4_tensors(granitehybrid_tensors(tensors, config), config)


def plamo2_tensors(tensors: dict, config: dict, offsets: dict = _PLAMO2_NORM_OFFSETS) -> dict:
    """A PLaMo 2 (or 3) GGUF's tensors as mlx-lm's plamo2 (plamo3) has its parameters: each
    norm's weight less the offset llama.cpp's converter added (``offsets``, by the norm's GGUF
    name's end: :func:`_offsets_removed`), the Mamba layers as Jamba's (:func:`jamba_tensors`:
    conv kernels in MLX's layout, A_log of llama.cpp's -exp(A_log))."""
    return _offsets_removed(jamba_tensors(tensors, config), offsets)


def _offsets_removed(tensors: dict, offsets: dict[str, float]) -> dict:
    """``tensors`` with each one whose name ends as a key of ``offsets`` less that offset (which
    llama.cpp's converter added; mlx-lm's norm adds it back), dequantized to float32."""
    from gguf import GGMLQuantizationType as T

    out = dict(tensors)
    for name, t in tensors.items():
        offset = next((v for end, v in offsets.items() if name.endswith(end)), None)
        if offset is not None:
            out[name] = _Part(name, T.F32, np.array(t.shape), _Lazy(
                lambda t=t, offset=offset:
                (dequantized(t).astype(np.float64) - offset).astype(np.float32)))
    return out


#: Muse Glimmer's norms around each branch: llama.cpp's converter stores 1 + w (its final norm
#: as it is), mlx-lm's CenteredRMSNorm w
_MUSE_GLIMMER_NORM_OFFSETS = dict.fromkeys((".attn_norm.weight", ".post_attention_norm.weight",
                                            ".ffn_norm.weight", ".post_ffw_norm.weight"), 1.0)


def muse_glimmer_tensors(tensors: dict, config: dict) -> dict:
    """A Muse Glimmer GGUF's tensors as mlx-lm's muse_glimmer has its parameters: its four
    norms around each branch less the 1 llama.cpp's converter added; the q/k norm weights
    dropped (the config's ``qk_scale_factor``: mlx-lm's q/k norms have none)."""
    return {name: t for name, t in _offsets_removed(tensors, _MUSE_GLIMMER_NORM_OFFSETS).items()
            if not name.endswith((".attn_q_norm.weight", ".attn_k_norm.weight"))}


def plamo_tensors(tensors: dict, config: dict) -> dict:
    """A PLaMo 1 GGUF's tensors as mlx-lm's plamo has its parameters: the query heads, which
    llama.cpp's converter put in grouped-query order (head i * n_shared_head + j holding the
    original head j * kv_heads + i, which reads key/value head i), back in the original order,
    raw blocks moved whole; the output projection's columns likewise (dequantized)."""
    from gguf import GGMLQuantizationType as T

    kv, d = config["num_attention_heads"] // config["n_shared_head"], config["head_dim"]
    heads = np.arange(config["num_attention_heads"]).reshape(kv, -1).T.ravel()
    order = (heads[:, None] * d + np.arange(d)).ravel()
    out = dict(tensors)
    for name, t in tensors.items():
        if name.endswith(".attn_q.weight"):
            out[name] = _reordered_rows(t, name, order)
        elif name.endswith(".attn_output.weight"):
            out[name] = _Part(name, T.F32, np.array(t.shape),
                              _Lazy(lambda t=t: dequantized(t)[:, order]))
    return out


def jamba_tensors(tensors: dict, config: dict, conv: Any = ".ssm_conv1d.weight") -> dict:
    """A Jamba GGUF's tensors as mlx-lm's jamba has its parameters (PLaMo 2's Mamba layers
    too, Kimi Linear's KDA ones: :func:`kimi_linear_tensors`): the conv kernels (those named
    ``*conv``) in MLX's layout (:func:`lfm2_tensors`), A_log (its shape as stored) of llama.cpp's
    -exp(A_log)."""
    from gguf import GGMLQuantizationType as T

    out = lfm2_tensors(tensors, config, conv)
    for name, t in tensors.items():
        if name.endswith(".ssm_a"):
            out[name] = _Part(name, T.F32, np.array(t.shape),
                              _Lazy(lambda t=t: _a_log(t.name, dequantized(t))))
    return out


def _kda_tensors(tensors: dict, config: dict) -> dict:
    """A KDA hybrid's tensors (Kimi Linear's, Ling 2.5's) with its latent attention's
    ``attn_k_b`` / ``attn_v_b`` as they are (:func:`deepseek2_tensors`) and its KDA layers'
    conv kernels, ggml's (width, 1, channels, 1) as llama.cpp's converter writes them, in
    MLX's layout (:func:`lfm2_tensors`)."""
    out = deepseek2_tensors(tensors, config)
    for name, t in tensors.items():
        if name.endswith(_KDA_CONVS):  # (channels, width), the same bytes
            out[name] = _Part(name, t.tensor_type, np.array([t.shape[0], np.prod(t.shape[1:])]),
                              t.data)
    return lfm2_tensors(out, config, _KDA_CONVS)


_KDA_CONVS = tuple(f".ssm_conv1d_{p}.weight" for p in "qkv")


def kimi_linear_tensors(tensors: dict, config: dict) -> dict:
    """A Kimi Linear GGUF's tensors as mlx-lm's kimi_linear has its parameters
    (:func:`_kda_tensors`), A_log of llama.cpp's -exp(A_log) as Jamba's
    (:func:`jamba_tensors`)."""
    return jamba_tensors(_kda_tensors(tensors, config), config, ())


def kimi_k3_tensors(tensors: dict, config: dict) -> dict:
    """A Kimi K3 GGUF's tensors as mlx-lm's kimi_k3 has its parameters: Kimi Linear's
    (:func:`kimi_linear_tensors`), each KDA layer's q, k and v projections and conv kernels
    fused, their rows in that order (``qkv_proj``, ``qkv_conv``; kept quantized where of one
    type), and each residual score (llama.cpp's converter multiplied the res_norm weight into
    the res_proj row) a (1, hidden) res_proj under a norm of ones."""
    from gguf import GGMLQuantizationType as T

    out = kimi_linear_tensors(tensors, config)
    for i in (layer - 1 for layer in config["linear_attn_config"]["kda_layers"]):
        for roles, role in ((("attn_q", "attn_k", "attn_v"), "attn_qkv"),
                            (tuple(f"ssm_conv1d_{p}" for p in "qkv"), "ssm_conv1d_qkv")):
            names = [f"blk.{i}.{r}.weight" for r in roles]
            if not all(name in out for name in names):
                continue  # (check_shapes names what is missing)
            parts, fused = [out.pop(name) for name in names], f"blk.{i}.{role}.weight"
            shape = np.array(parts[0].shape.tolist())
            shape[-1] = sum(int(p.shape[-1]) for p in parts)
            same = len({p.tensor_type for p in parts}) == 1
            out[fused] = _Part(fused, parts[0].tensor_type if same else T.F32, shape,
                               _rows(parts, np.arange(shape[-1]), dequantize=not same))
    for name, t in tensors.items():
        if name.endswith("res_score.weight"):
            norm, size = name.replace("_score.", "_norm."), int(np.prod(t.shape))
            out[name] = _Part(name, t.tensor_type, np.array([size, 1]), t.data)
            out[norm] = _Part(norm, T.F32, np.array([size]), np.ones(size, np.float32))
    return out


def bailingmoe3_tensors(tensors: dict, config: dict) -> dict:
    """A Ling 2.5/3 GGUF's tensors as mlx-lm's bailing_moe_v3 has its parameters
    (:func:`_kda_tensors`): A_log (heads,) of llama.cpp's exp(A_log) (heads, 1), the latent
    attention layers' output named apart from the KDA layers' (mlx-lm's ``dense``, the others'
    ``o_proj``)."""
    from gguf import GGMLQuantizationType as T

    out = _kda_tensors(tensors, config)
    for name, t in tensors.items():
        if name.endswith(".ssm_a"):
            out[name] = _Part(name, T.F32, np.array([np.prod(t.shape)]),
                              _Lazy(lambda t=t: _log_a(t.name, dequantized(t))))
        if name.endswith(".attn_output.weight") and \
                name.replace(".attn_output.", ".attn_kv_a_mqa.") in tensors:
            out[name.replace(".attn_output.", ".attn_dense.")] = out.pop(name)
    return out


def _log_a(gguf_name: str, a: np.ndarray) -> np.ndarray:
    """A KDA layer's A_log (heads,) of what llama.cpp's bailingmoe3 stores, exp(A_log)."""
    a = a.astype(np.float64).reshape(-1)
    if not np.all(np.isfinite(a) & (a > 0)):
        raise UserInputError(f"GGUF {gguf_name} must hold positive numbers (llama.cpp stores "
                             f"exp(A_log)), got {a[~(np.isfinite(a) & (a > 0))][0]}")
    return np.log(a).astype(np.float32)


def deci_tensors(tensors: dict, config: dict) -> dict:
    """A deci GGUF's tensors as mlx-lm's nemotron-nas has its parameters: the ``attn_output``
    of a layer whose attention is a linear map (llama.cpp's name for that map) as
    ``attn_linear``, mlx-lm's ``self_attn.linear``."""
    linear = {str(i) for i, block in enumerate(config["block_configs"])
              if block["attention"].get("replace_with_linear")}
    return {(name.replace(".attn_output.", ".attn_linear.")
             if name.startswith("blk.") and name.split(".")[1] in linear else name): t
            for name, t in tensors.items()}


def talkie_tensors(tensors: dict, config: dict) -> dict:
    """A Talkie GGUF's tensors as mlx-lm's talkie has its parameters: the second half of each
    head's q/k rows negated back (llama.cpp's converter negates them: its NeoX RoPE then turns
    them as Talkie's RoPE of negated frequencies does), dequantized; the query heads' gains
    (heads, 1) as (heads,); the head's gain, the config's ``logit_scale`` (taken out of it), a
    tensor."""
    from gguf import GGMLQuantizationType as T

    d = config["head_dim"]
    signs = np.where(np.arange(d) < d // 2, 1.0, -1.0).astype(np.float32)[:, None]

    def unflipped(t: Any) -> np.ndarray:
        x = dequantized(t).astype(np.float32)
        return (x.reshape(-1, d, x.shape[-1]) * signs).reshape(x.shape)

    out = {}
    for name, t in tensors.items():
        if name.endswith((".attn_q.weight", ".attn_k.weight")):
            out[name] = _Part(name, T.F32, np.array(t.shape), _Lazy(lambda t=t: unflipped(t)))
        elif name.endswith(".attn_q_norm.weight"):
            out[name] = _Part(name, T.F32, np.array(t.shape[1:]),
                              _Lazy(lambda t=t: dequantized(t).ravel()))
        elif name == "output.weight":  # a bare matrix: never kept quantized
            out[name] = _Part(name, T.F32, np.array(t.shape), _Lazy(lambda t=t: dequantized(t)))
        else:
            out[name] = t
    scale = np.array([config.pop("logit_scale")], np.float32)
    out["output_gain.w_g"] = _Part("output_gain.w_g", T.F32, np.array([1]), scale)
    return out


def stablelm_tensors(tensors: dict, config: dict) -> dict:
    """A StableLM GGUF's tensors with its q/k LayerNorms' weights, which llama.cpp's converter
    stacked (heads, head_dim), one per head as mlx-lm's stablelm holds them
    (``attn_q_norm.norms.<head>``)."""
    from gguf import GGMLQuantizationType as T

    out = dict(tensors)
    for name, t in tensors.items():
        if not name.endswith((".attn_q_norm.weight", ".attn_k_norm.weight")):
            continue
        if len(_shape(t)) != 2:
            raise UserInputError(f"GGUF {name} has shape {_shape(t)}, not (heads, head_dim)")
        del out[name]
        for h in range(_shape(t)[0]):
            head = name.replace(".weight", f".norms.{h}.weight")
            out[head] = _Part(head, T.F32, np.array([_shape(t)[1]]),
                              _Lazy(lambda t=t, h=h: dequantized(t)[h]))
    return out


def dots1_tensors(tensors: dict, config: dict) -> dict:
    """A dots.llm1, K-EXAONE or MiMo-V2-Flash GGUF's tensors with a zero correction bias in each
    sparse layer that has none (llama.cpp's optional ``exp_probs_b``: no bias; mlx-lm's dots1,
    exaone_moe and mimo_v2_flash always hold one)."""
    from gguf import GGMLQuantizationType as T

    out = dict(tensors)
    n = config.get("n_routed_experts") or config["num_experts"]
    sparse = config.get("is_moe_layer") or config.get("moe_layer_freq") or [
        i >= config["first_k_dense_replace"] for i in range(config["num_hidden_layers"])]
    for i in (i for i, moe in enumerate(sparse) if moe):
        name = f"blk.{i}.exp_probs_b.bias"
        if name not in out:
            out[name] = _Part(name, T.F32, np.array([n]), np.zeros(n, np.float32))
    return out


def _reordered_rows(t: Any, name: str, order: np.ndarray) -> _Part:
    """The GGUF tensor ``t`` (a matrix or a bias) as ``name``, holding its rows in ``order``:
    raw blocks moved whole (each row holds whole blocks), so quantized ones stay so."""
    return _Part(name, t.tensor_type, np.array([*t.shape.tolist()[:-1], len(order)]),
                 _rows([t], order, dequantize=False))


def phi2_tensors(tensors: dict, config: dict) -> dict:
    """A Phi-2 (or GLM-4-9B) GGUF's tensors with a fused ``attn_qkv`` (weight, bias: every q
    row, then k, then v, as older conversions and llama.cpp's loader take them) cut into
    mlx-lm's phi's (glm's) q, k and v projections."""
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    out = {}
    for name, t in tensors.items():
        if ".attn_qkv." not in name:
            out[name] = t
            continue
        if _shape(t)[0] != q + 2 * kv:
            raise UserInputError(f"GGUF {name} has shape {_shape(t)}, not q, k and v rows "
                                 f"({q} + {kv} + {kv})")
        for part, rows in zip("qkv", (np.arange(q), np.arange(q, q + kv),
                                      np.arange(q + kv, q + 2 * kv))):
            split = name.replace(".attn_qkv.", f".attn_{part}.")
            if split in tensors:
                raise UserInputError(f"GGUF has both {name} and {split}")
            out[split] = _reordered_rows(t, split, rows)
    return out


def gptneox_tensors(tensors: dict, config: dict) -> dict:
    """A GPT-NeoX GGUF's tensors with ``attn_qkv``'s rows (weight, bias), which llama.cpp's
    converter reordered to every head's q, then k, then v, back in the checkpoint's order that
    mlx-lm's gpt_neox splits: each head's q, k and v rows in turn."""
    heads, width = config["num_attention_heads"], config["hidden_size"]
    head = width // heads
    order = (np.arange(3)[None, :, None] * width + np.arange(heads)[:, None, None] * head
             + np.arange(head)[None, None, :]).ravel()
    out = dict(tensors)
    for name, t in tensors.items():
        if ".attn_qkv." in name:
            if _shape(t)[0] != len(order):
                raise UserInputError(f"GGUF {name} has shape {_shape(t)}, not q, k and v rows "
                                     f"(3 x {width})")
            out[name] = _reordered_rows(t, name, order)
    return out


def internlm2_tensors(tensors: dict, config: dict, arch: str = "internlm2") -> dict:
    """An InternLM2 (or Ling 1: ``arch`` bailingmoe) GGUF's tensors with each layer's
    ``attn_q``, ``attn_k`` and ``attn_v``, which llama.cpp's converter cut out of the
    checkpoint's ``wqkv`` (``query_key_value``; q/k rows permuted for its RoPE), un-permuted and
    put back in its order: for each key/value head, the queries of its group, its key, its value
    (Ling's: every query row, then every key row, then every value row; one ``attn_qkv``). Kept
    quantized where the three are of one type, else dequantized. Refused: q/k/v biases
    (mlx-lm's internlm2 takes them only with an output one, which llama.cpp never reads) and
    llama.cpp's own fused ``attn_qkv``."""
    from gguf import GGMLQuantizationType as T

    heads, kv, hidden, d = (config["num_attention_heads"], config["num_key_value_heads"],
                            config["hidden_size"], config["head_dim"])
    q = _unpermute_rows(np.arange(heads * d), heads)
    k = heads * d + _unpermute_rows(np.arange(kv * d), kv)
    v = (heads + kv) * d + np.arange(kv * d)
    group = heads // kv * d  # query rows of one key/value head
    order = np.concatenate([np.r_[q[g * group:(g + 1) * group], k[g * d:(g + 1) * d],
                                  v[g * d:(g + 1) * d]] for g in range(kv)]) \
        if arch == "internlm2" else np.concatenate([q, k, v])
    out = dict(tensors)
    for name in tensors:
        if name.endswith((".attn_q.bias", ".attn_k.bias", ".attn_v.bias", ".attn_qkv.bias")):
            raise UserInputError(f"GGUF {arch} with q/k/v biases ({name}) is not supported"
                                 + (" (mlx-lm's internlm2 takes them only with an output bias, "
                                    "which llama.cpp never reads)" if arch == "internlm2" else ""))
        if name.endswith(".attn_qkv.weight"):
            raise UserInputError(f"GGUF {arch} with fused q/k/v attention ({name}; "
                                 "llama.cpp's --fuse-qkv) is not supported")
        if not name.endswith(".attn_q.weight"):
            continue
        parts = [name.replace(".attn_q.", f".attn_{p}.") for p in "qkv"]
        for part, rows in zip(parts, (heads * d, kv * d, kv * d)):
            if part not in tensors:
                raise UserInputError(f"GGUF has {name} without {part}")
            if _shape(tensors[part]) != (rows, hidden):
                raise UserInputError(f"GGUF {part} has shape {_shape(tensors[part])}, the "
                                     f"metadata implies {(rows, hidden)}")
        ts = [tensors[part] for part in parts]
        same = len({t.tensor_type for t in ts}) == 1
        fused = name.replace(".attn_q.", ".attn_qkv.")
        out[fused] = _Part(fused, ts[0].tensor_type if same else T.F32,
                           np.array([hidden, len(order)]), _rows(ts, order, dequantize=not same))
        for part in parts:
            del out[part]
    return out


def gpt2_tensors(tensors: dict, config: dict) -> dict:
    """A GPT-2 GGUF's tensors without ``output.weight`` where it is a copy of the embedding
    (mlx-lm's gpt2 always reads the embedding as its head); a head of its own is refused."""
    out = dict(tensors)
    head, embedding = out.pop("output.weight", None), tensors["token_embd.weight"]
    if head is not None and not (head.tensor_type == embedding.tensor_type
                                 and np.array_equal(head.data, embedding.data)):
        raise UserInputError("GGUF gpt2 with a head of its own (output.weight, not the "
                             "embedding's copy) is not supported (mlx-lm's gpt2 ties it)")
    return out


def openelm_tensors(tensors: dict, config: dict) -> dict:
    """An OpenELM GGUF's tensors with each MLP's gate and up rows, which llama.cpp's converter
    cut out of the checkpoint's ``proj_1``, fused again (gate rows first) as mlx-lm's openelm
    holds them: kept quantized where both are of one type, else dequantized."""
    from gguf import GGMLQuantizationType as T

    out = dict(tensors)
    for name in tensors:
        if not name.endswith((".ffn_gate.weight", ".ffn_up.weight")):
            continue
        gate, up, fused = (f"blk.{name.split('.')[1]}.{role}.weight"
                           for role in ("ffn_gate", "ffn_up", "ffn_gate_up"))
        if gate not in tensors or up not in tensors:
            raise UserInputError(f"GGUF has {name} without {up if gate in tensors else gate}")
        if fused in out:
            continue
        halves = [tensors[gate], tensors[up]]
        shapes = [_shape(t) for t in halves]
        if shapes[0] != shapes[1] or len(shapes[0]) != 2:
            raise UserInputError(f"GGUF {gate} and {up} have shapes {shapes[0]} and "
                                 f"{shapes[1]}, not two halves of one projection")
        same = halves[0].tensor_type == halves[1].tensor_type
        out[fused] = _Part(fused, halves[0].tensor_type if same else T.F32,
                           np.array([shapes[0][1], 2 * shapes[0][0]]),
                           _rows(halves, np.arange(2 * shapes[0][0]), dequantize=not same))
        del out[gate], out[up]
    return out


#: DBRX's experts' stacks, by the name of each expert's matrix in mlx-lm's dbrx
_DBRX_EXPERTS = {"ffn_gate_exps": "w1", "ffn_up_exps": "v1", "ffn_down_exps": "w2"}


def dbrx_tensors(tensors: dict, config: dict) -> dict:
    """A DBRX GGUF's tensors with each experts' stack (gate, up: (experts, MLP, hidden); down:
    (experts, hidden, MLP), as llama.cpp's converter transposes it) cut into mlx-lm's dbrx's
    experts, one matrix each (``blk.<i>.ffn_exps.<expert>.<w1|v1|w2>``): raw blocks, so
    quantized ones stay so."""
    out = {}
    for name, t in tensors.items():
        role = name.split(".")[2] if name.startswith("blk.") else None
        if role not in _DBRX_EXPERTS:
            out[name] = t
            continue
        n = config["ffn_config"]["moe_num_experts"]
        if len(t.shape) != 3 or int(t.shape[-1]) != n:
            raise UserInputError(f"GGUF {name} has shape {_shape(t)}, not a stack of {n} "
                                 "experts' matrices")
        for e in range(n):
            part = name.replace(f".{role}.", f".ffn_exps.{e}.{_DBRX_EXPERTS[role]}.")
            out[part] = _Part(part, t.tensor_type, np.array(t.shape.tolist()[:-1]),
                              _Lazy(lambda t=t, e=e: np.asarray(t.data)[e]))
    return out


#: The architectures whose tensors are regrouped into mlx-lm's parameters once the config is
#: known (split, fused, or made up where llama.cpp takes a default)
REGROUPED = {"gemma4": gemma4_tensors, "gemma3n": gemma3n_tensors, "qwen3next": qwen3next_tensors,
             "ernie4_5-moe": ernie45_moe_tensors, "deepseek2": deepseek2_tensors,
             "mistral4": deepseek2_tensors, "deepseek32": deepseek2_tensors,
             "glm-dsa": deepseek2_tensors,
             "glm4": glm4_tensors, "lfm2": lfm2_tensors, "lfm2moe": lfm2_tensors,
             "stablelm": stablelm_tensors, "minicpm": glm4_tensors, "dots1": dots1_tensors,
             "exaone-moe": dots1_tensors, "mimo2": dots1_tensors,
             "llama4": glm4_tensors, "phi2": phi2_tensors, "gptneox": gptneox_tensors,
             "internlm2": internlm2_tensors, "gpt2": gpt2_tensors, "openelm": openelm_tensors,
             "deepseek": glm4_tensors, "minicpm3": glm4_tensors,
             "granitehybrid": granitehybrid_tensors, "chatglm": phi2_tensors,
             "jamba": jamba_tensors, "dbrx": dbrx_tensors, "deci": deci_tensors,
             "talkie": talkie_tensors,
             "bailingmoe": partial(internlm2_tensors, arch="bailingmoe"),
             **dict.fromkeys(("nemotron_h", "nemotron_h_moe", "falcon-h1"),
                             mamba2_tensors_with_head),
             "plamo2": plamo2_tensors, "plamo": plamo_tensors,
             "plamo3": partial(plamo2_tensors, offsets=_PLAMO3_NORM_OFFSETS),
             "kimi-linear": kimi_linear_tensors, "bailingmoe3": bailingmoe3_tensors,
             "kimi-k3": kimi_k3_tensors,
             "muse-glimmer": muse_glimmer_tensors}


def _hf_name(gguf_name: str, arch: str = "llama") -> str:
    if arch in QWEN35:  # mlx-lm's qwen3_5 holds the text model as its language_model
        return _QWEN35_PREFIX + _hf_name(gguf_name, "qwen3_5")
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
    layers, top = _ARCH_LAYOUT.get(arch, ("model.layers", _TOP_NAMES))
    if parts[0] == "blk" and len(parts) == 2 and suffix in names:  # no suffix: ssm_a
        return f"{layers}.{parts[1]}.{names[suffix]}"
    if parts[0] == "blk" and len(parts) == 3 and f"{parts[2]}.{suffix}" in names:
        return f"{layers}.{parts[1]}.{names[f'{parts[2]}.{suffix}']}"
    for end in range(len(parts), 2, -1):  # the longest role named: LFM2's shortconv.conv;
        role = ".".join(parts[2:end])  # attn_q_norm of StableLM's attn_q_norm.norms.3
        if parts[0] == "blk" and role in names:
            return ".".join((f"{layers}.{parts[1]}.{names[role]}", *parts[end:], suffix))
    if gguf_name in top:  # a bare parameter (Talkie's head)
        return top[gguf_name]
    if base in top:
        return f"{top[base]}.{suffix}"
    if len(parts) == 2 and parts[0] in top and parts[1].isdigit():  # one matrix of a stack
        return f"{top[parts[0]]}.{parts[1]}.{suffix}"
    raise UserInputError(f"unsupported GGUF tensor {gguf_name}")


def _shape(t: Any) -> tuple[int, ...]:
    """A GGUF tensor's logical (row-major) shape."""
    return tuple(int(n) for n in reversed(t.shape.tolist()))


def check_shapes(model: Any, tensors: dict, arch: str = "llama") -> None:
    """Compare the GGUF's tensors with the parameters of ``model``, mlx-lm's model of what
    its metadata describes."""
    from mlx.utils import tree_flatten

    expected = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    got = {_hf_name(name, arch): _shape(t) for name, t in tensors.items()}
    for name, t in tensors.items():
        if arch in DELTA_NET and _qwen35_role(name) == "ssm_conv1d":  # MLX's (C, K, 1)
            got[_hf_name(name, arch)] += (1,)
    if arch == "gemma3" and "lm_head.weight" not in got:
        expected.pop("lm_head.weight", None)  # tied: mlx-lm drops lm_head on load
    missing, extra = sorted(expected.keys() - got), sorted(got.keys() - expected)
    if missing or extra:
        what = (f"lacks {missing[0]}" if missing else f"has an unexpected tensor {extra[0]}")
        raise UserInputError(f"GGUF tensors disagree with its metadata: it {what} "
                             f"({len(missing)} missing, {len(extra)} unexpected)")
    for name, shape in got.items():
        if shape != expected[name]:
            raise UserInputError(f"GGUF tensors disagree with its metadata: {name} has shape "
                                 f"{shape}, the metadata implies {expected[name]}")


def _unpermute_rows(x: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (rows (h, 2, d/2) -> (h, d/2, 2) back to HF)."""
    rows = x.shape[0]
    return (x.reshape(n_heads, rows // n_heads // 2, 2, *x.shape[1:])
            .swapaxes(1, 2).reshape(x.shape))


def _affine(t: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """A Q4_0/Q4_1/Q8_0 tensor (a matrix or the experts' stack of them) as MLX affine (packed
    uint32 weight, scales, biases, bits).

    Each GGUF block of 32 values is one MLX group: Q8_0 is d·q (q int8) = d·(q+128) − 128d;
    Q4_0 is d·(q−8); Q4_1 is d·q + m.
    """
    from gguf import GGMLQuantizationType as T

    *lead, cols = _shape(t)
    blocks = np.asarray(t.data).reshape(*lead, cols // GGUF_GROUP_SIZE, -1)
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
    if t.tensor_type == T.Q8_0:
        q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        bias, bits = d * np.float16(-128), 8
    else:
        if t.tensor_type == T.Q4_1:
            bias, qs = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0], \
                blocks[..., 4:]
        else:
            bias, qs = d * np.float16(-8), blocks[..., 2:]
        q, bits = _nibbles_in_order(qs), 4
    packed = np.ascontiguousarray(q).reshape(*lead, -1).view(np.uint32)
    return packed, d, bias, bits


def _nibbles_in_order(qs: np.ndarray) -> np.ndarray:
    """A ggml block's 16 bytes of 4-bit values (values j and j + 16 in byte j, low nibble
    first) as MLX packs them: consecutive values, low nibble first."""
    nibbles = np.concatenate([qs & 15, qs >> 4], axis=-1)  # a block's values in order
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def mxfp4(t: Any) -> tuple[np.ndarray, np.ndarray]:
    """An MXFP4 tensor (a matrix or the experts' stack of them) as MLX's mxfp4 (packed uint32
    weight, uint8 scales).

    Both are OCP MX blocks of 32: one E8M0 scale byte (2^(e − 127)) and 32 FP4 E2M1 codes. ggml
    reads a code through a table of doubled values and halves the scale: the same numbers. Only
    the nibbles move.
    """
    *lead, cols = _shape(t)
    blocks = np.asarray(t.data).reshape(*lead, cols // GGUF_GROUP_SIZE, -1)
    scales = np.ascontiguousarray(blocks[..., 0])
    if (scales == 255).any():  # NaN in the MX format, 2^127 in ggml's reading
        raise UserInputError(f"GGUF {t.name} has an MXFP4 scale of 255 (not a number), which "
                             "cannot stay quantized; convert with --dtype to dequantize it")
    packed = np.ascontiguousarray(_nibbles_in_order(blocks[..., 1:]))
    return packed.reshape(*lead, -1).view(np.uint32), scales


def check_types(tensors: dict) -> None:
    """Fail on a tensor type the gguf package cannot dequantize (tried on one zero block)."""
    from gguf import GGML_QUANT_SIZES, dequantize

    for t in {t.tensor_type: t for t in tensors.values()}.values():
        try:
            dequantize(np.zeros((1, GGML_QUANT_SIZES[t.tensor_type][1]), np.uint8),
                       t.tensor_type)
        except NotImplementedError:
            raise UserInputError(f"unsupported GGUF tensor type {t.tensor_type.name} for "
                                 f"{t.name} (the gguf package cannot dequantize it)") from None


def dequantized(t: Any) -> np.ndarray:
    """The GGUF tensor ``t`` dequantized by the gguf package, in its logical shape."""
    from gguf import dequantize

    return dequantize(np.asarray(t.data), t.tensor_type).reshape(_shape(t))


#: GGUF tensors whose mlx-lm parameter no quantized layer holds, by model type: GLM-4.5's and
#: DeepSeek's routers (a matrix of mlx-lm's MoEGate; llama.cpp's quantizer leaves routers float
#: anyway)
_FLOAT_ONLY = dict.fromkeys(("glm4_moe", "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "dots1",
                             "exaone_moe", "mimo_v2_flash", "nemotron_h", "deepseek_v32",
                             "glm_moe_dsa"),
                            ".ffn_gate_inp.weight")


def _kept(t: Any, dtype: str | None, config: dict | None = None) -> bool:
    """Whether the GGUF tensor ``t`` stays quantized (``dtype=None``; weights of Q4_0/Q4_1/Q8_0
    and MXFP4, but where a layout change splits their blocks or mlx-lm's module is no layer
    it quantizes)."""
    from gguf import GGMLQuantizationType as T

    float_only = _FLOAT_ONLY.get(config["model_type"]) if config is not None else None
    return (dtype is None and t.tensor_type in (T.Q4_0, T.Q4_1, T.Q8_0, T.MXFP4)
            and t.name.endswith(".weight") and len(t.shape) >= 2
            and not (float_only and t.name.endswith(float_only))
            and not _qwen35_straddles(t, config))


def kept_quantization(arch: str, tensors: dict, dtype: str | None,
                      config: dict | None = None) -> dict:
    """The config's ``quantization`` for the tensors that stay quantized ({} if none): the
    bits and mode most of them have, and each other module's own."""
    from gguf import GGMLQuantizationType as T

    kinds = {T.Q8_0: (8, "affine"), T.MXFP4: (4, "mxfp4")}
    kind_of = {_hf_name(name, arch).rsplit(".", 1)[0]: kinds.get(t.tensor_type, (4, "affine"))
               for name, t in tensors.items() if _kept(t, dtype, config)}
    if not kind_of:
        return {}
    values = list(kind_of.values())
    common = max(sorted(set(values)), key=values.count)
    quant: dict[str, Any] = {"group_size": GGUF_GROUP_SIZE, "bits": common[0], "mode": common[1]}
    for module, (bits, mode) in kind_of.items():
        if (bits, mode) != common:
            quant[module] = {"group_size": GGUF_GROUP_SIZE, "bits": bits, "mode": mode}
    return quant


def gguf_arrays(arch: str, tensors: dict, config: dict, dtype: str | None,
                requantize: dict[str, dict],
                cast: Callable[[str], bool] = lambda _: True) -> Iterator[tuple[str, mx.array]]:
    """Each GGUF tensor as the mlx-lm named arrays it becomes, one tensor at a time: kept
    quantized (:func:`_kept`), or dequantized to ``dtype`` (float32 where ``cast``, mlx-lm's
    ``cast_predicate`` of the model, says a parameter keeps its precision: Qwen3.5's A_log,
    GLM-4.5's expert-score correction bias) and, for a module in ``requantize``, quantized
    with its parameters."""
    from gguf import GGMLQuantizationType as T

    target = getattr(mx, dtype or DEFAULT_GGUF_DTYPE)
    heads = {"self_attn.q_proj": config["num_attention_heads"],
             "self_attn.k_proj": config["num_key_value_heads"]}
    for gname, t in tensors.items():
        module, _, suffix = _hf_name(gname, arch).rpartition(".")  # (module "": bare)
        n_heads = heads.get(module.split(".", 3)[-1]) if arch in LLAMA_FAMILY else None
        kept = _kept(t, dtype, config)
        if kept and t.tensor_type == T.MXFP4:  # packed weights and their scale bytes
            parts = dict(zip(("weight", "scales"), mxfp4(t)))
        elif kept:
            w, scales, biases, _ = _affine(t)
            # packed weights and their float16 scales/biases stay as they are
            parts = {"weight": w, "scales": scales, "biases": biases}
        else:
            x = dequantized(t)
            if arch in _NORMS_PLUS_ONE and gname.endswith("norm.weight"):
                # llama.cpp stores the multiplier 1 + w of these norms; mlx-lm adds the 1
                x = x.astype(np.float32) - 1.0
            parts = {suffix: x}
        for key, x in parts.items():
            if n_heads is not None:  # (deci's key/value heads by layer: its rows' heads)
                x = _unpermute_rows(x, x.shape[0] // config["head_dim"] if arch == "deci"
                                    else n_heads)
            if arch in DELTA_NET:
                x = _delta_net_layout(gname, x, config)
            x = mx.array(x)
            parts[key] = (x if kept else
                          x.astype(target if cast(f"{module}.{key}") else mx.float32))
        if suffix == "weight" and module in requantize:
            w, scales, biases = mx.quantize(parts["weight"], **requantize[module])
            parts = {"weight": w, "scales": scales, "biases": biases}
        for key, x in parts.items():
            yield f"{module}.{key}" if module else key, x
