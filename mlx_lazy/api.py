"""Python API mirroring mlx-lm: ``load``, ``stream_generate``, ``generate``.

The package exports these as ``mlx_lazy.load`` etc.; ``python -m mlx_lazy.generate`` runs the
command-line interface (:mod:`mlx_lazy.cli`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Generator, Iterator, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import distributed
from .adapter import ModelAdapter, config_value, text_args
from .attention import implementation as attention_implementation
from .engine import GenerationStats, LazyEngine, ProgressFn
from .errors import UserInputError, one_line, shown
from .inputs import is_int
from .models import model_folder
from .prompt_cache import PromptCache, check_prompt_cache, make_prompt_cache
from .run_report import format_summary
from .config import PruningConfig
from .schedule import Schedule, check_fits
from .schedule_files import folder_schedules
from .selection import min_keep
from .token_ids import check_tokens, token_ids

Sampler = Callable[[mx.array], mx.array]


@dataclass
class GenerationResponse:
    """One streamed piece of output: mlx-lm's fields plus the pruning statistics.

    Attributes:
        text: the next segment of decoded text (may be empty).
        token: the next token id.
        logprobs: log probabilities over the vocabulary for this token.
        from_draft: always False (no speculative decoding).
        prompt_tokens: prompt tokens given to this call, as mlx-lm counts them (with a prompt
            cache, only the new ones; ``stats.prompt_tokens`` counts the cached ones too).
        prompt_tps: prompt tokens per second (prompt tokens / time to first token).
        generation_tokens: tokens generated so far.
        generation_tps: tokens per second since the first token.
        peak_memory: peak memory so far in GB.
        finish_reason: "length", "stop" or None.
        stats: the generation's :class:`GenerationStats`; complete on the last response.
    """

    text: str
    token: int
    logprobs: mx.array
    from_draft: bool
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: Optional[str] = None
    stats: Optional[GenerationStats] = None


def load(
    path_or_repo: Optional[Union[str, Path]] = None,
    group: Optional[mx.distributed.Group] = None,
) -> Tuple[nn.Module, TokenizerWrapper]:
    """Load a model and tokenizer like ``mlx_lm.load``.

    Args:
        path_or_repo: a named model (``mlx_lazy.models.MODELS``, e.g.
            "qwen2.5-coder-0.5b"; obtained into the cache on first use), a local MLX folder
            or a hub id (where the network allows); None loads the default model
            (SmolLM2-135M-Instruct, "smollm2-135m"). A folder holding
            ``mlx_lazy_schedule.json`` (written by ``python -m mlx_lazy.calibrate``) makes a
            plain ``"lazy"`` use that calibrated schedule (``mlx_lazy_schedule.high.json``
            for ``quality="high"``).
        group: an ``mx.distributed`` group of more than one rank (e.g.
            ``mx.distributed.init()`` under ``mlx.launch``): every rank calls ``load``, and
            each keeps its share of the model (mlx-lm's ``model.shard``). The ranks check
            together that they loaded the same files; every rank raises the same error if
            one fails. The engine and ``stream_generate`` then work unchanged.

    Raises:
        UserInputError: the path does not exist or holds no loadable model of a supported
            family (the message names the file and the problem), a named model cannot be
            obtained, or (with ``group``) the model cannot be sharded or another rank failed
            or loaded other files, or ``$MLX_LAZY_ATTENTION`` names no attention.
    """
    from mlx_lm import load as mlx_load

    # a bad $MLX_LAZY_ATTENTION or $MLX_LAZY_MIN_KEEP is refused before the model loads
    attention_implementation()
    min_keep()
    group = group if group is not None and group.size() > 1 else None
    with distributed.together(group) as same:  # sharded: every rank fails alike, or none
        path, cached = model_folder(path_or_repo, local=group is not None)
        try:  # lazy when sharded: each rank reads only its share
            model, tokenizer = mlx_load(path, lazy=group is not None)
        except (ValueError, OSError, TypeError) as e:  # mlx-lm's checks of the files,
            # reading them, or a config lacking a field its ModelArgs requires (a TypeError
            # naming the "required positional argument"; any other TypeError is a bug)
            if isinstance(e, TypeError) and "required positional argument" not in str(e):
                raise
            raise UserInputError(f"cannot load model {path}: {one_line(e)}"
                                 + (f"; delete {path} to rebuild it" if cached else "")
                                 ) from None
        if group is not None:
            same["model files"] = distributed.weights_digest(Path(path))
            distributed.shard(model, group)
            mx.eval(model.parameters())
    # the folder's calibrated schedules, by quality, for plain "lazy"
    model.mlx_lazy_schedules = folder_schedules(path, ModelAdapter(model).fingerprint())
    return model, tokenizer


# Hugging Face tokenizers without a configured limit report this huge sentinel.
_NO_TOKENIZER_LIMIT = 10**12


def context_length(model: nn.Module, tokenizer) -> Optional[int]:
    """The model's context: ``max_position_embeddings`` (GPT-2's ``n_positions``) of its
    config, else the tokenizer's ``model_max_length``; None when neither states one."""
    n = config_value(text_args(model), "max_position_embeddings")  # Youtu-LLM's config
    if n:
        return int(n)
    n = getattr(tokenizer, "model_max_length", None)
    if isinstance(n, int) and 0 < n < _NO_TOKENIZER_LIMIT:
        return n
    return None


