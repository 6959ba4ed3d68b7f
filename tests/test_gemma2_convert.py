"""GGUF ``gemma2`` -> MLX ``gemma2``: a synthetic tiny Gemma 2 GGUF written the way llama.cpp
writes one (Gemma 3's norms as 1 + w and vocabulary, soft-caps, a window mlx-lm ignores), and
its bad inputs."""

from __future__ import annotations

import mlx_lazy  # noqa: F401  (OpenBLAS before mlx)

import json

import mlx.core as mx
import mlx_lm
import pytest
from gguf import GGMLQuantizationType as T
from mlx_lm.models import gemma2

from mlx_lazy.convert import convert, read_gguf
from mlx_lazy.gguf_tokenizer import build_tokenizer
from numerics import rel_err
from test_convert import KQ, assert_refused, run_main
from test_gemma3_convert import TEXT, assert_q_bits_as_mlx_lm_convert, write_gemma_gguf
from tiny_models import VOCAB_SIZE

# Heads 32 wide, not hidden / heads (16), and soft-caps far from mlx-lm's defaults (50, 30) and
# from each other, small enough to bend these weights' scores and logits: a scale from the wrong
# width, or a cap dropped or swapped, shows. query_pre_attn_scalar is what llama.cpp implies;
# the epsilon one a GGUF's float32 holds exactly.
CONFIG = {"model_type": "gemma2", "hidden_size": 64, "num_hidden_layers": 4,
          "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "rms_norm_eps": 2.0**-20, "vocab_size": VOCAB_SIZE,
          "max_position_embeddings": 8192, "rope_theta": 10000.0, "sliding_window": 4096,
          "attn_logit_softcapping": 0.25, "final_logit_softcapping": 0.5,
          "query_pre_attn_scalar": 32}
SOFTCAPS = {"attn_logit_softcapping": CONFIG["attn_logit_softcapping"],
            "final_logit_softcapping": CONFIG["final_logit_softcapping"]}
# Gemma 2 27B's 46 layers: llama.cpp scales its queries by 1/sqrt(hidden / heads)
CONFIG_27B = {**CONFIG, "num_hidden_layers": 46, "query_pre_attn_scalar": 16}
# rows of 256 for K-quants
CONFIG_KQ = {**CONFIG, **KQ, "query_pre_attn_scalar": KQ["head_dim"]}


def write_gemma2_gguf(path, config: dict = CONFIG, **kwargs) -> dict:
    """A random-weight tiny Gemma 2 as llama.cpp's converter writes it (its soft-caps and
    window; no sliding-window pattern, llama.cpp's is hard-wired); the reference weights."""
    meta = {**SOFTCAPS, **kwargs.pop("meta", {})}
    return write_gemma_gguf(path, arch="gemma2", config=config, meta=meta, **kwargs)


def reference_logits(config: dict, weights: dict, x: mx.array) -> mx.array:
    """mlx-lm's gemma2 of ``config`` with ``weights``: its logits of ``x``."""
    ref = gemma2.Model(gemma2.ModelArgs.from_dict(config))
    ref.load_weights(list(weights.items()))
    return ref(x)


@pytest.mark.parametrize("config, qtype", [(CONFIG, T.F32), (CONFIG, T.Q8_0),
                                           (CONFIG, T.Q4_0), (CONFIG_KQ, T.Q4_K),
                                           (CONFIG_27B, T.F32)],
                         ids=["f32", "q8_0", "q4_0", "q4_k", "27b-f32"])
def test_gemma2_gguf_matches_its_tensors(tmp_path, config, qtype):
    """The converted folder computes what mlx-lm's gemma2 computes with the GGUF's tensors
    (norms taken back from 1 + w to w, kept quantized where they are Q8_0 / Q4_0, a K-quant
    dequantized), with the GGUF's soft-caps and llama.cpp's query scale (1/sqrt(head_dim), the
    27B's 1/sqrt(hidden / heads)); its Gemma tokenizer round-trips text."""
    reference = write_gemma2_gguf(tmp_path / "g.gguf", config, qtype=qtype)
    out = convert(tmp_path / "g.gguf", tmp_path / "out")
    got = json.loads((out / "config.json").read_text())
    assert {k: got[k] for k in config} == config
    assert ("quantization" in got) == (qtype in (T.Q8_0, T.Q4_0))
    model, tok = mlx_lm.load(str(out))
    ids = tok.encode(TEXT)
    assert ids[0] == 2 and tok.decode(ids[1:]) == TEXT
    pieces = tok.convert_ids_to_tokens(tok.encode("The passkey", add_special_tokens=False))
    assert pieces == ["T", "he", "\u2581passkey"]
    assert tok.eos_token_ids == {1, 6}  # <eos> and <end_of_turn>
    x = mx.array(ids)[None]
    assert rel_err(model(x), reference_logits(config, reference, x)) < 1e-5


