"""The rewrite guard (issue 17): run ccld's offline commands on a set of stores with two versions of
ccld (a git revision and a working tree) and report every difference in what they produce.

Each version runs as its own subprocess (`PYTHONPATH=<its root>`, this interpreter, cwd a temp dir),
so neither imports the other's code; this script imports no ccld at all and reads the outputs with
their formats' own readers (canonical_outputs.py: json, csv, html.parser, perfetto's shipped
TracePacket protos), so it keeps working while ccld's modules move. Per store, the commands in
COMMANDS: `diagnose --json`, `diagnose`, `links --json`, `export` to Perfetto and to Chrome JSON,
the failure trace as JSONL and CSV, `report`. Compared as (canonical_outputs.py says how):
  findings, links, failure records: multisets of JSON objects
  Chrome JSON, Perfetto: multisets of trace content (events, slices, tracks, flows), not bytes
  `diagnose` text and the `report` page: their text in reading order (plots by digest)
Not compared, because it legitimately differs between two runs of the same code:
  - findings' and failure records' "stack" (IGNORED_FINDING_FIELDS: py-spy's dump of a live
    process; None offline). No other finding field is volatile: offline, onset_at, detected_at and
    every time in the evidence come from the recording, not from the clock of the run
  - the report's "generated YYYY-MM-DD HH:MM UTC" (VOLATILE_TEXT)
  - the store's path, each version's output dir and root in any text (<store>, <out>, <root>)
  - floats beyond FLOAT_DECIMALS = 6 places (array arithmetic may change the last bit; times are
    Unix seconds or microseconds, so that is 1 us or 1 ps, far below what any output states)
  - the summary line `export` and `report` print (output path, size, seconds, events/s): the
    counts in it are the trace's content, compared in full
Exit status: 1 when anything differs or a command fails in one version only (or in both, with
different errors), else 0.
Times: time.monotonic() around each command, reported (ref/new seconds), never compared.
Caveat: the revision is extracted with `git archive`, and its C export accelerator is built in the
temp copy (unless --no-build-ext), so both sides export as after `make setup`; CCLD_PURE_PYTHON=1 in
the environment makes both pure Python.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from canonical_outputs import (FLOAT_DECIMALS, IGNORED_FINDING_FIELDS, SHOWN, canon_chrome, canon_csv, canon_html,
                               canon_perfetto, canon_records, canon_text, compare, event_id, finding_id, key_text,
                               record_id)

COMMAND_TIMEOUT_S = 600  # one command on one store; e2e fault-suite stores export in seconds
RUN_CCLD = "import sys; from ccld.cli import main; sys.exit(main())"  # `ccld` without a console script


# ---- the commands --------------------------------------------------------------------------------

def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# name -> (argv after `ccld`, with {store} and {out}; where the output is ("-": stdout); its reader;
#          compared in order; identity of an item for field-level diffs)
COMMANDS: Dict[str, Tuple[List[str], str, Callable[[str], List[Any]], bool, Optional[Callable[[Any], Any]]]] = {
    "diagnose --json": (["diagnose", "{store}", "--json"], "-",
                        lambda p: canon_records(_read(p).splitlines()), False, finding_id),
    "diagnose": (["diagnose", "{store}"], "-", lambda p: canon_text(_read(p)), True, None),
    "links --json": (["links", "{store}", "--json"], "-", lambda p: canon_records(_read(p).splitlines()),
                     False, record_id),
    "export perfetto": (["export", "{store}", "--perfetto", "{out}/trace.pftrace"], "trace.pftrace",
                        lambda p: canon_perfetto(_read_bytes(p)), False, event_id),
    "export chrome": (["export", "{store}", "--perfetto", "{out}/trace.json", "--format", "json"], "trace.json",
                      lambda p: canon_chrome(json.loads(_read(p))), False, event_id),
    "failure-trace jsonl": (["export", "{store}", "--failure-trace", "{out}/failures.jsonl"], "failures.jsonl",
                            lambda p: canon_records(_read(p).splitlines()), False, finding_id),
    "failure-trace csv": (["export", "{store}", "--failure-trace", "{out}/failures.csv"], "failures.csv",
                          lambda p: canon_csv(_read(p)), False, finding_id),
    "report": (["report", "{store}", "-o", "{out}/report.html"], "report.html",
               lambda p: canon_html(_read(p)), True, None),
}


class Version:
    """One ccld to run: a root that holds its `ccld` package."""

    def __init__(self, name: str, root: str, what: str) -> None:
        self.name, self.root, self.what = name, os.path.abspath(root), what

    def env(self) -> Dict[str, str]:
        env = dict(os.environ, PYTHONPATH=self.root)
        env.pop("PYTHONSTARTUP", None)
        return env

    def check(self, cwd: str) -> str:
        """Where `import ccld` lands for this version; refuses one that would import the other's."""
        got = subprocess.run([sys.executable, "-c", "import ccld; print(ccld.__file__)"], cwd=cwd, env=self.env(),
                             capture_output=True, text=True, timeout=60)
        where = got.stdout.strip()
        if got.returncode != 0 or not where.startswith(self.root + os.sep):
            raise SystemExit(f"compare_outputs: {self.name}: `import ccld` gives {where or got.stderr.strip()!r}, "
                             f"not a file under {self.root}")
        return where

    def run(self, argv: List[str], work: str, timeout_s: float) -> Dict[str, Any]:
        os.makedirs(work, exist_ok=True)
        out_path = os.path.join(work, "stdout.txt")
        t0 = time.monotonic()
        try:
            with open(out_path, "w") as out:
                p = subprocess.run([sys.executable, "-c", RUN_CCLD] + argv, cwd=work, env=self.env(),
                                   stdout=out, stderr=subprocess.PIPE, text=True, timeout=timeout_s)
            rc, err = p.returncode, p.stderr
        except subprocess.TimeoutExpired:
            rc, err = -1, f"timed out after {timeout_s:g} s"
        return {"rc": rc, "seconds": round(time.monotonic() - t0, 2), "stdout": out_path,
                "error": _last_line(err) if rc else None}


