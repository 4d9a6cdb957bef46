"""Member offsets of kernel structs, read from the running kernel's BTF (/sys/kernel/btf/vmlinux).

The network probes read a few fields of `struct sock` (ports, addresses, family). The kernel headers
bcc compiles against here are Debian's for another kernel version, so their struct layouts cannot be
trusted; BTF describes the kernel that is actually running. This is a small reader of the BTF format
(include/uapi/linux/btf.h): a header, a type section and a string section. It only answers "at which
byte offset is member a.b of struct S", descending through anonymous structs and unions.

Every malformed input raises BtfError naming the file and what was wrong; nothing here asserts.
"""
from __future__ import annotations

import struct
from typing import Dict, List, Optional, Tuple

from ccld.errors import CcldError

VMLINUX = "/sys/kernel/btf/vmlinux"
BTF_MAGIC = 0xEB9F
_HDR = struct.Struct("<HBBIIIII")     # magic, version, flags, hdr_len, type_off, type_len, str_off, str_len
_TYPE = struct.Struct("<III")         # name_off, info, size/type
_MEMBER = struct.Struct("<III")       # name_off, type, offset (bits; bitfield-encoded when kind_flag)
KIND_STRUCT, KIND_UNION = 4, 5
# Bytes that follow a btf_type, per kind: fixed part + per-vlen part (btf.h, kinds 1..19).
_EXTRA = {1: (4, 0), 2: (0, 0), 3: (12, 0), 4: (0, 12), 5: (0, 12), 6: (0, 8), 7: (0, 0), 8: (0, 0),
          9: (0, 0), 10: (0, 0), 11: (0, 0), 12: (0, 0), 13: (0, 8), 14: (4, 0), 15: (0, 12), 16: (0, 0),
          17: (4, 0), 18: (0, 0), 19: (0, 12)}


class BtfError(CcldError):
    pass


