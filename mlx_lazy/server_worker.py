"""The server's generation worker: one thread owns the model and runs one :class:`Job` at a
time, in order; the HTTP side (:mod:`mlx_lazy.server`) only validates requests into jobs and
hands their events (:class:`Delta`, :class:`Call`, :class:`Done`, :class:`APIError`) to the
clients.

Nothing here needs the ``[server]`` extra.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import queue
import threading
import time
import traceback
from contextlib import closing
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from ._args import sampler
from .adapter import ModelAdapter, recurrent_layers
from .api import context_length, load, stream_generate
from .errors import UserInputError, one_line
from .prefix_store import PromptCacheStore
from .prompt_cache import make_prompt_cache
from .schedule import Schedule
from .server_logprobs import (Aligner, LogprobSampler, TokenLogprob, TokenTexts,
                              token_logprob)
from .server_tools import CallSplitter, Piece

log = logging.getLogger("mlx_lazy.server")

MAX_ERROR_CHARS = 1000  # an error message is cut here: it never echoes a huge field back
MAX_PARAM_CHARS = 200  # and the name of the field it is about here


class APIError(Exception):
    """An HTTP error answered with an OpenAI-style error object."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, type: str = "invalid_request_error",
                 headers: Optional[Dict[str, str]] = None) -> None:
        message = one_line(Exception(message), MAX_ERROR_CHARS)
        if param is not None and len(param) > MAX_PARAM_CHARS:  # a path through huge keys
            param = param[: MAX_PARAM_CHARS - 1] + "…"
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type, self.headers = type, headers

    def body(self) -> dict:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class _Cancelled(Exception):
    """Raised from the prefill's progress callback when the client has gone."""


GONE = object()  # put on a job's events when its client has disconnected


@dataclasses.dataclass
class Delta:
    """A piece of output text; with ``logprobs`` asked, the tokens whose text ends in it
    (:class:`~mlx_lazy.server_logprobs.Aligner`; a piece may be empty and hold tokens)."""

    text: str
    logprobs: Sequence[TokenLogprob] = ()


@dataclasses.dataclass
class Call:
    """The text of a tool call, between the tokenizer's markers (not yet parsed), and its
    tokens (with ``logprobs`` asked)."""

    text: str
    logprobs: Sequence[TokenLogprob] = ()


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
    schedule: Schedule  # resolved once, by the HTTP side (mlx_lazy.resolve.resolve_config)
    loop: asyncio.AbstractEventLoop
    logit_bias: Dict[int, float] = dataclasses.field(default_factory=dict)  # token id -> bias
    top_k: int = 0  # 0: off (or at least the vocabulary)
    min_p: float = 0.0
    repetition_penalty: Optional[float] = None  # over the last 20 tokens, as mlx-lm's
    continues: bool = False  # the text continues the prompt's (/v1/completions), space and all
    # tool calls offered: the tokenizer's (tool_call_start, tool_call_end), else None
    tool_markers: Optional[Tuple[str, str]] = None
    # log probabilities asked: the alternatives each token shows (0: the token's own only);
    # None: not asked (nothing is computed)
    logprobs: Optional[int] = None
    events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)
    phase: str = "queued"
    layers_done: int = 0
    generated: int = 0
    # Under the worker's lock: the worker took the job, or its client left while it waited.
    taken: bool = False
    withdrawn: bool = False

    def emit(self, item: Union[Delta, Call, Done, APIError]) -> None:
        """Hand ``item`` to the request's event loop (thread-safe)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop has closed (shutdown)
            self.cancel.set()

    def failure(self) -> APIError:
        """The 500 that ends a failed request, naming it (the log has the traceback)."""
        return APIError(500, f"generation failed (request {self.id}; see the server log)",
                        type="server_error", code="generation_failed")


def dropped_space(tokenizer: Any, context: List[int], generated: List[int], text: str) -> str:
    """``" "`` when the streaming detokenizer dropped the space that the ``generated`` tokens'
    text begins with after ``context`` (mlx-lm's trims it from a response's first token:
    right for an answer, wrong for a continuation, where "capital of" + "the" loses the
    space), else ``""``. ``text``: the detokenizer's first text of them."""
    before = tokenizer.decode(context)
    after = tokenizer.decode(context + generated)
    if not after.startswith(before):
        return ""
    truth = after[len(before):]
    return " " if truth[1:].startswith(text) and truth[:1] == " " \
        and not truth.startswith(text) else ""


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

    def cut(self) -> str:
        """The withheld text, the matching started afresh: at a tool call, which no stop
        string is matched across."""
        self._state = [0] * len(self.stops)
        return self.flush()


