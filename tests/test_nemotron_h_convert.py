"""GGUF conversion of Nemotron-H (llama.cpp's ``nemotron_h``, mlx-lm's ``nemotron_h``): tiny
GGUFs written as llama.cpp's converter writes them, converted, and compared with mlx-lm's model
of the original checkpoint."""

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
from test_convert import T, assert_one_line_error, gguf_permute, run_main
from test_granite4_convert import GGUF_NAMES as GRANITE_NAMES, GGUF_PARAMETERS
from test_lfm2_convert import assert_converted_runs, hybrid_gguf_name, write_model
from tiny_models import tiny_config

#: llama.cpp's names of mlx-lm's nemotron_h layer parameters: one norm, one mixer a layer
GGUF_NAMES = {"norm": "attn_norm", "mixer.up_proj": "ffn_up", "mixer.down_proj": "ffn_down",
              **{"mixer." + k.split(".", 1)[1]: v for k, v in GRANITE_NAMES.items()
                 if k.startswith(("self_attn.", "mamba."))}}
#: The tiny kind's layout with an MLP where it has experts (llama.cpp's nemotron_h has none)
PATTERN = ["M", "-", "M", "*", "M", "M", "-", "*"]


def mamba2_layout(role: str, x: np.ndarray, groups: int,
                  heads: tuple[int, int] | None = None) -> np.ndarray:
    """A tensor of llama.cpp's role ``role`` as its converter (Mamba2Model) stores it: A as
    -exp(A_log) and A, D (heads, 1), the gated norm (groups, inner / groups), the conv kernels
    squeezed; with ``heads`` (query, key/value heads), q/k rows permuted (its LlamaModel's)."""
    if heads is not None and role in ("attn_q", "attn_k"):
        return gguf_permute(x, heads[role == "attn_k"])
    if role in ("ssm_a", "ssm_d"):
        return (-np.exp(x) if role == "ssm_a" else x)[:, None]
    if role == "ssm_norm":
        return x.reshape(groups, -1)
    return x[..., 0] if role == "ssm_conv1d" and x.ndim == 3 else x  # (not its bias)


gguf_name = partial(hybrid_gguf_name, layers="backbone.layers.", names=GGUF_NAMES,
                    top={"backbone.embeddings": "token_embd", "backbone.norm_f": "output_norm",
                         "lm_head": "output"},
                    parameters={f"mixer.{k}": v for k, v in GGUF_PARAMETERS.items()})

def write_nemotron_h_gguf(path: Path, tok_folder: Path, types: dict | None = None,
                          meta: dict | None = None, extra: dict | None = None,
                          **overrides) -> tuple[dict, dict]:
    """A random-weight Nemotron-H written as llama.cpp's converter writes it (NemotronHModel, a
    GraniteHybridModel): key/value heads and MLP widths per layer (0 where a layer has none),
    the SSM's sizes (heads as ssm.time_step_rank), head_dim as key/value length, the tensors in
    its layout (:func:`mamba2_layout`, q/k rows permuted). ``types``, ``meta``, ``extra``: as
    write_lfm2_gguf's. Returns (config, reference weights in mlx-lm's layout)."""
    config = {**tiny_config("nemotron_h"), "hybrid_override_pattern": PATTERN, **overrides}
    module = importlib.import_module("mlx_lm.models.nemotron_h")
    shapes = {k: v.shape for k, v in tree_flatten(module.Model(module.ModelArgs.from_dict(
        config)).parameters())}
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    inner = config["mamba_num_heads"] * config["mamba_head_dim"]

    def layout(role: str, x: np.ndarray) -> np.ndarray:
        return mamba2_layout(role, x, config["n_groups"], (heads, kv_heads))

    pattern = config["hybrid_override_pattern"]
    kv = {"block_count": len(pattern), "context_length": config["max_position_embeddings"],
          "embedding_length": config["hidden_size"],
          "feed_forward_length": [config["intermediate_size"] if c == "-" else 0
                                  for c in pattern],
          "head_count": heads,
          "head_count_kv": [kv_heads if c == "*" else 0 for c in pattern],
          "key_length": config["head_dim"], "value_length": config["head_dim"],
          "layer_norm_eps": config["layer_norm_epsilon"],
          "layer_norm_rms_eps": config["layer_norm_epsilon"],
          "ssm_conv_kernel": config["conv_kernel"], "ssm_inner_size": inner,
          "ssm_state_size": config["ssm_state_size"],
          "ssm_time_step_rank": config["mamba_num_heads"], "ssm_group_count": config["n_groups"]}
    reference = write_model(path, "nemotron_h", shapes, gguf_name, {**kv, **(meta or {})},
                            tok_folder, types or {}, extra, "refact", layout)
    if "output.weight" in (extra or {}):  # tied: llama.cpp's head is the embedding
        reference["lm_head.weight"] = reference["backbone.embeddings.weight"]
    return config, reference


