"""The HTTP server over real HTTP: a server subprocess on a free loopback port, spoken to with
the official ``openai`` client and with raw HTTP (``http.client``, sockets).

Expected texts come from ``mlx_lazy.generate`` in this process on the same model folder (and,
for SmolLM2, from ``mlx_lm.generate``).
"""

from __future__ import annotations

import mlx_lazy  # noqa: F401  (OpenBLAS before mlx)

import asyncio
import dataclasses
import http.client
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import mlx.core as mx
import numpy as np
import openai
import pytest
import uvicorn
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.tokenizer_utils import _byte_decoder
from uvicorn.server import ServerState

from mlx_lazy import PruningConfig, generate, generate_step, load
from mlx_lazy.adapter import ModelAdapter
from mlx_lazy.prefix_store import PromptCacheStore
from mlx_lazy.schedule_files import (MODEL_SCHEDULE_FILE, SCHEDULE_FORMAT, TRANSFER_SOURCE,
                                     write_schedule)
from mlx_lazy.scorers import Pooled, Window
from mlx_lazy import server as server_module
from mlx_lazy import server_worker
from mlx_lazy.server import App, main
from mlx_lazy.server_logprobs import LogprobSampler, TokenTexts, token_logprob
from mlx_lazy.server_http import (BoundedConnection, LingeringTransport, listen_socket,
                                  uvicorn_server)
from mlx_lazy.server_schemas import pruning_config
from mlx_lazy.server_settings import (DEFAULT_MAX_BODY_BYTES, ServerSettings, build_parser,
                                      is_loopback, settings_from_args)
from mlx_lazy.server_worker import StopText, Worker

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"  # tests never bind any other address
START_TIMEOUT_S = 180
MAX_PROMPT_TOKENS = 600
MAX_BODY_BYTES = 20_000
READ_TIMEOUT_S = 2.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Server:
    """A running ``python -m mlx_lazy.server`` subprocess."""

    def __init__(self, port: int, proc: Optional[subprocess.Popen] = None,
                 log: Optional[Path] = None, timeout: float = 300) -> None:
        self.port, self.proc, self.log, self.timeout = port, proc, log, timeout
        self.url = f"http://{HOST}:{port}"

    def client(self, api_key: str = "unused", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0,
                             timeout=self.timeout, **kw)

    def request(self, method: str, path: str, body=None, headers: Optional[dict] = None):
        """Raw HTTP: ``(status, headers, parsed JSON or text)``; ``body`` may be bytes."""
        conn = http.client.HTTPConnection(HOST, self.port, timeout=self.timeout)
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        raw = resp.read().decode()
        conn.close()
        try:
            payload = json.loads(raw)
        except json.JSONDecodeError:
            payload = raw
        return resp.status, dict(resp.getheaders()), payload

    def health(self) -> dict:
        return self.request("GET", "/health")[2]


@contextmanager
def run_server(model: Path, *args: str, tmp_path: Path) -> Iterator[Server]:
    port = free_port()
    log = tmp_path / f"server-{port}.log"
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "mlx_lazy.server", "--model", str(model), "--host", HOST,
           "--port", str(port), "--log-level", "warning", *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    server = Server(port, proc, log)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()}")
            try:
                if server.request("GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server did not start in {START_TIMEOUT_S} s:\n{log.read_text()}")
            time.sleep(0.2)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(tiny_model_path) -> Iterator[Server]:
    """The server these flags configure, read by its own parser, with the prompt-cache store
    ``main`` makes of them, in this process (a process of its own is ``run_server``'s)."""
    args = build_parser().parse_args([
        "--model", str(tiny_model_path), "--max-prompt-tokens", str(MAX_PROMPT_TOKENS),
        "--max-queue", "1", "--max-body-bytes", str(MAX_BODY_BYTES),
        "--read-timeout", str(READ_TIMEOUT_S)])
    settings = settings_from_args(args)
    store = PromptCacheStore(settings.prompt_cache_size, settings.prompt_cache_bytes,
                             settings.share_pruned_caches)
    fields = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)
              if f.name != "model"}
    with in_process_server(tiny_model_path, store, **fields) as s:
        yield s


def chat_prompt(tokenizer, messages: list) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def expected(model_tok, prompt: str, **kw) -> str:
    model, tokenizer = model_tok
    return generate(model, tokenizer, prompt, **kw)


MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]
LONG_TEXT = ("Long prompts are expensive: every layer attends over every token. "
             "The passkey is 12345. Remember it. ") * 12


# ---------------------------------------------------------------- unit-level pieces


class FakeTransport(asyncio.Transport):
    """A socket transport that records what is done to it."""

    def __init__(self, can_write_eof: bool = True) -> None:
        super().__init__()
        self.calls: list = []
        self.closed, self.eof_ok = False, can_write_eof

    def write(self, data) -> None:
        self.calls.append(("write", bytes(data)))

    def write_eof(self) -> None:
        self.calls.append("write_eof")

    def can_write_eof(self) -> bool:
        return self.eof_ok

    def close(self) -> None:
        self.calls.append("close")
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.calls.append("pause")

    def resume_reading(self) -> None:
        self.calls.append("resume")

    def get_extra_info(self, name, default=None):
        return {"peername": (HOST, 1), "sockname": (HOST, 2)}.get(name, default)


def test_a_lingering_close_shuts_the_write_side_then_closes_after_the_linger():
    async def run() -> None:
        loop = asyncio.get_running_loop()
        t = FakeTransport()
        lingering = LingeringTransport(t, loop, linger=0.05)
        assert not lingering.is_closing()
        lingering.close()
        lingering.close()  # once only
        assert t.calls == ["write_eof", "resume"] and lingering.is_closing() and not t.closed
        await asyncio.sleep(0.2)
        assert t.calls == ["write_eof", "resume", "close"]
        t = FakeTransport(can_write_eof=False)  # nothing to linger on: closed at once
        LingeringTransport(t, loop, linger=0.05).close()
        assert t.calls == ["close"]
        t = FakeTransport()
        t.write_eof = gone  # the client went away as its response ended: no error logged
        LingeringTransport(t, loop, linger=0.05).close()
        assert t.calls == ["close"]

    def gone() -> None:
        raise OSError(107, "Transport endpoint is not connected")

    asyncio.run(run())


def test_what_arrives_after_a_connection_is_closed_is_never_run():
    """A request completed after the header deadline closed its connection (the close
    lingers, so its bytes are still read) is dropped, not answered on a shut socket."""
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def run() -> None:
        config = uvicorn.Config(app, log_level="warning")
        config.load()
        conn = BoundedConnection(config=config, server_state=ServerState(), app_state={},
                                 timeout=30)
        t = FakeTransport()
        conn.connection_made(t)
        conn.data_received(b"GET /health HTTP/1.1\r\nHo")
        conn.transport.close()  # what the header deadline does
        conn.data_received(b"st: x\r\n\r\n")
        await asyncio.sleep(0.05)
        assert t.calls == ["write_eof", "resume"] and conn.cycle is None
        conn = BoundedConnection(config=config, server_state=ServerState(), app_state={},
                                 timeout=30)
        t = FakeTransport()  # the same request, whole and in time, is answered
        conn.connection_made(t)
        conn.data_received(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.05)
        assert t.calls[0][0] == "write" and t.calls[0][1].startswith(b"HTTP/1.1 200")

    asyncio.run(run())


def test_stop_text_withholds_a_possible_stop_and_cuts_at_the_first():
    s = StopText(["END", "xy"])
    assert s.feed("abcE") == ("abc", False)  # "E" may begin "END"
    assert s.feed("Nx") == ("EN", False)  # "ENx" cannot be "END"; "x" may begin "xy"
    assert s.feed("yz") == ("", True)  # "xy" found: cut before it
    s = StopText(["END"])
    assert s.feed("abE") == ("ab", False)
    assert s.feed("F") == ("EF", False)
    assert s.flush() == ""
    s = StopText(["END"])  # generation ends (EOS) while "E" is held back: it is not lost
    assert s.feed("xE") == ("x", False)
    assert s.flush() == "E"


