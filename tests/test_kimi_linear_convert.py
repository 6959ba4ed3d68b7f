"""GGUF conversion of Kimi Linear (llama.cpp's ``kimi-linear``, mlx-lm's ``kimi_linear``): tiny
GGUFs written as llama.cpp's converter writes them, converted, and compared with mlx-lm's model
of the original checkpoint; what mlx-lm's kimi_linear cannot compute as llama.cpp does is
refused."""

from __future__ import annotations

from functools import partial
import json
from pathlib import Path
from types import SimpleNamespace

import mlx_lm
import numpy as np
import pytest
from gguf import ExpertGatingFuncType, GGMLQuantizationType as T
from mlx.utils import tree_flatten

from mlx_lazy.convert import convert
from test_convert import assert_one_line_error, run_main
from test_lfm2_convert import assert_converted_runs, hybrid_gguf_name, write_model
from tiny_models import tiny_config

#: llama.cpp's names of mlx-lm's kimi_linear layer parameters (gguf-py's tensor_mapping, the
#: converter's renames)
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              **{f"self_attn.{p}_conv.conv": f"ssm_conv1d_{p}" for p in "qkv"},
              **{f"self_attn.{p}_{ab}_proj": f"ssm_{p}_{ab}" for p in "fg" for ab in "ab"},
              "self_attn.b_proj": "ssm_beta", "self_attn.o_norm": "ssm_norm",
              "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
              "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.embed_q": "attn_k_b",
              "self_attn.unembed_out": "attn_v_b", "mlp.gate": "ffn_gate_inp",
              **{f"mlp.{p}_proj": f"ffn_{p}" for p in ("gate", "up", "down")},
              **{f"mlp.switch_mlp.{p}_proj": f"ffn_{p}_exps" for p in ("gate", "up", "down")},
              **{f"mlp.shared_experts.{p}_proj": f"ffn_{p}_shexp"
                 for p in ("gate", "up", "down")}}

gguf_name = partial(hybrid_gguf_name, layers="model.layers.", names=GGUF_NAMES,
                    top={"model.embed_tokens": "token_embd", "model.norm": "output_norm",
                         "lm_head": "output"},
                    parameters={"self_attn.A_log": "ssm_a", "self_attn.dt_bias": "ssm_dt.bias",
                                "mlp.e_score_correction_bias": "exp_probs_b.bias"})
#: The tiny kind as llama.cpp can hold it: KDA heads as many as attention heads, no expert
#: groups, the RMS epsilon of mlx-lm's KDA q/k norms (llama.cpp's take the GGUF's)
GGUF_CONFIG = {"linear_attn_config": {**tiny_config("kimi_linear")["linear_attn_config"],
                                      "num_heads": 4, "head_dim": 16},
               "num_expert_group": 1, "topk_group": 1, "rms_norm_eps": 1e-6}


def write_kimi_linear_gguf(path: Path, tok_folder: Path, types: dict | None = None,
                           meta: dict | None = None, extra: dict | None = None
                           ) -> tuple[dict, dict]:
    """A random-weight Kimi Linear (the tiny kind's layers, :data:`GGUF_CONFIG`) written as
    llama.cpp's converter writes it (KimiLinearModel, ported): key/value heads per layer (0 in
    the KDA layers, 1 latent head in the others), the MLA and KDA widths, the MoE's keys, A as
    -exp(A_log), the conv kernels as (1, channels, 1, width), kv_b_proj as attn_k_b / attn_v_b
    (mlx-lm's embed_q / unembed_out). ``types``, ``meta``, ``extra``: as write_lfm2_gguf's.
    Returns (config, reference weights in mlx-lm's layout)."""
    config = {**tiny_config("kimi_linear"), **GGUF_CONFIG}
    from mlx_lm.models import kimi_linear

    shapes = {k: v.shape for k, v in tree_flatten(kimi_linear.Model(
        kimi_linear.ModelArgs.from_dict(config)).parameters())}
    kda = config["linear_attn_config"]["kda_layers"]

    def layout(role: str, x: np.ndarray) -> np.ndarray:
        if role == "ssm_a":
            return -np.exp(x)
        return x[..., 0][None, :, None] if role.startswith("ssm_conv1d") else x

    rank, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
    kv = {"block_count": config["num_hidden_layers"],
          "context_length": config["model_max_length"],
          "embedding_length": config["hidden_size"],
          "feed_forward_length": config["intermediate_size"],
          "head_count": config["num_attention_heads"],
          "head_count_kv": [0 if i + 1 in kda else 1 for i in range(config["num_hidden_layers"])],
          "layer_norm_rms_eps": config["rms_norm_eps"], "rope_freq_base": config["rope_theta"],
          "ssm_conv_kernel": config["linear_attn_config"]["short_conv_kernel_size"],
          "kda_head_dim": config["linear_attn_config"]["head_dim"], "kv_lora_rank": rank,
          "rope_dimension_count": rope, "key_length": rank + rope,
          "key_length_mla": config["qk_nope_head_dim"] + rope,
          "value_length_mla": config["v_head_dim"], "vocab_size": config["vocab_size"],
          "expert_count": config["num_experts"],
          "expert_used_count": config["num_experts_per_token"],
          "expert_feed_forward_length": config["moe_intermediate_size"],
          "expert_shared_count": config["num_shared_experts"],
          "leading_dense_block_count": config["first_k_dense_replace"],
          "expert_weights_scale": config["routed_scaling_factor"],
          "expert_gating_func": ExpertGatingFuncType.SIGMOID}
    reference = write_model(path, "kimi-linear", shapes, gguf_name, {**kv, **(meta or {})},
                            tok_folder, types or {}, extra, "refact", layout)
    return config, reference


