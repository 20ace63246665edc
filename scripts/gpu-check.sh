#!/bin/bash
# Every GPU check on a GPU machine, results into OUT_DIR: scripts/device-check.sh with OUT=OUT_DIR
# (the one way to run them; its header says what OUT_DIR then holds: gpu-check.md, gpu-check.jsonl,
# device-check.log, env.txt, gpu-check-files.tar.gz). For the device tool, call device-check.sh
# itself (README.md, "GPU").
#
#   scripts/gpu-check.sh OUT_DIR [--quick] [--only N,M] [--budget-s S]
#
# OOGC_GPU_DEVICE picks another device than cuda:0 (device-check.sh's OOGC_DEVICE).
set -euo pipefail
if [ $# -lt 1 ] || [ "${1:0:1}" = "-" ]; then
  echo "usage: $0 OUT_DIR [--quick] [--only N,M] [--budget-s S]" >&2
  exit 2
fi
mkdir -p "$1"
OUT=$(cd "$1" && pwd)
shift
export OUT OOGC_DEVICE=${OOGC_GPU_DEVICE:-${OOGC_DEVICE:-cuda:0}}
exec "$(dirname "$0")/device-check.sh" "$@"
