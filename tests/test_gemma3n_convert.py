"""GGUF ``gemma3n`` -> MLX ``gemma3n``: tiny random Gemma 3n GGUFs written as llama.cpp's
converter writes them (its Gemma3NModel, ported: norms as w, AltUp's projections stacked, the
sparsity as a Gaussian cut per layer, sliding layers by a flag each, Gemma's SentencePiece
vocabulary), converted and compared with mlx-lm's own gemma3n on the dequantized tensors; their
bad inputs."""

from __future__ import annotations

import mlx_lazy  # noqa: F401  (OpenBLAS before mlx)

import json
from pathlib import Path
from statistics import NormalDist

import gguf
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from mlx.utils import tree_flatten
from mlx_lm.models import gemma3n
from mlx_lm.models.cache import make_prompt_cache

from mlx_lazy.conversion import read_gguf
from mlx_lazy.convert import convert
from mlx_lazy.gguf_tokenizer import build_tokenizer
from numerics import rel_err
from test_convert import assert_refused, encode
from test_gemma3_convert import LAYER, TEXT, add_gemma_vocabulary
from tiny_models import tiny_config

# mlx-lm's parameter (in its text model) -> llama.cpp's tensor; AltUp's projections a stack
TOP = {"embed_tokens": "token_embd", "norm": "output_norm",
       "embed_tokens_per_layer": "per_layer_token_embd",
       "per_layer_model_projection": "per_layer_model_proj",
       "per_layer_projection_norm": "per_layer_proj_norm",
       "altup_projections": "altup_proj", "altup_unembed_projections": "altup_unembd_proj"}
LAYER_3N = {**LAYER, "altup.correction_coefs": "altup_correct_coef",
            "altup.prediction_coefs": "altup_predict_coef",
            "altup.modality_router": "altup_router", "altup.router_norm": "altup_router_norm",
            "laurel.linear_left": "laurel_l", "laurel.linear_right": "laurel_r",
            "laurel.post_laurel_norm": "laurel_post_norm", "per_layer_input_gate": "inp_gate",
            "per_layer_projection": "proj", "post_per_layer_input_norm": "post_norm"}
#: The tiny Gemma 3n as llama.cpp's graph runs it: every layer (of its first 10) sparse, with
#: keys and values of its own (of its first 20)
TINY = {**tiny_config("gemma3n")["text_config"], "activation_sparsity_pattern": [0.95] * 4,
        "num_kv_shared_layers": 0}
#: E2B's layout in 22 layers: 4 sliding to 1 global, sparse gates in the first 10, layers 20
#: and 21 (sliding) reading layer 18's keys and values (llama.cpp's 20 layers with their own)
E2B = {**TINY, "num_hidden_layers": 22, "num_kv_shared_layers": 2,
       "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 4
       + ["sliding_attention"] * 2,
       "activation_sparsity_pattern": [0.95] * 10 + [0.0] * 12}


def gguf_name(name: str) -> str:
    """llama.cpp's tensor of an mlx-lm parameter (the stacked projections by their stack)."""
    base, suffix = name.removeprefix("model.language_model.").rsplit(".", 1)
    if base.split(".")[0] in TOP:
        return f"{TOP[base.split('.')[0]]}.{suffix}"
    _, i, rest = base.split(".", 2)
    if suffix == "correct_output_scale":  # Gemma3NModel's filter_tensors: a ".weight" added
        return f"blk.{i}.altup_correct_scale.weight"
    return f"blk.{i}.{LAYER_3N[rest]}.{suffix}"


