"""PNG plots from a results.json (matplotlib, Agg backend: no display needed).

- ``pareto.png``: accuracy vs TTFT speedup over mlx-lm, one curve per method family
  (the line joins that family's Pareto-optimal points), one panel per prompt length.
- ``pareto.png`` of a calibration (:func:`plot_calibration`): relative accuracy with its
  paired 95% interval against the predicted pruning gain (and the measured one, where
  measured), one colour per scorer; :func:`plot_calibrations` (``python -m
  mlx_lazy.bench.plots DIR ... --out PNG``) puts several models' side by side.
- ``token_usage.png``: prompt computations as % of the prompt's tokens (cumulative over
  the whole generation; above 100 where ``exact`` recomputed) in each layer stage (the
  layers split in four, as in the paper's Figure 7).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from ..extras import needs_extra

with needs_extra("bench", "the plots"):
    import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .common import BASELINE  # noqa: E402

#: Each method family's colour in every plot.
COLORS = {
    "mlx-lm": "black", "full": "tab:gray", "lazy": "tab:blue", "speed": "tab:orange",
    "lazy+speed": "tab:green", "static": "tab:red", "random": "tab:purple",
}


def _all_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in result["summary"] if r["task"] == "all"]


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not dominated in (higher speedup, higher score), sorted by speedup."""
    front = []
    for x, y in sorted(points, key=lambda p: (-p[0], -p[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return sorted(front)


def plot_pareto(result: dict[str, Any], path: Path) -> Path:
    """Accuracy vs TTFT speedup (vs mlx-lm), one curve per method family, per length."""
    rows = _all_rows(result)
    lengths = sorted({r["length"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5.5 * len(lengths), 4.2), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        by_family: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in rows:
            if r["length"] == length and r["ttft_speedup"] is not None:
                by_family[r["family"]].append(r)
        for family, rs in by_family.items():
            color = COLORS.get(family, None)
            pts = [(r["ttft_speedup"], r["score"]) for r in rs]
            marker = "*" if family == BASELINE else "o"
            ax.scatter(*zip(*pts), color=color, marker=marker, s=80 if marker == "*" else 25,
                       alpha=0.8, label=family)
            front = pareto_front(pts)
            if len(front) > 1:
                ax.plot(*zip(*front), color=color, alpha=0.8)
            if len(rs) <= 3 and family not in (BASELINE,):
                for r in rs:
                    ax.annotate(r["method"].split(":")[0] if len(rs) == 1 else r["method"],
                                (r["ttft_speedup"], r["score"]), fontsize=7,
                                xytext=(3, 3), textcoords="offset points")
        ax.axvline(1.0, color="black", lw=0.5, ls=":")
        ax.set_title(f"prompt ≤ {length} tokens")
        ax.set_xlabel("TTFT speedup vs mlx-lm (×)")
        ax.set_ylabel("accuracy (mean over tasks)")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="lower left")
    return _save(fig, path)


def stage_bounds(n_layers: int, n_stages: int = 4) -> list[tuple[int, int]]:
    """Split ``n_layers`` into ``n_stages`` contiguous [start, end) ranges."""
    edges = [round(i * n_layers / n_stages) for i in range(n_stages + 1)]
    return [(edges[i], edges[i + 1]) for i in range(n_stages) if edges[i + 1] > edges[i]]


def plot_token_usage(result: dict[str, Any], path: Path, max_methods: int = 12) -> Path:
    """Prompt computations per layer stage as % of the prompt's tokens, cumulative over the
    generation (above 100 where ``complete="exact"`` recomputed)."""
    usage: dict[str, list[list[float]]] = defaultdict(list)
    for r in _all_rows(result):
        if r.get("layer_usage_pct"):
            usage[r["method"]].append(r["layer_usage_pct"])
    methods = result["meta"]["methods"]
    # Presets and progressive schedules first; single-layer schedules only if room is left.
    names = sorted(usage, key=lambda n: len(methods.get(n, {}).get("prune_layers") or ()) == 1)
    names = names[:max_methods]
    n_layers = result["meta"]["n_layers"]
    stages = stage_bounds(n_layers)
    fig, ax = plt.subplots(figsize=(max(7.0, 0.9 * len(names) + 3), 4.6 + 0.15 * len(names)))
    width, top = 0.8 / max(len(names), 1), 100.0
    for k, name in enumerate(names):
        per_layer = [statistics.fmean(col) for col in zip(*usage[name])]
        vals = [statistics.fmean(per_layer[a:b]) for a, b in stages]
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(stages))]
        color = COLORS.get(name, plt.cm.tab20(k % 20))  # presets by family colour
        ax.bar(xs, vals, width, label=name, color=color)
        top = max(top, *vals)
    ax.set_xticks(range(len(stages)), [f"layers {a + 1}–{b}" for a, b in stages])
    ax.set_ylabel("prompt computations, % of its tokens")
    ax.set_ylim(0, top + 5)
    ax.set_title("cumulative prompt-token usage by layer stage (whole generation)")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def write_plots(result: dict[str, Any], out: str | Path) -> list[Path]:
    """Write every plot that the results support under ``out``; return their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if not result["summary"]:
        return []
    paths = [plot_pareto(result, out / "pareto.png"),
             plot_token_usage(result, out / "token_usage.png")]
    return paths


#: Legend entry of the hollow markers: candidates whose rung a stopped calibration left unfinished.
PARTIAL_LABEL = "partial rung (stopped early)"


def plot_calibration(doc: dict[str, Any], cells: list[str], path: Path) -> Path:
    """Calibration candidates: relative accuracy (1 − paired relative loss, 95% bootstrap
    interval) against the predicted pruning gain, one colour per scorer, marker size by
    samples per cell, hollow when its rung is unfinished (:data:`PARTIAL_LABEL`); a
    candidate whose gain was measured also shows it (×, joined by a line)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    _draw_calibration(ax, doc, cells, f"{', '.join(cells)} (marker size: samples per cell)")
    return _save(fig, path)


def plot_calibrations(dirs: list[Path], path: Path) -> Path:
    """One :func:`plot_calibration` panel per calibration output folder (one per model),
    side by side: the frontier of every model in one figure."""
    import json

    from .calibration_results import used_cells

    fig, axes = plt.subplots(1, len(dirs), figsize=(6.5 * len(dirs), 4.5), squeeze=False)
    for ax, d in zip(axes[0], dirs):
        doc = json.loads((Path(d) / "results.json").read_text())
        cells = used_cells(doc)
        model = (Path(doc["options"]["model"]).name if doc["options"].get("model")
                 else f"default model ({doc['fingerprint']['model_type']})")
        _draw_calibration(ax, doc, cells, f"{model}: {', '.join(cells)}")
    return _save(fig, path)


def _draw_calibration(ax: Any, doc: dict[str, Any], cells: list[str], title: str) -> None:
    from .calibration_results import candidate_rows

    rows = candidate_rows(doc, cells)
    scorers = sorted({_scorer_label(r["config"]) for r in rows})
    cmap = plt.get_cmap("tab10")
    for i, label in enumerate(scorers):
        mine = [r for r in rows if _scorer_label(r["config"]) == label]
        x = [r["gain"] for r in mine]
        y = [1 - r["paired"].rel_loss for r in mine]
        err = [[r["paired"].rel_loss_ci[1] - r["paired"].rel_loss for r in mine],
               [r["paired"].rel_loss - r["paired"].rel_loss_ci[0] for r in mine]]
        ax.errorbar(x, y, yerr=err, fmt="none", ecolor=cmap(i), alpha=0.4)
        ax.scatter(x, y, s=[8 + r["n"] for r in mine], edgecolors=cmap(i), label=label,
                   facecolors=[(0, 0, 0, 0) if r["partial"] else cmap(i) for r in mine])
        for r, yi in zip(mine, y):
            if r["measured_gain"] is not None:
                ax.plot([r["gain"], r["measured_gain"]], [yi, yi], color=cmap(i), lw=0.8)
                ax.scatter([r["measured_gain"]], [yi], marker="x", color=cmap(i))
    if any(r["measured_gain"] is not None for r in rows):
        ax.scatter([], [], marker="x", color="gray", label="measured gain")
    if any(r["partial"] for r in rows):
        ax.scatter([], [], facecolors="none", edgecolors="gray", label=PARTIAL_LABEL)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("pruning gain at the gain length (our full prefill / pruned), predicted")
    ax.set_ylabel("accuracy relative to full (paired)")
    ax.set_title(title, fontsize=10)
    if rows:
        ax.legend(fontsize=8)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m mlx_lazy.bench.plots DIR [DIR ...] --out PNG``: the calibration frontiers
    of the given ``python -m mlx_lazy.calibrate`` output folders side by side."""
    from .._args import OneLineParser, path_arg

    p = OneLineParser(prog="python -m mlx_lazy.bench.plots", description=main.__doc__)
    p.add_argument("dirs", nargs="+", type=path_arg, help="calibration output folders")
    p.add_argument("--out", type=path_arg, required=True, help="PNG file to write")
    args = p.parse_args(argv)
    missing = [d for d in args.dirs if not (d / "results.json").is_file()]
    if missing:
        p.error(f"{missing[0]} holds no results.json of a calibration")
    if args.out.suffix.lower() != ".png":  # matplotlib picks the format by the suffix
        p.error(f"--out must name a .png file, got {str(args.out)!r}")
    from ..errors import UserInputError
    from ..folders import check_destination

    try:
        check_destination(args.out, "--out")
    except UserInputError as e:
        p.error(str(e))
    try:
        print(plot_calibrations(args.dirs, args.out))
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # JSON's errors included
        p.error(f"{' '.join(map(str, args.dirs))}: not calibration results ({e!r})")
    return 0


def _scorer_label(config: dict[str, Any]) -> str:
    """The scorer spec of a calibration candidate's config, spaced for a legend."""
    return config.get("scorer", "last").replace(":", " ")


if __name__ == "__main__":
    raise SystemExit(main())
