"""Answer latency: when each token of the whole answer arrives, path by path, side by side.

Usage::

    python -m mlx_lazy.bench.answer --lengths 4096 --answer-tokens 128 --repeats 3
    python -m mlx_lazy.bench.answer --model qwen2.5-coder-0.5b --lengths 2048,4096,8192 \\
        --paths 'full;lazy;lazy:complete=none:max_revivals=8' --out /tmp/answer.json

A user waits for the answer, not for its first token. For each prompt length a document (English
prose, :func:`mlx_lazy.bench.tasks.build_prompt`) followed by a question in the chat template
goes through every path; every path generates exactly ``--answer-tokens`` tokens (EOS
suppressed, greedy), so the same answer length is compared. Per repeat the paths run in an
order rotated by one, in one process, and every figure is a median over repeats:

* **arrival of token n** (n = 1, 2, 16, 64, 128, 256 up to the answer's length): seconds from
  the call to the n-th token, and ``× full``, the per-repeat ratio full / path (above 1:
  sooner than our unpruned path);
* **never slower**: the largest ratio path / full over *every* n from 1 to the answer's
  length (the promise holds when it is at most 1.05);
* **TPOT**: the median gap between consecutive tokens over the answer's second half (steady
  state, after completion or the early revivals);
* peak memory, KV bytes held at the end, the share of the prompt's token-layers computed by
  the end (LazyLLM's Table 2: below 100% when decoding runs on the pruned state), revivals,
  the token-layers completion computed, and host syncs per decode step (the engine's
  selections; the sampled token's own sync is not counted);
* the mean decode step measured here beside what :mod:`.decode_cost`'s roofline predicts
  from the step's counted work on this CPU and on Apple GPUs running 4-bit weights, where a
  step is bandwidth-bound and revived rows cost little.

Paths are method strings (:mod:`mlx_lazy.bench.methods`) or ``mlx-lm`` (mlx-lm's own
``stream_generate``); the default runs every completion mode beside ``speed`` and
``lazy+speed``. The JSON (``--out``) is rewritten after every run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from .. import load
from .._args import OneLineParser, path_arg
from ..adapter import num_layers, recurrent_layers
from ..api import context_length
from ..errors import UserInputError
from ..folders import check_destination, write_text_atomic
from ..resolve import resolve_config
from .common import (BASELINE, FULL, MIB, RunRecord, fmt, machine_info, markdown_table, measure,
                     median)
from .decode_cost import MACHINES, ModelShape, step_seconds, step_work
from .methods import method_list, parse_method
from .tasks import build_prompt, encode, render_prompt

#: Paths run by default: mlx-lm, our unpruned path, each completion mode, SPEED; on a hybrid
#: model, which revives and completes nothing, all but the completion modes.
DEFAULT_PATHS = (BASELINE, FULL, "lazy", "lazy:complete=after-first", "lazy:complete=none",
                 "lazy:complete=progressive:64", "speed", "lazy+speed")
HYBRID_PATHS = (BASELINE, FULL, "lazy", "speed", "lazy+speed")
#: The tokens whose arrival the table shows (those within the answer).
MARKS = (1, 2, 16, 64, 128, 256)
QUESTION = "What is the text above about? Answer in a few paragraphs."
#: A path may be this much slower than ``full`` at some token and still count as never slower
#: (the medians of 3 runs on a shared 2-core machine move by about that much).
SLACK = 1.05


def answer_prompt(tokenizer: Any, n_tokens: int) -> list[int]:
    """Exactly ``n_tokens`` token ids: prose, then :data:`QUESTION` in the chat template."""
    suffix = encode(tokenizer, render_prompt(tokenizer, "\n\n" + QUESTION, ""))
    if n_tokens <= len(suffix) + 1:
        raise UserInputError(f"a prompt of {n_tokens} tokens leaves no room for the document "
                             f"before the question's {len(suffix)} tokens")
    return build_prompt(tokenizer, n_tokens - len(suffix)) + suffix


def run(model: Any, tokenizer: Any, lengths: Sequence[int], answer_tokens: int, repeats: int,
        paths: Sequence[str], out: Optional[Path] = None,
        info: Optional[dict] = None) -> dict[str, Any]:
    """Measure every path at every length (see the module docstring); returns the result dict
    (``runs`` and ``summary``), also written to ``out`` after every run."""
    methods = [parse_method(p, num_layers(model)) for p in paths]
    shape = ModelShape.of(model)
    runs: list[RunRecord] = []
    result: dict[str, Any] = {"info": info or {}, "answer_tokens": answer_tokens, "runs": []}
    for length in lengths:
        prompt = answer_prompt(tokenizer, length)
        for repeat in range(repeats):
            k = repeat % len(methods)
            for order, method in enumerate(methods[k:] + methods[:k]):
                r = measure(model, tokenizer, method, prompt, answer_tokens, stop_at_eos=False)
                r.repeat, r.length, r.order = repeat, length, order
                runs.append(r)
                result["runs"] = [vars(x) for x in runs]
                result["summary"] = summarize(runs, answer_tokens, shape)
                if out is not None:
                    write_text_atomic(out, json.dumps(result, indent=1))
                print(f"  {length} #{repeat} {method.name}: first {r.ttft_s:.2f} s, "
                      f"answer {r.total_s:.2f} s", file=sys.stderr, flush=True)
    return result


def _steady_tpot(arrivals: Sequence[float]) -> Optional[float]:
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return statistics.median(gaps[len(gaps) // 2:]) if gaps else None


def _prompt_layers_pct(r: RunRecord) -> Optional[float]:
    return None if r.stats is None else r.stats.get("prompt_token_layers_computed_pct")


def summarize(runs: Sequence[RunRecord], answer_tokens: int,
              shape: Optional[ModelShape] = None) -> list[dict[str, Any]]:
    """One row per (length, path): medians over repeats, ratios paired by repeat with full;
    with the model's ``shape``, the decode step the roofline predicts on each machine."""
    marks = [n for n in MARKS if n <= answer_tokens]
    if answer_tokens not in marks:
        marks.append(answer_tokens)
    full = {(r.length, r.repeat): r for r in runs if r.method == FULL}
    rows = []
    for key in dict.fromkeys((r.length, r.method) for r in runs):
        rs = [r for r in runs if (r.length, r.method) == key]
        refs = [full.get((r.length, r.repeat)) for r in rs]
        row: dict[str, Any] = {"length": key[0], "path": key[1], "repeats": len(rs)}
        for n in marks:
            row[f"token_{n}_s"] = median(r.arrivals_s[n - 1] for r in rs)
            row[f"token_{n}_x_full"] = median(
                f.arrivals_s[n - 1] / r.arrivals_s[n - 1] for r, f in zip(rs, refs) if f)
        # Never slower: compare medians of arrival at every n.
        if all(refs):
            worst = max(
                median(r.arrivals_s[i] for r in rs) / median(f.arrivals_s[i] for f in refs)
                for i in range(answer_tokens))
            row["worst_vs_full"] = worst
            row["never_slower"] = worst <= SLACK
        row["tpot_s"] = median(_steady_tpot(r.arrivals_s) for r in rs)
        row["peak_mib"] = median(r.peak_memory_bytes * MIB for r in rs)
        row["kv_mib"] = median(r.kv_bytes * MIB for r in rs)
        row["kv_mib_per_layer"] = [x * MIB for x in rs[-1].kv_bytes_per_layer]
        row["prompt_token_layers_pct"] = median(_prompt_layers_pct(r) for r in rs)
        steps = answer_tokens - 1
        if steps:
            row["mean_step_s"] = median((r.arrivals_s[-1] - r.arrivals_s[0]) / steps for r in rs)
        stats = [r.stats for r in rs if r.stats]
        if stats:
            row["host_syncs_per_step"] = median(s["host_syncs"] / max(1, steps) for s in stats)
            row["revivals"] = median(s["revivals"] for s in stats)
            row["completed_token_layers"] = median(s["completed_token_layers"] for s in stats)
            works = [w for w in (step_work(s, steps) for s in stats) if w is not None]
            if shape is not None and works:
                row["token_layers_per_step"] = median(w.token_layers for w in works)
                row["predicted_step_s"] = {
                    name: median(step_seconds(shape, w, m) for w in works)
                    for name, m in MACHINES.items()}
        rows.append(row)
    return rows


