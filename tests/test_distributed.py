"""Tensor parallelism over ``mx.distributed``: 2 and 3 ranks on this machine through
``mlx.launch`` (ring backend, 127.0.0.1), against single-process mlx-lm and mlx-lazy.

Each launch runs tests/distributed_worker.py (or the installed console script) on every
rank and is bounded in time, so a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import List

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_lazy import LazyEngine, PruningConfig, UserInputError, distributed, resolve_config
from mlx_lazy.adapter import ModelAdapter
from mlx_lazy.cli import main as cli_main

from distributed_worker import greedy_run
from numerics import rel_err
from tiny_models import tiny_config

WORKER = Path(__file__).with_name("distributed_worker.py")
LAUNCH = Path(sys.executable).with_name("mlx.launch")
TIMEOUT = 240  # seconds per launch of tiny models: Python processes sharing two slow cores
SLOW_TIMEOUT = 900  # seconds per launch of a real model
LAUNCHER_INPUT = 1 << 18  # bytes: 4 pipes' worth (Linux: 64 KiB, macOS: 16-64 KiB)
# many cuts: revivals in decode (none: nothing completes)
LAZY = {"prune_layers": [0, 1, 2], "keep": [0.5, 0.3, 0.2], "complete": "none"}
STEPS = 16
# Decode steps of the real models' runs, whose sharded steps are the slow part (two all-sums
# per layer, each a wait for every rank on two shared cores): their cuts complete exactly (what
# their configs resolve to), so the first step carries every pruned token through the layers
# above the cuts and the steps after it decode the completed cache, as every further step would.
# The tiny model's runs decode STEPS, re-selecting and reviving at each.
REAL_STEPS = 4

pytestmark = pytest.mark.skipif(
    not mx.distributed.is_available() or not LAUNCH.exists(),
    reason="mx.distributed or mlx.launch unavailable",
)


def free_port(n: int) -> int:
    """A port p such that p .. p + n - 1 were free a moment ago (the ring listens on them),
    drawn below the kernel's ephemeral range: there the kernel may hand one of them to an
    outgoing connection (the ranks' own connects to each other) before a rank binds it (a
    suite run once failed so: "[ring] Couldn't bind socket (error: 98)")."""
    rng = random.Random()
    while True:
        port = rng.randrange(10_000, _ephemeral_low() - n)
        if all(_free(port + i) for i in range(n)):
            return port


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default (macOS's range starts higher, at 49152)


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def launch(n: int, *command: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """Run ``command`` (a script and its arguments) on ``n`` ranks; past ``timeout`` seconds
    the launcher and every rank are killed and the test fails."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    cmd = [str(LAUNCH), "-n", str(n), "--backend", "ring", "--starting-port", str(free_port(n)),
           "--python", sys.executable, "--", *command]
    stdin, feed = os.pipe()
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, stdin=stdin, start_new_session=True)
    finally:
        os.close(stdin)  # the launcher's alone: it ending ends our writes (BrokenPipeError)
    writer = threading.Thread(target=idle_launcher, args=(feed,), daemon=True)
    writer.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the ranks too, not only the launcher
        out, err = proc.communicate()
        pytest.fail(f"{n} ranks still running after {timeout} s:\n{out}\n{err}")
    finally:
        writer.join(timeout=10)  # the launcher ended: its write has too (written or refused)
        if not writer.is_alive():  # else left open: closed, its number could be reused
            os.close(feed)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def idle_launcher(feed: int) -> None:
    """Keep mlx.launch from spinning, so that the ranks have the cores: it forwards its
    standard input to every rank's and polls each rank's input pipe for room to write,
    which an empty pipe always has, so each forwarding thread busy-loops (and its main
    thread too once its input ends). On 2 cores an all-sum of 896 floats between 2 ranks
    took ~18 ms so, ~0.3 ms without. Bytes that the ranks never read, more than a pipe
    holds, fill every rank's input pipe (the launcher keeps the rest), and ``feed`` left
    open until the launcher ends keeps its own input from ending: then every loop waits in
    ``select``."""
    try:
        os.write(feed, bytes(LAUNCHER_INPUT))
    except OSError:  # the launcher ended first, or its input was closed
        pass


