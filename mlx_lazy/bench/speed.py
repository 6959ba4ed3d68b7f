"""Speed benchmark: mlx-lm vs our unpruned path vs LazyLLM / SPEED schedules, side by side.

Usage::

    python -m mlx_lazy.bench.speed                       # 4K prompt, SmolLM2, all default schedules
    python -m mlx_lazy.bench.speed --lengths 1024,2048,4096 --max-tokens 32 --repeats 3 \\
        --schedules lazy,lazy-2,lazy-mild,speed,lazy+speed --out /tmp/speed.json
    python -m mlx_lazy.bench.speed --quick --model path/to/tiny   # seconds; smoke test

What one run does, in one process:

1. Loads the model (``mlx_lazy.load(--model)``; default SmolLM2-135M-Instruct, float32 on
   this CPU with OpenBLAS) and builds a prompt of exactly N tokens of English prose (the Python
   help texts, ``mlx_lazy.bench.tasks.prose_sentences``), given to every method as token ids.
2. For each repeat, runs every method once at the *main* length (the largest of
   ``--lengths``), in an order rotated every repeat so that no method always runs first:

   * ``mlx-lm``: ``mlx_lm.stream_generate`` (its own prefill and decode loop, default
     settings, its own KV cache);
   * ``full``: ``mlx_lazy.stream_generate`` with ``PruningConfig("full")`` (our unpruned path);
   * every schedule of ``--schedules``: method strings or named methods (see
     :func:`mlx_lazy.bench.methods.parse_method`).

   It also runs ``full`` at each smaller length of ``--lengths``: the cost model
   (:mod:`mlx_lazy.bench.costmodel`) is fitted on all ``full`` runs (≥ 3 lengths) and predicts
   each pruned run's TTFT from its counts (``sum(prefill_tokens_per_layer)``,
   ``prefill_attention_pairs``).
3. Writes JSON (``--out``, rewritten after every run so a timeout keeps what was measured)
   and prints a markdown table.

Measurements (all methods measured identically, wall clock, ``time.perf_counter``):

* **TTFT**: from calling ``stream_generate`` to receiving its first response. Both generators
  only yield a token after evaluating it (``mx.eval`` / ``.item()``), so this is prefill plus
  the first sample.
* **TPOT**: (time of last response − time of first) / (responses − 1): the decode time per
  token at N-token context. EOS is disabled for the measurement (``tokenizer.eos_token_ids``
  emptied) so every method generates exactly ``--max-tokens`` tokens. *TPOT first 16* is the
  same over the first 16 decode steps (a short answer), where LazyLLM revives the most tokens.
* **CPU time**: the same TTFT/TPOT in process CPU seconds (``time.process_time``, all threads).
  On a machine shared with other jobs, wall time stretches with their load; CPU time stretches
  much less (it still grows somewhat: BLAS threads spin while their partner thread waits for a
  core). Both are reported, and the cost model is fitted on each. Check the machine-load line
  under the tables (1-minute load average at the end of each run) before trusting a figure.
* **Ratios**: per repeat, the method's time divided by mlx-lm's (and by ``full``'s) from the
  same repeat; the table shows the median over repeats. Side-by-side ratios cancel most of the
  noise of a shared machine; absolute seconds are medians too.
* **Peak memory**: ``mx.reset_peak_memory()`` before each run, ``mx.get_peak_memory()``
  after; "work" is the peak minus the memory active before the run (the weights).
* **KV bytes**: ours from ``GenerationStats`` (``kv_bytes``, ``kv_bytes_per_layer``,
  ``aux_bytes``); mlx-lm's from its prompt cache, ``nbytes`` of each layer's keys and values
  up to its offset (the filled part; the allocation, rounded up to 256 positions, is in the JSON as
  ``kv_bytes_allocated``).
* **Cost-model error**: (measured TTFT − predicted) / predicted, for each pruned run; target
  within ±10%. "× full vs predicted (CPU)" is the drift-free form: the measured CPU-time ratio
  pruned/full (same repeat) against the model's predicted ratio, minus 1. Positive means the
  pruning machinery (scoring, gathers, Aux Cache, host syncs) costs more than the model of
  plain work accounts for.

Other columns: *token-layers %* and *attn pairs %* are the prefill's work counts relative to an
unpruned prefill; *decode token-layers/step* is the layer work per decode step (the model's depth
for a plain step; more when LazyLLM revives tokens from the Aux Cache and computes them at the
layers they had skipped); *revival ms/step (model)* prices that extra work at the cost model's
per-token-layer rate only (a lower bound: each revived token also attends over the layer's
whole cache, work that GenerationStats does not count); *total × mlx-lm* compares whole
generations (TTFT + all decode steps);
*work MiB* is the peak memory above what was allocated before the run (mostly the weights).

``--report results.json`` prints the tables of a saved result (e.g. one cut short by a timeout:
the JSON is rewritten after every run).

``--decode-interleaved STEPS`` measures decode alone, robustly on a busy machine: every method
prefills once at the largest length, then STEPS single decode steps per method run interleaved
round-robin; the table gives mean step time (wall, CPU) and ratios against mlx-lm's model and
``KVCache`` stepped the same way (:func:`decode_interleaved`).

``--quick`` shrinks everything (lengths 48,64,96, 4 tokens, 1 repeat) for tests on tiny models.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from mlx_lazy import (PromptCache, PruningConfig, generate_step, load, make_prompt_cache,
                      resolve_config)
from mlx_lazy.bench.common import (BASELINE, FULL, MIB, SHORT_ANSWER, RunRecord, fmt,
                                   machine_info, markdown_table, measure, median, paired_ratios,
                                   ratio)
from mlx_lazy.bench.methods import NAMED_METHODS, Method, method_list, parse_method
from mlx_lazy.bench.tasks import build_prompt

import mlx.core as mx

from mlx_lazy.bench.costmodel import CostModel
from mlx_lazy._args import OneLineParser, path_arg
from mlx_lazy.adapter import num_layers
from mlx_lazy.api import context_length
from mlx_lazy.errors import UserInputError
from mlx_lazy.folders import check_destination, write_text_atomic
from mlx_lazy.inputs import MiB, read_json

__all__ = [
    "DEFAULT_SCHEDULES",
    "schedule_config",
    "build_prompt",
    "run_benchmark",
    "decode_interleaved",
    "decode_table",
    "summarize",
    "render_table",
    "main",
]

#: Schedules run by default besides mlx-lm and ``full``: method strings or names of the
#: benchmarks' one registry, :data:`mlx_lazy.bench.methods.NAMED_METHODS`.
DEFAULT_SCHEDULES = ("lazy", "lazy-4", "lazy-2", "speed", "lazy+speed", "lazy-2+speed")


def schedule_config(name: str, num_layers: int) -> PruningConfig:
    """The :class:`PruningConfig` of a method string or named method for a model of
    ``num_layers`` layers (see :func:`mlx_lazy.bench.methods.parse_method`)."""
    method = parse_method(name, num_layers)
    if method.is_baseline:
        raise ValueError(f"{name!r} is the baseline, not a schedule of our engine")
    return method.config


def run_benchmark(
    model: Any,
    tokenizer: Any,
    *,
    lengths: Sequence[int] = (1024, 2048, 4096),
    max_tokens: int = 32,
    repeats: int = 3,
    schedules: Sequence[str] = DEFAULT_SCHEDULES,
    out: Optional[Path] = None,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
    info: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Run the side-by-side benchmark; return (and optionally write) the JSON result.

    Every ``full`` run at every length feeds the cost model; the other methods run only at the
    largest length. Raises ValueError for fewer than 3 distinct lengths or an unknown schedule.
    """
    lengths = sorted(set(int(n) for n in lengths))
    if len(lengths) < 3:
        raise ValueError(f"--lengths needs >= 3 distinct prompt lengths for the cost model, "
                         f"got {lengths}")
    if max_tokens < 2:
        raise ValueError("--max-tokens must be >= 2 to measure time per output token")
    main_len = lengths[-1]
    L = num_layers(model)
    methods: dict[str, Method] = {BASELINE: parse_method(BASELINE), FULL: parse_method(FULL)}
    methods |= {name: parse_method(name, L) for name in schedules if name not in methods}
    resolved, skipped = runnable(model, {n: m.config for n, m in methods.items()
                                         if not m.is_baseline})
    for name, why in skipped.items():
        log(f"skipping schedule {name!r}: {why}")
    methods = {n: m for n, m in methods.items() if n not in skipped}
    prompts = {n: build_prompt(tokenizer, n) for n in lengths}
    result: dict[str, Any] = {
        "info": {**(info or machine_info(model, "mlx_lazy.bench.speed")), "lengths": lengths,
                 "main_length": main_len, "max_tokens": max_tokens, "repeats": repeats},
        "schedules": {n: dataclasses.asdict(m.config)
                      | {"resolved": resolved[n].as_dict()}
                      for n, m in methods.items() if not m.is_baseline},
        "skipped": skipped,
        "runs": [],
    }
    runs: list[RunRecord] = []

    # Warm-up: one short run of each method (first-call costs, allocator growth).
    warm = prompts[lengths[0]][: min(64, lengths[0])]
    for m in methods.values():
        measure(model, tokenizer, m, warm, 2, stop_at_eos=False)
    t_start = time.perf_counter()
    names = list(methods)
    for r in range(repeats):
        order = [(FULL, n) for n in lengths[:-1]]
        k = r % len(names)
        order += [(m, main_len) for m in names[k:] + names[:k]]
        for m, n in order:
            res = measure(model, tokenizer, methods[m], prompts[n], max_tokens, stop_at_eos=False)
            res.repeat = r
            runs.append(res)
            result["runs"].append(dataclasses.asdict(res))
            log(f"[{time.perf_counter() - t_start:7.1f}s] repeat {r} {m:>10} N={n}: "
                f"TTFT {res.ttft_s:.3f}s TPOT {1e3 * (res.tpot_s or 0):.1f}ms")
            if out is not None:  # after every run, so a timeout keeps everything measured
                result["summary"] = summarize(runs, main_len)
                write_text_atomic(out, json.dumps(result, indent=1))
    result["summary"] = summarize(runs, main_len)
    if out is not None:
        write_text_atomic(out, json.dumps(result, indent=1))
    return result