def test_stop_text_is_linear_in_the_stops_length():
    """Once quadratic: 0.24 s a token for four stops of 100K characters (12 s at 1M)."""
    stop = "Z" * 200_000
    s = StopText([stop] * 4)
    tic = time.perf_counter()
    for _ in range(200):
        assert s.feed("ZZZ") == ("", False)  # all of it may begin the stop
    assert time.perf_counter() - tic < 1.0
    assert len(s.pending) == 600
    out, hit = s.feed("Z" * (len(stop) - 600) + "tail")
    assert (out, hit) == ("", True)
    s = StopText(["ab" * 1000 + "c"])
    assert s.feed("ab" * 1500) == ("ab" * 500, False)  # the longest tail that begins it
    assert s.feed("c") == ("", True)


def test_pruning_field_builds_the_config_generically():
    default = PruningConfig.preset("lazy", keep=(0.5, 0.2))
    assert pruning_config("speed", default) == PruningConfig.preset("speed")
    assert pruning_config({"method": "lazy", "keep": [0.6, 0.3]}, default) == \
        PruningConfig.preset("lazy", keep=(0.6, 0.3))
    assert pruning_config({"scorer": "window:size=16:pool=2"}, default) == PruningConfig.preset(
        "lazy", keep=(0.5, 0.2), scorer=Pooled(Window(size=16), 2))
    # over a schedule file's config: cuts given are the user's (they kept the file's name,
    # and a null prune_layers was refused naming pruning.source), decode fields leave it
    # the file's
    calibrated = dataclasses.replace(PruningConfig.preset("lazy", prune_layers=(2,), keep=(0.4,)),
                                     source="calibrated:s.json")
    assert pruning_config({"keep": [0.3]}, calibrated).source is None
    assert pruning_config({"prune_layers": None}, calibrated).source is None
    assert pruning_config({"complete": "none"}, calibrated).source == "calibrated:s.json"


