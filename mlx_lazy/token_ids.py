"""Token ids as the user gives them: a list, tuple or 1-D integer array, checked to be ids
the model has before anything runs on them (MLX does not bounds-check its embedding
lookup)."""

from __future__ import annotations

from typing import Any, List

import mlx.core as mx
import numpy as np

from .errors import UserInputError


def token_ids(tokens: Any) -> List[int]:
    """``tokens`` (a list or tuple of ints, or a 1-D integer array) as a list of ints.

    Raises:
        UserInputError: anything else (text included: encode it first).
    """
    if isinstance(tokens, (mx.array, np.ndarray)):
        integer = (mx.issubdtype(tokens.dtype, mx.integer) if isinstance(tokens, mx.array)
                   else np.issubdtype(tokens.dtype, np.integer))
        if tokens.ndim != 1 or not integer:
            raise UserInputError(
                f"a prompt array must be 1-D of integer token ids, got {tokens.dtype} "
                f"of shape {tuple(tokens.shape)}"
            )
        return [int(t) for t in tokens.tolist()]
    if not isinstance(tokens, (list, tuple)):
        got = ("text: encode it with the tokenizer first" if isinstance(tokens, str)
               else type(tokens).__name__)
        raise UserInputError(
            f"expected token ids (a list of integers or a 1-D integer array), got {got}")
    for t in tokens:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise UserInputError(f"token ids must be integers, got {t!r}")
    return [int(t) for t in tokens]


def check_tokens(tokens: List[int], vocab_size: int) -> None:
    """Raise UserInputError for an empty prompt or ids outside the vocabulary."""
    if not tokens:
        raise UserInputError("the prompt is empty")
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise UserInputError(
            f"token id {bad} is outside the model's vocabulary of {vocab_size} tokens "
            f"(ids 0 to {vocab_size - 1})"
        )
