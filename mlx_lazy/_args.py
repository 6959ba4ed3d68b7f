"""Command-line pieces shared by the tools (generate, cache_prompt, the server, the demo and
the benchmarks): one-line usage errors, the exit statuses, and the argument types and flags
that mean the same everywhere."""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path
from typing import Callable, NoReturn

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

from .completion import parse_completion
from .errors import UserInputError
from .inputs import parse_float, parse_int
from .policies import POLICIES, canonical_method

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # the shell's convention for SIGINT


class OneLineParser(argparse.ArgumentParser):
    """ArgumentParser whose errors are a single ``error: ...`` line (exit status 2)."""

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        flags = re.match(r"argument (\S+): expected one argument$", message)
        if flags and self._took_a_dash_value(flags[1].split("/")):
            message += " (a value that starts with '-': write --flag=VALUE)"
        self.exit(EXIT_BAD_INPUT, f"error: {message} (see --help)\n")

    def _took_a_dash_value(self, flags: list) -> bool:
        """Whether a flag of ``flags`` is followed by a word starting with '-' that is no
        option (argparse reads ``--keep -0.1,-0.2``'s value as a flag; ``--keep`` at the end,
        or before another option, has none)."""
        argv = getattr(self, "_argv", [])
        return any(word in flags and i + 1 < len(argv) and argv[i + 1].startswith("-")
                   and argv[i + 1].split("=")[0] not in self._option_string_actions
                   for i, word in enumerate(argv))


def complete_arg(text: str) -> str:
    """Parse a ``complete`` mode (:func:`~mlx_lazy.completion.parse_completion`) into its canonical
    spelling."""
    try:
        return parse_completion(text).spec
    except UserInputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def method_arg(text: str) -> str:
    """Parse a pruning method (``full`` or policies joined by ``+``) into its canonical
    spelling, so ``speed+lazy`` reads as ``lazy+speed``."""
    try:
        return canonical_method(text)
    except UserInputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


#: ``--method``'s help, shared by the tools that take one.
METHOD_HELP = (f"pruning method: full (no pruning) or policies joined by '+' in any order "
               f"({', '.join(POLICIES)}), e.g. lazy+speed")


def temperature_arg(text: str) -> float:
    """A sampling temperature: a finite number >= 0 (0: greedy)."""
    t = _number(text)
    if not (math.isfinite(t) and t >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0 (0: greedy), got {text!r}")
    return t


def top_p_arg(text: str) -> float:
    """A sampling top-p in (0, 1] (1: off)."""
    p = _number(text)
    if not 0 < p <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1] (1: off), got {text!r}")
    return p


#: A temperature below this samples greedily, its limit: the sampler multiplies the
#: log-probabilities by 1/T in the model's dtype, where 1/T past float16's 65504 (T = 1e-300
#: past float32's too) is infinite and the top token's 0 * inf is NaN (uniformly random
#: tokens, once).
MIN_TEMPERATURE = 1e-4
#: A top-p below this samples greedily: it keeps the most likely token alone in any
#: vocabulary of up to a million tokens (that token has at least 1/V of the mass), and one
#: that underflows float32 (5e-324) once made the nucleus empty.
MIN_TOP_P = 1e-6


def sampler(temperature: float, top_p: float, min_p: float = 0.0,
            top_k: int = 0) -> Callable[[mx.array], mx.array]:
    """mlx-lm's sampler for ``temperature``, ``top_p``, ``min_p`` and ``top_k`` (0: off);
    greedy below :data:`MIN_TEMPERATURE` or :data:`MIN_TOP_P`, which the sampler cannot
    use."""
    if temperature < MIN_TEMPERATURE or top_p < MIN_TOP_P:
        temperature = 0.0
    return make_sampler(temperature, top_p, min_p=min_p, top_k=top_k)


def seed_arg(text: str) -> int:
    """A PRNG seed: an integer in [0, 2**64)."""
    try:
        seed = int(text)
    except ValueError:
        seed = -1
    if not 0 <= seed < 2**64:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**64), got {text!r}")
    return seed


def integer_arg(text: str) -> int:
    """An integer in ASCII decimal digits (:func:`~mlx_lazy.inputs.parse_int`)."""
    try:
        return parse_int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def path_arg(text: str) -> Path:
    """A path, never empty (``Path("")`` would be the current folder)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    return Path(text)


def number_arg(text: str) -> float:
    """A finite decimal number (:func:`~mlx_lazy.inputs.parse_float`)."""
    try:
        return parse_float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite decimal number, got {text!r}") \
            from None


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def add_sampling_arguments(p: argparse.ArgumentParser, max_tokens: int, what: str = "") -> None:
    """``-m/--max-tokens``, ``--temp`` and ``--top-p`` (mlx-lm's names); ``what`` prefixes
    their help, e.g. ``"default "`` for a server's defaults of requests."""
    p.add_argument("-m", "--max-tokens", type=int, default=max_tokens,
                   help=f"{what}maximum number of tokens to generate (default {max_tokens})")
    p.add_argument("--temp", type=temperature_arg, default=0.0,
                   help=f"{what}sampling temperature (0, or below {MIN_TEMPERATURE:g}: greedy)")
    p.add_argument("--top-p", type=top_p_arg, default=1.0, help=f"{what}sampling top-p, in (0, 1]")