def run_engines(tmp_path: Path, model_dir: Path, n: int, configs: dict, prompt_len: int = 200,
                timeout: float = TIMEOUT, steps: int = STEPS, checks: bool = True):
    """Every method of ``configs`` sharded over ``n`` ranks, ``steps`` decode steps each; per
    method, each rank's record and logits. ``checks``: the ranks also write the worker's
    checks-rank*.json (which only ``two_rank_runs``' tests read)."""
    return run_many_engines(tmp_path, [model_dir], n, configs, prompt_len, timeout, steps,
                            checks)[0]


def run_many_engines(tmp_path: Path, model_dirs: List[Path], n: int, configs: dict,
                     prompt_len: int = 200, timeout: float = TIMEOUT, steps: int = STEPS,
                     checks: bool = False) -> List[dict]:
    """:func:`run_engines` for each of ``model_dirs`` in one launch (each launch costs every
    rank's start): per model, per method, each rank's record and logits."""
    r = launch(n, str(WORKER), "engine", str(tmp_path), *map(str, model_dirs),
               "--configs", json.dumps(configs), "--prompt-len", str(prompt_len),
               "--steps", str(steps), *(() if checks else ("--no-checks",)), timeout=timeout)
    assert r.returncode == 0, r.stderr
    outs = []
    for i in range(len(model_dirs)):
        folder = tmp_path / str(i) if len(model_dirs) > 1 else tmp_path
        out = {}
        for method in configs:
            try:
                out[method] = [(json.loads((folder / f"{method}-rank{k}.json").read_text()),
                                np.load(folder / f"{method}-rank{k}.npy")) for k in range(n)]
            except FileNotFoundError:
                pytest.fail(f"rank output of {method} missing:\n{r.stdout}\n{r.stderr}")
        outs.append(out)
    return outs


def single_process(model, config: PruningConfig, prompt_len: int = 200, steps: int = STEPS):
    """Greedy tokens, logits, stats and selection digests of the unsharded engine on the
    worker's prompt."""
    prompt = np.random.default_rng(0).integers(0, ModelAdapter(model).vocab_size, prompt_len)
    engine = LazyEngine(model, resolve_config(model, config))
    tokens, logits, selections = greedy_run(engine, prompt, steps)
    return tokens, logits, engine.stats, selections


def mlx_lm_logits(model, tokens, prompt_len: int = 200) -> np.ndarray:
    """mlx-lm's own logits along ``tokens`` (teacher-forced) on the worker's prompt."""
    prompt = np.random.default_rng(0).integers(0, ModelAdapter(model).vocab_size, prompt_len)
    cache = make_prompt_cache(model)
    logits = [model(mx.array(prompt.astype(np.int32))[None], cache=cache)[0, -1]]
    for t in tokens[:-1]:
        logits.append(model(mx.array([[t]]), cache=cache)[0, -1])
    return np.array(mx.stack(logits))


@pytest.fixture(scope="module")
def two_rank_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("two-ranks")


@pytest.fixture(scope="module")
def two_rank_runs(tiny_model_dir, two_rank_dir):
    """full, lazy (mean and max over heads, last-query and window scorers) and speed over 2
    ranks of the tiny llama (4 heads, 2 KV heads): one launch."""
    return run_engines(two_rank_dir, tiny_model_dir("llama"), 2, {
        "full": {}, "lazy": LAZY, "speed": {},
        "lazy-max": {"method": "lazy", **LAZY, "scorer": "last:heads=max"},
        "lazy-window": {"method": "lazy", **LAZY, "scorer": "window:size=8"}})


@pytest.mark.slow
def test_full_sharded_matches_mlx_lm(two_rank_runs, tiny_model):
    model, _ = tiny_model("llama")
    (rec0, logits0), (rec1, logits1) = two_rank_runs["full"]
    assert rec0["tokens"] == rec1["tokens"]
    np.testing.assert_array_equal(logits0, logits1)  # the all-sums leave every rank alike
    ref = mlx_lm_logits(model, rec0["tokens"])
    assert rel_err(logits0, ref) < 1e-5  # sharded all-sums: float32 sums in another order
    assert rec0["tokens"] == [int(t) for t in ref.argmax(axis=-1)]


