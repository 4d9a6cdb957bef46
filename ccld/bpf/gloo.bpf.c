/* gloo.bpf.c: collectives of PyTorch's gloo backend (c10d::ProcessGroupGloo in libtorch_cpu.so).
 *
 * Attach points (all entry-only uprobes, by PID; see ccld/bpf/gloo.py for the mangled symbols):
 *   pg_init     ProcessGroupGloo::ProcessGroupGloo(store&, int rank, int size, options)
 *                 -> GLOO_PG_INIT {pg, rank, size}
 *   api_enter   every ProcessGroupGloo collective API (allreduce, broadcast, barrier, ...),
 *                 Python thread -> remembers {pg, ts} for this thread (no record)
 *   p2p_send/p2p_recv/p2p_recvany  ProcessGroupGloo::send/recv(tensors, int peer, int tag)
 *                 -> GLOO_P2P {pg, op, peer, tag}
 *   work_init   AsyncWork::AsyncWork(context, outputs, OpType op, u64 seq, ms timeout, const char* title, ...)
 *                 -> GLOO_WORK_INIT {pg, work, seq, op, title, enter_ns}: "rank entered collective seq"
 *   work_exec   AsyncWork::execute(const intrusive_ptr<AsyncWork>&), worker thread
 *                 -> GLOO_WORK_START {work}
 *   work_done / work_fail   AsyncWork::finishWorkGloo() / finishWorkGlooError(exception_ptr const&)
 *                 -> GLOO_WORK_END {work, ok}
 *
 * Why no uretprobes: a uretprobe on a frame a C++ exception unwinds through turns the job's normal
 * error (a gloo timeout) into SIGABRT. Entry probes on the finish functions give completion safely.
 * `seq` is c10d's per-process-group sequence number: identical on every rank for one collective, so
 * (communicator, seq) joins ranks without any counting here, even when we attach mid-run.
 *
 * Maps: events (ringbuf, records), lost (per-CPU loss counter), api_inflight (LRU tid -> last API
 * entry, so dead threads leak nothing). One record per collective per phase, never per chunk.
 * Minimum kernel: 5.8 (ring buffer); uprobes.
 */
#include <uapi/linux/ptrace.h>
#include "common.h"

#ifndef CCLD_TITLE_LEN
#define CCLD_TITLE_LEN 32
#endif
#ifndef CCLD_MAX_THREADS
#define CCLD_MAX_THREADS 16384
#endif

enum gloo_kind {
    GLOO_PG_INIT = 1,
    GLOO_WORK_INIT = 2,
    GLOO_WORK_START = 3,
    GLOO_WORK_END = 4,
    GLOO_P2P = 5,
};

struct gloo_pg_init {
    struct ccld_hdr hdr;
    u64 pg;
    s32 rank;
    s32 size;
};
_Static_assert(sizeof(struct gloo_pg_init) == 40, "gloo_pg_init");

struct gloo_work_init {
    struct ccld_hdr hdr;
    u64 pg;        /* 0 when the API entry on this thread was not seen */
    u64 work;
    u64 seq;
    u64 enter_ns;  /* when the Python thread entered the API (== hdr.ts_ns when unknown) */
    u64 timeout_ms;
    s32 op;        /* c10d::OpType */
    u32 pad;
    char title[CCLD_TITLE_LEN];
};
_Static_assert(sizeof(struct gloo_work_init) == 24 + 48 + CCLD_TITLE_LEN, "gloo_work_init");

struct gloo_work_ev {
    struct ccld_hdr hdr;
    u64 work;
    s32 ok;
    u32 pad;
};
_Static_assert(sizeof(struct gloo_work_ev) == 40, "gloo_work_ev");

struct gloo_p2p {
    struct ccld_hdr hdr;
    u64 pg;
    s32 op;   /* 12 send, 13 recv, 14 recv-any-source (c10d::OpType) */
    s32 peer;
    s32 tag;
    u32 pad;
};
_Static_assert(sizeof(struct gloo_p2p) == 48, "gloo_p2p");

struct api_entry {
    u64 pg;
    u64 ts_ns;
    u32 used;  /* the first work built after the entry gets its timestamp; later ones get their own */
    u32 pad;
};

BPF_RINGBUF_OUTPUT(events, CCLD_RINGBUF_PAGES);
BPF_PERCPU_ARRAY(lost, u64, 1);  /* records the ring buffer had no room for; slot 0 */

#ifndef CCLD_MAX_PROCS
#define CCLD_MAX_PROCS 4096
#endif
/* The probes are attached once per library, for every process that maps it (pid -1), so adding a
 * rank costs one map update instead of an attach, and removing one costs no uprobe unregister
 * (~110 ms each). Processes not in this set return at the first instruction. */
BPF_HASH(traced, u32, u8, CCLD_MAX_PROCS);

static __always_inline int ccld_untraced(void)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    return traced.lookup(&tgid) == NULL;
}
BPF_TABLE("lru_hash", u32, struct api_entry, api_inflight, CCLD_MAX_THREADS);

static __always_inline void ccld_count_lost(void)
{
    int zero = 0;
    u64 *n = lost.lookup(&zero);
    if (n)
        (*n)++;
}

