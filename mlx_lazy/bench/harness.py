"""Side-by-side accuracy and latency harness: mlx-lm baseline vs our engine's methods.

One process, one model, methods alternating per sample (the order rotates from sample to
sample so no method always runs first). For every (sample, method) the harness records
time to first token, time per output token, whole-generation time, peak memory (reset
before each run), KV/aux bytes, % of prompt tokens computed and the scores; then it
aggregates per (task, length, method) with ratios against the mlx-lm baseline and against
our own unpruned path, and adds the cost model's predicted TTFT speedup beside the
measured one.

Methods are written as strings (:mod:`mlx_lazy.bench.methods`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import metrics, stats
from .common import (BASELINE, FULL, MIB, Method, RunRecord, jsonable, fmt, geomean,
                     machine_info, markdown_table, mean, measure, paired_ratios)
from ..folders import write_text_atomic
from ..adapter import num_layers
from .methods import parse_method
from .tasks import QUICK_TASKS, TASKS, Sample, build_prompt, build_suite

DEFAULT_METHODS: tuple[str, ...] = (BASELINE, FULL, "lazy", "speed", "lazy+speed", "static",
                                    "random")
# ----------------------------------------------------------------------------------------
# One measured run


def run_one(model: Any, tokenizer: Any, method: Method, sample: Sample, order: int = 0,
            max_tokens: int | None = None) -> RunRecord:
    """Generate greedily for one sample with one method, measure and score it."""
    r = measure(model, tokenizer, method, sample.tokens, max_tokens or sample.max_tokens)
    return dataclasses.replace(
        r, task=sample.task, length=sample.target_tokens, index=sample.index, order=order,
        score=metrics.score(r.prediction, sample.references, sample.match),
        scores=metrics.score_all(r.prediction, sample.references))


# ----------------------------------------------------------------------------------------
# Configuration and the main loop


@dataclass
class BenchConfig:
    """What to run (the CLI's options)."""

    model: str | None = None  # path or hub id; None -> the library's default SmolLM2
    tasks: tuple[str, ...] = tuple(TASKS)
    lengths: tuple[int, ...] = (512, 1024)
    samples: int = 5
    methods: tuple[str, ...] = DEFAULT_METHODS
    seed: int = 0
    max_tokens: int | None = None  # None -> each task's own budget
    out: str = "bench_out"
    warmup: bool = True
    progress: bool = True
    time_limit_s: float | None = None  # stop starting new samples after this many seconds
    agreement_prompts: int = 0  # prose prompts per length for teacher-forced agreement
    agreement_steps: int = 32  # steps along full's continuation per prompt

    @classmethod
    def quick(cls, **overrides: Any) -> "BenchConfig":
        """The ``--quick`` preset: short lengths, few samples, three tasks, 10-token answers.

        84 runs; under 10 minutes with SmolLM2 on 2 CPU cores.
        """
        base = dict(tasks=QUICK_TASKS, lengths=(512, 1024), samples=2, max_tokens=10)
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)


@dataclass
class BenchResult:
    """Raw runs plus their aggregation (what results.json holds)."""

    meta: dict[str, Any]
    samples: list[dict[str, Any]]
    runs: list[RunRecord]
    summary: list[dict[str, Any]] = field(default_factory=list)
    cost_model: dict[str, Any] | None = None
    agreement: list[dict[str, Any]] | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "meta": self.meta,
            "cost_model": self.cost_model,
            "agreement": self.agreement,
            "summary": self.summary,
            "samples": self.samples,
            "runs": [dataclasses.asdict(r) for r in self.runs],
        }


