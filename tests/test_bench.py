"""The evaluation harness: task generators, scorers, method parsing, selection, end to end."""

from __future__ import annotations

import dataclasses
import importlib
import json

import numpy as np
import pytest

from mlx_lazy import PruningConfig, build_schedule
from mlx_lazy.bench import harness, methods, metrics, tasks
from mlx_lazy.bench.__main__ import main, parse_methods
from mlx_lazy.bench.common import MIB, RunRecord, fmt, markdown_table
from mlx_lazy.scorers import Pooled, Window


class WordTokenizer:
    """Whitespace tokenizer with a chat template: enough for the generators, no model."""

    bos_token = None
    chat_template = "stub"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(w) for w in text.split()]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return f"<user>\n{messages[0]['content']}\n<assistant>\n"


TOK = WordTokenizer()


# ---------------------------------------------------------------------------- generators


@pytest.mark.parametrize("task", sorted(tasks.TASKS))
def test_generators_are_deterministic_and_fit(task):
    a = tasks.build_samples(TOK, task, 600, 3, seed=0)
    b = tasks.build_samples(TOK, task, 600, 3, seed=0)
    c = tasks.build_samples(TOK, task, 600, 3, seed=1)
    assert [s.prompt for s in a] == [s.prompt for s in b]
    assert [s.tokens for s in a] == [s.tokens for s in b]
    assert [s.prompt for s in a] != [s.prompt for s in c]
    assert len({s.prompt for s in a}) == 3  # samples differ from each other too
    for s in a:
        assert 0.75 * 600 < s.n_tokens <= 600
        assert s.prompt.startswith("<user>")
        assert all(ref in s.prompt for ref in s.references)
        assert s.match in metrics.MATCH_MODES
        assert s.as_dict()["prompt_tokens"] == s.n_tokens


def test_needles_move_deeper_with_the_sample_index():
    samples = tasks.build_samples(TOK, "niah_single", 800, 4, seed=3)
    positions = [s.prompt.index("special magic numbers for") for s in samples]
    assert [s.depths[0] for s in samples] == [0.125, 0.375, 0.625, 0.875]
    assert positions == sorted(positions)


def test_haystack_is_natural_prose():
    sents = tasks.prose_sentences()
    assert len(sents) > 500
    assert all(s.endswith(".") and s[0].isupper() for s in sents)
    assert not any(ch.isdigit() for s in sents for ch in s)  # no stray numbers near needles


def test_too_short_length_and_unknown_task():
    with pytest.raises(ValueError, match="too short"):
        tasks.build_samples(TOK, "multidoc_qa", 20, 1)
    with pytest.raises(ValueError, match="unknown task"):
        tasks.get_task("nope")


def test_suite_covers_every_cell():
    suite = tasks.build_suite(TOK, ["passkey", "kv_retrieval"], [300, 500], 2, seed=0)
    assert {(s.task, s.target_tokens) for s in suite} == {
        (t, n) for t in ("passkey", "kv_retrieval") for n in (300, 500)}
    assert len(suite) == 8


@pytest.mark.slow
def test_lengths_with_the_real_tokenizer(smollm2_path):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(smollm2_path)
    for task in tasks.TASKS:
        (s,) = tasks.build_samples(tok, task, 512, 1, seed=0)
        assert 400 < s.n_tokens <= 512, task
        assert s.prompt.startswith("<|im_start|>system")  # chat template applied
        assert list(s.tokens) == tasks.encode(tok, s.prompt)


# ------------------------------------------------------------------------------- scorers


def test_normalization():
    assert metrics.normalize_answer("The  Quick, brown fox!") == "quick brown fox"
    assert metrics.normalize_answer("An apple; a PEAR.") == "apple pear"
    assert metrics.normalize_answer("  ") == ""


