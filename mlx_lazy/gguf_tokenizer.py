"""Hugging Face fast tokenizers rebuilt from a GGUF's metadata (for :mod:`mlx_lazy.conversion`).

llama.cpp stores the vocabulary, merges, token types and special ids; this rebuilds
``tokenizer.json`` and ``tokenizer_config.json`` from them: byte-level BPE with llama.cpp's
pre-tokenizer regexes (``tokenizer.ggml.model`` "gpt2"), and SentencePiece vocabularies
("llama": Llama 2, Mistral, Phi-3, Gemma) as the byte-fallback BPE such models ship, tokenizing
as llama.cpp does, and Gemma 4's "gemma4" BPE (the GGUF's merges over text spelled with "\u2581")
as llama.cpp tokenizes it. Bad metadata is a :class:`UserInputError`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .errors import UserInputError, one_line
from .gguf_tensors import GEMMA_VOCABULARY

# Split regexes of the models' own tokenizer.json files, as llama.cpp groups its pre-tokenizers
# (llama.cpp runs adapted copies of them), and llama.cpp's own for GPT-2 and its default.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Seed-Coder's (Seed-OSS's vocabulary): Qwen 2's without the newlines after punctuation
_SEED_CODER_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}|"
                     r" ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5's: Qwen 2's with combining marks (\p{M}) inside words, not punctuation
_QWEN35_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"
                 r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# K-EXAONE's (its tokenizer.json's): a word is letters (with their marks) and the single spaces
# between them
_EXAONE_MOE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?"
                     r"(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
                     r"|\s*[\r\n]|\s+(?!\S)|\s+")
# Laguna's: lines apart first, then K-EXAONE's split without its marks and word runs
_LAGUNA_SPLITS = (r"[^\n]+|[\n]+",
                  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_REGEX = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
                 r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
                 r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_REGEX = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
                r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
                r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# DeepSeek's (LLM / V2, Coder): newlines alone, then runs of letters (DeepSeek LLM's: Latin,
# Greek, Cyrillic, Armenian, Georgian, Cherokee and other cased scripts, not CJK; written
# escaped, as "\u2126" and others are not what NFC makes of them) and of punctuation (ASCII,
# fullwidth, CJK), each with one space before it, trailing whitespace, runs of CJK / Hangul
# (U+0800 to U+4E00 too), numbers (DeepSeek Coder's: each digit alone). llama.cpp matches the
# regexes without \p{..} on the text with its non-ASCII whitespace read as "\v": the ideographic
# space and the others in these ranges (U+1680, U+2000-U+200A, U+3000, ...) are whitespace
# there, not punctuation or CJK, hence "&&\S".
_DEEPSEEK_CJK = "[[一-龥ࠀ-一가-\ud7ff]&&\\S]+"
_DEEPSEEK_LLM_SPLITS = (
    r"[\r\n]",
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
    "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
    "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
    "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
    "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[[!-/:-~！-／：-～‘-‟\u3000-。]&&\\S]+", r"\s+$", _DEEPSEEK_CJK, r"\p{N}+")
_DEEPSEEK_CODER_SPLITS = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}")
# DeepSeek-V3's (R1, Moonlight): numbers in threes, runs of CJK and kana, then words (ASCII
# punctuation before ASCII letters, or one other character before letters and marks),
# punctuation and symbols, whitespace
_DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}", "[一-龥\u3040-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|"""
    r" ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Spark 2.5's: DeepSeek-V3's with a newline alone (none after punctuation, no runs of them), then
# every digit apart
_SPARK2_5_SPLITS = (*_DEEPSEEK_V3_SPLITS[:2],
                    _DEEPSEEK_V3_SPLITS[2].replace(r"[\r\n]*|\s*[\r\n]+|", r"|[\r\n]|"), r"\p{N}")
# AFM's (Trinity): a digit run's leading len % 3 digits, then threes (llama.cpp's
# \p{AFMoE_digits}); runs of CJK, kana, Hangul, Thai, Lao, Khmer, Myanmar and their neighbours;
# then DeepSeek-V3's words
_AFMOE_SPLITS = (
    r"\p{N}{1,2}(?=(?:\p{N}{3})*(?!\p{N}))|\p{N}{3}",
    "[一-鿿㐀-䶿豈-﫿぀-ゟ゠-ヿ･-ﾟ⼀-⿟เ-๿຀-໿ក-៿က-႟ꩠ-ꩿꧠ-꧿가-힯ᄀ-ᇿ]+",
    _DEEPSEEK_V3_SPLITS[2])