def _emit(job: Job, stop: StopText, pieces: List[Piece],
          spans: Optional[Sequence[Tuple[int, int]]] = None,
          aligner: Optional[Aligner] = None) -> bool:
    """Emit generated ``pieces`` (:class:`~mlx_lazy.server_tools.CallSplitter`'s): text
    through the stop check, a call (and a call's raw text) whole, never cut by a stop string
    nor part of one; True when a stop string was hit (the pieces after it are dropped).

    With an ``aligner`` (log probabilities asked), ``spans`` are the pieces' places in its
    text, counted back from its end (:attr:`~mlx_lazy.server_tools.CallSplitter.spans`):
    each event carries the tokens whose text ends in it, a stop string's the tokens any of
    whose text is before it (the rest are dropped)."""
    for n, (kind, text) in enumerate(pieces):
        start, end = (0, 0) if aligner is None else (aligner.fed - spans[n][0],
                                                     aligner.fed - spans[n][1])
        if kind == "text":
            held = len(stop.pending)  # the text fed before this piece and not yet emitted
            out, hit = stop.feed(text)
            tokens = () if aligner is None else aligner.upto(start - held + len(out), hit)
            if out or tokens:
                job.emit(Delta(out, tokens))
            if hit:
                if aligner is not None:
                    aligner.drop()
                return True
            continue
        tail = stop.cut()
        tokens = () if aligner is None else aligner.upto(start)
        if tail or tokens:
            job.emit(Delta(tail, tokens))
        tokens = () if aligner is None else aligner.upto(end)
        job.emit(Call(text, tokens) if kind == "call" else Delta(text, tokens))
    return False


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
    next turn of that conversation needs no revivals. The thread is supervised: an exception
    in a job fails that job and the thread goes on to the next; should the thread itself end,
    the running and waiting jobs fail and later ones are refused (``/health`` says
    ``"dead"``).
    """

    def __init__(self, model_path: Optional[str], max_queue: int,
                 store: Optional[PromptCacheStore] = None, idle_complete: bool = False) -> None:
        self.model_path, self.max_queue = model_path, max_queue
        self.store, self.idle_complete = store, idle_complete
        self.model = self.tokenizer = None
        self.texts: Optional[TokenTexts] = None  # how tokens show in log probabilities
        self.num_layers = 0
        self.keeps_prompt_ends = False
        self.vocab_size = 0
        self.fingerprint: Dict[str, Any] = {}  # the model's, for resolve_config
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

    def cancel(self, job: Job) -> None:
        """Cancel ``job`` (its client went away). One still waiting gives its place in the
        queue back at once and is counted cancelled (it is skipped when its turn comes); one
        running stops at its next step or prefill layer."""
        job.cancel.set()
        with self._lock:
            if job.taken or job.withdrawn:
                return
            job.withdrawn = True
            self.waiting -= 1
            self.cancelled += 1

    def status(self) -> dict:
        """What ``/health`` reports about the queue and the running generation."""
        job = self.current
        running = None if job is None else {
            "id": job.id, "phase": job.phase, "layers_done": job.layers_done,
            "num_layers": self.num_layers, "prompt_tokens": len(job.tokens),
            "generated_tokens": job.generated, "method": job.schedule.method,
            "seconds_since_progress": round(time.monotonic() - self.last_progress, 3),
        }
        cached = None if self.store is None else {"entries": len(self.store),
                                                  "bytes": self.store.nbytes}
        return {"queued": self.waiting, "generating": running, "completed": self.completed,
                "cancelled": self.cancelled, "failed": self.failed, "prompt_cache": cached}

    def _run(self) -> None:
        try:
            self.model, self.tokenizer = load(self.model_path)
            self.texts = TokenTexts(self.tokenizer)
            adapter = ModelAdapter(self.model)
            self.num_layers = adapter.num_layers  # a looped Nanbeige's: each pass
            # A hybrid's caches cannot trim back to a prompt's end: keep that state too.
            self.keeps_prompt_ends = bool(recurrent_layers(self.model))
            self.vocab_size, self.fingerprint = adapter.vocab_size, adapter.fingerprint()
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
                job.emit(job.failure())

    def _supervise(self, job: Job) -> None:
        """Run ``job``, turning any exception into that job's failure, and count it."""
        with self._lock:
            if job.withdrawn:  # counted when its client left
                return
            job.taken = True
            self.waiting -= 1
            self.current = job
            self.last_progress = time.monotonic()
        tic = time.perf_counter()
        last: Union[Done, APIError, None] = None
        try:
            last = self._generate(job)
            outcome = "cancelled" if last is None else "completed"
        except UserInputError as e:  # the library refused what validation let through: a 400
            log.warning("request %s refused: %s", job.id, one_line(e))
            last, outcome = APIError(400, one_line(e)), "failed"
        except Exception:  # an internal error: logged with the request's id, the request gets a 500
            log.error("request %s failed:\n%s", job.id, traceback.format_exc())
            last, outcome = job.failure(), "failed"
        finally:
            mx.clear_cache()
        with self._lock:
            self.current = None
            setattr(self, outcome, getattr(self, outcome) + 1)
            took = time.perf_counter() - tic
            # a moving average of request durations, for Retry-After
            self.mean_seconds = 0.8 * self.mean_seconds + 0.2 * took if self.mean_seconds else took
        if last is not None:  # counted first: a client holding its response sees it in /health
            job.emit(last)

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

    def _generate(self, job: Job) -> Optional[Done]:
        """Run ``job``, emitting its text; its :class:`Done` (for the caller to emit once the
        job is counted), or None when it was cancelled."""
        if job.cancel.is_set():
            return None

        def progress(processed: int, total: int) -> None:  # prompt tokens, as mlx-lm counts
            self.last_progress = time.monotonic()
            job.layers_done = processed * self.num_layers // max(total, 1)
            if job.cancel.is_set():
                raise _Cancelled

        if job.seed is not None:
            mx.random.seed(job.seed)
        job.phase = "prefill"
        stop = StopText(job.stop)
        calls = None if job.tool_markers is None else CallSplitter(*job.tool_markers)
        sample = sampler(job.temperature, job.top_p, job.min_p, job.top_k)
        draws = None if job.logprobs is None else LogprobSampler(sample, job.logprobs)
        aligner = None if draws is None else Aligner()
        resp, finish, prompt_end, before_last, hit = None, None, None, None, False
        if self.store is None:
            cache = make_prompt_cache(self.model, job.schedule)
        else:  # a private copy: a failed or cancelled request leaves the stored one intact
            cache = self.store.checkout(self.model, job.schedule, job.tokens)
        cached, tic, split_s, split_layers = len(cache), time.perf_counter(), 0.0, 0
        try:
            if (self.keeps_prompt_ends and self.store is not None
                    and self.store.keeps(job.schedule) and not job.schedule.prunes
                    and len(job.tokens) - cached > 1):
                # A hybrid's state cannot trim back one token, which an exact repeat of this
                # prompt (a regenerated answer) needs to run its last: keep the state before
                # it. Two chunks compute what one does (nothing is pruned), up to rounding.
                n, counted = len(job.tokens) - cached, sum(cache.engine.prefill_tokens_per_layer)
                cache.process(job.tokens[cached:-1],
                              lambda done, layers: progress(done * (n - 1) // layers, n))
                before_last = cache.copy()
                # the request's own counts restart with its generation: carry this chunk's
                split_s = time.perf_counter() - tic
                split_layers = sum(cache.engine.prefill_tokens_per_layer) - counted
            with closing(stream_generate(
                self.model, self.tokenizer, job.tokens[len(cache):], max_tokens=job.max_tokens,
                sampler=sample if draws is None else draws,
                prompt_cache=cache,
                logits_processors=make_logits_processors(job.logit_bias or None,
                                                         job.repetition_penalty),
                prompt_progress_callback=progress,
            )) as responses:
                generated: Optional[List[int]] = []  # until the first text, for dropped_space
                for resp in responses:
                    self.last_progress = time.monotonic()
                    if job.cancel.is_set():
                        return None
                    if (self.keeps_prompt_ends and self.store is not None and prompt_end is None
                            and len(cache) == len(job.tokens)):  # the first token not yet in
                        prompt_end = cache.copy()
                    job.phase, job.generated = "decode", resp.generation_tokens
                    piece = resp.text
                    if job.continues and generated is not None:
                        generated.append(resp.token)
                        if piece:
                            piece = dropped_space(self.tokenizer, job.tokens[-8:], generated,
                                                  piece) + piece
                            generated = None
                    if aligner is not None:  # the end-of-sequence token is no part of it
                        aligner.add(None if resp.finish_reason == "stop" else token_logprob(
                            draws.pop(), resp.token, self.texts), len(piece))
                    if calls is None:
                        pieces, spans = [("text", piece)], [(len(piece), 0)]
                    else:
                        pieces, spans = calls.feed(piece), calls.spans
                    hit = _emit(job, stop, pieces, spans, aligner)
                    finish = "stop" if hit else resp.finish_reason
                    if finish:
                        break
                if calls is not None and not hit:  # what the markers withheld
                    if _emit(job, stop, calls.finish(cut=finish != "stop"), calls.spans,
                             aligner):
                        finish = "stop"
        except _Cancelled:
            return None
        tail = stop.flush()  # empty after a stop string; after EOS, the held-back text
        tokens = () if aligner is None else aligner.rest()  # none after a stop string
        if tail or tokens:
            job.emit(Delta(tail, tokens))
        if self.store is not None:
            for kept in (before_last, prompt_end):  # what a repeat or a next turn can reuse
                if kept is not None:
                    self.store.checkin(kept)
            self.store.checkin(cache)
        s = resp.stats
        return Done(finish, s.prompt_tokens, resp.generation_tokens, cached, {
            "method": s.method, "ttft_s": split_s + s.ttft_s,
            "schedule_source": s.schedule["source"],
            "prompt_tokens_computed_pct": s.prompt_tokens_computed_pct,
            "prompt_token_layers_computed_pct": s.prompt_token_layers_computed_pct,
            "kv_bytes": s.kv_bytes, "aux_bytes": s.aux_bytes, "revivals": s.revivals,
            "completed_token_layers": s.completed_token_layers, "anchors": job.schedule.anchors,
            "prefill_token_layers": sum(s.prefill_tokens_per_layer) + split_layers,
        })
