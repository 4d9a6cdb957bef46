#!/usr/bin/env bash
# Installs everything ccld and its tests need on a fresh Debian 12 / Ubuntu machine (as root):
# Debian's bcc and kernel headers, then a virtualenv at .venv with ccld, torch (CPU) and the test tools.
# Idempotent: a second run only checks. Set CCLD_SKIP_APT=1 to skip the Debian packages.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

if [[ "${CCLD_SKIP_APT:-0}" != 1 ]]; then
  # chromium: the e2e test that opens `ccld report`'s page headless
  # libibverbs1: the RDMA probe test drives the real library (no device needed); libibverbs-dev: its
  # <infiniband/verbs.h>, against which a unit test checks the struct offsets rdma.bpf.c reads
  # tmux: the test that drives `ccld top` in a real terminal; systemd: `systemd-analyze verify` of deploy/systemd
  # g++, binutils (nm): the pgnccl tests build a library with torch's ProcessGroupNCCL symbols and read them
  pkgs=(python3-bpfcc linux-headers-amd64 bpftool iproute2 iptables procps python3-venv chromium
        libibverbs1 libibverbs-dev tmux systemd g++ binutils)
  # gcc, libc6-dev, python3-dev build the export's C accelerator (ccld/export/_hotpath.c); without them
  # it runs in Python, so without root they are only asked for, not required
  optional=(gcc libc6-dev python3-dev)
  for p in "${optional[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 && continue
    if [[ $(id -u) == 0 ]]; then pkgs+=("$p"); else say "optional: $p is missing (the export's C accelerator needs it)"; fi
  done
  missing=()
  for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if ((${#missing[@]})); then
    if [[ $(id -u) != 0 ]]; then
      echo "setup: need root to install Debian packages: ${missing[*]} (run with sudo)" >&2; exit 1
    fi
    say "installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi

PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  say "creating .venv with $($PY --version)"
  $PY -m venv .venv
fi
say "installing ccld, torch==2.13.0 (CPU), NCCL's library (for the probe tests; no GPU needed), cupti-python and test tools into .venv"
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q torch==2.13.0 nvidia-nccl-cu12==2.32.3 -e '.[test,cupti]'

# bcc ships as a Debian Python package; link it into the venv instead of exposing all of dist-packages.
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [[ -d /usr/lib/python3/dist-packages/bcc && ! -e "$site/bcc" ]]; then
  ln -s /usr/lib/python3/dist-packages/bcc "$site/bcc"
fi
.venv/bin/python -c 'import bcc' 2>/dev/null && say "bcc importable in .venv" || say "bcc NOT importable (eBPF sources will be off)"
.venv/bin/python -c 'from ccld.export import accel; assert accel.hot' 2>/dev/null && say "export accelerator built" \
  || say "export accelerator NOT built (no C compiler or Python headers?): ccld export runs in Python"
# ccld's NCCL profiler plugin (ccld/ncclprof/): built where there is a C compiler; without it `ccld run`
# leaves NCCL's profiler alone
if out=$(.venv/bin/python -m ccld.ncclprof.build ccld/ncclprof 2>&1); then say "NCCL profiler plugin built: $out"
else say "NCCL profiler plugin NOT built ($out)"; fi
say "done: .venv/bin/ccld is ready"
