"""Calibration mechanics, schedule files (round trip, bad input) and where a schedule comes
from (preset, user, calibrated)."""

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from mlx_lazy import LazyEngine, PruningConfig, UserInputError, load, read_schedule, resolve_config
from mlx_lazy import selection
from mlx_lazy.adapter import ModelAdapter
from mlx_lazy.bench import stats
from mlx_lazy.bench.calibrate import Calibration, candidates, main, run
from mlx_lazy.schedule_files import MODEL_SCHEDULE_FILE, write_schedule


def kept_positions(model, config, prompt):
    engine = LazyEngine(model, resolve_config(model, config))
    mx.eval(engine.prefill(prompt))
    return [engine.cache.layers[i].cached_positions().tolist() for i in range(len(model.layers))]


def tiny_calibration(path, out, **kw):
    # max_kld: random weights drift without bound, so the KLD bar admits any (see
    # test_the_kld_bars_choose_the_default_and_high_quality_schedules for the bars)
    opts = dict(model=str(path), out=str(out), tasks=("passkey",), lengths=(200,), rungs=(2, 3),
                keep_per_rung=(3,), pilot=2, kld_windows=1, kld_length=64, kld_steps=3,
                gain_length=512, measure=False, max_kld=1e9,
                scorers=("last", "window:size=4"))
    opts.update(kw)
    return run(Calibration(**opts))


@pytest.mark.slow  # a calibration end to end
def test_calibration_writes_a_schedule_that_reproduces_its_selections(tiny_model_path, tmp_path):
    # Random weights score 0 everywhere: with min_base 0 every candidate passes, which
    # exercises the whole pipeline; the choice is the highest predicted gain.
    doc = tiny_calibration(tiny_model_path, tmp_path / "cal", min_base=0.0)
    assert doc["complete"] and doc["chosen"]["default"]
    gains = [c["predicted_gain"] for c in doc["candidates"]]
    ev = doc["chosen"]["default"]
    assert ev["predicted_gain"] == max(gains) and gains == sorted(gains, reverse=True)
    # one window of prose and one of code, 3 steps each; both yardsticks on the same ones
    assert ev["samples_per_cell"] == 3 and (ev["kld"]["windows"], ev["kld"]["steps"]) == (2, 6)
    assert {k: v["steps"] for k, v in ev["yardsticks"].items()} == {"q8": 6, "q4": 6}
    assert ev["yardsticks"]["q4"]["kld_mean"] > ev["yardsticks"]["q8"]["kld_mean"] > 0
    assert set(ev["cells"]) == {"passkey@200"}
    sched = tmp_path / "cal" / "schedule.json"
    model, _ = load(tiny_model_path)
    loaded = read_schedule(sched, ModelAdapter(model).fingerprint())
    chosen = next(c for c in doc["candidates"] if c["name"] == ev["name"])
    direct = PruningConfig(**{k: tuple(v) if isinstance(v, list) else v
                              for k, v in chosen["config"].items()})
    prompt = mx.array(np.random.default_rng(0).integers(0, 300, 150).astype(np.int32))
    assert kept_positions(model, loaded, prompt) == kept_positions(model, direct, prompt)
    # Best gain first, in batches of 3 (keep_per_rung): every one is confirmed (nothing is
    # lost, the default bar admits any KLD), so the first is the default schedule; batches
    # went on until one was within the high bar, a quarter of the 4-bit yardstick's KLD.
    bar = doc["bars"]["high"]
    assert bar == pytest.approx(ev["yardsticks"]["q4"]["kld_mean"] / 4)
    ran = [c for c in doc["candidates"] if c["scores"]]
    assert ran == doc["candidates"][:len(ran)] and len(ran) % 3 == 0
    confirmed = [c for c in ran if c["rung"] == 1 and c["dropped_at"] is None]
    high = next(c for c in confirmed if c["kld"]["kld_mean"] <= bar)
    assert doc["chosen"]["high"]["name"] == high["name"] != ev["name"]
    assert all(c["kld"]["kld_mean"] > bar for c in confirmed[:confirmed.index(high)])
    assert len(ran) - confirmed.index(high) <= 3  # the batch that found it was the last
    high_file = read_schedule(tmp_path / "cal" / "schedule.high.json")
    assert high_file.prune_layers == tuple(high["config"]["prune_layers"])
    report = (tmp_path / "cal" / "report.md").read_text()
    assert report.count("| `lazy:") == len(ran) and "weights through 4 bits" in report
    # the work done, to time a calibration on another machine: every retrieval prompt run
    # (full's and each candidate's), every KLD window (full's reference, both yardsticks,
    # each candidate measured at the last rung)
    work = doc["work"]
    assert work["retrieval_prefills"] == (sum(map(len, doc["full"].values()))
                                          + sum(len(v) for c in ran for v in c["scores"].values()))
    assert 150 * work["retrieval_prefills"] < work["retrieval_prompt_tokens"] \
        <= 250 * work["retrieval_prefills"]  # passkey prompts of about 200 tokens
    assert work["kld_prefills"] == 2 * (1 + 2 + sum(c["kld"] is not None for c in ran))
    assert (work["kld_prompt_tokens"], work["kld_forced_steps"]) == (
        64 * work["kld_prefills"], 3 * work["kld_prefills"])
    assert work["gain_prompt_tokens"] == 0 and work["seconds"] > 0
    assert f"{work['retrieval_prompt_tokens'] + work['kld_prompt_tokens']:,} prompt tokens in all" \
        in report


def test_no_cell_the_full_path_can_do_is_bad_input(tiny_model_path, tmp_path):
    with pytest.raises(UserInputError, match="full scores < 80%"):
        tiny_calibration(tiny_model_path, tmp_path / "cal")


def test_an_error_found_before_any_output_leaves_no_empty_out_folder(tiny_model_path,
                                                                      tmp_path):
    """The folder made for the outputs goes again when the run stops before writing any
    (here: a length past the tiny model's context, found once the model is loaded)."""
    with pytest.raises(UserInputError, match="beyond the model's context"):
        tiny_calibration(tiny_model_path, tmp_path / "new" / "cal", lengths=(100_000,))
    assert not (tmp_path / "new" / "cal").exists()
    (tmp_path / "mine").mkdir()  # a folder the user made stays, even empty
    with pytest.raises(UserInputError, match="beyond the model's context"):
        tiny_calibration(tiny_model_path, tmp_path / "mine", lengths=(100_000,))
    assert (tmp_path / "mine").is_dir()


def fake_record(score, sample):
    """What the harness's ``run_one`` returns, as far as calibration reads it."""
    from types import SimpleNamespace

    return SimpleNamespace(score=score, ttft_s=0.01, tpot_s=None,
                           prompt_tokens=len(sample.tokens))


def fake_runs(monkeypatch, interrupt_at=None):
    """Replace the model runs of a calibration: every method answers every sample; the
    ``interrupt_at``-th run raises KeyboardInterrupt. Returns the (method, sample) runs."""

    from mlx_lazy.bench import calibrate

    runs = []

    def fake_run_one(model, tokenizer, method, sample):
        if len(runs) + 1 == interrupt_at:
            raise KeyboardInterrupt
        runs.append((method.name, sample.index))
        return fake_record(1.0, sample)

    monkeypatch.setattr(calibrate, "run_one", fake_run_one)
    return runs


