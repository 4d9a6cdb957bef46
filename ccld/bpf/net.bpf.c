/* net.bpf.c: per-connection TCP metrics of the traced processes, aggregated in the kernel.
 *
 * Attach points (tracepoints only: this kernel has no kprobes; all are stable tracepoint formats):
 *   sock:sock_send_length / sock:sock_recv_length   process context: bytes, calls, errors per socket;
 *                                                   the first one of a traced process adds the socket
 *   tcp:tcp_probe             softirq (ACK processing): smoothed RTT (us) and congestion window
 *   tcp:tcp_retransmit_skb    retransmissions
 *   tcp:tcp_receive_reset / tcp:tcp_send_reset      resets, either way
 *   sock:inet_sock_set_state  TCP state changes (ESTABLISHED -> CLOSE...)
 * These fire for every socket of the machine, so each first tests one bit (an array lookup the
 * verifier inlines: a few ns, no hash): the send/recv pair runs in the process and tests its pid's
 * bit in `proc_bits`; everything else fires outside the process (softirq, timers) and tests the
 * socket's bit in `sock_bits` (a hash of the socket's address; set when a traced process's socket
 * enters `conns`, rebuilt by the agent when connections close), and only then looks the socket up in
 * `conns`: only sockets already there (added by a traced process's send/recv) count.
 *
 * Maps: proc_bits (bitmap over pids: the traced processes, set by the agent; CCLD_PID_WORDS words of
 * 64, from pid_max), sock_bits (bitmap over a hash of socket addresses: sockets that may be in
 * conns), conns (LRU: struct sock * -> cumulative counters and the connection's 4-tuple). The agent reads `conns` every interval and ships what changed: one
 * record per connection per interval, never one per packet. Addresses and ports are read from the
 * socket at offsets the loader takes from the running kernel's BTF (-DSKC_*_OFF), never from headers.
 * Counters are updated with atomic adds: a socket is touched from several CPUs at once. An entry in
 * state CLOSE takes no more TCP events until the agent's next drain ships and deletes it (its memory
 * may be reused by a new socket meanwhile, whose first sends, at most one drain's worth, then count
 * towards the closed connection).
 * Minimum kernel: 5.8 (sock_send_length needs 6.1; tcp_probe's skaddr 5.x).
 */
#include <uapi/linux/ptrace.h>

#ifndef CCLD_MAX_PROCS
#define CCLD_MAX_PROCS 4096
#endif
#ifndef CCLD_MAX_CONNS
#define CCLD_MAX_CONNS 8192  /* a 1,024-rank gloo full mesh from one 8-rank node; past it the LRU drops the
                             * connections idle longest. The agent reads every bucket each drain: ~25 us
                             * at this size, ~180 us at 65,536 */
#endif
#ifndef CCLD_PID_WORDS
#define CCLD_PID_WORDS 65536  /* 4,194,304 pids (the 64-bit pid_max default) / 64; the loader passes the real one */
#endif
#ifndef CCLD_SOCK_WORDS
#define CCLD_SOCK_WORDS 1024  /* 65,536 bits: with a few hundred traced sockets, ~1 % of others' ACKs look one up */
#endif
/* struct sock member offsets; the loader always passes the running kernel's (ccld/bpf/btf.py).
 * These defaults are 6.x x86-64 values, only so that `--ebpf` output compiles on its own. */
#ifndef SKC_DADDR_OFF
#define SKC_DADDR_OFF 0
#endif
#ifndef SKC_RCV_SADDR_OFF
#define SKC_RCV_SADDR_OFF 4
#endif
#ifndef SKC_DPORT_OFF
#define SKC_DPORT_OFF 12
#endif
#ifndef SKC_NUM_OFF
#define SKC_NUM_OFF 14
#endif
#ifndef SKC_FAMILY_OFF
#define SKC_FAMILY_OFF 16
#endif
#ifndef SKC_STATE_OFF
#define SKC_STATE_OFF 18
#endif
#ifndef SKC_V6_DADDR_OFF
#define SKC_V6_DADDR_OFF 56
#endif
#ifndef SKC_V6_RCV_SADDR_OFF
#define SKC_V6_RCV_SADDR_OFF 72
#endif

