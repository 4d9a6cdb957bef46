"""Machine code of a function in a shared library, read from the ELF file (not from a process).

`code_at(path, vaddr, n)` returns n bytes at virtual address vaddr (a symbol's st_value, as bcc's
get_user_functions_and_addresses reports it), found through the PT_LOAD program header that maps it.
Used to read a field offset off a tiny accessor's instructions (gloo.py: nextTag), so no struct layout
is assumed. `segments()` is the one reader of program headers here; `file_offset()` turns a symbol's
address into the file offset a uprobe is placed at (program.py). Only 64-bit little-endian ELF; anything else, or an address no segment maps, is a
ValueError naming the file.
"""
from __future__ import annotations

import struct
from typing import BinaryIO, List, NamedTuple, Optional

PT_LOAD, PF_X = 1, 1
MAX_PHDRS = 4096   # real libraries have ~10 program headers; more is a damaged file
MAX_CODE = 4096    # bytes read at once: accessors are a few dozen

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_PHDR = struct.Struct("<IIQQQQQQ")


class Segment(NamedTuple):
    """One PT_LOAD program header: where a part of the file is mapped."""
    flags: int
    offset: int
    vaddr: int
    filesz: int
    memsz: int


def segments(path: str, f: Optional[BinaryIO] = None) -> List[Segment]:
    """The loadable segments of ELF file `path` (read from `f` when given), in header order."""
    if f is None:
        with open(path, "rb") as g:
            return segments(path, g)
    f.seek(0)
    head = f.read(_EHDR.size)
    if len(head) < _EHDR.size or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
    e = _EHDR.unpack(head)
    phoff, phentsize, phnum = e[5], e[9], e[10]
    if phentsize < _PHDR.size or phnum > MAX_PHDRS:
        raise ValueError(f"{path}: implausible program headers ({phnum} of {phentsize} bytes)")
    f.seek(phoff)
    table = f.read(phentsize * phnum)
    out = []
    for i in range(min(phnum, len(table) // phentsize)):
        p_type, p_flags, p_offset, p_vaddr, _paddr, p_filesz, p_memsz, _align = _PHDR.unpack_from(table, i * phentsize)
        if p_type == PT_LOAD:
            out.append(Segment(p_flags, p_offset, p_vaddr, p_filesz, p_memsz))
    return out


def code_at(path: str, vaddr: int, n: int) -> bytes:
    if not 0 < n <= MAX_CODE:
        raise ValueError(f"{path}: asked for {n} bytes of code")
    with open(path, "rb") as f:
        for seg in segments(path, f):
            if seg.vaddr <= vaddr and vaddr + n <= seg.vaddr + seg.filesz:
                f.seek(seg.offset + vaddr - seg.vaddr)
                got = f.read(n)
                if len(got) == n:
                    return got
                break
    raise ValueError(f"{path}: no loadable segment holds {n} bytes at {vaddr:#x}")


def file_offset(path: str, addr: int) -> int:
    """The file offset of virtual address `addr` (a symbol's st_value): where the uprobe PMU wants
    a probe (its config2). Through the executable segment that maps it, as bcc's
    bcc_resolve_symname does; a ValueError when none does."""
    for seg in segments(path):
        if seg.flags & PF_X and seg.vaddr <= addr < seg.vaddr + seg.memsz:
            return addr - seg.vaddr + seg.offset
    raise ValueError(f"{path}: no executable segment maps address {addr:#x}")
