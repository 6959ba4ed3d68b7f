"""Tensor-parallel benchmark: 1 rank against N ranks (``mlx.launch``, ring backend, this
machine), ``full`` and ``lazy``, with the communication's share.

Usage::

    python -m mlx_lazy.bench.distributed --model path/to/model --ranks 1,2 --length 2048 \\
        --max-tokens 16 --methods full,lazy --repeats 2 --out /tmp/dist.json

The driver starts R ranks of the ring backend on this machine for each rank count in turn
(in an order rotated every repeat; :func:`launch`), each rank running this file. Each
rank gets ``cores / R`` BLAS threads (``OPENBLAS_NUM_THREADS``), so that R ranks share the
machine as R machines of a R-th of its size would. Every rank loads the model (sharded over
the ranks, :func:`mlx_lazy.load` with ``group``), builds the same prompt of ``--length``
tokens of prose, and for each method runs ``stream_generate`` (EOS disabled) and records:

* **TTFT** and **TPOT**, wall clock on rank 0 (:func:`mlx_lazy.bench.common.timed`), and
  rank 0's process CPU time for the same spans (less sensitive to a busy machine);
* **all-sum bytes**: the arrays all-summed by the model's layers (``o_proj`` and
  ``down_proj`` outputs, counted where they are summed, :mod:`mlx_lazy.distributed`) in
  prefill and per decode step, and the selection scores' all-sums;
* **all-sum time**: after the run, every all-sum size the run used is timed alone (median
  of 7, ``mx.eval`` each) on all ranks together, and the run's time in all-sums is
  estimated as count x time per size. Dividing by TTFT (prefill) and TPOT (per decode
  step) gives the *communication share*. The score all-sums (one per selection, its mean
  size) are priced the same way. This prices each all-sum as if nothing overlapped
  it; in the real run the CPU backend waits on each all-sum too, so it is a fair estimate
  there, an upper bound where communication overlaps compute.

The counters see an all-sum when its graph is built; prefill and decode are told apart by
the prefill's progress callback once the first token is out.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

import mlx_lazy  # noqa: F401  (OpenBLAS before mlx.core)

import mlx.core as mx

from mlx_lazy import distributed, load, stream_generate
from mlx_lazy._args import OneLineParser
from mlx_lazy.adapter import num_layers
from mlx_lazy.bench.common import fmt, markdown_table, median, no_eos, ratio, timed
from mlx_lazy.bench.speed import schedule_config
from mlx_lazy.bench.tasks import build_prompt

ALLSUM_REPEATS = 7


def allsum_seconds(sizes: Sequence[int], group: mx.distributed.Group) -> dict[int, float]:
    """Median wall time of one float32 all-sum of each size (bytes), run alone on every rank."""
    out = {}
    for size in sorted(sizes):
        x = mx.ones((size // 4,), mx.float32)
        mx.eval(x)
        times = []
        for _ in range(ALLSUM_REPEATS):
            tic = time.perf_counter()
            mx.eval(mx.distributed.all_sum(x, group=group))
            times.append(time.perf_counter() - tic)
        out[size] = statistics.median(times)
    return out


def rank_main(args: argparse.Namespace) -> None:
    """One rank of one launch: every method once; rank 0 writes the JSON record."""
    group = distributed.world()
    model, tokenizer = load(args.model, group=group)
    prompt = build_prompt(tokenizer, args.length)
    counter = distributed.allsum_counter(model)
    records = []
    methods = args.methods.split(",")
    for i in range(len(methods)):
        method = methods[(i + args.rotate) % len(methods)]
        config = schedule_config(method, num_layers(model))
        before = Counter(counter.by_size) if counter else Counter()
        split: list[Counter] = []

        def prefill_done(processed: int, total: int) -> None:  # (total, total): prefill over
            if processed == total and counter:
                split.append(Counter(counter.by_size))

        with no_eos(tokenizer):
            timing, last, _ = timed(stream_generate(
                model, tokenizer, prompt, max_tokens=args.max_tokens, config=config,
                prompt_progress_callback=prefill_done))
        record = {"method": method, "ranks": 1 if group is None else group.size(),
                  "ttft_s": timing.ttft_s, "tpot_s": timing.tpot_s,
                  "ttft_cpu_s": timing.ttft_cpu_s, "tpot_cpu_s": timing.tpot_cpu_s,
                  "generation_tokens": timing.generation_tokens, "stats": last.stats.as_dict()}
        record["stats"].pop("text")
        if counter:
            prefill = split[0] - before
            decode = Counter(counter.by_size) - split[0]
            stats = record["stats"]
            score_calls = stats["selections"]  # one score all-sum per selection
            score_size = (4 * round(stats["score_allsum_bytes"] / 4 / score_calls)
                          if score_calls else 0)
            seconds = allsum_seconds(set(prefill) | set(decode) | ({score_size} - {0}), group)
            # generate_step runs every token it hands out through the model (as mlx-lm's, so
            # the prompt cache holds them all): one decode step per generated token.
            steps = max(1, timing.generation_tokens)
            record |= {
                "prefill_allsum_bytes": sum(s * c for s, c in prefill.items()),
                "prefill_allsums": sum(prefill.values()),
                "prefill_allsum_s": sum(seconds[s] * c for s, c in prefill.items()),
                "decode_allsum_bytes_per_step": sum(s * c for s, c in decode.items()) / steps,
                "decode_allsum_s_per_step": sum(seconds[s] * c for s, c in decode.items()) / steps,
                "score_allsum_s": seconds[score_size] * score_calls if score_calls else 0.0,
            }
        records.append(record)
    if distributed.is_rank0(group):
        Path(args.record).write_text(json.dumps(records))


def launch(ranks: int, args: argparse.Namespace, record: Path, rotate: int) -> list[dict]:
    """Run every method on ``ranks`` ranks; return rank 0's records.

    The ranks are started the way ``mlx.launch --backend ring`` starts them on one machine
    (``MLX_RANK``, ``MLX_HOSTFILE``), but without the launcher, whose output-forwarding
    threads poll continuously: about a fifth of a core each, too much on a 2-core machine.
    """
    threads = max(1, (os.cpu_count() or 1) // ranks)
    script = [sys.executable, __file__, "--rank", "--model", str(args.model),
              "--length", str(args.length), "--max-tokens", str(args.max_tokens),
              "--methods", args.methods, "--rotate", str(rotate), "--record", str(record)]
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads))
    with tempfile.TemporaryDirectory() as tmp:
        if ranks > 1:
            with socket.socket() as s:  # a free port, not the launcher's fixed default
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            hostfile = Path(tmp) / "hosts.json"
            hostfile.write_text(json.dumps([[f"127.0.0.1:{port + r}"] for r in range(ranks)]))
            env["MLX_HOSTFILE"] = str(hostfile)
        procs = [subprocess.Popen(script, env=dict(env, MLX_RANK=str(r)), stdin=subprocess.DEVNULL)
                 for r in range(ranks)]
        try:
            codes = [p.wait(timeout=args.timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    if any(codes):
        raise RuntimeError(f"a rank failed (exit statuses {codes})")
    return json.loads(record.read_text())


def table(runs: list[dict]) -> str:
    """Markdown: median per (ranks, method), TTFT and TPOT against 1 rank of the same repeat."""
    base = {(r["repeat"], r["method"]): r for r in runs if r["ranks"] == 1}
    rows = []
    for ranks, method in sorted({(r["ranks"], r["method"]) for r in runs}):
        group = [r for r in runs if (r["ranks"], r["method"]) == (ranks, method)]

        def med(f):
            return median(f(r) for r in group)

        def vs_one(r, k):
            one = base.get((r["repeat"], method))
            return ratio(r[k], one[k]) if one else None

        rows.append([
            ranks, method, fmt(med(lambda r: r["ttft_s"])),
            fmt(med(lambda r: vs_one(r, "ttft_s"))),
            fmt(med(lambda r: r["tpot_s"]), ".1f", 1e3),
            fmt(med(lambda r: vs_one(r, "tpot_s"))),
            fmt(med(lambda r: r.get("prefill_allsum_bytes", 0)), ".1f", 1e-6),
            fmt(med(lambda r: ratio(r.get("prefill_allsum_s"), r["ttft_s"])), ".1f", 100, "%"),
            fmt(med(lambda r: r.get("decode_allsum_bytes_per_step", 0)), ".1f", 1e-3),
            fmt(med(lambda r: ratio(r.get("decode_allsum_s_per_step"), r["tpot_s"])), ".1f", 100,
                "%"),
            fmt(med(lambda r: r["stats"]["score_allsum_bytes"]), ".1f", 1e-3),
            fmt(med(lambda r: r.get("score_allsum_s")), ".3f"),
        ])
    return markdown_table(
        ["ranks", "method", "TTFT s", "TTFT × 1 rank", "TPOT ms", "TPOT × 1 rank",
         "prefill all-sums MB", "all-sum share of TTFT", "decode all-sum KB/step",
         "all-sum share of TPOT", "score all-sums KB", "score all-sums s"], rows)


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = OneLineParser(prog="python -m mlx_lazy.bench.distributed",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True,
                   help="a model whose head counts divide every rank count")
    p.add_argument("--ranks", default="1,2", help="rank counts to compare (default 1,2)")
    p.add_argument("--length", type=int, default=2048, help="prompt tokens")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--methods", default="full,lazy", help="schedules of mlx_lazy.bench.speed")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    p.add_argument("--out", default=None, help="JSON of every run (rewritten after each launch)")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rotate", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--record", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
    args = _parse(argv)
    if args.rank:
        rank_main(args)
        return []
    ranks = [int(r) for r in args.ranks.split(",")]
    runs: list[dict] = []
    record = Path(args.out or "dist.json").with_suffix(".rank0.json")
    for repeat in range(args.repeats):
        for i in range(len(ranks)):
            n = ranks[(i + repeat) % len(ranks)]
            for r in launch(n, args, record, rotate=repeat):
                runs.append(r | {"repeat": repeat})
            if args.out:
                Path(args.out).write_text(json.dumps(runs, indent=1))
            print(f"repeat {repeat}, {n} rank(s) done, load {os.getloadavg()[0]:.1f}",
                  file=sys.stderr, flush=True)
    print(table(runs))
    return runs


if __name__ == "__main__":
    main()