#define CCLD_AF_INET 2
#define CCLD_AF_INET6 10
#define CCLD_IPPROTO_TCP 6
#define CCLD_EAGAIN 11
#define CCLD_TCP_CLOSE 7

#ifndef CCLD_HAVE_SK_RST_REASON
/* tcp_send_reset's format names `enum sk_rst_reason` (6.10+); bcc builds `args` from that format, so
 * the type must exist even where the kernel headers in use are older. Only its size matters here. */
enum sk_rst_reason { CCLD_SK_RST_REASON_UNUSED = 0 };
#endif

struct conn {
    u32 tgid;
    u16 family;
    u16 sport;      /* host order */
    u16 dport;      /* host order */
    u16 pad;
    s32 state;      /* latest TCP state (include/net/tcp_states.h), 0 = not seen */
    u8 saddr[16];   /* IPv4 in the first 4 bytes */
    u8 daddr[16];
    u64 tx_bytes;
    u64 rx_bytes;
    u64 tx_calls;
    u64 rx_calls;
    u64 tx_errs;
    u64 rx_errs;
    u64 retrans;
    u64 resets;
    u64 srtt_us;    /* latest tcp_probe sample */
    u64 cwnd;
    u64 last_tx_ns;
    u64 last_rx_ns;
};
_Static_assert(sizeof(struct conn) == 144, "conn is 144 bytes (mirror: net.py Conn)");

BPF_ARRAY(proc_bits, u64, CCLD_PID_WORDS);
BPF_ARRAY(sock_bits, u64, CCLD_SOCK_WORDS);
BPF_TABLE("lru_hash", u64, struct conn, conns, CCLD_MAX_CONNS);

static __always_inline int proc_on(u32 pid)
{
    u32 w = pid >> 6;
    u64 *bits = proc_bits.lookup(&w);
    return bits && (*bits & (1ULL << (pid & 63)));
}

/* The socket's bit: its address hashed (slab objects are cache-line aligned, so the low 6 bits carry
 * nothing). sock_bit() must stay what ccld/bpf/net.py's sock_bit() computes. */
static __always_inline u32 sock_bit(u64 sk)
{
    return (u32)((sk >> 6) ^ (sk >> 22)) & (CCLD_SOCK_WORDS * 64 - 1);
}

static __always_inline int sock_on(u64 sk)
{
    u32 b = sock_bit(sk);
    u32 w = b >> 6;
    u64 *bits = sock_bits.lookup(&w);
    return bits && (*bits & (1ULL << (b & 63)));
}

static __always_inline void sock_mark(u64 sk)
{
    u32 b = sock_bit(sk);
    u32 w = b >> 6;
    u64 *bits = sock_bits.lookup(&w);
    if (bits)
        __sync_fetch_and_or(bits, 1ULL << (b & 63));
}

static __always_inline void read_tuple(struct conn *c, const void *sk)
{
    u16 family = 0, sport = 0, dport = 0;
    u8 state = 0;
    bpf_probe_read_kernel(&family, sizeof(family), (const char *)sk + SKC_FAMILY_OFF);
    bpf_probe_read_kernel(&state, sizeof(state), (const char *)sk + SKC_STATE_OFF);
    c->state = state;
    bpf_probe_read_kernel(&sport, sizeof(sport), (const char *)sk + SKC_NUM_OFF);   /* host order */
    bpf_probe_read_kernel(&dport, sizeof(dport), (const char *)sk + SKC_DPORT_OFF); /* network order */
    c->family = family;
    c->sport = sport;
    c->dport = (u16)((dport >> 8) | (dport << 8));
    if (family == CCLD_AF_INET6) {
        bpf_probe_read_kernel(c->saddr, 16, (const char *)sk + SKC_V6_RCV_SADDR_OFF);
        bpf_probe_read_kernel(c->daddr, 16, (const char *)sk + SKC_V6_DADDR_OFF);
    } else {
        bpf_probe_read_kernel(c->saddr, 4, (const char *)sk + SKC_RCV_SADDR_OFF);
        bpf_probe_read_kernel(c->daddr, 4, (const char *)sk + SKC_DADDR_OFF);
    }
}

