"""The agent's sinks for what code inside the ranks sends it: the CUPTI shim and the NCCL profiler plugin.

`ccld run` makes them before the agent exists (their endpoints go in the job's environment) and the
agent adopts them; each is then polled by the agent's loop, asked for its loss counters and its
periodic announcements, and closed after a last poll when the agent stops. A sink's bug is logged and
costs only its own events. The NCCL plugin's sink is polled before the probe families drain (the
agent's loop does so), so that from a rank's first plugin datagram on the NCCL API uprobes' records
of that rank are dropped (`on_plugin`): one source per collective.
"""
from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional, Tuple

from ccld import wire as ev

log = logging.getLogger("ccld.agent")


class RankSinks:
    def __init__(self, emit: Callable[[ev.Event], None], ident_of: Callable[[int], Optional[Tuple[int, str]]],
                 on_plugin: Callable[[int, int], None] = lambda pid, since_ns: None):
        self.emit, self.ident_of, self.on_plugin = emit, ident_of, on_plugin
        self.cupti = None     # cupti_sink.CuptiSink
        self.ncclprof = None  # ncclprof_sink.NcclProfSink
        self.sources: List[str] = []

    def adopt_cupti(self, sink) -> None:
        sink.emit = self.emit
        sink.rank_of = lambda pid: (self.ident_of(pid) or (None, ""))[0]
        self.cupti = sink
        self.sources.append("cupti (shim)")

    def adopt_ncclprof(self, sink) -> None:
        sink.emit, sink.ident_of, sink.on_first = self.emit, self.ident_of, self.on_plugin
        self.ncclprof = sink
        self.sources.append("nccl profiler plugin")

    def open_cupti(self) -> str:
        if self.cupti is None:
            from ccld.tracer.cupti_sink import CuptiSink
            self.adopt_cupti(CuptiSink(self.emit))
        return self.cupti.endpoint

    def open_ncclprof(self, path: Optional[str] = None) -> str:
        if self.ncclprof is None:
            from ccld.tracer.ncclprof_sink import NcclProfSink
            self.adopt_ncclprof(NcclProfSink(self.emit, path=path))
        return self.ncclprof.path

    def _each(self):
        return [s for s in (self.ncclprof, self.cupti) if s is not None]

    def poll(self, most: int = 256) -> None:
        for s in self._each():
            try:
                s.poll(most)
            except Exception:  # a bug in a sink must not end tracing
                log.exception("%s poll failed", type(s).__name__)

    def announce(self) -> List[ev.Event]:
        out: List[ev.Event] = []
        for s in self._each():
            out.extend(s.announce())
        return out

    def loss(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for s in self._each():
            out.update(s.loss())
        return out

    def close(self) -> None:
        """A last poll of everything that came (the ranks' pids still map to ranks), then close."""
        self.poll(1 << 30)
        for s in self._each():
            s.close()
