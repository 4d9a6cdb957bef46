"""CollView: one collective of the CollStore (colltable.py) as the analyses read it.

Mappings global rank -> value, made from the collective's slot when first read after a write (the
slot's version) and kept until the next: enter, start, end (Unix s), ops, sizes (count, dtype, nbytes).
What only some collectives have (failed ranks' errors, GPU kernel times) is kept on the view itself.
Caveat: a view an analysis still holds when its collective is evicted keeps a copy (`freeze`, done by
comms.evict); any other view reads its slot, so it must not be kept past its eviction otherwise.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from ccld.timeline.colltable import CollStore, CommCols

_FIELDS = ("enter", "start", "end", "ops", "sizes")


class CollView:
    """One collective (comm, seq) as seen by every rank that reported it: its slot of the CollStore shown
    as mappings global rank -> value (enter/start/end Unix s, ops, sizes (count, dtype, nbytes)), plus
    what only some collectives have (failed ranks' errors, GPU kernel times), kept here. The mappings
    are snapshots, made once per write of the slot: change the timeline, not them. One that an
    analysis still holds when its collective is evicted keeps a copy (`freeze`, comms.evict)."""
    __slots__ = ("comm", "seq", "op", "completed_at", "_failed", "_gpu_start", "_gpu_end", "_store", "_cols",
                 "_slot", "_cache", "_frozen", "made")

    def __init__(self, comm: str, seq: int, op: str, store: CollStore, cols: CommCols, slot: int, made: int):
        self.comm, self.seq, self.op, self.made = comm, seq, op, made  # made: Comm.made when it was made
        self.completed_at: Optional[float] = None
        self._failed: Optional[Dict[int, str]] = None
        self._gpu_start: Optional[Dict[int, float]] = None
        self._gpu_end: Optional[Dict[int, float]] = None
        self._cache: Optional[Dict[str, Tuple[int, Any]]] = None
        self._frozen: Optional[Dict[str, Any]] = None
        self._store, self._cols, self._slot = store, cols, slot

    @property
    def failed(self) -> Dict[int, str]:
        """global rank -> the library error its end reported."""
        if self._failed is None:
            self._failed = {}
        return self._failed

    @property
    def gpu_start(self) -> Dict[int, float]:
        """rank -> Unix s its NCCL kernel began (gpu.py)."""
        if self._gpu_start is None:
            self._gpu_start = {}
        return self._gpu_start

    @property
    def gpu_end(self) -> Dict[int, float]:
        if self._gpu_end is None:
            self._gpu_end = {}
        return self._gpu_end

    def _get(self, name: str) -> Any:
        if self._frozen is not None:
            return self._frozen[name]
        st, slot = self._store, self._slot
        v = int(st.version[slot]) * 1_000_003 + self._cols.ncols  # a new member column changes what shows
        cache = self._cache
        if cache is None:
            cache = self._cache = {}
        got = cache.get(name)
        if got is not None and got[0] == v:
            return got[1]
        if name == "span":
            d: Any = st.span(st.enter, slot, self._cols)
        elif name == "ops":
            d = st.ops_row(slot, self._cols)
        elif name == "sizes":
            d = st.sizes_row(slot, self._cols)
        else:
            d = st.row(getattr(st, name), slot, self._cols)
        cache[name] = (v, d)
        return d

    def freeze(self) -> None:
        """Copy what the slot holds into the view (its slot is about to be freed)."""
        self._frozen = {name: self._get(name) for name in _FIELDS}

    @property
    def enter(self) -> Dict[int, float]:
        return self._get("enter")

    @property
    def start(self) -> Dict[int, float]:
        return self._get("start")

    @property
    def end(self) -> Dict[int, float]:
        return self._get("end")

    @property
    def ops(self) -> Dict[int, str]:
        return self._get("ops")

    @property
    def sizes(self) -> Dict[int, Tuple[int, str, int]]:
        return self._get("sizes")

    def entered(self) -> bool:
        """Whether any rank entered it (bool(enter), without building it)."""
        if self._frozen is not None:
            return bool(self._frozen["enter"])
        return bool(self._store.n_entered[self._slot])

    def enter_span(self) -> Tuple[int, float, float]:
        """(ranks that entered, first enter, last enter), without building `enter` (nan, nan: none did)."""
        if self._frozen is not None:
            e = self.enter
            return (len(e), min(e.values()), max(e.values())) if e else (0, float("nan"), float("nan"))
        return self._get("span")

    def uniform(self) -> bool:
        """Whether the ranks that reported it agree on its op and on its size: len(set(ops.values())) <= 1
        and len(set(sizes.values())) <= 1, read from the slot without building either mapping."""
        if self._frozen is not None:
            return len(set(self.ops.values())) <= 1 and len(set(self.sizes.values())) <= 1
        return self._store.uniform(self._slot, self._cols)

    def first_enter(self) -> Optional[float]:
        n, first, _ = self.enter_span()
        return first if n else None

    def last_enter(self) -> Optional[float]:
        n, _, last = self.enter_span()
        return last if n else None

    def __repr__(self) -> str:
        return f"CollView(comm={self.comm!r}, seq={self.seq}, op={self.op!r}, enter={self.enter}, end={self.end})"
