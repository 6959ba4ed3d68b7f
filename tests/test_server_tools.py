"""Tool calls through the server: the pieces (splitting generated text at the tokenizer's
markers, parsing, assembling an answer, the stop check around calls, where a prompt's tool
definitions end), the request schema, scripted generations through the real worker and HTTP
side (a tiny model whose chat template renders tools, its text replaced by a script), the
tool definitions kept at every cut of a pruned prefill, and a real agent turn on
Qwen2.5-Coder-0.5B.
"""

from __future__ import annotations

import mlx_lazy  # noqa: F401  (OpenBLAS before mlx)

import dataclasses
import json
import shutil
import sys
from pathlib import Path
from typing import Iterator, List

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_server import LONG_TEXT, Server, in_process_server  # noqa: E402

from mlx_lazy import server_worker  # noqa: E402
from mlx_lazy.server_schemas import MAX_SCHEMA_DEPTH, MAX_TOOLS  # noqa: E402
from mlx_lazy.server_tools import (CallSplitter, ChatOutput, parse_calls,  # noqa: E402
                                   tools_end)
from mlx_lazy.server_worker import Call, Delta, StopText, _emit  # noqa: E402
from mlx_lazy.server_logprobs import Aligner, TokenLogprob  # noqa: E402
from mlx_lm.tool_parsers.json_tools import parse_tool_call  # noqa: E402

START, END = "<tool_call>", "</tool_call>"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALL_TEXT = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'

#: A chat template that renders tools before the messages, with the markers and the
#: ``tool_call.name`` that make mlx-lm infer its json_tools parser (as for Qwen 2.5).
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n"
    "{{ tool | tojson }}{% endfor %}\n</tools>\nCall one as <tool_call>{\"name\": ..., "
    "\"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}"
    "<tool_call>{\"name\": \"{{ tool_call.name }}\", \"arguments\": "
    "{{ tool_call.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# ---------------------------------------------------------------- the pieces


def split(chunks: List[str], cut: bool = False) -> list:
    """``chunks`` fed one by one, then finished; adjacent text pieces joined."""
    splitter = CallSplitter(START, END)
    pieces = [p for c in chunks for p in splitter.feed(c)] + splitter.finish(cut)
    out: list = []
    for kind, text in pieces:
        if out and kind == out[-1][0] == "text":
            out[-1] = ("text", out[-1][1] + text)
        else:
            out.append((kind, text))
    return out


@pytest.mark.parametrize("text, want", [
    ("no call here", [("text", "no call here")]),
    (f"{START}{CALL_TEXT}{END}", [("call", CALL_TEXT)]),
    (f"Let me check.{START}{CALL_TEXT}{END}Done.",
     [("text", "Let me check."), ("call", CALL_TEXT), ("text", "Done.")]),
    (f"{START}a{END}\n{START}b{END}", [("call", "a"), ("text", "\n"), ("call", "b")]),
    ("a < b and <tool_ca", [("text", "a < b and <tool_ca")]),  # a marker's start, then the end
])
def test_the_splitter_finds_calls_however_the_text_is_chunked(text, want):
    """Whole, a character at a time, or in chunks that split the markers (``<tool`` then
    ``_call>``), the pieces are the same."""
    assert split([text]) == want
    assert split(list(text)) == want
    assert split([text[i:i + 5] for i in range(0, len(text), 5)]) == want


def test_the_splitter_withholds_only_what_may_begin_a_marker():
    splitter = CallSplitter(START, END)
    assert splitter.feed("Sure <tool") == [("text", "Sure ")]  # "<tool" may open a call
    assert splitter.feed("box>") == [("text", "<toolbox>")]  # it did not
    assert splitter.feed("<tool_call>{\"na") == [] and splitter.in_call  # a call waits whole
    assert splitter.feed("me\": \"f\"}</tool_call>") == [("call", '{"name": "f"}')]


