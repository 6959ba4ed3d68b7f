"""Convert models to MLX folders that ``mlx_lm.load`` reads.

Two sources:

* a Hugging Face / MLX folder or a hub id: delegated to ``mlx_lm.convert`` (optional
  quantization and dtype);
* a GGUF file with the ``llama`` architecture (tensor types F32, F16, Q4_0, Q4_1, Q8_0):
  weights are read with ``mx.load``, q/k rows are un-permuted from llama.cpp's RoPE layout to
  the Hugging Face layout, and ``tokenizer.json`` / ``tokenizer_config.json`` are rebuilt from
  the GGUF metadata. Quantized tensors are kept quantized (affine, group size 32) or
  dequantized to a chosen dtype.

Every failure on bad input is a ``ValueError`` with a one-line message; the output folder is
written to a temporary sibling and renamed at the end, so nothing half-written is left behind.
"""

from __future__ import annotations

from . import _blas  # noqa: F401  (must precede any mlx import)

import argparse
import contextlib
import io
import json
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import mlx.core as mx

GGUF_GROUP_SIZE = 32
# GGUF tensor type ids that mx.load reads natively (quantized ones as affine triples).
GGUF_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}
_GGUF_TYPE_NAMES = {6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K",
                    13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 24: "I8", 25: "I16", 26: "I32",
                    27: "I64", 28: "F64", 30: "BF16"}
DTYPES = ("float32", "float16", "bfloat16")

# GPT-2 byte-level regex variants used by llama.cpp pre-tokenizers; "smollm" additionally
# splits every digit into its own token before the GPT-2 regex.
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = ("smollm", "gpt2", "default", "llama-bpe")

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}


# --------------------------------------------------------------------------- public API


def convert(
    source: str | os.PathLike,
    output: str | os.PathLike,
    *,
    q_bits: int | None = None,
    q_group_size: int | None = None,
    dtype: str | None = None,
    dequantize: bool = False,
) -> Path:
    """Convert ``source`` (GGUF file, HF/MLX folder or hub id) into the MLX folder ``output``.

    Args:
        source: a ``.gguf`` file, a folder with ``config.json``, or a Hugging Face hub id.
        output: folder to create; it must not exist.
        q_bits: quantize linear/embedding weights to 4 or 8 bits (affine).
        q_group_size: quantization group size (mlx-lm's default 64 when None; GGUF keeps 32).
        dtype: float dtype of unquantized weights ("float32", "float16", "bfloat16"). For a
            GGUF source, giving a dtype dequantizes all tensors to it; without dtype and
            q_bits, GGUF tensors are kept as stored.
        dequantize: dequantize an already quantized HF/MLX model.

    Returns:
        The output folder.

    Raises:
        ValueError: bad input (missing source, not GGUF, unsupported architecture / tensor
            type / tokenizer, existing output, bad option), with a one-line message.
    """
    out = Path(output)
    if out.exists():
        raise ValueError(f"output folder {out} already exists; remove it or choose another")
    if q_bits is not None and q_bits not in (4, 8):
        raise ValueError(f"--q-bits must be 4 or 8, not {q_bits}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if q_group_size is not None and q_bits is None:
        raise ValueError("--q-group-size needs --q-bits")
    src = Path(source)
    if src.is_file():
        _check_gguf_magic(src)
        if dequantize and dtype is None:
            dtype = "float32"
        with _atomic_dir(out) as tmp:
            convert_gguf(src, tmp, dtype=dtype, q_bits=q_bits, q_group_size=q_group_size)
        return out
    if src.is_dir():
        if not (src / "config.json").is_file():
            raise ValueError(f"{src} is a folder without config.json (not a HF/MLX model)")
    elif not is_hub_id(str(source)):
        raise ValueError(f"no such file or folder: {source}")
    with _atomic_dir(out) as tmp:
        _convert_hf(str(source), tmp, q_bits=q_bits, q_group_size=q_group_size, dtype=dtype,
                    dequantize=dequantize)
    return out


def is_hub_id(name: str) -> bool:
    """True when ``name`` is no local path but reads as a hub id ``owner/name``."""
    return (
        not Path(name).expanduser().exists()
        and name.count("/") == 1
        and not name.startswith((".", "/", "~"))
        and not name.endswith(".gguf")
    )


def convert_gguf(
    gguf: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: str | None = None,
    q_bits: int | None = None,
    q_group_size: int | None = None,
) -> None:
    """Write an MLX folder for a llama-architecture GGUF into the existing folder ``out_dir``.

    Prefer :func:`convert`, which checks its arguments and writes atomically.
    ``dtype=None`` keeps quantized tensors quantized (affine, group size 32, mixed bits are
    recorded per layer in the config); a dtype dequantizes them. ``q_bits`` requantizes via
    mlx-lm after dequantizing.
    """
    gguf, out_dir = Path(gguf), Path(out_dir)
    types = read_gguf_tensor_types(gguf)
    for name, t in types.items():
        if t not in GGUF_TYPES:
            tname = _GGUF_TYPE_NAMES.get(t, f"type {t}")
            raise ValueError(f"unsupported GGUF tensor type {tname} for {name} "
                             f"(supported: {', '.join(GGUF_TYPES.values())})")
    try:
        tensors, meta = mx.load(str(gguf), return_metadata=True)
    except Exception as e:  # mlx raises RuntimeError on malformed files
        raise ValueError(f"cannot read GGUF {gguf}: {e}") from None
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: 'llama')")

    config = _llama_config(meta, tensors)
    tokenizer, tokenizer_config = _build_tokenizer(meta)

    if q_bits is not None:
        # Dequantize to a float folder, then let mlx-lm quantize it.
        with tempfile.TemporaryDirectory(dir=out_dir.parent) as tmp:
            convert_gguf(gguf, tmp, dtype=dtype or "float16")
            _convert_hf(tmp, out_dir, q_bits=q_bits, q_group_size=q_group_size, dtype=None,
                        dequantize=False)
        return

    weights, quant = _gguf_weights(tensors, config, dtype)
    if quant:
        config["quantization"] = config["quantization_config"] = quant
    if dtype is not None:
        config["torch_dtype"] = dtype
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))


