/* ccld_profiler.c: libnccl-profiler-ccld.so, ccld's NCCL profiler plugin (NCCL >= 2.23).
 *
 * What: NCCL (NCCL_PROFILER_PLUGIN=<this file>) takes the newest ncclProfiler_vN table it knows; this
 * library exports v1..v5 (NCCL 2.23: v1, 2.24: v2, 2.25-2.26: v3, 2.27: v4, 2.28+: v5 -- 2.29's v6 falls
 * back to v5). The five tables translate NCCL's descriptors into one core, which records
 *   - per collective / send / receive: its start (host), a prompt record when its first kernel channel
 *     starts, its end (host) and the kernel's GPU timestamps where the version gives them;
 *   - per communicator: commHash, rank, nranks, nNodes, once;
 *   - per link (commHash, peer, channel, direction): what the proxy's network steps did over each flush
 *     interval (bytes, steps, time waiting on the network vs on the GPU, steps in flight), summed here.
 * A thread started at the first init sends them every CCLD_NCCLPROF_FLUSH_MS (100) ms as datagrams
 * (ccld_profiler.h) to the AF_UNIX datagram socket CCLD_NCCLPROF_ENDPOINT, never blocking: a refused
 * send is counted, not retried. CCLD_NCCLPROF_CHAIN names another profiler plugin that gets every call
 * too (the user's own NCCL_PROFILER_PLUGIN, which `ccld run` moves there).
 *
 * Units and clocks: host times CLOCK_MONOTONIC ns; GPU times are NCCL's kernel timestamps (%globaltimer
 * ns), kept raw.
 *
 * Threads: NCCL calls startEvent/stopEvent/recordEventState from the application thread (coll, p2p) and
 * its proxy threads (proxyOp, proxyStep, kernelCh). Each call does bounded work and never waits for
 * another thread: handles come from fixed pools through lock-free rings of free indices (FIFO, so a
 * freed handle is reused as late as possible: NCCL passes a parent's handle to children after it has
 * stopped it), a parent's progress is one atomic word, records go onto a bounded lock-free ring (Vyukov's
 * MPMC queue), link sums are atomics in a fixed open-addressed table. A full queue, an empty pool or a
 * full table is a counted drop. Nothing is allocated after the first init.
 *
 * Failure: any failure (allocation, thread start, a call NCCL cannot make) turns the plugin off with one
 * line on stderr, "ccld: NCCL profiler plugin off: <why>"; from then on every call returns ncclSuccess
 * (0), handles already given are still taken back and the chained plugin still gets every call.
 *
 * Caveat: NCCL's stopEvent of a collective only means "enqueued" (plugins/profiler/README.md, "Profiling
 * of collective and p2p operations"). When it is over is decided here from its children: see task_stop().
 * This file has not run under a real NCCL on a GPU yet; tests/unit/test_ncclprof_plugin.py drives each
 * table with descriptors laid out as NCCL's headers define them.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "ccld_profiler.h"

#ifndef CCLD_NP_SOURCE_SHA256
#define CCLD_NP_SOURCE_SHA256 "" /* build.py passes this file's SHA-256, so Python can tell a stale build */
#endif

_Static_assert(sizeof(ccld_np_header) == CCLD_NP_HEADER_SIZE, "header size");
_Static_assert(sizeof(ccld_np_task) == CCLD_NP_RECORD_SIZE, "task record size");
_Static_assert(sizeof(ccld_np_comm) == CCLD_NP_RECORD_SIZE, "comm record size");
_Static_assert(sizeof(ccld_np_progress) == CCLD_NP_RECORD_SIZE, "progress record size");
_Static_assert(offsetof(ccld_np_task, peer) == 72 && offsetof(ccld_np_progress, last_ns) == 64, "record layout");

/* ---- tunables ---------------------------------------------------------------------------------- */
#define FLUSH_MS_DEFAULT 100   /* CCLD_NCCLPROF_FLUSH_MS: how often the thread sends (1..60000) */
#define QUEUE_DEFAULT 16384    /* CCLD_NCCLPROF_QUEUE: records held between flushes (power of 2, 16..2^20):
                                  ~1.4 MiB; 160k records/s at 100 ms */
#define HANDLES_DEFAULT 8192   /* CCLD_NCCLPROF_HANDLES: coll/p2p/kernel-channel events open at once (16..2^20) */
#define OPS_PER_HANDLES 2      /* proxy-op handles = handles / 2, each with STEP_CELLS step handles */
#define LINKS 8192             /* link sums + p2p counters kept (power of 2); ~1 MiB */
#define LINK_PROBES 32         /* open addressing: slots tried before a key counts as dropped */
#define STEP_CELLS 8           /* NCCL_STEPS: NCCL keeps a proxy op's step handles at [step % 8] */
#define CTX_MAX 1024           /* communicators open at once */
#define HEARTBEAT_MS 1000      /* a datagram at least this often, records or not: a quiet rank vs a dead plugin */
#define QUIET_INTERVALS 1      /* an op whose children all stopped ends once none started for this long: NCCL's
                                  proxy sees a kernel's channels start one by one, so channel 1 may start
                                  after channel 0 of a tiny op already stopped */
#define GRACE_INTERVALS 10     /* no-kernel-event versions: an enqueued op with no child after this many
                                  flushes ends "enqueue only" (proxy ops start within ms when they come) */
#define STALE_INTERVALS 3000   /* v3+: an enqueued op no kernel channel ever started for this many flushes
                                  (5 min) ends "stale" and its handle is taken back */
#define JOIN_WAIT_MS 2000      /* the last finalize waits at most this long for the thread's "bye" */

/* ---- NCCL's side, declared from its published headers (plugins/profiler/example/nccl/) ----------- */
typedef int nccl_result; /* ncclResult_t; only ncclSuccess (0) is ever returned */
typedef void (*nccl_logger)(int level, unsigned long flags, const char* file, int line, const char* fmt, ...);

enum { /* event types (descriptor .type, activation mask bits) */
  EV_GROUP = 1 << 0, EV_COLL = 1 << 1, EV_P2P = 1 << 2, EV_PROXY_OP = 1 << 3, EV_PROXY_STEP = 1 << 4,
  EV_PROXY_CTRL = 1 << 5, EV_KERNEL_CH = 1 << 6, EV_NET_PLUGIN = 1 << 7, EV_GROUP_API = 1 << 8,
  EV_COLL_API = 1 << 9, EV_P2P_API = 1 << 10, EV_KERNEL_LAUNCH = 1 << 11,
};
enum { /* event states (recordEventState) this plugin reads */
  ST_STEP_SEND_GPU_WAIT = 8, ST_STEP_SEND_WAIT = 9, ST_STEP_RECV_WAIT = 10, ST_STEP_RECV_FLUSH_WAIT = 11,
  ST_STEP_RECV_GPU_WAIT = 12, ST_OP_IN_PROGRESS_V4 = 19, ST_STEP_SEND_PEER_WAIT_V4 = 20, ST_KERNEL_CH_STOP = 22,
};
#define OP_STATE_LAST_V1 7 /* proxyOp states 0..7 (SendPosted .. RecvDone) carry the op's running transSize (v1-v3) */

struct d_proxy_op { pid_t pid; uint8_t channel; int peer; int nsteps; int chunk_size; int is_send; };
struct d_proxy_step { int step; };
struct d_net_plugin { int64_t id; void* data; };
struct d2_p2p { const char* name; uint64_t comm_hash; const char* func; void* buf; const char* dtype; size_t count; int peer; };
/* v2 and v3 differ only in v2's trafficBytes */
#define D23_COLL_HEAD const char* name; uint64_t comm_hash; uint64_t seq; const char* func; const void* sendbuf; \
  void* recvbuf; size_t count; int root; const char* dtype;
#define D23_COLL_TAIL uint8_t max_channels; uint8_t nwarps; const char* algo; const char* proto;

struct descr_v1 {
  uint8_t type; void* parent; int rank;
  union {
    struct { const char* name; uint64_t comm_hash; uint64_t seq; uint8_t func; const void* sendbuf; void* recvbuf;
             size_t count; int root; uint8_t dtype; uint32_t redop; size_t traffic_bytes; uint8_t max_channels;
             uint8_t nwarps; uint8_t algo; uint8_t proto; int is_collnet; int is_nvls; } coll;
    struct { const char* name; uint64_t comm_hash; uint8_t func; void* buf; uint8_t dtype; size_t count; int peer; } p2p;
    struct d_proxy_op proxy_op;
    struct d_proxy_step proxy_step;
  };
};
struct descr_v2 {
  uint8_t type; void* parent; int rank;
  union {
    struct { D23_COLL_HEAD size_t traffic_bytes; D23_COLL_TAIL } coll;
    struct d2_p2p p2p;
    struct d_proxy_op proxy_op;
    struct d_proxy_step proxy_step;
  };
};
struct descr_v3 {
  uint8_t type; void* parent; int rank;
  union {
    struct { D23_COLL_HEAD D23_COLL_TAIL } coll;
    struct d2_p2p p2p;
    struct d_proxy_op proxy_op;
    struct d_proxy_step proxy_step;
    struct { uint8_t channel; } kernel_ch;
    struct d_net_plugin net;
  };
};
struct descr_v4 {
  uint8_t type; void* parent; int rank;
  union {
    struct { uint64_t seq; const char* func; const void* sendbuf; void* recvbuf; size_t count; int root;
             const char* dtype; uint8_t nchannels; uint8_t nwarps; const char* algo; const char* proto; } coll;
    struct { const char* func; void* buf; const char* dtype; size_t count; int peer; uint8_t nchannels; } p2p;
    struct d_proxy_op proxy_op;
    struct d_proxy_step proxy_step;
    struct { uint8_t channel; uint64_t ptimer; } kernel_ch;
    struct d_net_plugin net;
  };
};
struct descr_v5 {
  uint64_t type; void* parent; int rank;
  union {
    struct { bool graph_captured; int group_depth; } group_api;
    struct { const char* func; size_t count; const char* dtype; int root; void* stream; bool graph_captured; } coll_api;
    struct { const char* func; size_t count; const char* dtype; void* stream; bool graph_captured; } p2p_api;
    struct { void* stream; } kernel_launch;
    struct { uint64_t seq; const char* func; const void* sendbuf; void* recvbuf; size_t count; int root;
             const char* dtype; uint8_t nchannels; uint8_t nwarps; const char* algo; const char* proto;
             void* parent_group; } coll;
    struct { const char* func; void* buf; const char* dtype; size_t count; int peer; uint8_t nchannels;
             void* parent_group; } p2p;
    struct d_proxy_op proxy_op;
    struct d_proxy_step proxy_step;
    struct { uint8_t channel; uint64_t ptimer; } kernel_ch;
    struct d_net_plugin net;
  };
};
union args_v1 { /* v1..v3 */
  struct { size_t trans_size; int steps; } proxy_op;
  struct { int appended; } proxy_ctrl;
};
union args_v4 { /* v4, v5 */
  struct { size_t trans_size; } proxy_step;
  struct { int appended; } proxy_ctrl;
  struct { void* data; } net;
  struct { uint64_t ptimer; } kernel_ch;
};
/* sizes computed by hand from NCCL's headers (x86-64 / aarch64 LP64): a typo above fails the build */
_Static_assert(sizeof(struct descr_v1) == 120 && offsetof(struct descr_v1, coll.root) == 80, "descr_v1");
_Static_assert(sizeof(struct descr_v2) == 128 && offsetof(struct descr_v2, coll.proto) == 120, "descr_v2");
_Static_assert(sizeof(struct descr_v3) == 120 && offsetof(struct descr_v3, coll.proto) == 112, "descr_v3");
_Static_assert(sizeof(struct descr_v4) == 104 && offsetof(struct descr_v4, kernel_ch.ptimer) == 32, "descr_v4");
_Static_assert(sizeof(struct descr_v5) == 112 && offsetof(struct descr_v5, coll.parent_group) == 104, "descr_v5");
_Static_assert(sizeof(union args_v1) == 16 && sizeof(union args_v4) == 8, "state args");