def test_an_unterminated_call_is_text_when_cut_and_a_call_when_the_model_ended_it():
    opened = ["Checking.", START, '{"name": "get_weather", "argu']
    # max_tokens cut it: its raw text, markers included, is the answer's text
    assert split(opened, cut=True) == [("text", "Checking."),
                                       ("raw", START + '{"name": "get_weather", "argu')]
    # the model's end-of-sequence token ended it: read as a call (mlx-lm's server's reading)
    assert split([START, CALL_TEXT], cut=False) == [("call", CALL_TEXT)]


def test_a_format_without_a_closing_marker_calls_to_the_end():
    """Mistral's ``[TOOL_CALLS]`` has no closing marker: its calls run to the answer's end."""
    splitter = CallSplitter("[TOOL_CALLS]", "")
    assert splitter.feed("Sure.[TOOL_") == [("text", "Sure.")]
    assert splitter.feed('CALLS][{"name": "f"}]') == [] and splitter.in_call
    assert splitter.finish(cut=False) == [("call", '[{"name": "f"}]')]


def test_calls_parse_into_openai_tool_calls():
    [call] = parse_calls(parse_tool_call, CALL_TEXT, [WEATHER])
    assert call["id"].startswith("call_") and len(call["id"]) > 10 and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert isinstance(call["function"]["arguments"], str)
    # arguments given as a JSON string are read the same; none are {}
    [again] = parse_calls(parse_tool_call, '{"name": "f", "arguments": "{\\"a\\": 1}"}', None)
    assert json.loads(again["function"]["arguments"]) == {"a": 1}
    [bare] = parse_calls(parse_tool_call, '{"name": "f"}', None)
    assert bare["function"]["arguments"] == "{}"
    # a parser that reads two calls in one text gives both, each its own id
    two = parse_calls(lambda text, tools: [{"name": "a", "arguments": {}},
                                           {"name": "b", "arguments": {"x": 1}}], "", None)
    assert [c["function"]["name"] for c in two] == ["a", "b"] and two[0]["id"] != two[1]["id"]
    # an id the parser read (Mistral's) is kept
    [own] = parse_calls(lambda text, tools: {"id": "abc123XYZ", "name": "f", "arguments": {}},
                        "", None)
    assert own["id"] == "abc123XYZ"
    for bad in ('{"name": "get_weather", "arguments": {"city": "Par', "not json", "[1, 2]",
                '{"arguments": {}}', '{"name": "", "arguments": {}}',
                '{"name": "f", "arguments": [1]}', '{"name": "f", "arguments": "{oops"}'):
        assert parse_calls(parse_tool_call, bad, [WEATHER]) is None, bad


def test_an_answer_assembles_text_and_calls():
    output = ChatOutput(parse_tool_call, [WEATHER], (START, END))
    sent = [output.content("Let me check."), output.content("\n")]
    text, calls = output.call(CALL_TEXT)
    sent += [text, output.content("\n")]
    text2, calls2 = output.call('{"name": "get_weather", "arguments": {"city": "Rome"}}')
    sent += [text2, output.end()]
    # the newlines between and after the calls are not the answer's content
    assert "".join(sent) == "Let me check."
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls + calls2] == [
        "Paris", "Rome"]
    assert output.calls == 2 and output.finish_reason("stop") == "tool_calls"
    assert output.finish_reason("length") == "length"
    # an unparsable call is text, markers and all; without calls nothing is withheld at the end
    output = ChatOutput(parse_tool_call, [WEATHER], (START, END))
    assert output.call("<xml>no</xml>") == (f"{START}<xml>no</xml>{END}", [])
    assert output.content("\n") == "" and output.end() == "\n"
    assert output.finish_reason("stop") == "stop"
    # no tools offered: text passes as it is
    assert ChatOutput().content("\n") == "\n"


class _Job:
    def __init__(self) -> None:
        self.events: list = []

    def emit(self, item) -> None:
        self.events.append(item)


