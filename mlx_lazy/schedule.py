"""Pruning configuration: which prompt tokens go through which layers.

The data flows one way: a :class:`PruningConfig` is what users write (a method plus
optional fields, with presets); its method names the :class:`Policy` units it composes
(:data:`POLICIES`); :meth:`PruningConfig.resolve` lets each policy contribute its part to a
:class:`Schedule`, the concrete per-layer plan the engine executes. A method is ``full``
(no policy) or policy names joined by ``+``: ``lazy+speed`` is LazyLLM cuts composed with
the SPEED cutoff. Every policy is one of two mechanisms:

* **cuts** (LazyLLM, static pruning): after each pruning layer, keep the top fraction of
  the context by a scorer (:mod:`mlx_lazy.scorers`); LazyLLM redoes it at every decode step;
* **depth limits** (SPEED, random drop): a prompt token that is dropped permanently never
  goes above its limit, so it never needs an Aux Cache entry.

Keep fractions are fractions of the whole context (prompt plus generated tokens) that
survive past each pruning layer, so they must not increase.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import warnings
from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar, Dict, Mapping, Optional, Tuple, Type, Union

import numpy as np

from .errors import UserInputError
from .folders import write_text_atomic
from .inputs import MiB, read_json
from .scorers import Scorer, default_window, make_scorer

#: The ``format`` of schedule files (written by ``python -m mlx_lazy.calibrate``).
SCHEDULE_FORMAT = "mlx-lazy-schedule/1"
#: PruningConfig fields a schedule file sets; the rest (revive, anchors, seed) stay the caller's.
SCHEDULE_FIELDS = ("method", "prune_layers", "keep", "scorer", "heads", "window", "pool")
#: Calibrated schedules shipped with the package, matched to models by fingerprint.
PACKAGED_SCHEDULES = Path(__file__).parent / "data" / "schedules"
#: A model folder holding this file makes ``--method lazy`` use it (see ``mlx_lazy.load``).
MODEL_SCHEDULE_FILE = "mlx_lazy_schedule.json"
#: The schedules calibrate writes per model, by ``PruningConfig.quality``: ``default``, the
#: fastest whose deviation (mean KLD against ``full``) is at most 4-bit weights'; ``high``,
#: the fastest at most a quarter of that. Files are named ``X.json`` and ``X.high.json``.
QUALITIES = ("default", "high")
#: Bounds of schedule files (calibrate writes a few KiB, nested 4 deep).
SCHEDULE_MAX_BYTES = 1 * MiB
SCHEDULE_MAX_DEPTH = 16
#: The largest token count, position or layer index a config may hold: MLX indexes with
#: int32, and larger values would only fail later, inside numpy or MLX.
MAX_COUNT = 2**31 - 1
#: Seeds are what ``mx.random.seed`` and numpy take: integers in [0, 2**64).
SEED_LIMIT = 2**64


@dataclass(frozen=True)
class Schedule:
    """A pruning plan resolved against a model with ``num_layers`` layers.

    Attributes:
        method: the method name this plan came from.
        num_layers: depth of the model.
        prune_layers: layer indices whose attention scores the context; the kept tokens
            continue to the next layer.
        keep: fraction of the context kept after each of ``prune_layers``.
        dynamic: re-select at every decode step (LazyLLM) rather than once in prefill.
        revive: with ``dynamic``, pruned tokens keep their hidden state in the Aux Cache
            and can come back; without, decode steps re-select only among tokens that
            already have KV at the next layer.
        complete: when tokens waiting in the Aux Cache are carried through their remaining
            layers (see :func:`parse_complete`; without ``revive`` none wait).
        scorer: the registered scorer (:data:`mlx_lazy.scorers.SCORERS`) that ranks the
            context at each cut.
        heads: how the scorer reduces attention over heads, ``"mean"`` or ``"max"``.
        window: the ``"window"`` scorer's number of trailing prompt queries (else None).
        pool: radius of the max-pooling of scores over neighbouring candidates before
            top-k (0: none).
        prompt_depth: number of layers that non-anchor prompt tokens may reach (SPEED
            cutoff; ``num_layers`` when unused).
        random_keep: fraction of prompt tokens kept before layer 0 (random drop), or None.
        anchors: number of leading prompt tokens that are always kept at full depth.
        seed: seed of the random drop.
        source: where the cuts came from: ``"preset"``, ``"user"`` or
            ``"calibrated:<file name>"``.
    """

    method: str
    num_layers: int
    prune_layers: Tuple[int, ...] = ()
    keep: Tuple[float, ...] = ()
    dynamic: bool = False
    revive: bool = False
    complete: str = "none"
    scorer: str = "last"
    heads: str = "mean"
    window: Optional[int] = None
    pool: int = 0
    prompt_depth: int = 0
    random_keep: Optional[float] = None
    anchors: int = 1
    seed: int = 0
    source: str = "preset"

    @property
    def prunes(self) -> bool:
        """True when any prompt token may skip a layer."""
        return bool(self.prune_layers) or self.random_keep is not None or (
            self.prompt_depth < self.num_layers
        )

    def keep_after(self, layer: int) -> Optional[float]:
        """Fraction kept after ``layer``, or None when ``layer`` is not a pruning layer."""
        if layer in self.prune_layers:
            return self.keep[self.prune_layers.index(layer)]
        return None

    def make_scorer(self) -> Scorer:
        """The scorer this plan selects with."""
        return make_scorer(self.scorer, self.heads, self.window, self.pool)

    def as_dict(self) -> dict:
        """JSON-friendly form."""
        d = asdict(self)
        d["prune_layers"] = list(self.prune_layers)
        d["keep"] = list(self.keep)
        return d


# ---------------------------------------------------------------------------- policies


class Policy:
    """One unit of a pruning method: which layers cut and how much, or what depth limit
    applies. Adding one is a subclass plus a line in :data:`POLICIES`.

    A policy is a frozen dataclass whose fields hold its preset; :meth:`apply` turns the
    :class:`PruningConfig` fields it :attr:`takes` (the preset's values where they are None)
    into its part of the :class:`Schedule`, checking them.
    """

    #: The PruningConfig fields this policy reads. A method refuses a field that none of its
    #: policies takes; two policies that take the same field do not compose (the field would
    #: mean two things). Fields no policy takes (anchors, seed) apply to every method.
    takes: ClassVar[Tuple[str, ...]] = ()

    @classmethod
    def preset(cls, method: Dict[str, Type["Policy"]]) -> "Policy":
        """This policy's preset within ``method`` (all the method's policies, by name)."""
        return cls()

    def apply(self, config: "PruningConfig", schedule: Schedule) -> Schedule:
        """``schedule`` with this policy's part set from ``config``.

        Raises:
            UserInputError: a value of ``config`` that does not fit ``schedule``'s model.
        """
        raise NotImplementedError


@dataclass(frozen=True)
class SpeedCutoff(Policy):
    """SPEED: prompt tokens other than the anchors and the last one get KV only below the
    cutoff, a fraction of the layers (float) or a layer count (int)."""

    takes = ("speed_cutoff",)
    cutoff: Union[float, int] = 0.75

    def apply(self, config: "PruningConfig", schedule: Schedule) -> Schedule:
        cutoff = self.cutoff if config.speed_cutoff is None else config.speed_cutoff
        return replace(schedule, prompt_depth=_resolve_cutoff(cutoff, schedule.num_layers))


@dataclass(frozen=True)
class RandomDrop(Policy):
    """Random drop (a baseline): before layer 0 keep one fraction of the prompt, drawn with
    the config's ``seed``; the dropped tokens are never computed."""

    takes = ("keep",)
    keep: Tuple[float, ...] = (0.5,)

    def apply(self, config: "PruningConfig", schedule: Schedule) -> Schedule:
        keep = self.keep if config.keep is None else config.keep
        if len(keep) != 1:
            raise UserInputError(
                f"method {schedule.method!r} takes one keep fraction, got {len(keep)}")
        _check_fraction(keep[0])
        return replace(schedule, random_keep=keep[0])


