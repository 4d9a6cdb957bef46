"""Single-node scenarios of the parallelism shapes beyond DDP: a 4-stage pipeline (pipeline_job.py:
GPipe with blocking p2p on the default group, 1F1B with batched p2p on its own group), an FSDP-style
loop (fsdp_job.py, 4 ranks), a 2 (tensor) x 2 (pipeline) x 2 (data) job (hybrid_job.py, 8 ranks),
and an elastic restart (torchrun --nnodes 1:2, a second launcher joining). One fault each, under
`ccld run`, with the exact answer (see scenarios.py for the strict rules).

The I/O faults read a StuckFuse file (tests/fusebed.py: the read never completes, the rank is in D
until the harness closes the mount at cleanup). A fault of one rank comes on time (the job's
--fault-file, fault_scenarios.open_at): hangs 20 s after the first progress line, slowdowns 60 s;
the batch change and the data loader's stall at a step from fault_scenarios.step_at (the rates
measured here). Budget on 2 vCPUs: 4-rank jobs start in ~10-15 s, 8-rank ones in ~20 s;
hang scenarios take ~40-50 s, slowdowns ~90-110 s, the elastic restart ~80 s.

Elastic restart recipe (torch 2.13): both launchers use the c10d rendezvous on one endpoint
(`--nnodes 1:2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:P --rdzv-id ID --max-restarts 3
--rdzv-conf last_call_timeout=1`), the second started ELASTIC_JOIN_S after the first, and
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1. Without that variable the restart deadlocks in torch 2.13:
the first launcher keeps the bootstrap store info of round 0 and never writes MASTER_ADDR for
round 1, which the joining launcher waits for ("wait timeout after 60000ms, keys:
/torch.rendezvous.ID.1/MASTER_ADDR", while the first waits for the role_info keys).
"""
from __future__ import annotations

import os
import re
import signal
import sys
import time
from typing import Dict

import fault_scenarios as fsc
from fault_scenarios import (HANG_BASELINE_S, SLOW_BASELINE_S, START_TIMEOUT_S, Job, Result, Session, begin_slowdown,
                             fault_file, healthy_run, open_at, pin_with_hog, step_at, stop_hog)
from scenarios import HANG_DEADLINE_S, SLOW_DEADLINE_S, Scenario, register, register_job

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: fusebed

RUN = ["--steps", 1000000, "--progress-every", 10]  # the first progress line, where a baseline is counted from
                          # (Job.started_at), within ~1 s of the first step (every 50: 2.5-5 s at 10-20 steps/s)
ONE_F_ONE_B = ["--schedule", "1f1b", "--p2p", "batch", "--pp-group", "own"]
SLOW_MS = 40              # extra compute per step of the slowed rank: about one step's time on these jobs
BATCH_FACTOR = 2.0        # --batch-change: compute and activations double
CKPT_AFTER_S = 15.0       # the pipeline checkpoint begins after this much running
OWN_HISTORY_S = 40.0      # own-work comp-slow compares a rank with its last ~40 s: the hog comes that long after
ELASTIC_JOIN_S = 28.0     # the second launcher joins this long after the first starts (its group has run ~20 s)
ELASTIC_RUN_S = 35        # each round of the elastic job runs this long (--seconds)
ELASTIC_TIMEOUT_S = 240.0


def stuck_file(s: Session) -> str:
    """A StuckFuse mount in the session's directory, closed at cleanup (the reader then fails, EIO)."""
    import fusebed
    stuck = fusebed.StuckFuse(os.path.join(s.tmp, "mnt"))
    s.closers.append(stuck.close)
    return stuck.path


def hang_at_step(s: Session, name: str, script: str, nproc: int, args, onset_rx: str, cls: str, culprits,
                 title: str, **notes) -> Result:
    """A fault the workload injects at a step (its line gives the onset): wait for `cls`."""
    j = s.job(name, script, nproc, *RUN, *args)
    onset = j.onset(onset_rx, START_TIMEOUT_S + HANG_BASELINE_S * 2)
    return _found(j, onset, cls, culprits, title, **notes)


def hang_after_baseline(s: Session, name: str, script: str, nproc: int, args, onset_rx: str, cls: str, culprits,
                        title: str, **notes) -> Result:
    """A one-rank fault placed at step 0 (`args`), held by the job's --fault-file until HANG_BASELINE_S
    after the first progress line: wait for `cls`."""
    go = fault_file(s, name)
    j = s.job(name, script, nproc, *RUN, *args, "--fault-file", go)
    open_at(j, go, j.started_at() + HANG_BASELINE_S)
    return _found(j, j.onset(onset_rx, 60), cls, culprits, title, **notes)


