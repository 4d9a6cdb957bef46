"""rdma.bpf.c's records match their ctypes mirrors; its ABI offsets match verbs.h; the translator's
mapping of records to QpInfo (mask gating, port choice, GID text) and the symbol-version filter. No root.

The size/field checks reuse test_bpf_records' reader of `_Static_assert`s and struct declarations.
"""
import ctypes as ct
import os
import re
import shutil
import struct
import subprocess

import numpy as np
import pytest

from ccld.bpf import elfver, rdma, records
from test_bpf_records import _asserted_sizes, _defines, _source, _struct_fields

pytestmark = pytest.mark.unit

MIRRORS = {"rdma_qp_create": rdma.QpCreate, "rdma_qp_modify": rdma.QpModify, "rdma_qp_destroy": rdma.QpDestroy}
MASK_BITS = {"IBV_QP_STATE": rdma.IBV_QP_STATE, "IBV_QP_PORT": rdma.IBV_QP_PORT, "IBV_QP_AV": rdma.IBV_QP_AV,
             "IBV_QP_DEST_QPN": rdma.IBV_QP_DEST_QPN}
C_OFFSETS = {  # -D default in rdma.bpf.c -> offsetof() expression against <infiniband/verbs.h>
    "IBV_QP_CONTEXT_OFF": "offsetof(struct ibv_qp, context)",
    "IBV_QP_NUM_OFF": "offsetof(struct ibv_qp, qp_num)",
    "IBV_PD_CONTEXT_OFF": "offsetof(struct ibv_pd, context)",
    "IBV_CONTEXT_DEVICE_OFF": "offsetof(struct ibv_context, device)",
    "IBV_DEVICE_NAME_OFF": "offsetof(struct ibv_device, name)",
    "IBV_INIT_QP_TYPE_OFF": "offsetof(struct ibv_qp_init_attr, qp_type)",
    "IBV_ATTR_STATE_OFF": "offsetof(struct ibv_qp_attr, qp_state)",
    "IBV_ATTR_DEST_QPN_OFF": "offsetof(struct ibv_qp_attr, dest_qp_num)",
    "IBV_ATTR_AH_OFF": "offsetof(struct ibv_qp_attr, ah_attr)",
    "IBV_ATTR_PORT_OFF": "offsetof(struct ibv_qp_attr, port_num)",
    "IBV_AH_DGID_OFF": "offsetof(struct ibv_ah_attr, grh) + offsetof(struct ibv_global_route, dgid)",
    "IBV_AH_DLID_OFF": "offsetof(struct ibv_ah_attr, dlid)",
    "IBV_AH_IS_GLOBAL_OFF": "offsetof(struct ibv_ah_attr, is_global)",
    "IBV_AH_PORT_OFF": "offsetof(struct ibv_ah_attr, port_num)",
}


def test_mirrors_match_static_asserts():
    text = _source("rdma.bpf.c")
    defs = _defines(_source("common.h"), text)
    sizes = _asserted_sizes(text, defs)
    assert set(sizes) == set(MIRRORS)
    for cname, size in sizes.items():
        cls = MIRRORS[cname]
        assert ct.sizeof(cls) == size, f"struct {cname} is {size} bytes, {cls.__name__} {ct.sizeof(cls)}"
        assert [(n, ct.sizeof(t)) for n, t in cls._fields_] == _struct_fields(text, cname, defs), cname


def test_kind_numbers_and_constants_match():
    text = _source("rdma.bpf.c")
    body = re.search(r"enum\s+rdma_kind\s*\{(.*?)\};", text, flags=re.S).group(1)
    assert {k: int(v) for k, v in re.findall(r"(\w+)\s*=\s*(\d+)", body)} == {
        "RDMA_QP_CREATE": rdma.QP_CREATE, "RDMA_QP_MODIFY": rdma.QP_MODIFY, "RDMA_QP_DESTROY": rdma.QP_DESTROY}
    defs = _defines(text)
    assert int(defs["CCLD_DEV_NAME_LEN"]) == rdma.DEV_NAME_LEN
    assert set(rdma.RdmaFamily.KINDS.classes) == {rdma.QP_CREATE, rdma.QP_MODIFY, rdma.QP_DESTROY}


