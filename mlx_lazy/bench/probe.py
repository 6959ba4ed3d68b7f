"""Where a model ranks a needle: ``python -m mlx_lazy.bench.probe``.

At a cut the scorer ranks the context and the top ``keep`` fraction goes on; a retrieval
answer needs the needle's value. For each layer this measures the smallest keep fraction a cut
after it would need, at the prompt, to keep every token of the value: the share of the prompt
scoring at least as high as the value's lowest-scoring token (the tokens a cut always keeps
counted in, as the engine counts them), from that layer's queries and keys in an unpruned
prefill. A few dozen retrieval prompts take a minute or two on this CPU, where one retrieval
cell of a calibration takes ten.

::

    python -m mlx_lazy.bench.probe --model qwen2.5-coder-0.5b --samples 24 --length 1024

It also gives the fraction that keeps *any* value token. The two bound the risk: a cut keeping
at least the every-token fraction kept every answer whatever the decode did, revivals off
included; one keeping less than the any-token fraction dropped the whole value and lost the
answer at its first token; in between, the answer's revivals decide (SmolLM2 after layer 8
keeping 50%: every value token needs 74% in the median prompt, any 31%, and its answers stand).
Drift is measured apart (docs/calibration.md).
"""

from __future__ import annotations

import json
import sys
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from .. import _blas  # noqa: F401  (OpenBLAS before mlx.core)
from .. import load
from .._args import OneLineParser, path_arg
from ..adapter import sliding_windows
from ..api import context_length
from ..attention import BlockSparse, Chunks, Window
from ..engine import LazyEngine
from ..errors import UserInputError
from ..folders import check_destination, write_text_atomic
from ..scorers import ScoreContext, Scorer, parse_scorer, scorer_spec
from ..selection import forced_mask
from .tasks import TASKS, Sample, build_samples

#: The quantiles over prompts the report gives per layer.
QUANTILES = (0.5, 0.9, 1.0)
#: The keep fractions the report names the shallowest cut it clears for.
KEEPS = (0.5, 0.4, 0.3, 0.2)


def value_positions(tokenizer: Any, sample: Sample) -> np.ndarray:
    """Positions of the prompt tokens that spell the sample's answer values (each value's
    first occurrence in the prompt, the tokens decoded one by one).

    Raises:
        UserInputError: a value that does not appear in the prompt (a task whose answer is
            not copied from it).
    """
    pieces = [tokenizer.decode([t]) for t in sample.tokens]
    text = "".join(pieces)
    ends = np.cumsum([len(p) for p in pieces])
    starts = ends - np.array([len(p) for p in pieces])
    found: List[np.ndarray] = []
    for value in sample.references:
        at = text.find(value)
        if at < 0:
            raise UserInputError(f"{sample.task} sample {sample.index}: its value {value!r} "
                                 "is not in the prompt")
        found.append(np.flatnonzero((starts < at + len(value)) & (ends > at)))
    return np.unique(np.concatenate(found))


def needed_keep(scores: np.ndarray, value: np.ndarray, forced: np.ndarray,
                every: bool = True) -> float:
    """The smallest keep fraction whose selection by ``scores`` (n,) keeps every position in
    ``value`` (with ``every`` False: at least one), in the engine's terms
    (:func:`mlx_lazy.selection.kept_count`: a share of all ``n`` prompt tokens, the ``forced``
    ones, always kept, among them): the share scoring at least as high as the lowest-scoring
    (highest-scoring) ``value`` position, ties kept."""
    ranked = np.where(forced, np.inf, scores)
    threshold = scores[value].min() if every else scores[value].max()
    return float((ranked >= threshold).sum()) / len(scores)


def layer_scores(engine: LazyEngine, tokens: Sequence[int], scorer: Scorer
                 ) -> Dict[int, np.ndarray]:
    """By layer, the (n,) scores ``scorer`` gives the prompt ``tokens`` at every layer with
    attention a cut may follow (all but the last, no recurrent one), from an unpruned
    prefill on ``engine`` (a ``full`` one): what a cut after that layer would rank the
    prompt by."""
    adapter, window, n = engine.adapter, scorer.n_queries, len(tokens)
    scores: Dict[int, np.ndarray] = {}
    qkv = adapter.qkv
    candidates = np.ones(n, bool)  # every prompt token, at every layer
    # the keys of the layers that later layers read (Gemma 4's E2B/E4B); no others are held
    read = {adapter.kv_layer(layer) for layer in range(adapter.num_layers)
            if adapter.kv_layer(layer) != layer}
    held = {}

    def scored(layer: int, h: mx.array, positions: np.ndarray) -> tuple:
        q, k, v, gate = qkv(layer, h, positions)
        if layer in read:
            held[layer] = k
        if layer < adapter.num_layers - 1:  # scored at once
            keys = held[adapter.kv_layer(layer)] if k is None else k
            ctx = ScoreContext(layer, q[:, :, -window:], positions[-window:], keys, positions,
                               candidates, None, adapter.scale,
                               softcap=adapter.softcap(layer))
            scores[layer] = np.array(scorer.score(ctx))
        return q, k, v, gate

    adapter.qkv = scored  # this engine's instance only
    try:
        mx.eval(engine.prefill(list(tokens)))
    finally:
        del adapter.qkv
    return scores