def _found(j: Job, onset: float, cls: str, culprits, title: str, **notes) -> Result:
    j.expect(cls, onset, HANG_DEADLINE_S)
    j.stop()
    return j.result(title, cls, culprits, onset, **notes)


def slow_after_baseline(s: Session, name: str, script: str, nproc: int, rank: int, title: str, args=()) -> Result:
    """Rank `rank` computes SLOW_MS more per step from SLOW_BASELINE_S in: comp-slow, that rank."""
    go = fault_file(s, name)
    j = s.job(name, script, nproc, *RUN, *args, "--slow-rank", rank, "--slow-ms", SLOW_MS, "--fault-file", go)
    onset = begin_slowdown(j, go, rank)
    j.expect("comp-slow", onset, SLOW_DEADLINE_S)
    j.stop()
    return j.result(title, "comp-slow", [rank], onset)


# ---- pipeline ------------------------------------------------------------------------------------

def pp_batch_change_then_never_sends(s: Session, rank: int = 2) -> Dict[str, Result]:
    """GPipe, blocking p2p on the default group: the batch size doubles after ~20 s (every step
    slower: healthy; every rank at one step), then, 20 s later, stage `rank` never sends: not-entered,
    that stage."""
    change = step_at(HANG_BASELINE_S, "gpipe")
    go = fault_file(s, "pp-batch-hang")
    j = s.job("pp-batch-hang", "pipeline_job.py", 4, *RUN, "--batch-change-step", change,
              "--batch-factor", BATCH_FACTOR, "--hang-rank", rank, "--hang-step", change, "--fault-file", go)
    t_change = j.onset(rf"^rank 0: batch x {BATCH_FACTOR:g} from step", START_TIMEOUT_S + HANG_BASELINE_S * 2)
    open_at(j, go, t_change + HANG_BASELINE_S)
    onset = j.onset(rf"^rank {rank}: hanging at step", 60)
    j.expect("not-entered", onset, HANG_DEADLINE_S)
    j.stop()
    return {"pp-batch-change": j.result("batch size doubles (pipeline)", None, [], until=onset, change=t_change,
                                        after_change_s=onset - t_change),
            "pp-gpipe-never-sends": j.result("a stage never sends (GPipe, default group)", "not-entered", [rank],
                                             onset, since=onset)}


def pp_slow_then_kill(s: Session, rank: int = 2, killed: int = 1) -> Dict[str, Result]:
    """Stage `rank` computes SLOW_MS more per step (after 60 s): comp-slow, that stage; then (once
    found, or its deadline passed) stage `killed` is SIGKILLed: fault, exactly that stage."""
    go = fault_file(s, "pp-slow-kill")
    j = s.job("pp-slow-kill", "pipeline_job.py", 4, *RUN, "--slow-rank", rank, "--slow-ms", SLOW_MS, "--fault-file", go)
    onset = begin_slowdown(j, go, rank)
    j.expect("comp-slow", onset, SLOW_DEADLINE_S)
    os.kill(s.rank_pid(killed), signal.SIGKILL)
    t_kill = time.time()
    j.expect("fault", t_kill, HANG_DEADLINE_S)
    j.stop()
    return {"pp-slow": j.result("a stage computes more (pipeline)", "comp-slow", [rank], onset, until=t_kill),
            "pp-killed": j.result("a stage SIGKILLed (pipeline)", "fault", [killed], t_kill, since=t_kill)}


def pp_checkpoint_then_hog(s: Session, rank: int = 1) -> Dict[str, Result]:
    """Stage 0 writes checkpoints for 20 s after ~15 s (its neighbours wait in recv: healthy), then,
    with >= 60 s of running and >= 40 s after the checkpoint (own-work history), a CPU hog on stage
    `rank`'s core (the work per step fixed): comp-slow, that stage."""
    go = fault_file(s, "pp-ckpt-hog")
    j = s.job("pp-ckpt-hog", "pipeline_job.py", 4, *RUN, "--compute-work", "--ckpt-rank", 0, "--ckpt-step", 0,
              "--ckpt-s", 20, "--fault-file", go)
    started = j.started_at()
    open_at(j, go, started + CKPT_AFTER_S)
    t_ckpt = j.onset(r"^rank 0: checkpointing for", 60)
    t_done = j.onset(r"^rank 0: checkpoint done", 60)
    j.run_until(max(started + SLOW_BASELINE_S, t_done + OWN_HISTORY_S))
    hog = pin_with_hog(s, rank, 4)
    onset = time.time()
    try:
        j.expect("comp-slow", onset, SLOW_DEADLINE_S)
    finally:
        stop_hog(hog)
    j.stop()
    return {"pp-checkpoint": j.result("stage 0 checkpoints 20 s (pipeline)", None, [], until=onset,
                                      pause=(t_ckpt, t_done)),
            "pp-cpu-hog": j.result("a CPU hog on a stage's core (pipeline)", "comp-slow", [rank], onset, since=onset)}


