"""Schedule files: what ``python -m mlx_lazy.calibrate`` writes (:func:`write_schedule`) and
:func:`read_schedule` reads, and where a plain ``lazy`` finds the model's calibrated schedule
(:func:`calibrated`: the model folder, the cache by fingerprint, the package's own).

A schedule follows the model, not the file: it applies to every copy of the model it was
calibrated for whose shapes are the same and whose identity (``ModelAdapter.identity``:
sketches of dequantized embedding rows and of the norm weights) matches, so the 4-, 6- and
8-bit and float16/bfloat16 copies of a calibrated model take its schedule
(:func:`model_mismatch`). A file's ``model.variants`` records which copies it was checked on
(:func:`check_variants`)."""

from __future__ import annotations

import hashlib
import json
import math
import re
import warnings
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

from .adapter import (IDENTITY_TOLERANCE, decode_identity, fingerprint_difference,
                      identities_match, identity_distances)
from .config import PRUNING_FIELDS, QUALITIES, PruningConfig, build_schedule
from .errors import UserInputError, shown
from .folders import check_destination, write_text_atomic
from .inputs import MAX_COUNT, MiB, as_path, is_int, read_json
from .policies import cuts_at_global_layers
from .scorers import scorer_spec

#: The ``format`` of schedule files (written by ``python -m mlx_lazy.calibrate``).
SCHEDULE_FORMAT = "mlx-lazy-schedule/2"
#: Format 1 spelt the scorer's parameters as config fields (read, and converted, still).
SCHEDULE_FORMAT_1 = "mlx-lazy-schedule/1"
#: The decode step a schedule is calibrated with (its evidence holds for it): the PruningConfig
#: fields that a config naming its own value overrides when it takes the schedule.
DECODE_FIELDS = ("complete", "max_revivals", "revive_margin", "reselect_every")
#: PruningConfig fields a schedule file sets; the rest (revive, anchors, seed) stay the caller's.
SCHEDULE_FIELDS = ("method", "prune_layers", "keep", "scorer") + DECODE_FIELDS
#: Calibrated schedules shipped with the package, matched to models by fingerprint.
PACKAGED_SCHEDULES = Path(__file__).parent / "data" / "schedules"
#: A model folder holding this file makes ``--method lazy`` use it (see ``mlx_lazy.load``).
MODEL_SCHEDULE_FILE = "mlx_lazy_schedule.json"
#: Bounds of schedule files (calibrate writes a few KiB, nested 4 deep).
SCHEDULE_MAX_BYTES = 1 * MiB
SCHEDULE_MAX_DEPTH = 16
#: Fingerprint fields that tell copies of one model apart and that a schedule ignores: the
#: exact weights digest (what a prompt cache checks) and the variant (how they are stored).
#: A schedule matches on the rest (the shapes) and on the ``identity`` (weights up to
#: quantization and dtype).
COPY_FIELDS = ("weights", "identity", "variant")
#: What a ``model.variants`` entry may say was checked on that copy of the model:
#: ``calibrated`` (the file's evidence was measured on it), ``identity`` (its identity matches
#: the file's, so it takes this schedule), ``retrieval`` and ``kld`` (the bars were measured on
#: it against its own ``full``).
VARIANT_CHECKS = ("calibrated", "identity", "retrieval", "kld")
#: Fields of a ``model.variants`` entry.
VARIANT_FIELDS = ("variant", "checked", "how", "date")
#: A variant as ``ModelAdapter.variant`` spells it: ``bfloat16+q4g64``.
VARIANT_PATTERN = re.compile(
    r"^(float32|float16|bfloat16)(\+(q[1-8]|mxfp4|mxfp8|nvfp4)g(16|32|64|128))*$")
#: At most this many files of the cache's schedules folder are read looking for one whose
#: model matches (a schedule calibrated on another copy of the model).
CACHE_SCAN_LIMIT = 256


