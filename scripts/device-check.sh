#!/bin/bash
# The device call: every GPU check (`oogc gpu-check`) on the GPU machine, its results packed into
# the few files the device tool brings back from $OUT (at most 8 files, each under 16 MiB, 64 MiB
# in all, none deeper than $OUT/a/b/file, names of letters, digits, '.', '_', '-'). From the
# repository root, with dist/oogc-cuda (scripts/build-cuda.sh) carried along:
#
#   device tool `run`:  command: scripts/device-check.sh   carry: ["dist/oogc-cuda"]   timeout_s: 600
#
#   scripts/device-check.sh [--quick] [--only N,M] [--device D] [--budget-s S] [other gpu-check options]
#
# The arguments go to `oogc gpu-check` (default: all 11 checks on cuda:0, the harness's budget
# 500 s, each check in a child with its own budget). gpu-check runs at most 540 s (then SIGTERM:
# the check in flight fails with its figures so far, the rest are skipped; SIGKILL 15 s later),
# so packing ends well inside the tool's 600 s. Whatever happens (a crash, the timeout, a
# signal), what exists is packed. $OUT afterwards, 5 or 6 files:
#
#   gpu-check.md            the Markdown report (header: date, git rev, device, driver; a line per check)
#   gpu-check.jsonl         one JSON row per check (each with its git_rev)
#   device-check.log        this script's and gpu-check's whole output (head and tail if over 15 MiB)
#   env.txt                 the machine: nvidia-smi, the driver, the binary's libraries, torch, disk
#   gpu-profile.toml        check 8's GPU profile (bf16/f32 TFLOP/s, copy-stream GB/s) for
#                           `oogc plan --profile`; on CUDA only (6 files then)
#   gpu-check-files.tar.gz  logs/ (each check's output), rows/ (rows, partial figures), traces/,
#                           work/ (the checks' subprocess outputs: swapper tests, peers, pip),
#                           BUILD.txt (dist's build record) and MANIFEST.txt (every file, and what
#                           was cut or dropped to keep it under 15 MiB; scripts/pack-capped.sh)
#
# Environment: OUT (required: the folder that comes back; the device tool sets it); OOGC_BIN (the
# binary, default dist/oogc-cuda/run.sh; CI: target/debug/oogc with --device sim); OOGC_DEVICE
# (default cuda:0, unless --device is given); OOGC_DEVICE_CHECK_DIR (reports and scratch, default
# /tmp/oogc-device-check, emptied first); OOGC_DEVICE_CHECK_LIMIT_S (gpu-check's hard limit, default
# 540; the default budget is 40 s less, half of it under 80 s). Exit status: gpu-check's when it failed (1: a check
# failed; 124: the hard limit), else 3 when $OUT breaks a limit, else 0.
set -uo pipefail
if [ -z "${OUT:-}" ]; then
  echo "error: OUT is not set: the folder whose files come back (the device tool sets it)" >&2
  echo "fix: OUT=\$(mktemp -d) $0 $*" >&2
  exit 2