def pp_1f1b_never_sends(s: Session, rank: int = 1) -> Result:
    return hang_after_baseline(s, "pp-1f1b-hang", "pipeline_job.py", 4,
                               [*ONE_F_ONE_B, "--hang-rank", rank, "--hang-step", 0],
                               rf"^rank {rank}: hanging at step", "not-entered", [rank],
                               "a stage never sends (1F1B, batched p2p, own group)")


def pp_stuck_io(s: Session, rank: int = 2) -> Result:
    return hang_after_baseline(s, "pp-io", "pipeline_job.py", 4,
                               ["--io-rank", rank, "--io-step", 0, "--io-path", stuck_file(s)],
                               rf"^rank {rank}: reading ", "not-entered", [rank],
                               "a stage stuck in I/O, D state (pipeline)")


def pp_loader_stall(s: Session, rank: int = 1) -> Result:
    # at a step: the loader's worker reads ahead of the rank, so a file would not place it
    return hang_at_step(s, "pp-loader", "pipeline_job.py", 4,
                        ["--loader-rank", rank, "--loader-step", step_at(HANG_BASELINE_S, "gpipe")],
                        rf"^rank {rank}: waiting on a stalled data loader", "not-entered", [rank],
                        "a stage's data loader stalls (pipeline)")


# ---- elastic -------------------------------------------------------------------------------------

