"""The Python API against hostile input, and its parity with mlx-lm's keywords and callbacks."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

from mlx_lazy import LazyEngine, PruningConfig, UserInputError, generate, load, stream_generate
from mlx_lazy.adapter import MLX_LM_VERSIONS, check_mlx_lm_version, supported_types

REPO = Path(__file__).resolve().parents[1]
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


def tokens_of(responses) -> list[int]:
    return [r.token for r in responses]


# ---------------------------------------------------------------- hostile arguments


@pytest.mark.parametrize("max_tokens", [2.5, 0, -1, True, "3", None])
def test_bad_max_tokens_raise_at_once(tiny_model, max_tokens):
    """max_tokens=2.5 used to repeat an old token forever: run in a thread with a timeout so a
    regression fails instead of hanging the suite."""
    model, tokenizer = tiny_model("llama")
    outcome = []

    def consume():
        try:
            list(stream_generate(model, tokenizer, PROMPT, max_tokens=max_tokens))
            outcome.append("returned")
        except UserInputError as e:
            outcome.append(str(e))

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), f"stream_generate(max_tokens={max_tokens!r}) did not return"
    assert outcome and "max_tokens must be a positive integer" in outcome[0]


def test_generate_step_checks_what_stream_generate_checks(tiny_model):
    """``generate_step`` is public too: a max_tokens of another type never stopped, a
    prompt past the context ran, anchors covering the prompt pruned nothing, silently. Its
    own meanings stay mlx-lm's (0 the prompt only, a negative count no limit of its own), but a
    negative count stops where the context is full: it once ran on past it, silently."""
    from mlx_lazy import generate_step as lazy_generate_step
    from mlx_lazy import make_prompt_cache

    model, tokenizer = tiny_model("llama")
    prompt = tokenizer.encode(PROMPT)
    for bad in (2.5, "3", None, True, float("nan")):
        with pytest.raises(UserInputError, match="max_tokens must be an integer"):
            next(lazy_generate_step(prompt, model, max_tokens=bad))
    context = model.args.max_position_embeddings
    cache = make_prompt_cache(model)
    with pytest.raises(UserInputError, match="exceeds the model's context"):
        next(lazy_generate_step(prompt, model, max_tokens=context, prompt_cache=cache))
    with pytest.raises(UserInputError, match="the prompt has .* but the model's context"):
        next(lazy_generate_step([1] * (context + 1), model, max_tokens=-1))
    with pytest.raises(UserInputError, match="anchors=.* more than the prompt"):
        next(lazy_generate_step(prompt[:5], model, max_tokens=2,
                                config=PruningConfig("speed", anchors=6)))
    assert len(cache) == 0  # refused before the prompt went in
    assert len(list(lazy_generate_step(prompt, model, max_tokens=np.int64(3)))) == 3
    assert list(lazy_generate_step(prompt, model, max_tokens=0)) == []
    steps = lazy_generate_step(prompt, model, max_tokens=-1)
    assert len([next(steps) for _ in range(5)]) == 5
    full = lazy_generate_step([1] * (context - 3), model, max_tokens=-1)
    assert len(list(itertools.islice(full, 10))) == 3


def test_an_empty_model_name_is_one_message():
    """``load("")`` once said "cannot load model : no config.json" (the current folder)."""
    with pytest.raises(UserInputError, match="^the model is empty; give a named model"):
        load("")


def test_verbose_generate_prints_the_command_lines_summary(tiny_model, capsys):
    """generate(verbose=True) prints the text, then the summary the command line prints (it
    once built its own lines, without the pruning's)."""
    model, tokenizer = tiny_model("llama")
    text = generate(model, tokenizer, "the passkey is", max_tokens=3, verbose=True,
                    config="lazy")
    out = capsys.readouterr().out
    head, summary = out.split("\n==========\n")
    assert head == text and summary.splitlines()[0].startswith("Prompt: ")
    assert "Pruning (lazy): " in summary and "whole answer" in summary


def test_numpy_integer_max_tokens_is_accepted(tiny_model):
    model, tokenizer = tiny_model("llama")
    assert len(list(stream_generate(model, tokenizer, PROMPT, max_tokens=np.int64(2)))) == 2


@pytest.mark.parametrize("bad", [10**7, 2**31, 2**40, -1, 384])
def test_token_ids_outside_the_vocabulary_are_rejected(tiny_model, bad):
    """Ids >= the vocabulary used to crash the process (MLX does not bounds-check the
    embedding lookup) or, for -1 and the vocabulary size itself, give silent garbage."""
    model, tokenizer = tiny_model("llama")
    vocab = model.model.embed_tokens.weight.shape[0]
    assert vocab == 384
    for prompt in ([1, bad], np.array([1, bad]) if abs(bad) < 2**31 else [bad, 1]):
        with pytest.raises(UserInputError) as err:
            list(stream_generate(model, tokenizer, prompt, max_tokens=2))
        assert f"token id {bad}" in str(err.value) and f"vocabulary of {vocab}" in str(err.value)


@pytest.mark.parametrize("prompt, message", [
    ([1, 2.5], "token ids must be integers"),
    ([1, True], "token ids must be integers"),
    (mx.array([1.0, 2.0]), "integer token ids"),
    (mx.array([[1, 2]]), "1-D"),
    (np.array([[1, 2]]), "1-D"),
    (5, "text or token ids"),
    ([], "the prompt is empty"),
    ("caf\udce9", "not valid text"),  # a lone surrogate: an undecodable byte from argv
])
def test_malformed_prompts_are_rejected(tiny_model, prompt, message):
    model, tokenizer = tiny_model("llama")
    with pytest.raises(UserInputError) as err:
        list(stream_generate(model, tokenizer, prompt, max_tokens=2))
    assert message in str(err.value)


def test_token_id_prompts_in_every_form_agree(tiny_model):
    model, tokenizer = tiny_model("llama")
    ids = tokenizer.encode(PROMPT)
    runs = [tokens_of(stream_generate(model, tokenizer, p, max_tokens=3))
            for p in (ids, tuple(ids), np.array(ids), mx.array(ids), PROMPT)]
    assert all(r == runs[0] for r in runs)


@pytest.mark.parametrize("config", [5, {"method": "lazy"}, ["lazy"]])
def test_config_of_the_wrong_type_is_rejected(tiny_model, config):
    model, tokenizer = tiny_model("llama")
    with pytest.raises(UserInputError, match="config must be a PruningConfig"):
        list(stream_generate(model, tokenizer, PROMPT, max_tokens=2, config=config))


def test_more_anchors_than_prompt_tokens_is_an_error(tiny_model):
    model, tokenizer = tiny_model("llama")
    ids = tokenizer.encode(PROMPT)
    config = PruningConfig("lazy", prune_layers=(1,), keep=(0.5,), anchors=1000)
    with pytest.raises(UserInputError, match=f"anchors=1000 is more than the prompt's {len(ids)}"):
        list(stream_generate(model, tokenizer, ids, max_tokens=2, config=config))
    config = PruningConfig("lazy", prune_layers=(1,), keep=(0.5,), anchors=len(ids))
    assert len(list(stream_generate(model, tokenizer, ids, max_tokens=2, config=config))) == 2


# ---------------------------------------------------------------- model folders


def _folder_with(tiny_model_path, tmp_path, edit) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_path, folder)
    edit(folder)
    return folder


