"""OpenAI-compatible HTTP server with pruning per request: ``python -m mlx_lazy.server``.

Endpoints as mlx-lm's server and the OpenAI API define them: ``POST /v1/chat/completions``,
``POST /v1/completions``, ``GET /v1/models`` and ``GET /health``. A request may choose its
pruning with one extra body field, ``"pruning"``: a preset name (``"full"``, ``"lazy"``, ...)
or an object of :class:`~mlx_lazy.config.PruningConfig` fields; without it the server's
``--method`` / ``--schedule`` apply. ``usage.pruning`` reports what the pruning did.

One thread owns the model and runs one generation at a time from a queue; the HTTP side
(FastAPI on uvicorn, one event loop) only parses, validates and streams, so ``/health``
answers during a long prefill. A client that disconnects cancels its generation (between two
layers of the prefill or two decode steps). Every error is an OpenAI-style error object:
``{"error": {"message", "type", "param", "code"}}``.

Here: the request bodies and the bounds on their fields, the middleware, the :class:`App`
and :func:`main`. The generation thread and its jobs are :mod:`mlx_lazy.server_worker`, the
command line's flags and settings :mod:`mlx_lazy.server_settings`, the prompt caches kept
between requests :mod:`mlx_lazy.prefix_store`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import json
import logging
import os
import socket
import sys
import time
import traceback
import uuid
from typing import Annotated, Any, AsyncIterator, Dict, List, Literal, Optional, Sequence, Union

from jinja2 import TemplateError

from .extras import needs_extra

with needs_extra("server", "the server"):
    from fastapi import FastAPI, Request
    from fastapi.concurrency import run_in_threadpool
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from pydantic import AfterValidator, BaseModel, ConfigDict, Field
    from sse_starlette import EventSourceResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
    import h11
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

from .api import check_anchors, check_context, check_tokens, prompt_token_ids
from .config import PruningConfig
from .errors import UserInputError, one_line, shown
from .inputs import parse_int
from .policies import compose
from .prefix_store import PromptCacheStore
from .resolve import resolve_config
from .schedule import check_fits
from .server_settings import ServerSettings, build_parser, is_loopback, settings_from_args
from .server_worker import GONE, APIError, Delta, Done, Job, Worker

log = logging.getLogger("mlx_lazy.server")

SSE_PING_S = 15  # a comment line keeps proxies from closing a stream during a long prefill


# ---------------------------------------------------------------- errors


def error_response(exc: APIError) -> JSONResponse:
    """``exc`` as an HTTP response: its status, headers and OpenAI-style error object."""
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _param(loc: Sequence[Union[str, int]]) -> Optional[str]:
    """``("body", "messages", 0, "content")`` -> ``"messages[0].content"``."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or None


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    bad_json = next((e for e in errors if e["type"] == "json_invalid"), None)
    if bad_json is not None:
        why = bad_json.get("ctx", {}).get("error", bad_json["msg"])
        return APIError(400, f"malformed JSON in the request body: {why}")
    # A union reports one error per member (loc ends in the member's type): the field is the
    # common prefix of the first field's errors.
    locs = [tuple(e["loc"]) for e in errors if tuple(e["loc"][:2]) == tuple(errors[0]["loc"][:2])]
    param = _param(os.path.commonprefix(locs))
    first = errors[0]
    msg = first["msg"] if len(locs) == 1 else f"{first['msg']} (or another accepted type)"
    where = param or "the request body"
    return APIError(400, f"{where}: {msg}", param=param,
                    code="missing_field" if first["type"] == "missing" else None)


# ---------------------------------------------------------------- bounds on request fields


