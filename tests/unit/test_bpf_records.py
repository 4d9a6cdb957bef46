"""The ctypes mirrors match the C records; the batch decoding (records.Kinds: a drain's rows checked
and read as numpy arrays) equals the record-by-record decoding it replaced, and names bad records'
reasons the same way.

For each BPF source, every `_Static_assert(sizeof(struct NAME) == EXPR, ...)` is read from the C text,
EXPR is evaluated with the `#define` defaults the source (and common.h) set, and the Python mirror
must have that size, the same field names in the same order, and the same size per field; every
record fits the family's slot (CCLD_REC_SIZE). No root. The same equality on records the kernel
wrote: tests/bpf (test_gloo_batch.py, and the nccl/rdma probe tests' recorder).
"""
import ast
import ctypes as ct
import operator
import os
import re
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ccld.bpf import gloo, gloo_records, nccl, pgnccl, rdma, records, sched
from ccld.bpf.loader import BPF_DIR

pytestmark = pytest.mark.unit

# C struct -> Python mirror, per source. A record struct without an entry here fails the test.
MIRRORS = {
    "common.h": {"ccld_hdr": records.Header},
    "gloo.bpf.c": {"gloo_pg_init": gloo_records.PgInit, "gloo_work_init": gloo_records.WorkInit,
                   "gloo_work_start": gloo_records.WorkStart, "gloo_work_end": gloo_records.WorkEnd,
                   "gloo_p2p": gloo_records.P2pRec, "gloo_pair_fail": gloo_records.PairFail,
                   "gloo_p2p_end": gloo_records.P2pEnd, "gloo_enter_of": gloo_records.EnterOf,
                   "gloo_pg_name": gloo_records.PgName},
    "sched.bpf.c": {"sched_stats": sched.SchedVal, "fatal_signal": sched.FatalSignal},
    "nccl.bpf.c": {"nccl_call": nccl.NcclCall, "nccl_group": nccl.NcclGroup,
                   "nccl_comm_init": nccl.NcclCommInit, "nccl_comm_end": nccl.NcclCommEnd},
    "pgnccl.bpf.c": {"pgn_pg": pgnccl.PgnPg, "pgn_work": pgnccl.PgnWork},
}
# C record kind -> Python constant, per source
KIND_NAMES = {
    "gloo.bpf.c": ("gloo_kind", {"GLOO_PG_INIT": gloo_records.PG_INIT, "GLOO_WORK_INIT": gloo_records.WORK_INIT,
                                 "GLOO_WORK_START": gloo_records.WORK_START, "GLOO_WORK_END": gloo_records.WORK_END,
                                 "GLOO_P2P": gloo_records.P2P_REC, "GLOO_PAIR_FAIL": gloo_records.PAIR_FAIL,
                                 "GLOO_P2P_END": gloo_records.P2P_END, "GLOO_PG_NAME": gloo_records.PG_NAME}),
    "nccl.bpf.c": ("nccl_kind", {"NCCL_COLL": nccl.COLL, "NCCL_P2P": nccl.P2P_REC, "NCCL_GROUP": nccl.GROUP,
                                 "NCCL_COMM_INIT": nccl.COMM_INIT, "NCCL_COMM_END": nccl.COMM_END}),
    "pgnccl.bpf.c": ("pgn_kind", {"PGN_PG": pgnccl.PG, "PGN_WORK": pgnccl.WORK}),
}
FAMILIES = {"gloo.bpf.c": gloo.GlooFamily, "nccl.bpf.c": nccl.NcclFamily, "rdma.bpf.c": rdma.RdmaFamily,
            "pgnccl.bpf.c": pgnccl.PgncclFamily}
C_TYPE_BYTES = {"u8": 1, "s8": 1, "char": 1, "u16": 2, "s16": 2, "u32": 4, "s32": 4, "u64": 8, "s64": 8,
                "struct ccld_hdr": 24, "struct gloo_enter_of": 32}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def _source(name: str) -> str:
    with open(os.path.join(BPF_DIR, name)) as f:
        text = f.read()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def _defines(*texts: str) -> dict:
    """Every object-like `#define NAME VALUE` (the defaults under #ifndef included; -D overrides aside)."""
    out = {}
    for text in texts:
        for name, value in re.findall(r"^\s*#define\s+([A-Z_][A-Z0-9_]*)[ \t]+([^\n]+)$", text, flags=re.M):
            out[name] = value.strip()
    return out


def _eval(expr: str, defs: dict, depth: int = 0) -> int:
    """Integer value of a C constant expression made of numbers, defines, + - * / and parentheses."""
    if depth > 10:
        raise ValueError(f"define loop in {expr!r}")
    expr = re.sub(r"\b([A-Za-z_]\w*)\b", lambda m: f"({_eval(defs[m.group(1)], defs, depth + 1)})", expr)
    expr = re.sub(r"\b(0x[0-9a-fA-F]+|\d+)[uUlL]*\b", r"\1", expr).replace("/", "//")

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"not a simple constant expression: {expr!r}")
    return ev(ast.parse(expr, mode="eval"))


