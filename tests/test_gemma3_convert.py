"""GGUF ``gemma3`` -> MLX ``gemma3_text``: a synthetic tiny Gemma 3 GGUF written the way
llama.cpp writes one (norm weights stored as 1 + w, a SentencePiece vocabulary with byte
tokens and no merges), and its bad inputs."""

from __future__ import annotations

import mlx_lazy  # noqa: F401  (OpenBLAS before mlx)

import json
from pathlib import Path
from typing import Callable

import gguf
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from mlx.utils import tree_flatten
from mlx_lm.models import gemma3_text

from mlx_lazy.convert import convert
from numerics import rel_err
from test_convert import (add_shape, assert_refused, encode, model_module, saved_weights)
from tiny_models import VOCAB_SIZE, tiny_config

# llama.cpp's Gemma 3 layout: its converter fixes the sliding pattern at 6 and scales
# queries by 1/sqrt(head_dim); six layers, so layer 5 is global.
CONFIG = {**tiny_config("gemma3_text"), "num_hidden_layers": 6, "sliding_window_pattern": 6,
          "query_pre_attn_scalar": 16}
LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
         "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
PIECES = ["\u2581", "e", "t", "a", "o", "h", "s", "n", "i", "r", "k", "y", "p", "T", "m",
          "b", "u", "w", "q", "c", "l", "d", "f", "x", "j", "g", "v", "z", ".", ",", "?", "1",
          "2", "3", "4", "5", "th", "he", "\u2581t", "\u2581the", "\u2581a", "\u2581p", "as",
          "\u2581pas", "\u2581pass", "ke", "ey", "key", "\u2581passkey", "ss", "\u2581k",
          "\u2581key", "qu", "\u2581qu", "ck", "\u2581quick"]
TEXT = "The passkey is 12345. The quick fox? Ünïcödé, and  two spaces\nnew line"


def tokens_and_types() -> tuple[list[str], list[int]]:
    tokens = SPECIAL + ["\n", "  "] + [f"<0x{b:02X}>" for b in range(256)] + PIECES
    types = [3] * len(SPECIAL) + [4, 4] + [6] * 256 + [1] * len(PIECES)
    pad = VOCAB_SIZE - len(tokens)
    return tokens + [f"<unused{i}>" for i in range(pad)], types + [3] * pad


def add_gemma_vocabulary(w: gguf.GGUFWriter) -> None:
    """The tiny SentencePiece vocabulary's metadata, as llama.cpp's Gemma converters write it."""
    tokens, types = tokens_and_types()
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([-1000.0 if t != 1 else -float(i) for i, t in enumerate(types)])
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)


