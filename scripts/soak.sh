#!/usr/bin/env bash
# The fault-injection soak, longer than CI's (cli/tests/soak.rs): kill `oogc train` KILLS times
# (SIGKILL at random moments, inside checkpoint writes and NVMe writes; aborts; SIGTERM stops),
# resume each time, and require the uninterrupted run's losses and parameters bit for bit.
#   scripts/soak.sh [KILLS=200] [SEED=17]
set -euo pipefail
cd "$(dirname "$0")/.."
export RAYON_NUM_THREADS="${RAYON_NUM_THREADS:-2}"
OOGC_SOAK_KILLS="${1:-200}" OOGC_SOAK_SEED="${2:-17}" \
  cargo test --release -p oogc-cli --test soak -- --nocapture
