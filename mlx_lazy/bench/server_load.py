"""Load check of the HTTP server: concurrent clients, long prompts, ``full`` vs a pruning method.

Usage::

    python -m mlx_lazy.bench.server_load                     # SmolLM2, 2 clients x 2 requests, 2K
    python -m mlx_lazy.bench.server_load --clients 4 --requests 3 --prompt-tokens 2048 \\
        --methods full,lazy --max-tokens 16 --out /tmp/load.json
    python -m mlx_lazy.bench.server_load --url http://127.0.0.1:8080   # a server already running

Starts ``python -m mlx_lazy.server`` on a free loopback port (unless ``--url``), then for each
method in turn: ``--clients`` threads each send ``--requests`` streaming ``/v1/completions``
requests one after another, every one a different ``--prompt-tokens``-token slice of English
prose (as token ids) with ``"pruning": method``. The server generates one request at a time,
so a request's time to first token includes its wait in the queue, as a user would see it.

Reported per method: requests completed (every one must end with a finish reason and its
usage), wall time, throughput (requests per minute, generated tokens per second), time to
first token percentiles measured by the clients (p50, p90, max), and the server's own prefill
time (``usage.pruning.ttft_s``, median); then the method's ratios to the first method. Timings
are wall clock on whatever else the machine runs: compare the methods of one run, not runs.
"""

from __future__ import annotations

from .. import _blas  # noqa: F401  (OpenBLAS before mlx.core)
from .._args import OneLineParser

import argparse
import http.client
import json
import math
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import List, Optional, Sequence
from urllib.parse import urlparse

from ..errors import UserInputError, one_line
from ..folders import check_destination, write_text_atomic
from ..inputs import regular_file
from ..policies import canonical_method
from .common import fmt, markdown_table, ratio
from .methods import method_list
from .tasks import build_prompt