def _config_edit(value):
    def edit(folder):
        (folder / "config.json").write_text(value if isinstance(value, str) else json.dumps(value))
    return edit


def _truncate(folder):
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])


def _llama_config(tiny_model_path, **changes):
    config = json.loads((tiny_model_path / "config.json").read_text())
    config.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del config[key]
    return config


def test_a_hub_id_for_a_sharded_load_downloads_as_mlx_lm_does(monkeypatch, tmp_path):
    """A hub id resolves to the folder huggingface_hub's snapshot_download gives, with
    mlx-lm's file patterns (it went through a private function of mlx-lm's)."""
    import huggingface_hub
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    from mlx_lazy.models import model_folder

    calls = []

    def snapshot_download(repo, **kwargs):
        calls.append((repo, kwargs))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert model_folder("mlx-community/Some-Model-4bit", local=True) == (str(tmp_path), False)
    assert calls == [("mlx-community/Some-Model-4bit",
                      {"allow_patterns": DEFAULT_ALLOW_PATTERNS})]
    assert model_folder("mlx-community/Some-Model-4bit") == ("mlx-community/Some-Model-4bit",
                                                             False) and len(calls) == 1


@pytest.mark.parametrize("case, fragments", [
    ("truncated", ["model.safetensors is truncated"]),
    ("no model_type", ["config.json has no model_type"]),
    ("list", ["config.json must hold a JSON object, not list"]),
    ("not json", ["cannot read", "config.json"]),
    ("rwkv7", ["unsupported model type 'rwkv7'", "config.json"]),
    ("dbrx", ["unsupported model type 'dbrx'"]),
    ("no weights", ["no model*.safetensors"]),
    ("missing", ["no such folder"]),
    ("a gguf file", ["a file, not a model folder", "mlx-lazy-convert"]),
])
def test_broken_model_folders_are_one_short_message(tiny_model_path, tmp_path, case, fragments):
    edits = {
        "truncated": _truncate,
        "no model_type": _config_edit(_llama_config(tiny_model_path, model_type=None)),
        "list": _config_edit([]),
        "not json": _config_edit("{'model_type': llama"),
        "rwkv7": _config_edit(_llama_config(tiny_model_path, model_type="rwkv7")),
        "dbrx": _config_edit(_llama_config(tiny_model_path, model_type="dbrx")),
        "no weights": lambda folder: (folder / "model.safetensors").unlink(),
        "missing": lambda folder: shutil.rmtree(folder),
        "a gguf file": lambda folder: None,
    }
    folder = _folder_with(tiny_model_path, tmp_path, edits[case])
    if case == "a gguf file":
        folder = folder / "model.gguf"
        folder.write_bytes(b"GGUF")
    with pytest.raises(UserInputError) as err:
        load(folder)
    message = str(err.value)
    assert all(f in message for f in fragments), message
    # the path is pytest's; the listing of supported types grows with them
    short = message.replace(str(folder), "").replace(supported_types(), "")
    assert len(short) < 300 and "\n" not in message