def test_stop_strings_never_cut_a_call_nor_match_across_one():
    job = _Job()
    stop = StopText(["}", "bc"])
    hit = _emit(job, stop, [("text", "ab"), ("call", '{"name": "f"}'), ("text", "cd")])
    # "}" inside the call is no stop; "b" + "c" on either side of it is no stop either
    assert not hit
    assert job.events == [Delta("a"), Delta("b"), Call('{"name": "f"}'), Delta("cd")]
    job = _Job()
    assert _emit(job, StopText(["}"]), [("call", "{}"), ("text", "x}y"), ("text", "z")])
    assert job.events == [Call("{}"), Delta("x")]  # text after the call still stops
    job = _Job()
    assert not _emit(job, StopText(["argu"]), [("raw", START + '{"argu')])
    assert job.events == [Delta(START + '{"argu')]  # an unterminated call's text, whole


def _shown(events) -> list:
    """Events as (kind, text, their tokens)."""
    return [(type(e).__name__, e.text, [t.token for t in e.logprobs]) for e in events]


def test_each_token_goes_out_with_the_text_that_ends_its_own():
    """Log probabilities: a token goes with the event where its text ends (held back by a
    possible stop, it waits), a call's with the call; at a stop string those any of whose
    text is before it go out with the last text, the rest never."""
    def token(text: str, raw: bytes = b"") -> TokenLogprob:
        return TokenLogprob(text, tuple(raw or text.encode()), -1.0)

    job, aligner, stop = _Job(), Aligner(), StopText(["de"])
    for text in ("ab", "cd", "ef"):
        aligner.add(token(text), len(text))
        hit = _emit(job, stop, [("text", text)], [(len(text), 0)], aligner)
    # "d" may begin "de": withheld, its token too; at "de", "cd" began before the stop and
    # "ef" is all in it or after
    assert hit and _shown(job.events) == [("Delta", "ab", ["ab"]), ("Delta", "c", []),
                                          ("Delta", "", ["cd"])]
    assert aligner.rest() == []
    # a token without text of its own (part of a character) goes with the next text, each
    # at the character its first byte is part of; a call's tokens with the call
    job, aligner = _Job(), Aligner()
    splitter = CallSplitter(START, END)
    for tok, text in [(token("a"), "a"), (token("bytes:\\xc3", b"\xc3"), ""),
                      (token("bytes:\\xa9", b"\xa9"), "\u00e9"), (token(START), START),
                      (token("{}"), "{}"), (token(END), END), (token("ok"), "ok"),
                      (token(" "), ""), (token("x"), " x")]:  # a space held for the next
        aligner.add(tok, len(text))
        assert not _emit(job, StopText([]), splitter.feed(text), splitter.spans, aligner)
    assert _shown(job.events) == [("Delta", "a", ["a"]),
                                  ("Delta", "\u00e9", ["bytes:\\xc3", "bytes:\\xa9"]),
                                  ("Call", "{}", [START, "{}", END]), ("Delta", "ok", ["ok"]),
                                  ("Delta", " x", [" ", "x"])]
    # where each begins in the text fed
    offsets = [t.offset for e in job.events for t in e.logprobs]
    n = len(START + END)
    assert offsets == [0, 1, 1, 2, 2 + len(START), 4 + len(START), 4 + n, 6 + n, 7 + n]
    # a call still open at the end: its tokens go with it, read as a call or as its raw text
    for cut, shown in ((False, ("Call", "{}")), (True, ("Delta", START + "{}"))):
        job, aligner, splitter = _Job(), Aligner(), CallSplitter(START, END)
        for text in ("ok", START, "{}"):
            aligner.add(token(text), len(text))
            assert not _emit(job, StopText([]), splitter.feed(text), splitter.spans, aligner)
        assert not _emit(job, StopText([]), splitter.finish(cut), splitter.spans, aligner)
        assert _shown(job.events) == [("Delta", "ok", ["ok"]), (*shown, [START, "{}"])]


