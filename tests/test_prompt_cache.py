"""Prompt caches: the lazy state kept across turns, trimmed, saved and loaded; completion of
pruned tokens from the Aux Cache."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.models.cache import make_prompt_cache as mlx_lm_make_prompt_cache

from mlx_lazy import (LazyEngine, PruningConfig, UserInputError, can_trim_prompt_cache,
                      generate_step, load_prompt_cache, make_prompt_cache, read_schedule,
                      resolve_config, save_prompt_cache, stream_generate, trim_prompt_cache)
from mlx_lazy import scorers
from mlx_lazy.cache_prompt import file_parts
from numerics import rel_err

REPO = Path(__file__).resolve().parents[1]
# Two float32 paths over the same tokens that differ only in how the work is chunked (and so
# in summation order) agree to ~1e-6 of the logits' scale; 1e-4 leaves room for any BLAS.
REL_TOL = 1e-4


def ids(n: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


# the paper's decode (complete="none"): tokens stay in the Aux Cache and are revived
AGGRESSIVE = PruningConfig("lazy", prune_layers=(0, 1), keep=(0.5, 0.2), complete="none")


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gpt_oss"])  # gpt_oss: windows, sinks
def test_full_extend_equals_one_prefill(tiny_model, kind):
    model, _ = tiny_model(kind)
    a, b = ids(300, model.args.vocab_size, 0), ids(90, model.args.vocab_size, 1)
    whole = make_prompt_cache(model).process(a + b)
    cache = make_prompt_cache(model)
    cache.process(a)
    assert rel_err(cache.process(b), whole) < REL_TOL
    assert cache.tokens == a + b and cache.engine.stats.max_computations_per_token_layer == 1


def test_full_with_a_cache_matches_mlx_lm_with_its_cache_over_three_turns(tiny_model):
    """Three turns, each resending nothing: the new turn's tokens go on top of the cache.
    Same greedy tokens and first-token logits as mlx-lm's generate_step with its cache, and as
    our own run without a cache over the whole conversation."""
    model, _ = tiny_model("llama")
    vocab = model.args.vocab_size
    turns = [ids(200, vocab, 2), ids(40, vocab, 3), ids(25, vocab, 4)]
    ours, theirs = make_prompt_cache(model), mlx_lm_make_prompt_cache(model)
    conversation: list[int] = []
    for turn in turns:
        conversation += turn
        mine = list(generate_step(conversation[len(ours):], model, prompt_cache=ours,
                                  max_tokens=6))
        ref = list(mlx_lm_generate_step(mx.array(conversation[theirs[0].offset:]), model,
                                        prompt_cache=theirs, max_tokens=6))
        fresh = list(generate_step(conversation, model, max_tokens=6))
        assert [t for t, _ in mine] == [t for t, _ in ref] == [t for t, _ in fresh]
        assert rel_err(mine[0][1], ref[0][1]) < REL_TOL
        assert rel_err(mine[0][1], fresh[0][1]) < REL_TOL
        conversation += [t for t, _ in mine]
    assert ours.tokens == conversation[:len(ours)] and len(ours) == theirs[0].offset


@pytest.mark.parametrize("config", ["full", AGGRESSIVE], ids=["full", "lazy"])
def test_a_caller_that_stops_early_leaves_every_token_in_the_cache(tiny_model, config):
    """Breaking out of generate_step after k tokens (the first alone too: an answer that is
    one token, or EOS at once) leaves prompt + k tokens in the cache, as mlx-lm's does (its
    steps run ahead; on the CPU ours runs the last token when the caller stops), and the
    next turn goes on from there as mlx-lm's does."""
    model, _ = tiny_model("llama")
    vocab = model.args.vocab_size
    prompt, follow = ids(150, vocab, 20), ids(12, vocab, 21)
    for k in (1, 2, 5):
        ours, theirs = make_prompt_cache(model, config), mlx_lm_make_prompt_cache(model)
        mine, ref = [], []
        for token, _ in generate_step(prompt, model, prompt_cache=ours, max_tokens=10):
            mine.append(token)
            if len(mine) == k:
                break
        for token, _ in mlx_lm_generate_step(mx.array(prompt), model, prompt_cache=theirs,
                                             max_tokens=10):
            ref.append(int(token))
            if len(ref) == k:
                break
        assert ours.tokens == prompt + mine and len(ours) == theirs[0].offset == 150 + k
        assert ours.engine.cache.length == 150 + k
        one = make_prompt_cache(model, config)
        list(generate_step(prompt, model, prompt_cache=one, max_tokens=k))  # runs out instead
        assert one.tokens == prompt + mine
        if config == "full":
            assert mine == ref
            after = list(generate_step(follow, model, prompt_cache=ours, max_tokens=3))
            after_ref = list(mlx_lm_generate_step(mx.array(follow), model,
                                                  prompt_cache=theirs, max_tokens=3))
            assert [t for t, _ in after] == [int(t) for t, _ in after_ref]
            assert rel_err(after[0][1], after_ref[0][1]) < REL_TOL


@dataclass(frozen=True)
class Targeted(scorers.Scorer):
    """A test scorer: the positions in :attr:`target` score 1, the rest 0."""

    heads: str = "mean"
    target: tuple = ()

    def score(self, ctx: scorers.ScoreContext) -> np.ndarray:
        return np.isin(ctx.key_positions, Targeted.target).astype(np.float32)


def test_a_needle_asked_about_only_in_turn_two_is_revived_then(tiny_model, monkeypatch):
    """Turn 1 selects needle A at the cut after layer 1: needle B stops at depth 2 (no KV at
    layers 2 and 3). Turn 2 selects B: its tokens are revived from the Aux Cache, get KV at
    the deep layers in that turn, and no (token, layer) is computed twice."""
    model, _ = tiny_model("llama")
    monkeypatch.setitem(scorers.SCORERS, "targeted", Targeted)
    vocab, depth = model.args.vocab_size, model.args.num_hidden_layers
    doc = ids(400, vocab, 5)
    needle_a, needle_b = np.arange(100, 110), np.arange(250, 262)
    config = PruningConfig("lazy", prune_layers=(1,), keep=(0.1,), scorer="targeted",
                           complete="none")  # the paper: turn 2 revives what it selects
    cache = make_prompt_cache(model, config)

    monkeypatch.setattr(Targeted, "target", tuple(needle_a), raising=False)
    list(generate_step(doc + ids(10, vocab, 6), model, prompt_cache=cache, max_tokens=4))
    state = cache.engine.cache
    assert (state.depth[needle_a] == depth).all()
    assert (state.depth[needle_b] == 2).all()
    for layer in (2, 3):
        assert not np.isin(needle_b, state.layers[layer].cached_positions()).any()

    monkeypatch.setattr(Targeted, "target", tuple(needle_b), raising=False)
    cache.process(ids(12, vocab, 7))
    stats = cache.engine.stats
    for layer in (2, 3):
        assert np.isin(needle_b, state.layers[layer].cached_positions()).all()
    assert stats.revivals >= len(needle_b)
    assert stats.max_computations_per_token_layer == 1


