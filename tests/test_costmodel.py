"""Tests for mlx_lazy.bench.costmodel (synthetic) and mlx_lazy.bench.speed (tiny model, quick)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
import pytest

from mlx_lazy.bench.costmodel import CostModel, PrefillCounts, counts, fit

A, B, C = 2.5e-6, 4.0e-9, 0.12  # seconds per token-layer, per pair, fixed
LAYERS = 30


@dataclass
class FakeStats:
    """The two GenerationStats fields the cost model reads."""

    prefill_tokens_per_layer: list[int] = field(default_factory=list)
    prefill_attention_pairs: int = 0


def _unpruned(n: int) -> FakeStats:
    return FakeStats([n] * LAYERS, LAYERS * n * (n + 1) // 2)


def _time(s: FakeStats) -> float:
    return A * sum(s.prefill_tokens_per_layer) + B * s.prefill_attention_pairs + C


def test_fit_recovers_exact_coefficients() -> None:
    runs = [_unpruned(n) for n in (1024, 2048, 4096)]
    model = fit(runs, [_time(s) for s in runs])
    # Noise-free data: least squares in float64 leaves rounding only (the intercept, a small
    # term of second-scale sums, loses a few more digits to cancellation).
    assert model.a == pytest.approx(A, rel=1e-6)
    assert model.b == pytest.approx(B, rel=1e-6)
    assert model.c == pytest.approx(C, rel=1e-5)
    assert model.n_samples == 3
    assert model.max_relative_residual < 1e-9


def test_fit_with_noise_and_repeats_predicts_pruned_run() -> None:
    rng = np.random.default_rng(0)
    runs = [_unpruned(n) for n in (1024, 2048, 3072, 4096) for _ in range(3)]
    times = [_time(s) * (1 + 0.01 * rng.standard_normal()) for s in runs]
    model = CostModel.fit(runs, times)
    # 1% noise on 12 runs: the coefficients within 10%, predictions within 3x the noise.
    assert model.a == pytest.approx(A, rel=0.1)
    assert model.b == pytest.approx(B, rel=0.1)
    assert 0 < model.rms_relative_residual < 0.03
    # A pruned run: keep 60/40/25/15 % after layers 6/12/18/24 of a 4K prompt.
    n, per_layer, pairs = 4096, [], 0
    cuts = {6: 0.6, 12: 0.4, 18: 0.25, 24: 0.15}
    frac = 1.0
    for layer in range(LAYERS):
        k = int(n * frac)
        frac = cuts.get(layer, frac)
        per_layer.append(k)
        pairs += k * (k + 1) // 2
    pruned = FakeStats(per_layer, pairs)
    assert model.predict(pruned) == pytest.approx(_time(pruned), rel=0.03)
    assert abs(model.relative_error(pruned, _time(pruned))) < 0.03


def test_predict_accepts_stats_dict_counts_and_tuple() -> None:
    model = CostModel(a=A, b=B, c=C)
    s = _unpruned(512)
    expected = _time(s)
    as_dict = {"prefill_tokens_per_layer": s.prefill_tokens_per_layer,
               "prefill_attention_pairs": s.prefill_attention_pairs, "method": "full"}
    c = counts(s)
    assert c == PrefillCounts(512 * LAYERS, s.prefill_attention_pairs)
    for value in (s, as_dict, c, (c.token_layers, c.attention_pairs)):
        assert model.predict(value) == pytest.approx(expected)
    with pytest.raises(TypeError):
        model.predict(object())


def test_as_dict_round_trip_is_json() -> None:
    runs = [_unpruned(n) for n in (256, 512, 1024)]
    model = fit(runs, [_time(s) for s in runs])
    d = json.loads(json.dumps(model.as_dict()))
    assert set(d) >= {"a", "b", "c", "n_samples"}
    assert CostModel.from_dict(d) == model


def test_fit_rejects_underdetermined_and_bad_input() -> None:
    runs = [_unpruned(n) for n in (1024, 2048)] * 3
    with pytest.raises(ValueError, match="3 distinct"):
        fit(runs, [_time(s) for s in runs])
    runs = [_unpruned(n) for n in (1024, 2048, 4096)]
    with pytest.raises(ValueError, match="one time per run"):
        fit(runs, [1.0, 2.0])
    with pytest.raises(ValueError, match="positive"):
        fit(runs, [1.0, 0.0, 2.0])


def test_nonnegative_fit_never_returns_negative_costs() -> None:
    # Pure quadratic data with a dip at one length: unconstrained least squares goes negative.
    runs = [_unpruned(n) for n in (128, 256, 512)]
    times = [1.0, 0.9, 7.0]
    free = fit(runs, times, nonnegative=False)
    assert min(free.a, free.b, free.c) < 0
    model = fit(runs, times)
    assert min(model.a, model.b, model.c) >= 0
    assert model.predict(_unpruned(64)) > 0


@pytest.mark.slow
def test_speed_benchmark_quick_on_tiny_model(tiny_model_path, tmp_path, capsys) -> None:
    """``python -m mlx_lazy.bench.speed --quick`` end to end: every method runs, tables render."""
    from mlx_lazy.bench import speed

    out = tmp_path / "speed.json"
    result = speed.main(["--quick", "--model", str(tiny_model_path), "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["info"]["lengths"] == [48, 64, 96] and saved["info"]["max_tokens"] == 4
    assert saved["summary"]["cost_model"] is not None
    methods = saved["summary"]["methods"]
    assert set(methods) | set(saved["skipped"]) == {"mlx-lm", "full", *speed.DEFAULT_SCHEDULES}
    assert {"mlx-lm", "full", "speed"} <= set(methods)
    for name, row in methods.items():
        assert row["ttft_s"] > 0 and row["tpot_s"] > 0 and row["ttft_cpu_s"] > 0, name
        assert row["kv_bytes"] == sum(row["kv_bytes_per_layer"]) > 0, name
    # Every method generates exactly max_tokens tokens (EOS disabled).
    assert all(r["generation_tokens"] == 4 for r in saved["runs"])
    # Unpruned KV has mlx-lm's bytes per position. When the last token is handed out (and
    # the stats read), mlx-lm's generate_step has run it already (96 + 4 positions); ours
    # has on a GPU, and runs it after on the CPU (96 + 3 then).
    ours = 96 + (3 if mx.default_device() == mx.cpu else 4)
    assert methods["full"]["kv_bytes"] * 100 == methods["mlx-lm"]["kv_bytes"] * ours
    # SPEED keeps only anchor + last prompt token + decode tokens above its cutoff.
    assert methods["speed"]["kv_bytes"] < methods["full"]["kv_bytes"]
    for name, row in methods.items():
        if name not in ("mlx-lm", "full"):
            assert row["predicted_ttft_s"] > 0 and len(row["prediction_errors"]) == 1
    table = capsys.readouterr().out
    assert "| mlx-lm |" in table and "| full |" in table and "Cost model" in table
    assert result["summary"] == saved["summary"]
    # --report re-renders a saved result without a model.
    speed.main(["--report", str(out)])
    assert "| speed |" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--lengths", "64"], "--lengths needs >= 3 distinct"),  # once a traceback
    (["--lengths", "48,64,0"], "--lengths must be positive"),  # once mlx-lm's traceback
    (["--lengths", "48,64,99999"], "exceed the model's context"),  # once accepted
    (["--max-tokens", "0"], "--max-tokens must be >= 2"),
    (["--repeats", "0"], "--repeats must be at least 1"),  # once empty tables, exit 0
    (["--decode-interleaved", "-3"], "--decode-interleaved takes"),  # once a StatisticsError
    # its steps count, not --max-tokens (once run past the 4,096-token context)
    (["--lengths", "48,64,4090", "--decode-interleaved", "50"], "--decode-interleaved 51"),
    (["--schedules", "bogus"], "--schedules"),  # once exit status 1
    (["--schedules", ""], "--schedules names no method"),  # once the defaults, in silence
    (["--schedules", "lazy,lazy"], "--schedules names lazy twice"),
    (["--out", "/tmp"], "--out /tmp is a folder"),  # once a traceback after the runs
    (["--report", "/nonexistent.json"], "--report /nonexistent.json"),
])
def test_speed_benchmark_bad_options_are_one_error_line(tiny_model_path, tmp_path, capsys,
                                                        argv, message) -> None:
    from mlx_lazy.bench import speed

    with pytest.raises(SystemExit) as e:
        speed.main(["--quick", "--model", str(tiny_model_path), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err


def test_decode_interleaved_skips_a_schedule_the_model_cannot_run(tiny_model_path, capsys):
    """As the generation benchmark does (a traceback once), naming it."""
    from mlx_lazy.bench import speed

    result = speed.main(["--quick", "--model", str(tiny_model_path), "--lengths", "48,64,96",
                         "--decode-interleaved", "2", "--schedules", "lazy:layers=99"])
    assert "skipped lazy:layers=99: pruning layers" in capsys.readouterr().err
    assert set(result["decode_interleaved"]["methods"]) == {"mlx-lm", "full"}


def test_speed_report_of_another_json_is_one_error(tmp_path, capsys) -> None:
    from mlx_lazy.bench import speed

    (tmp_path / "other.json").write_text("[1, 2]")
    with pytest.raises(SystemExit) as e:
        speed.main(["--report", str(tmp_path / "other.json")])
    assert e.value.code == 2 and "is not a bench.speed result" in capsys.readouterr().err


@pytest.mark.parametrize("layers, keep", [((0,), (0.3,)), ((1, 2), (0.5, 0.2)), ((), ())])
def test_predicted_counts_equal_the_engines(tiny_model, layers, keep):
    import numpy as np

    from mlx_lazy import LazyEngine, PruningConfig, resolve_config
    from mlx_lazy.bench.costmodel import counts, predicted_counts

    model, _ = tiny_model("llama")
    n = 700  # several query blocks of 256
    config = PruningConfig("lazy", prune_layers=layers, keep=keep) if layers else PruningConfig()
    engine = LazyEngine(model, resolve_config(model, config))
    prompt = np.random.default_rng(0).integers(0, model.args.vocab_size, n)
    mx.eval(engine.prefill(mx.array(prompt.astype(np.int32))))
    assert predicted_counts(engine.schedule, n) == counts(engine.stats)


def test_prior_scales_with_layer_size(tiny_model):
    from mlx_lazy.bench.costmodel import prior

    model, _ = tiny_model("llama")
    small = prior(model)
    assert small.a > 0 and small.b > 0 and small.c == 0
    # The SmolLM2 reference fit scaled by the layer's linear parameters and heads x head_dim.
    a = model.args
    head_dim = a.head_dim
    params = (a.hidden_size * head_dim * (2 * a.num_attention_heads + 2 * a.num_key_value_heads)
              + 3 * a.hidden_size * a.intermediate_size)
    assert small.a == pytest.approx(94e-6 * params / 3_538_944)
    assert small.b == pytest.approx(102e-9 * a.num_attention_heads * head_dim / 576)


@pytest.mark.parametrize("kind", ["gpt_oss", "mistral3", "granite", "bailing_moe", "openelm"])
def test_prior_reads_heads_where_the_family_names_them(tiny_model, kind):
    """gpt-oss names its heads and scale otherwise (``num_attention_heads``, ``sm_scale``);
    a ``mistral3`` checkpoint's layers sit in its text model; Granite's scale is no head
    size (a multiplier of 0.1 here: 100 "dims" read from it); Ling's attention is
    ``block.attention``; OpenELM's heads differ by layer (2, 4, 4, 6: 4 on average) and its
    hidden size is ``model_dim``."""
    from mlx_lazy.bench.costmodel import prior
    from mlx_lazy.bench.decode_cost import ModelShape

    cost = prior(tiny_model(kind)[0])
    assert cost.a > 0 and cost.b == pytest.approx(102e-9 * 4 * 16 / 576)
    shape = ModelShape.of(tiny_model(kind)[0])
    assert (shape.head_dims, shape.head_params) == (4 * 16, 384 * 64)


def test_prior_and_shape_read_youtu_llms_config(tiny_model):
    """Youtu-LLM's settings are at ``model.config`` (no ``args``): the prior and the decode
    cost's shape read them there; its latent heads' query-key width is 40 (32 + 8 RoPE)."""
    from mlx_lazy.bench.costmodel import prior
    from mlx_lazy.bench.decode_cost import ModelShape

    model = tiny_model("youtu_llm")[0]
    assert prior(model).b == pytest.approx(102e-9 * 4 * 40 / 576)
    assert ModelShape.of(model).head_dims == 4 * 40


def test_a_layers_weights_count_the_experts_a_token_takes_and_every_layer(tiny_model):
    """The prior scales by the weights a token runs through: gpt-oss's experts (2 of 4 per
    token: their weights were not counted at all, so its layers looked all attention) and
    Gemma 4's layers, which differ (wider global heads, E2B's wider upper MLPs: only layer 0
    was read)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mlx_lazy.adapter import ModelAdapter
    from mlx_lazy.bench.costmodel import head_dims, layer_params

    model, _ = tiny_model("gpt_oss")
    a = ModelAdapter(model)
    experts = sum(p.size for name, p in tree_flatten(a.layers[0].parameters())
                  if "experts" in name and name.endswith("weight"))
    dense = sum(m.weight.size for _, m in a.layers[0].named_modules()
                if isinstance(m, nn.Linear))
    assert experts > dense and layer_params(a) == dense + experts * 2 / 4
    # GLM-4.5: its config names the experts otherwise (n_routed_experts); the shared expert
    # takes every token, and its dense first layer has no experts
    model, _ = tiny_model("glm4_moe")
    a = ModelAdapter(model)
    routed = [sum(p.size for name, p in tree_flatten(layer.parameters())
                  if "switch_mlp" in name and name.endswith("weight")) for layer in a.layers]
    dense = [sum(m.weight.size for _, m in layer.named_modules() if isinstance(m, nn.Linear))
             for layer in a.layers]
    assert routed[0] == 0 and min(routed[1:]) > 0 and len(set(dense)) == 2
    assert layer_params(a) == sum(d + r * 2 / 4 for d, r in zip(dense, routed)) / 4
    model, _ = tiny_model("gemma4_text-e2b")
    a = ModelAdapter(model)
    sizes = [sum(m.weight.size for _, m in layer.named_modules() if isinstance(m, nn.Linear))
             for layer in a.layers]
    assert len(set(sizes)) == 4 and layer_params(a) == sum(sizes) / 4
    assert head_dims(a) == 4 * (16 + 32) / 2  # sliding layers' 16, global ones' 32
