"""Prompt-cache files against hostile edits: whatever a file holds, ``load_prompt_cache``
either gives a cache that generates a valid answer or raises ``UserInputError`` (``... is
corrupt: ...``), never another exception, a traceback mid-generation or a silently wrong
state (:mod:`mlx_lazy.prompt_cache_file`).

Real files of a tiny model are mutated: by hand for each case the issue names (a table),
and by hypothesis (arrays dropped, renamed, reshaped, cast, given NaN or shifted positions;
metadata fields replaced by values of other types or out of range, or deleted).
"""

from __future__ import annotations

import copy
import json
import math
import os
import tempfile
from dataclasses import fields
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mlx_lazy import (PruningConfig, UserInputError, build_schedule, can_trim_prompt_cache,
                      generate_step, load_prompt_cache, make_prompt_cache, save_prompt_cache,
                      trim_prompt_cache)
from mlx_lazy.cache import TOKEN_ARRAYS
from mlx_lazy.prompt_cache_file import INFO_KEYS, META_STATE_KEYS
from mlx_lazy.schedule import Schedule

#: hypothesis examples of the fuzz test (each a save, a load and, when it loads, a short
#: generation: ~0.1 s on the tiny model)
EXAMPLES = 400
FOLLOW_UP = [5, 17, 3, 250]
#: the base files: every kind of state a file can hold (Aux Cache, scoring windows, depth
#: limits, tokens dropped before layer 0, an exact recompute done on save)
BASES = {
    "lazy": PruningConfig("lazy", prune_layers=(0, 1), keep=(0.5, 0.2), complete="none",
                          scorer="window:size=4", revive_margin=0.5, reselect_every=2),
    "random+speed": PruningConfig("random+speed", keep=(0.6,), speed_cutoff=2, anchors=2),
    "exact": PruningConfig("lazy", prune_layers=(1,), keep=(0.4,), complete="exact"),
}


def ids(n: int, seed: int, vocab: int = 384) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")[0]


class Bases(dict):
    """name -> (arrays, metadata object), shown short (hypothesis prints its arguments)."""

    def __repr__(self) -> str:
        return f"Bases({', '.join(self)})"


@pytest.fixture(scope="module")
def bases(model, tmp_path_factory):
    """name -> (arrays, metadata object) of a real saved cache."""
    folder, out = tmp_path_factory.mktemp("bases"), Bases()
    out.model = model
    for i, (name, config) in enumerate(BASES.items()):
        cache = make_prompt_cache(model, config)
        list(generate_step(ids(60, i), model, prompt_cache=cache,
                           max_tokens=0 if name == "exact" else 3))
        path = folder / f"{name}.safetensors"
        save_prompt_cache(path, cache)
        arrays, meta = mx.load(str(path), return_metadata=True)
        out[name] = (arrays, json.loads(meta["mlx_lazy"]))
    assert any(k.startswith("aux.") for k in out["lazy"][0])
    assert any(k.startswith("window.") for k in out["lazy"][0])
    assert (np.array(out["random+speed"][0]["limit"]) == 0).any()
    return out


def write(path: Path, arrays: dict, info) -> Path:
    mx.save_safetensors(str(path), arrays, metadata={"mlx_lazy": json.dumps(info)})
    return path


def assert_consistent(cache, vocab: int) -> None:
    """The invariants of a state that has run: KV exactly below each token's depth, Aux
    Cache rows at their depth, token ids of the vocabulary."""
    c, L = cache.engine.cache, cache.engine.adapter.num_layers
    assert len(cache.tokens) == c.length and all(0 <= t < vocab for t in cache.tokens)
    assert ((0 <= c.depth) & (c.depth <= c.limit) & (c.limit <= L)).all()
    for layer, kv in enumerate(c.layers):
        np.testing.assert_array_equal(np.sort(kv.cached_positions()),
                                      np.flatnonzero(c.depth > layer))
    for d, entry in c.aux.items():
        assert (c.depth[entry.positions] == d).all()
    np.testing.assert_array_equal(c.computed[:, : c.length] > 0,
                                  np.arange(L)[:, None] < c.depth[None, :])


