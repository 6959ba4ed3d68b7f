"""The server's prompt caches: a shared prefix is computed once, concurrent requests on one
cached prefix stay independent, a failing request leaves the stored cache intact, pruned
states are shared only when asked, and the store never holds more than its byte limit."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")

from mlx_lazy import PruningConfig, generate, stream_generate  # noqa: E402
from mlx_lazy.prompt_cache import make_prompt_cache  # noqa: E402
from mlx_lazy import server_worker  # noqa: E402
from mlx_lazy.prefix_store import PromptCacheStore  # noqa: E402
from test_server import Server, in_process_server, run_server  # noqa: E402

DOC = "The passkey is 12345. Remember it. Long prompts are expensive. " * 48


def completion(s: Server, prompt: str, **kw) -> dict:
    status, _, payload = s.request("POST", "/v1/completions",
                                   {"prompt": prompt, "max_tokens": 4, **kw})
    assert status == 200, payload
    return payload


@pytest.mark.slow  # runs a process of its own
def test_a_shared_prefix_is_computed_once_and_reported(tiny_model, tiny_model_path, tmp_path):
    model, tokenizer = tiny_model("llama")
    assert len(tokenizer.encode(DOC)) >= 1000
    with run_server(tiny_model_path, "--no-idle-complete", tmp_path=tmp_path) as s:
        first = completion(s, DOC + " Question one?")
        second = completion(s, DOC + " Question two?")
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 1000 and cached < second["usage"]["prompt_tokens"]
        # The second request computed only its new tokens: far less prefill work.
        work = [r["usage"]["pruning"]["prefill_token_layers"] for r in (first, second)]
        assert work[1] * 20 < work[0], work
        for r, q in ((first, " Question one?"), (second, " Question two?")):
            assert r["choices"][0]["text"] == generate(model, tokenizer, DOC + q, max_tokens=4)
        health = s.health()
        assert health["prompt_cache"]["entries"] >= 1 and health["prompt_cache"]["bytes"] > 0


@pytest.mark.slow  # runs a process of its own
def test_concurrent_requests_on_one_cached_prefix_are_independent(tiny_model, tiny_model_path,
                                                                   tmp_path):
    model, tokenizer = tiny_model("llama")
    questions = [f" Question {i}: what is the passkey?" for i in range(4)]
    with run_server(tiny_model_path, "--no-idle-complete", tmp_path=tmp_path) as s:
        completion(s, DOC)  # the prefix is cached
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda q: completion(s, DOC + q), questions))
    for q, r in zip(questions, answers):
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1000
        assert r["choices"][0]["text"] == generate(model, tokenizer, DOC + q, max_tokens=4)


def test_a_failing_request_leaves_the_stored_cache_intact(tiny_model, tiny_model_path,
                                                          monkeypatch):
    model, tokenizer = tiny_model("llama")
    store = PromptCacheStore(4, 2**30)
    real = server_worker.stream_generate

    def failing_after_prefill(*args, **kw):
        for i, resp in enumerate(real(*args, **kw)):
            if i == 1:
                raise RuntimeError("injected fault after the prefill")
            yield resp

    with in_process_server(tiny_model_path, store) as s:
        completion(s, DOC + " First?")
        held = list(store.most_recent().tokens)
        monkeypatch.setattr(server_worker, "stream_generate", failing_after_prefill)
        status, _, payload = s.request("POST", "/v1/completions",
                                       {"prompt": DOC + " Second?", "max_tokens": 4})
        assert status == 500, payload
        assert store.most_recent().tokens == held and len(store) == 1
        monkeypatch.setattr(server_worker, "stream_generate", real)
        again = completion(s, DOC + " Second?")
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1000
        assert again["choices"][0]["text"] == generate(model, tokenizer, DOC + " Second?",
                                                       max_tokens=4)


@pytest.mark.slow  # runs a process of its own
def test_the_store_never_exceeds_its_byte_limit(tiny_model_path, tmp_path):
    limit = 3 * 2**20
    with run_server(tiny_model_path, "--prompt-cache-bytes", str(limit), "--no-idle-complete",
                    tmp_path=tmp_path) as s:
        for i in range(4):
            completion(s, f"Document {i}. " + DOC[: 400 * (i + 1)])
            assert s.health()["prompt_cache"]["bytes"] <= limit


@pytest.mark.parametrize("idle_complete", [False, True])
def test_idle_completion_carries_the_last_state_to_every_layer(tiny_model_path, idle_complete):
    """With idle completion, the lazy state kept after a request is carried through every
    layer once the server is idle (each token-layer still once); without, tokens wait."""
    store = PromptCacheStore(4, 2**30, share_pruned=True)
    # the paper's decode: the request leaves tokens waiting in the Aux Cache
    pruning = {"method": "lazy", "prune_layers": [1], "keep": [0.3], "complete": "none"}
    with in_process_server(tiny_model_path, store, idle_complete) as s:
        completion(s, DOC + " First?", pruning=pruning)
        deadline = time.monotonic() + 30
        while (idle_complete and store.most_recent().engine.pending_token_layers
               and time.monotonic() < deadline):
            time.sleep(0.05)
        engine = store.most_recent().engine  # a completed copy replaces the stored cache
        assert (engine.pending_token_layers == 0) == idle_complete
        assert engine.stats.max_computations_per_token_layer == 1
        second = completion(s, DOC + " Second?", pruning=pruning)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1000


class WatchedStore(PromptCacheStore):
    """A store that records its byte count after every checkin."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.checkins: list = []

    def checkin(self, cache) -> None:
        super().checkin(cache)
        self.checkins.append(self.nbytes)


