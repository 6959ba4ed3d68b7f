"""``python -m mlx_lazy.bench.probe``: the keep fraction a cut needs to keep a needle's value."""

import dataclasses
import json

import numpy as np
import pytest

from mlx_lazy import PruningConfig, resolve_config, selection
from mlx_lazy.attention import BlockSparse
from mlx_lazy.bench import probe
from mlx_lazy.bench.tasks import build_samples
from mlx_lazy.engine import LazyEngine
from mlx_lazy.errors import UserInputError
from mlx_lazy.scorers import parse_scorer

SCORER = "window:size=8:pool=2"


def test_needed_keep_counts_what_scores_at_least_the_weakest_value_token():
    """Forced positions count as kept; the weakest value token sets the threshold, ties in."""
    scores = np.array([0.0, 5.0, 1.0, 3.0, 3.0, 2.0, 9.0, 0.5])
    forced = np.zeros(8, bool)
    forced[[0, 7]] = True
    # value at 1 and 3: the weakest scores 3.0; at or above it: 1, 3, 4 (a tie), 6, and the
    # forced 0 and 7
    assert probe.needed_keep(scores, np.array([1, 3]), forced) == 6 / 8
    assert probe.needed_keep(scores, np.array([6]), forced) == 3 / 8
    # any of 1 and 3: the stronger, 5.0, sets it: 1, 6 and the forced two
    assert probe.needed_keep(scores, np.array([1, 3]), forced, every=False) == 4 / 8


@pytest.mark.parametrize("kind, layer", [("llama", 1), ("gemma3_text", 1),
                                         ("gemma4_text-e2b", 2), ("gemma2", 1)])
def test_the_probe_keep_is_what_the_engine_cut_needs(tiny_model, kind, layer):
    """A cut after the layer keeping the probe's fraction keeps every value token through the
    prompt's selection; keeping only what scores strictly above the weakest one drops one.
    At its fraction for any value token, one stays; strictly above the strongest, none does.
    So the probe ranks as the engine's own selection does, layer for layer (Gemma 4 E2B's
    layer 2 scoring layer 0's keys, which it reads; Gemma 2's soft-capped logits)."""
    model, tokenizer = tiny_model(kind)
    sample = build_samples(tokenizer, "niah_single", 600, 1, seed=1)[0]
    scorer = parse_scorer(SCORER)
    value = probe.value_positions(tokenizer, sample)
    assert sample.references[0] in tokenizer.decode([sample.tokens[i] for i in value])
    n = sample.n_tokens
    positions = np.arange(n)
    forced = (positions < 1) | (positions >= n - scorer.n_queries)
    scores = probe.layer_scores(LazyEngine(model), sample.tokens, scorer)
    need = probe.needed_keep(scores[layer], value, forced)
    ranked = np.where(forced, np.inf, scores[layer])
    above = ranked > scores[layer][value].min()
    assert need < 1 and above.sum() / n < need
    need_any = probe.needed_keep(scores[layer], value, forced, every=False)
    above_all = ranked > scores[layer][value].max()
    assert above_all.sum() / n < need_any < need

    def kept_at_depth(keep: float) -> np.ndarray:
        config = PruningConfig("lazy", prune_layers=(layer,), keep=(keep,), scorer=SCORER,
                               complete="none")
        engine = LazyEngine(model, resolve_config(model, config))
        engine.prefill(list(sample.tokens))
        return engine.cache.depth[value] > layer + 1

    with selection.keep_floor(0):
        assert kept_at_depth(need).all()
        assert not kept_at_depth(above.sum() / n).all()
        assert kept_at_depth(need_any).any()
        assert not kept_at_depth(above_all.sum() / n).any()


