"""Many nodes, one timeline: 3 simulated nodes x 2 ranks (tests/multinode.py), each node's agent on a
clock seconds off and tens of ppm fast or slow (CCLD_TEST_CLOCK), one collector across the bridge
with CurveZMQ keys. Checked against the truth (the transforms are known):
  - after 30 s of clock sync, the collector's estimate of every node's clock is within 50 us, or within
    the uncertainty it states for that node where that is wider (a busy box), and so is each arrival;
  - the timeline orders arrivals as they happened: every pair of ranks on different nodes whose true
    arrival times differ by more than 100 us (after 30 s), or by more than the collector's stated
    pair uncertainty (from 5 s after the first estimates), is in the right order; without alignment
    it would be off by each node's shift (its offset plus its drift over the machine's uptime);
  - a hang (rank 4 never enters a collective) is found and localized to rank 4 alone, as on one node;
  - `ccld diagnose` shows every node's offset, drift and uncertainty;
  - a rate limit on the link between nodes 1 and 2 is named as the one ring link it slows (ranks 3
    and 4), as tests/e2e/test_links_e2e.py names a link with one rank per namespace.
Budget: ~1.5 minutes per test (6 ranks importing torch and 3 agents compiling BPF on a shared 2-core box).
"""
import json
import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: netbed, multinode
from conftest import bpf_skip_reason  # noqa: E402
from netbed import skip_reason  # noqa: E402

_SKIP = skip_reason() or bpf_skip_reason()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]

from multinode import CCLD, MultiNodeBed  # noqa: E402

CLOCKS = ["-2.5,30", "4.0,-45", "1.25,15"]   # per node: offset s, drift ppm
TOLERANCE_NS = 50_000
SYNC_S = 30.0                 # the estimate must be within TOLERANCE_NS after this much clock sync
SETTLE_S = 5.0                # ... and arrivals are ordered beyond the stated uncertainty from this long after the
                              # first estimates (before, they were converted with the first, wider ones)
HANG_RANK, HANG_STEP = 4, 420  # steps take >= 100 ms (--step-sleep-ms): the hang comes after >= 42 s
START_TIMEOUT_S = 150.0
HANG_DEADLINE_S = 60.0
JOB = ["--steps", "100000", "--ops", "allreduce,allgather", "--elems", "1024", "--compute-ms", "1",
       "--step-sleep-ms", "100", "--progress-every", "10", "--timeout-s", "300",
       "--hang-rank", str(HANG_RANK), "--hang-step", str(HANG_STEP)]


def wait_for(what, cond, timeout, mb):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        if any(p.poll() is not None for p in mb.agents + [mb.collector]):
            break
        time.sleep(0.5)
    found = [{k: x.get(k) for k in ("class", "ranks", "link", "evidence")} for x in mb.findings_list()]
    pytest.fail(f"timed out waiting for {what}\nfindings (last 3): {json.dumps(found[-3:])[:6000]}\n"
                f"{mb.logs(tail=600)}")


def estimate_errors_ns(mb, stats):
    """Per node: the collector's conversion of its clock minus the truth, at its latest estimate."""
    anchor = stats["time_service"]["anchor_ns"]
    out = {}
    for agent, d in stats["clock"].items():
        n = mb.node_of_agent(agent)
        out[n] = (d["offset_ns"] + d["at_ns"]) - mb.truth_unix_ns(n, d["at_ns"], anchor)
    return out


def raw_enters(store):
    """(comm, seq) -> {rank: (node, ts_ns on that node's clock)} from the stored frames."""
    from ccld import wire as ev
    from ccld.store import read_store
    out = {}
    for _, frame in read_store(store, []):
        b = ev.decode_batch(frame)
        for e in b.events:
            if isinstance(e, ev.CollEnter):
                out.setdefault((e.comm, e.seq), {})[e.rank] = (b.agent, e.ts_ns)
    return out


