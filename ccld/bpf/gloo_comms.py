"""Who is who in the traced gloo processes: each one's process groups and the communicator each
stands for, and what gloo.bpf.c's rare records say (groups built and named, broken connections, p2p
ops posted and waited for). GlooTranslator (gloo_translator.py) owns one GlooComms and asks it the
communicator of each collective record; per-process state is dropped when the process is forgotten.

Communicators are named `<job>/gloo:<name>`, name = c10d's group name (setGroupName, right after the
group is built: "0" for the world, then "1", "2", ... in new_group order, or a hash of the ranks),
the same on every member and different between groups. Ranks of a 2 x 2 tensor-parallel job build
different groups in the same place ({0,1} and {2,3} are each one rank's second group), so an order
of creation alone would join unrelated groups. Caveat: a group built before we attached, or by a
c10d without setGroupName, has no name we saw: it is named `<job>/gloo:<k>`, k = the order in which
the process built (or first used) its gloo groups; right for the world group, and for subgroups only
when every rank belongs to the same ones (a job attached mid-run with tp x dp groups is not).

Broken connections: when gloo's I/O thread finds a connection broken (PAIR_FAIL: EOF, reset), the
first such peer since the process's last successful collective is named in the error of its next
failed WorkEnd: "...; connection to group rank N broke: <gloo's message>" (LOST_RE reads it back).
A rank killed inside a collective is the one its peers' errors name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from ccld import wire as ev
from ccld.bpf.gloo_records import NO_BYTES, P2P_END, P2P_OPS, P2P_REC, PAIR_FAIL, PG_INIT, PG_NAME
from ccld.bpf.rows import Builder, group_keys

LOST_RE = re.compile(r"connection to group rank (\d+) broke")  # in WorkEnd.error; diagnose/hang.py reads it
MAX_WORKS_PER_PROC = 65536  # p2p ops in flight at once are a handful; this only bounds leaks from missed ends


@dataclass
class ProcState:
    rank: int
    job: str
    pgs: Dict[int, Tuple[str, int, int]] = field(default_factory=dict)  # pg ptr -> (comm, group_rank, size)
    built: Dict[int, Tuple[int, int, int, int]] = field(default_factory=dict)  # pg ptr -> (index, group_rank,
                                            # size, ts) of a group seen built and not yet named or used
    unnamed: List[int] = field(default_factory=list)  # groups built since the last setGroupName: it names
                                            # the first (TORCH_DISTRIBUTED_DEBUG=DETAIL builds a helper
                                            # gloo group after the group's own backend)
    codes: Dict[int, int] = field(default_factory=dict)  # pg ptr -> its comm's index in GlooComms.names
    lost: Optional[Tuple[int, str]] = None  # first broken connection since the last good end: (peer, message)
    next_index: int = 0
    tags: bool = False                      # the collective tag is read (GlooFamily.attach says)
    p2p_n: Dict[Tuple[int, str, int], int] = field(default_factory=dict)  # (pg, op, peer) -> ops posted
    p2p: Dict[int, Tuple[str, str, int, int]] = field(default_factory=dict)  # work ptr -> (comm, op, peer, seq)


def gloo_message(raw: bytes) -> str:
    """gloo's exception text without its source location and advice: "Read error [a]:p: reset by peer"."""
    text = raw.decode("utf-8", "replace")
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". This is typically", 1)[0].strip()[:120]

