"""Store benchmark: write throughput with and without fsync, and a corruption sweep's recovery figures.

Writes real agent frames (events.encode_batch) through StoreWriter as fast as one thread can, for a
fixed time per mode, in a temporary directory on the filesystem of --dir; the modes run in one
process, so their ratios are comparable even on a shared machine. Then corrupts a small store many
times (byte flips, runs, truncations, insertions) and counts what read_store recovers.
Units: frames/s, MB/s (10^6 bytes of records, headers included), fsync latency in ms.
Caveat: fsync cost depends on the disk and on what else writes to it; run it on the collector's disk.

    .venv/bin/python bench/store_bench.py                  # print
    .venv/bin/python bench/store_bench.py --write-results  # and update bench/RESULTS.md (store section)
"""
from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ccld import wire as ev  # noqa: E402
from results import write_section  # noqa: E402  (bench/ is on sys.path when run as a script)
from ccld import store as st  # noqa: E402
from ccld.store.layout import RECORD_HEADER, RECORD_MAGIC, STORE_VERSION, segment_name  # noqa: E402
from ccld.store.writer import FLUSH_INTERVAL_S  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def agent_frame(i: int, events: int) -> bytes:
    """A batch like an agent ships: a clock sample and `events` collective enters."""
    evs: List[ev.Event] = [ev.ClockSample(mono_ns=i * 10**6, wall_ns=1_700_000_000 * 10**9 + i, ts_ns=i)]
    evs += [ev.CollEnter(pid=4242 + j % 8, rank=j % 8, ts_ns=i * 10**6 + j, backend="nccl", comm="0x7f00dead",
                         seq=i, op="allreduce", tid=4243, count=1 << 20, dtype="float32", nbytes=4 << 20)
            for j in range(events)]
    return ev.encode_batch("agent-0", "node-0", i, evs)


def write_mode(root: str, frames: List[bytes], seconds: float, **kw) -> Dict:
    d = tempfile.mkdtemp(prefix="store-", dir=root)
    try:
        w = st.StoreWriter(d, **kw)
        n = nbytes = 0
        t0 = time.perf_counter()
        deadline = t0 + seconds
        while True:
            for f in frames:  # check the clock every len(frames) appends, not every one
                w.append(f, 1.0)
            n += len(frames)
            if time.perf_counter() >= deadline:
                break
        w.close()  # included: the last flush + fsync are part of the cost
        dt = time.perf_counter() - t0
        nbytes = w.bytes
        return dict(frames=n, seconds=dt, fps=n / dt, mbps=nbytes / dt / 1e6, fsyncs=w.fsyncs,
                    fsync_max_ms=w.fsync_max_s * 1000, durable=w.durable_records)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def write_paced(root: str, frames: List[bytes], fps: float, seconds: float) -> Dict:
    """The default writer (fsync every FLUSH_INTERVAL_S) at a steady rate: how long each fsync stalls
    the collector's ingest thread, and what share of its time goes to fsync."""
    d = tempfile.mkdtemp(prefix="store-", dir=root)
    try:
        w = st.StoreWriter(d)
        t0 = time.perf_counter()
        n = 0
        while True:
            now = time.perf_counter() - t0
            if now >= seconds:
                break
            due = int(now * fps)
            while n < due:
                w.append(frames[n % len(frames)], 1.0)
                n += 1
            w.maybe_flush()  # what the collector's ingest loop does between bursts
            time.sleep(0.005)
        w.close()
        dt = time.perf_counter() - t0
        return dict(frames=n, fps=n / dt, mbps=w.bytes / dt / 1e6, fsyncs=w.fsyncs,
                    fsync_mean_ms=w.fsync_total_s / max(1, w.fsyncs) * 1000,
                    fsync_max_ms=w.fsync_max_s * 1000, fsync_share=w.fsync_total_s / dt)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def decode_rate(frames: List[bytes], seconds: float = 0.5) -> float:
    """Frames/s that decode_batch alone manages: the collector does at least this per frame."""
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for f in frames:
            ev.decode_batch(f)
        n += len(frames)
    return n / (time.perf_counter() - t0)


