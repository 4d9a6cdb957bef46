"""The link table (collector) and the link localisers (diagnose), on synthetic jobs sent as real frames."""
import pytest

from ccld import wire as ev
from ccld.timeline import links as lk
from ccld.timeline.timeline import Timeline
from ccld.diagnose import Diagnoser, commslow, hang, linkfaults
from ccld_synth import T0, SynthJob, SynthLinks, rank_ip, rank_port


def job_with_links(world=4, nodes=2):
    tl, job = Timeline(), SynthJob(world=world, nodes=nodes)
    job.announce(T0)
    job.feed(tl, T0)
    return tl, job, SynthLinks(job)


def link_event(pid, rank, saddr, sport, daddr, dport, ts_ns, **kw):
    return ev.LinkStats(pid=pid, rank=rank, ts_ns=ts_ns, saddr=saddr, sport=sport, daddr=daddr, dport=dport, **kw)


def test_every_connection_is_labelled_with_its_rank_pair():
    tl, job, links = job_with_links()
    links.ring(T0 + 1)
    job.feed(tl, T0 + 1.1)
    rows = tl.links.table("job")
    assert len(rows) == 8  # 4 ring connections, both ends
    got = {(r["rank"], r["peer"]) for r in rows}
    assert got == {(0, 1), (1, 2), (2, 3), (3, 0), (1, 0), (2, 1), (3, 2), (0, 3)}
    row = next(r for r in rows if (r["rank"], r["peer"]) == (2, 3))
    assert row["local"] == f"{rank_ip(2)}:{rank_port(2, 3)}" and row["tx_bytes"] == 16384
    assert row["label"] == "rank 2 -> rank 3"


def test_store_and_outside_connections_are_labelled_as_such():
    tl, job, _ = job_with_links()
    tl.links.note_job("job", "10.9.0.1", 29500)
    a = job.agent_of[1]
    t = T0 + 1
    a.pending += [link_event(job.pid[1], 1, rank_ip(1), 41000, rank_ip(0), 29500, a.mono(t), tx_bytes=10),
                  link_event(job.pid[1], 1, rank_ip(1), 41001, "93.184.216.34", 443, a.mono(t), tx_bytes=10)]
    job.feed(tl, t)
    labels = {r["remote"]: r["label"] for r in tl.links.table()}
    assert labels == {"10.9.0.1:29500": "store", "93.184.216.34:443": "external"}
    # Rank 0 hosts the store: its side of that connection is a rank's known endpoint, and still "store".
    a0 = job.agent_of[0]
    a0.pending.append(link_event(job.pid[0], 0, rank_ip(0), 29500, rank_ip(1), 41000, a0.mono(t + 1), rx_bytes=10))
    job.feed(tl, t + 1)
    assert {r["local"]: r["label"] for r in tl.links.table() if r["rank"] in (0, 1)}[f"{rank_ip(0)}:29500"] == "store"
    assert all(r["label"] != "rank 1 -> rank 0" for r in tl.links.table())


def test_loopback_endpoints_do_not_join_across_nodes():
    tl, job, _ = job_with_links(world=2, nodes=2)
    t = T0 + 1
    # Rank 0 (node0) and rank 1 (node1) each talk to 127.0.0.1 with mirrored ports: on different nodes
    # these are different connections, and must not be taken for the two ends of one.
    a0, a1 = job.agent_of[0], job.agent_of[1]
    a0.pending.append(link_event(job.pid[0], 0, "127.0.0.1", 5000, "127.0.0.1", 6000, a0.mono(t), tx_bytes=1))
    a1.pending.append(link_event(job.pid[1], 1, "127.0.0.1", 6000, "127.0.0.1", 5000, a1.mono(t), tx_bytes=1))
    job.feed(tl, t)
    assert {r["label"] for r in tl.links.table()} == {"external"}


def test_series_adds_deltas_per_second_and_survives_an_agent_restart():
    tl, job, links = job_with_links()
    for i in range(5):
        links.send(1, 2, T0 + 1 + i * 0.25, 1000, retrans=1 if i == 3 else 0)
    job.feed(tl, T0 + 3)
    win = tl.links.pair_window("job", T0, T0 + 10)
    assert win[(1, 2)].tx_bytes == 5000 and win[(1, 2)].retrans == 1
    assert (2, 1) not in win or win[(2, 1)].tx_bytes == 0  # rank 2 only received
    # The agent restarts: its counters begin again from zero. Nothing negative is added.
    links.c[(1, 2)].update(tx_bytes=0, retrans=0)
    links.send(1, 2, T0 + 4, 700)
    job.feed(tl, T0 + 4.1)
    assert tl.anomalies["link-counter-reset"] == 1
    assert tl.links.pair_window("job", T0, T0 + 10)[(1, 2)].tx_bytes == 5700