def check_context(n_prompt: int, max_tokens: int, context: Optional[int],
                  name: str = "max_tokens") -> None:
    """Raise UserInputError when the prompt, or the prompt plus ``max_tokens`` new tokens, does
    not fit a context of ``context`` tokens (None: no known limit); the message names the
    option as the caller spelt it (``name``)."""
    if context is None:
        return
    if n_prompt > context:
        raise UserInputError(
            f"the prompt has {n_prompt} tokens but the model's context is {context} tokens"
        )
    if n_prompt + max_tokens > context:
        raise UserInputError(
            f"the prompt has {n_prompt} tokens; with {max_tokens} new tokens it exceeds the "
            f"model's context of {context} tokens (lower {name})"
        )


# mlx-lm's keyword arguments of stream_generate / generate_step that mlx-lazy does not
# implement; passing one (other than as None) raises instead of being silently ignored.
MLX_LM_UNSUPPORTED = (
    "draft_model", "num_draft_tokens", "max_kv_size", "kv_bits",
    "kv_group_size", "quantized_kv_start", "prefill_step_size", "input_embeddings", "stream",
)
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
PromptProgress = Callable[[int, int], None]


def _check_unsupported(kwargs: dict) -> None:
    unknown = sorted(set(kwargs) - set(MLX_LM_UNSUPPORTED))
    if unknown:
        raise TypeError(f"stream_generate() got unexpected keyword arguments: {', '.join(unknown)}")
    given = sorted(k for k, v in kwargs.items() if v is not None)
    if given:
        raise UserInputError(
            f"mlx-lazy does not support mlx-lm's {', '.join(given)}; supported options are "
            f"max_tokens, sampler, logits_processors, prompt_progress_callback, prompt_cache "
            f"and config"
        )


def _check_max_tokens(max_tokens: int) -> None:
    if not is_int(max_tokens, numpy=True) or max_tokens < 1:
        raise UserInputError(f"max_tokens must be a positive integer, got {max_tokens!r}")


def prompt_token_ids(tokenizer: TokenizerWrapper, prompt: Union[str, List[int], mx.array],
                     verbose: bool = True) -> List[int]:
    """Token ids of ``prompt``: text is encoded as mlx-lm does, ids are checked to be integers.
    ``verbose`` False: the tokenizer does not warn of a text longer than its
    ``model_max_length`` (for a caller that checks the length itself)."""
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise UserInputError(
                f"the prompt is not valid text: {prompt[e.start]!r} at index {e.start} (a byte "
                f"that is not UTF-8, e.g. from a command line or file in another encoding)"
            ) from None
        bos = tokenizer.bos_token
        return tokenizer.encode(prompt, verbose=verbose,
                                add_special_tokens=bos is None or not prompt.startswith(bos))
    if not isinstance(prompt, (list, tuple, mx.array, np.ndarray)):
        raise UserInputError(f"the prompt must be text or token ids, got {type(prompt).__name__}")
    return token_ids(prompt)