@pytest.mark.slow  # a calibration end to end
def test_a_time_limit_mid_rung_reports_the_partial_rung_and_resume_completes_it(
        tiny_model_path, tmp_path, monkeypatch):
    import time
    from types import SimpleNamespace

    from mlx_lazy.bench import calibrate

    runs = fake_runs(monkeypatch)
    fake_deviation(monkeypatch)  # every KLD 0: the first confirmed is of both qualities
    # One clock tick per run: the pilot (2 runs of full), rung 0 (2 runs each of 3
    # candidates), then the best candidate's third sample (tick 9) at rung 1; full's third
    # (tick 10) is past the limit. The candidate then has more samples than full.
    clock = iter(range(100))
    monkeypatch.setattr(calibrate, "time", SimpleNamespace(
        monotonic=lambda: next(clock), strftime=time.strftime, perf_counter=time.perf_counter))
    doc = tiny_calibration(tiny_model_path, tmp_path / "cal", min_base=0.0, time_limit_s=9.5)
    assert doc["stopped"] == "time limit of 9.5 s" and not doc["complete"] and not doc["chosen"]
    best = doc["candidates"][0]
    assert len(best["scores"]["passkey@200"]) == 3 and len(doc["full"]["passkey@200"]) == 2
    report = (tmp_path / "cal" / "report.md").read_text()
    assert "Stopped early (time limit of 9.5 s)" in report
    assert f"| `{best['name']}` |" in report and report.count("| 2 (partial) |") == 1
    assert report.count("| 2 |") == 2  # the two other candidates finished rung 0
    assert hollow_markers(tmp_path / "cal", monkeypatch) == 1
    assert not (tmp_path / "cal" / "schedule.json").exists()

    runs.clear()
    again = tiny_calibration(tiny_model_path, tmp_path / "cal", min_base=0.0, resume=True)
    assert runs == [("full", 2)]  # only what the stop left unmeasured
    assert again["complete"] and again["stopped"] is None
    chosen = again["chosen"]["default"]
    assert chosen["name"] == best["name"] and chosen["samples_per_cell"] == 3
    assert "(partial)" not in (tmp_path / "cal" / "report.md").read_text()
    assert hollow_markers(tmp_path / "cal", monkeypatch) == 0


def hollow_markers(out, monkeypatch) -> int:
    """Candidates drawn hollow (partial) in the plot of the calibration in ``out``; the plot
    legend must say what hollow means."""
    from mlx_lazy.bench import plots
    from mlx_lazy.bench.calibration_results import used_cells

    assert (out / "pareto.png").is_file()
    monkeypatch.setattr(plots, "_save", lambda fig, path: fig)
    doc = json.loads((out / "results.json").read_text())
    ax = plots.plot_calibration(doc, used_cells(doc), out / "unused.png").axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    points = [c for c in ax.collections if c.get_label() in labels and len(c.get_offsets())]
    hollow = sum(int((c.get_facecolors()[:, 3] == 0).sum()) for c in points)
    assert (plots.PARTIAL_LABEL in labels) == (hollow > 0)
    return hollow


def test_ctrl_c_writes_what_was_measured_and_exits_130(tiny_model_path, tmp_path,
                                                       monkeypatch, capsys):
    fake_runs(monkeypatch, interrupt_at=2)  # in the pilot's second run of full
    out = tmp_path / "cal"
    assert main(["--model", str(tiny_model_path), "--out", str(out), "--tasks", "passkey",
                 "--lengths", "200", "--rungs", "2,50", "--pilot", "3", "--min-base", "0",
                 "--max-kld", "q8", "--no-measure", "--scorers", "last",
                 "--cuts", "0.5/0.2"]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == "interrupted"
    doc = json.loads((out / "results.json").read_text())
    assert doc["stopped"] == "interrupted" and doc["full"] == {"passkey@200": [1.0]}
    assert "| passkey@200 | 1 of 3 samples (partial) |" in (out / "report.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--lengths", "0"], "--lengths needs prompt lengths >= 1"),
    (["--lengths", "200,,300"], "expected comma-separated integers"),
    (["--pilot", "-3"], "--pilot must be in [1, 50]"),
    (["--pilot", "51"], "--pilot must be in [1, 50]"),
    (["--rungs", "50,4"], "--rungs needs increasing sample counts"),
    (["--time-limit", "-1"], "--time-limit must be a positive number"),
    (["--time-limit", "nan"], "--time-limit must be a positive number"),
    (["--keep-per-rung", "0"], "--keep-per-rung values must be >= 1"),
    (["--gain-length", "0"], "--gain-length must be >= 1"),
    (["--tasks", ""], "unknown task ''"),
    (["--time-limit", "30 minutes"], "--time-limit takes seconds or a duration"),
    (["--max-kld", "-1"], "--max-kld takes a non-negative number or q8 / q4"),
    (["--max-kld", "x"], "--max-kld takes a non-negative number or q8 / q4"),
    (["--max-kld", "inf"], "--max-kld takes a non-negative number"),
    (["--min-agreement", "0.9"], "unrecognized arguments: --min-agreement"),
    (["--kld-windows", "0"], "--kld-windows must be >= 1"),
    (["--kld-steps", "0"], "--kld-steps must be in"),
    (["--kld-length", "1"], "--kld-length must be in [2, 1,048,576]"),
    (["--kld-length", "99999999"], "--kld-length must be in [2, 1,048,576]"),
    (["--qualities", "best"], "expected default, high or both"),
    (["--out", ""], "--out is empty"),  # once a calibration writing into the current folder
])
def test_bad_options_are_one_error_line_before_any_work(tmp_path, monkeypatch, capsys, args,
                                                        message):
    from mlx_lazy.bench import calibrate

    monkeypatch.setattr(calibrate, "load", lambda *a: pytest.fail("loaded a model"))
    out = tmp_path / "cal"
    assert exit_status(main, ["--out", str(out), *args]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]
    assert not out.exists()


def test_the_kld_steps_default_to_a_whole_answer_and_reach_the_calibration(tmp_path,
                                                                             monkeypatch):
    from mlx_lazy.bench import calibrate

    seen = []

    def fake_run(cal):
        seen.append((cal.kld_steps, cal.kld_length))
        raise UserInputError("stop here")
    monkeypatch.setattr(calibrate, "run", fake_run)
    assert exit_status(main, ["--out", str(tmp_path / "a")]) == 2
    assert exit_status(main, ["--out", str(tmp_path / "b"), "--kld-steps", "7",
                              "--kld-length", "4096"]) == 2
    assert seen == [(128, 700), (7, 4096)]


@pytest.mark.parametrize("out, message", [
    (lambda tmp: tmp / "file", "exists and is not a folder"),
    (lambda tmp: "/proc/x", "cannot create --out /proc/x"),
    # an earlier calibration there, which a run without --resume replaced in silence
    (lambda tmp: tmp / "earlier", "holds an earlier calibration: pass --resume"),
])
def test_an_unusable_out_is_one_error_line(tmp_path, monkeypatch, capsys, out, message):
    from mlx_lazy.bench import calibrate

    monkeypatch.setattr(calibrate, "load", lambda *a: pytest.fail("loaded a model"))
    (tmp_path / "file").write_text("mine")
    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / "results.json").write_text('{"an": "hour of runs"}')
    assert main(["--out", str(out(tmp_path))]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]
    assert (tmp_path / "file").read_text() == "mine"
    assert (tmp_path / "earlier" / "results.json").read_text() == '{"an": "hour of runs"}'


@pytest.mark.parametrize("edit", [
    lambda doc: [1, 2],
    lambda doc: {**doc, "full": [1, 2]},
    lambda doc: {**doc, "candidates": [{"x": 1}]},
    lambda doc: {**doc, "candidates": [{**doc["candidates"][0], "scores": [0.5]}]},
])
def test_resume_of_a_malformed_results_file_is_one_error(tiny_model_path, tmp_path,
                                                         monkeypatch, edit):
    """A results.json edited by hand (a list, full's scores not by cell, a candidate without
    its config) failed half-way through reading it with an AttributeError or KeyError."""
    fake_runs(monkeypatch)
    fake_deviation(monkeypatch)
    tiny_calibration(tiny_model_path, tmp_path / "cal", min_base=0.0)
    path = tmp_path / "cal" / "results.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    with pytest.raises(UserInputError, match="is not a calibration's results"):
        tiny_calibration(tiny_model_path, tmp_path / "cal", min_base=0.0, resume=True)


