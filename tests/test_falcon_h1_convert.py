"""GGUF conversion of Falcon-H1 (llama.cpp's ``falcon-h1``, mlx-lm's ``falcon_h1``): tiny GGUFs
written as llama.cpp's converter writes them, converted, and compared with mlx-lm's model of
the original checkpoint."""

from __future__ import annotations

from functools import partial
import importlib
import json
from pathlib import Path

import mlx_lm
import pytest
from mlx.utils import tree_flatten

from mlx_lazy.convert import convert
from test_convert import T, assert_one_line_error, run_main
from test_granite4_convert import GGUF_NAMES as GRANITE_NAMES, GGUF_PARAMETERS
from test_lfm2_convert import assert_converted_runs, hybrid_gguf_name, write_model
from test_nemotron_h_convert import mamba2_layout
from tiny_models import tiny_config

#: llama.cpp's names of mlx-lm's falcon_h1 layer parameters: Granite 4.0's attention and
#: Mamba-2 ones, the MLP at feed_forward after pre_ff_layernorm
GGUF_NAMES = {**{k: v for k, v in GRANITE_NAMES.items()
                 if k.startswith(("self_attn.", "mamba.")) or k == "input_layernorm"},
              **{f"feed_forward.{p}_proj": f"ffn_{p}" for p in ("gate", "up", "down")},
              # its MLP's norm: llama.cpp's converter maps the whole name, no suffix
              "pre_ff_layernorm": "ffn_norm."}


gguf_name = partial(hybrid_gguf_name, layers="model.layers.", names=GGUF_NAMES,
                    top={"model.embed_tokens": "token_embd", "model.final_layernorm": "output_norm",
                         "lm_head": "output"},
                    parameters={f"mamba.{k}": v for k, v in GGUF_PARAMETERS.items()})

def write_falcon_h1_gguf(path: Path, tok_folder: Path, types: dict | None = None,
                         meta: dict | None = None, extra: dict | None = None,
                         **overrides) -> tuple[dict, dict]:
    """A random-weight Falcon-H1 (an untied head, one SSM group) written as llama.cpp's
    converter writes it (FalconH1Model, a Mamba2Model): the multipliers folded into the tensors
    (random ones here), the SSM's sizes (heads as ssm.time_step_rank), head_dim as key/value
    length, q/k as they are (NeoX RoPE), the Mamba-2 tensors in its layout
    (:func:`mamba2_layout`). ``types``, ``meta``, ``extra``: as write_lfm2_gguf's (``extra``
    ``{"output.weight": None}``: a tied head, the embedding). Returns (config, reference
    weights in mlx-lm's layout)."""
    config = {**tiny_config("falcon_h1"), "mamba_n_groups": 1, "tie_word_embeddings": False,
              **overrides}
    module = importlib.import_module("mlx_lm.models.falcon_h1")
    shapes = {k: v.shape for k, v in tree_flatten(module.Model(module.ModelArgs.from_dict(
        config)).parameters())}
    kv = {"block_count": config["num_hidden_layers"],
          "context_length": config["max_position_embeddings"],
          "embedding_length": config["hidden_size"],
          "feed_forward_length": config["intermediate_size"],
          "head_count": config["num_attention_heads"],
          "head_count_kv": config["num_key_value_heads"],
          "key_length": config["head_dim"], "value_length": config["head_dim"],
          "layer_norm_rms_eps": config["rms_norm_eps"], "rope_freq_base": config["rope_theta"],
          "ssm_conv_kernel": config["mamba_d_conv"], "ssm_inner_size": config["mamba_d_ssm"],
          "ssm_state_size": config["mamba_d_state"],
          "ssm_time_step_rank": config["mamba_n_heads"],
          "ssm_group_count": config["mamba_n_groups"]}
    reference = write_model(path, "falcon-h1", shapes, gguf_name, {**kv, **(meta or {})},
                            tok_folder, types or {}, extra, "refact",
                            lambda role, x: mamba2_layout(role, x, config["mamba_n_groups"]))
    if "output.weight" in (extra or {}):  # llama.cpp's head is then the embedding, unscaled
        reference["lm_head.weight"] = reference["model.embed_tokens.weight"]
    return config, reference


