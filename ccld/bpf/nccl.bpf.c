/* nccl.bpf.c: the host-side API of NCCL (libnccl.so), one record per API call.
 *
 * Attach points (uprobes by PID on the exported C symbols; see ccld/bpf/nccl.py for the list):
 *   coll_*       ncclAllReduce/Broadcast/Reduce/AllGather/ReduceScatter (and, where the library has
 *                them, AlltoAll/Gather/Scatter and the *Config variants, whose leading arguments are the
 *                same) -> NCCL_COLL {comm, count, datatype, redop, root, stream, sendbuff, recvbuff}
 *   p2p_send/p2p_recv   ncclSend/ncclRecv(buff, count, datatype, peer, comm, stream)
 *                -> NCCL_P2P {comm, count, datatype, peer (in `root`), stream, buff}
 *   group_start/group_end   ncclGroupStart()/ncclGroupEnd() -> NCCL_GROUP {fn}
 *   init_rank/init_rank_config/comm_split (entry) + init_ret (uretprobe on the same three)
 *                ncclCommInitRank(comm*, nranks, ncclUniqueId id, rank)
 *                ncclCommInitRankConfig(comm*, nranks, ncclUniqueId id, rank, config*)
 *                ncclCommSplit(comm, color, key, newcomm*, config*)
 *                entry remembers the arguments per thread; return -> NCCL_COMM_INIT
 *                {comm = *out-pointer, idhash, nranks, rank | parent, color, key, ret, enter_ns}
 *   comm_destroy/comm_abort   ncclCommDestroy/ncclCommAbort(comm) -> NCCL_COMM_END {comm, fn}
 *
 * ABI (SysV x86-64, plain C, so no hidden return slot): integer arguments in PARM1..6, the 7th and
 * 8th at SP+8 and SP+16 at function entry (SP points at the return address). ncclUniqueId is a
 * 128-byte struct passed by value: it goes on the stack (SP+8..SP+135) and uses no register, so
 * InitRank's `rank` is PARM3 although it is the 4th argument.
 *
 * Identity: the ncclUniqueId is the one value every rank of a new communicator passes in, so its
 * FNV-1a 64 hash (computed here, over all 128 bytes) names the communicator across ranks.
 * User space derives a split's identity from its parent's (ccld/bpf/nccl.py).
 *
 * Why uretprobes only on the three init calls: they are plain C functions that cannot throw, and
 * their out-parameter (*comm) is only written inside them. Every other probe is entry-only, and an
 * entry on a collective means "this rank enqueued it", not that it ran (NCCL is asynchronous).
 * ncclBcast is not probed: it calls ncclBroadcast, whose probe sees it.
 *
 * Maps: events (ringbuf, records), lost (per-CPU loss counter), init_inflight (LRU tid -> init
 * arguments between entry and return, so a thread that dies inside init leaks nothing).
 * Minimum kernel: 5.8 (ring buffer); 5.3 for the bounded hash loop; uprobes.
 */
#include <uapi/linux/ptrace.h>
#ifndef CCLD_REC_SIZE
#define CCLD_REC_SIZE 80  /* the largest record (nccl_call, nccl_comm_init): every record takes this room */
#endif
#include "common.h"

#ifndef CCLD_MAX_THREADS
#define CCLD_MAX_THREADS 16384
#endif
#define NCCL_UNIQUE_ID_BYTES 128 /* fixed by NCCL's ABI (nccl.h) */
#define FNV64_OFFSET 0xcbf29ce484222325ULL
#define FNV64_PRIME 0x100000001b3ULL

enum nccl_kind {
    NCCL_COLL = 1,
    NCCL_P2P = 2,
    NCCL_GROUP = 3,
    NCCL_COMM_INIT = 4,
    NCCL_COMM_END = 5,
};

