"""Schedule files: what ``python -m mlx_lazy.calibrate`` writes (:func:`write_schedule`) and
:func:`read_schedule` reads, and where a plain ``lazy`` finds the model's calibrated schedule
(:func:`calibrated`: the model folder, the cache by fingerprint, the package's own)."""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Union

from .config import MAX_COUNT, QUALITIES, PruningConfig
from .errors import UserInputError, shown
from .folders import write_text_atomic
from .inputs import MiB, read_json
from .scorers import scorer_spec

#: The ``format`` of schedule files (written by ``python -m mlx_lazy.calibrate``).
SCHEDULE_FORMAT = "mlx-lazy-schedule/2"
#: Format 1 spelt the scorer's parameters as config fields (read, and converted, still).
SCHEDULE_FORMAT_1 = "mlx-lazy-schedule/1"
#: PruningConfig fields a schedule file sets; the rest (revive, anchors, seed) stay the caller's.
SCHEDULE_FIELDS = ("method", "prune_layers", "keep", "scorer")
#: Calibrated schedules shipped with the package, matched to models by fingerprint.
PACKAGED_SCHEDULES = Path(__file__).parent / "data" / "schedules"
#: A model folder holding this file makes ``--method lazy`` use it (see ``mlx_lazy.load``).
MODEL_SCHEDULE_FILE = "mlx_lazy_schedule.json"
#: Bounds of schedule files (calibrate writes a few KiB, nested 4 deep).
SCHEDULE_MAX_BYTES = 1 * MiB
SCHEDULE_MAX_DEPTH = 16


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
    path = Path(path)
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
    saved = model["fingerprint"]
    layers = saved.get("num_layers")
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= MAX_COUNT:
        raise UserInputError(f"schedule file {path}: model.fingerprint.num_layers must be a "
                             f"positive integer, got {shown(layers)}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}
    try:
        out = PruningConfig(**values, source=f"calibrated:{path.name}", fingerprint=saved)
        out.resolve(layers)
    except ValueError as e:
        raise UserInputError(f"schedule file {path}: invalid config: {e}") from None
    if fingerprint is not None:
        out.check_model(fingerprint)
    return out


def schedule_file_name(stem: str, quality: str = "default") -> str:
    """The file name of a ``quality`` schedule (:data:`QUALITIES`): ``stem.json`` for the
    default, ``stem.high.json`` for ``high``."""
    return f"{stem}.json" if quality == "default" else f"{stem}.{quality}.json"


def write_schedule(path: Union[str, Path], config: PruningConfig, fingerprint: Dict[str, Any],
                   evidence: Dict[str, Any], model_name: str = "",
                   quality: str = "default") -> Path:
    """Write a schedule file: the config's :data:`SCHEDULE_FIELDS`, its ``quality``, the
    model it was calibrated for and the evidence behind it. :func:`read_schedule`
    reads it."""
    config.resolve(fingerprint["num_layers"])  # never write an invalid file
    values = {f: getattr(config, f) for f in SCHEDULE_FIELDS if getattr(config, f) is not None}
    values = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
    if "scorer" in values:
        values["scorer"] = scorer_spec(values["scorer"])
    doc = {"format": SCHEDULE_FORMAT, "quality": quality,
           "model": {"name": model_name, "fingerprint": fingerprint},
           "config": values, "evidence": evidence}
    path = Path(path)
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


def calibrated(config: PruningConfig, fingerprint: Dict[str, Any],
               attached: Optional[Mapping[str, PruningConfig]] = None) -> PruningConfig:
    """The config to run: a plain ``lazy`` request (no cuts, keep fractions or scorer given)
    takes the model's calibrated schedule of its ``quality``: the one ``attached`` by
    ``mlx_lazy.load`` from the model folder (by quality, see :func:`folder_schedules`), else
    the one ``python -m mlx_lazy.calibrate`` left in the cache for this fingerprint
    (:func:`cached_schedule_path`), else a packaged one with the same fingerprint; a default
    quality request without any keeps the preset. Any other request is ``config`` itself.

    Raises:
        UserInputError: ``quality="high"`` on a request that is not plain ``lazy``, or for a
            model without a calibrated high-quality schedule.
    """
    plain = (config.method == "lazy" and config.source is None
             and all(getattr(config, f) is None for f in ("prune_layers", "keep", "scorer")))
    high = config.quality != "default"
    if not plain:
        if high:
            raise UserInputError(f"quality={config.quality!r} picks the model's calibrated "
                                 "schedule: it takes a plain method 'lazy' (no cuts, keep "
                                 "fractions, scorer or schedule file)")
        return config
    found = (attached or {}).get(config.quality)
    if found is None:
        try:
            cached: Optional[Path] = cached_schedule_path(fingerprint, config.quality)
        except UserInputError:  # no cache folder and none can be made: nothing cached
            cached = None
        found = (read_schedule(cached, fingerprint) if cached and cached.is_file()
                 else packaged_schedule(fingerprint, config.quality))
    if found is None:
        if high:
            raise UserInputError(
                f"no quality={config.quality!r} schedule is calibrated for this model; make one "
                "with python -m mlx_lazy.calibrate --model MODEL, or drop quality")
        return config
    return replace(found, revive=config.revive, complete=config.complete,
                   anchors=config.anchors, seed=config.seed, quality=config.quality)


def folder_schedules(folder: Union[str, Path],
                     fingerprint: Dict[str, Any]) -> Dict[str, PruningConfig]:
    """The calibrated schedules a model folder holds (``mlx_lazy_schedule.json`` and
    ``mlx_lazy_schedule.high.json``), by quality, checked against the model's fingerprint.

    Raises:
        UserInputError: a malformed file, or one calibrated for another model.
    """
    stem = MODEL_SCHEDULE_FILE.removesuffix(".json")
    paths = {q: Path(folder) / schedule_file_name(stem, q) for q in QUALITIES}
    return {q: read_schedule(p, fingerprint) for q, p in paths.items() if p.is_file()}


def fingerprint_digest(fingerprint: Dict[str, Any]) -> str:
    """A short digest of a model fingerprint (shapes and weights digest): the cache key of
    the model's own calibrated schedules."""
    text = json.dumps(sorted(fingerprint.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached_schedule_path(fingerprint: Dict[str, Any], quality: str = "default") -> Path:
    """Where ``python -m mlx_lazy.calibrate`` keeps a schedule for a model whose folder it
    cannot write (a named model, a hub id, a read-only folder):
    ``~/.cache/mlx_lazy/schedules/<fingerprint digest>[.high].json``."""
    from .default_model import cache_dir

    return cache_dir() / "schedules" / schedule_file_name(fingerprint_digest(fingerprint),
                                                          quality)


def packaged_schedule(fingerprint: Dict[str, Any],
                      quality: str = "default") -> Optional[PruningConfig]:
    """The packaged calibrated schedule of ``quality`` whose model fingerprint equals
    ``fingerprint``."""
    return _packaged().get((_key(fingerprint), quality))


@lru_cache(maxsize=1)
def _packaged() -> Dict[tuple, PruningConfig]:
    """Packaged schedules by (model fingerprint, quality), read once per process. A corrupt
    file is skipped with one warning naming it, so the model keeps its preset."""
    found = {}
    for path in sorted(PACKAGED_SCHEDULES.glob("*.json")):
        try:
            config = read_schedule(path)
            quality = read_json(path, f"schedule file {path}", SCHEDULE_MAX_BYTES,
                                SCHEDULE_MAX_DEPTH).get("quality", "default")
            if quality not in QUALITIES:
                raise UserInputError(f"field 'quality' must be one of {', '.join(QUALITIES)}")
        except UserInputError as e:
            warnings.warn(f"ignoring the packaged schedule {path}: {e}", stacklevel=2)
            continue
        found[(_key(dict(config.fingerprint)), quality)] = config
    return found


def _key(fingerprint: Dict[str, Any]) -> tuple:
    return tuple(sorted(fingerprint.items()))