def test_probe_reports_every_layer_a_cut_may_follow(tiny_model_path, tmp_path, capsys):
    out = tmp_path / "probe.json"
    assert probe.main(["--model", str(tiny_model_path), "--samples", "2", "--length", "600",
                       "--scorer", SCORER, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    layers = report["layers"]
    assert [row["layer"] for row in layers] == list(range(len(layers)))
    assert all(0 < row["q50"] <= row["q90"] <= row["q100"] <= 1 for row in layers)
    assert all(0 < row["any_q50"] <= row["any_q90"] <= row["any_q100"] <= 1 for row in layers)
    every, anyone = (np.array(report["per_prompt"][k]) for k in ("every", "any"))
    assert every.shape == anyone.shape == (2, len(layers)) and (anyone <= every).all()
    # each row holds its own layer's quantiles over the prompts, of the right fraction
    for row in layers:
        assert row["q100"] == every[:, row["layer"]].max()
        assert row["any_q100"] == anyone[:, row["layer"]].max()
        assert row["q50"] == np.median(every[:, row["layer"]])
    assert capsys.readouterr().out.count("\n  layer ") == len(layers)


def test_a_chunked_model_probe_names_its_chunks(tiny_model_dir, tmp_path, capsys):
    """Llama 4's chunked layers (0-2, those a cut may follow here) are written as such: JSON
    has no Chunks."""
    out = tmp_path / "probe.json"
    assert probe.main(["--model", str(tiny_model_dir("llama4")), "--samples", "1", "--length",
                       "600", "--scorer", SCORER, "--out", str(out)]) == 0
    layers = json.loads(out.read_text())["layers"]
    assert [row["sliding_window"] for row in layers] == ["chunks of 24"] * 3
    assert "(sliding window chunks of 24)" in capsys.readouterr().out
    rows = probe.summary(np.zeros((2, 1, 2)), [BlockSparse(32, 2, 3, 4), None])  # Phi-3-small's
    assert [row["sliding_window"] for row in rows] == [
        "block-sparse: blocks of 32, 2 local, a stride of 3", None]


def test_a_hybrid_probe_scores_only_its_attention_layers(tiny_model_dir, tmp_path, capsys):
    """Qwen3.5's recurrent layers give no attention to rank by: their rows say so, their
    numbers are null (strict JSON, no NaN), and no cut is cleared after one."""
    out = tmp_path / "probe.json"
    assert probe.main(["--model", str(tiny_model_dir("qwen3_5")), "--samples", "2",
                       "--length", "400", "--out", str(out)]) == 0
    report = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    scored = [row["layer"] for row in report["layers"] if row["q100"] is not None]
    assert scored == [3]
    assert all(v is None for prompt in report["per_prompt"]["every"] for v in prompt[:3])
    assert capsys.readouterr().out.count("recurrent, no cut may follow it") == 6


def test_a_value_missing_from_its_prompt_is_refused(tiny_model):
    _, tokenizer = tiny_model("llama")
    sample = build_samples(tokenizer, "niah_single", 600, 1)[0]
    with pytest.raises(UserInputError, match="is not in the prompt"):
        probe.value_positions(tokenizer, dataclasses.replace(sample, references=("QQQQQQ",)))


@pytest.mark.parametrize("argv, says", [
    (["--samples", "0"], "--samples must be >= 1"),
    (["--length", "-5"], "--length must be >= 1"),
    (["--task", "nope"], "--task 'nope' is not one of"),
    (["--scorer", "bogus"], "scorer"),
    (["--length", "100"], "too short for this task"),
    (["--scorer", "window:size=1000"], "among the tokens a cut always keeps"),
    (["--length", "999999"], "--length 999999 is beyond the model's context"),
    (["--out", "/tmp"], "--out /tmp is a folder"),  # once a traceback after the probe
])
def test_bad_input_is_one_error_line(tiny_model_path, argv, says, capsys):
    assert probe.main(["--model", str(tiny_model_path), "--length", "600", "--samples", "1",
                       *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and says in err[0]


def test_the_cleared_cut_is_the_shallowest_global_layer_within_the_keep():
    """Sliding-window layers are passed over (a cut may not follow them), and the largest
    fraction over the prompts, not the median, decides."""
    rows = [{"layer": 0, "sliding_window": None, "q50": 0.1, "q90": 0.5, "q100": 0.6},
            {"layer": 1, "sliding_window": 512, "q50": 0.1, "q90": 0.1, "q100": 0.1},
            {"layer": 2, "sliding_window": None, "q50": 0.2, "q90": 0.3, "q100": 0.35},
            {"layer": 3, "sliding_window": None, "q50": 0.1, "q90": 0.1, "q100": 0.15}]
    for row in rows:
        row.update({f"any_{q}": row[q] / 2 for q in ("q50", "q90", "q100")})
    assert probe.cleared(rows, 0.5) == 2
    assert probe.cleared(rows, 0.6) == 0
    assert probe.cleared(rows, 0.2) == 3
    assert probe.cleared(rows, 0.1) is None
    report = probe.render(rows, 4)
    assert "keep 50%: after layer 2 (calibrate --cuts 0.6000/0.5)" in report
    assert "keep 20%: after layer 3 (calibrate --cuts 0.8000/0.2)" in report
