#!/usr/bin/env bash
# `oogc plan` for Llama-3-8B's shape (configs/llama-8b-h100.toml) and Llama-3-70B's (the same
# config at d 8192, 80 layers, 64 query heads over 8 key/value heads, SwiGLU 28672) on the GPU
# machine of this workplace (128 GiB of RAM), optimizer state in host memory, once per
# `[optimizer] state_dtype` (and int8 with `master_dtype = "bf16"`): the host ledger's minimum,
# the stated overhead and whether the two fit in 128 GiB. Fast (the plan, no training).
#
#   scripts/state-dtype-plans.sh [path/to/oogc]
set -euo pipefail
cd "$(dirname "$0")/.."
oogc="${1:-target/release/oogc}"
[[ -x "$oogc" ]] || cargo build --release --locked -q
tmp="$(mktemp -d configs/.state-dtype-plans.XXXXXX)"
trap 'rm -rf "$tmp"' EXIT
machine=$((128 << 30))
echo "| model | state_dtype, master_dtype | B/param | host ledger minimum | minimum + stated overhead | fits in 128 GiB |"
echo "|---|---|---|---|---|---|"
for model in 8b 70b; do
  for v in f32,f32 bf16,f32 int8,f32 int8,bf16; do
    d="${v%,*}"; master="${v#*,}"
    cfg="$tmp/$model-$d-$master.toml"
    sed -e 's#"\.\./#"../../#g' -e "s#^\[optimizer\]#[optimizer]\nstate_dtype = \"$d\"\nmaster_dtype = \"$master\"#" \
        -e 's/^host = .*/host = "128GiB"/' configs/llama-8b-h100.toml > "$cfg"
    if [[ $model == 70b ]]; then
      sed -i -e 's/^hidden_size = .*/hidden_size = 8192/' -e 's/^intermediate_size = .*/intermediate_size = 28672/' \
          -e 's/^num_hidden_layers = .*/num_hidden_layers = 80/' -e 's/^num_attention_heads = .*/num_attention_heads = 64/' "$cfg"
    fi
    out="$("$oogc" plan --config "$cfg" 2>&1)"
    min=$(grep -oP '^host .*\(minimum \K[0-9]+' <<<"$out")
    over=$(grep -oP '^rss .*expected \+ overhead \K[0-9]+' <<<"$out")
    bpp=$(grep -oP 'moments = \K[0-9.]+' <<<"$out")
    fits=$([[ $((min + over)) -le $machine ]] && echo yes || echo no)
    printf '| %s | %s | %s | %.1f GiB | %.1f GiB | %s |\n' "Llama ${model^^}" "$d, $master" "$bpp" \
      "$(bc -l <<<"$min / 2^30")" "$(bc -l <<<"($min + $over) / 2^30")" "$fits"
  done
done
