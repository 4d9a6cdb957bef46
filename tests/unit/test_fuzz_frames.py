"""Property tests of the frame decoder: whatever arrives, decode_batch returns a Batch or raises FrameError.

Hypothesis draws malformed frames of five shapes (random bytes, valid MessagePack of any structure,
good envelopes with one field broken, good frames with bytes flipped/cut/inserted, good envelopes
whose events lose, gain or retype fields) and checks: nothing but FrameError escapes, every error
has a reason and a short readable message naming what was wrong, and good events beside bad ones
are kept, in order, with every dropped event counted.
The default run is a few thousand examples (seconds); CCLD_FUZZ_EXAMPLES=N raises it per test.
The live, 100k-frame version is bench/fuzz_collector.py (and tests/unit/test_fuzz_live.py).
"""
import os

import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from ccld import wire as ev
from ccld.timeline.ingest import IngestCounters, decode_frame

from test_events_schema import ONE_OF_EACH

pytestmark = pytest.mark.unit

EXAMPLES = int(os.environ.get("CCLD_FUZZ_EXAMPLES", "500"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MAX_MESSAGE = 600  # hostile values are shown shortened: a message never carries a megabyte of junk

GOOD_WIRE = [e.to_wire() for e in ONE_OF_EACH]
GOOD_FRAME = ev.encode_batch("a1", "n1", 7, ONE_OF_EACH)
FIELD_NAMES = sorted({k for d in GOOD_WIRE for k in d} | {"v", "agent", "node", "batch", "events"})
EXTREME_INTS = [0, -1, 2**31, 2**32, 2**63 - 1, -2**63, 2**64 - 1, 1 << 20]

ints = st.one_of(st.integers(-2**63, 2**64 - 1), st.sampled_from(EXTREME_INTS))
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(), st.text(max_size=12), st.binary(max_size=12),
                    st.sampled_from(sorted(ev.EVENT_TYPES)))
keys = st.one_of(st.sampled_from(FIELD_NAMES), st.text(max_size=6), st.integers(-3, 3), st.binary(max_size=3),
                 st.none(), st.booleans())
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(keys, inner, max_size=4)), max_leaves=12)


def pack(obj):
    return msgpack.packb(obj, use_bin_type=True)


def envelope(events, **over):
    d = {"v": [ev.SCHEMA_MAJOR, ev.SCHEMA_MINOR], "agent": "a1", "node": "n1", "batch": 7, "events": events}
    d.update(over)
    return d


def outcome(frame):
    """Decode; anything but a Batch or a FrameError propagates and fails the property."""
    try:
        batch = ev.decode_batch(frame)
    except ev.FrameError as e:
        assert e.reason and isinstance(e.reason, str)
        assert str(e) and len(str(e)) < MAX_MESSAGE, str(e)[:200]
        return e
    assert isinstance(batch, ev.Batch)
    assert sum(batch.bad_counts.values()) >= len(batch.errors)
    assert len(batch.errors) <= ev.MAX_ERRORS_KEPT
    for err in batch.errors:
        msg = str(err)
        assert ("event #" in msg or "block #" in msg) and len(msg) < MAX_MESSAGE, msg[:200]  # names which
        if err.reason in ("missing-field", "bad-field"):
            assert "field '" in msg or "column '" in msg, msg  # names the field (a block's: its column)
    # the ingest path counts the same frame once, either way
    c = IngestCounters()
    decode_frame(frame, c)
    assert c.frames_ok + sum(c.frames_rejected.values()) == 1 and "decoder-error" not in c.frames_rejected
    return batch


@FUZZ
@given(st.binary(max_size=512))
@example(b"")
@example(b"\xc1")
@example(b"\xdd\xff\xff\xff\xff")
def test_random_bytes(frame):
    outcome(frame)


@FUZZ
@given(values)
def test_random_msgpack_structure(obj):
    got = outcome(pack(obj))
    assert isinstance(got, ev.FrameError)  # no random structure is a frame: it has no version