def read_gguf_tensor_types(path: str | os.PathLike) -> dict[str, int]:
    """Return ``{tensor name: GGUF type id}`` from a GGUF header (metadata is skipped).

    Raises ValueError when the file is not GGUF or the header is truncated.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            r = _Reader(f)
            if r.read(4) != b"GGUF":
                raise ValueError(f"{path} is not a GGUF file")
            version = r.u32()
            if version < 2:
                raise ValueError(f"{path}: GGUF version {version} is not supported")
            n_tensors, n_kv = r.u64(), r.u64()
            for _ in range(n_kv):
                r.string()
                r.skip_value(r.u32())
            types = {}
            for _ in range(n_tensors):
                name = r.string().decode("utf-8", "replace")
                n_dims = r.u32()
                r.read(8 * n_dims)
                types[name] = r.u32()
                r.u64()
            return types
    except (struct.error, EOFError, MemoryError, OverflowError):
        raise ValueError(f"{path} is not a valid GGUF file (truncated header)") from None


def main(argv: list[str] | None = None) -> int:
    """Command line entry point (``mlx-lazy-convert``, ``python convert/convert.py``)."""
    p = argparse.ArgumentParser(
        prog="mlx-lazy-convert",
        description="Convert a GGUF file (llama architecture), a Hugging Face/MLX folder or "
                    "a hub id to an MLX model folder.")
    p.add_argument("source", nargs="?", help="GGUF file, model folder or hub id")
    p.add_argument("output", nargs="?", help="output folder (must not exist)")
    p.add_argument("--q-bits", type=int, choices=(4, 8), help="quantize to 4 or 8 bits")
    p.add_argument("--q-group-size", type=int, help="quantization group size")
    p.add_argument("--dtype", choices=DTYPES,
                   help="dtype of float weights (for GGUF: dequantize everything to it)")
    p.add_argument("--dequantize", action="store_true", help="dequantize a quantized model")
    p.add_argument("--default", action="store_true",
                   help="build (or find) the default SmolLM2-135M-Instruct model in the cache "
                        "and print its folder")
    p.add_argument("--default-quantized", action="store_true",
                   help="with --default: the 4-bit copy (for Metal) instead of float32")
    args = p.parse_args(argv)
    try:
        if args.default:
            from .default_model import default_model_path

            print(default_model_path(quantized=args.default_quantized))
            return 0
        if not args.source or not args.output:
            p.print_usage(sys.stderr)
            print("error: source and output are required (or use --default)", file=sys.stderr)
            return 2
        out = convert(args.source, args.output, q_bits=args.q_bits,
                      q_group_size=args.q_group_size, dtype=args.dtype,
                      dequantize=args.dequantize)
    except ValueError as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # e.g. DefaultModelUnavailable
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


# --------------------------------------------------------------------------- helpers


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _check_gguf_magic(path: Path) -> None:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (and not a model folder)")


@contextlib.contextmanager
def _atomic_dir(out: Path) -> Iterator[Path]:
    """Yield an empty temp folder next to ``out``; rename it to ``out`` on success."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            raise ValueError(f"output folder {out} already exists; remove it or choose another")
        os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _convert_hf(source: str, out_dir: Path | str, *, q_bits: int | None,
                q_group_size: int | None, dtype: str | None, dequantize: bool) -> None:
    from mlx_lm.convert import convert as mlx_lm_convert

    target = Path(out_dir) / "model"  # mlx_lm refuses existing folders
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # keep our CLI's output to one line
            mlx_lm_convert(str(source), str(target), quantize=q_bits is not None,
                           q_bits=q_bits, q_group_size=q_group_size, dtype=dtype,
                           dequantize=dequantize)
    except ValueError:
        raise
    except Exception as e:  # hub errors, missing weights, unknown model types
        raise ValueError(f"cannot convert {source}: {type(e).__name__}: {_one_line(e)}") from None
    for item in target.iterdir():
        os.rename(item, Path(out_dir) / item.name)
    target.rmdir()


