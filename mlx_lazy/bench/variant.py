"""Check a calibrated schedule on another copy of its model: ``python -m mlx_lazy.bench.variant``.

A schedule calibrated on a model's float weights applies to its quantized and cast copies,
matched by the weights' identity (:func:`mlx_lazy.schedule_files.model_mismatch`). Whether its
bars still hold there is measured here, not assumed: the schedule file's own evidence is
replayed on the copy against the copy's own ``full``:

* **retrieval**: the same samples (the file's tasks, lengths, seed and samples per cell),
  paired, within the file's loss allowance (``max_loss``, 1% by default);
* **drift**: the mean KL divergence along ``full``'s 128-step continuation on the same windows
  (the file's ``kld_windows``, ``kld_length`` and ``kld_steps``), within the bar the schedule
  was admitted under: the float model's 4-bit yardstick on those windows.

::

    python -m mlx_lazy.bench.variant --model FOLDER --schedule FILE [--record] [--out F.json]
    python -m mlx_lazy.bench.variant --model qwen2.5-coder-0.5b --round 4 --schedule FILE

``--round BITS`` checks the loaded (unquantized) model with its weights rounded through
``BITS``-bit affine quantization in groups of ``--group-size`` and back
(:func:`.yardstick.round_weights`): bit for bit the dequantized weights of the
``mlx_lm.convert -q`` copy, at float speed (quantized products are ~20x slower than float32
ones on a CPU; on a Mac, give the quantized folder itself). ``--record`` adds (or replaces) the
copy's entry in the file's ``model.variants`` when both bars hold. Exit status 0: both bars
hold; 1: one does not; 2: bad input.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from .. import _blas  # noqa: F401  (OpenBLAS before mlx.core)
from .. import load
from .._args import OneLineParser, path_arg
from ..adapter import ModelAdapter
from ..config import PruningConfig
from ..errors import UserInputError
from ..folders import check_destination, write_text_atomic
from ..inputs import is_int, read_json
from ..schedule_files import (SCHEDULE_MAX_BYTES, SCHEDULE_MAX_DEPTH, check_model,
                              check_variants, read_schedule)
from ..selection import keep_floor
from . import stats, yardstick
from .calibrate import MIN_KEEP_MEASURED, Deviation, within_loss
from .common import Method, jsonable
from .harness import run_one
from .methods import method_spec
from .progress import Progress
from .tasks import TASKS, build_samples

#: What a replay reads from a schedule file's ``evidence``, and from ``evidence.made.options``.
EVIDENCE_FIELDS = ("samples_per_cell", "cells", "max_loss", "kld_bar", "kld_texts",
                   "yardsticks", "made")
OPTION_FIELDS = ("seed", "kld_windows", "kld_length", "kld_steps")


def replay_plan(path: Path) -> dict[str, Any]:
    """The schedule in the file at ``path`` (``config``) and what it was admitted on: its cells
    (``task@length``), samples per cell and seed, loss allowance, KLD windows, bar and
    yardsticks.

    Raises:
        UserInputError: a file that is not a schedule, or one without the calibration
            evidence a replay needs (a hand-written schedule), naming the missing field.
    """
    config = read_schedule(path)  # the file itself is well formed
    doc = read_json(path, f"schedule file {path}", SCHEDULE_MAX_BYTES, SCHEDULE_MAX_DEPTH)
    evidence = doc.get("evidence")
    missing = next((f"evidence.{f}" for f in EVIDENCE_FIELDS
                    if not isinstance(evidence, dict) or f not in evidence), None)
    options = evidence["made"].get("options") if missing is None \
        and isinstance(evidence["made"], dict) else None
    if missing is None:
        missing = next((f"evidence.made.options.{f}" for f in OPTION_FIELDS
                        if not isinstance(options, dict)
                        or not is_int(options.get(f))), None)
    if missing is not None:
        raise UserInputError(f"schedule file {path} has no {missing}: only a schedule written "
                             "by python -m mlx_lazy.calibrate carries the evidence to replay")
    numbers = {k: evidence[k] for k in ("max_loss", "kld_bar")}
    shapes = [("evidence.cells", isinstance(evidence["cells"], dict) and evidence["cells"]),
              ("evidence.samples_per_cell", isinstance(evidence["samples_per_cell"], int)
               and evidence["samples_per_cell"] >= 1),
              *((f"evidence.{k}", isinstance(v, (int, float)) and 0 <= v < math.inf)
                for k, v in numbers.items()),
              *((f"evidence.{k}", isinstance(evidence[k], dict) and all(
                  isinstance(v, dict) for v in evidence[k].values()))
                for k in ("kld_texts", "yardsticks"))]
    bad = next((name for name, ok in shapes if not ok), None)
    if bad is not None or not all(isinstance(y.get("kld_mean"), (int, float))
                                  for y in evidence["yardsticks"].values()):
        raise UserInputError(f"schedule file {path}: {bad or 'evidence.yardsticks'} is not "
                             "what python -m mlx_lazy.calibrate writes")
    cells = []
    for cell in evidence["cells"]:
        task, _, length = str(cell).partition("@")
        if task not in TASKS or not length.isdigit():
            raise UserInputError(f"schedule file {path}: evidence.cells has {cell!r}, not a "
                                 "task@length of the offline tasks")
        cells.append((task, int(length)))
    min_base = options.get("min_base", 0.8)
    return {"config": config, "cells": cells, "samples_per_cell": evidence["samples_per_cell"],
            "seed": options["seed"],
            "min_base": float(min_base) if isinstance(min_base, (int, float)) else 0.8,
            **{k: float(v) for k, v in numbers.items()},
            "yardsticks": evidence["yardsticks"], "kld_texts": evidence["kld_texts"],
            **{f: options[f] for f in OPTION_FIELDS[1:]}}


def same_windows(texts: dict[str, Any], saved: dict[str, Any]) -> bool:
    """Whether two records of KLD windows (``Deviation.texts``) cut the same windows from the
    same text: the files' contents and token counts and the windows' starts, kind by kind
    (not the files' paths, which move between machines)."""
    def key(t: dict[str, Any]) -> Any:
        return {kind: ([(f.get("sha256"), f.get("tokens")) for f in v.get("files", [])],
                       v.get("starts")) for kind, v in t.items()}
    return key(texts) == key(saved)


def check(model: Any, tokenizer: Any, plan: dict[str, Any],
          progress: Optional[Progress] = None) -> dict[str, Any]:
    """Replay ``plan`` (:func:`replay_plan`: its schedule, samples and windows) on ``model``
    against the model's own ``full``: per cell and pooled paired retrieval, the KLD row beside
    the bar, and whether each bar holds."""
    with keep_floor(MIN_KEEP_MEASURED):  # as calibrate measured the evidence
        return _check(model, tokenizer, plan, progress or Progress())


def _check(model: Any, tokenizer: Any, plan: dict[str, Any], progress: Progress
           ) -> dict[str, Any]:
    config = plan["config"]
    rows = (("full", Method("full", PruningConfig())),
            ("schedule", Method(method_spec(config), config)))
    n, per_cell, base, mine = plan["samples_per_cell"], {}, [], []
    for task, length in plan["cells"]:
        cell = f"{task}@{length}"
        samples = build_samples(tokenizer, task, length, n, plan["seed"])
        scores: dict[str, list[float]] = {"full": [], "schedule": []}
        for i, sample in enumerate(samples):
            for row, method in rows:
                scores[row].append(run_one(model, tokenizer, method, sample).score)
            progress.update(f"retrieval {cell}", i + 1, n)
        per_cell[cell] = stats.paired(scores["full"], scores["schedule"]).as_dict()
        base += scores["full"]
        mine += scores["schedule"]
    pooled = stats.paired(base, mine)
    deviation = Deviation(model, tokenizer, plan["kld_windows"], plan["kld_length"],
                          plan["kld_steps"])
    deviation.on_window = lambda row, done, total: progress.update(
        f"KLD windows, {row}", done, total)
    kld = deviation.measure(config, row="schedule")
    windows_same = same_windows(deviation.texts, plan["kld_texts"])
    # calibrate uses only cells where full scores >= min_base: where the copy's full cannot
    # do the task, a loss is measured on few right answers
    weak = [c for c, p in per_cell.items() if p["base"] < plan["min_base"]]
    return {"cells": per_cell, "pooled": pooled.as_dict(), "weak_cells": weak,
            "retrieval_ok": within_loss(pooled, plan["max_loss"]),
            "kld": kld, "kld_bar": plan["kld_bar"], "yardsticks": plan["yardsticks"],
            "same_windows": windows_same,
            "kld_ok": windows_same and kld["kld_mean"] <= plan["kld_bar"]}


def variant_entry(variant: str, how: str, result: dict[str, Any]) -> dict[str, Any]:
    """A ``model.variants`` entry for a copy on which both bars held, its figures in ``how``."""
    p, k = result["pooled"], result["kld"]
    cells = ", ".join(result["cells"])
    lo, hi = k["kld_mean_ci"]
    return {"variant": variant, "checked": ["identity", "retrieval", "kld"],
            "how": f"{how}, against its own full (python -m mlx_lazy.bench.variant, every cut "
                   f"keeping its fraction): {cells}, {p['n']} paired, full {p['base']:.2f}, "
                   f"schedule {p['score']:.2f}, lost "
                   f"{p['lost']} / won {p['won']}; mean KLD {k['kld_mean']:.4f} (95% CI "
                   f"{lo:.3f}-{hi:.3f}), same-top-1 {k['same_top1']:.3f}, over {k['windows']} "
                   f"windows x {k['steps'] // max(k['windows'], 1)} steps, against the bar "
                   f"{result['kld_bar']:.4f} on the same windows"
                   + (f"; full below the cell bar on {', '.join(result['weak_cells'])}"
                      if result["weak_cells"] else ""),
            "date": time.strftime("%Y-%m-%d")}


def record(path: Path, entry: dict[str, Any]) -> None:
    """Put ``entry`` into the schedule file's ``model.variants`` in the place of the entry for
    the same variant, else last; the file is replaced whole (atomically), indented as it was
    (a diff shows the entry alone), and re-read."""
    text = path.read_text()
    doc = json.loads(text)
    second = text.splitlines()[1:2] or ["  "]
    indent = len(second[0]) - len(second[0].lstrip(" ")) or 2
    variants = doc["model"].get("variants", [])
    at = next((i for i, v in enumerate(variants) if v.get("variant") == entry["variant"]),
              len(variants))
    kept = [v for v in variants if v.get("variant") != entry["variant"]]
    doc["model"]["variants"] = check_variants([*kept[:at], entry, *kept[at:]])
    write_text_atomic(path, json.dumps(doc, indent=indent) + "\n")
    read_schedule(path)


def render(variant: str, result: dict[str, Any]) -> str:
    """The result in a few lines."""
    lines = [f"variant {variant}"]
    for cell, p in [*result["cells"].items(), ("pooled", result["pooled"])]:
        lines.append(f"  retrieval {cell}: n {p['n']}, full {p['base']:.2f}, schedule "
                     f"{p['score']:.2f}, lost {p['lost']} / won {p['won']}, relative loss "
                     f"{p['rel_loss']:+.3f}")
    k = result["kld"]
    yard = ", ".join(f"{row} {y['kld_mean']:.4f}" for row, y in result["yardsticks"].items())
    lines.append(f"  KLD over {k['windows']} windows: mean {k['kld_mean']:.4f} (95% CI "
                 f"{k['kld_mean_ci'][0]:.3f}-{k['kld_mean_ci'][1]:.3f}), same-top-1 "
                 f"{k['same_top1']:.3f}; bar {result['kld_bar']:.4f} (the float model's "
                 f"yardsticks: {yard})")
    if result["weak_cells"]:
        lines.append(f"  the copy's full scores below the calibration's cell bar on "
                     f"{', '.join(result['weak_cells'])}: a loss there rests on few right "
                     "answers")
    if not result["same_windows"]:
        lines.append("  the KLD windows differ from the file's (other texts on this machine): "
                     "the bar was not measured on them")
    verdict = {True: "holds", False: "fails"}
    lines.append(f"  retrieval bar {verdict[result['retrieval_ok']]}; KLD bar "
                 f"{verdict[result['kld_ok']]}")
    return "\n".join(lines)


def build_parser() -> OneLineParser:
    """The command-line options."""
    p = OneLineParser(prog="python -m mlx_lazy.bench.variant",
                      description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the copy: a model folder or name")
    p.add_argument("--schedule", required=True, type=path_arg,
                   help="the schedule file calibrated on the model (its evidence is replayed)")
    p.add_argument("--round", type=int, default=None, metavar="BITS",
                   help="check the model with its weights rounded through BITS-bit affine "
                        "quantization and back (the quantized copy's weights at float speed)")
    p.add_argument("--group-size", type=int, default=yardstick.GROUP_SIZE,
                   help=f"weights per quantization group with --round (default "
                        f"{yardstick.GROUP_SIZE})")
    p.add_argument("--record", action="store_true",
                   help="when both bars hold, record the copy in the file's model.variants")
    p.add_argument("--out", type=path_arg, default=None, help="also write the result as JSON here")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        if args.round is not None and (args.round not in (2, 3, 4, 5, 6, 8)
                                       or args.group_size not in (32, 64, 128)):
            raise UserInputError("--round takes 2, 3, 4, 5, 6 or 8 bits and --group-size 32, "
                                 "64 or 128 (mlx's affine quantization)")
        if not args.schedule.is_file():
            raise UserInputError(f"--schedule {args.schedule} is not a file")
        plan = replay_plan(args.schedule)
        # before the hour of runs: where the results go must take them
        for flag, target in (("--record", args.schedule if args.record else None),
                             ("--out", args.out)):
            if target is not None:
                check_destination(str(target), flag)
        model, tokenizer = load(args.model)
        variant = ModelAdapter(model).variant()
        how = f"the model {args.model} as loaded"
        if args.round is not None:
            model = yardstick.round_weights(model, args.round, args.group_size)
            variant += f"+q{args.round}g{args.group_size}"
            how = (f"bench.yardstick.round_weights({args.model}, {args.round}) with groups of "
                   f"{args.group_size} (bit for bit the quantized copy's dequantized weights)")
        check_model(plan["config"], ModelAdapter(model).fingerprint())
        result = check(model, tokenizer, plan)
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result.update(variant=variant, how=how, schedule=str(args.schedule))
    print(render(variant, result))
    if args.out is not None:
        write_text_atomic(args.out, json.dumps(jsonable(result), indent=1) + "\n")
    passed = result["retrieval_ok"] and result["kld_ok"]
    if args.record and passed:
        record(args.schedule, variant_entry(variant, how, result))
        print(f"recorded {variant} in {args.schedule}")
    elif args.record:
        print(f"not recorded: a bar fails on {variant}", file=sys.stderr)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
