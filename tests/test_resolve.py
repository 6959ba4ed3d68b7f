"""One resolve per API call, command-line run and server request (issue 31 item 2): a config
becomes a Schedule in one :func:`mlx_lazy.resolve.resolve_config` call, and what runs below it
(the engine, the prompt cache, the server's worker) takes that schedule as it is. Refusals
come from that one call too. ``resolve_calls`` (conftest) counts the calls."""

from __future__ import annotations

import pytest

from mlx_lazy import (PruningConfig, UserInputError, cli, generate, generate_step,
                      make_prompt_cache, resolve_config)
from test_server import in_process_server

#: A config every tiny model refuses (it has fewer layers): the one resolve call says so.
TOO_DEEP = PruningConfig("lazy", prune_layers=(99,), keep=(0.5,))
PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.mark.parametrize("config", [None, "lazy", PruningConfig.preset("lazy+speed")])
def test_an_api_call_resolves_its_config_once(tiny_model, resolve_calls, config):
    model, tokenizer = tiny_model()
    generate(model, tokenizer, PROMPT, max_tokens=3, config=config)
    assert resolve_calls == [config]
    resolve_calls.clear()
    list(generate_step([1, 2, 3], model, max_tokens=2, config=config))
    assert resolve_calls == [config]


def test_an_api_call_on_a_prompt_cache_resolves_only_a_config_it_is_given(tiny_model,
                                                                          resolve_calls):
    model, tokenizer = tiny_model()
    cache = make_prompt_cache(model, "lazy")
    assert resolve_calls == ["lazy"]
    generate(model, tokenizer, PROMPT, max_tokens=2, prompt_cache=cache, config="lazy")
    assert resolve_calls == ["lazy"] * 2  # the check that the cache was made for it
    generate(model, tokenizer, " And then?", max_tokens=2, prompt_cache=cache)
    assert resolve_calls == ["lazy"] * 2  # the cache's own schedule: nothing to resolve


def test_an_api_call_refused_by_the_resolve_resolves_once(tiny_model, resolve_calls):
    model, tokenizer = tiny_model()
    with pytest.raises(UserInputError, match="pruning layers"):
        generate(model, tokenizer, PROMPT, max_tokens=2, config=TOO_DEEP)
    assert resolve_calls == [TOO_DEEP]


@pytest.mark.parametrize("flags", [["--method", "lazy"], ["--method", "lazy", "--compare"],
                                   ["--method", "full", "--verbose", "True"]])
def test_a_cli_run_resolves_once(tiny_model_path, resolve_calls, capsys, flags):
    """``--compare``'s baseline is the unpruned schedule, not a second resolve."""
    assert cli.main(["--model", str(tiny_model_path), "-p", PROMPT, "-m", "3", *flags]) == 0
    assert len(resolve_calls) == 1 and resolve_calls[0].method == flags[1], resolve_calls


def test_a_cli_run_refused_by_the_resolve_resolves_once(tiny_model_path, resolve_calls,
                                                        capsys):
    argv = ["--model", str(tiny_model_path), "-p", PROMPT, "-m", "2", "--method", "lazy",
            "--prune-layers", "99", "--keep", "0.5"]
    assert cli.main(argv) == 2
    assert "error: " in capsys.readouterr().err
    assert len(resolve_calls) == 1


def test_a_server_request_resolves_once_and_its_worker_runs_that_schedule(tiny_model_path,
                                                                          resolve_calls):
    with in_process_server(tiny_model_path) as server:
        resolve_calls.clear()  # the server's start-up
        body = {"prompt": PROMPT, "max_tokens": 3}
        for pruning in (None, "lazy", {"method": "lazy", "keep": [0.4]}):
            status, _, payload = server.request(
                "POST", "/v1/completions", body if pruning is None else {**body,
                                                                         "pruning": pruning})
            assert status == 200, payload
            assert len(resolve_calls) == 1, resolve_calls
            resolve_calls.clear()
        status, _, payload = server.request("POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2,
            "pruning": {"method": "lazy", "prune_layers": [99], "keep": [0.5]}})
        assert status == 400 and payload["error"]["param"] == "pruning", payload
        assert len(resolve_calls) == 1, resolve_calls


@pytest.mark.parametrize("source", ["whatever", "", "calibrated:", 3])
def test_a_source_the_library_does_not_set_is_refused(source):
    """A config's source says where its schedule came from; "whatever" once made a plain
    ``lazy`` skip the calibrated schedule and run the preset without a word."""
    with pytest.raises(UserInputError, match="source must be one of preset, user, transfer"):
        PruningConfig("lazy", source=source)
    for known in ("preset", "user", "transfer", "calibrated:s.json"):
        cuts = {"prune_layers": (1,), "keep": (0.5,)}
        assert PruningConfig("lazy", source=known, **cuts).source == known


@pytest.mark.parametrize("source", ["user", "transfer", "calibrated:smollm2-135m.json"])
def test_a_source_without_values_is_refused(source):
    """A source names where a schedule's values came from: given alone it made a plain
    ``lazy`` run its preset under that name (e.g. reported as calibrated)."""
    with pytest.raises(UserInputError, match="names where a schedule's cuts came from"):
        PruningConfig("lazy", source=source)
    assert PruningConfig("lazy", source="preset").source == "preset"


@pytest.mark.parametrize("given", [{"complete": "exact"}, {"max_revivals": 2},
                                   {"revive_margin": 1.0}])
def test_revival_fields_without_revive_are_refused(tiny_model, given):
    """Without revive, pruned tokens never come back: a completion mode, a revival bound or
    margin would be dropped without a word (``--no-revive --complete exact`` ran ``none``)."""
    model, _ = tiny_model("llama")
    config = PruningConfig("lazy", prune_layers=(1,), keep=(0.5,), revive=False, **given)
    with pytest.raises(UserInputError, match=f"revive=False keeps pruned tokens out for good, "
                                             f"so {next(iter(given))} would do nothing"):
        resolve_config(model, config)
    assert not resolve_config(model, PruningConfig("lazy", revive=False)).revive
    assert not resolve_config(model, PruningConfig("lazy", revive=False, complete="none",
                                                   max_revivals=0)).revive


def test_keep_fractions_for_the_presets_cuts_name_them():
    """keep without prune_layers goes with the preset's cuts, which merge on a shallow model:
    the error names them (it said "1 layers, 2 fractions" of layers the user never gave)."""
    from mlx_lazy import build_schedule

    with pytest.raises(UserInputError, match="the 'lazy' preset cuts after layer 2 of this "
                                             "4-layer model: give 1 keep fraction"):
        build_schedule(PruningConfig("lazy", keep=(1.0, 1.0)), 4)
    assert build_schedule(PruningConfig("lazy", keep=(0.5, 0.3)), 30).keep == (0.5, 0.3)
    # a fraction out of range is said first: the count's error sent a user on to the next one
    with pytest.raises(UserInputError, match=r"keep fractions must be in \(0, 1\], got 1.5"):
        build_schedule(PruningConfig("lazy", keep=(1.5,)), 30)
    with pytest.raises(UserInputError, match="quality must be one of default, high"):
        PruningConfig("lazy", quality=["high"])
