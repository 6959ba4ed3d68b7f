"""What the benchmarks share: the method names, one measured run, the machine, tables.

- :class:`Method` and :class:`RunRecord`: a way of generating, and one measured generation
  (:func:`measure`) as both ``python -m mlx_lazy.bench`` (accuracy) and
  ``python -m mlx_lazy.bench.speed`` record it;
- :func:`timed`: TTFT, TPOT and total time of a response stream, wall and CPU;
- :func:`machine_info`: where and with what the numbers were measured;
- :func:`mean`, :func:`median`, :func:`geomean`, :func:`ratio`, :func:`paired_ratios`: the
  summaries' arithmetic, all skipping missing values;
- :func:`fmt` and :func:`markdown_table`: every markdown table of the benchmarks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import gc
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import _blas

import mlx.core as mx  # noqa: E402  (after _blas: OpenBLAS must load first)

from ..adapter import num_layers  # noqa: E402

#: mlx-lm's own ``stream_generate``: the baseline every method is compared with.
BASELINE = "mlx-lm"
#: Our engine without pruning.
FULL = "full"
#: Decode steps of a short answer: TPOT is also measured over the first this many steps,
#: where LazyLLM revives the most tokens.
SHORT_ANSWER = 16
MIB = 1 / 2**20


@dataclass(frozen=True)
class Method:
    """A named way of generating: the mlx-lm baseline (``config is None``) or our engine."""

    name: str
    config: Any = None  # mlx_lazy.PruningConfig, or None for the mlx-lm baseline

    @property
    def is_baseline(self) -> bool:
        """True for the mlx-lm reference path."""
        return self.config is None

    @property
    def family(self) -> str:
        """``mlx-lm`` or the PruningConfig method (``full``, ``lazy``, ``speed`` ...)."""
        return BASELINE if self.config is None else str(self.config.method)

    def schedule(self) -> dict[str, Any]:
        """The configuration as a JSON-friendly dict."""
        if self.config is None:
            return {"method": BASELINE}
        if hasattr(self.config, "as_dict"):
            return jsonable(self.config.as_dict())
        return jsonable(dict(vars(self.config)))


def jsonable(obj: Any) -> Any:
    """Tuples -> lists, numpy/mlx scalars -> Python, recursively."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


# ----------------------------------------------------------------------------------------
# One measured run


@dataclass
class Timing:
    """TTFT, TPOT and total time of one streamed generation, in wall and process-CPU seconds."""

    ttft_s: float
    tpot_s: float | None
    total_s: float
    ttft_cpu_s: float
    tpot_cpu_s: float | None
    generation_tokens: int
    tpot_short_s: float | None  # TPOT over the first SHORT_ANSWER decode steps
    # from the call to the second token: the first token plus the first decode step, where
    # complete="after-first" carries the pruned tokens through their remaining layers
    second_token_s: float | None = None
    # from the call to each token's arrival (the whole answer, token by token)
    arrivals_s: list[float] = field(default_factory=list)


@dataclass
class RunRecord:
    """One measured generation, as both benchmarks record it.

    :func:`measure` fills every field but the last group: an accuracy run adds its sample
    (``task`` ... ``scores``) and later ``predicted_ttft_s``; a speed run adds its ``repeat``.
    mlx-lm runs have no ``stats`` and the token counts of an unpruned generation. Fields with
    defaults may be missing from results.json files written before the two records were one
    (:meth:`from_dict` reads those).
    """

    method: str  # method string or named method
    family: str  # mlx-lm, or the PruningConfig method (full, lazy, speed, ...)
    prompt_tokens: int
    generation_tokens: int
    ttft_s: float
    tpot_s: float | None
    total_s: float
    peak_memory_bytes: int
    kv_bytes: int
    aux_bytes: int
    ttft_cpu_s: float | None = None
    tpot_cpu_s: float | None = None
    tpot_short_s: float | None = None
    second_token_s: float | None = None
    arrivals_s: list[float] = field(default_factory=list)
    work_memory_bytes: int | None = None  # peak minus what was allocated before (the weights)
    kv_bytes_per_layer: list[int] = field(default_factory=list)
    kv_bytes_allocated: int | None = None  # mlx-lm: its cache's allocation, 256 steps at a time
    prompt_tokens_computed_pct: float | None = None
    tokens_computed_per_layer: list[int] = field(default_factory=list)  # prefill and decode
    prefill_tokens_per_layer: list[int] = field(default_factory=list)
    prefill_attention_pairs: int | None = None
    prediction: str = ""  # the generated text
    loadavg_1min: float | None = None  # machine load when the run ended (noise indicator)
    stats: dict[str, Any] | None = None  # GenerationStats.as_dict() without the text
    # Filled by the runner:
    repeat: int = 0
    task: str | None = None
    length: int | None = None  # the sample's target prompt length
    index: int | None = None
    order: int = 0  # position of this method within the sample's rotation
    score: float | None = None  # the task's primary metric
    scores: dict[str, float] | None = None
    predicted_ttft_s: float | None = None  # cost model, filled after the fit

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunRecord":
        """Read a record from results.json, including the two older record types."""
        d = dict(d)
        if "generated" in d:  # the speed benchmark's former RunResult
            d["generation_tokens"] = d.pop("generated")
            stats = d.get("stats")
            d["family"] = BASELINE if stats is None else stats["method"]
            if stats is not None:  # its counts were only in the stats
                for k in ("prompt_tokens_computed_pct", "tokens_computed_per_layer",
                          "prefill_tokens_per_layer", "prefill_attention_pairs"):
                    d[k] = stats[k]
        return cls(**d)


def loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def timed(responses: Iterator[Any]) -> tuple[Timing, Any, str]:
    """Consume a response stream, stamping each response's arrival; return its timings, the
    last response and the whole text.

    Both mlx-lm's and our ``stream_generate`` yield a token only after evaluating it, so the
    first stamp marks the first token. Wall time (``perf_counter``) is what a user sees;
    process CPU time (``process_time``: all threads) is far less sensitive to other processes
    competing for the cores.
    """
    stamps: list[tuple[float, float]] = []
    pieces: list[str] = []
    last = None
    w0, c0 = time.perf_counter(), time.process_time()
    for last in responses:
        stamps.append((time.perf_counter(), time.process_time()))
        pieces.append(last.text)
    if not stamps:
        raise RuntimeError("the generator produced no tokens")
    n = len(stamps)
    (w1, c1), (wn, cn) = stamps[0], stamps[-1]
    short = min(SHORT_ANSWER, n - 1)
    return Timing(
        ttft_s=w1 - w0,
        tpot_s=(wn - w1) / (n - 1) if n > 1 else None,
        total_s=wn - w0,
        ttft_cpu_s=c1 - c0,
        tpot_cpu_s=(cn - c1) / (n - 1) if n > 1 else None,
        generation_tokens=n,
        tpot_short_s=(stamps[short][0] - w1) / short if short else None,
        second_token_s=stamps[1][0] - w0 if n > 1 else None,
        arrivals_s=[w - w0 for w, _ in stamps],
    ), last, "".join(pieces)


@contextlib.contextmanager
def no_eos(tokenizer: Any) -> Iterator[None]:
    """Empty ``tokenizer.eos_token_ids`` so generation always runs to ``max_tokens``."""
    saved = getattr(tokenizer, "eos_token_ids", None)
    if saved is None:
        yield
        return
    tokenizer.eos_token_ids = set()
    try:
        yield
    finally:
        tokenizer.eos_token_ids = saved


def mlx_lm_kv_bytes_per_layer(cache: Sequence[Any], num_layers: int = 0) -> list[int]:
    """Bytes of the filled part of each layer of an mlx-lm prompt cache (not the 256-step
    allocation, which is ``cache[i].nbytes``), 0 for the last of ``num_layers`` layers that
    have none (Gemma 4 E2B/E4B's upper layers read lower layers' keys and values); 0 for a
    recurrent layer's state (a hybrid's), which holds no keys and values, as ours counts it."""
    filled = [0 if c.empty() or not hasattr(c, "keys_and_values")
              else sum(a.nbytes for a in c.keys_and_values()) for c in cache]
    return filled + [0] * (num_layers - len(filled))


