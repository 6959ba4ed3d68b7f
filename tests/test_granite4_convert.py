"""GGUF conversion of Granite 4.0's hybrids (llama.cpp's ``granitehybrid``, mlx-lm's
``granitemoehybrid``): tiny GGUFs written as llama.cpp's converter writes them, converted, and
compared with mlx-lm's model of the original checkpoint."""

from __future__ import annotations

from functools import partial
import importlib
import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_lazy.convert import convert
from test_convert import T, assert_one_line_error, gguf_permute, run_main
from test_lfm2_convert import assert_converted_runs, hybrid_gguf_name, write_model
from tiny_models import tiny_config

#: llama.cpp's names of mlx-lm's granitemoehybrid layer parameters (gguf-py's tensor_mapping;
#: the shared MLP's input_linear is written as its gate and up halves)
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "mamba.in_proj": "ssm_in", "mamba.conv1d": "ssm_conv1d",
              "mamba.norm": "ssm_norm", "mamba.out_proj": "ssm_out",
              **{f"mlp.{p}_proj": f"ffn_{p}" for p in ("gate", "up", "down")},
              **{f"block_sparse_moe.switch_mlp.{p}_proj": f"ffn_{p}_exps"
                 for p in ("gate", "up", "down")},
              "block_sparse_moe.router.layer": "ffn_gate_inp",
              "shared_mlp.gate": "ffn_gate_shexp", "shared_mlp.up": "ffn_up_shexp",
              "shared_mlp.output_linear": "ffn_down_shexp"}
#: Mamba-2's parameters named without a suffix in llama.cpp, and the dt bias
GGUF_PARAMETERS = {"A_log": "ssm_a", "D": "ssm_d", "dt_bias": "ssm_dt.bias"}


gguf_name = partial(hybrid_gguf_name, layers="model.layers.", names=GGUF_NAMES,
                    top={"model.embed_tokens": "token_embd", "model.norm": "output_norm",
                         "lm_head": "output"},
                    parameters={f"mamba.{k}": v for k, v in GGUF_PARAMETERS.items()})

