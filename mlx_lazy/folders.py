"""Writing folders and files atomically: a temporary sibling renamed into place at the end.

Temporary names are ``.<target name>.tmp-<pid>-<random>`` (:func:`temp_prefix`), next to the
target. A process killed mid-write (SIGKILL, power loss) leaves one behind; the next atomic
write into the same folder sweeps every such name whose process has ended
(:func:`sweep_stale_temps`), whatever its target.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Union

from .errors import UserInputError
from .inputs import as_path

#: The environment variable naming mlx-lazy's cache folder (named models, the CPU shim).
CACHE_ENV = "MLX_LAZY_CACHE"


def cache_root() -> Path:
    """mlx-lazy's cache folder: ``$MLX_LAZY_CACHE`` or ``~/.cache/mlx_lazy`` (not created)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mlx_lazy").expanduser()


# tempfile's random part: 8 characters of [a-z0-9_]
_TEMP_NAME = re.compile(r"\..+\.tmp-(?P<pid>[0-9]+)-[a-z0-9_]{8}")


def temp_prefix(target: Path) -> str:
    """The name prefix of this process's temporary files for ``target`` (what
    :func:`sweep_stale_temps` removes once the process is gone)."""
    return f".{target.name}.tmp-{os.getpid()}-"


def sweep_stale_temps(folder: Path) -> list[Path]:
    """Remove the temporary files and folders in ``folder`` named by :func:`temp_prefix` of
    processes that have ended; return what was removed.

    Only names of exactly that pattern, owned by this user, whose pid is not running. A pid
    reused by a live process keeps its entry (the safe side).
    """
    removed = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:  # missing or unreadable: nothing of ours to sweep
        return removed
    for path in entries:
        m = _TEMP_NAME.fullmatch(path.name)
        if m is None or _alive(int(m["pid"])):
            continue
        try:
            if path.lstat().st_uid != os.getuid():
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path)
        except OSError:  # gone meanwhile, or not ours to remove
            pass
    return removed


@contextlib.contextmanager
def atomic_dir(out: Path) -> Iterator[Path]:
    """Yield an empty temporary folder next to ``out``; rename it to ``out`` on success.

    On any error, and on SIGTERM (in the main thread), the temporary folder and the parent
    folders created for it are removed. Stale temporary folders left by killed processes are
    swept first. The result's permissions follow the umask (not mkdtemp's 0700).

    Raises:
        UserInputError: the parent cannot be created or written, or ``out`` appeared meanwhile.
    """
    created = _make_parents(out.parent)
    ok = False
    try:
        sweep_stale_temps(out.parent)
        try:
            tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out), dir=out.parent))
        except OSError as e:
            raise UserInputError(f"cannot write to {out.parent}: {e.strerror or e}") from None
        try:
            with _sigterm_raises():
                yield tmp
                if out.exists():
                    raise UserInputError(f"output folder {out} already exists; remove it or "
                                         "choose another")
                os.chmod(tmp, 0o777 & ~umask())
                os.rename(tmp, out)
            ok = True
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if not ok:
            for d in reversed(created):
                with contextlib.suppress(OSError):
                    d.rmdir()


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "w") -> Iterator[Any]:
    """Open a temporary sibling of ``path`` for writing; replace ``path`` with it when the
    block ends without an error (readers see the old file or the new one, never a torn one)."""
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


@contextlib.contextmanager
def output_folder(out: Path) -> Iterator[None]:
    """Run a tool whose outputs go into the folder ``out``: if it stops on bad input
    (:class:`UserInputError`) before writing any, a folder it made is removed again; a folder
    that was there before stays."""
    new = not out.exists()
    try:
        yield
    except UserInputError:
        if new and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise


def make_folder(out: Path, what: str = "--out") -> None:
    """Create the folder ``out`` (and its parents) for a tool's outputs, or fail with one
    line when it is a file, cannot be created or cannot be written into.

    Raises:
        UserInputError: naming ``what`` and the problem.
    """
    if out.exists() and not out.is_dir():
        raise UserInputError(f"{what} {out} exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserInputError(f"cannot create {what} {out}: {e.strerror or e}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise UserInputError(f"cannot write into {what} {out}")


def check_destination(path: Union[str, os.PathLike], what: str) -> Path:
    """``path``, checked to be where a file can be written atomically: a regular file or a new
    name, in an existing folder that this process can create files in (probed with a
    temporary file, removed again). A FIFO, device, socket or folder there is refused, not
    replaced (as root, a replaced device node is gone for everyone). Meant to run before the
    slow work whose result is written.

    Raises:
        UserInputError: naming ``what`` and the problem.
    """
    target = as_path(path, what)
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise UserInputError(f"cannot write {what} {path}: {e.strerror or e}") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise UserInputError(f"{what} {path} is a folder; give a file name")
    if mode is not None and not stat.S_ISREG(mode):
        raise UserInputError(f"{what} {path} is not a regular file (a FIFO, socket or "
                             "device); give a file name")
    folder = target.absolute().parent
    if not folder.is_dir():
        raise UserInputError(f"cannot write {what} {path}: folder {folder} does not exist")
    try:
        fd, probe = tempfile.mkstemp(prefix=temp_prefix(target), dir=folder)
    except OSError as e:  # /proc says "No such file or directory": name what was tried
        raise UserInputError(f"cannot write {what} {path}: cannot create a file in {folder} "
                             f"({e.strerror or e})") from None
    os.close(fd)
    os.unlink(probe)
    return target


def check_not_an_input(output: Optional[str], what: str, inputs: Mapping[str, Optional[str]],
                       replaced: bool = False) -> None:
    """Refuse an output path that names one of the ``inputs`` (a flag's name -> its path):
    writing it would destroy what the run reads (a prompt cache once became the run's
    statistics). An output written through its file (``open(path, "w")``) destroys an input
    it links to; one ``replaced`` whole (:func:`atomic_file`: a new file renamed onto the
    name) only an input whose own name, links resolved, it is.

    Raises:
        UserInputError: naming both flags.
    """
    if not output:
        return
    for flag, path in inputs.items():
        if path and (_same_name(output, path) if replaced else _same_file(output, path)):
            raise UserInputError(f"{what} {output} is also {flag}'s file, which writing it "
                                 "would destroy; give another file name")


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist (yet): the same name, links resolved
        return os.path.realpath(a) == os.path.realpath(b)


def _same_name(output: str, path: str) -> bool:
    """Whether renaming a file onto ``output`` replaces the file ``path`` reads: the name
    itself (its folder's links resolved, not a link it may be), against ``path`` resolved."""
    named = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(output))),
                         os.path.basename(output))
    return named == os.path.realpath(path)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through :func:`atomic_file`."""
    with atomic_file(path) as f:
        f.write(text)


def umask() -> int:
    """The process umask (read without changing it for longer than two calls)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # someone else's process; not a pid of ours
        return True
    return True


def _make_parents(folder: Path) -> list[Path]:
    """mkdir -p ``folder``; return the folders created, outermost first."""
    missing = []
    p = folder.absolute()
    while not p.exists():
        missing.append(p)
        p = p.parent
    created = []
    try:
        for d in reversed(missing):
            d.mkdir()
            created.append(d)
    except OSError as e:
        for d in reversed(created):
            with contextlib.suppress(OSError):
                d.rmdir()
        raise UserInputError(f"cannot create folder {folder}: {e.strerror or e}") from None
    return created


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises SystemExit so that ``finally`` clauses clean up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