# Youtu-LLM's: runs of Hangul, of CJK punctuation, of Bopomofo, of CJK and kana; then words as
# llama.cpp reads its regex (its \p{Lu}, \p{Ll}, \p{Lt}, \p{Lm}, \p{Lo} are all \p{L} there:
# one letter class, so a word's case changes never split it), each digit alone, punctuation runs
# (and slashes after them), whitespace
_YOUTU_SPLITS = (
    "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a"
    "\uff1b\uff0c\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|"
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Kimi K2's, as llama.cpp's unicode.cpp runs it (by hand, not the model's regex): runs of Han
# (its ranges: CJK ideographs and their extensions, compatibility ideographs), then words of any
# other letters (one class, whatever their case; without marks), each with one other character
# before it and a contraction after, numbers in threes, punctuation runs, whitespace
_KIMI_K2_HAN = ("\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002a6df"
                "\U0002a700-\U0002ebef\U0002f800-\U0002fa1f")
_KIMI_K2_REGEX = (f"[{_KIMI_K2_HAN}]+|[^\\r\\n\\p{{L}}\\p{{N}}]?[\\p{{L}}&&[^{_KIMI_K2_HAN}]]+"
                  r"(?:'[sStTmMdD]|'[rR][eE]|'[vV][eE]|'[lL][lL])?|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


class PreTokenizer(NamedTuple):
    """How llama.cpp tokenizes for one ``tokenizer.ggml.pre`` name."""
    splits: tuple[str, ...]  # regexes splitting the text, each the words the last one left
    whole_words: bool  # a word found whole in the vocabulary is one token, unmerged
    bos: bool  # BOS is added when the GGUF does not say


_GPT2 = PreTokenizer((_GPT2_REGEX,), False, False)
_LLAMA3 = PreTokenizer((_LLAMA3_REGEX,), True, True)
#: Byte-level BPE pre-tokenizers by llama.cpp's names and groups; Llama 3's and Tekken's
#: tokenizer.json files say the same of whole words and BOS. "default" (and a GGUF without
#: the key) is llama.cpp's fallback, not GPT-2's split: punctuation runs apart first, and
#: numbers in threes after it.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **dict.fromkeys(("default", "gpt2"), PreTokenizer(
        (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_REGEX, r"\p{N}+", "[0-9][0-9][0-9]"), False, False)),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "trillion",
                     "granite-docling", "a.x-4.0", "mellum", "gigachat"), _GPT2),
    **dict.fromkeys(("smollm", "refact", "starcoder", "command-r", "codeshell", "exaone",
                     "minerva-7b"), _GPT2._replace(splits=(r"\p{N}", _GPT2_REGEX))),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2"), _LLAMA3),
    **dict.fromkeys(("dbrx", "smaug-bpe"), _LLAMA3._replace(whole_words=False, bos=False)),
    "glm4": _LLAMA3._replace(bos=False),  # GLM-4.5/4.6/4.7: no BOS (its template writes [gMASK])
    # (Ling/Ring's bailingmoe, bailingmoe2, LLaDA-MoE's: llama.cpp's regex of their own splits
    # as Qwen 2's)
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2", "hunyuan",
                     "bailingmoe", "bailingmoe2", "llada-moe"),
                    PreTokenizer((_QWEN2_REGEX,), False, False)),
    "qwen35": PreTokenizer((_QWEN35_REGEX,), False, False),
    "exaone-moe": PreTokenizer((_EXAONE_MOE_REGEX,), False, False),
    "seed-coder": PreTokenizer((_SEED_CODER_REGEX,), False, False),
    "tekken": PreTokenizer((_TEKKEN_REGEX,), True, True),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2", "talkie"),
                    PreTokenizer((_GPT4O_REGEX,), False, False)),
    "deepseek-llm": PreTokenizer(_DEEPSEEK_LLM_SPLITS, False, False),
    "deepseek-coder": PreTokenizer(_DEEPSEEK_CODER_SPLITS, False, False),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense"),
                    PreTokenizer(_DEEPSEEK_V3_SPLITS, False, False)),
    "youtu": PreTokenizer(_YOUTU_SPLITS, True, False),
    "afmoe": PreTokenizer(_AFMOE_SPLITS, False, False),
    "spark2_5": PreTokenizer(_SPARK2_5_SPLITS, False, False),
    "laguna": PreTokenizer(_LAGUNA_SPLITS, False, False),
    "kimi-k2": PreTokenizer((_KIMI_K2_REGEX,), False, False),
}
# Control tokens that end a turn although the GGUF names another EOS (llama.cpp's EOG list;
# llama.cpp makes them control tokens whatever the GGUF says: Gemma 4's converter writes
# <|tool_response>, which ends a turn that calls a tool, as user-defined).
_EOG_TEXTS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>",
              "<|return|>", "<|call|>", "<end_of_turn>", "<|end_of_text|>", "<EOT>", "_<EOT>",
              "<end_of_utterance>",
              "<eos>", "<turn|>", "<|tool_response>",
              "<|flush|>", "<|calls|>",  # Solar Open
              "[EOT]", "[EOS]",  # Kimi K2
              "<｜end▁of▁sentence｜>",  # DeepSeek
              "[e~[",  # MiniMax-M2
              "</s>")