class Bounds:
    """Every request field whose cost grows with its size, and its bound: no body within
    them costs more than a bounded amount of time or memory before it is refused.

    Cost model, per request, n being the body's bytes:

    * the body: read, parsed and validated in O(n); ``max_body_bytes`` (413) is checked on
      the bytes as they arrive, before any parsing. Fields the server ignores (``tools``,
      ``user``, ...) cost their parse only, within that bound.
    * a prompt's text: tokenizing is O(bytes) and the slowest step a body can ask for (1-2 s
      per MB on a CPU), so a text too long to fit ``prompt_tokens`` is refused (413)
      before the tokenizer runs: a token stands for at most ``token_bytes`` bytes of text
      (:func:`token_bytes`), so more than ``prompt_tokens * token_bytes`` bytes cannot fit.
    * token ids: checked against the vocabulary in O(ids); more than ``prompt_tokens`` is 413.
    * ``messages``: the chat template renders O(messages + bytes); at most
      :data:`MAX_MESSAGES` (OpenAI's own limit), their text as a prompt's text above.
    * ``stop``: the check is linear in the generated text for each stop string
      (:class:`~mlx_lazy.server_worker.StopText`), its set-up linear in their length, and a
      stream withholds at most the longest one less a character: at most :data:`MAX_STOPS`
      of :data:`MAX_STOP_CHARS`.
    * ``logit_bias``: every decode step adds each bias, O(entries); at most
      :data:`MAX_LOGIT_BIAS` entries, each a token of the vocabulary.
    * ``pruning``: checked against the model in O(its size) before the request is queued.
    * ``max_tokens``: within the model's context (400 otherwise).

    Args:
        prompt_tokens: the most prompt tokens accepted (None: no limit known).
        token_bytes: the most bytes of text one token stands for (None: not known).
    """

    def __init__(self, prompt_tokens: Optional[int], token_bytes: Optional[int]) -> None:
        self.prompt_tokens, self.token_bytes = prompt_tokens, token_bytes

    @property
    def text_bytes(self) -> Optional[int]:
        """The most bytes of prompt text that could fit ``prompt_tokens`` tokens."""
        if self.prompt_tokens is None or self.token_bytes is None:
            return None
        return self.prompt_tokens * self.token_bytes

    def check_text(self, nbytes: int, param: str) -> None:
        """Refuse, before tokenizing, a prompt of ``nbytes`` bytes of text that cannot fit.

        Raises:
            APIError: 413.
        """
        limit = self.text_bytes
        if limit is not None and nbytes > limit:
            raise APIError(413, f"the prompt's text has {nbytes} bytes; at most "
                                f"{self.prompt_tokens} tokens are accepted, which no text "
                                f"longer than {limit} bytes fits", param=param,
                           code="context_length_exceeded")

    def check_tokens(self, n: int, param: str) -> None:
        """Refuse a prompt of ``n`` tokens longer than ``prompt_tokens``.

        Raises:
            APIError: 413.
        """
        if self.prompt_tokens is not None and n > self.prompt_tokens:
            raise APIError(413, f"the prompt has {n} tokens; this server accepts at most "
                                f"{self.prompt_tokens}", param=param,
                           code="context_length_exceeded")


MAX_STOPS = 4  # OpenAI's limit
MAX_STOP_CHARS = 500
MAX_MESSAGES = 2048  # OpenAI's limit
MAX_LOGIT_BIAS = 1024


def token_bytes(tokenizer) -> Optional[int]:
    """The most bytes of text one token of ``tokenizer`` stands for (None when the tokenizer
    cannot say): the longest token decoded alone, plus the leading space a decoder may drop,
    times 4 when the tokenizer normalizes its input first (NFKC may shrink a 4-byte character
    to one byte). About a second for a vocabulary of 150K tokens, once."""
    try:
        ids = [[i] for i in tokenizer.get_vocab().values()]
        longest = max((len(t.encode("utf-8", "surrogatepass"))
                       for t in tokenizer.batch_decode(ids)), default=0)
    except (AttributeError, TypeError, ValueError):  # not a Hugging Face tokenizer
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    shrink = 1 if backend is not None and backend.normalizer is None else 4
    return (longest + 1) * shrink


# ---------------------------------------------------------------- request bodies


class _Strict(BaseModel):
    # Strict: "5" is not a number; unknown fields are ignored, since OpenAI clients send
    # many (frequency_penalty, user, ...) that this server does not use.
    model_config = ConfigDict(strict=True, extra="ignore")