def test_series_is_bounded():
    tl, job, links = job_with_links()
    for i in range(lk.SERIES_BUCKETS + 50):
        links.send(0, 1, T0 + 1 + i, 10)
        if i % 100 == 0:
            job.feed(tl, T0 + 1 + i)
    job.feed(tl, T0 + lk.SERIES_BUCKETS + 60)
    assert len(tl.links.series[("job", 0, 1)]) == lk.SERIES_BUCKETS


def hung_job(retrans=None, seconds=8.0, synth=None):
    """60 healthy collectives, then seq 61 that every rank entered and nobody finishes, with ring
    traffic each second and `retrans` {(src, dst): n per second} while it hangs. `synth` (a list)
    gets the SynthJob, to send more."""
    tl, job, links = job_with_links()
    end = job.steps(1, 60, T0 + 1, period=0.05)
    job.collective(61, end + 0.01, finish=False)
    for i in range(int(seconds)):
        links.ring(end + 0.5 + i, nbytes=0 if i else 16384, retrans=retrans)
    now = end + seconds
    job.feed(tl, now)
    if synth is not None:
        synth.append(job)
    return tl, now


def test_a_hang_with_one_link_retransmitting_is_a_fault_of_that_link():
    tl, now = hung_job(retrans={(1, 2): 1})
    hangs = hang.find_hangs(tl, now)
    assert [h.evidence["reason"] for h in hangs] == ["not-finished"]  # every rank waits: no culprit
    got = linkfaults.find_link_faults(tl, now, hangs)
    assert len(got) == 1
    f = got[0]
    assert (f.kind, f.cls, f.ranks, f.link) == ("hang", "fault", [1, 2], [1, 2])
    assert f.evidence["pairs"][0]["retrans"] >= linkfaults.MIN_LINK_RETRANS and f.evidence["others_max_retrans"] == 0
    assert f.seq == hangs[0].seq and f.evidence["hang_reason"] == "not-finished"


def test_a_ticks_hold_and_link_faults_read_a_hangs_link_window_once(monkeypatch):
    # LossyHold and find_link_faults both ask which links retransmitted since a fresh hang began: one
    # tick reads that window once (the finding is the same either way).
    tl, now = hung_job(retrans={(1, 2): 1})
    asked = []
    real = tl.links.pair_window

    def counted(job, t_from, t_to):
        asked.append((job, t_from, t_to))
        return real(job, t_from, t_to)

    monkeypatch.setattr(tl.links, "pair_window", counted)
    got = Diagnoser(tl).find_hangs(now)
    assert [(f.cls, f.link) for f in got] == [("fault", [1, 2])]
    since_onset = [a for a in asked if a[2] == now + 1.0]
    assert len(since_onset) == 1, asked


def lossy_then_hung(lossy_before: bool, seconds: float):
    """12 s of healthy collectives with ring traffic each second (link 1->2 retransmitting 20 times a
    second throughout when `lossy_before`: 5 % loss), then seq 61 that nobody finishes while 1->2
    retransmits twice a second (TCP backing off on a lost segment, or on a cut link)."""
    tl, job, links = job_with_links()
    end = job.steps(1, 60, T0 + 1, period=0.2)
    for i in range(12):
        links.ring(T0 + 1 + i, retrans={(1, 2): 20} if lossy_before else None)
    job.collective(61, end + 0.01, finish=False)
    for i in range(int(seconds)):
        links.ring(end + 0.5 + i, nbytes=0, retrans={(1, 2): 2})
    now = end + seconds
    job.feed(tl, now)
    return tl, now


@pytest.mark.parametrize("lossy_before", [True, False])
def test_a_stall_on_a_link_that_was_lossy_before_is_held_and_a_cut_one_is_not(lossy_before):
    # The CI miss of node-lossy-link: a 5 % lossy link stalled one transfer for 3 s (TCP's backoff)
    # and was called a hang before comm-slow named the link. A link lossy before the wait is held for
    # LOSSY_HOLD_S; a link that was clean until the wait (a cut) is named at the usual floor.
    tl, now = lossy_then_hung(lossy_before, seconds=7)
    hangs = hang.find_hangs(tl, now)
    assert len(hangs) == 1
    assert linkfaults.held_on_lossy_links(tl, now, hangs) == (hangs if lossy_before else [])
    assert [f.link for f in Diagnoser(tl).find_hangs(now)] == ([] if lossy_before else [[1, 2]])
    tl, now = lossy_then_hung(lossy_before, seconds=linkfaults.LOSSY_HOLD_S + 1)
    hangs = hang.find_hangs(tl, now)
    assert linkfaults.held_on_lossy_links(tl, now, hangs) == []  # past the hold: a hang, lossy or not
    assert [f.link for f in Diagnoser(tl).find_hangs(now)] == [[1, 2]]


