"""Teacher-forced agreement: how often a pruned path picks the unpruned path's next token.

Along the unpruned path's own greedy continuation of natural text, the pruned engine is fed
the same tokens step by step; at each step we check whether its argmax equals the unpruned
token. No task has to be solvable by the model, every step is a paired sample, and drift
shows early: a cheap, sensitive fidelity measure (the bar is ≥ 95%).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import mlx.core as mx

from .. import LazyEngine, PruningConfig, resolve_config
from . import stats
from .tasks import build_prompt

#: a prose prompt and the unpruned path's greedy continuation of it
Reference = tuple[list[int], list[int]]


def greedy_tokens(model: Any, prompt: Sequence[int], steps: int,
                  config: Optional[PruningConfig] = None) -> list[int]:
    """The engine's greedy continuation of ``prompt`` (unpruned by default)."""
    engine = LazyEngine(model, resolve_config(model, config))
    logits, out = engine.prefill(mx.array(prompt)), []
    for _ in range(steps):
        out.append(int(mx.argmax(logits)))
        logits = engine.decode(out[-1])
    return out


def agreement(model: Any, config: PruningConfig, prompt: Sequence[int],
              reference: Sequence[int]) -> list[bool]:
    """Per step: does ``config``'s argmax equal ``reference`` (the unpruned continuation)
    when fed the reference tokens?"""
    engine = LazyEngine(model, resolve_config(model, config))
    logits, hits = engine.prefill(mx.array(prompt)), []
    for token in reference:
        hits.append(int(mx.argmax(logits)) == token)
        logits = engine.decode(token)
    return hits


def references(model: Any, tokenizer: Any, length: int, prompts: int,
               steps: int) -> list[Reference]:
    """``prompts`` prose prompts of ``length`` tokens (37 lines apart in the text), each with
    the unpruned path's greedy continuation of ``steps`` tokens."""
    out = []
    for i in range(prompts):
        prompt = build_prompt(tokenizer, length, offset=37 * i)
        out.append((prompt, greedy_tokens(model, prompt, steps)))
    return out


def agreement_summary(model: Any, config: PruningConfig,
                      refs: Sequence[Reference]) -> dict[str, Any]:
    """Agreement of ``config`` along every reference: steps, agreeing steps, their rate (1.0
    when there are no steps) and its Wilson interval."""
    hits = [h for prompt, ref in refs for h in agreement(model, config, prompt, ref)]
    return {"steps": len(hits), "agree": sum(hits),
            "rate": sum(hits) / len(hits) if hits else 1.0,
            "ci": stats.wilson(sum(hits), len(hits))}