@dataclass(frozen=True)
class ScoredCuts(Policy):
    """Cuts after chosen layers that keep the top fraction of the context by a scorer.

    ``at`` (fractions of the depth, see :func:`layers_at`) and ``keep`` are the preset cuts,
    placed below any depth limit already in the schedule.
    """

    takes = ("prune_layers", "keep", "pool", "scorer", "heads", "window")
    #: re-select at every decode step (else once, in prefill)
    dynamic: ClassVar[bool] = False
    #: exactly one cut
    once: ClassVar[bool] = False
    at: Tuple[float, ...] = ()
    keep: Tuple[float, ...] = ()

    def apply(self, config: "PruningConfig", schedule: Schedule) -> Schedule:
        scorer = "last" if config.scorer is None else config.scorer
        heads = "mean" if config.heads is None else config.heads
        window = config.window
        make_scorer(scorer, heads, window, config.pool)  # the scorer checks its own fields
        m, num_layers, depth = schedule.method, schedule.num_layers, schedule.prompt_depth
        if config.prune_layers is None:
            if min(num_layers, depth) < 2:
                bound, fix = (
                    (f"SPEED cutoff {depth}", "raise speed_cutoff to at least 2")
                    if depth < num_layers else
                    (f"model depth {num_layers}", "use a model of at least 2 layers"))
                raise UserInputError(
                    f"the {bound} leaves no room for the {m!r} preset's pruning cut, "
                    f"which needs a layer after it below the cutoff ({fix})")
            layers = layers_at(self.at, num_layers, depth)
        else:
            layers = config.prune_layers
        keep = self.keep[: len(layers)] if config.keep is None else config.keep
        _check_layers(layers, keep, num_layers, depth, m, self.once)
        return replace(
            schedule, prune_layers=layers, keep=keep, dynamic=self.dynamic,
            revive=self.dynamic and config.revive,
            complete=config.complete if self.dynamic else "none",
            scorer=scorer, heads=heads,
            window=default_window(scorer) if window is None else window, pool=config.pool)


