"""``python -m mlx_lazy.bench.conversation``: multi-turn conversations with and without
prompt caches.

Each conversation is a document with one needle per turn; turn ``i`` asks about needle ``i``,
which no earlier turn asked about (so the earlier turns' selections pruned it at the deep
layers). The client resends the whole conversation every turn, as chat clients do; a path
with a cache keeps the state of its previous turn, trims it to the prefix the new prompt
shares with it and processes the rest (what mlx-lm's server does with its prompt cache).

Paths, side by side in one process and interleaved per conversation:

* ``mlx-lm+cache`` / ``mlx-lm``: mlx-lm's ``generate_step`` with and without its prompt cache;
* ``<method>+cache`` / ``<method>``: ours, with and without a cache (``full``, ``lazy``, any
  method of the benchmark syntax, e.g. ``lazy:layers=9:keep=0.2:scorer=window:size=32``);
* ``<method>+cache+complete``: the cached state completed between turns (the pruned tokens
  carried through their remaining layers while the user reads the answer, as the idle server
  does; not in the TTFT), for methods that do not complete after the first answer token
  already (``complete=none``, ``progressive:K``).

Reported per path and turn: median time to first token, answers right, token-layers
computed and revivals; per path the KV + Aux bytes of the cached state at the end beside
mlx-lm's cache; follow-up TTFT ratios against mlx-lm with its cache and against our own
uncached path; paired lost/won against ``full+cache`` with a Wilson bound.

Example::

    python -m mlx_lazy.bench.conversation --model smollm2-135m --length 2048 \\
        --conversations 3 --methods full,lazy --out /tmp/conv
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from .. import _blas  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx

from .common import (fmt, jsonable, loadavg, machine_info, markdown_table, median,
                     mlx_lm_kv_bytes_per_layer)
from .methods import parse_method, parse_methods
from .metrics import score
from .stats import paired, wilson
from .._args import OneLineParser
from ..adapter import num_layers
from ..errors import UserInputError
from ..folders import make_folder, write_text_atomic
from ..prompt_cache import common_prefix
from ..resolve import resolve_config
from .tasks import Conversation, build_conversations

MLX_LM = "mlx-lm"


@dataclass
class Turn:
    """One measured turn of one path."""

    ttft_s: float
    text: str
    right: float
    prompt_tokens: int
    cached_tokens: int
    revivals: int = 0
    token_layers: int = 0
    complete_s: float = 0.0


@dataclass
class Route:
    """A way of answering: mlx-lm or one of our methods, with or without a cache."""

    name: str
    config: Any  # a PruningConfig; None for mlx-lm
    cached: bool
    complete: bool = False
    turns: Dict[int, List[Turn]] = field(default_factory=dict)
    state_bytes: List[int] = field(default_factory=list)
    token_layers: List[int] = field(default_factory=list)  # per conversation
    tokens_held: List[int] = field(default_factory=list)  # per conversation, at the end


def render(tokenizer: Any, conv: Conversation, answers: Sequence[str], turn: int) -> str:
    """The whole conversation up to turn ``turn``'s answer prefix, as a chat client sends it."""
    messages = []
    for i in range(turn + 1):
        question = conv.questions[i]
        user = f"{conv.document}\n\n{question}" if i == 0 else question
        messages.append({"role": "user", "content": user})
        if i < turn:
            messages.append({"role": "assistant",
                             "content": f"{conv.answer_prefixes[i]}{answers[i]}"})
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "\n\n".join(m["content"] for m in messages) + "\n\nAnswer: "
    return text + conv.answer_prefixes[turn]


