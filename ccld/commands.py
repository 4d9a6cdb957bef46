"""One function per `ccld` verb: turn parsed arguments into calls on the modules that do the work."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
from typing import Any, Iterator, Optional, Tuple

from ccld.errors import CcldError
from ccld.launch import WAIT_SLICE_S, StopFlag


def _say(line: str) -> None:
    print(line, flush=True)


def _on_signal() -> StopFlag:
    """SIGINT and SIGTERM from now on set the flag instead of raising: installed before a command
    says it is ready, so a signal sent as soon as the line is read still stops it cleanly (it used to
    come before the handler and leave the collector's threads running, the process alive)."""
    done = StopFlag()

    def stop(*_) -> None:
        done.set()
        for s in (signal.SIGINT, signal.SIGTERM):  # a second one ends a long stop (a big export) at once
            signal.signal(s, signal.SIG_DFL)

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, stop)
    done.wake_on_signals()
    return done


def _wait_for(done: StopFlag) -> None:
    # The signal's byte ends poll() at once; the Python handler that sets the flag runs right after
    # it, before the next wait. The timeout only bounds a wait whose byte was lost (a full pipe).
    while not done.wait(WAIT_SLICE_S):
        pass


def cmd_collector(args) -> int:
    from ccld.collector.server import Collector
    keys = _server_keys(args)
    store, tmp_store = args.store, None
    if args.perfetto and not store:  # the trace is made from a store: keep a temporary one for it
        import tempfile
        store = tmp_store = tempfile.mkdtemp(prefix="ccld-store-")
    c = Collector(listen=args.listen, store_dir=store, findings_path=args.findings, on_line=_say,
                  floor_s=args.hang_after, keys=keys, time_listen=args.time_listen)
    try:
        c.start()
    except BaseException:
        if tmp_store:
            import shutil
            shutil.rmtree(tmp_store, ignore_errors=True)
        raise
    done = _on_signal()
    metrics = None
    try:
        metrics = _serve_metrics(c, args.metrics)
        _say(f"ccld collector: listening on {c.endpoint}"
             + (f", time service {c.time_service.endpoint}" if c.time_service else "")
             + (f", store {args.store}" if args.store else "")
             + (f", findings {args.findings}" if args.findings else "")
             + (f", metrics {metrics.url}/metrics" if metrics else "")
             + (f", trace {args.perfetto} at exit" if args.perfetto else "") + ". Ctrl-C to end")
        _wait_for(done)
    finally:
        if metrics:
            metrics.stop()
        c.stop()
        if args.perfetto:
            from ccld.export import export_at_stop
            export_at_stop(store, args.perfetto, c.findings, _say, remove_store=tmp_store is not None)
    return 0


def cmd_agent(args) -> int:
    if args.ebpf:
        from ccld.tracer.families import FAMILY_NAMES, build_families, parse_probes
        for fam, _ in build_families(lambda e: None, parse_probes(args.probes) if args.probes else FAMILY_NAMES):
            print(fam.program_text())
        return 0
    from ccld.tracer.agent import Agent
    from ccld.tracer.families import FAMILY_NAMES, parse_probes
    probes = parse_probes(args.probes) if args.probes else FAMILY_NAMES
    for pid in args.pid:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            raise CcldError(f"no process with pid {pid}") from None
        except PermissionError:
            raise CcldError(f"no permission to trace pid {pid}: run ccld as root (or the process's owner "
                            "with CAP_SYS_PTRACE)") from None
    if args.spool_max_mb <= 0:
        raise CcldError(f"--spool-max-mb must be positive, got {args.spool_max_mb:g}")
    from ccld.tracer.spool_dir import default_dir
    node = args.node or socket.gethostname()
    spool = None if args.spool == "memory" else (args.spool or default_dir(node))
    agent = Agent(args.collector, pids=args.pid, discover_all=args.discover, use_bpf=not args.no_bpf, say=_say,
                  keys=_client_keys(args), probes=probes, node=node, time_service=args.time_service,
                  spool_dir=spool, spool_max_bytes=int(args.spool_max_mb * 2**20))
    agent.load()
    if args.nccl_plugin_socket:
        agent.open_ncclprof_sink(args.nccl_plugin_socket)
    done = _on_signal()  # a signal during the start is kept: the agent stops as soon as it has started
    agent.start()
    what = f"pid {', '.join(map(str, args.pid))}" if args.pid else "every rank on this node"
    try:
        _say(f"ccld agent: tracing {what}; sources: {', '.join(agent.all_sources)}; collector {args.collector}; "
             f"{agent.spool.describe()}. Ctrl-C to end")
        _wait_for(done)
    finally:
        agent.stop()
        _say(_shipped_line(agent.shipper.stats()))
    return 0