/* The function tables. Parameters NCCL types as descriptor/args pointers are void* here: the same ABI. */
typedef nccl_result (*start_fn)(void* context, void** handle, void* descr);
typedef nccl_result (*stop_fn)(void* handle);
typedef nccl_result (*record_fn)(void* handle, int state, void* args);
typedef nccl_result (*finalize_fn)(void* context);
typedef nccl_result (*init_v1_fn)(void** context, int* mask);
typedef nccl_result (*init_v4_fn)(void** context, int* mask, const char* name, uint64_t comm_hash, int nnodes,
                                  int nranks, int rank, nccl_logger log);
typedef nccl_result (*init_v5_fn)(void** context, uint64_t comm_id, int* mask, const char* name, int nnodes,
                                  int nranks, int rank, nccl_logger log);
typedef struct { const char* name; void* init; start_fn start; stop_fn stop; record_fn record; finalize_fn finalize; } table_any;
typedef struct { const char* name; init_v1_fn init; start_fn start; stop_fn stop; record_fn record; finalize_fn finalize; } table_v1;
typedef struct { const char* name; init_v4_fn init; start_fn start; stop_fn stop; record_fn record; finalize_fn finalize; } table_v4;
typedef struct { const char* name; init_v5_fn init; start_fn start; stop_fn stop; record_fn record; finalize_fn finalize; } table_v5;

/* Which event types NCCL emits for a mask bit: the bit's own and its ancestors' (NCCL captures every
   event above a requested one). Used to give the chained plugin only what it would have got alone. */
static int wanted_by(int mask, int type) {
  const int below_task = EV_PROXY_OP | EV_PROXY_STEP | EV_KERNEL_CH | EV_NET_PLUGIN;
  int implies = type;
  switch (type) {
    case EV_GROUP: implies |= EV_COLL | EV_P2P | below_task; break;
    case EV_COLL: case EV_P2P: case EV_COLL_API: case EV_P2P_API: implies |= below_task;
      if (type == EV_COLL_API) implies |= EV_COLL;
      if (type == EV_P2P_API) implies |= EV_P2P;
      break;
    case EV_PROXY_OP: implies |= EV_PROXY_STEP | EV_NET_PLUGIN; break;
    case EV_PROXY_STEP: implies |= EV_NET_PLUGIN; break;
    case EV_GROUP_API: implies = ~0; break;
    default: break;
  }
  return (mask & implies) != 0;
}

/* ---- the id tables (ccld_profiler.h) ------------------------------------------------------------ */
static const char* const OP_NAMES[CCLD_NP_OP_N] = {
  NULL, "Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce", "SendRecv", "Send", "Recv",
  "AlltoAll", "Scatter", "Gather", "AllGatherV", "PutSignal", "Signal", "WaitSignal"};
static const char* const DT_NAMES[CCLD_NP_DT_N] = {
  NULL, "ncclInt8", "ncclUint8", "ncclInt32", "ncclUint32", "ncclInt64", "ncclUint64", "ncclFloat16",
  "ncclFloat32", "ncclFloat64", "ncclBfloat16", "ncclFloat8e4m3", "ncclFloat8e5m2"};
static const char* const ALGO_NAMES[CCLD_NP_ALGO_N] = {
  NULL, "TREE", "RING", "COLLNET_DIRECT", "COLLNET_CHAIN", "NVLS", "NVLS_TREE", "PAT"};
static const char* const PROTO_NAMES[CCLD_NP_PROTO_N] = {NULL, "LL", "LL128", "SIMPLE"};

/* NCCL passes pointers to its static strings: at most ~15 short compares per event */
static uint8_t id_of(const char* s, const char* const* names, int n) {
  if (s == NULL) return 0;
  for (int i = 1; i < n; i++)
    if (strcmp(s, names[i]) == 0) return (uint8_t)i;
  return 0;
}
static uint8_t id_from_nccl(unsigned v, int n) { return v + 1 < (unsigned)n ? (uint8_t)(v + 1) : 0; }

/* ---- small helpers ------------------------------------------------------------------------------ */
static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
static void atomic_max_u64(_Atomic uint64_t* a, uint64_t v) {
  uint64_t cur = atomic_load_explicit(a, memory_order_relaxed);
  while (cur < v && !atomic_compare_exchange_weak_explicit(a, &cur, v, memory_order_relaxed, memory_order_relaxed)) {}
}
static void atomic_min_nonzero_u64(_Atomic uint64_t* a, uint64_t v) { /* 0 = none yet */
  uint64_t cur = atomic_load_explicit(a, memory_order_relaxed);
  while ((cur == 0 || v < cur) &&
         !atomic_compare_exchange_weak_explicit(a, &cur, v, memory_order_relaxed, memory_order_relaxed)) {}
}

/* ---- counters and state ------------------------------------------------------------------------- */
static _Atomic uint64_t c_drop_queue, c_drop_handles, c_drop_datagrams, c_drop_sent_records, c_drop_links, c_orphans;
static atomic_int g_last_errno;
static atomic_int g_on;          /* 1: recording. 0: off (never recording again in this process) */
static atomic_int g_said_off;    /* the one stderr line was written */
static char g_off_reason[256];   /* written once, before g_on drops to 0 */
static _Atomic uint64_t g_next_id = 1;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER; /* init / finalize / thread start and stop only */
static int g_configured, g_api, g_mask, g_flush_ms = FLUSH_MS_DEFAULT, g_rank = -1;
static pid_t g_pid;
static struct sockaddr_un g_addr;
static socklen_t g_addrlen;     /* 0: no endpoint */
static int g_fd = -1;
static const table_any* g_chain; /* the chained plugin's table of the version NCCL picked, or NULL */

static void say_off(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
static void say_off(const char* fmt, ...) {
  if (atomic_exchange(&g_said_off, 1)) return; /* one line, once */
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_off_reason, sizeof g_off_reason, fmt, ap);
  va_end(ap);
  atomic_store(&g_on, 0); /* the thread notices at its next wake, sends what it holds and an "off" datagram */
  fprintf(stderr, "ccld: NCCL profiler plugin off: %s\n", g_off_reason);
}
static bool on(void) { return atomic_load_explicit(&g_on, memory_order_acquire) != 0; }

/* ---- bounded lock-free rings (Vyukov's MPMC queue): the record queue and the free-handle lists ---- */
struct ring {
  size_t mask, stride, elem;
  unsigned char* cells; /* per cell: an atomic sequence number, then elem bytes */
  _Alignas(64) atomic_size_t tail;
  _Alignas(64) atomic_size_t head;
};
static atomic_size_t* cell_seq(struct ring* r, size_t i) { return (atomic_size_t*)(r->cells + (i & r->mask) * r->stride); }
static void* cell_data(struct ring* r, size_t i) { return r->cells + (i & r->mask) * r->stride + sizeof(atomic_size_t); }

static bool ring_init(struct ring* r, size_t cap, size_t elem) { /* cap: a power of 2 */
  r->mask = cap - 1;
  r->elem = elem;
  r->stride = (sizeof(atomic_size_t) + elem + 7) & ~(size_t)7;
  r->cells = calloc(cap, r->stride);
  if (r->cells == NULL) return false;
  for (size_t i = 0; i < cap; i++) atomic_init(cell_seq(r, i), i);
  atomic_init(&r->tail, 0);
  atomic_init(&r->head, 0);
  return true;
}
/* Claim the cell at *cursor once its sequence number says it is ready: pos + 0 (free, for a producer) or
   pos + 1 (written, for a consumer). False: full (producer) or empty / still being written (consumer). */
static bool ring_claim(struct ring* r, atomic_size_t* cursor, size_t ready, size_t* out) {
  size_t pos = atomic_load_explicit(cursor, memory_order_relaxed);
  for (;;) {
    size_t seq = atomic_load_explicit(cell_seq(r, pos), memory_order_acquire);
    intptr_t dif = (intptr_t)seq - (intptr_t)(pos + ready);
    if (dif == 0) {
      if (atomic_compare_exchange_weak_explicit(cursor, &pos, pos + 1, memory_order_relaxed, memory_order_relaxed)) break;
    } else if (dif < 0) {
      return false;
    } else {
      pos = atomic_load_explicit(cursor, memory_order_relaxed);
    }
  }
  *out = pos;
  return true;
}
static bool ring_push(struct ring* r, const void* src) { /* false: full */
  size_t pos;
  if (!ring_claim(r, &r->tail, 0, &pos)) return false;
  memcpy(cell_data(r, pos), src, r->elem);
  atomic_store_explicit(cell_seq(r, pos), pos + 1, memory_order_release); /* written: a consumer may take it */
  return true;
}
static bool ring_pop(struct ring* r, void* dst) { /* false: empty */
  size_t pos;
  if (!ring_claim(r, &r->head, 1, &pos)) return false;
  memcpy(dst, cell_data(r, pos), r->elem);
  atomic_store_explicit(cell_seq(r, pos), pos + r->mask + 1, memory_order_release); /* free for the next lap */
  return true;
}