class GlooComms:
    """Per-process state of the traced gloo processes, and the communicators named so far (`names`,
    by index: the index is what records and rows carry)."""

    def __init__(self):
        self.procs: Dict[int, ProcState] = {}
        self.names: List[str] = []                     # communicator names by index
        self.zero_pg: Dict[Tuple[int, int], int] = {}  # (pid, work) -> comm index, for works entered with pg 0
        self.abandoned = 0  # p2p works rebuilt at the same address before their wait ended (never waited for)
        self.pids = np.zeros(0, np.int64)   # known pids, sorted, and their ranks
        self.ranks = np.zeros(0, np.int64)
        self._comm_table = (np.zeros(0, np.uint64), np.zeros(0, np.int64), np.zeros(0, np.int64))

    # -- processes --------------------------------------------------------------------------------
    def add_process(self, pid: int, rank: int, job: str) -> None:
        self.procs.setdefault(pid, ProcState(rank, job))
        self._index()

    def forget(self, pid: int) -> None:
        self.procs.pop(pid, None)
        self.zero_pg = {k: v for k, v in self.zero_pg.items() if k[0] != pid}
        self._index()

    def _index(self) -> None:
        pids = sorted(self.procs)
        self.pids = np.array(pids, np.int64)
        self.ranks = np.array([self.procs[p].rank for p in pids], np.int64)
        self._tables()

    def _tables(self) -> None:
        """The sorted (pg pointer, pid, comm index) table of every named group, for codes()."""
        rows = sorted((g, p, c) for p, st in self.procs.items() for g, c in st.codes.items() if g)
        self._comm_table = (np.array([r[0] for r in rows], np.uint64), np.array([r[1] for r in rows], np.int64),
                            np.array([r[2] for r in rows], np.int64))

    def tags_readable(self, pid: int, yes: bool) -> None:
        """GlooFamily.attach: whether the probes read c10d's collective tag in this process."""
        st = self.procs.get(pid)
        if st is not None:
            st.tags = yes

    def rank_of(self, pids: np.ndarray) -> np.ndarray:
        return self.ranks[np.searchsorted(self.pids, pids)]

    def codes(self, out: Builder, pid: np.ndarray, pg: np.ndarray, work: np.ndarray, ts: np.ndarray,
              is_enter: np.ndarray, is_end: np.ndarray) -> np.ndarray:
        """Communicator index of each record (-1: none known, for a start or end of a work we did not
        see entered). Enters name their groups in order of first sight (a CommInit for each new one),
        as the reference does; pg 0 (the API entry was not seen): an enter takes the process's one
        group if it has exactly one, else a group of its own for pg 0, and its start and end take
        what it took. Starts and ends never name a group."""
        # the common case, with no Python step: every row's (pid, pg) named already (a sorted table of
        # every process's groups, by pg pointer; two processes with a group at one address fall through)
        table = self._comm_table
        if len(table[0]):
            at = np.minimum(np.searchsorted(table[0], pg), len(table[0]) - 1)
            if np.count_nonzero((table[0][at] != pg) | (table[1][at] != pid)) == 0:
                return table[2][at]
        zero = pg == 0
        codes = np.full(len(pid), -1, np.int64)
        e = np.flatnonzero(is_enter & ~zero)
        steps = []  # (row, unique pair of an enter's first sight, or -1 for a row of pg 0), in ring order
        if len(e):
            first, inv = group_keys(pid[e], pg[e].view(np.int64))
            steps = [(int(e[f]), u) for u, f in enumerate(first.tolist())]
        steps += [(int(i), -1) for i in np.flatnonzero(zero).tolist()]
        for i, u in sorted(steps):
            p = int(pid[i])
            st = self.procs[p]
            if u >= 0:
                g = int(pg[i])
                got = st.codes.get(g)
                codes[e[inv == u]] = got if got is not None else self._comm_for(out, p, st, g, int(ts[i]))
                continue
            key = (p, int(work[i]))
            if not is_enter[i]:  # an end is the last of its work: forget what its enter took
                codes[i] = self.zero_pg.pop(key, -1) if is_end[i] else self.zero_pg.get(key, -1)
                continue
            if len(st.pgs) == 1:
                code = next(iter(st.codes.values()))
            else:
                code = st.codes.get(0)
                if code is None:
                    code = self._comm_for(out, p, st, 0, int(ts[i]))
            self.zero_pg[key] = codes[i] = code
        rest = np.flatnonzero(~is_enter & ~zero)
        if len(rest):
            first, inv = group_keys(pid[rest], pg[rest].view(np.int64))
            got = np.array([self.procs[int(pid[rest[f]])].codes.get(int(pg[rest[f]]), -1) for f in first.tolist()],
                           np.int64)
            codes[rest] = got[inv]
        return codes

    def failed_end(self, pid: int, ts: int, comm: int, seq: int, lost) -> ev.WorkEnd:
        """The end of a collective gloo failed; `lost`: the first broken connection since the process's
        last good end, if any (PAIR_FAIL: ProcState.lost)."""
        error = "gloo reported an error (finishWorkGlooError)"
        if lost is not None:
            peer, msg = lost
            error += (f"; connection to group rank {peer} broke" if peer >= 0 else "; a connection broke") + \
                (f": {msg}" if msg else "")
        return ev.WorkEnd(pid=pid, rank=self.procs[pid].rank, ts_ns=ts, comm=self.names[comm], seq=seq, ok=False,
                          error=error)

    # -- communicators and the rare records ------------------------------------------------------
    def _comm_for(self, out: Builder, pid: int, st: ProcState, pg: int, ts: int) -> int:
        """The code of group `pg` at its first use: named already, else by its order of creation (seen
        built and never named) or, not seen built (attached mid-run), of first use."""
        code = st.codes.get(pg)
        if code is not None:
            return code
        built = st.built.pop(pg, None)
        if built is not None:
            index, group_rank, size, _ = built
            return self._named(out, pid, st, pg, f"{st.job}/gloo:{index}", group_rank, size, ts)
        st.next_index += 1
        return self._named(out, pid, st, pg, f"{st.job}/gloo:{st.next_index - 1}", -1, -1, ts)

    def _built(self, st: ProcState, pg: int, group_rank: int, size: int, ts: int) -> None:
        """A gloo group built (PG_INIT): named by the setGroupName that follows, or at its first use."""
        if st.codes.pop(pg, None) is not None:  # an address a destroyed group had: a new group
            st.pgs.pop(pg, None)
            self._tables()
        st.built[pg] = (st.next_index, group_rank, size, ts)
        st.next_index += 1
        st.unnamed.append(pg)

    def _named(self, out: Builder, pid: int, st: ProcState, pg: int, comm: str, group_rank: int, size: int,
               ts: int) -> int:
        st.pgs[pg] = (comm, group_rank, size)
        code = st.codes[pg] = len(self.names)
        self.names.append(comm)
        self._tables()
        # Seen at its creation (PG_INIT: group_rank known) -> every count here starts with the group's.
        source = (ev.SEQ_LIBRARY if st.tags else ev.SEQ_FROM_INIT) if group_rank >= 0 else \
            (ev.SEQ_LIBRARY if st.tags else ev.SEQ_FROM_ATTACH)
        out.event(ev.CommInit(pid=pid, rank=st.rank, ts_ns=ts, backend="gloo", comm=comm,
                              group_rank=group_rank, group_size=size, handle=pg, seq_source=source))
        return code

    def rare(self, out: Builder, kind: int, rec) -> bool:
        """One record of a rare kind; False for one that matched nothing (a p2p op's end whose post we
        did not see)."""
        pid = rec.hdr.tgid
        st = self.procs[pid]
        ts = rec.hdr.ts_ns
        if kind == PG_INIT:
            self._built(st, rec.pg, rec.rank, rec.size, ts)
        elif kind == PG_NAME:
            # c10d names a group right after building its backends, on the same thread
            pg = next((g for g in st.unnamed if g in st.built), None)
            st.unnamed.clear()
            if pg is None:
                return True  # a group of another backend (NCCL), or one whose gloo backend we did not see built
            index, group_rank, size, _ = st.built.pop(pg)
            name = rec.name.decode("utf-8", "replace") or str(index)
            self._named(out, pid, st, pg, f"{st.job}/gloo:{name}", group_rank, size, ts)
        elif kind == PAIR_FAIL:
            if st.lost is None:  # the first one: later ones follow from it (the process group is broken)
                st.lost = (rec.peer, gloo_message(rec.msg))
        elif kind == P2P_REC:
            self._p2p(out, pid, st, rec, ts)
        elif kind == P2P_END:
            got = st.p2p.pop(rec.work, None)
            if got is None:
                return False  # posted before we attached
            comm, op, peer, seq = got
            out.event(ev.P2PEnd(pid=pid, rank=st.rank, ts_ns=ts, comm=comm, op=op, peer=peer, seq=seq,
                                ok=bool(rec.ok), error="" if rec.ok else "gloo reported an error (send/recv wait)",
                                wait_ns=rec.wait_ns))
        return True

    def _p2p(self, out: Builder, pid: int, st: ProcState, rec, ts: int) -> None:
        if rec.pg == 0 and len(st.pgs) == 1:
            comm = next(iter(st.pgs.values()))[0]
        else:
            comm = self.names[self._comm_for(out, pid, st, rec.pg, ts)]
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
        out.event(ev.P2P(pid=pid, rank=st.rank, ts_ns=rec.enter_ns or ts, backend="gloo", comm=comm, op=op,
                         peer=rec.peer, tag=rec.tag, seq=seq, nbytes=nbytes, lib_seq=rec.seq))
