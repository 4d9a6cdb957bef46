/* sched.bpf.c: how long the traced processes' threads waited for a CPU, and how long they were off it.
 *
 * Attach points (tracepoints, stable formats):
 *   sched:sched_switch       a thread leaves the CPU (runnable -> runqueue wait starts; blocked ->
 *                            off-CPU starts) and another comes on (its wait ends)
 *   sched:sched_wakeup / sched:sched_wakeup_new   a blocked thread becomes runnable: off-CPU ends,
 *                            runqueue wait starts
 * The woken thread is not the current one in sched_wakeup, so threads are recognised by tid: a thread
 * of a traced process enters `threads` the first time it is switched out.
 *
 * Maps: traced (tgid set, filled by the agent), threads (LRU tid -> tgid and the start of its current
 * wait, so dead threads leak nothing), stats (tgid -> cumulative runqueue ns, waits, off-CPU ns,
 * switches), runq_max (tgid -> longest wait since the last drain). The agent reads both every interval.
 * This is the evidence that separates "rank slow because its CPU is contended" from "its link is slow".
 * Minimum kernel: 4.x tracepoints; preemption is reported in prev_state as TASK_REPORT_MAX (0x100).
 */
#include <uapi/linux/ptrace.h>

#ifndef CCLD_MAX_PROCS
#define CCLD_MAX_PROCS 4096
#endif
#ifndef CCLD_MAX_THREADS
#define CCLD_MAX_THREADS 65536
#endif

struct thread {
    u32 tgid;
    u32 pad;
    u64 runq_since;  /* runnable but not running since this time; 0 when not waiting */
    u64 off_since;   /* blocked (sleeping, I/O) since this time; 0 when not blocked */
};

struct sched_stats {
    u64 runq_ns;
    u64 runq_waits;
    u64 offcpu_ns;
    u64 switches;
};
_Static_assert(sizeof(struct sched_stats) == 32, "sched_stats is 32 bytes (mirror: sched.py SchedVal)");

BPF_HASH(traced, u32, u8, CCLD_MAX_PROCS);
BPF_TABLE("lru_hash", u32, struct thread, threads, CCLD_MAX_THREADS);
BPF_HASH(stats, u32, struct sched_stats, CCLD_MAX_PROCS);
/* Longest single runqueue wait per tgid since the agent last deleted the entry (it does so every
 * drain). Kept apart from `stats` so that deleting it never races with the atomic adds there. */
BPF_HASH(runq_max, u32, u64, CCLD_MAX_PROCS);

static __always_inline struct sched_stats *stats_of(u32 tgid)
{
    struct sched_stats zero = {};
    stats.lookup_or_try_init(&tgid, &zero);
    return stats.lookup(&tgid);
}

TRACEPOINT_PROBE(sched, sched_switch)
{
    /* This runs on every context switch of the machine, traced or not: the clock is read only once
     * one of the two threads turns out to be ours (0 = not read yet). */
    u64 now = 0;
    /* Outgoing thread: the current task is `prev`. */
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (traced.lookup(&tgid)) {
        now = bpf_ktime_get_ns();
        u32 tid = args->prev_pid;
        struct thread t = {};
        t.tgid = tgid;
        if ((args->prev_state & 0xff) == 0)  /* TASK_RUNNING or preempted: straight back to the queue */
            t.runq_since = now;
        else
            t.off_since = now;
        threads.update(&tid, &t);
        struct sched_stats *s = stats_of(tgid);
        if (s)
            __sync_fetch_and_add(&s->switches, 1);
    }
    /* Incoming thread: its runqueue wait ends. */
    u32 next = args->next_pid;
    struct thread *n = threads.lookup(&next);
    if (!n || !n->runq_since)
        return 0;
    if (!now)
        now = bpf_ktime_get_ns();
    struct sched_stats *s = stats_of(n->tgid);
    if (s && now > n->runq_since) {
        u64 d = now - n->runq_since;
        __sync_fetch_and_add(&s->runq_ns, d);
        __sync_fetch_and_add(&s->runq_waits, 1);
        u32 owner = n->tgid;
        u64 *m = runq_max.lookup(&owner);
        if (!m)
            runq_max.update(&owner, &d);
        else if (d > *m)
            *m = d;  /* racy between CPUs; a lost maximum is only evidence, not a count */
    }
    n->runq_since = 0;
    return 0;
}

static __always_inline int on_wakeup(u32 tid)
{
    struct thread *t = threads.lookup(&tid);
    if (!t || !t->off_since)
        return 0;
    u64 now = bpf_ktime_get_ns();
    struct sched_stats *s = stats_of(t->tgid);
    if (s && now > t->off_since)
        __sync_fetch_and_add(&s->offcpu_ns, now - t->off_since);
    t->off_since = 0;
    t->runq_since = now;
    return 0;
}

TRACEPOINT_PROBE(sched, sched_wakeup)
{
    return on_wakeup(args->pid);
}

TRACEPOINT_PROBE(sched, sched_wakeup_new)
{
    return on_wakeup(args->pid);
}