def _scalar(meta: dict, key: str, default: Any = None) -> Any:
    v = meta.get(key, default)
    return v.item() if isinstance(v, mx.array) else v


def _llama_config(meta: dict, tensors: dict) -> dict:
    g = lambda k, d=None: _scalar(meta, f"llama.{k}", d)  # noqa: E731
    n_heads = g("attention.head_count")
    hidden = g("embedding_length")
    if n_heads is None or hidden is None or g("block_count") is None:
        raise ValueError("GGUF metadata lacks llama.attention.head_count / embedding_length / "
                         "block_count")
    head_dim = g("attention.key_length") or g("rope.dimension_count") or hidden // n_heads
    if g("rope.scaling.type") not in (None, "none") or "rope_freqs.weight" in tensors:
        raise ValueError("GGUF with RoPE scaling (rope_freqs) is not supported")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": g("feed_forward_length"),
        "num_hidden_layers": g("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": g("attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": g("context_length", 4096),
        "vocab_size": g("vocab_size") or len(tokens) or tensors["token_embd.weight"].shape[0],
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }
    for key in ("bos_token_id", "eos_token_id"):
        v = _scalar(meta, f"tokenizer.ggml.{key}")
        if v is not None:
            config[key] = int(v)
    return config


def _unpermute_rows(x: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's q/k row permutation (rows (h, 2, d/2) -> (h, d/2, 2) back to HF)."""
    rows = x.shape[0]
    return (x.reshape(n_heads, rows // n_heads // 2, 2, *x.shape[1:])
            .swapaxes(1, 2).reshape(x.shape))


def _hf_name(gguf_base: str) -> str:
    parts = gguf_base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    if gguf_base in _TOP_NAMES:
        return _TOP_NAMES[gguf_base]
    raise ValueError(f"unsupported GGUF tensor {gguf_base} for the llama architecture")


def _gguf_weights(tensors: dict, config: dict, dtype: str | None) -> tuple[dict, dict]:
    """Map GGUF tensors to mlx-lm names; return (weights, quantization config or {})."""
    target = getattr(mx, dtype) if dtype else None
    bases = sorted({k.rsplit(".", 1)[0] for k in tensors})
    weights: dict[str, mx.array] = {}
    bits_of: dict[str, int] = {}
    for base in bases:
        name = _hf_name(base)
        w = tensors[f"{base}.weight"]
        scales, biases = tensors.get(f"{base}.scales"), tensors.get(f"{base}.biases")
        n_heads = {"self_attn.q_proj": config["num_attention_heads"],
                   "self_attn.k_proj": config["num_key_value_heads"]}.get(
                       name.split(".", 3)[-1])
        if scales is not None:
            bits = w.shape[-1] * 32 // (scales.shape[-1] * GGUF_GROUP_SIZE)
            if target is not None:
                w = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32),
                                  group_size=GGUF_GROUP_SIZE, bits=bits).astype(target)
                scales = biases = None
            else:
                bits_of[name] = bits
        elif target is not None:
            w = w.astype(target)
        if n_heads is not None:
            w = _unpermute_rows(w, n_heads)
            if scales is not None:
                scales, biases = _unpermute_rows(scales, n_heads), _unpermute_rows(biases, n_heads)
        weights[f"{name}.weight"] = w
        if scales is not None:
            weights[f"{name}.scales"], weights[f"{name}.biases"] = scales, biases
    quant: dict[str, Any] = {}
    if bits_of:
        common = max(set(bits_of.values()), key=list(bits_of.values()).count)
        quant = {"group_size": GGUF_GROUP_SIZE, "bits": common, "mode": "affine"}
        for name, bits in bits_of.items():
            if bits != common:
                quant[name] = {"group_size": GGUF_GROUP_SIZE, "bits": bits, "mode": "affine"}
    return weights, quant


def _build_tokenizer(meta: dict) -> tuple[Any, dict]:
    """Rebuild a Hugging Face fast tokenizer (tokenizer.json + tokenizer_config.json)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, \
        processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2' "
                         "byte-level BPE)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} "
                         f"(supported: {', '.join(PRE_TOKENIZERS)})")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    types = meta.get("tokenizer.ggml.token_type")
    types = types.tolist() if types is not None else [1] * len(tokens)

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre != "llama-bpe")
    steps = [byte_level]
    if pre == "smollm":
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    elif pre == "llama-bpe":
        steps.insert(0, pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    # llama.cpp token types: 3 = control, 4 = user defined.
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t in (3, 4)])

    def token(key: str) -> str | None:
        i = _scalar(meta, f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos = token("bos")
    add_bos = bool(_scalar(meta, "tokenizer.ggml.add_bos_token", False)) and bos is not None
    post = [processors.ByteLevel(trim_offsets=False)]
    if add_bos:
        post.append(processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tokens.index(bos))]))
    tok.post_processor = processors.Sequence(post)

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "model_max_length": int(_scalar(meta, "llama.context_length", 4096)),
    }
    for key in ("bos", "eos", "unknown", "padding"):
        t = token(key)
        if t is not None:
            config[{"unknown": "unk_token", "padding": "pad_token"}.get(key, f"{key}_token")] = t
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tok, config


class _Reader:
    """Little-endian reader for the GGUF header."""

    _SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def __init__(self, f: Any) -> None:
        self.f = f

    def read(self, n: int) -> bytes:
        b = self.f.read(n)
        if len(b) != n:
            raise EOFError
        return b

    def u32(self) -> int:
        return struct.unpack("<I", self.read(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.read(8))[0]

    def string(self) -> bytes:
        return self.read(self.u64())

    def skip_value(self, vtype: int) -> None:
        if vtype == 8:
            self.string()
        elif vtype == 9:
            inner, n = self.u32(), self.u64()
            if inner in self._SIZES:
                self.f.seek(self._SIZES[inner] * n, 1)
            else:
                for _ in range(n):
                    self.skip_value(inner)
        elif vtype in self._SIZES:
            self.read(self._SIZES[vtype])
        else:
            raise EOFError


if __name__ == "__main__":
    sys.exit(main())
