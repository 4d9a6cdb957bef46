/* gloo.bpf.c: collectives of PyTorch's gloo backend (c10d::ProcessGroupGloo in libtorch_cpu.so).
 *
 * Attach points (all entry-only uprobes, attached per library for every process that maps it; see
 * ccld/bpf/gloo.py for the mangled symbols):
 *   pg_init     ProcessGroupGloo::ProcessGroupGloo(store&, int rank, int size, options)
 *                 -> GLOO_PG_INIT {pg, rank, size}
 *   pg_name     c10d::ProcessGroup::setGroupName(const std::string&), which c10d calls right after it
 *                 built a group's backends -> GLOO_PG_NAME {the ProcessGroup, name}: the group's name
 *                 is the same on every member and differs between groups ("0" for the world, then
 *                 "1", "2", ... in new_group order, or a hash of the ranks), so it is what joins a
 *                 subgroup across ranks; the translator gives it to the process's last gloo backend
 *                 built (this ProcessGroup is the wrapper, not the ProcessGroupGloo the others name)
 *   api_enter   every ProcessGroupGloo collective API (allreduce, broadcast, barrier, ...), Python
 *                 thread -> remembers {pg, ts, c10d's collective counter as it stands} (no record)
 *   work_init   AsyncWork::AsyncWork(context, outputs, OpType op, u64 seq, ms timeout, ...), right
 *                 after the API's nextTag() -> GLOO_WORK_INIT {pg, work, seq, lib_seq, tag, op, enter_ns}:
 *                 "rank entered collective seq"; the work goes into `works` with its (pg, seq)
 *   p2p_send/p2p_recv/p2p_recvany  ProcessGroupGloo::send/recv(tensors, int peer, int tag), recvAnysource:
 *                 remember {pg, op, peer, tag, ts} for this thread (no record)
 *   p2p_work    SendWork::SendWork(tensor&, unique_ptr<UnboundBuffer>, u64 seq) and RecvWork::RecvWork(
 *                 tensor&, unique_ptr<UnboundBuffer>, OpType, u64 seq, const char*), right after the API
 *                 entry on the same thread -> GLOO_P2P {pg, work, seq, enter_ns, nbytes, op, peer, tag};
 *                 the work goes into p2p_works
 *   p2p_wait    SendWork::wait / RecvWork::wait(ms): the thread starts blocking on it (p2p_works.wait_ns)
 *   p2p_done    c10d::Work::finishAndThrow(exception_ptr), which both waits call when the transfer is
 *                 over (or failed) -> GLOO_P2P_END {work, ok, wait_ns} for works in p2p_works only
 *   work_exec   AsyncWork::execute(const intrusive_ptr<AsyncWork>&), worker thread: the work starts
 *                 (its time and (pg, seq) from `works` kept for the thread; no record) and this thread's
 *                 size window for it opens
 *   buf_new     gloo::Context::createUnboundBuffer(void* ptr, size_t nbytes) (returns unique_ptr by
 *                 value: PARM1 = return slot, PARM2 = this, PARM3 = ptr, PARM4 = nbytes); in an open
 *                 window: min/total bytes and count of the buffers c10d hands gloo (no record)
 *   algo_enter  gloo::allreduce/broadcast/allgather(v)/gather/scatter/reduce/alltoall(v)/barrier:
 *                 c10d is done building the buffers -> GLOO_WORK_START {work, pg, seq, start_ns, min,
 *                 total, n}: the start and the size travel together, window closed (buffers the
 *                 algorithm allocates itself, e.g. the ring's scratch, are not the user's tensor)
 *   work_done / work_fail   AsyncWork::finishWorkGloo() / finishWorkGlooError(exception_ptr const&)
 *                 -> GLOO_WORK_END {work, pg, seq, ok, start_ns}: start_ns is the start when no
 *                 algorithm entry closed the window (an op gloo runs without one), 0 when it went
 *   pair_new    gloo::transport::tcp::Pair::Pair(Context*, Device*, int rank, ms, bool): the connection
 *                 to group rank `rank` of one gloo context (at init_process_group) -> pair_peer map
 *   pair_fail   Pair::signalException(const std::string& msg): gloo's I/O thread found the connection
 *                 broken (EOF, reset, write error) -> GLOO_PAIR_FAIL {pair, peer, msg}. This is what
 *                 tells a rank that died inside a collective from the ranks that lost it: every rank
 *                 whose collective then fails names the same peer.
 * Three records per collective per rank (enter; start with size; end), seven uprobe hits (api, work,
 * exec, ~1.5 buffers, algorithm, finish); never one per chunk.
 *
 * Why no uretprobes: a uretprobe on a frame a C++ exception unwinds through turns the job's normal
 * error (a gloo timeout) into SIGABRT. Entry probes on the finish functions give completion safely.
 *
 * Which number joins ranks: c10d's per-group seq_ (`lib_seq`) counts collectives AND point-to-point
 * ops, and p2p ops happen on some ranks only (pipeline stages), so after the first send the same
 * all-reduce carries different seqs on different ranks. `seq` is c10d's collective tag + 1: the
 * counter nextTag() returns and increments, which counts collectives alone (every collective takes
 * exactly one, in order, on every member; p2p uses the caller's tag): identical on every rank for one
 * collective, also when we attach mid-run. The counter is read in place, at the API entry and again
 * when the work is built: it moved by one -> the tag is the old value; it did not move -> no tag (a
 * work built without nextTag). nextTag itself is not probed: its first instruction (a load) would be
 * single-stepped by the uprobe (~5 us a hit here, against ~1 us for the push every other probed
 * function starts with). Its offset in ProcessGroupGloo is not an interface, so user space reads it
 * from nextTag's own machine code (ccld/bpf/gloo.py: `mov OFF(%rdi),%eax; lea 1(%rax),%edx; mov
 * %edx,OFF(%rdi); ret`) and passes it per process in `traced`; where the code does not match, 0
 * ("unknown"), tag -1, and collectives are counted here per (process, group) from the first one seen
 * (exact when tracing began before the group made its first collective, as under ccld run; the
 * translator says so in CommInit.seq_source).
 * p2p ops are matched pairwise in the collector (the n-th send a->b with the n-th recv on b from a);
 * their GLOO_P2P carries c10d's seq too, for reference.
 *
 * Why sizes come from createUnboundBuffer: it is the one exported function on a collective's path
 * whose arguments carry its size (c10d's typed setInput/setOutput templates are inlined into the
 * work's run(), and reading at::Tensor's numel would need TensorImpl offsets that move between torch
 * versions). The smallest buffer c10d builds for a work is the per-rank tensor's bytes for every op
 * whose ranks must agree on it (allreduce: the tensor; allgather/gather/scatter: input n, output
 * world*n), so ranks can be compared at one (communicator, seq). It arrives on the worker thread,
 * after GLOO_WORK_INIT: the translator holds the enter until it comes (gloo_translator.py, HOLD_MS).
 *
 * Maps: events (ringbuf, fixed-size records), lost (per-CPU loss counter), traced (tgid -> that
 * process's counter offset + 1, 1 = unknown), api_inflight (LRU tid -> last API entry, so dead threads
 * leak nothing), works (LRU (tgid, work) -> its (pg, seq) from enter to end), pg_seq (LRU (tgid, pg)
 * -> the group's last collective seq, for the counting fallback), exec_inflight (LRU worker tid -> the
 * work it runs, its start and the buffer sizes so far), p2p_works (LRU SendWork/RecvWork -> when its
 * wait began; an op never waited for ages out), pair_peer. Entries of long-lived threads are written
 * in place (an LRU update costs ~0.5 us here, a lookup ~0.1).
 * Minimum kernel: 5.8 (ring buffer); uprobes.
 */