def test_the_tool_definitions_end_where_the_renderings_meet_again():
    rest = [7, 8, 9, 10]
    assert tools_end([1, 2, 50, 51, 52, 3] + rest, [1, 2, 3] + rest) == 5  # after the block
    assert tools_end([50, 51] + rest, rest) == 2
    assert tools_end(rest + [50, 51, 10], rest + [10]) == 6  # definitions last: all before
    assert tools_end(rest, rest) == 0  # a template that does not render them
    assert tools_end([1, 1, 1], [1, 1]) == 3  # repeats: the prefix wins, never overlaps


# ---------------------------------------------------------------- a tiny model that takes tools


@pytest.fixture(scope="module")
def tool_model_path(tiny_model_path, tmp_path_factory) -> Path:
    """The tiny llama model with :data:`TOOLS_TEMPLATE` as its chat template."""
    folder = tmp_path_factory.mktemp("tiny-tools") / "model"
    shutil.copytree(tiny_model_path, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {**config, "chat_template": TOOLS_TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def tool_server(tool_model_path) -> Iterator[Server]:
    with in_process_server(tool_model_path, max_prompt_tokens=900) as s:
        yield s


@pytest.fixture
def scripted(monkeypatch):
    """``scripted(pieces, finish)``: the next generations' texts are ``pieces``, one per
    token, the last one's finish reason ``finish``; the tokens, counts and statistics are
    the tiny model's own (a request must ask for at least ``len(pieces)`` tokens)."""
    real = server_worker.stream_generate

    def script(pieces: List[str], finish: str = "stop") -> None:
        def fake(*args, **kw):
            for i, resp in enumerate(real(*args, **kw)):
                last = i == len(pieces) - 1
                yield dataclasses.replace(resp, text=pieces[i],
                                          finish_reason=finish if last else None)
                if last:
                    return

        monkeypatch.setattr(server_worker, "stream_generate", fake)

    return script


QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
NEVER_EOS = {"logit_bias": {"100": 100}}  # the tiny model's text is replaced: never its EOS


def chat(server: Server, stream: bool, max_tokens: int = 40, **kw):
    """A request offering the weather tool: the whole response, or its chunks."""
    request = dict(model="any", messages=QUESTION, tools=[WEATHER], max_tokens=max_tokens,
                   extra_body=NEVER_EOS, **kw)
    if not stream:
        return server.client().chat.completions.create(**request)
    return list(server.client().chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True}))


def streamed(chunks) -> tuple:
    """A stream's content, its tool calls and finish reason."""
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    return content, calls, [c.choices[0].finish_reason for c in chunks if c.choices][-1]


MARKER_SPLIT = ["I will check", ".\n", "<to", "ol_", "call", ">\n{\"name\": \"get_", "weather\", ",
                "\"arguments\": {\"city\": ", "\"Paris\"}}\n</tool", "_call>", "\n"]


def test_a_call_comes_back_as_tool_calls_whole_and_streamed(tool_server, scripted):
    scripted(MARKER_SPLIT, "stop")
    r = chat(tool_server, stream=False)
    message, choice = r.choices[0].message, r.choices[0]
    assert message.content == "I will check.\n" and choice.finish_reason == "tool_calls"
    [call] = message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Paris"})
    assert r.usage.completion_tokens == len(MARKER_SPLIT)  # every token counted, calls too

    chunks = chat(tool_server, stream=True)
    content, calls, finish = streamed(chunks)
    assert (content, finish) == ("I will check.\n", "tool_calls")
    [streamed_call] = calls  # sent once, whole, when it closed
    assert streamed_call.index == 0 and streamed_call.id.startswith("call_")
    assert streamed_call.function.model_dump() == call.function.model_dump()
    assert chunks[-1].usage.completion_tokens == len(MARKER_SPLIT)
    assert chunks[0].choices[0].delta.role == "assistant"