def run_bench(
    cfg: BenchConfig,
    model: Any = None,
    tokenizer: Any = None,
    log: Callable[[str], None] = print,
) -> BenchResult:
    """Build the suite, run every method on every sample (alternating), aggregate."""
    from tqdm.auto import tqdm

    if model is None or tokenizer is None:
        from .. import load

        model, tokenizer = load(cfg.model)
    methods = [parse_method(m, num_layers(model)) for m in cfg.methods]
    if not any(m.is_baseline for m in methods):
        methods.insert(0, parse_method(BASELINE))
    suite = build_suite(tokenizer, cfg.tasks, cfg.lengths, cfg.samples, cfg.seed)
    # Sample 0 of every (task, length) first, then sample 1, ...: a run stopped early by
    # the time limit (or Ctrl-C) still covers every cell.
    suite.sort(key=lambda s: s.index)
    log(f"bench: {len(suite)} samples x {len(methods)} methods "
        f"(tasks {', '.join(cfg.tasks)}; lengths {', '.join(map(str, cfg.lengths))})")
    if cfg.warmup and suite:
        # One untimed pass per method so first-call overheads do not land on sample 0.
        shortest = min(suite, key=lambda s: s.n_tokens)
        for m in methods:
            run_one(model, tokenizer, m, shortest, max_tokens=2)
    calibration = cost_model_runs(model, tokenizer, max(cfg.lengths)) if suite else []
    runs: list[RunRecord] = []
    done: list[Sample] = []
    stopped = None
    bar = tqdm(total=len(suite) * len(methods), disable=not cfg.progress, unit="run",
               desc="bench")
    t_start = time.perf_counter()
    try:
        for k, sample in enumerate(suite):
            if cfg.time_limit_s is not None and time.perf_counter() - t_start > cfg.time_limit_s:
                stopped = f"time limit of {cfg.time_limit_s:g} s reached"
                break
            rot = k % len(methods)
            sample_runs = []
            for order, m in enumerate(methods[rot:] + methods[:rot]):
                bar.set_postfix_str(f"{sample.task}@{sample.target_tokens} {m.name}"[:60])
                sample_runs.append(run_one(model, tokenizer, m, sample, order, cfg.max_tokens))
                bar.update(1)
            runs += sample_runs  # only complete samples: every method sees the same prompts
            done.append(sample)
    except KeyboardInterrupt:
        stopped = "interrupted"
    bar.close()
    if stopped:
        log(f"bench: stopped early ({stopped}) after {len(done)} of {len(suite)} samples")
    meta = {
        "model": cfg.model or "default (SmolLM2-135M-Instruct)",
        "config": jsonable(dataclasses.asdict(cfg)),
        "machine": machine_info(model, "mlx_lazy.bench"),
        "methods": {m.name: m.schedule() for m in methods},
        "n_layers": num_layers(model),
        "stopped_early": stopped,
        "samples_done": len(done),
        "samples_planned": len(suite),
    }
    result = BenchResult(meta=meta, samples=[s.as_dict() for s in done], runs=runs)
    result.cost_model = apply_cost_model(runs, calibration)
    result.summary = summarize(runs)
    if cfg.agreement_prompts and not stopped:
        result.agreement = teacher_forced(model, tokenizer, methods, cfg)
    return result


def teacher_forced(model: Any, tokenizer: Any, methods: Sequence[Method],
                   cfg: BenchConfig) -> list[dict[str, Any]]:
    """Teacher-forced top-1 agreement of every engine method with ``full`` along ``full``'s
    own greedy continuation of prose (:mod:`.fidelity`), per prompt length, with a Wilson
    interval over the steps."""
    from . import fidelity

    rows = []
    for length in cfg.lengths:
        refs = fidelity.references(model, tokenizer, length, cfg.agreement_prompts,
                                   cfg.agreement_steps)
        for m in methods:
            if m.is_baseline or m.name == FULL:
                continue
            rows.append({"method": m.name, "length": length,
                         **fidelity.agreement_summary(model, m.config, refs)})
    return rows


# ----------------------------------------------------------------------------------------
# Aggregation


def cost_model_runs(model: Any, tokenizer: Any, max_length: int,
                    fractions: Sequence[float] = (0.25, 0.5, 1.0)) -> list[RunRecord]:
    """Unpruned one-token runs on plain prose at spread-out lengths, for the cost-model fit.

    The benchmark's own prompts all sit near a few target lengths, too close together to
    separate the linear and quadratic terms; these runs add well-spaced points.
    """
    full = parse_method(FULL)
    runs = []
    for frac in fractions:
        n = max(16, round(frac * max_length))
        sample = Sample(task="costmodel", index=0, seed=0, target_tokens=n, prompt="",
                        tokens=tuple(build_prompt(tokenizer, n)), question="", references=("",),
                        match="any", depths=(), max_tokens=1)
        runs.append(run_one(model, tokenizer, full, sample))
    return runs