def render(result: dict[str, Any]) -> str:
    """Markdown tables of a result: arrivals, then costs."""
    rows, n = result["summary"], result["answer_tokens"]
    marks = [m for m in MARKS if m <= n] + ([n] if n not in MARKS else [])
    arrive = [[r["length"], r["path"],
               *[f"{fmt(r[f'token_{m}_s'])} ({fmt(r[f'token_{m}_x_full'])}x)" for m in marks],
               fmt(r.get("worst_vs_full")), "yes" if r.get("never_slower") else "no"]
              for r in rows]
    costs = [[r["length"], r["path"], fmt(r["tpot_s"], ".3f"), fmt(r["peak_mib"], ".0f"),
              fmt(r["kv_mib"], ".1f"), fmt(r["prompt_token_layers_pct"], ".1f"),
              fmt(r.get("revivals"), ".0f"), fmt(r.get("completed_token_layers"), ".0f"),
              fmt(r.get("host_syncs_per_step"))] for r in rows]
    full = {r["length"]: r for r in rows if r["path"] == FULL}

    def step_ms(r: dict[str, Any]) -> dict[str, Optional[float]]:
        return {"measured": r.get("mean_step_s"), **r.get("predicted_step_s", {})}

    def vs_full(r: dict[str, Any], column: str) -> str:
        value, ref = step_ms(r)[column], step_ms(full.get(r["length"], {})).get(column)
        if value is None:
            return "–"
        return f"{value * 1e3:.1f} ({fmt(ref / value if ref else None)}x)"

    steps = [[r["length"], r["path"], fmt(r.get("token_layers_per_step"), ".1f"),
              *[vs_full(r, c) for c in ("measured", *MACHINES)]]
             for r in rows if r.get("predicted_step_s")]
    return "\n".join([
        f"Arrival of token n in seconds (x full: sooner than our unpruned path), {n}-token answer:",
        "", markdown_table(["length", "path", *[f"token {m}" for m in marks],
                            "worst path/full", "never slower"], arrive), "",
        markdown_table(["length", "path", "TPOT s (2nd half)", "peak MiB", "KV MiB at end",
                        "prompt token-layers %", "revivals", "completed token-layers",
                        "host syncs/step"], costs), "",
        "Mean decode step in ms (x full), measured here and predicted by the roofline "
        "(mlx_lazy.bench.decode_cost; Apple GPUs: 4-bit weights, assumed efficiencies):", "",
        markdown_table(["length", "path", "token-layers/step", "measured",
                        *[f"predicted {MACHINES[m].name}" for m in MACHINES]], steps)])


