#!/usr/bin/env bash
# bench/gpu_check.sh: everything about CUPTI that needs a GPU, in one run. Installs nothing.
#
#   1. preflight: GPU, python, torch (CUDA), cupti-python, pyzmq, msgpack, pytest; says what is missing
#   2. the gpu-marked tests (tests/gpu/): the injected shim on compute kernels and on NCCL all-reduces
#      over two communicators in one process (world size 1: one GPU allows no more), and `ccld run`
#      end to end; a skip there is a failure (CCLD_REQUIRE_TIERS=gpu)
#   3. bench/cupti_overhead.py: off / NCCL-only / all-kernels capture, ratios in one run
#
# Results go to $OUT when it is set (gpu_tests.log, cupti_gpu_*.json, cupti_overhead.{txt,json,md},
# gpu_check.txt) and a short table is printed at the end. Exit status: 0 all passed, 1 a test or the
# benchmark failed, 2 the machine lacks something (nothing was run).
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
#   bash bench/gpu_check.sh [--preflight]   (--preflight: step 1 only)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
OUT=${OUT:-}
[[ -n "$OUT" ]] && mkdir -p "$OUT"
REPORT=$(mktemp)
say() { printf '[gpu_check] %s\n' "$*" | tee -a "$REPORT"; }
to_out() { [[ -n "$OUT" ]] && cp "$1" "$OUT/$2"; return 0; }

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
if ((${#missing[@]})); then
  say "missing: ${missing[*]}"
  say "carry the missing wheels as this script's header says; nothing was run"
  to_out "$REPORT" gpu_check.txt
  exit 2
fi
[[ "${1:-}" == "--preflight" ]] && { to_out "$REPORT" gpu_check.txt; exit 0; }

# ---- 2. the gpu tests ----------------------------------------------------------------------------
status=0
LOG=$(mktemp)
say "running the gpu tests (tests/gpu)"
CCLD_REQUIRE_TIERS=gpu timeout 420 $PY -m pytest -m gpu -rA -p no:cacheprovider -o addopts= tests/gpu 2>&1 | tee "$LOG"
tests_rc=${PIPESTATUS[0]}
to_out "$LOG" gpu_tests.log
tests_line=$(tail -1 "$LOG")
say "gpu tests: exit $tests_rc; ${tests_line:-no summary line}"
((tests_rc == 0)) || status=1

# ---- 3. overhead ---------------------------------------------------------------------------------
say "running bench/cupti_overhead.py"
BLOG=$(mktemp)
timeout 240 $PY bench/cupti_overhead.py --rounds 7 --kernels 50000 --allreduces 5000 2>&1 | tee "$BLOG"  # writes to $OUT
bench_rc=${PIPESTATUS[0]}
((bench_rc == 0)) || status=1

# ---- summary -------------------------------------------------------------------------------------
say "---------------------------------------------------------------------------"
say "gpu tests: $([[ $tests_rc == 0 ]] && echo PASS || echo "FAIL (exit $tests_rc)")"
grep -E '^(PASSED|FAILED|ERROR|SKIPPED) ' "$LOG" | sed 's/^/[gpu_check]   /' | tee -a "$REPORT"
say "overhead: $([[ $bench_rc == 0 ]] && echo done || echo "FAIL (exit $bench_rc)")"
sed -n '/^workload/,/^NCCL-only/p' "$BLOG" | sed 's/^/[gpu_check]   /' | tee -a "$REPORT"
to_out "$REPORT" gpu_check.txt
rm -f "$LOG" "$BLOG" "$REPORT"
exit $status