@pytest.mark.slow
def test_full_stats_count_the_model_allsums(two_rank_runs):
    stats = two_rank_runs["full"][0][0]["stats"]
    # o_proj and down_proj all-sum (tokens, hidden 64) float32 at every layer; in prefill
    # the last of the 4 layers computes only the newest of the 200 tokens.
    row = 2 * 64 * 4
    assert stats["allsum_bytes"] == row * (3 * 200 + 1 + 4 * STEPS)
    assert stats["ranks"] == 2 and stats["score_allsum_bytes"] == 0


@pytest.mark.slow
def test_lazy_sharded_selects_alike_and_matches_single_process(two_rank_runs, tiny_model):
    model, _ = tiny_model("llama")
    (rec0, _), (rec1, _) = two_rank_runs["lazy"]
    # 3 cuts in prefill and in each of the 16 decode steps.
    assert len(rec0["selections"]) == 3 * (STEPS + 1)
    assert rec0["selections"] == rec1["selections"]
    stats = rec0["stats"]
    assert stats["revivals"] > 0 and stats["score_allsum_bytes"] > 0
    tokens, _, single, selections = single_process(model, PruningConfig("lazy", **LAZY))
    assert rec0["tokens"] == tokens and rec0["selections"] == selections
    assert stats["revivals"] == single.revivals
    assert stats["tokens_computed_per_layer"] == single.tokens_computed_per_layer


@pytest.mark.slow
@pytest.mark.parametrize("run, fields", [("lazy-max", {"scorer": "last:heads=max"}),
                                         ("lazy-window", {"scorer": "window:size=8"})])
def test_every_head_reduction_and_scorer_selects_as_one_process(two_rank_runs, tiny_model, run,
                                                                 fields):
    """Max over heads needs an all-max, the window scorer reduces (m, n) scores: both must
    select exactly what the unsharded engine selects."""
    model, _ = tiny_model("llama")
    (rec0, _), (rec1, _) = two_rank_runs[run]
    tokens, _, _, selections = single_process(model, PruningConfig("lazy", **LAZY, **fields))
    assert rec0["selections"] == rec1["selections"] == selections
    assert rec0["tokens"] == tokens


@pytest.mark.slow
def test_cross_rank_reductions_and_rank0_token(two_rank_runs, two_rank_dir):
    checks = [json.loads(p.read_text()) for p in sorted(two_rank_dir.glob("checks-rank*.json"))]
    assert len(checks) == 2
    for c in checks:
        assert c["mean"] == [[2.0, 3.0]]  # (1+3)/2, (4+2)/2: the mean over all heads
        assert c["max"] == [[3.0, 4.0]]
        assert c["from_rank0"] == 5
        assert c["sampled"] == [5, 5, 5, 5]  # rank 1's sampler drew 6: rank 0's token wins


def test_ranks_that_disagree_or_save_a_cache_are_refused_on_every_rank(two_rank_runs,
                                                                      two_rank_dir):
    """Through the API, ranks given different prompts would run different all-sums (a
    wrong answer or a hang): every rank raises instead. A prompt-cache file of a sharded
    model would hold one rank's heads: refused."""
    checks = [json.loads(p.read_text()) for p in sorted(two_rank_dir.glob("checks-rank*.json"))]
    for c in checks:
        assert "the prompts differ between rank 0 and rank 1" in c["refused"]["prompts"]
        assert "cannot save prompt cache files on a model sharded" in c["refused"]["cache file"]
    assert not list(two_rank_dir.glob("cache-rank*"))


@pytest.mark.slow
def test_speed_sharded_kv_is_split_over_ranks(two_rank_runs, tiny_model):
    model, _ = tiny_model("llama")
    (rec0, _), (rec1, _) = two_rank_runs["speed"]
    _, _, single, _ = single_process(model, PruningConfig("speed"))
    assert rec0["tokens"] == rec1["tokens"]
    for rec in (rec0, rec1):
        assert 2 * rec["stats"]["kv_bytes"] == single.kv_bytes
        assert [2 * b for b in rec["stats"]["kv_bytes_per_layer"]] == single.kv_bytes_per_layer


