"""Tokenizers rebuilt from a GGUF's metadata: byte-level BPE pre-tokenizers by llama.cpp's
names, and SentencePiece vocabularies (``tokenizer.ggml.model`` "llama": Llama 2, Mistral 7B,
TinyLlama, Phi-3).

The byte-level splits are checked against llama.cpp's own regexes, run by Python's ``regex``.
The SentencePiece reference is llama.cpp's own SPM tokenizer, written out below (its bigram
merge by score and its byte resegmentation, text split around special tokens with a space
prefix before each run of text), checked itself against ``sentencepiece`` on plain text.
The vocabulary is a tiny SentencePiece BPE model trained here, written to a GGUF as
llama.cpp's converter writes one.
"""

from __future__ import annotations

import mlx_lazy  # noqa: F401  (OpenBLAS before mlx)

import functools
import hashlib
import heapq
import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import gguf
import mlx_lm
import pytest
import regex
import sentencepiece as spm
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_lazy.conversion import read_gguf
from mlx_lazy.convert import convert
from mlx_lazy.errors import UserInputError
from mlx_lazy.folders import atomic_file
from mlx_lazy.gguf_tokenizer import PRE_TOKENIZERS, build_tokenizer
from mlx_lazy.models import cache_dir
from test_convert import assert_one_line_error, run_main, write_gguf

REPO = Path(__file__).resolve().parents[1]
CONTROL, USER = ["[INST]", "[/INST]"], "<tool>"
CODE = "def f(x):\n    if x:\n        return  x\n\treturn None  # done\n"
TEXTS = [
    "Hello world", " leading space", "  two leading spaces", "trailing space ", "",
    "When in the Course of human events, it becomes necessary",
    "multiple   spaces\n\nand new lines\r\n", CODE, "12345 67.89",
    "Ünïcödé and emoji 😀 and \u2581 the piece mark itself", "中文 text",
]
SPECIAL_TEXTS = [
    "<s>[INST] What is the passkey? [/INST] It is 12345.</s>",
    "[INST]Hello[/INST] world", "a<tool>b <tool> c", "<unk> and </s>",
    "[INST][/INST]", " [INST]  spaced  [/INST] ",
]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] "
                 "{{ m['content'] }} [/INST]{% else %}{{ m['content'] }}{{ eos_token }}"
                 "{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def sp() -> spm.SentencePieceProcessor:
    """A tiny SentencePiece BPE model with Llama 2's settings: byte fallback, identity
    normalisation, whitespace kept, digits split, whitespace-only pieces (code indents)."""
    text = (REPO / "mlx_lazy" / "data" / "declaration_of_independence.txt").read_text()
    lines = text.splitlines() + [CODE] * 20 + ["Ünïcödé text 12345"] * 5
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, model_type="bpe", vocab_size=600,
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
        user_defined_symbols=[USER], control_symbols=CONTROL, unk_id=0, bos_id=1, eos_id=2,
        pad_id=-1, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def vocab_of(sp: spm.SentencePieceProcessor, pad: int = 0) -> tuple[list, list, list]:
    """(tokens, scores, types) as llama.cpp's converter writes them: pieces as they are,
    their scores, llama.cpp's token types (the user-defined one as an added token of the
    tokenizer config makes it), ``pad`` unused ``[PADi]`` tokens after them."""
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else
                     5 if sp.is_unused(i) else 6 if sp.is_byte(i) else
                     4 if tokens[-1] == USER else 1)
    return (tokens + [f"[PAD{i}]" for i in range(pad)], scores + [-10000.0] * pad,
            types + [5] * pad)


def spm_meta(sp: spm.SentencePieceProcessor, **extra) -> dict:
    tokens, scores, types = vocab_of(sp)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": False,
            "tokenizer.chat_template": CHAT_TEMPLATE, **extra}


def llama_cpp_spm(tokens: list[str], scores: list[float], text: str) -> list[int]:
    """llama.cpp's ``llm_tokenizer_spm`` on already-escaped text: start from characters,
    merge the adjacent pair whose joint text is the best-scoring token (leftmost on a tie)
    until none is a token, then spell what is not a token by the merges that built it, or
    as its UTF-8 bytes."""
    vocab = {t: i for i, t in enumerate(tokens)}
    sym = [[c, i - 1, i + 1] for i, c in enumerate(text)]  # text, prev, next (-1 / n: none)
    queue, built = [], {}

    def pair(left: int, right: int) -> None:
        if left < 0 or right >= len(sym):
            return
        joint = sym[left][0] + sym[right][0]
        if joint in vocab:
            heapq.heappush(queue, (-scores[vocab[joint]], left, right, len(joint)))
            built[joint] = (sym[left][0], sym[right][0])

    for i in range(1, len(sym)):
        pair(i - 1, i)
    while queue:
        _, left, right, size = heapq.heappop(queue)
        a, b = sym[left], sym[right]
        if not a[0] or not b[0] or len(a[0]) + len(b[0]) != size:
            continue  # outdated: one side merged since
        a[0], b[0], a[2] = a[0] + b[0], "", b[2]
        if b[2] < len(sym):
            sym[b[2]][1] = left
        pair(a[1], left)
        pair(left, a[2])

    def spell(piece: str) -> list[int]:
        if piece in vocab:
            return [vocab[piece]]
        if piece in built:
            return [i for part in built[piece] for i in spell(part)]
        return [vocab[f"<0x{b:02X}>"] for b in piece.encode()]

    out, i = [], 0
    while i < len(sym):
        out += spell(sym[i][0])
        i = sym[i][2]
    return out


