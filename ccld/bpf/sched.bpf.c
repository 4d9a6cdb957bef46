/* sched.bpf.c: how long the traced processes' threads waited for a CPU, and how long they were off it.
 *
 * Attach points (tracepoints, stable formats):
 *   sched:sched_switch       a thread leaves the CPU (runnable -> runqueue wait starts; blocked ->
 *                            off-CPU starts) and another comes on (its wait ends)
 *   sched:sched_wakeup / sched:sched_wakeup_new   a blocked thread becomes runnable: off-CPU ends,
 *                            runqueue wait starts
 *   sched:sched_process_exit a traced process's main thread exits: when the process died, to the ns
 *                            (`exited`). The agent's /proc scan sees a death up to a scan later, and
 *                            after a launcher stops the other ranks (torchrun: ~0.1 s after the first
 *                            death) its scan times cannot tell which rank died first; these can.
 *   signal:signal_generate   the first signal that ends a process by default (KILL, TERM, INT, HUP,
 *                            QUIT, ABRT, SEGV, BUS, FPE, ILL) sent to a traced process or one of its
 *                            threads, with its sender's tgid (`signals`): a rank its launcher stopped
 *                            (an elastic restart, a job cancelled) is no fault; one killed from outside,
 *                            or crashed, is.
 * The woken thread is not the current one in sched_wakeup, so threads are recognised by tid: a thread
 * of a traced process enters `threads` the first time it is switched out, and leaves at its last
 * switch, the one after it exited (prev_state EXIT_ZOMBIE or EXIT_DEAD): its tid may be anyone's next.
 *
 * These fire on every context switch and wakeup of the machine, the job's or not, so the first thing
 * each does is a test of one bit in a per-pid bitmap (an array lookup the verifier inlines: a few ns,
 * no helper, no hash): `proc_bits` for the outgoing thread's process, `thread_bits` for the incoming
 * (or woken) thread. Only then a clock read and the per-thread entry. Sums go into per-CPU arrays,
 * one slot per traced process (no atomic adds, no cache line bouncing between CPUs); the agent adds
 * the CPUs up when it drains.
 *
 * Maps: proc_bits / thread_bits (bitmaps over pids, CCLD_PID_WORDS words of 64: pid_max / 64, from
 * the running kernel; set and cleared by the agent, thread bits also here), traced (tgid -> its slot,
 * the agent's), threads (LRU tid -> its process, slot and the start of its current wait), stats
 * (per-CPU, per slot: cumulative runqueue ns, waits, off-CPU ns, switches), runq_max (per-CPU, per
 * slot: longest wait since the agent last reset it, every drain), exited (per slot: when the
 * process's main thread exited, 0 while it lives; the agent zeroes a slot when it gives it out),
 * signals (per slot: the first fatal signal, when and from whom; zeroed alike).
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
#define CCLD_EXITED 0x30  /* prev_state of a task's last switch: EXIT_ZOMBIE (0x20) or EXIT_DEAD (0x10) */

#ifndef CCLD_PID_WORDS
#define CCLD_PID_WORDS 65536  /* 4,194,304 pids (the 64-bit pid_max default) / 64; the loader passes the real one */
#endif

struct thread {
    u32 tgid;
    u32 slot;        /* its process's slot in stats / runq_max */
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

BPF_ARRAY(proc_bits, u64, CCLD_PID_WORDS);
BPF_ARRAY(thread_bits, u64, CCLD_PID_WORDS);
BPF_HASH(traced, u32, u32, CCLD_MAX_PROCS);
BPF_TABLE("lru_hash", u32, struct thread, threads, CCLD_MAX_THREADS);
BPF_PERCPU_ARRAY(stats, struct sched_stats, CCLD_MAX_PROCS);
BPF_PERCPU_ARRAY(runq_max, u64, CCLD_MAX_PROCS);
BPF_ARRAY(exited, u64, CCLD_MAX_PROCS);

struct fatal_signal {
    u64 ts_ns;    /* when it was sent */
    u32 sender;   /* the sending process (tgid of the task that sent it; the faulting one for SEGV) */
    s32 sig;      /* 0: none yet */
};
_Static_assert(sizeof(struct fatal_signal) == 16, "fatal_signal is 16 bytes (mirror: sched.py FatalSignal)");
BPF_ARRAY(signals, struct fatal_signal, CCLD_MAX_PROCS);
/* signals whose default action ends the process: HUP INT QUIT ILL ABRT BUS FPE KILL SEGV TERM */
#define CCLD_FATAL_SIGNALS ((1U << 1) | (1U << 2) | (1U << 3) | (1U << 4) | (1U << 6) | (1U << 7) | \
                            (1U << 8) | (1U << 9) | (1U << 11) | (1U << 15))
#define CCLD_SIGNAL_SENT 0      /* signal_generate's result: TRACE_SIGNAL_DELIVERED ... */
#define CCLD_SIGNAL_PENDING 2   /* ... TRACE_SIGNAL_ALREADY_PENDING (a second KILL while the first acts) */

