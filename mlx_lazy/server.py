"""OpenAI-compatible HTTP server with pruning per request: ``python -m mlx_lazy.server``.

Endpoints as mlx-lm's server and the OpenAI API define them: ``POST /v1/chat/completions``,
``POST /v1/completions``, ``GET /v1/models`` and ``GET /health``. A request may choose its
pruning with one extra body field, ``"pruning"``: a preset name (``"full"``, ``"lazy"``, ...)
or an object of :class:`~mlx_lazy.schedule.PruningConfig` fields; without it the server's
``--method`` / ``--schedule`` apply. ``usage.pruning`` reports what the pruning did.

One thread owns the model and runs one generation at a time from a queue; the HTTP side
(FastAPI on uvicorn, one event loop) only parses, validates and streams, so ``/health``
answers during a long prefill. A client that disconnects cancels its generation (between two
layers of the prefill or two decode steps). Every error is an OpenAI-style error object:
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hmac
import ipaddress
import json
import logging
import math
import os
import queue
import sys
import threading
import time
import traceback
import uuid
from contextlib import closing
from typing import Annotated, Any, AsyncIterator, Dict, List, Literal, Optional, Sequence, Tuple, Union

import mlx.core as mx
from fastapi import Depends, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from jinja2 import TemplateError
from mlx_lm.sample_utils import make_sampler
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .adapter import ModelAdapter
from .cli import METHOD_HELP, OneLineParser, method_arg, temperature_arg, top_p_arg
from .api import (_encode, check_anchors, check_context, check_tokens, context_length, load,
                  stream_generate)
from .errors import UserInputError
from .schedule import PruningConfig, compose

log = logging.getLogger("mlx_lazy.server")

DEFAULT_PORT = 8080
DEFAULT_MAX_TOKENS = 512  # mlx-lm's server default
DEFAULT_MAX_QUEUE = 8
DEFAULT_MAX_BODY_BYTES = 8 * 2**20
SSE_PING_S = 15  # a comment line keeps proxies from closing a stream during a long prefill
_LOOPBACK_NAMES = ("localhost",)


# ---------------------------------------------------------------- errors


class APIError(Exception):
    """An HTTP error answered with an OpenAI-style error object."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, type: str = "invalid_request_error",
                 headers: Optional[Dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type, self.headers = type, headers

    def body(self) -> dict:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


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


# ---------------------------------------------------------------- request bodies


class _Strict(BaseModel):
    # Strict: "5" is not a number; unknown fields are ignored, since OpenAI clients send
    # many (frequency_penalty, user, ...) that this server does not use.
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: str
    content: Union[str, List[TextPart], None] = None


class StreamOptions(_Strict):
    include_usage: bool = False


class _Body(_Strict):
    model: Optional[str] = None
    max_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    temperature: Optional[Annotated[float, Field(ge=0.0, le=2.0)]] = None
    top_p: Optional[Annotated[float, Field(gt=0.0, le=1.0)]] = None
    seed: Optional[int] = None
    stop: Union[str, Annotated[List[str], Field(max_length=4)], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: Literal[1] = 1
    pruning: Union[str, Dict[str, Any], None] = None


class ChatRequest(_Body):
    messages: Annotated[List[Message], Field(min_length=1)]
    max_completion_tokens: Optional[Annotated[int, Field(ge=1)]] = None


class CompletionRequest(_Body):
    prompt: Union[Annotated[str, Field(min_length=1)], Annotated[List[int], Field(min_length=1)]]


# ---------------------------------------------------------------- pruning per request


def pruning_config(spec: Union[str, Dict[str, Any]], default: PruningConfig) -> PruningConfig:
    """The configuration a ``"pruning"`` value asks for (not yet checked against a model).

    A string is a method (its preset). An object holds :class:`PruningConfig` fields; with a
    ``"method"`` it overrides that preset, without one the server's ``default``. JSON
    arrays become tuples.

    Raises:
        APIError: 400 for an unknown preset, method or field, or a field of the wrong type.
    """
    if isinstance(spec, str):
        fields, method = {}, spec
    else:
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()}
        method = fields.pop("method", None)
        names = {f.name for f in dataclasses.fields(PruningConfig)}
        unknown = sorted(set(fields) - names)
        if unknown:
            raise APIError(400, f"unknown pruning field {unknown[0]!r}; fields are "
                                f"{', '.join(sorted(names))}", param=f"pruning.{unknown[0]}")
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


# ---------------------------------------------------------------- generation worker


class _Cancelled(Exception):
    """Raised from the prefill's progress callback when the client has gone."""


@dataclasses.dataclass
class Delta:
    """A piece of output text."""

    text: str


@dataclasses.dataclass
class Done:
    """The end of a generation."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    pruning: dict


@dataclasses.dataclass
class Job:
    """One validated request waiting for, or in, generation."""

    tokens: List[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: Optional[int]
    stop: List[str]
    config: PruningConfig
    per_request: bool  # the request set its own pruning
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)
    phase: str = "queued"
    layers_done: int = 0
    generated: int = 0

    def emit(self, item: Union[Delta, Done, BaseException]) -> None:
        """Hand ``item`` to the request's event loop (thread-safe)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop has closed (shutdown)
            self.cancel.set()


class StopText:
    """Cuts streamed text at the first of ``stops``, withholding a tail that may begin one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> Tuple[str, bool]:
        """Add ``text``; return the text that is safe to emit and whether a stop was hit."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        hold = max((k for s in self.stops for k in range(1, len(s))
                    if self.pending.endswith(s[:k])), default=0)
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out):]
        return out, False

    def flush(self) -> str:
        """The withheld text, at the end of the generation."""
        out, self.pending = self.pending, ""
        return out