class Runner:
    """Runs every path of one conversation, keeping each cached path's state between turns."""

    def __init__(self, model: Any, tokenizer: Any, max_tokens: int):
        self.model, self.tokenizer, self.max_tokens = model, tokenizer, max_tokens

    def answer(self, path: Route, state: Any, prompt: List[int]) -> tuple[Turn, Any]:
        """One turn of ``path`` on ``prompt`` (the whole conversation); returns the turn and
        the state to keep."""
        from mlx_lm.generate import generate_step as mlx_lm_generate_step
        from mlx_lm.models import cache as mlx_lm_cache

        from .. import generate_step, make_prompt_cache

        gc.collect()
        mx.clear_cache()
        eos = set(self.tokenizer.eos_token_ids)
        tic = time.perf_counter()
        if path.config is None:
            if state is None or not path.cached:
                state, held = mlx_lm_cache.make_prompt_cache(self.model), []
            else:
                state, held = state
            keep = min(common_prefix(held, prompt), len(prompt) - 1)
            if keep < len(held) and not mlx_lm_cache.can_trim_prompt_cache(state):
                # a recurrent layer's state (a hybrid's) cannot drop tokens: start again
                state, keep = mlx_lm_cache.make_prompt_cache(self.model), 0
            else:
                mlx_lm_cache.trim_prompt_cache(state, len(held) - keep)
            cached = keep
            steps = mlx_lm_generate_step(mx.array(prompt[keep:]), self.model, prompt_cache=state,
                                         max_tokens=self.max_tokens)
        else:
            if state is None or not path.cached:
                state = make_prompt_cache(self.model, path.config)
            rest = state.extend_prefix(prompt)
            cached = len(prompt) - len(rest)
            steps = generate_step(rest, self.model, prompt_cache=state,
                                  max_tokens=self.max_tokens)
        yielded: List[int] = []
        ttft = 0.0
        for token, _ in steps:
            if not yielded:
                ttft = time.perf_counter() - tic
            yielded.append(int(token))
            if token in eos:
                break
        steps.close()
        answer = [t for t in yielded if t not in eos]
        turn = Turn(ttft, self.tokenizer.decode(answer), 0.0, len(prompt), cached)
        if path.config is None:  # mlx-lm's cache holds the tokens it ran, in order
            ran = next(c.offset for c in state if hasattr(c, "offset"))  # a KV layer's count
            state = (state, (prompt + yielded)[:ran])
        else:
            turn.revivals = state.engine.stats.revivals
            if path.complete:
                tic = time.perf_counter()
                state.engine.complete()
                turn.complete_s = time.perf_counter() - tic
            turn.token_layers = sum(state.engine.stats.tokens_computed_per_layer)
        return turn, state


def state_bytes(path: Route, state: Any) -> int:
    """KV (+ Aux) bytes of a path's state."""
    if path.config is None:
        return sum(mlx_lm_kv_bytes_per_layer(state[0]))
    return state.nbytes


def run(model: Any, tokenizer: Any, paths: List[Route], conversations: List[Conversation],
        max_tokens: int, time_limit: Optional[float] = None,
        after_each: Optional[Callable[[int], None]] = None) -> int:
    """Run the conversations; return how many finished. ``after_each(done)`` is called after
    every finished conversation (every path has then run it)."""
    runner = Runner(model, tokenizer, max_tokens)
    start = time.perf_counter()
    done = 0
    for conv in conversations:
        if time_limit is not None and time.perf_counter() - start > time_limit:
            break
        for path in paths:
            state, answers = None, []
            for t in range(len(conv.questions)):
                prompt = list(tokenizer.encode(render(tokenizer, conv, answers, t),
                                               add_special_tokens=False))
                turn, state = runner.answer(path, state, prompt)
                turn.right = score(turn.text, (conv.references[t],), "all")
                answers.append(turn.text)
                path.turns.setdefault(t, []).append(turn)
            path.state_bytes.append(state_bytes(path, state))
            path.tokens_held.append(len(state[1]) if path.config is None else len(state))
            if path.config is not None:  # a cached state counts over its whole life
                mine = [ts[-1] for ts in (path.turns[t] for t in range(len(conv.questions)))]
                path.token_layers.append(mine[-1].token_layers if path.cached
                                         else sum(x.token_layers for x in mine))
        done += 1
        if after_each is not None:
            after_each(done)
        print(f"conversation {done}/{len(conversations)} done "
              f"({time.perf_counter() - start:.0f} s, load {fmt(loadavg(), '.1f')})",
              file=sys.stderr)
    return done


