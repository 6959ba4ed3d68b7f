"""What a ``mlx_lazy.generate`` run prints about itself: mlx-lm style statistics lines
(:func:`format_summary`) and ``--compare``'s side-by-side table of the baseline and the pruned
run (:func:`format_compare_table`), from each run's :class:`RunResult`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .engine import GenerationStats

MB = 1e6  # tables report decimal megabytes, as mlx-lm reports decimal gigabytes


@dataclass
class RunResult:
    """One generation: its statistics, full text and output token ids."""

    method: str
    stats: GenerationStats
    text: str
    tokens: list[int] = field(default_factory=list)


def first_divergence(a: RunResult, b: RunResult) -> Optional[int]:
    """Index of the first output token where the runs differ; None when the texts agree."""
    if a.text == b.text:
        return None
    for i, (x, y) in enumerate(zip(a.tokens, b.tokens)):
        if x != y:
            return i
    return min(len(a.tokens), len(b.tokens))


def format_summary(stats: GenerationStats) -> str:
    """mlx-lm style statistics lines for one run, plus a pruning line."""
    return "\n".join([
        f"Prompt: {stats.prompt_tokens} tokens"
        + (f" ({stats.cached_tokens} from the cache, "
           f"{stats.prompt_tokens - stats.cached_tokens} new)" if stats.cached_tokens else "")
        + f", {stats.prompt_tps:.3f} tokens-per-sec (time to first token {stats.ttft_s:.3f} s)",
        f"Generation: {stats.generation_tokens} tokens, {stats.generation_tps:.3f} tokens-per-sec"
        f" (whole answer {stats.answer_s:.3f} s)",
        f"Peak memory: {stats.peak_memory_bytes / 1e9:.3f} GB",
        f"Pruning ({stats.method}): {stats.prompt_token_layers_computed_pct:.1f}% of the prompt's "
        f"token-layers computed, KV {stats.kv_bytes / MB:.2f} MB, "
        f"aux {stats.aux_bytes / MB:.2f} MB, "
        f"revivals {stats.revivals}",
        *([f"Completion ({stats.schedule.get('complete')}): {stats.completed_token_layers} "
           "token-layers carried on after the first token"]
          if stats.completed_token_layers else []),
    ])


def _prefill_work_pct(stats: GenerationStats) -> float:
    """Share of the prompt's token-layer work done in prefill. Unlike
    ``prompt_tokens_computed_pct`` (tokens that reached the top layer), this shows SPEED's
    partial-depth savings."""
    layers = stats.prefill_tokens_per_layer
    full = stats.prompt_tokens * len(layers)
    return 100.0 * sum(layers) / full if full else 0.0


def format_compare_table(base: RunResult, other: RunResult) -> str:
    """Side-by-side table of the baseline and the pruned run, with a ratio column."""
    rows = [
        # label, value getter, format, show ratio
        ("prompt tokens", lambda s: s.prompt_tokens, "{:d}", False),
        ("generated tokens", lambda s: s.generation_tokens, "{:d}", False),
        ("time to first token (s)", lambda s: s.ttft_s, "{:.3f}", True),
        ("whole answer (s)", lambda s: s.answer_s, "{:.3f}", True),
        # completion, when the mode has any, runs before the second token: in this average
        ("time per output token (ms)", lambda s: s.tpot_s * 1e3, "{:.2f}", True),
        ("prompt token-layers computed (%)", lambda s: s.prompt_token_layers_computed_pct,
         "{:.1f}", False),
        ("token-layers completed", lambda s: s.completed_token_layers, "{:d}", False),
        ("prefill token-layers (%)", _prefill_work_pct, "{:.1f}", False),
        ("KV cache (MB)", lambda s: s.kv_bytes / MB, "{:.2f}", True),
        ("aux cache (MB)", lambda s: s.aux_bytes / MB, "{:.2f}", False),
        ("peak memory (MB)", lambda s: s.peak_memory_bytes / MB, "{:.1f}", True),
        ("revivals", lambda s: s.revivals, "{:d}", False),
    ]
    header = ("metric", base.method, other.method, f"{other.method}/{base.method}")
    table = [header]
    for label, get, fmt, ratio in rows:
        a, b = get(base.stats), get(other.stats)
        r = f"{b / a:.2f}x" if ratio and a else ""
        table.append((label, fmt.format(a), fmt.format(b), r))
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    lines = [
        "  ".join([row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])])
        .rstrip()
        for row in table
    ]
    lines.insert(1, "-" * len(lines[0]))
    div = first_divergence(base, other)
    agree = "identical text" if div is None else f"differ from output token {div}"
    lines.append(f"{'outputs'.ljust(widths[0])}  {agree}")
    return "\n".join(lines)
