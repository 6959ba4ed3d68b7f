"""Calibrate a LazyLLM schedule for one model: ``python -m mlx_lazy.calibrate``.

1. **Cells.** The offline tasks at each ``--lengths`` value. The unpruned path (``full``) runs
   on the first ``--pilot`` samples of each cell; only cells where it scores ≥ ``--min-base``
   (0.8) are used, since a loss is only measurable where the model can do the task.
2. **Candidates.** Scorers × cut schedules (cuts at fractions of the depth, keep fractions;
   on a model with sliding-window layers each cut moves to the nearest global one),
   ranked by the pruning gain (our unpruned prefill ÷ the pruned one) that the cost model
   predicts at ``--gain-length`` tokens from the schedule alone, so ranking needs no timing
   on a busy machine.
3. **Successive halving.** Candidates run best predicted gain first on the first
   ``rungs[0]`` samples of each cell; the first ``--keep-per-rung`` of them within the loss
   allowance go on to ``rungs[1]`` samples (the rest wait), and so on. The last rung (≥ 50
   samples per cell) confirms: a schedule is **admissible** when its paired relative loss
   against ``full`` pooled over the cells is ≤ ``--max-loss`` and its mean KL divergence from
   ``full`` along ``--kld-steps`` (128) steps of full's own continuation (``--kld-windows``
   windows of prose and of code, :mod:`.fidelity`) is ≤ ``--max-kld``: a number, or ``q4`` /
   ``q8``, the mean KLD of the model with its weights rounded through 4- / 8-bit
   quantization on the same windows (:mod:`.yardstick`). The fastest admissible schedule is
   the default one; the fastest whose KLD is also ≤ a quarter of the 4-bit yardstick's is
   the ``high`` quality one (``--qualities`` names the ones sought: ``default`` alone ends
   the run at the first admissible schedule). When the last rung leaves one unfound, the
   next batch of candidates starts at rung 0 where the first stopped. ``--resume`` reuses an
   earlier run's samples in ``--out``.
4. **Evidence.** Per cell and pooled: paired lost/won counts, Wilson intervals, a paired
   bootstrap interval of the relative loss; mean and p99 KLD and same-top-1 with bootstrap
   intervals, beside both yardsticks; predicted gain at ``--gain-length`` for every candidate
   and (unless ``--no-measure``) the measured gain of every candidate that reached the last
   rung, that of the whole ``--gain-answer-tokens`` answer (what a user waits for) with the
   first token's beside it: the frontier, prediction beside measurement.

Writes into ``--out`` (default: ``~/.cache/mlx_lazy/calibration/<fingerprint digest>``):
``results.json`` (every run, replaced atomically after each candidate), ``report.md``,
``pareto.png`` and, for each quality found, ``schedule.json`` / ``schedule.high.json`` (load
one with ``--schedule`` or ``mlx_lazy.read_schedule``). Without ``--out`` (or with
``--install``) the schedules are also installed where ``mlx_lazy.load`` finds them: into a
writable model folder as ``mlx_lazy_schedule.json`` / ``mlx_lazy_schedule.high.json``, else
(a named model, a hub id, a read-only folder) into ``~/.cache/mlx_lazy/schedules/`` by
fingerprint; one whose measured whole answer came later than ``full``'s is not installed.
A ``--time-limit`` (``1800``, ``30m``, ``2h``), Ctrl-C or SIGTERM stops it
early: the files then hold what was measured (a rung or pilot left unfinished is marked
partial; a schedule already confirmed is still written; exit status 130 after an interrupt)
and ``--resume`` continues from them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from .. import _blas  # noqa: F401  (OpenBLAS before mlx.core)
from .. import PruningConfig, build_schedule, load
from ..adapter import ModelAdapter, global_layers, num_layers, recurrent_layers
from ..api import context_length
from .._args import OneLineParser, complete_arg
from ..errors import UserInputError
from ..folders import make_folder, output_folder, write_text_atomic
from ..scorers import parse_scorer, scorer_spec
from ..selection import keep_floor
from .. import completion
from ..completion import COMPLETE_MODES, parse_completion
from ..config import MAX_MARGIN, QUALITIES
from ..inputs import MAX_COUNT
from ..policies import at_global_layers, layers_at
from ..resolve import check_hybrid
from ..schedule_files import (DECODE_FIELDS, MODEL_SCHEDULE_FILE, cached_schedule_path,
                               fingerprint_digest, schedule_file_name, write_schedule)
from . import fidelity, stats, yardstick
from .calibration_results import measured_floor, report, used_cells
from .costmodel import predicted_counts, prior
from .common import Method, jsonable, loadavg, median
from .harness import run_one
from .methods import method_spec
from .progress import Progress, Rates, duration
from .tasks import TASKS, build_prompt, build_samples

#: Scorers tried (specs, :func:`mlx_lazy.scorers.parse_scorer`).
SCORER_GRID: tuple[str, ...] = (
    "last",
    "window:size=8",
    "window:size=16",
    "window:size=8:pool=3",
    "window:size=8:heads=max",
    "window:size=32:pool=8",  # covers a chat question; 17-token spans
)
#: Cut schedules tried: (depth fractions, keep fractions). Single cuts are FastKV's "token
#: propagation" layer; the last is the uncalibrated preset.
CUT_GRID: tuple[tuple[tuple[float, ...], tuple[float, ...]], ...] = (
    ((0.2, 0.4, 0.6, 0.8), (0.6, 0.4, 0.25, 0.15)),
    ((0.25,), (0.3,)),
    ((0.25, 0.5), (0.5, 0.3)),
    ((0.25, 0.55), (0.5, 0.2)),
    ((0.4,), (0.25,)),
    ((0.4, 0.55), (0.5, 0.2)),
    ((1 / 3, 2 / 3), (0.5, 0.25)),
    ((0.4, 0.7), (0.4, 0.2)),
    ((0.5,), (0.2,)),
    ((0.5, 0.75), (0.3, 0.15)),
    ((0.6, 0.8), (0.3, 0.15)),
    ((0.7, 0.85), (0.25, 0.15)),
)
DEFAULT_TASKS = ("passkey", "niah_single", "niah_multikey")
#: The longest ``--lengths`` value taken before the model is known (2**20 tokens, beyond any
#: model's context here); once it loads, its own context is the bound.
MAX_LENGTH = 2**20
#: The fewest tokens a cut keeps while calibrating (and replaying, bench.variant): none, so a
#: cut keeps its fraction of the short prompts that stand for long ones; recorded in the
#: evidence as ``min_keep``.
MIN_KEEP_MEASURED = 0
#: Candidates decode as a plain ``lazy`` does unless ``--complete`` says otherwise.
DEFAULT_COMPLETE = completion.DEFAULT_COMPLETE


@dataclass
class Candidate:
    """One schedule under test."""

    name: str
    config: PruningConfig
    predicted_gain: float
    token_layers_pct: float
    scores: dict[str, list[float]] = field(default_factory=dict)  # cell -> per-sample scores
    rung: int = 0  # the rung it reached (its samples fall short when a run stopped mid-rung)
    dropped_at: Optional[int] = None
    measured_gain: Optional[dict[str, Any]] = None  # measure_gain(), last-rung candidates only
    kld: Optional[dict[str, Any]] = None  # Deviation.measure(), once accurate at the last rung
    min_keep: Optional[int] = MIN_KEEP_MEASURED  # the floor it was measured under (None: 256)

    def config_dict(self) -> dict[str, Any]:
        """The config as results.json holds it (fields set, JSON-friendly)."""
        return {k: v for k, v in self.config.as_dict().items() if v is not None}

    def as_dict(self) -> dict[str, Any]:
        d = jsonable(asdict(self))
        d["config"] = self.config_dict()
        return d


def candidates(model: Any, gain_length: int,
               scorer_grid: Sequence[str] = SCORER_GRID,
               cut_grid: Sequence[tuple[tuple[float, ...], tuple[float, ...]]] = CUT_GRID,
               decode: Optional[dict[str, Any]] = None) -> list[Candidate]:
    """Every scorer × cut schedule for ``model``, best predicted gain first, each decoding
    as ``decode`` says (:data:`~mlx_lazy.schedule_files.DECODE_FIELDS` of PruningConfig; the
    ``complete`` mode defaults to the library's; a hybrid model's candidates revive
    nothing, :func:`~mlx_lazy.adapter.recurrent_layers`): none of them changes the
    prefill, hence the predicted gain.

    Raises:
        UserInputError: on a hybrid model, ``decode`` naming a revival setting
            (:func:`~mlx_lazy.resolve.check_hybrid`), or no layer a cut may follow (Falcon-H1's
            attention beside Mamba-2 in every layer).
    """
    decode = dict(decode or {})
    cut_after = global_layers(model)
    if recurrent_layers(model):
        check_hybrid(PruningConfig("lazy", **decode))
        decode["revive"] = False
        if not cut_after:
            raise UserInputError("this hybrid model has no layer a cut may follow (attention "
                                 "alone, not in its last layer): nothing to calibrate; run "
                                 "speed, random or full")
    else:
        decode["complete"] = decode.get("complete") or DEFAULT_COMPLETE
    n_layers = num_layers(model)
    cost = prior(model)
    full = build_schedule(PruningConfig("full"), n_layers)
    full_counts = predicted_counts(full, gain_length)
    full_t = cost.predict(full_counts)
    out = []
    for fracs, keep in cut_grid:
        layers = at_global_layers(layers_at(fracs, n_layers), cut_after)
        for scorer in scorer_grid:
            config = PruningConfig("lazy", prune_layers=layers, keep=keep[: len(layers)],
                                   scorer=scorer, **decode)
            sched = build_schedule(config, n_layers)
            c = predicted_counts(sched, gain_length)
            out.append(Candidate(
                name=method_spec(config), config=config, predicted_gain=full_t / cost.predict(c),
                token_layers_pct=100 * c.token_layers / full_counts.token_layers))
    unique = {c.name: c for c in out}  # on shallow models cut positions may collide
    return sorted(unique.values(), key=lambda c: -c.predicted_gain)


#: Spellings of ``--max-kld`` that name a yardstick: the mean KLD of the model with its
#: weights rounded through that many bits.
YARDSTICKS = {fidelity.yardstick_row(b): b for b in yardstick.BITS}
#: The ``high`` quality's bar: this fraction of the 4-bit yardstick's mean KLD.
HIGH_FRACTION = 0.25


def valid_max_kld(value: Any) -> bool:
    """Whether ``value`` is a ``max_kld``: a yardstick name or a finite number >= 0."""
    if isinstance(value, str):
        return value in YARDSTICKS
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0)


def parse_max_kld(text: str) -> Union[float, str]:
    """``--max-kld``: a yardstick name (``q4``, ``q8``) or a non-negative number."""
    text = text.strip()
    try:
        value: Union[float, str] = text if text in YARDSTICKS else float(text)
    except ValueError:
        value = text
    if not valid_max_kld(value):
        raise argparse.ArgumentTypeError(
            f"--max-kld takes a non-negative number or {' / '.join(YARDSTICKS)}, got {text!r}")
    return value


def parse_duration(text: str) -> float:
    """``--time-limit``: seconds, or a number with ``s``, ``m`` or ``h`` (``30m``, ``2h``)."""
    unit = {"s": 1, "m": 60, "h": 3600}.get(text.strip()[-1:].lower())
    try:
        return float(text.strip()[:-1] if unit else text) * (unit or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--time-limit takes seconds or a duration like 30m or 2h, got {text!r}") from None


@dataclass
class Calibration:
    """Options of one calibration (the command's flags)."""

    model: Optional[str] = None
    out: Optional[str] = None  # None: the cache, by model fingerprint
    tasks: tuple[str, ...] = DEFAULT_TASKS
    lengths: tuple[int, ...] = (1024,)
    rungs: tuple[int, ...] = (6, 20, 50)
    keep_per_rung: tuple[int, ...] = (8, 3)
    pilot: int = 10
    min_base: float = 0.8
    max_loss: float = 0.01
    gain_length: int = 4096
    scorers: tuple[dict[str, Any], ...] = SCORER_GRID
    cuts: tuple[tuple[tuple[float, ...], tuple[float, ...]], ...] = CUT_GRID
    max_kld: Union[float, str] = "q4"
    kld_windows: int = 8  # per kind of text
    kld_length: int = 700  # tokens per window; the gain length checks drift where speed is claimed
    kld_steps: int = 128  # the whole answer's drift: over 32 steps Qwen's passed, over 128 not
    install: bool = False  # also where mlx_lazy.load finds it (the model folder or the cache)
    measure: bool = True
    gain_repeats: int = 1
    gain_answer_tokens: int = 128  # the measured gain is the whole answer's, this long
    time_limit_s: Optional[float] = None
    seed: int = 0
    resume: bool = False
    # how candidates decode (the evidence holds only for it); None: the library's default
    # (exact; a hybrid model's candidates revive nothing)
    complete: Optional[str] = None
    max_revivals: Optional[int] = None  # a decode step's revivals per cut (None: unbounded)
    revive_margin: Optional[float] = None  # a revival's score handicap (None: the paper's 0)
    reselect_every: Optional[int] = None  # decode steps per re-selection (None: 1, the paper)
    qualities: tuple[str, ...] = QUALITIES  # the schedules sought; found all, the run ends

    def decode(self) -> dict[str, Any]:
        """How the candidates decode: the :data:`DECODE_FIELDS` of their configs."""
        return {f: getattr(self, f) for f in DECODE_FIELDS}

    def check(self) -> None:
        """Raise UserInputError naming the first option outside its domain."""
        bad = [t for t in self.tasks if t not in TASKS]
        rungs, top, limit = self.rungs, max(self.rungs, default=1), self.time_limit_s
        complete = self.complete and parse_completion(self.complete).spec  # canonical
        why = next((message for failed, message in [
            (self.out == "", "--out is empty; give a folder (or leave it out: "
                             "~/.cache/mlx_lazy/calibration/<fingerprint digest>)"),
            (not self.tasks or bad, f"unknown task {(bad or [''])[0]!r} (choose from "
                                    f"{', '.join(TASKS)})"),
            (not self.lengths or min(self.lengths) < 1,
             "--lengths needs prompt lengths >= 1 token"),
            (max(self.lengths, default=0) > MAX_LENGTH,
             f"--lengths takes prompt lengths of at most {MAX_LENGTH:,} tokens, got "
             f"{max(self.lengths, default=0):,}"),
            (not rungs or min(rungs) < 1 or list(rungs) != sorted(set(rungs)),
             "--rungs needs increasing sample counts >= 1, e.g. 6,20,50"),
            (any(k < 1 for k in self.keep_per_rung), "--keep-per-rung values must be >= 1"),
            (not 1 <= self.pilot <= top, f"--pilot must be in [1, {top}] (the pilot runs on "
                                         "the rungs' samples)"),
            (not 0 <= self.min_base <= 1, "--min-base must be in [0, 1]"),
            (not 0 <= self.max_loss < 1, "--max-loss must be in [0, 1)"),
            (not valid_max_kld(self.max_kld),
             f"--max-kld takes a non-negative number or {' / '.join(YARDSTICKS)}"),
            (self.gain_length < 1, "--gain-length must be >= 1 token"),
            (self.gain_repeats < 1, "--gain-repeats must be >= 1"),
            (not 1 <= self.gain_answer_tokens <= MAX_COUNT,
             f"--gain-answer-tokens must be in [1, {MAX_COUNT:,}]"),
            (self.kld_windows < 1, "--kld-windows must be >= 1"),
            (not 2 <= self.kld_length <= MAX_LENGTH,
             f"--kld-length must be in [2, {MAX_LENGTH:,}] tokens"),
            (not 1 <= self.kld_steps <= MAX_COUNT,
             f"--kld-steps must be in [1, {MAX_COUNT:,}]"),
            (limit is not None and not (math.isfinite(limit) and limit > 0),
             "--time-limit must be a positive number of seconds"),
            (not self.scorers or not self.cuts, "--scorers and --cuts need at least one value"),
            (self.complete != complete, f"complete must be spelt {complete!r}"),
            (self.max_revivals is not None and not 0 <= self.max_revivals <= MAX_COUNT,
             f"--max-revivals must be an integer in [0, {MAX_COUNT:,}]"),
            (self.revive_margin is not None and not 0 <= self.revive_margin <= MAX_MARGIN,
             f"--revive-margin must be a number in [0, {MAX_MARGIN:g}]"),
            (self.reselect_every is not None and not 1 <= self.reselect_every <= MAX_COUNT,
             f"--reselect-every must be an integer in [1, {MAX_COUNT:,}]"),
            (not self.qualities or list(self.qualities) != [q for q in QUALITIES
                                                             if q in self.qualities],
             f"--qualities takes one or both of {', '.join(QUALITIES)}, in that order"),
        ] if failed), None)
        if why:
            raise UserInputError(why)


class Deviation:
    """Mean KL divergence from ``full`` along full's own greedy continuation, on fixed
    windows of each kind of text (:data:`.fidelity.KINDS`): of candidate schedules, and of
    the quantization yardsticks (:data:`YARDSTICKS`) on the same windows. The windows and
    full's runs are made on first use, the yardsticks once."""

    def __init__(self, model: Any, tokenizer: Any, windows: int, length: int, steps: int):
        self.model, self.tokenizer = model, tokenizer
        self.windows, self.length, self.steps = windows, length, steps
        self.texts: dict[str, Any] = {}  # kind -> what the windows came from
        self._refs: list[tuple[list[int], fidelity.Continuation]] = []
        self.yardsticks: dict[str, dict[str, Any]] = {}
        # Seconds and windows by how a row runs: "stepped" (full's references and candidates,
        # a prefill then a decode step per forced token) or "forward" (the yardsticks, one
        # forward pass per window, fidelity.forced_forward): their times per window differ.
        self.seconds = {"stepped": 0.0, "forward": 0.0}
        self.counts = {"stepped": 0, "forward": 0}
        #: Called as ``on_window(row, done, total)`` after each window of a row.
        self.on_window: Callable[[str, int, int], None] = lambda row, done, total: None

    def _runs(self, row: str, windows: Sequence[Any], one: Callable[[Any], Any]) -> list[Any]:
        """``one(window)`` for every window of a row, timed and reported."""
        runs, how = [], "forward" if row in YARDSTICKS else "stepped"
        for window in windows:
            tic = time.perf_counter()
            runs.append(one(window))
            self.seconds[how] += time.perf_counter() - tic
            self.counts[how] += 1
            self.on_window(row, len(runs), len(windows))
        return runs

    @property
    def prefills(self) -> int:
        """Windows run, each ``length`` tokens then ``steps`` forced steps."""
        return sum(self.counts.values())

    def rows_left(self) -> dict[str, int]:
        """Rows of windows not yet run that every schedule's bars need, by how they run:
        full's references ("stepped") and the yardsticks ("forward")."""
        return {"stepped": int(not self._refs),
                "forward": len(YARDSTICKS) - len(self.yardsticks)}

    def window_s(self, how: str) -> Optional[float]:
        """Mean seconds per window so far of the rows that run ``how`` ("stepped" or
        "forward"; None before any)."""
        return self.seconds[how] / self.counts[how] if self.counts[how] else None

    def references(self) -> list[tuple[list[int], fidelity.Continuation]]:
        """Every window with ``full``'s run along it."""
        if not self._refs:
            prompts = []
            for kind in fidelity.KINDS:
                windows, self.texts[kind] = fidelity.text_windows(
                    self.tokenizer, fidelity.kind_files(kind), self.windows, self.length)
                prompts += windows
            refs = self._runs("full", prompts,
                              lambda p: fidelity.continuation(self.model, p, self.steps))
            self._refs = list(zip(prompts, refs))
        return self._refs

    def measure(self, config: Optional[PruningConfig], model: Any = None,
                row: str = "candidate") -> dict[str, Any]:
        """:func:`.fidelity.row_summary` of ``config`` on ``model`` (default: the model)
        teacher-forced along every reference; ``row`` names it in progress reports."""
        def one(window: tuple[list[int], fidelity.Continuation]) -> Any:
            prompt, ref = window
            return fidelity.compare(ref, fidelity.continuation(
                model or self.model, prompt, self.steps, config, forced=ref.tokens))
        return fidelity.row_summary(self._runs(row, self.references(), one))

    def bars(self, max_kld: Union[float, str]) -> dict[str, float]:
        """The largest mean KLD of each quality: ``max_kld`` (a yardstick's, by name) for the
        default one; at most :data:`HIGH_FRACTION` of the 4-bit yardstick's for ``high``."""
        for row, bits in YARDSTICKS.items():
            if row not in self.yardsticks:
                self.yardsticks[row] = self.measure(
                    None, yardstick.round_weights(self.model, bits), row=row)
        default = (self.yardsticks[max_kld]["kld_mean"] if isinstance(max_kld, str)
                   else float(max_kld))
        q4 = self.yardsticks[fidelity.yardstick_row(4)]["kld_mean"]
        return {"default": default, "high": min(default, HIGH_FRACTION * q4)}


class _OutOfTime(Exception):
    pass


def run(cal: Calibration) -> dict[str, Any]:
    """Calibrate; write the outputs into ``cal.out``; return the results document.

    Every cut keeps its fraction of the prompt, however short (:data:`MIN_KEEP_MEASURED`):
    the evidence is of the schedule as it prunes a long prompt. A time limit or a
    KeyboardInterrupt stops it early: the outputs then hold what was measured
    (``doc["stopped"]`` says why) and ``resume=True`` continues from them.

    Raises:
        UserInputError: an option outside its domain, an unwritable ``out``, lengths too
            short for a task, no cell the unpruned path can do, or a ``resume`` of another
            calibration.
    """
    with keep_floor(MIN_KEEP_MEASURED), (contextlib.nullcontext() if cal.out is None
                                         else output_folder(Path(cal.out))):
        return _calibrate(cal)


def _calibrate(cal: Calibration) -> dict[str, Any]:
    cal.check()
    start = time.monotonic()
    started = time.perf_counter()  # the run's wall time, for the work record
    if cal.out is not None:  # before the model loads: a bad --out fails at once
        _prepare_out(Path(cal.out), cal.resume)
    model, tokenizer = load(cal.model)
    yardstick.check_unquantized(model)  # the KLD bars come from rounding its weights
    context = context_length(model, tokenizer)
    if context is not None and max(cal.lengths) > context:  # before any prompt is built
        raise UserInputError(f"--lengths {max(cal.lengths):,} is beyond the model's context of "
                             f"{context:,} tokens")
    if context is not None and cal.kld_length + cal.kld_steps > context:
        raise UserInputError(f"--kld-length {cal.kld_length:,} and --kld-steps "
                             f"{cal.kld_steps:,} are beyond the model's context of "
                             f"{context:,} tokens")
    cands = candidates(model, cal.gain_length, cal.scorers, cal.cuts, cal.decode())
    if cal.measure and context is not None \
            and cal.gain_length + cal.gain_answer_tokens > context:  # else refused at the end
        raise UserInputError(f"--gain-length {cal.gain_length:,} and --gain-answer-tokens "
                             f"{cal.gain_answer_tokens:,} are beyond the model's context of "
                             f"{context:,} tokens (lower --gain-length, or --no-measure)")
    fingerprint = ModelAdapter(model).fingerprint()
    if cal.out is not None:
        out = Path(cal.out)
    else:  # the default work folder, known once the model is
        out = work_folder(fingerprint)
        _prepare_out(out, cal.resume)
    n_max = max(cal.rungs)
    try:
        samples = {f"{t}@{n}": build_samples(tokenizer, t, n, n_max, cal.seed)
                   for t in cal.tasks for n in cal.lengths}
    except ValueError as e:  # a length too short for a task's question and needles
        raise UserInputError(str(e)) from None
    doc: dict[str, Any] = {"options": asdict(cal), "fingerprint": fingerprint, "cells": {},
                           "full": {}, "candidates": [], "yardsticks": {}, "bars": None,
                           "chosen": {}, "installed": {}, "out": str(out), "complete": False,
                           "stopped": None, "min_keep": MIN_KEEP_MEASURED}

    def check_time() -> None:
        if cal.time_limit_s is not None and time.monotonic() - start > cal.time_limit_s:
            raise _OutOfTime

    # counted here; the time and the KLD windows' counts are filled in by save()
    work = doc["work"] = {"retrieval_prefills": 0, "retrieval_prompt_tokens": 0,
                          "gain_prompt_tokens": 0}

    progress = Progress(cal.time_limit_s, goal="next schedule")
    rates = Rates()  # seconds per retrieval run (by method), full's per prompt token and step
    current: list[Candidate] = cands[:1]  # the candidate under test, for the ETA

    def score(config: Optional[PruningConfig], cell: str, i: int) -> float:
        check_time()
        method = Method("full" if config is None else method_spec(config),
                        config or PruningConfig())
        work["retrieval_prefills"] += 1
        work["retrieval_prompt_tokens"] += len(samples[cell][i].tokens)
        tic = time.perf_counter()
        record = run_one(model, tokenizer, method, samples[cell][i])
        rates.add(method.name, time.perf_counter() - tic)
        if config is None:
            rates.add("prefill token", record.ttft_s, record.prompt_tokens)
            if record.tpot_s is not None:
                rates.add("step", record.tpot_s)
        return record.score

    full: dict[str, list[float]] = {}

    def full_scores(cell: str, n: int) -> list[float]:
        have = full.setdefault(cell, [])
        while len(have) < n:
            have.append(score(None, cell, len(have)))
            progress.update(f"full {cell}", len(have), n, eta())
        return have[:n]

    deviation = Deviation(model, tokenizer, cal.kld_windows, cal.kld_length, cal.kld_steps)
    doc["yardsticks"], doc["kld_texts"] = deviation.yardsticks, deviation.texts  # on first use
    deviation.on_window = lambda row, done, total: progress.update(
        f"KLD windows, {row}", done, total, eta())

    def eta() -> Optional[float]:
        """Seconds until the candidate under test would be confirmed, if it passes: its
        retrieval runs and full's still to do, the KLD rows, the measured gain. Kinds of work
        not yet timed are scaled from full's prefill time per token and decode step."""
        per_token, step = rates.mean("prefill token"), rates.mean("step") or 0.0
        if per_token is None or not current:
            return None
        cand, n = current[0], max(cal.rungs)
        cells_now = used_cells(doc) or list(samples)
        t_full = rates.mean("full") or 0.0
        t_cand = rates.mean(cand.name) or t_full / cand.predicted_gain
        left = sum(max(0, n - len(full.get(c, []))) * t_full
                   + max(0, n - len(cand.scores.get(c, []))) * t_cand for c in cells_now)
        stepped = (deviation.window_s("stepped")
                   or cal.kld_length * per_token + cal.kld_steps * step)
        forward = deviation.window_s("forward") or (cal.kld_length + cal.kld_steps) * per_token
        rows = deviation.rows_left()
        left += cal.kld_windows * len(fidelity.KINDS) * (
            (rows["stepped"] + (cand.kld is None)) * stepped + rows["forward"] * forward)
        if cal.measure and cand.measured_gain is None:
            prefill = cal.gain_length * per_token
            answer = cal.gain_answer_tokens * step
            gain = rates.mean("gain") or (2 * answer + prefill * (1 + 1 / cand.predicted_gain))
            left += cal.gain_repeats * gain
        return left

    def bars() -> dict[str, float]:
        check_time()
        doc["bars"] = deviation.bars(cal.max_kld)
        return doc["bars"]

    def save() -> None:
        """Write the outputs (after every candidate: ``--resume`` loses nothing), with the
        work this run has done so far: time it on another machine by its prefill speed."""
        work.update(seconds=round(time.perf_counter() - started, 1),
                    kld_prefills=deviation.prefills,
                    kld_prompt_tokens=deviation.prefills * cal.kld_length,
                    kld_forced_steps=deviation.prefills * cal.kld_steps)
        _write(out, doc, full, cells)

    doc["candidates"] = cands
    if cal.resume:
        _resume(out, cal, fingerprint, full, cands, deviation, doc, progress)
    last = len(cal.rungs) - 1
    try:
        # 1. cells where the unpruned path can do the task
        for cell in samples:
            base = full_scores(cell, cal.pilot)
            doc["cells"][cell] = {"pilot_base": sum(base) / len(base),
                                  "used": sum(base) / len(base) >= cal.min_base}
            progress.log(f"pilot {cell}: full {sum(base):.0f}/{len(base)}")
        cells = used_cells(doc)
        if not cells:
            raise UserInputError(
                f"full scores < {cal.min_base:.0%} on every cell; choose shorter --lengths or "
                "other --tasks where this model can do the task")
        first, left = eta(), progress.left_s()
        if left is not None and first is not None:
            progress.log(f"at this pace the first schedule needs ≈{duration(first)}; the time "
                         f"limit leaves {duration(left)}"
                         + ("" if first <= left else ": expect none (fewer --tasks, --lengths "
                            "or --cuts, or a longer --time-limit)"))
        # 2-3. successive halving in batches, best predicted gain first: a batch is what rung
        # 0 takes in; while the last rung leaves a quality unfound, the next batch starts
        # where rung 0 stopped, until every quality is found or no candidate is left.
        pending = list(cands)
        while pending and len(_choose(cands, cells, cal, doc["bars"])) < len(cal.qualities):
            alive = pending
            for r, n in enumerate(cal.rungs):
                passing, tried = [], 0
                for cand in alive:
                    tried += 1
                    cand.rung = r
                    current[:] = [cand]
                    stage = f"rung {r} {cand.name}"
                    for cell in cells:
                        have = cand.scores.setdefault(cell, [])
                        while len(have) < n:
                            have.append(score(cand.config, cell, len(have)))
                            progress.update(stage, sum(len(cand.scores.get(c, [])[:n])
                                                       for c in cells), n * len(cells), eta())
                    p = _pooled(full_scores, cand, cells, n)
                    ok = within_loss(p, cal.max_loss, last=r == last)
                    if ok and r == last:
                        if cand.kld is None:
                            check_time()
                            cand.kld = deviation.measure(cand.config)
                        ok = cand.kld["kld_mean"] <= bars()["default"]
                    progress.log(f"rung {r} n={n} {cand.name}: gain {cand.predicted_gain:.2f}x "
                         f"lost {p.lost} won {p.won} rel loss {p.rel_loss:+.3f}"
                         + (f" KLD {cand.kld['kld_mean']:.4f} (bars "
                            + ", ".join(f"{q} {b:.4f}" for q, b in doc["bars"].items()) + ")"
                            if r == last and cand.kld and doc["bars"] else "")
                         + ("" if ok else " (dropped)"))
                    if ok:
                        passing.append(cand)
                    else:
                        cand.dropped_at = r
                    save()
                    # Candidates are in predicted-gain order: once a rung has as many passing
                    # as go on (at the last rung: every quality found), the rest could not
                    # be chosen.
                    if r == last:
                        if len(_choose(cands, cells, cal, doc["bars"])) == len(cal.qualities):
                            break
                    elif len(passing) >= (cal.keep_per_rung[r] if r < len(cal.keep_per_rung)
                                          else len(alive)):
                        break
                if r == 0:
                    pending = alive[tried:]
                alive = passing
                save()
                if not alive:
                    break
        # 4. the frontier's measured gain, beside the predicted one
        for cand in _final(cands, cells, cal) if cal.measure else []:
            if cand.measured_gain is None:
                check_time()
                progress.log(f"timing {cand.name} against full at {cal.gain_length:,} tokens")
                g = cand.measured_gain = measure_gain(
                    model, tokenizer, cand.config, cal.gain_length, cal.gain_repeats,
                    cal.gain_answer_tokens)
                rates.add("gain", sum(g["full_s"]) + sum(g["pruned_s"]), cal.gain_repeats)
                work["gain_prompt_tokens"] += 2 * cal.gain_repeats * cal.gain_length
                progress.log(f"measured gain {cand.name}: {g['gain']:.2f}x whole answer, "
                             f"{g['first_token_gain']:.2f}x first token "
                             f"(predicted {cand.predicted_gain:.2f}x)")
                save()
        doc["complete"] = True
    except _OutOfTime:
        doc["stopped"] = f"time limit of {cal.time_limit_s:g} s"
    except KeyboardInterrupt:
        doc["stopped"] = "interrupted"
    if doc["stopped"]:
        progress.log(f"stopped ({doc['stopped']}): writing what was measured")
    cells = used_cells(doc)
    # A schedule confirmed before a stop stays the fastest admissible one: candidates reach
    # the last rung in predicted-gain order, every faster one was dropped.
    for quality, cand in _choose(cands, cells, cal, doc["bars"]).items():
        evidence = _evidence(cal, cand, full_scores, cells, quality, doc, deviation)
        doc["chosen"][quality] = {"name": cand.name, **evidence}
        path = write_schedule(out / schedule_file_name("schedule", quality), cand.config,
                              fingerprint, evidence, str(cal.model or "default"), quality)
        progress.log(f"{quality} quality: {cand.name}, wrote {path}")
        slower = slower_than_full(cand)
        if slower:
            doc["chosen"][quality]["not_installed"] = slower
            progress.log(f"warning: {quality} quality: {slower}; to use it anyway, "
                         f"--schedule {path}")
        elif cal.install:
            target = install_path(cal.model, fingerprint, quality)
            target.parent.mkdir(parents=True, exist_ok=True)
            write_schedule(target, cand.config, fingerprint, evidence,
                           str(cal.model or "default"), quality)
            doc["installed"][quality] = str(target)
            progress.log(f"installed {target}")
    if not doc["chosen"]:
        progress.log("no candidate confirmed: no schedule written")
    save()
    return json.loads((out / "results.json").read_text())


def slower_than_full(cand: Candidate) -> Optional[str]:
    """Why a chosen schedule is not installed, if its measured whole answer came later than
    ``full``'s: a schedule ``load`` applies by itself must not slow the user down."""
    g = cand.measured_gain
    if g is None or g["gain"] >= 1:
        return None
    return f"its whole answer measured {g['gain']:.2f}x full's (slower): not installed"


def _choose(cands: Sequence[Candidate], cells: Sequence[str], cal: Calibration,
            bars: Optional[dict[str, float]]) -> dict[str, Candidate]:
    """Per quality sought, the fastest confirmed candidate within its KLD bar (none before
    the bars are known)."""
    confirmed = [c for c in _final(cands, cells, cal) if c.dropped_at is None and c.kld]
    chosen = {q: next((c for c in confirmed if c.kld["kld_mean"] <= bars[q]), None)
              for q in cal.qualities} if bars else {}
    return {q: c for q, c in chosen.items() if c is not None}


def work_folder(fingerprint: dict[str, Any]) -> Path:
    """The default ``--out``: the cache's calibration folder of this model."""
    from ..models import cache_dir

    return cache_dir() / "calibration" / fingerprint_digest(fingerprint)


def install_path(model: Optional[str], fingerprint: dict[str, Any], quality: str) -> Path:
    """Where ``mlx_lazy.load`` finds a schedule of ``quality`` for ``model``: inside a local
    model folder it can write, else in the cache by fingerprint (a named model, a hub id,
    a read-only folder)."""
    folder = None if model is None else Path(model).expanduser()
    if folder is not None and folder.is_dir() and os.access(folder, os.W_OK | os.X_OK):
        return folder / schedule_file_name(MODEL_SCHEDULE_FILE.removesuffix(".json"), quality)
    return cached_schedule_path(fingerprint, quality)


def _prepare_out(out: Path, resume: bool = False) -> None:
    """Create the output folder, or fail with one line when it cannot hold the outputs or,
    without ``resume``, holds an earlier calibration (which this run would replace)."""
    if not resume and (out / "results.json").exists():
        raise UserInputError(f"--out {out} holds an earlier calibration: pass --resume to "
                             "build on it, or choose another folder")
    make_folder(out)


def _check_earlier(old: Any, path: Path) -> None:
    """Refuse a ``results.json`` not shaped as this tool writes it (edited by hand, or
    another tool's), whose reading would fail half-way."""
    def mapping_of_lists(x: Any) -> bool:
        return isinstance(x, dict) and all(isinstance(v, list) for v in x.values())

    shaped = (isinstance(old, dict) and isinstance(old.get("options", {}), dict)
              and mapping_of_lists(old.get("full", {}))
              and isinstance(old.get("resumed", []), list)
              and isinstance(old.get("candidates", []), list)
              and all(isinstance(c, dict) and isinstance(c.get("config"), dict)
                      and mapping_of_lists(c.get("scores"))
                      for c in old.get("candidates", [])))
    if not shaped:
        raise UserInputError(f"--resume: {path} is not a calibration's results (malformed); "
                             "use another --out")


def _final(cands: Sequence[Candidate], cells: Sequence[str], cal: Calibration) -> list[Candidate]:
    """The candidates measured on every sample of the last rung, in predicted-gain order."""
    return [c for c in cands if cells and c.rung == len(cal.rungs) - 1
            and min(len(c.scores.get(cell, [])) for cell in cells) >= max(cal.rungs)]


def _resume(out: Path, cal: Calibration, fingerprint: dict[str, Any],
            full: dict[str, list[float]], cands: Sequence[Candidate],
            deviation: Deviation, doc: dict[str, Any], progress: Progress) -> None:
    """Reuse the per-sample scores of an earlier run in ``out`` (same model and samples) and
    its KLD measurements (when made on the same windows: same kld options). Into ``doc``:
    that run's options and work (``resumed``) and its candidates that this run's grid lacks
    (``earlier``, kept in the results). Files written before KLD replaced teacher-forced
    agreement resume without their agreement."""
    path = out / "results.json"
    if not path.is_file():
        return
    try:
        old = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserInputError(f"--resume: cannot read {path} ({e}); use another --out") from None
    _check_earlier(old, path)
    o = old.get("options", {})
    same = (old.get("fingerprint") == fingerprint and o.get("seed") == cal.seed
            and max(o.get("rungs") or [0]) == max(cal.rungs))
    if not same:
        raise UserInputError(f"--resume: {path} is from another model, seed or sample count; "
                             "use another --out")
    full.update({k: list(v) for k, v in old.get("full", {}).items()})
    # the runs this one builds on, oldest first: their options and work, for the evidence
    doc["resumed"] = [*old.get("resumed", []), {"options": o, "work": old.get("work")}]
    same_windows = all(o.get(k) == getattr(cal, k)
                       for k in ("kld_windows", "kld_length", "kld_steps"))
    if same_windows:
        deviation.yardsticks.update(old.get("yardsticks") or {})
        deviation.texts.update(old.get("kld_texts") or {})
    # The same candidate is the same config, decode mode included: names omit a field at
    # its default and so change when a default does. (Files from before completion existed
    # decoded as the paper: "none".)
    earlier = {_config_key(c["config"]): c for c in old.get("candidates", [])}
    # A candidate measured under the keep floor (none recorded, in the file or the
    # candidate) pruned short prompts less: its scores and KLD are not this run's; full's
    # and the yardsticks' are. It stays in the results marked so.
    for c in earlier.values():
        c["min_keep"] = measured_floor(c, old)
    for c in cands:
        found = earlier.pop(_config_key(c.config_dict()), None)
        if found is not None and found["min_keep"] == MIN_KEEP_MEASURED:
            c.scores = {k: list(v) for k, v in found["scores"].items()}
            c.measured_gain = found.get("measured_gain")
            c.kld = found.get("kld") if same_windows else None
    doc["earlier"] = list(earlier.values())
    progress.log(f"resumed {sum(map(len, full.values()))} full and "
         f"{sum(len(v) for c in cands for v in c.scores.values())} candidate runs from {path}")


def _config_key(config: dict[str, Any]) -> str:
    return json.dumps({"complete": "none", **config}, sort_keys=True)


def _pooled(full_scores, cand: Candidate, cells: Sequence[str], n: int) -> stats.Paired:
    base = [s for c in cells for s in full_scores(c, n)]
    mine = [s for c in cells for s in cand.scores[c][:n]]
    return stats.paired(base, mine)


def within_loss(p: stats.Paired, max_loss: float, last: bool = True) -> bool:
    """The loss allowance: at the last rung the pooled relative loss ≤ ``max_loss``; before
    it, one more net lost answer than that allows (few samples only rank candidates)."""
    allowed = max_loss * p.base * p.n + (0 if last else 1)
    return p.lost - p.won <= allowed


def _evidence(cal: Calibration, cand: Candidate, full_scores, cells: Sequence[str],
              quality: str, doc: dict[str, Any], deviation: Deviation) -> dict[str, Any]:
    """What a schedule file says about its schedule: the paired retrieval samples, its KLD
    beside the yardsticks on the same windows, the gains, and how and when it was made."""
    n = max(cal.rungs)
    per_cell = {c: stats.paired(full_scores(c, n), cand.scores[c][:n]).as_dict() for c in cells}
    ev: dict[str, Any] = {
        "quality": quality,
        "samples_per_cell": n,
        "cells": per_cell,
        "pooled": _pooled(full_scores, cand, cells, n).as_dict(),
        "max_loss": cal.max_loss,
        "min_keep": MIN_KEEP_MEASURED,
        **{f: getattr(cand.config, f) for f in DECODE_FIELDS},  # as the candidate decoded
        "predicted_gain": cand.predicted_gain,
        "gain_length": cal.gain_length,
        "token_layers_pct": cand.token_layers_pct,
        "kld": cand.kld,
        "yardsticks": doc["yardsticks"],
        "max_kld": cal.max_kld,
        "kld_bar": doc["bars"][quality],
        "kld_texts": deviation.texts,
        "made": {"by": "python -m mlx_lazy.calibrate", "date": time.strftime("%Y-%m-%d"),
                 "options": jsonable(asdict(cal)),
                 "resumed": [r["options"] for r in doc.get("resumed", [])]},
    }
    if cand.measured_gain is not None:
        ev["measured_gain"] = cand.measured_gain
    return ev


def measure_gain(model: Any, tokenizer: Any, config: PruningConfig, n_tokens: int,
                 repeats: int = 1, answer_tokens: int = 1) -> dict[str, Any]:
    """Time to the last of ``answer_tokens`` tokens (greedy; ``generate_step`` evaluates each
    token before yielding it and never stops early) of ``full`` ÷ that of ``config`` on an
    ``n_tokens`` prose prompt, measured side by side, alternating: what a user waits for. The
    gain is the median of the ``repeats`` paired ratios; the first token's gain stands beside
    it, and the load average says how busy the machine was."""
    from .. import generate_step

    prompt = build_prompt(tokenizer, n_tokens)
    first: dict[str, list[float]] = {"full": [], "pruned": []}
    whole: dict[str, list[float]] = {"full": [], "pruned": []}
    for _ in range(repeats):
        for name, cfg in (("full", None), ("pruned", config)):
            tic = time.perf_counter()
            for i, _token in enumerate(generate_step(prompt, model, max_tokens=answer_tokens,
                                                     config=cfg)):
                now = time.perf_counter()
                if i == 0:
                    first[name].append(now - tic)
            whole[name].append(now - tic)

    def gain(times: dict[str, list[float]]) -> float:
        return median([f / p for f, p in zip(times["full"], times["pruned"])])

    return {"prompt_tokens": n_tokens, "answer_tokens": answer_tokens,
            "full_s": whole["full"], "pruned_s": whole["pruned"], "gain": gain(whole),
            "first_token_full_s": first["full"], "first_token_pruned_s": first["pruned"],
            "first_token_gain": gain(first), "loadavg_1min": loadavg()}


def _write(out: Path, doc: dict[str, Any], full: dict[str, list[float]],
           cells: Sequence[str]) -> None:
    doc = {k: v for k, v in doc.items() if k != "earlier"} | dict(
        full=full, candidates=[c.as_dict() for c in doc["candidates"]] + doc.get("earlier", []))
    # atomic: a Ctrl-C while writing leaves the previous file for --resume, not a torn one
    write_text_atomic(out / "results.json", json.dumps(jsonable(doc), indent=1))
    write_text_atomic(out / "report.md", report(doc, cells))
    try:
        from .plots import plot_calibration

        plot_calibration(doc, cells, out / "pareto.png")
    except ImportError:  # matplotlib missing: the table is enough
        pass


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") \
            from None


def parse_cuts(spec: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``0.5,0.75/0.3,0.15`` -> ``((0.5, 0.75), (0.3, 0.15))``: cuts at depth fractions, and
    the fraction kept after each."""
    try:
        fracs, keep = (tuple(float(x) for x in part.split(",")) for part in spec.split("/"))
        build_schedule(PruningConfig("lazy", prune_layers=layers_at(fracs, 30), keep=keep), 30)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad cuts {spec!r} (expected depth fractions/keep "
                                         f"fractions, e.g. 0.5,0.75/0.3,0.15): {e}") from None
    if len(fracs) != len(keep) or not all(0 < f < 1 for f in fracs) or list(fracs) != sorted(fracs):
        raise argparse.ArgumentTypeError(f"bad cuts {spec!r}: one keep fraction per cut, cuts "
                                         "at increasing depth fractions in (0, 1)")
    return fracs, keep


def _qualities_arg(text: str) -> tuple[str, ...]:
    """``default``, ``high`` or both, comma-separated, in :data:`QUALITIES` order."""
    asked = {q.strip() for q in text.split(",")}
    if not asked <= set(QUALITIES):
        raise argparse.ArgumentTypeError(f"expected {', '.join(QUALITIES)} or both "
                                         f"comma-separated, got {text!r}")
    return tuple(q for q in QUALITIES if q in asked)


def _scorer_arg(spec: str) -> str:
    """A scorer spec, checked (:func:`mlx_lazy.scorers.parse_scorer`) and spelt canonically."""
    try:
        return scorer_spec(parse_scorer(spec))
    except UserInputError as e:
        raise argparse.ArgumentTypeError(f"bad scorer {spec!r}: {e}") from None


def build_parser() -> argparse.ArgumentParser:
    """The command-line options."""
    p = OneLineParser(prog="python -m mlx_lazy.calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder or name (default SmolLM2)")
    p.add_argument("--out", default=None,
                   help="output folder (default: ~/.cache/mlx_lazy/calibration/<fingerprint "
                        "digest>, and the schedules are installed, see --install)")
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                   help=f"comma-separated tasks ({','.join(TASKS)})")
    p.add_argument("--lengths", type=_ints, default=(1024,), help="prompt lengths, e.g. 768,1024")
    p.add_argument("--rungs", type=_ints, default=(6, 20, 50),
                   help="samples per cell at each rung of successive halving; the last confirms")
    p.add_argument("--keep-per-rung", type=_ints, default=(8, 3),
                   help="most candidates kept after each rung but the last")
    p.add_argument("--pilot", type=int, default=10, help="full-path samples per cell to pick cells")
    p.add_argument("--min-base", type=float, default=0.8, help="least full-path score of a cell")
    p.add_argument("--max-loss", type=float, default=0.01, help="largest relative accuracy loss")
    p.add_argument("--max-kld", type=parse_max_kld, default="q4",
                   help="largest mean KL divergence from full along its own continuation for "
                        "a schedule to be chosen: a number, or q4 / q8, that of the model with "
                        "its weights rounded through 4 / 8 bits on the same windows (default "
                        "q4); the high quality schedule also keeps to a quarter of q4's")
    p.add_argument("--kld-windows", type=int, default=8,
                   help="windows of prose and of code each on which KLD is measured (default 8)")
    p.add_argument("--install", action="store_true",
                   help="with --out: also install the schedules where mlx_lazy.load finds them "
                        "(the model folder, or the cache by fingerprint); always done without "
                        "--out")
    p.add_argument("--kld-length", type=int, default=Calibration.kld_length, metavar="N",
                   help=f"tokens of each KLD window (default {Calibration.kld_length}); "
                        "--gain-length's value checks drift at the length the gain is claimed "
                        "for, at about one prefill of that length per window and row")
    p.add_argument("--kld-steps", type=int, default=Calibration.kld_steps, metavar="N",
                   help="steps of full's continuation along which each KLD window is measured "
                        f"(default {Calibration.kld_steps}, a whole answer's: a pruned state's "
                        "drift grows with the "
                        "answer, quantized weights' does not)")
    p.add_argument("--gain-length", type=int, default=4096,
                   help="prompt tokens at which the pruning gain is predicted and measured")
    p.add_argument("--scorers", type=lambda t: tuple(_scorer_arg(x) for x in t.split(",")),
                   default=SCORER_GRID, help="scorer specs to try, e.g. last,window:size=8:pool=2 "
                   "(default: " + ",".join(SCORER_GRID) + ")")
    p.add_argument("--cuts", type=parse_cuts, nargs="+", default=CUT_GRID, metavar="F,../K,..",
                   help="cut schedules to try: depth fractions / keep fractions, e.g. "
                        "0.5,0.75/0.3,0.15 0.5/0.2 (default: a grid from 0.2 to 0.85 of the "
                        "depth)")
    p.add_argument("--no-measure", action="store_true",
                   help="do not time the candidates that reached the last rung")
    p.add_argument("--gain-repeats", type=int, default=1,
                   help="side-by-side timings per measured gain (the median is reported; a "
                        "single one on a busy machine is noisy)")
    p.add_argument("--gain-answer-tokens", type=int, default=128, metavar="N",
                   help="tokens of the answer whose arrival the measured gain times (default "
                        "128; 1: the first token's gain only)")
    p.add_argument("--resume", action="store_true",
                   help="reuse the runs of an earlier calibration in --out (same model, seed "
                        "and largest rung)")
    p.add_argument("--complete", type=complete_arg, default=None, metavar="MODE",
                   help="how the candidates decode (the schedule's evidence holds for it): "
                        f"{', '.join(COMPLETE_MODES)} (default {DEFAULT_COMPLETE}; a hybrid "
                        "model's candidates revive nothing: none, or no mode)")
    p.add_argument("--max-revivals", type=int, default=None, metavar="R",
                   help="at most R revivals per decode step and cut while the candidates "
                        "decode (the schedule's evidence holds for it; default: unbounded)")
    p.add_argument("--revive-margin", type=float, default=None, metavar="M",
                   help="while the candidates decode, a token to be revived competes with its "
                        "score divided by 1 + M (the schedule's evidence holds for it; "
                        "default 0, the paper's selection)")
    p.add_argument("--reselect-every", type=int, default=None, metavar="K",
                   help="while the candidates decode, re-select at the cuts every K steps, the "
                        "steps between seeing the last choice (the schedule's evidence holds "
                        "for it; default 1, the paper's step)")
    p.add_argument("--qualities", type=_qualities_arg, default=QUALITIES, metavar="Q,..",
                   help="the schedules to find: default, high or default,high (the default); "
                        "the run ends once each is found, so default alone ends sooner")
    p.add_argument("--time-limit", type=parse_duration, default=None,
                   help="seconds, or a duration like 30m or 2h; stop starting runs after it "
                        "and write what was measured")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit status (0: a schedule was chosen, the
    default quality's when it was sought; 1: none confirmed; 2: bad input; 130: interrupted,
    after writing what was measured)."""
    args = build_parser().parse_args(argv)
    cal = Calibration(model=args.model, out=args.out,
                      tasks=tuple(t.strip() for t in args.tasks.split(",")),
                      lengths=args.lengths, rungs=args.rungs, keep_per_rung=args.keep_per_rung,
                      pilot=args.pilot, min_base=args.min_base, max_loss=args.max_loss,
                      max_kld=args.max_kld, kld_windows=args.kld_windows,
                      kld_length=args.kld_length, kld_steps=args.kld_steps,
                      install=args.out is None or args.install,
                      gain_length=args.gain_length,
                      scorers=args.scorers, cuts=tuple(args.cuts), measure=not args.no_measure,
                      gain_repeats=args.gain_repeats,
                      gain_answer_tokens=args.gain_answer_tokens, time_limit_s=args.time_limit,
                      resume=args.resume, complete=args.complete,
                      max_revivals=args.max_revivals, revive_margin=args.revive_margin,
                      reselect_every=args.reselect_every,
                      qualities=args.qualities)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `timeout`: keep results
    try:
        if max(cal.rungs, default=0) < 50:
            raise UserInputError("the last rung must have >= 50 samples per cell (claims "
                                 "need them)")
        doc = run(cal)
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print((Path(doc["out"]) / "report.md").read_text())
    if doc["stopped"] == "interrupted":
        print("interrupted", file=sys.stderr)
        return 130
    return 0 if cal.qualities[0] in doc["chosen"] else 1


if __name__ == "__main__":
    sys.exit(main())
