"""OpenAI-compatible HTTP server with pruning per request: ``python -m mlx_lazy.server``.

Endpoints as mlx-lm's server and the OpenAI API define them: ``POST /v1/chat/completions``,
``POST /v1/completions``, ``GET /v1/models`` and ``GET /health``. A request may choose its
pruning with one extra body field, ``"pruning"``: a preset name (``"full"``, ``"lazy"``, ...)
or an object of :class:`~mlx_lazy.config.PruningConfig` fields; without it the server's
``--method`` / ``--schedule`` apply. ``usage.pruning`` reports what the pruning did. A chat
request may offer ``tools`` (OpenAI function tools) to a model whose tokenizer has a tool-call
format; its answer's calls come back as ``tool_calls``, and pruning never drops the tokens of
the tool definitions (:mod:`mlx_lazy.server_tools`). ``logprobs`` (and a chat request's
``top_logprobs``) return each generated token's log probability and its most likely
alternatives, in OpenAI's chat and legacy shapes (:mod:`mlx_lazy.server_logprobs`).

One thread owns the model and runs one generation at a time from a queue; the HTTP side
(FastAPI on uvicorn, one event loop) only parses, validates and streams, so ``/health``
answers during a long prefill. A client that disconnects cancels its generation (between two
layers of the prefill or two decode steps). Every error is an OpenAI-style error object:
``{"error": {"message", "type", "param", "code"}}``.

Here: the :class:`App` (the endpoints; each request validated and resolved once into a job)
and :func:`main`. The request bodies and the bounds on their fields are
:mod:`mlx_lazy.server_schemas`, the error objects, middleware and uvicorn set-up
:mod:`mlx_lazy.server_http`, the generation thread and its jobs :mod:`mlx_lazy.server_worker`,
the command line's flags and settings :mod:`mlx_lazy.server_settings`, the prompt caches kept
between requests :mod:`mlx_lazy.prefix_store`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
import uuid
from dataclasses import replace
from typing import AsyncIterator, Dict, List, Optional, Sequence, Tuple, Union

from jinja2 import TemplateError

from .extras import needs_extra

with needs_extra("server", "the server"):
    from fastapi import FastAPI, Request
    from fastapi.concurrency import run_in_threadpool
    from fastapi.responses import JSONResponse
    from sse_starlette import EventSourceResponse

from .api import check_anchors, check_context, prompt_token_ids
from .errors import UserInputError, one_line, shown
from .inputs import parse_int
from .policies import RandomDrop, compose
from .prefix_store import PromptCacheStore
from .resolve import resolve_config
from .schedule import check_fits
from .server_http import (ApiKey, BodyLimit, add_error_handlers, listen_socket,
                          uvicorn_server)
from .server_logprobs import chat_logprobs, completion_logprobs
from .server_schemas import (Bounds, ChatRequest, CompletionRequest, Message, RequestBody,
                             pruning_config, token_bytes)
from .server_settings import ServerSettings, build_parser, is_loopback, settings_from_args
from .server_tools import ChatOutput, tools_end
from .server_worker import GONE, APIError, Call, Delta, Done, Job, Worker
from .token_ids import check_tokens

SSE_PING_S = 15  # a comment line keeps proxies from closing a stream during a long prefill


class App:
    """The HTTP side of the server: validates each request into a :class:`Job` for
    ``worker``'s (loaded) model with ``settings``, and returns or streams its output
    (:meth:`fastapi` builds the application that routes to the endpoints here). Text is
    tokenized with ``verbose=False``: a prompt too long is a 413, not also transformers'
    warning of one longer than the tokenizer's ``model_max_length``."""

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
        add_error_handlers(app)
        app.api_route("/health", methods=["GET", "HEAD"])(self.health)
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
        self.bounds.check_text(body.text_bytes(), "messages")
        tools = self.offered_tools(body)
        tokens, anchors = await run_in_threadpool(self.chat_tokens, body.messages, tools)
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await self.respond(body, tokens, request, chat=True, max_tokens=max_tokens,
                                  tools=tools, anchors=anchors)

    async def completions(self, body: CompletionRequest, request: Request):
        if isinstance(body.prompt, str):
            self.bounds.check_text(len(body.prompt.encode()), "prompt")
            tokens = await run_in_threadpool(prompt_token_ids, self.tokenizer, body.prompt,
                                             verbose=False)
        else:
            self.bounds.check_tokens(len(body.prompt), "prompt")
            try:
                check_tokens(body.prompt, self.worker.vocab_size)
            except UserInputError as e:
                raise APIError(400, str(e), param="prompt") from None
            tokens = list(body.prompt)
        return await self.respond(body, tokens, request, chat=False, max_tokens=body.max_tokens)

    # ------------------------------------------------------------ a request's parts
    def offered_tools(self, body: ChatRequest) -> Optional[List[dict]]:
        """The tools ``body`` offers the model, as the chat template takes them; None when it
        offers none (or ``tool_choice`` is ``"none"``: the tools are then neither rendered
        nor their calls parsed).

        Raises:
            APIError: 400 when the model cannot call tools (its tokenizer has no tool-call
                format, or no chat template).
        """
        if not body.offers_tools():
            return None
        tokenizer = self.tokenizer
        if not (getattr(tokenizer, "has_chat_template", False)
                and getattr(tokenizer, "has_tool_calling", False)):
            why = ("has no chat template" if not getattr(tokenizer, "has_chat_template", False)
                   else "has no tool-call format mlx-lm knows (no tool parser matches its chat "
                        "template)")
            raise APIError(400, f"this model cannot call tools: its tokenizer {why}; leave "
                                f"tools out, or send tool_choice \"none\"", param="tools")
        return [t.model_dump(exclude_none=True) for t in body.tools]

    def chat_tokens(self, messages: List[Message],
                    tools: Optional[List[dict]] = None) -> Tuple[List[int], int]:
        """The prompt of ``messages`` (and ``tools``): the model's chat template, or without
        one their contents, one per line; and how many of its leading tokens hold the
        tools' definitions (0 without tools; :func:`~mlx_lazy.server_tools.tools_end`, from
        the prompt rendered once more without them)."""
        tokenizer = self.tokenizer
        plain = [_template_message(m) for m in messages]
        if not getattr(tokenizer, "has_chat_template", False):
            return prompt_token_ids(tokenizer, "\n".join(m["content"] for m in plain),
                                    verbose=False), 0

        def render(tools: Optional[List[dict]]) -> List[int]:
            try:
                text = tokenizer.apply_chat_template(plain, tools=tools, tokenize=False,
                                                     add_generation_prompt=True)
            except TemplateError as e:  # e.g. "roles must alternate user/assistant"
                what = "these messages and tools" if tools else "these messages"
                raise APIError(400, f"the model's chat template rejects {what}: {e}",
                               param="messages") from None
            return list(tokenizer.encode(text, add_special_tokens=False, verbose=False))

        tokens = render(tools)
        return tokens, tools_end(tokens, render(None)) if tools else 0

    def make_job(self, rid: str, body: RequestBody, tokens: List[int],
                 max_tokens: Optional[int], tools: Optional[List[dict]] = None,
                 anchors: int = 0) -> Job:
        """The job for a validated body and its prompt ``tokens``: with ``tools`` offered,
        their calls are split from the text; a pruning schedule keeps at least the first
        ``anchors`` prompt tokens (the tools' definitions) at every cut.

        Raises:
            APIError: 400 for a field asking what this server does not do (``echo``,
                ...), a pruning or ``max_tokens`` the model cannot run; 413 for a prompt
                over the limit.
        """
        settings, worker = self.settings, self.worker
        asked = body.unsupported()
        if asked is not None:
            raise APIError(400, f"{asked} is not supported by this server (leave it out)",
                           param=asked)
        config = (settings.config if body.pruning is None
                  else pruning_config(body.pruning, settings.config, worker.num_layers))
        n = len(tokens)
        try:  # the request's one resolve; the worker runs this schedule
            if body.seed is not None and RandomDrop in compose(config.method).values() \
                    and not (isinstance(body.pruning, dict) and "seed" in body.pruning):
                config = replace(config, seed=body.seed)  # as the CLI's --seed: the drop's too
            schedule = resolve_config(worker.model, config, fingerprint=worker.fingerprint)
            # The tools' definitions are never pruned; a schedule that prunes nothing keeps the
            # request's own anchors, so that its cache is shared with requests without tools
            # (the prompt-cache store compares schedules).
            if schedule.prunes and anchors > schedule.anchors:
                schedule = replace(schedule, anchors=anchors)
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
                   logit_bias=self.logit_bias(body.logit_bias),
                   top_k=0 if (body.top_k or 0) >= worker.vocab_size else body.top_k or 0,
                   min_p=body.min_p or 0.0, repetition_penalty=body.repetition_penalty,
                   continues=not isinstance(body, ChatRequest),
                   logprobs=body.alternatives(),
                   tool_markers=None if tools is None else (self.tokenizer.tool_call_start,
                                                            self.tokenizer.tool_call_end))

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
            if token in out:  # "1000" and "01000": which bias was meant?
                raise APIError(400, f"logit_bias: {shown(key, 40)} names token {token} again",
                               param="logit_bias")
            out[token] = value
        return out

    async def respond(self, body: RequestBody, tokens: List[int], request: Request, chat: bool,
                      max_tokens: Optional[int], tools: Optional[List[dict]] = None,
                      anchors: int = 0):
        """Queue the request's job; return its completion, or stream it as server-sent
        events. A chat answer's text and tool calls are assembled by a
        :class:`~mlx_lazy.server_tools.ChatOutput`, the same for both."""
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        job = self.make_job(rid, body, tokens, max_tokens, tools, anchors)
        self.worker.submit(job)
        obj = "chat.completion" if chat else "text_completion"
        head = {"id": rid, "object": obj, "created": int(time.time()), "model": self.model_id}
        tokenizer = self.tokenizer
        output = (ChatOutput() if tools is None else
                  ChatOutput(tokenizer.tool_parser, tools,
                             (tokenizer.tool_call_start, tokenizer.tool_call_end)))

        asked = job.logprobs is not None
        shape = chat_logprobs if chat else completion_logprobs

        def pieces(item: Union[Delta, Call]) -> Tuple[str, List[dict], list]:
            """The text, tool calls and tokens (log probabilities) to send for ``item``."""
            if isinstance(item, Delta):
                text, calls = output.content(item.text, item.logprobs), []
            else:
                text, calls = output.call(item.text, item.logprobs)
            return text, calls, output.take()

        if not body.stream:
            texts, calls, tokens, done = [], [], [], None
            watcher = asyncio.create_task(_watch(self.worker, job, request))
            try:
                async for item in _events(self.worker, job):  # a failed job raises its APIError
                    if isinstance(item, Done):
                        done = item
                    else:
                        more, made, of = pieces(item)
                        texts.append(more)
                        calls += made
                        tokens += of
            finally:
                watcher.cancel()
            if done is None:  # the client went away
                return JSONResponse({}, status_code=499)
            text = "".join(texts) + output.end()
            tokens += output.take()
            if not chat:
                out = {"text": text}
            elif calls:  # OpenAI's shape: no text is null content
                out = {"message": {"role": "assistant", "content": text or None,
                                   "tool_calls": calls}}
            else:
                out = {"message": {"role": "assistant", "content": text}}
            choice = {"index": 0, **out, "logprobs": shape(tokens) if asked else None,
                      "finish_reason": output.finish_reason(done.finish_reason)}
            return {**head, "choices": [choice], "usage": _usage(done)}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(piece: Optional[str], finish: Optional[str], first: bool = False,
                  calls: Sequence[dict] = (), tokens: Sequence = ()) -> str:
            logprobs = shape(tokens) if tokens else None
            if chat:
                delta = {} if piece is None else {"content": piece}
                if calls:
                    delta["tool_calls"] = list(calls)
                if first:
                    delta = {"role": "assistant", **delta}
                choice = {"index": 0, "delta": delta, "logprobs": logprobs,
                          "finish_reason": finish}
                return json.dumps({**head, "object": "chat.completion.chunk", "choices": [choice]})
            choice = {"index": 0, "text": piece or "", "logprobs": logprobs,
                      "finish_reason": finish}
            return json.dumps({**head, "choices": [choice]})

        async def sse() -> AsyncIterator[str]:
            first, index = True, 0
            try:
                async for item in _events(self.worker, job):
                    if not isinstance(item, Done):
                        text, calls, tokens = pieces(item)
                        if text or tokens:
                            yield chunk(text, None, first, tokens=tokens)
                            first = False
                        if calls:  # each whole, numbered as OpenAI's stream numbers them
                            yield chunk(None, None, first, [
                                {"index": index + i, **c} for i, c in enumerate(calls)])
                            first, index = False, index + len(calls)
                        continue
                    tail = output.end()
                    tokens = output.take()
                    if tail or tokens:
                        yield chunk(tail, None, first, tokens=tokens)
                        first = False
                    yield chunk(None, output.finish_reason(item.finish_reason), first)
                    if include_usage:
                        yield json.dumps({**head, "object": "chat.completion.chunk" if chat
                                          else obj, "choices": [], "usage": _usage(item)})
            except APIError as e:  # the job failed
                yield json.dumps(e.body())
            yield "[DONE]"

        return EventSourceResponse(sse(), ping=SSE_PING_S, sep="\n")


