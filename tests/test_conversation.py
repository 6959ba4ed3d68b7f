"""The conversation benchmark end to end on a tiny model: caches change no greedy answer, a
cached conversation computes each (token, layer) once, completion reaches full's state."""

from __future__ import annotations

import json

import pytest

from mlx_lazy.bench import conversation


@pytest.mark.slow
def test_conversation_bench_end_to_end(tiny_model_path, tmp_path):
    out = tmp_path / "conv"
    assert conversation.main(["--model", str(tiny_model_path), "--length", "600", "--turns", "3",
                              "--conversations", "1", "--max-tokens", "4",
                              "--methods", "full;lazy:layers=1:keep=0.3:complete=none",
                              "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    paths = {p["name"]: p for p in results["paths"]}
    lazy = "lazy:layers=1:keep=0.3:complete=none"  # the paper's: revivals, no completion
    assert set(paths) == {"mlx-lm+cache", "mlx-lm", "full+cache", "full", f"{lazy}+cache",
                          f"{lazy}+cache+complete", lazy}

    def texts(name):
        return [turn[0]["text"] for _, turn in sorted(paths[name]["turns"].items())]

    # Greedy answers: a cache changes nothing for the unpruned paths, ours or mlx-lm's.
    assert texts("full+cache") == texts("full") == texts("mlx-lm+cache") == texts("mlx-lm")
    for name in ("full+cache", "mlx-lm+cache", f"{lazy}+cache"):
        follow_ups = [turn[0]["cached_tokens"] for t, turn in paths[name]["turns"].items()
                      if t != "0"]
        assert all(n > 500 for n in follow_ups), (name, follow_ups)
    assert all(turn[0]["cached_tokens"] == 0 for turn in paths["full"]["turns"].values())
    # Every (token, layer) once over the whole conversation: full with a cache and a completed
    # lazy state computed each held token at every layer exactly once, lazy alone fewer; the
    # uncached paths redo the context every turn.
    depth = 4  # the tiny model's layers

    def work(name):
        return paths[name]["token_layers"][0] / (depth * paths[name]["tokens_held"][0])

    assert work("full+cache") == work(f"{lazy}+cache+complete") == 1.0
    # ... by completing between turns: the answers ran the paper's way, with revivals
    done = paths[f"{lazy}+cache+complete"]["turns"].values()
    assert all(turn[0]["complete_s"] > 0 and turn[0]["revivals"] > 0 for turn in done)
    assert work(f"{lazy}+cache") < 1.0
    assert work("full") > 2.0
    assert "TTFT / mlx-lm+cache" in (out / "table.md").read_text()


@pytest.mark.slow
def test_a_hybrid_models_caches_change_no_answer(tiny_model_dir, tmp_path):
    """Qwen3.5's recurrent layers cannot trim: a cache that holds more than a turn shares
    (mlx-lm's or ours) starts that turn again instead of running on stale state, so the
    greedy answers are the uncached ones."""
    out = tmp_path / "conv"
    assert conversation.main(["--model", str(tiny_model_dir("qwen3_5")), "--length", "400",
                              "--turns", "3", "--conversations", "1", "--max-tokens", "4",
                              "--methods", "full", "--out", str(out)]) == 0
    paths = {p["name"]: p for p in json.loads((out / "results.json").read_text())["paths"]}
    texts = {name: [turn[0]["text"] for _, turn in sorted(p["turns"].items())]
             for name, p in paths.items()}
    assert texts["full+cache"] == texts["full"] == texts["mlx-lm+cache"] == texts["mlx-lm"]


def test_an_interrupted_run_keeps_the_finished_conversations(tiny_model_path, tmp_path,
                                                            monkeypatch):
    """Results are written after every conversation: a Ctrl-C in the second one leaves the
    first one's in results.json and table.md, and exit status 130."""
    answer, calls = conversation.Runner.answer, []

    def interrupted(self, *args):
        calls.append(1)
        if len(calls) == 6:  # 2 paths x 2 turns per conversation: the second one's 2nd turn
            raise KeyboardInterrupt
        return answer(self, *args)

    monkeypatch.setattr(conversation.Runner, "answer", interrupted)
    out = tmp_path / "conv"
    assert conversation.main(["--model", str(tiny_model_path), "--length", "600", "--turns", "2",
                              "--conversations", "3", "--max-tokens", "2", "--methods", "full",
                              "--paths", "cache,uncached", "--out", str(out)]) == 130
    results = json.loads((out / "results.json").read_text())
    assert results["conversations"] == 1
    assert {p["name"]: [len(ts) for ts in p["turns"].values()] for p in results["paths"]} == {
        "full+cache": [1, 1], "full": [1, 1]}
    assert "1 conversations" in (out / "table.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--paths", "cache,sometimes"], "--paths takes cache, uncached"),
    (["--time-limit", "0"], "--time-limit must be a positive"),
    (["--turns", "0"], "--turns must be at least 1, got 0"),  # once one sentence for all
    (["--conversations", "-1"], "--conversations must be at least 1"),
    (["--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--length", "10"], "--length must be at least 64"),
])
def test_bad_options_are_one_line_naming_the_flag(capsys, args, message):
    assert conversation.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


@pytest.mark.parametrize("args, message", [
    (["--methods", "bogus"], "unknown method"),  # these three were tracebacks
    (["--methods", "lazy:layers=99"], "layer"),
    (["--methods", "mlx-lm"], "mlx-lm is a --paths kind"),
    (["--out", "{tmp}/file/sub"], "cannot create --out"),
    (["--turns", "1191"], "past the model's context of 4096"),  # once an endless loop
    (["--length", "100000"], "past the model's context"),  # once built a 100K-token document
])
def test_bad_values_are_one_line_before_any_run(tiny_model_path, tmp_path, capsys, args,
                                                message):
    (tmp_path / "file").write_text("mine")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    base = ["--model", str(tiny_model_path), "--length", "512", "--conversations", "1",
            "--max-tokens", "2", "--out", str(tmp_path / "out")]
    assert conversation.main([*base, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_more_turns_than_keys_is_an_error_not_a_loop(tiny_model):
    """Past the keys there are, drawing new ones once looped for ever (the command line
    refuses so many turns against the context first)."""
    from mlx_lazy.bench.tasks import build_conversations

    _, tokenizer = tiny_model("llama")
    with pytest.raises(ValueError, match="cannot draw 1191 different keys"):
        build_conversations(tokenizer, 512, 1, turns=1191)
