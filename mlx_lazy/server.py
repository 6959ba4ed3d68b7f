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
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import hmac
import ipaddress
import json
import logging
import math
import os
import queue
import socket
import sys
import threading
import time
import traceback
import uuid
from contextlib import closing
from typing import Annotated, Any, AsyncIterator, Dict, List, Literal, Optional, Sequence, Tuple, Union

import mlx.core as mx
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

from .adapter import ModelAdapter
from ._args import METHOD_HELP, OneLineParser, add_sampling_arguments, method_arg, sampler
from .api import (check_anchors, check_context, check_tokens, context_length, load, prompt_token_ids,
                  stream_generate)
from .errors import UserInputError, one_line
from .prefix_store import PromptCacheStore
from .prompt_cache import make_prompt_cache, resolve_config
from .config import PruningConfig
from .policies import compose
from .schedule import check_fits
from .schedule_files import read_schedule

log = logging.getLogger("mlx_lazy.server")

DEFAULT_PORT = 8080
DEFAULT_MAX_TOKENS = 512  # mlx-lm's server default
DEFAULT_MAX_QUEUE = 8
DEFAULT_MAX_BODY_BYTES = 8 * 2**20
DEFAULT_READ_TIMEOUT_S = 30.0
# A job with no prefill layer or decode step done for this long is reported stuck. The slowest
# step here, a layer of an 8K-token prefill on a CPU, takes seconds.
DEFAULT_STALL_TIMEOUT_S = 300.0
DEFAULT_PROMPT_CACHE_SIZE = 10  # mlx-lm's server default
# KV and Aux Cache bytes kept between requests: room on a 16 GB Mac beside a few-GB model.
DEFAULT_PROMPT_CACHE_BYTES = 2 * 2**30
SSE_PING_S = 15  # a comment line keeps proxies from closing a stream during a long prefill
MAX_ERROR_CHARS = 1000  # an error message is cut here: it never echoes a huge field back
_LOOPBACK_NAMES = ("localhost",)


# ---------------------------------------------------------------- errors


