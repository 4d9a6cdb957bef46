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
 *                 -> GLOO_WORK_START {work}; opens this thread's size window for the work
 *   buf_new     gloo::Context::createUnboundBuffer(void* ptr, size_t nbytes) (returns unique_ptr by
 *                 value: PARM1 = return slot, PARM2 = this, PARM3 = ptr, PARM4 = nbytes); in an open
 *                 window: min/total bytes and count of the buffers c10d hands gloo (no record)
 *   algo_enter  gloo::allreduce/broadcast/allgather(v)/gather/scatter/reduce/alltoall(v)/barrier:
 *                 c10d is done building the buffers -> GLOO_WORK_SIZE {work, min, total, n}, window
 *                 closed (buffers the algorithm allocates itself, e.g. the ring's scratch, are not
 *                 the user's tensor and are not counted)
 *   work_done / work_fail   AsyncWork::finishWorkGloo() / finishWorkGlooError(exception_ptr const&)
 *                 -> GLOO_WORK_END {work, ok}
 *   pair_new    gloo::transport::tcp::Pair::Pair(Context*, Device*, int rank, ms, bool): the connection
 *                 to group rank `rank` of one gloo context (at init_process_group) -> pair_peer map
 *   pair_fail   Pair::signalException(const std::string& msg): gloo's I/O thread found the connection
 *                 broken (EOF, reset, write error) -> GLOO_PAIR_FAIL {pair, peer, msg}. This is what
 *                 tells a rank that died inside a collective from the ranks that lost it: every rank
 *                 whose collective then fails names the same peer.
 *
 * Why no uretprobes: a uretprobe on a frame a C++ exception unwinds through turns the job's normal
 * error (a gloo timeout) into SIGABRT. Entry probes on the finish functions give completion safely.
 * `seq` is c10d's per-process-group sequence number: identical on every rank for one collective, so
 * (communicator, seq) joins ranks without any counting here, even when we attach mid-run.
 *
 * Why sizes come from createUnboundBuffer: it is the one exported function on a collective's path
 * whose arguments carry its size (c10d's typed setInput/setOutput templates are inlined into the
 * work's run(), and reading at::Tensor's numel would need TensorImpl offsets that move between torch
 * versions). The smallest buffer c10d builds for a work is the per-rank tensor's bytes for every op
 * whose ranks must agree on it (allreduce: the tensor; allgather/gather/scatter: input n, output
 * world*n), so ranks can be compared at one (communicator, seq). It arrives on the worker thread,
 * after GLOO_WORK_INIT: the translator holds the enter until it comes (gloo.py, HOLD_MS).
 *
 * Maps: events (ringbuf, records), lost (per-CPU loss counter), api_inflight (LRU tid -> last API
 * entry, so dead threads leak nothing), exec_inflight (LRU worker tid -> the work it runs and the
 * buffer sizes so far). One record per collective per phase, never per chunk.
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
#ifndef CCLD_ERR_LEN
#define CCLD_ERR_LEN 160  /* gloo's messages: "[<source path>:<line>] Read error [addr]:port: <strerror>..." */
#endif
#ifndef CCLD_MAX_PAIRS
#define CCLD_MAX_PAIRS 65536  /* connections of traced processes: world - 1 per gloo context */
#endif

enum gloo_kind {
    GLOO_PG_INIT = 1,
    GLOO_WORK_INIT = 2,
    GLOO_WORK_START = 3,
    GLOO_WORK_END = 4,
    GLOO_P2P = 5,
    GLOO_WORK_SIZE = 6,
    GLOO_PAIR_FAIL = 7,
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

struct gloo_work_size {
    struct ccld_hdr hdr;
    u64 work;
    u64 min_bytes;    /* smallest buffer c10d handed gloo for the work: the per-rank tensor's bytes */
    u64 total_bytes;  /* all of them together */
    u32 nbufs;        /* 0: the op takes no tensor (barrier) */
    u32 pad;
};
_Static_assert(sizeof(struct gloo_work_size) == 56, "gloo_work_size");

struct gloo_pair_fail {
    struct ccld_hdr hdr;
    u64 pair;
    s32 peer;   /* group rank at the far end (from the Pair's constructor); -1 when it was not seen */
    u32 pad;
    char msg[CCLD_ERR_LEN];
};
_Static_assert(sizeof(struct gloo_pair_fail) == 40 + CCLD_ERR_LEN, "gloo_pair_fail");

struct exec_state {
    u64 work;
    u64 min_bytes;
    u64 total_bytes;
    u32 nbufs;
    u32 pad;
};

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
/* Only threads of traced processes get an entry (work_exec checks), so buf_new and algo_enter need
 * no `traced` lookup: one lookup here is all an untraced process's buffer costs. */
BPF_TABLE("lru_hash", u32, struct exec_state, exec_inflight, CCLD_MAX_THREADS);
BPF_TABLE("lru_hash", u64, s32, pair_peer, CCLD_MAX_PAIRS);  /* Pair* -> group rank of its far end */

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

/* The caller has checked that the process is traced. */
static __always_inline int emit_work_traced(u16 kind, u64 work, s32 ok)
{
    struct gloo_work_ev *r = events.ringbuf_reserve(sizeof(*r));
    CCLD_FILL_OR_LOST(r, kind);
    r->work = work;
    r->ok = ok;
    r->pad = 0;
    events.ringbuf_submit(r, CCLD_SUBMIT_FLAGS);
    return 0;
}

static __always_inline int emit_work(u16 kind, u64 work, s32 ok)
{
    if (ccld_untraced())
        return 0;
    return emit_work_traced(kind, work, ok);
}

/* static execute(const intrusive_ptr<AsyncWork>& work): the intrusive_ptr's first word is the pointer. */
int work_exec(struct pt_regs *ctx)
{
    if (ccld_untraced())
        return 0;
    u64 work = 0;
    bpf_probe_read_user(&work, sizeof(work), (void *)PT_REGS_PARM1(ctx));
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct exec_state st = {};
    st.work = work;
    st.min_bytes = ~0ULL;
    exec_inflight.update(&tid, &st);
    return emit_work_traced(GLOO_WORK_START, work, 1);
}

/* finish runs on the worker thread that ran the work: close a window no algorithm entry closed
 * (an op gloo implements without one of the probed entry points). */
static __always_inline int work_finish(struct pt_regs *ctx, s32 ok)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    exec_inflight.delete(&tid);
    return emit_work(GLOO_WORK_END, PT_REGS_PARM1(ctx), ok);
}

int work_done(struct pt_regs *ctx) { return work_finish(ctx, 1); }
int work_fail(struct pt_regs *ctx) { return work_finish(ctx, 0); }

/* unique_ptr<UnboundBuffer> gloo::Context::createUnboundBuffer(void* ptr, size_t size):
 * (return slot, this, ptr, size). Also called on the Python thread for send/recv (no window there). */
int buf_new(struct pt_regs *ctx)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct exec_state *st = exec_inflight.lookup(&tid);
    if (!st)
        return 0;
    u64 n = PT_REGS_PARM4(ctx);
    st->nbufs++;
    st->total_bytes += n;
    if (n < st->min_bytes)
        st->min_bytes = n;
    return 0;
}