def corruption_sweep(root: str, trials: int, seed: int = 8) -> Dict:
    """Corrupt a 40-record segment `trials` times; count records untouched vs recovered."""
    d = tempfile.mkdtemp(prefix="sweep-", dir=root)
    try:
        store = os.path.join(d, "s")
        w = st.StoreWriter(store)
        frames = []
        for i in range(40):
            f = agent_frame(i, i % 5) + b"p" * (i * 7 % 50)
            if i in (9, 27):  # frames that carry the record marker: false resync candidates
                f = b"\x00" + RECORD_MAGIC + b"\x00\x00\x00\x03" + b"\x00" * 32 + f
            frames.append(f)
            w.append(f, 500.0 + i)
        w.close()
        seg = os.path.join(store, segment_name(1))
        raw = open(seg, "rb").read()
        spans, off = [], 0
        for f in frames:
            spans.append((off, off + RECORD_HEADER.size + len(f)))
            off = spans[-1][1]
        rng = random.Random(seed)
        out = dict(trials=trials, by_kind={}, untouched=0, recovered_untouched=0, touched=0,
                   recovered_touched=0, phantom=0, exceptions=0, silent_losses=0, problems=0)
        for _ in range(trials):
            kind, bad, touched = corrupt(rng, raw, spans)
            out["by_kind"][kind] = out["by_kind"].get(kind, 0) + 1
            with open(seg, "wb") as f:
                f.write(bad)
            problems: List[str] = []
            try:
                got = list(st.read_store(store, problems))
            except Exception:
                out["exceptions"] += 1
                continue
            good = {(500.0 + i, f) for i, f in enumerate(frames)}
            gotset = set(got)
            for i, f in enumerate(frames):
                hit = (500.0 + i, f) in gotset
                if i in touched:
                    out["touched"] += 1
                    out["recovered_touched"] += hit
                else:
                    out["untouched"] += 1
                    out["recovered_untouched"] += hit
            out["phantom"] += sum(1 for r in got if r not in good)
            out["problems"] += len(problems)
            if kind != "truncate" and bad != raw and not problems:
                out["silent_losses"] += 1
        return out
    finally:
        shutil.rmtree(d, ignore_errors=True)


def corrupt(rng: random.Random, raw: bytes, spans):
    """One random corruption (byte flips, a run, truncation or inserted junk) of a segment whose
    records occupy `spans`: returns (kind, damaged bytes, indexes of the records it touched).
    Shared with tests/unit/test_store_durability.py."""
    kind = rng.choice(["flip", "flips", "run", "truncate", "insert"])
    b = bytearray(raw)
    touched = set()
    if kind in ("flip", "flips", "run"):
        if kind == "run":
            start = rng.randrange(len(b))
            positions = range(start, min(len(b), start + rng.randint(2, 64)))
        else:
            positions = rng.sample(range(len(b)), 1 if kind == "flip" else rng.randint(2, 4))
        for pos in positions:
            b[pos] ^= rng.randint(1, 255)
            touched |= {i for i, (s, e) in enumerate(spans) if s <= pos < e}
    elif kind == "truncate":
        cut = rng.randrange(len(b))
        del b[cut:]
        touched = {i for i, (s, e) in enumerate(spans) if e > cut}
    else:
        pos = rng.randrange(len(b) + 1)
        b[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 40)))
        touched = {i for i, (s, e) in enumerate(spans) if s < pos < e}
    return kind, bytes(b), touched