def _asserted_sizes(text: str, defs: dict) -> dict:
    found = re.findall(r"_Static_assert\s*\(\s*sizeof\s*\(\s*struct\s+(\w+)\s*\)\s*==\s*([^,]+),", text)
    return {name: _eval(expr, defs) for name, expr in found}


def _struct_fields(text: str, name: str, defs: dict):
    """[(field, bytes)] of `struct name { ... };` in declaration order."""
    body = re.search(r"struct\s+" + name + r"\s*\{(.*?)\};", text, flags=re.S).group(1)
    fields = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        m = re.fullmatch(r"(struct\s+\w+|\w+)\s+(\w+)\s*(?:\[([^\]]+)\])?", decl)
        assert m, f"struct {name}: cannot read field declaration {decl!r}"
        ctype, fname, dim = m.groups()
        fields.append((fname, C_TYPE_BYTES[ctype] * (_eval(dim, defs) if dim else 1)))
    return fields


@pytest.mark.parametrize("source", ["common.h", "gloo.bpf.c", "nccl.bpf.c", "pgnccl.bpf.c", "sched.bpf.c"])
def test_mirrors_match_static_asserts(source):
    common = _source("common.h")
    text = _source(source)
    defs = _defines(common, text)
    sizes = _asserted_sizes(text, defs)
    assert sizes, f"{source} has no _Static_assert on a record size"
    assert set(sizes) == set(MIRRORS[source]), f"{source}: record structs and their Python mirrors differ"
    for cname, size in sizes.items():
        cls = MIRRORS[source][cname]
        assert ct.sizeof(cls) == size, f"{source}: struct {cname} is {size} bytes, {cls.__name__} {ct.sizeof(cls)}"
        c_fields = _struct_fields(text, cname, defs)
        py_fields = [(n, ct.sizeof(t)) for n, t in cls._fields_]
        assert py_fields == c_fields, f"{source}: struct {cname} fields differ from {cls.__name__}"


@pytest.mark.parametrize("source", sorted(FAMILIES))
def test_every_record_fits_the_familys_slot(source):
    common, text = _source("common.h"), _source(source)
    defs = _defines(common, text)
    kinds = FAMILIES[source].KINDS
    assert _eval("CCLD_REC_SIZE", defs) == kinds.rec_size, f"{source}: CCLD_REC_SIZE differs from the loader's"
    assert kinds.rec_size % 8 == 0
    assert max(ct.sizeof(c) for c in kinds.classes.values()) == kinds.rec_size  # no slot bigger than needed


@pytest.mark.parametrize("source", ["gloo.bpf.c", "nccl.bpf.c", "pgnccl.bpf.c"])
def test_kind_numbers_match(source):
    enum, names = KIND_NAMES[source]
    body = re.search(r"enum\s+" + enum + r"\s*\{(.*?)\};", _source(source), flags=re.S).group(1)
    c_kinds = {k: int(v, 0) for k, v in re.findall(r"(\w+)\s*=\s*(\w+)", body)}
    assert c_kinds == names


def test_nccl_fn_numbers_match():
    body = re.search(r"enum\s+nccl_fn\s*\{(.*?)\};", _source("nccl.bpf.c"), flags=re.S).group(1)
    for name, value in re.findall(r"(FN_\w+)\s*=\s*(\d+)", body):
        assert getattr(nccl, name) == int(value), name


def test_eval_handles_defines_and_arithmetic():
    defs = _defines("#ifndef A\n#define A 32\n#endif\n#define B (A * 2)\n")
    assert _eval("24 + 48 + A", defs) == 104
    assert _eval("B / 4 - 1", defs) == 15
    assert _eval("0x10U + 1UL", defs) == 17
    with pytest.raises(ValueError):
        _eval("1 << 2", defs)  # anything beyond + - * / is refused, not guessed


# -- the batch decoding against the record-by-record one ----------------------------------------

def decode_one(data: bytes, kinds: dict):
    """(kind, record) or (None, reason): the per-record decoding the agent used before its batch path
    (ccld/bpf/records.py until issue 16), kept here as the reference."""
    if len(data) < records.HEADER_SIZE:
        return None, "short"
    kind, version, size = struct.unpack_from("=HHI", data)
    if version != records.REC_VERSION:
        return None, "version"
    cls = kinds.get(kind)
    if cls is None:
        return None, "unknown-kind"
    if size != ct.sizeof(cls) or len(data) < ct.sizeof(cls):
        return None, "size"
    return kind, cls.from_buffer_copy(data)