def exit_status(main, argv):
    """``main``'s status, whether returned or raised by the argument parser."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def test_the_command_refuses_claims_on_few_samples(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--rungs", "4,16"]) == 2
    assert ">= 50 samples" in capsys.readouterr().err


@pytest.mark.parametrize("cuts, message", [
    ("0.5,0.4/0.2,0.1", "increasing depth fractions"), ("0.5/0.2,0.1", "one keep fraction"),
    ("0.5/2", "keep fractions must be in"), ("0.5", "depth fractions/keep fractions")])
def test_bad_cut_schedules_are_one_error(tmp_path, capsys, cuts, message):
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "cal"), "--cuts", cuts])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "cal").exists()


def test_cut_schedules_set_the_candidates(tiny_model):
    from mlx_lazy.bench.calibrate import parse_cuts

    grid = (parse_cuts("0.5/0.2"), parse_cuts("0.25,0.75/0.5,0.1"))
    model, _ = tiny_model()
    cands = candidates(model, 512, ["last"], grid)
    n = len(model.layers)
    assert {c.config.prune_layers for c in cands} == {
        (round(0.5 * n) - 1,), (round(0.25 * n) - 1, min(n - 2, round(0.75 * n) - 1))}


def test_cuts_of_a_sliding_window_model_go_after_global_layers(tiny_model):
    from mlx_lazy.bench.calibrate import at_global_layers, parse_cuts

    # tiny Gemma 3: layers 0 and 2 slide, 1 and 3 are global; 3 is the last, no cut after it
    model, _ = tiny_model("gemma3_text")
    grid = (parse_cuts("0.25/0.3"), parse_cuts("0.75/0.3"), parse_cuts("0.25,0.75/0.5,0.2"))
    assert {c.config.prune_layers for c in candidates(model, 512, ["last"], grid)} == {(1,)}
    # Gemma 3 270M's pattern: global layers 5, 11 and 17 of 18
    assert at_global_layers((3, 7, 8, 14), [5, 11]) == (5, 11)
    assert at_global_layers((8,), [5, 11]) == (5,)  # a tie goes to the lower layer
    assert at_global_layers((2, 9), list(range(17))) == (2, 9)  # no sliding layers
    assert at_global_layers((2, 9), []) == (2, 9)


def test_candidates_rank_by_predicted_gain(tiny_model):
    model, _ = tiny_model("llama")
    cands = candidates(model, 4096)
    gains = [c.predicted_gain for c in cands]
    assert gains == sorted(gains, reverse=True) and all(g > 1 for g in gains)
    assert len({c.name for c in cands}) == len(cands)


def test_paired_statistics():
    p = stats.paired([1, 1, 1, 1, 0, 1], [1, 0, 1, 1, 1, 1])
    assert (p.lost, p.won, p.n) == (1, 1, 6) and p.rel_loss == 0
    lo, hi = stats.wilson(45, 50)
    assert lo < 0.9 < hi and hi - lo < 0.2
    worse = stats.paired([1] * 50, [1] * 40 + [0] * 10)
    assert worse.rel_loss == pytest.approx(0.2) and worse.rel_loss_ci[0] > 0.05
    assert worse.lost_ci == stats.wilson(10, 50)
    # none lost of 50: the bootstrap collapses to zero, the lost fraction's bound does not
    same = stats.paired([1] * 50, [1] * 50)
    assert same.rel_loss_ci == (0.0, 0.0)
    assert same.lost_ci[1] == pytest.approx(0.07135, rel=1e-3)  # 0.071348
    # only the unpruned path's right answers can be lost
    assert stats.paired([1] * 10 + [0] * 40, [0] * 50).lost_ci == stats.wilson(10, 10)


# ------------------------------------------------------------------ schedule files


@pytest.fixture
def schedule_file(tiny_model, tmp_path):
    model, _ = tiny_model("llama")
    fp = ModelAdapter(model).fingerprint()
    config = PruningConfig("lazy", prune_layers=(0, 2), keep=(0.4, 0.2), scorer="window:size=4")
    return write_schedule(tmp_path / "s.json", config, fp, {"note": "test"}), fp


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: None, "does not exist"),
        (lambda d: "{not json", "not valid JSON"),
        (lambda d: dict(d, format="other"), "field 'format'"),
        (lambda d: dict(d, config=dict(d["config"], turbo=1)), "config.turbo"),
        (lambda d: dict(d, config=dict(d["config"], keep=[0.4, 1.5])), "keep fractions must be in"),
        (lambda d: dict(d, config=dict(d["config"], scorer="psychic")), "unknown scorer"),
        (lambda d: dict(d, model={"fingerprint": dict(d["model"]["fingerprint"], num_layers=24)}),
         "model.fingerprint.num_layers"),
        (lambda d: dict(d, quality="ultra"), "quality must be one of default, high, got 'ultra'"),
        (lambda d: dict(d, evidence=[1]), "evidence must be an object, got [1]"),
    ],
)
def test_bad_schedule_files_name_the_field(schedule_file, tmp_path, edit, message):
    path, fp = schedule_file
    doc = edit(json.loads(path.read_text()))
    bad = tmp_path / "bad.json"
    if doc is not None:
        bad.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(UserInputError) as err:
        read_schedule(bad, fp)
    assert message in str(err.value)


def test_a_schedule_is_written_only_where_a_file_can_be(schedule_file, tmp_path,
                                                         monkeypatch):
    """A FIFO or device there is refused, not replaced (as root, ``/dev/full`` once became a
    JSON file); so are a folder, a missing folder and names that are no file names (``None``
    was written as a file called ``None``)."""
    path, fp = schedule_file
    config = read_schedule(path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    monkeypatch.chdir(tmp_path)
    for target, message in [(fifo, "not a regular file"), (tmp_path, "is a folder"),
                            (tmp_path / "no" / "s.json", "does not exist"),
                            (None, "must be a file name"), (5, "must be a file name"),
                            (b"s.json", "must be a file name"), ("", "is empty")]:
        with pytest.raises(UserInputError, match=message):
            write_schedule(target, config, fp, {})
        with pytest.raises(UserInputError, match=message if target != tmp_path else "directory"):
            read_schedule(target)
    with pytest.raises(UserInputError, match="quality must be one of default, high"):
        write_schedule(tmp_path / "t.json", config, fp, {}, quality="bogus")  # unreadable
    assert fifo.is_fifo() and sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "s.json"]
    assert write_schedule(tmp_path / "t.json", config, fp, {}) == tmp_path / "t.json"


def test_packaged_schedules_apply_by_fingerprint(schedule_file, tiny_model, tmp_path,
                                                monkeypatch):
    from mlx_lazy import schedule_files as schedule

    path, _ = schedule_file  # calibrated for the tiny llama
    packaged = tmp_path / "packaged"
    packaged.mkdir()
    shutil.copy(path, packaged / "tiny.json")
    monkeypatch.setattr(schedule, "PACKAGED_SCHEDULES", packaged)
    schedule._packaged.cache_clear()
    try:
        llama = LazyEngine(tiny_model("llama")[0], resolve_config(
            tiny_model("llama")[0], PruningConfig("lazy"))).stats.schedule
        qwen = LazyEngine(tiny_model("qwen2")[0], resolve_config(
            tiny_model("qwen2")[0], PruningConfig("lazy"))).stats.schedule
    finally:
        schedule._packaged.cache_clear()
    assert (llama["source"], llama["prune_layers"], llama["scorer"]) == (
        "calibrated:tiny.json", [0, 2], "window:size=4")
    assert qwen["source"] == "preset"  # another fingerprint: the preset


def test_a_schedule_for_another_model_is_refused_by_the_engine(schedule_file, tiny_model):
    path, _ = schedule_file  # calibrated for the tiny llama
    config = read_schedule(path)  # read without a model
    LazyEngine(tiny_model("llama")[0], resolve_config(tiny_model("llama")[0], config))
    with pytest.raises(UserInputError, match="calibrated for another model"):
        LazyEngine(tiny_model("qwen2")[0], resolve_config(tiny_model("qwen2")[0], config))


def test_schedule_source_preset_user_and_calibrated_folder(tiny_model_path, schedule_file,
                                                           tmp_path):
    path, _ = schedule_file
    model, _ = load(tiny_model_path)
    preset = LazyEngine(model, resolve_config(model, PruningConfig("lazy")))
    assert preset.stats.schedule["source"] == "transfer"
    user = PruningConfig("lazy", prune_layers=(1,), keep=(0.5,))
    assert LazyEngine(model, resolve_config(model, user)).stats.schedule["source"] == "user"

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_path, folder)
    shutil.copy(path, folder / MODEL_SCHEDULE_FILE)
    model, _ = load(folder)
    engine = LazyEngine(model, resolve_config(model, PruningConfig("lazy", revive=False)))
    sched = engine.stats.schedule
    assert sched["source"] == f"calibrated:{MODEL_SCHEDULE_FILE}"
    assert (sched["prune_layers"], sched["scorer"]) == ([0, 2], "window:size=4")
    assert sched["revive"] is False  # the caller's own fields stay
    # An explicit schedule wins over the folder's.
    assert LazyEngine(model, resolve_config(model, user)).stats.schedule["prune_layers"] == [1]


def test_a_folder_schedule_must_be_a_lazy_one(tiny_model_path, tmp_path):
    """A model folder's schedule is what a plain ``--method lazy`` runs: one of another
    method ran that method (a random drop, for ``lazy``), and a file without a method ran
    ``full``."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_path, folder)
    model, _ = load(folder)
    fp = ModelAdapter(model).fingerprint()
    write_schedule(folder / MODEL_SCHEDULE_FILE, PruningConfig("random", keep=(0.5,)), fp, {})
    with pytest.raises(UserInputError, match="its method must be 'lazy', not 'random'"):
        load(folder)
    doc = json.loads((folder / MODEL_SCHEDULE_FILE).read_text())
    del doc["config"]["method"]
    (folder / MODEL_SCHEDULE_FILE).write_text(json.dumps(doc))
    with pytest.raises(UserInputError, match="lacks config.method"):
        load(folder)


