"""Flight Recorder dumps, hand-made in the shapes torch 2.13 writes (gloo: seen on real dumps; NCCL:
torch's documented fields), read by frdump and judged by frcheck; malformed dumps fail clearly."""
import json
import os
import pickle

import pytest

from ccld import cli
from ccld.diagnose.frcheck import check, diagnose_dumps, op_name, user_frame
from ccld.diagnose.frdump import FrDumpError, read_dir, read_dump

pytestmark = pytest.mark.unit

T0_NS = 1_764_400_000_000_000_000
USER = {"name": "train_step", "filename": "/home/me/train.py", "line": 42}
TORCH = {"name": "all_reduce", "filename": "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py",
         "line": 3245}


def entry(seq, name="gloo:all_reduce", pg=("0", "default_pg"), sizes=((8,),), dtype="Float", state="scheduled",
          retired=True, created_s=0.0, started_ns=None, completed_ns=None, frames=True, p2p=False):
    return {"record_id": seq, "pg_id": int(pg[0]), "process_group": tuple(pg), "collective_seq_id": 0 if p2p else seq,
            "p2p_seq_id": seq if p2p else 0, "op_id": seq, "profiling_name": name,
            "input_sizes": [list(s) for s in sizes], "output_sizes": [list(s) for s in sizes],
            "input_dtypes": [dtype] * len(sizes), "output_dtypes": [dtype] * len(sizes), "is_p2p": p2p,
            "retired": retired, "state": state, "thread_id": "1", "thread_name": "python",
            "time_created_ns": T0_NS + int(created_s * 1e9), "time_discovered_started_ns": started_ns,
            "time_discovered_completed_ns": completed_ns, "timeout_ms": 600000,
            "frames": [TORCH, USER] if frames else []}


def dump(entries, pg_config=None, pg_status=None, version="2.10"):
    return {"version": version, "comm_lib_version": "", "entries": entries,
            "pg_config": pg_config if pg_config is not None else {"": {"name": "", "desc": "", "ranks": "[]"}},
            "pg_status": pg_status if pg_status is not None else {"0": {"last_enqueued_collective": 0,
                                                                         "last_started_collective": -1,
                                                                         "last_completed_collective": 0}}}


def write(directory, rank, d, fmt="pickle", prefix="fr_rank_", mtime_s=30.0):
    path = directory / f"{prefix}{rank}"
    if fmt == "pickle":
        path.write_bytes(pickle.dumps(d))
    else:
        d = dict(d, entries=[{k: v for k, v in e.items() if k != "frames"} for e in d["entries"]])  # JSON has none
        path.write_text(json.dumps(d))
    t = T0_NS / 1e9 + mtime_s
    os.utime(path, (t, t))
    return path


def healthy(n, **kw):
    return [entry(s, created_s=s * 0.1, **kw) for s in range(1, n + 1)]


@pytest.mark.parametrize("fmt", ["pickle", "json"])
def test_a_rank_that_never_entered_is_named(tmp_path, fmt):
    for r in range(4):
        es = healthy(20)
        if r != 2:
            es.append(entry(21, retired=False, created_s=10.0))  # ranks 0, 1, 3 wait in seq 21
        write(tmp_path, r, dump(es), fmt)
    findings, dumps = diagnose_dumps(str(tmp_path))
    assert [d.rank for d in dumps] == [0, 1, 2, 3] and {d.fmt for d in dumps} == {fmt}
    assert len(findings) == 1
    f = findings[0]
    assert (f.kind, f.cls, f.ranks, f.comm, f.seq, f.op) == ("hang", "not-entered", [2], "gloo:0", 21, "allreduce")
    assert f.onset_at == pytest.approx(T0_NS / 1e9 + 10.0)
    assert f.detected_at == pytest.approx(T0_NS / 1e9 + 30.0)
    ev = f.evidence
    assert ev["waiting"] == [0, 1, 3] and ev["waited_s"] == pytest.approx(20.0) and not ev["waiters_done"]
    assert ev["fr_ranks"] == [{"rank": 2, "last_seq": 20, "last_op": "allreduce",
                               "last_called_at": "train.py:42 in train_step" if fmt == "pickle" else None,
                               "dump_age_s": 0.0}]
    assert ev["ranks"] == [{"rank": 2, "seen": True, "last_entered": {"seq": 20, "op": "allreduce"}}]