#: one SSM group under the gated norm; 2 groups without one
CASES = {"norm": {}, "groups": {"mamba_n_groups": 2, "mamba_rms_norm": False}}


@pytest.mark.parametrize("dtype, case, tied", [("float32", "norm", False),
                                               ("float32", "groups", True), (None, "norm", False)],
                         ids=["float32", "groups-tied", "kept"])
def test_falcon_h1_from_gguf(dtype, case, tied, tiny_model_dir, tmp_path):
    """A Falcon-H1 GGUF becomes mlx-lm's falcon_h1 (Mamba-2 beside attention, its SSM's sizes,
    the gated norm where the GGUF has one, a head of its own: the embedding as stored where the
    GGUF has none, unscaled as llama.cpp's) and computes what the GGUF's tensors do in mlx-lm's
    model of the original checkpoint, float32 or kept quantized (as test_lfm2_from_gguf: 1e-5,
    sums in another order); and runs in the engine unpruned as in mlx-lm."""
    types = {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "ssm_in": T.Q4_1, "ffn_down": T.Q4_0,
             "*": T.Q8_0} if dtype is None else None
    config, reference = write_falcon_h1_gguf(tmp_path / "m.gguf", tiny_model_dir("falcon_h1"),
                                             types, extra={"output.weight": None} if tied
                                             else None, **CASES[case])
    out = convert(tmp_path / "m.gguf", tmp_path / "out", dtype=dtype)
    saved = json.loads((out / "config.json").read_text())
    settings = {k: config[k] for k in (
        "model_type", "mamba_d_ssm", "mamba_n_heads", "mamba_d_head", "mamba_n_groups",
        "mamba_d_state", "mamba_d_conv", "mamba_rms_norm", "head_dim", "num_key_value_heads",
        "intermediate_size", "tie_word_embeddings")}
    assert {k: saved[k] for k in settings} == settings
    assert saved["mamba_conv_bias"]  # (mlx-lm's default, the tiny's)
    assert bool(saved.get("quantization")) == (dtype is None)
    assert_converted_runs(mlx_lm.load(str(out))[0], "falcon_h1", config, reference,
                          dtype is None)


@pytest.mark.parametrize("meta, overrides, fragment", [
    ({"ssm_group_count": 2}, {}, "GGUF falcon-h1 with a gated norm over 2 SSM groups is not "
                                 "supported (mlx-lm's falcon_h1 normalises all groups at once"),
    ({"attention_scale": 0.5}, {}, "GGUF falcon-h1 with attention scale 0.5 is not supported"),
    ({"ssm_time_step_rank": 6}, {}, "GGUF falcon-h1 with an SSM inner size of 128 for 6 heads"),
    ({"ssm_state_size": None}, {}, "GGUF metadata lacks falcon-h1."),
    ({}, {"attention_bias": True}, "GGUF tensors disagree with its metadata: it has an "
                                   "unexpected tensor model.layers.0.self_attn."),
], ids=["groups-norm", "scale", "heads", "no-state", "attention-bias"])
def test_falcon_h1_bad_input(meta, overrides, fragment, tiny_model_dir, tmp_path, capsys):
    """What mlx-lm's falcon_h1 cannot express as llama.cpp runs it (or llama.cpp requires) is
    refused in one line, nothing written: attention biases too (llama.cpp's graph skips the
    output one, mlx-lm's model has it with the others)."""
    write_falcon_h1_gguf(tmp_path / "m.gguf", tiny_model_dir("falcon_h1"), meta=meta,
                         **overrides)
    before = set(tmp_path.iterdir())
    rc, err = run_main(capsys, str(tmp_path / "m.gguf"), str(tmp_path / "out"))
    assert_one_line_error(rc, err, fragment)
    assert set(tmp_path.iterdir()) == before
