"""A calibration's results document (``results.json`` of ``python -m mlx_lazy.calibrate``):
the cells used, one row per candidate and the markdown report.

Pure functions of the document, shared by :mod:`mlx_lazy.bench.calibrate` (which writes it)
and :mod:`mlx_lazy.bench.plots` (which draws it). A calibration that stopped early (time
limit, Ctrl-C) leaves samples of an unfinished rung: every row compares a candidate with
``full`` on the samples both have, and says when that is fewer than its rung asked for.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

from ..config import QUALITIES
from . import stats
from .common import fmt, jsonable, markdown_table


def used_cells(doc: dict[str, Any]) -> list[str]:
    """The cells of a calibration (results) document where ``full`` scored enough."""
    return [c for c, v in doc["cells"].items() if v["used"]]


def rung_samples(doc: dict[str, Any], rung: int) -> int:
    """Samples per cell that rung ``rung`` of the document's calibration asks for."""
    rungs = doc["options"]["rungs"]
    return rungs[min(rung, len(rungs) - 1)]  # a resumed run may have had more rungs


def measured_floor(candidate: dict[str, Any], doc: dict[str, Any]) -> Optional[int]:
    """The keep floor ``candidate`` of results ``doc`` was measured under: its own, else (a
    file from before candidates recorded one) the file's; None: the library's floor."""
    return candidate.get("min_keep", doc.get("min_keep"))


def candidate_rows(doc: dict[str, Any], cells: Sequence[str]) -> list[dict[str, Any]]:
    """Per candidate, pooled paired statistics on the samples of ``cells`` that both it and
    ``full`` have (the same count in every cell); ``partial`` when that is fewer than the
    rung it reached asks for."""
    rows = []
    for c in doc["candidates"]:
        n = min((min(len(c["scores"].get(cell, [])), len(doc["full"].get(cell, [])))
                 for cell in cells), default=0)
        if n == 0:
            continue
        base = [s for cell in cells for s in doc["full"][cell][:n]]
        mine = [s for cell in cells for s in c["scores"][cell][:n]]
        measured = c.get("measured_gain")
        # an earlier run's, measured under another keep floor: not comparable with the rest
        other_floor = measured_floor(c, doc) != doc.get("min_keep")
        name = c["name"] + (" (measured under another keep floor)" if other_floor else "")
        rows.append(dict(name=name, config=c["config"], gain=c["predicted_gain"],
                         measured_gain=measured and measured["gain"],
                         first_token_gain=measured and measured.get("first_token_gain"),
                         kld=c.get("kld"),
                         token_layers_pct=c["token_layers_pct"], n=n,
                         partial=n < rung_samples(doc, c["rung"]),
                         dropped_at=c["dropped_at"], paired=stats.paired(base, mine)))
    return rows


def kld_text(summary: Optional[dict[str, Any]]) -> str:
    """A :func:`~mlx_lazy.bench.fidelity.row_summary`'s mean KLD with its interval."""
    if not summary:
        return "–"
    lo, hi = summary["kld_mean_ci"]
    return f"{summary['kld_mean']:.4f} ({lo:.4f}-{hi:.4f})"


def report(doc: dict[str, Any], cells: Sequence[str]) -> str:
    """The markdown report: cells, every candidate's pooled paired result and KLD, the
    yardsticks, the choice of each quality."""
    pilot = doc["options"]["pilot"]
    cell_rows = [[cell, f"{v['pilot_base']:.2f}", "yes" if v["used"] else "no"]
                 for cell, v in doc["cells"].items()]
    cell_rows += [[cell, f"{len(s)} of {pilot} samples (partial)", "–"]
                  for cell, s in doc["full"].items() if cell not in doc["cells"]]
    candidates = []
    for r in sorted(candidate_rows(doc, cells), key=lambda r: -r["gain"]):
        p = r["paired"]
        candidates.append([
            f"`{r['name']}`", f"{r['gain']:.2f}x", fmt(r["measured_gain"], suffix="x"),
            fmt(r["first_token_gain"], suffix="x"), f"{r['token_layers_pct']:.0f}",
            f"{r['n']} (partial)" if r["partial"] else r["n"],
            f"{p.base:.3f}", f"{p.score:.3f} ({p.score_ci[0]:.2f}-{p.score_ci[1]:.2f})",
            f"{p.lost} / {p.won}", f"{p.lost_ci[1]:.3f}",
            f"{p.rel_loss:+.3f} ({p.rel_loss_ci[0]:+.3f} to {p.rel_loss_ci[1]:+.3f})",
            kld_text(r["kld"]), "-" if r["dropped_at"] is None else r["dropped_at"]])
    lines = ["# Calibration", ""]
    if doc.get("stopped"):
        lines += [f"Stopped early ({doc['stopped']}): the tables hold what was measured; "
                  "\"partial\" marks a rung or pilot left unfinished. `--resume` continues.", ""]
    work = doc.get("work")
    if work:
        tokens = sum(work[k] for k in ("retrieval_prompt_tokens", "kld_prompt_tokens",
                                       "gain_prompt_tokens"))
        lines += [f"This run took {work['seconds'] / 60:.0f} min: {work['retrieval_prefills']} "
                  f"retrieval prompts ({work['retrieval_prompt_tokens']:,} tokens), "
                  f"{work['kld_prefills']} KLD windows ({work['kld_prompt_tokens']:,} tokens, "
                  f"{work['kld_forced_steps']:,} forced steps), {work['gain_prompt_tokens']:,} "
                  f"tokens timed; {tokens:,} prompt tokens in all. On another machine it takes "
                  "about that many tokens at its prompt speed (`mlx_lm.generate --verbose` "
                  "reports prompt tokens per second), plus the short answers.", ""]
    earlier = [r["work"] for r in doc.get("resumed", []) if r.get("work")]
    if earlier:
        lines += [f"It resumed {len(earlier)} earlier run(s) in this folder, which took "
                  f"{sum(w['seconds'] for w in earlier) / 60:.0f} min more; their options are "
                  "in `results.json` (`resumed`).", ""]
    lines += [f"Model fingerprint: `{json.dumps(doc['fingerprint'])}`", "",
              markdown_table(["cell", "full, pilot", "used"], cell_rows), "",
              markdown_table(["candidate", "predicted gain", "measured gain (whole answer)",
                              "measured gain (first token)", "token-layers %",
                              "samples/cell", "full", "method (95% CI)", "lost / won",
                              "lost of full's right, 95% upper bound",
                              "relative loss (95% CI)", "mean KLD (95% CI)",
                              "dropped at rung"], candidates)]
    yardsticks = doc.get("yardsticks") or {}
    if yardsticks:
        lines += ["", "Yardsticks on the same windows (mean KLD from `full`, 95% CI): "
                  + "; ".join(f"weights through {row[1:]} bits {kld_text(s)}"
                              for row, s in yardsticks.items())
                  + ". Largest mean KLD admitted: "
                  + ", ".join(f"{q} quality {b:.4f}" for q, b in (doc.get("bars") or {}).items())]
    chosen = doc.get("chosen") or {}
    for quality in doc["options"].get("qualities", QUALITIES):
        picked = chosen.get(quality)
        lines += ["", f"Chosen, {quality} quality: "
                  + (f"`{picked['name']}`" if picked else "none confirmed")
                  + (f"; {picked['not_installed']}" if picked and "not_installed" in picked
                     else "")]
        if picked:
            lines += ["", "```json\n" + json.dumps(jsonable(picked), indent=1) + "\n```"]
    return "\n".join(lines) + "\n"