def test_exact_and_substring_match():
    assert metrics.exact_match("The Answer.", ["answer"]) == 1.0
    assert metrics.exact_match("answer two", ["answer"]) == 0.0
    assert metrics.substring_match("Keys: 123, 456.", ["123", "456"], "all") == 1.0
    assert metrics.substring_match("Keys: 123.", ["123", "456"], "all") == 0.0
    assert metrics.substring_match("Keys: 123.", ["123", "456"], "any") == 1.0
    assert metrics.substring_match("91234", ["123"], "any") == 0.0  # whole tokens only
    assert metrics.substring_match("6776", ["67767"], "any") == 0.0  # partial digits fail
    with pytest.raises(ValueError):
        metrics.substring_match("x", ["x"], "some")


def test_token_f1():
    assert metrics.token_f1("the cat sat", ["a cat sat down"]) == pytest.approx(0.8)
    assert metrics.token_f1("Lisbon.", ["lisbon"]) == 1.0
    assert metrics.token_f1("Oslo", ["Lisbon", "Oslo"]) == 1.0  # best reference
    assert metrics.token_f1("nothing here", ["Lisbon"]) == 0.0
    assert metrics.token_f1("", [""]) == 1.0


def test_score_modes():
    text = " 67767.\nThe pass key is something else"
    assert metrics.score(text, ["67767"], "exact") == 1.0  # first line only
    assert metrics.score(text, ["67767"], "any") == 1.0
    assert metrics.score(" Lisbon, a city\nmore", ["Lisbon"], "f1") == pytest.approx(2 / 3)
    assert set(metrics.score_all(text, ["67767"])) == set(metrics.MATCH_MODES)
    with pytest.raises(ValueError, match="unknown match mode"):
        metrics.score(text, ["x"], "fuzzy")


# ------------------------------------------------------------------- methods, selection


def test_parse_method():
    assert methods.parse_method("mlx-lm").is_baseline
    m = methods.parse_method("lazy:layers=5,11:keep=0.6,0.4")
    assert (m.config.method, m.config.prune_layers, m.config.keep) == ("lazy", (5, 11), (0.6, 0.4))
    assert m.family == "lazy" and m.schedule()["keep"] == [0.6, 0.4]
    s = methods.parse_method("static:layers=6:keep=0.4")
    assert (s.config.prune_layers, s.config.keep) == ((6,), (0.4,))
    assert methods.parse_method("speed:cutoff=0.5").config.speed_cutoff == 0.5
    spec = methods.method_spec(PruningConfig("lazy", prune_layers=(3,), keep=(0.5,)))
    assert methods.parse_method(spec).config.prune_layers == (3,)
    with pytest.raises(ValueError, match="unknown method"):
        methods.parse_method("nope")
    with pytest.raises(ValueError, match="field=value"):
        methods.parse_method("lazy:oops")
    assert parse_methods("full,lazy") == ("full", "lazy")
    assert parse_methods("full;lazy:layers=1,2:keep=0.5,0.2") == (
        "full", "lazy:layers=1,2:keep=0.5,0.2")
    # one string with fields: its lists' commas do not split it (once "unknown method '2'")
    assert parse_methods("lazy:layers=1,2:keep=0.5,0.2") == ("lazy:layers=1,2:keep=0.5,0.2",)


@pytest.mark.parametrize("config", [
    dict(method="lazy", prune_layers=(3, 9), keep=(0.5, 0.25), scorer="window:size=9:pool=2"),
    dict(method="lazy", revive=False, scorer="last:heads=max", complete="progressive:8"),
    dict(method="lazy", complete="none"),  # "none" is a mode here, not Python's None
    dict(method="lazy+speed", speed_cutoff=0.6, anchors=4),
    dict(method="random", keep=(0.3,), seed=2),
    dict(method="full"),
    dict(method="speed", speed_cutoff=1.0),  # full depth; once written "cutoff=1", one layer
    dict(method="lazy", prune_layers=(2,), keep=(0.123456789,)),  # once cut to 0.123457
    dict(method="lazy", quality="high"),  # once dropped
])
def test_method_spec_round_trips(config):
    cfg = PruningConfig(**config)
    assert methods.parse_method(methods.method_spec(cfg)).config == cfg


@pytest.mark.parametrize("spec", ["lazy:layers=6,12,:keep=0.5,0.4", "lazy:layers=1_0",
                                  "lazy:keep=,0.5"])