def test_once_per_layer_over_three_turns_with_revivals(tiny_model):
    model, _ = tiny_model("qwen2")
    vocab = model.args.vocab_size
    cache = make_prompt_cache(model, AGGRESSIVE)
    revived, total = 0, 0
    for turn, n in enumerate((300, 60, 80)):
        steps = list(generate_step(ids(n, vocab, 10 + turn), model, prompt_cache=cache,
                                   max_tokens=8))
        assert len(steps) == 8
        revived += cache.engine.stats.revivals
        total = len(cache)
    stats = cache.engine.stats
    assert stats.max_computations_per_token_layer == 1
    assert revived > 0
    assert all(c <= total for c in stats.tokens_computed_per_layer)
    assert stats.tokens_computed_per_layer[0] == total  # layer 0 computes every token once


@pytest.mark.parametrize("kind", ["qwen3", "deepseek_v3"])  # latent: values narrower than keys
def test_trim_then_extend_equals_a_fresh_run_on_the_shorter_prefix(tiny_model, kind):
    model, _ = tiny_model(kind)
    vocab = model.args.vocab_size
    a, b, c = ids(200, vocab, 20), ids(50, vocab, 21), ids(30, vocab, 22)
    cache = make_prompt_cache(model)
    cache.process(a + b)
    assert can_trim_prompt_cache(cache)
    assert trim_prompt_cache(cache, len(b)) == len(b)
    assert len(cache) == len(a) and all(kv.size == len(a) for kv in cache.engine.cache.layers)
    fresh = make_prompt_cache(model).process(a + c)
    assert rel_err(cache.process(c), fresh) < REL_TOL


def test_extend_prefix_trims_to_the_shared_prefix_and_returns_the_rest(tiny_model):
    """The chat-client case: a conversation resent whole is cut to what the cache lacks, the
    cache trimmed back to where the two part."""
    model, _ = tiny_model("llama")
    vocab = model.args.vocab_size
    a, b, c = ids(120, vocab, 23), ids(20, vocab, 24), ids(15, vocab, 25)
    cache = make_prompt_cache(model, AGGRESSIVE)
    cache.process(a + b)
    assert cache.extend_prefix(a + b + c) == c and len(cache) == len(a + b)
    assert cache.extend_prefix(a + c) == c and cache.tokens == a
    assert cache.extend_prefix(a) == a[-1:] and cache.tokens == a[:-1]  # the last one reruns


@pytest.mark.parametrize("tokens, message", [
    ("some text", "got text: encode it with the tokenizer first"),
    (None, "got NoneType"),
    ([], "the prompt is empty"),
    ([1, 2, 10 ** 8], "token id 100000000 is outside the model's vocabulary"),
    ([1, True], "token ids must be integers"),
    (np.zeros((2, 2), np.int32), "1-D of integer token ids"),
])
def test_extend_prefix_refuses_what_is_not_token_ids_and_leaves_the_cache(tiny_model, tokens,
                                                                           message):
    """Text, nothing, or ids the model lacks: one clear error, and the cache as it was (a
    string shares no prefix with the ids, so it used to trim the whole cache away)."""
    model, _ = tiny_model("llama")
    cache = make_prompt_cache(model, AGGRESSIVE)
    prompt = ids(60, model.args.vocab_size, 26)
    cache.process(prompt)
    with pytest.raises(UserInputError, match=message):
        cache.extend_prefix(tokens)
    assert cache.tokens == prompt and cache.engine.cache.length == len(prompt)


def test_trim_keeps_revived_tokens_compacted(tiny_model):
    """After revivals the layer caches hold tokens out of position order; trimming must keep
    exactly the positions below the cut, each with its own keys."""
    model, _ = tiny_model("llama")
    cache = make_prompt_cache(model, AGGRESSIVE)
    list(generate_step(ids(300, model.args.vocab_size, 23), model, prompt_cache=cache,
                       max_tokens=12))
    layer = cache.engine.cache.layers[2]
    before = {int(p): np.array(layer.fetch(np.array([p]))[0]) for p in layer.cached_positions()}
    trim_prompt_cache(cache, 100)
    kept = layer.cached_positions()
    assert sorted(kept.tolist()) == sorted(p for p in before if p < len(cache))
    for p in kept.tolist():
        np.testing.assert_array_equal(np.array(layer.fetch(np.array([p]))[0]), before[p])
    assert all((e.positions < len(cache)).all() for e in cache.engine.cache.aux.values())


def test_save_and_load_give_identical_next_token_logits(tiny_model, tmp_path):
    model, _ = tiny_model("llama")
    cache = make_prompt_cache(model, AGGRESSIVE)
    list(generate_step(ids(250, model.args.vocab_size, 30), model, prompt_cache=cache,
                       max_tokens=5))
    assert cache.engine.cache.aux, "the schedule should leave tokens in the Aux Cache"
    path = tmp_path / "state.safetensors"
    save_prompt_cache(path, cache, {"note": "hello"})
    loaded, meta = load_prompt_cache(path, model, return_metadata=True)
    assert meta == {"note": "hello"} and loaded.tokens == cache.tokens
    assert loaded.schedule == cache.schedule
    more = ids(20, model.args.vocab_size, 31)
    a, b = cache.process(more), loaded.process(more)
    np.testing.assert_array_equal(np.array(a), np.array(b))
    assert loaded.engine.stats.max_computations_per_token_layer == 1
    assert [p for p in tmp_path.iterdir()] == [path]  # no temporary file left behind


def test_bad_caches_are_user_errors(tiny_model, tmp_path):
    model, tokenizer = tiny_model("llama")
    other, _ = tiny_model("qwen2")
    cache = make_prompt_cache(model, AGGRESSIVE)
    cache.process(ids(120, model.args.vocab_size, 40))
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, cache)

    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    foreign = tmp_path / "foreign.safetensors"
    mx.save_safetensors(str(foreign), {"x": mx.zeros((2, 2))})
    # cut short past its header: said to be corrupt, not foreign (it once was)
    for bad, match in [(truncated, "prompt cache .*truncated.safetensors is corrupt: "),
                       (foreign, "a safetensors file without mlx-lazy's metadata: not a "
                                 "prompt cache saved by mlx-lazy"),
                       (tmp_path / "missing.safetensors", "does not exist")]:
        with pytest.raises(UserInputError, match=match):
            load_prompt_cache(bad, model)
    with pytest.raises(UserInputError, match="another model"):
        load_prompt_cache(path, other)
    with pytest.raises(UserInputError, match="another model"):
        list(stream_generate(other, tokenizer, [1, 2, 3], max_tokens=1, prompt_cache=cache))
    with pytest.raises(UserInputError, match="another pruning config: keep .*\\(leave the pruning "
                                             "settings out to go on with the cache's own"):
        list(stream_generate(model, tokenizer, [1, 2, 3], max_tokens=1, prompt_cache=cache,
                             config=PruningConfig("lazy", prune_layers=(0, 1), keep=(0.5, 0.3))))
    for n in (len(cache) + 1, -1, 1.5, True):
        with pytest.raises(UserInputError, match="cannot trim"):
            trim_prompt_cache(cache, n)
    with pytest.raises(UserInputError, match="cannot write"):
        save_prompt_cache(tmp_path / "no" / "such" / "dir.safetensors", cache)
    # The matching config, given again, is accepted.
    list(stream_generate(model, tokenizer, [1, 2, 3], max_tokens=1, prompt_cache=cache,
                         config=AGGRESSIVE))


