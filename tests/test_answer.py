"""The answer-latency benchmark: arrivals of every token, paired ratios, bad options."""

import json

import pytest

from mlx_lazy.bench import answer
from mlx_lazy.bench.common import RunRecord
from mlx_lazy.bench.decode_cost import MACHINES, ModelShape


def record(path, repeat, arrivals, syncs=0, revived_layers=0):
    """A run on a 2-layer model; its decode steps computed ``revived_layers`` token-layers
    beyond the new token's."""
    steps = len(arrivals) - 1
    stats = None if path == "mlx-lm" else {
        "host_syncs": syncs, "revivals": 0, "completed_token_layers": 0,
        "prompt_token_layers_computed_pct": 50.0, "prefill_tokens_per_layer": [10, 5],
        "tokens_computed_per_layer": [10 + steps, 5 + steps + revived_layers],
        "decode_attention_pairs": 40 * steps, "kv_bytes": 2**20}
    return RunRecord(method=path, family=path, prompt_tokens=10, generation_tokens=len(arrivals),
                     ttft_s=arrivals[0], tpot_s=None, total_s=arrivals[-1], peak_memory_bytes=1,
                     kv_bytes=2**20, aux_bytes=0, arrivals_s=list(arrivals), stats=stats,
                     repeat=repeat, length=100)


def test_summary_pairs_by_repeat_and_finds_the_worst_token():
    full = [record("full", r, [10.0, 11.0, 12.0, 13.0]) for r in range(3)]
    # Sooner at the first token, later at the third: not never-slower.
    late = [record("lazy", r, [5.0, 6.0, 13.0, 13.5], syncs=6, revived_layers=3)
            for r in range(3)]
    shape = ModelShape(num_layers=2, layer_params=10**6, head_params=10**6, head_dims=64)
    rows = {r["path"]: r for r in answer.summarize(full + late, 4, shape)}
    lazy = rows["lazy"]
    assert lazy["token_1_x_full"] == pytest.approx(2.0)
    assert lazy["token_4_s"] == pytest.approx(13.5)
    assert lazy["worst_vs_full"] == pytest.approx(13.0 / 12.0)
    assert lazy["never_slower"] is False
    assert lazy["host_syncs_per_step"] == pytest.approx(2.0)
    assert lazy["tpot_s"] == pytest.approx(3.75)  # the second half of the gaps 1, 7, 0.5
    assert rows["full"]["never_slower"] is True
    assert lazy["mean_step_s"] == pytest.approx(8.5 / 3)
    # one revived token-layer per step beyond full's two: the CPU adds its arithmetic
    assert lazy["token_layers_per_step"] == pytest.approx(3.0)
    assert rows["full"]["token_layers_per_step"] == pytest.approx(2.0)
    cpu, full_cpu = lazy["predicted_step_s"]["cpu"], rows["full"]["predicted_step_s"]["cpu"]
    assert cpu - full_cpu == pytest.approx(2 * 10**6 / MACHINES["cpu"].flops)
    text = answer.render({"summary": list(rows.values()), "answer_tokens": 4})
    assert "| 100 | lazy |" in text and "predicted M2 Pro GPU, 4-bit" in text


@pytest.mark.slow
def test_end_to_end_on_a_tiny_model(tiny_model_path, tmp_path):
    out = tmp_path / "answer.json"
    result = answer.main(["--model", str(tiny_model_path), "--lengths", "96",
                          "--answer-tokens", "5", "--repeats", "2",
                          "--paths", "mlx-lm;lazy:complete=none;lazy", "--out", str(out)])
    runs = json.loads(out.read_text())["runs"]
    assert {r["method"] for r in runs} == {"full", "mlx-lm", "lazy:complete=none", "lazy"}
    assert all(len(r["arrivals_s"]) == 5 and r["prompt_tokens"] == 96 for r in runs)
    # rotated: the first path differs between the two repeats
    assert len({r["method"] for r in runs if r["order"] == 0}) == 2
    rows = {(r["path"]): r for r in result["summary"]}
    assert rows["lazy:complete=none"]["prompt_token_layers_pct"] < 100
    assert rows["full"]["prompt_token_layers_pct"] == 100


@pytest.mark.parametrize("argv, message", [
    (["--answer-tokens", "0"], "--answer-tokens must be at least 1"),
    (["--paths", "lazy:bogus=1"], "--paths"),
    (["--lengths", "999999"], "exceed the model's context"),
    (["--lengths", "x"], "--lengths"),
    (["--lengths", "256,256"], "--lengths names a length twice"),  # once full 0.81x of itself
    (["--paths", ""], "--paths names no method"),  # once only full, in silence
    (["--paths", "lazy;lazy"], "--paths names lazy twice"),  # once one run, in silence
    (["--paths", "lazy:layers=99:keep=0.5"], "--paths lazy:layers=99:keep=0.5:"),  # once after
    (["--out", "/tmp"], "--out /tmp is a folder"),  # once a traceback after the runs
    (["--out", "/nonexistent/dir/a.json"], "folder /nonexistent/dir does not exist"),
])
def test_bad_options_are_one_error_line(tiny_model_path, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        answer.main(["--model", str(tiny_model_path), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_a_hybrid_model_runs_the_paths_it_can(tiny_model_dir, tmp_path):
    """On Qwen3.5's hybrid layout the default paths are those without revival or completion
    (the others are refused there), and mlx-lm's row counts its recurrent state as no KV."""
    out = tmp_path / "answer.json"
    answer.main(["--model", str(tiny_model_dir("qwen3_5")), "--lengths", "64",
                 "--answer-tokens", "2", "--repeats", "1", "--out", str(out)])
    runs = {r["method"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == set(answer.HYBRID_PATHS)
    held = [[b > 0 for b in runs[p]["kv_bytes_per_layer"]] for p in ("mlx-lm", "full")]
    assert held[0] == held[1] == [layer in (3, 7) for layer in range(8)]


def test_depth_fractions_count_a_looped_models_passes(tiny_model_dir, tmp_path):
    """A looped Nanbeige's 2 blocks run twice: 4 engine layers, and ``at=0.75`` cuts after
    layer 2 of them (of its 2 blocks it would cut after layer 0), as in mlx-lm's 4 caches."""
    out = tmp_path / "answer.json"
    answer.main(["--model", str(tiny_model_dir("nanbeige")), "--lengths", "64",
                 "--answer-tokens", "2", "--repeats", "1", "--out", str(out),
                 "--paths", "mlx-lm;lazy:at=0.75:keep=0.5:complete=none"])
    runs = {r["method"]: r for r in json.loads(out.read_text())["runs"]}
    prefill = runs["lazy:at=0.75:keep=0.5:complete=none"]["stats"]["prefill_tokens_per_layer"]
    assert prefill[:3] == [64] * 3 and prefill[3] < 64
    assert len(runs["mlx-lm"]["kv_bytes_per_layer"]) == 4