# Special tokens whose following whitespace is dropped, in models llama.cpp names Phi-3 (as
# Phi-3's own tokenizer.json has them), but these
_PHI3_KEEPS_SPACE = ("<unk>", "<s>", "<|endoftext|>")


def eos_ids(meta: dict) -> list[int]:
    """Every end-of-generation id: the GGUF's EOS/EOT/EOM and the tokens llama.cpp ends a
    turn at by their text.

    As llama.cpp: where both ``<|return|>`` and ``<|call|>`` end generation (gpt-oss's
    harmony format), or ``<|flush|>`` and ``<|calls|>`` (Solar Open's), ``<|end|>`` does not:
    it closes each message, the reasoning too; beside ``<|tool_response>`` (Gemma 4) or
    ``<|plamo:eos|>`` (PLaMo), ``</s>`` is a normal token."""
    ids = [int(meta[f"tokenizer.ggml.{k}_token_id"]) for k in ("eos", "eot", "eom")
           if meta.get(f"tokenizer.ggml.{k}_token_id") is not None]
    tokens = meta.get("tokenizer.ggml.tokens") or []
    ids += [i for i, tok in enumerate(tokens) if tok in _EOG_TEXTS]  # of any type
    ids = list(dict.fromkeys(ids))
    texts = {tokens[i] if 0 <= i < len(tokens) else None: i for i in ids}
    calls = "<|call|>" in texts or "<|calls|>" in texts
    if "<|end|>" in texts and calls and ("<|return|>" in texts or "<|flush|>" in texts):
        ids.remove(texts["<|end|>"])
    if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
        ids.remove(texts["</s>"])
    return ids


def _rstrip(meta: dict, token: str) -> bool:
    """Whether whitespace after the special token ``token`` is dropped (llama.cpp: in models
    named Phi-3, every special token but :data:`_PHI3_KEEPS_SPACE`)."""
    name = str(meta.get("general.name", "")).lower()
    return ("phi-3" in name or "phi3" in name) and token not in _PHI3_KEEPS_SPACE


def build_tokenizer(arch: str, meta: dict) -> tuple[Any, dict]:
    """Rebuild a Hugging Face fast tokenizer (tokenizer.json + tokenizer_config.json)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, \
        pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama":
        return _sentencepiece_tokenizer(arch, meta)
    if kind == "gemma4":
        return _gemma4_tokenizer(arch, meta)
    if kind == "plamo2":
        # llama.cpp's llm_tokenizer_plamo2 is a Unigram's Viterbi over integer scores (round(
        # score * 1e4)), but it takes, of segmentations of equal score, the one whose first token
        # is longest, then the next; Hugging Face's Unigram (and SentencePiece's) the one whose
        # last token is longest. No scores can turn one rule into the other where the two hold
        # the same tokens in another order, as a run of spaces no token spells whole does (and
        # code is full of them), so the vocabulary is not rebuilt.
        raise UserInputError("GGUF tokenizer model 'plamo2' (PLaMo 2/3) is not supported: of "
                             "equally scored splits llama.cpp takes the longest first token "
                             "(5 spaces as 4 + 1), a Hugging Face Unigram the longest last "
                             "(1 + 4)")
    if kind != "gpt2":
        raise UserInputError(f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2' "
                             "byte-level BPE, 'llama' SentencePiece, 'gemma4' BPE)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise UserInputError(f"unsupported GGUF pre-tokenizer {pre!r} "
                             f"(supported: {', '.join(PRE_TOKENIZERS)})")
    tokens = _vocabulary(meta)
    merges = meta.get("tokenizer.ggml.merges") or []
    types = _token_types(meta, tokens)

    how = PRE_TOKENIZERS[pre]
    vocab = {t: i for i, t in enumerate(tokens)}
    try:
        model = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                           fuse_unk=False,
                           byte_fallback=False, ignore_merges=how.whole_words)
    except Exception as e:  # tokenizers' own errors on a merge of unknown or missing tokens
        raise UserInputError(f"GGUF tokenizer.ggml.merges are malformed ({one_line(e)})") \
            from None
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in how.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    # llama.cpp token types: 3 = control, 4 = user defined.
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False,
                                       rstrip=_rstrip(meta, tokens[i]))
                            for i, t in enumerate(types) if t in (3, 4)])

    bos = _special_token(meta, tokens, "bos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", how.bos)) and bos is not None
    post = [processors.ByteLevel(trim_offsets=False)]
    tok.post_processor = processors.Sequence(post + [_bos_first(bos, vocab)] if add_bos else post)

    return tok, _tokenizer_config(meta, tokens, add_bos,
                                  int(meta.get(f"{arch}.context_length", 4096)))


def _vocabulary(meta: dict) -> list[str]:
    """The GGUF's tokens, each a distinct string (a token id per string is what a tokenizer
    file can hold)."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise UserInputError("GGUF metadata lacks tokenizer.ggml.tokens")
    if not all(isinstance(t, str) for t in tokens):
        raise UserInputError("GGUF tokenizer.ggml.tokens must be strings")
    if len(set(tokens)) < len(tokens):
        first: dict[str, int] = {}
        i, j = next((first[t], i) for i, t in enumerate(tokens) if first.setdefault(t, i) != i)
        raise UserInputError(f"GGUF tokenizer.ggml.tokens repeats {tokens[j]!r} (ids {i} and {j})")
    return list(tokens)


