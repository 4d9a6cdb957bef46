"""Call libibverbs' queue-pair API with known arguments, without an RDMA device.

Drives the RDMA probe tests (tests/bpf/test_rdma_probes.py). It loads Debian's real libibverbs.so.1
with ctypes (path from --lib), builds the objects a provider would (device, context, pd, qp) in
ctypes buffers, prints one `ready {json}` line, waits for --go-file, makes the calls in the plan, and
prints `done {json}` with every return value. Exit status 0 unless the library could not be loaded.

Why it is safe: libibverbs does nothing itself in these calls; it jumps to the provider's function
in the context's ops table. Every slot of our fake provider table (and of the legacy ibv_context.ops,
which older libibverbs call) holds one ctypes callback that returns EOPNOTSUPP, so each call returns
an error without touching anything (ibv_create_qp returns the callback's value as its pointer: the
workload only prints it). We fill whole tables rather than pick slots so the fake does not depend on
rdma-core's private layout of its ops; only the public verbs.h layout (offsets below) is assumed.
Buffers start as 0xEE bytes, so a field the probe reads without its attr_mask bit shows up as garbage.
"""
import argparse
import ctypes as ct
import json
import os
import struct
import sys
import time

EOPNOTSUPP = 95
DEVICE_NAME = b"ccld_fake0"

# Public x86-64 layout of rdma-core's <infiniband/verbs.h> (offsetof against rdma-core 44).
VERBS_CONTEXT_SIZE, CONTEXT_IN_VERBS_CONTEXT = 648, 320  # struct verbs_context; its last member is ibv_context
CONTEXT_OPS_OFF, CONTEXT_OPS_SIZE = 8, 256                # ibv_context.ops (legacy provider table)
DEVICE_SIZE, DEVICE_NAME_OFF = 664, 24                    # struct ibv_device, name[64]
PD_SIZE, QP_SIZE, QP_NUM_OFF, QP_STATE_OFF, QP_TYPE_OFF = 16, 160, 52, 56, 60
INIT_ATTR_SIZE, INIT_QP_TYPE_OFF = 64, 52
ATTR_SIZE, ATTR_STATE_OFF, ATTR_DEST_QPN_OFF, ATTR_AH_OFF, ATTR_PORT_OFF = 144, 0, 28, 56, 129
AH_DGID_OFF, AH_DLID_OFF, AH_IS_GLOBAL_OFF, AH_PORT_OFF = 0, 24, 29, 30
PRIV_SIZE = 4096                                          # stand-in for rdma-core's private verbs_ex_private

# enum ibv_qp_attr_mask / ibv_qp_state / ibv_qp_type
QP_STATE, QP_ACCESS_FLAGS, QP_PKEY_INDEX, QP_PORT, QP_AV = 1, 1 << 3, 1 << 4, 1 << 5, 1 << 7
QP_PATH_MTU, QP_TIMEOUT, QP_RETRY_CNT, QP_RNR_RETRY, QP_RQ_PSN = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
QP_MAX_QP_RD_ATOMIC, QP_MIN_RNR_TIMER, QP_SQ_PSN, QP_MAX_DEST_RD_ATOMIC, QP_DEST_QPN = (
    1 << 13, 1 << 15, 1 << 16, 1 << 17, 1 << 20)
RESET, INIT, RTR, RTS = 0, 1, 2, 3
RC, UD = 2, 4

MASK_INIT = QP_STATE | QP_PKEY_INDEX | QP_PORT | QP_ACCESS_FLAGS
MASK_RTR = QP_STATE | QP_AV | QP_PATH_MTU | QP_DEST_QPN | QP_RQ_PSN | QP_MAX_DEST_RD_ATOMIC | QP_MIN_RNR_TIMER
MASK_RTS = QP_STATE | QP_TIMEOUT | QP_RETRY_CNT | QP_RNR_RETRY | QP_SQ_PSN | QP_MAX_QP_RD_ATOMIC
MASK_TIMEOUT = QP_TIMEOUT

# Two QPs, set up the way NCCL sets up its connections: A over RoCE (the GID addresses the peer, LID 0),
# B over InfiniBand without a GRH (the LID addresses the peer). QP numbers are 24 bits.
QP_A, QP_B = 0x000ABC, 0x123456
GID_A = bytes.fromhex("00000000000000000000ffff0a000207")  # RoCE v2: ::ffff:10.0.2.7
# One call per line: (label, qp, attr fields, attr_mask). Fields not in the mask stay 0xEE garbage,
# except where noted, so a probe that ignores the mask reads a value the test would not expect.
PLAN = [
    ("create", "rc", None, None),
    ("create", "ud", None, None),
    ("modify", "A", dict(state=INIT, port=1, dest_qpn=0x00EEEE), MASK_INIT),  # dest_qpn set but not masked
    ("modify", "A", dict(state=RTR, dest_qpn=0x0BEEF0, gid=GID_A, is_global=1, dlid=0, ah_port=1,
                         port=9), MASK_RTR),  # port set but not masked: the address vector's port counts
    ("modify", "A", dict(state=RTS), MASK_RTS),
    ("modify", "B", dict(state=INIT, port=2), MASK_INIT),
    ("modify", "B", dict(state=RTR, dest_qpn=0x654321, is_global=0, dlid=0x1234, ah_port=2), MASK_RTR),
    ("modify", "B", dict(state=RTS), MASK_RTS),
    ("modify", "B", dict(state=RTR), MASK_TIMEOUT),  # no IBV_QP_STATE: the state must not be reported
    ("destroy", "B", None, None),
]