@dataclass(frozen=True)
class LazyCuts(ScoredCuts):
    """LazyLLM: cuts re-selected at every decode step; with ``revive`` (the paper) a pruned
    token can come back from its Aux Cache hidden state.

    The preset is calibrated on SmolLM2 (mlx_lazy/bench/README.md): cuts in the lower half
    of the layers lost accuracy; cuts after layers 20 and 25 of 30 lost none on any task or
    on the demo.
    """

    takes = ScoredCuts.takes + ("revive", "complete")
    dynamic = True
    at: Tuple[float, ...] = (0.7, 0.85)
    keep: Tuple[float, ...] = (0.25, 0.15)

    @classmethod
    def preset(cls, method: Dict[str, Type[Policy]]) -> "LazyCuts":
        # Under a SPEED cutoff (75% of the depth by default) the 85% cut would sit above it.
        return cls(at=(0.7,), keep=(0.25,)) if SpeedCutoff in method.values() else cls()


@dataclass(frozen=True)
class StaticCut(ScoredCuts):
    """Static pruning (a baseline): one cut, chosen once in prefill; the tokens it prunes
    never come back."""

    once = True
    at: Tuple[float, ...] = (0.2,)
    keep: Tuple[float, ...] = (0.4,)


#: Policy name -> class. A method names its policies in this order and resolution applies
#: them last to first, so depth limits are in place before the cuts placed below them.
POLICIES: Dict[str, Type[Policy]] = {
    "lazy": LazyCuts,
    "static": StaticCut,
    "random": RandomDrop,
    "speed": SpeedCutoff,
}


def _shared(a: str, b: str) -> Tuple[str, ...]:
    """The PruningConfig fields both policies ``a`` and ``b`` take."""
    return tuple(f for f in POLICIES[a].takes if f in POLICIES[b].takes)


#: Every method in its canonical spelling: ``full``, each policy, then each composition of
#: policies that take no field in common.
METHODS: Tuple[str, ...] = ("full",) + tuple(
    "+".join(names)
    for n in range(1, len(POLICIES) + 1)
    for names in itertools.combinations(POLICIES, n)
    if not any(_shared(a, b) for a, b in itertools.combinations(names, 2))
)


def compose(method: Any) -> Dict[str, Type[Policy]]:
    """The policies of a method string, by name in :data:`POLICIES` order: ``full`` is
    none, ``"speed+lazy"`` is ``{"lazy": LazyCuts, "speed": SpeedCutoff}``.

    Raises:
        UserInputError: an unknown policy, one named twice, ``full`` with another, or two
            policies that take the same field.
    """
    choose = f"choose one of {', '.join(METHODS)} (policies in any order)"
    if not isinstance(method, str):
        raise UserInputError(f"unknown method {_shown(method)}; {choose}")
    if method == "full":
        return {}
    names = method.split("+")
    if "full" in names:
        raise UserInputError(f"method {method!r}: full prunes nothing and composes with no "
                             f"policy; {choose}")
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        detail = f" (no policy {unknown[0]!r})" if len(names) > 1 else ""
        raise UserInputError(f"unknown method {method!r}{detail}; {choose}")
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise UserInputError(f"method {method!r} names {twice} twice")
    ordered = [n for n in POLICIES if n in names]
    for a, b in itertools.combinations(ordered, 2):
        if _shared(a, b):
            raise UserInputError(
                f"method {method!r}: {a} and {b} do not compose (both take "
                f"{', '.join(_shared(a, b))})")
    return {n: POLICIES[n] for n in ordered}


def canonical_method(method: Any) -> str:
    """``method`` spelt as in :data:`METHODS` (its policies in registry order).

    Raises:
        UserInputError: as :func:`compose`.
    """
    return "+".join(compose(method)) or "full"