def test_stream_generate_reports_cached_tokens(tiny_model):
    model, tokenizer = tiny_model("llama")
    cache = make_prompt_cache(model, "full")
    first = list(stream_generate(model, tokenizer, ids(100, model.args.vocab_size, 50),
                                 max_tokens=4, prompt_cache=cache))
    assert first[-1].stats.cached_tokens == 0
    held = len(cache)
    second = list(stream_generate(model, tokenizer, ids(10, model.args.vocab_size, 51),
                                  max_tokens=4, prompt_cache=cache))
    assert second[-1].stats.cached_tokens == held
    assert second[-1].stats.prompt_tokens == held + 10 and second[-1].prompt_tokens == 10


# ------------------------------------------------------------------------- completion


def test_complete_carries_every_waiting_token_to_the_top_once(tiny_model):
    """After complete(): every token that may reach the top has KV at every layer, nothing
    waits, the counter stays at one per (token, layer); the KV completed at the first layer
    above the cut equals mlx-lm's full forward (the hidden states waited there exactly)."""
    model, _ = tiny_model("qwen2")
    depth = model.args.num_hidden_layers
    prompt = ids(300, model.args.vocab_size, 60)
    engine = LazyEngine(model, resolve_config(model, PruningConfig(
        "lazy", prune_layers=(1,), keep=(0.3,), complete="after-first")))
    mx.eval(engine.prefill(mx.array(prompt)))
    waiting = engine.cache.aux[2].positions.copy()
    assert engine.pending_token_layers == len(waiting) * (depth - 2) > 0
    done = engine.complete()
    assert done == len(waiting) * (depth - 2) and engine.pending_token_layers == 0
    assert not engine.cache.aux and (engine.cache.depth == depth).all()
    assert engine.stats.max_computations_per_token_layer == 1
    assert engine.stats.completed_token_layers == done and engine.stats.revivals == 0
    ref = mlx_lm_make_prompt_cache(model)
    model(mx.array(prompt)[None], cache=ref)
    keys, values = engine.cache.layers[2].fetch(waiting)
    assert rel_err(keys, ref[2].keys[:, :, waiting.tolist()]) < REL_TOL
    assert rel_err(values, ref[2].values[:, :, waiting.tolist()]) < REL_TOL


def test_complete_with_a_budget_goes_lowest_layer_first_and_resumes(tiny_model):
    model, _ = tiny_model("llama")
    engine = LazyEngine(model, resolve_config(model, AGGRESSIVE))
    mx.eval(engine.prefill(mx.array(ids(300, model.args.vocab_size, 61))))
    total = engine.pending_token_layers
    steps = []
    while engine.pending_token_layers:
        steps.append(engine.complete(max_token_layers=50))
        assert steps[-1] <= 50 and steps[-1] > 0
    assert sum(steps) == total and engine.stats.max_computations_per_token_layer == 1
    assert engine.complete(should_stop=lambda: True) == 0
    for bad in (0, -1, 1.5, True, "8"):  # -1 once computed nothing, silently
        with pytest.raises(UserInputError, match="max_token_layers must be a positive"):
            engine.complete(bad)


def test_a_completion_one_token_layer_at_a_time_is_the_whole_completion(tiny_model):
    """Carried one row at a time (progressive:1's pace), a waiting token attends only to
    keys at or before its position: the KV equals one whole completion's (a single row was
    once taken for the context's newest and saw every key)."""
    model, _ = tiny_model("llama")
    prompt = mx.array(ids(150, model.args.vocab_size, 64))
    whole, paced = (LazyEngine(model, resolve_config(model, AGGRESSIVE)) for _ in range(2))
    mx.eval(whole.prefill(prompt), paced.prefill(prompt))
    whole.complete()
    steps = 0
    while paced.pending_token_layers:
        assert paced.complete(max_token_layers=1) == 1
        steps += 1
    assert steps > 50 and paced.stats.max_computations_per_token_layer == 1
    for a, b in zip(whole.cache.layers, paced.cache.layers):
        positions = a.cached_positions()
        assert positions.tolist() == b.cached_positions().tolist()
        (ka, va), (kb, vb) = a.fetch(positions), b.fetch(positions)
        assert rel_err(kb, ka) < REL_TOL and rel_err(vb, va) < REL_TOL


def test_nothing_pruned_completion_is_a_no_op_and_full_is_matched(tiny_model):
    model, _ = tiny_model("llama")
    prompt = mx.array(ids(200, model.args.vocab_size, 62))
    # exact stashes only at a cut that prunes: with nothing pruned there is nothing to redo,
    # in a first chunk or in a follow-up one
    kept_all = LazyEngine(model, resolve_config(model, PruningConfig(
        "lazy", prune_layers=(1,), keep=(1.0,), complete="exact")))
    full = LazyEngine(model, resolve_config(model, "full"))
    a, b = kept_all.prefill(prompt), full.prefill(prompt)
    assert kept_all.complete() == 0
    assert rel_err(a, b) < REL_TOL
    assert rel_err(kept_all.decode(5), full.decode(5)) < REL_TOL
    more = mx.array(ids(40, model.args.vocab_size, 63))
    assert rel_err(kept_all.extend(more), full.extend(more)) < REL_TOL
    assert kept_all.complete() == 0


# --------------------------------------------------------------------------------- CLI


def run_tool(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                          cwd=REPO, timeout=180)