def test_method_specs_read_numbers_as_the_cli_does(spec):
    """A trailing comma or an underscore in a number, refused by the CLI's --prune-layers and
    --keep, was accepted here (6,12, read as 6,12; 1_0 as 10)."""
    with pytest.raises(ValueError):
        methods.parse_method(spec)


def test_named_methods_and_depth_fractions():
    lazy4 = methods.parse_method("lazy-4", 30).config
    assert lazy4.prune_layers == (5, 11, 17, 23) and lazy4.keep == (0.6, 0.4, 0.25, 0.15)
    # On a 4-layer model the fractions collide and are clamped below the last layer.
    shallow = methods.parse_method("lazy-4", 4).config
    assert shallow.prune_layers == (0, 1, 2) and len(shallow.keep) == 3
    build_schedule(shallow, 4)
    for name in methods.NAMED_METHODS:
        build_schedule(methods.parse_method(name, 30).config, 30)
    with pytest.raises(ValueError, match="depth is needed"):
        methods.parse_method("lazy:at=0.5:keep=0.3")
    w = methods.parse_method("lazy:scorer=window:size=16:heads=max:complete=after-first").config
    assert w.scorer == Window(size=16, heads="max") and w.complete == "after-first"
    pooled = methods.parse_method("lazy:complete=progressive:4:scorer=window:pool=3:size=16")
    assert pooled.config.scorer == Pooled(Window(size=16), 3)
    assert pooled.config.complete == "progressive:4"
    with pytest.raises(ValueError, match="unexpected keyword argument 'window'"):
        methods.parse_method("lazy:scorer=window:window=16")  # the old spelling


# ------------------------------------------------------------------- records and tables


