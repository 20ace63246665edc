#!/usr/bin/env python3
"""The policy table of an MoE config's runs (scripts/moe-policies.sh) from
target/runs/${NAME}${TAG}-<policy>/metrics.jsonl (NAME defaults to mixtral-shakespeare):
means over steps 2.. (step 1 has no popularity yet), validation bits per byte at the last step,
whether the losses are bitwise the same under every policy, and else the largest relative
difference from the first policy's (device optimizers update in another f32 order)."""
import json, os, sys
policies = sys.argv[1:] or ["ours", "fetch", "lru"]
tag = os.environ.get("TAG", "")
name = os.environ.get("NAME", "mixtral-shakespeare")
rows, losses = {}, {}
for p in policies:
    recs = [json.loads(l) for l in open(f"target/runs/{name}{tag}-{p}/metrics.jsonl")]
    tail = recs[1:]
    mean = lambda k: sum(r[k] for r in tail) / len(tail)
    bpb = [r["val_bits_per_byte"] for r in recs if r.get("val_bits_per_byte") is not None]
    rows[p] = dict(expert_h2d=mean("expert_h2d_bytes"), h2d=mean("h2d_bytes"), step_s=mean("step_s"),
                   cpu_tokens=mean("cpu_tokens"), hit=mean("expert_hit_rate"), bpb=bpb[-1] if bpb else float("nan"),
                   steps=len(recs))
    losses[p] = [r["loss"] for r in recs]
f = rows.get("fetch")
# KiB for small experts (Mixtral's 96 KiB), MiB for large ones.
unit, div = ("MiB", 2**20) if max(r["h2d"] for r in rows.values()) > 64 * 2**20 else ("KiB", 1024)
print("| policy | expert bytes H2D / step | vs fetch | all H2D / step | step time (s) | vs fetch | tokens on CPU / step | hit rate | val bits/byte |")
print("|---|---|---|---|---|---|---|---|---|")
for p, r in rows.items():
    vb = f"{r['expert_h2d'] / f['expert_h2d']:.2f}×" if f else "-"
    vs = f"{f['step_s'] / r['step_s']:.2f}× faster" if f else "-"
    print(f"| {p} | {r['expert_h2d'] / div:.0f} {unit} | {vb} | {r['h2d'] / div:.0f} {unit} | {r['step_s']:.3f} | {vs} | "
          f"{r['cpu_tokens']:.0f} | {r['hit']:.3f} | {r['bpb']:.4f} |")
same = all(losses[p] == losses[policies[0]] for p in policies)
print(f"\nlosses over {len(losses[policies[0]])} steps bitwise equal under {', '.join(policies)}: {same}")
if not same:
    ref = losses[policies[0]]
    for p in policies[1:]:
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses[p], ref))
        print(f"largest relative loss difference, {p} vs {policies[0]}: {worst:.2e}")
