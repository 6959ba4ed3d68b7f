"""Command line interface: ``python -m mlx_lazy.generate`` / ``mlx-lazy-generate``.

Shared options keep mlx-lm's names (``--model``, ``-p/--prompt``, ``-m/--max-tokens``,
``--temp``, ``--top-p``, ``--seed``, ``--system-prompt``, ``--ignore-chat-template``,
``--verbose``); the pruning schedule is chosen with ``--method`` (``full`` or policies of
:data:`~mlx_lazy.policies.POLICIES` joined by ``+``, e.g. ``lazy+speed``) and refined with
``--prune-layers``, ``--keep``, ``--speed-cutoff`` and ``--anchors``.

``--compare`` runs the unpruned baseline (``full``) and then ``--method`` on the same prompt
in one process and prints a side-by-side table. ``--stats-json PATH`` writes
``GenerationStats.as_dict()``; with ``--compare`` the file holds one such object per run,
keyed by method name: ``{"full": {...}, "lazy": {...}}``.

Bad input (unknown model, unsupported architecture, invalid schedule or flag value, empty,
unreadable or non-UTF-8 prompt, prompt longer than the model's context, an unwritable
``--stats-json``) raises :class:`~mlx_lazy.errors.UserInputError`, printed as a single
``error: ...`` line on stderr with exit status 2, before the model is loaded where it can be.
Any other exception is an internal error: its traceback is shown and the status is 1.
Ctrl-C prints one line and exits with status 130.

Under ``mlx.launch`` with more than one rank the model is sharded over the ranks
(:mod:`mlx_lazy.distributed`); only rank 0 prints and writes ``--stats-json``, and an error
on any rank is printed once, by rank 0, and ends every rank. Every rank must be given the same
model, prompt, pruning flags and :data:`GENERATION_OPTIONS`: a difference is such an error.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import replace
from typing import Callable, Iterator, Optional, Sequence

import mlx.core as mx

from . import distributed
from ._args import (EXIT_BAD_INPUT, EXIT_INTERRUPTED, METHOD_HELP, OneLineParser,
                    add_sampling_arguments, complete_arg, integer_arg, method_arg, number_arg,
                    sampler, seed_arg)
from .api import check_prompt, decision_digest, load, stream_generate
from .prompt_cache import PromptCache, load_prompt_cache, make_prompt_cache
from .errors import UserInputError, one_line
from .folders import check_not_an_input
from .inputs import parse_float, parse_int, regular_file
from .config import QUALITIES, PruningConfig
from .policies import RandomDrop, compose
from .prompt_input import (add_prompt_arguments, argv_text, check_cache_template, encode_prompt,
                           read_prompt)
from .run_report import RunResult, format_compare_table, format_summary
from .schedule_files import DECODE_FIELDS, SCHEDULE_FIELDS, read_schedule_flag
from .resolve import check_config
from .schedule import Schedule
from .scorers import SCORERS, Scorer, parse_scorer

DEFAULT_MAX_TOKENS = 100
BASELINE = "full"
#: Flags besides the prompt and the pruning schedule that shape what every rank computes.
GENERATION_OPTIONS = ("max_tokens", "temp", "top_p", "seed", "compare")


def _number_list(cast: Callable[[str], float], example: str) -> Callable[[str], tuple]:
    """An argparse type parsing comma-separated numbers like ``example`` with ``cast``."""

    def parse(text: str) -> tuple:
        items = text.split(",")
        if not all(x.strip() for x in items):
            raise argparse.ArgumentTypeError(
                f"an empty item in {text!r}; expected comma-separated numbers like {example}")
        try:
            return tuple(cast(x.strip()) for x in items)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated numbers like {example}, got {text!r}"
            ) from None

    return parse


def _cutoff(text: str) -> float | int:
    """Parse a SPEED cutoff: ``"0.75"`` is a fraction of the layers, ``"24"`` a layer count."""
    try:
        return parse_int(text)
    except ValueError:
        pass
    try:
        return parse_float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a fraction like 0.75 or a layer count like 24, got {text!r}"
        ) from None


def _scorer_arg(text: str) -> Scorer:
    try:
        return parse_scorer(text)
    except UserInputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _str2bool(text: str) -> bool:
    """mlx-lm's reading of a boolean flag (anything but "false" / "f" is True), with a warning
    line for words that are neither true nor false."""
    value = text.lower() not in ("false", "f")
    if text.lower() not in ("true", "t", "false", "f"):
        print(f"warning: read {text!r} as {value}, as mlx-lm does; write True or False",
              file=sys.stderr)
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (mlx-lm's names for shared options, plus pruning options)."""
    p = OneLineParser(
        prog="mlx-lazy-generate",
        description="Generate text with LazyLLM / SPEED prompt pruning on MLX.",
        epilog=(
            "With --compare, --stats-json writes {method: stats} for both runs, e.g. "
            '{"full": {...}, "lazy": {...}}; otherwise a single stats object.'
        ),
    )
    add_prompt_arguments(p)
    add_sampling_arguments(p, DEFAULT_MAX_TOKENS)
    p.add_argument("--seed", type=seed_arg, default=None,
                   help="PRNG seed (also the drop seed of a --method with random); with "
                        "--compare each run is seeded alike (default 0)")
    p.add_argument("--verbose", type=_str2bool, default=True,
                   help="'True': stream output and statistics; 'False': print only the response")

    g = add_pruning_arguments(p)
    g.add_argument("--prompt-cache-file", default=None, metavar="FILE",
                   help="a prompt cache (python -m mlx_lazy.cache_prompt): the prompt given is "
                        "appended to the cached one, which is not recomputed")
    g.add_argument("--compare", action="store_true",
                   help=f"also run the unpruned baseline ({BASELINE}) and print a comparison table")
    g.add_argument("--stats-json", default=None, metavar="PATH",
                   help="write generation statistics as JSON to PATH")
    return p