@pytest.mark.slow
def test_console_script_under_mlx_launch(tiny_model_dir, tmp_path, capsys):
    """The installed entry point, unchanged: rank 0 alone prints and writes the stats."""
    script = shutil.which("mlx-lazy-generate", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("mlx-lazy-generate is not installed next to this Python")
    args = ["--model", str(tiny_model_dir("llama")), "-p", "the quick brown fox " * 20,
            "--method", "lazy", "--prune-layers", "1,2", "--keep", "0.5,0.3", "-m", "8",
            "--verbose", "False"]
    r = launch(2, script, *args, "--stats-json", str(tmp_path / "stats.json"))
    assert r.returncode == 0 and "error" not in r.stderr, r.stderr
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["ranks"] == 2 and stats["allsum_bytes"] > 0 and stats["score_allsum_bytes"] > 0
    assert cli_main(args) == 0
    single = capsys.readouterr().out
    assert r.stdout == single  # the same text, printed once


def _cli_fails(tmp_path: Path, n: int, model: Path, *worker_args: str,
               flags: tuple = ()) -> str:
    r = launch(n, str(WORKER), "cli", str(tmp_path), *worker_args, "--",
               "--model", str(model), "-p", "hello " * 30, "-m", "4", "--verbose", "False",
               *flags)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    return errors[0]


@pytest.mark.slow
def test_bad_path_on_one_rank_ends_every_rank(tiny_model_path, tmp_path):
    missing = shlex.quote(str(tmp_path / "missing"))
    line = _cli_fails(tmp_path, 2, tiny_model_path, f"--rank1-args=--model {missing}")
    assert "rank 1" in line and "no such folder" in line
    assert [(tmp_path / f"rank{k}.rc").read_text() for k in range(2)] == ["2", "2"]


@pytest.mark.slow
def test_different_model_files_on_one_rank(tiny_model_path, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny_model_path, other)
    data = bytearray((other / "model.safetensors").read_bytes())
    data[-4:] = bytes(4)  # one weight changed
    (other / "model.safetensors").write_bytes(bytes(data))
    line = _cli_fails(tmp_path, 2, tiny_model_path,
                      f"--rank1-args=--model {shlex.quote(str(other))}")
    assert "model files differ between rank 0 and rank 1" in line
    assert [(tmp_path / f"rank{k}.rc").read_text() for k in range(2)] == ["2", "2"]


@pytest.mark.slow
@pytest.mark.parametrize("rank1_args, differ", [
    ("--prune-layers 1 --keep 0.5", "pruning settings"),  # the case: it hung
    ("--temp 0.5", "generation options"),
])
def test_ranks_given_different_flags_fail_together(tiny_model_path, tmp_path, rank1_args, differ):
    """Different cuts make the ranks' all-sums disagree in number: without the check they
    wait for each other forever (bounded here by TIMEOUT)."""
    line = _cli_fails(tmp_path, 2, tiny_model_path, f"--rank1-args={rank1_args}",
                      flags=("--method", "lazy"))
    assert f"the {differ} differ between rank 0 and rank 1" in line
    assert [(tmp_path / f"rank{k}.rc").read_text() for k in range(2)] == ["2", "2"]


@pytest.mark.slow
def test_heads_not_divisible_by_ranks(tiny_model_path, tmp_path):
    line = _cli_fails(tmp_path, 3, tiny_model_path)  # 4 heads over 3 ranks
    assert "4 attention heads cannot be split evenly over 3 ranks" in line
    assert [(tmp_path / f"rank{k}.rc").read_text() for k in range(3)] == ["2"] * 3


@pytest.mark.slow
def test_killed_rank_ends_the_run(tiny_model_path, tmp_path):
    r = launch(2, str(WORKER), "cli", str(tmp_path), "--kill-rank1-at", "2", "--",
               "--model", str(tiny_model_path), "-p", "hello " * 30, "-m", "32",
               "--verbose", "False")  # bounded by TIMEOUT: a hang fails here
    assert not (tmp_path / "rank1.rc").exists()
    assert "rank 1 exited with code -9" in r.stderr, r.stderr
    # Rank 0 reports the lost rank itself, unless mlx.launch stopped it first.
    reported = "error: another rank stopped (failed or was killed)" in r.stderr
    stopped = "rank 0 was killed" in r.stderr or "rank 0 exited with code -15" in r.stderr
    assert reported or stopped, r.stderr
    rc0 = tmp_path / "rank0.rc"
    assert not rc0.exists() or rc0.read_text() == "1"


# MoE layers have no mlp.gate_proj; GPT-2's config names its heads n_head, Step-3.5's its
# key/value heads num_attention_groups
@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "gpt2", "step3p5"])
def test_shard_checks_head_counts_before_sharding(tiny_model, kind):
    class Group:
        def size(self):
            return 3

    model, _ = tiny_model(kind)
    with pytest.raises(UserInputError, match="4 attention heads .* over 3 ranks"):
        distributed.shard(model, Group())
    assert distributed.model_group(model) is None  # left unsharded