def test_mlx_lm_load_errors_are_user_errors_and_short(tiny_model_path, tmp_path):
    """A supported family whose weights do not match its config: mlx-lm's page-long list of
    parameters becomes one short line."""
    folder = _folder_with(tiny_model_path, tmp_path, _config_edit(
        _llama_config(tiny_model_path, hidden_size=32)))
    with pytest.raises(UserInputError) as err:
        load(folder)
    assert str(err.value).startswith(f"cannot load model {folder}")
    assert len(str(err.value)) <= 300


def test_a_bad_attention_variable_is_refused_before_the_model_loads(tiny_model_path,
                                                                    monkeypatch):
    import mlx_lm

    def refuse(*args, **kw):
        raise AssertionError("the model was loaded before the bad variable was reported")

    monkeypatch.setattr(mlx_lm, "load", refuse)
    monkeypatch.setenv("MLX_LAZY_ATTENTION", "bogus")
    with pytest.raises(UserInputError, match="MLX_LAZY_ATTENTION must be one of fast, "
                                             "cpu-kernel, got 'bogus'"):
        load(tiny_model_path)


# ---------------------------------------------------------------- mlx-lm parity


def test_unsupported_mlx_lm_keywords_are_named(tiny_model):
    model, tokenizer = tiny_model("llama")
    with pytest.raises(UserInputError) as err:
        list(stream_generate(model, tokenizer, PROMPT, max_tokens=2, max_kv_size=8, kv_bits=4))
    assert "kv_bits, max_kv_size" in str(err.value)
    with pytest.raises(UserInputError, match="make_prompt_cache"):  # mlx-lm's cache: a list
        list(stream_generate(model, tokenizer, PROMPT, max_tokens=2, prompt_cache=[]))
    with pytest.raises(UserInputError, match="draft_model"):
        generate(model, tokenizer, PROMPT, max_tokens=2, draft_model=model)
    # mlx-lm's defaults (None) are accepted, so mlx-lm call sites work unchanged.
    text = generate(model, tokenizer, PROMPT, max_tokens=2, draft_model=None, kv_bits=None)
    assert text == generate(model, tokenizer, PROMPT, max_tokens=2)
    with pytest.raises(TypeError, match="temperature"):  # not mlx-lm's either
        list(stream_generate(model, tokenizer, PROMPT, max_tokens=2, temperature=0.5))