def test_gemma2_vocabulary_is_gemmas(tmp_path):
    """Gemma 2's SentencePiece vocabulary is read as Gemma 3's and Gemma 1's (the same converter
    code writes all three): merges in the vocabulary's order whatever the scores say (here
    reversed: "he" would merge before "th"), runs of spaces as "\u2581" runs, no space
    prefix."""
    write_gemma2_gguf(tmp_path / "g.gguf")
    meta = {k: f.contents() for k, f in read_gguf(tmp_path / "g.gguf").fields.items()}
    meta["tokenizer.ggml.scores"] = [float(i) for i in range(VOCAB_SIZE)]
    tok = build_tokenizer("gemma2", meta)[0]
    assert tok.encode("the  passkey", add_special_tokens=False).tokens == \
        ["th", "e", "\u2581\u2581", "p", "as", "s", "key"]
    for text in (TEXT, "a   b", " x"):
        ids = tok.encode(text).ids
        assert ids == build_tokenizer("gemma3", meta)[0].encode(text).ids
        assert ids == build_tokenizer("gemma", meta)[0].encode(text).ids


def test_q_bits_writes_what_mlx_lm_convert_writes(tmp_path):
    """Gemma 2 requantized one tensor at a time (its tied embedding, its norms taken back to
    w) is what mlx-lm's convert makes of the float16 conversion, bit for bit."""
    assert_q_bits_as_mlx_lm_convert(tmp_path, write_gemma2_gguf)


@pytest.mark.parametrize("change", ["norms as stored", "scalar of hidden / heads",
                                    "attn_logit_softcapping", "final_logit_softcapping",
                                    "softcaps swapped"])
def test_each_setting_shows_in_the_logits(tmp_path, change):
    """What the match above rests on: with the stored 1 + w as w, the queries scaled by
    1/sqrt(hidden / heads), either soft-cap at mlx-lm's default or the two swapped, mlx-lm's
    gemma2 computes other logits from these weights."""
    reference = write_gemma2_gguf(tmp_path / "g.gguf")
    model, _ = mlx_lm.load(str(convert(tmp_path / "g.gguf", tmp_path / "out")))
    config, weights = dict(CONFIG), dict(reference)
    if change == "norms as stored":
        weights = {k: (v + 1.0 if "norm" in k else v) for k, v in weights.items()}
    elif change == "scalar of hidden / heads":
        config["query_pre_attn_scalar"] = CONFIG_27B["query_pre_attn_scalar"]
    elif change == "softcaps swapped":
        config.update(attn_logit_softcapping=CONFIG["final_logit_softcapping"],
                      final_logit_softcapping=CONFIG["attn_logit_softcapping"])
    else:
        del config[change]
    x = mx.array([[2, 40, 50, 60, 70, 80, 90]])
    assert rel_err(model(x), reference_logits(config, weights, x)) > 1e-2


def test_cli_notes_the_window_mlx_lm_lacks(tmp_path, capsys):
    """The command line says where the converted model stops computing what llama.cpp does:
    past the GGUF's window (mlx-lm's gemma2 has none)."""
    write_gemma2_gguf(tmp_path / "g.gguf", meta={"sliding_window": 512})
    rc, err = run_main(capsys, str(tmp_path / "g.gguf"), str(tmp_path / "out"))
    assert rc == 0, err
    assert err.startswith("note: mlx-lm's gemma2 attends over every token") and \
        "contexts up to 512 tokens" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("case, fragment", [
    ("tensor", "lacks model.layers.2.pre_feedforward_layernorm.weight"),
    ("key", "GGUF metadata lacks gemma2.attention.head_count / embedding_length / "
            "block_count / feed_forward_length / attention.layer_norm_rms_epsilon"),
    ("softcap", "gemma2.attn_logit_softcapping must be a positive number, got 0"),
    ("rope", "GGUF gemma2 with another RoPE base in its sliding-window layers"),
])
def test_bad_gemma2_gguf_is_one_error_and_nothing_written(tmp_path, capsys, case, fragment):
    """A missing tensor or required key (llama.cpp's: the norms' epsilon too), a soft-cap of 0,
    another RoPE base in the sliding layers (mlx-lm's gemma2 has one): one error line, nothing
    written."""
    src = tmp_path / "bad.gguf"
    if case == "tensor":
        write_gemma2_gguf(src, drop="blk.2.ffn_norm.weight")
    else:
        meta = {"key": {"layer_norm_rms_eps": None}, "softcap": {"attn_logit_softcapping": 0.0},
                "rope": {"rope_freq_base_swa": 1000.0}}[case]
        write_gemma2_gguf(src, meta=meta)
    assert_refused(src, tmp_path, capsys, fragment)