def report(paths: List[Route], turns: int) -> str:
    """The markdown tables."""
    by = {p.name: p for p in paths}
    rows = []
    for p in paths:
        for t in range(turns):
            ts = p.turns.get(t, [])
            right = sum(x.right for x in ts)
            lo, hi = wilson(right, len(ts))
            rows.append([p.name, t + 1, f"{median(x.ttft_s for x in ts):.3f}",
                         f"{right:g}/{len(ts)} ({lo:.2f}-{hi:.2f})",
                         f"{median(x.cached_tokens for x in ts):.0f}",
                         f"{median(x.revivals for x in ts):.0f}",
                         f"{median(x.complete_s for x in ts):.2f}"])
    out = [markdown_table(["path", "turn", "TTFT s (median)", "right (95% CI)",
                           "cached tokens", "revivals", "completion s"], rows)]

    ref = by.get(f"{MLX_LM}+cache")
    ratios = []
    for p in paths:
        if not p.cached or p.config is None:
            continue
        uncached = by.get(p.name.split("+cache")[0])
        for t in range(1, turns):
            mine = median(x.ttft_s for x in p.turns.get(t, []))
            vs_ref = mine / median(x.ttft_s for x in ref.turns[t]) if ref else None
            vs_own = (median(x.ttft_s for x in uncached.turns[t]) / mine) if uncached else None
            ratios.append([p.name, t + 1, "-" if vs_ref is None else f"{vs_ref:.2f}x",
                           "-" if vs_own is None else f"{vs_own:.1f}x"])
    if ratios:
        out.append(markdown_table(["path", "turn", "TTFT / mlx-lm+cache",
                                   "uncached own path / TTFT (speed-up)"], ratios))

    base = by.get("full+cache")
    if base is not None:
        rows = []
        for p in paths:
            if p is base or p.config is None:
                continue
            for t in range(1, turns):
                b = [x.right for x in base.turns.get(t, [])]
                m = [x.right for x in p.turns.get(t, [])][: len(b)]
                if not b or len(m) != len(b):
                    continue
                r = paired(b, m)
                rows.append([p.name, t + 1, f"{r.base:.2f}", f"{r.score:.2f}",
                             f"{r.lost}/{r.won}", f"{r.lost_ci[1]:.1%}"])
        if rows:
            out.append(markdown_table(["path", "turn", "full+cache right", "path right",
                                       "lost/won", "lost ≤ (95%)"], rows))

    mem = [[p.name, f"{median(p.state_bytes) / 1e6:.1f}",
            "-" if not p.token_layers else f"{median(p.token_layers):.0f}"]
           for p in paths if p.state_bytes]
    out.append(markdown_table(["path", "state at the end (MB, median)",
                               "token-layers over the conversation (median)"], mem))
    return "\n\n".join(out) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m mlx_lazy.bench.conversation",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="named model, folder or hub id (default smollm2-135m)")
    p.add_argument("--length", type=int, default=2048, help="first prompt's tokens (default 2048)")
    p.add_argument("--turns", type=int, default=4, help="questions per conversation (default 4)")
    p.add_argument("--conversations", type=int, default=3, help="(default 3)")
    p.add_argument("--methods", default="full,lazy",
                   help="our methods, benchmark syntax; ';' between them when one holds commas "
                        "(default full,lazy)")
    p.add_argument("--paths", default="cache,uncached,complete,mlx-lm",
                   help="which paths: cache (every method with a cache), uncached, complete "
                        "(pruning methods not completing after-first, completed between "
                        "turns), mlx-lm (with and without its cache) (default: all)")
    p.add_argument("--max-tokens", type=int, default=12, help="answer budget (default 12)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds; stop between conversations")
    p.add_argument("--out", default="conversation_out")
    return p


#: Tokens a turn adds besides its answer, at most: the question and the chat template's.
TURN_TOKENS = 64


