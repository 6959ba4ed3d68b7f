"""Answer scorers: exact match, substring match (all-of / any-of) and SQuAD-style token F1.

Every scorer takes the model's prediction and the reference answers and returns a score in
[0, 1]. Normalization follows the SQuAD evaluation script: lowercase, strip punctuation,
drop the articles "a", "an", "the", collapse whitespace.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
MATCH_MODES: tuple[str, ...] = ("exact", "all", "any", "f1")

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalization: lowercase, remove punctuation and articles, collapse whitespace."""
    text = text.lower().translate(_PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, references: Sequence[str]) -> float:
    """1.0 when the normalized prediction equals any normalized reference."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(r) for r in references))


def substring_match(prediction: str, references: Sequence[str], mode: str = "all") -> float:
    """Whether normalized references occur in the normalized prediction.

    ``mode="all"``: every reference must occur (score 1.0 or 0.0);
    ``mode="any"``: at least one must occur.
    Matching is on whole tokens, so reference "123" does not match prediction "91234".
    """
    if mode not in ("all", "any"):
        raise ValueError(f"substring mode must be 'all' or 'any', got {mode!r}")
    pred = f" {normalize_answer(prediction)} "
    hits = [f" {normalize_answer(r)} " in pred for r in references]
    return float(all(hits) if mode == "all" else any(hits))


def token_f1(prediction: str, references: Sequence[str]) -> float:
    """Best SQuAD token F1 of the prediction against any reference."""
    pred_tokens = normalize_answer(prediction).split()
    best = 0.0
    for ref in references:
        ref_tokens = normalize_answer(ref).split()
        if not pred_tokens or not ref_tokens:
            best = max(best, float(pred_tokens == ref_tokens))
            continue
        common = Counter(pred_tokens) & Counter(ref_tokens)
        same = sum(common.values())
        if same == 0:
            continue
        precision = same / len(pred_tokens)
        recall = same / len(ref_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def first_line(text: str) -> str:
    """The first non-empty line of a generation (what exact match and F1 score)."""
    for line in text.strip().splitlines():
        if line.strip():
            return line.strip()
    return ""


def score(prediction: str, references: Sequence[str], mode: str) -> float:
    """Score a generation with the named match mode (one of :data:`MATCH_MODES`).

    Substring modes look at the whole generation; ``exact`` and ``f1`` at its first line
    (models often continue after the answer).
    """
    if mode == "exact":
        return exact_match(first_line(prediction), references)
    if mode in ("all", "any"):
        return substring_match(prediction, references, mode)
    if mode == "f1":
        return token_f1(first_line(prediction), references)
    raise ValueError(f"unknown match mode {mode!r}; choose one of {MATCH_MODES}")


def score_all(prediction: str, references: Sequence[str]) -> dict[str, float]:
    """Every metric at once (reported side by side in results.json)."""
    return {mode: score(prediction, references, mode) for mode in MATCH_MODES}
