"""The rule that joins an NCCL kernel (a CUPTI GpuKernel) to the collective calls that launched it.

One rule for the collector's live join (timeline/gpu.py) and the trace export (export/gpu.py). NCCL
launches a collective's kernel inside the call, or at ncclGroupEnd for calls made in a group, always
in the calling thread, on the NCCL stream of the call's communicator. So a kernel launched by thread T
at L runs the calls T entered at or before L (within MAX_LAUNCH_LAG_NS) that no earlier kernel ran,
of one communicator: the one its stream serves once learned, else the first candidate's, candidates
first narrowed to the kernel's op (parsed from its name) when some match it. A kernel without a launch
record runs the oldest unclaimed call of its stream's communicator (stream order).
Times: node-monotonic ns (a kernel's launch and start and the calls' enters come from one node).
Calls are each side's own objects (Call: ts, comm, op, claimed); each side keeps them (by thread, how
long, bounds) and picks the launch window's candidates.
"""
from __future__ import annotations

from typing import Callable, Deque, Dict, List, Optional, Protocol, Sequence, Tuple, TypeVar

MAX_LAUNCH_LAG_NS = 10_000_000_000  # enter -> launch; more is a stalled launch queue or another call
AMBIGUOUS = ""                      # a stream seen serving two communicators: never used to choose

Stream = Tuple[int, int]  # (device, stream)


class Call(Protocol):
    """A collective call a rank entered, as each side keeps it."""
    ts: int      # enter, node-monotonic ns
    comm: str
    op: str

    @property
    def claimed(self) -> bool: ...  # a kernel has taken it


E = TypeVar("E", bound=Call)


def choose(cands: Sequence[E], stream_comm: Dict[Stream, str], stream: Stream, op: str,
           is_open: Optional[Callable[[E], bool]] = None) -> Tuple[List[E], bool]:
    """The calls (one, or a group's) a launched kernel ran, out of `cands`: its thread's calls in the
    launch window, in call order. `is_open` (when given) drops the claimed ones after the op is used
    to narrow, so an op whose calls are all claimed leaves none rather than another op's; a caller
    that passes only open candidates falls back to another op's. Learns the stream's communicator
    from candidates all of one; returns (chosen, whether that made the stream AMBIGUOUS)."""
    comm = stream_comm.get(stream) or None
    if comm is not None:
        cands = [c for c in cands if c.comm == comm]
    elif op:
        cands = [c for c in cands if c.op == op] or cands
    if is_open is not None:
        cands = [c for c in cands if is_open(c)]
    if not cands:
        return [], False
    ambiguous = False
    if comm is None:
        comm = cands[0].comm
        if all(c.comm == comm for c in cands):
            ambiguous = learn(stream_comm, stream, comm)
    return [c for c in cands if c.comm == comm], ambiguous


def learn(stream_comm: Dict[Stream, str], stream: Stream, comm: str) -> bool:
    """Note that `stream` serves `comm`; True when it was known to serve another (it is now AMBIGUOUS)."""
    old = stream_comm.get(stream)
    if old is None:
        stream_comm[stream] = comm
    elif old != comm and old != AMBIGUOUS:
        stream_comm[stream] = AMBIGUOUS
        return True
    return False


def by_stream_order(by_comm: Dict[str, Deque[E]], comm: Optional[str], start_ns: int) -> Optional[E]:
    """For a kernel without a launch record: the oldest unclaimed call of its stream's communicator
    `comm` (None or AMBIGUOUS: unknown), taken off `by_comm[comm]` (calls in call order), if it was
    entered by the kernel's GPU start `start_ns`. Claimed calls at the front are dropped on the way."""
    q = by_comm.get(comm) if comm else None
    while q and q[0].claimed:
        q.popleft()
    if q and q[0].ts <= start_ns:
        return q.popleft()
    return None