def _check_options(args: argparse.Namespace) -> set[str]:
    """The path kinds ``--paths`` names, after checking the options that need no model.

    Raises:
        UserInputError: naming the flag."""
    kinds = {k.strip() for k in args.paths.split(",") if k.strip()}
    if not kinds or kinds - {"cache", "uncached", "complete", "mlx-lm"}:
        raise UserInputError(f"--paths takes cache, uncached, complete, mlx-lm; got "
                             f"{args.paths!r}")
    for flag, value, least in (("--length", args.length, 64), ("--turns", args.turns, 1),
                               ("--conversations", args.conversations, 1),
                               ("--max-tokens", args.max_tokens, 1)):
        if value < least:
            raise UserInputError(f"{flag} must be at least {least}, got {value}")
    if args.time_limit is not None and not args.time_limit > 0:
        raise UserInputError(f"--time-limit must be a positive number of seconds, got "
                             f"{args.time_limit}")
    if not args.out:  # Path("") is the current folder
        raise UserInputError("--out is empty; give a folder")
    return kinds


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        kinds = _check_options(args)
        make_folder(Path(args.out))
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from .. import load
    from ..api import context_length

    model, tokenizer = load(args.model)
    context = context_length(model, tokenizer)
    longest = args.length + args.turns * (args.max_tokens + TURN_TOKENS)
    if context is not None and longest > context:
        print(f"error: --length {args.length} and {args.turns} turns of up to "
              f"{args.max_tokens + TURN_TOKENS} tokens reach about {longest} tokens, past the "
              f"model's context of {context}", file=sys.stderr)
        return 2
    paths: List[Route] = []
    if "mlx-lm" in kinds:
        paths += [Route(f"{MLX_LM}+cache", None, True), Route(MLX_LM, None, False)]
    try:
        methods = [(spec, parse_method(spec, num_layers(model)).config)
                   for spec in parse_methods(args.methods)]
        if any(config is None for _, config in methods):
            raise ValueError("--methods takes our methods (mlx-lm is a --paths kind)")
        # none, progressive:K (as the plain method resolves for this model)
        waiting = [resolve_config(model, config).completion.waits for _, config in methods]
    except ValueError as e:  # UserInputError included
        print(f"error: {e}", file=sys.stderr)
        return 2
    for (spec, config), waits in zip(methods, waiting):
        if "cache" in kinds:
            paths.append(Route(f"{spec}+cache", config, True))
        if "complete" in kinds and config.method != "full" and waits:
            # Completed between turns, as the idle server does; after-first and exact have
            # completed during the answer already, so that route would be their +cache twin.
            paths.append(Route(f"{spec}+cache+complete", config, True, complete=True))
        if "uncached" in kinds:
            paths.append(Route(spec, config, False))
    try:
        convs = build_conversations(tokenizer, args.length, args.conversations, args.turns,
                                    args.seed)
    except ValueError as e:  # too short a length for the questions
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    info = machine_info(model, "mlx_lazy.bench.conversation")

    def save(done: int) -> None:
        # after every conversation, atomically: an interrupted run keeps what it finished
        write_text_atomic(out / "results.json", json.dumps(jsonable({
            "machine": info, "conversations": done, "load_after": loadavg(),
            "paths": [{"name": p.name, "state_bytes": p.state_bytes,
                       "token_layers": p.token_layers, "tokens_held": p.tokens_held,
                       "turns": {t: [vars(x) for x in ts] for t, ts in p.turns.items()}}
                      for p in paths]}), indent=1) + "\n")
        write_text_atomic(out / "table.md", f"{info['command']}\n\n{done} conversations, load "
                                            f"after {fmt(loadavg(), '.1f')}\n\n"
                                            f"{report(paths, args.turns)}")

    try:
        run(model, tokenizer, paths, convs, args.max_tokens, args.time_limit, after_each=save)
    except KeyboardInterrupt:
        print(f"interrupted: the finished conversations are in {out}", file=sys.stderr)
        return 130
    print((out / "table.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