def summarize(runs: Sequence[RunRecord], main_length: int) -> dict[str, Any]:
    """Cost-model fit (on every ``full`` run), then per method at ``main_length``: medians and
    side-by-side ratios against mlx-lm and ``full`` (per repeat, then the median)."""
    full_runs = [r for r in runs if r.method == FULL]
    model: Optional[CostModel] = None
    cpu_model: Optional[CostModel] = None
    fit_error = None
    try:
        model = CostModel.fit(full_runs, [r.ttft_s for r in full_runs])
        cpu_model = CostModel.fit(full_runs, [r.ttft_cpu_s for r in full_runs])
    except ValueError as exc:
        fit_error = str(exc)
    by_method: dict[str, list[RunRecord]] = {}
    for r in runs:
        if r.prompt_tokens == main_length:
            by_method.setdefault(r.method, []).append(r)
    refs = {ref: by_method.get(ref, []) for ref in (BASELINE, FULL)}
    full_first = refs[FULL][0] if refs[FULL] else None

    def repeat(r: RunRecord) -> int:
        return r.repeat

    rows: dict[str, dict[str, Any]] = {}
    for m, mine in by_method.items():
        row: dict[str, Any] = {"n_runs": len(mine)}
        for key in ("ttft_s", "second_token_s", "tpot_s", "tpot_short_s", "total_s", "ttft_cpu_s",
                    "tpot_cpu_s"):
            row[key] = median(getattr(r, key) for r in mine)
            row[key[:-2] + "_vs_mlx_lm"] = median(paired_ratios(mine, refs[BASELINE], key, repeat))
            row[key[:-2] + "_vs_full"] = median(paired_ratios(mine, refs[FULL], key, repeat))
        last = mine[-1]
        row.update(
            kv_bytes=last.kv_bytes,
            kv_bytes_per_layer=last.kv_bytes_per_layer,
            aux_bytes=last.aux_bytes,
            peak_memory_bytes=max(r.peak_memory_bytes for r in mine),
            work_memory_bytes=max(r.work_memory_bytes for r in mine),
        )
        s = last.stats
        if s is not None:
            num_layers = len(last.prefill_tokens_per_layer)
            prefill_tl = sum(last.prefill_tokens_per_layer)
            # Decode steps = new tokens computed at layer 0 (nothing is ever revived there).
            steps = max(1, last.tokens_computed_per_layer[0] - last.prefill_tokens_per_layer[0])
            decode_tl = (sum(last.tokens_computed_per_layer) - prefill_tl) / steps
            full_pairs = full_first.prefill_attention_pairs if full_first else None
            row.update(
                token_layers_pct=100.0 * prefill_tl / (main_length * num_layers),
                attention_pairs_pct=(100.0 * last.prefill_attention_pairs / full_pairs
                                     if full_pairs else None),
                prompt_tokens_computed_pct=last.prompt_tokens_computed_pct,
                revivals=s["revivals"],
                host_syncs=s["host_syncs"],
                max_computations_per_token_layer=s["max_computations_per_token_layer"],
                decode_token_layers_per_step=decode_tl,
            )
            if model is not None:
                errs = [model.relative_error(r, r.ttft_s) for r in mine]
                row.update(
                    predicted_ttft_s=model.predict(last),
                    prediction_errors=errs,
                    prediction_error_median=median(errs),
                    predicted_ttft_cpu_s=cpu_model.predict(last),
                    prediction_errors_cpu=[cpu_model.relative_error(r, r.ttft_cpu_s) for r in mine],
                    # Token-layer work a decode step does beyond its own token (revivals),
                    # priced at the prefill's per-token-layer cost.
                    modelled_revival_s_per_step=model.a * max(0.0, decode_tl - num_layers),
                )
                row["prediction_error_cpu_median"] = median(row["prediction_errors_cpu"])
                if full_first is not None and row["ttft_cpu_vs_full"] is not None:
                    # Drift-free check: measured pruned/full ratio (same repeat, side by side)
                    # against the model's predicted ratio; machine speed changes between
                    # repeats cancel out.
                    predicted_ratio = cpu_model.predict(last) / cpu_model.predict(full_first)
                    row["predicted_cpu_vs_full"] = predicted_ratio
                    row["ratio_error_cpu"] = row["ttft_cpu_vs_full"] / predicted_ratio - 1
        rows[m] = row
    main_repeats: dict[int, set[str]] = {}
    for rs in by_method.values():
        for r in rs:
            main_repeats.setdefault(r.repeat, set()).add(r.method)
    return {
        "repeats_completed": sum(1 for ms in main_repeats.values() if ms == set(by_method)),
        "cost_model": model.as_dict() if model else None,
        "cost_model_cpu": cpu_model.as_dict() if cpu_model else None,
        "cost_model_error": fit_error,
        "cost_model_fit_points": [
            {"prompt_tokens": r.prompt_tokens, "ttft_s": r.ttft_s, "ttft_cpu_s": r.ttft_cpu_s,
             "fitted_s": model.predict(r) if model else None,
             "fitted_cpu_s": cpu_model.predict(r) if cpu_model else None} for r in full_runs],
        "methods": rows,
    }


