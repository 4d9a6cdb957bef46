/* probe_cost.bpf.c: the three shapes of work ccld's probes do, each alone, for bench/probe_cost.py.
 *
 *   up_empty   an entry uprobe that returns at once: the price of the trap itself
 *   up_record  the tgid filter, then one 48-byte ring-buffer record without a wakeup (gloo/nccl shape)
 *   up_map     the tgid filter, then an atomic add into a hash entry (net/sched aggregation shape)
 * Attached by the benchmark to a libc function it calls in a tight loop, for its own pid only.
 */
#include <uapi/linux/ptrace.h>

struct rec {
    u64 ts;
    u64 a;
    u64 b;
    u64 c;
    u64 d;
    u64 e;
};

BPF_RINGBUF_OUTPUT(events, 64);
BPF_HASH(traced, u32, u8, 64);
BPF_HASH(counts, u32, u64, 64);

int up_empty(struct pt_regs *ctx)
{
    return 0;
}

int up_record(struct pt_regs *ctx)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!traced.lookup(&tgid))
        return 0;
    struct rec *r = events.ringbuf_reserve(sizeof(*r));
    if (!r)
        return 0;
    r->ts = bpf_ktime_get_ns();
    r->a = PT_REGS_PARM1(ctx);
    events.ringbuf_submit(r, 1 /* BPF_RB_NO_WAKEUP */);
    return 0;
}

int up_map(struct pt_regs *ctx)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!traced.lookup(&tgid))
        return 0;
    u64 zero = 0;
    u64 *v = counts.lookup_or_try_init(&tgid, &zero);
    if (v)
        __sync_fetch_and_add(v, 1);
    return 0;
}