def test_three_nodes_one_timeline(tmp_path):
    with MultiNodeBed(nodes=3, ranks_per_node=2, clocks=CLOCKS) as mb:
        mb.start_collector()
        go = os.path.join(mb.workdir, "go")
        mb.start_job(JOB + ["--wait-file", go])
        mb.start_agents(probes="gloo")
        wait_for("3 agents tracing", lambda: all("ccld agent: tracing" in mb.log(f"agent{n}.log")
                                                 for n in range(3)), START_TIMEOUT_S, mb)
        wait_for("a clock estimate from each node",
                 lambda: len([d for d in (mb.stats().get("clock") or {}).values()
                              if d["source"].startswith("sync")]) == 3, 60, mb)
        synced_at = time.monotonic()
        with open(go, "w"):
            pass
        wait_for("the job's first steps", lambda: min(mb.steps()) >= 10, START_TIMEOUT_S, mb)

        # 1. the live estimate, from the collector's stats.json (rewritten every 2 s)
        time.sleep(max(0.0, synced_at + SYNC_S + 3 - time.monotonic()))
        stats = mb.stats()
        errs = estimate_errors_ns(mb, stats)
        print("estimate error after 30 s (us):", {n: round(e / 1e3, 1) for n, e in sorted(errs.items())})
        # within the goal, or, on a box noisier than that, within the uncertainty the collector states
        # (its own claim; bench/clock_align.py measures the goal: worst 42 us from 30 s there)
        bound = {mb.node_of_agent(a): max(TOLERANCE_NS, d["uncertainty_us"] * 1e3) for a, d in stats["clock"].items()}
        assert len(errs) == 3 and all(abs(e) <= bound[n] for n, e in errs.items()), (errs, stats["clock"])
        for agent, d in stats["clock"].items():
            # the agents' wall pairs alone would be off by the node's whole shift. That shift is the
            # offset plus the drift over this machine's uptime (nodeclock.py), so it is not always
            # seconds: -2.5 s + 30 ppm x 23 h is 0. The estimate above is within the bound regardless.
            n = mb.node_of_agent(agent)
            wall_err = d["wall_offset_ns"] + d["at_ns"] - mb.truth_unix_ns(n, d["at_ns"],
                                                                        stats["time_service"]["anchor_ns"])
            shift = mb.clocks[n].shift(round(mb.clocks[n].invert(d["at_ns"])))
            assert abs(wall_err - shift) < 50e6, (agent, wall_err, shift)
            drift = -mb.clocks[n].drift_ppb / 1e3
            # 2 ppm, or on a noisier box what the stated uncertainty covers: a drift error of x ppm over
            # the SYNC_S of round trips moves the offset by x us a second (a CI-like run of 863046b was
            # 2.1 ppm off on one node, once in three runs)
            assert d["drift_ppm"] == pytest.approx(drift, abs=max(2.0, d["uncertainty_us"] / SYNC_S)), (agent, d)

        # 2. the hang, localized as on one node
        f = wait_for("the hang finding", lambda: next(
            (x for x in mb.findings_list() if x.get("kind") == "hang"), None), HANG_DEADLINE_S + 60, mb)
        assert f["class"] == "not-entered" and f["ranks"] == [HANG_RANK], f
        # nothing else is blamed (a slowdown that names no rank, which a busy 2-core box can cause, blames nobody)
        wrong = [x for x in mb.findings_list() if x.get("kind") in ("hang", "slow")
                 and (x.get("ranks") or x.get("link")) and x.get("ranks") != [HANG_RANK]]
        assert not wrong, json.dumps(wrong)[:3000]
        mb.stop_tracing()

        # 3. arrivals in the right order (the store replayed: the timeline the collector built)
        from ccld.timeline.ingest import load_timeline
        tl = load_timeline(mb.store)
        anchor = stats["time_service"]["anchor_ns"]
        raw = raw_enters(mb.store)
        late_after = (synced_at - time.monotonic()) + time.time() + SYNC_S  # Unix s, roughly
        # The stated uncertainty is the collector's latest; a collective of the first seconds was
        # converted with the first, wider estimates (seen: 170 us off at seq 2 against a final 110 us)
        settled_after = late_after - SYNC_S + SETTLE_S
        checked = checked_late = 0
        worst = excess = 0.0
        stated = {a: d["uncertainty_us"] / 1e6 for a, d in tl.clock.summary().items()}
        for comm in tl.comms.values():
            for seq, view in comm.colls.items():
                got = raw.get((comm.id, seq), {})
                truth = {r: mb.truth_unix_ns(mb.node_of_agent(a), ts, anchor) / 1e9 for r, (a, ts) in got.items()}
                ranks = sorted(set(truth) & set(view.enter))
                late = view.first_enter() is not None and view.first_enter() > late_after
                settled = view.first_enter() is not None and view.first_enter() > settled_after
                for r in ranks:
                    if late:
                        err = abs(view.enter[r] - truth[r])
                        worst = max(worst, err)
                        # beyond the uncertainty the collector states for that node (its own claim)
                        excess = max(excess, err - max(TOLERANCE_NS / 1e9, stated[got[r][0]]))
                for i, a in enumerate(ranks):
                    for b in ranks[i + 1:]:
                        if mb.node_of(a) == mb.node_of(b):
                            continue
                        true_d = truth[a] - truth[b]
                        seen_d = view.enter[a] - view.enter[b]
                        ua = tl.clock.pair_uncertainty_s(got[a][0], got[b][0])
                        if settled and abs(true_d) > ua:
                            checked += 1
                            assert (seen_d > 0) == (true_d > 0), (comm.id, seq, a, b, true_d, seen_d, ua)
                        if late and abs(true_d) > 100e-6:
                            checked_late += 1
                            assert (seen_d > 0) == (true_d > 0), (comm.id, seq, a, b, true_d, seen_d)
        print(f"ordered pairs checked: {checked} (beyond the stated uncertainty), {checked_late} (after 30 s, "
              f"> 100 us apart); worst arrival error after 30 s {worst * 1e6:.1f} us")
        assert checked >= 100 and checked_late >= 100
        # Each arrival within max(50 us, the uncertainty stated for its node): CI once saw 52.9 us on a
        # node whose estimate was 47.4 us off, with ~+-100 us stated.
        assert excess <= 0, (worst, stated)

        # 4. `ccld diagnose` says how the clocks were aligned
        out = subprocess.run(CCLD + ["diagnose", mb.store], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("clock node")]
        assert len(lines) == 3 and all(": sync" in ln and " ppm +-" in ln for ln in lines), out.stdout
        assert any(f"ranks [{HANG_RANK}]" in ln or f"[{HANG_RANK}]" in ln for ln in out.stdout.splitlines()
                   if "HANG" in ln), out.stdout