@pytest.mark.parametrize("dtype, tied", [("float32", False), ("float32", True), (None, False)],
                         ids=["float32", "tied", "kept"])
def test_nemotron_h_from_gguf(dtype, tied, tiny_model_dir, tmp_path):
    """A Nemotron-H GGUF becomes mlx-lm's nemotron_h (Mamba-2, attention and MLP layers where
    the original's are, its SSM's sizes in 2 groups, attention biases, the embedding as the head
    where the GGUF has none) and computes what the GGUF's tensors do in mlx-lm's model of the
    original checkpoint, float32 or kept quantized (as test_lfm2_from_gguf: 1e-5, sums in
    another order); and runs in the engine unpruned as in mlx-lm."""
    types = {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "ssm_in": T.Q4_1, "ffn_up": T.Q4_0,
             "*": T.Q8_0} if dtype is None else None
    config, reference = write_nemotron_h_gguf(tmp_path / "m.gguf", tiny_model_dir("nemotron_h"),
                                              types, extra={"output.weight": None} if tied
                                              else None)
    out = convert(tmp_path / "m.gguf", tmp_path / "out", dtype=dtype)
    saved = json.loads((out / "config.json").read_text())
    settings = {k: config[k] for k in (
        "model_type", "hybrid_override_pattern", "attention_bias", "mlp_bias", "mamba_num_heads",
        "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel", "use_conv_bias",
        "num_key_value_heads", "intermediate_size", "head_dim")}
    assert {k: saved[k] for k in settings} == settings
    assert saved["layer_norm_epsilon"] == pytest.approx(config["layer_norm_epsilon"])
    assert bool(saved.get("quantization")) == (dtype is None)
    assert_converted_runs(mlx_lm.load(str(out))[0], "nemotron_h", config, reference,
                          dtype is None)


@pytest.mark.parametrize("meta, fragment", [
    ({"head_count_kv": [0] * 8}, "GGUF nemotron_h with layers M-MMMM-M is not supported "
                                 "(mlx-lm's nemotron_h indexes a Mamba-2 and an attention layer)"),
    ({"head_count_kv": [0, 0, 0, 2, 0, 0, 0, 1]},
     "GGUF nemotron_h with MLP widths or key/value heads that differ by layer"),
    ({"feed_forward_length": [0, 128, 0, 0, 0, 0, 128]},
     "GGUF metadata nemotron_h.feed_forward_length has 7 values for 8 layers"),
    ({"expert_count": 4}, "GGUF nemotron_h with experts is not supported"),
    ({"attention_scale": 0.5}, "GGUF nemotron_h with attention scale 0.5 is not supported"),
    ({"ssm_time_step_rank": 6}, "GGUF nemotron_h with an SSM inner size of 128 for 6 heads"),
    ({"layer_norm_eps": None}, "GGUF metadata lacks nemotron_h."),
], ids=["no-attention", "two-kv-counts", "widths", "experts", "scale", "heads", "no-eps"])
def test_nemotron_h_bad_input(meta, fragment, tiny_model_dir, tmp_path, capsys):
    """What mlx-lm's nemotron_h cannot express (or llama.cpp requires) is refused in one line,
    nothing written."""
    write_nemotron_h_gguf(tmp_path / "m.gguf", tiny_model_dir("nemotron_h"), meta=meta)
    before = set(tmp_path.iterdir())
    rc, err = run_main(capsys, str(tmp_path / "m.gguf"), str(tmp_path / "out"))
    assert_one_line_error(rc, err, fragment)
    assert set(tmp_path.iterdir()) == before
