/* pgnccl.bpf.c: PyTorch's NCCL process groups (c10d::ProcessGroupNCCL in libtorch_cuda.so), one
 * record per work c10d builds: the group's name and c10d's own collective sequence number.
 *
 * Attach points (entry-only uprobes, attached once per library for every process that maps it; the
 * mangled symbols are in ccld/bpf/pgnccl.py):
 *   pg_init    ProcessGroupNCCL::ProcessGroupNCCL(intrusive_ptr<Store>, int rank, int size,
 *                intrusive_ptr<Options>): intrusive_ptr is not trivially copyable, so the SysV ABI
 *                passes it by hidden reference: this = PARM1, rank = PARM3, size = PARM4
 *                -> PGN_PG {pg, rank, size}
 *   init_work  ProcessGroupNCCL::initWork(Device&, int rank, OpType, bool isP2P, ...), which every
 *                collective and p2p op calls right before it builds its work. It returns an
 *                intrusive_ptr by value, so PARM1 is the return slot and `this` (the group) PARM2:
 *                remembered per thread (no record), for the constructor below
 *   work_new   ProcessGroupNCCL::WorkNCCL::WorkNCCL(std::string pgUID, std::string pgDesc, Device&,
 *                int rank, OpType opType, uint64_t seq, bool isP2P, ...): the strings are passed by
 *                hidden reference (PARM2, PARM3), rank = PARM5, opType = PARM6, seq and isP2P are the
 *                7th and 8th arguments (SP+8, SP+16 at entry) -> PGN_WORK {pg, seq, rank, op, p2p, uid}
 *
 * Which number joins ranks: c10d keeps seqCollective_ (collectives only) and seqP2P_ (p2p only) per
 * group and passes `isP2P ? seqP2P_ : seqCollective_` to the work it builds; Flight Recorder records
 * the same two as collective_seq_id / p2p_seq_id. A collective's seq is therefore identical on every
 * member, also when ccld attaches mid-run, and pgUID (the group's name: "0" for the default group) is
 * identical on every member too. Both are function arguments: no struct offset of torch's is read.
 * The one layout read is libstdc++'s std::string (data pointer, then length), fixed by its C++11 ABI.
 *
 * Why entry probes only: a uretprobe on a frame a C++ exception unwinds through aborts the job
 * (docs: platform notes); the constructor's arguments are all we need.
 *
 * Maps: events (ringbuf, fixed-size records), lost (per-CPU loss counter), traced (tgid -> 1: the
 * processes we trace; every other returns at once), work_pg (LRU tid -> the group of the initWork
 * this thread is in, so a thread that dies inside leaks nothing).
 * Minimum kernel: 5.8 (ring buffer); uprobes.
 */
#include <uapi/linux/ptrace.h>
#ifndef CCLD_REC_SIZE
#define CCLD_REC_SIZE 96  /* pgn_work, the largest record: every record takes this room */
#endif
#ifndef CCLD_RINGBUF_PAGES
/* 1 MiB: 10,082 slots of 104 bytes (a record + its 8-byte header), one per collective: one 500 ms drain
 * period of 20,000 collectives/s on the node (a burst to that rate can lose, and count, records in
 * its first drain period; the agent then drains every 125 ms: tracer/agent.py). The agent maps a ring's pages twice and they count in
 * its resident memory (8 MiB for the common 4 MiB ring), so this family keeps to what it needs. */
#define CCLD_RINGBUF_PAGES 256
#endif
#include "common.h"

#ifndef CCLD_MAX_THREADS
#define CCLD_MAX_THREADS 16384
#endif
#ifndef CCLD_MAX_PROCS
#define CCLD_MAX_PROCS 4096
#endif
#define PGN_UID_BYTES 48  /* a group name longer than this is cut (torch's are "0".."N" or a 40-hex hash) */

enum pgn_kind {
    PGN_PG = 1,
    PGN_WORK = 2,
};

