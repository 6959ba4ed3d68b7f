"""The invariant matrix, in the kvpress way: every registered method (``METHODS``) x every
completion mode its policies take (``COMPLETIONS``; only LazyLLM's cuts take one) x every
operation on a prompt cache (prefill, a follow-up chunk, decode steps, trim, save/load, copy),
each checked against the engine's invariants after the operation:

* each (token, layer) is computed at most once (twice with ``exact``, which recomputes the kept
  tokens' upper layers once), and exactly the layers below its depth;
* a token has KV at layer l iff its depth is above l; depth <= limit; the Aux Cache at depth d
  holds tokens of depth d that may go deeper, and every token that may go deeper is there;
  no position at or beyond the cache's length anywhere (after trim too);
* each layer's cached positions are unique and its slot map is their inverse;
* ``full`` is mlx-lm: greedy tokens and first-token logits, after a follow-up chunk too, and a
  trimmed cache continues as one built on the shorter prefix;
* a copy is independent both ways; save -> load gives the same state arrays and next logits.

Tiny random models, short prompts, a few decode steps: the whole file runs in well under a
minute.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.models.cache import make_prompt_cache as mlx_lm_make_prompt_cache

from mlx_lazy import (METHODS, PruningConfig, UserInputError, build_schedule, generate_step,
                      load_prompt_cache, make_prompt_cache, save_prompt_cache, trim_prompt_cache)
from mlx_lazy.completion import COMPLETIONS, parse_completion
from numerics import rel_err

# Two float32 paths over the same tokens that differ only in how the work is chunked agree to
# ~1e-6 of the logits' scale (as in test_prompt_cache).
REL_TOL = 1e-4
KIND = "llama"
NUM_LAYERS = 4  # the tiny models' depth
PROMPT, CHUNK, MORE = 150, 40, 15  # first prompt, follow-up chunk, tokens after a trim/copy/load
DECODE = 4  # generated tokens per turn


def _mode_specs() -> list:
    """Every completion mode by a spec: its name, or ``name:3`` for one that takes a budget."""
    specs = []
    for name in COMPLETIONS:
        try:
            parse_completion(name)
            specs.append(name)
        except UserInputError:
            specs.append(f"{name}:3")
    return specs


MODES = _mode_specs()


class Combo(NamedTuple):
    """One row of the matrix: a method, its completion mode (None: the method takes none),
    and further fields for LazyLLM (revive=False, a scorer, max_revivals)."""

    method: str
    mode: Optional[str]
    options: Tuple[Tuple[str, Any], ...] = ()

    @property
    def id(self) -> str:
        return "/".join([self.method] + ([self.mode] if self.mode else [])
                        + [f"{k}={v}" for k, v in self.options])

    @property
    def exact(self) -> bool:
        return self.mode == "exact"

    @property
    def revive(self) -> bool:
        return dict(self.options).get("revive", True)

    def config(self) -> PruningConfig:
        """The method's preset; LazyLLM with two cuts (so tokens wait at two depths), the
        mode and the options."""
        if self.mode is None and not self.options:
            return PruningConfig.preset(self.method)
        fields = {"prune_layers": (0, 1), "keep": (0.5, 0.25), **dict(self.options)}
        if self.mode is not None:
            fields["complete"] = self.mode
        return PruningConfig.preset(self.method, **fields)


def _takes_complete(method: str) -> bool:
    try:
        build_schedule(PruningConfig(method=method, complete="none"), NUM_LAYERS)
        return True
    except UserInputError:
        return False


#: Every legal (method, mode), plus LazyLLM without revival (no token ever waits; decode
#: chooses only among tokens that have KV), with a window scorer (several scoring queries
#: kept per cut), with a revival budget per decode step and with a choice held 3 steps.
COMBOS = [Combo(m, c) for m in METHODS for c in (MODES if _takes_complete(m) else [None])]
COMBOS += [Combo(m, None, (("revive", False),)) for m in METHODS if _takes_complete(m)]
COMBOS += [Combo("lazy", "none", (("scorer", "window:size=8"),)),
           Combo("lazy", "exact", (("scorer", "window:size=8"),)),
           Combo("lazy", "none", (("max_revivals", 2),)),
           Combo("lazy", "none", (("reselect_every", 3),)),
           Combo("lazy", "promote:60", (("max_revivals", 2),))]  # promote:3 promotes nothing


def test_the_matrix_covers_every_method_and_mode():
    methods = {c.method for c in COMBOS}
    assert methods == set(METHODS)
    lazy = [m for m in METHODS if _takes_complete(m)]
    assert lazy and all("lazy" in m for m in lazy)
    for m in lazy:
        assert {c.mode for c in COMBOS if c.method == m and not c.options} == set(MODES)
        for c in MODES:
            schedule = build_schedule(Combo(m, c).config(), NUM_LAYERS)
            assert schedule.completion == parse_completion(c)
    for m in set(METHODS) - set(lazy):  # the others refuse any mode but the default's
        for c in MODES:
            if c != PruningConfig().complete:
                with pytest.raises(UserInputError):
                    build_schedule(PruningConfig(method=m, complete=c), NUM_LAYERS)


def ids(n: int, seed: int, vocab: int = 384) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def gen(model, cache, tokens, k):
    """Greedy ``generate_step`` on ``cache``: the (token, logprobs) pairs."""
    return list(generate_step(tokens, model, prompt_cache=cache, max_tokens=k))


def snapshot(cache) -> dict:
    """The state arrays (``LazyCache.state``) as numpy, plus the scalars and token ids."""
    state = cache.engine.cache
    arrays = {k: np.array(v) for k, v in state.state.items()}
    return {"arrays": arrays, "meta": dict(state.meta_state), "tokens": list(cache.tokens)}


def assert_same_state(a: dict, b: dict) -> None:
    assert a["meta"] == b["meta"] and a["tokens"] == b["tokens"]
    assert sorted(a["arrays"]) == sorted(b["arrays"])
    for k in a["arrays"]:
        np.testing.assert_array_equal(a["arrays"][k], b["arrays"][k], err_msg=k)


def check_invariants(cache, exact: bool) -> None:
    """Every invariant of a prompt cache's state (see the module docstring)."""
    engine, c = cache.engine, cache.engine.cache
    L, n = c.num_layers, c.length
    assert len(cache.tokens) == n
    assert c.depth.shape == c.limit.shape == (n,)
    assert c.computed.shape[0] == L and c.computed.shape[1] >= n
    assert not c.computed[:, n:].any(), "counts kept beyond the cache's length"
    assert ((0 <= c.depth) & (c.depth <= c.limit) & (c.limit <= L)).all()
    # each (token, layer) at most once where promised, and exactly the layers below its depth
    bound = 2 if exact else 1
    assert engine.stats.max_computations_per_token_layer <= bound
    assert c.computed[:, :n].max(initial=0) <= bound
    below = np.arange(L)[:, None] < c.depth[None, :]
    np.testing.assert_array_equal(c.computed[:, :n] > 0, below)
    # KV at layer l iff depth > l; unique positions; slot map their inverse
    for layer, kv in enumerate(c.layers):
        pos = kv.cached_positions()
        assert len(np.unique(pos)) == len(pos), f"layer {layer}: a position cached twice"
        assert ((0 <= pos) & (pos < n)).all(), f"layer {layer}: a position beyond the cache"
        np.testing.assert_array_equal(np.sort(pos), np.flatnonzero(c.depth > layer),
                                      err_msg=f"layer {layer}: KV is not where depth says")
        if kv.size:
            assert kv.keys.shape[2] >= kv.size and kv.values.shape[2] >= kv.size
        np.testing.assert_array_equal(kv.slot_of[pos], np.arange(kv.size))
        stale = np.ones(len(kv.slot_of), bool)
        stale[pos] = False
        assert (kv.slot_of[stale] == -1).all(), f"layer {layer}: slot map names a lost token"
    # the Aux Cache: tokens waiting at their depth, each once; every token that may go on
    waiting = []
    for d, entry in c.aux.items():
        assert 0 < d < L and len(entry.positions)
        assert entry.data.shape[1] == len(entry.positions)
        assert (entry.positions < n).all()
        assert (c.depth[entry.positions] == d).all(), f"Aux Cache {d}: a token of another depth"
        assert (c.limit[entry.positions] > d).all(), f"Aux Cache {d}: a token that cannot go on"
        waiting += entry.positions.tolist()
    assert len(set(waiting)) == len(waiting), "a token waits twice"
    may_go_on = np.flatnonzero((c.depth < c.limit) & (c.depth > 0))
    assert set(waiting) == set(may_go_on.tolist()), "a token that may go on has no hidden state"
    assert not (c.depth[c.limit > 0] == 0).any(), "a live token was never computed"
    if not engine.schedule.revive:
        assert not c.aux
    # the stash (exact only) and the scoring windows
    if c.stash:
        assert exact and len(c.stash) == 1
    for name in ("stash", "window"):
        axis = 1 if name == "stash" else 2
        for key, entry in getattr(c, name).items():
            assert 0 < key <= L if name == "stash" else 0 <= key < L
            assert entry.data.shape[axis] == len(entry.positions)
            assert len(np.unique(entry.positions)) == len(entry.positions)
            assert ((0 <= entry.positions) & (entry.positions < n)).all(), \
                f"{name} {key}: a position beyond the cache"
    assert ((0 <= c.always_kept) & (c.always_kept < n)).all()
    assert 0 <= c.prompt_len <= n