@pytest.mark.slow
def test_cache_prompt_then_generate_with_the_cache_file(tiny_model_path, tmp_path):
    """The document is cached once, its pruned tokens completed before saving (or kept
    pruned with --keep-pruned); generate appends the question and reports the cached tokens;
    its text equals the same through the API."""
    doc, question = "The quick brown fox jumps over the lazy dog. " * 8, " Where is the fox?"
    cache_file, stats_file = tmp_path / "doc.safetensors", tmp_path / "stats.json"
    common = ["--model", str(tiny_model_path), "--ignore-chat-template", "--method", "lazy",
              "--prune-layers", "1", "--keep", "0.5", "--complete", "none"]
    made = run_tool("mlx_lazy.cache_prompt", *common, "-p", doc,
                    "--prompt-cache-file", str(cache_file))
    assert made.returncode == 0, made.stderr.decode()
    used = run_tool("mlx_lazy.generate", *common, "-p", question, "-m", "5",
                    "--prompt-cache-file", str(cache_file), "--verbose", "False",
                    "--stats-json", str(stats_file))
    assert used.returncode == 0, used.stderr.decode()
    stats = json.loads(stats_file.read_text())

    from mlx_lazy import load
    model, tokenizer = load(str(tiny_model_path))
    doc_ids = tokenizer.encode(doc)
    q_ids = tokenizer.encode(question, add_special_tokens=False)
    assert stats["cached_tokens"] == len(doc_ids)
    assert stats["prompt_tokens"] == len(doc_ids) + len(q_ids)
    config = PruningConfig("lazy", prune_layers=(1,), keep=(0.5,), complete="none")
    cache = make_prompt_cache(model, config)
    cache.process(doc_ids)
    assert cache.engine.cache.aux  # the schedule prunes this document
    assert cache.engine.complete() > 0
    text = "".join(r.text for r in stream_generate(model, tokenizer, q_ids, max_tokens=5,
                                                   prompt_cache=cache))
    assert used.stdout.decode() == text + "\n"
    # The file holds the completed state: every token at every layer, nothing waiting.
    saved = load_prompt_cache(str(cache_file), model).engine.cache
    assert not saved.aux and (saved.depth[: saved.length] == saved.num_layers).all()
    assert "token-layers of pruned tokens completed first" in made.stderr.decode()
    # --keep-pruned saves the pruned state as it is: the Aux Cache still holds tokens.
    pruned_file = tmp_path / "pruned.safetensors"
    kept = run_tool("mlx_lazy.cache_prompt", *common, "-p", doc, "--keep-pruned",
                    "--prompt-cache-file", str(pruned_file))
    assert kept.returncode == 0, kept.stderr.decode()
    assert load_prompt_cache(str(pruned_file), model).engine.cache.aux
    # The size reported is the file's (it was the KV buffers' capacity, nearly twice it).
    for proc, path in ((made, cache_file), (kept, pruned_file)):
        assert f"({path.stat().st_size / 1e6:.1f} MB: KV " in proc.stderr.decode()
        assert re.search(r"Aux Cache \S+ MB, the rest \(selection state, header\) \d",
                         proc.stderr.decode())
    # The rest is named and is what KV and the Aux Cache leave (29.2 MB read as KV 28.8 and
    # Aux Cache 0.0, nothing else); on the tiny model it is under the line's 0.1 MB.
    assert file_parts(29_200_000, 28_800_000, 100_000) == (
        "29.2 MB: KV 28.8 MB, Aux Cache 0.1 MB, the rest (selection state, header) 0.3 MB")

    # No pruning flag: the cache's own config runs (same text).
    plain = run_tool("mlx_lazy.generate", "--model", str(tiny_model_path), "-p", question,
                     "-m", "5", "--ignore-chat-template", "--verbose", "False",
                     "--prompt-cache-file", str(cache_file))
    assert plain.returncode == 0 and plain.stdout == used.stdout, plain.stderr.decode()
    # The file says the prompt skipped the chat template: a question through it, which would
    # open a turn the document never did, is refused (it once ran, exit 0).
    assert load_prompt_cache(str(cache_file), model, return_metadata=True)[1][
        "chat_template"] == "no"
    templated = run_tool("mlx_lazy.generate", "--model", str(tiny_model_path), "-p", question,
                         "-m", "5", "--prompt-cache-file", str(cache_file))
    assert templated.returncode == 2, templated.stderr.decode()
    assert templated.stderr.decode().strip() == (
        f"error: prompt cache {cache_file} holds a prompt made without the chat template; "
        "add --ignore-chat-template so that the question continues it")
    # Another config than the cache's, a truncated file: one error line, status 2.
    other = run_tool("mlx_lazy.generate", "--model", str(tiny_model_path), "-p", question,
                     "--method", "full", "--prompt-cache-file", str(cache_file))
    assert other.returncode == 2 and other.stderr.decode().startswith("error: ")
    assert "another pruning config" in other.stderr.decode()
    cache_file.write_bytes(cache_file.read_bytes()[:100])
    broken = run_tool("mlx_lazy.generate", *common, "-p", question,
                      "--prompt-cache-file", str(cache_file))
    err = broken.stderr.decode().strip().splitlines()
    assert broken.returncode == 2 and len(err) == 1 and err[0].startswith("error: "), err


def test_after_first_completes_once_the_first_token_is_out(tiny_model):
    """``complete="after-first"``: when the first token is handed out the pruned tokens still
    wait (the first token keeps the pruned time); by the second every token that may reach
    the top has KV at every layer, each (token, layer) computed once."""
    model, _ = tiny_model("llama")
    config = PruningConfig("lazy", prune_layers=(0, 1), keep=(0.5, 0.2), complete="after-first")
    cache = make_prompt_cache(model, config)
    steps = generate_step(ids(300, model.args.vocab_size, 70), model, prompt_cache=cache,
                          max_tokens=6)
    next(steps)
    assert cache.engine.pending_token_layers > 0
    next(steps)
    state, depth = cache.engine.cache, model.args.num_hidden_layers
    assert cache.engine.pending_token_layers == 0 and not state.aux
    assert (state.depth == depth).all()
    for _ in steps:  # decoding on: nothing waits again, nothing is computed twice
        assert not state.aux
    assert cache.engine.stats.max_computations_per_token_layer == 1
    assert cache.engine.stats.completed_token_layers > 0


def test_promote_tops_up_every_cut_once_before_the_second_token(tiny_model):
    """``complete="promote:60"`` with two cuts keeping 50% and 20%: the first token is the
    pruned prefill's (the same logits as ``none``); the first decode step brings each cut up
    to 60% of the context with keys above it, the second cut too (the tokens carried from the
    first count there); later steps carry nothing more, and no token-layer is computed twice.
    Without revivals, so that only the top-up can give a pruned token its upper layers."""
    model, _ = tiny_model("llama")
    prompt = ids(300, model.args.vocab_size, 72)
    cuts = dict(prune_layers=(0, 1), keep=(0.5, 0.2), max_revivals=0)
    config = PruningConfig("lazy", complete="promote:60", **cuts)
    none = make_prompt_cache(model, PruningConfig("lazy", complete="none", **cuts))
    cache = make_prompt_cache(model, config)
    first = cache.process(prompt)
    assert rel_err(first, none.process(prompt)) < REL_TOL
    engine, state = cache.engine, cache.engine.cache
    engine.decode(int(mx.argmax(first)))
    for cut in (0, 1):  # keys above the cut: 60% of the prompt, no more (the best of them)
        assert (state.depth[: len(prompt)] > cut + 1).sum() == round(0.6 * len(prompt))
    carried = engine.stats.completed_token_layers
    assert carried > 0
    for token in (5, 6, 7):
        engine.decode(token)
    assert engine.stats.completed_token_layers == carried
    assert engine.stats.max_computations_per_token_layer == 1


def test_progressive_completion_spends_its_budget_per_step(tiny_model):
    model, _ = tiny_model("llama")
    config = PruningConfig("lazy", prune_layers=(0, 1), keep=(0.5, 0.2), complete="progressive:40")
    cache = make_prompt_cache(model, config)
    engine, done = cache.engine, [0]
    decode = engine.decode

    def counted(token):  # the engine completes before each decode step
        out = decode(token)
        done.append(engine.completed_token_layers)
        return out

    engine.decode = counted
    for _ in generate_step(ids(300, model.args.vocab_size, 71), model, prompt_cache=cache,
                           max_tokens=40):
        pass
    per_step = np.diff(done)
    assert per_step.max() <= 40 and per_step.sum() > 0
    assert engine.stats.max_computations_per_token_layer == 1
    # While tokens wait, decode steps still select (2 cuts each); once none waits, they stop:
    # the prefill and every step but the one whose completion finished select.
    waiting_steps = int((per_step > 0).sum())
    assert engine.stats.selections == 2 * (1 + waiting_steps - 1)
    assert engine.pending_token_layers == 0 and engine.stats.selections < 2 * 40


@pytest.mark.slow
def test_complete_flag_is_checked(tiny_model, tiny_model_path):
    for bad in ("progressive:0", "progressive:x", "promote:0", "promote:101", "sometimes"):
        proc = run_tool("mlx_lazy.generate", "--model", str(tiny_model_path), "--method", "lazy",
                        "--complete", bad)
        err = proc.stderr.decode().strip().splitlines()
        assert proc.returncode == 2 and len(err) == 1 and "complete" in err[0], err
    with pytest.raises(UserInputError, match="takes no complete"):
        make_prompt_cache(tiny_model("llama")[0], PruningConfig("full", complete="none"))


