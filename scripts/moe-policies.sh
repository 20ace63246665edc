#!/bin/bash
# Runs an MoE config (configs/$NAME.toml; NAME defaults to mixtral-shakespeare, also
# qwen3-moe-shakespeare) once per [moe] policy (sequentially), each into its own
# target/runs/$NAME${TAG}-<policy>/ directory with its own NVMe directory. A policy is `ours`,
# `fetch` or `lru`, optionally followed by `-nocpu` ([moe] cpu_compute = false), `-cpu`
# (cpu_compute = true) and/or `-hostopt` ([moe] device_optimizer = false: the hot set holds
# compute copies only). GPU and EXPERT_BUDGET, when set, replace [budgets] gpu and [moe]
# expert_budget for every policy alike. scripts/moe-table.py makes the table of the runs.
set -e
cd "$(dirname "$0")/.."
BIN=${BIN:-./target/debug/oogc}
STEPS=${STEPS:-40}
TAG=${TAG:-}
NAME=${NAME:-mixtral-shakespeare}
src=configs/$NAME.toml
nvme=$(sed -n 's|^nvme_dirs = \["\.\./target/\([^"]*\)"\]|\1|p' "$src")
for policy in ${POLICIES:-ours fetch lru}; do
  base=${policy%%-*}
  name=$NAME$TAG-$policy
  cfg=configs/.$name.toml
  sed -e "s|^policy = \"ours\"|policy = \"$base\"|" \
      -e "s|runs/$NAME/|runs/$name/|g" \
      -e "s|\.\./target/$nvme\"|../target/oogc-nvme-$name\"|" "$src" > "$cfg"
  case $policy in *-nocpu*) sed -i 's|^cpu_compute = true|cpu_compute = false|' "$cfg" ;; esac
  case $policy in *-cpu*) sed -i 's|^cpu_compute = false|cpu_compute = true|' "$cfg" ;; esac
  case $policy in *-hostopt*) sed -i 's|^\[moe\]|[moe]\ndevice_optimizer = false|' "$cfg" ;; esac
  if [ -n "$GPU" ]; then sed -i "s|^gpu = .*|gpu = \"$GPU\"|" "$cfg"; fi
  if [ -n "$EXPERT_BUDGET" ]; then sed -i "s|^expert_budget = .*|expert_budget = \"$EXPERT_BUDGET\"|" "$cfg"; fi
  rm -rf target/runs/$name target/oogc-nvme-$name
  RAYON_NUM_THREADS=2 nice -n 19 "$BIN" train --config "$cfg" --steps "$STEPS" --no-progress > target/$name.log 2>&1
  rm -f "$cfg" && rm -rf target/oogc-nvme-$name
done