def test_logits_processors_match_mlx_lm(tiny_model):
    """A repetition penalty through ``logits_processors`` gives mlx-lm's tokens, and differs
    from the unpenalised run (so the processors are really applied)."""
    model, tokenizer = tiny_model("qwen2")
    ids = tokenizer.encode(PROMPT)
    n = 24

    def ours(**kw):
        return tokens_of(stream_generate(model, tokenizer, ids, max_tokens=n, **kw))

    def theirs(**kw):
        return [t for t, _ in generate_step(mx.array(ids), model, max_tokens=n, **kw)]

    processors = make_logits_processors(repetition_penalty=3.0, repetition_context_size=16)
    penalised = ours(logits_processors=processors)
    assert penalised == theirs(logits_processors=processors)
    assert ours() == theirs()
    assert penalised != ours()


def test_prompt_progress_counts_tokens_like_mlx_lm(tiny_model):
    model, tokenizer = tiny_model("llama")
    ids = tokenizer.encode(PROMPT)
    n, layers = len(ids), model.args.num_hidden_layers
    ours, theirs = [], []
    list(stream_generate(model, tokenizer, ids, max_tokens=2,
                         prompt_progress_callback=lambda *a: ours.append(a)))
    list(generate_step(mx.array(ids), model, max_tokens=2,
                       prompt_progress_callback=lambda *a: theirs.append(a)))
    # mlx-lm: (0, n) first, (n, n) once the first token is out, (processed, n) in between.
    assert ours[0] == theirs[0] == (0, n) and ours[-1] == theirs[-1] == (n, n)
    done = [p for p, _ in ours]
    assert done == sorted(set(done)) and all(total == n for _, total in ours)
    # In between, the layers done count as token equivalents (not layers) below n.
    assert done[1:-1] == [min(n - 1, n * k // layers) for k in range(1, layers + 1)]


@pytest.mark.slow  # runs a process of its own
def test_generate_is_the_function_in_every_import_order():
    """``import mlx_lazy.generate`` (the CLI module, named like mlx-lm's) must not replace the
    package's ``generate`` function, whichever is imported first."""
    sys.modules.pop("mlx_lazy.generate", None)
    import mlx_lazy.generate  # noqa: F401  (after the package)

    assert mlx_lazy.generate is mlx_lazy.api.generate
    assert callable(sys.modules["mlx_lazy.generate"].main)
    code = ("import mlx_lazy.generate, mlx_lazy, mlx_lazy.api as api, sys; "
            "from mlx_lazy import generate; "
            "assert mlx_lazy.generate is generate is api.generate, mlx_lazy.generate; "
            "assert sys.modules['mlx_lazy.generate'].main; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


def test_mlx_lm_outside_the_tested_range_is_refused(tiny_model, monkeypatch):
    lo, hi = MLX_LM_VERSIONS
    check_mlx_lm_version(f"{lo[0]}.{lo[1]}.0")
    for version in (f"{lo[0]}.{lo[1] - 1}.9", f"{hi[0]}.{hi[1]}.0", "1.0", "nonsense"):
        with pytest.raises(UserInputError, match=r"pip install 'mlx-lm>="):
            check_mlx_lm_version(version)
    model, _ = tiny_model("llama")
    monkeypatch.setattr("mlx_lazy.adapter._installed_mlx_lm", lambda: f"{hi[0]}.{hi[1] + 5}.1")
    with pytest.raises(UserInputError, match=f"mlx-lm {hi[0]}.{hi[1] + 5}.1 is installed"):
        LazyEngine(model)


def test_pinned_mlx_lm_range_matches_the_check():
    """pip's requirement (the installed metadata) admits exactly the versions the check does."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    pinned = [r for r in map(Requirement, requires("mlx-lazy")) if r.name == "mlx-lm"]
    assert len(pinned) == 1
    (lo_major, lo_minor), (hi_major, hi_minor) = MLX_LM_VERSIONS
    for version in (f"{lo_major}.{lo_minor - 1}.9", f"{lo_major}.{lo_minor}.0",
                    f"{lo_major}.{lo_minor}.7", f"{hi_major}.{hi_minor - 1}.5",
                    f"{hi_major}.{hi_minor}.0", f"{hi_major + 1}.0.0"):
        try:
            check_mlx_lm_version(version)
            accepted = True
        except UserInputError:
            accepted = False
        assert pinned[0].specifier.contains(version) == accepted, version


def test_stats_time_the_whole_answer_and_count_the_prompt_token_layers(tiny_model):
    """``answer_s`` runs from the call to the last token (the first token's time plus every
    gap after it); ``prompt_token_layers_computed_pct`` is the share of the prompt's
    (token, layer) pairs computed by the end: 100 unpruned, below 100 and at least the
    prefill's share when decoding stays on the pruned state."""
    from mlx_lazy import make_prompt_cache

    model, tokenizer = tiny_model("llama")
    n, layers = 200, model.args.num_hidden_layers
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, model.args.vocab_size, n)]
    # one cut after layer 0 keeping 25%, nothing completed: the prefill computes
    # 1 + 0.25 (layers - 1) layers a token; revivals in decode add to that
    pruned = PruningConfig("lazy", prune_layers=(0,), keep=(0.25,), complete="none")
    for config, low, high in ((PruningConfig("full"), 100.0, 100.0),
                              (pruned, 100 * (1 + 0.25 * (layers - 1)) / layers, 99.9)):
        cache = make_prompt_cache(model, config)
        for last in stream_generate(model, tokenizer, prompt, max_tokens=6, prompt_cache=cache):
            # the same share counted another way when the token is handed out (each (token,
            # layer) computed once here; on the CPU the last token runs after it)
            computed = cache.engine.cache.computed[:, :n].astype(bool).sum()
            counted = 100 * computed / (n * layers)
        s = last.stats
        assert s.answer_s == pytest.approx(s.ttft_s + s.tpot_s * (s.generation_tokens - 1))
        assert s.answer_s > s.ttft_s > 0
        assert s.prompt_token_layers_computed_pct == pytest.approx(counted)
        assert low <= s.prompt_token_layers_computed_pct <= high


def test_the_supported_types_listing_names_each_type_once():
    """The listing an unsupported model's message shows folds each type's variants into it
    (``gemma3(_text)``); expanded again it is exactly the supported list."""
    from mlx_lazy.adapter import SUPPORTED_MODEL_TYPES, supported_types

    import re

    expanded = []
    for item in supported_types().split(", "):
        base, variants = re.fullmatch(r"([\w-]+)((?:\(\w+\))*)", item).groups()
        expanded += [base] + [base + v for v in re.findall(r"\((\w+)\)", variants)]
    assert sorted(expanded) == sorted(SUPPORTED_MODEL_TYPES)
    # folded by suffix only: Gemma 3 and Qwen 3 stand apart from Gemma 1 and Qwen 1
    assert {"gemma", "gemma3(_text)", "qwen", "qwen3(_moe)"} <= set(supported_types().split(", "))