def add_pruning_arguments(p: argparse.ArgumentParser,
                          default_method: str = "full: every approximation is opt-in"
                          ) -> argparse._ArgumentGroup:
    """The pruning options, shared by the tools that build a :class:`PruningConfig`
    (:func:`build_config`); returns their group. ``default_method`` is what the tool's help
    says ``--method`` defaults to."""
    g = p.add_argument_group("pruning")
    g.add_argument("--method", type=method_arg, default=None, metavar="METHOD",
                   help=f"{METHOD_HELP} (default: {default_method}); flags below override its "
                        "preset's fields")
    g.add_argument("--prune-layers", type=_number_list(parse_int, "8,16,24"), default=None,
                   metavar="L1,L2,...",
                   help="layer indices after which tokens are pruned, e.g. 8,16,24")
    g.add_argument("--keep", type=_number_list(parse_float, "0.7,0.5,0.3"), default=None,
                   metavar="F1,F2,...",
                   help="fraction of the context kept after each pruning layer, e.g. 0.7,0.5,0.3")
    g.add_argument("--speed-cutoff", type=_cutoff, default=None, metavar="X",
                   help="SPEED: prompt tokens get KV only below this depth; a fraction "
                        "(0.75; 1.0 is every layer) or a layer count (24; 1 is one layer)")
    g.add_argument("--anchors", type=integer_arg, default=None, metavar="N",
                   help="leading prompt tokens that are never pruned")
    g.add_argument("--scorer", type=_scorer_arg, default=None, metavar="SPEC",
                   help=f"LazyLLM/static: what ranks the context at each cut, NAME[:field=value"
                        f"...] with NAME one of {', '.join(SCORERS)}: 'last' (the query token's "
                        "attention, the paper), 'window:size=32' (the last 32 prompt tokens' "
                        "attention; the window is always kept); ':heads=max' reduces over "
                        "heads by max, ':pool=R' max-pools scores over R neighbouring tokens "
                        "on each side so spans survive together")
    g.add_argument("--schedule", default=None, metavar="FILE",
                   help="a calibrated schedule file (python -m mlx_lazy.calibrate) for this "
                        "model; sets the method, cuts and scorer")
    g.add_argument("--complete", type=complete_arg, default=None, metavar="MODE",
                   help="LazyLLM: what happens to pruned tokens after the first output token "
                        "(default: the calibrated schedule's, else exact): exact (the prompt's "
                        "layers above the first cut are recomputed over every token, so "
                        "decoding is the unpruned model's), "
                        "after-first (only the pruned tokens are carried on, from the Aux "
                        "Cache, each token-layer once), none (the paper: computed when a "
                        "decode step selects them), progressive:K (K token-layers per "
                        "output token) or promote:P (none, but before the second token the "
                        "best-scoring pruned tokens are carried on until P%% of the prompt "
                        "has every layer, and decode steps keep P%%)")
    g.add_argument("--quality", choices=QUALITIES, default=None,
                   help="LazyLLM: which calibrated schedule --method lazy takes: default (the "
                        "fastest that deviates from full at most as much as 4-bit weights) or "
                        "high (at most a quarter of that)")
    g.add_argument("--no-revive", dest="revive", action="store_false", default=None,
                   help="LazyLLM: decode steps choose only among tokens that already have KV "
                        "(no Aux Cache revivals; faster decoding, beyond the paper)")
    g.add_argument("--max-revivals", type=integer_arg, default=None, metavar="R",
                   help="LazyLLM: the most pruned tokens a decode step revives at one cut, "
                        "the best-scoring first (default: the calibrated schedule's, else no "
                        "bound, the paper); 0: none")
    g.add_argument("--revive-margin", type=number_arg, default=None, metavar="M",
                   help="LazyLLM: a decode step revives a pruned token only when it scores "
                        "1+M times a token that already has KV (default: the calibrated "
                        "schedule's, else 0, the paper)")
    g.add_argument("--reselect-every", type=integer_arg, default=None, metavar="K",
                   help="LazyLLM: decode steps re-select at the cuts every K steps, those "
                        "between seeing the last choice (default: the calibrated schedule's, "
                        "else 1, the paper)")
    return g


