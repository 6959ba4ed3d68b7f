"""GGUF conversion of Jamba (llama.cpp's ``jamba``, mlx-lm's ``jamba``) without experts: tiny
GGUFs written as llama.cpp's converter writes them, converted, and compared with mlx-lm's model
of the original checkpoint; what mlx-lm's jamba cannot compute as llama.cpp does is refused."""

from __future__ import annotations

from functools import partial
import json
from pathlib import Path

import mlx_lm
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from mlx.utils import tree_flatten

from mlx_lazy.convert import convert
from test_convert import assert_one_line_error, run_main
from test_lfm2_convert import assert_converted_runs, hybrid_gguf_name, write_model
from tiny_models import tiny_config

#: llama.cpp's names of mlx-lm's jamba layer parameters (gguf-py's tensor_mapping)
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "input_layernorm": "attn_norm", "pre_ff_layernorm": "ffn_norm",
              **{f"feed_forward.{p}_proj": f"ffn_{p}" for p in ("gate", "up", "down")},
              "mamba.in_proj": "ssm_in", "mamba.conv1d": "ssm_conv1d", "mamba.x_proj": "ssm_x",
              "mamba.dt_proj": "ssm_dt", "mamba.dt_layernorm": "ssm_dt_norm",
              "mamba.b_layernorm": "ssm_b_norm", "mamba.c_layernorm": "ssm_c_norm",
              "mamba.out_proj": "ssm_out"}


gguf_name = partial(hybrid_gguf_name, layers="model.layers.", names=GGUF_NAMES,
                    top={"model.embed_tokens": "token_embd", "model.final_layernorm": "output_norm",
                         "lm_head": "output"},
                    parameters={"mamba.A_log": "ssm_a", "mamba.D": "ssm_d"})

def write_jamba_gguf(path: Path, tok_folder: Path, types: dict | None = None,
                     meta: dict | None = None, extra: dict | None = None,
                     **overrides) -> tuple[dict, dict]:
    """A random-weight Jamba without experts (the tiny kind's layers, one dense MLP each) written
    as llama.cpp's converter writes it (JambaModel, ported): key/value heads per layer (0 in
    the Mamba layers), the SSM's sizes, A as -exp(A_log), the conv kernels squeezed to
    (channels, width), q/k unpermuted (no RoPE). ``types``, ``meta``, ``extra``: as
    write_lfm2_gguf's. Returns (config, reference weights in mlx-lm's layout)."""
    config = {**tiny_config("jamba"), "num_experts": 1, "num_experts_per_tok": 1,
              "intermediate_size": 96, **overrides}
    from mlx_lm.models import jamba

    shapes = {k: v.shape for k, v in tree_flatten(jamba.Model(jamba.ModelArgs.from_dict(
        config)).parameters())}
    types_of_layers = jamba.ModelArgs.from_dict(config).layers_block_type

    def layout(role: str, x: np.ndarray) -> np.ndarray:
        if role == "ssm_a":
            return -np.exp(x)
        return x[..., 0] if role == "ssm_conv1d" and x.ndim == 3 else x  # (not its bias)

    kv = {"block_count": config["num_hidden_layers"],
          "context_length": config["max_position_embeddings"],
          "embedding_length": config["hidden_size"],
          "feed_forward_length": config["intermediate_size"],
          "head_count": config["num_attention_heads"],
          "head_count_kv": [config["num_key_value_heads"] if t == "attention" else 0
                            for t in types_of_layers],
          "layer_norm_rms_eps": config["rms_norm_eps"],
          "ssm_conv_kernel": config["mamba_d_conv"],
          "ssm_inner_size": config["mamba_expand"] * config["hidden_size"],
          "ssm_state_size": config["mamba_d_state"],
          "ssm_time_step_rank": config["mamba_dt_rank"], "expert_count": 1,
          "expert_used_count": 1}
    reference = write_model(path, "jamba", shapes, gguf_name, {**kv, **(meta or {})},
                            tok_folder, types or {}, extra, "refact", layout)
    return config, reference


@pytest.mark.parametrize("dtype", ["float32", None])
def test_jamba_from_gguf(dtype, tiny_model_dir, tmp_path):
    """A Jamba GGUF without experts becomes mlx-lm's jamba (Mamba and attention layers where the
    original's are, its SSM's sizes, time-step rank, the conv's bias, an untied head) and
    computes what the GGUF's tensors do in mlx-lm's model of the original checkpoint (A_log
    from llama.cpp's -exp(A_log), the kernels in MLX's layout), float32 or kept quantized (as
    test_lfm2_from_gguf: float32 scales; 1e-5: sums in another order); and runs in the engine
    unpruned as in mlx-lm."""
    types = {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "ssm_in": T.Q4_1, "ssm_x": T.Q4_0,
             "ssm_a": T.F32, "*": T.Q8_0} if dtype is None else None
    config, reference = write_jamba_gguf(tmp_path / "m.gguf", tiny_model_dir("jamba"), types)
    out = convert(tmp_path / "m.gguf", tmp_path / "out", dtype=dtype)
    saved = json.loads((out / "config.json").read_text())
    settings = {k: config[k] for k in (
        "model_type", "attn_layer_offset", "attn_layer_period", "num_key_value_heads",
        "intermediate_size",
        "mamba_d_conv", "mamba_d_state", "mamba_expand", "mamba_dt_rank", "mamba_conv_bias",
        "mamba_proj_bias", "num_experts", "tie_word_embeddings")}
    assert {k: saved[k] for k in settings} == settings
    assert bool(saved.get("quantization")) == (dtype is None)
    assert_converted_runs(mlx_lm.load(str(out))[0], "jamba", config, reference, dtype is None)


@pytest.mark.parametrize("meta, extra, fragment", [
    ({}, {"blk.1.ffn_gate_inp.weight": np.zeros((4, 64))},
     "GGUF jamba with experts is not supported (llama.cpp weighs the chosen experts by their "
     "softmax over all of them, mlx-lm's jamba renormalises over the chosen ones)"),
    ({"ssm_inner_size": 64}, {}, "GGUF jamba with an SSM inner size of 64 is not supported "
                                 "(llama.cpp requires twice the hidden size 64)"),
    ({"head_count_kv": 2}, {}, "GGUF jamba with 8 attention layers of 8 is not supported "
                               "(mlx-lm's jamba takes Mamba and attention layers"),
    ({"head_count_kv": [0, 2, 0, 2, 0, 0, 0, 2]}, {},
     "GGUF jamba with attention in layers [1, 3, 7] is not supported (mlx-lm's jamba takes "
     "them every attn_layer_period-th layer from attn_layer_offset)"),
    ({"ssm_time_step_rank": None}, {}, "GGUF metadata lacks jamba."),
    ({}, {"blk.0.ssm_a": np.full((128, 16), 0.5)},
     "GGUF blk.0.ssm_a must hold negative numbers (llama.cpp stores -exp(A_log)), got 0.5"),
], ids=["experts", "inner-size", "all-attention", "aperiodic", "no-dt-rank", "a-not-negative"])
def test_jamba_bad_input(meta, extra, fragment, tiny_model_dir, tmp_path, capsys):
    """What mlx-lm's jamba cannot compute as llama.cpp does (or llama.cpp requires) is refused
    in one line, nothing written."""
    write_jamba_gguf(tmp_path / "m.gguf", tiny_model_dir("jamba"), meta=meta, extra=extra)
    before = set(tmp_path.iterdir())
    rc, err = run_main(capsys, str(tmp_path / "m.gguf"), str(tmp_path / "out"))
    assert_one_line_error(rc, err, fragment)
    assert set(tmp_path.iterdir()) == before