typedef union {
  ccld_np_task task;
  ccld_np_comm comm;
  ccld_np_progress progress;
  unsigned char raw[CCLD_NP_RECORD_SIZE];
} np_record;
static struct ring g_queue;
static size_t g_queue_cap = QUEUE_DEFAULT;

static void push_any(const np_record* r) {
  if (!ring_push(&g_queue, r)) atomic_fetch_add_explicit(&c_drop_queue, 1, memory_order_relaxed);
}
static void push(const np_record* r) { /* NCCL's threads: nothing new once off */
  if (on()) push_any(r);
}

/* ---- communicators -------------------------------------------------------------------------------- */
struct ctx {
  int used;                  /* under g_mu */
  int version;
  uint64_t id;
  _Atomic uint64_t comm_hash; /* v4+: from init; v1-v3: from the first coll/p2p descriptor */
  atomic_int announced;      /* the COMM record was queued */
  int mask;                  /* the activation mask given to NCCL at this init (ours | chained) */
  int chain_mask;
  void* chain_ctx;           /* the chained plugin's context; NULL: not chained for this comm */
};
static struct ctx g_ctx[CTX_MAX];
static int g_active;        /* communicators initialized and not finalized (under g_mu) */
static uint64_t g_ctx_ids;

static struct ctx* ctx_of(void* context) { /* NULL: not one of ours */
  uintptr_t p = (uintptr_t)context, base = (uintptr_t)g_ctx;
  if (p < base || p >= base + sizeof g_ctx || (p - base) % sizeof(struct ctx)) return NULL;
  return context;
}
static void announce(struct ctx* c, uint64_t hash, int rank, int nranks, int nnodes, bool from_init) {
  if (atomic_exchange(&c->announced, 1)) return;
  np_record r;
  memset(&r, 0, sizeof r);
  r.comm.kind = CCLD_NP_COMM;
  r.comm.flags = from_init ? CCLD_NP_F_FROM_INIT : 0;
  r.comm.id = c->id;
  r.comm.comm_hash = hash;
  r.comm.rank = rank;
  r.comm.nranks = nranks;
  r.comm.nnodes = nnodes;
  r.comm.t_ns = now_ns();
  push(&r);
}

/* ---- handles -------------------------------------------------------------------------------------
 * Three kinds of handle NCCL gets from us, all addresses inside two fixed pools, so a handle is ours iff
 * it lies in a pool at an element boundary (anything else is the chained plugin's, passed through):
 *   struct task  (g_tasks): a coll or p2p, or a kernel channel (kind K_KCH);
 *   struct op    (g_ops):   a proxy op, with STEP_CELLS step cells inside it -- a step's handle is its
 *                           cell, so steps (the busiest events) need no allocation at all. */
enum { K_FREE = 0, K_COLL, K_P2P, K_KCH };

/* task.st: the progress of a coll/p2p, one atomic word. Free slots and kernel channels hold T_DONE, so
   a late child that names them as parent is refused (an orphan). */
#define T_LIVE 0xffffffffull     /* children started and not stopped */
#define T_ANY_CHILD (1ull << 32) /* a child has started */
#define T_STOPPED (1ull << 33)   /* NCCL's stopEvent of it came: enqueued */
#define T_DONE (1ull << 34)      /* its END was queued (or it is not a task) */
#define T_WAIT_CHILD (1ull << 35) /* kernel channels will come (v3+ with kernelCh on): never "enqueue only" */

struct task {
  _Atomic uint64_t st;
  uint8_t kind, op, dtype, algo, proto, nwarps;
  uint16_t nchannels;         /* coll/p2p: NCCL's; kernel channel: its channel id */
  int32_t peer;               /* p2p: peer; coll: root */
  void* chain;                /* the chained plugin's handle of this event */
  struct task* parent;        /* kernel channel: its coll/p2p (or NULL) */
  uint64_t id, comm, seq, count, t_start, gpu_stop;
  _Atomic uint64_t t_enq, t_last_child, gpu_start, gpu_end;
  atomic_uint n_kernel, n_proxy, kernel_seen;
};
struct link;
struct cell { void* chain; uint64_t t_state, trans; uint8_t busy, state; };
struct op {
  void* chain;
  struct task* parent;
  struct link* link;
  uint64_t last_trans; /* v1-v3: the op's running transSize already summed */
  struct cell cells[STEP_CELLS];
};
static struct task* g_tasks;
static struct op* g_ops;
static size_t g_ntasks = HANDLES_DEFAULT, g_nops;
static struct ring g_free_tasks, g_free_ops;

enum { H_RAW = 0, H_BAD, H_TASK, H_OP, H_CELL };
static int classify(const void* h) {
  uintptr_t p = (uintptr_t)h, tasks = (uintptr_t)g_tasks, ops = (uintptr_t)g_ops;
  if (g_tasks && p >= tasks && p < tasks + g_ntasks * sizeof(struct task))
    return (p - tasks) % sizeof(struct task) ? H_BAD : H_TASK;
  if (g_ops && p >= ops && p < ops + g_nops * sizeof(struct op)) {
    size_t rem = (p - ops) % sizeof(struct op);
    if (rem == 0) return H_OP;
    if (rem >= offsetof(struct op, cells) && (rem - offsetof(struct op, cells)) % sizeof(struct cell) == 0) return H_CELL;
    return H_BAD;
  }
  return H_RAW;
}
static struct op* op_of_cell(const void* cell) {
  return &g_ops[(size_t)((const char*)cell - (const char*)g_ops) / sizeof(struct op)];
}

static struct task* task_alloc(void) {
  uint32_t i;
  if (!ring_pop(&g_free_tasks, &i)) { atomic_fetch_add_explicit(&c_drop_handles, 1, memory_order_relaxed); return NULL; }
  struct task* t = &g_tasks[i];
  t->chain = NULL;
  t->parent = NULL;
  return t;
}
static void task_free(struct task* t) {
  uint32_t i = (uint32_t)(t - g_tasks);
  t->kind = K_FREE;
  atomic_store_explicit(&t->st, T_DONE, memory_order_release);
  ring_push(&g_free_tasks, &i); /* cannot be full: it has room for every index */
}
static struct op* op_alloc(void) {
  uint32_t i;
  if (!ring_pop(&g_free_ops, &i)) { atomic_fetch_add_explicit(&c_drop_handles, 1, memory_order_relaxed); return NULL; }
  struct op* o = &g_ops[i];
  memset(o, 0, sizeof *o);
  return o;
}
static void op_free(struct op* o) {
  uint32_t i = (uint32_t)(o - g_ops);
  ring_push(&g_free_ops, &i);
}

/* The chained plugin's handle for a parent we may have wrapped. */
static void* chain_handle_of(void* h) {
  switch (classify(h)) {
    case H_TASK: return ((struct task*)h)->chain;
    case H_OP: return ((struct op*)h)->chain;
    case H_CELL: return ((struct cell*)h)->chain;
    case H_BAD: return NULL;
    default: return h;
  }
}

/* ---- links: per (comm, peer, channel, direction) sums, and per (comm, peer, direction) p2p counters -- */
enum { L_PROGRESS = 1, L_P2P = 2 };
struct link {
  _Atomic uint64_t key;   /* a hash of the fields below, never 0; 0 = empty */
  atomic_int ready;       /* the fields below are written */
  uint8_t kind, send;
  uint16_t channel;
  int32_t peer;
  uint64_t comm;
  _Atomic uint64_t nbytes, steps, net_ns, gpu_ns, ops, last_ns; /* L_P2P: nbytes is the counter */
  _Atomic int64_t in_flight;
};
static struct link* g_links;

