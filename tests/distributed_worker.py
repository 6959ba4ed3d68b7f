"""One rank of the tensor-parallel tests, started by ``mlx.launch`` (see test_distributed.py).

``engine OUT MODEL [MODEL ...] --configs JSON --prompt-len N --steps S``: load each MODEL
sharded over every rank; for each run of ``{name: PruningConfig fields}`` (the method is the name
unless the fields give one) prefill a seeded random prompt and decode S greedy steps; write
``OUT/{name}-rank{r}.json`` (tokens, a digest of every selected token set, stats) and
``OUT/{name}-rank{r}.npy`` (the logits), in ``OUT/{i}/`` for the i-th of several models (one
launch for many families: each launch costs every rank's start). Also, with one model and
unless ``--no-checks``,
``OUT/checks-rank{r}.json``: the cross-rank reductions on rank-dependent inputs, the tokens
``stream_generate`` returns when each rank's sampler draws a different token, and what is
refused (ranks given different prompts, a prompt-cache file of a sharded model).

``cli OUT [--rank1-args=ARGS1] [--kill-rank1-at STEP] -- ARGS``: run ``mlx_lazy.cli.main(ARGS)``
on every rank (rank 1 with the shell words ARGS1 appended, which override ARGS, or killing
itself at a decode step) and write its exit status to ``OUT/rank{r}.rc``.
"""

from __future__ import annotations

import mlx_lazy  # noqa: F401  (OpenBLAS before mlx)

import argparse
import hashlib
import json
import os
import shlex
import signal
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_lazy import LazyEngine, PruningConfig, distributed, load, resolve_config
from mlx_lazy.adapter import ModelAdapter


def run_engine(args: argparse.Namespace, out: Path) -> None:
    group = distributed.world()
    rank = group.rank()
    for i, path in enumerate(args.model):
        folder = out / str(i) if len(args.model) > 1 else out
        folder.mkdir(exist_ok=True)
        model, tokenizer = load(path, group=group)
        prompt = np.random.default_rng(0).integers(0, ModelAdapter(model).vocab_size,
                                                   args.prompt_len)
        for name, fields in json.loads(args.configs).items():
            config = PruningConfig(**{"method": name, **fields})
            engine = LazyEngine(model, resolve_config(model, config))
            tokens, logits, selections = greedy_run(engine, prompt, args.steps)
            np.save(folder / f"{name}-rank{rank}.npy", logits)
            (folder / f"{name}-rank{rank}.json").write_text(json.dumps(
                {"tokens": tokens, "selections": selections, "stats": engine.stats.as_dict()}))
    if args.checks and len(args.model) == 1:
        write_checks(model, tokenizer, group, prompt, out)


def write_checks(model, tokenizer, group: mx.distributed.Group, prompt: np.ndarray,
                 out: Path) -> None:
    """``OUT/checks-rank{r}.json`` (see the module's docstring)."""
    rank = group.rank()
    tp = distributed.TensorParallel(model, group)
    local = mx.array([[1.0, 4.0]] if rank == 0 else [[3.0, 2.0]])
    drawn = [r.token for r in mlx_lazy.stream_generate(
        model, tokenizer, prompt[:20].tolist(), max_tokens=4,
        sampler=lambda logprobs: mx.array([5 + rank], mx.uint32))]
    refused = {}
    try:  # ranks given different prompts
        list(mlx_lazy.stream_generate(model, tokenizer, prompt[:20 + rank].tolist(), max_tokens=2))
    except mlx_lazy.UserInputError as e:
        refused["prompts"] = str(e)
    try:
        mlx_lazy.save_prompt_cache(out / f"cache-rank{rank}.safetensors",
                                   mlx_lazy.make_prompt_cache(model))
    except mlx_lazy.UserInputError as e:
        refused["cache file"] = str(e)
    (out / f"checks-rank{rank}.json").write_text(json.dumps({
        "refused": refused,
        "mean": np.array(tp.reduce_heads(local, "mean")).tolist(),
        "max": np.array(tp.reduce_heads(local, "max")).tolist(),
        "from_rank0": distributed.from_rank0(mx.array([rank + 5]), group).item(),
        "sampled": drawn}))


def greedy_run(engine: LazyEngine, prompt: np.ndarray, steps: int):
    """Greedy tokens, logits (steps + 1, vocab) and a digest of every selected token set."""
    selections = []
    select, on_device = engine.selector.on_host, engine.selector.on_device

    def digest(positions: np.ndarray) -> None:
        selections.append(hashlib.sha256(positions.astype(np.int64).tobytes()).hexdigest())

    def record(*a, **k):
        chosen, pruned = select(*a, **k)
        digest(chosen)
        return chosen, pruned

    def record_on_device(*a, **k):
        chosen = on_device(*a, **k)
        digest(np.flatnonzero(np.array(chosen)))
        return chosen

    engine.selector.on_host, engine.selector.on_device = record, record_on_device
    logits = [engine.prefill(mx.array(prompt.astype(np.int32)))]
    tokens = [int(mx.argmax(logits[-1]))]
    for _ in range(steps):
        logits.append(engine.decode(tokens[-1]))
        tokens.append(int(mx.argmax(logits[-1])))
    return tokens, np.array(mx.stack(logits)), selections


def run_cli(args: argparse.Namespace, out: Path) -> None:
    from mlx_lazy import cli
    from mlx_lazy.engine import LazyEngine as Engine

    rank = int(os.environ.get("MLX_RANK", "0"))
    argv = list(args.rest)
    if rank == 1:
        argv += shlex.split(args.rank1_args)
    if rank == 1 and args.kill_rank1_at is not None:
        decode, steps = Engine.decode, []

        def dying(self, token):
            steps.append(token)
            if len(steps) == args.kill_rank1_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return decode(self, token)

        Engine.decode = dying
    rc = cli.main(argv)
    (out / f"rank{rank}.rc").write_text(str(rc))
    sys.exit(rc)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["engine", "cli"])
    p.add_argument("out")
    p.add_argument("model", nargs="*")
    p.add_argument("--configs", default='{"full": {}}',
                   help="JSON {method: PruningConfig fields}, run one after the other")
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--no-checks", dest="checks", action="store_false",
                   help="engine: skip OUT/checks-rank{r}.json")
    p.add_argument("--rank1-args", default="")
    p.add_argument("--kill-rank1-at", type=int)
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:split])
    args.rest = argv[split + 1:]
    out = Path(args.out)
    run_engine(args, out) if args.mode == "engine" else run_cli(args, out)


if __name__ == "__main__":
    main()
