"""PruningConfig presets and validation; schedule files."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from mlx_lazy import METHODS, PruningConfig, UserInputError, build_schedule, read_schedule
from mlx_lazy.inputs import MAX_COUNT
from mlx_lazy.schedule import Schedule, check_fits
from mlx_lazy.schedule_files import SCHEDULE_FORMAT, SCHEDULE_MAX_BYTES
from mlx_lazy.scorers import LastQuery, Pooled, Window, parse_scorer, scorer_spec


@pytest.mark.parametrize("method", METHODS)
def test_presets_resolve(method):
    s = build_schedule(PruningConfig.preset(method), 30)
    assert s.method == method
    assert list(s.keep) == sorted(s.keep, reverse=True)
    assert all(0 <= layer < s.prompt_depth - 1 for layer in s.prune_layers)
    assert s.prunes == (method != "full")


def test_a_schedule_without_a_speed_cutoff_lets_the_prompt_through():
    """A Schedule built without prompt_depth (SPEED's cutoff) cuts nothing off: it once
    defaulted to 0, which kept every prompt token but the last out of layer 0."""
    sched = Schedule("lazy", 4, prune_layers=(1,), keep=(0.5,), dynamic=True)
    assert sched.prompt_depth == 4 and Schedule.full(4).prompt_depth == 4
    assert Schedule.from_dict(sched.as_dict()) == sched


def test_speed_cutoff_fraction_and_count():
    assert build_schedule(PruningConfig("speed", speed_cutoff=0.75), 32).prompt_depth == 24
    assert build_schedule(PruningConfig("speed", speed_cutoff=20), 32).prompt_depth == 20
    assert build_schedule(PruningConfig("speed", speed_cutoff=1.0), 32).prompt_depth == 32


def test_static_and_random_are_not_dynamic():
    assert not build_schedule(PruningConfig.preset("static"), 30).dynamic
    r = build_schedule(PruningConfig("random", keep=(0.3,), seed=4), 30)
    assert (r.random_keep, r.keep, r.dynamic) == (0.3, (), False)
    assert build_schedule(PruningConfig.preset("lazy"), 30).dynamic


@pytest.mark.parametrize(
    "config, message",
    [
        (PruningConfig("speed", speed_cutoff=0), "between 1 and 30"),
        (PruningConfig("speed", speed_cutoff=31), "between 1 and 30"),
        (PruningConfig("speed", speed_cutoff=1.5), "fraction must be in (0, 1]"),
        (PruningConfig("lazy", prune_layers=(4, 8), keep=(0.5, 0.0)), "in (0, 1]"),
        (PruningConfig("lazy", prune_layers=(4, 8), keep=(0.5, 1.2)), "in (0, 1]"),
        (PruningConfig("lazy", prune_layers=(4, 8), keep=(0.3, 0.5)), "must not increase"),
        (PruningConfig("lazy", prune_layers=(8, 4), keep=(0.5, 0.3)), "strictly increasing"),
        (PruningConfig("lazy", prune_layers=(4, 29), keep=(0.5, 0.3)), "must lie in [0, 28]"),
        (PruningConfig("lazy", prune_layers=(-1,), keep=(0.5,)), "must lie in"),
        (PruningConfig("lazy", prune_layers=(4, 8), keep=(0.5,)), "one keep fraction per"),
        # a bad value is named before a count (NaN once read as one fraction too few)
        (PruningConfig("lazy", prune_layers=(4, 8), keep=(float("nan"),)),
         "in (0, 1], got nan"),
        (PruningConfig("lazy+speed", prune_layers=(4, 22), keep=(0.5, 0.3), speed_cutoff=0.75),
         "SPEED cutoff 22"),
        (PruningConfig("static", prune_layers=(2, 4), keep=(0.5, 0.3)), "exactly one"),
        (PruningConfig("random", keep=(0.5, 0.4)), "one keep fraction"),
        (PruningConfig("full", prune_layers=(3,)), "takes no prune_layers"),
        (PruningConfig("lazy", speed_cutoff=0.5), "takes no speed_cutoff"),
        (PruningConfig("static", revive=False), "takes no revive=False; lazy does"),
        (PruningConfig("speed", scorer="last:pool=2"), "takes no scorer; lazy and static do"),
    ],
)
def test_invalid_configs_raise_helpful_errors(config, message):
    with pytest.raises(UserInputError) as err:
        build_schedule(config, 30)
    assert message in str(err.value)


def test_unknown_preset():
    with pytest.raises(ValueError, match="choose one of"):
        PruningConfig.preset("fast")


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(method="turbo"), "unknown method 'turbo'"),  # rejected when made, not when used
        (dict(method="lazy:keep=0.2"), "NAME:field=value is the benchmarks' spelling"),
        (dict(method="lazy", revive="no"), "revive must be True or False"),
        (dict(method="lazy", revive=0), "revive must be True or False"),
        (dict(method="lazy", prune_layers=(3,), keep=(True,)), "keep fraction must be a number"),
        (dict(method="lazy", prune_layers=(True,), keep=(0.5,)), "layer must be an integer"),
        (dict(method="lazy", prune_layers=(2.0,), keep=(0.5,)), "layer must be an integer"),
        (dict(method="lazy", prune_layers=3, keep=(0.5,)), "prune_layers must be a sequence"),
        (dict(method="speed", anchors=True), "anchors must be an integer"),
        (dict(method="speed", anchors=-1), "anchors must be a non-negative integer"),
        (dict(method="speed", speed_cutoff=True), "speed_cutoff must be a fraction of the "
                                                  "layers or a layer count, got True"),
        (dict(method="speed", speed_cutoff="0.5"), "speed_cutoff must be a fraction of the "
                                                   "layers or a layer count, got '0.5'"),
        (dict(method="random", seed=-1), "seed must be a non-negative integer"),
        (dict(method="lazy", scorer="last:pool=-1"), "pool must be an integer in [0,"),
        (dict(method="lazy", scorer="window:size=0"), "size must be an integer in [1,"),
        (dict(method="lazy", scorer="window:size=8.5"), "size must be int, got '8.5'"),
        (dict(method="lazy", scorer="last:heads=median"), "heads must be one of mean, max"),
        (dict(method="lazy", scorer="last:size=8"), "scorer 'last' has no field 'size'"),
        (dict(method="lazy", scorer="psychic"), "unknown scorer 'psychic'"),
        (dict(method="lazy", scorer=8), "scorer must be a non-empty spec"),
    ],
)
def test_bad_field_types_are_rejected_at_construction(fields, message):
    with pytest.raises(UserInputError) as err:
        PruningConfig(**fields)
    assert message in str(err.value)
    with pytest.raises(UserInputError):  # presets go through the same checks
        PruningConfig.preset(fields.pop("method"), **fields)


def test_numpy_scalars_are_accepted_and_normalised():
    config = PruningConfig("lazy", prune_layers=np.array([4, 8]), keep=(np.float32(0.5), 0.25),
                           anchors=np.int64(2), revive=np.bool_(False))
    assert config.prune_layers == (4, 8) and type(config.prune_layers[0]) is int
    assert config.keep == (0.5, 0.25) and type(config.keep[0]) is float
    assert config.anchors == 2 and config.revive is False
    assert build_schedule(config, 30).prune_layers == (4, 8)
    assert build_schedule(PruningConfig("speed", speed_cutoff=np.int32(20)), 30).prompt_depth == 20


def test_speed_cutoff_leaving_no_room_for_the_preset_cut_says_so():
    with pytest.raises(UserInputError) as err:
        build_schedule(PruningConfig("lazy+speed", speed_cutoff=1), 30)
    message = str(err.value)
    assert "SPEED cutoff 1 leaves no room" in message and "speed_cutoff" in message
    assert "[-1]" not in message  # no layers the user never gave
    assert build_schedule(PruningConfig("lazy+speed", speed_cutoff=2), 30).prune_layers == (0,)


# ------------------------------------------------------------------ input domains

HUGE = 10**5000  # past Python's 4,300-digit limit for printing an int


@pytest.mark.parametrize("fields, name", [
    (dict(method="lazy", scorer=f"last:pool={10**20}"), "pool"),
    (dict(method="lazy", scorer=f"last:pool={MAX_COUNT + 1}"), "pool"),
    (dict(method="lazy", scorer=f"window:size={10**20}"), "size"),
    (dict(method="speed", anchors=HUGE), "anchors"),
    (dict(method="random", seed=2**64), "seed"),
    (dict(method="lazy", prune_layers=(3, HUGE), keep=(0.5, 0.3)), "each pruning layer"),
    (dict(method="lazy", prune_layers=(-HUGE,), keep=(0.5,)), "each pruning layer"),
    (dict(method="speed", speed_cutoff=HUGE), "speed_cutoff"),
])
def test_integers_are_bounded_on_construction(fields, name):
    with pytest.raises(UserInputError, match=f"^{name} must be") as err:
        PruningConfig(**fields)
    assert len(str(err.value)) < 200  # the value is described, not printed in full


def test_bounds_are_inclusive():
    assert PruningConfig("lazy", scorer=f"last:pool={MAX_COUNT}").scorer.radius == MAX_COUNT
    assert PruningConfig("random", seed=2**64 - 1).seed == 2**64 - 1


def test_a_huge_keep_fraction_is_refused_by_name():
    with pytest.raises(UserInputError, match="keep fractions must be in"):
        build_schedule(PruningConfig("lazy", prune_layers=(3,), keep=(HUGE,)), 30)


@pytest.mark.parametrize("scorer", ["", " ", "\t"])
def test_scorer_specs_are_non_empty(scorer):
    with pytest.raises(UserInputError, match="scorer must be a non-empty spec"):
        PruningConfig("lazy", scorer=scorer)


def test_pool_and_window_must_fit_the_context():
    schedule = build_schedule(PruningConfig("lazy", scorer="window:size=50:pool=100"), 30)
    check_fits(schedule, 100)  # equal to the context: fits
    check_fits(schedule, None)  # no known context: nothing to check
    with pytest.raises(UserInputError, match="pool=100 is more than the model's context of 99"):
        check_fits(schedule, 99)
    window = build_schedule(PruningConfig("lazy", scorer="window:size=50"), 30)
    with pytest.raises(UserInputError, match="window:size=50 reads 50 query tokens, more than "
                                             "the model's context of 49"):
        check_fits(window, 49)


@pytest.mark.parametrize("spec", ["last", "last:heads=max", "window", "window:size=32",
                                  "window:size=32:heads=max:pool=8", "last:pool=3"])
def test_scorer_specs_round_trip(spec):
    scorer = parse_scorer(spec)
    assert scorer_spec(scorer) == spec and parse_scorer(scorer_spec(scorer)) == scorer
    assert PruningConfig("lazy", scorer=spec) == PruningConfig("lazy", scorer=scorer)


def test_scorer_fields_reach_the_scorer():
    config = PruningConfig("lazy", scorer="window:pool=8:heads=max:size=32")
    scorer = build_schedule(config, 30).scorer
    assert scorer == Pooled(Window(size=32, heads="max"), radius=8)
    assert scorer.n_queries == 32 and list(scorer.always_kept(100)) == list(range(68, 100))


# ------------------------------------------------------------------ schedule files


def schedule_doc(**config) -> dict:
    return {"format": SCHEDULE_FORMAT, "model": {"fingerprint": {"num_layers": 30}},
            "config": {"method": "lazy", **config}}


def test_a_valid_schedule_file_loads(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(schedule_doc(prune_layers=[20], keep=[0.3],
                                            scorer="window:size=16:pool=4")))
    config = read_schedule(path)
    assert (config.prune_layers, config.keep, config.scorer) == (
        (20,), (0.3,), Pooled(Window(size=16), 4))


def test_a_format_1_schedule_file_loads_with_its_scorer_fields_as_one_spec(tmp_path):
    """Format 1 (before scorers owned their parameters) spelt window, heads and pool as
    config fields; its files still load, to the same scorer."""
    path = tmp_path / "old.json"
    doc = schedule_doc(prune_layers=[9], keep=[0.25], scorer="window", window=16, heads="max",
                       pool=0)
    path.write_text(json.dumps(dict(doc, format="mlx-lazy-schedule/1")))
    assert read_schedule(path).scorer == Window(size=16, heads="max")
    doc = schedule_doc(prune_layers=[9], keep=[0.25], pool=2)
    path.write_text(json.dumps(dict(doc, format="mlx-lazy-schedule/1")))
    assert read_schedule(path).scorer == Pooled(LastQuery(), 2)
    path.write_text(json.dumps(schedule_doc(prune_layers=[9], keep=[0.25], window=16)))
    with pytest.raises(UserInputError, match="unknown field config.window"):
        read_schedule(path)  # format 2 has no such field


@pytest.mark.parametrize("text, fragment", [
    ("[" * 200_000, "nests arrays or objects more than 16 deep"),  # the parser's recursion
    (json.dumps(dict(schedule_doc(), evidence=json.loads("[" * 16 + "]" * 16))),
     "more than 16 deep"),  # parsed (17 deep), but deeper than the limit
    (json.dumps(schedule_doc())[:-2] + ', "pool": ' + "9" * 5000 + "}}", "not valid JSON"),
    (json.dumps(schedule_doc(scorer=f"last:pool={10**30}")), "invalid config: pool must be"),
    (json.dumps(schedule_doc(pool=2)), "unknown field config.pool"),
    (json.dumps(schedule_doc(scorer="")), "invalid config: scorer must be a non-empty"),
    (json.dumps(dict(schedule_doc(), model={"fingerprint": {"num_layers": 10**400}})),
     "num_layers must be a positive integer"),
    (json.dumps(schedule_doc()) + " " * (SCHEDULE_MAX_BYTES + 1 - len(json.dumps(schedule_doc()))),
     "larger than the limit of 1 MiB"),
    (b"\xff\xfe{}", "not valid UTF-8"),
])
def test_bad_schedule_files_are_user_errors_naming_the_file(tmp_path, text, fragment):
    path = tmp_path / "bad.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(UserInputError) as err:
        read_schedule(path)
    assert str(path) in str(err.value) and fragment in str(err.value)


def test_the_largest_schedule_file_allowed_loads(tmp_path):
    text = json.dumps(schedule_doc(prune_layers=[20], keep=[0.3]))
    path = tmp_path / "s.json"
    path.write_text(text + " " * (SCHEDULE_MAX_BYTES - len(text)))
    assert read_schedule(path).method == "lazy"


def test_a_schedule_file_beyond_the_limit_is_refused(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(" " * (SCHEDULE_MAX_BYTES + 1))
    with pytest.raises(UserInputError, match="s.json is larger than the limit"):
        read_schedule(path)


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero")
def test_an_endless_schedule_file_is_refused_unread():
    """/dev/zero never ends, a FIFO nobody writes to never starts: neither is read."""
    with pytest.raises(UserInputError, match="schedule file /dev/zero is not a regular file"):
        read_schedule("/dev/zero")


# ------------------------------------------------------------------ the transfer rule


def test_the_transfer_rule_is_the_envelope_of_the_shipped_schedules():
    """Fit on Qwen2.5-Coder-0.5B (after layer 9 of 24, 40%) and SmolLM2-135M (after 8 and
    14 of 30, 50% and 20%): 50% from SmolLM2's first cut's depth, 9/30, on, 40% from half of
    it, with their common scorer, decoding on the pruned state at the gentlest of their
    settings (Qwen: every step, at most 2 revivals, margin 1; SmolLM2: held 3 steps, at most
    4, margin 0.5)."""
    from mlx_lazy.schedule_files import transfer_rule

    rule, scorer, decode = transfer_rule()
    assert rule == ((0.3, 0.5), (0.5, 0.4)) and scorer == "window:size=32:pool=8"
    assert decode == {"complete": "none", "max_revivals": 4, "revive_margin": 0.5,
                      "reselect_every": None}


def test_the_transfer_rule_keeps_at_least_what_each_calibrated_schedule_keeps():
    """On each calibrated model's own depth the rule cuts first where the shallowest of them
    does, and from each one's first cut on keeps at every layer at least as much as its
    calibrated schedule (which met the bars), pruning somewhere."""
    from mlx_lazy.schedule_files import (PACKAGED_SCHEDULES, TRANSFER_FROM, keep_at,
                                         transfer_layers, transfer_rule)

    rule = transfer_rule().cuts
    sources = [read_schedule(PACKAGED_SCHEDULES / name) for name in TRANSFER_FROM]
    shallowest = min((c.prune_layers[0] + 1) / dict(c.fingerprint)["num_layers"]
                     for c in sources)
    assert rule[0][0] == shallowest
    for name, config in zip(TRANSFER_FROM, sources):
        n = dict(config.fingerprint)["num_layers"]
        layers, keep = transfer_layers(rule, n)
        for layer in range(config.prune_layers[0], n):
            depth = (layer + 1) / n
            assert keep_at(layers, keep, n, depth) >= keep_at(config.prune_layers, config.keep,
                                                              n, depth), (name, layer)
        assert keep_at(layers, keep, n, 1.0) < 1.0


def test_a_synthetic_transfer_fit():
    from mlx_lazy.schedule_files import transfer_layers, transfer_rule

    a = PruningConfig("lazy", prune_layers=(1, 5), keep=(0.6, 0.1), scorer="last",  # of 10
                      complete="none", max_revivals=2, revive_margin=1.0, reselect_every=3)
    b = PruningConfig("lazy", prune_layers=(3,), keep=(0.3,), scorer="window:size=8",  # of 8
                      complete="none", max_revivals=5, revive_margin=0.25, reselect_every=2)
    rule, scorer, decode = transfer_rule([(10, a), (8, b)])
    # Depths 0.2: a keeps 0.6, b its first cut's 0.3 -> 0.6; 0.5: 0.6 vs 0.3 -> 0.6;
    # 0.6: 0.1 vs 0.3 -> 0.3.
    assert rule == ((0.2, 0.6), (0.6, 0.3)) and scorer is None
    assert decode == {"complete": "none", "max_revivals": 5, "revive_margin": 0.25,
                      "reselect_every": 2}
    # One unbounded, one re-selecting at every step, one with no margin, modes that differ:
    c = PruningConfig("lazy", prune_layers=(3,), keep=(0.3,), complete="after-first")
    assert transfer_rule([(10, a), (8, c)]).decode == dict.fromkeys(
        ("complete", "max_revivals", "revive_margin", "reselect_every"))
    assert transfer_rule([]).cuts == ()
    assert transfer_layers(rule, 10) == ((1, 5), (0.6, 0.3))
    assert transfer_layers(rule, 3) == ((0, 1), (0.6, 0.3))
    assert transfer_layers(((0.5, 0.6), (0.6, 0.3)), 3) == ((1,), (0.6,))  # one layer: the most
    assert transfer_layers(((0.41, 0.5), (0.5, 0.2)), 30) == ((12, 14), (0.5, 0.2))  # never earlier
    # With sliding-window layers each cut goes after the nearest global one (8: a tie, the
    # lower), where both of these land: the most kept.
    assert transfer_layers(((10 / 24, 0.5), (0.5, 0.4)), 18, (5, 11)) == ((5,), (0.5,))
    assert transfer_layers(((0.6, 0.3),), 18, (5, 11)) == ((11,), (0.3,))


def test_the_transfer_rule_cuts_a_sliding_window_model_after_global_layers(tiny_model,
                                                                          monkeypatch):
    """The tiny Gemma 3 attends through a window at layers 0 and 2: a rule's cut that would
    follow layer 0 follows layer 1, its global neighbour (the last layer is never a cut)."""
    from mlx_lazy import resolve_config, schedule_files
    from mlx_lazy.adapter import global_layers, sliding_windows

    gemma, _ = tiny_model("gemma3_text")
    assert sliding_windows(gemma) == [24, None, 24, None] and global_layers(gemma) == (1,)
    assert global_layers(tiny_model("llama")[0]) == ()
    rule = schedule_files.TransferRule(((0.25, 0.5),), None,
                                       dict.fromkeys(schedule_files.DECODE_FIELDS))
    monkeypatch.setattr(schedule_files, "transfer_rule", lambda: rule)
    assert resolve_config(gemma, "lazy").prune_layers == (1,)
    assert resolve_config(tiny_model("llama")[0], "lazy").prune_layers == (0,)


def test_a_plain_lazy_on_an_uncalibrated_model_takes_the_transfer_rule(tiny_model):
    """No calibrated schedule matches the tiny models: a plain ``lazy`` reports the transfer
    rule, placed on the model's depth; anything else is as before."""
    from mlx_lazy import LazyEngine, resolve_config
    from mlx_lazy.schedule_files import calibrated

    model, _ = tiny_model("qwen2")
    s = resolve_config(model, "lazy")
    assert (s.source, s.prune_layers, s.keep, scorer_spec(s.scorer)) == (
        "transfer", (1,), (0.5,), "window:size=32:pool=8")
    assert (s.complete, s.max_revivals, s.revive_margin, s.reselect_every) == (
        "none", 4, 0.5, 1)
    assert LazyEngine(model, s).stats.schedule["source"] == "transfer"
    # A decode setting the request names stays its own.
    mine = resolve_config(model, PruningConfig("lazy", complete="exact", max_revivals=1))
    assert (mine.source, mine.complete, mine.max_revivals) == ("transfer", "exact", 1)
    deep = calibrated(PruningConfig("lazy", anchors=3), {"num_layers": 36})
    assert (deep.source, deep.prune_layers, deep.keep, deep.anchors, deep.complete) == (
        "transfer", (10, 17), (0.5, 0.4), 3, "none")
    user = PruningConfig("lazy", prune_layers=(0,), keep=(0.5,))
    assert resolve_config(model, user).source == "user"
    # any field that says what is pruned makes the schedule the user's, the rest the preset's
    for mine in (PruningConfig("lazy", scorer="window:size=8:pool=1"),
                 PruningConfig("speed", speed_cutoff=2), PruningConfig("lazy", keep=(0.3,))):
        assert resolve_config(model, mine).source == "user", mine
    assert resolve_config(model, "lazy+speed").source == "preset"
    with pytest.raises(UserInputError, match="no quality='high' schedule"):
        resolve_config(model, PruningConfig("lazy", quality="high"))


def test_a_schedule_files_revival_bound_is_what_a_plain_lazy_decodes_with(tiny_model_dir,
                                                                          tmp_path, monkeypatch):
    """A schedule calibrated with ``max_revivals`` (``calibrate --max-revivals``) names it;
    a plain ``lazy`` on that model decodes with it, and a config naming its own bound keeps
    that one (as with ``complete``)."""
    import mlx_lazy
    from mlx_lazy.adapter import ModelAdapter
    from mlx_lazy.resolve import resolve_config
    from mlx_lazy.schedule_files import MODEL_SCHEDULE_FILE, write_schedule

    monkeypatch.setenv("MLX_LAZY_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), folder)
    bounded = PruningConfig("lazy", prune_layers=(1,), keep=(0.3,), scorer="window:size=4",
                            complete="none", max_revivals=0)
    fingerprint = ModelAdapter(mlx_lazy.load(str(folder))[0]).fingerprint()
    path = write_schedule(folder / MODEL_SCHEDULE_FILE, bounded, fingerprint, {})
    assert json.loads(path.read_text())["config"]["max_revivals"] == 0
    model, _ = mlx_lazy.load(str(folder))
    assert resolve_config(model, "lazy").max_revivals == 0
    assert resolve_config(model, PruningConfig("lazy", max_revivals=3)).max_revivals == 3


def test_a_field_lazy_does_not_take_is_refused_before_a_calibrated_schedule_stands_in(
        tiny_model_dir, tmp_path, monkeypatch):
    """``lazy`` with ``speed_cutoff`` is refused as with explicit cuts, also where a
    calibrated schedule (or the transfer rule) replaces the plain request, which would drop
    the field with the preset: the run would silently not be what was asked."""
    import mlx_lazy
    from mlx_lazy.adapter import ModelAdapter
    from mlx_lazy.resolve import resolve_config
    from mlx_lazy.schedule_files import MODEL_SCHEDULE_FILE, write_schedule

    monkeypatch.setenv("MLX_LAZY_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), folder)
    schedule = PruningConfig("lazy", prune_layers=(1,), keep=(0.3,), scorer="window:size=4",
                             complete="none")
    fingerprint = ModelAdapter(mlx_lazy.load(str(folder))[0]).fingerprint()
    write_schedule(folder / MODEL_SCHEDULE_FILE, schedule, fingerprint, {})
    calibrated_model, _ = mlx_lazy.load(str(folder))
    assert resolve_config(calibrated_model, "lazy").source.startswith("calibrated")
    for model in (calibrated_model, mlx_lazy.load(tiny_model_dir("qwen2"))[0]):  # + transfer
        with pytest.raises(UserInputError, match="method 'lazy' takes no speed_cutoff"):
            resolve_config(model, PruningConfig("lazy", speed_cutoff=0.5))
    assert resolve_config(calibrated_model, PruningConfig("lazy+speed", speed_cutoff=0.5))