struct pgn_pg {
    struct ccld_hdr hdr;
    u64 pg;     /* the ProcessGroupNCCL object: stable for the group's life in this process */
    s32 rank;   /* this process's rank in the group */
    s32 size;   /* the group's size */
};
_Static_assert(sizeof(struct pgn_pg) == 40, "pgn_pg");

struct pgn_work {
    struct ccld_hdr hdr;
    u64 pg;       /* the group whose initWork built it; 0 when that entry was not seen */
    u64 seq;      /* seqCollective_ for a collective, seqP2P_ for a p2p op */
    s32 rank;     /* the group rank */
    u8 op;        /* c10d::OpType (a uint8_t enum) */
    u8 p2p;       /* isP2P */
    u16 uid_len;  /* the group name's full length (the bytes kept: at most PGN_UID_BYTES) */
    char uid[PGN_UID_BYTES];
};
_Static_assert(sizeof(struct pgn_work) == 96, "pgn_work");

BPF_RINGBUF_OUTPUT(events, CCLD_RINGBUF_PAGES);
BPF_PERCPU_ARRAY(lost, u64, 1);  /* records the ring buffer had no room for; slot 0 */
BPF_HASH(traced, u32, u8, CCLD_MAX_PROCS);
BPF_TABLE("lru_hash", u32, u64, work_pg, CCLD_MAX_THREADS);

static __always_inline int ccld_untraced(void)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    return traced.lookup(&tgid) == NULL;
}

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
    struct pgn_pg *r = events.ringbuf_reserve(CCLD_REC_SIZE);
    CCLD_FILL_OR_LOST(r, PGN_PG);
    r->pg = PT_REGS_PARM1(ctx);
    r->rank = (s32)PT_REGS_PARM3(ctx);
    r->size = (s32)PT_REGS_PARM4(ctx);
    events.ringbuf_submit(r, CCLD_SUBMIT_FLAGS);
    return 0;
}

int init_work(struct pt_regs *ctx)
{
    if (ccld_untraced())
        return 0;
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u64 pg = PT_REGS_PARM2(ctx);
    work_pg.update(&tid, &pg);
    return 0;
}

int work_new(struct pt_regs *ctx)
{
    if (ccld_untraced())
        return 0;
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct pgn_work *r = events.ringbuf_reserve(CCLD_REC_SIZE);
    CCLD_FILL_OR_LOST(r, PGN_WORK);
    u64 *pg = work_pg.lookup(&tid);
    r->pg = pg ? *pg : 0;
    if (pg)
        work_pg.delete(&tid);
    u64 sp = PT_REGS_SP(ctx);
    u64 seq = 0;
    u8 p2p = 0;
    bpf_probe_read_user(&seq, sizeof(seq), (void *)(sp + 8));
    bpf_probe_read_user(&p2p, sizeof(p2p), (void *)(sp + 16));
    r->seq = seq;
    r->p2p = p2p;
    r->rank = (s32)PT_REGS_PARM5(ctx);
    r->op = (u8)PT_REGS_PARM6(ctx);
    /* std::string (libstdc++, C++11 ABI): {char *data; size_t length; ...} */
    struct { u64 data; u64 len; } s = {};
    bpf_probe_read_user(&s, sizeof(s), (void *)PT_REGS_PARM2(ctx));
    r->uid_len = s.len > 0xffff ? 0xffff : (u16)s.len;
    /* std::string's data is NUL-terminated (c_str()): read up to the NUL, at most the room we have. The
     * slot is not zeroed by ringbuf_reserve (an earlier record's bytes are there once the ring wraps):
     * the name's room is cleared first, so nothing but the name and NULs reaches user space. */
    __builtin_memset(r->uid, 0, sizeof(r->uid));
    if (s.data)
        bpf_probe_read_user_str(r->uid, sizeof(r->uid), (void *)s.data);
    events.ringbuf_submit(r, CCLD_SUBMIT_FLAGS);
    return 0;
}
