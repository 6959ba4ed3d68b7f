"""GGUF conversion of Kimi Linear (llama.cpp's ``kimi-linear``, mlx-lm's ``kimi_linear``) and
Kimi K3 (``kimi-k3``, ``kimi_k3``): tiny
GGUFs written as llama.cpp's converter writes them, converted, and compared with mlx-lm's model
of the original checkpoint; what mlx-lm's kimi_linear cannot compute as llama.cpp does is
refused."""

from __future__ import annotations

from functools import partial
import importlib
import json
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from gguf import ExpertGatingFuncType, GGMLQuantizationType as T
from mlx.utils import tree_flatten
from mlx_lm.models import kimi_k3

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
#: groups; Kimi Linear's RMS epsilon, 1e-5 (mlx-lm's KDA q/k norms keep their 1e-6, llama.cpp's
#: take the GGUF's)
GGUF_CONFIG = {"linear_attn_config": {**tiny_config("kimi_linear")["linear_attn_config"],
                                      "num_heads": 4, "head_dim": 16},
               "num_expert_group": 1, "topk_group": 1, "rms_norm_eps": 1e-5}
#: Kimi K3's as llama.cpp's converter writes it: besides, the KDA layers' full-rank gate (the
#: only one llama.cpp reads) and lower-bounded decay
K3_GGUF_CONFIG = {**GGUF_CONFIG, "linear_attn_config": {
    **tiny_config("kimi_k3")["linear_attn_config"], "num_heads": 4, "head_dim": 16,
    "use_full_rank_gate": True, "gate_lower_bound": -5.0}}
#: llama.cpp's names of mlx-lm's kimi_k3 parameters besides Kimi Linear's (the latent
#: attention's output gate is attn_gate, k3_gguf_name's)
K3_NAMES = {**GGUF_NAMES, "self_attn.g_proj": "ssm_g",
            **{f"{m}_res_proj": f"{a}_res_score"
               for m, a in (("self_attention", "attn"), ("mlp", "ffn"))},
            "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
            "self_attn.q_b_proj": "attn_q_b",
            **{f"mlp.routed_expert_{p}_proj": f"ffn_routed_{p}" for p in ("down", "up")},
            "mlp.routed_expert_norm": "ffn_routed_norm"}


def k3_gguf_name(hf_name: str) -> str:
    """llama.cpp's name of a kimi_k3 parameter: Kimi Linear's, its text model's prefix, the
    fused residual scores', the output gate of a latent attention layer attn_gate."""
    name = hybrid_gguf_name(hf_name, layers="language_model.model.layers.", names=K3_NAMES,
                            top={"language_model.model.embed_tokens": "token_embd",
                                 "language_model.model.norm": "output_norm",
                                 "language_model.lm_head": "output",
                                 "language_model.model.output_attn_res_proj": "output_res_score"},
                            parameters={"self_attn.A_log": "ssm_a",
                                        "self_attn.dt_bias": "ssm_dt.bias",
                                        "mlp.e_score_correction_bias": "exp_probs_b.bias"})
    kda = K3_GGUF_CONFIG["linear_attn_config"]["kda_layers"]
    if name.endswith(".ssm_g.weight") and int(name.split(".")[1]) + 1 not in kda:
        return name.replace(".ssm_g.", ".attn_gate.")
    return name