def test_a_schedules_decode_step_applies_unless_the_config_names_its_own(tiny_model_path,
                                                                         tmp_path):
    """A plain ``lazy`` decodes as its schedule was calibrated (complete, max_revivals,
    revive_margin, reselect_every); each field a config names itself wins."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_path, folder)
    model, _ = load(folder)
    fp = ModelAdapter(model).fingerprint()
    calibrated = dict(complete="none", max_revivals=2, revive_margin=0.5, reselect_every=3)
    write_schedule(folder / MODEL_SCHEDULE_FILE, PruningConfig(
        "lazy", prune_layers=(0, 2), keep=(0.4, 0.2), scorer="window:size=4", **calibrated),
        fp, {"note": "test"})
    model, _ = load(folder)
    sched = LazyEngine(model, resolve_config(model, PruningConfig("lazy"))).stats.schedule
    assert {f: sched[f] for f in calibrated} == calibrated
    own = dict(complete="after-first", max_revivals=5, revive_margin=1.0, reselect_every=2)
    for field, value in own.items():
        config = PruningConfig("lazy", **{field: value})
        sched = LazyEngine(model, resolve_config(model, config)).stats.schedule
        assert {f: sched[f] for f in calibrated} == {**calibrated, field: value}, field


def test_cli_schedule_flag(tiny_model_path, schedule_file, tmp_path, capsys):
    from mlx_lazy.cli import main as cli

    path, _ = schedule_file
    stats_path = tmp_path / "stats.json"
    assert cli(["--model", str(tiny_model_path), "-p", "hello there", "-m", "3",
                "--schedule", str(path), "--stats-json", str(stats_path),
                "--verbose", "False"]) == 0
    assert json.loads(stats_path.read_text())["schedule"]["source"] == "calibrated:s.json"
    assert cli(["--model", str(tiny_model_path), "-p", "hi", "--schedule", str(path),
                "--keep", "0.5"]) == 2
    assert "drop --keep" in capsys.readouterr().err
    # The method is the file's: --method full once ran the file's lazy, reported as lazy.
    assert cli(["--model", str(tiny_model_path), "-p", "hi", "--schedule", str(path),
                "--method", "full"]) == 2
    assert f"--schedule {path} runs method 'lazy'; drop --method full" in capsys.readouterr().err
    # Its decode fields may be set, as on a plain lazy's calibrated schedule, and --anchors.
    assert cli(["--model", str(tiny_model_path), "-p", "hello there", "-m", "2",
                "--schedule", str(path), "--complete", "exact", "--anchors", "3",
                "--stats-json", str(stats_path), "--verbose", "False"]) == 0
    schedule = json.loads(stats_path.read_text())["schedule"]
    assert (schedule["complete"], schedule["anchors"]) == ("exact", 3)


def test_cli_schedule_of_random_drop_takes_the_seed(tiny_model_path, tmp_path):
    """--seed reached a random drop given by --method only; from a schedule file it was
    dropped (every run with seed 0)."""
    from mlx_lazy.cli import build_config, build_parser

    path = tmp_path / "random.json"
    write_schedule(path, PruningConfig("random", keep=(0.5,)), {"num_layers": 4}, {})
    args = build_parser().parse_args(["-p", "hi", "--schedule", str(path), "--seed", "7"])
    assert build_config(args).seed == 7


@pytest.mark.slow
def test_resume_reuses_every_measured_run(tiny_model_path, tmp_path, monkeypatch):
    first = tiny_calibration(tiny_model_path, tmp_path / "cal", min_base=0.0)
    # A resume with fewer scorers keeps the others' runs in results.json.
    fewer = tiny_calibration(tiny_model_path, tmp_path / "cal", min_base=0.0, resume=True,
                             scorers=("last",))
    ran = {c["name"] for c in first["candidates"] if c["scores"]}
    assert ran <= {c["name"] for c in fewer["candidates"] if c["scores"]}
    from mlx_lazy.bench import calibrate

    def no_new_runs(*a, **kw):
        raise AssertionError("a run was repeated")

    monkeypatch.setattr(calibrate, "run_one", no_new_runs)
    monkeypatch.setattr(calibrate.Deviation, "measure", no_new_runs)  # KLDs and yardsticks too
    again = tiny_calibration(tiny_model_path, tmp_path / "cal", min_base=0.0, resume=True)
    assert again["chosen"] == first["chosen"] | {
        q: dict(c, made=again["chosen"][q]["made"]) for q, c in first["chosen"].items()}
    # The evidence names every run it rests on, oldest first, with its options and work.
    assert [r["options"]["scorers"] for r in again["resumed"]] == [
        list(first["options"]["scorers"]), ["last"]]
    assert [r["work"] for r in again["resumed"]] == [first["work"], fewer["work"]]
    made = again["chosen"]["default"]["made"]
    assert made["resumed"] == [r["options"] for r in again["resumed"]]
    assert "resumed 2 earlier run(s)" in (tmp_path / "cal" / "report.md").read_text()
    with pytest.raises(UserInputError, match="another model, seed"):
        tiny_calibration(tiny_model_path, tmp_path / "cal", min_base=0.0, resume=True, seed=1)


def test_calibration_measures_the_schedules_fractions_under_the_library_floor(
        tiny_model_path, tmp_path, monkeypatch):
    """With the library's floor of 256 kept tokens, a cut of a 200-token prompt would keep
    it whole and every candidate would measure as ``full``; calibrate measures each cut at
    its fraction (``min_keep`` 0 in the evidence) and leaves the floor as it was. A resume
    of a run that does not say so measures its candidates again (full's runs are reused)."""
    monkeypatch.setattr(selection, "MIN_KEEP", selection.DEFAULT_MIN_KEEP)
    opts = dict(rungs=(3,), keep_per_rung=(1,), min_base=0.0, scorers=("last",),
                cuts=(((0.5,), (0.3,)),), qualities=("default",))
    doc = tiny_calibration(tiny_model_path, tmp_path / "cal", **opts)
    ev = doc["chosen"]["default"]
    assert ev["min_keep"] == 0 == doc["min_keep"]
    assert ev["kld"]["kld_mean"] > 1e-6  # unpruned, as under the floor: exactly 0
    assert selection.MIN_KEEP == selection.DEFAULT_MIN_KEEP
    results = tmp_path / "cal" / "results.json"
    saved = json.loads(results.read_text())
    del saved["min_keep"]  # as written before calibration measured without the floor
    for c in saved["candidates"]:
        del c["min_keep"]
    results.write_text(json.dumps(saved))
    from mlx_lazy.bench import calibrate
    ran = []
    run_one = calibrate.run_one

    def counted(model, tokenizer, method, sample):
        ran.append(method.name)
        return run_one(model, tokenizer, method, sample)

    monkeypatch.setattr(calibrate, "run_one", counted)
    # Another cut first: the old candidate stays in the results, marked as measured under
    # the floor, and a later resume that asks for it again measures it again.
    other = dict(opts, cuts=(((0.5,), (0.5,)),))
    tiny_calibration(tiny_model_path, tmp_path / "cal", resume=True, **other)
    saved = json.loads(results.read_text())
    assert saved["min_keep"] == 0
    assert [c["min_keep"] for c in saved["candidates"]] == [0, None]
    assert "measured under another keep floor" in (tmp_path / "cal" / "report.md").read_text()
    ran.clear()
    tiny_calibration(tiny_model_path, tmp_path / "cal", resume=True, **opts)
    assert ran and "full" not in ran
    assert [c["min_keep"] for c in json.loads(results.read_text())["candidates"]] == [0, 0]


@pytest.mark.slow
def test_candidates_decode_with_the_complete_mode_the_evidence_names(tiny_model_path, tmp_path,
                                                                   monkeypatch):
    """``complete`` is how every candidate decodes (its retrieval answers and KLD hold only
    for it): the evidence says which. A resume matches candidates by config, decode mode
    included, not by name (names omit a field at its default, so they change with it): one
    under another mode runs the candidates again (reusing the unpruned runs, which do not
    depend on it), one under the same mode reuses them whatever they were called."""
    from mlx_lazy.bench import calibrate

    other = "after-first" if calibrate.DEFAULT_COMPLETE != "after-first" else "exact"
    doc = tiny_calibration(tiny_model_path, tmp_path / "cal", min_base=0.0, complete=other)
    assert {c["config"]["complete"] for c in doc["candidates"]} == {other}
    assert {q: c["complete"] for q, c in doc["chosen"].items()} == {"default": other,
                                                                   "high": other}
    results = tmp_path / "cal" / "results.json"
    # names as the default mode's would be: a match by name would reuse these runs
    results.write_text(results.read_text().replace(f":complete={other}", ""))
    runs = []
    real = calibrate.run_one
    monkeypatch.setattr(calibrate, "run_one",
                        lambda model, tok, method, sample: runs.append(method.config)
                        or real(model, tok, method, sample))
    again = tiny_calibration(tiny_model_path, tmp_path / "cal", min_base=0.0, resume=True)
    assert runs and {c.method for c in runs} == {"lazy"}  # full's runs were reused
    assert {c.complete for c in runs} == {calibrate.DEFAULT_COMPLETE}
    assert again["chosen"]["default"]["complete"] == calibrate.DEFAULT_COMPLETE
    # renamed, the same configs are found again: nothing runs
    results.write_text(results.read_text().replace('"name": "lazy', '"name": "renamed-lazy'))
    runs.clear()
    tiny_calibration(tiny_model_path, tmp_path / "cal", min_base=0.0, resume=True)
    assert runs == []
    with pytest.raises(UserInputError, match="complete must be spelt 'progressive:8'"):
        tiny_calibration(tiny_model_path, tmp_path / "other", complete="progressive:08")


@pytest.mark.slow
def test_resume_of_a_results_file_from_the_agreement_bar(tiny_model_path, tmp_path,
                                                         monkeypatch):
    from mlx_lazy.bench import calibrate

    first = tiny_calibration(tiny_model_path, tmp_path / "cal", min_base=0.0)
    path = tmp_path / "cal" / "results.json"
    old = json.loads(path.read_text())  # as written before KLD replaced agreement
    for key in ("kld_windows", "kld_length", "kld_steps", "max_kld", "install"):
        del old["options"][key]
    old["options"].update(min_agreement=0.95, agreement_prompts=1, agreement_steps=3)
    for c in old["candidates"]:
        c["agreement"] = {"rate": 0.5} if c.pop("kld", None) else None
    for key in ("yardsticks", "bars", "kld_texts", "installed"):
        del old[key]
    old["chosen"] = None
    path.write_text(json.dumps(old))
    monkeypatch.setattr(calibrate, "run_one", lambda *a: pytest.fail("a run was repeated"))
    again = tiny_calibration(tiny_model_path, tmp_path / "cal", min_base=0.0, resume=True)
    assert {q: c["name"] for q, c in again["chosen"].items()} == {
        q: c["name"] for q, c in first["chosen"].items()}
    assert again["chosen"]["default"]["kld"] == first["chosen"]["default"]["kld"]
    assert "agreement" not in json.dumps(again["candidates"])


@pytest.mark.slow
def test_every_last_rung_candidate_has_its_gain_measured(tiny_model_path, tmp_path, monkeypatch):

    from mlx_lazy.bench import calibrate
    from mlx_lazy.bench.plots import main as plots_main

    calls: dict[str, int] = {}

    def fake_run_one(model, tokenizer, method, sample):
        # full answers all; the best-gain candidate loses its third answer (dropped at the
        # last rung), every other candidate answers all
        calls[method.name] = calls.get(method.name, 0) + 1
        victim = next((n for n in calls if n != "full"), None)
        return fake_record(float(method.name != victim or calls[method.name] < 3), sample)

    timed = []

    def fake_measure(model, tokenizer, config, n_tokens, repeats=1, answer_tokens=1):
        timed.append(config)
        return {"prompt_tokens": n_tokens, "full_s": [2.0], "pruned_s": [1.0],
                "gain": 2.0 + len(timed), "first_token_gain": 2.5}

    monkeypatch.setattr(calibrate, "run_one", fake_run_one)
    monkeypatch.setattr(calibrate, "measure_gain", fake_measure)
    fake_deviation(monkeypatch)  # every KLD 0: the first confirmed is of both qualities
    opts = dict(min_base=0.5, measure=True, keep_per_rung=(2,))
    doc = tiny_calibration(tiny_model_path, tmp_path / "cal", **opts)
    final = [c for c in doc["candidates"] if min(map(len, c["scores"].values()), default=0) == 3]
    # both candidates that reached the last rung are measured, the dropped one too
    assert [c["dropped_at"] for c in final] == [1, None]
    assert [c["measured_gain"]["gain"] for c in final] == [3.0, 4.0] and len(timed) == 2
    assert doc["chosen"]["default"]["name"] == final[1]["name"]
    assert doc["chosen"]["default"]["measured_gain"]["gain"] == 4.0
    report = (tmp_path / "cal" / "report.md").read_text()
    assert "| 3.00x |" in report and "| 4.00x |" in report
    # a resume measures nothing again
    tiny_calibration(tiny_model_path, tmp_path / "cal", resume=True, **opts)
    assert len(timed) == 2
    png = tmp_path / "front.png"
    assert plots_main([str(tmp_path / "cal"), str(tmp_path / "cal"), "--out", str(png)]) == 0
    assert png.stat().st_size > 10_000
    with pytest.raises(SystemExit):
        plots_main([str(tmp_path), "--out", str(png)])


@pytest.mark.slow  # a calibration end to end
def test_a_schedule_measured_slower_than_full_is_written_but_not_installed(
        tiny_model_path, tmp_path, monkeypatch, packaged):
    from mlx_lazy.bench import calibrate

    monkeypatch.setenv("MLX_LAZY_CACHE", str(tmp_path / "cache"))
    fake_runs(monkeypatch)
    fake_deviation(monkeypatch)
    gains = iter([0.8, 1.3])

    def fake_measure(model, tokenizer, config, n_tokens, repeats=1, answer_tokens=1):
        return {"prompt_tokens": n_tokens, "full_s": [1.0], "pruned_s": [1.0],
                "gain": next(gains), "first_token_gain": 1.5}

    monkeypatch.setattr(calibrate, "measure_gain", fake_measure)
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_path, folder)
    opts = dict(min_base=0.0, measure=True, keep_per_rung=(1,), install=True,
                scorers=("last",))
    doc = tiny_calibration(folder, tmp_path / "cal", **opts)
    picked = doc["chosen"]["default"]
    assert picked["measured_gain"]["gain"] == 0.8 and doc["installed"] == {}
    assert "0.80x full's (slower): not installed" in picked["not_installed"]
    assert (tmp_path / "cal" / "schedule.json").exists()
    assert not (folder / MODEL_SCHEDULE_FILE).exists()
    assert "not installed" in (tmp_path / "cal" / "report.md").read_text()
    # measured faster on a second calibration: installed where load finds it
    doc = tiny_calibration(folder, tmp_path / "cal2", **opts)
    assert "not_installed" not in doc["chosen"]["default"]
    assert doc["installed"]["default"] == str(folder / MODEL_SCHEDULE_FILE)
    assert (folder / MODEL_SCHEDULE_FILE).exists()