ENVELOPE_KEYS = ["v", "agent", "node", "batch", "events"]
BAD_VERSIONS = st.one_of(st.tuples(ints, ints).map(list), st.lists(ints, max_size=4), values,
                         st.sampled_from([[ev.SCHEMA_MAJOR + 1, 0], [ev.SCHEMA_MAJOR - 1, 0], [True, False],
                                          [1.0, 0], "1.0", [ev.SCHEMA_MAJOR, 2**64 - 1]]))


@FUZZ
@given(st.sampled_from(ENVELOPE_KEYS), st.sampled_from(["delete", "replace", "version"]), values, BAD_VERSIONS,
       st.dictionaries(keys, values, max_size=3))
def test_envelope_with_a_broken_field(key, how, junk, version, extra):
    env = envelope(GOOD_WIRE)
    env.update((k, v) for k, v in extra.items() if k not in ENVELOPE_KEYS)  # unknown envelope keys: tolerated
    if how == "delete":
        del env[key]
    elif how == "replace":
        env[key] = junk
    else:
        key, env["v"] = "v", version
    got = outcome(pack(env))
    if isinstance(got, ev.FrameError):
        assert repr(key) in str(got) or (key == "v" and "version" in str(got)), str(got)
    else:  # still a readable frame: the broken field happened to be acceptable (e.g. a list of events)
        assert isinstance(got.agent, str) and isinstance(got.batch, int) and not isinstance(got.batch, bool)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(GOOD_FRAME) - 1), st.integers(0, 255)), min_size=1, max_size=6),
       st.one_of(st.none(), st.integers(0, len(GOOD_FRAME))), st.binary(max_size=8), st.integers(0, len(GOOD_FRAME)))
def test_good_frame_with_bytes_flipped_cut_or_inserted(flips, cut, inserted, at):
    b = bytearray(GOOD_FRAME)
    for i, byte in flips:
        b[i] = byte
    b[at:at] = inserted
    if cut is not None:
        del b[cut:]
    outcome(bytes(b))


def mutated_event(draw_base, ops):
    d = dict(draw_base)
    for op, key, val in ops:
        if op == "delete":
            d.pop(key, None)
        elif op == "retype":
            d[key] = val
        else:
            d[f"extra_{key}" if isinstance(key, str) else key] = val
    return d


events_with_mutations = st.lists(
    st.tuples(st.sampled_from(range(len(GOOD_WIRE))), st.booleans(),
              st.lists(st.tuples(st.sampled_from(["delete", "retype", "extra"]), keys, values), max_size=3)),
    min_size=1, max_size=12)


@FUZZ
@given(events_with_mutations, st.sampled_from([ev.SCHEMA_MINOR, ev.SCHEMA_MINOR + 1]))
def test_bad_events_are_dropped_and_good_ones_kept(spec, minor):
    wire, good_idx = [], []
    for idx, keep_good, ops in spec:
        if keep_good or not ops:
            good_idx.append(len(wire))
            wire.append(GOOD_WIRE[idx])
        else:
            wire.append(mutated_event(GOOD_WIRE[idx], ops))
    batch = outcome(pack(envelope(wire, v=[ev.SCHEMA_MAJOR, minor])))
    assert isinstance(batch, ev.Batch)
    # every event is accounted for: kept, dropped as bad (counted by reason), or skipped (newer minor)
    assert len(batch.events) + sum(batch.bad_counts.values()) + batch.skipped == len(wire)
    # the good events are all there, in order (a mutated one that is still valid may sit between them)
    kept = iter(batch.events)
    for i in good_idx:
        want = ev.event_from_wire(wire[i])
        assert any(e == want for e in kept), f"good event #{i} lost"
    for err in batch.errors:
        assert "'a1'" in str(err) and "batch 7" in str(err)


# ---- regressions found by these tests and by bench/fuzz_collector.py --------------------------------------

