#!/usr/bin/env bash
# The CPU compute path against PyTorch on the same machine, one run after the other: the main
# job's Llama (configs/llama-shakespeare.toml: 0.99 M parameters, batch 16 x 128) trained for N
# steps by
#   oogc offloaded  - the main config as it is (sim device, GPU budget 1900 KiB, state on NVMe);
#   oogc resident   - the same with a 256 MiB GPU budget and the optimizer state in host memory;
#   pytorch         - transformers' LlamaForCausalLM of the same shape, AdamW(fused=True),
#                     clipping, resident, without and with activation recompute per layer
#                     (scripts/torch_llama_cpu.py);
# then prints tokens/s and the ratios the CPU-speed issue asks for (oogc resident / PyTorch with
# recompute, oogc offloaded / oogc resident). oogc's figure is `oogc train --json`'s tokens_per_s
# (every step, the first, schedule-recording one included); PyTorch's skips 2 warm-up steps.
#
#   scripts/bench-cpu-vs-torch.sh [STEPS] [--json]     # default 80 steps; 2 threads each
#   OOGC_BIN=/path/to/oogc scripts/bench-cpu-vs-torch.sh  # another build of oogc (before/after)
#
# Needs a release build (`cargo build --release --bin oogc`), ../shared beside the checkout, and
# the project's Python environment with torch and transformers (`scripts/python-tests.sh` makes
# target/python-venv; OOGC_PY_VENV=DIR for another).
set -euo pipefail
cd "$(dirname "$0")/.."
steps=80
json=0
for arg in "$@"; do
  case $arg in
    --json) json=1 ;;
    *) steps=$arg ;;
  esac
done
threads=2
export RAYON_NUM_THREADS=$threads OMP_NUM_THREADS=$threads
oogc=${OOGC_BIN:-target/release/oogc}
python=${OOGC_PY_VENV:-target/python-venv}/bin/python
[ -x "$oogc" ] || { echo "bench-cpu-vs-torch: build $oogc first: cargo build --release --bin oogc" >&2; exit 1; }
"$python" -c 'import torch, transformers' 2>/dev/null ||
  { echo "bench-cpu-vs-torch: $python lacks torch or transformers: run scripts/python-tests.sh (makes target/python-venv)" >&2; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/oogc-cpu-bench.XXXXXX")
trap 'rm -rf "$work"' EXIT
shared=$(cd .. && pwd)/shared
# The main config with absolute paths, its own scratch directories, no checkpoints or metrics.
sed -e "s|\"\.\./\.\./shared/|\"$shared/|" -e "s|\"\.\./target/oogc-tokens\"|\"$work/tokens\"|" \
    -e "s|\"\.\./target/oogc-nvme-llama\"|\"$work/nvme\"|" -e '/^dir = /d' -e '/^metrics = /d' \
    configs/llama-shakespeare.toml > "$work/offloaded.toml"
mkdir -p "$work/nvme"
sed -e 's|^gpu = .*|gpu = "256MiB"|' -e 's|^optimizer_state = .*|optimizer_state = "host"|' -e '/^nvme_dirs = /d' \
    "$work/offloaded.toml" > "$work/resident.toml"

oogc_run() { "$oogc" train --config "$work/$1.toml" --steps "$steps" --no-progress --json 2>/dev/null | tail -1; }
torch_run() {
  "$python" scripts/torch_llama_cpu.py --hidden 128 --intermediate 344 --layers 4 --heads 4 --kv-heads 2 \
    --vocab 1024 --batch 16 --seq 128 --steps "$steps" --threads "$threads" "$@" 2>/dev/null | tail -1
}
off=$(oogc_run offloaded)
res=$(oogc_run resident)
pt=$(torch_run)
ptr=$(torch_run --recompute)

"$python" - "$off" "$res" "$pt" "$ptr" "$steps" "$json" <<'PY'
import json, sys
off, res, pt, ptr = (json.loads(x) for x in sys.argv[1:5])
steps, as_json = int(sys.argv[5]), sys.argv[6] == "1"
t = {"oogc_offloaded": off["tokens_per_s"], "oogc_resident": res["tokens_per_s"],
     "pytorch_resident": pt["tokens_per_s"], "pytorch_resident_recompute": ptr["tokens_per_s"]}
ratios = {"oogc_resident_vs_pytorch_recompute": t["oogc_resident"] / t["pytorch_resident_recompute"],
          "oogc_offloaded_vs_oogc_resident": t["oogc_offloaded"] / t["oogc_resident"],
          "oogc_resident_vs_pytorch": t["oogc_resident"] / t["pytorch_resident"]}
if as_json:
    print(json.dumps({"steps": steps, "tokens_per_s": t, "ratios": ratios, "torch": pt["torch"],
                      "params": {"oogc": off["params"], "pytorch": pt["params"]}}))
else:
    print(f"{steps} steps of 16 x 128 tokens, {off['params']:,} parameters (PyTorch's model: {pt['params']:,}); torch {pt['torch']}")
    print("| run | tokens/s |\n|---|---|")
    for k, v in t.items():
        print(f"| {k} | {v:,.0f} |")
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")
PY