HOST = "127.0.0.1"
PROMPT_STRIDE = 37  # tokens between consecutive requests' prompt slices


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, by linear interpolation."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stream_completion(host: str, port: int, body: dict, timeout: float) -> dict:
    """One streaming request; the client-side timings, the finish reason and the usage."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    tic = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = {"status": resp.status, "ttft_s": None, "finish_reason": None, "usage": None}
    if resp.status != 200:
        out["error"] = resp.read().decode(errors="replace")
        conn.close()
        return out
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            break
        event = json.loads(data)
        if event.get("choices"):
            if out["ttft_s"] is None:
                out["ttft_s"] = time.perf_counter() - tic
            out["finish_reason"] = event["choices"][0]["finish_reason"] or out["finish_reason"]
        if event.get("usage"):
            out["usage"] = event["usage"]
    out["total_s"] = time.perf_counter() - tic
    conn.close()
    return out


def run_method(host: str, port: int, method: str, prompts: List[List[int]], clients: int,
               requests: int, max_tokens: int, timeout: float) -> dict:
    """``clients`` threads × ``requests`` sequential requests with ``"pruning": method``."""
    results: List[dict] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for r in range(requests):
            body = {"prompt": prompts[c * requests + r], "max_tokens": max_tokens, "stream": True,
                    "stream_options": {"include_usage": True}, "pruning": method}
            try:
                res = stream_completion(host, port, body, timeout)
            except OSError as e:
                res = {"status": None, "error": str(e)}
            with lock:
                results.append(res)

    tic = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - tic
    done = [r for r in results if r.get("finish_reason") and r.get("usage")]
    ttfts = [r["ttft_s"] for r in done]
    tokens = sum(r["usage"]["completion_tokens"] for r in done)
    return {
        "method": method,
        "requests": len(results),
        "completed": len(done),
        "all_completed": len(done) == clients * requests,
        "errors": [r.get("error") for r in results if r not in done],
        "wall_s": wall,
        "requests_per_min": 60 * len(done) / wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
        "ttft_p90_s": percentile(ttfts, 90) if ttfts else None,
        "ttft_max_s": max(ttfts) if ttfts else None,
        "server_prefill_median_s": (statistics.median(r["usage"]["pruning"]["ttft_s"] for r in done)
                                    if done else None),
        "prompt_tokens": [r["usage"]["prompt_tokens"] for r in done],
    }


def start_server(model: Optional[str], port: int, log: Path) -> subprocess.Popen:
    """``python -m mlx_lazy.server`` on ``HOST:port``, once its ``/health`` answers."""
    cmd = [sys.executable, "-m", "mlx_lazy.server", "--host", HOST, "--port", str(port),
           "--log-level", "warning", "--max-queue", "64"]
    if model is not None:
        cmd += ["--model", model]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {log.read_text()}")
        try:
            conn = http.client.HTTPConnection(HOST, port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server did not start: {log.read_text()}")


def format_table(rows: List[dict]) -> str:
    """A markdown table of the methods, with ratios to the first."""
    base = rows[0]
    return markdown_table(
        ["method", "completed", "wall (s)", "req/min", "tok/s", "TTFT p50 (s)", "TTFT p90 (s)",
         "TTFT max (s)", "server prefill (s)", "TTFT p50 vs first", "req/min vs first"],
        [[r["method"], f"{r['completed']}/{r['requests']}", fmt(r["wall_s"], ".1f"),
          fmt(r["requests_per_min"]), fmt(r["tokens_per_s"]), fmt(r["ttft_p50_s"]),
          fmt(r["ttft_p90_s"]), fmt(r["ttft_max_s"]), fmt(r["server_prefill_median_s"]),
          fmt(ratio(r["ttft_p50_s"], base["ttft_p50_s"]), suffix="x"),
          fmt(ratio(r["requests_per_min"], base["requests_per_min"]), suffix="x")]
         for r in rows])


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the load check; exit status 1 when any request did not complete."""
    p = OneLineParser(prog="python -m mlx_lazy.bench.server_load",
                                description="Concurrent-client load check of mlx_lazy.server.")
    p.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--url", default=None, help="use this running server instead of starting one")
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--requests", type=int, default=2, help="sequential requests per client")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--methods", default="full,lazy", help="comma-separated pruning presets")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per request")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    try:
        methods, server = _check_options(args)
        if args.out is not None:
            check_destination(args.out, "--out")
    except UserInputError as e:
        p.error(str(e))

    from mlx_lm.utils import load_tokenizer

    from ..models import model_folder

    try:
        model_path = Path(model_folder(args.model, local=True)[0])
        if not args.url:
            _check_context(model_path, args.prompt_tokens + args.max_tokens)
    except UserInputError as e:
        p.error(str(e))
    tokenizer = load_tokenizer(model_path)
    n_prompts = args.clients * args.requests
    ids = build_prompt(tokenizer, args.prompt_tokens + PROMPT_STRIDE * n_prompts)
    prompts = [ids[i * PROMPT_STRIDE: i * PROMPT_STRIDE + args.prompt_tokens]
               for i in range(n_prompts)]

    proc = None
    if server is not None:
        host, port = server
    else:
        import socket

        with socket.socket() as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        host = HOST
        log = Path(tempfile.gettempdir()) / f"mlx-lazy-server-load-{port}.log"
        proc = start_server(str(model_path), port, log)
    try:
        rows = []
        for method in methods:
            rows.append(run_method(host, port, method, prompts, args.clients, args.requests,
                                   args.max_tokens, args.timeout))
            print(f"{method}: {rows[-1]['completed']}/{rows[-1]['requests']} completed in "
                  f"{rows[-1]['wall_s']:.1f} s", file=sys.stderr)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    print(f"{args.clients} clients x {args.requests} requests, {args.prompt_tokens}-token prompts, "
          f"{args.max_tokens} new tokens, model {model_path.name}")
    print(format_table(rows))
    if args.out is not None:
        write_text_atomic(Path(args.out), json.dumps({"args": vars(args), "results": rows},
                                                     indent=2))
    failed = [r for r in rows if not r["all_completed"]]
    if failed:
        first = next((e for r in failed for e in r["errors"] if e), None)
        print(f"error: {sum(r['requests'] - r['completed'] for r in failed)} request(s) did not "
              f"complete" + (f" (first: {one_line(first, limit=300)})" if first else ""),
              file=sys.stderr)
    return 1 if failed else 0


def _check_options(args: argparse.Namespace) -> tuple[list[str], Optional[tuple[str, int]]]:
    """The methods to run and the running server's (host, port) (None: start one).

    Raises:
        UserInputError: naming the flag."""
    for flag, value in (("--clients", args.clients), ("--requests", args.requests),
                        ("--prompt-tokens", args.prompt_tokens),
                        ("--max-tokens", args.max_tokens)):
        if value < 1:
            raise UserInputError(f"{flag} must be at least 1, got {value}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise UserInputError(f"--timeout must be a positive number of seconds, got "
                             f"{args.timeout}")
    methods = list(method_list(args.methods, "--methods"))
    for method in methods:  # the server's "pruning": a preset's name
        try:
            canonical_method(method)
        except UserInputError as e:
            raise UserInputError(f"--methods: {e}") from None
    if not args.url:
        return methods, None
    url = urlparse(args.url)
    try:
        port = url.port or 80
    except ValueError:
        port = None
    if url.scheme != "http" or not url.hostname or port is None:
        raise UserInputError(f"--url takes a server's address such as http://127.0.0.1:8080, "
                             f"got {args.url!r}")
    return methods, (url.hostname, port)


def _check_context(folder: Path, tokens: int) -> None:
    """Refuse ``tokens`` (prompt and answer) beyond the context the model's config states."""
    config = json.loads(regular_file(folder / "config.json", "the model's config.json")
                        .read_text())
    context = (config.get("max_position_embeddings")
               or (config.get("text_config") or {}).get("max_position_embeddings"))
    if isinstance(context, int) and tokens > context:
        raise UserInputError(f"--prompt-tokens and --max-tokens come to {tokens} tokens, past "
                             f"the model's context of {context}")


if __name__ == "__main__":
    raise SystemExit(main())