def test_abi_offsets_match_verbs_h(tmp_path):
    """The -D defaults and attr_mask bits are rdma-core's public x86-64 ABI; checked with the C compiler
    where verbs.h is installed (libibverbs-dev, as on the development machines)."""
    if not os.path.exists("/usr/include/infiniband/verbs.h") or shutil.which("cc") is None:
        pytest.skip("needs a C compiler and <infiniband/verbs.h> (apt-get install libibverbs-dev)")
    defs = _defines(_source("rdma.bpf.c"))
    exprs = dict(C_OFFSETS, **{n: n for n in MASK_BITS})
    names = sorted(exprs)
    prog = "#include <stdio.h>\n#include <stddef.h>\n#include <infiniband/verbs.h>\nint main(void){\n"
    prog += "".join(f'printf("%ld\\n", (long)({exprs[n]}));\n' for n in names) + "return 0;}\n"
    (tmp_path / "off.c").write_text(prog)
    subprocess.run(["cc", "-o", str(tmp_path / "off"), str(tmp_path / "off.c")], check=True)
    got = dict(zip(names, map(int, subprocess.run([str(tmp_path / "off")], check=True, capture_output=True,
                                                  text=True).stdout.split())))
    assert {n: got[n] for n in C_OFFSETS} == {n: int(defs[n].split()[0]) for n in C_OFFSETS}
    assert {n: got[n] for n in MASK_BITS} == MASK_BITS
    bpf_bits = {n: 1 << int(re.fullmatch(r"\(1 << (\d+)\)", defs[n]).group(1)) for n in MASK_BITS}
    assert bpf_bits == MASK_BITS


# -- the translator -------------------------------------------------------------------------------

def _rec(cls, kind, tgid=42, ts=1000, **fields):
    r = cls()
    r.hdr.kind, r.hdr.version, r.hdr.size = kind, records.REC_VERSION, ct.sizeof(cls)
    r.hdr.ts_ns, r.hdr.tgid, r.hdr.tid = ts, tgid, tgid
    for k, v in fields.items():
        if k == "dgid":
            ct.memmove(ct.addressof(r) + type(r).dgid.offset, v, 16)
        else:
            setattr(r, k, v)
    kinds = rdma.RdmaFamily.KINDS
    row = np.frombuffer(bytes(r).ljust(kinds.rec_size, b"\0"), np.uint8).reshape(1, kinds.rec_size).copy()
    good, got = kinds.check(row, {})
    assert got.tolist() == [kind]
    return kinds.record(good[0])


def _modify(**kw):
    base = dict(qp=0x1000, qp_num=77, attr_mask=0, state=-1, dest_qp_num=-1, dlid=-1, port=-1, ah_port=-1,
                is_global=0, dev=b"mlx5_0")
    base.update(kw)
    return _rec(rdma.QpModify, rdma.QP_MODIFY, **base)


def test_translator_maps_each_record():
    out = []
    tr = rdma.RdmaTranslator(out.append)
    tr.add_process(42, rank=3, job="j")
    gid = bytes.fromhex("fe800000000000000002c90300a1b2c3")
    tr(rdma.QP_CREATE, _rec(rdma.QpCreate, rdma.QP_CREATE, pd=0x10, qp_type=2, dev=b"mlx5_0"))
    tr(rdma.QP_MODIFY, _modify(state=1, port=1))
    tr(rdma.QP_MODIFY, _modify(state=2, dest_qp_num=0xABCDEF, dlid=0x17, ah_port=2, is_global=1, dgid=gid))
    tr(rdma.QP_MODIFY, _modify(state=2, dest_qp_num=5, dlid=9, ah_port=1, port=2, is_global=0, dgid=gid))
    tr(rdma.QP_MODIFY, _modify(state=42))
    tr(rdma.QP_DESTROY, _rec(rdma.QpDestroy, rdma.QP_DESTROY, qp=0x1000, qp_num=77))
    assert [(e.call, e.qp_num, e.state, e.dest_qp_num, e.dgid, e.dlid, e.port) for e in out] == [
        ("ibv_create_qp", -1, "", -1, "", -1, -1),
        ("ibv_modify_qp", 77, "INIT", -1, "", -1, 1),
        ("ibv_modify_qp", 77, "RTR", 0xABCDEF, gid.hex(), 0x17, 2),   # port from ah_attr when IBV_QP_PORT is unset
        ("ibv_modify_qp", 77, "RTR", 5, "", 9, 2),                    # attr->port_num wins; no GRH -> no GID
        ("ibv_modify_qp", 77, "state42", -1, "", -1, -1),              # a state newer than this table
        ("ibv_destroy_qp", 77, "", -1, "", -1, -1),
    ]
    assert all((e.pid, e.rank, e.ts_ns) == (42, 3, 1000) for e in out)


