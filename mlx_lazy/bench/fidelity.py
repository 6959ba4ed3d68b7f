"""Fidelity a user can read: KL divergence and same-top-1 against the unpruned path, beside
the drift of 8- and 4-bit weights.

``python -m mlx_lazy.bench.fidelity --out DIR [--model M] [--methods 'lazy;lazy:layers=14']``

On fixed-length windows of two kinds of held-out text (prose: licence texts; code: mlx-lm's
own modules), ``full`` generates its greedy continuation; every other row (each method, and
the model with its weights rounded through 8- and 4-bit affine quantization, see
:mod:`.yardstick`) is teacher-forced along that same continuation, so every row sees the same
tokens. Per row: the mean and 99th percentile of KL(full ‖ row) of the next-token
distributions per step, the rate of steps with the same top-1 token, each with a 95% interval
(bootstrap over windows: the steps of one window are not independent), the prefill work
(token-layers computed in prefill relative to ``full``), and the row's mean KLD minus the
4-bit weights' paired by window, with its interval and the windows where the row drifts less
(side by side, two rows' intervals overlap even when one drifts less on nearly every window).
Like llama.cpp's KLD / "same top p" comparison of a quantized model with the unquantized one;
a user can judge "deviates less than 4-bit weights do" where "agreement 0.93" has no
yardstick.

The engine is driven only through :func:`mlx_lazy.generate_step`: teacher forcing is a
sampler that returns the reference's next token whatever it is given.
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from .. import _blas  # noqa: F401  (OpenBLAS before mlx.core)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models import cache as mlx_lm_cache  # noqa: E402

from .. import (GenerationStats, PruningConfig, generate_step, make_prompt_cache,  # noqa: E402
                 resolve_config)
from .. import selection  # noqa: E402
from ..api import Sampler, check_context, context_length  # noqa: E402
from .._args import OneLineParser, path_arg  # noqa: E402
from ..adapter import num_layers  # noqa: E402
from ..errors import UserInputError  # noqa: E402
from ..folders import make_folder, output_folder, write_text_atomic  # noqa: E402
from ..models import MODELS  # noqa: E402
from . import stats, yardstick  # noqa: E402
from .common import (BASELINE, FULL, fmt, jsonable, loadavg, machine_info,  # noqa: E402
                     markdown_table)
from .methods import parse_method, parse_methods  # noqa: E402
from .tasks import build_prompt  # noqa: E402

#: a prose prompt and the unpruned path's greedy continuation of it
Reference = tuple[list[int], list[int]]

#: Prose: licence texts (plain English, held out from calibration's pydoc prose), in this
#: order, those present on the machine: Debian's common licences, then Python's own licence.
PROSE_FILES: tuple[Path, ...] = tuple(
    Path("/usr/share/common-licenses") / name
    for name in ("GPL-3", "GPL-2", "LGPL-2.1", "GFDL-1.3", "MPL-1.1", "MPL-2.0", "Apache-2.0",
                 "Artistic", "CC0-1.0")
) + (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt",)
KINDS = ("prose", "code")
#: Every row is paired window by window with the weights through this many bits: a
#: schedule's default drift bar (:func:`paired_with`).
BAR_BITS = 4
RESAMPLES = 2000
DEFAULT_METHODS = "full;lazy"


# ----------------------------------------------------------------------------------------
# Runs through generate_step


@dataclass
class Continuation:
    """One row's run along a window: the tokens fed after the prompt, the log probabilities
    the row gave each of them (``(steps, vocab)``), and the engine's statistics."""

    tokens: list[int]
    logprobs: mx.array
    stats: Optional[GenerationStats]  # None: an unpruned forward pass (:func:`forced_forward`)


def forcing_sampler(tokens: Sequence[int]) -> Sampler:
    """A sampler returning ``tokens`` one by one, whatever log probabilities it gets
    (``generate_step`` asks once more after the last token: it gets the last again)."""
    it: Iterator[int] = iter(tokens)
    last = tokens[-1]

    def sample(logprobs: mx.array) -> mx.array:
        return mx.array([next(it, last)])

    return sample