#include <uapi/linux/ptrace.h>
#ifndef CCLD_REC_SIZE
#define CCLD_REC_SIZE 200  /* the largest record (gloo_pair_fail): every record takes this room */
#endif
#ifndef CCLD_RINGBUF_PAGES
/* 16 MiB: 80,659 slots of 208 bytes. A collective writes 3 records (enter, start, end), so this holds
 * 1.3 s of 20,000 collectives/s; common.h's 4 MiB held 0.34 s, less than a drain period plus its
 * lateness (the agent drained every 250 ms then, 500 ms now, 125 ms during a burst; later when the
 * node's CPUs are busy), and bench/burst.py lost records at 20,000/s with it. */
#define CCLD_RINGBUF_PAGES 4096
#endif
#include "common.h"

#ifndef CCLD_MAX_THREADS
#define CCLD_MAX_THREADS 16384
#endif
#ifndef CCLD_ERR_LEN
#define CCLD_ERR_LEN 160  /* gloo's messages: "[<source path>:<line>] Read error [addr]:port: <strerror>..." */
#endif
#ifndef CCLD_MAX_PAIRS
#define CCLD_MAX_PAIRS 65536  /* connections of traced processes: world - 1 per gloo context */
#endif
#ifndef CCLD_MAX_WORKS
#define CCLD_MAX_WORKS 65536  /* collectives entered and not ended, all processes: a handful each */
#endif
#ifndef CCLD_NAME_LEN
#define CCLD_NAME_LEN 64  /* group names: "0", "1", ... or 40 hex digits (a hash of the ranks) */
#endif
#ifndef CCLD_MAX_GROUPS
#define CCLD_MAX_GROUPS 65536 /* (process, process group) pairs: tens per process */
#endif

