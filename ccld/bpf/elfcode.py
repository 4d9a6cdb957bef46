"""Machine code of a function in a shared library, read from the ELF file (not from a process).

`code_at(path, vaddr, n)` returns n bytes at virtual address vaddr (a symbol's st_value, as bcc's
get_user_functions_and_addresses reports it), found through the PT_LOAD program header that maps it.
Used to read a field offset off a tiny accessor's instructions (gloo.py: nextTag), so no struct layout
is assumed. Only 64-bit little-endian ELF; anything else, or an address no segment maps, is a
ValueError naming the file.
"""
from __future__ import annotations

import struct

PT_LOAD = 1
MAX_PHDRS = 4096   # real libraries have ~10 program headers; more is a damaged file
MAX_CODE = 4096    # bytes read at once: accessors are a few dozen

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_PHDR = struct.Struct("<IIQQQQQQ")


def code_at(path: str, vaddr: int, n: int) -> bytes:
    if not 0 < n <= MAX_CODE:
        raise ValueError(f"{path}: asked for {n} bytes of code")
    with open(path, "rb") as f:
        head = f.read(_EHDR.size)
        if len(head) < _EHDR.size or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
        e = _EHDR.unpack(head)
        phoff, phentsize, phnum = e[5], e[9], e[10]
        if phentsize < _PHDR.size or phnum > MAX_PHDRS:
            raise ValueError(f"{path}: implausible program headers ({phnum} of {phentsize} bytes)")
        f.seek(phoff)
        table = f.read(phentsize * phnum)
        for i in range(phnum):
            chunk = table[i * phentsize:i * phentsize + _PHDR.size]
            if len(chunk) < _PHDR.size:
                break
            p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz, _memsz, _align = _PHDR.unpack(chunk)
            if p_type == PT_LOAD and p_vaddr <= vaddr and vaddr + n <= p_vaddr + p_filesz:
                f.seek(p_offset + vaddr - p_vaddr)
                got = f.read(n)
                if len(got) == n:
                    return got
                break
    raise ValueError(f"{path}: no loadable segment holds {n} bytes at {vaddr:#x}")