def _with_policy(method: Dict[str, Type[Policy]], name: str) -> str:
    """The method with policy ``name`` added where it composes, else ``name`` alone."""
    try:
        return canonical_method("+".join([*method, name]))
    except UserInputError:
        return name


@dataclass(frozen=True)
class PruningConfig:
    """What to prune, as a user states it.

    Args:
        method: ``"full"`` or policy names of :data:`POLICIES` joined by ``+`` in any
            order (``"lazy"``, ``"lazy+speed"``, ...); stored as spelt in :data:`METHODS`.
            Each policy takes some of the fields below; a field set for a method none of
            whose policies takes it is an error.
        prune_layers: layer indices after which tokens are pruned (LazyLLM, static).
            None takes the preset's positions for the model's depth.
        keep: fraction of the context that survives past each pruning layer
            (non-increasing, in (0, 1]); for ``"random"`` a single fraction of the prompt
            kept before layer 0. None takes the preset's values.
        speed_cutoff: SPEED cutoff, a float fraction of the layers in (0, 1] or an int
            number of layers in [1, num_layers]; prompt tokens other than the anchors and
            the last one are computed only below it. None takes 0.75 for SPEED methods.
        anchors: leading prompt tokens that are never pruned (SPEED's anchor; also
            protected from LazyLLM selection).
        seed: random-drop seed.
        revive: LazyLLM only. True (the paper): a token pruned in one step can come back in
            a later one, computed from its Aux Cache hidden state. False: decode steps choose
            only among tokens that already have KV at the next layer, so no decode step
            computes prompt tokens (faster decoding on compute-bound machines, no Aux Cache;
            an approximation beyond the paper).
        complete: LazyLLM only (without revive no token waits): when tokens waiting in the
            Aux Cache are carried
            through their remaining layers (:func:`parse_complete`): ``"none"`` (the paper:
            only when a step selects them), ``"after-first"`` (all of them right after the
            first output token, so decoding sees every token at every layer while the first
            token keeps the pruned time), ``"progressive:K"`` (K token-layers after each
            output token, lowest layer first). Each (token, layer) is still computed once.
            Once completion has left no token waiting, every token is attended to at every
            layer and decode steps do not re-select: the cuts spared the prompt's
            computation only.
        pool: LazyLLM and static only: before top-k, each candidate's score becomes the
            maximum over itself and ``pool`` neighbouring candidates on each side, so kept
            tokens come in spans (a number split into digit tokens stays whole). 0 (the
            paper) scores tokens alone; an approximation beyond the paper.
        scorer: score-based methods only: the registered scorer that ranks the context
            (:data:`mlx_lazy.scorers.SCORERS`): ``"last"`` (the paper: the query token's
            attention) or ``"window"`` (the last ``window`` prompt tokens' attention; the
            window is always kept). None: the calibrated schedule's, else ``"last"``.
        heads: how scores are reduced over attention heads, ``"mean"`` (the paper) or
            ``"max"``. None: ``"mean"``.
        window: the ``"window"`` scorer's size (default 8).
        quality: which calibrated schedule a plain ``"lazy"`` takes (:data:`QUALITIES`):
            ``"default"`` (the fastest that deviates at most as much as 4-bit weights) or
            ``"high"`` (the fastest that deviates at most a quarter of that); resolved by
            :func:`calibrated`.
        source: where these values come from (set by :meth:`from_file`); None lets
            :meth:`resolve` say ``"preset"`` or ``"user"``.
        fingerprint: the model a calibrated schedule is for (set by :meth:`from_file`, as
            sorted ``(key, value)`` pairs); ``LazyEngine`` refuses another model.
    """

    method: str = "full"
    prune_layers: Optional[Tuple[int, ...]] = None
    keep: Optional[Tuple[float, ...]] = None
    speed_cutoff: Optional[Union[float, int]] = None
    anchors: int = 1
    seed: int = 0
    revive: bool = True
    complete: str = "none"
    pool: int = 0
    scorer: Optional[str] = None
    heads: Optional[str] = None
    window: Optional[int] = None
    quality: str = "default"
    source: Optional[str] = None
    fingerprint: Optional[Tuple[Tuple[str, Any], ...]] = None

    def __post_init__(self) -> None:
        """Check field types (ranges that depend on the model are checked by :meth:`resolve`)
        and normalise numpy scalars and lists to plain ints, floats and tuples."""
        method = canonical_method(self.method)
        if not isinstance(self.revive, (bool, np.bool_)):
            raise UserInputError(f"revive must be True or False, got {_shown(self.revive)}")
        if self.quality not in QUALITIES:
            raise UserInputError(f"quality must be one of {', '.join(QUALITIES)}, got "
                                 f"{_shown(self.quality)}")
        values = {
            "method": method,
            "revive": bool(self.revive),
            "complete": parse_complete(self.complete)[0],
            "anchors": _bounded("anchors", self.anchors, 0, MAX_COUNT),
            "seed": _bounded("seed", self.seed, 0, SEED_LIMIT - 1),
            "pool": _bounded("pool", self.pool, 0, MAX_COUNT),
        }
        if self.prune_layers is not None:
            layers = _sequence("prune_layers", self.prune_layers)
            # negative layers pass here: resolve() names the model's valid range
            values["prune_layers"] = tuple(
                _bounded("each pruning layer", x, -MAX_COUNT, MAX_COUNT) for x in layers)
        if self.keep is not None:
            keep = _sequence("keep", self.keep)
            values["keep"] = tuple(_real("each keep fraction", x) for x in keep)
        for name in ("scorer", "heads", "source"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise UserInputError(f"{name} must be a non-empty string, got {_shown(value)}")
        if self.window is not None:
            values["window"] = _bounded("window", self.window, 1, MAX_COUNT)
        if self.fingerprint is not None:
            pairs = (self.fingerprint.items() if isinstance(self.fingerprint, dict)
                     else _sequence("fingerprint", self.fingerprint))
            values["fingerprint"] = tuple(sorted((str(k), v) for k, v in pairs))
        if self.speed_cutoff is not None:
            c = self.speed_cutoff
            values["speed_cutoff"] = (
                _real("speed_cutoff", c) if isinstance(c, (float, np.floating))
                else _bounded("speed_cutoff", c, -MAX_COUNT, MAX_COUNT)
            )
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @classmethod
    def preset(cls, name: str, **overrides) -> "PruningConfig":
        """The preset of method ``name`` (see :data:`METHODS`) with optional field overrides."""
        return replace(cls(method=name), **overrides)

    @classmethod
    def from_file(cls, path: Union[str, Path],
                  fingerprint: Optional[Dict[str, Any]] = None) -> "PruningConfig":
        """Load a calibrated schedule file (see :func:`write_schedule`).

        Args:
            path: the JSON file.
            fingerprint: the model's (``ModelAdapter.fingerprint()``); when given, the file
                must have been calibrated for a model with the same fingerprint.

        Raises:
            UserInputError: missing, malformed or mismatched file, naming the field.
        """
        path = Path(path)
        data = read_json(path, f"schedule file {path}", SCHEDULE_MAX_BYTES, SCHEDULE_MAX_DEPTH)
        if not isinstance(data, dict) or data.get("format") != SCHEDULE_FORMAT:
            raise UserInputError(f"{path} is not an mlx-lazy schedule file (field 'format' must "
                                 f"be {SCHEDULE_FORMAT!r})")
        config, model = data.get("config"), data.get("model")
        if not isinstance(config, dict) or not isinstance(model, dict) \
                or not isinstance(model.get("fingerprint"), dict):
            raise UserInputError(f"schedule file {path} lacks the 'config' or "
                                 "'model.fingerprint' object")
        unknown = sorted(set(config) - set(SCHEDULE_FIELDS))
        if unknown:
            raise UserInputError(f"schedule file {path}: unknown field config.{unknown[0]} "
                                 f"(fields: {', '.join(SCHEDULE_FIELDS)})")
        saved = model["fingerprint"]
        layers = saved.get("num_layers")
        if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= MAX_COUNT:
            raise UserInputError(f"schedule file {path}: model.fingerprint.num_layers must be a "
                                 f"positive integer, got {_shown(layers)}")
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}
        try:
            out = cls(**values, source=f"calibrated:{path.name}", fingerprint=saved)
            out.resolve(layers)
        except ValueError as e:
            raise UserInputError(f"schedule file {path}: invalid config: {e}") from None
        if fingerprint is not None:
            out.check_model(fingerprint)
        return out

    def check_model(self, fingerprint: Dict[str, Any]) -> None:
        """Refuse a model other than the one this calibrated schedule was made for.

        Raises:
            UserInputError: naming the first fingerprint field that differs.
        """
        if self.fingerprint is None:
            return
        saved = dict(self.fingerprint)
        for key, value in fingerprint.items():
            if saved.get(key) != value:
                raise UserInputError(
                    f"the schedule {self.source or ''} was calibrated for another model: "
                    f"model.fingerprint.{key} is {saved.get(key)!r}, this model has {value!r}")

    def resolve(self, num_layers: int) -> Schedule:
        """Check this configuration against a model depth and build its :class:`Schedule`.

        Raises:
            UserInputError: with a message saying which value to change.
        """
        # Field types were checked on construction (__post_init__); here, what depends on
        # the method and the model.
        policies = compose(self.method)
        self._check_taken(policies)
        schedule = Schedule(
            method=self.method, num_layers=num_layers, prompt_depth=num_layers,
            anchors=self.anchors, seed=self.seed,
            source=self.source or (
                "preset" if self.prune_layers is None and self.keep is None else "user"))
        for policy in reversed(policies.values()):  # depth limits first (see POLICIES)
            schedule = policy.preset(policies).apply(self, schedule)
        return schedule

    def _check_taken(self, policies: Dict[str, Type[Policy]]) -> None:
        """Refuse a policy field set away from its default that none of ``policies`` takes,
        naming the methods that do take it."""
        taken = {f for policy in policies.values() for f in policy.takes}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in taken or value == f.default:
                continue
            owners = [n for n, policy in POLICIES.items() if f.name in policy.takes]
            if not owners:  # anchors, seed: every method carries them
                continue
            label = f"{f.name}={value}" if isinstance(value, bool) else f.name
            uses = _listing([repr(_with_policy(policies, n)) for n in owners], "or")
            raise UserInputError(f"method {self.method!r} takes no {label}; "
                                 f"{_listing(owners, 'and')} {'do' if owners[1:] else 'does'}: "
                                 f"use {uses}")