def continuation(model: Any, prompt: Sequence[int], steps: int,
                 config: Optional[PruningConfig] = None,
                 forced: Optional[Sequence[int]] = None) -> Continuation:
    """Run ``config`` (None: ``full``) on ``prompt`` for ``steps`` (≥ 1) tokens: greedy, or
    teacher-forced along ``forced``; unpruned and teacher-forced, that is one forward pass
    (:func:`forced_forward`)."""
    if config is None and forced is not None:
        return forced_forward(model, prompt, forced[:steps])
    cache = make_prompt_cache(model, config)
    sampler = None if forced is None else forcing_sampler(forced[:steps])
    tokens, logprobs = [], []
    for token, lp in generate_step(list(prompt), model, prompt_cache=cache, sampler=sampler,
                                   max_tokens=steps):
        tokens.append(token)
        logprobs.append(lp)
    return Continuation(tokens, mx.stack(logprobs), cache.engine.stats)


#: Prompt tokens per call of :func:`forced_forward`'s pass over the prompt: mlx-lm's attention
#: holds a chunk's scores against every earlier key, so a whole long window at once would
#: hold L x L of them per head.
FORCED_PREFILL_CHUNK = 512


def forced_forward(model: Any, prompt: Sequence[int], forced: Sequence[int],
                   chunk: int = FORCED_PREFILL_CHUNK) -> Continuation:
    """The unpruned model teacher-forced along ``forced`` (≥ 1 token) after ``prompt``, in one
    forward pass of mlx-lm's model: an unpruned model's logits at a position are the same (up
    to float rounding) whether the tokens before it came in one pass or step by step, and a
    decode step is weight-bound, so this costs about a prefill where a prefill and
    ``len(forced)`` steps did. The prompt goes through in ``chunk``-token calls evaluated for
    the cache alone; only the forced positions' logits are computed. The yardsticks' rows run
    here."""
    cache = mlx_lm_cache.make_prompt_cache(model)
    for start in range(0, len(prompt) - 1, chunk):
        model(mx.array(prompt[start : min(start + chunk, len(prompt) - 1)])[None], cache=cache)
        mx.eval([c.state for c in cache])
    logits = model(mx.array([prompt[-1], *forced[:-1]])[None], cache=cache)[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(logprobs)
    return Continuation(list(forced), logprobs, None)


def greedy_tokens(model: Any, prompt: Sequence[int], steps: int,
                  config: Optional[PruningConfig] = None) -> list[int]:
    """The engine's greedy continuation of ``prompt`` (unpruned by default)."""
    return continuation(model, prompt, steps, config).tokens


def agreement(model: Any, config: PruningConfig, prompt: Sequence[int],
              reference: Sequence[int]) -> list[bool]:
    """Per step: does ``config``'s argmax equal ``reference`` (the unpruned continuation)
    when fed the reference tokens?"""
    if not reference:
        return []
    run = continuation(model, prompt, len(reference), config, forced=reference)
    return [bool(a == t) for a, t in zip(mx.argmax(run.logprobs, axis=-1).tolist(), reference)]


def references(model: Any, tokenizer: Any, length: int, prompts: int,
               steps: int) -> list[Reference]:
    """``prompts`` prose prompts of ``length`` tokens (37 lines apart in the text), each with
    the unpruned path's greedy continuation of ``steps`` tokens."""
    out = []
    for i in range(prompts):
        prompt = build_prompt(tokenizer, length, offset=37 * i)
        out.append((prompt, greedy_tokens(model, prompt, steps)))
    return out


def agreement_summary(model: Any, config: PruningConfig,
                      refs: Sequence[Reference]) -> dict[str, Any]:
    """Agreement of ``config`` along every reference: steps, agreeing steps, their rate (1.0
    when there are no steps) and its Wilson interval."""
    hits = [h for prompt, ref in refs for h in agreement(model, config, prompt, ref)]
    return {"steps": len(hits), "agree": sum(hits),
            "rate": sum(hits) / len(hits) if hits else 1.0,
            "ci": stats.wilson(sum(hits), len(hits))}


def kl_divergence(reference: mx.array, other: mx.array) -> np.ndarray:
    """KL(reference ‖ other) per row of two ``(steps, vocab)`` log-probability arrays."""
    return np.array(mx.sum(mx.exp(reference) * (reference - other), axis=-1))


def compare(reference: Continuation, run: Continuation) -> dict[str, Any]:
    """One row on one window against ``full``'s run: KLD and same-top-1 per step, and the
    prefill work (prefill token-layers relative to ``full``'s)."""
    top1 = mx.argmax(run.logprobs, axis=-1) == mx.argmax(reference.logprobs, axis=-1)
    return {"kld": kl_divergence(reference.logprobs, run.logprobs).tolist(),
            "top1": top1.tolist(),
            "prefill_work": 1.0 if run.stats is None else
            sum(run.stats.prefill_tokens_per_layer) / sum(reference.stats.prefill_tokens_per_layer)}


# ----------------------------------------------------------------------------------------
# Texts


def code_files() -> list[Path]:
    """Code: mlx-lm's model modules, sorted by name (pinned with mlx-lm's version)."""
    import mlx_lm

    return sorted(p for p in (Path(mlx_lm.__file__).parent / "models").glob("*.py")
                  if p.name != "__init__.py")


def encode_file(tokenizer: Any, path: Path, chunk_chars: int = 2000) -> list[int]:
    """Token ids of a text file, encoded a few lines at a time (no single encode exceeds the
    tokenizer's maximum length)."""
    ids: list[int] = []
    chunk = ""
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        chunk += line
        if len(chunk) >= chunk_chars:
            ids += tokenizer.encode(chunk, add_special_tokens=False)
            chunk = ""
    return ids + (tokenizer.encode(chunk, add_special_tokens=False) if chunk else [])


def text_windows(tokenizer: Any, files: Sequence[Path], n: int,
                 length: int) -> tuple[list[list[int]], dict[str, Any]]:
    """``n`` windows of ``length`` tokens from the files (read in order, only as far as
    ``n × length`` tokens need), evenly spaced: disjoint when the text is long enough.

    Returns the windows and what they came from (each file's sha256 and token count, the
    windows' start offsets).

    Raises:
        UserInputError: the files hold fewer than ``length`` tokens.
    """
    ids: list[int] = []
    used = []
    for path in (p for p in files if p.is_file()):
        if len(ids) >= n * length:
            break
        new = encode_file(tokenizer, path)
        ids += new
        used.append({"path": str(path), "tokens": len(new),
                     "sha256": hashlib.sha256(path.read_bytes()).hexdigest()})
    if len(ids) < length:
        raise UserInputError(f"the texts ({', '.join(str(p) for p in files[:3])}, ...) hold "
                             f"{len(ids)} tokens, fewer than one window of {length}")
    stride = (len(ids) - length) // (n - 1) if n > 1 else 0
    starts = [i * stride for i in range(n)]
    return [ids[s:s + length] for s in starts], {
        "files": used, "total_tokens": len(ids), "starts": starts,
        "disjoint": n == 1 or stride >= length}


def kind_files(kind: str) -> list[Path]:
    """The files of a kind of text (:data:`KINDS`)."""
    return list(PROSE_FILES) if kind == "prose" else code_files()


# ----------------------------------------------------------------------------------------
# Statistics


def spread_order(n: int) -> list[int]:
    """``range(n)`` in van der Corput order (0, n/2, n/4, 3n/4, ...): every prefix is spread
    over the whole range, so a run cut short still samples the whole text."""
    order: list[int] = []
    seen: set[int] = set()
    j = 0
    while len(order) < n:  # the 2^m points of level m >= log2(n) hit every window
        v, f, k = 0.0, 0.5, j
        while k:
            v, f, k = v + f * (k & 1), f / 2, k >> 1
        if int(v * n) not in seen:
            seen.add(int(v * n))
            order.append(int(v * n))
        j += 1
    return order


def row_summary(windows: Sequence[dict[str, Any]], resamples: int = RESAMPLES,
                seed: int = 0) -> dict[str, Any]:
    """Mean and 99th-percentile KLD per step, same-top-1 rate and mean prefill work of one
    row over ``windows`` (:func:`compare` results), with 95% percentile intervals from a
    bootstrap over windows (the same resampled windows for every row with the same seed)."""
    kld = np.array([w["kld"] for w in windows], float)
    top1 = np.array([w["top1"] for w in windows], float)
    idx = _resampled_windows(len(windows), resamples, seed)
    boot_kld = kld[idx].reshape(resamples, -1)
    measures = {
        "kld_mean": (kld.mean(), boot_kld.mean(axis=1)),
        "kld_p99": (np.quantile(kld, 0.99), np.quantile(boot_kld, 0.99, axis=1)),
        "same_top1": (top1.mean(), top1[idx].reshape(resamples, -1).mean(axis=1)),
    }
    out: dict[str, Any] = {"windows": len(windows), "steps": int(kld.size),
                           "prefill_work": float(np.mean([w["prefill_work"] for w in windows]))}
    for name, (value, boot) in measures.items():
        out[name] = float(value)
        out[name + "_ci"] = _interval(boot)
    return out


def _resampled_windows(n: int, resamples: int, seed: int) -> np.ndarray:
    """(resamples, n) window indices of a bootstrap over ``n`` windows: the same for every
    row (and every paired difference) with the same seed."""
    return np.random.default_rng(seed).integers(0, n, (resamples, n))


def _interval(boot: np.ndarray) -> tuple[float, float]:
    """The 95% percentile interval of bootstrap values."""
    return float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))


