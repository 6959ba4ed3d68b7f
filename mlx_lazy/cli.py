"""Command line interface: ``python -m mlx_lazy.generate`` / ``mlx-lazy-generate``.

Shared options keep mlx-lm's names (``--model``, ``-p/--prompt``, ``-m/--max-tokens``,
``--temp``, ``--top-p``, ``--seed``, ``--system-prompt``, ``--ignore-chat-template``,
``--verbose``); the pruning schedule is chosen with ``--method`` (a preset of
:class:`~mlx_lazy.schedule.PruningConfig`) and refined with ``--prune-layers``, ``--keep``,
``--speed-cutoff`` and ``--anchors``.

``--compare`` runs the unpruned baseline (``full``) and then ``--method`` on the same prompt
in one process and prints a side-by-side table. ``--stats-json PATH`` writes
``GenerationStats.as_dict()``; with ``--compare`` the file holds one such object per run,
keyed by method name: ``{"full": {...}, "lazy": {...}}``.

Bad input (unknown model, unsupported architecture, invalid schedule, empty or unreadable
prompt, prompt longer than the model's context) prints a single ``error: ...`` line on
stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, NoReturn, Optional, Sequence

import mlx.core as mx
from mlx_lm.generate import str2bool
from mlx_lm.sample_utils import make_sampler

from .engine import GenerationStats, LazyEngine
from .api import check_context, context_length, load, stream_generate
from .schedule import METHODS, PruningConfig

DEFAULT_PROMPT = "hello"  # same default as mlx-lm
DEFAULT_MAX_TOKENS = 100
BASELINE = "full"
EXIT_BAD_INPUT = 2
MB = 1e6  # tables report decimal megabytes, as mlx-lm reports decimal gigabytes


class UsageError(Exception):
    """Bad user input detected by the CLI itself; reported as one ``error:`` line."""


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are a single ``error: ...`` line (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"error: {message} (see --help)\n")


def _number_list(cast: Callable[[str], float], example: str) -> Callable[[str], tuple]:
    """An argparse type parsing comma-separated numbers like ``example`` with ``cast``."""

    def parse(text: str) -> tuple:
        try:
            return tuple(cast(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated numbers like {example}, got {text!r}"
            ) from None

    return parse


def _cutoff(text: str) -> float | int:
    """Parse a SPEED cutoff: ``"0.75"`` is a fraction of the layers, ``"24"`` a layer count."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a fraction like 0.75 or a layer count like 24, got {text!r}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (mlx-lm's names for shared options, plus pruning options)."""
    p = _Parser(
        prog="mlx-lazy-generate",
        description="Generate text with LazyLLM / SPEED prompt pruning on MLX.",
        epilog=(
            "With --compare, --stats-json writes {method: stats} for both runs, e.g. "
            '{"full": {...}, "lazy": {...}}; otherwise a single stats object.'
        ),
    )
    p.add_argument("--model", default=None,
                   help="named model (smollm2-135m, qwen2.5-coder-0.5b; obtained when "
                        "missing), local model folder or Hugging Face repo (default: "
                        "smollm2-135m)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", default=None,
                     help=f"message to process ('-' reads stdin; default {DEFAULT_PROMPT!r})")
    src.add_argument("--prompt-file", default=None, help="read the message from this UTF-8 file")
    p.add_argument("-m", "--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="maximum number of tokens to generate")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling top-p")
    p.add_argument("--seed", type=int, default=None,
                   help="PRNG seed (also the drop seed of --method random); with --compare "
                        "each run is seeded alike (default 0)")
    p.add_argument("--system-prompt", default=None, help="system prompt for the chat template")
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="use the raw prompt without the tokenizer's chat template")
    p.add_argument("--verbose", type=str2bool, default=True,
                   help="'True': stream output and statistics; 'False': print only the response")

    g = p.add_argument_group("pruning")
    g.add_argument("--method", choices=METHODS, default="full",
                   help="pruning preset (default: full, i.e. no pruning: every approximation "
                        "is opt-in); flags below override its fields")
    g.add_argument("--prune-layers", type=_number_list(int, "8,16,24"), default=None, metavar="L1,L2,...",
                   help="layer indices after which tokens are pruned, e.g. 8,16,24")
    g.add_argument("--keep", type=_number_list(float, "0.7,0.5,0.3"), default=None, metavar="F1,F2,...",
                   help="fraction of the context kept after each pruning layer, e.g. 0.7,0.5,0.3")
    g.add_argument("--speed-cutoff", type=_cutoff, default=None, metavar="X",
                   help="SPEED: prompt tokens get KV only below this depth; a fraction "
                        "(0.75) or a layer count (24)")
    g.add_argument("--anchors", type=int, default=None, metavar="N",
                   help="leading prompt tokens that are never pruned")
    g.add_argument("--pool", type=int, default=None, metavar="R",
                   help="LazyLLM/static: max-pool scores over R neighbouring tokens on each side "
                        "before top-k, so spans survive together (default 0)")
    g.add_argument("--no-revive", dest="revive", action="store_false", default=None,
                   help="LazyLLM: decode steps choose only among tokens that already have KV "
                        "(no Aux Cache revivals; faster decoding, beyond the paper)")
    g.add_argument("--compare", action="store_true",
                   help=f"also run the unpruned baseline ({BASELINE}) and print a comparison table")
    g.add_argument("--stats-json", default=None, metavar="PATH",
                   help="write generation statistics as JSON to PATH")
    return p


