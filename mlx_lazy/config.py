"""What users write: a :class:`PruningConfig` (a method of :mod:`mlx_lazy.policies` plus
optional fields, with presets), checked on construction; :func:`build_schedule` turns it into
the engine's :class:`~mlx_lazy.schedule.Schedule` for a model depth (the calibrated lookup and
the model checks are :func:`mlx_lazy.resolve.resolve_config`'s)."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Dict, Iterator, Optional, Tuple, TypeVar, Union

import numpy as np

from .errors import UserInputError, shown
from .completion import parse_completion
from .inputs import MAX_COUNT, is_int
from .policies import ScoredCuts, canonical_method, check_taken, compose
from .schedule import Schedule
from .scorers import Scorer, parse_scorer, scorer_spec

#: The largest revive_margin: past it no waiting token is ever worth a revival (use
#: max_revivals=0 to say so).
MAX_MARGIN = 1e6
#: Seeds are what ``mx.random.seed`` and numpy take: integers in [0, 2**64).
SEED_LIMIT = 2**64
#: The calibrated schedules a plain ``lazy`` may take, by ``PruningConfig.quality``:
#: ``default``, the fastest whose deviation (mean KLD against ``full``) is at most 4-bit
#: weights'; ``high``, the fastest at most a quarter of that.
QUALITIES = ("default", "high")
#: The fields that say what is pruned: a config that gives none of them runs its method's
#: preset (a plain ``lazy``, the model's calibrated schedule), one that gives any is the user's.
PRUNING_FIELDS = ("prune_layers", "keep", "scorer", "speed_cutoff")
#: Where a schedule came from, besides ``"calibrated:FILE"`` (a schedule file): the method's
#: preset, the user's fields, the transfer rule.
SOURCES = ("preset", "user", "transfer")
#: The most characters of a user's value an error message shows, and the longest message a
#: config raises (a 400,000-item ``prune_layers`` once came back as a 3 MB message).
SHOWN = 200
MESSAGE_LIMIT = 1000

_F = TypeVar("_F", bound=Callable[..., Any])


def _short_errors(fn: _F) -> _F:
    """``fn`` with any UserInputError it raises cut to :data:`MESSAGE_LIMIT` characters (the
    policies' and parsers' messages quote what they were given)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except UserInputError as e:
            text = str(e)
            if len(text) <= MESSAGE_LIMIT:
                raise
            short = UserInputError(text[: MESSAGE_LIMIT - 5] + " ...")
            short.field = e.field
            raise short from None
    return wrapper  # type: ignore[return-value]


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
        complete: LazyLLM only (without revive no token waits): what happens to the pruned
            tokens after the first output token (:mod:`mlx_lazy.completion`). None (the
            default): the mode the calibrated schedule was chosen with (on a model without
            one, the transfer rule's: :func:`~mlx_lazy.schedule_files.transfer_rule`), else
            ``"exact"``.
            ``"exact"``: every token of the prompt chunk is carried from the first cut through
            the layers above, over every token, from hidden states kept there; the kept
            tokens' are computed again (they had seen only kept tokens), so from the second
            output token on decoding is the unpruned model's and only the first token is the
            pruned prefill's. ``"after-first"``: only the waiting tokens are carried, from the
            Aux Cache, each (token, layer) computed once; the kept tokens' deep states stay
            as pruned. ``"none"`` (the paper): tokens are computed only when a decode step
            selects them. ``"progressive:K"``: K waiting token-layers after each output
            token, lowest layer first. ``"promote:P"``: as ``"none"``, but before the first
            decode step the best-scoring waiting tokens are carried on in one batch until P%
            of the context has keys above each cut, and decode steps keep that share. Once
            no token waits, every token is attended to at every layer and decode steps do
            not re-select: the cuts spared the prompt's computation only. Measured
            (docs/fidelity.md): ``exact`` and ``after-first`` decode at the unpruned speed,
            ``exact``'s second token comes a little later; ``none`` decodes 2.0-2.2x slower
            per token on a CPU and drifts most.
        max_revivals: LazyLLM with revive only: the most tokens one decode step revives at
            one cut, the best-scoring of those it selected; the others stay in the Aux Cache
            and may come back in a later step. It bounds a decode step's work (selections
            at a cut's boundary flip spans of tokens from one step to the next, and each
            flip would revive them). None: the calibrated schedule's (Qwen2.5-Coder-0.5B's:
            2, Gemma 3 270M's: 4), else no bound, the paper's step.
        revive_margin: LazyLLM with revive only: in a decode step's selection, a token
            that would have to be revived from the Aux Cache competes with its score divided
            by ``1 + revive_margin``, so it displaces a token that already has KV there only
            when it scores that many times higher. It damps the churn at a cut's boundary
            (each flip of a span costs its tokens' remaining layers) and keeps the tokens a
            step clearly wants (a needle's score is far above the boundary). None: the
            calibrated schedule's, else 0 (the paper's selection).
        reselect_every: LazyLLM only: decode steps re-select at the cuts every K steps
            (counted from the last selection, the prompt's included); the steps between make
            no selection and revive nothing: their upper layers see what the last selection
            chose plus the tokens generated since. The window scorer's scores move by one
            query of its window a step, so a choice held a few steps is nearly the one made
            afresh, while the steps between cost no scoring, no host sync and no revived
            rows, and a selection's revivals share one pass through the upper layers. None:
            the calibrated schedule's (SmolLM2-135M's and Gemma 3 270M's: 3; Qwen2.5-Coder-
            0.5B's: 1, it drifted past its bar held), else 1 (the paper's step: every step
            re-selects).
        scorer: score-based methods only: the scorer that ranks the context at each cut, a
            :class:`~mlx_lazy.scorers.Scorer` or its spec (:func:`~mlx_lazy.scorers.parse_scorer`):
            ``"last"`` (the paper: the query token's attention), ``"window:size=32"`` (the last
            32 prompt tokens' attention; the window is always kept), ``heads=max`` to reduce
            over heads by max, ``pool=R`` to max-pool scores over R neighbouring tokens on
            each side (kept tokens come in spans; an approximation beyond the paper). None:
            the calibrated schedule's, else ``"last"``.
        quality: which calibrated schedule a plain ``"lazy"`` takes (:data:`QUALITIES`):
            ``"default"`` (the fastest that deviates at most as much as 4-bit weights) or
            ``"high"`` (the fastest that deviates at most a quarter of that); resolved by
            :func:`~mlx_lazy.schedule_files.calibrated`.
        source: where these values come from (set by
            :func:`~mlx_lazy.schedule_files.read_schedule`); None lets :func:`build_schedule` say
            ``"preset"`` or ``"user"`` (any of :data:`PRUNING_FIELDS` given).
        fingerprint: the model a calibrated schedule is for (set by
            :func:`~mlx_lazy.schedule_files.read_schedule`, as sorted ``(key, value)``
            pairs); :func:`~mlx_lazy.resolve_config` refuses another model.
    """

    method: str = "full"
    prune_layers: Optional[Tuple[int, ...]] = None
    keep: Optional[Tuple[float, ...]] = None
    speed_cutoff: Optional[Union[float, int]] = None
    anchors: int = 1
    seed: int = 0
    revive: bool = True
    complete: Optional[str] = None
    max_revivals: Optional[int] = None
    revive_margin: Optional[float] = None
    reselect_every: Optional[int] = None
    scorer: Optional[Union[str, Scorer]] = None
    quality: str = "default"
    source: Optional[str] = None
    fingerprint: Optional[Tuple[Tuple[str, Any], ...]] = None

    @_short_errors
    def __post_init__(self) -> None:
        """Check field types (ranges that depend on the model are checked by :func:`build_schedule`)
        and normalise numpy scalars and lists to plain ints, floats and tuples. A refusal
        names its field (:attr:`UserInputError.field`)."""
        with _at("method"):
            method = canonical_method(self.method)
        with _at("revive"):
            if not isinstance(self.revive, (bool, np.bool_)):
                raise UserInputError(
                    f"revive must be True or False, got {shown(self.revive, SHOWN)}")
        with _at("quality"):
            if not isinstance(self.quality, str) or self.quality not in QUALITIES:
                raise UserInputError(f"quality must be one of {', '.join(QUALITIES)}, got "
                                     f"{shown(self.quality, SHOWN)}")
        values: Dict[str, Any] = {"method": method, "revive": bool(self.revive)}
        with _at("complete"):
            values["complete"] = (None if self.complete is None
                                  else parse_completion(self.complete).spec)
        with _at("anchors"):
            values["anchors"] = _bounded("anchors", self.anchors, 0, MAX_COUNT)
        with _at("seed"):
            values["seed"] = _bounded("seed", self.seed, 0, SEED_LIMIT - 1)
        if self.prune_layers is not None:
            with _at("prune_layers"):
                layers = _sequence("prune_layers", self.prune_layers)
            # negative layers pass here: build_schedule() names the model's valid range
            values["prune_layers"] = tuple(
                _item("prune_layers", i, _bounded, "each pruning layer", x, -MAX_COUNT,
                      MAX_COUNT) for i, x in enumerate(layers))
        if self.keep is not None:
            with _at("keep"):
                keep = _sequence("keep", self.keep)
            values["keep"] = tuple(_item("keep", i, _real, "each keep fraction", x)
                                   for i, x in enumerate(keep))
        if self.scorer is not None:
            with _at("scorer"):
                values["scorer"] = parse_scorer(self.scorer)
        if self.max_revivals is not None:
            with _at("max_revivals"):
                values["max_revivals"] = _bounded("max_revivals", self.max_revivals, 0,
                                                  MAX_COUNT)
        if self.reselect_every is not None:
            with _at("reselect_every"):
                values["reselect_every"] = _bounded("reselect_every", self.reselect_every, 1,
                                                    MAX_COUNT)
        if self.revive_margin is not None:
            with _at("revive_margin"):
                margin = _real("revive_margin", self.revive_margin)
                if not 0 <= margin <= MAX_MARGIN:  # before float(): an int may overflow it
                    raise UserInputError(f"revive_margin must be in [0, {MAX_MARGIN:g}], got "
                                         f"{shown(self.revive_margin, SHOWN)}")
                values["revive_margin"] = float(margin)
        with _at("source"):
            if self.source is not None and not (
                    isinstance(self.source, str) and (self.source in SOURCES or (
                        self.source.startswith("calibrated:") and self.source[11:].strip()))):
                raise UserInputError(
                    f"source must be one of {', '.join(SOURCES)}, 'calibrated:FILE' (the "
                    f"library sets it), got {shown(self.source, SHOWN)}")
            if self.source not in (None, "preset") and self.prune_layers is None and any(
                    issubclass(p, ScoredCuts) for p in compose(self.method).values()):
                raise UserInputError(f"source {shown(self.source, SHOWN)} names where a "
                                     "schedule's cuts came from, but this config gives none "
                                     "(its method's preset would run under that name); drop it")
        if self.fingerprint is not None:
            with _at("fingerprint"):
                pairs = (self.fingerprint.items() if isinstance(self.fingerprint, dict)
                         else _sequence("fingerprint", self.fingerprint))
                values["fingerprint"] = tuple(sorted((str(k), v) for k, v in pairs))
        if self.speed_cutoff is not None:
            with _at("speed_cutoff"):
                c = self.speed_cutoff
                if isinstance(c, (bool, np.bool_)) or not isinstance(
                        c, (int, float, np.integer, np.floating)):
                    raise UserInputError("speed_cutoff must be a fraction of the layers or a "
                                         f"layer count, got {shown(c, SHOWN)}")
                values["speed_cutoff"] = (
                    _real("speed_cutoff", c) if isinstance(c, (float, np.floating))
                    else _bounded("speed_cutoff", c, -MAX_COUNT, MAX_COUNT)
                )
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def as_dict(self) -> Dict[str, Any]:
        """JSON-friendly form: lists for tuples, the scorer as its spec."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d = {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
        if self.scorer is not None:
            d["scorer"] = scorer_spec(self.scorer)
        if self.fingerprint is not None:
            d["fingerprint"] = dict(self.fingerprint)
        return d

    @classmethod
    def preset(cls, name: str, **overrides) -> "PruningConfig":
        """The preset of method ``name`` (see :data:`METHODS`) with optional field overrides."""
        return replace(cls(method=name), **overrides)

@_short_errors
def build_schedule(config: PruningConfig, num_layers: int) -> Schedule:
    """The :class:`Schedule` of ``config`` on a model of ``num_layers`` layers, as stated: each
    policy of its method contributes its part, checked against that depth. No calibrated
    lookup and no fingerprint check: :func:`mlx_lazy.resolve.resolve_config` does those
    before it calls this.

    Raises:
        UserInputError: with a message saying which value to change.
    """
    # Field types were checked on construction (__post_init__); here, what depends on
    # the method and the model.
    policies = compose(config.method)
    check_taken(config, policies)
    schedule = Schedule(
        method=config.method, num_layers=num_layers, prompt_depth=num_layers,
        anchors=config.anchors, seed=config.seed,
        source=config.source or (
            "preset" if all(getattr(config, f) is None for f in PRUNING_FIELDS) else "user"))
    for policy in reversed(policies.values()):  # depth limits first (see POLICIES)
        schedule = policy.preset(policies).apply(config, schedule)
    return schedule


def _integer(name: str, x: Any) -> int:
    """``x`` as an int: Python and numpy integers pass, bools and anything else do not."""
    if not is_int(x, numpy=True):
        raise UserInputError(f"{name} must be an integer, got {shown(x, SHOWN)}")
    return int(x)


def _bounded(name: str, x: Any, low: int, high: int) -> int:
    """``x`` as an int in [low, high] (see :func:`_integer`)."""
    value = _integer(name, x)
    if not low <= value <= high:
        kind = {0: "a non-negative integer", 1: "a positive integer"}.get(low)
        bound = f"{kind} of at most {high}" if kind else f"an integer in [{low}, {high}]"
        raise UserInputError(f"{name} must be {bound}, got {shown(x, SHOWN)}")
    return value


@contextlib.contextmanager
def _at(field: str) -> Iterator[None]:
    """Name ``field`` as the one a UserInputError raised inside refuses (unless it names one)."""
    try:
        yield
    except UserInputError as e:
        e.field = e.field or field
        raise


def _item(field: str, i: int, check: Callable[..., Any], *args: Any) -> Any:
    """``check(*args)`` for item ``i`` of the sequence ``field``, a refusal naming it."""
    with _at(f"{field}[{i}]"):
        return check(*args)


def _real(name: str, x: Any) -> Union[float, int]:
    """``x`` as a plain number: Python and numpy ints and floats pass, bools do not."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise UserInputError(f"{name} must be a number, got {shown(x, SHOWN)}")
    return int(x) if isinstance(x, (int, np.integer)) else float(x)


def _sequence(name: str, x: Any) -> tuple:
    if isinstance(x, (str, bytes)) or not hasattr(x, "__iter__"):
        raise UserInputError(f"{name} must be a sequence, got {shown(x, SHOWN)}")
    return tuple(x)