@pytest.mark.parametrize("dtype", ["float32", None])
def test_kimi_linear_from_gguf(dtype, tiny_model_dir, tmp_path):
    """A Kimi Linear GGUF becomes mlx-lm's kimi_linear (KDA layers where the original's are,
    its widths, latent attention without RoPE, the experts' routing and scale) and computes
    what the GGUF's tensors do in mlx-lm's model of the original checkpoint (A_log from
    llama.cpp's -exp(A_log), the kernels in MLX's layout), float32 or kept quantized (as
    test_lfm2_from_gguf: float32 scales; 1e-5: sums in another order); and runs in the engine
    unpruned as in mlx-lm."""
    types = {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "ffn_gate_exps": T.Q4_0,
             "ssm_f_a": T.Q8_0, "ffn_down_shexp": T.Q4_1} if dtype is None else None
    config, reference = write_kimi_linear_gguf(tmp_path / "m.gguf", tiny_model_dir("kimi_linear"),
                                               types)
    out = convert(tmp_path / "m.gguf", tmp_path / "out", dtype=dtype)
    saved = json.loads((out / "config.json").read_text())
    settings = {k: config[k] for k in (
        "model_type", "linear_attn_config", "kv_lora_rank", "qk_rope_head_dim",
        "qk_nope_head_dim", "v_head_dim", "num_experts", "num_experts_per_token",
        "num_shared_experts", "first_k_dense_replace", "routed_scaling_factor",
        "num_expert_group", "tie_word_embeddings")}
    assert {k: saved[k] for k in settings} == {**settings, "linear_attn_config": {
        **settings["linear_attn_config"], "full_attn_layers": [4, 8]}}
    assert saved["moe_router_activation_func"] == "sigmoid"
    assert bool(saved.get("quantization")) == (dtype is None)
    assert_converted_runs(mlx_lm.load(str(out))[0], "kimi_linear", config, reference,
                          dtype is None)


@pytest.mark.parametrize("meta, extra, fragment", [
    ({}, {"blk.3.attn_q_a.weight": np.zeros((32, 64))},
     "GGUF kimi-linear with low-rank queries (attn_q_a) is not supported (mlx-lm's kimi_linear "
     "projects its queries in one step)"),
    ({"expert_used_count": 1}, {}, "GGUF kimi-linear with one expert per token is not "
                                   "supported (llama.cpp renormalises its weight to 1"),
    ({"expert_gating_func": SimpleNamespace(value=3)}, {},
     "GGUF kimi-linear with expert gating function 3 is not "
                                    "supported (mlx-lm's kimi_linear routes by softmax (1) or "
                                    "sigmoid (2))"),
    ({"head_count_kv": 1}, {}, "GGUF kimi-linear with 8 attention layers of 8 is not supported "
                               "(mlx-lm's kimi_linear takes Kimi Delta Attention and attention "
                               "layers"),
    ({"kda_head_dim": None}, {}, "GGUF metadata lacks kimi-linear."),
    ({"layer_norm_rms_eps": 1e-5}, {}, "GGUF kimi-linear with norm epsilon 1e-05 is not "
                                       "supported (llama.cpp normalises the KDA layers' q/k with "
                                       "it, mlx-lm's kimi_linear with 1e-06)"),
    ({}, {"blk.0.ssm_a": np.full((1, 1, 4, 1), 0.5)},
     "GGUF blk.0.ssm_a must hold negative numbers (llama.cpp stores -exp(A_log)), got 0.5"),
], ids=["low-rank-queries", "one-expert", "gating", "all-attention", "no-kda-head-dim", "eps",
        "a-not-negative"])
def test_kimi_linear_bad_input(meta, extra, fragment, tiny_model_dir, tmp_path, capsys):
    """What mlx-lm's kimi_linear cannot compute as llama.cpp does (or llama.cpp requires) is
    refused in one line, nothing written."""
    write_kimi_linear_gguf(tmp_path / "m.gguf", tiny_model_dir("kimi_linear"), meta=meta,
                           extra=extra)
    before = set(tmp_path.iterdir())
    rc, err = run_main(capsys, str(tmp_path / "m.gguf"), str(tmp_path / "out"))
    assert_one_line_error(rc, err, fragment)
    assert set(tmp_path.iterdir()) == before