@pytest.mark.slow  # a calibration end to end
def test_when_the_last_rung_confirms_none_the_next_batch_is_tried(tiny_model_path, tmp_path,
                                                                     monkeypatch):

    from mlx_lazy.bench import calibrate

    calls: dict[str, int] = {}

    def fake_run_one(model, tokenizer, method, sample):
        # full answers all; the first two candidates (rung 0's first batch with
        # keep_per_rung 2) lose their third answer, every later one answers all
        calls[method.name] = calls.get(method.name, 0) + 1
        batch = [n for n in calls if n != "full"][:2]
        return fake_record(float(method.name not in batch or calls[method.name] < 3), sample)

    monkeypatch.setattr(calibrate, "run_one", fake_run_one)
    fake_deviation(monkeypatch)  # every KLD 0: the first confirmed is of both qualities
    doc = tiny_calibration(tiny_model_path, tmp_path / "cal", min_base=0.5, keep_per_rung=(2,))
    names = [c["name"] for c in doc["candidates"]]
    assert doc["complete"] and doc["chosen"]["default"]["name"] == names[2]
    assert [c["dropped_at"] for c in doc["candidates"][:3]] == [1, 1, None]
    assert not any(c["scores"] for c in doc["candidates"][4:])  # batch 2 stopped at its 2nd


