"""Pruning policies (mlx_lazy.schedule.POLICIES): every registered policy and every
composition resolves, refuses fields it does not take, round-trips through the benchmarks'
method strings and runs through the engine; the presets are those of the fixed method
names they replaced."""

import dataclasses
from itertools import combinations

import mlx.core as mx
import numpy as np
import pytest

from mlx_lazy import LazyEngine, PruningConfig, UserInputError, build_schedule, resolve_config
from mlx_lazy.bench.methods import method_spec, parse_method
from mlx_lazy.policies import METHODS, POLICIES, compose
from mlx_lazy.scorers import scorer_spec

#: A value for every field some policy takes (each differs from its default and from
#: every preset, and fits a 30-layer model in any method that takes it).
SAMPLE = {"prune_layers": (3,), "keep": (0.3,), "speed_cutoff": 0.5, "revive": False,
          "scorer": "window:size=4:heads=max:pool=1", "complete": "none", "max_revivals": 4,
          "revive_margin": 0.75, "reselect_every": 3}
#: How each sampled field reads back from the resolved Schedule.
READ_BACK = {
    "prune_layers": lambda s: s.prune_layers,
    "keep": lambda s: s.keep or (s.random_keep,),
    "speed_cutoff": lambda s: s.prompt_depth / s.num_layers,
    "revive": lambda s: s.revive,
    "scorer": lambda s: scorer_spec(s.scorer),
    "complete": lambda s: s.complete,
    "max_revivals": lambda s: s.max_revivals,
    "revive_margin": lambda s: s.revive_margin,
    "reselect_every": lambda s: s.reselect_every,
}
#: The Schedule fields each policy sets.
SETS = {
    "lazy": {"prune_layers", "keep", "dynamic", "revive", "complete", "max_revivals",
             "revive_margin", "reselect_every", "scorer"},
    "static": {"prune_layers", "keep", "scorer"},
    "random": {"random_keep"},
    "speed": {"prompt_depth"},
}
SETS_ANY = set().union(*SETS.values())
POLICY_FIELDS = {f for policy in POLICIES.values() for f in policy.takes}
COMPOSITIONS = [m for m in METHODS if "+" in m]


def taken(method):
    return {f for name in method.split("+") if name in POLICIES for f in POLICIES[name].takes}


def sampled(method):
    return PruningConfig(method, **{f: SAMPLE[f] for f in taken(method)})


def test_methods_are_full_each_policy_and_the_compositions_that_compose():
    """Policies compose when no two take the same field; METHODS lists exactly those."""
    names = list(POLICIES)
    disjoint = [c for r in range(2, len(names) + 1) for c in combinations(names, r)
                if all(not set(POLICIES[a].takes) & set(POLICIES[b].takes)
                       for a, b in combinations(c, 2))]
    assert METHODS == ("full", *names, *("+".join(c) for c in disjoint))
    assert set(SAMPLE) == POLICY_FIELDS == set(READ_BACK) and set(SETS) == set(POLICIES)


@pytest.mark.parametrize("name", POLICIES)
def test_each_policy_resolves_alone_and_prunes(name):
    s = build_schedule(PruningConfig(name), 30)
    assert s.method == name and s.prunes and s.source == "preset"


@pytest.mark.parametrize("name", POLICIES)
def test_each_policy_refuses_the_fields_it_does_not_take(name):
    assert set(POLICIES[name].takes) <= set(PruningConfig.__dataclass_fields__)
    for field in sorted(POLICY_FIELDS - set(POLICIES[name].takes)):
        with pytest.raises(UserInputError, match=f"method '{name}' takes no {field}"):
            build_schedule(PruningConfig(name, **{field: SAMPLE[field]}), 30)


@pytest.mark.parametrize("method", METHODS)
def test_each_method_applies_every_field_its_policies_take(method):
    s = build_schedule(sampled(method), 30)
    assert s.method == method
    for field in taken(method):
        expected = SAMPLE[field]
        assert READ_BACK[field](s) == expected, field
    # The rest of the plan is the unpruned one's: no policy sets another's part.
    full = build_schedule(PruningConfig("full"), 30)
    parts = set().union(*(SETS[n] for n in method.split("+") if n != "full"))
    assert {f for f in SETS_ANY if getattr(s, f) != getattr(full, f)} <= parts