def test_a_hang_shown_before_its_link_retransmits_is_not_held_later():
    # The hold depends on retransmissions counted since the hang began, which come after it: a hang
    # shown at the floor before the lost segment's RTO fired must not be held a tick later (it would
    # read as recovered while it still waits).
    tl, job, links = job_with_links()
    end = job.steps(1, 60, T0 + 1, period=0.2)
    for i in range(12):
        links.ring(T0 + 1 + i, retrans={(1, 2): 20})  # lossy before
    job.collective(61, end + 0.01, finish=False)
    for i in range(5):
        links.ring(end + 0.5 + i, nbytes=0)  # quiet at first
    job.feed(tl, end + 5.4)
    d = Diagnoser(tl)
    first = d.find_hangs(end + 5.4)
    assert [(h.kind, h.seq) for h in first] == [("hang", 61)]  # past the floor, no link to hold it on
    for i in range(5, 8):
        links.ring(end + 0.5 + i, nbytes=0, retrans={(1, 2): 2})
    job.feed(tl, end + 8.0)
    assert [(h.seq, h.link) for h in d.find_hangs(end + 8.0)] == [(61, [1, 2])]  # still shown, now on its link
    assert Diagnoser(tl).find_hangs(end + 8.0) == []  # seen first now, it is held: the memory keeps it shown


def test_a_rank_that_never_entered_is_not_explained_by_a_retransmitting_link():
    # Rank 2 is asleep before seq 61 (in no operation), the others wait in it; a link of the job
    # happens to retransmit meanwhile. A link cannot keep a rank from entering: the hang stays its own.
    tl, job, links = job_with_links()
    end = job.steps(1, 60, T0 + 1, period=0.05)
    job.collective(61, end + 0.01, ranks=[0, 1, 3], finish=False)
    for i in range(8):
        links.ring(end + 0.5 + i, nbytes=0 if i else 16384, retrans={(0, 1): 1})
    now = end + 8
    job.feed(tl, now)
    hangs = hang.find_hangs(tl, now)
    assert [(h.cls, h.ranks) for h in hangs] == [("not-entered", [2])]
    assert linkfaults.find_link_faults(tl, now, hangs) == []


def test_retransmissions_everywhere_name_no_link():
    tl, now = hung_job(retrans={(r, (r + 1) % 4): 1 for r in range(4)})
    hangs = hang.find_hangs(tl, now)
    assert len(hangs) == 1 and linkfaults.find_link_faults(tl, now, hangs) == []


def test_a_quiet_hang_names_no_link():
    tl, now = hung_job(retrans=None)
    hangs = hang.find_hangs(tl, now)
    assert len(hangs) == 1 and linkfaults.find_link_faults(tl, now, hangs) == []


def slow_job(srtt=None, retrans=None, late=None, slow_dur=0.060, healthy_s=30.0, slow_s=12.0, extra=(),
             stall_every=0):
    """A job with one all-reduce every 0.1 s (3 ms each) for healthy_s, then slow_dur each for
    slow_s; ring traffic with per-pair RTT (us) and retransmissions per collective in the slow part."""
    tl, job, links = job_with_links()
    t, seq = T0 + 1, 1
    while t < T0 + 1 + healthy_s:
        job.collective(seq, t, dur=0.003)
        links.ring(t + 0.003)
        for a, b in extra:
            links.send(a, b, t + 0.003, 4096)
        seq, t = seq + 1, t + 0.1
        if seq % 20 == 0:
            job.feed(tl, t)
    stop = t + slow_s
    while t < stop:
        dur = 0.210 if stall_every and seq % stall_every == 0 else slow_dur  # a retransmission timeout
        job.collective(seq, t, dur=dur, late=late)
        links.ring(t + slow_dur, srtt=srtt, retrans=retrans)
        for a, b in extra:
            links.send(a, b, t + slow_dur, 4096, srtt_us=(srtt or {}).get((a, b), 50))
        seq, t = seq + 1, t + 0.1 + dur
        if seq % 5 == 0:
            job.feed(tl, t)
    job.feed(tl, t)
    return tl, t


def test_a_crawling_link_is_named_by_its_rtt():
    tl, now = slow_job(srtt={(2, 3): 25_000})
    got = commslow.find_comm_slow(tl, now)
    assert len(got) == 1
    f = got[0]
    assert (f.kind, f.cls, f.ranks, f.link, f.seq) == ("slow", "comm-slow", [2, 3], [2, 3], -1)
    assert f.evidence["localised_by"] == "rtt" and f.evidence["slowdown"] >= commslow.SLOW_FACTOR
    assert f.evidence["pairs"][0]["srtt_mean_us"] == pytest.approx(25_000)
    assert f.evidence["job_median_rtt_us"] == pytest.approx(50)