def llama_cpp_tokenize(meta: dict, text: str, rstrip: frozenset = frozenset()) -> list[int]:
    """llama.cpp's SPM ``tokenize`` with special tokens parsed: BOS, then the text cut
    around control, unknown and user-defined tokens (the longest first; the whitespace after
    those in ``rstrip`` dropped), each run of text prefixed by a space when the vocabulary
    says so and spaces escaped as "\u2581"."""
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    specials = sorted((t for t, k in zip(tokens, types) if k in (2, 3, 4)), key=len, reverse=True)
    parts: list = [text]
    for special in specials:
        cut = []
        for part in parts:
            if isinstance(part, int):
                cut.append(part)
                continue
            pieces = part.split(special)
            for j, piece in enumerate(pieces):
                if j and special in rstrip:
                    piece = piece.lstrip(" \t\n\v\f\r")
                cut += ([tokens.index(special)] if j else []) + ([piece] if piece else [])
        parts = cut
    out = [meta["tokenizer.ggml.bos_token_id"]] if meta["tokenizer.ggml.add_bos_token"] else []
    after_special = True
    for part in parts:
        if isinstance(part, int):
            out.append(part)
        else:
            escaped = ((" " if prefix and after_special else "") + part).replace(" ", "\u2581")
            out += llama_cpp_spm(tokens, meta["tokenizer.ggml.scores"], escaped)
        after_special = isinstance(part, int)
    return out


def llama_cpp_gemma4(meta: dict, text: str, ranks: dict | None = None) -> list[int]:
    """llama.cpp's tokenizer of a "gemma4" vocabulary (its BPE session, ``LLAMA_VOCAB_PRE_TYPE_
    GEMMA4``): BOS, then the text cut around control and user-defined tokens (the longest
    first); each run of text with spaces escaped as "\u2581", cut into runs of newlines and
    runs of the rest; a run of newlines that is a token stays whole, any other run is merged
    from its characters, the adjacent pair of lowest merge rank first (the leftmost on a tie);
    what is no token is spelled by its UTF-8 bytes' <0xXX> tokens. ``ranks`` caches the
    merges' ranks (pair -> rank) across calls."""
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    vocab = {t: i for i, t in enumerate(tokens)}
    if ranks is None:
        ranks = {}
    if not ranks:
        for i, m in enumerate(meta["tokenizer.ggml.merges"]):
            cut = m.find(" ", 1)
            ranks.setdefault((m[:cut], m[cut + 1:]), i)
    specials = sorted((t for t, k in zip(tokens, types) if k in (3, 4)), key=len, reverse=True)
    parts: list = [text]
    for special in specials:
        parts = [piece for part in parts for piece in (
            [part] if isinstance(part, int) else
            [x for j, chunk in enumerate(part.split(special))
             for x in ([vocab[special]] if j else []) + ([chunk] if chunk else [])])]
    out = [meta["tokenizer.ggml.bos_token_id"]]
    for part in parts:
        if isinstance(part, int):
            out.append(part)
            continue
        for word in regex.findall(r"[^\n]+|\n+", part.replace(" ", "\u2581")):
            if not word.strip("\n") and word in vocab:
                out.append(vocab[word])
                continue
            sym = list(word)
            while True:
                best = min(((ranks[pair], i) for i, pair in enumerate(zip(sym, sym[1:]))
                            if pair in ranks), default=None)
                if best is None:
                    break
                i = best[1]
                sym[i:i + 2] = [sym[i] + sym[i + 1]]
            for piece in sym:
                out += ([vocab[piece]] if piece in vocab else
                        [vocab[f"<0x{b:02X}>"] for b in piece.encode()])
    return out


def test_the_reference_is_sentencepiece_on_plain_text(sp):
    """The reference above agrees with sentencepiece itself (no special tokens in the text:
    sentencepiece does not parse them)."""
    meta = spm_meta(sp, **{"tokenizer.ggml.add_bos_token": False})
    for text in TEXTS:
        assert llama_cpp_tokenize(meta, text) == sp.encode(text), text


@pytest.mark.parametrize("prefix", [None, False])
def test_encoding_is_llama_cpps(sp, prefix):
    extra = {} if prefix is None else {"tokenizer.ggml.add_space_prefix": prefix}
    meta = spm_meta(sp, **extra)
    tok, config = build_tokenizer("llama", meta)
    for text in TEXTS + SPECIAL_TEXTS:
        assert tok.encode(text).ids == llama_cpp_tokenize(meta, text), text
    assert config["bos_token"] == "<s>" and config["eos_token"] == "</s>" and \
        config["unk_token"] == "<unk>" and config["add_bos_token"] is True


@settings(max_examples=200, deadline=None, database=None)
@given(text=st.lists(st.sampled_from(list("abcdefghijklmnopqrstuvwxyzTWH .,\n\t0123456789ÜéВ😀")
                                     + CONTROL + [USER, "<s>", "  ", "the ", "tion"]),
                     max_size=40).map("".join))
def test_encoding_is_llama_cpps_on_any_text(sp, text):
    meta = spm_meta(sp)
    assert build_tokenizer("llama", meta)[0].encode(text).ids == llama_cpp_tokenize(meta, text)