def check_fits(schedule: Schedule, context: Optional[int]) -> None:
    """Refuse a schedule whose token counts exceed a model's context of ``context`` tokens
    (None: no known limit): a pool radius or a scoring window longer than any prompt the
    model can take.

    Raises:
        UserInputError: naming the field and the context.
    """
    if context is None:
        return
    for name, value in (("pool", schedule.pool), ("window", schedule.window)):
        if value is not None and value > context:
            raise UserInputError(f"{name}={value} is more than the model's context of "
                                 f"{context} tokens (lower {name})")


#: The ``complete`` modes (``progressive`` takes ``:K``).
COMPLETE_MODES = ("none", "after-first", "progressive:K")


def parse_complete(mode: Any) -> Tuple[str, Optional[int]]:
    """A ``complete`` mode in its canonical spelling and its token-layer budget per step:
    ``("none", 0)``, ``("after-first", None)`` (no limit, once) or ``("progressive:K", K)``.

    Raises:
        UserInputError: any other value.
    """
    if mode in ("none", "after-first"):
        return mode, (0 if mode == "none" else None)
    if isinstance(mode, str) and mode.startswith("progressive:"):
        k = mode.split(":", 1)[1]
        # ASCII digits only ("²".isdigit() too), and few enough for int() to take
        if k.isascii() and k.isdigit() and len(k) <= 10 and 0 < int(k) <= MAX_COUNT:
            return f"progressive:{int(k)}", int(k)
    raise UserInputError(f"complete must be one of none, after-first or progressive:K with K "
                         f"a positive integer, got {_shown(mode)}")


