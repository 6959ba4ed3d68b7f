"""The server's HTTP layer below the endpoints: error objects (:func:`error_response`, the
handlers :func:`add_error_handlers` installs), the ASGI middleware that bounds a request before
it is parsed (:class:`ApiKey`, :class:`BodyLimit`), the connection's header deadline and
lingering close (:class:`BoundedConnection`) and the uvicorn server and listening socket
(:func:`uvicorn_server`, :func:`listen_socket`). Needs the ``[server]`` extra.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import os
import socket
import traceback
import uuid
from typing import Optional, Sequence, Union

from .extras import needs_extra

with needs_extra("server", "the server"):
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
    import h11
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import UserInputError, one_line
from .server_settings import ServerSettings
from .server_worker import APIError

log = logging.getLogger("mlx_lazy.server")


def error_response(exc: APIError) -> JSONResponse:
    """``exc`` as an HTTP response: its status, headers and OpenAI-style error object."""
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _param(loc: Sequence[Union[str, int]]) -> Optional[str]:
    """``("body", "messages", 0, "content")`` -> ``"messages[0].content"``; a union member's
    tag in the loc (``"list[constrained-str]"``, ``"function-after[...]"``) is left out, and
    a refused dict key (followed by ``"[key]"``) ends it at the dict."""
    out = ""
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    for part, after in zip(parts, parts[1:] + [None]):
        if after == "[key]":
            break
        if isinstance(part, str) and ("[" in part or "-" in part):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or None


def validation_error(exc: RequestValidationError) -> APIError:
    """A body that failed validation as a 400 naming the field (``param``), or malformed JSON."""
    errors = exc.errors()
    bad_json = next((e for e in errors if e["type"] == "json_invalid"), None)
    if bad_json is not None:
        why = bad_json.get("ctx", {}).get("error", bad_json["msg"])
        return APIError(400, f"malformed JSON in the request body: {why}")
    if tuple(errors[0]["loc"]) == ("body",) and errors[0]["type"] in _NOT_AN_OBJECT:
        return APIError(400, "the request body must be a JSON object (sent with Content-Type: "
                             "application/json)")
    # A union reports one error per member (its loc goes on with the member's tag). The
    # member whose type the value has says what is wrong with it (a list of 5 stops: too
    # many, not "not a string"), its deepest error where (stop[1]); only a value of none of
    # the members' types is "(or another accepted type)".
    group = [e for e in errors if tuple(e["loc"][:2]) == tuple(errors[0]["loc"][:2])]
    shallow = len(os.path.commonprefix([tuple(e["loc"]) for e in group])) + 1
    typed = [e for e in group if not e["type"].endswith("_type") or len(e["loc"]) > shallow]
    first = max(typed or group, key=lambda e: len(e["loc"]))
    param = _param(first["loc"])
    msg = first["msg"] if len(group) == 1 or typed else f"{first['msg']} (or another accepted type)"
    where = param or "the request body"
    return APIError(400, f"{where}: {msg}", param=param,
                    code="missing_field" if first["type"] == "missing" else None)


#: Pydantic's errors for a body that is not a JSON object (or was not sent as JSON; missing:
#: an empty body).
_NOT_AN_OBJECT = ("model_attributes_type", "dict_type", "model_type", "missing")


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


LINGER_S = 2.0


class LingeringTransport:
    """A transport whose ``close()`` lingers, as nginx's ``lingering_close``: what was written
    is sent, the write side is shut (FIN), and what the client still sends is read and dropped
    until it closes its side or ``linger`` seconds pass. A socket closed at once with unread
    input is reset (RST), and the client may lose the response just sent: the 408 of a body
    still arriving. Everything else is the wrapped transport's."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop,
                 linger: float = LINGER_S) -> None:
        self.transport, self.loop, self.linger = transport, loop, linger
        self.lingering = False

    def __getattr__(self, name: str):
        return getattr(self.transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self.transport.is_closing()

    def close(self) -> None:
        if self.lingering:
            return
        self.lingering = True
        if self.transport.is_closing() or not self.transport.can_write_eof():
            self.transport.close()
            return
        try:
            self.transport.write_eof()
        except OSError:  # the client went away meanwhile: nothing to linger for
            self.transport.close()
            return
        self.transport.resume_reading()  # the client's EOF must be seen to close early
        self.loop.call_later(self.linger, self.transport.close)


class BoundedConnection(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose next request's headers have not all
    arrived ``timeout`` seconds after it opened or after its last response (uvicorn times an
    idle connection only until its first byte, so a client that stops mid-headers is held
    forever), and closing every connection with a :class:`LingeringTransport`. The body's
    deadline is :class:`BodyLimit`'s."""

    def __init__(self, *args, timeout: float, **kw) -> None:
        super().__init__(*args, **kw)
        self.timeout = timeout
        self.deadline: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self.transport = LingeringTransport(transport, self.loop)
        self.arm()

    def data_received(self, data: bytes) -> None:
        if self.transport.lingering:  # the last response is sent: the rest is dropped
            return
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


def uvicorn_server(app: FastAPI, settings: ServerSettings, log_level: str) -> uvicorn.Server:
    """A uvicorn server for ``app`` whose connections have ``settings.read_timeout_s`` for a
    request's headers and close lingering (:class:`BoundedConnection`)."""
    protocol = functools.partial(BoundedConnection, timeout=settings.read_timeout_s)
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


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(validation_error(exc))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(APIError(exc.status_code, _unparsed(exc) or str(exc.detail),
                                   headers=exc.headers))


def _unparsed(exc: StarletteHTTPException) -> Optional[str]:
    """Why FastAPI could not parse a body, from the error under its generic "There was an
    error parsing the body" (None when it is not that)."""
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return (f"the body is not UTF-8: byte 0x{cause.object[cause.start]:02x} at offset "
                f"{cause.start}")
    if isinstance(cause, RecursionError):
        return "the body's JSON nests too deeply"
    if isinstance(cause, ValueError) and "digits" in str(cause):  # int_max_str_digits
        return f"the body's JSON holds an integer too long to read ({one_line(cause)})"
    return None


async def _internal(request: Request, exc: Exception) -> JSONResponse:
    rid = "req-" + uuid.uuid4().hex
    log.error("request %s failed:\n%s", rid, "".join(traceback.format_exception(exc)))
    return error_response(APIError(500, f"internal server error (request {rid}; see the server "
                                        "log)", type="server_error"))


def add_error_handlers(app: FastAPI) -> None:
    """Answer every error as an OpenAI-style error object: an :class:`APIError` as it is, a
    body that fails validation as a 400 (:func:`validation_error`), Starlette's own HTTP errors
    (404, 405) with their status, anything else as a 500 naming a request id that the log's
    traceback names too."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)