int pg_init(struct pt_regs *ctx)
{
    if (ccld_untraced())
        return 0;
    struct gloo_pg_init *r = events.ringbuf_reserve(sizeof(*r));
    CCLD_FILL_OR_LOST(r, GLOO_PG_INIT);
    r->pg = PT_REGS_PARM1(ctx);
    r->rank = (s32)PT_REGS_PARM3(ctx);
    r->size = (s32)PT_REGS_PARM4(ctx);
    events.ringbuf_submit(r, CCLD_SUBMIT_FLAGS);
    return 0;
}

int api_enter(struct pt_regs *ctx)
{
    if (ccld_untraced())
        return 0;
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct api_entry e = {};
    e.pg = PT_REGS_PARM2(ctx);  /* PARM1 is the hidden return slot of intrusive_ptr<Work> */
    e.ts_ns = bpf_ktime_get_ns();
    api_inflight.update(&tid, &e);
    return 0;
}

static __always_inline int emit_p2p(struct pt_regs *ctx, s32 op, s32 peer, s32 tag)
{
    if (ccld_untraced())
        return 0;
    struct gloo_p2p *r = events.ringbuf_reserve(sizeof(*r));
    CCLD_FILL_OR_LOST(r, GLOO_P2P);
    r->pg = PT_REGS_PARM2(ctx);
    r->op = op;
    r->peer = peer;
    r->tag = tag;
    r->pad = 0;
    events.ringbuf_submit(r, CCLD_SUBMIT_FLAGS);
    return 0;
}

/* The API returns c10::intrusive_ptr<Work> by value, a class with a non-trivial destructor, so the
 * Itanium ABI passes a hidden return slot first: PARM1 = return slot, PARM2 = this, then the arguments.
 * send/recv(ret, this, std::vector<at::Tensor>&, int peer, int tag) */
int p2p_send(struct pt_regs *ctx) { return emit_p2p(ctx, 12, (s32)PT_REGS_PARM4(ctx), (s32)PT_REGS_PARM5(ctx)); }
int p2p_recv(struct pt_regs *ctx) { return emit_p2p(ctx, 13, (s32)PT_REGS_PARM4(ctx), (s32)PT_REGS_PARM5(ctx)); }
/* recvAnysource(ret, this, std::vector<at::Tensor>&, int tag) */
int p2p_recvany(struct pt_regs *ctx) { return emit_p2p(ctx, 14, -1, (s32)PT_REGS_PARM4(ctx)); }

/* AsyncWork(this, shared_ptr<Context> (by invisible ref), vector<vector<Tensor>> (by invisible ref),
 *           OpType op, u64 seq, ms timeout, const char* title [stack], const optional<...>& [stack]) */
int work_init(struct pt_regs *ctx)
{
    if (ccld_untraced())
        return 0;
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct gloo_work_init *r = events.ringbuf_reserve(sizeof(*r));
    CCLD_FILL_OR_LOST(r, GLOO_WORK_INIT);
    r->work = PT_REGS_PARM1(ctx);
    r->op = (s32)(PT_REGS_PARM4(ctx) & 0xff);  /* OpType is a uint8_t enum: only the low byte is set */
    r->seq = PT_REGS_PARM5(ctx);
    r->timeout_ms = PT_REGS_PARM6(ctx);
    r->pad = 0;
    r->pg = 0;
    r->enter_ns = r->hdr.ts_ns;
    struct api_entry *e = api_inflight.lookup(&tid);
    if (e) {
        r->pg = e->pg;
        if (!e->used) {
            r->enter_ns = e->ts_ns;
            e->used = 1;
        }
    }
    /* 7th argument: first stack slot above the return address. */
    u64 title = 0;
    bpf_probe_read_user(&title, sizeof(title), (void *)(PT_REGS_SP(ctx) + 8));
    r->title[0] = 0;
    if (title)
        bpf_probe_read_user_str(r->title, sizeof(r->title), (void *)title);
    events.ringbuf_submit(r, CCLD_SUBMIT_FLAGS);
    return 0;
}

static __always_inline int emit_work(u16 kind, u64 work, s32 ok)
{
    if (ccld_untraced())
        return 0;
    struct gloo_work_ev *r = events.ringbuf_reserve(sizeof(*r));
    CCLD_FILL_OR_LOST(r, kind);
    r->work = work;
    r->ok = ok;
    r->pad = 0;
    events.ringbuf_submit(r, CCLD_SUBMIT_FLAGS);
    return 0;
}

/* static execute(const intrusive_ptr<AsyncWork>& work): the intrusive_ptr's first word is the pointer. */
int work_exec(struct pt_regs *ctx)
{
    u64 work = 0;
    bpf_probe_read_user(&work, sizeof(work), (void *)PT_REGS_PARM1(ctx));
    return emit_work(GLOO_WORK_START, work, 1);
}

int work_done(struct pt_regs *ctx) { return emit_work(GLOO_WORK_END, PT_REGS_PARM1(ctx), 1); }
int work_fail(struct pt_regs *ctx) { return emit_work(GLOO_WORK_END, PT_REGS_PARM1(ctx), 0); }
