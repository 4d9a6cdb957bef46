/* rdma.bpf.c: the queue-pair control path of libibverbs (InfiniBand and RoCE), one record per call.
 *
 * NCCL's IB transport moves data with RDMA writes that user space posts straight to the NIC, so no
 * byte of it passes the kernel and no socket probe sees it. What does pass through a function we can
 * probe is the control path: a queue pair (QP) is created, moved RESET -> INIT -> RTR -> RTS, and
 * destroyed. The move to RTR names the remote end (its QP number and GID/LID), which ties a local QP
 * to the QP of a peer rank. These calls happen while connections are set up, never per message.
 *
 * Attach points (entry-only uprobes on libibverbs.so.1, the default IBVERBS_1.1 version of each
 * symbol; ccld/bpf/rdma.py skips the IBVERBS_1.0 compat entries, which take another struct layout and
 * call the 1.1 function anyway):
 *   create_qp   ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *init)
 *                 -> RDMA_QP_CREATE {pd, qp_type, dev}: the QP number is not known yet at entry
 *   modify_qp   ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask)
 *                 -> RDMA_QP_MODIFY {qp, qp_num, attr_mask, state, dest_qp_num, dlid, port, ah_port,
 *                    is_global, dgid, dev}; each attribute only when attr_mask says it is valid
 *   destroy_qp  ibv_destroy_qp(struct ibv_qp *qp) -> RDMA_QP_DESTROY {qp, qp_num, dev}
 *
 * Entry only, no uretprobes (see the platform notes): the call's result is not seen, so a record means
 * "the process asked for this", not that the NIC accepted it. A QP's number first appears in the
 * ibv_modify_qp that moves it to INIT, which every QP goes through before it can be used.
 *
 * Struct fields are read at their offsets in rdma-core's public <infiniband/verbs.h> (x86-64), a
 * stable ABI since libibverbs 1.1 (2006); the defaults below were computed with offsetof() against
 * rdma-core 44 and can be overridden with -D. `dev` is ibv_device.name (e.g. "mlx5_0"), reached
 * through the object's context: it names the NIC whose /sys/class/infiniband counters carry the QP.
 *
 * Maps: events (ringbuf, records), lost (per-CPU loss counter), traced (tgids to report; the probes
 * are attached once per library for every process that maps it).
 * Minimum kernel: 5.8 (ring buffer); uprobes.
 */
#include <uapi/linux/ptrace.h>
#ifndef CCLD_REC_SIZE
#define CCLD_REC_SIZE 112  /* the largest record (rdma_qp_modify): every record takes this room */
#endif
#ifndef CCLD_RINGBUF_PAGES
#define CCLD_RINGBUF_PAGES 64  /* 256 KiB: records come at connection set-up only */
#endif
#include "common.h"

#ifndef CCLD_DEV_NAME_LEN
#define CCLD_DEV_NAME_LEN 32 /* ibv_device.name holds 64; real names ("mlx5_0", "rocep65s0f0") fit in 32 */
#endif

/* struct ibv_qp */
#ifndef IBV_QP_CONTEXT_OFF
#define IBV_QP_CONTEXT_OFF 0   /* struct ibv_context *context */
#endif
#ifndef IBV_QP_NUM_OFF
#define IBV_QP_NUM_OFF 52      /* uint32_t qp_num */
#endif
/* struct ibv_pd */
#ifndef IBV_PD_CONTEXT_OFF
#define IBV_PD_CONTEXT_OFF 0   /* struct ibv_context *context */
#endif
/* struct ibv_context / struct ibv_device */
#ifndef IBV_CONTEXT_DEVICE_OFF
#define IBV_CONTEXT_DEVICE_OFF 0  /* struct ibv_device *device */
#endif
#ifndef IBV_DEVICE_NAME_OFF
#define IBV_DEVICE_NAME_OFF 24    /* char name[IBV_SYSFS_NAME_MAX] */
#endif
/* struct ibv_qp_init_attr */
#ifndef IBV_INIT_QP_TYPE_OFF
#define IBV_INIT_QP_TYPE_OFF 52   /* enum ibv_qp_type qp_type */
#endif
/* struct ibv_qp_attr */
#ifndef IBV_ATTR_STATE_OFF
#define IBV_ATTR_STATE_OFF 0      /* enum ibv_qp_state qp_state */
#endif
#ifndef IBV_ATTR_DEST_QPN_OFF
#define IBV_ATTR_DEST_QPN_OFF 28  /* uint32_t dest_qp_num */
#endif
#ifndef IBV_ATTR_AH_OFF
#define IBV_ATTR_AH_OFF 56        /* struct ibv_ah_attr ah_attr */
#endif
#ifndef IBV_ATTR_PORT_OFF
#define IBV_ATTR_PORT_OFF 129     /* uint8_t port_num */
#endif
/* struct ibv_ah_attr (grh, a struct ibv_global_route, is its first member; dgid is grh's first) */
#ifndef IBV_AH_DGID_OFF
#define IBV_AH_DGID_OFF 0         /* union ibv_gid grh.dgid, 16 bytes */
#endif
#ifndef IBV_AH_DLID_OFF
#define IBV_AH_DLID_OFF 24        /* uint16_t dlid */
#endif
#ifndef IBV_AH_IS_GLOBAL_OFF
#define IBV_AH_IS_GLOBAL_OFF 29   /* uint8_t is_global: grh (and so dgid) is valid */
#endif
#ifndef IBV_AH_PORT_OFF
#define IBV_AH_PORT_OFF 30        /* uint8_t port_num */
#endif

