"""Property-based tests of the input domains outside the server: any generated
``PruningConfig``, schedule file or command-line number either works or is a clean user
error (``UserInputError``, or exit status 2 with one ``error:`` line), never another
exception, and never an allocation that grows with a number the user wrote.

Each property runs a bounded number of examples (``EXAMPLES``) so the suite stays fast.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import tempfile
from datetime import timedelta
from pathlib import Path
from unittest import mock

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_lazy import METHODS, PruningConfig, UserInputError, build_schedule, cli, read_schedule
from mlx_lazy.inputs import MAX_COUNT
from mlx_lazy.schedule import check_fits
from mlx_lazy.schedule_files import SCHEDULE_FIELDS, SCHEDULE_FORMAT
from mlx_lazy.scorers import LastQuery, pool_by_position

EXAMPLES = 200
# A deadline far above an example's few milliseconds, so a loaded CI machine does not trip
# it, yet an input that makes parsing crawl does. No example database: nothing is written
# into the working tree (a failure prints its example and seed).
PROPERTY = settings(max_examples=EXAMPLES, deadline=timedelta(seconds=5), database=None,
                    suppress_health_check=[HealthCheck.too_slow])
NUM_LAYERS = 30
POOL_BYTES = 1 << 20  # pooling 64 scores needs a few KiB; a user's radius must not scale it

# Numbers as users mistype them: small, negative, at the int32/int64 edges, past Python's
# 4,300-digit printing limit; floats with nan and inf.
SMALL_INTS = st.one_of(st.integers(-3, 40), st.integers(-2**70, 2**70),
                       st.sampled_from([2**31 - 1, 2**31, 2**63, 2**64 - 1, 2**64, 10**20]))
# Made by a map: hypothesis prints its strategies, and Python refuses to print such an int
# (JSON cannot hold one either: json.loads refuses it, see the schedule-file texts below).
INTS = st.one_of(SMALL_INTS, st.integers(4301, 6000).map(lambda digits: 10**digits))
FLOATS = st.floats(allow_nan=True, allow_infinity=True)


def config_fields(ints: st.SearchStrategy) -> dict:
    """A strategy per PruningConfig field (method aside): plausible values, edge numbers
    drawn from ``ints``, and values of the wrong type."""
    numbers = st.one_of(ints, FLOATS, st.booleans())
    wrong = st.one_of(st.none(), numbers, st.text(max_size=8), st.lists(numbers, max_size=4))
    return {
        "prune_layers": st.one_of(st.lists(ints, max_size=4), wrong),
        "keep": st.one_of(st.lists(st.one_of(st.floats(0, 1), FLOATS, ints), max_size=4), wrong),
        "speed_cutoff": st.one_of(st.floats(0, 1), ints, wrong),
        "anchors": st.one_of(ints, wrong),
        "seed": st.one_of(ints, wrong),
        "revive": st.one_of(st.booleans(), wrong),
        "max_revivals": st.one_of(ints, wrong),
        "revive_margin": st.one_of(st.floats(0, 10), FLOATS, ints, wrong),
        "reselect_every": st.one_of(ints, wrong),
        # scorer specs: names, fields and values, each plausible, on the edge or wrong
        "scorer": st.one_of(
            st.lists(st.one_of(
                st.sampled_from(["last", "window", "", " ", "size", "pool=", "heads=max",
                                 "heads=", "size=8", "window=8"]),
                st.tuples(st.sampled_from(["size", "pool", "heads"]),
                          st.one_of(SMALL_INTS.map(str), st.text(max_size=4),
                                    st.integers(1, 6000).map(lambda n: "7" * n))
                          ).map("=".join)),
                min_size=1, max_size=4).map(":".join), wrong),
        "method": st.one_of(st.sampled_from(METHODS), st.text(max_size=12), wrong),
        "complete": st.one_of(
            st.sampled_from(["none", "after-first", "progressive:4", "progressive:0",
                             "progressive:\u00b2", "progressive:\u0663"]),
            st.integers(1, 6000).map(lambda digits: "progressive:" + "7" * digits),
            st.text(max_size=14).map(lambda k: "progressive:" + k), wrong),
    }


FIELDS = config_fields(INTS)
CONFIGS = st.fixed_dictionaries({}, optional=FIELDS)


def pooled_peak(radius: int) -> int:
    """Peak bytes MLX allocates while max-pooling 64 scores over ``radius`` neighbours."""
    scores = mx.array(np.random.default_rng(0).random(64).astype(np.float32))
    mx.eval(scores)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(pool_by_position(np.arange(64), scores, radius))
    return mx.get_peak_memory() - base


@PROPERTY
@given(CONFIGS)
def test_any_pruning_config_works_or_is_a_user_error(fields):
    try:
        schedule = build_schedule(PruningConfig(**fields), NUM_LAYERS)
        check_fits(schedule, 8192)
    except UserInputError:
        return
    # what resolved is a plan the engine can run, and its pool costs no more than any other
    assert 0 <= schedule.anchors <= MAX_COUNT and 0 <= schedule.seed < 2**64
    scorer = schedule.scorer
    assert 1 <= scorer.n_queries <= 8192 and len(scorer.always_kept(100)) <= 100
    assert all(0 < k <= 1 for k in schedule.keep)
    assert list(schedule.keep) == sorted(schedule.keep, reverse=True)
    assert all(0 <= layer < schedule.prompt_depth - 1 for layer in schedule.prune_layers)
    assert pooled_peak(getattr(scorer, "radius", 0)) < POOL_BYTES


@settings(max_examples=50, deadline=None, database=None)
@given(st.lists(st.floats(-1e6, 1e6, width=32), min_size=1, max_size=40),
       st.one_of(st.integers(0, 50), st.integers(0, 10**6)), st.integers(0, 2**32 - 1))
def test_pooling_over_candidates_is_the_definition(scores, radius, seed):
    """Each candidate's score becomes the maximum over ``radius`` candidates on each side in
    position order (non-candidates keep theirs and take no part); a radius past every
    candidate pools over all of them."""
    rng = np.random.default_rng(seed)
    scores = np.array(scores, np.float32)
    positions = rng.permutation(len(scores)) * 3
    candidates = rng.random(len(scores)) < 0.7
    pooled = np.array(pool_by_position(positions, scores, radius, candidates))
    order = [i for i in np.argsort(positions) if candidates[i]]  # candidates by position
    ref = scores.copy()  # the definition, entry by entry
    for j, at in enumerate(order):
        ref[at] = scores[order[max(0, j - radius): j + radius + 1]].max()
    np.testing.assert_array_equal(pooled, ref)  # max-pooling: exact, no arithmetic
    if radius >= len(scores) and order:
        assert (pooled[candidates] == scores[candidates].max()).all()


def test_a_huge_pool_radius_allocates_nothing_more():
    # 10**7 would pad to 160 MB without the clamp; the real-world 10**9 is the same code path
    assert pooled_peak(10**7) < POOL_BYTES


# ------------------------------------------------------------------ schedule files

JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), SMALL_INTS, FLOATS, st.text(max_size=6)),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=4),
    max_leaves=20)
FILE_FIELDS = config_fields(SMALL_INTS)
SCHEDULE_DOCS = st.one_of(
    JSON,
    st.fixed_dictionaries({
        "format": st.one_of(st.just(SCHEDULE_FORMAT), JSON),
        "model": st.one_of(st.fixed_dictionaries({"fingerprint": st.one_of(
            st.fixed_dictionaries({"num_layers": st.one_of(st.integers(1, 40), SMALL_INTS)}),
            JSON)}), JSON),
        "config": st.one_of(st.fixed_dictionaries(
            {}, optional={f: st.one_of(FILE_FIELDS[f], JSON) for f in SCHEDULE_FIELDS}), JSON)}))
FILE_TEXT = st.one_of(
    SCHEDULE_DOCS.map(lambda d: json.dumps(d).encode()),
    # a valid document whose scorer's pool has thousands of digits
    st.tuples(SCHEDULE_DOCS, st.integers(1, 6000)).map(
        lambda d: json.dumps(d[0]).encode()[:-1] + b', "scorer": "last:pool=' + b"7" * d[1]
        + b'"}'),
    st.binary(max_size=64),
    st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n))


@pytest.fixture(scope="module")
def scratch():
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


@PROPERTY
@given(data=FILE_TEXT)
def test_any_schedule_file_loads_or_is_a_user_error_naming_it(scratch, data):
    path = scratch / "schedule.json"
    path.write_bytes(data)
    try:
        config = read_schedule(path)
    except UserInputError as e:
        assert str(path) in str(e)
        return
    assert build_schedule(config, dict(config.fingerprint)["num_layers"]).method == config.method


# ------------------------------------------------------------------ command-line numbers


class Reached(Exception):
    """The CLI accepted every flag and went on to load the model."""


# the scorer's numbers arrive inside its spec ("--scorer=window:size=" + text)
NUMBER_FLAGS = ["--prune-layers", "--keep", "--speed-cutoff", "--scorer=last:pool", "--anchors",
                "--scorer=window:size", "--seed", "--temp", "--top-p", "-m"]
NUMBER_TEXT = st.one_of(
    st.from_regex(r"\A-?[0-9]{0,6}(\.[0-9]{0,3})?(,-?[0-9]{0,4}(\.[0-9]{0,2})?){0,3},?\Z"),
    SMALL_INTS.map(str), st.integers(1, 6000).map(lambda digits: "7" * digits), FLOATS.map(str),
    st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=10))


@PROPERTY
@given(flag=st.sampled_from(NUMBER_FLAGS), text=NUMBER_TEXT,
       method=st.sampled_from(["lazy", "static", "random", "lazy+speed"]))
def test_any_number_on_the_command_line_works_or_exits_2_with_one_line(flag, text, method):
    err = io.StringIO()
    argv = ["--method", method, "-p", "hi", f"{flag}={text}"]
    with mock.patch.object(cli, "load", side_effect=Reached), \
            contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = cli.main(argv)
        except Reached:  # then every number is in its domain
            args = cli.build_parser().parse_args(argv)
            assert math.isfinite(args.temp) and args.temp >= 0 and 0 < args.top_p <= 1
            assert args.seed is None or 0 <= args.seed < 2**64
            assert args.max_tokens >= 1
            config = cli.build_config(args)
            assert 0 <= config.anchors <= MAX_COUNT
            scorer = config.scorer or LastQuery()
            assert 0 <= getattr(scorer, "radius", 0) <= MAX_COUNT
            assert 1 <= scorer.n_queries <= MAX_COUNT
            return
    lines = err.getvalue().strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith("error: "), (argv, lines)