def fake_deviation(monkeypatch, klds=(), rest=0.0):
    """Replace KLD measurements: the 8- and 4-bit yardsticks measure 0.02 and 0.4; the
    i-th candidate configuration measured measures ``klds[i]``, later ones ``rest``."""
    from mlx_lazy.bench import calibrate

    seen: list = []

    def measure(self, config, model=None, row="candidate"):
        if config is None:  # a yardstick: round_weights below returned its bits
            return {"kld_mean": {8: 0.02, 4: 0.4}[model], "kld_mean_ci": (0, 1), "steps": 1}
        seen.append(config)
        i = len(seen) - 1
        return {"kld_mean": klds[i] if i < len(klds) else rest, "kld_mean_ci": (0, 1),
                "steps": 1}

    monkeypatch.setattr(calibrate.Deviation, "measure", measure)
    monkeypatch.setattr(calibrate.yardstick, "round_weights", lambda model, bits: bits)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("max_kld, default, high", [
    ("q4", 1, 2),     # 0.5 > q4's 0.4: dropped; 0.2 <= 0.4; 0.05 <= 0.4 / 4
    (0.3, 1, 2),      # a number as the bar
    (0.6, 0, 2),      # a looser bar than q4: the high one still keeps to a quarter of q4's
    ("q8", None, None),  # 0.05 > q8's 0.02: none admissible (and then none of high quality)
])
def test_the_kld_bars_choose_the_default_and_high_quality_schedules(
        tiny_model_path, tmp_path, monkeypatch, max_kld, default, high):
    seen = fake_deviation(monkeypatch, [0.5, 0.2, 0.05], rest=0.3)
    doc = tiny_calibration(tiny_model_path, tmp_path / "cal", min_base=0.0, max_kld=max_kld)
    names = [c["name"] for c in doc["candidates"]]
    chosen = {q: names.index(c["name"]) for q, c in doc["chosen"].items()}
    assert chosen == {q: i for q, i in (("default", default), ("high", high)) if i is not None}
    bar = {"q4": 0.4, "q8": 0.02}.get(max_kld, max_kld)
    assert doc["bars"] == {"default": bar, "high": min(bar, 0.1)}
    assert [c["dropped_at"] for c in doc["candidates"][:3]] == [
        None if k <= bar else 1 for k in (0.5, 0.2, 0.05)]
    for quality, name in (("default", "schedule.json"), ("high", "schedule.high.json")):
        path = tmp_path / "cal" / name
        assert path.is_file() == (quality in chosen)
        if quality in chosen:
            saved = json.loads(path.read_text())
            assert saved["quality"] == saved["evidence"]["quality"] == quality
            assert saved["evidence"]["kld_bar"] == doc["bars"][quality]
            assert saved["evidence"]["yardsticks"]["q4"]["kld_mean"] == 0.4
    if high is not None:  # the high one ends the search: nothing after it was measured
        assert len(seen) == high + 1


@pytest.mark.slow
def test_a_calibration_seeking_the_default_alone_stops_at_it(tiny_model_path, tmp_path,
                                                             monkeypatch):
    # KLDs 0.5 (dropped), 0.2 (default quality), 0.05 (high): seeking both measures all
    # three (test above); seeking the default alone stops after the second
    seen = fake_deviation(monkeypatch, [0.5, 0.2, 0.05], rest=0.3)
    doc = tiny_calibration(tiny_model_path, tmp_path / "cal", min_base=0.0, max_kld="q4",
                           qualities=("default",))
    names = [c["name"] for c in doc["candidates"]]
    assert {q: names.index(c["name"]) for q, c in doc["chosen"].items()} == {"default": 1}
    assert len(seen) == 2 and doc["complete"]
    assert not (tmp_path / "cal" / "schedule.high.json").exists()
    report = (tmp_path / "cal" / "report.md").read_text()
    assert "Chosen, default quality: `" in report and "Chosen, high quality" not in report


def test_kld_windows_are_timed_apart_by_how_their_rows_run(tiny_model, monkeypatch):
    # full's references and candidates decode step by step; the yardsticks are one forward
    # pass per window: the ETA scales each kind of row by its own seconds per window.
    from mlx_lazy.bench import calibrate as cal_mod

    model, tokenizer = tiny_model("llama")
    slow = {"stepped": 5.0, "forward": 1.0}
    now = {"t": 0.0}

    def fake_counter():  # each window of a row takes that row kind's seconds
        return now["t"]

    real_runs = cal_mod.Deviation._runs

    def timed_runs(self, row, windows, one):
        how = "forward" if row in cal_mod.YARDSTICKS else "stepped"

        def one_timed(window):
            out = one(window)
            now["t"] += slow[how]
            return out
        return real_runs(self, row, windows, one_timed)

    monkeypatch.setattr(cal_mod, "time", SimpleNamespace(perf_counter=fake_counter))
    monkeypatch.setattr(cal_mod.Deviation, "_runs", timed_runs)
    dev = cal_mod.Deviation(model, tokenizer, windows=1, length=48, steps=2)
    assert dev.rows_left() == {"stepped": 1, "forward": 2}
    assert dev.window_s("stepped") is None and dev.window_s("forward") is None
    dev.bars(1e9)  # full's references first, then both yardsticks
    assert dev.rows_left() == {"stepped": 0, "forward": 0}
    assert dev.window_s("stepped") == 5.0 and dev.window_s("forward") == 1.0
    assert dev.prefills == 3 * 2  # three rows, a window of each kind of text