class Worker:
    """Owns the model on one thread and generates one :class:`Job` at a time, in order.

    The model is loaded on that thread too (MLX work stays on the thread that created it,
    as in mlx-lm's server).
    """

    def __init__(self, model_path: Optional[str], max_queue: int) -> None:
        self.model_path, self.max_queue = model_path, max_queue
        self.model = self.tokenizer = None
        self.num_layers = 0
        self.vocab_size = 0
        self.context: Optional[int] = None
        self.current: Optional[Job] = None
        self.waiting = 0
        self.completed = self.cancelled = 0
        self.mean_seconds = 0.0
        self._jobs: "queue.Queue[Job]" = queue.Queue()
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._load_error: Optional[BaseException] = None
        threading.Thread(target=self._run, name="mlx-lazy-generation", daemon=True).start()

    def wait_ready(self) -> None:
        """Block until the model is loaded.

        Raises:
            UserInputError: the model cannot be loaded.
        """
        self._ready.wait()
        if isinstance(self._load_error, UserInputError):  # load() worded it already
            raise self._load_error
        if self._load_error is not None:
            what = "the default model" if self.model_path is None else f"model {self.model_path!r}"
            msg = " ".join(str(self._load_error).split())
            raise UserInputError(f"cannot load {what}: {msg}") from None

    def submit(self, job: Job) -> None:
        """Queue ``job``.

        Raises:
            APIError: 503 with ``Retry-After`` when ``max_queue`` requests already wait.
        """
        with self._lock:
            ahead = self.waiting + (self.current is not None)
            if ahead > self.max_queue:
                retry = max(1, math.ceil(self.mean_seconds * ahead))
                raise APIError(503, f"the server is busy ({self.waiting} requests queued); retry "
                                    f"in {retry} s", type="server_error", code="queue_full",
                               headers={"Retry-After": str(retry)})
            self.waiting += 1
        self._jobs.put(job)

    def status(self) -> dict:
        """What ``/health`` reports about the queue and the running generation."""
        job = self.current
        running = None if job is None else {
            "phase": job.phase, "layers_done": job.layers_done, "num_layers": self.num_layers,
            "prompt_tokens": len(job.tokens), "generated_tokens": job.generated,
            "method": job.config.method,
        }
        return {"queued": self.waiting, "generating": running, "completed": self.completed,
                "cancelled": self.cancelled}

    def _run(self) -> None:
        try:
            self.model, self.tokenizer = load(self.model_path)
            self.num_layers = len(self.model.layers)
            self.vocab_size = ModelAdapter(self.model).vocab_size
            self.context = context_length(self.model, self.tokenizer)
        except Exception as e:  # reported by wait_ready on the main thread
            self._load_error = e
            self._ready.set()
            return
        self._ready.set()
        while True:
            job = self._jobs.get()
            with self._lock:
                self.waiting -= 1
                self.current = job
            tic = time.perf_counter()
            finished = False
            try:
                finished = self._generate(job)
            finally:
                with self._lock:
                    self.current = None
                    self.completed += finished
                    self.cancelled += not finished
                    took = time.perf_counter() - tic
                    # a moving average of request durations, for Retry-After
                    self.mean_seconds = (0.8 * self.mean_seconds + 0.2 * took
                                         if self.mean_seconds else took)

    def _generate(self, job: Job) -> bool:
        """Run ``job``; True when it ran to its end (not cancelled, no error)."""
        if job.cancel.is_set():
            return False

        def progress(processed: int, total: int) -> None:  # prompt tokens, as mlx-lm counts
            job.layers_done = processed * self.num_layers // max(total, 1)
            if job.cancel.is_set():
                raise _Cancelled

        if job.seed is not None:
            mx.random.seed(job.seed)
        job.phase = "prefill"
        stop = StopText(job.stop)
        resp, finish = None, None
        try:
            with closing(stream_generate(
                self.model, self.tokenizer, job.tokens, max_tokens=job.max_tokens,
                sampler=make_sampler(job.temperature, job.top_p), config=job.config,
                prompt_progress_callback=progress,
            )) as responses:
                for resp in responses:
                    if job.cancel.is_set():
                        return False
                    job.phase, job.generated = "decode", resp.generation_tokens
                    text, hit = stop.feed(resp.text)
                    if text:
                        job.emit(Delta(text))
                    finish = "stop" if hit else resp.finish_reason
                    if finish:
                        break
            tail = stop.flush()  # empty after a stop string; after EOS, the held-back text
            if tail:
                job.emit(Delta(tail))
            s = resp.stats
            job.emit(Done(finish, resp.prompt_tokens, resp.generation_tokens, {
                "method": s.method, "ttft_s": s.ttft_s,
                "schedule_source": "request" if job.per_request else s.schedule["source"],
                "prompt_tokens_computed_pct": s.prompt_tokens_computed_pct,
                "kv_bytes": s.kv_bytes, "revivals": s.revivals,
            }))
            return True
        except _Cancelled:
            return False
        except Exception as e:  # an internal error: logged, and the request gets a 500
            log.error("generation failed:\n%s", traceback.format_exc())
            job.emit(e)
            return False
        finally:
            mx.clear_cache()