/* Which API function a record comes from (mirror: nccl.py FN_*). */
enum nccl_fn {
    FN_ALLREDUCE = 1,
    FN_BROADCAST = 2,
    FN_REDUCE = 3,
    FN_ALLGATHER = 4,
    FN_REDUCESCATTER = 5,
    FN_ALLTOALL = 6,
    FN_GATHER = 7,
    FN_SCATTER = 8,
    FN_SEND = 20,
    FN_RECV = 21,
    FN_GROUP_START = 30,
    FN_GROUP_END = 31,
    FN_INIT_RANK = 40,
    FN_INIT_RANK_CONFIG = 41,
    FN_SPLIT = 42,
    FN_DESTROY = 50,
    FN_ABORT = 51,
};

/* NCCL_COLL and NCCL_P2P */
struct nccl_call {
    struct ccld_hdr hdr;
    u64 comm;      /* ncclComm_t handle: a pointer, stable for the communicator's life in this process */
    u64 count;     /* elements; per-rank send count (AllGather) or receive count (ReduceScatter) */
    u64 stream;    /* cudaStream_t */
    u64 sendbuff;  /* send/recv: the one buffer */
    u64 recvbuff;  /* 0 for send/recv */
    s32 fn;        /* enum nccl_fn */
    s32 datatype;  /* ncclDataType_t */
    s32 redop;     /* ncclRedOp_t; -1 when the function has none */
    s32 root;      /* root (Broadcast/Reduce/Gather/Scatter) or peer (Send/Recv); -1 when none */
};
_Static_assert(sizeof(struct nccl_call) == 24 + 40 + 16, "nccl_call");

struct nccl_group {
    struct ccld_hdr hdr;
    s32 fn;  /* FN_GROUP_START / FN_GROUP_END */
    u32 pad;
};
_Static_assert(sizeof(struct nccl_group) == 32, "nccl_group");

struct nccl_comm_init {
    struct ccld_hdr hdr;  /* ts_ns: when the init call returned */
    u64 comm;      /* *newcomm after return; 0 when NCCL did not create one */
    u64 parent;    /* split: the parent handle; 0 for init */
    u64 idhash;    /* init: FNV-1a 64 of the ncclUniqueId; 0 for split */
    u64 enter_ns;  /* when the thread called the function */
    s32 fn;        /* FN_INIT_RANK / FN_INIT_RANK_CONFIG / FN_SPLIT */
    s32 ret;       /* ncclResult_t; 7 (ncclInProgress) is success of a non-blocking init */
    s32 nranks;    /* init: nranks; split: -1 (not known until NCCL finishes) */
    s32 rank;      /* init: rank; split: -1 */
    s32 color;     /* split; -1 for init */
    s32 key;       /* split; -1 for init */
};
_Static_assert(sizeof(struct nccl_comm_init) == 24 + 32 + 24, "nccl_comm_init");

struct nccl_comm_end {
    struct ccld_hdr hdr;
    u64 comm;
    s32 fn;  /* FN_DESTROY / FN_ABORT */
    u32 pad;
};
_Static_assert(sizeof(struct nccl_comm_end) == 40, "nccl_comm_end");

