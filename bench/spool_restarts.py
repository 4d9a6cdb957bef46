"""Spool and acknowledged replay: a real `ccld collector` process SIGKILLed and restarted on its store
again and again while the agent's shipper (disk spool, acks) ships a synthetic 4-rank job; then one
outage longer than the spool's bound; then how long a restarted collector takes to learn what a big
store holds.

Phase 1 (within the bound): every collective the job made must be in the store exactly once after
--restarts SIGKILLs, each after 1.5-4 s of traffic, the collector away 1-4 s. Phase 2 (beyond it): a
1 MiB spool, the collector away ~3x as long as that holds; every frame missing from the store must be
one the agent counted (dropped, never sent; or evicted while unacknowledged), and what arrived arrives
once. Phase 3: AckBook.rebuild over a store of --rebuild-frames frames.
The shipper runs in this process (no root, no probes); the collector is the `ccld collector` command.
Units: frames, events, seconds. Caveat: on 2 shared CPUs the timing figures move run to run.

    .venv/bin/python bench/spool_restarts.py                  # print
    .venv/bin/python bench/spool_restarts.py --write-results  # and update bench/RESULTS.md (spool section)
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ccld import wire as ev  # noqa: E402
from ccld.collector.acks import AckBook  # noqa: E402
from ccld.store import StoreWriter, read_store  # noqa: E402
from ccld.tracer import shipper as sh  # noqa: E402
from ccld.tracer.spool import Spool  # noqa: E402
from ccld.collector.timesvc import free_port_pair  # noqa: E402
from fuzz_collector import machine  # noqa: E402
from results import write_section  # noqa: E402

AGENT = "bench-node:1:spool0"
RANKS = 4
OPS_PER_S = 150          # collectives per second (each rank enters each): ~1,200 events/s with start/end
START_TIMEOUT_S = 30.0




class CollectorProc:
    """`ccld collector` on a fixed port and store, started and SIGKILLed as the bench says."""

    def __init__(self, port: int, store: str, logdir: str):
        self.port, self.store, self.logdir, self.runs = port, store, logdir, 0
        self.proc = None

    def start(self) -> None:
        self.runs += 1
        log = os.path.join(self.logdir, f"collector-{self.runs}.log")
        self.proc = subprocess.Popen([sys.executable, "-m", "ccld.cli", "collector", "--listen",
                                      f"tcp://127.0.0.1:{self.port}", "--store", self.store],
                                     stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while "listening on" not in open(log).read():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"collector did not start: {open(log).read()[-2000:]}")
            time.sleep(0.05)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(60)


class Job:
    """A synthetic 4-rank job: every 1/OPS_PER_S s each rank enters, starts and ends collective seq
    (these travel as column blocks: ~16 B an event); with `pad`, each rank also reports a /proc state
    of that many bytes (a plain event), to fill a spool sooner."""

    def __init__(self, shipper: sh.Shipper, pad: int = 0):
        self.shipper, self.pad, self.seq = shipper, pad, 0
        self.put_s_max = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            self.seq += 1
            t0 = time.monotonic()
            now = time.monotonic_ns()
            for r in range(RANKS):
                self.shipper.put(ev.CollEnter(pid=100 + r, rank=r, ts_ns=now, backend="gloo", comm="job/gloo:0",
                                              seq=self.seq, op="allreduce", count=16, dtype="float32"))
                if self.pad:
                    self.shipper.put(ev.RankState(pid=100 + r, rank=r, ts_ns=now, state="R", wchan="w" * self.pad))
                self.shipper.put(ev.WorkStart(pid=100 + r, rank=r, ts_ns=now + 1, comm="job/gloo:0", seq=self.seq))
                self.shipper.put(ev.WorkEnd(pid=100 + r, rank=r, ts_ns=now + 2, comm="job/gloo:0", seq=self.seq))
            self.put_s_max = max(self.put_s_max, time.monotonic() - t0)
            next_at += 1 / OPS_PER_S
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def start(self) -> "Job":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def scan(store: str) -> Dict[str, Any]:
    """What the store holds of AGENT: collective enters per (rank, seq), batches, the latest loss counters."""
    enters, batches, loss = collections.Counter(), collections.Counter(), {}
    problems: List[str] = []
    for _, frame in read_store(store, problems):
        b = ev.decode_batch(frame)
        if b.agent != AGENT:
            continue
        batches[b.batch] += 1
        for e in b.events:
            if e.KIND == "coll":
                enters[(e.rank, e.seq)] += 1
            elif e.KIND == "loss":
                loss = e.counters
    return {"enters": enters, "batches": batches, "loss": loss, "problems": [p.kind for p in problems]}


def wait_acked(s: sh.Shipper, timeout_s: float) -> bool:
    last = s.last_batch
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if s.spool.acked(AGENT) >= last:
            return True
        time.sleep(0.05)
    return False


def phase_restarts(root: str, restarts: int, rng: random.Random) -> Dict[str, Any]:
    port, store = free_port_pair(), os.path.join(root, "store-1")
    col = CollectorProc(port, store, root)
    col.start()
    said: List[str] = []
    spool = Spool(os.path.join(root, "spool-1"), collector=f"tcp://127.0.0.1:{port}", say=said.append).open()
    s = sh.Shipper(f"tcp://127.0.0.1:{port}", AGENT, "bench-node", spool=spool,
                   acks=f"tcp://127.0.0.1:{port + 1}", say=said.append).start()
    job = Job(s).start()
    outages = []
    t0 = time.monotonic()
    try:
        for _ in range(restarts):
            time.sleep(rng.uniform(1.5, 4.0))
            col.kill()
            away = rng.uniform(1.0, 4.0)
            time.sleep(away)
            col.start()
            outages.append(round(away, 1))
        time.sleep(3.0)
        job.stop()
        acked = wait_acked(s, 30)
    finally:
        job.stop()
        s.close(timeout_s=5)
        col.stop()
    took = time.monotonic() - t0
    got = scan(store)
    st = s.stats()
    want = {(r, q) for r in range(RANKS) for q in range(1, job.seq + 1)}
    missing = len(want - set(got["enters"]))
    dup = sum(1 for c in got["enters"].values() if c > 1)
    rewinds = [int(m) for line in said for m in re.findall(r"sending again the (\d+) frames", line)]
    with open(os.path.join(store, "stats.json")) as f:
        last_stats = json.load(f)
    return {"restarts": restarts, "outages_s": outages, "seconds": round(took, 1), "collectives": job.seq,
            "events_put": job.seq * RANKS * 3, "acked_at_end": acked, "frames_sent": st["sent_frames"],
            "frames_replayed": st["spool_replayed_frames"], "rewinds": rewinds,
            "restarts_seen": st["collector_restarts"], "disconnects": st["disconnects"],
            "enters_missing": missing, "enters_duplicated": dup, "batch_duplicated": sum(
                1 for c in got["batches"].values() if c > 1),
            "events_lost_counted": st["queue_dropped"] + st["spool_dropped_events"],
            "unacked_evicted": st["spool_unacked_evicted_frames"], "put_ms_max": round(job.put_s_max * 1000, 2),
            "store_problems": dict(collections.Counter(got["problems"])),
            "last_run_duplicates": last_stats.get("frames_duplicate"),
            "last_run_rebuilt": last_stats.get("ack_rebuilt_frames"),
            "store_mib": round(sum(os.path.getsize(os.path.join(store, n)) for n in os.listdir(store)
                                   if n.endswith(".ccld")) / 2**20, 2)}


def phase_overflow(root: str, bound_mib: float) -> Dict[str, Any]:
    port, store = free_port_pair(), os.path.join(root, "store-2")
    col = CollectorProc(port, store, root)
    col.start()
    spool = Spool(os.path.join(root, "spool-2"), max_bytes=int(bound_mib * 2**20),
                  collector=f"tcp://127.0.0.1:{port}", say=lambda line: None).open()
    s = sh.Shipper(f"tcp://127.0.0.1:{port}", AGENT, "bench-node", spool=spool,
                   acks=f"tcp://127.0.0.1:{port + 1}", say=lambda line: None).start()
    job = Job(s, pad=200).start()
    try:
        time.sleep(3.0)
        t0 = time.monotonic()
        col.kill()
        while spool.disk_bytes < spool.max_bytes * 0.5 and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        half_s = time.monotonic() - t0
        away = max(5.0, 4 * half_s)  # ~2x what the spool holds
        time.sleep(max(0.0, away - half_s))
        col.start()
        time.sleep(3.0)
        job.stop()
        acked = wait_acked(s, 30)
        time.sleep(sh.LOSS_EVERY_S + 0.5)  # the latest loss counters reach the store
        wait_acked(s, 10)
    finally:
        job.stop()
        s.close(timeout_s=5)
        col.stop()
    got = scan(store)
    st = s.stats()
    last = s.last_batch
    missing_batches = sorted(set(range(1, last + 1)) - set(got["batches"]))
    want = {(r, q) for r in range(RANKS) for q in range(1, job.seq + 1)}
    return {"bound_mib": bound_mib, "away_s": round(away, 1), "acked_at_end": acked, "frames_made": last,
            "frames_missing": len(missing_batches), "frames_dropped_counted": st["spool_dropped_frames"],
            "frames_unacked_evicted": st["spool_unacked_evicted_frames"],
            "events_dropped_counted": st["spool_dropped_events"],
            "enters_missing": len(want - set(got["enters"])), "enters_put": len(want),
            "enters_duplicated": sum(1 for c in got["enters"].values() if c > 1),
            "reported_to_collector": {k: got["loss"].get(k) for k in ("spool_dropped_frames", "spool_dropped_events",
                                                                       "spool_unacked_evicted_frames")},
            "accounted": st["spool_dropped_frames"] <= len(missing_batches)
            <= st["spool_dropped_frames"] + st["spool_unacked_evicted_frames"],
            "put_ms_max": round(job.put_s_max * 1000, 2)}


def phase_rebuild(root: str, frames: int) -> Dict[str, Any]:
    store = os.path.join(root, "store-3")
    w = StoreWriter(store, fsync=False)
    evs = [ev.CollEnter(pid=100 + r, rank=r, ts_ns=r, backend="gloo", comm="job/gloo:0", seq=1, op="allreduce")
           for r in range(8)] + [ev.ClockSample(mono_ns=1, wall_ns=1)]
    for i in range(1, frames + 1):
        w.append(ev.encode_batch(f"node-{i % 16}:1:ab", f"node-{i % 16}", i // 16 + 1, evs, resend=True), 1.0)
    w.close()
    nbytes = sum(os.path.getsize(os.path.join(store, n)) for n in os.listdir(store) if n.endswith(".ccld"))
    book = AckBook()
    t0 = time.perf_counter()
    book.rebuild(store)
    dt = time.perf_counter() - t0
    return {"frames": frames, "frame_bytes": round(nbytes / frames), "mib": round(nbytes / 2**20, 1),
            "seconds": round(dt, 2),
            "frames_per_s": round(frames / dt), "mib_per_s": round(nbytes / 2**20 / dt, 1),
            "found": book.rebuilt_frames}


def results_md(r: Dict[str, Any], cmd: str) -> str:
    a, b, c = r["restarts"], r["overflow"], r["rebuild"]
    return "\n".join([
        "## Spool: collector restarts, acknowledged replay, overflow",
        "",
        f"`{cmd}` on {datetime.date.today().isoformat()}, {machine()}.",
        "",
        "The agent's shipper (disk spool, acks on the time service) in the bench process; the collector is "
        "the `ccld collector` command, SIGKILLed and restarted on its store. A synthetic 4-rank job: "
        f"{OPS_PER_S} collectives/s, each entered, started and ended by every rank.",
        "",
        "| figure | value |", "|---|---|",
        f"| collector SIGKILLs survived (within the 256 MiB bound) | {a['restarts']} in {a['seconds']} s, away "
        f"{', '.join(f'{x:g}' for x in a['outages_s'])} s |",
        f"| collectives / events the job made | {a['collectives']:,} / {a['events_put']:,} |",
        f"| frames sent / replayed (sent again after a restart) | {a['frames_sent']:,} / {a['frames_replayed']:,} "
        f"(per restart, sent to the killed collector and not acknowledged: {', '.join(map(str, a['rewinds']))}) |",
        f"| collective enters missing / duplicated in the store | {a['enters_missing']} / {a['enters_duplicated']} |",
        f"| events lost, as counted by the agent | {a['events_lost_counted']} |",
        f"| restarts and disconnects the agent saw | {a['restarts_seen']} / {a['disconnects']} |",
        f"| the last collector: resendable frames found in the store at start / replayed copies dropped | "
        f"{a['last_run_rebuilt']:,} / {a['last_run_duplicates']} |",
        f"| store problems reported (the SIGKILLs) | {json.dumps(a['store_problems'])} |",
        f"| longest put() of one collective's 12 events (bench thread; the GIL is shared with the sender, "
        f"not with the traced job) | {a['put_ms_max']} ms |",
        f"| outage beyond the bound | {b['bound_mib']:g} MiB spool, collector away {b['away_s']} s |",
        f"| frames made / missing from the store | {b['frames_made']:,} / {b['frames_missing']:,} |",
        f"| counted by the agent: dropped (never sent) / evicted unacknowledged | {b['frames_dropped_counted']:,} / "
        f"{b['frames_unacked_evicted']} ({b['events_dropped_counted']:,} events); every missing frame counted: "
        f"{'yes' if b['accounted'] else 'NO'} |",
        f"| collective enters missing / duplicated | {b['enters_missing']:,} of {b['enters_put']:,} / "
        f"{b['enters_duplicated']} |",
        f"| loss counters in the store (reported to the collector) | {json.dumps(b['reported_to_collector'])} |",
        f"| a restarted collector reads its store's envelopes | {c['frames']:,} frames of {c['frame_bytes']} B "
        f"({c['mib']} MiB) in "
        f"{c['seconds']} s: {c['frames_per_s']:,} frames/s, {c['mib_per_s']} MiB/s |",
        "",
        "Acknowledged means handed to the OS and fsynced by the collector's store (it fsyncs every 0.5 s), so "
        "an agent holds ~1 s of frames when all is well. Within the bound nothing is lost and nothing is "
        "stored twice; beyond it the oldest frames go, and every frame missing from the store is one the agent "
        "counted (and reported in its loss counters).",
    ])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--restarts", type=int, default=5)
    p.add_argument("--overflow-mib", type=float, default=1.0)
    p.add_argument("--rebuild-frames", type=int, default=200_000)
    p.add_argument("--seed", type=int, default=8)
    p.add_argument("--write-results", action="store_true", help="update bench/RESULTS.md (spool section)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    root = tempfile.mkdtemp(prefix="ccld-spool-bench-")
    try:
        r = {"restarts": phase_restarts(root, a.restarts, random.Random(a.seed)),
             "overflow": phase_overflow(root, a.overflow_mib),
             "rebuild": phase_rebuild(root, a.rebuild_frames)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(r, indent=1, default=str))
    x, y = r["restarts"], r["overflow"]
    bad = (x["enters_missing"] or x["enters_duplicated"] or x["events_lost_counted"] or not x["acked_at_end"]
           or y["enters_duplicated"] or not y["accounted"])
    if a.write_results:
        cmd = f"python bench/spool_restarts.py --restarts {a.restarts} --overflow-mib {a.overflow_mib:g}"
        write_section("spool", results_md(r, cmd))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