def build_config(args: argparse.Namespace) -> PruningConfig:
    """The preset of ``args.method`` with the explicitly given pruning flags overriding it."""
    overrides = {
        name: value
        for name, value in (
            ("prune_layers", args.prune_layers),
            ("keep", args.keep),
            ("speed_cutoff", args.speed_cutoff),
            ("anchors", args.anchors),
            ("revive", args.revive),
            ("pool", args.pool),
            ("seed", args.seed if args.method == "random" else None),
        )
        if value is not None
    }
    return PruningConfig.preset(args.method, **overrides)


def read_prompt(args: argparse.Namespace) -> str:
    """The user message from ``--prompt`` (``-``: stdin) or ``--prompt-file``.

    Raises:
        UsageError: unreadable or non-UTF-8 input, or an empty prompt.
    """
    if args.prompt_file is not None:
        source = f"prompt file {args.prompt_file!r}"
        try:
            with open(args.prompt_file, "rb") as f:
                data = f.read()
        except OSError as e:
            raise UsageError(f"cannot read {source}: {e.strerror or e}") from None
        text = _decode(data, source)
    elif args.prompt == "-":
        text = _decode(sys.stdin.buffer.read(), "stdin")
    else:
        prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
        # mlx-lm lets shell users type \n and \t escapes in -p.
        text = prompt.replace("\\n", "\n").replace("\\t", "\t")
    if not text.strip():
        raise UsageError("the prompt is empty")
    return text


def _decode(data: bytes, source: str) -> str:
    """UTF-8 text of ``data``; a UsageError naming ``source`` and the bad byte otherwise."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"{source} is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})"
        ) from None


def encode_prompt(tokenizer, text: str, system_prompt: Optional[str],
                  ignore_chat_template: bool) -> list[int]:
    """Token ids of the prompt, with the chat template applied the way mlx-lm's CLI does."""
    use_template = not ignore_chat_template and getattr(tokenizer, "has_chat_template", False)
    if use_template:
        messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
        messages.append({"role": "user", "content": text})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    with _quiet_transformers():
        return list(tokenizer.encode(text, add_special_tokens=not use_template))


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' warnings (its too-long-sequence one would duplicate the CLI's own
    one-line context check)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