def test_an_open_collective_younger_than_the_floor_is_in_flight_not_a_hang(tmp_path):
    for r in range(2):
        es = healthy(5) + ([entry(6, retired=False, created_s=29.0)] if r == 0 else [])
        write(tmp_path, r, dump(es))
    assert check(read_dir(str(tmp_path)), floor_s=5.0) == []
    assert [f.ranks for f in check(read_dir(str(tmp_path)), floor_s=0.5)] == [[1]]


def test_gloo_retires_a_timed_out_collective_and_the_missing_rank_is_still_named(tmp_path):
    for r in range(3):
        es = healthy(4) + ([entry(5, retired=True, created_s=1.0)] if r != 1 else [])
        write(tmp_path, r, dump(es))
    (f,) = check(read_dir(str(tmp_path)))
    assert (f.cls, f.ranks, f.seq) == ("not-entered", [1], 5)
    assert f.evidence["waiters_done"] and "timed out" in f.evidence["note"]


def test_ranks_without_a_dump_are_named_when_every_dumped_rank_waits(tmp_path):
    cfg = {"": {"name": "", "desc": "", "ranks": "[0, 1, 2, 3]"}}  # gloo: the world, under ""
    for r in range(3):
        write(tmp_path, r, dump(healthy(6) + [entry(7, retired=False, created_s=2.0)], pg_config=cfg))
    (f,) = check(read_dir(str(tmp_path)))
    assert (f.cls, f.ranks, f.seq, f.evidence["reason"], f.evidence["no_dump"]) == ("not-entered", [3], 7, "no-dump", [3])


def test_inconsistent_ops_and_sizes(tmp_path):
    for r in range(4):
        es = healthy(3)
        if r == 1:
            es.append(entry(4, name="gloo:all_gather", retired=False, created_s=5.0))
        else:
            es.append(entry(4, retired=False, created_s=5.0))
        write(tmp_path, r, dump(es))
    (f,) = check(read_dir(str(tmp_path)))
    assert (f.cls, f.ranks, f.seq, f.op, f.evidence["reason"]) == ("inconsistent", [1], 4, "allreduce", "different-ops")
    assert f.evidence["summary"] == "different ops: rank 1 allgather where 3 ranks call allreduce"
    assert "train.py:42" in f.stack and f.stack.startswith("rank 1 (train.py:42 in train_step):")

    sizes = tmp_path / "sizes"
    sizes.mkdir()
    for r in range(3):
        write(sizes, r, dump(healthy(2) + [entry(3, sizes=((16,),) if r == 0 else ((8,),), created_s=5.0)]))
    (f,) = check(read_dir(str(sizes)))
    assert (f.cls, f.ranks, f.seq, f.evidence["reason"]) == ("inconsistent", [0], 3, "different-sizes")
    assert f.evidence["summary"] == "different sizes or dtypes: rank 0 allreduce [[16]] ['Float'] where 2 ranks " \
                                    "call allreduce [[8]] ['Float']"