/* The send/recv pair: the process's own thread, so the tgid filter applies here. */
static __always_inline int on_length(const void *sk, u16 family, u16 protocol, int ret, int is_tx)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!proc_on(tgid))
        return 0;
    if (protocol != CCLD_IPPROTO_TCP || (family != CCLD_AF_INET && family != CCLD_AF_INET6))
        return 0;
    u64 key = (u64)sk;
    struct conn *c = conns.lookup(&key);
    if (!c) {
        struct conn fresh = {};
        fresh.tgid = tgid;
        read_tuple(&fresh, sk);
        if (fresh.state == CCLD_TCP_CLOSE)
            return 0;  /* a socket already closed (e.g. a recv after a reset): not a connection to track */
        conns.update(&key, &fresh);
        c = conns.lookup(&key);
        if (!c)
            return 0;
    }
    if (!sock_on(key))
        sock_mark(key);  /* after the agent rebuilt the bitmap without it: set again */
    u64 now = bpf_ktime_get_ns();
    if (ret > 0) {
        if (is_tx) {
            __sync_fetch_and_add(&c->tx_bytes, (u64)ret);
            __sync_fetch_and_add(&c->tx_calls, 1);
            c->last_tx_ns = now;
        } else {
            __sync_fetch_and_add(&c->rx_bytes, (u64)ret);
            __sync_fetch_and_add(&c->rx_calls, 1);
            c->last_rx_ns = now;
        }
    } else if (ret < 0 && ret != -CCLD_EAGAIN) {  /* EAGAIN is a non-blocking socket's "not now" */
        if (is_tx)
            __sync_fetch_and_add(&c->tx_errs, 1);
        else
            __sync_fetch_and_add(&c->rx_errs, 1);
    }
    return 0;
}

TRACEPOINT_PROBE(sock, sock_send_length)
{
    return on_length(args->sk, args->family, args->protocol, args->ret, 1);
}

TRACEPOINT_PROBE(sock, sock_recv_length)
{
    return on_length(args->sk, args->family, args->protocol, args->ret, 0);
}

TRACEPOINT_PROBE(tcp, tcp_probe)
{
    u64 key = (u64)args->skaddr;
    if (!sock_on(key))
        return 0;
    struct conn *c = conns.lookup(&key);
    if (!c || c->state == CCLD_TCP_CLOSE)
        return 0;
    c->srtt_us = args->srtt;  /* the tracepoint already shifts tp->srtt_us >> 3: microseconds */
    c->cwnd = args->snd_cwnd;
    return 0;
}

TRACEPOINT_PROBE(tcp, tcp_retransmit_skb)
{
    u64 key = (u64)args->skaddr;
    if (!sock_on(key))
        return 0;
    struct conn *c = conns.lookup(&key);
    if (c && c->state != CCLD_TCP_CLOSE)
        __sync_fetch_and_add(&c->retrans, 1);
    return 0;
}

TRACEPOINT_PROBE(tcp, tcp_receive_reset)
{
    u64 key = (u64)args->skaddr;
    if (!sock_on(key))
        return 0;
    struct conn *c = conns.lookup(&key);
    if (c && c->state != CCLD_TCP_CLOSE)
        __sync_fetch_and_add(&c->resets, 1);
    return 0;
}

TRACEPOINT_PROBE(tcp, tcp_send_reset)
{
    u64 key = (u64)args->skaddr;
    if (!sock_on(key))
        return 0;
    struct conn *c = conns.lookup(&key);
    if (c && c->state != CCLD_TCP_CLOSE)
        __sync_fetch_and_add(&c->resets, 1);
    return 0;
}

TRACEPOINT_PROBE(sock, inet_sock_set_state)
{
    u64 key = (u64)args->skaddr;
    if (!sock_on(key) || args->protocol != CCLD_IPPROTO_TCP)
        return 0;
    struct conn *c = conns.lookup(&key);
    /* A CLOSE entry is finished: the agent ships and deletes it. Until then the freed socket's memory
     * may already belong to someone else's new socket, whose changes must not land here. */
    if (c && c->state != CCLD_TCP_CLOSE)
        c->state = args->newstate;
    return 0;
}