def _utf8(text: str) -> str:
    """``text`` when it can be encoded (JSON's ``"\\ud800"`` decodes to a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid text: {text[e.start]!r} at index {e.start} is a lone "
                         "surrogate") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class Message(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: Union[Text, List[TextPart]]


class StreamOptions(_Strict):
    include_usage: bool = False


class _Body(_Strict):
    model: Optional[str] = None
    max_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    temperature: Optional[Annotated[float, Field(ge=0.0, le=2.0)]] = None
    top_p: Optional[Annotated[float, Field(gt=0.0, le=1.0)]] = None
    seed: Optional[Annotated[int, Field(ge=0, lt=2**64)]] = None  # mx.random.seed's domain
    stop: Union[StopString, Annotated[List[StopString], Field(max_length=MAX_STOPS)], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: Literal[1] = 1
    logit_bias: Optional[Annotated[Dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
                                   Field(max_length=MAX_LOGIT_BIAS)]] = None
    pruning: Union[Text, Dict[Text, Any], None] = None


class ChatRequest(_Body):
    messages: Annotated[List[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Optional[Annotated[int, Field(ge=1)]] = None


class CompletionRequest(_Body):
    prompt: Union[Annotated[Text, Field(min_length=1)], Annotated[List[int], Field(min_length=1)]]


# ---------------------------------------------------------------- pruning per request


INTERNAL_FIELDS = ("source", "fingerprint")  # PruningConfig fields set by schedule files only


def pruning_config(spec: Union[str, Dict[str, Any]], default: PruningConfig,
                   num_layers: Optional[int] = None) -> PruningConfig:
    """The configuration a ``"pruning"`` value asks for (not yet checked against a model).

    A string is a method (its preset). An object holds :class:`PruningConfig` fields other
    than :data:`INTERNAL_FIELDS`; with a ``"method"`` it overrides that preset, without one
    the server's ``default``. JSON arrays become tuples; with ``num_layers``, one longer than
    that is refused before any is checked (a list names one item per cut, at most one cut per
    layer).

    Raises:
        APIError: 400 for an unknown preset, method or field, or a field of the wrong type.
    """
    if isinstance(spec, str):
        fields, method = {}, spec
    else:
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()}
        method = fields.pop("method", None)
        names = {f.name for f in dataclasses.fields(PruningConfig)} - set(INTERNAL_FIELDS)
        unknown = sorted(set(fields) - names)
        if unknown:
            raise APIError(400, f"unknown pruning field {shown(unknown[0], 40)}; fields are "
                                f"{', '.join(sorted(names))}", param=f"pruning.{unknown[0]}")
        long = next((k for k, v in fields.items() if isinstance(v, tuple)
                     and num_layers is not None and len(v) > num_layers), None)
        if long is not None:
            raise APIError(400, f"pruning.{long} has {len(fields[long])} items; the model has "
                                f"{num_layers} layers, at most one cut each",
                           param=f"pruning.{long}")
    if method is not None:
        try:
            compose(method)
        except UserInputError as e:
            raise APIError(400, str(e),
                           param="pruning" if isinstance(spec, str) else "pruning.method") from None
    try:  # PruningConfig checks its fields' types on construction
        if method is None:
            return dataclasses.replace(default, **fields)
        return PruningConfig.preset(method, **fields)
    except UserInputError as e:
        raise APIError(400, str(e), param="pruning") from None


# ---------------------------------------------------------------- the HTTP application


class BodyLimit:
    """ASGI middleware: a POST body over ``limit`` bytes is answered 413, and one that has not
    fully arrived ``timeout`` seconds after its headers 408, before any parsing."""

    def __init__(self, app, limit: int, timeout: float) -> None:
        self.app, self.limit, self.timeout = app, limit, timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        too_large = APIError(413, f"the request body exceeds {self.limit} bytes",
                             code="request_too_large")
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.limit:
            return await error_response(too_large)(scope, receive, send)
        chunks, size, more = [], 0, True
        deadline = asyncio.get_running_loop().time() + self.timeout
        while more:  # a chunked body has no Content-Length: count as it arrives
            left = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), timeout=max(left, 0))
            except asyncio.TimeoutError:
                slow = APIError(408, f"the request body did not arrive within {self.timeout:g} s",
                                code="request_timeout", headers={"Connection": "close"})
                return await error_response(slow)(scope, receive, send)
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await error_response(too_large)(scope, receive, send)
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


class ApiKey:
    """ASGI middleware: every request but ``/health`` must carry ``Authorization: Bearer
    KEY``, checked in constant time on the headers alone (401), before the body is read."""

    def __init__(self, app, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope["headers"]:
            scheme, _, credentials = value.partition(b" ")
            if name == b"authorization" and scheme.lower() == b"bearer":
                given = credentials.strip()
        if not hmac.compare_digest(given, self.key):
            refused = APIError(401, "invalid or missing API key (send 'Authorization: Bearer "
                                    "KEY')", type="authentication_error", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
            return await error_response(refused)(scope, receive, send)
        await self.app(scope, receive, send)


class HeaderDeadline(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose next request's headers have not all
    arrived ``timeout`` seconds after it opened or after its last response (uvicorn times an
    idle connection only until its first byte, so a client that stops mid-headers is held
    forever). The body's deadline is :class:`BodyLimit`'s."""

    def __init__(self, *args, timeout: float, **kw) -> None:
        super().__init__(*args, **kw)
        self.timeout = timeout
        self.deadline: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self.arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request's headers are in
            self.disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE:
            self.arm()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.disarm()
        super().connection_lost(exc)

    def arm(self) -> None:
        """Start (or restart) the headers' deadline."""
        self.disarm()
        self.deadline = self.loop.call_later(self.timeout, self.transport.close)

    def disarm(self) -> None:
        """Cancel the headers' deadline."""
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None


