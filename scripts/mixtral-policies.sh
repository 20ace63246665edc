#!/bin/bash
# Runs configs/mixtral-shakespeare.toml once per [moe] policy (sequentially), each into its own
# target/runs/mixtral-shakespeare-<policy>/ directory.
set -e
cd "$(dirname "$0")/.."
BIN=${BIN:-./target/debug/oogc}
STEPS=${STEPS:-40}
for policy in ${POLICIES:-ours fetch lru}; do
  cfg=configs/.mixtral-shakespeare-$policy.toml
  sed -e "s|^policy = \"ours\"|policy = \"${policy%-nocpu}\"|" \
      -e "s|runs/mixtral-shakespeare/|runs/mixtral-shakespeare-$policy/|g" \
      -e "s|oogc-nvme-mixtral|oogc-nvme-mixtral-$policy|" configs/mixtral-shakespeare.toml > "$cfg"
  if [ "${policy%-nocpu}" != "$policy" ]; then sed -i 's|^cpu_compute = true|cpu_compute = false|' "$cfg"; fi
  rm -rf target/runs/mixtral-shakespeare-$policy target/oogc-nvme-mixtral-$policy
  RAYON_NUM_THREADS=2 nice -n 19 "$BIN" train --config "$cfg" --steps "$STEPS" --no-progress > target/mixtral-$policy.log 2>&1
  rm -f "$cfg"
done
