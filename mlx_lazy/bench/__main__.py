"""``python -m mlx_lazy.bench``: accuracy vs time-to-first-token benchmark.

Calibrating a schedule is ``python -m mlx_lazy.calibrate`` (:mod:`mlx_lazy.bench.calibrate`).

Examples::

    python -m mlx_lazy.bench --quick --out /tmp/bench           # < 10 min on 2 CPU cores
    python -m mlx_lazy.bench --lengths 512,1024,2048 --samples 10 --methods mlx-lm,full,lazy

Writes ``results.json``, ``table.md`` and the PNG plots into ``--out``.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from .. import _blas  # noqa: F401  (OpenBLAS before mlx.core)
from .._args import OneLineParser
from ..adapter import num_layers
from ..errors import UserInputError
from ..folders import make_folder, write_text_atomic
from .methods import parse_method, parse_methods
from .tasks import QUICK_TASKS, TASKS


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def build_parser() -> OneLineParser:
    """The command-line options."""
    p = OneLineParser(
        prog="python -m mlx_lazy.bench",
        description="Offline long-context accuracy vs TTFT benchmark: mlx-lm baseline, our "
        "unpruned path, LazyLLM, SPEED, LazyLLM+SPEED, static and random pruning.",
    )
    p.add_argument("--quick", action="store_true",
                   help=f"short run: tasks {','.join(QUICK_TASKS)}, lengths 512,1024, 2 samples, "
                   "10-token answers (explicit options still override)")
    p.add_argument("--out", default="bench_out", help="output folder (default: ./bench_out)")
    p.add_argument("--model", default=None,
                   help="named model (e.g. qwen2.5-coder-0.5b), model folder or Hugging Face id "
                        "(default: smollm2-135m)")
    p.add_argument("--lengths", type=_ints, default=None,
                   help="prompt lengths in tokens, comma-separated (default 512,1024)")
    p.add_argument("--samples", type=int, default=None,
                   help="samples per (task, length) (default 5; quick 2)")
    p.add_argument("--tasks", type=_names, default=None,
                   help=f"comma-separated, from: {','.join(TASKS)} (default: all)")
    p.add_argument("--methods", default=None,
                   help="comma-separated methods; separate with ';' when an override holds "
                   "commas, e.g. 'mlx-lm;full;lazy:layers=6,12:keep=0.6,0.4' "
                   "(default: mlx-lm,full,lazy,speed,lazy+speed,static,random)")
    p.add_argument("--seed", type=int, default=0, help="task generator seed (default 0)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="generation budget per answer (default: each task's own, 12-40; quick 10)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds after which no new sample starts; results so far are written "
                   "(SIGTERM and Ctrl-C also stop cleanly after writing)")
    p.add_argument("--report", metavar="DIR", default=None,
                   help="re-aggregate an existing DIR/results.json (tables, plots) "
                   "without running anything")
    p.add_argument("--agreement", type=int, default=0, metavar="N",
                   help="also measure teacher-forced top-1 agreement with full on N prose "
                   "prompts per length (default 0: off)")
    p.add_argument("--agreement-steps", type=int, default=32, metavar="T",
                   help="steps along full's continuation per agreement prompt (default 32)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return the exit status."""
    p = build_parser()
    args = p.parse_args(argv)
    from . import harness

    if args.report:
        return report(Path(args.report))
    for flag, value, low in (("--samples", args.samples, 1), ("--max-tokens", args.max_tokens, 1),
                             ("--agreement", args.agreement, 0),
                             ("--agreement-steps", args.agreement_steps, 1)):
        if value is not None and value < low:
            p.error(f"{flag} must be at least {low}, got {value}")
    if args.lengths is not None and (not args.lengths or min(args.lengths) < 1):
        p.error("--lengths must be positive")
    for flag, values in (("--lengths", args.lengths), ("--tasks", args.tasks)):
        if values is not None and len(set(values)) < len(values):  # one sample counted twice
            p.error(f"{flag} names a value twice: {','.join(map(str, values))}")
    if args.tasks is not None and not args.tasks:
        p.error("--tasks names no task")
    if args.time_limit is not None and not 0 < args.time_limit < float("inf"):
        p.error(f"--time-limit must be a positive number of seconds, got {args.time_limit}")
    try:  # before the runs, whose results it is to hold
        make_folder(Path(args.out))
    except UserInputError as e:
        p.error(str(e))

    opts = dict(tasks=args.tasks, lengths=args.lengths, samples=args.samples,
                methods=parse_methods(args.methods) if args.methods else None)
    opts = {k: v for k, v in opts.items() if v is not None}
    cfg = harness.BenchConfig.quick(**opts) if args.quick else harness.BenchConfig(**opts)
    cfg.model, cfg.seed = args.model, args.seed
    if args.max_tokens is not None:
        cfg.max_tokens = args.max_tokens
    cfg.out, cfg.progress = args.out, not args.no_progress
    cfg.time_limit_s = args.time_limit
    cfg.agreement_prompts, cfg.agreement_steps = args.agreement, args.agreement_steps
    # `timeout` sends SIGTERM: treat it like Ctrl-C so the results so far are still written.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    unknown = [t for t in cfg.tasks if t not in TASKS]
    if unknown:
        print(f"error: unknown task(s) {unknown}; choose from {','.join(TASKS)}", file=sys.stderr)
        return 2

    from .. import load
    from ..api import context_length

    model, tokenizer = load(cfg.model)
    try:
        for m in cfg.methods:
            parse_method(m, num_layers(model))
        context = context_length(model, tokenizer)
        if context is not None and max(cfg.lengths) > context:
            raise ValueError(f"--lengths {max(cfg.lengths)} is beyond the model's context of "
                             f"{context} tokens")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        result = harness.run_bench(cfg, model, tokenizer)
    except ValueError as exc:  # e.g. a --lengths value too short for a task
        print(f"error: {exc}", file=sys.stderr)
        return 2
    harness.write_results(result, cfg.out)
    status = _write_reports(Path(cfg.out))
    return 130 if result.meta.get("stopped_early") == "interrupted" else status


def _write_reports(out: Path) -> int:
    """table.md and the PNGs from out/results.json; print the table."""
    from . import harness, plots

    data = harness.load_results(out)
    table = harness.render_table(data)
    write_text_atomic(out / "table.md", table)
    pngs = plots.write_plots(data, out)
    print(table)
    print(f"wrote {out / 'results.json'}, {out / 'table.md'}, " + ", ".join(str(p) for p in pngs))
    return 0


def report(out: Path) -> int:
    """Re-aggregate a saved run (summary, table, plots)."""
    from . import harness

    if not (out / "results.json").is_file():
        print(f"error: no results.json in {out}", file=sys.stderr)
        return 2
    try:
        data = harness.load_results(out)
        runs = [harness.RunRecord.from_dict(r) for r in data["runs"]]
        result = harness.BenchResult(meta=data["meta"], samples=data["samples"], runs=runs,
                                     cost_model=data.get("cost_model"),
                                     agreement=data.get("agreement"))
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSON's errors included
        print(f"error: {out / 'results.json'} is not this benchmark's results ({e!r})",
              file=sys.stderr)
        return 2
    result.summary = harness.summarize(runs)
    harness.write_results(result, out)
    return _write_reports(out)


if __name__ == "__main__":
    sys.exit(main())