def run(model, path: Path) -> str:
    """Load ``path`` and generate on it: a UserInputError from the load is a pass; anything
    else must be a valid answer on a consistent state. Returns which it was."""
    try:
        cache = load_prompt_cache(path, model)
    except UserInputError as e:
        assert "is corrupt" in str(e) or "not an mlx-lazy prompt cache" in str(e) \
            or "another model" in str(e), e
        assert len(str(e)) < 1000 and "\n" not in str(e)
        return "refused"
    vocab = cache.engine.adapter.vocab_size
    out = list(generate_step(FOLLOW_UP, model, prompt_cache=cache, max_tokens=3))
    assert len(out) == 3
    for token, logprobs in out:
        assert 0 <= int(token) < vocab
        assert mx.all(mx.isfinite(logprobs)).item()
    assert_consistent(cache, vocab)
    return "answered"


# ------------------------------------------------------------------ the issue's cases
def _set(info, *path_value):
    *path, value = path_value
    node = info
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _del(info, *path):
    node = info
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]


def _edit(name, fn):
    """An array edited in numpy."""
    def mutate(arrays, info):
        a = np.array(arrays[name])
        arrays[name] = mx.array(fn(a))
    return mutate


def _at(index, value):
    def fn(a):
        a = a.copy()
        a.reshape(-1)[index] = value
        return a
    return fn


META_CASES = {
    "fingerprint a list": lambda a, i: _set(i, "fingerprint", [1]),
    "schedule a list": lambda a, i: _set(i, "schedule", []),
    "schedule missing": lambda a, i: _del(i, "schedule"),
    "state missing": lambda a, i: _del(i, "state"),
    "state a string": lambda a, i: _set(i, "state", "x"),
    "prompt_len missing": lambda a, i: _del(i, "state", "prompt_len"),
    "prompt_len a float": lambda a, i: _set(i, "state", "prompt_len", 60.0),
    "prompt_len beyond the tokens": lambda a, i: _set(i, "state", "prompt_len", 10**6),
    "prompt_len one beyond the tokens": lambda a, i: _set(i, "state", "prompt_len",
                                                          len(i["tokens"]) + 1),
    "prompt_len negative": lambda a, i: _set(i, "state", "prompt_len", -1),
    "revivals negative": lambda a, i: _set(i, "state", "revivals", -3),
    "revivals true": lambda a, i: _set(i, "state", "revivals", True),
    "state num_layers 5": lambda a, i: _set(i, "state", "num_layers", 5),
    "state unknown key": lambda a, i: _set(i, "state", "extra", 1),
    "tokens a string": lambda a, i: _set(i, "tokens", "abc"),
    "a token a string": lambda a, i: _set(i, "tokens", 0, "7"),
    "a token a float": lambda a, i: _set(i, "tokens", 0, 1.5),
    "a token a bool": lambda a, i: _set(i, "tokens", 0, True),
    "a token null": lambda a, i: _set(i, "tokens", 0, None),
    "a token beyond the vocabulary": lambda a, i: _set(i, "tokens", 0, 384),
    "a token negative": lambda a, i: _set(i, "tokens", 0, -1),
    "a token too many": lambda a, i: i["tokens"].append(3),
    "unknown top-level key": lambda a, i: _set(i, "extra", 1),
    "schedule num_layers 5": lambda a, i: _set(i, "schedule", "num_layers", 5),
    "keep NaN": lambda a, i: _set(i, "schedule", "keep", [math.nan, 0.2]),
    "keep increasing": lambda a, i: _set(i, "schedule", "keep", [0.2, 0.5]),
    "keep above 1": lambda a, i: _set(i, "schedule", "keep", [1.5, 0.2]),
    "keep a string": lambda a, i: _set(i, "schedule", "keep", "0.5"),
    "prompt_depth -5": lambda a, i: _set(i, "schedule", "prompt_depth", -5),
    "prompt_depth NaN": lambda a, i: _set(i, "schedule", "prompt_depth", math.nan),
    "prompt_depth 2 without speed": lambda a, i: _set(i, "schedule", "prompt_depth", 2),
    "prune_layers beyond the model": lambda a, i: _set(i, "schedule", "prune_layers", [0, 3]),
    "prune_layers floats": lambda a, i: _set(i, "schedule", "prune_layers", [0.0, 1.0]),
    "anchors negative": lambda a, i: _set(i, "schedule", "anchors", -1),
    "anchors NaN": lambda a, i: _set(i, "schedule", "anchors", math.nan),
    "seed a float": lambda a, i: _set(i, "schedule", "seed", 1.5),
    "scorer unknown": lambda a, i: _set(i, "schedule", "scorer", "bogus"),
    "scorer size 0": lambda a, i: _set(i, "schedule", "scorer", "window:size=0"),
    "scorer a list": lambda a, i: _set(i, "schedule", "scorer", ["last"]),
    "complete unknown": lambda a, i: _set(i, "schedule", "complete", "sometimes"),
    "complete progressive:0": lambda a, i: _set(i, "schedule", "complete", "progressive:0"),
    "method unknown": lambda a, i: _set(i, "schedule", "method", "lazier"),
    "method a number": lambda a, i: _set(i, "schedule", "method", 7),
    "dynamic false for lazy": lambda a, i: _set(i, "schedule", "dynamic", False),
    "dynamic 1 for true": lambda a, i: _set(i, "schedule", "dynamic", 1),
    "revive a string": lambda a, i: _set(i, "schedule", "revive", "yes"),
    "max_revivals negative": lambda a, i: _set(i, "schedule", "max_revivals", -1),
    "revive_margin negative": lambda a, i: _set(i, "schedule", "revive_margin", -0.5),
    "revive_margin a string": lambda a, i: _set(i, "schedule", "revive_margin", "0.5"),
    "reselect_every 0": lambda a, i: _set(i, "schedule", "reselect_every", 0),
    "reselect_every a float": lambda a, i: _set(i, "schedule", "reselect_every", 2.0),
    "random_keep without random": lambda a, i: _set(i, "schedule", "random_keep", 0.5),
    "source empty": lambda a, i: _set(i, "schedule", "source", ""),
    "schedule unknown field": lambda a, i: _set(i, "schedule", "window", 8),
    "schedule field missing": lambda a, i: _del(i, "schedule", "seed"),
}

