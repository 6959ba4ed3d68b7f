"""GGUF conversion of Ling 2.5/3 (llama.cpp's ``bailingmoe3``, mlx-lm's ``bailing_moe_v3``): tiny
GGUFs written as llama.cpp's converter writes them, converted, and compared with mlx-lm's model
of the original checkpoint; what mlx-lm's bailing_moe_v3 cannot compute as llama.cpp does is
refused."""

from __future__ import annotations

import json
from pathlib import Path

import mlx_lm
import numpy as np
import pytest
from gguf import ExpertGatingFuncType, GGMLQuantizationType as T
from mlx.utils import tree_flatten

from mlx_lazy.convert import convert
from test_convert import assert_one_line_error, run_main
from test_kimi_linear_convert import GGUF_NAMES as KIMI_NAMES
from test_lfm2_convert import assert_converted_runs, hybrid_gguf_name, write_model
from tiny_models import tiny_config

#: llama.cpp's names of mlx-lm's bailing_moe_v3 layer parameters (Kimi Linear's at
#: ``attention``; the KDA layers' full-rank gates, the latent attention's output ``dense``)
GGUF_NAMES = {**{k.replace("self_attn.", "attention.").replace("_conv.conv", "_conv1d"): v
                 for k, v in KIMI_NAMES.items()},
              "attention.f_proj": "ssm_f_a", "attention.g_proj": "ssm_g_a",
              "attention.dense": "attn_output", "attention.q_a_proj": "attn_q_a",
              "attention.q_a_layernorm": "attn_q_a_norm", "attention.q_b_proj": "attn_q_b"}
#: The tiny kind with an RMS epsilon other than Ling's 1e-6 (mlx-lm's KDA q/k norms keep their
#: 1e-6, llama.cpp's take the GGUF's), the safe gate's bound (mlx-lm's default) written out
GGUF_CONFIG = {"rms_norm_eps": 1e-5, "kda_lower_bound": -5.0}


def write_bailingmoe3_gguf(path: Path, tok_folder: Path, types: dict | None = None,
                           meta: dict | None = None, extra: dict | None = None
                           ) -> tuple[dict, dict]:
    """A random-weight Ling 2.5 (the tiny kind's layers, :data:`GGUF_CONFIG`) written as
    llama.cpp's converter writes it (BailingMoeV3Model, ported): one latent key/value head in
    the attention layers (0 in the KDA ones), the MLA and KDA widths, the safe gate's bound,
    the MoE's keys, A as exp(A_log) (heads, 1), the conv kernels as (1, channels, 1, width), the
    latent attention's gate attn_gate, kv_b_proj as attn_k_b / attn_v_b (mlx-lm's embed_q /
    unembed_out). ``types``, ``meta``, ``extra``: as write_lfm2_gguf's. Returns (config,
    reference weights in mlx-lm's layout)."""
    config = {**tiny_config("bailing_moe_v3"), **GGUF_CONFIG}
    from mlx_lm.models import bailing_moe_v3

    model = bailing_moe_v3.Model(bailing_moe_v3.ModelArgs.from_dict(config))
    shapes = {k: v.shape for k, v in tree_flatten(model.parameters())}
    linear = [layer.is_linear for layer in model.layers]
    name_of = hybrid_gguf_name
    top = {"model.word_embeddings": "token_embd", "model.norm": "output_norm",
           "lm_head": "output"}
    parameters = {"attention.A_log": "ssm_a", "attention.dt_bias": "ssm_dt.bias",
                  "mlp.gate.expert_bias": "exp_probs_b.bias", "mlp.gate.weight":
                  "ffn_gate_inp.weight"}

    def gguf_name(name: str) -> str:
        if name.endswith(".attention.g_proj.weight") and not linear[int(name.split(".")[2])]:
            return f"blk.{name.split('.')[2]}.attn_gate.weight"
        return name_of(name, top, "model.layers.", GGUF_NAMES, parameters)

    def layout(role: str, x: np.ndarray) -> np.ndarray:
        if role == "ssm_a":
            return np.exp(x).reshape(-1, 1)
        return x[..., 0][None, :, None] if role.startswith("ssm_conv1d") else x

    rank, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
    kv = {"block_count": config["num_hidden_layers"],
          "context_length": config["max_position_embeddings"],
          "embedding_length": config["hidden_size"],
          "feed_forward_length": config["intermediate_size"],
          "head_count": config["num_attention_heads"],
          "head_count_kv": [0 if lin else 1 for lin in linear],
          "layer_norm_rms_eps": config["rms_norm_eps"], "rope_freq_base": config["rope_theta"],
          "ssm_conv_kernel": config["short_conv_kernel_size"],
          "kda.head_dim": config["head_dim"], "kda.safe_gate": True,
          "kda.gate_lower_bound": config["kda_lower_bound"],
          "q_lora_rank": config["q_lora_rank"], "kv_lora_rank": rank,
          "rope_dimension_count": rope, "key_length": rank + rope,
          "key_length_mla": config["qk_nope_head_dim"] + rope,
          "value_length_mla": config["v_head_dim"], "vocab_size": config["vocab_size"],
          "expert_count": config["num_experts"],
          "expert_used_count": config["num_experts_per_tok"],
          "expert_feed_forward_length": config["moe_intermediate_size"],
          "expert_shared_feed_forward_length": config["moe_shared_expert_intermediate_size"],
          "expert_shared_count": config["num_shared_experts"],
          "leading_dense_block_count": config["first_k_dense_replace"],
          "expert_weights_scale": config["routed_scaling_factor"], "expert_weights_norm": True,
          "expert_gating_func": ExpertGatingFuncType.SIGMOID,
          "expert_group_count": config["n_group"],
          "expert_group_used_count": config["topk_group"]}
    reference = write_model(path, "bailingmoe3", shapes, gguf_name, {**kv, **(meta or {})},
                            tok_folder, types or {}, extra, "refact", layout)
    return config, reference


