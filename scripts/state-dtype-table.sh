#!/usr/bin/env bash
# The main job (configs/llama-shakespeare.toml, 1,200 steps) once per `[optimizer] state_dtype`
# (f32, bf16, int8; a name ending in `+bf16-master` adds `master_dtype = "bf16"`, e.g.
# `f32+bf16-master`), each in its own NVMe, checkpoint and metrics directories under
# target/state-dtype/, then one Markdown table of the final validation loss and bits per byte,
# each against f32's, with the NVMe bytes per step and the wall time. Not in CI: 10–30 min on
# a 2-core machine (three main jobs, one after another).
#
#   scripts/state-dtype-table.sh [--report] [--steps N] [DTYPE ...]    # --report: the table of runs done     # default: f32 bf16 int8 f32+bf16-master int8+bf16-master
#
# OOGC=path/to/oogc uses that binary instead of building target/release/oogc.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=""; report=""
if [[ "${1:-}" == "--report" ]]; then report=1; shift; fi
if [[ "${1:-}" == "--steps" ]]; then steps="$2"; shift 2; fi
dtypes=("$@"); [[ ${#dtypes[@]} -gt 0 ]] || dtypes=(f32 bf16 int8 f32+bf16-master int8+bf16-master)
root="$PWD"
out="$root/target/state-dtype"
mkdir -p "$out"
oogc="${OOGC:-}"
[[ -n "$report" ]] && dtypes_to_run=() || dtypes_to_run=("${dtypes[@]}")
if [[ -z "$oogc" && -z "$report" ]]; then cargo build --release --locked -q; oogc="$root/target/release/oogc"; fi
for d in "${dtypes_to_run[@]}"; do
  dir="$out/$d"
  rm -rf "$dir"; mkdir -p "$dir"
  moments="${d%+bf16-master}"; master=f32; [[ "$d" == *+bf16-master ]] && master=bf16
  # The main job's config with absolute paths, its own directories and the state dtype.
  sed -e "s#\"\.\./\.\./#\"$root/../#g" -e "s#\"\.\./target/oogc-nvme-llama\"#\"$dir/nvme\"#" \
      -e "s#\"\.\./target/runs/llama-shakespeare/#\"$dir/#" -e "s#\"\.\./target/#\"$root/target/#g" \
      -e "s#^\[optimizer\]#[optimizer]\nstate_dtype = \"$moments\"\nmaster_dtype = \"$master\"#" \
      configs/llama-shakespeare.toml > "$dir/config.toml"
  [[ -z "$steps" ]] || sed -i "s/^steps = .*/steps = $steps/" "$dir/config.toml"
  start=$(date +%s.%N)
  "$oogc" train --config "$dir/config.toml" --no-progress --json > "$dir/summary.json" 2> "$dir/stderr.log"
  end=$(date +%s.%N)
  echo "$end - $start" | bc > "$dir/wall_s"
  echo "$d: $(cat "$dir/wall_s") s" >&2
done
python3 - "$out" "${dtypes[@]}" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1]); dtypes = sys.argv[2:]
rows = {}
for d in dtypes:
    s = json.loads((out / d / "summary.json").read_text())
    rows[d] = (s, float((out / d / "wall_s").read_text()))
base = rows.get("f32", (None,))[0]
print("| state_dtype (master) | B/param (master + m + v) | final val loss | vs f32 | bits/byte | NVMe read/step | wall |")
print("|---|---|---|---|---|---|---|")
bpp = {"f32": "12", "bf16": "8", "int8": "6.03", "f32+bf16-master": "10", "bf16+bf16-master": "6", "int8+bf16-master": "4.03"}
for d in dtypes:
    s, wall = rows[d]
    vl = s["final_val_loss"]
    rel = f"{(vl / base['final_val_loss'] - 1) * 100:+.2f} %" if base else "—"
    steps = s["last_step"] - s["first_step"] + 1
    nv = s["nvme_read_bytes"] / steps
    print(f"| {d} | {bpp[d]} | {vl:.4f} | {rel} | {s['final_val_bits_per_byte']:.4f} | {nv:,.0f} | {wall:.0f} s |")
PY
