/* Common record header of every ccld BPF program, and the loss counter.
 *
 * Every record a ccld program puts in its ring buffer starts with struct ccld_hdr. User space
 * dispatches on `kind`, checks `version` and `size`, and counts (never crashes on) short or
 * unknown records. The Python mirror is ccld/bpf/records.py; a unit test asserts the sizes.
 * Clock: ts_ns is bpf_ktime_get_ns(), i.e. CLOCK_MONOTONIC of this node.
 */
#ifndef CCLD_COMMON_H
#define CCLD_COMMON_H

#define CCLD_REC_VERSION 1

#ifndef CCLD_RINGBUF_PAGES
/* 4 MiB: 20,164 slots of 208 bytes (a 200-byte record + its 8-byte header), 47,662 of 88. The agent
 * drains every 500 ms, every 125 ms while a burst fills a quarter of a ring in 500 ms (tracer/agent.py
 * POLL_MS): a family whose records are big
 * or many sets its own size before including this file (gloo: 16 MiB), so that its ring holds well
 * over a drain period at the node's busiest rate (bench/burst.py). */
#define CCLD_RINGBUF_PAGES 1024
#endif

/* Every record of a family takes the same room in the ring buffer (CCLD_REC_SIZE bytes, set by the
 * family before including this file), whatever its kind: user space then reads a drain's records
 * as one fixed-stride array (ccld/bpf/ringbuf.py) instead of walking them one by one. The header's
 * `size` is the record's own struct size; the bytes after it are not written. */
#ifndef CCLD_REC_SIZE
#error "a family defines CCLD_REC_SIZE (the largest of its records, a multiple of 8) before common.h"
#endif
_Static_assert(CCLD_REC_SIZE % 8 == 0, "CCLD_REC_SIZE is a multiple of 8 (the ring buffer's alignment)");

#ifndef CCLD_SUBMIT_FLAGS
/* No wakeup per record: the agent drains every few tens of ms anyway (Family.poll), and a wakeup
 * per collective costs the traced node a context switch and the agent a Python callback round trip.
 * BPF_RB_NO_WAKEUP is 1 in uapi/linux/bpf.h (5.8+); -DCCLD_SUBMIT_FLAGS=0 restores wakeups. */
#define CCLD_SUBMIT_FLAGS 1
#endif

struct ccld_hdr {
    u16 kind;
    u16 version;
    u32 size;   /* whole record, header included, in bytes */
    u64 ts_ns;  /* CLOCK_MONOTONIC */
    u32 tgid;
    u32 tid;
};
_Static_assert(sizeof(struct ccld_hdr) == 24, "ccld_hdr is 24 bytes (mirror: records.Header)");

/* Maps are not declared here: bcc rewrites map calls only in the main source file, so each
 * family's .bpf.c declares `events` (BPF_RINGBUF_OUTPUT), `lost` (BPF_PERCPU_ARRAY of one u64)
 * and `static void ccld_count_lost(void)`, which the macro below calls. */

static __always_inline void ccld_fill_hdr(struct ccld_hdr *h, u16 kind, u32 size)
{
    u64 id = bpf_get_current_pid_tgid();
    h->kind = kind;
    h->version = CCLD_REC_VERSION;
    h->size = size;
    h->ts_ns = bpf_ktime_get_ns();
    h->tgid = id >> 32;
    h->tid = (u32)id;
}

/* Reserve a record into `r` (a typed pointer) with kind K, or count the loss and `return 0`.
 * bcc refuses map calls inside macros and a non-inlined helper breaks the verifier's constant-size
 * rule, so each probe writes `r = events.ringbuf_reserve(CCLD_REC_SIZE); CCLD_FILL_OR_LOST(r, K);`. */
#define CCLD_FILL_OR_LOST(r, K)                                         \
    do {                                                                \
        if (!(r)) {                                                     \
            ccld_count_lost();                                          \
            return 0;                                                   \
        }                                                               \
        _Static_assert(sizeof(*(r)) <= CCLD_REC_SIZE, "record fits its slot"); \
        ccld_fill_hdr(&(r)->hdr, (K), sizeof(*(r)));                    \
    } while (0)

#endif