static uint64_t mix64(uint64_t x) { /* splitmix64's finalizer */
  x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27; x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
static struct link* link_get(int kind, uint64_t comm, int32_t peer, uint16_t channel, bool send) {
  uint64_t key = mix64(comm ^ mix64(((uint64_t)(uint32_t)peer << 24) ^ ((uint64_t)channel << 8) ^
                                    ((uint64_t)send << 4) ^ (uint64_t)kind)) | 1;
  for (unsigned probe = 0; probe < LINK_PROBES; probe++) {
    struct link* l = &g_links[(key + probe) & (LINKS - 1)];
    uint64_t k = atomic_load_explicit(&l->key, memory_order_acquire);
    if (k == 0) {
      if (atomic_compare_exchange_strong_explicit(&l->key, &k, key, memory_order_acq_rel, memory_order_acquire)) {
        l->kind = (uint8_t)kind; l->send = send; l->channel = channel; l->peer = peer; l->comm = comm;
        atomic_store_explicit(&l->ready, 1, memory_order_release);
        return l;
      }
    }
    if (k != key) continue;
    if (!atomic_load_explicit(&l->ready, memory_order_acquire)) return l; /* being written: same key */
    if (l->kind == kind && l->comm == comm && l->peer == peer && l->channel == channel && l->send == send) return l;
  }
  atomic_fetch_add_explicit(&c_drop_links, 1, memory_order_relaxed);
  return NULL;
}

/* ---- the core: what one event does ------------------------------------------------------------------ */
struct nev { /* a descriptor, whatever its version */
  int type, rank;
  void* parent;
  uint64_t comm_hash; /* v1-v3 coll/p2p; 0 otherwise */
  uint64_t seq, count, ptimer;
  int peer_or_root, pid, is_send, step;
  uint8_t op, dtype, algo, proto, nchannels, nwarps, channel;
  bool has_ptimer;
};

static void task_record(struct task* t, int kind, uint8_t flags, uint64_t t_ns, uint64_t t_enq, np_record* r) {
  memset(r, 0, sizeof *r);
  r->task.kind = (uint8_t)kind;
  r->task.flags = flags;
  r->task.op = t->op;
  r->task.dtype = t->dtype;
  r->task.channels = t->nchannels;
  r->task.id = t->id;
  r->task.comm_hash = t->comm;
  r->task.seq = t->seq;
  r->task.count = t->count;
  r->task.t_ns = t_ns;
  r->task.t_enq_ns = t_enq;
  r->task.peer = t->peer;
  r->task.algo = t->algo;
  r->task.proto = t->proto;
  r->task.nwarps = t->nwarps;
}

/* The op is over: queue its END and take the handle back. Called by the sender thread (reap), which set
   T_DONE, exactly once. */
static void complete(struct task* t, uint64_t t_end, uint8_t how) {
  np_record r;
  uint64_t gs = atomic_load(&t->gpu_start), ge = atomic_load(&t->gpu_end);
  unsigned np = atomic_load(&t->n_proxy);
  task_record(t, t->kind == K_COLL ? CCLD_NP_COLL_END : CCLD_NP_P2P_END,
              (uint8_t)(how | (gs ? CCLD_NP_F_GPU_START : 0) | (ge ? CCLD_NP_F_GPU_END : 0)),
              t_end, atomic_load(&t->t_enq), &r);
  r.task.channels = (uint16_t)atomic_load(&t->n_kernel);
  r.task.proxy_ops = (uint16_t)(np > 0xffff ? 0xffff : np);
  r.task.gpu_start_ns = gs;
  r.task.gpu_end_ns = ge;
  push_any(&r); /* also in the last flush after the plugin went off: the op was over before */
  task_free(t);
}

static struct task* task_start(struct ctx* c, const struct nev* e) {
  struct task* t = task_alloc();
  if (t == NULL) return NULL;
  bool p2p = e->type == EV_P2P;
  uint64_t comm = e->comm_hash ? e->comm_hash : atomic_load_explicit(&c->comm_hash, memory_order_relaxed);
  if (e->comm_hash && c->version <= 3) { /* v1-v3: the communicator is known from its first op */
    uint64_t zero = 0;
    atomic_compare_exchange_strong(&c->comm_hash, &zero, e->comm_hash);
    announce(c, e->comm_hash, e->rank, -1, -1, false);
  }
  t->kind = p2p ? K_P2P : K_COLL;
  t->op = e->op; t->dtype = e->dtype; t->algo = e->algo; t->proto = e->proto; t->nwarps = e->nwarps;
  t->nchannels = e->nchannels;
  t->peer = e->peer_or_root;
  t->id = atomic_fetch_add_explicit(&g_next_id, 1, memory_order_relaxed);
  t->comm = comm;
  t->count = e->count;
  t->seq = e->seq;
  if (p2p) { /* the n-th op of this direction with this peer on this communicator */
    struct link* l = link_get(L_P2P, comm, e->peer_or_root, 0, e->op == CCLD_NP_OP_SEND);
    t->seq = l ? atomic_fetch_add_explicit(&l->nbytes, 1, memory_order_relaxed) + 1 : 0;
  }
  t->t_start = now_ns();
  atomic_store_explicit(&t->t_enq, 0, memory_order_relaxed);
  atomic_store_explicit(&t->t_last_child, 0, memory_order_relaxed);
  atomic_store_explicit(&t->gpu_start, 0, memory_order_relaxed);
  atomic_store_explicit(&t->gpu_end, 0, memory_order_relaxed);
  atomic_store_explicit(&t->n_kernel, 0, memory_order_relaxed);
  atomic_store_explicit(&t->n_proxy, 0, memory_order_relaxed);
  atomic_store_explicit(&t->kernel_seen, 0, memory_order_relaxed);
  /* NCCL adds a kernel-channel proxy op only for work with steps: an empty op may never get one, and
     neither does a send or receive to the rank itself (a local copy, no proxy op: NCCL's enqueue) */
  bool to_self = p2p && e->peer_or_root == e->rank;
  bool kernels_come = c->version >= 3 && (c->mask & EV_KERNEL_CH) && e->count > 0 && !to_self;
  atomic_store_explicit(&t->st, kernels_come ? T_WAIT_CHILD : 0, memory_order_release);
  np_record r;
  task_record(t, p2p ? CCLD_NP_P2P_START : CCLD_NP_COLL_START, 0, t->t_start, 0, &r);
  push(&r);
  return t;
}

/* When is a collective (or send, receive) over? NCCL's stopEvent of it only says it was enqueued; the
 * child events tell the rest (README, "Profiling of collective and p2p operations"): a kernel channel
 * (v3+, ncclProfileKernelCh) stops when the GPU finished that channel's work, a proxy op when the proxy
 * finished its network part. So: it is over when NCCL has stopped it AND every child that started has
 * stopped AND at least one child came -- at the host time the last child stopped (END_CHILDREN). NCCL
 * does not say how many children will come (nChannels is not the count on every path), and its proxy
 * sees a kernel's channels start one poll at a time, so "all stopped" is only believed after
 * QUIET_INTERVALS without a new child; the sender thread decides (reap), NCCL's threads only count.
 * Children start after the stopEvent (the proxy thread sees the kernel run later), so "no child yet"
 * means "not known yet": v3+ with kernel channels on waits for them (a kernel that never starts is
 * exactly what a hang looks like: START without KERNEL); after STALE_INTERVALS it gives the handle back
 * with END_STALE. Without kernel events (v1, v2 or a narrowed mask) and no proxy op within
 * GRACE_INTERVALS (intra-node, no network), the stopEvent time is all there is: END_ENQUEUE. */
static void task_stop(struct task* t) {
  atomic_store_explicit(&t->t_enq, now_ns(), memory_order_relaxed);
  uint64_t cur = atomic_load_explicit(&t->st, memory_order_relaxed);
  do {
    if (cur & (T_DONE | T_STOPPED)) { atomic_fetch_add_explicit(&c_orphans, 1, memory_order_relaxed); return; }
  } while (!atomic_compare_exchange_weak_explicit(&t->st, &cur, cur | T_STOPPED, memory_order_acq_rel,
                                                  memory_order_relaxed));
}

static bool child_attach(struct task* p) {
  uint64_t cur = atomic_load_explicit(&p->st, memory_order_relaxed), nxt;
  do {
    if (cur & T_DONE || (cur & T_LIVE) == T_LIVE) return false;
    nxt = (cur + 1) | T_ANY_CHILD;
  } while (!atomic_compare_exchange_weak_explicit(&p->st, &cur, nxt, memory_order_acq_rel, memory_order_relaxed));
  return true;
}
static void child_done(struct task* p, uint64_t now) {
  atomic_max_u64(&p->t_last_child, now); /* before the release below: reap sees it with live == 0 */
  uint64_t cur = atomic_load_explicit(&p->st, memory_order_relaxed);
  do {
    if ((cur & T_LIVE) == 0 || (cur & T_DONE)) { atomic_fetch_add_explicit(&c_orphans, 1, memory_order_relaxed); return; }
  } while (!atomic_compare_exchange_weak_explicit(&p->st, &cur, cur - 1, memory_order_acq_rel, memory_order_relaxed));
}
static struct task* parent_task(void* parent) { /* our coll/p2p that accepts a child, or NULL */
  if (parent == NULL) return NULL;
  if (classify(parent) != H_TASK) return NULL;
  struct task* p = parent;
  if (!child_attach(p)) { atomic_fetch_add_explicit(&c_orphans, 1, memory_order_relaxed); return NULL; }
  return p;
}

static struct task* kch_start(const struct nev* e) {
  if (e->parent == NULL || classify(e->parent) != H_TASK) return NULL; /* its op is not followed */
  struct task* k = task_alloc();
  if (k == NULL) return NULL;
  struct task* p = parent_task(e->parent);
  if (p == NULL) { task_free(k); return NULL; }
  uint64_t now = now_ns();
  k->kind = K_KCH;
  k->parent = p;
  k->nchannels = e->channel;
  k->gpu_stop = 0;
  atomic_store_explicit(&k->st, T_DONE, memory_order_release);
  if (e->has_ptimer && e->ptimer) atomic_min_nonzero_u64(&p->gpu_start, e->ptimer);
  if (atomic_exchange(&p->kernel_seen, 1) == 0) { /* the prompt record: this op's kernel runs */
    np_record r;
    task_record(p, p->kind == K_COLL ? CCLD_NP_COLL_KERNEL : CCLD_NP_P2P_KERNEL,
                e->has_ptimer && e->ptimer ? CCLD_NP_F_GPU_START : 0, now, 0, &r);
    r.task.channels = e->channel;
    r.task.gpu_start_ns = e->has_ptimer ? e->ptimer : 0;
    push(&r);
  }
  return k;
}
static void kch_stop(struct task* k) {
  struct task* p = k->parent;
  if (p) {
    if (k->gpu_stop) atomic_max_u64(&p->gpu_end, k->gpu_stop);
    atomic_fetch_add_explicit(&p->n_kernel, 1, memory_order_relaxed);
    child_done(p, now_ns());
  }
  task_free(k);
}

static struct op* op_start(struct ctx* c, const struct nev* e) {
  struct op* o = op_alloc();
  if (o == NULL) return NULL;
  uint64_t now = now_ns();
  uint64_t comm = c ? atomic_load_explicit(&c->comm_hash, memory_order_relaxed) : 0;
  /* PXN: an op another process posted; its parent is an address there, not to be followed */
  if (e->pid == g_pid && (o->parent = parent_task(e->parent)) != NULL) {
    atomic_fetch_add_explicit(&o->parent->n_proxy, 1, memory_order_relaxed);
    comm = o->parent->comm;
  }
  o->link = link_get(L_PROGRESS, comm, e->peer_or_root, e->channel, e->is_send != 0);
  if (o->link) {
    atomic_fetch_add_explicit(&o->link->ops, 1, memory_order_relaxed);
    atomic_store_explicit(&o->link->last_ns, now, memory_order_relaxed);
  }
  return o;
}
static void op_record(struct op* o, int state, const union args_v1* a) {
  if (o->link == NULL) return;
  if (g_api <= 3 && a && state >= 0 && state <= OP_STATE_LAST_V1 && a->proxy_op.trans_size > o->last_trans) {
    atomic_fetch_add_explicit(&o->link->nbytes, a->proxy_op.trans_size - o->last_trans, memory_order_relaxed);
    o->last_trans = a->proxy_op.trans_size;
  }
  atomic_store_explicit(&o->link->last_ns, now_ns(), memory_order_relaxed);
}
static void op_stop(struct op* o) {
  for (int i = 0; i < STEP_CELLS; i++) /* steps NCCL never stopped: no longer in flight */
    if (o->cells[i].busy && o->link) atomic_fetch_sub_explicit(&o->link->in_flight, 1, memory_order_relaxed);
  if (o->parent) child_done(o->parent, now_ns());
  op_free(o);
}

/* A step's time in a state goes to the network or the GPU (ncclProfilerProxyStep* states). */
static void step_account(struct link* l, struct cell* s, uint64_t now) {
  uint64_t dt = now > s->t_state ? now - s->t_state : 0;
  switch (s->state) {
    case ST_STEP_SEND_WAIT: case ST_STEP_RECV_WAIT: case ST_STEP_SEND_PEER_WAIT_V4:
      atomic_fetch_add_explicit(&l->net_ns, dt, memory_order_relaxed); break;
    case ST_STEP_SEND_GPU_WAIT: case ST_STEP_RECV_GPU_WAIT: case ST_STEP_RECV_FLUSH_WAIT:
      atomic_fetch_add_explicit(&l->gpu_ns, dt, memory_order_relaxed); break;
    default: break; /* before its first state */
  }
}
static struct cell* step_start(const struct nev* e) {
  if (e->parent == NULL || classify(e->parent) != H_OP) return NULL; /* its op is not followed */
  struct op* o = e->parent;
  struct cell* s = &o->cells[(unsigned)e->step % STEP_CELLS];
  if (s->busy) { /* NCCL reused [step % 8] before stopping it */
    atomic_fetch_add_explicit(&c_orphans, 1, memory_order_relaxed);
    if (o->link) atomic_fetch_sub_explicit(&o->link->in_flight, 1, memory_order_relaxed);
  }
  uint64_t now = now_ns();
  s->chain = NULL; s->busy = 1; s->state = 0; s->t_state = now; s->trans = 0;
  if (o->link) {
    atomic_fetch_add_explicit(&o->link->in_flight, 1, memory_order_relaxed);
    atomic_store_explicit(&o->link->last_ns, now, memory_order_relaxed);
  }
  return s;
}
static void step_record(struct cell* s, int state, const void* args) {
  struct op* o = op_of_cell(s);
  uint64_t now = now_ns();
  if (!s->busy) return;
  if (o->link) {
    step_account(o->link, s, now);
    atomic_store_explicit(&o->link->last_ns, now, memory_order_relaxed);
  }
  s->state = (uint8_t)state;
  s->t_state = now;
  if (g_api >= 4 && args) s->trans = ((const union args_v4*)args)->proxy_step.trans_size;
}
static void step_stop(struct cell* s) {
  struct op* o = op_of_cell(s);
  uint64_t now = now_ns();
  if (!s->busy) return;
  s->busy = 0;
  if (o->link == NULL) return;
  step_account(o->link, s, now);
  if (g_api >= 4) atomic_fetch_add_explicit(&o->link->nbytes, s->trans, memory_order_relaxed);
  atomic_fetch_add_explicit(&o->link->steps, 1, memory_order_relaxed);
  atomic_fetch_sub_explicit(&o->link->in_flight, 1, memory_order_relaxed);
  atomic_store_explicit(&o->link->last_ns, now, memory_order_relaxed);
}

/* ---- the shared entry points ------------------------------------------------------------------------ */
static void* bind_chain(void* ours, int kind, void* chained) {
  if (ours == NULL) return chained; /* not followed here: the chained plugin's handle as it is */
  if (kind == H_TASK) ((struct task*)ours)->chain = chained;
  else if (kind == H_OP) ((struct op*)ours)->chain = chained;
  else ((struct cell*)ours)->chain = chained;
  return ours;
}

/* Start one event. `copy` is the version's descriptor, copied, for the chained plugin, NULL when there is
   none for this communicator; its parent is translated here to the chained plugin's own handle. Only
   children of followed events (kernel channels, proxy ops and steps) can have a parent of ours: groups and
   API events are never followed, so v5's coll.parentGroup is always the chained plugin's handle already. */
static void core_start(struct ctx* c, void** handle, const struct nev* e, void* copy, void** copy_parent) {
  void* ours = NULL;
  int kind = H_TASK;
  if (c && on()) {
    switch (e->type) {
      case EV_COLL: case EV_P2P: ours = task_start(c, e); break;
      case EV_KERNEL_CH: ours = kch_start(e); break;
      case EV_PROXY_OP: ours = op_start(c, e); kind = H_OP; break;
      case EV_PROXY_STEP: ours = step_start(e); kind = H_CELL; break;
      default: break; /* groups, API events, proxy control, network plugin: not followed */
    }
  }
  void* chained = NULL;
  if (copy && wanted_by(c->chain_mask, e->type)) {
    /* PXN: a parent from another process is passed as it is */
    if (*copy_parent && !(e->type == EV_PROXY_OP && e->pid != g_pid)) *copy_parent = chain_handle_of(*copy_parent);
    g_chain->start(c->chain_ctx, &chained, copy);
  }
  *handle = bind_chain(ours, kind, chained);
}

static nccl_result impossible(void** handle, const char* what) {
  if (handle) *handle = NULL;
  say_off("%s", what);
  return 0;
}

static nccl_result core_stop(void* h) {
  if (h == NULL) return 0;
  switch (classify(h)) {
    case H_RAW:
      if (g_chain) g_chain->stop(h);
      else say_off("stopEvent got a handle ccld never gave");
      return 0;
    case H_BAD: say_off("stopEvent got an address inside ccld's handles that is not one"); return 0;
    case H_TASK: {
      struct task* t = h;
      if (g_chain && t->chain) g_chain->stop(t->chain);
      if (t->kind == K_KCH) kch_stop(t);
      else if (t->kind == K_COLL || t->kind == K_P2P) task_stop(t);
      else atomic_fetch_add_explicit(&c_orphans, 1, memory_order_relaxed); /* stopped twice */
      return 0;
    }
    case H_OP: {
      struct op* o = h;
      if (g_chain && o->chain) g_chain->stop(o->chain);
      op_stop(o);
      return 0;
    }
    default: {
      struct cell* s = h;
      if (g_chain && s->chain) g_chain->stop(s->chain);
      step_stop(s);
      return 0;
    }
  }
}

static nccl_result core_record(void* h, int state, void* args) {
  if (h == NULL) return 0;
  switch (classify(h)) {
    case H_RAW:
      if (g_chain) g_chain->record(h, state, args);
      else say_off("recordEventState got a handle ccld never gave");
      return 0;
    case H_BAD: say_off("recordEventState got an address inside ccld's handles that is not one"); return 0;
    case H_TASK: {
      struct task* t = h;
      if (g_chain && t->chain) g_chain->record(t->chain, state, args);
      if (t->kind == K_KCH && state == ST_KERNEL_CH_STOP && g_api >= 4 && args)
        t->gpu_stop = ((union args_v4*)args)->kernel_ch.ptimer;
      return 0;
    }
    case H_OP: {
      struct op* o = h;
      if (g_chain && o->chain) g_chain->record(o->chain, state, args);
      op_record(o, state, args);
      return 0;
    }
    default: {
      struct cell* s = h;
      if (g_chain && s->chain) g_chain->record(s->chain, state, args);
      step_record(s, state, args);
      return 0;
    }
  }
}

/* ---- the sending thread ----------------------------------------------------------------------------- */
static pthread_t g_thread;
static atomic_int g_thread_alive;
static int g_stop; /* under g_tmu */
static pthread_mutex_t g_tmu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_tcond;
static uint64_t g_interval, g_number;     /* thread only (and a config failure, before any thread) */
static unsigned char g_dgram[CCLD_NP_DATAGRAM_MAX];
static uint32_t g_dn;                      /* records in g_dgram */
static uint64_t g_last_sent_ns, g_last_drops;

#define DGRAM_RECORDS ((CCLD_NP_DATAGRAM_MAX - CCLD_NP_HEADER_SIZE) / CCLD_NP_RECORD_SIZE)

static uint64_t drops_sum(void) { /* refused sends left out: each would trigger the next one */
  return atomic_load(&c_drop_queue) + atomic_load(&c_drop_handles) + atomic_load(&c_drop_links) +
         atomic_load(&c_orphans);
}
/* Send g_dgram's g_dn records (+ text) with the given state; refused: counted, never retried. */
static void send_dgram(int state, const char* text) {
  ccld_np_header* h = (ccld_np_header*)g_dgram;
  size_t tl = text ? strlen(text) : 0;
  size_t off = CCLD_NP_HEADER_SIZE + (size_t)g_dn * CCLD_NP_RECORD_SIZE;
  if (tl > sizeof g_dgram - off) tl = sizeof g_dgram - off;
  memset(h, 0, sizeof *h);
  h->magic = CCLD_NP_MAGIC;
  h->version = CCLD_NP_VERSION;
  h->header_size = CCLD_NP_HEADER_SIZE;
  h->record_size = CCLD_NP_RECORD_SIZE;
  h->api_version = (uint8_t)g_api;
  h->state = (uint8_t)state;
  h->pid = (int32_t)getpid();
  h->rank = g_rank;
  h->n_records = g_dn;
  h->number = ++g_number;
  h->sent_ns = now_ns();
  h->text_len = (uint32_t)tl;
  h->last_errno = atomic_load(&g_last_errno);
  h->drop_queue = atomic_load(&c_drop_queue);
  h->drop_handles = atomic_load(&c_drop_handles);
  h->drop_datagrams = atomic_load(&c_drop_datagrams);
  h->drop_sent_records = atomic_load(&c_drop_sent_records);
  h->drop_links = atomic_load(&c_drop_links);
  h->orphans = atomic_load(&c_orphans);
  if (tl) memcpy(g_dgram + off, text, tl);
  g_last_drops = drops_sum();
  g_last_sent_ns = h->sent_ns;
  ssize_t n = -1;
  if (g_fd >= 0)
    n = sendto(g_fd, g_dgram, off + tl, MSG_DONTWAIT | MSG_NOSIGNAL, (struct sockaddr*)&g_addr, g_addrlen);
  if (n < 0) {
    atomic_store(&g_last_errno, g_fd >= 0 ? errno : EBADF);
    atomic_fetch_add(&c_drop_datagrams, 1);
    atomic_fetch_add(&c_drop_sent_records, g_dn);
  }
  g_dn = 0;
}
static void dgram_add(const void* rec) {
  if (g_dn == DGRAM_RECORDS) send_dgram(CCLD_NP_STATE_ON, NULL);
  memcpy(g_dgram + CCLD_NP_HEADER_SIZE + (size_t)g_dn * CCLD_NP_RECORD_SIZE, rec, CCLD_NP_RECORD_SIZE);
  g_dn++;
}

/* Which stopped ops are over (see task_stop): children all stopped and quiet for QUIET_INTERVALS (at the
   last flush: now); no child ever: END_ENQUEUE after the grace, END_STALE much later. A child that
   attaches meanwhile makes the CAS fail: the op stays open. */
static void reap(uint64_t now, bool last) {
  uint64_t interval_ns = (uint64_t)g_flush_ms * 1000000ull;
  for (size_t i = 0; i < g_ntasks; i++) {
    struct task* t = &g_tasks[i];
    uint64_t st = atomic_load_explicit(&t->st, memory_order_acquire);
    if ((st & (T_DONE | T_LIVE)) || !(st & T_STOPPED)) continue;
    uint64_t since = atomic_load_explicit(st & T_ANY_CHILD ? &t->t_last_child : &t->t_enq, memory_order_relaxed);
    if (since > now) continue; /* moved after this flush began */
    uint64_t age = now - since;
    uint8_t how;
    if (st & T_ANY_CHILD) {
      if (!last && age < QUIET_INTERVALS * interval_ns) continue;
      how = CCLD_NP_F_END_CHILDREN;
    } else if (st & T_WAIT_CHILD) {
      if (age < STALE_INTERVALS * interval_ns) continue;
      how = CCLD_NP_F_END_STALE;
    } else {
      if (age < GRACE_INTERVALS * interval_ns) continue;
      how = CCLD_NP_F_END_ENQUEUE;
    }
    if (atomic_compare_exchange_strong(&t->st, &st, st | T_DONE))
      complete(t, how == CCLD_NP_F_END_STALE ? 0 : since, how);
  }
}
static void add_progress(void) {
  for (size_t i = 0; i < LINKS; i++) {
    struct link* l = &g_links[i];
    if (!atomic_load_explicit(&l->ready, memory_order_acquire) || l->kind != L_PROGRESS) continue;
    np_record r;
    memset(&r, 0, sizeof r);
    r.progress.nbytes = atomic_exchange_explicit(&l->nbytes, 0, memory_order_relaxed);
    r.progress.steps = atomic_exchange_explicit(&l->steps, 0, memory_order_relaxed);
    r.progress.net_wait_ns = atomic_exchange_explicit(&l->net_ns, 0, memory_order_relaxed);
    r.progress.gpu_wait_ns = atomic_exchange_explicit(&l->gpu_ns, 0, memory_order_relaxed);
    uint64_t ops = atomic_exchange_explicit(&l->ops, 0, memory_order_relaxed);
    int64_t inflight = atomic_load_explicit(&l->in_flight, memory_order_relaxed);
    if (!(r.progress.nbytes | r.progress.steps | r.progress.net_wait_ns | r.progress.gpu_wait_ns | ops) && inflight <= 0)
      continue;
    r.progress.kind = CCLD_NP_PROGRESS;
    r.progress.flags = l->send ? CCLD_NP_F_SEND : 0;
    r.progress.channel = l->channel;
    r.progress.in_flight = inflight > 0 ? (uint32_t)inflight : 0;
    r.progress.id = g_interval;
    r.progress.comm_hash = l->comm;
    r.progress.peer = l->peer;
    r.progress.proxy_ops = ops > UINT32_MAX ? UINT32_MAX : (uint32_t)ops;
    r.progress.last_ns = atomic_load_explicit(&l->last_ns, memory_order_relaxed);
    dgram_add(&r);
  }
}
/* One interval: ends found by reap, what the queue holds (at most its size: producers go on meanwhile),
   the link sums; sent when there is something, the drop counters moved, or a heartbeat is due. */
static void flush(bool last) {
  uint64_t now = now_ns();
  g_interval++;
  reap(now, last);
  np_record r;
  for (size_t n = 0; n < g_queue_cap && ring_pop(&g_queue, &r); n++) dgram_add(&r);
  add_progress();
  if (g_dn || drops_sum() != g_last_drops || now - g_last_sent_ns >= HEARTBEAT_MS * 1000000ull)
    send_dgram(CCLD_NP_STATE_ON, NULL);
}

static void* sender(void* arg) {
  (void)arg;
  uint64_t period = (uint64_t)g_flush_ms * 1000000ull, next = now_ns() + period;
  pthread_mutex_lock(&g_tmu);
  for (;;) {
    while (!g_stop && on()) {
      uint64_t now = now_ns();
      if (now >= next) break;
      struct timespec ts;
      clock_gettime(CLOCK_MONOTONIC, &ts);
      uint64_t wait = next - now, ns = (uint64_t)ts.tv_nsec + wait % 1000000000ull;
      ts.tv_sec += (time_t)(wait / 1000000000ull + ns / 1000000000ull);
      ts.tv_nsec = (long)(ns % 1000000000ull);
      pthread_cond_timedwait(&g_tcond, &g_tmu, &ts);
    }
    int stop = g_stop;
    pthread_mutex_unlock(&g_tmu);
    bool was_on = on();
    flush(stop || !was_on); /* the last datagrams: every op whose children all stopped is over */
    if (!was_on) { /* what was held, then why: the last datagram of this process */
      send_dgram(CCLD_NP_STATE_OFF, g_off_reason);
      break;
    }
    if (stop) {
      send_dgram(CCLD_NP_STATE_BYE, NULL);
      break;
    }
    next += period;
    uint64_t now = now_ns();
    if (next < now) next = now + period; /* slept through intervals (a stopped process): no burst */
    pthread_mutex_lock(&g_tmu);
  }
  atomic_store(&g_thread_alive, 0);
  return NULL;
}

static void send_off_now(void);

/* under g_mu */
static void thread_start(void) {
  if (!on() || atomic_load(&g_thread_alive)) return;
  const char* fault = getenv("CCLD_NCCLPROF_FAULT");
  pthread_mutex_lock(&g_tmu);
  g_stop = 0;
  pthread_mutex_unlock(&g_tmu);
  atomic_store(&g_thread_alive, 1);
  int err = fault && strcmp(fault, "thread") == 0 ? EAGAIN : pthread_create(&g_thread, NULL, sender, NULL);
  if (err) {
    atomic_store(&g_thread_alive, 0);
    say_off("cannot start its sending thread: %s", strerror(err));
    send_off_now();
  }
}
/* Stop the thread after its last flush and "bye"; waits at most JOIN_WAIT_MS (the library stays loaded:
   see pin_self, so a thread still sending cannot outlive its code). */
static void thread_stop(void) {
  if (!atomic_load(&g_thread_alive)) return;
  pthread_mutex_lock(&g_tmu);
  g_stop = 1;
  pthread_cond_signal(&g_tcond);
  pthread_mutex_unlock(&g_tmu);
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_sec += JOIN_WAIT_MS / 1000;
  ts.tv_nsec += (JOIN_WAIT_MS % 1000) * 1000000L;
  if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
  if (pthread_timedjoin_np(g_thread, NULL, &ts) != 0) pthread_detach(g_thread);
}

/* ---- configuration (the first init) ----------------------------------------------------------------- */
static bool env_int(const char* name, long lo, long hi, long dflt, long* out) {
  const char* s = getenv(name);
  *out = dflt;
  if (s == NULL || *s == 0) return true;
  char* end;
  errno = 0;
  long v = strtol(s, &end, 0);
  if (errno || *end || v < lo || v > hi) {
    say_off("%s='%s' is not a number in %ld..%ld", name, s, lo, hi);
    return false;
  }
  *out = v;
  return true;
}
static bool pow2(long v) { return v > 0 && (v & (v - 1)) == 0; }

/* NCCL dlcloses the plugin when its last communicator is gone; keep the code mapped (RTLD_NODELETE) so a
   sending thread that outlived the bounded wait, or a later re-init, finds it. */
static void pin_self(void) {
  Dl_info info;
  if (dladdr((void*)&pin_self, &info) && info.dli_fname) (void)dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE);
}