def test_shard_checks_qwens_mlp_width_before_sharding():
    """Qwen 1's MLP is half its intermediate_size wide: 132 divides over 4 ranks, its 66-wide
    MLP does not."""
    from mlx_lm.models import qwen

    class Group:
        def size(self):
            return 4

    model = qwen.Model(qwen.ModelArgs.from_dict({**tiny_config("qwen"), "intermediate_size": 132}))
    with pytest.raises(UserInputError, match="66 MLP width cannot be split evenly over 4 ranks"):
        distributed.shard(model, Group())
    assert distributed.model_group(model) is None


def test_shard_checks_step3p5s_sliding_window_heads_before_sharding():
    """Step-3.5's sliding-window layers have heads of their own (``attention_other_setting``):
    4 query and 2 key/value heads divide over 2 ranks, the sliding layers' 3 key/value heads do
    not."""
    from mlx_lm.models import step3p5

    class Group:
        def size(self):
            return 2

    other = {"num_attention_heads": 6, "num_attention_groups": 3}
    model = step3p5.Model(step3p5.ModelArgs.from_dict({**tiny_config("step3p5"),
                                                       "attention_other_setting": other}))
    with pytest.raises(UserInputError, match="3 sliding-window key/value heads cannot be split"):
        distributed.shard(model, Group())
    assert distributed.model_group(model) is None


def test_shard_checks_minimax_m3s_indexer_heads_before_sharding():
    """MiniMax-M3's sparse layers' indexer has heads of its own, split with the query heads:
    4 query and 2 key/value heads divide over 2 ranks, 3 indexer heads do not."""
    from mlx_lm.models import minimax_m3_vl

    class Group:
        def size(self):
            return 2

    config = tiny_config("minimax_m3_vl")
    config["text_config"]["sparse_attention_config"]["sparse_num_index_heads"] = 3
    model = minimax_m3_vl.Model(minimax_m3_vl.ModelArgs.from_dict(config))
    with pytest.raises(UserInputError, match="3 indexer heads cannot be split evenly"):
        distributed.shard(model, Group())
    assert distributed.model_group(model) is None


@pytest.mark.parametrize("kind", ["olmo2", "olmo3", "gemma4_text", "qwen3_5", "qwen3_next",
                                  "ernie4_5_moe", "apertus",
                                  "mixtral", "qwen2_moe", "olmoe", "granitemoe", "phimoe",
                                  "lfm2", "lfm2_moe", "dots1", "bailing_moe", "hunyuan",
                                  "llama4_text", "llama4", "gpt_bigcode", "openelm", "deepseek",
                                  "mellum", "granitemoehybrid", "nemotron_h", "jamba", "Klear",
                                  "afmoe", "lfm2-vl", "kimi_vl", "dbrx", "phixtral",
                                  "mimo_v2_flash", "nemotron-nas", "plamo3", "laguna",
                                  "talkie", "bailing_moe_v3", "longcat_flash", "falcon_h1",
                                  "plamo2", "lille-130m", "plamo", "recurrent_gemma", "afm7",
                                  "baichuan_m1", "olmo_hybrid", "kimi_linear",
                                  "bailing_moe_linear", "bailing_hybrid", "gemma3n",
                                  "muse_glimmer", "spark2_5", "phi3small",
                                  "prism_hadamard_qwen35", "longcat_flash_ngram", "muse_spark",
                                  "kimi_k3"])