def render_table(result: dict[str, Any]) -> str:
    """The summary as markdown: prefill table, decode/memory table, cost model, KV per layer."""
    info, summ = result["info"], result["summary"]
    rows = summ["methods"]
    ref_kv = rows.get(BASELINE, {}).get("kv_bytes")
    lines = [
        f"Prompt {info['main_length']} tokens, {info['max_tokens']} generated tokens, "
        f"{summ.get('repeats_completed', info['repeats'])} of {info['repeats']} repeats completed; "
        "times are medians, ratios are per-repeat side-by-side "
        "ratios, then the median.",
        "",
        markdown_table(
            ["method", "TTFT s", "TTFT × mlx-lm", "TTFT × full", "predicted s", "pred. error",
             "CPU-s × mlx-lm", "CPU-s × full", "pred. error (CPU)", "× full vs predicted (CPU)",
             "token-layers %", "attn pairs %", "host syncs"],
            [[m, fmt(r["ttft_s"]), fmt(r["ttft_vs_mlx_lm"], ".3f"), fmt(r["ttft_vs_full"], ".3f"),
              fmt(r.get("predicted_ttft_s")),
              fmt(r.get("prediction_error_median"), "+.1f", 100, "%"),
              fmt(r["ttft_cpu_vs_mlx_lm"], ".3f"), fmt(r["ttft_cpu_vs_full"], ".3f"),
              fmt(r.get("prediction_error_cpu_median"), "+.1f", 100, "%"),
              fmt(r.get("ratio_error_cpu"), "+.1f", 100, "%"),
              fmt(r.get("token_layers_pct"), ".1f"), fmt(r.get("attention_pairs_pct"), ".1f"),
              r.get("host_syncs")] for m, r in rows.items()]),
        "",
        markdown_table(
            ["method", "2nd token s", "2nd token × full", "TPOT ms", "TPOT × mlx-lm",
             "TPOT × full", "TPOT CPU × mlx-lm",
             f"TPOT first {SHORT_ANSWER} × mlx-lm", "total × mlx-lm",
             "decode token-layers/step", "revival ms/step (model)", "revivals", "KV MiB",
             "KV × mlx-lm", "aux MiB", "peak MiB", "work MiB"],
            [[m, fmt(r.get("second_token_s")), fmt(r.get("second_token_vs_full"), ".3f"),
              fmt(r["tpot_s"], ".1f", 1e3), fmt(r["tpot_vs_mlx_lm"], ".3f"),
              fmt(r["tpot_vs_full"], ".3f"), fmt(r["tpot_cpu_vs_mlx_lm"], ".3f"),
              fmt(r.get("tpot_short_vs_mlx_lm"), ".3f"), fmt(r["total_vs_mlx_lm"], ".3f"),
              fmt(r.get("decode_token_layers_per_step"), ".1f"),
              fmt(r.get("modelled_revival_s_per_step"), ".1f", 1e3), r.get("revivals"),
              fmt(r["kv_bytes"], ".1f", MIB), fmt(ratio(r["kv_bytes"], ref_kv), ".3f"),
              fmt(r["aux_bytes"], ".1f", MIB), fmt(r["peak_memory_bytes"], ".0f", MIB),
              fmt(r["work_memory_bytes"], ".0f", MIB)] for m, r in rows.items()]),
        "",
    ]
    cm = summ["cost_model"]
    if cm:
        lines.append(
            f"Cost model (fitted on {cm['n_samples']} unpruned runs at {info['lengths']} tokens): "
            f"TTFT ≈ {cm['a'] * 1e6:.4g} µs × token_layers + "
            f"{cm['b'] * 1e9:.4g} ns × attention_pairs "
            f"+ {cm['c']:.3g} s; fit residual RMS {100 * cm['rms_relative_residual']:.1f}%, "
            f"max {100 * cm['max_relative_residual']:.1f}%.")
        cc = summ.get("cost_model_cpu")
        if cc:
            lines.append(
                f"Same fit on process CPU time: {cc['a'] * 1e6:.4g} µs × token_layers + "
                f"{cc['b'] * 1e9:.4g} ns × attention_pairs + {cc['c']:.3g} s; residual RMS "
                f"{100 * cc['rms_relative_residual']:.1f}%, "
                f"max {100 * cc['max_relative_residual']:.1f}%.")
        pts = summ["cost_model_fit_points"]
        lines.append("Fit points (N: measured / fitted s): " + ", ".join(
            f"{p['prompt_tokens']}: {p['ttft_s']:.2f}/{p['fitted_s']:.2f}" for p in pts))
    else:
        lines.append(f"Cost model not fitted: {summ['cost_model_error']}")
    loads = [r["loadavg_1min"] for r in result["runs"] if r.get("loadavg_1min") is not None]
    if loads:
        lines.append(f"Machine load (1-min average at the end of each run): min {min(loads):.1f}, "
                     f"median {median(loads):.1f}, max {max(loads):.1f} "
                     f"on {info.get('cpu_count')} CPUs.")
    lines += ["", "KV bytes per layer (KiB, layer 0 first):", ""]
    for m, r in rows.items():
        lines.append(f"- {m}: " + ", ".join(f"{b / 1024:.0f}" for b in r["kv_bytes_per_layer"]))
    if result.get("skipped"):
        lines += ["", "Skipped: " + "; ".join(f"{k}: {v}" for k, v in result["skipped"].items())]
    return "\n".join(lines)


