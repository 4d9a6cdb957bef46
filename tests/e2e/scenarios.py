"""The scenario registry and the strict scorer, shared by the e2e tests (one run of each scenario) and
bench/accuracy.py (N runs of each, scored).

A Scenario is a real job (a workload under ccld/workloads/, on one node or spread over simulated
nodes) with one fault injected, or none, and what ccld must say about it: the class, exactly the
culprit ranks (or exactly the link), within the deadline (hangs 15 s, slowdowns 60 s from the
fault's onset). `run(session)` returns a fault_scenarios.Result: the findings as read back from the
findings file, the onset (Unix s) and notes.

Strict scoring (`judge`): a run is correct only when its first hang or slow finding (informational
ones excluded: pauses) has the expected class and names exactly the culprits (for a link scenario:
exactly the link, as a rank pair in either order) and came within the deadline. Every other hang or
slow finding is a false finding, except one that says the same thing again (same class, same ranks,
same link: a second line about the one problem). A healthy scenario is correct when it has no hang
or slow finding at all.

Shared jobs: where it is natural, one job serves a healthy phase and a later fault (a checkpoint,
then a kill). `register_job(key, fn, *scenarios)` registers such scenarios with one function that
returns {scenario key: Result}; `plan()` lists what to run (each shared job once) for a selection.
`load()` imports the modules that register scenarios: fault_scenarios (DDP-style), shape_scenarios
(pipeline, FSDP, hybrid, elastic) and node_scenarios (simulated nodes).
"""
from __future__ import annotations

from dataclasses import dataclass, field
import importlib
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

HANG_DEADLINE_S = 15.0
SLOW_DEADLINE_S = 60.0


@dataclass
class Scenario:
    key: str                                  # short and stable: "pp-never-sends"
    title: str                                # its row in bench/RESULTS.md
    shape: str                                # ddp | pipeline | fsdp | hybrid | multinode | ...
    expect: Optional[str]                     # the class; None: healthy, nothing may be found
    culprits: List[int]                       # exactly these ranks ([] for a link scenario)
    run: Optional[Callable[..., Any]] = None  # (fault_scenarios.Session) -> fault_scenarios.Result
    link: Optional[List[int]] = None          # exactly this rank pair, for link scenarios
    deadline_s: float = HANG_DEADLINE_S
    kind: str = "hang"                        # "hang" | "slow" | "healthy"
    ci: bool = True                           # run once by the e2e suite in CI
    healthy_s: float = 0.0                    # healthy running this scenario contributes (false findings per hour)
    job: Optional[str] = None                 # the shared job (JOBS) that runs it with other scenarios
    needs: Tuple[str, ...] = ()               # beyond root + eBPF + torch: "fuse" (/dev/fuse), "netns" (netbed)
    long_run: bool = False                    # a healthy run whose length bench/accuracy.py sets (run(s, seconds=))


REGISTRY: Dict[str, Scenario] = {}
JOBS: Dict[str, Callable[..., Dict[str, Any]]] = {}
MODULES = ("fault_scenarios", "shape_scenarios", "node_scenarios")


def register(s: Scenario) -> Scenario:
    if s.key in REGISTRY:
        raise ValueError(f"scenario {s.key!r} registered twice")
    if s.run is None and s.job is None:
        raise ValueError(f"scenario {s.key!r} has neither run nor job")
    REGISTRY[s.key] = s
    return s


def register_job(key: str, fn: Callable[..., Dict[str, Any]], *scenarios: Scenario) -> None:
    """One job, several scenarios: fn(session) returns {scenario key: Result} for each of them."""
    if key in JOBS:
        raise ValueError(f"job {key!r} registered twice")
    JOBS[key] = fn
    for s in scenarios:
        s.job = key
        register(s)


def load() -> Dict[str, Scenario]:
    """Every registered scenario (importing the modules that register them), in registry order."""
    for m in MODULES:
        importlib.import_module(m)
    return REGISTRY


def plan(keys: Optional[Iterable[str]] = None, ci_only: bool = False) -> List[Tuple[str, List[Scenario]]]:
    """What to run for a selection: (job or scenario key, the selected scenarios it yields), each
    shared job once, in registry order. Unknown keys raise ValueError."""
    reg = load()
    want = list(keys) if keys is not None else [k for k, s in reg.items() if s.ci or not ci_only]
    unknown = [k for k in want if k not in reg]
    if unknown:
        raise ValueError(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(reg)}")
    out: List[Tuple[str, List[Scenario]]] = []
    index: Dict[str, int] = {}
    for k, s in reg.items():
        if k not in want:
            continue
        unit = s.job or s.key
        if unit not in index:
            index[unit] = len(out)
            out.append((unit, []))
        out[index[unit]][1].append(s)
    return out