def test_a_model_no_sharder_splits_is_refused(tiny_model, kind):
    """OLMo's q/k norms span every head: split by heads they would normalise each rank's share
    alone; Gemma 4's global layers have one key/value head; ERNIE 4.5's, Mixtral's, Qwen2-MoE's,
    OLMoE's, Granite MoE's, Phi-3.5-MoE's, dots.llm1's, Ling's, Hunyuan's, Llama 4's, Klear's,
    AFM's, DeepSeek-MoE's, Mellum's and Laguna's MoE blocks have no split here, nor mlx-lm's dense
    llama4_text's MLP (at ``feed_forward``), Apertus's layers (plain up_proj MLP, heads named
    otherwise), OpenELM's (heads by layer, a fused q/k/v and gate/up), LFM2's convolutions,
    StarCoder 1's one key/value head (multi-query), Granite 4.0's, Nemotron-H's and Jamba's
    layers (Mamba, shared MLPs), LFM2-VL's (LFM2's), Kimi-VL's (DeepSeek-V3's absorbed
    attention and experts, its wrapper without a ``shard``), MiMo-V2-Flash's (heads and
    sinks by layer, MoE blocks), Nemotron-NAS's layers (linear maps for attention), PLaMo
    3's (a fused q/k/v of unequal parts), Talkie's (its parts named otherwise, a gain per
    head), Ling 2.5's, Kimi Linear's or Kimi K3's (Kimi Delta Attention, latent attention,
    experts; mlx-lm splits Kimi K3's, the engine runs its KDA layers whole) or OLMo
    Hybrid's (Gated DeltaNet, OLMo's q/k norms) or Ring-linear's and Ling 2.5 linear's
    (lightning attention, experts). Refused (mlx-lm
    has no ``shard`` for them either; LongCat-Flash's blocks of two attentions and a
    shortcut MoE it splits, the engine's layers are half of one: refused here, as with an n-gram
    embedding). Qwen3.5's
    linear-attention layers are not split here (mlx-lm's ``shard`` splits them, but the engine
    runs them whole; nor those of its Hadamard packs). Nor DBRX's and Phixtral's experts,
    Lille's fused q/k/v (its norms inside its modules), PLaMo 1's tiled key/value heads, Muse
    Glimmer's output gate (a projection beside q_proj) or Spark 2.5's fused q/k/v and gate per
    head (mlx-lm has no ``shard`` for any), nor Phi-3-small's layers (block-sparse patterns by
    each head's index among all heads). Nor Muse Spark's (mlx-lm's shard splits its head, which
    its own forward gathers, and its experts' compressed projections)."""
    class Group:
        def size(self):
            return 2

    model, _ = tiny_model(kind)
    with pytest.raises(UserInputError, match=f"cannot shard '{kind}' models"):
        distributed.shard(model, Group())
    assert distributed.model_group(model) is None


#: Families split over two ranks in one launch (:func:`test_families_over_two_ranks`)
TWO_RANK_KINDS = ["gemma3_text", "smollm3", "mistral3", "granite", "gpt_oss",
                  "exaone4", "glm4_moe", "seed_oss", "ernie4_5", "deepseek_v3",
                  "glm4_moe_lite", "deepseek_v2", "gemma2", "cohere2", "helium",
                  "internlm3", "starcoder2", "hunyuan_v1_dense", "minicpm", "mimo",
                  "exaone", "stablelm-parallel", "nanochat", "gemma", "cohere",
                  "phi", "gpt_neox", "internlm2", "qwen", "gpt2", "nemotron",
                  "nanbeige", "minicpm3", "youtu_llm", "glm", "telechat3", "solar_open", "glm4",
                  "mistral4", "exaone_moe", "qwen3_vl_moe", "kimi_k25", "gptj", "minimax",
                  "deepseek_v32", "iquestloopcoder", "minimax_m3_vl"]
#: What each of them runs over two ranks and in one process
TWO_RANK_LAZY = {"prune_layers": [0, 2], "keep": [0.5, 0.3]}


@pytest.fixture(scope="module")
def families_two_rank_runs(tiny_model_dir, tmp_path_factory) -> dict:
    """Each of :data:`TWO_RANK_KINDS`, full and lazy over two ranks: one launch."""
    runs = run_many_engines(tmp_path_factory.mktemp("families-two-ranks"),
                            [tiny_model_dir(kind) for kind in TWO_RANK_KINDS], 2,
                            {"full": {}, "lazy": TWO_RANK_LAZY},
                            timeout=TIMEOUT * len(TWO_RANK_KINDS) / 4)
    return dict(zip(TWO_RANK_KINDS, runs))