def _token_types(meta: dict, tokens: list[str]) -> list[int]:
    """llama.cpp's type of each token (1 = normal where the GGUF gives none)."""
    return meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)


def _sentencepiece_decoder(strip_prefix: bool) -> Any:
    """The decoder of a vocabulary spelling spaces "\u2581" with <0xXX> byte tokens; with
    ``strip_prefix``, the space a leading "\u2581" became is dropped."""
    from tokenizers import decoders

    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    return decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] * strip_prefix)


def _bos_first(bos: str, vocab: dict[str, int]) -> Any:
    """The post-processor that puts ``bos`` before a text (and before each of a pair)."""
    from tokenizers import processors

    return processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                         special_tokens=[(bos, vocab[bos])])


def _special_token(meta: dict, tokens: list[str], key: str) -> str | None:
    """The token of ``tokenizer.ggml.<key>_token_id`` (bos, eos, unknown, padding), if any."""
    i = meta.get(f"tokenizer.ggml.{key}_token_id")
    return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None


def _tokenizer_config(meta: dict, tokens: list[str], add_bos: bool,
                      context_length: int) -> dict[str, Any]:
    """tokenizer_config.json of a tokenizer rebuilt from GGUF metadata."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "model_max_length": context_length,
    }
    for key in ("bos", "eos", "unknown", "padding"):
        t = _special_token(meta, tokens, key)
        if t is not None:
            config[{"unknown": "unk_token", "padding": "pad_token"}.get(key, f"{key}_token")] = t
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def _sentencepiece_tokenizer(arch: str, meta: dict) -> tuple[Any, dict]:
    """A SentencePiece vocabulary (``tokenizer.ggml.model`` "llama": Llama 2, Mistral 7B,
    TinyLlama, Phi-3, Gemma) as the byte-fallback BPE fast tokenizer such models ship.

    The GGUF lists no merges: they are rebuilt from the vocabulary, best first, as
    transformers does; best is the higher score, except for Gemma, whose merge order is the
    vocabulary's order (its scores do not follow it). Spaces become "\u2581". Where the GGUF
    says to (``add_space_prefix``, on unless it says otherwise, except for Gemma), each run of
    text gets a leading "\u2581", after every special or user-defined token too, as llama.cpp
    tokenizes (Llama 2's own ``tokenizer.json`` does the same), and decoding strips it again.
    Unknown and control tokens are special, user-defined ones are matched whole.
    """
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

    raw = _vocabulary(meta)
    gemma = arch in GEMMA_VOCABULARY
    # Gemma's GGUF stores runs of spaces as spaces; its tokenizer spells them with "\u2581"
    tokens = ["\u2581" * len(t) if gemma and t and not t.strip(" ") else t for t in raw]
    vocab = {t: i for i, t in enumerate(tokens)}
    if gemma:
        ranks = [-i for i in range(len(tokens))]
    else:
        ranks = meta.get("tokenizer.ggml.scores")
        if ranks is None or len(ranks) != len(tokens):
            raise UserInputError("GGUF metadata lacks tokenizer.ggml.scores for its "
                                 f"{len(tokens)} SentencePiece tokens")
    merges = []
    for i, t in enumerate(tokens):
        local = [(t[:j], t[j:]) for j in range(1, len(t)) if t[:j] in vocab and t[j:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges += [(float(ranks[i]), len(a), len(b), a, b) for a, b in local]
    merges.sort(key=lambda m: m[:3], reverse=True)  # stable: ties keep the vocabulary's order

    types = _token_types(meta, tokens)
    unk = _special_token(meta, tokens, "unknown") or "<unk>"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges],
                               unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = not gemma and bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    spaces = normalizers.Replace(" ", "\u2581")
    tok.normalizer = (normalizers.Sequence([normalizers.Prepend("\u2581"), spaces])
                      if prefix else spaces)
    if gemma:
        tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous")
    tok.decoder = _sentencepiece_decoder(strip_prefix=prefix)
    # llama.cpp token types: 2 = unknown, 3 = control, 4 = user defined.
    special = (3,) if gemma else (2, 3)
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False,
                                       rstrip=_rstrip(meta, tokens[i]))
                            for i, t in enumerate(types) if t in special])
    tok.add_tokens([AddedToken(raw[i], special=False, normalized=False,  # "\n", "<table>"
                               rstrip=_rstrip(meta, raw[i]))
                    for i, t in enumerate(types) if t == 4 and raw[i] == tokens[i]])
    bos = _special_token(meta, tokens, "bos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True)) and bos is not None
    if add_bos:
        tok.post_processor = _bos_first(bos, vocab)
    return tok, _tokenizer_config(meta, tokens, add_bos, int(meta.get(
        f"{arch}.context_length", 32768 if gemma else 4096)))


def _gemma4_tokenizer(arch: str, meta: dict) -> tuple[Any, dict]:
    """Gemma 4's vocabulary (``tokenizer.ggml.model`` "gemma4"): a BPE over UTF-8 characters
    with the GGUF's merges, spaces spelled "\u2581", tokenized as llama.cpp does.

    llama.cpp replaces every space by "\u2581" (no prefix space), cuts the text into runs of
    newlines and runs of anything else, and merges each run by the merges' ranks; a run of
    newlines that is a token is that token, unmerged; a character no token spells becomes its
    UTF-8 bytes' <0xXX> tokens. Control and user-defined tokens (``<|tool_call>``,
    ``<|channel>``: Gemma 4's tool and thinking markers, which a reply shows) are matched
    whole. BOS is added, as llama.cpp does whatever the GGUF says (mlx-lm's chat path sees
    the ``<bos>`` the chat template writes and adds none).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, \
        pre_tokenizers

    tokens = _vocabulary(meta)
    raw_merges = meta.get("tokenizer.ggml.merges")
    if not raw_merges:  # llama.cpp refuses such a file too
        raise UserInputError("GGUF metadata lacks tokenizer.ggml.merges for its gemma4 "
                             "vocabulary")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for m in raw_merges:  # llama.cpp cuts at the first space after the first character
        cut = m.find(" ", 1)
        if cut < 0:
            raise UserInputError(f"GGUF tokenizer merge {m[:40]!r} is not two tokens")
        merges.append((m[:cut], m[cut + 1:]))
    # llama.cpp takes a run of newlines that is a token whole, unmerged; the BPE here gets
    # there only through merges, as Gemma 4's rebuild each such token
    newline_ranks: dict[tuple[str, str], int] = {}
    for i, (a, b) in enumerate(merges):
        if not (a + b).strip("\n"):
            newline_ranks.setdefault((a, b), i)
    for t in tokens:
        if t and not t.strip("\n") and _merged(t, newline_ranks) != [t]:
            raise UserInputError(f"GGUF gemma4 vocabulary whose merges do not build its token "
                                 f"{t!r} is not supported")
    types = _token_types(meta, tokens)
    unk = _special_token(meta, tokens, "unknown")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=False,
                               byte_fallback=True, ignore_merges=False))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
    tok.decoder = _sentencepiece_decoder(strip_prefix=False)
    # llama.cpp token types: 3 = control, 4 = user defined (shown in a reply)
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t == 3])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(types) if t == 4])
    bos = _special_token(meta, tokens, "bos")
    if bos is not None:
        tok.post_processor = _bos_first(bos, vocab)
    return tok, _tokenizer_config(meta, tokens, bos is not None,
                                  int(meta.get(f"{arch}.context_length", 131072)))


def _merged(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """``word`` merged from its characters by BPE: the adjacent pair of lowest rank first (the
    leftmost on a tie), as llama.cpp merges."""
    pieces = list(word)
    while True:
        best = min(((ranks[pair], i) for i, pair in enumerate(zip(pieces, pieces[1:]))
                    if pair in ranks), default=None)
        if best is None:
            return pieces
        i = best[1]
        pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]
