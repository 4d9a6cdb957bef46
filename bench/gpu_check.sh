#!/usr/bin/env bash
# bench/gpu_check.sh: everything about CUPTI and ccld's NCCL profiler plugin that needs a GPU, in one
# run. Installs nothing.
#
#   1. preflight: GPU, python, torch (CUDA), the NCCL torch loaded, cupti-python, pyzmq, msgpack, pytest
#      (says what is missing); a C compiler and the NCCL profiler plugin built from this tree (a failed
#      build is said, not fatal: the plugin's test then fails and its benchmark is not run)
#   2. the gpu-marked tests (tests/gpu/): the injected shim on compute kernels and on NCCL all-reduces
#      over two communicators in one process (world size 1: one GPU allows no more), and `ccld run`
#      end to end; the NCCL profiler plugin loaded by torch's NCCL (test_ncclprof_gpu.py: two
#      communicators, sends/receives to self; two ranks on the GPU where NCCL >= 2.30 allows it, else
#      that NCCL refuses them); a skip there is a failure (CCLD_REQUIRE_TIERS=gpu)
#   3. bench/cupti_overhead.py: off / NCCL-only / all-kernels capture, ratios in one run
#   4. bench/ncclprof_overhead.py: the plugin off / on, per-op time ratios in one run (one rank:
#      all-reduce, which NCCL reports nothing of, and all_to_all to self, which it does)
#
# Results go to $OUT when it is set (gpu_tests.log, cupti_gpu_*.json, ncclprof_gpu.json,
# cupti_overhead.{txt,json,md}, ncclprof_overhead.{txt,json,md}, gpu_check.txt) and a short table is
# printed at the end. A run brings back at most 8 files from $OUT, so at the end all but gpu_check.txt,
# gpu_tests.log, ncclprof_gpu.json, cupti_overhead.txt and ncclprof_overhead.txt are packed into
# gpu_check_details.tar.gz. Exit status: 0 all passed, 1 a test or a benchmark failed, 2 the machine
# lacks something (nothing was run).
#
# On the device machine of this workplace, which has torch (CUDA) but neither cupti-python nor pyzmq,
# carry their wheels (made here: `python3 -m pip download --no-deps --only-binary=:all:
# --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform
# manylinux_2_26_x86_64 --platform manylinux2014_x86_64 -d .whl cupti-python==13.0.1 pyzmq==27.3.0`,
# with /.whl/ in .git/info/exclude) and run, with carry [".whl"] and a timeout of ~570 s:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site || exit; bash bench/gpu_check.sh
#
# cupti-python 13.0.1, not the newest: it wants nvidia-cuda-cupti ~= 13.0 and cuda-bindings ~= 13.0,
# which torch's CUDA 13.0 build already brought, and CUDA 13.0 is what the machine's driver (580) runs.
#
# NCCL_PROFILER_PLUGIN takes the plugin's absolute path (NCCL dlopens it as given, up to 255 bytes).
# This script has not run on a GPU since step 1's plugin lines and steps 2 (test_ncclprof_gpu.py) and 4
# were added.
#
#   bash bench/gpu_check.sh [--preflight]   (--preflight: step 1 only)
# shellcheck disable=SC2086  # $PY unquoted on purpose: PYTHON may carry options ("python3 -X dev")
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
OUT=${OUT:-}
[[ -n "$OUT" ]] && mkdir -p "$OUT"
RES=${OUT:-$(mktemp -d)}  # the tests' and benchmarks' files: $OUT, or a temporary folder removed at the end
REPORT=$(mktemp)
PLUGIN_DIR=$(mktemp -d)
say() { printf '[gpu_check] %s\n' "$*" | tee -a "$REPORT"; }
to_out() { [[ -n "$OUT" ]] && cp "$1" "$OUT/$2"; return 0; }
cleanup() { rm -rf "$PLUGIN_DIR"; [[ -z "$OUT" ]] && rm -rf "$RES"; return 0; }
# A run brings back at most 8 files from $OUT: the details go into one archive, the summaries stay.
pack_out() {
  [[ -n "$OUT" ]] || return 0
  local f details=()
  for f in "$OUT"/*; do
    [[ -f "$f" ]] || continue
    case "${f##*/}" in
      gpu_check.txt|gpu_tests.log|ncclprof_gpu.json|cupti_overhead.txt|ncclprof_overhead.txt) ;;
      gpu_check_details.tar.gz) ;;
      *) details+=("${f##*/}") ;;
    esac
  done
  ((${#details[@]})) || return 0
  tar -czf "$OUT/gpu_check_details.tar.gz" -C "$OUT" "${details[@]}" && (cd "$OUT" && rm -f -- "${details[@]}")
}

# ---- 1. preflight --------------------------------------------------------------------------------
missing=()
if command -v nvidia-smi >/dev/null 2>&1; then
  say "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
else
  say "GPU: nvidia-smi not found"
fi
say "python: $($PY -c 'import sys; print(sys.version.split()[0], sys.executable)')"
torch_line=$($PY -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1 | tail -1)
say "torch: $torch_line"
[[ "$torch_line" == *"available True"* ]] || missing+=("a CUDA device visible to torch")
say "NCCL: $($PY - <<'PYNCCL' 2>&1 | tail -1
import torch
from ccld.ncclprof import loaded_nccl
path, v = loaded_nccl()  # the libnccl torch mapped, and its ncclGetVersion()
try:
    built = ".".join(map(str, torch.cuda.nccl.version()[:3]))
except (AttributeError, RuntimeError):
    built = "none"
print((".".join(map(str, v)) + " " + path if v else "not mapped") + "; torch built with " + built)
PYNCCL
)"
while read -r state mod rest; do
  say "$mod: $([[ $state == ok ]] && echo "$rest" || echo "NOT importable ($rest)")"
  [[ $state == ok ]] || missing+=("$mod")
done < <($PY - <<'PYCHECK' 2>&1
import importlib, importlib.metadata as md
for mod, dist in (("cupti.cupti", "cupti-python"), ("zmq", "pyzmq"), ("msgpack", "msgpack"), ("pytest", "pytest")):
    try:
        importlib.import_module(mod)
        print("ok", mod, dist, md.version(dist))
    except Exception as e:
        print("missing", mod, type(e).__name__ + ":", str(e).replace("\n", " ")[:200])
PYCHECK
)
# ccld's NCCL profiler plugin, built from this tree with the machine's C compiler (not fatal: the CUPTI
# checks need none; its test then fails and its benchmark is not run)
plugin_line=$($PY - "$PLUGIN_DIR" <<'PYPLUG' 2>&1 | tail -1
import shlex, subprocess, sys
from ccld.ncclprof import build
cc = build.compiler()
got = build.build(sys.argv[1])
try:
    ver = subprocess.run(shlex.split(cc) + ["--version"], capture_output=True, text=True).stdout.split("\n")[0]
except (OSError, TypeError, ValueError):
    ver = "?"
print(f"ok {got.path} ({cc}: {ver})" if got.path else f"fail {got.reason}")
PYPLUG
)
PLUGIN=""
if [[ "$plugin_line" == "ok "* ]]; then
  PLUGIN=$(cut -d' ' -f2 <<<"$plugin_line")
  say "NCCL profiler plugin: built, ${plugin_line#ok }"
else
  say "NCCL profiler plugin: NOT built (${plugin_line#fail }): its test will fail, its benchmark is not run"
fi
if ((${#missing[@]})); then
  say "missing: ${missing[*]}"
  say "carry the missing wheels as this script's header says; nothing was run"
  to_out "$REPORT" gpu_check.txt
  cleanup
  exit 2
fi
[[ "${1:-}" == "--preflight" ]] && { to_out "$REPORT" gpu_check.txt; cleanup; exit 0; }

# ---- 2. the gpu tests ----------------------------------------------------------------------------
status=0
LOG=$(mktemp)
say "running the gpu tests (tests/gpu)"
OUT="$RES" CCLD_REQUIRE_TIERS=gpu timeout 420 $PY -m pytest -m gpu -rA -p no:cacheprovider -o addopts= tests/gpu 2>&1 | tee "$LOG"
tests_rc=${PIPESTATUS[0]}
to_out "$LOG" gpu_tests.log
tests_line=$(tail -1 "$LOG")
say "gpu tests: exit $tests_rc; ${tests_line:-no summary line}"
((tests_rc == 0)) || status=1

# ---- 3. overhead ---------------------------------------------------------------------------------
say "running bench/cupti_overhead.py"
BLOG=$(mktemp)
OUT="$RES" timeout 240 $PY bench/cupti_overhead.py --rounds 7 --kernels 50000 --allreduces 5000 2>&1 | tee "$BLOG"  # writes to $OUT
bench_rc=${PIPESTATUS[0]}
((bench_rc == 0)) || status=1

# ---- 4. the NCCL profiler plugin's overhead ------------------------------------------------------
NLOG=$(mktemp)
if [[ -n "$PLUGIN" ]]; then
  say "running bench/ncclprof_overhead.py"
  timeout 150 $PY bench/ncclprof_overhead.py --rounds 7 --iters 3000 --plugin "$PLUGIN" --out "$RES" 2>&1 | tee "$NLOG"
  nbench_rc=${PIPESTATUS[0]}
  ((nbench_rc == 0)) || status=1
else
  nbench_rc=skipped
fi

# ---- summary -------------------------------------------------------------------------------------
say "---------------------------------------------------------------------------"
say "gpu tests: $([[ $tests_rc == 0 ]] && echo PASS || echo "FAIL (exit $tests_rc)")"
grep -E '^(PASSED|FAILED|ERROR|SKIPPED) ' "$LOG" | sed 's/^/[gpu_check]   /' | tee -a "$REPORT"
say "overhead: $([[ $bench_rc == 0 ]] && echo "done" || echo "FAIL (exit $bench_rc)")"
sed -n '/^workload/,/^NCCL-only/p' "$BLOG" | sed 's/^/[gpu_check]   /' | tee -a "$REPORT"
# the plugin: what NCCL picked, what arrived (from the test's evidence), and its overhead
while IFS= read -r line; do say "$line"; done < <($PY - "$RES/ncclprof_gpu.json" <<'PYSUM' 2>&1
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    print(f"NCCL profiler plugin: no evidence ({type(e).__name__}: the test did not get to run the job)")
    sys.exit()
print("NCCL profiler plugin, one rank: " + d.get("one_rank", {}).get("summary", "no summary"))
two = d.get("two_ranks")
if two:
    print("NCCL profiler plugin, two ranks: " + two.get("summary", "refused by NCCL (before 2.30), exit codes "
                                                    + str(two.get("refused_as_expected_before_2.30"))))
PYSUM
)
case "$nbench_rc" in
  0) say "plugin overhead: done" ;;
  skipped) say "plugin overhead: not run (the plugin was not built)" ;;
  *) say "plugin overhead: FAIL (exit $nbench_rc)" ;;
esac
sed -n '/^workload/,/^ncclprof overhead:/p' "$NLOG" | sed 's/^/[gpu_check]   /' | tee -a "$REPORT"
to_out "$REPORT" gpu_check.txt
pack_out
rm -f "$LOG" "$BLOG" "$NLOG" "$REPORT"
cleanup
exit $status