def test_translator_drops_unknown_processes_and_forgets():
    out = []
    tr = rdma.RdmaTranslator(out.append)
    tr(rdma.QP_MODIFY, _modify())
    tr.add_process(42, rank=0, job="j")
    tr.forget(42)
    tr(rdma.QP_MODIFY, _modify())
    assert out == [] and tr.unmatched == 2


# -- symbol versions ------------------------------------------------------------------------------

def _elf(symbols, versions=None) -> bytes:
    """A minimal little-endian ELF64 with .dynsym (+ .dynstr, + .gnu.version when `versions`)."""
    strtab = b"\0"
    syms = bytes(24)  # index 0: the null symbol
    for name, value, defined in symbols:
        syms += struct.pack("<IBBHQQ", len(strtab), 0x12, 0, 13 if defined else 0, value, 8)
        strtab += name.encode() + b"\0"
    sections = [(0, b""), (3, strtab), (11, syms)]  # (type, data); dynsym links to section 1
    if versions is not None:
        sections.append((0x6FFFFFFF, struct.pack(f"<{len(versions) + 1}H", 0, *versions)))
    data = bytearray(64)
    offsets = []
    for _, blob in sections:
        offsets.append(len(data))
        data += blob
    shoff = len(data)
    for (typ, blob), off in zip(sections, offsets):
        data += struct.pack("<IIQQQQIIQQ", 0, typ, 0, 0, off, len(blob), 1 if typ == 11 else 0, 0, 8,
                            24 if typ == 11 else 0)
    data[:64] = struct.pack("<16sHHIQQQIHHHHHH", b"\x7fELF\x02\x01\x01" + bytes(9), 3, 62, 1, 0, 0, shoff,
                            0, 64, 56, 0, 64, len(sections), 0)
    return bytes(data)


def test_default_versions_only(tmp_path):
    lib = tmp_path / "lib.so"
    # ibv_modify_qp@IBVERBS_1.0 (hidden, index 2) and @@IBVERBS_1.1 (index 3); an unversioned-global one;
    # an undefined reference that must not count.
    lib.write_bytes(_elf([("ibv_modify_qp", 0x100, True), ("ibv_modify_qp", 0x200, True),
                          ("ibv_create_qp", 0x300, True), ("ibv_destroy_qp", 0, False)],
                         versions=[0x8002, 3, 1, 0]))
    assert elfver.default_symbol_addresses(str(lib), ["ibv_modify_qp", "ibv_create_qp", "ibv_destroy_qp"]) == {
        "ibv_modify_qp": {0x200}, "ibv_create_qp": {0x300}}


def test_no_version_table_means_all_default(tmp_path):
    lib = tmp_path / "lib.so"
    lib.write_bytes(_elf([("f", 0x10, True), ("g", 0x20, True)]))
    assert elfver.default_symbol_addresses(str(lib), ["f", "g", "h"]) == {"f": {0x10}, "g": {0x20}}


@pytest.mark.parametrize("blob", [b"", b"not an elf file at all" * 4, b"\x7fELF\x01\x01" + bytes(80)],
                         ids=["empty", "text", "elf32"])
def test_not_elf64_is_a_value_error(tmp_path, blob):
    lib = tmp_path / "lib.so"
    lib.write_bytes(blob)
    with pytest.raises(ValueError):
        elfver.default_symbol_addresses(str(lib), ["f"])


def test_plan_keeps_default_versions_and_refuses_ambiguity(tmp_path, monkeypatch):
    """RdmaFamily._plan over the loader's plan: compat entries dropped; when versions cannot be read,
    a name with two addresses is reported missing rather than probed twice."""
    fam = rdma.RdmaFamily(lambda k, r: None)
    found = [("ibv_modify_qp", 0x100), ("ibv_modify_qp", 0x200), ("ibv_create_qp", 0x300),
             ("ibv_destroy_qp", 0x400)]

    from ccld.bpf import elfsyms
    monkeypatch.setattr(elfsyms, "functions", lambda lib, pattern: list(found))
    lib = tmp_path / "libibverbs.so.1.0"
    lib.write_bytes(_elf([(s, a, True) for s, a in found], versions=[0x8002, 3, 3, 3]))
    points, missing = fam._plan(str(lib))
    assert sorted((s, a) for s, a, _ in points) == [("ibv_create_qp", 0x300), ("ibv_destroy_qp", 0x400),
                                                    ("ibv_modify_qp", 0x200)]
    assert missing == []
    bad = tmp_path / "libibverbs.so.1.1"
    bad.write_bytes(b"garbage")
    points, missing = fam._plan(str(bad))
    assert sorted(s for s, _, _ in points) == ["ibv_create_qp", "ibv_destroy_qp"]
    assert missing == ["ibv_modify_qp"]