def test_measured_gain_is_the_median_of_its_paired_repeats(tiny_model, monkeypatch):
    from mlx_lazy.bench import calibrate

    model, tokenizer = tiny_model("llama")
    # full 4, 6, 2 s; pruned 1, 2, 3 s: paired ratios 4, 3, 2/3 (median 3), unlike the ratio
    # of the medians (2) or of the means (2)
    clock = iter([0, 4, 10, 11, 20, 26, 30, 32, 40, 42, 50, 53])
    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: next(clock))
    config = PruningConfig("lazy", prune_layers=(1,), keep=(0.5,))
    got = calibrate.measure_gain(model, tokenizer, config, 64, repeats=3)
    assert got["full_s"] == [4, 6, 2] and got["pruned_s"] == [1, 2, 3]
    assert got["gain"] == got["first_token_gain"] == 3.0
    assert "loadavg_1min" in got


def test_measured_gain_is_the_whole_answers_with_the_first_tokens_beside_it(tiny_model,
                                                                           monkeypatch):
    """With an answer of 3 tokens the gain times the third token's arrival, and the first
    token's gain stands beside it, each the median of its own paired ratios: repeat 1 full
    2 s / 12 s (first / third token), pruned 1 s / 6 s; repeat 2 full 1 s / 10 s, pruned
    4 s / 8 s."""
    from mlx_lazy.bench import calibrate

    model, tokenizer = tiny_model("llama")
    # per run: tic, then each of the 3 tokens
    clock = iter([0, 2, 5, 12, 20, 21, 23, 26, 30, 31, 35, 40, 50, 54, 56, 58])
    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: next(clock))
    config = PruningConfig("lazy", prune_layers=(1,), keep=(0.5,))
    got = calibrate.measure_gain(model, tokenizer, config, 64, repeats=2, answer_tokens=3)
    assert got["first_token_full_s"] == [2, 1] and got["first_token_pruned_s"] == [1, 4]
    assert got["full_s"] == [12, 10] and got["pruned_s"] == [6, 8]
    assert got["gain"] == pytest.approx((2 + 1.25) / 2)
    assert got["first_token_gain"] == pytest.approx((2 + 0.25) / 2)
    assert got["answer_tokens"] == 3


@pytest.fixture
def packaged(monkeypatch, tmp_path):
    """An empty packaged-schedules folder in place of the package's (read afresh)."""
    from mlx_lazy import schedule_files as schedule

    folder = tmp_path / "packaged"
    folder.mkdir()
    monkeypatch.setattr(schedule, "PACKAGED_SCHEDULES", folder)
    schedule._packaged.cache_clear()
    yield folder
    schedule._packaged.cache_clear()


def lazy_schedule(model, **fields):
    return LazyEngine(model, resolve_config(model, PruningConfig("lazy", **fields))).stats.schedule