def apply_cost_model(runs: Sequence[RunRecord],
                     calibration: Sequence[RunRecord] = ()) -> dict[str, Any] | None:
    """Fit the speed helper's cost model on unpruned runs; predict every engine run's TTFT.

    The fit uses the benchmark's ``full`` runs plus the ``calibration`` runs
    (:func:`cost_model_runs`). Returns the coefficients (or why there is no fit) and fills
    ``RunRecord.predicted_ttft_s``.
    """
    try:
        from .costmodel import CostModel
    except ImportError:
        return {"error": "mlx_lazy.bench.costmodel is not available"}
    full = [r for r in runs if r.family == FULL] + list(calibration)
    try:
        model = CostModel.fit(full, [r.ttft_s for r in full])
    except ValueError as exc:
        return {"error": str(exc)}
    for r in runs:
        if r.family != BASELINE:
            r.predicted_ttft_s = model.predict(r)
    return {"fitted_on": f"{FULL} runs + {len(calibration)} prose calibration runs",
            "target": "ttft_s", **model.as_dict(),
            "calibration_runs": [{"prompt_tokens": r.prompt_tokens, "ttft_s": r.ttft_s}
                                 for r in calibration]}


def _sample(r: RunRecord) -> tuple[str, int, int]:
    return (r.task, r.length, r.index)


def paired_speedup(rs: Sequence[RunRecord], refs: Sequence[RunRecord], attr: str) -> float | None:
    """Geometric mean over samples of ``ref.attr / run.attr`` (> 1: the run is faster), each
    run paired with the reference method's run on the same sample (:func:`paired_ratios`)."""
    g = geomean(paired_ratios(rs, refs, attr, _sample))
    return None if g is None else 1 / g