def _say(line: str) -> None:
    print(line, flush=True)


def _last_line(text: str) -> str:
    lines = [ln for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "(nothing on stderr)"


def find_stores(top: str) -> List[str]:
    """Every ccld store at or below `top`: a directory whose store.json says format "ccld-store"
    (ccld/store/layout.py, read_meta; the commands themselves check the rest)."""
    out = []
    for d, subdirs, files in os.walk(top):
        subdirs.sort()
        if "store.json" in files:
            try:
                with open(os.path.join(d, "store.json")) as f:
                    if json.load(f).get("format") == "ccld-store":
                        out.append(os.path.abspath(d))
            except (OSError, ValueError, AttributeError):
                pass
    return out


def materialise(repo: str, rev: str, dest: str, build_ext: bool) -> str:
    """`git archive REV` into dest (nothing in the checkout is touched); the short commit it names."""
    sha = subprocess.run(["git", "-C", repo, "rev-parse", "--short", rev + "^{commit}"], capture_output=True,
                         text=True, check=True).stdout.strip()
    archive = subprocess.Popen(["git", "-C", repo, "archive", sha], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", dest], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit(f"compare_outputs: git archive {rev} failed")
    if build_ext and os.path.exists(os.path.join(dest, "setup.py")):
        b = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=dest,
                           capture_output=True, text=True)
        if b.returncode != 0:
            print(f"compare_outputs: building {rev}'s C accelerator failed; it exports in pure Python",
                  file=sys.stderr)
    return sha


def compare_one(command: str, store: str, versions: List[Version], work: str, timeout_s: float,
                shown: int) -> Dict[str, Any]:
    argv, where, read, ordered, pair = COMMANDS[command]
    sides: Dict[str, Dict[str, Any]] = {}
    items: Dict[str, List[Any]] = {}
    for v in versions:
        out = os.path.join(work, v.name, _slug(store), _slug(command))
        res = v.run([a.format(store=store, out=out) for a in argv], out, timeout_s)
        if res["rc"] == 0:
            try:
                got = read(res["stdout"] if where == "-" else os.path.join(out, where))
                # longest first: the store may lie under a root, the outputs under the store's
                subst = sorted(((store, "<store>"), (out, "<out>"), (v.root, "<root>")), key=lambda x: -len(x[0]))
                items[v.name] = [_unpath(x, subst) for x in got]
            except Exception as e:  # an output its format's reader rejects is a result, not a crash
                res["error"] = f"output unreadable: {type(e).__name__}: {e}"
        res.pop("stdout")
        sides[v.name] = res
    ok = [v.name for v in versions if v.name in items]
    if len(ok) == 2:
        diff = compare(items[versions[0].name], items[versions[1].name], ordered, pair, shown)
        status = "same" if diff["same"] else "DIFFERENT"
    elif ok:
        diff, status = {}, f"FAILED in {'new' if ok == [versions[0].name] else 'ref'}"
    else:  # the same error is no difference (a store neither can read); another error is one
        errors = {_unpath(sides[v.name]["error"], [(store, "<store>"), (v.root, "<root>")]) for v in versions}
        diff, status = {}, "both failed" if len(errors) == 1 else "both failed, DIFFERENTLY"
    return {"store": store, "command": command, "status": status, **diff, "runs": sides}


def _unpath(x: Any, subst: Iterable[Tuple[str, str]]) -> Any:
    s = key_text(x)
    for path, name in subst:
        s = s.replace(path, name)
    return s if isinstance(x, str) else json.loads(s)


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s.strip("/"))[-80:]