def test_a_corrupt_packaged_schedule_leaves_the_preset_with_one_warning(
        packaged, schedule_file, tiny_model):
    import warnings

    path, _ = schedule_file  # calibrated for the tiny llama
    shutil.copy(path, packaged / "tiny.json")
    corrupt = json.loads(path.read_text())
    corrupt["config"]["keep"] = [0.4, 1.5]
    (packaged / "other.json").write_text(json.dumps(corrupt))
    (packaged / "torn.json").write_text('{"format": "mlx-lazy-sched')
    llama, qwen = tiny_model("llama")[0], tiny_model("qwen2")[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert lazy_schedule(qwen)["source"] == "preset"
        assert lazy_schedule(llama)["source"] == "calibrated:tiny.json"  # the sound one
        assert lazy_schedule(qwen)["source"] == "preset"
    # once each, naming the file
    assert sorted(str(w.message).split(": ")[0].rsplit("/", 1)[-1] for w in caught) == [
        "other.json", "torn.json"]
    assert all(str(w.message).startswith(f"ignoring the packaged schedule {packaged}/")
               for w in caught)


def test_quality_high_takes_the_high_schedule_or_says_why_not(packaged, schedule_file,
                                                             tiny_model):
    from mlx_lazy.schedule_files import write_schedule

    path, fp = schedule_file
    shutil.copy(path, packaged / "tiny.json")
    strict = PruningConfig("lazy", prune_layers=(2,), keep=(0.5,))
    write_schedule(packaged / "tiny.high.json", strict, fp, {}, quality="high")
    llama, qwen = tiny_model("llama")[0], tiny_model("qwen2")[0]
    high = lazy_schedule(llama, quality="high", revive=False)
    assert (high["source"], high["prune_layers"], high["keep"]) == (
        "calibrated:tiny.high.json", [2], [0.5])
    assert high["revive"] is False  # the caller's own fields stay
    assert lazy_schedule(llama)["source"] == "calibrated:tiny.json"
    with pytest.raises(UserInputError, match="no quality='high' schedule is calibrated"):
        lazy_schedule(qwen, quality="high")
    with pytest.raises(UserInputError, match="takes a plain method 'lazy'"):
        lazy_schedule(llama, quality="high", keep=(0.5,))
    with pytest.raises(UserInputError, match="quality must be one of default, high"):
        PruningConfig("lazy", quality="best")


def test_cli_quality_flag(packaged, schedule_file, tiny_model_path, tmp_path, capsys):
    from mlx_lazy.cli import main as cli
    from mlx_lazy.schedule_files import write_schedule

    path, fp = schedule_file
    write_schedule(packaged / "tiny.high.json", read_schedule(path), fp, {},
                   quality="high")
    stats_path = tmp_path / "stats.json"
    assert cli(["--model", str(tiny_model_path), "-p", "hello there", "-m", "2", "--method",
                "lazy", "--quality", "high", "--stats-json", str(stats_path),
                "--verbose", "False"]) == 0
    assert json.loads(stats_path.read_text())["schedule"]["source"] == "calibrated:tiny.high.json"
    capsys.readouterr()
    assert exit_status(cli, ["--model", str(tiny_model_path), "-p", "hi", "--method", "lazy",
                             "--quality", "best"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "--quality" in err[0]


@pytest.mark.slow
def test_own_model_calibration_installs_where_load_finds_it(tiny_model_path, tmp_path,
                                                            monkeypatch, packaged, capsys):
    from mlx_lazy.bench import calibrate
    from mlx_lazy.schedule_files import cached_schedule_path

    monkeypatch.setenv("MLX_LAZY_CACHE", str(tmp_path / "cache"))
    fake_runs(monkeypatch)  # every method answers every sample
    fake_deviation(monkeypatch, [0.2], rest=0.05)  # the first is the default, the second high
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_path, folder)
    argv = ["--model", str(folder), "--time-limit", "30m", "--tasks", "passkey", "--lengths",
            "200", "--rungs", "2,50", "--pilot", "2", "--no-measure", "--scorers", "last"]
    assert main(argv) == 0
    model, _ = load(folder)
    assert lazy_schedule(model)["source"] == f"calibrated:{MODEL_SCHEDULE_FILE}"
    high = lazy_schedule(model, quality="high")
    assert high["source"] == "calibrated:mlx_lazy_schedule.high.json"
    fp = ModelAdapter(model).fingerprint()
    work = tmp_path / "cache" / "calibration"
    assert [p.name for p in work.iterdir()] == [calibrate.fingerprint_digest(fp)]
    assert not cached_schedule_path(fp).exists()

    # a folder it cannot write (as root, os.access stands in for the mode): the cache
    real_access = os.access
    monkeypatch.setattr(calibrate.os, "access",
                        lambda p, mode: Path(p) != folder and real_access(p, mode))
    for name in ("mlx_lazy_schedule.json", "mlx_lazy_schedule.high.json"):
        (folder / name).unlink()
    assert main(argv + ["--resume"]) == 0
    assert {p.name for p in cached_schedule_path(fp).parent.iterdir()} == {
        f"{calibrate.fingerprint_digest(fp)}.json", f"{calibrate.fingerprint_digest(fp)}.high.json"}
    model, _ = load(folder)
    assert lazy_schedule(model)["source"] == f"calibrated:{cached_schedule_path(fp).name}"
    # another model of the same shapes does not take it (the weights digest differs)
    other = load(folder)[0]
    other.model.norm.weight = other.model.norm.weight * 2
    assert lazy_schedule(other)["source"] == "preset"
    assert calibrate.parse_duration("2h") == 7200 and calibrate.parse_duration("90") == 90
    assert calibrate.parse_duration("1.5m") == 90


def test_packaged_schedules_meet_the_admissibility_rule():
    """Every shipped schedule file reads, names its model by fingerprint (weights digest
    included) and carries evidence that meets calibrate's rule: ≥ 50 paired samples per cell,
    relative retrieval loss ≤ max_loss, mean KLD ≤ its bar ≤ the 4-bit yardstick's on the
    same windows (a quarter of it for high quality), a predicted and a measured gain, all
    measured decoding as a plain ``lazy`` does with it (the mode the file names, else the
    default ``complete``), its KLD along a whole 128-token answer unless it decodes ``exact``;
    a default schedule's measured gain is a whole answer's of ≥ 128 tokens, timed with the
    file's own configuration."""
    from mlx_lazy.bench.calibrate import HIGH_FRACTION
    from mlx_lazy.bench.methods import parse_method
    from mlx_lazy.completion import DEFAULT_COMPLETE
    from mlx_lazy.schedule_files import PACKAGED_SCHEDULES

    fields = ("method", "prune_layers", "keep", "scorer", "complete", "max_revivals",
              "revive_margin", "reselect_every")

    files = sorted(PACKAGED_SCHEDULES.glob("*.json"))
    assert [f.name for f in files] == ["gemma3-270m.json", "qwen2.5-coder-0.5b.high.json",
                                       "qwen2.5-coder-0.5b.json", "smollm2-135m.high.json",
                                       "smollm2-135m.json"]
    for path in files:
        config = read_schedule(path)
        doc = json.loads(path.read_text())
        ev, q4 = doc["evidence"], doc["evidence"]["yardsticks"]["q4"]["kld_mean"]
        assert doc["quality"] == ev["quality"] and len(dict(config.fingerprint)["weights"]) == 16
        assert ev["samples_per_cell"] >= 50
        assert ev["complete"] == (config.complete or DEFAULT_COMPLETE)
        assert ev.get("max_revivals") == config.max_revivals
        assert ev.get("revive_margin") == config.revive_margin
        assert ev.get("reselect_every") == config.reselect_every
        assert all(c["n"] >= 50 for c in ev["cells"].values())
        assert ev["pooled"]["rel_loss"] <= ev["max_loss"] <= 0.01
        bar = q4 * (HIGH_FRACTION if doc["quality"] == "high" else 1)
        assert ev["kld"]["kld_mean"] <= ev["kld_bar"] <= bar
        assert ev["kld"]["windows"] == ev["yardsticks"]["q4"]["windows"]
        assert ev["kld"]["steps"] == ev["yardsticks"]["q4"]["steps"]
        # Drift over the whole answer: a pruned state's grows along it (Qwen's passed over 32
        # steps, not over 128). `exact` decodes on the completed, unpruned state, so only its
        # first token drifts (later steps only to rounding) and a shorter run's mean bounds a
        # longer one's.
        if ev["complete"] != "exact":
            assert ev["kld"]["steps"] // ev["kld"]["windows"] >= 128, path.name
        assert ev["predicted_gain"] > 1 and ev["measured_gain"]["gain"] > 1
        if doc["quality"] == "default":  # the gain a plain `lazy` brings: this schedule's
            gain = ev["measured_gain"]
            timed = parse_method(gain["path"]).config
            assert gain["answer_tokens"] >= 128 and gain["path"] in gain["by"], path.name
            assert {f: getattr(timed, f) for f in fields} == {
                f: getattr(config, f) for f in fields}, path.name
        assert ev["made"]["by"] == "python -m mlx_lazy.calibrate" and ev["made"]["date"]
        assert ev["made"]["options"]["max_kld"] == ev["max_kld"]


def test_a_quantized_model_is_refused_before_any_run(tiny_model_4bit, tmp_path, monkeypatch,
                                                     capsys):
    """Its yardsticks, and with them the KLD bars, would be 0 (rounding quantized layers
    changes nothing) and nothing could be admitted after an hour of runs: refused in one
    line, exit status 2, right after the model loads."""
    from mlx_lazy.bench import calibrate

    model, tokenizer = tiny_model_4bit("llama")

    def no_samples(*a, **k):
        raise AssertionError("prompts were built")

    monkeypatch.setattr(calibrate, "load", lambda *a, **k: (model, tokenizer))
    monkeypatch.setattr(calibrate, "build_samples", no_samples)
    assert main(["--model", "a-4-bit-copy", "--out", str(tmp_path / "cal")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already quantized (q4g32 layers)" in err


def test_lengths_beyond_any_context_are_refused_at_once(tiny_model_path, tmp_path, monkeypatch,
                                                        capsys):
    """``--lengths 99999999`` once built its prompts for minutes before anything was said:
    beyond MAX_LENGTH it is refused before the model loads, beyond the model's context (the
    tiny model's is 4,096) right after, before any prompt is built."""
    import time

    from mlx_lazy.bench import calibrate

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    with monkeypatch.context() as m:
        m.setattr(calibrate, "load", no_load)
        with pytest.raises(UserInputError, match="at most 1,048,576 tokens, got 99,999,999"):
            run(Calibration(model=str(tiny_model_path), lengths=(200, 99999999)))
        assert main(["--model", str(tiny_model_path), "--lengths", "99999999",
                     "--out", str(tmp_path / "cal")]) == 2
        assert "at most 1,048,576" in capsys.readouterr().err

    def no_samples(*a, **k):
        raise AssertionError("prompts were built")

    monkeypatch.setattr(calibrate, "build_samples", no_samples)
    start = time.monotonic()
    with pytest.raises(UserInputError, match="--lengths 5,000 is beyond the model's context "
                                             "of 4,096 tokens"):
        tiny_calibration(tiny_model_path, tmp_path / "cal", lengths=(200, 5000))
    # a KLD window and its continuation must fit the context too
    with pytest.raises(UserInputError, match="--kld-length 4,000 and --kld-steps 128 are "
                                             "beyond the model's context of 4,096 tokens"):
        tiny_calibration(tiny_model_path, tmp_path / "cal", kld_length=4000, kld_steps=128)
    # so must the measured gain's prompt and answer (the default 4,096 + 128 once failed at
    # the end, after every rung); not measuring, nothing is timed
    with pytest.raises(UserInputError, match="--gain-length 4,096 and --gain-answer-tokens 128 "
                                             "are beyond the model's context of 4,096 tokens"):
        tiny_calibration(tiny_model_path, tmp_path / "cal", gain_length=4096, measure=True)
    with pytest.raises(AssertionError, match="prompts were built"):
        tiny_calibration(tiny_model_path, tmp_path / "cal", gain_length=4096, measure=False)
    assert time.monotonic() - start < 30


@pytest.mark.slow  # a calibration end to end
def test_candidates_decode_with_the_revival_bound_the_evidence_names(tiny_model_path, tmp_path):
    """``--max-revivals`` bounds every candidate's decode steps; the chosen schedule and its
    evidence name the bound, so a plain ``lazy`` decodes as it was measured. A bound out of
    range is refused before anything runs."""
    doc = tiny_calibration(tiny_model_path, tmp_path / "cal", min_base=0.0, complete="none",
                           max_revivals=0)
    assert {c["config"]["max_revivals"] for c in doc["candidates"]} == {0}
    assert doc["chosen"]["default"]["max_revivals"] == 0
    saved = json.loads((tmp_path / "cal" / "schedule.json").read_text())
    assert saved["config"]["max_revivals"] == 0 and saved["evidence"]["max_revivals"] == 0
    model, _ = load(tiny_model_path)
    assert read_schedule(tmp_path / "cal" / "schedule.json",
                         ModelAdapter(model).fingerprint()).max_revivals == 0
    with pytest.raises(UserInputError, match="--max-revivals must be an integer"):
        tiny_calibration(tiny_model_path, tmp_path / "bad", max_revivals=-1)