int algo_enter(struct pt_regs *ctx)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct exec_state *st = exec_inflight.lookup(&tid);
    if (!st)
        return 0;  /* not a traced work's first algorithm call (nested, or another caller) */
    struct exec_state got = *st;
    exec_inflight.delete(&tid);
    struct gloo_work_size *r = events.ringbuf_reserve(sizeof(*r));
    CCLD_FILL_OR_LOST(r, GLOO_WORK_SIZE);
    r->work = got.work;
    r->nbufs = got.nbufs;
    r->min_bytes = got.nbufs ? got.min_bytes : 0;
    r->total_bytes = got.total_bytes;
    r->pad = 0;
    events.ringbuf_submit(r, CCLD_SUBMIT_FLAGS);
    return 0;
}

/* Pair(this, Context*, Device*, int rank, milliseconds timeout, bool): built once per peer at init. */
int pair_new(struct pt_regs *ctx)
{
    if (ccld_untraced())
        return 0;
    u64 pair = PT_REGS_PARM1(ctx);
    s32 peer = (s32)PT_REGS_PARM4(ctx);
    pair_peer.update(&pair, &peer);
    return 0;
}

/* signalException(this, const std::string& msg): libstdc++'s string starts with its data pointer. */
int pair_fail(struct pt_regs *ctx)
{
    if (ccld_untraced())
        return 0;
    u64 pair = PT_REGS_PARM1(ctx);
    struct gloo_pair_fail *r = events.ringbuf_reserve(sizeof(*r));
    CCLD_FILL_OR_LOST(r, GLOO_PAIR_FAIL);
    r->pair = pair;
    s32 *peer = pair_peer.lookup(&pair);
    r->peer = peer ? *peer : -1;
    r->pad = 0;
    u64 data = 0;
    bpf_probe_read_user(&data, sizeof(data), (void *)PT_REGS_PARM2(ctx));
    r->msg[0] = 0;
    if (data)
        bpf_probe_read_user_str(r->msg, sizeof(r->msg), (void *)data);
    events.ringbuf_submit(r, CCLD_SUBMIT_FLAGS);
    return 0;
}