extern const table_v1 ncclProfiler_v1, ncclProfiler_v2, ncclProfiler_v3;
extern const table_v4 ncclProfiler_v4;
extern const table_v5 ncclProfiler_v5;

static void chain_load(int version) {
  const char* name = getenv("CCLD_NCCLPROF_CHAIN");
  if (name == NULL || *name == 0) return;
  void* lib = NULL;
  if (strchr(name, '/') == NULL) { /* NCCL's naming: a name means libnccl-profiler-<name>.so */
    char path[PATH_MAX];
    snprintf(path, sizeof path, "libnccl-profiler-%s.so", name);
    lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  }
  if (lib == NULL) lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    const char* err = dlerror();
    fprintf(stderr, "ccld: NCCL profiler plugin: chained plugin %s not loaded (%s); ccld's goes on\n", name,
            err ? err : "?");
    return;
  }
  char sym[32];
  snprintf(sym, sizeof sym, "ncclProfiler_v%d", version);
  const table_any* t = dlsym(lib, sym);
  const void* self[] = {NULL, &ncclProfiler_v1, &ncclProfiler_v2, &ncclProfiler_v3, &ncclProfiler_v4, &ncclProfiler_v5};
  if (t == NULL || (const void*)t == self[version]) {
    fprintf(stderr, "ccld: NCCL profiler plugin: chained plugin %s not used (%s); ccld's goes on\n", name,
            t ? "it is ccld's own" : "it has no ncclProfiler table of the version NCCL picked");
    return;
  }
  g_chain = t;
}

