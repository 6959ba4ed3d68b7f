"""Pruning policies: which prompt tokens go through which layers.

The data flows one way: a :class:`~mlx_lazy.config.PruningConfig` is what users write (a method plus
optional fields, with presets); its method names the :class:`Policy` units it composes
(:data:`POLICIES`); :func:`~mlx_lazy.config.build_schedule` lets each policy contribute its
part to a :class:`Schedule`, the concrete per-layer plan the engine executes. A method is ``full``
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

import itertools
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Sequence, Tuple, Type, Union

import mlx.nn as nn

from .adapter import global_layers, model_family, recurrent_layers, stateless_layers
from .completion import DEFAULT_COMPLETE
from .errors import UserInputError, shown
from .inputs import is_int
from .schedule import Schedule
from .scorers import LastQuery

#: What :meth:`Policy.apply` and :func:`check_taken` read: a
#: :class:`~mlx_lazy.config.PruningConfig` (config.py imports this module, so the type is
#: named here, not imported).
Config = Any


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

    def apply(self, config: Config, schedule: Schedule) -> Schedule:
        """``schedule`` with this policy's part set from ``config``.

        Raises:
            UserInputError: a value of ``config`` that does not fit ``schedule``'s model.
        """
        raise NotImplementedError

    @classmethod
    def given(cls, values: Mapping[str, Any]) -> Dict[str, Any]:
        """The config fields that give this policy's part of a schedule back, from the
        schedule's ``values`` (:meth:`Schedule.as_dict`): :meth:`apply`'s inverse, by which
        a saved schedule (a prompt-cache file's) is checked.

        Raises:
            UserInputError: a value no config gives.
        """
        raise NotImplementedError


@dataclass(frozen=True)
class SpeedCutoff(Policy):
    """SPEED: prompt tokens other than the anchors and the last one get KV only below the
    cutoff, a fraction of the layers (float) or a layer count (int)."""

    takes = ("speed_cutoff",)
    cutoff: Union[float, int] = 0.75

    def apply(self, config: Config, schedule: Schedule) -> Schedule:
        cutoff = self.cutoff if config.speed_cutoff is None else config.speed_cutoff
        return replace(schedule, prompt_depth=_resolve_cutoff(cutoff, schedule.num_layers))

    @classmethod
    def given(cls, values: Mapping[str, Any]) -> Dict[str, Any]:
        depth = values["prompt_depth"]
        if not is_int(depth):  # a float is a fraction
            raise UserInputError(f"prompt_depth must be a layer count, got {shown(depth, 80)}")
        return {"speed_cutoff": depth}


@dataclass(frozen=True)
class RandomDrop(Policy):
    """Random drop (a baseline): before layer 0 keep one fraction of the prompt, drawn with
    the config's ``seed``; the dropped tokens are never computed."""

    takes = ("keep",)
    keep: Tuple[float, ...] = (0.5,)

    def apply(self, config: Config, schedule: Schedule) -> Schedule:
        keep = self.keep if config.keep is None else config.keep
        if len(keep) != 1:
            raise UserInputError(
                f"method {schedule.method!r} takes one keep fraction, got {len(keep)}")
        _check_fraction(keep[0])
        return replace(schedule, random_keep=keep[0])

    @classmethod
    def given(cls, values: Mapping[str, Any]) -> Dict[str, Any]:
        return {"keep": [values["random_keep"]]}


@dataclass(frozen=True)
class ScoredCuts(Policy):
    """Cuts after chosen layers that keep the top fraction of the context by a scorer.

    ``at`` (fractions of the depth, see :func:`layers_at`) and ``keep`` are the preset cuts,
    placed below any depth limit already in the schedule.
    """

    takes = ("prune_layers", "keep", "scorer")
    #: re-select at every decode step (else once, in prefill)
    dynamic: ClassVar[bool] = False
    #: exactly one cut
    once: ClassVar[bool] = False
    at: Tuple[float, ...] = ()
    keep: Tuple[float, ...] = ()

    def apply(self, config: Config, schedule: Schedule) -> Schedule:
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
            for k in config.keep or ():  # a fraction out of range is the first thing to say
                _check_fraction(k)
            if config.keep is not None and len(config.keep) != len(layers):
                raise UserInputError(
                    f"the {m!r} preset cuts after layer{'s' if layers[1:] else ''} "
                    f"{', '.join(map(str, layers))} of this {num_layers}-layer model: give "
                    f"{len(layers)} keep fraction{'s' if layers[1:] else ''}, or prune_layers "
                    f"with the keep fractions")
        else:
            layers = config.prune_layers
        keep = self.keep[: len(layers)] if config.keep is None else config.keep
        _check_layers(layers, keep, num_layers, depth, m, self.once)
        return replace(
            schedule, prune_layers=layers, keep=keep, dynamic=self.dynamic,
            revive=self.dynamic and config.revive,
            complete=(config.complete or DEFAULT_COMPLETE) if self.dynamic and config.revive
            else "none",
            max_revivals=config.max_revivals if self.dynamic else None,
            revive_margin=(config.revive_margin or 0.0) if self.dynamic else 0.0,
            reselect_every=(config.reselect_every or 1) if self.dynamic else 1,
            scorer=LastQuery() if config.scorer is None else config.scorer)

    @classmethod
    def given(cls, values: Mapping[str, Any]) -> Dict[str, Any]:
        return {k: values[k] for k in ("prune_layers", "keep", "scorer")}


@dataclass(frozen=True)
class LazyCuts(ScoredCuts):
    """LazyLLM: cuts re-selected at every decode step; with ``revive`` (the paper) a pruned
    token can come back from its Aux Cache hidden state.

    The preset is calibrated on SmolLM2 (mlx_lazy/bench/README.md): cuts in the lower half
    of the layers lost accuracy; cuts after layers 20 and 25 of 30 lost none on any task or
    on the demo.
    """

    takes = ScoredCuts.takes + ("revive", "complete", "max_revivals", "revive_margin",
                                 "reselect_every")
    dynamic = True
    at: Tuple[float, ...] = (0.7, 0.85)
    keep: Tuple[float, ...] = (0.25, 0.15)

    @classmethod
    def preset(cls, method: Dict[str, Type[Policy]]) -> "LazyCuts":
        # Under a SPEED cutoff (75% of the depth by default) the 85% cut would sit above it.
        return cls(at=(0.7,), keep=(0.25,)) if SpeedCutoff in method.values() else cls()

    @classmethod
    def given(cls, values: Mapping[str, Any]) -> Dict[str, Any]:
        decode = ("revive", "max_revivals", "revive_margin", "reselect_every")
        return {**super().given(values), **{k: values[k] for k in decode},
                # without revival a schedule's complete is "none", whatever was asked
                **({"complete": values["complete"]} if values["revive"] is True else {})}


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
        raise UserInputError(f"unknown method {shown(method)}; {choose}")
    if method == "full":
        return {}
    names = method.split("+")
    if "full" in names:
        raise UserInputError(f"method {method!r}: full prunes nothing and composes with no "
                             f"policy; {choose}")
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        detail = f" (no policy {unknown[0]!r})" if len(names) > 1 else ""
        if ":" in method:  # the benchmarks' spelling of a config
            detail = (" (NAME:field=value is the benchmarks' spelling; elsewhere each field "
                      "is given on its own: a flag, a PruningConfig field, a key of a server "
                      "request's pruning object)")
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


def check_taken(config: Config, policies: Dict[str, Type[Policy]]) -> None:
    """Refuse a field of ``config`` set away from its default that none of ``policies``
    takes, naming the methods that do take it.

    Raises:
        UserInputError: naming the field and the methods that take it.
    """
    taken = {f for policy in policies.values() for f in policy.takes}
    for f in fields(config):
        value = getattr(config, f.name)
        if f.name in taken or value == f.default:
            continue
        owners = [n for n, policy in POLICIES.items() if f.name in policy.takes]
        if not owners:  # anchors, seed: every method carries them
            continue
        label = f"{f.name}={value}" if isinstance(value, bool) else f.name
        uses = _listing([repr(_with_policy(policies, n)) for n in owners], "or")
        raise UserInputError(f"method {config.method!r} takes no {label}; "
                             f"{_listing(owners, 'and')} {'do' if owners[1:] else 'does'}: "
                             f"use {uses}")


#: The fields that act on pruned tokens coming back, and the value of each that does nothing.
REVIVAL_IDLE = {"complete": "none", "max_revivals": 0, "revive_margin": 0}


def revival_fields(config: Config) -> List[str]:
    """The fields of :data:`REVIVAL_IDLE` that ``config`` sets to something that acts."""
    return [f for f, idle in REVIVAL_IDLE.items() if getattr(config, f) not in (None, idle)]


def check_revive(config: Config) -> None:
    """Refuse, with ``revive`` off, the fields that act on pruned tokens coming back.

    Raises:
        UserInputError: a ``complete`` mode but ``"none"``, a ``max_revivals`` but 0 or a
            ``revive_margin`` but 0 given with ``revive=False`` (they would do nothing:
            pruned tokens stay out for good).
    """
    given = revival_fields(config)
    if not config.revive and given:
        raise UserInputError(f"revive=False keeps pruned tokens out for good, so "
                             f"{_listing(given, 'and')} would do nothing; drop "
                             f"{'them' if given[1:] else 'it'}")


def layers_at(fractions: Tuple[float, ...], num_layers: int,
              prompt_depth: Optional[int] = None) -> Tuple[int, ...]:
    """Pruning layers at fractions of the depth: fraction f cuts after layer
    ``round(f * num_layers) - 1``, clamped so that a layer (below the SPEED cutoff
    ``prompt_depth``) follows each cut; on shallow models positions may collide, so the
    distinct ones are kept."""
    last = min(num_layers, prompt_depth or num_layers) - 2
    return tuple(sorted({min(last, max(0, round(f * num_layers) - 1)) for f in fractions}))


def at_global_layers(layers: Sequence[int], global_layers: Sequence[int]) -> Tuple[int, ...]:
    """Cut ``layers`` moved each to the nearest of ``global_layers`` (the lower on a tie):
    the layers a cut may follow on a model with sliding-window layers
    (:func:`mlx_lazy.adapter.global_layers`). With none to move to, the cuts stay.

    A cut selects by its layer's attention, and a sliding-window layer never learnt to attend
    beyond its window, so its scores cannot rank a far needle. With ``exact`` decoding that
    cost nothing measurable, but every other decode keeps states computed from its choice:
    on Gemma 3 270M, cuts after sliding layers 7 and 8 lost 26 of 50 paired niah_single@1024
    decoding on the pruned state and 5 with ``after-first``, where a cut after global layer 5
    lost none with either.
    """
    return cuts_at_global_layers(layers, [1.0] * len(layers), global_layers)[0]


def nearest_global_layer(layer: int, global_layers: Sequence[int]) -> int:
    """The one of ``global_layers`` nearest ``layer`` (the lower on a tie)."""
    return min(global_layers, key=lambda g: (abs(g - layer), g))


def cuts_at_global_layers(layers: Sequence[int], keep: Sequence[float],
                          global_layers: Sequence[int]
                          ) -> Tuple[Tuple[int, ...], Tuple[float, ...]]:
    """Cuts after ``layers`` keeping ``keep`` moved as :func:`at_global_layers` moves them;
    cuts that land on one layer keep the most of them (so the fractions still do not
    grow)."""
    cuts: Dict[int, float] = {}
    for layer, k in zip(layers, keep):
        layer = nearest_global_layer(layer, global_layers) if global_layers else layer
        cuts[layer] = max(cuts.get(layer, 0.0), k)
    moved = tuple(sorted(cuts))
    return moved, tuple(cuts[layer] for layer in moved)


def _listing(words: list[str], conjunction: str) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return ", ".join(words[:-1]) + f" {conjunction} " + words[-1] if words[1:] else words[0]


def _check_fraction(k: float) -> None:
    if not isinstance(k, (int, float)) or not 0.0 < k <= 1.0:
        raise UserInputError(f"keep fractions must be in (0, 1], got {shown(k)}")


def _resolve_cutoff(cutoff: Union[float, int], num_layers: int) -> int:
    if isinstance(cutoff, bool) or not isinstance(cutoff, (int, float)):
        raise UserInputError(
            f"speed_cutoff must be a fraction or a layer count, got {shown(cutoff)}")
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
    for k in keep:  # a bad value is named as such, before any count
        _check_fraction(k)
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
    if any(b > a for a, b in zip(keep, keep[1:])):
        raise UserInputError(
            f"keep fractions must not increase (kept sets only shrink), got {list(keep)}"
        )


#: Why a hybrid model revives nothing.
NO_WAY_BACK = ("this model's recurrent (linear-attention) layers take tokens only in order, so "
               "a pruned token cannot come back")


def check_hybrid_schedule(schedule: Schedule, model: nn.Module) -> None:
    """Refuse a schedule a ``model`` with layers without attention cannot run (nothing on
    another model): on a hybrid one that revives; on any a cut after a recurrent or stateless
    layer (a cut follows an attention layer, :func:`~mlx_lazy.adapter.global_layers`, whose
    scores rank the context); on DeepSeek-V4 a SPEED cutoff below its last layer.

    Raises:
        UserInputError: naming the setting and what to use instead.
    """
    recurrent = recurrent_layers(model)
    if not recurrent and not stateless_layers(model):
        return
    cut_layers = global_layers(model)
    if recurrent and schedule.revive:
        raise UserInputError(f"{NO_WAY_BACK}: use revive=False (--no-revive)")
    if (schedule.prompt_depth < schedule.num_layers
            and model_family(getattr(model, "model_type", None)) == "deepseek_v41"):
        raise UserInputError(
            f"a SPEED cutoff at layer {schedule.prompt_depth} of {schedule.num_layers} would "
            "leave this deepseek_v41 model's upper layers without the compressed keys the "
            "layers below make of the prompt: use speed_cutoff=1.0 or full")
    if schedule.prune_layers and not cut_layers:
        raise UserInputError(f"{schedule.method!r} cuts after an attention layer, and this "
                             "model has none a cut may follow (attention alone, not in "
                             "its last layer): use speed, random or full")
    wrong = [layer for layer in schedule.prune_layers if layer not in cut_layers]
    if wrong:
        raise UserInputError(
            f"a cut must follow an attention layer of this model, not layer"
            f"{'s' if wrong[1:] else ''} {', '.join(map(str, wrong))}; its attention layers "
            f"(but the last): {', '.join(map(str, cut_layers))}")