def write_kimi_linear_gguf(path: Path, tok_folder: Path, types: dict | None = None,
                           meta: dict | None = None, extra: dict | None = None,
                           kind: str = "kimi_linear") -> tuple[dict, dict]:
    """A random-weight Kimi Linear (the tiny kind's layers, :data:`GGUF_CONFIG`) written as
    llama.cpp's converter writes it (KimiLinearModel, ported): key/value heads per layer (0 in
    the KDA layers, 1 latent head in the others), the MLA and KDA widths, the MoE's keys, A as
    -exp(A_log), the conv kernels as (1, channels, 1, width), kv_b_proj as attn_k_b / attn_v_b
    (mlx-lm's embed_q / unembed_out). ``types``, ``meta``, ``extra``: as write_lfm2_gguf's.
    Kimi K3 (``kind``): as KimiK3Model writes it, besides: the KDA layers' q/k/v projections and
    kernels apart, the residual blocks' size, each res_norm times res_proj (a norm of ones
    here), the SiTU betas, the experts' latent, the output gate.
    Returns (config, reference weights in mlx-lm's layout)."""
    k3 = kind == "kimi_k3"
    config = {**tiny_config(kind), **(K3_GGUF_CONFIG if k3 else GGUF_CONFIG)}
    module = importlib.import_module(f"mlx_lm.models.{kind}")
    model = module.Model(module.ModelArgs.from_dict(config))
    shapes = {k: v.shape for k, v in tree_flatten(model.parameters())
              if not k.endswith("res_norm.weight")}
    for name in [k for k in shapes if ".qkv_" in k]:  # kimi_k3's KDA: q, k, v apart
        shape = shapes.pop(name)
        for p in "qkv":
            shapes[name.replace(".qkv_", f".{p}_")] = (shape[0] // 3, *shape[1:])
    kda = config["linear_attn_config"]["kda_layers"]

    def layout(role: str, x: np.ndarray) -> np.ndarray:
        if role == "ssm_a":
            return -np.exp(x)
        if role.endswith("res_score"):  # (1, hidden) -> (hidden,)
            return x.reshape(-1)
        return x[..., 0][None, :, None] if role.startswith("ssm_conv1d") else x

    rank, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
    kv = {"block_count": config["num_hidden_layers"],
          "context_length": config.get("model_max_length", config["max_position_embeddings"]),
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
    if k3:
        args = config["linear_attn_config"]
        kv.update({"q_lora_rank": config["q_lora_rank"], "expert_weights_norm": True,
                   "attn_res.block_size": config["attn_res_block_size"],
                   "activation.situ_beta": config["activation_situ_beta"],
                   "activation.situ_linear_beta": config["activation_situ_linear_beta"],
                   "expert_latent_length": config["routed_expert_hidden_size"],
                   "kda.gate_lower_bound": args["gate_lower_bound"]})
    reference = write_model(path, "kimi-k3" if k3 else "kimi-linear", shapes,
                            k3_gguf_name if k3 else gguf_name, {**kv, **(meta or {})},
                            tok_folder, types or {}, extra, "refact", layout)
    if k3:  # q, k, v fused as mlx-lm's sanitize fuses them; the norms of ones
        reference = model.sanitize(reference)
        reference.update({k: mx.ones(v.shape) for k, v in tree_flatten(model.parameters())
                          if k.endswith("res_norm.weight")})
    return config, reference


@pytest.mark.parametrize("dtype", ["float32", None])
@pytest.mark.parametrize("kind", ["kimi_linear", "kimi_k3"])
def test_kimi_linear_from_gguf(kind, dtype, tiny_model_dir, tmp_path):
    """A Kimi Linear GGUF becomes mlx-lm's kimi_linear (KDA layers where the original's are,
    its widths, latent attention without RoPE, the experts' routing and scale) and computes
    what the GGUF's tensors do in mlx-lm's model of the original checkpoint (A_log from
    llama.cpp's -exp(A_log), the kernels in MLX's layout), float32 or kept quantized (as
    test_lfm2_from_gguf: float32 scales; 1e-5: sums in another order); and runs in the engine
    unpruned as in mlx-lm. Kimi K3's too: its KDA layers' q/k/v and kernels fused (kept
    quantized: its q, k, v of one type), its residual scores, output gate, latent experts and
    SiTU as the GGUF says."""
    types = {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "ffn_gate_exps": T.Q4_0,
             "ssm_f_a": T.Q8_0, "ffn_down_shexp": T.Q4_1,
             **({"attn_k": T.Q4_0, "attn_v": T.Q4_0} if kind == "kimi_k3" else {})
             } if dtype is None else None
    config, reference = write_kimi_linear_gguf(tmp_path / "m.gguf", tiny_model_dir(kind),
                                               types, kind=kind)
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
    if kind == "kimi_k3":
        args = kimi_k3.TextArgs.from_dict(config)
        assert {k: saved[k] for k in K3_SETTINGS} == {k: getattr(args, k) for k in K3_SETTINGS}
    assert_converted_runs(mlx_lm.load(str(out))[0], kind, config, reference, dtype is None)


#: What the tiny Kimi K3's GGUF gives mlx-lm's kimi_k3 besides Kimi Linear's settings
K3_SETTINGS = ("q_lora_rank", "attn_res_block_size", "activation_situ_beta",
               "activation_situ_linear_beta", "mla_use_output_gate", "routed_expert_hidden_size",
               "latent_moe_use_norm", "moe_renormalize", "hidden_act")


@pytest.mark.parametrize("kind, meta, extra, fragment", [
    ("kimi_linear", {}, {"blk.3.attn_q_a.weight": np.zeros((32, 64))},
     "GGUF kimi-linear with low-rank queries (attn_q_a) is not supported (mlx-lm's kimi_linear "
     "projects its queries in one step)"),
    ("kimi_linear", {"expert_used_count": 1}, {},
     "GGUF kimi-linear with one expert per token is not supported (llama.cpp renormalises its "
     "weight to 1"),
    ("kimi_linear", {"expert_gating_func": SimpleNamespace(value=3)}, {},
     "GGUF kimi-linear with expert gating function 3 is not "
                                    "supported (mlx-lm's kimi_linear routes by softmax (1) or "
                                    "sigmoid (2))"),
    ("kimi_linear", {"head_count_kv": 1}, {},
     "GGUF kimi-linear with 8 attention layers of 8 is not supported "
                               "(mlx-lm's kimi_linear takes Kimi Delta Attention and attention "
                               "layers"),
    ("kimi_linear", {"kda_head_dim": None}, {}, "GGUF metadata lacks kimi-linear."),
    ("kimi_linear", {}, {"blk.0.ssm_a": np.full((1, 1, 4, 1), 0.5)},
     "GGUF blk.0.ssm_a must hold negative numbers (llama.cpp stores -exp(A_log)), got 0.5"),
    ("kimi_k3", {"expert_gating_func": ExpertGatingFuncType.SOFTMAX}, {},
     "GGUF kimi-k3 with expert gating function 1 is not supported (mlx-lm's kimi_k3 routes by "
     "sigmoid (2))"),
    ("kimi_k3", {}, {"blk.7.attn_gate.weight": None},  # one latent attention layer's gate
     "GGUF tensors disagree with its metadata: it lacks "
     "language_model.model.layers.7.self_attn.g_proj.weight"),
    ("kimi_k3", {"attn_res.block_size": None}, {}, "GGUF metadata lacks kimi-k3."),
    ("kimi_k3", {"activation.situ_beta": 0.0}, {}, "GGUF metadata kimi-k3.activation.situ_beta "
                                                   "must be a positive number, got 0.0"),
], ids=["low-rank-queries", "one-expert", "gating", "all-attention", "no-kda-head-dim",
        "a-not-negative", "k3-softmax", "k3-one-gate", "k3-no-blocks", "k3-situ-beta"])
def test_kimi_linear_bad_input(kind, meta, extra, fragment, tiny_model_dir, tmp_path, capsys):
    """What mlx-lm's kimi_linear (kimi_k3) cannot compute as llama.cpp does (or llama.cpp
    requires) is refused in one line, nothing written."""
    write_kimi_linear_gguf(tmp_path / "m.gguf", tiny_model_dir(kind), meta=meta, extra=extra,
                           kind=kind)
    before = set(tmp_path.iterdir())
    rc, err = run_main(capsys, str(tmp_path / "m.gguf"), str(tmp_path / "out"))
    assert_one_line_error(rc, err, fragment)
    assert set(tmp_path.iterdir()) == before
