"""Selection rules pinned: every registered scorer against an independent numpy reference,
planted keys, windows, pooling spans, exact top-k sizes, and keep 1.0 == full."""

import json
from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import numpy as np
import pytest

from mlx_lazy import (LazyEngine, PruningConfig, UserInputError, build_schedule, cli,
                      read_schedule, resolve_config)
from mlx_lazy.adapter import ModelAdapter
from mlx_lazy.bench.methods import method_spec, parse_method
from mlx_lazy.schedule_files import write_schedule
from mlx_lazy.scorers import (SCORERS, LastQuery, Pooled, Scorer, ScoreContext, ScoreMemo,
                              Window, parse_scorer, pool_by_position, scorer_spec, top_k)
from numerics import rel_err

SCORER_SPECS = ["last", "last:heads=max", "window:size=6", "window:size=6:heads=max"]


def test_every_registered_scorer_is_covered():
    assert {spec.split(":")[0] for spec in SCORER_SPECS} == set(SCORERS)


def window_of(spec):
    """The trailing prompt tokens a scorer's queries come from and always keeps (0: none)."""
    scorer = parse_scorer(spec)
    return scorer.size if hasattr(scorer, "size") else 0


def random_prompt(n, vocab, seed=0):
    return mx.array(np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32))


def reference_scores(q, k, scale, qpos, kpos, heads, softcap=None):
    """numpy: per query row, causal softmax over keys (of logits soft-capped by ``softcap``
    when given: Gemma 2); reduce heads; mean over rows."""
    q, k = np.array(q)[0], np.array(k)[0]  # (H, m, d), (G, n, d)
    rep = q.shape[0] // k.shape[0]
    rows = []
    for r, p in enumerate(qpos):
        probs = []
        for h in range(q.shape[0]):
            logits = k[h // rep] @ q[h, r] * scale
            if softcap:
                logits = np.tanh(logits / softcap) * softcap
            logits = np.where(kpos <= p, logits, -np.inf)
            w = np.exp(logits - logits.max())
            probs.append(w / w.sum())
        probs = np.stack(probs)
        rows.append(probs.mean(0) if heads == "mean" else probs.max(0))
    return np.mean(rows, axis=0)


def reference_selection(scores, n, keep, forced):
    k = max(round(keep * n), len(forced))
    order = sorted(range(n), key=lambda i: (i not in forced, -scores[i]))
    return sorted(order[:k])


@pytest.mark.parametrize("spec", SCORER_SPECS)
@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2"])
def test_prefill_selection_matches_numpy_reference(tiny_model, kind, spec):
    """The tokens kept after the first cut are exactly the top-k of an independently
    computed score (so random scores, a wrong head reduction or a wrong window fail; Gemma
    2's from its soft-capped logits)."""
    model, _ = tiny_model(kind)
    n, keep = 160, 0.3
    prompt = random_prompt(n, model.args.vocab_size, seed=11)
    engine = LazyEngine(model, resolve_config(
        model, PruningConfig("lazy", prune_layers=(0,), keep=(keep,), scorer=spec)))
    mx.eval(engine.prefill(prompt))
    kept = sorted(engine.cache.layers[1].cached_positions().tolist())

    a = engine.adapter
    positions = np.arange(n)
    q, k, _, _ = a.qkv(0, a.embed(prompt), positions)
    w = max(1, window_of(spec))
    scores = reference_scores(q[:, :, -w:], k, a.scale, positions[-w:], positions,
                              parse_scorer(spec).heads, a.softcap(0))
    forced = {0, n - 1} | set(range(n - w, n))
    assert kept == reference_selection(scores, n, keep, forced)
    assert len(kept) == round(keep * n)


@pytest.mark.parametrize("spec", SCORER_SPECS)
@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_decode_selection_matches_numpy_reference(tiny_model, kind, spec):
    """At a decode step a scorer scores with its window of the latest tokens' queries, the
    newest token's last (``last``: that one alone), over the layer's cache (a window's
    weights kept from step to step, :class:`ScoreMemo`; Gemma 2's soft-capped)."""
    model, _ = tiny_model(kind)
    n, keep = 120, 0.4
    prompt = random_prompt(n, model.args.vocab_size, seed=12)
    # none: nothing completes, so the decode step selects
    config = PruningConfig("lazy", prune_layers=(0,), keep=(keep,), scorer=spec,
                           complete="none")
    engine = LazyEngine(model, resolve_config(model, config))
    token = int(mx.argmax(engine.prefill(prompt)))
    before = engine.cache.layers[1].cached_positions().copy()
    mx.eval(engine.decode(token))

    a = engine.adapter
    kv = engine.cache.layers[0]
    keys, _ = kv.fetch()
    kpos = kv.cached_positions()
    w = window_of(spec)
    qpos = np.arange(n + 1)[-max(1, w):]  # the window slides onto the generated token
    everything = mx.concatenate([prompt, mx.array([token], prompt.dtype)])
    q, _, _, _ = a.qkv(0, a.embed(everything), np.arange(n + 1))
    scores = reference_scores(q[:, :, mx.array(qpos)], keys, a.scale, qpos, kpos,
                              parse_scorer(spec).heads, a.softcap(0))
    by_pos = dict(zip(kpos.tolist(), scores))
    forced = {0, n} | set(range(n - w, n))
    selected = reference_selection([by_pos[i] for i in range(n + 1)], n + 1, keep, forced)
    # Layer 1 now holds the prefill selection, the new token and the revived tokens.
    assert sorted(engine.cache.layers[1].cached_positions().tolist()) == sorted(
        set(before.tolist()) | set(selected))


@pytest.mark.parametrize("spec", SCORER_SPECS)
def test_planted_key_is_always_kept(spec):
    """A key aligned with every query is the most attended token: it survives a 5% cut."""
    rng = np.random.default_rng(0)
    heads, kv_heads, n, d, m = 4, 2, 200, 16, max(1, window_of(spec))
    q = rng.standard_normal((1, heads, m, d)).astype(np.float32) * 0.1
    k = rng.standard_normal((1, kv_heads, n, d)).astype(np.float32) * 0.1
    planted = 37
    k[0, :, planted] = 5 * q[0, ::2].mean(axis=1)  # one direction per key head
    kpos = np.arange(n)
    ctx = ScoreContext(layer=3, queries=mx.array(q), query_positions=kpos[-m:],
                       keys=mx.array(k), key_positions=kpos, candidates=np.ones(n, bool),
                       visible=None, scale=d ** -0.5)
    scorer = parse_scorer(spec)
    scores = scorer.score(ctx)
    assert int(np.argmax(scores)) == planted
    kept = kpos[np.array(top_k(scores, kpos, np.ones(n, bool),
                               np.isin(kpos, scorer.always_kept(n)), 10))]
    assert planted in kept


@pytest.mark.parametrize("spec", ["window:size=6", "window:size=6:heads=max",
                                  "window:size=6:pool=2"])
def test_memo_scores_equal_fresh_ones_step_after_step(spec):
    """Decode steps scoring through a :class:`ScoreMemo` (rows and columns carried over)
    against the scorer's fresh computation at each step: the window slides, the keys gain
    the new token and revived old tokens (slots out of position order, one far above its
    rows' maxima, so the cap acts), and the visible keys change every step; the window
    grows for the first steps, and the keys outgrow the memo's table twice."""
    rng = np.random.default_rng(4)
    heads, kv_heads, d, m, n0 = 4, 2, 16, 6, 60
    scorer, memo = parse_scorer(spec), ScoreMemo()
    memo.step = 4  # 51 keys at first (room for 52), 59 at the end: it grows at steps 2 and 4
    queries = rng.standard_normal((1, heads, n0 + 8, d)).astype(np.float32)
    keys = rng.standard_normal((1, kv_heads, n0 + 8, d)).astype(np.float32)
    keys[0, :, 5] = 40 * queries[0, ::2, n0 - 3:].mean(axis=1)  # revived at step 2: huge
    kpos = rng.permutation(np.arange(10, n0))  # cached out of order; 0..9 pruned for now
    revive = {2: [5, 1], 4: [7]}
    for step in range(6):
        newest = n0 + step
        kpos = np.concatenate([kpos, revive.get(step, []), [newest]]).astype(np.int64)
        qpos = np.arange(newest - min(m, 3 + step) + 1, newest + 1)
        visible = rng.random(len(kpos)) < 0.7
        visible[-1] = True
        args = dict(layer=1, queries=mx.array(queries[:, :, qpos]), query_positions=qpos,
                    keys=mx.array(keys[:, :, kpos]), key_positions=kpos,
                    candidates=visible, visible=visible, scale=d ** -0.5)
        fresh = np.array(scorer.score(ScoreContext(**args)))
        carried = np.array(scorer.score(ScoreContext(**args, memo=memo)))
        assert rel_err(carried[visible], fresh[visible]) < 1e-5, step
        assert memo.keys == len(kpos) and sorted(memo.positions) == qpos.tolist()


def test_window_scorer_keeps_its_window_at_every_cut(tiny_model):
    model, _ = tiny_model("qwen2")
    n, window = 200, 12
    engine = LazyEngine(model, resolve_config(
        model, PruningConfig("lazy", prune_layers=(0, 1), keep=(0.2, 0.1),
                             scorer=f"window:size={window}")))
    token = int(mx.argmax(engine.prefill(random_prompt(n, model.args.vocab_size, seed=5))))
    mx.eval(engine.decode(token))
    for layer in (1, 2):
        kept = set(engine.cache.layers[layer].cached_positions().tolist())
        assert set(range(n - window, n)) <= kept


def kept_by_top_k(positions, scores, candidates, forced, k):
    """Sorted positions :func:`top_k` keeps (its device mask read back)."""
    return sorted(positions[np.array(top_k(mx.array(scores), positions, candidates, forced, k))])


def reference_top_k(positions, scores, candidates, forced, k):
    """The definition: candidates ranked by score (forced first), ties by lower position."""
    pos, sc, fo = positions[candidates], scores[candidates], forced[candidates]
    k = min(len(pos), max(int(fo.sum()), k, 1))
    ranked = np.lexsort((pos, -np.where(fo, np.inf, sc)))
    return sorted(pos[ranked[:k]])


def test_top_k_ties_go_to_the_lower_position():
    """Integer-valued scores tie by the hundred: the k kept are the best by score, then by
    lower position (argpartition alone keeps an arbitrary subset of the ties)."""
    rng = np.random.default_rng(0)
    n, k = 1000, 300
    positions = rng.permutation(n) * 3  # in no particular order
    scores = rng.integers(0, 10, n).astype(np.float32)
    forced = np.isin(positions, [6, 2997])  # kept whatever their scores
    every = np.ones(n, bool)
    ranked = np.lexsort((positions, -np.where(forced, np.inf, scores)))
    assert kept_by_top_k(positions, scores, every, forced, k) == sorted(positions[ranked[:k]])
    assert kept_by_top_k(positions, scores, every, forced, 1) == [6, 2997]  # never fewer


@pytest.mark.parametrize("seed", range(6))
def test_top_k_over_some_candidates_equals_the_definition(seed):
    """Masked candidates, ties, forced entries and k past the candidates: the device
    selection keeps exactly what the ranking definition keeps, never a non-candidate."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 400))
    positions = rng.permutation(n) * 2 + 1
    scores = rng.integers(0, 4 + seed, n).astype(np.float32) / 7
    candidates = rng.random(n) < rng.uniform(0.05, 1.0)
    forced = candidates & (rng.random(n) < 0.05)
    for k in (0, 1, 5, n // 3, n, 2 * n):
        if not candidates.any():
            assert kept_by_top_k(positions, scores, candidates, forced, k) == []
            continue
        assert kept_by_top_k(positions, scores, candidates, forced, k) == reference_top_k(
            positions, scores, candidates, forced, k)


@pytest.mark.parametrize("keep", [0.5, 0.237, 0.05])
def test_top_k_sizes_are_exact(tiny_model, keep):
    model, _ = tiny_model("llama")
    n, steps = 150, 3
    # none: nothing completes, so every decode step selects
    engine = LazyEngine(model, resolve_config(model, PruningConfig(
        "lazy", prune_layers=(0,), keep=(keep,), complete="none")))
    sizes, select = [], engine.selector.on_host
    engine.selector.on_host = lambda *a, **kw: sizes.append(len((r := select(*a, **kw))[0])) or r
    token = int(mx.argmax(engine.prefill(random_prompt(n, model.args.vocab_size, seed=6))))
    for _ in range(steps):
        token = int(mx.argmax(engine.decode(token)))
    assert sizes == [round(keep * (n + i)) for i in range(steps + 1)]
    assert engine.stats.prefill_tokens_per_layer[1] == round(keep * n)


@pytest.mark.parametrize("spec", SCORER_SPECS)
def test_keep_everything_at_every_cut_equals_full(tiny_model, spec):
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = tiny_model("llama")
    prompt = random_prompt(100, model.args.vocab_size, seed=7)
    layers = model.args.num_hidden_layers
    config = PruningConfig("lazy", prune_layers=tuple(range(layers - 1)),
                           keep=(1.0,) * (layers - 1), scorer=spec)
    engine = LazyEngine(model, resolve_config(model, config))
    cache = make_prompt_cache(model)
    ref, ours = model(prompt[None], cache=cache)[0, -1], engine.prefill(prompt)
    for _ in range(8):
        assert rel_err(ours, ref) < 1e-5  # unpruned: mlx-lm's sums in another order
        token = int(mx.argmax(ref))
        ref, ours = model(mx.array([[token]]), cache=cache)[0, -1], engine.decode(token)
    assert engine.stats.revivals == 0


def test_pooling_spreads_scores_to_neighbours_in_position_order():
    positions = np.array([7, 1, 3, 2, 9, 4])
    scores = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 1.0])  # position 4 is the peak
    pooled = np.array(pool_by_position(positions, scores, 1))
    # In position order 1,2,3,4,7,9 the neighbours of 4 are 3 and 7.
    assert dict(zip(positions.tolist(), pooled.tolist())) == {1: 0, 2: 0, 3: 1, 4: 1, 7: 1, 9: 0}


def test_pooled_selection_keeps_spans(tiny_model):
    model, _ = tiny_model("llama")
    n = 300
    prompt = random_prompt(n, model.args.vocab_size, seed=10)

    def kept_after_first_cut(pool):
        engine = LazyEngine(model, resolve_config(
            model, PruningConfig("lazy", prune_layers=(0,), keep=(0.2,),
                                 scorer=f"last:pool={pool}")))
        mx.eval(engine.prefill(prompt))
        return np.array(sorted(engine.cache.layers[1].cached_positions().tolist()))

    def isolated(kept):  # kept tokens with neither neighbour kept
        s = set(kept.tolist())
        return sum(1 for p in s if p - 1 not in s and p + 1 not in s)

    plain, pooled = kept_after_first_cut(0), kept_after_first_cut(2)
    assert len(plain) == len(pooled) == 60
    assert isolated(pooled) < isolated(plain)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nope", "unknown scorer"),
        ("last:heads=median", "heads must be one of"),
        ("window:size=0", "size must be an integer in [1,"),
        ("last:size=4", "scorer 'last' has no field 'size'; its fields: heads, pool"),
    ],
)
def test_bad_scorer_fields(spec, message):
    with pytest.raises(ValueError) as err:
        build_schedule(PruningConfig("lazy", scorer=spec), 30)
    assert message in str(err.value)


def test_scorer_objects_are_those_a_spec_can_name():
    """A schedule, cache file or report names its scorer by spec: an object no spec names
    (an unregistered class, pooling by 0 or pooling a pooled scorer, which once ran and then
    wrote a cache file its own load refused) is refused where it is given."""
    @dataclass(frozen=True)
    class Unregistered(Scorer):
        def score(self, ctx):
            return ctx.key_positions

    with pytest.raises(UserInputError, match="scorer Unregistered is not registered"):
        PruningConfig("lazy", scorer=Unregistered())
    for inner, radius, message in ((LastQuery(), 0, "pool must be an integer in .1,"),
                                   (Pooled(LastQuery(), 2), 3, "Pooled wraps one of"),
                                   ("last", 2, "Pooled wraps one of")):
        with pytest.raises(UserInputError, match=message):
            Pooled(inner, radius)
    with pytest.raises(UserInputError, match="each field once"):
        parse_scorer("last:pool=0:pool=3")
    pooled = Pooled(Window(size=4), 2)
    assert parse_scorer(scorer_spec(pooled)) == pooled == parse_scorer(pooled)
    assert parse_scorer("last:pool=0") == LastQuery()
    with pytest.raises(ValueError, match="method .speed. takes no scorer; lazy and static do"):
        build_schedule(PruningConfig("speed", scorer="last"), 30)


# ------------------------------------------------- a new scorer is one class plus one line

@dataclass(frozen=True)
class Stride(Scorer):
    """A throwaway scorer with a parameter no other scorer has: every ``step``-th position
    scores 1, the rest 0. Each call records its step, so a test sees which scorer ran."""

    step: int = 2
    calls: ClassVar[list] = []

    def score(self, ctx: ScoreContext) -> np.ndarray:
        Stride.calls.append(self.step)
        return (ctx.key_positions % self.step == 0).astype(np.float32)


@pytest.fixture
def stride(monkeypatch):
    monkeypatch.setitem(SCORERS, "stride", Stride)  # the one registry line
    Stride.calls.clear()
    return Stride


def kept_after_cut(engine, layer=1):
    return sorted(engine.cache.layers[layer].cached_positions().tolist())


def assert_strided(kept, step, n):
    """Every token kept past the cut is a multiple of ``step`` or the query token."""
    assert kept and all(p % step == 0 or p == n - 1 for p in kept), (step, kept)
    assert any(p % step == 0 and p % 2 for p in kept) or step == 2, kept


def test_a_new_scorer_runs_through_a_schedule_file(stride, tiny_model, tmp_path):
    model, _ = tiny_model("llama")
    n = 120
    config = PruningConfig("lazy", prune_layers=(0,), keep=(0.2,), scorer="stride:step=5")
    fingerprint = ModelAdapter(model).fingerprint()
    path = write_schedule(tmp_path / "s.json", config, fingerprint, {"note": "test"})
    assert json.loads(path.read_text())["config"]["scorer"] == "stride:step=5"
    loaded = read_schedule(path, fingerprint)
    assert loaded.scorer == Stride(step=5)
    engine = LazyEngine(model, resolve_config(model, loaded))
    mx.eval(engine.prefill(random_prompt(n, model.args.vocab_size, seed=3)))
    assert_strided(kept_after_cut(engine), 5, n)
    assert set(Stride.calls) == {5}


def test_a_new_scorer_runs_through_the_benchmark_syntax(stride, tiny_model):
    model, _ = tiny_model("llama")
    n = 120
    method = parse_method("lazy:layers=0:keep=0.2:scorer=stride:step=3:complete=after-first")
    assert method.config.scorer == Stride(step=3) and method.config.complete == "after-first"
    assert parse_method(method_spec(method.config)).config == method.config
    engine = LazyEngine(model, resolve_config(model, method.config))
    mx.eval(engine.prefill(random_prompt(n, model.args.vocab_size, seed=4)))
    assert_strided(kept_after_cut(engine), 3, n)
    assert set(Stride.calls) == {3}


def test_a_new_scorer_runs_through_the_cli(stride, tiny_model_path, tmp_path, capsys):
    out = tmp_path / "stats.json"
    status = cli.main(["--model", str(tiny_model_path), "-p", "hello there " * 30,
                       "--method", "lazy", "--prune-layers", "0", "--keep", "0.2",
                       "--scorer", "stride:step=7", "-m", "3", "--stats-json", str(out)])
    assert status == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["schedule"]["scorer"] == "stride:step=7"
    assert Stride.calls and set(Stride.calls) == {7}  # prefill and every decode step
    assert "stride" in cli.build_parser().format_help()  # --scorer's help lists the registry
    with pytest.raises(UserInputError, match="scorer 'stride' has no field 'size'; its "
                                             "fields: step, pool"):
        PruningConfig("lazy", scorer="stride:size=3")
