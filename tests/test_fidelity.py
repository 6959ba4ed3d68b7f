"""Fidelity: KL divergence and same-top-1 against ``full`` along its greedy continuation,
teacher-forced through generate_step, beside the 8/4-bit weight-rounding yardsticks."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_lazy import PruningConfig, UserInputError, resolve_config
from mlx_lazy.bench import fidelity, yardstick
from mlx_lazy.bench.common import jsonable
from mlx_lazy.bench.speed import build_prompt

# after-first: decoding stays approximate (the kept tokens' deep states are the pruned ones)
LAZY = PruningConfig("lazy", prune_layers=(1,), keep=(0.3,), complete="after-first")


def test_agreement_is_exact_for_full_and_drops_under_heavy_pruning(tiny_model):
    model, tokenizer = tiny_model("llama")
    prompt = build_prompt(tokenizer, 200)
    assert len(prompt) == 200 and prompt != build_prompt(tokenizer, 200, offset=37)
    ref = fidelity.greedy_tokens(model, prompt, 8)
    assert fidelity.agreement(model, PruningConfig("full"), prompt, ref) == [True] * 8
    assert fidelity.agreement(model, PruningConfig("full"), prompt, []) == []
    dropped = fidelity.agreement(model, PruningConfig("random", keep=(0.05,)), prompt, ref)
    assert len(dropped) == 8 and np.mean(dropped) < 1


def test_references_and_summary(tiny_model):
    model, tokenizer = tiny_model("llama")
    refs = fidelity.references(model, tokenizer, 120, 2, 5)
    assert [len(p) for p, _ in refs] == [120, 120] and refs[0][0] != refs[1][0]
    assert all(r == fidelity.greedy_tokens(model, p, 5) for p, r in refs)
    config = PruningConfig("random", keep=(0.05,))
    hits = [h for p, r in refs for h in fidelity.agreement(model, config, p, r)]
    summary = fidelity.agreement_summary(model, config, refs)
    assert (summary["steps"], summary["agree"]) == (10, sum(hits))
    assert summary["rate"] == sum(hits) / 10 and summary["ci"][0] <= summary["rate"]
    assert fidelity.agreement_summary(model, PruningConfig("full"), refs)["rate"] == 1.0


def test_forcing_sampler_forces_the_reference_tokens(tiny_model):
    model, tokenizer = tiny_model("llama")
    prompt = build_prompt(tokenizer, 120)
    greedy = fidelity.greedy_tokens(model, prompt, 6)
    forced = [(t * 7 + 11) % 300 for t in greedy]  # not what the model would pick
    assert forced != greedy
    run = fidelity.continuation(model, prompt, 6, LAZY, forced=forced)
    assert run.tokens == forced and run.logprobs.shape == (6, model.args.vocab_size)


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])
def test_an_unpruned_forced_run_is_one_forward_pass_with_the_steps_logits(tiny_model, kind):
    """The yardsticks' single forward pass gives what ``full`` gives step by step: the same
    distributions (relative to the logits' magnitude, float32 rounding of different matmul
    shapes) at every forced position, in order."""
    model, tok = tiny_model(kind)
    prompt = tok.encode("a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3)
    ref = fidelity.continuation(model, prompt, 8)
    fast = fidelity.continuation(model, prompt, 8, forced=ref.tokens)
    stepped = fidelity.continuation(model, prompt, 8, PruningConfig("full"), forced=ref.tokens)
    assert fast.stats is None and fast.tokens == ref.tokens
    scale = float(mx.abs(stepped.logprobs).max())
    assert float(mx.abs(fast.logprobs - stepped.logprobs).max()) <= 1e-4 * scale
    assert fidelity.compare(ref, fast)["prefill_work"] == 1.0
    assert max(fidelity.compare(ref, fast)["kld"]) < 1e-6
    # the prompt's pass in chunks of 16 tokens changes nothing; fewer
    # steps than forced tokens take the first ones
    chunked = fidelity.forced_forward(model, prompt, ref.tokens[:5], chunk=16)
    assert chunked.tokens == ref.tokens[:5]
    assert float(mx.abs(chunked.logprobs - stepped.logprobs[:5]).max()) <= 1e-4 * scale
    assert fidelity.continuation(model, prompt, 5, forced=ref.tokens).tokens == ref.tokens[:5]


def test_kl_divergence_matches_its_definition():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 50))
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = (np.exp(logp[0]) * (logp[0] - logp[1])).sum(-1)
    got = fidelity.kl_divergence(mx.array(logp[0], mx.float32), mx.array(logp[1], mx.float32))
    # float32 sums of 50 terms of magnitude ~1: a few ulps relative to the largest value
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want)) and np.all(want > 0)


def test_kld_of_the_model_against_itself_is_zero_and_against_a_perturbed_copy_positive(tiny_model):
    model, tokenizer = tiny_model("llama")
    prompt = build_prompt(tokenizer, 120)
    ref = fidelity.continuation(model, prompt, 6)
    again = fidelity.continuation(model, prompt, 6, PruningConfig("full"), forced=ref.tokens)
    same = fidelity.compare(ref, again)
    assert same["kld"] == [0.0] * 6 and same["top1"] == [True] * 6 and same["prefill_work"] == 1
    perturbed = yardstick.round_weights(model, 4)
    drift = fidelity.compare(ref, fidelity.continuation(perturbed, prompt, 6, forced=ref.tokens))
    assert min(drift["kld"]) > 0 and drift["prefill_work"] == 1
    pruned = fidelity.compare(ref, fidelity.continuation(model, prompt, 6, LAZY, forced=ref.tokens))
    # cut after layer 1 of 4 keeping 30%: 2 full layers + 2 at 30% (+ the kept last token)
    assert 0.6 < pruned["prefill_work"] < 0.7 and min(pruned["kld"]) > 0
    # exact: only the first step is the pruned prefill's; later steps are the model's, their
    # KLD zero up to float32 rounding (~1e-6 here, whatever the BLAS), far under 1% of the
    # pruned step's (> 1e-3); after-first's later steps are above that 1% (~3x)
    exact = fidelity.compare(ref, fidelity.continuation(
        model, prompt, 6, replace(LAZY, complete="exact"), forced=ref.tokens))
    assert exact["kld"][0] == pruned["kld"][0] > 1e-3
    assert max(abs(k) for k in exact["kld"][1:]) < 0.01 * exact["kld"][0]


def test_a_model_already_quantized_has_no_yardstick(tiny_model, tiny_model_4bit):
    """Rounding quantized layers would change nothing: every yardstick row would read 0 and
    every bar set by one would admit nothing, so such a model is refused as bad input."""
    yardstick.check_unquantized(tiny_model("llama")[0])  # float weights pass
    model, tokenizer = tiny_model_4bit("llama")
    with pytest.raises(UserInputError, match=r"already quantized \(q4g32 layers\)"):
        yardstick.round_weights(model, 8)
    with pytest.raises(UserInputError, match="already quantized"):
        fidelity.run(model, tokenizer, {"full": PruningConfig("full")}, 1, 64, 2)


def test_yardstick_weights_within_a_quantization_step(tiny_model):
    model, _ = tiny_model("qwen2")  # tied embeddings: the embedding is the LM head too
    before = dict(tree_flatten(model.parameters()))
    quantized = {name for name, m in model.named_modules() if yardstick.quantizable(m)}
    assert "model.embed_tokens" in quantized and "model.layers.0.mlp.down_proj" in quantized
    for bits in yardstick.BITS:
        rounded = dict(tree_flatten(yardstick.round_weights(model, bits).parameters()))
        for name, w in before.items():
            r = rounded[name]
            assert r.dtype == w.dtype
            if name.removesuffix(".weight") not in quantized:
                assert mx.array_equal(r, w), name  # norms and biases untouched
                continue
            g = np.array(w).reshape(*w.shape[:-1], -1, yardstick.GROUP_SIZE)
            err = np.abs(np.array(r).reshape(g.shape) - g)
            _, scales, biases = mx.quantize(w, group_size=yardstick.GROUP_SIZE, bits=bits)
            s, b = np.array(scales)[..., None], np.array(biases)[..., None]
            codes = (g - b) / s  # a code in [0, 2^bits - 1] lies on the grid
            on_grid = (codes > -0.5) & (codes < 2**bits - 0.5)
            # float32 rounding of the weights' magnitude: relative slack of 1e-5
            slack = 1e-5 * np.abs(g).max(axis=-1, keepdims=True)
            assert np.all((err <= np.abs(s) / 2 + slack) | ~on_grid), (name, bits)
            # mlx keeps zero exact, so a group's far end may be clipped: at most one step of
            # the group's range (max - min) / (2^bits - 1)
            step = (g.max(axis=-1, keepdims=True) - g.min(axis=-1, keepdims=True)) / (2**bits - 1)
            assert np.all(err <= step + slack), (name, bits)
            assert np.mean(err > 0) > 0.5, (name, bits)  # the weights were really rounded
    assert all(mx.array_equal(v, before[k]) for k, v in tree_flatten(model.parameters()))


def test_yardstick_rounds_switch_layers(tiny_model):
    model, _ = tiny_model("qwen3_moe")
    experts = [m for _, m in model.named_modules() if yardstick.quantizable(m)
               and m.weight.ndim == 3]
    assert experts  # the MoE experts' stacked weights are quantizable too
    rounded = yardstick.round_weights(model, 4)
    name, module = next((n, m) for n, m in rounded.named_modules()
                        if n.endswith("switch_mlp.up_proj"))
    original = dict(model.named_modules())[name]
    assert not mx.array_equal(module.weight, original.weight)
    assert not yardstick.quantizable(nn.Linear(48, 8))  # 48 is not a multiple of 64


def test_row_summary_intervals_are_a_bootstrap_over_windows():
    windows = [{"kld": [0.0] * 32, "top1": [True] * 32, "prefill_work": 0.5},
               {"kld": [1.0] * 32, "top1": [False] * 32, "prefill_work": 1.0}]
    s = fidelity.row_summary(windows)
    assert (s["kld_mean"], s["same_top1"], s["prefill_work"], s["steps"]) == (0.5, 0.5, 0.75, 64)
    # two windows: resampled means are 0, 0.5 or 1; over 64 independent steps the interval
    # would be about ±0.12
    assert s["kld_mean_ci"] == (0.0, 1.0) and s["same_top1_ci"] == (0.0, 1.0)
    ramp = [{"kld": list(np.linspace(0, 1, 100)), "top1": [True] * 100, "prefill_work": 1.0}]
    # np.quantile interpolates: 0.99 of a ramp over [0, 1], exact up to float rounding
    assert fidelity.row_summary(ramp)["kld_p99"] == pytest.approx(0.99, rel=1e-9)


def _windows(means, order=None):
    """Window results whose per-step KLDs average to ``means`` (window i has mean means[i]),
    listed in ``order``."""
    order = range(len(means)) if order is None else order
    return [{"window": i, "kld": [means[i] - 0.05, means[i] + 0.05], "top1": [True, False],
             "prefill_work": 1.0} for i in order]


def test_paired_with_the_yardstick_matches_windows_not_list_positions():
    row = _windows([0.1, 0.5, 0.9])
    yard = _windows([0.2, 0.6, 1.0], order=[2, 0, 1])  # listed in another order
    p = fidelity.paired_with(row, yard)
    # every window drifts 0.1 less than the yardstick's: the paired interval is that point,
    # where the two rows' own intervals (0.1-0.9 against 0.2-1.0) overlap almost entirely
    assert p["windows"] == 3 and p["windows_below"] == 3
    assert p["kld_mean_diff"] == pytest.approx(-0.1, rel=1e-9)
    assert p["kld_mean_diff_ci"] == pytest.approx((-0.1, -0.1), rel=1e-9)
    worse = fidelity.paired_with(_windows([0.3, 0.7, 1.1]), yard)
    assert worse["windows_below"] == 0 and worse["kld_mean_diff_ci"][0] == pytest.approx(0.1)


def test_summary_pairs_every_row_with_the_4_bit_yardstick_by_kind_and_window():
    # window numbers repeat across kinds: "all" must pair prose 0 with prose 0
    records = {"full": {"prose": _windows([0.0, 0.0]), "code": _windows([0.0, 0.0])},
               "lazy": {"prose": _windows([0.1, 0.3]), "code": _windows([1.5, 2.5])},
               "q4": {"prose": _windows([0.2, 0.4]), "code": _windows([1.0, 2.0])}}
    summary = fidelity.summarize(records)
    assert "vs_q4" not in summary["all"]["q4"]
    assert summary["prose"]["lazy"]["vs_q4"]["windows_below"] == 2
    assert summary["code"]["lazy"]["vs_q4"]["windows_below"] == 0
    both = summary["all"]["lazy"]["vs_q4"]
    assert both["windows"] == 4 and both["windows_below"] == 2
    assert both["kld_mean_diff"] == pytest.approx((-0.1 - 0.1 + 0.5 + 0.5) / 4)
    assert summary["all"]["full"]["vs_q4"]["kld_mean_diff"] == pytest.approx(-0.9)
    assert "+0.2000" in fidelity.render({"meta": {"steps": 2, "length": 8}, "summary": summary})


def test_spread_order_visits_every_window_spread_out():
    assert fidelity.spread_order(8) == [0, 4, 2, 6, 1, 5, 3, 7]
    assert all(sorted(fidelity.spread_order(n)) == list(range(n)) for n in range(1, 60))
    first = fidelity.spread_order(50)[:8]  # a run cut short: both ends of the text are in
    assert min(first) < 7 and max(first) > 42


def test_text_windows(tiny_model):
    _, tokenizer = tiny_model("llama")
    files = fidelity.code_files()
    assert files == sorted(files) and all(p.suffix == ".py" for p in files)
    windows, meta = fidelity.text_windows(tokenizer, files, 4, 100)
    assert [len(w) for w in windows] == [100] * 4 and meta["disjoint"]
    ids = [t for f in meta["files"] for t in fidelity.encode_file(tokenizer, Path(f["path"]))]
    assert all(w == ids[s:s + 100] for w, s in zip(windows, meta["starts"]))
    assert meta["starts"][1] >= 100 and meta["total_tokens"] == len(ids)
    with pytest.raises(fidelity.UserInputError, match="fewer than one window"):
        fidelity.text_windows(tokenizer, files[:1], 2, 10**7)


def test_run_writes_tables_with_the_yardstick_rows(tiny_model, tmp_path):
    model, tokenizer = tiny_model("llama")
    methods = fidelity.resolve_methods(["lazy:layers=1:keep=0.3", "lazy"], model)
    result = fidelity.run(model, tokenizer, methods, 4, 48, 3, out=tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    # the meta says what each row ran: a plain "lazy" names no cuts, what it resolved to does
    assert saved["meta"]["methods"]["lazy"]["prune_layers"] is None
    ran = saved["meta"]["schedules"]
    assert ran["lazy"] == jsonable(resolve_config(model, "lazy").as_dict())
    assert ran["lazy"]["prune_layers"] and ran["lazy"]["source"] == "transfer"
    assert ran["lazy:layers=1:keep=0.3"]["prune_layers"] == [1]
    assert set(saved["summary"]) == {"prose", "code", "all"}
    for kind, rows in saved["summary"].items():
        assert set(rows) == {"full", "lazy:layers=1:keep=0.3", "lazy", "q8", "q4"}, kind
        assert rows["full"]["kld_mean"] == 0 and rows["full"]["same_top1"] == 1
        assert rows["q4"]["kld_mean"] > 0
    assert saved["summary"]["all"]["q4"]["windows"] == 8
    assert [w["window"] for w in saved["records"]["q4"]["code"]] == [0, 2, 1, 3]  # spread
    table = (tmp_path / "table.md").read_text()
    assert table == fidelity.render(result) + "\n"
    for kind in ("prose", "code", "all"):
        section = table.split(f"**{kind}**")[1].split("**")[0]
        assert "weights through 8-bit (group 64)" in section
        assert "weights through 4-bit (group 64)" in section


def test_min_keep_chooses_between_a_users_short_prompt_and_the_schedules_fractions(
        tiny_model_path, tmp_path, monkeypatch):
    """Under the library's floor (256 kept tokens) a 48-token window is not pruned, so the
    default measures ``full`` again; ``--min-keep 0`` measures the cut at its fraction."""
    monkeypatch.setattr(fidelity.selection, "MIN_KEEP", fidelity.selection.DEFAULT_MIN_KEEP)
    spec = "lazy:layers=1:keep=0.3"
    args = ["--model", str(tiny_model_path), "--methods", spec, "--windows", "1",
            "--length", "48", "--steps", "3"]
    kld = {}
    for floor in (None, 0):
        more = [] if floor is None else ["--min-keep", str(floor)]
        out = tmp_path / f"out{floor}"
        assert fidelity.main([*args, *more, "--out", str(out)]) == 0
        saved = json.loads((out / "results.json").read_text())
        assert saved["meta"]["min_keep"] == (256 if floor is None else 0)
        kld[floor] = saved["summary"]["all"][spec]["kld_mean"]
    assert kld[None] < 1e-6 < kld[0]  # unpruned: exactly 0


@pytest.mark.slow
def test_cli_bad_input_is_one_error_line(tiny_model, tiny_model_path, tmp_path, capsys):
    model = ["--model", str(tiny_model_path)]
    for args, names in ((["--windows", "0"], "--windows"), (["--steps", "0"], "--steps"),
                        ([*model, "--methods", "bogus"], "unknown method 'bogus'"),
                        ([*model, "--methods", "mlx-lm"], "mlx-lm is not a method"),
                        ([*model, "--methods", "lazy:layers=9"], "pruning layers must lie"),
                        ([*model, "--min-keep", "-1"], "--min-keep must be >= 0"),
                        # once run past the 4,096-token context
                        ([*model, "--length", "5000"], "the model's context is 4096"),
                        ([*model, "--length", "4094", "--steps", "4"], "(lower --steps)")):
        assert fidelity.main([*args, "--out", str(tmp_path / "out")]) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and names in err[0], (args, err)
        assert not (tmp_path / "out").exists(), args  # the folder it made goes again
    model_, _ = tiny_model("llama")
    with pytest.raises(fidelity.UserInputError, match="pruning layers"):  # before measuring
        fidelity.resolve_methods(["lazy:layers=9"], model_)
    proc = subprocess.run([sys.executable, "-m", "mlx_lazy.bench.fidelity", "--windows", "x",
                           "--out", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("error: ")