def _rows(prefix: str, fn):
    """The entry ``prefix`` (a layer or a row map) with ``fn`` applied to the row indices of
    its positions (its tensors follow)."""
    def mutate(arrays, info):
        rows = fn(np.arange(arrays[f"{prefix}.positions"].shape[0]), info)
        idx = mx.array(np.asarray(rows, np.int32))
        for key in [k for k in arrays if k.startswith(prefix + ".")]:
            a = arrays[key]
            arrays[key] = a[idx] if a.ndim == 1 else (a[:, idx] if key.startswith("aux") or
                                                      key.startswith("stash") else a[:, :, idx])
    return mutate


def _finished_token_limit(arrays, info):
    """The limit of a token computed to the top, set one below its depth."""
    depth, limit = np.array(arrays["depth"]), np.array(arrays["limit"])
    limit[int(np.flatnonzero(depth == depth.max())[0])] = depth.max() - 1
    arrays["limit"] = mx.array(limit)


def _aux_row_of_a_finished_token(arrays, info):
    depth = np.array(arrays["depth"])
    top = int(np.flatnonzero(depth == depth.max())[0])
    arrays["aux.1.positions"] = mx.concatenate([arrays["aux.1.positions"],
                                                mx.array([top], mx.int64)])
    arrays["aux.1.data"] = mx.concatenate([arrays["aux.1.data"], arrays["aux.1.data"][:, :1]],
                                          axis=1)


