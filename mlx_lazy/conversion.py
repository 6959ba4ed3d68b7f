"""Convert models to MLX folders that ``mlx_lm.load`` reads (the command line is
:mod:`mlx_lazy.convert`).

Two sources:

* a Hugging Face / MLX folder or a hub id: delegated to ``mlx_lm.convert`` (optional
  quantization and dtype);
* a GGUF file, read with the ``gguf`` package (llama.cpp's reference reader): architectures
  ``llama`` (Mistral's GGUFs use it too; Llama 3.1/3.2's ``rope_freqs`` become mlx-lm's
  ``llama3`` RoPE scaling), ``qwen2``, ``qwen3``, ``qwen3moe`` (to mlx-lm's
  ``qwen3_moe``: the experts' stacked weights) and ``gemma3`` (to mlx-lm's
  ``gemma3_text``: llama.cpp stores Gemma's norm weights as 1 + w, mlx-lm as w; its
  SentencePiece vocabulary becomes a byte-fallback BPE), ``phi3`` (Phi-3/3.5, Phi-4-mini: fused
  q/k/v and gate/up tensors as mlx-lm's ``phi3`` has them, partial RoPE, LongRoPE factors),
  ``gpt-oss`` (to mlx-lm's ``gpt_oss``: attention sinks, biases, the sliding-window layers,
  YaRN RoPE; not llama.cpp's optional fused ``ffn_gate_up_exps``),
  ``smollm3`` (no RoPE in every 4th layer, as llama.cpp hard-wires it), ``granite`` (Granite
  3.x dense: its embedding, residual, attention and logit multipliers), ``olmo2`` (norms after
  each branch; an OLMo 3 GGUF, with a sliding window, is refused) and ``exaone4`` (its
  sliding window and pattern, global layers without RoPE; Llama 3 RoPE scaling from
  ``rope_freqs``), ``qwen35`` / ``qwen35moe`` (Qwen3.5/3.6's text model, to mlx-lm's
  ``qwen3_5`` / ``qwen3_5_moe``: llama.cpp's changes to the Gated DeltaNet layers undone,
  A_log from its −exp(A_log), the conv unsqueezed, the value heads it tiles grouped again;
  the full-attention period from its flags or interval; partial RoPE, as its MRoPE is on
  text; a shared expert; the multi-token prediction block dropped),
  ``gemma4`` (to mlx-lm's ``gemma4_text``: Gemma 4 31B, 26B A4B and E2B/E4B;
  sliding layers by a flag each, head sizes and key/value heads by kind of layer, values from
  the keys where a global layer has no ``attn_v``, the global layers' partial RoPE from
  ``rope_freqs`` as mlx-lm's proportional RoPE, the experts' fused gate/up stacks split,
  shared keys, double-wide MLPs and per-layer inputs; its "gemma4" BPE vocabulary), and every
  tensor type that
  package dequantizes. Q4_0/Q4_1/Q8_0 matrices map exactly onto MLX affine quantization (group
  size 32), MXFP4 ones (gpt-oss's experts) onto MLX's ``mxfp4``, and stay quantized unless a
  dtype is given (the experts' stacks too); the other types
  are dequantized (to float32 on Linux, float16 elsewhere, unless a dtype is given), and
  requantized as ``mlx_lm.convert -q`` would when bits are asked for. Tensors are converted
  one at a time and written in shards as they go. llama, smollm3 and granite q/k rows are
  un-permuted from llama.cpp's RoPE layout to the Hugging Face one; ``tokenizer.json`` /
  ``tokenizer_config.json`` are rebuilt from the GGUF metadata (:mod:`mlx_lazy.gguf_tokenizer`).

Every failure on bad input is a :class:`UserInputError` with a one-line message. The output
folder is written to a temporary sibling and renamed at the end; an error or a SIGTERM
removes the temporary folder and any parent folder the run created.
"""

from __future__ import annotations

from . import _blas  # noqa: F401  (must precede any mlx import)

import contextlib
import importlib
import io
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import mlx.core as mx
import numpy as np

from .errors import UserInputError, one_line, shown
from .folders import atomic_dir
from .gguf_tokenizer import build_tokenizer, eos_ids

GGUF_GROUP_SIZE = 32
DTYPES = ("float32", "float16", "bfloat16")
#: The group sizes MLX quantizes with.
Q_GROUP_SIZES = (32, 64, 128)
# Float dtype of dequantized GGUF tensors when none is given: float16 and quantized matmuls
# bypass BLAS on the Linux CPU.
DEFAULT_GGUF_DTYPE = "float32" if sys.platform == "linux" else "float16"
#: A GGUF conversion writes its weights in files of about this size, converting one tensor at
#: a time: the most converted weights it holds in memory at once.
SHARD_BYTES = 2 << 30
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                 "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "gpt-oss": "GptOssForCausalLM",
                 "smollm3": "SmolLM3ForCausalLM",
                 "granite": "GraniteForCausalLM",
                 "olmo2": "Olmo2ForCausalLM",
                 "exaone4": "Exaone4ForCausalLM",
                 "qwen35": "Qwen3_5ForCausalLM",
                 "qwen35moe": "Qwen3_5MoeForCausalLM",
                 "gemma4": "Gemma4ForCausalLM"}
# mlx-lm's model type of each GGUF architecture (the same name unless listed)
_MODEL_TYPES = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe",
                "gpt-oss": "gpt_oss",
                "qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe",
                "gemma4": "gemma4_text"}
# Gemma 3: llama.cpp's hard-wired sliding-window pattern (5 local layers, then a global one)
# and local RoPE base, unless the GGUF says otherwise
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
# Gemma 4: llama.cpp's defaults for its local RoPE base (Gemma 3's) and logit soft-cap, and the
# divisor its converter gives the RoPE frequencies a global layer leaves unrotated (1e30: none
# below this is taken for one)
GEMMA4_LOCAL_ROPE_BASE = GEMMA3_LOCAL_ROPE_BASE
GEMMA4_LOGIT_SOFTCAP = 30.0
GEMMA4_UNROTATED = 1e29
# gpt-oss: llama.cpp's sliding-window pattern (a local layer, then a global one) unless the GGUF
# says otherwise, and its YaRN betas (its gpt-oss loader reads no key for them)
GPT_OSS_SLIDING_PATTERN = 2
GPT_OSS_YARN_BETAS = {"beta_fast": 32.0, "beta_slow": 1.0}
# llama.cpp's converter permutes q/k rows (and biases) for its LlamaModel family, whose graphs
# also take optional attention and MLP biases
_LLAMA_FAMILY = ("llama", "smollm3", "granite")
# SmolLM3: llama.cpp hard-wires RoPE off in every 4th layer (no GGUF key holds it)
SMOLLM3_NO_ROPE_INTERVAL = 4
# EXAONE 4.0 32B (64 layers): llama.cpp's hard-wired window and pattern period (3 local layers,
# then a global one without RoPE), unless the GGUF says otherwise
EXAONE4_32B_LAYERS = 64
EXAONE4_32B_WINDOW = 4096
EXAONE4_32B_PERIOD = 4
# Qwen3.5/3.6 (Gated DeltaNet linear attention, every n-th layer full attention): llama.cpp's
# architectures, its default period, and what mlx-lm's qwen3_5 names its parameters under
_QWEN35 = ("qwen35", "qwen35moe")
QWEN35_FULL_ATTENTION_INTERVAL = 4
_QWEN35_PREFIX = "language_model."

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Qwen3-MoE: the router and the experts' weights, one (experts, out, in) stack each
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
# Gemma 3's four norms per layer: llama.cpp's ``ffn_norm`` is the norm before the MLP there
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3: q, k, v rows in one tensor and the MLP's gate then up rows in another, fused as in
# mlx-lm's phi3 (llama.cpp's converter writes Hugging Face's tensors unpermuted: NeoX RoPE)
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj",
                     "ffn_up": "mlp.gate_up_proj"}
# gpt-oss: the norm before the MoE is llama.cpp's post_attention_norm; the router and the
# experts' stacks (with biases) under mlx-lm's names; the attention sinks are a parameter of
# their own (a "role.suffix" key names a whole parameter)
_GPT_OSS_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if k != "ffn_norm"},
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# OLMo 2, EXAONE 4: a norm on each branch's output and none before it
_POST_NORM_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if k not in ("attn_norm", "ffn_norm")},
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Qwen3.5/3.6: the norm before the MLP is llama.cpp's post_attention_norm; the linear-attention
# layers' projections (attn_qkv: q, k, v rows; attn_gate: z), its conv, dt bias (a parameter of
# its own) and gated norm; the MoE's shared expert and its gate
_QWEN35_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if k != "ffn_norm"},
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_out": "linear_attn.out_proj",
    "ssm_norm": "linear_attn.norm",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Gemma 4: Gemma 3's norms (stored as w, not 1 + w), and its MoE layers' dense MLP beside the
