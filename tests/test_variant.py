"""``python -m mlx_lazy.bench.variant``: a schedule's evidence replayed on a copy of its model."""

import json
import shutil
from types import SimpleNamespace

import mlx.core as mx
import mlx.utils
import pytest

from mlx_lazy import load, read_schedule, selection
from mlx_lazy.bench import variant, yardstick
from mlx_lazy.bench.calibrate import Calibration, run
from mlx_lazy.bench.methods import method_spec
from mlx_lazy.bench.tasks import build_samples


@pytest.fixture(scope="module")
def calibrated(tiny_model_path, tmp_path_factory):
    """A schedule file written by a small calibration of the tiny llama (random weights score
    0 everywhere, so with min_base 0 its one candidate passes; the KLD bar admits any)."""
    out = tmp_path_factory.mktemp("cal")
    run(Calibration(model=str(tiny_model_path), out=str(out), tasks=("passkey",),
                    lengths=(200,), rungs=(3,), pilot=2, min_base=0.0, kld_windows=1,
                    kld_length=64, kld_steps=3, measure=False, max_kld=1e9, seed=5,
                    scorers=("last",), cuts=(((0.5,), (0.5,)),), qualities=("default",)))
    return out / "schedule.json"


@pytest.fixture
def schedule(calibrated, tmp_path):
    """A fresh copy of the calibrated schedule file, to record into or edit."""
    return shutil.copy(calibrated, tmp_path / "schedule.json")


def test_a_rounded_copy_replays_the_evidence_and_is_recorded(tiny_model_path, schedule,
                                                             tmp_path, monkeypatch, capsys):
    """The copy runs the file's own samples (task, length, seed, count) with the file's own
    schedule against its own full, on weights rounded through 4 bits; both bars hold, so the
    copy is recorded in the file, which still loads."""
    seen = {"samples": [], "methods": set()}
    run_one, check = variant.run_one, variant.check

    def spy_run_one(model, tokenizer, method, sample):
        seen["samples"].append(sample.tokens)
        seen["methods"].add(method.name)
        return run_one(model, tokenizer, method, sample)

    def spy_check(model, *a, **k):
        seen["model"] = model
        return check(model, *a, **k)

    monkeypatch.setattr(variant, "run_one", spy_run_one)
    monkeypatch.setattr(variant, "check", spy_check)
    out = tmp_path / "result.json"
    assert variant.main(["--model", str(tiny_model_path), "--schedule", str(schedule),
                         "--round", "4", "--group-size", "32", "--record",
                         "--out", str(out)]) == 0
    model, tokenizer = load(tiny_model_path)
    config = read_schedule(schedule)
    expected = [s.tokens for s in build_samples(tokenizer, "passkey", 200, 3, seed=5)]
    assert seen["samples"] == [t for t in expected for _ in range(2)]  # full's, then its own
    assert seen["methods"] == {"full", method_spec(config)}
    rounded = dict(mlx.utils.tree_flatten(yardstick.round_weights(model, 4, 32).parameters()))
    checked = dict(mlx.utils.tree_flatten(seen["model"].parameters()))
    assert all(mx.array_equal(checked[k], w).item() for k, w in rounded.items())
    result = json.loads(out.read_text())
    assert result["variant"] == "float32+q4g32" and result["same_windows"]
    assert result["weak_cells"] == []  # the calibration's cell bar was 0
    assert result["pooled"]["n"] == 3 and set(result["cells"]) == {"passkey@200"}
    assert (result["kld"]["windows"], result["kld"]["steps"]) == (2, 6)
    assert result["kld"]["kld_mean"] > 0  # the rounded copy's own full is the reference
    entries = json.loads(schedule.read_text())["model"]["variants"]
    entry = next(e for e in entries if e["variant"] == "float32+q4g32")
    assert entry["checked"] == ["identity", "retrieval", "kld"]
    assert "3 paired" in entry["how"] and f"{result['kld']['kld_mean']:.4f}" in entry["how"]
    assert read_schedule(schedule).prune_layers == config.prune_layers
    assert "recorded float32+q4g32" in capsys.readouterr().out


def test_a_replay_measures_each_cut_at_its_fraction_under_the_library_floor(
        tiny_model_path, schedule, tmp_path, monkeypatch):
    """As calibrate measured the evidence: with the library's floor of 256 kept tokens the
    file's 64-token KLD windows would not be pruned at all (KLD 0 against full)."""
    monkeypatch.setattr(selection, "MIN_KEEP", selection.DEFAULT_MIN_KEEP)
    out = tmp_path / "result.json"
    variant.main(["--model", str(tiny_model_path), "--schedule", str(schedule),
                  "--out", str(out)])
    assert json.loads(out.read_text())["kld"]["kld_mean"] > 1e-6  # unpruned: exactly 0
    assert selection.MIN_KEEP == selection.DEFAULT_MIN_KEEP


