"""What a decode step costs: a roofline, fitted to this CPU and stated for Apple GPUs.

A decode step reads every weight once (each layer's, and the LM head's for the one output
row), reads each layer's cached keys and values, and computes the rows it carries through
each layer: the new token at every layer, plus, with LazyLLM decoding on the pruned state,
the tokens it revives, at each layer above their cut. So per step::

    bytes = weights · bits / 8  +  KV bytes held
    flops = 2 · (layer params · token-layers + head params)  +  4 · heads · head_dim · pairs

On a Mac's GPU the reads and the arithmetic overlap and a step costs the larger of
``bytes / bandwidth`` and ``flops / throughput``: a decode step is bandwidth-bound, so a few
revived rows ride along nearly free until their arithmetic outgrows the reads. On this 2-core
CPU they do not overlap (Qwen2.5-Coder-0.5B at 4K tokens: an unpruned step takes 128 ms, and
each revived token-layer adds about 0.5 ms, its layer's arithmetic), so a step costs the sum,
plus a fixed cost per step (the graph's many small ops).
:data:`MACHINES` holds both kinds; the Apple figures are published peak bandwidth and float32
throughput times :data:`EFFICIENCY`, with no fixed cost: stated assumptions, not measurements
(this project has not run on a Mac yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ..adapter import ModelAdapter, text_args
from .costmodel import head_dims, layer_params

#: Fractions of the published peaks a decode step reaches on an Apple GPU (assumed: MLX's
#: kernels reach ~80% of peak bandwidth on large reads; small-row matmuls far less than
#: peak arithmetic).
EFFICIENCY = {"bandwidth": 0.8, "flops": 0.3}
#: Bits a weight takes in a 4-bit mlx-community checkpoint: 4, plus a float16 scale and bias
#: per group of 64.
Q4_BITS = 4 + 32 / 64


@dataclass(frozen=True)
class Machine:
    """Where a step runs: sustained bytes/s of its reads, FLOP/s of its small matmuls, and
    whether the two overlap (a GPU) or add up (this CPU)."""

    name: str
    bandwidth: float
    flops: float
    overlap: bool
    weight_bits: float  # what its users' weights take (float32 here, 4-bit on a Mac)
    kv_bytes_scale: float = 1.0  # its KV's bytes per float32 KV byte measured here
    overhead_s: float = 0.0  # a step's fixed cost


def _apple(name: str, bandwidth_gbs: float, fp32_tflops: float) -> Machine:
    return Machine(name, bandwidth_gbs * 1e9 * EFFICIENCY["bandwidth"],
                   fp32_tflops * 1e12 * EFFICIENCY["flops"], True, Q4_BITS, 0.5)


#: The machines a decode step is predicted on. ``cpu``: this project's test machine (2-core
#: AMD EPYC, OpenBLAS, float32), its rates and fixed cost fitted on 2026-12-06 by least
#: squares (relative) to the mean steps of ``bench.answer`` at 4K, 128-token answers, of
#: ``full`` and the default pruned path of Qwen2.5-Coder-0.5B, SmolLM2-135M and Gemma 3 270M:
#: within 8% of each (tests/test_decode_cost.py; the fit of 2026-12-03, before the one-row
#: products and the MLP kernels, predicted twice the steps measured now). The Apple GPUs run
#: 4-bit weights with a float16 KV.
MACHINES: Mapping[str, Machine] = {
    "cpu": Machine("this CPU (2 cores, float32)", 44.3e9, 60.0e9, False, 32, overhead_s=0.053),
    "m1": _apple("M1 GPU, 4-bit", 68.25, 2.6),
    "m2-pro": _apple("M2 Pro GPU, 4-bit", 200, 6.8),
    "m3-max": _apple("M3 Max GPU, 4-bit", 400, 16.4),
}


@dataclass(frozen=True)
class ModelShape:
    """The sizes a decode step's cost depends on."""

    num_layers: int
    layer_params: float  # linear weights a token runs through in a layer (the mean layer)
    head_params: int  # the LM head's (tied or not, it is read every step)
    head_dims: float  # query heads x head_dim (the mean layer)

    @classmethod
    def of(cls, model: Any) -> "ModelShape":
        """The shape of an mlx-lm model of a family the engine runs (quantized layers counted
        at their float size)."""
        a = ModelAdapter(model)
        return cls(a.num_layers, layer_params(a), a.vocab_size * text_args(a.text).hidden_size,
                   head_dims(a))


@dataclass(frozen=True)
class StepWork:
    """One decode step's reads and arithmetic (a mean over an answer's steps)."""

    token_layers: float  # rows computed, summed over layers (num_layers without revivals)
    pairs: float  # query-key pairs attended
    kv_bytes: float  # float32 KV held, read once per step


def step_work(stats: Mapping[str, Any], steps: int) -> Optional[StepWork]:
    """The mean step of a generation from its ``GenerationStats.as_dict()`` and its number of
    decode steps: token-layers computed after the prefill (completion's excluded: it is not
    part of a step), attention pairs, KV held at the end. None without steps."""
    if steps < 1:
        return None
    decoded = (sum(stats["tokens_computed_per_layer"]) - sum(stats["prefill_tokens_per_layer"])
               - stats["completed_token_layers"])
    return StepWork(decoded / steps, stats["decode_attention_pairs"] / steps,
                    stats["kv_bytes"])


def step_seconds(shape: ModelShape, work: StepWork, machine: Machine) -> float:
    """The roofline's time of ``work`` on ``machine`` (see the module docstring)."""
    weights = shape.num_layers * shape.layer_params + shape.head_params
    read = weights * machine.weight_bits / 8 + work.kv_bytes * machine.kv_bytes_scale
    flops = (2 * (shape.layer_params * work.token_layers + shape.head_params)
             + 4 * shape.head_dims * work.pairs)
    t_read, t_compute = read / machine.bandwidth, flops / machine.flops
    return machine.overhead_s + (max(t_read, t_compute) if machine.overlap
                                 else t_read + t_compute)