@pytest.mark.parametrize("method", METHODS)
def test_each_policy_gives_its_part_of_a_schedule_back(method):
    """Policy.given inverts apply: the fields each policy reads off a resolved schedule
    build that schedule again (what a prompt-cache file's schedule is checked by, so a
    policy added without its given fails here)."""
    for config in (sampled(method), PruningConfig(method),
                   dataclasses.replace(sampled(method), revive=True, complete="after-first")
                   if "lazy" in method else PruningConfig(method)):
        schedule = build_schedule(config, 30)
        values = schedule.as_dict()
        given = {k: values[k] for k in ("method", "anchors", "seed", "source")}
        for policy in compose(method).values():
            given.update(policy.given(values))
        assert build_schedule(PruningConfig(**given), 30) == schedule, config


@pytest.mark.parametrize("method", METHODS)
def test_method_strings_round_trip_through_the_benchmark_syntax(method):
    for config in (PruningConfig.preset(method), sampled(method)):
        spec = method_spec(config)
        assert spec.split(":")[0] == method
        assert parse_method(spec).config == config


def test_policies_compose_in_any_order_under_one_canonical_name():
    assert PruningConfig("speed+lazy") == PruningConfig("lazy+speed")
    assert PruningConfig.preset("speed+random").method == "random+speed"
    assert parse_method("speed+static:cutoff=0.5").config.method == "static+speed"


@pytest.mark.parametrize("method, message", [
    ("lazy+static", "lazy and static do not compose (both take prune_layers, keep"),
    ("random+lazy", "lazy and random do not compose (both take keep)"),
    ("static+random+speed", "static and random do not compose (both take keep)"),
    ("lazy+lazy", "names lazy twice"),
    ("full+lazy", "full prunes nothing and composes with no policy"),
    ("lazy+turbo", "unknown method 'lazy+turbo' (no policy 'turbo'); choose one of full, lazy"),
    ("lazy+", "(no policy '')"),
    ("Lazy", "unknown method 'Lazy'"),
    (("lazy",), "unknown method ('lazy',)"),
])
def test_invalid_compositions_are_one_clear_error(method, message):
    with pytest.raises(UserInputError) as err:
        PruningConfig(method)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_depth_limits_are_applied_before_the_cuts_placed_below_them():
    """Preset cuts are placed below the SPEED cutoff: applied the other way round they would
    sit at the model-depth positions (5 and 20 of 30) and be refused."""
    assert build_schedule(PruningConfig("static+speed", speed_cutoff=4), 30).prune_layers == (2,)
    assert build_schedule(PruningConfig("lazy+speed", speed_cutoff=2), 30).prune_layers == (0,)


def test_a_field_of_another_policy_names_the_methods_that_take_it():
    with pytest.raises(UserInputError) as err:
        build_schedule(PruningConfig("speed", keep=(0.5,)), 30)
    assert str(err.value) == ("method 'speed' takes no keep; lazy, static and random do: use "
                              "'lazy+speed', 'static+speed' or 'random+speed'")


@pytest.mark.parametrize("num_layers", [12, 24, 30])
@pytest.mark.parametrize("method", [m for m in COMPOSITIONS if m.endswith("+speed")])
def test_a_preset_with_speed_is_the_policy_s_preset_cut_at_speed_s_depth(method, num_layers):
    """X+speed: SPEED's prompt depth, and X's preset with the cuts at or above it dropped."""
    alone, speed = (build_schedule(PruningConfig.preset(m), num_layers)
                    for m in (method[:-6], "speed"))
    depth = speed.prompt_depth
    cuts = [(layer, k) for layer, k in zip(alone.prune_layers, alone.keep) if layer < depth]
    assert 0 < depth < num_layers
    assert build_schedule(PruningConfig.preset(method), num_layers) == dataclasses.replace(
        alone, method=method, prompt_depth=depth, prune_layers=tuple(c[0] for c in cuts),
        keep=tuple(c[1] for c in cuts))


@pytest.mark.parametrize("method", METHODS)
def test_every_method_generates_on_the_tiny_model(tiny_model, method):
    model, _ = tiny_model("llama")
    n, steps = 64, 3
    prompt = mx.array(np.random.default_rng(0).integers(0, model.args.vocab_size, n)
                      .astype(np.int32))
    engine = LazyEngine(model, resolve_config(model, PruningConfig.preset(method)))
    tokens = [int(mx.argmax(engine.prefill(prompt)))]
    for _ in range(steps):
        tokens.append(int(mx.argmax(engine.decode(tokens[-1]))))
    stats = engine.stats
    assert stats.method == method and stats.generation_tokens == steps
    assert all(0 <= t < model.args.vocab_size for t in tokens)
    # the prefill spared work (exact completion then computes every token at every layer)
    spared = sum(stats.prefill_tokens_per_layer) < n * model.args.num_hidden_layers
    assert spared == (method != "full")