def test_a_lossy_link_is_named_by_its_retransmissions():
    tl, now = slow_job(retrans={(0, 1): 2})
    (f,) = commslow.find_comm_slow(tl, now)
    assert (f.ranks, f.link, f.evidence["localised_by"]) == ([0, 1], [0, 1], "retransmissions")


def test_every_link_of_one_rank_slow_names_that_rank():
    # Rank 1 sends to 2 (ring) and to 0 (extra); both of its links crawl, nobody else's do.
    tl, now = slow_job(srtt={(1, 2): 30_000, (1, 0): 30_000}, extra=[(1, 0)])
    (f,) = commslow.find_comm_slow(tl, now)
    assert (f.ranks, f.link) == ([1], None)
    assert sorted((p["src"], p["dst"]) for p in f.evidence["pairs"]) == [(1, 0), (1, 2)]


def test_healthy_and_late_arrival_jobs_are_not_comm_slow():
    tl, now = slow_job(slow_dur=0.003)
    assert commslow.find_comm_slow(tl, now) == []
    # Slow because one rank arrives late (compute), not because the collective itself is slow.
    tl, now = slow_job(slow_dur=0.003, late={3: 0.080})
    assert commslow.find_comm_slow(tl, now) == []


def test_a_slowdown_without_link_data_says_so():
    tl, now = slow_job(srtt={(r, (r + 1) % 4): 50 for r in range(4)})
    (f,) = commslow.find_comm_slow(tl, now)
    assert f.ranks == [] and f.link is None and "no link stands out" in f.evidence["note"]


def test_a_heavy_tail_of_retransmission_stalls_is_slow_even_when_the_median_is_not():
    # 1 collective in 8 waits out a 200 ms RTO; the rest run at normal speed, so the median is fine.
    tl, now = slow_job(slow_dur=0.003, stall_every=8, retrans={(2, 3): 1})
    (f,) = commslow.find_comm_slow(tl, now)
    assert f.evidence["judged_by"] == "tail" and (f.ranks, f.link) == ([2, 3], [2, 3])
    # The same tail at 1 in 40 is noise, not a finding.
    tl, now = slow_job(slow_dur=0.003, stall_every=40, retrans={(2, 3): 1})
    assert commslow.find_comm_slow(tl, now) == []


def test_ccld_links_prints_the_table_of_a_store(tmp_path, capsys):
    from ccld import cli
    from ccld.store import StoreWriter
    job = SynthJob(world=4, nodes=2)
    links = SynthLinks(job)
    job.announce(T0)
    w = StoreWriter(str(tmp_path / "store"))
    for f in job.frames(T0):
        w.append(f, T0)
    links.ring(T0 + 1, nbytes=3 << 20, retrans={(2, 3): 4})
    for f in job.frames(T0 + 1.1):
        w.append(f, T0 + 1.1)
    w.close()
    assert cli.main(["links", str(tmp_path / "store")]) == 0
    out = capsys.readouterr().out.splitlines()
    row = next(line for line in out if "r2 -> r3" in line)
    assert f"{rank_ip(2)}:{rank_port(2, 3)}" in row and " 3.0 " in row and " 4 " in row
    assert any("2->3 3.0 MiB 4 re" in line for line in out)
    assert cli.main(["links", str(tmp_path / "store"), "--json"]) == 0
    rows = [__import__("json").loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(rows) == 8 and {(r["rank"], r["peer"]) for r in rows if r["tx_bytes"]} == {(0, 1), (1, 2), (2, 3), (3, 0)}



@pytest.mark.parametrize("who, folded", [(2, True), (0, False)])
def test_a_link_faults_rank_that_then_exits_is_the_faults_consequence(who, folded):
    """Link 1-2 keeps retransmitting in a hang: a link fault. Then rank `who` exits. Rank 2 is at one
    end of that link: its exit is the cut's consequence, and the link finding stays in its place
    (noting the exit), not a second finding. Rank 0 is not: its exit is a finding of its own."""
    from ccld.diagnose import Diagnoser
    synth = []
    tl, now = hung_job(retrans={(1, 2): 1}, synth=synth)
    d = Diagnoser(tl)
    first = [f for f in d.find_hangs(now) if f.kind == "hang"]
    assert [(f.cls, f.ranks, f.link) for f in first] == [("fault", [1, 2], [1, 2])]
    synth[0].exit(who, now + 1)
    synth[0].feed(tl, now + 2)
    later = [f for f in d.find_hangs(now + 3) if f.kind == "hang"]
    if folded:
        assert [(f.cls, f.ranks, f.link, f.evidence.get("then_exited")) for f in later] == [
            ("fault", [1, 2], [1, 2], [2])]
    else:
        assert [(f.cls, f.ranks, f.evidence.get("reason")) for f in later] == [("fault", [0], "exited")]