enum gloo_kind {
    GLOO_PG_INIT = 1,
    GLOO_WORK_INIT = 2,
    GLOO_WORK_START = 3,
    GLOO_WORK_END = 4,
    GLOO_P2P = 5,
    GLOO_PAIR_FAIL = 7,
    GLOO_P2P_END = 8,
    GLOO_PG_NAME = 9,
};

/* c10d::OpType values the program needs (torch/csrc/distributed/c10d/Work.hpp) */
#define OP_SEND 12
#define OP_RECVANYSOURCE 14

struct gloo_pg_init {
    struct ccld_hdr hdr;
    u64 pg;
    s32 rank;
    s32 size;
};
_Static_assert(sizeof(struct gloo_pg_init) == 40, "gloo_pg_init");

struct gloo_pg_name {
    struct ccld_hdr hdr;
    u64 pg;        /* the c10d::ProcessGroup being named (the wrapper of the gloo backend) */
    u32 len;       /* the name's length; name holds its first CCLD_NAME_LEN - 1 bytes */
    u32 pad;
    char name[CCLD_NAME_LEN];
};
_Static_assert(sizeof(struct gloo_pg_name) == 40 + CCLD_NAME_LEN, "gloo_pg_name");

/* The three records of a collective start alike: pg, work, seq at offsets 24, 32, 40 (user space reads
 * them through one view). A start and an end also carry what their enter had (from `works`), and
 * whether they are the first of the work's records after its enter ("releases"): the one the
 * translator sends a sized op's enter with (its size comes in the start), so that it needs no join
 * of its own. */
struct gloo_work_init {
    struct ccld_hdr hdr;
    u64 pg;        /* 0 when the API entry on this thread was not seen */
    u64 work;
    u64 seq;       /* the collective's number: tag + 1, else counted per (process, group) */
    u64 lib_seq;   /* c10d's seq_: collectives and p2p ops together */
    u64 enter_ns;  /* when the Python thread entered the API (== hdr.ts_ns when unknown) */
    u64 timeout_ms;
    s64 tag;       /* c10d's collective tag (nextTag), -1 when not read */
    s32 op;        /* c10d::OpType */
    u8 reuse;      /* the work object's last use had no start or end yet (its enter still waits) */
    u8 pad[3];
};
_Static_assert(sizeof(struct gloo_work_init) == 24 + 64, "gloo_work_init");

/* What a start and an end know of their enter (from `works`; zero when found == 0). */
struct gloo_enter_of {
    u64 enter_ns;
    u64 lib_seq;
    u32 tid;       /* the thread that entered */
    s32 op;
    u8 found;      /* the work's enter is in `works` (not: built before we attached) */
    u8 releases;   /* the first start or end since the enter */
    u8 pad[6];
};
_Static_assert(sizeof(struct gloo_enter_of) == 32, "gloo_enter_of");

/* The start of a collective on gloo's worker thread, with the sizes of its buffers. start_ns and e are
 * at the same offsets in gloo_work_start and gloo_work_end. */
