#!/bin/bash
# Runs every GPU check (`oogc gpu-check`, DESIGN.md "GPU backends") on the GPU machine from
# dist/oogc-cuda/ as scripts/build-cuda.sh writes it there (the CUDA binary, run.sh, the swapper's
# tests and data/): one JSON row per check in OUT_DIR/gpu-check.jsonl and the Markdown report
# OUT_DIR/gpu-check.md, each written as its check finishes, so a cut-off run keeps what ran.
#
#   scripts/gpu-check.sh OUT_DIR [--quick] [--only N,M] [--budget-s S]
#
# --quick: checks 1–8 in under 3 minutes; without it all 11 in under 8 (the harness's own
# budgets: each check runs in a child process with a time budget and is killed past it, its row
# saying so; a check that cannot start in the time left is skipped). Exit status 0 only when no
# check failed. OOGC_GPU_DEVICE picks another device than cuda:0. The outer timeout is only a
# safety net for a hung harness (OOGC_GPU_CHECK_TIMEOUT seconds, default 590).
set -euo pipefail
if [ $# -lt 1 ] || [ "${1:0:1}" = "-" ]; then
  echo "usage: $0 OUT_DIR [--quick] [--only N,M] [--budget-s S]" >&2
  exit 2
fi
mkdir -p "$1"
OUT=$(cd "$1" && pwd)
shift
cd "$(dirname "$0")/.."
RUN=dist/oogc-cuda/run.sh
if [ ! -x "$RUN" ]; then
  echo "error: $RUN not found: build it with scripts/build-cuda.sh (on a machine with the toolchain) and carry dist/oogc-cuda here" >&2
  exit 1
fi
exec timeout --kill-after=10 "${OOGC_GPU_CHECK_TIMEOUT:-590}" \
  "$RUN" gpu-check --out "$OUT" --device "${OOGC_GPU_DEVICE:-cuda:0}" "$@"