# --------------------------------------------------------------------------------- store


def test_store_hands_out_private_copies_and_never_mixes_configs(tiny_model):
    from mlx_lazy.prefix_store import PromptCacheStore

    model, _ = tiny_model("llama")
    vocab = model.args.vocab_size
    # a pruned config too
    store = PromptCacheStore(max_entries=4, max_bytes=10**9, share_pruned=True)
    lazy, full = resolve_config(model, AGGRESSIVE), resolve_config(model, "full")
    doc, q1, q2 = ids(200, vocab, 80), ids(20, vocab, 81), ids(20, vocab, 82)

    first = store.checkout(model, lazy, doc + q1)
    assert len(first) == 0
    first.process(doc + q1)
    store.checkin(first)
    stored_logits = store.checkout(model, lazy, doc + q1 + q2).process(q2)
    # Two requests on the same prefix get independent copies: what one does (even a longer
    # extension) changes neither the other's answer nor the stored cache.
    a = store.checkout(model, lazy, doc + q1 + q2)
    b = store.checkout(model, lazy, doc + q1 + q2)
    assert a is not b and a is not first and len(a) == len(b) == len(first)
    a.process(q1 + q2 + q1)
    np.testing.assert_array_equal(np.array(b.process(q2)), np.array(stored_logits))
    assert first.tokens == doc + q1 and len(first.engine.cache.depth) == len(doc + q1)
    # Another config never gets it.
    assert len(store.checkout(model, full, doc + q1 + q2)) == 0
    # A request sharing only the document gets a copy trimmed to it.
    branch = store.checkout(model, lazy, doc + q2)
    assert len(branch) == len(doc) and first.tokens == doc + q1
    # Keeping an extension replaces the stored cache it extends; a branch is kept beside it.
    store.checkin(b)
    assert len(store) == 1 and store.most_recent() is b
    branch.process(q2)
    store.checkin(branch)
    assert len(store) == 2


def test_store_stays_within_its_byte_and_entry_limits(tiny_model):
    from mlx_lazy.prefix_store import PromptCacheStore

    model, _ = tiny_model("llama")
    schedule = resolve_config(model, "full")
    caches = []
    for i, n in enumerate((100, 200, 300, 1000)):
        c = make_prompt_cache(model)
        c.process(ids(n, model.args.vocab_size, 90 + i))
        caches.append(c)
    limit = caches[1].nbytes + caches[2].nbytes
    store = PromptCacheStore(max_entries=3, max_bytes=limit)
    for c in caches[:3]:
        store.checkin(c)
        assert store.nbytes <= limit
    assert store.most_recent() is caches[2] and len(store) == 2  # the oldest went first
    store.checkin(caches[3])  # larger than the whole budget: not kept
    assert store.most_recent() is caches[2] and store.nbytes <= limit
    assert store.checkout(model, schedule, caches[0].tokens + [1]).tokens == []


def test_a_schedule_for_a_model_of_the_same_shapes_is_refused(tiny_model, tmp_path):
    """Fingerprints cover the weights: a schedule calibrated for one model is refused by
    another of exactly the same architecture and shapes."""
    import mlx_lm
    from tiny_models import build_tiny_model

    from mlx_lazy.adapter import ModelAdapter
    from mlx_lazy.schedule_files import write_schedule

    model, _ = tiny_model("llama")
    twin, _ = mlx_lm.load(str(build_tiny_model("llama", tmp_path / "twin", seed=1)))
    ours, theirs = ModelAdapter(model).fingerprint(), ModelAdapter(twin).fingerprint()
    assert {k: v for k, v in ours.items() if k not in ("weights", "identity")} == \
        {k: v for k, v in theirs.items() if k not in ("weights", "identity")}
    path = write_schedule(tmp_path / "s.json", PruningConfig("lazy", prune_layers=(1,),
                                                             keep=(0.5,)), ours, {})
    assert read_schedule(path, ours).prune_layers == (1,)
    with pytest.raises(UserInputError, match="weights"):
        read_schedule(path, theirs)


def test_generate_step_with_no_tokens_to_generate_only_caches_the_prompt(tiny_model):
    model, _ = tiny_model("llama")
    cache = make_prompt_cache(model)
    prompt = ids(50, model.args.vocab_size, 100)
    assert list(generate_step(prompt, model, prompt_cache=cache, max_tokens=0)) == []
    assert cache.tokens == prompt


def test_with_completion_decode_sees_every_token_with_kv(tiny_model):
    """With ``after-first`` the first token is the same pruned prefill's; then decode steps
    neither select nor revive (only the prefill's cuts synced with the host) and attend to
    every token, now all with KV, so they differ from decode steps that attend to their
    selection only."""
    model, _ = tiny_model("llama")
    prompt = ids(300, model.args.vocab_size, 110)
    cuts = dict(prune_layers=(0, 1), keep=(0.5, 0.2))
    done = make_prompt_cache(model, PruningConfig("lazy", complete="after-first", **cuts))
    plain = make_prompt_cache(model, PruningConfig("lazy", complete="none", **cuts))
    out = {}
    for name, cache in (("done", done), ("plain", plain)):
        out[name] = [lp for _, lp in generate_step(prompt, model, prompt_cache=cache,
                                                   max_tokens=3)]
    assert rel_err(out["done"][0], out["plain"][0]) < REL_TOL
    assert done.engine.pending_token_layers == 0
    assert done.engine.stats.selections == len(cuts["prune_layers"])
    assert plain.engine.stats.selections > len(cuts["prune_layers"])
    assert rel_err(out["done"][2], out["plain"][2]) > REL_TOL


def test_complete_stops_each_token_at_its_depth_limit(tiny_model):
    """lazy+speed: waiting tokens are carried only up to their SPEED limit."""
    model, _ = tiny_model("llama")
    config = PruningConfig("lazy+speed", prune_layers=(0,), keep=(0.3,), speed_cutoff=3,
                           complete="after-first")
    engine = LazyEngine(model, resolve_config(model, config))
    mx.eval(engine.prefill(mx.array(ids(200, model.args.vocab_size, 120))))
    state = engine.cache
    expected = int((state.limit[state.aux[1].positions] - 1).sum())
    assert engine.pending_token_layers == expected > 0
    assert engine.complete() == expected
    assert (state.depth <= state.limit).all() and engine.stats.max_computations_per_token_layer == 1


# --------------------------------------------------------------------- exact completion

EXACT = PruningConfig("lazy", prune_layers=(1, 2), keep=(0.5, 0.2), complete="exact")


def forced(tokens: list[int]):
    """A sampler that teacher-forces ``tokens`` one step at a time (generate_step samples
    one step ahead: past the end it repeats the last)."""
    it = iter(tokens)
    return lambda logprobs: mx.array([next(it, tokens[-1])])


def logprobs_along(model, cache, prompt, tokens):
    return [np.array(lp) for _, lp in generate_step(prompt, model, prompt_cache=cache,
                                                    max_tokens=len(tokens),
                                                    sampler=forced(tokens))]


