"""``python -m mlx_lazy.cache_prompt``: process a prompt once and save the lazy state.

As mlx-lm's ``cache_prompt``: the prompt (a long document, a system prompt) is run through
the model with the chosen pruning method and the state is written to
``--prompt-cache-file``; ``python -m mlx_lazy.generate --prompt-cache-file FILE -p
QUESTION`` then appends the question to it instead of recomputing the document. With a
chat template the cache holds the conversation up to the end of the prompt's text, and the
later prompt continues that user message (mlx-lm's convention).

A file is made once and asked many times, so before saving the pruned tokens are carried
through their remaining layers (:meth:`~mlx_lazy.engine.LazyEngine.complete`, what the server
does to a cached state between turns): each (token, layer) is still computed once, and a
question from the file revives nothing. ``--keep-pruned`` saves the pruned state as it is: a
smaller file, made sooner, whose every question revives what it selects.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from . import cli
from .prompt_input import (TEMPLATE_KEY, add_prompt_arguments, encode_prompt, read_prompt,
                           uses_template)
from .run_report import MB
from ._args import EXIT_BAD_INPUT, EXIT_INTERRUPTED, OneLineParser
from .api import check_prompt
from .errors import UserInputError, one_line
from .folders import check_destination, check_not_an_input
from .prompt_cache import make_prompt_cache, save_prompt_cache


def build_parser() -> OneLineParser:
    """The argument parser: the generate tool's model, prompt and pruning options."""
    p = OneLineParser(
        prog="python -m mlx_lazy.cache_prompt",
        description="Process a prompt once with LazyLLM / SPEED pruning and save the state "
                    "for python -m mlx_lazy.generate --prompt-cache-file.")
    add_prompt_arguments(p)
    cli.add_pruning_arguments(p)
    p.add_argument("--prompt-cache-file", required=True, metavar="FILE",
                   help="the safetensors file to write")
    p.add_argument("--keep-pruned", action="store_true",
                   help="save the pruned state as it is (a smaller file, made sooner; each "
                        "question revives the tokens it selects) instead of completing it; "
                        "complete=exact is stored recomputed either way")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the tool with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    args = build_parser().parse_args(argv)
    try:
        config = cli.build_config(args)
        text = read_prompt(args)
        check_not_an_input(args.prompt_cache_file, "--prompt-cache-file",
                           {"--prompt-file": args.prompt_file, "--schedule": args.schedule},
                           replaced=True)
        check_destination(args.prompt_cache_file, "--prompt-cache-file")  # before the prefill
        model, tokenizer = cli.load_model(args.model)
        cache = make_prompt_cache(model, config)
        tokens = encode_prompt(tokenizer, text, args.system_prompt, args.ignore_chat_template,
                               "prefix")
        check_prompt(cache.engine, tokenizer, tokens, 1)
        cache.process(tokens)
        completed = 0 if args.keep_pruned else cache.engine.complete()
        template = "yes" if uses_template(tokenizer, args.ignore_chat_template) else "no"
        save_prompt_cache(args.prompt_cache_file, cache,
                          {"model": str(args.model or ""), TEMPLATE_KEY: template})
    except UserInputError as e:
        print(f"error: {one_line(e, limit=1000)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    state = cache.engine.cache
    print(f"cached {len(cache)} tokens in {args.prompt_cache_file} ("
          + file_parts(os.path.getsize(args.prompt_cache_file), sum(state.kv_bytes_per_layer),
                       state.aux_bytes) + ")"
          + (f"; {completed} token-layers of pruned tokens completed first" if completed else ""),
          file=sys.stderr)
    return 0


def file_parts(size: int, kv: int, aux: int) -> str:
    """A cache file's ``size`` in bytes and its parts: ``kv`` and ``aux`` (the Aux Cache), and
    the rest (selection state, header)."""
    return (f"{size / MB:.1f} MB: KV {kv / MB:.1f} MB, Aux Cache {aux / MB:.1f} MB, the rest "
            f"(selection state, header) {(size - kv - aux) / MB:.1f} MB")


if __name__ == "__main__":
    raise SystemExit(main())