def decode_interleaved(
    model: Any,
    tokenizer: Any,
    prompt: list[int],
    steps: int,
    configs: dict[str, PruningConfig],
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
) -> dict[str, Any]:
    """Decode time per token with every method's steps interleaved round-robin.

    Each method runs through its ``generate_step`` generator (mlx-lm's, with its own
    ``KVCache``; ours, with a prompt cache): the first token is the prefill. Then, ``steps``
    times, every method is asked for ONE more greedy token, in an order rotated each round.
    Neighbouring steps of different methods see the same machine load, so per-round ratios are
    far less noisy than TPOT from whole generations run minutes apart. Both generators queue
    their next step ahead alike.
    """
    from mlx_lm.generate import generate_step as mlx_lm_generate_step

    n = len(prompt)
    gens: dict[str, Iterator[Any]] = {}
    caches: dict[str, PromptCache] = {}
    for name in (BASELINE, *configs):
        t0 = time.perf_counter()
        if name == BASELINE:
            gens[name] = mlx_lm_generate_step(mx.array(prompt), model, max_tokens=steps + 1)
        else:
            caches[name] = make_prompt_cache(model, configs[name])
            gens[name] = generate_step(prompt, model, prompt_cache=caches[name],
                                       max_tokens=steps + 1)
        next(gens[name])
        log(f"decode-interleaved: prefilled {name} in {time.perf_counter() - t0:.1f}s")

    methods = list(gens)
    wall: dict[str, list[float]] = {m: [] for m in methods}
    cpu: dict[str, list[float]] = {m: [] for m in methods}
    revived: dict[str, list[int]] = {m: [] for m in caches}
    for s in range(steps):
        k = s % len(methods)
        for m in methods[k:] + methods[:k]:
            before = caches[m].engine.cache.revivals if m in caches else 0
            w, c = time.perf_counter(), time.process_time()
            next(gens[m])
            wall[m].append(time.perf_counter() - w)
            cpu[m].append(time.process_time() - c)
            if m in caches:
                revived[m].append(caches[m].engine.cache.revivals - before)
    rows: dict[str, Any] = {}
    for m in methods:
        per_round = [a / b for a, b in zip(wall[m], wall[BASELINE])]
        rows[m] = {
            "mean_step_s": statistics.fmean(wall[m]),
            "median_step_s": statistics.median(wall[m]),
            "mean_step_cpu_s": statistics.fmean(cpu[m]),
            "wall_vs_mlx_lm": sum(wall[m]) / sum(wall[BASELINE]),
            "cpu_vs_mlx_lm": sum(cpu[m]) / sum(cpu[BASELINE]),
            "median_round_ratio": statistics.median(per_round),
            "step_s": wall[m],
            "step_cpu_s": cpu[m],
            "revivals_per_step": revived.get(m),
        }
    return {"prompt_tokens": n, "steps": steps, "methods": rows}


