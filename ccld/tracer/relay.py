"""An emit whose target is set later.

`ccld run` loads the probe programs and starts the job before the collector and the agent exist:
the translators (and a CUPTI sink) made then send to a Relay, which the agent points at its shipper
when it adopts them. Nothing drains a ring buffer before the agent runs, so nothing is sent before
that; anything that were would be counted in `dropped` (and the agent ships its loss counters).
"""
from __future__ import annotations

from typing import Callable, Optional


class Relay:
    def __init__(self):
        self.target: Optional[Callable] = None
        self.dropped = 0

    def __call__(self, item) -> None:
        if self.target is not None:
            self.target(item)
        else:
            self.dropped += 1