def test_a_bar_that_fails_is_exit_1_and_nothing_recorded(tiny_model_path, schedule, capsys):
    doc = json.loads(schedule.read_text())
    doc["evidence"]["kld_bar"] = 0.0  # no copy drifts less than nothing
    doc["evidence"]["made"]["options"]["min_base"] = 0.5  # random weights score 0
    schedule.write_text(json.dumps(doc))
    before = schedule.read_text()
    assert variant.main(["--model", str(tiny_model_path), "--schedule", str(schedule),
                         "--round", "8", "--group-size", "32", "--record"]) == 1
    captured = capsys.readouterr()
    assert "KLD bar fails" in captured.out and "retrieval bar holds" in captured.out
    assert "not recorded" in captured.err and schedule.read_text() == before
    assert "full scores below the calibration's cell bar on passkey@200" in captured.out


def test_a_lost_answer_fails_the_retrieval_bar(tiny_model_path, schedule, monkeypatch, capsys):
    """Random weights answer nothing, so the copy's full is made to answer every sample and
    the schedule to miss the first: 1 lost of 3 is past the file's 1% allowance."""
    def answers(model, tokenizer, method, sample):
        return SimpleNamespace(score=float(method.name == "full" or sample.index > 0))

    monkeypatch.setattr(variant, "run_one", answers)
    assert variant.main(["--model", str(tiny_model_path), "--schedule", str(schedule),
                         "--record"]) == 1
    out = capsys.readouterr().out
    assert "lost 1 / won 0" in out and "retrieval bar fails; KLD bar holds" in out


def test_recording_replaces_the_entry_of_the_same_variant_in_its_place(schedule):
    old = json.loads(schedule.read_text())["model"]["variants"]
    assert [v["variant"] for v in old] == ["float32"]  # calibrate's own record
    entry = {"variant": "float32+q4g64", "checked": ["identity", "retrieval", "kld"],
             "how": "first"}
    variant.record(schedule, entry)
    variant.record(schedule, {**entry, "how": "second"})
    entries = json.loads(schedule.read_text())["model"]["variants"]
    assert entries == [*old, {**entry, "how": "second"}]
    float32 = {"variant": "float32", "checked": ["calibrated", "identity", "kld"]}
    variant.record(schedule, float32)
    entries = json.loads(schedule.read_text())["model"]["variants"]
    assert entries == [float32, {**entry, "how": "second"}]
    # indented as calibrate wrote it (2), or as the file was (a diff shows the entry alone)
    assert schedule.read_text() == json.dumps(json.loads(schedule.read_text()), indent=2) + "\n"
    schedule.write_text(json.dumps(json.loads(schedule.read_text()), indent=1) + "\n")
    variant.record(schedule, entry)
    assert schedule.read_text() == json.dumps(json.loads(schedule.read_text()), indent=1) + "\n"


def test_windows_compare_by_content_not_path():
    texts = {"prose": {"files": [{"path": "/a/GPL-3", "tokens": 90, "sha256": "ab"}],
                       "starts": [0, 40]}}
    moved = {"prose": {"files": [{"path": "/b/GPL-3", "tokens": 90, "sha256": "ab"}],
                       "starts": [0, 40]}}
    assert variant.same_windows(texts, moved)
    other = json.loads(json.dumps(moved))
    other["prose"]["starts"] = [0, 41]
    assert not variant.same_windows(texts, other)
    other = json.loads(json.dumps(moved))
    other["prose"]["files"][0]["sha256"] = "cd"
    assert not variant.same_windows(texts, other)


def _no_load(*a, **k):
    raise AssertionError("the model was loaded")


@pytest.mark.parametrize("edit, args, message", [
    (lambda d: d.pop("evidence"), [], "has no evidence.samples_per_cell"),
    (lambda d: d["evidence"]["made"]["options"].pop("seed"), [],
     "has no evidence.made.options.seed"),
    (lambda d: d["evidence"].update(cells={"nosuchtask@200": {}}), [], "'nosuchtask@200'"),
    (lambda d: d["evidence"].update(kld_texts="GPL-3"), [], "evidence.kld_texts is not"),
    (lambda d: d["evidence"].update(max_loss="1%"), [], "evidence.max_loss is not"),
    (lambda d: d["evidence"].update(kld_bar=-1), [], "evidence.kld_bar is not"),
    (lambda d: d["evidence"]["yardsticks"]["q4"].pop("kld_mean"), [],
     "evidence.yardsticks is not"),
    (lambda d: None, ["--round", "7"], "--round takes 2, 3, 4, 5, 6 or 8 bits"),
    (lambda d: None, ["--out", "/nonexistent/dir/r.json"],
     "cannot write --out /nonexistent/dir/r.json: folder /nonexistent/dir does not exist"),
    (lambda d: None, ["--out", "/tmp"], "--out /tmp is a folder"),  # once a traceback at the end
])
def test_bad_input_is_one_error_line_before_the_model_loads(schedule, monkeypatch, capsys,
                                                            edit, args, message):
    doc = json.loads(schedule.read_text())
    edit(doc)
    schedule.write_text(json.dumps(doc))
    monkeypatch.setattr(variant, "load", _no_load)
    assert variant.main(["--model", "m", "--schedule", str(schedule), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error:") and message in err


def test_a_schedule_of_another_model_is_refused(tiny_model_dir, schedule, monkeypatch, capsys):
    """The copy must be of the schedule's model: its identity is checked before any run."""
    monkeypatch.setattr(variant, "check", _no_load)
    assert variant.main(["--model", str(tiny_model_dir("qwen2")), "--schedule",
                         str(schedule)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "calibrated for another model" in err