struct gloo_work_start {
    struct ccld_hdr hdr;
    u64 pg;           /* from `works`: the (pg, seq) its enter had; 0, 0 when e.found == 0 */
    u64 work;
    u64 seq;
    u64 start_ns;     /* AsyncWork::execute */
    struct gloo_enter_of e;
    u64 min_bytes;    /* smallest buffer c10d handed gloo for the work: the per-rank tensor's bytes */
    u64 total_bytes;  /* all of them together */
    u32 nbufs;        /* 0: the op takes no tensor (barrier) */
    u8 sized;         /* 1: an algorithm entry closed the window (the sizes hold); 0: start only */
    u8 pad[3];
};
_Static_assert(sizeof(struct gloo_work_start) == 24 + 32 + 32 + 24, "gloo_work_start");

struct gloo_work_end {
    struct ccld_hdr hdr;
    u64 pg;           /* from `works`, as in gloo_work_start */
    u64 work;
    u64 seq;
    u64 start_ns;     /* the start, when no GLOO_WORK_START went for it (no algorithm entry); else 0 */
    struct gloo_enter_of e;
    s32 ok;
    u32 pad;
};
_Static_assert(sizeof(struct gloo_work_end) == 24 + 32 + 32 + 8, "gloo_work_end");

struct gloo_p2p {
    struct ccld_hdr hdr;
    u64 pg;        /* 0 when the API entry on this thread was not seen */
    u64 work;      /* the SendWork/RecvWork: GLOO_P2P_END names it */
    u64 seq;       /* c10d's seq_ of the op */
    u64 enter_ns;  /* when the Python thread called send/recv (== hdr.ts_ns when unknown) */
    u64 nbytes;    /* the tensor's bytes (createUnboundBuffer on the calling thread); ~0 unknown */
    s32 op;        /* 12 send, 13 recv, 14 recv-any-source (c10d::OpType) */
    s32 peer;      /* group rank; -1 for recv-any-source */
    s32 tag;       /* the caller's tag */
    u32 pad;
};
_Static_assert(sizeof(struct gloo_p2p) == 24 + 56, "gloo_p2p");

struct gloo_p2p_end {
    struct ccld_hdr hdr;
    u64 work;
    u64 wait_ns;   /* when a thread began waiting on it; 0 when the wait entry was not seen */
    s32 ok;
    u32 pad;
};
_Static_assert(sizeof(struct gloo_p2p_end) == 48, "gloo_p2p_end");

struct gloo_pair_fail {
    struct ccld_hdr hdr;
    u64 pair;
    s32 peer;   /* group rank at the far end (from the Pair's constructor); -1 when it was not seen */
    u32 pad;
    char msg[CCLD_ERR_LEN];
};
_Static_assert(sizeof(struct gloo_pair_fail) == 40 + CCLD_ERR_LEN, "gloo_pair_fail");
_Static_assert(sizeof(struct gloo_pair_fail) == CCLD_REC_SIZE, "the largest record sets the slot size");

#define EXEC_IDLE 0     /* no work, or its start went out */
#define EXEC_OPEN 1     /* a work started on this thread; its start and sizes not sent yet */

struct exec_state {
    u64 work;
    u64 start_ns;
    u64 min_bytes;
    u64 total_bytes;
    u32 nbufs;
    u8 state;   /* EXEC_* */
    u8 pad[3];
};

struct api_entry {
    u64 pg;
    u64 ts_ns;
    s64 ctr;       /* c10d's collective counter when last read (API entry, then each work); -1 unread */
    u64 nbytes;    /* p2p: the buffer built on this thread after the entry; ~0 none */
    u32 used;      /* the first work built after the entry gets its timestamp; later ones get their own */
    s32 p2p_op;    /* p2p: c10d::OpType of the pending send/recv; 0 for a collective entry */
    s32 peer;
    s32 utag;
};

struct work_key {
    u32 tgid;
    u32 pad;
    u64 ptr;
};

struct work_val {
    u64 pg;
    u64 seq;
    u64 enter_ns;
    u64 lib_seq;
    u32 tid;
    s32 op;
    u8 covered;    /* a start (with sizes) or the end has gone for it */
    u8 pad[7];
};

struct p2p_state {
    u64 wait_ns;
};

BPF_RINGBUF_OUTPUT(events, CCLD_RINGBUF_PAGES);
BPF_PERCPU_ARRAY(lost, u64, 1);  /* records the ring buffer had no room for; slot 0 */