# experts, each with norms of its own, the router's weight, input scale and per-expert output
# scales (llama.cpp's ffn_down_exps.scale), the experts' gate and up halves (ffn_gate_up_exps
# is split into them: _gemma4_tensors); a scalar per layer; E2B/E4B's per-layer input gates
_GEMMA4_LAYER_NAMES = {
    **_GEMMA3_LAYER_NAMES,
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
    "ffn_gate_inp": "router.proj",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_exps": "experts.switch_glu.gate_proj",
    "ffn_up_exps": "experts.switch_glu.up_proj",
    "ffn_down_exps": "experts.switch_glu.down_proj",
    "layer_output_scale.weight": "layer_scalar",
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
}
_ARCH_LAYER_NAMES = {"gemma3": _GEMMA3_LAYER_NAMES, "phi3": _PHI3_LAYER_NAMES,
                     "gemma4": _GEMMA4_LAYER_NAMES,
                     "olmo2": _POST_NORM_LAYER_NAMES,
                     "exaone4": _POST_NORM_LAYER_NAMES, "gpt-oss": _GPT_OSS_LAYER_NAMES,
                     # by mlx-lm's model type: the names in its text model
                     "qwen3_5": _QWEN35_LAYER_NAMES}
# Phi-3's LongRoPE: llama.cpp's tensors of its factors beyond and within the original context
_LONGROPE = {"long_factor": "rope_factors_long.weight",
             "short_factor": "rope_factors_short.weight"}
# RoPE scaling held as tensors (config, not weights), and the architectures llama.cpp reads
# each for (Llama 3.1/3.2's and EXAONE 4's divisors, Phi-3's factors)
_ROPE_TENSORS = {"rope_freqs.weight": ("llama", "exaone4",
                                        "gemma4"),  # Gemma 4: its global layers' partial RoPE
                 **dict.fromkeys(_LONGROPE.values(), ("phi3",))}
