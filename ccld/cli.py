"""The `ccld` command: parse, build, run. Each verb's work lives in its own module."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import List, Optional

from ccld import __version__
from ccld.errors import CcldError, EnvironmentProblem

EPILOG = """examples:
  ccld run -- torchrun --nproc-per-node 4 train.py      trace a job from its start
  ccld agent --pid 12345 --collector tcp://10.0.0.5:5555 attach to a running job (its launcher's pid)
  ccld collector --listen tcp://0.0.0.0:5555 --store runs/today --findings findings.jsonl
  ccld diagnose runs/today                              re-run the detectors on a recorded store
  ccld links runs/today                                 which rank pair every TCP connection joins
  ccld export runs/today --perfetto today.pftrace       a trace to open in ui.perfetto.dev
  ccld report runs/today -o report.html                 one HTML page: findings, heatmaps, plots
  ccld collector --metrics 127.0.0.1:9555               also serve Prometheus /metrics (and /snapshot)
  ccld top 127.0.0.1:9555                               live view of that collector: ranks, links, findings
  ccld diagnose --flight-recorder /tmp/fr               findings from PyTorch Flight Recorder dumps
  ccld diagnose --ops ops.csv                           findings from a per-op timing table
  ccld diagnose --kineto traces/                        findings from torch.profiler traces, one per rank
  ccld diagnose --nccl-inspector logs/                  findings from NCCL Inspector logs (verbose mode)
  ccld export runs/today --failure-trace failures.csv   one record per finding, for schedulers and simulators
  ccld keys /etc/ccld collector                         key pair for CurveZMQ (listening beyond loopback)
  ccld demo --fault hang                                a 4-rank CPU job with one rank that hangs