def assert_exact_is_full(model, cache) -> None:
    """``exact`` without a depth limit: once completed, a decode step is the unpruned model's
    (its next-token logits those of ``full`` over the same tokens)."""
    token = 7
    want = make_prompt_cache(model, "full").process(cache.tokens + [token])
    got = cache.engine.decode(token)
    cache.tokens.append(token)
    assert rel_err(got, want) < REL_TOL
    assert not cache.engine.cache.aux and not cache.engine.cache.stash


def exact_without_limits(combo) -> bool:
    return combo.exact and combo.method == "lazy"


# ------------------------------------------------------------------- scenarios
@pytest.fixture
def model(tiny_model):
    return tiny_model(KIND)[0]


def _prefilled(model, combo):
    cache = make_prompt_cache(model, combo.config())
    logits = cache.process(ids(PROMPT, 0))
    return cache, logits


def _two_turns(model, combo, decode_after_chunk: bool = True):
    """A prompt and its answer, then a follow-up chunk and (``decode_after_chunk``) its
    answer: the state the other operations start from."""
    exact = combo.exact
    cache = make_prompt_cache(model, combo.config())
    assert len(gen(model, cache, ids(PROMPT, 0), DECODE)) == DECODE
    check_invariants(cache, exact)
    if decode_after_chunk:
        assert len(gen(model, cache, ids(CHUNK, 2), DECODE)) == DECODE
    else:
        cache.process(ids(CHUNK, 2))
    check_invariants(cache, exact)
    return cache


