"""Prompt caches with mlx-lm's names: the lazy state kept across turns, requests and files.

A :class:`PromptCache` holds one engine's state (per-layer KV, the Aux Cache of pruned
tokens' hidden states, each token's depth), the token ids it has processed and the schedule
it was made for. Passed to ``generate_step`` / ``stream_generate`` as ``prompt_cache=``, the
prompt given is processed on top of it and the cache is updated in place, as in mlx-lm; a
follow-up turn then re-selects the context at each pruning layer and revives from the Aux
Cache what it needs, so over a whole conversation every (token, layer) is computed at most
once.

A config becomes the cache's schedule through :func:`mlx_lazy.resolve.resolve_config`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from .adapter import ModelAdapter, fingerprint_difference
from .cache import LazyCache
from .prompt_cache_file import check_cache_file
from .engine import LazyEngine, ProgressFn
from .errors import UserInputError, one_line, shown
from .config import PruningConfig
from .distributed import model_group
from .folders import check_destination
from .inputs import is_int, regular_file
from .resolve import resolve_config
from .schedule import Schedule
from .token_ids import check_tokens, token_ids

#: The ``format`` of prompt-cache files.
CACHE_FORMAT = "mlx-lazy-prompt-cache/3"  # 3: the state as LazyCache.state / meta_state
#: The metadata key of the library's own JSON in a prompt-cache file (a user key may not
#: take it).
METADATA_KEY = "mlx_lazy"


class PromptCache:
    """The state of one growing sequence, reusable across calls (see the module docstring).

    Attributes:
        engine: the :class:`LazyEngine` whose state this is.
        tokens: the token ids processed so far, in order (``len(cache)``).
    """

    def __init__(self, engine: LazyEngine, tokens: Optional[List[int]] = None):
        self.engine = engine
        self.tokens: List[int] = list(tokens or [])

    @property
    def schedule(self) -> Schedule:
        """The schedule this cache was made for."""
        return self.engine.schedule

    @property
    def model(self) -> nn.Module:
        return self.engine.adapter.model

    @property
    def nbytes(self) -> int:
        """Bytes the state holds: KV buffers (filled or not), the Aux Cache, and what waits
        beside them (a recompute's stash, the scorer's window, recurrent states)."""
        return self.engine.cache.nbytes

    def copy(self) -> "PromptCache":
        """An independent copy: generating on one leaves the other as it was."""
        return _holding(self.model, self.schedule, self.engine.cache.copy(), self.tokens,
                        self.engine.attention.block_size)

    def __len__(self) -> int:
        return len(self.tokens)

    def process(self, tokens: Sequence[int], progress: Optional[ProgressFn] = None) -> mx.array:
        """Run prompt ``tokens`` on top of this cache; return the (vocab,) logits of the
        token after them. Interrupted (an exception, Ctrl-C), it leaves the cache as it was.

        Raises:
            UserInputError: ``tokens`` is not a non-empty sequence of the model's token ids.
        """
        tokens = token_ids(tokens)
        logits = self.engine.extend(tokens, progress)
        self.tokens.extend(tokens)
        return logits

    def drop_unrecorded(self) -> None:
        """Trim the model's state back to :attr:`tokens`: a decode step that went through
        the model before its caller failed (a sampler that raised) leaves a token there
        that was never handed out."""
        if self.engine.cache.length > len(self.tokens):
            self.engine.cache.trim(len(self.tokens))

    def check(self, model: nn.Module, config: Union[PruningConfig, str, None] = None) -> None:
        """Refuse a cache made for another model, or for another config than ``config``
        (None: any config).

        Raises:
            UserInputError: naming the mismatch.
        """
        if model is not self.model:
            ours, theirs = self.engine.adapter.fingerprint(), ModelAdapter(model).fingerprint()
            diff = fingerprint_difference(theirs, ours)
            if diff is not None:
                what = "weights differ" if diff == "weights" else (
                    f"{diff} {ours[diff]!r}, the model has {theirs.get(diff)!r}")
                raise UserInputError(f"the prompt cache was made for another model ({what})")
        if config is not None:
            check_same_schedule(self.schedule, resolve_config(model, config), "the prompt cache")

    def reusable(self, tokens: List[int]) -> int:
        """How many leading tokens of ``tokens`` this cache can serve: the prefix they share,
        less one when that is all of ``tokens`` (the last token must run to give logits);
        with recurrent layers, whose state cannot drop tokens, all of the cache or none."""
        common = min(common_prefix(self.tokens, tokens), len(tokens) - 1)
        return common if self.engine.cache.can_trim(common) else 0

    def extend_prefix(self, tokens: Sequence[int]) -> List[int]:
        """Trim this cache to the prefix :meth:`reusable` finds and return the tokens still
        to process.

        Raises:
            UserInputError: ``tokens`` is not a non-empty sequence of the model's token ids
                (text included: encode it first); the cache is left as it was.
        """
        tokens = token_ids(tokens)
        check_tokens(tokens, self.engine.adapter.vocab_size)
        common = self.reusable(tokens)
        if common < len(self.tokens):
            trim_prompt_cache(self, len(self.tokens) - common)
        return tokens[common:]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def check_same_schedule(have: Schedule, want: Schedule, what: str) -> None:
    """Raise UserInputError naming the first field where schedule ``want`` differs from the
    ``have`` that ``what`` was made for."""
    a, b = have.as_dict(), want.as_dict()
    diff = next((k for k in a if k != "source" and a[k] != b[k]), None)
    # A field the user never named may differ (a given keep runs the preset's scorer): say
    # how to go on with the cache's own.
    if diff is not None:
        raise UserInputError(f"{what} was made for another pruning config: {diff} is "
                             f"{a[diff]!r} there, {b[diff]!r} here (leave the pruning "
                             "settings out to go on with the cache's own)")


def make_prompt_cache(model: nn.Module,
                      config: Union[PruningConfig, str, Schedule, None] = None) -> PromptCache:
    """An empty prompt cache for ``model`` and pruning ``config`` (None: ``"full"``; a
    :class:`Schedule` is taken as already resolved for this model).

    Raises:
        UserInputError: an invalid config.
    """
    schedule = config if isinstance(config, Schedule) else resolve_config(model, config)
    return PromptCache(LazyEngine(model, schedule))


def _holding(model: nn.Module, schedule: Schedule, state: LazyCache, tokens: List[int],
             block_size: int = 256) -> PromptCache:
    """A prompt cache of ``model`` whose engine runs ``schedule`` on top of ``state``."""
    engine = LazyEngine(model, schedule, block_size)
    engine.cache = state
    engine.start_request()
    return PromptCache(engine, tokens)


def check_prompt_cache(cache: Any, what: str = "cache") -> None:
    """Refuse anything but a :class:`PromptCache` (an mlx-lm cache list included).

    Raises:
        UserInputError: naming ``what`` and what it got.
    """
    if not isinstance(cache, PromptCache):
        raise UserInputError(f"{what} must be an mlx-lazy PromptCache (from "
                             f"mlx_lazy.make_prompt_cache or load_prompt_cache), got "
                             f"{shown(cache, 80)}")


def can_trim_prompt_cache(cache: PromptCache) -> bool:
    """Whether ``cache`` can drop its last tokens: a lazy state can, but one whose recurrent
    layers (a hybrid model's) have taken tokens, which trims only to empty.

    Raises:
        UserInputError: ``cache`` is not a :class:`PromptCache`.
    """
    check_prompt_cache(cache)
    return cache.engine.cache.can_trim(len(cache) - 1)


def trim_prompt_cache(cache: PromptCache, num_tokens: int) -> int:
    """Drop the last ``num_tokens`` tokens from every layer's KV, the Aux Cache and the
    bookkeeping (a client that edits or regenerates its last turn); return ``num_tokens``.

    Raises:
        UserInputError: ``cache`` is not a :class:`PromptCache`, ``num_tokens`` negative
            or more than the cache holds, or some but not all of the tokens a recurrent
            layer's state has taken (:func:`can_trim_prompt_cache`).
    """
    check_prompt_cache(cache)
    if not is_int(num_tokens, numpy=True) or not 0 <= num_tokens <= len(cache):
        raise UserInputError(f"cannot trim {num_tokens!r} tokens from a prompt cache of "
                             f"{len(cache)} tokens")
    length = len(cache) - int(num_tokens)
    cache.engine.cache.trim(length)
    cache.tokens = cache.tokens[:length]
    return int(num_tokens)


def _unsharded(model: nn.Module, verb: str) -> None:
    """Refuse a prompt-cache file on a model sharded over ranks: each rank holds only its
    heads' keys and values, which a file of one process's state cannot tell apart."""
    if model_group(model) is not None:
        raise UserInputError(f"cannot {verb} prompt cache files on a model sharded over ranks "
                             "(each rank holds only its own heads' keys and values); run the "
                             "cached prompt again instead")


def save_prompt_cache(path: Union[str, Path], cache: PromptCache,
                      metadata: Optional[Dict[str, str]] = None) -> None:
    """Write ``cache`` to a safetensors file (atomically) with JSON metadata: the format
    version, the model's fingerprint (shapes and a digest of its weights), the schedule and
    the token ids. A recompute that ``complete="exact"`` still owes is done first (in place:
    it is the first thing the cache would compute anyway), so the file is stored completed.

    Args:
        path: the file to write.
        cache: the prompt cache.
        metadata: extra string metadata kept in the file (returned by
            :func:`load_prompt_cache` with ``return_metadata=True``): strings to strings,
            the key ``"mlx_lazy"`` being the library's own.

    Raises:
        UserInputError: ``cache`` is not a :class:`PromptCache`, ``metadata`` is not a
            mapping of strings or names the key ``"mlx_lazy"``, ``path`` cannot be written
            (checked first: a folder, FIFO or device there is refused, not replaced), or the
            model is sharded over ranks.
    """
    check_prompt_cache(cache)
    _unsharded(cache.model, "save")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise UserInputError(f"metadata must be a mapping of strings, got {shown(metadata, 80)}")
    extra = dict(metadata or {})
    for k, v in extra.items():  # as mlx-lm's: str(None) would load back as "None"
        if not isinstance(k, str) or not isinstance(v, str):
            raise UserInputError(f"metadata must be a mapping of strings to strings, got "
                                 f"{shown(k, 40)}: {shown(v, 40)}")
    if METADATA_KEY in extra:
        raise UserInputError(f"metadata key {METADATA_KEY!r} is mlx-lazy's own; use another name")
    path = check_destination(path, "prompt cache")
    engine = cache.engine
    # complete="exact" recomputes a chunk's upper layers before anything else runs on it: do it
    # once here, so every question from the file starts from the recomputed state.
    if engine.cache.stash:
        engine.complete()
    info = {
        "format": CACHE_FORMAT,
        "fingerprint": engine.adapter.fingerprint(),
        "schedule": engine.schedule.as_dict(),
        "tokens": cache.tokens,
        "state": engine.cache.meta_state,
    }
    arrays = engine.cache.state
    meta = {**extra, METADATA_KEY: json.dumps(info)}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.safetensors")
    try:
        mx.save_safetensors(str(tmp), arrays, metadata=meta)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # mlx reports an unopenable file as RuntimeError
        raise UserInputError(f"cannot write prompt cache {path}: {one_line(e)}") from None
    finally:
        tmp.unlink(missing_ok=True)


def _says_prompt_cache(path: Path) -> bool:
    """Whether ``path``'s safetensors header parses and holds mlx-lazy's metadata key: a file
    that then fails to load was a prompt cache (cut short, say), not a foreign file."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= min(path.stat().st_size - 8, 1 << 30):
                return False
            header = json.loads(f.read(size))
        meta = header.get("__metadata__")
        return isinstance(meta, dict) and METADATA_KEY in meta
    except (OSError, ValueError, AttributeError, RecursionError):
        return False


def load_prompt_cache(path: Union[str, Path], model: nn.Module, return_metadata: bool = False
                      ) -> Union[PromptCache, Tuple[PromptCache, Dict[str, str]]]:
    """Read a file written by :func:`save_prompt_cache` for ``model`` (unlike mlx-lm, the
    model is needed: the cache is an engine's state).

    Returns:
        The cache, and with ``return_metadata`` also the extra metadata saved with it.

    Raises:
        UserInputError: a model sharded over ranks, a missing, truncated or foreign file,
            one made for another model, or one whose contents are corrupt
            (:func:`mlx_lazy.prompt_cache_file.check_cache_file`: the metadata, the schedule
            and every array are checked against the model).
    """
    _unsharded(model, "load")
    path = regular_file(path, "prompt cache")
    try:
        arrays, meta = mx.load(str(path), format="safetensors", return_metadata=True)
        info = json.loads(meta[METADATA_KEY]) if METADATA_KEY in meta else None
    except (RuntimeError, ValueError, OSError, RecursionError) as e:
        # ValueError: JSON that does not parse, or an integer too long to convert
        if _says_prompt_cache(path):
            raise UserInputError(f"prompt cache {path} is corrupt: {one_line(e)}") from None
        raise UserInputError(f"{path} is not an mlx-lazy prompt cache ({one_line(e)})") from None
    if info is None:  # mlx-lm's own cache files, model weights
        raise UserInputError(f"{path} is a safetensors file without mlx-lazy's metadata: not a "
                             "prompt cache saved by mlx-lazy")
    if not isinstance(info, dict) or info.get("format") != CACHE_FORMAT:
        raise UserInputError(f"{path} is not an mlx-lazy prompt cache of format {CACHE_FORMAT!r}")
    adapter = ModelAdapter(model)
    fingerprint = adapter.fingerprint()
    saved = info.get("fingerprint")
    if not isinstance(saved, dict):
        raise UserInputError(f"prompt cache {path} is corrupt: fingerprint must be an object, "
                             f"got {shown(saved, 80)}")
    diff = fingerprint_difference(saved, fingerprint)
    if diff is not None:
        raise UserInputError(f"prompt cache {path} was made for another model: {diff} is "
                             f"{shown(saved[diff], 80) if diff in saved else 'missing'} there, "
                             f"{fingerprint[diff]!r} here")
    cache = _holding(model, *check_cache_file(path, arrays, info, adapter))
    extra = {k: v for k, v in meta.items() if k != METADATA_KEY}
    return (cache, extra) if return_metadata else cache