def write_granite_gguf(path: Path, tok_folder: Path, types: dict | None = None,
                       meta: dict | None = None, extra: dict | None = None,
                       **overrides) -> tuple[dict, dict]:
    """A random-weight Granite 4.0 H (one SSM group, as Granite 4.0's) written as llama.cpp's
    converter writes it
    (GraniteHybridModel, ported): key/value heads per layer (0 in the Mamba-2 layers), the
    SSM's sizes (heads as ssm.time_step_rank), Granite's multipliers, RoPE's switch
    (rope.scaling.finetuned), q/k rows permuted, A as -exp(A_log) and A, D (heads, 1), the
    gated norm (groups, inner / groups), the conv kernels squeezed to (channels, width), the
    shared MLP's input_linear split into gate and up. ``types``, ``meta``, ``extra``: as
    write_lfm2_gguf's. Returns (config, reference weights in mlx-lm's layout)."""
    config = {**tiny_config("granitemoehybrid"), "mamba_n_groups": 1, **overrides}
    module = importlib.import_module("mlx_lm.models.granitemoehybrid")
    shapes = {k: v.shape for k, v in tree_flatten(module.Model(module.ModelArgs.from_dict(
        config)).parameters())}
    for name in [k for k in shapes if k.endswith(".shared_mlp.input_linear.weight")]:
        rows, cols = shapes.pop(name)
        for half in ("gate", "up"):
            shapes[name.replace(".input_linear.", f".{half}.")] = (rows // 2, cols)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    inner = config["mamba_n_heads"] * config["mamba_d_head"]

    def layout(role: str, x: np.ndarray) -> np.ndarray:
        if role in ("attn_q", "attn_k"):
            return gguf_permute(x, heads if role == "attn_q" else kv_heads)
        if role in ("ssm_a", "ssm_d"):  # (heads, 1); A as -exp(A_log)
            return (-np.exp(x) if role == "ssm_a" else x)[:, None]
        if role == "ssm_norm":
            return x.reshape(config["mamba_n_groups"], -1)
        return x[..., 0] if role == "ssm_conv1d" and x.ndim == 3 else x  # (not its bias)

    kv = {"block_count": config["num_hidden_layers"],
          "context_length": config["max_position_embeddings"],
          "embedding_length": config["hidden_size"],
          "feed_forward_length": config["intermediate_size"], "head_count": heads,
          "head_count_kv": [kv_heads if t == "attention" else 0 for t in config["layer_types"]],
          "rope_freq_base": config["rope_theta"], "layer_norm_rms_eps": config["rms_norm_eps"],
          "ssm_conv_kernel": config["mamba_d_conv"], "ssm_inner_size": inner,
          "ssm_state_size": config["mamba_d_state"],
          "ssm_time_step_rank": config["mamba_n_heads"],
          "ssm_group_count": config["mamba_n_groups"],
          "embedding_scale": config["embedding_multiplier"],
          "residual_scale": config["residual_multiplier"],
          "logit_scale": config["logits_scaling"],
          "attention_scale": config["attention_multiplier"],
          "rope_scaling_finetuned": config["position_embedding_type"] != "nope"}
    if config["num_local_experts"]:
        kv.update(expert_count=config["num_local_experts"],
                  expert_used_count=config["num_experts_per_tok"],
                  expert_shared_feed_forward_length=config["shared_intermediate_size"])
    reference = write_model(path, "granitehybrid", shapes, gguf_name, {**kv, **(meta or {})},
                            tok_folder, types or {}, extra, "refact", layout)
    for name in [k for k in reference if k.endswith(".shared_mlp.gate.weight")]:
        halves = [reference.pop(name), reference.pop(name.replace(".gate.", ".up."), None)]
        if halves[1] is not None:  # (one left out by ``extra``)
            reference[name.replace(".gate.", ".input_linear.")] = mx.concatenate(halves)
    return config, reference


#: Granite 4.0 H-Tiny's layout (the tiny kind: experts beside a shared MLP, no RoPE), and
#: H-Micro's (a dense MLP), here with RoPE and biases on its attention
CASES = {"h-tiny": {}, "dense-rope": {"num_local_experts": 0, "intermediate_size": 128,
                                      "position_embedding_type": "rope",
                                      "attention_bias": True}}


@pytest.mark.parametrize("dtype", ["float32", None])
@pytest.mark.parametrize("case", CASES)
def test_granitehybrid_from_gguf(case, dtype, tiny_model_dir, tmp_path):
    """A Granite 4.0 GGUF becomes mlx-lm's granitemoehybrid (Mamba-2 and attention layers where the
    original's are, its SSM's sizes, time steps unclamped as llama.cpp's, multipliers, RoPE or none,
    experts and shared MLP or a dense one) and computes what the GGUF's tensors do in mlx-lm's model
    of the original checkpoint, float32 or kept quantized (as test_lfm2_from_gguf: float32 scales;
    1e-5: sums in another order); and runs in the engine unpruned as in mlx-lm."""
    types = {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "ssm_in": T.Q4_1, "ffn_gate_shexp": T.Q4_0,
             "ffn_up_shexp": T.Q4_0, "ffn_gate_exps": T.Q4_1, "ffn_gate_inp": T.F32,
             "*": T.Q8_0} if dtype is None else None
    config, reference = write_granite_gguf(tmp_path / "m.gguf",
                                           tiny_model_dir("granitemoehybrid"), types,
                                           **CASES[case])
    out = convert(tmp_path / "m.gguf", tmp_path / "out", dtype=dtype)
    saved = json.loads((out / "config.json").read_text())
    settings = {k: config[k] for k in (
        "model_type", "layer_types", "position_embedding_type", "attention_bias",
        "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv",
        "mamba_conv_bias", "num_key_value_heads", "intermediate_size")}
    assert {k: saved[k] for k in settings} == settings
    multipliers = {k: saved[k] for k in ("embedding_multiplier", "residual_multiplier",
                                         "logits_scaling", "attention_multiplier")}
    assert multipliers == pytest.approx({k: config[k] for k in multipliers})  # float32 there
    assert saved.get("num_local_experts", 0) == config["num_local_experts"]
    assert saved["time_step_limit"] == [0.0, float(np.finfo(np.float32).max)]  # unclamped
    assert bool(saved.get("quantization")) == (dtype is None)
    reference_config = {**config, **multipliers, "time_step_limit": saved["time_step_limit"]}
    assert_converted_runs(mlx_lm.load(str(out))[0], "granitemoehybrid", reference_config,
                          reference, dtype is None)


@pytest.mark.parametrize("meta, extra, fragment", [
    ({"head_count_kv": 2}, {}, "GGUF granitehybrid with 8 attention layers of 8 is not supported "
                               "(mlx-lm's granitemoehybrid takes Mamba-2 and attention layers"),
    ({"head_count_kv": [0, 0, 0, 2, 0, 0, 0, 1]}, {},
     "GGUF granitehybrid with attention layers of 1 and 2 key/value heads is not supported"),
    ({"ssm_inner_size": 64}, {}, "GGUF granitehybrid with an SSM inner size of 64 for 8 heads is "
                                 "not supported (the inner size must be twice"),
    ({"ssm_group_count": 2}, {}, "GGUF granitehybrid with 2 SSM groups is not supported (mlx-lm's "
                                 "granitemoehybrid normalises the gated SSM output over all"),
    ({"expert_shared_feed_forward_length": None}, {},
     "GGUF granitehybrid with experts but no shared MLP is not supported"),
    ({"ssm_state_size": None}, {}, "GGUF metadata lacks granitehybrid."),
    ({}, {"blk.0.ssm_a": np.full((8, 1), 0.5)},
     "GGUF blk.0.ssm_a must hold negative numbers (llama.cpp stores -exp(A_log)), got 0.5"),
    ({}, {"blk.0.ffn_up_shexp.weight": None},
     "GGUF blk.0.ffn_gate_shexp.weight needs an blk.0.ffn_up_shexp.weight of its shape"),
], ids=["all-attention", "two-kv-counts", "inner-size", "groups", "no-shared", "no-state",
        "a-not-negative", "no-shared-up"])
def test_granitehybrid_bad_input(meta, extra, fragment, tiny_model_dir, tmp_path, capsys):
    """What mlx-lm's granitemoehybrid cannot express (or llama.cpp requires) is refused in one
    line, nothing written."""
    write_granite_gguf(tmp_path / "m.gguf", tiny_model_dir("granitemoehybrid"), meta=meta,
                       extra=extra)
    before = set(tmp_path.iterdir())
    rc, err = run_main(capsys, str(tmp_path / "m.gguf"), str(tmp_path / "out"))
    assert_one_line_error(rc, err, fragment)
    assert set(tmp_path.iterdir()) == before
