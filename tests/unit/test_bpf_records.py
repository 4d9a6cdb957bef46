"""The ctypes mirrors match the C records, and records.decode turns bad records into reasons.

For each BPF source, every `_Static_assert(sizeof(struct NAME) == EXPR, ...)` is read from the C text,
EXPR is evaluated with the `#define` defaults the source (and common.h) set, and the Python mirror
must have that size, the same field names in the same order, and the same size per field. No root.
"""
import ast
import ctypes as ct
import operator
import os
import re

import pytest

from ccld.bpf import gloo, nccl, records
from ccld.bpf.loader import BPF_DIR

pytestmark = pytest.mark.unit

# C struct -> Python mirror, per source. A record struct without an entry here fails the test.
MIRRORS = {
    "common.h": {"ccld_hdr": records.Header},
    "gloo.bpf.c": {"gloo_pg_init": gloo.PgInit, "gloo_work_init": gloo.WorkInit,
                   "gloo_work_ev": gloo.WorkEv, "gloo_p2p": gloo.P2pRec, "gloo_work_size": gloo.WorkSize,
                   "gloo_pair_fail": gloo.PairFail},
    "nccl.bpf.c": {"nccl_call": nccl.NcclCall, "nccl_group": nccl.NcclGroup,
                   "nccl_comm_init": nccl.NcclCommInit, "nccl_comm_end": nccl.NcclCommEnd},
}
# C record kind -> Python constant, per source
KIND_NAMES = {
    "gloo.bpf.c": ("gloo_kind", {"GLOO_PG_INIT": gloo.PG_INIT, "GLOO_WORK_INIT": gloo.WORK_INIT,
                                 "GLOO_WORK_START": gloo.WORK_START, "GLOO_WORK_END": gloo.WORK_END,
                                 "GLOO_P2P": gloo.P2P_REC, "GLOO_WORK_SIZE": gloo.WORK_SIZE,
                                 "GLOO_PAIR_FAIL": gloo.PAIR_FAIL}),
    "nccl.bpf.c": ("nccl_kind", {"NCCL_COLL": nccl.COLL, "NCCL_P2P": nccl.P2P_REC, "NCCL_GROUP": nccl.GROUP,
                                 "NCCL_COMM_INIT": nccl.COMM_INIT, "NCCL_COMM_END": nccl.COMM_END}),
}
C_TYPE_BYTES = {"u8": 1, "s8": 1, "char": 1, "u16": 2, "s16": 2, "u32": 4, "s32": 4, "u64": 8, "s64": 8,
                "struct ccld_hdr": 24}

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


@pytest.mark.parametrize("source", ["common.h", "gloo.bpf.c", "nccl.bpf.c"])
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


@pytest.mark.parametrize("source", ["gloo.bpf.c", "nccl.bpf.c"])
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


# -- records.decode -------------------------------------------------------------------------------

def _raw(cls, kind: int, version: int = records.REC_VERSION, size=None) -> bytes:
    rec = cls()
    rec.hdr.kind, rec.hdr.version = kind, version
    rec.hdr.size = ct.sizeof(cls) if size is None else size
    rec.hdr.ts_ns, rec.hdr.tgid, rec.hdr.tid = 123456789, 42, 43
    return bytes(rec)


@pytest.mark.parametrize("family", [gloo.GlooFamily, nccl.NcclFamily])
def test_decode_good_records(family):
    for kind, cls in family.KINDS.items():
        got_kind, rec = records.decode(_raw(cls, kind), family.KINDS)
        assert got_kind == kind and isinstance(rec, cls)
        assert (rec.hdr.ts_ns, rec.hdr.tgid, rec.hdr.tid) == (123456789, 42, 43)


def test_decode_reads_fields():
    r = nccl.NcclCall()
    r.hdr.kind, r.hdr.version, r.hdr.size = nccl.COLL, records.REC_VERSION, ct.sizeof(r)
    r.comm, r.count, r.datatype, r.root = 0xDEADBEEF, 1001, 7, -1
    kind, rec = records.decode(bytes(r) + b"\0" * 8, nccl.NcclFamily.KINDS)  # ring buffer padding is fine
    assert (kind, rec.comm, rec.count, rec.datatype, rec.root) == (nccl.COLL, 0xDEADBEEF, 1001, 7, -1)


@pytest.mark.parametrize("data", [b"", b"\x01", bytes(records.HEADER_SIZE - 1)], ids=["empty", "1", "23"])
def test_decode_short(data):
    assert records.decode(data, nccl.NcclFamily.KINDS) == (None, "short")


def test_decode_unknown_kind():
    assert records.decode(_raw(nccl.NcclCall, 99), nccl.NcclFamily.KINDS) == (None, "unknown-kind")
    assert records.decode(_raw(nccl.NcclCall, 0), nccl.NcclFamily.KINDS) == (None, "unknown-kind")


@pytest.mark.parametrize("version", [0, records.REC_VERSION + 1, 0xFFFF])
def test_decode_bad_version(version):
    assert records.decode(_raw(nccl.NcclCall, nccl.COLL, version=version),
                          nccl.NcclFamily.KINDS) == (None, "version")


def test_decode_bad_size():
    kinds = nccl.NcclFamily.KINDS
    size = ct.sizeof(nccl.NcclCall)
    assert records.decode(_raw(nccl.NcclCall, nccl.COLL, size=size - 8), kinds) == (None, "size")
    assert records.decode(_raw(nccl.NcclCall, nccl.COLL, size=size + 8), kinds) == (None, "size")
    # header says the right size but the bytes stop early
    assert records.decode(_raw(nccl.NcclCall, nccl.COLL)[:size - 1], kinds) == (None, "size")
    # a record of another kind's shape under this kind
    assert records.decode(_raw(nccl.NcclGroup, nccl.COLL), kinds) == (None, "size")
