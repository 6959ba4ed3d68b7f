"""The plan the engine executes: a :class:`Schedule`, resolved once from a
:class:`~mlx_lazy.config.PruningConfig` against a model (:func:`mlx_lazy.resolve.resolve_config`,
which builds it with :func:`~mlx_lazy.config.build_schedule`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any, Mapping, Optional, Tuple

from .completion import Completion, parse_completion
from .scorers import LastQuery, Scorer, parse_scorer, scorer_spec


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
            layers: a spec of :mod:`mlx_lazy.completion` (without ``revive`` none wait).
        max_revivals: with ``revive``, the most tokens a decode step revives at one cut
            (None: no bound, the paper).
        revive_margin: with ``revive``, a decode step's selection divides the score of a
            token it would have to revive by ``1 + revive_margin`` (0: the paper).
        reselect_every: with ``dynamic``, decode steps re-select every this many steps,
            those between seeing the last choice (1: the paper, every step).
        scorer: the scorer (:mod:`mlx_lazy.scorers`) that ranks the context at each cut,
            with its parameters.
        prompt_depth: number of layers that non-anchor prompt tokens may reach (SPEED
            cutoff; ``num_layers`` when unused, the default).
        random_keep: fraction of prompt tokens kept before layer 0 (random drop), or None.
        anchors: number of leading prompt tokens that are always kept at full depth.
        seed: seed of the random drop.
        source: where the pruning came from: ``"preset"``, ``"user"`` (cuts, keep fractions,
            scorer or SPEED cutoff given), ``"calibrated:<file name>"`` or ``"transfer"`` (the
            rule for a model without a calibrated schedule).
    """

    method: str
    num_layers: int
    prune_layers: Tuple[int, ...] = ()
    keep: Tuple[float, ...] = ()
    dynamic: bool = False
    revive: bool = False
    complete: str = "none"
    max_revivals: Optional[int] = None
    revive_margin: float = 0.0
    reselect_every: int = 1
    scorer: Scorer = LastQuery()
    prompt_depth: int = None  # type: ignore[assignment]  (num_layers, set below)
    random_keep: Optional[float] = None
    anchors: int = 1
    seed: int = 0
    source: str = "preset"

    def __post_init__(self) -> None:
        if self.prompt_depth is None:  # once 0: every prompt token but the last dropped
            object.__setattr__(self, "prompt_depth", self.num_layers)

    @classmethod
    def full(cls, num_layers: int) -> "Schedule":
        """The unpruned plan on ``num_layers`` layers: every token through every layer (what
        method ``"full"`` resolves to)."""
        return cls("full", num_layers)

    @cached_property
    def completion(self) -> Completion:
        """The completion mode ``complete`` names."""
        return parse_completion(self.complete)

    @property
    def prunes(self) -> bool:
        """True when any prompt token may skip a layer."""
        return bool(self.prune_layers) or self.random_keep is not None or (
            self.prompt_depth < self.num_layers
        )

    def keep_after(self, layer: int, decoding: bool = False) -> Optional[float]:
        """Fraction kept after ``layer`` (by a decode step: at least the completion mode's
        :attr:`~mlx_lazy.completion.Completion.decode_keep`), or None when ``layer`` is not a
        pruning layer."""
        if layer in self.prune_layers:
            keep = self.keep[self.prune_layers.index(layer)]
            return max(keep, self.completion.decode_keep) if decoding else keep
        return None

    def as_dict(self) -> dict:
        """JSON-friendly form (the scorer as its spec)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["prune_layers"] = list(self.prune_layers)
        d["keep"] = list(self.keep)
        d["scorer"] = scorer_spec(self.scorer)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Schedule":
        """The schedule :meth:`as_dict` gave ``d``.

        Raises:
            TypeError: unknown fields; UserInputError: a bad scorer spec.
        """
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
        return cls(**{**values, "scorer": parse_scorer(values.get("scorer", "last"))})


def check_fits(schedule: Schedule, context: Optional[int]) -> None:
    """Refuse a schedule whose token counts exceed a model's context of ``context`` tokens
    (None: no known limit): a scorer whose window or pool is longer than any prompt the
    model can take.

    Raises:
        UserInputError: naming the field and the context.
    """
    if context is not None:
        schedule.scorer.check_fits(context)