def test_exact_completion_decodes_as_the_full_model_across_turns(tiny_model):
    """``complete="exact"``: the first token of each turn is the pruned prefill's; after it
    the chunk's layers above the first cut are recomputed over every token, so every later
    step matches ``full`` (within REL_TOL) though the first step does not. Kept tokens' deep
    layers are the only ones computed twice, and nothing waits or is stashed afterwards."""
    model, _ = tiny_model("llama")
    vocab, depth = model.args.vocab_size, model.args.num_hidden_layers
    doc, turn1 = ids(300, vocab, 130), ids(6, vocab, 131)
    question, turn2 = ids(120, vocab, 132), ids(6, vocab, 133)
    exact, full = make_prompt_cache(model, EXACT), make_prompt_cache(model, "full")
    for prompt, answer in ((doc, turn1), (question, turn2)):
        got = logprobs_along(model, exact, prompt, answer)
        want = logprobs_along(model, full, prompt, answer)
        assert rel_err(got[0], want[0]) > REL_TOL  # the pruned first token
        assert max(rel_err(g, w) for g, w in zip(got[1:], want[1:])) < REL_TOL
        state = exact.engine.cache
        assert not state.aux and not state.stash and (state.depth == depth).all()
    computed = state.computed[:, : len(doc)]
    assert (computed[:2] == 1).all()  # up to the first cut: once
    assert computed.max() == 2 and set(np.unique(computed[2:])) == {1, 2}


def test_exact_stash_is_recomputed_once_when_saved_and_survives_trim(tiny_model, tmp_path):
    """A prompt cached with nothing generated keeps its stash; saving recomputes it once (the
    file is stored completed), a trimmed copy keeps the stash of the tokens left, and either
    way the step after the next chunk matches ``full``."""
    model, _ = tiny_model("qwen2")
    vocab = model.args.vocab_size
    doc, more = ids(250, vocab, 140), ids(40, vocab, 141)

    def next_logits(cache):
        cache.process(more)
        return cache.engine.decode(7)  # recomputes `more`'s stash first

    exact = make_prompt_cache(model, EXACT)
    exact.process(doc)
    assert exact.engine.cache.stash and exact.engine.pending_token_layers > 0
    trimmed = exact.copy()
    trim_prompt_cache(trimmed, 100)
    save_prompt_cache(tmp_path / "c.safetensors", exact)
    loaded = load_prompt_cache(tmp_path / "c.safetensors", model)
    assert not loaded.engine.cache.stash and loaded.engine.pending_token_layers == 0
    (_, entry), = trimmed.engine.cache.stash.items()
    assert entry.positions.max() < len(doc) - 100
    for cache, prefix in ((loaded, doc), (trimmed, doc[:-100])):
        full = make_prompt_cache(model, "full")
        full.process(prefix)
        assert rel_err(next_logits(cache), next_logits(full)) < REL_TOL
        assert not cache.engine.cache.stash and not cache.engine.cache.aux


def test_a_question_from_a_saved_exact_cache_computes_only_its_own_tokens(tiny_model, tmp_path):
    """The file holds the recomputed state: to its first token, a question on it computes its
    own tokens' layers (pruned at the cuts) and nothing of the document again, no
    completion, no revival."""
    model, _ = tiny_model("llama")
    vocab, L = model.args.vocab_size, model.args.num_hidden_layers
    doc, question = ids(300, vocab, 150), ids(12, vocab, 151)
    cache = make_prompt_cache(model, EXACT)
    for _ in generate_step(doc, model, prompt_cache=cache, max_tokens=0):
        pass
    save_prompt_cache(tmp_path / "doc.safetensors", cache)
    loaded = load_prompt_cache(tmp_path / "doc.safetensors", model)
    before = loaded.engine.cache.computed[:, : len(doc)].copy()
    assert (loaded.engine.cache.depth == L).all()
    for _ in generate_step(question, model, prompt_cache=loaded, max_tokens=1):
        stats, state = loaded.engine.stats, loaded.engine.cache  # at the first token
        computed = state.computed[:, : len(doc)].copy()
    assert (computed == before).all()
    assert stats.completed_token_layers == 0 and stats.revivals == 0
    assert sum(stats.prefill_tokens_per_layer) <= len(question) * L


def test_a_question_from_a_saved_pruned_cache_computes_its_tokens_and_its_revivals(tiny_model,
                                                                                   tmp_path):
    """The file holds the pruned state (``complete="none"``): to its first token, a question
    on it computes its own tokens' layers and, of the document, exactly the remaining layers
    of the tokens it revives, each token-layer once; nothing is completed."""
    model, _ = tiny_model("llama")
    vocab = model.args.vocab_size
    doc, question = ids(300, vocab, 160), ids(12, vocab, 161)
    config = PruningConfig("lazy", prune_layers=(1,), keep=(0.3,), complete="none")
    cache = make_prompt_cache(model, config)
    for _ in generate_step(doc, model, prompt_cache=cache, max_tokens=0):
        pass
    save_prompt_cache(tmp_path / "doc.safetensors", cache)
    loaded = load_prompt_cache(tmp_path / "doc.safetensors", model)
    state = loaded.engine.cache
    depth, computed = state.depth[: len(doc)].copy(), state.computed[:, : len(doc)].copy()
    for _ in generate_step(question, model, prompt_cache=loaded, max_tokens=1):
        stats = loaded.engine.stats  # at the first token
        now, counted = state.depth[: len(doc)].copy(), state.computed.copy()
    revived = np.flatnonzero(now > depth)
    new = counted[:, : len(doc)] - computed
    assert stats.revivals == len(revived) > 0 and stats.completed_token_layers == 0
    assert new.sum() == (now[revived] - depth[revived]).sum()
    assert stats.max_computations_per_token_layer == 1
    asked = counted[:, len(doc):len(doc) + len(question)].sum()
    assert sum(stats.prefill_tokens_per_layer) == new.sum() + asked


class Boom(Exception):
    pass


def raise_after(n: int, then=lambda *args: args[-1]):
    """A progress callback or logits processor (or ``then``) that raises on its ``n``-th
    call."""
    calls = []

    def hook(*args):
        calls.append(args)
        if len(calls) == n:
            raise Boom
        return then(*args)

    return hook


def interrupt(engine, monkeypatch, n: int, call) -> None:
    """Run ``call`` with the ``n``-th layer ``engine`` finishes raising (as Ctrl-C would
    there), and check that it raised."""
    finish = engine.adapter.finish
    monkeypatch.setattr(engine.adapter, "finish", raise_after(n, finish))
    with pytest.raises(Boom):
        call()
    monkeypatch.setattr(engine.adapter, "finish", finish)


def continues_as(engine, twin, token: int) -> mx.array:
    """Decode ``token`` on ``engine`` and on a copy of its state ``twin`` (engine.cache
    stays its own): the logits agree; returns them."""
    logits = engine.decode(token)
    engine.cache, own = twin, engine.cache
    assert rel_err(engine.decode(token), logits) < REL_TOL
    engine.cache = own
    return logits


def same_state(cache):
    """A check that a cache's state is, array for array, what ``cache``'s is now."""
    then = {name: np.array(a) for name, a in cache.state.items()}

    def check(now):
        state = {name: np.array(a) for name, a in now.state.items()}
        assert state.keys() == then.keys()
        for name, a in then.items():
            np.testing.assert_array_equal(state[name], a, err_msg=name)

    return check