static bool make_pools(void) {
  const char* fault = getenv("CCLD_NCCLPROF_FAULT");
  if (fault && strcmp(fault, "alloc") == 0) return false;
  g_nops = g_ntasks / OPS_PER_HANDLES;
  g_tasks = calloc(g_ntasks, sizeof *g_tasks);
  g_ops = calloc(g_nops, sizeof *g_ops);
  g_links = calloc(LINKS, sizeof *g_links);
  size_t cap = 1;
  while (cap < g_ntasks) cap <<= 1; /* the free rings hold every index */
  if (!g_tasks || !g_ops || !g_links || !ring_init(&g_queue, g_queue_cap, CCLD_NP_RECORD_SIZE) ||
      !ring_init(&g_free_tasks, cap, sizeof(uint32_t)) || !ring_init(&g_free_ops, cap, sizeof(uint32_t))) {
    free(g_tasks); free(g_ops); free(g_links); /* rings: left to the process (tiny, never used) */
    g_tasks = NULL; g_ops = NULL; g_links = NULL;
    return false;
  }
  for (uint32_t i = 0; i < g_ntasks; i++) {
    atomic_init(&g_tasks[i].st, T_DONE);
    ring_push(&g_free_tasks, &i);
  }
  for (uint32_t i = 0; i < g_nops; i++) ring_push(&g_free_ops, &i);
  return true;
}