class App:
    """The HTTP side of the server: validates each request into a :class:`Job` for
    ``worker``'s (loaded) model with ``settings``, and returns or streams its output
    (:meth:`fastapi` builds the application that routes to the endpoints here)."""

    def __init__(self, settings: ServerSettings, worker: Worker) -> None:
        self.settings, self.worker = settings, worker
        self.tokenizer = worker.tokenizer
        self.model_id = settings.model or "default_model"
        self.created = int(time.time())
        self.bounds = Bounds(settings.max_prompt_tokens or (worker.context and worker.context - 1),
                             token_bytes(self.tokenizer))

    def fastapi(self) -> FastAPI:
        """The FastAPI application: the middleware (the API key first, then the body's
        limits), the error handlers and the endpoints."""
        app = FastAPI(title="mlx-lazy", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_middleware(BodyLimit, limit=self.settings.max_body_bytes,
                           timeout=self.settings.read_timeout_s)
        if self.settings.api_key is not None:  # added last, so it runs first
            app.add_middleware(ApiKey, key=self.settings.api_key)
        app.add_exception_handler(APIError, _api_error)
        app.add_exception_handler(RequestValidationError, _invalid)
        app.add_exception_handler(StarletteHTTPException, _http_error)
        app.add_exception_handler(Exception, _internal)
        app.get("/health")(self.health)
        app.get("/v1/models")(self.models)
        app.post("/v1/chat/completions")(self.chat_completions)
        app.post("/v1/completions")(self.completions)
        return app

    # ------------------------------------------------------------ endpoints
    async def health(self) -> JSONResponse:
        """200 with ``"status": "ok"``; 503 with ``"dead"`` when the generation thread has
        ended, ``"stuck"`` when its job has made no progress for ``stall_timeout_s``."""
        status = self.worker.status()
        stalled = (status["generating"] is not None and
                   status["generating"]["seconds_since_progress"] > self.settings.stall_timeout_s)
        state = "dead" if not self.worker.alive else "stuck" if stalled else "ok"
        return JSONResponse({"status": state, "model": self.model_id, **status},
                            status_code=200 if state == "ok" else 503)

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_id, "object": "model",
                                            "created": self.created, "owned_by": "mlx-lazy"}]}

    async def chat_completions(self, body: ChatRequest, request: Request):
        self.bounds.check_text(sum(len(m.content.encode()) if isinstance(m.content, str)
                                   else sum(len(p.text.encode()) for p in m.content)
                                   for m in body.messages), "messages")
        tokens = await run_in_threadpool(self.chat_tokens, body.messages)
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await self.respond(body, tokens, request, chat=True, max_tokens=max_tokens)

    async def completions(self, body: CompletionRequest, request: Request):
        if isinstance(body.prompt, str):
            self.bounds.check_text(len(body.prompt.encode()), "prompt")
            tokens = await run_in_threadpool(prompt_token_ids, self.tokenizer, body.prompt)
        else:
            self.bounds.check_tokens(len(body.prompt), "prompt")
            try:
                check_tokens(body.prompt, self.worker.vocab_size)
            except UserInputError as e:
                raise APIError(400, str(e), param="prompt") from None
            tokens = list(body.prompt)
        return await self.respond(body, tokens, request, chat=False, max_tokens=body.max_tokens)

    # ------------------------------------------------------------ a request's parts
    def chat_tokens(self, messages: List[Message]) -> List[int]:
        """The prompt of ``messages``: the model's chat template, or without one their
        contents, one per line."""
        tokenizer = self.tokenizer
        plain = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                  else "".join(p.text for p in m.content or [])} for m in messages]
        if not getattr(tokenizer, "has_chat_template", False):
            return prompt_token_ids(tokenizer, "\n".join(m["content"] for m in plain))
        try:
            text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
        except TemplateError as e:  # e.g. "roles must alternate user/assistant"
            raise APIError(400, f"the model's chat template rejects these messages: {e}",
                           param="messages") from None
        return list(tokenizer.encode(text, add_special_tokens=False))

    def make_job(self, rid: str, body: _Body, tokens: List[int],
                 max_tokens: Optional[int]) -> Job:
        """The job for a validated body and its prompt ``tokens``.

        Raises:
            APIError: 400 for a pruning or ``max_tokens`` the model cannot run, 413 for a
                prompt over the limit.
        """
        settings, worker = self.settings, self.worker
        config = (settings.config if body.pruning is None
                  else pruning_config(body.pruning, settings.config, worker.num_layers))
        n = len(tokens)
        try:  # the request's one resolve; the worker runs this schedule
            schedule = resolve_config(worker.model, config, fingerprint=worker.fingerprint)
            check_anchors(schedule, n)
            check_fits(schedule, worker.context)  # before the worker: 400, not its 500
        except ValueError as e:
            raise APIError(400, f"pruning: {e}", param="pruning") from None
        self.bounds.check_tokens(n, "messages" if isinstance(body, ChatRequest) else "prompt")
        if max_tokens is None:  # the server's default, shortened to fit the context
            room = settings.max_tokens if worker.context is None else worker.context - n
            max_tokens = max(1, min(settings.max_tokens, room))
        param = ("max_completion_tokens" if getattr(body, "max_completion_tokens", None)
                 else "max_tokens")
        try:
            check_context(n, max_tokens, worker.context, param)
        except ValueError as e:
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        return Job(id=rid, tokens=tokens, max_tokens=max_tokens,
                   temperature=(settings.temperature if body.temperature is None
                                else body.temperature),
                   top_p=settings.top_p if body.top_p is None else body.top_p,
                   seed=body.seed, stop=stop, schedule=schedule, loop=asyncio.get_running_loop(),
                   logit_bias=self.logit_bias(body.logit_bias))

    def logit_bias(self, bias: Optional[Dict[str, float]]) -> Dict[int, float]:
        """``logit_bias`` with its keys read as token ids of the vocabulary.

        Raises:
            APIError: 400 for a key that is not one.
        """
        out = {}
        for key, value in (bias or {}).items():
            try:
                token = parse_int(key)
            except ValueError:
                token = -1
            if not 0 <= token < self.worker.vocab_size:
                raise APIError(400, f"logit_bias: {shown(key, 40)} is not a token id in "
                                    f"[0, {self.worker.vocab_size})", param="logit_bias")
            out[token] = value
        return out

    async def respond(self, body: _Body, tokens: List[int], request: Request, chat: bool,
                      max_tokens: Optional[int]):
        """Queue the request's job; return its completion, or stream it as server-sent
        events."""
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        job = self.make_job(rid, body, tokens, max_tokens)
        self.worker.submit(job)
        obj = "chat.completion" if chat else "text_completion"
        head = {"id": rid, "object": obj, "created": int(time.time()), "model": self.model_id}

        if not body.stream:
            text, done = "", None
            watcher = asyncio.create_task(_watch(job, request))
            try:
                async for item in _events(job):  # a failed job raises its APIError
                    if isinstance(item, Delta):
                        text += item.text
                    else:
                        done = item
            finally:
                watcher.cancel()
            if done is None:  # the client went away
                return JSONResponse({}, status_code=499)
            out = ({"message": {"role": "assistant", "content": text}} if chat
                   else {"text": text})
            choice = {"index": 0, **out, "logprobs": None, "finish_reason": done.finish_reason}
            return {**head, "choices": [choice], "usage": _usage(done)}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(piece: Optional[str], finish: Optional[str], first: bool = False) -> str:
            if chat:
                delta = {} if piece is None else {"content": piece}
                if first:
                    delta = {"role": "assistant", **delta}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                return json.dumps({**head, "object": "chat.completion.chunk", "choices": [choice]})
            choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
            return json.dumps({**head, "choices": [choice]})

        async def sse() -> AsyncIterator[str]:
            first = True
            try:
                async for item in _events(job):
                    if isinstance(item, Delta):
                        yield chunk(item.text, None, first)
                        first = False
                        continue
                    yield chunk(None, item.finish_reason, first)
                    if include_usage:
                        yield json.dumps({**head, "object": "chat.completion.chunk" if chat
                                          else obj, "choices": [], "usage": _usage(item)})
            except APIError as e:  # the job failed
                yield json.dumps(e.body())
            yield "[DONE]"

        return EventSourceResponse(sse(), ping=SSE_PING_S, sep="\n")


