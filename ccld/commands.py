"""One function per `ccld` verb: turn parsed arguments into calls on the modules that do the work."""
from __future__ import annotations

import json
import signal
import sys
import threading

from ccld.errors import CcldError


def _say(line: str) -> None:
    print(line, flush=True)


def _wait_for_signal() -> None:
    done = threading.Event()
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda *_: done.set())
    while not done.wait(0.5):
        pass


def cmd_collector(args) -> int:
    from ccld.collector.server import Collector
    for flag in ("perfetto", "metrics"):
        if getattr(args, flag):
            _say(f"ccld: note: --{flag} is not built yet; ignored")
    c = Collector(listen=args.listen, store_dir=args.store, findings_path=args.findings, on_line=_say,
                  floor_s=args.hang_after)
    c.start()
    _say(f"ccld collector: listening on {c.endpoint}" + (f", store {args.store}" if args.store else "")
         + (f", findings {args.findings}" if args.findings else "") + ". Ctrl-C to end")
    try:
        _wait_for_signal()
    finally:
        c.stop()
    return 0


def cmd_agent(args) -> int:
    if args.ebpf:
        from ccld.tracer.agent import _families
        for fam, _ in _families(lambda e: None):
            print(fam.program_text())
        return 0
    from ccld.tracer.agent import Agent
    agent = Agent(args.collector, pids=args.pid, discover_all=args.discover, use_bpf=not args.no_bpf, say=_say)
    for pid in args.pid:
        try:
            import os
            os.kill(pid, 0)
        except ProcessLookupError:
            raise CcldError(f"no process with pid {pid}") from None
        except PermissionError:
            raise CcldError(f"no permission to trace pid {pid}: run ccld as root (or the process's owner "
                            "with CAP_SYS_PTRACE)") from None
    agent.load()
    agent.start()
    what = f"pid {', '.join(map(str, args.pid))}" if args.pid else "every rank on this node"
    _say(f"ccld agent: tracing {what}; sources: {', '.join(agent.sources)}; collector {args.collector}. "
         "Ctrl-C to end")
    try:
        _wait_for_signal()
    finally:
        agent.stop()
    return 0


def cmd_run(args) -> int:
    from ccld import launch
    if args.perfetto:
        _say("ccld: note: --perfetto is not built yet; ignored")
    return launch.run(args.cmd, args.collector, args.store, args.findings, args.hang_after,
                      use_bpf=not args.no_bpf, say=_say)


def cmd_diagnose(args) -> int:
    from ccld.diagnose.findings import format_line
    from ccld.diagnose.replay import format_report, replay
    _timeline, findings, recoveries, report = replay(args.store, floor_s=args.hang_after)
    if args.json:
        for f in findings:
            print(json.dumps(f.to_json()))
        for r in recoveries:
            print(json.dumps(r))
        return 0
    for line in format_report(report):
        print(line)
    if not findings:
        print("no findings")
    for f in findings:
        print(format_line(f))
    for r in recoveries:
        print(format_line(r))
    return 0


def cmd_demo(args) -> int:
    from ccld import demo
    return demo.run(fault=args.fault, ranks=args.ranks, seed=args.seed, keep=args.keep, say=_say)
