"""GGUF conversion of LFM2 (llama.cpp's ``lfm2``, mlx-lm's ``lfm2``), LFM2-8B-A1B
(``lfm2moe``, mlx-lm's ``lfm2_moe``) and Llama 4 (``llama4``): tiny GGUFs written as llama.cpp's
converter writes them, converted, and compared with mlx-lm's model of the original checkpoint."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import gguf
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_lazy import PruningConfig
from mlx_lazy.convert import convert
from numerics import rel_err
from test_convert import (T, add_bpe_vocab, assert_one_line_error, encode, llama_cpp_rope_freqs,
                          run_main)
from test_engine import LOGITS_TOL, mlx_lm_error, random_prompt
from tiny_models import VOCAB_SIZE, tiny_config

#: llama.cpp's names of mlx-lm's lfm2 / lfm2_moe layer parameters (gguf-py's tensor_mapping)
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_output",
              "self_attn.q_layernorm": "attn_q_norm", "self_attn.k_layernorm": "attn_k_norm",
              "operator_norm": "attn_norm", "ffn_norm": "ffn_norm",
              "conv.conv": "shortconv.conv", "conv.in_proj": "shortconv.in_proj",
              "conv.out_proj": "shortconv.out_proj",
              "feed_forward.w1": "ffn_gate", "feed_forward.w3": "ffn_up",
              "feed_forward.w2": "ffn_down",
              "feed_forward.gate_proj": "ffn_gate", "feed_forward.up_proj": "ffn_up",
              "feed_forward.down_proj": "ffn_down", "feed_forward.gate": "ffn_gate_inp",
              **{f"feed_forward.switch_mlp.{p}_proj": f"ffn_{p}_exps"
                 for p in ("gate", "up", "down")}}
GGUF_ARCH = {"lfm2": "lfm2", "lfm2_moe": "lfm2moe"}


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.embedding_norm.weight":  # LFM2's final norm (llama.cpp's name)
        return "token_embd_norm.weight"
    _, _, i, rest = hf_name.split(".", 3)
    if rest == "feed_forward.expert_bias":
        return f"blk.{i}.exp_probs_b.bias"
    base, suffix = rest.rsplit(".", 1)
    return f"blk.{i}.{GGUF_NAMES[base]}.{suffix}"


def write_lfm2_gguf(path: Path, kind: str, tok_folder: Path, types: dict | None = None,
                    meta: dict | None = None, extra: dict | None = None,
                    **overrides) -> tuple[dict, dict]:
    """A random-weight LFM2 / LFM2-MoE of ``kind`` written as llama.cpp's converter writes it
    (LFM2Model / LFM2MoeModel, ported): key/value heads per layer (0 in the convolution
    layers), the auto-adjusted MLP width, the convolutions' kernels squeezed to (channels,
    width), no conv biases. ``types``: a GGUF role's type ("*" the other matrices; default
    F32); ``meta``: writer method suffix -> value (None leaves it out); ``extra``: tensors
    added by GGUF name. Returns (config, reference weights: what the stored tensors dequantize
    to, in mlx-lm's layout)."""
    types, config = types or {}, {**tiny_config(kind), "conv_bias": False, **overrides}
    module = importlib.import_module(f"mlx_lm.models.{kind}")
    model = module.Model(module.ModelArgs.from_dict(config))
    shapes = {k: v.shape for k, v in tree_flatten(model.parameters())}
    moe = kind == "lfm2_moe"
    ff = config["intermediate_size"] if moe else shapes["model.layers.0.feed_forward.w1.weight"][0]
    kv = {"block_count": config["num_hidden_layers"],
          "context_length": config["max_position_embeddings"],
          "embedding_length": config["hidden_size"], "feed_forward_length": ff,
          "head_count": config["num_attention_heads"],
          "head_count_kv": [config["num_key_value_heads"] if t == "full_attention" else 0
                            for t in config["layer_types"]],
          "rope_freq_base": config.get("rope_theta", 1e6),
          "layer_norm_rms_eps": config["norm_eps"], "shortconv_l_cache": config["conv_L_cache"]}
    if moe:
        kv.update(expert_count=config["num_experts"],
                  expert_used_count=config["num_experts_per_tok"],
                  expert_feed_forward_length=config["moe_intermediate_size"],
                  leading_dense_block_count=config["num_dense_layers"],
                  expert_gating_func=gguf.ExpertGatingFuncType.SIGMOID)
    return config, write_model(path, GGUF_ARCH[kind], shapes, gguf_name, {**kv, **(meta or {})},
                               tok_folder, types, extra, "lfm2")


def write_model(path: Path, arch: str, shapes: dict, name_of, kv: dict, tok_folder: Path,
                types: dict, extra: dict | None, pre: str, layout=None) -> dict:
    """A GGUF of ``arch`` with the metadata ``kv`` (writer method suffix -> value, or a key
    under ``arch`` with a dot or no such method -> a bool, int or float; None left
    out), the tokenizer of
    ``tok_folder`` and random tensors of mlx-lm's ``shapes`` under the names ``name_of`` gives
    them (``types`` by role as write_lfm2_gguf's; convolution kernels
    float32), in llama.cpp's layout where ``layout(role, stored)`` gives one, and ``extra``
    float32 ones; returns what the stored tensors dequantize to, by mlx-lm's names."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in kv.items():
        # a key gguf's writer has no method for
        if value is not None and ("." in key or not hasattr(w, f"add_{key}")):
            add = (w.add_bool if isinstance(value, bool) else
                   w.add_uint32 if isinstance(value, int) else w.add_float32)
            add(f"{arch}.{key}", value)
        elif value is not None:
            getattr(w, f"add_{key}")(value)
    add_bpe_vocab(w, tok_folder, pre=pre)
    rng = np.random.default_rng(0)
    reference = {}
    for name, shape in shapes.items():
        gname = name_of(name)
        role = gname.split(".", 2)[2].rsplit(".", 1)[0] if gname.startswith("blk.") \
            else gname.split(".")[0]
        if gname in (extra or {}):  # replaced
            continue
        if role == "shortconv.conv":  # (channels, width, 1) in MLX; squeezed in the GGUF
            x = rng.normal(0, 0.5, shape[:2])
        elif len(shape) >= 2:
            x = rng.normal(0, 0.05, shape)
        elif role == "exp_probs_b":  # as large as the sigmoid scores' differences
            x = 0.1 * rng.normal(size=shape)
        else:
            x = 1.0 + 0.1 * rng.normal(size=shape)
        x = x.astype(np.float32)
        qtype = types.get(role, types.get("*", T.F32)) \
            if len(shape) >= 2 and not role.startswith(("shortconv.conv", "ssm_conv1d")) else T.F32
        data = encode(x, qtype, rng)
        stored = gguf.dequantize(data, qtype).reshape(x.shape)
        reference[name] = mx.array(stored.reshape(shape))
        w.add_tensor(gname, data if layout is None else layout(role, data), raw_dtype=qtype)
    for gname, data in (extra or {}).items():
        if data is not None:
            w.add_tensor(gname, np.asarray(data, np.float32), raw_dtype=T.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return reference


def reference_model(kind: str, config: dict, weights: dict):
    module = importlib.import_module(f"mlx_lm.models.{kind}")
    model = module.Model(module.ModelArgs.from_dict(config))
    model.load_weights(list(weights.items()))
    return model


KEPT_TYPES = {"lfm2": {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "shortconv.in_proj": T.Q4_1,
                       "ffn_down": T.Q4_0, "*": T.Q8_0},
              "lfm2_moe": {"token_embd": T.Q8_0, "ffn_gate_exps": T.Q4_0,
                           "ffn_up_exps": T.Q4_1, "shortconv.in_proj": T.Q4_0,
                           "ffn_gate_inp": T.F32, "*": T.Q8_0}}
SETTINGS = {"lfm2": {"block_ff_dim": 96, "block_auto_adjust_ff_dim": False},
            "lfm2_moe": {"num_dense_layers": 2, "use_expert_bias": True, "norm_topk_prob": True,
                         "moe_intermediate_size": 32, "num_experts": 4,
                         "num_experts_per_tok": 2}}


def hybrid_gguf_name(hf_name: str, top: dict, layers: str, names: dict,
                     parameters: dict) -> str:
    """llama.cpp's name (its converter's) of a model's parameter ``hf_name``: ``top`` names the
    modules outside the layers (``layers``: their prefix, up to the index); in a layer,
    ``parameters`` names some by module and parameter (those llama.cpp names without a suffix,
    as Mamba's A_log and D), ``names`` the others by module, the suffix kept (a name ending in
    "." is written whole, without one)."""
    base, suffix = hf_name.rsplit(".", 1)
    if base in top:
        return f"{top[base]}.{suffix}"
    i, rest = hf_name.removeprefix(layers).split(".", 1)
    if rest in parameters:
        return f"blk.{i}.{parameters[rest]}"
    name = names[rest.rsplit(".", 1)[0]]
    return f"blk.{i}.{name[:-1]}" if name.endswith(".") else f"blk.{i}.{name}.{suffix}"


def assert_converted_runs(model, kind: str, config: dict, reference: dict, quantized: bool,
                          prompt: int = 64) -> None:
    """A converted model (mlx-lm's load of the folder) has the logits of mlx-lm's model of the
    GGUF's dequantized weights ``reference`` (relative 1e-5: float32 sums in another order; a
    kept-quantized model's scales and biases in float32 first, as the reference dequantized
    them) and runs unpruned through the engine as mlx-lm does."""
    if quantized:
        model.load_weights([(k, v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())
                            if k.endswith((".scales", ".biases"))], strict=False)
    x = random_prompt(prompt, VOCAB_SIZE)[None]
    assert rel_err(model(x), reference_model(kind, config, reference)(x)) < 1e-5
    assert mlx_lm_error(model, PruningConfig("full"), random_prompt(300, VOCAB_SIZE), 8,
                        block_size=64) < LOGITS_TOL


@pytest.mark.parametrize("dtype", ["float32", None])
@pytest.mark.parametrize("kind", ["lfm2", "lfm2_moe"])
def test_lfm2_from_gguf(kind, dtype, tiny_model_dir, tmp_path):
    """An LFM2 / LFM2-8B-A1B GGUF becomes mlx-lm's lfm2 / lfm2_moe (convolution and attention
    layers where the original's are, its MLP width as llama.cpp wrote it, the kernels in MLX's
    layout, token_embd_norm as the final norm, the experts' selection bias) and computes what
    the GGUF's tensors do in mlx-lm's model of the original checkpoint, float32 or kept
    quantized (float32: 1e-5, sums in another order; kept quantized: MLX's float16 scales,
    taken as float32 here as test_convert does for the MoEs whose routing they flip); and
    runs in the engine unpruned as in mlx-lm."""
    config, reference = write_lfm2_gguf(tmp_path / "m.gguf", kind, tiny_model_dir(kind),
                                        KEPT_TYPES[kind] if dtype is None else None,
                                        norm_eps=2 ** -6)  # one of its own, exact in float32
    out = convert(tmp_path / "m.gguf", tmp_path / "out", dtype=dtype)
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == kind and saved["layer_types"] == config["layer_types"]
    assert {k: saved[k] for k in SETTINGS[kind]} == SETTINGS[kind]
    assert saved["conv_L_cache"] == 3 and saved["norm_eps"] == config["norm_eps"]
    assert bool(saved.get("quantization")) == (dtype is None)
    model, tok = mlx_lm.load(str(out))
    # LFM2's pre-tokenizer ("lfm2": Llama 3's, which adds BOS)
    ref_tok = mlx_lm.load(str(tiny_model_dir(kind)))[1]
    assert tok.encode("Hello world") == [tok.bos_token_id, *ref_tok.encode("Hello world")]
    assert_converted_runs(model, kind, config, reference, dtype is None)


@pytest.mark.parametrize("kind, meta, extra, fragment", [
    ("lfm2", {"head_count_kv": 2}, {},
     "GGUF lfm2 with 8 attention layers of 8 is not supported (mlx-lm's lfm2 takes convolution "
     "and attention layers, one count of key/value heads)"),
    ("lfm2", {"head_count_kv": [0] * 8}, {}, "GGUF lfm2 with 0 attention layers of 8"),
    ("lfm2", {"head_count_kv": [0, 0, 0, 2, 0, 0, 0, 1]}, {},
     "GGUF lfm2 with attention layers of 1 and 2 key/value heads is not supported"),
    ("lfm2", {"head_count_kv": [0, 2]}, {},
     "GGUF metadata lfm2.attention.head_count_kv has 2 values for 8 layers"),
    ("lfm2", {}, {"output.weight": np.zeros((VOCAB_SIZE, 64))},
     "GGUF lfm2 with an output head of its own is not supported (mlx-lm's lfm2 ties it"),
    ("lfm2", {"sliding_window": 16}, {}, "GGUF lfm2 with a sliding window is not supported"),
    ("lfm2", {"causal_attention": False}, {},
     "GGUF lfm2 with non-causal attention is not supported"),
    ("lfm2", {"shortconv_l_cache": None}, {}, "GGUF metadata lacks lfm2."),
    ("lfm2", {"layer_norm_rms_eps": None}, {}, "GGUF metadata lacks lfm2."),
    ("lfm2", {}, {"blk.0.shortconv.conv.bias": np.zeros(64)},
     "GGUF tensors disagree with its metadata: it has an unexpected tensor "
     "model.layers.0.conv.conv.bias"),
    ("lfm2_moe", {"expert_gating_func": gguf.ExpertGatingFuncType.SOFTMAX}, {},
     "GGUF lfm2moe with expert gating function 1 is not supported (mlx-lm's lfm2_moe routes by "
     "sigmoid (2))"),
], ids=["all-attention", "no-attention", "two-kv-counts", "kv-length", "untied", "window",
        "non-causal", "no-l-cache", "no-eps", "conv-bias", "softmax-gating"])
def test_lfm2_bad_input(kind, meta, extra, fragment, tiny_model_dir, tmp_path, capsys):
    """What mlx-lm's lfm2 / lfm2_moe cannot express (or llama.cpp requires) is refused in one
    line, nothing written."""
    write_lfm2_gguf(tmp_path / "m.gguf", kind, tiny_model_dir(kind), meta=meta, extra=extra)
    before = set(tmp_path.iterdir())
    rc, err = run_main(capsys, str(tmp_path / "m.gguf"), str(tmp_path / "out"))
    assert_one_line_error(rc, err, fragment)
    assert set(tmp_path.iterdir()) == before


#: llama.cpp's names of mlx-lm's llama4 text model's layer parameters
LLAMA4_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                "feed_forward.router": "ffn_gate_inp",
                **{f"feed_forward.{p}_proj": f"ffn_{p}" for p in ("gate", "up", "down")},
                **{f"feed_forward.experts.{p}_proj": f"ffn_{p}_exps"
                   for p in ("gate", "up", "down")},
                **{f"feed_forward.shared_expert.{p}_proj": f"ffn_{p}_shexp"
                   for p in ("gate", "up", "down")}}


def llama4_gguf_name(hf_name: str) -> str:
    top = {"language_model.model.embed_tokens": "token_embd",
           "language_model.model.norm": "output_norm", "language_model.lm_head": "output"}
    base, suffix = hf_name.rsplit(".", 1)
    if base in top:
        return f"{top[base]}.{suffix}"
    i, rest = base.removeprefix("language_model.model.layers.").split(".", 1)
    return f"blk.{i}.{LLAMA4_NAMES[rest]}.{suffix}"


def write_llama4_gguf(path: Path, tok_folder: Path, types: dict | None = None,
                      meta: dict | None = None, extra: dict | None = None,
                      **overrides) -> tuple[dict, dict]:
    """A random-weight Llama 4 text model written as llama.cpp's converter writes it
    (Llama4Model, ported: q/k as they are, the MLPs' width as feed_forward_length, the experts'
    as expert_feed_forward_length, Llama 3's RoPE scaling as rope_freqs). Returns (mlx-lm's
    config of the checkpoint with llama.cpp's hard-wired chunk and temperature, reference
    weights)."""
    config = tiny_config("llama4")
    text = {**config["text_config"], "attention_chunk_size": 8192, "floor_scale": 8192,
            **overrides}
    config = {**config, "text_config": text}
    module = importlib.import_module("mlx_lm.models.llama4")
    shapes = {k: v.shape for k, v in
              tree_flatten(module.Model(module.ModelArgs.from_dict(config)).parameters())}
    kv = {"block_count": text["num_hidden_layers"],
          "context_length": text["max_position_embeddings"],
          "embedding_length": text["hidden_size"],
          "feed_forward_length": text["intermediate_size_mlp"],
          "head_count": text["num_attention_heads"],
          "head_count_kv": text["num_key_value_heads"], "key_length": text["head_dim"],
          "value_length": text["head_dim"], "rope_dimension_count": text["head_dim"],
          "rope_freq_base": text["rope_theta"], "layer_norm_rms_eps": text["rms_norm_eps"],
          "expert_count": text["num_local_experts"],
          "expert_used_count": text["num_experts_per_tok"],
          "expert_feed_forward_length": text["intermediate_size"],
          "interleave_moe_layer_step": text["interleave_moe_layer_step"], **(meta or {})}
    rope = {"rope_freqs.weight": llama_cpp_rope_freqs(text)} if text.get("rope_scaling") else {}
    return config, write_model(path, "llama4", shapes, llama4_gguf_name, kv, tok_folder,
                               types or {}, {**rope, **(extra or {})}, "llama4")


@pytest.mark.parametrize("dtype", ["float32", None])
@pytest.mark.parametrize("extra, overrides", [
    ({}, {}),
    # tied (llama.cpp reads the embedding as the head); no RoPE scaling
    ({"output.weight": None}, {"rope_scaling": None}),
], ids=["scout", "tied"])
def test_llama4_from_gguf(extra, overrides, dtype, tiny_model_dir, tmp_path):
    """A Llama 4 GGUF becomes mlx-lm's llama4 (its text_config: llama.cpp's chunk and
    temperature, q/k norms, the MoE every 2nd layer, the MLPs' and experts' widths, Llama 3's
    RoPE scaling) and computes what the GGUF's tensors do in mlx-lm's model of the checkpoint,
    float32 or kept quantized (as test_lfm2_from_gguf: float32 scales); and runs in the engine
    unpruned as in mlx-lm."""
    types = {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "ffn_gate_exps": T.Q4_1,
             "ffn_gate_inp": T.F32, "*": T.Q8_0} if dtype is None else None
    config, reference = write_llama4_gguf(tmp_path / "m.gguf", tiny_model_dir("llama4"), types,
                                          extra=extra, **overrides)
    if extra:  # llama.cpp's head of a tied GGUF: the embedding
        reference["language_model.lm_head.weight"] = \
            reference["language_model.model.embed_tokens.weight"]
    out = convert(tmp_path / "m.gguf", tmp_path / "out", dtype=dtype)
    saved = json.loads((out / "config.json").read_text())["text_config"]
    settings = {"attention_chunk_size": 8192, "floor_scale": 8192, "attn_scale": 0.1,
                "use_qk_norm": True, "interleave_moe_layer_step": 2, "intermediate_size": 32,
                "intermediate_size_mlp": 128, "num_local_experts": 4, "num_experts_per_tok": 1}
    assert {k: saved[k] for k in settings} == settings
    assert (saved.get("rope_scaling") or {}).get("rope_type") == (
        None if overrides else "llama3")
    assert_converted_runs(mlx_lm.load(str(out))[0], "llama4", config, reference,
                          dtype is None, prompt=100)


@pytest.mark.parametrize("meta, fragment", [
    ({"sliding_window": 0}, "GGUF llama4 without chunked attention (sliding window 0) is not "
                            "supported (mlx-lm's llama4 chunks 3 of every 4 layers)"),
    ({"sliding_window_pattern": 2}, "GGUF llama4 with a chunked-attention pattern other than 3 "
                                    "chunked layers, then a global one, is not supported"),
    ({"expert_used_count": 2}, "GGUF llama4 with 2 experts a token is not supported (mlx-lm's "
                               "llama4 routes each token to one)"),
    ({"rope_freq_base_swa": 500.0}, "GGUF llama4 with another RoPE base in its chunked layers"),
], ids=["no-chunks", "pattern", "two-experts", "swa-base"])
def test_llama4_bad_input(meta, fragment, tiny_model_dir, tmp_path, capsys):
    """What mlx-lm's llama4 cannot express is refused in one line, nothing written."""
    write_llama4_gguf(tmp_path / "m.gguf", tiny_model_dir("llama4"), meta=meta)
    before = set(tmp_path.iterdir())
    rc, err = run_main(capsys, str(tmp_path / "m.gguf"), str(tmp_path / "out"))
    assert_one_line_error(rc, err, fragment)
    assert set(tmp_path.iterdir()) == before