class PrefillProgress:
    """A tqdm bar over layers on stderr, fed by ``stream_generate``'s ``progress`` callback.

    Appears only once the prefill has lasted ``delay`` seconds, and is removed as soon as
    the last layer is done.
    """

    def __init__(self, desc: str, enabled: bool, file=None, delay: float = 0.5) -> None:
        self.desc = desc
        self.enabled = enabled
        self.file = file if file is not None else sys.stderr
        self.delay = delay
        self._bar = None

    def __call__(self, done_layers: int, total_layers: int) -> None:
        if not self.enabled:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=total_layers, desc=self.desc, unit="layer",
                             file=self.file, leave=False, delay=self.delay)
        self._bar.update(done_layers - self._bar.n)
        if done_layers >= total_layers:  # clear the line before the output text starts
            self.close()

    def close(self) -> None:
        """Remove the bar (safe to call when none was shown)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


@dataclass
class RunResult:
    """One generation: its statistics, full text and output token ids."""

    method: str
    stats: GenerationStats
    text: str
    tokens: list[int] = field(default_factory=list)


def run_once(model, tokenizer, tokens: list[int], config: PruningConfig, args: argparse.Namespace,
             echo: bool, progress: Callable[[int, int], None] | None) -> RunResult:
    """Generate once with ``config``; stream the text to stdout when ``echo``."""
    if args.seed is not None or args.compare:
        # Re-seed per run so sampled outputs of a comparison are comparable.
        mx.random.seed(args.seed if args.seed is not None else 0)
    sampler = make_sampler(args.temp, args.top_p)
    pieces: list[str] = []
    out_tokens: list[int] = []
    resp = None
    for resp in stream_generate(model, tokenizer, tokens, max_tokens=args.max_tokens,
                                config=config, sampler=sampler, progress=progress):
        pieces.append(resp.text)
        if resp.finish_reason != "stop":  # a "stop" response carries the EOS token
            out_tokens.append(resp.token)
        if echo:
            print(resp.text, end="", flush=True)
    if echo:
        print()
    if resp is None:
        raise RuntimeError("stream_generate yielded no response")
    return RunResult(config.method, resp.stats, "".join(pieces), out_tokens)


def first_divergence(a: RunResult, b: RunResult) -> Optional[int]:
    """Index of the first output token where the runs differ; None when the texts agree."""
    if a.text == b.text:
        return None
    for i, (x, y) in enumerate(zip(a.tokens, b.tokens)):
        if x != y:
            return i
    return min(len(a.tokens), len(b.tokens))


def format_summary(stats: GenerationStats) -> str:
    """mlx-lm style statistics lines for one run, plus a pruning line."""
    return "\n".join([
        f"Prompt: {stats.prompt_tokens} tokens, {stats.prompt_tps:.3f} tokens-per-sec "
        f"(time to first token {stats.ttft_s:.3f} s)",
        f"Generation: {stats.generation_tokens} tokens, {stats.generation_tps:.3f} tokens-per-sec",
        f"Peak memory: {stats.peak_memory_bytes / 1e9:.3f} GB",
        f"Pruning ({stats.method}): {stats.prompt_tokens_computed_pct:.1f}% of prompt tokens "
        f"computed, KV {stats.kv_bytes / MB:.2f} MB, aux {stats.aux_bytes / MB:.2f} MB, "
        f"revivals {stats.revivals}",
    ])


def _prefill_work_pct(stats: GenerationStats) -> float:
    """Share of the prompt's token-layer work done in prefill. Unlike
    ``prompt_tokens_computed_pct`` (tokens that reached the top layer), this shows SPEED's
    partial-depth savings."""
    layers = stats.prefill_tokens_per_layer
    full = stats.prompt_tokens * len(layers)
    return 100.0 * sum(layers) / full if full else 0.0


def format_compare_table(base: RunResult, other: RunResult) -> str:
    """Side-by-side table of the baseline and the pruned run, with a ratio column."""
    rows = [
        # label, value getter, format, show ratio
        ("prompt tokens", lambda s: s.prompt_tokens, "{:d}", False),
        ("generated tokens", lambda s: s.generation_tokens, "{:d}", False),
        ("time to first token (s)", lambda s: s.ttft_s, "{:.3f}", True),
        ("time per output token (ms)", lambda s: s.tpot_s * 1e3, "{:.2f}", True),
        ("prompt tokens computed (%)", lambda s: s.prompt_tokens_computed_pct, "{:.1f}", False),
        ("prefill token-layers (%)", _prefill_work_pct, "{:.1f}", False),
        ("KV cache (MB)", lambda s: s.kv_bytes / MB, "{:.2f}", True),
        ("aux cache (MB)", lambda s: s.aux_bytes / MB, "{:.2f}", False),
        ("peak memory (MB)", lambda s: s.peak_memory_bytes / MB, "{:.1f}", True),
        ("revivals", lambda s: s.revivals, "{:d}", False),
    ]
    header = ("metric", base.method, other.method, f"{other.method}/{base.method}")
    table = [header]
    for label, get, fmt, ratio in rows:
        a, b = get(base.stats), get(other.stats)
        r = f"{b / a:.2f}x" if ratio and a else ""
        table.append((label, fmt.format(a), fmt.format(b), r))
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    lines = [
        "  ".join([row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])])
        .rstrip()
        for row in table
    ]
    lines.insert(1, "-" * len(lines[0]))
    div = first_divergence(base, other)
    agree = "identical text" if div is None else f"differ from output token {div}"
    lines.append(f"{'outputs'.ljust(widths[0])}  {agree}")
    return "\n".join(lines)


def _one_line(exc: BaseException) -> str:
    """An exception's message collapsed onto one line."""
    msg = " ".join(str(exc).split())
    return msg or type(exc).__name__