@pytest.mark.parametrize("kind", TWO_RANK_KINDS)
def test_families_over_two_ranks(tiny_model, families_two_rank_runs, kind):
    """Models whose mlx-lm module cannot shard itself (:func:`distributed.shard_by_heads`; Gemma
    2's soft-cap acts on each head's logits, whole on its rank; Command R7B's parallel branches
    each all-summed, StarCoder2's plain c_fc/c_proj MLP, Hunyuan's per-head q/k norms after RoPE
    whole on each rank, MiniCPM's heads named num_heads, its multipliers, EXAONE 3's and
    nanochat's projections named otherwise, StableLM's per-head q/k LayerNorms split with their
    heads and its parallel branches, Gemma 1's heads wider than hidden / heads, Command R+'s
    per-head q/k LayerNorm weights split with their heads, Phi-2's and GPT-NeoX's parallel
    branches, GPT-NeoX's fused q/k/v split by head, InternLM2's fused wqkv split by key/value
    head groups, Qwen 1's c_attn by thirds, its w2-gated MLP, GPT-2's fused c_attn split in its
    three parts and its learned positions whole on every rank, Nemotron's plain squared-ReLU MLP
    and its biases, Nanbeige's blocks split once though run twice, GLM-4-9B's fused gate_up_proj
    split in its two halves, TeleChat 3's biases, GPT-J's parallel branches and its fc_in/fc_out
    MLP), gpt-oss (mlx-lm's shard, its sinks split by
    head), GLM-4.5 and Solar Open (mlx-lm's glm4_moe shard: its MoE blocks sum their ranks'
    shares themselves), DeepSeek-V3, GLM-4.7-Flash and DeepSeek-V2 (mlx-lm's shard: each rank
    its heads' queries, embed_q and unembed_out or kv_b_proj, the latent whole on every rank;
    Mistral Small 4's too, its queries scaled by position on each rank; MiniCPM3's and
    Youtu-LLM's split the same way by shard_by_heads), K-EXAONE (mlx-lm's shard: its MoE blocks
    sum their ranks' shares), Qwen3-VL MoE (its text model's qwen3_moe shard: the wrapper has
    none), Kimi K2.5 (its wrapper's shard, DeepSeek-V3's) and MiniMax-M2 (mlx-lm's shard: its
    q/k norms over all heads split with them, their sums of squares all-summed), DeepSeek-V3.2
    (mlx-lm's shard, DeepSeek-V3's; its lightning indexer whole on every rank),
    IQuest-Loop-Coder (mlx-lm's shard: each rank its heads' loop gates) and MiniMax-M3 (mlx-lm's
    shard: per-head q/k norms, indexer heads with the query heads): unpruned,
    each rank's logits equal mlx-lm's; pruned, each rank selects what the single process
    selects and its logits equal it."""
    model = tiny_model(kind)[0]
    assert hasattr(model, "shard") == (kind in ("gpt_oss", "glm4_moe", "deepseek_v3",
                                                "glm4_moe_lite", "deepseek_v2", "solar_open",
                                                "mistral4", "exaone_moe", "kimi_k25",
                                                "minimax", "deepseek_v32", "iquestloopcoder",
                                                "minimax_m3_vl"))
    runs = families_two_rank_runs[kind]
    (rec0, logits0), (rec1, logits1) = runs["full"]
    assert rec0["tokens"] == rec1["tokens"] and rec0["stats"]["ranks"] == 2
    assert rel_err(logits0, mlx_lm_logits(model, rec0["tokens"])) < 1e-5
    tokens, logits, _, selections = single_process(model, PruningConfig("lazy", **{
        k: tuple(v) for k, v in TWO_RANK_LAZY.items()}))
    for rec, got in runs["lazy"]:
        assert rec["selections"] == selections and rec["tokens"] == tokens
        assert rel_err(got, logits) < 1e-5


@pytest.mark.slow
def test_smollm2_lazy_over_three_ranks(smollm2_path, smollm2, tmp_path):
    """SmolLM2's 9 heads and 3 KV heads split over 3 ranks."""
    model, _ = smollm2
    config = {"prune_layers": [10, 20], "keep": [0.4, 0.2]}
    runs = run_engines(tmp_path, smollm2_path, 3, {"lazy": config}, prompt_len=300,
                       timeout=SLOW_TIMEOUT, steps=REAL_STEPS, checks=False)["lazy"]
    selections = [rec["selections"] for rec, _ in runs]
    assert selections[0] == selections[1] == selections[2] and selections[0]
    assert all(rec["stats"]["ranks"] == 3 and rec["stats"]["allsum_bytes"] > 0
               for rec, _ in runs)  # sharded indeed
    tokens, logits, _, _ = single_process(model, PruningConfig("lazy", **config), prompt_len=300,
                                          steps=REAL_STEPS)
    assert runs[0][0]["tokens"] == tokens
    assert rel_err(runs[0][1], logits) < 1e-4  # 30 layers of sharded float32 sums in another order


