"""PruningConfig presets and validation."""

import numpy as np
import pytest

from mlx_lazy import METHODS, PruningConfig, UserInputError


@pytest.mark.parametrize("method", METHODS)
def test_presets_resolve(method):
    s = PruningConfig.preset(method).resolve(30)
    assert s.method == method
    assert list(s.keep) == sorted(s.keep, reverse=True)
    assert all(0 <= layer < s.prompt_depth - 1 for layer in s.prune_layers)
    assert s.prunes == (method != "full")


def test_speed_cutoff_fraction_and_count():
    assert PruningConfig("speed", speed_cutoff=0.75).resolve(32).prompt_depth == 24
    assert PruningConfig("speed", speed_cutoff=20).resolve(32).prompt_depth == 20
    assert PruningConfig("speed", speed_cutoff=1.0).resolve(32).prompt_depth == 32


def test_static_and_random_are_not_dynamic():
    assert not PruningConfig.preset("static").resolve(30).dynamic
    r = PruningConfig("random", keep=(0.3,), seed=4).resolve(30)
    assert (r.random_keep, r.keep, r.dynamic) == (0.3, (), False)
    assert PruningConfig.preset("lazy").resolve(30).dynamic


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
        (PruningConfig("lazy+speed", prune_layers=(4, 22), keep=(0.5, 0.3), speed_cutoff=0.75), "SPEED cutoff 22"),
        (PruningConfig("static", prune_layers=(2, 4), keep=(0.5, 0.3)), "exactly one"),
        (PruningConfig("random", keep=(0.5, 0.4)), "one keep fraction"),
        (PruningConfig("full", prune_layers=(3,)), "takes no prune_layers"),
        (PruningConfig("lazy", speed_cutoff=0.5), "takes no speed_cutoff"),
        (PruningConfig("static", revive=False), "takes no revive=False; lazy does"),
        (PruningConfig("speed", pool=2), "takes no pool; lazy and static do"),
    ],
)
def test_invalid_configs_raise_helpful_errors(config, message):
    with pytest.raises(UserInputError) as err:
        config.resolve(30)
    assert message in str(err.value)


def test_unknown_preset():
    with pytest.raises(ValueError, match="choose one of"):
        PruningConfig.preset("fast")


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(method="turbo"), "unknown method 'turbo'"),  # rejected when made, not when used
        (dict(method="lazy", revive="no"), "revive must be True or False"),
        (dict(method="lazy", revive=0), "revive must be True or False"),
        (dict(method="lazy", prune_layers=(3,), keep=(True,)), "keep fraction must be a number"),
        (dict(method="lazy", prune_layers=(True,), keep=(0.5,)), "layer must be an integer"),
        (dict(method="lazy", prune_layers=(2.0,), keep=(0.5,)), "layer must be an integer"),
        (dict(method="lazy", prune_layers=3, keep=(0.5,)), "prune_layers must be a sequence"),
        (dict(method="speed", anchors=True), "anchors must be an integer"),
        (dict(method="speed", anchors=-1), "anchors must be a non-negative integer"),
        (dict(method="speed", speed_cutoff=True), "speed_cutoff must be an integer"),
        (dict(method="speed", speed_cutoff="0.5"), "speed_cutoff must be an integer"),
        (dict(method="random", seed=-1), "seed must be a non-negative integer"),
        (dict(method="lazy", pool=-1), "pool must be a non-negative integer"),
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
    assert config.resolve(30).prune_layers == (4, 8)
    assert PruningConfig("speed", speed_cutoff=np.int32(20)).resolve(30).prompt_depth == 20


def test_speed_cutoff_leaving_no_room_for_the_preset_cut_says_so():
    with pytest.raises(UserInputError) as err:
        PruningConfig("lazy+speed", speed_cutoff=1).resolve(30)
    message = str(err.value)
    assert "SPEED cutoff 1 leaves no room" in message and "speed_cutoff" in message
    assert "[-1]" not in message  # no layers the user never gave
    assert PruningConfig("lazy+speed", speed_cutoff=2).resolve(30).prune_layers == (0,)