@pytest.mark.parametrize("prefix", [None, False])
def test_decoding_gives_the_text_back(sp, prefix):
    extra = {} if prefix is None else {"tokenizer.ggml.add_space_prefix": prefix}
    tok = build_tokenizer("llama", spm_meta(sp, **extra))[0]
    for text in TEXTS:  # "\u2581" is a space to every SentencePiece tokenizer
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=True) == \
            text.replace("\u2581", " "), text
    # the prefix space is the tokenizer's, not the text's: decoding strips one, and only one
    assert tok.decode(tok.encode("  x").ids[1:]) == "  x"


def test_a_converted_llama_2_style_gguf_loads_with_its_tokenizer(sp, tiny_model_dir, tmp_path):
    """A llama GGUF with a SentencePiece vocabulary (padded past the model's pieces, as
    llama.cpp pads to the config's vocab size) converts, and mlx-lm loads it with
    sentencepiece's encoding, the chat template, its EOS and the SPM streaming detokenizer."""
    tokens, scores, types = vocab_of(sp, pad=8)
    meta = spm_meta(sp)

    def vocab(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)

    write_gguf(tmp_path / "m.gguf", "llama", tiny_model_dir("llama"), vocab=vocab,
               vocab_size=len(tokens))
    model, tok = mlx_lm.load(str(convert(tmp_path / "m.gguf", tmp_path / "out")))
    assert model.args.vocab_size == len(tokens)
    for text in TEXTS:
        assert tok.encode(text) == [1] + sp.encode(text), text
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert chat == "<s>[INST] Hi [/INST]"
    assert tok.encode(chat, add_special_tokens=False) == llama_cpp_tokenize(
        {**meta, "tokenizer.ggml.add_bos_token": False}, chat)
    assert tok.eos_token_ids == {2}
    detok = tok.detokenizer
    assert type(detok).__name__ == "SPMStreamingDetokenizer"
    streamed = "Ünïcödé and emoji 😀 中文\n" + CODE
    detok.reset()
    for i in sp.encode(streamed):
        detok.add_token(i)
    detok.finalize()
    assert detok.text == streamed
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is True and config["chat_template"] == CHAT_TEMPLATE


