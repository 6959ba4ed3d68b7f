"""GGUF conversion of Nemotron-H's MoE layout (llama.cpp's ``nemotron_h_moe``, Nemotron 3 Nano;
mlx-lm's ``nemotron_h``): tiny GGUFs written as llama.cpp's converter writes them, converted, and
compared with mlx-lm's model of the original checkpoint."""

from __future__ import annotations

from functools import partial
import importlib
import json
from pathlib import Path

import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_lazy.convert import convert
from test_convert import T, assert_refused, gguf_permute, llama_cpp_mtp_block
from test_lfm2_convert import assert_converted_runs, hybrid_gguf_name, write_model
from tiny_models import tiny_config

#: llama.cpp's names of mlx-lm's nemotron_h layer parameters (gguf-py's tensor_mapping)
GGUF_NAMES = {"norm": "attn_norm", **{f"mixer.{p}_proj": f"attn_{p}" for p in "qkv"},
              "mixer.o_proj": "attn_output", "mixer.in_proj": "ssm_in",
              "mixer.conv1d": "ssm_conv1d", "mixer.norm": "ssm_norm", "mixer.out_proj": "ssm_out",
              "mixer.gate": "ffn_gate_inp", "mixer.switch_mlp.fc1": "ffn_up_exps",
              "mixer.switch_mlp.fc2": "ffn_down_exps",
              "mixer.shared_experts.up_proj": "ffn_up_shexp",
              "mixer.shared_experts.down_proj": "ffn_down_shexp",
              "mixer.fc1_latent_proj": "ffn_latent_down", "mixer.fc2_latent_proj": "ffn_latent_up"}
#: Parameters of their own: Mamba-2's (no suffix in llama.cpp), the dt and correction biases
GGUF_PARAMETERS = {"mixer.A_log": "ssm_a", "mixer.D": "ssm_d", "mixer.dt_bias": "ssm_dt.bias",
                   "mixer.gate.e_score_correction_bias": "exp_probs_b.bias"}


gguf_name = partial(hybrid_gguf_name, layers="backbone.layers.", names=GGUF_NAMES,
                    top={"backbone.embeddings": "token_embd", "backbone.norm_f": "output_norm",
                         "lm_head": "output"}, parameters=GGUF_PARAMETERS)

def write_nemotron_h_moe_gguf(path: Path, tok_folder: Path, types: dict | None = None,
                              meta: dict | None = None, extra: dict | None = None,
                              **overrides) -> tuple[dict, dict]:
    """A random-weight Nemotron-H MoE (the tiny nemotron_h with experts in its MLP layer too)
    written as llama.cpp's converter writes it (NemotronHModel, GraniteHybridModel's, ported):
    key/value heads and feed-forward widths per layer (0 where a layer has none), the SSM's
    sizes (heads as ssm.time_step_rank), the experts' keys, q/k rows permuted (invisible: no
    RoPE), A as -exp(A_log) and A, D (1, heads), the gated norm (groups, inner / groups), the
    conv kernels squeezed to (channels, width). Returns (config, reference weights in mlx-lm's
    layout)."""
    config = tiny_config("nemotron_h")
    config = {**config, "hybrid_override_pattern": [
        "E" if c == "-" else c for c in config["hybrid_override_pattern"]], **overrides}
    module = importlib.import_module("mlx_lm.models.nemotron_h")
    shapes = {k: v.shape for k, v in tree_flatten(module.Model(module.ModelArgs.from_dict(
        config)).parameters())}
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    pattern = config["hybrid_override_pattern"]

    def layout(role: str, x: np.ndarray) -> np.ndarray:
        if role in ("attn_q", "attn_k"):
            return gguf_permute(x, heads if role == "attn_q" else kv_heads)
        if role in ("ssm_a", "ssm_d"):
            return (-np.exp(x) if role == "ssm_a" else x)[:, None]
        if role == "ssm_norm":
            return x.reshape(config["n_groups"], -1)
        return x[..., 0] if role == "ssm_conv1d" and x.ndim == 3 else x

    kv = {"block_count": len(pattern), "context_length": config["max_position_embeddings"],
          "embedding_length": config["hidden_size"],
          "feed_forward_length": [config["moe_intermediate_size"] if c == "E" else 0
                                  for c in pattern],
          "head_count": heads, "head_count_kv": [kv_heads if c == "*" else 0 for c in pattern],
          "key_length": config["head_dim"], "value_length": config["head_dim"],
          "layer_norm_eps": config["layer_norm_epsilon"],
          "layer_norm_rms_eps": config["layer_norm_epsilon"],
          "ssm_conv_kernel": config["conv_kernel"],
          "ssm_inner_size": config["mamba_num_heads"] * config["mamba_head_dim"],
          "ssm_state_size": config["ssm_state_size"],
          "ssm_time_step_rank": config["mamba_num_heads"], "ssm_group_count": config["n_groups"],
          "expert_count": config["n_routed_experts"],
          "expert_used_count": config["num_experts_per_tok"],
          "expert_feed_forward_length": config["moe_intermediate_size"],
          "expert_shared_feed_forward_length": config["moe_shared_expert_intermediate_size"],
          "expert_shared_count": config["n_shared_experts"],
          "expert_weights_norm": config["norm_topk_prob"],
          "expert_weights_scale": config["routed_scaling_factor"],
          "expert_group_count": config["n_group"],
          "moe_latent_size": config.get("moe_latent_size")}
    reference = write_model(path, "nemotron_h_moe", shapes, gguf_name, {**kv, **(meta or {})},
                            tok_folder, types or {}, extra, "refact", layout)
    return config, reference