def test_idle_completion_never_takes_the_store_past_its_bound(tiny_model, tiny_model_path):
    """Once the stored entry grew from 15.9 to 23.6 MB under a 20 MB bound while idle: the
    bound was checked only when an entry was stored, and completing grows the KV."""
    model, tokenizer = tiny_model("llama")
    pruning = {"method": "lazy", "prune_layers": [1], "keep": [0.3], "complete": "none"}
    config = PruningConfig.preset("lazy", prune_layers=(1,), keep=(0.3,), complete="none")
    # the sizes of the request's state, and of that state completed
    cache = make_prompt_cache(model, config)
    ids = tokenizer.encode(DOC + " First?")
    for _ in stream_generate(model, tokenizer, ids, max_tokens=4, prompt_cache=cache):
        pass
    stored = cache.nbytes
    cache.engine.complete()
    assert cache.nbytes > stored  # completing grows it
    store = WatchedStore(4, (stored + cache.nbytes) // 2, True)
    seen = []
    with in_process_server(tiny_model_path, store, idle_complete=True) as s:
        completion(s, DOC + " First?", pruning=pruning)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(store.checkins) < 2:
            seen.append(store.nbytes)
            time.sleep(0.001)
        seen.append(store.nbytes)
        assert max(seen + store.checkins) <= store.max_bytes, (max(seen), store.max_bytes)
        assert store.nbytes == stored and len(store) == 1  # the uncompleted state is kept
        health = s.health()
        assert health["prompt_cache"]["bytes"] == stored
        second = completion(s, DOC + " Second?", pruning=pruning)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1000


def test_pruned_states_are_not_shared_unless_asked(tiny_model, tiny_model_path):
    """Once 11 of 16 answers of a lazy `complete: none` server differed from the same
    requests on a server without a prefix cache: they depended on the requests before."""
    model, tokenizer = tiny_model("llama")
    pruning = {"method": "lazy", "prune_layers": [1], "keep": [0.3], "complete": "none"}
    config = PruningConfig.preset("lazy", prune_layers=(1,), keep=(0.3,), complete="none")
    questions = [" First?", " Second?", " Third?"]
    for share in (False, True):
        store = PromptCacheStore(4, 2**30, share_pruned=share)
        with in_process_server(tiny_model_path, store) as s:
            answers = [completion(s, DOC + q, pruning=pruning) for q in questions]
            full = [completion(s, DOC + q) for q in questions]  # nothing pruned: shared
        cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in answers]
        assert (min(cached[1:]) >= 1000) == share and (max(cached) == 0) != share, cached
        assert min(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in full[1:]) >= 1000
        for r, q in zip(answers + full, questions * 2):
            want = generate(model, tokenizer, DOC + q, max_tokens=4,
                            config=config if r in answers else None)
            if not share or r in full:
                assert r["choices"][0]["text"] == want, (share, q)