/* enum ibv_qp_attr_mask bits (verbs.h) */
#define IBV_QP_STATE (1 << 0)
#define IBV_QP_PORT (1 << 5)
#define IBV_QP_AV (1 << 7)
#define IBV_QP_DEST_QPN (1 << 20)

enum rdma_kind {
    RDMA_QP_CREATE = 1,
    RDMA_QP_MODIFY = 2,
    RDMA_QP_DESTROY = 3,
};

struct rdma_qp_create {
    struct ccld_hdr hdr;
    u64 pd;
    s32 qp_type;  /* enum ibv_qp_type: 2 RC, 3 UC, 4 UD, ... */
    u32 pad;
    char dev[CCLD_DEV_NAME_LEN];
};
_Static_assert(sizeof(struct rdma_qp_create) == 24 + 16 + CCLD_DEV_NAME_LEN, "rdma_qp_create");

struct rdma_qp_modify {
    struct ccld_hdr hdr;
    u64 qp;
    u32 qp_num;
    u32 attr_mask;
    s32 state;        /* enum ibv_qp_state, -1 unless IBV_QP_STATE */
    s32 dest_qp_num;  /* -1 unless IBV_QP_DEST_QPN (QP numbers are 24 bits) */
    s32 dlid;         /* -1 unless IBV_QP_AV; 0 on RoCE, where the GID addresses the peer */
    s32 port;         /* attr->port_num, -1 unless IBV_QP_PORT */
    s32 ah_port;      /* attr->ah_attr.port_num, -1 unless IBV_QP_AV */
    u8 is_global;     /* attr->ah_attr.is_global under IBV_QP_AV: dgid is valid */
    u8 pad[3];
    u8 dgid[16];      /* zero unless is_global */
    char dev[CCLD_DEV_NAME_LEN];
};
_Static_assert(sizeof(struct rdma_qp_modify) == 24 + 40 + 16 + CCLD_DEV_NAME_LEN, "rdma_qp_modify");

struct rdma_qp_destroy {
    struct ccld_hdr hdr;
    u64 qp;
    u32 qp_num;
    u32 pad;
    char dev[CCLD_DEV_NAME_LEN];
};
_Static_assert(sizeof(struct rdma_qp_destroy) == 24 + 16 + CCLD_DEV_NAME_LEN, "rdma_qp_destroy");

BPF_RINGBUF_OUTPUT(events, CCLD_RINGBUF_PAGES);
BPF_PERCPU_ARRAY(lost, u64, 1);  /* records the ring buffer had no room for; slot 0 */

#ifndef CCLD_MAX_PROCS
#define CCLD_MAX_PROCS 4096
#endif
BPF_HASH(traced, u32, u8, CCLD_MAX_PROCS);

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

/* ibv_device.name of the context at `obj + ctx_off` (a pd's or a qp's); "" when any pointer is bad.
 * Every read is bpf_probe_read_user: the pointers come from the traced process and may be garbage. */
static __always_inline void read_dev_name(char *dst, u64 obj, u32 ctx_off)
{
    u64 ctx = 0, dev = 0;
    dst[0] = 0;
    if (!obj || bpf_probe_read_user(&ctx, sizeof(ctx), (void *)(obj + ctx_off)) || !ctx)
        return;
    if (bpf_probe_read_user(&dev, sizeof(dev), (void *)(ctx + IBV_CONTEXT_DEVICE_OFF)) || !dev)
        return;
    if (bpf_probe_read_user_str(dst, CCLD_DEV_NAME_LEN, (void *)(dev + IBV_DEVICE_NAME_OFF)) < 0)
        dst[0] = 0;
}