def test_a_vocabulary_without_scores_is_one_error_line(sp, tiny_model_dir, tmp_path, capsys):
    tokens, _, types = vocab_of(sp)

    def vocab(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_types(types)

    write_gguf(tmp_path / "m.gguf", "llama", tiny_model_dir("llama"), vocab=vocab,
               vocab_size=len(tokens))
    rc, err = run_main(capsys, str(tmp_path / "m.gguf"), str(tmp_path / "out"))
    assert_one_line_error(rc, err, "GGUF metadata lacks tokenizer.ggml.scores")
    assert not (tmp_path / "out").exists()


# llama.cpp's adapted split regexes (src/llama-vocab.cpp, ``llm_tokenizer_bpe``), by its
# pre-tokenizer groups: what it splits a text into before the merges.
_CPP_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_CPP_LLAMA3 = (_CPP_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CPP_QWEN2 = (_CPP_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_CPP_QWEN35 = (_CPP_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
               r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CPP_SEED_CODER = (_CPP_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
                   r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+")
_CPP_UPPER, _CPP_LOWER = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
_CPP_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_CPP_UPPER}*{_CPP_LOWER}+|"
               rf"[^\r\n\p{{L}}\p{{N}}]?{_CPP_UPPER}+{_CPP_LOWER}*|\p{{N}}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CPP_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_CPP_UPPER}*{_CPP_LOWER}+{_CPP_CONTRACTIONS}?|"
              rf"[^\r\n\p{{L}}\p{{N}}]?{_CPP_UPPER}+{_CPP_LOWER}*{_CPP_CONTRACTIONS}?|"
              r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CPP_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CPP_YOUTU_WORDS = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                    + _CPP_CONTRACTIONS + r"?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
                    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CPP_CONTRACTIONS
                    + r"?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CPP_SPLITS = {  # each name's regexes, applied in turn, by llama.cpp's switch
    **dict.fromkeys(("default", "gpt2"),  # llama.cpp's fallback ("gpt2" is no name of its)
                    (r"[\p{P}\$\+<=>\^~\|]+", _CPP_GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "trillion",
                     "granite-docling", "a.x-4.0", "mellum", "gigachat"), (_CPP_GPT2,)),
    **dict.fromkeys(("smollm", "refact", "starcoder", "command-r", "codeshell", "exaone",
                     "minerva-7b"), (r"\p{N}", _CPP_GPT2)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "dbrx", "smaug-bpe", "glm4"), (_CPP_LLAMA3,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2", "hunyuan"),
                    (_CPP_QWEN2,)),
    "qwen35": (_CPP_QWEN35,),
    # Ling/Ring's, as llama-vocab.cpp writes it (its own regex: Qwen 2's splits)
    **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"), (
        "'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
        "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",)),
    # K-EXAONE's, as llama-vocab.cpp writes it
    "exaone-moe": ("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                   "|[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|\\p{N}"
                   "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",),
    "seed-coder": (_CPP_SEED_CODER,),
    "tekken": (_CPP_TEKKEN,),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2", "talkie"), (_CPP_GPT4O,)),
    # DeepSeek LLM's letter class (a thousand characters) as the module writes it: the real
    # vocabulary's test checks it
    "deepseek-llm": ("[\r\n]", PRE_TOKENIZERS["deepseek-llm"].splits[1],
                     "\\s?[!-/:-~！-／：-～‘-‟\u3000-。]+", "\\s+$", "[一-龥ࠀ-一가-\ud7ff]+",
                     "\\p{N}+"),
    "deepseek-coder": ("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[一-龥ࠀ-一가-\ud7ff]+", "\\p{N}"),
    # Hunyuan dense's: DeepSeek-V3's
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense"), (
        "\\p{N}{1,3}", "[一-龥\u3040-ゟ゠-ヿ]+",
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
        "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")),
    # AFM's: its digits (llama.cpp's custom \p{AFMoE_digits}: our regex, checked against
    # unicode.cpp's rule in test_afmoe_digits_split_as_llama_cpp), llama-vocab.cpp's CJK class,
    # DeepSeek-V3's words
    # Laguna's, as llama-vocab.cpp writes it
    "laguna": ("[^\\n]+|[\\n]+",
               "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?"
               "\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"),
    "afmoe": (PRE_TOKENIZERS["afmoe"].splits[0],
              "[一-鿿㐀-䶿豈-﫿぀-ゟ゠-ヿ･-ﾟ⼀-⿟เ-๿຀-໿ក-៿က-႟ꩠ-ꩿꧠ-꧿가-힯ᄀ-ᇿ]+",
              "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
              "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"),
    # Spark 2.5's, as llama-vocab.cpp writes it
    "spark2_5": ("\\p{N}{1,3}", "[一-龥\u3040-ゟ゠-ヿ]+",
                 "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
                 "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+", "\\p{N}"),
    # Kimi K2's, as unicode.cpp's unicode_regex_split_custom_kimi_k2 cuts by hand: Han by its
    # ranges (extensions B to F and the compatibility supplement apart), words of any other
    # letters (no case split, no marks), digits in threes, punctuation, whitespace
    "kimi-k2": ("[\\u4e00-\\u9fff\\u3400-\\u4dbf\\U00020000-\\U0002a6df\\U0002a700-\\U0002b73f"
                "\\U0002b740-\\U0002b81f\\U0002b820-\\U0002ceaf\\U0002ceb0-\\U0002ebef\\uf900-\\ufaff"
                "\\U0002f800-\\U0002fa1f]+|[^\\r\\n\\p{L}\\p{N}]?(?:(?![\\u4e00-\\u9fff\\u3400-\\u4dbf"
                "\\U00020000-\\U0002ebef\\uf900-\\ufaff\\U0002f800-\\U0002fa1f])\\p{L})+"
                "(?:'[sS]|'[tT]|'[mM]|'[dD]|'[rR][eE]|'[vV][eE]|'[lL][lL])?|\\p{N}{1,3}"
                "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",),
    # Youtu-LLM's, its letter categories one class (llama.cpp collapses each to \p{L})
    "youtu": ("[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+",
              _CPP_YOUTU_WORDS.replace("\\p{Lu}", "\\p{L}").replace("\\p{Ll}", "\\p{L}")
              .replace("\\p{Lt}", "\\p{L}").replace("\\p{Lm}", "\\p{L}")
              .replace("\\p{Lo}", "\\p{L}")),
}
# llama.cpp's ignore_merges groups, and those of them it adds BOS for (not GLM-4.5's)
CPP_WHOLE_WORDS = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                   "midm-2.0", "lfm2", "tekken", "glm4", "youtu"}
CPP_BOS = CPP_WHOLE_WORDS - {"glm4", "youtu"}
SPLIT_TEXTS = TEXTS + [
    "I'm sure THEY'LL say it's HTTPServer's CamelCase: getHTTPResponseCode()",
    "Numbers 1234567 and 3.14159, paths a/b/c//d, URLs http://x.io/?q=1",
    "Ünïcödé ÀÉÎ, Ελληνικά, русский ТЕКСТ, 日本語のテキスト, 한국어, عربى",
    "tabs\t\tand\r\nwindows\r\n\r\nlines   \n  end  ",
    "中文，日本語のカタカナ、한국어 123456789 ０１２ ½ ①",
    "ideographic\u3000space 。\u3000、 \u2000en quad 中\u3000文 한\u205f국 !\u3000! "
    "\u00a0\u00a0x ½ 😀 \t",
    "Han and not: 汉字々〇⺀ 𠀀豈\u9ffd x中y 'S中",
]


def byte_level(word: str) -> str:
    from tokenizers.pre_tokenizers import ByteLevel
    return "".join(piece for piece, _ in ByteLevel(add_prefix_space=False, use_regex=False)
                   .pre_tokenize_str(word))


def cpp_split(patterns: tuple[str, ...], text: str) -> list[str]:
    """llama.cpp's ``unicode_regex_split``: each pattern cuts every word the last one left
    into its matches and the text between them, matching where non-ASCII whitespace reads
    as "\\v" (as its ``std::regex`` sees the text: a class such as DeepSeek's "\\u3000-。"
    never matches the ideographic space)."""
    words = [text] if text else []
    for pattern in patterns:
        cut = []
        for word in words:
            end = 0
            seen = "".join("\v" if c > "\x7f" and regex.match(r"\s", c) else c for c in word)
            for m in regex.finditer(pattern, seen):
                cut += [word[end:m.start()]] * (m.start() > end) + [word[m.start():m.end()]]
                end = m.end()
            cut += [word[end:]] * (end < len(word))
        words = cut
    return words