# 256 KiB all-reduces: the ring's bulk links carry ~384 KiB a step; at 20 Mbit/s a shaped one slows
# steps ~10x. Ring 0-1-2-3-4-5: between nodes 1 (ranks 2, 3) and 2 (ranks 4, 5) only 3<->4 is a ring link.
SLOW_JOB = ["--seconds", "600", "--elems", "65536", "--compute-ms", "1", "--progress-every", "10",
            "--timeout-s", "600"]
BASELINE_S = 15.0
SLOW_DEADLINE_S = 60.0


def test_a_slow_link_between_nodes_is_named():
    with MultiNodeBed(nodes=3, ranks_per_node=2, clocks=CLOCKS) as mb:
        mb.start_collector()
        mb.start_job(SLOW_JOB)
        mb.start_agents(probes="gloo,net,sched")
        wait_for("the job's first steps", lambda: min(mb.steps()) >= 10, START_TIMEOUT_S, mb)
        time.sleep(BASELINE_S)
        before = [x for x in mb.findings_list() if x.get("kind") in ("hang", "slow") and x.get("ranks")]
        assert not before, json.dumps(before)[:3000]
        mb.bed.rate_limit_pair(1, 2, "20mbit")  # hosts 1 and 2: the nodes
        f = wait_for("a comm-slow finding naming ranks", lambda: next(
            (x for x in mb.findings_list() if x.get("class") == "comm-slow" and x.get("ranks")), None),
            SLOW_DEADLINE_S, mb)
        print("slow link finding:", json.dumps({k: f.get(k) for k in ("class", "ranks", "link")}))
        # Shaping is per node pair here (both ranks of a node share its eth0): the finding names the
        # shaped ring link, or the one rank of it that every slow pair shares; never anything else.
        assert set(f["ranks"]) <= {3, 4} and (f.get("link") is None or sorted(f["link"]) == [3, 4]), f