@pytest.mark.parametrize("config", ["full", AGGRESSIVE], ids=["full", "lazy"])
def test_an_interrupted_prompt_leaves_the_cache_as_it_was(tiny_model, tmp_path, config):
    """A prompt stopped part-way through its layers (a progress callback that raises, as
    Ctrl-C would) leaves the cache holding the earlier turn only, in the model's state too:
    it saves and loads, and the retried turn gives what a cache that was never interrupted
    gives (unpruned: exactly; pruned, tokens the interrupted turn revived stay computed)."""
    model, _ = tiny_model("llama")
    vocab = model.args.vocab_size
    turn1, turn2 = ids(200, vocab, 40), ids(120, vocab, 41)
    cache = make_prompt_cache(model, config)
    cache.process(turn1)
    before = same_state(cache.engine.cache)
    with pytest.raises(Boom):
        list(generate_step(turn2, model, prompt_cache=cache, max_tokens=4,
                           prompt_progress_callback=raise_after(3)))
    assert cache.tokens == turn1
    before(cache.engine.cache)
    save_prompt_cache(tmp_path / "c.safetensors", cache)
    cache = load_prompt_cache(tmp_path / "c.safetensors", model)
    got = [t for t, _ in generate_step(turn2, model, prompt_cache=cache, max_tokens=6)]
    assert cache.engine.stats.max_computations_per_token_layer == 1
    assert len(cache) == cache.engine.cache.length == len(turn1 + turn2) + 6
    if config == "full":
        fresh = make_prompt_cache(model, config)
        fresh.process(turn1)
        assert got == [t for t, _ in generate_step(turn2, model, prompt_cache=fresh,
                                                   max_tokens=6)]


@pytest.mark.parametrize("config", ["full", AGGRESSIVE], ids=["full", "lazy"])
def test_a_processor_that_raises_mid_answer_leaves_the_cache_consistent(tiny_model, config):
    """The 6th decode step's processor raises after the step ran its token, the 6th handed
    out, through the model: the cache holds the prompt and every token handed out (the 6th
    was once dropped, so a caller going on from them lost one), as when the caller stops,
    so the conversation continues as one run of the whole of it would."""
    model, _ = tiny_model("llama")
    prompt = ids(150, model.args.vocab_size, 42)
    cache = make_prompt_cache(model, config)
    got = []
    with pytest.raises(Boom):
        for token, _ in generate_step(prompt, model, prompt_cache=cache, max_tokens=20,
                                      logits_processors=[raise_after(7)]):
            got.append(token)
    assert len(got) == 6 and cache.tokens == prompt + got
    assert cache.engine.cache.length == len(cache.tokens)
    assert cache.engine.stats.max_computations_per_token_layer == 1
    if config == "full":
        rest = cache.extend_prefix(prompt + got)
        assert rest == got[5:]
        again = [t for t, _ in generate_step(rest, model, prompt_cache=cache, max_tokens=4)]
        whole = [t for t, _ in generate_step(prompt + got, model, max_tokens=4)]
        assert again == whole


def test_revivals_are_counted_per_request(tiny_model):
    """A request's stats count its own revivals, not the cache's since it was made."""
    model, _ = tiny_model("llama")
    cache = make_prompt_cache(model, AGGRESSIVE)
    prompt = ids(150, model.args.vocab_size, 47)
    list(generate_step(prompt, model, prompt_cache=cache, max_tokens=4))
    first = cache.engine.stats.revivals
    assert first == cache.engine.cache.revivals > 0
    list(generate_step(ids(20, model.args.vocab_size, 48), model, prompt_cache=cache,
                       max_tokens=8))
    second = cache.engine.stats.revivals
    assert second == cache.engine.cache.revivals - first and second > 0


def test_an_exact_recompute_is_no_revival(tiny_model):
    """``complete="exact"`` recomputes the pruned tokens' upper layers before the first
    decode step: completion, counted as such, not as revivals (in the stats and the cache,
    which a saved file carries)."""
    model, _ = tiny_model("llama")
    cache = make_prompt_cache(model, PruningConfig("lazy", prune_layers=(0, 1),
                                                   keep=(0.5, 0.25)))
    cache.process(ids(200, model.args.vocab_size, 49))
    engine = cache.engine
    assert engine.cache.stash
    engine.decode(5)
    engine.decode(6)
    assert engine.stats.completed_token_layers > 0
    assert engine.stats.revivals == engine.cache.revivals == 0


@pytest.mark.parametrize("returned", [10 ** 6, -1, 2.5])
def test_a_sampler_returning_no_token_id_is_refused(tiny_model, returned):
    """MLX does not bounds-check its embedding lookup (an id past the table crashed the
    process): a sampler's token outside the vocabulary is one clear error, the cache left
    holding what went through."""
    model, _ = tiny_model("llama")
    prompt = ids(100, model.args.vocab_size, 43)
    cache = make_prompt_cache(model)
    calls = []

    def sampler(logprobs):
        calls.append(1)
        return mx.array([returned]) if len(calls) == 3 else mx.argmax(logprobs, axis=-1)

    with pytest.raises(UserInputError, match="the sampler returned .* not a token id"):
        list(generate_step(prompt, model, prompt_cache=cache, sampler=sampler, max_tokens=8))
    assert len(cache) == cache.engine.cache.length == len(prompt) + 2


def test_the_engine_and_process_refuse_ids_outside_the_vocabulary(tiny_model):
    model, _ = tiny_model("llama")
    prompt = ids(80, model.args.vocab_size, 44)
    cache = make_prompt_cache(model, AGGRESSIVE)
    cache.process(prompt)
    for bad in ([1, 2, 10 ** 6], [-1], "text"):
        with pytest.raises(UserInputError, match="outside the model's vocabulary|encode it"):
            cache.process(bad)
        assert cache.tokens == prompt and cache.engine.cache.length == len(prompt)
    engine = cache.engine
    for bad in (10 ** 6, -1):
        with pytest.raises(UserInputError, match="outside the model's vocabulary"):
            engine.decode(bad)
        with pytest.raises(UserInputError, match="outside the model's vocabulary"):
            engine.extend([bad])
    assert engine.cache.length == len(prompt)
    with pytest.raises(UserInputError, match="encode it with the tokenizer first"):
        next(generate_step("hello", model))


def test_a_decode_step_interrupted_in_a_layer_leaves_the_state_as_it_was(tiny_model,
                                                                        monkeypatch):
    """Ctrl-C can land inside a pruned decode step, after it took tokens out of the Aux
    Cache to revive them: the step's state goes back whole, and the next step is the one
    an uninterrupted state takes."""
    model, _ = tiny_model("llama")
    cache = make_prompt_cache(model, AGGRESSIVE)
    engine = cache.engine
    token = int(mx.argmax(cache.process(ids(300, model.args.vocab_size, 45))))
    revivals = engine.cache.revivals
    for _ in range(6):  # until a step revives
        twin = engine.cache.copy()
        before = same_state(engine.cache)
        interrupt(engine, monkeypatch, 3, lambda: engine.decode(token))  # in layer 2
        before(engine.cache)
        token = int(mx.argmax(continues_as(engine, twin, token)))
        if engine.cache.revivals > revivals:
            break
    assert engine.cache.revivals > revivals, "no step revived: the test checks nothing"