def byte_level_meta(pre: str, tokens: list[str] | None = None, merges: list[str] = ()) -> dict:
    from tokenizers.pre_tokenizers import ByteLevel
    alphabet = sorted(ByteLevel.alphabet())
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": list(dict.fromkeys(alphabet + (tokens or []))),
            "tokenizer.ggml.merges": list(merges)}


@pytest.mark.parametrize("pre", sorted(CPP_SPLITS))
def test_byte_level_splits_are_llama_cpps(pre):
    tok = build_tokenizer("llama", byte_level_meta(pre))[0]
    for text in SPLIT_TEXTS:
        ours = [piece for piece, _ in tok.pre_tokenizer.pre_tokenize_str(text)]
        assert ours == [byte_level(w) for w in cpp_split(CPP_SPLITS[pre], text)], text


#: Combining marks (\p{M}): decomposed accents, Devanagari and Khmer vowel signs, an emoji's
#: variation selector
MARKS_TEXT = ("cafe\u0301 e\u0300 \u0301x, \u0939\u093f\u0928\u094d\u0926\u0940, "
              "\u1797\u17b6\u179f\u17b6 \u2764\ufe0f!")


def test_afmoe_digits_split_as_llama_cpp():
    """AFM's digit runs as unicode.cpp's unicode_regex_split_custom_afmoe cuts them: the first
    len % 3 digits (if any), then threes; any Unicode number (\\p{N}) counts."""
    tok = build_tokenizer("afmoe", byte_level_meta("afmoe"))[0]
    for n in range(1, 11):
        for digit in ("7", "\u0663", "\u2460"):  # ASCII, Arabic-Indic, circled
            run = digit * n
            want = ([run[:n % 3]] if n % 3 else []) + [run[i:i + 3] for i in range(n % 3, n, 3)]
            ours = [piece for piece, _ in tok.pre_tokenizer.pre_tokenize_str(f"x{run}y")]
            assert ours == [byte_level(w) for w in ["x", *want, "y"]], (n, digit)


def test_qwen35_words_take_in_combining_marks():
    """Qwen3.5's split keeps a word's combining marks in it, as llama.cpp's regex does (Qwen 2's
    splits them off)."""
    tok = build_tokenizer("qwen35", byte_level_meta("qwen35"))[0]
    ours = [piece for piece, _ in tok.pre_tokenizer.pre_tokenize_str(MARKS_TEXT)]
    assert ours == [byte_level(w) for w in cpp_split((_CPP_QWEN35,), MARKS_TEXT)]
    assert ours != [byte_level(w) for w in cpp_split((_CPP_QWEN2,), MARKS_TEXT)]


def test_every_named_pre_tokenizer_is_checked():
    """Each name is in the table above (its splits checked against llama.cpp's group), with
    llama.cpp's ignore_merges."""
    assert set(PRE_TOKENIZERS) == set(CPP_SPLITS)
    assert {name for name, how in PRE_TOKENIZERS.items() if how.whole_words} == CPP_WHOLE_WORDS


@pytest.mark.parametrize("pre", ["llama-bpe", "tekken", "qwen2", "smollm", "glm4", "deepseek-v3"])
@pytest.mark.parametrize("said", [None, True, False])
def test_bos_as_the_gguf_says_or_as_llama_cpp_defaults(pre, said):
    """A GGUF's add_bos_token rules; without it, llama.cpp adds BOS for the Llama 3 group
    and Tekken (Llama 3's tokenizer_config.json has no such key, so its GGUFs may not), not
    for GLM-4.5's "glm4", though it splits as Llama 3 does."""
    meta = byte_level_meta(pre, ["<s>"])
    meta["tokenizer.ggml.bos_token_id"] = bos = len(meta["tokenizer.ggml.tokens"]) - 1
    if said is not None:
        meta["tokenizer.ggml.add_bos_token"] = said
    tok, config = build_tokenizer("llama", meta)
    added = said if said is not None else pre in CPP_BOS
    assert (tok.encode("hi").ids[0] == bos) == added == config["add_bos_token"]


@pytest.mark.parametrize("pre", ["llama-bpe", "tekken", "qwen2", "gpt-4o", "glm4"])
def test_a_whole_word_in_the_vocabulary_skips_the_merges_where_llama_cpp_does(pre):
    """" abc" is a token ("\u0120abc") no merge reaches: llama.cpp's ignore_merges groups
    (Llama 3, Tekken) take the word whole, the others merge it to " ab", "c"."""
    meta = byte_level_meta(pre, ["\u0120a", "\u0120ab", "\u0120abc"],
                           ["\u0120 a", "\u0120a b"])
    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    ids = build_tokenizer("llama", meta)[0].encode(" abc").ids
    whole = pre in CPP_WHOLE_WORDS
    assert ids == ([vocab["\u0120abc"]] if whole else [vocab["\u0120ab"], vocab["c"]])