def pruning_given(args: argparse.Namespace) -> bool:
    """Whether any pruning flag was given (a prompt cache's own config applies otherwise)."""
    return args.method is not None or args.schedule is not None or any(
        getattr(args, f) is not None for f in PRUNING_OVERRIDES)


#: The pruning flags that override a method's preset fields (``args`` names).
PRUNING_OVERRIDES = ("prune_layers", "keep", "speed_cutoff", "anchors", "revive", "complete",
                     "max_revivals", "revive_margin", "reselect_every", "scorer", "quality")


def build_config(args: argparse.Namespace) -> PruningConfig:
    """The preset of ``args.method`` (``full`` when not given), or the ``--schedule`` file's
    config, with the explicitly given pruning flags overriding it (of a schedule, only its
    decode fields: ``--complete``, ``--max-revivals``, ``--revive-margin``,
    ``--reselect-every``)."""
    overrides = {f: getattr(args, f) for f in PRUNING_OVERRIDES if getattr(args, f) is not None}
    if args.schedule is None:
        with _as_flags(overrides):
            config = PruningConfig.preset(args.method or BASELINE, **overrides)
    else:
        config = read_schedule_flag(args.schedule, args.method)
        fixed = sorted(set(overrides) & set(SCHEDULE_FIELDS) - set(DECODE_FIELDS))
        if fixed:
            raise UserInputError("--schedule sets the method, cuts and scorer; drop " + ", ".join(
                map(_flag, fixed)))
        with _as_flags(overrides):
            config = replace(config, **overrides)
    seed = getattr(args, "seed", None)
    if seed is not None and RandomDrop in compose(config.method).values():
        config = replace(config, seed=seed)
    return config


def _flag(field: str) -> str:
    """The command-line flag of a :class:`PruningConfig` field."""
    return "--" + field.replace("_", "-")


@contextmanager
def _as_flags(given: dict) -> Iterator[None]:
    """Name a refused field by its flag where the user gave it as one (``max_revivals must
    be ...`` reads ``--max-revivals must be ...``)."""
    try:
        yield
    except UserInputError as e:
        field = e.field
        if field in given and str(e).startswith(field + " "):
            raise UserInputError(_flag(field) + str(e)[len(field):]) from None
        raise