def probe(model: Any, tokenizer: Any, samples: Sequence[Sample], scorer: Scorer) -> np.ndarray:
    """(2, samples, layers - 1) keep fractions (:func:`needed_keep`) of each sample at every
    layer a cut may follow, to keep every value token ([0]) and to keep any ([1]), from one
    unpruned prefill per sample (NaN after a recurrent layer, which no cut may follow).

    Raises:
        UserInputError: a sample whose value is missing from its prompt or among the tokens a
            cut always keeps (:func:`mlx_lazy.selection.forced_mask`: nothing to measure).
    """
    engine = LazyEngine(model)
    need = np.zeros((2, len(samples), engine.adapter.num_layers - 1))
    for i, sample in enumerate(samples):
        value, n = value_positions(tokenizer, sample), sample.n_tokens
        positions = np.arange(n)
        forced = forced_mask(positions, n, engine.schedule.anchors, scorer.always_kept(n))
        if forced[value].any():
            raise UserInputError(f"{sample.task} sample {sample.index}: the value is among the "
                                 "tokens a cut always keeps (the scorer's window)")
        need[:, i] = np.nan  # a recurrent layer's: no cut may follow it
        for layer, scores in layer_scores(engine, sample.tokens, scorer).items():
            need[:, i, layer] = [needed_keep(scores, value, forced, every)
                                 for every in (True, False)]
    return need


def summary(need: np.ndarray, windows: Sequence[Optional[Window]]) -> List[Dict[str, Any]]:
    """Per layer: the quantiles over prompts (:data:`QUANTILES`) of :func:`probe`'s fractions
    to keep every value token (``q50``...) and any (``any_q50``...), None after a recurrent
    layer (no cut may follow it), and its sliding window (None: global; a cut may follow
    only a global layer on a model that has both)."""
    def quantile(values: np.ndarray, q: float) -> Optional[float]:
        return None if np.isnan(values).any() else float(np.quantile(values, q))

    return [{"layer": layer, "sliding_window": (str(windows[layer])  # JSON: "chunks of 24"
                                                if isinstance(windows[layer],
                                                              (Chunks, BlockSparse))
                                                else windows[layer]),
             **{f"{prefix}q{round(q * 100)}": quantile(need[k, :, layer], q)
                for k, prefix in enumerate(("", "any_")) for q in QUANTILES}}
            for layer in range(need.shape[2])]


def cleared(rows: Sequence[Dict[str, Any]], keep: float) -> Optional[int]:
    """The shallowest layer a cut keeping ``keep`` may follow (a global one where the model
    has sliding windows) whose largest fraction over the prompts is at most ``keep``: a cut
    there kept the value in every prompt at the prompt's selection. None if there is none."""
    allowed = [r for r in rows if r["sliding_window"] is None and r["q100"] is not None]
    return next((r["layer"] for r in allowed if r["q100"] <= keep), None)


def render(rows: Sequence[Dict[str, Any]], samples: int) -> str:
    """The report: one line per layer, then the shallowest cut it clears per keep fraction
    (:data:`KEEPS`) as ``calibrate --cuts`` takes it."""
    out = [f"keep fraction a cut after each layer needs to keep every value token, and any "
           f"({samples} prompts): median, 90th percentile, largest"]
    for row in rows:
        if row["q100"] is None:
            out.append(f"  layer {row['layer']:>3}: recurrent, no cut may follow it")
            continue
        local = f"  (sliding window {row['sliding_window']})" if row["sliding_window"] else ""
        out.append(f"  layer {row['layer']:>3}: every {row['q50']:.2f} {row['q90']:.2f} "
                   f"{row['q100']:.2f}  any {row['any_q50']:.2f} {row['any_q90']:.2f} "
                   f"{row['any_q100']:.2f}{local}")
    out.append("the shallowest cut whose selection kept the value in every prompt:")
    depth = len(rows) + 1  # a cut may follow every layer but the last
    for keep in KEEPS:
        layer = cleared(rows, keep)
        where = "none" if layer is None else (
            f"after layer {layer} (calibrate --cuts {(layer + 1) / depth:.4f}/{keep:g})")
        out.append(f"  keep {keep:.0%}: {where}")
    return "\n".join(out)


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="python -m mlx_lazy.bench.probe",
                      description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--model", default="smollm2-135m", help="model folder or name")
    p.add_argument("--task", default="niah_single",
                   help=f"a retrieval task whose answer is in the prompt ({', '.join(TASKS)})")
    p.add_argument("--length", type=int, default=1024, help="prompt tokens per sample")
    p.add_argument("--samples", type=int, default=24, help="prompts")
    p.add_argument("--scorer", default="window:size=32:pool=8", help="the scorer's spec")
    p.add_argument("--seed", type=int, default=0, help="the samples' seed")
    p.add_argument("--out", type=path_arg, help="also write the per-prompt fractions as JSON")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        for flag, value in (("--length", args.length), ("--samples", args.samples)):
            if value < 1:
                raise UserInputError(f"{flag} must be >= 1, got {value}")
        scorer = parse_scorer(args.scorer)
        if args.task not in TASKS:
            raise UserInputError(f"--task {args.task!r} is not one of {', '.join(TASKS)}")
        if args.out is not None:
            check_destination(args.out, "--out")
        model, tokenizer = load(args.model)
        context = context_length(model, tokenizer)
        if context is not None and args.length > context:
            raise UserInputError(f"--length {args.length} is beyond the model's context of "
                                 f"{context} tokens")
        try:
            samples = build_samples(tokenizer, args.task, args.length, args.samples, args.seed)
        except ValueError as e:  # a length too short for the task
            raise UserInputError(str(e)) from None
        need = probe(model, tokenizer, samples, scorer)
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = summary(need, sliding_windows(model))
    print(render(rows, args.samples))
    if args.out is not None:
        write_text_atomic(args.out, json.dumps(
            {"model": args.model, "task": args.task, "length": args.length, "seed": args.seed,
             "scorer": scorer_spec(scorer), "layers": rows,
             "per_prompt": {kind: np.where(np.isnan(need[k]), None, need[k]).tolist()
                            for k, kind in enumerate(("every", "any"))}},
            indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