def report(args, modes: Dict[str, Dict], paced: Dict[str, Dict], decode: Dict[str, float], sweep: Dict) -> str:
    lines = [f"### Store (format version {STORE_VERSION}): write throughput and corruption recovery", "",
             f"`{args.cmdline}` on {os.cpu_count()} CPUs (shared), store in `{args.dir}`, "
             f"{time.strftime('%Y-%m-%d')}; one writer thread, real agent frames (1 or 40 events).", "",
             f"Flat out (StoreWriter.append in a loop for {args.seconds:g} s, close included; segments rotate "
             f"every 64 MiB and each rotation fsyncs): median of {args.rounds} interleaved runs per mode; "
             "min/max = slowest run / fastest run (the machine is shared: ratios under ~1.5x are noise).", "",
             "| mode | frame B | frames/s | MB/s | vs no fsync | min/max | fsyncs | max fsync ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in modes.items():
        lines.append(f"| {name} | {r['frame_bytes']} | {r['fps']:,.0f} | {r['mbps']:.1f} | "
                     f"{r['fps'] / modes[r['base']]['fps']:.2f} | {r['spread']:.2f} | {r['fsyncs']} | "
                     f"{r['fsync_max_ms']:.1f} |")
    lines += ["", f"Paced, 3 s each (default writer: fsync every {FLUSH_INTERVAL_S} s; maybe_flush every ~5 ms "
              "as the collector's ingest loop does); the fsync time is what the ingest thread stalls:", "",
              "| rate | MB/s | fsyncs | mean fsync ms | max fsync ms | time in fsync |",
              "|---|---:|---:|---:|---:|---:|"]
    for name, r in paced.items():
        lines.append(f"| {name} | {r['mbps']:.2f} | {r['fsyncs']} | {r['fsync_mean_ms']:.2f} | "
                     f"{r['fsync_max_ms']:.2f} | {r['fsync_share']:.2%} |")
    lines += ["", "For scale, `events.decode_batch` alone (the collector decodes every frame before storing it): "
              + ", ".join(f"{k} {v:,.0f} frames/s" for k, v in decode.items()) + ".", ""]
    s = sweep
    lines += [f"Corruption sweep: {s['trials']} corruptions of a 40-record segment "
              f"({', '.join(f'{k} {v}' for k, v in sorted(s['by_kind'].items()))}); "
              f"records not touched by the corruption: {s['recovered_untouched']:,} of {s['untouched']:,} "
              f"recovered; touched: {s['recovered_touched']} of {s['touched']:,} recovered (a damaged frame is "
              f"dropped whole); phantom records {s['phantom']}; exceptions {s['exceptions']}; corruptions "
              f"left unreported {s['silent_losses']} (truncations excluded: one at a record boundary leaves "
              f"nothing to see); {s['problems']:,} problems reported.", ""]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=1.0, help="time per write run")
    p.add_argument("--rounds", type=int, default=3, help="runs per write mode (the median is kept)")
    p.add_argument("--trials", type=int, default=2000, help="corruptions in the sweep")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the temporary stores go")
    p.add_argument("--write-results", action="store_true", help=f"update the store section of {RESULTS}")
    args = p.parse_args()
    args.cmdline = "python bench/store_bench.py " + " ".join(sys.argv[1:])
    logging.disable(logging.WARNING)  # the sweep's problems are counted, not printed
    modes: Dict[str, Dict] = {}
    paced: Dict[str, Dict] = {}
    decode: Dict[str, float] = {}
    for events, label in ((1, "small"), (40, "large")):
        frames = [agent_frame(i, events) for i in range(256)]
        size = sum(map(len, frames)) // len(frames)
        base = f"no fsync, {label}"
        kinds = ((base, dict(fsync=False)),
                 (f"fsync every {FLUSH_INTERVAL_S} s (default), {label}", dict(fsync=True)),
                 (f"fsync every append, {label}", dict(fsync=True, flush_interval_s=0.0)))
        runs: Dict[str, List[Dict]] = {name: [] for name, _ in kinds}
        for _ in range(args.rounds):  # interleaved, so a noisy neighbour hits every mode alike
            for name, kw in kinds:
                runs[name].append(write_mode(args.dir, frames, args.seconds, **kw))
        for name, rs in runs.items():
            r = sorted(rs, key=lambda x: x["fps"])[len(rs) // 2]  # the median run
            r = dict(r, frame_bytes=size, base=base, fsync_max_ms=max(x["fsync_max_ms"] for x in rs),
                     spread=(rs and min(x["fps"] for x in rs) / max(x["fps"] for x in rs)))
            modes[name] = r
            print(f"{name:44s} {size:6d} B  {r['fps']:10,.0f} frames/s  {r['mbps']:7.1f} MB/s  "
                  f"fsyncs {r['fsyncs']:5d}  max fsync {r['fsync_max_ms']:6.1f} ms  "
                  f"min/max {r['spread']:.2f}", flush=True)
        decode[f"{label} ({size} B)"] = decode_rate(frames)
        if label == "large":
            for fps in (200, 2000):
                name = f"{fps:,} frames/s of {size} B"
                paced[name] = r = write_paced(args.dir, frames, fps, 3.0)
                print(f"paced {name}: {r}", flush=True)
    print(f"decode_batch: {decode}")
    t = time.perf_counter()
    sweep = corruption_sweep(args.dir, args.trials)
    print(f"corruption sweep ({time.perf_counter() - t:.1f} s): {sweep}")
    text = report(args, modes, paced, decode, sweep)
    if args.write_results:
        write_section("store", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