/* What init's entry saw, kept until its return on the same thread. */
struct init_entry {
    u64 commp;    /* the out-parameter: where NCCL writes the new handle */
    u64 parent;
    u64 idhash;
    u64 enter_ns;
    s32 fn;
    s32 nranks;
    s32 rank;
    s32 color;
    s32 key;
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
BPF_TABLE("lru_hash", u32, struct init_entry, init_inflight, CCLD_MAX_THREADS);

static __always_inline void ccld_count_lost(void)
{
    int zero = 0;
    u64 *n = lost.lookup(&zero);
    if (n)
        (*n)++;
}

/* 7th, 8th, ... integer argument at function entry: slot 1, 2, ... above the return address. */
static __always_inline u64 stack_arg(struct pt_regs *ctx, int slot)
{
    u64 v = 0;
    bpf_probe_read_user(&v, sizeof(v), (void *)(PT_REGS_SP(ctx) + 8 * slot));
    return v;
}

static __always_inline int emit_call(u16 kind, s32 fn, u64 sendbuff, u64 recvbuff, u64 count, s32 datatype,
                                     s32 redop, s32 root, u64 comm, u64 stream)
{
    if (ccld_untraced())
        return 0;
    struct nccl_call *r = events.ringbuf_reserve(CCLD_REC_SIZE);
    CCLD_FILL_OR_LOST(r, kind);
    r->comm = comm;
    r->count = count;
    r->stream = stream;
    r->sendbuff = sendbuff;
    r->recvbuff = recvbuff;
    r->fn = fn;
    r->datatype = datatype;
    r->redop = redop;
    r->root = root;
    events.ringbuf_submit(r, CCLD_SUBMIT_FLAGS);
    return 0;
}

#define P(n) PT_REGS_PARM##n(ctx)

/* (sendbuff, recvbuff, count, datatype, op, comm, stream[stack]) */
int coll_allreduce(struct pt_regs *ctx)
{
    return emit_call(NCCL_COLL, FN_ALLREDUCE, P(1), P(2), P(3), (s32)P(4), (s32)P(5), -1, P(6), stack_arg(ctx, 1));
}

int coll_reducescatter(struct pt_regs *ctx)
{
    return emit_call(NCCL_COLL, FN_REDUCESCATTER, P(1), P(2), P(3), (s32)P(4), (s32)P(5), -1, P(6),
                     stack_arg(ctx, 1));
}

/* (sendbuff, recvbuff, count, datatype, root, comm, stream[stack]) */
int coll_broadcast(struct pt_regs *ctx)
{
    return emit_call(NCCL_COLL, FN_BROADCAST, P(1), P(2), P(3), (s32)P(4), -1, (s32)P(5), P(6), stack_arg(ctx, 1));
}

int coll_gather(struct pt_regs *ctx)
{
    return emit_call(NCCL_COLL, FN_GATHER, P(1), P(2), P(3), (s32)P(4), -1, (s32)P(5), P(6), stack_arg(ctx, 1));
}

int coll_scatter(struct pt_regs *ctx)
{
    return emit_call(NCCL_COLL, FN_SCATTER, P(1), P(2), P(3), (s32)P(4), -1, (s32)P(5), P(6), stack_arg(ctx, 1));
}

/* (sendbuff, recvbuff, count, datatype, op, root, comm[stack 1], stream[stack 2]) */
int coll_reduce(struct pt_regs *ctx)
{
    return emit_call(NCCL_COLL, FN_REDUCE, P(1), P(2), P(3), (s32)P(4), (s32)P(5), (s32)P(6), stack_arg(ctx, 1),
                     stack_arg(ctx, 2));
}

/* (sendbuff, recvbuff, count, datatype, comm, stream) */
int coll_allgather(struct pt_regs *ctx)
{
    return emit_call(NCCL_COLL, FN_ALLGATHER, P(1), P(2), P(3), (s32)P(4), -1, -1, P(5), P(6));
}

int coll_alltoall(struct pt_regs *ctx)
{
    return emit_call(NCCL_COLL, FN_ALLTOALL, P(1), P(2), P(3), (s32)P(4), -1, -1, P(5), P(6));
}

/* (buff, count, datatype, peer, comm, stream) */
int p2p_send(struct pt_regs *ctx)
{
    return emit_call(NCCL_P2P, FN_SEND, P(1), 0, P(2), (s32)P(3), -1, (s32)P(4), P(5), P(6));
}

int p2p_recv(struct pt_regs *ctx)
{
    return emit_call(NCCL_P2P, FN_RECV, P(1), 0, P(2), (s32)P(3), -1, (s32)P(4), P(5), P(6));
}

static __always_inline int emit_group(s32 fn)
{
    if (ccld_untraced())
        return 0;
    struct nccl_group *r = events.ringbuf_reserve(CCLD_REC_SIZE);
    CCLD_FILL_OR_LOST(r, NCCL_GROUP);
    r->fn = fn;
    r->pad = 0;
    events.ringbuf_submit(r, CCLD_SUBMIT_FLAGS);
    return 0;
}

int group_start(struct pt_regs *ctx) { return emit_group(FN_GROUP_START); }
int group_end(struct pt_regs *ctx) { return emit_group(FN_GROUP_END); }

static __always_inline int emit_end(s32 fn, u64 comm)
{
    if (ccld_untraced())
        return 0;
    struct nccl_comm_end *r = events.ringbuf_reserve(CCLD_REC_SIZE);
    CCLD_FILL_OR_LOST(r, NCCL_COMM_END);
    r->comm = comm;
    r->fn = fn;
    r->pad = 0;
    events.ringbuf_submit(r, CCLD_SUBMIT_FLAGS);
    return 0;
}

int comm_destroy(struct pt_regs *ctx) { return emit_end(FN_DESTROY, P(1)); }
int comm_abort(struct pt_regs *ctx) { return emit_end(FN_ABORT, P(1)); }

/* FNV-1a 64 over the ncclUniqueId passed by value, i.e. on the stack right above the return address.
 * The loop is bounded (128), which the verifier accepts since 5.3; clang may unroll it anyway. */
static __always_inline u64 unique_id_hash(struct pt_regs *ctx)
{
    unsigned char id[NCCL_UNIQUE_ID_BYTES];
    if (bpf_probe_read_user(id, sizeof(id), (void *)(PT_REGS_SP(ctx) + 8)) != 0)
        return 0;  /* cannot happen for a live call frame; 0 tells user space "no identity" */
    u64 h = FNV64_OFFSET;
    for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++) {
        h ^= id[i];
        h *= FNV64_PRIME;
    }
    return h;
}