def paired_with(windows: Sequence[dict[str, Any]], yard: Sequence[dict[str, Any]],
                resamples: int = RESAMPLES, seed: int = 0) -> dict[str, Any]:
    """One row's drift against a yardstick's on the same windows (matched by their
    ``window`` and ``kind``): the mean over windows of (row's mean KLD - yardstick's) with a
    95% bootstrap interval over windows, and in how many windows the row drifted less.

    Pairing removes what the windows share (a hard window is hard for both rows), so the
    interval is far narrower than the two rows' own intervals side by side."""
    theirs = {(w.get("kind"), w["window"]): float(np.mean(w["kld"])) for w in yard}
    pairs = [(float(np.mean(w["kld"])), theirs[key]) for w in windows
             if (key := (w.get("kind"), w["window"])) in theirs]
    diff = np.array([a - b for a, b in pairs], float)
    if not diff.size:
        return {"windows": 0}
    boot = diff[_resampled_windows(diff.size, resamples, seed)].mean(axis=1)
    return {"windows": int(diff.size), "kld_mean_diff": float(diff.mean()),
            "kld_mean_diff_ci": _interval(boot), "windows_below": int((diff < 0).sum())}


def summarize(records: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per kind of text and over all (``"all"``), each row's :func:`row_summary`, and for
    every row but the bar yardstick (:data:`BAR_BITS`) its :func:`paired_with` that yardstick
    under :data:`PAIRED_KEY`; ``records[row][kind]`` are that row's window results."""
    kinds = sorted({k for per_kind in records.values() for k in per_kind if per_kind[k]},
                   key=lambda k: KINDS.index(k))
    bar = yardstick_row(BAR_BITS)
    out: dict[str, Any] = {}
    for kind in kinds + (["all"] if len(kinds) > 1 else []):
        picked = kinds if kind == "all" else [kind]
        windows = {row: [{**w, "kind": k} for k in picked for w in per_kind.get(k, [])]
                   for row, per_kind in records.items() if all(per_kind.get(k) for k in picked)}
        out[kind] = {row: row_summary(w) for row, w in windows.items()}
        if bar in windows:
            for row, s in out[kind].items():
                if row != bar:
                    s[PAIRED_KEY] = paired_with(windows[row], windows[bar])
    return out


# ----------------------------------------------------------------------------------------
# The benchmark


def yardstick_row(bits: int) -> str:
    """The row name of the weights-through-``bits`` yardstick."""
    return f"q{bits}"


#: The key of a row's :func:`paired_with` the bar yardstick in a summary (``vs_q4``).
PAIRED_KEY = "vs_" + yardstick_row(BAR_BITS)


def row_label(row: str) -> str:
    """How a row is shown in the tables."""
    for bits in yardstick.BITS:
        if row == yardstick_row(bits):
            return f"weights through {bits}-bit (group {yardstick.GROUP_SIZE})"
    return f"`{row}`"


def render(result: dict[str, Any]) -> str:
    """The markdown tables of a result: one per kind of text and one over all, rows in order
    of mean KLD, the yardsticks among them."""
    meta = result["meta"]
    parts = [f"Fidelity against `full` along its own greedy continuation "
             f"({meta['steps']} teacher-forced steps per window of {meta['length']} tokens); "
             "95% intervals: bootstrap over windows.", ""]
    for kind, rows in result["summary"].items():
        table = [[row_label(row), fmt(s["prefill_work"]),
                  f"{s['same_top1']:.3f} ({s['same_top1_ci'][0]:.3f}–{s['same_top1_ci'][1]:.3f})",
                  f"{s['kld_mean']:.4f} ({s['kld_mean_ci'][0]:.4f}–{s['kld_mean_ci'][1]:.4f})",
                  _paired_cell(s.get(PAIRED_KEY)),
                  f"{s['kld_p99']:.3f} ({s['kld_p99_ci'][0]:.3f}–{s['kld_p99_ci'][1]:.3f})"]
                 for row, s in sorted(rows.items(), key=lambda r: r[1]["kld_mean"])]
        n = next(iter(rows.values()))["windows"] if rows else 0
        parts += [f"**{kind}** ({n} windows)", "",
                  markdown_table(["path", "prefill work", "same-top-1 (95% CI)",
                                  "mean KLD (95% CI)",
                                  f"KLD − {BAR_BITS}-bit's, paired by window "
                                  "(95% CI; windows below)",
                                  "p99 KLD (95% CI)"], table), ""]
    return "\n".join(parts)


def _paired_cell(p: Optional[dict[str, Any]]) -> str:
    """A :func:`paired_with` result as a table cell ("–" for the yardstick itself)."""
    if not p or not p["windows"]:
        return "–"
    lo, hi = p["kld_mean_diff_ci"]
    return (f"{p['kld_mean_diff']:+.4f} ({lo:+.4f} to {hi:+.4f}; "
            f"{p['windows_below']}/{p['windows']})")


def check_options(windows: int, length: int, steps: int) -> None:
    """Raise UserInputError for option values the benchmark cannot run with."""
    for name, value, least in (("--windows", windows, 1), ("--length", length, 2),
                               ("--steps", steps, 1)):
        if value < least:
            raise UserInputError(f"{name} must be at least {least}, got {value}")


def resolve_methods(specs: Sequence[str], model: Any) -> dict[str, PruningConfig]:
    """The methods to compare on ``model`` (``full`` first, always) as name -> config.

    Raises:
        UserInputError: an unknown or malformed method, one the model cannot run, or mlx-lm
            (not our engine).
    """
    out: dict[str, PruningConfig] = {FULL: PruningConfig(FULL)}
    for spec in specs:
        if spec == BASELINE:
            raise UserInputError("mlx-lm is not a method here: fidelity compares our engine's "
                                 "methods with `full`, our unpruned path")
        try:
            config = parse_method(spec, num_layers(model)).config
        except ValueError as e:
            raise UserInputError(str(e)) from None
        make_prompt_cache(model, config)  # checks it against the model: fails now, not later
        out.setdefault(spec, config)
    return out


def run(model: Any, tokenizer: Any, methods: dict[str, PruningConfig], windows: int,
        length: int, steps: int, out: Optional[Path] = None,
        info: Optional[dict[str, Any]] = None,
        progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Measure every method and both yardsticks on ``windows`` windows of each kind of text;
    write ``results.json`` and ``table.md`` into ``out`` after every window (a run cut short
    keeps what it measured) and return the result."""
    check_options(windows, length, steps)
    rounded = {yardstick_row(b): yardstick.round_weights(model, b) for b in yardstick.BITS}
    texts = {kind: text_windows(tokenizer, kind_files(kind), windows, length) for kind in KINDS}
    rows = [*methods, *rounded]
    records: dict[str, dict[str, list[dict[str, Any]]]] = {r: {k: [] for k in KINDS} for r in rows}
    result: dict[str, Any] = {
        "meta": {**(info or {}), "windows": windows, "length": length, "steps": steps,
                 "methods": {name: jsonable(c.as_dict()) for name, c in methods.items()},
                 # what each ran: a plain "lazy" names no cuts, its calibrated schedule does
                 "schedules": {name: jsonable(resolve_config(model, c).as_dict())
                               for name, c in methods.items()},
                 "yardsticks": {yardstick_row(b): {"bits": b, "group_size": yardstick.GROUP_SIZE}
                                for b in yardstick.BITS},
                 "texts": {kind: meta for kind, (_, meta) in texts.items()},
                 "interval": f"95% percentile bootstrap over windows, {RESAMPLES} resamples"},
        "records": records, "loadavg_1min": []}
    for done, i in enumerate(spread_order(windows), 1):
        for kind in KINDS:
            prompt = texts[kind][0][i]
            reference = continuation(model, prompt, steps)
            for row in rows:
                model_, config = (rounded[row], None) if row in rounded else (model, methods[row])
                forced = reference if row == FULL else continuation(
                    model_, prompt, steps, config, forced=reference.tokens)
                records[row][kind].append({"window": i, **compare(reference, forced)})
        result["summary"] = summarize(records)
        result["loadavg_1min"].append(loadavg())  # after each window: the noise of the machine
        if out is not None:
            write_text_atomic(out / "results.json", json.dumps(jsonable(result)))
            write_text_atomic(out / "table.md", render(result) + "\n")
        progress(f"window {done}/{windows} of each kind done (load {fmt(loadavg(), '.1f')})")
    return result


def build_parser() -> OneLineParser:
    """The command-line options."""
    p = OneLineParser(prog="python -m mlx_lazy.bench.fidelity",
                      description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help=f"named model ({', '.join(MODELS)}), folder or hub id "
                        "(default smollm2-135m)")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="methods as in python -m mlx_lazy.bench, ';'-separated when one has "
                        f"commas (default {DEFAULT_METHODS!r}; full is always measured)")
    p.add_argument("--windows", type=int, default=50, help="windows per kind of text (default 50)")
    p.add_argument("--length", type=int, default=700, help="tokens per window (default 700)")
    p.add_argument("--steps", type=int, default=32,
                   help="teacher-forced steps per window (default 32)")
    p.add_argument("--min-keep", type=int, default=None, metavar="N",
                   help="the fewest tokens a cut keeps (default: the library's floor, "
                        f"{selection.MIN_KEEP}, what a user's prompt of --length tokens gets; "
                        "0: every cut keeps its fraction, as calibrate measures, so that a "
                        "short window stands for a long prompt)")
    p.add_argument("--out", type=path_arg, required=True,
                   help="folder for results.json and table.md")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit status (2: bad input)."""
    from .. import load

    args = build_parser().parse_args(argv)
    try:
        with output_folder(args.out):
            check_options(args.windows, args.length, args.steps)
            if args.min_keep is not None and args.min_keep < 0:
                raise UserInputError(f"--min-keep must be >= 0, got {args.min_keep}")
            make_folder(args.out)
            model, tokenizer = load(args.model)
            # a window and the steps along its continuation (once run past the context)
            check_context(args.length, args.steps, context_length(model, tokenizer), "--steps")
            methods = resolve_methods(parse_methods(args.methods), model)
            floor = selection.min_keep() if args.min_keep is None else args.min_keep
            with selection.keep_floor(floor):
                result = run(model, tokenizer, methods, args.windows, args.length, args.steps,
                             args.out, {**machine_info(model, "mlx_lazy.bench.fidelity", argv),
                                        "min_keep": floor},
                             progress=lambda line: print(line, file=sys.stderr, flush=True))
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