ARRAY_CASES = {
    "a token's KV left out at layer 1": _rows("layers.1", lambda r, i: r[1:]),
    "a token's KV at layer 1 twice": _rows("layers.1", lambda r, i: np.r_[r, r[:1]]),
    "an aux row twice": _rows("aux.1", lambda r, i: np.r_[r, r[:1]]),
    "an aux row left out": _rows("aux.2", lambda r, i: r[1:]),
    "an aux row of a token that is not waiting": _aux_row_of_a_finished_token,
    "a finished token's limit below its depth": _finished_token_limit,
    "layers.0.keys missing": lambda a, i: a.pop("layers.0.keys"),
    "layer 0 missing": lambda a, i: [a.pop(f"layers.0.{p}") for p in ("keys", "values",
                                                                      "positions")],
    "depth missing": lambda a, i: a.pop("depth"),
    "an aux entry missing": lambda a, i: [a.pop(k) for k in list(a) if k.startswith("aux.1.")],
    "aux data without positions": lambda a, i: a.pop("aux.1.positions"),
    "head dim halved": _edit("layers.1.keys", lambda x: x[..., :8]),
    "kv heads doubled": _edit("layers.1.values", lambda x: np.concatenate([x, x], axis=1)),
    "keys float16": lambda a, i: a.update({"layers.2.keys": a["layers.2.keys"].astype(mx.float16)}),
    "keys a token short": _edit("layers.2.keys", lambda x: x[:, :, 1:]),
    "NaN key": _edit("layers.0.keys", _at(5, np.nan)),
    "inf value": _edit("layers.3.values", _at(0, np.inf)),
    "NaN hidden state": _edit("aux.1.data", _at(3, np.nan)),
    "NaN query": _edit("window.0.data", _at(3, np.nan)),
    "aux hidden size": _edit("aux.2.data", lambda x: x[..., :32]),
    "window heads": _edit("window.1.data", lambda x: x[:, :2]),
    "a position out of range": lambda a, i: _edit("layers.1.positions",
                                                  _at(0, len(i["tokens"])))(a, i),
    "a position negative": _edit("layers.1.positions", _at(0, -1)),
    "a position repeated": _edit("layers.0.positions", lambda x: np.concatenate([x[:1], x[:-1]])),
    "positions float": _edit("layers.0.positions", lambda x: x.astype(np.float32)),
    "positions 2-D": _edit("layers.0.positions", lambda x: x[None]),
    "an aux position of another depth": _edit("aux.2.positions", _at(0, 0)),
    "an aux position beyond": _edit("aux.1.positions", _at(0, 10**9)),
    "limit below depth": _edit("limit", lambda x: np.minimum(x, 1)),
    "depth beyond the model": _edit("depth", lambda x: x + 10),
    "limit beyond the model": _edit("limit", _at(0, 5)),
    "depth negative": _edit("depth", _at(0, -1)),
    "depth float": _edit("depth", lambda x: x.astype(np.float32)),
    "depth uint64 huge": _edit("depth", lambda x: x.astype(np.uint64) + np.uint64(2**63)),
    "depth a token short": _edit("depth", lambda x: x[:-1]),
    "computed negative": _edit("computed", _at(0, -1)),
    "computed a zero below depth": _edit("computed", _at(0, 0)),
    "computed wrong shape": _edit("computed", lambda x: x[:, :-1]),
    "always_kept out of range": _edit("always_kept", _at(0, 10**6)),
    "always_kept at the length": lambda a, i: _edit("always_kept",
                                                    _at(0, len(i["tokens"])))(a, i),
    "window at a layer that does not cut": lambda a, i: a.update(
        {"window.2.data": a["window.0.data"], "window.2.positions": a["window.0.positions"]}),
    "window too long": lambda a, i: a.update(  # 8 queries of a window of 4
        {"window.0.data": mx.concatenate([a["window.0.data"]] * 2, axis=2),
         "window.0.positions": mx.arange(len(i["tokens"]) - 8, len(i["tokens"]))}),
    "a stash under a schedule that keeps none": lambda a, i: a.update(
        {"stash.1.data": a["aux.1.data"], "stash.1.positions": a["aux.1.positions"]}),
    "an unknown array": lambda a, i: a.update({"junk": mx.zeros(3)}),
    "a layer beyond the model": lambda a, i: a.update({"layers.4.keys": a["layers.0.keys"]}),
    "an empty layer": lambda a, i: a.update(
        {"layers.3.keys": mx.zeros((1, 2, 0, 16)), "layers.3.values": mx.zeros((1, 2, 0, 16)),
         "layers.3.positions": mx.zeros((0,), mx.int64)}),
}


