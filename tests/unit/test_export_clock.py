"""The export converts with the agents' round-trip clock estimates (ClockSync), like the live
timeline, and draws them: offset, drift and uncertainty counters per agent (ccld/export/clocktrack.py)."""
import json

import pytest

from ccld import wire as ev
from ccld.export.chrome import export_chrome
from ccld.store import StoreWriter

pytestmark = pytest.mark.unit

UNIX = 1_764_400_000_000_000_000
BOOT = 7_000_000_000_000          # the node's clock at UNIX
WALL_ERR = 3_000_000_000          # the node's wall clock is 3 s off: the pair alone would misplace everything


def test_export_uses_and_shows_the_clock_estimate(tmp_path):
    store = tmp_path / "s"
    w = StoreWriter(str(store))
    sync = ev.ClockSync(ts_ns=BOOT, ref_ns=BOOT, offset_ns=UNIX - BOOT, drift_ppb=-30_000, uncertainty_ns=42_000,
                        rtt_min_ns=80_000, samples=20, epoch=3)
    starts = []
    for i in range(5):
        t = BOOT + i * 100_000_000
        evs = [sync,
               ev.RankInfo(pid=9, rank=0, world_size=1, local_rank=0, node="n0", job="j", ts_ns=t),
               ev.CollEnter(pid=9, rank=0, ts_ns=t + 1_000_000, backend="gloo", comm="j/gloo:0", seq=i + 1,
                            op="allreduce"),
               ev.WorkEnd(pid=9, rank=0, ts_ns=t + 2_000_000, comm="j/gloo:0", seq=i + 1),
               ev.ClockSample(mono_ns=t + 3_000_000, wall_ns=UNIX + t + 3_000_000 - BOOT + WALL_ERR,
                              ts_ns=t + 3_000_000)]
        starts.append(UNIX + i * 100_000_000 + 1_000_000 - 3_000 * i - 30)  # -30 ppm: 3 us less per 100 ms
        w.append(ev.encode_batch("n0:1:ab", "n0", i + 1, evs), (UNIX + t - BOOT) / 1e9)
    w.close()
    out = tmp_path / "t.json"
    export_chrome(str(store), str(out), findings=[])
    trace = json.loads(out.read_text())
    evs = trace["traceEvents"] if isinstance(trace, dict) else trace
    # each collective is drawn on the rank's track and on the communicator's: the same begin on both
    slices = sorted({e["ts"] for e in evs if e.get("ph") in ("X", "B") and "allreduce" in e.get("name", "")})
    assert len(slices) == 5
    for got_us, want_ns in zip(slices, starts):
        # the estimate, not the wall pair's +3 s; the export holds one offset per frame, so the drift
        # within a frame (30 ppm x 100 ms = 3 us) is its resolution
        assert got_us == pytest.approx(want_ns / 1e3, abs=4.0), (got_us, want_ns)
    counters = {e["name"]: e["args"]["value"] for e in evs if e.get("ph") == "C"}
    assert counters.get("n0:1:ab clock uncertainty us") == 42.0, sorted(counters)
    assert counters.get("n0:1:ab clock drift ppm") == -30.0
    assert counters.get("n0:1:ab clock offset s") == pytest.approx((UNIX - BOOT) / 1e9, abs=1e-6)