def _shipped_line(s) -> str:
    """The agent's last line: what it shipped, sent again, and lost (the counters it ships, and more)."""
    lost = s["queue_dropped"] + s["spool_dropped_events"]
    return (f"ccld agent: shipped {s['sent_frames']} frames ({s['sent_events']} events); replayed "
            f"{s['spool_replayed_frames']} after {s['collector_restarts']} collector restarts and "
            f"{s['disconnects']} disconnects; lost {lost} events (queue {s['queue_dropped']}, spool "
            f"{s['spool_dropped_frames']} frames); {s['spool_unacked_evicted_frames']} unacknowledged frames "
            f"evicted; {s['spool_frames']} frames left in the spool")


def _serve_metrics(collector, addr):
    """The /metrics + /snapshot endpoint of `collector` on HOST:PORT, or None without --metrics."""
    if not addr:
        return None
    from ccld.collector.metrics import MetricsServer
    try:
        return MetricsServer(collector, addr).start()
    except BaseException:
        collector.stop()
        raise


def _server_keys(args):
    from ccld.security import ServerKeys
    if bool(args.curve_key) != bool(args.allow_keys):
        raise CcldError("--curve-key and --allow-keys go together (the collector's secret key and the "
                        "directory of agents it accepts)")
    return ServerKeys(args.curve_key, args.allow_keys) if args.curve_key else None


def _client_keys(args):
    from ccld.security import ClientKeys
    if bool(args.curve_key) != bool(args.collector_key):
        raise CcldError("--curve-key and --collector-key go together (this agent's secret key and the "
                        "collector's public key)")
    return ClientKeys(args.curve_key, args.collector_key) if args.curve_key else None


def cmd_keys(args) -> int:
    from ccld.security import make_keypair
    public, secret = make_keypair(args.dir, args.name)
    _say(f"ccld keys: public {public} (give it to the other side), secret {secret} (owner-only, keep it here)")
    return 0


def cmd_run(args) -> int:
    from ccld import launch
    return launch.run(args.cmd, args.collector, args.store, args.findings, args.hang_after,
                      use_bpf=not args.no_bpf, say=_say, perfetto=args.perfetto, metrics=args.metrics)


# The sources a verb reads beside a store: (argument, flag, what it takes). Each is made into a temporary
# store (removed afterwards), so a per-op table, Kineto traces and NCCL Inspector logs take the store's
# one path through the detectors.
_SOURCES = (("ops", "--ops", "FILE"), ("kineto", "--kineto", "DIR"), ("nccl_inspector", "--nccl-inspector", "DIR"))


def _sources_text(first: str) -> str:
    """"FIRST, --ops FILE, --kineto DIR or --nccl-inspector DIR", for the errors."""
    names = [first] + [f"{flag} {what}" for _, flag, what in _SOURCES]
    return ", ".join(names[:-1]) + " or " + names[-1]


@contextlib.contextmanager
def _read_source(attr: str, value: Any) -> Iterator[Tuple[str, list]]:
    """(store directory, the lines that say what was read) of one non-store source."""
    if attr == "ops":
        from ccld.diagnose.opframes import format_job, table_store
        with table_store(value) as (store, job):
            for line in job.table.bad_lines():  # a bad row is one line; the rest was read
                print(f"ccld: {line}", file=sys.stderr)
            yield store, format_job(job)
    elif attr == "kineto":
        from ccld.diagnose.kineto import kineto_store
        with kineto_store(value) as got:
            yield got
    else:
        from ccld.diagnose.inspector import inspector_store
        with inspector_store(value) as got:
            yield got


@contextlib.contextmanager
def _source(args) -> Iterator[Tuple[str, Optional[list]]]:
    """(store directory, the lines saying what was read, or None for STORE_DIR) a verb reads."""
    given = [(attr, flag) for attr, flag, _ in _SOURCES if getattr(args, attr, None)]
    if len(given) + bool(args.store) > 1:
        names = (["STORE_DIR"] if args.store else []) + [flag for _, flag in given]
        raise CcldError(f"{' and '.join(names)}: give one of {_sources_text('STORE_DIR')}, not both")
    if given:
        attr = given[0][0]
        with _read_source(attr, getattr(args, attr)) as got:
            yield got
        return
    if not args.store:
        raise CcldError(f"nothing to {args.verb}: give "
                        + _sources_text("STORE_DIR, --flight-recorder DIR" if args.verb == "diagnose" else "STORE_DIR"))
    yield args.store, None


