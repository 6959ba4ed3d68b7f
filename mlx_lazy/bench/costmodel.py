"""A linear cost model of prefill time, fitted on unpruned runs.

Model::

    t  ≈  a · token_layers  +  b · attention_pairs  +  c

- ``token_layers``    = ``sum(stats.prefill_tokens_per_layer)``: one unit per token computed at
  one layer (projections, MLP, norms, RoPE: everything linear in the number of tokens).
- ``attention_pairs`` = ``stats.prefill_attention_pairs``: query-key pairs scored in prefill
  (QKᵀ, mask, softmax, PV: everything quadratic in the context).
- ``c``: fixed cost (embedding of the prompt, final norm + LM head on one position, Python).

The coefficients are fitted by least squares (numpy) on *unpruned* runs at ≥ 3 distinct prompt
lengths (the two count columns grow as N and ~N², so three lengths identify a, b and c). The model
then predicts what a *pruned* run should cost from its own counts; a pruned run measured well
above its prediction means the pruning machinery itself (scoring, gathers, the Aux Cache, host
syncs) costs more than the work it saves. ``mlx_lazy.bench.speed`` reports the error of every
pruned run against this prediction (target: within 10%).

By default the fit minimises *relative* residuals (each row divided by its measured time), which
matches the relative accuracy target and keeps the long runs from dominating the short ones.

Example::

    model = CostModel.fit([stats_1k, stats_2k, stats_4k], [t_1k, t_2k, t_4k])
    model.predict(pruned_stats)          # seconds
    model.relative_error(pruned_stats, measured_ttft)
    json.dumps(model.as_dict())
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from ..adapter import ModelAdapter, attention_module, text_args
from ..selection import cuts_select, kept_count

__all__ = ["PrefillCounts", "CostModel", "counts", "fit", "layer_params", "linear_params",
           "predicted_counts", "prior"]


@dataclass(frozen=True)
class PrefillCounts:
    """The two work counts the cost model reads from one prefill."""

    token_layers: int
    attention_pairs: int


#: Anything ``counts`` accepts: a GenerationStats (or any object with the two attributes), its
#: ``as_dict()``, a PrefillCounts, or a ``(token_layers, attention_pairs)`` pair.
StatsLike = Union[PrefillCounts, Mapping[str, Any], Sequence[int], Any]


def counts(stats: StatsLike) -> PrefillCounts:
    """Extract ``(token_layers, attention_pairs)`` from a GenerationStats-like value.

    Accepts a :class:`PrefillCounts`, a ``(token_layers, attention_pairs)`` tuple, a mapping with
    ``prefill_tokens_per_layer`` and ``prefill_attention_pairs`` (``GenerationStats.as_dict()``),
    or any object with those two attributes (``GenerationStats`` itself).
    """
    if isinstance(stats, PrefillCounts):
        return stats
    if isinstance(stats, Mapping):
        per_layer = stats["prefill_tokens_per_layer"]
        pairs = stats["prefill_attention_pairs"]
    elif isinstance(stats, (tuple, list)) and len(stats) == 2:
        return PrefillCounts(int(stats[0]), int(stats[1]))
    else:
        try:
            per_layer = stats.prefill_tokens_per_layer
            pairs = stats.prefill_attention_pairs
        except AttributeError as exc:
            raise TypeError(
                f"cannot read prefill counts from {type(stats).__name__}: expected a "
                "GenerationStats, its as_dict(), a PrefillCounts or a (token_layers, "
                "attention_pairs) pair"
            ) from exc
    return PrefillCounts(int(sum(per_layer)), int(pairs))


@dataclass
class CostModel:
    """Fitted coefficients of ``t ≈ a·token_layers + b·attention_pairs + c`` (seconds).

    Attributes:
        a: seconds per token-layer.
        b: seconds per scored query-key pair.
        c: fixed seconds per prefill.
        n_samples: number of runs the fit used.
        rms_relative_residual: RMS of (measured − fitted) / measured over the fit's runs.
        max_relative_residual: largest |measured − fitted| / measured over the fit's runs.
    """

    a: float
    b: float
    c: float
    n_samples: int = 0
    rms_relative_residual: float = 0.0
    max_relative_residual: float = 0.0

    @classmethod
    def fit(
        cls,
        stats: Sequence[StatsLike],
        times_s: Sequence[float],
        *,
        relative: bool = True,
        nonnegative: bool = True,
    ) -> "CostModel":
        """Least-squares fit on runs given as parallel sequences of stats and measured seconds.

        Args:
            stats: one GenerationStats-like value per run (see :func:`counts`); unpruned runs.
            times_s: measured prefill time (e.g. TTFT) of each run, in seconds.
            relative: minimise relative residuals (rows weighted by 1/t) instead of absolute.
            nonnegative: constrain a, b, c to be >= 0 (costs cannot be negative; on noisy timings
                an unconstrained fit can trade a negative term against another and then
                extrapolate badly to pruned runs).

        Raises:
            ValueError: lengths differ, a time is not positive, or the runs cover fewer than
                three distinct (token_layers, attention_pairs) points (a, b, c not identifiable:
                add runs at more prompt lengths).
        """
        rows = [counts(s) for s in stats]
        t = np.asarray(times_s, dtype=np.float64)
        if len(rows) != len(t):
            raise ValueError(f"got {len(rows)} stats but {len(t)} times; pass one time per run")
        if np.any(~np.isfinite(t)) or np.any(t <= 0):
            raise ValueError("times_s must be positive finite seconds")
        distinct = {(r.token_layers, r.attention_pairs) for r in rows}
        if len(distinct) < 3:
            raise ValueError(
                f"the fit needs runs at >= 3 distinct prompt lengths, got {len(distinct)} "
                "distinct (token_layers, attention_pairs) points; add runs at more lengths"
            )
        X = np.array([[r.token_layers, r.attention_pairs, 1.0] for r in rows], dtype=np.float64)
        w = 1.0 / t if relative else np.ones_like(t)
        coef = _lstsq(X, t, w, nonnegative)
        fitted = X @ coef
        rel = (t - fitted) / t
        return cls(
            a=float(coef[0]),
            b=float(coef[1]),
            c=float(coef[2]),
            n_samples=len(rows),
            rms_relative_residual=float(np.sqrt(np.mean(rel**2))),
            max_relative_residual=float(np.max(np.abs(rel))),
        )

    def predict(self, stats: StatsLike) -> float:
        """Predicted prefill seconds for a run with these counts (see :func:`counts`)."""
        n = counts(stats)
        return self.a * n.token_layers + self.b * n.attention_pairs + self.c

    def relative_error(self, stats: StatsLike, measured_s: float) -> float:
        """(measured − predicted) / predicted: positive means slower than the model predicts."""
        predicted = self.predict(stats)
        return (measured_s - predicted) / predicted

    def as_dict(self) -> dict[str, float | int]:
        """JSON-ready coefficients and fit quality."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CostModel":
        """Inverse of :meth:`as_dict`."""
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def _lstsq(X: np.ndarray, t: np.ndarray, w: np.ndarray, nonnegative: bool) -> np.ndarray:
    """Weighted least squares ``min ||w·(X c − t)||``, optionally with ``c >= 0``.

    The non-negative solution is found exactly by trying every subset of columns (2^3 − 1 = 7
    unconstrained solves; the NNLS optimum is the best of the feasible ones).
    """
    scale = np.abs(X).max(axis=0)
    scale[scale == 0] = 1.0
    Xs = X / scale  # unit-max columns: pairs ~1e9 and ones ~1 in one well-conditioned solve
    A, y = Xs * w[:, None], t * w
    n = X.shape[1]
    best, best_res = None, np.inf
    subsets = [tuple(range(n))] if not nonnegative else [
        tuple(j for j in range(n) if mask >> j & 1) for mask in range(1, 2**n)
    ]
    for cols in subsets:
        sol, *_ = np.linalg.lstsq(A[:, cols], y, rcond=None)
        if nonnegative and np.any(sol < 0):
            continue
        coef = np.zeros(n)
        coef[list(cols)] = sol
        res = float(np.sum((A @ coef - y) ** 2))
        if res < best_res * (1 - 1e-12):
            best, best_res = coef, res
    assert best is not None  # single columns of positive data always give a feasible fit
    return best / scale