def summarize(runs: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """Per (task, length, method) rows, plus ``task="all"`` rows pooled over tasks.

    Speedups are geometric means of per-sample paired ratios, reference time / method
    time (> 1 means faster; see :func:`paired_speedup`). Relative accuracy loss is
    (baseline − method) / baseline against the mlx-lm baseline's mean score.
    """
    groups: dict[tuple[str, int, str], list[RunRecord]] = defaultdict(list)
    by_method: dict[str, list[RunRecord]] = defaultdict(list)
    for r in runs:
        groups[(r.task, r.length, r.method)].append(r)
        groups[("all", r.length, r.method)].append(r)
        by_method[r.method].append(r)
    families = {r.method: r.family for r in runs}
    base_runs, full_runs = by_method[BASELINE], by_method[FULL]
    rows = []
    for (task, length, method), rs in groups.items():
        base = groups.get((task, length, BASELINE), [])
        row = _aggregate(rs)
        bs = _aggregate(base)["score"] if base else None
        row.update(
            task=task,
            length=length,
            method=method,
            family=families[method],
            baseline_score=bs,
            relative_accuracy_loss=(bs - row["score"]) / bs if bs else None,
            ttft_speedup=paired_speedup(rs, base_runs, "ttft_s"),
            tpot_speedup=paired_speedup(rs, base_runs, "tpot_s"),
            generation_speedup=paired_speedup(rs, base_runs, "total_s"),
            ttft_speedup_vs_full=paired_speedup(rs, full_runs, "ttft_s"),
            generation_speedup_vs_full=paired_speedup(rs, full_runs, "total_s"),
            predicted_ttft_speedup_vs_full=paired_speedup(rs, full_runs, "predicted_ttft_s"),
            score_ci=stats.wilson(sum(r.score for r in rs), len(rs)),
            vs_full=_paired_vs(rs, full_runs),
        )
        rows.append(row)
    order = {m: i for i, m in enumerate(dict.fromkeys(r.method for r in runs))}
    rows.sort(key=lambda x: (x["task"] == "all", x["task"], x["length"], order[x["method"]]))
    return rows


def _paired_vs(rs: Sequence[RunRecord], refs: Sequence[RunRecord]) -> dict[str, Any] | None:
    """Paired statistics (lost/won answers, relative loss with its bootstrap interval) of
    ``rs`` against the reference method's runs on the same samples."""
    by_sample = {_sample(r): r for r in refs}
    pairs = [(by_sample[k].score, r.score) for r in rs if (k := _sample(r)) in by_sample]
    if not pairs:
        return None
    p = stats.paired([a for a, _ in pairs], [b for _, b in pairs])
    return {"n": p.n, "lost": p.lost, "won": p.won, "rel_loss": p.rel_loss,
            "rel_loss_ci": list(p.rel_loss_ci)}


def prompt_layer_usage(r: RunRecord) -> list[float]:
    """Prompt token computations at each layer over the whole generation, as % of the
    prompt's tokens: above 100 where ``complete="exact"`` computed kept tokens a second time
    (its recompute).

    ``tokens_computed_per_layer`` also counts the generated tokens fed back in decode,
    which every method computes at full depth; their number is the last layer's count
    minus the prompt tokens that reached full depth.
    """
    per_layer = r.tokens_computed_per_layer
    if not per_layer or not r.prompt_tokens:
        return []
    full_depth = round(r.prompt_tokens_computed_pct / 100 * r.prompt_tokens)
    fed = max(0, per_layer[-1] - full_depth)
    return [100.0 * max(0, c - fed) / r.prompt_tokens for c in per_layer]


def prefill_work_pct(r: RunRecord) -> float:
    """Prefill token-layers computed, as % of the unpruned prefill (prompt × layers)."""
    n_layers = len(r.prefill_tokens_per_layer)
    return 100.0 * sum(r.prefill_tokens_per_layer) / max(r.prompt_tokens * n_layers, 1)


def _aggregate(rs: Sequence[RunRecord]) -> dict[str, Any]:
    usages = [prompt_layer_usage(r) for r in rs]
    n_layers = max(len(u) for u in usages)
    usage = [mean(u[i] for u in usages if i < len(u)) for i in range(n_layers)]
    return {
        "n": len(rs),
        "prompt_tokens": mean(r.prompt_tokens for r in rs),
        "score": mean(r.score for r in rs),
        "scores": {k: mean(r.scores[k] for r in rs) for k in metrics.MATCH_MODES},
        "ttft_s": mean(r.ttft_s for r in rs),
        "tpot_s": mean(r.tpot_s for r in rs),
        "total_s": mean(r.total_s for r in rs),
        "predicted_ttft_s": mean(r.predicted_ttft_s for r in rs),
        "prompt_tokens_computed_pct": mean(r.prompt_tokens_computed_pct for r in rs),
        "prefill_work_pct": mean(prefill_work_pct(r) for r in rs),
        "kv_bytes": mean(r.kv_bytes for r in rs),
        "aux_bytes": mean(r.aux_bytes for r in rs),
        "peak_memory_bytes": max(r.peak_memory_bytes for r in rs),
        "layer_usage_pct": usage,
    }


# ----------------------------------------------------------------------------------------
# Output


def write_results(result: BenchResult, out: str | Path) -> Path:
    """Write results.json under ``out`` (created if needed); return its path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    # a full disk leaves the old file, never a torn one
    write_text_atomic(path, json.dumps(jsonable(result.as_dict()), indent=1))
    return path


def load_results(path: str | Path) -> dict[str, Any]:
    """Read a results.json written by :func:`write_results`."""
    p = Path(path)
    return json.loads((p / "results.json" if p.is_dir() else p).read_text())


def render_table(result: dict[str, Any]) -> str:
    """Markdown tables shaped like the LazyLLM paper's Tables 1 and 2, per prompt length.

    Table 1: score (mlx-lm baseline → method) with its Wilson 95% interval, relative loss,
    answers lost / won against our unpruned path on the same samples, TTFT speedup vs mlx-lm, vs our
    unpruned path, and the cost model's predicted speedup vs our unpruned path.
    Table 2: % of prompt tokens computed (at every layer, by the end of the generation), %
    of the unpruned prefill work (token-layers), generation (end to end) speedup, TPOT
    speedup, KV / aux / peak memory.
    """
    meta = result["meta"]
    mach = meta["machine"]
    lines = [
        "# mlx-lazy benchmark",
        "",
        f"Model: {meta['model']} ({meta['n_layers']} layers). Machine: {mach['cpu']} "
        f"({mach['cpu_count']} cores), {mach['platform']}, mlx {mach['mlx']}, mlx-lm "
        f"{mach['mlx_lm']}, OpenBLAS: {'yes' if mach['openblas'] else 'no'}. Date: {mach['date']}.",
        f"Samples per (task, length): {meta['config']['samples']}; seed {meta['config']['seed']}; "
        "greedy decoding. Speedups are baseline time / method time (> 1 is faster).",
        "",
    ]
    if meta.get("stopped_early"):
        lines += [f"**Stopped early ({meta['stopped_early']}): {meta['samples_done']} of "
                  f"{meta['samples_planned']} samples done.**", ""]
    summary = result["summary"]
    for length in sorted({r["length"] for r in summary}):
        rows = [r for r in summary if r["length"] == length]
        table1 = markdown_table(
            ["Task", "Method", "Score (mlx-lm → method)", "95% CI", "Rel. loss",
             "lost / won vs full", "TTFT speedup vs mlx-lm", "vs full", "predicted vs full"],
            [[r["task"], r["method"], f"{fmt(r['baseline_score'])} → {fmt(r['score'])}",
              f"{r['score_ci'][0]:.2f}-{r['score_ci'][1]:.2f}" if r.get("score_ci") else None,
              fmt(r["relative_accuracy_loss"], ".1%"),
              f"{r['vs_full']['lost']} / {r['vs_full']['won']}" if r.get("vs_full") else None,
              fmt(r["ttft_speedup"], suffix="×"), fmt(r["ttft_speedup_vs_full"], suffix="×"),
              fmt(r["predicted_ttft_speedup_vs_full"], suffix="×")] for r in rows])
        table2 = markdown_table(
            ["Task", "Method", "% prompt tokens computed", "% prefill work", "Generation speedup",
             "TPOT speedup", "KV MiB", "Aux MiB", "Peak MiB"],
            [[r["task"], r["method"], fmt(r["prompt_tokens_computed_pct"], ".1f", suffix="%"),
              fmt(r["prefill_work_pct"], ".1f", suffix="%"),
              fmt(r["generation_speedup"], suffix="×"), fmt(r["tpot_speedup"], suffix="×"),
              fmt(r["kv_bytes"], ".1f", MIB), fmt(r["aux_bytes"], ".1f", MIB),
              fmt(r["peak_memory_bytes"], ".1f", MIB)] for r in rows])
        lines += [f"## Prompt length ≤ {length} tokens", "",
                  "Table 1 — accuracy and time to first token", "", table1, "",
                  "Table 2 — prompt tokens computed and whole-generation time", "", table2, ""]
    agreement = result.get("agreement")
    if agreement:
        lines += ["Teacher-forced top-1 agreement with `full` along its own greedy continuation "
                  "of prose:", "",
                  markdown_table(["Length", "Method", "Agreement", "95% CI", "Steps"],
                                 [[a["length"], a["method"], f"{a['rate']:.3f}",
                                   f"{a['ci'][0]:.3f}-{a['ci'][1]:.3f}", a["steps"]]
                                  for a in agreement]), ""]
    cm = result.get("cost_model")
    if cm and "a" in cm:
        lines += [f"Cost model (fitted on {cm['n_samples']} unpruned runs: "
                  f"{cm['fitted_on']}; TTFT): "
                  f"t = {cm['a']:.3g}·token_layers + {cm['b']:.3g}·attention_pairs "
                  f"+ {cm['c']:.3g} s "
                  f"(RMS relative residual {cm['rms_relative_residual']:.1%}).", ""]
    elif cm:
        lines += [f"Cost model: not fitted ({cm.get('error')}).", ""]
    return "\n".join(lines)