#ifndef CCLD_MAX_PROCS
#define CCLD_MAX_PROCS 4096
#endif
#ifndef CCLD_MAX_P2P
#define CCLD_MAX_P2P 65536  /* p2p ops posted and not yet waited for, all processes: a handful each */
#endif
#define CCLD_MAX_TAG_OFF 65536  /* a field offset past this is not ProcessGroupGloo's */
/* The probes are attached once per library, for every process that maps it (pid -1), so adding a
 * rank costs one map update instead of an attach, and removing one costs no uprobe unregister
 * (~110 ms each). Processes not in this set return at the first instruction. The value is the
 * process's collective counter offset + 1 (1: unknown). */
BPF_HASH(traced, u32, u32, CCLD_MAX_PROCS);

static __always_inline int ccld_untraced(void)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    return traced.lookup(&tgid) == NULL;
}
BPF_TABLE("lru_hash", u32, struct api_entry, api_inflight, CCLD_MAX_THREADS);
/* Only threads of traced processes get an entry (work_exec checks), so buf_new and algo_enter need
 * no `traced` lookup: one lookup here is all an untraced process's buffer costs. */
BPF_TABLE("lru_hash", u32, struct exec_state, exec_inflight, CCLD_MAX_THREADS);
BPF_TABLE("lru_hash", struct work_key, struct work_val, works, CCLD_MAX_WORKS);
BPF_TABLE("lru_hash", struct work_key, u64, pg_seq, CCLD_MAX_GROUPS);
BPF_TABLE("lru_hash", u64, s32, pair_peer, CCLD_MAX_PAIRS);  /* Pair* -> group rank of its far end */
BPF_TABLE("lru_hash", u64, struct p2p_state, p2p_works, CCLD_MAX_P2P);

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
    struct gloo_pg_init *r = events.ringbuf_reserve(CCLD_REC_SIZE);
    CCLD_FILL_OR_LOST(r, GLOO_PG_INIT);
    r->pg = PT_REGS_PARM1(ctx);
    r->rank = (s32)PT_REGS_PARM3(ctx);
    r->size = (s32)PT_REGS_PARM4(ctx);
    events.ringbuf_submit(r, CCLD_SUBMIT_FLAGS);
    return 0;
}

/* setGroupName(this, const std::string& name): libstdc++'s string is {char *data; size_t len; ...}. */
int pg_name(struct pt_regs *ctx)
{
    if (ccld_untraced())
        return 0;
    struct gloo_pg_name *r = events.ringbuf_reserve(CCLD_REC_SIZE);
    CCLD_FILL_OR_LOST(r, GLOO_PG_NAME);
    r->pg = PT_REGS_PARM1(ctx);
    r->pad = 0;
    u64 str[2] = {0, 0};
    bpf_probe_read_user(str, sizeof(str), (void *)PT_REGS_PARM2(ctx));
    r->len = str[1] > 0xffffffffULL ? 0xffffffffU : (u32)str[1];
    r->name[0] = 0;
    if (str[0])
        bpf_probe_read_user_str(r->name, sizeof(r->name), (void *)str[0]);
    events.ringbuf_submit(r, CCLD_SUBMIT_FLAGS);
    return 0;
}

/* c10d's collective counter of process group `pg` (uint32_t collectiveCounter_ at pg + off - 1, off
 * being the `traced` value), or -1 when its offset is unknown or the read fails. */
static __always_inline s64 read_counter(u32 off, u64 pg)
{
    if (off <= 1 || off > CCLD_MAX_TAG_OFF || pg == 0)
        return -1;
    u32 ctr = 0;
    if (bpf_probe_read_user(&ctr, sizeof(ctr), (void *)(pg + off - 1)) != 0)
        return -1;
    return ctr;
}

static __always_inline int remember_entry(struct pt_regs *ctx, s32 p2p_op, s32 peer, s32 utag)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u32 *off = traced.lookup(&tgid);
    if (off == NULL)
        return 0;
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u64 pg = PT_REGS_PARM2(ctx);  /* PARM1 is the hidden return slot of intrusive_ptr<Work> */
    s64 ctr = p2p_op ? -1 : read_counter(*off, pg);
    u64 now = bpf_ktime_get_ns();
    struct api_entry *e = api_inflight.lookup(&tid);
    if (e) {  /* the thread's entry from its last call: overwritten in place */
        e->pg = pg;
        e->ts_ns = now;
        e->ctr = ctr;
        e->nbytes = ~0ULL;
        e->used = 0;
        e->p2p_op = p2p_op;
        e->peer = peer;
        e->utag = utag;
        return 0;
    }
    struct api_entry fresh = {};
    fresh.pg = pg;
    fresh.ts_ns = now;
    fresh.ctr = ctr;
    fresh.nbytes = ~0ULL;
    fresh.p2p_op = p2p_op;
    fresh.peer = peer;
    fresh.utag = utag;
    api_inflight.update(&tid, &fresh);
    return 0;
}