def layers_at(fractions: Tuple[float, ...], num_layers: int,
              prompt_depth: Optional[int] = None) -> Tuple[int, ...]:
    """Pruning layers at fractions of the depth: fraction f cuts after layer
    ``round(f * num_layers) - 1``, clamped so that a layer (below the SPEED cutoff
    ``prompt_depth``) follows each cut; on shallow models positions may collide, so the
    distinct ones are kept."""
    last = min(num_layers, prompt_depth or num_layers) - 2
    return tuple(sorted({min(last, max(0, round(f * num_layers) - 1)) for f in fractions}))


def _listing(words: list[str], conjunction: str) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return ", ".join(words[:-1]) + f" {conjunction} " + words[-1] if words[1:] else words[0]


def _integer(name: str, x: Any) -> int:
    """``x`` as an int: Python and numpy integers pass, bools and anything else do not."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise UserInputError(f"{name} must be an integer, got {_shown(x)}")
    return int(x)


def _bounded(name: str, x: Any, low: int, high: int) -> int:
    """``x`` as an int in [low, high] (see :func:`_integer`)."""
    value = _integer(name, x)
    if not low <= value <= high:
        kind = {0: "a non-negative integer", 1: "a positive integer"}.get(low)
        bound = f"{kind} of at most {high}" if kind else f"an integer in [{low}, {high}]"
        raise UserInputError(f"{name} must be {bound}, got {_shown(x)}")
    return value


def _shown(x: Any) -> str:
    """``repr(x)``, except that an integer too long to read is shown by its number of digits
    (Python refuses to print one past 4,300 digits, even inside a list)."""
    if isinstance(x, int) and x.bit_length() > 64:
        return f"an integer of about {round(x.bit_length() * math.log10(2))} digits"
    try:
        return repr(x)
    except ValueError:
        return f"a {type(x).__name__} holding an integer too long to print"


def _real(name: str, x: Any) -> Union[float, int]:
    """``x`` as a plain number: Python and numpy ints and floats pass, bools do not."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise UserInputError(f"{name} must be a number, got {_shown(x)}")
    return int(x) if isinstance(x, (int, np.integer)) else float(x)


