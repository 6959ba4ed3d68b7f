"""Python API mirroring mlx-lm: ``load``, ``stream_generate``, ``generate``.

The package exports these as ``mlx_lazy.load`` etc.; ``python -m mlx_lazy.generate`` runs the
command-line interface (:mod:`mlx_lazy.cli`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .engine import GenerationStats, LazyEngine, ProgressFn
from .errors import UserInputError
from .schedule import PruningConfig

Sampler = Callable[[mx.array], mx.array]


@dataclass
class GenerationResponse:
    """One streamed piece of output: mlx-lm's fields plus the pruning statistics.

    Attributes:
        text: the next segment of decoded text (may be empty).
        token: the next token id.
        logprobs: log probabilities over the vocabulary for this token.
        from_draft: always False (no speculative decoding).
        prompt_tokens: number of prompt tokens.
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


def load(path_or_repo: Optional[Union[str, Path]] = None) -> Tuple[nn.Module, TokenizerWrapper]:
    """Load a model and tokenizer like ``mlx_lm.load``.

    Args:
        path_or_repo: a named model (``mlx_lazy.default_model.MODELS``, e.g.
            "qwen2.5-coder-0.5b"; obtained into the cache on first use), a local MLX folder
            or a hub id (where the network allows); None loads the default model
            (SmolLM2-135M-Instruct, "smollm2-135m").

    Raises:
        UserInputError: the path does not exist or holds no loadable model, or a named model
            cannot be obtained.
    """
    from mlx_lm import load as mlx_load

    from .default_model import DEFAULT_MODEL, MODELS, model_path

    name = DEFAULT_MODEL if path_or_repo is None else str(path_or_repo)
    path = Path(name).expanduser()
    if name in MODELS and not path.exists():
        folder = model_path(name)
        try:
            return mlx_load(str(folder))
        except (RuntimeError, ValueError, OSError) as e:
            raise UserInputError(f"the cached model {folder} cannot be loaded ({e}); delete "
                                 "that folder to rebuild it") from None
    from .convert import is_hub_id

    if is_hub_id(name):
        return mlx_load(name)
    if not (path / "config.json").is_file():
        raise UserInputError(f"no model found at {name} (expected a folder with config.json, "
                             f"a hub id or a named model: {', '.join(MODELS)})")
    return mlx_load(str(path))


# Hugging Face tokenizers without a configured limit report this huge sentinel.
_NO_TOKENIZER_LIMIT = 10**12


def context_length(model: nn.Module, tokenizer) -> Optional[int]:
    """The model's context: ``max_position_embeddings`` of its config, else the tokenizer's
    ``model_max_length``; None when neither states one."""
    n = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    if n:
        return int(n)
    n = getattr(tokenizer, "model_max_length", None)
    if isinstance(n, int) and 0 < n < _NO_TOKENIZER_LIMIT:
        return n
    return None


def check_context(n_prompt: int, max_tokens: int, context: Optional[int]) -> None:
    """Raise ValueError when the prompt, or the prompt plus ``max_tokens`` new tokens, does
    not fit a context of ``context`` tokens (None: no known limit)."""
    if context is None:
        return
    if n_prompt > context:
        raise ValueError(
            f"the prompt has {n_prompt} tokens but the model's context is {context} tokens"
        )
    if n_prompt + max_tokens > context:
        raise ValueError(
            f"the prompt has {n_prompt} tokens; with {max_tokens} new tokens it exceeds the "
            f"model's context of {context} tokens (lower max_tokens)"
        )


def _encode(tokenizer: TokenizerWrapper, prompt: Union[str, List[int], mx.array]) -> List[int]:
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        return tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    return [int(t) for t in (prompt.tolist() if isinstance(prompt, mx.array) else prompt)]


def stream_generate(
    model: nn.Module,
    tokenizer,
    prompt: Union[str, List[int], mx.array],
    max_tokens: int = 256,
    sampler: Optional[Sampler] = None,
    config: Optional[Union[PruningConfig, str]] = None,
    progress: Optional[ProgressFn] = None,
) -> Iterator[GenerationResponse]:
    """Generate text, yielding a :class:`GenerationResponse` per token.

    Args:
        model: a model from :func:`load`.
        tokenizer: its tokenizer (wrapped into mlx-lm's ``TokenizerWrapper`` if needed).
        prompt: text (the chat template is not applied here) or token ids.
        max_tokens: the most tokens to generate.
        sampler: maps log probabilities (1, vocab) to a token (1,); None is greedy.
        config: a :class:`PruningConfig`, a preset name, or None for no pruning.
        progress: called as ``progress(layers_done, num_layers)`` during prefill.

    Raises:
        ValueError: empty prompt, prompt longer than the model's context, bad config or
            unsupported model.
    """
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    if isinstance(config, str):
        config = PruningConfig.preset(config)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    tokens = _encode(tokenizer, prompt)
    engine = LazyEngine(model, config)
    if not tokens:
        raise ValueError("the prompt is empty")
    check_context(len(tokens), max_tokens, context_length(model, tokenizer))
    sampler = sampler or (lambda logprobs: mx.argmax(logprobs, axis=-1))

    def sample(logits: mx.array) -> Tuple[mx.array, mx.array]:
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        return sampler(logprobs[None]), logprobs

    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    mx.reset_peak_memory()
    tic = time.perf_counter()
    y, logprobs = sample(engine.prefill(mx.array(tokens), progress))
    mx.eval(y, logprobs)
    ttft = time.perf_counter() - tic
    tic = time.perf_counter()
    n = 0
    while True:
        # Queue the next step before handing this token out, as mlx-lm does.
        if n + 1 < max_tokens:
            next_y, next_logprobs = sample(engine.decode(y))
            mx.async_eval(next_y, next_logprobs)
        token = y.item()
        n += 1
        finish = "stop" if token in tokenizer.eos_token_ids else ("length" if n == max_tokens else None)
        if finish != "stop":
            detokenizer.add_token(token)
        if finish:
            detokenizer.finalize()
        elapsed = time.perf_counter() - tic
        stats = replace(
            engine.stats,
            ttft_s=ttft,
            tpot_s=elapsed / (n - 1) if n > 1 else 0.0,
            prompt_tps=len(tokens) / ttft,
            generation_tps=(n - 1) / elapsed if n > 1 else 0.0,
            generation_tokens=n,
            peak_memory_bytes=mx.get_peak_memory(),
            text=detokenizer.text,
        )
        yield GenerationResponse(
            text=detokenizer.last_segment,
            token=token,
            logprobs=logprobs,
            from_draft=False,
            prompt_tokens=len(tokens),
            prompt_tps=stats.prompt_tps,
            generation_tokens=n,
            generation_tps=stats.generation_tps,
            peak_memory=stats.peak_memory_bytes / 1e9,
            finish_reason=finish,
            stats=stats,
        )
        if finish:
            return
        y, logprobs = next_y, next_logprobs


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
        s = last.stats
        print(
            f"\n==========\nPrompt: {s.prompt_tokens} tokens, TTFT {s.ttft_s:.3f} s, "
            f"{s.prompt_tps:.1f} tokens-per-sec\nGeneration: {s.generation_tokens} tokens, "
            f"{s.generation_tps:.1f} tokens-per-sec\nPeak memory: {last.peak_memory:.3f} GB"
        )
    return text
