"""The decode-step roofline: the work a step's stats count, and the two ways it costs."""

import pytest

from mlx_lazy.bench.decode_cost import (MACHINES, Machine, ModelShape, StepWork, step_seconds,
                                        step_work)

SHAPE = ModelShape(num_layers=24, layer_params=15_000_000, head_params=136_000_000,
                   head_dims=896)
GPU = Machine("gpu", bandwidth=100e9, flops=1e12, overlap=True, weight_bits=4)
CPU = Machine("cpu", bandwidth=10e9, flops=50e9, overlap=False, weight_bits=32)


def test_a_steps_work_is_what_the_stats_count_after_the_prefill():
    stats = {"tokens_computed_per_layer": [110, 110, 60, 60], "prefill_tokens_per_layer":
             [100, 100, 40, 40], "completed_token_layers": 12, "decode_attention_pairs": 2000,
             "kv_bytes": 4096}
    work = step_work(stats, steps=4)
    # 60 token-layers after the prefill, 12 of them completion's: 48 over 4 steps
    assert work == StepWork(token_layers=12.0, pairs=500.0, kv_bytes=4096)
    assert step_work(stats, steps=0) is None


def test_on_a_gpu_revived_rows_ride_along_on_the_cpu_they_add_up():
    plain = StepWork(token_layers=SHAPE.num_layers, pairs=4096, kv_bytes=50e6)
    revived = StepWork(token_layers=SHAPE.num_layers + 60, pairs=4096, kv_bytes=50e6)
    # 4-bit weights: 0.25 GB read in 2.5 ms; 60 more token-layers are 1.8 GFLOP, 1.8 ms
    assert step_seconds(SHAPE, revived, GPU) == pytest.approx(step_seconds(SHAPE, plain, GPU))
    extra = 2 * SHAPE.layer_params * 60 / CPU.flops
    assert (step_seconds(SHAPE, revived, CPU) - step_seconds(SHAPE, plain, CPU)
            == pytest.approx(extra))
    # past the reads, the GPU's arithmetic shows: 600 more token-layers are 18 ms
    many = StepWork(token_layers=SHAPE.num_layers + 600, pairs=4096, kv_bytes=50e6)
    assert step_seconds(SHAPE, many, GPU) > 5 * step_seconds(SHAPE, plain, GPU)


#: Shapes as ModelShape.of gives them.
SHAPES = {"qwen": ModelShape(24, 14_909_440, 151_936 * 896, 14 * 64),
          "smollm2": ModelShape(30, 3_538_944, 49_152 * 576, 9 * 64),
          "gemma3": ModelShape(18, 5_570_560, 262_144 * 640, 4 * 256)}
#: bench.answer at 4K, 128-token answers, 2026-12-06: each path's mean step (median of 3) and
#: the mean work its stats counted (full; the shipped lazy).
MEASURED = [
    ("qwen", StepWork(24.0, 99_840, 103_784_448), 0.1279),
    ("qwen", StepWork(52.0, 114_800, 72_187_904), 0.1376),
    ("smollm2", StepWork(30.0, 124_800, 194_595_840), 0.0815),
    ("smollm2", StepWork(70.3, 114_299, 108_080_640), 0.0835),
    ("gemma3", StepWork(18.0, 74_880, 155_676_672), 0.0920),
    ("gemma3", StepWork(38.6, 57_627, 83_005_440), 0.0884),
]


@pytest.mark.parametrize("model, work, measured", MEASURED)
def test_the_cpu_row_reproduces_the_steps_it_was_fitted_on(model, work, measured):
    """Within 10% (the fit's worst is 8%: Gemma 3's pruned step)."""
    predicted = step_seconds(SHAPES[model], work, MACHINES["cpu"])
    assert abs(predicted / measured - 1) < 0.1, predicted


def test_the_shape_of_a_model_counts_its_linear_weights(tiny_model):
    model, _ = tiny_model("llama")
    shape = ModelShape.of(model)
    layer = model.layers[0]
    linears = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
               layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
               layer.mlp.down_proj]
    assert shape.layer_params == sum(m.weight.size for m in linears)
    assert shape.head_params == model.args.vocab_size * model.args.hidden_size
    assert shape.num_layers == len(model.layers)
