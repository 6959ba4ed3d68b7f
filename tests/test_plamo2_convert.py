"""GGUF conversion of PLaMo 2 (llama.cpp's ``plamo2``, mlx-lm's ``plamo2``): tiny GGUFs written
as llama.cpp's converter writes them, converted, and compared with mlx-lm's model of the
original checkpoint."""

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
from test_convert import T, assert_one_line_error, run_main
from test_lfm2_convert import assert_converted_runs, hybrid_gguf_name, write_model
from tiny_models import tiny_config

#: llama.cpp's names of mlx-lm's plamo2 layer parameters (gguf-py's tensor_mapping; a name
#: ending in "." takes no suffix)
GGUF_NAMES = {"pre_mixer_norm": "attn_norm", "mixer.qkv_proj": "attn_qkv",
              "mixer.o_proj": "attn_output", "post_mixer_norm": "post_attention_norm.",
              "pre_mlp_norm": "ffn_norm", "post_mlp_norm": "post_ffw_norm.",
              "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "mixer.in_proj": "ssm_in", "mixer.conv1d": "ssm_conv1d", "mixer.bcdt_proj": "ssm_x",
              "mixer.dt_proj": "ssm_dt", "mixer.out_proj": "ssm_out"}
#: What llama.cpp's converter adds to each norm's weight (Plamo2Model.modify_tensors), by role
NORM_OFFSETS = {"attn_norm": 1.0, "post_attention_norm": 1 / 5, "ffn_norm": 1.0,
                "post_ffw_norm": 1 / 5 ** 1.5, "output_norm": 1.0}
#: parameters named by llama.cpp without a suffix (or another one)
GGUF_PARAMETERS = {"q_weight": "attn_q_norm.weight", "k_weight": "attn_k_norm.weight",
                   "dt_bias": "ssm_dt.bias", "dt_norm_weight": "ssm_dt_norm",
                   "B_norm_weight": "ssm_b_norm", "C_norm_weight": "ssm_c_norm",
                   "A_log": "ssm_a", "D": "ssm_d"}


gguf_name = partial(hybrid_gguf_name, layers="model.layers.layers.", names=GGUF_NAMES,
                    top={"model.embed_tokens": "token_embd", "model.norm": "output_norm",
                         "lm_head": "output"},
                    parameters={f"mixer.{k}": v for k, v in GGUF_PARAMETERS.items()})

def write_plamo2_gguf(path: Path, tok_folder: Path, types: dict | None = None,
                      meta: dict | None = None, **overrides) -> tuple[dict, dict]:
    """A random-weight PLaMo 2 written as llama.cpp's converter writes it (Plamo2Model): heads
    and key/value heads per layer (0 in the Mamba layers), the SSM's sizes (no groups), each
    norm's weight plus mlx-lm's offset, A as -exp(A_log), the conv kernels squeezed; PLaMo 2's
    epsilon, 1e-6. ``types``,
    ``meta``: as write_lfm2_gguf's. Returns (config, reference weights in mlx-lm's layout)."""
    config = {**tiny_config("plamo2"), "rms_norm_eps": 1e-6, **overrides}  # (PLaMo 2's)
    module = importlib.import_module("mlx_lm.models.plamo2")
    model = module.Model(module.ModelArgs.from_dict(config))
    shapes = {k: v.shape for k, v in tree_flatten(model.parameters())}
    attention = [not layer.is_mamba for layer in model.layers]

    def layout(role: str, x: np.ndarray) -> np.ndarray:
        if role in NORM_OFFSETS:
            return x + np.float32(NORM_OFFSETS[role])
        if role == "ssm_a":
            return -np.exp(x)
        return x[..., 0] if role == "ssm_conv1d" else x

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    kv = {"block_count": config["num_hidden_layers"],
          "context_length": config["max_position_embeddings"],
          "embedding_length": config["hidden_size"],
          "feed_forward_length": config["intermediate_size"],
          "head_count": [heads if a else 0 for a in attention],
          "head_count_kv": [kv_heads if a else 0 for a in attention],
          "key_length": config["hidden_size_per_head"],
          "value_length": config["hidden_size_per_head"],
          "layer_norm_rms_eps": config["rms_norm_eps"], "rope_freq_base": 10000.0,
          "ssm_conv_kernel": config["mamba_d_conv"], "ssm_state_size": config["mamba_d_state"],
          "ssm_time_step_rank": config["mamba_num_heads"],
          "ssm_inner_size": config["mamba_num_heads"] * config["hidden_size_per_head"],
          "ssm_group_count": 0}
    reference = write_model(path, "plamo2", shapes, gguf_name, {**kv, **(meta or {})},
                            tok_folder, {"attn_q_norm": T.F32, "attn_k_norm": T.F32,
                                         **(types or {})}, None, "refact", layout)
    return config, reference


