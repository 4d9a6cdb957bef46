"""A loaded program's maps as the families use them (`prog[b"name"]`): item get/set/delete with
ctypes keys and values, `.Key`/`.Leaf`, `.map_fd`, `.max_entries`, iteration; bcc's table API, the
part ccld uses, over sysbpf's system calls.

Key and value types come from the descriptions bcc's compiler writes of them, which the program
cache keeps (progcache.describe): a C type name ("unsigned int"), or [name, fields, "struct" |
"struct_packed" | "union"] whose fields are [name, type], [name, type, [N]] (an array of N),
[name, type, BITS] (a bit field) or a nested struct/union description (anonymous when its name is
""). decode_type() turns one into a ctypes type; a description it does not know is a ValueError
(a bad cache file: the program is compiled again).
Per-CPU maps hold one value per possible CPU, each padded to 8 bytes: their `Leaf` is that array
(a zero `Leaf()` resets every CPU's value), a read returns it (sum() it for a total).
"""
from __future__ import annotations

import ctypes as ct
import json
from typing import Any, Dict, Iterator, List, Tuple

from ccld.bpf import sysbpf

HASH, ARRAY, PERCPU_HASH, PERCPU_ARRAY, LRU_HASH, LRU_PERCPU_HASH, RINGBUF = 1, 2, 5, 6, 9, 10, 27
ARRAYS = (ARRAY, PERCPU_ARRAY)
PER_CPU = (PERCPU_HASH, PERCPU_ARRAY, LRU_PERCPU_HASH)
KNOWN = (HASH, ARRAY, PERCPU_HASH, PERCPU_ARRAY, LRU_HASH, LRU_PERCPU_HASH, RINGBUF)
POSSIBLE_CPUS = "/sys/devices/system/cpu/possible"

C_TYPES: Dict[str, Any] = {
    "_Bool": ct.c_bool, "char": ct.c_char, "signed char": ct.c_byte, "unsigned char": ct.c_ubyte,
    "short": ct.c_short, "unsigned short": ct.c_ushort, "int": ct.c_int, "unsigned int": ct.c_uint,
    "long": ct.c_long, "unsigned long": ct.c_ulong, "long long": ct.c_longlong,
    "unsigned long long": ct.c_ulonglong, "float": ct.c_float, "double": ct.c_double,
    "long double": ct.c_longdouble, "__int128": ct.c_int64 * 2, "unsigned __int128": ct.c_uint64 * 2,
}
KINDS = {"struct": (ct.Structure, False), "struct_packed": (ct.Structure, True), "union": (ct.Union, False)}


def decode_type(desc: Any) -> Any:
    """The ctypes type of one of bcc's type descriptions (parsed JSON; see the module's text)."""
    if isinstance(desc, str):
        if desc not in C_TYPES:
            raise ValueError(f"unknown C type {desc!r}")
        return C_TYPES[desc]
    if not (isinstance(desc, list) and len(desc) >= 2 and isinstance(desc[0], str) and isinstance(desc[1], list)):
        raise ValueError(f"not a type description: {desc!r}")
    base, packed = KINDS.get(desc[2] if len(desc) > 2 else "struct", (None, False))
    if base is None:
        raise ValueError(f"{desc[0]}: unknown aggregate kind {desc[2]!r}")
    fields: List[tuple] = []
    anon: List[str] = []
    for f in desc[1]:
        if not isinstance(f, list) or len(f) not in (2, 3) or not isinstance(f[0], str):
            raise ValueError(f"{desc[0]}: bad field {f!r}")
        if len(f) == 2:
            fields.append((f[0], decode_type(f[1])))
        elif isinstance(f[2], list) and len(f[2]) == 1 and isinstance(f[2][0], int):
            fields.append((f[0], decode_type(f[1]) * f[2][0]))
        elif isinstance(f[2], int) and not isinstance(f[2], bool):
            fields.append((f[0], decode_type(f[1]), f[2]))          # a bit field of f[2] bits
        elif f[2] in KINDS:
            name = f[0] or f"__anon{len(anon)}"
            if not f[0]:
                anon.append(name)
            fields.append((name, decode_type(f)))
        else:
            raise ValueError(f"{desc[0]}: bad field {f!r}")
    body: Dict[str, Any] = {"_fields_": fields, "_anonymous_": anon}
    if packed:
        body["_pack_"] = 1
    return type(desc[0], (base,), body)


