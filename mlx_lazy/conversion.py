"""Convert models to MLX folders that ``mlx_lm.load`` reads (the command line is
:mod:`mlx_lazy.convert`).

Two sources:

* a Hugging Face / MLX folder or a hub id: delegated to ``mlx_lm.convert`` (optional
  quantization and dtype);
* a GGUF file, read with the ``gguf`` package (llama.cpp's reference reader): its metadata
  becomes mlx-lm's ``config.json`` (:mod:`mlx_lazy.gguf_config`, which lists the architectures
  and what converting each involves), its tensors mlx-lm's named arrays
  (:mod:`mlx_lazy.gguf_tensors`: Q4_0/Q4_1/Q8_0 and MXFP4 matrices stay quantized unless a
  dtype is given, the other types are dequantized), requantized as ``mlx_lm.convert -q``
  would when bits are asked for. Tensors are converted one at a time and written in shards as
  they go. ``tokenizer.json`` / ``tokenizer_config.json`` are rebuilt from the GGUF metadata
  (:mod:`mlx_lazy.gguf_tokenizer`).

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
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.utils import get_total_parameters

from .errors import UserInputError, one_line
from .folders import atomic_dir
from .gguf_config import (ARCHITECTURES, ROPE_TENSORS, UNSUPPORTED_ARCHITECTURES, mlx_lm_config,
                          xielu_parameters)
from .gguf_tensors import (DEFAULT_GGUF_DTYPE, NEXTN, REGROUPED, check_shapes, check_types,
                           gguf_arrays, kept_quantization, trunk_tensors, xielu_tensors)
from .gguf_tokenizer import build_tokenizer, eos_ids

DTYPES = ("float32", "float16", "bfloat16")
#: The group sizes MLX quantizes with.
Q_GROUP_SIZES = (32, 64, 128)
#: A GGUF conversion writes its weights in files of about this size, converting one tensor at
#: a time: the most converted weights it holds in memory at once.
SHARD_BYTES = 2 << 30


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
    check_types(tensors)
    arch = meta.get("general.architecture")
    if arch in UNSUPPORTED_ARCHITECTURES:
        raise UserInputError(f"GGUF {arch} is not supported ({UNSUPPORTED_ARCHITECTURES[arch]})")
    if arch not in ARCHITECTURES:
        raise UserInputError(f"unsupported GGUF architecture {arch!r} "
                             f"(supported: {', '.join(map(repr, ARCHITECTURES))})")
    if arch in NEXTN:
        tensors = trunk_tensors(arch, meta, tensors)
    config = mlx_lm_config(arch, meta, tensors)
    for name in ROPE_TENSORS:  # in the config now, not weights
        tensors.pop(name, None)
    if arch in REGROUPED:
        tensors = REGROUPED[arch](tensors, config)
    if arch == "apertus":  # its activation's parameters are metadata in a GGUF
        tensors = xielu_tensors(tensors, xielu_parameters(meta, config["num_hidden_layers"]))
    tokenizer, tokenizer_config = build_tokenizer(arch, meta)
    config["eos_token_id"] = eos_ids(meta)
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))  # lazy: nothing is computed
    check_shapes(model, tensors, arch)
    parameters = get_total_parameters(model)  # before --q-bits quantizes it in place

    if q_bits is not None:
        dtype = dtype or "float16"
        requantize, quant = _requantized_modules(model, q_bits, q_group_size)
    else:
        requantize, quant = {}, kept_quantization(arch, tensors, dtype, config)
    with _Shards(out_dir, shard_bytes, parameters) as shards:
        cast = getattr(model, "cast_predicate", lambda _: True)  # as mlx-lm's convert casts
        for name, x in gguf_arrays(arch, tensors, config, dtype, requantize, cast):
            shards.add(name, x)
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


class _Shards:
    """Writes named arrays as they come into ``model.safetensors``, or into
    ``model-0000i-of-0000n.safetensors`` files of about ``limit`` bytes each, with mlx-lm's
    ``model.safetensors.index.json`` (its ``total_parameters``: ``parameters``); it holds one
    file's arrays in memory at a time. On any error (a full disk, Ctrl-C) every file it began
    is removed."""

    def __init__(self, folder: Path, limit: int, parameters: int):
        self.folder, self.limit, self.parameters = folder, limit, parameters
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
        metadata = {"total_size": self.total, "total_parameters": self.parameters}
        index.write_text(json.dumps({"metadata": metadata,
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