class Btf:
    """The types of one BTF blob, indexed enough to look up struct members by name."""

    def __init__(self, data: bytes, source: str = VMLINUX):
        self.source = source
        if len(data) < _HDR.size:
            raise BtfError(f"{source}: {len(data)} bytes is too short for a BTF header")
        magic, version, _flags, hdr_len, type_off, type_len, str_off, str_len = _HDR.unpack_from(data)
        if magic != BTF_MAGIC:
            raise BtfError(f"{source}: bad magic {magic:#x} (expected {BTF_MAGIC:#x}): not BTF")
        if version != 1:
            raise BtfError(f"{source}: BTF version {version} is not supported (only 1)")
        types_at, strs_at = hdr_len + type_off, hdr_len + str_off
        if types_at + type_len > len(data) or strs_at + str_len > len(data):
            raise BtfError(f"{source}: type or string section runs past the end of the file "
                           f"({len(data)} bytes)")
        self._data = data
        self._strs = data[strs_at:strs_at + str_len]
        self._offsets: List[int] = [0]  # type id -> byte offset of its btf_type; id 0 is void
        pos, end = types_at, types_at + type_len
        while pos < end:
            if pos + _TYPE.size > end:
                raise BtfError(f"{source}: type #{len(self._offsets)} is cut off at byte {pos}")
            _name, info, _size = _TYPE.unpack_from(data, pos)
            kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
            extra = _EXTRA.get(kind)
            if extra is None:
                raise BtfError(f"{source}: type #{len(self._offsets)} at byte {pos} has unknown kind {kind}")
            self._offsets.append(pos)
            pos += _TYPE.size + extra[0] + extra[1] * vlen
        if pos != end:
            raise BtfError(f"{source}: the last type overruns the type section by {pos - end} bytes")

    @classmethod
    def from_file(cls, path: str = VMLINUX) -> "Btf":
        try:
            with open(path, "rb") as f:
                return cls(f.read(), path)
        except OSError as e:
            raise BtfError(f"cannot read {path}: {e.strerror} (the kernel needs CONFIG_DEBUG_INFO_BTF)") from None

    def _name(self, off: int) -> str:
        if off >= len(self._strs):
            raise BtfError(f"{self.source}: name offset {off} is outside the string section")
        end = self._strs.find(b"\0", off)
        return self._strs[off:end if end >= 0 else len(self._strs)].decode("utf-8", "replace")

    def _type(self, tid: int) -> Tuple[int, int, int, int, int]:
        """(name_off, kind, vlen, kind_flag, byte offset) of type `tid`."""
        if not 0 < tid < len(self._offsets):
            raise BtfError(f"{self.source}: reference to type #{tid}, which does not exist")
        pos = self._offsets[tid]
        name, info, _ = _TYPE.unpack_from(self._data, pos)
        return name, (info >> 24) & 0x1F, info & 0xFFFF, info >> 31, pos

    def find_struct(self, name: str) -> int:
        """Type id of the first complete struct called `name`."""
        needle = b"\0" + name.encode() + b"\0"
        at = self._strs.find(needle)
        offs = set()
        while at >= 0:  # the same string may appear more than once in the section
            offs.add(at + 1)
            at = self._strs.find(needle, at + 1)
        for tid in range(1, len(self._offsets)):
            name_off, kind, vlen, _, _ = self._type(tid)
            if kind == KIND_STRUCT and vlen and name_off in offs:
                return tid
        raise BtfError(f"{self.source}: no struct {name!r}")

    def members(self, tid: int, base_bits: int = 0, depth: int = 0) -> Dict[str, int]:
        """Member name -> bit offset within struct/union `tid`, anonymous members flattened in."""
        if depth > 8:
            raise BtfError(f"{self.source}: anonymous members nested too deep under type #{tid}")
        _, kind, vlen, kflag, pos = self._type(tid)
        if kind not in (KIND_STRUCT, KIND_UNION):
            raise BtfError(f"{self.source}: type #{tid} is not a struct or union (kind {kind})")
        out: Dict[str, int] = {}
        for i in range(vlen):
            name_off, mtype, moff = _MEMBER.unpack_from(self._data, pos + _TYPE.size + i * _MEMBER.size)
            bits = base_bits + ((moff & 0xFFFFFF) if kflag else moff)
            name = self._name(name_off)
            if name:
                out.setdefault(name, bits)
                continue
            inner = self._resolve(mtype)
            if inner is not None:
                for k, v in self.members(inner, bits, depth + 1).items():
                    out.setdefault(k, v)
        return out

    def _resolve(self, tid: int) -> Optional[int]:
        """Follow typedef/const/volatile to a struct or union id, or None."""
        for _ in range(16):
            _, kind, _, _, pos = self._type(tid)
            if kind in (KIND_STRUCT, KIND_UNION):
                return tid
            if kind not in (8, 9, 10, 11, 18):
                return None
            tid = _TYPE.unpack_from(self._data, pos)[2]
        return None

    def offset(self, struct_name: str, member: str) -> int:
        """Byte offset of `member` in `struct_name` (anonymous unions/structs looked through)."""
        bits = self.members(self.find_struct(struct_name)).get(member)
        if bits is None:
            raise BtfError(f"{self.source}: struct {struct_name} has no member {member!r}")
        if bits % 8:
            raise BtfError(f"{self.source}: {struct_name}.{member} is a bitfield (bit {bits}), not byte-aligned")
        return bits // 8


# struct sock begins with struct sock_common __sk_common; these are read through a `struct sock *`.
SOCK_FIELDS = {"skc_daddr": "SKC_DADDR_OFF", "skc_rcv_saddr": "SKC_RCV_SADDR_OFF", "skc_dport": "SKC_DPORT_OFF",
               "skc_num": "SKC_NUM_OFF", "skc_family": "SKC_FAMILY_OFF", "skc_state": "SKC_STATE_OFF", "skc_v6_daddr": "SKC_V6_DADDR_OFF",
               "skc_v6_rcv_saddr": "SKC_V6_RCV_SADDR_OFF"}


def sock_offsets(btf: Btf) -> Dict[str, int]:
    """-D macro name -> byte offset in struct sock, for every field the net probes read."""
    base = btf.offset("sock", "__sk_common")
    common = btf.members(btf.find_struct("sock_common"))
    out = {}
    for field, macro in SOCK_FIELDS.items():
        bits = common.get(field)
        if bits is None or bits % 8:
            raise BtfError(f"{btf.source}: struct sock_common has no byte-aligned member {field!r}")
        out[macro] = base + bits // 8
    return out