def run_unit(unit: str, session: Any, **kw) -> Dict[str, Any]:
    """Run one entry of plan(): {scenario key: Result}."""
    if unit in JOBS:
        return JOBS[unit](session, **kw)
    return {unit: REGISTRY[unit].run(session, **kw)}


def is_real(f: Dict[str, Any]) -> bool:
    """A hang or slow finding that blames (informational ones, pauses, do not)."""
    return f.get("kind") in ("hang", "slow") and not (f.get("evidence") or {}).get("informational")


_real = is_real


def _same(f: Dict[str, Any], cls: Optional[str], ranks: List[int], link: Optional[List[int]]) -> bool:
    if f.get("class") != cls:
        return False
    if link is not None:
        return sorted(f.get("link") or []) == sorted(link)
    return sorted(f.get("ranks") or []) == sorted(ranks)


@dataclass
class Verdict:
    correct: bool                  # the strict answer
    detected: bool                 # some finding of the expected class came within the deadline
    latency_s: Optional[float]     # onset -> the first real finding (whatever it says)
    first: Optional[Dict[str, Any]]
    false: List[Dict[str, Any]] = field(default_factory=list)
    why: str = ""


def judge(s: Scenario, result: Any) -> Verdict:
    findings = sorted([f for f in result.findings if _real(f)], key=lambda f: f.get("detected_at", 0.0))
    if s.expect is None:
        return Verdict(correct=not findings, detected=not findings, latency_s=None, first=None, false=findings,
                       why="" if not findings else f"{len(findings)} finding(s) in a healthy run")
    first = findings[0] if findings else None
    onset = getattr(result, "onset", None)
    latency = None if first is None or onset is None else first["detected_at"] - onset
    in_time = latency is not None and latency <= s.deadline_s
    right = first is not None and _same(first, s.expect, s.culprits, s.link)
    detected = any(f.get("class") == s.expect and onset is not None and f["detected_at"] - onset <= s.deadline_s
                   for f in findings)
    false = [f for f in findings if not _same(f, s.expect, s.culprits, s.link)]
    why = ""
    if first is None:
        why = "nothing found"
    elif not right:
        why = f"first finding {first.get('class')} {first.get('ranks')} link {first.get('link')}"
    elif not in_time:
        why = f"named after {latency:.1f} s (deadline {s.deadline_s:.0f} s)"
    return Verdict(correct=right and in_time, detected=detected, latency_s=latency, first=first, false=false, why=why)


def wilson(k: int, n: int, z: float = 1.96) -> Optional[tuple]:
    """95 % Wilson score interval of k successes in n runs (None without runs)."""
    if n <= 0:
        return None
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / d
    return max(0.0, c - h), min(1.0, c + h)


def summary(f: Optional[Dict[str, Any]]) -> str:
    """One line for a finding: class, ranks, link, the evidence's summary."""
    if f is None:
        return "-"
    ev = f.get("evidence") or {}
    link = f" link {f['link'][0]}-{f['link'][1]}" if f.get("link") else ""
    what = ev.get("summary") or ev.get("reason") or ""
    return f"{f.get('kind')} {f.get('class')} {f.get('ranks')}{link} {str(f.get('comm', '')).rsplit('/', 1)[-1]} " \
           f"{f.get('op')} seq {f.get('seq')}: {what}"


def describe(s: Scenario, result: Any, v: Verdict) -> str:
    """What a person fixing detection needs: the expected answer, the first finding, the latency, the
    false findings, what ccld printed."""
    want = "nothing" if s.expect is None else f"{s.expect} {s.link and ('link %s' % s.link) or s.culprits}"
    lat = "-" if v.latency_s is None else f"{v.latency_s:.1f} s"
    lines = [f"{s.key}: {'correct' if v.correct else 'WRONG'} ({v.why or 'as expected'}); expected {want} within "
             f"{s.deadline_s:.0f} s; first: {summary(v.first)}; onset -> first {lat}; false findings {len(v.false)}"]
    lines += [f"  false: {summary(f)}" for f in v.false[:6]]
    onset = getattr(result, "onset", None)
    named = [f for f in result.findings if is_real(f) and _same(f, s.expect, s.culprits, s.link)]
    if s.expect is not None and named and named[0] is not v.first and onset is not None:
        lines.append(f"  the right finding came {named[0]['detected_at'] - onset:.1f} s after the onset: "
                     f"{summary(named[0])}")
    base = getattr(result, "baseline_s", None)
    if base is not None:
        lines.append(f"  healthy running before the onset: {base:.0f} s")
    lines += [f"  printed (whole job): {t}" for t in (getattr(result, "terminal", None) or [])[:8]]
    return "\n".join(lines)