fi
# Paths given relative to where it was called from, before moving to the repository's root.
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || { echo "error: cannot create OUT=$OUT" >&2; exit 2; }
BIN=${OOGC_BIN:-}
[ -n "$BIN" ] && [[ "$BIN" == */* ]] && [ -e "$BIN" ] && BIN=$(realpath -s "$BIN")
DIR=$(realpath -m "${OOGC_DEVICE_CHECK_DIR:-/tmp/oogc-device-check}")
cd "$(dirname "$0")/.."
REPO=$PWD
BIN=${BIN:-dist/oogc-cuda/run.sh}
LIMIT_S=${OOGC_DEVICE_CHECK_LIMIT_S:-540}
TAR_CAP=$((15 << 20)) LOG_CAP=$((15 << 20))
START_S=$(date +%s)
rm -rf "$DIR" && mkdir -p "$DIR/reports" "$DIR/work" "$DIR/pack" || exit 2
REPORTS=$DIR/reports WORK=$DIR/work

# The whole output, into $OUT as it goes (it comes back even if this script is killed) and on
# stdout (the tool shows its tail).
LOG=$OUT/device-check.log
exec 3>&1 4>&2
exec > >(tee "$LOG") 2>&1
TEE_PID=$!
say() { printf '[device-check %3ds] %s\n' $(($(date +%s) - START_S)) "$*"; }

ARGS=("$@")
has_arg() { local a; for a in "${ARGS[@]}"; do [ "$a" = "$1" ] && return 0; done; return 1; }
has_arg --device || ARGS+=(--device "${OOGC_DEVICE:-cuda:0}")
# The harness's own budget: 40 s inside the hard limit (half of it for a limit under 80 s).
has_arg --budget-s || ARGS+=(--budget-s $((LIMIT_S >= 80 ? LIMIT_S - 40 : LIMIT_S / 2)))

# env.txt: the machine, before the run (each probe bounded).
env_txt() {
  probe() { echo "## $*"; timeout 60 "$@" 2>&1 || echo "(exit $?)"; echo; }
  echo "# device-check environment, $(date -u '+%F %T UTC')"
  echo
  probe "$BIN" --version
  probe uname -a
  probe nvidia-smi
  probe nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_cap,clocks.max.sm,clocks.max.mem,pcie.link.gen.max,pcie.link.width.max --format=csv
  probe cat /proc/driver/nvidia/version
  if [ "$(basename "$BIN")" = run.sh ]; then probe "$BIN" --ldd; else probe ldd "$BIN"; fi
  probe python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
  probe nproc
  probe free -g
  probe df -h /tmp "$REPO"
  echo "## variables"
  env | grep -E '^(CUDA_|LD_LIBRARY_PATH|OOGC_|RAYON_|RUST_)' | sort
}

GPU_RC=
finish() {
  local rc=$?
  trap - EXIT INT TERM
  [ -n "$GPU_RC" ] || GPU_RC=$rc
  say "packing what exists into $OUT"
  for f in gpu-check.md gpu-check.jsonl; do
    if [ -s "$REPORTS/$f" ]; then
      head -c "$LOG_CAP" "$REPORTS/$f" >"$OUT/$f"
    else
      echo "device-check: gpu-check wrote no $f (exit $GPU_RC): see device-check.log" >"$OUT/$f"
    fi
  done
  # Check 8's GPU profile, for `oogc plan --profile` here (small; absent on the sim device).
  [ -s "$REPORTS/gpu-profile.toml" ] && head -c "$LOG_CAP" "$REPORTS/gpu-profile.toml" >"$OUT/gpu-profile.toml"
  # The tarball: reports but the two above, the scratch's text outputs (not the NVMe files, the
  # pip tree or the token cache), dist's build record.
  local stage=$DIR/pack/gpu-check-files
  mkdir -p "$stage"
  for d in logs rows traces; do [ -d "$REPORTS/$d" ] && cp -r "$REPORTS/$d" "$stage/"; done
  (cd "$WORK" && find . \( -name py -o -name nvme -o -name tokens \) -prune -o -type f \
     \( -name '*.stdout' -o -name '*.stderr' -o -name '*.log' -o -name '*.txt' -o -name '*.json' -o -name '*.jsonl' \) \
     -print0 | while IFS= read -r -d '' f; do mkdir -p "$stage/work/$(dirname "$f")"; cp "$f" "$stage/work/$f"; done)
  [ -f "$(dirname "$BIN")/BUILD.txt" ] && cp "$(dirname "$BIN")/BUILD.txt" "$stage/"
  scripts/pack-capped.sh "$OUT/gpu-check-files.tar.gz" "$TAR_CAP" "$stage" || say "error: no tarball (see above)"

  # The short summary (the tool shows the output's last 12,000 characters).
  echo
  echo "==== device-check summary: gpu-check exit $GPU_RC after $(($(date +%s) - START_S)) s ===="
  grep -m1 '^- device:' "$OUT/gpu-check.md" | cut -c1-300
  grep -m1 '^- oogc ' "$OUT/gpu-check.md" | cut -c1-300
  grep '^| [0-9]' "$OUT/gpu-check.md" | cut -c1-400
  grep -E '^[0-9]+ passed, ' "$OUT/gpu-check.md" || echo "(no summary line: gpu-check did not finish)"
  echo "reports and scratch on this machine: $DIR"

  # Close the tee (the log is complete), cap the log, check what comes back.
  exec 1>&3 2>&4
  wait "$TEE_PID" 2>/dev/null
  local bytes
  bytes=$(stat -c %s "$LOG")
  if [ "$bytes" -gt "$LOG_CAP" ]; then
    mv "$LOG" "$LOG.full"
    { head -c $((LOG_CAP / 2 - 4096)) "$LOG.full"
      printf '\n[... %d bytes cut here by device-check.sh ...]\n' $((bytes - LOG_CAP + 8192))
      tail -c $((LOG_CAP / 2 - 4096)) "$LOG.full"; } >"$LOG"
    rm -f "$LOG.full"
    echo "device-check.log: $bytes bytes, cut to its head and tail ($(stat -c %s "$LOG") bytes)"
  fi
  echo "files in \$OUT ($OUT):"
  local limits=0
  scripts/check-out-limits.sh "$OUT" gpu-check.md gpu-check.jsonl device-check.log || limits=3
  if [ "$GPU_RC" != 0 ]; then exit "$GPU_RC"; fi
  exit "$limits"
}
trap finish EXIT
trap 'say "stopped by SIGTERM"; exit 143' TERM
trap 'say "stopped by SIGINT"; exit 130' INT

say "oogc device-check: $BIN gpu-check ${ARGS[*]} (reports in $REPORTS, scratch in $WORK, hard limit ${LIMIT_S} s)"
env_txt >"$OUT/env.txt" 2>&1
say "env.txt written ($(stat -c %s "$OUT/env.txt") bytes); $(grep -m1 -A1 -- "--version" "$OUT/env.txt" | tail -1)"
# Its own process group is not needed: gpu-check kills its checks' groups on SIGTERM.
timeout --signal=TERM --kill-after=15 "$LIMIT_S" \
  "$BIN" gpu-check --out "$REPORTS" --work "$WORK" "${ARGS[@]}"
GPU_RC=$?
case "$GPU_RC" in
  0) say "gpu-check: no check failed" ;;
  124) say "gpu-check: stopped at the hard limit of $LIMIT_S s (SIGTERM)" ;;
  137) say "gpu-check: killed (SIGKILL) 15 s after the hard limit" ;;
  *) say "gpu-check: exit $GPU_RC (1: a check failed)" ;;
esac
