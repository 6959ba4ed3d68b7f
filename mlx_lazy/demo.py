"""Long-prompt demo: ``python -m mlx_lazy.demo``.

Loads the default model (SmolLM2-135M-Instruct, obtained and converted on first use), asks a
question about a ~1,700-token public-domain text (the US Declaration of Independence, 1776)
and prints the answer and the time to first token.
"""

from __future__ import annotations

from . import _blas  # noqa: F401  (must precede any mlx import)

import argparse
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


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the process exit code."""
    p = argparse.ArgumentParser(prog="python -m mlx_lazy.demo", description=__doc__.split("\n\n")[1])
    p.add_argument("--model", help="MLX model folder or hub id (default: SmolLM2-135M-Instruct)")
    p.add_argument("--max-tokens", type=int, default=48)
    args = p.parse_args(argv)

    import mlx_lm

    from .default_model import DefaultModelUnavailable, default_model_path

    try:
        path = args.model or str(default_model_path())
    except DefaultModelUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    model, tokenizer = mlx_lm.load(path)
    prompt = demo_prompt(tokenizer)
    n_prompt = len(tokenizer.encode(prompt, add_special_tokens=False))
    print(f"model: {path}\nprompt: {n_prompt} tokens (the Declaration of Independence + a "
          f"question)\nquestion: {QUESTION}\n")
    start = time.perf_counter()
    ttft = None
    text = ""
    for resp in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=args.max_tokens):
        if ttft is None:
            ttft = time.perf_counter() - start
            print("answer: ", end="", flush=True)
        print(resp.text, end="", flush=True)
        text += resp.text
    total = time.perf_counter() - start
    print(f"\n\ntime to first token: {ttft:.2f} s   total: {total:.2f} s   "
          f"({resp.prompt_tps:.0f} prompt tok/s, {resp.generation_tps:.1f} gen tok/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