# ---------------------------------------------------------------- the HTTP application


class BodyLimit:
    """ASGI middleware: a POST body over ``limit`` bytes is answered 413 before any parsing."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        too_large = APIError(413, f"the request body exceeds {self.limit} bytes",
                             code="request_too_large")
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.limit:
            return await too_large.response()(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:  # a chunked body has no Content-Length: count as it arrives
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await too_large.response()(scope, receive, send)
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


@dataclasses.dataclass
class ServerSettings:
    """What the command line sets: the model, defaults for requests, limits, the API key."""

    model: Optional[str] = None
    config: PruningConfig = dataclasses.field(default_factory=PruningConfig)
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    max_prompt_tokens: Optional[int] = None
    max_queue: int = DEFAULT_MAX_QUEUE
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_key: Optional[str] = None


def create_app(settings: ServerSettings, worker: Worker) -> FastAPI:
    """The FastAPI application serving ``worker``'s (loaded) model with ``settings``."""
    app = FastAPI(title="mlx-lazy", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    model_id = settings.model or "default_model"
    created = int(time.time())
    tokenizer = worker.tokenizer
    # A prompt must leave room for one new token in the model's context.
    limits = [n for n in (settings.max_prompt_tokens, worker.context and worker.context - 1) if n]
    prompt_limit = min(limits) if limits else None
    bearer = HTTPBearer(auto_error=False)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.error("internal error:\n%s", "".join(traceback.format_exception(exc)))
        return APIError(500, "internal server error", type="server_error").response()

    def authorize(credentials: Optional[HTTPAuthorizationCredentials] = Depends(bearer)) -> None:
        if settings.api_key is None:
            return
        given = b"" if credentials is None else credentials.credentials.encode()
        if not hmac.compare_digest(given, settings.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    def make_job(body: _Body, tokens: List[int], max_tokens: Optional[int]) -> Job:
        per_request = body.pruning is not None
        config = pruning_config(body.pruning, settings.config) if per_request else settings.config
        n = len(tokens)
        try:
            check_anchors(config.resolve(worker.num_layers), n)
        except ValueError as e:
            raise APIError(400, f"pruning: {e}", param="pruning") from None
        if prompt_limit is not None and n > prompt_limit:
            raise APIError(413, f"the prompt has {n} tokens; this server accepts at most "
                                f"{prompt_limit}", param="messages" if isinstance(body, ChatRequest)
                           else "prompt", code="context_length_exceeded")
        if max_tokens is None:  # the server's default, shortened to fit the context
            room = settings.max_tokens if worker.context is None else worker.context - n
            max_tokens = max(1, min(settings.max_tokens, room))
        try:
            check_context(n, max_tokens, worker.context)
        except ValueError as e:
            raise APIError(400, str(e), param="max_tokens", code="context_length_exceeded") from None
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        return Job(tokens=tokens, max_tokens=max_tokens,
                   temperature=settings.temperature if body.temperature is None else body.temperature,
                   top_p=settings.top_p if body.top_p is None else body.top_p,
                   seed=body.seed, stop=stop, config=config, per_request=per_request,
                   loop=asyncio.get_running_loop())

    async def events(job: Job, request: Optional[Request]) -> AsyncIterator[Union[Delta, Done]]:
        """The job's output; setting ``job.cancel`` when the consumer stops early. With
        ``request``, polls for a disconnected client (a stream's response does that itself)."""
        try:
            while True:
                if request is None:
                    item = await job.events.get()
                else:
                    try:
                        item = await asyncio.wait_for(job.events.get(), timeout=0.5)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            return
                        continue
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, Done):
                    return
        finally:
            job.cancel.set()  # no effect once finished

    def usage(done: Done) -> dict:
        return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
                "total_tokens": done.prompt_tokens + done.completion_tokens,
                "pruning": done.pruning}

    async def respond(body: _Body, tokens: List[int], request: Request, chat: bool,
                      max_tokens: Optional[int]):
        job = make_job(body, tokens, max_tokens)
        worker.submit(job)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        obj = "chat.completion" if chat else "text_completion"
        head = {"id": rid, "object": obj, "created": int(time.time()), "model": model_id}

        if not body.stream:
            text, done = "", None
            try:
                async for item in events(job, request):
                    if isinstance(item, Delta):
                        text += item.text
                    else:
                        done = item
            except Exception:
                raise APIError(500, "generation failed (see the server log)", type="server_error")
            if done is None:  # the client went away
                return JSONResponse({}, status_code=499)
            out = ({"message": {"role": "assistant", "content": text}} if chat
                   else {"text": text})
            choice = {"index": 0, **out, "logprobs": None, "finish_reason": done.finish_reason}
            return {**head, "choices": [choice], "usage": usage(done)}

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
                async for item in events(job, None):
                    if isinstance(item, Delta):
                        yield chunk(item.text, None, first)
                        first = False
                        continue
                    yield chunk(None, item.finish_reason, first)
                    if include_usage:
                        yield json.dumps({**head, "object": "chat.completion.chunk" if chat
                                          else obj, "choices": [], "usage": usage(item)})
            except Exception:
                yield json.dumps(APIError(500, "generation failed (see the server log)",
                                          type="server_error").body())
            yield "[DONE]"

        return EventSourceResponse(sse(), ping=SSE_PING_S, sep="\n")

    def chat_tokens(messages: List[Message]) -> List[int]:
        plain = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                  else "".join(p.text for p in m.content or [])} for m in messages]
        if not getattr(tokenizer, "has_chat_template", False):  # the contents, one per line
            return _encode(tokenizer, "\n".join(m["content"] for m in plain))
        try:
            text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
        except TemplateError as e:  # e.g. "roles must alternate user/assistant"
            raise APIError(400, f"the model's chat template rejects these messages: {e}",
                           param="messages") from None
        return list(tokenizer.encode(text, add_special_tokens=False))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": model_id, **worker.status()}

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict:
        return {"object": "list", "data": [
            {"id": model_id, "object": "model", "created": created, "owned_by": "mlx-lazy"}]}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(body: ChatRequest, request: Request):
        tokens = await run_in_threadpool(chat_tokens, body.messages)
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await respond(body, tokens, request, chat=True, max_tokens=max_tokens)

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest, request: Request):
        if isinstance(body.prompt, str):
            tokens = await run_in_threadpool(_encode, tokenizer, body.prompt)
        else:
            try:
                check_tokens(body.prompt, worker.vocab_size)
            except UserInputError as e:
                raise APIError(400, str(e), param="prompt") from None
            tokens = list(body.prompt)
        return await respond(body, tokens, request, chat=False, max_tokens=body.max_tokens)

    return app


