"""Multi-node scenarios: a pipeline whose stages and data-parallel peers sit on different simulated
nodes (tests/multinode.py: a network namespace per node, an agent per node, the collector on its own
host across the bridge), and faults on one link between two nodes at a time.

The job: pipeline_job.py with 2 stages x 2 data-parallel replicas, 4 ranks, no loss all_reduce, so
every rank pair that talks is one of the pipeline links (0-2, 1-3) or the dp links (0-1, 2-3):
  node 0: rank 0 (stage 0, d0)   node 1: rank 1 (stage 0, d1)   node 2: ranks 2, 3 (stage 1)
so each pair of nodes carries exactly one rank link, and a fault between two nodes is a fault on
that one link:
  nodes 0-2 rate-limited (20 Mbit/s)   the stage link 0-2          -> comm-slow, link [0, 2]
  nodes 0-1 lossy (5 % of 0's packets)  the dp link 0-1             -> comm-slow, link [0, 1]
  nodes 1-2 blackholed                  the stage link 1-3          -> fault, link [1, 3]
One job serves all three, in that order, after SLOW_BASELINE_S of healthy running (the link
localiser learns each pair's own baseline; the healthy part is a scenario too); each fault is
cleared, and its finding given RECOVER_S to recover, before the next. Findings are cut by time:
each phase owns what was found from its onset to the next one's. Onsets: the moment the fault was
put on. Budget: ~3-5 minutes (3 agents and 4 ranks start in ~30 s on 2 vCPUs).
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Any, Dict, List, Optional

from fault_scenarios import (PROGRESS, SETTLE_S, SLOW_BASELINE_S, START_TIMEOUT_S, TERMINAL, WAIT_MARGIN_S, WORKLOADS,
                             Result, Session)
from scenarios import HANG_DEADLINE_S, SLOW_DEADLINE_S, Scenario, is_real, register_job

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: netbed, multinode

LAYOUT = [0, 1, 2, 2]     # rank -> node (see the header)
RATE = "20mbit"           # a 256 KiB activation takes ~100 ms instead of < 1 ms
LOSS = 0.05
RATE_WINDOW_S = 20.0      # the job's step rate is compared over this long before each fault and while it lasts
RECOVER_S = 30.0          # a cleared fault's finding has this long to be resolved before the next fault
JOB = ["--stages", 2, "--dp", 2, "--no-loss-allreduce", "--elems", 65536, "--steps", 1000000, "--progress-every", 10,
       "--timeout-s", 900]


def _wait(cond, timeout: float, mb, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = cond()
        if got:
            return got
        if any(p.poll() is not None for p in mb.agents + [mb.collector] + mb.job):
            break
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}\n{mb.logs()[-6000:]}")


def _expect(mb, cls: str, after: float, deadline_s: float) -> Optional[Dict[str, Any]]:
    """The first real finding of `cls` detected after `after`, waiting up to the deadline (+ margin)."""
    end = after + deadline_s + WAIT_MARGIN_S
    while time.time() < end:
        got = [f for f in mb.findings_list() if is_real(f) and f.get("class") == cls and f["detected_at"] >= after]
        if got:
            time.sleep(SETTLE_S)
            return got[0]
        time.sleep(0.25)
    return None


def _recovered(mb, f: Optional[Dict[str, Any]]) -> None:
    if f is None:
        time.sleep(5)  # nothing to recover: let the cleared link settle
        return
    end = time.time() + RECOVER_S
    while time.time() < end:
        if any(r.get("kind") == "recovered" and r.get("id") == f.get("id") for r in mb.findings_list()):
            return
        time.sleep(0.25)


def _rate(mb, t0: float, t1: float) -> Optional[float]:
    """Rank 0's steps per second between Unix times t0 and t1 (its --progress-every lines)."""
    pts = [(int(m.group(2)), float(m.group(3))) for m in PROGRESS.finditer(mb.log("rank0.log"))
           if t0 <= float(m.group(3)) <= t1]
    if len(pts) < 2:
        return 0.0 if pts or t1 - t0 > 5 else None
    return round((pts[-1][0] - pts[0][0]) / (pts[-1][1] - pts[0][1]), 2)


