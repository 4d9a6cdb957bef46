"""The function symbols of a shared library whose names match a regex, with their addresses, read
from the ELF file without bcc (what bcc's BPF.get_user_functions_and_addresses lists, same pairs).

Both symbol tables count (.symtab when the file has one, and .dynsym), as in bcc: a symbol is listed
once per table that holds it. Listed: functions (STT_FUNC) and indirect functions (STT_GNU_IFUNC)
with a name and a non-zero value, defined in a section. Addresses are st_value (virtual addresses in
the file's own layout); elfcode.file_offset() turns one into the offset the uprobe PMU takes.

libtorch_cpu.so has ~600,000 symbols and 76 MiB of names: the tables are read as numpy arrays off
an mmap (only the pages of the tables are touched), the function symbols picked out with array
operations, and the names cut out of the string table a chunk at a time by splits at its NULs, so
the regex is the only per-name step, and the pass's memory stays a few MiB. Only 64-bit little-endian ELF; anything else is a ValueError naming the
file.
"""
from __future__ import annotations

import mmap
import re
import struct
from typing import Dict, List, Tuple

import numpy as np

SHT_SYMTAB, SHT_DYNSYM = 2, 11
STT_FUNC, STT_GNU_IFUNC = 2, 10
SHN_UNDEF = 0
MAX_SECTIONS = 1 << 16  # real libraries have ~40 sections; more is a damaged file
CHUNK_BYTES = 1 << 20   # string table read and split this much at a time (bounds the pass's memory)

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
                 ("value", "<u8"), ("size", "<u8")])


def _header(path: str, mm) -> tuple:
    if len(mm) < _EHDR.size or mm[:4] != b"\x7fELF" or mm[4] != 2 or mm[5] != 1:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
    return _EHDR.unpack_from(mm, 0)


def _section(path: str, mm, off: int, size: int) -> memoryview:
    if off + size > len(mm):
        raise ValueError(f"{path}: a section runs past the end of the file")
    return memoryview(mm)[off:off + size]


def _matching(mm, base: int, size: int, rx: "re.Pattern[bytes]", offsets: np.ndarray) -> Dict[int, bytes]:
    """index in `offsets` (sorted string-table offsets) -> the NUL-terminated name there, for the
    names that match `rx`; the string table is `size` bytes at `base` of `mm`.

    A chunk of the table at a time (CHUNK_BYTES, cut after a NUL) is split at its NULs and every
    string matched (C loops both); the chunk's strings are then dropped, so the pass holds a few
    MiB however large the table (a whole-table split of libtorch's 76 MiB kept ~35 MiB resident
    after it, as fragments the allocator could not hand back). A linker that merges tails (GNU ld)
    points some names into another one's end: those few are cut out of the string that holds them
    and matched one by one."""
    out: Dict[int, bytes] = {}
    pos = 0
    while pos < size:
        end = min(pos + CHUNK_BYTES, size)
        if end < size:
            cut = mm.rfind(b"\0", base + pos, base + end)
            if cut < 0:  # one string longer than a chunk: take it whole
                cut = mm.find(b"\0", base + end, base + size)
            end = size if cut < 0 else cut - base + 1
        lo, hi = np.searchsorted(offsets, [pos, end])
        if hi > lo:
            pieces = mm[base + pos:base + end].split(b"\0")
            starts = np.zeros(len(pieces), np.int64)
            np.cumsum(np.fromiter(map(len, pieces[:-1]), np.int64, len(pieces) - 1) + 1, out=starts[1:])
            hits = np.fromiter((i for i, m in enumerate(map(rx.match, pieces)) if m), np.int64)
            rel = offsets[lo:hi] - pos
            at = np.searchsorted(starts, rel, side="right") - 1
            inside = rel - starts[at]
            for j in np.flatnonzero((inside == 0) & np.isin(at, hits)).tolist():
                out[lo + j] = pieces[at[j]]
            for j in np.flatnonzero(inside != 0).tolist():
                name = pieces[at[j]][inside[j]:]
                if rx.match(name):
                    out[lo + j] = name
            del pieces
        pos = end
    return out


def functions(path: str, pattern: str) -> List[Tuple[str, int]]:
    """(name, address) of each function symbol of `path` whose name re.match()es `pattern`, per
    symbol table (a name in both is listed twice, as bcc lists it). OSError when the file cannot be
    read, ValueError when it is no ELF64 file this reads."""
    rx = re.compile(pattern.encode())
    out: List[Tuple[str, int]] = []
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        eh = _header(path, mm)
        shoff, shentsize, shnum = eh[6], eh[11], eh[12]
        if shnum == 0 or shnum > MAX_SECTIONS or shentsize != _SHDR.size:
            raise ValueError(f"{path}: no usable section header table")
        shdrs = [_SHDR.unpack_from(mm, shoff + i * shentsize) for i in range(shnum)
                 if shoff + (i + 1) * shentsize <= len(mm)]
        for sh in shdrs:
            if sh[1] not in (SHT_SYMTAB, SHT_DYNSYM) or sh[6] >= len(shdrs):
                continue
            strtab = shdrs[sh[6]]
            if strtab[4] + strtab[5] > len(mm):
                raise ValueError(f"{path}: a string table runs past the end of the file")
            syms = np.frombuffer(_section(path, mm, sh[4], sh[5] - sh[5] % _SYM.itemsize), _SYM)
            kind = syms["info"] & 0xF
            keep = (((kind == STT_FUNC) | (kind == STT_GNU_IFUNC)) & (syms["value"] != 0)
                    & (syms["shndx"] != SHN_UNDEF) & (syms["name"] != 0) & (syms["name"] < strtab[5]))
            name_at, value = syms["name"][keep].astype(np.int64), syms["value"][keep]
            del syms, kind, keep  # views of the mmap: gone before it closes
            offsets, which = np.unique(name_at, return_inverse=True)
            names = _matching(mm, strtab[4], strtab[5], rx, offsets)
            hit = np.zeros(len(offsets), bool)
            hit[list(names)] = True
            for i in np.flatnonzero(hit[which]).tolist():
                out.append((names[int(which[i])].decode(errors="replace"), int(value[i])))
    return out