def _sequence(name: str, x: Any) -> tuple:
    if isinstance(x, (str, bytes)) or not hasattr(x, "__iter__"):
        raise UserInputError(f"{name} must be a sequence, got {_shown(x)}")
    return tuple(x)


def _check_fraction(k: float) -> None:
    if not isinstance(k, (int, float)) or not 0.0 < k <= 1.0:
        raise UserInputError(f"keep fractions must be in (0, 1], got {_shown(k)}")


def _resolve_cutoff(cutoff: Union[float, int], num_layers: int) -> int:
    if isinstance(cutoff, bool) or not isinstance(cutoff, (int, float)):
        raise UserInputError(f"speed_cutoff must be a fraction or a layer count, got {_shown(cutoff)}")
    if isinstance(cutoff, float):
        if not 0.0 < cutoff <= 1.0:
            raise UserInputError(
                f"speed_cutoff {cutoff} as a fraction must be in (0, 1]; "
                f"pass an int for a layer count"
            )
        layers = max(1, round(cutoff * num_layers))
    else:
        layers = cutoff
    if not 1 <= layers <= num_layers:
        raise UserInputError(
            f"speed_cutoff must keep between 1 and {num_layers} layers (the model's depth), "
            f"got {layers}"
        )
    return layers


def _check_layers(layers: Tuple[int, ...], keep: Tuple[float, ...], num_layers: int,
                  prompt_depth: int, m: str, once: bool) -> None:
    if not layers:
        raise UserInputError(f"method {m!r} needs at least one pruning layer")
    if len(layers) != len(keep):
        raise UserInputError(
            f"give one keep fraction per pruning layer: {len(layers)} layers, {len(keep)} fractions"
        )
    if once and len(layers) != 1:
        raise UserInputError(f"method {m!r} prunes once: give exactly one pruning layer")
    last = min(num_layers, prompt_depth) - 2
    if layers[0] < 0 or layers[-1] > last:
        raise UserInputError(
            f"pruning layers must lie in [0, {last}] so that a layer follows each cut "
            f"(model depth {num_layers}"
            + (f", SPEED cutoff {prompt_depth}" if prompt_depth < num_layers else "")
            + f"), got {list(layers)}"
        )
    if any(b <= a for a, b in zip(layers, layers[1:])):
        raise UserInputError(f"pruning layers must be strictly increasing, got {list(layers)}")
    for k in keep:
        _check_fraction(k)
    if any(b > a for a, b in zip(keep, keep[1:])):
        raise UserInputError(
            f"keep fractions must not increase (kept sets only shrink), got {list(keep)}"
        )


def schedule_file_name(stem: str, quality: str = "default") -> str:
    """The file name of a ``quality`` schedule (:data:`QUALITIES`): ``stem.json`` for the
    default, ``stem.high.json`` for ``high``."""
    return f"{stem}.json" if quality == "default" else f"{stem}.{quality}.json"


def write_schedule(path: Union[str, Path], config: PruningConfig, fingerprint: Dict[str, Any],
                   evidence: Dict[str, Any], model_name: str = "",
                   quality: str = "default") -> Path:
    """Write a schedule file: the config's :data:`SCHEDULE_FIELDS`, its ``quality``, the
    model it was calibrated for and the evidence behind it. :meth:`PruningConfig.from_file`
    reads it."""
    config.resolve(fingerprint["num_layers"])  # never write an invalid file
    values = {f: getattr(config, f) for f in SCHEDULE_FIELDS if getattr(config, f) is not None}
    values = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
    doc = {"format": SCHEDULE_FORMAT, "quality": quality,
           "model": {"name": model_name, "fingerprint": fingerprint},
           "config": values, "evidence": evidence}
    path = Path(path)
    write_text_atomic(path, json.dumps(doc, indent=2) + "\n")
    return path