static void init_cond(void) {
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&g_tcond, &ca);
  pthread_condattr_destroy(&ca);
}
/* A forked child has no sending thread (it starts again at the child's first init), and a lock another
   thread held at the fork would never be released there: both locks start afresh. */
static void atfork_child(void) {
  pthread_mutex_init(&g_mu, NULL);
  pthread_mutex_init(&g_tmu, NULL);
  init_cond();
  atomic_store(&g_thread_alive, 0);
  g_stop = 0;
  g_pid = getpid();
}

/* Send one header-only "off" datagram now (a configuration failure, before any thread). */
static void send_off_now(void) {
  if (g_addrlen == 0) return;
  if (g_fd < 0) g_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  g_dn = 0;
  send_dgram(CCLD_NP_STATE_OFF, g_off_reason);
}

/* under g_mu, once */
static void configure(int version) {
  g_configured = 1;
  g_api = version;
  g_pid = getpid();
  init_cond();
  pthread_atfork(NULL, NULL, atfork_child);
  pin_self();
  const char* rank = getenv("RANK");
  if (rank && *rank) {
    char* end;
    long v = strtol(rank, &end, 10);
    g_rank = *end == 0 && v >= 0 && v <= INT32_MAX ? (int)v : -1;
  }
  chain_load(version);
  const char* ep = getenv("CCLD_NCCLPROF_ENDPOINT");
  if (ep == NULL || *ep == 0) { say_off("CCLD_NCCLPROF_ENDPOINT is not set"); return; }
  if (strlen(ep) >= sizeof g_addr.sun_path) { say_off("CCLD_NCCLPROF_ENDPOINT is longer than a socket path"); return; }
  g_addr.sun_family = AF_UNIX;
  strcpy(g_addr.sun_path, ep);
  g_addrlen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + strlen(ep) + 1);
  long flush, queue, handles, mask;
  int dflt = EV_COLL | EV_P2P | EV_PROXY_OP | EV_PROXY_STEP | (version >= 3 ? EV_KERNEL_CH : 0);
  if (!env_int("CCLD_NCCLPROF_FLUSH_MS", 1, 60000, FLUSH_MS_DEFAULT, &flush) ||
      !env_int("CCLD_NCCLPROF_QUEUE", 16, 1 << 20, QUEUE_DEFAULT, &queue) ||
      !env_int("CCLD_NCCLPROF_HANDLES", 16, 1 << 20, HANDLES_DEFAULT, &handles) ||
      !env_int("CCLD_NCCLPROF_MASK", 0, INT_MAX, dflt, &mask)) { send_off_now(); return; }
  if (!pow2(queue)) { say_off("CCLD_NCCLPROF_QUEUE=%ld is not a power of 2", queue); send_off_now(); return; }
  g_flush_ms = (int)flush;
  g_queue_cap = (size_t)queue;
  g_ntasks = (size_t)handles;
  g_mask = (int)mask & dflt; /* narrows the default, never widens it */
  if (!make_pools()) { say_off("cannot allocate its buffers"); send_off_now(); return; }
  g_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (g_fd < 0) { say_off("cannot make a socket: %s", strerror(errno)); return; }
  atomic_store(&g_on, 1);
}

/* Every init: configure once, take a context, start the thread if it is not running. NULL: none to give. */
static struct ctx* ctx_open(int version, void** context, int* mask) {
  if (context == NULL || mask == NULL) { say_off("init got a NULL pointer"); return NULL; }
  *context = NULL;
  *mask = 0;
  pthread_mutex_lock(&g_mu);
  if (!g_configured) configure(version);
  struct ctx* c = NULL;
  for (int i = 0; i < CTX_MAX && c == NULL; i++)
    if (!g_ctx[i].used) c = &g_ctx[i];
  if (c == NULL) {
    atomic_fetch_add(&c_drop_handles, 1);
  } else {
    c->used = 1;
    c->version = version;
    c->id = ++g_ctx_ids;
    atomic_store(&c->comm_hash, 0);
    atomic_store(&c->announced, 0);
    c->chain_ctx = NULL;
    c->chain_mask = 0;
    g_active++;
    thread_start(); /* may turn the plugin off: the mask after it */
    c->mask = on() ? g_mask : 0;
    *context = c;
    *mask = c->mask;
  }
  pthread_mutex_unlock(&g_mu);
  return c;
}
static void chain_inited(struct ctx* c, int* mask, nccl_result rc, void* cctx, int cmask) {
  static atomic_int said;
  if (rc != 0) { /* NCCL would have turned that plugin off: it gets nothing more for this communicator */
    if (!atomic_exchange(&said, 1))
      fprintf(stderr, "ccld: NCCL profiler plugin: chained plugin's init failed (%d); not chained for that communicator\n", rc);
    return;
  }
  c->chain_ctx = cctx;
  c->chain_mask = cmask;
  c->mask |= cmask;
  *mask = c->mask;
}

static nccl_result core_finalize(void* context) {
  if (context == NULL) return 0;
  struct ctx* c = ctx_of(context);
  if (c == NULL) { say_off("finalize got a context ccld never gave"); return 0; }
  if (g_chain && c->chain_ctx) g_chain->finalize(c->chain_ctx);
  pthread_mutex_lock(&g_mu);
  if (c->used) {
    c->used = 0;
    if (--g_active == 0) thread_stop(); /* the last communicator: flush, "bye" */
  }
  pthread_mutex_unlock(&g_mu);
  return 0;
}

__attribute__((destructor)) static void at_unload(void) { /* process exit without finalize: "bye" too */
  if (pthread_mutex_trylock(&g_mu) != 0) return; /* an init or finalize is running: do not wait at exit */
  thread_stop();
  pthread_mutex_unlock(&g_mu);
}

/* ---- the five tables ----------------------------------------------------------------------------- */
static struct ctx* start_ctx(void* context, void** handle, void* descr, bool* bad) {
  *bad = false;
  if (handle == NULL || descr == NULL) { impossible(handle, "startEvent got a NULL pointer"); *bad = true; return NULL; }
  if (context == NULL) return NULL; /* a communicator we had no context for: counted at its init */
  struct ctx* c = ctx_of(context);
  if (c == NULL) { impossible(handle, "startEvent got a context ccld never gave"); *bad = true; }
  return c;
}
/* Each version's descriptor -> struct nev. proxyOp and proxyStep have one layout in every version. */
static void fill_proxy(struct nev* e, const struct d_proxy_op* op, const struct d_proxy_step* step) {
  if (e->type == EV_PROXY_OP) {
    e->pid = op->pid; e->channel = op->channel; e->peer_or_root = op->peer; e->is_send = op->is_send;
  } else if (e->type == EV_PROXY_STEP) {
    e->step = step->step;
  }
}
/* v2..v5 name a collective's function, datatype, algorithm and protocol with NCCL's strings */
#define FILL_COLL_STR(e, c)                                                                            \
  do {                                                                                                 \
    (e)->seq = (c).seq; (e)->count = (c).count; (e)->peer_or_root = (c).root; (e)->nwarps = (c).nwarps; \
    (e)->op = id_of((c).func, OP_NAMES, CCLD_NP_OP_N); (e)->dtype = id_of((c).dtype, DT_NAMES, CCLD_NP_DT_N); \
    (e)->algo = id_of((c).algo, ALGO_NAMES, CCLD_NP_ALGO_N);                                          \
    (e)->proto = id_of((c).proto, PROTO_NAMES, CCLD_NP_PROTO_N);                                      \
  } while (0)
#define FILL_P2P_STR(e, p)                                                                             \
  do {                                                                                                 \
    (e)->count = (p).count; (e)->peer_or_root = (p).peer;                                              \
    (e)->op = id_of((p).func, OP_NAMES, CCLD_NP_OP_N); (e)->dtype = id_of((p).dtype, DT_NAMES, CCLD_NP_DT_N); \
  } while (0)

static void fill_v1(struct nev* e, const struct descr_v1* d) { /* NCCL's enum values, commHash per event */
  if (e->type == EV_COLL) {
    e->comm_hash = d->coll.comm_hash; e->seq = d->coll.seq; e->count = d->coll.count; e->peer_or_root = d->coll.root;
    e->op = id_from_nccl(d->coll.func, CCLD_NP_OP_N); e->dtype = id_from_nccl(d->coll.dtype, CCLD_NP_DT_N);
    e->algo = id_from_nccl(d->coll.algo, CCLD_NP_ALGO_N); e->proto = id_from_nccl(d->coll.proto, CCLD_NP_PROTO_N);
    e->nchannels = d->coll.max_channels; e->nwarps = d->coll.nwarps;
  } else if (e->type == EV_P2P) {
    e->comm_hash = d->p2p.comm_hash; e->count = d->p2p.count; e->peer_or_root = d->p2p.peer;
    e->op = id_from_nccl(d->p2p.func, CCLD_NP_OP_N); e->dtype = id_from_nccl(d->p2p.dtype, CCLD_NP_DT_N);
  }
  fill_proxy(e, &d->proxy_op, &d->proxy_step);
}
/* v2 and v3: strings, commHash per event; v3 drops v2's trafficBytes and adds kernel channels */
#define FILL_V23(e, d)                                                                                 \
  do {                                                                                                 \
    if ((e)->type == EV_COLL) {                                                                        \
      FILL_COLL_STR(e, (d)->coll);                                                                     \
      (e)->comm_hash = (d)->coll.comm_hash; (e)->nchannels = (d)->coll.max_channels;                   \
    } else if ((e)->type == EV_P2P) {                                                                  \
      FILL_P2P_STR(e, (d)->p2p);                                                                       \
      (e)->comm_hash = (d)->p2p.comm_hash;                                                             \
    }                                                                                                  \
    fill_proxy(e, &(d)->proxy_op, &(d)->proxy_step);                                                   \
  } while (0)