def _load_model(path: Optional[str]):
    """Load a model, reporting a missing or unloadable one as a UsageError."""
    try:
        return load(path)
    except (ValueError, OSError) as e:
        what = "the default model" if path is None else f"model {path!r}"
        raise UsageError(f"cannot load {what}: {_one_line(e)}") from None


def _check_stats_path(path: Optional[str]) -> None:
    """Fail before any generation if ``--stats-json`` could never be written."""
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"--stats-json: directory {parent} does not exist")


def _run(args: argparse.Namespace) -> None:
    """Validate the input, load the model, generate (twice with --compare), report."""
    if args.max_tokens < 1:
        raise UsageError("--max-tokens must be at least 1")
    config = build_config(args)
    if args.compare and config.method == BASELINE:
        raise UsageError(f"--compare runs {BASELINE} against --method; choose a pruning method "
                         f"such as --method lazy")
    _check_stats_path(args.stats_json)
    text = read_prompt(args)
    model, tokenizer = _load_model(args.model)
    # Constructing an engine is cheap; it reports an unsupported architecture or a schedule
    # that does not fit the model before any (baseline) run is spent.
    LazyEngine(model, config)
    tokens = encode_prompt(tokenizer, text, args.system_prompt, args.ignore_chat_template)
    # Checked here too so that nothing (no baseline run) starts before the error.
    check_context(len(tokens), args.max_tokens, context_length(model, tokenizer))

    show_progress = bool(args.verbose) and sys.stderr.isatty()
    configs = [PruningConfig.preset(BASELINE), config] if args.compare else [config]
    results = []
    for cfg in configs:
        if args.verbose:
            print("=" * 10 + (f" {cfg.method}" if args.compare else ""))
        progress = PrefillProgress(f"prefill ({cfg.method})", show_progress)
        try:
            results.append(run_once(model, tokenizer, tokens, cfg, args,
                                    echo=bool(args.verbose), progress=progress))
        finally:
            progress.close()
        if args.verbose:
            print("=" * 10)
            print(format_summary(results[-1].stats))
        elif not args.compare:
            print(results[-1].text)

    if args.compare:
        print(format_compare_table(results[0], results[1]))
    if args.stats_json is not None:
        if args.compare:
            payload = {r.method: r.stats.as_dict() for r in results}
        else:
            payload = results[0].stats.as_dict()
        try:
            with open(args.stats_json, "w", encoding="utf-8") as f:
                json.dump(payload, f, indent=2)
                f.write("\n")
        except OSError as e:
            raise UsageError(f"cannot write --stats-json {args.stats_json}: "
                             f"{e.strerror or e}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, or a usage error already printed
        return e.code if isinstance(e.code, int) else 0
    try:
        _run(args)
    except (UsageError, ValueError, OSError) as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130  # the shell's convention for SIGINT
    return 0