def test_loopback_detection():
    assert all(map(is_loopback, ["127.0.0.1", "127.1.2.3", "::1", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.168.1.2", "example.org"]))


@pytest.fixture
def never_serve(monkeypatch) -> None:
    """``main`` fails a test instead of serving forever when it passes its start-up checks."""
    def refuse(*args, **kw):
        raise AssertionError("main passed its start-up checks and would serve")

    monkeypatch.setattr(server_module, "uvicorn_server", refuse)


def one_error_line(capsys, argv: list) -> str:
    """``main(argv)``'s single stderr line, after checking it exits with status 2."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_bad_command_line_is_one_error_line(tmp_path, tiny_model_path, capsys, never_serve):
    model = ["--model", str(tiny_model_path), "--port", str(free_port())]
    line = one_error_line(capsys, ["--model", str(tmp_path / "missing"), *model[2:]])
    assert line.startswith("error: cannot load model") and line.count("cannot load") == 1, line
    bad = tmp_path / "s.json"
    schedule = {"format": SCHEDULE_FORMAT, "model": {"fingerprint": {"num_layers": 4}},
                "config": {"method": "lazy", "prune_layers": [0, 1], "keep": [0.5, 0.9]}}
    bad.write_text(json.dumps(schedule))
    assert "keep fractions must not increase" in one_error_line(
        capsys, [*model, "--schedule", str(bad)])
    schedule["config"]["keep"] = [0.5, 0.3]  # valid, but calibrated for another model
    bad.write_text(json.dumps(schedule))
    assert "calibrated for another model" in one_error_line(
        capsys, [*model, "--schedule", str(bad)])
    bad.write_text("[" * 200_000)  # a RecursionError once
    assert str(bad) in one_error_line(capsys, [*model, "--schedule", str(bad)])
    for flag in ("--read-timeout", "--stall-timeout"):
        for value in ("0", "-1", "nan", "inf"):
            assert flag in one_error_line(capsys, [*model, flag, value])
    # a key no client can send (once: a server that refused every client with 401)
    for key, bad in (("clé", "U+00E9"), ("a b", "U+0020"), ("k\x01", "U+0001"), ("", "empty")):
        line = one_error_line(capsys, [*model, "--api-key", key])
        assert "--api-key" in line and bad in line, line


def test_start_up_errors_are_one_line(tiny_model_path, tmp_path, capsys, never_serve):
    model = ["--model", str(tiny_model_path)]
    line = one_error_line(capsys, [*model, "--host", "999.1.1.1", "--port", str(free_port())])
    assert line.startswith("error: cannot listen on 999.1.1.1:"), line
    with socket.socket() as busy:
        busy.bind((HOST, 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = one_error_line(capsys, [*model, "--host", HOST, "--port", str(port)])
    assert line.startswith(f"error: cannot listen on {HOST}:{port}") and "in use" in line, line
    # A prompt limit the model's context cannot hold is refused, not clamped.
    context = json.loads((tiny_model_path / "config.json").read_text())["max_position_embeddings"]
    argv = [*model, "--port", str(free_port()), "--max-prompt-tokens"]
    assert f"at most {context - 1}" in one_error_line(capsys, [*argv, str(context)])
    # So is a default pruning whose pool reaches beyond the context.
    fingerprint = ModelAdapter(load(tiny_model_path)[0]).fingerprint()
    wide = PruningConfig("lazy", prune_layers=(1,), keep=(0.5,), scorer=f"last:pool={context + 1}")
    path = write_schedule(tmp_path / "wide.json", wide, fingerprint, {"note": "test"})
    line = one_error_line(capsys, [*argv[:-1], "--schedule", str(path)])
    assert f"pool={context + 1} is more than the model's context of {context}" in line, line
    # A schedule sets the method, as generate says (--method was dropped in silence)
    line = one_error_line(capsys, [*argv[:-1], "--schedule", str(path), "--method", "speed"])
    assert f"--schedule {path} runs method 'lazy'; drop --method speed" in line, line


# ---------------------------------------------------------------- endpoints


@pytest.mark.slow  # runs a process of its own
def test_usage_names_the_schedule_the_engine_used(tiny_model_path, tmp_path):
    """``--method lazy`` (or a request's ``"pruning": "lazy"``) on a model folder that holds a
    calibrated schedule runs that schedule, and ``usage.pruning`` says so (not "preset" or
    "request")."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_path, folder)
    fingerprint = ModelAdapter(load(folder)[0]).fingerprint()
    config = PruningConfig("lazy", prune_layers=(1,), keep=(0.5,), scorer="window:size=2")
    write_schedule(folder / MODEL_SCHEDULE_FILE, config, fingerprint, {"note": "test"})
    # Idle completion off: the second request must not find the first one's state completed.
    with run_server(folder, "--method", "lazy", "--share-pruned-caches", "--no-idle-complete",
                    tmp_path=tmp_path) as server:
        # the server's default, then a request's own plain "lazy" (the same schedule runs)
        answers = [server.client().completions.create(
            model="any", prompt="one two three " * 8, max_tokens=2, **kw)
            for kw in ({}, {"extra_body": {"pruning": "lazy"}})]
    for r in answers:
        pruning = r.usage.model_extra["pruning"]
        assert pruning["method"] == "lazy"
        assert pruning["schedule_source"] == f"calibrated:{MODEL_SCHEDULE_FILE}"
    # the schedule's cut pruned the first prefill, which the default (exact) recomputed above
    # the cut after its first token; the second request reused that state and ran only the
    # prompt's last token, recomputed over the 2 layers above the cut after its first token
    first, second = (r.usage.model_extra["pruning"] for r in answers)
    assert first["completed_token_layers"] > 2 and second["completed_token_layers"] == 2


def test_models_and_health(server, tiny_model_path):
    ids = [m.id for m in server.client().models.list()]
    assert ids == [str(tiny_model_path)]  # the --model the server was started with
    health = server.health()
    assert health["status"] == "ok" and health["queued"] == 0
    status, _, body = server.request("HEAD", "/health")  # a load balancer's probe: once 405
    assert (status, body) == (200, "")


def test_chat_non_streaming_equals_in_process(server, tiny_model, tiny_model_path):
    tokenizer = tiny_model()[1]
    prompt = chat_prompt(tokenizer, MESSAGES)
    r = server.client().chat.completions.create(model="any", messages=MESSAGES, max_tokens=12)
    assert r.object == "chat.completion" and r.model == str(tiny_model_path)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected(tiny_model(), prompt, max_tokens=12)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    pruning = r.usage.model_extra["pruning"]
    assert pruning["method"] == "full" and pruning["schedule_source"] == "preset"
    assert pruning["prompt_tokens_computed_pct"] == 100.0 and pruning["revivals"] == 0


def test_chat_streaming_with_usage(server, tiny_model):
    want = expected(tiny_model(), chat_prompt(tiny_model()[1], MESSAGES), max_tokens=10)
    chunks = list(server.client().chat.completions.create(
        model="any", messages=MESSAGES, max_tokens=10, stream=True,
        stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10

    # Raw: server-sent events, each "data: {json}", the last "data: [DONE]".
    status, headers, text = server.request("POST", "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 3, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    pieces = [json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1]]
    assert "".join(pieces) == expected(tiny_model(), chat_prompt(tiny_model()[1], MESSAGES),
                                       max_tokens=3)


def test_completions_streaming_and_not(server, tiny_model):
    prompt = "The quick brown fox jumps over"
    want = expected(tiny_model(), prompt, max_tokens=8)
    client = server.client()
    r = client.completions.create(model="any", prompt=prompt, max_tokens=8)
    assert r.object == "text_completion" and r.choices[0].text == want
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    chunks = list(client.completions.create(model="any", prompt=prompt, max_tokens=8, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    # Token ids are a prompt too.
    ids = tiny_model()[1].encode(prompt)
    r = client.completions.create(model="any", prompt=ids, max_tokens=8)
    assert r.choices[0].text == want


def test_lazy_request_equals_in_process_and_reports_pruning(server, tiny_model):
    messages = [{"role": "user", "content": LONG_TEXT + "What is the passkey?"}]
    prompt = chat_prompt(tiny_model()[1], messages)
    client = server.client()
    for spec, config, source in [
            ("lazy", PruningConfig.preset("lazy"), TRANSFER_SOURCE),  # an uncalibrated model
            ({"method": "lazy", "prune_layers": [0], "keep": [0.3]},
             PruningConfig.preset("lazy", prune_layers=(0,), keep=(0.3,)), "user")]:
        r = client.chat.completions.create(model="any", messages=messages, max_tokens=6,
                                           extra_body={"pruning": spec})
        assert r.choices[0].message.content == expected(tiny_model(), prompt, max_tokens=6,
                                                        config=config)
        pruning = r.usage.model_extra["pruning"]
        assert pruning["method"] == "lazy" and pruning["schedule_source"] == source
        assert pruning["kv_bytes"] > 0 and pruning["ttft_s"] > 0 and pruning["revivals"] >= 0
        if source == "user":  # pruned in prefill, then completed after the first token
            assert pruning["completed_token_layers"] > 0, str(pruning)
            assert pruning["prompt_tokens_computed_pct"] == 100
        else:  # the transfer rule decodes on the pruned state, as its sources do
            assert pruning["completed_token_layers"] == 0, str(pruning)
            assert pruning["prompt_token_layers_computed_pct"] < 100


def test_stop_sequences(server, tiny_model):
    prompt = "Pruning keeps the tokens that matter"
    full_text = expected(tiny_model(), prompt, max_tokens=16)
    stop = full_text[5:8]
    assert len(stop) == 3 and stop.strip()
    want = full_text[: full_text.find(stop)]
    client = server.client()
    r = client.completions.create(model="any", prompt=prompt, max_tokens=16, stop=[stop, "\x00"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    chunks = list(client.completions.create(model="any", prompt=prompt, max_tokens=16,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_sampling_values_the_sampler_cannot_use_are_greedy(server, tiny_model):
    """Once temperature 1e-300 or top_p 5e-324 sampled uniformly random tokens."""
    prompt = "A language model predicts"
    want = expected(tiny_model(), prompt, max_tokens=8)
    client = server.client()
    for kw in ({"temperature": 1e-300}, {"temperature": 1.0, "top_p": 5e-324}):
        r = client.completions.create(model="any", prompt=prompt, max_tokens=8, seed=1, **kw)
        assert r.choices[0].text == want, kw


def test_logit_bias(server, tiny_model):
    """Once ignored silently; now added to the logits of every step."""
    tokenizer = tiny_model()[1]
    token = tokenizer.encode(" fox", add_special_tokens=False)[-1]
    r = server.client().completions.create(model="any", prompt="The quick brown", max_tokens=4,
                                           logit_bias={str(token): 100})
    assert r.choices[0].text == tokenizer.decode([token] * 4)


def test_a_completion_keeps_the_space_its_first_token_begins_with(server, tiny_model):
    """mlx-lm's detokenizer drops the first token's leading space (an answer starts with no
    space); a completion continues the prompt's text, so "capital of" + "the" lost it.
    Chat answers keep mlx-lm's."""
    tokenizer = tiny_model()[1]
    vocab = tokenizer._tokenizer.get_vocab()
    spaced = next(i for t, i in sorted(vocab.items()) if t.startswith("\u0120") and len(t) > 2)
    prompt = "The quick brown"
    ids = tokenizer.encode(prompt)
    truth = tokenizer.decode(ids + [spaced] * 3)[len(tokenizer.decode(ids)):]
    assert truth.startswith(" ") and not truth.startswith("  ")
    body = {"prompt": prompt, "max_tokens": 3, "logit_bias": {str(spaced): 100}}
    assert server.request("POST", "/v1/completions", body)[2]["choices"][0]["text"] == truth
    _, _, text = server.request("POST", "/v1/completions", {**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in text.splitlines()
              if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == truth
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 3,
            "logit_bias": {str(spaced): 100}}
    answer = server.request("POST", "/v1/chat/completions", chat)[2]
    assert answer["choices"][0]["message"]["content"] == truth[1:]


def test_a_request_seed_is_a_random_drop_seed_too(server, tiny_model):
    """As the CLI's --seed: ``"pruning": "random"`` with ``"seed": 7`` drops what seed 7
    drops (it dropped seed 0's); a pruning object's own seed wins."""
    model, tokenizer = tiny_model()
    prompt = np.random.default_rng(1).integers(3, 384, 300).tolist()
    answers = {seed: generate(model, tokenizer, prompt, max_tokens=8,
                              config=PruningConfig("random", seed=seed)) for seed in (0, 7)}
    assert answers[0] != answers[7]  # the seeds drop differently here
    for pruning, want in (("random", answers[7]), ({"method": "random", "seed": 0}, answers[0])):
        body = {"prompt": prompt, "max_tokens": 8, "seed": 7, "pruning": pruning}
        got = server.request("POST", "/v1/completions", body)[2]["choices"][0]["text"]
        assert got == want, pruning


def test_seeded_sampling(server, tiny_model):
    prompt = "A language model predicts"
    model, tokenizer = tiny_model()
    mx.random.seed(7)
    want = generate(model, tokenizer, prompt, max_tokens=10, sampler=make_sampler(1.0, 0.9))
    client = server.client()
    texts = [client.completions.create(model="any", prompt=prompt, max_tokens=10, temperature=1.0,
                                       top_p=0.9, seed=7).choices[0].text for _ in range(2)]
    assert texts == [want, want]
    assert want != expected(tiny_model(), prompt, max_tokens=10)  # sampling did change it


def test_mlx_lm_sampling_fields(server, tiny_model):
    """top_k, min_p and repetition_penalty as mlx-lm's server takes them (once ignored):
    top_k 1 or min_p 1 at temperature 1 sample the top token only; a repetition penalty
    gives what mlx-lm's own logits processor gives."""
    prompt = "A language model predicts"
    model, tokenizer = tiny_model()
    greedy = expected(tiny_model(), prompt, max_tokens=10)
    client = server.client()
    for field in ({"top_k": 1}, {"min_p": 1.0}):
        r = client.completions.create(model="any", prompt=prompt, max_tokens=10, temperature=1.0,
                                      seed=3, extra_body=field)
        assert r.choices[0].text == greedy, field
    want = generate(model, tokenizer, prompt, max_tokens=10,
                    logits_processors=make_logits_processors(repetition_penalty=3.0))
    assert want != greedy  # the penalty changes this answer
    r = client.completions.create(model="any", prompt=prompt, max_tokens=10,
                                  extra_body={"repetition_penalty": 3.0})
    assert r.choices[0].text == want


def _token_ids(tokenizer, entries) -> list:
    """The ids of byte-level BPE tokens given by their ``bytes`` (GPT-2's byte alphabet)."""
    encode = {b: c for c, b in _byte_decoder().items()}
    vocab = tokenizer._tokenizer.get_vocab()
    return [vocab["".join(encode[b] for b in e.bytes)] for e in entries]


def test_chat_logprobs_are_the_models_log_softmax_whole_and_streamed(server, tiny_model,
                                                                     monkeypatch):
    """Each token's logprob and its top alternatives are the log-softmax of mlx-lm's own
    model's logits at that step, recomputed in one pass over the prompt and the answer
    (float32: the server's step-by-step decode differs only in summation order, by 1e-7 of
    the value here; 1e-4 allows for that on any platform and still catches another
    distribution, a step off, a temperature). A stream carries the same, each chunk its
    tokens."""
    model, tokenizer = tiny_model()
    body = dict(model="any", messages=MESSAGES, max_tokens=8, logprobs=True, top_logprobs=3)
    r = server.client().chat.completions.create(**body)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8  # no end-of-sequence token here
    answer = _token_ids(tokenizer, content)
    text = bytes(b for e in content for b in e.bytes).decode("utf-8", "replace")
    assert text in (r.choices[0].message.content, " " + r.choices[0].message.content)
    prompt = tokenizer.encode(chat_prompt(tokenizer, MESSAGES), add_special_tokens=False)
    logits = model(mx.array([prompt + answer]))[0, len(prompt) - 1:-1].astype(mx.float32)
    want = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    for step, (entry, token) in enumerate(zip(content, answer)):
        assert token == want[step].argmax()  # greedy
        assert entry.logprob == pytest.approx(want[step, token], rel=1e-4), step
        top = entry.top_logprobs
        assert len(top) == 3 and top[0].token == entry.token  # the argmax, the chosen one
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        best = np.argsort(-want[step], kind="stable")[:3]
        assert _token_ids(tokenizer, top) == best.tolist(), step
        assert [t.logprob for t in top] == pytest.approx(want[step, best], rel=1e-4)

    chunks = list(server.client().chat.completions.create(**body, stream=True))
    streamed = [e for c in chunks if c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    _same_entries(streamed, content)
    for c in chunks:  # each token with the text it brought, none on the finishing chunk
        assert bool(c.choices[0].delta.content) == bool(c.choices[0].logprobs), c
    # without logprobs asked: none, and none computed
    monkeypatch.setattr(server_worker, "token_logprob", None)
    assert server.client().chat.completions.create(
        model="any", messages=MESSAGES, max_tokens=2).choices[0].logprobs is None


def _same_entries(got, want) -> None:
    """Chat logprobs entries alike: tokens exactly, values up to rounding (a repeated
    prompt's cache may split its prefill differently)."""
    for g, w in zip(got, want, strict=True):
        assert (g.token, g.bytes) == (w.token, w.bytes)
        assert g.logprob == pytest.approx(w.logprob, rel=1e-5)
        assert [(t.token, t.bytes) for t in g.top_logprobs] == [
            (t.token, t.bytes) for t in w.top_logprobs]
        assert [t.logprob for t in g.top_logprobs] == pytest.approx(
            [t.logprob for t in w.top_logprobs], rel=1e-5)


def test_completion_logprobs_drop_what_a_stop_string_cut(server):
    """The legacy shape (tokens, token_logprobs, top_logprobs as {token: logprob} holding the
    chosen token, text_offset into the text). A stop string cuts the text: the tokens that
    went out are those any of whose text is in it, whole and streamed alike; a stop at a
    token's first character drops that token, one inside it keeps it."""
    client = server.client()
    prompt = "The quick brown fox jumps over"
    full = client.completions.create(model="any", prompt=prompt, max_tokens=12, logprobs=2)
    text, lp = full.choices[0].text, full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and top[token] == logprob == max(top.values())  # greedy
    # the offsets: where each token's text begins (a token of part of a character: that one)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(text[o:].startswith(t) for t, o in zip(lp.tokens, lp.text_offset)
               if not t.startswith("bytes:"))
    i = next(i for i, t in enumerate(lp.tokens) if i > 1 and len(t) > 2
             and not t.startswith("bytes:") and text.find(t[:2]) == lp.text_offset[i])
    for stop in (lp.tokens[i][:2], lp.tokens[i][1:3]):  # at the token's start, inside it
        cut = text.find(stop)
        kept = sum(o < cut for o in lp.text_offset)
        assert kept == i + (cut > lp.text_offset[i]), stop
        for stream in (False, True):
            r = client.completions.create(model="any", prompt=prompt, max_tokens=12, logprobs=2,
                                          stop=stop, stream=stream)
            choices = [c.choices[0] for c in r] if stream else r.choices
            assert "".join(c.text for c in choices) == text[:cut]
            assert choices[-1].finish_reason == "stop"
            got = [c.logprobs for c in choices if c.logprobs]
            assert [t for g in got for t in g.tokens] == lp.tokens[:kept], (stop, stream)
            assert [o for g in got for o in g.text_offset] == lp.text_offset[:kept]
            assert [v for g in got for v in g.token_logprobs] == pytest.approx(
                lp.token_logprobs[:kept], rel=1e-5)
    # logit_bias shapes the distribution reported (as mlx-lm's): the biased token is certain
    r = client.completions.create(model="any", prompt=prompt, max_tokens=2, logprobs=0,
                                  logit_bias={"100": 100})
    assert r.choices[0].logprobs.token_logprobs == pytest.approx([0, 0], abs=1e-3)
    assert [list(t) for t in r.choices[0].logprobs.top_logprobs] == [
        [r.choices[0].logprobs.tokens[0]]] * 2  # logprobs 0: the chosen token's own


@pytest.mark.parametrize("ahead", [False, True], ids=["cpu", "built-ahead"])
def test_each_token_gets_its_own_steps_log_probabilities(tiny_model, monkeypatch, ahead):
    """The values a LogprobSampler selected for a token are its step's, its own value
    (sampled: not always the largest) and the 3 largest (ties: the lower id first), also
    when, as on a GPU, the next token is drawn before this one is handed out."""
    from mlx_lazy import api

    monkeypatch.setattr(api, "_pipelined", lambda engine: ahead)
    model, tokenizer = tiny_model()
    texts = TokenTexts(tokenizer)
    draws = LogprobSampler(make_sampler(temp=1.0), 3)
    mx.random.seed(3)
    sampled = 0
    for token, logprobs in generate_step(tokenizer.encode("The quick brown fox"), model,
                                         sampler=draws, max_tokens=10):
        want = np.array(logprobs.astype(mx.float32))
        best = np.argsort(-want, kind="stable")[:3]
        entry = token_logprob(draws.pop(), token, texts)
        assert (entry.token, entry.logprob) == (texts(token)[0], want[token])
        assert entry.top == tuple((*texts(i), want[i]) for i in best)
        sampled += token != best[0]
    assert sampled  # a token that is not the most likely was checked


def test_log_probabilities_are_evaluated_with_their_token(server, monkeypatch):
    """Asking for log probabilities adds no evaluation to a decode step: the generation
    thread calls mx.eval as often as without them, and each token's values and alternatives
    go to the device in the mx.async_eval of the token itself (one wait for both)."""
    evals, scheduled, drawn = [], [], []

    def recorded(calls: list, real):
        def call(*arrays):
            if threading.current_thread().name == "mlx-lazy-generation":
                calls.append(arrays)
            return real(*arrays)
        return call

    monkeypatch.setattr(mx, "eval", recorded(evals, mx.eval))
    monkeypatch.setattr(mx, "async_eval", recorded(scheduled, mx.async_eval))
    read = server_worker.token_logprob
    monkeypatch.setattr(server_worker, "token_logprob",
                        lambda draw, token, texts: drawn.append((draw, token))
                        or read(draw, token, texts))
    body = dict(model="any", prompt="The quick brown fox", max_tokens=6)
    client = server.client()
    client.completions.create(**body)  # cached: the two below start from the same prefix
    counts = []
    for logprobs in (None, 3):
        evals.clear()
        client.completions.create(**body, logprobs=logprobs)
        counts.append(len(evals))
    assert counts[0] == counts[1] and len(drawn) == 6
    for (values, top), token in drawn:
        assert any(any(a is values for a in arrays) and any(a is top for a in arrays)
                   and [token] in [a.tolist() for a in arrays] for arrays in scheduled), token


# ---------------------------------------------------------------- bad requests


def _long_prompt(tokenizer, n: int) -> str:
    text = ""
    while len(tokenizer.encode(text)) < n:
        text += "The passkey is 12345. Remember it. "
    return text


def bad_requests(tokenizer, context: int):
    chat = "/v1/chat/completions"
    ok = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    lazy = {"method": "lazy", "prune_layers": [0], "keep": [0.5]}
    return [
        # (path, body, status, param)
        (chat, b'{"messages": [', 400, None),
        (chat, {"max_tokens": 2}, 400, "messages"),
        (chat, {"messages": "hi"}, 400, "messages"),
        (chat, {"messages": []}, 400, "messages"),
        (chat, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
        (chat, {**ok, "max_tokens": -3}, 400, "max_tokens"),
        (chat, {**ok, "max_tokens": "2"}, 400, "max_tokens"),
        (chat, {**ok, "temperature": "hot"}, 400, "temperature"),
        (chat, {**ok, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        (chat, {**ok, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
        (chat, {**ok, "logit_bias": {"\u0663": 1}}, 400, "logit_bias"),
        (chat, {**ok, "logit_bias": {str(10**6): 1}}, 400, "logit_bias"),
        (chat, {**ok, "logit_bias": {"10": 1, "010": -1}}, 400, "logit_bias"),  # once merged
        (chat, {**ok, "logit_bias": {"1": 101}}, 400, "logit_bias.1"),
        (chat, {**ok, "logit_bias": {str(i): 1 for i in range(1025)}}, 400, "logit_bias"),
        (chat, {**ok, "n": 2}, 400, "n"),
        # log probabilities: OpenAI's types and ranges, top_logprobs only with logprobs
        (chat, {**ok, "top_logprobs": 2}, 400, "top_logprobs"),
        (chat, {**ok, "logprobs": False, "top_logprobs": 2}, 400, "top_logprobs"),
        (chat, {**ok, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        (chat, {**ok, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
        (chat, {**ok, "logprobs": True, "top_logprobs": "2"}, 400, "top_logprobs"),
        (chat, {**ok, "logprobs": True, "top_logprobs": 2.0}, 400, "top_logprobs"),
        (chat, {**ok, "logprobs": 1}, 400, "logprobs"),
        (chat, {**ok, "logprobs": "true", "top_logprobs": 2}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 6}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "logprobs": True}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "logprobs": "2"}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 2, "top_logprobs": 2}, 400,
         "top_logprobs"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 2, "echo": True}, 400, "echo"),
        (chat, {**ok, "top_k": -1}, 400, "top_k"),
        (chat, {**ok, "min_p": 1.5}, 400, "min_p"),
        (chat, {**ok, "repetition_penalty": 0}, 400, "repetition_penalty"),
        (chat, {**ok, "pruning": "turbo"}, 400, "pruning"),
        (chat, {**ok, "pruning": 7}, 400, "pruning"),
        (chat, {**ok, "pruning": {"method": "warp"}}, 400, "pruning.method"),
        (chat, {**ok, "pruning": {"method": "lazy", "kep": [0.5]}}, 400, "pruning.kep"),
        (chat, {**ok, "pruning": {"method": "lazy", "keep": [0.2, 0.9]}}, 400, "pruning"),
        (chat, {**ok, "pruning": {"method": "lazy", "prune_layers": 3}}, 400,
         "pruning.prune_layers"),
        (chat, {**ok, "pruning": {"method": "speed", "speed_cutoff": 99}}, 400, "pruning"),
        (chat, {**ok, "pruning": {"method": "speed", "anchors": 1000}}, 400, "pruning"),
        # once a dead generation thread and a hung queue
        (chat, {**ok, "seed": -1}, 400, "seed"),
        (chat, {**ok, "seed": 2**64}, 400, "seed"),
        (chat, {**ok, "seed": 2**80}, 400, "seed"),
        # once a 500, or 8.5 GB and 47 s for pool=10**9
        (chat, {**ok, "pruning": {**lazy, "scorer": f"last:pool={10**20}"}}, 400,
         "pruning.scorer"),
        (chat, {**ok, "pruning": {**lazy, "scorer": f"last:pool={10**9}"}}, 400, "pruning"),
        (chat, {**ok, "pruning": {**lazy, "scorer": f"last:pool={context + 1}"}}, 400, "pruning"),
        (chat, {**ok, "pruning": {**lazy, "scorer": f"window:size={context + 1}"}}, 400,
         "pruning"),
        (chat, {**ok, "pruning": {**lazy, "pool": 2}}, 400, "pruning.pool"),  # a scorer field now
        # internal fields (a bad fingerprint was a 500)
        (chat, {**ok, "pruning": {**lazy, "fingerprint": {"num_layers": 3}}}, 400,
         "pruning.fingerprint"),
        (chat, {**ok, "pruning": {**lazy, "source": "calibrated:x.json"}}, 400, "pruning.source"),
        (chat, {**ok, "pruning": {**lazy, "scorer": ""}}, 400, "pruning.scorer"),
        (chat, {**ok, "pruning": {**lazy, "scorer": "last:heads="}}, 400, "pruning.scorer"),
        (chat, {**ok, "pruning": {**lazy, "scorer": 3}}, 400, "pruning.scorer"),
        (chat, {**ok, "pruning": {**lazy, "\ud800": 1}}, 400, "pruning"),  # a 500 once
        # once a 500 from the tokenizer
        (chat, {**ok, "messages": [{"role": "user", "content": "a\ud800b"}]}, 400,
         "messages[0].content"),
        (chat, {**ok, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "\udfff"}]}]}, 400, "messages[0].content[0].text"),
        ("/v1/completions", {"prompt": "\ud800", "max_tokens": 2}, 400, "prompt"),
        # once a 200
        (chat, {**ok, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
        (chat, {**ok, "messages": [{"role": "user", "content": None}]}, 400,
         "messages[0].content"),
        (chat, {**ok, "messages": [{"role": "user"}]}, 400, "messages[0].content"),
        (chat, {**ok, "max_tokens": 10**20}, 400, "max_tokens"),
        (chat, {**ok, "max_tokens": context}, 400, "max_tokens"),
        # the OpenAI spelling is named as the client spelt it
        (chat, {**ok, "max_completion_tokens": context}, 400, "max_completion_tokens"),
        (chat, {**ok, "max_tokens": 4000, "messages": [
            {"role": "user", "content": _long_prompt(tokenizer, 200)}]}, 400, "max_tokens"),
        (chat, {**ok, "messages": [{"role": "user", "content": _long_prompt(
            tokenizer, MAX_PROMPT_TOKENS + 50)}]}, 413, "messages"),
        ("/v1/completions", {"prompt": "x" * (MAX_BODY_BYTES + 1)}, 413, None),
        ("/v1/completions", {"prompt": [1, 2, 10**6]}, 400, "prompt"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/nothing", {}, 404, None),
    ]


def test_bad_requests_get_error_objects_and_the_server_keeps_serving(server, tiny_model,
                                                                      tiny_model_path):
    tokenizer = tiny_model()[1]
    context = json.loads((tiny_model_path / "config.json").read_text())["max_position_embeddings"]
    normal = {"prompt": "The quick brown fox", "max_tokens": 1}
    for path, body, status, param in bad_requests(tokenizer, context):
        got, _, payload = server.request("POST", path, body)
        assert got == status, (body, payload)
        error = payload["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], payload
        assert error["param"] == param, (body, error)
        # every bad request leaves the server answering a normal one
        assert server.request("POST", "/v1/completions", normal)[0] == 200, body
    assert server.health()["status"] == "ok"
    # A chunked body (no Content-Length) over the limit is refused as well.
    conn = http.client.HTTPConnection(HOST, server.port, timeout=60)
    conn.request("POST", "/v1/completions",
                 body=iter([b'{"prompt": "', b"y" * MAX_BODY_BYTES, b'"}']),
                 headers={"Content-Type": "application/json"}, encode_chunked=True)
    assert conn.getresponse().status == 413
    conn.close()
    # The openai client surfaces them as its own exceptions.
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model="any", messages=MESSAGES,
                                                extra_body={"pruning": "turbo"})
    assert e.value.body["param"] == "pruning"
    r = server.client().chat.completions.create(model="any", messages=MESSAGES, max_tokens=4)
    assert r.choices[0].message.content == expected(tiny_model(), chat_prompt(tokenizer, MESSAGES),
                                                    max_tokens=4)


@pytest.mark.parametrize("template", [True, False], ids=["chat-template", "no-template"])
def test_a_prompt_over_the_context_is_a_413_without_the_tokenizers_warning(
        tiny_model_path, tmp_path, caplog, template):
    """A prompt longer than the model's context (and the tokenizer's model_max_length) is a
    413, without transformers' warning that indexing it would fail (given once per
    tokenizer: a fresh server's), a completion's and a chat's, with the model's chat
    template or without one; other tokenizing still warns."""
    from transformers import AutoTokenizer

    model = tiny_model_path
    if not template:
        model = tmp_path / "model"
        shutil.copytree(tiny_model_path, model)
        config = json.loads((model / "tokenizer_config.json").read_text())
        del config["chat_template"]
        (model / "tokenizer_config.json").write_text(json.dumps(config))
    warning = "Token indices sequence length is longer than the specified maximum"
    context = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    long = "1" * (context + 10)  # a token per digit
    library = logging.getLogger("transformers")  # which does not propagate to caplog's
    library.addHandler(caplog.handler)
    try:
        with in_process_server(model) as s:
            for path, body in (("/v1/completions", {"prompt": long}),
                               ("/v1/chat/completions",
                                {"messages": [{"role": "user", "content": long}]})):
                status, _, payload = s.request("POST", path, body)
                assert status == 413 and payload["error"]["code"] == "context_length_exceeded"
        assert warning not in caplog.text
        AutoTokenizer.from_pretrained(str(model)).encode(long)
        assert warning in caplog.text
    finally:
        library.removeHandler(caplog.handler)


HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n")


@pytest.mark.parametrize("sent, drip, answer", [
    (HEAD[:40], None, b""),  # headers cut short after "Host: x\r\n": the connection is closed
    (HEAD[:40], b"y", b""),  # ... or sent a byte at a time (a header name that never ends)
    (HEAD + b"{", None, b"HTTP/1.1 408"),  # a body cut short: 408, then closed
    (HEAD + b"{", b" ", b"HTTP/1.1 408"),
])
def test_a_half_sent_request_is_cut_off_at_the_read_timeout(server, sent, drip, answer):
    """Headers or a body that stop arriving, or arrive a byte at a time, are cut off at the
    read timeout; the server goes on."""
    sock = socket.create_connection((HOST, server.port))
    sock.sendall(sent)
    tic = time.monotonic()
    sock.settimeout(0.25)
    received = b""
    while time.monotonic() - tic < READ_TIMEOUT_S + 5:
        try:
            data = sock.recv(4096)
        except socket.timeout:
            if drip:
                sock.sendall(drip)
            continue
        if not data:
            break
        received += data
    took = time.monotonic() - tic
    sock.close()
    assert received.startswith(answer) and (answer or not received), received
    # closed at the timeout, not at the client's pace (1,000 bytes dripped take 250 s)
    assert READ_TIMEOUT_S - 0.1 < took < READ_TIMEOUT_S + 5, took
    r = server.client().completions.create(model="any", prompt="hi", max_tokens=2)
    assert r.usage.completion_tokens == 2


@pytest.mark.parametrize("sent, flood, answer", [
    (HEAD[:40], b"y", b""),
    (HEAD.replace(b"1000", b"19000") + b"{", b" ", b"HTTP/1.1 408"),
])
def test_a_connection_closed_while_the_client_still_sends_ends_cleanly(server, sent, flood,
                                                                      answer):
    """A client still sending when the read timeout closes its connection gets the response and
    a clean end, not a reset that can lose the response: the server lingers (shuts its side,
    drops what arrives) instead of closing a socket with unread input. Bytes every 0.1 ms from
    just before the deadline make the unread input near certain."""
    sock = socket.create_connection((HOST, server.port))
    sock.sendall(sent)
    tic = time.monotonic()
    done = threading.Event()

    def send_until_closed() -> None:
        while not done.is_set() and time.monotonic() - tic < READ_TIMEOUT_S + 1:
            if time.monotonic() - tic < READ_TIMEOUT_S - 0.2:
                time.sleep(0.01)
                continue
            try:
                sock.send(flood)
            except OSError:
                return
            time.sleep(1e-4)

    sender = threading.Thread(target=send_until_closed)
    sender.start()
    received = b""
    sock.settimeout(READ_TIMEOUT_S + 5)
    try:
        while data := sock.recv(4096):
            received += data
    finally:
        done.set()
        sender.join()
        sock.close()
    assert received.startswith(answer) and (answer or not received), received
    r = server.client().completions.create(model="any", prompt="hi", max_tokens=2)
    assert r.usage.completion_tokens == 2


# ---------------------------------------------------------------- concurrency


def test_two_clients_at_once_get_their_own_answers(server, tiny_model):
    prompts = ["The quick brown fox jumps over", "Question: where is the key? Answer:"]
    wants = [expected(tiny_model(), p, max_tokens=10) for p in prompts]
    assert wants[0] != wants[1]
    got = [None, None]

    def ask(i: int) -> None:
        got[i] = server.client().completions.create(model="any", prompt=prompts[i],
                                                    max_tokens=10).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert got == wants


def _wait_for(server: Server, predicate, what: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = server.health()
        if predicate(health):
            return health
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}; last /health: {health}")


def send_raw(server: Server, body: dict) -> socket.socket:
    """POST ``body`` to /v1/completions on a raw socket, leaving the response unread."""
    sock = socket.create_connection((HOST, server.port))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def start_long_stream(server: Server) -> socket.socket:
    """A streaming generation of 3,000 tokens, read until its first token, then left running."""
    sock = send_raw(server, {"prompt": "Count", "max_tokens": 3000, "stream": True})
    received = b""
    while b"data: " not in received:
        received += sock.recv(4096)
    assert received.startswith(b"HTTP/1.1 200")
    _wait_for(server, lambda h: h["generating"] and h["generating"]["phase"] == "decode",
              "the long request to decode")
    return sock


def test_disconnect_stops_generation_and_a_full_queue_is_refused(server, tiny_model):
    before = server.health()
    sock = start_long_stream(server)

    # One more request may wait (--max-queue 1); the next is refused with Retry-After.
    prompt = "The quick brown fox jumps over"
    queued: dict = {}
    waiter = threading.Thread(target=lambda: queued.update(r=server.client().completions.create(
        model="any", prompt=prompt, max_tokens=5)))
    waiter.start()
    _wait_for(server, lambda h: h["queued"] == 1, "the second request to queue")
    status, headers, payload = server.request("POST", "/v1/completions",
                                              {"prompt": prompt, "max_tokens": 5})
    assert status == 503 and int(headers["retry-after"]) >= 1
    assert payload["error"]["code"] == "queue_full"

    # Disconnecting stops the first generation; the queued request then completes correctly.
    sock.close()
    waiter.join(timeout=300)
    assert queued["r"].choices[0].text == expected(tiny_model(), prompt, max_tokens=5)
    after = _wait_for(server, lambda h: h["generating"] is None, "the queue to drain")
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["completed"] == before["completed"] + 1


def test_a_non_streaming_client_that_leaves_during_decode_cancels_it(server):
    """Once it ran on to max_tokens and was counted completed: the disconnect was polled
    only after 0.5 s without an event, and decode never pauses."""
    before = server.health()
    sock = send_raw(server, {"prompt": "Count", "max_tokens": 3000})
    seen = _wait_for(server, lambda h: h["generating"] and h["generating"]["phase"] == "decode"
                     and h["generating"]["generated_tokens"] > 0, "the request to decode")
    sock.close()
    after = _wait_for(server, lambda h: h["generating"] is None, "the generation to stop")
    assert (after["cancelled"], after["completed"]) == (before["cancelled"] + 1,
                                                        before["completed"])
    assert seen["generating"]["generated_tokens"] < 2000, seen


# ---------------------------------------------------------------- a supervised worker


@contextmanager
def in_process_server(model: Path, store: Optional[PromptCacheStore] = None,
                      idle_complete: bool = False, max_queue: int = 2,
                      **settings) -> Iterator[Server]:
    """The app on uvicorn in a thread of this process, so a test can patch what its worker
    calls; ``settings`` are the other :class:`ServerSettings` fields, ``store``,
    ``idle_complete`` and ``max_queue`` the worker's."""
    worker = Worker(str(model), max_queue=max_queue, store=store, idle_complete=idle_complete)
    worker.wait_ready()
    sock = listen_socket(HOST, 0)
    settings = ServerSettings(model=str(model), max_queue=max_queue,
                              idle_complete=idle_complete, **settings)
    server = uvicorn_server(App(settings, worker).fastapi(), settings, "warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        yield Server(sock.getsockname()[1], timeout=60)  # a hang fails in a minute
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def request_id(payload: dict) -> str:
    """The request id a 500's message names."""
    found = re.search(r"request ((?:chatcmpl|cmpl|req)-[0-9a-f]{32})", payload["error"]["message"])
    assert found, payload
    return found.group(1)


def test_a_failing_job_is_its_own_500_and_the_worker_goes_on(tiny_model, tiny_model_path,
                                                              monkeypatch, caplog):
    real = server_worker.stream_generate
    faults = [RuntimeError("injected fault A"), RuntimeError("injected fault B")]

    def flaky(*args, **kw):
        if faults:
            raise faults.pop(0)
        return real(*args, **kw)

    monkeypatch.setattr(server_worker, "stream_generate", flaky)
    caplog.set_level(logging.ERROR, logger="mlx_lazy.server")
    body = {"prompt": "The quick brown fox jumps over", "max_tokens": 4}
    with in_process_server(tiny_model_path) as s:
        status, _, payload = s.request("POST", "/v1/completions", body)
        assert status == 500 and payload["error"]["code"] == "generation_failed", payload
        rid = request_id(payload)
        # the log has the traceback under the same id
        assert re.search(rf"request {rid} failed:\n.*Traceback.*injected fault A", caplog.text,
                         re.S), caplog.text
        # a stream ends with the error object, then [DONE]
        status, _, text = s.request("POST", "/v1/completions", {**body, "stream": True})
        events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
        assert status == 200 and events[-1] == "[DONE]", text
        error = json.loads(events[-2])["error"]
        assert error["code"] == "generation_failed" and request_id({"error": error}) in caplog.text
        # the worker goes on
        r = s.client().completions.create(model="any", **body)
        assert r.choices[0].text == expected(tiny_model(), body["prompt"], max_tokens=4)
        health = _wait_for(s, lambda h: h["generating"] is None, "the counts")
        assert health["status"] == "ok", health
        assert (health["failed"], health["completed"], health["cancelled"]) == (2, 1, 0)

        # A check the library makes that validation missed is still the client's 400.
        monkeypatch.setattr(server_module, "check_fits", lambda schedule, context: None)
        wide = {"method": "lazy", "prune_layers": [0], "keep": [0.5], "scorer": "last:pool=1000000"}
        status, _, payload = s.request("POST", "/v1/completions", {**body, "pruning": wide})
        assert status == 400 and "pool=1000000 is more than" in payload["error"]["message"], payload
        assert _wait_for(s, lambda h: h["generating"] is None, "the counts")["failed"] == 3

        # An internal error outside a job (here while checking a prompt) is named the same way.
        def broken(*args, **kw):
            raise RuntimeError("injected endpoint fault")

        monkeypatch.setattr(server_module, "check_tokens", broken)
        status, _, payload = s.request("POST", "/v1/completions",
                                       {"prompt": [1, 2], "max_tokens": 1})
        assert status == 500 and payload["error"]["type"] == "server_error", payload
        assert re.search(rf"request {request_id(payload)} failed:\n.*injected endpoint fault",
                         caplog.text, re.S), caplog.text


def test_a_client_holding_its_response_sees_it_counted_in_health(tiny_model_path, monkeypatch):
    # the worker's clean-up made slow: a response sent before its job is counted would show
    # in /health as still generating, with nothing counted
    real = server_worker.mx.clear_cache

    def slow():
        time.sleep(0.5)
        real()

    monkeypatch.setattr(server_worker.mx, "clear_cache", slow)
    body = {"prompt": "The quick brown fox jumps over", "max_tokens": 2}
    with in_process_server(tiny_model_path) as s:
        for stream in (False, True):
            before = s.health()
            status, _, _ = s.request("POST", "/v1/completions", {**body, "stream": stream})
            after = s.health()
            assert status == 200 and after["generating"] is None, after
            assert after["completed"] == before["completed"] + 1, (before, after)
        monkeypatch.setattr(server_worker, "stream_generate", lambda *a, **kw: 1 / 0)
        status, _, _ = s.request("POST", "/v1/completions", body)
        after = s.health()
        assert status == 500 and after["generating"] is None and after["failed"] == 1, after


def test_a_stuck_job_makes_health_503_until_it_moves(tiny_model_path, monkeypatch):
    real, release = server_worker.stream_generate, threading.Event()

    def hung(*args, **kw):
        release.wait(timeout=120)
        return real(*args, **kw)

    monkeypatch.setattr(server_worker, "stream_generate", hung)
    with in_process_server(tiny_model_path, stall_timeout_s=0.5) as s:
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(r=s.request(
            "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})))
        t.start()
        deadline = time.monotonic() + 60
        while (status := s.request("GET", "/health"))[0] == 200:
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        assert status[0] == 503 and status[2]["status"] == "stuck", status
        assert status[2]["generating"]["seconds_since_progress"] > 0.5
        release.set()
        t.join(timeout=120)
        assert result["r"][0] == 200
        status, _, health = s.request("GET", "/health")
        assert status == 200 and health["status"] == "ok"


class _Fatal(BaseException):
    """Not an Exception: what supervision does not catch (as SystemExit)."""


def test_a_dead_worker_fails_its_job_and_health_says_503(tiny_model_path, monkeypatch, caplog):
    def fatal(*args, **kw):
        raise _Fatal("injected")

    monkeypatch.setattr(server_worker, "stream_generate", fatal)
    caplog.set_level(logging.ERROR, logger="mlx_lazy.server")
    body = {"prompt": "hi", "max_tokens": 2}
    with in_process_server(tiny_model_path) as s:
        status, _, payload = s.request("POST", "/v1/completions", body)
        assert status == 500 and payload["error"]["code"] == "generation_failed", payload
        assert "the generation worker stopped" in caplog.text
        status, _, health = s.request("GET", "/health")
        assert status == 503 and health["status"] == "dead", health
        # later requests are refused at once, not queued forever
        status, _, payload = s.request("POST", "/v1/completions", body)
        assert status == 503 and payload["error"]["code"] == "worker_dead", payload


# ---------------------------------------------------------------- authentication


@pytest.mark.slow  # runs a process of its own
def test_api_key(tiny_model_path, tmp_path):
    with run_server(tiny_model_path, "--api-key", "s3cret", tmp_path=tmp_path) as s:
        assert s.request("GET", "/health")[0] == 200  # health needs no key
        # where it listens is said once it does (uvicorn on a given socket said nothing)
        assert f"serving on http://{HOST}:{s.port}/v1 (pruning: full;" in s.log.read_text()
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}]:
            status, hdrs, payload = s.request("GET", "/v1/models", headers=headers)
            assert status == 401 and payload["error"]["type"] == "authentication_error"
            assert hdrs["www-authenticate"] == "Bearer"
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").completions.create(model="any", prompt="hi", max_tokens=2)
        r = s.client(api_key="s3cret").completions.create(model="any", prompt="hi", max_tokens=2)
        assert r.usage.completion_tokens == 2
        # the key is checked before the body is read: once a malformed body got a 400 first
        for body in (b'{"prompt": ', b"x" * (2 * DEFAULT_MAX_BODY_BYTES)):
            status, _, payload = s.request("POST", "/v1/completions", body)
            assert status == 401 and payload["error"]["code"] == "invalid_api_key", payload
        status, _, payload = s.request("POST", "/v1/completions", b'{"prompt": ',
                                       headers={"Authorization": "Bearer s3cret"})
        assert status == 400, payload


# ---------------------------------------------------------------- SmolLM2


@pytest.mark.slow
def test_smollm2_full_equals_mlx_lm_and_lazy_reports_pruning(smollm2_path, smollm2, tmp_path):
    import mlx_lm

    model, tokenizer = smollm2
    messages = [{"role": "user",
                 "content": "What is the capital of France? Answer in one sentence."}]
    prompt = chat_prompt(tokenizer, messages)
    ours = generate(model, tokenizer, prompt, max_tokens=24)
    assert ours == mlx_lm.generate(model, tokenizer, prompt=prompt, max_tokens=24)

    whole = (Path(mlx_lazy.__file__).parent / "data" / "declaration_of_independence.txt"
             ).read_text()
    doc = whole[: len(whole) // 2]  # ~900 tokens: a prefill to watch, short enough for CI
    long_messages = [{"role": "user", "content": doc + "\n\nWho wrote this?"}]
    with run_server(smollm2_path, tmp_path=tmp_path) as s:
        client = s.client()
        r = client.chat.completions.create(model="any", messages=messages, max_tokens=24,
                                           extra_body={"pruning": "full"})
        assert r.choices[0].message.content == ours

        # /health answers while a long lazy prefill runs, and sees it in progress.
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(r=client.chat.completions.create(
            model="any", messages=long_messages, max_tokens=2, extra_body={"pruning": "lazy"})))
        t.start()
        seen = _wait_for(s, lambda h: h["generating"] and h["generating"]["phase"] == "prefill"
                         and 0 < h["generating"]["layers_done"] < h["generating"]["num_layers"],
                         "the prefill", timeout=300)
        assert seen["generating"]["num_layers"] == 30
        t.join(timeout=600)
        pruning = result["r"].usage.model_extra["pruning"]
        own = (smollm2_path / MODEL_SCHEDULE_FILE).exists()  # what a plain "lazy" runs
        assert pruning["method"] == "lazy" and pruning["schedule_source"] == (
            f"calibrated:{MODEL_SCHEDULE_FILE}" if own else "calibrated:smollm2-135m.json")
        n = result["r"].usage.prompt_tokens
        assert n > 800
        # the packaged schedule's cuts pruned the prefill (half its token-layers in 30
        # layers), and its decode mode (none) ran on the pruned state: nothing completed
        assert pruning["prefill_token_layers"] < 0.8 * 30 * n
        assert pruning["completed_token_layers"] == 0
        assert pruning["prompt_token_layers_computed_pct"] < 80

        # A client that leaves during the prefill stops it before its last layer. The prompt
        # (~3,400 tokens, ~10 s of prefill here) makes a prefill that ran on plain to see; one
        # cancelled as it should costs only its first layers.
        before = s.health()
        sock = send_raw(s, {"prompt": whole * 2, "max_tokens": 50, "stream": True})
        seen = [_wait_for(s, lambda h: h["generating"] and h["generating"]["phase"] == "prefill"
                          and h["generating"]["layers_done"] >= 2,
                          "the prefill", timeout=300)["generating"]]
        sock.close()
        while seen[-1] is not None:
            time.sleep(0.05)
            seen.append(s.health()["generating"])
        # stopped within a third of the layers after the first sight (~3 s here), never decoding
        assert all(g["phase"] == "prefill" for g in seen[:-1]), seen
        assert seen[-2]["layers_done"] <= seen[0]["layers_done"] + 10, seen
        assert s.health()["cancelled"] == before["cancelled"] + 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_whose_client_left_while_queued_is_never_generated(server, tiny_model, stream):
    """Nor does it hold its place in the queue: a client that gives up while it waits frees
    the slot (--max-queue 1) at once, for a live client to take."""
    before = server.health()
    running = start_long_stream(server)
    waiting = send_raw(server, {"prompt": "Count", "max_tokens": 5, "stream": stream})
    _wait_for(server, lambda h: h["queued"] == 1, "the second request to queue")
    waiting.close()
    freed = _wait_for(server, lambda h: h["queued"] == 0, "the queue to free the slot")
    assert freed["cancelled"] == before["cancelled"] + 1 and freed["generating"], freed
    live = send_raw(server, {"prompt": "Count", "max_tokens": 5})
    _wait_for(server, lambda h: h["queued"] == 1, "a live request to take the slot")
    live.close()
    time.sleep(2.0)  # the server hears of the disconnect at once: a margin for a busy machine
    running.close()
    after = _wait_for(server, lambda h: h["generating"] is None and h["queued"] == 0,
                      "the queue to drain")
    assert (after["cancelled"], after["completed"]) == (
        before["cancelled"] + 3, before["completed"])
    r = server.client().completions.create(model="any", prompt="Count", max_tokens=3)
    assert r.choices[0].text == expected(tiny_model(), "Count", max_tokens=3)


def test_a_looped_models_progress_counts_each_pass(tiny_model_dir):
    """A job's progress counts the engine's layers: a looped Nanbeige (2 blocks run twice,
    each pass with its own keys and values) has 4, not its 2 blocks."""
    worker = Worker(str(tiny_model_dir("nanbeige")), max_queue=1)
    worker.wait_ready()
    assert worker.num_layers == 4