def test_a_processor_that_raises_leaves_the_state_of_a_run_that_stopped(tiny_model):
    """A logits processor that raises on the logits after the 8th token handed out, once
    the step ran that token through the model (and revived tokens from the Aux Cache),
    leaves the state, array for array, of a run that stopped after handing out 8 tokens:
    the step stays whole, revivals and all (once they stayed while the step's token was
    dropped: the next step differed)."""
    model, _ = tiny_model("llama")
    prompt = ids(300, model.args.vocab_size, 46)
    cache = make_prompt_cache(model, AGGRESSIVE)
    got = []
    with pytest.raises(Boom):
        for token, _ in generate_step(prompt, model, prompt_cache=cache, max_tokens=20,
                                      logits_processors=[raise_after(9)]):
            got.append(token)
    assert len(got) == 8
    twin = make_prompt_cache(model, AGGRESSIVE)
    list(generate_step(prompt, model, prompt_cache=twin, max_tokens=8))
    assert cache.tokens == twin.tokens
    same_state(twin.engine.cache)(cache.engine.cache)
    assert cache.engine.cache.revivals == twin.engine.cache.revivals


@pytest.mark.parametrize("complete", ["after-first", "progressive:8"])
def test_a_completion_interrupted_leaves_the_waiting_tokens_waiting(tiny_model, monkeypatch,
                                                                    complete):
    """Ctrl-C inside the completion a decode step runs first (after-first's whole one,
    progressive's budget) once lost the hidden states it had taken out of the Aux Cache:
    those tokens never went deeper, and a saved file of it was refused as corrupt. Now the
    step and its completion go back whole: the retried step is an uninterrupted one."""
    model, _ = tiny_model("llama")
    config = PruningConfig("lazy", prune_layers=(0, 1), keep=(0.5, 0.25), complete=complete)
    cache = make_prompt_cache(model, config)
    engine = cache.engine
    token = int(mx.argmax(cache.process(ids(200, model.args.vocab_size, 47))))
    twin = engine.cache.copy()
    before = same_state(engine.cache)
    interrupt(engine, monkeypatch, 2, lambda: engine.decode(token))  # in the completion
    before(engine.cache)
    # the count of completed token-layers goes back with them (it once kept the lost
    # layer's, and bench.decode_cost's per-step work, computed minus it, came out short)
    assert engine.stats.completed_token_layers == 0
    continues_as(engine, twin, token)
    same_state(engine.cache)(twin)


def test_an_interrupted_complete_call_leaves_the_waiting_tokens_waiting(tiny_model,
                                                                       monkeypatch):
    model, _ = tiny_model("llama")
    cache = make_prompt_cache(model, AGGRESSIVE)
    engine = cache.engine
    cache.process(ids(200, model.args.vocab_size, 48))
    before = same_state(engine.cache)
    interrupt(engine, monkeypatch, 2, engine.complete)
    before(engine.cache)
    assert engine.complete() > 0 and not engine.cache.aux
    assert engine.stats.max_computations_per_token_layer == 1


def test_held_choices_survive_a_copy_a_rollback_and_a_file(tiny_model, monkeypatch, tmp_path):
    """With reselect_every 2 a decode step may see the last selection: a copy, a step taken
    back and a saved file keep it (they once re-selected at once, unlike the live cache); a
    file's choice that no pruning layer could hold is refused."""
    model, _ = tiny_model("llama")
    config = PruningConfig("lazy", prune_layers=(1,), keep=(0.1,), complete="none",
                           reselect_every=2)
    cache = make_prompt_cache(model, config)
    engine = cache.engine
    token = int(mx.argmax(cache.process(ids(300, model.args.vocab_size, 49))))
    copy = engine.cache.copy()
    save_prompt_cache(tmp_path / "c.safetensors", cache)
    loaded = load_prompt_cache(tmp_path / "c.safetensors", model)
    interrupt(engine, monkeypatch, 3, lambda: engine.decode(token))
    logits = continues_as(engine, copy, token)
    assert rel_err(loaded.engine.decode(token), logits) < REL_TOL
    arrays, meta = mx.load(str(tmp_path / "c.safetensors"), return_metadata=True)
    assert list(k for k in arrays if k.startswith("choices.")) == ["choices.1"]
    for name, value in (("choices.2", arrays["choices.1"]),
                        ("choices.1", arrays["choices.1"].astype(mx.float32))):
        tampered = {k: v for k, v in arrays.items() if not k.startswith("choices.")}
        tampered[name] = value
        mx.save_safetensors(str(tmp_path / "t.safetensors"), tampered, metadata=meta)
        with pytest.raises(UserInputError, match="must be the last choice of a pruning layer"):
            load_prompt_cache(tmp_path / "t.safetensors", model)


# ------------------------------------------------------------ steps built ahead (a GPU's)


@pytest.mark.parametrize("config", ["full", AGGRESSIVE], ids=["full", "lazy"])
def test_steps_built_ahead_as_on_a_gpu_give_the_same_answer_and_cache(tiny_model, monkeypatch,
                                                                     config):
    """On a GPU ``generate_step`` builds step n+1 before waiting for token n; forced here on
    the CPU (where it runs too, only slower), the answer and the cache are a plain run's,
    array for array, and the rules of a stop hold: every token handed out is in the cache,
    after a stop, a processor that raises or a sampler's token outside the vocabulary
    (refused, its step built ahead on a clipped token dropped)."""
    from mlx_lazy import api

    model, _ = tiny_model("llama")
    vocab = model.args.vocab_size
    prompt = ids(150, vocab, 70)
    plain = make_prompt_cache(model, config)
    want = [t for t, _ in generate_step(prompt, model, prompt_cache=plain, max_tokens=12)]
    monkeypatch.setattr(api, "_pipelined", lambda engine: True)
    ahead = make_prompt_cache(model, config)
    assert [t for t, _ in generate_step(prompt, model, prompt_cache=ahead,
                                        max_tokens=12)] == want
    assert ahead.tokens == plain.tokens == prompt + want
    same_state(plain.engine.cache)(ahead.engine.cache)

    stopped, got = make_prompt_cache(model, config), []
    for token, _ in generate_step(prompt, model, prompt_cache=stopped, max_tokens=12):
        got.append(token)
        if len(got) == 5:
            break
    assert stopped.tokens == prompt + want[:5]
    assert stopped.engine.cache.length == len(stopped.tokens)

    raised, got = make_prompt_cache(model, config), []
    with pytest.raises(Boom):
        for token, _ in generate_step(prompt, model, prompt_cache=raised, max_tokens=12,
                                      logits_processors=[raise_after(7)]):
            got.append(token)
    assert got == want[:5] and raised.tokens == prompt + got
    assert raised.engine.cache.length == len(raised.tokens)

    for bad in (vocab + 5, -1, 2.5):  # 2.5 once reached the embedding: MLX's gather error
        calls = []

        def sampler(logprobs):
            calls.append(1)
            return mx.array([bad]) if len(calls) == 4 else mx.argmax(logprobs, axis=-1)

        refused = make_prompt_cache(model, config)
        with pytest.raises(UserInputError, match="the sampler returned .* not a token id"):
            list(generate_step(prompt, model, prompt_cache=refused, sampler=sampler,
                               max_tokens=8))
        assert refused.tokens == prompt + want[:3]
        assert refused.engine.cache.length == len(refused.tokens)
