"""A calibration's progress: status lines, stage ETAs and the estimate of the time to a
schedule that a time limit is checked against."""

import io
from types import SimpleNamespace

import pytest

from mlx_lazy.bench.progress import Progress, Rates, duration


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (59.4, "59s"), (60, "1m00s"),
                                           (754, "12m34s"), (3600, "1h00m"), (3930, "1h05m"),
                                           (-3, "0s")])
def test_durations_read_as_a_person_says_them(seconds, text):
    assert duration(seconds) == text


def test_rates_are_means_per_unit():
    r = Rates()
    assert r.mean("full") is None
    r.add("full", 3.0)
    r.add("full", 5.0)
    r.add("token", 2.0, units=4)
    assert r.mean("full") == 4.0 and r.mean("token") == 0.5


def test_a_stage_eta_comes_from_the_stages_own_pace():
    clock, out = Clock(), io.StringIO()
    p = Progress(limit_s=600, goal="next schedule", stream=out, clock=clock)
    clock.t = 100  # earlier stages took 100 s: not this stage's pace
    assert "stage ETA" not in p.line("rung 0 x", 4, 10)  # its start: 4 done before it
    clock.t = 120
    text = p.line("rung 0 x", 6, 10, goal_s=300)
    # 2 samples in 20 s: 4 more take 40 s
    assert text == ("rung 0 x: 6/10 · 2m00s spent · stage ETA 40s · next schedule in ≈5m00s"
                    " · time limit: 8m00s left")
    assert "stage ETA" not in p.line("rung 0 x", 10, 10)  # done


def test_into_a_file_lines_are_written_when_due_and_at_a_stages_end():
    clock, out = Clock(), io.StringIO()
    p = Progress(stream=out, clock=clock, every_s=60)
    for t, done in [(0, 0), (10, 1), (30, 2), (61, 3), (70, 4), (80, 5)]:
        clock.t = t
        p.update("full c", done, 5)
    lines = out.getvalue().splitlines()
    assert [line.split("] ")[1].split(" ·")[0] for line in lines] == [
        "full c: 0/5", "full c: 3/5", "full c: 5/5"]
    assert "\r" not in out.getvalue()


def test_on_a_terminal_the_status_line_is_rewritten_and_cleared_for_logs():
    clock = Clock()
    out = io.StringIO()
    out.isatty = lambda: True
    p = Progress(stream=out, clock=clock)
    p.update("full c", 1, 5)
    p.update("full c", 2, 5)
    p.log("pilot done")
    text = out.getvalue()
    assert text.count("\r\033[K") == 3 and text.endswith("pilot done\n")
    assert "full c: 2/5" in text


def slow_prefills(monkeypatch, seconds_per_token):
    """Calibration runs that answer at once but report ``seconds_per_token`` of prefill,
    which is what the ETA scales the work it has not timed yet from."""
    from mlx_lazy.bench import calibrate

    def fake_run_one(model, tokenizer, method, sample):
        n = len(sample.tokens)
        return SimpleNamespace(score=1.0, ttft_s=seconds_per_token * n, tpot_s=None,
                               prompt_tokens=n)

    monkeypatch.setattr(calibrate, "run_one", fake_run_one)


@pytest.mark.parametrize("limit, warned", [(100.0, True), (1e6, False)])
def test_a_time_limit_too_short_for_a_schedule_is_said_after_the_pilot(
        tiny_model_path, tmp_path, monkeypatch, capsys, limit, warned):
    from mlx_lazy.bench.calibrate import Calibration, run

    # 1 s per prompt token: full's KLD windows (64 tokens, 2 kinds), the two yardsticks'
    # and a candidate's are 4 rows x 2 windows x 64 s = 512 s, more than 100 s leaves.
    slow_prefills(monkeypatch, 1.0)
    monkeypatch.setattr("mlx_lazy.bench.calibrate.Deviation.measure",
                        lambda self, config, model=None, row="candidate": {
                            "kld_mean": 0.0, "kld_mean_ci": (0, 0), "steps": 1})
    run(Calibration(model=str(tiny_model_path), out=str(tmp_path / "cal"), tasks=("passkey",),
                    lengths=(200,), rungs=(2,), pilot=2, kld_windows=1, kld_length=64,
                    kld_steps=3, measure=False, max_kld=1e9, min_base=0.0,
                    scorers=("last",), cuts=(((0.5,), (0.3,)),), time_limit_s=limit))
    err = capsys.readouterr().err
    needs = next(line for line in err.splitlines() if "the first schedule needs" in line)
    minutes = needs.split("≈")[1].split(";")[0]
    assert minutes.startswith(("8m", "9m")), needs  # 512 s of KLD and the retrieval runs
    assert ("expect none" in needs) == warned
    assert "full passkey@200: 2/2" in err and "rung 0 lazy" in err