def measure(model: Any, tokenizer: Any, method: Method, prompt: Sequence[int], max_tokens: int,
            stop_at_eos: bool = True) -> RunRecord:
    """Generate greedily once with ``method`` (mlx-lm's ``stream_generate`` and its own KV
    cache, or ours) and measure it.

    Memory is freed and the peak counter reset first. ``stop_at_eos=False`` generates exactly
    ``max_tokens`` tokens (the speed benchmark's TPOT).
    """
    import mlx_lm

    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    eos = contextlib.nullcontext() if stop_at_eos else no_eos(tokenizer)
    n = len(prompt)
    if method.is_baseline:
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
        with eos:
            stream = mlx_lm.stream_generate(model, tokenizer, mx.array(list(prompt)),
                                            max_tokens=max_tokens, prompt_cache=cache)
            timing, _, text = timed(stream)
        peak = mx.get_peak_memory()
        n_layers = num_layers(model)  # mlx-lm keeps no cache for layers reading another's
        kv_per_layer = mlx_lm_kv_bytes_per_layer(cache, n_layers)
        # Every token at every layer: the prompt, then each generated token fed back but the last.
        fed = n + timing.generation_tokens - 1
        counts = dict(prompt_tokens_computed_pct=100.0, tokens_computed_per_layer=[fed] * n_layers,
                      prefill_tokens_per_layer=[n] * n_layers,
                      prefill_attention_pairs=n * (n + 1) // 2 * n_layers)
        return RunRecord(**dataclasses.asdict(timing), method=method.name, family=method.family,
                         prompt_tokens=n, peak_memory_bytes=peak, work_memory_bytes=peak - before,
                         kv_bytes=sum(kv_per_layer), kv_bytes_per_layer=kv_per_layer, aux_bytes=0,
                         kv_bytes_allocated=sum(c.nbytes for c in cache), prediction=text,
                         loadavg_1min=loadavg(), **counts)
    from .. import stream_generate

    with eos:
        timing, last, text = timed(stream_generate(model, tokenizer, list(prompt),
                                                   max_tokens=max_tokens, config=method.config))
    peak = mx.get_peak_memory()
    stats = jsonable(last.stats.as_dict())
    stats.pop("text")
    return RunRecord(**dataclasses.asdict(timing), method=method.name, family=method.family,
                     prompt_tokens=n, peak_memory_bytes=peak, work_memory_bytes=peak - before,
                     kv_bytes=stats["kv_bytes"], kv_bytes_per_layer=stats["kv_bytes_per_layer"],
                     aux_bytes=stats["aux_bytes"],
                     prompt_tokens_computed_pct=stats["prompt_tokens_computed_pct"],
                     tokens_computed_per_layer=stats["tokens_computed_per_layer"],
                     prefill_tokens_per_layer=stats["prefill_tokens_per_layer"],
                     prefill_attention_pairs=stats["prefill_attention_pairs"],
                     prediction=text, loadavg_1min=loadavg(), stats=stats)


def machine_info(model: Any, prog: str, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Where and with what the benchmark ran; ``prog`` and ``argv`` (default: this process's
    arguments) give the command line recorded."""
    import mlx_lm
    import numpy as np
    from mlx.utils import tree_flatten

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                   cpu)
    dtypes = sorted({str(v.dtype).replace("mlx.core.", "")
                     for _, v in tree_flatten(model.parameters())})
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, "-m", prog,
                             *(sys.argv[1:] if argv is None else argv)]),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "numpy": np.__version__,
        "device": str(mx.default_device()),
        "openblas": _blas.loaded_path,
        "model_dtypes": dtypes,
        "num_layers": num_layers(model),
    }


# ----------------------------------------------------------------------------------------
# Summaries


def _present(xs: Iterable[float | None]) -> list[float]:
    return [x for x in xs if x is not None and not math.isnan(x)]


def mean(xs: Iterable[float | None]) -> float | None:
    """Mean of the values that are not None or NaN; None when there are none."""
    vals = _present(xs)
    return statistics.fmean(vals) if vals else None


def median(xs: Iterable[float | None]) -> float | None:
    """Median of the values that are not None or NaN; None when there are none."""
    vals = _present(xs)
    return statistics.median(vals) if vals else None


def geomean(xs: Iterable[float | None]) -> float | None:
    """Geometric mean of the values that are not None or NaN (all > 0); None when none."""
    vals = _present(xs)
    return math.exp(statistics.fmean(math.log(x) for x in vals)) if vals else None


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den`` when both are positive, else None (a missing or failed measurement)."""
    return num / den if num is not None and den is not None and num > 0 and den > 0 else None


def paired_ratios(runs: Iterable[RunRecord], refs: Iterable[RunRecord], attr: str,
                  key: Callable[[RunRecord], Hashable]) -> list[float]:
    """``attr`` of each run over ``attr`` of the reference run with the same ``key`` (the same
    sample, the same repeat), skipping runs without a reference or a value.

    Side-by-side runs are measured moments apart, so slow drifts in machine load cancel out
    of each ratio.
    """
    by_key = {key(r): r for r in refs}
    out = []
    for r in runs:
        ref = by_key.get(key(r))
        x = ratio(getattr(r, attr), getattr(ref, attr)) if ref is not None else None
        if x is not None:
            out.append(x)
    return out


# ----------------------------------------------------------------------------------------
# Tables


def fmt(x: float | None, spec: str = ".2f", scale: float = 1.0, suffix: str = "") -> str:
    """``x * scale`` formatted with ``spec`` and ``suffix``; "–" for a missing value."""
    return "–" if x is None else format(x * scale, spec) + suffix


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table; cells are written with ``str``, None as "–".

    Raises ValueError when a row has a different number of cells than the header.
    """
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"table row has {len(row)} cells for {len(header)} columns: {row}")
        lines.append("| " + " | ".join("–" if c is None else str(c) for c in row) + " |")
    return "\n".join(lines)