@pytest.mark.parametrize("dtype", ["float32", None])
def test_bailingmoe3_from_gguf(dtype, tiny_model_dir, tmp_path):
    """A Ling 2.5/3 GGUF becomes mlx-lm's bailing_moe_v3 (KDA layers where the original's are,
    by its layer_group_size, its widths, the safe gate's bound, low-rank queries, the experts'
    groups and scale, the shared MLP's width) and computes what the GGUF's tensors do in
    mlx-lm's model of the original checkpoint (A_log from llama.cpp's exp(A_log), the kernels
    in MLX's layout, the latent attention's gate and output apart from the KDA layers'), float32
    or kept quantized (as test_lfm2_from_gguf: float32 scales; 1e-5: sums in another order);
    and runs in the engine unpruned as in mlx-lm."""
    types = {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "ffn_gate_exps": T.Q4_0,
             "ssm_f_a": T.Q8_0, "ffn_down_shexp": T.Q4_1} if dtype is None else None
    config, reference = write_bailingmoe3_gguf(tmp_path / "m.gguf",
                                               tiny_model_dir("bailing_moe_v3"), types)
    out = convert(tmp_path / "m.gguf", tmp_path / "out", dtype=dtype)
    saved = json.loads((out / "config.json").read_text())
    settings = {k: config[k] for k in (
        "model_type", "layer_group_size", "head_dim", "short_conv_kernel_size",
        "kda_lower_bound", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
        "qk_nope_head_dim", "v_head_dim", "num_experts", "num_experts_per_tok",
        "moe_intermediate_size", "moe_shared_expert_intermediate_size", "num_shared_experts",
        "first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor",
        "tie_word_embeddings")}
    assert {k: saved[k] for k in settings} == settings
    assert bool(saved.get("quantization")) == (dtype is None)
    assert_converted_runs(mlx_lm.load(str(out))[0], "bailing_moe_v3", config, reference,
                          dtype is None)


@pytest.mark.parametrize("meta, extra, fragment", [
    ({"head_count_kv": [0, 0, 1, 0, 0, 0, 1, 0]}, {},
     "GGUF bailingmoe3 with attention in layers [2, 6] is not supported (mlx-lm's "
     "bailing_moe_v3 takes it every layer_group_size-th layer)"),
    ({"expert_weights_norm": False}, {}, "GGUF bailingmoe3 without renormalised expert weights "
                                         "(expert_weights_norm) is not supported"),
    ({"swiglu_clamp_exp": [0.0] + [7.0] * 7}, {},
     "GGUF bailingmoe3 with swiglu_clamp_exp is not supported"),
    ({"kda.gate_lower_bound": 1.0}, {}, "GGUF bailingmoe3 needs a safe KDA gate with a "
                                        "negative kda.gate_lower_bound"),
    ({}, {"blk.0.ssm_a": np.full((4, 1), -0.5)},
     "GGUF blk.0.ssm_a must hold positive numbers (llama.cpp stores exp(A_log)), got -0.5"),
], ids=["aperiodic", "unnormalised", "clamp", "unsafe-gate", "a-not-positive"])
def test_bailingmoe3_bad_input(meta, extra, fragment, tiny_model_dir, tmp_path, capsys):
    """What mlx-lm's bailing_moe_v3 cannot compute as llama.cpp does (or llama.cpp requires) is
    refused in one line, nothing written."""
    write_bailingmoe3_gguf(tmp_path / "m.gguf", tiny_model_dir("bailing_moe_v3"), meta=meta,
                           extra=extra)
    before = set(tmp_path.iterdir())
    rc, err = run_main(capsys, str(tmp_path / "m.gguf"), str(tmp_path / "out"))
    assert_one_line_error(rc, err, fragment)
    assert set(tmp_path.iterdir()) == before