def test_two_calls_are_numbered_and_a_call_only_answer_has_null_content(tool_server, scripted):
    pieces = [START, '{"name": "get_weather", "arguments": {"city": "Paris"}}', END, "\n",
              START, '{"name": "get_weather", "arguments": {"city": "Rome"}}', END]
    scripted(pieces, "stop")
    r = chat(tool_server, stream=False)
    assert r.choices[0].message.content is None  # as OpenAI answers a call-only turn
    cities = [json.loads(c.function.arguments)["city"] for c in r.choices[0].message.tool_calls]
    assert cities == ["Paris", "Rome"]
    content, calls, finish = streamed(chat(tool_server, stream=True))
    assert content == "" and finish == "tool_calls"
    assert [(c.index, json.loads(c.function.arguments)["city"]) for c in calls] == [
        (0, "Paris"), (1, "Rome")]


def test_a_call_cut_by_max_tokens_is_its_raw_text(tool_server, scripted):
    pieces = ["Checking: ", START, '{"name": "get_weather", ', '"arguments": {"ci']
    scripted(pieces, "length")
    r = chat(tool_server, stream=False, max_tokens=len(pieces))
    want = "Checking: " + "".join(pieces[1:])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (want, "length")
    assert r.choices[0].message.tool_calls is None
    assert streamed(chat(tool_server, stream=True, max_tokens=len(pieces))) == (
        want, [], "length")


def test_a_stop_string_cuts_the_text_but_never_a_call(tool_server, scripted):
    pieces = ["Let me see", START, '{"name": "get_weather", "arguments": {"city": "Paris"}}',
              END, " and then } more"]
    scripted(pieces, "length")
    for stream in (False, True):
        r = chat(tool_server, stream=stream, stop=["}"])
        if stream:
            content, [call], finish = streamed(r)
        else:
            content, [call] = r.choices[0].message.content, r.choices[0].message.tool_calls
            finish = r.choices[0].finish_reason
        # "}" inside the call's arguments is not a stop; the one after it is
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        assert (content, finish) == ("Let me see and then ", "tool_calls")


def test_logprobs_hold_the_contents_tokens_only(tool_server, scripted):
    """The tokens of a call made (markers included) and of the whitespace dropped after it
    are no content's: their log probabilities are left out; a call answered as its raw text
    is content, and its tokens are in."""
    def counts(pieces, finish) -> list:
        scripted(pieces, finish)
        whole = chat(tool_server, stream=False, max_tokens=len(pieces), logprobs=True)
        chunks = chat(tool_server, stream=True, max_tokens=len(pieces), logprobs=True,
                      top_logprobs=1)
        streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                    for e in c.choices[0].logprobs.content]
        assert all(len(e.top_logprobs) == 1 for e in streamed)
        return [len(whole.choices[0].logprobs.content), len(streamed)]

    assert counts(MARKER_SPLIT, "length") == [2, 2]  # "I will check", ".\n"
    cut = ["Checking: ", START, '{"name": "get_weather", ', '"arguments": {"ci']
    assert counts(cut, "length") == [4, 4]


def test_tool_choice_none_neither_offers_nor_parses(tool_server, scripted):
    pieces = [START, '{"name": "get_weather", "arguments": {}}', END]
    scripted(pieces, "stop")
    r = chat(tool_server, stream=False, tool_choice="none")
    assert r.choices[0].message.content == "".join(pieces)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    # nor rendered: the prompt is the one without tools
    plain = tool_server.client().chat.completions.create(
        model="any", messages=QUESTION, max_tokens=1, extra_body=NEVER_EOS)
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens
    offered = chat(tool_server, stream=False, max_tokens=len(pieces))
    assert offered.usage.prompt_tokens > plain.usage.prompt_tokens


def positions_kept(caches: list, cut: int) -> List[List[int]]:
    engine = caches[-1].engine
    return [sorted(layer.cached_positions().tolist())
            for layer in engine.cache.layers[cut + 1:]]


