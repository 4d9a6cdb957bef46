"""The translator of gloo.bpf.c's records to wire events, a drain at a time (the records:
gloo_records.py; the probes: gloo.py).

CommInit when a process group is built, CollEnter when a rank calls collective `seq`, WorkStart/WorkEnd
when gloo's worker thread runs and finishes it, P2P when a send/recv is posted and P2PEnd when the
wait on it is over. Times stay CLOCK_MONOTONIC ns. The collectives' records (three per collective:
enter; start with sizes; end) are read as arrays and their events leave as rows.Rows (columns), with
no Python step per record; the rare kinds (groups, p2p ops, broken connections) are read one by one,
by gloo_comms.py, which keeps the per-process state (process group pointer -> communicator name, p2p
counters) and drops it when the process is forgotten. Which collective a work is (its group and seq)
is kept by the kernel from its enter to its end and comes with each of its records.

Sizes: CollEnter.nbytes is the per-rank tensor's bytes (the smallest buffer c10d hands gloo, see
gloo.bpf.c), for the ops whose ranks must agree on it (SIZED_OPS). It is measured on gloo's worker
thread when the work runs, after the Python thread's enter, and comes with the work's start, so the
enter of such an op is held until its start comes, the work ends, the process is forgotten, or
HOLD_MS pass (a worker busy with earlier works: the enter then goes out without a size). Its
timestamp is the call's either way; only when the collector sees it moves, by at most HOLD_MS plus
one drain. Count and dtype stay unknown (-1, ""): gloo's buffers carry bytes, not elements.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import numpy as np

from ccld.bpf import records
from ccld.bpf.gloo_comms import GlooComms
from ccld.bpf.gloo_records import HOT_HEAD, KINDS, OP_LIST, WORK_END, WORK_INIT, WORK_START, WorkInit, WorkStart
from ccld.bpf.rows import KIND_COLL, KIND_END, KIND_START, Builder, Groups, group_keys

# Ops whose ranks must all pass the same tensor bytes and whose buffers c10d hands to one of gloo's
# probed algorithm entry points (checked on torch 2.13: all_gather_into_tensor and reduce_scatter_tensor
# run as allgather and allreduce works). Not: barrier (no tensor), alltoall* (uneven splits are legal),
# the sparse allreduce (nnz differs per rank), and the coalesced, list reduce_scatter and *_base works
# (other code paths, not checked): their enters go out at once, without a size.
SIZED_OPS = frozenset({"allreduce", "broadcast", "reduce", "allgather", "gather", "scatter"})
HOLD_MS = 200  # longest an enter waits for its size: gloo's worker normally takes the work within microseconds


@dataclass
class Held:
    """An enter waiting for its size: CollEnter's fields but nbytes."""
    pid: int
    rank: int
    ts_ns: int       # the enter's time (the API entry)
    comm: int        # index into GlooComms.names
    seq: int
    op: int          # index into OP_LIST
    tid: int
    lib_seq: int
    since_ns: int    # the WORK_INIT record's time (HOLD_MS counts from it)
    start_ns: int = 0  # a start that came while it waited (sent right after it); 0: none


_SIZED = np.array([name in SIZED_OPS for name in OP_LIST])
_SLOT_KINDS = np.array([KIND_COLL, KIND_START, KIND_END], np.uint8)
_NB_LIMIT, _COMM_LIMIT = (1 << 34) - 1, 1 << 20  # what fits a group key of one int64 (kind 2, comm 20, op 8 bits)
_SIZED_AT = WorkStart.sized.offset   # byte of a start that says whether an algorithm entry sized it
_REUSE_AT = WorkInit.reuse.offset    # byte of an enter that says its work object's last enter still waits


