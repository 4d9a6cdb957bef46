/* ccld_profiler.h: the datagram format of libnccl-profiler-ccld.so (ccld_profiler.c), ccld's NCCL
 * profiler plugin, and the small id tables its records use. ccld/ncclprof/format.py mirrors it as numpy
 * dtypes; a unit test compares both against ccld_np_layout() (exported by the plugin).
 *
 * One datagram (AF_UNIX SOCK_DGRAM, at most CCLD_NP_DATAGRAM_MAX bytes) =
 *   ccld_np_header | n_records fixed-size records (CCLD_NP_RECORD_SIZE each) | text_len bytes of UTF-8
 * (the text is the reason the plugin turned off; empty otherwise). Native byte order: little-endian on
 * every machine NCCL runs on (x86-64, aarch64); a reader checks the magic.
 *
 * Clocks and units: every t_* / *_ns host time is CLOCK_MONOTONIC ns of the sending host (the same clock
 * as ccld's agent there). gpu_start_ns / gpu_end_ns are NCCL's kernel timestamps (the GPU's %globaltimer,
 * ns, another clock): kept raw, meaningful only where the record's flags say valid. Counts are elements
 * (count) or bytes (nbytes).
 *
 * Versioning: CCLD_NP_VERSION is a major version; a reader rejects another. Fields are only ever added at
 * the end of the header or of a record (header_size / record_size grow); a reader skips what it does not
 * know.
 */
#ifndef CCLD_PROFILER_H_
#define CCLD_PROFILER_H_

#include <stdint.h>

#define CCLD_NP_MAGIC 0x504e4343u  /* "CCNP" as little-endian bytes */
#define CCLD_NP_VERSION 1
#define CCLD_NP_DATAGRAM_MAX 61440 /* 60 KiB: below every AF_UNIX datagram limit (net.core.wmem_default) */

/* header.state */
#define CCLD_NP_STATE_OFF 0 /* the plugin turned off; the trailing text says why; nothing follows */
#define CCLD_NP_STATE_ON 1
#define CCLD_NP_STATE_BYE 2 /* the last communicator was finalized (or the process exits): the last one */

typedef struct {
  uint32_t magic;             /*  0 CCLD_NP_MAGIC */
  uint16_t version;           /*  4 CCLD_NP_VERSION */
  uint16_t header_size;       /*  6 sizeof(ccld_np_header) as the sender knows it */
  uint16_t record_size;       /*  8 CCLD_NP_RECORD_SIZE as the sender knows it */
  uint8_t api_version;        /* 10 the ncclProfiler_vN NCCL picked (1..5) */
  uint8_t state;              /* 11 CCLD_NP_STATE_* */
  int32_t pid;                /* 12 */
  int32_t rank;               /* 16 global rank from env RANK, -1 when unset */
  uint32_t n_records;         /* 20 */
  uint64_t number;            /* 24 datagram number in this process, from 1 (a gap: datagrams lost) */
  uint64_t sent_ns;           /* 32 when this datagram was built (host ns) */
  uint32_t text_len;          /* 40 bytes of UTF-8 after the records */
  int32_t last_errno;         /* 44 errno of the last refused send, 0 if none yet */
  /* cumulative loss counters (since the plugin loaded), as of sent_ns */
  uint64_t drop_queue;        /* 48 records dropped: the queue was full between two flushes */
  uint64_t drop_handles;      /* 56 NCCL events not followed: no free handle (or too many communicators) */
  uint64_t drop_datagrams;    /* 64 datagrams whose send was refused (no listener, its queue full, ...) */
  uint64_t drop_sent_records; /* 72 records those datagrams held */
  uint64_t drop_links;        /* 80 proxy ops not summed / p2p ops not numbered: the link table was full */
  uint64_t orphans;           /* 88 child events whose parent was unknown or already over; reused step slots */
} ccld_np_header;

#define CCLD_NP_HEADER_SIZE 96
#define CCLD_NP_RECORD_SIZE 80