int create_qp(struct pt_regs *ctx)
{
    if (ccld_untraced())
        return 0;
    struct rdma_qp_create *r = events.ringbuf_reserve(CCLD_REC_SIZE);
    CCLD_FILL_OR_LOST(r, RDMA_QP_CREATE);
    u64 pd = PT_REGS_PARM1(ctx);
    u64 init = PT_REGS_PARM2(ctx);
    r->pd = pd;
    r->pad = 0;
    r->qp_type = -1;
    if (init)
        bpf_probe_read_user(&r->qp_type, sizeof(r->qp_type), (void *)(init + IBV_INIT_QP_TYPE_OFF));
    read_dev_name(r->dev, pd, IBV_PD_CONTEXT_OFF);
    events.ringbuf_submit(r, CCLD_SUBMIT_FLAGS);
    return 0;
}

int modify_qp(struct pt_regs *ctx)
{
    if (ccld_untraced())
        return 0;
    struct rdma_qp_modify *r = events.ringbuf_reserve(CCLD_REC_SIZE);
    CCLD_FILL_OR_LOST(r, RDMA_QP_MODIFY);
    u64 qp = PT_REGS_PARM1(ctx);
    u64 attr = PT_REGS_PARM2(ctx);
    u32 mask = (u32)PT_REGS_PARM3(ctx);
    r->qp = qp;
    r->attr_mask = mask;
    r->qp_num = 0;
    if (qp)
        bpf_probe_read_user(&r->qp_num, sizeof(r->qp_num), (void *)(qp + IBV_QP_NUM_OFF));
    read_dev_name(r->dev, qp, IBV_QP_CONTEXT_OFF);

    r->state = r->dest_qp_num = r->dlid = r->port = r->ah_port = -1;
    r->is_global = 0;
    r->pad[0] = r->pad[1] = r->pad[2] = 0;
    __builtin_memset(r->dgid, 0, sizeof(r->dgid));
    if (!attr)
        goto out;
    /* Fields the mask does not name hold whatever the caller left there: never report them. */
    if (mask & IBV_QP_STATE) {
        u32 v = 0;
        if (!bpf_probe_read_user(&v, sizeof(v), (void *)(attr + IBV_ATTR_STATE_OFF)))
            r->state = (s32)v;
    }
    if (mask & IBV_QP_DEST_QPN) {
        u32 v = 0;
        if (!bpf_probe_read_user(&v, sizeof(v), (void *)(attr + IBV_ATTR_DEST_QPN_OFF)))
            r->dest_qp_num = (s32)(v & 0xffffff);
    }
    if (mask & IBV_QP_PORT) {
        u8 v = 0;
        if (!bpf_probe_read_user(&v, sizeof(v), (void *)(attr + IBV_ATTR_PORT_OFF)))
            r->port = v;
    }
    if (mask & IBV_QP_AV) {
        u64 ah = attr + IBV_ATTR_AH_OFF;
        u16 lid = 0;
        u8 v = 0;
        if (!bpf_probe_read_user(&lid, sizeof(lid), (void *)(ah + IBV_AH_DLID_OFF)))
            r->dlid = lid;
        if (!bpf_probe_read_user(&v, sizeof(v), (void *)(ah + IBV_AH_PORT_OFF)))
            r->ah_port = v;
        v = 0;
        bpf_probe_read_user(&v, sizeof(v), (void *)(ah + IBV_AH_IS_GLOBAL_OFF));
        if (v && !bpf_probe_read_user(r->dgid, sizeof(r->dgid), (void *)(ah + IBV_AH_DGID_OFF)))
            r->is_global = 1;
        else
            __builtin_memset(r->dgid, 0, sizeof(r->dgid));
    }
out:
    events.ringbuf_submit(r, CCLD_SUBMIT_FLAGS);
    return 0;
}

int destroy_qp(struct pt_regs *ctx)
{
    if (ccld_untraced())
        return 0;
    struct rdma_qp_destroy *r = events.ringbuf_reserve(CCLD_REC_SIZE);
    CCLD_FILL_OR_LOST(r, RDMA_QP_DESTROY);
    u64 qp = PT_REGS_PARM1(ctx);
    r->qp = qp;
    r->pad = 0;
    r->qp_num = 0;
    if (qp)
        bpf_probe_read_user(&r->qp_num, sizeof(r->qp_num), (void *)(qp + IBV_QP_NUM_OFF));
    read_dev_name(r->dev, qp, IBV_QP_CONTEXT_OFF);
    events.ringbuf_submit(r, CCLD_SUBMIT_FLAGS);
    return 0;
}