def read_schedule(path: Union[str, Path],
              fingerprint: Optional[Dict[str, Any]] = None) -> PruningConfig:
    """Load a calibrated schedule file (written by :func:`write_schedule`).

    Args:
        path: the JSON file.
        fingerprint: the model's (``ModelAdapter.fingerprint()``); when given, the file
            must have been calibrated for a model with the same fingerprint.

    Raises:
        UserInputError: missing, malformed or mismatched file, naming the field.
    """
    config, _ = _read(as_path(path, "schedule file"))
    if fingerprint is not None:
        check_model(config, fingerprint)
    return config


def read_schedule_flag(path: Union[str, Path], method: Optional[str]) -> PruningConfig:
    """:func:`read_schedule` of a command line's ``--schedule``, beside which a ``--method``
    (canonical, or None) may only name the schedule's own method.

    Raises:
        UserInputError: as :func:`read_schedule`, or naming both flags.
    """
    config = read_schedule(path)
    if method not in (None, config.method):
        raise UserInputError(f"--schedule {path} runs method {config.method!r}; drop --method "
                             f"{method}")
    return config


def _read(path: Path) -> Tuple[PruningConfig, str]:
    """A schedule file's config (checked against its own model's depth) and quality."""
    data = read_json(path, f"schedule file {path}", SCHEDULE_MAX_BYTES, SCHEDULE_MAX_DEPTH)
    if not isinstance(data, dict) or data.get("format") not in (SCHEDULE_FORMAT,
                                                                SCHEDULE_FORMAT_1):
        raise UserInputError(f"{path} is not an mlx-lazy schedule file (field 'format' must "
                             f"be {SCHEDULE_FORMAT!r})")
    config, model = data.get("config"), data.get("model")
    if not isinstance(config, dict) or not isinstance(model, dict) \
            or not isinstance(model.get("fingerprint"), dict):
        raise UserInputError(f"schedule file {path} lacks the 'config' or "
                             "'model.fingerprint' object")
    if data["format"] == SCHEDULE_FORMAT_1:
        config = _scorer_fields_as_spec(config)
    unknown = sorted(set(config) - set(SCHEDULE_FIELDS))
    if unknown:
        raise UserInputError(f"schedule file {path}: unknown field config.{unknown[0]} "
                             f"(fields: {', '.join(SCHEDULE_FIELDS)})")
    if "method" not in config:  # else PruningConfig's default, full, would run
        raise UserInputError(f"schedule file {path} lacks config.method")
    saved = model["fingerprint"]
    layers = saved.get("num_layers")
    if not is_int(layers) or not 1 <= layers <= MAX_COUNT:
        raise UserInputError(f"schedule file {path}: model.fingerprint.num_layers must be a "
                             f"positive integer, got {shown(layers)}")
    if "identity" in saved:
        try:
            decode_identity(saved["identity"])
        except ValueError as e:
            raise UserInputError(f"schedule file {path}: model.fingerprint.identity is not an "
                                 f"identity ModelAdapter.identity() writes ({e})") from None
    if "variant" in saved and not (isinstance(saved["variant"], str)
                                   and VARIANT_PATTERN.match(saved["variant"])):
        raise UserInputError(f"schedule file {path}: model.fingerprint.variant must be a "
                             f"variant such as 'bfloat16+q4g64', got {shown(saved['variant'])}")
    if "variants" in model:
        check_variants(model["variants"], f"schedule file {path}: model.variants")
    if data.get("quality", "default") not in QUALITIES:
        raise UserInputError(f"schedule file {path}: quality must be one of "
                             f"{', '.join(QUALITIES)}, got {shown(data['quality'])}")
    if not isinstance(data.get("evidence", {}), dict):
        raise UserInputError(f"schedule file {path}: evidence must be an object, got "
                             f"{shown(data['evidence'])}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}
    try:
        out = PruningConfig(**values, source=f"calibrated:{path.name}", fingerprint=saved)
        build_schedule(out, layers)
    except ValueError as e:
        raise UserInputError(f"schedule file {path}: invalid config: {e}") from None
    return out, data.get("quality", "default")


def check_variants(variants: Any, where: str = "model.variants") -> List[Dict[str, Any]]:
    """A schedule file's record of the copies of its model it was checked on: a list of
    objects, each with ``variant`` (as ``ModelAdapter.variant`` spells it, e.g.
    ``bfloat16+q4g64``), ``checked`` (a non-empty list of :data:`VARIANT_CHECKS`) and
    optionally ``how`` and ``date`` (strings).

    Raises:
        UserInputError: naming the first malformed entry and field.
    """
    if not isinstance(variants, list) or len(variants) > 64:
        raise UserInputError(f"{where} must be a list of at most 64 objects, got "
                             f"{shown(variants)}")
    for i, entry in enumerate(variants):
        at = f"{where}[{i}]"
        if not isinstance(entry, dict):
            raise UserInputError(f"{at} must be an object, got {shown(entry)}")
        unknown = sorted(set(entry) - set(VARIANT_FIELDS))
        if unknown:
            raise UserInputError(f"{at}: unknown field {unknown[0]!r} (fields: "
                                 f"{', '.join(VARIANT_FIELDS)})")
        variant = entry.get("variant")
        if not isinstance(variant, str) or not VARIANT_PATTERN.match(variant):
            raise UserInputError(f"{at}.variant must be a variant such as 'bfloat16+q4g64', "
                                 f"got {shown(variant)}")
        checked = entry.get("checked")
        if not isinstance(checked, list) or not checked or any(
                c not in VARIANT_CHECKS for c in checked) or len(set(checked)) != len(checked):
            raise UserInputError(f"{at}.checked must be a non-empty list of distinct checks "
                                 f"among {', '.join(VARIANT_CHECKS)}, got {shown(checked)}")
        for key in ("how", "date"):
            if key in entry and not isinstance(entry[key], str):
                raise UserInputError(f"{at}.{key} must be a string, got {shown(entry[key])}")
    return variants


def model_mismatch(saved: Mapping[str, Any], fingerprint: Mapping[str, Any]) -> Optional[str]:
    """Why a schedule calibrated for the model ``saved`` (its file's ``model.fingerprint``)
    does not apply to the model of ``fingerprint`` (``ModelAdapter.fingerprint()``), or None
    when it does.

    With an ``identity`` on both sides, the shapes must be equal and the identities match
    (``identities_match``: any quantization and float dtype of the same weights); the exact
    ``weights`` digest and the ``variant`` are ignored. A file written before identities
    existed must match every field, the exact weights digest included.
    """
    by_identity = "identity" in saved and "identity" in fingerprint
    key = fingerprint_difference(saved, fingerprint, COPY_FIELDS if by_identity else
                                 [k for k in ("identity", "variant") if k not in saved])
    if key is not None:
        theirs = f"is {saved[key]!r}" if key in saved else "is missing"
        return f"model.fingerprint.{key} {theirs}, this model has {fingerprint[key]!r}"
    if not by_identity or identities_match(saved["identity"], fingerprint["identity"]):
        return None
    try:
        far = ", ".join(f"{k} {v:.3g} (at most {IDENTITY_TOLERANCE[k]})" for k, v in
                        identity_distances(saved["identity"], fingerprint["identity"]).items())
    except ValueError as e:
        far = str(e)
    return (f"its weights differ from this model's beyond quantization or a dtype cast "
            f"(model.fingerprint.identity: relative distances {far})")


def schedule_file_name(stem: str, quality: str = "default") -> str:
    """The file name of a ``quality`` schedule (:data:`QUALITIES`): ``stem.json`` for the
    default, ``stem.high.json`` for ``high``."""
    return f"{stem}.json" if quality == "default" else f"{stem}.{quality}.json"


def write_schedule(path: Union[str, Path], config: PruningConfig, fingerprint: Dict[str, Any],
                   evidence: Dict[str, Any], model_name: str = "",
                   quality: str = "default",
                   variants: Optional[List[Dict[str, Any]]] = None) -> Path:
    """Write a schedule file: the config's :data:`SCHEDULE_FIELDS`, its ``quality``, the
    model it was calibrated for, the copies of it the schedule was checked on
    (``variants``, see :func:`check_variants`; by default the copy of ``fingerprint``,
    ``calibrated``) and the evidence behind it. :func:`read_schedule` reads it."""
    if quality not in QUALITIES:  # read_schedule would refuse the file
        raise UserInputError(f"quality must be one of {', '.join(QUALITIES)}, got "
                             f"{shown(quality)}")
    path = check_destination(path, "schedule file")  # a device or folder there is refused
    build_schedule(config, fingerprint["num_layers"])  # never write an invalid file
    if variants is None and isinstance(fingerprint.get("variant"), str):
        variants = [{"variant": fingerprint["variant"], "checked": ["calibrated", "identity"]}]
    model: Dict[str, Any] = {"name": model_name, "fingerprint": fingerprint}
    if variants is not None:
        model["variants"] = check_variants(variants)
    values = {f: getattr(config, f) for f in SCHEDULE_FIELDS if getattr(config, f) is not None}
    values = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
    if "scorer" in values:
        values["scorer"] = scorer_spec(values["scorer"])
    doc = {"format": SCHEDULE_FORMAT, "quality": quality,
           "model": model,
           "config": values, "evidence": evidence}
    write_text_atomic(path, json.dumps(doc, indent=2) + "\n")
    return path


def _scorer_fields_as_spec(config: Dict[str, Any]) -> Dict[str, Any]:
    """A format-1 config, whose ``scorer``, ``window``, ``heads`` and ``pool`` fields were
    separate, with one scorer spec instead."""
    legacy = {"window": "size", "heads": "heads", "pool": "pool"}
    parts = [str(config.get("scorer") or "last")]
    parts += [f"{key}={config[old]}" for old, key in legacy.items()
              if config.get(old) not in (None, 0)]
    rest = {k: v for k, v in config.items() if k not in legacy}
    return {**rest, "scorer": ":".join(parts)} if parts[1:] or "scorer" in config else rest


def check_model(config: PruningConfig, fingerprint: Dict[str, Any]) -> None:
    """Refuse a model other than the one the calibrated schedule ``config`` was made for;
    any quantized or cast copy of that model is the same model (:func:`model_mismatch`).

    Raises:
        UserInputError: naming the first fingerprint field that differs.
    """
    if config.fingerprint is None:
        return
    problem = model_mismatch(dict(config.fingerprint), fingerprint)
    if problem is not None:
        named = f" {config.source}" if config.source else ""
        raise UserInputError(f"the schedule{named} was calibrated for another model: {problem}")


def calibrated(config: PruningConfig, fingerprint: Dict[str, Any],
               attached: Optional[Mapping[str, PruningConfig]] = None,
               global_layers: Sequence[int] = ()) -> PruningConfig:
    """The config to run: a plain ``lazy`` request (no cuts, keep fractions or scorer given)
    takes the model's calibrated schedule of its ``quality``: the one ``attached`` by
    ``mlx_lazy.load`` from the model folder (by quality, see :func:`folder_schedules`), else
    the one ``python -m mlx_lazy.calibrate`` left in the cache for this fingerprint
    (:func:`cached_schedule_path`) or for another copy of the model
    (:func:`cached_copy_schedule`), else a packaged one for the model (any copy, see
    :func:`model_mismatch`); a default quality request without any takes the transfer rule
    (:func:`transfer_config`; ``global_layers``: :func:`mlx_lazy.adapter.global_layers`).
    Any other request is ``config`` itself.

    Raises:
        UserInputError: ``quality="high"`` on a request that is not plain ``lazy``, or for a
            model without a calibrated high-quality schedule.
    """
    check_quality(config)
    if not is_plain(config):
        return config
    high = config.quality != "default"
    found = (attached or {}).get(config.quality)
    if found is None:
        try:
            cached: Optional[Path] = cached_schedule_path(fingerprint, config.quality)
        except UserInputError:  # no cache folder and none can be made: nothing cached
            cached = None
        if cached and cached.is_file():
            found = read_schedule(cached, fingerprint)
        else:
            found = (cached_copy_schedule(cached, fingerprint, config.quality) if cached
                     else None) or packaged_schedule(fingerprint, config.quality)
    if found is None:
        if high:
            raise UserInputError(
                f"no quality={config.quality!r} schedule is calibrated for this model; make one "
                "with python -m mlx_lazy.calibrate --model MODEL, or drop quality")
        return transfer_config(config, fingerprint, global_layers)
    return replace(found, revive=config.revive,
                   **_decode(config, {f: getattr(found, f) for f in DECODE_FIELDS}),
                   anchors=config.anchors, seed=config.seed, quality=config.quality)


def _decode(config: PruningConfig, chosen: Mapping[str, Any]) -> Dict[str, Any]:
    """The decode step a schedule was chosen with (``chosen``, by :data:`DECODE_FIELDS`),
    field by field unless the request ``config`` names its own."""
    return {f: chosen[f] if getattr(config, f) is None else getattr(config, f)
            for f in DECODE_FIELDS}


def is_plain(config: PruningConfig) -> bool:
    """Whether ``config`` is a plain ``lazy`` request (no cuts, keep fractions, scorer or
    schedule file), the one a calibrated schedule stands in for."""
    return (config.method == "lazy" and config.source is None
            and all(getattr(config, f) is None for f in PRUNING_FIELDS))


def check_quality(config: PruningConfig) -> None:
    """Refuse a quality other than the default on a request that is not plain
    (:func:`is_plain`): a quality picks a calibrated schedule.

    Raises:
        UserInputError: naming the quality.
    """
    if config.quality != "default" and not is_plain(config):
        raise UserInputError(f"quality={config.quality!r} picks the model's calibrated "
                             "schedule: it takes a plain method 'lazy' (no cuts, keep "
                             "fractions, scorer or schedule file)")


def folder_schedules(folder: Union[str, Path],
                     fingerprint: Dict[str, Any]) -> Dict[str, PruningConfig]:
    """The calibrated schedules a model folder holds (``mlx_lazy_schedule.json`` and
    ``mlx_lazy_schedule.high.json``), by quality, checked against the model's fingerprint.

    Raises:
        UserInputError: a malformed file, one calibrated for another model, or one whose
            method is not ``lazy``.
    """
    stem = MODEL_SCHEDULE_FILE.removesuffix(".json")
    paths = {q: Path(folder) / schedule_file_name(stem, q) for q in QUALITIES}
    found = {q: read_schedule(p, fingerprint) for q, p in paths.items() if p.is_file()}
    for q, config in found.items():
        if config.method != "lazy":  # what a plain "lazy" takes
            raise UserInputError(f"{paths[q]} is what --method lazy runs on this model: its "
                                 f"method must be 'lazy', not {config.method!r}")
    return found


def fingerprint_digest(fingerprint: Dict[str, Any]) -> str:
    """A short digest of a model fingerprint (shapes and weights digest): the cache key of
    the model's own calibrated schedules."""
    text = json.dumps(sorted(fingerprint.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached_schedule_path(fingerprint: Dict[str, Any], quality: str = "default") -> Path:
    """Where ``python -m mlx_lazy.calibrate`` keeps a schedule for a model whose folder it
    cannot write (a named model, a hub id, a read-only folder):
    ``~/.cache/mlx_lazy/schedules/<fingerprint digest>[.high].json``."""
    from .models import cache_dir

    return cache_dir() / "schedules" / schedule_file_name(fingerprint_digest(fingerprint),
                                                          quality)


def cached_copy_schedule(path: Path, fingerprint: Dict[str, Any],
                         quality: str = "default") -> Optional[PruningConfig]:
    """A schedule of ``quality`` that ``python -m mlx_lazy.calibrate`` left in the cache
    folder of ``path`` (:func:`cached_schedule_path`) for another copy of this model (e.g. the
    float32 one, for this 4-bit one; :func:`model_mismatch`), the most recent if several;
    None if none. Unreadable files are passed over; at most :data:`CACHE_SCAN_LIMIT` are
    read."""
    if "identity" not in fingerprint:
        return None
    name = re.compile(r"^[0-9a-f]{16}\.json$" if quality == "default"
                      else rf"^[0-9a-f]{{16}}\.{re.escape(quality)}\.json$")
    try:
        paths = [p for p in path.parent.iterdir() if name.match(p.name) and p != path]
        paths.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return None
    for candidate in paths[:CACHE_SCAN_LIMIT]:
        try:
            config = read_schedule(candidate)
        except (UserInputError, OSError):
            continue
        if model_mismatch(dict(config.fingerprint or ()), fingerprint) is None:
            return config
    return None


def packaged_schedule(fingerprint: Dict[str, Any],
                      quality: str = "default") -> Optional[PruningConfig]:
    """The packaged calibrated schedule of ``quality`` for this model, whatever its
    quantization or dtype (:func:`model_mismatch`)."""
    for saved, q, config in _packaged():
        if q == quality and model_mismatch(saved, fingerprint) is None:
            return config
    return None


@lru_cache(maxsize=1)
def _packaged() -> Tuple[Tuple[Dict[str, Any], str, PruningConfig], ...]:
    """Packaged schedules as (model fingerprint, quality, config), read once per process. A
    corrupt file is skipped with one warning naming it, so the model takes the transfer rule."""
    found = []
    for path in sorted(PACKAGED_SCHEDULES.glob("*.json")):
        try:
            config, quality = _read(path)
        except UserInputError as e:
            warnings.warn(f"ignoring the packaged schedule {path}: {e}", stacklevel=2)
            continue
        found.append((dict(config.fingerprint), quality, config))
    return tuple(found)


#: The shipped default-quality schedules the transfer rule is fit on (:func:`transfer_rule`).
#: Listed, not globbed: a schedule shipped later (Gemma 3's) does not move the rule measured
#: before it.
TRANSFER_FROM = ("qwen2.5-coder-0.5b.json", "smollm2-135m.json")
#: The source a transferred schedule reports.
TRANSFER_SOURCE = "transfer"


class TransferRule(NamedTuple):
    """What a model without a calibrated schedule runs (:func:`transfer_rule`)."""

    #: ``((relative depth, keep), ...)``: keep that fraction from that depth on.
    cuts: Tuple[Tuple[float, float], ...]
    #: The scorer's spec, None for the default (``last``).
    scorer: Optional[str]
    #: :data:`DECODE_FIELDS` values (None: the library's default).
    decode: Dict[str, Any]


def keep_at(prune_layers: Tuple[int, ...], keep: Tuple[float, ...], num_layers: int,
            depth: float, first: float = 1.0) -> float:
    """The fraction of the context a schedule keeps at relative depth ``depth`` (a cut after
    layer ``l`` of ``L`` acts from depth ``(l + 1) / L`` on): ``first`` above its first cut
    (1: nothing pruned there)."""
    kept = [k for layer, k in zip(prune_layers, keep) if (layer + 1) / num_layers <= depth + 1e-9]
    return min(kept) if kept else first


def transfer_rule(schedules: Optional[List[Tuple[int, PruningConfig]]] = None) -> TransferRule:
    """The transfer rule, fit on calibrated schedules (``(num_layers, config)`` pairs; by
    default the shipped :data:`TRANSFER_FROM`).

    Cuts: from the shallowest depth any of them cuts at, at each relative depth the most that
    any of them keeps there, a schedule counting as keeping its first cut's fraction from that
    depth on (the upper envelope of their keep-against-depth steps, each first cut moved up to
    the shallowest). A cut selects by its own layer's attention, and what a deeper layer's drops
    the answer may not bring back: SmolLM2 cut after its layer 12 (the depth of Qwen's cut)
    instead of 8 lost 44 / won 2 of 100 paired retrieval answers decoding on the pruned state;
    in a ranking on 16 niah_single@768 samples it lost the six whose value the prompt's
    selection drops there (:mod:`mlx_lazy.bench.probe`), revivals or none, where after 8 the
    answer's queries revive it. From Qwen2.5-Coder-0.5B (after layer 9 of 24, keep 40%) and
    SmolLM2-135M (after 8 and 14 of 30, keep 50% and 20%): keep 50% from 9/30 of the depth, 40%
    from half of it. The scorer is theirs when they agree, else None (``last``).

    Decoding: their mode when they agree (else the library's), and of each shortcut a decode
    step takes from the paper's step the gentlest any of them takes: the largest bound on
    revivals (none if one has none), the smallest revive margin, the shortest hold. No source
    was calibrated at another's settings, so the rule takes none of them further from the
    paper than its own calibration did. From the two: decoding on the pruned state,
    re-selecting at every step (Qwen's), at most 4 revivals a step and cut (SmolLM2's),
    revive margin 0.5 (SmolLM2's).

    No cuts (``()``) when there is nothing to fit on.
    """
    if schedules is None:
        schedules = [(dict(config.fingerprint)["num_layers"], config)
                     for _, quality, config in _packaged()
                     if quality == "default" and config.source is not None
                     and config.source.removeprefix("calibrated:") in TRANSFER_FROM]
    schedules = [(n, c) for n, c in schedules if c.prune_layers and c.keep]
    if not schedules:
        return TransferRule((), None, dict.fromkeys(DECODE_FIELDS))
    depths = sorted({(layer + 1) / n for n, c in schedules for layer in c.prune_layers})
    cuts, last = [], 1.0
    for depth in depths:
        k = max(keep_at(c.prune_layers, c.keep, n, depth, first=c.keep[0]) for n, c in schedules)
        if k < last:
            cuts.append((depth, k))
            last = k
    configs = [c for _, c in schedules]
    specs = {scorer_spec(c.scorer) if c.scorer is not None else None for c in configs}
    modes = {c.complete for c in configs}
    bounds = [c.max_revivals for c in configs]
    margin = min(c.revive_margin or 0.0 for c in configs)
    hold = min(c.reselect_every or 1 for c in configs)
    decode = {"complete": modes.pop() if len(modes) == 1 else None,
              "max_revivals": None if None in bounds else max(bounds),
              "revive_margin": margin or None, "reselect_every": hold if hold > 1 else None}
    return TransferRule(tuple(cuts), specs.pop() if len(specs) == 1 else None, decode)


def transfer_layers(rule: Tuple[Tuple[float, float], ...], num_layers: int,
                    global_layers: Sequence[int] = ()
                    ) -> Tuple[Tuple[int, ...], Tuple[float, ...]]:
    """The rule's cuts on a model of ``num_layers``: each after the first layer that reaches
    its relative depth (``ceil(depth * L) - 1``), at most ``L - 2`` so that a layer follows
    it; on a model where not every layer may take a cut (sliding-window or recurrent
    layers), moved to the nearest of its ``global_layers``
    (:func:`~mlx_lazy.policies.cuts_at_global_layers`, so possibly earlier); cuts that land
    on one layer keep the most of them."""
    layers = [min(num_layers - 2, max(0, math.ceil(depth * num_layers - 1e-9) - 1))
              for depth, _ in rule]
    return cuts_at_global_layers(layers, [k for _, k in rule], global_layers)


def transfer_config(config: PruningConfig, fingerprint: Dict[str, Any],
                    global_layers: Sequence[int] = ()) -> PruningConfig:
    """A plain ``lazy`` for a model without a calibrated schedule: the cuts, scorer and decode
    settings of :func:`transfer_rule`, the cuts placed on its depth (:func:`transfer_layers`,
    after its ``global_layers`` where it has sliding windows), a decode setting the request
    names staying its own; reporting ``source: "transfer"``. ``config`` itself (the preset)
    when there is no rule or the model is too shallow for a cut."""
    num_layers = fingerprint.get("num_layers")
    rule = transfer_rule()
    if not rule.cuts or not is_int(num_layers) or num_layers < 2:
        return config
    layers, keep = transfer_layers(rule.cuts, num_layers, global_layers)
    return replace(config, prune_layers=layers, keep=keep, scorer=rule.scorer,
                   source=TRANSFER_SOURCE, **_decode(config, rule.decode))
