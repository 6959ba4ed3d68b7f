"""Completion modes: what happens to pruned prompt tokens once the answer has begun.

A mode is a small frozen class with one hook, :meth:`Completion.before_decode`, that the
engine calls before each decode step; adding a mode is one class plus its name in
:data:`COMPLETIONS`. ``PruningConfig.complete`` and the command lines name a mode by its spec
(:func:`parse_completion`): ``none``, ``after-first``, ``exact``, ``progressive:K`` or
``promote:P``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Optional, Protocol, Type

from .errors import UserInputError, shown
from .inputs import MAX_COUNT, is_int


class Completing(Protocol):
    """What a mode sees of the engine that calls it (:class:`mlx_lazy.engine.LazyEngine`)."""

    cache: Any  # the LazyCache: its aux and stash say whether tokens wait

    def complete(self, max_token_layers: Optional[int] = None) -> int: ...

    def promote(self, share: float) -> int: ...

#: The mode of a config that names none and whose schedule records none.
DEFAULT_COMPLETE = "exact"


@dataclass(frozen=True)
class Completion:
    """When tokens waiting in the Aux Cache are carried through their remaining layers."""

    #: the spec's name
    name: ClassVar[str] = ""
    #: the spec of a mode that takes a count, as help texts show it (``progressive:K``); its
    #: one field holds the count
    form: ClassVar[str] = ""
    #: the prompt chunk's hidden states are kept at its first cut that prunes, so the layers
    #: above can be recomputed over every token (:meth:`LazyEngine.complete`)
    stashes: ClassVar[bool] = False
    #: decode steps keep re-selecting even when nothing waits (else, once nothing waits,
    #: every token is attended to at every layer and the cuts spared the prompt only)
    keeps_selecting: ClassVar[bool] = False
    #: tokens may still wait while the answer is decoded (its state is not the full model's)
    waits: ClassVar[bool] = False

    @property
    def spec(self) -> str:
        """The mode as :func:`parse_completion` reads it."""
        return self.name

    @property
    def decode_keep(self) -> float:
        """The least share of the context a decode step keeps at every cut (0: each cut's
        own fraction, as in the prompt)."""
        return 0.0

    def before_decode(self, engine: Completing) -> None:
        """Called by ``engine`` before each decode step."""


@dataclass(frozen=True)
class Never(Completion):
    """The paper's decode: a token is computed at a layer only when a decode step selects it
    (each step re-selects at every cut and revives from the Aux Cache)."""

    name = "none"
    keeps_selecting = True
    waits = True


@dataclass(frozen=True)
class AfterFirst(Completion):
    """Before the first decode step (the first output token is out), carry every waiting
    token through its remaining layers, each (token, layer) once; the kept tokens' deep
    states stay as computed under pruning."""

    name = "after-first"

    def before_decode(self, engine: Completing) -> None:
        if engine.cache.aux:  # a stash (exact's) is completed before any step (atomic)
            engine.complete()


@dataclass(frozen=True)
class Exact(AfterFirst):
    """As :class:`AfterFirst`, but the chunk's layers above its first cut that prunes are
    recomputed for every token from the hidden states stashed there: from the second
    output token on, decoding is the unpruned model's."""

    name = "exact"
    stashes = True


@dataclass(frozen=True)
class Progressive(Completion):
    """``budget`` waiting token-layers before each decode step, lowest layer first."""

    budget: int = 1
    name = "progressive"
    form = "progressive:K"
    waits = True

    def __post_init__(self) -> None:
        b = self.budget
        if not is_int(b) or not 0 < b <= MAX_COUNT:
            raise UserInputError(f"progressive:K takes a positive integer K, got {shown(b)}")

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.budget}"

    def before_decode(self, engine: Completing) -> None:
        engine.complete(self.budget)


@dataclass(frozen=True)
class Promote(Completion):
    """The paper's decode (:class:`Never`) over a wider choice: the prompt is pruned at each
    cut's own fraction, so the first token comes as soon, then before the first decode step
    the best-scoring tokens waiting at each cut are carried through their remaining layers
    in one batch until ``percent``% of the context has keys above it, and every decode step
    keeps that share at each cut (at least the cut's own). Where the paper's decode would
    revive such tokens a few per step, they go as one batch. Each (token, layer) is still
    computed once."""

    percent: int = 40
    name = "promote"
    form = "promote:P"
    keeps_selecting = True
    waits = True

    def __post_init__(self) -> None:
        p = self.percent
        if not is_int(p) or not 0 < p <= 100:
            raise UserInputError(f"promote:P takes a percentage P from 1 to 100, got {shown(p)}")

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.percent}"

    @property
    def decode_keep(self) -> float:
        return self.percent / 100

    def before_decode(self, engine: Completing) -> None:
        engine.promote(self.decode_keep)


#: spec name -> mode class.
COMPLETIONS: Dict[str, Type[Completion]] = {
    c.name: c for c in (Never, AfterFirst, Exact, Progressive, Promote)}
#: The specs, for help texts.
COMPLETE_MODES = tuple(c.form or c.name for c in COMPLETIONS.values())


def parse_completion(spec: Any) -> Completion:
    """The mode a spec names (one of :data:`COMPLETE_MODES`: ``none``, ``after-first``,
    ``exact``, ``progressive:K``, K a positive integer, or ``promote:P``, P a percentage); a
    :class:`Completion` passes through.

    Raises:
        UserInputError: any other value.
    """
    if isinstance(spec, Completion):
        return spec
    if isinstance(spec, str):
        name, sep, k = spec.partition(":")
        cls = COMPLETIONS.get(name)
        # ASCII digits only ("²".isdigit() too), and few enough for int() to take
        if cls is not None and cls.form and sep and k.isascii() and k.isdigit() \
                and len(k) <= 10 and 0 < int(k) <= MAX_COUNT:
            return cls(int(k))
        if cls is not None and not cls.form and not sep:
            return cls()
    raise UserInputError(f"complete must be one of {', '.join(COMPLETE_MODES[:-1])} or "
                         f"{COMPLETE_MODES[-1]} (K a positive integer, P a percentage from 1 "
                         f"to 100), got {shown(spec)}")
