"""A model's identity (weights up to quantization and dtype): what a calibrated schedule
matches on, while a prompt cache stays tied to the exact weights."""

from __future__ import annotations

import mlx_lazy  # noqa: F401  (OpenBLAS before mlx)

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx.utils import tree_map

from mlx_lazy import PruningConfig, UserInputError, read_schedule
from mlx_lazy import schedule_files
from mlx_lazy.adapter import ModelAdapter, identities_match, identity_distances
from mlx_lazy.conversion import convert
from mlx_lazy.prompt_cache import load_prompt_cache, make_prompt_cache, save_prompt_cache
from mlx_lazy.resolve import resolve_config
from mlx_lazy.schedule_files import cached_schedule_path, write_schedule
from tiny_models import build_tiny_model

CALIBRATED = PruningConfig("lazy", prune_layers=(1,), keep=(0.3,), scorer="window:size=4")


def copy_of(folder, dtype=None, bits=None, group_size=None):
    """The model of ``folder`` cast to ``dtype`` and/or quantized as mlx-lm does (the layers
    whose input width the group size divides)."""
    model, _ = mlx_lm.load(str(folder))
    if dtype is not None:
        model.update(tree_map(lambda p: p.astype(dtype), model.parameters()))
    if bits is not None:
        nn.quantize(model, group_size=group_size, bits=bits,
                    class_predicate=lambda _, m: hasattr(m, "to_quantized")
                    and m.weight.shape[-1] % group_size == 0)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def twin_dir(tmp_path_factory):
    """A tiny llama of the same shapes as the fixture's, from another seed."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("twin"), seed=1)


@pytest.fixture(scope="module")
def converted(tiny_model_dir, tmp_path_factory):
    """The tiny llama through ``mlx_lm.convert``: ``-q`` (4 bits, groups of 64) and
    ``--dtype float16``, as users make them."""
    root = tmp_path_factory.mktemp("converted")
    source = tiny_model_dir("llama")
    return {"q4": convert(source, root / "q4", q_bits=4),
            "q8g32": convert(source, root / "q8g32", q_bits=8, q_group_size=32),
            "float16": convert(source, root / "f16", dtype="float16"),
            "bfloat16+q4": convert(source, root / "bf16q4", q_bits=4, dtype="bfloat16")}


VARIANTS = [
    ("float16", mx.float16, None, None), ("bfloat16", mx.bfloat16, None, None),
    ("q4g32", None, 4, 32), ("q4g64", None, 4, 64), ("q6g32", None, 6, 32),
    ("q8g64", None, 8, 64), ("bfloat16+q4g32", mx.bfloat16, 4, 32),
]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_identity_survives_quantization_and_casts(tiny_model_dir, kind):
    """Every 4/6/8-bit and float16/bfloat16 copy keeps the identity (while its exact weights
    digest changes); the variant names the copy."""
    folder = tiny_model_dir(kind)
    base = ModelAdapter(copy_of(folder))
    for label, dtype, bits, group in VARIANTS:
        other = ModelAdapter(copy_of(folder, dtype, bits, group))
        assert other.variant() == (label if dtype is not None and bits is None
                                   else label if "+" in label else f"float32+{label}")
        assert other.weights_digest() != base.weights_digest(), label
        assert identities_match(base.identity(), other.identity()), (
            label, identity_distances(base.identity(), other.identity()))


def test_identity_tells_a_same_shape_model_apart(tiny_model_dir, twin_dir):
    """Another model of exactly the same shapes, or a copy of it, does not match; neither
    does the model with one norm weight rescaled."""
    ours = ModelAdapter(copy_of(tiny_model_dir("llama")))
    theirs = ModelAdapter(copy_of(twin_dir))
    assert {k: v for k, v in ours.fingerprint().items() if k not in ("weights", "identity")} \
        == {k: v for k, v in theirs.fingerprint().items() if k not in ("weights", "identity")}
    assert not identities_match(ours.identity(), theirs.identity())
    assert not identities_match(ours.identity(),
                                ModelAdapter(copy_of(twin_dir, None, 4, 32)).identity())
    model = copy_of(tiny_model_dir("llama"))
    norm = model.model.layers[2].input_layernorm
    norm.weight = norm.weight * 1.3
    assert identities_match(ours.identity(), ModelAdapter(model).identity()) is False
    assert identity_distances(ours.identity(), ours.identity()) == {"embedding": 0.0,
                                                                   "norms": 0.0}
    assert not identities_match(ours.identity(), "i1:garbage")


@pytest.fixture
def packaged(tiny_model_dir, tmp_path, monkeypatch):
    """A packaged schedule calibrated on the float32 tiny llama (and no cache)."""
    monkeypatch.setenv("MLX_LAZY_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "packaged"
    folder.mkdir()
    fp = ModelAdapter(copy_of(tiny_model_dir("llama"))).fingerprint()
    write_schedule(folder / "tiny.json", CALIBRATED, fp, {"note": "test"}, "tiny")
    monkeypatch.setattr(schedule_files, "PACKAGED_SCHEDULES", folder)
    schedule_files._packaged.cache_clear()
    yield folder / "tiny.json"
    schedule_files._packaged.cache_clear()


def test_quantized_and_cast_copies_take_the_calibrated_schedule(packaged, converted,
                                                                  tiny_model_dir, twin_dir):
    """A plain ``lazy`` on the 4-bit, 8-bit and float16 copies made by ``mlx_lm.convert``
    resolves to the schedule calibrated for the float32 model; a same-shape other model (and
    its 4-bit copy) does not (the preset: the packaged folder here holds nothing the
    transfer rule is fit on)."""
    want = ("calibrated:tiny.json", (1,), (0.3,))
    for name in ("q4", "q8g32", "float16", "bfloat16+q4"):
        model, _ = mlx_lazy.load(str(converted[name]))
        s = resolve_config(model, "lazy")
        assert (s.source, s.prune_layers, s.keep) == want, name
    assert resolve_config(copy_of(tiny_model_dir("llama")), "lazy").source == want[0]
    assert resolve_config(copy_of(twin_dir), "lazy").source == "preset"
    assert resolve_config(copy_of(twin_dir, None, 4, 64), "lazy").source == "preset"
    # read against a model, the file is refused by the other one, naming the weights
    read_schedule(packaged, ModelAdapter(mlx_lazy.load(str(converted["q4"]))[0]).fingerprint())
    with pytest.raises(UserInputError, match="weights differ"):
        read_schedule(packaged, ModelAdapter(copy_of(twin_dir)).fingerprint())


def test_a_schedule_in_the_model_folder_follows_the_copies(tiny_model_dir, converted,
                                                           tmp_path, monkeypatch):
    """The float32 model's ``mlx_lazy_schedule.json`` copied into the 4-bit folder applies
    there."""
    monkeypatch.setenv("MLX_LAZY_CACHE", str(tmp_path / "cache"))
    fp = ModelAdapter(copy_of(tiny_model_dir("llama"))).fingerprint()
    folder = tmp_path / "q4"
    shutil.copytree(converted["q4"], folder)
    write_schedule(folder / schedule_files.MODEL_SCHEDULE_FILE, CALIBRATED, fp, {})
    model, _ = mlx_lazy.load(str(folder))
    assert resolve_config(model, "lazy").source == "calibrated:mlx_lazy_schedule.json"


def test_a_cached_calibration_follows_the_copies(tiny_model_dir, converted, twin_dir,
                                                 tmp_path, monkeypatch):
    """What ``calibrate`` leaves in the cache for the float32 model (keyed by its exact
    fingerprint) is found for its 4-bit copy too; another model does not take it (it takes
    the transfer rule of the shipped schedules)."""
    monkeypatch.setenv("MLX_LAZY_CACHE", str(tmp_path / "cache"))
    fp = ModelAdapter(copy_of(tiny_model_dir("llama"))).fingerprint()
    path = cached_schedule_path(fp)
    path.parent.mkdir(parents=True)
    write_schedule(path, CALIBRATED, fp, {})
    (path.parent / "0123456789abcdef.json").write_text("{broken")  # passed over
    model, _ = mlx_lazy.load(str(converted["q4"]))
    assert cached_schedule_path(ModelAdapter(model).fingerprint()) != path
    assert resolve_config(model, "lazy").source == f"calibrated:{path.name}"
    assert resolve_config(copy_of(twin_dir), "lazy").source == "transfer"
    assert resolve_config(model, PruningConfig("lazy", quality="default")).prune_layers == (1,)


def test_a_prompt_cache_stays_tied_to_the_exact_weights(tiny_model_dir, converted, tmp_path):
    """A prompt cache made on the float32 weights is refused by the 4-bit copy (which takes
    the same schedules), naming the weights digest."""
    model = copy_of(tiny_model_dir("llama"))
    cache = make_prompt_cache(model, "full")
    cache.process(list(range(5, 25)))
    save_prompt_cache(tmp_path / "c.safetensors", cache)
    assert load_prompt_cache(tmp_path / "c.safetensors", model).tokens == list(range(5, 25))
    q4, _ = mlx_lazy.load(str(converted["q4"]))
    with pytest.raises(UserInputError, match="weights"):
        load_prompt_cache(tmp_path / "c.safetensors", q4)
    with pytest.raises(UserInputError, match="another model"):
        cache.check(q4, "full")


def test_schedule_files_record_the_variants_checked(tiny_model_dir, tmp_path):
    """write_schedule records the calibrated copy; a malformed identity or variants list is
    one UserInputError naming the field."""
    fp = ModelAdapter(copy_of(tiny_model_dir("llama"))).fingerprint()
    path = write_schedule(tmp_path / "s.json", CALIBRATED, fp, {})
    doc = json.loads(path.read_text())
    assert doc["model"]["variants"] == [{"variant": "float32",
                                         "checked": ["calibrated", "identity"]}]
    bad = [
        (dict(doc["model"], variants={"float32": 1}), "model.variants must be a list"),
        (dict(doc["model"], variants=[{"variant": "q4", "checked": ["identity"]}]),
         "model.variants[0].variant"),
        (dict(doc["model"], variants=[{"variant": "float32", "checked": []}]),
         "model.variants[0].checked"),
        (dict(doc["model"], variants=[{"variant": "float32", "checked": ["vibes"]}]),
         "model.variants[0].checked"),
        (dict(doc["model"], variants=[{"variant": "float32", "checked": ["kld"], "by": 1}]),
         "unknown field 'by'"),
        (dict(doc["model"], fingerprint=dict(fp, identity="i1:nope")),
         "model.fingerprint.identity"),
        (dict(doc["model"], fingerprint=dict(fp, variant=4)), "model.fingerprint.variant"),
        # a well-formed part whose values overflow: not an identity either
        (dict(doc["model"], fingerprint=dict(fp, identity=fp["identity"].replace(
            fp["identity"].split(":")[1].split(".")[0] + ".", "999.", 1))),
         "model.fingerprint.identity"),
    ]
    for model, message in bad:
        (tmp_path / "bad.json").write_text(json.dumps(dict(doc, model=model)))
        with pytest.raises(UserInputError, match=message.replace("[", r"\[").replace("]", r"\]")):
            read_schedule(tmp_path / "bad.json")


def test_schedule_files_without_an_identity_still_match_exactly(tiny_model_dir, tmp_path):
    """A file written before identities names the exact weights: only those weights take it."""
    fp = ModelAdapter(copy_of(tiny_model_dir("llama"))).fingerprint()
    old = {k: v for k, v in fp.items() if k not in ("identity", "variant")}
    path = write_schedule(tmp_path / "old.json", CALIBRATED, old, {})
    assert read_schedule(path, fp).prune_layers == (1,)
    q4 = ModelAdapter(copy_of(tiny_model_dir("llama"), None, 4, 64)).fingerprint()
    with pytest.raises(UserInputError, match="model.fingerprint.weights"):
        read_schedule(path, q4)
    # a field the file lacks is said to be missing (once "is None")
    partial = write_schedule(tmp_path / "partial.json", CALIBRATED,
                             {k: v for k, v in fp.items() if k != "hidden_size"}, {})
    with pytest.raises(UserInputError, match="model.fingerprint.hidden_size is missing, this "
                                             "model has 64"):
        read_schedule(partial, fp)


def test_the_shipped_schedules_name_their_models_identity():
    """Each shipped file carries an identity and records the copies it was checked on, the
    calibrated one included."""
    for path in sorted(schedule_files.PACKAGED_SCHEDULES.glob("*.json")):
        doc = json.loads(path.read_text())
        config = read_schedule(path)
        fp = dict(config.fingerprint)
        assert fp["identity"].startswith("i1:") and len(fp["weights"]) == 16, path.name
        variants = doc["model"]["variants"]
        calibrated = [v for v in variants if "calibrated" in v["checked"]]
        assert [v["variant"] for v in calibrated] == [fp["variant"]], path.name
        assert any(v["variant"].endswith("q4g64") for v in variants), path.name


@pytest.mark.slow
def test_smollm2_and_its_4bit_copy_take_the_shipped_schedules(smollm2_path):
    """The real SmolLM2: the float32 folder's identity is the shipped files' (its weights
    digest too), and the 4-bit copy (the GGUF's own Q4_1/Q8_0) resolves a plain ``lazy`` to the
    same calibrated schedules, while its exact weights digest differs."""
    from mlx_lazy.models import model_path

    shipped = dict(read_schedule(schedule_files.PACKAGED_SCHEDULES / "smollm2-135m.json")
                   .fingerprint)
    f32 = mlx_lazy.load(str(smollm2_path))[0]
    assert {k: ModelAdapter(f32).fingerprint()[k] for k in shipped} == shipped
    q4 = mlx_lazy.load(str(model_path("smollm2-135m", quantized=True)))[0]
    fp = ModelAdapter(q4).fingerprint()
    assert fp["variant"] == "float32+q4g32+q8g32" and fp["weights"] != shipped["weights"]
    for quality in ("default", "high"):
        s = resolve_config(q4, PruningConfig("lazy", quality=quality))
        name = schedule_files.schedule_file_name('smollm2-135m', quality)
        assert s.source == f"calibrated:{name}"