def write_gemma_gguf(path: Path, drop: str | None = None, arch: str = "gemma3",
                     qtype: T = T.F32, config: dict = CONFIG, meta: dict | None = None) -> dict:
    """A random-weight tiny Gemma (Gemma 3's ``config`` unless another is given) as llama.cpp
    writes it, with ``meta``'s metadata besides (a key given None is left out); returns the
    reference weights (mlx-lm's layout: norms as w)."""
    c = config
    w = gguf.GGUFWriter(str(path), arch)
    add_shape(w, c)
    values = {"value_length": c["head_dim"], "rope_freq_base": c["rope_theta"],
              "layer_norm_rms_eps": c["rms_norm_eps"], "sliding_window": c["sliding_window"],
              **(meta or {})}
    for key, value in values.items():
        if value is not None:
            getattr(w, f"add_{key}")(value)
    add_gemma_vocabulary(w)
    module = model_module(c["model_type"])
    model = module.Model(module.ModelArgs.from_dict(c))
    rng = np.random.default_rng(0)
    reference = {}
    for name, p in tree_flatten(model.parameters()):
        if name.startswith("lm_head"):
            continue  # tied
        base, suffix = name.rsplit(".", 1)
        if base in TOP:
            gname = f"{TOP[base]}.{suffix}"
        else:
            _, _, i, rest = base.split(".", 3)
            gname = f"blk.{i}.{LAYER[rest]}.{suffix}"
        if gname == drop:
            continue
        kind = qtype if p.ndim == 2 and gname != "token_embd.weight" else T.F32
        if p.ndim == 2:
            data = encode(rng.normal(0, 0.05, p.shape).astype(np.float32), kind, rng)
            reference[name] = mx.array(gguf.dequantize(data, kind).reshape(p.shape))
        else:  # Gemma's norm weights w; llama.cpp stores 1 + w
            x = (0.1 * rng.normal(size=p.shape)).astype(np.float32)
            reference[name] = mx.array(x)
            data = x + np.float32(1.0)
        w.add_tensor(gname, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return reference


@pytest.mark.parametrize("qtype", [T.F32, T.Q8_0])
def test_gemma3_gguf_matches_its_tensors(tmp_path, qtype):
    """The converted folder computes what mlx-lm's gemma3_text computes with the GGUF's
    tensors (norms taken back from 1 + w to w), tied head, windows from the metadata; its
    tokenizer round-trips text (byte fallback for what the vocabulary lacks) and keeps the
    control tokens whole."""
    reference = write_gemma_gguf(tmp_path / "g.gguf", qtype=qtype)
    out = convert(tmp_path / "g.gguf", tmp_path / "out", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["sliding_window"] == 24
    assert config["query_pre_attn_scalar"] == 16 and config["sliding_window_pattern"] == 6
    model, tok = mlx_lm.load(str(out))
    assert not hasattr(model, "lm_head") or "lm_head" not in model  # tied
    ref = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(CONFIG))
    ref.load_weights(list(ref.sanitize(dict(reference)).items()))
    ids = tok.encode(TEXT)
    assert ids[0] == 2 and tok.decode(ids[1:]) == TEXT
    assert tok.encode("<start_of_turn>", add_special_tokens=False) == [5]
    pieces = tok.convert_ids_to_tokens(tok.encode("The passkey", add_special_tokens=False))
    assert pieces == ["T", "he", "\u2581passkey"]
    assert tok.eos_token_ids == {1, 6}  # <eos> and <end_of_turn>
    x = mx.array(ids * 3)[None]  # 120 tokens: past the window
    assert x.shape[1] > 24
    assert rel_err(model(x), ref(x)) < 1e-5


def test_q_bits_writes_what_mlx_lm_convert_writes(tmp_path):
    """Gemma 3 requantized one tensor at a time (its tied embedding, its norms taken back
    to w) is what mlx-lm's convert makes of the float16 conversion, bit for bit."""
    assert_q_bits_as_mlx_lm_convert(tmp_path, write_gemma_gguf)


def assert_q_bits_as_mlx_lm_convert(tmp_path: Path, write: Callable[..., dict]) -> None:
    """A Q8_0 GGUF that ``write`` writes, converted with ``q_bits``, is what mlx-lm's convert
    makes of its float16 conversion, bit for bit."""
    write(tmp_path / "g.gguf", qtype=T.Q8_0)
    float16 = convert(tmp_path / "g.gguf", tmp_path / "f16", dtype="float16")
    want = saved_weights(convert(float16, tmp_path / "via-mlx-lm", q_bits=4, q_group_size=32))
    have = saved_weights(convert(tmp_path / "g.gguf", tmp_path / "q", q_bits=4,
                                 q_group_size=32))
    assert sorted(have) == sorted(want) and "model.embed_tokens.scales" in have
    for name, x in want.items():
        assert have[name].dtype == x.dtype and mx.array_equal(have[name], x), name


def test_norms_left_as_stored_would_be_wrong(tmp_path):
    """The norm convention matters: the stored 1 + w, used as w, changes the logits."""
    reference = write_gemma_gguf(tmp_path / "g.gguf")
    out = convert(tmp_path / "g.gguf", tmp_path / "out", dtype="float32")
    model, _ = mlx_lm.load(str(out))
    shifted = {k: (v + 1.0 if "norm" in k else v) for k, v in reference.items()}
    ref = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(CONFIG))
    ref.load_weights(list(ref.sanitize(shifted).items()))
    x = mx.array([[2, 40, 50, 60, 70]])
    assert rel_err(model(x), ref(x)) > 1e-2


@pytest.mark.parametrize("case, fragment", [
    ("missing", "lacks model.layers.3.post_feedforward_layernorm.weight"),
    ("architecture", "unsupported GGUF architecture 'bloom'"),
])
def test_bad_gemma3_gguf_is_one_error_and_nothing_written(tmp_path, capsys, case, fragment):
    src = tmp_path / "bad.gguf"
    if case == "missing":
        write_gemma_gguf(src, drop="blk.3.post_ffw_norm.weight")
    else:
        write_gemma_gguf(src, arch="bloom")
    assert_refused(src, tmp_path, capsys, fragment)