def test_nccl_dumps_membership_from_pg_config_and_a_rank_that_never_started(tmp_path):
    cfg = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"},
           "1": {"name": "1", "desc": "tp", "ranks": "[2, 3]"}}
    done = dict(state="completed", retired=True, started_ns=T0_NS + 1, completed_ns=T0_NS + 2)
    for r in range(4):
        es = [entry(s, name="nccl:all_reduce", created_s=s * 0.1, **done) for s in range(1, 8)]
        es.append(entry(8, name="nccl:all_reduce", created_s=5.0, retired=False,
                        state="scheduled" if r == 1 else "started", started_ns=None if r == 1 else T0_NS + 5))
        es.append(entry(1, name="nccl:send", p2p=True, created_s=1.0, **done))
        if r == 2:   # rank 2 entered the [2, 3] group's first collective; rank 3 never did
            es.append(entry(1, name="nccl:_allgather_base", pg=("1", "tp"), created_s=4.0, retired=False,
                            state="started"))
        write(tmp_path, r, dict(dump(es, pg_config=cfg), comm_lib_version="2.27.3", nccl_comm_state={}))
    findings = check(read_dir(str(tmp_path)))
    got = [(f.cls, f.ranks, f.comm, f.seq, f.op, f.evidence["reason"]) for f in findings]
    assert got == [("fault", [1], "nccl:0", 8, "allreduce", "not-started"),
                   ("not-entered", [3], "nccl:1", 1, "_allgather_base", "not-entered")]
    assert findings[0].evidence["states"] == {"0": "started", "1": "scheduled", "2": "started", "3": "started"}


def test_op_names_and_user_frames():
    assert op_name("gloo:all_reduce") == "allreduce" and op_name("nccl:all_gather") == "allgather"
    assert op_name("nccl:reduce_scatter") == "reduce_scatter" and op_name("gloo:barrier") == "barrier"
    assert user_frame([TORCH, USER]) == "train.py:42 in train_step" and user_frame([TORCH]) is None


# ---- malformed dumps: a clear error naming the file and the field --------------------------------

