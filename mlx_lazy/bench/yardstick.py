"""Quantization as a fidelity yardstick: the model with its weights rounded through mlx's
affine quantization, run at float speed.

MLX users run 4-bit weights by default, so the drift 8- and 4-bit weights cause is a
deviation they already accept. :func:`round_weights` copies a model and sends every weight
that ``nn.quantize`` would quantize through ``mx.quantize`` and back (``mx.dequantize``, in
the weight's own dtype): the numerical error of quantized weights without the quantized
matmuls, which are ~20x slower than float32 ones on this CPU.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn

from ..adapter import quantizations
from ..errors import UserInputError

#: Weights per quantization group (mlx-lm's default).
GROUP_SIZE = 64
#: The yardsticks every fidelity table carries: weights through 8 and 4 bits.
BITS = (8, 4)


def quantizable(module: nn.Module, group_size: int = GROUP_SIZE) -> bool:
    """Whether ``nn.quantize`` would quantize ``module``: a layer with ``to_quantized``
    (Linear, Embedding, their switch/MoE forms) whose rows split into whole groups."""
    weight = getattr(module, "weight", None) if hasattr(module, "to_quantized") else None
    return weight is not None and weight.shape[-1] % group_size == 0


def check_unquantized(model: nn.Module) -> None:
    """Refuse a model whose layers are already quantized: rounding its weights would leave
    those layers as they are and measure no drift, so every bar set by a yardstick would be 0.

    Raises:
        UserInputError: naming the layers' bits and what to measure instead.
    """
    found = quantizations(model)
    if found:
        raise UserInputError(
            f"the model is already quantized ({', '.join(found)} layers): the "
            "8- and 4-bit yardsticks round a model's weights and would measure no drift here; "
            "measure the unquantized model it was made from (its calibrated schedule applies "
            "to this copy, matched by the weights' identity)")


def round_weights(model: nn.Module, bits: int, group_size: int = GROUP_SIZE) -> nn.Module:
    """A copy of ``model`` whose quantizable weights (:func:`quantizable`) went through
    ``bits``-bit affine quantization with groups of ``group_size`` and back to their dtype;
    ``model`` itself is unchanged.

    Raises:
        UserInputError: a model already quantized (:func:`check_unquantized`).
        ValueError: ``bits`` or ``group_size`` that mlx's affine mode does not support.
    """
    check_unquantized(model)
    rounded = copy.deepcopy(model)
    for _, module in rounded.named_modules():
        if quantizable(module, group_size):
            w = module.weight
            packed = mx.quantize(w, group_size=group_size, bits=bits)
            module.weight = mx.dequantize(*packed, group_size=group_size, bits=bits).astype(w.dtype)
    mx.eval(rounded.parameters())
    return rounded