@pytest.mark.parametrize("case", sorted(META_CASES) + sorted(ARRAY_CASES))
def test_each_corruption_the_issue_names_is_a_user_error(model, bases, tmp_path, case):
    arrays, info = dict(bases["lazy"][0]), copy.deepcopy(bases["lazy"][1])
    (META_CASES.get(case) or ARRAY_CASES[case])(arrays, info)
    path = write(tmp_path / "c.safetensors", arrays, info)
    with pytest.raises(UserInputError, match=r"^prompt cache .*c\.safetensors is corrupt: "):
        load_prompt_cache(path, model)


def test_random_and_speed_files_keep_their_checks(model, bases, tmp_path):
    """A file of depth limits: its dropped tokens (limit 0) and SPEED's cutoff are checked
    too; the untouched file loads and generates."""
    arrays, info = bases["random+speed"]
    run(model, write(tmp_path / "ok.safetensors", arrays, info))
    for edit in ({"prompt_depth": 5}, {"prompt_depth": 2.0}, {"random_keep": 0.0},
                 {"random_keep": None}, {"keep": [0.6]}, {"scorer": "window:size=4"}):
        bad = copy.deepcopy(info)
        bad["schedule"].update(edit)
        with pytest.raises(UserInputError, match="is corrupt: schedule"):
            load_prompt_cache(write(tmp_path / "c.safetensors", arrays, bad), model)
    limit = np.array(arrays["limit"])
    dropped = int(np.flatnonzero(limit == 0)[0])
    for name, value in (("limit", 3), ("depth", 1)):  # a dropped token come alive, or computed
        a = dict(arrays)
        x = np.array(a[name])
        x[dropped] = value
        a[name] = mx.array(x)
        with pytest.raises(UserInputError, match="is corrupt"):
            load_prompt_cache(write(tmp_path / "c.safetensors", a, info), model)


def test_the_untouched_files_load_and_answer_as_before(model, bases, tmp_path):
    for name, (arrays, info) in bases.items():
        path = write(tmp_path / f"{name}.safetensors", arrays, info)
        run(model, path)
        loaded = load_prompt_cache(path, model)
        assert loaded.schedule == make_prompt_cache(model, BASES[name]).schedule


@pytest.mark.parametrize("name, given, before", [("revive_margin", 0.5, 0.0),
                                                  ("reselect_every", 2, 1)])
def test_a_file_from_before_a_field_loads_with_the_papers_step(model, bases, tmp_path, name,
                                                               given, before):
    """Files written before the field existed were made with the paper's decode step: no
    revive margin (0), a selection at every step (1)."""
    arrays, info = bases["lazy"]
    assert info["schedule"][name] == given
    old = copy.deepcopy(info)
    del old["schedule"][name]
    loaded = load_prompt_cache(write(tmp_path / "old.safetensors", arrays, old), model)
    assert getattr(loaded.schedule, name) == before


def test_the_checks_know_every_field_of_the_state_and_the_schedule():
    """A new piece of state or schedule field must get a check here (prompt_cache_file.py)."""
    assert set(TOKEN_ARRAYS) == {"depth", "limit", "computed", "always_kept"}
    assert META_STATE_KEYS == tuple(make_meta_state_keys())
    assert INFO_KEYS == ("format", "fingerprint", "schedule", "tokens", "state")
    assert {f.name for f in fields(Schedule)} == {
        "method", "num_layers", "prune_layers", "keep", "dynamic", "revive", "complete",
        "max_revivals", "revive_margin", "reselect_every", "scorer", "prompt_depth",
        "random_keep", "anchors", "seed", "source"}


def make_meta_state_keys():
    from mlx_lazy.cache import LazyCache

    return LazyCache(1).meta_state.keys()