def addr(buf) -> int:
    return ct.addressof(buf)


def put(buf, off: int, fmt: str, value) -> None:
    struct.pack_into(fmt, buf, off, value)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default="libibverbs.so.1")
    ap.add_argument("--go-file", default="")
    ap.add_argument("--go-timeout-s", type=float, default=120)
    a = ap.parse_args()

    lib = ct.CDLL(a.lib)
    vp = ct.c_void_p
    lib.ibv_create_qp.argtypes, lib.ibv_create_qp.restype = [vp, vp], vp
    lib.ibv_modify_qp.argtypes, lib.ibv_modify_qp.restype = [vp, vp, ct.c_int], ct.c_int
    lib.ibv_destroy_qp.argtypes, lib.ibv_destroy_qp.restype = [vp], ct.c_int

    provider_calls = []
    # Accepts and ignores the provider function's arguments (SysV: they are in registers).
    op = ct.CFUNCTYPE(ct.c_uint64)(lambda: provider_calls.append(1) or EOPNOTSUPP)
    op_addr = ct.cast(op, vp).value

    priv = ct.create_string_buffer(PRIV_SIZE)
    for off in range(0, PRIV_SIZE, 8):
        put(priv, off, "<Q", op_addr)
    device = ct.create_string_buffer(b"\xee" * DEVICE_SIZE, DEVICE_SIZE)
    ct.memmove(addr(device) + DEVICE_NAME_OFF, DEVICE_NAME + b"\0", len(DEVICE_NAME) + 1)
    vctx = ct.create_string_buffer(VERBS_CONTEXT_SIZE)
    for off in range(0, CONTEXT_IN_VERBS_CONTEXT, 8):  # every field before ibv_context (priv among them)
        put(vctx, off, "<Q", addr(priv))
    context = addr(vctx) + CONTEXT_IN_VERBS_CONTEXT
    put(vctx, CONTEXT_IN_VERBS_CONTEXT, "<Q", addr(device))
    for off in range(CONTEXT_OPS_OFF, CONTEXT_OPS_OFF + CONTEXT_OPS_SIZE, 8):
        put(vctx, CONTEXT_IN_VERBS_CONTEXT + off, "<Q", op_addr)

    pd = ct.create_string_buffer(PD_SIZE)
    put(pd, 0, "<Q", context)
    qps = {}
    for label, num in (("A", QP_A), ("B", QP_B)):
        qp = ct.create_string_buffer(b"\xee" * QP_SIZE, QP_SIZE)
        put(qp, 0, "<Q", context)
        put(qp, QP_NUM_OFF, "<I", num)
        put(qp, QP_STATE_OFF, "<I", RESET)
        put(qp, QP_TYPE_OFF, "<I", RC)
        qps[label] = qp
    inits = {}
    for label, qp_type in (("rc", RC), ("ud", UD)):
        ia = ct.create_string_buffer(b"\xee" * INIT_ATTR_SIZE, INIT_ATTR_SIZE)
        put(ia, INIT_QP_TYPE_OFF, "<I", qp_type)
        inits[label] = ia

    attrs = []
    for kind, _, fields, _ in PLAN:
        if kind != "modify":
            attrs.append(None)
            continue
        at = ct.create_string_buffer(b"\xee" * ATTR_SIZE, ATTR_SIZE)
        put(at, ATTR_STATE_OFF, "<I", fields["state"])
        if "dest_qpn" in fields:
            put(at, ATTR_DEST_QPN_OFF, "<I", fields["dest_qpn"])
        if "port" in fields:
            put(at, ATTR_PORT_OFF, "<B", fields["port"])
        ah = ATTR_AH_OFF
        if "is_global" in fields:
            put(at, ah + AH_IS_GLOBAL_OFF, "<B", fields["is_global"])
            ct.memmove(addr(at) + ah + AH_DGID_OFF, fields.get("gid", b"\x11" * 16), 16)
        if "dlid" in fields:
            put(at, ah + AH_DLID_OFF, "<H", fields["dlid"])
        if "ah_port" in fields:
            put(at, ah + AH_PORT_OFF, "<B", fields["ah_port"])
        attrs.append(at)

    print("ready " + json.dumps({"pid": os.getpid(), "pd": addr(pd), "qp": {k: addr(v) for k, v in qps.items()},
                                 "device": DEVICE_NAME.decode()}), flush=True)
    if a.go_file:
        deadline = time.monotonic() + a.go_timeout_s
        while not os.path.exists(a.go_file):
            if time.monotonic() > deadline:
                print("no go file", file=sys.stderr)
                return 2
            time.sleep(0.01)

    rcs = []
    for (kind, which, _, mask), at in zip(PLAN, attrs):
        if kind == "create":
            rcs.append(lib.ibv_create_qp(addr(pd), addr(inits[which])) or 0)
        elif kind == "modify":
            rcs.append(lib.ibv_modify_qp(addr(qps[which]), addr(at), mask))
        else:
            rcs.append(lib.ibv_destroy_qp(addr(qps[which])))
    states = {k: struct.unpack_from("<I", v, QP_STATE_OFF)[0] for k, v in qps.items()}
    print("done " + json.dumps({"rcs": rcs, "provider_calls": len(provider_calls), "qp_states": states}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