/* record kinds (byte 0 of every record) */
#define CCLD_NP_COMM 1        /* a communicator, once when first seen: ccld_np_comm */
#define CCLD_NP_COLL_START 2  /* NCCL started a collective (host): ccld_np_task */
#define CCLD_NP_COLL_KERNEL 3 /* its first kernel channel started (prompt, v3+): ccld_np_task */
#define CCLD_NP_COLL_END 4    /* it is over (see flags for how that is known): ccld_np_task */
#define CCLD_NP_P2P_START 5   /* same three for a send or a receive */
#define CCLD_NP_P2P_KERNEL 6
#define CCLD_NP_P2P_END 7
#define CCLD_NP_PROGRESS 8    /* one link's network progress over one flush interval: ccld_np_progress */

/* ccld_np_task.flags */
#define CCLD_NP_F_GPU_START 0x01     /* gpu_start_ns holds a kernel timestamp (v4+) */
#define CCLD_NP_F_GPU_END 0x02       /* gpu_end_ns holds one */
#define CCLD_NP_F_END_CHILDREN 0x04  /* END: t_ns = when the last of its kernel channels / proxy ops stopped */
#define CCLD_NP_F_END_ENQUEUE 0x08   /* END: no child event ever came (v1/v2 without network, or a mask
                                        without them): t_ns = t_enq_ns, it was only launched */
#define CCLD_NP_F_END_STALE 0x10     /* END: enqueued and no kernel channel ever started for 3000 flush
                                        intervals; t_ns = 0; its handle was taken back */

/* ccld_np_comm.flags */
#define CCLD_NP_F_FROM_INIT 0x01 /* rank/nranks/nnodes from NCCL's init (v4+); else rank from an event, others -1 */
/* ccld_np_progress.flags */
#define CCLD_NP_F_SEND 0x01      /* this rank sends to peer; else receives from it */

/* op ids: ncclFunc_t + 1 (NCCL's own numbering since 2.19); 0 = not known */
enum {
  CCLD_NP_OP_UNKNOWN = 0, CCLD_NP_OP_BROADCAST, CCLD_NP_OP_REDUCE, CCLD_NP_OP_ALLGATHER,
  CCLD_NP_OP_REDUCE_SCATTER, CCLD_NP_OP_ALLREDUCE, CCLD_NP_OP_SENDRECV, CCLD_NP_OP_SEND,
  CCLD_NP_OP_RECV, CCLD_NP_OP_ALLTOALL, CCLD_NP_OP_SCATTER, CCLD_NP_OP_GATHER, CCLD_NP_OP_ALLGATHERV,
  CCLD_NP_OP_PUT_SIGNAL, CCLD_NP_OP_SIGNAL, CCLD_NP_OP_WAIT_SIGNAL, CCLD_NP_OP_N
};
/* datatype ids: ncclDataType_t + 1; 0 = not known */
enum {
  CCLD_NP_DT_UNKNOWN = 0, CCLD_NP_DT_INT8, CCLD_NP_DT_UINT8, CCLD_NP_DT_INT32, CCLD_NP_DT_UINT32,
  CCLD_NP_DT_INT64, CCLD_NP_DT_UINT64, CCLD_NP_DT_FLOAT16, CCLD_NP_DT_FLOAT32, CCLD_NP_DT_FLOAT64,
  CCLD_NP_DT_BFLOAT16, CCLD_NP_DT_FLOAT8_E4M3, CCLD_NP_DT_FLOAT8_E5M2, CCLD_NP_DT_N
};
/* algorithm ids: NCCL_ALGO_* + 1; protocol ids: NCCL_PROTO_* + 1; 0 = not known */
enum { CCLD_NP_ALGO_UNKNOWN = 0, CCLD_NP_ALGO_TREE, CCLD_NP_ALGO_RING, CCLD_NP_ALGO_COLLNET_DIRECT,
       CCLD_NP_ALGO_COLLNET_CHAIN, CCLD_NP_ALGO_NVLS, CCLD_NP_ALGO_NVLS_TREE, CCLD_NP_ALGO_PAT, CCLD_NP_ALGO_N };
enum { CCLD_NP_PROTO_UNKNOWN = 0, CCLD_NP_PROTO_LL, CCLD_NP_PROTO_LL128, CCLD_NP_PROTO_SIMPLE, CCLD_NP_PROTO_N };