/* The API returns c10::intrusive_ptr<Work> by value, a class with a non-trivial destructor, so the
 * Itanium ABI passes a hidden return slot first: PARM1 = return slot, PARM2 = this, then the arguments. */
int api_enter(struct pt_regs *ctx) { return remember_entry(ctx, 0, -1, 0); }
/* send/recv(ret, this, std::vector<at::Tensor>&, int peer, int tag) */
int p2p_send(struct pt_regs *ctx) { return remember_entry(ctx, 12, (s32)PT_REGS_PARM4(ctx), (s32)PT_REGS_PARM5(ctx)); }
int p2p_recv(struct pt_regs *ctx) { return remember_entry(ctx, 13, (s32)PT_REGS_PARM4(ctx), (s32)PT_REGS_PARM5(ctx)); }
/* recvAnysource(ret, this, std::vector<at::Tensor>&, int tag) */
int p2p_recvany(struct pt_regs *ctx) { return remember_entry(ctx, 14, -1, (s32)PT_REGS_PARM4(ctx)); }

/* AsyncWork(this, shared_ptr<Context> (by invisible ref), vector<vector<Tensor>> (by invisible ref),
 *           OpType op, u64 seq, ms timeout, const char* title [stack], const optional<...>& [stack]) */
int work_init(struct pt_regs *ctx)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u32 *off = traced.lookup(&tgid);
    if (off == NULL)
        return 0;
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u64 now = bpf_ktime_get_ns();
    u64 pg = 0, enter_ns = now;
    s64 tag = -1;
    struct api_entry *e = api_inflight.lookup(&tid);
    if (e) {
        pg = e->pg;
        /* nextTag() ran between the API entry (or the last work built in it) and here iff the
         * counter moved: one tag, one work (a work built without nextTag must not reuse it). */
        s64 ctr = read_counter(*off, pg);
        if (ctr >= 0 && e->ctr >= 0 && ctr != e->ctr)
            tag = (u32)(ctr - 1);
        e->ctr = ctr;
        if (!e->used) {
            enter_ns = e->ts_ns;
            e->used = 1;
        }
    }
    s32 op = (s32)(PT_REGS_PARM4(ctx) & 0xff);  /* OpType is a uint8_t enum: only the low byte is set */
    if (op >= OP_SEND && op <= OP_RECVANYSOURCE)
        return 0;  /* a p2p op's work: GLOO_P2P reports it */
    struct work_key gk = {.tgid = tgid, .ptr = pg};
    u64 seq;
    u64 *last = pg_seq.lookup(&gk);
    if (tag >= 0)
        seq = (u64)tag + 1;
    else
        seq = (last ? *last : 0) + 1;
    if (last)
        *last = seq;
    else
        pg_seq.update(&gk, &seq);
    u64 work = PT_REGS_PARM1(ctx);
    u64 lib_seq = PT_REGS_PARM5(ctx);
    struct work_key wk = {.tgid = tgid, .ptr = work};
    struct work_val *old = works.lookup(&wk);
    u8 reuse = old && !old->covered;
    struct work_val wv = {.pg = pg, .seq = seq, .enter_ns = enter_ns, .lib_seq = lib_seq, .tid = tid, .op = op};
    works.update(&wk, &wv);
    struct gloo_work_init *r = events.ringbuf_reserve(CCLD_REC_SIZE);
    CCLD_FILL_OR_LOST(r, GLOO_WORK_INIT);
    r->pg = pg;
    r->work = work;
    r->lib_seq = lib_seq;
    r->enter_ns = enter_ns;
    r->timeout_ms = PT_REGS_PARM6(ctx);
    r->tag = tag;
    r->seq = seq;
    r->op = op;
    r->reuse = reuse;
    r->pad[0] = r->pad[1] = r->pad[2] = 0;
    events.ringbuf_submit(r, CCLD_SUBMIT_FLAGS);
    return 0;
}

