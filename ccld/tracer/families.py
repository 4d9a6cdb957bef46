"""The probe families this build has, and loading them: their names (FAMILY_NAMES, in load order),
each family built with its translator, and loading them (compiled, or taken from the compiled-program
cache) before the agent that adopts them exists (`ccld run` loads them while the job starts).

A family that cannot load is a warning and costs only its own events; when none loads, the
environment is the problem (Preloaded.problem) and the agent traces with /proc only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ccld import wire as ev
from ccld.bpf.progcache import PROGRAMS
from ccld.errors import CcldError, EnvironmentProblem
from ccld.tracer.relay import Relay

FAMILY_NAMES = tuple(PROGRAMS)  # every probe family this build has, in load order


def build_families(emit: Callable[[ev.Event], None], names: Sequence[str] = FAMILY_NAMES):
    """(family, translator) pairs for the probe families named (default: all)."""
    from ccld.bpf.gloo import GlooFamily
    from ccld.bpf.gloo_translator import GlooTranslator
    from ccld.bpf.nccl import NcclFamily, NcclTranslator
    from ccld.bpf.net import NetFamily, NetTranslator
    from ccld.bpf.pgnccl import PgncclFamily, PgncclTranslator
    from ccld.bpf.sched import SchedFamily, SchedTranslator
    from ccld.bpf.rdma import RdmaFamily, RdmaTranslator
    builders = {"gloo": (GlooFamily, GlooTranslator), "nccl": (NcclFamily, NcclTranslator),
                "pgnccl": (PgncclFamily, PgncclTranslator), "net": (NetFamily, NetTranslator),
                "sched": (SchedFamily, SchedTranslator), "rdma": (RdmaFamily, RdmaTranslator)}
    out = []
    for name in FAMILY_NAMES:
        if name in names:
            fam_cls, tr_cls = builders[name]
            tr = tr_cls(emit)
            out.append((fam_cls(tr), tr))
    return out


@dataclass
class Preloaded:
    """Probe families loaded before their agent exists (load_families)."""
    relay: Relay
    families: List[Tuple[object, object]]
    sources: List[str]
    problem: Optional[EnvironmentProblem]
    warnings: List[str] = field(default_factory=list)


def load_families(probes: Sequence[str] = FAMILY_NAMES, use_bpf: bool = True,
                  programs: Optional[Dict[str, object]] = None) -> Preloaded:
    """Compile (or take from the compiled-program cache) and load the probe families named;
    `programs` holds those progcache.preload() already put in the kernel. Says nothing; the agent
    that adopts them says what is on (Agent(preloaded=...))."""
    programs = programs or {}
    relay = Relay()
    pre = Preloaded(relay, [], ["proc"], None)
    if not use_bpf:
        return pre
    from ccld.bpf.progcache import bpf_available
    pre.problem = bpf_available()
    if pre.problem is not None:
        return pre
    failed = []
    built = build_families(relay, probes)
    from ccld.bpf.loader import compile_ahead
    compile_ahead([fam for fam, _ in built if fam.NAME not in programs])
    for fam, tr in built:
        try:
            fam.load(programs.pop(fam.NAME, None))
        except EnvironmentProblem as e:
            failed.append((fam.NAME, e))
            continue
        pre.families.append((fam, tr))
        pre.sources.append(f"{fam.NAME} (eBPF)")
    for prog in programs.values():  # preloaded for a family not asked for
        prog.cleanup()
    if failed and not pre.families:
        pre.problem = failed[0][1]  # nothing loads: the environment, not one family
    else:
        for name, e in failed:  # one family that cannot load costs only its own events
            pre.warnings.append(f"ccld: warning: {name} probes are off: {e} (fix: {e.hint})")
    return pre


def parse_probes(text: str) -> List[str]:
    """`--probes gloo,net` -> ["gloo", "net"]; an unknown name is an error that lists the known ones."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in FAMILY_NAMES]
    if bad or not names:
        raise CcldError(f"--probes: unknown probe famil{'ies' if len(bad) > 1 else 'y'} {', '.join(bad) or '(none)'}"
                        f"; choose from {','.join(FAMILY_NAMES)}")
    return names