def check_prompt(engine: LazyEngine, tokenizer, tokens: List[int], max_tokens: int,
                 name: str = "max_tokens") -> None:
    """Raise UserInputError when ``engine`` cannot generate ``max_tokens`` tokens after
    ``tokens`` (:func:`check_tokens`, then :func:`check_room`); ``name`` is how the caller
    spells ``max_tokens``."""
    check_tokens(tokens, engine.adapter.vocab_size)
    check_room(engine, tokenizer, len(tokens), max_tokens, name)


def check_room(engine: LazyEngine, tokenizer, n_tokens: int, max_tokens: int,
               name: str = "max_tokens") -> None:
    """Raise UserInputError when ``engine`` has no room for ``max_tokens`` tokens after
    ``n_tokens`` (:func:`check_context`, :func:`mlx_lazy.schedule.check_fits`,
    :func:`check_anchors`): what a prompt's length decides, its ids aside."""
    context = context_length(engine.adapter.model, tokenizer)
    check_context(n_tokens, max_tokens, context, name)
    check_fits(engine.schedule, context)
    check_anchors(engine.schedule, n_tokens)


def check_anchors(schedule: Schedule, n_prompt: int) -> None:
    """Raise UserInputError when a pruning schedule's anchors cover the whole prompt."""
    if schedule.prunes and schedule.anchors > n_prompt:
        raise UserInputError(
            f"anchors={schedule.anchors} is more than the prompt's {n_prompt} tokens, so "
            f"nothing could be pruned (lower anchors)"
        )