/* What a start or an end tells of its enter; marks the work covered (its enter has gone with this). */
static __always_inline void enter_of(struct gloo_enter_of *e, struct work_val *wv)
{
    __builtin_memset(e, 0, sizeof(*e));
    if (wv == NULL)
        return;
    e->enter_ns = wv->enter_ns;
    e->lib_seq = wv->lib_seq;
    e->tid = wv->tid;
    e->op = wv->op;
    e->found = 1;
    e->releases = !wv->covered;
}

/* The start of the work this thread runs, with what its window gathered (sized: an algorithm entry
 * closed the window, so the sizes are the work's buffers; only such a start releases the enter). */
static __always_inline int emit_start(struct exec_state *st, u8 sized)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    struct work_key wk = {.tgid = tgid, .ptr = st->work};
    struct work_val *wv = works.lookup(&wk);
    struct gloo_work_start *r = events.ringbuf_reserve(CCLD_REC_SIZE);
    CCLD_FILL_OR_LOST(r, GLOO_WORK_START);
    r->work = st->work;
    r->pg = wv ? wv->pg : 0;
    r->seq = wv ? wv->seq : 0;
    r->start_ns = st->start_ns;
    r->nbufs = st->nbufs;
    r->min_bytes = st->nbufs ? st->min_bytes : 0;
    r->total_bytes = st->total_bytes;
    r->sized = sized;
    r->pad[0] = r->pad[1] = r->pad[2] = 0;
    enter_of(&r->e, wv);
    if (!sized)
        r->e.releases = 0;
    else if (wv)
        wv->covered = 1;
    events.ringbuf_submit(r, CCLD_SUBMIT_FLAGS);
    return 0;
}

/* static execute(const intrusive_ptr<AsyncWork>& work): the intrusive_ptr's first word is the pointer. */
int work_exec(struct pt_regs *ctx)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (traced.lookup(&tgid) == NULL)
        return 0;
    u64 work = 0;
    bpf_probe_read_user(&work, sizeof(work), (void *)PT_REGS_PARM1(ctx));
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct exec_state *st = exec_inflight.lookup(&tid);
    if (st == NULL) {
        struct exec_state fresh = {};
        exec_inflight.update(&tid, &fresh);
        st = exec_inflight.lookup(&tid);
        if (st == NULL)
            return 0;
    } else if (st->state == EXEC_OPEN) {
        emit_start(st, 0);  /* the last work's window never closed (no algorithm entry, no finish) */
    }
    st->work = work;
    st->start_ns = bpf_ktime_get_ns();
    st->min_bytes = ~0ULL;
    st->total_bytes = 0;
    st->nbufs = 0;
    st->state = EXEC_OPEN;
    return 0;
}

/* finish runs on the worker thread that ran the work. A start no algorithm entry sent goes with the
 * end (the same work) or just before it (another: its window never closed). */
static __always_inline int work_finish(struct pt_regs *ctx, s32 ok)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (traced.lookup(&tgid) == NULL)
        return 0;
    u64 work = PT_REGS_PARM1(ctx);
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u64 start_ns = 0;
    struct exec_state *st = exec_inflight.lookup(&tid);
    if (st && st->state == EXEC_OPEN) {
        if (st->work == work)
            start_ns = st->start_ns;
        else
            emit_start(st, 0);
        st->state = EXEC_IDLE;
    }
    struct work_key wk = {.tgid = tgid, .ptr = work};
    struct work_val *wv = works.lookup(&wk);
    struct gloo_work_end *r = events.ringbuf_reserve(CCLD_REC_SIZE);
    if (!r) {
        ccld_count_lost();
        if (wv)
            works.delete(&wk);
        return 0;
    }
    ccld_fill_hdr(&r->hdr, GLOO_WORK_END, sizeof(*r));
    r->work = work;
    r->pg = wv ? wv->pg : 0;
    r->seq = wv ? wv->seq : 0;
    r->start_ns = start_ns;
    r->ok = ok;
    r->pad = 0;
    enter_of(&r->e, wv);
    if (wv)
        works.delete(&wk);  /* after the copy: the value lives in the map */
    events.ringbuf_submit(r, CCLD_SUBMIT_FLAGS);
    return 0;
}

