"""Optional: Perfetto's own trace_processor loads an exported trace without errors, and sees every
slice and flow (the collectives' across ranks, and the GPU kernels' to their collectives). It needs the
trace_processor_shell binary: CCLD_TRACE_PROCESSOR=/path/to/it, one on PATH, or the one perfetto's
Python package downloads on first use (into ~/.local/share/perfetto/prebuilts). No registry this
project's machines reach ships one (see README, "Open the trace"), so offline (CI here) this module is
skipped, saying why.

The skip is module-level on purpose: it is not a test tier (CCLD_REQUIRE_TIERS fails skipped tests
in required tiers), just an extra check where the binary exists.
"""
import glob
import os
import shutil

import pytest

from ccld.export.perfetto import export_perfetto
from test_export_perfetto import N_OK, record


def _trace_processor():
    found = (os.environ.get("CCLD_TRACE_PROCESSOR") or shutil.which("trace_processor_shell")
             or shutil.which("trace_processor"))
    if found:
        return found
    got = sorted(glob.glob(os.path.expanduser("~/.local/share/perfetto/prebuilts/trace_processor_shell*")))
    return got[-1] if got else None


BINARY = _trace_processor()
if BINARY is None:
    pytest.skip("no trace_processor_shell: not in CCLD_TRACE_PROCESSOR, on PATH or in "
                "~/.local/share/perfetto/prebuilts (perfetto's TraceProcessor downloads it from a host this "
                "machine cannot reach; no PyPI, npm or Debian package ships it)", allow_module_level=True)


@pytest.mark.perfetto_tp
def test_trace_processor_reads_it(tmp_path):
    from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig
    record(tmp_path / "s")
    out = tmp_path / "t.pftrace"
    export_perfetto(str(tmp_path / "s"), str(out))
    tp = TraceProcessor(trace=str(out), config=TraceProcessorConfig(bin_path=BINARY))
    try:
        def one(sql):
            return list(tp.query(sql))[0]
        assert one("select count(*) as n from slice where name = 'allreduce' and category is null "
                   "and depth = 0").n >= 4 * N_OK + 3
        # a flow per collective: 3 arrows for each 4-rank one, 2 for the hung one (ranks 0, 1, 3)
        assert one("select count(*) as n from flow").n == 3 * N_OK + 2
        assert one("select count(*) as n from slice where name = 'HANG not-entered'").n == 1
        bad = list(tp.query("select name, value from stats where severity in ('error', 'data_loss') and value > 0"))
        assert bad == [], [(b.name, b.value) for b in bad]
    finally:
        tp.close()


@pytest.mark.perfetto_tp
def test_trace_processor_sees_gpu_streams_and_kernel_flows(tmp_path):
    from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig
    from test_export_gpu import N_COLL, WORLD, healthy_store
    healthy_store(tmp_path / "s")
    out = tmp_path / "t.pftrace"
    export_perfetto(str(tmp_path / "s"), str(out), findings=[])
    tp = TraceProcessor(trace=str(out), config=TraceProcessorConfig(bin_path=BINARY))
    try:
        def one(sql):
            return list(tp.query(sql))[0]
        assert one("select count(*) as n from track where name = 'GPU 0 stream 7'").n == WORLD
        # every kernel is the end of one flow, whose start is its rank's slice of the same collective
        rows = list(tp.query(
            "select k.name as kernel, c.name as coll, extract_arg(k.arg_set_id, 'debug.seq') as kseq, "
            "extract_arg(c.arg_set_id, 'debug.seq') as cseq from flow f join slice k on k.id = f.slice_in "
            "join slice c on c.id = f.slice_out join track t on t.id = k.track_id "
            "where t.name = 'GPU 0 stream 7'"))
        assert len(rows) == WORLD * N_COLL and all(r.kseq == r.cseq and r.coll == "allreduce" for r in rows)
        bad = list(tp.query("select name, value from stats where severity in ('error', 'data_loss') and value > 0"))
        assert bad == [], [(b.name, b.value) for b in bad]
    finally:
        tp.close()