/* (ncclComm_t* comm, int nranks, ncclUniqueId id [stack], int rank [, ncclConfig_t* config]) */
static __always_inline int init_enter(struct pt_regs *ctx, s32 fn)
{
    if (ccld_untraced())
        return 0;
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct init_entry e = {};
    e.fn = fn;
    e.commp = P(1);
    e.nranks = (s32)P(2);
    e.rank = (s32)P(3);
    e.idhash = unique_id_hash(ctx);
    e.color = -1;
    e.key = -1;
    e.enter_ns = bpf_ktime_get_ns();
    init_inflight.update(&tid, &e);
    return 0;
}

int init_rank(struct pt_regs *ctx) { return init_enter(ctx, FN_INIT_RANK); }
int init_rank_config(struct pt_regs *ctx) { return init_enter(ctx, FN_INIT_RANK_CONFIG); }

/* (ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config) */
int comm_split(struct pt_regs *ctx)
{
    if (ccld_untraced())
        return 0;
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct init_entry e = {};
    e.fn = FN_SPLIT;
    e.parent = P(1);
    e.color = (s32)P(2);
    e.key = (s32)P(3);
    e.commp = P(4);
    e.nranks = -1;
    e.rank = -1;
    e.enter_ns = bpf_ktime_get_ns();
    init_inflight.update(&tid, &e);
    return 0;
}

/* Return of any of the three: the handle NCCL wrote to the out-parameter, and the result code. */
int init_ret(struct pt_regs *ctx)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct init_entry *e = init_inflight.lookup(&tid);
    if (!e)
        return 0;  /* we attached while this thread was inside init: its arguments are unknown */
    struct nccl_comm_init *r = events.ringbuf_reserve(CCLD_REC_SIZE);
    if (!r) {
        ccld_count_lost();
        init_inflight.delete(&tid);
        return 0;
    }
    ccld_fill_hdr(&r->hdr, NCCL_COMM_INIT, sizeof(*r));
    u64 comm = 0;
    if (e->commp)
        bpf_probe_read_user(&comm, sizeof(comm), (void *)e->commp);
    r->comm = comm;
    r->parent = e->parent;
    r->idhash = e->idhash;
    r->enter_ns = e->enter_ns;
    r->fn = e->fn;
    r->ret = (s32)PT_REGS_RC(ctx);
    r->nranks = e->nranks;
    r->rank = e->rank;
    r->color = e->color;
    r->key = e->key;
    events.ringbuf_submit(r, CCLD_SUBMIT_FLAGS);
    init_inflight.delete(&tid);
    return 0;
}