# ------------------------------------------------------------------ the fuzz test
JSON_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-10, 70),
    st.sampled_from([2**31, 2**63, 10**30, -2**63]),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.text(max_size=4), st.lists(st.integers(-2, 70), max_size=3),
    st.just({}), st.just({"a": 1}))
DTYPES = [mx.float16, mx.bfloat16, mx.float32, mx.int8, mx.int32, mx.int64, mx.uint64,
          mx.bool_]
SHIFTS = st.sampled_from([-1, 1, 2, -100, 60, 63, 64, 10**9, 2**40])


def _mutate(data, arrays: dict, info: dict) -> None:
    """One random edit of a file's arrays or metadata, in place."""
    kind = data.draw(st.sampled_from(
        ["drop", "drop_entry", "drop_row", "reshape", "cast", "nonfinite", "shift", "repeat",
         "rename", "add", "meta_set", "meta_delete", "meta_set", "shift"]), label="kind")
    names = sorted(arrays)
    entries = sorted({k.rsplit(".", 1)[0] for k in names if k.endswith(".positions")})
    if not names or (kind in ("drop_entry", "drop_row") and not entries):
        return
    if kind == "drop":
        del arrays[data.draw(st.sampled_from(names), label="drop")]
    elif kind == "drop_entry":  # every array of a layer or a row map
        prefix = data.draw(st.sampled_from(entries), label="entry")
        for key in [k for k in names if k.startswith(prefix + ".")]:
            del arrays[key]
    elif kind == "drop_row":  # one token's row of every array of an entry, consistently
        prefix = data.draw(st.sampled_from(entries), label="entry")
        count = arrays[f"{prefix}.positions"].shape[0] if arrays[
            f"{prefix}.positions"].ndim == 1 else 0
        if count:
            row = data.draw(st.integers(0, count - 1), label="row")
            try:
                _rows(prefix, lambda r, i: np.delete(r, row))(arrays, info)
            except (ValueError, IndexError):  # an entry already reshaped: no consistent cut
                pass
    elif kind == "rename":
        name = data.draw(st.sampled_from(names), label="from")
        to = data.draw(st.sampled_from(names + ["layers.3.keys", "aux.3.data", "aux.0.positions",
                                                "stash.2.positions", "window.3.data", "x"]),
                       label="to")
        arrays[to] = arrays.pop(name)
    elif kind == "add":
        name = data.draw(st.sampled_from(["layers.3.positions", "aux.3.positions", "junk",
                                          "window.1.positions", "stash.1.data"]), label="add")
        arrays[name] = mx.array(data.draw(st.lists(st.integers(-1, 70), max_size=4)),
                                mx.int64)
    elif kind in ("reshape", "cast", "nonfinite", "shift", "repeat"):
        name = data.draw(st.sampled_from(names), label="array")
        a = arrays[name]
        if kind == "cast":
            arrays[name] = a.astype(data.draw(st.sampled_from(DTYPES), label="dtype"))
            return
        x = np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)  # numpy has none
        if kind == "reshape" and x.ndim:
            axis = data.draw(st.integers(0, x.ndim - 1), label="axis")
            how = data.draw(st.sampled_from(["cut", "grow", "flat", "axis", "empty"]))
            if how == "cut":
                x = np.take(x, range(max(0, x.shape[axis] - 1)), axis=axis)
            elif how == "grow":
                x = np.concatenate([x, np.take(x, [0], axis=axis)], axis=axis) \
                    if x.shape[axis] else x
            elif how == "flat":
                x = x.reshape(-1)
            elif how == "axis":
                x = x[None]
            else:
                x = np.take(x, [], axis=axis)
        elif x.size and kind == "nonfinite" and x.dtype.kind == "f":
            x = x.copy()
            x.reshape(-1)[data.draw(st.integers(0, x.size - 1))] = data.draw(
                st.sampled_from([np.nan, np.inf, -np.inf]))
        elif x.size and kind == "shift" and x.dtype.kind in "iu":
            x = x.astype(np.int64)
            shift = data.draw(SHIFTS, label="shift")
            if data.draw(st.booleans(), label="all"):
                x = x + shift
            else:
                x.reshape(-1)[data.draw(st.integers(0, x.size - 1))] += shift
        elif x.size > 1 and kind == "repeat":
            x = x.copy()
            flat = x.reshape(-1)
            i, j = data.draw(st.integers(0, x.size - 1)), data.draw(st.integers(0, x.size - 1))
            flat[i] = flat[j]
        arrays[name] = mx.array(x)
    else:  # metadata
        paths = [(k,) for k in info]
        if isinstance(info.get("state"), dict):
            paths += [("state", k) for k in info["state"]]
        if isinstance(info.get("schedule"), dict):
            paths += [("schedule", k) for k in info["schedule"]]
        if isinstance(info.get("tokens"), list) and info["tokens"]:
            paths += [("tokens", data.draw(st.integers(0, len(info["tokens"]) - 1)))]
        if isinstance(info.get("fingerprint"), dict) and "num_layers" in info["fingerprint"]:
            paths += [("fingerprint", "num_layers")]  # an earlier edit may have deleted it
        path = data.draw(st.sampled_from(paths), label="field")
        node = info
        for key in path[:-1]:
            node = node[key]
        if kind == "meta_delete":
            del node[path[-1]]
        else:
            node[path[-1]] = data.draw(JSON_VALUES, label="value")


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_mutated_cache_file_answers_or_is_a_user_error(bases, data):
    name = data.draw(st.sampled_from(sorted(bases)), label="base")
    arrays, info = dict(bases[name][0]), copy.deepcopy(bases[name][1])
    for _ in range(data.draw(st.integers(1, 2), label="edits")):
        _mutate(data, arrays, info)
    with tempfile.TemporaryDirectory() as folder:
        event(run(bases.model, write(Path(folder) / "c.safetensors", arrays, info)))