static __always_inline int proc_on(u32 pid)
{
    u32 w = pid >> 6;
    u64 *bits = proc_bits.lookup(&w);
    return bits && (*bits & (1ULL << (pid & 63)));
}

static __always_inline int thread_on(u32 tid)
{
    u32 w = tid >> 6;
    u64 *bits = thread_bits.lookup(&w);
    return bits && (*bits & (1ULL << (tid & 63)));
}

static __always_inline void thread_mark(u32 tid)
{
    u32 w = tid >> 6;
    u64 *bits = thread_bits.lookup(&w);
    if (bits)
        __sync_fetch_and_or(bits, 1ULL << (tid & 63));  /* once per thread: the rare path */
}

static __always_inline void thread_unmark(u32 tid)
{
    u32 w = tid >> 6;
    u64 *bits = thread_bits.lookup(&w);
    if (bits)
        __sync_fetch_and_and(bits, ~(1ULL << (tid & 63)));
}

TRACEPOINT_PROBE(sched, sched_switch)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u32 next = args->next_pid;
    int out_on = proc_on(tgid), in_on = thread_on(next);
    if (!out_on && !in_on)
        return 0;  /* neither thread is a traced process's: the common case on a busy node */
    u64 now = bpf_ktime_get_ns();
    if (out_on) {  /* the current task is `prev`, leaving the CPU */
        u32 tid = args->prev_pid;
        if (args->prev_state & CCLD_EXITED) {  /* its last switch: forget the thread */
            thread_unmark(tid);
            threads.delete(&tid);
            goto incoming;
        }
        struct thread *t = threads.lookup(&tid);
        if (t == NULL || t->tgid != tgid) {
            u32 *slot = traced.lookup(&tgid);
            if (slot != NULL) {
                struct thread fresh = {.tgid = tgid, .slot = *slot};
                threads.update(&tid, &fresh);
                t = threads.lookup(&tid);
                thread_mark(tid);
            } else {
                t = NULL;  /* a bit left over from a process no longer traced */
            }
        } else if (!thread_on(tid)) {
            thread_mark(tid);  /* its bit lost to the agent's clearing of a neighbour's: set again */
        }
        if (t != NULL) {
            if ((args->prev_state & 0xff) == 0) {  /* TASK_RUNNING or preempted: straight back to the queue */
                t->runq_since = now;
                t->off_since = 0;
            } else {
                t->off_since = now;
                t->runq_since = 0;
            }
            u32 slot = t->slot;
            struct sched_stats *s = stats.lookup(&slot);
            if (s)
                s->switches++;
        }
    }
incoming:
    if (in_on) {  /* `next` comes on: its runqueue wait ends */
        struct thread *n = threads.lookup(&next);
        if (n == NULL || !n->runq_since)
            return 0;
        u32 slot = n->slot;
        if (now > n->runq_since) {
            u64 d = now - n->runq_since;
            struct sched_stats *s = stats.lookup(&slot);
            if (s) {
                s->runq_ns += d;
                s->runq_waits++;
            }
            u64 *m = runq_max.lookup(&slot);
            if (m && d > *m)
                *m = d;
        }
        n->runq_since = 0;
    }
    return 0;
}

static __always_inline int on_wakeup(u32 tid)
{
    if (!thread_on(tid))
        return 0;
    struct thread *t = threads.lookup(&tid);
    if (!t || !t->off_since)
        return 0;
    u64 now = bpf_ktime_get_ns();
    u32 slot = t->slot;
    struct sched_stats *s = stats.lookup(&slot);
    if (s && now > t->off_since)
        s->offcpu_ns += now - t->off_since;
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

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if ((u32)id != tgid || !proc_on(tgid))
        return 0;  /* another thread (a worker ending is no death), or not a traced process */
    u32 *slot = traced.lookup(&tgid);
    if (slot == NULL)
        return 0;
    u64 *at = exited.lookup(slot);
    if (at)
        *at = bpf_ktime_get_ns();
    return 0;
}

TRACEPOINT_PROBE(signal, signal_generate)
{
    int sig = args->sig;
    if (sig <= 0 || sig >= 32 || !((CCLD_FATAL_SIGNALS >> sig) & 1))
        return 0;  /* most signals on a busy node: SIGCHLD, SIGALRM, real-time ones */
    u32 pid = args->pid;  /* the target task: a process's main thread (kill), or a thread (SEGV) */
    u32 slot;
    if (proc_on(pid)) {
        u32 *s = traced.lookup(&pid);
        if (s == NULL)
            return 0;
        slot = *s;
    } else if (thread_on(pid)) {
        struct thread *t = threads.lookup(&pid);
        if (t == NULL)
            return 0;
        slot = t->slot;
    } else {
        return 0;
    }
    if (args->result != CCLD_SIGNAL_SENT && args->result != CCLD_SIGNAL_PENDING)
        return 0;  /* ignored or dropped: it ends nothing */
    struct fatal_signal *f = signals.lookup(&slot);
    if (f == NULL || f->sig != 0)
        return 0;  /* the first one is what ended it */
    f->ts_ns = bpf_ktime_get_ns();
    f->sender = bpf_get_current_pid_tgid() >> 32;
    f->sig = sig;
    return 0;
}
