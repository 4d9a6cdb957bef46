"""The gloo translator as it was before the batch path (commit 9a4bdd2), one record at a time: the
reference the batch translator (ccld/bpf/gloo_translator.py) is checked against, on real kernel records
and on generated ones (test_gloo_batch.py). Not used by ccld itself.

It reads the records of the old program, one event per probe: WORK_INIT, WORK_START (at execute),
WORK_SIZE (at the algorithm entry), WORK_END. `feed()` turns the program's records into those: a
WorkStart record into a START at its start_ns and, when sized, a SIZE; a WorkEnd that carries a start
into a START and the END. The reference keeps its own work table and counts collectives itself from
the tag (the kernel's `works` and `seq` are not read), so the comparison checks those too.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

from ccld import wire as ev
from ccld.bpf import gloo_records as gr
from ccld.bpf.gloo_comms import gloo_message
from ccld.bpf.gloo_records import OP_NAMES, P2P_OPS
from ccld.bpf.gloo_translator import HOLD_MS, SIZED_OPS

PG_INIT, WORK_INIT, WORK_START, WORK_END, P2P_REC, WORK_SIZE, PAIR_FAIL, P2P_END, PG_NAME = 1, 2, 3, 4, 5, 6, 7, 8, 9


def _hdr(h, ts=None):
    return types.SimpleNamespace(tgid=h.tgid, tid=h.tid, ts_ns=h.ts_ns if ts is None else ts)


def old_records(kind: int, rec):
    """[(old kind, old-style record)] for one record of today's program."""
    if kind == gr.WORK_INIT:
        return [(WORK_INIT, types.SimpleNamespace(hdr=rec.hdr, pg=rec.pg, work=rec.work, seq=rec.lib_seq,
                                                  enter_ns=rec.enter_ns, tag=rec.tag, op=rec.op))]
    if kind == gr.WORK_START:
        out = [(WORK_START, types.SimpleNamespace(hdr=_hdr(rec.hdr, rec.start_ns), work=rec.work, ok=1))]
        if rec.sized:
            out.append((WORK_SIZE, types.SimpleNamespace(hdr=rec.hdr, work=rec.work, min_bytes=rec.min_bytes,
                                                         nbufs=rec.nbufs)))
        return out
    if kind == gr.WORK_END:
        out = []
        if rec.start_ns:
            out.append((WORK_START, types.SimpleNamespace(hdr=_hdr(rec.hdr, rec.start_ns), work=rec.work, ok=1)))
        out.append((WORK_END, types.SimpleNamespace(hdr=rec.hdr, work=rec.work, ok=rec.ok)))
        return out
    return [(kind, rec)]


@dataclass
class ProcState:
    rank: int
    job: str
    pgs: Dict[int, Tuple[str, int, int]] = field(default_factory=dict)  # pg ptr -> (comm, group_rank, size)
    built: Dict[int, Tuple[int, int, int]] = field(default_factory=dict)  # pg ptr -> (index, group_rank, size)
    unnamed: list = field(default_factory=list)  # built since the last setGroupName (it names the first)
    works: Dict[int, Tuple[str, int]] = field(default_factory=dict)    # work ptr -> (comm, seq)
    held: Dict[int, "Held"] = field(default_factory=dict)              # work ptr -> enter waiting for its size
    lost: Optional[Tuple[int, str]] = None  # first broken connection since the last good end: (peer, message)
    next_index: int = 0
    tags: bool = False                      # the collective tag is read (GlooFamily.attach says)
    last_seq: Dict[int, int] = field(default_factory=dict)   # pg ptr -> the newest collective seq given
    p2p_n: Dict[Tuple[int, str, int], int] = field(default_factory=dict)  # (pg, op, peer) -> ops posted
    p2p: Dict[int, Tuple[str, str, int, int]] = field(default_factory=dict)  # work ptr -> (comm, op, peer, seq)


@dataclass
class Held:
    enter: Dict                    # CollEnter's fields but the size
    since_ns: int                  # the WORK_INIT record's time
    start_ns: Optional[int] = None  # a WorkStart that came while the enter waited (sent right after it)


MAX_WORKS_PER_PROC = 65536  # in flight at once is a handful; this only bounds leaks from missed ends
NO_BYTES = (1 << 64) - 1    # gloo_p2p.nbytes when no buffer was seen


