#!/usr/bin/env bash
# The beyond-RAM run (configs/scale-beyond-ram.toml, 2.49 B parameters, state and parameters on
# NVMe, 6 GiB host budget) saves a checkpoint, is killed with SIGKILL, and resumes bitwise:
#
#   1. reference: steps 1-4 without a checkpoint (the losses to match);
#   2. killed: steps 1-2, the checkpoint after step 2 (written in the background, unit by unit,
#      while step 3 runs), step 3, then SIGKILL during step 4; its peak RSS (VmHWM) is read just
#      before the kill, so it covers the save;
#   3. resumed: `--resume` from that checkpoint, steps 3-4: their losses must equal the
#      reference's bit for bit.
#
# Then one Markdown table (save seconds and bytes, peak RSS against the budget, the losses). The
# runs share one NVMe directory, one after another. Not in CI: about 15-25 min on 2 cores.
#
#   scripts/scale-checkpoint.sh [STATE_DTYPE MASTER_DTYPE]    # default: int8 bf16
#
# f32 state (the config's own) needs about 62 GB of free disk under target/ (a 32 GB NVMe store:
# the compute copies and m, v; and a 30 GB checkpoint); int8 moments about 30 GB (15 + 15);
# int8 moments with bf16 master weights (4.03 B per parameter) about 31 GB. OOGC=path/to/oogc uses that binary instead of building target/release/oogc.
set -euo pipefail
cd "$(dirname "$0")/.."
state="${1:-int8}"; master="${2:-bf16}"
root="$PWD"
out="$root/target/scale-checkpoint/$state-$master"
rm -rf "$out"; mkdir -p "$out"
oogc="${OOGC:-}"
if [[ -z "$oogc" ]]; then cargo build --release --locked -q; oogc="$root/target/release/oogc"; fi

# The config with absolute paths, the dtypes, its checkpoint directory and metrics per run.
config() { # name, with_checkpoint
  local f="$out/$1.toml"
  sed -e "s#\"\.\./\.\./#\"$root/../#g" -e "s#\"\.\./target/#\"$root/target/#g" \
      -e "s#^\[optimizer\]#[optimizer]\nstate_dtype = \"$state\"\nmaster_dtype = \"$master\"#" \
      -e "s#^metrics = .*#metrics = \"$out/$1.metrics.jsonl\"#" \
      -e '/^\[checkpoint\]/,/^$/d' \
      configs/scale-beyond-ram.toml > "$f"
  if [[ "$2" == 1 ]]; then printf '\n[checkpoint]\ndir = "%s/ckpt"\ninterval = 2\nkeep = 1\n' "$out" >> "$f"; fi
  echo "$f"
}
lines() { [[ -f "$1" ]] && wc -l < "$1" || echo 0; }

echo "reference: steps 1-4" >&2
"$oogc" train --config "$(config reference 0)" --steps 4 --no-progress --json > "$out/reference.json" 2> "$out/reference.log"

echo "killed: steps 1-2, a checkpoint written while step 3 runs, SIGKILL in step 4" >&2
cfg=$(config killed 1)
"$oogc" train --config "$cfg" --steps 4 --no-progress > /dev/null 2> "$out/killed.log" &
pid=$!
# Step 3's line (the save after step 2 completed by then) and not step 4's: kill in step 4.
until [[ $(lines "$out/killed.metrics.jsonl") -ge 3 ]]; do
  kill -0 "$pid" 2>/dev/null || { echo "the run ended before step 3's line" >&2; exit 1; }
  sleep 1
done
[[ -f "$out/ckpt/ckpt-00000002.safetensors" ]] || { echo "no checkpoint of step 2 after step 3" >&2; exit 1; }
sleep 20
[[ $(lines "$out/killed.metrics.jsonl") == 3 ]] || { echo "step 4 ended before the kill: rerun" >&2; exit 1; }
grep VmHWM "/proc/$pid/status" | awk '{printf "%.0f\n", $2 * 1024}' > "$out/killed.peak_rss"
kill -9 "$pid"; wait "$pid" || true
ls -l "$out/ckpt" > "$out/ckpt.ls"

echo "resumed: steps 3-4 from the checkpoint" >&2
"$oogc" train --config "$(config resumed 0)" --resume "$out/ckpt" --steps 4 --no-progress --json \
  > "$out/resumed.json" 2> "$out/resumed.log"

python3 - "$out" "$state" "$master" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1]); state, master = sys.argv[2:4]
read = lambda n: [json.loads(l) for l in (out / f"{n}.metrics.jsonl").read_text().splitlines()]
ref, killed, resumed = read("reference"), read("killed"), read("resumed")
loss = {r["step"]: r["loss"] for r in ref}
same = all(r["loss"] == loss[r["step"]] for r in resumed) and [r["step"] for r in resumed] == [3, 4]
summary = json.loads((out / "reference.json").read_text())
budget = summary["host"]["budget_bytes"]
peak = int(float((out / "killed.peak_rss").read_text()))
ckpt = next(p for p in (out / "ckpt").glob("ckpt-*.safetensors"))
# The save (in the background): its seconds from start to rename and what it held the trainer
# (step 3's line), and step 3's time beside the reference's (the step the save ran beside).
step3 = next(r for r in killed if r["step"] == 3)
save_s, held_s = step3.get("ckpt_s"), step3.get("ckpt_held_s")
cost = (step3["step_s"] + (held_s or 0)) / next(r for r in ref if r["step"] == 3)["step_s"] - 1
losses = ", ".join(f"{r['loss']:.6f}" for r in resumed)
verdict = "bitwise the reference" if same else f"DIFFERENT from {[loss[3], loss[4]]}"
print(f"| state, master | checkpoint | save (background) | held the trainer | step 3 beside it vs the reference's | peak RSS through the save | budget | resumed losses (steps 3, 4) |")
print("|---|---|---|---|---|---|---|---|")
save = f"{save_s:.0f} s" if save_s is not None else "not done by step 3's end"
print(f"| {state}, {master} | {ckpt.stat().st_size / 1e9:.2f} GB | {save} | {held_s:.2f} s | {cost:+.1%} | {peak / 2**30:.2f} GiB | {budget / 2**30:.0f} GiB | {losses}: {verdict} |")
print("step times (reference):", [round(r["step_s"], 1) for r in ref])
print("step times (resumed):", [round(r["step_s"], 1) for r in resumed])
sys.exit(0 if same else 1)
PY
