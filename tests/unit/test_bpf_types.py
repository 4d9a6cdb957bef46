"""maps.decode_type: bcc's descriptions of map key and value types, as the program cache keeps them
(the strings below are copied from real cache files of this kernel's programs), become ctypes types
of the map's key and value sizes with the fields the C structs have; the forms no ccld program uses
yet (unions, bit fields, anonymous members) decode as bcc decodes them; a bad description is a
ValueError. No root: nothing is loaded."""
import ctypes as ct
import json

import pytest

from ccld.bpf import maps

pytestmark = pytest.mark.unit

# (key_desc, leaf_desc, key_size, leaf_size) of maps in real cache files (gloo, net, sched, nccl)
CACHED = {
    "works": ('["work_key", [["tgid","unsigned int"], ["pad","unsigned int"], ["ptr","unsigned long long"] ], '
              '"struct_packed"]',
              '["work_val", [["pg","unsigned long long"], ["seq","unsigned long long"], ["enter_ns","unsigned long long"],'
              ' ["lib_seq","unsigned long long"], ["tid","unsigned int"], ["op","int"], ["covered","unsigned char"], '
              '["pad","unsigned char", [7]] ], "struct_packed"]', 16, 48),
    "exec_inflight": ('"unsigned int"',
                      '["exec_state", [["work","unsigned long long"], ["start_ns","unsigned long long"], '
                      '["min_bytes","unsigned long long"], ["total_bytes","unsigned long long"], ["nbufs","unsigned int"],'
                      ' ["state","unsigned char"], ["pad","unsigned char", [3]] ], "struct_packed"]', 4, 40),
    "conns": ('"unsigned long long"',
              '["conn", [["tgid","unsigned int"], ["family","unsigned short"], ["sport","unsigned short"], '
              '["dport","unsigned short"], ["pad","unsigned short"], ["state","int"], ["saddr","unsigned char", [16]], '
              '["daddr","unsigned char", [16]], ["tx_bytes","unsigned long long"], ["rx_bytes","unsigned long long"], '
              '["tx_calls","unsigned long long"], ["rx_calls","unsigned long long"], ["tx_errs","unsigned long long"], '
              '["rx_errs","unsigned long long"], ["retrans","unsigned long long"], ["resets","unsigned long long"], '
              '["srtt_us","unsigned long long"], ["cwnd","unsigned long long"], ["last_tx_ns","unsigned long long"], '
              '["last_rx_ns","unsigned long long"] ], "struct_packed"]', 8, 144),
    "signals": ('"int"', '["fatal_signal", [["ts_ns","unsigned long long"], ["sender","unsigned int"], ["sig","int"] ], '
                '"struct_packed"]', 4, 16),
    "init_inflight": ('"unsigned int"',
                      '["init_entry", [["commp","unsigned long long"], ["parent","unsigned long long"], '
                      '["idhash","unsigned long long"], ["enter_ns","unsigned long long"], ["fn","int"], ["nranks","int"],'
                      ' ["rank","int"], ["color","int"], ["key","int"], ["pad","unsigned int"] ], "struct_packed"]', 4, 56),
    "traced": ('"unsigned int"', '"unsigned char"', 4, 1),
}


@pytest.mark.parametrize("name", sorted(CACHED))
def test_cached_descriptions_decode_to_the_maps_sizes(name):
    key_desc, leaf_desc, key_size, leaf_size = CACHED[name]
    key, leaf = maps.decode_type(json.loads(key_desc)), maps.decode_type(json.loads(leaf_desc))
    assert (ct.sizeof(key), ct.sizeof(leaf)) == (key_size, leaf_size)


def test_struct_fields_keep_their_names_order_and_types():
    work_val = maps.decode_type(json.loads(CACHED["works"][1]))
    assert [f[0] for f in work_val._fields_] == ["pg", "seq", "enter_ns", "lib_seq", "tid", "op", "covered", "pad"]
    assert work_val.pad.size == 7 and work_val.op.offset == 36
    v = work_val(seq=5, op=-2)
    assert (v.seq, v.op, bytes(v.pad)) == (5, -2, b"\0" * 7)
    conn = maps.decode_type(json.loads(CACHED["conns"][1]))
    assert conn.saddr.offset == 16 and conn.tx_bytes.offset == 48


def test_unions_bit_fields_and_anonymous_members_decode_as_bccs():
    desc = ["outer", [["a", "unsigned int", 3], ["b", "unsigned int", 29],
                      ["", [["x", "unsigned long long"], ["y", "int"]], "union"],
                      ["inner", [["c", "char"], ["d", "long long"]], "struct"]], "struct"]
    t = maps.decode_type(desc)
    v = t(a=5, b=7, x=0x1_0000_0001)
    assert (v.a, v.b, v.x, v.y) == (5, 7, 0x1_0000_0001, 1)  # the anonymous union's members are the struct's
    assert ct.sizeof(t) == 4 + 4 + 8 + 16  # not packed: inner is aligned to 8


def test_packed_and_unpacked_structs_differ_only_in_padding():
    fields = [["c", "unsigned char"], ["q", "unsigned long long"]]
    assert ct.sizeof(maps.decode_type(["p", fields, "struct_packed"])) == 9
    assert ct.sizeof(maps.decode_type(["p", fields, "struct"])) == 16


@pytest.mark.parametrize("bad", ["unsigned whatever", ["x"], ["x", [["f"]], "struct"], ["x", [], "class"],
                                 ["x", [["f", "int", "wide"]], "struct"]])
def test_a_bad_description_is_a_value_error(bad):
    with pytest.raises(ValueError):
        maps.decode_type(bad)


def test_per_cpu_values_are_padded_to_8_bytes_per_cpu():
    assert maps._per_cpu_leaf(ct.c_ulonglong, 3) == ct.c_ulonglong * 3
    assert ct.sizeof(maps._per_cpu_leaf(ct.c_uint, 3)) == 24
    stats = maps.decode_type(["s", [["a", "unsigned long long"], ["b", "unsigned long long"]], "struct_packed"])
    assert ct.sizeof(maps._per_cpu_leaf(stats, 2)) == 32
    with pytest.raises(ValueError):
        maps._per_cpu_leaf(maps.decode_type(["odd", [["c", "unsigned char", [12]]], "struct"]), 2)


def test_a_map_whose_types_do_not_match_its_sizes_is_refused():
    desc = {"type": maps.HASH, "key_size": 8, "leaf_size": 4, "max_entries": 1, "flags": 0,
            "key_desc": '"unsigned int"', "leaf_desc": '"unsigned int"'}
    with pytest.raises(ValueError, match="key type is 4 bytes"):
        maps.Map("m", -1, desc)