def pipeline_links(s: Session) -> Dict[str, Result]:
    from multinode import MultiNodeBed
    mb = MultiNodeBed(nodes=3, layout=LAYOUT)
    s.closers.append(mb.close)
    go = os.path.join(mb.workdir, "go")
    mb.start_collector()
    mb.start_job(JOB + ["--wait-file", go], script=os.path.join(WORKLOADS, "pipeline_job.py"))
    mb.start_agents(probes="gloo,net,sched")
    _wait(lambda: all("ccld agent: tracing" in mb.log(f"agent{n}.log") for n in range(3)), START_TIMEOUT_S, mb,
          "3 agents tracing")
    open(go, "w").close()
    _wait(lambda: min(mb.steps()) >= 10, START_TIMEOUT_S, mb, "the job's first steps")
    t_start = time.time()
    time.sleep(SLOW_BASELINE_S)
    marks: List[float] = []
    notes: Dict[str, Any] = {}
    bed = mb.bed
    for key, fault, cls, deadline in (
            ("node-slow-link", lambda: bed.rate_limit_pair(0, 2, RATE), "comm-slow", SLOW_DEADLINE_S),
            ("node-lossy-link", lambda: bed.loss(0, 1, LOSS), "comm-slow", SLOW_DEADLINE_S),
            ("node-cut-link", lambda: bed.blackhole(1, 2), "fault", HANG_DEADLINE_S)):
        fault()
        marks.append(time.time())
        f = _expect(mb, cls, marks[-1], deadline)
        bed.clear_faults()
        notes[key] = {"steps_per_s_before": _rate(mb, marks[-1] - RATE_WINDOW_S, marks[-1]),
                      "steps_per_s_during": _rate(mb, marks[-1], time.time())}  # did the fault bite?
        if key != "node-cut-link":
            _recovered(mb, f)
    mb.stop_job()
    mb.stop_tracing()
    logs = os.path.join(s.tmp, "node-links")  # the bed's own directory goes with it at close
    shutil.copytree(mb.workdir, logs, ignore=shutil.ignore_patterns("store", "keys", "allow"), dirs_exist_ok=True)
    findings = mb.findings_list()
    printed = [m.group(0) for m in TERMINAL.finditer(mb.log("collector.log"))]
    ends = marks[1:] + [None]

    def cut(name, cls, onset, until, link=None):
        fs = [f for f in findings if f.get("detected_at", 0) >= (onset or 0)
              and (until is None or f.get("detected_at", 0) < until)]
        return Result(name, cls, [], onset=onset, findings=fs, ran_s=time.time() - t_start, log=logs,
                      notes=dict(notes, link=link), healthy_s=(until - t_start) if cls is None else 0.0,
                      baseline_s=None if onset is None else onset - t_start, terminal=printed)
    return {"node-baseline": cut("pipeline across 3 nodes, healthy", None, None, marks[0]),
            "node-slow-link": cut("rate limit between two stages", "comm-slow", marks[0], ends[0], [0, 2]),
            "node-lossy-link": cut("loss between two dp peers", "comm-slow", marks[1], ends[1], [0, 1]),
            "node-cut-link": cut("blackhole between two stages", "fault", marks[2], ends[2], [1, 3])}


def _register() -> None:
    netns = ("netns",)
    register_job("node-links", pipeline_links,
                 Scenario("node-baseline", "healthy: a pipeline across 3 nodes (an agent each)", "multinode", None, [],
                          kind="healthy", needs=netns),
                 Scenario("node-slow-link", "comm-slow: a rate-limited link between two stages on two nodes",
                          "multinode", "comm-slow", [], link=[0, 2], kind="slow", deadline_s=SLOW_DEADLINE_S,
                          needs=netns),
                 Scenario("node-lossy-link", "comm-slow: a lossy link between two dp peers on two nodes", "multinode",
                          "comm-slow", [], link=[0, 1], kind="slow", deadline_s=SLOW_DEADLINE_S, needs=netns),
                 Scenario("node-cut-link", "fault: a blackholed link between two stages on two nodes", "multinode",
                          "fault", [], link=[1, 3], needs=netns))


_register()