@pytest.mark.parametrize("dtype", ["float32", None])
@pytest.mark.parametrize("case", ["nano", "latent", "nextn"])
def test_nemotron_h_moe_from_gguf(case, dtype, tiny_model_dir, tmp_path):
    """A Nemotron-H MoE GGUF becomes mlx-lm's nemotron_h (Mamba-2, attention and expert layers
    where the original's are, the SSM's sizes and groups, attention biases, the experts' keys;
    through latent projections in ``latent``; its NextN block dropped in ``nextn``) and computes
    what the GGUF's tensors do in mlx-lm's model of the original checkpoint, float32 or kept
    quantized (1e-5: sums in another order); and runs in the engine unpruned as in mlx-lm."""
    types = {"token_embd": T.Q8_0, "ssm_in": T.Q4_0, "ffn_up_exps": T.Q4_1, "attn_q": T.Q4_0,
             "*": T.Q8_0} if dtype is None else None
    overrides = {"moe_latent_size": 32} if case == "latent" else {}
    n = len(tiny_config("nemotron_h")["hybrid_override_pattern"])
    meta, extra = {}, {}
    if case == "nextn":  # llama.cpp's converter folds the MTP head into one trailing block
        base = tiny_config("nemotron_h")
        pattern = ["E" if c == "-" else c for c in base["hybrid_override_pattern"]]
        meta = {"block_count": n + 1, "nextn_predict_layers": 1,
                "head_count_kv": [base["num_key_value_heads"] if c == "*" else 0
                                  for c in pattern] + [base["num_key_value_heads"]],
                "feed_forward_length": [32 if c == "E" else 0 for c in pattern] + [32]}
        extra = llama_cpp_mtp_block(base, n)
    config, reference = write_nemotron_h_moe_gguf(tmp_path / "m.gguf",
                                                  tiny_model_dir("nemotron_h"), types, meta,
                                                  extra, **overrides)
    out = convert(tmp_path / "m.gguf", tmp_path / "out", dtype=dtype)
    saved = json.loads((out / "config.json").read_text())
    settings = {k: config[k] for k in (
        "hybrid_override_pattern", "num_key_value_heads", "attention_bias", "mamba_num_heads",
        "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel", "use_conv_bias",
        "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
        "moe_shared_expert_intermediate_size", "norm_topk_prob", "routed_scaling_factor",
        "tie_word_embeddings")}
    assert {k: saved[k] for k in settings} == settings
    assert saved["moe_latent_size"] == config.get("moe_latent_size")
    assert saved["num_hidden_layers"] == n
    assert_converted_runs(mlx_lm.load(str(out))[0], "nemotron_h", config, reference,
                          dtype is None)


@pytest.mark.parametrize("meta, fragment", [
    ({"expert_used_count": 1}, "GGUF nemotron_h_moe renormalising the weight of one expert a "
                               "token is not supported"),
    ({"ssm_inner_size": 124}, "GGUF nemotron_h_moe with an SSM inner size of 124 for 8 heads in "),
    ({"head_count_kv": [0] * 8}, "GGUF nemotron_h_moe with layers "),
])
def test_nemotron_h_moe_bad_input(meta, fragment, tiny_model_dir, tmp_path, capsys):
    """What mlx-lm's nemotron_h cannot express (or llama.cpp would not read): one line,
    nothing written."""
    write_nemotron_h_moe_gguf(tmp_path / "m.gguf", tiny_model_dir("nemotron_h"), meta=meta)
    assert_refused(tmp_path / "m.gguf", tmp_path, capsys, fragment)