#: How far a GGUF's ``rope.scaling.attn_factor`` may be from mlx-lm's RoPE scale, relatively:
#: llama.cpp writes it in float32 (rounding ~6e-8), other formulas miss by percents.
ATTN_FACTOR_RTOL = 1e-6
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head",
              # Gemma 4 E2B/E4B: the per-layer inputs' embedding, projection and its norm
              "per_layer_token_embd": "model.embed_tokens_per_layer",
              "per_layer_model_proj": "model.per_layer_model_projection",
              "per_layer_proj_norm": "model.per_layer_projection_norm"}


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
        q_bits: quantize linear/embedding weights to 4 or 8 bits (affine, mlx-lm's layers).
        q_group_size: quantization group size, one of :data:`Q_GROUP_SIZES` (mlx-lm's
            default 64 when None).
        dtype: float dtype of unquantized weights ("float32", "float16", "bfloat16"). For a
            GGUF source, a dtype dequantizes every tensor to it; without dtype and q_bits,
            Q4_0/Q4_1/Q8_0 tensors stay quantized and the others become
            ``DEFAULT_GGUF_DTYPE``.
        dequantize: dequantize an already quantized model.

    Returns:
        The output folder.

    Raises:
        UserInputError: bad input (missing source, not GGUF, unsupported architecture /
            tensor type / tokenizer, tensors that disagree with the metadata, existing or
            uncreatable output, bad option), with a one-line message.
    """
    out = Path(output)
    if out.exists() or out.is_symlink():  # a dangling link too: the final rename fails on it
        what = "folder" if out.is_dir() else "path"
        raise UserInputError(f"output {what} {out} already exists; remove it or choose another")
    if q_bits is not None and q_bits not in (4, 8):
        raise UserInputError(f"--q-bits must be 4 or 8, not {q_bits}")
    if dtype is not None and dtype not in DTYPES:
        raise UserInputError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if q_group_size is not None and q_bits is None:
        raise UserInputError("--q-group-size needs --q-bits")
    if dequantize and q_bits is not None:  # as mlx-lm's convert: one or the other
        raise UserInputError("--dequantize and --q-bits ask for opposite things; give one "
                             "(--q-bits requantizes a GGUF by itself; a quantized folder: "
                             "dequantize it, then quantize the float copy)")
    if q_group_size is not None and q_group_size not in Q_GROUP_SIZES:
        # Another size quantizes no layer (mlx-lm skips a layer whose width it does not
        # divide) while the config still says quantized, or fails deep inside MLX.
        raise UserInputError(f"--q-group-size must be one of "
                             f"{', '.join(map(str, Q_GROUP_SIZES))}, not {q_group_size}")
    src = Path(source)
    if src.exists() and not src.is_dir() and not src.is_file():  # /dev/zero, a FIFO: not read
        raise UserInputError(f"{src} is not a GGUF file (not a regular file)")
    if src.is_file():
        with open(src, "rb") as f:
            if f.read(4) != b"GGUF":
                raise UserInputError(f"{src} is not a GGUF file (and not a model folder)")
        if dequantize and dtype is None:
            dtype = "float32"
        with atomic_dir(out) as tmp:
            convert_gguf(src, tmp, dtype=dtype, q_bits=q_bits, q_group_size=q_group_size)
        return out
    if src.is_dir():
        if not (src / "config.json").is_file():
            raise UserInputError(f"{src} is a folder without config.json (not a HF/MLX model)")
        try:
            quantized = json.loads((src / "config.json").read_text()).get("quantization")
        except (OSError, ValueError, AttributeError):  # reported where mlx-lm reads it
            quantized = None
        if q_bits is not None and isinstance(quantized, dict):  # mlx-lm kept the old bits
            raise UserInputError(
                f"{src} is quantized already ({quantized.get('bits')}-bit, groups of "
                f"{quantized.get('group_size')}); --q-bits would leave it so: convert the "
                "float model instead")
    elif not is_hub_id(str(source)):
        raise UserInputError(f"no such file or folder: {source}")
    with atomic_dir(out) as tmp:
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
    shard_bytes: int = SHARD_BYTES,
) -> None:
    """Write an MLX folder for a GGUF model into the existing folder ``out_dir``.

    Prefer :func:`convert`, which checks its arguments and writes atomically. ``dtype=None``
    keeps Q4_0/Q4_1/Q8_0 tensors quantized (affine, group size 32, mixed bits recorded per
    layer in the config); a dtype dequantizes everything to it. ``q_bits`` requantizes
    (``dtype``, float16 by default, then mlx-lm's choice of layers and its affine
    quantization: what ``mlx_lm.convert -q`` writes from the dequantized model).

    Tensors are converted one at a time and written in shards of about ``shard_bytes``
    (mlx-lm's file names and index), so the memory a conversion needs is one shard and one
    dequantized tensor, not the model.
    """
    gguf, out_dir = Path(gguf), Path(out_dir)
    held = sorted(p.name for p in out_dir.glob("model*.safetensors*"))
    if held:  # mlx-lm would load them beside the new ones
        raise UserInputError(f"{out_dir} holds weights already ({held[0]}); convert into an "
                             "empty folder")
    reader = read_gguf(gguf)
    meta = {k: f.contents() for k, f in reader.fields.items()}
    tensors = {t.name: t for t in reader.tensors}
    _check_types(tensors)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UserInputError(f"unsupported GGUF architecture {arch!r} "
                             f"(supported: {', '.join(map(repr, ARCHITECTURES))})")
    if arch in _QWEN35:
        tensors = _qwen35_trunk(arch, meta, tensors)
    config = _config(arch, meta, tensors)
    for name in _ROPE_TENSORS:  # in the config now, not weights
        tensors.pop(name, None)
    if arch == "gemma4":
        tensors = _gemma4_tensors(tensors, config)
    tokenizer, tokenizer_config = build_tokenizer(arch, meta)
    config["eos_token_id"] = eos_ids(meta)
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))  # lazy: nothing is computed
    _check_shapes(model, tensors, arch)

    if q_bits is not None:
        dtype = dtype or "float16"
        requantize, quant = _requantized_modules(model, q_bits, q_group_size)
    else:
        requantize, quant = {}, _kept_quantization(arch, tensors, dtype, config)
    with _Shards(out_dir, shard_bytes) as shards:
        for name, x in _gguf_arrays(arch, tensors, config, dtype, requantize):
            shards.add(name, x)
    if arch == "gemma3":  # read by mlx-lazy's own code only (mlx-lm ignores it)
        config["tie_word_embeddings"] = "output.weight" not in tensors
    if quant:
        config["quantization"] = config["quantization_config"] = quant
    config["torch_dtype"] = dtype or DEFAULT_GGUF_DTYPE
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))


def read_gguf(path: str | os.PathLike) -> Any:
    """Open ``path`` with ``gguf.GGUFReader`` (memory-mapped).

    Raises:
        UserInputError: the file is not GGUF, is truncated or malformed.
    """
    from gguf import GGUFReader

    class Reader(GGUFReader):
        """The reader over a plain array view of its memory map: the same mapped bytes, but
        each of the million small views it parses a 128K-token vocabulary with no longer pays
        for ``np.memmap``'s subclass hooks (Llama 3's vocabulary opened in 9.7 s, now 2.7)."""

        @property
        def data(self) -> np.ndarray:
            return self._mapped

        @data.setter
        def data(self, mapped: np.memmap) -> None:
            self._mapped = mapped.view(np.ndarray)

    try:
        return Reader(path)
    except Exception as e:  # the reader fails with ValueError/IndexError/... on bad files
        raise UserInputError(f"{path} is not a valid GGUF file ({one_line(e)})") from None


# --------------------------------------------------------------------------- helpers


def _convert_hf(source: str, out_dir: Path | str, *, q_bits: int | None,
                q_group_size: int | None, dtype: str | None, dequantize: bool) -> None:
    from mlx_lm.convert import convert as mlx_lm_convert

    target = Path(out_dir) / "model"  # mlx_lm refuses existing folders
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # keep our CLI's output to one line
            mlx_lm_convert(str(source), str(target), quantize=q_bits is not None,
                           q_bits=q_bits, q_group_size=q_group_size, dtype=dtype,
                           dequantize=dequantize)
    except Exception as e:  # hub errors, missing weights, unknown model types
        raise UserInputError(f"cannot convert {source}: {type(e).__name__}: {one_line(e)}") \
            from None
    for item in target.iterdir():
        os.rename(item, Path(out_dir) / item.name)
    target.rmdir()


#: The largest count a GGUF's metadata may give (heads, widths, context): far above any
#: model's, far below what would make the shape check allocate without bound.
_MAX_COUNT = 2**24


def _config(arch: str, meta: dict, tensors: dict) -> dict:
    def g(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    def count(key: str, default: Any = None, *, value: Any = None) -> int:
        value = g(key, default) if value is None else value
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
                or not 1 <= value <= _MAX_COUNT:
            raise UserInputError(f"GGUF metadata {arch}.{key} must be an integer in "
                                 f"[1, {_MAX_COUNT}], got {shown(value, 40)}")
        return int(value)

    def positive(key: str, default: float | None = None) -> float:
        value = g(key, default)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)) \
                or not np.isfinite(value) or value <= 0:
            raise UserInputError(f"GGUF metadata {arch}.{key} must be a positive number, got "
                                 f"{shown(value, 40)}")
        return float(value)

    def experts() -> tuple[int, int]:
        """The number of experts and of those each token uses."""
        total, used = count("expert_count"), count("expert_used_count")
        if used > total:
            raise UserInputError(f"GGUF metadata {arch}.expert_used_count ({used}) exceeds "
                                 f"{arch}.expert_count ({total})")
        return total, used

    required = ("attention.head_count", "embedding_length", "block_count",
                "feed_forward_length")
    if arch == "qwen35moe":  # llama.cpp's converter writes none: every layer is sparse
        required = required[:-1]
    if any(g(k) is None for k in required):
        raise UserInputError(f"GGUF metadata lacks {arch}.{' / '.join(required)}")
    gemma4 = arch == "gemma4"  # key/value heads and MLP widths by layer: _gemma4_config's
    if isinstance(g("attention.head_count"), list) or \
            (isinstance(g("attention.head_count_kv"), list) and not gemma4):
        raise UserInputError("GGUF with per-layer head counts is not supported")
    n_heads, hidden, n_layers = (count("attention.head_count"), count("embedding_length"),
                                 count("block_count"))
    if arch in _QWEN35:  # the multi-token prediction blocks after the model's own
        n_layers -= _qwen35_nextn(arch, meta)
    n_kv = 1 if gemma4 else count("attention.head_count_kv", n_heads)
    if not tensors:  # llama.cpp's ggml-vocab-*.gguf files, say
        raise UserInputError("GGUF holds no tensors: a vocabulary-only file, no weights to "
                             "convert")
    blocks = {name.split(".")[1] for name in tensors if name.startswith("blk.")}
    if n_layers != len(blocks):  # before a model of n_layers is built to compare shapes
        raise UserInputError(f"GGUF metadata {arch}.block_count is {n_layers}, its tensors "
                             f"hold {len(blocks)} blocks")
    if "token_embd.weight" not in tensors:
        raise UserInputError("GGUF has no token_embd.weight tensor")
    head_dim = (count("attention.key_length") if g("attention.key_length") is not None
                else hidden // n_heads)
    rope_dims = count("rope.dimension_count", head_dim)
    # mlx-lm's phi3 rotates the first int(head_dim · partial_rotary_factor) dims of each head
    # (Phi-4-mini: 96 of 128); the other families' models rotate all of them
    if rope_dims != head_dim and (arch not in ("phi3", *_QWEN35) or rope_dims > head_dim
                                  or rope_dims % 2
                                  or int(head_dim * (rope_dims / head_dim)) != rope_dims):
        raise UserInputError(f"GGUF {arch} with RoPE over {rope_dims} of each head's {head_dim} "
                             "dims is not supported")
    vocab = int(tensors["token_embd.weight"].shape[1])
    if len(meta.get("tokenizer.ggml.tokens") or []) > vocab:
        raise UserInputError(f"GGUF tokenizer has more tokens than the embedding's {vocab} rows")
    # llama.cpp's RoPE scaling is linear unless the GGUF names another, its factor under
    # today's key or the old one
    factor = g("rope.scaling.factor", g("rope.scale_linear"))
    scaling = g("rope.scaling.type") or ("linear" if factor not in (None, 0, 1) else None)
    linear = arch == "gemma3" and scaling == "linear"  # Gemma 3 4B+: global layers only
    yarn = arch == "gpt-oss" and scaling == "yarn"
    if scaling not in (None, "none") and not (linear or yarn):
        raise UserInputError(f"GGUF with RoPE scaling ({scaling}) is not supported")
    for name, owners in _ROPE_TENSORS.items():
        if name in tensors and arch not in owners:
            raise UserInputError(f"GGUF {arch} with RoPE scaling ({name.removesuffix('.weight')}) "
                                 "is not supported")
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": _MODEL_TYPES.get(arch, arch),
        "hidden_size": hidden,
        "intermediate_size": 1 if gemma4 else count("feed_forward_length", hidden),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": positive("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": positive("rope.freq_base", 10000.0),
        "max_position_embeddings": count("context_length", 4096),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
    }
    if arch in _LLAMA_FAMILY:
        config.update(attention_bias="blk.0.attn_q.bias" in tensors,
                      mlp_bias="blk.0.ffn_gate.bias" in tensors)
    if arch == "smollm3":
        config["no_rope_layer_interval"] = SMOLLM3_NO_ROPE_INTERVAL
    if arch == "granite":
        if not g("rope.scaling.finetuned", True):  # llama.cpp's switch for RoPE
            raise UserInputError("GGUF granite without RoPE (rope.scaling.finetuned false) is "
                                 "not supported")
        if g("logit_scale") is None:  # llama.cpp refuses the GGUF too
            raise UserInputError("GGUF metadata lacks granite.logit_scale")
        # the others as llama.cpp defaults them: no scaling, queries by 1/sqrt(head_dim)
        config.update(embedding_multiplier=positive("embedding_scale", 1.0),
                      residual_multiplier=positive("residual_scale", 1.0),
                      attention_multiplier=positive("attention.scale", head_dim ** -0.5),
                      logits_scaling=positive("logit_scale"))
    if arch == "olmo2" and g("attention.sliding_window"):  # llama.cpp: a window is OLMo 3's
        raise UserInputError("GGUF olmo2 with a sliding window (OLMo 3) is not supported")
    if arch == "exaone4":  # llama.cpp's 32B defaults where the GGUF gives no window or pattern
        big = n_layers == EXAONE4_32B_LAYERS
        flags = g("attention.sliding_window_pattern", EXAONE4_32B_PERIOD if big else None)
        # without a window (or a local layer) every layer is global, with RoPE
        pattern = (_sliding_pattern(flags, n_layers, arch)
                   if flags is not None and (big or g("attention.sliding_window")) else None)
        window = count("attention.sliding_window", EXAONE4_32B_WINDOW) if pattern else None
        letters = (pattern or "G") * n_layers  # a letter per layer, and more
        # layer_types for transformers' config, which loading the tokenizer reads
        config.update(rope_scaling=None, sliding_window=window, sliding_window_pattern=pattern,
                      layer_types=["sliding_attention" if c == "L" else "full_attention"
                                   for c in letters[:n_layers]])
    if arch == "qwen3moe":  # every layer sparse, the top experts' weights renormalised
        n_experts, n_used = experts()
        config.update(num_experts=n_experts, num_experts_per_tok=n_used,
                      moe_intermediate_size=count("expert_feed_forward_length"),
                      decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    if arch in _QWEN35:
        config.update(_qwen35_config(arch, g, count, experts, n_layers, head_dim, rope_dims,
                                     config["rope_theta"]))
    if arch == "gpt-oss":  # every layer sparse; its SwiGLU's alpha and limit are hard-wired in
        # llama.cpp (1.702, 7) as in mlx-lm
        n_experts, n_used = experts()
        config.update(num_local_experts=n_experts, num_experts_per_tok=n_used,
                      intermediate_size=count("expert_feed_forward_length"),
                      **_gpt_oss_windows(g, count, n_layers))
        if g("rope.freq_base_swa", config["rope_theta"]) != config["rope_theta"]:
            raise UserInputError("GGUF gpt-oss with another RoPE base in its sliding-window "
                                 "layers is not supported")
        if yarn:  # every layer's RoPE, as in llama.cpp
            config["rope_scaling"] = {
                "rope_type": "yarn", "factor": positive("rope.scaling.factor", 1.0),
                # llama.cpp's default: the context length
                "original_max_position_embeddings": count(
                    "rope.scaling.original_context_length", config["max_position_embeddings"]),
                **GPT_OSS_YARN_BETAS}
    if arch == "gemma3":
        window = g("attention.sliding_window")
        if window is None:
            raise UserInputError("GGUF metadata lacks gemma3.attention.sliding_window")
        # llama.cpp scales queries by 1/sqrt(head_dim), by 1/sqrt(hidden/heads) for the 27B
        scalar = hidden // n_heads if n_layers == 62 else head_dim
        config.update(
            hidden_act="gelu_pytorch_tanh", sliding_window=int(window),
            sliding_window_pattern=GEMMA3_SLIDING_PATTERN, query_pre_attn_scalar=scalar,
            rope_local_base_freq=float(g("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)))
        if linear:
            config["rope_scaling"] = {"rope_type": "linear", "factor": float(factor or 1.0)}
    if gemma4:
        config.update(_gemma4_config(g, count, positive, experts, tensors, config))
    if arch == "phi3":  # its sliding window is ignored: llama.cpp disables it, mlx-lm has none
        # without it llama.cpp takes the context as the original one: no LongRoPE scale
        config["original_max_position_embeddings"] = count(
            "rope.scaling.original_context_length", config["max_position_embeddings"])
        if rope_dims != head_dim:
            config["partial_rotary_factor"] = rope_dims / head_dim
        if any(name in tensors for name in _LONGROPE.values()):
            config["rope_scaling"] = _longrope_scaling(tensors, rope_dims)
    if "rope_freqs.weight" in tensors and not gemma4:  # Llama 3.1 / 3.2: the scaling
        config["rope_scaling"] = _llama3_rope_scaling(
            _rope_factors("rope_freqs.weight", tensors, head_dim), config["rope_theta"],
            head_dim)
    # llama.cpp multiplies the rotated dims of queries and keys by attn_factor (and under YaRN
    # by its own magnitude); mlx-lm by its own scale (LongRoPE's, from the contexts' ratio;
    # YaRN's mscale), 1 in the other families
    attn_factor, scale = positive("rope.scaling.attn_factor", 1.0), _rope_scale(config, rope_dims)
    magnitude = _llama_cpp_yarn_magnitude(config)
    if not math.isclose(attn_factor * magnitude, scale, rel_tol=ATTN_FACTOR_RTOL):
        times = f" (times YaRN's {magnitude:.7g})" if magnitude != 1 else ""
        raise UserInputError(f"GGUF metadata {arch}.rope.scaling.attn_factor is "
                             f"{attn_factor:.7g}{times}, mlx-lm's {config['model_type']} scales "
                             f"by {scale:.7g}")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        config["bos_token_id"] = int(bos)
    return config


def _qwen35_nextn(arch: str, meta: dict) -> int:
    """How many of a Qwen3.5 GGUF's blocks are multi-token prediction blocks, after the model's
    own (``nextn_predict_layers``; llama.cpp's converter appends them unless told not to)."""
    key = f"{arch}.nextn_predict_layers"
    n, blocks = meta.get(key, 0), meta.get(f"{arch}.block_count")
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 0 or \
            (isinstance(blocks, (int, np.integer)) and n >= blocks):
        raise UserInputError(f"GGUF metadata {key} must be an integer in [0, "
                             f"{arch}.block_count), got {shown(n, 40)}")
    return int(n)


def _qwen35_trunk(arch: str, meta: dict, tensors: dict) -> dict:
    """A Qwen3.5 GGUF's tensors without its multi-token prediction blocks (mlx-lm's qwen3_5
    has none: it drops them from Hugging Face checkpoints too), refusing the layouts of
    llama.cpp's optional fusions."""
    blocks = meta.get(f"{arch}.block_count")
    trunk = blocks - _qwen35_nextn(arch, meta) if isinstance(blocks, (int, np.integer)) else None
    kept = {name: t for name, t in tensors.items() if trunk is None or
            not (name.startswith("blk.") and name.split(".")[1].isdigit()
                 and int(name.split(".")[1]) >= trunk)}
    for name in kept:
        if ".ffn_gate_up_exps." in name:
            raise UserInputError(f"GGUF {arch} with fused gate/up experts ({name}; llama.cpp's "
                                 "--fuse-gate-up-exps) is not supported")
        if name.endswith(".attn_qkv.weight") and \
                name.replace(".attn_qkv.", ".attn_q.") in kept:  # a full-attention layer
            raise UserInputError(f"GGUF {arch} with fused q/k/v attention ({name}; llama.cpp's "
                                 "--fuse-qkv) is not supported")
    return kept


def _qwen35_config(arch: str, g: Any, count: Any, experts: Any, n_layers: int, head_dim: int,
                   rope_dims: int, theta: float) -> dict:
    """mlx-lm's qwen3_5 / qwen3_5_moe config of a Qwen3.5/3.6 GGUF: its linear-attention (Gated
    DeltaNet) heads from llama.cpp's ssm keys, which layers attend fully, the partial RoPE
    (llama.cpp's interleaved MRoPE: on text every section turns by the same position, plain
    RoPE over the rotated dims), and the MoE's experts and shared expert."""
    n_v, n_k = count("ssm.time_step_rank"), count("ssm.group_count")
    inner = count("ssm.inner_size")
    if n_v % n_k or inner % n_v:
        raise UserInputError(f"GGUF metadata {arch}.ssm.time_step_rank ({n_v}) must be a "
                             f"multiple of {arch}.ssm.group_count ({n_k}), and "
                             f"{arch}.ssm.inner_size ({inner}) of it")
    if count("attention.value_length", head_dim) != head_dim:
        raise UserInputError(f"GGUF {arch} with values {g('attention.value_length')} wide and "
                             f"keys {head_dim} wide is not supported")
    # (its MRoPE sections left out: on text they turn by one position, and transformers warns
    # of them beside a "default" RoPE)
    rope = {"rope_type": "default", "rope_theta": theta,
            "partial_rotary_factor": rope_dims / head_dim}
    config = {"linear_num_value_heads": n_v, "linear_num_key_heads": n_k,
              "linear_key_head_dim": count("ssm.state_size"),
              "linear_value_head_dim": inner // n_v,
              "linear_conv_kernel_dim": count("ssm.conv_kernel"),
              "full_attention_interval": _qwen35_interval(arch, g, count, n_layers),
              "attention_bias": False, "rope_parameters": rope,
              "partial_rotary_factor": rope_dims / head_dim}
    if arch == "qwen35moe":  # every layer sparse beside a gated shared expert; llama.cpp
        # renormalises the top experts' weights (hard-wired)
        n_experts, n_used = experts()
        shared = count("expert_shared_feed_forward_length", g("feed_forward_length"))
        config.update(num_experts=n_experts, num_experts_per_tok=n_used,
                      moe_intermediate_size=count("expert_feed_forward_length"),
                      shared_expert_intermediate_size=shared, norm_topk_prob=True,
                      decoder_sparse_step=1, intermediate_size=count("feed_forward_length", shared))
    return config


def _qwen35_interval(arch: str, g: Any, count: Any, n_layers: int) -> int:
    """The period n of Qwen3.5's full-attention layers (layer i attends fully when
    (i + 1) % n == 0), from llama.cpp's flag per layer (``attention.recurrent_layers``, which
    it prefers) or its interval (4 when the GGUF gives neither)."""
    flags = g("attention.recurrent_layers")
    if flags is None:
        interval = count("full_attention_interval", QWEN35_FULL_ATTENTION_INTERVAL)
        if interval > n_layers:
            raise UserInputError(f"GGUF {arch} without a full-attention layer (interval "
                                 f"{interval}, {n_layers} layers) is not supported")
        return interval
    key = f"GGUF metadata {arch}.attention.recurrent_layers"
    if not isinstance(flags, list) or len(flags) < n_layers:
        raise UserInputError(f"{key} must be a flag per layer, got {shown(flags, 40)}")
    linear = [bool(x) for x in flags[:n_layers]]
    interval = linear.index(False) + 1 if False in linear else None
    if interval is None or any(x != ((i + 1) % interval != 0) for i, x in enumerate(linear)):
        raise UserInputError(f"{key} are not mlx-lm's qwen3_5 pattern (every n-th layer "
                             f"full attention, the others linear): {shown(flags, 40)}")
    return interval


def _qwen35_role(gguf_name: str) -> str:
    """A Qwen3.5 GGUF tensor's role: ``blk.3.ssm_dt.bias`` -> ``ssm_dt``."""
    parts = gguf_name.split(".")
    return parts[2] if parts[0] == "blk" and len(parts) > 2 else parts[0]


#: The linear-attention tensors whose value heads llama.cpp's converter tiles (see
#: :func:`_untile_v_heads`): the axis, and whether only the rows past q and k move
_QWEN35_V_HEADS = {"attn_qkv": (0, True), "ssm_conv1d": (0, True), "attn_gate": (0, False),
                   "ssm_beta": (0, False), "ssm_alpha": (0, False), "ssm_a": (0, False),
                   "ssm_dt": (0, False), "ssm_out": (-1, False)}


def _untile_v_heads(x: np.ndarray, axis: int, n_k: int, n_v: int) -> np.ndarray:
    """Undo llama.cpp's tiling of Qwen3.5's value heads along ``axis``: value head h = r·n_k + k
    back to k·(n_v / n_k) + r, grouped under the key head k it reads, as mlx-lm's repeat of the
    keys has them (ggml's broadcast takes key head h % n_k). Each head's slice moves whole, so
    packed quantized weights and their scales move with it."""
    x = np.moveaxis(x, axis, 0)
    r, rest = n_v // n_k, x.shape[1:]
    x = x.reshape(r, n_k, -1, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.moveaxis(x, 0, axis)


def _qwen35_straddles(t: Any, config: dict | None) -> bool:
    """Whether the GGUF tensor ``t`` is a Qwen3.5 ``ssm_out`` whose value heads, tiled by
    llama.cpp, do not fill whole blocks of 32 columns: it cannot stay quantized."""
    return (config is not None and config["model_type"] in ("qwen3_5", "qwen3_5_moe")
            and _qwen35_role(t.name) == "ssm_out"
            and config["linear_num_key_heads"] != config["linear_num_value_heads"]
            and config["linear_value_head_dim"] % GGUF_GROUP_SIZE != 0)


def _qwen35_layout(gguf_name: str, x: np.ndarray, config: dict) -> np.ndarray:
    """A Qwen3.5 GGUF array (a tensor, or a quantized one's packed weights, scales or biases)
    in mlx-lm's qwen3_5 layout: value heads untiled; ``ssm_a`` (llama.cpp stores −exp(A_log))
    as A_log; the conv's (channels, kernel) as MLX's (channels, kernel, 1). Norms need nothing:
    llama.cpp and mlx-lm both store Qwen's 1 + w (its gated norm's w as it is)."""
    role = _qwen35_role(gguf_name)
    n_k, n_v = config["linear_num_key_heads"], config["linear_num_value_heads"]
    if role in _QWEN35_V_HEADS and n_k != n_v:
        axis, past_qk = _QWEN35_V_HEADS[role]
        if past_qk:  # the rows of q and k, then those of v
            qk = 2 * config["linear_num_key_heads"] * config["linear_key_head_dim"]
            x = np.concatenate([x[:qk], _untile_v_heads(x[qk:], axis, n_k, n_v)])
        else:
            x = _untile_v_heads(x, axis, n_k, n_v)
    if role == "ssm_a":
        a = x.astype(np.float64)
        if not np.all(np.isfinite(a) & (a < 0)):
            bad = a[~(np.isfinite(a) & (a < 0))][0]
            raise UserInputError(f"GGUF {gguf_name} must hold negative numbers (llama.cpp "
                                 f"stores -exp(A_log)), got {bad}")
        x = np.log(-a).astype(np.float32)
    if role == "ssm_conv1d":
        x = x[..., None]
    return x


def _local_layers(pattern: Any, n_layers: int, arch: str) -> list[bool]:
    """Which layers slide, by a GGUF's sliding-window pattern: a flag per layer, or llama.cpp's
    period n (n - 1 local layers, then a global one; 0: every layer local)."""
    key = f"GGUF metadata {arch}.attention.sliding_window_pattern"
    if isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise UserInputError(f"{key} has {len(pattern)} flags for {n_layers} layers")
        return [bool(x) for x in pattern]
    if isinstance(pattern, (int, np.integer)) and not isinstance(pattern, (bool, np.bool_)) \
            and 0 <= pattern <= _MAX_COUNT:
        return [pattern == 0 or i % pattern < pattern - 1 for i in range(n_layers)]
    raise UserInputError(f"{key} must be a flag per layer or a period, got "
                         f"{shown(pattern, 40)}")


def _sliding_pattern(pattern: Any, n_layers: int, arch: str) -> str | None:
    """A GGUF's sliding-window pattern (:func:`_local_layers`) as mlx-lm's string of L (local)
    and G (global) repeated over the layers, the shortest; None when no layer is local."""
    local = _local_layers(pattern, n_layers, arch)
    if not any(local):
        return None
    if all(local):
        raise UserInputError(f"GGUF {arch} with a sliding window in every layer is not "
                             f"supported (mlx-lm's {arch} needs a global layer)")
    size = next(n for n in range(1, n_layers + 1)
                if all(x == local[i % n] for i, x in enumerate(local)))
    return "".join("L" if x else "G" for x in local[:size])


def _number(x: float) -> int | float:
    """``x`` to 6 significant digits, an int when whole: 8192, not 8191.999999999998."""
    x = float(f"{x:.6g}")
    return int(x) if x.is_integer() else x


def _rope_factors(name: str, tensors: dict, dims: int) -> np.ndarray:
    """The GGUF tensor ``name``, which must hold a positive number per RoPE frequency of
    ``dims`` dims."""
    x, what = _dequantized(tensors[name]), name.removesuffix(".weight")
    if x.shape != (dims // 2,):
        raise UserInputError(f"GGUF {what} must hold {dims // 2} numbers (one per RoPE "
                             f"frequency), got shape {x.shape}")
    if not np.all(np.isfinite(x)) or x.min() <= 0:
        bad = x[~(np.isfinite(x) & (x > 0))][0]
        raise UserInputError(f"GGUF {what} must be positive numbers, got {bad}")
    return x


def _longrope_scaling(tensors: dict, dims: int) -> dict:
    """Phi-3's LongRoPE ``rope_scaling`` from llama.cpp's ``rope_factors_long`` and
    ``rope_factors_short`` tensors: what each RoPE frequency's wavelength is multiplied by
    beyond the original context and within it. (llama.cpp picks by the context it runs with;
    mlx-lm's SuScaledRoPE takes the long factors at any length, as for the Hugging Face
    checkpoint.)"""
    missing = [name for name in _LONGROPE.values() if name not in tensors]
    if missing:
        raise UserInputError(f"GGUF phi3 lacks {missing[0]}: LongRoPE needs "
                             f"{' and '.join(_LONGROPE.values())}")
    # float32 as llama.cpp writes them; each as its shortest decimal, as the original config has it
    return {"type": "longrope", **{
        key: [float(str(v)) for v in _rope_factors(name, tensors, dims).astype(np.float32)]
        for key, name in _LONGROPE.items()}}


def _gpt_oss_windows(g: Any, count: Any, n_layers: int) -> dict:
    """gpt-oss's sliding window and its layers' kinds, by llama.cpp's pattern period
    (:func:`_local_layers`; mlx-lm's gpt_oss needs both kinds)."""
    period = count("attention.sliding_window_pattern", GPT_OSS_SLIDING_PATTERN)
    kinds = ["sliding_attention" if local else "full_attention"
             for local in _local_layers(period, n_layers, "gpt-oss")]
    missing = {"sliding_attention", "full_attention"} - set(kinds)
    if missing:
        raise UserInputError(f"GGUF gpt-oss without a {missing.pop().replace('_', ' ')} layer "
                             f"(sliding window pattern {period}, {n_layers} layers) is not "
                             "supported")
    return {"sliding_window": count("attention.sliding_window"), "layer_types": kinds}


def _gemma4_config(g: Any, count: Any, positive: Any, experts: Any, tensors: dict,
                   config: dict) -> dict:
    """mlx-lm's gemma4_text settings of a Gemma 4 GGUF, read as llama.cpp reads it.

    Sliding layers by a flag each; their heads ``key_length_swa`` wide, the global layers'
    ``key_length``; RoPE over all of a sliding head at ``rope.freq_base_swa``, and over the
    first frequencies of a global head at ``rope.freq_base`` (the ``rope_freqs`` tensor: mlx-lm's
    proportional RoPE); key/value heads per layer (one count per kind); values from the keys'
    projection where a global layer has no ``attn_v``; the last ``shared_kv_layers`` layers
    reading the keys and values of the last layers of their kind below them, their MLPs twice
    as wide where ``feed_forward_length`` says so (E2B/E4B); per-layer inputs; an MoE beside
    the MLP in every layer (26B A4B). Any other layout is a :class:`UserInputError`.
    """
    n_layers, head_dim = config["num_hidden_layers"], config["head_dim"]

    def per_layer(key: str, default: Any = None) -> list[int]:
        """A count for each layer: one for all, or llama.cpp's array of them."""
        value = g(key, default)
        if not isinstance(value, list):
            return [count(key, default)] * n_layers
        if len(value) != n_layers:
            raise UserInputError(f"GGUF metadata gemma4.{key} has {len(value)} values for "
                                 f"{n_layers} layers")
        return [count(key, value=v) for v in value]

    def optional(key: str) -> int:
        """A count llama.cpp takes as 0 when the GGUF has none."""
        return 0 if g(key, 0) == 0 else count(key)

    flags = g("attention.sliding_window_pattern")
    if not isinstance(flags, list) or len(flags) != n_layers:
        raise UserInputError("GGUF metadata gemma4.attention.sliding_window_pattern must be a "
                             f"flag per layer ({n_layers}), got {shown(flags, 40)}")
    local = [bool(x) for x in flags]
    swa_dim = count("attention.key_length_swa")
    for key, dim in (("attention.value_length", head_dim), ("attention.value_length_swa", swa_dim)):
        if count(key, dim) != dim:  # llama.cpp refuses it too
            raise UserInputError(f"GGUF gemma4 whose {key} differs from its key length is not "
                                 "supported")
    rot_swa = count("rope.dimension_count_swa", head_dim)  # llama.cpp: the global layers'
    if rot_swa != swa_dim:
        raise UserInputError(f"GGUF gemma4 with RoPE over {rot_swa} of its sliding layers' "
                             f"{swa_dim} head dims is not supported")
    full_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    if not all(local):
        if "rope_freqs.weight" not in tensors:  # llama.cpp requires it too
            raise UserInputError("GGUF gemma4 lacks rope_freqs.weight (its global layers' "
                                 "partial RoPE)")
        full_rope.update(_gemma4_proportional_rope(tensors, head_dim))

    n_shared = optional("attention.shared_kv_layers")
    first_shared = n_layers - n_shared
    if n_shared and first_shared < 2:  # llama.cpp asserts as much
        raise UserInputError(f"GGUF metadata gemma4.attention.shared_kv_layers ({n_shared}) "
                             f"leaves fewer than 2 of {n_layers} layers their own keys")
    for i in range(first_shared, n_layers):  # llama.cpp's source layer, mlx-lm's
        source = first_shared - (2 if local[i] else 1)
        own = [j for j in range(first_shared) if local[j] == local[i]]
        if not own or own[-1] != source:
            raise UserInputError(f"GGUF gemma4 whose layer {i} reads the keys of layer {source} "
                                 "(llama.cpp's rule), not of the last layer of its kind below "
                                 "the shared ones (mlx-lm's), is not supported")
    kv = per_layer("attention.head_count_kv", config["num_attention_heads"])
    heads = {}
    for kind in (True, False):
        counts = {n for n, x in zip(kv, local) if x == kind}
        if len(counts) > 1:
            raise UserInputError(f"GGUF gemma4 with {'sliding' if kind else 'global'} layers of "
                                 f"{' and '.join(map(str, sorted(counts)))} key/value heads is "
                                 "not supported")
        heads[kind] = counts.pop() if counts else None
    global_kv = [i for i in range(first_shared) if not local[i]]
    without_v = [i for i in global_kv if f"blk.{i}.attn_v.weight" not in tensors]
    if without_v and without_v != global_kv:
        raise UserInputError(f"GGUF gemma4 with values from the keys' projection in global "
                             f"layer {without_v[0]} but not in layer "
                             f"{sorted(set(global_kv) - set(without_v))[0]} is not supported")
    k_eq_v = bool(without_v)
    n_kv = heads[True] if heads[True] is not None else heads[False]
    if heads[False] not in (None, n_kv) and not k_eq_v:
        raise UserInputError(f"GGUF gemma4 with {heads[False]} key/value heads in its global "
                             f"layers and {n_kv} in its sliding ones is not supported where "
                             "global layers project values of their own (mlx-lm's gemma4_text)")

    ff = per_layer("feed_forward_length")
    width = ff[0]
    double = n_shared > 0 and ff == [width] * first_shared + [2 * width] * n_shared
    if not double and ff != [width] * n_layers:
        raise UserInputError("GGUF gemma4 with MLP widths by layer other than E2B/E4B's (twice "
                             "as wide in the layers sharing keys) is not supported")

    moe = [f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(n_layers)]
    sparse: dict[str, Any] = {"enable_moe_block": all(moe)}
    if any(moe) and not all(moe):
        raise UserInputError(f"GGUF gemma4 with experts in {sum(moe)} of its {n_layers} layers "
                             "is not supported (mlx-lm's gemma4_text has them in all or none)")
    if all(moe):
        n_experts, n_used = experts()
        widths = set(per_layer("expert_feed_forward_length"))
        if len(widths) > 1:
            raise UserInputError("GGUF gemma4 with experts of different widths by layer is not "
                                 "supported")
        sparse.update(num_experts=n_experts, top_k_experts=n_used,
                      moe_intermediate_size=widths.pop())

    per_input = optional("embedding_length_per_layer_input")
    embd = tensors.get("per_layer_token_embd.weight")
    softcap = g("final_logit_softcapping", GEMMA4_LOGIT_SOFTCAP)
    return {
        "hidden_act": "gelu_pytorch_tanh", "head_dim": swa_dim, "global_head_dim": head_dim,
        "num_key_value_heads": n_kv,
        "num_global_key_value_heads": heads[False] if k_eq_v else None,
        "attention_k_eq_v": k_eq_v, "intermediate_size": width, "use_double_wide_mlp": double,
        "num_kv_shared_layers": n_shared, "hidden_size_per_layer_input": per_input,
        "vocab_size_per_layer_input": (int(embd.shape[1]) if embd is not None
                                       else config["vocab_size"]),
        "sliding_window": count("attention.sliding_window"),
        "layer_types": ["sliding_attention" if x else "full_attention" for x in local],
        "rope_parameters": {
            "full_attention": full_rope,
            "sliding_attention": {"rope_type": "default", "partial_rotary_factor": 1.0,
                                  "rope_theta": positive("rope.freq_base_swa",
                                                         GEMMA4_LOCAL_ROPE_BASE)}},
        # llama.cpp: 0 caps nothing
        "final_logit_softcapping": (positive("final_logit_softcapping", GEMMA4_LOGIT_SOFTCAP)
                                    if softcap else None),
        **sparse,
    }


def _gemma4_proportional_rope(tensors: dict, dims: int) -> dict:
    """Gemma 4's global layers' RoPE from llama.cpp's ``rope_freqs``: the divisor of each
    frequency of a ``dims``-wide head, one (f) for the first frequencies and 1e30 (none) for
    the rest, which stay unrotated: mlx-lm's proportional RoPE over that share of the head
    (its frequencies those of the whole head, times f where f is not 1)."""
    x = _rope_factors("rope_freqs.weight", tensors, dims).astype(np.float64)
    rotated = int(np.argmax(x >= GEMMA4_UNROTATED)) if (x >= GEMMA4_UNROTATED).any() else len(x)
    if rotated == 0 or not np.allclose(x[:rotated], x[0], rtol=1e-6, atol=0):
        raise UserInputError("GGUF gemma4 rope_freqs are not Gemma 4's proportional RoPE (one "
                             "divisor for the first frequencies, 1e30 for the unrotated rest)")
    share = 2 * rotated / dims
    if int(dims * share) != 2 * rotated:  # what mlx-lm's ProportionalRoPE rotates
        raise UserInputError(f"GGUF gemma4 with RoPE over {2 * rotated} of its global layers' "
                             f"{dims} head dims is not supported")
    factor = float(str(np.float32(x[0])))  # as llama.cpp writes it, in float32
    return {"rope_type": "proportional", "partial_rotary_factor": share,
            **({"factor": factor} if factor != 1 else {})}


class _Part(NamedTuple):
    """A GGUF tensor's stand-in, read as the reader's tensors are: half of a fused tensor's
    rows, or what llama.cpp takes where the file has no such tensor."""
    name: str
    tensor_type: Any
    shape: np.ndarray  # GGUF's order: columns first
    data: np.ndarray


def _gemma4_tensors(tensors: dict, config: dict) -> dict:
    """A Gemma 4 GGUF's tensors as mlx-lm's gemma4_text has its parameters: the experts' fused
    gate/up stacks split into their gate and up halves (the gate first, as llama.cpp reads
    them); layer scalars and per-expert scales of 1 where the file has none (llama.cpp then
    scales by nothing); the unused key/value projections of layers that share keys dropped."""
    from gguf import GGMLQuantizationType as T

    n_layers = config["num_hidden_layers"]
    first_shared = n_layers - config["num_kv_shared_layers"]
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if parts[0] != "blk" or len(parts) != 4:
            out[name] = t
        elif int(parts[1]) >= first_shared and parts[2] in ("attn_k", "attn_v", "attn_k_norm"):
            continue  # llama.cpp reads a lower layer's keys and values there
        elif parts[2:] == ["ffn_gate_up_exps", "weight"]:
            shape = np.array(t.shape.tolist())
            if len(shape) != 3 or shape[1] % 2:
                raise UserInputError(f"GGUF {name} has shape {_shape(t)}, not the experts' "
                                     "gate and up rows")
            shape[1] //= 2
            halves = np.split(np.asarray(t.data), 2, axis=-2)
            for half, data in zip(("ffn_gate_exps", "ffn_up_exps"), halves):
                split = f"blk.{parts[1]}.{half}.weight"
                if split in tensors:
                    raise UserInputError(f"GGUF has both {name} and {split}")
                out[split] = _Part(split, t.tensor_type, shape, data)
        else:
            out[name] = t
    for i in range(n_layers):
        ones = {f"blk.{i}.layer_output_scale.weight": 1}
        if config["enable_moe_block"]:
            ones[f"blk.{i}.ffn_down_exps.scale"] = config["num_experts"]
        for name, n in ones.items():
            if name not in out:
                out[name] = _Part(name, T.F32, np.array([n]), np.ones(n, np.float32))
    return out


def _llama_cpp_yarn_magnitude(config: dict) -> float:
    """What llama.cpp's YaRN multiplies the rotated dims of queries and keys by besides the
    GGUF's attn_factor: 0.1 ln(factor) + 1 (its gpt-oss loader reads no other YaRN key); 1
    without YaRN."""
    scaling = config.get("rope_scaling") or {}
    factor = scaling.get("factor", 1.0) if scaling.get("rope_type") == "yarn" else 1.0
    return 0.1 * math.log(factor) + 1 if factor > 1 else 1.0


def _rope_scale(config: dict, dims: int) -> float:
    """What mlx-lm's RoPE for ``config`` multiplies the rotated dims of queries and keys by."""
    from mlx_lm.models.rope_utils import SuScaledRoPE, initialize_rope

    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "yarn":
        return initialize_rope(dims, config["rope_theta"], False, scaling).mscale
    if scaling.get("type") != "longrope":
        return 1.0
    return SuScaledRoPE(dims, base=config["rope_theta"],
                        max_position_embeddings=config["max_position_embeddings"],
                        original_max_position_embeddings=config["original_max_position_embeddings"],
                        long_factor=scaling["long_factor"])._scale


def _llama3_rope_scaling(divisors: np.ndarray, base: float, dims: int) -> dict:
    """Llama 3's ``rope_scaling`` from llama.cpp's ``rope_freqs`` tensor, which holds what each
    RoPE frequency is divided by: 1 for short wavelengths, ``factor`` for long ones, between
    them 1 / ((1 − s) / factor + s) with s = (original / wavelength − low) / (high − low).

    Only the ratios of (original, low, high) are in the tensor, and the RoPE depends on no
    more: ``low_freq_factor`` is taken as 1 and the others fitted to the smoothed band. The
    result is checked against mlx-lm's own Llama 3 RoPE, so a tensor of another shape is an
    error, never a silently different RoPE.
    """
    from mlx_lm.models.rope_utils import Llama3RoPE

    d = divisors.astype(np.float64)
    factor = float(d.max())
    wavelength = 2 * np.pi * base ** (np.arange(0, dims, 2) / dims)
    band = ~np.isclose(d, 1.0, rtol=1e-6) & ~np.isclose(d, factor, rtol=1e-6)
    if factor <= 1 or band.sum() < 2:
        raise UserInputError("GGUF rope_freqs are not Llama 3's RoPE scaling (no smoothed band "
                             "between unscaled and scaled frequencies)")
    # s · (high − 1) − original / wavelength = s − 1, linear in (high, original)
    smooth = (1 / d[band] - 1 / factor) / (1 - 1 / factor)
    a = np.stack([smooth, -1 / wavelength[band]], axis=1)
    high, original = np.linalg.lstsq(a, smooth - 1, rcond=None)[0]
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
               "high_freq_factor": float(_number(high)),
               "original_max_position_embeddings": _number(original)}
    # float32 powers of the base: ~1e-6 relative; another scaling's divisors miss by far more
    expected = np.asarray(base ** (mx.arange(0, dims, 2) / dims)) * d
    got = np.asarray(Llama3RoPE(dims, base=base, scaling_config=scaling)._freqs)
    if not np.allclose(got, expected, rtol=1e-4, atol=0):
        raise UserInputError("GGUF rope_freqs are not Llama 3's RoPE scaling (the fitted "
                             f"scaling misses them by {np.max(np.abs(got / expected - 1)):.2g}; "
                             "llama.cpp writes them in float32)")
    return scaling


def _hf_name(gguf_name: str, arch: str = "llama") -> str:
    if arch in _QWEN35:  # mlx-lm's qwen3_5 holds the text model as its language_model
        parts = gguf_name.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[2] == "ssm_a":  # no suffix
            return f"{_QWEN35_PREFIX}model.layers.{parts[1]}.linear_attn.A_log"
        return _QWEN35_PREFIX + _hf_name(gguf_name, "qwen3_5")
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
    if parts[0] == "blk" and len(parts) == 3 and f"{parts[2]}.{suffix}" in names:
        return f"model.layers.{parts[1]}.{names[f'{parts[2]}.{suffix}']}"
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    raise UserInputError(f"unsupported GGUF tensor {gguf_name}")


def _shape(t: Any) -> tuple[int, ...]:
    """A GGUF tensor's logical (row-major) shape."""
    return tuple(int(n) for n in reversed(t.shape.tolist()))


def _check_shapes(model: Any, tensors: dict, arch: str = "llama") -> None:
    """Compare the GGUF's tensors with the parameters of ``model``, mlx-lm's model of what
    its metadata describes."""
    from mlx.utils import tree_flatten

    expected = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    got = {_hf_name(name, arch): _shape(t) for name, t in tensors.items()}
    for name, t in tensors.items():
        if arch in _QWEN35 and _qwen35_role(name) == "ssm_conv1d":  # MLX's (C, K, 1)
            got[_hf_name(name, arch)] += (1,)
    if arch == "gemma3" and "lm_head.weight" not in got:
        expected.pop("lm_head.weight", None)  # tied: mlx-lm drops lm_head on load
    missing, extra = sorted(expected.keys() - got), sorted(got.keys() - expected)
    if missing or extra:
        what = (f"lacks {missing[0]}" if missing else f"has an unexpected tensor {extra[0]}")
        raise UserInputError(f"GGUF tensors disagree with its metadata: it {what} "
                             f"({len(missing)} missing, {len(extra)} unexpected)")
    for name, shape in got.items():
        if shape != expected[name]:
            raise UserInputError(f"GGUF tensors disagree with its metadata: {name} has shape "
                                 f"{shape}, the metadata implies {expected[name]}")


def _unpermute_rows(x: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (rows (h, 2, d/2) -> (h, d/2, 2) back to HF)."""
    rows = x.shape[0]
    return (x.reshape(n_heads, rows // n_heads // 2, 2, *x.shape[1:])
            .swapaxes(1, 2).reshape(x.shape))


def _affine(t: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """A Q4_0/Q4_1/Q8_0 tensor (a matrix or the experts' stack of them) as MLX affine (packed
    uint32 weight, scales, biases, bits).

    Each GGUF block of 32 values is one MLX group: Q8_0 is d·q (q int8) = d·(q+128) − 128d;
    Q4_0 is d·(q−8); Q4_1 is d·q + m.
    """
    from gguf import GGMLQuantizationType as T

    *lead, cols = _shape(t)
    blocks = np.asarray(t.data).reshape(*lead, cols // GGUF_GROUP_SIZE, -1)
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
    if t.tensor_type == T.Q8_0:
        q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        bias, bits = d * np.float16(-128), 8
    else:
        if t.tensor_type == T.Q4_1:
            bias, qs = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0], \
                blocks[..., 4:]
        else:
            bias, qs = d * np.float16(-8), blocks[..., 2:]
        q, bits = _nibbles_in_order(qs), 4
    packed = np.ascontiguousarray(q).reshape(*lead, -1).view(np.uint32)
    return packed, d, bias, bits


def _nibbles_in_order(qs: np.ndarray) -> np.ndarray:
    """A ggml block's 16 bytes of 4-bit values (values j and j + 16 in byte j, low nibble
    first) as MLX packs them: consecutive values, low nibble first."""
    nibbles = np.concatenate([qs & 15, qs >> 4], axis=-1)  # a block's values in order
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def _mxfp4(t: Any) -> tuple[np.ndarray, np.ndarray]:
    """An MXFP4 tensor (a matrix or the experts' stack of them) as MLX's mxfp4 (packed uint32
    weight, uint8 scales).

    Both are OCP MX blocks of 32: one E8M0 scale byte (2^(e − 127)) and 32 FP4 E2M1 codes. ggml
    reads a code through a table of doubled values and halves the scale: the same numbers. Only
    the nibbles move.
    """
    *lead, cols = _shape(t)
    blocks = np.asarray(t.data).reshape(*lead, cols // GGUF_GROUP_SIZE, -1)
    scales = np.ascontiguousarray(blocks[..., 0])
    if (scales == 255).any():  # NaN in the MX format, 2^127 in ggml's reading
        raise UserInputError(f"GGUF {t.name} has an MXFP4 scale of 255 (not a number), which "
                             "cannot stay quantized; convert with --dtype to dequantize it")
    packed = np.ascontiguousarray(_nibbles_in_order(blocks[..., 1:]))
    return packed.reshape(*lead, -1).view(np.uint32), scales


def _check_types(tensors: dict) -> None:
    """Fail on a tensor type the gguf package cannot dequantize (tried on one zero block)."""
    from gguf import GGML_QUANT_SIZES, dequantize

    for t in {t.tensor_type: t for t in tensors.values()}.values():
        try:
            dequantize(np.zeros((1, GGML_QUANT_SIZES[t.tensor_type][1]), np.uint8),
                       t.tensor_type)
        except NotImplementedError:
            raise UserInputError(f"unsupported GGUF tensor type {t.tensor_type.name} for "
                                 f"{t.name} (the gguf package cannot dequantize it)") from None


def _dequantized(t: Any) -> np.ndarray:
    from gguf import dequantize

    return dequantize(np.asarray(t.data), t.tensor_type).reshape(_shape(t))


def _kept(t: Any, dtype: str | None, config: dict | None = None) -> bool:
    """Whether the GGUF tensor ``t`` stays quantized (``dtype=None``; weights of Q4_0/Q4_1/Q8_0
    and MXFP4, but where a layout change splits their blocks)."""
    from gguf import GGMLQuantizationType as T

    return (dtype is None and t.tensor_type in (T.Q4_0, T.Q4_1, T.Q8_0, T.MXFP4)
            and t.name.endswith(".weight") and len(t.shape) >= 2
            and not _qwen35_straddles(t, config))


def _kept_quantization(arch: str, tensors: dict, dtype: str | None,
                       config: dict | None = None) -> dict:
    """The config's ``quantization`` for the tensors that stay quantized ({} if none): the
    bits and mode most of them have, and each other module's own."""
    from gguf import GGMLQuantizationType as T

    kinds = {T.Q8_0: (8, "affine"), T.MXFP4: (4, "mxfp4")}
    kind_of = {_hf_name(name, arch).rsplit(".", 1)[0]: kinds.get(t.tensor_type, (4, "affine"))
               for name, t in tensors.items() if _kept(t, dtype, config)}
    if not kind_of:
        return {}
    values = list(kind_of.values())
    common = max(sorted(set(values)), key=values.count)
    quant: dict[str, Any] = {"group_size": GGUF_GROUP_SIZE, "bits": common[0], "mode": common[1]}
    for module, (bits, mode) in kind_of.items():
        if (bits, mode) != common:
            quant[module] = {"group_size": GGUF_GROUP_SIZE, "bits": bits, "mode": mode}
    return quant


def _requantized_modules(model: Any, bits: int,
                         group_size: int | None) -> tuple[dict[str, dict], dict]:
    """The modules ``mlx_lm.convert -q`` quantizes in ``model`` (mlx-lm's, its weights never
    computed; quantized in place), each with its parameters, and the ``quantization`` config
    it writes: mlx-lm's own choice (the model's ``quant_predicate``, the widths its group
    size divides)."""
    from mlx_lm.utils import quantize_model

    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its bits-per-weight line
            model, quantized = quantize_model(model, {}, group_size, bits)
    except ValueError as e:  # a width its group size does not divide (a model's own choice)
        raise UserInputError(f"cannot quantize to {bits} bits: {one_line(e)}") from None
    chosen = {path: {"group_size": m.group_size, "bits": m.bits, "mode": m.mode}
              for path, m in model.named_modules() if "scales" in m}
    return chosen, quantized["quantization"]


def _gguf_arrays(arch: str, tensors: dict, config: dict, dtype: str | None,
                 requantize: dict[str, dict]) -> Iterator[tuple[str, mx.array]]:
    """Each GGUF tensor as the mlx-lm named arrays it becomes, one tensor at a time: kept
    quantized (:func:`_kept`), or dequantized to ``dtype`` and, for a module in
    ``requantize``, quantized with its parameters."""
    from gguf import GGMLQuantizationType as T

    target = getattr(mx, dtype or DEFAULT_GGUF_DTYPE)
    heads = {"self_attn.q_proj": config["num_attention_heads"],
             "self_attn.k_proj": config["num_key_value_heads"]}
    for gname, t in tensors.items():
        module, suffix = _hf_name(gname, arch).rsplit(".", 1)
        n_heads = heads.get(module.split(".", 3)[-1]) if arch in _LLAMA_FAMILY else None
        kept = _kept(t, dtype, config)
        if kept and t.tensor_type == T.MXFP4:  # packed weights and their scale bytes
            parts = dict(zip(("weight", "scales"), _mxfp4(t)))
        elif kept:
            w, scales, biases, _ = _affine(t)
            # packed weights and their float16 scales/biases stay as they are
            parts = {"weight": w, "scales": scales, "biases": biases}
        else:
            x = _dequantized(t)
            if arch == "gemma3" and gname.endswith("norm.weight"):
                # llama.cpp stores the multiplier 1 + w of Gemma's norms; mlx-lm adds the 1
                x = x.astype(np.float32) - 1.0
            parts = {suffix: x}
        for key, x in parts.items():
            if n_heads is not None:
                x = _unpermute_rows(x, n_heads)
            if arch in _QWEN35:
                x = _qwen35_layout(gname, x, config)
            x = mx.array(x)
            # A_log stays float32, as mlx-lm's qwen3_5 casts it to nothing else
            parts[key] = x if kept or suffix == "A_log" else x.astype(target)
        if suffix == "weight" and module in requantize:
            w, scales, biases = mx.quantize(parts["weight"], **requantize[module])
            parts = {"weight": w, "scales": scales, "biases": biases}
        for key, x in parts.items():
            yield f"{module}.{key}", x


class _Shards:
    """Writes named arrays as they come into ``model.safetensors``, or into
    ``model-0000i-of-0000n.safetensors`` files of about ``limit`` bytes each, with mlx-lm's
    ``model.safetensors.index.json``; it holds one file's arrays in memory at a time. On any
    error (a full disk, Ctrl-C) every file it began is removed."""

    def __init__(self, folder: Path, limit: int = SHARD_BYTES):
        self.folder, self.limit = folder, limit
        self.pending: dict[str, mx.array] = {}
        self.pending_bytes = 0
        self.files: list[list[str]] = []  # the arrays' names, per file written
        self.begun: list[Path] = []  # every file this writer has begun, to remove on error
        self.total = 0

    def __enter__(self) -> "_Shards":
        return self

    def add(self, name: str, x: mx.array) -> None:
        mx.eval(x)  # frees what it was computed from
        if self.pending and self.pending_bytes + x.nbytes > self.limit:
            self._write()
        self.pending[name] = x
        self.pending_bytes += x.nbytes
        self.total += x.nbytes

    def _write(self) -> None:
        path = self._path(len(self.files))
        self.begun.append(path)
        mx.save_safetensors(str(path), self.pending, metadata={"format": "mlx"})
        self.files.append(sorted(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def _path(self, i: int, count: int | None = None) -> Path:
        if count is None:
            return self.folder / f".shard-{i}.safetensors"
        return self.folder / ("model.safetensors" if count == 1 else
                              f"model-{i + 1:05d}-of-{count:05d}.safetensors")

    def _finish(self) -> None:
        if self.pending:
            self._write()
        count, weight_map = len(self.files), {}
        index = self.folder / "model.safetensors.index.json"
        self.begun += [self._path(i, count) for i in range(count)] + [index]
        for i, names in enumerate(self.files):
            os.rename(self._path(i), self._path(i, count))
            weight_map.update(dict.fromkeys(names, self._path(i, count).name))
        index.write_text(json.dumps({"metadata": {"total_size": self.total},
                                     "weight_map": dict(sorted(weight_map.items()))}, indent=4))

    def __exit__(self, kind: Any, *_: Any) -> None:
        done = False
        try:
            if kind is None:
                self._finish()
                done = True
        finally:
            if not done:  # nothing half-written
                for path in self.begun:
                    path.unlink(missing_ok=True)