def elastic_restart(s: Session) -> Result:
    """A 2-rank group restarted into a 4-rank one when a second launcher joins: healthy."""
    port = fsc.free_port()
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"ccld-{s.tag[:8]}",
                "--max-restarts", "3", "--rdzv-conf", "last_call_timeout=1", "--monitor-interval", "1",
                fsc.GLOO_JOB, "--seconds", str(ELASTIC_RUN_S), "--ops", "allreduce,broadcast", "--step-sleep-ms", "10",
                "--progress-every", "200"]
    line = " ".join(launcher)
    script = f"{line} & first=$!; sleep {ELASTIC_JOIN_S:g}; {line}; rc=$?; wait $first; exit $(( rc | $? ))"
    env = dict(s.env, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    j = Job(s, "elastic", ["bash", "-c", script], env=env)
    try:
        rc = j.p.wait(ELASTIC_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - a stuck restart: stop it and report what there was
        rc = None
    j.stop()
    text = j.text()
    return j.result("elastic restart: 2 ranks, then 4 (a launcher joins)", None, [], rc=rc,
                    restarted=len(re.findall(r"closing signal SIGTERM", text)),
                    done=re.findall(r"^rank (\d+) done: (\d+) steps", text, re.M))


def _register() -> None:
    S = SLOW_DEADLINE_S
    register_job("pp-batch-hang", pp_batch_change_then_never_sends,
                 Scenario("pp-batch-change", "healthy: the batch size doubles mid-run (pipeline)", "pipeline", None, [],
                          kind="healthy"),
                 Scenario("pp-gpipe-never-sends", "not-entered: a stage never sends (GPipe, default group)", "pipeline",
                          "not-entered", [2]))
    register(Scenario("pp-1f1b-never-sends", "not-entered: a stage never sends (1F1B, batched p2p, own group)",
                      "pipeline", "not-entered", [1], run=pp_1f1b_never_sends))
    register(Scenario("pp-io", "not-entered: a stage stuck in I/O, D state (pipeline)", "pipeline", "not-entered", [2],
                      run=pp_stuck_io, needs=("fuse",)))
    register(Scenario("pp-loader", "not-entered: a stage's data loader stalls (pipeline)", "pipeline", "not-entered",
                      [1], run=pp_loader_stall))
    register_job("pp-slow-kill", pp_slow_then_kill,
                 Scenario("pp-slow", f"comp-slow: a stage computes +{SLOW_MS} ms per step (pipeline)", "pipeline",
                          "comp-slow", [2], kind="slow", deadline_s=S),
                 Scenario("pp-killed", "fault: a stage SIGKILLed (pipeline)", "pipeline", "fault", [1]))
    register_job("pp-ckpt-hog", pp_checkpoint_then_hog,
                 Scenario("pp-checkpoint", "healthy: stage 0 checkpoints 20 s (pipeline)", "pipeline", None, [],
                          kind="healthy"),
                 # In CI again since 2026-12-03: it had failed often (nothing within 60 s) because the hogged
                 # stage's blocked share rises with everyone's (it waits for the CPU inside its sends and
                 # receives too), so own work could not point at it; busy.py's cpu-starved rule (its runqueue
                 # share against the others') names it: 3 of 3 runs then (7.8 and 9.9 s live, 11 s replayed).
                 Scenario("pp-cpu-hog", "comp-slow: a CPU hog on a stage's core (pipeline)", "pipeline", "comp-slow",
                          [1], kind="slow", deadline_s=S))
    register(Scenario("fsdp-hang", "not-entered: a rank hangs before its all-gather (FSDP)", "fsdp", "not-entered", [1],
                      run=lambda s: hang_after_baseline(s, "fsdp-hang", "fsdp_job.py", 4,
                                                        ["--hang-rank", 1, "--hang-step", 0],
                                                        r"^rank 1: hanging at step", "not-entered", [1],
                                                        "a rank hangs (FSDP)")))
    register(Scenario("fsdp-wrong-op", "inconsistent: all_reduce instead of an all-gather (FSDP)", "fsdp",
                      "inconsistent", [2],
                      run=lambda s: hang_after_baseline(s, "fsdp-wrongop", "fsdp_job.py", 4,
                                                        ["--wrong-op-rank", 2, "--wrong-op-step", 0],
                                                        r"^rank 2: calling all_reduce instead of", "inconsistent",
                                                        [2], "a wrong op (FSDP)")))
    register(Scenario("fsdp-slow", f"comp-slow: a rank computes +{SLOW_MS} ms per step (FSDP)", "fsdp", "comp-slow",
                      [3], kind="slow", deadline_s=S,
                      run=lambda s: slow_after_baseline(s, "fsdp-slow", "fsdp_job.py", 4, 3, "a slow rank (FSDP)")))
    register(Scenario("hybrid-hang", "not-entered: a rank hangs (tp x pp x dp, 8 ranks)", "hybrid", "not-entered", [5],
                      run=lambda s: hang_after_baseline(s, "hybrid-hang", "hybrid_job.py", 8,
                                                        ["--hang-rank", 5, "--hang-step", 0],
                                                        r"^rank 5: hanging at step", "not-entered", [5],
                                                        "a rank hangs (hybrid)")))
    register(Scenario("hybrid-wrong-op-tp", "inconsistent: a wrong op in one tp group, the others fine (hybrid)",
                      "hybrid", "inconsistent", [2],
                      run=lambda s: hang_after_baseline(s, "hybrid-wrongop", "hybrid_job.py", 8,
                                                        ["--wrong-op-rank", 2, "--wrong-op-group", "tp",
                                                         "--wrong-op-step", 0],
                                                        r"^rank 2: calling all_gather instead of", "inconsistent",
                                                        [2], "a wrong op in one tp group (hybrid)")))
    register(Scenario("hybrid-io", "not-entered: a rank stuck in I/O, D state (hybrid)", "hybrid", "not-entered", [6],
                      needs=("fuse",),
                      run=lambda s: hang_after_baseline(s, "hybrid-io", "hybrid_job.py", 8,
                                                        ["--io-rank", 6, "--io-step", 0, "--io-path", stuck_file(s)],
                                                        r"^rank 6: reading ", "not-entered", [6],
                                                        "a rank stuck in I/O (hybrid)")))
    register(Scenario("hybrid-slow", f"comp-slow: a rank computes +{SLOW_MS} ms per step (hybrid)", "hybrid",
                      "comp-slow", [3], kind="slow", deadline_s=S,
                      run=lambda s: slow_after_baseline(s, "hybrid-slow", "hybrid_job.py", 8, 3,
                                                        "a slow rank (hybrid)")))
    register(Scenario("elastic-restart", "healthy: an elastic restart, 2 ranks then 4 (torchrun c10d rendezvous)",
                      "elastic", None, [], kind="healthy", run=elastic_restart))
    for key, title, script, n, args in (
            ("healthy-pipeline", "GPipe pipeline", "pipeline_job.py", 4, []),
            ("healthy-pipeline-1f1b", "1F1B pipeline, batched p2p", "pipeline_job.py", 4, ONE_F_ONE_B),
            ("healthy-fsdp", "FSDP-style shards", "fsdp_job.py", 4, []),
            ("healthy-fsdp-torch", "torch FSDP2 (fully_shard) on CPU", "fsdp_job.py", 4, ["--torch-fsdp"]),
            ("healthy-hybrid", "tp x pp x dp, 8 ranks", "hybrid_job.py", 8, [])):
        register(Scenario(key, f"healthy: {title}, no fault", key.split("-")[1], None, [], kind="healthy", ci=False,
                          long_run=True,
                          run=(lambda script, n, args, name: lambda s, seconds=120: healthy_run(
                              s, name, script, n, args, seconds))(script, n, args, key[len("healthy-"):])))


_register()
