"""The one check of a prompt-cache file against the model it is loaded for.

:func:`mlx_lazy.prompt_cache.load_prompt_cache` reads a safetensors file whose metadata key
``mlx_lazy`` holds JSON (``format``, ``fingerprint``, ``schedule``, ``tokens`` and ``state``,
the :attr:`LazyCache.meta_state`) and whose arrays are :attr:`LazyCache.state`. Everything
in it is checked here before an engine runs on it (:func:`check_cache_file`), so that no
file can crash generation or make it run silently wrong:

* the metadata's types and ranges: token ids of the vocabulary, ``prompt_len`` in
  [0, len(tokens)], ``revivals`` non-negative, ``num_layers`` the model's;
* the schedule through the checks a schedule file goes through (:func:`check_schedule`):
  it must be what :func:`~mlx_lazy.config.build_schedule` makes of its own method and fields
  on this model, and the engine runs that resolved schedule, not the file's dict; on a hybrid
  model, one it can run (no revival, cuts after attention layers);
* every array against the model and the cache's invariants (:func:`check_state`): integer
  bookkeeping of the right shapes (``0 <= depth <= limit <= num_layers``, no live token
  left at depth 0, ``computed`` > 0 exactly below each token's depth); at layer ``l`` KV
  for exactly the tokens whose depth is above ``l`` (none where the layer reads a lower
  layer's), shaped and typed as the model's keys
  and values (:func:`model_tensors` runs one token through the layers to see them); Aux Cache
  rows of tokens waiting at their depth (and one for every token that may still go on), at
  most one stash and only where the schedule stashes, scoring windows only at its pruning
  layers (at most the scorer's queries, in position order), the last choices (held between
  re-selections) only at its pruning layers (one boolean per token then, all of one
  length); no NaN or infinity in any tensor; no array the state does not name.

A problem raises ``UserInputError("prompt cache PATH is corrupt: ...")``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from .adapter import ModelAdapter
from .attention import attention
from .cache import EMBEDDING_STATE, TOKEN_ARRAYS, ROW_MAPS, LazyCache
from .config import PruningConfig, build_schedule
from .errors import UserInputError, shown
from .inputs import is_int
from .policies import check_hybrid_schedule, compose
from .schedule import Schedule

#: The keys of the ``mlx_lazy`` metadata object, and of its ``state``.
INFO_KEYS = ("format", "fingerprint", "schedule", "tokens", "state")
META_STATE_KEYS = ("num_layers", "prompt_len", "revivals")
#: The largest count a file's scalars may hold (numpy's int64, with room).
MAX_SCALAR = 2**62
#: Longest user value an error message shows.
SHOWN = 80

_ARRAY_NAME = re.compile(
    r"(layers|aux|stash|window)\.(0|[1-9][0-9]{0,9})\.(keys|values|positions|data)")
_CHOICE_NAME = re.compile(r"choices\.(0|[1-9][0-9]{0,9})")
_RECURRENT_NAME = re.compile(r"recurrent\.(0|[1-9][0-9]{0,9})\.(0|[1-9][0-9]{0,9})")
_PARTS = {"layers": ("keys", "values", "positions"), **{m: ("data", "positions") for m in ROW_MAPS}}


class Corrupt(Exception):
    """What is wrong with a file (the caller names the file)."""


def check_cache_file(path: Any, arrays: Dict[str, mx.array], info: Any,
                     adapter: ModelAdapter) -> Tuple[Schedule, LazyCache, List[int]]:
    """The schedule, state and token ids of a prompt-cache file whose arrays and parsed
    ``mlx_lazy`` metadata are ``arrays`` and ``info``, every part checked against
    ``adapter``'s model (the module docstring lists what). The format and the fingerprint are
    the caller's (a foreign file, another model); their types are checked here.

    Raises:
        UserInputError: ``prompt cache PATH is corrupt: ...``, naming the first problem.
    """
    try:
        tokens, meta = check_info(info, adapter)
        schedule = check_schedule(info["schedule"], adapter.num_layers)
        try:
            check_hybrid_schedule(schedule, adapter.model)
        except UserInputError as e:
            raise Corrupt(f"schedule: {e}") from None
        state = check_state(arrays, meta, tokens, schedule, adapter)
    except Corrupt as e:
        raise UserInputError(f"prompt cache {path} is corrupt: {e}") from None
    return schedule, state, tokens


def check_info(info: Any, adapter: ModelAdapter) -> Tuple[List[int], Dict[str, int]]:
    """The token ids and the ``state`` scalars of the metadata object ``info``.

    Raises:
        Corrupt: a missing or unknown key, a value of the wrong type or out of range.
    """
    _keys("the metadata", info, INFO_KEYS)
    if not isinstance(info["fingerprint"], dict):
        raise Corrupt(f"fingerprint must be an object, got {shown(info['fingerprint'], SHOWN)}")
    tokens, vocab = info["tokens"], adapter.vocab_size
    if not isinstance(tokens, list):
        raise Corrupt(f"tokens must be a list of token ids, got {shown(tokens, SHOWN)}")
    bad = next((i for i, t in enumerate(tokens) if not is_int(t) or not 0 <= t < vocab), None)
    if bad is not None:
        raise Corrupt(f"tokens must be token ids in [0, {vocab}), got {shown(tokens[bad], SHOWN)} "
                      f"at index {bad}")
    meta = info["state"]
    _keys("state", meta, META_STATE_KEYS)
    for key in META_STATE_KEYS:
        if not is_int(meta[key]) or not 0 <= meta[key] <= MAX_SCALAR:
            raise Corrupt(f"state.{key} must be a non-negative integer, got "
                          f"{shown(meta[key], SHOWN)}")
    if meta["num_layers"] != adapter.num_layers:
        raise Corrupt(f"state.num_layers is {meta['num_layers']}, the model has "
                      f"{adapter.num_layers} layers")
    if meta["prompt_len"] > len(tokens):
        raise Corrupt(f"state.prompt_len must be in [0, {len(tokens)}] (the token count), got "
                      f"{meta['prompt_len']}")
    return tokens, meta


def check_schedule(d: Any, num_layers: int) -> Schedule:
    """The schedule a file's ``schedule`` object ``d`` (``Schedule.as_dict``) stands for on a
    model of ``num_layers`` layers: the :class:`PruningConfig` of its method and fields,
    checked and resolved as a schedule file's is (``read_schedule``), must give ``d`` again
    field for field (types included), and that resolved schedule is returned.

    Raises:
        Corrupt: a missing or unknown field, a value the config's checks refuse, or a field
            its method and other fields do not give.
    """
    names = [f.name for f in fields(Schedule)]
    if isinstance(d, dict):  # written before these fields: the paper's step
        d = {"revive_margin": 0.0, "reselect_every": 1, **d}
    _keys("schedule", d, names)
    if not is_int(d["num_layers"]) or d["num_layers"] != num_layers:
        raise Corrupt(f"schedule.num_layers is {shown(d['num_layers'], SHOWN)}, the model has "
                      f"{num_layers} layers")
    try:
        given: Dict[str, Any] = {k: d[k] for k in ("method", "anchors", "seed", "source")}
        for policy in compose(d["method"]).values():
            given.update(policy.given(d))
        for key in ("prune_layers", "keep"):  # the config takes any sequence; a file, lists
            if key in given and not isinstance(given[key], list):
                raise UserInputError(f"{key} must be a list, got {shown(given[key], SHOWN)}")
        resolved = build_schedule(PruningConfig(**given), num_layers)
    except UserInputError as e:
        raise Corrupt(f"schedule: {e}") from None
    want = resolved.as_dict()
    for name in names:
        if json.dumps(want[name]) != json.dumps(d[name]):
            raise Corrupt(f"schedule.{name} is {shown(d[name], SHOWN)}, its method and other "
                          f"fields give {shown(want[name], SHOWN)}")
    return resolved


Kind = Tuple[Tuple[Optional[int], ...], Any]


@dataclass(frozen=True)
class ModelTensors:
    """Shapes (without the token axis) and dtypes of what a model computes per token, by
    layer: keys and values (kv_heads, head_dim), scoring queries (heads, head_dim) (None at
    a recurrent layer), and by depth the hidden states (hidden_size,) after that many layers
    (this process's heads, on a sharded model); by recurrent layer, its state's parts (None on
    the axis of a part that grows by a row a token: Falcon-H1's keys and values)."""

    keys: List[Optional[Kind]]
    values: List[Optional[Kind]]
    queries: List[Optional[Kind]]
    hidden: List[Kind]
    recurrent: Dict[int, List[Kind]]


def model_tensors(adapter: ModelAdapter) -> ModelTensors:
    """What ``adapter``'s model produces: one token run through every layer (a decode
    step's work; a model whose layers differ in dtype is seen as it is)."""
    h = adapter.embed(mx.array([0]))
    out = ModelTensors([], [], [], [((h.shape[2],), h.dtype)], {})

    def heads(x: mx.array) -> Kind:
        return (x.shape[1], x.shape[3]), x.dtype

    kvs = {}
    for layer in range(adapter.num_layers):
        if adapter.stateless(layer):
            h = adapter.stateless_block(layer, h)
        elif adapter.recurrent(layer):
            state: List[Optional[mx.array]] = []
            longer: List[Optional[mx.array]] = []  # after two tokens: which axes grow
            adapter.recurrent_block(layer, mx.concatenate([h, h], axis=1), longer, np.arange(2))
            h = adapter.recurrent_block(layer, h, state, np.array([0]))
            mx.eval(h, state, longer)
            out.recurrent[layer] = [
                (tuple(a if a == b else None for a, b in zip(part.shape[1:], two.shape[1:])),
                 part.dtype) for part, two in zip(state, longer)]
        if adapter.attention_free(layer):
            for kinds in (out.keys, out.values, out.queries):
                kinds.append(None)
            out.hidden.append(((h.shape[2],), h.dtype))
            continue
        q, k, v, gate = adapter.qkv(layer, h, np.array([0]))
        if k is None:  # a layer reading a lower layer's keys and values
            k, v = kvs[adapter.kv_layer(layer)]
        kvs[layer] = k, v
        h = adapter.finish(layer, h, attention(q, k, v, adapter.scale), gate)
        mx.eval(q, k, v, h)
        out.keys.append(heads(k))
        out.values.append(heads(v))
        out.queries.append(heads(q))
        out.hidden.append(((h.shape[2],), h.dtype))
    return out


def check_state(arrays: Dict[str, mx.array], meta: Dict[str, int], tokens: List[int],
                schedule: Schedule, adapter: ModelAdapter) -> LazyCache:
    """The :class:`LazyCache` of a file's ``arrays`` and ``meta`` (its ``state``), checked
    against ``tokens``, ``schedule`` and the model (see the module docstring).

    Raises:
        Corrupt: naming the first array that is missing, unknown or wrong.
    """
    L, n = adapter.num_layers, len(tokens)
    entries: Dict[Tuple[str, int], Dict[str, mx.array]] = {}
    choices = {}
    recurrent: Dict[int, Dict[int, mx.array]] = {}
    context = None  # an n-gram embedding's state (EMBEDDING_STATE)
    for name, array in arrays.items():
        m = _ARRAY_NAME.fullmatch(name)
        if name in TOKEN_ARRAYS:
            continue
        if _CHOICE_NAME.fullmatch(name):
            choices[name] = array
            continue
        r = _RECURRENT_NAME.fullmatch(name)
        if r is not None and int(r[1]) < L and adapter.recurrent(int(r[1])):
            recurrent.setdefault(int(r[1]), {})[int(r[2])] = array
            continue
        if name == f"recurrent.{EMBEDDING_STATE}.0" and adapter.context_width:
            context = array
            continue
        if m is None or m[3] not in _PARTS[m[1]] or (m[1] == "layers" and int(m[2]) >= L):
            raise Corrupt(f"unknown array {shown(name, SHOWN)}")
        entries.setdefault((m[1], int(m[2])), {})[m[3]] = array
    for name in TOKEN_ARRAYS:
        if name not in arrays:
            raise Corrupt(f"array {name} is missing")
    depth = _ints("depth", arrays["depth"], (n,))
    limit = _ints("limit", arrays["limit"], (n,))
    if not ((0 <= depth) & (depth <= limit) & (limit <= L)).all():
        raise Corrupt(f"depth and limit must satisfy 0 <= depth <= limit <= {L} (the model's "
                      "layers)")
    if ((limit > 0) & (depth == 0)).any():
        raise Corrupt("a token that may reach layer 0 was never computed (limit above 0, "
                      "depth 0)")
    computed = _ints("computed", arrays["computed"], (L, n))
    if (computed < 0).any() or (computed > np.iinfo(np.int32).max).any():
        raise Corrupt("computed must hold non-negative int32 counts")
    if not np.array_equal(computed > 0, np.arange(L)[:, None] < depth[None, :]):
        raise Corrupt("computed must count a computation at exactly the layers below each "
                      "token's depth")
    kept = _ints("always_kept", arrays["always_kept"], None)
    if not ((0 <= kept) & (kept < n)).all():
        raise Corrupt(f"always_kept must hold positions in [0, {n})")

    if adapter.context_width:
        _embedding_state(context, tokens, adapter.context_width)
    shapes = model_tensors(adapter)
    for layer in range(L):
        parts = entries.get(("layers", layer), {})
        # a layer reading a lower layer's keys and values (Gemma 4's E2B/E4B) holds none,
        # nor does a stateless one, nor a recurrent one, whose state has taken the tokens whose
        # depth is above it
        if adapter.recurrent(layer):
            took = int((depth > layer).sum())
            _recurrent_state(layer, recurrent.pop(layer, {}), took, shapes.recurrent[layer],
                             adapter.state_rows(layer, took))
        has_kv = adapter.kv_layer(layer) == layer and not adapter.attention_free(layer)
        want = np.flatnonzero(depth > layer) if has_kv else []
        if not len(want) and not parts:
            continue
        where = f"layers.{layer}"
        _complete(where, parts)
        positions = _positions(where, parts["positions"], n)
        if not np.array_equal(np.sort(positions), want):
            raise Corrupt(f"{where} holds KV for other tokens than those whose depth is above "
                          f"{layer} ({len(positions)} positions, {len(want)} tokens)")
        for part, kind in (("keys", shapes.keys), ("values", shapes.values)):
            _tensor(f"{where}.{part}", parts[part], kind[layer], len(positions), 2)

    waiting: Dict[str, np.ndarray] = {m: np.zeros(0, np.int64) for m in ROW_MAPS}
    for (name, d), parts in sorted(entries.items()):
        if name == "layers":
            continue
        where = f"{name}.{d}"
        _complete(where, parts)
        positions = _positions(where, parts["positions"], n)
        if name == "aux":
            if not schedule.revive:
                raise Corrupt(f"{where}: an Aux Cache under a schedule without revival")
            if not 1 <= d < L or not (depth[positions] == d).all() \
                    or not (limit[positions] > d).all():
                raise Corrupt(f"{where} holds tokens that are not waiting at depth {d}")
            _tensor(f"{where}.data", parts["data"], shapes.hidden[d], len(positions), 1)
        elif name == "stash":
            if not schedule.completion.stashes or waiting["stash"].size:
                raise Corrupt(f"{where}: a stash where the schedule keeps none, or two")
            if not 1 <= d < L or not (depth[positions] >= d).all() \
                    or (np.diff(positions) <= 0).any():
                raise Corrupt(f"{where} must hold increasing positions of tokens computed "
                              f"to depth {d}")
            _tensor(f"{where}.data", parts["data"], shapes.hidden[d], len(positions), 1)
        else:
            if d not in schedule.prune_layers or len(positions) > schedule.scorer.n_queries \
                    or (np.diff(positions) <= 0).any():
                raise Corrupt(f"{where} must be the scoring queries of a pruning layer: at "
                              f"most {schedule.scorer.n_queries}, at increasing positions")
            _tensor(f"{where}.data", parts["data"], shapes.queries[d], len(positions), 2)
        waiting[name] = np.concatenate([waiting[name], positions])
    lengths = {array.shape[0] for array in choices.values()}
    for name, array in choices.items():
        if int(name.split(".")[1]) not in schedule.prune_layers or array.dtype != mx.bool_ \
                or array.ndim != 1 or not 1 <= array.shape[0] <= n or len(lengths) > 1:
            raise Corrupt(f"{name} must be the last choice of a pruning layer: one boolean per "
                          f"token then, every choice alike")
    goes_on = np.flatnonzero((depth > 0) & (depth < limit))
    if not np.isin(goes_on, np.concatenate([waiting["aux"], waiting["stash"]])).all():
        raise Corrupt("a token that may go deeper has no hidden state in the Aux Cache")

    ints = {"depth": depth, "limit": limit, "computed": computed, "always_kept": kept}
    state = {**arrays, **{k: mx.array(v) for k, v in ints.items()}}
    for key, array in arrays.items():
        if key.endswith(".positions"):
            state[key] = mx.array(np.array(array).astype(np.int64))
    return LazyCache.from_state(state, meta)


def _recurrent_state(layer: int, parts: Dict[int, mx.array], took: int,
                     kinds: List[Kind], rows: Optional[List[int]] = None) -> None:
    """Refuse a recurrent layer's state unless it is there exactly when the layer took a
    token (``took`` tokens), every part shaped and typed as the model's (a growing part, a row
    a token, or where given each part's ``rows``) and finite."""
    if not took:
        if parts:
            raise Corrupt(f"recurrent.{layer}: a state for a layer that took no token")
        return
    for i, kind in enumerate(kinds):
        if i not in parts:
            raise Corrupt(f"array recurrent.{layer}.{i} is missing")
        shape = ((rows[i], *kind[0][1:]) if rows else
                 tuple(took if size is None else size for size in kind[0]))
        _array(f"recurrent.{layer}.{i}", parts.pop(i), (1, *shape), kind[1])
    if parts:
        raise Corrupt(f"unknown array recurrent.{layer}.{min(parts)}")


def _embedding_state(context: Optional[mx.array], tokens: List[int], width: int) -> None:
    """Refuse an n-gram embedding's state unless it holds, as int64, the ids of the last
    ``width`` of ``tokens`` (none before the first)."""
    want = np.array(tokens[-width:], np.int64)[None] if tokens else None
    if (context is None) != (want is None) or context is not None and (
            context.dtype != mx.int64 or not np.array_equal(np.array(context), want)):
        raise Corrupt(f"recurrent.{EMBEDDING_STATE}.0 must hold the ids of the last {width} "
                      "tokens (the n-gram embedding's context)")


def _keys(where: str, d: Any, names: Any) -> None:
    """Refuse ``d`` unless it is an object with exactly the keys ``names``."""
    if not isinstance(d, dict):
        raise Corrupt(f"{where} must be an object, got {shown(d, SHOWN)}")
    missing = [k for k in names if k not in d]
    if missing:
        raise Corrupt(f"{where} lacks {missing[0]!r}")
    unknown = sorted(str(k) for k in set(d) - set(names))
    if unknown:
        raise Corrupt(f"{where} has an unknown key {shown(unknown[0], SHOWN)}")


def _ints(name: str, array: mx.array, shape: Optional[Tuple[int, ...]]) -> np.ndarray:
    """An integer array of ``shape`` (None: any 1-D) as int64 (values checked by callers
    against bounds far inside int64; larger unsigned values are refused here)."""
    if not mx.issubdtype(array.dtype, mx.integer):
        raise Corrupt(f"{name} must be an integer array, got {array.dtype}")
    if (array.ndim != 1) if shape is None else (tuple(array.shape) != shape):
        want = "1-D" if shape is None else f"of shape {shape}"
        raise Corrupt(f"{name} must be {want}, got shape {tuple(array.shape)}")
    values = np.array(array)
    if values.size and values.dtype == np.uint64 and values.max() > MAX_SCALAR:
        raise Corrupt(f"{name} holds a value beyond {MAX_SCALAR}")
    return values.astype(np.int64)


def _positions(where: str, array: mx.array, n: int) -> np.ndarray:
    """A row map's or layer's positions: 1-D, not empty, unique, in [0, n)."""
    positions = _ints(f"{where}.positions", array, None)
    if not len(positions) or not ((0 <= positions) & (positions < n)).all() \
            or len(np.unique(positions)) != len(positions):
        raise Corrupt(f"{where}.positions must be distinct positions in [0, {n}), at least one")
    return positions


def _complete(where: str, parts: Dict[str, mx.array]) -> None:
    kind = where.split(".")[0]
    missing = [p for p in _PARTS[kind] if p not in parts]
    if missing:
        raise Corrupt(f"array {where}.{missing[0]} is missing")


def _tensor(name: str, array: mx.array, kind: Kind, rows: int, axis: int) -> None:
    """Refuse ``array`` unless it is (1, ..., rows at ``axis``, ...) with the model's
    per-token shape and dtype ``kind``, and finite."""
    shape, dtype = kind
    _array(name, array, (1, *shape[: axis - 1], rows, *shape[axis - 1:]), dtype)


def _array(name: str, array: mx.array, want: Tuple[int, ...], dtype: Any) -> None:
    """Refuse ``array`` unless it is ``dtype`` of shape ``want``, and finite."""
    if tuple(array.shape) != want or array.dtype != dtype:
        raise Corrupt(f"{name} must be {dtype} of shape {want} (what the model computes), got "
                      f"{array.dtype} of shape {tuple(array.shape)}")
    if not mx.all(mx.isfinite(array)).item():
        raise Corrupt(f"{name} holds NaN or infinity")
