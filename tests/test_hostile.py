"""Hostile input to the server: bodies of every shape get a 2xx or an error object (never a
500, a hang or a huge echo), every field whose cost grows with its size is bounded, and the
stop check is linear."""

from __future__ import annotations

import json
import re
from typing import Iterator, List

import pytest

pytest.importorskip("fastapi")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mlx_lazy import server as server_module  # noqa: E402
from mlx_lazy.config import PruningConfig  # noqa: E402
from mlx_lazy.errors import UserInputError  # noqa: E402
from mlx_lazy.inputs import is_int, parse_int  # noqa: E402
from mlx_lazy.scorers import parse_scorer  # noqa: E402
from mlx_lazy.server_schemas import MAX_MESSAGES, MAX_STOP_CHARS, token_bytes  # noqa: E402
from mlx_lazy.server_worker import MAX_ERROR_CHARS, StopText  # noqa: E402
from test_server import Server, in_process_server  # noqa: E402

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
PROMPT_TOKENS = 64


@pytest.fixture(scope="module")
def hostile(tiny_model_path) -> Iterator[Server]:
    with in_process_server(tiny_model_path, max_prompt_tokens=PROMPT_TOKENS) as s:
        yield s


def first_stop(text: str, stops: List[str]) -> int:
    """Where the earliest of ``stops`` begins in ``text`` (-1: none)."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(found, default=-1)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text("abc", max_size=6), max_size=4),
       st.lists(st.text("abc", max_size=5), min_size=1, max_size=10))
def test_stop_text_cuts_at_the_first_stop_and_withholds_only_what_may_begin_one(stops, pieces):
    s, text, out = StopText(stops), "", ""
    for piece in pieces:
        text += piece
        emitted, hit = s.feed(piece)
        out += emitted
        at = first_stop(text, stops)
        if hit:
            assert at >= 0 and out == text[:at]
            return
        assert at < 0 and text.startswith(out)
        # what is held back is the longest tail that begins a stop
        held = text[len(out):]
        longest = max((k for stop in stops for k in range(1, len(stop))
                       if text.endswith(stop[:k])), default=0)
        assert len(held) == longest
    assert out + s.flush() == text


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=6))
def test_sizes_are_ascii_decimal_only(text):
    """``int`` reads ``3_0``, `` 7 `` and Arabic-Indic digits; a size must not."""
    ascii_digits = text.lstrip("+-")[:1].isdigit() and text.isascii()
    try:
        value = parse_int(text)
    except ValueError:
        assert not (text.isascii() and re.fullmatch(r"[+-]?[0-9]+", text))
    else:
        assert ascii_digits and value == int(text) and "_" not in text and text == text.strip()


def test_a_count_is_an_integer_and_never_a_bool():
    """``True`` is an ``int`` to Python; a numpy integer passes only where the API says so
    (it would not serialise into a schedule or cache file)."""
    import numpy as np

    assert is_int(3) and is_int(-1) and is_int(np.int64(3), numpy=True)
    assert not any(is_int(x) for x in (True, False, 3.0, "3", None, np.int64(3), np.bool_(1)))
    assert not any(is_int(x, numpy=True) for x in (True, np.bool_(1), np.float32(3), 3.0))
    with pytest.raises(UserInputError, match="must be an integer"):
        PruningConfig(method="lazy", max_revivals=True)


def test_scorer_sizes_are_ascii_decimal_only():
    """Once ``window:size=3_0`` was a window of 30 and Arabic-Indic digits a size too."""
    assert parse_scorer("window:size=30") == parse_scorer("window:size=+30")
    for bad in ("3_0", "\u0663\u0660", " 30", "\uff13\uff10", "30.0"):
        with pytest.raises(UserInputError, match="size must be int"):
            parse_scorer(f"window:size={bad}")


def status_of(s: Server, path: str, body) -> tuple:
    status, _, payload = s.request("POST", path, body)
    return status, payload


def check_error(status: int, payload) -> None:
    """A 4xx with an OpenAI-style error object whose message is short."""
    assert 400 <= status < 500, (status, payload)
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], payload
    assert len(error["message"]) <= MAX_ERROR_CHARS, len(error["message"])


def test_stop_strings_are_bounded(hostile):
    ok = {"prompt": "hi", "max_tokens": 1}
    for stop, param, why in [
            ("Z" * (MAX_STOP_CHARS + 1), "stop", "at most 500 characters"),
            (["a", "Z" * (MAX_STOP_CHARS + 1)], "stop[1]", "at most 500 characters"),
            (["a"] * 5, "stop", "at most 4 items")]:
        status, payload = status_of(hostile, COMPLETIONS, {**ok, "stop": stop})
        check_error(status, payload)
        assert status == 400 and payload["error"]["param"] == param, payload
        assert why in payload["error"]["message"], payload
    status, payload = status_of(hostile, COMPLETIONS, {**ok, "stop": ["Z" * MAX_STOP_CHARS] * 4})
    assert status == 200, payload


@pytest.mark.parametrize("path, body, headers, param, why", [
    (COMPLETIONS, {"prompt": []}, {}, "prompt", "at least 1 item"),
    # OpenAI's batches: once "prompt[0]: Input should be a valid integer"
    (COMPLETIONS, {"prompt": ["a", "b"]}, {}, "prompt", "a batch of prompts is not supported"),
    (COMPLETIONS, {"prompt": [[1, 2]]}, {}, "prompt", "a batch of prompts is not supported"),
    (COMPLETIONS, {"prompt": ""}, {}, "prompt", "at least 1 character"),
    (COMPLETIONS, {"prompt": "hi", "stop": [1]}, {}, "stop[0]", "valid string"),
    (COMPLETIONS, {"prompt": "hi", "temperature": float("nan")}, {}, "temperature",
     "finite number"),
    (COMPLETIONS, {"prompt": "hi", "top_p": float("inf")}, {}, "top_p", "finite number"),
    (COMPLETIONS, b'{"prompt": "hi"}', {"Content-Type": "application/x-www-form-urlencoded"},
     None, "must be a JSON object (sent with Content-Type: application/json)"),
    (COMPLETIONS, [1, 2], {}, None, "must be a JSON object"),
    (COMPLETIONS, b"", {}, None, "must be a JSON object"),  # once "Field required"
    # once 200 with garbage: 1e-40 is 0 in float32, and the logits divided by it inf
    (COMPLETIONS, {"prompt": "hi", "repetition_penalty": 1e-40}, {}, "repetition_penalty",
     "greater than or equal to 0.001"),
    (COMPLETIONS, {"prompt": "hi", "repetition_penalty": 1e300}, {}, "repetition_penalty",
     "less than or equal to 1000"),
    # each names the field down to the item (once "pruning", the message "each keep ...")
    (CHAT, {"messages": [{"role": "user", "content": "hi"}],
            "pruning": {"method": "lazy", "keep": [0.4, "x"]}}, {}, "pruning.keep[1]",
     "each keep fraction must be a number"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}],
            "pruning": {"method": "lazy", "prune_layers": [1, 5.0]}}, {},
     "pruning.prune_layers[1]", "each pruning layer must be an integer"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}],
            "pruning": {"method": "lazy", "scorer": "window:size=0"}}, {}, "pruning.scorer",
     "size must be an integer in [1, "),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}],
            "pruning": {"method": "lazy", "keep": "0.3"}}, {}, "pruning.keep",
     "keep must be a sequence"),
])
def test_an_error_names_what_is_wrong_where(hostile, path, body, headers, param, why):
    """The error says why the value is refused, of the type it has (an empty list prompt is
    empty, not "not a string"; NaN is not a number, not out of range; a body not sent as JSON
    says so) and names the field down to the item."""
    status, _, payload = hostile.request("POST", path, body, headers)
    check_error(status, payload)
    assert status == 400 and payload["error"]["param"] == param, payload
    assert why in payload["error"]["message"], payload
    assert "another accepted type" not in payload["error"]["message"], payload


@pytest.mark.parametrize("body, why", [
    (b'{"prompt": "caf\xe9"}', "the body is not UTF-8: byte 0xe9 at offset 15"),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests too deeply"),
    (b'{"prompt": [' + b"7" * 5000 + b"]}", "an integer too long to read"),
])
def test_a_body_that_cannot_be_read_says_why(hostile, body, why):
    """Each was "There was an error parsing the body"."""
    status, payload = status_of(hostile, COMPLETIONS, body)
    check_error(status, payload)
    assert status == 400 and why in payload["error"]["message"], payload


@pytest.mark.parametrize("field, value", [
    ("echo", True), ("suffix", "x"),
    ("best_of", 2), ("presence_penalty", 0.5), ("frequency_penalty", -1.0),
    # once answered 200 without them
    ("response_format", {"type": "json_object"}), ("tools", [{"type": "function"}]),
    ("tool_choice", "required"), ("modalities", ["audio"])])
def test_a_field_asking_what_the_server_does_not_do_is_refused(hostile, field, value):
    """Answered without what it asked for (``"logprobs": null``), a client that asked for
    log probabilities or a penalty would go on as if it had them."""
    status, payload = status_of(hostile, COMPLETIONS, {"prompt": "hi", "max_tokens": 1,
                                                       field: value})
    check_error(status, payload)
    assert status == 400 and payload["error"]["param"] == field, payload
    assert f"{field} is not supported" in payload["error"]["message"], payload


def test_the_values_clients_send_by_default_ask_nothing(hostile):
    defaults = {"logprobs": False, "top_logprobs": 0, "echo": False, "suffix": "", "best_of": 1,
                "presence_penalty": 0.0, "frequency_penalty": 0, "user": "me", "n": None,
                "response_format": {"type": "text"}, "tools": [], "tool_choice": "auto",
                "modalities": ["text"], "top_k": 0, "min_p": 0.0, "repetition_penalty": None}
    # and their empty forms (an empty list of modalities was refused)
    for field, nothing in (("modalities", []), ("response_format", {})):
        status, payload = status_of(hostile, COMPLETIONS, {"prompt": "hi", "max_tokens": 1,
                                                           field: nothing})
        assert status == 200, (field, payload)
    status, payload = status_of(hostile, COMPLETIONS, {"prompt": "hi", "max_tokens": 1,
                                                       **defaults})
    assert status == 200, payload
    status, payload = status_of(hostile, CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 1, "logprobs": None})
    assert status == 200, payload


def test_messages_are_bounded(hostile):
    messages = [{"role": "user", "content": ""}] * (MAX_MESSAGES + 1)
    status, payload = status_of(hostile, CHAT, {"messages": messages, "max_tokens": 1})
    check_error(status, payload)
    assert status == 400 and payload["error"]["param"] == "messages", payload


def test_a_text_too_long_to_fit_is_refused_before_tokenizing(hostile, tiny_model, monkeypatch):
    """Once a 7.8 MB prompt was tokenized first (13 s of CPU, +900 MB of RSS), then 413."""
    limit = PROMPT_TOKENS * token_bytes(tiny_model()[1])
    calls = []
    real = server_module.prompt_token_ids
    monkeypatch.setattr(server_module, "prompt_token_ids",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    text = "x" * (limit + 1)
    for path, body, param in [
            (COMPLETIONS, {"prompt": text}, "prompt"),
            (CHAT, {"messages": [{"role": "user", "content": text}]}, "messages"),
            (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]},
             "messages"),
            (COMPLETIONS, {"prompt": [5] * (PROMPT_TOKENS + 1)}, "prompt")]:
        status, payload = status_of(hostile, path, body)
        check_error(status, payload)
        assert status == 413 and payload["error"]["param"] == param, payload
    assert calls == []
    # a text within the bound is tokenized, and refused by its token count if it must be
    status, payload = status_of(hostile, COMPLETIONS, {"prompt": text[:limit]})
    assert status == 413 and calls == [1], payload


def test_an_error_never_echoes_a_huge_field(hostile, monkeypatch):
    """Once a 400 echoed a 400,000-item prune_layers back: 3 MB."""
    huge = "k" * 1_000_000
    for body in ({"pruning": {"method": "lazy", "prune_layers": list(range(400_000)),
                              "keep": [0.5] * 400_000}},
                 {"pruning": {"method": "lazy", huge: 1}},
                 {"logit_bias": {huge: 1000}},  # a field path through a huge key
                 {"stop": huge}):
            status, _, raw = hostile.request("POST", COMPLETIONS, json.dumps(
                {"prompt": "hi", "max_tokens": 1, **body}).encode())
            assert status == 400 and len(json.dumps(raw)) < 2 * MAX_ERROR_CHARS, raw
    # a list longer than the model's depth is refused before its items are checked
    monkeypatch.setattr(PruningConfig, "preset", None)  # would fail if reached
    status, _, raw = hostile.request("POST", COMPLETIONS, json.dumps(
        {"prompt": "hi", "pruning": {"method": "lazy", "prune_layers": list(range(5))}}).encode())
    assert status == 400 and raw["error"]["param"] == "pruning.prune_layers", raw


# ---------------------------------------------------------------- any body

_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 3),
                     st.sampled_from([10**20, -(10**20), 2**64]),
                     st.floats(allow_nan=False, allow_infinity=False),
                     st.sampled_from([1e-300, 5e-324, 0.0, 1.0, 2.5]),
                     st.text(max_size=8), st.sampled_from(["\ud800", "lazy", "full", "x" * 600]))
_JSON = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
_MESSAGE = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system",
                                                                      "assistant"]), _SCALARS),
                                  "content": st.one_of(st.text(max_size=20), _JSON)})
_FIELDS = {
    "messages": st.one_of(st.lists(_MESSAGE, max_size=3), _JSON),
    "prompt": st.one_of(st.text(max_size=20), st.lists(st.integers(-2, 400), max_size=5), _JSON),
    # valid lengths stay short: a long generation is not what is tested
    "max_tokens": st.one_of(st.integers(1, 2), st.sampled_from([0, -1, "2", 10**20, 2.0])),
    "temperature": _SCALARS, "top_p": _SCALARS, "seed": _SCALARS,
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=6), _JSON),
    "stream": st.one_of(st.booleans(), _SCALARS),
    "n": _SCALARS,
    "pruning": st.one_of(st.sampled_from(["lazy", "full", "speed", "turbo"]), _JSON,
                         st.fixed_dictionaries({"method": st.sampled_from(["lazy", "speed"])},
                                               optional={"keep": _JSON, "prune_layers": _JSON,
                                                         "scorer": _JSON, "complete": _JSON})),
    "stream_options": _JSON,
    "logit_bias": _JSON,
}
_VALID = {CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
          COMPLETIONS: {"prompt": "hi", "max_tokens": 1}}
# a valid body with up to three fields replaced (or added): deep paths get hostile values too
_CHANGES = st.lists(st.sampled_from(sorted(_FIELDS)), max_size=3, unique=True).flatmap(
    lambda keys: st.fixed_dictionaries({k: _FIELDS[k] for k in keys}))


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from([CHAT, COMPLETIONS]), changes=_CHANGES)
def test_any_body_gets_an_answer_or_an_error_object(hostile, path, changes):
    """Whatever the body, the server answers 200 or a 4xx error object with a short message
    (never a 500 or a hang) and goes on answering."""
    body = {**_VALID[path], **changes}
    status, _, payload = hostile.request("POST", path, json.dumps(body).encode())
    if status == 200:
        if isinstance(payload, dict):
            assert payload["choices"], payload
        else:  # a stream: server-sent events ending in [DONE]
            assert payload.rstrip().endswith("data: [DONE]"), payload
            assert '"generation_failed"' not in payload, payload
    else:
        check_error(status, payload)
    assert hostile.health()["status"] == "ok"