@pytest.fixture(params=COMBOS, ids=[c.id for c in COMBOS])
def combo(request):
    return request.param


def test_prefill(model, combo):
    cache, logits = _prefilled(model, combo)
    check_invariants(cache, combo.exact)
    state = cache.engine.cache
    assert logits.shape == (model.args.vocab_size,)
    assert state.prompt_len == PROMPT and (state.depth[-1:] == NUM_LAYERS).all()
    if combo.method == "full":
        assert (state.depth == NUM_LAYERS).all()


def test_extend(model, combo):
    cache = _two_turns(model, combo, decode_after_chunk=False)
    state = cache.engine.cache
    assert state.prompt_len == state.length == PROMPT + DECODE + CHUNK
    assert state.depth[-1] == NUM_LAYERS  # the chunk's last token produces the next one
    mode, revive = combo.mode, combo.revive
    if mode is not None:  # the scenario exercises what it checks: tokens wait, exact stashes
        assert state.aux
        assert bool(state.stash) == (mode == "exact")
    if combo.method != "full" and not (mode is not None and revive):
        assert (state.limit < NUM_LAYERS).any()  # stopped for good


def test_decode(model, combo):
    """Decode steps after the prompt and after a follow-up chunk."""
    mode, exact = combo.mode, combo.exact
    cache = make_prompt_cache(model, combo.config())
    for turn, n in enumerate((PROMPT, CHUNK)):
        assert len(gen(model, cache, ids(n, 10 + turn), DECODE)) == DECODE
        check_invariants(cache, exact)
        state = cache.engine.cache
        if mode in ("after-first", "exact"):  # completed before the first decode step
            assert not state.aux and not state.stash
            assert (state.depth == state.limit).all()
        elif mode is not None:  # the paper's decode and progressive revive what they select
            assert state.revivals > 0 and state.aux
    assert cache.engine.cache.length == PROMPT + CHUNK + 2 * DECODE
    if exact_without_limits(combo):
        assert_exact_is_full(model, cache)
        check_invariants(cache, exact)