def _token_progress(callback: PromptProgress, n: int) -> ProgressFn:
    """The engine's per-layer progress as mlx-lm's ``(prompt tokens processed, total)``:
    layers done in token equivalents, below ``n`` until the first token is out."""
    last = 0

    def on_layer(done: int, num_layers: int) -> None:
        nonlocal last
        processed = min(n - 1, n * done // num_layers)
        if processed > last:
            last = processed
            callback(processed, n)

    return on_layer


def generate_step(
    prompt: Union[List[int], mx.array],
    model: nn.Module,
    *,
    max_tokens: int = 256,
    sampler: Optional[Sampler] = None,
    logits_processors: Optional[List[LogitsProcessor]] = None,
    prompt_cache: Optional[PromptCache] = None,
    prompt_progress_callback: Optional[PromptProgress] = None,
    config: Optional[Union[PruningConfig, str]] = None,
) -> Generator[Tuple[int, mx.array], None, None]:
    """Yield ``(token, logprobs)`` one generated token at a time, as mlx-lm's
    ``generate_step``: the engine's generation loop (``stream_generate``, the CLI, the server
    and the benchmarks generate through it; ``cache_prompt`` and the probe only fill a
    cache, through :meth:`PromptCache.process` and :meth:`LazyEngine.prefill`).

    Args:
        prompt: token ids, processed on top of ``prompt_cache``.
        model: a model from :func:`load`.
        max_tokens: the most tokens to generate (0: none, the prompt only goes into the
            cache; negative: until the model's context is full, or no limit when its config
            states none; mlx-lm's runs past the context).
        sampler: maps log probabilities (1, vocab) to a token (1,); None is greedy. A
            sampler that returns given tokens teacher-forces a continuation.
        logits_processors: each called as ``processor(tokens, logits)`` with every token so
            far (cached, prompt and output) and the (1, vocab) logits, before sampling.
        prompt_cache: a :func:`make_prompt_cache` cache, updated in place with the prompt and
            the generated tokens the model has run; None starts from an empty one.
        prompt_progress_callback: called with ``(prompt tokens processed, total)``.
        config: the pruning config (None: the cache's, or ``"full"`` without a cache); with
            a cache it must be the one the cache was made for.

    Raises:
        UserInputError: a cache made for another model or config, a prompt that is not
            token ids of the model, ``max_tokens`` that is no integer, a prompt that with
            ``max_tokens`` exceeds the model's context, a pruning schedule with more anchors
            than the prompt has tokens, a sampler that returns something else; on a sharded
            model, ranks given different prompts, ``max_tokens`` or pruning settings (every
            rank raises). An exception (these, one from a sampler or processor, Ctrl-C)
            leaves ``prompt_cache`` holding the prompt and every token handed out before
            it, as stopping does, or as it was (a prompt interrupted part-way).
    """
    owned = prompt_cache is None  # nobody else sees it: tokens need not go in at the end
    # Sharded, the ranks must agree on all that decides, or their all-sums stop lining up.
    with distributed.together(distributed.model_group(model)) as same:
        if owned:
            prompt_cache = make_prompt_cache(model, config)
        else:
            check_prompt_cache(prompt_cache, "prompt_cache")
            prompt_cache.check(model, config)
        tokens = token_ids(prompt)
        if prompt_cache.engine.tp.group is not None:
            same["prompts"] = distributed.digest(str(prompt_cache.tokens + tokens).encode())
            same["pruning settings"] = decision_digest(prompt_cache.schedule)
            same["token limits"] = distributed.digest_of(max_tokens)
    engine = prompt_cache.engine
    if not is_int(max_tokens, numpy=True):
        raise UserInputError("max_tokens must be an integer (0: the prompt only; negative: up "
                             f"to the model's context), got {shown(max_tokens, 80)}")
    check_tokens(tokens, engine.adapter.vocab_size)  # the cache's were, as they went in
    n_context = len(prompt_cache) + len(tokens)
    check_room(engine, None, n_context, max(int(max_tokens), 0))
    context = context_length(engine.adapter.model, None)
    if max_tokens < 0 and context is not None:  # no limit of its own: the context's
        max_tokens = context - n_context
    vocab = engine.adapter.vocab_size
    engine.start_request()
    sampler = sampler or (lambda logprobs: mx.argmax(logprobs, axis=-1))
    processors = list(logits_processors or [])
    history = mx.array(prompt_cache.tokens + tokens)  # for the logits processors

    def sample(logits: mx.array) -> Tuple[mx.array, mx.array]:
        logits = logits[None]
        for processor in processors:
            logits = processor(history, logits)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        # Sharded: every rank continues with rank 0's token, whatever its own sampler drew.
        return distributed.from_rank0(sampler(logprobs), engine.tp.group), logprobs[0]

    on_layer = None
    if prompt_progress_callback is not None:
        on_layer = _token_progress(prompt_progress_callback, len(tokens))
    # On mlx-lm's generation stream, as its generate_step: Metal overlaps building the next
    # step with computing this one.
    with mx.stream(generation_stream):
        y, logprobs = sample(prompt_cache.process(tokens, on_layer))
    if max_tokens == 0:  # as mlx-lm: the prompt is processed (and cached), nothing generated
        return
    mx.eval(y, logprobs)

    def forward(y: mx.array) -> mx.array:
        """The model on ``y``, into the cache (taken back whole, revivals included, if it
        raises); the logits after it."""
        with mx.stream(generation_stream), engine.atomic():
            return engine.decode(y)  # the engine completes first, as its schedule says

    def then_sample(y: mx.array, logits: mx.array) -> Tuple[mx.array, mx.array]:
        nonlocal history
        if processors:
            history = mx.concatenate([history, y.reshape(1).astype(history.dtype)])
        with mx.stream(generation_stream):
            out = sample(logits)
        mx.async_eval(*out)
        return out

    def step(y: mx.array) -> Tuple[mx.array, mx.array]:
        return then_sample(y, forward(y))

    def feed(y: mx.array, token: int) -> mx.array:
        """Run the handed-out ``token`` (``y``) through the model into the cache: once it is
        there, a sampler or processor that raises on the logits after it leaves it there."""
        logits = forward(y)
        prompt_cache.tokens.append(token)
        return logits

    overlap = _pipelined(engine)
    n = 0
    try:
        while True:
            # On a GPU, from the second token on, the next step is built on this one's token
            # before waiting for it, as mlx-lm does: the host builds step n+1 (up to a pruned
            # step's first selection, which waits) while the device computes step n, and the
            # cache holds every token handed out. The first token goes out at once: a pruned
            # decode step syncs with the host to select, and completion runs before the first
            # decode step; the time to first token includes neither.
            ahead = overlap and n > 0
            if ahead:  # a token outside the vocabulary is refused below, its step dropped
                next_y, next_logprobs = step(mx.clip(y, 0, vocab - 1).astype(mx.uint32))
            token = y.item()
            if not is_int(token) or not 0 <= token < vocab:
                raise UserInputError(f"the sampler returned {token!r}, not a token id of the "
                                     f"model's vocabulary (0 to {vocab - 1})")
            if ahead:
                prompt_cache.tokens.append(token)
            # Not yet in the cache (the first token, and every token on the CPU): it goes in
            # when the caller stops, as it would have gone in before it went out on a GPU.
            unfed = not ahead and not owned
            try:
                yield token, logprobs
            except GeneratorExit:
                if unfed:
                    mx.async_eval(feed(y, token))
                raise
            n += 1
            if n == max_tokens:
                if unfed:
                    mx.async_eval(feed(y, token))
                return
            if n % 256 == 0:
                mx.clear_cache()
            if not ahead:
                next_y, next_logprobs = then_sample(y, feed(y, token))
            y, logprobs = next_y, next_logprobs

    except BaseException:  # a sampler or processor that raised, Ctrl-C: a consistent cache
        mx.synchronize(generation_stream)
        prompt_cache.drop_unrecorded()
        raise
    finally:  # a step queued ahead finishes before anything else runs (ranks stay in step)
        mx.synchronize(generation_stream)


def _pipelined(engine: LazyEngine) -> bool:
    """Whether :func:`generate_step` builds each decode step before waiting for the token
    before it: on a GPU, as mlx-lm does. On the CPU the host would build with the cores that
    compute: on 2 cores, steps built ahead ran 8% slower unpruned and 18% pruned (Gemma 3 at
    2K, alternating runs); there a token goes into the cache after it is handed out, the last
    one when the caller stops (the caller's cache then holds every token handed out, as
    mlx-lm's does). A step run ahead is taken back by a trim, which a recurrent layer's
    state cannot do."""
    return generation_stream.device != mx.cpu and not engine.cache.recurrent


def decision_digest(schedule: Schedule) -> bytes:
    """A digest of what decides a pruned run's selections beside the prompt: the schedule,
    the least kept (``$MLX_LAZY_MIN_KEEP``) and the attention in use (``$MLX_LAZY_ATTENTION``);
    the ranks of a sharded model must agree on it."""
    return distributed.digest_of([schedule.as_dict(), min_keep(), attention_implementation()])


def stream_generate(
    model: nn.Module,
    tokenizer,
    prompt: Union[str, List[int], mx.array],
    max_tokens: int = 256,
    *,
    sampler: Optional[Sampler] = None,
    logits_processors: Optional[List[LogitsProcessor]] = None,
    prompt_progress_callback: Optional[PromptProgress] = None,
    config: Optional[Union[PruningConfig, str]] = None,
    prompt_cache: Optional[PromptCache] = None,
    **mlx_lm_kwargs,
) -> Iterator[GenerationResponse]:
    """Generate text, yielding a :class:`GenerationResponse` per token.

    Args:
        model: a model from :func:`load`.
        tokenizer: its tokenizer (wrapped into mlx-lm's ``TokenizerWrapper`` if needed).
        prompt: text (the chat template is not applied here) or token ids; with
            ``prompt_cache``, what comes after the cached tokens.
        max_tokens: the most tokens to generate (a positive integer).
        sampler: maps log probabilities (1, vocab) to a token (1,); None is greedy.
        logits_processors: as in mlx-lm, each called as ``processor(tokens, logits)`` with
            every token so far (prompt and output) and the (1, vocab) logits, before sampling;
            e.g. ``mlx_lm.sample_utils.make_logits_processors(repetition_penalty=1.2)``.
        prompt_progress_callback: as in mlx-lm, called with ``(prompt tokens processed,
            total)``: ``(0, n)`` first, rising during prefill (the engine goes layer by layer,
            so the layers done count as token equivalents) and ``(n, n)`` once the first
            token is out.
        config: a :class:`PruningConfig`, a preset name, or None for no pruning (with a
            prompt cache: the cache's config).
        prompt_cache: a :func:`mlx_lazy.make_prompt_cache` cache: the prompt is processed on
            top of it and the cache updated in place (prompt and generated tokens), as in
            mlx-lm; ``stats.cached_tokens`` says how many tokens it held.
        **mlx_lm_kwargs: mlx-lm's other options (:data:`MLX_LM_UNSUPPORTED`) are accepted as
            None only.

    Raises:
        UserInputError: empty prompt, token ids outside the vocabulary, prompt longer than
            the model's context, bad ``max_tokens`` or config, a cache made for another
            model or config, an mlx-lm option mlx-lazy does not support, or an unsupported
            model.
    """
    _check_unsupported(mlx_lm_kwargs)
    _check_max_tokens(max_tokens)
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    tokens = prompt_token_ids(tokenizer, prompt)
    if prompt_cache is None:
        prompt_cache = make_prompt_cache(model, config)
    else:
        check_prompt_cache(prompt_cache, "prompt_cache")
        prompt_cache.check(model, config)
    engine, cached = prompt_cache.engine, len(prompt_cache)
    check_prompt(engine, tokenizer, prompt_cache.tokens + tokens, max_tokens)

    n_prompt = len(tokens)
    if prompt_progress_callback is not None:
        prompt_progress_callback(0, n_prompt)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    mx.reset_peak_memory()
    tic = time.perf_counter()
    steps = generate_step(tokens, model, max_tokens=max_tokens, sampler=sampler,
                          logits_processors=logits_processors, prompt_cache=prompt_cache,
                          prompt_progress_callback=prompt_progress_callback)
    ttft = 0.0
    with wired_limit(model, [generation_stream]):  # large models on Metal, as mlx-lm
        for n, (token, logprobs) in enumerate(steps, start=1):
            if n == 1:
                ttft = time.perf_counter() - tic
                if prompt_progress_callback is not None:
                    prompt_progress_callback(n_prompt, n_prompt)
                tic = time.perf_counter()
            finish = ("stop" if token in tokenizer.eos_token_ids
                      else ("length" if n == max_tokens else None))
            if finish != "stop":
                detokenizer.add_token(token)
            if finish:
                detokenizer.finalize()
            elapsed = time.perf_counter() - tic
            stats = replace(
                engine.stats,
                ttft_s=ttft,
                tpot_s=elapsed / (n - 1) if n > 1 else 0.0,
                answer_s=ttft + elapsed,
                prompt_tps=n_prompt / ttft,
                generation_tps=(n - 1) / elapsed if n > 1 else 0.0,
                prompt_tokens=cached + n_prompt,
                cached_tokens=cached,
                generation_tokens=n,
                peak_memory_bytes=mx.get_peak_memory(),
                text=detokenizer.text,
            )
            yield GenerationResponse(
                text=detokenizer.last_segment,
                token=token,
                logprobs=logprobs,
                from_draft=False,
                prompt_tokens=n_prompt,
                prompt_tps=stats.prompt_tps,
                generation_tokens=n,
                generation_tps=stats.generation_tps,
                peak_memory=stats.peak_memory_bytes / 1e9,
                finish_reason=finish,
                stats=stats,
            )
            if finish:
                return


def generate(
    model: nn.Module,
    tokenizer,
    prompt: Union[str, List[int], mx.array],
    verbose: bool = False,
    **kwargs,
) -> str:
    """Generate a complete response; keyword arguments as :func:`stream_generate`.

    With ``verbose`` the text is printed as it is generated, followed by timings.
    """
    text, last = "", None
    for last in stream_generate(model, tokenizer, prompt, **kwargs):
        text += last.text
        if verbose:
            print(last.text, end="", flush=True)
    if verbose and last is not None:
        print("\n==========\n" + format_summary(last.stats))  # as the command line's
    return text