/* COLL_START/KERNEL/END, P2P_START/KERNEL/END. The three records of one op share `id`. */
typedef struct {
  uint8_t kind;          /*  0 */
  uint8_t flags;         /*  1 CCLD_NP_F_GPU_* / END_* */
  uint8_t op;            /*  2 CCLD_NP_OP_* */
  uint8_t dtype;         /*  3 CCLD_NP_DT_* */
  uint16_t channels;     /*  4 START: nChannels NCCL gave (0: not given); KERNEL: that channel's id;
                                END: kernel channels that stopped */
  uint16_t proxy_ops;    /*  6 END: proxy ops that were its children (saturates at 65535) */
  uint64_t id;           /*  8 op number in this process, from 1 */
  uint64_t comm_hash;    /* 16 NCCL's commHash */
  uint64_t seq;          /* 24 coll: NCCL's seqNumber (per communicator and func); p2p: the n-th op of
                                this direction between this rank and peer on comm, from 1 (our n-th send
                                to peer pairs with peer's n-th receive from us); 0: not numbered */
  uint64_t count;        /* 32 elements */
  uint64_t t_ns;         /* 40 START: started (host); KERNEL: the first kernel channel's start was seen;
                                END: over (0 when END_STALE) */
  uint64_t t_enq_ns;     /* 48 END: NCCL's stopEvent of it (launched/enqueued); else 0 */
  uint64_t gpu_start_ns; /* 56 KERNEL: that channel's start; END: earliest channel start */
  uint64_t gpu_end_ns;   /* 64 END: latest channel stop */
  int32_t peer;          /* 72 p2p: the peer's rank in comm; coll: root (-1 when NCCL gives none) */
  uint8_t algo;          /* 76 CCLD_NP_ALGO_* */
  uint8_t proto;         /* 77 CCLD_NP_PROTO_* */
  uint8_t nwarps;        /* 78 */
  uint8_t reserved;      /* 79 */
} ccld_np_task;

typedef struct {
  uint8_t kind;       /*  0 CCLD_NP_COMM */
  uint8_t flags;      /*  1 CCLD_NP_F_FROM_INIT */
  uint16_t reserved2; /*  2 */
  uint32_t reserved4; /*  4 */
  uint64_t id;        /*  8 the plugin's number for this communicator, from 1 */
  uint64_t comm_hash; /* 16 */
  int32_t rank;       /* 24 this process's rank in it */
  int32_t nranks;     /* 28 -1: not known (v1-v3) */
  int32_t nnodes;     /* 32 -1: not known (v1-v3) */
  int32_t reserved;   /* 36 */
  uint64_t t_ns;      /* 40 when the plugin saw it first */
  uint8_t pad[32];    /* 48 */
} ccld_np_comm;

/* One link: (comm_hash, peer, channel, direction), over the flush interval ending at the datagram's
   sent_ns. Sent for every link that moved in the interval or has steps in flight. */
typedef struct {
  uint8_t kind;         /*  0 CCLD_NP_PROGRESS */
  uint8_t flags;        /*  1 CCLD_NP_F_SEND */
  uint16_t channel;     /*  2 NCCL channel */
  uint32_t in_flight;   /*  4 proxy steps started and not stopped, at the end of the interval */
  uint64_t id;          /*  8 the flush interval's number, from 1 */
  uint64_t comm_hash;   /* 16 */
  int32_t peer;         /* 24 the peer's rank in comm */
  uint32_t proxy_ops;   /* 28 proxy ops (NCCL's per-channel work items) started in the interval */
  uint64_t nbytes;      /* 32 bytes of the steps completed in the interval (v4+: per step; v1-v3: from
                                the proxy op's running total) */
  uint64_t steps;       /* 40 proxy steps completed in the interval */
  uint64_t net_wait_ns; /* 48 summed over steps: time in a network state (send: peer credit wait, send
                                wait; recv: recv wait) */
  uint64_t gpu_wait_ns; /* 56 ... in a GPU state (send: GPU wait; recv: flush wait, GPU wait) */
  uint64_t last_ns;     /* 64 host ns a step or proxy op of this link last moved (ever), 0: never */
  uint8_t pad[8];       /* 72 */
} ccld_np_progress;

#endif
