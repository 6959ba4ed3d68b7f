"""Teacher-forced agreement: how often a pruned path picks the unpruned path's next token.

Along the unpruned path's own greedy continuation of natural text, the pruned engine is fed
the same tokens step by step; at each step we check whether its argmax equals the unpruned
token. No task has to be solvable by the model, every step is a paired sample, and drift
shows early: a cheap, sensitive fidelity measure (the bar is ≥ 95%).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import mlx.core as mx

from .. import LazyEngine, PruningConfig


def greedy_tokens(model: Any, prompt: Sequence[int], steps: int,
                  config: Optional[PruningConfig] = None) -> list[int]:
    """The engine's greedy continuation of ``prompt`` (unpruned by default)."""
    engine = LazyEngine(model, config)
    logits, out = engine.prefill(mx.array(prompt)), []
    for _ in range(steps):
        out.append(int(mx.argmax(logits)))
        logits = engine.decode(out[-1])
    return out


def agreement(model: Any, config: PruningConfig, prompt: Sequence[int],
              reference: Sequence[int]) -> list[bool]:
    """Per step: does ``config``'s argmax equal ``reference`` (the unpruned continuation)
    when fed the reference tokens?"""
    engine = LazyEngine(model, config)
    logits, hits = engine.prefill(mx.array(prompt)), []
    for token in reference:
        hits.append(int(mx.argmax(logits)) == token)
        logits = engine.decode(token)
    return hits