def label(store: str, repo: str) -> str:
    """A store's short name: its path from the tree under test or from here, without tests/data/ and
    /store (the full path is in --json's results)."""
    rel = next((r for r in (os.path.relpath(store, repo), os.path.relpath(store)) if not r.startswith("..")), store)
    rel = rel[len("tests/data/"):] if rel.startswith("tests/data/") else rel
    return rel[:-len("/store")] if rel.endswith("/store") else rel


def format_result(r: Dict[str, Any], repo: str, col: int = 22, width: int = 100) -> List[str]:
    runs = r["runs"]
    secs = "/".join(f"{s['seconds']:.1f}" for s in runs.values())
    head = f"{label(r['store'], repo):<{col}} {r['command']:<19} {r['status']}"
    if r["status"] == "DIFFERENT":
        head += f": {r['only_ref']} only in ref, {r['only_new']} only in new (of {r['ref_items']}/{r['new_items']})"
    lines = [f"{head}  [{secs} s]"]
    lines += [("    " + s)[:width] for s in r.get("shown", []) if r["status"] == "DIFFERENT"]
    lines += [f"    {name}: rc {s['rc']}: {s['error']}"[:width] for name, s in runs.items() if s.get("error")]
    return lines


def default_ref(repo: str) -> str:
    has = subprocess.run(["git", "-C", repo, "rev-parse", "--verify", "-q", "origin/main"], capture_output=True)
    return "origin/main" if has.returncode == 0 else "HEAD"


def main(argv: Optional[List[str]] = None) -> int:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(
        prog="compare_outputs.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  .venv/bin/python bench/compare_outputs.py --ref HEAD          the working tree against HEAD\n"
               "  .venv/bin/python bench/compare_outputs.py --store /tmp/faults  also every store under it\n"
               "  .venv/bin/python bench/compare_outputs.py --command 'diagnose --json' --json")
    ap.add_argument("--ref", help="git revision to compare against (default origin/main, else HEAD)")
    ap.add_argument("--new", default=repo, help="root of the version under test (default: this checkout)")
    ap.add_argument("--store", action="append", default=[], metavar="DIR",
                    help="also the stores at or under DIR (repeatable); tests/data's are always in")
    ap.add_argument("--command", action="append", choices=sorted(COMMANDS), help="only these (repeatable)")
    ap.add_argument("--shown", type=int, default=SHOWN, help=f"differing items shown each (default {SHOWN})")
    ap.add_argument("--timeout", type=float, default=COMMAND_TIMEOUT_S, help="seconds per command run")
    ap.add_argument("--no-build-ext", action="store_true", help="do not build the ref's C accelerator")
    ap.add_argument("--keep", metavar="DIR", help="write outputs under DIR and keep them (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = ap.parse_args(argv)

    t0 = time.monotonic()
    ref_rev = args.ref or default_ref(repo)
    stores = find_stores(os.path.join(args.new, "tests", "data"))
    for top in args.store:
        found = find_stores(top)
        if not found:
            raise SystemExit(f"compare_outputs: no ccld store (store.json) at or under {top}")
        stores += [s for s in found if s not in stores]
    commands = args.command or list(COMMANDS)
    work = args.keep or tempfile.mkdtemp(prefix="ccld-compare-")
    os.makedirs(work, exist_ok=True)
    ref_root = tempfile.mkdtemp(prefix="ccld-ref-")
    try:
        sha = materialise(repo, ref_rev, ref_root, build_ext=not args.no_build_ext)
        versions = [Version("ref", ref_root, f"{ref_rev} = {sha}, extracted to {ref_root}"),
                    Version("new", args.new, f"{os.path.abspath(args.new)} (working tree)")]
        say = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else _say
        for v in versions:
            v.check(work)
            accel = glob.glob(os.path.join(v.root, "ccld", "export", "_hotpath*.so"))
            v.what += f"; C accelerator {'built' if accel else 'absent'}"
            say(f"{v.name}: {v.what}")
        say(f"{len(stores)} stores x {len(commands)} commands; each line: store, command, verdict "
            f"[ref/new seconds]")
        results = []
        col = min(40, max([len(label(s, args.new)) for s in stores] + [5]))
        for store in stores:
            for c in commands:
                r = compare_one(c, store, versions, work, args.timeout, args.shown)
                results.append(r)
                say("\n".join(format_result(r, args.new, col)))
    finally:
        shutil.rmtree(ref_root, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    bad = [r for r in results if r["status"] != "same" and r["status"] != "both failed"]
    both = sum(r["status"] == "both failed" for r in results)
    took = time.monotonic() - t0
    if args.json:
        print(json.dumps({"ref": versions[0].what, "new": versions[1].what, "stores": stores,
                          "commands": commands, "ignored_finding_fields": list(IGNORED_FINDING_FIELDS),
                          "float_decimals": FLOAT_DECIMALS, "results": results, "different": len(bad),
                          "both_failed": both, "seconds": round(took, 1)}, indent=1))
    else:
        print(f"{len(results) - len(bad) - both} same, {len(bad)} DIFFERENT or failing in one version only, "
              f"{both} failing in both alike; {took:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