def test_pruning_keeps_the_tool_definitions_at_every_cut(tool_server, tool_model_path,
                                                         monkeypatch):
    """With tools offered, the tokens up to the end of their definitions are the request's
    anchors: cuts keeping 10% and 5% (fewer tokens than the definitions hold) keeps them
    all, in every layer above each cut; usage.pruning.anchors says how many."""
    from mlx_lm import load as mlx_lm_load

    tokenizer = mlx_lm_load(str(tool_model_path))[1]
    messages = [{"role": "user", "content": LONG_TEXT + "What is the weather in Paris?"}]
    text = tokenizer.apply_chat_template(messages, tools=[WEATHER], tokenize=False,
                                         add_generation_prompt=True)
    want = len(tokenizer.encode(text[: text.index("<|im_start|>user")],
                                add_special_tokens=False))
    n = len(tokenizer.encode(text, add_special_tokens=False))
    caches: list = []
    real = server_worker.make_prompt_cache
    monkeypatch.setattr(server_worker, "make_prompt_cache",
                        lambda *a, **kw: caches.append(real(*a, **kw)) or caches[-1])
    cuts = (0, 2)
    pruning = {"method": "lazy", "prune_layers": list(cuts), "keep": [0.1, 0.05],
               "revive": False, "complete": "none"}  # the prefill's cuts stay as they were
    assert 50 < want < 0.5 * n and want > 0.1 * n  # the cut alone could not keep them
    r = tool_server.client().chat.completions.create(
        model="any", messages=messages, tools=[WEATHER], max_tokens=2,
        extra_body={"pruning": pruning})
    # the block and the conversation both begin with <|im_start|>: the renderings align it
    # either way, and the shared prefix is taken first (one token more, never fewer)
    anchors = r.usage.model_extra["pruning"]["anchors"]
    assert r.usage.prompt_tokens == n and anchors in (want, want + 1)
    want = anchors
    for cut in cuts:
        for positions in positions_kept(caches, cut):
            assert set(range(want)) <= set(positions), (cut, positions)
            assert len(positions) < n  # and the cut did prune the rest
    # A request's own larger anchors stand; a request that prunes nothing runs with its own
    # (its prompt cache is shared with requests without tools)
    r = tool_server.client().chat.completions.create(
        model="any", messages=messages, tools=[WEATHER], max_tokens=1,
        extra_body={"pruning": {**pruning, "anchors": want + 5}})
    assert r.usage.model_extra["pruning"]["anchors"] == want + 5
    r = tool_server.client().chat.completions.create(
        model="any", messages=messages, tools=[WEATHER], max_tokens=1)
    assert r.usage.model_extra["pruning"]["anchors"] == 1


# ---------------------------------------------------------------- the request schema

CHAT = "/v1/chat/completions"
ASKED = {"role": "user", "content": "What is the weather in Paris?"}
CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
ANSWERED = {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 18}'}


def tool(**function) -> dict:
    return {"type": "function", "function": {"name": "get_weather", **function}}


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"items": schema}
    return schema


def with_call(**changes) -> dict:
    call = {**CALLED["tool_calls"][0], **changes}
    return {**CALLED, "tool_calls": [call]}


def with_arguments(arguments) -> dict:
    return with_call(function={"name": "get_weather", "arguments": arguments})


@pytest.mark.parametrize("body", [
    {"tools": [WEATHER]},
    {"tools": [tool(), tool(description="d", parameters={"type": "object"}, strict=True)],
     "tool_choice": "auto"},
    {"tools": [{**WEATHER, "extra": 1}], "parallel_tool_calls": True},  # unknown fields ignored
    {"tools": [WEATHER], "tool_choice": "none"},
    {"tools": [tool(parameters=nested(MAX_SCHEMA_DEPTH))]},
    {"tools": [WEATHER], "messages": [ASKED, CALLED, ANSWERED]},
    {"messages": [ASKED, {k: v for k, v in CALLED.items() if k != "content"}, ANSWERED]},
    {"messages": [ASKED, with_arguments(""), {**ANSWERED, "content": [
        {"type": "text", "text": "18 C"}]}]},
    {"tools": [tool(name="mcp.files:read-2")]},
])
def test_tool_requests_are_accepted(tool_server, body):
    status, _, payload = tool_server.request("POST", CHAT, {
        "messages": [ASKED], "max_tokens": 1, **body})
    assert status == 200, payload