#: Module-level alias: ``costmodel.fit(stats, times)`` is ``CostModel.fit(stats, times)``.
fit = CostModel.fit

#: The fit on SmolLM2-135M-Instruct float32 (2-core AMD EPYC, OpenBLAS; README): seconds per
#: token-layer and per attention pair, and what they scale with.
_REFERENCE = dict(a=94e-6, b=102e-9, params_per_layer=3_538_944, head_dims=9 * 64)


def linear_params(module: Any, experts_per_token: Optional[int] = None) -> float:
    """Weights of ``module``'s linear layers that a token runs through: quantized ones
    counted at their float size, a sparse MoE's experts (mlx-lm's switch layers, whose
    weights stack one matrix per expert) at the ``experts_per_token`` of them a token takes
    (all of them when None)."""
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    switch = (SwitchLinear, QuantizedSwitchLinear)
    params = 0.0
    for _, m in module.named_modules():
        if isinstance(m, (nn.Linear, nn.QuantizedLinear, *switch)):
            size = m.weight.size * (32 // m.bits if hasattr(m, "bits") else 1)
            experts = m.weight.shape[0] if isinstance(m, switch) else 1
            params += size * min(experts_per_token or experts, experts) / experts
    return params


def layer_params(adapter: ModelAdapter) -> float:
    """:func:`linear_params` of a token's layer, averaged over the layers (Gemma 4's differ;
    an MoE layer's experts at the share a token takes: k of E)."""
    args = text_args(adapter.text)
    per_token = getattr(args, "num_experts_per_tok", None) or getattr(args, "top_k_experts", None)
    return sum(linear_params(layer, per_token) for layer in adapter.layers) / adapter.num_layers


def head_dims(adapter: ModelAdapter) -> float:
    """Query heads x head_dim of a layer, averaged over the layers (Gemma 4's global layers
    have wider heads, OpenELM's layers more or fewer of them; a hybrid's recurrent layers and
    layers without attention pair no query with a key, 0): what a
    query-key pair's arithmetic scales with (the head size from the attention scale, 1/sqrt
    of it, where the module does not say it: Granite's scale is a multiplier of its own)."""
    dims = [0 if adapter.attention_free(i) else
            getattr(attention_module(layer), "n_heads", adapter.n_heads)
            * (getattr(attention_module(layer), "head_dim", None) or round(adapter.scale ** -2))
            for i, layer in enumerate(adapter.layers)]
    return sum(dims) / len(dims)


def prior(model: Any) -> CostModel:
    """A cost model for ``model`` without timing it: the SmolLM2 reference fit with the
    per-token-layer cost scaled by the layer's linear parameters and the per-pair cost by
    heads × head_dim. Good for ranking schedules (only ratios are used); measure to confirm.
    """
    adapter = ModelAdapter(model)
    params = layer_params(adapter)
    r = _REFERENCE
    return CostModel(a=r["a"] * params / r["params_per_layer"],
                     b=r["b"] * head_dims(adapter) / r["head_dims"], c=0.0)


def predicted_counts(schedule: Any, n: int, block_size: int = 256) -> PrefillCounts:
    """Prefill counts of a LazyLLM schedule (a resolved ``Schedule``) on an ``n``-token prompt,
    without running it: ``round(keep·n)`` tokens (at least the always-kept ones: anchors and
    the query token or the scorer's window) after each cut; block-causal pairs as the engine
    counts them; at the last layer one query.
    """
    forced = schedule.anchors + max(1, len(schedule.scorer.always_kept(n)))
    layers = schedule.num_layers
    active, token_layers, pairs = n, 0, 0
    for layer in range(layers):
        token_layers += active
        if layer == layers - 1:
            pairs += active
        else:
            pairs += sum((min(i + block_size, active) - i) * min(i + block_size, active)
                         for i in range(0, active, block_size)) if active > 1 else active
        keep = schedule.keep_after(layer)
        if keep is not None and cuts_select(n):
            active = min(active, max(forced, kept_count(keep, n), 1))
    return PrefillCounts(token_layers, pairs)