# llama.cpp's own tokenizer tests: real vocabularies written as GGUFs (no weights), inputs,
# and the ids llama.cpp gives them (models/ggml-vocab-*.gguf{,.inp,.out}), from the source
# distribution of llama-cpp-python on PyPI, which vendors llama.cpp.
LLAMA_CPP_SDIST = ("llama-cpp-python==0.3.36",
                   "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")
# Llama 2 / Mistral 7B v0.1 (SentencePiece), Phi-3 (SentencePiece), Llama 3 (ignore_merges),
# Qwen 2, GPT-2 and MPT (GPT-2's split), Refact, StarCoder and Command-R (digits apart first, as
# Granite 3.x's "refact" and SmolLM's "smollm"), Qwen3.5 (combining marks inside words), Gemma 4
# (BPE over "\u2581"-spelled text), DeepSeek LLM and DeepSeek Coder (their own splits: letters,
# punctuation, CJK and digits apart)
LLAMA_CPP_VOCABS = ("llama-spm", "phi-3", "llama-bpe", "qwen2", "gpt-2", "mpt", "refact",
                    "starcoder", "command-r", "qwen35", "gemma-4", "deepseek-llm", "deepseek-coder")


@pytest.fixture(scope="module")
def llama_cpp_vocabs() -> Path:
    """The folder of llama.cpp's vocabulary tests, taken from the sdist once into the cache."""
    folder = cache_dir() / "llama.cpp-vocab-tests"
    files = [f"ggml-vocab-{n}.gguf{ext}" for n in LLAMA_CPP_VOCABS for ext in ("", ".inp", ".out")]
    if all((folder / f).is_file() for f in files):
        return folder
    requirement, sha256 = LLAMA_CPP_SDIST
    with tempfile.TemporaryDirectory() as tmp:
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                              ":all:", "--disable-pip-version-check", "-q", "-d", tmp,
                              requirement], capture_output=True, text=True)
        sdists = list(Path(tmp).glob("*.tar.gz"))
        if got.returncode or not sdists:
            pytest.skip(f"{requirement} cannot be downloaded: {got.stderr.strip()[-200:]}")
        assert hashlib.sha256(sdists[0].read_bytes()).hexdigest() == sha256
        folder.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdists[0]) as tar:
            for member in tar.getmembers():
                name = member.name.rpartition("/")[2]
                if name in files:  # written whole, then renamed into place (another
                    # test worker may be writing the same file beside: each its own temporary)
                    with atomic_file(folder / name, "wb") as f:
                        f.write(tar.extractfile(member).read())
    return folder