def write_gemma3n_gguf(path: Path, text: dict = TINY, qtype: T = T.F32, meta: dict | None = None,
                       drop: tuple = (), extra: dict | None = None) -> dict:
    """A random tiny Gemma 3n (its text config ``text``) as llama.cpp's Gemma3NModel writes it:
    Gemma 3's keys, AltUp's, the per-layer inputs' width, the shared layers' count, the
    sparsity as its Gaussian cut (-inf where none), a sliding flag per layer, the per-layer
    embedding padded with zero rows to the vocabulary's size; matrices of
    ``qtype`` (where rows fill its blocks), norms and the rest float32. ``meta`` overrides
    metadata (None leaves a key out), ``drop`` leaves tensors out, ``extra`` adds float32
    ones. Returns the reference weights: what the stored tensors dequantize to, in mlx-lm's
    names."""
    args = gemma3n.TextConfig.from_dict(text)
    n = args.num_hidden_layers
    values = {
        "block_count": n, "context_length": args.max_position_embeddings,
        "embedding_length": args.hidden_size, "feed_forward_length": args.intermediate_size,
        "head_count": args.num_attention_heads, "head_count_kv": args.num_key_value_heads,
        "key_length": args.head_dim, "value_length": args.head_dim,
        "rope_freq_base": args.rope_theta, "layer_norm_rms_eps": args.rms_norm_eps,
        "final_logit_softcapping": args.final_logit_softcapping,
        "sliding_window": args.sliding_window, "altup_active_idx": args.altup_active_idx,
        "altup_num_inputs": args.altup_num_inputs,
        "embedding_length_per_layer_input": args.hidden_size_per_layer_input,
        "shared_kv_layers": args.num_kv_shared_layers,
        "activation_sparsity_scale": [NormalDist().inv_cdf(s) if s else -np.inf
                                      for s in args.activation_sparsity_pattern],
        "sliding_window_pattern": [t == "sliding_attention" for t in args.layer_types],
        **(meta or {})}
    w = gguf.GGUFWriter(str(path), "gemma3n")
    for key, value in values.items():
        if value is not None:
            getattr(w, f"add_{key}")(value)
    add_gemma_vocabulary(w)
    model = gemma3n.Model(gemma3n.ModelArgs("gemma3n", text))
    rng = np.random.default_rng(0)
    reference, stacks = {}, {}
    for name, p in tree_flatten(model.parameters()):
        gname = gguf_name(name)
        if gname in drop:
            continue
        if p.ndim == 2:
            kind = qtype if p.shape[1] % 32 == 0 else T.F32
            x = rng.normal(0, 0.05, p.shape).astype(np.float32)
            if gname == "per_layer_token_embd.weight":  # Gemma3NModel's: zero rows to the
                # vocabulary's size (mlx-lm's model reads row 0 for the tokens past its own)
                x = np.concatenate([x, np.zeros((args.vocab_size - len(x), x.shape[1]),
                                                np.float32)])
            data = encode(x, kind, rng)
            reference[name] = mx.array(gguf.dequantize(data, kind).reshape(x.shape))
        else:  # norms and AltUp's output scale: around one, stored as they are
            kind = T.F32
            data = (1.0 + 0.1 * rng.normal(size=p.shape)).astype(np.float32)
            reference[name] = mx.array(data)
        if gname.startswith("altup_"):  # Gemma3NModel._stack_matrices
            stacks.setdefault(gname, []).append(data)
        else:
            w.add_tensor(gname, data, raw_dtype=kind)
    for gname, matrices in stacks.items():
        w.add_tensor(gname, np.stack(matrices), raw_dtype=qtype)
    for gname, x in (extra or {}).items():
        w.add_tensor(gname, np.asarray(x, np.float32), raw_dtype=T.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return reference


def reference_model(text: dict, weights: dict) -> gemma3n.Model:
    rows = weights["model.language_model.embed_tokens_per_layer.weight"].shape[0]
    model = gemma3n.Model(gemma3n.ModelArgs("gemma3n", {**text,
                                                        "vocab_size_per_layer_input": rows}))
    model.load_weights(list(weights.items()))
    return model


CASES = {
    # 4 layers (each with its own keys and values in llama.cpp), every tensor float32
    "tiny-f32": (TINY, T.F32, "float32", {}),
    # E2B's layout, its sliding layers by llama.cpp's default period (5), matrices Q8_0 kept
    # quantized (the per-layer embedding and AltUp's stacks too)
    "e2b-q8": (E2B, T.Q8_0, None, {"sliding_window_pattern": None}),
}


@pytest.mark.parametrize("case", CASES)
def test_gemma3n_gguf_matches_its_dequantized_tensors(case, tmp_path):
    """The converted folder computes what mlx-lm's gemma3n computes with the GGUF's tensors,
    past the sliding window: AltUp's stacks cut per stream, the settings llama.cpp hard-wires,
    the layers sharing keys, every row of the per-layer embedding read by token id (the
    zero rows of tokens past the model's own too, as llama.cpp reads them); its tokenizer
    round-trips text (Gemma's vocabulary, read as Gemma 3's)."""
    text, qtype, dtype, meta = CASES[case]
    reference = write_gemma3n_gguf(tmp_path / "g.gguf", text, qtype, meta)
    out = convert(tmp_path / "g.gguf", tmp_path / "out", dtype=dtype)
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == "gemma3n"
    for key in ("layer_types", "num_kv_shared_layers", "activation_sparsity_pattern",
                "laurel_rank", "hidden_size_per_layer_input", "sliding_window", "vocab_size"):
        assert saved["text_config"][key] == text[key], key
    assert saved["text_config"]["vocab_size_per_layer_input"] == text["vocab_size"]
    meta = {k: f.contents() for k, f in read_gguf(tmp_path / "g.gguf").fields.items()}
    assert build_tokenizer("gemma3n", meta)[0].to_str() == \
        build_tokenizer("gemma3", meta)[0].to_str()  # Gemma's vocabulary, as Gemma 3's
    model, tok = mlx_lm.load(str(out))
    ids = tok.encode(TEXT)
    assert ids[0] == 2 and tok.decode(ids[1:]) == TEXT
    x = mx.array(ids * 2)[None]
    assert x.shape[1] > 24
    # kept quantized: with float32 scales (MLX computes in float16 with float16 ones: tens of
    # percents after 22 layers of AltUp and sparse gates), the dequantized tensors' results up
    # to sums in another order, which 22 layers of the gates' cuts make 4e-4
    model.load_weights([(k, v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())
                        if k.endswith((".scales", ".biases"))], strict=False)
    tol = 1e-5 if dtype else 1e-3
    ref = reference_model(text, reference)  # (with caches: mlx-lm's gemma3n shares keys
    # and values only through them)
    assert rel_err(model(x, cache=make_prompt_cache(model)),
                   ref(x, cache=make_prompt_cache(ref))) < tol


def bad_gguf(case: str, path: Path) -> str:
    """Write the bad GGUF of ``case``; return the error's expected fragment."""
    if case == "streams":  # llama.cpp's graph runs 4 whatever the key says
        write_gemma3n_gguf(path, meta={"altup_num_inputs": 2})
        return "gemma3n.altup.num_inputs is 2; llama.cpp's graph hard-wires 4"
    if case == "sparsity":  # llama.cpp cuts the first 10 layers' gates at 0.95
        write_gemma3n_gguf(path, meta={"activation_sparsity_scale": [1.0] * 4})
        return "gemma3n.activation_sparsity_scale is"
    if case == "shared":  # llama.cpp: only layers from the 20th on share
        write_gemma3n_gguf(path, meta={"shared_kv_layers": 2})
        return "gemma3n.attention.shared_kv_layers is 2"
    if case == "shared-source":  # layer 20 (global) would read layer 19 (sliding)
        pattern = [i % 5 < 4 for i in range(19)] + [True, False, False]
        write_gemma3n_gguf(path, E2B, meta={"sliding_window_pattern": pattern})
        return "layer 20 reads the keys of layer 19"
    if case == "one-kind":
        write_gemma3n_gguf(path, meta={"sliding_window_pattern": [True] * 4})
        return "no global layers among those with keys of their own"
    if case == "head":
        write_gemma3n_gguf(path, extra={"output.weight": np.zeros((384, 64))})
        return "a head of its own"
    if case == "missing":
        write_gemma3n_gguf(path, drop=("blk.2.laurel_l.weight",))
        return "lacks model.language_model.layers.2.laurel.linear_left.weight"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["streams", "sparsity", "shared", "shared-source", "one-kind",
                                  "head", "missing"])
def test_bad_gemma3n_gguf_is_one_error_and_nothing_written(case, tmp_path, capsys):
    src = tmp_path / "bad.gguf"
    fragment = bad_gguf(case, src)
    assert_refused(src, tmp_path, capsys, fragment)