def test_a_hybrid_model_reuses_an_exact_repeat(tiny_model, tiny_model_dir):
    """Regenerating an answer sends the same prompt again. A hybrid's state cannot trim back
    to the token before the prompt's last, which must run again to give logits, so the worker
    keeps that state too: the repeat computes one token, and both answer as a fresh run."""
    model, tokenizer = tiny_model("qwen3_5")
    prompt = DOC + " First?"
    store = PromptCacheStore(8, 2**30)
    with in_process_server(tiny_model_dir("qwen3_5"), store) as s:
        first = completion(s, prompt)
        again = completion(s, prompt)
    n = first["usage"]["prompt_tokens"]
    assert n == len(tokenizer.encode(prompt)) > 1000
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    # each request's prefill work, the split prompt's two chunks counted: n tokens, then 1
    layers = len(model.layers)
    assert [r["usage"]["pruning"]["prefill_token_layers"] for r in (first, again)] == \
        [n * layers, layers]
    texts = [r["choices"][0]["text"] for r in (first, again)]
    # the completions endpoint gives back the space the detokenizer drops at the start
    assert texts[0] == texts[1] and texts[0].lstrip() == generate(model, tokenizer, prompt,
                                                                  max_tokens=4).lstrip()


def test_a_split_prompts_first_token_time_counts_its_first_chunk(tiny_model_dir, monkeypatch):
    """The split's first chunk runs before stream_generate's clock starts: the request's
    ttft_s adds it. The worker's clock jumps 100 s while that chunk runs (the first of the
    prompt's two chunks)."""
    from mlx_lazy.prompt_cache import PromptCache

    class Clock:  # the worker's time module, its perf_counter skewed from the jump on
        skew = 0.0

        def __getattr__(self, name):
            return getattr(time, name)

        def perf_counter(self) -> float:
            return time.perf_counter() + self.skew

    clock, process = Clock(), PromptCache.process

    def slow_process(self, tokens, progress=None):
        clock.skew = clock.skew or 100.0
        return process(self, tokens, progress)

    monkeypatch.setattr(server_worker, "time", clock)
    monkeypatch.setattr(PromptCache, "process", slow_process)
    with in_process_server(tiny_model_dir("qwen3_5"), PromptCacheStore(8, 2**30)) as s:
        ttft = completion(s, DOC + " First?")["usage"]["pruning"]["ttft_s"]
    assert clock.skew == 100.0 and 100.0 <= ttft < 150.0


def test_a_pruned_hybrid_prompt_is_not_split(tiny_model_dir):
    """The split before a prompt's last token is for prompts that prune nothing: a pruning
    schedule's cut is chosen by that last token, so even with --share-pruned-caches a pruned
    prompt runs whole, and keeps the states at its end and after its answer only."""
    pruning = {"method": "static", "prune_layers": [3], "keep": [0.3]}
    for kept, request in ((3, {}), (2, {"pruning": pruning})):
        store = PromptCacheStore(8, 2**30, share_pruned=True)
        with in_process_server(tiny_model_dir("qwen3_5"), store) as s:
            completion(s, DOC + " First?", **request)
        assert len(store) == kept, request


def test_a_hybrid_model_reuses_the_prompt_of_a_turn_it_cannot_trim_back_to(tiny_model,
                                                                           tiny_model_dir):
    """A hybrid's cache cannot trim (its recurrent state): the worker also keeps the state at
    the end of each prompt, so a next request that shares the prompt but not the answer
    (a client re-rendering it, another question) reuses the prompt, and answers as a fresh
    run."""
    model, tokenizer = tiny_model("qwen3_5")
    first, second = DOC + " First?", DOC + " First? Answer: none. Second?"
    shared = tokenizer.encode(first)
    assert tokenizer.encode(second)[: len(shared)] == shared
    store = PromptCacheStore(8, 2**30)
    with in_process_server(tiny_model_dir("qwen3_5"), store) as s:
        completion(s, first)
        reply = completion(s, second)
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == len(shared)
    assert reply["choices"][0]["text"] == generate(model, tokenizer, second, max_tokens=4)
