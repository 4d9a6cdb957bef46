"""The rewrite guard (bench/compare_outputs.py, bench/canonical_outputs.py): its canonical forms keep
what is content and drop only what legitimately differs between runs (order, ids, interning, the
ignored fields, float noise), and a real difference is reported, with the field that changed."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import canonical_outputs as co  # noqa: E402
import compare_outputs as guard  # noqa: E402

pytestmark = pytest.mark.unit

FINDING = {"kind": "hang", "class": "not-entered", "ranks": [1], "link": None, "comm": "h:1/gloo:0", "seq": 451,
           "op": "allreduce", "onset_at": 1795986646.7910018, "detected_at": 1795986651.9296515,
           "evidence": {"waited_s": 26.701, "ranks": [{"rank": 1, "doing": "sleeping"}]}, "stack": None,
           "id": "hang-ff45cbaa1ad9", "job": "h:1"}
RECOVERY = {"kind": "recovered", "id": "hang-ff45cbaa1ad9", "class": "not-entered", "ranks": [1], "comm": "h:1/gloo:0",
            "seq": 451, "recovered_at": 1795986660.5}


def lines(*objs):
    return [json.dumps(o) for o in objs]


def test_findings_are_a_multiset_without_the_ignored_fields_and_float_noise():
    other = dict(FINDING, stack="Thread 14237: train.py:40", onset_at=FINDING["onset_at"] + 1e-9)
    ref = co.canon_records(lines(FINDING, RECOVERY))
    new = co.canon_records(lines(RECOVERY, other) + [""])
    assert "stack" in co.IGNORED_FINDING_FIELDS and all("stack" not in f for f in ref + new)
    d = co.compare(ref, new, pair=co.finding_id)
    assert d["same"] and d["shown"] == [] and d["ref_items"] == d["new_items"] == 2


def test_a_changed_finding_is_reported_with_the_field_that_changed():
    moved = dict(FINDING, onset_at=FINDING["onset_at"] + 0.001)
    d = co.compare(co.canon_records(lines(FINDING)), co.canon_records(lines(moved)), pair=co.finding_id)
    assert not d["same"] and (d["only_ref"], d["only_new"]) == (1, 1)
    assert d["shown"][0].startswith("~ hang not-entered h:1/gloo:0 451 [1]")
    assert d["shown"][1].strip() == "onset_at: 1795986646.791002 -> 1795986646.792002"


def test_a_lost_and_a_new_finding_are_minus_and_plus():
    extra = dict(FINDING, seq=452, id="hang-other")
    d = co.compare(co.canon_records(lines(FINDING, RECOVERY)), co.canon_records(lines(FINDING, extra)),
                   pair=co.finding_id)
    assert not d["same"]
    assert [s[0] for s in d["shown"]] == ["-", "+"] and '"recovered"' in d["shown"][0] and "452" in d["shown"][1]


def chrome(flow_ids=(7, 8), order=1):
    ev = [{"ph": "M", "name": "process_name", "pid": 10, "args": {"name": "rank 0"}},
          {"ph": "X", "cat": "collective", "name": "allreduce", "pid": 10, "tid": 1, "ts": 100.5, "dur": 2.0,
           "args": {"seq": 1}},
          {"ph": "X", "cat": "collective", "name": "allreduce", "pid": 11, "tid": 1, "ts": 100.7, "dur": 1.8,
           "args": {"seq": 1}},
          {"ph": "s", "id": flow_ids[0], "cat": "flow", "name": "collective", "pid": 10, "tid": 1, "ts": 100.5},
          {"ph": "f", "id": flow_ids[0], "cat": "flow", "name": "collective", "pid": 11, "tid": 1, "ts": 100.7,
           "bp": "e"},
          {"ph": "s", "id": flow_ids[1], "cat": "flow", "name": "collective", "pid": 10, "tid": 1, "ts": 103.0},
          {"ph": "f", "id": flow_ids[1], "cat": "flow", "name": "collective", "pid": 11, "tid": 1, "ts": 103.1,
           "bp": "e"}]
    return {"traceEvents": ev[::order], "displayTimeUnit": "ns"}


def test_chrome_events_are_a_multiset_and_flows_do_not_depend_on_their_ids():
    ref, new = co.canon_chrome(chrome()), co.canon_chrome(chrome(flow_ids=(2, 1), order=-1))
    assert co.compare(ref, new, pair=co.event_id)["same"]
    assert sum(1 for x in ref if x.get("ph") == "flow") == 2 and {"meta": {"displayTimeUnit": "ns"}} in ref


def test_chrome_a_flow_that_joins_another_slice_is_a_difference():
    t = chrome()
    t["traceEvents"][4] = dict(t["traceEvents"][4], ts=100.8)
    d = co.compare(co.canon_chrome(chrome()), co.canon_chrome(t), pair=co.event_id)
    assert not d["same"] and d["shown"][0] == "~ flow flow collective"
    assert d["shown"][1].strip() == "members[0].ts: 100.7 -> 100.8"  # the "f" end sorts first


def perfetto_trace(interned, uuids=(1, 2), flow=5, end=2000, first_arg="op"):
    """Two tracks (a process and its calls thread), one slice with two arguments and a flow, once
    with interned names and once with names inline, with any uuids and flow id."""
    pb = pytest.importorskip("perfetto.protos.perfetto.trace.perfetto_trace_pb2",
                             reason="the perfetto package is a dependency of ccld (pip install perfetto)")
    t = pb.Trace()
    proc, thread = uuids
    p = t.packet.add()
    p.trusted_packet_sequence_id = 1
    p.sequence_flags = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
    if interned:
        p.interned_data.event_names.add(iid=1, name="allreduce")
        p.interned_data.debug_annotation_names.add(iid=1, name="op")
        p.interned_data.debug_annotation_names.add(iid=2, name="seq")
        p.interned_data.debug_annotation_string_values.add(iid=3, str=b"allreduce")
    d = t.packet.add().track_descriptor
    d.uuid, d.process.pid, d.process.process_name = proc, 10, "rank 0"
    d = t.packet.add().track_descriptor
    d.uuid, d.parent_uuid, d.thread.pid, d.thread.tid, d.thread.thread_name = thread, proc, 10, 10, "calls"
    p = t.packet.add()
    p.trusted_packet_sequence_id, p.timestamp = 1, 1000
    p.sequence_flags = pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
    te = p.track_event
    te.type, te.track_uuid = pb.TrackEvent.TYPE_SLICE_BEGIN, thread
    te.flow_ids.append(flow)
    names = [(first_arg, "allreduce"), ("seq", 3)]
    for k, v in (names if interned else names[::-1]):
        a = te.debug_annotations.add()
        if interned:
            a.name_iid = {"op": 1, "seq": 2}[k]
            if isinstance(v, str):
                a.string_value_iid = 3
            else:
                a.int_value = v
        else:
            a.name = k
            if isinstance(v, str):
                a.string_value = v
            else:
                a.int_value = v
    if interned:
        te.name_iid = 1
    else:
        te.name = "allreduce"
    p = t.packet.add()
    p.trusted_packet_sequence_id, p.timestamp = 1, end
    p.track_event.type, p.track_event.track_uuid = pb.TrackEvent.TYPE_SLICE_END, thread
    return t.SerializeToString()


def test_perfetto_content_does_not_depend_on_interning_uuids_or_flow_ids():
    ref = co.canon_perfetto(perfetto_trace(interned=True))
    new = co.canon_perfetto(perfetto_trace(interned=False, uuids=(40, 41), flow=99))
    assert co.compare(ref, new, pair=co.event_id)["same"], (ref, new)
    sl = [x for x in ref if x["kind"] == "slice"]
    assert len(sl) == 1 and sl[0]["track"] == "rank 0 / calls" and sl[0]["name"] == "allreduce"
    assert (sl[0]["ts"], sl[0]["end"]) == (1000, 2000)
    assert {"kind": "flow", "members": [["rank 0 / calls", 1000, "out"]]} in ref


def test_perfetto_a_slice_that_ends_later_is_a_difference():
    d = co.compare(co.canon_perfetto(perfetto_trace(interned=True)),
                   co.canon_perfetto(perfetto_trace(interned=True, end=2500)), pair=co.event_id)
    assert not d["same"] and d["shown"][0] == "~ slice allreduce rank 0 / calls"
    assert d["shown"][1].strip() == "end: 2000 -> 2500"


def test_report_text_folds_whitespace_and_the_generation_time_and_keeps_plots_and_data():
    page = ('<html><head><style>body{x:1}</style></head><body><h1>ccld  report</h1>'
            '<div>store <code>S</code>; generated 2026-12-02 08:16 UTC by ccld</div>'
            '<p>4 ranks,\n   1 communicator</p><img src="data:image/png;base64,AAAA" data-ranks="0,1"></body></html>')
    later = page.replace("08:16", "09:01").replace("4 ranks,\n   1", "4 ranks, 1")
    ref, new = co.canon_html(page), co.canon_html(later)
    assert ref[:3] == ["ccld report", "store S; generated <time> UTC by ccld", "4 ranks, 1 communicator"]
    assert ref[3].startswith("[img 26 bytes sha256:") and ref[4] == "[data-ranks=0,1]"
    assert co.compare(ref, new, ordered=True)["same"]
    d = co.compare(ref, co.canon_html(page.replace("AAAA", "AAAB")), ordered=True)
    assert not d["same"] and d["shown"][0].startswith("- [img 26 bytes")


def test_a_long_changed_line_is_cut_to_where_it_differs():
    a = "HANG fault [3] gloo:0 seq 2050 allreduce: waiting 5.1 s; rank 3 T in do_signal_stop"
    d = co.compare([a], [a.replace("waiting", "waited")], ordered=True)
    assert d["shown"] == ["- ...loo:0 seq 2050 allreduce: waiting 5.1 s; rank 3 T in do_signal_stop",
                          "+ ...loo:0 seq 2050 allreduce: waited 5.1 s; rank 3 T in do_signal_stop"]


def test_failure_trace_csv_rows_and_paths_of_each_version():
    csv_text = "id,start,summary\nhang-1,1.5,stopped: rank 3\n"
    assert co.canon_csv(csv_text) == [{"header": ["id", "start", "summary"]},
                                      {"id": "hang-1", "start": "1.5", "summary": "stopped: rank 3"}]
    subst = [("/tmp/ref-x/out", "<out>"), ("/tmp/ref-x", "<root>")]
    assert guard._unpath({"path": "/tmp/ref-x/out/t.json", "src": "/tmp/ref-x/ccld"}, subst) == \
        {"path": "<out>/t.json", "src": "<root>/ccld"}


def test_stores_are_found_by_their_store_json(tmp_path):
    (tmp_path / "a" / "store").mkdir(parents=True)
    (tmp_path / "a" / "store" / "store.json").write_text(json.dumps({"format": "ccld-store", "version": 2}))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "store.json").write_text(json.dumps({"format": "something-else"}))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "store.json").write_text("[not json")
    assert guard.find_stores(str(tmp_path)) == [str(tmp_path / "a" / "store")]
    assert len(guard.find_stores(os.path.join(ROOT, "tests", "data"))) >= 3