async def _events(worker: Worker, job: Job) -> AsyncIterator[Union[Delta, Done]]:
    """The job's output, ending early at a :data:`~mlx_lazy.server_worker.GONE`; cancelling
    the job when the consumer stops early."""
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
        worker.cancel(job)  # no effect once finished


async def _watch(worker: Worker, job: Job, request: Request) -> None:
    """Cancel ``job`` the moment its client disconnects (a response that writes nothing until
    the end learns it only from the connection); a stream's response does that itself."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    worker.cancel(job)
    job.events.put_nowait(GONE)


def _template_message(message: Message) -> dict:
    """``message`` as chat templates take it (as mlx-lm's server gives it): the content's
    text ("" for none), a call's ``arguments`` parsed into an object."""
    out: dict = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": c.type, "function": {
                "name": c.function.name,
                "arguments": json.loads(c.function.arguments)
                if c.function.arguments.strip() else {}}}
            for c in message.tool_calls]
    for field in ("tool_call_id", "name"):
        if getattr(message, field) is not None:
            out[field] = getattr(message, field)
    return out


def _usage(done: Done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
            "pruning": done.pruning}


# ---------------------------------------------------------------- command line


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
    host, port = sock.getsockname()[:2]  # uvicorn on a socket given to it names neither
    print(f"serving on http://{f'[{host}]' if ':' in host else host}:{port}/v1 "
          f"(pruning: {settings.config.method}; Ctrl-C stops)", file=sys.stderr, flush=True)
    uvicorn_server(App(settings, worker).fastapi(), settings, args.log_level).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
