"""The benchmarks' method syntax: one string per way of generating.

- ``mlx-lm``: ``mlx_lm.stream_generate`` itself (not our engine): the baseline;
- a preset name of :class:`mlx_lazy.PruningConfig` (``full``, ``lazy``, ``speed``,
  ``lazy+speed``, ``static``, ``random``);
- a preset with overrides: ``lazy:layers=6,12,18,24:keep=0.6,0.4,0.25,0.15``,
  ``speed:cutoff=0.6``, ``random:keep=0.5:seed=1``, ``lazy:complete=progressive:8``,
  ``lazy:scorer=window:size=8:pool=2`` (``layers``/``cutoff`` are short for
  ``prune_layers``/``speed_cutoff``; ``at=`` gives the cuts as fractions of the depth; any
  other PruningConfig field name works too; ``scorer=`` takes a scorer spec as
  :func:`mlx_lazy.scorers.parse_scorer` reads it: the parts after it that name the scorer's
  own fields, or ``pool``, belong to it);
- a name of :data:`NAMED_METHODS` (``lazy-4``, ``lazy-norevive``, ...).

A leaf module: the harness, calibration, fidelity, speed and conversation benchmarks all
read it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import UserInputError
from ..inputs import parse_float, parse_int
from ..scorers import Scorer, scorer_spec, spec_keys
from .common import BASELINE, Method

_ALIASES = {"layers": "prune_layers", "cutoff": "speed_cutoff"}
#: Named methods, the one registry both benchmarks read: name -> method string. ``at=`` gives
#: cuts as fractions of the depth (fraction f cuts after layer round(f·depth) − 1, as the
#: presets), so each fits any model.
NAMED_METHODS: dict[str, str] = {
    # The preset without revival: decode re-selects only among tokens that have KV.
    "lazy-norevive": "lazy:revive=false",
    # Four cuts after layers 5/11/17/23 of 30 keeping 60/40/25/15 % (48% of the token-layers).
    "lazy-4": "lazy:at=0.2,0.4,0.6,0.8:keep=0.6,0.4,0.25,0.15",
    # Two cuts, after layers 9/19 of 30, keeping 50/25 %.
    "lazy-2": "lazy:at=0.3333,0.6667:keep=0.5,0.25",
    # Mild: two cuts after layers 11/20 of 30 keeping 70/50 %.
    "lazy-mild": "lazy:at=0.4,0.7:keep=0.7,0.5",
    # LazyLLM cuts after layers 5/11 of 30 keeping 60/40 %, then the SPEED cutoff at 75%.
    "lazy-2+speed": "lazy+speed:at=0.2,0.4:keep=0.6,0.4:cutoff=0.75",
}


# ----------------------------------------------------------------------------------------
# Methods


def _parse_value(text: str) -> Any:
    """``"6,12"`` -> (6, 12); ``"0.5"`` -> 0.5; ``"true"`` -> True; else the string. Numbers
    as the CLI reads them (no ``1_0``); a list with an empty item is refused."""
    if "," in text:
        items = text.split(",")
        if not all(items):
            raise ValueError(f"the list {text!r} has an empty item")
        return tuple(_parse_value(t) for t in items)
    for conv in (parse_int, parse_float):
        try:
            return conv(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def parse_method(spec: str, num_layers: int | None = None) -> Method:
    """Build a :class:`Method` from ``name[:field=value[:field=value...]]`` or a name of
    :data:`NAMED_METHODS`.

    Single-element tuple fields accept a bare value (``keep=0.4`` means ``keep=(0.4,)``);
    ``at=`` (cuts at depth fractions) needs ``num_layers``. Raises ValueError naming the valid
    forms when the spec cannot be understood.
    """
    spec = spec.strip()
    if spec == BASELINE:
        return Method(BASELINE)
    from .. import PruningConfig
    from ..policies import POLICIES, layers_at

    name, *pieces = NAMED_METHODS.get(spec, spec).split(":")
    overrides: list[str] = []
    scorer_at, scorer_keys = -1, ()
    for piece in pieces:  # a value may hold ':' itself (complete=progressive:8)
        key = piece.split("=", 1)[0]
        if overrides and "=" not in piece and piece[:1].isdigit():
            overrides[-1] += ":" + piece
        elif scorer_at >= 0 and "=" in piece and key in scorer_keys:
            overrides[scorer_at] += ":" + piece
        else:
            if key == "scorer":
                scorer_at = len(overrides)
                scorer_keys = spec_keys(piece.split("=", 1)[1])
            overrides.append(piece)
    try:
        cfg = PruningConfig.preset(name)
    except (ValueError, KeyError) as exc:
        raise ValueError(
            f"unknown method {name!r} in {spec!r}: use 'mlx-lm', a PruningConfig method "
            f"(full or policies joined by '+': {', '.join(POLICIES)}), a named method "
            f"({', '.join(NAMED_METHODS)}), optionally with overrides such as "
            "'lazy:layers=6,12:keep=0.6,0.4'"
        ) from exc
    kwargs: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"bad override {item!r} in {spec!r}: expected field=value")
        key, value = item.split("=", 1)
        key = _ALIASES.get(key, key)
        # specs that are strings whatever they read like ("none" is a completion mode)
        parsed = value if key in ("scorer", "complete") else _parse_value(value)
        if key in ("prune_layers", "keep", "at") and not isinstance(parsed, tuple):
            parsed = (parsed,)
        if key == "at":
            if num_layers is None:
                raise ValueError(f"{spec!r} gives cuts as depth fractions (at=): the model's "
                                 "depth is needed")
            key, parsed = "prune_layers", layers_at(parsed, num_layers)
        kwargs[key] = parsed
    if "prune_layers" in kwargs and "keep" in kwargs:  # colliding depth fractions
        kwargs["keep"] = kwargs["keep"][: len(kwargs["prune_layers"])]
    try:
        cfg = dataclasses.replace(cfg, **kwargs)
    except TypeError as exc:
        raise ValueError(f"bad override in {spec!r}: {exc}") from exc
    return Method(spec, cfg)


def parse_methods(text: str) -> tuple[str, ...]:
    """Split a list of method strings on ';' if present, else on ',' (plain names); without a
    ';', a string with fields (``lazy:layers=0,1:keep=0.5,0.4``, whose lists hold commas) is
    one method."""
    if ";" not in text and ":" in text:
        return (text.strip(),) if text.strip() else ()
    sep = ";" if ";" in text else ","
    return tuple(x.strip() for x in text.split(sep) if x.strip())


def method_list(text: str, flag: str) -> tuple[str, ...]:
    """:func:`parse_methods` of a flag's value, which must name at least one method and none
    twice (a repeat would run twice, or be dropped without a word).

    Raises:
        UserInputError: naming ``flag``.
    """
    methods = parse_methods(text)
    if not methods:
        raise UserInputError(f"{flag} names no method")
    twice = next((m for i, m in enumerate(methods) if m in methods[:i]), None)
    if twice is not None:
        raise UserInputError(f"{flag} names {twice} twice")
    return methods


#: Order of the fields in :func:`method_spec`: the cuts first, the scorer (whose spec takes
#: the parts after it) last.
_SPEC_FIELDS = ("prune_layers", "keep", "speed_cutoff", "anchors", "seed", "revive", "complete",
                "max_revivals", "revive_margin", "reselect_every", "quality", "scorer")


def method_spec(config: Any) -> str:
    """The method string of a PruningConfig, naming the fields that differ from its preset
    (``lazy:layers=6,12:keep=0.6,0.4:scorer=window:size=8``); :func:`parse_method` reads
    it back."""
    from .. import PruningConfig

    preset = PruningConfig.preset(config.method)
    short = {v: k for k, v in _ALIASES.items()}
    parts = [config.method]
    for f in _SPEC_FIELDS:
        value = getattr(config, f)
        if value != getattr(preset, f):
            parts.append(f"{short.get(f, f)}={_spec_value(value)}")
    return ":".join(parts)


def _spec_value(x: Any) -> str:
    """A field value as :func:`_parse_value` reads it back."""
    if isinstance(x, tuple):
        return ",".join(_spec_value(v) for v in x)
    if isinstance(x, bool):
        return str(x).lower()
    if isinstance(x, Scorer):
        return scorer_spec(x)
    return repr(x) if isinstance(x, float) else str(x)  # 1.0 stays a fraction, not 1 layer