def decode_table(dec: dict[str, Any]) -> str:
    """Markdown table of :func:`decode_interleaved`'s result."""
    rows = [
        [m, fmt(r["mean_step_s"], ".1f", 1e3), fmt(r["median_step_s"], ".1f", 1e3),
         fmt(r["mean_step_cpu_s"], ".1f", 1e3), fmt(r["wall_vs_mlx_lm"], ".3f"),
         fmt(r["cpu_vs_mlx_lm"], ".3f"), fmt(r["median_round_ratio"], ".3f"),
         None if r["revivals_per_step"] is None else sum(r["revivals_per_step"])]
        for m, r in dec["methods"].items()
    ]
    return "\n".join([
        f"Decode at {dec['prompt_tokens']} tokens of context, {dec['steps']} steps per method, "
        "interleaved round-robin (each through its generate_step):", "",
        markdown_table(["method", "mean step ms", "median step ms", "mean CPU ms", "wall × mlx-lm",
                        "CPU × mlx-lm", "median per-round × mlx-lm", "revivals"], rows)])


def _parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = OneLineParser(prog="python -m mlx_lazy.bench.speed",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="named model (e.g. qwen2.5-coder-0.5b), folder or hub id for mlx_lazy.load "
                        "(default: smollm2-135m)")
    p.add_argument("--lengths", default="1024,2048,4096",
                   help="comma-separated prompt lengths; >= 3; all fit the cost model, the "
                        "largest is where every method is compared (default 1024,2048,4096)")
    p.add_argument("--max-tokens", type=int, default=32,
                   help="tokens generated per run (default 32)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of every run (default 3)")
    p.add_argument("--schedules", default=",".join(DEFAULT_SCHEDULES),
                   help="schedules besides mlx-lm and full: presets, named methods "
                        f"({', '.join(NAMED_METHODS)}) or method strings, separated by ',' "
                        "(';' when a method string has commas; "
                        f"default {','.join(DEFAULT_SCHEDULES)})")
    p.add_argument("--out", type=path_arg, default=None, help="write the JSON result here")
    p.add_argument("--decode-interleaved", type=int, default=0, metavar="STEPS",
                   help="instead of the generation benchmark: prefill every method once at "
                        "the largest length, then time STEPS decode steps per method "
                        "interleaved round-robin")
    p.add_argument("--report", type=path_arg, default=None,
                   help="print the tables of a saved --out JSON (e.g. one cut short by a "
                        "timeout) and exit")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: lengths 48,64,96, 4 tokens, 1 repeat (unless given "
                        "explicitly)")
    args = p.parse_args(argv)
    if args.quick:
        given = set(a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]))
        if "--lengths" not in given:
            args.lengths = "48,64,96"
        if "--max-tokens" not in given:
            args.max_tokens = 4
        if "--repeats" not in given:
            args.repeats = 1
    try:
        args.lengths = sorted({int(x) for x in args.lengths.split(",") if x.strip()})
    except ValueError:
        p.error(f"--lengths takes comma-separated integers, got {args.lengths!r}")
    if not args.lengths or args.lengths[0] < 1:
        p.error("--lengths must be positive")
    if len(args.lengths) < 3 and not args.decode_interleaved:
        p.error(f"--lengths needs >= 3 distinct prompt lengths for the cost model, got "
                f"{args.lengths}")
    if args.max_tokens < 2:
        p.error("--max-tokens must be >= 2 to measure time per output token")
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.decode_interleaved < 0:
        p.error(f"--decode-interleaved takes a number of steps >= 1, got "
                f"{args.decode_interleaved}")
    return args