def test_the_template_gets_a_history_calls_arguments_as_an_object(tool_server,
                                                                  tool_model_path):
    """As mlx-lm's server gives them: a template's ``arguments | tojson`` renders the
    object, not the string's JSON (a quoted, escaped string)."""
    from mlx_lm import load as mlx_lm_load

    tokenizer = mlx_lm_load(str(tool_model_path))[1]
    messages = [ASKED, CALLED, ANSWERED]
    status, _, payload = tool_server.request("POST", CHAT, {
        "messages": messages, "tools": [WEATHER], "max_tokens": 1})
    assert status == 200, payload
    given = [ASKED, with_arguments({"city": "Paris"}), ANSWERED]
    text = tokenizer.apply_chat_template(given, tools=[WEATHER], tokenize=False,
                                         add_generation_prompt=True)
    assert '"arguments": {"city": "Paris"}}</tool_call>' in text
    want = len(tokenizer.encode(text, add_special_tokens=False))
    assert payload["usage"]["prompt_tokens"] == want


@pytest.mark.parametrize("body, param", [
    ({"tools": WEATHER}, "tools"),
    ({"tools": [WEATHER] * (MAX_TOOLS + 1)}, "tools"),
    ({"tools": [{"function": WEATHER["function"]}]}, "tools[0].type"),
    ({"tools": [{**WEATHER, "type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, tool(name="get weather!")]}, "tools[1].function.name"),
    ({"tools": [tool(name="f" * 65)]}, "tools[0].function.name"),
    ({"tools": [tool(description=5)]}, "tools[0].function.description"),
    ({"tools": [tool(parameters=[])]}, "tools[0].function.parameters"),
    ({"tools": [tool(parameters=nested(MAX_SCHEMA_DEPTH + 1))]}, "tools[0].function.parameters"),
    ({"tools": [tool(strict="yes")]}, "tools[0].function.strict"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                          "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "assistant", "tool_calls": []}]}, "messages[0].content"),
    ({"messages": [{**ASKED, "tool_calls": CALLED["tool_calls"]}]}, "messages[0].tool_calls"),
    ({"messages": [ASKED, CALLED, {"role": "tool", "content": "18"}]},
     "messages[2].tool_call_id"),
    ({"messages": [{**ASKED, "tool_call_id": "call_1"}]}, "messages[0].tool_call_id"),
    ({"messages": [ASKED, CALLED, {**ANSWERED, "content": None}]}, "messages[2].content"),
    ({"messages": [ASKED, with_arguments('{"city": "Par')]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [ASKED, with_arguments("[1, 2]")]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [ASKED, with_arguments({"city": "Paris"})]},  # an object, not its JSON
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [ASKED, with_call(id=None)]}, "messages[1].tool_calls[0].id"),
    ({"messages": [ASKED, with_call(type="code")]}, "messages[1].tool_calls[0].type"),
    ({"messages": [ASKED, with_call(function={"arguments": "{}"})]},
     "messages[1].tool_calls[0].function.name"),
    ({"messages": [ASKED, {**CALLED, "tool_calls": "get_weather"}]}, "messages[1].tool_calls"),
])
def test_a_malformed_tool_request_names_the_field(tool_server, body, param):
    status, _, payload = tool_server.request("POST", CHAT, {
        "messages": [ASKED], "max_tokens": 1, **body})
    assert status == 400, payload
    assert payload["error"]["param"] == param and payload["error"]["message"], payload


def test_a_model_that_cannot_call_tools_refuses_them(tiny_model_path):
    """The tiny model's template renders no tools and mlx-lm finds no parser for it: tools
    are a 400 naming them; with tool_choice "none", or none offered, the request is
    answered (a conversation's earlier calls and results are only text to it)."""
    with in_process_server(tiny_model_path) as s:
        status, _, payload = s.request("POST", CHAT, {"messages": [ASKED], "max_tokens": 1,
                                                      "tools": [WEATHER]})
        assert status == 400 and payload["error"]["param"] == "tools", payload
        assert "cannot call tools" in payload["error"]["message"], payload
        for body in ({"tools": [WEATHER], "tool_choice": "none"}, {"tools": []}):
            status, _, payload = s.request("POST", CHAT, {"messages": [ASKED], "max_tokens": 1,
                                                          **body})
            assert status == 200, (body, payload)


# ---------------------------------------------------------------- Qwen2.5-Coder-0.5B


@pytest.fixture(scope="module")
def qwen_server(qwen_path) -> Iterator[Server]:
    with in_process_server(qwen_path) as s:
        s.timeout = 600
        yield s


#: Asked plainly, Qwen2.5-Coder-0.5B answers a bare JSON object (or one in a code block),
#: not the ``<tool_call>`` its template asks for (the special token's logit is ~22 below the
#: top); asked for "HTML tags named tool_call" it writes the markers, as text, around its
#: JSON call: greedy, in a code block, ```` ```json\n<tool_call>\n  {...}\n</tool_call>\n``` ````.
QWEN_QUESTION = [{"role": "user", "content":
                  "What is the weather in Paris? Wrap the JSON in HTML tags named tool_call."}]


def _qwen_call(server: Server, stream: bool) -> tuple:
    request = dict(model="any", messages=QWEN_QUESTION, tools=[WEATHER], max_tokens=40)
    if stream:
        return streamed(list(server.client().chat.completions.create(**request, stream=True)))
    r = server.client().chat.completions.create(**request)
    return r.choices[0].message.content, r.choices[0].message.tool_calls, r.choices[0].finish_reason


@pytest.mark.slow
def test_qwen_calls_a_tool_and_answers_with_its_result(qwen_server):
    whole, streamed_ = _qwen_call(qwen_server, False), _qwen_call(qwen_server, True)
    for content, calls, finish in (whole, streamed_):
        assert finish == "tool_calls" and len(calls) == 1, (content, calls)
        assert calls[0].function.name == "get_weather"
        assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
        assert START not in (content or "")  # the call is not in the text
    assert whole[0] == streamed_[0]  # the same text around it
    # The agent's second turn: the call and its result, answered with text
    call = whole[1][0]
    messages = QWEN_QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id,
         "content": json.dumps({"temperature_c": 18, "sky": "sunny"})}]
    r = qwen_server.client().chat.completions.create(model="any", messages=messages,
                                                     tools=[WEATHER], max_tokens=40)
    answer = r.choices[0]
    assert answer.finish_reason == "stop" and answer.message.tool_calls is None
    assert "18" in answer.message.content, answer.message.content


@pytest.mark.slow
def test_qwen_prunes_around_its_tool_definitions(qwen_server, qwen_path):
    """Qwen's template puts the tools in the system block, first: the anchors reach the end of
    the definitions (the ``<|im_end|>`` the two renderings share), not the question."""
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(qwen_path)
    text = tokenizer.apply_chat_template(QWEN_QUESTION, tools=[WEATHER], tokenize=False,
                                         add_generation_prompt=True)
    want = len(tokenizer.encode(text[: text.index("<|im_end|>")], add_special_tokens=False))
    r = qwen_server.client().chat.completions.create(
        model="any", messages=QWEN_QUESTION, tools=[WEATHER], max_tokens=1,
        extra_body={"pruning": {"method": "lazy", "prune_layers": [2], "keep": [0.3]}})
    assert r.usage.model_extra["pruning"]["anchors"] == want
    assert 100 < want < r.usage.prompt_tokens - 20