def _parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = OneLineParser(prog="python -m mlx_lazy.bench.answer",
                      description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="named model, folder or hub id for mlx_lazy.load (default: smollm2-135m)")
    p.add_argument("--lengths", default="2048,4096", help="comma-separated prompt lengths")
    p.add_argument("--answer-tokens", type=int, default=128,
                   help="tokens every path generates (default 128)")
    p.add_argument("--repeats", type=int, default=3, help="repeats per path (default 3)")
    p.add_argument("--paths", default=None,
                   help="method strings or mlx-lm, separated by ';' (default: "
                        f"{';'.join(DEFAULT_PATHS)}; on a hybrid model such as Qwen3.5, "
                        f"{';'.join(HYBRID_PATHS)}); full is always run")
    p.add_argument("--out", type=path_arg, default=None, help="write the JSON result here")
    args = p.parse_args(argv)
    try:
        args.lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        p.error(f"--lengths takes comma-separated integers, got {args.lengths!r}")
    if not args.lengths or min(args.lengths) < 1:
        p.error("--lengths must be positive")
    if len(set(args.lengths)) < len(args.lengths):  # paired with full by length: one run lost
        p.error(f"--lengths names a length twice: {','.join(map(str, args.lengths))}")
    if args.answer_tokens < 1:
        p.error(f"--answer-tokens must be at least 1, got {args.answer_tokens}")
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.paths is not None:
        try:
            paths = method_list(args.paths, "--paths")
        except UserInputError as e:
            p.error(str(e))
        args.paths = list(dict.fromkeys([FULL, *paths]))
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Command-line entry point; returns the result dict."""
    args = _parse_args(argv)
    try:
        if args.out is not None:  # before the runs, whose results it is to hold
            check_destination(args.out, "--out")
        model, tokenizer = load(args.model)
        if args.paths is None:
            args.paths = list(HYBRID_PATHS if recurrent_layers(model) else DEFAULT_PATHS)
        for path in args.paths:
            try:
                method = parse_method(path, num_layers(model))
            except ValueError as e:  # the method syntax's errors
                raise UserInputError(f"--paths: {e}") from None
            if method.config is not None:  # and what only the model's depth refuses
                try:
                    resolve_config(model, method.config)
                except UserInputError as e:
                    raise UserInputError(f"--paths {path}: {e}") from None
        context = context_length(model, tokenizer)
        if context is not None and max(args.lengths) + args.answer_tokens > context:
            raise UserInputError(f"a {max(args.lengths)}-token prompt and a {args.answer_tokens}"
                                 f"-token answer exceed the model's context of {context} tokens")
        result = run(model, tokenizer, args.lengths, args.answer_tokens, args.repeats,
                     args.paths, args.out, machine_info(model, "mlx_lazy.bench.answer", argv))
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(render(result))
    return result


if __name__ == "__main__":
    main()