#: Bounds on reading a --report file: far above what a run writes.
REPORT_MAX_BYTES, REPORT_MAX_DEPTH = 256 * MiB, 64


def _read_report(path: Path) -> dict[str, Any]:
    """The result a ``--out`` run wrote to ``path``, its summary made anew.

    Raises:
        UserInputError: ``path`` is not such a result.
    """
    doc = read_json(path, f"--report {path}", REPORT_MAX_BYTES, REPORT_MAX_DEPTH)
    try:
        runs = [RunRecord.from_dict(r) for r in doc["runs"]]
        doc["summary"] = summarize(runs, doc["info"]["main_length"])
    except (KeyError, TypeError, AttributeError) as e:
        raise UserInputError(f"--report {path} is not a bench.speed result ({e!r})") from None
    return doc


def runnable(model: Any, configs: dict[str, PruningConfig]
             ) -> tuple[dict[str, Any], dict[str, str]]:
    """Each config's schedule on ``model`` (resolved once), and why ``model`` refuses the
    others (a schedule too deep for a tiny model, a hybrid's refusals): those are skipped."""
    resolved, skipped = {}, {}
    for name, config in configs.items():
        try:
            resolved[name] = resolve_config(model, config)
        except ValueError as e:
            skipped[name] = str(e)
    return resolved, skipped


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Command-line entry point; returns the result dict."""
    args = _parse_args(argv)
    try:
        if args.report is not None:
            result = _read_report(args.report)
            print(render_table(result))
            return result
        if args.out is not None:  # before the runs, whose results it is to hold
            check_destination(args.out, "--out")
        schedules = method_list(args.schedules, "--schedules")
        model, tokenizer = load(args.model)
        context = context_length(model, tokenizer)
        steps, flag = ((args.decode_interleaved + 1, "--decode-interleaved")
                       if args.decode_interleaved else (args.max_tokens, "--max-tokens"))
        if context is not None and args.lengths[-1] + steps > context:
            raise UserInputError(f"--lengths {args.lengths[-1]} and {flag} {steps} exceed "
                                 f"the model's context of {context} tokens")
        for s in schedules:
            if s != BASELINE:
                try:
                    schedule_config(s, num_layers(model))
                except ValueError as e:
                    raise UserInputError(f"--schedules: {e}") from None
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    info = machine_info(model, "mlx_lazy.bench.speed", argv)
    if info["model_dtypes"] != ["float32"]:
        print(f"note: model weights are {info['model_dtypes']}, not float32", file=sys.stderr)
    if args.decode_interleaved:
        n = args.lengths[-1]
        L = num_layers(model)
        configs = {name: schedule_config(name, L) for name in dict.fromkeys([FULL, *schedules])
                   if name != BASELINE}
        _, skipped = runnable(model, configs)
        for name, why in skipped.items():
            print(f"skipped {name}: {why}", file=sys.stderr)
        configs = {n: c for n, c in configs.items() if n not in skipped}
        dec = decode_interleaved(model, tokenizer, build_prompt(tokenizer, n),
                                 args.decode_interleaved, configs)
        result = {"info": info, "decode_interleaved": dec}
        if args.out is not None:
            write_text_atomic(args.out, json.dumps(result, indent=1))
        print(decode_table(dec))
        return result
    result = run_benchmark(
        model, tokenizer,
        lengths=args.lengths,
        max_tokens=args.max_tokens, repeats=args.repeats, schedules=schedules,
        out=args.out, info=info,
    )
    print(render_table(result))
    return result


if __name__ == "__main__":
    main()
