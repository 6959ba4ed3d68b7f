"""The command line interface, end to end in subprocesses, plus its pure helpers in-process.

Each subprocess pays ~2-3 s to import mlx, so runs are few and generate only a handful of
tokens; the SmolLM2 run is marked slow.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from tiny_models import KINDS

from mlx_lazy import api, cli, prompt_input, run_report
from mlx_lazy.scorers import Pooled, Window

REPO = Path(__file__).resolve().parents[1]
STATS_KEYS = {
    "method", "schedule", "prompt_tokens", "generation_tokens", "ttft_s", "tpot_s",
    "prompt_tps", "generation_tps", "peak_memory_bytes", "kv_bytes", "aux_bytes",
    "kv_bytes_per_layer", "prompt_tokens_computed_pct", "tokens_computed_per_layer",
    "prefill_tokens_per_layer", "prefill_attention_pairs", "revivals", "host_syncs",
    "max_computations_per_token_layer", "text",
}
PROMPT = "The quick brown fox jumps over the lazy dog. " * 6


def run_cli(*args: str, stdin: bytes | None = None, timeout: float = 180,
            module: str = "mlx_lazy.generate") -> subprocess.CompletedProcess:
    """Run ``python -m <module> ARGS`` from the repository root, as a user does."""
    return subprocess.run(
        [sys.executable, "-m", module, *args], input=stdin, capture_output=True,
        cwd=REPO, timeout=timeout,
    )


def assert_bad_input(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit status 2, one ``error:`` line on stderr, no traceback; returns that line."""
    err = proc.stderr.decode()
    assert proc.returncode == 2, (proc.returncode, err)
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for frag in fragments:
        assert frag in lines[0], (frag, lines[0])
    return lines[0]