static void fill_v2(struct nev* e, const struct descr_v2* d) { FILL_V23(e, d); }
static void fill_v3(struct nev* e, const struct descr_v3* d) {
  FILL_V23(e, d);
  if (e->type == EV_KERNEL_CH) e->channel = d->kernel_ch.channel; /* no timestamp before v4 */
}
/* v4 and v5: no commHash in events (init gives it), kernel timestamps; v5 adds parentGroup at the end */
#define FILL_V45(e, d)                                                                                 \
  do {                                                                                                 \
    if ((e)->type == EV_COLL) {                                                                        \
      FILL_COLL_STR(e, (d)->coll);                                                                     \
      (e)->nchannels = (d)->coll.nchannels;                                                            \
    } else if ((e)->type == EV_P2P) {                                                                  \
      FILL_P2P_STR(e, (d)->p2p);                                                                       \
      (e)->nchannels = (d)->p2p.nchannels;                                                             \
    } else if ((e)->type == EV_KERNEL_CH) {                                                            \
      (e)->channel = (d)->kernel_ch.channel; (e)->ptimer = (d)->kernel_ch.ptimer; (e)->has_ptimer = true; \
    }                                                                                                  \
    fill_proxy(e, &(d)->proxy_op, &(d)->proxy_step);                                                   \
  } while (0)
static void fill_v4(struct nev* e, const struct descr_v4* d) { FILL_V45(e, d); }
static void fill_v5(struct nev* e, const struct descr_v5* d) { FILL_V45(e, d); }

/* One startEvent per version: check the call, read the descriptor, and give the chained plugin (if any,
   for this communicator) a copy whose parent core_start translates to its own handle. */
#define START_FN(NAME, T, FILL)                                                                        \
  static nccl_result NAME(void* context, void** handle, void* descr) {                                 \
    bool bad;                                                                                          \
    struct ctx* c = start_ctx(context, handle, descr, &bad);                                           \
    if (bad) return 0;                                                                                 \
    const T* d = descr;                                                                                \
    if ((uint64_t)d->type > INT_MAX) return impossible(handle, "startEvent got an event type beyond NCCL's"); \
    struct nev e = {.type = (int)d->type, .rank = d->rank, .parent = d->parent, .peer_or_root = -1};   \
    FILL(&e, d);                                                                                       \
    T copy;                                                                                            \
    bool chained = g_chain && c && c->chain_ctx;                                                       \
    if (chained) copy = *d;                                                                            \
    core_start(c, handle, &e, chained ? &copy : NULL, chained ? &copy.parent : NULL);                  \
    return 0;                                                                                          \
  }
START_FN(v1_start, struct descr_v1, fill_v1)
START_FN(v2_start, struct descr_v2, fill_v2)
START_FN(v3_start, struct descr_v3, fill_v3)
START_FN(v4_start, struct descr_v4, fill_v4)
START_FN(v5_start, struct descr_v5, fill_v5)

static nccl_result v1_init(void** context, int* mask, int version) {
  struct ctx* c = ctx_open(version, context, mask);
  if (c && g_chain) {
    void* cc = NULL;
    int cm = 0;
    nccl_result rc = ((init_v1_fn)g_chain->init)(&cc, &cm);
    chain_inited(c, mask, rc, cc, cm);
  }
  return 0;
}
static nccl_result v1_init1(void** context, int* mask) { return v1_init(context, mask, 1); }
static nccl_result v1_init2(void** context, int* mask) { return v1_init(context, mask, 2); }
static nccl_result v1_init3(void** context, int* mask) { return v1_init(context, mask, 3); }

/* v4 and v5 differ only in their init's argument order; both give the communicator's hash and size */
static nccl_result v45_init(int version, void** context, uint64_t comm_hash, int* mask, const char* name, int nnodes,
                            int nranks, int rank, nccl_logger log) {
  struct ctx* c = ctx_open(version, context, mask);
  if (c == NULL) return 0;
  atomic_store(&c->comm_hash, comm_hash);
  if (g_chain) {
    void* cc = NULL;
    int cm = 0;
    nccl_result rc = version == 4 ? ((init_v4_fn)g_chain->init)(&cc, &cm, name, comm_hash, nnodes, nranks, rank, log)
                                  : ((init_v5_fn)g_chain->init)(&cc, comm_hash, &cm, name, nnodes, nranks, rank, log);
    chain_inited(c, mask, rc, cc, cm);
  }
  announce(c, comm_hash, rank, nranks, nnodes, true);
  return 0;
}
static nccl_result v4_init(void** context, int* mask, const char* name, uint64_t comm_hash, int nnodes, int nranks,
                           int rank, nccl_logger log) {
  return v45_init(4, context, comm_hash, mask, name, nnodes, nranks, rank, log);
}
static nccl_result v5_init(void** context, uint64_t comm_id, int* mask, const char* name, int nnodes, int nranks,
                           int rank, nccl_logger log) {
  return v45_init(5, context, comm_id, mask, name, nnodes, nranks, rank, log);
}

#define EXPORT __attribute__((visibility("default")))
EXPORT const table_v1 ncclProfiler_v1 = {"ccld", v1_init1, v1_start, core_stop, core_record, core_finalize};
EXPORT const table_v1 ncclProfiler_v2 = {"ccld", v1_init2, v2_start, core_stop, core_record, core_finalize};
EXPORT const table_v1 ncclProfiler_v3 = {"ccld", v1_init3, v3_start, core_stop, core_record, core_finalize};
EXPORT const table_v4 ncclProfiler_v4 = {"ccld", v4_init, v4_start, core_stop, core_record, core_finalize};
EXPORT const table_v5 ncclProfiler_v5 = {"ccld", v5_init, v5_start, core_stop, core_record, core_finalize};

/* ---- for tests and ccld's Python: the layouts this file was built with, and its source ------------ */
struct ccld_np_field { const char* name; uint32_t offset, size; };
/* a member's name is its path, as written here (F), under the struct's short name (S) */
#define F(N, T, M) {N "." #M, (uint32_t)offsetof(T, M), (uint32_t)sizeof(((T*)0)->M)}
#define S(N, T) {N, 0, (uint32_t)sizeof(T)}
#define V(n, M) F("v" #n, struct descr_v##n, M)
static const struct ccld_np_field LAYOUT[] = {
  S("header", ccld_np_header), F("header", ccld_np_header, magic), F("header", ccld_np_header, state),
  F("header", ccld_np_header, api_version), F("header", ccld_np_header, number), F("header", ccld_np_header, text_len),
  F("header", ccld_np_header, drop_queue), F("header", ccld_np_header, orphans),
  S("task", ccld_np_task), F("task", ccld_np_task, id), F("task", ccld_np_task, seq), F("task", ccld_np_task, t_ns),
  F("task", ccld_np_task, gpu_end_ns), F("task", ccld_np_task, peer), F("task", ccld_np_task, proto),
  S("comm", ccld_np_comm), F("comm", ccld_np_comm, rank), F("comm", ccld_np_comm, nnodes), F("comm", ccld_np_comm, t_ns),
  S("progress", ccld_np_progress), F("progress", ccld_np_progress, in_flight), F("progress", ccld_np_progress, peer),
  F("progress", ccld_np_progress, nbytes), F("progress", ccld_np_progress, gpu_wait_ns),
  F("progress", ccld_np_progress, last_ns),
  S("v1", struct descr_v1), V(1, parent), V(1, rank), V(1, coll.comm_hash), V(1, coll.seq), V(1, coll.func),
  V(1, coll.count), V(1, coll.root), V(1, coll.dtype), V(1, coll.max_channels), V(1, coll.algo), V(1, coll.proto),
  V(1, coll.is_nvls), V(1, p2p.comm_hash), V(1, p2p.func), V(1, p2p.dtype), V(1, p2p.count), V(1, p2p.peer),
  V(1, proxy_op.pid), V(1, proxy_op.channel), V(1, proxy_op.peer), V(1, proxy_op.is_send), V(1, proxy_step.step),
  S("v2", struct descr_v2), V(2, coll.func), V(2, coll.dtype), V(2, coll.max_channels), V(2, coll.algo),
  V(2, coll.proto), V(2, p2p.peer),
  S("v3", struct descr_v3), V(3, coll.dtype), V(3, coll.max_channels), V(3, coll.proto), V(3, p2p.peer),
  V(3, kernel_ch.channel), V(3, net.data),
  S("v4", struct descr_v4), V(4, coll.seq), V(4, coll.root), V(4, coll.dtype), V(4, coll.nchannels), V(4, coll.proto),
  V(4, p2p.peer), V(4, p2p.nchannels), V(4, kernel_ch.ptimer),
  S("v5", struct descr_v5), V(5, parent), V(5, rank), V(5, coll.seq), V(5, coll.count), V(5, coll.dtype),
  V(5, coll.nchannels), V(5, coll.proto), V(5, coll.parent_group), V(5, p2p.peer), V(5, p2p.parent_group),
  V(5, proxy_op.is_send), V(5, kernel_ch.ptimer), V(5, coll_api.graph_captured),
  S("args_v1", union args_v1), F("args_v1", union args_v1, proxy_op.steps), S("args_v4", union args_v4),
};
EXPORT const struct ccld_np_field* ccld_np_layout(uint32_t* n) {
  *n = sizeof LAYOUT / sizeof LAYOUT[0];
  return LAYOUT;
}
EXPORT const char* ccld_np_source_sha256(void) { return CCLD_NP_SOURCE_SHA256; }
