"""Long-prompt demo: ``python -m mlx_lazy.demo``.

Loads the default model (SmolLM2-135M-Instruct, obtained and converted on first use), asks a
question about a ~1,700-token public-domain text (the US Declaration of Independence, 1776)
with mlx-lm's own generate, with mlx-lazy unpruned and with LazyLLM pruning, and prints the
answers, times to first token and whole-answer times.
"""

from __future__ import annotations

from . import _blas  # noqa: F401  (must precede any mlx import)

import sys
import time
from importlib import resources
from typing import Any

DOCUMENT = "declaration_of_independence.txt"
QUESTION = "According to the document, what do the signers mutually pledge to each other?"
#: Lowercase substrings a correct answer contains ("our Lives, our Fortunes and our sacred Honor").
EXPECTED = ("lives", "fortunes", "honor")


def demo_text() -> str:
    """The built-in document (public domain)."""
    return resources.files("mlx_lazy").joinpath("data", DOCUMENT).read_text(encoding="utf-8")


def demo_prompt(tokenizer: Any, question: str = QUESTION) -> str:
    """The demo prompt, a string with the tokenizer's chat template already applied."""
    content = (f"Read the following document and answer the question after it.\n\n"
               f"{demo_text()}\n\nQuestion: {question}\nAnswer in one short sentence.")
    return tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                         add_generation_prompt=True, tokenize=False)


def _answer_mlx_lm(model, tokenizer, prompt: str,
                   max_tokens: int) -> tuple[str, float, int, float]:
    """The baseline: mlx-lm's own generate. Returns (answer, time to first token, tokens,
    whole answer's seconds)."""
    import mlx_lm

    start, ttft, text, tokens = time.perf_counter(), 0.0, "", 0
    for resp in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        if not text and not ttft:
            ttft = time.perf_counter() - start
        text, tokens = text + resp.text, resp.generation_tokens
    return text.strip(), ttft, tokens, time.perf_counter() - start


def _answer_ours(model, tokenizer, prompt: str, max_tokens: int,
                 config) -> tuple[str, Any, float]:
    """Our engine with ``config``. Returns (answer, GenerationStats, whole answer's seconds)."""
    from .api import stream_generate

    start, text, resp = time.perf_counter(), "", None
    for resp in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, config=config):
        text += resp.text
    return text.strip(), resp.stats, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the process exit code."""
    from ._args import OneLineParser
    from .bench.methods import method_spec
    from .cli import add_pruning_arguments, build_config
    from .config import PruningConfig
    from .models import MODEL_HELP

    p = OneLineParser(prog="python -m mlx_lazy.demo", description=__doc__.split("\n\n")[1])
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--max-tokens", type=int, default=48,
                   help="the answer's length in tokens (default 48: the correct answer needs "
                        "about 40; a shorter one is cut before it and marked incorrect)")
    # the generate command's (--complete, --quality, --schedule, ...)
    add_pruning_arguments(p, default_method="lazy, shown against mlx-lm")
    args = p.parse_args(argv)
    if args.method is None and args.schedule is None:
        args.method = "lazy"
    if args.max_tokens < 1:  # mlx-lm's traceback, after the model loaded, once
        p.error(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.method == "full" and args.schedule is None:
        p.error("the demo shows a pruning method against mlx-lm: choose one other than full")

    from .api import check_context, context_length, load
    from .resolve import resolve_config
    from .errors import UserInputError, one_line

    try:
        model, tokenizer = load(args.model)
        prompt = demo_prompt(tokenizer)
        n_prompt = len(tokenizer.encode(prompt, add_special_tokens=False))
        # before mlx-lm runs past the context (and ours then refuses it)
        check_context(n_prompt, args.max_tokens, context_length(model, tokenizer),
                      "--max-tokens")
        config = build_config(args)
        resolve_config(model, config)  # one the model cannot run: refused before any run
    except UserInputError as e:  # a bad --model, one not obtained, too short or unable to
        # run --method
        print(f"error: {one_line(e, limit=1000)}", file=sys.stderr)
        return 2
    print(f"prompt: {n_prompt} tokens (the Declaration of Independence + a question)\n"
          f"question: {QUESTION}\n")

    print("[mlx-lm, no pruning] ...", flush=True)
    base_text, base_ttft, base_tokens, base_s = _answer_mlx_lm(model, tokenizer, prompt,
                                                               args.max_tokens)
    print(f"  answer: {base_text}\n  time to first token: {base_ttft:.2f} s, whole answer "
          f"({base_tokens} tokens): {base_s:.2f} s\n")

    # The same model through our engine unpruned: what the pruning itself gains is against
    # this, not against mlx-lm (whose CPU attention is slower here than ours).
    print("[mlx-lazy, full: no pruning] ...", flush=True)
    full_text, full_stats, full_s = _answer_ours(model, tokenizer, prompt, args.max_tokens,
                                                 PruningConfig.preset("full"))
    print(f"  answer: {full_text}\n  time to first token: {full_stats.ttft_s:.2f} s, whole "
          f"answer ({full_stats.generation_tokens} tokens): {full_s:.2f} s\n")

    name = method_spec(config)
    print(f"[mlx-lazy, {name}] ...", flush=True)
    text, stats, seconds = _answer_ours(model, tokenizer, prompt, args.max_tokens, config)
    print(f"  answer: {text}\n  time to first token: {stats.ttft_s:.2f} s "
          f"({full_stats.ttft_s / stats.ttft_s:.2f}x sooner than unpruned, "
          f"{base_ttft / stats.ttft_s:.2f}x than mlx-lm), whole answer "
          f"({stats.generation_tokens} tokens): {seconds:.2f} s ({full_s / seconds:.2f}x sooner "
          f"than unpruned, {base_s / seconds:.2f}x than mlx-lm)\n"
          f"  {stats.prompt_tokens_computed_pct:.0f}% of prompt tokens reached the top layer, "
          f"schedule {stats.schedule['prune_layers'] or ''} keep {stats.schedule['keep'] or ''}")
    for label, answer in (("mlx-lm", base_text), ("full", full_text), (name, text)):
        ok = all(word in answer.lower() for word in EXPECTED)
        print(f"  {label:>10}: {'correct' if ok else 'incorrect'} (expects "
              f"{', '.join(EXPECTED)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