def _record(method, ttft, *, task="passkey", index=0, repeat=0, prompt=100, score=1.0,
            kv=2**20, layers=4):
    """A run with known numbers: TPOT ttft / 10, total 2 ttft, CPU time 1.5 ttft."""
    family = method.split(":")[0]
    stats = None if method == "mlx-lm" else {
        "method": family, "revivals": 0, "host_syncs": 0, "max_computations_per_token_layer": 1}
    return RunRecord(
        method=method, family=family, prompt_tokens=prompt, generation_tokens=4, ttft_s=ttft,
        tpot_s=ttft / 10, total_s=2 * ttft, peak_memory_bytes=3 * 2**20, kv_bytes=kv, aux_bytes=0,
        ttft_cpu_s=1.5 * ttft, tpot_cpu_s=0.15 * ttft, tpot_short_s=ttft / 10,
        work_memory_bytes=2**20, kv_bytes_per_layer=[kv // layers] * layers,
        prompt_tokens_computed_pct=100.0, tokens_computed_per_layer=[prompt + 3] * layers,
        prefill_tokens_per_layer=[prompt] * layers,
        prefill_attention_pairs=prompt * (prompt + 1) // 2 * layers, prediction="12345",
        stats=stats, repeat=repeat, task=task, length=prompt, index=index, score=score,
        scores={m: score for m in metrics.MATCH_MODES})


def _tables(md):
    """Every markdown table in ``md``: a list of rows, each a dict keyed by the header."""
    def cells(line):
        return [c.strip() for c in line.strip().strip("|").split("|")]

    lines, tables = md.splitlines(), []
    for i, line in enumerate(lines):
        if line.startswith("|---"):
            head, rows = cells(lines[i - 1]), []
            for row in lines[i + 1:]:
                if not row.startswith("|"):
                    break
                assert len(cells(row)) == len(head), row
                rows.append(dict(zip(head, cells(row))))
            tables.append(rows)
    return tables


def test_markdown_table_and_fmt():
    assert markdown_table(["a", "b"], [[1, None], ["x", "2.0%"]]) == (
        "| a | b |\n|---|---|\n| 1 | – |\n| x | 2.0% |")
    with pytest.raises(ValueError, match="3 cells for 2 columns"):
        markdown_table(["a", "b"], [[1, 2, 3]])
    assert fmt(None) == "–" and fmt(0.5) == "0.50"
    assert fmt(-0.0312, "+.1f", 100, "%") == "-3.1%" and fmt(3 * 2**20, ".1f", MIB) == "3.0"


def test_record_round_trips_through_json():
    r = _record("lazy", 0.5)
    assert RunRecord.from_dict(json.loads(json.dumps(dataclasses.asdict(r)))) == r


def test_records_written_before_the_merge_are_read():
    acc = dataclasses.asdict(_record("lazy", 0.5))
    for k in ("ttft_cpu_s", "tpot_cpu_s", "tpot_short_s", "work_memory_bytes", "kv_bytes_per_layer",
              "kv_bytes_allocated", "loadavg_1min", "repeat"):
        del acc[k]
    old = RunRecord.from_dict(acc)
    assert old.score == 1.0 and old.ttft_cpu_s is None and old.prefill_attention_pairs == 20200
    # The speed benchmark's RunResult: ``generated``, no family, the counts only in stats.
    full = _record("full", 1.0)
    speed = {k: v for k, v in dataclasses.asdict(full).items() if k in (
        "ttft_s", "tpot_s", "total_s", "ttft_cpu_s", "tpot_cpu_s", "tpot_short_s", "method",
        "prompt_tokens", "repeat", "peak_memory_bytes", "work_memory_bytes", "kv_bytes",
        "kv_bytes_per_layer", "aux_bytes")}
    counts = {"prompt_tokens_computed_pct": 100.0, "tokens_computed_per_layer": [103] * 4,
              "prefill_tokens_per_layer": [100] * 4, "prefill_attention_pairs": 20200}
    speed |= {"generated": 4, "stats": {**full.stats, **counts}}
    r = RunRecord.from_dict(speed)
    assert (r.family, r.generation_tokens, r.prefill_tokens_per_layer) == ("full", 4, [100] * 4)
    assert RunRecord.from_dict({**speed, "method": "mlx-lm", "stats": None}).family == "mlx-lm"


def test_accuracy_summary_and_table_from_known_runs():
    # Two samples; lazy answers the second wrong. Paired TTFT ratios vs mlx-lm: 2 and 4.
    runs = [_record("mlx-lm", 2.0), _record("full", 1.0), _record("lazy", 1.0, kv=2**19),
            _record("mlx-lm", 4.0, index=1), _record("full", 2.0, index=1),
            _record("lazy", 1.0, index=1, score=0.0, kv=2**19)]
    summary = harness.summarize([RunRecord.from_dict(dataclasses.asdict(r)) for r in runs])
    lazy = next(r for r in summary if (r["task"], r["method"]) == ("passkey", "lazy"))
    assert lazy["ttft_speedup"] == pytest.approx(8 ** 0.5)  # geometric mean of 2 and 4
    assert lazy["ttft_speedup_vs_full"] == pytest.approx(2 ** 0.5)
    assert lazy["relative_accuracy_loss"] == pytest.approx(0.5)
    meta = {"model": "m", "n_layers": 4, "config": {"samples": 2, "seed": 0},
            "machine": {"cpu": "cpu", "cpu_count": 2, "platform": "p", "mlx": "0", "mlx_lm": "0",
                        "openblas": None, "date": "d"}}
    table1, table2 = _tables(harness.render_table({"meta": meta, "summary": summary}))
    row1 = next(r for r in table1 if (r["Task"], r["Method"]) == ("passkey", "lazy"))
    assert row1["Score (mlx-lm → method)"] == "1.00 → 0.50" and row1["Rel. loss"] == "50.0%"
    assert row1["lost / won vs full"] == "1 / 0"
    assert row1["TTFT speedup vs mlx-lm"] == "2.83×" and row1["vs full"] == "1.41×"
    assert row1["predicted vs full"] == "–"
    row2 = next(r for r in table2 if (r["Task"], r["Method"]) == ("all", "lazy"))
    assert row2["Generation speedup"] == "2.83×" and row2["KV MiB"] == "0.5"
    assert row2["Peak MiB"] == "3.0" and row2["% prefill work"] == "100.0%"


def test_speed_summary_and_table_from_known_runs():
    from mlx_lazy.bench import speed

    # full at three lengths fits the cost model; at 400 tokens two repeats, speed only in the first.
    runs = [_record("full", t, prompt=n) for n, t in ((100, 0.1), (200, 0.25))]
    for rep, (base, full, lazy) in enumerate(((2.0, 1.0, 0.5), (4.0, 1.0, 1.0))):
        runs += [_record("mlx-lm", base, prompt=400, repeat=rep, kv=2**20),
                 _record("full", full, prompt=400, repeat=rep, kv=2**20),
                 _record("lazy", lazy, prompt=400, repeat=rep, kv=2**19)]
    runs.append(_record("speed", 1.0, prompt=400, kv=2**18))
    summary = speed.summarize(runs, 400)
    lazy = summary["methods"]["lazy"]
    assert lazy["ttft_vs_mlx_lm"] == pytest.approx(0.25)  # 0.5 / 2 and 1 / 4
    assert lazy["ttft_vs_full"] == pytest.approx(0.75)  # median of 0.5 and 1
    assert summary["methods"]["speed"]["ttft_vs_mlx_lm"] == pytest.approx(0.5)  # repeat 0 only
    assert summary["repeats_completed"] == 1
    result = {"info": {"main_length": 400, "max_tokens": 4, "repeats": 2,
                       "lengths": [100, 200, 400], "cpu_count": 2},
              "summary": summary, "runs": [dataclasses.asdict(r) for r in runs], "skipped": {}}
    text = speed.render_table(result)
    assert "1 of 2 repeats completed" in text
    prefill, decode = _tables(text)
    row = next(r for r in prefill if r["method"] == "lazy")
    assert (row["TTFT s"], row["TTFT × mlx-lm"], row["TTFT × full"]) == ("0.75", "0.250", "0.750")
    assert row["CPU-s × mlx-lm"] == "0.250" and row["token-layers %"] == "100.0"
    assert row["host syncs"] == "0"
    row = next(r for r in decode if r["method"] == "lazy")
    assert (row["TPOT ms"], row["TPOT × mlx-lm"], row["KV × mlx-lm"]) == ("75.0", "0.250", "0.500")
    assert next(r for r in decode if r["method"] == "mlx-lm")["revivals"] == "–"


@pytest.mark.parametrize("args, message", [
    (["--clients", "0"], "--clients must be at least 1, got 0"),  # once "0/0 completed", exit 0
    (["--requests", "-1"], "--requests must be at least 1"),
    (["--timeout", "nan"], "--timeout must be a positive number"),  # once thread tracebacks
    (["--url", "notaurl"], "--url takes a server's address"),  # once thread tracebacks
    (["--methods", "bogus"], "--methods: unknown method 'bogus'"),  # once 0/N, exit 1
    (["--methods", "full,full"], "--methods names full twice"),
    (["--prompt-tokens", "100000"], "past the model's context of 4096"),  # once 0/N, exit 1
    (["--out", "/nonexistent/dir/l.json"], "folder /nonexistent/dir does not exist"),
])
def test_server_load_refuses_bad_options_before_starting_a_server(tiny_model_path, monkeypatch,
                                                                  capsys, args, message):
    from mlx_lazy.bench import server_load

    monkeypatch.setattr(server_load, "start_server", lambda *a: pytest.fail("started"))
    with pytest.raises(SystemExit) as e:
        server_load.main(["--model", str(tiny_model_path), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and message in err[0], err


def test_server_load_and_distributed_tables():
    from mlx_lazy.bench import distributed, server_load

    base = {"method": "full", "requests": 2, "completed": 2, "wall_s": 10.0,
            "requests_per_min": 12.0, "tokens_per_s": 3.0, "ttft_p50_s": 2.0, "ttft_p90_s": 3.0,
            "ttft_max_s": 4.0, "server_prefill_median_s": 1.5}
    failed = {**base, "method": "lazy", "completed": 0, "requests_per_min": 0.0, "ttft_p50_s": None,
              "ttft_p90_s": None, "ttft_max_s": None, "server_prefill_median_s": None}
    fast = {**base, "method": "speed", "ttft_p50_s": 1.0, "requests_per_min": 24.0}
    (rows,) = _tables(server_load.format_table([base, failed, fast]))
    assert rows[1]["completed"] == "0/2" and rows[1]["TTFT p50 vs first"] == "–"
    assert (rows[2]["TTFT p50 vs first"], rows[2]["req/min vs first"]) == ("0.50x", "2.00x")
    stats = {"score_allsum_bytes": 0}
    one = {"repeat": 0, "method": "full", "ranks": 1, "ttft_s": 2.0, "tpot_s": 0.02, "stats": stats}
    two = {**one, "ranks": 2, "ttft_s": 1.0, "tpot_s": 0.04, "prefill_allsum_bytes": 3e6,
           "prefill_allsum_s": 0.25, "decode_allsum_bytes_per_step": 2e3,
           "decode_allsum_s_per_step": 0.01, "score_allsum_s": 0.0,
           "stats": {"score_allsum_bytes": 4e3}}
    (rows,) = _tables(distributed.table([one, two]))
    assert rows[0]["all-sum share of TTFT"] == "–" and rows[0]["prefill all-sums MB"] == "0.0"
    assert (rows[1]["TTFT × 1 rank"], rows[1]["TPOT × 1 rank"], rows[1]["TPOT ms"]) == (
        "0.50", "2.00", "40.0")
    assert (rows[1]["all-sum share of TTFT"], rows[1]["all-sum share of TPOT"]) == (
        "25.0%", "25.0%")
    assert rows[1]["prefill all-sums MB"] == "3.0" and rows[1]["score all-sums KB"] == "4.0"


# ---------------------------------------------------------------------------- end to end


def drawn(png, method: str) -> bool:
    """Whether ``png`` has pixels of ``method``'s (chromatic) plot colour: its hue, whatever
    the transparency over the white background."""
    from matplotlib import colors, image

    from mlx_lazy.bench.plots import COLORS

    hsv = colors.rgb_to_hsv(image.imread(png)[..., :3])
    hue = colors.rgb_to_hsv(colors.to_rgb(COLORS[method]))[0]
    off = abs(hsv[..., 0] - hue)
    return bool(((hsv[..., 1] > 0.3) & (np.minimum(off, 1 - off) < 0.01)).sum() > 20)


@pytest.mark.slow
def test_quick_end_to_end(tiny_model_path, tmp_path):
    out = tmp_path / "bench"
    assert main(["--quick", "--model", str(tiny_model_path), "--lengths", "600",
                 "--samples", "1", "--max-tokens", "4", "--out", str(out), "--no-progress",
                 "--agreement", "1", "--agreement-steps", "4"]) == 0
    assert (out / "table.md").read_text().count("\n| ") > len(harness.DEFAULT_METHODS)
    # Every pruning method's colour is drawn: the plots show the runs, not an empty frame.
    pruned = set(harness.DEFAULT_METHODS) - {"mlx-lm", "full"}  # black and grey: no hue
    assert {m for m in pruned if drawn(out / "pareto.png", m)} == pruned
    assert drawn(out / "token_usage.png", "lazy") and drawn(out / "token_usage.png", "speed")
    data = json.loads((out / "results.json").read_text())
    runs = data["runs"]
    assert {r["method"] for r in runs} == set(harness.DEFAULT_METHODS)
    assert {r["task"] for r in runs} == set(tasks.QUICK_TASKS)
    # methods alternate: the first method differs from sample to sample
    firsts = {r["task"]: r["method"] for r in runs if r["order"] == 0}
    assert len(set(firsts.values())) > 1
    for r in runs:
        assert r["ttft_s"] > 0 and r["total_s"] >= r["ttft_s"]
        assert 0.0 <= r["score"] <= 1.0 and r["peak_memory_bytes"] > 0
        assert (r["stats"] is None) == (r["method"] == "mlx-lm")
    base = [r for r in data["summary"] if r["method"] == "mlx-lm" and r["task"] == "all"]
    assert base and base[0]["ttft_speedup"] == pytest.approx(1.0)
    assert base[0]["baseline_score"] is not None  # the baseline's own accuracy is reported
    lazy = next(r for r in data["summary"] if r["method"] == "lazy" and r["task"] == "all")
    # the prefill is pruned and, decoding on the pruned state (the transfer rule of a model
    # nobody calibrated), some prompt tokens never reach the last layer
    assert lazy["prefill_work_pct"] < 100 and lazy["prompt_tokens_computed_pct"] < 100
    # Paired against our unpruned path on the same samples, with a Wilson interval.
    n = len([r for r in runs if r["method"] == "lazy"])
    assert lazy["vs_full"]["n"] == n and lazy["vs_full"]["lost"] + lazy["vs_full"]["won"] <= n
    assert 0 <= lazy["score_ci"][0] <= lazy["score"] <= lazy["score_ci"][1] <= 1
    table = (out / "table.md").read_text()
    assert "Table 1" in table and "Table 2" in table and "| all | lazy |" in table
    assert "lost / won vs full" in table
    # Teacher-forced agreement with full: every engine method but full, 4 steps each.
    agreement = {a["method"]: a for a in data["agreement"]}
    assert set(agreement) == set(harness.DEFAULT_METHODS) - {"mlx-lm", "full"}
    assert all(a["steps"] == 4 and 0 <= a["rate"] <= 1 for a in agreement.values())
    assert "Teacher-forced top-1 agreement" in table


def test_cli_errors_are_one_line(tiny_model_path, tmp_path, capsys):
    base = ["--model", str(tiny_model_path), "--out", str(tmp_path), "--no-progress"]
    assert main([*base, "--tasks", "nope"]) == 2
    assert main([*base, "--methods", "mlx-lm,bogus"]) == 2
    assert main([*base, "--tasks", "multidoc_qa", "--lengths", "20"]) == 2
    err = capsys.readouterr().err
    assert "unknown task" in err and "unknown method" in err and "too short" in err


@pytest.mark.parametrize("argv, message", [
    (["--samples", "0"], "--samples must be at least 1"),  # once an empty report, exit 0
    (["--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--agreement", "-1"], "--agreement must be at least 0"),
    (["--agreement", "1", "--agreement-steps", "0"], "--agreement-steps must be at least 1"),
    (["--time-limit", "-1"], "--time-limit must be a positive number"),  # once a run of nothing
    (["--time-limit", "abc"], "--time-limit"),  # once argparse's usage block
    (["--lengths", "0"], "--lengths must be positive"),
    (["--lengths", "999999"], "beyond the model's context"),  # once run past it
    (["--out", "{tmp}/file"], "exists and is not a folder"),  # once a traceback after the runs
    (["--out", "{tmp}/file/sub"], "cannot create --out"),  # ... and this one, every result lost
    (["--lengths", "512,512"], "--lengths names a value twice"),  # once n counted twice
    (["--tasks", "passkey,passkey"], "--tasks names a value twice"),
])
def test_bad_options_are_one_error_line(tiny_model_path, tmp_path, capsys, argv, message):
    (tmp_path / "file").write_text("mine")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    try:
        status = main(["--quick", "--model", str(tiny_model_path), "--no-progress",
                       "--out", str(tmp_path / "out"), *argv])
    except SystemExit as e:
        status = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("error:"), err
    assert message in err[0], err
    assert (tmp_path / "file").read_text() == "mine"


def test_report_of_another_results_file_is_one_error(tmp_path, capsys):
    (tmp_path / "results.json").write_text("[1, 2]")
    assert main(["--report", str(tmp_path)]) == 2
    assert "is not this benchmark's results" in capsys.readouterr().err


def test_time_limit_stops_between_samples(tiny_model_path, tmp_path):
    from mlx_lazy import load

    model, tok = load(str(tiny_model_path))
    cfg = harness.BenchConfig(tasks=("passkey",), lengths=(400,), samples=3,
                              methods=("mlx-lm", "full"), max_tokens=2, progress=False,
                              warmup=False, time_limit_s=0.0)
    result = harness.run_bench(cfg, model, tok, log=lambda msg: None)
    assert result.meta["stopped_early"] and result.meta["samples_done"] <= 1
    assert len(result.runs) == 2 * result.meta["samples_done"]


def test_an_interrupted_run_writes_what_it_has_and_exits_130(tiny_model_path, tmp_path,
                                                            monkeypatch, capsys):
    """Ctrl-C between samples: the samples done are written, and the exit status says it
    was interrupted (it said 0, as a finished run)."""
    real, calls = harness.run_one, []

    def interrupted(*args, **kw):
        if len(args) == 6:  # a sample's run (the warm-up's pass max_tokens by name)
            calls.append(args[3])
            if calls[-1] is not calls[0]:  # the second sample's first method
                raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(harness, "run_one", interrupted)
    status = main(["--model", str(tiny_model_path), "--no-progress", "--out", str(tmp_path),
                   "--tasks", "passkey", "--lengths", "400", "--samples", "2",
                   "--max-tokens", "2", "--methods", "full,lazy"])
    result = harness.load_results(tmp_path)
    assert status == 130 and result["meta"]["stopped_early"] == "interrupted", status
    assert result["meta"]["samples_done"] == 1


@pytest.mark.parametrize("results, out, message", [
    ('{"runs": []}', "p.png", "not calibration results"),  # a harness run: KeyError once
    (None, "p.txt", "--out must name a .png file"),  # matplotlib's ValueError once
    (None, "nodir/p.png", "--out"),  # a traceback once
])
def test_plots_bad_input_is_one_error_line(tmp_path, capsys, results, out, message):
    from mlx_lazy.bench.plots import main as plots_main

    (tmp_path / "results.json").write_text(results or '{"cells": {}}')
    with pytest.raises(SystemExit) as e:
        plots_main([str(tmp_path), "--out", str(tmp_path / out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and message in err[-1], err


def test_the_mlx_lm_row_counts_every_layer(tiny_model):
    """mlx-lm keeps caches for Gemma 4 E2B's lower layers only (the upper ones read them):
    its row still has one entry per layer, KV where ours (``full``) has it (layer 0's is its
    24-token sliding window), and every layer's prompt tokens and attention pairs (its row
    once had 2 layers of 4, half the pairs)."""
    from mlx_lazy.bench.common import Method, measure

    model, tokenizer = tiny_model("gemma4_text-e2b")
    prompt = list(range(3, 123))
    theirs = measure(model, tokenizer, Method("mlx-lm"), prompt, 2, stop_at_eos=False)
    ours = measure(model, tokenizer, Method("full", PruningConfig("full")), prompt, 2,
                   stop_at_eos=False)
    for row in (theirs, ours):
        assert [b > 0 for b in row.kv_bytes_per_layer] == [True, True, False, False]
    assert theirs.prefill_tokens_per_layer == ours.prefill_tokens_per_layer == [120] * 4
    assert theirs.prefill_attention_pairs == 120 * 121 // 2 * 4


@pytest.mark.parametrize("tool, argv", [
    ("answer", ["--out", ""]), ("fidelity", ["--out", ""]), ("probe", ["--out", ""]),
    ("speed", ["--out", ""]), ("speed", ["--report", ""]),
    ("variant", ["--model", "m", "--schedule", "s.json", "--out", ""]),
    ("variant", ["--model", "m", "--schedule", ""]),
    ("plots", ["", "--out", "p.png"]), ("plots", ["runs", "--out", ""]),
])
def test_an_empty_path_is_one_error_line(tool, argv, tmp_path, monkeypatch, capsys):
    """``Path("")`` is the current folder: ``bench.fidelity --out ''`` once ran its whole
    benchmark and wrote results.json and table.md there."""
    monkeypatch.chdir(tmp_path)
    main = importlib.import_module(f"mlx_lazy.bench.{tool}").main
    try:
        status = main(argv)
    except SystemExit as e:
        status = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert "expected a path, got an empty string" in err[0]
    assert not list(tmp_path.iterdir())