# ---------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    """The server's argument parser."""
    p = OneLineParser(
        prog="mlx-lazy-server",
        description="OpenAI-compatible HTTP server with LazyLLM / SPEED pruning per request.")
    p.add_argument("--model", default=None,
                   help="local model folder or Hugging Face repo (default: SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--method", type=method_arg, default="full", metavar="METHOD",
                   help=f"{METHOD_HELP}; the default for requests without a 'pruning' field "
                        "(default: full)")
    p.add_argument("--schedule", default=None, metavar="FILE",
                   help="default pruning from a JSON file of PruningConfig fields "
                        "(overrides --method)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="default max_tokens of a request")
    p.add_argument("--temp", type=temperature_arg, default=0.0,
                   help="default sampling temperature")
    p.add_argument("--top-p", type=top_p_arg, default=1.0, help="default sampling top-p")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longer prompts are refused with HTTP 413 (default and upper bound: "
                        "what fits the model's context)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="requests that may wait behind the running one; more get HTTP 503 "
                        f"with Retry-After (default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get HTTP 413")
    p.add_argument("--api-key", default=os.environ.get("MLX_LAZY_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $MLX_LAZY_API_KEY; "
                        "none: no authentication)")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    return p


def is_loopback(host: str) -> bool:
    """True when ``host`` only accepts connections from this machine."""
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """Check the flags that need no model and turn them into :class:`ServerSettings`.

    Raises:
        UserInputError: a bad flag value or schedule file.
    """
    least = {"max_tokens": 1, "max_queue": 0, "max_body_bytes": 1, "max_prompt_tokens": 1}
    for name, low in least.items():
        value = getattr(args, name)
        if value is not None and value < low:
            raise UserInputError(f"--{name.replace('_', '-')} must be at least {low}, got {value}")
    if not 1 <= args.port <= 65535:
        raise UserInputError(f"--port must be in 1..65535, got {args.port}")
    if args.api_key is not None and not args.api_key:
        raise UserInputError("--api-key is empty")
    if args.schedule is not None:
        config = PruningConfig.from_file(args.schedule)
    else:
        config = PruningConfig.preset(args.method)
    return ServerSettings(
        model=args.model, config=config, max_tokens=args.max_tokens,
        temperature=args.temp, top_p=args.top_p, max_prompt_tokens=args.max_prompt_tokens,
        max_queue=args.max_queue, max_body_bytes=args.max_body_bytes, api_key=args.api_key)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the server until interrupted; return the exit status (2 for bad input)."""
    import uvicorn

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    try:
        settings = settings_from_args(args)
        worker = Worker(settings.model, settings.max_queue)
        worker.wait_ready()
        try:
            settings.config.check_model(ModelAdapter(worker.model).fingerprint())
            settings.config.resolve(worker.num_layers)
        except ValueError as e:
            flag = f"--schedule {args.schedule}" if args.schedule else f"--method {args.method}"
            raise UserInputError(f"{flag}: {e}") from None
    except UserInputError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if not is_loopback(args.host) and settings.api_key is None:
        print(f"warning: listening on {args.host} with no authentication: anyone who can reach "
              f"this port can use the model (set --api-key)", file=sys.stderr)
    app = create_app(settings, worker)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