@pytest.mark.slow
def test_qwen_full_and_lazy_over_two_ranks(qwen_path, tmp_path):
    """Qwen2.5-Coder-0.5B's 14 heads and 2 KV heads split over 2 ranks."""
    import mlx_lm

    lazy = {"prune_layers": [8, 16], "keep": [0.4, 0.2]}
    runs = run_engines(tmp_path, qwen_path, 2, {"full": {}, "lazy": lazy}, prompt_len=300,
                       timeout=SLOW_TIMEOUT, steps=REAL_STEPS, checks=False)
    model, _ = mlx_lm.load(str(qwen_path))
    (full0, logits0), (full1, _) = runs["full"]
    assert full0["tokens"] == full1["tokens"]
    assert all(rec["stats"]["ranks"] == 2 and rec["stats"]["allsum_bytes"] > 0
               for rec, _ in runs["full"])  # sharded indeed
    ref = mlx_lm_logits(model, full0["tokens"], prompt_len=300)
    assert rel_err(logits0, ref) < 1e-4  # 24 layers of float32 sums in another order
    assert full0["tokens"] == [int(t) for t in ref.argmax(axis=-1)]
    (lazy0, lazy_logits), (lazy1, _) = runs["lazy"]
    assert lazy0["selections"] == lazy1["selections"] and lazy0["selections"]
    tokens, logits, _, _ = single_process(model, PruningConfig("lazy", **lazy), prompt_len=300,
                                          steps=REAL_STEPS)
    assert lazy0["tokens"] == tokens
    assert rel_err(lazy_logits, logits) < 1e-4  # selected as one process does: the same cut


@pytest.mark.slow
def test_benchmark_counts_allsums(tiny_model_path, tmp_path):
    from mlx_lazy.bench import distributed as bench

    runs = bench.main(["--model", str(tiny_model_path), "--ranks", "1,2", "--length", "64",
                       "--max-tokens", "3", "--methods", "full,lazy", "--timeout", str(TIMEOUT),
                       "--out", str(tmp_path / "bench.json")])
    assert sorted((r["ranks"], r["method"]) for r in runs) == [
        (1, "full"), (1, "lazy"), (2, "full"), (2, "lazy")]
    full = next(r for r in runs if (r["ranks"], r["method"]) == (2, "full"))
    row = 2 * 64 * 4  # o_proj and down_proj outputs of one token, float32, hidden 64
    # Prefill: 3 of 4 layers over the 64 tokens, the last over the newest one. Decode: a
    # step per generated token (each is run through the model), 4 layers of one token each.
    assert full["prefill_allsum_bytes"] == row * (3 * 64 + 1)
    assert full["decode_allsum_bytes_per_step"] == row * 4
    assert full["prefill_allsum_s"] > 0
    assert all("prefill_allsum_bytes" not in r for r in runs if r["ranks"] == 1)


def test_the_ranks_decision_digest_covers_the_settings_read_from_the_environment(
        tiny_model, monkeypatch):
    """One rank launched with another ``$MLX_LAZY_MIN_KEEP`` or ``$MLX_LAZY_ATTENTION`` keeps
    other tokens: the digest the ranks compare before generating differs."""
    from mlx_lazy.api import decision_digest

    model, _ = tiny_model("llama")
    schedule = resolve_config(model, PruningConfig("lazy", prune_layers=(1,), keep=(0.5,)))
    base = decision_digest(schedule)
    from mlx_lazy import selection

    with monkeypatch.context() as m:
        m.setattr(selection, "MIN_KEEP", 3)  # what $MLX_LAZY_MIN_KEEP=3 gives at import
        assert decision_digest(schedule) != base
    with monkeypatch.context() as m:
        m.setenv("MLX_LAZY_ATTENTION", "fast")
        assert decision_digest(schedule) != base
    assert decision_digest(schedule) == base