@functools.cache
def vocabulary(folder: Path, name: str) -> dict:
    """The metadata of llama.cpp's vocabulary GGUF ``name`` (read once: Gemma 4's takes
    seconds)."""
    reader = read_gguf(folder / f"ggml-vocab-{name}.gguf")
    return {k: f.contents() for k, f in reader.fields.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", LLAMA_CPP_VOCABS)
def test_real_vocabularies_tokenize_as_llama_cpp(name, llama_cpp_vocabs):
    """Each of llama.cpp's tests (46 texts: spaces, newlines, tabs, digits, accents, CJK,
    emoji, code) gives llama.cpp's ids, no special tokens added."""
    meta = vocabulary(llama_cpp_vocabs, name)
    tok = build_tokenizer(meta["general.architecture"], meta)[0]
    texts = (llama_cpp_vocabs / f"ggml-vocab-{name}.gguf.inp").read_text(
        encoding="utf-8").split("\n__ggml_vocab_test__\n")
    if texts[-1] == "":  # after the last text's separator (Gemma 4's file has none there)
        texts.pop()
    ids = (llama_cpp_vocabs / f"ggml-vocab-{name}.gguf.out").read_text().strip("\n").split("\n")
    assert len(texts) == len(ids) > 40
    for text, want in zip(texts, ids):
        assert tok.encode(text, add_special_tokens=False).ids == \
            [int(i) for i in want.split()], text


# llama.cpp's ids for DeepSeek's splits on more texts than its tests have (and DeepSeek-V3's and
# Kimi K2's, which it has no test of), generated by llama-cpp-python 0.3.36 from its test
# vocabularies (for "deepseek-v3" and "kimi-k2", DeepSeek LLM's with tokenizer.ggml.pre rewritten
# by the gguf package's GGUFReader / GGUFWriter): Llama(path, vocab_only=True).tokenize(
# text.encode(), add_bos=False, special=False), and add_bos=True, special=True for "with_bos".
# The texts: CJK / kana / Hangul, digit runs of 1 to 10, punctuation, whitespace runs (non-ASCII
# ones too), newlines, emoji, code, contractions in any case, CamelCase, Han at the edges of
# llama.cpp's ranges, random mixes of those. Each pre-tokenizer agreed with llama.cpp on 4,600
# such texts (Kimi K2's on 5,500: mixes of those pieces, and of random characters of the
# first three Unicode planes).
DEEPSEEK_IDS = REPO / "tests" / "data" / "deepseek_tokens.json"


@pytest.mark.slow
@pytest.mark.parametrize("pre", ["deepseek-llm", "deepseek-coder", "deepseek-v3", "kimi-k2"])
def test_deepseek_splits_tokenize_as_llama_cpp(pre, llama_cpp_vocabs):
    """DeepSeek's splits give llama.cpp's ids, and Kimi K2's (Han runs apart, then words with
    their contractions); DeepSeek-V3's (numbers in threes, CJK and kana runs, then words) its
    BOS first where the GGUF says to add it, special tokens parsed."""
    name = "deepseek-coder" if pre == "deepseek-coder" else "deepseek-llm"
    meta = {**vocabulary(llama_cpp_vocabs, name), "tokenizer.ggml.pre": pre}
    tok, config = build_tokenizer("deepseek2", meta)
    want = json.loads(DEEPSEEK_IDS.read_text(encoding="utf-8"))
    assert len(want["texts"]) == len(want["ids"][pre]) > 150
    for text, ids in zip(want["texts"], want["ids"][pre]):
        assert tok.encode(text, add_special_tokens=False).ids == ids, text
    if pre == "deepseek-v3":
        for text, ids in want["with_bos"]:
            assert tok.encode(text).ids == ids, text
    assert config["bos_token"] == "<｜begin▁of▁sentence｜>" and config["add_bos_token"] is True
    assert config["eos_token"] == "<｜end▁of▁sentence｜>"


@pytest.fixture(scope="module")
def gemma_4(llama_cpp_vocabs) -> tuple[dict, object, dict]:
    """llama.cpp's Gemma 4 vocabulary: its metadata, the tokenizer rebuilt from it, the
    reference's merge ranks."""
    meta = vocabulary(llama_cpp_vocabs, "gemma-4")
    return meta, build_tokenizer("gemma4", meta)[0], {}


@pytest.mark.slow
@settings(max_examples=150, deadline=None, database=None)
@given(text=st.lists(st.sampled_from(list("abcdefghijklmnopqrstuvwxyzTWH .,'\n\t0123456789ÜéВ😀中")
                                     + ["\u2581", "<turn|>", "<|turn>", "<|tool_call>", "<bos>",
                                        "  ", "\n\n\n", " \n", "<unused3>", "\ufeff"]),
                     max_size=30).map("".join))
def test_gemma_4_tokenizes_any_text_as_llama_cpp(gemma_4, text):
    """Gemma 4's real vocabulary on any text: llama.cpp's ids (its BOS first; runs of spaces,
    newlines, markers, text the vocabulary spells only in bytes), and decoding gives the text
    back."""
    meta, tok, ranks = gemma_4
    ids = tok.encode(text).ids
    assert ids == llama_cpp_gemma4(meta, text, ranks)
    # a "\u2581" of the text reads as the space it spells, as in llama.cpp
    assert tok.decode(ids[1:], skip_special_tokens=False) == text.replace("\u2581", " ")


@pytest.mark.slow
def test_gemma_4_markers_and_turns(gemma_4):
    """Gemma 4's chat turns (control tokens), its tool and thinking markers (user-defined:
    matched whole and shown when a reply is decoded), its end of turn and tool call as
    end-of-generation tokens (llama.cpp's list); BOS added once, as llama.cpp forces it."""
    from mlx_lazy.gguf_tokenizer import eos_ids

    meta, tok, _ = gemma_4
    text = "<|turn>user\nHi<turn|>\n<|turn>model\n<|tool_call>call:f{}<tool_call|>"
    ids = tok.encode(text).ids
    assert ids[:2] == [2, 105] and ids.count(2) == 1 and 48 in ids and 49 in ids
    shown = tok.decode(ids, skip_special_tokens=True)
    assert shown == "user\nHi\nmodel\n<|tool_call>call:f{}<tool_call|>"
    assert sorted(eos_ids(meta)) == [1, 50, 106]  # <eos>, <|tool_response>, <turn|>


@pytest.mark.slow
def test_phi_3_drops_the_whitespace_after_its_special_tokens(llama_cpp_vocabs):
    """llama.cpp strips the whitespace after a special token in models named Phi-3 (Phi-3's
    tokenizer.json says rstrip), but after <unk>, <s> and <|endoftext|>: a chat turn is what
    llama.cpp makes of it, not a newline token more per marker."""
    meta = vocabulary(llama_cpp_vocabs, "phi-3")
    assert "phi3" in meta["general.name"].lower()
    tok = build_tokenizer("phi3", meta)[0]
    keeps = {"<unk>", "<s>", "<|endoftext|>"}
    rstrip = frozenset(t for t, k in zip(meta["tokenizer.ggml.tokens"],
                                         meta["tokenizer.ggml.token_type"])
                       if k in (2, 3, 4) and t not in keeps)
    no_bos = {**meta, "tokenizer.ggml.add_bos_token": False}
    for text in ("<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\n",
                 "<s> a <|endoftext|>\n b </s>  c"):
        want = llama_cpp_tokenize(no_bos, text, rstrip)
        assert tok.encode(text, add_special_tokens=False).ids == want, text
    assert want != llama_cpp_tokenize(no_bos, text)  # the stripping is seen
    renamed = build_tokenizer("phi3", {**meta, "general.name": "Phi 4 Mini"})[0]
    assert renamed.encode(text, add_special_tokens=False).ids == llama_cpp_tokenize(no_bos, text)


def gemma4_meta(tokens: list[str], merges: list[str]) -> dict:
    """A tiny "gemma4" vocabulary: the control tokens, ``tokens``, the 256 byte tokens."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + tokens + [f"<0x{b:02X}>" for b in range(256)]
    return {"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3] * 4 + [1] * (len(tokens) - 260) + [6] * 256,
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": 2,
            "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3}


def test_gemma4_merges_stop_at_newlines():
    """llama.cpp cuts Gemma 4's text into runs of newlines and runs of the rest before merging:
    a merge across a newline never applies."""
    meta = gemma4_meta(["a", "\n", "\u2581", "a\n", "\na", "\n\n", "\u2581a"],
                       ["a \n", "\n a", "\n \n", "\u2581 a"])
    tok = build_tokenizer("gemma4", meta)[0]
    for text in ("a\na", " a\n\na a", "\n\n\na\n"):
        assert tok.encode(text).ids == llama_cpp_gemma4(meta, text), text
    assert tok.encode("a\na", add_special_tokens=False).ids == [4, 5, 4]


def test_a_gemma4_newline_token_its_merges_cannot_build_is_refused():
    """llama.cpp takes a run of newlines that is a token whole; the rebuilt BPE reaches such
    tokens by merges only, so a vocabulary whose merges miss one is one clear error."""
    meta = gemma4_meta(["\n", "\n\n", "\n\n\n"], ["\n \n"])
    with pytest.raises(UserInputError, match=re.escape(r"do not build its token '\n\n\n'")):
        build_tokenizer("gemma4", meta)
    meta["tokenizer.ggml.merges"] = ["\n \n", "\n\n \n"]
    tok = build_tokenizer("gemma4", meta)[0]
    assert tok.encode("\n\n\n", add_special_tokens=False).ids == [6]


@pytest.mark.parametrize("has_call", [True, False])
def test_harmony_end_of_message_is_not_end_of_generation(has_call):
    """gpt-oss ends its reasoning and its answer with <|end|>, and the turn with <|return|> or
    <|call|>: where both of those are there, <|end|> does not stop generation (llama.cpp's
    rule); elsewhere (Phi-3) it does."""
    from mlx_lazy.gguf_tokenizer import eos_ids

    tokens = ["a", "<|end|>", "<|return|>", "<|endoftext|>"] + ["<|call|>"] * has_call
    meta = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1] + [3] * 4,
            "tokenizer.ggml.eos_token_id": 2}
    assert sorted(eos_ids(meta)) == ([2, 3, 4] if has_call else [1, 2, 3])


@pytest.mark.parametrize("tokens, expected", [
    # Solar Open: <|flush|> and <|calls|> end a turn, <|end|> then closes a message only
    (["<eos>", "<|end|>", "<|flush|>", "<|calls|>"], [0, 2, 3]),
    (["<eos>", "<|end|>", "<|flush|>"], [0, 1, 2]),
    (["<eos>", "[EOT]", "[EOS]"], [0, 1, 2]),  # Kimi K2
    (["<eos>", "<\uff5cend\u2581of\u2581sentence\uff5c>"], [0, 1]),  # DeepSeek
    (["<eos>", "[e~["], [0, 1]),  # MiniMax-M2
    (["<eos>", "</s>"], [0, 1]),
    # beside Gemma 4's <|tool_response> or PLaMo's EOS, </s> is a normal token
    (["<eos>", "</s>", "<|tool_response>"], [0, 2]),
    (["<|plamo:eos|>", "</s>"], [0]),
], ids=["solar_open", "end_without_calls", "kimi_k2", "deepseek", "minimax_m2", "s",
        "gemma4_s", "plamo_s"])
def test_end_of_generation_texts_as_llama_cpp(tokens, expected):
    """The tokens llama.cpp (0.3.36's llama-vocab.cpp) ends generation at by their text
    beside the GGUF's EOS (id 0 here), and the two it takes back where a family's markers say
    they close a message only."""
    from mlx_lazy.gguf_tokenizer import eos_ids

    meta = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.eos_token_id": 0}
    assert sorted(eos_ids(meta)) == expected


@pytest.mark.parametrize("meta, fragment", [
    ({"tokenizer.ggml.model": "gpt2"}, "lacks tokenizer.ggml.tokens"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": [1, 2]}, "must be strings"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "a"]},
     "repeats 'a' (ids 0 and 2)"),
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "x", "x"],
      "tokenizer.ggml.scores": [0.0] * 3}, "repeats 'x' (ids 1 and 2)"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"],
      "tokenizer.ggml.merges": ["a c"]}, "merges are malformed"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"],
      "tokenizer.ggml.merges": ["ab"]}, "merges are malformed"),
], ids=["no_tokens", "not_strings", "repeated", "repeated_spm", "unknown_merge", "no_space"])
def test_malformed_vocabularies_are_one_error(meta, fragment):
    """Malformed tokenizer metadata is one UserInputError naming it (it was a KeyError or a
    tokenizers exception, or, for a repeated token, a folder mlx-lm could not load)."""
    with pytest.raises(UserInputError, match=regex.escape(fragment)):
        build_tokenizer("llama", meta)


def test_end_of_turn_tokens_by_their_text_whatever_their_type():
    """llama.cpp ends generation at "<|im_end|>" and its kind by text, a token marked normal
    too (it warns and makes it a control token)."""
    from mlx_lazy.gguf_tokenizer import eos_ids

    meta = {"tokenizer.ggml.tokens": ["a", "<|im_end|>", "<|eot_id|>"],
            "tokenizer.ggml.token_type": [1, 1, 4], "tokenizer.ggml.eos_token_id": 0}
    assert eos_ids(meta) == [0, 1, 2]