def calibrated(config: PruningConfig, fingerprint: Dict[str, Any],
               attached: Optional[Mapping[str, PruningConfig]] = None) -> PruningConfig:
    """The config to run: a plain ``lazy`` request (no cuts, keep fractions or scorer given)
    takes the model's calibrated schedule of its ``quality``: the one ``attached`` by
    ``mlx_lazy.load`` from the model folder (by quality, see :func:`folder_schedules`), else
    the one ``python -m mlx_lazy.calibrate`` left in the cache for this fingerprint
    (:func:`cached_schedule_path`), else a packaged one with the same fingerprint; a default
    quality request without any keeps the preset. Any other request is ``config`` itself.

    Raises:
        UserInputError: ``quality="high"`` on a request that is not plain ``lazy``, or for a
            model without a calibrated high-quality schedule.
    """
    plain = (config.method == "lazy" and config.source is None and not config.pool
             and all(getattr(config, f) is None
                     for f in ("prune_layers", "keep", "scorer", "heads", "window")))
    high = config.quality != "default"
    if not plain:
        if high:
            raise UserInputError(f"quality={config.quality!r} picks the model's calibrated "
                                 "schedule: it takes a plain method 'lazy' (no cuts, keep "
                                 "fractions, scorer or schedule file)")
        return config
    found = (attached or {}).get(config.quality)
    if found is None:
        try:
            cached: Optional[Path] = cached_schedule_path(fingerprint, config.quality)
        except UserInputError:  # no cache folder and none can be made: nothing cached
            cached = None
        found = (PruningConfig.from_file(cached, fingerprint) if cached and cached.is_file()
                 else packaged_schedule(fingerprint, config.quality))
    if found is None:
        if high:
            raise UserInputError(
                f"no quality={config.quality!r} schedule is calibrated for this model; make one "
                "with python -m mlx_lazy.calibrate --model MODEL, or drop quality")
        return config
    return replace(found, revive=config.revive, complete=config.complete,
                   anchors=config.anchors, seed=config.seed, quality=config.quality)


def folder_schedules(folder: Union[str, Path],
                     fingerprint: Dict[str, Any]) -> Dict[str, PruningConfig]:
    """The calibrated schedules a model folder holds (``mlx_lazy_schedule.json`` and
    ``mlx_lazy_schedule.high.json``), by quality, checked against the model's fingerprint.

    Raises:
        UserInputError: a malformed file, or one calibrated for another model.
    """
    stem = MODEL_SCHEDULE_FILE.removesuffix(".json")
    paths = {q: Path(folder) / schedule_file_name(stem, q) for q in QUALITIES}
    return {q: PruningConfig.from_file(p, fingerprint) for q, p in paths.items() if p.is_file()}


def fingerprint_digest(fingerprint: Dict[str, Any]) -> str:
    """A short digest of a model fingerprint (shapes and weights digest): the cache key of
    the model's own calibrated schedules."""
    text = json.dumps(sorted(fingerprint.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached_schedule_path(fingerprint: Dict[str, Any], quality: str = "default") -> Path:
    """Where ``python -m mlx_lazy.calibrate`` keeps a schedule for a model whose folder it
    cannot write (a named model, a hub id, a read-only folder):
    ``~/.cache/mlx_lazy/schedules/<fingerprint digest>[.high].json``."""
    from .default_model import cache_dir

    return cache_dir() / "schedules" / schedule_file_name(fingerprint_digest(fingerprint),
                                                          quality)


def packaged_schedule(fingerprint: Dict[str, Any],
                      quality: str = "default") -> Optional[PruningConfig]:
    """The packaged calibrated schedule of ``quality`` whose model fingerprint equals
    ``fingerprint``."""
    return _packaged().get((_key(fingerprint), quality))


@lru_cache(maxsize=1)
def _packaged() -> Dict[tuple, PruningConfig]:
    """Packaged schedules by (model fingerprint, quality), read once per process. A corrupt
    file is skipped with one warning naming it, so the model keeps its preset."""
    found = {}
    for path in sorted(PACKAGED_SCHEDULES.glob("*.json")):
        try:
            config = PruningConfig.from_file(path)
            quality = read_json(path, f"schedule file {path}", SCHEDULE_MAX_BYTES,
                                SCHEDULE_MAX_DEPTH).get("quality", "default")
            if quality not in QUALITIES:
                raise UserInputError(f"field 'quality' must be one of {', '.join(QUALITIES)}")
        except UserInputError as e:
            warnings.warn(f"ignoring the packaged schedule {path}: {e}", stacklevel=2)
            continue
        found[(_key(dict(config.fingerprint)), quality)] = config
    return found


def _key(fingerprint: Dict[str, Any]) -> tuple:
    return tuple(sorted(fingerprint.items()))
