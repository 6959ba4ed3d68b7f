"""PruningConfig presets and validation."""

import pytest

from mlx_lazy import METHODS, PruningConfig


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
        (PruningConfig("nope"), "unknown method"),
        (PruningConfig("speed", anchors=-1), "anchors"),
        (PruningConfig("static", revive=False), "revive=False applies to"),
        (PruningConfig("lazy", pool=-1), "pool must be a non-negative integer"),
        (PruningConfig("speed", pool=2), "pool applies to score-based methods"),
    ],
)
def test_invalid_configs_raise_helpful_errors(config, message):
    with pytest.raises(ValueError, match=None) as err:
        config.resolve(30)
    assert message in str(err.value)


def test_unknown_preset():
    with pytest.raises(ValueError, match="choose one of"):
        PruningConfig.preset("fast")