def model_depth(model_path) -> int:
    """Number of layers from the model folder's config.json (a looped Nanbeige's and
    IQuest-Loop-Coder's once per loop)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    return config["num_hidden_layers"] * config.get("num_loops", config.get("loop_num", 1))


def check_stats(stats: dict, method: str, depth: int) -> None:
    """The stats object has every contract key and respects the at-most-once invariant."""
    assert set(stats) >= STATS_KEYS, STATS_KEYS - set(stats)
    assert stats["method"] == method
    assert stats["prompt_tokens"] > 0 and stats["generation_tokens"] >= 1
    assert stats["ttft_s"] > 0
    assert 0 < stats["prompt_tokens_computed_pct"] <= 100
    assert len(stats["tokens_computed_per_layer"]) == depth
    assert isinstance(stats["schedule"], dict)
    # exact recomputes the kept tokens' layers above the first cut once, nothing else twice
    twice = stats["schedule"].get("complete") == "exact"
    assert stats["max_computations_per_token_layer"] <= (2 if twice else 1)
    assert isinstance(stats["text"], str)


# ---------------------------------------------------------------- tiny model, end to end


@pytest.fixture
def unsupported_model_path(tiny_model_path, tmp_path) -> Path:
    """A tiny Mamba (``mamba``, random weights, the tiny llama's tokenizer): mlx-lm loads it,
    mlx-lazy does not run it (no attention layer)."""
    from mlx_lm.utils import _get_classes, save_config, save_model

    folder = tmp_path / "mamba"
    shutil.copytree(tiny_model_path, folder, ignore=shutil.ignore_patterns("*.safetensors*"))
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="mamba", architectures=["MambaForCausalLM"], state_size=8,
                  conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=4)
    model_class, args_class = _get_classes(config)
    save_model(folder, model_class(args_class.from_dict(config)))
    save_config(config, folder / "config.json")
    return folder


TINY_RUN = ("-p", PROMPT, "-m", "4", "--method", "lazy", "--verbose", "False")


# (not Gear: transformers cannot read its config's ``conv_mixer`` layers, so no tokenizer loads)
@pytest.mark.parametrize("kind", [kind for kind in KINDS if kind != "gear"])
def test_generate_tiny(tiny_model_dir, kind, tmp_path, capsys):
    """A plain run prints the response and writes a complete stats object, for every family
    (in this process: a process of its own costs seconds a family; the next test starts one);
    SPEED on Falcon-H1, whose layers take no cut (attention beside Mamba-2 in each), on
    RecurrentGemma (every attention layer a sliding window) and on Baichuan-M1 (each layer's
    keys mix in the previous token's: every layer recurrent)."""
    model = tiny_model_dir(kind)
    out = tmp_path / "stats.json"
    method = ("speed" if kind in ("falcon_h1", "recurrent_gemma", "baichuan_m1")
              else "full" if kind == "deepseek_v41" else "lazy")
    run = [method if arg == "lazy" else arg for arg in TINY_RUN]
    assert cli.main(["--model", str(model), *run, "--stats-json", str(out)]) == 0
    stats = json.loads(out.read_text())
    check_stats(stats, method, model_depth(model))
    assert capsys.readouterr().out == stats["text"] + "\n"


@pytest.mark.slow  # runs a process of its own
def test_generate_tiny_as_a_user_runs_it(tiny_model_path, tmp_path):
    """``python -m mlx_lazy.generate``, as a user runs it, prints what the stats hold."""
    out = tmp_path / "stats.json"
    proc = run_cli("--model", str(tiny_model_path), *TINY_RUN, "--stats-json", str(out))
    assert proc.returncode == 0, proc.stderr.decode()
    stats = json.loads(out.read_text())
    check_stats(stats, "lazy", model_depth(tiny_model_path))
    assert proc.stdout.decode() == stats["text"] + "\n"


def test_compare_without_verbose_prints_both_responses(tiny_model_path, capsys):
    """``--compare --verbose False``: each response under its method's name, then the table
    (it printed the table alone)."""
    assert cli.main(["--model", str(tiny_model_path), "-p", PROMPT, "-m", "3", "--method", "lazy",
                     "--compare", "--verbose", "False"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("full: ") and lines[1].startswith("lazy: ")
    assert lines[2].startswith("metric")


def test_compare_reports_each_runs_own_peak_memory(tiny_model_path, tmp_path, capsys):
    """--compare lets the baseline's cache go before the pruned run: the pruned run's peak
    is its own (it held the baseline's KV beside it, and read 1.02x the baseline's peak where
    alone it is 0.95x: a long prompt, 20% kept after layer 0, decoding on the pruned
    state)."""
    out = tmp_path / "stats.json"
    prompt = " ".join(f"w{i % 97}" for i in range(900))  # 3,499 tokens
    assert cli.main(["--model", str(tiny_model_path), "-p", prompt, "-m", "4", "--method",
                     "lazy", "--prune-layers", "0", "--keep", "0.2", "--complete", "none",
                     "--ignore-chat-template", "--compare", "--verbose", "False",
                     "--stats-json", str(out)]) == 0
    both = json.loads(out.read_text())
    assert both["lazy"]["kv_bytes"] < both["full"]["kv_bytes"]
    assert both["lazy"]["peak_memory_bytes"] < both["full"]["peak_memory_bytes"]


@pytest.mark.slow  # runs a process of its own
def test_compare_and_overrides(tiny_model_path, tmp_path):
    """--compare prints both runs and a table; explicit flags override the preset;
    --stats-json holds both runs keyed by method."""
    out = tmp_path / "stats.json"
    proc = run_cli("--model", str(tiny_model_path), "-p", PROMPT, "-m", "5",
                   "--method", "lazy", "--prune-layers", "0", "--keep", "0.5", "--anchors", "2",
                   "--ignore-chat-template", "--compare", "--stats-json", str(out))
    assert proc.returncode == 0, proc.stderr.decode()
    stdout = proc.stdout.decode()
    for row in ("metric", "time to first token (s)", "whole answer (s)",
                "time per output token (ms)",
                "prompt token-layers computed (%)", "token-layers completed",
                "prefill token-layers (%)", "KV cache (MB)",
                "aux cache (MB)", "peak memory (MB)", "outputs"):
        assert row in stdout, row
    assert "========== full" in stdout and "========== lazy" in stdout

    both = json.loads(out.read_text())
    assert set(both) == {"full", "lazy"}
    depth = model_depth(tiny_model_path)
    for method, stats in both.items():
        check_stats(stats, method, depth)
    full, lazy = both["full"], both["lazy"]
    assert full["prompt_tokens"] == lazy["prompt_tokens"]
    assert full["prompt_tokens_computed_pct"] == pytest.approx(100.0)
    assert lazy["prefill_tokens_per_layer"][1] < lazy["prefill_tokens_per_layer"][0]
    assert lazy["schedule"]["prune_layers"] == [0]
    assert lazy["schedule"]["keep"] == [0.5]
    assert lazy["schedule"]["anchors"] == 2
    agree = "identical text" if full["text"] == lazy["text"] else "differ from output token"
    assert agree in stdout.splitlines()[-1]


@pytest.mark.slow  # runs a process of its own
def test_generate_module_exit_status(tiny_model_path):
    """``python -m mlx_lazy.generate`` keeps the CLI's exit status and prints nothing but the
    error (no runpy warning about the package importing the module first)."""
    bad = run_cli("--model", str(tiny_model_path), "-p", " ")
    assert bad.returncode == 2
    assert bad.stderr.decode().strip().splitlines() == ["error: the prompt is empty"]


@pytest.mark.slow  # runs a process of its own
def test_prompt_from_stdin(tiny_model_path):
    """``-p -`` reads the prompt from stdin (same result as passing it with -p)."""
    args = ("--model", str(tiny_model_path), "-m", "3", "--verbose", "False",
            "--method", "full")
    piped = run_cli(*args, "-p", "-", stdin=PROMPT.encode())
    direct = run_cli(*args, "-p", PROMPT)
    assert piped.returncode == 0 and direct.returncode == 0, piped.stderr.decode()
    assert piped.stdout == direct.stdout


@pytest.mark.slow  # runs a process of its own
@pytest.mark.parametrize("module", ["mlx_lazy.generate", "mlx_lazy.cache_prompt"])
def test_prompt_from_a_closed_stdin_is_one_error_line(tiny_model_path, tmp_path, module):
    """Started with its standard input closed (``<&-``), Python has no sys.stdin: once a
    traceback."""
    out = ["--prompt-cache-file", str(tmp_path / "c")] if "cache" in module else []
    done = subprocess.run([sys.executable, "-m", module, "--model", str(tiny_model_path),
                           "-p", "-", *out],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=120, preexec_fn=lambda: os.close(0))
    assert (done.returncode, done.stderr) == (
        2, "error: --prompt -: there is no standard input to read\n"), done.stderr


# ---------------------------------------------------------------- bad input


@pytest.mark.slow  # runs a process of its own
def test_unknown_model_path(tmp_path):
    assert_bad_input(run_cli("--model", str(tmp_path / "missing"), "-p", "hi"), "missing")


@pytest.mark.slow  # runs a process of its own
def test_model_folder_without_config(tmp_path):
    assert_bad_input(run_cli("--model", str(tmp_path), "-p", "hi"), "cannot load model")


@pytest.mark.slow  # runs a process of its own
def test_unsupported_architecture(unsupported_model_path):
    assert_bad_input(run_cli("--model", str(unsupported_model_path), "-p", "hi"),
                     "unsupported model type 'mamba'")


@pytest.mark.slow  # runs a process of its own
@pytest.mark.parametrize("flags, fragment", [
    (("--method", "lazy", "--prune-layers", "99", "--keep", "0.5"), "pruning layers"),
    (("--method", "lazy", "--prune-layers", "0,1", "--keep", "0.3,0.6"), "must not increase"),
    (("--prune-layers", "2", "--keep", "0.5"), "method 'full' takes no prune_layers"),
    (("--method", "speed", "--speed-cutoff", "1.5"), "speed_cutoff"),
])
def test_invalid_schedule(tiny_model_path, flags, fragment):
    assert_bad_input(run_cli("--model", str(tiny_model_path), "-p", "hi", *flags), fragment)


@pytest.mark.parametrize("flags, message", [
    (("--keep", "0.5"), "method 'full' takes no keep"),
    (("--method", "lazy", "--no-revive", "--complete", "exact"), "revive=False keeps pruned"),
    (("--quality", "high", "--method", "lazy", "--keep", "0.5"), "quality='high' picks"),
])
def test_a_config_error_comes_before_the_model_loads(flags, message, capsys):
    """Errors that need no model are found before one loads (a real one takes seconds to
    minutes): with a model path that does not exist, the config's error is the one given."""
    assert cli.main(["--model", "/nonexistent/model", "-p", "hi", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "cannot load model" not in err, err


@pytest.mark.slow  # runs a process of its own
def test_empty_prompt():
    assert_bad_input(run_cli("-p", "  \\n "), "empty")


@pytest.mark.slow  # runs a process of its own
def test_prompt_longer_than_context(tiny_model_path, tmp_path):
    config = json.loads((Path(tiny_model_path) / "config.json").read_text())
    ctx = config["max_position_embeddings"]
    long_file = tmp_path / "long.txt"
    long_file.write_text("word " * (ctx + 10))
    line = assert_bad_input(run_cli("--model", str(tiny_model_path), "--prompt-file",
                                    str(long_file), "--ignore-chat-template"), str(ctx))
    n_tokens = int(line.split("prompt has ")[1].split()[0])
    assert n_tokens > ctx


@pytest.mark.slow  # runs a process of its own
def test_unreadable_prompt_file(tmp_path):
    assert_bad_input(run_cli("--prompt-file", str(tmp_path / "nope.txt")), "nope.txt")


@pytest.mark.slow  # runs a process of its own
def test_non_utf8_prompt_file(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait".encode("latin-1"))
    assert_bad_input(run_cli("--prompt-file", str(bad)), "UTF-8", "offset 3")


@pytest.mark.slow  # runs a process of its own
def test_bad_flag_value_is_one_line():
    assert_bad_input(run_cli("--keep", "half"), "--keep")


@pytest.mark.slow  # runs a process of its own
def test_compare_needs_a_pruning_method():
    assert_bad_input(run_cli("--method", "full", "--compare"), "--compare")


# ---------------------------------------------------------------- SmolLM2


@pytest.mark.slow
def test_smollm2_compare(smollm2_path, tmp_path):
    """The real model: --compare with the lazy preset on a short chat prompt."""
    out = tmp_path / "stats.json"
    proc = run_cli("--model", str(smollm2_path), "-p",
                   "Name three colours of the rainbow. " + PROMPT, "-m", "8",
                   "--method", "lazy", "--compare", "--stats-json", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()
    both = json.loads(out.read_text())
    for method, stats in both.items():
        check_stats(stats, method, 30)
        assert stats["generation_tokens"] >= 1 and stats["text"].strip()
    assert "time to first token (s)" in proc.stdout.decode()


# ---------------------------------------------------------------- helpers, in-process


def _args(**kw) -> SimpleNamespace:
    base = dict(method="lazy", prune_layers=None, keep=None, speed_cutoff=None, anchors=None,
                seed=None, revive=None, scorer=None,
                complete=None, max_revivals=None, revive_margin=None, reselect_every=None,
                quality=None,
                schedule=None)
    return SimpleNamespace(**{**base, **kw})


def test_build_config_overrides_preset():
    assert cli.build_config(_args()) == cli.PruningConfig.preset("lazy")
    cfg = cli.build_config(_args(method="lazy+speed", prune_layers=(2, 4), keep=(0.6, 0.4),
                                 speed_cutoff=24, anchors=3))
    assert (cfg.method, cfg.prune_layers, cfg.keep, cfg.speed_cutoff, cfg.anchors) == (
        "lazy+speed", (2, 4), (0.6, 0.4), 24, 3)
    assert cli.build_config(_args(method="random", seed=7)).seed == 7
    assert cli.build_config(_args(method="lazy", seed=7)).seed == 0  # only random uses it
    assert cli.build_config(_args()).revive
    args = cli.build_parser().parse_args(["--method", "lazy", "--no-revive",
                                          "--scorer", "window:size=4:pool=2"])
    assert not cli.build_config(args).revive
    assert cli.build_config(args).scorer == Pooled(Window(size=4), 2)
    args = cli.build_parser().parse_args(["--method", "lazy", "--revive-margin", "1.5"])
    assert cli.build_config(args).revive_margin == 1.5
    args = cli.build_parser().parse_args(["--method", "lazy", "--reselect-every", "4"])
    assert cli.build_config(args).reselect_every == 4
    args = cli.build_parser().parse_args(["--method", "lazy", "--max-revivals", "3"])
    assert cli.build_config(args).max_revivals == 3


def test_flag_parsers():
    ns = cli.build_parser().parse_args(
        ["--prune-layers", "8,16,24", "--keep", "0.7,0.5,0.3", "--speed-cutoff", "0.75"])
    assert ns.prune_layers == (8, 16, 24) and ns.keep == (0.7, 0.5, 0.3)
    assert ns.speed_cutoff == 0.75 and isinstance(ns.speed_cutoff, float)
    cutoff = cli.build_parser().parse_args(["--speed-cutoff", "24"]).speed_cutoff
    assert cutoff == 24 and isinstance(cutoff, int)
    assert cli.main(["--method", "bogus"]) == 2
    assert cli.main(["-m", "0"]) == 2


def test_first_divergence_and_table():
    def result(method, text, tokens, pct):
        stats = SimpleNamespace(prompt_tokens=100, generation_tokens=len(tokens), ttft_s=0.5,
                                tpot_s=0.02, answer_s=0.5 + 0.02 * (len(tokens) - 1),
                                prompt_token_layers_computed_pct=pct, completed_token_layers=0,
                                kv_bytes=2e6,
                                prefill_tokens_per_layer=[100, 100, int(pct), int(pct)],
                                aux_bytes=1e5, peak_memory_bytes=3e8, revivals=4)
        return run_report.RunResult(method, stats, text, tokens)

    full = result("full", "a b c", [1, 2, 3], 100.0)
    assert run_report.first_divergence(full, result("lazy", "a b c", [1, 2, 3], 50.0)) is None
    other = result("lazy", "a b d", [1, 2, 9], 48.5)
    assert run_report.first_divergence(full, other) == 2
    assert run_report.first_divergence(full, result("lazy", "a b", [1, 2], 48.5)) == 2
    table = run_report.format_compare_table(full, other)
    assert "lazy/full" in table.splitlines()[0]
    assert "48.5" in table and "1.00x" in table
    work = next(line for line in table.splitlines() if line.startswith("prefill token-layers"))
    assert work.split()[-2:] == ["100.0", "74.0"]  # (100 + 100 + 48 + 48) / 400
    assert table.splitlines()[-1].endswith("differ from output token 2")


def test_prefill_progress_bar():
    buf = io.StringIO()
    bar = cli.PrefillProgress("prefill", enabled=True, file=buf, delay=0)
    for done in range(1, 4):
        bar(done, 4)
    assert bar._bar.n == 3 and bar._bar.total == 4
    bar(4, 4)
    assert bar._bar is None  # closed (line cleared) once the whole prompt is done
    bar.close()
    assert "prefill" in buf.getvalue() and "tok" in buf.getvalue()
    silent = io.StringIO()
    off = cli.PrefillProgress("prefill", enabled=False, file=silent, delay=0)
    off(1, 4)
    off.close()
    assert silent.getvalue() == ""


def test_context_length_sources():
    model = SimpleNamespace(args=SimpleNamespace(max_position_embeddings=2048))
    assert api.context_length(model, SimpleNamespace(model_max_length=512)) == 2048
    youtu = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=4096))  # no args
    assert api.context_length(youtu, SimpleNamespace(model_max_length=512)) == 4096
    bare = SimpleNamespace(args=SimpleNamespace(max_position_embeddings=None))
    assert api.context_length(bare, SimpleNamespace(model_max_length=512)) == 512
    assert api.context_length(bare, SimpleNamespace(model_max_length=int(1e30))) is None


@pytest.mark.slow
def test_installed_console_script_generates(tiny_model_path):
    """The installed ``mlx-lazy-generate`` runs the CLI: one generation on the tiny model."""
    exe = shutil.which("mlx-lazy-generate", path=os.path.dirname(sys.executable))
    assert exe, "mlx-lazy-generate is not installed beside this Python (scripts/setup.sh)"
    proc = subprocess.run([exe, "--model", str(tiny_model_path), "-p", PROMPT, "-m", "3",
                           "--verbose", "False"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr


@pytest.mark.parametrize("module", [
    "mlx_lazy.cli", "mlx_lazy.cache_prompt", "mlx_lazy.convert", "mlx_lazy.server",
    "mlx_lazy.demo", "mlx_lazy.bench.__main__", "mlx_lazy.bench.answer", "mlx_lazy.calibrate",
    "mlx_lazy.bench.conversation", "mlx_lazy.bench.distributed", "mlx_lazy.bench.fidelity",
    "mlx_lazy.bench.plots", "mlx_lazy.bench.probe", "mlx_lazy.bench.server_load",
    "mlx_lazy.bench.speed", "mlx_lazy.bench.variant"])
def test_every_tool_says_a_bad_flag_in_one_line(module, capsys):
    """Each command line answers an unknown flag with one ``error:`` line and status 2 (the
    demo and four benchmarks printed argparse's usage block first)."""
    import importlib

    try:
        code = importlib.import_module(module).main(["--no-such-flag"])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("args, says", [
    (["--document", "/nonexistent/report.txt"], "No such file or directory"),
    (["--model", "/nonexistent/model"], "cannot load model /nonexistent/model"),
    (["--method", "bogus"], "unknown method 'bogus'"),  # once argparse's usage block
])
def test_the_example_says_bad_input_in_one_line(args, says):
    example = Path(__file__).parent.parent / "examples" / "long_document_qa.py"
    proc = subprocess.run([sys.executable, str(example), *args], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.startswith("error: ") and says in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


# ---------------------------------------------------------------- hostile input, in-process


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if the CLI gets as far as loading a model."""

    def refuse(path, **kwargs):
        raise AssertionError("the model was loaded before the bad input was reported")

    monkeypatch.setattr(cli, "load", refuse)


def main_error(capsys, *argv: str) -> str:
    """Run the CLI in-process; assert exit status 2 and one ``error:`` line; return it."""
    assert cli.main(list(argv)) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    return lines[0]


@pytest.mark.parametrize("flags, fragments", [
    (("--temp", "-1"), ["--temp", "-1"]),
    (("--temp", "nan"), ["--temp", "nan"]),
    (("--temp", "inf"), ["--temp"]),
    (("--top-p", "0"), ["--top-p", "(0, 1]"]),
    (("--top-p", "2"), ["--top-p"]),
    (("--top-p", "-1"), ["--top-p"]),
    (("--seed", "-1"), ["--seed", "2**64"]),
    (("--seed", str(2**64)), ["--seed"]),
    (("--seed", "1.5"), ["--seed"]),
    (("-p", "\udcff\udcfe hi"), ["--prompt is not valid UTF-8", "byte 0xff at offset 0"]),
    (("--system-prompt", "ok \udce9"), ["--system-prompt is not valid UTF-8", "offset 3"]),
    (("--anchors", "4"), ["--anchors applies to pruning methods"]),
    (("--method", "lazy", "--anchors", "-2"), ["anchors must be a non-negative integer"]),
    # named by the flag given, not the config's field (once "max_revivals must be ...")
    (("--method", "lazy", "--max-revivals", "-1"), ["--max-revivals must be a non-negative"]),
    (("--method", "lazy", "--reselect-every", "0"), ["--reselect-every must be a positive"]),
    (("--stats-json", "{tmp}"), ["is a directory"]),
    (("--stats-json", "/proc/x.json"), ["cannot write --stats-json /proc/x.json"]),
    (("--stats-json", "/dev/full"), ["cannot write --stats-json /dev/full", "No space"]),
    (("--stats-json", "{tmp}/fifo"), ["cannot write --stats-json", "fifo"]),  # once a hang
    (("--method", "lazy", "--prune-layers", "5,,6,", "--keep", "0.5,0.3"),
     ["--prune-layers", "an empty item in '5,,6,'"]),
    (("--method", "lazy", "--prune-layers", "5", "--keep", "0.5,"), ["--keep", "an empty item"]),
    (("--method", "lazy", "--scorer", f"last:pool={10**20}"), ["pool must be an integer in [0,"]),
    (("--method", "lazy", "--scorer", ""), ["--scorer", "scorer must be a non-empty spec"]),
    (("--method", "lazy", "--scorer", "window:window=8"),
     ["scorer 'window' has no field 'window'"]),
    (("--schedule", "{tmp}/big.json"), ["big.json is larger than the limit of 1 MiB"]),
    (("--schedule", "/dev/zero"), ["schedule file /dev/zero is not a regular file"]),
    (("--schedule", "{tmp}/fifo"), ["fifo is not a regular file"]),  # once a hang
    (("--schedule", "{tmp}/deep.json"), ["deep.json nests arrays or objects more than 16 deep"]),
    (("--prompt-file", "/dev/zero"),
     ["prompt file '/dev/zero' is larger than the limit of 16 MiB"]),
    # sizes Python's int reads but a user never means (once: size 30, 33, 10)
    (("--method", "lazy", "--scorer", "window:size=3_0"), ["size must be int, got '3_0'"]),
    (("--method", "lazy", "--scorer", "window:size=\u0663\u0663"), ["size must be int"]),
    (("--method", "lazy", "--scorer", "last:pool=\uff11"), ["pool must be int"]),
    (("--method", "lazy", "--prune-layers", "1_0", "--keep", "0.5"), ["--prune-layers"]),
    (("--method", "lazy", "--prune-layers", "1", "--keep", "0.5_0"), ["--keep"]),
    (("--method", "lazy", "--anchors", "\u0663"), ["--anchors"]),
    # argparse takes a negative value for a flag: say how to give one
    (("--method", "lazy", "--keep", "-0.1,-0.2"), ["expected one argument (a value that "
                                                   "starts with '-': write --flag=VALUE)"]),
    (("--method", "lazy", "--keep"), ["--keep: expected one argument (see --help)"]),
    (("--keep", "--method", "lazy"), ["--keep: expected one argument (see --help)"]),
    # once "invalid parse_int value", the helper's name
    (("--method", "lazy", "--anchors", "x"), ["--anchors: expected an integer, got 'x'"]),
    (("--method", "lazy", "--revive-margin", "nan"),
     ["--revive-margin: expected a finite decimal number, got 'nan'"]),
    # once the prompt cache or the prompt became the run's statistics
    (("--prompt-cache-file", "{tmp}/c.safetensors", "--stats-json", "{tmp}/c.safetensors"),
     ["--stats-json", "is also --prompt-cache-file's file"]),
    (("--prompt-file", "{tmp}/p.txt", "--stats-json", "{tmp}/./p.txt"),
     ["--stats-json", "is also --prompt-file's file"]),
    (("--stats-json", ""), ["--stats-json is empty"]),
    # once a traceback or a misleading "does not exist"
    (("--prompt-cache-file", ""), ["--prompt-cache-file is empty"]),
    (("--prompt-cache-file", "{tmp}"), ["--prompt-cache-file", "is a folder"]),
    (("--prompt-cache-file", "{tmp}/fifo"), ["--prompt-cache-file", "not a regular file"]),
    (("--prompt-cache-file", "{tmp}/missing"), ["--prompt-cache-file", "missing does not exist"]),
    # once silently ignored
    (("--prompt-cache-file", "{tmp}/missing", "--system-prompt", "Be brief."),
     ["--system-prompt belongs to the cached prompt"]),
])
def test_bad_flags_fail_before_the_model_loads(no_model_load, capsys, tmp_path, flags, fragments):
    if any(f in flags for f in ("/dev/full", "/dev/zero")) and not Path(flags[1]).exists():
        pytest.skip(f"no {flags[1]} here")
    (tmp_path / "deep.json").write_text("[" * 200_000)
    (tmp_path / "big.json").write_text(" " * ((1 << 20) + 1))
    (tmp_path / "c.safetensors").write_bytes(b"kept")
    (tmp_path / "p.txt").write_text("kept")
    os.mkfifo(tmp_path / "fifo")
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    line = main_error(capsys, *flags)
    assert all(f in line for f in fragments), line
    assert (tmp_path / "c.safetensors").read_bytes() == b"kept"
    assert (tmp_path / "p.txt").read_text() == "kept"


def test_sampling_values_the_sampler_cannot_use_are_greedy():
    """Once --temp 1e-300 or top-p 5e-324 sampled uniformly random tokens (1/T is infinite
    and 0 * inf NaN; the nucleus underflowed to nothing)."""
    import mlx.core as mx

    from mlx_lazy._args import MIN_TEMPERATURE, sampler

    mx.random.seed(3)
    logits = mx.random.normal((1, 384)) * 3
    for dtype in (mx.float32, mx.float16):
        logprobs = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).astype(dtype)
        best = mx.argmax(logprobs, axis=-1).item()
        for temp, top_p in ((1e-300, 1.0), (5e-324, 1.0), (MIN_TEMPERATURE / 2, 1.0),
                            (1.0, 5e-324), (1.0, 1e-300)):
            draws = {sampler(temp, top_p)(logprobs).item() for _ in range(30)}
            assert draws == {best}, (dtype, temp, top_p, draws)
        # just above the bounds it still samples, and lands on tokens the logits favour
        assert len({sampler(1.0, 1.0)(logprobs).item() for _ in range(30)}) > 1


@pytest.mark.parametrize("dest, fragments", [
    ("", ["--prompt-cache-file is empty"]),
    ("{tmp}", ["is a folder"]),
    ("{tmp}/fifo", ["not a regular file"]),  # once replaced by a regular file, exit 0
    ("/dev/null", ["not a regular file"]),  # as root, a system device node was replaced
    ("{tmp}/no/such/c.safetensors", ["folder", "does not exist"]),  # once after the prefill
    ("/proc/c.safetensors", ["cannot write --prompt-cache-file /proc/c.safetensors: cannot "
                             "create a file in /proc"]),
])
def test_cache_prompt_refuses_a_destination_before_the_model_loads(no_model_load, capsys,
                                                                   tmp_path, dest, fragments):
    from mlx_lazy import cache_prompt

    os.mkfifo(tmp_path / "fifo")
    dest = dest.replace("{tmp}", str(tmp_path))
    assert cache_prompt.main(["-p", "a document", "--prompt-cache-file", dest]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and all(f in lines[0] for f in fragments), lines
    assert (tmp_path / "fifo").is_fifo() and sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]


def test_cache_prompt_never_writes_over_its_prompt_file(no_model_load, capsys, tmp_path,
                                                         monkeypatch):
    from mlx_lazy import cache_prompt

    (tmp_path / "p.txt").write_text("a document")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "link").symlink_to("p.txt")
    for dest in ("p.txt", str(tmp_path / "p.txt"), "./p.txt"):
        assert cache_prompt.main(["--prompt-file", "p.txt", "--prompt-cache-file", dest]) == 2
        line = capsys.readouterr().err.strip()
        assert "--prompt-cache-file" in line and "is also --prompt-file's file" in line, line
    # the prompt read through a link is the file the link names
    assert cache_prompt.main(["--prompt-file", "link", "--prompt-cache-file", "p.txt"]) == 2
    assert "is also --prompt-file's file" in capsys.readouterr().err
    assert (tmp_path / "p.txt").read_text() == "a document"
    # The cache is renamed onto its name: a link (or a hard link) there is replaced, not
    # written through, so the prompt it points at is safe and the run goes on to the model.
    os.link(tmp_path / "p.txt", tmp_path / "hard")
    for dest in ("link", "hard"):
        with pytest.raises(AssertionError, match="the model was loaded"):
            cache_prompt.main(["--prompt-file", "p.txt", "--prompt-cache-file", dest])


def test_a_prompt_on_stdin_is_read_up_to_the_limit(no_model_load, monkeypatch, capsys):
    monkeypatch.setattr(prompt_input, "PROMPT_MAX_BYTES", 8)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"123456789")))
    assert "stdin is larger than the limit of 8 bytes" in main_error(capsys, "-p", "-")


def test_a_pool_beyond_the_context_is_refused_before_any_run(tiny_model_path, capsys):
    context = json.loads((tiny_model_path / "config.json").read_text())["max_position_embeddings"]
    line = main_error(capsys, "--model", str(tiny_model_path), "-p", "hi", "--method", "lazy",
                      "--scorer", f"last:pool={context + 1}")
    assert f"pool={context + 1} is more than the model's context of {context} tokens" in line
    # the case: a radius of 10**9 once padded 7.45 GiB of scores
    assert "pool=1000000000 is more than" in main_error(
        capsys, "--model", str(tiny_model_path), "-p", "hi", "--method", "lazy",
        "--scorer", "last:pool=1000000000")


def test_stats_json_probe_leaves_no_file(capsys, tmp_path):
    out = tmp_path / "stats.json"
    main_error(capsys, "--stats-json", str(out), "--model", str(tmp_path / "missing"))
    assert not out.exists()


def test_verbose_reads_like_mlx_lm_and_warns_on_other_words(capsys):
    parse = cli.build_parser().parse_args
    assert parse(["--verbose", "False"]).verbose is False
    assert parse(["--verbose", "f"]).verbose is False
    assert parse(["--verbose", "True"]).verbose is True
    assert capsys.readouterr().err == ""
    assert parse(["--verbose", "maybe"]).verbose is True  # as mlx-lm reads it
    assert capsys.readouterr().err.strip() == (
        "warning: read 'maybe' as True, as mlx-lm does; write True or False")


def test_errors_found_after_loading_come_before_any_run(tiny_model_path, capsys, tmp_path):
    """A SPEED cutoff with no room for the preset cut, or more anchors than prompt tokens:
    one line, before the baseline run of --compare prints anything."""
    model = str(tiny_model_path)
    line = main_error(capsys, "--model", model, "-p", "hi", "--method", "lazy+speed",
                      "--speed-cutoff", "1")
    assert "SPEED cutoff 1 leaves no room" in line and "[-1]" not in line
    line = main_error(capsys, "--model", model, "-p", "hi", "--method", "lazy",
                      "--anchors", "1000", "--compare", "--ignore-chat-template")
    assert "anchors=1000 is more than the prompt's" in line


def test_broken_model_folder_is_one_line(tiny_model_path, tmp_path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_path, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert "model.safetensors is truncated" in main_error(capsys, "--model", str(folder))


@pytest.mark.parametrize("error", [ValueError("internal shape bug"), OSError(5, "I/O error"),
                                   RuntimeError("boom")])
def test_internal_errors_are_not_reported_as_bad_input(monkeypatch, error):
    """Only UserInputError is bad input (exit 2); anything else keeps its traceback (exit 1
    once it leaves main)."""

    def fail(args, group=None):
        raise error

    monkeypatch.setattr(cli, "_run", fail)
    with pytest.raises(type(error)):
        cli.main(["-p", "hi"])


def test_ctrl_c_in_main_is_one_line(monkeypatch, capsys):
    def interrupted(args, group=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_run", interrupted)
    assert cli.main(["-p", "hi"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["interrupted"]


@pytest.mark.slow  # runs a process of its own
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_ctrl_c_while_importing_is_one_line(tiny_model_path):
    """SIGINT once mlx is loaded, while mlx-lm and transformers are still importing (or,
    on a fast machine, a little later): one line and the SIGINT exit status, no traceback.
    The tool gets SIGINT's default disposition: a shell starts background jobs with SIGINT
    ignored, Python then installs no handler, and the signal would be lost."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_lazy.generate", "--model", str(tiny_model_path), "-p", "hi"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if "libmlx" in maps.read_text():
                break
        except OSError:
            pass
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode in (130, -signal.SIGINT), err.decode()
    assert err.decode().strip().splitlines() == ["interrupted"]


def _with_the_hook(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with the tools' exception hook installed."""
    hooked = "import sys\nfrom mlx_lazy import _interrupt\nsys.excepthook = _interrupt._hook\n"
    return subprocess.run([sys.executable, "-c", hooked + code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_ctrl_c_turned_into_an_import_error_is_one_line():
    """What CI once hit: SIGINT while mlx.core initialised reached the hook as the ImportError
    the extension raised from the KeyboardInterrupt. Still one line and the SIGINT status."""
    done = _with_the_hook("try:\n"
                          "    raise KeyboardInterrupt\n"
                          "except KeyboardInterrupt as error:\n"
                          "    raise ImportError('Encountered an error while initializing the "
                          "extension.') from error\n")
    assert done.returncode in (130, -signal.SIGINT), done.stderr
    assert done.stderr.strip().splitlines() == ["interrupted"]


def test_ctrl_c_is_held_back_until_the_block_ends(monkeypatch):
    from mlx_lazy import _interrupt

    monkeypatch.setattr(_interrupt, "running_a_tool", lambda: True)
    # Python's own handler, as in a tool run from a terminal (a runner started in the
    # background of a non-interactive shell inherits SIGINT ignored, and held() leaves that be)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    reached_the_end = False
    try:
        with pytest.raises(KeyboardInterrupt):
            with _interrupt.held():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)  # Python runs signal handlers between bytecodes: here, if not held
                reached_the_end = True
        assert reached_the_end
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)


def test_an_import_error_of_its_own_keeps_its_traceback():
    done = _with_the_hook("raise ImportError('no such module')\n")
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "no such module" in done.stderr


@pytest.mark.parametrize("orig_argv, argv0, expected", [
    (["python", "-m", "mlx_lazy.generate", "-p", "hi"], "-m", True),
    (["python", "-X", "dev", "-m", "mlx_lazy.convert"], "-m", True),
    (["python", "-mmlx_lazy.bench"], "-m", True),
    (["python", "-m", "pytest", "tests"], "-m", False),
    (["python", "script.py", "-m", "mlx_lazy.generate"], "script.py", False),
    (["python", "-c", "import mlx_lazy"], "-c", False),
    (["/venv/bin/python", "/venv/bin/mlx-lazy-generate"], "/venv/bin/mlx-lazy-generate", True),
])
def test_tool_detection_for_the_ctrl_c_hook(monkeypatch, orig_argv, argv0, expected):
    from mlx_lazy import _interrupt

    monkeypatch.setattr(sys, "orig_argv", orig_argv)
    monkeypatch.setattr(sys, "argv", [argv0])
    assert _interrupt.running_a_tool() is expected


def test_demo_bad_model_is_one_line_exit_2(tmp_path, capsys):
    from mlx_lazy import demo

    assert demo.main(["--model", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot load model"), err


@pytest.mark.parametrize("argv, message", [
    (["--max-tokens", "0"], "--max-tokens must be at least 1"),  # mlx-lm's traceback once
    (["--max-tokens", "-1"], "--max-tokens must be at least 1"),
    ([], "but the model's context is 4096 tokens"),  # 6,285 tokens: mlx-lm ran past it
])
def test_demo_bad_values_are_one_line_before_any_run(tiny_model_path, capsys, argv, message):
    from mlx_lazy import demo

    try:
        status = demo.main(["--model", str(tiny_model_path), *argv])
    except SystemExit as e:
        status = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and message in err[-1] and "[mlx-lm" not in "".join(err), err


def test_the_demo_takes_the_generate_commands_pruning_flags(tiny_model_path, capsys,
                                                           monkeypatch, tmp_path):
    """The README's demo runs with --complete exact and --quality high (the flags it talked
    about were the generate command's only); full is refused, a bad combination too."""
    from mlx_lazy import demo

    monkeypatch.setattr(demo, "demo_text", lambda: "The signers pledge their lives. " * 20)
    model = ["--model", str(tiny_model_path), "--max-tokens", "2"]
    assert demo.main([*model, "--complete", "exact"]) == 0
    assert "[mlx-lazy, lazy:complete=exact] ..." in capsys.readouterr().out
    # a schedule file runs its own method (the demo's default once stood against it)
    from mlx_lazy import load
    from mlx_lazy.adapter import ModelAdapter
    from mlx_lazy.config import PruningConfig
    from mlx_lazy.schedule_files import write_schedule

    fingerprint = ModelAdapter(load(str(tiny_model_path))[0]).fingerprint()
    schedule = write_schedule(tmp_path / "demo-speed.json", PruningConfig(
        "lazy+speed", prune_layers=(1,), keep=(0.5,), speed_cutoff=3), fingerprint, {})
    assert demo.main([*model, "--schedule", str(schedule)]) == 0
    assert "[mlx-lazy, lazy+speed:" in capsys.readouterr().out
    for argv, message in ((["--method", "full"], "choose one other than full"),
                          (["--complete", "exact", "--no-revive"], "revive=False keeps")):
        try:
            status = demo.main([*model, *argv])
        except SystemExit as e:
            status = e.code
        err = capsys.readouterr().err.strip().splitlines()
        assert status == 2 and len(err) == 1 and message in err[0], err


def test_an_answer_past_the_context_names_the_option_as_the_command_line_spells_it(
        tiny_model_path, capsys):
    context = json.loads((tiny_model_path / "config.json").read_text())["max_position_embeddings"]
    line = main_error(capsys, "--model", str(tiny_model_path), "-p", "hi", "-m",
                      str(context + 1))
    assert f"exceeds the model's context of {context} tokens (lower -m/--max-tokens)" in line


def test_a_system_prompt_without_the_chat_template_is_refused(tiny_model_path, capsys):
    """mlx-lm drops it without a word; the answer would be to another question."""
    line = main_error(capsys, "--model", str(tiny_model_path), "-p", "hi", "--system-prompt",
                      "Answer in French.", "--ignore-chat-template")
    assert "--system-prompt goes into the chat template, which --ignore-chat-template" in line