class ReferenceTranslator:
    """Records -> wire events, one record at a time (see the module's text). `emit` receives each event."""

    def __init__(self, emit: Callable[[ev.Event], None], hold_ns: int = HOLD_MS * 1_000_000):
        self.emit = emit
        self.hold_ns = hold_ns
        self.procs: Dict[int, ProcState] = {}
        self.unmatched = 0  # start/end records of works we never saw built (e.g. attached mid-collective)
        self.unsized = 0    # enters of SIZED_OPS sent without a size (HOLD_MS passed, or the work ended first)
        self.abandoned = 0  # p2p works rebuilt at the same address before their wait ended (never waited for)
        self._holding = 0   # enters held, all processes together (flush() returns at once when 0)

    def feed(self, kind: int, rec) -> None:
        """One record of today's program."""
        for k, r in old_records(kind, rec):
            self(k, r)

    def add_process(self, pid: int, rank: int, job: str) -> None:
        self.procs.setdefault(pid, ProcState(rank, job))

    def tags_readable(self, pid: int, yes: bool) -> None:
        """GlooFamily.attach: whether the probes read c10d's collective tag in this process."""
        st = self.procs.get(pid)
        if st is not None:
            st.tags = yes

    def forget(self, pid: int) -> None:
        st = self.procs.get(pid)
        if st is not None:  # its last enters still happened: send them before forgetting it
            for work in list(st.held):
                self._release(pid, st, work, None)
        self.procs.pop(pid, None)

    def flush(self, now_ns: int) -> None:
        """Send the enters that waited HOLD_MS for a size (their worker is busy with earlier works)."""
        if not self._holding:
            return
        for pid, st in list(self.procs.items()):
            for work, h in list(st.held.items()):
                if now_ns - h.since_ns >= self.hold_ns:
                    self._release(pid, st, work, None)

    def _release(self, pid: int, st: ProcState, work: int, nbytes: Optional[int]) -> None:
        h = st.held.pop(work)
        self._holding -= 1
        if nbytes is None:
            self.unsized += 1
        self.emit(ev.CollEnter(**h.enter, nbytes=-1 if nbytes is None else nbytes))
        if h.start_ns is not None:
            self.emit(ev.WorkStart(pid=pid, rank=st.rank, ts_ns=h.start_ns, comm=h.enter["comm"], seq=h.enter["seq"]))

    def _comm_for(self, pid: int, st: ProcState, pg: int, ts: int) -> str:
        """A group at its first use: its name, else its order of creation, else of first use."""
        known = st.pgs.get(pg)
        if known is not None:
            return known[0]
        built = st.built.pop(pg, None)
        if built is not None:
            return self._named(pid, st, pg, f"{st.job}/gloo:{built[0]}", built[1], built[2], ts)
        st.next_index += 1
        return self._named(pid, st, pg, f"{st.job}/gloo:{st.next_index - 1}", -1, -1, ts)

    def _named(self, pid: int, st: ProcState, pg: int, comm: str, group_rank: int, size: int, ts: int) -> str:
        st.pgs[pg] = (comm, group_rank, size)
        # Seen at its creation (PG_INIT: group_rank known) -> every count here starts with the group's.
        source = (ev.SEQ_LIBRARY if st.tags else ev.SEQ_FROM_INIT) if group_rank >= 0 else \
            (ev.SEQ_LIBRARY if st.tags else ev.SEQ_FROM_ATTACH)
        self.emit(ev.CommInit(pid=pid, rank=st.rank, ts_ns=ts, backend="gloo", comm=comm,
                              group_rank=group_rank, group_size=size, handle=pg, seq_source=source))
        return comm

    def _coll_seq(self, st: ProcState, pg: int, tag: int) -> int:
        """The collective's seq: c10d's tag + 1 when read, else one more than the group's last."""
        seq = tag + 1 if tag >= 0 else st.last_seq.get(pg, 0) + 1
        st.last_seq[pg] = seq
        return seq

    def __call__(self, kind: int, rec) -> None:
        pid = rec.hdr.tgid
        st = self.procs.get(pid)
        if st is None:
            return  # a process we were told to forget; its probes are being detached
        ts = rec.hdr.ts_ns
        if kind == PG_INIT:
            st.pgs.pop(rec.pg, None)  # an address a destroyed group had: a new group
            st.built[rec.pg] = (st.next_index, rec.rank, rec.size)
            st.next_index += 1
            st.unnamed.append(rec.pg)
        elif kind == PG_NAME:
            pg = next((g for g in st.unnamed if g in st.built), None)
            st.unnamed.clear()
            if pg is not None:
                index, group_rank, size = st.built.pop(pg)
                name = rec.name.decode("utf-8", "replace") or str(index)
                self._named(pid, st, pg, f"{st.job}/gloo:{name}", group_rank, size, ts)
        elif kind == WORK_INIT:
            op = OP_NAMES.get(rec.op, f"op{rec.op}")
            if op in ("send", "recv", "recvanysource"):
                return  # p2p works are reported by the P2P record
            if rec.pg == 0 and len(st.pgs) == 1:
                comm = next(iter(st.pgs.values()))[0]
            else:
                comm = self._comm_for(pid, st, rec.pg, ts)
            if len(st.works) >= MAX_WORKS_PER_PROC:
                st.works.clear()
                for work in list(st.held):
                    self._release(pid, st, work, None)
            seq = self._coll_seq(st, rec.pg, rec.tag)
            st.works[rec.work] = (comm, seq)
            enter = dict(pid=pid, rank=st.rank, ts_ns=rec.enter_ns, backend="gloo", comm=comm, seq=seq,
                         op=op, tid=rec.hdr.tid, lib_seq=rec.seq)
            if rec.work in st.held:  # a work object reused before its size came: the old one is done
                # (issue 16: also when the new op has no size to wait for; before, the old enter stayed
                # and took the new work's start and size: the only behaviour the batch path changed)
                self._release(pid, st, rec.work, None)
            if op in SIZED_OPS:
                st.held[rec.work] = Held(enter, ts)
                self._holding += 1
            else:
                self.emit(ev.CollEnter(**enter))
        elif kind == WORK_SIZE:
            if rec.work in st.held:
                self._release(pid, st, rec.work, rec.min_bytes if rec.nbufs else None)
        elif kind in (WORK_START, WORK_END):
            got = st.works.get(rec.work)
            if got is None:
                self.unmatched += 1
                return
            comm, seq = got
            h = st.held.get(rec.work)
            if kind == WORK_START:
                if h is not None:
                    h.start_ns = ts  # sent after the enter, when its size comes
                else:
                    self.emit(ev.WorkStart(pid=pid, rank=st.rank, ts_ns=ts, comm=comm, seq=seq))
            else:
                if h is not None:
                    self._release(pid, st, rec.work, None)  # ended before any size: the enter comes first
                del st.works[rec.work]
                error = ""
                if rec.ok:
                    st.lost = None
                else:
                    error = "gloo reported an error (finishWorkGlooError)"
                    if st.lost is not None:
                        peer, msg = st.lost
                        error += (f"; connection to group rank {peer} broke" if peer >= 0 else
                                  "; a connection broke") + (f": {msg}" if msg else "")
                self.emit(ev.WorkEnd(pid=pid, rank=st.rank, ts_ns=ts, comm=comm, seq=seq, ok=bool(rec.ok),
                                     error=error))
        elif kind == PAIR_FAIL:
            if st.lost is None:  # the first one: later ones follow from it (the process group is broken)
                st.lost = (rec.peer, gloo_message(rec.msg))
        elif kind == P2P_REC:
            self._p2p(pid, st, rec, ts)
        elif kind == P2P_END:
            got = st.p2p.pop(rec.work, None)
            if got is None:
                self.unmatched += 1  # posted before we attached
                return
            comm, op, peer, seq = got
            self.emit(ev.P2PEnd(pid=pid, rank=st.rank, ts_ns=ts, comm=comm, op=op, peer=peer, seq=seq,
                                ok=bool(rec.ok), error="" if rec.ok else "gloo reported an error (send/recv wait)",
                                wait_ns=rec.wait_ns))

    def _p2p(self, pid: int, st: ProcState, rec, ts: int) -> None:
        if rec.pg == 0 and len(st.pgs) == 1:
            comm = next(iter(st.pgs.values()))[0]
        else:
            comm = self._comm_for(pid, st, rec.pg, ts)
        op = P2P_OPS.get(rec.op, f"op{rec.op}")
        seq = -1
        if rec.peer >= 0:
            key = (rec.pg, op, rec.peer)
            seq = st.p2p_n[key] = st.p2p_n.get(key, 0) + 1
        if rec.work in st.p2p:
            self.abandoned += 1  # a work object reused: its op was never waited for (isend, dropped)
        if len(st.p2p) >= MAX_WORKS_PER_PROC:
            st.p2p.clear()
        st.p2p[rec.work] = (comm, op, rec.peer, seq)
        nbytes = -1 if rec.nbytes == NO_BYTES else rec.nbytes
        self.emit(ev.P2P(pid=pid, rank=st.rank, ts_ns=rec.enter_ns or ts, backend="gloo", comm=comm, op=op,
                         peer=rec.peer, tag=rec.tag, seq=seq, nbytes=nbytes, lib_seq=rec.seq))