class PrefillProgress:
    """A tqdm bar over prompt tokens on stderr, fed by ``stream_generate``'s
    ``prompt_progress_callback(processed, total)`` (as mlx-lm's).

    Appears only once the prefill has lasted ``delay`` seconds, and is removed as soon as
    the whole prompt is processed.
    """

    def __init__(self, desc: str, enabled: bool, file=None, delay: float = 0.5) -> None:
        self.desc = desc
        self.enabled = enabled
        self.file = file if file is not None else sys.stderr
        self.delay = delay
        self._bar = None

    def __call__(self, processed: int, total: int) -> None:
        if not self.enabled:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=self.desc, unit="tok",
                             file=self.file, leave=False, delay=self.delay)
        self._bar.update(processed - self._bar.n)
        if processed >= total:  # clear the line before the output text starts
            self.close()

    def close(self) -> None:
        """Remove the bar (safe to call when none was shown)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def run_once(model, tokenizer, tokens: list[int], cache: PromptCache, args: argparse.Namespace,
             echo: bool, progress: Callable[[int, int], None] | None) -> RunResult:
    """Generate once on top of ``cache``; stream the text to stdout when ``echo``."""
    if args.seed is not None or args.compare:
        # Re-seed per run so sampled outputs of a comparison are comparable.
        mx.random.seed(args.seed if args.seed is not None else 0)
    pieces: list[str] = []
    out_tokens: list[int] = []
    resp = None
    for resp in stream_generate(model, tokenizer, tokens, max_tokens=args.max_tokens,
                                prompt_cache=cache, sampler=sampler(args.temp, args.top_p),
                                prompt_progress_callback=progress):
        pieces.append(resp.text)
        if resp.finish_reason != "stop":  # a "stop" response carries the EOS token
            out_tokens.append(resp.token)
        if echo:
            print(resp.text, end="", flush=True)
    if echo:
        print()
    if resp is None:
        raise RuntimeError("stream_generate yielded no response")
    return RunResult(cache.schedule.method, resp.stats, "".join(pieces), out_tokens)


def load_model(path: Optional[str], group=None):
    """Load a model (sharded over ``group``); :func:`mlx_lazy.load` reports bad model
    folders as UserInputError."""
    try:
        return load(path, group=group)
    except OSError as e:  # reading the user's folder, or the default model's cache
        what = "the default model" if path is None else f"model {path!r}"
        raise UserInputError(f"cannot load {what}: {one_line(e)}") from None


def _check_stats_path(path: Optional[str]) -> None:
    """Fail before any generation if ``--stats-json`` cannot be written: open it for
    appending (nothing truncated; without blocking, so a FIFO nobody reads is refused rather
    than waited on) and write zero bytes, which a device that refuses writes (``/dev/full``)
    rejects; a file created by the probe is removed again."""
    if path is None:
        return
    if not path:
        raise UserInputError("--stats-json is empty; give a file name")
    if os.path.isdir(path):
        raise UserInputError(f"--stats-json {path} is a directory; give a file name")
    existed = os.path.lexists(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o666)
        try:
            os.write(fd, b"")
        finally:
            os.close(fd)
            if not existed:
                os.unlink(path)
    except OSError as e:
        raise UserInputError(f"cannot write --stats-json {path}: {e.strerror or e}") from None


def _run(args: argparse.Namespace, group=None) -> None:
    """Validate the input, load the model, generate (twice with --compare), report."""
    # Each start-up step ends on every rank alike (distributed.together): one rank's
    # error stops them all.
    with distributed.together(group) as same:
        same["generation options"] = distributed.digest_of(
            {name: getattr(args, name) for name in GENERATION_OPTIONS})
        if args.max_tokens < 1:
            raise UserInputError("--max-tokens must be at least 1")
        if args.anchors is not None and args.schedule is None and \
                (args.method or BASELINE) == BASELINE:
            raise UserInputError(f"--anchors applies to pruning methods; --method {BASELINE} "
                                 f"prunes nothing")
        config = build_config(args)
        check_config(config)  # what needs no model, before it loads
        if args.compare and config.method == BASELINE:
            raise UserInputError(f"--compare runs {BASELINE} against --method; choose a pruning "
                                 f"method such as --method lazy")
        if args.prompt_cache_file is not None:
            if args.compare:
                raise UserInputError("--compare starts both runs from an empty state; drop "
                                     "--prompt-cache-file")
            if args.system_prompt is not None:  # the cache's prompt begins the conversation
                raise UserInputError("--system-prompt belongs to the cached prompt: give it "
                                     "to mlx_lazy.cache_prompt, and drop it here")
            regular_file(args.prompt_cache_file, "--prompt-cache-file")
        if distributed.is_rank0(group):
            check_not_an_input(args.stats_json, "--stats-json", {
                "--prompt-cache-file": args.prompt_cache_file, "--prompt-file": args.prompt_file,
                "--schedule": args.schedule})
            _check_stats_path(args.stats_json)
        text = read_prompt(args)
        system_prompt = (None if args.system_prompt is None
                         else argv_text(args.system_prompt, "--system-prompt"))
    model, tokenizer = load_model(args.model, group)
    with distributed.together(group) as same:
        # Making a cache is cheap; it reports an unsupported architecture or a schedule
        # that does not fit (or was calibrated for another) model before any (baseline) run
        # is spent.
        if args.prompt_cache_file is None:
            cache = make_prompt_cache(model, config)
        else:
            cache, metadata = load_prompt_cache(args.prompt_cache_file, model,
                                                return_metadata=True)
            if pruning_given(args):  # else the cache's own config
                cache.check(model, config)
            check_cache_template(metadata, tokenizer, args.ignore_chat_template,
                                 args.prompt_cache_file)
        tokens = encode_prompt(tokenizer, text, system_prompt, args.ignore_chat_template,
                               "whole" if args.prompt_cache_file is None else "suffix")
        same["prompt tokens"] = distributed.digest(str(cache.tokens + tokens).encode())
        same["pruning settings"] = decision_digest(cache.schedule)
        # Checked here too so that nothing (no baseline run) starts before the error.
        check_prompt(cache.engine, tokenizer, cache.tokens + tokens, args.max_tokens,
                     "-m/--max-tokens")

    show_progress = bool(args.verbose) and sys.stderr.isatty() and distributed.is_rank0(group)
    # the baseline is the unpruned plan itself: the run's one resolve was the config's, above
    baseline = Schedule.full(cache.schedule.num_layers)
    results = []
    for plan in ([baseline, None] if args.compare else [None]):
        # The baseline's cache is let go before the next run, so that each run's peak memory
        # is its own, not the baseline's KV held beside it.
        run_cache = cache if plan is None else make_prompt_cache(model, plan)
        method = run_cache.schedule.method
        if args.verbose:
            print("=" * 10 + (f" {method}" if args.compare else ""))
        progress = PrefillProgress(f"prefill ({method})", show_progress)
        try:
            results.append(run_once(model, tokenizer, tokens, run_cache, args,
                                    echo=bool(args.verbose), progress=progress))
        finally:
            progress.close()
        if args.verbose:
            print("=" * 10)
            print(format_summary(results[-1].stats))
        else:  # the response alone; under its method's name when two are compared
            print(f"{method}: {results[-1].text}" if args.compare else results[-1].text)

    if args.compare:
        print(format_compare_table(results[0], results[1]))
    if args.stats_json is not None and distributed.is_rank0(group):
        if args.compare:
            payload = {r.method: r.stats.as_dict() for r in results}
        else:
            payload = results[0].stats.as_dict()
        try:
            with open(args.stats_json, "w", encoding="utf-8") as f:
                json.dump(payload, f, indent=2)
                f.write("\n")
        except OSError as e:
            raise UserInputError(f"cannot write --stats-json {args.stats_json}: "
                                 f"{e.strerror or e}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    group = distributed.world()
    rank0 = distributed.is_rank0(group)
    try:
        # Every rank parses the same arguments: only rank 0 shows help and usage errors.
        with redirect_stderr(sys.stderr if rank0 else io.StringIO()), \
                redirect_stdout(sys.stdout if rank0 else io.StringIO()):
            args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, or a usage error already printed
        return e.code if isinstance(e.code, int) else 0
    try:
        with open(os.devnull, "w") as null, redirect_stdout(sys.stdout if rank0 else null):
            _run(args, group)
    except UserInputError as e:
        if rank0:  # our own messages are short; the cut is for third-party ones
            print(f"error: {one_line(e, limit=1000)}", file=sys.stderr)
        distributed.barrier(group)  # no rank ends (and gets the others stopped) before it
        return EXIT_BAD_INPUT
    except RuntimeError as e:
        if distributed.lost_peer(e):
            e = RuntimeError(f"another rank stopped (failed or was killed): {e}")
        elif not isinstance(e, distributed.RankFailed):
            raise
        if rank0:
            print(f"error: {one_line(e)}", file=sys.stderr)
        if isinstance(e, distributed.RankFailed):
            distributed.barrier(group)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0
