"""/proc parsing against hostile processes: odd comms, odd environments, processes that vanish.

Real processes set their comm to ')', spaces, newlines, invalid UTF-8 (or a multi-byte character
cut at 15 bytes), start with environments holding entries without '=' and undecodable bytes, and
exit between two reads. The parsers must give the right fields or None, never raise; the pure
parser (parse_stat) rejects malformed text with an error naming the file and the field.
"""
import ctypes
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import given, settings, strategies as st

from ccld import wire as ev
from ccld.tracer import discover, procstate
from ccld.tracer.procstate import ProcParseError, Stat, parse_stat

pytestmark = pytest.mark.unit

SLEEP = shutil.which("sleep") or "/bin/sleep"


def stat_line(comm: bytes, state=b"S", ppid=1, utime=7, stime=3) -> bytes:
    """A /proc/PID/stat line as the kernel writes it (52 fields)."""
    rest = [state, b"%d" % ppid] + [b"0"] * 9 + [b"%d" % utime, b"%d" % stime] + [b"0"] * 37
    return b"4242 (" + comm + b") " + b" ".join(rest) + b"\n"


def wait_for(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.fixture
def procs():
    out = []
    yield out
    for p in out:
        if p.poll() is None:
            p.kill()
        p.wait()


# ---- the pure parser --------------------------------------------------------------------------------------

HOSTILE_COMMS = [b"a) b (c", b")", b"((", b") S 1 2 3 (", b"x\ny z", b"\xff\xfe) (", "ééééééé".encode() + b"\xc3",
                 b"", b" ", b"\x00"]


@pytest.mark.parametrize("comm", HOSTILE_COMMS, ids=repr)
def test_parse_stat_takes_comm_up_to_the_last_paren(comm):
    got = parse_stat(stat_line(comm, state=b"T", ppid=99, utime=11, stime=5), "/proc/4242/stat")
    assert got == Stat(comm=comm.decode(errors="replace"), state="T", ppid=99, utime=11, stime=5)


@pytest.mark.parametrize("raw,field", [
    (b"", "field 2 (comm)"),
    (b"4242 comm S 1 2", "field 2 (comm)"),
    (b"4242 (x", "field 2 (comm)"),
    (b"4242 (x)", "field 3 (state)"),
    (b"4242 (x) S", "field 4 (ppid)"),
    (b"4242 (x) S 1 0 0 0 0 0 0 0 0 0", "field 14 (utime)"),
    (stat_line(b"x", utime=0).replace(b" 0 3 0", b" zz 3 0", 1), "field 14 (utime)"),
    (stat_line(b"x", state=b"SS"), "field 3 (state)"),
    (stat_line(b"x", state=b"7"), "field 3 (state)"),
    (stat_line(b"x").replace(b") S 1 ", b") S 1e3 "), "field 4 (ppid)"),
    (stat_line(b"x").replace(b") S 1 ", b") S " + b"9" * 40 + b" "), "field 4 (ppid)"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_malformed_stat_names_the_file_and_the_field(raw, field):
    with pytest.raises(ProcParseError) as ei:
        parse_stat(raw, "/proc/4242/stat")
    assert "/proc/4242/stat" in str(ei.value) and field in str(ei.value)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.binary(max_size=15), st.integers(0, 2**22), st.integers(0, 2**40), st.integers(0, 2**40))
def test_any_comm_any_numbers(comm, ppid, utime, stime):
    got = parse_stat(stat_line(comm, ppid=ppid, utime=utime, stime=stime), "s")
    assert (got.ppid, got.utime, got.stime, got.state) == (ppid, utime, stime, "S")


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.binary(max_size=300))
def test_any_bytes_parse_or_a_named_error(raw):
    try:
        parse_stat(raw, "/proc/1/stat")
    except ProcParseError as e:
        assert str(e).startswith("/proc/1/stat: field ")


# ---- real processes -------------------------------------------------------------------------------------

SET_COMM_AND_SLEEP = ("import sys, time\n"
                      "open('/proc/self/comm', 'wb').write(bytes.fromhex(sys.argv[1]))\n"
                      "print('ready', flush=True)\n"
                      "time.sleep(60)\n")


@pytest.mark.parametrize("comm", [b"a) b (c", b") ) (", b"x\ny) z", b"\xff\xfe) (\xc3",
                                  "éééééééé".encode()], ids=repr)
def test_real_process_with_a_hostile_comm(comm, procs):
    """comm written to /proc/self/comm (the kernel keeps 15 bytes: 'éééééééé' loses half a
    character). Before the fix, invalid UTF-8 made read_state raise UnicodeDecodeError and made
    alive() say False and ppid_of() say -1 for a live process (a rank reported as exited)."""
    p = subprocess.Popen([sys.executable, "-c", SET_COMM_AND_SLEEP, comm.hex()], stdout=subprocess.PIPE)
    procs.append(p)
    assert p.stdout.readline() == b"ready\n"
    want = comm[:15].decode(errors="replace")
    st_ = procstate.read_stat(p.pid)
    assert st_ is not None and st_.comm == want and st_.ppid == os.getpid() and st_.state in "RS"
    state = procstate.read_state(p.pid)
    assert state is not None and state[0] in "RS" and state[2] >= 0
    assert discover.alive(p.pid) and discover.ppid_of(p.pid) == os.getpid()
    assert p.pid in discover.descendants(os.getpid())


def test_real_process_named_like_a_stat_line(tmp_path, procs):
    """comm from the executable's name: a symlink called 'a) b (c' to python."""
    link = tmp_path / "a) b (c"
    link.symlink_to(sys.executable)
    p = subprocess.Popen([str(link), "-c", "print('ready', flush=True); import time; time.sleep(60)"],
                         stdout=subprocess.PIPE)
    procs.append(p)
    assert p.stdout.readline() == b"ready\n"
    assert procstate.read_stat(p.pid).comm == "a) b (c"
    assert discover.ppid_of(p.pid) == os.getpid() and discover.alive(p.pid)
    assert discover._cmdline(p.pid).startswith(str(link))


EXECVE_WITH_RAW_ENV = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
def arr(items):
    a = (ctypes.c_char_p * (len(items) + 1))(*items, None)
    return a
env = [bytes.fromhex(h) for h in sys.argv[2:]]
libc.execve(sys.argv[1].encode(), arr([b"sleep", b"60"]), arr(env))
raise SystemExit("execve failed: %d" % ctypes.get_errno())
"""


def spawn_with_raw_env(env_entries, procs):
    """A `sleep 60` whose environment is exactly `env_entries` (bytes, '=' or not), via execve(2)."""
    p = subprocess.Popen([sys.executable, "-c", EXECVE_WITH_RAW_ENV, SLEEP] + [e.hex() for e in env_entries])
    procs.append(p)
    assert wait_for(lambda: discover._cmdline(p.pid) == "sleep 60"), "execve did not happen"
    return p


def test_environ_with_invalid_utf8_and_entries_without_equals(procs):
    p = spawn_with_raw_env([b"NOEQUALS", b"", b"=no-name", b"BAD\xff=\xfe\xff", b"RANK=1", b"WORLD_SIZE=4",
                            b"MASTER_ADDR=10.0.0.\xff", b"MASTER_PORT=29500", b"LOCAL_RANK=1_0",
                            b"CCLD_JOB=j\xffob", b"RANK_EXTRA=x=y=z"], procs)
    env = discover.read_environ(p.pid)
    assert env["RANK"] == "1" and env["MASTER_ADDR"] == "10.0.0.\ufffd" and "NOEQUALS" not in env
    ident = discover.identify(p.pid)
    assert ident is not None
    assert (ident.pid, ident.rank, ident.world_size, ident.master_port) == (p.pid, 1, 4, 29500)
    assert ident.local_rank == 1          # "1_0" is not a number (int() would have read 10)
    assert ident.job == "j\ufffdob" and ident.master_addr == "10.0.0.\ufffd"
    # what the agent ships from it encodes and decodes cleanly
    info = ev.RankInfo(pid=ident.pid, rank=ident.rank, world_size=ident.world_size, local_rank=ident.local_rank,
                       node="n", job=ident.job, ts_ns=1, master_addr=ident.master_addr,
                       master_port=ident.master_port, cmdline=ident.cmdline)
    assert ev.decode_batch(ev.encode_batch("a", "n", 1, [info])).events == [info]


@pytest.mark.parametrize("rank", [b"99999999999999999999999", b"\xd9\xa3", b" 1", b"1e3", b"0x1", b""],
                         ids=repr)
def test_environ_with_a_rank_that_is_not_a_number_is_not_a_rank(rank, procs):
    """RANK=10**23 used to become a RankInfo that msgpack cannot encode (OverflowError in the
    shipper thread); Arabic-Indic digits and spaces were read as numbers by int()."""
    p = spawn_with_raw_env([b"RANK=" + rank, b"WORLD_SIZE=2"], procs)
    assert discover.identify(p.pid) is None


def test_huge_world_size_and_port_are_not_read():
    env = {"RANK": "0", "WORLD_SIZE": "1" + "0" * 30, "MASTER_PORT": "9" * 25}
    assert discover._int(env, "WORLD_SIZE") == -1 and discover._int(env, "MASTER_PORT", 0) == 0
    assert discover._int(env, "RANK") == 0 and discover._int({"RANK": "-3"}, "RANK") == -3


def test_process_that_exits_between_calls(procs):
    p = subprocess.Popen([SLEEP, "60"])
    procs.append(p)
    assert wait_for(lambda: discover._cmdline(p.pid) == f"{SLEEP} 60" or discover._cmdline(p.pid) == "sleep 60")
    assert discover.alive(p.pid)
    p.kill()
    assert wait_for(lambda: (procstate.read_stat(p.pid) or Stat("", "Z", 0, 0, 0)).state == "Z")
    # a zombie: stat still readable, not alive, not a rank
    assert not discover.alive(p.pid) and procstate.read_state(p.pid)[0] == "Z"
    assert discover.identify(p.pid) is None
    p.wait()
    # gone: every reader says so without raising
    assert procstate.read_stat(p.pid) is None and procstate.read_state(p.pid) is None
    assert not discover.alive(p.pid) and discover.ppid_of(p.pid) == -1
    assert discover.read_environ(p.pid) is None and discover.identify(p.pid) is None
    assert discover._cmdline(p.pid) == "" and p.pid not in discover.descendants(os.getpid())


def test_readers_race_with_processes_that_come_and_go():
    """Short-lived processes start and exit while every reader runs over all of /proc: no exception."""
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            subprocess.run(["true"])

    threads = [threading.Thread(target=churn, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    rounds = 0
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            pids = discover.all_pids()
            for pid in pids:
                procstate.read_state(pid)
                discover.alive(pid)
                discover.identify(pid)
            discover.descendants(os.getpid(), pids)
            rounds += 1
    finally:
        stop.set()
        for t in threads:
            t.join(5)
    assert rounds >= 1