class GlooTranslator:
    """Records of one GlooFamily -> wire events, a drain at a time. `emit` receives Events (rare kinds:
    communicators, p2p ops, failures) and rows.Rows (enters, starts and ends, as columns).

    What a drain's collective records become, as the reference one-record-at-a-time translator
    (tests/bpf/gloo_reference.py) makes them: an enter of a sized op waits for its size (the next
    record of the same work: its start with the sizes, its end, or a newer enter of a reused work
    object), a start that came while it waited goes right after it; the others go at once. Each drain
    is cut where a rare record is (they change who is who: a new group, a broken connection), and
    each part is done with array operations; enters still waiting pass to the next drain in `held`."""

    def __init__(self, emit: Callable, hold_ns: int = HOLD_MS * 1_000_000):
        self.emit = emit
        self.hold_ns = hold_ns
        self.comms = GlooComms()  # who is who: processes, their groups, communicator names, rare records
        self.unmatched = 0  # start/end records of works we never saw built (e.g. attached mid-collective)
        self.unsized = 0    # enters of SIZED_OPS sent without a size (HOLD_MS passed, or the work ended first)
        self.held: Dict[Tuple[int, int], Held] = {}  # (pid, work) -> enter waiting for its size, oldest first
        self.expired: set = set()  # (pid, work) of enters HOLD_MS sent unsized whose start/end has not come
        self.groups = Groups()
        self._group_ids: Dict[Tuple[int, int, int, int], int] = {}  # (kind, comm, op, nbytes) -> Groups id
        self._table = self.groups.table
        self._gkeys = np.zeros(0, np.int64)  # group keys seen (sorted) and their Groups ids, for _groups_of
        self._gids = np.zeros(0, np.int32)
        self._gtable = None                  # the Groups table those ids are in

    @property
    def abandoned(self) -> int:
        """p2p works rebuilt at the same address before their wait ended (never waited for)."""
        return self.comms.abandoned

    # -- processes --------------------------------------------------------------------------------
    def add_process(self, pid: int, rank: int, job: str) -> None:
        self.comms.add_process(pid, rank, job)

    def tags_readable(self, pid: int, yes: bool) -> None:
        """GlooFamily.attach: whether the probes read c10d's collective tag in this process."""
        self.comms.tags_readable(pid, yes)

    def forget(self, pid: int) -> None:
        if pid in self.comms.procs:  # its last enters still happened: send them before forgetting it
            out = Builder(self.groups)
            for key in [k for k in self.held if k[0] == pid]:
                self._release_one(out, self.held.pop(key), None)
            self.expired = {k for k in self.expired if k[0] != pid}
            self._send(out)
        self.comms.forget(pid)

    def flush(self, now_ns: int) -> None:
        """Send the enters that waited HOLD_MS for a size (their worker is busy with earlier works)."""
        if not self.held:
            return
        out = Builder(self.groups)
        for key, h in list(self.held.items()):
            if now_ns - h.since_ns >= self.hold_ns:
                del self.held[key]
                self.expired.add(key)
                self._release_one(out, h, None)
        self._send(out)

    def _send(self, out: Builder) -> None:
        for item in out.done():
            self.emit(item)

    # -- a drain ----------------------------------------------------------------------------------
    def records(self, rows: np.ndarray, kinds: np.ndarray) -> None:
        """Every record of one drain, in ring order: (n, REC_SIZE) uint8 rows and their kinds."""
        head = records.view(rows, HOT_HEAD)
        known = records.member(head["hdr"]["tgid"], self.comms.pids)
        if not known.all():  # processes we were told to forget; their probes are being detached
            rows, kinds, head = rows[known], kinds[known], head[known]
        n = len(kinds)
        if n == 0:
            return
        # Cut at the rare kinds, and at the two collective records that change a waiting enter
        # without sending it: a start no algorithm entry sized, an enter of a reused work object.
        is_s, is_e = kinds == WORK_START, kinds == WORK_INIT
        odd = ~(is_e | is_s | (kinds == WORK_END))
        odd |= is_s & (rows[:, _SIZED_AT] == 0)
        odd |= is_e & (rows[:, _REUSE_AT] != 0)
        out = Builder(self.groups)
        if not odd.any():
            self._hot(out, rows, kinds, head)
        else:
            a = 0
            for c in np.flatnonzero(odd).tolist() + [n]:
                if c > a:
                    self._hot(out, rows[a:c], kinds[a:c], head[a:c])
                if c < n:
                    k = int(kinds[c])
                    if k == WORK_START:
                        self._start_only(out, KINDS.record(rows[c]))
                    elif k == WORK_INIT:
                        self._reused(out, KINDS.record(rows[c]))
                        self._hot(out, rows[c:c + 1], kinds[c:c + 1], head[c:c + 1])
                    elif not self.comms.rare(out, k, KINDS.record(rows[c])):
                        self.unmatched += 1
                a = c + 1
        self._send(out)


    def _group(self, kind: int, comm: int, op: int = 0, nbytes: int = -1) -> int:
        """The Groups id of the shared fields of a coll (comm, op, nbytes), start or end (comm) row."""
        key = (kind, comm, op, nbytes)
        if self._table is not self.groups.table:  # the table started afresh: our ids are stale
            self._group_ids, self._table = {}, self.groups.table
        got = self._group_ids.get(key)
        if got is None:
            if kind == KIND_COLL:
                same = {"backend": "gloo", "comm": self.comms.names[comm], "op": OP_LIST[op], "count": -1, "dtype": "",
                        "root": -1, "nbytes": nbytes}
            elif kind == KIND_START:
                same = {"comm": self.comms.names[comm]}
            else:
                same = {"comm": self.comms.names[comm], "ok": True, "error": ""}
            got = self.groups.id(kind, same)
            if self._table is not self.groups.table:  # this very id started a new table
                self._group_ids, self._table = {}, self.groups.table
            self._group_ids[key] = got
        return got

    def _groups_of(self, kind: np.ndarray, comm: np.ndarray, op: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Groups ids of rows: from a sorted table of the keys seen before (no Python step), else one
        Python step per distinct (kind, comm, op, nbytes)."""
        if len(comm) == 0:
            return np.zeros(0, np.int32)
        if nbytes.max() >= _NB_LIMIT or comm.max() >= _COMM_LIMIT:  # a key too wide for one int64
            first, inv = group_keys(kind, comm, op, nbytes)
            return np.array([self._group(int(kind[f]), int(comm[f]), int(op[f]), int(nbytes[f]))
                             for f in first.tolist()], np.int32)[inv]
        key = (kind.astype(np.int64) << 62) | (comm << 42) | (op << 34) | (nbytes + 1)
        if self._gtable is self.groups.table and len(self._gkeys):
            at = np.minimum(np.searchsorted(self._gkeys, key), len(self._gkeys) - 1)
            if np.count_nonzero(self._gkeys[at] != key) == 0:
                return self._gids[at]
        _, first, inv = np.unique(key, return_index=True, return_inverse=True)
        while True:
            table = self.groups.table
            ids = np.array([self._group(int(kind[f]), int(comm[f]), int(op[f]), int(nbytes[f]))
                            for f in first.tolist()], np.int32)
            if self.groups.table is table:
                break  # (else the table started afresh on the way: number them all in the new one)
        if self._gtable is not table:
            self._gkeys, self._gids, self._gtable = np.zeros(0, np.int64), np.zeros(0, np.int32), table
        keys, keep = np.unique(np.concatenate([self._gkeys, key[first]]), return_index=True)
        self._gkeys, self._gids = keys, np.concatenate([self._gids, ids])[keep]
        return ids[inv]

    def _hot(self, out: Builder, rows: np.ndarray, kinds: np.ndarray, head: np.ndarray) -> None:
        """One part of a drain: enters, sized starts and ends only, in ring order.

        Each row makes up to three events, at (its position, enter < start < end): an enter of an op
        with no size to wait for goes at once; a start or an end that the kernel marks as the first
        since its enter ("releases") sends a sized op's enter, with the start's size (or none), unless
        HOLD_MS already sent it; then the start (an end's own when no algorithm entry sent one, or
        one that came while the enter waited); then the end. The enters of sized ops no row of this
        part releases wait in `held` for a later one."""
        n = len(kinds)
        hdr = head["hdr"]
        pid = hdr["tgid"].astype(np.int64)
        work = head["work"].astype(np.uint64)
        ts = hdr["ts_ns"].astype(np.int64)
        seq = head["seq"].astype(np.int64)
        is_e, is_s, is_d = kinds == WORK_INIT, kinds == WORK_START, kinds == WORK_END
        comm = self.comms.codes(out, pid, head["pg"].astype(np.uint64), work, ts, is_e, is_d)
        # an enter's fields: its own for an enter, the kernel's copy for a start or an end
        ve, vs, vd = (records.view(rows, KINDS.dtypes[k]) for k in (WORK_INIT, WORK_START, WORK_END))
        e = vs["e"]  # at the same offset in a start and an end
        op = np.where(is_e, ve["op"], e["op"]).astype(np.int64) & 0xFF
        enter_ns = np.where(is_e, ve["enter_ns"], e["enter_ns"]).astype(np.int64)
        lib_seq = np.where(is_e, ve["lib_seq"], e["lib_seq"]).astype(np.int64)
        tid = np.where(is_e, hdr["tid"], e["tid"]).astype(np.int64)
        start_ns = np.where(is_e, 0, vs["start_ns"]).astype(np.int64)
        found = ~is_e & (e["found"] != 0) & (comm >= 0)  # a group we never named: its enter was not seen here
        ok = ~is_d | (vd["ok"] != 0)
        nbytes = np.where(is_s & (vs["nbufs"] > 0), vs["min_bytes"].astype(np.int64), -1)
        self.unmatched += int(np.count_nonzero(~is_e & ~found) + np.count_nonzero(is_d & ~found & (start_ns != 0)))
        sized = _SIZED[op]
        rel = found & (e["releases"] != 0) & sized  # sends a waiting enter
        wait = is_e & sized                         # waits
        held_start = np.zeros(n, np.int64)          # a start that came while the enter waited
        paired = np.zeros(n, bool)                  # releasing rows whose enter is in this part
        if wait.any() and rel.any():
            self._pair(pid, work, rel, wait, paired)
        if self.held or self.expired:
            self._unhold(pid, work, rel & ~paired, rel, held_start)
        self.unsized += int(np.count_nonzero(rel & (nbytes < 0)))
        if wait.any():
            for r in np.flatnonzero(wait).tolist():
                p = int(pid[r])
                self.held[(p, int(work[r]))] = Held(p, self.comms.procs[p].rank, int(enter_ns[r]), int(comm[r]),
                                                    int(seq[r]), int(op[r]), int(tid[r]), int(lib_seq[r]), int(ts[r]))

        # three slots per row (enter, start, end): the rows' slots in C order are the events in order
        coll = (is_e & ~sized) | rel
        st_ts = np.where(start_ns != 0, start_ns, held_start)
        start = found & (is_s | (st_ts != 0))
        end = is_d & found
        mask = np.empty((n, 3), bool)
        mask[:, 0], mask[:, 1], mask[:, 2] = coll, start, end
        per_row = mask.sum(1)
        kind = np.broadcast_to(_SLOT_KINDS, (n, 3))[mask]

        def slots(a, b, c):  # filled in place: np.stack costs ~3x these three copies on a drain's rows
            m = np.empty((n, 3), np.result_type(a, b, c))
            m[:, 0], m[:, 1], m[:, 2] = a, b, c
            return m[mask]
        o_pid, o_seq, o_comm = np.repeat(pid, per_row), np.repeat(seq, per_row), np.repeat(comm, per_row)
        zeros, minus = np.zeros(n, np.int64), np.full(n, -1, np.int64)
        o_ts = slots(enter_ns, st_ts, ts)
        o_op = slots(op, zeros, zeros)
        o_nb = slots(nbytes, minus, minus)
        cols = {"seq": o_seq, "pid": o_pid, "rank": self.comms.rank_of(o_pid), "ts_ns": o_ts,
                "tid": slots(tid, zeros, zeros), "lib_seq": slots(lib_seq, minus, minus)}
        failed = end & ~ok
        if not failed.any():
            out.add(kind, self._groups_of(kind, o_comm, o_op, o_nb), cols)
        else:  # a failed end says which connection broke, if one did since the process's last good end
            o_failed = slots(np.zeros(n, bool), np.zeros(n, bool), failed)
            group = self._groups_of(kind, o_comm, o_op, o_nb)
            o_row = np.repeat(np.arange(n), per_row)
            a = 0
            for f in np.flatnonzero(o_failed).tolist():
                out.add(kind[a:f], group[a:f], {c: x[a:f] for c, x in cols.items()})
                p = int(o_pid[f])
                cleared = bool(np.any(end & ok & (pid == p) & (np.arange(n) < o_row[f])))
                out.event(self.comms.failed_end(p, int(o_ts[f]), int(o_comm[f]), int(o_seq[f]),
                                                None if cleared else self.comms.procs[p].lost))
                a = f + 1
            out.add(kind[a:], group[a:], {c: x[a:] for c, x in cols.items()})
        good = end & ok
        if good.any():
            for p in np.unique(pid[good]).tolist():
                self.comms.procs[int(p)].lost = None

    @staticmethod
    def _pair(pid, work, rel, wait, paired) -> None:
        """A waiting enter whose (pid, work) has a releasing row after it in this part waits no more
        (`wait` cleared for it, `paired` set for that row). The kernel marks only the first start or
        end after an enter, so the next of the two kinds in the same (pid, work) is the one."""
        idx = np.flatnonzero(wait | rel)
        order = idx[np.lexsort((idx, work[idx], pid[idx]))]
        op, ow = pid[order], work[order]
        # hit[i]: row order[i] waits and the next row in (pid, work) order releases the same work
        # (slices, not np.r_: its index machinery costs ~10 us a call, a drain's worth of work here)
        hit = wait[order]
        hit[-1:] = False
        hit[:-1] &= (op[1:] == op[:-1]) & (ow[1:] == ow[:-1]) & rel[order][1:]
        wait[order[hit]] = False
        paired[order[1:][hit[:-1]]] = True

    def _unhold(self, pid, work, todo, rel, held_start) -> None:
        """A releasing row whose enter came in an earlier part (`todo`) takes it out of `held` (with
        the start that came while it waited), or, if HOLD_MS sent it already, sends no enter again
        (`rel` cleared). Only when enters waited across parts: one Python step per such row."""
        for i in np.flatnonzero(todo).tolist():
            key = (int(pid[i]), int(work[i]))
            h = self.held.pop(key, None)
            if h is not None:
                held_start[i] = h.start_ns
            elif key in self.expired:
                self.expired.discard(key)
                rel[i] = False

    def _reused(self, out: Builder, rec) -> None:
        """An enter of a work object whose last enter still waits (that work never started nor ended):
        the older one goes now, without a size."""
        key = (rec.hdr.tgid, rec.work)
        self.expired.discard(key)
        h = self.held.pop(key, None)
        if h is not None:
            self._release_one(out, h, None)

    def _start_only(self, out: Builder, rec) -> None:
        """A start no algorithm entry sized: it goes with its enter if that still waits, else at once."""
        pid, work = rec.hdr.tgid, rec.work
        comm = self.comms.codes(out, np.array([pid], np.int64), np.array([rec.pg], np.uint64),
                                np.array([work], np.uint64), np.array([rec.hdr.ts_ns], np.int64),
                                np.zeros(1, bool), np.zeros(1, bool))[0]
        if not rec.e.found or comm < 0:
            self.unmatched += 1
            return
        h = self.held.get((pid, work))
        if h is not None:
            h.start_ns = rec.start_ns
        else:
            out.one(KIND_START, self._group(KIND_START, int(comm)), rec.seq, pid, self.comms.procs[pid].rank,
                    rec.start_ns)


    def _release_one(self, out: Builder, h: Held, nbytes: Optional[int]) -> None:
        """Send one waiting enter (and the start that came while it waited)."""
        if nbytes is None:
            self.unsized += 1
        out.one(KIND_COLL, self._group(KIND_COLL, h.comm, h.op, -1 if nbytes is None else nbytes), h.seq, h.pid,
                h.rank, h.ts_ns, h.tid, h.lib_seq)
        if h.start_ns:
            out.one(KIND_START, self._group(KIND_START, h.comm), h.seq, h.pid, h.rank, h.start_ns)