@pytest.mark.parametrize("kind", [[1], {"a": 1}, None, 5, b"coll"], ids=["list", "map", "nil", "int", "bin"])
def test_event_kind_of_any_type_is_a_clear_error(kind):
    """An unhashable kind (list, map) used to escape as TypeError: the collector lost the frame
    and its ingest thread slept 100 ms per such frame."""
    batch = outcome(pack(envelope([{"k": kind}, GOOD_WIRE[7]])))
    assert batch.events == [ONE_OF_EACH[7]] and list(batch.bad_counts) == ["bad-field"]
    assert "field 'k'" in str(batch.errors[0])
    batch = outcome(pack(envelope([{"seq": 1}])))
    assert list(batch.bad_counts) == ["missing-field"] and "field 'k'" in str(batch.errors[0])


@pytest.mark.parametrize("depth", [999, 1000, 1023, 1024, 5000])
def test_deeply_nested_version_is_a_clear_error(depth):
    """A version nested ~1000 deep used to escape as RecursionError (from its repr in the message)."""
    err = outcome(b"\x81" + pack("v") + b"\x91" * depth + b"\x01")
    assert isinstance(err, ev.FrameError) and err.reason in ("no-version", "not-msgpack")


def test_many_bad_events_are_counted_not_all_kept():
    """A frame of 60,000 junk events keeps MAX_ERRORS_KEPT messages and counts all (it used to keep
    one exception per event: a 16 MiB frame of junk took 7 GiB and 80 s)."""
    n = ev.MAX_EVENTS_PER_FRAME - 1
    batch = outcome(pack(envelope([1] * (n - 1) + [GOOD_WIRE[7]])))
    assert batch.bad_counts == {"bad-event": n - 1} and len(batch.errors) == ev.MAX_ERRORS_KEPT
    assert batch.events == [ONE_OF_EACH[7]]
    c = IngestCounters()
    decode_frame(pack(envelope([1] * (n - 1))), c)
    assert c.bad_events == {"bad-event": n - 1} and c.frames_ok == 1


def test_too_many_events_is_rejected_before_decoding():
    err = outcome(pack(envelope([1] * (ev.MAX_EVENTS_PER_FRAME + 1))))
    assert isinstance(err, ev.FrameError) and err.reason == "too-many-items"
    # a 16 MiB frame claiming 16M one-byte events is refused from its header
    n = ev.MAX_FRAME_BYTES - 64
    frame = pack(envelope(None))[:-1] + b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n
    err = outcome(frame)
    assert isinstance(err, ev.FrameError) and err.reason == "too-many-items"


@pytest.mark.parametrize("field,value,got", [
    ("counters", {"x": b"\xff"}, "bytes value"), ("counters", {b"x": 1}, "bytes key"),
    ("counters", {"x": True}, "bool value"), ("counters", {1: 1}, "int key"),
])
def test_container_elements_are_checked(field, value, got):
    """Elements of Dict/List fields end up in stats.json: a bytes one would break json.dump."""
    batch = outcome(pack(envelope([dict(GOOD_WIRE[11], **{field: value})])))
    assert batch.events == [] and list(batch.bad_counts) == ["bad-field"]
    assert f"field {field!r}" in str(batch.errors[0]) and got in str(batch.errors[0])
    for bad in ({"libs": {"a": 1}}, {"sources": ["gloo", None]}):
        for base in (GOOD_WIRE[2], GOOD_WIRE[0]):
            if next(iter(bad)) in base:
                batch = outcome(pack(envelope([dict(base, **bad)])))
                assert list(batch.bad_counts) == ["bad-field"] and repr(next(iter(bad))) in str(batch.errors[0])


def test_bool_batch_number_is_not_an_int():
    err = outcome(pack(envelope([], batch=True)))
    assert isinstance(err, ev.FrameError) and err.reason == "bad-envelope" and "'batch'" in str(err)


def test_hostile_agent_name_is_shortened_in_messages():
    batch = outcome(pack(envelope([1], agent="x" * 100_000)))
    assert len(str(batch.errors[0])) < 300 and "xxx" in str(batch.errors[0])
