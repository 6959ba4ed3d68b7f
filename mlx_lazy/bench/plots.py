"""PNG plots from a results.json (matplotlib, Agg backend: no display needed).

- ``pareto.png``: accuracy vs TTFT speedup over mlx-lm, one curve per method family
  (the line joins that family's Pareto-optimal points), one panel per prompt length.
- ``sweep_heatmap.png``: accuracy (relative to the baseline) of single-layer LazyLLM
  schedules, pruning layer position × keep fraction, annotated with the TTFT speedup.
  Only when the results contain a ``--sweep``.
- ``token_usage.png``: % of prompt tokens computed (cumulative over the whole
  generation) in each layer stage (the layers split in four, as in the paper's Figure 7).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BASELINE = "mlx-lm"
_COLORS = {
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
            color = _COLORS.get(family, None)
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep_heatmap(result: dict[str, Any], path: Path) -> Path | None:
    """Single-layer sweep: accuracy / baseline by (pruning layer, keep); None if no sweep."""
    methods = result["meta"]["methods"]
    cells: dict[tuple[int, float], list[tuple[float, float | None]]] = defaultdict(list)
    for r in _all_rows(result):
        sched = methods.get(r["method"], {})
        layers, keep = sched.get("prune_layers"), sched.get("keep")
        if r["family"] != "lazy" or not layers or len(layers) != 1 or not keep:
            continue
        base = r["baseline_score"]
        rel = r["score"] / base if base else float("nan")
        cells[(int(layers[0]), float(keep[0]))].append((rel, r["ttft_speedup"]))
    if not cells:
        return None
    xs = sorted({k[0] for k in cells})
    ys = sorted({k[1] for k in cells})
    grid = [[float("nan")] * len(xs) for _ in ys]
    fig, ax = plt.subplots(figsize=(1.1 * len(xs) + 2.5, 0.8 * len(ys) + 2))
    for (x, y), vals in cells.items():
        rel = statistics.fmean(v[0] for v in vals)
        sp = [v[1] for v in vals if v[1] is not None]
        i, j = ys.index(y), xs.index(x)
        grid[i][j] = rel
        label = f"{rel:.2f}" + (f"\n{statistics.fmean(sp):.2f}×" if sp else "")
        ax.text(j, i, label, ha="center", va="center", fontsize=8)
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1.05, origin="lower", aspect="auto")
    ax.set_xticks(range(len(xs)), [str(x) for x in xs])
    ax.set_yticks(range(len(ys)), [f"{y:g}" for y in ys])
    ax.set_xlabel("pruning layer (tokens scored by this layer's attention)")
    ax.set_ylabel("keep fraction")
    ax.set_title("single-layer LazyLLM: accuracy / baseline (TTFT speedup)")
    fig.colorbar(im, ax=ax, label="accuracy relative to mlx-lm")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def stage_bounds(n_layers: int, n_stages: int = 4) -> list[tuple[int, int]]:
    """Split ``n_layers`` into ``n_stages`` contiguous [start, end) ranges."""
    edges = [round(i * n_layers / n_stages) for i in range(n_stages + 1)]
    return [(edges[i], edges[i + 1]) for i in range(n_stages) if edges[i + 1] > edges[i]]


def plot_token_usage(result: dict[str, Any], path: Path, max_methods: int = 12) -> Path:
    """% of prompt tokens computed per layer stage, cumulative over the generation."""
    usage: dict[str, list[list[float]]] = defaultdict(list)
    for r in _all_rows(result):
        if r.get("layer_usage_pct"):
            usage[r["method"]].append(r["layer_usage_pct"])
    methods = result["meta"]["methods"]
    # Presets and progressive schedules first; single-layer sweep points only if room is left.
    names = sorted(usage, key=lambda n: len(methods.get(n, {}).get("prune_layers") or ()) == 1)
    names = names[:max_methods]
    n_layers = result["meta"]["n_layers"]
    stages = stage_bounds(n_layers)
    fig, ax = plt.subplots(figsize=(max(7.0, 0.9 * len(names) + 3), 4.6 + 0.15 * len(names)))
    width = 0.8 / max(len(names), 1)
    for k, name in enumerate(names):
        per_layer = [statistics.fmean(col) for col in zip(*usage[name])]
        vals = [statistics.fmean(per_layer[a:b]) for a, b in stages]
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(stages))]
        color = _COLORS.get(name, plt.cm.tab20(k % 20))  # presets by family colour
        ax.bar(xs, vals, width, label=name, color=color)
    ax.set_xticks(range(len(stages)), [f"layers {a + 1}–{b}" for a, b in stages])
    ax.set_ylabel("% of prompt tokens computed")
    ax.set_ylim(0, 105)
    ax.set_title("cumulative prompt-token usage by layer stage (whole generation)")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(result: dict[str, Any], out: str | Path) -> list[Path]:
    """Write every plot that the results support under ``out``; return their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if not result["summary"]:
        return []
    paths = [plot_pareto(result, out / "pareto.png"),
             plot_sweep_heatmap(result, out / "sweep_heatmap.png"),
             plot_token_usage(result, out / "token_usage.png")]
    return [p for p in paths if p is not None]