def test_truncated_pickle_and_json_name_the_file(tmp_path):
    good = pickle.dumps(dump(healthy(3)))
    (tmp_path / "fr_rank_0").write_bytes(good[: len(good) // 2])
    with pytest.raises(FrDumpError, match=r"fr_rank_0: not a complete pickle .*truncated\?"):
        read_dump(str(tmp_path / "fr_rank_0"), 0)
    text = json.dumps(dump(healthy(3)))
    (tmp_path / "fr_rank_1").write_text(text[:100])
    with pytest.raises(FrDumpError, match=r"fr_rank_1: not valid JSON .*truncated\?"):
        read_dump(str(tmp_path / "fr_rank_1"), 1)
    (tmp_path / "fr_rank_2").write_bytes(b"")
    with pytest.raises(FrDumpError, match="fr_rank_2: empty file"):
        read_dump(str(tmp_path / "fr_rank_2"), 2)
    (tmp_path / "fr_rank_3").write_bytes(b"hello")
    with pytest.raises(FrDumpError, match="fr_rank_3: neither a pickle nor JSON"):
        read_dump(str(tmp_path / "fr_rank_3"), 3)


def test_missing_and_mistyped_fields_are_named(tmp_path):
    es = healthy(5)
    del es[3]["collective_seq_id"]
    write(tmp_path, 0, dump(es), "json")
    with pytest.raises(FrDumpError, match=r"fr_rank_0: entries\[3\]: missing field 'collective_seq_id'"):
        read_dir(str(tmp_path))
    es = healthy(2)
    es[1]["time_created_ns"] = "yesterday"
    write(tmp_path, 0, dump(es))
    with pytest.raises(FrDumpError, match=r"entries\[1\]: field 'time_created_ns' should be int, found str"):
        read_dir(str(tmp_path))
    es = healthy(2)
    es[0]["process_group"] = ("0",)
    write(tmp_path, 0, dump(es))
    with pytest.raises(FrDumpError, match=r"entries\[0\]: field 'process_group' should be \[name, desc\]"):
        read_dir(str(tmp_path))
    write(tmp_path, 0, {"version": "2.10"})
    assert read_dir(str(tmp_path))[0].entries == []   # JSON dumps leave out an empty 'entries'
    write(tmp_path, 0, {"entries": []})
    with pytest.raises(FrDumpError, match="fr_rank_0: missing field 'version'"):
        read_dir(str(tmp_path))
    write(tmp_path, 0, dump(healthy(1), version="3.0"))
    with pytest.raises(FrDumpError, match="field 'version' is '3.0'"):
        read_dir(str(tmp_path))
    write(tmp_path, 0, dump(healthy(1), pg_config={"0": {"desc": "x", "ranks": "[0, 1"}}))
    with pytest.raises(FrDumpError, match=r"pg_config\['0'\]: field 'ranks' is not a list"):
        read_dir(str(tmp_path))
    write(tmp_path, 0, dump(healthy(1), pg_status={"0": {"last_completed_collective": "many"}}))
    with pytest.raises(FrDumpError, match=r"pg_status\['0'\]: last_completed_collective: expected a number"):
        read_dir(str(tmp_path))


def test_a_pickle_that_would_run_code_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch %s" % (tmp_path / "pwned"),))
    (tmp_path / "fr_rank_0").write_bytes(pickle.dumps({"version": "2.10", "entries": [Evil()]}))
    with pytest.raises(FrDumpError, match="refusing to load .*system"):
        read_dir(str(tmp_path))
    assert not (tmp_path / "pwned").exists()


def test_directory_problems(tmp_path):
    with pytest.raises(FrDumpError, match="not a directory"):
        read_dir(str(tmp_path / "nope"))
    with pytest.raises(FrDumpError, match="no dump files"):
        read_dir(str(tmp_path))
    write(tmp_path, 0, dump(healthy(1)), prefix="a_rank_")
    write(tmp_path, 0, dump(healthy(1)), prefix="b_rank_")
    with pytest.raises(FrDumpError, match=r"several prefixes \('a_rank_', 'b_rank_'\): say which with --fr-prefix"):
        read_dir(str(tmp_path))
    assert [d.rank for d in read_dir(str(tmp_path), prefix="b_rank_")] == [0]
    (tmp_path / "b_rank_0.json").write_text(json.dumps(dump(healthy(1))))
    with pytest.raises(FrDumpError, match=r"more than one dump for rank\(s\) \[0\]"):
        read_dir(str(tmp_path), prefix="b_rank_")


def test_cli_prints_findings_and_maps_bad_dumps_to_one_error_line(tmp_path, capsys):
    for r in range(2):
        write(tmp_path, r, dump(healthy(3) + ([entry(4, retired=False, created_s=1.0)] if r == 0 else [])))
    assert cli.main(["diagnose", "--flight-recorder", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"flight recorder: 2 dumps (pickle, version 2.10, gloo) in {tmp_path}: ranks 0,1, 7 entries"
    assert out[2].startswith("HANG not-entered ranks [1] gloo:0 seq 4 allreduce: waiting 29.0 s; rank 1, last entered seq 3")
    assert out[3] == "  rank 0 waits in seq 4 allreduce at train.py:42 in train_step; rank 1 last entered seq 3 " \
                     "allreduce at train.py:42 in train_step"
    (tmp_path / "fr_rank_1").write_bytes(b"\x80\x04")
    assert cli.main(["diagnose", "--flight-recorder", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ccld: {tmp_path}/fr_rank_1: not a complete pickle") and err.count("\n") == 1
    assert cli.main(["diagnose"]) == 1
    assert "nothing to diagnose: give STORE_DIR, --flight-recorder DIR" in capsys.readouterr().err


def test_cli_shows_where_the_odd_ranks_called_the_inconsistent_collective(tmp_path, capsys):
    for r in range(3):
        write(tmp_path, r, dump(healthy(2) + [entry(3, name="gloo:broadcast" if r == 2 else "gloo:all_reduce",
                                                    created_s=1.0, retired=False)]))
    assert cli.main(["diagnose", "--flight-recorder", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2] == "HANG inconsistent [2] gloo:0 seq 3: different ops: rank 2 broadcast where 2 ranks call allreduce"
    assert out[3:] == ["  rank 2 called broadcast at train.py:42 in train_step"]
