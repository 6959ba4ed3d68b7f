"""The prompt a command-line tool is given: its options (``--prompt``, ``--prompt-file``,
``--system-prompt``, ``--ignore-chat-template``, mlx-lm's names), reading it (a bounded read of
a file or stdin, checked to be UTF-8) and its token ids with the chat template applied as
mlx-lm's CLI does. Shared by ``mlx_lazy.generate`` (:mod:`mlx_lazy.cli`) and
``mlx_lazy.cache_prompt``.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager
from typing import Dict, Iterator, Optional

from .errors import UserInputError
from .inputs import MiB, read_file, read_stream
from .models import MODEL_HELP

DEFAULT_PROMPT = "hello"  # same default as mlx-lm
#: The most bytes read from --prompt-file or stdin: far more text than any model's context
#: holds (a token is a few bytes), yet a bounded read of /dev/zero.
PROMPT_MAX_BYTES = 16 * MiB


def add_prompt_arguments(p: argparse.ArgumentParser) -> None:
    """The model and prompt options (mlx-lm's names), shared by the tools that take a prompt."""
    p.add_argument("--model", default=None, help=MODEL_HELP)
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", default=None,
                     help=f"message to process ('-' reads stdin; default {DEFAULT_PROMPT!r})")
    src.add_argument("--prompt-file", default=None, help="read the message from this UTF-8 file")
    p.add_argument("--system-prompt", default=None, help="system prompt for the chat template")
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="use the raw prompt without the tokenizer's chat template")


def read_prompt(args: argparse.Namespace) -> str:
    """The user message from ``--prompt`` (``-``: stdin) or ``--prompt-file``.

    Raises:
        UserInputError: unreadable, non-UTF-8 or larger than :data:`PROMPT_MAX_BYTES` input,
            or an empty prompt.
    """
    if args.prompt_file is not None:
        source = f"prompt file {args.prompt_file!r}"
        text = _decode(read_file(args.prompt_file, source, PROMPT_MAX_BYTES), source)
    elif args.prompt == "-":
        if sys.stdin is None:  # started with its standard input closed
            raise UserInputError("--prompt -: there is no standard input to read")
        text = _decode(read_stream(sys.stdin.buffer, "stdin", PROMPT_MAX_BYTES), "stdin")
    else:
        prompt = DEFAULT_PROMPT if args.prompt is None else argv_text(args.prompt, "--prompt")
        # mlx-lm lets shell users type \n and \t escapes in -p.
        text = prompt.replace("\\n", "\n").replace("\\t", "\t")
    if not text.strip():
        raise UserInputError("the prompt is empty")
    return text


def argv_text(text: str, source: str) -> str:
    """A command-line argument (named ``source`` in errors) checked to be UTF-8 (Python keeps
    other bytes as lone surrogates, which the tokenizer cannot encode)."""
    return _decode(os.fsencode(text), source)


def _decode(data: bytes, source: str) -> str:
    """UTF-8 text of ``data``; a UserInputError naming ``source`` and the bad byte otherwise."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserInputError(
            f"{source} is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})"
        ) from None


#: The metadata key of a ``cache_prompt`` file saying whether its prompt went through the
#: chat template ("yes" / "no"): a question on top of it must do as it did.
TEMPLATE_KEY = "chat_template"


def uses_template(tokenizer, ignore_chat_template: bool) -> bool:
    """Whether :func:`encode_prompt` puts the text into the tokenizer's chat template."""
    return not ignore_chat_template and bool(getattr(tokenizer, "has_chat_template", False))


def check_cache_template(metadata: Dict[str, str], tokenizer, ignore_chat_template: bool,
                         path: str) -> None:
    """Refuse a question encoded otherwise than the cached prompt it continues (with the
    chat template on one side only, the turn is never closed, or opened twice); a file that
    does not say (saved by the API, or before files said) is not checked.

    Raises:
        UserInputError: naming the flag that makes them agree.
    """
    made = metadata.get(TEMPLATE_KEY)
    if made not in ("yes", "no"):
        return
    if (made == "yes") != uses_template(tokenizer, ignore_chat_template):
        fix = "drop --ignore-chat-template" if made == "yes" else "add --ignore-chat-template"
        raise UserInputError(f"prompt cache {path} holds a prompt made "
                             f"{'with' if made == 'yes' else 'without'} the chat template; "
                             f"{fix} so that the question continues it")


def encode_prompt(tokenizer, text: str, system_prompt: Optional[str],
                  ignore_chat_template: bool, part: str = "whole") -> list[int]:
    """Token ids of the prompt, with the chat template applied the way mlx-lm's CLI does.

    ``part`` splits the templated conversation around the user's text, as mlx-lm's
    ``cache_prompt`` does: ``"prefix"`` is everything up to and including the text (what a
    prompt cache holds), ``"suffix"`` the text and what follows it (what a later prompt adds
    on top of that cache); ``"whole"`` is both.

    Raises:
        UserInputError: a ``system_prompt`` with no chat template to put it in.
    """
    use_template = uses_template(tokenizer, ignore_chat_template)
    if system_prompt is not None and not use_template:  # mlx-lm drops it without a word
        raise UserInputError("--system-prompt goes into the chat template, which "
                             + ("--ignore-chat-template leaves out" if ignore_chat_template
                                else "this model's tokenizer does not have"))
    if use_template:
        messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
        marker = "\x00mlx-lazy-text\x00"
        messages.append({"role": "user", "content": marker})
        templated = tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
        before, after = templated.split(marker)
        text = {"whole": before + text + after, "prefix": before + text,
                "suffix": text + after}[part]
    with _quiet_transformers():
        return list(tokenizer.encode(text,
                                     add_special_tokens=not use_template and part != "suffix"))


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' warnings (its too-long-sequence one would duplicate the CLI's own
    one-line context check)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