def create_app(settings: ServerSettings, worker: Worker) -> FastAPI:
    """The FastAPI application serving ``worker``'s (loaded) model with ``settings``."""
    return App(settings, worker).fastapi()


async def _events(job: Job) -> AsyncIterator[Union[Delta, Done]]:
    """The job's output, ending early at a :data:`~mlx_lazy.server_worker.GONE`; setting
    ``job.cancel`` when the consumer stops early."""
    try:
        while True:
            item = await job.events.get()
            if item is GONE:
                return
            if isinstance(item, APIError):
                raise item
            yield item
            if isinstance(item, Done):
                return
    finally:
        job.cancel.set()  # no effect once finished


async def _watch(job: Job, request: Request) -> None:
    """Cancel ``job`` the moment its client disconnects (a response that writes nothing until
    the end learns it only from the connection); a stream's response does that itself."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel.set()
    job.events.put_nowait(GONE)


def _usage(done: Done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
            "pruning": done.pruning}


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(_validation_error(exc))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(APIError(exc.status_code, str(exc.detail), headers=exc.headers))


async def _internal(request: Request, exc: Exception) -> JSONResponse:
    rid = "req-" + uuid.uuid4().hex
    log.error("request %s failed:\n%s", rid, "".join(traceback.format_exception(exc)))
    return error_response(APIError(500, f"internal server error (request {rid}; see the server "
                                        "log)", type="server_error"))


# ---------------------------------------------------------------- command line


def uvicorn_server(app: FastAPI, settings: ServerSettings, log_level: str) -> uvicorn.Server:
    """A uvicorn server for ``app`` whose connections have ``settings.read_timeout_s`` for a
    request's headers (:class:`HeaderDeadline`)."""
    protocol = functools.partial(HeaderDeadline, timeout=settings.read_timeout_s)
    return uvicorn.Server(uvicorn.Config(app, http=protocol, log_level=log_level,
                                         timeout_graceful_shutdown=5))


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (not yet listening).

    Raises:
        UserInputError: the address does not resolve, is not this machine's, or is in use.
    """
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserInputError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    family, kind, proto, _, address = info[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UserInputError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the server until interrupted; return the exit status (2 for bad input)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    try:
        settings = settings_from_args(args)
        sock = listen_socket(args.host, args.port)  # before the (slow) model load
        store = (PromptCacheStore(settings.prompt_cache_size, settings.prompt_cache_bytes,
                                  settings.share_pruned_caches)
                 if settings.prompt_cache_size else None)
        worker = Worker(settings.model, settings.max_queue, store, settings.idle_complete)
        worker.wait_ready()
        limit, context = settings.max_prompt_tokens, worker.context
        if limit is not None and context is not None and limit >= context:
            raise UserInputError(f"--max-prompt-tokens {limit} leaves no room for an answer in "
                                 f"the model's context of {context} tokens (at most {context - 1})")
        try:
            check_fits(resolve_config(worker.model, settings.config,
                                      fingerprint=worker.fingerprint), context)
        except ValueError as e:
            flag = f"--schedule {args.schedule}" if args.schedule else f"--method {args.method}"
            raise UserInputError(f"{flag}: {e}") from None
    except UserInputError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    if not is_loopback(args.host) and settings.api_key is None:
        print(f"warning: listening on {args.host} with no authentication: anyone who can reach "
              f"this port can use the model (set --api-key)", file=sys.stderr)
    uvicorn_server(create_app(settings, worker), settings, args.log_level).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