"""

DEFAULT_LISTEN = "tcp://127.0.0.1:5555"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ccld", description="Find the rank and link that make a distributed "
                                "training job hang or crawl, while it runs.", epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"ccld {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug detail to stderr")
    sub = p.add_subparsers(dest="verb", metavar="VERB")

    def detector_flags(sp):
        sp.add_argument("--hang-after", type=float, default=None, metavar="S",
                        help="shortest wait (s) reported as a hang, fixed; by default 5 s, and 3 s once a "
                             "minute of the job's own waits is known; it grows with the job's normal waits")

    c = sub.add_parser("collector", help="receive events from agents, store them, report findings")
    c.add_argument("--listen", default=DEFAULT_LISTEN, help=f"ZeroMQ endpoint to bind (default {DEFAULT_LISTEN})")
    c.add_argument("--store", metavar="DIR", help="append every frame to this store directory")
    c.add_argument("--findings", metavar="FILE.jsonl", help="append findings here, one JSON object a line")
    c.add_argument("--perfetto", metavar="FILE", help="at exit, write the store as a Perfetto trace (.json: "
                   "Chrome JSON); without --store a temporary store is used and removed")
    c.add_argument("--metrics", metavar="HOST:PORT", help="serve Prometheus metrics at /metrics and a JSON "
                   "snapshot for `ccld top` at /snapshot (read-only, unauthenticated; port 0: any free port)")
    c.add_argument("--curve-key", metavar="FILE.key_secret",
                   help="CurveZMQ: this collector's secret key (needed to listen beyond loopback)")
    c.add_argument("--allow-keys", metavar="DIR", help="CurveZMQ: directory of allowed agents' *.key files")
    c.add_argument("--time-listen", default="auto", metavar="tcp://HOST:PORT|off",
                   help="time service for the agents' clock sync (default: the --listen port + 1)")
    detector_flags(c)

    a = sub.add_parser("agent", help="trace the ranks on this node and ship events to a collector")
    a.add_argument("--collector", default=DEFAULT_LISTEN, metavar="tcp://HOST:PORT")
    a.add_argument("--pid", type=int, action="append", default=[], metavar="PID",
                   help="a rank, or a launcher whose descendants are ranks (repeatable)")
    a.add_argument("--discover", action="store_true", help="trace every rank found on this node")
    a.add_argument("--no-bpf", action="store_true", help="use /proc only, no eBPF probes")
    a.add_argument("--probes", default=None, metavar="LIST",
                   help="probe families to load, comma-separated (default all: gloo,nccl,net,sched,rdma)")
    a.add_argument("--curve-key", metavar="FILE.key_secret", help="CurveZMQ: this agent's secret key")
    a.add_argument("--collector-key", metavar="FILE.key", help="CurveZMQ: the collector's public key")
    a.add_argument("--time-service", metavar="tcp://HOST:PORT|off",
                   help="the collector's time service for clock sync (default: the collector's port + 1; "
                        "off: convert with this node's wall clock)")
    a.add_argument("--node", metavar="NAME", help="this node's name in the trace (default: the host name)")
    a.add_argument("--spool", metavar="DIR|memory",
                   help="keep frames here until the collector acknowledges them, and replay them after it "
                        "restarts (default /var/lib/ccld/spool/NODE as root, else $TMPDIR/ccld-spool-UID/NODE; "
                        "memory: keep them in memory only, up to 32 MiB)")
    a.add_argument("--spool-max-mb", type=float, default=256, metavar="N",
                   help="the spool's bound; beyond it the oldest frames are dropped and counted (default 256)")
    a.add_argument("--nccl-plugin-socket", metavar="PATH",
                   help="receive ccld's NCCL profiler plugin from jobs started elsewhere at this Unix socket "
                        "(the job sets NCCL_PROFILER_PLUGIN=<libnccl-profiler-ccld.so> and "
                        "CCLD_NCCLPROF_ENDPOINT=PATH; docs/nccl-profiler.md)")
    a.add_argument("--ebpf", action="store_true", help=argparse.SUPPRESS)  # print programs + cflags, exit

    r = sub.add_parser("run", help="run a command and trace every rank it starts")
    r.add_argument("--collector", metavar="ADDR", help="ship to this collector instead of starting one")
    r.add_argument("--store", metavar="DIR")
    r.add_argument("--findings", metavar="FILE.jsonl")
    r.add_argument("--perfetto", metavar="FILE", help="at exit, write a Perfetto trace of the run (.json: "
                   "Chrome JSON)")
    r.add_argument("--no-bpf", action="store_true", help="use /proc only, no eBPF probes")
    r.add_argument("--metrics", metavar="HOST:PORT", help="the collector also serves /metrics and /snapshot here")
    detector_flags(r)
    r.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD [ARG...]")

    k = sub.add_parser("keys", help="make a CurveZMQ key pair (NAME.key, NAME.key_secret) in DIR")
    k.add_argument("dir", metavar="DIR")
    k.add_argument("name", metavar="NAME", help="e.g. collector, or the agent's node name")

    def ops_flag(sp):
        sp.add_argument("--ops", metavar="FILE", help="instead of a store: a per-op table, one row per operation "
                        "a rank ran (CSV, JSON Lines, .gz, Parquet with pyarrow; docs/ops-table.md)")
        sp.add_argument("--kineto", metavar="DIR|FILE", nargs="+", help="instead of a store: torch.profiler "
                        "(Kineto) traces, one per rank (.json, .json.gz; a directory: all of them; docs/kineto.md)")
        sp.add_argument("--nccl-inspector", metavar="DIR", help="instead of a store: NCCL Inspector logs, one "
                        "file per process (*.log, *.jsonl, .gz; NCCL_INSPECTOR_DUMP_VERBOSE=1; docs/nccl-inspector.md)")

    d = sub.add_parser("diagnose", help="replay a store through the detectors (or read Flight Recorder dumps, "
                       "or a per-op table)")
    d.add_argument("store", metavar="STORE_DIR", nargs="?")
    d.add_argument("--flight-recorder", metavar="DIR", help="instead of a store: PyTorch Flight Recorder dumps "
                   "(one file per rank, pickle or JSON, NCCL or gloo)")
    ops_flag(d)
    d.add_argument("--fr-prefix", metavar="PREFIX", help="dump file names are PREFIX<rank> (default: guessed)")
    d.add_argument("--json", action="store_true", help="print findings as JSON lines")
    detector_flags(d)

    ln = sub.add_parser("links", help="the link table of a store: every connection labelled with its rank pair")
    ln.add_argument("store", metavar="STORE_DIR")
    ln.add_argument("--job", help="only this job (MASTER_ADDR:MASTER_PORT)")
    ln.add_argument("--json", action="store_true", help="one JSON object per connection")

    x = sub.add_parser("export", help="write a store as a Perfetto trace (or Chrome JSON)",
                       description="Write a store as a trace for ui.perfetto.dev: a track per rank, a slice "
                       "per collective, flows joining one collective across ranks, findings as markers.")
    x.add_argument("store", metavar="STORE_DIR", nargs="?")
    ops_flag(x)
    x.add_argument("--perfetto", metavar="OUT.pftrace", help="the trace file to write")
    x.add_argument("--failure-trace", metavar="OUT.csv|OUT.jsonl", help="instead: one record per finding "
                   "(time, duration, class, ranks, nodes, job; docs/failure-trace.md)")
    x.add_argument("--format", choices=["perfetto", "json"],
                   help="perfetto (protobuf, default) or json (Chrome JSON; the default for OUT.json)")
    x.add_argument("--from", dest="t_from", type=float, metavar="S",
                   help="only what overlaps Unix time S and later")
    x.add_argument("--to", dest="t_to", type=float, metavar="S", help="only what overlaps Unix time S and earlier")
    x.add_argument("--ranks", metavar="0,2", help="only these global ranks (e.g. 0,2,4-7)")
    x.add_argument("--findings", metavar="FILE.jsonl",
                   help="mark the findings of this file (the collector's) instead of replaying the store")
    x.add_argument("--no-findings", action="store_true", help="no finding markers (skips the replay)")
    detector_flags(x)

    rp = sub.add_parser("report", help="write one self-contained HTML page about a store (findings, plots)")
    rp.add_argument("store", metavar="STORE_DIR", nargs="?")
    ops_flag(rp)
    rp.add_argument("-o", "--output", default="report.html", metavar="FILE.html",
                    help="where to write the page (default report.html)")
    rp.add_argument("--comm", metavar="COMM", help="communicator to draw (default: the widest, then busiest)")
    rp.add_argument("--last", type=int, default=200, metavar="N",
                    help="collectives in the arrival heatmap, newest first (default 200)")
    detector_flags(rp)

    t = sub.add_parser("top", help="live view of a running collector (its --metrics address)")
    t.add_argument("addr", nargs="?", default="127.0.0.1:9555", metavar="HOST:PORT",
                   help="the collector's --metrics address (default 127.0.0.1:9555)")
    t.add_argument("--interval", type=float, default=1.0, metavar="S", help="refresh period (default 1 s)")
    t.add_argument("--once", action="store_true", help="print one screen to stdout and exit")

    m = sub.add_parser("demo", help="a 4-rank gloo job on the CPU with an injected fault, traced")
    m.add_argument("--fault", default="hang", choices=["hang", "stop", "none"],
                   help="hang: a rank sleeps forever; stop: a rank is SIGSTOPped; none: healthy")
    m.add_argument("--ranks", type=int, default=4)
    m.add_argument("--seed", type=int, default=None, help="fix the random rank/step of the fault")
    m.add_argument("--keep", metavar="DIR", help="keep the store and findings in DIR")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="ccld: %(levelname)s %(name)s: %(message)s")
    if not args.verb:
        _parser().print_help()
        return 2
    from ccld import commands
    try:
        return getattr(commands, f"cmd_{args.verb}")(args)
    except EnvironmentProblem as e:
        print(f"ccld: {e}" + (f"\n  fix: {e.hint}" if e.hint else ""), file=sys.stderr)
        return 1
    except CcldError as e:
        print(f"ccld: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `ccld diagnose --json | head`: the reader is done, so are we
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