# ------------------------------------------------------------------ around the file
def test_paths_that_are_not_regular_files_are_refused(model, bases, tmp_path):
    os.mkfifo(tmp_path / "fifo")
    for path, fragment in (("", "is empty"), (tmp_path, "is a folder"),
                           (tmp_path / "fifo", "not a regular file"),
                           (tmp_path / "missing", "does not exist"),
                           (None, "must be a file name"), (0, "must be a file name"),
                           (b"c.safetensors", "must be a file name")):  # 0: no stdin read
        with pytest.raises(UserInputError, match=fragment):
            load_prompt_cache(path, model)


def test_save_refuses_a_destination_that_is_not_a_file_and_keeps_its_own_key(
        model, tmp_path, monkeypatch):
    cache = make_prompt_cache(model, "full")
    cache.process([1, 2, 3])
    os.mkfifo(tmp_path / "fifo")
    monkeypatch.chdir(tmp_path)  # None and 5 were written as files called "None" and "5"
    for dest, fragment in ((tmp_path / "fifo", "not a regular file"),
                           (tmp_path, "is a folder"), ("", "is empty"),
                           (tmp_path / "no" / "c.safetensors", "does not exist"),
                           (None, "must be a file name"), (5, "must be a file name")):
        with pytest.raises(UserInputError, match=fragment):
            save_prompt_cache(dest, cache)
    assert (tmp_path / "fifo").is_fifo()
    with pytest.raises(UserInputError, match="'mlx_lazy' is mlx-lazy's own"):
        save_prompt_cache(tmp_path / "c.safetensors", cache, {"mlx_lazy": "{}"})
    with pytest.raises(UserInputError, match="metadata must be a mapping"):
        save_prompt_cache(tmp_path / "c.safetensors", cache, ["note"])
    for meta in ({"note": 3}, {"x": None}, {3: "a"}):  # once loaded back as "3", "None"
        with pytest.raises(UserInputError, match="mapping of strings to strings"):
            save_prompt_cache(tmp_path / "c.safetensors", cache, meta)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]
    save_prompt_cache(tmp_path / "c.safetensors", cache, {"note": "kept"})
    loaded, meta = load_prompt_cache(tmp_path / "c.safetensors", model, return_metadata=True)
    assert meta == {"note": "kept"} and loaded.tokens == [1, 2, 3]


