"""Optional: Perfetto's own trace_processor loads an exported trace without errors, and sees every
slice and flow. It needs the trace_processor_shell binary, which perfetto's Python package downloads
on first use; offline (CI here) there is none, so this module is skipped, saying why.

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
    found = shutil.which("trace_processor_shell") or shutil.which("trace_processor")
    if found:
        return found
    got = sorted(glob.glob(os.path.expanduser("~/.local/share/perfetto/prebuilts/trace_processor_shell*")))
    return got[-1] if got else None


BINARY = _trace_processor()
if BINARY is None:
    pytest.skip("no trace_processor_shell on PATH or in ~/.local/share/perfetto/prebuilts (perfetto's "
                "TraceProcessor downloads it, which needs the network)", allow_module_level=True)


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