class APIError(Exception):
    """An HTTP error answered with an OpenAI-style error object."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, type: str = "invalid_request_error",
                 headers: Optional[Dict[str, str]] = None) -> None:
        message = one_line(Exception(message), MAX_ERROR_CHARS)
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


# ---------------------------------------------------------------- bounds on request fields


class Bounds:
    """Every request field whose cost grows with its size, and its bound: no body within
    them costs more than a bounded amount of time or memory before it is refused.

    Cost model, per request, n being the body's bytes:

    * the body: read, parsed and validated in O(n); ``max_body_bytes`` (413) is checked on
      the bytes as they arrive, before any parsing. Fields the server ignores (``logit_bias``,
      ``tools``, ...) cost their parse only, within that bound.
    * a prompt's text: tokenizing is O(bytes) and the slowest step a body can ask for (about
      2 s per MB on a CPU), so a text too long to fit ``prompt_tokens`` is refused (413)
      before the tokenizer runs: a token stands for at most ``token_bytes`` bytes of text
      (:func:`token_bytes`), so more than ``prompt_tokens * token_bytes`` bytes cannot fit.
    * token ids: checked against the vocabulary in O(ids); more than ``prompt_tokens`` is 413.
    * ``messages``: the chat template renders O(messages + bytes); at most
      :data:`MAX_MESSAGES` (OpenAI's own limit), their text as a prompt's text above.
    * ``stop``: the check is linear in the generated text for each stop string
      (:class:`StopText`), its set-up linear in their length, and a stream withholds at most
      the longest one less a character: at most :data:`MAX_STOPS` of :data:`MAX_STOP_CHARS`.
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
    pruning: Union[Text, Dict[Text, Any], None] = None


class ChatRequest(_Body):
    messages: Annotated[List[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Optional[Annotated[int, Field(ge=1)]] = None


class CompletionRequest(_Body):
    prompt: Union[Annotated[Text, Field(min_length=1)], Annotated[List[int], Field(min_length=1)]]


# ---------------------------------------------------------------- pruning per request


INTERNAL_FIELDS = ("source", "fingerprint")  # PruningConfig fields set by schedule files only


def pruning_config(spec: Union[str, Dict[str, Any]], default: PruningConfig) -> PruningConfig:
    """The configuration a ``"pruning"`` value asks for (not yet checked against a model).

    A string is a method (its preset). An object holds :class:`PruningConfig` fields other
    than :data:`INTERNAL_FIELDS`; with a ``"method"`` it overrides that preset, without one
    the server's ``default``. JSON arrays become tuples.

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


_GONE = object()  # put on a job's events when its client has disconnected


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
    cached_tokens: int
    pruning: dict


@dataclasses.dataclass
class Job:
    """One validated request waiting for, or in, generation."""

    id: str  # the response's id, also named in the log and in a 500's message
    tokens: List[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: Optional[int]
    stop: List[str]
    config: PruningConfig
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)
    phase: str = "queued"
    layers_done: int = 0
    generated: int = 0

    def emit(self, item: Union[Delta, Done, APIError]) -> None:
        """Hand ``item`` to the request's event loop (thread-safe)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop has closed (shutdown)
            self.cancel.set()

    def fail(self) -> None:
        """End the request with a 500 that names it (the log has the traceback)."""
        self.emit(APIError(500, f"generation failed (request {self.id}; see the server log)",
                           type="server_error", code="generation_failed"))


class StopText:
    """Cuts streamed text at the first of ``stops``, withholding a tail that may begin one.

    Each stop string is matched by a Knuth-Morris-Pratt automaton fed one character at a
    time, whose state is the longest tail of the text so far that begins that stop: a
    :meth:`feed` costs time linear in its text (amortized), whatever the stops' lengths,
    and the text withheld is never longer than the longest stop.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)
        self.pending = ""

    def feed(self, text: str) -> Tuple[str, bool]:
        """Add ``text``; return the text that is safe to emit and whether a stop was hit."""
        start = len(self.pending)
        self.pending += text
        first = None  # where the earliest stop found begins, in pending
        for i, (stop, fail) in enumerate(zip(self.stops, self._fail)):
            k = self._state[i]
            for j, c in enumerate(text, start):
                while k and stop[k] != c:
                    k = fail[k - 1]
                if stop[k] == c:
                    k += 1
                if k == len(stop):
                    where = j + 1 - k
                    first = where if first is None else min(first, where)
                    break
            self._state[i] = k
        if first is not None:
            out, self.pending = self.pending[:first], ""
            return out, True
        hold = max(self._state, default=0)
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out):]
        return out, False

    def flush(self) -> str:
        """The withheld text, at the end of the generation."""
        out, self.pending = self.pending, ""
        return out


def _failure(s: str) -> List[int]:
    """KMP's failure function: ``f[i]`` is the length of the longest proper prefix of
    ``s[: i + 1]`` that is also its suffix."""
    f, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return f


class Worker:
    """Owns the model on one thread and generates one :class:`Job` at a time, in order.

    The model is loaded on that thread too (MLX work stays on the thread that created it,
    as in mlx-lm's server). With a ``store``, each request starts from a copy of the stored
    prompt cache sharing the longest prefix with it and its cache is kept afterwards where the
    store's rule shares it (:meth:`PromptCacheStore.keeps`); with
    ``idle_complete``, while no request waits the most recent cache's pruned tokens are
    carried through their remaining layers (a new request stops that between layers), so the
    next turn of that conversation needs no revivals. The thread is supervised: an exception in a job fails that job
    and the thread goes on to the next; should the thread itself end, the running and
    waiting jobs fail and later ones are refused (``/health`` says ``"dead"``).
    """

    def __init__(self, model_path: Optional[str], max_queue: int,
                 store: Optional[PromptCacheStore] = None, idle_complete: bool = False) -> None:
        self.model_path, self.max_queue = model_path, max_queue
        self.store, self.idle_complete = store, idle_complete
        self.model = self.tokenizer = None
        self.num_layers = 0
        self.vocab_size = 0
        self.context: Optional[int] = None
        self.current: Optional[Job] = None
        self.waiting = 0
        self.completed = self.cancelled = self.failed = 0
        self.mean_seconds = 0.0
        self.last_progress = time.monotonic()  # of the running job: a step, a prefill layer
        self._jobs: "queue.Queue[Job]" = queue.Queue()
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._load_error: Optional[BaseException] = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="mlx-lazy-generation", daemon=True)
        self._thread.start()

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

    @property
    def alive(self) -> bool:
        """Whether the generation thread is running and taking jobs."""
        return self._thread.is_alive() and not self._stopped

    def submit(self, job: Job) -> None:
        """Queue ``job``.

        Raises:
            APIError: 503, with ``Retry-After`` when ``max_queue`` requests already wait, or
                when the generation thread has ended.
        """
        with self._lock:
            if not self.alive:
                raise APIError(503, "the generation worker has stopped (see the server log); "
                                    "the server must be restarted", type="server_error",
                               code="worker_dead")
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
            "id": job.id, "phase": job.phase, "layers_done": job.layers_done,
            "num_layers": self.num_layers, "prompt_tokens": len(job.tokens),
            "generated_tokens": job.generated, "method": job.config.method,
            "seconds_since_progress": round(time.monotonic() - self.last_progress, 3),
        }
        cached = None if self.store is None else {"entries": len(self.store),
                                                  "bytes": self.store.nbytes}
        return {"queued": self.waiting, "generating": running, "completed": self.completed,
                "cancelled": self.cancelled, "failed": self.failed, "prompt_cache": cached}

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
        try:
            while True:
                self._supervise(self._jobs.get())
                if self.idle_complete and self.store is not None and self._jobs.empty():
                    self._complete_recent()
        except BaseException:  # SystemExit, KeyboardInterrupt or a bug here: fail what is left
            log.critical("the generation worker stopped:\n%s", traceback.format_exc())
            with self._lock:
                self._stopped = True
                left = [self.current] if self.current is not None else []
                while not self._jobs.empty():
                    left.append(self._jobs.get_nowait())
            for job in left:
                job.fail()

    def _supervise(self, job: Job) -> None:
        """Run ``job``, turning any exception into that job's failure, and count it."""
        with self._lock:
            self.waiting -= 1
            self.current = job
            self.last_progress = time.monotonic()
        tic = time.perf_counter()
        outcome = "cancelled"
        try:
            if self._generate(job):
                outcome = "completed"
        except UserInputError as e:  # the library refused what validation let through: a 400
            log.warning("request %s refused: %s", job.id, one_line(e))
            job.emit(APIError(400, one_line(e)))
            outcome = "failed"
        except Exception:  # an internal error: logged with the request's id, the request gets a 500
            log.error("request %s failed:\n%s", job.id, traceback.format_exc())
            job.fail()
            outcome = "failed"
        finally:
            mx.clear_cache()
        with self._lock:
            self.current = None
            setattr(self, outcome, getattr(self, outcome) + 1)
            took = time.perf_counter() - tic
            # a moving average of request durations, for Retry-After
            self.mean_seconds = 0.8 * self.mean_seconds + 0.2 * took if self.mean_seconds else took

    def _complete_recent(self) -> None:
        """Complete the most recent stored cache until a request arrives: a copy of it, kept
        in its place only when the store's byte bound holds the copy (completing grows the
        KV; the stored cache itself is never written, so the bound holds at every moment)."""
        cache = self.store.most_recent()
        if cache is None or not cache.engine.pending_token_layers:
            return
        try:
            done = cache.copy()
            done.engine.complete(should_stop=lambda: not self._jobs.empty())
        except Exception:  # a bug here must not stop the worker: log it, drop nothing
            log.error("completing a cached prompt failed:\n%s", traceback.format_exc())
            return
        self.store.checkin(done)

    def _generate(self, job: Job) -> bool:
        """Run ``job``; True when it ran to its end, False when it was cancelled."""
        if job.cancel.is_set():
            return False

        def progress(processed: int, total: int) -> None:  # prompt tokens, as mlx-lm counts
            self.last_progress = time.monotonic()
            job.layers_done = processed * self.num_layers // max(total, 1)
            if job.cancel.is_set():
                raise _Cancelled

        if job.seed is not None:
            mx.random.seed(job.seed)
        job.phase = "prefill"
        stop = StopText(job.stop)
        resp, finish = None, None
        schedule = resolve_config(self.model, job.config)
        if self.store is None:
            cache = make_prompt_cache(self.model, schedule)
        else:  # a private copy: a failed or cancelled request leaves the stored one intact
            cache = self.store.checkout(self.model, schedule, job.tokens)
        try:
            with closing(stream_generate(
                self.model, self.tokenizer, job.tokens[len(cache):], max_tokens=job.max_tokens,
                sampler=sampler(job.temperature, job.top_p), prompt_cache=cache,
                prompt_progress_callback=progress,
            )) as responses:
                for resp in responses:
                    self.last_progress = time.monotonic()
                    if job.cancel.is_set():
                        return False
                    job.phase, job.generated = "decode", resp.generation_tokens
                    text, hit = stop.feed(resp.text)
                    if text:
                        job.emit(Delta(text))
                    finish = "stop" if hit else resp.finish_reason
                    if finish:
                        break
        except _Cancelled:
            return False
        tail = stop.flush()  # empty after a stop string; after EOS, the held-back text
        if tail:
            job.emit(Delta(tail))
        if self.store is not None:
            self.store.checkin(cache)
        s = resp.stats
        job.emit(Done(finish, s.prompt_tokens, resp.generation_tokens, s.cached_tokens, {
            "method": s.method, "ttft_s": s.ttft_s, "schedule_source": s.schedule["source"],
            "prompt_tokens_computed_pct": s.prompt_tokens_computed_pct,
            "kv_bytes": s.kv_bytes, "aux_bytes": s.aux_bytes, "revivals": s.revivals,
            "completed_token_layers": s.completed_token_layers,
            "prefill_token_layers": sum(s.prefill_tokens_per_layer),
        }))
        return True


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
            return await too_large.response()(scope, receive, send)
        chunks, size, more = [], 0, True
        deadline = asyncio.get_running_loop().time() + self.timeout
        while more:  # a chunked body has no Content-Length: count as it arrives
            left = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), timeout=max(left, 0))
            except asyncio.TimeoutError:
                slow = APIError(408, f"the request body did not arrive within {self.timeout:g} s",
                                code="request_timeout", headers={"Connection": "close"})
                return await slow.response()(scope, receive, send)
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
            return await refused.response()(scope, receive, send)
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


@dataclasses.dataclass
class ServerSettings:
    """What the command line sets: the model, defaults for requests, limits, the API key.

    ``max_prompt_tokens`` None: what fits the model's context (one token left for the answer).
    """

    model: Optional[str] = None
    config: PruningConfig = dataclasses.field(default_factory=PruningConfig)
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    max_prompt_tokens: Optional[int] = None
    max_queue: int = DEFAULT_MAX_QUEUE
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_key: Optional[str] = None
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    prompt_cache_size: int = DEFAULT_PROMPT_CACHE_SIZE
    prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES
    share_pruned_caches: bool = False
    idle_complete: bool = True


def create_app(settings: ServerSettings, worker: Worker) -> FastAPI:
    """The FastAPI application serving ``worker``'s (loaded) model with ``settings``."""
    app = FastAPI(title="mlx-lazy", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes, timeout=settings.read_timeout_s)
    if settings.api_key is not None:  # added last, so it runs first
        app.add_middleware(ApiKey, key=settings.api_key)
    model_id = settings.model or "default_model"
    created = int(time.time())
    tokenizer = worker.tokenizer
    bounds = Bounds(settings.max_prompt_tokens or (worker.context and worker.context - 1),
                    token_bytes(tokenizer))

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
        rid = "req-" + uuid.uuid4().hex
        log.error("request %s failed:\n%s", rid, "".join(traceback.format_exception(exc)))
        return APIError(500, f"internal server error (request {rid}; see the server log)",
                        type="server_error").response()

    def make_job(rid: str, body: _Body, tokens: List[int], max_tokens: Optional[int]) -> Job:
        config = (settings.config if body.pruning is None
                  else pruning_config(body.pruning, settings.config))
        n = len(tokens)
        try:
            schedule = config.resolve(worker.num_layers)
            check_anchors(schedule, n)
            check_fits(schedule, worker.context)  # before the worker: 400, not its 500
        except ValueError as e:
            raise APIError(400, f"pruning: {e}", param="pruning") from None
        bounds.check_tokens(n, "messages" if isinstance(body, ChatRequest) else "prompt")
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
                   temperature=settings.temperature if body.temperature is None else body.temperature,
                   top_p=settings.top_p if body.top_p is None else body.top_p,
                   seed=body.seed, stop=stop, config=config, loop=asyncio.get_running_loop())

    async def events(job: Job) -> AsyncIterator[Union[Delta, Done]]:
        """The job's output, ending early at a :data:`_GONE`; setting ``job.cancel`` when the
        consumer stops early."""
        try:
            while True:
                item = await job.events.get()
                if item is _GONE:
                    return
                if isinstance(item, APIError):
                    raise item
                yield item
                if isinstance(item, Done):
                    return
        finally:
            job.cancel.set()  # no effect once finished

    async def watch(job: Job, request: Request) -> None:
        """Cancel ``job`` the moment its client disconnects (a response that writes nothing
        until the end learns it only from the connection); a stream's response does that
        itself."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancel.set()
        job.events.put_nowait(_GONE)

    def usage(done: Done) -> dict:
        return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
                "total_tokens": done.prompt_tokens + done.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
                "pruning": done.pruning}

    async def respond(body: _Body, tokens: List[int], request: Request, chat: bool,
                      max_tokens: Optional[int]):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        job = make_job(rid, body, tokens, max_tokens)
        worker.submit(job)
        obj = "chat.completion" if chat else "text_completion"
        head = {"id": rid, "object": obj, "created": int(time.time()), "model": model_id}

        if not body.stream:
            text, done = "", None
            watcher = asyncio.create_task(watch(job, request))
            try:
                async for item in events(job):  # a failed job raises its APIError
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
                async for item in events(job):
                    if isinstance(item, Delta):
                        yield chunk(item.text, None, first)
                        first = False
                        continue
                    yield chunk(None, item.finish_reason, first)
                    if include_usage:
                        yield json.dumps({**head, "object": "chat.completion.chunk" if chat
                                          else obj, "choices": [], "usage": usage(item)})
            except APIError as e:  # the job failed
                yield json.dumps(e.body())
            yield "[DONE]"

        return EventSourceResponse(sse(), ping=SSE_PING_S, sep="\n")

    def chat_tokens(messages: List[Message]) -> List[int]:
        plain = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                  else "".join(p.text for p in m.content or [])} for m in messages]
        if not getattr(tokenizer, "has_chat_template", False):  # the contents, one per line
            return prompt_token_ids(tokenizer, "\n".join(m["content"] for m in plain))
        try:
            text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
        except TemplateError as e:  # e.g. "roles must alternate user/assistant"
            raise APIError(400, f"the model's chat template rejects these messages: {e}",
                           param="messages") from None
        return list(tokenizer.encode(text, add_special_tokens=False))

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 with ``"status": "ok"``; 503 with ``"dead"`` when the generation thread has
        ended, ``"stuck"`` when its job has made no progress for ``stall_timeout_s``."""
        status = worker.status()
        stalled = (status["generating"] is not None and
                   status["generating"]["seconds_since_progress"] > settings.stall_timeout_s)
        state = "dead" if not worker.alive else "stuck" if stalled else "ok"
        return JSONResponse({"status": state, "model": model_id, **status},
                            status_code=200 if state == "ok" else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [
            {"id": model_id, "object": "model", "created": created, "owned_by": "mlx-lazy"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        bounds.check_text(sum(len(m.content.encode()) if isinstance(m.content, str)
                              else sum(len(p.text.encode()) for p in m.content)
                              for m in body.messages), "messages")
        tokens = await run_in_threadpool(chat_tokens, body.messages)
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await respond(body, tokens, request, chat=True, max_tokens=max_tokens)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if isinstance(body.prompt, str):
            bounds.check_text(len(body.prompt.encode()), "prompt")
            tokens = await run_in_threadpool(prompt_token_ids, tokenizer, body.prompt)
        else:
            bounds.check_tokens(len(body.prompt), "prompt")
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
                   help="default pruning from a calibrated schedule file (as mlx-lazy-calibrate "
                        "and mlx_lazy.write_schedule write them; overrides --method)")
    add_sampling_arguments(p, DEFAULT_MAX_TOKENS, "a request's default ")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longer prompts are refused with HTTP 413 (default and upper bound: "
                        "the model's context less one token)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="requests that may wait behind the running one; more get HTTP 503 "
                        f"with Retry-After (default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get HTTP 413")
    p.add_argument("--read-timeout", type=float, default=DEFAULT_READ_TIMEOUT_S, metavar="SECONDS",
                   help="a request's headers, and then its body, must each arrive within this "
                        "time: slow headers close the connection, a slow body gets HTTP 408 "
                        f"(default {DEFAULT_READ_TIMEOUT_S:g})")
    p.add_argument("--stall-timeout", type=float, default=DEFAULT_STALL_TIMEOUT_S,
                   metavar="SECONDS",
                   help="/health answers 503 'stuck' when a generation has made no progress "
                        f"(a prefill layer, a token) for this long (default {DEFAULT_STALL_TIMEOUT_S:g})")
    p.add_argument("--prompt-cache-size", type=int, default=DEFAULT_PROMPT_CACHE_SIZE,
                   metavar="N", help="prompt caches kept between requests, as mlx-lm's server "
                                     f"(0: none; default {DEFAULT_PROMPT_CACHE_SIZE})")
    p.add_argument("--prompt-cache-bytes", type=int, default=DEFAULT_PROMPT_CACHE_BYTES,
                   metavar="BYTES", help="most bytes of KV and Aux Cache those caches hold "
                                         f"(default {DEFAULT_PROMPT_CACHE_BYTES})")
    p.add_argument("--share-pruned-caches", action="store_true",
                   help="also keep the prompt caches of pruning methods for later requests: "
                        "follow-up turns skip their prefix, but an answer may then depend on "
                        "the requests before it (by default only caches that prune nothing "
                        "are kept, and no answer does)")
    p.add_argument("--no-idle-complete", dest="idle_complete", action="store_false",
                   help="with --share-pruned-caches: do not carry the last conversation's "
                        "pruned tokens through their remaining layers while the server is idle")
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


def check_api_key(key: str) -> None:
    """Refuse an API key that no client can send: an HTTP header carries it, so it must be
    printable ASCII without spaces (a non-ASCII key once started a server that refused
    every client).

    Raises:
        UserInputError: naming the first character that cannot be sent.
    """
    if not key:
        raise UserInputError("--api-key (or $MLX_LAZY_API_KEY) is empty")
    bad = next((i for i, c in enumerate(key) if not "!" <= c <= "~"), None)
    if bad is not None:
        raise UserInputError(f"--api-key (or $MLX_LAZY_API_KEY) must be printable ASCII without "
                             f"spaces, as an HTTP header carries it; character {bad} is "
                             f"U+{ord(key[bad]):04X}")


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """Check the flags that need no model and turn them into :class:`ServerSettings`.

    Raises:
        UserInputError: a bad flag value or schedule file.
    """
    least = {"max_tokens": 1, "max_queue": 0, "max_body_bytes": 1, "max_prompt_tokens": 1,
             "prompt_cache_size": 0, "prompt_cache_bytes": 0}
    for name, low in least.items():
        value = getattr(args, name)
        if value is not None and value < low:
            raise UserInputError(f"--{name.replace('_', '-')} must be at least {low}, got {value}")
    if not 1 <= args.port <= 65535:
        raise UserInputError(f"--port must be in 1..65535, got {args.port}")
    if args.api_key is not None:
        check_api_key(args.api_key)
    for name in ("read_timeout", "stall_timeout"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise UserInputError(f"--{name.replace('_', '-')} must be a positive number of "
                                 f"seconds, got {value}")
    if args.schedule is not None:
        config = read_schedule(args.schedule)
    else:
        config = PruningConfig.preset(args.method)
    return ServerSettings(
        model=args.model, config=config, max_tokens=args.max_tokens,
        temperature=args.temp, top_p=args.top_p, max_prompt_tokens=args.max_prompt_tokens,
        max_queue=args.max_queue, max_body_bytes=args.max_body_bytes, api_key=args.api_key,
        read_timeout_s=args.read_timeout, stall_timeout_s=args.stall_timeout,
        prompt_cache_size=args.prompt_cache_size, prompt_cache_bytes=args.prompt_cache_bytes,
        share_pruned_caches=args.share_pruned_caches, idle_complete=args.idle_complete)


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
            settings.config.check_model(ModelAdapter(worker.model).fingerprint())
            check_fits(settings.config.resolve(worker.num_layers), context)
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
