"""Which of a shared library's same-named symbols is the one a program links to (its default version).

Libraries with symbol versioning export old ABI variants under the same name: libibverbs has
`ibv_modify_qp@IBVERBS_1.0` (a compat entry taking the 1.0 struct layout) beside the default
`ibv_modify_qp@@IBVERBS_1.1`. bcc lists both as "ibv_modify_qp", so probing by name alone would hit
both (and read the compat one's arguments with the wrong layout). The default version is the one
whose .gnu.version entry lacks the "hidden" bit; this reads just enough ELF (section headers,
.dynsym, its string table, .gnu.version) to tell, seeking instead of reading the whole file.
Addresses are st_value, as bcc's get_user_functions_and_addresses reports them.
"""
from __future__ import annotations

import struct
from typing import BinaryIO, Dict, Iterable, Set

SHT_DYNSYM = 11
SHT_GNU_VERSYM = 0x6FFFFFFF
VERSYM_HIDDEN = 0x8000     # a non-default version: reachable only by `name@VERSION`
SHN_UNDEF = 0
MAX_SECTION_BYTES = 64 << 20  # .dynsym of the largest libraries (libtorch) is a few MiB; more is a broken file

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")


def _read(f: BinaryIO, off: int, size: int) -> bytes:
    if size > MAX_SECTION_BYTES:
        raise ValueError(f"section of {size} bytes is implausibly large")
    f.seek(off)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("file is shorter than its section headers say")
    return data


def default_symbol_addresses(path: str, names: Iterable[str]) -> Dict[str, Set[int]]:
    """name -> addresses of its defined, default-version dynamic symbols (unversioned ones count as
    default). Names the library does not define are absent. Raises ValueError when `path` is not a
    little-endian ELF64 file, OSError when it cannot be read."""
    wanted = set(names)
    with open(path, "rb") as f:
        eh = _EHDR.unpack(_read(f, 0, _EHDR.size))
        ident, shoff, shentsize, shnum = eh[0], eh[6], eh[11], eh[12]
        if ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
            raise ValueError("not a little-endian ELF64 file")
        if shentsize != _SHDR.size or shnum == 0:
            raise ValueError("no usable section header table")
        shdrs = [_SHDR.unpack_from(_read(f, shoff + i * shentsize, shentsize)) for i in range(shnum)]
        dynsym = next((s for s in shdrs if s[1] == SHT_DYNSYM), None)
        if dynsym is None:
            return {}
        versym = next((s for s in shdrs if s[1] == SHT_GNU_VERSYM), None)
        if dynsym[6] >= len(shdrs):
            raise ValueError(".dynsym links to a string table that does not exist")
        strtab = shdrs[dynsym[6]]
        syms = _read(f, dynsym[4], dynsym[5])
        strs = _read(f, strtab[4], strtab[5])
        vers = _read(f, versym[4], versym[5]) if versym is not None else b""
    out: Dict[str, Set[int]] = {}
    for i in range(len(syms) // _SYM.size):
        st_name, _info, _other, shndx, value, _size = _SYM.unpack_from(syms, i * _SYM.size)
        if shndx == SHN_UNDEF or st_name >= len(strs):
            continue
        end = strs.find(b"\0", st_name)
        name = strs[st_name:end if end >= 0 else len(strs)].decode(errors="replace")
        if name not in wanted:
            continue
        if len(vers) >= 2 * (i + 1) and struct.unpack_from("<H", vers, 2 * i)[0] & VERSYM_HIDDEN:
            continue
        out.setdefault(name, set()).add(value)
    return out