int work_done(struct pt_regs *ctx) { return work_finish(ctx, 1); }
int work_fail(struct pt_regs *ctx) { return work_finish(ctx, 0); }

/* unique_ptr<UnboundBuffer> gloo::Context::createUnboundBuffer(void* ptr, size_t size):
 * (return slot, this, ptr, size). On a worker thread inside a work's window: the work's buffers. On
 * the Python thread of a pending send/recv: the p2p op's tensor (its one buffer). */
int buf_new(struct pt_regs *ctx)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u64 n = PT_REGS_PARM4(ctx);
    struct exec_state *st = exec_inflight.lookup(&tid);
    if (!st || st->state != EXEC_OPEN) {
        struct api_entry *e = api_inflight.lookup(&tid);
        if (e && e->p2p_op && e->nbytes == ~0ULL)
            e->nbytes = n;
        return 0;
    }
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
    if (!st || st->state != EXEC_OPEN)
        return 0;  /* not a traced work's first algorithm call (nested, or another caller) */
    st->state = EXEC_IDLE;
    return emit_start(st, 1);
}

/* SendWork(this, at::Tensor&, unique_ptr<UnboundBuffer> (by invisible ref), u64 seq) and
 * RecvWork(this, at::Tensor&, unique_ptr<UnboundBuffer>, OpType, u64 seq, const char*): the seq is
 * PARM4 or PARM5. Built on the thread that called send/recv, right after its buffer. */
static __always_inline int emit_p2p(struct pt_regs *ctx, u64 seq)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct api_entry *e = api_inflight.lookup(&tid);
    if (e == NULL || e->p2p_op == 0)
        return 0;  /* not after a probed send/recv of a traced process (the entry checked `traced`) */
    u64 work = PT_REGS_PARM1(ctx);
    struct gloo_p2p *r = events.ringbuf_reserve(CCLD_REC_SIZE);
    CCLD_FILL_OR_LOST(r, GLOO_P2P);
    r->pg = e->pg;
    r->work = work;
    r->seq = seq;
    r->enter_ns = e->ts_ns;
    r->nbytes = e->nbytes;
    r->op = e->p2p_op;
    r->peer = e->peer;
    r->tag = e->utag;
    r->pad = 0;
    e->p2p_op = 0;  /* one entry, one op */
    events.ringbuf_submit(r, CCLD_SUBMIT_FLAGS);
    struct p2p_state st = {};
    p2p_works.update(&work, &st);
    return 0;
}

int p2p_send_work(struct pt_regs *ctx) { return emit_p2p(ctx, PT_REGS_PARM4(ctx)); }
int p2p_recv_work(struct pt_regs *ctx) { return emit_p2p(ctx, PT_REGS_PARM5(ctx)); }

/* SendWork::wait / RecvWork::wait(this, ms): the first wait on the op. */
int p2p_wait(struct pt_regs *ctx)
{
    u64 work = PT_REGS_PARM1(ctx);
    struct p2p_state *st = p2p_works.lookup(&work);
    if (st && st->wait_ns == 0)
        st->wait_ns = bpf_ktime_get_ns();
    return 0;
}

/* c10d::Work::finishAndThrow(this, std::exception_ptr (by invisible ref)): the exception_ptr's one
 * word is null when the op succeeded. Other kinds of Work call it too: only ours make a record. */
int p2p_done(struct pt_regs *ctx)
{
    u64 work = PT_REGS_PARM1(ctx);
    struct p2p_state *st = p2p_works.lookup(&work);
    if (st == NULL)
        return 0;
    u64 wait_ns = st->wait_ns;
    p2p_works.delete(&work);
    u64 exc = 0;
    bpf_probe_read_user(&exc, sizeof(exc), (void *)PT_REGS_PARM2(ctx));
    struct gloo_p2p_end *r = events.ringbuf_reserve(CCLD_REC_SIZE);
    CCLD_FILL_OR_LOST(r, GLOO_P2P_END);
    r->work = work;
    r->wait_ns = wait_ns;
    r->ok = exc == 0;
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
    struct gloo_pair_fail *r = events.ringbuf_reserve(CCLD_REC_SIZE);
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