def _source_name(args) -> Optional[str]:
    """What a report says it was made from, when not a store."""
    for attr, flag, _ in _SOURCES:
        value = getattr(args, attr, None)
        if value:
            return " ".join([flag] + (list(value) if isinstance(value, list) else [value]))
    return None


def cmd_diagnose(args) -> int:
    from ccld.diagnose.findings import format_line
    from ccld.diagnose.replay import format_report, replay
    if args.flight_recorder:
        from ccld.diagnose.frcheck import diagnose_dumps, format_detail, format_dumps
        if args.store or any(getattr(args, attr, None) for attr, _, _ in _SOURCES):
            raise CcldError(f"give one of {_sources_text('STORE_DIR, --flight-recorder DIR')}")
        findings, dumps = diagnose_dumps(args.flight_recorder, prefix=args.fr_prefix,
                                         **({} if args.hang_after is None else {"floor_s": args.hang_after}))
        lines = [json.dumps(f.to_json()) for f in findings] if args.json else format_dumps(dumps) + (
            [ln for f in findings for ln in [format_line(f)] + format_detail(f)] or ["no findings"])
        for line in lines:
            print(line)
        return 0
    with _source(args) as (store, read):
        _timeline, findings, recoveries, report = replay(store, floor_s=args.hang_after)
    if args.json:
        for f in findings:
            print(json.dumps(f.to_json()))
        for r in recoveries:
            print(json.dumps(r))
        return 0
    head = format_report(report) if read is None else read + format_report(report, store=False)
    for line in head:
        print(line)
    if not findings:
        print("no findings")
    for f in findings:
        print(format_line(f))
    for r in recoveries:
        print(format_line(r))
    return 0


def cmd_links(args) -> int:
    from ccld.timeline.ingest import load_timeline
    from ccld.timeline.links import format_table
    tl = load_timeline(args.store)
    rows = tl.links.table(args.job)
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    for line in format_table(rows, tl.links):
        print(line)
    return 0


def cmd_report(args) -> int:
    from ccld.export.report import write_report
    if args.last < 1:
        raise CcldError("--last must be at least 1")
    # progress lines for a person watching; a script gets only the summary line
    progress = (lambda m: print(f"ccld report: {m}", file=sys.stderr, flush=True)) if sys.stderr.isatty() else None
    with _source(args) as (store, _read):
        s = write_report(store, args.output, progress=progress, comm=args.comm, last=args.last,
                         floor_s=args.hang_after, source=_source_name(args))
    _say(f"ccld report: {s['path']} ({s['bytes'] // 1024} KiB): {s['ranks']} ranks, {s['comms']} communicators, "
         f"{s['collectives']} collectives, {s['findings']} finding{'s' * (s['findings'] != 1)} "
         f"({s['active']} active)")
    return 0


def cmd_export(args) -> int:
    with _source(args) as (store, _read):
        return _export(args, store)


def _export(args, store: str) -> int:
    from ccld.export import export_trace, guess_format, parse_ranks, progress_line, read_findings, summary_line
    if args.failure_trace:
        from ccld.export.failures import write_failure_trace
        _say(write_failure_trace(store, args.failure_trace, findings_path=args.findings,
                                 hang_after=args.hang_after))
        return 0
    if not args.perfetto:
        raise CcldError("say what to write: --perfetto OUT.pftrace or --failure-trace OUT.csv")
    fmt = guess_format(args.perfetto, args.format)
    ranks = parse_ranks(args.ranks)
    findings = [] if args.no_findings else read_findings(args.findings) if args.findings else None
    shown = [0.0]

    def progress(p) -> None:  # long work says how it goes, on stderr, every PROGRESS_S
        if p.get("elapsed_s", 0) - shown[0] >= PROGRESS_S:
            shown[0] = p.get("elapsed_s", 0)
            print(progress_line(p), file=sys.stderr, flush=True)

    stats = export_trace(store, args.perfetto, fmt, t_from=args.t_from, t_to=args.t_to, ranks=ranks,
                         progress=progress, findings=findings, hang_after=args.hang_after)
    for p in stats["store_problems"][:5]:
        print(f"ccld export: store problem: {p}", file=sys.stderr)
    _say(summary_line(stats))
    return 0


PROGRESS_S = 2.0  # `ccld export` progress period


def cmd_top(args) -> int:
    from ccld import top
    return top.run(args.addr, args.interval, args.once, say=_say)


def cmd_demo(args) -> int:
    from ccld import demo
    return demo.run(fault=args.fault, ranks=args.ranks, seed=args.seed, keep=args.keep, say=_say)
