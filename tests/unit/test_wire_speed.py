"""The decoder's fast paths decide exactly as its full checks do.

read_block tries a clean block with blocks._fits before the full field-by-field check (read_fields); the
fast path must accept only what the full check accepts, and build the same Block. Hypothesis draws good
blocks of every kind (every field shared or a column, short columns and ones past SHORT_COLUMN) and breaks
them the ways a hostile or newer sender could: a bool or an int/str subclass where an int or str belongs,
a value of the wrong type in one row, a column of the wrong length or not a list, an unknown field, a
str-subclass or non-str name, a field both shared and a column, a missing one, no column at all. Each
block is read twice, with the fast path and with it switched off: the same Block (the same value
objects, names, order) or the same FrameError (reason and message). Both pass through decode_batch too,
so the rejects counters and messages match.
The default run is a few hundred examples; CCLD_FUZZ_EXAMPLES=N raises it.
"""
import os
from unittest import mock

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from ccld import wire as ev
from ccld.wire import blocks

from test_events_schema import ONE_OF_EACH

pytestmark = pytest.mark.unit

EXAMPLES = int(os.environ.get("CCLD_FUZZ_EXAMPLES", "400"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BY_KIND = {type(e).KIND: e for e in ONE_OF_EACH}
HOT = ["coll", "start", "end"]


class IntSub(int):
    pass


class StrSub(str):
    pass


JUNK = [True, False, 0, 1, -1, 2**64, 1.5, None, "x", "", b"b", [], [1], {}, {"a": 1}, IntSub(3), StrSub("s")]


def good_block(kind, n, in_cols, vary):
    """A good block of `kind`: n rows, the fields named in `in_cols` as columns (ints varied by row)."""
    wire = BY_KIND[kind].to_wire()
    del wire["k"]
    same = {k: v for k, v in wire.items() if k not in in_cols}
    cols = {k: [v + i if vary and type(v) is int else v for i in range(n)] for k, v in wire.items() if k in in_cols}
    return {"k": kind, "n": n, "at": 0, "same": same, "cols": cols}


def names(d):
    return sorted(d, key=repr)  # names may be of any type once broken


@st.composite
def blocks_(draw):
    kind = draw(st.one_of(st.sampled_from(HOT), st.sampled_from(sorted(BY_KIND))))
    fields = sorted(BY_KIND[kind].to_wire().keys() - {"k"})
    n = draw(st.sampled_from([1, 2, 8, blocks.SHORT_COLUMN, blocks.SHORT_COLUMN + 1, 40]))
    in_cols = draw(st.sets(st.sampled_from(fields)))
    b = good_block(kind, n, in_cols, draw(st.booleans()))
    for _ in range(draw(st.integers(0, 3))):
        how = draw(st.sampled_from(["same-junk", "row-junk", "length", "not-list", "unknown", "odd-name",
                                    "both", "drop", "no-cols", "n", "subclass-row", "pack", "pack"]))
        same, cols = b["same"], b["cols"]
        if how == "same-junk" and same:
            same[draw(st.sampled_from(names(same)))] = draw(st.sampled_from(JUNK))
        elif how == "row-junk" and cols:
            col = cols[draw(st.sampled_from(names(cols)))]
            if type(col) is list and col:
                col[draw(st.integers(0, len(col) - 1))] = draw(st.sampled_from(JUNK))
        elif how == "subclass-row" and cols:
            col = cols[draw(st.sampled_from(names(cols)))]
            if type(col) is list and col:
                x = col[-1]
                col[-1] = IntSub(x) if type(x) is int else StrSub(x) if type(x) is str else x
        elif how == "length" and cols:
            name = draw(st.sampled_from(names(cols)))
            if type(cols[name]) is list:
                cols[name] = cols[name][:-1] if draw(st.booleans()) else cols[name] + cols[name][:1]
        elif how == "not-list" and cols:
            cols[draw(st.sampled_from(names(cols)))] = draw(st.sampled_from([5, "x", None, (1, 2), {}]))
        elif how == "unknown":
            where = same if draw(st.booleans()) else cols
            where[draw(st.sampled_from(["zzz", "extra_field"]))] = [0] * n if where is cols else 7
        elif how == "odd-name":
            where = same if draw(st.booleans()) or not cols else cols
            if where:
                name = draw(st.sampled_from(names(where)))
                odd = draw(st.sampled_from([StrSub(name), 3, b"x", None]))
                where[odd] = where.pop(name)
        elif how == "both":
            name = draw(st.sampled_from(fields))
            if name in cols and name not in same:
                same[name] = BY_KIND[kind].to_wire()[name]
            elif name in same and name not in cols:
                cols[name] = [same[name]] * n
        elif how == "drop":
            where = same if draw(st.booleans()) or not cols else cols
            if where:
                del where[draw(st.sampled_from(names(where)))]
        elif how == "no-cols":
            b["cols"] = {}
        elif how == "n":
            b["n"] = draw(st.sampled_from([1, n + 1, max(1, n - 1)]))
        elif how == "pack" and cols:  # schema 1.8: a column as n little-endian int64 (bytes)
            name = draw(st.sampled_from(names(cols)))
            col = cols[name]
            if type(col) is list:
                width = draw(st.sampled_from([1, 2, 4, 8, 8]))
                ints = all(type(x) is int and -(1 << (8 * width - 1)) <= x < 1 << (8 * width - 1) for x in col)
                packed = np.array(col, f"<i{width}").tobytes() if ints else b"\0" * (width * len(col))
                cut = draw(st.sampled_from([0, 0, 0, 1, 3, 8, -8]))  # mostly whole, else bytes short or over
                cols[name] = packed[:len(packed) - cut] if cut > 0 else packed + b"\1" * -cut
    return b


def outcome(raw, n_events=0):
    """What read_block makes of `raw`: the Block's parts (names with their types, value objects by id) or
    the error's reason and message."""
    try:
        b = blocks.read_block(raw, n_events)
    except ev.FrameError as e:
        return ("error", e.reason, str(e))
    assert b.same is not raw["same"] and b.lists is not raw["cols"]  # the Block's maps are its own
    return ("block", b.kind, b.n, b.at, [(type(k), k, type(v), id(v)) for k, v in b.same.items()],
            [(type(k), k, id(v)) for k, v in b.lists.items()], sorted((b.bin or {}).items()))


def full_check():
    return mock.patch.object(blocks, "_fits", lambda *a: False)


@FUZZ
@given(blocks_())
def test_the_fast_path_decides_as_the_full_check(raw):
    fast = outcome(raw)
    with full_check():
        slow = outcome(raw)
    assert fast == slow


@FUZZ
@given(st.lists(blocks_(), min_size=1, max_size=4))
def test_frames_count_and_name_bad_blocks_as_the_full_check(raws):
    try:
        frame = msgpack.packb({"v": [ev.SCHEMA_MAJOR, ev.SCHEMA_MINOR], "agent": "a1", "node": "n1", "batch": 3,
                               "events": [], "blocks": raws}, use_bin_type=True)
    except OverflowError:  # 2**64 has no MessagePack form
        assume(False)

    def seen():
        try:
            b = ev.decode_batch(frame)
        except ev.FrameError as e:
            return ("frame", e.reason, str(e))
        return ([(x.kind, x.n, x.same, x.cols) for x in b.blocks], b.bad_counts, [str(e) for e in b.errors],
                b.skipped)

    fast = seen()
    with full_check():
        assert seen() == fast


def test_good_hot_blocks_take_the_fast_path():
    """The point of it: an agent's blocks (every field known, exact types) never need the full check."""
    for kind in HOT:
        for n in (1, 8, 40):
            raw = good_block(kind, n, {"seq", "pid", "rank", "ts_ns"}, True)
            with mock.patch.object(blocks, "read_fields", side_effect=AssertionError("full check")):
                b = blocks.read_block(raw, 0)
            assert b.n == n and b.cols == raw["cols"] and b.same == raw["same"]


@pytest.mark.parametrize("col,got", [([4, True], "a bool"), ([4, IntSub(5)], "a IntSub"), ([4, "5"], "a str")])
def test_an_odd_row_gets_the_full_checks_message(col, got):
    raw = good_block("start", 2, {"seq", "pid", "rank", "ts_ns"}, True)
    raw["cols"]["seq"] = col
    with pytest.raises(ev.FrameError) as ei:
        blocks.read_block(raw, 0)
    assert ei.value.reason == "bad-field"
    assert str(ei.value) == f"block of 'start': column 'seq' should hold int, has {got}"


def test_a_str_subclass_name_is_an_unknown_field_as_before():
    raw = good_block("start", 2, {"seq", "pid", "rank", "ts_ns"}, True)
    raw["same"] = {StrSub("comm"): "c"}  # equal to "comm", but not a str: ignored, so comm is missing
    with pytest.raises(ev.FrameError) as ei:
        blocks.read_block(raw, 0)
    assert ei.value.reason == "missing-field" and "'comm'" in str(ei.value)