@pytest.mark.parametrize("dtype", ["float32", None])
def test_plamo2_from_gguf(dtype, tiny_model_dir, tmp_path):
    """A PLaMo 2 GGUF becomes mlx-lm's plamo2 (Mamba and attention layers where the original's
    are, by mamba_step; its SSM's sizes; each norm less llama.cpp's offset) and computes what
    the GGUF's tensors do in mlx-lm's model of the original checkpoint, float32 or kept quantized
    (as test_lfm2_from_gguf: 1e-5, sums in another order); and runs in the engine unpruned as in
    mlx-lm. The float32 one has an RMS epsilon other than PLaMo 2's: its q/k norms keep the 1e-6
    mlx-lm's plamo2 hard-wires (llama.cpp's take the GGUF's)."""
    types = {"token_embd": T.Q8_0, "attn_qkv": T.Q4_0, "ssm_in": T.Q4_1, "ffn_up": T.Q4_0,
             "*": T.Q8_0} if dtype is None else None
    config, reference = write_plamo2_gguf(tmp_path / "m.gguf", tiny_model_dir("plamo2"), types,
                                          rms_norm_eps=1e-5 if dtype else 1e-6)
    out = convert(tmp_path / "m.gguf", tmp_path / "out", dtype=dtype)
    saved = json.loads((out / "config.json").read_text())
    settings = {k: config[k] for k in (
        "model_type", "mamba_step", "hidden_size_per_head", "mamba_num_heads", "mamba_d_state",
        "mamba_d_conv", "num_attention_heads", "num_key_value_heads", "intermediate_size",
        "tie_word_embeddings")}
    assert {k: saved[k] for k in settings} == settings
    assert bool(saved.get("quantization")) == (dtype is None)
    assert_converted_runs(mlx_lm.load(str(out))[0], "plamo2", config, reference, dtype is None)


@pytest.mark.parametrize("meta, fragment", [
    ({"head_count_kv": [2, 0, 0, 2]}, "GGUF plamo2 with attention in layers [0, 3] is not "
                                      "supported (mlx-lm's plamo2 takes them every mamba_step"),
    ({"ssm_group_count": 1}, "GGUF plamo2 with SSM groups or an inner size of 128 for 8 heads"),
    ({"rope_freq_base": 1e6}, "GGUF plamo2 with RoPE base 1e+06 is not supported"),
    ({"ssm_state_size": None}, "GGUF metadata lacks plamo2."),
], ids=["layout", "groups", "rope-base", "no-state"])
def test_plamo2_bad_input(meta, fragment, tiny_model_dir, tmp_path, capsys):
    """What mlx-lm's plamo2 cannot express as llama.cpp runs it (or llama.cpp requires) is
    refused in one line, nothing written."""
    write_plamo2_gguf(tmp_path / "m.gguf", tiny_model_dir("plamo2"), meta=meta)
    before = set(tmp_path.iterdir())
    rc, err = run_main(capsys, str(tmp_path / "m.gguf"), str(tmp_path / "out"))
    assert_one_line_error(rc, err, fragment)
    assert set(tmp_path.iterdir()) == before