def possible_cpus() -> int:
    """How many CPUs this kernel may bring up: the per-CPU value count of per-CPU maps."""
    with open(POSSIBLE_CPUS) as f:
        text = f.read().strip()
    n = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        n = max(n, int(hi or lo) + 1)
    return n


def _per_cpu_leaf(elem: Any, ncpus: int) -> Any:
    """The value type of a per-CPU map: `elem` per CPU, each padded to 8 bytes (as the kernel copies
    them); a 4-byte integer is read as its 8-byte slot (its high half is the padding: zero)."""
    if ct.sizeof(elem) % 8 == 0:
        return elem * ncpus
    if elem in (ct.c_int, ct.c_uint):
        return (ct.c_int64 if elem is ct.c_int else ct.c_uint64) * ncpus
    raise ValueError(f"a per-CPU value of {ct.sizeof(elem)} bytes is not a multiple of 8")


class Map:
    """One map of a loaded program (made by program.Program from its description)."""

    def __init__(self, name: str, fd: int, desc: Dict[str, Any]):
        self.name, self.map_fd, self.ttype = name, fd, int(desc["type"])
        self.max_entries = int(desc["max_entries"])
        self.flags = int(desc.get("flags", 0))
        if self.ttype not in KNOWN:
            raise ValueError(f"map {name}: type {self.ttype} is not one this loader knows")
        self.Key = decode_type(json.loads(desc["key_desc"])) if desc.get("key_desc") else ct.c_int
        leaf = decode_type(json.loads(desc["leaf_desc"])) if desc.get("leaf_desc") else ct.c_int
        self.sLeaf = leaf
        self.Leaf = _per_cpu_leaf(leaf, possible_cpus()) if self.ttype in PER_CPU else leaf
        if self.ttype != RINGBUF:
            for what, t, size in (("key", self.Key, desc["key_size"]), ("value", leaf, desc["leaf_size"])):
                if ct.sizeof(t) != int(size):
                    raise ValueError(f"map {name}: its {what} type is {ct.sizeof(t)} bytes, the map's {size}")

    def _key(self, key: Any) -> Any:
        if isinstance(key, int):
            key = self.Key(key)
        if self.ttype in ARRAYS and not 0 <= int(getattr(key, "value", 0)) < self.max_entries:
            raise IndexError(f"{self.name}: index {key.value} out of range")
        return key

    def __getitem__(self, key: Any) -> Any:
        value = self.Leaf()
        if not sysbpf.map_lookup(self.map_fd, self._key(key), value):
            raise KeyError(key)
        return value

    def __setitem__(self, key: Any, value: Any) -> None:
        sysbpf.map_update(self.map_fd, self._key(key), value)

    def __delitem__(self, key: Any) -> None:
        key = self._key(key)
        if self.ttype in ARRAYS:  # an array's entries cannot go: zeroed, as bcc does
            self[key] = self.Leaf()
        elif not sysbpf.map_delete(self.map_fd, key):
            raise KeyError(key)

    def keys(self) -> Iterator[Any]:
        """Every key, by BPF_MAP_GET_NEXT_KEY (a concurrent delete may end the walk early)."""
        key = None
        while True:
            nxt = self.Key()
            if not sysbpf.map_next_key(self.map_fd, key, nxt):
                return
            yield nxt
            key = nxt

    __iter__ = keys

    def items(self) -> List[Tuple[Any, Any]]:
        out = []
        for k in self.keys():
            try:
                out.append((k, self[k]))
            except KeyError:  # deleted meanwhile
                pass
        return out

    def values(self) -> List[Any]:
        return [v for _, v in self.items()]

    def items_lookup_batch(self) -> List[Tuple[Any, Any]]:
        """items() in BPF_MAP_LOOKUP_BATCH calls (mapread.BatchReader), as ctypes keys and values."""
        from ccld.bpf.mapread import BatchReader
        keys, vals = BatchReader(self).read()
        return [(self.Key.from_buffer_copy(k.tobytes()), self.Leaf.from_buffer_copy(v.tobytes()))
                for k, v in zip(keys, vals)]