def _raw(cls, kind: int, version: int = records.REC_VERSION, size=None) -> bytes:
    rec = cls()
    rec.hdr.kind, rec.hdr.version = kind, version
    rec.hdr.size = ct.sizeof(cls) if size is None else size
    rec.hdr.ts_ns, rec.hdr.tgid, rec.hdr.tid = 123456789, 42, 43
    return bytes(rec)


def _rows(raws, rec_size):
    return np.frombuffer(b"".join(r.ljust(rec_size, b"\0")[:rec_size] for r in raws), np.uint8).reshape(
        len(raws), rec_size).copy()


def _values(x):
    """A ctypes or numpy field value in a comparable form."""
    if isinstance(x, (bytes, np.bytes_)):
        return bytes(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    if hasattr(x, "_length_"):  # a ctypes array
        return list(x)
    return int(x)


def _same_fields(cls, rec, row):
    if cls is records.Header:
        for h, _ in records.Header._fields_:
            assert int(getattr(rec, h)) == int(row[h]), ("hdr", h)
        return
    for name, ctype in cls._fields_:
        if isinstance(ctype, type) and issubclass(ctype, ct.Structure):  # the header, or another nested struct
            _same_fields(ctype, getattr(rec, name), row[name])
        elif issubclass(ctype, ct.Array) and ctype._type_ is ct.c_char:  # both read up to the first NUL
            assert getattr(rec, name) == bytes(row[name]).split(b"\0", 1)[0], (cls.__name__, name)
        else:
            assert _values(getattr(rec, name)) == _values(row[name]), (cls.__name__, name)


@pytest.mark.parametrize("family", sorted(FAMILIES.values(), key=lambda f: f.NAME), ids=lambda f: f.NAME)
def test_good_records_read_alike(family):
    kinds = family.KINDS
    raws = [_raw(cls, kind) for kind, cls in kinds.classes.items()]
    bad: dict = {}
    good, got_kinds = kinds.check(_rows(raws, kinds.rec_size), bad)
    assert bad == {} and got_kinds.tolist() == list(kinds.classes)
    for kind, cls in kinds.classes.items():
        (row,) = kinds.of(good, got_kinds, kind)
        want_kind, rec = decode_one(_raw(cls, kind), kinds.classes)
        assert want_kind == kind
        _same_fields(cls, rec, row)


def _slot(draw, kinds):
    """One slot's bytes: a record of a random kind with random contents, sometimes damaged."""
    kind = draw(st.sampled_from(sorted(kinds.classes) + [0, 99]))
    cls = kinds.classes.get(kind, nccl.NcclGroup)
    size = ct.sizeof(cls)
    body = bytearray(draw(st.binary(min_size=kinds.rec_size, max_size=kinds.rec_size)))
    version = draw(st.sampled_from([records.REC_VERSION] * 6 + [0, 2]))
    hsize = draw(st.sampled_from([size] * 6 + [size - 8, size + 8]))
    struct.pack_into("=HHI", body, 0, kind, version, hsize)
    return bytes(body)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_drains_decode_as_record_by_record(data):
    """Counts (good and bad, by reason) and every field of every good record: the batch decoding of a
    drain equals the decoding of its records one at a time."""
    family = data.draw(st.sampled_from([gloo.GlooFamily, nccl.NcclFamily, rdma.RdmaFamily]))
    kinds = family.KINDS
    raws = [_slot(data.draw, kinds) for _ in range(data.draw(st.integers(0, 40)))]
    bad: dict = {}
    good, got_kinds = kinds.check(_rows(raws, kinds.rec_size) if raws else np.zeros((0, kinds.rec_size), np.uint8), bad)
    want, want_bad = [], {}
    for raw in raws:
        k, rec = decode_one(raw, kinds.classes)
        if k is None:
            want_bad[rec] = want_bad.get(rec, 0) + 1
        else:
            want.append((k, rec))
    assert bad == want_bad
    assert got_kinds.tolist() == [k for k, _ in want]
    for (k, rec), row in zip(want, good):
        _same_fields(kinds.classes[k], rec, records.view(row.reshape(1, -1), kinds.dtypes[k])[0])


def test_bad_records_are_counted_by_reason():
    kinds = nccl.NcclFamily.KINDS
    size = ct.sizeof(nccl.NcclCall)
    raws = [_raw(nccl.NcclCall, 99), _raw(nccl.NcclCall, 0), _raw(nccl.NcclCall, nccl.COLL, version=0),
            _raw(nccl.NcclCall, nccl.COLL, version=0xFFFF), _raw(nccl.NcclCall, nccl.COLL, size=size - 8),
            _raw(nccl.NcclCall, nccl.COLL, size=size + 8), _raw(nccl.NcclGroup, nccl.COLL),
            _raw(nccl.NcclCall, nccl.COLL)]
    bad: dict = {}
    good, got = kinds.check(_rows(raws, kinds.rec_size), bad)
    assert bad == {"unknown-kind": 2, "version": 2, "size": 3} and got.tolist() == [nccl.COLL]