@pytest.mark.parametrize("not_a_cache", [None, [], "cache", 3])
def test_trim_and_save_take_only_prompt_caches(not_a_cache, tmp_path):
    for call in (lambda: trim_prompt_cache(not_a_cache, 1),
                 lambda: can_trim_prompt_cache(not_a_cache),
                 lambda: save_prompt_cache(tmp_path / "c.safetensors", not_a_cache)):
        with pytest.raises(UserInputError, match="must be an mlx-lazy PromptCache"):
            call()


@pytest.mark.parametrize("not_a_model", ["smollm2-135m", None])
def test_a_cache_is_made_for_a_loaded_model(not_a_model):
    """A model's name given for the model once read "unsupported model type None"."""
    with pytest.raises(UserInputError, match="the model must be one that mlx_lazy.load "
                                             "returns, got (str 'smollm2-135m'|NoneType)"):
        make_prompt_cache(not_a_model)


def test_generation_takes_only_prompt_caches(tiny_model):
    """An mlx-lm cache handed to generate_step once failed with an AttributeError deep in it;
    stream_generate said so in other words."""
    import mlx_lm.models.cache as mlx_lm_cache

    from mlx_lazy import stream_generate

    model, tokenizer = tiny_model("llama")
    for not_a_cache in (mlx_lm_cache.make_prompt_cache(model), "cache"):
        for run in (lambda: next(generate_step([1, 2, 3], model, prompt_cache=not_a_cache)),
                    lambda: next(stream_generate(model, tokenizer, "hi",
                                                 prompt_cache=not_a_cache))):
            with pytest.raises(UserInputError, match="prompt_cache must be an mlx-lazy "
                                                     "PromptCache .* got "):
                run()


def test_the_cli_reports_a_corrupt_file_in_one_line(tiny_model_path, bases, tmp_path, capsys):
    from mlx_lazy import cli

    arrays, info = dict(bases["lazy"][0]), copy.deepcopy(bases["lazy"][1])
    info["schedule"]["prompt_depth"] = -5
    path = write(tmp_path / "c.safetensors", arrays, info)
    code = cli.main(["--model", str(tiny_model_path), "--ignore-chat-template", "-p", "hi",
                     "-m", "2", "--prompt-cache-file", str(path)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: prompt cache") and "is corrupt: schedule" in lines[0]


# ------------------------------------------------------------------ bounded messages
BIG = 400_000
OWN = 300  # config.py's own messages: a value shown in at most SHOWN characters


@pytest.mark.parametrize("fields_, bound", [
    # the policies' message once quoted all 400,000 layers (3 MB)
    ({"method": "lazy", "prune_layers": tuple(range(BIG)), "keep": (0.5,) * BIG}, None),
    ({"method": ["lazy"] * BIG}, None),  # quoted by the policies
    ({"method": "lazy", "complete": "x" * BIG}, None),  # quoted by the completion modes
    ({"method": "lazy", "revive": list(range(BIG))}, OWN),
    ({"method": "lazy", "quality": "q" * BIG}, OWN),
    ({"method": "lazy", "anchors": [1] * BIG}, OWN),
    ({"method": "lazy+speed", "speed_cutoff": [1] * BIG}, OWN),
    ({"method": "lazy", "source": ["x"] * BIG}, OWN),
    ({"method": "lazy", "prune_layers": (1,), "keep": ["x" * BIG]}, OWN),
    ({"method": "lazy", "prune_layers": "1" * BIG}, OWN),
], ids=["prune_layers", "method", "complete", "revive", "quality", "anchors", "speed_cutoff",
        "source", "keep", "not-a-sequence"])
def test_a_config_error_quotes_a_huge_value_in_a_few_hundred_characters(fields_, bound):
    from mlx_lazy.config import MESSAGE_LIMIT

    with pytest.raises(UserInputError) as e:
        build_schedule(PruningConfig(**fields_), 30)
    assert 20 < len(str(e.value)) <= (bound or MESSAGE_LIMIT), len(str(e.value))
