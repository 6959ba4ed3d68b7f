"""Where a user's :class:`~mlx_lazy.config.PruningConfig` becomes the
:class:`~mlx_lazy.schedule.Schedule` an engine runs, once per request: :func:`resolve_config`
(the calibrated lookup, the fingerprint check, the checks against the model's depth and the
``complete`` mode parsed into its :class:`~mlx_lazy.completion.Completion`).

The API (``make_prompt_cache`` / ``stream_generate`` / ``generate_step``), the command line and
the server each call it once per call, run or request and hand the schedule on; nothing below
them resolves again.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, Optional, Tuple, Union

import mlx.nn as nn

from .adapter import ModelAdapter, global_layers, recurrent_layers, stateless_layers
from .config import PruningConfig, build_schedule
from .errors import UserInputError
from .policies import (NO_WAY_BACK, REVIVAL_IDLE, LazyCuts, ScoredCuts, check_hybrid_schedule,
                       check_revive, check_taken, compose, cuts_at_global_layers,
                       revival_fields)
from .schedule import Schedule
from .schedule_files import calibrated, check_model, check_quality


def as_config(config: Union[PruningConfig, str, None]) -> Optional[PruningConfig]:
    """A config given as a :class:`PruningConfig`, a method name (its preset) or None.

    Raises:
        UserInputError: anything else, or an unknown method name.
    """
    if isinstance(config, str):
        return PruningConfig.preset(config)
    if config is not None and not isinstance(config, PruningConfig):
        raise UserInputError(
            f"config must be a PruningConfig, a method name or None, got {config!r}")
    return config


def check_config(config: PruningConfig) -> None:
    """The checks of a request that need no model (the CLI runs them before one loads), made
    before a calibrated schedule stands in for it: a field its method does not take
    (speed_cutoff on a plain "lazy" is refused, not dropped with the preset), revival fields
    without revive, a quality on a request that is not plain ``lazy``.

    Raises:
        UserInputError: naming the field.
    """
    check_taken(config, compose(config.method))
    check_revive(config)
    check_quality(config)


def resolve_config(model: nn.Module, config: Union[PruningConfig, str, None] = None, *,
                   fingerprint: Optional[Dict[str, Any]] = None) -> Schedule:
    """The schedule ``model`` runs for ``config`` (None: ``"full"``): a plain ``"lazy"`` takes
    the model's calibrated schedule (:func:`mlx_lazy.schedule_files.calibrated`), a calibrated
    schedule must match the model's fingerprint, and every value is checked against the
    model's depth (:func:`~mlx_lazy.config.build_schedule`); the schedule carries ``complete``
    as its typed mode (``Schedule.completion``).

    Args:
        model: a model from :func:`mlx_lazy.load`.
        config: a :class:`PruningConfig`, a method name (its preset) or None.
        fingerprint: ``ModelAdapter(model).fingerprint()`` when the caller holds it already
            (the server computes it once, on the thread that owns the model); None computes it.

    Raises:
        UserInputError: an invalid config or a schedule calibrated for another model.
    """
    requested = as_config(config) or PruningConfig()
    check_config(requested)
    if fingerprint is None:
        fingerprint = ModelAdapter(model).fingerprint()
    cut_layers, recurrent = global_layers(model), recurrent_layers(model)
    chosen = calibrated(requested, fingerprint, getattr(model, "mlx_lazy_schedules", None),
                        cut_layers)
    if recurrent:
        check_hybrid(requested)
    if recurrent or stateless_layers(model):
        chosen = for_hybrid(chosen, cut_layers, fingerprint["num_layers"], bool(recurrent))
    check_model(chosen, fingerprint)
    schedule = build_schedule(chosen, fingerprint["num_layers"])
    check_hybrid_schedule(schedule, model)
    return schedule


def check_hybrid(requested: PruningConfig) -> None:
    """Refuse a request that names a revival setting (:data:`~mlx_lazy.policies.REVIVAL_IDLE`)
    on a hybrid model: a recurrent layer takes tokens in order only (:func:`~mlx_lazy.
    adapter.recurrent_layers`), so a pruned token can never come back (:func:`for_hybrid`).

    Raises:
        UserInputError: naming the settings to drop.
    """
    given = revival_fields(requested)
    if given:
        # spelt as in a method spec (lazy:complete=exact), which the CLI and the API both read
        named = ", ".join(f"{f}={getattr(requested, f)}" for f in given)
        raise UserInputError(f"{NO_WAY_BACK}: drop {named}")


def for_hybrid(config: PruningConfig, cut_layers: Tuple[int, ...], num_layers: int,
               recurrent: bool = True) -> PruningConfig:
    """``config`` as a model with layers without attention runs it: on a hybrid
    (``recurrent``), LazyLLM without revival (``revive`` is True by default everywhere, so it
    cannot mean a request; a calibrated schedule's or the transfer rule's revival settings are
    dropped); on any, a preset's cuts moved onto the nearest of the attention layers
    ``cut_layers`` below its SPEED cutoff, if any
    (:func:`~mlx_lazy.policies.cuts_at_global_layers`), keeping the fractions the request
    gives for those; cuts the request gives stay as given
    (:func:`~mlx_lazy.policies.check_hybrid_schedule` refuses the wrong ones)."""
    policies = compose(config.method).values()
    if recurrent and any(issubclass(p, LazyCuts) for p in policies):
        config = replace(config, revive=False, **{f: None for f in REVIVAL_IDLE})
    if config.prune_layers is None and any(issubclass(p, ScoredCuts) for p in policies):
        preset = build_schedule(replace(config, keep=None), num_layers)
        depth = preset.prompt_depth
        below = [layer for layer in cut_layers if layer < depth - 1]  # SPEED's cutoff
        if cut_layers and not below:
            raise UserInputError(
                f"no attention layer of this model lies below the SPEED cutoff {depth} "
                f"(a cut must follow one, with a layer after it below the cutoff; its "
                f"attention layers: {', '.join(map(str, cut_layers))}): use speed alone, or "
                f"a cutoff of at least {cut_layers[0] + 2} layers")
        layers, keep = cuts_at_global_layers(preset.prune_layers, preset.keep, below)
        # keep fractions the request gives are for the cuts that run: those moved
        config = replace(config, prune_layers=layers, keep=config.keep or keep,
                         source=config.source or ("user" if config.keep else preset.source))
    return config
