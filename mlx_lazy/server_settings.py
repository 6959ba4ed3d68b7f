"""The server's command line: its flags, their checks and the :class:`ServerSettings` they
make (what :func:`mlx_lazy.server.main` starts from). Nothing here needs the ``[server]``
extra."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import math
import os
from typing import Optional

from ._args import METHOD_HELP, OneLineParser, add_sampling_arguments, method_arg
from .config import PruningConfig
from .errors import UserInputError
from .models import MODEL_HELP
from .schedule_files import read_schedule_flag

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
_LOOPBACK_NAMES = ("localhost",)


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


def build_parser() -> argparse.ArgumentParser:
    """The server's argument parser."""
    p = OneLineParser(
        prog="mlx-lazy-server",
        description="OpenAI-compatible HTTP server with LazyLLM / SPEED pruning per request.")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--method", type=method_arg, default=None, metavar="METHOD",
                   help=f"{METHOD_HELP}; the default for requests without a 'pruning' field "
                        "(default: full)")
    p.add_argument("--schedule", default=None, metavar="FILE",
                   help="default pruning from a calibrated schedule file (as python -m "
                        "mlx_lazy.calibrate and mlx_lazy.write_schedule write them; it sets "
                        "the method)")
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
                        "(a prefill layer, a token) for this long "
                        f"(default {DEFAULT_STALL_TIMEOUT_S:g})")
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
        config = read_schedule_flag(args.schedule, args.method)  # as generate reads it
    else:
        config = PruningConfig.preset(args.method or "full")
    return ServerSettings(
        model=args.model, config=config, max_tokens=args.max_tokens,
        temperature=args.temp, top_p=args.top_p, max_prompt_tokens=args.max_prompt_tokens,
        max_queue=args.max_queue, max_body_bytes=args.max_body_bytes, api_key=args.api_key,
        read_timeout_s=args.read_timeout, stall_timeout_s=args.stall_timeout,
        prompt_cache_size=args.prompt_cache_size, prompt_cache_bytes=args.prompt_cache_bytes,
        share_pruned_caches=args.share_pruned_caches, idle_complete=args.idle_complete)
