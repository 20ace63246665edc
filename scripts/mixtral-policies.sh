#!/bin/bash
# Runs configs/mixtral-shakespeare.toml once per [moe] policy (sequentially), each into its own
# target/runs/mixtral-shakespeare${TAG}-<policy>/ directory. A policy is `ours`, `fetch` or
# `lru`, optionally followed by `-nocpu` ([moe] cpu_compute = false) and/or `-hostopt` ([moe]
# device_optimizer = false: the hot set holds compute copies only). GPU and EXPERT_BUDGET, when
# set, replace [budgets] gpu and [moe] expert_budget for every policy alike.
set -e
cd "$(dirname "$0")/.."
BIN=${BIN:-./target/debug/oogc}
STEPS=${STEPS:-40}
TAG=${TAG:-}
for policy in ${POLICIES:-ours fetch lru}; do
  base=${policy%%-*}
  name=mixtral-shakespeare$TAG-$policy
  cfg=configs/.$name.toml
  sed -e "s|^policy = \"ours\"|policy = \"$base\"|" \
      -e "s|runs/mixtral-shakespeare/|runs/$name/|g" \
      -e "s|oogc-nvme-mixtral|oogc-nvme-$name|" configs/mixtral-shakespeare.toml > "$cfg"
  case $policy in *-nocpu*) sed -i 's|^cpu_compute = true|cpu_compute = false|' "$cfg" ;; esac
  case $policy in *-hostopt*) sed -i 's|^\[moe\]|[moe]\ndevice_optimizer = false|' "$cfg" ;; esac
  if [ -n "$GPU" ]; then sed -i "s|^gpu = .*|gpu = \"$GPU\"|" "$cfg"; fi
  if [ -n "$EXPERT_BUDGET" ]; then sed -i "s|^expert_budget = .*|expert_budget = \"$EXPERT_BUDGET\"|" "$cfg"; fi
  rm -rf target/runs/$name target/oogc-nvme-$name
  RAYON_NUM_THREADS=2 nice -n 19 "$BIN" train --config "$cfg" --steps "$STEPS" --no-progress > target/$name.log 2>&1
  rm -f "$cfg"
done