@pytest.mark.parametrize("where", ["chunk", "prompt", "nothing", "all"])
@pytest.mark.parametrize("decoded", [True, False], ids=["after-decode", "after-chunk"])
def test_trim(model, combo, where, decoded):
    """Trim into the follow-up chunk, into the first prompt, nothing or everything; before
    the decode after the chunk (exact's stash, after-first's waiting tokens still there) or
    after it."""
    method, exact = combo.method, combo.exact
    cache = _two_turns(model, combo, decode_after_chunk=decoded)
    keep = {"chunk": PROMPT + DECODE + CHUNK // 2, "prompt": PROMPT // 2,
            "nothing": len(cache), "all": 0}[where]
    tokens = list(cache.tokens[:keep])
    drop = len(cache) - keep
    assert trim_prompt_cache(cache, drop) == drop
    assert cache.tokens == tokens
    check_invariants(cache, exact)
    more = ids(MORE, 20)
    logits = cache.process(more)
    check_invariants(cache, exact)
    if method == "full":
        fresh = make_prompt_cache(model, "full")
        want = fresh.process(tokens + more)
        assert rel_err(logits, want) < REL_TOL
    assert len(gen(model, cache, ids(1, 21), DECODE)) == DECODE
    check_invariants(cache, exact)
    if exact_without_limits(combo):
        assert_exact_is_full(model, cache)


@pytest.mark.parametrize("decoded", [True, False], ids=["after-decode", "after-chunk"])
def test_save_load(model, combo, decoded, tmp_path):
    exact = combo.exact
    cache = _two_turns(model, combo, decode_after_chunk=decoded)
    path = tmp_path / "cache.safetensors"
    save_prompt_cache(path, cache)
    check_invariants(cache, exact)  # saving may finish exact's recompute, in place
    loaded = load_prompt_cache(path, model)
    assert loaded.schedule == cache.schedule
    assert_same_state(snapshot(loaded), snapshot(cache))
    check_invariants(loaded, exact)
    more = ids(MORE, 30)
    a, b = cache.process(more), loaded.process(more)
    assert rel_err(b, a) < REL_TOL
    assert_same_state(snapshot(loaded), snapshot(cache))
    ga, gb = gen(model, cache, ids(1, 31), DECODE), gen(model, loaded, ids(1, 31), DECODE)
    assert [t for t, _ in ga] == [t for t, _ in gb]
    check_invariants(loaded, exact)
    if exact_without_limits(combo):
        assert_exact_is_full(model, loaded)


@pytest.mark.parametrize("decoded", [True, False], ids=["after-decode", "after-chunk"])
def test_copy(model, combo, decoded):
    """Generating on a copy leaves the original as it was, and the other way round; both
    continue alike."""
    exact = combo.exact
    cache = _two_turns(model, combo, decode_after_chunk=decoded)
    before = snapshot(cache)
    copy = cache.copy()
    assert_same_state(snapshot(copy), before)
    check_invariants(copy, exact)
    more = ids(MORE, 40)
    on_copy = gen(model, copy, more, DECODE)
    check_invariants(copy, exact)
    assert_same_state(snapshot(cache), before)
    after_copy = snapshot(copy)
    on_original = gen(model, cache, more, DECODE)
    check_invariants(cache, exact)
    assert_same_state(snapshot(copy), after_copy)
    assert [t for t, _ in on_copy] == [t for t, _ in on_original]
    assert rel_err(on_copy[0][1], on_original[0][1]) < REL_TOL
    assert_same_state(snapshot(cache), after_copy)
    if exact_without_limits(combo):
        assert_exact_is_full(model, copy)
    # a trim on a copy leaves the original alone too
    again = cache.copy()
    trim_prompt_cache(again, len(again) - PROMPT // 2)
    assert_same_state(snapshot(cache), after_copy)


# ------------------------------------------------------------- full is mlx-lm
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_full_equals_mlx_lm_over_a_follow_up_chunk(tiny_model, kind):
    """``full`` against mlx-lm's generate_step with its own cache: the same greedy tokens and
    first-token logits on the prompt and after a follow-up chunk; each (token, layer) once."""
    model, _ = tiny_model(kind)
    ours, theirs = make_prompt_cache(model, "full"), mlx_lm_make_prompt_cache(model)
    conversation: list[int] = []
    for turn, n in enumerate((PROMPT, CHUNK)):
        conversation += ids(n, 50 + turn)
        mine = gen(model, ours, conversation[len(ours):], DECODE + 2)
        ref = list(mlx_lm_generate_step(mx.array(conversation[theirs[0].offset:]), model,
                                        prompt_cache=theirs, max_tokens=DECODE + 2))
        assert [t for t, _ in mine] == [t for t, _ in ref]
        assert rel_err(mine[0][1], ref[0][1]) < REL_TOL
        conversation += [t for t, _ in mine]
        check_invariants(ours, exact=False)
        assert ours.engine.stats.max_computations_per_token_layer == 1
    assert ours.tokens == conversation[:len(ours)] and len(ours) == theirs[0].offset
